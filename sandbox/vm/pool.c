/* pool.c: clones restored and stopped, ready to hand out, and spare QEMUs
 * waiting for a restore; new clones of a base. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/config.h"
#include "common/fs.h"
#include "common/log.h"
#include "common/util.h"
#include "sandbox/vm/internal.h"

/* ---- the pool ---- */

static void push(struct vm **list, unsigned *n, struct vm *v) {
  v->next = *list;
  *list = v;
  (*n)++;
}

struct vm *vm_pop(struct vm **list, unsigned *n) {
  struct vm *v = *list;
  if (v) {
    *list = v->next;
    v->next = NULL;
    (*n)--;
  }
  return v;
}

/* Empties the pool (called with the lock, returns without it) and destroys
 * its VMs. */
void vm_drain_pool_locked(void) {
  struct vm *lists[2] = {vmb.ready, vmb.spares};
  struct vm *loader = steal_ptr(vmb.loader);
  vmb.ready = vmb.spares = NULL;
  vmb.n_ready = vmb.n_spares = 0;
  pthread_mutex_unlock(&vmb.lock);
  if (loader)
    vm_loader_free(loader);
  for (size_t i = 0; i < ARRAY_SIZE(lists); i++)
    for (struct vm *v = lists[i], *nx; v; v = nx) {
      nx = v->next;
      vm_free(v);
    }
}

/* A spare QEMU fits a base only if it maps that base's RAM file. */
static bool spare_fits(const struct vm *spare, const char *ram) {
  struct stat st;
  return strcmp(spare->ram, ram) == 0 && stat(ram, &st) == 0 && st.st_dev == spare->ram_dev &&
         st.st_ino == spare->ram_ino;
}

int vm_new_clone(const char *base, bool warm, struct vm **ret, char **ret_err) {
  struct vm *v = NULL;
  int r = 0;
  _cleanup_free_ char *base_dir = strdup(base);
  /* A missing file means the base is gone (set aside by another server, or
   * removed), not that every clone must fail: find or make it again.  (QEMU
   * would also create an empty RAM file, and the clone would hang.) */
  if (!vm_base_complete(base_dir)) {
    free(steal_ptr(base_dir));
    if ((r = vm_remake_base(base, &base_dir, ret_err)) < 0)
      return r;
  }
  pthread_mutex_lock(&vmb.lock);
  struct vm *spare = vm_pop(&vmb.spares, &vmb.n_spares);
  pthread_mutex_unlock(&vmb.lock);
  pthread_cond_broadcast(&vmb.cond);
  _cleanup_free_ char *ram = xasprintf("%s/ram", base_dir);
  if (spare && !spare_fits(spare, ram)) {
    vm_free(spare); /* started for an older base */
    spare = NULL;
  }
  if (spare) {
    v = spare;
  } else {
    r = vm_start(VM_CLONE, vmb.accel, ram, NULL, &v, NULL, ret_err);
    if (r < 0)
      return r;
  }
  if (warm) {
    pthread_mutex_lock(&vmb.lock);
    vmb.filling = v;
    if (vmb.stopping)
      sandbox_proc_kill(&v->proc);
    pthread_mutex_unlock(&vmb.lock);
  }
  r = vm_restore(v, base_dir, ret_err);
  if (r == 0 && warm) {
    /* Give it its identity and run it once, so TCG has translated the
     * agent's path, then stop it. */
    r = vm_new_identity(v, ret_err);
    if (r == 0)
      r = vm_fresh_entropy(v, ret_err);
    if (r == 0)
      r = qmp_command(v->qmp, "cont", NULL, QMP_TIMEOUT_MS, NULL, ret_err);
    if (r == 0)
      r = vm_warm_clone(v, RESTORE_TIMEOUT_MS, ret_err);
    if (r == 0)
      r = qmp_command(v->qmp, "stop", NULL, QMP_TIMEOUT_MS, NULL, ret_err);
    v->identity_set = r == 0;
  }
  if (warm) {
    pthread_mutex_lock(&vmb.lock);
    vmb.filling = NULL;
    pthread_mutex_unlock(&vmb.lock);
  }
  if (r < 0) {
    vm_add_log_tail(v, ret_err);
    vm_free(v);
    return r;
  }
  strcpy(v->path, "restore");
  *ret = v;
  return 0;
}

void vm_loader_free(struct vm *v) {
  if (v->ram)
    unlink(v->ram);
  vm_free(v);
}

struct vm *vm_take_loader(void) {
  pthread_mutex_lock(&vmb.lock);
  struct vm *v = steal_ptr(vmb.loader);
  vmb.want_loader = true;
  pthread_mutex_unlock(&vmb.lock);
  pthread_cond_broadcast(&vmb.cond);
  return v;
}

/* A loader started ahead of a snapshot: its RAM file is made in the store
 * (the same filesystem as the stages, so a snapshot renames it into its
 * directory), named after this server so that the next one removes it if
 * this one dies. */
static int new_loader(struct vm **ret, char **ret_err) {
  pthread_mutex_lock(&vmb.lock);
  unsigned n = ++vmb.loader_seq;
  pthread_mutex_unlock(&vmb.lock);
  _cleanup_free_ char *ram = xasprintf("%s/.loader-%d-%u.ram", cfg.store, getpid(), n);
  int fd = -1;
  int r = vm_stage_file_create(ram, (uint64_t)cfg.vm_memory_mb << 20, 0660, &fd, ret_err);
  if (r < 0)
    return r;
  close(fd);
  r = vm_start(VM_LOADER, vmb.accel, ram, NULL, ret, NULL, ret_err);
  if (r < 0)
    unlink(ram);
  return r;
}

/* The pool waits after a failure: until shutdown, a change in the pool, or
 * MS pass. */
static void pool_wait(uint64_t ms) {
  pthread_mutex_lock(&vmb.lock);
  if (!vmb.stopping) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, ms);
    pthread_cond_timedwait(&vmb.cond, &vmb.lock, &ts);
  }
  pthread_mutex_unlock(&vmb.lock);
}

/* Keeps the pool filled until shutdown; a VM it is making when shutdown
 * comes is destroyed before it returns. */
void *vm_pool_loop(void) {
  unsigned failures = 0;
  for (;;) {
    pthread_mutex_lock(&vmb.lock);
    while (!vmb.stopping && vmb.base_dir && vmb.n_ready >= cfg.pool &&
           vmb.n_spares >= cfg.spares && (vmb.loader || !vmb.want_loader))
      pthread_cond_wait(&vmb.cond, &vmb.lock);
    bool stopping = vmb.stopping;
    /* Copies: a call that finds the base gone may replace both meanwhile. */
    _cleanup_free_ char *base_dir = vmb.base_dir ? strdup(vmb.base_dir) : NULL;
    _cleanup_free_ char *base_fp = vmb.fingerprint ? strdup(vmb.fingerprint) : NULL;
    bool want_ready = vmb.n_ready < cfg.pool, want_spare = vmb.n_spares < cfg.spares;
    bool want_loader = !vmb.loader && vmb.want_loader;
    pthread_mutex_unlock(&vmb.lock);
    if (stopping || !base_dir)
      return NULL;

    /* Inputs changed under a running server (a rebuild), or the base went:
     * the base first.  A failure is retried only when due (vm_remake_base);
     * until then the pool waits, a few seconds at a time, for a change. */
    _cleanup_free_ char *fp = vm_fingerprint(vmb.accel);
    bool stale = !base_fp || strcmp(fp, base_fp) != 0;
    if (stale || !vm_base_complete(base_dir)) {
      if (stale) {
        pthread_mutex_lock(&vmb.lock);
        vm_drain_pool_locked();
      }
      _cleanup_free_ char *err = NULL;
      if (vm_remake_base(stale ? NULL : base_dir, NULL, &err) < 0)
        pool_wait(5000);
      continue;
    }

    _cleanup_free_ char *err = NULL;
    struct vm *v = NULL;
    int r;
    if (want_ready) {
      r = vm_new_clone(base_dir, true, &v, &err);
    } else if (want_spare) {
      _cleanup_free_ char *ram = xasprintf("%s/ram", base_dir);
      r = vm_start(VM_CLONE, vmb.accel, ram, NULL, &v, NULL, &err);
    } else if (want_loader) {
      r = new_loader(&v, &err);
    } else {
      continue;
    }
    if (r < 0) {
      pthread_mutex_lock(&vmb.lock);
      stopping = vmb.stopping;
      pthread_mutex_unlock(&vmb.lock);
      if (stopping)
        return NULL; /* killed by shutdown (vm_backend_shutdown) */
      log_warn("refilling the VM pool failed: %s", err);
      /* Do not spin on a persistent failure. */
      usleep(failures < 10 ? 200000u << (failures / 3) : 5000000u);
      failures++;
      continue;
    }
    failures = 0;
    pthread_mutex_lock(&vmb.lock);
    if (vmb.stopping) {
      pthread_mutex_unlock(&vmb.lock);
      if (!want_ready && !want_spare)
        vm_loader_free(v);
      else
        vm_free(v);
      return NULL;
    }
    if (want_ready)
      push(&vmb.ready, &vmb.n_ready, v);
    else if (!want_spare)
      vmb.loader = v;
    else
      push(&vmb.spares, &vmb.n_spares, v);
    pthread_mutex_unlock(&vmb.lock);
    pthread_cond_broadcast(&vmb.cond);
  }
}
