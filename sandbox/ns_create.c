/* ns_create.c: a namespace sandbox's creation: the clone of the agent into
 * fresh user, mount, pid, net, ipc and uts namespaces (on the spawner
 * thread, as the uid block's owner when the server is root), its cgroup or
 * the rlimits that stand in for one, its user namespace's maps and the
 * idmapped rootfs and stage layer handed to it, and its release as root of
 * its namespace; and the probe that says whether this host lets us make
 * those namespaces at all.  The agent builds the sandbox's root itself
 * (guest/ns_setup.c). */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "sandbox/ns_int.h"
#include "sandbox/stage.h"

struct clone_args_ns {
  const char *agent;
  char **argv;              /* ends "--rootfs-fd", "4", NULL: cut when no mount came */
  bool want_stage_fd;       /* argv has "--stage-fd 5": the message must carry it */
  size_t rootfs_fd_arg;     /* index of "--rootfs-fd" in argv */
  char *const *envp;
  int chan_fd;              /* child's end of the socketpair */
  int err_fd;               /* write end of the stderr pipe */
  int sync_fd;              /* child's end: released (and the rootfs) once mapped */
  int null_fd;
  uid_t owner;              /* the user namespace's owner (root), or -1 */
  bool clear_groups;        /* setgroups(0): root wrote the gid map */
  unsigned long nproc;      /* RLIMIT_NPROC for the sandbox, 0 for none */
  unsigned long data;       /* RLIMIT_DATA in bytes for each process, 0 for none */
  pid_t ret_pid;
};

#define NS_CLONE_FLAGS                                                                       \
  (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)

/* The spawner thread back to euid and egid 0 (the uid first: it brings back
 * the capability to set the gid), and the process's dumpable flag as it was
 * (DUMPABLE), which a change of either cleared.  Going on as another user
 * would be worse than dying. */
static void ns_spawner_restore(int dumpable) {
  if (syscall(SYS_setresuid, -1, 0, -1) < 0 || syscall(SYS_setresgid, -1, 0, -1) < 0)
    abort();
  if (dumpable == 1)
    prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
}

/* Runs on the spawner thread.  Between clone and execve the child makes raw
 * system calls only. */
static int clone_agent(void *p) {
  struct clone_args_ns *a = p;
  /* No CLONE_NEWCGROUP: the agent makes its cgroup namespace once it is in
   * the session's groups (guest/ns_setup.c). */
  /* The kernel charges the per-user counts of a user namespace (RLIMIT_*
   * ucounts, inotify instances) to its owner as well, and the owner is the
   * euid that creates it: as root, create it as the block's first uid.  On
   * this thread only: raw syscalls change one thread's credentials (glibc's
   * wrappers would change every thread's), and ruid and suid stay 0 so the
   * capabilities come back with euid 0. */
  bool as_owner = a->owner != (uid_t)-1;
  /* A change of euid also makes the whole process undumpable: put back what
   * it was. */
  int dumpable = as_owner ? prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) : -1;
  if (as_owner && (syscall(SYS_setresgid, -1, a->owner, -1) < 0 ||
                   syscall(SYS_setresuid, -1, a->owner, -1) < 0)) {
    int e = errno;
    ns_spawner_restore(dumpable);
    return -e;
  }
  pid_t pid = (pid_t)syscall(SYS_clone, NS_CLONE_FLAGS | SIGCHLD, NULL, NULL, NULL, NULL);
  int clone_errno = errno;
  if (pid != 0 && as_owner)
    ns_spawner_restore(dumpable);
  if (pid < 0)
    return -clone_errno;
  if (pid == 0) {
    char c = 0;
    int tree_fd = -1, stage_fd = -1, fds[2] = {-1, -1};
    union {
      struct cmsghdr h;
      char buf[CMSG_SPACE(2 * sizeof(int))];
    } u;
    struct iovec iov = {.iov_base = &c, .iov_len = 1};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                        .msg_controllen = sizeof u.buf};
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    /* The server writes our uid and gid maps, then releases us; the message
     * carries the idmapped rootfs when there is one. */
    if (recvmsg(a->sync_fd, &mh, MSG_CMSG_CLOEXEC) != 1 || c != 'x')
      _exit(126);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
      size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      memcpy(fds, CMSG_DATA(cm), (n > 2 ? 2 : n) * sizeof(int));
      tree_fd = fds[0];
      stage_fd = n > 1 ? fds[1] : -1;
    }
    if (a->want_stage_fd && stage_fd < 0)
      _exit(126);
    /* Until now we were the server's host uid, unmapped in here: become
     * root of the namespace (the block's first uid, or the user's own). */
    if (syscall(SYS_setresgid, 0, 0, 0) < 0 ||
        (a->clear_groups && syscall(SYS_setgroups, 0, NULL) < 0) ||
        syscall(SYS_setresuid, 0, 0, 0) < 0)
      _exit(125);
    /* A change of uid clears the death signal: set it again, then tell the
     * server, which is then known to be alive (else EPIPE). */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (send(a->sync_fd, "y", 1, MSG_NOSIGNAL) != 1)
      _exit(126);
    if (a->nproc) {
      struct rlimit rl = {.rlim_cur = a->nproc, .rlim_max = a->nproc};
      if (syscall(SYS_prlimit64, 0, RLIMIT_NPROC, &rl, NULL) < 0)
        _exit(125);
    }
    if (a->data) {
      struct rlimit rl = {.rlim_cur = a->data, .rlim_max = a->data};
      if (syscall(SYS_prlimit64, 0, RLIMIT_DATA, &rl, NULL) < 0)
        _exit(125);
    }
    if (tree_fd >= 0 && (tree_fd = fcntl(tree_fd, F_DUPFD, 10)) < 0)
      _exit(126);
    if (stage_fd >= 0 && (stage_fd = fcntl(stage_fd, F_DUPFD, 10)) < 0)
      _exit(126);
    if (tree_fd < 0)
      a->argv[a->rootfs_fd_arg] = NULL; /* our own copy of the array */
    if (dup2(a->null_fd, 0) < 0 || dup2(a->null_fd, 1) < 0 || dup2(a->err_fd, 2) < 0 ||
        dup2(a->chan_fd, 3) < 0 || (tree_fd >= 0 && dup2(tree_fd, NS_ROOTFS_FD) < 0) ||
        (stage_fd >= 0 && dup2(stage_fd, NS_STAGE_FD) < 0))
      _exit(126);
    /* Only fds 0-3 (and the rootfs and stage mounts) reach the sandbox,
     * whatever the server inherited. */
    int keep = stage_fd >= 0 ? NS_STAGE_FD + 1 : tree_fd >= 0 ? NS_ROOTFS_FD + 1 : 4;
    if (syscall(SYS_close_range, keep, ~0U, 0) < 0)
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

int ns_probe(char **ret_err) {
  pid_t pid = (pid_t)syscall(SYS_clone, NS_CLONE_FLAGS | SIGCHLD, NULL, NULL, NULL, NULL);
  if (pid == 0)
    _exit(0);
  if (pid < 0) {
    int e = errno;
    bool perm = e == EPERM || e == EACCES || e == ENOSPC;
    *ret_err = xasprintf(
        "cannot create user, mount, pid, net, ipc, uts and cgroup namespaces: %s%s", strerror(e),
        !perm ? ""
        : ns_as_root()
            ? " (something forbids namespaces to root here, e.g. a seccomp filter of a container)"
            : " (this host does not let users create user namespaces: see "
              "/proc/sys/user/max_user_namespaces, /proc/sys/kernel/unprivileged_userns_clone "
              "and /proc/sys/kernel/apparmor_restrict_unprivileged_userns)");
    return -e;
  }
  while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
    ;
  return 0;
}

/* Releases the child (with the rootfs mount, or none) and waits for it to
 * say it is root of its namespace. */
static int ns_release(int sync_fd, int tree_fd, int stage_fd) {
  char c = 'x';
  union {
    struct cmsghdr h;
    char buf[CMSG_SPACE(2 * sizeof(int))];
  } u;
  memset(&u, 0, sizeof u);
  struct iovec iov = {.iov_base = &c, .iov_len = 1};
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  int fds[2] = {tree_fd, stage_fd};
  size_t nfds = tree_fd < 0 ? 0 : stage_fd < 0 ? 1 : 2;
  if (nfds) {
    mh.msg_control = u.buf;
    mh.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(nfds * sizeof(int));
    memcpy(CMSG_DATA(cm), fds, nfds * sizeof(int));
  }
  if (sendmsg(sync_fd, &mh, MSG_NOSIGNAL) != 1)
    return -errno;
  ssize_t n;
  while ((n = read(sync_fd, &c, 1)) < 0 && errno == EINTR)
    ;
  return n == 1 && c == 'y' ? 0 : n < 0 ? -errno : -ECHILD;
}

/* STAGE's layer/ as an O_PATH fd, opened relative to the directory checked
 * when the stage was opened (never by its name, which another server's
 * commit with replace may give to another stage at any time), without
 * following a link: *ret_fd, and *ret_path, where it is now (for the agent
 * of a user's server, which binds it by that name and checks that it bound
 * this directory, and for messages). */
static int ns_open_layer(const struct stage *stage, int *ret_fd, char **ret_path,
                         char **ret_err) {
  _cleanup_close_ int fd = -1;
  int r = stage_open_file(stage, "layer", O_PATH | O_DIRECTORY, &fd, ret_err);
  if (r == -ELOOP || r == -ENOTDIR) {
    free(*ret_err);
    *ret_err = xasprintf("stage %s cannot be used: %s/layer is not a directory of its own (%s); "
                         "remove the stage with stage_rm and commit it again",
                         stage->name ? stage->name : stage->id, stage->dir, strerror(-r));
    return -EBADMSG;
  }
  if (r < 0)
    return r;
  char proc[64], path[PATH_MAX];
  snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(proc, path, sizeof path - 1);
  if (n <= 0 || (size_t)n >= sizeof path - 1 || path[0] != '/') {
    r = n < 0 ? -errno : -ENAMETOOLONG;
    *ret_err = xasprintf("the layer of stage %s cannot be located (%s): is /proc mounted?",
                         stage->name ? stage->name : stage->id, strerror(-r));
    return r;
  }
  path[n] = '\0';
  *ret_path = strdup(path);
  if (!*ret_path)
    return -ENOMEM;
  *ret_fd = steal_fd(fd);
  return 0;
}

int ns_create(const struct sandbox_config *cfg, const char *session_id, struct sandbox **ret,
              char **ret_err) {
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
  sb->stage_layer_fd = -1;
  sb->counters_fd = -1;
  sb->counters_errno = -ENOENT;
  sandbox_proc_init(&sb->proc);
  pthread_mutex_init(&sb->err_lock, NULL);
  pthread_mutex_init(&sb->counters_lock, NULL);
  sb->uid_lock_fds[0] = sb->uid_lock_fds[1] = -1;

  bool root = ns_as_root();
  unsigned host_uid = (unsigned)geteuid();
  _cleanup_close_ int tree_fd = -1, stage_fd = -1;
  _cleanup_free_ char *layer = NULL;
  int r;
  /* The stage's layer, opened relative to the checked directory without
   * following a link: a root server mounts this fd; a user's agent binds
   * its path and checks that it bound this directory (its inode). */
  _cleanup_close_ int layer_fd = -1;
  char layer_inode[48] = "";
  if (cfg->stage) {
    struct stat lst;
    if ((r = ns_open_layer(cfg->stage, &layer_fd, &layer, ret_err)) < 0)
      return r;
    if (fstat(layer_fd, &lst) < 0) {
      r = -errno;
      *ret_err = xasprintf("cannot examine the layer of stage %s: %s",
                           cfg->stage->name ? cfg->stage->name : cfg->stage->id, strerror(errno));
      return r;
    }
    snprintf(layer_inode, sizeof layer_inode, "%ju:%ju", (uintmax_t)lst.st_dev,
             (uintmax_t)lst.st_ino);
  }
  if (root && (r = ns_uid_take(cfg->ns_uid_base, &host_uid, sb->uid_lock_fds, ret_err)) < 0)
    return r;

  char cg_name[64];
  snprintf(cg_name, sizeof cg_name, "ign-mcp-%d-%u", getpid(), ++seq);
  _cleanup_free_ char *cg_err = NULL;
  /* The overlay's tmpfs pages are charged to the sandbox's memory cgroup:
   * it is at most half the memory limit (sandbox_overlay_mb), and without a
   * cgroup too: the same size either way, and less of the host's memory
   * that nothing accounts for. */
  unsigned overlay_mb = sandbox_overlay_mb(cfg->memory_mb, cfg->overlay_mb);
  unsigned long nproc = 0, data = 0;
  if (cgroup_create(cg_name, cfg->memory_mb, cfg->pids, &sb->cg, &cg_err) < 0) {
    /* RLIMIT_NPROC counts the processes of our uid in the sandbox's user
     * namespace: a pids limit of its own.  Memory has no equivalent: the
     * session's total is not limited, only each process's data (heap and
     * private writable mappings; reservations without access, as Go and
     * V8 make, do not count) to the memory limit, so that one runaway
     * process gets ENOMEM before the host runs short. */
    nproc = cfg->pids;
    data = (unsigned long)cfg->memory_mb << 20;
    log_warn("session %s runs without a cgroup (memory is not limited but per process; pids %u "
             "by RLIMIT_NPROC): %s",
             session_id, cfg->pids, cg_err);
    snprintf(sb->base.limits, sizeof sb->base.limits,
             "pids %u (RLIMIT_NPROC), overlay %u MiB; memory not enforced (no cgroup; %u MiB "
             "data per process)",
             cfg->pids, overlay_mb, cfg->memory_mb);
  } else {
    snprintf(sb->base.limits, sizeof sb->base.limits, "memory %u MiB, pids %u, overlay %u MiB%s",
             cfg->memory_mb, cfg->pids, overlay_mb,
             overlay_mb < cfg->overlay_mb ? " (at most half the memory limit)" : "");
  }

  int sv[2] = {-1, -1}, errp[2] = {-1, -1}, syncp[2] = {-1, -1};
  _cleanup_close_ int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0 || pipe2(errp, O_CLOEXEC) < 0 ||
      socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, syncp) < 0 || null_fd < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot make the sandbox's channel: %s", strerror(errno));
    goto fail;
  }

  char overlay[16], rootfs_fd[16], stage_fd_arg[16];
  snprintf(overlay, sizeof overlay, "%u", overlay_mb);
  snprintf(rootfs_fd, sizeof rootfs_fd, "%d", NS_ROOTFS_FD);
  snprintf(stage_fd_arg, sizeof stage_fd_arg, "%d", NS_STAGE_FD);
  /* A stage's layer: as root an idmapped mount like the rootfs's (its
   * files belong to on-disk uids 0..65535, the sandbox's through the
   * mapping); as a user its path now and its inode, which the agent binds
   * from /oldroot and checks. */
  char *argv[16] = {"ign-agent", "--ns", "--rootfs", (char *)cfg->rootfs, "--overlay-mb",
                    overlay, "--hostname", (char *)session_id};
  size_t argc = 8;
  if (layer) {
    argv[argc++] = root ? "--stage-fd" : "--stage";
    argv[argc++] = root ? stage_fd_arg : layer;
    if (!root) {
      argv[argc++] = "--stage-inode";
      argv[argc++] = layer_inode;
    }
  }
  argv[argc++] = "--rootfs-fd";
  argv[argc++] = rootfs_fd;
  argv[argc] = NULL;
  sb->stage = cfg->stage;
  snprintf(sb->session_id, sizeof sb->session_id, "%s", session_id);
  sb->host_uid = host_uid;
  sb->overlay_mb = overlay_mb;
  char *envp[] = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL};
  struct clone_args_ns a = {
      .agent = cfg->agent, .argv = argv, .rootfs_fd_arg = argc - 2, .envp = envp,
      .want_stage_fd = layer && root,
      .chan_fd = sv[1], .err_fd = errp[1], .sync_fd = syncp[1], .null_fd = null_fd,
      .owner = root ? (uid_t)host_uid : (uid_t)-1, .clear_groups = root, .nproc = nproc,
      .data = data,
  };
  r = spawner_call(clone_agent, &a);
  close(sv[1]);
  close(errp[1]);
  close(syncp[1]);
  sv[1] = errp[1] = syncp[1] = -1;
  if (r < 0) {
    _cleanup_free_ char *why = NULL;
    ns_probe(&why);
    *ret_err = why ? steal_ptr(why)
                   : xasprintf("cannot create the namespaces (clone: %s)", strerror(-r));
    goto fail;
  }
  sandbox_proc_set(&sb->proc, a.ret_pid);
  sb->err_fd = steal_fd(errp[0]);

  if ((r = ns_write_maps(a.ret_pid, host_uid, ret_err)) < 0)
    goto fail_child;
  if (root) {
    /* Without an idmapped mount the session still works, with the rootfs's
     * files read-only (their owner is not mapped) and a fresh /root and
     * /tmp: said in its limits, and logged once per server. */
    static _Atomic bool warned;
    _cleanup_free_ char *why = NULL;
    if (ns_idmapped_tree("rootfs", cfg->rootfs, -1, a.ret_pid, &tree_fd, &why) < 0) {
      if (!warned) {
        warned = true;
        log_warn("%s; namespace sessions see the rootfs's files read-only", why);
      }
      size_t n = strlen(sb->base.limits);
      snprintf(sb->base.limits + n, sizeof sb->base.limits - n,
               "; rootfs read-only (no idmapped mount)");
    }
    if (layer && tree_fd < 0) {
      r = -EOPNOTSUPP;
      *ret_err = xasprintf("cannot start session %s from stage %s: a root server lays a stage "
                           "through an idmapped mount, and none can be made here (%s); start it "
                           "from the base instead",
                           session_id, cfg->stage->name ? cfg->stage->name : cfg->stage->id, why);
      goto fail_child;
    }
    if (layer && (r = ns_idmapped_tree("stage layer", layer, layer_fd, a.ret_pid, &stage_fd,
                                       ret_err)) < 0)
      goto fail_child;
  }
  if (sb->cg && (r = cgroup_attach(sb->cg, a.ret_pid)) < 0)
    log_warn("cannot move the sandbox of session %s into its cgroup: %s", session_id,
             strerror(-r));
  if ((r = ns_release(syncp[0], tree_fd, stage_fd)) < 0) {
    *ret_err = r == -EPIPE || r == -ECHILD
                   ? strdup("the sandbox's first process exited before it became root of its "
                            "user namespace (setresuid or setgroups failed)")
                   : xasprintf("cannot release the sandbox's first process: %s", strerror(-r));
    goto fail_child;
  }
  ns_close_pair(syncp);

  /* What the sandbox is made of, for a stage committed from it later. */
  if (cfg->stage) {
    snprintf(sb->base.inputs_id, sizeof sb->base.inputs_id, "%s", cfg->stage->inputs_id);
  } else {
    _cleanup_free_ char *id = NULL, *text = NULL, *err = NULL;
    if (ns_inputs_id(&id, &text, &err) == 0)
      snprintf(sb->base.inputs_id, sizeof sb->base.inputs_id, "%s", id);
  }
  sb->base.info = json_pack("{s:I}", "host_uid", (json_int_t)host_uid);
  if (cfg->stage && sb->base.info)
    json_object_set_new(sb->base.info, "stage_layer", json_string("files (overlay lower layer)"));
  sb->base.fd = sv[0];
  sb->stage_layer_fd = steal_fd(layer_fd);
  *ret = &steal_ptr(sb)->base;
  return 0;

fail_child:
  sandbox_proc_kill_wait(&sb->proc);
fail:
  sandbox_proc_fini(&sb->proc);
  pthread_mutex_destroy(&sb->err_lock);
  pthread_mutex_destroy(&sb->counters_lock);
  ns_close_pair(sv);
  ns_close_pair(errp);
  ns_close_pair(syncp);
  if (sb->err_fd >= 0)
    close(sb->err_fd);
  cgroup_destroy(sb->cg);
  ns_close_pair(sb->uid_lock_fds);
  return r;
}
