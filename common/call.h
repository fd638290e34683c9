/* call.h: one tool call's context as the layer that runs the tools sees it:
 * who made the call, whether it was cancelled, and where its progress goes.
 * The protocol layer (mcp/server.c) embeds it in its own record of the
 * request (id, progress token, output) and fills it in; the tools use only
 * this, so they never depend on the protocol. */
#pragma once

#include <stdatomic.h>
#include <stdint.h>

/* What a call has done so far. */
struct call_progress {
  const char *message; /* the newest output line, or how much was copied */
  uint64_t elapsed_ms;
  /* bytes of stdout and stderr so far (a command), or copied and 0 (a copy) */
  uint64_t bytes, err_bytes;
};

struct call_ctx {
  /* Set when the client cancels the call or goes away; the call then ends
   * as soon as it can, and nothing more of it is sent. */
  atomic_bool cancelled;
  /* Who made the call: the name of the HTTP bearer token that authorised it
   * (IGN_MCP_HTTP_TOKENS), or "" on stdio and on HTTP without tokens.
   * Sessions and stages belong to the owner that made them. */
  const char *owner;
  /* Reports progress of the call (P->message may be NULL or ""); NULL when
   * nobody asked for its progress. */
  void (*progress)(struct call_ctx *ctx, const struct call_progress *p);
};

/* Who made the call (struct call_ctx.owner): its sessions and stages are the
 * only ones the call sees.  "" for a context that names none (a test's). */
static inline const char *call_owner(const struct call_ctx *ctx) {
  return ctx && ctx->owner ? ctx->owner : "";
}
