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
