/* ns_uid.c: who a namespace sandbox is on the host (see "Who the sandbox is
 * on the host" in ns.c): the blocks of 65536 host uids a root server gives
 * its sandboxes, each held with an flock under /run/ignition-mcp-uids until
 * the sandbox is reaped; the uid and gid maps the server writes for a
 * sandbox's user namespace (the block, or a user server's own uid); and
 * the idmapped mounts through which the sandbox sees a tree owned by host
 * root (the rootfs, a stage's layer) as its own. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/config.h"
#include "common/util.h"
#include "sandbox/ns_int.h"

/* Host-wide (not the server's run directory, which tests/fence.sh gives
 * each fenced server a private copy of). */
#define NS_UID_LOCK_DIR "/run/ignition-mcp-uids"

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
int ns_uid_take(unsigned base, unsigned *ret_uid, int ret_fds[2], char **ret_err) {
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
int ns_write_maps(pid_t pid, unsigned uid, char **ret_err) {
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
int ns_idmapped_tree(const char *what, const char *rootfs, int tree_fd, pid_t pid, int *ret_fd,
                     char **ret_err) {
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
