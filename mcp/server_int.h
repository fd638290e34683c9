/* server_int.h: what the pieces of the MCP dispatch share (server.c, which
 * serves the requests, and envelope.c, which tells a 2026-07-28 request from
 * a legacy one and checks its _meta envelope): the envelope's keys, the
 * versions served after initialize and the NUL test of names.  Private to
 * the two. */
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <string.h>

#include "mcp/server.h"

/* The one modern revision: requests carry it in _meta, never in initialize. */
#define MODERN_VERSION MCP_MODERN_VERSION

#define META_VERSION MCP_META_VERSION
#define META_CAPS "io.modelcontextprotocol/clientCapabilities"
#define META_CLIENT "io.modelcontextprotocol/clientInfo"
#define META_LOG_LEVEL "io.modelcontextprotocol/logLevel"
#define META_SERVER "io.modelcontextprotocol/serverInfo"

/* A result for a modern request (resultType, the server's identity in
 * _meta, for a CACHEABLE list its cache hints).  Steals RESULT; NULL stays
 * NULL. */
json_t *mcp_modern_result(json_t *result, bool cacheable);

/* The versions served after initialize, newest first. */
extern const char *const mcp_supported_versions[4];

/* JSON strings may hold NUL (\u0000); a name compared with strcmp must not:
 * "ping\u0000x" is not "ping". */
static inline bool has_nul(json_t *s) {
  return strlen(json_string_value(s)) != json_string_length(s);
}
