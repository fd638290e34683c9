/* tokens.c: the HTTP transport's bearer tokens: loaded once, kept as
 * SHA-256 hashes, checked in constant time.
 *
 * Hashing first means the comparison is over fixed-size digests whatever
 * the length of the token presented, and a core dump or a stray read of the
 * server's memory does not give the tokens away.  Every entry is compared on
 * every check (no early exit), so the time does not say which entry, if any,
 * matched. */
#include "common/tokens.h"

#include <errno.h>
#include <fcntl.h>
#include <nettle/memops.h>
#include <nettle/sha2.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

#define NAME_MAX_LEN 64
#define TOKEN_MIN 16
#define TOKEN_MAX 4096
#define ENTRIES_MAX 1024
/* The file is read whole; no honest tokens file comes near this. */
#define FILE_MAX (1u << 20)

struct token_entry {
  char name[NAME_MAX_LEN + 1];
  uint8_t hash[SHA256_DIGEST_SIZE];
};

struct tokens {
  size_t n;
  struct token_entry e[];
};

static void hash(const char *s, size_t len, uint8_t out[SHA256_DIGEST_SIZE]) {
  struct sha256_ctx c;
  sha256_init(&c);
  sha256_update(&c, len, (const uint8_t *)s);
  sha256_digest(&c, SHA256_DIGEST_SIZE, out);
}

static bool valid_name(const char *s, size_t len) {
  if (len == 0 || len > NAME_MAX_LEN)
    return false;
  for (size_t i = 0; i < len; i++) {
    char c = s[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
          c == '_' || c == '.' || c == '-'))
      return false;
  }
  return true;
}

/* A token is visible ASCII: it travels in an HTTP header as is. */
static bool valid_token(const char *s, size_t len) {
  for (size_t i = 0; i < len; i++)
    if ((unsigned char)s[i] <= 0x20 || (unsigned char)s[i] >= 0x7f)
      return false;
  return true;
}

static int read_file(const char *path, char **ret, size_t *ret_len, char **ret_warn,
                     char **ret_err) {
  _cleanup_close_ int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    *ret_err = xasprintf("cannot open the tokens file %s: %s%s", path, strerror(errno),
                         errno == ELOOP ? " (it is a symbolic link; name the file itself)" : "");
    return -1;
  }
  struct stat st;
  if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
    *ret_err = xasprintf("the tokens file %s is not a regular file", path);
    return -1;
  }
  if (st.st_uid != geteuid()) {
    *ret_err = xasprintf("the tokens file %s belongs to uid %u, not to the user the server runs "
                         "as (uid %u): chown it, or use a file of your own",
                         path, (unsigned)st.st_uid, (unsigned)geteuid());
    return -1;
  }
  if (st.st_mode & 022) {
    *ret_err = xasprintf("the tokens file %s is writable by others (mode %04o): anyone who can "
                         "write it can let themselves in; chmod 600 %s",
                         path, (unsigned)(st.st_mode & 07777), path);
    return -1;
  }
  if (st.st_mode & 044)
    *ret_warn = xasprintf("the tokens file %s is readable by others (mode %04o); chmod 600 %s",
                          path, (unsigned)(st.st_mode & 07777), path);
  if (st.st_size > FILE_MAX) {
    *ret_err = xasprintf("the tokens file %s is %lld bytes, over the %u accepted", path,
                         (long long)st.st_size, FILE_MAX);
    return -1;
  }
  _cleanup_free_ char *buf = malloc((size_t)st.st_size + 1);
  if (!buf) {
    *ret_err = xasprintf("out of memory reading the tokens file");
    return -1;
  }
  size_t len = 0;
  while (len < (size_t)st.st_size) {
    ssize_t n = read(fd, buf + len, (size_t)st.st_size - len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      break;
    len += (size_t)n;
  }
  buf[len] = '\0';
  *ret = steal_ptr(buf);
  *ret_len = len;
  return 0;
}

int tokens_load(const char *path, struct tokens **ret, char **ret_warn, char **ret_err) {
  *ret = NULL;
  *ret_warn = NULL;
  *ret_err = NULL;
  _cleanup_free_ char *buf = NULL;
  size_t len;
  if (read_file(path, &buf, &len, ret_warn, ret_err) < 0)
    return -1;
  struct tokens *t = calloc(1, sizeof *t + ENTRIES_MAX * sizeof(struct token_entry));
  if (!t) {
    *ret_err = xasprintf("out of memory reading the tokens file");
    return -1;
  }
  unsigned lineno = 0;
  for (char *line = buf; line < buf + len;) {
    char *nl = memchr(line, '\n', (size_t)(buf + len - line));
    char *end = nl ? nl : buf + len;
    lineno++;
    size_t n = (size_t)(end - line);
    if (n > 0 && line[n - 1] == '\r')
      n--;
    const char *why = NULL;
    if (n == 0 || line[0] == '#') {
      line = end + 1;
      continue;
    }
    char *colon = memchr(line, ':', n);
    size_t name_len = colon ? (size_t)(colon - line) : 0;
    size_t tok_len = colon ? n - name_len - 1 : 0;
    if (!colon)
      why = "it is not name:token";
    else if (!valid_name(line, name_len))
      why = "the name must be 1 to 64 of A-Z a-z 0-9 _ . -";
    else if (tok_len < TOKEN_MIN)
      why = "the token is shorter than 16 characters (make one with: openssl rand -hex 32)";
    else if (tok_len > TOKEN_MAX)
      why = "the token is longer than 4096 characters";
    else if (!valid_token(colon + 1, tok_len))
      why = "the token has a space or a control or non-ASCII character";
    else if (t->n == ENTRIES_MAX)
      why = "more than 1024 tokens";
    if (!why) {
      struct token_entry *e = &t->e[t->n];
      memcpy(e->name, line, name_len);
      e->name[name_len] = '\0';
      hash(colon + 1, tok_len, e->hash);
      for (size_t i = 0; i < t->n && !why; i++) {
        if (strcmp(t->e[i].name, e->name) == 0)
          why = "this name is already used by an earlier line";
        else if (memcmp(t->e[i].hash, e->hash, SHA256_DIGEST_SIZE) == 0)
          why = "this token is already used by an earlier line (each name needs its own)";
      }
      if (!why)
        t->n++;
    }
    if (why) {
      /* The line itself is not quoted: it holds a token. */
      *ret_err = xasprintf("the tokens file %s, line %u: %s", path, lineno, why);
      explicit_bzero(buf, len);
      tokens_free(t);
      return -1;
    }
    line = end + 1;
  }
  explicit_bzero(buf, len);
  if (t->n == 0) {
    *ret_err = xasprintf("the tokens file %s has no name:token line", path);
    tokens_free(t);
    return -1;
  }
  *ret = t;
  return 0;
}

void tokens_free(struct tokens *t) {
  if (!t)
    return;
  explicit_bzero(t->e, t->n * sizeof t->e[0]);
  free(t);
}

size_t tokens_count(const struct tokens *t) { return t ? t->n : 0; }

const char *tokens_check(const struct tokens *t, const char *token, size_t len) {
  if (!t || len > TOKEN_MAX)
    return NULL;
  uint8_t h[SHA256_DIGEST_SIZE];
  hash(token, len, h);
  const char *found = NULL;
  for (size_t i = 0; i < t->n; i++) {
    /* memeql_sec takes the same time whether or not the digests match; the
     * loop goes on after a match. */
    int eq = memeql_sec(h, t->e[i].hash, SHA256_DIGEST_SIZE);
    found = eq ? t->e[i].name : found;
  }
  return found;
}
