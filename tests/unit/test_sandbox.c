/* test_sandbox.c: the backends' pure rules (overlay size, when a failed
 * warm base is tried again, whether a failed QEMU ran). */
#include <signal.h>
#include <sys/wait.h>

#include "sandbox/sandbox.h"
#include "sandbox/vm.h"
#include "test.h"

static void overlay_at_most_half_the_memory(void) {
  CHECK_EQ_INT(sandbox_overlay_mb(1024, 256), 256);
  CHECK_EQ_INT(sandbox_overlay_mb(256, 256), 128);
  CHECK_EQ_INT(sandbox_overlay_mb(256, 128), 128);
  CHECK_EQ_INT(sandbox_overlay_mb(257, 200), 128);
  CHECK_EQ_INT(sandbox_overlay_mb(1, 64), 0);
  CHECK_EQ_INT(sandbox_overlay_mb(0, 64), 0);
}

static void base_retry_only_when_something_changed(void) {
  const uint64_t MiB = 1 << 20;
  struct vm_base_failure guest = {.at_ms = 1000, .store_fault = false, .store_free = 8 * MiB,
                                  .fingerprint = "qemu=a kernel=b"};
  /* The guest failed: the same inputs soon after are refused, whatever the store does. */
  CHECK(!vm_base_retry_due(&guest, 1000, 8 * MiB, "qemu=a kernel=b"));
  CHECK(!vm_base_retry_due(&guest, 1000 + VM_BASE_RETRY_MS - 1, 600 * MiB, "qemu=a kernel=b"));
  /* ... but new inputs, or enough time, make a try due. */
  CHECK(vm_base_retry_due(&guest, 2000, 8 * MiB, "qemu=a kernel=c"));
  CHECK(vm_base_retry_due(&guest, 1000 + VM_BASE_RETRY_MS, 8 * MiB, "qemu=a kernel=b"));
  /* The store's fault: a try is due once it has more room (not for noise). */
  struct vm_base_failure store = guest;
  store.store_fault = true;
  CHECK(!vm_base_retry_due(&store, 2000, 8 * MiB, "qemu=a kernel=b"));
  CHECK(!vm_base_retry_due(&store, 2000, 8 * MiB + 4096, "qemu=a kernel=b"));
  CHECK(!vm_base_retry_due(&store, 2000, 7 * MiB, "qemu=a kernel=b"));
  CHECK(vm_base_retry_due(&store, 2000, 600 * MiB, "qemu=a kernel=b"));
  CHECK(!vm_base_retry_due(&store, 2000, UINT64_MAX, "qemu=a kernel=b"));
  store.store_free = UINT64_MAX;
  CHECK(!vm_base_retry_due(&store, 2000, 600 * MiB, "qemu=a kernel=b"));
  /* No record of the inputs: try. */
  struct vm_base_failure none = {.at_ms = 1000};
  CHECK(vm_base_retry_due(&none, 1000, 8 * MiB, "qemu=a kernel=b"));
}

static void qemu_ran_only_past_its_spawn(void) {
  /* QEMU refused the guest or the accelerator (it exits 1), or died. */
  CHECK(vm_qemu_ran(W_EXITCODE(1, 0)));
  CHECK(vm_qemu_ran(W_EXITCODE(0, 0)));
  CHECK(vm_qemu_ran(W_EXITCODE(117, 0)));
  CHECK(vm_qemu_ran(W_EXITCODE(128, 0)));
  CHECK(vm_qemu_ran(SIGSYS)); /* seccomp */
  CHECK(vm_qemu_ran(SIGKILL));
  /* The spawn's child failed before QEMU ran: nothing about the guest. */
  CHECK(!vm_qemu_ran(W_EXITCODE(127, 0)));
  CHECK(!vm_qemu_ran(W_EXITCODE(118, 0)));
  CHECK(!vm_qemu_ran(W_EXITCODE(VM_SPAWN_EXIT_MAX, 0)));
  CHECK(!vm_qemu_ran(W_EXITCODE(VM_SPAWN_EXIT_MIN, 0)));
}

TEST_MAIN(TEST(overlay_at_most_half_the_memory), TEST(base_retry_only_when_something_changed),
          TEST(qemu_ran_only_past_its_spawn))
