/* tasks.h: MCP Tasks: a tools/call that answers at once with a task id and
 * runs on, its result collected later by id (docs/mcp-tasks.md has the wire
 * shapes of both eras and where they were read).  server.c makes a task for
 * a call that asks for one (2025-11-25: params.task; 2026-07-28: the Tasks
 * extension declared in the request), runs the call as any other and hands
 * its result here; tasks.c keeps the table and answers tasks/get,
 * tasks/result, tasks/list, tasks/cancel and tasks/update.  Private to mcp/. */
#pragma once

#include <jansson.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "common/call.h"
#include "mcp/server.h"

/* 2026-07-28: the extension's name, and MissingRequiredClientCapability. */
#define TASKS_EXTENSION "io.modelcontextprotocol/tasks"
#define RPC_MISSING_CAPABILITY (-32021)

struct task;

/* Whether a modern request's _meta declares the Tasks extension. */
bool tasks_declared(json_t *params);
/* Checks a legacy params.task (present: not NULL) before anything runs: 0,
 * or a JSON-RPC error code and *ret_msg (malloc'd). */
int tasks_check_param(json_t *task, const char *tool, char **ret_msg);
/* Registers a task of OWNER for a call of TOOL with ARGS (its session_id is
 * kept: closing or resetting that session cancels the task).  TASK_PARAM is
 * the legacy params.task (its ttl is honoured up to IGN_MCP_TASK_TTL_S), or
 * NULL.  CANCELLED is the call's flag, set by tasks/cancel while the call
 * runs.  NULL with *ret_msg (malloc'd) past IGN_MCP_TASKS_MAX or the bytes
 * the tasks may hold. */
struct task *tasks_new(const char *owner, const char *tool, json_t *args, json_t *task_param,
                       bool modern, atomic_bool *cancelled, struct mcp_out *out, char **ret_msg);
/* The result that answers the tools/call that made T (legacy {task},
 * modern flat with resultType "task"). */
json_t *tasks_created(struct task *t, bool modern);
/* The call of T reports progress. */
void tasks_progress(struct task *t, const struct call_progress *p);
/* The call of T ended with RESULT (stolen; NULL: out of memory).  T's call
 * no longer exists after this. */
void tasks_finish(struct task *t, json_t *result);
/* Cancels the tasks of OWNER whose call names session SID, WHY saying why
 * ("was closed", "was reset"): sessions_set_on_end's hook. */
void tasks_cancel_session(const char *sid, const char *owner, const char *why);
/* Whether METHOD is a task method this era has; handles it if so. */
bool tasks_handle(const struct mcp_req *r, json_t *id, const char *method, json_t *params,
                  bool modern);
/* OUT's client went away: the tasks/result requests waiting on it are
 * dropped. */
void tasks_drop_out(struct mcp_out *out);
