/* test_tools.c: what the tool layer reserves for a call before it runs
 * (tools_result_cost), which the server's byte budget adds up. */
#include <jansson.h>

#include "mcp/config.h"
#include "test.h"
#include "tools/tools.h"

static size_t read_cost(json_t *args) {
  size_t c = tools_result_cost("read_file", args);
  json_decref(args);
  return c;
}

static void read_file_cost_follows_max_bytes_up_to_the_cap(void) {
  cfg.max_file = 64u << 20;
  /* The default piece is 1 MiB; a call may ask for up to 2 MiB, and is
   * charged for what it asked. */
  CHECK_EQ_INT(read_cost(json_pack("{s:s}", "path", "/f")), (1u << 20) * 6);
  CHECK_EQ_INT(read_cost(json_pack("{s:i}", "max_bytes", 4096)), 4096 * 6);
  CHECK_EQ_INT(read_cost(json_pack("{s:i}", "max_bytes", 2 << 20)), (2u << 20) * 6);
  CHECK_EQ_INT(read_cost(json_pack("{s:i}", "max_bytes", 3 << 20)), (2u << 20) * 6);
  /* A smaller IGN_MCP_MAX_FILE caps the piece. */
  cfg.max_file = 65536;
  CHECK_EQ_INT(read_cost(json_pack("{s:i}", "max_bytes", 2 << 20)), 65536 * 6);
  CHECK_EQ_INT(read_cost(json_pack("{s:s}", "path", "/f")), 65536 * 6);
}

TEST_MAIN(TEST(read_file_cost_follows_max_bytes_up_to_the_cap))
