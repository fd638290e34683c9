/* test_tarstream_hostile.c: tar_unpack fed streams a hostile sender writes
 * by hand, byte for byte (what libarchive's writer would never make): a
 * sparse map as big as the stream, a damaged header, a sender that keeps
 * the stream open after its end or fails there, directories without
 * permissions.  Each
 * test works in a fresh directory under /tmp. */
#include <fcntl.h>
#include <limits.h>
#include <linux/capability.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/tarstream.h"
#include "common/util.h"
#include "test.h"

static char dir[PATH_MAX];

static void setup(void) {
  alarm(120);
  if (!test_mkdtemp(dir, sizeof dir, "test_tarstream_hostile"))
    abort();
}

static void teardown(void) {
  char cmd[2 * PATH_MAX + 64];
  snprintf(cmd, sizeof cmd, "chmod -R u+rwx %s 2>/dev/null; rm -rf %s", dir, dir);
  if (system(cmd) != 0)
    fprintf(stderr, "  cannot remove %s\n", dir);
  alarm(0);
}

static int mem_fd(void) {
  int fd = memfd_create("stream", MFD_CLOEXEC);
  if (fd < 0)
    abort();
  return fd;
}

static void put(int fd, const void *b, size_t n) {
  if (write(fd, b, n) != (ssize_t)n)
    abort();
}

/* Zeros up to the next 512-byte block. */
static void pad(int fd) {
  static const char z[512];
  off_t o = lseek(fd, 0, SEEK_CUR);
  if (o % 512)
    put(fd, z, 512 - (size_t)(o % 512));
}

/* A ustar header; BAD_SUM makes its checksum wrong. */
static void header(int fd, const char *name, char type, uint64_t size, mode_t mode, bool bad_sum) {
  char h[512] = {0};
  snprintf(h, 100, "%s", name);
  snprintf(h + 100, 8, "%07o", (unsigned)mode);
  snprintf(h + 108, 8, "%07o", 0);
  snprintf(h + 116, 8, "%07o", 0);
  snprintf(h + 124, 12, "%011llo", (unsigned long long)size);
  snprintf(h + 136, 12, "%011o", 1000000000);
  h[156] = type;
  memcpy(h + 257, "ustar", 6);
  memcpy(h + 263, "00", 2);
  memset(h + 148, ' ', 8);
  unsigned sum = 0;
  for (int i = 0; i < 512; i++)
    sum += (unsigned char)h[i];
  snprintf(h + 148, 8, "%06o", sum + (bad_sum ? 1 : 0));
  put(fd, h, 512);
}

/* One pax record "LEN KEY=VALUE\n" appended to BUF. */
static void pax_record(char *buf, size_t cap, const char *key, const char *value) {
  size_t body = 1 + strlen(key) + 1 + strlen(value) + 1;
  size_t len = body + 1;
  while (snprintf(NULL, 0, "%zu", len) + body != len)
    len++;
  size_t at = strlen(buf);
  snprintf(buf + at, cap - at, "%zu %s=%s\n", len, key, value);
}

static void end_marker(int fd) {
  static const char z[1024];
  put(fd, z, sizeof z);
}

static int unpack_in_dir(int fd, const char *name, const struct tar_limits *lim,
                         struct tar_report *rep, char **err) {
  int dfd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  int r = tar_unpack(fd, dfd, name, lim, NULL, rep, err);
  close(dfd);
  return r;
}

static bool dir_is_empty(void) {
  char cmd[2 * PATH_MAX + 64];
  snprintf(cmd, sizeof cmd, "test -z \"$(ls -A %s)\"", dir);
  return system(cmd) == 0;
}

static const struct tar_limits big = {1ull << 30, 100000};

/* A GNU sparse 1.0 map travels in the entry's data, but libarchive reads it
 * whole while it reads the header and keeps it in memory, at about ten
 * times its size; only the file's logical size is checked against the cap.
 * A map as large as the stream cap allows must not be held: the header is
 * refused while it is read, and the receiving process stays small. */
static void sparse_map_is_not_held_in_memory(void) {
  setup();
  const unsigned n = 2u * 1024 * 1024; /* map entries: ~20 MiB of map */
  int fd = mem_fd();
  char pax[1024] = {0}, realsize[32];
  snprintf(realsize, sizeof realsize, "%u", 2 * n);
  pax_record(pax, sizeof pax, "GNU.sparse.major", "1");
  pax_record(pax, sizeof pax, "GNU.sparse.minor", "0");
  pax_record(pax, sizeof pax, "GNU.sparse.name", "T");
  pax_record(pax, sizeof pax, "GNU.sparse.realsize", realsize);
  header(fd, "PaxHeader/T", 'x', strlen(pax), 0644, false);
  put(fd, pax, strlen(pax));
  pad(fd);
  /* The map: the count, then offset and length of each data block. */
  int map = mem_fd();
  dprintf(map, "%u\n", n);
  for (unsigned i = 0; i < n; i++)
    dprintf(map, "%u\n1\n", 2 * i);
  pad(map);
  off_t map_len = lseek(map, 0, SEEK_CUR);
  header(fd, "GNUSparseFile.0/T", '0', (uint64_t)map_len + n, 0644, false);
  lseek(map, 0, SEEK_SET);
  static char buf[1 << 16];
  for (ssize_t k; (k = read(map, buf, sizeof buf)) > 0;)
    put(fd, buf, (size_t)k);
  close(map);
  memset(buf, 'x', sizeof buf);
  for (unsigned left = n; left;) {
    unsigned k = left < sizeof buf ? left : (unsigned)sizeof buf;
    put(fd, buf, k);
    left -= k;
  }
  pad(fd);
  end_marker(fd);
  lseek(fd, 0, SEEK_SET);

  int p[2];
  CHECK_EQ_INT(pipe2(p, O_CLOEXEC), 0);
  pid_t pid = fork();
  if (pid == 0) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    long before = ru.ru_maxrss;
    char *err = NULL;
    int r = unpack_in_dir(fd, "dst", &big, NULL, &err);
    getrusage(RUSAGE_SELF, &ru);
    dprintf(p[1], "%d %ld %s", r, (ru.ru_maxrss - before) / 1024, err ? err : "");
    _exit(0);
  }
  close(p[1]);
  char out[1024] = {0};
  for (size_t len = 0; len < sizeof out - 1;) {
    ssize_t k = read(p[0], out + len, sizeof out - 1 - len);
    if (k <= 0)
      break;
    len += (size_t)k;
  }
  close(p[0]);
  waitpid(pid, NULL, 0);
  int r = 0;
  long grew_mib = 0;
  int at = 0;
  sscanf(out, "%d %ld %n", &r, &grew_mib, &at);
  fprintf(stderr, "  tar_unpack: %d, grew by %ld MiB: %s\n", r, grew_mib, out + at);
  CHECK_EQ_INT(r, -EOVERFLOW);
  CHECK(strstr(out + at, "header") && strstr(out + at, "MiB"));
  CHECK(grew_mib < 64);
  CHECK(dir_is_empty());
  close(fd);
  teardown();
}

/* A GNU sparse 1.0 file T of REALSIZE bytes whose map has the N regions
 * OFF/LEN (in the map's order, whatever it is), each region's bytes 'x'. */
static int sparse_stream(const char *realsize, const uint64_t (*regions)[2], size_t n) {
  int fd = mem_fd();
  char pax[1024] = {0};
  pax_record(pax, sizeof pax, "GNU.sparse.major", "1");
  pax_record(pax, sizeof pax, "GNU.sparse.minor", "0");
  pax_record(pax, sizeof pax, "GNU.sparse.name", "T");
  pax_record(pax, sizeof pax, "GNU.sparse.realsize", realsize);
  header(fd, "PaxHeader/T", 'x', strlen(pax), 0644, false);
  put(fd, pax, strlen(pax));
  pad(fd);
  char map[4096];
  size_t m = (size_t)snprintf(map, sizeof map, "%zu\n", n);
  uint64_t data = 0;
  for (size_t i = 0; i < n; i++) {
    m += (size_t)snprintf(map + m, sizeof map - m, "%llu\n%llu\n",
                          (unsigned long long)regions[i][0], (unsigned long long)regions[i][1]);
    data += regions[i][1];
  }
  size_t map_len = (m + 511) / 512 * 512;
  header(fd, "GNUSparseFile.0/T", '0', map_len + data, 0644, false);
  put(fd, map, m);
  pad(fd);
  static char xs[8192];
  memset(xs, 'x', sizeof xs);
  for (uint64_t left = data; left;) {
    size_t k = left < sizeof xs ? (size_t)left : sizeof xs;
    put(fd, xs, k);
    left -= k;
  }
  pad(fd);
  end_marker(fd);
  lseek(fd, 0, SEEK_SET);
  return fd;
}

/* Hostile sparse maps: a size past the cap with almost no data (holes
 * count), regions out of order and overlapping, a region past the size the
 * map declares.  Each is refused with nothing left behind, or makes a file
 * of the declared size that allocates no more than it. */
static void hostile_sparse_maps_stay_bounded(void) {
  const struct tar_limits lim = {1ull << 20, 100};
  static const uint64_t tiny[][2] = {{0, 4}};
  static const uint64_t tangled[][2] = {{8192, 4}, {0, 4096}, {2048, 4096}, {100, 1}};
  static const uint64_t past[][2] = {{0, 4}, {20000, 4}};
  struct {
    const char *what, *realsize;
    const uint64_t (*regions)[2];
    size_t n;
    int want; /* 0: a file of realsize bytes; else the refusal */
  } rows[] = {
      {"2^63-1 bytes of holes", "9223372036854775807", tiny, 1, -EFBIG},
      {"one byte past the cap, as holes", "1048577", tiny, 1, -EFBIG},
      {"the cap exactly, as holes", "1048576", tiny, 1, 0},
      {"regions out of order and overlapping", "16384", tangled, 4, 0},
      {"a region past the declared size", "16384", past, 2, -1},
  };
  for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
    setup();
    int fd = sparse_stream(rows[i].realsize, rows[i].regions, rows[i].n);
    char *err = NULL;
    struct tar_report rep = {0};
    int r = unpack_in_dir(fd, "dst", &lim, &rep, &err);
    close(fd);
    fprintf(stderr, "  %s: %d %s\n", rows[i].what, r, err ? err : "");
    if (rows[i].want == 0) {
      CHECK_EQ_INT(r, 0);
      char path[PATH_MAX + 8];
      snprintf(path, sizeof path, "%s/dst", dir);
      struct stat st;
      CHECK_EQ_INT(stat(path, &st), 0);
      CHECK_EQ_INT((long long)st.st_size, atoll(rows[i].realsize));
      CHECK((uint64_t)st.st_blocks * 512 <= (uint64_t)st.st_size + 65536);
    } else {
      CHECK(r < 0);
      if (rows[i].want != -1)
        CHECK_EQ_INT(r, rows[i].want);
      CHECK(dir_is_empty());
    }
    free(err);
    tar_report_free(&rep);
    teardown();
  }
}

/* A header with a wrong checksum after the top: libarchive says
 * ARCHIVE_RETRY, which holds no entry; the copy fails as a broken stream,
 * not with an internal error about the library's state. */
static void damaged_header_is_a_broken_stream(void) {
  setup();
  int fd = mem_fd();
  header(fd, "T/", '5', 0, 0755, false);
  header(fd, "T/f", '0', 0, 0644, true);
  end_marker(fd);
  lseek(fd, 0, SEEK_SET);
  char *err = NULL;
  int r = unpack_in_dir(fd, "dst", &big, NULL, &err);
  CHECK(r < 0);
  CHECK(err && strstr(err, "broken") && !strstr(err, "INTERNAL"));
  if (err)
    fprintf(stderr, "  %s\n", err);
  free(err);
  close(fd);
  CHECK(dir_is_empty());
  teardown();
}

/* ---- the sender's end: after the end marker ---------------------------- */

struct drain_run {
  int fd;
  atomic_bool cancelled;
  int r;
  char *err;
  pthread_t thread;
};

static void *drain_main(void *arg) {
  struct drain_run *d = arg;
  int dfd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  d->r = tar_unpack(d->fd, dfd, "dst", &big, &d->cancelled, NULL, &d->err);
  close(dfd);
  return NULL;
}

static void sleep_ms(unsigned ms) {
  nanosleep(&(struct timespec){.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L}, NULL);
}

/* A whole stream (end marker included) is in the pipe; the sender then
 * waits WAIT_MS with its end open, and either fails (CANCEL: the stop is
 * set, as a failed sender's runner does, then the stream is closed) or
 * closes it as a sender that succeeded.  The destination "dst" held "old";
 * it is replaced only in the second case, and only after the close. */
static void drain_row(unsigned wait_ms, bool cancel) {
  setup();
  char path[PATH_MAX + 8];
  snprintf(path, sizeof path, "%s/dst", dir);
  int old = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  put(old, "old\n", 4);
  close(old);
  struct stat before;
  CHECK_EQ_INT(stat(path, &before), 0);

  int p[2];
  CHECK_EQ_INT(pipe2(p, O_CLOEXEC), 0);
  int fd = mem_fd();
  header(fd, "T", '0', 4, 0644, false);
  put(fd, "new\n", 4);
  pad(fd);
  end_marker(fd);
  char buf[4096];
  lseek(fd, 0, SEEK_SET);
  for (ssize_t k; (k = read(fd, buf, sizeof buf)) > 0;)
    put(p[1], buf, (size_t)k);
  close(fd);

  struct drain_run d = {.fd = p[0]};
  uint64_t t0 = mono_ms();
  pthread_create(&d.thread, NULL, drain_main, &d);
  sleep_ms(wait_ms);
  if (cancel)
    atomic_store(&d.cancelled, true);
  close(p[1]);
  pthread_join(d.thread, NULL);
  uint64_t took = mono_ms() - t0;
  close(p[0]);

  char got[16] = {0};
  int rfd = open(path, O_RDONLY | O_CLOEXEC);
  CHECK(rfd >= 0 && read(rfd, got, sizeof got - 1) > 0);
  if (rfd >= 0)
    close(rfd);
  struct stat after;
  CHECK_EQ_INT(stat(path, &after), 0);
  fprintf(stderr, "  wait %u ms, %s: tar_unpack %d after %llu ms (%s), dst \"%.3s\"\n", wait_ms,
          cancel ? "stop" : "close", d.r, (unsigned long long)took, d.err ? d.err : "-", got);
  if (cancel) {
    CHECK_EQ_INT(d.r, -ECANCELED);
    CHECK(d.err && strstr(d.err, "cancelled"));
    CHECK_STREQ(got, "old\n");
    CHECK_EQ_INT(after.st_ino, before.st_ino);
  } else {
    CHECK_EQ_INT(d.r, 0);
    CHECK_STREQ(got, "new\n");
    CHECK(took >= wait_ms);
  }
  free(d.err);
  /* Nothing else: no staging left behind. */
  char cmd[PATH_MAX + 64];
  snprintf(cmd, sizeof cmd, "test \"$(ls -A %s)\" = dst", dir);
  CHECK_EQ_INT(system(cmd), 0);
  teardown();
}

/* A cancel that lands while the rest of a whole stream is drained is a
 * failed copy: soon after the end marker (before a poll interval ran out)
 * and long after it. */
static void cancel_in_the_drain_keeps_the_destination(void) {
  drain_row(50, true);
  drain_row(600, true);
}

/* A sender that keeps its end open after the end marker holds the commit
 * until it closes (its success is its EOF), then the copy is done. */
static void commit_waits_for_the_senders_end(void) { drain_row(600, false); }

/* Root in the test bypasses permissions: the child drops the capabilities
 * that do (it then sees a directory as its owner does), as the server,
 * run by a user, always does. */
static void drop_dac_override(void) {
  struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3};
  struct __user_cap_data_struct d[2];
  if (syscall(SYS_capget, &h, d) < 0)
    return;
  for (int i = 0; i < 2; i++)
    d[i].effective &= ~(1u << CAP_DAC_OVERRIDE | 1u << CAP_DAC_READ_SEARCH | 1u << CAP_FOWNER);
  if (syscall(SYS_capset, &h, d) < 0)
    abort();
}

/* A directory its owner may neither read nor search (mode 0000, 0100)
 * with entries below it: the copy either makes it, mode and all, or fails,
 * and in both cases leaves no staging behind, nor an old tree that held
 * one when it is replaced. */
static void unreadable_directory_leaves_nothing_behind(void) {
  setup();
  for (int round = 0; round < 3; round++) {
    int fd = mem_fd();
    header(fd, "T/", '5', 0, 0755, false);
    header(fd, "T/d/", '5', 0, round == 1 ? 0100 : 0, false);
    header(fd, "T/d/e/", '5', 0, 0, false);
    header(fd, "T/d/e/f", '0', 2, 0644, false);
    put(fd, "hi", 2);
    pad(fd);
    if (round < 2)
      end_marker(fd); /* round 2: cut, the copy fails */
    lseek(fd, 0, SEEK_SET);
    pid_t pid = fork();
    if (pid == 0) {
      drop_dac_override();
      char *err = NULL;
      struct tar_report rep = {0};
      int r = unpack_in_dir(fd, "dst", &big, &rep, &err);
      if (r < 0)
        fprintf(stderr, "  round %d: %s\n", round, err);
      _exit(r == 0 ? (rep.files == 1 ? 0 : 2) : 1);
    }
    int status;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == (round < 2 ? 0 : 1));
    close(fd);
    char cmd[2 * PATH_MAX + 128];
    snprintf(cmd, sizeof cmd,
             "cd %s && test \"$(ls -A)\" = dst && test \"$(stat -c %%a dst/d)\" = %s", dir,
             round == 0 ? "0" : "100"); /* round 2 left round 1's copy */
    CHECK_EQ_INT(system(cmd), 0);
  }
  teardown();
}

TEST_MAIN(TEST(sparse_map_is_not_held_in_memory), TEST(hostile_sparse_maps_stay_bounded), TEST(damaged_header_is_a_broken_stream),
          TEST(cancel_in_the_drain_keeps_the_destination),
          TEST(commit_waits_for_the_senders_end),
          TEST(unreadable_directory_leaves_nothing_behind))
