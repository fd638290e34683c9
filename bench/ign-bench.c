/* ign-bench.c: the C half of the benchmark harness (bench/bench.mjs).
 *
 * It times what the Node harness cannot time without its own overhead, and
 * the layers below MCP:
 *
 *   spawn N ARGV...         N runs of ARGV on the host, one after another
 *                           (fork, execvp, waitpid): the host baselines
 *   spawn-serve [--posix-spawn]
 *                           for each line CMD read on stdin, one run of
 *                           `sh -c CMD` on the host (fork, or posix_spawn:
 *                           clone(CLONE_VM|CLONE_VFORK), as the agent starts
 *                           commands); answers one line {"ns": N} each (the
 *                           paired exec loop)
 *   spawn-par P N ARGV...   P processes at once, each running ARGV N times
 *                           in a row: the host baseline for throughput
 *   host-files SIZE:N,...   write and read a SIZE-byte file N times on the
 *                           host's tmpfs (/dev/shm): the baseline for files
 *   agent fd [tasks]        ign-agent --serve-fd 3 on a socketpair, driven by
 *                           the server's own protocol client (proto/client.c):
 *                           the agent protocol with no sandbox and no MCP
 *   agent session [tasks]   the server's session layer in this process: the
 *                           same config (IGN_MCP_*), backend, session_open,
 *                           lease and agent_* calls as the tools, without the
 *                           MCP layer (JSON-RPC, tool argument checks, SDK)
 *
 * tasks: --open N (open and close N times), --exec N (run `true` and
 * `echo hello` N times each in one sandbox), --files SIZE:N,... (write_file
 * and read_file of SIZE bytes, N times each), --serve (in one sandbox, for
 * each line CMD read on stdin, one run of CMD answered with a line
 * {"ns": N}, until EOF: the harness interleaves the layers of the exec
 * path sample by sample with it).
 *
 * Output: one JSON object on stdout, every duration in nanoseconds; errors
 * as {"error": "..."} with exit status 1; progress lines on stderr.
 *
 * It is built from the server's sources minus mcp/main.c (like the unit
 * tests) and lives next to the server (build/ign-bench), so the session
 * layer finds the agent and the images exactly as the server does. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "proto/client.h"
#include "proto/proto.h"
#include "session/session.h"

#define WARMUP 3
#define CALL_TIMEOUT_MS 60000u

static uint64_t now(void) { return now_ns(CLOCK_MONOTONIC); }

static void progress(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "  [ign-bench] ");
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

/* Set once a termination signal arrived: main() then parks in fail()
 * instead of exiting, while the signal thread cleans up. */
static atomic_bool terminating, main_parked;

__attribute__((noreturn)) static void fail(const char *fmt, ...) {
  if (terminating) {
    main_parked = true;
    for (;;)
      pause();
  }
  va_list ap;
  va_start(ap, fmt);
  char *msg = NULL;
  if (vasprintf(&msg, fmt, ap) < 0)
    msg = NULL;
  va_end(ap);
  json_t *o = json_pack("{s:s}", "error", msg ? msg : "out of memory");
  json_dumpf(o, stdout, JSON_COMPACT);
  fputc('\n', stdout);
  fprintf(stderr, "ign-bench: %s\n", msg ? msg : "out of memory");
  exit(1);
}

static json_t *samples_new(void) { return json_array(); }
static void sample_add(json_t *a, uint64_t ns) { json_array_append_new(a, json_integer((json_int_t)ns)); }

static unsigned long parse_num(const char *s, const char *what, unsigned long max) {
  char *end;
  errno = 0;
  unsigned long v = strtoul(s, &end, 10);
  if (errno || *end || v == 0 || v > max)
    fail("%s wants a number from 1 to %lu, got '%s'", what, max, s);
  return v;
}

static unsigned parse_count(const char *s, const char *what) {
  return (unsigned)parse_num(s, what, 1000000);
}

/* ---- host processes ----------------------------------------------------- */

/* Waits for PID; returns its wait status (or -1). */
static int wait_status(pid_t pid) {
  int st;
  while (waitpid(pid, &st, 0) < 0)
    if (errno != EINTR)
      return -1;
  return st;
}

/* Runs argv once and waits; returns its wait status (or -1). */
static int run_once(char **argv, int null_fd) {
  pid_t pid = fork();
  if (pid < 0)
    return -1;
  if (pid == 0) {
    dup2(null_fd, 0);
    dup2(null_fd, 1);
    execvp(argv[0], argv);
    _exit(127);
  }
  return wait_status(pid);
}

static int cmd_spawn(int argc, char **argv) {
  if (argc < 2)
    fail("usage: spawn N ARGV...");
  unsigned n = parse_count(argv[0], "spawn");
  int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  json_t *s = samples_new();
  for (unsigned i = 0; i < n + WARMUP; i++) {
    uint64_t t0 = now();
    int st = run_once(argv + 1, null_fd);
    uint64_t dt = now() - t0;
    if (st != 0)
      fail("`%s` failed (wait status %d)", argv[1], st);
    if (i >= WARMUP)
      sample_add(s, dt);
  }
  json_t *o = json_pack("{s:o}", "ns", s);
  json_dumpf(o, stdout, JSON_COMPACT);
  fputc('\n', stdout);
  return 0;
}

/* Writes one answer line of a serving loop. */
static void serve_answer(uint64_t ns) {
  printf("{\"ns\":%llu}\n", (unsigned long long)ns);
  fflush(stdout);
}

/* Reads one command line of a serving loop into BUF; false at EOF. */
static bool serve_read(char *buf, size_t size) {
  if (!fgets(buf, (int)size, stdin))
    return false;
  size_t n = strlen(buf);
  if (n && buf[n - 1] == '\n')
    buf[--n] = '\0';
  else if (n == size - 1)
    fail("a command line longer than %zu bytes", size - 2);
  return true;
}

/* Runs argv once with posix_spawnp (stdin and stdout on NULL_FD) and waits;
 * returns its wait status (or -1). */
static int run_once_spawn(char **argv, int null_fd) {
  posix_spawn_file_actions_t fa;
  if (posix_spawn_file_actions_init(&fa) != 0)
    return -1;
  posix_spawn_file_actions_adddup2(&fa, null_fd, 0);
  posix_spawn_file_actions_adddup2(&fa, null_fd, 1);
  pid_t pid;
  int r = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (r != 0)
    return -1;
  return wait_status(pid);
}

static int cmd_spawn_serve(int argc, char **argv) {
  bool use_spawn = argc == 1 && strcmp(argv[0], "--posix-spawn") == 0;
  if (argc != 0 && !use_spawn)
    fail("usage: spawn-serve [--posix-spawn] (commands on stdin, one a line)");
  int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  char line[4096];
  while (serve_read(line, sizeof line)) {
    char *cmd[] = {"sh", "-c", line, NULL};
    uint64_t t0 = now();
    int st = use_spawn ? run_once_spawn(cmd, null_fd) : run_once(cmd, null_fd);
    uint64_t dt = now() - t0;
    if (st != 0)
      fail("`sh -c %s` failed (wait status %d)", line, st);
    serve_answer(dt);
  }
  return 0;
}

/* P workers started at once, each running ARGV N times; the wall time from
 * the first start to the last exit gives runs per second.  Each worker
 * reports its per-run times through a pipe. */
static int cmd_spawn_par(int argc, char **argv) {
  if (argc < 3)
    fail("usage: spawn-par P N ARGV...");
  unsigned p = parse_count(argv[0], "spawn-par P"), n = parse_count(argv[1], "spawn-par N");
  char **cmd = argv + 2;
  int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  int pfd[2];
  if (pipe2(pfd, O_CLOEXEC) < 0)
    fail("pipe: %s", strerror(errno));
  pid_t *workers = calloc(p, sizeof *workers);
  int go[2];
  if (!workers || pipe2(go, O_CLOEXEC) < 0)
    fail("out of resources");
  for (unsigned w = 0; w < p; w++) {
    workers[w] = fork();
    if (workers[w] < 0)
      fail("fork: %s", strerror(errno));
    if (workers[w] == 0) {
      close(go[1]);
      char c;
      if (read(go[0], &c, 1) < 0)
        _exit(1);
      for (unsigned i = 0; i < n; i++) {
        uint64_t t0 = now();
        int st = run_once(cmd, null_fd);
        uint64_t dt = now() - t0;
        if (st != 0)
          _exit(2);
        if (write(pfd[1], &dt, sizeof dt) != sizeof dt)
          _exit(1);
      }
      _exit(0);
    }
  }
  close(pfd[1]);
  close(go[0]);
  uint64_t t0 = now();
  close(go[1]); /* EOF releases every worker at once */
  json_t *s = samples_new();
  uint64_t dt;
  while (read(pfd[0], &dt, sizeof dt) == sizeof dt)
    sample_add(s, dt);
  bool ok = true;
  for (unsigned w = 0; w < p; w++) {
    int st;
    while (waitpid(workers[w], &st, 0) < 0 && errno == EINTR)
      ;
    ok = ok && st == 0;
  }
  uint64_t wall = now() - t0;
  if (!ok)
    fail("a worker running `%s` failed", cmd[0]);
  json_t *o = json_pack("{s:I, s:I, s:o}", "wall_ns", (json_int_t)wall, "runs",
                        (json_int_t)(p * n), "ns", s);
  json_dumpf(o, stdout, JSON_COMPACT);
  fputc('\n', stdout);
  free(workers);
  return 0;
}

/* ---- files on the host -------------------------------------------------- */

struct file_task {
  size_t size;
  unsigned n;
};

static size_t parse_files(const char *spec, struct file_task *tasks, size_t max) {
  size_t k = 0;
  _cleanup_free_ char *copy = strdup(spec);
  for (char *save = NULL, *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    char *colon = strchr(tok, ':');
    if (!colon || k == max)
      fail("--files wants SIZE:N[,SIZE:N...], got '%s'", spec);
    *colon = '\0';
    tasks[k].size = parse_num(tok, "--files SIZE", 1ul << 30);
    tasks[k].n = parse_count(colon + 1, "--files N");
    k++;
  }
  return k;
}

static void *pattern(size_t size) {
  uint8_t *b = malloc(size);
  if (!b)
    fail("out of memory for a %zu byte buffer", size);
  for (size_t i = 0; i < size; i++)
    b[i] = (uint8_t)(i * 131 + (i >> 12));
  return b;
}

static int cmd_host_files(int argc, char **argv) {
  if (argc != 1)
    fail("usage: host-files SIZE:N,...");
  struct file_task tasks[8];
  size_t nt = parse_files(argv[0], tasks, ARRAY_SIZE(tasks));
  char path[64];
  snprintf(path, sizeof path, "/dev/shm/ign-bench-%d", (int)getpid());
  json_t *files = json_object();
  for (size_t k = 0; k < nt; k++) {
    _cleanup_free_ uint8_t *data = pattern(tasks[k].size);
    _cleanup_free_ uint8_t *back = malloc(tasks[k].size);
    json_t *w = samples_new(), *r = samples_new();
    for (unsigned i = 0; i < tasks[k].n + 1; i++) {
      uint64_t t0 = now();
      int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0 || proto_write_all(fd, data, tasks[k].size) < 0 || close(fd) < 0)
        fail("writing %s: %s", path, strerror(errno));
      uint64_t t1 = now();
      fd = open(path, O_RDONLY | O_CLOEXEC);
      if (fd < 0 || proto_read_all(fd, back, tasks[k].size) < 0 || close(fd) < 0)
        fail("reading %s: %s", path, strerror(errno));
      uint64_t t2 = now();
      if (memcmp(data, back, tasks[k].size) != 0)
        fail("%s read back differently", path);
      if (i > 0) { /* the first round warms up */
        sample_add(w, t1 - t0);
        sample_add(r, t2 - t1);
      }
    }
    char key[32];
    snprintf(key, sizeof key, "%zu", tasks[k].size);
    json_object_set_new(files, key, json_pack("{s:o, s:o}", "write", w, "read", r));
  }
  unlink(path);
  json_t *o = json_pack("{s:o}", "files", files);
  json_dumpf(o, stdout, JSON_COMPACT);
  fputc('\n', stdout);
  return 0;
}

/* ---- the agent, two ways ------------------------------------------------ */

/* What a termination signal must clean up: the harness sends SIGTERM when
 * it is interrupted, and sandboxes and their cgroups must not outlive us. */
static bool sig_session;
static char sig_dir[64];
static _Atomic pid_t sig_agent = -1; /* the fd-mode agent, while it runs */

static void *signal_main(void *arg) {
  sigset_t *set = arg;
  int sig;
  if (sigwait(set, &sig) == 0) {
    terminating = true;
    if (sig_session) {
      /* Kills every sandbox; the call in flight then fails, releases its
       * lease (the last reference: that removes the cgroup) and main()
       * parks in fail().  Give it the time to get there. */
      sessions_shutdown();
      for (int i = 0; i < 300 && !main_parked; i++)
        usleep(10000);
    }
    pid_t agent = sig_agent;
    if (agent > 0) {
      /* First the agent: a write in flight would create the directory anew. */
      kill(agent, SIGKILL);
      waitpid(agent, NULL, 0);
    }
    if (sig_dir[0]) {
      /* Files the fd-mode agent wrote: at most one per size. */
      char cmd[128];
      snprintf(cmd, sizeof cmd, "rm -rf '%s'", sig_dir);
      if (system(cmd) != 0)
        fprintf(stderr, "ign-bench: could not remove %s\n", sig_dir);
    }
    _exit(128 + sig);
  }
  return NULL;
}

static void catch_termination(bool session, const char *dir) {
  static sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, NULL);
  sig_session = session;
  snprintf(sig_dir, sizeof sig_dir, "%s", dir ? dir : "");
  pthread_t t;
  pthread_create(&t, NULL, signal_main, &set);
  pthread_detach(t);
}

/* A connection to an agent plus what it takes to end it. */
struct target {
  bool session;             /* session layer; else fd mode */
  /* fd mode */
  struct agent_conn *conn;
  pid_t pid;
  char dir[64];             /* scratch directory for files (fd mode) */
  /* session mode */
  char id[64];
};

static int fd_agent_open(struct target *t, const char *agent, char **ret_err) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
    *ret_err = xasprintf("socketpair: %s", strerror(errno));
    return -errno;
  }
  pid_t pid = fork();
  if (pid < 0) {
    *ret_err = xasprintf("fork: %s", strerror(errno));
    return -errno;
  }
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (dup2(sv[1], 3) < 0)
      _exit(126);
    execl(agent, "ign-agent", "--serve-fd", "3", (char *)NULL);
    _exit(127);
  }
  close(sv[1]);
  t->pid = pid;
  sig_agent = pid;
  int r = agent_conn_open(sv[0], 10000, &t->conn, ret_err);
  if (r < 0) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
  }
  return r;
}

static void fd_agent_close(struct target *t) {
  agent_conn_free(t->conn); /* closes the channel: the agent reads EOF and exits */
  t->conn = NULL;
  int st;
  while (waitpid(t->pid, &st, 0) < 0 && errno == EINTR)
    ;
  sig_agent = -1;
}

/* Opens a session through the session layer; *ret_info gets the result. */
static int session_open_id(struct target *t, json_t **ret_info, char **ret_err) {
  json_t *info = NULL;
  int r = session_open("", NULL, NULL, &info, ret_err);
  if (r < 0)
    return r;
  const char *id = json_string_value(json_object_get(info, "session_id"));
  snprintf(t->id, sizeof t->id, "%s", id ? id : "");
  *ret_info = info;
  return 0;
}

/* The agent connection to use for one call, as the tools take it. */
struct call {
  struct lease l;
  struct agent_conn *conn;
};

static int call_begin(struct target *t, struct call *c, char **ret_err) {
  if (!t->session) {
    c->conn = t->conn;
    return 0;
  }
  int r = session_acquire(t->id, "", &c->l, ret_err);
  if (r == 0)
    c->conn = lease_conn(&c->l);
  return r;
}

static void call_end(struct target *t, struct call *c) {
  if (t->session)
    session_release(&c->l);
}

/* One run of COMMAND as the run tool does it: a lease, agent_exec, the
 * release.  Returns the nanoseconds it took. */
static uint64_t exec_once(struct target *t, const char *command) {
  uint64_t t0 = now();
  struct call c;
  _cleanup_free_ char *err = NULL;
  if (call_begin(t, &c, &err) < 0)
    fail("lease for `%s`: %s", command, err ? err : "failed");
  struct agent_exec_req req = {
      .command = command, .timeout_ms = 30000, .out_cap = t->session ? cfg.output_cap : 65536,
  };
  struct agent_exec_res res;
  int r = agent_exec(c.conn, &req, NULL, &res, &err);
  call_end(t, &c);
  uint64_t dt = now() - t0;
  if (r < 0)
    fail("`%s`: %s", command, err ? err : strerror(-r));
  bool ok = res.exit_code == 0 && res.signal == 0;
  agent_exec_res_free(&res);
  if (!ok)
    fail("`%s` did not exit 0", command);
  return dt;
}

static void do_exec(struct target *t, const char *command, json_t *samples, unsigned n) {
  for (unsigned i = 0; i < n + WARMUP; i++) {
    uint64_t dt = exec_once(t, command);
    if (i >= WARMUP)
      sample_add(samples, dt);
  }
}

static void do_files(struct target *t, const struct file_task *task, json_t *files) {
  _cleanup_free_ uint8_t *data = pattern(task->size);
  char path[128];
  snprintf(path, sizeof path, "%s/ign-bench-%zu", t->session ? "/tmp" : t->dir, task->size);
  json_t *w = samples_new(), *rd = samples_new();
  for (unsigned i = 0; i < task->n + 1; i++) {
    struct call c;
    _cleanup_free_ char *err = NULL;
    uint64_t t0 = now();
    if (call_begin(t, &c, &err) < 0)
      fail("lease: %s", err);
    int r = agent_write_file(c.conn, path, 0644, data, task->size, NULL, &err);
    call_end(t, &c);
    uint64_t t1 = now();
    if (r < 0)
      fail("write %s: %s", path, err ? err : strerror(-r));
    void *back = NULL;
    size_t len = 0;
    uint64_t size = 0;
    bool eof = false;
    if (call_begin(t, &c, &err) < 0)
      fail("lease: %s", err);
    r = agent_read_file(c.conn, path, 0, task->size, NULL, &back, &len, &size, &eof, &err);
    call_end(t, &c);
    uint64_t t2 = now();
    if (r < 0)
      fail("read %s: %s", path, err ? err : strerror(-r));
    bool same = len == task->size && memcmp(back, data, len) == 0;
    free(back);
    if (!same)
      fail("%s read back %zu bytes that differ from the %zu written", path, len, task->size);
    if (i > 0) {
      sample_add(w, t1 - t0);
      sample_add(rd, t2 - t1);
    }
  }
  char key[32];
  snprintf(key, sizeof key, "%zu", task->size);
  json_object_set_new(files, key, json_pack("{s:o, s:o}", "write", w, "read", rd));
}

static int cmd_agent(int argc, char **argv) {
  if (argc < 1 || (strcmp(argv[0], "fd") != 0 && strcmp(argv[0], "session") != 0))
    fail("usage: agent fd|session [--open N] [--exec N] [--files SIZE:N,...] [--serve]");
  struct target t = {.session = strcmp(argv[0], "session") == 0, .pid = -1};
  unsigned n_open = 0, n_exec = 0;
  bool serve = false;
  struct file_task tasks[8];
  size_t nt = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--serve") == 0) {
      serve = true;
      continue;
    }
    if (i + 1 >= argc)
      fail("%s wants a value", argv[i]);
    if (strcmp(argv[i], "--open") == 0)
      n_open = parse_count(argv[++i], "--open");
    else if (strcmp(argv[i], "--exec") == 0)
      n_exec = parse_count(argv[++i], "--exec");
    else if (strcmp(argv[i], "--files") == 0)
      nt = parse_files(argv[++i], tasks, ARRAY_SIZE(tasks));
    else
      fail("unknown option %s", argv[i]);
  }

  /* What the server's main() does before it serves. */
  const char *lv = getenv("IGN_MCP_LOG");
  log_set_stderr_level(lv && *lv && log_level_parse(lv) >= 0 ? (enum log_level)log_level_parse(lv)
                                                             : LOG_WARNING);
  if (config_load() < 0)
    fail("invalid IGN_MCP_* settings (see above)");
  signal(SIGPIPE, SIG_IGN);
  if (!t.session) {
    snprintf(t.dir, sizeof t.dir, "/dev/shm/ign-bench.XXXXXX");
    if (!mkdtemp(t.dir))
      fail("mkdtemp: %s", strerror(errno));
  }
  /* Before any other thread exists, so that every thread blocks them. */
  catch_termination(t.session, t.session ? NULL : t.dir);
  _cleanup_free_ char *err = NULL;
  if (t.session && sessions_init(&err) < 0)
    fail("%s", err);
  if (!t.session && !cfg.agent)
    fail("ign-agent was not found next to %s; set IGN_MCP_AGENT", config_exe_dir());

  json_t *out = json_object();
  json_object_set_new(out, "backend", json_string(t.session ? sessions_backend() : "agent-fd"));

  if (n_open) {
    progress("%s: open and close %u times", argv[0], n_open);
    json_t *s = samples_new(), *paths = json_array(), *info_ms = json_array();
    for (unsigned i = 0; i < n_open + WARMUP; i++) {
      json_t *info = NULL;
      free(err);
      err = NULL;
      uint64_t t0 = now();
      int r = t.session ? session_open_id(&t, &info, &err) : fd_agent_open(&t, cfg.agent, &err);
      uint64_t dt = now() - t0;
      if (r < 0)
        fail("open: %s", err ? err : strerror(-r));
      if (i >= WARMUP) {
        sample_add(s, dt);
        json_t *p = info ? json_object_get(info, "path") : NULL;
        json_array_append(paths, p ? p : json_null());
        json_t *ms = info ? json_object_get(info, "open_ms") : NULL;
        json_array_append(info_ms, ms ? ms : json_null());
      }
      if (i == 0 && info)
        json_object_set(out, "open_info", info);
      json_decref(info);
      if (t.session) {
        if (session_close(t.id, "", &err) < 0)
          fail("close %s: %s", t.id, err);
      } else {
        fd_agent_close(&t);
      }
    }
    json_object_set_new(out, "open", json_pack("{s:o, s:o, s:o}", "ns", s, "path", paths,
                                               "open_ms", info_ms));
  }

  if (n_exec || nt || serve) {
    json_t *info = NULL;
    free(err);
    err = NULL;
    int r = t.session ? session_open_id(&t, &info, &err) : fd_agent_open(&t, cfg.agent, &err);
    if (r < 0)
      fail("open: %s", err ? err : strerror(-r));
    if (info)
      json_object_set_new(out, "session", info);
    if (n_exec) {
      progress("%s: `true` and `echo hello`, %u times each", argv[0], n_exec);
      json_t *a = samples_new(), *b = samples_new();
      do_exec(&t, "true", a, n_exec);
      do_exec(&t, "echo hello", b, n_exec);
      json_object_set_new(out, "exec", json_pack("{s:o, s:o}", "true", a, "echo hello", b));
    }
    if (nt) {
      json_t *files = json_object();
      for (size_t k = 0; k < nt; k++) {
        progress("%s: write and read %zu bytes, %u times each", argv[0], tasks[k].size, tasks[k].n);
        do_files(&t, &tasks[k], files);
      }
      json_object_set_new(out, "files", files);
    }
    if (serve) {
      progress("%s: serving commands from stdin", argv[0]);
      char line[4096];
      while (serve_read(line, sizeof line))
        serve_answer(exec_once(&t, line));
    }
    if (t.session) {
      if (session_close(t.id, "", &err) < 0)
        fail("close %s: %s", t.id, err);
    } else {
      fd_agent_close(&t);
    }
  }

  if (t.session)
    sessions_shutdown();
  else {
    for (size_t k = 0; k < nt; k++) {
      char path[128];
      snprintf(path, sizeof path, "%s/ign-bench-%zu", t.dir, tasks[k].size);
      unlink(path);
    }
    rmdir(t.dir);
  }
  json_dumpf(out, stdout, JSON_COMPACT);
  fputc('\n', stdout);
  json_decref(out);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: ign-bench spawn|spawn-serve|spawn-par|host-files|agent ... (see bench/ign-bench.c)\n");
    return 2;
  }
  if (strcmp(argv[1], "spawn") == 0)
    return cmd_spawn(argc - 2, argv + 2);
  if (strcmp(argv[1], "spawn-serve") == 0)
    return cmd_spawn_serve(argc - 2, argv + 2);
  if (strcmp(argv[1], "spawn-par") == 0)
    return cmd_spawn_par(argc - 2, argv + 2);
  if (strcmp(argv[1], "host-files") == 0)
    return cmd_host_files(argc - 2, argv + 2);
  if (strcmp(argv[1], "agent") == 0)
    return cmd_agent(argc - 2, argv + 2);
  fprintf(stderr, "ign-bench: unknown command '%s'\n", argv[1]);
  return 2;
}
