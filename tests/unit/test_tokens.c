/* test_tokens.c: the bearer tokens file: what is accepted, what is refused
 * and why, and that a check finds the right name and only it. */
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/tokens.h"
#include "common/util.h"
#include "test.h"

static char path[64];

static void write_file(const char *text, mode_t mode) {
  snprintf(path, sizeof path, "/tmp/ign-tokens-test.%d", getpid());
  unlink(path);
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text))
    abort();
  fchmod(fd, mode);
  close(fd);
}

static struct tokens *load(const char *text, mode_t mode, char **err, char **warn) {
  write_file(text, mode);
  struct tokens *t = NULL;
  int r = tokens_load(path, &t, warn, err);
  unlink(path);
  CHECK(r == 0 ? t != NULL : t == NULL);
  return t;
}

static void finds_the_name_of_each_token(void) {
  char *err = NULL, *warn = NULL;
  struct tokens *t = load("# comment\n\nalice:0123456789abcdef0123\r\nbob.ci-1:"
                          "ZZZZZZZZZZZZZZZZZZZZ\n",
                          0600, &err, &warn);
  CHECK(t != NULL && err == NULL && warn == NULL);
  CHECK_EQ_INT(tokens_count(t), 2);
  CHECK_STREQ(tokens_check(t, "0123456789abcdef0123", 20), "alice");
  CHECK_STREQ(tokens_check(t, "ZZZZZZZZZZZZZZZZZZZZ", 20), "bob.ci-1");
  CHECK(tokens_check(t, "0123456789abcdef012", 19) == NULL);   /* a prefix */
  CHECK(tokens_check(t, "0123456789abcdef01234", 21) == NULL); /* longer */
  CHECK(tokens_check(t, "", 0) == NULL);
  CHECK(tokens_check(NULL, "0123456789abcdef0123", 20) == NULL);
  tokens_free(t);
  free(err);
  free(warn);
}

static void refuses_bad_files_saying_which_line(void) {
  static const struct {
    const char *text, *why;
  } cases[] = {
      {"alice\n", "line 1: it is not name:token"},
      {"# c\nali ce:0123456789abcdef0123\n", "line 2: the name must be"},
      {":0123456789abcdef0123\n", "line 1: the name must be"},
      {"alice:short\n", "line 1: the token is shorter than 16"},
      {"alice:0123456789abc def0123\n", "line 1: the token has a space"},
      {"alice:0123456789abcdef0123\nalice:1123456789abcdef0123\n", "line 2: this name is already"},
      {"alice:0123456789abcdef0123\nbob:0123456789abcdef0123\n", "line 2: this token is already"},
      {"# nothing\n\n", "has no name:token line"},
  };
  for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
    char *err = NULL, *warn = NULL;
    struct tokens *t = load(cases[i].text, 0600, &err, &warn);
    CHECK(t == NULL);
    CHECK(err && strstr(err, cases[i].why));
    /* The message never quotes the token. */
    CHECK(err && !strstr(err, "0123456789abcdef0123"));
    if (!err || !strstr(err, cases[i].why))
      fprintf(stderr, "  case %zu: %s\n", i, err ? err : "(no error)");
    free(err);
    free(warn);
  }
}

static void file_modes(void) {
  char *err = NULL, *warn = NULL;
  struct tokens *t = load("alice:0123456789abcdef0123\n", 0620, &err, &warn);
  CHECK(t == NULL && err && strstr(err, "writable by others"));
  free(err);
  free(warn);
  err = warn = NULL;
  t = load("alice:0123456789abcdef0123\n", 0644, &err, &warn);
  CHECK(t != NULL && warn && strstr(warn, "readable by others"));
  tokens_free(t);
  free(err);
  free(warn);
  err = warn = NULL;
  CHECK(tokens_load("/nonexistent/tokens", &t, &warn, &err) < 0 && err &&
        strstr(err, "cannot open"));
  free(err);
  free(warn);
  err = warn = NULL;
  /* A symbolic link is not followed. */
  write_file("alice:0123456789abcdef0123\n", 0600);
  char link[80];
  snprintf(link, sizeof link, "%s.link", path);
  unlink(link);
  CHECK(symlink(path, link) == 0);
  CHECK(tokens_load(link, &t, &warn, &err) < 0 && err && strstr(err, "symbolic link"));
  unlink(link);
  unlink(path);
  free(err);
  free(warn);
}

TEST_MAIN(TEST(finds_the_name_of_each_token), TEST(refuses_bad_files_saying_which_line),
          TEST(file_modes))
