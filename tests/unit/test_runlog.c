/* test_runlog.c: the complete logs of runs (common/runlog.c): bytes land
 * whole and in order, the cap marker, the drop marker when the writer
 * stalls, the modes of the directory and the files, a refused directory,
 * pruning by size and age that leaves open logs alone, and write errors
 * reported in the result. */
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fs.h"
#include "common/runlog.h"
#include "common/util.h"
#include "tests/unit/test.h"

void runlog_test_hold_writer(bool hold);
void runlog_test_prune(void);

static char base[64];

static char *tmpdir(const char *name) {
  if (!base[0]) {
    if (!test_mkdtemp(base, sizeof base, "test_runlog"))
      abort();
  }
  return xasprintf("%s/%s", base, name);
}

static char *slurp(const char *path, size_t *ret_len) {
  FILE *f = fopen(path, "rb");
  if (!f)
    return NULL;
  size_t cap = 1 << 16, len = 0;
  char *b = malloc(cap);
  size_t n;
  while ((n = fread(b + len, 1, cap - len, f)) > 0) {
    len += n;
    if (len == cap)
      b = realloc(b, cap *= 2);
  }
  fclose(f);
  *ret_len = len;
  return b;
}

static const char *jstr(json_t *o, const char *k) { return json_string_value(json_object_get(o, k)); }

static void test_bytes_whole_and_modes(void) {
  _cleanup_free_ char *dir = tmpdir("a/b/logs");
  char *err = NULL;
  CHECK_EQ_INT(runlog_init(dir, 1 << 20, 0, 0, &err), 0);
  free(err);
  struct stat st;
  CHECK(stat(dir, &st) < 0); /* nothing on disk before the first log */
  struct runlog *logs[2];
  err = NULL;
  CHECK_EQ_INT(runlog_open_run("s1", logs, &err), 0);
  CHECK(logs[0] && logs[1]);
  char buf[1000];
  for (int i = 0; i < 300; i++) {
    memset(buf, 'a' + i % 26, sizeof buf);
    runlog_tap(logs, 1, buf, sizeof buf);
    runlog_tap(logs, 2, "e", 1);
  }
  json_t *res = json_object();
  runlog_close_run(logs, NULL, res);
  const char *out = jstr(res, "stdout_log_path"), *errp = jstr(res, "stderr_log_path");
  CHECK(out && errp);
  CHECK(!json_object_get(res, "log_error"));
  size_t len = 0;
  _cleanup_free_ char *got = out ? slurp(out, &len) : NULL;
  CHECK_EQ_INT(len, 300000);
  bool same = got != NULL;
  for (size_t i = 0; same && i < len; i++)
    same = got[i] == 'a' + (char)((i / 1000) % 26);
  CHECK(same);
  CHECK(stat(out, &st) == 0 && (st.st_mode & 07777) == 0600);
  CHECK(stat(errp, &st) == 0 && st.st_size == 300 && (st.st_mode & 07777) == 0600);
  CHECK(stat(dir, &st) == 0 && (st.st_mode & 07777) == 0700);
  _cleanup_free_ char *parent = tmpdir("a/b");
  CHECK(stat(parent, &st) == 0 && (st.st_mode & 07777) == 0700);
  CHECK(strstr(out, "/s1-") != NULL);
  json_decref(res);
  runlog_shutdown();
}

static void test_cap_marker(void) {
  _cleanup_free_ char *dir = tmpdir("cap");
  char *err = NULL;
  CHECK_EQ_INT(runlog_init(dir, 100, 0, 0, &err), 0);
  struct runlog *logs[2];
  CHECK_EQ_INT(runlog_open_run("s2", logs, &err), 0);
  char buf[64];
  memset(buf, 'x', sizeof buf);
  for (int i = 0; i < 4; i++)
    runlog_tap(logs, 1, buf, sizeof buf);
  runlog_tap(logs, 2, "short", 5);
  json_t *res = json_object();
  runlog_close_run(logs, NULL, res);
  size_t len = 0;
  _cleanup_free_ char *got = slurp(jstr(res, "stdout_log_path"), &len);
  const char *marker = "\n[ignition-mcp: log cut at 100 bytes; the run wrote 256]\n";
  CHECK_EQ_INT(len, 100 + strlen(marker));
  CHECK(got && memcmp(got + 100, marker, strlen(marker)) == 0);
  _cleanup_free_ char *e = slurp(jstr(res, "stderr_log_path"), &len);
  CHECK(e && len == 5 && memcmp(e, "short", 5) == 0);
  CHECK(!json_object_get(res, "log_error")); /* the cap is not an error */
  json_decref(res);
  runlog_shutdown();
}

static void test_drop_marker_when_the_writer_stalls(void) {
  _cleanup_free_ char *dir = tmpdir("drop");
  char *err = NULL;
  CHECK_EQ_INT(runlog_init(dir, 1ull << 30, 0, 0, &err), 0);
  struct runlog *logs[2];
  CHECK_EQ_INT(runlog_open_run("s3", logs, &err), 0);
  runlog_test_hold_writer(true);
  size_t n = 64 << 10;
  char *buf = malloc(n);
  memset(buf, 'y', n);
  uint64_t t0 = mono_ms();
  /* 64 MiB into a queue of 32 MiB per log that nothing drains: never blocks. */
  for (int i = 0; i < 1024; i++)
    runlog_tap(logs, 1, buf, n);
  CHECK(mono_ms() - t0 < 5000);
  runlog_test_hold_writer(false);
  for (int i = 0; i < 100; i++) /* let the writer make room */
    usleep(20000);
  runlog_tap(logs, 1, "tail", 4); /* room again: the marker, then this */
  json_t *res = json_object();
  runlog_close_run(logs, NULL, res);
  const char *le = jstr(res, "log_error");
  CHECK(le && strstr(le, "stdout log is incomplete") && strstr(le, "dropped"));
  size_t len = 0;
  _cleanup_free_ char *got = slurp(jstr(res, "stdout_log_path"), &len);
  CHECK(got && len > (32u << 20) - n && len < (33u << 20));
  CHECK(got && memmem(got, len, "bytes dropped here: the log writer fell behind]\ntail", 51));
  json_decref(res);
  free(buf);
  runlog_shutdown();
}

static void test_refused_dirs(void) {
  _cleanup_free_ char *real = tmpdir("real");
  _cleanup_free_ char *link = tmpdir("link");
  _cleanup_free_ char *open_dir = tmpdir("open");
  CHECK(mkdir(real, 0700) == 0 && symlink(real, link) == 0 && mkdir(open_dir, 0700) == 0 &&
        chmod(open_dir, 0777) == 0);
  char *err = NULL;
  CHECK(runlog_init(link, 1 << 20, 0, 0, &err) < 0);
  CHECK(err && strstr(err, "symbolic link"));
  free(err);
  err = NULL;
  struct runlog *logs[2];
  CHECK(runlog_open_run("s4", logs, &err) < 0 && !logs[0] && !logs[1]);
  json_t *res = json_object();
  runlog_close_run(logs, err, res);
  CHECK(json_is_null(json_object_get(res, "stdout_log_path")));
  CHECK(jstr(res, "log_error") && strstr(jstr(res, "log_error"), "symbolic link"));
  json_decref(res);
  free(err);
  runlog_shutdown();

  err = NULL;
  CHECK(runlog_init(open_dir, 1 << 20, 0, 0, &err) < 0);
  CHECK(err && strstr(err, "writable by group or others"));
  free(err);
  runlog_shutdown();

  /* Owned by someone else. */
  if (geteuid() == 0) {
    _cleanup_free_ char *other = tmpdir("other");
    CHECK(mkdir(other, 0700) == 0 && chown(other, 12345, 12345) == 0);
    err = NULL;
    CHECK(runlog_init(other, 1 << 20, 0, 0, &err) < 0);
    CHECK(err && strstr(err, "must belong to uid 0"));
    free(err);
    runlog_shutdown();
  }

  /* IGN_MCP_LOG_CAP=0: no logs, and no error either. */
  _cleanup_free_ char *off = tmpdir("off");
  err = NULL;
  CHECK_EQ_INT(runlog_init(off, 0, 0, 0, &err), 0);
  CHECK_EQ_INT(runlog_open_run("s5", logs, &err), 0);
  runlog_tap(logs, 1, "x", 1);
  res = json_object();
  runlog_close_run(logs, NULL, res);
  CHECK(json_is_null(json_object_get(res, "stdout_log_path")) && !json_object_get(res, "log_error"));
  struct stat st;
  CHECK(stat(off, &st) < 0);
  json_decref(res);
  runlog_shutdown();
}

static void make_file(const char *dir, const char *name, size_t size, time_t age_s) {
  _cleanup_free_ char *p = xasprintf("%s/%s", dir, name);
  int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || ftruncate(fd, (off_t)size) < 0)
    abort();
  struct timespec t[2] = {{time(NULL) - age_s, 0}, {time(NULL) - age_s, 0}};
  futimens(fd, t);
  close(fd);
}

static bool exists(const char *dir, const char *name) {
  _cleanup_free_ char *p = xasprintf("%s/%s", dir, name);
  return access(p, F_OK) == 0;
}

static void test_prune_by_size_and_age(void) {
  _cleanup_free_ char *dir = tmpdir("prune");
  CHECK(mkdir(dir, 0700) == 0);
  /* Oldest first: e.stdout is 9 days old, a..d from 5 hours to 2 hours. */
  make_file(dir, "e-1.stdout", 10, 9 * 86400);
  make_file(dir, "a-1.stdout", 400 << 10, 5 * 3600);
  make_file(dir, "b-1.stderr", 400 << 10, 4 * 3600);
  make_file(dir, "c-1.stdout", 400 << 10, 3 * 3600);
  make_file(dir, "d-1.stdout", 400 << 10, 2 * 3600);
  make_file(dir, "notes.txt", 5 << 20, 30 * 86400); /* not a log: never touched */
  /* a-1.stdout is held open by someone (another server): it stays. */
  _cleanup_free_ char *held = xasprintf("%s/a-1.stdout", dir);
  _cleanup_close_ int hfd = open(held, O_RDONLY | O_CLOEXEC);
  CHECK(hfd >= 0 && flock(hfd, LOCK_EX) == 0);
  char *err = NULL;
  CHECK_EQ_INT(runlog_init(dir, 1 << 20, 1 << 20, 7, &err), 0);
  /* And one of ours, open while pruning: its run is still going. */
  struct runlog *logs[2];
  CHECK_EQ_INT(runlog_open_run("live", logs, &err), 0);
  runlog_tap(logs, 1, "running", 7);
  runlog_test_prune();
  CHECK(!exists(dir, "e-1.stdout"));  /* too old */
  CHECK(exists(dir, "a-1.stdout"));   /* open elsewhere */
  CHECK(!exists(dir, "b-1.stderr"));  /* the oldest, over 1 MiB in all */
  CHECK(!exists(dir, "c-1.stdout"));
  CHECK(exists(dir, "d-1.stdout"));   /* a + d + the live ones fit again */
  CHECK(exists(dir, "notes.txt"));
  CHECK(exists(dir, "live-1.stdout") && exists(dir, "live-1.stderr"));
  json_t *res = json_object();
  runlog_close_run(logs, NULL, res);
  json_decref(res);
  close(hfd);
  hfd = -1;
  /* Released: the oldest goes when a new one brings the total over. */
  make_file(dir, "f-1.stdout", 400 << 10, 60);
  runlog_test_prune();
  CHECK(!exists(dir, "a-1.stdout"));
  CHECK(exists(dir, "d-1.stdout") && exists(dir, "f-1.stdout"));
  runlog_shutdown();

  /* A limit nothing fits: every closed log goes, the open one stays. */
  err = NULL;
  CHECK_EQ_INT(runlog_init(dir, 1 << 20, 1, 0, &err), 0);
  CHECK_EQ_INT(runlog_open_run("live", logs, &err), 0);
  runlog_tap(logs, 1, "running", 7);
  runlog_test_prune();
  CHECK(!exists(dir, "d-1.stdout") && !exists(dir, "f-1.stdout") && !exists(dir, "live-1.stdout"));
  CHECK(exists(dir, "live-2.stdout") && exists(dir, "live-2.stderr"));
  res = json_object();
  runlog_close_run(logs, NULL, res);
  size_t len = 0;
  _cleanup_free_ char *got = slurp(jstr(res, "stdout_log_path"), &len);
  CHECK(got && len == 7 && memcmp(got, "running", 7) == 0);
  json_decref(res);
  runlog_shutdown();
}

static void test_write_error_reported(void) {
  _cleanup_free_ char *dir = tmpdir("full");
  CHECK(mkdir(dir, 0700) == 0);
  bool tmpfs = geteuid() == 0 && mount("tmpfs", dir, "tmpfs", 0, "size=256k,mode=0700") == 0;
  struct rlimit old;
  getrlimit(RLIMIT_FSIZE, &old);
  if (!tmpfs) {
    /* Without a tiny file system: a file size limit gives EFBIG instead. */
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {256 << 10, old.rlim_max};
    setrlimit(RLIMIT_FSIZE, &rl);
  }
  char *err = NULL;
  CHECK_EQ_INT(runlog_init(dir, 64 << 20, 0, 0, &err), 0);
  struct runlog *logs[2];
  CHECK_EQ_INT(runlog_open_run("big", logs, &err), 0);
  char buf[16384];
  memset(buf, 'z', sizeof buf);
  for (int i = 0; i < 64; i++)
    runlog_tap(logs, 1, buf, sizeof buf);
  json_t *res = json_object();
  runlog_close_run(logs, NULL, res);
  const char *le = jstr(res, "log_error");
  CHECK(le && strstr(le, "stdout log is incomplete: writing it failed"));
  CHECK(le && strstr(le, tmpfs ? "No space left on device" : "File too large"));
  CHECK(jstr(res, "stdout_log_path") != NULL);
  if (le)
    printf("# %s\n", le);
  json_decref(res);
  runlog_shutdown();
  if (tmpfs)
    umount2(dir, MNT_DETACH);
  else
    setrlimit(RLIMIT_FSIZE, &old);
}

/* Keeps STATE/NAME as the serial log of session ID: runlog_keep_serial's
 * return; *ret_path and *ret_err (to free) as it left them. */
static int keep(const char *id, const char *state, const char *name, char **ret_path,
                char **ret_err) {
  _cleanup_free_ char *src = xasprintf("%s/%s", state, name);
  *ret_path = *ret_err = NULL;
  return runlog_keep_serial(id, src, ret_path, ret_err);
}

/* The serial log lies in a QEMU's state directory, which belongs to the
 * QEMU's uid: it is copied only when it is a regular file with one name
 * that belongs to the directory's owner, as qemu.log is read.  A hard link
 * to a file elsewhere (a secret of root's), a symbolic link, a FIFO and a
 * file of another uid are not copied, and the result says why. */
static void test_serial_copy_checks(void) {
  _cleanup_free_ char *dir = tmpdir("serial-logs");
  _cleanup_free_ char *state = tmpdir("serial-state");
  _cleanup_free_ char *secret = tmpdir("secret");
  CHECK(mkdir(state, 0700) == 0);
  char *err = NULL, *path = NULL;
  CHECK_EQ_INT(runlog_init(dir, 1 << 20, 0, 0, &err), 0);
  free(err);
  _cleanup_free_ char *log = xasprintf("%s/qemu.log", state);
  _cleanup_free_ char *hard = xasprintf("%s/hard.log", state);
  _cleanup_free_ char *soft = xasprintf("%s/soft.log", state);
  _cleanup_free_ char *fifo = xasprintf("%s/fifo.log", state);
  make_file(state, "qemu.log", 0, 0);
  int fd = open(log, O_WRONLY | O_APPEND | O_CLOEXEC);
  CHECK(fd >= 0 && write(fd, "guest console\n", 14) == 14);
  close(fd);
  make_file(base, "secret", 0, 0);
  fd = open(secret, O_WRONLY | O_APPEND | O_CLOEXEC);
  CHECK(fd >= 0 && write(fd, "root's secret\n", 14) == 14);
  close(fd);
  CHECK(link(secret, hard) == 0 && symlink(secret, soft) == 0 && mkfifo(fifo, 0600) == 0);

  /* The log QEMU was given: copied whole. */
  CHECK_EQ_INT(keep("serial-ok", state, "qemu.log", &path, &err), 0);
  size_t len = 0;
  _cleanup_free_ char *got = path ? slurp(path, &len) : NULL;
  CHECK(got && len == 14 && memcmp(got, "guest console\n", 14) == 0);
  CHECK(err == NULL);
  free(path);
  free(err);

  struct {
    const char *id, *name, *why;
    int r;
  } bad[] = {
      {"serial-hard", "hard.log", "2 names, a hard link", -EMLINK},
      {"serial-soft", "soft.log", "symbolic link", -ELOOP},
      {"serial-fifo", "fifo.log", "not a regular file", -EINVAL},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CHECK_EQ_INT(keep(bad[i].id, state, bad[i].name, &path, &err), bad[i].r);
    CHECK(path == NULL);
    CHECK(err && strstr(err, "the guest's serial log was not kept") && strstr(err, bad[i].why) &&
          strstr(err, bad[i].name));
    _cleanup_free_ char *kept = xasprintf("%s.serial", bad[i].id);
    CHECK(!exists(dir, kept));
    if (err)
      printf("# %s\n", err);
    free(path);
    free(err);
  }

  /* None there: nothing to say. */
  CHECK_EQ_INT(keep("serial-none", state, "none.log", &path, &err), -ENOENT);
  CHECK(path == NULL && err == NULL);

  /* A root server's QEMU runs as a uid of its own, which owns the state
   * directory: a file there of another uid is not its log. */
  if (geteuid() == 0) {
    CHECK(chown(state, 4242, 4242) == 0);
    CHECK_EQ_INT(keep("serial-root", state, "qemu.log", &path, &err), -EPERM);
    CHECK(path == NULL && err && strstr(err, "belongs to uid 0, not to uid 4242"));
    _cleanup_free_ char *kept = xasprintf("%s.serial", "serial-root");
    CHECK(!exists(dir, kept));
    free(path);
    free(err);
    CHECK(chown(log, 4242, 4242) == 0);
    CHECK_EQ_INT(keep("serial-qemu", state, "qemu.log", &path, &err), 0);
    CHECK(path && err == NULL);
    free(path);
    free(err);
  } else {
    printf("# skip the owner half of test_serial_copy_checks: needs root to chown\n");
  }
  runlog_shutdown();
}

static void test_cleanup(void) {
  if (base[0])
    fs_remove_tree(base);
}

TEST_MAIN(TEST(test_bytes_whole_and_modes), TEST(test_cap_marker),
          TEST(test_drop_marker_when_the_writer_stalls), TEST(test_refused_dirs),
          TEST(test_prune_by_size_and_age), TEST(test_write_error_reported), TEST(test_serial_copy_checks),
          TEST(test_cleanup))
