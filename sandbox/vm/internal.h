/* internal.h: what the vm backend's files share (sandbox/vm/): struct vm
 * (one QEMU), the backend's state, its timeouts, and the functions one file
 * offers the next.  The files form a chain, each using only those before
 * it: accel.c (does KVM help here) <- qemu.c (one QEMU: command line,
 * start, restore, logs) <- base.c (a warm base: fingerprint, making,
 * checksums) <- store.c (the bases in the store: its lock, the current
 * base, making it again) <- pool.c (ready clones and spares) <- vm.c (init,
 * the sandbox ops).  spawn.c, uid.c and qmp.c serve qemu.c; stagefile.c (a
 * stage's snapshot files) serves pool.c and vm.c.  The public side is
 * sandbox/vm.h. */
#pragma once

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>

#include "sandbox/vm.h"
#include "sandbox/vm/qmp.h"

#define QMP_TIMEOUT_MS 10000
/* How long a waiting loader QEMU has to answer before a snapshot uses it. */
#define LOADER_CHECK_MS 1000
#define COLD_BOOT_TIMEOUT_MS 90000
#define KVM_BOOT_TIMEOUT_MS 20000
#define RESTORE_TIMEOUT_MS 20000
#define BASE_WAIT_MS 180000
#define TB_SIZE_MB 128
/* 4: no guest has a network device any more (net= left the text).
 * 5: the TCG command line trusts the TSC (tsc=reliable). */
#define FINGERPRINT_VERSION 5
/* A snapshot of a running VM: its RAM streams at up to this rate (the
 * stream is a local socket), and the source is stopped for the last pages
 * only when they fit in this time. */
#define MIGRATE_MAX_BANDWIDTH (10ull << 30)
#define MIGRATE_DOWNTIME_MS 5
#define MIGRATE_TIMEOUT_MS 60000
/* How long a snapshot's stream may make no progress (the source is stopped). */
#define MIGRATE_STALL_MS 5000
/* How many passes over the dirty pages a live stream may take before its
 * source is stopped for the rest (a guest dirtying its pages faster than
 * they stream never converges; 3-8 passes were seen under TCG). */
#define MIGRATE_LIVE_PASSES 12
/* From this QEMU major version on, the source keeps running while its RAM
 * streams (pre-copy live migration, stopped only for the last dirty pages:
 * QEMU's downtime ~2-16 ms, paused ~10-60 ms with the cont on a loaded
 * host); an older QEMU is stopped for the whole stream (~0.4-0.9 s for
 * 256 MiB under TCG, seconds on a loaded host).  Measured under TCG
 * (docs/vm-recipe.md 5b): QEMU 7.2's live stream lost pages in 3 to 4
 * snapshots of 8 (guest panics, files with stale pages); with QEMU 10.0,
 * 39 of 40 snapshots checked by files were whole (the 40th's session
 * hung with nothing on its console, on a host at load 15) and all 30
 * checked page by page (tests/guest/pagecheck.c).  Versions in between
 * were not measured, so they stream stopped. */
#define SNAPSHOT_LIVE_QEMU 10

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
  uint64_t t_spawn_us, t_restore_us, t_cont_us, t_created_us;
  /* Who the guest is (its hostname and /etc/machine-id), made once per
   * clone: set in the guest as the pool fills it (identity_set), else by the
   * HELLO at hand-out.  ENTROPY: fresh bytes for that HELLO, wiped once the
   * agent answered. */
  char hostname[64], machine_id[33];
  bool identity_set;
  uint8_t entropy[32];
  /* QMP is spoken by one thread at a time (a snapshot runs on the calling
   * session's thread while others may ask about the VM). */
  pthread_mutex_t qmp_lock;
};
/* ---- helpers ---- */

static inline bool file_exists(const char *p) { return access(p, F_OK) == 0; }

/* The backend's state (vm.c). */
struct vm_state {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  bool init_done, stopping, pool_running;
  char *init_error;         /* why sessions cannot open, when they cannot */
  bool retry;               /* a session asks to try making the base again */
  unsigned attempts;        /* tries made after the first */
  struct vm_base_failure failure; /* the last try, when it failed */
  char *base_error;         /* why the last vm_remake_base failed, or NULL */
  const char *accel;        /* "kvm", "tcg" */
  char isolation[16];
  unsigned tsc_khz;
  char *run_dir;            /* per-VM state directories */
  char *fingerprint;
  char *base_dir;           /* the current base, or NULL */
  struct vm *ready, *spares;
  unsigned n_ready, n_spares;
  /* The clone the pool thread is filling: shutdown kills its QEMU, so that
   * the fill ends at once and the clone is destroyed before the server is. */
  struct vm *filling;
  unsigned seq;
  gid_t kvm_gid;
  int base_lock_fd;         /* shared flock on the base in use */
  struct vm_uids uids;      /* a root server's QEMU uids */
  /* A loader QEMU kept waiting for the next snapshot (its RAM file in the
   * store, v->ram), once a snapshot has been asked for. */
  struct vm *loader;
  bool want_loader;
  unsigned loader_seq;
};
extern struct vm_state vmb;

/* accel.c */
/* Sets the accelerator the backend uses (and says in its isolation). */
void vm_set_accel(const char *accel);

/* qemu.c */
/* GOLDEN: cold boot with its RAM file made (share=on), to save as a base.
 * CLONE: waits in -incoming defer, RAM mapped share=off from a snapshot.
 * COLD: boots with anonymous RAM.  LOADER: like a clone, but its RAM file
 * is mapped share=on (what it receives is written to the file) and it is
 * held with -S: it becomes a snapshot's RAM, never runs. */
enum vm_kind { VM_GOLDEN, VM_CLONE, VM_COLD, VM_LOADER };
unsigned vm_host_tsc_khz(void);
/* The guest's overlay is a tmpfs in guest RAM, which has no swap. */
unsigned vm_guest_overlay_mb(void);
/* Starts a QEMU of KIND.  RAM_FILE is the base's RAM (golden: created).  On
 * failure *RET_EXITED (when given) tells whether QEMU itself ran and exited
 * (it refused the guest or the accelerator), as opposed to never starting. */
int vm_start(enum vm_kind kind, const char *accel, const char *ram_file, const char *dir,
             struct vm **ret, bool *ret_exited, char **ret_err);
/* Loads a snapshot's state (DIR/state) into a clone waiting in -incoming defer. */
int vm_restore(struct vm *v, const char *base_dir, char **ret_err);
/* The same from the state file open as STATE_FD (taken: closed here). */
int vm_restore_fd(struct vm *v, int state_fd, char **ret_err);
/* Runs a clone once before the pool stops it: opens its agent connection
 * (v->base.conn) with a HELLO that sets its identity, and runs `true`. */
int vm_warm_clone(struct vm *v, uint32_t timeout_ms, char **ret_err);
/* vm.c: makes V's identity (hostname, machine id) and fills v->entropy with
 * fresh bytes: 0, or -EIO with *ret_err. */
int vm_new_identity(struct vm *v, char **ret_err);
int vm_fresh_entropy(struct vm *v, char **ret_err);
/* Streams SRC (running) live into LOADER (a VM_LOADER waiting): SRC's RAM
 * lands in LOADER's RAM file.  SRC is continued the moment the migration
 * completes, and runs again when it fails.  *RET_PAUSED_US: how long SRC was
 * stopped (an upper bound). */
int vm_migrate_live(struct vm *src, struct vm *loader, bool keep_stopped, uint64_t *ret_paused_us,
                    char **ret_err);
/* Continues SRC, left stopped by vm_migrate_live(KEEP_STOPPED). */
int vm_cont_migrated(struct vm *src, char **ret_err);
/* Writes V's device state (with x-ignore-shared: not its share=on RAM) to FD. */
int vm_save_state(struct vm *v, int fd, char **ret_err);
/* Ends *ERR with what QEMU last said, when it said anything. */
void vm_add_log_tail(struct vm *v, char **err);
char *vm_log_tail(const struct vm *v);
/* The guest kernel's panic line in the VM's log, or NULL. */
char *vm_log_panic(const struct vm *v);
/* Kills and reaps V's QEMU and frees everything of it, its state directory
 * too (unless v->dir was emptied). */
void vm_free(struct vm *v);

/* base.c */
/* Whose fault a failed attempt at the base is.  Only the guest's (it did not
 * boot, or could not be saved) says anything about the accelerator; the
 * store's (full, over quota, read-only, not writable, an I/O error) would fail
 * the same way under TCG, and must not make a server give up KVM for good. */
enum base_fault { BASE_FAULT_STORE, BASE_FAULT_GUEST };
/* What a base is made from, as text; its hash names the base directory. */
char *vm_fingerprint(const char *accel);
/* Its hash: the 16 hex digits that name the base directory. */
uint64_t vm_fingerprint_hash(const char *fingerprint);
char *vm_base_dir_for(const char *fingerprint);
/* Free bytes in the store, or UINT64_MAX when unknown. */
uint64_t vm_store_free(void);
bool vm_base_complete(const char *dir);
/* Checks DIR's files against the checksums in its meta; *RET_WHY says what
 * differs. */
int vm_base_verify(const char *dir, char **ret_why);
/* Builds the base for FINGERPRINT under ACCEL in a temporary directory of
 * the store, *RET_TMP (its files checksummed); on failure *RET_FAULT says
 * whose fault it is. */
int vm_base_build(const char *accel, const char *fingerprint, char **ret_tmp,
                  enum base_fault *ret_fault, char **ret_err);

/* store.c */
/* Records a failed try (under vmb.lock). */
void vm_note_failure(enum base_fault fault, char *fingerprint);
/* Why the last failed try is not followed by another one now, or NULL when
 * one is due; under vmb.lock. */
char *vm_retry_not_due(const char *fingerprint);
/* Makes the base again once sessions run (its inputs changed, or the base
 * at GONE lost its files); *RET_DIR (when given): the base to use now. */
int vm_remake_base(const char *gone, char **ret_dir, char **ret_err);
/* Makes sure the base exists, falling back from KVM to TCG when the guest
 * does not run under KVM (MARK: record that in the store). */
int vm_ensure_base_any_accel(bool force, bool mark, enum base_fault *ret_fault, char **ret_err);

/* stagefile.c */
/* Creates a stage's file at PATH (O_EXCL) of SIZE bytes (a hole), owned
 * as the base's files are (root: 0:VM_GID) with MODE; *RET_FD open
 * read-write. */
int vm_stage_file_create(const char *path, uint64_t size, mode_t mode, int *ret_fd,
                         char **ret_err);
/* Punches the zero 4 KiB pages of the RAM file FD out as holes (the file
 * keeps its size and content); *RET_PUNCHED: the bytes punched. */
int vm_punch_zero_pages(int fd, uint64_t *ret_punched, char **ret_err);
struct stage;
/* Refuses stage ST when its files (FDS: "ram", "state") are not whole: a
 * RAM file of another size than the guest's memory, an empty state. */
int vm_stage_files_check(const struct stage *st, const int fds[2], char **ret_err);

/* pool.c */
struct vm *vm_pop(struct vm **list, unsigned *n);
/* Empties the pool (called with vmb.lock, returns without it) and destroys
 * its VMs. */
void vm_drain_pool_locked(void);
/* A clone restored from BASE (a directory with ram and state), run once and
 * stopped when WARM. */
int vm_new_clone(const char *base, bool warm, struct vm **ret, char **ret_err);
/* The waiting loader (VM_LOADER, its RAM file at v->ram in the store, made
 * like a stage's), or NULL; asks the pool for the next one. */
struct vm *vm_take_loader(void);
/* Kills a loader and removes its RAM file (when still at v->ram). */
void vm_loader_free(struct vm *v);
/* Keeps the pool filled until shutdown. */
void *vm_pool_loop(void);
