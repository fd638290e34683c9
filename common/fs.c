/* fs.c: removing trees that someone else may have filled (QEMU's state
 * directories, a sandbox's files), reading a file from such a directory,
 * and making directories. */
#include "common/fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"

/* Removing a state directory.  It belongs to QEMU's uid, which may have put
 * links, FIFOs and directories there, nested as deep as it liked: every step
 * is relative to an fd of the directory it is in and nothing is followed, so
 * a link is removed, never what it points to.  The walk descends at most
 * REMOVE_MAX_DEPTH directories (as many fds); a directory found deeper is
 * moved up to the top of the tree (renamed, which follows nothing either)
 * and removed in a later pass, so that no depth leaves the tree behind.
 * REMOVE_MAX_PASSES bounds the work should something keep adding to it. */
#define REMOVE_MAX_DEPTH 8
#define REMOVE_MAX_PASSES 100000u

/* NAME for a log line: QEMU chose it, so no control characters (a newline
 * would forge a line of the server's log), and not all of it. */
static void printable_name(const char *name, char *buf, size_t size) {
  size_t i = 0;
  for (; name[i] && i + 1 < size; i++)
    buf[i] = (unsigned char)name[i] < 0x20 || name[i] == 0x7f ? '?' : name[i];
  buf[i] = '\0';
}

static void remove_warn(const char *name, unsigned depth, int err) {
  char shown[80];
  printable_name(name, shown, sizeof shown);
  log_warn("cannot remove %s%s: %s", depth ? ".../" : "", shown, strerror(err));
}

/* Removes NAME under PARENT (an fd of a directory in the tree whose top is
 * the fd TOP), and all in it when it is a directory; sets *RET_MOVED when
 * it moved a directory up to TOP instead. */
static void remove_at(int top, int parent, const char *name, unsigned depth, bool *ret_moved) {
  if (unlinkat(parent, name, 0) == 0 || errno == ENOENT)
    return;
  if (errno != EISDIR) {
    remove_warn(name, depth, errno);
    return;
  }
  if (depth >= REMOVE_MAX_DEPTH) {
    static _Atomic unsigned moves;
    for (int tries = 0; tries < 16; tries++) {
      char up[32];
      snprintf(up, sizeof up, ".ign-deep-%u", ++moves);
      if (renameat2(parent, name, top, up, RENAME_NOREPLACE) == 0) {
        *ret_moved = true;
        return;
      }
      if (errno != EEXIST)
        break;
    }
    remove_warn(name, depth, errno);
    return;
  }
  int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (!d) {
    int e = errno;
    if (fd >= 0)
      close(fd);
    remove_warn(name, depth, e);
    return;
  }
  struct dirent *e;
  while ((e = readdir(d)))
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
      remove_at(top, dirfd(d), e->d_name, depth + 1, ret_moved);
  closedir(d);
  if (unlinkat(parent, name, AT_REMOVEDIR) < 0 && errno != ENOENT)
    remove_warn(name, depth, errno);
}

void fs_remove_tree(const char *dir) {
  _cleanup_close_ int top = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (top < 0) {
    /* Not a directory (or a link to one): only the name goes. */
    if ((errno == ENOTDIR || errno == ELOOP) && unlinkat(AT_FDCWD, dir, 0) == 0)
      return;
    if (errno != ENOENT)
      log_warn("cannot remove %s: %s", dir, strerror(errno));
    return;
  }
  bool moved = true;
  for (unsigned pass = 0; moved && pass < REMOVE_MAX_PASSES; pass++) {
    moved = false;
    /* A fresh fd per pass: the DIR owns it, and reads from the start. */
    int fd = openat(top, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
      if (fd >= 0)
        close(fd);
      break;
    }
    struct dirent *e;
    while ((e = readdir(d)))
      if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
        remove_at(top, dirfd(d), e->d_name, 1, &moved);
    closedir(d);
  }
  if (rmdir(dir) < 0 && errno != ENOENT)
    log_warn("cannot remove %s: %s", dir, strerror(errno));
}

int fs_mkdir_p(const char *path, mode_t parents_mode, mode_t mode) {
  _cleanup_free_ char *p = strdup(path);
  if (!p)
    return -ENOMEM;
  for (char *s = p + 1; *s; s++)
    if (*s == '/') {
      *s = '\0';
      if (mkdir(p, parents_mode) < 0 && errno != EEXIST)
        return -errno;
      *s = '/';
    }
  if (mkdir(p, mode) < 0 && errno != EEXIST)
    return -errno;
  return 0;
}

int fs_own_dir(const char *d, const char *what, mode_t max, char **ret_err) {
  int r = fs_mkdir_p(d, 0755, 0700);
  if (r < 0) {
    *ret_err = xasprintf("cannot make the %s %s: %s (IGN_MCP_STORE must be a writable directory)",
                         what, d, strerror(-r));
    return r;
  }
  struct stat st;
  if (lstat(d, &st) < 0 || !S_ISDIR(st.st_mode)) {
    *ret_err = xasprintf("%s is not a directory (a link?): move it away so that the server can "
                         "make its %s there",
                         d, what);
    return -ENOTDIR;
  }
  /* Whoever may write in it may plant entries, swap one for a link while a
   * server checks, deletes or uses it, or rename what a server is about to
   * delete: only the server's own uid, never a group. */
  if (st.st_uid != geteuid()) {
    *ret_err = xasprintf("%s belongs to uid %u, not to the server's uid %u: whoever owns it can "
                         "plant or swap what the server keeps there; move it away (or chown it to "
                         "uid %u) and try again",
                         d, (unsigned)st.st_uid, (unsigned)geteuid(), (unsigned)geteuid());
    return -EPERM;
  }
  if ((st.st_mode & 0777 & ~max) && chmod(d, st.st_mode & max) < 0) {
    r = -errno;
    *ret_err = xasprintf("%s is writable by its group or open to others, and its mode cannot be "
                         "narrowed (%s): chmod 0700 it and try again",
                         d, strerror(errno));
    return r;
  }
  return 0;
}

int fs_open_one_name(int dir_fd, const char *name, uid_t owner, int *ret_fd, char **ret_why) {
  _cleanup_close_ int fd =
      openat(dir_fd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) < 0) {
    int r = -errno;
    *ret_why = r == -ELOOP ? xasprintf("it is a symbolic link") : xasprintf("%s", strerror(-r));
    return r;
  }
  if (!S_ISREG(st.st_mode)) {
    *ret_why = xasprintf("it is not a regular file");
    return -EINVAL;
  }
  if (st.st_nlink != 1) {
    *ret_why = xasprintf("it has %ju names, a hard link to a file elsewhere",
                         (uintmax_t)st.st_nlink);
    return -EMLINK;
  }
  if (st.st_uid != owner) {
    *ret_why = xasprintf("it belongs to uid %u, not to uid %u", (unsigned)st.st_uid,
                         (unsigned)owner);
    return -EPERM;
  }
  *ret_fd = steal_fd(fd);
  return 0;
}
