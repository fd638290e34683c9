/* stagefile.c: the files of a vm stage's snapshot (and of a loader's RAM
 * file, made the same way): created owned and moded as a base's files, and
 * the RAM file made sparse again once written, its zero pages punched out
 * as holes; and the check that a stage's files are whole before a QEMU
 * maps them. */
#include <errno.h>
#include <inttypes.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/config.h"
#include "common/util.h"
#include "sandbox/stage.h"
#include "sandbox/vm/internal.h"

int vm_stage_file_create(const char *path, uint64_t size, mode_t mode, int *ret_fd,
                         char **ret_err) {
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot create the stage file %s: %s", path, strerror(errno));
    return r;
  }
  /* The loader (another uid, group VM_GID) writes the RAM file; the
   * stage's clones open it read-only once vm_snapshot has taken the group's
   * write bit (where QEMU maps it so), and the server reads the state for
   * them: as the base's files. */
  if ((size && ftruncate(fd, (off_t)size) < 0) ||
      (getuid() == 0 && fchown(fd, 0, VM_GID) < 0) || fchmod(fd, mode) < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot size or hand over the stage file %s: %s%s", path, strerror(errno),
                         r == -ENOSPC || r == -EDQUOT ? " (the store is full: free space in it)"
                                                      : "");
    close(fd);
    unlink(path);
    return r;
  }
  *ret_fd = fd;
  return 0;
}

/* Whether the LEN bytes at P are all zero. */
static bool all_zero(const uint8_t *p, size_t len) {
  return len == 0 || (p[0] == 0 && memcmp(p, p + 1, len - 1) == 0);
}

int vm_punch_zero_pages(int fd, uint64_t *ret_punched, char **ret_err) {
  enum { PAGE = 4096, CHUNK = 1 << 20 };
  _cleanup_free_ uint8_t *buf = malloc(CHUNK);
  if (!buf) {
    *ret_err = strdup("out of memory to scan the stage's RAM file");
    return -ENOMEM;
  }
  struct stat st;
  if (fstat(fd, &st) < 0) {
    *ret_err = xasprintf("cannot stat the stage's RAM file: %s", strerror(errno));
    return -errno;
  }
  uint64_t punched = 0;
  off_t off = 0;
  /* Only the data the loader wrote is read: holes are zero already. */
  while (off < st.st_size) {
    off_t data = lseek(fd, off, SEEK_DATA);
    if (data < 0)
      break; /* ENXIO: no more data */
    off_t hole = lseek(fd, data, SEEK_HOLE);
    if (hole < 0)
      hole = st.st_size;
    for (off_t pos = data; pos < hole;) {
      size_t want = (size_t)(hole - pos < CHUNK ? hole - pos : CHUNK);
      ssize_t n = pread(fd, buf, want, pos);
      if (n < 0 && errno == EINTR)
        continue;
      if (n <= 0) {
        *ret_err = xasprintf("cannot read the stage's RAM file: %s",
                             n < 0 ? strerror(errno) : "it is shorter than it was");
        return n < 0 ? -errno : -EIO;
      }
      /* Runs of whole zero pages become holes. */
      size_t run_start = 0, run_len = 0;
      for (size_t i = 0; i + PAGE <= (size_t)n; i += PAGE) {
        bool zero = all_zero(buf + i, PAGE);
        if (zero && run_len == 0)
          run_start = i;
        if (zero)
          run_len += PAGE;
        if ((!zero || i + 2 * PAGE > (size_t)n) && run_len) {
          if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, pos + (off_t)run_start,
                        (off_t)run_len) == 0)
            punched += run_len;
          run_len = 0;
        }
      }
      pos += n;
    }
    off = hole;
  }
  *ret_punched = punched;
  return 0;
}

/* The stage's files must be whole before a QEMU maps them: QEMU would
 * extend a short RAM file with zeros (a guest that hangs or crashes), and a
 * missing one would be created empty.  FDS are its "ram" and "state". */
int vm_stage_files_check(const struct stage *st, const int fds[2], char **ret_err) {
  static const char *const files[] = {"ram", "state"};
  uint64_t want = (uint64_t)cfg.vm_memory_mb << 20;
  for (size_t i = 0; i < ARRAY_SIZE(files); i++) {
    struct stat sb;
    const char *what = NULL;
    _cleanup_free_ char *size_text = NULL;
    if (fstat(fds[i], &sb) < 0)
      what = strerror(errno);
    else if (!S_ISREG(sb.st_mode))
      what = "not a regular file";
    else if (i == 0 && (uint64_t)sb.st_size != want)
      what = size_text = xasprintf("%lld bytes instead of %" PRIu64 " (%u MiB of guest RAM)",
                                   (long long)sb.st_size, want, cfg.vm_memory_mb);
    else if (i == 1 && sb.st_size == 0)
      what = "empty";
    if (what) {
      *ret_err = xasprintf("the stage %s cannot be started: its file %s/%s is %s; remove it "
                           "(stage_rm) and commit it again from a session",
                           st->name ? st->name : "(a fork's)", st->dir, files[i], what);
      return -EBADMSG;
    }
  }
  return 0;
}
