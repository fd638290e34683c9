/* stage_verify.c: the stage store's checks (see stage.h): the checksum of a
 * stage's tree and what it takes on disk, the content id, the check of a
 * stage on the first open by this server (its backend, its inputs, its
 * files against their checksum; the ids checked are remembered), and the
 * opening of a stage's files relative to the directory that was checked.
 *
 * The checksum is one XXH3-128 over a canonical walk of the stage's tree
 * (names sorted; per entry its name, type, mode, owner, size, device
 * number, link target, content and user.* xattrs; a directory's entries
 * follow it and an end mark closes them).  Content is hashed per 1 MiB
 * chunk, a chunk of zeros as a count only, and holes (SEEK_DATA) are never
 * read: the digest depends on the bytes, not on how they sit on disk, and a
 * 256 MiB RAM file that is mostly holes hashes in a few ms per allocated MiB.
 * The walk is relative to directory fds, follows no link, opens files
 * O_NOFOLLOW|O_NONBLOCK and refuses trees deeper than STAGE_MAX_DEPTH. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <search.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/log.h"
#include "common/util.h"
#include "sandbox/stage_int.h"

#define STAGE_MAX_DEPTH 512
#define STAGE_DIR_MAX_ENTRIES (1u << 18) /* names held in memory to sort them */
#define CHUNK (1u << 20)

/* ---- the canonical walk: checksum and allocated bytes ---- */

struct walk {
  XXH3_state_t *st;  /* NULL: count bytes only */
  uint8_t *buf;      /* CHUNK bytes, when hashing */
  void *inodes;      /* tsearch tree of the multiply linked inodes counted */
  uint64_t bytes;
  uint64_t ninodes;  /* counted once each, like their blocks */
  bool lenient;      /* bytes only: skip what cannot be read instead of failing */
  char *err;
};

struct ino_key {
  dev_t dev;
  ino_t ino;
};

static int ino_cmp(const void *a, const void *b) {
  const struct ino_key *x = a, *y = b;
  if (x->dev != y->dev)
    return x->dev < y->dev ? -1 : 1;
  return x->ino < y->ino ? -1 : x->ino > y->ino;
}

static void count_blocks(struct walk *w, const struct stat *st) {
  if (st->st_nlink > 1 && !S_ISDIR(st->st_mode)) {
    struct ino_key *k = malloc(sizeof *k);
    if (!k)
      abort();
    k->dev = st->st_dev;
    k->ino = st->st_ino;
    void **found = tsearch(k, &w->inodes, ino_cmp);
    if (!found)
      abort();
    if (*found != k) {
      free(k);
      return;
    }
  }
  w->bytes += (uint64_t)st->st_blocks * 512;
  w->ninodes++;
}

static void upd(struct walk *w, const void *p, size_t n) {
  if (w->st)
    XXH3_128bits_update(w->st, p, n);
}

static void upd_u64(struct walk *w, uint64_t v) { upd(w, &v, sizeof v); }
static void upd_str(struct walk *w, const char *s, size_t n) {
  upd_u64(w, n);
  upd(w, s, n);
}

/* Records the first failure of the walk; -ERR (-EIO when 0). */
static int walk_fail(struct walk *w, const char *rel, const char *what, int err) {
  if (!w->err)
    w->err = err ? xasprintf("%s: %s: %s", rel, what, strerror(err))
                 : xasprintf("%s: %s", rel, what);
  return err ? -err : -EIO;
}

static bool all_zero(const uint8_t *p, size_t n) {
  return n == 0 || (p[0] == 0 && !memcmp(p, p + 1, n - 1));
}

/* Hashes the content of the regular file FD of SIZE bytes (see the top). */
static int hash_content(struct walk *w, int fd, uint64_t size, const char *rel) {
  uint64_t pos = 0, zeros = 0;
  bool seek = true;
  while (pos < size) {
    if (seek) {
      off_t d = lseek(fd, (off_t)pos, SEEK_DATA);
      if (d < 0 && errno == ENXIO)
        d = (off_t)size;
      else if (d < 0)
        seek = false, d = (off_t)pos;
      if ((uint64_t)d >= size) {
        zeros += (size - pos + CHUNK - 1) / CHUNK;
        break;
      }
      uint64_t cd = (uint64_t)d / CHUNK * CHUNK;
      if (cd > pos) {
        zeros += (cd - pos) / CHUNK;
        pos = cd;
      }
    }
    size_t n = size - pos < CHUNK ? (size_t)(size - pos) : CHUNK;
    size_t got = 0;
    while (got < n) {
      ssize_t k = pread(fd, w->buf + got, n - got, (off_t)(pos + got));
      if (k < 0 && errno == EINTR)
        continue;
      if (k < 0) {
        return walk_fail(w, rel, "cannot be read", errno);
      }
      if (k == 0) {
        return walk_fail(w, rel, "became shorter while it was read", 0);
      }
      got += (size_t)k;
    }
    if (all_zero(w->buf, n)) {
      zeros++;
    } else {
      upd_u64(w, zeros);
      upd(w, w->buf, n);
      zeros = 0;
    }
    pos += n;
  }
  upd_u64(w, zeros);
  upd_u64(w, size);
  return 0;
}

static int cmp_names(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static int cmp_strs(const void *a, const void *b) { return cmp_names(a, b); }

/* Hashes FD's user.* xattrs, sorted by name. */
static int hash_xattrs(struct walk *w, int fd, const char *rel) {
  if (!w->st)
    return 0;
  _cleanup_free_ char *list = malloc(XATTR_LIST_MAX);
  _cleanup_free_ const char **names = calloc(XATTR_LIST_MAX / 6, sizeof *names);
  if (!list || !names)
    return -ENOMEM;
  ssize_t n = flistxattr(fd, list, XATTR_LIST_MAX);
  if (n < 0 && (errno == ENOTSUP || errno == EPERM))
    n = 0;
  if (n < 0) {
    return walk_fail(w, rel, "its extended attributes cannot be listed", errno);
  }
  size_t k = 0;
  for (ssize_t i = 0; i < n; i += (ssize_t)strlen(list + i) + 1)
    if (strncmp(list + i, "user.", 5) == 0 && k < XATTR_LIST_MAX / 6)
      names[k++] = list + i;
  qsort(names, k, sizeof *names, cmp_strs);
  upd_u64(w, k);
  _cleanup_free_ char *val = malloc(XATTR_SIZE_MAX);
  if (!val)
    return -ENOMEM;
  for (size_t i = 0; i < k; i++) {
    ssize_t v = fgetxattr(fd, names[i], val, XATTR_SIZE_MAX);
    if (v < 0) {
      return walk_fail(w, rel, "an extended attribute cannot be read", errno);
    }
    upd_str(w, names[i], strlen(names[i]));
    upd_str(w, val, (size_t)v);
  }
  return 0;
}

static int walk_dir(struct walk *w, int dfd, const char *rel, unsigned depth, const char *skip);

/* A link's target (never followed); out of walk_entry, whose frame is on the
 * stack once per level of the tree. */
static int hash_link(struct walk *w, int dfd, const char *name, const char *rel) {
  _cleanup_free_ char *target = malloc(PATH_MAX);
  if (!target)
    return -ENOMEM;
  ssize_t n = readlinkat(dfd, name, target, PATH_MAX);
  if (n < 0) {
    return walk_fail(w, rel, "the link cannot be read", errno);
  }
  upd_str(w, target, (size_t)n);
  return 0;
}

/* A path for messages: REL/NAME, shortened when long. */
static char *child_rel(const char *rel, const char *name) {
  if (strlen(rel) > 1024)
    return xasprintf(".../%s", name);
  return *rel ? xasprintf("%s/%s", rel, name) : strdup(name);
}

static int walk_entry(struct walk *w, int dfd, const char *name, const char *rel,
                      unsigned depth) {
  struct stat st;
  if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
    if (w->lenient)
      return 0;
    return walk_fail(w, rel, "cannot be examined", errno);
  }
  count_blocks(w, &st);
  uint32_t rec[4] = {(uint32_t)(st.st_mode & S_IFMT), (uint32_t)(st.st_mode & 07777),
                     (uint32_t)st.st_uid, (uint32_t)st.st_gid};
  upd_str(w, name, strlen(name));
  upd(w, rec, sizeof rec);
  if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode))
    upd_u64(w, (uint64_t)st.st_rdev);
  if (S_ISLNK(st.st_mode) && w->st)
    return hash_link(w, dfd, name, rel);
  if (S_ISREG(st.st_mode) && w->st) {
    _cleanup_close_ int fd =
        openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    struct stat fst;
    if (fd < 0)
      return walk_fail(w, rel, "cannot be opened", errno);
    if (fstat(fd, &fst) < 0 || !S_ISREG(fst.st_mode) || fst.st_ino != st.st_ino ||
        fst.st_dev != st.st_dev)
      return walk_fail(w, rel, "changed while it was read", 0);
    int r = hash_content(w, fd, (uint64_t)fst.st_size, rel);
    if (r == 0)
      r = hash_xattrs(w, fd, rel);
    return r;
  }
  if (S_ISDIR(st.st_mode)) {
    if (depth >= STAGE_MAX_DEPTH) {
      if (w->lenient)
        return 0;
      w->err = w->err ? w->err
                      : xasprintf("%s is nested more than %d directories deep: a stage cannot "
                                  "hold a tree that deep; make it shallower and try again",
                                  rel, STAGE_MAX_DEPTH);
      return -ELOOP;
    }
    _cleanup_close_ int fd =
        openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      if (w->lenient)
        return 0;
      return walk_fail(w, rel, "cannot be opened", errno);
    }
    int r = hash_xattrs(w, fd, rel);
    if (r == 0)
      r = walk_dir(w, fd, rel, depth + 1, NULL);
    upd_u64(w, UINT64_MAX); /* the end of its entries */
    return r;
  }
  return 0;
}

/* The entries of directory DFD except SKIP, sorted (malloc'd). */
static int read_names(struct walk *w, int dfd, const char *rel, const char *skip,
                      char ***ret_names, size_t *ret_n) {
  int fd = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (!d) {
    int e = errno;
    if (fd >= 0)
      close(fd);
    walk_fail(w, rel[0] ? rel : ".", "cannot be listed", e);
    return -e;
  }
  char **names = NULL;
  size_t n = 0, cap = 0;
  int r = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || (skip && !strcmp(e->d_name, skip)))
      continue;
    if (n == STAGE_DIR_MAX_ENTRIES) {
      w->err = w->err ? w->err
                      : xasprintf("%s holds more than %u entries: a stage cannot hold a "
                                  "directory that large; spread its files over several",
                                  rel[0] ? rel : "the top directory", STAGE_DIR_MAX_ENTRIES);
      r = -E2BIG;
      break;
    }
    if (n == cap) {
      cap = cap ? cap * 2 : 16;
      char **nn = realloc(names, cap * sizeof *nn);
      if (!nn)
        abort();
      names = nn;
    }
    if (!(names[n++] = strdup(e->d_name)))
      abort();
  }
  closedir(d);
  if (r < 0) {
    for (size_t i = 0; i < n; i++)
      free(names[i]);
    free(names);
    return r;
  }
  if (n)
    qsort(names, n, sizeof *names, cmp_names);
  *ret_names = names;
  *ret_n = n;
  return 0;
}

static int walk_dir(struct walk *w, int dfd, const char *rel, unsigned depth, const char *skip) {
  char **names = NULL;
  size_t n = 0;
  int r = read_names(w, dfd, rel, skip, &names, &n);
  if (r < 0)
    return w->lenient ? 0 : r;
  for (size_t i = 0; i < n; i++) {
    if (r == 0) {
      _cleanup_free_ char *crel = child_rel(rel, names[i]);
      r = walk_entry(w, dfd, names[i], crel, depth);
    }
    free(names[i]);
  }
  free(names);
  return r;
}

/* Walks DIR (minus its meta.json): its checksum as 32 hex digits into HEX
 * (when not NULL), its allocated bytes and its inodes. */
int stage_tree_digest(int dir_fd, char hex[33], uint64_t *ret_bytes, uint64_t *ret_inodes,
                      char **ret_err) {
  struct walk w = {0};
  if (hex) {
    w.st = XXH3_createState();
    w.buf = malloc(CHUNK);
    if (!w.st || !w.buf)
      abort();
    XXH3_128bits_reset(w.st);
  } else {
    w.lenient = true;
  }
  int r;
  struct stat st;
  if (fstat(dir_fd, &st) < 0) {
    r = -errno;
    w.err = xasprintf("cannot examine the stage's directory: %s", strerror(errno));
  } else {
    count_blocks(&w, &st);
    r = walk_dir(&w, dir_fd, "", 0, "meta.json");
  }
  if (r == 0) {
    if (hex) {
      XXH128_hash_t h = XXH3_128bits_digest(w.st);
      snprintf(hex, 33, "%016" PRIx64 "%016" PRIx64, (uint64_t)h.high64, (uint64_t)h.low64);
    }
    if (ret_bytes)
      *ret_bytes = w.bytes;
    if (ret_inodes)
      *ret_inodes = w.ninodes;
  } else if (ret_err) {
    *ret_err = steal_ptr(w.err);
  }
  free(w.err);
  free(w.buf);
  XXH3_freeState(w.st);
  tdestroy(w.inodes, free);
  return r;
}

/* The bytes allocated under PATH (a file or a tree), and its inodes. */
uint64_t stage_tree_usage(const char *path, uint64_t *ret_inodes) {
  struct stat st;
  *ret_inodes = 0;
  if (lstat(path, &st) < 0)
    return 0;
  *ret_inodes = 1;
  if (!S_ISDIR(st.st_mode))
    return (uint64_t)st.st_blocks * 512;
  uint64_t bytes = 0;
  struct walk w = {.lenient = true};
  _cleanup_close_ int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0) {
    count_blocks(&w, &st);
    walk_dir(&w, fd, "", 0, NULL);
    bytes = w.bytes;
    *ret_inodes = w.ninodes;
  }
  free(w.err);
  tdestroy(w.inodes, free);
  return bytes;
}

uint64_t stage_tree_bytes(const char *path) {
  uint64_t inodes;
  return stage_tree_usage(path, &inodes);
}

void stage_make_id(const char *digest, const char *parent, const char *inputs_id,
                   const char *backend, char ret[36]) {
  XXH3_state_t *st = XXH3_createState();
  if (!st)
    abort();
  XXH3_128bits_reset(st);
  const char *parts[] = {"ign-stage-1", digest, parent ? parent : "", inputs_id, backend};
  for (size_t i = 0; i < ARRAY_SIZE(parts); i++)
    XXH3_128bits_update(st, parts[i], strlen(parts[i]) + 1);
  XXH128_hash_t h = XXH3_128bits_digest(st);
  XXH3_freeState(st);
  snprintf(ret, 36, "st-%016" PRIx64 "%016" PRIx64, (uint64_t)h.high64, (uint64_t)h.low64);
}

/* ---- the check on the first open ---- */

/* The stage ids this server has checked or made: not checked again. */
static pthread_mutex_t verified_lock = PTHREAD_MUTEX_INITIALIZER;
static char **verified;
static size_t verified_n, verified_cap;

static bool verified_has(const char *id) {
  for (size_t i = 0; i < verified_n; i++)
    if (!strcmp(verified[i], id))
      return true;
  return false;
}

/* Under verified_lock. */
static void verified_add(const char *id) {
  if (verified_has(id))
    return;
  if (verified_n == verified_cap) {
    verified_cap = verified_cap ? verified_cap * 2 : 8;
    char **n = realloc(verified, verified_cap * sizeof *n);
    if (!n)
      abort();
    verified = n;
  }
  if (!(verified[verified_n++] = strdup(id)))
    abort();
}

void stage_verified_add(const char *id) {
  pthread_mutex_lock(&verified_lock);
  verified_add(id);
  pthread_mutex_unlock(&verified_lock);
}

/* Checks the stage of meta M against this server and its files against
 * their checksum (the first time). */
int stage_verify(const char *name, int dir_fd, const struct stage_meta *m, const char *backend,
                 const char *inputs_id, char **ret_err) {
  if (strcmp(m->backend, backend) != 0) {
    *ret_err = xasprintf("stage '%s' was made by the %s backend; this server runs the %s backend",
                         name, m->backend, backend);
    return -EXDEV;
  }
  if (strcmp(m->inputs_id, inputs_id) != 0) {
    *ret_err = xasprintf(
        "stage '%s' (%s) was made over base %s, but this server's base is now %s (its kernel, "
        "initramfs, agent, rootfs image, QEMU or guest RAM changed): it cannot start safely. "
        "Open a session, set it up again and commit it under the same name with replace: true "
        "(or stage_rm it)",
        name, m->id, m->inputs_id, inputs_id);
    return -ESTALE;
  }
  pthread_mutex_lock(&verified_lock);
  bool known = verified_has(m->id);
  pthread_mutex_unlock(&verified_lock);
  if (known)
    return 0;
  char digest[33], id[36];
  _cleanup_free_ char *why = NULL;
  uint64_t t0 = mono_ms();
  int r = stage_tree_digest(dir_fd, digest, NULL, NULL, &why);
  if (r < 0) {
    *ret_err = xasprintf("stage '%s' (%s) cannot be checked: %s; remove it with stage_rm and "
                         "commit it again",
                         name, m->id, why);
    return r == -ENOMEM ? r : -EBADMSG;
  }
  stage_make_id(digest, m->parent, m->inputs_id, m->backend, id);
  if (strcmp(digest, m->digest) != 0 || strcmp(id, m->id) != 0) {
    *ret_err = xasprintf("stage '%s' (%s) is damaged: its files do not match their checksum "
                         "(xxh3-128 %s, recorded %s); remove it with stage_rm and commit it again",
                         name, m->id, digest, m->digest);
    return -EBADMSG;
  }
  log_info("stage '%s' (%s) checked in %" PRIu64 " ms", name, m->id, mono_ms() - t0);
  stage_verified_add(m->id);
  return 0;
}

/* ---- a stage's files ---- */

int stage_open_file(const struct stage *s, const char *name, int flags, int *ret_fd,
                    char **ret_err) {
  int fd = s->dir_fd < 0 ? -EBADF : openat(s->dir_fd, name, flags | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    int r = s->dir_fd < 0 ? -EBADF : -errno;
    *ret_err = xasprintf("the stage %s (%s) cannot be used: its %s cannot be opened (%s); remove "
                         "it with stage_rm and commit it again",
                         s->name ? s->name : "(a fork's)", s->id, name,
                         r == -ELOOP ? "it is a link" : strerror(-r));
    return r;
  }
  *ret_fd = fd;
  return 0;
}

void stage_test_forget(void) {
  pthread_mutex_lock(&verified_lock);
  for (size_t i = 0; i < verified_n; i++)
    free(verified[i]);
  verified_n = 0;
  pthread_mutex_unlock(&verified_lock);
}
