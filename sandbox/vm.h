/* vm.h: the microVM backend's internals shared by its files:
 * vm.c (environment, warm base, pool, sandbox ops) and vm_spawn.c (starting
 * one confined QEMU). */
#pragma once

#include <stdbool.h>
#include <sys/types.h>

#include "sandbox/sandbox.h"

struct vm_spawn_req {
  const char *qemu;
  char *const *argv;
  const char *dir;               /* state directory: logs; the only writable place */
  const char *ram_file_writable; /* the golden RAM file (QEMU 7.2 opens it O_RDWR) */
  const char *needed[4];         /* paths QEMU reads by their own name: never hidden */
  /* Files QEMU reads through its state directory: each SRC is bind-mounted
   * (read-only unless WRITABLE) onto DIR/NAME in QEMU's mount namespace, so
   * the unprivileged QEMU needs no access to the directories above them. */
  struct vm_bind {
    const char *src, *name;
    bool writable;
  } binds[4];
  int qmp_fd, agent_fd;          /* become fds 3 and 4 */
  bool net;
  uid_t uid;                     /* 0: keep the server's uid */
  gid_t gid, kvm_gid;
};

int vm_spawn(const struct vm_spawn_req *req, pid_t *ret_pid, char **ret_err);
bool vm_landlock_available(void);

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
