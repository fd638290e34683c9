/* test_accel.c: the KVM probe (sandbox/accel.c) runs a real guest through
 * /dev/kvm: it reaches the guest's OUT when given time, and it comes back,
 * saying "not finished", when the loop outlasts its budget; it never hangs
 * its caller.  Skipped (and says so) where /dev/kvm does not open. */
#include <fcntl.h>
#include <unistd.h>

#include "sandbox/vm.h"
#include "test.h"

static bool kvm_opens(void) {
  int fd = open("/dev/kvm", O_RDWR | O_CLOEXEC);
  if (fd < 0)
    return false;
  close(fd);
  return true;
}

/* A loop of one iteration: the guest gets to its OUT, whatever the host. */
static void a_short_loop_finishes(void) {
  if (!kvm_opens()) {
    printf("  skip: /dev/kvm does not open for this user\n");
    return;
  }
  struct vm_kvm_probe p;
  char *err = NULL;
  CHECK_EQ_INT(vm_kvm_probe(1, 10000, &p, &err), 0);
  CHECK(p.finished);
  CHECK(!p.stuck);
  CHECK_EQ_INT(p.loops, 1);
  free(err);
}

/* Four billion iterations take seconds even on real KVM: the probe gives
 * up at its budget, kicks the vCPU out and says so. */
static void a_loop_over_budget_is_not_finished_and_returns(void) {
  if (!kvm_opens()) {
    printf("  skip: /dev/kvm does not open for this user\n");
    return;
  }
  struct vm_kvm_probe p;
  char *err = NULL;
  CHECK_EQ_INT(vm_kvm_probe(0xffffffffu, 20, &p, &err), 0);
  CHECK(!p.finished);
  CHECK(!p.stuck);
  CHECK_EQ_INT(p.budget_ms, 20);
  free(err);
}

/* Without /dev/kvm access the probe fails with the reason, not a verdict. */
static void no_kvm_is_an_error_with_the_reason(void) {
  if (kvm_opens())
    return;
  struct vm_kvm_probe p;
  char *err = NULL;
  CHECK(vm_kvm_probe(1, 100, &p, &err) < 0);
  CHECK(err && strstr(err, "/dev/kvm"));
  free(err);
}

TEST_MAIN(TEST(a_short_loop_finishes), TEST(a_loop_over_budget_is_not_finished_and_returns),
          TEST(no_kvm_is_an_error_with_the_reason))
