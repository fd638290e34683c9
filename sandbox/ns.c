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
 * Stages (see ns_snapshot.c and ns_stage.c): a commit copies the files the
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
 * kills everything else in it, so a SIGKILLed server leaves nothing behind.
 *
 * The backend's files: ns_uid.c the uid blocks of a root server and the
 * id mapping (uid_map, the idmapped mounts); ns_create.c the sandbox's
 * creation (the clone into the namespaces, its cgroup and limits, the
 * agent's start); ns_snapshot.c the commits and what a sandbox is made of
 * (inputs_id); ns_stage.c the stage layer's copy.  This file holds the ops
 * table and a started sandbox's life: ready (the refusal counters), kill,
 * why it died, and its teardown.  What they share is in ns_int.h. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <linux/netlink.h>

#include "common/log.h"
#include "common/nft_counters.h"
#include "common/util.h"
#include "sandbox/ns_int.h"

#define NS_COUNTERS_TIMEOUT_MS 1000u /* the kernel answers a dump at once */

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
 * /proc/<pid>/fd/6 does (see ns_snapshot.c).  No process of ours inside
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
  /* Killed while a final snapshot left it frozen: thawed, so that its
   * processes can die and be reaped. */
  cgroup_thaw_now(sb->cg);
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

const struct sandbox_ops sandbox_ns_ops = {
    .name = "ns",
    .create = ns_create,
    .ready = ns_ready,
    .kill = ns_kill,
    .destroy = ns_destroy,
    .death_reason = ns_death_reason,
    .inputs_id = ns_inputs_id,
    .snapshot = ns_snapshot,
    .unpause = ns_unpause,
    .egress_counters = ns_egress_counters,
};
