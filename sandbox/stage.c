/* stage.c: the stage store (see stage.h).
 *
 * Layout under IGN_MCP_STORE/stages/ (mode 0700):
 *   <name, '/' as '+'>/      a named stage: meta.json and the backend's files
 *   .tmp-<pid>-<n>/          being made (stage_begin .. stage_finish)
 *   .anon-<pid>-<n>/         a fork's anonymous stage
 *   .rm-<pid>-<n>/           removed or replaced, deleted once nobody holds it
 *   .lock                    flock LOCK_EX around every change of names
 * A stage in use is held by a shared flock on its meta.json, and a .tmp
 * being made by an flock on the directory itself (so that no server, in
 * whatever pid namespace, removes one that is alive); a directory is deleted
 * only under .lock by whoever gets LOCK_EX on it (on its meta for stages).
 *
 * The checksum is one XXH3-128 over a canonical walk of the stage's tree
 * (names sorted; per entry its name, type, mode, owner, size, device
 * number, link target, content and user.* xattrs; a directory's entries
 * follow it and an end mark closes them).  Content is hashed per 1 MiB
 * chunk, a chunk of zeros as a count only, and holes (SEEK_DATA) are never
 * read: the digest depends on the bytes, not on how they sit on disk, and a
 * 256 MiB RAM file that is mostly holes hashes in a few ms per allocated MiB.
 * The walk is relative to directory fds, follows no link, opens files
 * O_NOFOLLOW|O_NONBLOCK and refuses trees deeper than STAGE_MAX_DEPTH.
 *
 * Owners: meta.json records the owner that committed the stage ("owner";
 * absent in a stage made before owners were recorded: owner "").  The names
 * are one space for all owners, but a stage of another owner is, to every
 * call but a commit under its name, a name nobody made: the same "no stage
 * named" error.  A commit under it is refused as taken (the name cannot be
 * given twice), with nothing else about the stage. */
#include "sandbox/stage.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <search.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/fs.h"
#include "common/util.h"
#include "common/config.h"
#include "common/log.h"

#define STAGE_MAX_DEPTH 512
#define STAGE_DIR_MAX_ENTRIES (1u << 18) /* names held in memory to sort them */
#define STAGE_META_MAX 65536
#define STAGE_LOCK_WAIT_MS 60000
#define CHUNK (1u << 20)
#define MiB ((uint64_t)1 << 20)
/* What the quota charges for each inode of a stage besides its blocks: an
 * empty file or a link takes no block but an inode of the store's file
 * system, and a sandbox can make a million of them in its tmpfs for free;
 * charged as a block each, a quota of N GiB holds at most N * 256 Ki inodes. */
#define STAGE_INODE_CHARGE 4096u

/* ---- paths and names ---- */

static char *stages_dir(void) { return xasprintf("%s/stages", cfg.store); }

/* stages/ is the server's (a stage is a copy of a sandbox and may hold
 * secrets typed into it): made 0700, never a link, owned by the server's
 * uid, never open to others nor writable by its group; group read and
 * search given on purpose (the vm backend's QEMUs, group VM_GID, must
 * reach a stage's files as they reach a base's) are kept. */
static int ensure_stages_dir(char **ret_err) {
  _cleanup_free_ char *d = stages_dir();
  int r = fs_mkdir_p(d, 0755, 0700);
  if (r < 0) {
    *ret_err = xasprintf("cannot make the stage directory %s: %s (IGN_MCP_STORE must be a "
                         "writable directory)",
                         d, strerror(-r));
    return r;
  }
  struct stat st;
  if (lstat(d, &st) < 0 || !S_ISDIR(st.st_mode)) {
    *ret_err = xasprintf("%s is not a directory (a link?): move it away so that the server can "
                         "make its stage directory there",
                         d);
    return -ENOTDIR;
  }
  /* Whoever may write in stages/ may plant a stage, swap one for a link
   * while a server checks, deletes or lays it, or rename what a server is
   * about to delete: only the server's own uid, never a group (QEMU's
   * group needs to reach a vm stage's files, never to make entries). */
  if (st.st_uid != geteuid()) {
    *ret_err = xasprintf("%s belongs to uid %u, not to the server's uid %u: whoever owns it can "
                         "plant or swap stages; move it away (or chown it to uid %u) and try "
                         "again",
                         d, (unsigned)st.st_uid, (unsigned)geteuid(), (unsigned)geteuid());
    return -EPERM;
  }
  if ((st.st_mode & 027) && chmod(d, st.st_mode & 0750) < 0) {
    int r = -errno;
    *ret_err = xasprintf("%s is writable by its group or open to others, and its mode cannot be "
                         "narrowed (%s): chmod 0700 it and try again",
                         d, strerror(errno));
    return r;
  }
  return 0;
}

/* The directory of named stage NAME (already checked). */
static char *name_dir(const char *name) {
  _cleanup_free_ char *enc = strdup(name);
  if (!enc)
    abort();
  for (char *p = enc; *p; p++)
    if (*p == '/')
      *p = '+';
  return xasprintf("%s/stages/%s", cfg.store, enc);
}

static _Atomic unsigned seq;

/* A fresh path stages/.KIND-<pid>-<n>. */
static char *aside_path(const char *kind) {
  return xasprintf("%s/stages/.%s-%d-%u", cfg.store, kind, (int)getpid(), ++seq);
}

int stage_name_check(const char *name, char **ret_err) {
  const char *why = NULL;
  size_t n = name ? strlen(name) : 0;
  char bad = 0;
  if (!name || n == 0)
    why = "it is empty";
  else if (n > STAGE_NAME_MAX)
    why = "it is longer than 128 characters";
  else if (!((name[0] >= 'a' && name[0] <= 'z') || (name[0] >= '0' && name[0] <= '9')))
    why = "it must start with a lowercase letter or a digit";
  else
    for (size_t i = 1; i < n && !why; i++) {
      char c = name[i];
      if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
            c == '/' || c == '-')) {
        bad = c;
        why = "it holds a character outside a-z 0-9 . _ / -";
      }
    }
  if (!why)
    return 0;
  if (bad && (unsigned char)bad >= 0x20 && bad != 0x7f && !((unsigned char)bad & 0x80))
    *ret_err = xasprintf("invalid stage name: %s ('%c'); a name must match %s, e.g. "
                         "\"myproject/data-deps\"",
                         why, bad, STAGE_NAME_RULE);
  else
    *ret_err = xasprintf("invalid stage name: %s; a name must match %s, e.g. "
                         "\"myproject/data-deps\"",
                         why, STAGE_NAME_RULE);
  return -EINVAL;
}

/* ---- the lock on the names ---- */

static int stages_lock(char **ret_err) {
  _cleanup_free_ char *p = xasprintf("%s/stages/.lock", cfg.store);
  int fd = open(p, O_RDONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot open the stages' lock file %s: %s (IGN_MCP_STORE must be a "
                         "writable directory)",
                         p, strerror(errno));
    return r;
  }
  struct stat st;
  if (fstat(fd, &st) == 0 && st.st_uid == geteuid() && (st.st_mode & 077))
    fchmod(fd, st.st_mode & 0700);
  uint64_t deadline = mono_ms() + STAGE_LOCK_WAIT_MS;
  bool told = false;
  while (flock(fd, LOCK_EX | LOCK_NB) < 0) {
    int r = -errno;
    if (r == -EINTR)
      continue;
    if (r != -EWOULDBLOCK || mono_ms() >= deadline) {
      *ret_err = r != -EWOULDBLOCK
                     ? xasprintf("cannot lock %s: %s", p, strerror(-r))
                     : xasprintf("another process holds %s for more than %d s (see: fuser -v %s); "
                                 "stop it or wait, then try again",
                                 p, STAGE_LOCK_WAIT_MS / 1000, p);
      close(fd);
      return r != -EWOULDBLOCK ? r : -ETIMEDOUT;
    }
    if (!told)
      log_info("waiting for %s: another server is changing the stages", p);
    told = true;
    usleep(50000);
  }
  return fd;
}

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

/* What the quota charges for BYTES of blocks and INODES inodes. */
static uint64_t charge(uint64_t bytes, uint64_t inodes) {
  uint64_t i = inodes > UINT64_MAX / STAGE_INODE_CHARGE ? UINT64_MAX : inodes * STAGE_INODE_CHARGE;
  return bytes > UINT64_MAX - i ? UINT64_MAX : bytes + i;
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
static int tree_digest(int dir_fd, char hex[33], uint64_t *ret_bytes, uint64_t *ret_inodes,
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
static uint64_t tree_usage(const char *path, uint64_t *ret_inodes) {
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
  return tree_usage(path, &inodes);
}

static void make_id(const char *digest, const char *parent, const char *inputs_id,
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

/* ---- meta.json ---- */

struct meta {
  json_t *j;
  const char *name, *id, *parent, *parent_name, *backend, *inputs_id, *carries, *digest;
  const char *owner;  /* "" when it records none */
  uint64_t bytes;
  uint64_t inodes;  /* 0 in a meta.json written before they were counted */
  int64_t created;
};

static bool hex_id(const char *s, const char *prefix, size_t nhex) {
  size_t p = strlen(prefix);
  if (!s || strncmp(s, prefix, p) || strlen(s) != p + nhex)
    return false;
  return strspn(s + p, "0123456789abcdef") == nhex;
}

static const char *opt_str(json_t *j, const char *key) {
  json_t *v = json_object_get(j, key);
  return json_is_string(v) ? json_string_value(v) : NULL;
}

/* Reads and checks the meta.json open as FD; *ret_why on failure. */
static int meta_read(int fd, struct meta *m, char **ret_why) {
  struct stat st;
  if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size > STAGE_META_MAX) {
    *ret_why = xasprintf("its meta.json is not a regular file of at most %d bytes", STAGE_META_MAX);
    return -EBADMSG;
  }
  _cleanup_free_ char *buf = malloc(STAGE_META_MAX + 1);
  if (!buf)
    return -ENOMEM;
  ssize_t n = pread(fd, buf, STAGE_META_MAX, 0);
  if (n < 0) {
    int r = -errno;
    *ret_why = xasprintf("its meta.json cannot be read: %s", strerror(-r));
    return r;
  }
  json_error_t e;
  json_t *j = json_loadb(buf, (size_t)n, JSON_REJECT_DUPLICATES, &e);
  if (!j) {
    *ret_why = xasprintf("its meta.json is not valid JSON (%s)", e.text);
    return -EBADMSG;
  }
  *m = (struct meta){.j = j};
  m->name = opt_str(j, "name");
  m->id = opt_str(j, "stage_id");
  m->parent = opt_str(j, "parent");
  m->parent_name = opt_str(j, "parent_name");
  m->backend = opt_str(j, "backend");
  m->inputs_id = opt_str(j, "base_id");
  m->carries = opt_str(j, "carries");
  m->digest = opt_str(j, "digest");
  m->owner = opt_str(j, "owner");
  if (!m->owner)
    m->owner = "";
  json_t *b = json_object_get(j, "bytes"), *c = json_object_get(j, "created");
  m->bytes = json_is_integer(b) && json_integer_value(b) >= 0 ? (uint64_t)json_integer_value(b) : 0;
  json_t *ino = json_object_get(j, "inodes");
  m->inodes =
      json_is_integer(ino) && json_integer_value(ino) >= 0 ? (uint64_t)json_integer_value(ino) : 0;
  m->created = json_is_integer(c) ? json_integer_value(c) : 0;
  if (json_integer_value(json_object_get(j, "version")) != 1 || !hex_id(m->id, "st-", 32) ||
      !hex_id(m->digest, "", 32) || !m->backend || !m->inputs_id || !m->carries ||
      (m->parent && !hex_id(m->parent, "st-", 32)) || !json_is_integer(b) || !json_is_integer(c)) {
    json_decref(j);
    m->j = NULL;
    *ret_why = strdup("its meta.json lacks a field or holds a wrong one (version 1 with "
                      "stage_id, digest, backend, base_id, carries, bytes and created)");
    return -EBADMSG;
  }
  return 0;
}

static int meta_write(const char *dir, const char *name, const char *id, const char *digest,
                      const struct stage_new *in, uint64_t bytes, uint64_t inodes,
                      int64_t created, char **ret_err) {
  json_t *j = json_pack(
      "{s:i, s:o, s:s, s:o, s:o, s:s, s:s, s:s, s:I, s:I, s:I, s:s}", "version", 1, "name",
      name ? json_string(name) : json_null(), "stage_id", id, "parent",
      in->parent ? json_string(in->parent->id) : json_null(), "parent_name",
      in->parent && in->parent->name ? json_string(in->parent->name) : json_null(), "backend",
      in->backend, "base_id", in->inputs_id, "carries", in->carries, "bytes", (json_int_t)bytes,
      "inodes", (json_int_t)inodes, "created", (json_int_t)created, "digest", digest);
  if (!j)
    abort();
  json_object_set_new(j, "owner", json_string(in->owner ? in->owner : ""));
  _cleanup_free_ char *text = json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS);
  json_decref(j);
  _cleanup_free_ char *p = xasprintf("%s/meta.json", dir);
  _cleanup_close_ int fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  size_t len = strlen(text);
  if (fd < 0 || write(fd, text, len) != (ssize_t)len || write(fd, "\n", 1) != 1 ||
      fsync(fd) < 0) {
    int r = errno ? -errno : -EIO;
    *ret_err = xasprintf("cannot write %s: %s", p, strerror(-r));
    return r;
  }
  return 0;
}

/* ---- the registry of open stages ---- */

/* A struct stage with what only this file sees. */
struct stage_obj {
  struct stage s;
  dev_t dev;      /* meta.json's inode: the stage's identity while held */
  ino_t ino;
  char *old_dir;  /* the dir before it was moved aside (a caller may still read it) */
};

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static struct stage_obj **reg;
static size_t reg_n, reg_cap;
static char **verified;
static size_t verified_n, verified_cap;

static struct stage_obj *reg_find(dev_t dev, ino_t ino) {
  for (size_t i = 0; i < reg_n; i++)
    if (reg[i]->dev == dev && reg[i]->ino == ino)
      return reg[i];
  return NULL;
}

static void reg_add(struct stage_obj *o) {
  if (reg_n == reg_cap) {
    reg_cap = reg_cap ? reg_cap * 2 : 8;
    struct stage_obj **n = realloc(reg, reg_cap * sizeof *n);
    if (!n)
      abort();
    reg = n;
  }
  reg[reg_n++] = o;
}

static void reg_del(struct stage_obj *o) {
  for (size_t i = 0; i < reg_n; i++)
    if (reg[i] == o) {
      reg[i] = reg[--reg_n];
      return;
    }
}

static bool verified_has(const char *id) {
  for (size_t i = 0; i < verified_n; i++)
    if (!strcmp(verified[i], id))
      return true;
  return false;
}

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

static char *dup_or_null(const char *s) {
  char *d = s ? strdup(s) : NULL;
  if (s && !d)
    abort();
  return d;
}

static struct stage_obj *obj_new(const struct meta *m, const char *dir, int dir_fd, int hold_fd,
                                 const struct stat *st) {
  struct stage_obj *o = calloc(1, sizeof *o);
  if (!o)
    abort();
  o->s.name = dup_or_null(m->name);
  o->s.id = dup_or_null(m->id);
  o->s.parent = dup_or_null(m->parent);
  o->s.parent_name = dup_or_null(m->parent_name);
  o->s.backend = dup_or_null(m->backend);
  o->s.inputs_id = dup_or_null(m->inputs_id);
  o->s.carries = dup_or_null(m->carries);
  o->s.owner = dup_or_null(m->owner ? m->owner : "");
  o->s.dir = dup_or_null(dir);
  o->s.bytes = m->bytes;
  o->s.created = m->created;
  o->s.refs = 1;
  o->s.hold_fd = hold_fd;
  o->s.dir_fd = dir_fd;
  o->dev = st->st_dev;
  o->ino = st->st_ino;
  return o;
}

static void obj_free(struct stage_obj *o) {
  if (o->s.hold_fd >= 0)
    close(o->s.hold_fd);
  if (o->s.dir_fd >= 0)
    close(o->s.dir_fd);
  free(o->s.name);
  free(o->s.id);
  free(o->s.parent);
  free(o->s.parent_name);
  free(o->s.backend);
  free(o->s.inputs_id);
  free(o->s.carries);
  free(o->s.owner);
  free(o->s.dir);
  free(o->old_dir);
  free(o);
}

/* The stage moved from its name to ASIDE (under the names lock): a held
 * one goes with its last reference. */
static void reg_moved(const char *aside) {
  _cleanup_free_ char *meta = xasprintf("%s/meta.json", aside);
  struct stat st;
  if (stat(meta, &st) < 0)
    return;
  pthread_mutex_lock(&reg_lock);
  struct stage_obj *o = reg_find(st.st_dev, st.st_ino);
  if (o) {
    free(o->old_dir);
    o->old_dir = o->s.dir;
    o->s.dir = dup_or_null(aside);
    o->s.removed = true;
  }
  pthread_mutex_unlock(&reg_lock);
}

/* ---- deleting ---- */

/* Deletes DIR (.rm-*, .anon-*) when nobody holds its meta; under the names
 * lock.  A directory without meta.json is deleted: none is ever left that
 * way except by a deletion that was cut short. */
static bool delete_if_free(const char *dir) {
  _cleanup_free_ char *meta = xasprintf("%s/meta.json", dir);
  _cleanup_close_ int fd = open(meta, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno != ENOENT && errno != ELOOP && errno != ENOTDIR)
    return false;
  if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) < 0)
    return false;
  fs_remove_tree(dir);
  return true;
}

static void delete_later_or_now(const char *dir) {
  _cleanup_free_ char *err = NULL;
  int lock = stages_lock(&err);
  if (lock < 0) {
    log_warn("%s; %s is left for a later clean-up", err, dir);
    return;
  }
  delete_if_free(dir);
  close(lock);
}

/* ---- space ---- */

/* The bytes all stages use as the quota counts them (blocks, and
 * STAGE_INODE_CHARGE per inode; from their metas, or a walk of .tmp dirs
 * and of directories without a meta), leaving out the entry SKIP. */
static uint64_t stages_used(const char *skip) {
  _cleanup_free_ char *sd = stages_dir();
  DIR *d = opendir(sd);
  if (!d)
    return 0;
  uint64_t used = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, ".lock") ||
        (skip && !strcmp(e->d_name, skip)))
      continue;
    _cleanup_free_ char *p = xasprintf("%s/%s", sd, e->d_name);
    if (strncmp(e->d_name, ".tmp-", 5) != 0) {
      _cleanup_free_ char *mp = xasprintf("%s/meta.json", p);
      _cleanup_close_ int fd = open(mp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
      struct meta m;
      _cleanup_free_ char *why = NULL;
      if (fd >= 0 && meta_read(fd, &m, &why) == 0) {
        uint64_t c = charge(m.bytes, m.inodes);
        used = c > UINT64_MAX - used ? UINT64_MAX : used + c;
        json_decref(m.j);
        continue;
      }
    }
    uint64_t inodes, b = tree_usage(p, &inodes);
    b = charge(b, inodes);
    used = b > UINT64_MAX - used ? UINT64_MAX : used + b;
  }
  closedir(d);
  return used;
}

static uint64_t mib_up(uint64_t b) { return (b + MiB - 1) / MiB; }

static char *quota_error(uint64_t used, uint64_t need) {
  return xasprintf("the stages in %s use %" PRIu64 " MiB of the %u MiB IGN_MCP_STAGES_MAX_MB "
                   "allows (this one may need %" PRIu64 " MiB; each file, directory and link "
                   "counts 4 KiB at least): remove stages you no longer need with stage_rm "
                   "(stage_list shows them), or raise IGN_MCP_STAGES_MAX_MB",
                   cfg.store, mib_up(used), cfg.stages_max_mb, mib_up(need));
}

static bool over_quota(uint64_t used, uint64_t need) {
  uint64_t max = (uint64_t)cfg.stages_max_mb * MiB;
  return need > max || used > max - need;
}

/* ---- making a stage ---- */

/* The .tmp dirs this server is making, each held by an flock on an fd of
 * it: stage_gc (of any server) removes a .tmp only when it can lock it, so
 * never one that is being made, whatever pid namespace its server is in. */
struct tmp_hold {
  char *dir;
  int fd;
};
static struct tmp_hold *tmps;
static size_t tmps_n, tmps_cap;

static void tmp_add(const char *dir, int fd) {
  pthread_mutex_lock(&reg_lock);
  if (tmps_n == tmps_cap) {
    tmps_cap = tmps_cap ? tmps_cap * 2 : 4;
    struct tmp_hold *n = realloc(tmps, tmps_cap * sizeof *n);
    if (!n)
      abort();
    tmps = n;
  }
  tmps[tmps_n++] = (struct tmp_hold){.dir = dup_or_null(dir), .fd = fd};
  pthread_mutex_unlock(&reg_lock);
}

/* A new fd of the .tmp DIR being made (for its walk), or -1. */
static int tmp_fd(const char *dir) {
  int fd = -1;
  pthread_mutex_lock(&reg_lock);
  for (size_t i = 0; i < tmps_n && fd < 0; i++)
    if (!strcmp(tmps[i].dir, dir))
      fd = fcntl(tmps[i].fd, F_DUPFD_CLOEXEC, 3);
  pthread_mutex_unlock(&reg_lock);
  return fd;
}

static void tmp_release(const char *dir) {
  pthread_mutex_lock(&reg_lock);
  for (size_t i = 0; i < tmps_n; i++)
    if (!strcmp(tmps[i].dir, dir)) {
      close(tmps[i].fd);
      free(tmps[i].dir);
      tmps[i] = tmps[--tmps_n];
      break;
    }
  pthread_mutex_unlock(&reg_lock);
}

int stage_begin(uint64_t need, char **ret_dir, char **ret_err) {
  int r = ensure_stages_dir(ret_err);
  if (r < 0)
    return r;
  stage_gc();
  uint64_t used = stages_used(NULL);
  if (over_quota(used, need)) {
    *ret_err = quota_error(used, need);
    return -ENOSPC;
  }
  _cleanup_free_ char *sd = stages_dir();
  struct statvfs sv;
  if (statvfs(sd, &sv) == 0 && (uint64_t)sv.f_bavail * sv.f_frsize < need) {
    *ret_err = xasprintf("the store %s has %" PRIu64 " MiB free, and this stage may need %" PRIu64
                         " MiB: free space there (stage_rm removes stages) and try again",
                         cfg.store, (uint64_t)sv.f_bavail * sv.f_frsize / MiB, mib_up(need));
    return -ENOSPC;
  }
  for (int tries = 0; tries < 16; tries++) {
    _cleanup_free_ char *dir = aside_path("tmp");
    if (mkdir(dir, 0700) == 0) {
      int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) < 0) {
        r = -errno;
        *ret_err = xasprintf("cannot hold %s: %s", dir, strerror(errno));
        if (fd >= 0)
          close(fd);
        rmdir(dir);
        return r;
      }
      tmp_add(dir, fd);
      *ret_dir = steal_ptr(dir);
      return 0;
    }
    if (errno != EEXIST) {
      r = -errno;
      *ret_err = xasprintf("cannot make %s: %s", dir, strerror(errno));
      return r;
    }
  }
  *ret_err = xasprintf("cannot find a free temporary name in %s", sd);
  return -EEXIST;
}

/* DIR is a .tmp-* directory directly in stages/. */
static bool is_tmp_dir(const char *dir) {
  _cleanup_free_ char *prefix = xasprintf("%s/stages/.tmp-", cfg.store);
  return !strncmp(dir, prefix, strlen(prefix)) && !strchr(dir + strlen(prefix), '/');
}

void stage_abort(const char *dir) {
  if (dir && is_tmp_dir(dir)) {
    fs_remove_tree(dir);
    tmp_release(dir);
  }
  else if (dir)
    log_warn("not removing %s: it is not a temporary stage directory", dir);
}

/* Renames TMP into place as NAME (or as an anonymous stage when NULL);
 * under the names lock.  *RET_DIR is where it went. */
/* The owner recorded by the stage whose directory is DIR, into *RET (to
 * free): 0, or -errno when it has no readable meta. */
static int owner_of(const char *dir, char **ret) {
  _cleanup_free_ char *mp = xasprintf("%s/meta.json", dir);
  _cleanup_close_ int fd = open(mp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  struct meta m;
  _cleanup_free_ char *why = NULL;
  int r = meta_read(fd, &m, &why);
  if (r < 0)
    return r;
  *ret = strdup(m.owner);
  json_decref(m.j);
  return *ret ? 0 : -ENOMEM;
}

/* Whether the stage at DIR is OWNER's; a stage whose meta cannot be read is
 * the owner "" 's, as one made before owners were recorded. */
static bool owned_by(const char *dir, const char *owner) {
  _cleanup_free_ char *o = NULL;
  if (owner_of(dir, &o) < 0)
    return !*owner;
  return strcmp(o, owner) == 0;
}

static char *name_taken(const char *name) {
  return xasprintf("the stage name '%s' is taken by a stage you cannot see: pick another name",
                   name);
}

static int install(const char *tmp, const char *name, const char *owner, bool replace,
                   char **ret_dir, char **ret_err) {
  if (!name) {
    for (int tries = 0; tries < 16; tries++) {
      _cleanup_free_ char *anon = aside_path("anon");
      if (renameat2(AT_FDCWD, tmp, AT_FDCWD, anon, RENAME_NOREPLACE) == 0) {
        *ret_dir = steal_ptr(anon);
        return 0;
      }
      if (errno != EEXIST)
        break;
    }
    int r = -errno;
    *ret_err = xasprintf("cannot move %s into place: %s", tmp, strerror(errno));
    return r;
  }
  _cleanup_free_ char *dir = name_dir(name);
  if (renameat2(AT_FDCWD, tmp, AT_FDCWD, dir, RENAME_NOREPLACE) == 0) {
    *ret_dir = steal_ptr(dir);
    return 0;
  }
  int r = -errno;
  if (r != -EEXIST) {
    *ret_err = xasprintf("cannot move %s to %s: %s", tmp, dir, strerror(-r));
    return r;
  }
  /* Another owner's: neither replaced nor described (under the names lock,
   * so it cannot change hands meanwhile). */
  if (!owned_by(dir, owner)) {
    *ret_err = name_taken(name);
    return -EEXIST;
  }
  if (!replace) {
    *ret_err = xasprintf("a stage named '%s' exists already (stage_info shows it): pass "
                         "replace: true to replace it, or choose another name",
                         name);
    return -EEXIST;
  }
  /* The new one takes the name in one step; the old one is at TMP then. */
  if (renameat2(AT_FDCWD, tmp, AT_FDCWD, dir, RENAME_EXCHANGE) < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot exchange %s with %s: %s", tmp, dir, strerror(-r));
    return r;
  }
  _cleanup_free_ char *rm = aside_path("rm");
  if (rename(tmp, rm) < 0) {
    log_warn("cannot move the replaced stage %s aside to %s: %s; it stays until a later "
             "clean-up",
             tmp, rm, strerror(errno));
  } else {
    reg_moved(rm);
    delete_if_free(rm);
  }
  *ret_dir = steal_ptr(dir);
  return 0;
}

/* A shared flock on DIR/meta.json: the fd, or -errno. */
static int hold(const char *dir) {
  _cleanup_free_ char *meta = xasprintf("%s/meta.json", dir);
  int fd = open(meta, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  while (flock(fd, LOCK_SH) < 0) {
    if (errno == EINTR)
      continue;
    int r = -errno;
    close(fd);
    return r;
  }
  return fd;
}

static int finish_checked(const char *dir, const char *name, bool replace,
                          const struct stage_new *in, struct stage **ret, char **ret_err) {
  char digest[33], id[36];
  uint64_t bytes = 0, inodes = 0;
  _cleanup_free_ char *why = NULL;
  _cleanup_close_ int dfd = tmp_fd(dir);
  if (dfd < 0)
    dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot open %s: %s", dir, strerror(errno));
    return r;
  }
  int r = tree_digest(dfd, digest, &bytes, &inodes, &why);
  if (r < 0) {
    *ret_err = xasprintf("cannot checksum the stage's files: %s", why);
    return r;
  }
  const char *base = strrchr(dir, '/') + 1;
  uint64_t used = stages_used(base);
  if (over_quota(used, charge(bytes, inodes))) {
    *ret_err = quota_error(used, charge(bytes, inodes));
    return -ENOSPC;
  }
  make_id(digest, in->parent ? in->parent->id : NULL, in->inputs_id, in->backend, id);
  int64_t created = (int64_t)time(NULL);
  if ((r = meta_write(dir, name, id, digest, in, bytes, inodes, created, ret_err)) < 0)
    return r;
  _cleanup_close_ int fd = hold(dir);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) < 0) {
    r = fd < 0 ? fd : -errno;
    *ret_err = xasprintf("cannot hold %s/meta.json: %s", dir, strerror(-r));
    return r;
  }
  /* The directory being made, which the rename below puts into place: its
   * files are opened relative to it, whatever is renamed onto its name
   * later. */
  _cleanup_close_ int dir_fd = openat(dfd, ".", O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot open %s: %s", dir, strerror(errno));
    return r;
  }
  int lock = stages_lock(ret_err);
  if (lock < 0)
    return lock;
  _cleanup_free_ char *placed = NULL;
  r = install(dir, name, in->owner ? in->owner : "", replace, &placed, ret_err);
  close(lock);
  if (r < 0)
    return r;
  struct meta m = {.name = name, .id = id, .parent = in->parent ? in->parent->id : NULL,
                   .parent_name = in->parent ? in->parent->name : NULL, .backend = in->backend,
                   .inputs_id = in->inputs_id, .carries = in->carries, .bytes = bytes,
                   .created = created, .owner = in->owner ? in->owner : ""};
  struct stage_obj *o = obj_new(&m, placed, steal_fd(dir_fd), steal_fd(fd), &st);
  pthread_mutex_lock(&reg_lock);
  reg_add(o);
  verified_add(id);
  pthread_mutex_unlock(&reg_lock);
  *ret = &o->s;
  return 0;
}

int stage_finish(const char *dir, const char *name, bool replace, const struct stage_new *in,
                 struct stage **ret, char **ret_err) {
  if (!dir || !is_tmp_dir(dir)) {
    *ret_err = xasprintf("%s is not a directory from stage_begin", dir ? dir : "(null)");
    return -EINVAL;
  }
  int r = 0;
  if (name)
    r = stage_name_check(name, ret_err);
  if (r == 0 && (!in || !in->backend || !in->inputs_id || !in->carries)) {
    *ret_err = strdup("a stage needs its backend, inputs id and what it carries");
    r = -EINVAL;
  }
  if (r == 0)
    r = finish_checked(dir, name, replace, in, ret, ret_err);
  if (r < 0)
    fs_remove_tree(dir);
  tmp_release(dir);
  return r;
}

/* ---- opening ---- */

static char *no_such(const char *name) {
  return xasprintf("no stage named '%s' (stage_list shows the stages in %s)", name, cfg.store);
}

/* Reads the meta of stage NAME from FD for OWNER: another owner's stage is
 * not there for it, and whose a damaged meta is cannot be read, so only the
 * owner of old stages, "", hears that it is damaged.  *M holds a reference
 * the caller drops (json_decref(m->j)) when this returns 0. */
static int meta_read_owned(int fd, const char *name, const char *owner, struct meta *m,
                           char **ret_err) {
  _cleanup_free_ char *why = NULL;
  int r = meta_read(fd, m, &why);
  if (r < 0) {
    *ret_err = *owner ? no_such(name)
                      : xasprintf("stage '%s' is damaged: %s; remove it with stage_rm and "
                                  "commit it again",
                                  name, why);
    return *owner ? -ENOENT : r;
  }
  if (strcmp(m->owner, owner) != 0) {
    json_decref(m->j);
    *ret_err = no_such(name);
    return -ENOENT;
  }
  return 0;
}

/* Opens and holds NAME's meta.json, and opens its directory, under the
 * names lock, so that neither is moved aside in between: the meta's fd
 * (*RET_DIR_FD the directory's, O_PATH: the stage is checked through it and
 * its files are opened relative to it), or -errno with *ret_err. */
static int open_held(const char *name, const char *dir, int *ret_dir_fd, char **ret_err) {
  int lock = stages_lock(ret_err);
  if (lock < 0)
    return lock;
  int fd = hold(dir);
  int dfd = fd >= 0 ? open(dir, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : -1;
  int e = errno;
  close(lock);
  if (fd >= 0 && dfd < 0) {
    close(fd);
    fd = -e;
  }
  if (fd == -ENOENT || fd == -ENOTDIR || fd == -ELOOP) {
    struct stat st;
    if (fd == -ENOENT && lstat(dir, &st) == 0) {
      *ret_err = xasprintf("stage '%s' has no meta.json (it is damaged): remove it with "
                           "stage_rm and commit it again",
                           name);
      return -EBADMSG;
    }
    *ret_err = no_such(name);
    return -ENOENT;
  }
  if (fd < 0)
    *ret_err = xasprintf("cannot open stage '%s' (%s/meta.json): %s", name, dir, strerror(-fd));
  else
    *ret_dir_fd = dfd;
  return fd;
}

/* Checks the stage of meta M against this server and its files against
 * their checksum (the first time). */
static int open_check(const char *name, int dir_fd, const struct meta *m,
                      const char *backend, const char *inputs_id, char **ret_err) {
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
  pthread_mutex_lock(&reg_lock);
  bool known = verified_has(m->id);
  pthread_mutex_unlock(&reg_lock);
  if (known)
    return 0;
  char digest[33], id[36];
  _cleanup_free_ char *why = NULL;
  uint64_t t0 = mono_ms();
  int r = tree_digest(dir_fd, digest, NULL, NULL, &why);
  if (r < 0) {
    *ret_err = xasprintf("stage '%s' (%s) cannot be checked: %s; remove it with stage_rm and "
                         "commit it again",
                         name, m->id, why);
    return r == -ENOMEM ? r : -EBADMSG;
  }
  make_id(digest, m->parent, m->inputs_id, m->backend, id);
  if (strcmp(digest, m->digest) != 0 || strcmp(id, m->id) != 0) {
    *ret_err = xasprintf("stage '%s' (%s) is damaged: its files do not match their checksum "
                         "(xxh3-128 %s, recorded %s); remove it with stage_rm and commit it again",
                         name, m->id, digest, m->digest);
    return -EBADMSG;
  }
  log_info("stage '%s' (%s) checked in %" PRIu64 " ms", name, m->id, mono_ms() - t0);
  pthread_mutex_lock(&reg_lock);
  verified_add(m->id);
  pthread_mutex_unlock(&reg_lock);
  return 0;
}

int stage_open(const char *name, const char *owner, const char *backend, const char *inputs_id,
               struct stage **ret, char **ret_err) {
  int r = stage_name_check(name, ret_err);
  if (r < 0)
    return r;
  _cleanup_free_ char *dir = name_dir(name);
  _cleanup_close_ int dir_fd = -1;
  _cleanup_close_ int fd = open_held(name, dir, &dir_fd, ret_err);
  if (fd == -EBADMSG && *owner) {
    /* No meta, so no owner: the owner "" 's, to anyone else a name nobody made. */
    free(*ret_err);
    *ret_err = no_such(name);
    return -ENOENT;
  }
  if (fd < 0)
    return fd;
  struct stat st;
  if (fstat(fd, &st) < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot open stage '%s': %s", name, strerror(errno));
    return r;
  }
  struct meta m;
  if ((r = meta_read_owned(fd, name, owner, &m, ret_err)) < 0)
    return r;
  if ((r = open_check(name, dir_fd, &m, backend, inputs_id, ret_err)) == 0) {
    pthread_mutex_lock(&reg_lock);
    struct stage_obj *o = reg_find(st.st_dev, st.st_ino);
    if (o) {
      o->s.refs++;
    } else {
      m.name = name; /* where it is now, whatever it was made as */
      o = obj_new(&m, dir, steal_fd(dir_fd), steal_fd(fd), &st);
      reg_add(o);
    }
    pthread_mutex_unlock(&reg_lock);
    *ret = &o->s;
  }
  json_decref(m.j);
  return r;
}

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

void stage_ref(struct stage *s) {
  pthread_mutex_lock(&reg_lock);
  s->refs++;
  pthread_mutex_unlock(&reg_lock);
}

void stage_unref(struct stage *s) {
  if (!s)
    return;
  struct stage_obj *o = (struct stage_obj *)s;
  pthread_mutex_lock(&reg_lock);
  bool last = --s->refs == 0;
  if (last)
    reg_del(o);
  pthread_mutex_unlock(&reg_lock);
  if (!last)
    return;
  bool gone = s->removed || !s->name;
  /* Moved aside by another server (or by an rm of this one that raced this
   * last reference): the name holds another inode, or none. */
  bool moved = false;
  if (!gone) {
    _cleanup_free_ char *meta = xasprintf("%s/meta.json", s->dir);
    struct stat st;
    moved = lstat(meta, &st) < 0 || st.st_dev != o->dev || st.st_ino != o->ino;
  }
  _cleanup_free_ char *dir = gone ? strdup(s->dir) : NULL;
  obj_free(o); /* closes hold_fd */
  if (dir)
    delete_later_or_now(dir);
  else if (moved)
    stage_gc();
}

void stage_sessions_add(struct stage *s, int delta) {
  pthread_mutex_lock(&reg_lock);
  if (delta < 0 && s->sessions < (unsigned)-delta)
    s->sessions = 0;
  else
    s->sessions += (unsigned)delta;
  pthread_mutex_unlock(&reg_lock);
}

/* ---- listing ---- */

/* The sessions of this server started from the stage whose meta is FD. */
static unsigned sessions_of(int fd) {
  struct stat st;
  if (fstat(fd, &st) < 0)
    return 0;
  pthread_mutex_lock(&reg_lock);
  struct stage_obj *o = reg_find(st.st_dev, st.st_ino);
  unsigned n = o ? o->s.sessions : 0;
  pthread_mutex_unlock(&reg_lock);
  return n;
}

/* NAME is where the stage is (its meta's name is what it was made as). */
static json_t *meta_json(const char *name, const struct meta *m, unsigned sessions) {
  json_t *j = json_pack("{s:s?, s:s, s:s?, s:s?, s:s, s:s, s:s, s:I, s:I, s:i}", "name", name,
                        "stage_id", m->id, "parent", m->parent_name ? m->parent_name : m->parent,
                        "parent_id", m->parent, "carries", m->carries, "backend", m->backend,
                        "base_id", m->inputs_id, "bytes", (json_int_t)m->bytes, "created",
                        (json_int_t)m->created, "sessions", (int)sessions);
  if (!j)
    abort();
  return j;
}

static int cmp_stage_names(const void *a, const void *b) {
  json_t *const *x = a, *const *y = b;
  return strcmp(json_string_value(json_object_get(*x, "name")),
                json_string_value(json_object_get(*y, "name")));
}

json_t *stage_list(const char *owner) {
  json_t *arr = json_array();
  _cleanup_free_ char *sd = stages_dir();
  DIR *d = opendir(sd);
  size_t n = 0, cap = 0;
  json_t **items = NULL;
  struct dirent *e;
  while (d && (e = readdir(d))) {
    if (e->d_name[0] == '.')
      continue;
    _cleanup_free_ char *name = strdup(e->d_name), *bad = NULL;
    if (!name)
      abort();
    for (char *p = name; *p; p++)
      if (*p == '+')
        *p = '/';
    if (stage_name_check(name, &bad) < 0)
      continue; /* not made by a server: no name could open it */
    _cleanup_free_ char *mp = xasprintf("%s/%s/meta.json", sd, e->d_name);
    _cleanup_close_ int fd = open(mp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    struct meta m;
    _cleanup_free_ char *why = NULL;
    if (fd < 0 || meta_read(fd, &m, &why) < 0) {
      log_warn("stage '%s' is not listed: %s; remove it with stage_rm", name,
               why ? why : "it has no meta.json");
      continue;
    }
    if (strcmp(m.owner, owner) != 0) {
      json_decref(m.j);
      continue;
    }
    if (n == cap) {
      cap = cap ? cap * 2 : 16;
      json_t **ni = realloc(items, cap * sizeof *ni);
      if (!ni)
        abort();
      items = ni;
    }
    items[n++] = meta_json(name, &m, sessions_of(fd));
    json_decref(m.j);
  }
  if (d)
    closedir(d);
  if (n)
    qsort(items, n, sizeof *items, cmp_stage_names);
  for (size_t i = 0; i < n; i++)
    json_array_append_new(arr, items[i]);
  free(items);
  json_t *j = json_pack("{s:o, s:I, s:I}", "stages", arr, "bytes_used",
                        (json_int_t)stages_used(NULL), "bytes_max",
                        (json_int_t)((uint64_t)cfg.stages_max_mb * MiB));
  if (!j)
    abort();
  return j;
}

int stage_info(const char *name, const char *owner, json_t **ret, char **ret_err) {
  int r = stage_name_check(name, ret_err);
  if (r < 0)
    return r;
  _cleanup_free_ char *dir = name_dir(name);
  _cleanup_free_ char *mp = xasprintf("%s/meta.json", dir);
  _cleanup_close_ int fd = open(mp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    r = -errno;
    *ret_err = r == -ENOENT || r == -ENOTDIR ? no_such(name)
                                            : xasprintf("cannot read %s: %s", mp, strerror(-r));
    return r == -ENOTDIR ? -ENOENT : r;
  }
  struct meta m;
  if ((r = meta_read_owned(fd, name, owner, &m, ret_err)) < 0)
    return r;
  *ret = meta_json(name, &m, sessions_of(fd));
  json_decref(m.j);
  return 0;
}

int stage_rm(const char *name, const char *owner, char **ret_err) {
  int r = stage_name_check(name, ret_err);
  if (r < 0)
    return r;
  _cleanup_free_ char *dir = name_dir(name);
  _cleanup_free_ char *rm = aside_path("rm");
  int lock = stages_lock(ret_err);
  if (lock < 0)
    return lock;
  /* Checked under the names lock: the stage cannot be replaced by another
   * owner's between the check and the rename. */
  struct stat st;
  if (lstat(dir, &st) == 0 && !owned_by(dir, owner)) {
    *ret_err = no_such(name);
    r = -ENOENT;
  } else if (renameat2(AT_FDCWD, dir, AT_FDCWD, rm, RENAME_NOREPLACE) < 0) {
    r = -errno;
    *ret_err = r == -ENOENT ? no_such(name)
                            : xasprintf("cannot move %s aside to %s: %s", dir, rm, strerror(-r));
  } else {
    reg_moved(rm);
    if (!delete_if_free(rm))
      log_info("stage '%s' is removed; its files go when its last session ends", name);
  }
  close(lock);
  return r;
}

/* ---- clean-up ---- */

static bool pid_dead(const char *s) {
  char *end;
  long pid = strtol(s, &end, 10);
  if (end == s || *end != '-' || pid <= 0 || pid > INT32_MAX)
    return false;
  return kill((pid_t)pid, 0) < 0 && errno == ESRCH;
}

void stage_gc(void) {
  _cleanup_free_ char *err = NULL;
  _cleanup_free_ char *sd = stages_dir();
  if (access(sd, F_OK) < 0)
    return;
  int lock = stages_lock(&err);
  if (lock < 0) {
    log_warn("stage clean-up skipped: %s", err);
    return;
  }
  DIR *d = opendir(sd);
  struct dirent *e;
  while (d && (e = readdir(d))) {
    const char *n = e->d_name;
    _cleanup_free_ char *p = xasprintf("%s/%s", sd, n);
    if (!strncmp(n, ".tmp-", 5)) {
      _cleanup_close_ int fd = open(p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      /* Its meta is checked too: a replaced stage that could not be moved
       * to .rm-* stays at its .tmp-* name, maybe held. */
      if (fd < 0 ? errno == ENOTDIR || errno == ELOOP : flock(fd, LOCK_EX | LOCK_NB) == 0) {
        if (delete_if_free(p))
          log_info("removed %s: a stage its server did not finish", p);
      }
    } else if (!strncmp(n, ".anon-", 6)) {
      _cleanup_free_ char *mp = xasprintf("%s/meta.json", p);
      bool has_meta = access(mp, F_OK) == 0;
      if (has_meta || pid_dead(n + 6))
        delete_if_free(p);
    } else if (!strncmp(n, ".rm-", 4)) {
      delete_if_free(p);
    }
  }
  if (d)
    closedir(d);
  close(lock);
}

void stage_test_forget(void) {
  pthread_mutex_lock(&reg_lock);
  for (size_t i = 0; i < verified_n; i++)
    free(verified[i]);
  verified_n = 0;
  pthread_mutex_unlock(&reg_lock);
}
