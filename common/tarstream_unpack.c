/* tarstream_unpack.c: a pax tar stream back into a file or directory tree,
 * and removing a tree (see tarstream.h for the rules, tarstream.c for the
 * approach).  Unpacking creates every entry itself under a sibling staging
 * name, relative to the fd of its parent reached component by component
 * with O_NOFOLLOW, and renames it into place only when the stream is
 * complete.  Linked into the static agent too. */
#include "common/tarstream.h"

#include <archive.h>
#include <archive_entry.h>
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "common/tarstream_int.h"
#include "common/util.h"

#define unpack_fail(u, code, ...) tar_first_fail(&(u)->err, code, __VA_ARGS__)

/* ------------------------------------------------------ removing a tree */

/* Opens the directory NAME in DFD, never following a symlink.  One its
 * owner may not read or search (a 0000 or 0100 directory from a tree) is
 * given 0700 first, through AT_SYMLINK_NOFOLLOW: without it a tree that
 * has one can be neither filled nor removed by an unprivileged user.
 * *RET_MODE (may be NULL) is set to its mode before, when it was changed. */
static int open_dir_at(int dfd, const char *name, mode_t *ret_mode) {
  int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0 || errno != EACCES)
    return fd;
  struct stat st;
  if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISDIR(st.st_mode) ||
      fchmodat(dfd, name, (st.st_mode & 07777) | 0700, AT_SYMLINK_NOFOLLOW) < 0) {
    errno = EACCES;
    return -1;
  }
  if (ret_mode)
    *ret_mode = st.st_mode & 07777;
  return openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

static unsigned long tar_counter(void) {
  static atomic_ulong n;
  return atomic_fetch_add(&n, 1);
}

/* Removes what directory FD holds.  Directories deeper than
 * TAR_REMOVE_DEPTH below TOP_FD are moved up into TOP_FD under a fresh name
 * and *PENDING set: the caller goes over TOP_FD again. */
static int remove_children(int top_fd, int fd, unsigned depth, bool *pending) {
  int dfd = dup(fd);
  if (dfd < 0)
    return -errno;
  DIR *d = fdopendir(dfd);
  if (!d) {
    int e = errno;
    close(dfd);
    return -e;
  }
  int r = 0;
  struct dirent *de;
  while ((de = readdir(d))) {
    const char *n = de->d_name;
    if (!strcmp(n, ".") || !strcmp(n, ".."))
      continue;
    if (unlinkat(fd, n, 0) == 0 || errno == ENOENT)
      continue;
    if (errno != EISDIR && errno != EPERM) {
      r = -errno;
      continue;
    }
    if (depth >= TAR_REMOVE_DEPTH) {
      char up[64];
      snprintf(up, sizeof up, ".ign-rm-%d-%lu", (int)getpid(), tar_counter());
      if (renameat(fd, n, top_fd, up) == 0)
        *pending = true;
      else
        r = -errno;
      continue;
    }
    int cfd = open_dir_at(fd, n, NULL);
    if (cfd < 0) {
      r = -errno;
      continue;
    }
    /* A directory without write permission (a 0555 one from the tree) is
     * ours: make it writable to empty it. */
    fchmod(cfd, 0700);
    int cr = remove_children(top_fd, cfd, depth + 1, pending);
    close(cfd);
    if (cr < 0)
      r = cr;
    else if (unlinkat(fd, n, AT_REMOVEDIR) < 0 && errno != ENOENT)
      r = -errno;
  }
  closedir(d);
  return r;
}

/* Removes DFD/NAME, whatever it is, never following a symlink in it. */
static int remove_tree_at(int dfd, const char *name) {
  if (unlinkat(dfd, name, 0) == 0 || errno == ENOENT)
    return 0;
  if (errno != EISDIR && errno != EPERM)
    return -errno;
  int fd = open_dir_at(dfd, name, NULL);
  if (fd < 0)
    return -errno;
  fchmod(fd, 0700);
  int r;
  for (int pass = 0;; pass++) {
    bool pending = false;
    r = remove_children(fd, fd, 0, &pending);
    if (r < 0 || !pending || pass > 1000000)
      break;
  }
  close(fd);
  if (r == 0 && unlinkat(dfd, name, AT_REMOVEDIR) < 0)
    r = -errno;
  return r;
}

/* ---------------------------------------------------------------- unpack */

struct level {
  int fd;
  char *name;
  mode_t mode;            /* to restore when the directory is left */
  bool restore_mode;      /* it was made writable while it was filled */
  struct timespec mtime;  /* filling it changed its mtime: set back */
};

struct unpack {
  struct archive *a;
  int in_fd;
  int dirfd;
  const char *name;
  uint64_t max_bytes, max_files;
  uint64_t stream_bytes, stream_cap;
  uint64_t header_from; /* stream_bytes when the header being read began */
  bool in_header;       /* in archive_read_next_header */
  bool draining;        /* after the end marker: until the sender's EOF */
  const atomic_bool *cancelled;
  struct tar_report *rep;
  uint64_t entries;
  uint64_t seen_bytes; /* declared and arrived content, skipped entries too */
  int io_errno;
  char *buf;
  char staging[NAME_MAX + 1];
  bool staged;
  bool top_is_dir;
  char *top;
  struct level stack[TAR_MAX_DEPTH + 1];
  unsigned depth; /* levels open in stack */
  char *err;
};


static la_ssize_t unpack_read_cb(struct archive *a, void *ud, const void **ret_buf) {
  struct unpack *u = ud;
  *ret_buf = u->buf;
  for (;;) {
    int r = tar_wait_fd(a, u->in_fd, POLLIN, u->cancelled, &u->io_errno);
    if (r < 0)
      return -1;
    if (r == 0)
      continue;
    ssize_t n = read(u->in_fd, u->buf, TAR_BLOCK);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN)
        continue;
      u->io_errno = errno;
      archive_set_error(a, errno, "read");
      return -1;
    }
    u->stream_bytes += (uint64_t)n;
    if (u->stream_bytes > u->stream_cap) {
      u->io_errno = EFBIG;
      archive_set_error(a, EFBIG, "stream cap");
      return -1;
    }
    if (u->in_header && u->stream_bytes - u->header_from > TAR_HEADER_MAX + TAR_BLOCK) {
      u->io_errno = EOVERFLOW;
      archive_set_error(a, EOVERFLOW, "header cap");
      return -1;
    }
    return n;
  }
}

static int unpack_archive_fail(struct unpack *u, const char *what, const char *path) {
  if (u->io_errno == ECANCELED)
    return unpack_fail(u, -ECANCELED, "the copy was cancelled");
  if (u->io_errno == EFBIG)
    return unpack_fail(u, -EFBIG, CAP_BYTES_FMT, tar_cap_bytes_msg((char[CAP_MSG_LEN]){0}, u->max_bytes));
  if (u->io_errno == EOVERFLOW)
    return unpack_fail(u, -EOVERFLOW, "the stream is refused %s%s: an entry's header (a pax "
                       "header, a long name, a sparse map) is larger than %d MiB; the sending "
                       "side is not ours or is broken",
                       what, path ? path : "", TAR_HEADER_MAX / (1024 * 1024));
  if (u->io_errno)
    return unpack_fail(u, -u->io_errno, "reading the stream: %s", strerror(u->io_errno));
  const char *msg = archive_error_string(u->a);
  return unpack_fail(u, -EIO, "the stream is broken %s%s: %s", what, path ? path : "",
                     msg ? msg : "unknown error");
}

/* Leaves the directory at the top of the stack: its mode (if it was made
 * writable) and its mtime (its children changed it) set back. */
static void level_pop(struct unpack *u) {
  struct level *l = &u->stack[--u->depth];
  if (l->restore_mode)
    fchmod(l->fd, l->mode);
  struct timespec ts[2] = {{.tv_nsec = UTIME_OMIT}, l->mtime};
  futimens(l->fd, ts);
  close(l->fd);
  free(l->name);
  l->name = NULL;
}

/* The fd of the directory COMPS[0..N-1] in the staging tree, reached one
 * component at a time with O_NOFOLLOW from the staging name, keeping the
 * stack of directories open (a stream lists a directory's entries
 * together).  Returns the fd, -1 with *RET_WHY for an entry to skip, or a
 * negative errno (< -1) for a failure. */
static int open_parent(struct unpack *u, char **comps, unsigned n, const char **ret_why) {
  unsigned k = 0;
  while (k < u->depth && k < n && !strcmp(u->stack[k].name, comps[k]))
    k++;
  while (u->depth > k)
    level_pop(u);
  for (unsigned i = k; i < n; i++) {
    int pfd = i == 0 ? u->dirfd : u->stack[i - 1].fd;
    const char *nm = i == 0 ? u->staging : comps[i];
    mode_t was = (mode_t)-1;
    int fd = open_dir_at(pfd, nm, &was);
    if (fd < 0) {
      if (errno == ENOENT) {
        *ret_why = "its directory is not in the stream before it";
        return -1;
      }
      if (errno == ELOOP || errno == ENOTDIR) {
        *ret_why = "it is inside a symlink or a file (never written through)";
        return -1;
      }
      return -errno;
    }
    struct stat st;
    if (fstat(fd, &st) < 0) {
      int e = errno;
      close(fd);
      return -e;
    }
    struct level *l = &u->stack[u->depth++];
    l->fd = fd;
    l->name = strdup(comps[i]);
    if (!l->name)
      abort();
    l->mode = was != (mode_t)-1 ? was : st.st_mode & 07777;
    l->mtime = st.st_mtim;
    l->restore_mode = (l->mode & 0700) != 0700;
    if (l->restore_mode)
      fchmod(fd, l->mode | 0700);
  }
  return u->stack[n - 1].fd;
}

/* Splits NAME (a copy, modified) into components; NULL when it is not one
 * a copy may hold, with the reason. */
static unsigned split_name(char *name, char **comps, const char **ret_why) {
  size_t len = strlen(name);
  while (len > 1 && name[len - 1] == '/')
    name[--len] = 0; /* directories are written "dir/" */
  if (len == 0) {
    *ret_why = "an empty name";
    return 0;
  }
  if (name[0] == '/') {
    *ret_why = "an absolute name";
    return 0;
  }
  if (len > TAR_MAX_NAME) {
    *ret_why = "a name longer than 4095 bytes";
    return 0;
  }
  unsigned n = 0;
  for (char *p = name;;) {
    char *end = strchrnul(p, '/');
    bool last = !*end;
    *end = 0;
    if (!strcmp(p, "..")) {
      *ret_why = "a name with \"..\" in it";
      return 0;
    }
    if (!*p || !strcmp(p, ".")) {
      *ret_why = "a name with an empty or \".\" component";
      return 0;
    }
    if (n > TAR_MAX_DEPTH) {
      *ret_why = "nested deeper than 256 directories";
      return 0;
    }
    comps[n++] = p;
    if (last)
      break;
    p = end + 1;
  }
  return n;
}

static void set_times_fd(int fd, struct archive_entry *e) {
  if (!archive_entry_mtime_is_set(e))
    return;
  struct timespec ts[2] = {{.tv_nsec = UTIME_OMIT},
                           {.tv_sec = archive_entry_mtime(e),
                            .tv_nsec = archive_entry_mtime_nsec(e)}};
  futimens(fd, ts);
}

/* Creates a staging name that is free in DIRFD: ".NAME.ign-<pid>-<n>". */
static int make_staging(struct unpack *u, bool dir, mode_t mode, int *ret_fd) {
  for (int tries = 0; tries < 100; tries++) {
    snprintf(u->staging, sizeof u->staging, ".%.200s.ign-%d-%lu", u->name, (int)getpid(),
             tar_counter());
    int fd;
    if (dir) {
      if (mkdirat(u->dirfd, u->staging, 0700) < 0) {
        if (errno == EEXIST)
          continue;
        return -errno;
      }
      u->staged = true;
      fd = openat(u->dirfd, u->staging, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    } else {
      fd = openat(u->dirfd, u->staging, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  0600);
      if (fd < 0 && errno == EEXIST)
        continue;
      if (fd >= 0)
        u->staged = true;
    }
    if (fd < 0)
      return -errno;
    if (fchmod(fd, mode) < 0) {
      int e = errno;
      close(fd);
      return -e;
    }
    *ret_fd = fd;
    return 0;
  }
  return -EEXIST;
}

/* Writes the current entry's content to FD: each block where the stream
 * puts it, so the holes of a sparse entry stay holes (the file is then
 * extended to its DECLARED size, which was counted against the cap, holes
 * included, before any of it was read).  A block past DECLARED is refused. */
static int unpack_data(struct unpack *u, int fd, const char *path, uint64_t declared) {
  uint64_t got = 0;
  for (;;) {
    const void *b;
    size_t n;
    la_int64_t off;
    int ar = archive_read_data_block(u->a, &b, &n, &off);
    if (ar == ARCHIVE_EOF)
      break;
    if (ar < ARCHIVE_WARN)
      return unpack_archive_fail(u, "in the content of ", path);
    if (off < 0 || (uint64_t)off > declared || n > declared - (uint64_t)off)
      return unpack_fail(u, -EFBIG, "the stream is refused in the content of %s: a block of "
                         "it lies past the size its header declares; the sending side is not "
                         "ours or is broken", path);
    got += n;
    for (size_t done = 0; done < n;) {
      ssize_t w = pwrite(fd, (const char *)b + done, n - done, (off_t)((uint64_t)off + done));
      if (w < 0) {
        if (errno == EINTR)
          continue;
        return unpack_fail(u, -errno, "cannot write %s: %s", path, strerror(errno));
      }
      done += (size_t)w;
    }
  }
  struct stat st;
  if (fstat(fd, &st) < 0 || ((uint64_t)st.st_size < declared && ftruncate(fd, (off_t)declared) < 0))
    return unpack_fail(u, -errno, "cannot write %s: %s", path, strerror(errno));
  u->rep->bytes += got;
  return 0;
}

/* A regular file's content into FD (taken: closed here), then its mode and
 * times; counted once it is whole. */
static int unpack_file(struct unpack *u, int fd, struct archive_entry *e, const char *raw,
                       mode_t mode, int64_t size) {
  int r = unpack_data(u, fd, raw, (uint64_t)size);
  if (r == 0 && fchmod(fd, mode) < 0)
    r = unpack_fail(u, -errno, "cannot set the mode of %s: %s", raw, strerror(errno));
  if (r == 0)
    set_times_fd(fd, e);
  close(fd);
  if (r < 0)
    return r;
  u->rep->files++;
  return 0;
}

static bool errno_is_duplicate(int e) { return e == EEXIST; }

#define CONTROL_REASON                                                                      \
  "a name with a control character (a newline, an escape or another byte below 0x20, 0x7f, " \
  "or U+0080 to U+009F)"

/* A C0 control, DEL, or a C1 control in UTF-8 (U+0080..U+009F, C2 80..C2
 * 9F): terminals such as xterm take U+009B as CSI, an escape of its own. */
static bool has_control_byte(const char *s) {
  for (const unsigned char *p = (const unsigned char *)s; *p; p++)
    if (*p < 0x20 || *p == 0x7f || (p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f))
      return true;
  return false;
}

/* One entry of the stream.  0 (done or skipped) or a negative errno. */
static int unpack_entry(struct unpack *u, struct archive_entry *e) {
  if (++u->entries > u->max_files)
    return unpack_fail(u, -E2BIG, CAP_FILES_FMT, (unsigned long long)u->max_files);
  /* Declared content counts before any of it is read, whatever the entry
   * turns out to be: a skipped entry's data is read too. */
  int64_t size = archive_entry_size_is_set(e) ? archive_entry_size(e) : 0;
  if (size < 0 || (uint64_t)size > u->max_bytes - u->seen_bytes)
    return unpack_fail(u, -EFBIG, CAP_BYTES_FMT, tar_cap_bytes_msg((char[CAP_MSG_LEN]){0}, u->max_bytes));
  u->seen_bytes += (uint64_t)size;

  const char *raw = archive_entry_pathname(e);
  if (!raw)
    raw = archive_entry_pathname_utf8(e);
  if (!raw) {
    tar_report_skip(u->rep, "?", "a name that cannot be read");
    return 0;
  }
  size_t raw_len = strlen(raw);
  if (raw_len > TAR_MAX_NAME + 64) {
    tar_report_skip(u->rep, raw, "a name longer than 4095 bytes");
    return 0;
  }
  _cleanup_free_ char *name = strdup(raw);
  if (!name)
    abort();
  char *comps[TAR_MAX_DEPTH + 2];
  const char *why = NULL;
  unsigned n = split_name(name, comps, &why);
  if (n == 0) {
    tar_report_skip(u->rep, raw, why);
    return 0;
  }
  if (!u->top) {
    if (n != 1) {
      tar_report_skip(u->rep, raw, "it comes before the top of the copied tree");
      return 0;
    }
  } else if (strcmp(comps[0], u->top) != 0) {
    tar_report_skip(u->rep, raw, "it is outside the copied tree");
    return 0;
  } else if (n == 1) {
    tar_report_skip(u->rep, raw, "a name that appears twice in the stream");
    return 0;
  }
  /* Below the top (whose name is the destination's): a newline, a
   * terminal escape or any other control byte in a name is never written,
   * so a listing or a script on the receiving side cannot be fooled by
   * one. */
  for (unsigned i = 1; i < n; i++)
    if (has_control_byte(comps[i])) {
      tar_report_skip(u->rep, raw, CONTROL_REASON);
      return 0;
    }
  if (archive_entry_hardlink(e)) {
    tar_report_skip(u->rep, raw, "a hard link");
    return 0;
  }
  mode_t type = archive_entry_filetype(e);
  if (type != AE_IFREG && type != AE_IFDIR && type != AE_IFLNK) {
    tar_report_skip(u->rep, raw, tar_type_reason(type));
    return 0;
  }
  if (type == AE_IFLNK) {
    const char *target = archive_entry_symlink(e);
    if (!target)
      target = archive_entry_symlink_utf8(e);
    if (n < 2 || !target || strlen(target) >= PATH_MAX ||
        !tar_symlink_inside(target, n - 2)) {
      tar_report_skip(u->rep, raw, "a symlink that points outside the copied tree");
      return 0;
    }
    if (has_control_byte(target)) {
      tar_report_skip(u->rep, raw, "a symlink whose target has a control character (a byte "
                                   "below 0x20, 0x7f, or U+0080 to U+009F)");
      return 0;
    }
  }
  mode_t mode = archive_entry_perm(e) & 0755;

  if (n == 1) {
    /* The top entry: the staging name. */
    if (type == AE_IFLNK) {
      tar_report_skip(u->rep, raw, "a symlink that points outside the copied tree");
      return 0;
    }
    u->top = strdup(comps[0]);
    if (!u->top)
      abort();
    u->top_is_dir = type == AE_IFDIR;
    int fd = -1;
    int r = make_staging(u, u->top_is_dir, type == AE_IFDIR ? mode | 0700 : 0600, &fd);
    if (r < 0)
      return unpack_fail(u, r, "cannot create %s next to %s: %s", u->staging, u->name,
                         strerror(-r));
    if (type == AE_IFREG)
      return unpack_file(u, fd, e, raw, mode, size);
    /* Its entries, if any, make it writable while they are created and
     * set its mode and time back (open_parent, level_pop). */
    fchmod(fd, mode);
    set_times_fd(fd, e);
    close(fd);
    u->rep->dirs++;
    return 0;
  }

  if (!u->top_is_dir) {
    tar_report_skip(u->rep, raw, "it is inside a symlink or a file (never written through)");
    return 0;
  }
  int pfd = open_parent(u, comps, n - 1, &why);
  if (pfd == -1) {
    tar_report_skip(u->rep, raw, why);
    return 0;
  }
  if (pfd < 0)
    return unpack_fail(u, pfd, "cannot open the directory of %s: %s", raw, strerror(-pfd));
  const char *leaf = comps[n - 1];

  if (type == AE_IFDIR) {
    if (mkdirat(pfd, leaf, 0700) < 0) {
      if (errno_is_duplicate(errno)) {
        tar_report_skip(u->rep, raw, "a name that appears twice in the stream");
        return 0;
      }
      return unpack_fail(u, -errno, "cannot create the directory %s: %s", raw, strerror(errno));
    }
    int fd = openat(pfd, leaf, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
      return unpack_fail(u, -errno, "cannot open the directory %s: %s", raw, strerror(errno));
    fchmod(fd, mode);
    set_times_fd(fd, e);
    close(fd);
    u->rep->dirs++;
    return 0;
  }
  if (type == AE_IFLNK) {
    const char *target = archive_entry_symlink(e);
    if (!target)
      target = archive_entry_symlink_utf8(e);
    if (symlinkat(target, pfd, leaf) < 0) {
      if (errno_is_duplicate(errno)) {
        tar_report_skip(u->rep, raw, "a name that appears twice in the stream");
        return 0;
      }
      return unpack_fail(u, -errno, "cannot create the symlink %s: %s", raw, strerror(errno));
    }
    if (archive_entry_mtime_is_set(e)) {
      struct timespec ts[2] = {{.tv_nsec = UTIME_OMIT},
                               {.tv_sec = archive_entry_mtime(e),
                                .tv_nsec = archive_entry_mtime_nsec(e)}};
      utimensat(pfd, leaf, ts, AT_SYMLINK_NOFOLLOW);
    }
    u->rep->symlinks++;
    return 0;
  }
  /* O_EXCL: an existing name, a symlink above all, is never opened. */
  int fd = openat(pfd, leaf, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno_is_duplicate(errno)) {
      tar_report_skip(u->rep, raw, "a name that appears twice in the stream");
      return 0;
    }
    return unpack_fail(u, -errno, "cannot create %s: %s", raw, strerror(errno));
  }
  return unpack_file(u, fd, e, raw, mode, size);
}

/* NAME in DIRFD may be replaced: it is missing, a regular file or a
 * directory.  0, or a negative errno and a message. */
static int check_destination(int dirfd, const char *name, struct stat *st, bool *exists,
                             char **ret_err) {
  *exists = false;
  if (fstatat(dirfd, name, st, AT_SYMLINK_NOFOLLOW) < 0) {
    if (errno == ENOENT)
      return 0;
    int e = errno;
    *ret_err = xasprintf("cannot read %s: %s", name, strerror(e));
    return -e;
  }
  *exists = true;
  if (S_ISLNK(st->st_mode)) {
    *ret_err = xasprintf("%s is a symlink: a copy never writes through one; remove it or name "
                         "another destination",
                         name);
    return -ELOOP;
  }
  if (!S_ISREG(st->st_mode) && !S_ISDIR(st->st_mode)) {
    *ret_err = xasprintf("%s is %s: a copy replaces only a file or a directory", name,
                         tar_type_reason(st->st_mode & S_IFMT));
    return -EEXIST;
  }
  return 0;
}

/* Puts the staging tree in NAME's place. */
static int unpack_commit(struct unpack *u) {
  struct stat st;
  bool exists;
  char *msg = NULL;
  int r = check_destination(u->dirfd, u->name, &st, &exists, &msg);
  if (r < 0) {
    u->err = u->err ? u->err : msg;
    return r;
  }
  /* Asked again at the last moment: a sender that failed while the tree
   * was being closed up still keeps the destination as it was. */
  if (tar_cancelled(u->cancelled))
    return unpack_fail(u, -ECANCELED, "the copy was cancelled");
  if (!exists) {
    if (renameat2(u->dirfd, u->staging, u->dirfd, u->name, RENAME_NOREPLACE) == 0)
      return 0;
    if (errno != EINVAL)
      return unpack_fail(u, -errno, "cannot rename the copy to %s: %s", u->name,
                         strerror(errno));
    if (renameat(u->dirfd, u->staging, u->dirfd, u->name) == 0)
      return 0;
    return unpack_fail(u, -errno, "cannot rename the copy to %s: %s", u->name, strerror(errno));
  }
  if (S_ISREG(st.st_mode) && !u->top_is_dir) {
    if (renameat(u->dirfd, u->staging, u->dirfd, u->name) == 0)
      return 0;
    return unpack_fail(u, -errno, "cannot rename the copy to %s: %s", u->name, strerror(errno));
  }
  /* A directory (or a file to be replaced by one): swapped in one step;
   * the old one is then at the staging name and removed. */
  if (renameat2(u->dirfd, u->staging, u->dirfd, u->name, RENAME_EXCHANGE) < 0)
    return unpack_fail(u, -errno, "cannot put the copy in place of %s: %s", u->name,
                       strerror(errno));
  remove_tree_at(u->dirfd, u->staging);
  u->staged = false;
  return 0;
}

int tar_unpack(int in_fd, int dirfd, const char *name, const struct tar_limits *lim,
               const atomic_bool *cancelled, struct tar_report *rep, char **ret_err) {
  struct tar_report local = {0};
  if (!rep)
    rep = &local;
  if (!tar_valid_top(name)) {
    *ret_err = xasprintf("cannot copy to '%s': the destination is one path component here",
                         name ? name : "");
    return -EINVAL;
  }
  struct stat st;
  bool exists;
  int r = check_destination(dirfd, name, &st, &exists, ret_err);
  if (r < 0)
    return r;

  struct unpack u = {
      .in_fd = in_fd,
      .dirfd = dirfd,
      .name = name,
      .max_bytes = lim && lim->max_bytes ? lim->max_bytes : UINT64_MAX,
      .max_files = lim && lim->max_files ? lim->max_files : UINT64_MAX,
      .cancelled = cancelled,
      .rep = rep,
  };
  /* The raw stream: content plus headers for every entry allowed. */
  u.stream_cap = u.max_bytes;
  uint64_t headers = u.max_files > (UINT64_MAX / TAR_HEADER_ALLOWANCE)
                         ? UINT64_MAX
                         : (u.max_files + 2) * TAR_HEADER_ALLOWANCE;
  u.stream_cap = u.stream_cap > UINT64_MAX - headers ? UINT64_MAX : u.stream_cap + headers;
  u.buf = malloc(TAR_BLOCK);
  u.a = archive_read_new();
  if (!u.buf || !u.a)
    abort();
  archive_read_support_format_tar(u.a);
  uint64_t end_of_entry = 0; /* stream offset after the last entry */
  if (archive_read_open(u.a, &u, NULL, unpack_read_cb, NULL) != ARCHIVE_OK) {
    if (u.stream_bytes == 0 && !u.io_errno)
      r = unpack_fail(&u, -ENODATA, "the stream holds no entry (the sending side sent nothing)");
    else
      r = unpack_archive_fail(&u, "at its start", NULL);
  }
  while (r == 0) {
    struct archive_entry *e;
    u.in_header = true;
    u.header_from = u.stream_bytes;
    int ar = archive_read_next_header(u.a, &e);
    u.in_header = false;
    if (ar == ARCHIVE_EOF)
      break;
    /* ARCHIVE_RETRY (a damaged header) is above ARCHIVE_WARN but holds no
     * entry. */
    if (ar != ARCHIVE_OK && ar != ARCHIVE_WARN) {
      r = unpack_archive_fail(&u, "after ", u.top ? u.top : "its start");
      break;
    }
    r = unpack_entry(&u, e);
    if (r < 0)
      break;
    if (archive_read_data_skip(u.a) < ARCHIVE_WARN) {
      r = unpack_archive_fail(&u, "in the content of ", archive_entry_pathname(e));
      break;
    }
    end_of_entry = (uint64_t)archive_filter_bytes(u.a, 0);
    if (tar_cancelled(cancelled))
      r = unpack_fail(&u, -ECANCELED, "the copy was cancelled");
  }
  /* libarchive takes a stream that stops between two entries for a whole
   * one.  A sender that failed stops exactly there: only a stream whose
   * end marker (a zero block after the last entry) arrived is complete. */
  if (r == 0 && (uint64_t)archive_filter_bytes(u.a, 0) < end_of_entry + 512)
    r = unpack_fail(&u, -EPIPE, "the stream stopped before its end (the sending side failed "
                                "or went away partway); nothing was changed");
  if (r == 0 && !u.top)
    r = unpack_fail(&u, -ENODATA, "the stream holds no entry that can be copied");
  /* The end marker says the stream is whole, not that its sender
   * succeeded: a sender fails after it too (its report, its close), or a
   * hostile one sends a whole stream and then an error.  The sender's
   * success is its EOF with no stop: whoever runs a sender sets CANCELLED
   * before closing the stream when it failed.  So the rest (block padding)
   * is read to EOF, and a cancel here is a failure like anywhere else. */
  if (r == 0) {
    u.draining = true;
    uint64_t drained = 0;
    for (;;) {
      const void *b;
      la_ssize_t n = unpack_read_cb(u.a, &u, &b);
      if (n < 0) {
        r = unpack_archive_fail(&u, "after its end marker", NULL);
        break;
      }
      if (n == 0)
        break;
      drained += (uint64_t)n;
      if (drained > TAR_DRAIN_MAX) {
        r = unpack_fail(&u, -EPROTO, "the stream goes on for more than %d KiB after its end "
                        "marker; the sending side is not ours or is broken; nothing was changed",
                        TAR_DRAIN_MAX / 1024);
        break;
      }
    }
    if (r == 0 && tar_cancelled(cancelled))
      r = unpack_fail(&u, -ECANCELED, "the copy was cancelled");
  }
  while (u.depth > 0)
    level_pop(&u);
  if (r == 0)
    r = unpack_commit(&u);
  if (r < 0 && u.staged)
    remove_tree_at(dirfd, u.staging);
  archive_read_free(u.a);
  free(u.buf);
  free(u.top);
  if (r < 0)
    *ret_err = u.err ? u.err : xasprintf("copying to %s failed", name);
  else
    free(u.err);
  tar_report_free(&local);
  return r;
}
