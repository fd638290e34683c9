/* ns_setup.c: the filesystem and identity of a namespace sandbox (--ns).
 *
 * The server clones us into new user, mount, pid, net, ipc and uts
 * namespaces (the cgroup namespace we make ourselves, see ns_mount_proc) and
 * maps uid 0 of ours to a host uid of the sandbox's own (a root server) or to
 * the user's (a server run as a user); we are PID 1, root of our user
 * namespace, and still see the host's filesystem.  Following bubblewrap's
 * technique:
 *   1. make every mount private, so nothing we do propagates to the host;
 *   2. mount a tmpfs of --overlay-mb MiB on /tmp and pivot_root into it, so
 *      the host's root sits at /oldroot (with its real /tmp, where a test's
 *      rootfs may live);
 *   3. overlay the read-only rootfs tree (lower), and a stage's layer above
 *      it when the session starts from a stage (--stage, --stage-fd), with
 *      upper and work dirs on that tmpfs, whose size caps what the sandbox
 *      can write (ENOSPC).  The tmpfs stays open on AGENT_NS_STATE_FD for
 *      the server to read a commit from (ns_setup.h).  A
 *      root server hands us the tree as an idmapped mount (--rootfs-fd), in
 *      which its files belong to our uids, so every file can be changed
 *      (copied up); without it (a server run as a user) files owned by an
 *      unmapped uid cannot be, and /root and /tmp, which must be writable,
 *      become fresh directories on the tmpfs when they are not.  Overlay
 *      keeps its own metadata in user.* xattrs (userxattr): a user
 *      namespace may not write trusted.* ones;
 *   4. build /proc (masked like Docker's defaults) and a minimal /dev with
 *      device nodes bound from the host's /dev; no sysfs;
 *   5. detach /oldroot and pivot_root into the overlay: nothing of the host
 *      remains reachable.
 * Then the hostname and loopback.  The tmpfs root itself is detached at the
 * end; the overlay keeps its upper layer alive.  Every failure logs one
 * line and aborts the setup: a half-built sandbox is never served. */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/util.h"
#include "guest/agent_core.h"
#include "guest/machine.h"
#include "guest/ns_setup.h"

/* /proc as container runtimes show it (the masked and read-only paths of
 * crun, runc and Docker), and more: files whose content is the host's and
 * no business of a sandbox are replaced by /dev/null (read as empty).
 *   Docker's: kcore, keys, timer_list, timer_stats, sched_debug,
 *     latency_stats, interrupts, and sysrq-trigger (read-only there; a
 *     write can crash the host, so nothing here);
 *   ours: key-users (who holds keys on the host), slabinfo and vmallocinfo
 *     (the kernel heap's layout, for exploits), config.gz and cmdline (the
 *     host kernel's build and boot options, boot secrets included), kallsyms
 *     and the kpage* files (kernel symbols, physical page flags). */
static const char *const ns_proc_null_files[] = {
    "kcore", "keys", "key-users", "timer_list", "timer_stats", "sched_debug", "latency_stats",
    "interrupts", "sysrq-trigger", "slabinfo", "vmallocinfo", "config.gz", "cmdline", "kallsyms",
    "kpagecount", "kpageflags", "kpagecgroup",
};
/* Hardware the sandbox has no part in: an empty read-only directory. */
static const char *const ns_proc_empty_dirs[] = {"acpi", "asound", "scsi"};
static const char *const ns_proc_readonly[] = {"sys", "bus", "fs", "irq"};
static const char *const ns_dev_nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};
static const struct {
  const char *target, *name;
} ns_dev_links[] = {
    {"/proc/self/fd", "fd"},
    {"/proc/self/fd/0", "stdin"},
    {"/proc/self/fd/1", "stdout"},
    {"/proc/self/fd/2", "stderr"},
};

/* Log "ns setup: <message>: <strerror(errno)>" and return -errno. */
__attribute__((format(printf, 1, 2))) static int ns_fail(const char *fmt, ...) {
  int err = errno ? errno : EINVAL;
  char what[2 * PATH_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  agent_log("ns setup: %s: %s", what, strerror(err));
  return -err;
}

static int ns_mount(const char *src, const char *target, const char *type, unsigned long flags,
                    const char *data) {
  if (mount(src, target, type, flags, data) < 0)
    return ns_fail("cannot mount %s on %s%s%s", type ? type : src, target, data ? " with " : "",
                   data ? data : "");
  return 0;
}

static int ns_bind(const char *src, const char *target) {
  if (mount(src, target, NULL, MS_BIND, NULL) < 0)
    return ns_fail("cannot bind %s on %s", src, target);
  return 0;
}

static int ns_pivot_root(const char *new_root, const char *put_old) {
  if (syscall(SYS_pivot_root, new_root, put_old) < 0)
    return ns_fail("cannot pivot_root(%s, %s)", new_root, put_old);
  return 0;
}

/* A mount point that must be a real directory (a symlink would be followed
 * out of the overlay).  Created with MODE when the rootfs lacks it. */
static int ns_ensure_dir(const char *path, mode_t mode) {
  if (mkdir(path, mode) == 0) {
    if (chmod(path, mode) < 0) /* mkdir's mode is umasked */
      return ns_fail("cannot chmod %s", path);
    return 0;
  }
  if (errno != EEXIST)
    return ns_fail("cannot create %s", path);
  struct stat st;
  if (lstat(path, &st) < 0)
    return ns_fail("cannot stat %s", path);
  if (!S_ISDIR(st.st_mode)) {
    errno = ENOTDIR;
    return ns_fail("%s exists in the rootfs but is not a directory", path);
  }
  return 0;
}

static bool ns_exists(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0;
}

/* The setup tmpfs stays open on AGENT_NS_STATE_FD for the server's commits
 * (ns_setup.h): the upper layer stays on this size-capped tmpfs, and the
 * server reads it through the fd instead of the sandbox writing to the
 * host.  Close-on-exec: no command inherits it. */
static int ns_keep_state_fd(void) {
  int fd = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return ns_fail("cannot open the setup tmpfs");
  if (fd == AGENT_NS_STATE_FD)
    return 0;
  /* Fds 0-3 and the layers' (4, 5) are all that is open here. */
  int r = dup3(fd, AGENT_NS_STATE_FD, O_CLOEXEC);
  close(fd);
  if (r < 0)
    return ns_fail("cannot keep the setup tmpfs on fd %d", AGENT_NS_STATE_FD);
  return 0;
}

/* Steps 1-2: private mounts, a tmpfs root, the host at /oldroot. */
static int ns_enter_tmpfs(unsigned overlay_mb) {
  char opts[64];
  int r;
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    return ns_fail("cannot make the mounts private");
  snprintf(opts, sizeof opts, "size=%um,mode=0755", overlay_mb);
  if ((r = ns_mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts)) < 0)
    return r;
  if (chdir("/tmp") < 0)
    return ns_fail("cannot enter the new tmpfs");
  static const char *const dirs[] = {"newroot", "oldroot", "upper", "work",
                                     "lower",   "stage",   "scratch"};
  for (size_t i = 0; i < ARRAY_SIZE(dirs); i++)
    if (mkdir(dirs[i], 0755) < 0)
      return ns_fail("cannot create /tmp/%s", dirs[i]);
  if ((r = ns_pivot_root(".", "oldroot")) < 0)
    return r;
  if (chdir("/") < 0)
    return ns_fail("cannot enter the new root");
  return ns_keep_state_fd();
}

/* Are we in a user namespace other than the host's?  (Its uid_map is then
 * not the identity over every uid.) */
static bool ns_in_userns(void) {
  char map[128] = "";
  int fd = open("/proc/self/uid_map", O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return true;
  ssize_t n = read(fd, map, sizeof map - 1);
  close(fd);
  unsigned long in, out, count;
  return n <= 0 || sscanf(map, "%lu %lu %lu", &in, &out, &count) != 3 || in != 0 || out != 0 ||
         count != 4294967295ul;
}

/* Puts a lower layer at AT (/lower, /stage): the server's mount of it on
 * FD (an idmapped one), or a bind of PATH as seen from the host
 * (/oldroot/PATH).  WHAT names it in messages.  INO (not 0): what was
 * bound must be the directory DEV:INO, the one the server checked; a name
 * is only a name, and another server may have renamed a different
 * directory onto it since. */
static int ns_attach_layer(const char *what, const char *path, int fd, const char *at,
                           dev_t dev, ino_t ino) {
  char host[PATH_MAX];
  struct stat st;
  /* Any absolute path: it reaches overlayfs as AT, not in its options
   * (which split on ',', ':' and '\\'). */
  if (fd < 0 && path[0] != '/') {
    errno = EINVAL;
    return ns_fail("%s '%s' must be an absolute path", what, path);
  }
  if (fd >= 0) {
    if (move_mount(fd, "", AT_FDCWD, at, MOVE_MOUNT_F_EMPTY_PATH) < 0)
      return ns_fail("cannot attach the idmapped mount of %s '%s' (fd %d)", what, path, fd);
    close(fd);
    return 0;
  }
  int n = snprintf(host, sizeof host, "/oldroot%s", path);
  if (n < 0 || (size_t)n >= sizeof host) {
    errno = ENAMETOOLONG;
    return ns_fail("%s '%s'", what, path);
  }
  if (stat(host, &st) < 0)
    return ns_fail("cannot use %s '%s'", what, path);
  if (!S_ISDIR(st.st_mode)) {
    errno = ENOTDIR;
    return ns_fail("%s '%s'", what, path);
  }
  int r = ns_bind(host, at);
  if (r < 0 || ino == 0)
    return r;
  if (stat(at, &st) < 0)
    return ns_fail("cannot stat %s", at);
  if (st.st_dev != dev || st.st_ino != ino) {
    errno = ESTALE;
    return ns_fail("%s '%s' is no longer the directory the server checked (another was renamed "
                   "onto its name meanwhile)",
                   what, path);
  }
  return 0;
}

/* Step 3: the rootfs tree under a writable overlay at /newroot, with a
 * stage's layer between them when the session starts from one.  The stage
 * keeps overlay's own marks (whiteouts, opaque directories) as a lower
 * layer does: what the session that made it deleted or replaced stays so. */
static int ns_mount_overlay(const struct ns_options *o) {
  char opts[128];
  int r;
  /* The overlay's options are shown in /proc/self/mountinfo: the layers are
   * at /lower and /stage (the server's idmapped mounts, or bound there), so
   * that they name them and not their host paths.  Both go with the setup
   * tmpfs at the end; the overlay keeps its own references to its layers. */
  if ((r = ns_attach_layer("rootfs", o->rootfs, o->rootfs_fd, "/lower", 0, 0)) < 0)
    return r;
  bool stage = o->stage_fd >= 0 || o->stage;
  if (stage && (r = ns_attach_layer("stage", o->stage ? o->stage : "(fd)", o->stage_fd, "/stage",
                                    o->stage_dev, o->stage_ino)) < 0)
    return r;
  snprintf(opts, sizeof opts, "lowerdir=%s/lower,upperdir=/upper,workdir=/work%s",
           stage ? "/stage:" : "", ns_in_userns() ? ",userxattr" : "");
  return ns_mount("overlay", "/newroot", "overlay", MS_NOSUID | MS_NODEV, opts);
}

/* PATH (a directory of the rootfs the sandbox must be able to write in) is
 * left as it is when a file can be made in it.  When its owner is a uid our
 * user namespace does not map (a rootfs of host root's, a server run as a
 * user), overlayfs cannot copy it up: it becomes a fresh directory on the
 * setup tmpfs (/scratch/NAME, the same size cap), owned by our root. */
static int ns_writable_dir(const char *path, const char *name, mode_t mode) {
  char probe[PATH_MAX], scratch[PATH_MAX];
  snprintf(probe, sizeof probe, "%s/.ign-write-probe", path);
  if (mkdir(probe, 0700) == 0) {
    if (rmdir(probe) < 0)
      return ns_fail("cannot remove %s", probe);
    return 0;
  }
  if (errno != EOVERFLOW && errno != EACCES && errno != EPERM)
    return ns_fail("cannot write in %s", path);
  agent_log("ns setup: %s of the rootfs cannot be written in this user namespace (%s: its owner "
            "is not mapped here); it is a fresh empty directory instead",
            path + strlen("/newroot"), strerror(errno));
  snprintf(scratch, sizeof scratch, "/scratch/%s", name);
  int r;
  if ((r = ns_ensure_dir(scratch, mode)) < 0)
    return r;
  return ns_bind(scratch, path);
}

/* Step 4a: a fresh proc for our pid namespace, with Docker's masks and a
 * cgroup namespace of our own. */
static int ns_mount_proc(void) {
  char path[PATH_MAX];
  int r;
  /* /proc/self/cgroup shows paths from the root of the reader's cgroup
   * namespace.  The server has put us in the session's groups before
   * letting us run, so a namespace made now has them as its root: "/"
   * instead of the server's pid and group names.  (Created by the server's
   * clone, it would have the server's group as its root.) */
  if (unshare(CLONE_NEWCGROUP) < 0)
    return ns_fail("cannot create a cgroup namespace");
  if ((r = ns_ensure_dir("/newroot/proc", 0555)) < 0 ||
      (r = ns_mount("proc", "/newroot/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL)) < 0)
    return r;
  /* Kernel internals, key material, and a way to crash the host. */
  for (size_t i = 0; i < ARRAY_SIZE(ns_proc_null_files); i++) {
    snprintf(path, sizeof path, "/newroot/proc/%s", ns_proc_null_files[i]);
    if (ns_exists(path) && (r = ns_bind("/oldroot/dev/null", path)) < 0)
      return r;
  }
  for (size_t i = 0; i < ARRAY_SIZE(ns_proc_empty_dirs); i++) {
    snprintf(path, sizeof path, "/newroot/proc/%s", ns_proc_empty_dirs[i]);
    if (ns_exists(path) &&
        (r = ns_mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                      "mode=0555,size=4k")) < 0)
      return r;
  }
  /* Host-wide knobs: readable, never writable. */
  for (size_t i = 0; i < ARRAY_SIZE(ns_proc_readonly); i++) {
    snprintf(path, sizeof path, "/newroot/proc/%s", ns_proc_readonly[i]);
    if (!ns_exists(path))
      continue;
    if ((r = ns_bind(path, path)) < 0)
      return r;
    if (mount(NULL, path, NULL,
              MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
      return ns_fail("cannot make %s read-only", path);
  }
  return 0;
}

/* Step 4b: a minimal /dev. */
static int ns_mount_dev(unsigned shm_mb) {
  char src[PATH_MAX], path[PATH_MAX], opts[64];
  int r;
  if ((r = ns_ensure_dir("/newroot/dev", 0755)) < 0 ||
      (r = ns_mount("tmpfs", "/newroot/dev", "tmpfs", MS_NOSUID | MS_NOEXEC,
                    "mode=0755,size=1m")) < 0)
    return r;
  for (size_t i = 0; i < ARRAY_SIZE(ns_dev_nodes); i++) {
    snprintf(src, sizeof src, "/oldroot/dev/%s", ns_dev_nodes[i]);
    snprintf(path, sizeof path, "/newroot/dev/%s", ns_dev_nodes[i]);
    if (!ns_exists(src))
      continue; /* a host without /dev/tty, say */
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0)
      return ns_fail("cannot create %s", path);
    close(fd);
    if ((r = ns_bind(src, path)) < 0)
      return r;
  }
  for (size_t i = 0; i < ARRAY_SIZE(ns_dev_links); i++) {
    snprintf(path, sizeof path, "/newroot/dev/%s", ns_dev_links[i].name);
    if (symlink(ns_dev_links[i].target, path) < 0)
      return ns_fail("cannot create %s", path);
  }
  /* Ptys are a convenience (script, python's pty): without devpts the
   * sandbox still works, so a failure here is only logged. */
  if ((r = ns_ensure_dir("/newroot/dev/pts", 0755)) < 0)
    return r;
  if (mount("devpts", "/newroot/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
            "newinstance,ptmxmode=0666,mode=620") < 0) {
    agent_log("ns setup: no /dev/pts (mounting devpts failed: %m); continuing without ptys");
  } else if (symlink("pts/ptmx", "/newroot/dev/ptmx") < 0) {
    return ns_fail("cannot create /newroot/dev/ptmx");
  }
  snprintf(opts, sizeof opts, "mode=1777,size=%um", shm_mb);
  if ((r = ns_ensure_dir("/newroot/dev/shm", 01777)) < 0 ||
      (r = ns_mount("tmpfs", "/newroot/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opts)) < 0)
    return r;
  return 0;
}

/* Step 5: leave only the overlay. */
static int ns_enter_newroot(void) {
  int r;
  if (umount2("/oldroot", MNT_DETACH) < 0)
    return ns_fail("cannot detach the host's root");
  if (chdir("/newroot") < 0)
    return ns_fail("cannot enter /newroot");
  /* pivot_root(".", ".") stacks the old root (the tmpfs) on top of the new
   * one; unmounting "." then removes exactly that layer. */
  if ((r = ns_pivot_root(".", ".")) < 0)
    return r;
  if (umount2(".", MNT_DETACH) < 0)
    return ns_fail("cannot detach the setup tmpfs");
  if (chdir("/") < 0)
    return ns_fail("cannot enter the sandbox's root");
  return 0;
}

int ns_setup(const struct ns_options *o) {
  int r;
  /* A session of our own: no controlling terminal of the server's can be
   * reached from the sandbox (/dev/tty, TIOCSTI). */
  if (setsid() < 0)
    return ns_fail("cannot start a new session");
  if ((r = ns_enter_tmpfs(o->overlay_mb)) < 0 || (r = ns_mount_overlay(o)) < 0)
    return r;
  /* A minimal rootfs may lack these. */
  if ((r = ns_ensure_dir("/newroot/tmp", 01777)) < 0 ||
      (r = ns_ensure_dir("/newroot/root", 0700)) < 0 ||
      (r = ns_writable_dir("/newroot/tmp", "tmp", 01777)) < 0 ||
      (r = ns_writable_dir("/newroot/root", "root", 0700)) < 0)
    return r;
  if ((r = ns_mount_proc()) < 0 || (r = ns_mount_dev(o->overlay_mb)) < 0 ||
      (r = ns_enter_newroot()) < 0)
    return r;
  if ((r = machine_set_hostname(o->hostname, strlen(o->hostname))) < 0) {
    errno = -r;
    return ns_fail("cannot set the hostname to '%s'", o->hostname);
  }
  if ((r = machine_loopback_up()) < 0) {
    errno = -r;
    return ns_fail("cannot bring the loopback interface up");
  }
  return 0;
}
