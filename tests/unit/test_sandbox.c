/* test_sandbox.c: the backends' pure rules (overlay size, when a failed
 * warm base is tried again, whether a failed QEMU ran), the kill/reap
 * mechanics of a sandbox's process (sandbox_proc), and, as root, an ns
 * sandbox whose agent dies at once asked why by several calls. */
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"

#include "common/config.h"
#include "sandbox/sandbox.h"
#include "sandbox/stage.h"
#include "sandbox/vm.h"
#include "test.h"

static void overlay_at_most_half_the_memory(void) {
  CHECK_EQ_INT(sandbox_overlay_mb(1024, 256), 256);
  CHECK_EQ_INT(sandbox_overlay_mb(256, 256), 128);
  CHECK_EQ_INT(sandbox_overlay_mb(256, 128), 128);
  CHECK_EQ_INT(sandbox_overlay_mb(257, 200), 128);
  CHECK_EQ_INT(sandbox_overlay_mb(1, 64), 0);
  CHECK_EQ_INT(sandbox_overlay_mb(0, 64), 0);
}

static void base_retry_only_when_something_changed(void) {
  const uint64_t MiB = 1 << 20;
  struct vm_base_failure guest = {.at_ms = 1000, .store_fault = false, .store_free = 8 * MiB,
                                  .fingerprint = "qemu=a kernel=b"};
  /* The guest failed: the same inputs soon after are refused, whatever the store does. */
  CHECK(!vm_base_retry_due(&guest, 1000, 8 * MiB, "qemu=a kernel=b"));
  CHECK(!vm_base_retry_due(&guest, 1000 + VM_BASE_RETRY_MS - 1, 600 * MiB, "qemu=a kernel=b"));
  /* ... but new inputs, or enough time, make a try due. */
  CHECK(vm_base_retry_due(&guest, 2000, 8 * MiB, "qemu=a kernel=c"));
  CHECK(vm_base_retry_due(&guest, 1000 + VM_BASE_RETRY_MS, 8 * MiB, "qemu=a kernel=b"));
  /* The store's fault: a try is due once it has more room (not for noise). */
  struct vm_base_failure store = guest;
  store.store_fault = true;
  CHECK(!vm_base_retry_due(&store, 2000, 8 * MiB, "qemu=a kernel=b"));
  CHECK(!vm_base_retry_due(&store, 2000, 8 * MiB + 4096, "qemu=a kernel=b"));
  CHECK(!vm_base_retry_due(&store, 2000, 7 * MiB, "qemu=a kernel=b"));
  CHECK(vm_base_retry_due(&store, 2000, 600 * MiB, "qemu=a kernel=b"));
  CHECK(!vm_base_retry_due(&store, 2000, UINT64_MAX, "qemu=a kernel=b"));
  store.store_free = UINT64_MAX;
  CHECK(!vm_base_retry_due(&store, 2000, 600 * MiB, "qemu=a kernel=b"));
  /* No record of the inputs: try. */
  struct vm_base_failure none = {.at_ms = 1000};
  CHECK(vm_base_retry_due(&none, 1000, 8 * MiB, "qemu=a kernel=b"));
}

static void qemu_ran_only_past_its_spawn(void) {
  /* QEMU refused the guest or the accelerator (it exits 1), or died. */
  CHECK(vm_qemu_ran(W_EXITCODE(1, 0)));
  CHECK(vm_qemu_ran(W_EXITCODE(0, 0)));
  CHECK(vm_qemu_ran(W_EXITCODE(117, 0)));
  CHECK(vm_qemu_ran(W_EXITCODE(128, 0)));
  CHECK(vm_qemu_ran(SIGSYS)); /* seccomp */
  CHECK(vm_qemu_ran(SIGKILL));
  /* The spawn's child failed before QEMU ran: nothing about the guest. */
  CHECK(!vm_qemu_ran(W_EXITCODE(127, 0)));
  CHECK(!vm_qemu_ran(W_EXITCODE(118, 0)));
  CHECK(!vm_qemu_ran(W_EXITCODE(VM_SPAWN_EXIT_MAX, 0)));
  CHECK(!vm_qemu_ran(W_EXITCODE(VM_SPAWN_EXIT_MIN, 0)));
}

static pid_t fork_child(int exit_code, bool linger) {
  pid_t pid = fork();
  if (pid == 0) {
    if (linger)
      pause();
    _exit(exit_code);
  }
  return pid;
}

static void proc_reaps_once_and_never_signals_after(void) {
  struct sandbox_proc p;
  sandbox_proc_init(&p);
  pid_t pid = fork_child(7, false);
  CHECK(pid > 0);
  sandbox_proc_set(&p, pid);
  CHECK(p.pidfd >= 0);
  int status = -1;
  CHECK(sandbox_proc_wait(&p, 10000, &status));
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 7);
  /* Reaped: the status stays, and a kill is a no-op (the pid is free). */
  status = -1;
  CHECK(sandbox_proc_wait(&p, 0, &status));
  CHECK_EQ_INT(WEXITSTATUS(status), 7);
  sandbox_proc_kill(&p);
  sandbox_proc_kill_wait(&p);
  CHECK(p.reaped);
  sandbox_proc_fini(&p);

  /* A live one: not reaped by a look; killed, it is reaped with SIGKILL. */
  sandbox_proc_init(&p);
  pid = fork_child(0, true);
  sandbox_proc_set(&p, pid);
  CHECK(!sandbox_proc_wait(&p, 0, &status));
  CHECK(kill(pid, 0) == 0);
  sandbox_proc_kill(&p);
  CHECK(sandbox_proc_wait(&p, 10000, &status));
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  sandbox_proc_fini(&p);
}

/* ---- the spawner's borrowed uid is given back ---- */

/* A filter that makes setresuid(-1, UID, -1) fail with EAGAIN for every uid
 * of 65536 or more (a uid block's), and lets every other call through (the
 * way back to uid 0, -1 passed as a long). */
static int deny_setresuid_to_blocks(void) {
  struct sock_filter f[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_setresuid, 0, 5),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[1]) + 4),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 3),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[1])),
      BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 65536, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EAGAIN),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {.len = ARRAY_SIZE(f), .filter = f};
  return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

/* As root the spawner thread takes the uid block as its effective uid for
 * the clone, which makes the whole server undumpable until it is back: a
 * failed switch must give back the flag too.  In a child process (the filter
 * stays there), before any test has started the spawner thread, which a
 * fork would not copy. */
static void ns_failed_uid_switch_leaves_the_server_dumpable(void) {
  if (geteuid() != 0) {
    fprintf(stderr, "  # skip: the ns backend needs root\n");
    return;
  }
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
    if (deny_setresuid_to_blocks() < 0)
      _exit(10);
    struct sandbox_config cfg = {.rootfs = "/", .agent = "/bin/true", .memory_mb = 256,
                                 .pids = 64, .overlay_mb = 16,
                                 .ns_uid_base = NS_UID_BASE_DEFAULT};
    struct sandbox *sb = NULL;
    char *err = NULL;
    if (sandbox_ns_ops.create(&cfg, "unit", &sb, &err) == 0)
      _exit(11); /* the filter did not stop the switch */
    if (geteuid() != 0 || getegid() != 0)
      _exit(12);
    _exit(prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 1 ? 0 : 13);
  }
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fprintf(stderr, "  child: status %#x (10 no filter, 11 created, 12 not root, 13 undumpable)\n",
            status);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* A uid base the config would refuse (root's and the accounts' uids, or past
 * 2^32 - 1) is refused by the backend too, before anything runs. */
static void ns_uid_base_below_the_accounts_is_refused(void) {
  if (geteuid() != 0) {
    fprintf(stderr, "  # skip: the ns backend needs root\n");
    return;
  }
  static const unsigned bases[] = {0, 1000, NS_UID_BLOCK - 1, 0xffffffffu - NS_UID_BLOCK,
                                   0xffffffffu - NS_UID_SLOTS * NS_UID_BLOCK + 1};
  for (size_t i = 0; i < ARRAY_SIZE(bases); i++) {
    struct sandbox_config cfg = {.rootfs = "/", .agent = "/bin/true", .memory_mb = 256,
                                 .pids = 64, .overlay_mb = 16, .ns_uid_base = bases[i]};
    struct sandbox *sb = NULL;
    _cleanup_free_ char *err = NULL;
    int r = sandbox_ns_ops.create(&cfg, "unit", &sb, &err);
    if (r == 0) {
      _cleanup_free_ char *info = sb->info ? json_dumps(sb->info, 0) : NULL;
      fprintf(stderr, "  base %u: a sandbox was made (%s)\n", bases[i], info ? info : "?");
      close(sb->fd);
      sb->ops->destroy(sb);
    }
    CHECK_EQ_INT(r, -EINVAL);
    CHECK(err && strstr(err, "IGN_MCP_NS_UID_BASE"));
  }
  /* The highest base the config takes: its last uid is 2^32 - 2. */
  struct sandbox_config cfg = {.rootfs = "/", .agent = "/bin/true", .memory_mb = 256, .pids = 64,
                               .overlay_mb = 16,
                               .ns_uid_base = 0xffffffffu - NS_UID_SLOTS * NS_UID_BLOCK};
  struct sandbox *sb = NULL;
  _cleanup_free_ char *err = NULL;
  int r = sandbox_ns_ops.create(&cfg, "unit", &sb, &err);
  if (r < 0)
    fprintf(stderr, "  create at the highest base: %s\n", err);
  CHECK_EQ_INT(r, 0);
  if (r == 0) {
    close(sb->fd);
    sb->ops->destroy(sb);
  }
}

/* ---- an ns sandbox whose agent says something on stderr and exits ---- */

#define AGENT_SAYS "agent: cannot mount the overlay (a test)"

struct reason_job {
  struct sandbox *sb;
  pthread_barrier_t *go;
  char *reason;
};

static void *ask_reason(void *arg) {
  struct reason_job *j = arg;
  pthread_barrier_wait(j->go);
  j->reason = j->sb->ops->death_reason(j->sb);
  return NULL;
}

static void check_reason(const char *reason) {
  CHECK(reason != NULL);
  if (!reason)
    return;
  if (!strstr(reason, "exited with status 3") || !strstr(reason, AGENT_SAYS))
    fprintf(stderr, "  reason: %s\n", reason);
  CHECK(strstr(reason, "exited with status 3") != NULL);
  CHECK(strstr(reason, AGENT_SAYS) != NULL);
}

static void ns_death_reason_is_the_same_for_every_caller(void) {
  if (geteuid() != 0) {
    fprintf(stderr, "  # skip: the ns backend needs root\n");
    return;
  }
  char dir[256];
  CHECK(test_mkdtemp(dir, sizeof dir, "ign-test-agent") != NULL);
  /* The agent is run as the sandbox's own host uid, not as root. */
  chmod(dir, 0755);
  _cleanup_free_ char *agent = xasprintf("%s/agent", dir);
  FILE *f = fopen(agent, "w");
  CHECK(f != NULL);
  if (!f)
    return;
  fprintf(f, "#!/bin/sh\necho '" AGENT_SAYS "' >&2\nexit 3\n");
  fclose(f);
  chmod(agent, 0755);
  struct sandbox_config cfg = {.rootfs = "/", .agent = agent, .memory_mb = 256, .pids = 64,
                               .overlay_mb = 16, .ns_uid_base = NS_UID_BASE_DEFAULT};
  for (int round = 0; round < 2; round++) {
    struct sandbox *sb = NULL;
    _cleanup_free_ char *err = NULL;
    int r = sandbox_ns_ops.create(&cfg, "unit", &sb, &err);
    if (r < 0)
      fprintf(stderr, "  create: %s\n", err);
    CHECK_EQ_INT(r, 0);
    if (r < 0)
      break;
    /* Ask once its channel has closed, as the calls that fail do: the
     * agent has then exited (had it not, the answer would depend on how
     * fast the host ran it). */
    char c;
    struct pollfd pfd = {.fd = sb->fd, .events = POLLIN};
    CHECK(poll(&pfd, 1, -1) == 1 && read(sb->fd, &c, 1) == 0);
    if (round == 0) {
      /* One after the other: the second must not find the pipe emptied. */
      _cleanup_free_ char *a = sb->ops->death_reason(sb);
      _cleanup_free_ char *b = sb->ops->death_reason(sb);
      check_reason(a);
      check_reason(b);
    } else {
      /* At once, as calls that fail together do. */
      enum { N = 6 };
      pthread_barrier_t go;
      pthread_barrier_init(&go, NULL, N);
      struct reason_job jobs[N];
      pthread_t t[N];
      for (int i = 0; i < N; i++) {
        jobs[i] = (struct reason_job){.sb = sb, .go = &go};
        pthread_create(&t[i], NULL, ask_reason, &jobs[i]);
      }
      for (int i = 0; i < N; i++) {
        pthread_join(t[i], NULL);
        check_reason(jobs[i].reason);
        free(jobs[i].reason);
      }
      pthread_barrier_destroy(&go);
    }
    close(sb->fd);
    sb->ops->destroy(sb);
  }
  unlink(agent);
  rmdir(dir);
}

/* vm_spawn's child (a raw clone of a threaded server, as root) changes to
 * QEMU's uid.  glibc's setgroups/setresgid/setresuid in a threaded process
 * go through __nptl_setxid, which takes glibc's stack lock and signals
 * (SIGSETXID, tgkill) every thread the parent had: in a raw clone that lock
 * may be held by a thread that does not exist there (the child hangs) and
 * those threads are not there to answer.  The child must change only its
 * own credentials, with the raw system calls.  Seen here without a race: a
 * seccomp filter kills the process that sends SIGSETXID. */
#define SIGSETXID_NR (__SIGRTMIN + 1)
static void spawn_child_changes_uid_without_glibc_setxid(void) {
  if (getuid() != 0) {
    printf("# skipped: the uid change of vm_spawn's child needs root\n");
    return;
  }
  char dir[256];
  CHECK(test_mkdtemp(dir, sizeof dir, "unit-vm-spawn") != NULL);
  pid_t tester = fork();
  if (tester == 0) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_tgkill, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[2])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SIGSETXID_NR, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = ARRAY_SIZE(f), .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) < 0)
      _exit(2);
    int q[2], a[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, q) < 0 ||
        socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, a) < 0)
      _exit(3);
    struct vm_spawn_req req = {.qemu = "/bin/true", .argv = (char *const[]){"true", NULL},
                               .dir = dir, .qmp_fd = q[1], .agent_fd = a[1],
                               .uid = VM_UID_BASE + VM_UID_SPAN - 1, .gid = VM_GID};
    pid_t pid;
    char *err = NULL;
    if (vm_spawn(&req, &pid, &err) < 0) {
      fprintf(stderr, "  vm_spawn: %s\n", err);
      _exit(4);
    }
    int status;
    if (waitpid(pid, &status, 0) != pid)
      _exit(5);
    if (WIFSIGNALED(status))
      fprintf(stderr, "  the spawn child died of signal %d\n", WTERMSIG(status));
    _exit(WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 6);
  }
  int status = 0;
  CHECK(tester > 0 && waitpid(tester, &status, 0) == tester);
  CHECK(WIFEXITED(status));
  CHECK_EQ_INT(WEXITSTATUS(status), 0);
  char log[300];
  snprintf(log, sizeof log, "%s/qemu.log", dir);
  unlink(log);
  rmdir(dir);
}

/* ---- an ns sandbox from a stage that another server replaced ---- */

/* Makes stage NAME (ns) whose layer holds "marker" with TEXT; 0 or -errno. */
static int ns_stage_with_marker(const char *name, const char *text, bool replace,
                                struct stage **ret) {
  char *dir = NULL, *err = NULL;
  int r = stage_begin(1 << 20, &dir, &err);
  if (r == 0) {
    _cleanup_free_ char *layer = xasprintf("%s/layer", dir);
    _cleanup_free_ char *marker = xasprintf("%s/marker", layer);
    FILE *f = mkdir(layer, 0755) == 0 ? fopen(marker, "w") : NULL;
    CHECK(f != NULL);
    if (f) {
      fputs(text, f);
      fclose(f);
    }
    chmod(marker, 0644);
    struct stage_new in = {.backend = "ns", .inputs_id = "b-test", .carries = "files"};
    r = stage_finish(dir, name, replace, &in, ret, &err);
  }
  if (r < 0)
    fprintf(stderr, "  %s\n", err);
  free(dir);
  free(err);
  return r;
}

/* A root server's ns backend lays a session over the stage it opened and
 * checked, even when another server sharing the store has committed with
 * replace under its name in between: the layer is opened relative to the
 * checked directory, never by the name.  The agent here is a script that
 * prints what the layer it was handed (fd 5, the idmapped mount) holds. */
static void ns_stage_layer_is_the_checked_one(void) {
  if (geteuid() != 0) {
    fprintf(stderr, "  # skip: the ns backend needs root\n");
    return;
  }
  char dir[256];
  CHECK(test_mkdtemp(dir, sizeof dir, "ign-test-stage") != NULL);
  chmod(dir, 0755);
  char *saved_store = cfg.store;
  unsigned saved_max = cfg.stages_max_mb;
  cfg.store = dir;
  cfg.stages_max_mb = 64;
  _cleanup_free_ char *agent = xasprintf("%s/agent", dir);
  FILE *f = fopen(agent, "w");
  CHECK(f != NULL);
  if (f) {
    fprintf(f, "#!/bin/sh\necho \"layer: $(cat /proc/self/fd/5/marker)\" >&2\nexit 3\n");
    fclose(f);
  }
  chmod(agent, 0755);
  struct stage *made = NULL, *s = NULL;
  char *err = NULL;
  CHECK_EQ_INT(ns_stage_with_marker("swap", "the checked layer", false, &made), 0);
  stage_unref(made);
  stage_test_forget();
  CHECK_EQ_INT(stage_open("swap", "", "ns", "b-test", &s, &err), 0);
  free(err);
  err = NULL;
  if (!s)
    goto out;
  /* Another server (another process) replaces it. */
  pid_t pid = fork();
  if (pid == 0) {
    struct stage *o = NULL;
    _exit(ns_stage_with_marker("swap", "another server's layer", true, &o) == 0 ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);

  struct sandbox_config sc = {.rootfs = "/", .agent = agent, .memory_mb = 256, .pids = 64,
                              .overlay_mb = 16, .ns_uid_base = NS_UID_BASE_DEFAULT, .stage = s};
  struct sandbox *sb = NULL;
  int r = sandbox_ns_ops.create(&sc, "unit", &sb, &err);
  if (r < 0)
    fprintf(stderr, "  create: %s\n", err);
  CHECK_EQ_INT(r, 0);
  if (r == 0) {
    char c;
    struct pollfd pfd = {.fd = sb->fd, .events = POLLIN};
    CHECK(poll(&pfd, 1, 10000) == 1 && read(sb->fd, &c, 1) == 0);
    _cleanup_free_ char *reason = sb->ops->death_reason(sb);
    CHECK(reason && strstr(reason, "layer: the checked layer"));
    if (!reason || !strstr(reason, "layer: the checked layer"))
      fprintf(stderr, "  reason: %s\n", reason ? reason : "(none)");
    close(sb->fd);
    sb->ops->destroy(sb);
  }
out:
  stage_unref(s);
  CHECK_EQ_INT(stage_rm("swap", "", &err), 0);
  free(err);
  stage_gc();
  cfg.store = saved_store;
  cfg.stages_max_mb = saved_max;
  _cleanup_free_ char *rm = xasprintf("rm -rf '%s'", dir);
  CHECK(system(rm) == 0);
}

/* First: its fork must not inherit a spawner thread that is not there. */
TEST_MAIN(TEST(spawn_child_changes_uid_without_glibc_setxid), TEST(overlay_at_most_half_the_memory), TEST(base_retry_only_when_something_changed),
          TEST(qemu_ran_only_past_its_spawn), TEST(proc_reaps_once_and_never_signals_after),
          TEST(ns_failed_uid_switch_leaves_the_server_dumpable),
          TEST(ns_uid_base_below_the_accounts_is_refused),
          TEST(ns_death_reason_is_the_same_for_every_caller),
          TEST(ns_stage_layer_is_the_checked_one))
