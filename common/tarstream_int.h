/* tarstream_int.h: what the two halves of the tar stream code share
 * (tarstream.c: packing and the report; tarstream_unpack.c: unpacking and
 * removing a tree).  Private to them: users include tarstream.h. */
#pragma once

#include <archive.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#define TAR_MAX_DEPTH 256   /* components below TOP */
#define TAR_MAX_NAME 4095   /* bytes of an entry's name in the stream */
#define TAR_BLOCK (64 * 1024)
#define TAR_POLL_MS 200
/* After the end marker, what the sender still writes (block padding) is
 * read and dropped until its EOF; a stream that goes on for more than this
 * is refused. */
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

/* Data regions of one file sent as a sparse entry; a file with more is
 * sent whole.  Its map (two decimal numbers per region) stays far below
 * TAR_HEADER_MAX. */
#define TAR_SPARSE_MAX 4096
struct tar_region {
  int64_t off, len;
};

#define CAP_MSG_LEN 160
#define CAP_BYTES_FMT                                                                  \
  "the copy is larger than its cap of %s (IGN_MCP_COPY_MAX_MB); raise the cap or copy " \
  "less"
#define CAP_FILES_FMT                                                                   \
  "the copy has more than %llu entries, its cap (IGN_MCP_COPY_MAX_FILES); raise the cap " \
  "or copy less"

static inline bool tar_cancelled(const atomic_bool *c) {
  return c && atomic_load_explicit(c, memory_order_relaxed);
}
/* MAX as "N MiB" or "N bytes" in BUF (CAP_MSG_LEN bytes); returns BUF. */
const char *tar_cap_bytes_msg(char *buf, uint64_t max);
/* Whether a relative symlink target, read lexically from DIR_DEPTH
 * components below the top, stays inside the tree. */
bool tar_symlink_inside(const char *target, unsigned dir_depth);
/* Why an entry of TYPE is not copied ("a FIFO", ...). */
const char *tar_type_reason(mode_t type);
/* Keeps the first failure's message in *ERR (later ones only explain it);
 * returns CODE. */
__attribute__((format(printf, 3, 4))) int tar_first_fail(char **err, int code, const char *fmt,
                                                         ...);
/* A top-level name for the stream: one component, not . or .. */
bool tar_valid_top(const char *top);
/* Waits up to TAR_POLL_MS for FD to be ready for EVENTS: 1 ready, 0 not yet
 * (or EINTR), -1 cancelled (CANCELLED set) or poll failed, with the
 * archive's error set and *IO_ERRNO saying why. */
int tar_wait_fd(struct archive *a, int fd, short events, const atomic_bool *cancelled,
                int *io_errno);
