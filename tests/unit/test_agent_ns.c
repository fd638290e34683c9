/* test_agent_ns.c: ign-agent --ns, for real.  Like the server's ns backend,
 * each test clones the agent into new mount, pid, net, ipc and uts
 * namespaces (the agent makes its cgroup namespace itself) over a tiny
 * busybox rootfs built in /tmp, then checks from inside what the sandbox
 * shows and refuses: only the rootfs, only its own processes, no
 * capabilities, no mounts or user namespaces, read-only /proc/sys, loopback
 * only, a size-capped overlay, an end to everything at EOF, and every entry
 * of the seccomp deny list (guest/confine.h) under the live filter.
 *
 * Needs root and Debian's busybox-static; without them it prints one
 * "ok - ... # skip" line and counts it as skipped (tests/run.sh adds up
 * "N passed, N failed, N skipped"). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/nft_counters.h"
#include "common/util.h"
#include "guest/confine.h"
#include "guest/egress_nl.h"
#include "tests/unit/agent_client.h"
#include "tests/unit/test.h"

#define NS_OVERLAY_MB "4"
#define NS_HOSTNAME "ign-test"

static char ns_base[64];   /* temp dir holding the rootfs */
static char ns_rootfs[96];

struct sandbox {
  pid_t pid; /* the agent, PID 1 inside */
  int fd;
  int err_fd; /* the agent's stderr */
};

static bool sandbox_start_with(struct sandbox *s, const char *rootfs) {
  int sv[2], errp[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0 || pipe2(errp, O_CLOEXEC) < 0)
    return false;
  char agent[PATH_MAX];
  if (!realpath(ac_agent_path(), agent))
    return false;
  long flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | SIGCHLD;
  pid_t pid = (pid_t)syscall(SYS_clone, flags, NULL, NULL, NULL, NULL);
  if (pid < 0) {
    fprintf(stderr, "  clone: %s\n", strerror(errno));
    return false;
  }
  if (pid == 0) {
    /* Raw clone: only plain system calls until execve. */
    if (dup2(errp[1], 2) < 0 || dup2(sv[1], 3) < 0)
      _exit(126);
    execl(agent, "ign-agent", "--ns", "--rootfs", rootfs, "--overlay-mb", NS_OVERLAY_MB,
          "--hostname", NS_HOSTNAME, (char *)NULL);
    _exit(127);
  }
  close(sv[1]);
  close(errp[1]);
  s->pid = pid;
  s->fd = sv[0];
  s->err_fd = errp[0];
  return true;
}

static bool sandbox_start(struct sandbox *s) { return sandbox_start_with(s, ns_rootfs); }

/* Starts the agent as a user's server does with a stage: its layer STAGE
 * bound by name, which must be the directory INODE ("DEV:INO"). */
static bool sandbox_start_stage(struct sandbox *s, const char *stage, const char *inode) {
  int sv[2], errp[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0 || pipe2(errp, O_CLOEXEC) < 0)
    return false;
  char agent[PATH_MAX];
  if (!realpath(ac_agent_path(), agent))
    return false;
  long flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | SIGCHLD;
  pid_t pid = (pid_t)syscall(SYS_clone, flags, NULL, NULL, NULL, NULL);
  if (pid < 0)
    return false;
  if (pid == 0) {
    if (dup2(errp[1], 2) < 0 || dup2(sv[1], 3) < 0)
      _exit(126);
    execl(agent, "ign-agent", "--ns", "--rootfs", ns_rootfs, "--overlay-mb", NS_OVERLAY_MB,
          "--hostname", NS_HOSTNAME, "--stage", stage, "--stage-inode", inode, (char *)NULL);
    _exit(127);
  }
  close(sv[1]);
  close(errp[1]);
  s->pid = pid;
  s->fd = sv[0];
  s->err_fd = errp[0];
  return true;
}

static int sandbox_stop(struct sandbox *s) {
  close(s->fd);
  close(s->err_fd);
  return ac_wait_exit(s->pid, 5000);
}

#define START(s)                                                                  \
  struct sandbox s;                                                               \
  if (!sandbox_start(&s)) {                                                       \
    CHECK(!"cannot start the sandbox");                                           \
    return;                                                                       \
  }
#define STOP(s) CHECK_EQ_INT(sandbox_stop(&s), 0)

static bool out_is(const struct ac_result *r, const char *want) {
  size_t n = strlen(want);
  bool ok = r->out.len == n && (n == 0 || memcmp(r->out.data, want, n) == 0);
  if (!ok)
    fprintf(stderr, "  stdout is \"%.*s\", expected \"%s\" (stderr \"%.*s\")\n", (int)r->out.len,
            (const char *)r->out.data, want, (int)r->err.len, (const char *)r->err.data);
  return ok;
}

/* Run COMMAND inside; expect exit 0 and exactly WANT on stdout. */
static void expect_sh(struct sandbox *s, const char *command, const char *want) {
  static uint32_t id = 1000;
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_sh(s->fd, id++, command, &r), 0);
  if (r.terminal != PROTO_EXIT || r.exit_code != 0)
    fprintf(stderr, "  '%s' ended with type %u exit %u: %s%.*s\n", command, r.terminal,
            r.exit_code, r.message, (int)r.err.len, (const char *)r.err.data);
  CHECK_EQ_INT(r.terminal, PROTO_EXIT);
  CHECK_EQ_INT(r.exit_code, 0);
  CHECK(out_is(&r, want));
  ac_result_free(&r);
}

/* ---- tests -------------------------------------------------------------- */

static void test_ns_hello(void) {
  START(s);
  struct ac_result r = {0};
  char info[128];
  CHECK_EQ_INT(ac_hello(s.fd, 1, PROTO_VERSION, &r, info, sizeof info), 0);
  CHECK_EQ_INT(r.terminal, PROTO_HELLO_OK);
  CHECK(strstr(info, "mode=ns") != NULL);
  ac_result_free(&r);

  /* A HELLO that carries SETUP's TLVs sets them before it answers: here
   * the hostname, which an ns agent may not set (EPERM, not HELLO_OK). */
  CHECK_EQ_INT(ac_hello_with(s.fd, 2, TAG_HOSTNAME, "other", &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EPERM);
  CHECK(r.message && strstr(r.message, "HOSTNAME") != NULL);
  ac_result_free(&r);
  /* Nothing runs after a setup that failed, until one succeeds. */
  CHECK_EQ_INT(ac_sh(s.fd, 3, "echo ran", &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EAGAIN);
  ac_result_free(&r);
  CHECK(ac_empty_setup_ok(s.fd, 4));
  expect_sh(&s, "hostname", NS_HOSTNAME "\n");
  STOP(s);
}

static void test_ns_sees_only_the_rootfs(void) {
  START(s);
  /* The mount points were created in the overlay; nothing else is there. */
  expect_sh(&s, "ls /", "bin\ndev\nproc\nroot\ntmp\n");
  expect_sh(&s, "pwd", "/root\n");
  expect_sh(&s, "for p in /etc/hostname /work /oldroot /newroot /upper /sys; do "
                "test -e $p && echo visible: $p; done; echo done",
            "done\n");
  /* Mounts: the overlay root, /dev and /proc with their masks, nothing else
   * (which /proc files exist to be masked depends on the kernel). */
  expect_sh(&s, "cut -d' ' -f2 /proc/mounts |"
                " grep -vE '^/(dev(/(full|null|pts|random|shm|tty|urandom|zero))?|proc(/.*)?)?$';"
                " echo done",
            "done\n");
  expect_sh(&s, "grep -c ' /proc/sys proc ro,' /proc/mounts", "1\n");
  expect_sh(&s, "grep -c '^overlay / overlay ' /proc/mounts", "1\n");
  /* No host path in the mount table (the rootfs is under ns_base), and the
   * cgroup namespace's root is the sandbox's own group. */
  char cmd[256];
  snprintf(cmd, sizeof cmd, "cat /proc/self/mountinfo /proc/mounts | grep -cF -e '%s' -e /oldroot || true",
           ns_base);
  expect_sh(&s, cmd, "0\n");
  expect_sh(&s, "grep -v ':/$' /proc/self/cgroup; echo done", "done\n");
  STOP(s);
}

/* Live processes in the sandbox, counted by the shell alone (no forks while
 * counting): the agent and that shell when nothing else runs.  Processes
 * just killed may take a moment to die and be reaped, hence the retries. */
#define COUNT_PROCS                                                              \
  "for i in 1 2 3 4 5 6 7 8 9 10; do n=0;"                                       \
  " for p in /proc/[0-9]*; do read -r st <$p/stat 2>/dev/null || continue;"      \
  " case \"$st\" in *') Z '*) ;; *) n=$((n+1)) ;; esac; done;"                   \
  " [ $n = 2 ] && break; sleep 0.1; done; echo $n"

static void test_ns_own_processes(void) {
  START(s);
  /* The agent is PID 1; the shell and its children are all there is. */
  expect_sh(&s, COUNT_PROCS, "2\n");
  expect_sh(&s, "tr '\\0' ' ' </proc/1/cmdline | cut -d' ' -f2", "--ns\n");
  /* ... without the host's paths. */
  expect_sh(&s, "tr '\\0' ' ' </proc/1/cmdline | grep -q rootfs || echo hidden", "hidden\n");
  /* Not dumpable: the channel and the agent's memory are out of reach. */
  expect_sh(&s, "echo x 2>/dev/null >/proc/1/fd/3 || echo denied", "denied\n");
  expect_sh(&s, "cat /proc/1/environ >/dev/null 2>&1 || echo denied", "denied\n");
  /* kill -9 -1 kills every process but PID 1. */
  expect_sh(&s, "sleep 100 & sleep 100 & kill -9 -1; echo survived", "survived\n");
  CHECK(ac_ping_ok(s.fd, 2));
  expect_sh(&s, COUNT_PROCS, "2\n");
  STOP(s);
}

/* The refusal counters (sandbox/ns.c): the agent keeps the netfilter
 * socket it opened before its drop on AGENT_NS_COUNTERS_FD, out of the
 * sandbox's reach, and the host dumps the counters on a copy of it taken
 * with pidfd_getfd; the agent itself cannot read them (EGRESS_STATS says
 * so), and no process of ours besides it runs in the sandbox. */
static void test_ns_counters_are_read_from_outside(void) {
  START(s);
  /* Once it answers, as the server waits for HELLO. */
  CHECK(ac_ping_ok(s.fd, 1));
  int pidfd = (int)syscall(SYS_pidfd_open, s.pid, 0);
  CHECK(pidfd >= 0);
  int fd = (int)syscall(SYS_pidfd_getfd, pidfd, AGENT_NS_COUNTERS_FD, 0);
  if (fd < 0)
    fprintf(stderr, "  pidfd_getfd: %s\n", strerror(errno));
  CHECK(fd >= 0);
  uint64_t c[EGRESS_REFUSED_N] = {9, 9, 9};
  char err[256] = "";
  int r = nft_refused_dump(fd, 1000, c, err, sizeof err);
  if (r < 0)
    fprintf(stderr, "  nft_refused_dump: %s\n", err);
  CHECK_EQ_INT(r, 0);
  CHECK_EQ_INT(c[EGRESS_REFUSED_UDP], 0);
  expect_sh(&s, "tftp -g -r x -l /tmp/x 8.8.8.8 69 2>/dev/null; echo sent", "sent\n");
  CHECK_EQ_INT(nft_refused_dump(fd, 1000, c, err, sizeof err), 0);
  CHECK(c[EGRESS_REFUSED_UDP] >= 1);
  CHECK_EQ_INT(c[EGRESS_REFUSED_ICMP], 0);
  /* Nothing in the sandbox reaches it, and no command inherited it. */
  expect_sh(&s, "ls -l /proc/1/fd/ 2>&1 | grep -c socket; ls /proc/self/fd | tr '\\n' ' '",
            "0\n0 1 2 3 ");
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_EGRESS_STATS, 4);
  CHECK_EQ_INT(ac_send(s.fd, &b), 0);
  struct ac_result res = {0};
  CHECK_EQ_INT(ac_collect(s.fd, 4, &res), 0);
  CHECK_EQ_INT(res.terminal, PROTO_ERROR);
  CHECK_EQ_INT(res.error, EPERM);
  CHECK(strstr(res.message, "the server reads them itself") != NULL);
  ac_result_free(&res);
  if (fd >= 0)
    close(fd);
  if (pidfd >= 0)
    close(pidfd);
  STOP(s);
}

static void test_ns_no_privileges(void) {
  START(s);
  expect_sh(&s, "grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' "
                "/proc/self/status | tr -s '\\t' ' '",
            "CapInh: 0000000000000000\nCapPrm: 0000000000000000\nCapEff: 0000000000000000\n"
            "CapBnd: 0000000000000000\nCapAmb: 0000000000000000\nNoNewPrivs: 1\nSeccomp: 2\n");
  expect_sh(&s, "id -u", "0\n");
  expect_sh(&s, "mkdir -p /mnt; mount -t tmpfs none /mnt 2>/dev/null || echo no-mount",
            "no-mount\n");
  expect_sh(&s, "unshare -U true 2>/dev/null || echo no-userns", "no-userns\n");
  expect_sh(&s, "unshare -n true 2>/dev/null || echo no-netns", "no-netns\n");
  expect_sh(&s, "echo x 2>/dev/null >/proc/sys/kernel/hostname || echo ro", "ro\n");
  expect_sh(&s, "echo 1 2>/dev/null >/proc/sys/vm/drop_caches || echo ro", "ro\n");
  expect_sh(&s, "hostname evil 2>/dev/null || echo no-hostname; hostname",
            "no-hostname\n" NS_HOSTNAME "\n");
  /* busybox date reports the failure but exits 0. */
  expect_sh(&s, "date -s 2000-01-01 2>&1 >/dev/null | grep -o 'not permitted'", "not permitted\n");
  expect_sh(&s, "chroot / true 2>/dev/null || echo no-chroot", "no-chroot\n");

  /* SETUP needs what was dropped: EPERM naming the part that failed. */
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_SETUP, 3);
  proto_put_str(&b, TAG_HOSTNAME, "other");
  CHECK_EQ_INT(ac_send(s.fd, &b), 0);
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_collect(s.fd, 3, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EPERM);
  CHECK(strstr(r.message, "HOSTNAME") != NULL);
  ac_result_free(&r);
  STOP(s);
}

static void test_ns_network_is_loopback_only(void) {
  START(s);
  expect_sh(&s, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '", "lo\n");
  expect_sh(&s, "ip -o link show lo | grep -q 'UP' && echo up", "up\n");
  expect_sh(&s, "nc -l -p 5555 -e echo hi & for i in $(seq 50); do"
                " out=$(nc 127.0.0.1 5555 </dev/null 2>/dev/null) && [ -n \"$out\" ] && break;"
                " sleep 0.1; done; echo $out",
            "hi\n");
  /* The capture (guest/egress_nl.c): a default route through lo, and TCP
   * to anywhere redirected to the agent's port, where the agent opens a
   * stream for it (guest/egress.c); the host (this test) refuses it. */
  expect_sh(&s, "awk '$1 == \"lo\" && $2 == \"00000000\"' /proc/net/route | wc -l", "1\n");
  struct ac_exec e = {.command = "nc 93.184.216.34 443 </dev/null >/dev/null 2>&1; echo done"};
  CHECK_EQ_INT(ac_send_exec(s.fd, 990, &e), 0);
  struct ac_result r = {0};
  bool opened = false;
  for (struct proto_header h; ac_recv(s.fd, &h, AC_TIMEOUT_MS) == 0;) {
    if (h.type == PROTO_STREAM_OPEN) {
      const uint8_t *v;
      uint32_t len;
      CHECK_EQ_INT(h.id, PROTO_AGENT_ID | 1u);
      CHECK(ac_find(ac_payload, h.len, TAG_ADDR, &v, &len) && len == 4 &&
            memcmp(v, "\x5d\xb8\xd8\x22", 4) == 0);
      CHECK_EQ_INT(ac_u32(ac_payload, h.len, TAG_PORT, 0), 443);
      struct proto_buf b = {0};
      proto_frame_begin(&b, PROTO_STREAM_RESET, h.id);
      proto_put_u32(&b, TAG_ERRNO, ECONNREFUSED);
      CHECK_EQ_INT(ac_send(s.fd, &b), 0);
      opened = true;
    } else if (h.id != 990 || ac_result_take(&r, &h, ac_payload)) {
      break;
    }
  }
  CHECK(opened);
  CHECK_EQ_INT(r.terminal, PROTO_EXIT);
  CHECK(out_is(&r, "done\n"));
  ac_result_free(&r);
  STOP(s);
}

static void test_ns_dev(void) {
  START(s);
  expect_sh(&s, "ls /dev | tr '\\n' ' '",
            "fd full null ptmx pts random shm stderr stdin stdout tty urandom zero ");
  expect_sh(&s, "echo x >/dev/null && head -c 5 /dev/urandom | wc -c | tr -d ' '", "5\n");
  expect_sh(&s, "head -c 3 /dev/zero | od -An -tx1 | tr -d ' '", "000000\n");
  /* A session of its own: no controlling terminal of the host's. */
  expect_sh(&s, "echo x 2>/dev/null >/dev/tty || echo no-tty", "no-tty\n");
  expect_sh(&s, "echo shm >/dev/shm/x && cat /dev/shm/x", "shm\n");
  STOP(s);
}

static void test_ns_files_persist(void) {
  START(s);
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_write_file(s.fd, 4, "/tmp/deep/new.txt", 0600, "hello\0world", 11, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_OK);
  ac_result_free(&r);
  expect_sh(&s, "od -An -c /tmp/deep/new.txt | tr -s ' '", " h e l l o \\0 w o r l d\n");
  expect_sh(&s, "echo made >/root/mine; echo bin >/bin/extra", "");
  expect_sh(&s, "cat /root/mine /bin/extra", "made\nbin\n");
  CHECK_EQ_INT(ac_read_file(s.fd, 5, "mine", 0, 100, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_READ_END);
  CHECK(r.data.len == 5 && memcmp(r.data.data, "made\n", 5) == 0);
  ac_result_free(&r);
  STOP(s);

  /* The rootfs tree on the host was never touched. */
  char path[256];
  snprintf(path, sizeof path, "%s/bin/extra", ns_rootfs);
  CHECK(access(path, F_OK) < 0);
  snprintf(path, sizeof path, "%s/tmp", ns_rootfs);
  CHECK(access(path, F_OK) < 0);
}

static void test_ns_overlay_is_capped(void) {
  START(s);
  size_t n = 6u << 20; /* over the 4 MiB overlay */
  uint8_t *big = calloc(1, n);
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_write_file(s.fd, 6, "/root/big", 0644, big, n, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, ENOSPC);
  CHECK_STREQ(r.message, "no space left writing '/root/big': the sandbox's disk is full");
  ac_result_free(&r);
  free(big);
  /* The partial temp file is gone, so there is room again. */
  CHECK(ac_ping_ok(s.fd, 7));
  expect_sh(&s, "ls -A /root; echo ok >/root/small && cat /root/small", "ok\n");
  CHECK_EQ_INT(ac_sh(s.fd, 8, "cat /dev/zero >/tmp/fill", &r), 0);
  CHECK(r.exit_code != 0);
  CHECK(r.err.len > 0 && memmem(r.err.data, r.err.len, "No space left", 13) != NULL);
  ac_result_free(&r);
  STOP(s);
}

/* Host pids in the pid namespace of PID (its processes, the agent included). */
static int pids_in_ns_of(pid_t pid, pid_t *ret, int max) {
  char path[64], want[64], link[64];
  snprintf(path, sizeof path, "/proc/%d/ns/pid", (int)pid);
  ssize_t n = readlink(path, want, sizeof want - 1);
  if (n < 0)
    return 0;
  want[n] = '\0';
  int count = 0;
  DIR *d = opendir("/proc");
  for (struct dirent *e; d && (e = readdir(d)) && count < max;) {
    pid_t p = (pid_t)atoi(e->d_name);
    if (p <= 0)
      continue;
    snprintf(path, sizeof path, "/proc/%d/ns/pid", (int)p);
    n = readlink(path, link, sizeof link - 1);
    if (n < 0)
      continue;
    link[n] = '\0';
    if (strcmp(link, want) == 0)
      ret[count++] = p;
  }
  if (d)
    closedir(d);
  return count;
}

static void test_ns_eof_ends_everything(void) {
  START(s);
  expect_sh(&s, "sleep 300 >/dev/null 2>&1 & sleep 300 & echo started", "started\n");
  pid_t pids[16];
  int n = pids_in_ns_of(s.pid, pids, 16);
  CHECK(n >= 3); /* the agent and two sleeps */
  STOP(s);
  usleep(100000);
  for (int i = 0; i < n; i++)
    CHECK(ac_pid_dead(pids[i]));
}

/* The seccomp filter of a command in a live sandbox, read through ptrace
 * (PTRACE_SECCOMP_GET_FILTER): its instructions in RET (malloc'd), their
 * count returned, or -1. */
static long filter_of(pid_t pid, struct sock_filter **ret) {
  if (ptrace(PTRACE_SEIZE, pid, 0, 0) < 0) {
    fprintf(stderr, "  PTRACE_SEIZE %d: %s\n", (int)pid, strerror(errno));
    return -1;
  }
  long n = -1;
  int status;
  if (ptrace(PTRACE_INTERRUPT, pid, 0, 0) == 0 && waitpid(pid, &status, __WALL) == pid) {
    n = ptrace(PTRACE_SECCOMP_GET_FILTER, pid, 0, NULL);
    struct sock_filter *f = n > 0 ? calloc((size_t)n, sizeof *f) : NULL;
    if (f && ptrace(PTRACE_SECCOMP_GET_FILTER, pid, 0, f) == n)
      *ret = f;
    else {
      fprintf(stderr, "  PTRACE_SECCOMP_GET_FILTER %d: %s\n", (int)pid, strerror(errno));
      free(f);
      n = -1;
    }
  }
  ptrace(PTRACE_DETACH, pid, 0, 0);
  return n;
}

/* In a child that keeps every capability (so the kernel's own permission
 * checks pass and only the filter can answer the filter's errno): every
 * entry of confine.h is probed without the filter, where no probe may get
 * the filter's errno, then with FILTER loaded.  Exits 0 when both hold. */
static int probe_rules_in_child(const struct sock_filter *filter, long len) {
  struct confine_rule rules[CONFINE_MAX_RULES];
  size_t n = confine_rules(rules, CONFINE_MAX_RULES);
  if (n == 0 || n > CONFINE_MAX_RULES)
    return 2;
  int bad = 0;
  /* Out of the host's terminal session, mounts and network, in case a
   * probe did more than fail. */
  if (setsid() < 0 || unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWIPC) < 0 ||
      mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    return 3;
  for (size_t i = 0; i < n; i++) {
    int got = confine_probe(&rules[i]);
    if (got == rules[i].err) {
      fprintf(stderr, "  %s(%s): the probe gets %s without the filter too: it proves nothing\n",
              rules[i].name, rules[i].what ? rules[i].what : "", strerrorname_np(got));
      bad++;
    }
  }
  struct sock_fprog prog = {.len = (unsigned short)len, .filter = (struct sock_filter *)filter};
  if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0)
    return 4;
  for (size_t i = 0; i < n; i++) {
    int got = confine_probe(&rules[i]);
    if (got != rules[i].err) {
      fprintf(stderr, "  %s(%s): the sandbox's filter lets it through (%s, not %s)\n",
              rules[i].name, rules[i].what ? rules[i].what : "", got ? strerrorname_np(got) : "ok",
              strerrorname_np(rules[i].err));
      bad++;
    }
  }
  /* With real arguments too: the host's device events, and vsock. */
  if (socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_KOBJECT_UEVENT) >= 0 || errno != EPERM ||
      socket(AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0) >= 0 || errno != EPERM) {
    fprintf(stderr, "  a uevent or vsock socket was not refused with EPERM\n");
    bad++;
  }
  /* What a sandbox needs still works under it. */
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int nl = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
  int sv[2];
  if (fd < 0 || nl < 0 || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
    fprintf(stderr, "  an allowed socket was refused: %s\n", strerror(errno));
    bad++;
  }
  pid_t p = fork();
  if (p == 0)
    _exit(0);
  if (p < 0 || waitpid(p, NULL, 0) != p) {
    fprintf(stderr, "  fork under the filter failed: %s\n", strerror(errno));
    bad++;
  }
  return bad ? 1 : 0;
}

static void test_ns_seccomp_every_rule(void) {
  START(s);
  /* A command's filter: the one every command inherits from the agent. */
  expect_sh(&s, "sleep 300 >/dev/null 2>&1 & echo started", "started\n");
  pid_t pids[16], sleeper = 0;
  /* The shell may have returned before the sleep's exec. */
  for (int tries = 0; tries < 100 && sleeper == 0; tries++, usleep(20000)) {
    int n = pids_in_ns_of(s.pid, pids, 16);
    for (int i = 0; i < n; i++) {
      char path[64], comm[32] = "";
      snprintf(path, sizeof path, "/proc/%d/comm", (int)pids[i]);
      FILE *f = fopen(path, "re");
      if (f && fgets(comm, sizeof comm, f) && strcmp(comm, "sleep\n") == 0)
        sleeper = pids[i];
      if (f)
        fclose(f);
    }
  }
  CHECK(sleeper > 0);
  struct sock_filter *filter = NULL;
  long len = sleeper > 0 ? filter_of(sleeper, &filter) : -1;
  CHECK(len > 0);
  if (len > 0) {
    fflush(stderr);
    pid_t child = fork();
    if (child == 0)
      _exit(probe_rules_in_child(filter, len));
    int status = -1;
    CHECK(child > 0 && waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0))
      fprintf(stderr, "  the probe child ended with status 0x%x\n", status);
  }
  free(filter);
  STOP(s);
}

/* A rootfs path with the characters overlayfs splits its options on. */
static void test_ns_rootfs_path_with_commas(void) {
  char odd[160];
  snprintf(odd, sizeof odd, "%s/a,b:c\\d", ns_base);
  CHECK(symlink("rootfs", odd) == 0 || errno == EEXIST);
  struct sandbox s;
  if (!sandbox_start_with(&s, odd)) {
    CHECK(!"cannot start the sandbox");
    return;
  }
  expect_sh(&s, "test -x /bin/busybox && echo ok", "ok\n");
  expect_sh(&s, "grep -c 'a,b' /proc/self/mountinfo || true", "0\n");
  STOP(s);
  unlink(odd);
}

/* A tree in and out (UNPACK, PACK) inside the sandbox: the tar processes
 * run under the sandbox's seccomp filter without capabilities, as PID 1's
 * children; the parents of the destination are created. */
static void test_ns_tree_in_and_out(void) {
  START(s);
  char dir[80], cmd[1024];
  snprintf(dir, sizeof dir, "%.60s/tree-src", ns_base);
  snprintf(cmd, sizeof cmd,
           "set -e; mkdir -p %s/t/sub; printf hi > %s/t/a; ln -s ../a %s/t/sub/l;"
           " tar --format=pax -C %s -cf %s/t.tar t",
           dir, dir, dir, dir, dir);
  CHECK(system(cmd) == 0);
  snprintf(cmd, sizeof cmd, "%s/t.tar", dir);
  static uint8_t tar[1 << 16];
  int fd = open(cmd, O_RDONLY | O_CLOEXEC);
  ssize_t n = fd >= 0 ? read(fd, tar, sizeof tar) : -1;
  if (fd >= 0)
    close(fd);
  CHECK(n > 0 && n < (ssize_t)sizeof tar);

  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_UNPACK, 77);
  proto_put_str(&b, TAG_PATH, "/root/made/here/t");
  proto_put_u64(&b, TAG_MAX_BYTES, 1 << 20);
  proto_put_u64(&b, TAG_MAX_FILES, 100);
  CHECK_EQ_INT(ac_send(s.fd, &b), 0);
  struct proto_header h;
  CHECK_EQ_INT(ac_recv(s.fd, &h, AC_TIMEOUT_MS), 0);
  CHECK_EQ_INT(h.type, PROTO_CREDIT);
  CHECK(ac_u32(ac_payload, h.len, TAG_WINDOW, 0) >= (uint32_t)n);
  CHECK_EQ_INT(ac_send_raw(s.fd, PROTO_DATA, 77, tar, (size_t)n), 0);
  CHECK_EQ_INT(ac_send_raw(s.fd, PROTO_DATA_END, 77, NULL, 0), 0);
  do
    CHECK_EQ_INT(ac_recv(s.fd, &h, AC_TIMEOUT_MS), 0);
  while (h.type == PROTO_CREDIT);
  if (h.type == PROTO_ERROR) {
    char msg[512];
    ac_str(ac_payload, h.len, TAG_MESSAGE, msg, sizeof msg);
    fprintf(stderr, "  UNPACK: %s\n", msg);
  }
  CHECK_EQ_INT(h.type, PROTO_OK);
  CHECK_EQ_INT(ac_u64(ac_payload, h.len, TAG_FILES, 0), 1);
  CHECK_EQ_INT(ac_u64(ac_payload, h.len, TAG_SYMLINKS, 0), 1);
  CHECK_EQ_INT(ac_u64(ac_payload, h.len, TAG_BYTES, 0), (uint64_t)n);
  expect_sh(&s, "cat /root/made/here/t/a; readlink /root/made/here/t/sub/l; ls -A /root/made/here",
            "hi../a\nt\n");

  proto_frame_begin(&b, PROTO_PACK, 78);
  proto_put_str(&b, TAG_PATH, "/root/made/here/t");
  proto_put_u64(&b, TAG_MAX_BYTES, 1 << 20);
  proto_put_u64(&b, TAG_MAX_FILES, 100);
  proto_put_u32(&b, TAG_WINDOW, 1 << 20);
  CHECK_EQ_INT(ac_send(s.fd, &b), 0);
  uint64_t got = 0;
  bool saw_a = false;
  for (;;) {
    if (ac_recv(s.fd, &h, AC_TIMEOUT_MS) != 0) {
      CHECK(!"no PACK_END");
      break;
    }
    if (h.type != PROTO_DATA)
      break;
    got += h.len;
    saw_a |= memmem(ac_payload, h.len, "t/a", 3) != NULL;
  }
  CHECK_EQ_INT(h.type, PROTO_PACK_END);
  CHECK_EQ_INT(ac_u64(ac_payload, h.len, TAG_BYTES, 0), got);
  CHECK_EQ_INT(ac_u64(ac_payload, h.len, TAG_FILES, 0), 1);
  CHECK(saw_a);
  STOP(s);
}

static void test_ns_setup_failure_is_reported(void) {
  struct sandbox s;
  CHECK(sandbox_start_with(&s, "/nonexistent/rootfs"));
  char buf[512] = "";
  size_t got = 0;
  for (;;) {
    ssize_t r = read(s.err_fd, buf + got, sizeof buf - 1 - got);
    if (r <= 0)
      break;
    got += (size_t)r;
  }
  buf[got] = '\0';
  CHECK(strstr(buf, "ign-agent: ns setup: cannot use rootfs '/nonexistent/rootfs': No such file or "
                    "directory\n") != NULL);
  int status = sandbox_stop(&s);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 1);
}

/* A user's server hands the agent a stage's layer by name, with the inode
 * of the directory it checked: the name may have been given to another
 * directory since (another server's commit with replace renames a
 * different stage onto it), and the agent then refuses to start rather
 * than lay the session over files nobody checked. */
static void test_ns_stage_bound_by_name_must_be_the_checked_one(void) {
  _cleanup_free_ char *checked = xasprintf("%s/layer-checked", ns_base);
  _cleanup_free_ char *named = xasprintf("%s/layer-named", ns_base);
  CHECK(mkdir(checked, 0755) == 0 && mkdir(named, 0755) == 0);
  _cleanup_free_ char *m1 = xasprintf("%s/marker", checked);
  _cleanup_free_ char *m2 = xasprintf("%s/marker", named);
  FILE *f = fopen(m1, "w");
  if (f) {
    fputs("checked", f);
    fclose(f);
  }
  f = fopen(m2, "w");
  if (f) {
    fputs("renamed onto the name", f);
    fclose(f);
  }
  chmod(m1, 0644);
  chmod(m2, 0644);
  struct stat a, b;
  CHECK(stat(checked, &a) == 0 && stat(named, &b) == 0);
  CHECK(a.st_ino != b.st_ino);
  char ia[48];
  snprintf(ia, sizeof ia, "%ju:%ju", (uintmax_t)a.st_dev, (uintmax_t)a.st_ino);

  /* The name is the checked directory: laid, its file seen. */
  struct sandbox s;
  CHECK(sandbox_start_stage(&s, checked, ia));
  expect_sh(&s, "cat /marker", "checked");
  STOP(s);

  /* The name holds another directory than the one checked: refused.  (Its
   * channel is closed at once: an agent that started anyway ends at EOF.) */
  CHECK(sandbox_start_stage(&s, named, ia));
  close(s.fd);
  s.fd = -1;
  char buf[512] = "";
  size_t got = 0;
  for (;;) {
    ssize_t r = read(s.err_fd, buf + got, sizeof buf - 1 - got);
    if (r <= 0)
      break;
    got += (size_t)r;
  }
  buf[got] = '\0';
  CHECK(strstr(buf, "is no longer the directory the server checked") != NULL);
  if (!strstr(buf, "is no longer the directory the server checked"))
    fprintf(stderr, "  the agent said: %s\n", buf);
  int status = sandbox_stop(&s);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 1);

  /* --stage without --stage-inode is refused. */
  char agent[PATH_MAX];
  CHECK(realpath(ac_agent_path(), agent) != NULL);
  _cleanup_free_ char *cmd =
      xasprintf("'%s' --ns --rootfs '%s' --stage '%s' 2>/dev/null", agent, ns_rootfs, checked);
  int rc = system(cmd);
  CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 2);
}

/* ---- main --------------------------------------------------------------- */

static const char *build_rootfs(void) {
  if (access("/bin/busybox", X_OK) < 0)
    return "no /bin/busybox (apt-get install busybox-static)";
  if (!test_mkdtemp(ns_base, sizeof ns_base, "ign-agent-ns"))
    return "cannot create a temp dir";
  snprintf(ns_rootfs, sizeof ns_rootfs, "%s/rootfs", ns_base);
  /* Relative applet links: `busybox --install -s` would point them at the
   * host path of busybox, which the sandbox cannot see. */
  char cmd[512];
  snprintf(cmd, sizeof cmd,
           "set -e; mkdir -p %s/bin; cp /bin/busybox %s/bin/; cd %s/bin;"
           " for a in $(./busybox --list); do [ $a = busybox ] || ln -s busybox $a; done",
           ns_rootfs, ns_rootfs, ns_rootfs);
  if (system(cmd) != 0)
    return "cannot build the busybox rootfs";
  return NULL;
}

static void remove_rootfs(void) {
  char cmd[128];
  if (!ns_base[0])
    return;
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", ns_base);
  if (system(cmd) != 0)
    fprintf(stderr, "cannot remove %s\n", ns_base);
}

static int count_host_mounts(void) {
  FILE *f = fopen("/proc/self/mountinfo", "r");
  int n = 0;
  for (int c; f && (c = fgetc(f)) != EOF;)
    n += c == '\n';
  if (f)
    fclose(f);
  return n;
}

int main(void) {
  static const struct test_case cases[] = {
      TEST(test_ns_hello),
      TEST(test_ns_sees_only_the_rootfs),
      TEST(test_ns_own_processes),
      TEST(test_ns_counters_are_read_from_outside),
      TEST(test_ns_no_privileges),
      TEST(test_ns_network_is_loopback_only),
      TEST(test_ns_dev),
      TEST(test_ns_files_persist),
      TEST(test_ns_overlay_is_capped),
      TEST(test_ns_eof_ends_everything),
      TEST(test_ns_seccomp_every_rule),
      TEST(test_ns_rootfs_path_with_commas),
      TEST(test_ns_setup_failure_is_reported),
      TEST(test_ns_stage_bound_by_name_must_be_the_checked_one),
      TEST(test_ns_tree_in_and_out),
  };
  const char *skip = geteuid() != 0 ? "needs root" : build_rootfs();
  if (skip) {
    printf("ok - test_agent_ns # skip %s\n0 passed, 0 failed, 1 skipped\n", skip);
    remove_rootfs();
    return 0;
  }
  int mounts = count_host_mounts();
  int r = test_run_all(cases, sizeof cases / sizeof cases[0]);
  remove_rootfs();
  /* The sandboxes' mounts never reached the host. */
  if (count_host_mounts() != mounts) {
    fprintf(stderr, "the host's mount table changed: %d mounts before, %d after\n", mounts,
            count_host_mounts());
    return 1;
  }
  return r;
}
