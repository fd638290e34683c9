/* qemu.c: one QEMU: its command line, its start (confined by spawn.c), a
 * restore from a snapshot's files, the run that warms a pool clone, its
 * log. */
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
#include "common/proc.h"
#include "common/util.h"
#include "proto/proto.h"
#include "sandbox/vm/internal.h"

unsigned vm_host_tsc_khz(void) {
  _cleanup_fclose_ FILE *f = fopen("/proc/cpuinfo", "re");
  char line[4096];
  double mhz = 0;
  while (f && fgets(line, sizeof line, f))
    if (strncmp(line, "cpu MHz", 7) == 0 && mhz == 0)
      sscanf(strchr(line, ':') + 1, "%lf", &mhz);
  if (mhz > 0)
    return (unsigned)(mhz * 1000 + 0.5);
  /* Calibrate rdtsc against the monotonic clock. */
  uint64_t t0 = now_ns(CLOCK_MONOTONIC_RAW), c0 = __builtin_ia32_rdtsc();
  usleep(50000);
  uint64_t t1 = now_ns(CLOCK_MONOTONIC_RAW), c1 = __builtin_ia32_rdtsc();
  return (unsigned)((c1 - c0) * 1000000ull / (t1 - t0));
}

unsigned vm_guest_overlay_mb(void) { return sandbox_overlay_mb(cfg.vm_memory_mb, cfg.overlay_mb); }

/* ---- one QEMU ---- */

static bool ram_readonly;

static void probe_ram_readonly(void) {
  char out[8192];
  int st = proc_run_capture((char *const[]){(char *)cfg.qemu, "-object", "memory-backend-file,help",
                                            NULL},
                            out, sizeof out, 10000);
  ram_readonly = st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0 && strstr(out, "\n  rom=");
  if (!ram_readonly)
    log_info("QEMU %s opens the warm base's and stages' RAM files read-write (mapped private: "
             "its guests never change them, but an escaped QEMU could): QEMU 8.2 or later maps "
             "them from a read-only file (on Debian 12: apt-get install -t bookworm-backports "
             "qemu-system-x86)",
             cfg.qemu);
}

bool vm_qemu_ram_readonly(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, probe_ram_readonly);
  return ram_readonly;
}

/* Appends the NULL-terminated list of arguments to ARGV. */
static void args_add(const char **argv, int *n, ...) {
  va_list ap;
  va_start(ap, n);
  for (const char *a; (a = va_arg(ap, const char *));)
    argv[(*n)++] = a;
  va_end(ap);
}

/* Ends *ERR with what QEMU last said, when it said anything. */
void vm_add_log_tail(struct vm *v, char **err) {
  _cleanup_free_ char *tail = vm_log_tail(v);
  if (!tail)
    return;
  char *m = xasprintf("%s; QEMU said: %s", *err, tail);
  free(*err);
  *err = m;
}

/* Under TCG the guest runs without address-space randomisation
 * (norandmaps): TCG reuses translated code only at the same virtual
 * addresses, so with randomisation every exec of a dynamically linked program
 * is translated anew (measured: /bin/true 20 ms instead of 4).  It is the
 * guest's own hardening, not part of the sandbox boundary.
 * A guest kernel that panics (its PID 1, the agent, died) reboots at once
 * (panic=-1) by a triple fault (reboot=t: a microvm has no keyboard
 * controller or ACPI to reboot through, and the other methods spin), and
 * -no-reboot turns that into QEMU exiting: the session is then seen dead
 * at once instead of hanging every call until its timeout.
 * Under TCG the TSC is trusted (tsc=reliable): the guest reads the host's
 * TSC, while its jiffies run late whenever the host is busy, and the
 * kernel's clocksource watchdog, comparing the two a second or so after a
 * clone starts, then marked the TSC unstable and fell back to
 * refined-jiffies.  The guest clock then moved in 4 ms steps, and two DNS
 * queries a resolver made in one step got the same ID (glibc takes it from
 * the clock): nslookup took the answer to its AAAA query for the one to
 * its A query and waited out its 5 s timeout on every name. */
static char *cmdline(const char *accel) {
  return xasprintf("console=ttyS0 quiet tsc_early_khz=%u nokaslr no_timer_check mitigations=off "
                   "i8042.noaux i8042.nokbd i8042.nopnp cryptomgr.notests panic=-1 reboot=t%s "
                   "ign.fstype=erofs ign.overlay_mb=%u",
                   vmb.tsc_khz, strcmp(accel, "tcg") == 0 ? " norandmaps tsc=reliable" : "", vm_guest_overlay_mb());
}

/* Starts a QEMU of KIND.  RAM_FILE is the base's RAM (golden: created).  On
 * failure *RET_EXITED (when given) tells whether QEMU itself ran and exited
 * (it refused the guest or the accelerator), as opposed to never starting
 * (no fork, no socket, no fds): only the former says anything about the
 * guest or KVM. */
int vm_start(enum vm_kind kind, const char *accel, const char *ram_file, const char *dir,
                    struct vm **ret, bool *ret_exited, char **ret_err) {
  if (ret_exited)
    *ret_exited = false;
  struct vm *v = calloc(1, sizeof *v);
  if (!v)
    return -ENOMEM;
  v->agent_fd = -1;
  sandbox_proc_init(&v->proc);
  pthread_mutex_init(&v->qmp_lock, NULL);
  v->ram = ram_file ? strdup(ram_file) : NULL;
  struct stat ram_st;
  if (ram_file && stat(ram_file, &ram_st) == 0) {
    v->ram_dev = ram_st.st_dev;
    v->ram_ino = ram_st.st_ino;
  }
  v->base.fd = -1;
  uint64_t t0 = mono_us();
  unsigned seq;
  pthread_mutex_lock(&vmb.lock);
  seq = ++vmb.seq;
  pthread_mutex_unlock(&vmb.lock);
  if (dir) {
    v->dir = strdup(dir);
  } else {
    v->dir = xasprintf("%s/%d-%u", vmb.run_dir, getpid(), seq);
    if (mkdir(v->dir, 0700) < 0) {
      *ret_err = xasprintf("cannot create the VM's state directory %s: %s", v->dir,
                           strerror(errno));
      free(v->dir);
      sandbox_proc_fini(&v->proc);
      free(v);
      return -EIO;
    }
  }

  bool kvm = strcmp(accel, "kvm") == 0;
  /* QEMU opens its inputs through bind mounts in its state directory (see
   * vm_spawn.c); only the golden VM creates its RAM file in place. */
  _cleanup_free_ char *k_path = xasprintf("%s/kernel", v->dir);
  _cleanup_free_ char *i_path = xasprintf("%s/initramfs", v->dir);
  _cleanup_free_ char *img_path = xasprintf("%s/image", v->dir);
  /* A clone and a loader map their RAM file through their state directory. */
  bool restores = kind == VM_CLONE || kind == VM_LOADER;
  _cleanup_free_ char *ram_path = restores   ? xasprintf("%s/ram", v->dir)
                                 : ram_file ? strdup(ram_file)
                                            : NULL;
  _cleanup_free_ char *machine =
      xasprintf("microvm,x-option-roms=off,isa-serial=on,rtc=on,pic=off,pit=off%s",
                kind == VM_COLD ? "" : ",memory-backend=mem");
  _cleanup_free_ char *accel_arg = kvm ? strdup("kvm") : xasprintf("tcg,tb-size=%d", TB_SIZE_MB);
  _cleanup_free_ char *mem = xasprintf("%uM", cfg.vm_memory_mb);
  /* A clone's RAM file (the warm base's or a stage's) is read-only to it
   * where QEMU can map a read-only file private and writable (8.2 and later:
   * readonly=on opens it O_RDONLY, rom=off keeps the guest's RAM writable):
   * bound read-only, with no Landlock right to write it.  Only the golden VM
   * and a loader write theirs (a file becoming a base or a stage). */
  bool ram_ro = kind == VM_CLONE && vm_qemu_ram_readonly();
  _cleanup_free_ char *backend =
      ram_path ? xasprintf("memory-backend-file,id=mem,size=%uM,mem-path=%s,share=%s%s",
                           cfg.vm_memory_mb, ram_path,
                           kind == VM_GOLDEN || kind == VM_LOADER ? "on" : "off",
                           ram_ro ? ",readonly=on,rom=off" : "")
               : NULL;
  _cleanup_free_ char *drive =
      xasprintf("file=%s,format=raw,if=none,readonly=on,id=root", img_path);
  _cleanup_free_ char *append = cmdline(accel);
  const char *argv[64];
  int n = 0;
  /* The firmware is qboot, named: it loads -kernel itself (x-option-roms=off).
   * Debian's QEMU 7.2 makes it microvm's default (bios-microvm.bin), but
   * QEMU 10 from bookworm-backports takes SeaBIOS's, which boots a kernel
   * only through an option ROM: with x-option-roms=off the guest never
   * printed a line. */
  args_add(argv, &n, "qemu-system-x86_64", "-M", machine, "-bios", "qboot.rom", "-accel",
           accel_arg, "-cpu", kvm ? "host" : "qemu64", "-smp", "1", "-m", mem, NULL);
  if (backend)
    args_add(argv, &n, "-object", backend, NULL);
  args_add(argv, &n, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
           "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
           /* QEMU's stdout and stderr are the VM's log file: the serial console goes there */
           "-serial", "stdio",
           "-chardev", "socket,id=qmp,fd=3,server=off", "-mon", "chardev=qmp,mode=control",
           "-drive", drive, "-device", "virtio-blk-device,drive=root",
           "-chardev", "socket,id=agent,fd=4,server=off",
           "-device", "virtio-serial-device,id=vser0",
           "-device", "virtserialport,chardev=agent,name=agent,bus=vser0.0",
           "-object", "rng-random,id=rng0,filename=/dev/urandom",
           "-device", "virtio-rng-device,rng=rng0", NULL);
  if (restores)
    args_add(argv, &n, "-incoming", "defer", NULL);
  else
    args_add(argv, &n, "-kernel", k_path, "-initrd", i_path, "-append", append, NULL);
  /* A loader must not run the guest it receives (it would be a second
   * copy of the source's guest): it only keeps its RAM. */
  if (kind == VM_LOADER)
    args_add(argv, &n, "-S", NULL);
  argv[n] = NULL;

  int qsv[2] = {-1, -1}, asv[2] = {-1, -1};
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, qsv) < 0 ||
      socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, asv) < 0) {
    int r = -errno;
    *ret_err = xasprintf("socketpair: %s", strerror(errno));
    closep(&qsv[0]);
    closep(&qsv[1]);
    fs_remove_tree(v->dir);
    free(v->dir);
    sandbox_proc_fini(&v->proc);
    free(v);
    return r;
  }
  struct vm_spawn_req req = {
      .qemu = cfg.qemu, .argv = (char *const *)argv, .dir = v->dir,
      .ram_file_writable = restores && !ram_ro ? ram_path : NULL,
      .makes_ram_file = kind == VM_GOLDEN,
      .needed = {cfg.qemu}, .hide = vmb.run_dir,
      .binds = {{cfg.vm_image, "image", false},
                {restores ? ram_file : cfg.kernel, restores ? "ram" : "kernel", restores && !ram_ro},
                {restores ? NULL : cfg.initramfs, "initramfs", false}},
      .qmp_fd = qsv[1], .agent_fd = asv[1],
      .gid = VM_GID, .kvm_gid = kvm ? vmb.kvm_gid : 0,
  };
  pid_t pid = 0;
  int r = 0;
  if (getuid() == 0 && (r = vm_uid_alloc(&vmb.uids, vm_uid_process_alive, &req.uid)) < 0)
    *ret_err = xasprintf("all %u QEMU uids (%u-%u) are in use by live QEMUs: close sessions or "
                         "lower IGN_MCP_MAX_SESSIONS and IGN_MCP_POOL",
                         VM_UID_SPAN, VM_UID_BASE, VM_UID_BASE + VM_UID_SPAN - 1);
  if (r == 0) {
    r = vm_spawn(&req, &pid, ret_err);
    if (r < 0)
      vm_uid_release(&vmb.uids, req.uid);
    else {
      vm_uid_started(&vmb.uids, req.uid, pid);
      v->uid = req.uid;
    }
  }
  close(qsv[1]);
  close(asv[1]);
  if (r < 0) {
    close(qsv[0]);
    close(asv[0]);
    fs_remove_tree(v->dir);
    free(v->dir);
    sandbox_proc_fini(&v->proc);
    free(v);
    return r;
  }
  sandbox_proc_set(&v->proc, pid);
  v->agent_fd = asv[0];
  r = qmp_open_fd(qsv[0], QMP_TIMEOUT_MS, &v->qmp, ret_err);
  /* A loader receives a stream with x-ignore-shared off (the whole RAM). */
  if (r == 0 && kind != VM_COLD && kind != VM_LOADER) {
    json_t *caps = json_pack("{s:[{s:s, s:b}]}", "capabilities", "capability", "x-ignore-shared",
                             "state", 1);
    r = qmp_command(v->qmp, "migrate-set-capabilities", caps, QMP_TIMEOUT_MS, NULL, ret_err);
  }
  v->t_spawn_us = mono_us() - t0;
  if (r < 0) {
    /* Let a dying QEMU finish its message and exit. */
    int status;
    if (sandbox_proc_wait(&v->proc, 500, &status) && ret_exited)
      *ret_exited = vm_qemu_ran(status);
    vm_add_log_tail(v, ret_err);
    vm_free(v);
    return r;
  }
  *ret = v;
  return 0;
}

/* Waits until V, loading an incoming migration, has it all (paused). */
static int wait_incoming(struct vm *v, uint32_t timeout_ms, char **ret_err) {
  uint64_t deadline = mono_ms() + timeout_ms;
  for (;;) {
    json_t *st = NULL;
    int r = qmp_command(v->qmp, "query-status", NULL, QMP_TIMEOUT_MS, &st, ret_err);
    if (r < 0) {
      char *m = xasprintf("loading the snapshot failed (QEMU: %s)", *ret_err);
      free(*ret_err);
      *ret_err = m;
      return r;
    }
    const char *s = json_string_value(json_object_get(st, "status"));
    bool waiting = s && strcmp(s, "inmigrate") == 0;
    bool ok = s && (strcmp(s, "paused") == 0 || strcmp(s, "prelaunch") == 0);
    _cleanup_free_ char *copy = s ? strdup(s) : NULL;
    json_decref(st);
    if (ok)
      return 0;
    if (!waiting) {
      *ret_err = xasprintf("after loading the snapshot, the VM is '%s' instead of paused",
                           copy ? copy : "?");
      return -EIO;
    }
    if (mono_ms() >= deadline) {
      *ret_err = xasprintf("loading the snapshot did not finish in %u ms", timeout_ms);
      return -ETIMEDOUT;
    }
    usleep(200);
  }
}

/* Loads a snapshot's state (BASE_DIR/state) into a clone waiting in
 * -incoming defer. */
int vm_restore(struct vm *v, const char *base_dir, char **ret_err) {
  _cleanup_free_ char *state = xasprintf("%s/state", base_dir);
  int fd = open(state, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int r = -errno;
    *ret_err = xasprintf("the snapshot's state file %s cannot be read: %s", state,
                         strerror(errno));
    return r;
  }
  return vm_restore_fd(v, fd, ret_err);
}

int vm_restore_fd(struct vm *v, int state_fd, char **ret_err) {
  uint64_t t0 = mono_us();
  _cleanup_close_ int fd = state_fd;
  int r = qmp_getfd(v->qmp, fd, "snap", QMP_TIMEOUT_MS, ret_err);
  if (r < 0)
    return r;
  r = qmp_command(v->qmp, "migrate-incoming", json_pack("{s:s}", "uri", "fd:snap"),
                  QMP_TIMEOUT_MS, NULL, ret_err);
  if (r == 0)
    r = wait_incoming(v, RESTORE_TIMEOUT_MS, ret_err);
  if (r < 0)
    return r;
  v->t_restore_us = mono_us() - t0;
  return 0;
}

/* Runs a clone once before it is stopped in the pool: its agent
 * connection is opened with a HELLO that sets its identity (hostname,
 * machine id, its own entropy with the CRNG reseeded, the clock), and a
 * `true` runs.  Each clone in the pool is then distinct, TCG has translated
 * the paths every session takes, and the connection is kept for the
 * session (v->base.conn): its hand-out sends only what must be fresh then,
 * the clock and more entropy, with no round trip (vm_create). */
int vm_warm_clone(struct vm *v, uint32_t timeout_ms, char **ret_err) {
  struct agent_setup_req req = {.entropy = v->entropy,
                                .entropy_len = sizeof v->entropy,
                                .clock = true,
                                .hostname = v->hostname,
                                .machine_id = v->machine_id};
  struct agent_conn *conn = NULL;
  _cleanup_free_ char *err = NULL;
  int r = agent_conn_open_setup(v->agent_fd, timeout_ms, &req, &conn, &err);
  v->agent_fd = -1; /* the connection's now, or closed */
  explicit_bzero(v->entropy, sizeof v->entropy);
  struct agent_exec_res res;
  if (r == 0) {
    struct agent_exec_req x = {.command = "true", .timeout_ms = timeout_ms, .out_cap = 64};
    r = agent_exec(conn, &x, NULL, &res, &err);
  }
  if (r < 0) {
    *ret_err = xasprintf("the clone's agent did not take its identity and run `true`: %s",
                         err ? err : strerror(-r));
    if (conn)
      agent_conn_free(conn);
    return r;
  }
  agent_exec_res_free(&res);
  v->base.conn = conn;
  return 0;
}

/* The VM's log, opened to read as root.  Its state directory belongs to
 * QEMU's uid, which can replace qemu.log with a link to a file only root may
 * read, with a hard link to one, or with a FIFO: the log is opened relative
 * to the directory by fs_open_one_name (no link followed, a regular file
 * with one name, QEMU's uid's), as the copy kept after the VM is
 * (runlog_keep_serial).  -1 otherwise. */
static int open_log(const struct vm *v) {
  if (!v->dir)
    return -1;
  _cleanup_close_ int dfd = open(v->dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0)
    return -1;
  /* A QEMU of a user's server runs as the user: its log is the server's. */
  uid_t owner = v->uid ? v->uid : geteuid();
  int fd = -1;
  _cleanup_free_ char *why = NULL;
  int r = fs_open_one_name(dfd, "qemu.log", owner, &fd, &why);
  if (r < 0 && r != -ENOENT) {
    log_warn("%s/qemu.log is not the log QEMU was given (%s): not reading it", v->dir, why);
    return -1;
  }
  return fd;
}

char *vm_log_tail(const struct vm *v) {
  _cleanup_close_ int fd = open_log(v);
  if (fd < 0)
    return NULL;
  char buf[600];
  off_t end = lseek(fd, 0, SEEK_END);
  off_t start = end > (off_t)sizeof buf - 1 ? end - (off_t)sizeof buf + 1 : 0;
  ssize_t n = pread(fd, buf, sizeof buf - 1, start);
  if (n <= 0)
    return NULL;
  buf[n] = '\0';
  for (char *p = buf; *p; p++)
    if ((unsigned char)*p < 0x20 || *p == 0x7f)
      *p = ' ';
  while (n > 0 && buf[n - 1] == ' ')
    buf[--n] = '\0';
  return strdup(buf + strspn(buf, " "));
}

bool vm_qemu_ran(int status) {
  if (WIFSIGNALED(status))
    return true;
  return WIFEXITED(status) && (WEXITSTATUS(status) < VM_SPAWN_EXIT_MIN ||
                               WEXITSTATUS(status) > VM_SPAWN_EXIT_MAX);
}

/* The QEMUs of a root server run as other uids: every directory above the
 * files they open must let others search it. */
int vm_check_reachable(const char *path, const char *what, char **ret_err) {
  if (getuid() != 0 || !path)
    return 0;
  _cleanup_free_ char *p = strdup(path);
  for (char *slash = strrchr(p, '/'); slash && slash != p; slash = strrchr(p, '/')) {
    *slash = '\0';
    struct stat st;
    if (stat(p, &st) == 0 && !(st.st_mode & S_IXOTH) && !(st.st_gid == VM_GID && (st.st_mode & S_IXGRP))) {
      *ret_err = xasprintf("%s %s is not reachable by the QEMU processes, which run as "
                           "unprivileged uids: %s is not searchable by others (chmod o+x %s, or "
                           "move it)",
                           what, path, p, p);
      return -EACCES;
    }
  }
  return 0;
}

/* The guest kernel's panic line in the VM's log ("Kernel panic - not
 * syncing: ..."), or NULL. */
char *vm_log_panic(const struct vm *v) {
  _cleanup_close_ int fd = open_log(v);
  if (fd < 0)
    return NULL;
  static const size_t size = 64 << 10;
  _cleanup_free_ char *buf = malloc(size + 1);
  off_t end = lseek(fd, 0, SEEK_END);
  off_t start = end > (off_t)size ? end - (off_t)size : 0;
  ssize_t n = buf ? pread(fd, buf, size, start) : -1;
  if (n <= 0)
    return NULL;
  buf[n] = '\0';
  for (ssize_t i = 0; i < n; i++)
    if (buf[i] == '\0')
      buf[i] = ' ';
  char *p = strstr(buf, "Kernel panic - ");
  if (!p)
    return NULL;
  p[strcspn(p, "\r\n")] = '\0';
  /* The guest wrote it: quoted to the client, but no terminal escape or
   * other control character with it (as vm_log_tail). */
  for (char *c = p; *c; c++)
    if ((unsigned char)*c < 0x20 || *c == 0x7f)
      *c = ' ';
  return strndup(p, 200);
}

void vm_free(struct vm *v) {
  sandbox_proc_kill_wait(&v->proc);
  if (v->base.conn) /* a pool clone's, not handed out */
    agent_conn_free(v->base.conn);
  /* Reaped: no live process has the uid now. */
  if (v->uid)
    vm_uid_release(&vmb.uids, v->uid);
  qmp_free(v->qmp);
  free(v->ram);
  if (v->agent_fd >= 0)
    close(v->agent_fd);
  if (v->dir && v->dir[0])
    fs_remove_tree(v->dir);
  free(v->dir);
  json_decref(v->base.info);
  sandbox_proc_fini(&v->proc);
  pthread_mutex_destroy(&v->qmp_lock);
  free(v);
}

static int set_ignore_shared(struct vm *v, bool on, char **ret_err) {
  json_t *caps = json_pack("{s:[{s:s, s:b}]}", "capabilities", "capability", "x-ignore-shared",
                           "state", on);
  return qmp_command(v->qmp, "migrate-set-capabilities", caps, QMP_TIMEOUT_MS, NULL, ret_err);
}

/* Makes sure SRC runs again after a migration that failed or was cut
 * short: cancelled when still going, and continued when stopped. */
static void resume_source(struct vm *src) {
  _cleanup_free_ char *err = NULL;
  qmp_command(src->qmp, "migrate_cancel", NULL, QMP_TIMEOUT_MS, NULL, &err);
  free(steal_ptr(err));
  for (int i = 0; i < 100; i++) {
    json_t *st = NULL;
    if (qmp_command(src->qmp, "query-status", NULL, QMP_TIMEOUT_MS, &st, &err) < 0)
      return; /* its QEMU is gone: the session sees it dead */
    const char *s = json_string_value(json_object_get(st, "status"));
    bool running = s && strcmp(s, "running") == 0;
    bool migrating = s && (strcmp(s, "finish-migrate") == 0);
    json_decref(st);
    if (running)
      return;
    if (!migrating) {
      if (qmp_command(src->qmp, "cont", NULL, QMP_TIMEOUT_MS, NULL, &err) < 0)
        log_warn("a source VM whose snapshot failed cannot be continued: %s", err);
      return;
    }
    usleep(1000);
  }
}

/* Continues SRC once its migration completed.  QEMU reports "completed"
 * a moment before its migration thread has cleaned up, and a cont in
 * between is refused ("Migration is not finalized yet"): that answer is
 * retried for up to a second. */
static int cont_migrated(struct vm *src, char **ret_err) {
  for (int i = 0;; i++) {
    _cleanup_free_ char *err = NULL;
    int r = qmp_command(src->qmp, "cont", NULL, QMP_TIMEOUT_MS, NULL, &err);
    if (r == 0)
      return 0;
    if (i >= 1000 || !err || !strstr(err, "not finalized")) {
      *ret_err = steal_ptr(err);
      return r;
    }
    usleep(1000);
  }
}

/* Polls SRC's migration until it ends, and continues SRC the moment it has
 * completed.  *T_STOP_US: when SRC was stopped for the stream, or 0 while
 * it runs (a live stream); one that has not completed after
 * MIGRATE_LIVE_PASSES passes over the dirty pages (a guest that dirties its
 * pages faster than they go) is stopped then, and the stream ends with the
 * pages still dirty.  Time alone does not stop it: a first pass that takes
 * long is a host short of CPU, and the guest may as well run meanwhile.
 * *RET_PAUSED_US: from the stop to the cont's answer; for a stream that
 * stayed live, QEMU's own downtime (the source stopped for the last pages)
 * plus, as an upper bound of the time between completion and cont, the
 * time from the previous poll (which saw it still going) to the cont's
 * answer. */
static int finish_live_migration(struct vm *src, uint32_t timeout_ms, bool keep_stopped,
                                 uint64_t *t_stop_us, uint64_t *ret_paused_us, char **ret_err) {
  uint64_t t0 = mono_ms(), deadline = t0 + timeout_ms;
  uint64_t t_prev = mono_us();
  /* A stream that stalls (a loader that hangs) ends after MIGRATE_STALL_MS
   * without progress, not at DEADLINE. */
  json_int_t sent = -1;
  uint64_t t_progress = mono_ms();
  for (;;) {
    uint64_t t_sent = mono_us();
    json_t *res = NULL;
    int r = qmp_command(src->qmp, "query-migrate", NULL, QMP_TIMEOUT_MS, &res, ret_err);
    if (r < 0)
      return r;
    json_t *ram = json_object_get(res, "ram");
    json_int_t now_sent = json_integer_value(json_object_get(ram, "transferred"));
    json_int_t passes = json_integer_value(json_object_get(ram, "dirty-sync-count"));
    if (now_sent != sent) {
      sent = now_sent;
      t_progress = mono_ms();
    }
    const char *status = json_string_value(json_object_get(res, "status"));
    if (status && strcmp(status, "completed") == 0) {
      json_int_t downtime_ms = json_integer_value(json_object_get(res, "downtime"));
      json_decref(res);
      log_debug("a snapshot's stream completed: %" PRId64 " bytes, %" PRId64
                " passes, downtime %" PRId64 " ms, %s", (int64_t)now_sent, (int64_t)passes,
                (int64_t)downtime_ms, *t_stop_us ? "source stopped" : "live");
      /* A final snapshot leaves it stopped: the caller ends it. */
      r = keep_stopped ? 0 : cont_migrated(src, ret_err);
      if (r < 0)
        return r;
      *ret_paused_us = *t_stop_us ? mono_us() - *t_stop_us
                                  : (uint64_t)downtime_ms * 1000 + (mono_us() - t_prev);
      return 0;
    }
    bool failed = status && (strcmp(status, "failed") == 0 || strcmp(status, "cancelled") == 0);
    if (failed) {
      const char *desc = json_string_value(json_object_get(res, "error-desc"));
      *ret_err = xasprintf("the live migration %s%s%s", status, desc ? ": " : "", desc ? desc : "");
    }
    json_decref(res);
    if (failed)
      return -EIO;
    if (mono_ms() >= deadline) {
      *ret_err = xasprintf("the live migration did not complete in %u ms", timeout_ms);
      return -ETIMEDOUT;
    }
    if (mono_ms() - t_progress >= MIGRATE_STALL_MS) {
      *ret_err = xasprintf("the stream to the loader QEMU made no progress for %u ms (%" PRId64
                           " bytes sent); it was stopped so that the session runs again",
                           MIGRATE_STALL_MS, (int64_t)sent);
      return -ETIMEDOUT;
    }
    if (!*t_stop_us && passes >= MIGRATE_LIVE_PASSES) {
      log_info("a live snapshot's stream has not converged after %" PRId64 " passes in %.1f s (%" PRId64
               " bytes sent): its source is stopped for the rest",
               (int64_t)passes, (mono_ms() - t0) / 1000.0, (int64_t)sent);
      uint64_t t = mono_us();
      r = qmp_command(src->qmp, "stop", NULL, QMP_TIMEOUT_MS, NULL, ret_err);
      if (r < 0)
        return r;
      *t_stop_us = t;
    }
    t_prev = t_sent;
    usleep(250);
  }
}

/* Whether SRC's QEMU may stream its RAM while its guest runs (see
 * SNAPSHOT_LIVE_QEMU): asked with query-version; a QEMU that does not say
 * is stopped for the stream. */
static bool streams_live(struct vm *src) {
  json_t *res = NULL;
  _cleanup_free_ char *err = NULL;
  if (qmp_command(src->qmp, "query-version", NULL, QMP_TIMEOUT_MS, &res, &err) < 0)
    return false;
  json_int_t major = json_integer_value(json_object_get(json_object_get(res, "qemu"), "major"));
  json_decref(res);
  return major >= SNAPSHOT_LIVE_QEMU;
}

int vm_cont_migrated(struct vm *src, char **ret_err) {
  pthread_mutex_lock(&src->qmp_lock);
  int r = cont_migrated(src, ret_err);
  pthread_mutex_unlock(&src->qmp_lock);
  return r;
}

int vm_migrate_live(struct vm *src, struct vm *loader, bool keep_stopped, uint64_t *ret_paused_us,
                    char **ret_err) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
    *ret_err = xasprintf("socketpair for the migration stream: %s", strerror(errno));
    return -errno;
  }
  _cleanup_close_ int in = sv[0], out = sv[1];
  int r = qmp_getfd(loader->qmp, in, "mig", QMP_TIMEOUT_MS, ret_err);
  if (r == 0)
    r = qmp_command(loader->qmp, "migrate-incoming", json_pack("{s:s}", "uri", "fd:mig"),
                    QMP_TIMEOUT_MS, NULL, ret_err);
  closep(&in);
  if (r < 0) {
    char *m = xasprintf("the snapshot's loader QEMU refused the stream: %s", *ret_err);
    free(*ret_err);
    *ret_err = m;
    return r;
  }
  pthread_mutex_lock(&src->qmp_lock);
  /* The source still has x-ignore-shared on from its own restore; its RAM
   * is private (share=off), so all of it must go. */
  r = set_ignore_shared(src, false, ret_err);
  if (r == 0)
    r = qmp_command(src->qmp, "migrate-set-parameters",
                    json_pack("{s:I, s:I}", "max-bandwidth", (json_int_t)MIGRATE_MAX_BANDWIDTH,
                              "downtime-limit", (json_int_t)MIGRATE_DOWNTIME_MS),
                    QMP_TIMEOUT_MS, NULL, ret_err);
  if (r == 0)
    r = qmp_getfd(src->qmp, out, "mig", QMP_TIMEOUT_MS, ret_err);
  closep(&out);
  bool started = false;
  /* See SNAPSHOT_LIVE_QEMU: an older QEMU is stopped for the whole stream. */
  uint64_t t_stop = 0;
  if (r == 0 && !streams_live(src)) {
    t_stop = mono_us();
    r = qmp_command(src->qmp, "stop", NULL, QMP_TIMEOUT_MS, NULL, ret_err);
    started = r == 0; /* from here on, a failure must continue it */
  }
  if (r == 0) {
    r = qmp_command(src->qmp, "migrate", json_pack("{s:s}", "uri", "fd:mig"), QMP_TIMEOUT_MS,
                    NULL, ret_err);
    started = started || r == 0; /* stopped, or migrating: continued on failure */
  }
  if (r == 0)
    r = finish_live_migration(src, MIGRATE_TIMEOUT_MS, keep_stopped, &t_stop, ret_paused_us,
                              ret_err);
  if (r < 0 && started)
    resume_source(src);
  pthread_mutex_unlock(&src->qmp_lock);
  if (r < 0)
    return r;
  return wait_incoming(loader, MIGRATE_TIMEOUT_MS, ret_err);
}

int vm_save_state(struct vm *v, int fd, char **ret_err) {
  pthread_mutex_lock(&v->qmp_lock);
  int r = set_ignore_shared(v, true, ret_err);
  if (r == 0)
    r = qmp_getfd(v->qmp, fd, "state", QMP_TIMEOUT_MS, ret_err);
  if (r == 0)
    r = qmp_command(v->qmp, "migrate", json_pack("{s:s}", "uri", "fd:state"), QMP_TIMEOUT_MS,
                    NULL, ret_err);
  if (r == 0)
    r = qmp_wait_migration(v->qmp, MIGRATE_TIMEOUT_MS, ret_err);
  pthread_mutex_unlock(&v->qmp_lock);
  return r;
}
