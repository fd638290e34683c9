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
 * Sparse files: the packer sends a file with holes as a sparse entry (its
 * data regions from SEEK_DATA/SEEK_HOLE; libarchive writes the map and
 * drops the zeros fed for the holes), and the unpacker writes each data
 * block at its offset and extends the file to its size, so holes stay
 * holes.  The caps count a file's logical size, holes included.
 *
 * tarstream_unpack.c has the unpacking half and tree removal.
 *
 * Both files are linked into the static agent too: libarchive, libc and
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

#include "common/tarstream_int.h"
#include "common/util.h"

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

const char *tar_cap_bytes_msg(char *buf, uint64_t max) {
  if (max % (1024 * 1024) == 0)
    snprintf(buf, CAP_MSG_LEN, "%llu MiB", (unsigned long long)(max / (1024 * 1024)));
  else
    snprintf(buf, CAP_MSG_LEN, "%llu bytes", (unsigned long long)max);
  return buf;
}
/* A symlink's target stays inside the copied tree when it is relative and,
 * read lexically from the directory the link is in (DIR_DEPTH components
 * below TOP), never climbs above TOP.  ".." is accepted only before the
 * first name: after a name it would be taken from wherever that name
 * resolves to (another symlink, say), which a lexical check cannot know. */
bool tar_symlink_inside(const char *target, unsigned dir_depth) {
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

const char *tar_type_reason(mode_t type) {
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

int tar_first_fail(char **err, int code, const char *fmt, ...) {
  if (!*err) {
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(err, fmt, ap) < 0)
      abort();
    va_end(ap);
  }
  return code;
}

bool tar_valid_top(const char *top) {
  return top && *top && !strchr(top, '/') && strcmp(top, ".") != 0 && strcmp(top, "..") != 0 &&
         strlen(top) <= NAME_MAX;
}

int tar_wait_fd(struct archive *a, int fd, short events, const atomic_bool *cancelled,
                int *io_errno) {
  if (tar_cancelled(cancelled)) {
    *io_errno = ECANCELED;
    archive_set_error(a, ECANCELED, "cancelled");
    return -1;
  }
  struct pollfd pfd = {.fd = fd, .events = events};
  int r = poll(&pfd, 1, TAR_POLL_MS);
  if (r < 0 && errno != EINTR) {
    *io_errno = errno;
    archive_set_error(a, errno, "poll");
    return -1;
  }
  return r > 0;
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
  uint64_t counted; /* logical size of the files packed, holes included */
  struct tar_region *regions; /* TAR_SPARSE_MAX: a file's data regions */
  int io_errno; /* set by the write callback */
  bool shut;    /* after a failure: nothing more is written */
  char *buf;
  char path[TAR_MAX_NAME + 1];
  size_t path_len;
  char *err;
};

#define pack_fail(p, code, ...) tar_first_fail(&(p)->err, code, __VA_ARGS__)

static la_ssize_t pack_write_cb(struct archive *a, void *ud, const void *buf, size_t len) {
  struct pack *p = ud;
  if (p->shut) {
    archive_set_error(a, ECANCELED, "the stream failed");
    return -1;
  }
  size_t done = 0;
  while (done < len) {
    int r = tar_wait_fd(a, p->out_fd, POLLOUT, p->cancelled, &p->io_errno);
    if (r < 0)
      return -1;
    if (r == 0)
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

/* The header of the entry at p->path.  A regular file with holes has
 * N_REGIONS data regions in p->regions (sparse; 0 regions and SPARSE: all
 * hole). */
static int pack_header(struct pack *p, const struct stat *st, mode_t type, int64_t size,
                       const char *link, bool sparse, size_t n_regions) {
  archive_entry_clear(p->e);
  archive_entry_copy_pathname(p->e, p->path);
  archive_entry_set_filetype(p->e, type);
  archive_entry_set_perm(p->e, st->st_mode & 0755);
  archive_entry_set_mtime(p->e, st->st_mtim.tv_sec, st->st_mtim.tv_nsec);
  archive_entry_set_size(p->e, size);
  if (link)
    archive_entry_copy_symlink(p->e, link);
  for (size_t i = 0; sparse && i < n_regions; i++)
    archive_entry_sparse_add_entry(p->e, p->regions[i].off, p->regions[i].len);
  if (sparse && n_regions == 0)
    archive_entry_sparse_add_entry(p->e, size, 0); /* all hole: the map says where it ends */
  int r = archive_write_header(p->a, p->e);
  if (r < ARCHIVE_WARN)
    return pack_archive_fail(p, "writing the header of");
  return 0;
}

/* The data regions of FD (SIZE bytes) in p->regions, found with SEEK_DATA
 * and SEEK_HOLE: true and their count in *RET_N when the file has holes;
 * false when it is to be sent whole (no hole, more than TAR_SPARSE_MAX
 * regions, or a file system that cannot tell). */
static bool pack_regions(struct pack *p, int fd, int64_t size, size_t *ret_n) {
  size_t n = 0;
  int64_t data = 0;
  off_t pos = 0;
  while (pos < size) {
    off_t d = lseek(fd, pos, SEEK_DATA);
    if (d < 0 && errno == ENXIO)
      break; /* a hole to the end */
    if (d < 0)
      return false;
    if (d >= size)
      break;
    off_t h = lseek(fd, d, SEEK_HOLE);
    if (h < 0 || h <= d || n == TAR_SPARSE_MAX)
      return false;
    if (h > size)
      h = size;
    p->regions[n++] = (struct tar_region){d, h - d};
    data += h - d;
    pos = h;
  }
  if (data >= size)
    return false;
  *ret_n = n;
  return true;
}

/* LEN bytes of a hole: zeros, which libarchive drops for a sparse entry
 * (it writes only what the map says is data). */
static int pack_zeros(struct pack *p, int64_t len) {
  static const char zeros[TAR_BLOCK];
  while (len > 0) {
    if (tar_cancelled(p->cancelled))
      return pack_fail(p, -ECANCELED, "the copy was cancelled");
    size_t k = len < TAR_BLOCK ? (size_t)len : TAR_BLOCK;
    if (archive_write_data(p->a, zeros, k) < 0)
      return pack_archive_fail(p, "writing");
    len -= (int64_t)k;
  }
  return 0;
}

/* LEN bytes of FD from OFF into the entry.  A file that shrank while it is
 * read is padded with zeros. */
static int pack_range(struct pack *p, int fd, int64_t off, int64_t len) {
  while (len > 0) {
    if (tar_cancelled(p->cancelled))
      return pack_fail(p, -ECANCELED, "the copy was cancelled");
    ssize_t n = pread(fd, p->buf, len < TAR_BLOCK ? (size_t)len : TAR_BLOCK, off);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return pack_fail(p, -errno, "cannot read %s: %s", p->path, strerror(errno));
    }
    if (n == 0)
      return pack_zeros(p, len);
    if (archive_write_data(p->a, p->buf, (size_t)n) < 0)
      return pack_archive_fail(p, "writing");
    off += n;
    len -= n;
  }
  return 0;
}

/* A regular file; one with holes as a sparse entry, holes kept.  Its
 * logical size counts against the cap, holes included: what the receiver
 * may allocate is bounded by the cap, however the file is laid out. */
static int pack_file(struct pack *p, int fd, const struct stat *st) {
  uint64_t size = (uint64_t)st->st_size;
  if (size > p->max_bytes - p->counted)
    return pack_fail(p, -EFBIG, CAP_BYTES_FMT, tar_cap_bytes_msg((char[CAP_MSG_LEN]){0}, p->max_bytes));
  size_t n = 0;
  bool sparse = size > 0 && pack_regions(p, fd, (int64_t)size, &n);
  int r = pack_header(p, st, AE_IFREG, (int64_t)size, NULL, sparse, n);
  if (r < 0)
    return r;
  uint64_t data = 0;
  if (!sparse) {
    r = pack_range(p, fd, 0, (int64_t)size);
    data = size;
  } else {
    int64_t pos = 0;
    for (size_t i = 0; r == 0 && i < n; i++) {
      r = pack_zeros(p, p->regions[i].off - pos);
      if (r == 0)
        r = pack_range(p, fd, p->regions[i].off, p->regions[i].len);
      pos = p->regions[i].off + p->regions[i].len;
      data += (uint64_t)p->regions[i].len;
    }
    if (r == 0)
      r = pack_zeros(p, (int64_t)size - pos);
  }
  if (r < 0)
    return r;
  if (archive_write_finish_entry(p->a) < ARCHIVE_WARN)
    return pack_archive_fail(p, "writing");
  p->counted += size;
  p->rep->bytes += data;
  p->rep->files++;
  return 0;
}

static int pack_entry(struct pack *p, int dfd, const char *name, unsigned depth);

static int pack_dir(struct pack *p, int fd, const struct stat *st, unsigned depth) {
  int r = pack_header(p, st, AE_IFDIR, 0, NULL, false, 0);
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
  if (tar_cancelled(p->cancelled))
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
    if (depth == 0 || !tar_symlink_inside(target, depth - 1)) {
      tar_report_skip(p->rep, p->path, "a symlink that points outside the copied tree");
      return 0;
    }
    int r = pack_header(p, &st, AE_IFLNK, 0, target, false, 0);
    if (r < 0)
      return r;
    p->rep->symlinks++;
    return 0;
  }
  if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
    tar_report_skip(p->rep, p->path, tar_type_reason(st.st_mode & S_IFMT));
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

int tar_pack(int dirfd, const char *name, const char *top, int out_fd,
             const struct tar_limits *lim, const atomic_bool *cancelled,
             struct tar_report *rep, char **ret_err) {
  struct tar_report local = {0};
  if (!rep)
    rep = &local;
  if (!tar_valid_top(top)) {
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
                         tar_type_reason(st.st_mode & S_IFMT));
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
  p.regions = malloc(TAR_SPARSE_MAX * sizeof *p.regions);
  p.a = archive_write_new();
  p.e = archive_entry_new();
  if (!p.buf || !p.regions || !p.a || !p.e)
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
  free(p.regions);
  free(p.buf);
  if (r < 0)
    *ret_err = p.err ? p.err : xasprintf("packing %s failed", top);
  else
    free(p.err);
  tar_report_free(&local);
  return r;
}

