/* store.c: the warm bases in IGN_MCP_STORE, shared by every server that
 * uses it: the store lock, finding the base of the current inputs and
 * checking it on first use, putting a new one into place, setting a
 * damaged one aside and removing outdated ones once no server holds them,
 * making it again while sessions run (and when a failed try is due again),
 * and the fallback from KVM to TCG.  A base itself (fingerprint, making,
 * checksums) is base.c's. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
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
#include "sandbox/vm/internal.h"

/* ---- the store lock ---- */

/* One lock for the whole store, shared by every server that uses it: held
 * while a base is checked and set aside as damaged, and while a new base is
 * moved into place and taken into use, so that no server sets aside (or
 * removes as stale) a base another one has just made.  It is taken only
 * under ensure_base's mutex (one thread per server) and before any per-base
 * lock, which under it are only tried (LOCK_NB) or shared and never wait on
 * it: no deadlock.  A server that holds it for long (stopped, hung) is not
 * waited for without end: after STORE_LOCK_WAIT_MS (room for another server's
 * checksum of a large RAM file on a loaded host) this fails and says who to
 * look for.  Returns the fd, or a negative errno with *RET_ERR; never goes
 * on unlocked. */
#define STORE_LOCK_WAIT_MS 120000

/* The files servers flock (the store's .lock, a base's meta) are for the
 * server's uid alone: an flock needs only a read-only descriptor, so anyone
 * who may open one (another local user, an escaped QEMU of a root server,
 * whose group may enter a base) could hold it, and every server would wait
 * on it: a base's meta without end (hold_base, under the store lock), the
 * store's lock until STORE_LOCK_WAIT_MS fails every build.  A file made
 * before with wider rights is narrowed when it is the server's. */
static void lock_file_private(int fd) {
  struct stat st;
  if (fd >= 0 && fstat(fd, &st) == 0 && st.st_uid == geteuid() && (st.st_mode & 077))
    fchmod(fd, st.st_mode & 0700);
}

static int store_lock(char **ret_err) {
  _cleanup_free_ char *p = xasprintf("%s/.lock", cfg.store);
  int fd = open(p, O_RDONLY | O_CREAT | O_CLOEXEC, 0600);
  lock_file_private(fd);
  if (fd < 0 && (errno == EROFS || errno == EACCES))
    fd = open(p, O_RDONLY | O_CLOEXEC); /* a read-only store made before */
  if (fd < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot open the store's lock file %s: %s (IGN_MCP_STORE must be a "
                         "writable directory)",
                         p, strerror(errno));
    log_error("%s", *ret_err);
    return r;
  }
  uint64_t deadline = mono_ms() + STORE_LOCK_WAIT_MS;
  bool told = false;
  while (flock(fd, LOCK_EX | LOCK_NB) < 0) {
    int r = -errno;
    if (r == -EINTR)
      continue;
    pthread_mutex_lock(&vmb.lock);
    bool stopping = vmb.stopping;
    pthread_mutex_unlock(&vmb.lock);
    if (r != -EWOULDBLOCK || stopping || mono_ms() >= deadline) {
      *ret_err = r != -EWOULDBLOCK
                     ? xasprintf("cannot lock %s: %s", p, strerror(-r))
                 : stopping ? strdup("the server is shutting down")
                            : xasprintf("another process holds %s for more than %d s (see: "
                                        "fuser -v %s); stop it or wait, then open a session again",
                                        p, STORE_LOCK_WAIT_MS / 1000, p);
      if (r != -EWOULDBLOCK)
        log_error("%s", *ret_err);
      close(fd);
      return r != -EWOULDBLOCK ? r : -ETIMEDOUT;
    }
    if (!told)
      log_info("waiting for %s: another server is checking or installing a warm base", p);
    told = true;
    usleep(100000);
  }
  return fd;
}

/* ---- the current base ---- */

static int set_aside(const char *dir, char **ret_err);

/* Moves the base built in TMP into place at FINAL (under the store lock). */
static int install_base(const char *tmp, const char *final, char **ret_err) {
  if (rename(tmp, final) == 0)
    return 0;
  int r = -errno;
  /* Another server made the same base meanwhile: use theirs. */
  if (vm_base_complete(final)) {
    fs_remove_tree(tmp);
    return 0;
  }
  /* A base with files missing is in the way (it has a log, say): under the
   * store lock nobody is making it, so set it aside and try once more. */
  _cleanup_free_ char *aside_err = NULL;
  if ((r == -ENOTEMPTY || r == -EEXIST) && set_aside(final, &aside_err) == 0) {
    if (rename(tmp, final) == 0)
      return 0;
    r = -errno;
  }
  fs_remove_tree(tmp);
  *ret_err = xasprintf("cannot move the warm base into place at %s: %s%s%s (remove %s and open a "
                       "session again)",
                       final, strerror(-r), aside_err ? "; " : "", aside_err ? aside_err : "",
                       final);
  return r;
}

/* Removes other bases of the same name (made from older inputs); under the
 * store lock. */
static void remove_stale_bases(const char *keep) {
  DIR *d = opendir(cfg.store);
  if (!d)
    return;
  size_t n = strlen(cfg.base);
  struct dirent *e;
  while ((e = readdir(d))) {
    if (strncmp(e->d_name, cfg.base, n) != 0 || e->d_name[n] != '-')
      continue;
    _cleanup_free_ char *p = xasprintf("%s/%s", cfg.store, e->d_name);
    if (strcmp(p, keep) == 0)
      continue;
    /* Another server still clones from it: it holds a shared lock. */
    _cleanup_free_ char *meta = xasprintf("%s/meta", p);
    _cleanup_close_ int lfd = open(meta, O_RDONLY | O_CLOEXEC);
    if (lfd >= 0 && flock(lfd, LOCK_EX | LOCK_NB) < 0)
      continue;
    /* A .tmp of a live server is still being built. */
    char *tmp = strstr(e->d_name, ".tmp-");
    if (tmp && kill((pid_t)atoi(tmp + 5), 0) == 0)
      continue;
    log_info("removing the outdated warm base %s", p);
    fs_remove_tree(p);
  }
  closedir(d);
}

char *vm_base_path(const char *accel, bool *ret_complete) {
  _cleanup_free_ char *fp = vm_fingerprint(accel);
  char *dir = vm_base_dir_for(fp);
  *ret_complete = vm_base_complete(dir);
  return dir;
}

/* Marks DIR as in use by this server (see remove_stale_bases). */
static void hold_base(const char *dir) {
  _cleanup_free_ char *meta = xasprintf("%s/meta", dir);
  int fd = open(meta, O_RDONLY | O_CLOEXEC);
  lock_file_private(fd);
  if (fd >= 0 && flock(fd, LOCK_SH) < 0) {
    close(fd);
    fd = -1;
  }
  if (vmb.base_lock_fd >= 0)
    close(vmb.base_lock_fd);
  vmb.base_lock_fd = fd;
}

/* One build at a time (the pool thread and calls may all find the base stale
 * or gone); it also guards `checked` and is the only holder of the store
 * lock in this server. */
static pthread_mutex_t build_lock = PTHREAD_MUTEX_INITIALIZER;

static int ensure_base_locked(bool force, enum base_fault *ret_fault, char **ret_err);

/* Makes sure the base for the current inputs exists; sets vmb.base_dir.  On
 * failure *ret_fault says whose fault it is. */
static int ensure_base(bool force, enum base_fault *ret_fault, char **ret_err) {
  pthread_mutex_lock(&build_lock);
  int r = ensure_base_locked(force, ret_fault, ret_err);
  pthread_mutex_unlock(&build_lock);
  return r;
}

/* A damaged base is renamed out of the way (a server may still hold it:
 * remove_stale_bases removes it once none does).  When the rename fails
 * nothing is removed: the path may by then be a sound base that another
 * server has just made. */
static int set_aside(const char *dir, char **ret_err) {
  static unsigned n; /* under build_lock: a base set aside before may still be held */
  _cleanup_free_ char *aside = xasprintf("%s.damaged-%d-%u", dir, getpid(), n++);
  if (rename(dir, aside) < 0) {
    int r = -errno;
    *ret_err = xasprintf("it cannot be moved aside to %s: %s", aside, strerror(errno));
    return r;
  }
  _cleanup_free_ char *meta = xasprintf("%s/meta", aside);
  _cleanup_close_ int lfd = open(meta, O_RDONLY | O_CLOEXEC);
  if (lfd < 0 || flock(lfd, LOCK_EX | LOCK_NB) == 0)
    fs_remove_tree(aside);
  return 0;
}

/* The first use of a base by this server checks its files (see
 * vm_base_verify); a base it made itself or checked before is trusted. */
static char *checked; /* under build_lock */

/* 1 when the base in DIR can be used; 0 when it was damaged and is set
 * aside; a negative errno when it is damaged and cannot be set aside.  Under
 * the store lock. */
static int check_base(const char *dir, char **ret_err) {
  if (checked && strcmp(checked, dir) == 0)
    return 1;
  _cleanup_free_ char *why = NULL, *aside_err = NULL;
  uint64_t t0 = mono_ms();
  if (vm_base_verify(dir, &why) < 0) {
    int r = set_aside(dir, &aside_err);
    if (r < 0) {
      *ret_err = xasprintf("the warm base %s is damaged (%s) and %s; remove it by hand", dir, why,
                           aside_err);
      return r;
    }
    log_warn("the warm base %s is damaged: %s; making it again", dir, why);
    return 0;
  }
  log_info("warm base %s checked in %" PRIu64 " ms", dir, mono_ms() - t0);
  free(checked);
  checked = strdup(dir);
  return 1;
}

static int ensure_base_locked(bool force, enum base_fault *ret_fault, char **ret_err) {
  _cleanup_free_ char *fp = vm_fingerprint(vmb.accel);
  _cleanup_free_ char *dir = vm_base_dir_for(fp);
  *ret_fault = BASE_FAULT_STORE;
  int lock = store_lock(ret_err);
  if (lock < 0)
    return lock;
  int r = 0; /* 1: the base is there and sound */
  if (!force && vm_base_complete(dir)) {
    r = check_base(dir, ret_err);
  } else if (file_exists(dir)) {
    /* Forced, or with files missing (it would stay in the way of the new
     * one): set aside, not removed, as other servers may still clone from
     * it. */
    _cleanup_free_ char *why = NULL;
    r = set_aside(dir, &why);
    if (r < 0)
      *ret_err = xasprintf("the warm base %s is %s, and %s; remove it by hand and open a session "
                           "again",
                           dir, force ? "to be made again" : "incomplete", why);
    else if (!force)
      log_warn("the warm base %s has files missing; making it again", dir);
  }
  if (r > 0)
    hold_base(dir);
  closep(&lock);
  if (r < 0)
    return r;
  if (r == 0) {
    _cleanup_free_ char *tmp = NULL;
    if ((r = vm_base_build(vmb.accel, fp, &tmp, ret_fault, ret_err)) < 0)
      return r;
    lock = store_lock(ret_err);
    if (lock < 0) {
      fs_remove_tree(tmp);
      return lock;
    }
    r = install_base(tmp, dir, ret_err);
    if (r == 0) {
      hold_base(dir);
      remove_stale_bases(dir);
      free(checked);
      checked = strdup(dir);
    }
    closep(&lock);
    if (r < 0)
      return r;
  }
  pthread_mutex_lock(&vmb.lock);
  free(vmb.fingerprint);
  vmb.fingerprint = steal_ptr(fp);
  free(vmb.base_dir);
  vmb.base_dir = steal_ptr(dir);
  pthread_mutex_unlock(&vmb.lock);
  return 0;
}

/* ---- failed tries, making it again ---- */

/* Records a failed try (under vmb.lock). */
void vm_note_failure(enum base_fault fault, char *fingerprint) {
  free(vmb.failure.fingerprint);
  vmb.failure = (struct vm_base_failure){.at_ms = mono_ms(), .store_fault = fault == BASE_FAULT_STORE,
                                         .store_free = vm_store_free(), .fingerprint = fingerprint};
}

/* Why the last failed try is not followed by another one now, or NULL when
 * one is due (vm_base_retry_due); under vmb.lock. */
char *vm_retry_not_due(const char *fingerprint) {
  uint64_t now = mono_ms();
  if (vm_base_retry_due(&vmb.failure, now, vm_store_free(), fingerprint))
    return NULL;
  unsigned wait_s = (unsigned)((vmb.failure.at_ms + VM_BASE_RETRY_MS - now + 999) / 1000);
  return xasprintf(" (not tried again yet: nothing has changed since the last try, %u s ago; the "
                   "next open_session tries again once the VM images change%s, or after %u s)",
                   (unsigned)((now - vmb.failure.at_ms) / 1000),
                   vmb.failure.store_fault ? " or the store has more free space" : "", wait_s);
}

/* Makes the base again once sessions run: its inputs changed, or the base at
 * GONE lost its files under this server (another one set it aside as
 * damaged, or someone removed it).  By init's rules: a failure is recorded,
 * and until another try is due the pool and every call get that failure at
 * once instead of building again each.  *RET_DIR (when given): the base to
 * use now. */
int vm_remake_base(const char *gone, char **ret_dir, char **ret_err) {
  pthread_mutex_lock(&build_lock);
  char *fp = vm_fingerprint(vmb.accel);
  pthread_mutex_lock(&vmb.lock);
  /* Another thread (the pool, a call) has made it meanwhile. */
  bool current = vmb.base_dir && vmb.fingerprint && strcmp(vmb.fingerprint, fp) == 0 &&
                 vm_base_complete(vmb.base_dir);
  _cleanup_free_ char *not_yet = !current && vmb.base_error ? vm_retry_not_due(fp) : NULL;
  if (current && ret_dir)
    *ret_dir = strdup(vmb.base_dir);
  if (not_yet)
    *ret_err = xasprintf("%s%s", vmb.base_error, not_yet);
  pthread_mutex_unlock(&vmb.lock);
  if (current || not_yet) {
    pthread_mutex_unlock(&build_lock);
    free(fp);
    return current ? 0 : -EAGAIN;
  }
  if (gone)
    log_warn("the warm base %s is gone; checking or making it again", gone);
  else
    log_info("the VM images changed; making a new warm base");
  if (gone && checked && strcmp(checked, gone) == 0)
    free(steal_ptr(checked));
  enum base_fault fault;
  int r = ensure_base_locked(false, &fault, ret_err);
  pthread_mutex_lock(&vmb.lock);
  free(steal_ptr(vmb.base_error));
  if (r < 0) {
    vmb.base_error = strdup(*ret_err);
    vm_note_failure(fault, steal_ptr(fp));
  } else if (ret_dir) {
    *ret_dir = strdup(vmb.base_dir);
  }
  pthread_mutex_unlock(&vmb.lock);
  pthread_mutex_unlock(&build_lock);
  pthread_cond_broadcast(&vmb.cond);
  free(fp);
  if (r < 0)
    log_error("cannot make the warm base again: %s", *ret_err);
  return r;
}

/* ensure_base, and under KVM in auto mode a fallback to TCG when the guest
 * does not run under KVM.  Only when it then runs under TCG is KVM to blame
 * (MARK: record that in the store, for the servers that come after); a guest
 * that fails under both is broken itself, and KVM stays.  A failure of the
 * store's is only that: KVM stays too. */
int vm_ensure_base_any_accel(bool force, bool mark, enum base_fault *ret_fault,
                                 char **ret_err) {
  int r = ensure_base(force, ret_fault, ret_err);
  if (r < 0 && *ret_fault == BASE_FAULT_GUEST && strcmp(vmb.accel, "kvm") == 0 &&
      strcmp(cfg.accel, "auto") == 0) {
    log_warn("the guest does not run under KVM (%s); trying TCG", *ret_err);
    _cleanup_free_ char *kvm_err = steal_ptr(*ret_err);
    vm_set_accel("tcg");
    r = ensure_base(force, ret_fault, ret_err);
    if (r < 0) {
      char *both = xasprintf("under KVM: %s; under TCG too: %s", kvm_err, *ret_err);
      free(*ret_err);
      *ret_err = both;
      vm_set_accel("kvm");
    } else if (mark) {
      log_warn("KVM is present but the guest runs only under TCG; using TCG");
      _cleanup_free_ char *marker = xasprintf("%s/kvm-unusable", cfg.store);
      _cleanup_fclose_ FILE *f = fopen(marker, "we");
      if (f)
        fputs("the guest did not boot under KVM on this host (it did under TCG); delete this "
              "file to retry\n",
              f);
    }
  }
  return r;
}

bool vm_base_retry_due(const struct vm_base_failure *f, uint64_t now_ms, uint64_t store_free,
                       const char *fingerprint) {
  if (now_ms - f->at_ms >= VM_BASE_RETRY_MS)
    return true;
  if (!f->fingerprint || !fingerprint || strcmp(f->fingerprint, fingerprint) != 0)
    return true;
  return f->store_fault && store_free != UINT64_MAX && f->store_free != UINT64_MAX &&
         store_free >= f->store_free + (1u << 20);
}
