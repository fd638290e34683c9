/* test_sandbox.c: the backends' pure rules (overlay size). */
#include "sandbox/sandbox.h"
#include "test.h"

static void overlay_at_most_half_the_memory(void) {
  CHECK_EQ_INT(sandbox_overlay_mb(1024, 256), 256);
  CHECK_EQ_INT(sandbox_overlay_mb(256, 256), 128);
  CHECK_EQ_INT(sandbox_overlay_mb(256, 128), 128);
  CHECK_EQ_INT(sandbox_overlay_mb(257, 200), 128);
  CHECK_EQ_INT(sandbox_overlay_mb(1, 64), 0);
  CHECK_EQ_INT(sandbox_overlay_mb(0, 64), 0);
}

TEST_MAIN(TEST(overlay_at_most_half_the_memory))
