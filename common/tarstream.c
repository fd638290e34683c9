/* tarstream.c: a file or directory tree as a pax tar stream and back (see
 * tarstream.h for the rules).
 *
 * libarchive does the format only.  The file system side is ours on both
 * ends, because the library's own walker and extractor work with paths:
 *
 * - Packing walks with openat(O_NOFOLLOW) and fdopendir from the fd of each
 *   directory, so a tree changed while it is read (a symlink swapped in for
 *   a directory) cannot lead the walk outside it.
 *
 * - Unpacking creates every entry itself, relative to the fd of its parent
 *   directory, with O_CREAT|O_EXCL|O_NOFOLLOW, mkdirat and symlinkat.  The
 *   parent is reached component by component with O_NOFOLLOW, so an entry
 *   can never be written through a symlink the stream made earlier (the
 *   classic "link -> /etc, then link/passwd" attack finds a symlink where it
 *   needs a directory and is skipped).  Everything goes into a sibling
 *   staging name first; only a complete stream (its end marker seen) is
 *   renamed over the destination.
 *
 * Both directions count entries and bytes as they go and stop at the caps:
 * the sender is not trusted to honour them.  Declared sizes are checked
 * before any data is read (a sparse or huge header cannot get past), the
 * bytes that arrive are counted again, and the raw stream has a cap of its
 * own so that headers alone cannot go on forever.
 *
 * This file is linked into the static agent too: libarchive, libc and
 * common/util.h only. */
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

#include "common/util.h"

#define TAR_MAX_DEPTH 256   /* components below TOP */
#define TAR_MAX_NAME 4095   /* bytes of an entry's name in the stream */
#define TAR_BLOCK (64 * 1024)
#define TAR_POLL_MS 200
/* After the end marker, what the sender still writes (block padding) is
 * read and dropped, up to this much, so that it does not fail on a closed
 * pipe. */
#define TAR_DRAIN_MAX (1024 * 1024)
/* Headers per entry the raw stream may carry besides file content: long
 * names and link targets in pax headers take a few KiB at most. */
#define TAR_HEADER_ALLOWANCE (16 * 1024)
/* The raw bytes one archive_read_next_header may read: what libarchive
 * parses there it keeps in memory, a sparse map at ten times its size or
 * more, so a header must not be as big as the whole stream may be.  Ours
 * are a few KiB; libarchive refuses a pax header over 1 MiB itself. */
#define TAR_HEADER_MAX (2 * 1024 * 1024)
/* A directory tree being removed is walked this deep before its deeper
 * parts are moved up (fds stay bounded whatever the depth). */
#define TAR_REMOVE_DEPTH 64

void tar_report_free(struct tar_report *r) {
  if (!r)
    return;
  for (size_t i = 0; i < r->n_listed; i++) {
    free(r->listed[i].path);
    free(r->listed[i].reason);
  }
  memset(r, 0, sizeof *r);
}

void tar_report_skip(struct tar_report *r, const char *path, const char *reason) {
  r->skipped++;
  if (r->n_listed >= TAR_SKIPPED_LISTED)
    return;
  /* A name from a hostile stream may be long: the report keeps enough of
   * it to recognise. */
  r->listed[r->n_listed].path = strndup(path, 1024);
  r->listed[r->n_listed].reason = strdup(reason);
  if (!r->listed[r->n_listed].path || !r->listed[r->n_listed].reason)
    abort();
  r->n_listed++;
}

static bool is_cancelled(const atomic_bool *c) {
  return c && atomic_load_explicit(c, memory_order_relaxed);
}

#define CAP_MSG_LEN 160
static const char *cap_bytes_msg(char *buf, uint64_t max) {
  if (max % (1024 * 1024) == 0)
    snprintf(buf, CAP_MSG_LEN, "%llu MiB", (unsigned long long)(max / (1024 * 1024)));
  else
    snprintf(buf, CAP_MSG_LEN, "%llu bytes", (unsigned long long)max);
  return buf;
}
#define CAP_BYTES_FMT                                                                  \
  "the copy is larger than its cap of %s (IGN_MCP_COPY_MAX_MB); raise the cap or copy " \
  "less"
#define CAP_FILES_FMT                                                                   \
  "the copy has more than %llu entries, its cap (IGN_MCP_COPY_MAX_FILES); raise the cap " \
  "or copy less"

/* A symlink's target stays inside the copied tree when it is relative and,
 * read lexically from the directory the link is in (DIR_DEPTH components
 * below TOP), never climbs above TOP.  ".." is accepted only before the
 * first name: after a name it would be taken from wherever that name
 * resolves to (another symlink, say), which a lexical check cannot know. */
static bool symlink_target_inside(const char *target, unsigned dir_depth) {
  if (!*target || target[0] == '/')
    return false;
  unsigned up = 0;
  bool named = false;
  for (const char *p = target; *p;) {
    const char *end = strchrnul(p, '/');
    size_t n = (size_t)(end - p);
    if (n == 2 && p[0] == '.' && p[1] == '.') {
      if (named || ++up > dir_depth)
        return false;
    } else if (n > 1 || (n == 1 && p[0] != '.'))
      named = true;
    p = *end ? end + 1 : end;
  }
  return true;
}

static const char *type_reason(mode_t type) {
  switch (type) {
  case S_IFCHR:
  case S_IFBLK:
    return "a device node";
  case S_IFIFO:
    return "a FIFO";
  case S_IFSOCK:
    return "a socket";
  default:
    return "a file of an unknown type";
  }
}

/* ------------------------------------------------------------------ pack */

struct pack {
  struct archive *a;
  struct archive_entry *e;
  int out_fd;
  uint64_t max_bytes, max_files;
  const atomic_bool *cancelled;
  struct tar_report *rep;
  uint64_t entries;
  int io_errno; /* set by the write callback */
  bool shut;    /* after a failure: nothing more is written */
  char *buf;
  char path[TAR_MAX_NAME + 1];
  size_t path_len;
  char *err;
};

/* Keeps the first failure's message in *ERR (later ones only explain it);
 * returns CODE. */
__attribute__((format(printf, 3, 4))) static int first_fail(char **err, int code,
                                                            const char *fmt, ...) {
  if (!*err) {
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(err, fmt, ap) < 0)
      abort();
    va_end(ap);
  }
  return code;
}
#define pack_fail(p, code, ...) first_fail(&(p)->err, code, __VA_ARGS__)
#define unpack_fail(u, code, ...) first_fail(&(u)->err, code, __VA_ARGS__)

static la_ssize_t pack_write_cb(struct archive *a, void *ud, const void *buf, size_t len) {
  struct pack *p = ud;
  if (p->shut) {
    archive_set_error(a, ECANCELED, "the stream failed");
    return -1;
  }
  size_t done = 0;
  while (done < len) {
    if (is_cancelled(p->cancelled)) {
      p->io_errno = ECANCELED;
      archive_set_error(a, ECANCELED, "cancelled");
      return -1;
    }
    struct pollfd pfd = {.fd = p->out_fd, .events = POLLOUT};
    int r = poll(&pfd, 1, TAR_POLL_MS);
    if (r < 0 && errno != EINTR) {
      p->io_errno = errno;
      archive_set_error(a, errno, "poll");
      return -1;
    }
    if (r <= 0)
      continue;
    ssize_t n = write(p->out_fd, (const char *)buf + done, len - done);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN)
        continue;
      p->io_errno = errno;
      archive_set_error(a, errno, "write");
      return -1;
    }
    done += (size_t)n;
  }
  return (la_ssize_t)len;
}

/* An archive call failed: the write callback's errno says why if it was the
 * output, else libarchive's message. */
static int pack_archive_fail(struct pack *p, const char *what) {
  if (p->io_errno == ECANCELED)
    return pack_fail(p, -ECANCELED, "the copy was cancelled");
  if (p->io_errno)
    return pack_fail(p, -p->io_errno, "writing the stream (at %s): %s", p->path,
                     p->io_errno == EPIPE ? "the receiving side stopped reading"
                                          : strerror(p->io_errno));
  return pack_fail(p, -EIO, "%s %s: %s", what, p->path, archive_error_string(p->a));
}

static int pack_header(struct pack *p, const struct stat *st, mode_t type, int64_t size,
                       const char *link) {
  archive_entry_clear(p->e);
  archive_entry_copy_pathname(p->e, p->path);
  archive_entry_set_filetype(p->e, type);
  archive_entry_set_perm(p->e, st->st_mode & 0755);
  archive_entry_set_mtime(p->e, st->st_mtim.tv_sec, st->st_mtim.tv_nsec);
  archive_entry_set_size(p->e, size);
  if (link)
    archive_entry_copy_symlink(p->e, link);
  int r = archive_write_header(p->a, p->e);
  if (r < ARCHIVE_WARN)
    return pack_archive_fail(p, "writing the header of");
  return 0;
}

static int pack_file(struct pack *p, int fd, const struct stat *st) {
  uint64_t size = (uint64_t)st->st_size;
  if (size > p->max_bytes - p->rep->bytes)
    return pack_fail(p, -EFBIG, CAP_BYTES_FMT, cap_bytes_msg((char[CAP_MSG_LEN]){0}, p->max_bytes));
  int r = pack_header(p, st, AE_IFREG, (int64_t)size, NULL);
  if (r < 0)
    return r;
  uint64_t left = size;
  while (left > 0) {
    if (is_cancelled(p->cancelled))
      return pack_fail(p, -ECANCELED, "the copy was cancelled");
    ssize_t n = read(fd, p->buf, left < TAR_BLOCK ? (size_t)left : TAR_BLOCK);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return pack_fail(p, -errno, "cannot read %s: %s", p->path, strerror(errno));
    }
    if (n == 0)
      break; /* it shrank while read: libarchive pads the rest with zeros */
    if (archive_write_data(p->a, p->buf, (size_t)n) < 0)
      return pack_archive_fail(p, "writing");
    left -= (uint64_t)n;
  }
  if (archive_write_finish_entry(p->a) < ARCHIVE_WARN)
    return pack_archive_fail(p, "writing");
  p->rep->bytes += size;
  p->rep->files++;
  return 0;
}

static int pack_entry(struct pack *p, int dfd, const char *name, unsigned depth);

static int pack_dir(struct pack *p, int fd, const struct stat *st, unsigned depth) {
  int r = pack_header(p, st, AE_IFDIR, 0, NULL);
  if (r < 0) {
    close(fd);
    return r;
  }
  p->rep->dirs++;
  DIR *d = fdopendir(fd);
  if (!d) {
    int e = errno;
    close(fd);
    return pack_fail(p, -e, "cannot read the directory %s: %s", p->path, strerror(e));
  }
  size_t len = p->path_len;
  for (;;) {
    errno = 0;
    struct dirent *de = readdir(d);
    if (!de) {
      if (errno) {
        r = pack_fail(p, -errno, "cannot read the directory %s: %s", p->path, strerror(errno));
        break;
      }
      r = 0;
      break;
    }
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
      continue;
    size_t n = strlen(de->d_name);
    if (len + 1 + n > TAR_MAX_NAME) {
      p->path[len] = 0;
      _cleanup_free_ char *full = xasprintf("%s/%s", p->path, de->d_name);
      if (++p->entries > p->max_files) {
        r = pack_fail(p, -E2BIG, CAP_FILES_FMT, (unsigned long long)p->max_files);
        break;
      }
      tar_report_skip(p->rep, full, "a name longer than 4095 bytes");
      continue;
    }
    p->path[len] = '/';
    memcpy(p->path + len + 1, de->d_name, n + 1);
    p->path_len = len + 1 + n;
    r = pack_entry(p, dirfd(d), de->d_name, depth + 1);
    p->path_len = len;
    p->path[len] = 0;
    if (r < 0)
      break;
  }
  closedir(d);
  return r;
}

/* Packs DFD/NAME, named p->path in the stream, DEPTH components below TOP. */
static int pack_entry(struct pack *p, int dfd, const char *name, unsigned depth) {
  if (is_cancelled(p->cancelled))
    return pack_fail(p, -ECANCELED, "the copy was cancelled");
  if (++p->entries > p->max_files)
    return pack_fail(p, -E2BIG, CAP_FILES_FMT, (unsigned long long)p->max_files);
  struct stat st;
  if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
    if (errno == ENOENT && depth > 0) {
      tar_report_skip(p->rep, p->path, "it disappeared while the tree was read");
      return 0;
    }
    return pack_fail(p, -errno, "cannot read %s: %s", p->path, strerror(errno));
  }
  if (S_ISLNK(st.st_mode)) {
    char target[PATH_MAX];
    ssize_t n = readlinkat(dfd, name, target, sizeof target);
    if (n < 0)
      return pack_fail(p, -errno, "cannot read the symlink %s: %s", p->path, strerror(errno));
    if ((size_t)n >= sizeof target) {
      tar_report_skip(p->rep, p->path, "a symlink with a target longer than 4095 bytes");
      return 0;
    }
    target[n] = 0;
    if (depth == 0 || !symlink_target_inside(target, depth - 1)) {
      tar_report_skip(p->rep, p->path, "a symlink that points outside the copied tree");
      return 0;
    }
    int r = pack_header(p, &st, AE_IFLNK, 0, target);
    if (r < 0)
      return r;
    p->rep->symlinks++;
    return 0;
  }
  if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
    tar_report_skip(p->rep, p->path, type_reason(st.st_mode & S_IFMT));
    return 0;
  }
  if (S_ISDIR(st.st_mode) && depth >= TAR_MAX_DEPTH) {
    tar_report_skip(p->rep, p->path, "nested deeper than 256 directories");
    return 0;
  }
  /* O_NONBLOCK: if a FIFO was swapped in since the fstatat, the open does
   * not wait for a writer; the fstat below then sees it and skips it. */
  int fd = openat(dfd, name,
                  O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY | O_NONBLOCK |
                      (S_ISDIR(st.st_mode) ? O_DIRECTORY : 0));
  if (fd < 0) {
    if (errno == ELOOP || errno == ENOTDIR || errno == ENOENT || errno == ENXIO) {
      tar_report_skip(p->rep, p->path, "it changed while the tree was read");
      return 0;
    }
    return pack_fail(p, -errno, "cannot open %s: %s", p->path, strerror(errno));
  }
  struct stat st2;
  if (fstat(fd, &st2) < 0 || st2.st_ino != st.st_ino || st2.st_dev != st.st_dev ||
      (st2.st_mode & S_IFMT) != (st.st_mode & S_IFMT)) {
    close(fd);
    tar_report_skip(p->rep, p->path, "it changed while the tree was read");
    return 0;
  }
  if (S_ISDIR(st2.st_mode))
    return pack_dir(p, fd, &st2, depth); /* takes FD */
  int r = pack_file(p, fd, &st2);
  close(fd);
  return r;
}

static bool valid_top(const char *top) {
  return top && *top && !strchr(top, '/') && strcmp(top, ".") != 0 && strcmp(top, "..") != 0 &&
         strlen(top) <= NAME_MAX;
}

int tar_pack(int dirfd, const char *name, const char *top, int out_fd,
             const struct tar_limits *lim, const atomic_bool *cancelled,
             struct tar_report *rep, char **ret_err) {
  struct tar_report local = {0};
  if (!rep)
    rep = &local;
  if (!valid_top(top)) {
    *ret_err = xasprintf("cannot copy '%s': the name of a copy is one path component",
                         top ? top : "");
    return -EINVAL;
  }
  struct stat st;
  if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
    int e = errno;
    *ret_err = e == ENOENT ? xasprintf("%s does not exist", top)
                           : xasprintf("cannot read %s: %s", top, strerror(e));
    return -e;
  }
  if (S_ISLNK(st.st_mode)) {
    *ret_err = xasprintf("%s is a symlink: name what it points to instead", top);
    return -ELOOP;
  }
  if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
    *ret_err = xasprintf("%s is %s: only regular files and directories are copied", top,
                         type_reason(st.st_mode & S_IFMT));
    return -EINVAL;
  }

  struct pack p = {
      .out_fd = out_fd,
      .max_bytes = lim && lim->max_bytes ? lim->max_bytes : UINT64_MAX,
      .max_files = lim && lim->max_files ? lim->max_files : UINT64_MAX,
      .cancelled = cancelled,
      .rep = rep,
  };
  p.buf = malloc(TAR_BLOCK);
  p.a = archive_write_new();
  p.e = archive_entry_new();
  if (!p.buf || !p.a || !p.e)
    abort();
  size_t n = strlen(top);
  memcpy(p.path, top, n + 1);
  p.path_len = n;
  int r = 0;
  /* pax_restricted: ustar headers, with a pax header only where a long
   * name, a big size or a name that is not ASCII needs one. */
  if (archive_write_set_format_pax_restricted(p.a) != ARCHIVE_OK ||
      archive_write_set_bytes_per_block(p.a, TAR_BLOCK) != ARCHIVE_OK ||
      archive_write_set_bytes_in_last_block(p.a, 1) != ARCHIVE_OK ||
      archive_write_open2(p.a, &p, NULL, pack_write_cb, NULL, NULL) != ARCHIVE_OK)
    r = pack_fail(&p, -EIO, "cannot start the tar stream: %s", archive_error_string(p.a));
  if (r == 0)
    r = pack_entry(&p, dirfd, name, 0);
  if (r == 0 && archive_write_close(p.a) != ARCHIVE_OK)
    r = pack_archive_fail(&p, "finishing the stream after");
  /* A failed stream must not end with an end marker: the receiver would
   * take what came before it for the whole tree.  The output is shut
   * before the archive is closed (archive_write_fail would skip the close
   * and leak libarchive's buffers). */
  if (r < 0) {
    p.shut = true;
    archive_write_close(p.a);
  }
  archive_write_free(p.a);
  archive_entry_free(p.e);
  free(p.buf);
  if (r < 0)
    *ret_err = p.err ? p.err : xasprintf("packing %s failed", top);
  else
    free(p.err);
  tar_report_free(&local);
  return r;
}

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
  bool draining;        /* after the end marker: stop when nothing comes */
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
    if (is_cancelled(u->cancelled)) {
      u->io_errno = ECANCELED;
      archive_set_error(a, ECANCELED, "cancelled");
      return -1;
    }
    struct pollfd pfd = {.fd = u->in_fd, .events = POLLIN};
    int r = poll(&pfd, 1, TAR_POLL_MS);
    if (r < 0 && errno != EINTR) {
      u->io_errno = errno;
      archive_set_error(a, errno, "poll");
      return -1;
    }
    if (r == 0 && u->draining)
      return 0;
    if (r <= 0)
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
    return unpack_fail(u, -EFBIG, CAP_BYTES_FMT, cap_bytes_msg((char[CAP_MSG_LEN]){0}, u->max_bytes));
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

/* Writes the current entry's content to FD, counting it against the cap. */
static int unpack_data(struct unpack *u, int fd, const char *path, uint64_t declared) {
  uint64_t got = 0;
  for (;;) {
    la_ssize_t n = archive_read_data(u->a, u->buf + TAR_BLOCK, TAR_BLOCK);
    if (n == 0)
      break;
    if (n < 0)
      return unpack_archive_fail(u, "in the content of ", path);
    got += (uint64_t)n;
    if (got > declared || u->seen_bytes - declared + got > u->max_bytes)
      return unpack_fail(u, -EFBIG, CAP_BYTES_FMT, cap_bytes_msg((char[CAP_MSG_LEN]){0}, u->max_bytes));
    for (la_ssize_t off = 0; off < n;) {
      ssize_t w = write(fd, u->buf + TAR_BLOCK + off, (size_t)(n - off));
      if (w < 0) {
        if (errno == EINTR)
          continue;
        return unpack_fail(u, -errno, "cannot write %s: %s", path, strerror(errno));
      }
      off += w;
    }
  }
  u->rep->bytes += got;
  return 0;
}

static bool errno_is_duplicate(int e) { return e == EEXIST; }

/* One entry of the stream.  0 (done or skipped) or a negative errno. */
static int unpack_entry(struct unpack *u, struct archive_entry *e) {
  if (++u->entries > u->max_files)
    return unpack_fail(u, -E2BIG, CAP_FILES_FMT, (unsigned long long)u->max_files);
  /* Declared content counts before any of it is read, whatever the entry
   * turns out to be: a skipped entry's data is read too. */
  int64_t size = archive_entry_size_is_set(e) ? archive_entry_size(e) : 0;
  if (size < 0 || (uint64_t)size > u->max_bytes - u->seen_bytes)
    return unpack_fail(u, -EFBIG, CAP_BYTES_FMT, cap_bytes_msg((char[CAP_MSG_LEN]){0}, u->max_bytes));
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
  if (archive_entry_hardlink(e)) {
    tar_report_skip(u->rep, raw, "a hard link");
    return 0;
  }
  mode_t type = archive_entry_filetype(e);
  if (type != AE_IFREG && type != AE_IFDIR && type != AE_IFLNK) {
    tar_report_skip(u->rep, raw, type_reason(type));
    return 0;
  }
  if (type == AE_IFLNK) {
    const char *target = archive_entry_symlink(e);
    if (!target)
      target = archive_entry_symlink_utf8(e);
    if (n < 2 || !target || strlen(target) >= PATH_MAX ||
        !symlink_target_inside(target, n - 2)) {
      tar_report_skip(u->rep, raw, "a symlink that points outside the copied tree");
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
    if (type == AE_IFREG) {
      r = unpack_data(u, fd, raw, (uint64_t)size);
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
                         type_reason(st->st_mode & S_IFMT));
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
  if (!valid_top(name)) {
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
  u.buf = malloc(2 * TAR_BLOCK);
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
    if (is_cancelled(cancelled))
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
  /* Block padding after the end marker: read, so the sender sees its
   * stream taken whole, but not waited for past a poll interval (a sender
   * that keeps the stream open must not hold a complete copy back). */
  if (r == 0) {
    u.draining = true;
    uint64_t drained = 0;
    while (drained < TAR_DRAIN_MAX) {
      const void *b;
      la_ssize_t n = unpack_read_cb(u.a, &u, &b);
      if (n <= 0)
        break;
      drained += (uint64_t)n;
    }
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
