/* result.h: shaping tool results (shared by tools.c and transfer.c): a
 * CallToolResult with structuredContent and the same JSON as text, errors as
 * text, and a finished command as the fields run and sandbox_run return. */
#pragma once

#include <jansson.h>

#include "proto/client.h"
#include "proto/proto.h"

/* run and sandbox_run */
#define DEFAULT_TIMEOUT_S 30
#define MAX_TIMEOUT_S 3600
#define MAX_ENV PROTO_MAX_ENV
/* The command, cwd and env of a run travel in one EXEC frame; with each at
 * its cap they still fit, so a run whose arguments pass their checks is never
 * refused later for its size. */
#define MAX_COMMAND (120u << 10)
_Static_assert(MAX_COMMAND + PROTO_MAX_PATH + PROTO_MAX_PAYLOAD / 2 + 6 * (PROTO_MAX_ENV + 4) <=
                   PROTO_MAX_PAYLOAD,
               "a run at every cap must fit in one frame");

json_t *text_block(const char *text);
/* Steals STRUCTURED. */
json_t *ok_result(json_t *structured);
/* MSG NULL: the out-of-memory sentence. */
json_t *err_result(const char *msg);
/* Frees MSG. */
json_t *err_result_free(char *msg);

/* agent_ctl.progress for a call's CTX. */
void on_progress(void *ctx, const char *last_line, uint64_t elapsed_ms, uint64_t bytes,
                 uint64_t err_bytes);
/* A call whose connection the host ended: the session cannot serve any more. */
char *conn_fault(const char *what_failed, const char *id, const char *why);
/* "SIGKILL", or "signal N" (malloc'd). */
char *signal_name(int sig);
/* {stdout, stderr, exit_code, timed_out, signal, duration_ms, *_bytes,
 * *_truncated} of RES (not freed), or NULL when out of memory. */
json_t *exec_result_json(const struct agent_exec_res *res);
