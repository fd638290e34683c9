/* server.h: the MCP side shared with the tool handlers: one in-flight call's
 * context (cancellation, progress) and outgoing notifications. */
#pragma once

#include <jansson.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

struct call_ctx {
  atomic_bool cancelled;
  json_t *id;               /* the request id, echoed as received */
  json_t *progress_token;   /* NULL when the call asked for no progress */
  double progress;          /* last value sent; must increase */
};

/* Sends notifications/progress for CTX if it carries a token. */
void mcp_progress(struct call_ctx *ctx, const char *message);
/* Writes one JSON-RPC message as a line on stdout (thread-safe). Steals MSG. */
void mcp_send(json_t *msg);

/* Reads stdin until EOF or a termination signal; returns the exit status. */
int mcp_serve(void);
/* Handles one message line as if read from stdin (used by the fuzzer). */
void mcp_handle_line(char *line, size_t len);
/* Waits up to TIMEOUT_MS for the tools/call threads still running (each
 * sends its answer before it ends); returns how many still run. */
unsigned mcp_wait_calls(uint64_t timeout_ms);
