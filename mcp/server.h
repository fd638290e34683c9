/* server.h: the MCP side shared by the transports: where a request's
 * messages go (struct mcp_out) and the dispatch both transports feed.  The
 * tools see a call only as its struct call_ctx (common/call.h). */
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

enum {
  RPC_PARSE_ERROR = -32700,
  RPC_INVALID_REQUEST = -32600,
  RPC_METHOD_NOT_FOUND = -32601,
  RPC_INVALID_PARAMS = -32602,
  RPC_INTERNAL_ERROR = -32603,
  /* 2026-07-28: UnsupportedProtocolVersionError, data {supported, requested} */
  RPC_UNSUPPORTED_VERSION = -32022,
  /* 2026-07-28 Streamable HTTP: HeaderMismatch, a mirrored header is missing,
   * malformed or not what the body says */
  RPC_HEADER_MISMATCH = -32020,
};

/* Where the messages of one request go: stdout on stdio (one line each),
 * the request's own HTTP response on HTTP.  send() gets one whole encoded
 * JSON-RPC message: MSG as sent (borrowed: a response has no "method") and
 * encoded (TEXT, LEN bytes, with room for one more byte at TEXT[LEN]; send()
 * takes TEXT and frees it).  A response is the last message for its
 * request; the others are its notifications.  hold()
 * and release() (both NULL for an output that lives as long as the process)
 * count the users: a call thread holds its output until its response is
 * sent. */
struct mcp_out {
  void (*send)(struct mcp_out *o, json_t *msg, char *text, size_t len);
  void (*hold)(struct mcp_out *o);
  void (*release)(struct mcp_out *o);
};

/* One request as a transport hands it over. */
struct mcp_req {
  struct mcp_out *out;
  size_t bytes;      /* its size as received: counted against the call caps */
  const char *owner; /* see call_ctx.owner (common/call.h); never NULL */
  /* Which notifications/cancelled may reach the calls this request starts:
   * those sent in the same scope ("stdio" on stdio, the Mcp-Session-Id of
   * a legacy HTTP session).  NULL: none (a 2026-07-28 HTTP request, whose
   * client cancels by closing the connection). */
  const char *cancel_scope;
};

/* Sends one JSON-RPC message to OUT (thread-safe). Steals MSG. */
void mcp_send(struct mcp_out *out, json_t *msg);
/* Sends a JSON-RPC error (ID may be NULL) to OUT.  Steals DATA (may be NULL). */
void mcp_send_error(struct mcp_out *out, json_t *id, int code, const char *msg, json_t *data);

/* Whether a request is of the 2026-07-28 era: its params._meta carries an
 * io.modelcontextprotocol/ envelope key (or it is server/discover with any
 * _meta).  Otherwise it is served as 2025-11-25 and earlier. */
bool mcp_request_is_modern(const char *method, json_t *params);
/* Checks a modern request's _meta: 0, or the JSON-RPC error code to answer
 * with (-32602 malformed, -32022 unsupported version) and in *RET_MSG a
 * message to free, in *RET_DATA the error's data or NULL (the caller owns
 * it). */
int mcp_check_envelope(json_t *meta, char **ret_msg, json_t **ret_data);

/* Parses one message of LEN bytes (refusing one with more values than any
 * request needs, or with duplicate keys); NULL after sending the error to
 * OUT. */
json_t *mcp_parse(struct mcp_out *out, const char *s, size_t len);
/* Handles one parsed JSON-RPC message: its answers go to R->out. */
void mcp_handle_message(const struct mcp_req *r, json_t *msg);
/* Marks every call whose output is OUT cancelled (its client went away):
 * nothing more is sent for them. */
void mcp_cancel_out(struct mcp_out *out);
/* The versions served after initialize, newest first, and the modern one. */
bool mcp_legacy_version(const char *v);
#define MCP_MODERN_VERSION "2026-07-28"
/* The _meta key of a modern request's protocol version (both transports read it). */
#define MCP_META_VERSION "io.modelcontextprotocol/protocolVersion"

/* Reads stdin until EOF or a termination signal; returns the exit status. */
int mcp_serve(void);
/* Handles one message line as if read from stdin (used by the fuzzer). */
void mcp_handle_line(char *line, size_t len);
/* Waits up to TIMEOUT_MS for the tools/call threads still running (each
 * sends its answer before it ends); returns how many still run. */
unsigned mcp_wait_calls(uint64_t timeout_ms);
