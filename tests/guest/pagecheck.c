/* pagecheck.c: finds pages a vm snapshot (commit, fork) lost or tore, from
 * inside the guest.  Static, plain libc; copied into a session and run there
 * (tests/e2e/pagecheck.test.mjs).
 *
 *   pagecheck write MIB   the writer: allocates MIB MiB (anonymous, each page
 *                         written once with generation 0), then for ever,
 *                         for G = 1, 2, ...: writes pages 0..N-1 in order with
 *                         generation G.  Its pid goes to /tmp/pagecheck.pid.
 *   pagecheck verify [S]  asks the writer (SIGUSR1) to check its pages,
 *                         waits up to S seconds (default 60) for the answer,
 *                         prints it; exit 0: ok, 1: bad pages, 2: no answer.
 *   pagecheck tear        the check's own test: stops the writer, changes one
 *                         word of its pages 0 and N/2 through /proc/PID/mem,
 *                         asks it to check and continues it; it must find
 *                         one or two torn pages (it finishes the page it was
 *                         writing, which may be one of them, before it
 *                         checks).  Prints the answer, exits as verify.
 *
 * A page is 512 64-bit words: [0] its index, [1] its generation, [2..510] a
 * fill derived from (index, generation), [511] a checksum over [0..510].
 * The writer's generation G and cursor C (the next page to write) are its
 * own variables, in the guest's memory and registers, so a snapshot takes
 * them together with the pages.  Between two pages (where the writer checks
 * and is checked) pages [0,C) hold generation G and pages [C,N) hold G-1,
 * exactly; a snapshot that restores into anything else lost a write (a page
 * of an older generation: "stale"), or mixed two moments (a page "ahead" of
 * the cursor, a wrong index), or tore a page (a bad checksum or fill).  A
 * page the snapshot took half written is finished by the resumed writer
 * before it checks.
 *
 * The check runs in the writer, at a page boundary, when SIGUSR1 has come:
 * it writes one line to /tmp/pagecheck.result (through a rename) and goes
 * on writing:
 *   ok gen=G cursor=C pages=N
 *   bad B of N pages (stale S, ahead A, torn T): first page P: found index I
 *     gen X checksum ok|bad fill ok|bad, expected gen E; gen=G cursor=C
 * `verify` removes the old result before it signals, so a result it reads
 * is the answer to its own signal (a snapshot carries /tmp too). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGE_WORDS 512
#define PAGE_BYTES (PAGE_WORDS * 8)
#define MAX_MIB 65536
#define PID_FILE "/tmp/pagecheck.pid" /* "PID ADDRESS PAGES" */
#define RESULT_FILE "/tmp/pagecheck.result"
#define RESULT_TMP "/tmp/pagecheck.result.tmp"

static volatile sig_atomic_t asked;

static void on_usr1(int sig) {
  (void)sig;
  asked = 1;
}

static uint64_t mix(uint64_t x) { /* splitmix64's finaliser */
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static uint64_t fill(uint64_t index, uint64_t gen, unsigned k) {
  return mix(index << 24 ^ gen) + k * 0x9e3779b97f4a7c15ull;
}

static uint64_t checksum(const uint64_t *p) {
  uint64_t s = 0;
  for (unsigned k = 0; k < PAGE_WORDS - 1; k++)
    s = (s ^ p[k]) * 0x100000001b3ull;
  return s;
}

static void write_page(uint64_t *p, uint64_t index, uint64_t gen) {
  p[0] = index;
  p[1] = gen;
  for (unsigned k = 2; k < PAGE_WORDS - 1; k++)
    p[k] = fill(index, gen, k);
  p[PAGE_WORDS - 1] = checksum(p);
}

/* Whether page P's fill is that of the index and generation it claims. */
static bool fill_ok(const uint64_t *p) {
  for (unsigned k = 2; k < PAGE_WORDS - 1; k++)
    if (p[k] != fill(p[0], p[1], k))
      return false;
  return true;
}

/* Checks every page against (gen, cursor) and writes the result line. */
static void check(const uint64_t *mem, uint64_t n, uint64_t gen, uint64_t cursor) {
  uint64_t bad = 0, stale = 0, ahead = 0, torn = 0, first = n;
  for (uint64_t i = 0; i < n; i++) {
    const uint64_t *p = mem + i * PAGE_WORDS;
    uint64_t want = i < cursor ? gen : gen - 1;
    bool sum_ok = p[PAGE_WORDS - 1] == checksum(p);
    if (p[0] == i && p[1] == want && sum_ok && fill_ok(p))
      continue;
    bad++;
    if (!sum_ok || p[0] != i || !fill_ok(p))
      torn++;
    else if (p[1] < want)
      stale++;
    else
      ahead++;
    if (first == n)
      first = i;
  }
  char line[512];
  if (bad == 0) {
    snprintf(line, sizeof line, "ok gen=%" PRIu64 " cursor=%" PRIu64 " pages=%" PRIu64 "\n", gen,
             cursor, n);
  } else {
    const uint64_t *p = mem + first * PAGE_WORDS;
    snprintf(line, sizeof line,
             "bad %" PRIu64 " of %" PRIu64 " pages (stale %" PRIu64 ", ahead %" PRIu64
             ", torn %" PRIu64 "): first page %" PRIu64 ": found index %" PRIu64 " gen %" PRIu64
             " checksum %s fill %s, expected gen %" PRIu64 "; gen=%" PRIu64 " cursor=%" PRIu64 "\n",
             bad, n, stale, ahead, torn, first, p[0], p[1],
             p[PAGE_WORDS - 1] == checksum(p) ? "ok" : "bad", fill_ok(p) ? "ok" : "bad",
             first < cursor ? gen : gen - 1, gen, cursor);
  }
  int fd = open(RESULT_TMP, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0 || write(fd, line, strlen(line)) != (ssize_t)strlen(line) || close(fd) < 0 ||
      rename(RESULT_TMP, RESULT_FILE) < 0)
    fprintf(stderr, "pagecheck: cannot write %s: %s\n", RESULT_FILE, strerror(errno));
}

static int writer(const char *arg) {
  char *end;
  unsigned long mib = strtoul(arg, &end, 10);
  if (*end || mib == 0 || mib > MAX_MIB) {
    fprintf(stderr, "pagecheck: MIB must be 1 to %d, not '%s'\n", MAX_MIB, arg);
    return 2;
  }
  uint64_t n = (uint64_t)mib * (1 << 20) / PAGE_BYTES;
  uint64_t *mem = mmap(NULL, n * PAGE_BYTES, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (mem == MAP_FAILED) {
    fprintf(stderr, "pagecheck: cannot map %lu MiB: %s\n", mib, strerror(errno));
    return 2;
  }
  for (uint64_t i = 0; i < n; i++)
    write_page(mem + i * PAGE_WORDS, i, 0);
  struct sigaction sa = {.sa_handler = on_usr1};
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGUSR1, &sa, NULL) < 0)
    return 2;
  FILE *f = fopen(PID_FILE, "w");
  if (!f || fprintf(f, "%d %" PRIuPTR " %" PRIu64 "\n", (int)getpid(), (uintptr_t)mem, n) < 0 ||
      fclose(f) != 0) {
    fprintf(stderr, "pagecheck: cannot write %s\n", PID_FILE);
    return 2;
  }
  for (uint64_t gen = 1;; gen++) {
    for (uint64_t c = 0; c < n; c++) {
      if (asked) {
        asked = 0;
        check(mem, n, gen, c);
      }
      write_page(mem + c * PAGE_WORDS, c, gen);
    }
  }
}

/* The writer's pid, pages' address and count from PID_FILE. */
static int read_pid_file(int *ret_pid, uintptr_t *ret_addr, uint64_t *ret_n) {
  FILE *f = fopen(PID_FILE, "r");
  bool ok = f && fscanf(f, "%d %" SCNuPTR " %" SCNu64, ret_pid, ret_addr, ret_n) == 3 &&
            *ret_pid > 0 && *ret_n > 0;
  if (f)
    fclose(f);
  if (!ok)
    printf("no writer: cannot read 'PID ADDRESS PAGES' from %s\n", PID_FILE);
  return ok ? 0 : -1;
}

/* Asks writer PID to check its pages (it may be stopped: CONT continues it
 * once asked) and waits up to SECS seconds for its answer: the exit code. */
static int ask(int pid, long secs, bool cont) {
  if (unlink(RESULT_FILE) < 0 && errno != ENOENT) {
    printf("cannot remove %s: %s\n", RESULT_FILE, strerror(errno));
    return 2;
  }
  if (kill(pid, SIGUSR1) < 0 || (cont && kill(pid, SIGCONT) < 0)) {
    printf("no writer: pid %d: %s\n", pid, strerror(errno));
    return 2;
  }
  for (long ms = 0; ms < secs * 1000; ms += 10) {
    char line[512];
    FILE *f = fopen(RESULT_FILE, "r");
    if (f) {
      bool got = fgets(line, sizeof line, f) != NULL;
      fclose(f);
      if (got) {
        fputs(line, stdout);
        return strncmp(line, "ok ", 3) == 0 ? 0 : 1;
      }
    }
    nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
  }
  printf("no answer from the writer (pid %d) in %ld s\n", pid, secs);
  return 2;
}

static int verify(const char *arg) {
  long secs = arg ? strtol(arg, NULL, 10) : 60;
  if (secs <= 0 || secs > 3600)
    secs = 60;
  int pid;
  uintptr_t addr;
  uint64_t n;
  if (read_pid_file(&pid, &addr, &n) < 0)
    return 2;
  return ask(pid, secs, false);
}

/* Changes a word (adds 1) of pages 0 and N/2 of the stopped writer, then
 * asks it to check: it finishes the page it was writing, if any, before it
 * checks, so it finds one or both pages torn. */
static int tear(void) {
  int pid;
  uintptr_t addr;
  uint64_t n;
  if (read_pid_file(&pid, &addr, &n) < 0)
    return 2;
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/mem", pid);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0 || kill(pid, SIGSTOP) < 0) {
    printf("cannot reach the writer (pid %d): %s\n", pid, strerror(errno));
    return 2;
  }
  for (uint64_t i = 0; i <= n / 2; i += n / 2 ? n / 2 : 1) {
    uint64_t w;
    off_t at = (off_t)(addr + i * PAGE_BYTES + 8 * 8);
    if (pread(fd, &w, 8, at) != 8 || (w++, pwrite(fd, &w, 8, at) != 8)) {
      printf("cannot change page %" PRIu64 " in %s: %s\n", i, path, strerror(errno));
      kill(pid, SIGCONT);
      close(fd);
      return 2;
    }
  }
  close(fd);
  return ask(pid, 60, true);
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "write") == 0)
    return writer(argv[2]);
  if ((argc == 2 || argc == 3) && strcmp(argv[1], "verify") == 0)
    return verify(argc == 3 ? argv[2] : NULL);
  if (argc == 2 && strcmp(argv[1], "tear") == 0)
    return tear();
  fprintf(stderr, "usage: pagecheck write MIB | pagecheck verify [SECONDS] | pagecheck tear\n");
  return 2;
}
