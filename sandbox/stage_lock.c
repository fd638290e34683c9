/* stage_lock.c: what the servers that share a store agree on about its
 * stages (see stage.h and the layout in stage_store.c): the names lock
 * around every change of names, the shared hold on the meta of a stage in
 * use, deleting a directory only once nobody holds it, the clean-up of what
 * servers that died left (stage_gc), and the space quota,
 * IGN_MCP_STAGES_MAX_MB, that all their stages count against. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/config.h"
#include "common/fs.h"
#include "common/log.h"
#include "common/util.h"
#include "sandbox/stage_int.h"

#define STAGE_LOCK_WAIT_MS 60000
/* What the quota charges for each inode of a stage besides its blocks: an
 * empty file or a link takes no block but an inode of the store's file
 * system, and a sandbox can make a million of them in its tmpfs for free;
 * charged as a block each, a quota of N GiB holds at most N * 256 Ki inodes. */
#define STAGE_INODE_CHARGE 4096u

/* ---- the lock on the names ---- */

int stage_names_lock(char **ret_err) {
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

/* A shared flock on DIR/meta.json: the fd, or -errno. */
int stage_hold(const char *dir) {
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

/* ---- deleting ---- */

/* Deletes DIR (.rm-*, .anon-*) when nobody holds its meta; under the names
 * lock.  A directory without meta.json is deleted: none is ever left that
 * way except by a deletion that was cut short. */
bool stage_delete_if_free(const char *dir) {
  _cleanup_free_ char *meta = xasprintf("%s/meta.json", dir);
  _cleanup_close_ int fd = open(meta, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno != ENOENT && errno != ELOOP && errno != ENOTDIR)
    return false;
  if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) < 0)
    return false;
  fs_remove_tree(dir);
  return true;
}

void stage_delete_later_or_now(const char *dir) {
  _cleanup_free_ char *err = NULL;
  int lock = stage_names_lock(&err);
  if (lock < 0) {
    log_warn("%s; %s is left for a later clean-up", err, dir);
    return;
  }
  stage_delete_if_free(dir);
  close(lock);
}

/* ---- space ---- */

/* What the quota charges for BYTES of blocks and INODES inodes. */
uint64_t stage_charge(uint64_t bytes, uint64_t inodes) {
  uint64_t i = inodes > UINT64_MAX / STAGE_INODE_CHARGE ? UINT64_MAX : inodes * STAGE_INODE_CHARGE;
  return bytes > UINT64_MAX - i ? UINT64_MAX : bytes + i;
}

/* The bytes all stages use as the quota counts them (blocks, and
 * STAGE_INODE_CHARGE per inode; from their metas, or a walk of .tmp dirs
 * and of directories without a meta), leaving out the entry SKIP. */
uint64_t stage_space_used(const char *skip) {
  _cleanup_free_ char *sd = stage_store_dir();
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
      struct stage_meta m;
      _cleanup_free_ char *why = NULL;
      if (fd >= 0 && stage_meta_read(fd, &m, &why) == 0) {
        uint64_t c = stage_charge(m.bytes, m.inodes);
        used = c > UINT64_MAX - used ? UINT64_MAX : used + c;
        json_decref(m.j);
        continue;
      }
    }
    uint64_t inodes, b = stage_tree_usage(p, &inodes);
    b = stage_charge(b, inodes);
    used = b > UINT64_MAX - used ? UINT64_MAX : used + b;
  }
  closedir(d);
  return used;
}

char *stage_quota_error(uint64_t used, uint64_t need) {
  return xasprintf("the stages in %s use %" PRIu64 " MiB of the %u MiB IGN_MCP_STAGES_MAX_MB "
                   "allows (this one may need %" PRIu64 " MiB; each file, directory and link "
                   "counts 4 KiB at least): remove stages you no longer need with stage_rm "
                   "(stage_list shows them), or raise IGN_MCP_STAGES_MAX_MB",
                   cfg.store, stage_mib_up(used), cfg.stages_max_mb, stage_mib_up(need));
}

bool stage_over_quota(uint64_t used, uint64_t need) {
  uint64_t max = (uint64_t)cfg.stages_max_mb * MiB;
  return need > max || used > max - need;
}

/* ---- clean-up ---- */

static bool pid_dead(const char *s) {
  char *end;
  long pid = strtol(s, &end, 10);
  if (end == s || *end != '-' || pid <= 0 || pid > INT32_MAX)
    return false;
  return kill((pid_t)pid, 0) < 0 && errno == ESRCH;
}

/* Goes over the .tmp, .anon and .rm directories (the layout: stage_store.c)
 * and deletes those nobody holds any more.  Named stages are never touched
 * here: a kind of directory that must outlive its server is one this passes
 * over. */
void stage_gc(void) {
  _cleanup_free_ char *err = NULL;
  _cleanup_free_ char *sd = stage_store_dir();
  if (access(sd, F_OK) < 0)
    return;
  int lock = stage_names_lock(&err);
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
        if (stage_delete_if_free(p))
          log_info("removed %s: a stage its server did not finish", p);
      }
    } else if (!strncmp(n, ".anon-", 6)) {
      _cleanup_free_ char *mp = xasprintf("%s/meta.json", p);
      bool has_meta = access(mp, F_OK) == 0;
      if (has_meta || pid_dead(n + 6))
        stage_delete_if_free(p);
    } else if (!strncmp(n, ".rm-", 4)) {
      stage_delete_if_free(p);
    }
  }
  if (d)
    closedir(d);
  close(lock);
}
