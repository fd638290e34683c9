/* tools.c: the tools that work on sessions and stages (transfer.c has
 * sandbox_run, copy_in and copy_out).  Each handler checks its arguments against the
 * same rules its inputSchema states (and says exactly what was wrong and how
 * to fix it), takes a lease on the session, calls the agent, and shapes the
 * result as structuredContent plus the same JSON as text.  Nothing here knows
 * which backend serves the session. */
#include "tools/tools.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/runlog.h"
#include "common/util.h"
#include "egress/egress.h"
#include "sandbox/stage.h"
#include "session/session.h"
#include "tools/args.h"
#include "tools/result.h"
#include "tools/transfer.h"
#include "tools/trust.h"

#define DEFAULT_READ 1048576
/* A result carries the content twice (structuredContent and its JSON text):
 * 2 MiB of file stays under the 10 MiB message limit of common clients. */
#define MAX_READ_PIECE (2u << 20)

/* ---- handlers ---- */

static json_t *tool_open_session(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  const char *stage = NULL;
  if (args_check(args, "open_session",
                 (const char *[]){"stage", "network", "allow_hosts", "secrets", NULL}, &err) < 0 ||
      arg_string(args, "open_session", "stage", false, 0, ARG_MAX_PATH, &stage, NULL, &err) < 0)
    return err_result_free(err);
  struct egress *e = NULL;
  if (egress_new_secrets("open_session", json_object_get(args, "network"),
                         json_object_get(args, "allow_hosts"), json_object_get(args, "secrets"),
                         &e, &err) < 0)
    return err_result_free(err);
  json_t *info;
  if (session_open(call_owner(ctx), stage, e, &info, &err) < 0)
    return err_result_free(err);
  return ok_result(info);
}

/* O with resumed_ms when the call resumed its hibernated session (MS of
 * its lease, 0: it did not). */
static json_t *note_resumed(json_t *o, uint64_t ms) {
  if (o && ms)
    json_object_set_new(o, "resumed_ms", json_integer((json_int_t)ms));
  return o;
}

static json_t *tool_run(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  if (args_check(args, "run",
                 (const char *[]){"session_id", "command", "timeout_s", "cwd", "stdin", "stdin_file",
                                  "env", NULL},
                 &err) < 0)
    return err_result_free(err);
  const char *id, *command, *cwd = NULL, *in = NULL, *in_file = NULL;
  size_t in_len = 0;
  long long timeout_s = DEFAULT_TIMEOUT_S;
  if (arg_session_id(args, &id, &err) < 0 ||
      arg_string(args, "run", "command", true, 1, MAX_COMMAND, &command, NULL, &err) < 0 ||
      arg_int(args, "run", "timeout_s", 1, MAX_TIMEOUT_S, &timeout_s, &err) < 0 ||
      arg_string(args, "run", "cwd", false, 1, ARG_MAX_PATH, &cwd, NULL, &err) < 0 ||
      arg_stdin_file(args, "run", &in_file, &err) < 0 ||
      arg_stdin(args, "run", cfg.max_stdin, &in, &in_len, &err) < 0)
    return err_result_free(err);
  const char *env[MAX_ENV];
  _cleanup_free_ char *env_buf = NULL;
  size_t n_env = 0;
  if (arg_env(args, "run", env, MAX_ENV, &n_env, &env_buf, &err) < 0)
    return err_result_free(err);
  _cleanup_free_ void *in_owned = NULL;
  if (in_file) {
    if (stdin_file_load("run", in_file, &in_owned, &in_len, &err) < 0)
      return err_result_free(err);
    in = in_owned;
  }

  struct lease l;
  if (session_acquire(id, call_owner(ctx), &l, &err) < 0)
    return err_result_free(err);
  /* The placeholders of its secrets, and the CA they need. */
  char **trust = NULL;
  if (trust_env(&l, "run", env, &n_env, MAX_ENV, &trust, &err) < 0) {
    session_release(&l);
    return err_result_free(err);
  }
  /* The complete output, on the host; a run without logs still runs. */
  struct runlog *logs[2];
  _cleanup_free_ char *log_err = NULL;
  runlog_open_run(id, logs, &log_err);
  struct agent_exec_req req = {
      .command = command, .cwd = cwd, .env = env, .n_env = n_env,
      .timeout_ms = (uint32_t)timeout_s * 1000, .stdin_data = in, .stdin_len = in_len,
      .out_cap = cfg.output_cap, .on_output = runlog_tap, .output_ctx = logs,
  };
  struct agent_ctl ctl = {.cancelled = &ctx->cancelled,
                          .progress = ctx->progress ? on_progress : NULL, .ctx = ctx};
  struct agent_exec_res res;
  int r = agent_exec(lease_conn(&l), &req, &ctl, &res, &err);
  trust_env_free(trust);
  if (r < 0) {
    json_t *out;
    if (r == -EPIPE)
      out = err_result_free(lease_failure(&l, "run failed"));
    else if (r == -EPROTO)
      out = err_result_free(conn_fault("run failed", id, err));
    else if (r == -ECANCELED)
      out = err_result("the call was cancelled; the command was killed");
    else
      out = err_result_free(xasprintf("run failed in session '%s': %s", id,
                                      err ? err : strerror(-r)));
    free(err);
    session_release(&l);
    json_t *dropped = json_object();
    runlog_close_run(logs, log_err, dropped);
    json_decref(dropped);
    return out;
  }
  /* What the command tried to reach, since the previous run's report. */
  json_t *egress = lease_egress(&l) ? egress_report(lease_egress(&l), true) : NULL;
  const uint64_t resumed_ms = l.resumed_ms;
  session_release(&l);

  json_t *o = note_resumed(exec_result_json(&res), resumed_ms);
  agent_exec_res_free(&res);
  if (!o) {
    json_decref(egress);
    json_t *discard = json_object();
    runlog_close_run(logs, log_err, discard);
    json_decref(discard);
    return err_result("out of memory shaping the output; lower IGN_MCP_OUTPUT_CAP");
  }
  runlog_close_run(logs, log_err, o);
  if (egress)
    json_object_set_new(o, "egress", egress);
  return ok_result(o);
}

static json_t *tool_write_file(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  if (args_check(args, "write_file",
                 (const char *[]){"session_id", "path", "content_base64", "mode", NULL}, &err) < 0)
    return err_result_free(err);
  const char *id, *path, *b64;
  size_t b64_len;
  uint32_t mode = 0644;
  if (arg_session_id(args, &id, &err) < 0 ||
      arg_string(args, "write_file", "path", true, 1, ARG_MAX_WRITE_PATH, &path, NULL, &err) < 0 ||
      arg_string(args, "write_file", "content_base64", true, 0, SIZE_MAX, &b64, &b64_len, &err) < 0 ||
      arg_mode(args, &mode, &err) < 0)
    return err_result_free(err);
  if (b64_len / 4 * 3 > cfg.max_file + 3)
    return err_result_free(xasprintf("content_base64 decodes to about %zu bytes, over the %zu byte "
                                     "cap for one file (IGN_MCP_MAX_FILE); split the file and "
                                     "append the pieces with run, e.g. cat part2 >> file",
                                     b64_len / 4 * 3, cfg.max_file));
  size_t len;
  _cleanup_free_ uint8_t *data = NULL;
  if (base64_decode(b64, b64_len, &data, &len, &err) < 0)
    return err_result_free(err);
  if (len > cfg.max_file)
    return err_result_free(xasprintf("the file is %zu bytes, over the %zu byte cap for one file "
                                     "(IGN_MCP_MAX_FILE); split it into pieces",
                                     len, cfg.max_file));
  struct lease l;
  if (session_acquire(id, call_owner(ctx), &l, &err) < 0)
    return err_result_free(err);
  struct agent_ctl ctl = {.cancelled = &ctx->cancelled};
  int r = agent_write_file(lease_conn(&l), path, mode, data, len, &ctl, &err);
  json_t *out;
  if (r == -EPIPE)
    out = err_result_free(lease_failure(&l, "write_file failed"));
  else if (r == -EPROTO)
    out = err_result_free(conn_fault("write_file failed", id, err));
  else if (r == -ECANCELED)
    out = err_result("the call was cancelled; the upload was stopped");
  else if (r < 0)
    out = err_result_free(xasprintf("write_file failed: %s", err ? err : strerror(-r)));
  else
    out = ok_result(note_resumed(
        json_pack("{s:b, s:s, s:I}", "ok", 1, "path", path, "bytes", (json_int_t)len), l.resumed_ms));
  free(err);
  session_release(&l);
  return out;
}

static long long read_cap(void) {
  return cfg.max_file < MAX_READ_PIECE ? (long long)cfg.max_file : MAX_READ_PIECE;
}

static json_t *tool_read_file(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  if (args_check(args, "read_file",
                 (const char *[]){"session_id", "path", "offset", "max_bytes", NULL}, &err) < 0)
    return err_result_free(err);
  const char *id, *path;
  long long offset = 0, max = DEFAULT_READ < read_cap() ? DEFAULT_READ : read_cap();
  if (arg_session_id(args, &id, &err) < 0 || arg_path(args, "read_file", &path, &err) < 0 ||
      arg_int(args, "read_file", "offset", 0, INT64_MAX / 2, &offset, &err) < 0 ||
      arg_int(args, "read_file", "max_bytes", 1, read_cap(), &max, &err) < 0)
    return err_result_free(err);
  struct lease l;
  if (session_acquire(id, call_owner(ctx), &l, &err) < 0)
    return err_result_free(err);
  struct agent_ctl ctl = {.cancelled = &ctx->cancelled};
  void *data = NULL;
  size_t len = 0;
  uint64_t size = 0;
  bool eof = false;
  int r = agent_read_file(lease_conn(&l), path, (uint64_t)offset, (uint64_t)max, &ctl, &data, &len,
                          &size, &eof, &err);
  json_t *out;
  if (r == -EPIPE) {
    out = err_result_free(lease_failure(&l, "read_file failed"));
  } else if (r == -EPROTO) {
    out = err_result_free(conn_fault("read_file failed", id, err));
  } else if (r < 0) {
    out = err_result_free(xasprintf("read_file failed: %s", err ? err : strerror(-r)));
  } else {
    _cleanup_free_ char *b64 = base64_encode(data, len);
    out = b64 ? ok_result(note_resumed(json_pack("{s:s, s:I, s:I, s:b}", "content_base64", b64,
                                                 "bytes", (json_int_t)len, "size",
                                                 (json_int_t)size, "eof", eof),
                                       l.resumed_ms))
              : err_result("out of memory encoding the file; read it in smaller pieces");
  }
  free(data);
  free(err);
  session_release(&l);
  return out;
}

static json_t *tool_reset(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  const char *id, *stage = NULL;
  if (args_check(args, "reset", (const char *[]){"session_id", "stage", NULL}, &err) < 0 ||
      arg_session_id(args, &id, &err) < 0 ||
      arg_string(args, "reset", "stage", false, 0, ARG_MAX_PATH, &stage, NULL, &err) < 0)
    return err_result_free(err);
  json_t *info;
  if (session_reset(id, call_owner(ctx), stage, &info, &err) < 0)
    return err_result_free(err);
  json_object_set_new(info, "ok", json_true());
  return ok_result(info);
}

static json_t *tool_close(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  const char *id;
  if (args_check(args, "close", (const char *[]){"session_id", NULL}, &err) < 0 ||
      arg_session_id(args, &id, &err) < 0)
    return err_result_free(err);
  if (session_close(id, call_owner(ctx), &err) < 0)
    return err_result_free(err);
  return ok_result(json_pack("{s:b, s:s}", "ok", 1, "session_id", id));
}

static json_t *tool_hibernate(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  const char *id;
  if (args_check(args, "hibernate", (const char *[]){"session_id", NULL}, &err) < 0 ||
      arg_session_id(args, &id, &err) < 0)
    return err_result_free(err);
  json_t *info;
  if (session_hibernate(id, call_owner(ctx), &info, &err) < 0)
    return err_result_free(err);
  return ok_result(info);
}

static json_t *tool_list_sessions(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  if (args_check(args, "list_sessions", (const char *[]){NULL}, &err) < 0)
    return err_result_free(err);
  return ok_result(session_list(call_owner(ctx)));
}

static json_t *tool_network_log(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  const char *id;
  if (args_check(args, "network_log", (const char *[]){"session_id", NULL}, &err) < 0 ||
      arg_session_id(args, &id, &err) < 0)
    return err_result_free(err);
  struct lease l;
  if (session_acquire(id, call_owner(ctx), &l, &err) < 0)
    return err_result_free(err);
  json_t *rep = lease_egress(&l) ? egress_report(lease_egress(&l), false) : NULL;
  session_release(&l);
  return rep ? ok_result(rep) : err_result(NULL);
}

static json_t *tool_network_update(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  const char *id;
  if (args_check(args, "network_update",
                 (const char *[]){"session_id", "network", "allow_hosts", "secrets", NULL},
                 &err) < 0 ||
      arg_session_id(args, &id, &err) < 0)
    return err_result_free(err);
  struct lease l;
  if (session_acquire(id, call_owner(ctx), &l, &err) < 0)
    return err_result_free(err);
  json_t *info = NULL;
  int r = lease_egress(&l) ? egress_update(lease_egress(&l), json_object_get(args, "network"),
                                           json_object_get(args, "allow_hosts"),
                                           json_object_get(args, "secrets"), &info, &err)
                           : -ENOENT;
  session_release(&l);
  if (r == -ENOENT)
    return err_result("network_update: this session has no network policy to change");
  if (r < 0)
    return err_result_free(err);
  json_object_set_new(info, "session_id", json_string(id));
  return ok_result(info);
}

/* commit_stop.gave_up of a call: it was cancelled. */
static bool call_gave_up(void *ctx) { return atomic_load(&((struct call_ctx *)ctx)->cancelled); }

static json_t *tool_commit(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  const char *id, *name;
  bool replace = false;
  if (args_check(args, "commit", (const char *[]){"session_id", "name", "replace", NULL}, &err) < 0 ||
      arg_session_id(args, &id, &err) < 0 ||
      arg_string(args, "commit", "name", true, 0, ARG_MAX_PATH, &name, NULL, &err) < 0 ||
      arg_bool(args, "commit", "replace", &replace, &err) < 0)
    return err_result_free(err);
  json_t *info;
  /* A cancelled commit saves nothing, unless the stage was already in
   * place. */
  const struct commit_stop stop = {.gave_up = call_gave_up, .ctx = ctx};
  if (session_commit(id, call_owner(ctx), name, replace, &stop, &info, &err) < 0)
    return err_result_free(err);
  return ok_result(info);
}

static json_t *tool_fork(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  const char *id;
  long long count = 1;
  if (args_check(args, "fork", (const char *[]){"session_id", "count", NULL}, &err) < 0 ||
      arg_session_id(args, &id, &err) < 0 ||
      arg_int(args, "fork", "count", 1, SESSION_FORK_MAX, &count, &err) < 0)
    return err_result_free(err);
  json_t *info;
  if (session_fork(id, call_owner(ctx), (unsigned)count, &info, &err) < 0)
    return err_result_free(err);
  return ok_result(info);
}

static json_t *tool_stage_list(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  if (args_check(args, "stage_list", (const char *[]){NULL}, &err) < 0)
    return err_result_free(err);
  return ok_result(stage_list(call_owner(ctx)));
}

static json_t *tool_stage_info(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  const char *name;
  if (args_check(args, "stage_info", (const char *[]){"name", NULL}, &err) < 0 ||
      arg_string(args, "stage_info", "name", true, 0, ARG_MAX_PATH, &name, NULL, &err) < 0 ||
      stage_name_check(name, &err) < 0)
    return err_result_free(err);
  json_t *info;
  if (stage_info(name, call_owner(ctx), &info, &err) < 0)
    return err_result_free(err);
  return ok_result(info);
}

static json_t *tool_stage_rm(json_t *args, struct call_ctx *ctx) {
  char *err = NULL;
  const char *name;
  if (args_check(args, "stage_rm", (const char *[]){"name", NULL}, &err) < 0 ||
      arg_string(args, "stage_rm", "name", true, 0, ARG_MAX_PATH, &name, NULL, &err) < 0 ||
      stage_name_check(name, &err) < 0)
    return err_result_free(err);
  if (stage_rm(name, call_owner(ctx), &err) < 0)
    return err_result_free(err);
  return ok_result(json_pack("{s:b, s:s}", "ok", 1, "name", name));
}

/* ---- definitions ---- */

struct tool {
  const char *name;
  json_t *(*fn)(json_t *args, struct call_ctx *ctx);
};

static const struct tool tools[] = {
    {"open_session", tool_open_session}, {"run", tool_run},
    {"write_file", tool_write_file},     {"read_file", tool_read_file},
    {"reset", tool_reset},               {"close", tool_close},
    {"hibernate", tool_hibernate},
    {"list_sessions", tool_list_sessions}, {"commit", tool_commit},
    {"fork", tool_fork},                 {"stage_list", tool_stage_list},
    {"stage_info", tool_stage_info},     {"stage_rm", tool_stage_rm},
    {"sandbox_run", tool_sandbox_run},   {"copy_in", tool_copy_in},
    {"copy_out", tool_copy_out},         {"network_log", tool_network_log},
    {"network_update", tool_network_update},
};

bool tools_exists(const char *name) {
  for (size_t i = 0; i < ARRAY_SIZE(tools); i++)
    if (strcmp(tools[i].name, name) == 0)
      return true;
  return false;
}

json_t *tools_call(const char *name, json_t *args, struct call_ctx *ctx) {
  for (size_t i = 0; i < ARRAY_SIZE(tools); i++)
    if (strcmp(tools[i].name, name) == 0)
      return tools[i].fn(args, ctx);
  return err_result("unknown tool");
}

size_t tools_result_cost(const char *name, json_t *args) {
  if (strcmp(name, "read_file") == 0) {
    /* The content as base64, twice (text and structuredContent), then the
     * whole response once more as the line sent. */
    json_t *m = json_object_get(args, "max_bytes");
    long long max = DEFAULT_READ < read_cap() ? DEFAULT_READ : read_cap();
    /* Any max_bytes the call may be let through with (up to read_cap()),
     * not just the default's. */
    if (json_is_integer(m) && json_integer_value(m) > 0)
      max = json_integer_value(m) < read_cap() ? json_integer_value(m) : read_cap();
    return (size_t)max * 6;
  }
  if (strcmp(name, "run") == 0 || strcmp(name, "sandbox_run") == 0)
    /* Two streams kept to the cap, escaped in JSON up to 6 bytes per byte
     * (control characters), in the text and the structured copy. */
    return cfg.output_cap * 2 * 6 * 2;
  if (strcmp(name, "write_file") == 0) {
    /* The decoded content, besides the request that carried it. */
    json_t *c = json_object_get(args, "content_base64");
    return json_is_string(c) ? json_string_length(c) / 4 * 3 + 3 : 0;
  }
  return 0;
}

/* The tools whose calls may run as tasks: those that can take minutes. */
static const char *const task_tools[] = {"run", "sandbox_run", "commit", "fork", "copy_in",
                                         "copy_out"};

bool tools_task_support(const char *name) {
  for (size_t i = 0; i < ARRAY_SIZE(task_tools); i++)
    if (strcmp(name, task_tools[i]) == 0)
      return true;
  return false;
}

const char *tools_task_names(void) { return "run, sandbox_run, commit, fork, copy_in, copy_out"; }

json_t *tools_list(bool legacy) {
  json_t *list = tool_definitions(config_net_name(), cfg.output_cap, cfg.max_file,
                                  (size_t)read_cap());
  /* 2025-11-25 says per tool whether a call may be a task (absent means
   * forbidden: said anyway); the 2026-07-28 Tool has no such field. */
  size_t i;
  json_t *t;
  if (!legacy)
    return list;
  json_array_foreach(list, i, t) {
    const char *name = json_string_value(json_object_get(t, "name"));
    json_object_set_new(t, "execution",
                        json_pack("{s:s}", "taskSupport",
                                  name && tools_task_support(name) ? "optional" : "forbidden"));
  }
  return list;
}
