/* store.c: the snapshots in IGN_MCP_STORE: the warm base (its
 * fingerprint, build, checksums, the store lock, space) and the file side
 * of a stage's snapshot. */
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

#include "common/fs.h"
#include "common/util.h"
#include "common/config.h"
#include "common/log.h"
#include "sandbox/vm/internal.h"
#include <xxhash.h>

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


/* What a base is made from, as text; its hash names the base directory. */
char *vm_fingerprint(const char *accel) {
  char buf[8192] = "";
  stat_part(buf, sizeof buf, "qemu", cfg.qemu);
  stat_part(buf, sizeof buf, "kernel", cfg.kernel);
  stat_part(buf, sizeof buf, "initramfs", cfg.initramfs);
  stat_part(buf, sizeof buf, "image", cfg.vm_image);
  size_t n = strlen(buf);
  snprintf(buf + n, sizeof buf - n, "mem=%u accel=%s tb=%d overlay=%u v=%d",
           cfg.vm_memory_mb, accel, TB_SIZE_MB, vm_guest_overlay_mb(), FINGERPRINT_VERSION);
  return strdup(buf);
}

uint64_t vm_fingerprint_hash(const char *fingerprint) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (const char *p = fingerprint; *p; p++)
    h = (h ^ (uint8_t)*p) * 1099511628211ull;
  return h;
}

char *vm_base_dir_for(const char *fingerprint) {
  return xasprintf("%s/%s-%016" PRIx64, cfg.store, cfg.base, vm_fingerprint_hash(fingerprint));
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
uint64_t vm_store_free(void) {
  struct statvfs sv;
  if (statvfs(cfg.store, &sv) < 0)
    return UINT64_MAX;
  return (uint64_t)sv.f_bavail * sv.f_frsize;
}

bool vm_base_complete(const char *dir) {
  _cleanup_free_ char *ram = xasprintf("%s/ram", dir);
  _cleanup_free_ char *state = xasprintf("%s/state", dir);
  _cleanup_free_ char *meta = xasprintf("%s/meta", dir);
  return file_exists(ram) && file_exists(state) && file_exists(meta);
}


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
  _cleanup_free_ char *final = vm_base_dir_for(fingerprint);
  _cleanup_free_ char *tmp = xasprintf("%s.tmp-%d", final, getpid());
  *ret_fault = BASE_FAULT_STORE;
  fs_remove_tree(tmp);
  int r = fs_mkdir_p(tmp, 0755, 0750);
  if (r < 0) {
    *ret_err = xasprintf("cannot create %s: %s (set IGN_MCP_STORE to a writable directory)", tmp,
                         strerror(-r));
    return r;
  }
  uint64_t t0 = mono_ms();
  uint64_t avail = vm_store_free(), need = base_space_needed();
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
    uint64_t left = vm_store_free();
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
  vm_free(v);
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

/* ---- a stage's files ---- */

int vm_stage_file_create(const char *path, uint64_t size, mode_t mode, int *ret_fd,
                         char **ret_err) {
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot create the stage file %s: %s", path, strerror(errno));
    return r;
  }
  /* Clones (other uids, group VM_GID) open the RAM file read-write and the
   * server reads the state for them: as the base's files. */
  if ((size && ftruncate(fd, (off_t)size) < 0) ||
      (getuid() == 0 && fchown(fd, 0, VM_GID) < 0) || fchmod(fd, mode) < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot size or hand over the stage file %s: %s%s", path, strerror(errno),
                         r == -ENOSPC || r == -EDQUOT ? " (the store is full: free space in it)"
                                                      : "");
    close(fd);
    unlink(path);
    return r;
  }
  *ret_fd = fd;
  return 0;
}

/* Whether the LEN bytes at P are all zero. */
static bool all_zero(const uint8_t *p, size_t len) {
  return len == 0 || (p[0] == 0 && memcmp(p, p + 1, len - 1) == 0);
}

int vm_punch_zero_pages(int fd, uint64_t *ret_punched, char **ret_err) {
  enum { PAGE = 4096, CHUNK = 1 << 20 };
  _cleanup_free_ uint8_t *buf = malloc(CHUNK);
  if (!buf) {
    *ret_err = strdup("out of memory to scan the stage's RAM file");
    return -ENOMEM;
  }
  struct stat st;
  if (fstat(fd, &st) < 0) {
    *ret_err = xasprintf("cannot stat the stage's RAM file: %s", strerror(errno));
    return -errno;
  }
  uint64_t punched = 0;
  off_t off = 0;
  /* Only the data the loader wrote is read: holes are zero already. */
  while (off < st.st_size) {
    off_t data = lseek(fd, off, SEEK_DATA);
    if (data < 0)
      break; /* ENXIO: no more data */
    off_t hole = lseek(fd, data, SEEK_HOLE);
    if (hole < 0)
      hole = st.st_size;
    for (off_t pos = data; pos < hole;) {
      size_t want = (size_t)(hole - pos < CHUNK ? hole - pos : CHUNK);
      ssize_t n = pread(fd, buf, want, pos);
      if (n < 0 && errno == EINTR)
        continue;
      if (n <= 0) {
        *ret_err = xasprintf("cannot read the stage's RAM file: %s",
                             n < 0 ? strerror(errno) : "it is shorter than it was");
        return n < 0 ? -errno : -EIO;
      }
      /* Runs of whole zero pages become holes. */
      size_t run_start = 0, run_len = 0;
      for (size_t i = 0; i + PAGE <= (size_t)n; i += PAGE) {
        bool zero = all_zero(buf + i, PAGE);
        if (zero && run_len == 0)
          run_start = i;
        if (zero)
          run_len += PAGE;
        if ((!zero || i + 2 * PAGE > (size_t)n) && run_len) {
          if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, pos + (off_t)run_start,
                        (off_t)run_len) == 0)
            punched += run_len;
          run_len = 0;
        }
      }
      pos += n;
    }
    off = hole;
  }
  *ret_punched = punched;
  return 0;
}
