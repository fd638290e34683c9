/* vm.c: the microVM backend: one QEMU (-M microvm) per session, cloned
 * copy-on-write from a warm snapshot (docs/vm-recipe.md has the measured
 * recipe this follows).
 *
 * The warm base: a golden VM cold-boots with its RAM in a file (share=on),
 * the agent answers, python3 and gcc are run once to warm the page cache,
 * then QMP stop + migrate to an fd with x-ignore-shared writes a small device
 * state file.  The base lives in IGN_MCP_STORE under a name that carries a
 * fingerprint of everything it was made from (QEMU, kernel, initramfs with
 * the agent, rootfs image, memory size, accelerator, overlay size, network):
 * when any of them changes the fingerprint changes, and a new base is built
 * before the next clone.  A base's RAM file never changes once made.
 *
 * A clone: QEMU with the same devices, its RAM mapped from the base's file
 * with share=off (MAP_PRIVATE: writes stay private), -incoming defer, then
 * migrate-incoming from the state file.  The pool keeps IGN_MCP_POOL clones
 * restored, run once (so TCG has translated the agent's path) and stopped
 * (no CPU), plus IGN_MCP_SPARES QEMUs waiting for a restore.  Each pool
 * clone is given its identity as it is filled (a hostname, a machine id, and
 * entropy of its own with the CRNG reseeded), so no two are alike.  Handing
 * one out is a QMP cont; the session layer's HELLO, its first request, then
 * carries what must be fresh at that moment: the host's clock (the guest's
 * stood still in the pool) and more entropy (what the clone's RNG held was
 * fixed when it was filled), set by the agent before it answers, so before
 * anything the session runs.  A clone that has no identity yet (restored on
 * demand, from a stage, cold-booted) gets it in that same HELLO.  A clone is
 * taken off the pool list under its lock, so it is handed out once.
 *
 * KVM is used when /dev/kvm works; "works" is decided by booting the golden
 * VM under it (a host can open /dev/kvm and still fail to run guests), with
 * TCG as the fallback; only a guest that then boots under TCG makes the
 * server (and, through a marker in the store, the servers after it) give KVM
 * up: a failure of the store's (full, not writable), or a guest that fails
 * under both, says nothing about KVM.  A base that failed, at start or when
 * it is made again later (its inputs changed, or it went), is made again
 * only when something may have changed (the inputs, the store's free space,
 * or a minute passed): a guest that cannot boot is not cold-booted on every
 * open_session, nor by the pool in a loop. */
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
#include "sandbox/stage.h"
#include "sandbox/vm/internal.h"


struct vm_state vmb = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER, .base_lock_fd = -1,
       .uids = {.lock = PTHREAD_MUTEX_INITIALIZER}};

const char *vm_isolation(void) { return vmb.isolation[0] ? vmb.isolation : "microvm"; }

/* ---- initialisation ---- */

static int check_inputs(char **ret_err) {
  if (!cfg.qemu) {
    *ret_err = config_missing_why("IGN_MCP_QEMU", "qemu-system-x86_64", "an executable file");
    return -ENOENT;
  }
  const char *files[][2] = {{cfg.kernel, "the guest kernel (IGN_MCP_KERNEL)"},
                            {cfg.initramfs, "the initramfs (IGN_MCP_INITRAMFS)"},
                            {cfg.vm_image, "the rootfs image"}};
  for (size_t i = 0; i < ARRAY_SIZE(files); i++)
    if (!files[i][0] || !file_exists(files[i][0])) {
      *ret_err = xasprintf("%s %s is missing: build the VM images with `make vm-images` (or "
                           "scripts/setup.sh)",
                           files[i][1], files[i][0] ? files[i][0] : "(none for this rootfs)");
      return -ENOENT;
    }
  return 0;
}

static void *init_main(void *unused) {
  (void)unused;
  _cleanup_free_ char *err = NULL;
  int r = 0;
  enum base_fault fault = BASE_FAULT_STORE;
  bool cold_only = strcmp(cfg.base, "none") == 0;
  if (!cold_only)
    r = vm_ensure_base_any_accel(false, true, &fault, &err);
  char *fp = r < 0 ? vm_fingerprint(vmb.accel) : NULL;
  pthread_mutex_lock(&vmb.lock);
  vmb.init_done = true;
  if (r < 0) {
    vmb.init_error = steal_ptr(err);
    vm_note_failure(fault, fp);
  }
  pthread_cond_broadcast(&vmb.cond);
  /* What made the base fail (a full store, say) may be fixed later: an
   * open_session that finds the backend failed asks for another try when one
   * is due (vm_base_retry_due). */
  while (r < 0 && !cold_only) {
    while (!vmb.stopping && !vmb.retry)
      pthread_cond_wait(&vmb.cond, &vmb.lock);
    if (vmb.stopping)
      break;
    pthread_mutex_unlock(&vmb.lock);
    log_info("trying again to make the warm base");
    r = vm_ensure_base_any_accel(false, true, &fault, &err);
    fp = r < 0 ? vm_fingerprint(vmb.accel) : NULL;
    pthread_mutex_lock(&vmb.lock);
    vmb.retry = false;
    vmb.attempts++;
    free(vmb.init_error);
    vmb.init_error = r < 0 ? steal_ptr(err) : NULL;
    if (r < 0)
      vm_note_failure(fault, fp);
    pthread_cond_broadcast(&vmb.cond);
  }
  pthread_mutex_unlock(&vmb.lock);
  pthread_cond_broadcast(&vmb.cond);
  if (r == 0 && !cold_only)
    vm_pool_loop();
  pthread_mutex_lock(&vmb.lock);
  vmb.pool_running = false;
  pthread_mutex_unlock(&vmb.lock);
  pthread_cond_broadcast(&vmb.cond);
  return NULL;
}

static int pick_accel(char **ret_err) {
  _cleanup_free_ char *why = NULL, *fix = NULL;
  const char *accel = vm_probe_accel(&why, &fix);
  if (!accel) {
    *ret_err = xasprintf("IGN_MCP_ACCEL=kvm but KVM cannot be used here: %s%s%s", why,
                         fix ? "; fix: " : "", fix ? fix : "");
    return -ENODEV;
  }
  /* What was decided and why, for whoever reads the log later. */
  _cleanup_free_ char *probe = vm_kvm_probe_text();
  if (strcmp(accel, "kvm") == 0)
    log_info("accelerator: kvm (%s)", probe ? probe : "/dev/kvm works");
  else
    log_info("accelerator: tcg (not KVM: %s)", why);
  vmb.accel = accel;
  snprintf(vmb.isolation, sizeof vmb.isolation, "microvm/%s", vmb.accel);
  struct group *g = getgrnam("kvm");
  vmb.kvm_gid = g ? g->gr_gid : 0;
  return 0;
}

/* The directory of the per-VM state directories: /run/ignition-mcp as root;
 * as a user $XDG_RUNTIME_DIR/ignition-mcp when that directory is there and
 * the user's, else /tmp/ignition-mcp-UID.  A user's must be a directory of
 * the user's own that nobody else may write to: in /tmp another user may
 * have made it (or a symlink) first. */
static int make_run_dir(char **ret_err) {
  const char *xdg = getenv("XDG_RUNTIME_DIR");
  struct stat st;
  bool xdg_ok = xdg && xdg[0] == '/' && stat(xdg, &st) == 0 && S_ISDIR(st.st_mode) &&
                st.st_uid == getuid();
  free(vmb.run_dir);
  vmb.run_dir = getuid() == 0 ? strdup("/run/ignition-mcp")
                : xdg_ok      ? xasprintf("%s/ignition-mcp", xdg)
                              : xasprintf("/tmp/ignition-mcp-%u", getuid());
  int r = fs_mkdir_p(vmb.run_dir, 0755, 0711);
  if (r < 0) {
    *ret_err = xasprintf("cannot create %s: %s", vmb.run_dir, strerror(-r));
    return r;
  }
  if (getuid() != 0 && (lstat(vmb.run_dir, &st) < 0 || !S_ISDIR(st.st_mode) ||
                        st.st_uid != getuid() || (st.st_mode & 0022))) {
    *ret_err = xasprintf("%s, where the QEMUs' state directories go, is not a directory of this "
                         "user's that only it may write to (another user may have made it): "
                         "remove it, or set XDG_RUNTIME_DIR to a directory of your own",
                         vmb.run_dir);
    return -EPERM;
  }
  return 0;
}

/* MAKE_STORE: create the store when it is not there (not for doctor's
 * trial session, which only reads a base that is there). */
static int prepare_store(bool make_store, char **ret_err) {
  int r = check_inputs(ret_err);
  if (r < 0)
    return r;
  /* The golden VM writes its RAM file in the store by path. */
  if ((r = vm_check_reachable(cfg.store, "the store (IGN_MCP_STORE)", ret_err)) < 0)
    return r;
  if (make_store && (r = fs_mkdir_p(cfg.store, 0755, 0755)) < 0) {
    *ret_err = xasprintf("cannot create the store %s: %s (set IGN_MCP_STORE)", cfg.store,
                         strerror(-r));
    return r;
  }
  if ((r = pick_accel(ret_err)) < 0)
    return r;
  vmb.tsc_khz = vm_host_tsc_khz();
  if ((r = make_run_dir(ret_err)) < 0)
    return r;
  /* State directories of servers that died without cleaning up. */
  DIR *d = opendir(vmb.run_dir);
  struct dirent *e;
  while (d && (e = readdir(d))) {
    int pid = atoi(e->d_name);
    if (pid > 0 && pid != getpid() && kill(pid, 0) < 0 && errno == ESRCH) {
      _cleanup_free_ char *p = xasprintf("%s/%s", vmb.run_dir, e->d_name);
      fs_remove_tree(p);
    }
  }
  if (d)
    closedir(d);
  /* Loaders' RAM files of servers that died (.loader-PID-N.ram). */
  d = make_store ? opendir(cfg.store) : NULL;
  while (d && (e = readdir(d))) {
    int pid = strncmp(e->d_name, ".loader-", 8) == 0 ? atoi(e->d_name + 8) : 0;
    if (pid > 0 && pid != getpid() && kill(pid, 0) < 0 && errno == ESRCH) {
      _cleanup_free_ char *p = xasprintf("%s/%s", cfg.store, e->d_name);
      unlink(p);
    }
  }
  if (d)
    closedir(d);
  return 0;
}

static int prepare(char **ret_err) { return prepare_store(true, ret_err); }

int vm_backend_init(char **ret_err) {
  int r = prepare(ret_err);
  if (r < 0)
    return r;
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  vmb.pool_running = true; /* cleared by the thread when it ends */
  r = pthread_create(&t, &attr, init_main, NULL);
  pthread_attr_destroy(&attr);
  if (r != 0) {
    vmb.pool_running = false;
    *ret_err = strdup("cannot start the VM pool thread");
    return -r;
  }
  log_info("vm backend: %s, QEMU %s, store %s, base %s, pool %u", vm_isolation(), cfg.qemu,
           cfg.store, cfg.base, cfg.pool);
  return 0;
}

int vm_make_base(bool force, char **ret_err) {
  int r = prepare(ret_err);
  if (r < 0)
    return r;
  enum base_fault fault;
  r = vm_ensure_base_any_accel(force, false, &fault, ret_err);
  if (r == 0)
    printf("warm base ready: %s (%s)\n", vmb.base_dir, vmb.accel);
  return r;
}

/* What `doctor` asks before it says the backend is ready: a QEMU started
 * the way a session's is (same confinement, same accelerator), restored
 * from the warm base when there is one and cold-booted when not, whose
 * agent answers HELLO and runs a command.  Nothing is left behind. */
int vm_trial_session(char **ret_how, char **ret_base_err, char **ret_err) {
  int r = prepare_store(false, ret_err);
  if (r < 0)
    return r;
  uint64_t t0 = mono_ms();
  bool complete = false;
  _cleanup_free_ char *base = strcmp(cfg.base, "none") == 0 ? NULL : vm_base_path(vmb.accel, &complete);
  _cleanup_free_ char *ram = complete ? xasprintf("%s/ram", base) : NULL;
  struct vm *v = NULL;
  const char *how = complete ? "restored from the warm base" : "cold-booted (no warm base yet)";
  _cleanup_free_ char *restore_err = NULL;
  if (complete) {
    r = vm_start(VM_CLONE, vmb.accel, ram, NULL, &v, NULL, ret_err);
    if (r == 0)
      r = vm_restore(v, base, ret_err);
    if (r == 0)
      r = qmp_command(v->qmp, "cont", NULL, QMP_TIMEOUT_MS, NULL, ret_err);
    if (r < 0 && v) {
      vm_add_log_tail(v, ret_err);
      vm_free(v);
      v = NULL;
    }
    if (r < 0) {
      /* A session would check the base and make it again: what must work
       * then is a boot, tried next. */
      restore_err = xasprintf("the warm base %s did not restore (%s), so sessions would make it "
                              "again first",
                              base, *ret_err);
      free(steal_ptr(*ret_err));
      complete = false;
      how = "cold-booted";
    }
  }
  if (!complete) {
    r = vm_start(VM_COLD, vmb.accel, NULL, NULL, &v, NULL, ret_err);
    if (r < 0)
      return r;
  }
  struct agent_conn *conn = NULL;
  uint32_t timeout = complete ? RESTORE_TIMEOUT_MS
                     : strcmp(vmb.accel, "kvm") == 0 ? KVM_BOOT_TIMEOUT_MS
                                                     : COLD_BOOT_TIMEOUT_MS;
  r = agent_conn_open(v->agent_fd, timeout, &conn, ret_err);
  v->agent_fd = -1; /* the connection owns it now */
  struct agent_exec_res res = {0};
  if (r == 0) {
    struct agent_exec_req req = {.command = "echo ready", .timeout_ms = 10000, .out_cap = 64};
    r = agent_exec(conn, &req, NULL, &res, ret_err);
    if (r == 0 && (res.exit_code != 0 || res.out_len != 6 || memcmp(res.out, "ready\n", 6) != 0)) {
      *ret_err = xasprintf("the agent ran `echo ready` but it exited %d with %zu bytes of output",
                           res.exit_code, res.out_len);
      r = -EPROTO;
    }
    agent_exec_res_free(&res);
  }
  if (r < 0) {
    char *m = xasprintf("the guest's agent did not answer: %s", *ret_err);
    free(*ret_err);
    *ret_err = m;
    vm_add_log_tail(v, ret_err);
  }
  agent_conn_free(conn);
  vm_free(v);
  if (r == 0) {
    *ret_how = xasprintf("%s, under %s, in %" PRIu64 " ms", how, vmb.accel, mono_ms() - t0);
    *ret_base_err = steal_ptr(restore_err);
  }
  return r;
}

void vm_backend_shutdown(void) {
  pthread_mutex_lock(&vmb.lock);
  vmb.stopping = true;
  pthread_cond_broadcast(&vmb.cond);
  /* A clone being filled ends now (its QEMU killed: every wait on it fails
   * at once), not after its fill's own deadlines. */
  if (vmb.filling)
    sandbox_proc_kill(&vmb.filling->proc);
  /* Let the pool thread finish (and destroy) the VM it may be making. */
  uint64_t deadline = mono_ms() + 5000;
  while (vmb.pool_running && mono_ms() < deadline) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, 20);
    pthread_cond_timedwait(&vmb.cond, &vmb.lock, &ts);
  }
  vm_drain_pool_locked();
}

/* ---- sandbox ops ---- */

/* Waits until the backend can start sessions (the warm base is there, or a
 * failed one was tried again when due); 0, or a negative errno with
 * *ret_err. */
static int wait_ready(char **ret_err) {
  pthread_mutex_lock(&vmb.lock);
  uint64_t deadline = mono_ms() + BASE_WAIT_MS;
  /* Shutdown ends the wait: the server answers this call and exits without
   * waiting for a base that may take minutes. */
  while (!vmb.init_done && !vmb.stopping && mono_ms() < deadline) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, 1000);
    pthread_cond_timedwait(&vmb.cond, &vmb.lock, &ts);
  }
  _cleanup_free_ char *not_yet = NULL;
  if (vmb.init_done && vmb.init_error && !vmb.stopping) {
    _cleanup_free_ char *fp = vm_fingerprint(vmb.accel);
    not_yet = vm_retry_not_due(fp);
  }
  if (vmb.init_done && vmb.init_error && !vmb.stopping && !not_yet) {
    unsigned attempt = vmb.attempts;
    vmb.retry = true;
    pthread_cond_broadcast(&vmb.cond);
    while (vmb.attempts == attempt && !vmb.stopping && mono_ms() < deadline) {
      struct timespec ts = timespec_in(CLOCK_REALTIME, 1000);
      pthread_cond_timedwait(&vmb.cond, &vmb.lock, &ts);
    }
  }
  if (vmb.stopping) {
    /* No QEMU is started once the pool is drained for shutdown. */
    pthread_mutex_unlock(&vmb.lock);
    *ret_err = strdup("the server is shutting down");
    return -ESHUTDOWN;
  }
  if (!vmb.init_done || vmb.init_error) {
    *ret_err = vmb.init_error ? xasprintf("the microVM backend cannot start sessions: %s%s",
                                          vmb.init_error, not_yet ? not_yet : "")
                              : strdup("the warm base is still being made; try again shortly");
    pthread_mutex_unlock(&vmb.lock);
    return -EAGAIN;
  }
  pthread_mutex_unlock(&vmb.lock);
  return 0;
}

/* A clone restored from stage ST (its ram and state are a base of their
 * own): never a pool clone or a spare of the warm base.  Its files are
 * opened relative to the directory checked when the stage was opened
 * (stage_open_file), never by the stage's name, which another server's
 * commit with replace may give to a different stage at any time: QEMU is
 * handed the RAM file through /proc/self/fd (vm_spawn binds what that
 * names and checks that it bound that file). */
static int clone_from_stage(const struct stage *st, struct vm **ret, char **ret_err) {
  _cleanup_close_ int ram_fd = -1, state_fd = -1;
  int r = stage_open_file(st, "ram", O_PATH, &ram_fd, ret_err);
  if (r == 0)
    r = stage_open_file(st, "state", O_RDONLY | O_NONBLOCK, &state_fd, ret_err);
  if (r == 0)
    r = vm_stage_files_check(st, (int[]){ram_fd, state_fd}, ret_err);
  if (r < 0)
    return r;
  char ram[64];
  snprintf(ram, sizeof ram, "/proc/self/fd/%d", ram_fd);
  struct vm *v = NULL;
  r = vm_start(VM_CLONE, vmb.accel, ram, NULL, &v, NULL, ret_err);
  if (r < 0)
    return r;
  r = vm_restore_fd(v, steal_fd(state_fd), ret_err);
  if (r < 0) {
    char *m = xasprintf("restoring from the stage %s failed: %s", st->name ? st->name : "(a fork's)",
                        *ret_err);
    free(*ret_err);
    *ret_err = m;
    vm_add_log_tail(v, ret_err);
    vm_free(v);
    return r;
  }
  strcpy(v->path, "stage");
  *ret = v;
  return 0;
}

/* A clone of the warm base: from the pool when it has one, else restored
 * now; or a cold boot with IGN_MCP_BASE=none. */
static int clone_from_base(struct vm **ret, char **ret_err) {
  pthread_mutex_lock(&vmb.lock);
  struct vm *v = vm_pop(&vmb.ready, &vmb.n_ready);
  _cleanup_free_ char *base_dir = vmb.base_dir ? strdup(vmb.base_dir) : NULL;
  pthread_mutex_unlock(&vmb.lock);
  pthread_cond_broadcast(&vmb.cond);

  int r = 0;
  if (v) {
    strcpy(v->path, "pool");
  } else if (base_dir) {
    /* A clone must never start from a base whose inputs changed: the guest's
     * page cache in the RAM file describes the old disk image. */
    _cleanup_free_ char *fp = vm_fingerprint(vmb.accel);
    pthread_mutex_lock(&vmb.lock);
    bool stale = strcmp(fp, vmb.fingerprint) != 0;
    pthread_mutex_unlock(&vmb.lock);
    if (stale) {
      free(steal_ptr(base_dir));
      if ((r = vm_remake_base(NULL, &base_dir, ret_err)) < 0)
        return r;
    }
    r = vm_new_clone(base_dir, false, &v, ret_err);
    if (r < 0)
      return r;
  } else {
    /* IGN_MCP_BASE=none: boot from scratch every time. */
    r = vm_start(VM_COLD, vmb.accel, NULL, NULL, &v, NULL, ret_err);
    if (r < 0)
      return r;
    strcpy(v->path, "cold");
  }
  *ret = v;
  return 0;
}

static int vm_create(const struct sandbox_config *sc, const char *session_id,
                     struct sandbox **ret, char **ret_err) {
  (void)session_id;
  int r = wait_ready(ret_err);
  if (r < 0)
    return r;
  struct vm *v = NULL;
  r = sc->stage ? clone_from_stage(sc->stage, &v, ret_err) : clone_from_base(&v, ret_err);
  if (r < 0)
    return r;
  if (sc->keep_identity)
    v->identity_set = true;
  if (!v->identity_set)
    r = vm_new_identity(v, ret_err);
  if (r == 0)
    r = vm_fresh_entropy(v, ret_err);
  if (r == 0 && strcmp(v->path, "cold") != 0) {
    uint64_t tc = mono_us();
    r = qmp_command(v->qmp, "cont", NULL, QMP_TIMEOUT_MS, NULL, ret_err);
    v->t_cont_us = mono_us() - tc;
  }
  /* A pool clone's connection is open: the clock and the entropy go ahead
   * of the session's first request, unanswered (the agent refuses that
   * request if they failed). */
  if (r == 0 && v->base.conn) {
    struct agent_setup_req now = {
        .entropy = v->entropy, .entropy_len = sizeof v->entropy, .clock = true};
    r = agent_setup_send(v->base.conn, &now, ret_err);
    explicit_bzero(v->entropy, sizeof v->entropy);
  }
  if (r < 0) {
    vm_free(v);
    return r;
  }
  /* Else the clock, the entropy and (unless it has one) the identity ride
   * in the HELLO of the connection the session layer opens. */
  if (!v->base.conn)
    v->base.hello = (struct agent_setup_req){
        .entropy = v->entropy,
        .entropy_len = sizeof v->entropy,
        .clock = true,
        .hostname = v->identity_set ? NULL : v->hostname,
        .machine_id = v->identity_set ? NULL : v->machine_id,
    };
  v->base.ops = &sandbox_vm_ops;
  /* What it was made from: a stage records this, not the inputs of later. */
  if (sc->stage && sc->stage->inputs_id) {
    snprintf(v->base.inputs_id, sizeof v->base.inputs_id, "%s", sc->stage->inputs_id);
  } else {
    pthread_mutex_lock(&vmb.lock);
    _cleanup_free_ char *fp = vmb.fingerprint ? strdup(vmb.fingerprint) : vm_fingerprint(vmb.accel);
    pthread_mutex_unlock(&vmb.lock);
    snprintf(v->base.inputs_id, sizeof v->base.inputs_id, "b-%016" PRIx64,
             vm_fingerprint_hash(fp));
  }
  v->base.isolation = vm_isolation();
  v->base.fd = steal_fd(v->agent_fd);
  snprintf(v->base.limits, sizeof v->base.limits, "memory %u MiB (guest RAM), overlay %u MiB%s",
           cfg.vm_memory_mb, vm_guest_overlay_mb(),
           vm_guest_overlay_mb() < cfg.overlay_mb ? " (at most half the guest RAM)" : "");
  if (strcmp(v->path, "pool") == 0)
    v->t_spawn_us = v->t_restore_us = 0; /* done before the call, not during it */
  v->t_created_us = mono_us();
  *ret = &v->base;
  return 0;
}

int vm_new_identity(struct vm *v, char **ret_err) {
  uint8_t idb[16];
  if (getrandom(idb, sizeof idb, 0) != sizeof idb) {
    *ret_err = xasprintf("cannot make the guest's machine id: getrandom failed: %s",
                         strerror(errno));
    return -EIO;
  }
  for (size_t i = 0; i < sizeof idb; i++)
    snprintf(v->machine_id + 2 * i, 3, "%02x", idb[i]);
  snprintf(v->hostname, sizeof v->hostname, "ign-%s", v->dir ? strrchr(v->dir, '/') + 1 : "vm");
  return 0;
}

int vm_fresh_entropy(struct vm *v, char **ret_err) {
  if (getrandom(v->entropy, sizeof v->entropy, 0) != sizeof v->entropy) {
    *ret_err = xasprintf("cannot draw entropy for the guest: getrandom failed: %s",
                         strerror(errno));
    return -EIO;
  }
  return 0;
}

/* The agent has answered the HELLO that set the clock, the entropy and (for
 * a clone without one) the identity. */
static int vm_ready(struct sandbox *sb, struct agent_conn *conn, char **ret_err) {
  (void)conn;
  (void)ret_err;
  struct vm *v = (struct vm *)sb;
  explicit_bzero(v->entropy, sizeof v->entropy);
  v->identity_set = true;
  json_t *info = json_pack("{s:s, s:s, s:{s:f, s:f, s:f, s:f}}", "path", v->path, "accel",
                           vmb.accel, "phases_ms", "spawn", v->t_spawn_us / 1000.0, "restore",
                           v->t_restore_us / 1000.0, "cont", v->t_cont_us / 1000.0, "hello",
                           (mono_us() - v->t_created_us) / 1000.0);
  /* The guest's serial console: QEMU writes it, bounded by RLIMIT_FSIZE. */
  if (info && v->dir)
    json_object_set_new(info, "serial_log_path", json_sprintf("%s/qemu.log", v->dir));
  sb->info = info;
  return 0;
}

static void vm_kill(struct sandbox *sb) { sandbox_proc_kill(&((struct vm *)sb)->proc); }

static void vm_destroy(struct sandbox *sb) { vm_free((struct vm *)sb); }



static char *vm_death_reason(struct sandbox *sb) {
  struct vm *v = (struct vm *)sb;
  /* A guest that panicked makes QEMU exit (reboot=t, -no-reboot) a moment
   * after its channel closes: give it that moment, so the reason is known.
   * Calls that fail together ask together; with a hung QEMU, later calls
   * do not each wait again, only look once more (sandbox_proc_wait). */
  int status = 0;
  bool reaped = sandbox_proc_wait(&v->proc, 500, &status);
  _cleanup_free_ char *panic = vm_log_panic(v);
  if (panic)
    return xasprintf("the guest kernel panicked (%s) and its QEMU %s", panic,
                     reaped ? "exited" : "stopped answering");
  _cleanup_free_ char *tail = vm_log_tail(v);
  const char *how = !reaped ? "its QEMU stopped answering"
                    : WIFSIGNALED(status) ? "its QEMU was killed"
                                          : "its QEMU exited";
  if (reaped && WIFSIGNALED(status))
    return xasprintf("%s by signal %d%s%s", how, WTERMSIG(status), tail ? "; log: " : "",
                     tail ? tail : "");
  return xasprintf("%s%s%s", how, tail ? "; log: " : "", tail ? tail : "");
}

/* A stage is made over the same inputs as the warm base: its id is the
 * base's (the hash of the fingerprint, accelerator included). */
static int vm_inputs_id(char **ret_id, char **ret_text, char **ret_err) {
  int r = wait_ready(ret_err);
  if (r < 0)
    return r;
  char *fp = vm_fingerprint(vmb.accel);
  *ret_id = xasprintf("b-%016" PRIx64, vm_fingerprint_hash(fp));
  *ret_text = fp;
  return 0;
}

/* The loader and the files of a snapshot being made. */
struct snap {
  struct vm *loader;
  int ram_fd, state_fd;
};

static void snap_fini(struct snap *s) {
  if (s->loader)
    vm_free(s->loader);
  closep(&s->ram_fd);
  closep(&s->state_fd);
}

/* Ends *ERR with what the loader's QEMU said, and says what failed. */
static void snap_error(struct snap *s, const char *step, char **ret_err) {
  char *m = xasprintf("saving the session's VM failed while %s: %s (the session keeps running; "
                      "try again, or close sessions if the host is short of memory)",
                      step, *ret_err ? *ret_err : "unknown error");
  free(*ret_err);
  *ret_err = m;
  if (s->loader)
    vm_add_log_tail(s->loader, ret_err);
}

/* Whether the loader the pool kept waiting is still there to receive a
 * stream: its QEMU may have died meanwhile (killed, out of memory), and a
 * dead one would fail the snapshot for nothing. */
static bool loader_answers(struct vm *v) {
  int status;
  if (sandbox_proc_wait(&v->proc, 0, &status))
    return false;
  _cleanup_free_ char *err = NULL;
  return qmp_command(v->qmp, "query-status", NULL, LOADER_CHECK_MS, NULL, &err) == 0;
}

/* The error of a snapshot that failed: a broken channel means the session
 * is dead only when its own QEMU is (the session layer then says so); one
 * to the loader, or to a source that still runs, is a failed snapshot. */
static int snap_result(struct vm *src, int r) {
  int status;
  bool broken = r == -EPIPE || r == -ECONNRESET;
  /* A QEMU whose channel just broke may take a moment to exit. */
  if (sandbox_proc_wait(&src->proc, broken ? 500 : 0, &status))
    return -EPIPE;
  return broken ? -EIO : r;
}

/* The snapshot of a running VM (docs/vm-recipe.md, "Live snapshot"): a
 * loader QEMU maps DIR/ram share=on and receives the source's live
 * migration (the whole RAM, x-ignore-shared off; on QEMU 10 and later the
 * source is stopped only for the last pages, on older ones for the whole
 * stream, and continued at once: SNAPSHOT_LIVE_QEMU); the loader then writes its
 * device state to DIR/state with x-ignore-shared on, and is killed; the
 * RAM file's zero pages become holes.  DIR/ram and DIR/state are then a base
 * of their own that clones restore from like the warm base. */
static int vm_snapshot(struct sandbox *sb, const char *dir, struct sandbox_snapshot *ret,
                       char **ret_err) {
  struct vm *src = (struct vm *)sb;
  struct snap s = {.ram_fd = -1, .state_fd = -1};
  uint64_t t0 = mono_us(), t_loader, t_stream, t_state, t_punch, paused_us = 0, punched = 0;
  _cleanup_free_ char *ram = xasprintf("%s/ram", dir);
  _cleanup_free_ char *state = xasprintf("%s/state", dir);
  const char *step = "making its RAM file";
  int r = 0;
  /* The loader the pool keeps waiting, its RAM file moved into DIR. */
  struct vm *pre = vm_take_loader();
  if (pre && !loader_answers(pre)) {
    log_warn("the waiting loader QEMU is gone (%s); starting another", pre->ram);
    vm_loader_free(steal_ptr(pre));
  }
  if (pre && rename(pre->ram, ram) == 0) {
    free(pre->ram);
    pre->ram = strdup(ram); /* DIR's now: the caller's to remove */
    s.loader = pre;
    s.ram_fd = open(ram, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (s.ram_fd < 0) {
      r = -errno;
      *ret_err = xasprintf("cannot open %s: %s", ram, strerror(errno));
    }
  } else if (pre) {
    log_warn("the waiting loader's RAM file %s cannot be moved into %s (%s); starting another",
             pre->ram, dir, strerror(errno));
    vm_loader_free(pre);
  }
  bool waited = s.loader != NULL;
  if (!s.loader && r == 0) {
    r = vm_stage_file_create(ram, (uint64_t)cfg.vm_memory_mb << 20, 0660, &s.ram_fd, ret_err);
    if (r == 0) {
      step = "starting the QEMU that receives it";
      r = vm_start(VM_LOADER, vmb.accel, ram, NULL, &s.loader, NULL, ret_err);
    }
  }
  t_loader = mono_us();
  if (r == 0) {
    step = "streaming its RAM";
    r = vm_migrate_live(src, s.loader, ret->final, &paused_us, ret_err);
  }
  t_stream = mono_us();
  if (r == 0) {
    step = "writing its device state";
    r = vm_stage_file_create(state, 0, 0640, &s.state_fd, ret_err);
  }
  if (r == 0)
    r = vm_save_state(s.loader, s.state_fd, ret_err);
  t_state = mono_us();
  if (r < 0) {
    snap_error(&s, step, ret_err);
    snap_fini(&s);
    return snap_result(src, r);
  }
  vm_free(steal_ptr(s.loader));
  r = vm_punch_zero_pages(s.ram_fd, &punched, ret_err);
  /* Written by the loader alone, read-only to the stage's sessions' QEMUs
   * from now on where they map it so (the group's write bit goes). */
  if (r == 0 && vm_qemu_ram_readonly() && fchmod(s.ram_fd, 0640) < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot make %s read-only: %s", ram, strerror(errno));
  }
  t_punch = mono_us();
  snap_fini(&s);
  if (r < 0) {
    snap_error(&s, "making its zero pages holes", ret_err);
    return r;
  }
  log_info("vm snapshot into %s: %.1f ms (%s loader %.1f, stream %.1f, state %.1f, holes %.1f: %" PRIu64
           " MiB), source paused %.2f ms",
           dir, (t_punch - t0) / 1000.0, waited ? "waiting" : "new", (t_loader - t0) / 1000.0, (t_stream - t_loader) / 1000.0,
           (t_state - t_stream) / 1000.0, (t_punch - t_state) / 1000.0, punched >> 20,
           paused_us / 1000.0);
  ret->carries = "memory";
  ret->paused_us = paused_us;
  return 0;
}

static int vm_unpause(struct sandbox *sb, char **ret_err) {
  return vm_cont_migrated((struct vm *)sb, ret_err);
}

const struct sandbox_ops sandbox_vm_ops = {
    .name = "vm",
    .create = vm_create,
    .ready = vm_ready,
    .kill = vm_kill,
    .destroy = vm_destroy,
    .death_reason = vm_death_reason,
    .inputs_id = vm_inputs_id,
    .snapshot = vm_snapshot,
    .unpause = vm_unpause,
};

