/* tools.h: the MCP tools: their definitions (schemas, annotations) and
 * handlers, which check arguments and call into the session layer. */
#pragma once

#include <jansson.h>
#include <stdbool.h>

#include "common/call.h"

/* The array for tools/list (a new reference); LEGACY (2025-11-25 and
 * before) adds each tool's execution.taskSupport. */
json_t *tools_list(bool legacy);
/* Whether a call of tool NAME may run as a task (MCP Tasks), and the names
 * of those tools, for messages. */
bool tools_task_support(const char *name);
const char *tools_task_names(void);
bool tools_exists(const char *name);
/* Runs tool NAME; returns a CallToolResult object.  ARGS may be NULL. */
json_t *tools_call(const char *name, json_t *args, struct call_ctx *ctx);
/* About how many bytes a call of NAME with ARGS holds besides its request
 * while it runs: its result at the largest the arguments allow, its decoded
 * input.  The server's budget for calls in progress counts it. */
size_t tools_result_cost(const char *name, json_t *args);
