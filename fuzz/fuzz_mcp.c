/* fuzz_mcp.c: bytes from the MCP client, the server's first parser.  The
 * input is a stdin stream: the line reader (framing.c) splits it with a small
 * cap, and every line goes through JSON-RPC validation and dispatch
 * (server.c), tools/call included: each call runs on its own thread against
 * the tool argument checks (tools/, args.c) and a session layer with no
 * backend, so open_session is refused and every session id is unknown.
 * Responses go to /dev/null. */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "common/config.h"
#include "fuzz/fuzz.h"
#include <string.h>

#include "common/log.h"
#include "mcp/framing.h"
#include "mcp/server.h"
#include "session/session.h"

/* Small, so that the oversize path is reached too. */
#define FUZZ_MAX_MESSAGE 4096

static void on_line(void *ctx, char *line, size_t len) {
  (void)ctx;
  mcp_handle_line(line, len);
}

/* The id scan of an oversized line is checked for what it hands on: a
 * NUL-terminated string of at most LINE_ID_MAX bytes. */
static void on_oversize(void *ctx, size_t len, const char *id_json) {
  (void)ctx;
  (void)len;
  if (id_json && strlen(id_json) > LINE_ID_MAX)
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_server_without_backend();
  int null = open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (null < 0 || dup2(null, STDOUT_FILENO) < 0)
    abort();
  close(null);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct line_reader lr;
  line_reader_init(&lr, FUZZ_MAX_MESSAGE);
  const struct line_sink sink = {.line = on_line, .oversize = on_oversize};
  /* Two reads, split where the first byte says, as a pipe might deliver. */
  size_t cut = size ? data[0] % (size + 1) : 0;
  if (line_reader_feed(&lr, (const char *)data, cut, &sink) == 0 &&
      line_reader_feed(&lr, (const char *)data + cut, size - cut, &sink) == 0)
    line_reader_finish(&lr, &sink);
  line_reader_free(&lr);
  mcp_wait_calls(60000);
  return 0;
}
