/* ns.c: the namespace backend.
 *
 * A sandbox is ign-agent running as PID 1 of fresh mount, pid, net, ipc, uts
 * and cgroup namespaces, in a cgroup with memory and pids limits.  The
 * server only clones the process and places it in its cgroup; the agent
 * itself (guest/ns_setup.c) builds the root: the rootfs tree read-only under
 * a size-capped tmpfs overlay, a fresh /proc and a minimal /dev, loopback
 * only, then drops every capability and installs its seccomp filter.
 *
 * Life and death: the agent's channel is one end of a socketpair whose other
 * end only the server holds, and the agent exits when it reads EOF; it also
 * has PR_SET_PDEATHSIG.  When PID 1 of a pid namespace exits, the kernel
 * kills everything else in it, so a SIGKILLed server leaves nothing behind. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"
#include "mcp/log.h"
#include "sandbox/sandbox.h"

struct ns_sandbox {
  struct sandbox base;
  struct cgroup *cg;
  struct sandbox_proc proc; /* the agent */
  /* What the agent said on stderr while it started.  Calls that fail
   * together ask why at once: the pipe is read under the lock, and what was
   * read is kept for every one of them. */
  pthread_mutex_t err_lock;
  int err_fd;               /* read end of the agent's stderr, or -1 */
  char err_msg[1024];
  size_t err_len;
};

struct clone_args_ns {
  const char *agent;
  char *const *argv;
  char *const *envp;
  int chan_fd;              /* child's end of the socketpair */
  int err_fd;               /* write end of the stderr pipe */
  int sync_fd;              /* read end: released once in its cgroup */
  int null_fd;
  pid_t ret_pid;
};

/* Runs on the spawner thread.  Between clone and execve the child makes raw
 * system calls only. */
static int clone_agent(void *p) {
  struct clone_args_ns *a = p;
  /* No CLONE_NEWCGROUP: the agent makes its cgroup namespace once it is in
   * the session's groups (guest/ns_setup.c). */
  long flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | SIGCHLD;
  pid_t pid = (pid_t)syscall(SYS_clone, flags, NULL, NULL, NULL, NULL);
  if (pid < 0)
    return -errno;
  if (pid == 0) {
    char c;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (read(a->sync_fd, &c, 1) != 1)
      _exit(126);
    if (dup2(a->null_fd, 0) < 0 || dup2(a->null_fd, 1) < 0 || dup2(a->err_fd, 2) < 0 ||
        dup2(a->chan_fd, 3) < 0)
      _exit(126);
    /* Only fds 0-3 reach the sandbox, whatever the server inherited. */
    if (syscall(SYS_close_range, 4, ~0U, 0) < 0)
      _exit(126);
    sandbox_child_reset_signals();
    execve(a->agent, a->argv, a->envp);
    static const char msg[] = "ign-agent: execve failed\n";
    if (write(2, msg, sizeof msg - 1) < 0)
      _exit(127);
    _exit(127);
  }
  a->ret_pid = pid;
  return 0;
}

static int ns_create(const struct sandbox_config *cfg, const char *session_id,
                     struct sandbox **ret, char **ret_err) {
  static _Atomic unsigned seq;
  char sh[4096];
  snprintf(sh, sizeof sh, "%s/bin/sh", cfg->rootfs);
  if (access(sh, F_OK) < 0 && faccessat(AT_FDCWD, sh, F_OK, AT_SYMLINK_NOFOLLOW) < 0) {
    *ret_err = xasprintf("the rootfs %s has no /bin/sh: build it with `make images` or point "
                         "IGN_MCP_ROOTFS at a rootfs directory",
                         cfg->rootfs);
    return -ENOENT;
  }

  _cleanup_free_ struct ns_sandbox *sb = calloc(1, sizeof *sb);
  if (!sb)
    return -ENOMEM;
  sb->base.ops = &sandbox_ns_ops;
  sb->base.isolation = "namespace";
  sb->err_fd = -1;
  sandbox_proc_init(&sb->proc);
  pthread_mutex_init(&sb->err_lock, NULL);

  char cg_name[64];
  snprintf(cg_name, sizeof cg_name, "ign-mcp-%d-%u", getpid(), ++seq);
  _cleanup_free_ char *cg_err = NULL;
  /* The overlay's tmpfs pages are charged to the sandbox's memory cgroup:
   * with a memory limit it is at most half of it (sandbox_overlay_mb). */
  unsigned overlay_mb = cfg->overlay_mb;
  if (cgroup_create(cg_name, cfg->memory_mb, cfg->pids, &sb->cg, &cg_err) < 0) {
    log_warn("session %s runs without memory and pids limits: %s", session_id, cg_err);
    snprintf(sb->base.limits, sizeof sb->base.limits, "overlay %u MiB; no cgroup limits",
             overlay_mb);
  } else {
    overlay_mb = sandbox_overlay_mb(cfg->memory_mb, cfg->overlay_mb);
    snprintf(sb->base.limits, sizeof sb->base.limits, "memory %u MiB, pids %u, overlay %u MiB%s",
             cfg->memory_mb, cfg->pids, overlay_mb,
             overlay_mb < cfg->overlay_mb ? " (at most half the memory limit)" : "");
  }

  int sv[2], errp[2], syncp[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
    int r = -errno;
    *ret_err = xasprintf("socketpair: %s", strerror(errno));
    cgroup_destroy(sb->cg);
    return r;
  }
  if (pipe2(errp, O_CLOEXEC) < 0) {
    int r = -errno;
    close(sv[0]);
    close(sv[1]);
    cgroup_destroy(sb->cg);
    *ret_err = xasprintf("pipe: %s", strerror(-r));
    return r;
  }
  if (pipe2(syncp, O_CLOEXEC) < 0) {
    int r = -errno;
    close(sv[0]);
    close(sv[1]);
    close(errp[0]);
    close(errp[1]);
    cgroup_destroy(sb->cg);
    *ret_err = xasprintf("pipe: %s", strerror(-r));
    return r;
  }
  _cleanup_close_ int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);

  char overlay[16];
  snprintf(overlay, sizeof overlay, "%u", overlay_mb);
  char *argv[] = {"ign-agent", "--ns", "--rootfs", (char *)cfg->rootfs, "--overlay-mb", overlay,
                  "--hostname", (char *)session_id, NULL};
  char *envp[] = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL};
  struct clone_args_ns a = {
      .agent = cfg->agent, .argv = argv, .envp = envp, .chan_fd = sv[1],
      .err_fd = errp[1], .sync_fd = syncp[0], .null_fd = null_fd,
  };
  int r = spawner_call(clone_agent, &a);
  close(sv[1]);
  close(errp[1]);
  close(syncp[0]);
  if (r < 0) {
    close(sv[0]);
    close(errp[0]);
    close(syncp[1]);
    cgroup_destroy(sb->cg);
    *ret_err = xasprintf("cannot create the namespaces (clone: %s); the ns backend needs root "
                         "or CAP_SYS_ADMIN",
                         strerror(-r));
    return r;
  }
  sandbox_proc_set(&sb->proc, a.ret_pid);
  if (sb->cg && (r = cgroup_attach(sb->cg, a.ret_pid)) < 0)
    log_warn("cannot move the sandbox of session %s into its cgroup: %s", session_id,
             strerror(-r));
  /* Release the child. */
  if (write(syncp[1], "x", 1) != 1)
    log_warn("cannot release the sandbox process of session %s", session_id);
  close(syncp[1]);

  sb->base.fd = sv[0];
  sb->err_fd = errp[0];
  *ret = &steal_ptr(sb)->base;
  return 0;
}

static int ns_ready(struct sandbox *base, struct agent_conn *conn, char **ret_err) {
  (void)conn;
  (void)ret_err;
  struct ns_sandbox *sb = (struct ns_sandbox *)base;
  /* The agent's stderr matters only while it starts up. */
  pthread_mutex_lock(&sb->err_lock);
  if (sb->err_fd >= 0) {
    close(sb->err_fd);
    sb->err_fd = -1;
  }
  pthread_mutex_unlock(&sb->err_lock);
  return 0;
}

static void ns_kill(struct sandbox *base) {
  sandbox_proc_kill(&((struct ns_sandbox *)base)->proc);
}

static void ns_destroy(struct sandbox *base) {
  struct ns_sandbox *sb = (struct ns_sandbox *)base;
  sandbox_proc_fini(&sb->proc);
  cgroup_destroy(sb->cg);
  if (sb->err_fd >= 0)
    close(sb->err_fd);
  pthread_mutex_destroy(&sb->err_lock);
  json_decref(sb->base.info);
  free(sb);
}

/* The first line the agent wrote on stderr (malloc'd), "" when none. */
static char *agent_said(struct ns_sandbox *sb) {
  pthread_mutex_lock(&sb->err_lock);
  if (sb->err_fd >= 0 && sb->err_len < sizeof sb->err_msg - 1) {
    fcntl(sb->err_fd, F_SETFL, O_NONBLOCK);
    ssize_t n = read(sb->err_fd, sb->err_msg + sb->err_len, sizeof sb->err_msg - 1 - sb->err_len);
    if (n > 0)
      sb->err_len += (size_t)n;
  }
  char *msg = strndup(sb->err_msg, strcspn(sb->err_msg, "\n"));
  pthread_mutex_unlock(&sb->err_lock);
  return msg;
}

static char *ns_death_reason(struct sandbox *base) {
  struct ns_sandbox *sb = (struct ns_sandbox *)base;
  int status = 0;
  /* Give a dying agent a moment to be reaped so its status is known. */
  bool reaped = sandbox_proc_wait(&sb->proc, 500, &status);
  _cleanup_free_ char *msg = agent_said(sb);
  if (!msg)
    return NULL;
  if (!reaped)
    return msg[0] ? strdup(msg) : NULL;
  if (WIFSIGNALED(status))
    return xasprintf("the sandbox's agent was killed by signal %d%s%s", WTERMSIG(status),
                     msg[0] ? ": " : "", msg);
  return xasprintf("the sandbox's agent exited with status %d%s%s", WEXITSTATUS(status),
                   msg[0] ? ": " : "", msg);
}

const struct sandbox_ops sandbox_ns_ops = {
    .name = "ns",
    .create = ns_create,
    .ready = ns_ready,
    .kill = ns_kill,
    .destroy = ns_destroy,
    .death_reason = ns_death_reason,
};
