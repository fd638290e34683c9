/* stage_commit.c: making a stage (see stage.h): a directory of stages/ to
 * make it in (stage_begin, held by an flock while it is made), its
 * checksum, quota and meta.json, and the rename that puts it into place
 * under its name, or an anonymous one's (stage_finish), replacing a stage
 * of the same owner only when asked; or its removal (stage_abort). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "common/config.h"
#include "common/fs.h"
#include "common/log.h"
#include "common/util.h"
#include "sandbox/stage_int.h"

/* ---- making a stage ---- */

/* The .tmp dirs this server is making, each held by an flock on an fd of
 * it: stage_gc (of any server) removes a .tmp only when it can lock it, so
 * never one that is being made, whatever pid namespace its server is in. */
struct tmp_hold {
  char *dir;
  int fd;
};
static pthread_mutex_t tmp_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tmp_hold *tmps;
static size_t tmps_n, tmps_cap;

static void tmp_add(const char *dir, int fd) {
  pthread_mutex_lock(&tmp_lock);
  if (tmps_n == tmps_cap) {
    tmps_cap = tmps_cap ? tmps_cap * 2 : 4;
    struct tmp_hold *n = realloc(tmps, tmps_cap * sizeof *n);
    if (!n)
      abort();
    tmps = n;
  }
  tmps[tmps_n++] = (struct tmp_hold){.dir = dup_or_null(dir), .fd = fd};
  pthread_mutex_unlock(&tmp_lock);
}

/* A new fd of the .tmp DIR being made (for its walk), or -1. */
static int tmp_fd(const char *dir) {
  int fd = -1;
  pthread_mutex_lock(&tmp_lock);
  for (size_t i = 0; i < tmps_n && fd < 0; i++)
    if (!strcmp(tmps[i].dir, dir))
      fd = fcntl(tmps[i].fd, F_DUPFD_CLOEXEC, 3);
  pthread_mutex_unlock(&tmp_lock);
  return fd;
}

static void tmp_release(const char *dir) {
  pthread_mutex_lock(&tmp_lock);
  for (size_t i = 0; i < tmps_n; i++)
    if (!strcmp(tmps[i].dir, dir)) {
      close(tmps[i].fd);
      free(tmps[i].dir);
      tmps[i] = tmps[--tmps_n];
      break;
    }
  pthread_mutex_unlock(&tmp_lock);
}

int stage_begin(uint64_t need, char **ret_dir, char **ret_err) {
  int r = stage_store_ensure(ret_err);
  if (r < 0)
    return r;
  stage_gc();
  uint64_t used = stage_space_used(NULL);
  if (stage_over_quota(used, need)) {
    *ret_err = stage_quota_error(used, need);
    return -ENOSPC;
  }
  _cleanup_free_ char *sd = stage_store_dir();
  struct statvfs sv;
  if (statvfs(sd, &sv) == 0 && (uint64_t)sv.f_bavail * sv.f_frsize < need) {
    *ret_err = xasprintf("the store %s has %" PRIu64 " MiB free, and this stage may need %" PRIu64
                         " MiB: free space there (stage_rm removes stages) and try again",
                         cfg.store, (uint64_t)sv.f_bavail * sv.f_frsize / MiB, stage_mib_up(need));
    return -ENOSPC;
  }
  for (int tries = 0; tries < 16; tries++) {
    _cleanup_free_ char *dir = stage_aside_path("tmp");
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

static char *name_taken(const char *name) {
  return xasprintf("the stage name '%s' is taken by a stage you cannot see: pick another name",
                   name);
}

/* Renames TMP into place as NAME (or as an anonymous stage when NULL);
 * under the names lock.  *RET_DIR is where it went. */
static int install(const char *tmp, const char *name, const char *owner, bool replace,
                   char **ret_dir, char **ret_err) {
  if (!name) {
    for (int tries = 0; tries < 16; tries++) {
      _cleanup_free_ char *anon = stage_aside_path("anon");
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
  _cleanup_free_ char *dir = stage_name_dir(name);
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
  if (!stage_owned_by(dir, owner)) {
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
  _cleanup_free_ char *rm = stage_aside_path("rm");
  if (rename(tmp, rm) < 0) {
    log_warn("cannot move the replaced stage %s aside to %s: %s; it stays until a later "
             "clean-up",
             tmp, rm, strerror(errno));
  } else {
    stage_reg_moved(rm);
    stage_delete_if_free(rm);
  }
  *ret_dir = steal_ptr(dir);
  return 0;
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
  int r = stage_tree_digest(dfd, digest, &bytes, &inodes, &why);
  if (r < 0) {
    *ret_err = xasprintf("cannot checksum the stage's files: %s", why);
    return r;
  }
  const char *base = strrchr(dir, '/') + 1;
  uint64_t used = stage_space_used(base);
  if (stage_over_quota(used, stage_charge(bytes, inodes))) {
    *ret_err = stage_quota_error(used, stage_charge(bytes, inodes));
    return -ENOSPC;
  }
  stage_make_id(digest, in->parent ? in->parent->id : NULL, in->inputs_id, in->backend, id);
  int64_t created = (int64_t)time(NULL);
  if ((r = stage_meta_write(dir, name, id, digest, in, bytes, inodes, created, ret_err)) < 0)
    return r;
  _cleanup_close_ int fd = stage_hold(dir);
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
  int lock = stage_names_lock(ret_err);
  if (lock < 0)
    return lock;
  _cleanup_free_ char *placed = NULL;
  r = install(dir, name, in->owner ? in->owner : "", replace, &placed, ret_err);
  close(lock);
  if (r < 0)
    return r;
  struct stage_meta m = {.name = name, .id = id, .parent = in->parent ? in->parent->id : NULL,
                         .parent_name = in->parent ? in->parent->name : NULL,
                         .backend = in->backend, .inputs_id = in->inputs_id,
                         .carries = in->carries, .bytes = bytes, .created = created,
                         .owner = in->owner ? in->owner : ""};
  *ret = stage_reg_new(&m, placed, steal_fd(dir_fd), steal_fd(fd), &st);
  stage_verified_add(id);
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
