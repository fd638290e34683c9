/* tarstream.h: a file or directory tree as a tar stream and back, with
 * libarchive, under the rules every copy between the host and a sandbox
 * follows.  The same code runs on both sides: in the server for host paths
 * and in ign-agent (statically linked) for guest paths, so the rules cannot
 * drift apart.
 *
 * The stream: POSIX pax tar.  Every entry is named TOP or TOP/..., where TOP
 * is one path component (the name of what was copied); the receiver gives
 * TOP the destination's name.
 *
 * What is copied: regular files, directories and symbolic links whose target
 * stays inside the copied tree (relative, resolving below TOP).  Modes are
 * masked with 0755: never setuid, setgid or sticky, never group/other
 * writable.  Owners are not copied (files belong to whoever extracts).
 * Everything else (device nodes, FIFOs, sockets, hard links, absolute or
 * escaping symlinks, names with "..", absolute names) is skipped and
 * reported, on the way in and on the way out.  The receiver also skips and
 * reports names below TOP, and symlink targets, with a control character
 * (a byte below 0x20, 0x7f, or U+0080..U+009F in UTF-8: a newline, a
 * terminal escape, a C1 CSI); a name that
 * begins with '-' is an ordinary name and is copied.  Neither side ever
 * follows a symlink inside the tree.  A file with several names (st_nlink > 1) is
 * packed under each name it has in the tree, as a regular file: its other
 * names may be outside the tree, and what is read is what the user who
 * runs the copy can read anyway (the kernel's protected_hardlinks keeps
 * anyone else from planting a link to a file they cannot read).
 *
 * A regular file with holes travels as a sparse entry (its data regions,
 * found with SEEK_DATA/SEEK_HOLE, up to TAR_SPARSE_MAX of them) and is
 * written back with its holes; the report's bytes count the data that
 * travelled.
 *
 * Both functions check LIM while they run (bytes of file content, entries)
 * and stop with -EFBIG (bytes) or -E2BIG (entries) and a message that names
 * the cap and its variable.  A file's logical size counts against the byte
 * cap, holes included, so what a copy allocates stays under it. */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct tar_limits {
  uint64_t max_bytes;  /* file content, all entries together */
  uint64_t max_files;  /* entries of any kind */
};

#define TAR_SKIPPED_LISTED 64u /* skipped entries named in a report; the rest counted */

struct tar_skip {
  char *path;    /* as in the stream, e.g. "src/dev/null" (malloc'd) */
  char *reason;  /* e.g. "a device node", "a symlink that points outside the copied tree" */
};

struct tar_report {
  uint64_t files, dirs, symlinks; /* entries copied */
  uint64_t bytes;                 /* file content copied (holes not counted) */
  uint64_t skipped;               /* entries left out; the first TAR_SKIPPED_LISTED listed */
  struct tar_skip listed[TAR_SKIPPED_LISTED];
  size_t n_listed;
};

void tar_report_free(struct tar_report *r);
/* Adds a skipped entry (copies PATH and REASON; counts it past the list). */
void tar_report_skip(struct tar_report *r, const char *path, const char *reason);

/* Writes DIRFD/NAME (a regular file or a directory; a symlink there is
 * refused with -ELOOP) to OUT_FD as a tar stream whose top entry is TOP.
 * The walk is openat-relative with O_NOFOLLOW: a tree changed while it is
 * read cannot lead it outside.  CANCELLED (may be NULL) is polled.  Returns
 * 0, or a negative errno and *ret_err. */
int tar_pack(int dirfd, const char *name, const char *top, int out_fd,
             const struct tar_limits *lim, const atomic_bool *cancelled,
             struct tar_report *rep, char **ret_err);

/* Reads a tar stream from IN_FD and makes DIRFD/NAME the tree it holds: the
 * entries are extracted under a sibling staging name (".NAME.ign-<pid>-<n>")
 * through openat-relative, O_NOFOLLOW opens, and only a complete extraction
 * is renamed over NAME (RENAME_EXCHANGE, then the old tree removed, when
 * NAME is an existing directory).  NAME that is a symlink is refused with
 * -ELOOP; a failure of any kind leaves NAME as it was and no staging behind.
 * A stream with no entry is an error (-ENODATA); entries outside the first
 * entry's TOP are skipped and reported.
 *
 * The stream is complete at IN_FD's EOF after the end marker, not at the
 * marker: its sender may still fail (or a hostile one send an error after a
 * whole stream).  Whoever runs the sender sets CANCELLED before it closes
 * IN_FD when the sender failed; a cancel at any point, the wait for EOF
 * included, is -ECANCELED, and CANCELLED is asked once more right before
 * the rename. */
int tar_unpack(int in_fd, int dirfd, const char *name, const struct tar_limits *lim,
               const atomic_bool *cancelled, struct tar_report *rep, char **ret_err);
