/* stagefile.c: the files of a vm stage's snapshot (and of a loader's RAM
 * file, made the same way): created owned and moded as a base's files, and
 * the RAM file made sparse again once written, its zero pages punched out
 * as holes. */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"
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
