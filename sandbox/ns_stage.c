/* ns_stage.c: the ns backend's stage layers.
 *
 * A commit makes DIR/layer: first a copy of the layer of the stage the
 * session started from (ns_layer_link: hard links, so a chain of stages
 * costs one inode per changed file, not one per file), then the session's
 * overlay upper applied on top (ns_layer_apply), by overlayfs's own rules.
 * The result is one layer that holds the whole chain; the agent lays it
 * between the rootfs and a new upper.
 *
 * The upper is the sandbox's: whatever a hostile sandbox could make on its
 * tmpfs may be there.  Every step is relative to an fd of the directory it
 * is in, no link is ever followed (O_NOFOLLOW, AT_SYMLINK_NOFOLLOW), files
 * are opened O_NONBLOCK (a FIFO never blocks the server) and checked to be
 * what fstatat said, entries that vanish are passed over, and depth and
 * entries are capped.  Sparse files are copied as sparse (SEEK_DATA): a
 * file's apparent size does not make the copy larger than the tmpfs held.
 *
 * A stage tree lives in the host's store, where a root server's copies are
 * owned by host uids 0..65535: no setuid or setgid bit is ever kept, device
 * nodes and sockets are dropped.  The layer's entries are never written in
 * place once linked: an entry that changes is unlinked and made anew, so a
 * parent stage's inode is never changed through its child. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <search.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "common/util.h"
#include "sandbox/ns_stage.h"

#define LAYER_COPY_CHUNK (128u << 10)
#define LAYER_XATTR_LIST (64u << 10)
#define LAYER_XATTR_VALUE (64u << 10) /* XATTR_SIZE_MAX */
#define LAYER_MODE_BITS (07777 & ~(S_ISUID | S_ISGID))
/* The most memory the upper's hard links are remembered in (paths of up to
 * PATH_MAX, for up to a million entries): past it, files are copied (and
 * max_bytes bounds what that costs). */
#define LAYER_LINKS_MEM (32u << 20)

struct layer_ctx {
  const struct ns_layer_opts *o;
  struct ns_layer_stats *st;
  char **ret_err;
  char path[PATH_MAX];          /* where we are, for messages */
  size_t path_len;
  char *buf;                    /* LAYER_COPY_CHUNK */
  char *names;                  /* LAYER_XATTR_LIST */
  char *value;                  /* LAYER_XATTR_VALUE */
  bool applying;                /* copying from the sandbox (max_bytes counts) */
  int root_fd;                  /* the layer's top (c->path is relative to it), or -1 */
  void *links;                  /* tsearch tree of struct layer_link: the upper's hard links */
  size_t links_mem;             /* bytes of it */
};

/* A file of the upper with more than one link, and the copy made of it:
 * its other names become links to that copy. */
struct layer_link {
  dev_t src_dev;
  ino_t src_ino;
  dev_t dst_dev;
  ino_t dst_ino;
  char rel[];                   /* the copy's path under root_fd */
};

static int link_cmp(const void *a, const void *b) {
  const struct layer_link *x = a, *y = b;
  if (x->src_dev != y->src_dev)
    return x->src_dev < y->src_dev ? -1 : 1;
  return x->src_ino < y->src_ino ? -1 : x->src_ino > y->src_ino;
}

static int ctx_init(struct layer_ctx *c, const struct ns_layer_opts *o,
                    struct ns_layer_stats *st, char **ret_err) {
  memset(c, 0, sizeof *c);
  c->o = o;
  c->st = st;
  c->ret_err = ret_err;
  c->root_fd = -1;
  c->buf = malloc(LAYER_COPY_CHUNK);
  c->names = malloc(LAYER_XATTR_LIST);
  c->value = malloc(LAYER_XATTR_VALUE);
  if (!c->buf || !c->names || !c->value) {
    *ret_err = strdup("out of memory for a stage copy's buffers");
    return -ENOMEM;
  }
  return 0;
}

static void ctx_fini(struct layer_ctx *c) {
  tdestroy(c->links, free);
  free(c->buf);
  free(c->names);
  free(c->value);
}

/* Enters NAME in c->path; returns the length to go back to. */
static size_t path_push(struct layer_ctx *c, const char *name) {
  size_t old = c->path_len;
  int n = snprintf(c->path + old, sizeof c->path - old, "/%s", name);
  if (n > 0)
    c->path_len = old + (size_t)n < sizeof c->path ? old + (size_t)n : sizeof c->path - 1;
  return old;
}

static void path_pop(struct layer_ctx *c, size_t old) {
  c->path_len = old;
  c->path[old] = '\0';
}

/* Sets *c->ret_err (once) to "WHAT /path: strerror(-R)" and returns R. */
__attribute__((format(printf, 3, 4))) static int layer_fail(struct layer_ctx *c, int r,
                                                            const char *fmt, ...) {
  if (!*c->ret_err) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    *c->ret_err = xasprintf("%s %s: %s", what, c->path_len ? c->path : "/", strerror(-r));
  }
  return r;
}

/* Like layer_fail for a cap the sandbox went past: the message says it
 * all, no strerror after the path. */
__attribute__((format(printf, 3, 4))) static int layer_refuse(struct layer_ctx *c, int r,
                                                              const char *fmt, ...) {
  if (!*c->ret_err) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    *c->ret_err = xasprintf("%s %s", what, c->path_len ? c->path : "/");
  }
  return r;
}

/* The owner an entry of stat S gets in the layer: false when it has none
 * there (owned by a uid outside the sandbox's block). */
static bool layer_owner(const struct layer_ctx *c, const struct stat *s, uid_t *uid, gid_t *gid) {
  switch (c->o->owners) {
  case NS_LAYER_OWNERS_SELF:
    *uid = (uid_t)-1;
    *gid = (gid_t)-1;
    return true;
  case NS_LAYER_OWNERS_KEEP:
    *uid = s->st_uid;
    *gid = s->st_gid;
    return true;
  case NS_LAYER_OWNERS_BLOCK:
    break;
  }
  uint64_t base = c->o->base;
  if (s->st_uid < base || s->st_uid >= base + 65536 || s->st_gid < base ||
      s->st_gid >= base + 65536)
    return false;
  *uid = (uid_t)(s->st_uid - base);
  *gid = (gid_t)(s->st_gid - base);
  return true;
}

/* ---- removal (of the layer's own entries) ---- */

static int layer_rm(struct layer_ctx *c, int dfd, const char *name, unsigned depth);

static int layer_rm_children(struct layer_ctx *c, int fd, unsigned depth) {
  int dup_fd = dup(fd);
  if (dup_fd < 0)
    return layer_fail(c, -errno, "cannot read the stage directory");
  DIR *d = fdopendir(dup_fd);
  if (!d) {
    int r = -errno;
    close(dup_fd);
    return layer_fail(c, r, "cannot read the stage directory");
  }
  struct dirent *e;
  int r = 0;
  while (r == 0 && (errno = 0, e = readdir(d)))
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
      r = layer_rm(c, fd, e->d_name, depth + 1);
  closedir(d);
  return r;
}

/* Removes DFD/NAME, a tree of the layer being made, when it exists. */
static int layer_rm(struct layer_ctx *c, int dfd, const char *name, unsigned depth) {
  if (unlinkat(dfd, name, 0) == 0 || errno == ENOENT)
    return 0;
  if (errno != EISDIR && errno != EPERM)
    return layer_fail(c, -errno, "cannot remove %s from the stage under", name);
  if (unlinkat(dfd, name, AT_REMOVEDIR) == 0 || errno == ENOENT)
    return 0;
  if (errno != ENOTEMPTY && errno != EEXIST)
    return layer_fail(c, -errno, "cannot remove the directory %s from the stage under", name);
  if (depth > NS_LAYER_MAX_DEPTH + 1)
    return layer_fail(c, -ELOOP, "the stage's directory %s nests too deep under", name);
  int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return layer_fail(c, -errno, "cannot open %s in the stage under", name);
  int r = layer_rm_children(c, fd, depth);
  close(fd);
  if (r == 0 && unlinkat(dfd, name, AT_REMOVEDIR) < 0 && errno != ENOENT)
    r = layer_fail(c, -errno, "cannot remove the directory %s from the stage under", name);
  return r;
}

/* ---- attributes ---- */

/* Copies the user.* xattrs of SFD to DFD (both open files or directories),
 * overlay's own (user.overlay.*) except when ALL: a layer's opaque mark is
 * set apart. */
static void layer_copy_xattrs(struct layer_ctx *c, int sfd, int dfd, bool all) {
  ssize_t n = flistxattr(sfd, c->names, LAYER_XATTR_LIST);
  if (n < 0) {
    if (errno == ERANGE)
      c->st->xattrs_dropped++;
    return;
  }
  for (ssize_t i = 0; i < n; i += (ssize_t)strlen(c->names + i) + 1) {
    const char *name = c->names + i;
    if (strncmp(name, "user.", 5) != 0)
      continue;
    if (!all && strncmp(name, "user.overlay.", 13) == 0)
      continue;
    ssize_t v = fgetxattr(sfd, name, c->value, LAYER_XATTR_VALUE);
    if (v < 0 || fsetxattr(dfd, name, c->value, (size_t)v, 0) < 0)
      c->st->xattrs_dropped++;
  }
}

/* Owner, mode (no setuid, setgid), user.* xattrs and times of S onto the
 * open DFD: chown first, it would clear the mode bits. */
static int layer_set_attrs(struct layer_ctx *c, int sfd, int dfd, const struct stat *s,
                           uid_t uid, gid_t gid, bool all_xattrs) {
  if ((uid != (uid_t)-1 || gid != (gid_t)-1) && fchown(dfd, uid, gid) < 0)
    return layer_fail(c, -errno, "cannot set the owner of");
  if (fchmod(dfd, s->st_mode & LAYER_MODE_BITS) < 0)
    return layer_fail(c, -errno, "cannot set the mode of");
  if (sfd >= 0)
    layer_copy_xattrs(c, sfd, dfd, all_xattrs);
  struct timespec t[2] = {s->st_atim, s->st_mtim};
  if (futimens(dfd, t) < 0)
    return layer_fail(c, -errno, "cannot set the times of");
  return 0;
}

/* Owner and times of an entry that cannot be opened (a link, a FIFO, a
 * whiteout), by name; FIFOs also get their mode. */
static int layer_set_attrs_at(struct layer_ctx *c, int dfd, const char *name,
                              const struct stat *s, uid_t uid, gid_t gid) {
  if ((uid != (uid_t)-1 || gid != (gid_t)-1) &&
      fchownat(dfd, name, uid, gid, AT_SYMLINK_NOFOLLOW) < 0)
    return layer_fail(c, -errno, "cannot set the owner of");
  /* A FIFO this copy just made in its own directory: no one else can swap
   * it for a link in between. */
  if (S_ISFIFO(s->st_mode) && fchmodat(dfd, name, s->st_mode & LAYER_MODE_BITS, 0) < 0)
    return layer_fail(c, -errno, "cannot set the mode of");
  struct timespec t[2] = {s->st_atim, s->st_mtim};
  if (utimensat(dfd, name, t, AT_SYMLINK_NOFOLLOW) < 0)
    return layer_fail(c, -errno, "cannot set the times of");
  return 0;
}

/* ---- entries ---- */

/* Copies SIZE bytes of IN to OUT, data ranges only (holes stay holes). */
static int layer_copy_data(struct layer_ctx *c, int in, int out, off_t size) {
  off_t pos = 0;
  while (pos < size) {
    off_t data = lseek(in, pos, SEEK_DATA);
    if (data < 0 && errno == ENXIO)
      break; /* a hole to the end */
    if (data < 0)
      data = pos; /* no SEEK_DATA here: copy it all */
    off_t hole = lseek(in, data, SEEK_HOLE);
    if (hole < 0 || hole > size)
      hole = size;
    for (off_t at = data; at < hole;) {
      size_t want = (size_t)(hole - at) < LAYER_COPY_CHUNK ? (size_t)(hole - at) : LAYER_COPY_CHUNK;
      if (c->applying && c->o->max_bytes && c->st->upper_bytes + want > c->o->max_bytes)
        return layer_refuse(c, -EFBIG,
                            "the sandbox's files came to more than its disk (%llu MiB) while "
                            "they were saved: a process of it wrote meanwhile; let it finish "
                            "(or stop it), then commit again; at",
                            (unsigned long long)(c->o->max_bytes >> 20));
      ssize_t n = pread(in, c->buf, want, at);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0)
        return layer_fail(c, -errno, "cannot read");
      if (n == 0) {
        hole = size = at; /* it shrank (a sandbox copied while it runs) */
        break;
      }
      for (ssize_t done = 0; done < n;) {
        ssize_t w = pwrite(out, c->buf + done, (size_t)(n - done), at + done);
        if (w < 0 && errno == EINTR)
          continue;
        if (w < 0)
          return layer_fail(c, -errno, "cannot write the stage's copy of");
        done += w;
      }
      at += n;
      c->st->bytes += (uint64_t)n;
      if (c->applying)
        c->st->upper_bytes += (uint64_t)n;
    }
    pos = hole;
  }
  if (ftruncate(out, size) < 0)
    return layer_fail(c, -errno, "cannot size the stage's copy of");
  return 0;
}

/* The copy L made of an upper file, opened beneath the layer's top without
 * following any link: the directory it is in (*ret_base its name there),
 * or -1 when it is no longer there as made. */
static int layer_link_dir(struct layer_ctx *c, const struct layer_link *l, const char **ret_base) {
  const char *slash = strrchr(l->rel, '/');
  _cleanup_free_ char *dir = slash ? strndup(l->rel, (size_t)(slash - l->rel)) : strdup(".");
  if (!dir)
    return -1;
  struct open_how how = {.flags = O_PATH | O_DIRECTORY | O_CLOEXEC,
                         .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
                                    RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV};
  int fd = (int)syscall(SYS_openat2, c->root_fd, dir, &how, sizeof how);
  if (fd < 0)
    return -1;
  const char *base = slash ? slash + 1 : l->rel;
  struct stat d;
  if (fstatat(fd, base, &d, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISREG(d.st_mode) ||
      d.st_dev != l->dst_dev || d.st_ino != l->dst_ino) {
    close(fd);
    return -1;
  }
  *ret_base = base;
  return fd;
}

/* DFD/NAME as one more link to the copy already made of the upper's inode
 * S: 1 when done, 0 when the file is to be copied (not seen yet, or its
 * copy is gone), or a negative errno. */
static int layer_relink(struct layer_ctx *c, int dfd, const char *name, const struct stat *s) {
  if (!c->applying || c->root_fd < 0 || s->st_nlink < 2)
    return 0;
  struct layer_link key = {.src_dev = s->st_dev, .src_ino = s->st_ino};
  struct layer_link **found = tfind(&key, &c->links, link_cmp);
  if (!found)
    return 0;
  const char *base;
  _cleanup_close_ int pfd = layer_link_dir(c, *found, &base);
  if (pfd < 0)
    return 0;
  int r = layer_rm(c, dfd, name, 0);
  if (r < 0)
    return r;
  if (linkat(pfd, base, dfd, name, 0) < 0)
    return errno == EMLINK || errno == ENOENT ? 0
                                              : layer_fail(c, -errno, "cannot link the stage's copy of");
  c->st->relinked++;
  return 1;
}

/* Remembers DFD/NAME as the copy of the upper's inode S (more than one link). */
static void layer_link_note(struct layer_ctx *c, int dfd, const char *name, const struct stat *s) {
  struct stat d;
  if (!c->applying || c->root_fd < 0 || s->st_nlink < 2 || c->path_len < 2 ||
      c->path_len >= sizeof c->path - 1 || fstatat(dfd, name, &d, AT_SYMLINK_NOFOLLOW) < 0)
    return;
  struct layer_link key = {.src_dev = s->st_dev, .src_ino = s->st_ino};
  struct layer_link **found = tfind(&key, &c->links, link_cmp);
  if (found) {
    /* Its first copy is gone (replaced meanwhile): this one stands in. */
    (*found)->dst_dev = d.st_dev;
    (*found)->dst_ino = d.st_ino;
    if (strlen((*found)->rel) >= c->path_len - 1) {
      memcpy((*found)->rel, c->path + 1, c->path_len);
      return;
    }
    struct layer_link *old = *found;
    tdelete(old, &c->links, link_cmp);
    free(old);
  }
  if (c->links_mem + sizeof(struct layer_link) + c->path_len > LAYER_LINKS_MEM)
    return;
  struct layer_link *l = malloc(sizeof *l + c->path_len);
  if (!l)
    return;
  c->links_mem += sizeof *l + c->path_len;
  *l = (struct layer_link){.src_dev = s->st_dev, .src_ino = s->st_ino, .dst_dev = d.st_dev,
                           .dst_ino = d.st_ino};
  memcpy(l->rel, c->path + 1, c->path_len); /* without the leading '/', with the NUL */
  if (!tsearch(l, &c->links, link_cmp))
    free(l);
}

/* Opens SFD/NAME of the upper (never following a link) with FLAGS added:
 * the fd; -ENOENT when it vanished or cannot be read (counted, skipped);
 * else layer_fail's error with WHAT. */
static int layer_open_entry(struct layer_ctx *c, int sfd, const char *name, int flags,
                            const char *what) {
  int in = openat(sfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | flags);
  if (in >= 0)
    return in;
  if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP || errno == ENXIO) {
    c->st->vanished++;
    return -ENOENT;
  }
  if (errno == EACCES || errno == EPERM) {
    c->st->unreadable++;
    return -ENOENT;
  }
  int r = layer_fail(c, -errno, "%s", what);
  return r == -ENOENT ? -EIO : r;
}

/* A regular file SFD/NAME (stat S) as DFD/NAME, made anew. */
static int layer_copy_file(struct layer_ctx *c, int sfd, int dfd, const char *name,
                           const struct stat *s, uid_t uid, gid_t gid, bool all_xattrs) {
  int in = layer_open_entry(c, sfd, name, O_NOCTTY, "cannot open");
  if (in < 0)
    return in == -ENOENT ? 0 : in;
  struct stat now;
  if (fstat(in, &now) < 0 || !S_ISREG(now.st_mode) || now.st_ino != s->st_ino ||
      now.st_dev != s->st_dev) {
    close(in); /* replaced between readdir and open */
    c->st->vanished++;
    return 0;
  }
  int r = layer_rm(c, dfd, name, 0);
  if (r < 0) {
    close(in);
    return r;
  }
  int out = openat(dfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (out < 0) {
    r = layer_fail(c, -errno, "cannot create the stage's copy of");
    close(in);
    return r;
  }
  r = layer_copy_data(c, in, out, now.st_size);
  if (r == 0)
    r = layer_set_attrs(c, in, out, &now, uid, gid, all_xattrs);
  close(in);
  close(out);
  if (r == 0)
    layer_link_note(c, dfd, name, &now);
  return r;
}

static int layer_merge(struct layer_ctx *c, int sfd, int dfd, unsigned depth, bool link);

/* Opens DFD/NAME as a directory to merge into: the one there when KEEP and
 * it is one, else a new one in place of whatever was there. */
static int layer_dst_dir(struct layer_ctx *c, int dfd, const char *name, bool keep) {
  struct stat d;
  if (keep && fstatat(dfd, name, &d, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(d.st_mode)) {
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    return fd >= 0 ? fd : layer_fail(c, -errno, "cannot open the stage's copy of");
  }
  int r = layer_rm(c, dfd, name, 0);
  if (r < 0)
    return r;
  if (mkdirat(dfd, name, 0700) < 0)
    return layer_fail(c, -errno, "cannot create the stage's copy of");
  int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  return fd >= 0 ? fd : layer_fail(c, -errno, "cannot open the stage's copy of");
}

/* Is the open directory FD marked opaque by overlayfs? */
static bool layer_is_opaque(int fd) {
  char v[4];
  ssize_t n = fgetxattr(fd, NS_LAYER_OPAQUE_XATTR, v, sizeof v);
  return n == 1 && v[0] == 'y';
}

/* The directory SFD/NAME (stat S) into DFD/NAME.  LINK: a stage's layer
 * being copied (its opaque marks copied with its xattrs); else an upper
 * being applied. */
static int layer_dir(struct layer_ctx *c, int sfd, int dfd, const char *name,
                     const struct stat *s, uid_t uid, gid_t gid, unsigned depth, bool link) {
  if (depth + 1 > NS_LAYER_MAX_DEPTH)
    return layer_refuse(c, -ELOOP,
                      "the sandbox's directories nest deeper than %u levels (a stage keeps at "
                      "most that many; remove or flatten the tree, then commit again) at",
                      NS_LAYER_MAX_DEPTH);
  int in = layer_open_entry(c, sfd, name, O_DIRECTORY, "cannot open the directory");
  if (in < 0)
    return in == -ENOENT ? 0 : in;
  struct stat now;
  if (fstat(in, &now) < 0) {
    int r = layer_fail(c, -errno, "cannot stat");
    close(in);
    return r;
  }
  (void)s;
  bool opaque = !link && layer_is_opaque(in);
  int out = layer_dst_dir(c, dfd, name, !link && !opaque);
  if (out < 0) {
    close(in);
    return out;
  }
  int r = layer_merge(c, in, out, depth + 1, link);
  if (r == 0 && opaque && fsetxattr(out, NS_LAYER_OPAQUE_XATTR, "y", 1, 0) < 0)
    r = layer_fail(c, -errno,
                   "cannot mark the stage's directory opaque (the store's file system must keep "
                   "user.* xattrs: ext4, xfs, btrfs or tmpfs of Linux 6.6 or later) at");
  if (r == 0)
    r = layer_set_attrs(c, in, out, &now, uid, gid, link);
  close(in);
  close(out);
  return r;
}

/* A whiteout at DFD/NAME in place of whatever was there. */
static int layer_whiteout(struct layer_ctx *c, int dfd, const char *name, const struct stat *s,
                          uid_t uid, gid_t gid) {
  int r = layer_rm(c, dfd, name, 0);
  if (r < 0)
    return r;
  if (mknodat(dfd, name, S_IFCHR | 0000, makedev(0, 0)) < 0)
    return layer_fail(c, -errno, "cannot make a whiteout (a deleted file) in the stage at");
  c->st->whiteouts++;
  return s ? layer_set_attrs_at(c, dfd, name, s, uid, gid) : 0;
}

/* A symlink or FIFO SFD/NAME as DFD/NAME, made anew. */
static int layer_special(struct layer_ctx *c, int sfd, int dfd, const char *name,
                         const struct stat *s, uid_t uid, gid_t gid) {
  char target[PATH_MAX];
  ssize_t n = 0;
  if (S_ISLNK(s->st_mode)) {
    n = readlinkat(sfd, name, target, sizeof target);
    if (n < 0 && (errno == ENOENT || errno == EINVAL)) {
      c->st->vanished++;
      return 0;
    }
    if (n < 0)
      return layer_fail(c, -errno, "cannot read the link");
    if ((size_t)n >= sizeof target)
      return layer_fail(c, -ENAMETOOLONG, "the link's target is too long at");
    target[n] = '\0';
  }
  int r = layer_rm(c, dfd, name, 0);
  if (r < 0)
    return r;
  if (S_ISLNK(s->st_mode) ? symlinkat(target, dfd, name) < 0
                          : mknodat(dfd, name, S_IFIFO | 0600, 0) < 0)
    return layer_fail(c, -errno, "cannot create the stage's copy of");
  return layer_set_attrs_at(c, dfd, name, s, uid, gid);
}

/* One entry SFD/NAME into DFD. */
static int layer_entry(struct layer_ctx *c, int sfd, int dfd, const char *name, unsigned depth,
                       bool link) {
  if (++c->st->entries > NS_LAYER_MAX_ENTRIES)
    return layer_refuse(c, -EFBIG,
                      "the sandbox holds more than %u changed files and directories (the most a "
                      "stage keeps; remove some, then commit again); at",
                      NS_LAYER_MAX_ENTRIES);
  struct stat s;
  if (fstatat(sfd, name, &s, AT_SYMLINK_NOFOLLOW) < 0) {
    if (errno == ENOENT) {
      c->st->vanished++;
      return 0;
    }
    return layer_fail(c, -errno, "cannot stat");
  }
  uid_t uid;
  gid_t gid;
  if (!layer_owner(c, &s, &uid, &gid)) {
    c->st->skipped_owner++;
    return 0;
  }
  if (S_ISDIR(s.st_mode))
    return layer_dir(c, sfd, dfd, name, &s, uid, gid, depth, link);
  if (link) {
    /* A stage's own entry: the same inode.  Too many links: a copy. */
    if (linkat(sfd, name, dfd, name, 0) == 0) {
      c->st->linked++;
      return 0;
    }
    if (errno != EMLINK)
      return layer_fail(c, -errno, "cannot link the parent stage's");
  }
  if (S_ISREG(s.st_mode)) {
    int r = layer_relink(c, dfd, name, &s);
    return r != 0 ? (r < 0 ? r : 0) : layer_copy_file(c, sfd, dfd, name, &s, uid, gid, link);
  }
  if (S_ISCHR(s.st_mode) && s.st_rdev == makedev(0, 0))
    return layer_whiteout(c, dfd, name, &s, uid, gid);
  if (S_ISLNK(s.st_mode) || S_ISFIFO(s.st_mode))
    return layer_special(c, sfd, dfd, name, &s, uid, gid);
  /* A device node or a socket: not in a stage.  The name is gone as the
   * sandbox saw it (what lay below does not come back). */
  c->st->dropped_special++;
  return layer_whiteout(c, dfd, name, NULL, uid, gid);
}

/* Every entry of the directory SFD into the directory DFD. */
static int layer_merge(struct layer_ctx *c, int sfd, int dfd, unsigned depth, bool link) {
  int dup_fd = fcntl(sfd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0)
    return layer_fail(c, -errno, "cannot read the directory");
  DIR *d = fdopendir(dup_fd);
  if (!d) {
    int r = -errno;
    close(dup_fd);
    return layer_fail(c, r, "cannot read the directory");
  }
  rewinddir(d); /* the fd's position is shared with the caller's */
  int r = 0;
  struct dirent *e;
  while (r == 0 && (errno = 0, e = readdir(d))) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    size_t old = path_push(c, e->d_name);
    r = layer_entry(c, sfd, dfd, e->d_name, depth, link);
    path_pop(c, old);
  }
  if (r == 0 && errno != 0)
    r = layer_fail(c, -errno, "cannot read the directory");
  closedir(d);
  return r;
}

/* The attributes of the directory SFD onto the root DFD of the layer. */
static int layer_root_attrs(struct layer_ctx *c, int sfd, int dfd, bool link) {
  struct stat s;
  uid_t uid;
  gid_t gid;
  if (fstat(sfd, &s) < 0)
    return layer_fail(c, -errno, "cannot stat");
  if (!layer_owner(c, &s, &uid, &gid)) {
    c->st->skipped_owner++;
    return 0;
  }
  return layer_set_attrs(c, sfd, dfd, &s, uid, gid, link);
}

int ns_layer_link(int src_fd, int dst_fd, const struct ns_layer_opts *o,
                  struct ns_layer_stats *st, char **ret_err) {
  struct layer_ctx c;
  int r = ctx_init(&c, o, st, ret_err);
  if (r == 0)
    r = layer_merge(&c, src_fd, dst_fd, 0, true);
  if (r == 0)
    r = layer_root_attrs(&c, src_fd, dst_fd, true);
  ctx_fini(&c);
  return r;
}

int ns_layer_apply(int upper_fd, int dst_fd, const struct ns_layer_opts *o,
                   struct ns_layer_stats *st, char **ret_err) {
  struct layer_ctx c;
  int r = ctx_init(&c, o, st, ret_err);
  c.applying = true;
  c.root_fd = dst_fd;
  if (r == 0)
    r = layer_merge(&c, upper_fd, dst_fd, 0, false);
  if (r == 0)
    r = layer_root_attrs(&c, upper_fd, dst_fd, false);
  ctx_fini(&c);
  return r;
}

int ns_layer_apply_dir(int src_fd, int dst_fd, const char *name, const struct ns_layer_opts *o,
                       struct ns_layer_stats *st, char **ret_err) {
  struct layer_ctx c;
  int r = ctx_init(&c, o, st, ret_err);
  if (r < 0) {
    ctx_fini(&c);
    return r;
  }
  c.applying = true;
  c.root_fd = dst_fd;
  size_t old = path_push(&c, name);
  /* What the sandbox saw there was this directory alone, nothing of the
   * rootfs's: it replaces what the layer had and hides what lies below
   * (opaque), so the stage's sessions see it writable and alone too. */
  int out = layer_dst_dir(&c, dst_fd, name, false);
  r = out;
  if (out >= 0) {
    r = layer_merge(&c, src_fd, out, 1, false);
    if (r == 0 && fsetxattr(out, NS_LAYER_OPAQUE_XATTR, "y", 1, 0) < 0)
      r = layer_fail(&c, -errno, "cannot mark the stage's directory opaque at");
    if (r == 0)
      r = layer_root_attrs(&c, src_fd, out, false);
    close(out);
  }
  path_pop(&c, old);
  ctx_fini(&c);
  return r;
}
