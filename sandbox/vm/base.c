/* base.c: a warm base, the snapshot every session starts from unless it
 * names a stage: what it is made from (its fingerprint, whose hash names
 * its directory in the store), its making (a golden VM booted cold, its
 * page cache warmed, stopped and saved: the RAM file and the device state),
 * and the checksums of its files, written when it is made and checked the
 * first time a server uses it.  Which base is current, and sharing the
 * store with other servers, are store.c's. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/config.h"
#include "common/fs.h"
#include "common/log.h"
#include "common/util.h"
#include "sandbox/vm/internal.h"

/* ---- the fingerprint ---- */

static void stat_part(char *buf, size_t size, const char *name, const char *path) {
  struct stat st;
  size_t n = strlen(buf);
  if (path && stat(path, &st) == 0)
    snprintf(buf + n, size - n, "%s=%s:%lld:%lld.%09ld:%llu ", name, path, (long long)st.st_size,
             (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec, (unsigned long long)st.st_ino);
  else
    snprintf(buf + n, size - n, "%s=%s:missing ", name, path ? path : "");
}

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

/* ---- its files ---- */

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
int vm_base_verify(const char *dir, char **ret_why) {
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

/* ---- making one ---- */

/* Builds the base for FINGERPRINT in a temporary directory of the store and
 * returns its path; store.c puts it into place (ensure_base_locked). */
/* Boots of the warm base whose guest timer did not run, tried again. */
#define TIMER_TRIES 3
/* How long a 0.1 s sleep in the new guest may take before its timer is
 * taken for dead. */
#define TIMER_PROBE_MS 10000

/* Whether the guest's timer interrupts run: a short sleep must end.  A
 * guest whose local APIC timer was calibrated while the host starved its
 * vCPU thread can come up with that timer disabled ("APIC frequency too
 * slow") and, with no PIT on a microVM, no timer at all: nothing that
 * sleeps ever wakes, and every clone of it would inherit that. */
static bool guest_timer_runs(struct agent_conn *conn, char **ret_err) {
  struct agent_exec_req req = {.command = "sleep 0.1", .timeout_ms = TIMER_PROBE_MS, .out_cap = 256};
  struct agent_exec_res res;
  _cleanup_free_ char *err = NULL;
  int r = agent_exec(conn, &req, NULL, &res, &err);
  bool ok = r == 0 && !res.timed_out && res.exit_code == 0;
  if (r == 0)
    agent_exec_res_free(&res);
  if (!ok)
    *ret_err = xasprintf("the new guest's timer does not run: `sleep 0.1` did not end within %d "
                         "ms (%s)",
                         TIMER_PROBE_MS, r < 0 ? (err ? err : strerror(-r)) : "timed out");
  return ok;
}

/* Boots a new guest in TMP and saves it there as the warm base (its RAM
 * file and device state).  *RET_TIMER_DEAD: it failed because the guest's
 * timer did not run (worth booting again). */
static int base_boot(const char *accel, const char *tmp, bool *ret_timer_dead,
                     enum base_fault *ret_fault, char **ret_err) {
  *ret_timer_dead = false;
  *ret_fault = BASE_FAULT_STORE;
  fs_remove_tree(tmp);
  int r = fs_mkdir_p(tmp, 0755, 0750);
  if (r < 0) {
    *ret_err = xasprintf("cannot create %s: %s (set IGN_MCP_STORE to a writable directory)", tmp,
                         strerror(-r));
    return r;
  }
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
  if (r == 0 && !guest_timer_runs(conn, &err)) {
    *ret_timer_dead = true;
    r = -ETIME;
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
  rename(log_src, log_dst);
  return 0;
}

int vm_base_build(const char *accel, const char *fingerprint, char **ret_tmp,
                  enum base_fault *ret_fault, char **ret_err) {
  _cleanup_free_ char *final = vm_base_dir_for(fingerprint);
  _cleanup_free_ char *tmp = xasprintf("%s.tmp-%d", final, getpid());
  uint64_t t0 = mono_ms();
  int r;
  for (unsigned tries = 1;; tries++) {
    bool timer_dead;
    r = base_boot(accel, tmp, &timer_dead, ret_fault, ret_err);
    if (r == 0 || !timer_dead || tries == TIMER_TRIES)
      break;
    log_warn("%s; booting the warm base again (%u of %d)", *ret_err, tries + 1, TIMER_TRIES);
    free(steal_ptr(*ret_err));
  }
  if (r < 0)
    return r;
  _cleanup_free_ char *ram = xasprintf("%s/ram", tmp);
  _cleanup_free_ char *state = xasprintf("%s/state", tmp);
  /* From here on, every failure is the store's. */
  static const char *const mount_points[] = {"image", "kernel", "initramfs"};
  for (size_t i = 0; i < ARRAY_SIZE(mount_points); i++) {
    _cleanup_free_ char *mp = xasprintf("%s/%s", tmp, mount_points[i]);
    unlink(mp);
  }
  /* Clones (other uids, group VM_GID) read the state and open the RAM file:
   * read-only where QEMU maps it so (8.2 and later), else read-write (QEMU
   * 7.2 opens it so even for a private mapping); nobody else. */
  if (chown(tmp, 0, VM_GID) < 0 || chown(ram, 0, VM_GID) < 0 || chown(state, 0, VM_GID) < 0 ||
      chmod(ram, vm_qemu_ram_readonly() ? 0640 : 0660) < 0 || chmod(state, 0640) < 0 ||
      chmod(tmp, 0750) < 0) {
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
