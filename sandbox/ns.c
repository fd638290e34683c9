/* ns.c: the namespace backend.
 *
 * A sandbox is ign-agent running as PID 1 of fresh user, mount, pid, net,
 * ipc, uts and cgroup namespaces, in a cgroup with memory and pids limits
 * where the host lets us make one.  The server clones the process, maps its
 * user namespace, places it in its cgroup and, as root, hands it an idmapped
 * copy of the rootfs; the agent itself (guest/ns_setup.c) builds the root:
 * the rootfs tree read-only under a size-capped tmpfs overlay, a fresh /proc
 * and a minimal /dev, loopback only, then drops every capability and
 * installs its seccomp filter.
 *
 * Who the sandbox is on the host (the user namespace):
 *   - The server runs as root: each sandbox gets a block of 65536 host uids
 *     and gids of its own, base + slot * 65536 (base IGN_MCP_NS_UID_BASE,
 *     default 0x70000000 = 1879048192, 256 slots: above the container ranges
 *     systemd hands out and below 2^31, away from the QEMUs' 0x49474e00
 *     range), uid 0 inside = the block's first uid.  Every per-user count of
 *     the kernel (inotify instances, fanotify groups, mqueue bytes, pipe
 *     pages, keys, processes, pending signals) is charged to that uid: not to
 *     host root, not to another session.  A block is held with an flock on
 *     /run/ignition-mcp-uids/<uid / 65536> (and on the next file too when the
 *     base is not a multiple of 65536): the files name host uids, so no two
 *     live sandboxes of any server on this host share a uid, whatever base
 *     each server was given; the lock is released only after the
 *     sandbox's PID 1 is reaped, which is after every process of its pid
 *     namespace is gone (a killed server's locks go with it, and its
 *     sandboxes die with it through PR_SET_PDEATHSIG).  The server writes
 *     uid_map and gid_map (setgroups stays allowed: root wrote the maps).
 *     The rootfs tree belongs to host root, which is unmapped inside: its
 *     files would show as nobody and overlayfs refuses to copy up files
 *     whose owner is unmapped.  So the server makes an idmapped mount of the
 *     tree (open_tree + mount_setattr(MOUNT_ATTR_IDMAP) with the sandbox's
 *     user namespace, read-only, nosuid, nodev) in which on-disk uid k is
 *     host uid base + slot * 65536 + k, i.e. uid k inside: the sandbox sees
 *     the rootfs exactly as before and may change any file (copy-up).  The
 *     mount travels to the child with SCM_RIGHTS on the socket that releases
 *     it, as fd 4 of the agent (--rootfs-fd).  Where no idmapped mount can
 *     be made (a file system without support for it, a kernel before 5.12,
 *     a valgrind that does not know the syscalls) the session runs without
 *     one, as for a server run as a user (below): the rootfs's files
 *     read-only, a fresh /root and /tmp; its limits say "rootfs read-only".
 *   - The server runs as a user: one mapping, uid and gid 0 inside = the
 *     user's own uid and gid (setgroups denied, as the kernel requires of an
 *     unprivileged writer).  Per-user counts are the user's, shared by the
 *     user's processes and every session of the user.  newuidmap and a
 *     subordinate range are not used: a user can only create user
 *     namespaces it owns, and the kernel charges the ucounts-based counts
 *     (RLIMIT_NPROC, RLIMIT_MSGQUEUE, RLIMIT_SIGPENDING, inotify) to the
 *     owner as well, so mapping root inside to a subordinate uid would
 *     separate little (pipe pages, keys) and would leave a rootfs the user
 *     owns unmapped, hence read-only.  An idmapped mount needs host root,
 *     so files of the rootfs owned by another uid (a rootfs built by root)
 *     show as nobody and cannot be changed; the agent then gives the
 *     sandbox a fresh /root and /tmp on the overlay's tmpfs (see
 *     ns_setup.c).  A rootfs the user owns is fully writable.  Without
 *     delegated cgroups (cgroup v1, or v2 without systemd's delegation) the
 *     pids limit is RLIMIT_NPROC, set in the child: counted per user
 *     namespace since Linux 5.14, it counts the sandbox's own processes and
 *     not the user's others; memory is then not enforced, and the limits
 *     string says so.
 *
 * Stages (see "stages" below and ns_stage.c): a commit copies the files the
 * sandbox changed (its overlay upper, read through the agent's fd of its
 * setup tmpfs) onto its own stage's layer, into one tree; a session from a
 * stage gets that tree as a second lower layer above the rootfs
 * (lowerdir=/stage:/lower), idmapped like the rootfs as root, bound from
 * /oldroot as a user; either way the layer of the directory checked when
 * the stage was opened, never whatever has its name by then.  Processes
 * are not carried: "files".
 *
 * Life and death: the agent's channel is one end of a socketpair whose other
 * end only the server holds, and the agent exits when it reads EOF; it also
 * has PR_SET_PDEATHSIG.  When PID 1 of a pid namespace exits, the kernel
 * kills everything else in it, so a SIGKILLed server leaves nothing behind. */
#include <dirent.h>
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
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <linux/netlink.h>

#include "common/nft_counters.h"
#include "common/util.h"
#include "common/config.h"
#include "common/log.h"
#include "sandbox/ns_stage.h"
#include "sandbox/sandbox.h"
#include "sandbox/stage.h"

/* Host-wide (not the server's run directory, which tests/fence.sh gives
 * each fenced server a private copy of). */
#define NS_UID_LOCK_DIR "/run/ignition-mcp-uids"
#define NS_ROOTFS_FD 4            /* the idmapped rootfs in the agent */
#define NS_STAGE_FD 5             /* the idmapped stage layer in the agent */
/* The agent's setup tmpfs (upper/, scratch/), open for its whole life:
 * AGENT_NS_STATE_FD of guest/agent.h. */
#define NS_STATE_FD 6
/* The agent's netfilter netlink socket, opened before it dropped its
 * capabilities, on which the server reads the refusal counters:
 * AGENT_NS_COUNTERS_FD of guest/agent.h. */
#define NS_COUNTERS_FD 7
#define NS_COUNTERS_TIMEOUT_MS 1000u /* the kernel answers a dump at once */
/* How long a commit waits for the sandbox's processes to stop. */
#define NS_FREEZE_TIMEOUT_MS 2000u

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
  int uid_lock_fds[2];      /* flocks held on the uid block's lock files, or -1 */
  unsigned host_uid;        /* uid 0 inside on the host (the block's first, or ours) */
  unsigned overlay_mb;      /* its disk: the tmpfs of its upper and scratch directories */
  const struct stage *stage; /* the stage it started from (held by the session), or NULL */
  int stage_layer_fd;       /* its layer/ (O_PATH), whatever is moved or renamed since, or -1 */
  char session_id[80];      /* for messages */
  /* The server's copy of the agent's counters socket (ns_ready), or -1 and
   * why not (a negative errno, a message); counters_lock keeps one dump at
   * a time on it. */
  pthread_mutex_t counters_lock;
  int counters_fd;
  int counters_errno;
  char counters_why[160];
};

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

/* ---- uids ---- */

bool ns_as_root(void) { return geteuid() == 0; }

/* Locks the file of one 65536-aligned range of host uids (INDEX = uid /
 * 65536): 0, -EWOULDBLOCK when a live sandbox holds it, or another -errno. */
static int ns_uid_lock(unsigned index, int *ret_fd, char **ret_err) {
  char path[128];
  snprintf(path, sizeof path, NS_UID_LOCK_DIR "/%u", index);
  int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot open %s: %s", path, strerror(errno));
    return r;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
    int r = errno == EWOULDBLOCK ? -EWOULDBLOCK : -errno;
    if (r != -EWOULDBLOCK)
      *ret_err = xasprintf("cannot lock %s: %s", path, strerror(errno));
    close(fd);
    return r;
  }
  *ret_fd = fd;
  return 0;
}

/* Takes a free uid block: flocks held until the sandbox is reaped.  The
 * lock files name host uids, not this server's slots: servers whose
 * IGN_MCP_NS_UID_BASE differ lock the same file for the same uids.  A block
 * locks every aligned range it touches (two where the base is not a
 * multiple of 65536), so two blocks that share a uid always share a lock
 * (and, with such a base, neighbouring blocks share one too: only every
 * other block can be live at once). */
static int ns_uid_take(unsigned base, unsigned *ret_uid, int ret_fds[2], char **ret_err) {
  static _Atomic unsigned next;
  /* The config refuses such a base; a caller that did not ask it must not
   * map a sandbox's root onto host root or an account. */
  if (base < NS_UID_BLOCK || base > UINT32_MAX - NS_UID_SLOTS * NS_UID_BLOCK) {
    *ret_err = xasprintf("IGN_MCP_NS_UID_BASE=%u is outside %u..%u: the sandboxes' uids would "
                         "include host accounts' (or root's), or reach 2^32 - 1",
                         base, NS_UID_BLOCK, UINT32_MAX - NS_UID_SLOTS * NS_UID_BLOCK);
    return -EINVAL;
  }
  if (mkdir(NS_UID_LOCK_DIR, 0700) < 0 && errno != EEXIST) {
    int r = -errno;
    *ret_err = xasprintf("cannot create %s for the sandboxes' uid blocks: %s", NS_UID_LOCK_DIR,
                         strerror(errno));
    return r;
  }
  unsigned start = (unsigned)getpid() * 7 + next++;
  for (unsigned i = 0; i < NS_UID_SLOTS; i++) {
    unsigned slot = (start + i) % NS_UID_SLOTS;
    unsigned uid = base + slot * NS_UID_BLOCK; /* its last uid is below 2^32 - 1 */
    unsigned first = uid / NS_UID_BLOCK, last = (uid + NS_UID_BLOCK - 1) / NS_UID_BLOCK;
    int fds[2] = {-1, -1};
    int r = ns_uid_lock(first, &fds[0], ret_err);
    if (r == 0 && last != first && (r = ns_uid_lock(last, &fds[1], ret_err)) < 0)
      close(fds[0]);
    if (r == -EWOULDBLOCK)
      continue;
    if (r < 0)
      return r;
    *ret_uid = uid;
    ret_fds[0] = fds[0];
    ret_fds[1] = fds[1];
    return 0;
  }
  *ret_err = xasprintf("all %u uid blocks for namespace sandboxes (from IGN_MCP_NS_UID_BASE=%u) "
                       "are held by running sessions on this host (" NS_UID_LOCK_DIR "): close "
                       "some sessions",
                       NS_UID_SLOTS, base);
  return -EBUSY;
}

static int ns_write_proc(pid_t pid, const char *name, const char *text, char **ret_err) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, name);
  _cleanup_close_ int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
    int r = -errno;
    *ret_err = xasprintf("cannot write %s to %s: %s", text, path, strerror(errno));
    return r;
  }
  return 0;
}

/* Maps uid and gid 0 of the child's user namespace: to the block from
 * UID as root, to our own uid and gid otherwise. */
static int ns_write_maps(pid_t pid, unsigned uid, char **ret_err) {
  char map[64];
  int r;
  if (ns_as_root()) {
    snprintf(map, sizeof map, "0 %u %u\n", uid, NS_UID_BLOCK);
    if ((r = ns_write_proc(pid, "uid_map", map, ret_err)) < 0 ||
        (r = ns_write_proc(pid, "gid_map", map, ret_err)) < 0)
      return r;
    return 0;
  }
  snprintf(map, sizeof map, "0 %u 1\n", (unsigned)geteuid());
  if ((r = ns_write_proc(pid, "uid_map", map, ret_err)) < 0 ||
      (r = ns_write_proc(pid, "setgroups", "deny", ret_err)) < 0)
    return r;
  snprintf(map, sizeof map, "0 %u 1\n", (unsigned)getegid());
  return ns_write_proc(pid, "gid_map", map, ret_err);
}

/* A detached, read-only mount of ROOTFS (the rootfs, or a stage's layer:
 * WHAT) in which host uid k shows as uid k of the child's user namespace.
 * TREE_FD >= 0: the directory is that fd's (ROOTFS names it in messages). */
static int ns_idmapped_tree(const char *what, const char *rootfs, int tree_fd, pid_t pid,
                            int *ret_fd, char **ret_err) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/ns/user", (int)pid);
  _cleanup_close_ int userns = open(path, O_RDONLY | O_CLOEXEC);
  if (userns < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot open %s: %s", path, strerror(errno));
    return r;
  }
  _cleanup_close_ int tree =
      tree_fd >= 0 ? open_tree(tree_fd, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH)
                   : open_tree(AT_FDCWD, rootfs, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
  if (tree < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot make a mount of the %s %s (open_tree: %s); Linux 5.12 or "
                         "later is needed",
                         what, rootfs, strerror(errno));
    return r;
  }
  struct mount_attr attr = {
      .attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
      .userns_fd = (uint64_t)userns,
  };
  if (mount_setattr(tree, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot make an idmapped mount of the %s %s (mount_setattr: %s): "
                         "its file system does not support idmapped mounts on this kernel; put "
                         "it on ext4, xfs or btrfs (or tmpfs with Linux 6.3 or later)",
                         what, rootfs, strerror(errno));
    return r;
  }
  *ret_fd = steal_fd(tree);
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

static void ns_close_pair(int fds[2]) {
  for (int i = 0; i < 2; i++)
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
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

static int ns_inputs_id(char **ret_id, char **ret_text, char **ret_err);

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

/* ---- the refusal counters ----
 *
 * The agent drops every capability before any program runs, and the kernel
 * answers nf_tables requests only when the socket's opener and its sender
 * both hold CAP_NET_ADMIN over the socket's network namespace
 * (netlink_net_capable).  So the agent opens a NETLINK_NETFILTER socket
 * before its drop and keeps it on NS_COUNTERS_FD, and once it answered
 * HELLO the server takes a copy with pidfd_getfd and sends the dumps
 * itself: the opener was the capable agent, and the sender is root, or the
 * user who owns the sandbox's user namespace and so holds every capability
 * in it.  pidfd_getfd needs ptrace access to the agent, as the commits'
 * /proc/<pid>/fd/6 does (see "stages" below).  No process of ours inside
 * the sandbox keeps a capability for it. */

/* Takes the copy.  0, or a negative errno with sb->counters_why. */
static int ns_take_counters_fd(struct ns_sandbox *sb, struct agent_conn *conn) {
  const char *no_capture = agent_conn_egress_error(conn);
  if (no_capture) {
    snprintf(sb->counters_why, sizeof sb->counters_why,
             "the sandbox has no capture of its traffic: %s", no_capture);
    return -ENOENT;
  }
  pthread_mutex_lock(&sb->proc.lock);
  int pidfd = sb->proc.reaped ? -1 : sb->proc.pidfd;
  int fd = pidfd < 0 ? -1 : (int)syscall(SYS_pidfd_getfd, pidfd, NS_COUNTERS_FD, 0);
  /* No pidfd: the agent is gone, or pidfd_open failed (before Linux 5.3). */
  int e = pidfd >= 0 ? errno : sb->proc.reaped ? ESRCH : ENOSYS;
  pthread_mutex_unlock(&sb->proc.lock);
  if (fd < 0) {
    snprintf(sb->counters_why, sizeof sb->counters_why,
             "cannot take the agent's netfilter socket (fd %d) with pidfd_getfd: %s%s",
             NS_COUNTERS_FD, strerror(e),
             e == EPERM ? " (the server needs ptrace access to its sandboxes' agents)" : "");
    return -e;
  }
  /* What the agent left there must be what it says: a netfilter netlink
   * socket, not anything a sandbox could have put in its place. */
  int domain = 0, protocol = -1;
  socklen_t len = sizeof domain;
  if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) < 0 || domain != AF_NETLINK ||
      (len = sizeof protocol, getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &protocol, &len)) < 0 ||
      protocol != NETLINK_NETFILTER) {
    close(fd);
    snprintf(sb->counters_why, sizeof sb->counters_why,
             "the agent's fd %d is not a netfilter netlink socket", NS_COUNTERS_FD);
    return -EPROTO;
  }
  sb->counters_fd = fd; /* close-on-exec: pidfd_getfd sets it */
  return 0;
}

static int ns_egress_counters(struct sandbox *base, uint64_t ret[3], char **ret_err) {
  struct ns_sandbox *sb = (struct ns_sandbox *)base;
  pthread_mutex_lock(&sb->counters_lock);
  int r = sb->counters_errno;
  char err[200];
  if (sb->counters_fd >= 0)
    r = nft_refused_dump(sb->counters_fd, NS_COUNTERS_TIMEOUT_MS, ret, err, sizeof err);
  else
    snprintf(err, sizeof err, "%s", sb->counters_why);
  pthread_mutex_unlock(&sb->counters_lock);
  if (r < 0)
    *ret_err = xasprintf("session %s: %s", sb->session_id, err);
  return r;
}

static int ns_ready(struct sandbox *base, struct agent_conn *conn, char **ret_err) {
  (void)ret_err;
  struct ns_sandbox *sb = (struct ns_sandbox *)base;
  /* The agent's stderr matters only while it starts up. */
  pthread_mutex_lock(&sb->err_lock);
  if (sb->err_fd >= 0) {
    close(sb->err_fd);
    sb->err_fd = -1;
  }
  pthread_mutex_unlock(&sb->err_lock);
  /* Without the counters the sandbox works as well: its record has no
   * refused_packets events, and the log says why. */
  pthread_mutex_lock(&sb->counters_lock);
  sb->counters_errno = ns_take_counters_fd(sb, conn);
  if (sb->counters_errno < 0 && sb->counters_errno != -ENOENT)
    log_warn("session %s: refused packets will not be counted: %s", sb->session_id,
             sb->counters_why);
  pthread_mutex_unlock(&sb->counters_lock);
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
  if (sb->stage_layer_fd >= 0)
    close(sb->stage_layer_fd);
  if (sb->counters_fd >= 0)
    close(sb->counters_fd);
  pthread_mutex_destroy(&sb->counters_lock);
  /* Reaped: nothing runs under the uid block any more. */
  ns_close_pair(sb->uid_lock_fds);
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

/* ---- stages ----
 *
 * A commit copies the sandbox's files (ns_stage.c): its overlay upper, and
 * its /root and /tmp when they are scratch directories apart from it.  The
 * upper stays where it is, on the sandbox's tmpfs, whose size is the
 * sandbox's disk limit: a write past it is ENOSPC inside the sandbox, the
 * pages are charged to its memory cgroup, and nothing is left on the host
 * when it dies (a host-side upper directory would need a quota of its own
 * and a cleanup after a killed server).  The server reads it through the
 * agent's fd of the setup tmpfs, /proc/<agent pid>/fd/NS_STATE_FD: a root
 * server may (CAP_SYS_PTRACE over every user namespace), and so may a user
 * server (it owns the sandbox's user namespace, where it holds every
 * capability, and the agent runs as its uid); the sandbox's own processes
 * may not (the agent is not dumpable).
 *
 * While the copy runs, the sandbox's processes are frozen when it has a
 * cgroup with a freezer, so the files are those of one instant.  Without
 * one (a user server without delegated cgroups) the copy is of a running
 * sandbox: a file written meanwhile may be copied half old, half new; the
 * session layer makes sure no call of ours runs, but a background process
 * of the sandbox's may.  The log says so. */

/* The agent's setup tmpfs, opened from the host. */
static int ns_open_state(struct ns_sandbox *sb, int *ret_fd, char **ret_err) {
  pthread_mutex_lock(&sb->proc.lock);
  pid_t pid = sb->proc.reaped ? 0 : sb->proc.pid;
  int pidfd = sb->proc.pidfd;
  pthread_mutex_unlock(&sb->proc.lock);
  if (pid <= 0) {
    *ret_err = xasprintf("the sandbox of session %s is gone: close it and open a new one",
                         sb->session_id);
    return -ESRCH;
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, NS_STATE_FD);
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot open the files of session %s through %s (the agent's setup "
                         "tmpfs): %s%s",
                         sb->session_id, path, strerror(errno),
                         errno == EACCES || errno == EPERM
                             ? "; the server needs ptrace access to its sandboxes' agents "
                               "(root, or the owner of their user namespaces)"
                             : "");
    return r;
  }
  /* Alive after the open: the pid was the agent's when it was opened. */
  if (pidfd >= 0 && syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) < 0) {
    close(fd);
    *ret_err = xasprintf("the sandbox of session %s died while it was being committed",
                         sb->session_id);
    return -ESRCH;
  }
  *ret_fd = fd;
  return 0;
}

static int ns_open_dir_at(int dfd, const char *name, int *ret_fd, char **ret_err) {
  int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot open %s: %s", name, strerror(errno));
    return r;
  }
  *ret_fd = fd;
  return 0;
}

/* The copy itself: the parent stage's layer (if any) is linked before the
 * freeze, the upper and scratch directories copied while frozen. */
static int ns_copy_layer(struct ns_sandbox *sb, int state, int layer, bool *frozen,
                         uint64_t *t0, struct ns_layer_stats *st, char **ret_err) {
  bool root = ns_as_root();
  /* What is copied from the sandbox is at most what its disk holds. */
  struct ns_layer_opts own = {.owners = root ? NS_LAYER_OWNERS_BLOCK : NS_LAYER_OWNERS_SELF,
                              .base = sb->host_uid,
                              .max_bytes = (uint64_t)sb->overlay_mb << 20};
  struct ns_layer_opts keep = {.owners = root ? NS_LAYER_OWNERS_KEEP : NS_LAYER_OWNERS_SELF};
  _cleanup_close_ int upper = -1, parent = -1, scratch = -1;
  int r;
  if ((r = ns_open_dir_at(state, "upper", &upper, ret_err)) < 0)
    return r;
  /* The layer the sandbox was laid over, by the fd opened then: not by
   * its path, whose name another server may have given to another stage
   * since (stage_rm, replace). */
  if (sb->stage_layer_fd >= 0) {
    if ((r = ns_open_dir_at(sb->stage_layer_fd, ".", &parent, ret_err)) < 0 ||
        (r = ns_layer_link(parent, layer, &keep, st, ret_err)) < 0)
      return r;
  }
  if (cgroup_can_freeze(sb->cg)) {
    *t0 = mono_us();
    *frozen = true;
    if ((r = cgroup_freeze(sb->cg, true, NS_FREEZE_TIMEOUT_MS, ret_err)) < 0)
      return r;
  }
  if ((r = ns_layer_apply(upper, layer, &own, st, ret_err)) < 0)
    return r;
  /* /root and /tmp of a sandbox that could not write the rootfs's. */
  if (ns_open_dir_at(state, "scratch", &scratch, ret_err) < 0) {
    free(steal_ptr(*ret_err));
    return 0;
  }
  static const char *const names[] = {"root", "tmp"};
  for (size_t i = 0; i < ARRAY_SIZE(names); i++) {
    _cleanup_close_ int fd = -1;
    if (ns_open_dir_at(scratch, names[i], &fd, ret_err) < 0) {
      free(steal_ptr(*ret_err));
      continue;
    }
    if ((r = ns_layer_apply_dir(fd, layer, names[i], &own, st, ret_err)) < 0)
      return r;
  }
  return 0;
}

static int ns_snapshot(struct sandbox *base, const char *dir, struct sandbox_snapshot *ret,
                       char **ret_err) {
  struct ns_sandbox *sb = (struct ns_sandbox *)base;
  _cleanup_close_ int state = -1, dirfd = -1, layer = -1;
  int r = ns_open_state(sb, &state, ret_err);
  if (r < 0)
    return r;
  if ((r = ns_open_dir_at(AT_FDCWD, dir, &dirfd, ret_err)) < 0)
    return r;
  if (mkdirat(dirfd, "layer", 0755) < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot create %s/layer: %s", dir, strerror(errno));
    return r;
  }
  if ((r = ns_open_dir_at(dirfd, "layer", &layer, ret_err)) < 0)
    return r;
  struct ns_layer_stats st = {0};
  bool frozen = false;
  uint64_t t0 = 0;
  _cleanup_free_ char *err = NULL;
  r = ns_copy_layer(sb, state, layer, &frozen, &t0, &st, &err);
  uint64_t paused = 0;
  if (frozen) {
    _cleanup_free_ char *thaw_err = NULL;
    /* Every path thaws: a sandbox left frozen would hang every call. */
    if (cgroup_freeze(sb->cg, false, NS_FREEZE_TIMEOUT_MS, &thaw_err) < 0)
      log_warn("session %s: %s", sb->session_id, thaw_err);
    paused = mono_us() - t0;
  }
  if (r < 0) {
    *ret_err = xasprintf("cannot save the files of session %s: %s", sb->session_id,
                         err ? err : strerror(-r));
    return r;
  }
  if (!frozen)
    log_info("session %s: committed while its processes ran (no cgroup freezer here): a file "
             "written meanwhile may be saved half written",
             sb->session_id);
  if (st.dropped_special || st.skipped_owner || st.unreadable || st.xattrs_dropped)
    log_warn("session %s: the stage leaves out %llu device nodes or sockets, %llu files owned "
             "by uids outside the sandbox, %llu files the server could not read and %llu "
             "extended attributes",
             sb->session_id, (unsigned long long)st.dropped_special,
             (unsigned long long)st.skipped_owner, (unsigned long long)st.unreadable,
             (unsigned long long)st.xattrs_dropped);
  log_info("session %s: layer of %llu entries (%llu linked from its stage, %llu hard links of "
           "its own, %llu whiteouts), %llu bytes copied, paused %llu us",
           sb->session_id, (unsigned long long)st.entries, (unsigned long long)st.linked,
           (unsigned long long)st.relinked, (unsigned long long)st.whiteouts,
           (unsigned long long)st.bytes,
           (unsigned long long)paused);
  ret->carries = "files";
  ret->paused_us = paused;
  return 0;
}

/* What the agent binary is: XXH3-64 of its content, computed once per
 * version of the file (device, inode, size, mtime). */
static int ns_agent_hash(const char *path, uint64_t *ret, char **ret_err) {
  static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
  static struct stat seen;
  static uint64_t hash;
  static bool known;
  _cleanup_close_ int fd = open(path, O_RDONLY | O_CLOEXEC);
  struct stat s;
  if (fd < 0 || fstat(fd, &s) < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot read the agent %s: %s", path, strerror(errno));
    return r;
  }
  pthread_mutex_lock(&lock);
  bool same = known && s.st_dev == seen.st_dev && s.st_ino == seen.st_ino &&
              s.st_size == seen.st_size && s.st_mtim.tv_sec == seen.st_mtim.tv_sec &&
              s.st_mtim.tv_nsec == seen.st_mtim.tv_nsec;
  uint64_t h = hash;
  pthread_mutex_unlock(&lock);
  if (!same) {
    XXH3_state_t *x = XXH3_createState();
    if (!x)
      return -ENOMEM;
    XXH3_64bits_reset(x);
    char buf[65536];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0)
      XXH3_64bits_update(x, buf, (size_t)n);
    h = XXH3_64bits_digest(x);
    XXH3_freeState(x);
    if (n < 0) {
      int r = -errno;
      *ret_err = xasprintf("cannot read the agent %s: %s", path, strerror(errno));
      return r;
    }
    pthread_mutex_lock(&lock);
    seen = s;
    hash = h;
    known = true;
    pthread_mutex_unlock(&lock);
  }
  *ret = h;
  return 0;
}

/* What the rootfs tree is: the image build's stamp (image/build-rootfs-*.sh
 * write .ign-rootfs-stamp last, from their inputs), else the tree's own
 * directory and top-level entries (inode and mtime: a rebuilt or swapped
 * tree differs). */
static int ns_rootfs_id(const char *rootfs, uint64_t *ret, const char **ret_how,
                        char **ret_err) {
  _cleanup_free_ char *stamp = xasprintf("%s/.ign-rootfs-stamp", rootfs);
  _cleanup_close_ int fd = open(stamp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  char buf[4096];
  if (fd >= 0) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n > 0) {
      *ret = XXH3_64bits(buf, (size_t)n);
      *ret_how = "its build stamp";
      return 0;
    }
  }
  DIR *d = opendir(rootfs);
  struct stat s;
  if (!d || fstat(dirfd(d), &s) < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot read the rootfs %s: %s", rootfs, strerror(errno));
    if (d)
      closedir(d);
    return r;
  }
  XXH64_hash_t h = XXH3_64bits_withSeed(&s.st_ino, sizeof s.st_ino, (uint64_t)s.st_mtim.tv_sec);
  struct dirent *e;
  while ((e = readdir(d))) {
    struct stat es;
    if (fstatat(dirfd(d), e->d_name, &es, AT_SYMLINK_NOFOLLOW) < 0)
      continue;
    /* Order-independent: readdir's order is not the tree's identity. */
    uint64_t v[3] = {(uint64_t)es.st_ino, (uint64_t)es.st_mtim.tv_sec,
                     (uint64_t)es.st_mtim.tv_nsec};
    h ^= XXH3_64bits_withSeed(v, sizeof v, XXH3_64bits(e->d_name, strlen(e->d_name)));
  }
  closedir(d);
  *ret = h;
  *ret_how = "its top-level entries (no build stamp)";
  return 0;
}

static int ns_inputs_id(char **ret_id, char **ret_text, char **ret_err) {
  if (!cfg.rootfs || !cfg.agent) {
    *ret_err = xasprintf("no %s: build it with `make images` (or point %s at one)",
                         !cfg.rootfs ? "rootfs" : "ign-agent",
                         !cfg.rootfs ? "IGN_MCP_ROOTFS" : "the server's install");
    return -ENOENT;
  }
  uint64_t agent, rootfs;
  const char *how;
  int r;
  if ((r = ns_agent_hash(cfg.agent, &agent, ret_err)) < 0 ||
      (r = ns_rootfs_id(cfg.rootfs, &rootfs, &how, ret_err)) < 0)
    return r;
  /* The id names contents, not paths: servers with other checkouts of the
   * same agent and rootfs share their stages. */
  char key[128];
  snprintf(key, sizeof key, NS_LAYER_VERSION " agent=%016llx rootfs=%016llx",
           (unsigned long long)agent, (unsigned long long)rootfs);
  *ret_id = xasprintf("b-%016llx", (unsigned long long)XXH3_64bits(key, strlen(key)));
  *ret_text = xasprintf("ns: %s (agent %s, content XXH3 %016llx; rootfs %s, by %s)", key,
                        cfg.agent, (unsigned long long)agent, cfg.rootfs, how);
  return 0;
}

const struct sandbox_ops sandbox_ns_ops = {
    .name = "ns",
    .create = ns_create,
    .ready = ns_ready,
    .kill = ns_kill,
    .destroy = ns_destroy,
    .death_reason = ns_death_reason,
    .inputs_id = ns_inputs_id,
    .snapshot = ns_snapshot,
    .egress_counters = ns_egress_counters,
};
