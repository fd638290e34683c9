/* hostio.c: host paths confined to IGN_MCP_HOST_IO_ROOT (see hostio.h).
 *
 * The check is the kernel's, not ours: every path is opened with
 * openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS) from an fd of the root
 * taken once at startup, so symlinks are resolved as part of the same lookup
 * that decides, and there is no gap between a check and an open for a
 * planted symlink to slip into.  The only lexical step is turning an
 * absolute path inside the root into a relative one (and the kernel still
 * resolves that beneath the root).
 *
 * What is read is looked at through an O_PATH fd first: a FIFO or a device
 * is refused without ever being opened for reading (opening a FIFO would
 * wait for a writer; opening a device can do things).  Writes go through
 * tar_unpack, whose staging and rename keep the destination as it was
 * until a copy is complete. */
#include "common/hostio.h"

#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"

static int root_fd = -1;
static char *root_path;
static bool copy_out_on;
static char *init_failure; /* why hostio_init failed, for every later call */

const char *hostio_root(void) { return root_path; }
bool hostio_copy_out_enabled(void) { return copy_out_on; }

int hostio_init(const char *root, bool copy_out, char **ret_err) {
  copy_out_on = copy_out;
  if (!root || root[0] != '/') {
    *ret_err = xasprintf("the host I/O root '%s' is not an absolute path (IGN_MCP_HOST_IO_ROOT)",
                         root ? root : "");
    free(init_failure);
    init_failure = strdup(*ret_err);
    return -EINVAL;
  }
  int fd = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    *ret_err = xasprintf("cannot open the host I/O root %s (IGN_MCP_HOST_IO_ROOT): %s", root,
                         strerror(e));
    free(init_failure);
    init_failure = strdup(*ret_err);
    return -e;
  }
  if (root_fd >= 0)
    close(root_fd);
  root_fd = fd;
  free(root_path);
  root_path = strdup(root);
  /* Kept without a trailing slash ("/" stays "/"): the prefix test below
   * depends on it. */
  for (size_t n = strlen(root_path); n > 1 && root_path[n - 1] == '/'; n--)
    root_path[n - 1] = 0;
  free(init_failure);
  init_failure = NULL;
  log_info("host paths (stdin_file, copy_in, copy_out) are confined to %s "
           "(IGN_MCP_HOST_IO_ROOT); writing to the host is %s (IGN_MCP_COPY_OUT)",
           root_path, copy_out ? "on" : "off");
  return 0;
}

static int not_ready(char **ret_err) {
  *ret_err = xasprintf("host paths are not available: %s",
                       init_failure ? init_failure : "the host I/O root was not opened");
  return -ENOENT;
}

static char *outside_msg(const char *path) {
  return xasprintf("%s is outside the host I/O root %s (IGN_MCP_HOST_IO_ROOT): host paths are "
                   "relative to the root or absolute inside it, and neither \"..\" nor a "
                   "symlink may lead out of it; name a path inside it or start the server with "
                   "another IGN_MCP_HOST_IO_ROOT",
                   path, root_path);
}

/* PATH as a path relative to the root (malloc'd; "." for the root itself),
 * trailing slashes dropped so that every step sees the final component the
 * kernel will ("link/" is "link", a symlink, and refused where one is). */
static int to_relative(const char *path, char **ret_rel, char **ret_err) {
  if (!path || !*path) {
    *ret_err = xasprintf("the host path is empty: give a path relative to %s "
                         "(IGN_MCP_HOST_IO_ROOT) or absolute inside it",
                         root_path);
    return -EINVAL;
  }
  if (strlen(path) >= PATH_MAX) {
    *ret_err = xasprintf("the host path is longer than %d bytes", PATH_MAX - 1);
    return -ENAMETOOLONG;
  }
  const char *rel = path;
  if (path[0] == '/') {
    size_t n = strlen(root_path);
    if (strcmp(root_path, "/") == 0)
      rel = path;
    else if (strncmp(path, root_path, n) == 0 && (path[n] == '/' || path[n] == 0))
      rel = path + n;
    else {
      *ret_err = outside_msg(path);
      return -EACCES;
    }
    while (*rel == '/')
      rel++;
  }
  char *r = strdup(*rel ? rel : ".");
  if (!r)
    abort();
  for (size_t n = strlen(r); n > 1 && r[n - 1] == '/'; n--)
    r[n - 1] = 0;
  *ret_rel = r;
  return 0;
}

/* openat2 beneath the root; a negative errno (EXDEV: it would leave). */
static int open_beneath(const char *rel, uint64_t flags) {
  struct open_how how = {
      .flags = flags | O_CLOEXEC,
      .resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS,
  };
  for (int tries = 0; tries < 16; tries++) {
    int fd = (int)syscall(SYS_openat2, root_fd, rel, &how, sizeof how);
    if (fd >= 0)
      return fd;
    /* EAGAIN: a rename elsewhere raced the lookup; the kernel asks for a
     * retry. */
    if (errno != EAGAIN)
      return -errno;
  }
  return -EAGAIN;
}

/* The message for a failed open_beneath of PATH. */
static char *open_failure_msg(const char *path, int r) {
  switch (-r) {
  case EXDEV:
    return outside_msg(path);
  case ENOENT:
    return xasprintf("%s does not exist (host paths are resolved in %s, IGN_MCP_HOST_IO_ROOT)",
                     path, root_path);
  case ELOOP:
    return xasprintf("%s: too many levels of symlinks, or a symlink where none is followed",
                     path);
  case ENOSYS:
    return xasprintf("%s: this kernel has no openat2 (Linux 5.6 or later is needed for host "
                     "paths)",
                     path);
  default:
    return xasprintf("cannot open %s: %s", path, strerror(-r));
  }
}

static const char *kind_of(mode_t m) {
  switch (m & S_IFMT) {
  case S_IFIFO:
    return "a FIFO";
  case S_IFCHR:
  case S_IFBLK:
    return "a device";
  case S_IFSOCK:
    return "a socket";
  case S_IFLNK:
    return "a symlink";
  case S_IFDIR:
    return "a directory";
  default:
    return "not a regular file";
  }
}

/* Opens the regular file behind the O_PATH fd PFD for reading: through
 * /proc/self/fd (the same inode, already known to be a regular file). */
static int reopen_regular(int pfd) {
  char p[64];
  snprintf(p, sizeof p, "/proc/self/fd/%d", pfd);
  int fd = open(p, O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0)
    return -errno;
  struct stat a, b;
  if (fstat(pfd, &a) < 0 || fstat(fd, &b) < 0 || a.st_ino != b.st_ino || a.st_dev != b.st_dev ||
      !S_ISREG(b.st_mode)) {
    close(fd);
    return -ESTALE;
  }
  return fd;
}

int hostio_read_file(const char *path, size_t max, void **ret_data, size_t *ret_len,
                     char **ret_err) {
  if (root_fd < 0)
    return not_ready(ret_err);
  _cleanup_free_ char *rel = NULL;
  int r = to_relative(path, &rel, ret_err);
  if (r < 0)
    return r;
  _cleanup_close_ int pfd = open_beneath(rel, O_PATH);
  if (pfd < 0) {
    r = pfd;
    *ret_err = open_failure_msg(path, r);
    return r;
  }
  struct stat st;
  if (fstat(pfd, &st) < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot read %s: %s", path, strerror(errno));
    return r;
  }
  if (!S_ISREG(st.st_mode)) {
    *ret_err = xasprintf("%s is %s: only a regular file can be read from the host", path,
                         kind_of(st.st_mode));
    return S_ISDIR(st.st_mode) ? -EISDIR : -EINVAL;
  }
  if ((uint64_t)st.st_size > max) {
    *ret_err = xasprintf("%s is %llu bytes: at most %zu can be read from the host here", path,
                         (unsigned long long)st.st_size, max);
    return -EFBIG;
  }
  _cleanup_close_ int fd = reopen_regular(pfd);
  if (fd < 0) {
    r = fd;
    *ret_err = xasprintf("cannot open %s: %s", path, strerror(-r));
    return r;
  }
  /* One byte more than the cap: a file that grew since the fstat is
   * refused rather than cut. */
  _cleanup_free_ char *buf = malloc(max + 1 ? max + 1 : 1);
  if (!buf)
    abort();
  size_t len = 0;
  while (len < max + 1) {
    ssize_t n = read(fd, buf + len, max + 1 - len);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      r = -errno;
      *ret_err = xasprintf("cannot read %s: %s", path, strerror(errno));
      return r;
    }
    if (n == 0)
      break;
    len += (size_t)n;
  }
  if (len > max) {
    *ret_err = xasprintf("%s is more than %zu bytes: at most %zu can be read from the host here",
                         path, max, max);
    return -EFBIG;
  }
  *ret_data = steal_ptr(buf);
  *ret_len = len;
  return 0;
}

/* The last component of REL ("." and ".." are not names). */
static const char *last_name(const char *rel) {
  const char *s = strrchr(rel, '/');
  s = s ? s + 1 : rel;
  if (!*s || !strcmp(s, ".") || !strcmp(s, ".."))
    return NULL;
  return s;
}

/* REL's parent, relative to the root (malloc'd). */
static char *parent_of(const char *rel) {
  const char *s = strrchr(rel, '/');
  if (!s)
    return strdup(".");
  size_t n = (size_t)(s - rel);
  while (n > 0 && rel[n - 1] == '/')
    n--;
  return n ? strndup(rel, n) : strdup(".");
}

/* The name of the directory behind FD (for a copy of the root itself or of
 * "a/.."): the last component of where it is. */
static char *dir_name_of(int fd) {
  char p[64], buf[PATH_MAX];
  snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(p, buf, sizeof buf - 1);
  if (n <= 0)
    return strdup("root");
  buf[n] = 0;
  const char *s = strrchr(buf, '/');
  s = s ? s + 1 : buf;
  return strdup(*s ? s : "root");
}

int hostio_copy_from(const char *path, int out_fd, const struct tar_limits *lim,
                     const atomic_bool *cancelled, struct tar_report *rep, char **ret_err) {
  if (root_fd < 0)
    return not_ready(ret_err);
  _cleanup_free_ char *rel = NULL;
  int r = to_relative(path, &rel, ret_err);
  if (r < 0)
    return r;
  /* The final component is not followed: a symlink there is refused like
   * a symlink anywhere in a copied tree is never followed. */
  _cleanup_close_ int pfd = open_beneath(rel, O_PATH | O_NOFOLLOW);
  if (pfd < 0) {
    *ret_err = open_failure_msg(path, pfd);
    return pfd;
  }
  struct stat st;
  if (fstat(pfd, &st) < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot read %s: %s", path, strerror(errno));
    return r;
  }
  if (S_ISLNK(st.st_mode)) {
    *ret_err = xasprintf("%s is a symlink: a copy does not follow one; name what it points to",
                         path);
    return -ELOOP;
  }
  if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
    *ret_err = xasprintf("%s is %s: only regular files and directories are copied", path,
                         kind_of(st.st_mode));
    return -EINVAL;
  }
  const char *last = last_name(rel);
  _cleanup_free_ char *err = NULL;
  if (S_ISDIR(st.st_mode)) {
    _cleanup_free_ char *top = last ? strdup(last) : dir_name_of(pfd);
    r = tar_pack(pfd, ".", top, out_fd, lim, cancelled, rep, &err);
  } else {
    _cleanup_free_ char *parent = parent_of(rel);
    _cleanup_close_ int dfd = open_beneath(parent, O_PATH | O_DIRECTORY);
    if (dfd < 0) {
      *ret_err = open_failure_msg(path, dfd);
      return dfd;
    }
    r = tar_pack(dfd, last, last, out_fd, lim, cancelled, rep, &err);
  }
  if (r < 0)
    *ret_err = xasprintf("copying %s: %s", path, err);
  return r;
}

/* The destination PATH's parent, opened beneath the root, and its last
 * component: what hostio_copy_to() writes and hostio_check_write() checks. */
static int open_dest(const char *path, int *ret_dfd, const char **ret_last, char **ret_rel,
                     char **ret_err) {
  if (root_fd < 0)
    return not_ready(ret_err);
  if (!copy_out_on) {
    *ret_err = xasprintf("writing to the host is off (IGN_MCP_COPY_OUT=off): %s was not "
                         "written; the server's environment decides this, not a tool call",
                         path ? path : "");
    return -EPERM;
  }
  _cleanup_free_ char *rel = NULL;
  int r = to_relative(path, &rel, ret_err);
  if (r < 0)
    return r;
  const char *last = last_name(rel);
  if (!last) {
    *ret_err = xasprintf("%s names no file or directory to write: name the destination itself "
                         "(e.g. %s/out), which the copy becomes",
                         path, root_path);
    return -EINVAL;
  }
  _cleanup_free_ char *parent = parent_of(rel);
  int dfd = open_beneath(parent, O_PATH | O_DIRECTORY);
  if (dfd < 0) {
    if (dfd == -ENOENT || dfd == -ENOTDIR)
      *ret_err = xasprintf("the directory %s is missing (or not a directory) in %s "
                           "(IGN_MCP_HOST_IO_ROOT): create it first; only the destination "
                           "itself is created",
                           parent, root_path);
    else
      *ret_err = open_failure_msg(path, dfd);
    return dfd;
  }
  *ret_dfd = dfd;
  *ret_last = last;
  *ret_rel = steal_ptr(rel);
  return 0;
}

int hostio_check_write(const char *path, char **ret_err) {
  _cleanup_free_ char *rel = NULL;
  _cleanup_close_ int dfd = -1;
  const char *last;
  int r = open_dest(path, &dfd, &last, &rel, ret_err);
  if (r < 0)
    return r;
  struct stat st;
  if (fstatat(dfd, last, &st, AT_SYMLINK_NOFOLLOW) < 0)
    return errno == ENOENT ? 0 : -errno;
  if (S_ISLNK(st.st_mode)) {
    *ret_err = xasprintf("%s is a symbolic link: a copy never writes through one; remove it or "
                         "name another destination", path);
    return -ELOOP;
  }
  if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
    *ret_err = xasprintf("%s is %s: a copy replaces only a regular file or a directory; remove "
                         "it or name another destination", path, kind_of(st.st_mode));
    return -EEXIST;
  }
  return 0;
}

int hostio_copy_to(int in_fd, const char *path, const struct tar_limits *lim,
                   const atomic_bool *cancelled, struct tar_report *rep, char **ret_err) {
  _cleanup_free_ char *rel = NULL;
  _cleanup_close_ int dfd = -1;
  const char *last;
  int r = open_dest(path, &dfd, &last, &rel, ret_err);
  if (r < 0)
    return r;
  _cleanup_free_ char *err = NULL;
  r = tar_unpack(in_fd, dfd, last, lim, cancelled, rep, &err);
  if (r < 0)
    *ret_err = xasprintf("copying to %s: %s", path, err);
  return r;
}
