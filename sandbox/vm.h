/* vm.h: the microVM backend's public side (session.c, doctor.c and the
 * tests use it).  The backend lives in sandbox/vm/: accel.c, qemu.c,
 * spawn.c, uid.c, qmp.c, base.c, store.c, stagefile.c, pool.c, vm.c; what
 * they share among themselves is in sandbox/vm/internal.h. */
#pragma once

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "sandbox/sandbox.h"

#define VM_SPAWN_BINDS 4

struct vm_spawn_req {
  const char *qemu;
  char *const *argv;
  const char *dir;               /* state directory: logs; the only writable place */
  const char *ram_file_writable; /* the golden RAM file (QEMU 7.2 opens it O_RDWR) */
  bool makes_ram_file;           /* the golden VM: its files are not limited to the log's size */
  const char *needed[4];         /* paths QEMU reads by their own name: never hidden */
  const char *hide;              /* hidden too: where the other QEMUs' state directories are */
  /* Files QEMU reads through its state directory: each SRC is bind-mounted
   * (read-only unless WRITABLE) onto DIR/NAME in QEMU's mount namespace, so
   * the unprivileged QEMU needs no access to the directories above them.
   * vm_spawn opens SRC first and QEMU gets that file or does not start
   * (a bind is made by name: the file's name then, its inode checked); SRC
   * may be /proc/self/fd/N of a file the caller holds open. */
  struct vm_bind {
    const char *src, *name;
    bool writable;
  } binds[VM_SPAWN_BINDS];
  int qmp_fd, agent_fd;          /* become fds 3 and 4 */
  uid_t uid;                     /* 0: keep the server's uid */
  gid_t gid, kvm_gid;
};

int vm_spawn(const struct vm_spawn_req *req, pid_t *ret_pid, char **ret_err);
/* vm_spawn's child exits with a code in this range when it fails before QEMU
 * runs, after writing which step failed to the VM's log. */
enum {
  VM_SPAWN_EXIT_MIN = 118,
  VM_SPAWN_EXIT_PROC = VM_SPAWN_EXIT_MIN, /* mounting QEMU's /proc */
  VM_SPAWN_EXIT_HIDE,     /* hiding /home, /root, /run/user; showing the state dir again */
  VM_SPAWN_EXIT_USERNS,   /* writing the user namespace's uid and gid maps */
  VM_SPAWN_EXIT_BIND,     /* private mounts, a bind mount into the state directory */
  VM_SPAWN_EXIT_FDS,      /* dup2, close_range */
  VM_SPAWN_EXIT_PARENT,   /* the server died before QEMU ran */
  VM_SPAWN_EXIT_LANDLOCK,
  VM_SPAWN_EXIT_NNP,
  VM_SPAWN_EXIT_UID,
  VM_SPAWN_EXIT_EXEC,     /* execve of QEMU */
  VM_SPAWN_EXIT_MAX = VM_SPAWN_EXIT_EXEC,
};
/* The uids of a root server's QEMUs (sandbox/vm/uid.c): VM_UID_BASE + n, n <
 * VM_UID_SPAN, group VM_GID. */
#define VM_UID_BASE 0x49474e00u
#define VM_UID_SPAN 4096u
#define VM_GID VM_UID_BASE
struct vm_uids {
  pthread_mutex_t lock;
  bool taken[VM_UID_SPAN];
  pid_t pid[VM_UID_SPAN];   /* the QEMU that has it; 0 while it is being started */
  unsigned next;
};
void vm_uids_init(struct vm_uids *u);
/* A uid no QEMU that is ALIVE (not yet reaped) has; -EAGAIN when all are. */
int vm_uid_alloc(struct vm_uids *u, bool (*alive)(uid_t uid, pid_t pid), uid_t *ret_uid);
/* UID's QEMU started as PID: the uid is free again once PID is reaped. */
void vm_uid_started(struct vm_uids *u, uid_t uid, pid_t pid);
/* UID's QEMU never started. */
void vm_uid_release(struct vm_uids *u, uid_t uid);
/* Whether a process PID exists (a zombie too) with real uid UID. */
bool vm_uid_process_alive(uid_t uid, pid_t pid);
/* Does KVM help here (sandbox/vm/accel.c): a tiny guest in long mode at ring 0 runs
 * LOOPS iterations of a countdown loop under KVM, given BUDGET_MS. */
#define KVM_PROBE_LOOPS 1000000u
#define KVM_PROBE_BUDGET_MS 100u
struct vm_kvm_probe {
  uint32_t loops;
  unsigned budget_ms;
  bool finished;            /* the loop ended within the budget */
  bool stuck;               /* the vCPU did not even come back when kicked */
  uint64_t run_ns;          /* the loop's time (the budget when it did not finish) */
  uint64_t setup_ns;        /* creating the VM and vCPU */
};
/* 0 and *RET, or a negative errno and *RET_ERR when KVM cannot even run
 * the probe (no /dev/kvm, no permission, an ioctl refused). */
int vm_kvm_probe(uint32_t loops, unsigned budget_ms, struct vm_kvm_probe *ret, char **ret_err);
/* The probe vm_probe_accel ran in this process: false when it did not run
 * (no /dev/kvm, say) or could not (then *RET_ERR, when given, says why). */
bool vm_kvm_probe_last(struct vm_kvm_probe *ret, char **ret_err);
/* What the probe measured, as a phrase, or NULL when it did not run. */
char *vm_kvm_probe_text(void);
/* Whether QEMUs are confined in a user namespace (the server is not root). */
bool vm_spawn_userns(void);
/* Whether a QEMU that ended with wait STATUS ran at all (it exited or was
 * killed), as opposed to its spawn failing first: only a QEMU that ran says
 * anything about the guest or the accelerator. */
bool vm_qemu_ran(int status);
bool vm_landlock_available(void);
/* Whether the configured QEMU maps a clone's RAM file (the warm base's or
 * a stage's) from a read-only file (QEMU 8.2 and later; asked once). */
bool vm_qemu_ram_readonly(void);

/* The backend's entry points, called by session.c. */
extern const struct sandbox_ops sandbox_vm_ops;
/* Checks QEMU and the images, picks the accelerator, makes sure the warm base
 * exists and matches (rebuilding it if not), starts the pool.  *ret_err
 * explains what is missing. */
int vm_backend_init(char **ret_err);
/* Builds (or rebuilds) the warm base and returns; for `ignition-mcp make-base`. */
int vm_make_base(bool force, char **ret_err);
/* Stops the pool and kills its QEMUs (shutdown). */
void vm_backend_shutdown(void);
/* "microvm/kvm" or "microvm/tcg" once initialised. */
const char *vm_isolation(void);

/* What `ignition-mcp doctor` asks; nothing here changes anything. */
/* Starts one QEMU as a session's is started (restored from the warm base
 * when it is there, else cold-booted) and has its agent run a command; *RET_HOW
 * says how and how long, *RET_ERR what failed.  A warm base that is there but
 * does not restore (damaged: sessions would make it again) is tried past with
 * a boot, and *RET_BASE_ERR says what was wrong with it (NULL otherwise). */
int vm_trial_session(char **ret_how, char **ret_base_err, char **ret_err);
/* The accelerator the backend would pick now: "kvm", or "tcg" with *ret_why
 * saying why not KVM (no /dev/kvm, no permission, QEMU's uid cannot reach it,
 * a guest failed under it before), or NULL when IGN_MCP_ACCEL=kvm cannot be
 * honoured.  *ret_fix, when set, is a command that may make KVM usable. */
const char *vm_probe_accel(char **ret_why, char **ret_fix);
/* The directory of the warm base that the current QEMU, images and settings
 * need under ACCEL; *ret_complete tells whether it is there and whole. */
char *vm_base_path(const char *accel, bool *ret_complete);
/* A failed attempt at making the warm base.  Another one is due only when
 * something may have changed since: the inputs (their fingerprint), the
 * store's free space after a failure of the store's (it grew by at least
 * 1 MiB), or VM_BASE_RETRY_MS passed.  Until then open_session gets the last
 * error at once, instead of the server cold-booting a guest (up to minutes
 * under TCG) that fails the same way on every call. */
#define VM_BASE_RETRY_MS 60000u
struct vm_base_failure {
  uint64_t at_ms;            /* when it ended (mono_ms) */
  bool store_fault;          /* the store's fault (full, not writable), not the guest's */
  uint64_t store_free;       /* the store's free bytes then (UINT64_MAX: unknown) */
  char *fingerprint;         /* what the base was to be made from */
};
bool vm_base_retry_due(const struct vm_base_failure *f, uint64_t now_ms, uint64_t store_free,
                       const char *fingerprint);
/* For a root server: every directory above PATH must let the QEMUs (other
 * uids) search it; -EACCES and *ret_err naming WHAT and the fix if not. */
int vm_check_reachable(const char *path, const char *what, char **ret_err);
