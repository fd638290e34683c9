/* ns_snapshot.c: the commits of a namespace sandbox, and what a sandbox
 * from the base is made of (its inputs id: the agent's and the rootfs's
 * contents), which names the stages it may start from.
 *
 * A commit copies the sandbox's files (ns_stage.c): its overlay upper, and
 * its /root and /tmp when they are scratch directories apart from it.  The
 * upper stays where it is, on the sandbox's tmpfs, whose size is the
 * sandbox's disk limit: a write past it is ENOSPC inside the sandbox, the
 * pages are charged to its memory cgroup, and nothing is left on the host
 * when it dies (a host-side upper directory would need a quota of its own
 * and a cleanup after a killed server).  The server reads it through the
 * agent's fd of the setup tmpfs, /proc/<agent pid>/fd/NS_STATE_FD: a root
 * server may (CAP_SYS_PTRACE over every user namespace), and so may a user
 * server (it owns the sandbox's user namespace, where it holds every
 * capability, and the agent runs as its uid); the sandbox's own processes
 * may not (the agent is not dumpable).
 *
 * While the copy runs, the sandbox's processes are frozen when it has a
 * cgroup with a freezer, so the files are those of one instant.  Without
 * one (a user server without delegated cgroups) the copy is of a running
 * sandbox: a file written meanwhile may be copied half old, half new; the
 * session layer makes sure no call of ours runs, but a background process
 * of the sandbox's may.  The log says so. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "sandbox/ns_int.h"
#include "sandbox/ns_stage.h"

/* How long a commit waits for the sandbox's processes to stop. */
#define NS_FREEZE_TIMEOUT_MS 2000u

/* The agent's setup tmpfs, opened from the host. */
static int ns_open_state(struct ns_sandbox *sb, int *ret_fd, char **ret_err) {
  pthread_mutex_lock(&sb->proc.lock);
  pid_t pid = sb->proc.reaped ? 0 : sb->proc.pid;
  int pidfd = sb->proc.pidfd;
  pthread_mutex_unlock(&sb->proc.lock);
  if (pid <= 0) {
    *ret_err = xasprintf("the sandbox of session %s is gone: close it and open a new one",
                         sb->session_id);
    return -ESRCH;
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, NS_STATE_FD);
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot open the files of session %s through %s (the agent's setup "
                         "tmpfs): %s%s",
                         sb->session_id, path, strerror(errno),
                         errno == EACCES || errno == EPERM
                             ? "; the server needs ptrace access to its sandboxes' agents "
                               "(root, or the owner of their user namespaces)"
                             : "");
    return r;
  }
  /* Alive after the open: the pid was the agent's when it was opened. */
  if (pidfd >= 0 && syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) < 0) {
    close(fd);
    *ret_err = xasprintf("the sandbox of session %s died while it was being committed",
                         sb->session_id);
    return -ESRCH;
  }
  *ret_fd = fd;
  return 0;
}

static int ns_open_dir_at(int dfd, const char *name, int *ret_fd, char **ret_err) {
  int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot open %s: %s", name, strerror(errno));
    return r;
  }
  *ret_fd = fd;
  return 0;
}

/* The copy itself: the parent stage's layer (if any) is linked before the
 * freeze, the upper and scratch directories copied while frozen. */
static int ns_copy_layer(struct ns_sandbox *sb, int state, int layer, bool *frozen,
                         uint64_t *t0, struct ns_layer_stats *st, char **ret_err) {
  bool root = ns_as_root();
  /* What is copied from the sandbox is at most what its disk holds. */
  struct ns_layer_opts own = {.owners = root ? NS_LAYER_OWNERS_BLOCK : NS_LAYER_OWNERS_SELF,
                              .base = sb->host_uid,
                              .max_bytes = (uint64_t)sb->overlay_mb << 20};
  struct ns_layer_opts keep = {.owners = root ? NS_LAYER_OWNERS_KEEP : NS_LAYER_OWNERS_SELF};
  _cleanup_close_ int upper = -1, parent = -1, scratch = -1;
  int r;
  if ((r = ns_open_dir_at(state, "upper", &upper, ret_err)) < 0)
    return r;
  /* The layer the sandbox was laid over, by the fd opened then: not by
   * its path, whose name another server may have given to another stage
   * since (stage_rm, replace). */
  if (sb->stage_layer_fd >= 0) {
    if ((r = ns_open_dir_at(sb->stage_layer_fd, ".", &parent, ret_err)) < 0 ||
        (r = ns_layer_link(parent, layer, &keep, st, ret_err)) < 0)
      return r;
  }
  if (cgroup_can_freeze(sb->cg)) {
    *t0 = mono_us();
    *frozen = true;
    if ((r = cgroup_freeze(sb->cg, true, NS_FREEZE_TIMEOUT_MS, ret_err)) < 0)
      return r;
  }
  if ((r = ns_layer_apply(upper, layer, &own, st, ret_err)) < 0)
    return r;
  /* /root and /tmp of a sandbox that could not write the rootfs's. */
  if (ns_open_dir_at(state, "scratch", &scratch, ret_err) < 0) {
    free(steal_ptr(*ret_err));
    return 0;
  }
  static const char *const names[] = {"root", "tmp"};
  for (size_t i = 0; i < ARRAY_SIZE(names); i++) {
    _cleanup_close_ int fd = -1;
    if (ns_open_dir_at(scratch, names[i], &fd, ret_err) < 0) {
      free(steal_ptr(*ret_err));
      continue;
    }
    if ((r = ns_layer_apply_dir(fd, layer, names[i], &own, st, ret_err)) < 0)
      return r;
  }
  return 0;
}

int ns_snapshot(struct sandbox *base, const char *dir, struct sandbox_snapshot *ret,
                char **ret_err) {
  struct ns_sandbox *sb = (struct ns_sandbox *)base;
  _cleanup_close_ int state = -1, dirfd = -1, layer = -1;
  int r = ns_open_state(sb, &state, ret_err);
  if (r < 0)
    return r;
  if ((r = ns_open_dir_at(AT_FDCWD, dir, &dirfd, ret_err)) < 0)
    return r;
  if (mkdirat(dirfd, "layer", 0755) < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot create %s/layer: %s", dir, strerror(errno));
    return r;
  }
  if ((r = ns_open_dir_at(dirfd, "layer", &layer, ret_err)) < 0)
    return r;
  struct ns_layer_stats st = {0};
  bool frozen = false;
  uint64_t t0 = 0;
  _cleanup_free_ char *err = NULL;
  r = ns_copy_layer(sb, state, layer, &frozen, &t0, &st, &err);
  uint64_t paused = 0;
  /* A final snapshot that succeeded stays frozen: the caller ends the
   * sandbox (or calls ns_unpause).  Every other path thaws: a sandbox left
   * frozen would hang every call. */
  if (frozen && !(ret->final && r == 0)) {
    _cleanup_free_ char *thaw_err = NULL;
    if (cgroup_freeze(sb->cg, false, NS_FREEZE_TIMEOUT_MS, &thaw_err) < 0)
      log_warn("session %s: %s", sb->session_id, thaw_err);
  }
  if (frozen)
    paused = mono_us() - t0;
  if (r < 0) {
    *ret_err = xasprintf("cannot save the files of session %s: %s", sb->session_id,
                         err ? err : strerror(-r));
    return r;
  }
  if (!frozen)
    log_info("session %s: committed while its processes ran (no cgroup freezer here): a file "
             "written meanwhile may be saved half written",
             sb->session_id);
  if (st.dropped_special || st.skipped_owner || st.unreadable || st.xattrs_dropped)
    log_warn("session %s: the stage leaves out %llu device nodes or sockets, %llu files owned "
             "by uids outside the sandbox, %llu files the server could not read and %llu "
             "extended attributes",
             sb->session_id, (unsigned long long)st.dropped_special,
             (unsigned long long)st.skipped_owner, (unsigned long long)st.unreadable,
             (unsigned long long)st.xattrs_dropped);
  log_info("session %s: layer of %llu entries (%llu linked from its stage, %llu hard links of "
           "its own, %llu whiteouts), %llu bytes copied, paused %llu us",
           sb->session_id, (unsigned long long)st.entries, (unsigned long long)st.linked,
           (unsigned long long)st.relinked, (unsigned long long)st.whiteouts,
           (unsigned long long)st.bytes,
           (unsigned long long)paused);
  ret->carries = "files";
  ret->paused_us = paused;
  return 0;
}

int ns_unpause(struct sandbox *base, char **ret_err) {
  struct ns_sandbox *sb = (struct ns_sandbox *)base;
  if (!cgroup_can_freeze(sb->cg))
    return 0;
  return cgroup_freeze(sb->cg, false, NS_FREEZE_TIMEOUT_MS, ret_err);
}

/* What the agent binary is: XXH3-64 of its content, computed once per
 * version of the file (device, inode, size, mtime). */
static int ns_agent_hash(const char *path, uint64_t *ret, char **ret_err) {
  static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
  static struct stat seen;
  static uint64_t hash;
  static bool known;
  _cleanup_close_ int fd = open(path, O_RDONLY | O_CLOEXEC);
  struct stat s;
  if (fd < 0 || fstat(fd, &s) < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot read the agent %s: %s", path, strerror(errno));
    return r;
  }
  pthread_mutex_lock(&lock);
  bool same = known && s.st_dev == seen.st_dev && s.st_ino == seen.st_ino &&
              s.st_size == seen.st_size && s.st_mtim.tv_sec == seen.st_mtim.tv_sec &&
              s.st_mtim.tv_nsec == seen.st_mtim.tv_nsec;
  uint64_t h = hash;
  pthread_mutex_unlock(&lock);
  if (!same) {
    XXH3_state_t *x = XXH3_createState();
    if (!x)
      return -ENOMEM;
    XXH3_64bits_reset(x);
    char buf[65536];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0)
      XXH3_64bits_update(x, buf, (size_t)n);
    h = XXH3_64bits_digest(x);
    XXH3_freeState(x);
    if (n < 0) {
      int r = -errno;
      *ret_err = xasprintf("cannot read the agent %s: %s", path, strerror(errno));
      return r;
    }
    pthread_mutex_lock(&lock);
    seen = s;
    hash = h;
    known = true;
    pthread_mutex_unlock(&lock);
  }
  *ret = h;
  return 0;
}

/* What the rootfs tree is: the image build's stamp (image/build-rootfs-*.sh
 * write .ign-rootfs-stamp last, from their inputs), else the tree's own
 * directory and top-level entries (inode and mtime: a rebuilt or swapped
 * tree differs). */
static int ns_rootfs_id(const char *rootfs, uint64_t *ret, const char **ret_how,
                        char **ret_err) {
  _cleanup_free_ char *stamp = xasprintf("%s/.ign-rootfs-stamp", rootfs);
  _cleanup_close_ int fd = open(stamp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  char buf[4096];
  if (fd >= 0) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n > 0) {
      *ret = XXH3_64bits(buf, (size_t)n);
      *ret_how = "its build stamp";
      return 0;
    }
  }
  DIR *d = opendir(rootfs);
  struct stat s;
  if (!d || fstat(dirfd(d), &s) < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot read the rootfs %s: %s", rootfs, strerror(errno));
    if (d)
      closedir(d);
    return r;
  }
  XXH64_hash_t h = XXH3_64bits_withSeed(&s.st_ino, sizeof s.st_ino, (uint64_t)s.st_mtim.tv_sec);
  struct dirent *e;
  while ((e = readdir(d))) {
    struct stat es;
    if (fstatat(dirfd(d), e->d_name, &es, AT_SYMLINK_NOFOLLOW) < 0)
      continue;
    /* Order-independent: readdir's order is not the tree's identity. */
    uint64_t v[3] = {(uint64_t)es.st_ino, (uint64_t)es.st_mtim.tv_sec,
                     (uint64_t)es.st_mtim.tv_nsec};
    h ^= XXH3_64bits_withSeed(v, sizeof v, XXH3_64bits(e->d_name, strlen(e->d_name)));
  }
  closedir(d);
  *ret = h;
  *ret_how = "its top-level entries (no build stamp)";
  return 0;
}

int ns_inputs_id(char **ret_id, char **ret_text, char **ret_err) {
  if (!cfg.rootfs || !cfg.agent) {
    *ret_err = xasprintf("no %s: build it with `make images` (or point %s at one)",
                         !cfg.rootfs ? "rootfs" : "ign-agent",
                         !cfg.rootfs ? "IGN_MCP_ROOTFS" : "the server's install");
    return -ENOENT;
  }
  uint64_t agent, rootfs;
  const char *how;
  int r;
  if ((r = ns_agent_hash(cfg.agent, &agent, ret_err)) < 0 ||
      (r = ns_rootfs_id(cfg.rootfs, &rootfs, &how, ret_err)) < 0)
    return r;
  /* The id names contents, not paths: servers with other checkouts of the
   * same agent and rootfs share their stages. */
  char key[128];
  snprintf(key, sizeof key, NS_LAYER_VERSION " agent=%016llx rootfs=%016llx",
           (unsigned long long)agent, (unsigned long long)rootfs);
  *ret_id = xasprintf("b-%016llx", (unsigned long long)XXH3_64bits(key, strlen(key)));
  *ret_text = xasprintf("ns: %s (agent %s, content XXH3 %016llx; rootfs %s, by %s)", key,
                        cfg.agent, (unsigned long long)agent, cfg.rootfs, how);
  return 0;
}
