/* tools.h: the MCP tools: their definitions (schemas, annotations) and
 * handlers, which check arguments and call into the session layer. */
#pragma once

#include <jansson.h>
#include <stdbool.h>

#include "mcp/server.h"

/* The array for tools/list (a new reference). */
json_t *tools_list(void);
bool tools_exists(const char *name);
/* Runs tool NAME; returns a CallToolResult object.  ARGS may be NULL. */
json_t *tools_call(const char *name, json_t *args, struct call_ctx *ctx);
