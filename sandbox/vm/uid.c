/* vm_uid.c: the uids a root server's QEMUs run as.
 *
 * Each QEMU of a root server runs as a uid of its own, VM_UID_BASE + slot,
 * so that one escaped QEMU cannot signal, trace or read another.  A uid is
 * therefore handed out only while no QEMU that had it is alive: a counter
 * taken modulo the range would give a pool QEMU that lived through 4,096
 * spawns' uid to a new one.  A slot is taken from its allocation until its
 * QEMU has been reaped; whether that has happened is asked of the caller's
 * ALIVE function (for the server: does /proc/PID exist with that real uid;
 * a zombie still does), so that no reaping path has to remember to give the
 * uid back.  Slots are tried round-robin, so a freed uid is reused as late
 * as possible. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "sandbox/vm.h"

void vm_uids_init(struct vm_uids *u) {
  memset(u, 0, sizeof *u);
  pthread_mutex_init(&u->lock, NULL);
}

static bool slot_taken(struct vm_uids *u, unsigned slot, bool (*alive)(uid_t, pid_t)) {
  if (!u->taken[slot])
    return false;
  /* Allocated and not yet started (pid 0): taken. */
  if (u->pid[slot] == 0 || alive(VM_UID_BASE + slot, u->pid[slot]))
    return true;
  u->taken[slot] = false;
  u->pid[slot] = 0;
  return false;
}

int vm_uid_alloc(struct vm_uids *u, bool (*alive)(uid_t uid, pid_t pid), uid_t *ret_uid) {
  pthread_mutex_lock(&u->lock);
  for (unsigned i = 0; i < VM_UID_SPAN; i++) {
    unsigned slot = (u->next + i) % VM_UID_SPAN;
    if (slot_taken(u, slot, alive))
      continue;
    u->taken[slot] = true;
    u->pid[slot] = 0;
    u->next = (slot + 1) % VM_UID_SPAN;
    pthread_mutex_unlock(&u->lock);
    *ret_uid = VM_UID_BASE + slot;
    return 0;
  }
  pthread_mutex_unlock(&u->lock);
  return -EAGAIN;
}

void vm_uid_started(struct vm_uids *u, uid_t uid, pid_t pid) {
  if (uid < VM_UID_BASE || uid >= VM_UID_BASE + VM_UID_SPAN)
    return;
  pthread_mutex_lock(&u->lock);
  u->pid[uid - VM_UID_BASE] = pid;
  pthread_mutex_unlock(&u->lock);
}

void vm_uid_release(struct vm_uids *u, uid_t uid) {
  if (uid < VM_UID_BASE || uid >= VM_UID_BASE + VM_UID_SPAN)
    return;
  pthread_mutex_lock(&u->lock);
  u->taken[uid - VM_UID_BASE] = false;
  u->pid[uid - VM_UID_BASE] = 0;
  pthread_mutex_unlock(&u->lock);
}

bool vm_uid_process_alive(uid_t uid, pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "re");
  if (!f)
    return errno != ENOENT && errno != ESRCH; /* cannot tell: keep it taken */
  bool same = false;
  unsigned real;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "Uid: %u", &real) == 1) {
      same = real == uid;
      break;
    }
  fclose(f);
  return same;
}
