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
 * (no CPU), plus IGN_MCP_SPARES QEMUs waiting for a restore.  Handing out a
 * pool clone is a QMP cont; the session layer then says HELLO and ready()
 * sends SETUP: fresh entropy, the host's clock, a hostname and a machine id,
 * before the session is returned.  A clone is taken off the pool list under
 * its lock, so it is handed out once.
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
#include "sandbox/vm.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <linux/kvm.h>
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
#include <xxhash.h>

#include "common/fs.h"
#include "common/util.h"
#include "mcp/config.h"
#include "mcp/log.h"
#include "proto/proto.h"
#include "sandbox/qmp.h"

#define QMP_TIMEOUT_MS 10000
#define COLD_BOOT_TIMEOUT_MS 90000
#define KVM_BOOT_TIMEOUT_MS 20000
#define RESTORE_TIMEOUT_MS 20000
#define BASE_WAIT_MS 180000
#define TB_SIZE_MB 128
#define FINGERPRINT_VERSION 3

struct vm {
  struct sandbox base;      /* first: the session layer sees this */
  struct vm *next;
  struct qmp *qmp;
  int agent_fd;
  char *dir;
  /* QEMU: killed and reaped only through this (spawn.c), as several calls
   * may ask why a VM died at once (death_reason) while a close kills it. */
  struct sandbox_proc proc;
  uid_t uid;                /* a root server's QEMU uid, given back once it is reaped; or 0 */
  char path[8];             /* "pool", "restore", "cold" */
  char *ram;                /* the RAM file it maps (a spare fits only its base) */
  dev_t ram_dev;            /* ... and that file's identity when it started: a base */
  ino_t ram_ino;            /* made again at the same path is another file */
  uint64_t t_spawn_us, t_restore_us, t_cont_us;
};

static struct {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  bool init_done, stopping, pool_running;
  char *init_error;         /* why sessions cannot open, when they cannot */
  bool retry;               /* a session asks to try making the base again */
  unsigned attempts;        /* tries made after the first */
  struct vm_base_failure failure; /* the last try, when it failed */
  char *base_error;         /* why the last remake_base failed, or NULL */
  const char *accel;        /* "kvm", "tcg" */
  char isolation[16];
  unsigned tsc_khz;
  char *run_dir;            /* per-VM state directories */
  char *fingerprint;
  char *base_dir;           /* the current base, or NULL */
  struct vm *ready, *spares;
  unsigned n_ready, n_spares;
  unsigned seq;
  gid_t kvm_gid;
  int base_lock_fd;         /* shared flock on the base in use */
  struct vm_uids uids;      /* a root server's QEMU uids */
} vmb = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER, .base_lock_fd = -1,
       .uids = {.lock = PTHREAD_MUTEX_INITIALIZER}};

const char *vm_isolation(void) { return vmb.isolation[0] ? vmb.isolation : "microvm"; }

/* ---- helpers ---- */

static bool file_exists(const char *p) { return access(p, F_OK) == 0; }

static unsigned host_tsc_khz(void) {
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

/* Why /dev/kvm cannot make a VM for this process, or NULL when it can. */
static char *kvm_open_why(char **ret_fix) {
  _cleanup_close_ int fd = open("/dev/kvm", O_RDWR | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT)
    return strdup("/dev/kvm does not exist (the host offers no hardware virtualisation to this "
                  "machine, or the kvm module is not loaded)");
  if (fd < 0 && errno == EACCES) {
    /* Say which: a device only root may use, or a group this user is not in. */
    struct stat st;
    struct group *g = getgrnam("kvm");
    bool kvm_group = stat("/dev/kvm", &st) == 0 && g && st.st_gid == g->gr_gid &&
                     (st.st_mode & 0060) == 0060;
    if (kvm_group) {
      *ret_fix = strdup("sudo usermod -aG kvm \"$USER\" (then log in again)");
      return strdup("/dev/kvm cannot be opened: Permission denied (it belongs to group kvm, "
                    "which this user is not in)");
    }
    *ret_fix = strdup("sudo chgrp kvm /dev/kvm && sudo chmod 0660 /dev/kvm && sudo usermod -aG kvm "
                      "\"$USER\" (then log in again); or run the server as root");
    return xasprintf("/dev/kvm cannot be opened: Permission denied (mode %03o, owner %u, group %u: "
                     "only root may use KVM on this host, so as a user it is not usable)",
                     (unsigned)(st.st_mode & 0777), (unsigned)st.st_uid, (unsigned)st.st_gid);
  }
  if (fd < 0)
    return xasprintf("/dev/kvm cannot be opened: %s", strerror(errno));
  if (ioctl(fd, KVM_GET_API_VERSION, 0) != KVM_API_VERSION)
    return strdup("/dev/kvm speaks another KVM API version");
  int vm = ioctl(fd, KVM_CREATE_VM, 0);
  if (vm < 0)
    return xasprintf("/dev/kvm opens but cannot create a VM: %s", strerror(errno));
  close(vm);
  return NULL;
}

static void stat_part(char *buf, size_t size, const char *name, const char *path) {
  struct stat st;
  size_t n = strlen(buf);
  if (path && stat(path, &st) == 0)
    snprintf(buf + n, size - n, "%s=%s:%lld:%lld.%09ld:%llu ", name, path, (long long)st.st_size,
             (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec, (unsigned long long)st.st_ino);
  else
    snprintf(buf + n, size - n, "%s=%s:missing ", name, path ? path : "");
}

/* The guest's overlay is a tmpfs in guest RAM, which has no swap. */
static unsigned guest_overlay_mb(void) { return sandbox_overlay_mb(cfg.vm_memory_mb, cfg.overlay_mb); }

/* What a base is made from, as text; its hash names the base directory. */
static char *make_fingerprint(const char *accel) {
  char buf[8192] = "";
  stat_part(buf, sizeof buf, "qemu", cfg.qemu);
  stat_part(buf, sizeof buf, "kernel", cfg.kernel);
  stat_part(buf, sizeof buf, "initramfs", cfg.initramfs);
  stat_part(buf, sizeof buf, "image", cfg.vm_image);
  size_t n = strlen(buf);
  snprintf(buf + n, sizeof buf - n, "mem=%u accel=%s tb=%d overlay=%u net=%d v=%d",
           cfg.vm_memory_mb, accel, TB_SIZE_MB, guest_overlay_mb(), cfg.net, FINGERPRINT_VERSION);
  return strdup(buf);
}

static char *base_dir_for(const char *fingerprint) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (const char *p = fingerprint; *p; p++)
    h = (h ^ (uint8_t)*p) * 1099511628211ull;
  return xasprintf("%s/%s-%016" PRIx64, cfg.store, cfg.base, h);
}

/* ---- one QEMU ---- */

static char *vm_log_tail(const struct vm *v);

enum vm_kind { VM_GOLDEN, VM_CLONE, VM_COLD };

/* Appends the NULL-terminated list of arguments to ARGV. */
static void args_add(const char **argv, int *n, ...) {
  va_list ap;
  va_start(ap, n);
  for (const char *a; (a = va_arg(ap, const char *));)
    argv[(*n)++] = a;
  va_end(ap);
}

/* Ends *ERR with what QEMU last said, when it said anything. */
static void add_log_tail(struct vm *v, char **err) {
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
 * at once instead of hanging every call until its timeout. */
static char *cmdline(const char *accel) {
  return xasprintf("console=ttyS0 quiet tsc_early_khz=%u nokaslr no_timer_check mitigations=off "
                   "i8042.noaux i8042.nokbd i8042.nopnp cryptomgr.notests panic=-1 reboot=t%s "
                   "ign.fstype=erofs ign.overlay_mb=%u",
                   vmb.tsc_khz, strcmp(accel, "tcg") == 0 ? " norandmaps" : "", guest_overlay_mb());
}

/* Starts a QEMU of KIND.  RAM_FILE is the base's RAM (golden: created).  On
 * failure *RET_EXITED (when given) tells whether QEMU itself ran and exited
 * (it refused the guest or the accelerator), as opposed to never starting
 * (no fork, no socket, no fds): only the former says anything about the
 * guest or KVM. */
static int vm_start(enum vm_kind kind, const char *accel, const char *ram_file, const char *dir,
                    struct vm **ret, bool *ret_exited, char **ret_err) {
  if (ret_exited)
    *ret_exited = false;
  struct vm *v = calloc(1, sizeof *v);
  if (!v)
    return -ENOMEM;
  v->agent_fd = -1;
  sandbox_proc_init(&v->proc);
  v->ram = ram_file ? strdup(ram_file) : NULL;
  struct stat ram_st;
  if (ram_file && stat(ram_file, &ram_st) == 0) {
    v->ram_dev = ram_st.st_dev;
    v->ram_ino = ram_st.st_ino;
  }
  v->base.ops = &sandbox_vm_ops;
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
  _cleanup_free_ char *ram_path = kind == VM_CLONE ? xasprintf("%s/ram", v->dir)
                                                   : ram_file ? strdup(ram_file) : NULL;
  _cleanup_free_ char *machine =
      xasprintf("microvm,x-option-roms=off,isa-serial=on,rtc=on,pic=off,pit=off%s",
                kind == VM_COLD ? "" : ",memory-backend=mem");
  _cleanup_free_ char *accel_arg = kvm ? strdup("kvm") : xasprintf("tcg,tb-size=%d", TB_SIZE_MB);
  _cleanup_free_ char *mem = xasprintf("%uM", cfg.vm_memory_mb);
  _cleanup_free_ char *backend =
      ram_path ? xasprintf("memory-backend-file,id=mem,size=%uM,mem-path=%s,share=%s",
                           cfg.vm_memory_mb, ram_path, kind == VM_GOLDEN ? "on" : "off")
               : NULL;
  _cleanup_free_ char *drive =
      xasprintf("file=%s,format=raw,if=none,readonly=on,id=root", img_path);
  _cleanup_free_ char *append = cmdline(accel);
  const char *argv[64];
  int n = 0;
  args_add(argv, &n, "qemu-system-x86_64", "-M", machine, "-accel", accel_arg, "-cpu",
           kvm ? "host" : "qemu64", "-smp", "1", "-m", mem, NULL);
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
  if (cfg.net)
    args_add(argv, &n, "-netdev", "user,id=net0", "-device", "virtio-net-device,netdev=net0",
             NULL);
  if (kind == VM_CLONE)
    args_add(argv, &n, "-incoming", "defer", NULL);
  else
    args_add(argv, &n, "-kernel", k_path, "-initrd", i_path, "-append", append, NULL);
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
      .ram_file_writable = kind == VM_CLONE ? ram_path : NULL, .makes_ram_file = kind == VM_GOLDEN,
      .needed = {cfg.qemu}, .hide = vmb.run_dir,
      .binds = {{cfg.vm_image, "image", false},
                {kind == VM_CLONE ? ram_file : cfg.kernel, kind == VM_CLONE ? "ram" : "kernel",
                 kind == VM_CLONE},
                {kind == VM_CLONE ? NULL : cfg.initramfs, "initramfs", false}},
      .qmp_fd = qsv[1], .agent_fd = asv[1], .net = cfg.net,
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
  if (r == 0 && kind != VM_COLD) {
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
    add_log_tail(v, ret_err);
    sandbox_vm_ops.destroy(&v->base);
    return r;
  }
  *ret = v;
  return 0;
}

/* Loads the base's state into a clone waiting in -incoming defer. */
static int vm_restore(struct vm *v, const char *base_dir, char **ret_err) {
  uint64_t t0 = mono_us();
  _cleanup_free_ char *state = xasprintf("%s/state", base_dir);
  _cleanup_close_ int fd = open(state, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *ret_err = xasprintf("the warm base's state file %s cannot be read: %s", state,
                         strerror(errno));
    return -errno;
  }
  int r = qmp_getfd(v->qmp, fd, "snap", QMP_TIMEOUT_MS, ret_err);
  if (r < 0)
    return r;
  r = qmp_command(v->qmp, "migrate-incoming", json_pack("{s:s}", "uri", "fd:snap"),
                  QMP_TIMEOUT_MS, NULL, ret_err);
  if (r < 0)
    return r;
  uint64_t deadline = mono_ms() + RESTORE_TIMEOUT_MS;
  for (;;) {
    json_t *st = NULL;
    r = qmp_command(v->qmp, "query-status", NULL, QMP_TIMEOUT_MS, &st, ret_err);
    if (r < 0) {
      char *m = xasprintf("restoring from the warm base failed (QEMU: %s)", *ret_err);
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
      break;
    if (!waiting) {
      *ret_err = xasprintf("after restoring, the clone is '%s' instead of paused",
                           copy ? copy : "?");
      return -EIO;
    }
    if (mono_ms() >= deadline) {
      *ret_err = strdup("restoring from the warm base did not finish in time");
      return -ETIMEDOUT;
    }
    usleep(200);
  }
  v->t_restore_us = mono_us() - t0;
  return 0;
}

/* Runs a clone once before it is stopped in the pool: HELLO, a SETUP and a
 * `true`, spoken raw on the channel (no agent_conn owns it yet).  TCG then
 * has translated the paths every session takes, so the clone's first real
 * calls are fast.  The SETUP here is not the clone's reseed: that one is
 * sent with fresh bytes when the clone is handed out. */
static int warm_clone(int fd, uint32_t timeout_ms, char **ret_err) {
  uint8_t entropy[32];
  if (getrandom(entropy, sizeof entropy, 0) != sizeof entropy)
    memset(entropy, 0, sizeof entropy);
  struct proto_buf b = {0};
  int r = 0;
  for (uint32_t id = 1; id <= 3 && r == 0; id++) {
    if (id == 1) {
      proto_frame_begin(&b, PROTO_HELLO, id);
      proto_put_u32(&b, TAG_VERSION, PROTO_VERSION);
    } else if (id == 2) {
      proto_frame_begin(&b, PROTO_SETUP, id);
      proto_put_bytes(&b, TAG_ENTROPY, entropy, sizeof entropy);
      proto_put_u64(&b, TAG_TIME_NS, now_ns(CLOCK_REALTIME));
      proto_put_str(&b, TAG_HOSTNAME, "ignition");
      proto_put_str(&b, TAG_MACHINE_ID, "00000000000000000000000000000000");
    } else {
      proto_frame_begin(&b, PROTO_EXEC, id);
      proto_put_str(&b, TAG_COMMAND, "true");
      proto_put_u32(&b, TAG_TIMEOUT_MS, timeout_ms);
      proto_put_u32(&b, TAG_HAS_STDIN, 0);
    }
    r = proto_frame_finish(&b);
    if (r == 0)
      r = proto_write_all(fd, b.data, b.len);
  }
  proto_buf_free(&b);
  /* On the heap, for this call only: a static thread-local buffer would be
   * carried by every thread of the server. */
  _cleanup_free_ uint8_t *payload = malloc(PROTO_MAX_PAYLOAD);
  if (!payload) {
    *ret_err = strdup("out of memory for the clone's first answer");
    return -ENOMEM;
  }
  uint64_t deadline = mono_ms() + timeout_ms;
  while (r == 0) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    uint64_t now = mono_ms();
    if (now >= deadline) {
      r = -ETIMEDOUT;
      break;
    }
    if (poll(&p, 1, (int)(deadline - now)) <= 0)
      continue;
    struct proto_header h;
    r = proto_read_frame(fd, &h, payload);
    if (r == 0 && h.id == 3 && (h.type == PROTO_EXIT || h.type == PROTO_ERROR))
      return 0;
    if (r == 0 && h.id == 1 && h.type == PROTO_ERROR)
      r = -EPROTO;
  }
  *ret_err = xasprintf("the clone's agent did not answer: %s", strerror(-r));
  return r;
}

/* The VM's log, opened to read as root.  Its state directory belongs to
 * QEMU's uid, which can replace qemu.log with a link to a file only root may
 * read, or with a FIFO: the log is opened relative to the directory without
 * following a link, and used only if it is a regular file with no other
 * name (a hard link to another file has two).  -1 otherwise. */
static int open_log(const struct vm *v) {
  if (!v->dir)
    return -1;
  _cleanup_close_ int dfd = open(v->dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0)
    return -1;
  int fd = openat(dfd, "qemu.log", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  struct stat st;
  if (fd >= 0 && (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1)) {
    log_warn("%s/qemu.log is not the log QEMU was given (not a regular file with one name); "
             "not reading it",
             v->dir);
    close(fd);
    return -1;
  }
  return fd;
}

static char *vm_log_tail(const struct vm *v) {
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

/* ---- the warm base ---- */

/* Every base's meta file records the size and XXH3-64 of its RAM and state
 * files, written when it is made and checked the first time a server uses
 * it, so that a damaged or truncated base is made again instead of giving
 * clones that hang or crash.  The whole of both files is hashed: a sampled
 * hash would miss a flipped byte, and XXH3 reads the 256 MiB RAM file
 * (mostly holes) in a fraction of a second. */
static const char *const base_files[] = {"ram", "state"};

static int file_digest(const char *path, uint64_t *ret_hash, uint64_t *ret_size) {
  _cleanup_close_ int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  enum { CHUNK = 1 << 20 };
  _cleanup_free_ uint8_t *buf = malloc(CHUNK);
  XXH3_state_t *st = XXH3_createState();
  if (!buf || !st) {
    XXH3_freeState(st);
    return -ENOMEM;
  }
  XXH3_64bits_reset(st);
  uint64_t size = 0;
  int r = 0;
  for (;;) {
    ssize_t n = read(fd, buf, CHUNK);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      r = -errno;
    if (n <= 0)
      break;
    XXH3_64bits_update(st, buf, (size_t)n);
    size += (uint64_t)n;
  }
  if (r == 0) {
    *ret_hash = XXH3_64bits_digest(st);
    *ret_size = size;
  }
  XXH3_freeState(st);
  return r;
}

/* Appends the digest lines of DIR's files to F. */
static int write_digests(FILE *f, const char *dir, char **ret_err) {
  for (size_t i = 0; i < ARRAY_SIZE(base_files); i++) {
    _cleanup_free_ char *p = xasprintf("%s/%s", dir, base_files[i]);
    uint64_t h, size;
    int r = file_digest(p, &h, &size);
    if (r < 0) {
      *ret_err = xasprintf("cannot read %s to checksum it: %s", p, strerror(-r));
      return r;
    }
    fprintf(f, "xxh3 %s %" PRIu64 " %016" PRIx64 "\n", base_files[i], size, h);
  }
  return 0;
}

/* Checks DIR's files against the digests in its meta; says what differs. */
static int verify_base(const char *dir, char **ret_why) {
  _cleanup_free_ char *meta = xasprintf("%s/meta", dir);
  _cleanup_fclose_ FILE *f = fopen(meta, "re");
  if (!f) {
    *ret_why = xasprintf("%s cannot be read: %s", meta, strerror(errno));
    return -EIO;
  }
  uint64_t want_size[ARRAY_SIZE(base_files)], want_hash[ARRAY_SIZE(base_files)];
  bool have[ARRAY_SIZE(base_files)] = {false};
  char line[8192], name[16];
  while (fgets(line, sizeof line, f)) {
    uint64_t size, h;
    if (sscanf(line, "xxh3 %15s %" SCNu64 " %" SCNx64, name, &size, &h) != 3)
      continue;
    for (size_t i = 0; i < ARRAY_SIZE(base_files); i++)
      if (strcmp(name, base_files[i]) == 0) {
        want_size[i] = size;
        want_hash[i] = h;
        have[i] = true;
      }
  }
  for (size_t i = 0; i < ARRAY_SIZE(base_files); i++) {
    _cleanup_free_ char *p = xasprintf("%s/%s", dir, base_files[i]);
    uint64_t h, size;
    int r;
    if (!have[i]) {
      *ret_why = xasprintf("%s records no checksum of %s", meta, p);
      return -EBADMSG;
    }
    if ((r = file_digest(p, &h, &size)) < 0) {
      *ret_why = xasprintf("%s cannot be read: %s", p, strerror(-r));
      return r;
    }
    if (size != want_size[i]) {
      *ret_why = xasprintf("%s is %" PRIu64 " bytes instead of %" PRIu64 " (truncated?)", p, size,
                           want_size[i]);
      return -EBADMSG;
    }
    if (h != want_hash[i]) {
      *ret_why = xasprintf("%s does not match its checksum (xxh3 %016" PRIx64
                           ", recorded %016" PRIx64 ")",
                           p, h, want_hash[i]);
      return -EBADMSG;
    }
  }
  return 0;
}

/* The space a base may take in the store: its RAM file (sparse, but the
 * guest may have touched all of it) and its device state. */
static uint64_t base_space_needed(void) { return ((uint64_t)cfg.vm_memory_mb + 4) << 20; }

/* Free bytes in the store, or UINT64_MAX when unknown. */
static uint64_t store_free(void) {
  struct statvfs sv;
  if (statvfs(cfg.store, &sv) < 0)
    return UINT64_MAX;
  return (uint64_t)sv.f_bavail * sv.f_frsize;
}

static bool base_complete(const char *dir) {
  _cleanup_free_ char *ram = xasprintf("%s/ram", dir);
  _cleanup_free_ char *state = xasprintf("%s/state", dir);
  _cleanup_free_ char *meta = xasprintf("%s/meta", dir);
  return file_exists(ram) && file_exists(state) && file_exists(meta);
}

/* Whose fault a failed attempt at the base is.  Only the guest's (it did not
 * boot, or could not be saved) says anything about the accelerator; the
 * store's (full, over quota, read-only, not writable, an I/O error) would fail
 * the same way under TCG, and must not make a server give up KVM for good. */
enum base_fault { BASE_FAULT_STORE, BASE_FAULT_GUEST };

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

/* Builds the base for FINGERPRINT in a temporary directory of the store and
 * returns its path; ensure_base_locked moves it into place. */
static int build_base(const char *accel, const char *fingerprint, char **ret_tmp,
                      enum base_fault *ret_fault, char **ret_err) {
  _cleanup_free_ char *final = base_dir_for(fingerprint);
  _cleanup_free_ char *tmp = xasprintf("%s.tmp-%d", final, getpid());
  *ret_fault = BASE_FAULT_STORE;
  fs_remove_tree(tmp);
  int r = fs_mkdir_p(tmp, 0750);
  if (r < 0) {
    *ret_err = xasprintf("cannot create %s: %s (set IGN_MCP_STORE to a writable directory)", tmp,
                         strerror(-r));
    return r;
  }
  uint64_t t0 = mono_ms();
  uint64_t avail = store_free(), need = base_space_needed();
  if (avail < need) {
    *ret_err = xasprintf("the store %s is full: %" PRIu64 " MiB free, and a warm base needs up to "
                         "%" PRIu64 " MiB there (its RAM file and device state); free space in "
                         "it or point IGN_MCP_STORE at a larger filesystem, then open a session "
                         "again",
                         cfg.store, avail >> 20, need >> 20);
    fs_remove_tree(tmp);
    return -ENOSPC;
  }
  _cleanup_free_ char *ram = xasprintf("%s/ram", tmp);
  struct vm *v = NULL;
  bool exited;
  r = vm_start(VM_GOLDEN, accel, ram, tmp, &v, &exited, ret_err);
  if (r < 0) {
    /* QEMU ran and refused the guest (under KVM: KVM's fault?); not when it
     * could not even be started (no memory, no fds). */
    if (exited)
      *ret_fault = BASE_FAULT_GUEST;
    fs_remove_tree(tmp);
    return r;
  }
  struct agent_conn *conn = NULL;
  _cleanup_free_ char *err = NULL;
  uint32_t boot_timeout = strcmp(accel, "kvm") == 0 ? KVM_BOOT_TIMEOUT_MS : COLD_BOOT_TIMEOUT_MS;
  r = agent_conn_open(v->agent_fd, boot_timeout, &conn, &err);
  v->agent_fd = -1; /* the connection owns it now */
  if (r == 0) {
    /* Warm the page cache of what sessions use most: every clone shares it. */
    struct agent_exec_req req = {
        .command = "command -v python3 >/dev/null && python3 -c pass; command -v gcc >/dev/null "
                   "&& echo 'int main(void){return 0;}' | gcc -x c -c -o /dev/null -; true",
        .timeout_ms = 120000, .out_cap = 4096};
    struct agent_exec_res res;
    if (agent_exec(conn, &req, NULL, &res, &err) == 0)
      agent_exec_res_free(&res);
    free(steal_ptr(err));
  }
  if (r == 0) {
    json_t *caps = json_pack("{s:[{s:s, s:b}]}", "capabilities", "capability", "x-ignore-shared",
                             "state", 1);
    r = qmp_command(v->qmp, "migrate-set-capabilities", caps, QMP_TIMEOUT_MS, NULL, &err);
  }
  if (r == 0)
    r = qmp_command(v->qmp, "stop", NULL, QMP_TIMEOUT_MS, NULL, &err);
  _cleanup_free_ char *state = xasprintf("%s/state", tmp);
  bool state_unwritable = false;
  if (r == 0) {
    _cleanup_close_ int fd = open(state, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
    if (fd < 0) {
      r = -errno;
      state_unwritable = true;
      err = xasprintf("cannot create %s: %s", state, strerror(errno));
    } else {
      r = qmp_getfd(v->qmp, fd, "snap", QMP_TIMEOUT_MS, &err);
    }
  }
  if (r == 0)
    r = qmp_command(v->qmp, "migrate", json_pack("{s:s}", "uri", "fd:snap"), QMP_TIMEOUT_MS, NULL,
                    &err);
  if (r == 0)
    r = qmp_wait_migration(v->qmp, 60000, &err);
  if (r < 0) {
    _cleanup_free_ char *tail = vm_log_tail(v);
    /* The store may have filled up while the guest wrote its RAM: then it is
     * the store's fault, not the guest's. */
    uint64_t left = store_free();
    bool full = left < (16u << 20);
    *ret_fault = full || state_unwritable ? BASE_FAULT_STORE : BASE_FAULT_GUEST;
    _cleanup_free_ char *full_text =
        full ? xasprintf(" (the store %s is full: %" PRIu64 " MiB free; a warm "
                         "base needs up to %" PRIu64 " MiB)",
                         cfg.store, left >> 20, base_space_needed() >> 20)
             : strdup("");
    *ret_err = xasprintf("making the warm base under %s failed%s: %s%s%s", accel, full_text,
                         err ? err : strerror(-r), tail ? "; QEMU/guest said: " : "",
                         tail ? tail : "");
  }
  qmp_command(v->qmp, "quit", NULL, 2000, NULL, &err);
  agent_conn_free(conn);
  _cleanup_free_ char *log_src = xasprintf("%s/qemu.log", tmp);
  _cleanup_free_ char *log_dst = xasprintf("%s/golden-boot.log", tmp);
  v->dir[0] = '\0'; /* keep the directory: it becomes the base */
  sandbox_vm_ops.destroy(&v->base);
  if (r < 0) {
    fs_remove_tree(tmp);
    return r;
  }
  /* From here on, every failure is the store's. */
  rename(log_src, log_dst);
  static const char *const mount_points[] = {"image", "kernel", "initramfs"};
  for (size_t i = 0; i < ARRAY_SIZE(mount_points); i++) {
    _cleanup_free_ char *mp = xasprintf("%s/%s", tmp, mount_points[i]);
    unlink(mp);
  }
  /* Clones (other uids, group VM_GID) read the state and open the RAM file
   * read-write (QEMU 7.2 does, even for a private mapping); nobody else. */
  if (chown(tmp, 0, VM_GID) < 0 || chown(ram, 0, VM_GID) < 0 || chown(state, 0, VM_GID) < 0 ||
      chmod(ram, 0660) < 0 || chmod(state, 0640) < 0 || chmod(tmp, 0750) < 0) {
    if (getuid() == 0) {
      r = -errno;
      *ret_err = xasprintf("cannot set the owner of the warm base in %s: %s", tmp, strerror(errno));
      fs_remove_tree(tmp);
      return r;
    }
  }
  _cleanup_free_ char *meta = xasprintf("%s/meta", tmp);
  int meta_fd = open(meta, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  _cleanup_fclose_ FILE *f = meta_fd >= 0 ? fdopen(meta_fd, "w") : NULL;
  if (meta_fd >= 0 && !f)
    close(meta_fd);
  uint64_t t_sum = mono_ms();
  if (f) {
    fprintf(f, "%s\n", fingerprint);
    r = write_digests(f, tmp, ret_err);
    if (fclose(steal_ptr(f)) != 0 && r == 0) {
      r = -errno;
      *ret_err = xasprintf("cannot write %s: %s", meta, strerror(errno));
    }
  } else {
    r = -errno;
    *ret_err = xasprintf("cannot write %s: %s", meta, strerror(errno));
  }
  if (r < 0) {
    fs_remove_tree(tmp);
    return r;
  }
  log_info("warm base %s made under %s in %" PRIu64 " ms (checksums: %" PRIu64 " ms)", final, accel,
           mono_ms() - t0, mono_ms() - t_sum);
  *ret_tmp = steal_ptr(tmp);
  return 0;
}

static int set_aside(const char *dir, char **ret_err);

/* Moves the base built in TMP into place at FINAL (under the store lock). */
static int install_base(const char *tmp, const char *final, char **ret_err) {
  if (rename(tmp, final) == 0)
    return 0;
  int r = -errno;
  /* Another server made the same base meanwhile: use theirs. */
  if (base_complete(final)) {
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
  _cleanup_free_ char *fp = make_fingerprint(accel);
  char *dir = base_dir_for(fp);
  *ret_complete = base_complete(dir);
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
 * verify_base); a base it made itself or checked before is trusted. */
static char *checked; /* under build_lock */

/* 1 when the base in DIR can be used; 0 when it was damaged and is set
 * aside; a negative errno when it is damaged and cannot be set aside.  Under
 * the store lock. */
static int check_base(const char *dir, char **ret_err) {
  if (checked && strcmp(checked, dir) == 0)
    return 1;
  _cleanup_free_ char *why = NULL, *aside_err = NULL;
  uint64_t t0 = mono_ms();
  if (verify_base(dir, &why) < 0) {
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
  _cleanup_free_ char *fp = make_fingerprint(vmb.accel);
  _cleanup_free_ char *dir = base_dir_for(fp);
  *ret_fault = BASE_FAULT_STORE;
  int lock = store_lock(ret_err);
  if (lock < 0)
    return lock;
  int r = 0; /* 1: the base is there and sound */
  if (!force && base_complete(dir)) {
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
    if ((r = build_base(vmb.accel, fp, &tmp, ret_fault, ret_err)) < 0)
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

/* Records a failed try (under vmb.lock). */
static void note_failure(enum base_fault fault, char *fingerprint) {
  free(vmb.failure.fingerprint);
  vmb.failure = (struct vm_base_failure){.at_ms = mono_ms(), .store_fault = fault == BASE_FAULT_STORE,
                                         .store_free = store_free(), .fingerprint = fingerprint};
}

/* Why the last failed try is not followed by another one now, or NULL when
 * one is due (vm_base_retry_due); under vmb.lock. */
static char *retry_not_due(const char *fingerprint) {
  uint64_t now = mono_ms();
  if (vm_base_retry_due(&vmb.failure, now, store_free(), fingerprint))
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
static int remake_base(const char *gone, char **ret_dir, char **ret_err) {
  pthread_mutex_lock(&build_lock);
  char *fp = make_fingerprint(vmb.accel);
  pthread_mutex_lock(&vmb.lock);
  /* Another thread (the pool, a call) has made it meanwhile. */
  bool current = vmb.base_dir && vmb.fingerprint && strcmp(vmb.fingerprint, fp) == 0 &&
                 base_complete(vmb.base_dir);
  _cleanup_free_ char *not_yet = !current && vmb.base_error ? retry_not_due(fp) : NULL;
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
    note_failure(fault, steal_ptr(fp));
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

/* ---- the pool ---- */

static void push(struct vm **list, unsigned *n, struct vm *v) {
  v->next = *list;
  *list = v;
  (*n)++;
}

static struct vm *pop(struct vm **list, unsigned *n) {
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
static void drain_pool_locked(void) {
  struct vm *lists[2] = {vmb.ready, vmb.spares};
  vmb.ready = vmb.spares = NULL;
  vmb.n_ready = vmb.n_spares = 0;
  pthread_mutex_unlock(&vmb.lock);
  for (size_t i = 0; i < ARRAY_SIZE(lists); i++)
    for (struct vm *v = lists[i], *nx; v; v = nx) {
      nx = v->next;
      sandbox_vm_ops.destroy(&v->base);
    }
}

/* A spare QEMU fits a base only if it maps that base's RAM file. */
static bool spare_fits(const struct vm *spare, const char *ram) {
  struct stat st;
  return strcmp(spare->ram, ram) == 0 && stat(ram, &st) == 0 && st.st_dev == spare->ram_dev &&
         st.st_ino == spare->ram_ino;
}

static int new_clone(const char *base, bool warm, struct vm **ret, char **ret_err) {
  struct vm *v = NULL;
  int r = 0;
  _cleanup_free_ char *base_dir = strdup(base);
  /* A missing file means the base is gone (set aside by another server, or
   * removed), not that every clone must fail: find or make it again.  (QEMU
   * would also create an empty RAM file, and the clone would hang.) */
  if (!base_complete(base_dir)) {
    free(steal_ptr(base_dir));
    if ((r = remake_base(base, &base_dir, ret_err)) < 0)
      return r;
  }
  pthread_mutex_lock(&vmb.lock);
  struct vm *spare = pop(&vmb.spares, &vmb.n_spares);
  pthread_mutex_unlock(&vmb.lock);
  pthread_cond_broadcast(&vmb.cond);
  _cleanup_free_ char *ram = xasprintf("%s/ram", base_dir);
  if (spare && !spare_fits(spare, ram)) {
    sandbox_vm_ops.destroy(&spare->base); /* started for an older base */
    spare = NULL;
  }
  if (spare) {
    v = spare;
  } else {
    r = vm_start(VM_CLONE, vmb.accel, ram, NULL, &v, NULL, ret_err);
    if (r < 0)
      return r;
  }
  r = vm_restore(v, base_dir, ret_err);
  if (r == 0 && warm) {
    /* Run it once so TCG has translated the agent's path, then stop it. */
    r = qmp_command(v->qmp, "cont", NULL, QMP_TIMEOUT_MS, NULL, ret_err);
    if (r == 0)
      r = warm_clone(v->agent_fd, RESTORE_TIMEOUT_MS, ret_err);
    if (r == 0)
      r = qmp_command(v->qmp, "stop", NULL, QMP_TIMEOUT_MS, NULL, ret_err);
  }
  if (r < 0) {
    add_log_tail(v, ret_err);
    sandbox_vm_ops.destroy(&v->base);
    return r;
  }
  strcpy(v->path, "restore");
  *ret = v;
  return 0;
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
static void *pool_loop(void) {
  unsigned failures = 0;
  for (;;) {
    pthread_mutex_lock(&vmb.lock);
    while (!vmb.stopping && vmb.base_dir && vmb.n_ready >= cfg.pool &&
           vmb.n_spares >= cfg.spares)
      pthread_cond_wait(&vmb.cond, &vmb.lock);
    bool stopping = vmb.stopping;
    /* Copies: a call that finds the base gone may replace both meanwhile. */
    _cleanup_free_ char *base_dir = vmb.base_dir ? strdup(vmb.base_dir) : NULL;
    _cleanup_free_ char *base_fp = vmb.fingerprint ? strdup(vmb.fingerprint) : NULL;
    bool want_ready = vmb.n_ready < cfg.pool, want_spare = vmb.n_spares < cfg.spares;
    pthread_mutex_unlock(&vmb.lock);
    if (stopping || !base_dir)
      return NULL;

    /* Inputs changed under a running server (a rebuild), or the base went:
     * the base first.  A failure is retried only when due (remake_base);
     * until then the pool waits, a few seconds at a time, for a change. */
    _cleanup_free_ char *fp = make_fingerprint(vmb.accel);
    bool stale = !base_fp || strcmp(fp, base_fp) != 0;
    if (stale || !base_complete(base_dir)) {
      if (stale) {
        pthread_mutex_lock(&vmb.lock);
        drain_pool_locked();
      }
      _cleanup_free_ char *err = NULL;
      if (remake_base(stale ? NULL : base_dir, NULL, &err) < 0)
        pool_wait(5000);
      continue;
    }

    _cleanup_free_ char *err = NULL;
    struct vm *v = NULL;
    int r;
    if (want_ready) {
      r = new_clone(base_dir, true, &v, &err);
    } else if (want_spare) {
      _cleanup_free_ char *ram = xasprintf("%s/ram", base_dir);
      r = vm_start(VM_CLONE, vmb.accel, ram, NULL, &v, NULL, &err);
    } else {
      continue;
    }
    if (r < 0) {
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
      sandbox_vm_ops.destroy(&v->base);
      return NULL;
    }
    if (want_ready)
      push(&vmb.ready, &vmb.n_ready, v);
    else
      push(&vmb.spares, &vmb.n_spares, v);
    pthread_mutex_unlock(&vmb.lock);
    pthread_cond_broadcast(&vmb.cond);
  }
}

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

/* Sets the accelerator the backend uses (and says in its isolation). */
static void set_accel(const char *accel) {
  pthread_mutex_lock(&vmb.lock);
  vmb.accel = accel;
  snprintf(vmb.isolation, sizeof vmb.isolation, "microvm/%s", accel);
  pthread_mutex_unlock(&vmb.lock);
}

/* ensure_base, and under KVM in auto mode a fallback to TCG when the guest
 * does not run under KVM.  Only when it then runs under TCG is KVM to blame
 * (MARK: record that in the store, for the servers that come after); a guest
 * that fails under both is broken itself, and KVM stays.  A failure of the
 * store's is only that: KVM stays too. */
static int ensure_base_any_accel(bool force, bool mark, enum base_fault *ret_fault,
                                 char **ret_err) {
  int r = ensure_base(force, ret_fault, ret_err);
  if (r < 0 && *ret_fault == BASE_FAULT_GUEST && strcmp(vmb.accel, "kvm") == 0 &&
      strcmp(cfg.accel, "auto") == 0) {
    log_warn("the guest does not run under KVM (%s); trying TCG", *ret_err);
    _cleanup_free_ char *kvm_err = steal_ptr(*ret_err);
    set_accel("tcg");
    r = ensure_base(force, ret_fault, ret_err);
    if (r < 0) {
      char *both = xasprintf("under KVM: %s; under TCG too: %s", kvm_err, *ret_err);
      free(*ret_err);
      *ret_err = both;
      set_accel("kvm");
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

bool vm_qemu_ran(int status) {
  if (WIFSIGNALED(status))
    return true;
  return WIFEXITED(status) && (WEXITSTATUS(status) < VM_SPAWN_EXIT_MIN ||
                               WEXITSTATUS(status) > VM_SPAWN_EXIT_MAX);
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

static void *init_main(void *unused) {
  (void)unused;
  _cleanup_free_ char *err = NULL;
  int r = 0;
  enum base_fault fault = BASE_FAULT_STORE;
  bool cold_only = strcmp(cfg.base, "none") == 0;
  if (!cold_only)
    r = ensure_base_any_accel(false, true, &fault, &err);
  char *fp = r < 0 ? make_fingerprint(vmb.accel) : NULL;
  pthread_mutex_lock(&vmb.lock);
  vmb.init_done = true;
  if (r < 0) {
    vmb.init_error = steal_ptr(err);
    note_failure(fault, fp);
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
    r = ensure_base_any_accel(false, true, &fault, &err);
    fp = r < 0 ? make_fingerprint(vmb.accel) : NULL;
    pthread_mutex_lock(&vmb.lock);
    vmb.retry = false;
    vmb.attempts++;
    free(vmb.init_error);
    vmb.init_error = r < 0 ? steal_ptr(err) : NULL;
    if (r < 0)
      note_failure(fault, fp);
    pthread_cond_broadcast(&vmb.cond);
  }
  pthread_mutex_unlock(&vmb.lock);
  pthread_cond_broadcast(&vmb.cond);
  if (r == 0 && !cold_only)
    pool_loop();
  pthread_mutex_lock(&vmb.lock);
  vmb.pool_running = false;
  pthread_mutex_unlock(&vmb.lock);
  pthread_cond_broadcast(&vmb.cond);
  return NULL;
}

/* QEMUs of a root server run as unprivileged uids with the kvm group: they
 * can use /dev/kvm only if that group may read and write it. */
static bool kvm_reachable(char **ret_why, char **ret_fix) {
  if (getuid() != 0)
    return true;
  struct stat st;
  struct group *g = getgrnam("kvm");
  if (stat("/dev/kvm", &st) < 0)
    return false;
  if ((st.st_mode & 0006) == 0006 || (g && st.st_gid == g->gr_gid && (st.st_mode & 0060) == 0060))
    return true;
  *ret_why = xasprintf("/dev/kvm (mode %03o, gid %u) cannot be opened by the unprivileged QEMU "
                       "user: give it to group kvm with mode 0660 (Debian's udev rules do)",
                       st.st_mode & 0777, (unsigned)st.st_gid);
  *ret_fix = strdup(g ? "chgrp kvm /dev/kvm && chmod 0660 /dev/kvm"
                      : "groupadd --system kvm && chgrp kvm /dev/kvm && chmod 0660 /dev/kvm");
  return false;
}

/* The KVM probe runs once per process (the doctor and the backend ask the
 * same question), under this lock. */
static pthread_mutex_t probe_lock = PTHREAD_MUTEX_INITIALIZER;
static bool probe_ran;
static int probe_rc;
static struct vm_kvm_probe probe_res;
static char *probe_err;

bool vm_kvm_probe_last(struct vm_kvm_probe *ret, char **ret_err) {
  pthread_mutex_lock(&probe_lock);
  bool ran = probe_ran;
  if (ran && probe_rc == 0)
    *ret = probe_res;
  if (ran && probe_rc < 0 && ret_err)
    *ret_err = strdup(probe_err);
  pthread_mutex_unlock(&probe_lock);
  return ran && probe_rc == 0;
}

char *vm_kvm_probe_text(void) {
  struct vm_kvm_probe p;
  _cleanup_free_ char *err = NULL;
  if (!vm_kvm_probe_last(&p, &err))
    return err ? xasprintf("the KVM probe could not run: %s", err) : NULL;
  if (p.finished)
    return xasprintf("KVM probe: a guest in kernel mode ran %u loop iterations in %.2f ms (budget "
                     "%u ms; VM set up in %.2f ms)",
                     p.loops, p.run_ns / 1e6, p.budget_ms, p.setup_ns / 1e6);
  return xasprintf("KVM probe: a guest in kernel mode did not finish %u loop iterations in %u ms%s "
                   "(real KVM takes about 1 ms; VM set up in %.2f ms)",
                   p.loops, p.budget_ms, p.stuck ? ", and its vCPU did not come back when stopped" : "",
                   p.setup_ns / 1e6);
}

/* Why KVM does not help on this host (it runs guest kernel code far slower
 * than TCG would), or NULL when it does. */
static char *kvm_slow_why(char **ret_fix) {
  pthread_mutex_lock(&probe_lock);
  if (!probe_ran) {
    probe_rc = vm_kvm_probe(KVM_PROBE_LOOPS, KVM_PROBE_BUDGET_MS, &probe_res, &probe_err);
    probe_ran = true;
  }
  int rc = probe_rc;
  struct vm_kvm_probe p = probe_res;
  pthread_mutex_unlock(&probe_lock);
  if (rc == 0 && p.finished)
    return NULL;
  _cleanup_free_ char *text = vm_kvm_probe_text();
  *ret_fix = strdup("nothing to do: TCG is faster here (IGN_MCP_ACCEL=kvm would insist on KVM)");
  if (rc < 0)
    return xasprintf("KVM opens but cannot run a guest: %s", text);
  return xasprintf("KVM does not help on this host: %s, so guest kernels would run far slower "
                   "than under TCG (a paravirtual or nested hypervisor)",
                   text);
}

const char *vm_probe_accel(char **ret_why, char **ret_fix) {
  *ret_why = *ret_fix = NULL;
  if (strcmp(cfg.accel, "tcg") == 0) {
    *ret_why = strdup("IGN_MCP_ACCEL=tcg");
    return "tcg";
  }
  char *why = kvm_open_why(ret_fix);
  if (!why) {
    why = kvm_slow_why(ret_fix);
    /* IGN_MCP_ACCEL=kvm insists on a KVM that works, however slow. */
    if (why && strcmp(cfg.accel, "kvm") == 0) {
      log_warn("%s; using it anyway (IGN_MCP_ACCEL=kvm)", why);
      free(steal_ptr(why));
      free(steal_ptr(*ret_fix));
    }
  }
  if (!why)
    kvm_reachable(&why, ret_fix);
  /* A guest that failed under KVM once is not retried (IGN_MCP_ACCEL=kvm
   * insists). */
  _cleanup_free_ char *marker = xasprintf("%s/kvm-unusable", cfg.store);
  if (!why && strcmp(cfg.accel, "auto") == 0 && file_exists(marker)) {
    why = xasprintf("a guest did not boot under KVM on this host before (the marker %s says so)",
                    marker);
    *ret_fix = xasprintf("rm %s (to try KVM again)", marker);
  }
  if (!why)
    return "kvm";
  *ret_why = why;
  return strcmp(cfg.accel, "kvm") == 0 ? NULL : "tcg";
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
  int r = fs_mkdir_p(vmb.run_dir, 0711);
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
  if (make_store && (r = fs_mkdir_p(cfg.store, 0755)) < 0) {
    *ret_err = xasprintf("cannot create the store %s: %s (set IGN_MCP_STORE)", cfg.store,
                         strerror(-r));
    return r;
  }
  if ((r = pick_accel(ret_err)) < 0)
    return r;
  vmb.tsc_khz = host_tsc_khz();
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
  r = ensure_base_any_accel(force, false, &fault, ret_err);
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
      add_log_tail(v, ret_err);
      sandbox_vm_ops.destroy(&v->base);
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
    add_log_tail(v, ret_err);
  }
  agent_conn_free(conn);
  sandbox_vm_ops.destroy(&v->base);
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
  /* Let the pool thread finish (and destroy) the VM it may be making. */
  uint64_t deadline = mono_ms() + 5000;
  while (vmb.pool_running && mono_ms() < deadline) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, 20);
    pthread_cond_timedwait(&vmb.cond, &vmb.lock, &ts);
  }
  drain_pool_locked();
}

/* ---- sandbox ops ---- */

static int vm_create(const struct sandbox_config *sc, const char *session_id,
                     struct sandbox **ret, char **ret_err) {
  (void)sc;
  (void)session_id;
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
    _cleanup_free_ char *fp = make_fingerprint(vmb.accel);
    not_yet = retry_not_due(fp);
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
  struct vm *v = pop(&vmb.ready, &vmb.n_ready);
  _cleanup_free_ char *base_dir = vmb.base_dir ? strdup(vmb.base_dir) : NULL;
  pthread_mutex_unlock(&vmb.lock);
  pthread_cond_broadcast(&vmb.cond);

  int r;
  if (v) {
    strcpy(v->path, "pool");
  } else if (base_dir) {
    /* A clone must never start from a base whose inputs changed: the guest's
     * page cache in the RAM file describes the old disk image. */
    _cleanup_free_ char *fp = make_fingerprint(vmb.accel);
    pthread_mutex_lock(&vmb.lock);
    bool stale = strcmp(fp, vmb.fingerprint) != 0;
    pthread_mutex_unlock(&vmb.lock);
    if (stale) {
      free(steal_ptr(base_dir));
      if ((r = remake_base(NULL, &base_dir, ret_err)) < 0)
        return r;
    }
    r = new_clone(base_dir, false, &v, ret_err);
    if (r < 0)
      return r;
  } else {
    /* IGN_MCP_BASE=none: boot from scratch every time. */
    r = vm_start(VM_COLD, vmb.accel, NULL, NULL, &v, NULL, ret_err);
    if (r < 0)
      return r;
    strcpy(v->path, "cold");
  }
  if (strcmp(v->path, "cold") != 0) {
    uint64_t tc = mono_us();
    r = qmp_command(v->qmp, "cont", NULL, QMP_TIMEOUT_MS, NULL, ret_err);
    v->t_cont_us = mono_us() - tc;
    if (r < 0) {
      sandbox_vm_ops.destroy(&v->base);
      return r;
    }
  }
  v->base.isolation = vm_isolation();
  v->base.fd = steal_fd(v->agent_fd);
  snprintf(v->base.limits, sizeof v->base.limits, "memory %u MiB (guest RAM), overlay %u MiB%s",
           cfg.vm_memory_mb, guest_overlay_mb(),
           guest_overlay_mb() < cfg.overlay_mb ? " (at most half the guest RAM)" : "");
  if (strcmp(v->path, "pool") == 0)
    v->t_spawn_us = v->t_restore_us = 0; /* done before the call, not during it */
  *ret = &v->base;
  return 0;
}

static int vm_ready(struct sandbox *sb, struct agent_conn *conn, char **ret_err) {
  struct vm *v = (struct vm *)sb;
  uint8_t entropy[32];
  uint8_t idb[16];
  if (getrandom(entropy, sizeof entropy, 0) != sizeof entropy ||
      getrandom(idb, sizeof idb, 0) != sizeof idb) {
    *ret_err = strdup("getrandom failed");
    return -EIO;
  }
  char machine_id[33];
  for (int i = 0; i < 16; i++)
    snprintf(machine_id + 2 * i, 3, "%02x", idb[i]);
  _cleanup_free_ char *hostname = xasprintf("ign-%s", v->dir ? strrchr(v->dir, '/') + 1 : "vm");
  uint64_t t0 = mono_us();
  int r = agent_setup(conn, entropy, sizeof entropy, now_ns(CLOCK_REALTIME), hostname, machine_id,
                      ret_err);
  explicit_bzero(entropy, sizeof entropy);
  if (r < 0)
    return r;
  json_t *info = json_pack("{s:s, s:s, s:{s:f, s:f, s:f, s:f}}", "path", v->path, "accel",
                           vmb.accel, "phases_ms", "spawn", v->t_spawn_us / 1000.0, "restore",
                           v->t_restore_us / 1000.0, "cont", v->t_cont_us / 1000.0, "setup",
                           (mono_us() - t0) / 1000.0);
  sb->info = info;
  return 0;
}

static void vm_kill(struct sandbox *sb) { sandbox_proc_kill(&((struct vm *)sb)->proc); }

static void vm_destroy(struct sandbox *sb) {
  struct vm *v = (struct vm *)sb;
  sandbox_proc_kill_wait(&v->proc);
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
  json_decref(sb->info);
  sandbox_proc_fini(&v->proc);
  free(v);
}

/* The guest kernel's panic line in the VM's log ("Kernel panic - not
 * syncing: ..."), or NULL. */
static char *vm_log_panic(const struct vm *v) {
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

const struct sandbox_ops sandbox_vm_ops = {
    .name = "vm",
    .create = vm_create,
    .ready = vm_ready,
    .kill = vm_kill,
    .destroy = vm_destroy,
    .death_reason = vm_death_reason,
};
