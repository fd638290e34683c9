/* hostio.h: host paths named by tool arguments (stdin_file, copy_in[].host,
 * copy_out[].host, copy_in/copy_out's host_path), confined to one directory:
 * cfg.host_io_root (IGN_MCP_HOST_IO_ROOT, default the server's working
 * directory).
 *
 * A path is relative to the root, or absolute and inside it.  It is resolved
 * by the kernel with openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS) from
 * the root's fd: every symlink is resolved before the check, ".." that would
 * leave the root is refused, and a symlink planted inside the root that
 * points out is refused, whatever the path's spelling ("link/", "a/../..").
 * Refusals name the root and the variable.
 *
 * Reading takes regular files and directories only (a FIFO, a device or a
 * socket is refused, never opened for reading).  Writing (refused when
 * IGN_MCP_COPY_OUT=off) needs the destination's parent directory to exist;
 * its final component is never followed (a symlink there is refused) and the
 * result replaces it only once complete (tar_unpack's staging and rename). */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/tarstream.h"

/* Opens the root (a directory fd kept for the server's life) and logs the
 * policy.  ROOT is absolute and resolved. */
int hostio_init(const char *root, bool copy_out, char **ret_err);
const char *hostio_root(void);
bool hostio_copy_out_enabled(void);

/* stdin_file: the whole regular file PATH, at most MAX bytes (a bigger one is
 * refused, naming its size and the cap). */
int hostio_read_file(const char *path, size_t max, void **ret_data, size_t *ret_len,
                     char **ret_err);

/* copy_in's host side: packs PATH (a file or a directory) as a tar stream to
 * OUT_FD with tar_pack(), TOP being PATH's last component. */
int hostio_copy_from(const char *path, int out_fd, const struct tar_limits *lim,
                     const atomic_bool *cancelled, struct tar_report *rep, char **ret_err);

/* Whether PATH can be a copy's destination now (writing on, beneath the
 * root, parent there, not a symlink, FIFO or device): sandbox_run checks its
 * copy_out entries before a sandbox starts.  0, or -errno and *ret_err. */
int hostio_check_write(const char *path, char **ret_err);

/* copy_out's host side: makes PATH the tree of the tar stream read from
 * IN_FD with tar_unpack(). */
int hostio_copy_to(int in_fd, const char *path, const struct tar_limits *lim,
                   const atomic_bool *cancelled, struct tar_report *rep, char **ret_err);
