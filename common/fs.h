/* fs.h: file system helpers shared by the backends and the store. */
#pragma once

#include <sys/types.h>

/* Removes DIR and everything in it without following any link: every step
 * is relative to an fd of the directory it is in, so a link planted in the
 * tree is removed, never what it points to.  Any depth is removed (deep
 * directories are moved up and removed in later passes).  A DIR that is a
 * link or a file: only the name goes.  Failures are logged. */
void fs_remove_tree(const char *dir);
/* mkdir -p: the parents it makes with PARENTS_MODE, PATH itself with MODE.
 * 0 or -errno. */
int fs_mkdir_p(const char *path, mode_t parents_mode, mode_t mode);
/* A directory of the server's own, made (parents 0755, itself 0700) when
 * missing: never a link, owned by the server's uid, and no mode bit beyond
 * MAX (narrowed when it has more).  WHAT names it in *ret_err ("stage
 * directory").  0 or -errno. */
int fs_own_dir(const char *dir, const char *what, mode_t max, char **ret_err);
/* Opens NAME in directory DIR_FD to read it where another uid may have put
 * something in its place (a QEMU's state directory, which belongs to the
 * QEMU's uid): without following a link, without blocking on a FIFO, and
 * only a regular file with one name (a hard link to a file elsewhere has
 * two) that belongs to OWNER.  *ret_fd (O_CLOEXEC), or -errno and *ret_why
 * (malloc'd) saying what was found instead: -ELOOP a link, -EINVAL not a
 * regular file, -EMLINK more names, -EPERM another owner. */
int fs_open_one_name(int dir_fd, const char *name, uid_t owner, int *ret_fd, char **ret_why);
