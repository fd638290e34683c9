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
  /* Who made the call: the name of the HTTP bearer token that authorised it
   * (IGN_MCP_HTTP_TOKENS), or "" on stdio and on HTTP without tokens.  Never
   * NULL.  Sessions and stages belong to the owner that made them. */
  const char *owner;
};

/* Sends notifications/progress for CTX if it carries a token. */
void mcp_progress(struct call_ctx *ctx, const char *message);
/* Writes one JSON-RPC message as a line on stdout (thread-safe). Steals MSG. */
void mcp_send(json_t *msg);

/* Whether a request is of the 2026-07-28 era: its params._meta carries an
 * io.modelcontextprotocol/ envelope key (or it is server/discover with any
 * _meta).  Otherwise it is served as 2025-11-25 and earlier. */
bool mcp_request_is_modern(const char *method, json_t *params);
/* Checks a modern request's _meta: 0, or the JSON-RPC error code to answer
 * with (-32602 malformed, -32022 unsupported version) and in *RET_MSG a
 * message to free, in *RET_DATA the error's data or NULL (the caller owns
 * it). */
int mcp_check_envelope(json_t *meta, char **ret_msg, json_t **ret_data);

/* Reads stdin until EOF or a termination signal; returns the exit status. */
int mcp_serve(void);
/* Handles one message line as if read from stdin (used by the fuzzer). */
void mcp_handle_line(char *line, size_t len);
/* Waits up to TIMEOUT_MS for the tools/call threads still running (each
 * sends its answer before it ends); returns how many still run. */
unsigned mcp_wait_calls(uint64_t timeout_ms);
