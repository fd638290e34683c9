/* test_vm_uid.c: a root server's QEMU uids are never shared by two live
 * QEMUs, however many spawns there were, and come free once a QEMU is gone. */
#include <stdlib.h>
#include <unistd.h>

#include "sandbox/vm.h"
#include "test.h"

/* The processes that exist in these tests: pid -> real uid (0: none). */
static uid_t proc_uid[1 << 16];

static bool fake_alive(uid_t uid, pid_t pid) { return pid > 0 && proc_uid[pid] == uid; }

static struct vm_uids uids;

static void every_uid_once_then_none(void) {
  memset(proc_uid, 0, sizeof proc_uid);
  vm_uids_init(&uids);
  static bool seen[VM_UID_SPAN];
  for (unsigned i = 0; i < VM_UID_SPAN; i++) {
    uid_t u;
    CHECK_EQ_INT(vm_uid_alloc(&uids, fake_alive, &u), 0);
    CHECK(u >= VM_UID_BASE && u < VM_UID_BASE + VM_UID_SPAN);
    CHECK(!seen[u - VM_UID_BASE]);
    seen[u - VM_UID_BASE] = true;
    pid_t pid = (pid_t)(100 + i);
    proc_uid[pid] = u;
    vm_uid_started(&uids, u, pid);
  }
  /* All 4,096 QEMUs live: no uid is handed out twice. */
  uid_t u;
  CHECK_EQ_INT(vm_uid_alloc(&uids, fake_alive, &u), -EAGAIN);
  /* One is reaped (its pid gone, or reused by a process of another uid):
   * exactly its uid comes free. */
  proc_uid[100 + 7] = 0;
  CHECK_EQ_INT(vm_uid_alloc(&uids, fake_alive, &u), 0);
  CHECK_EQ_INT(u, VM_UID_BASE + 7);
  vm_uid_started(&uids, u, 100 + 7);
  proc_uid[100 + 7] = 1000;
  CHECK_EQ_INT(vm_uid_alloc(&uids, fake_alive, &u), 0);
  CHECK_EQ_INT(u, VM_UID_BASE + 7);
  /* A uid being started (no pid yet) is taken. */
  CHECK_EQ_INT(vm_uid_alloc(&uids, fake_alive, &u), -EAGAIN);
  vm_uid_release(&uids, VM_UID_BASE + 7);
  CHECK_EQ_INT(vm_uid_alloc(&uids, fake_alive, &u), 0);
  CHECK_EQ_INT(u, VM_UID_BASE + 7);
}

/* A pool QEMU that lives through many thousand spawns of short-lived ones
 * keeps its uid to itself (a counter modulo 4,096 gave it away). */
static void a_long_lived_qemu_keeps_its_uid(void) {
  memset(proc_uid, 0, sizeof proc_uid);
  vm_uids_init(&uids);
  uid_t pool;
  CHECK_EQ_INT(vm_uid_alloc(&uids, fake_alive, &pool), 0);
  proc_uid[1] = pool;
  vm_uid_started(&uids, pool, 1);
  srand(1);
  enum { LIVE = 64 };
  pid_t live[LIVE] = {0};
  pid_t next_pid = 2;
  for (int spawn = 0; spawn < 20000; spawn++) {
    /* One of the 64 session QEMUs ends (and is reaped), a new one starts. */
    int k = rand() % LIVE;
    if (live[k]) {
      proc_uid[live[k]] = 0;
      live[k] = 0;
    }
    uid_t u;
    CHECK_EQ_INT(vm_uid_alloc(&uids, fake_alive, &u), 0);
    CHECK(u != pool);
    for (int i = 0; i < LIVE; i++)
      if (live[i] && proc_uid[live[i]] == u) {
        CHECK(!"a uid of a live QEMU was handed out again");
        i = LIVE;
      }
    /* Pids are reused, as the kernel's are, once their process is gone. */
    pid_t pid;
    do {
      pid = next_pid++;
      if (next_pid == (1 << 16))
        next_pid = 2;
    } while (proc_uid[pid]);
    proc_uid[pid] = u;
    vm_uid_started(&uids, u, pid);
    live[k] = pid;
  }
}

/* The server's real liveness check: this process is alive with its uid, not
 * with another, and a pid that does not exist is not alive. */
static void the_proc_check(void) {
  CHECK(vm_uid_process_alive(getuid(), getpid()));
  CHECK(!vm_uid_process_alive(getuid() + 1, getpid()));
  CHECK(!vm_uid_process_alive(getuid(), 0x3fffffff));
}

TEST_MAIN(TEST(every_uid_once_then_none), TEST(a_long_lived_qemu_keeps_its_uid),
          TEST(the_proc_check))
