/* server.c: MCP over stdio: JSON-RPC 2.0 validation, lifecycle, dispatch,
 * cancellation, progress and logging notifications.
 *
 * Two protocol eras share one process, decided per request (MCP 2026-07-28,
 * basic/versioning, "dual-era server"): a request whose params._meta carries
 * the io.modelcontextprotocol/ envelope (protocol version, client
 * capabilities, client info) is modern and is served statelessly, no
 * initialize needed; anything else is legacy (2024-11-05 ... 2025-11-25),
 * served as before (envelope.c tells them apart and checks the modern
 * envelope).  The tools, their results, progress and cancellation are
 * the same in both; a modern result also carries resultType, the server's
 * identity in _meta and, for lists, cache hints.  Logging (deprecated in
 * 2026-07-28) is for legacy clients only.  docs/mcp-2026-07-28.md has the
 * wire shapes.
 *
 * The main thread only reads and dispatches; quick methods are answered
 * inline, every tools/call runs on a thread of its own, so a command that
 * runs for minutes never delays ping, another session or a cancellation.
 * Each call is registered by request id until it ends; a cancelled call sends
 * no response.  Every message goes to its request's own output (struct
 * mcp_out): on stdio one whole line at a time under a mutex (stdout carries
 * nothing but protocol messages), on HTTP the request's response (http.c).
 * The calls in progress and their caps are shared by both transports. */
#include "mcp/server.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "mcp/framing.h"
#include "mcp/server_int.h"
#include "mcp/tasks.h"
#include "proto/proto.h"
#include "session/session.h"
#include "tools/args.h"
#include "tools/tools.h"

#define LATEST_VERSION "2025-11-25"
/* How long a modern client may keep tools/list and server/discover (ttlMs):
 * both are fixed for the life of the process. */
#define LIST_TTL_MS 3600000
/* At shutdown, after every sandbox is gone (sessions_shutdown waits for
 * those still starting), the calls still running end at once with an error;
 * this bounds the wait for their answers should one not. */
#define SHUTDOWN_WAIT_MS 30000
/* Parsed JSON costs tens of bytes per value: a 64 MiB line of "1,1,1,..."
 * would take over a GiB.  No MCP message needs this many values; lines long
 * enough to hold more are counted before they are parsed. */
#define MAX_JSON_VALUES 100000

static const char instructions[] =
    "ignition-mcp gives you sandboxes to run code in, isolated from the user's machine.\n"
    "- Call open_session once and keep its session_id; a session is a whole machine of its own "
    "(Debian with python3, gcc, git, make, curl unless configured otherwise), with no network "
    "unless you ask open_session for one (network: \"allow\", allow_hosts: the hosts it needs); "
    "network_log shows what it tried to reach, network_update changes what it may (e.g. none "
    "again once dependencies are installed).\n"
    "- run executes one command as a fresh `sh -c`: the working directory, environment variables "
    "and shell variables do NOT carry over between runs (pass cwd and env each time, or chain "
    "with &&), but files you create DO persist for the life of the session.\n"
    "- Put files in with write_file (binary-safe, base64) and read them back with read_file "
    "(use offset and max_bytes for large files) rather than echo/cat.\n"
    "- Long output is cut to a head; stdout_bytes/stderr_bytes give the full sizes, so redirect "
    "large output to a file and read it in pieces.\n"
    "- reset wipes the session back to a clean machine under the same id; close it when done.";

static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t calls_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t calls_cond = PTHREAD_COND_INITIALIZER;
static bool stdout_broken;

/* One tools/call in flight: what the tools see of it (ctx) and what only
 * the protocol knows (its id, progress token, output). */
struct call {
  struct call *next;
  struct call_ctx ctx;
  json_t *id;             /* the request id, echoed as received */
  json_t *progress_token; /* NULL when the call asked for no progress */
  double progress;        /* last value sent; must increase */
  struct mcp_out *out;    /* where its progress and response go */
  char *tool;
  json_t *args;
  size_t bytes; /* its request line and tools_result_cost() */
  bool modern;  /* a 2026-07-28 request: its result is modern_result() */
  char *owner;  /* ctx.owner's copy */
  char *cancel_scope; /* mcp_req.cancel_scope's copy; NULL: none */
  /* A call that runs as a task: its result goes to the task, not to OUT,
   * and neither its client going away nor notifications/cancelled stop it
   * (tasks/cancel does). */
  struct task *task;
};
static struct call *calls;
static unsigned n_calls;
/* What the calls in progress hold, in bytes: their request lines and what
 * their results may take (tools_result_cost).  Calls past IGN_MCP_MAX_CALLS,
 * or past 4 x IGN_MCP_MAX_MESSAGE bytes together, are refused as busy, so a
 * client cannot make the server hold every request it sends, nor every
 * result it does not read. */
static size_t calls_bytes;
/* Calls whose result is being written: they no longer count against the
 * caps above (a client that has the result may send its next call at
 * once), but shutdown still waits for them.  They are bounded by the same
 * caps in their own right: while they are at the caps (the client is not
 * reading its results), no further request is read. */
static unsigned n_sending;
static size_t sending_bytes;
static void stdio_send(struct mcp_out *o, json_t *msg, char *s, size_t n) {
  (void)o, (void)msg;
  s[n] = '\n';
  pthread_mutex_lock(&out_lock);
  if (!stdout_broken && proto_write_all(1, s, n + 1) < 0)
    stdout_broken = true;
  pthread_mutex_unlock(&out_lock);
  free(s);
}

/* stdout: one output for every request, for the life of the process. */
static struct mcp_out stdio_out = {.send = stdio_send};

void mcp_send(struct mcp_out *out, json_t *msg) {
  /* Twelve significant digits: timings like 6.733 ms, not 6.7329999999999997. */
  char *s = msg ? json_dumps(msg, JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(12)) : NULL;
  if (!s) {
    json_decref(msg);
    log_error("cannot encode a response (out of memory)");
    return;
  }
  out->send(out, msg, s, strlen(s));
  json_decref(msg);
}

void mcp_send_error(struct mcp_out *out, json_t *id, int code, const char *msg, json_t *data) {
  /* A message quoting part of a name may have cut a UTF-8 character in two:
   * it goes out with U+FFFD there rather than not at all. */
  _cleanup_free_ char *clean = utf8_sanitize(msg, strlen(msg), NULL);
  json_t *m = json_pack("{s:s, s:O, s:{s:i, s:s}}", "jsonrpc", "2.0", "id",
                        id ? id : json_null(), "error", "code", code, "message",
                        clean ? clean : "out of memory");
  if (m && data)
    json_object_set_new(json_object_get(m, "error"), "data", data);
  else
    json_decref(data);
  mcp_send(out, m);
}

static void send_error(struct mcp_out *out, json_t *id, int code, const char *msg) {
  mcp_send_error(out, id, code, msg, NULL);
}

static void send_result(struct mcp_out *out, json_t *id, json_t *result) {
  /* Every request gets an answer, even when its result could not be built. */
  if (!result) {
    send_error(out, id, RPC_INTERNAL_ERROR,
               "the result could not be built (out of memory); try again");
    return;
  }
  mcp_send(out, json_pack("{s:s, s:O, s:o}", "jsonrpc", "2.0", "id", id, "result", result));
}

/* A result for a modern request: every result says resultType "complete"
 * (2026-07-28 has no other kind for our methods), names the server in
 * _meta, and a list (CACHEABLE) says how long it may be cached and by whom.
 * Steals RESULT; NULL stays NULL (send_result answers it as an error). */
json_t *mcp_modern_result(json_t *result, bool cacheable) {
  if (!result)
    return NULL;
  json_t *meta = json_object_get(result, "_meta");
  if (!json_is_object(meta)) {
    meta = json_object();
    json_object_set_new(result, "_meta", meta);
  }
  /* A created task says "task"; everything else is complete. */
  if ((!json_object_get(result, "resultType") &&
       json_object_set_new(result, "resultType", json_string("complete")) < 0) ||
      json_object_set_new(meta, META_SERVER,
                          json_pack("{s:s, s:s, s:s}", "name", "ignition-mcp", "version",
                                    IGN_VERSION, "title",
                                    "ignition-mcp: a sandbox per session")) < 0) {
    json_decref(result);
    return NULL;
  }
  if (cacheable && (json_object_set_new(result, "ttlMs", json_integer(LIST_TTL_MS)) < 0 ||
                    json_object_set_new(result, "cacheScope", json_string("public")) < 0)) {
    json_decref(result);
    return NULL;
  }
  return result;
}

static void send_reply(struct mcp_out *out, json_t *id, json_t *result, bool modern,
                       bool cacheable) {
  send_result(out, id, modern ? mcp_modern_result(result, cacheable) : result);
}

static void send_notification(struct mcp_out *out, const char *method, json_t *params) {
  mcp_send(out, json_pack("{s:s, s:s, s:o}", "jsonrpc", "2.0", "method", method, "params", params));
}

/* call_ctx.progress of a call that carries a progress token or runs as a
 * task: the task keeps it for tasks/get; notifications/progress go to a
 * client that asked (2026-07-28 has no progress on tasks; the progress
 * token of a 2025-11-25 task stays valid for the task's life). */
static void call_progress(struct call_ctx *ctx, const struct call_progress *pr) {
  struct call *c = (struct call *)((char *)ctx - offsetof(struct call, ctx));
  const char *message = pr->message;
  if (c->task)
    tasks_progress(c->task, pr);
  /* Nothing more is sent for a cancelled call (2026-07-28, transports/stdio:
   * MUST NOT; earlier revisions: SHOULD NOT). */
  if (!c->progress_token || !c->out || atomic_load(&ctx->cancelled) || (c->task && c->modern))
    return;
  c->progress += 1;
  json_t *p = json_pack("{s:O, s:f}", "progressToken", c->progress_token, "progress",
                        c->progress);
  if (message && *message) {
    json_t *m = json_string(message);
    if (m)
      json_object_set_new(p, "message", m);
  }
  send_notification(c->out, "notifications/progress", p);
}

static void log_sink(enum log_level l, const char *msg) {
  json_t *data = json_string(msg);
  if (!data)
    return;
  /* Logging is a legacy stdio feature: it never goes to an HTTP client. */
  send_notification(&stdio_out, "notifications/message", json_pack("{s:s, s:s, s:o}", "level",
                                                        log_level_name(l), "logger",
                                                        "ignition-mcp", "data", data));
}

/* ---- tools/call on its own thread ---- */

static void call_free(struct call *c) {
  if (c->out && c->out->release)
    c->out->release(c->out);
  free(c->owner);
  free(c->cancel_scope);
  json_decref(c->id);
  json_decref(c->progress_token);
  json_decref(c->args);
  free(c->tool);
  free(c);
}

static void *call_main(void *arg) {
  struct call *c = arg;
  json_t *result = tools_call(c->tool, c->args, &c->ctx);
  /* The call's share of the caps is given back before its result goes
   * out: a client that read the result and sends its next call at once
   * must not find this one still counted. */
  pthread_mutex_lock(&calls_lock);
  for (struct call **pp = &calls; *pp; pp = &(*pp)->next)
    if (*pp == c) {
      *pp = c->next;
      break;
    }
  n_calls--;
  calls_bytes -= c->bytes;
  n_sending++;
  sending_bytes += c->bytes;
  pthread_mutex_unlock(&calls_lock);
  if (c->task)
    tasks_finish(c->task, result);
  else if (!atomic_load(&c->ctx.cancelled))
    send_reply(c->out, c->id, result, c->modern, false);
  else
    json_decref(result);
  pthread_mutex_lock(&calls_lock);
  n_sending--;
  sending_bytes -= c->bytes;
  pthread_cond_broadcast(&calls_cond);
  pthread_mutex_unlock(&calls_lock);
  call_free(c);
  return NULL;
}

static void start_call(const struct mcp_req *r, json_t *id, json_t *params, bool modern) {
  struct mcp_out *out = r->out;
  json_t *name = json_object_get(params, "name");
  json_t *args = json_object_get(params, "arguments");
  if (!json_is_string(name)) {
    send_error(out, id, RPC_INVALID_PARAMS, "tools/call needs params.name, the tool's name (a string)");
    return;
  }
  if (has_nul(name)) {
    send_error(out, id, RPC_INVALID_PARAMS, "tools/call params.name contains a NUL character; "
                                       "tools/list shows the tools");
    return;
  }
  if (!tools_exists(json_string_value(name))) {
    _cleanup_free_ char *msg = xasprintf("unknown tool '%.100s'; tools/list shows the tools",
                                         json_string_value(name));
    send_error(out, id, RPC_INVALID_PARAMS, msg);
    return;
  }
  if (args && !json_is_object(args) && !json_is_null(args)) {
    send_error(out, id, RPC_INVALID_PARAMS, "tools/call params.arguments must be an object");
    return;
  }
  /* A task: asked for with params.task (2025-11-25), or for any tool that
   * can be one when the request declares the Tasks extension (2026-07-28:
   * the server decides; params.task means nothing there). */
  json_t *task_param = modern ? NULL : json_object_get(params, "task");
  if (json_is_null(task_param))
    task_param = NULL;
  if (task_param) {
    _cleanup_free_ char *msg = NULL;
    int code = tasks_check_param(task_param, json_string_value(name), &msg);
    if (code) {
      send_error(out, id, code, msg ? msg : "out of memory");
      return;
    }
  }
  bool as_task = task_param || (modern && tasks_declared(params) &&
                                tools_task_support(json_string_value(name)));
  size_t budget = cfg.max_message * 4;
  size_t cost = r->bytes + tools_result_cost(json_string_value(name), args);
  pthread_mutex_lock(&calls_lock);
  /* Results the client has not read yet: wait for it to read them rather
   * than hold more (it is not refused, as a client that just read a result
   * may find that result's send not yet counted out). */
  while (n_sending > 0 && (n_sending >= cfg.max_calls || sending_bytes + cost > budget)) {
    /* A shutdown signal (blocked, for the main loop's signalfd) must still
     * be taken: the call goes ahead and the loop then sees the signal. */
    sigset_t pending;
    if (sigpending(&pending) == 0 && (sigismember(&pending, SIGTERM) ||
                                      sigismember(&pending, SIGINT) ||
                                      sigismember(&pending, SIGHUP)))
      break;
    struct timespec ts = timespec_in(CLOCK_REALTIME, 50);
    pthread_cond_timedwait(&calls_cond, &calls_lock, &ts);
  }
  /* A call alone is always let in: the budget bounds calls together. */
  bool busy = n_calls >= cfg.max_calls || (n_calls > 0 && calls_bytes + cost > budget);
  unsigned busy_calls = n_calls;
  size_t busy_bytes = calls_bytes;
  pthread_mutex_unlock(&calls_lock);
  if (busy) {
    _cleanup_free_ char *msg = xasprintf(
        "server busy: %u calls in progress hold %zu bytes of requests and results, and this one "
        "may take %zu (at most %u calls and %zu bytes, IGN_MCP_MAX_CALLS and 4 x "
        "IGN_MCP_MAX_MESSAGE); wait for a call to finish, then retry",
        busy_calls, busy_bytes, cost, cfg.max_calls, budget);
    log_warn("%s", msg);
    /* A legacy client that asked for a task expects a task or an error. */
    if (task_param)
      send_error(out, id, RPC_INTERNAL_ERROR, msg);
    else
      send_reply(out, id, json_pack("{s:[{s:s, s:s}], s:b}", "content", "type", "text", "text",
                                    msg, "isError", 1),
                 modern, false);
    return;
  }
  struct call *c = calloc(1, sizeof *c);
  if (!c) {
    send_error(out, id, RPC_INTERNAL_ERROR, "out of memory");
    return;
  }
  c->bytes = cost;
  c->modern = modern;
  c->id = json_incref(id);
  c->owner = strdup(r->owner);
  c->cancel_scope = r->cancel_scope ? strdup(r->cancel_scope) : NULL;
  c->ctx.owner = c->owner ? c->owner : "";
  c->out = out;
  if (out->hold)
    out->hold(out);
  json_t *meta = json_object_get(params, "_meta");
  json_t *token = meta ? json_object_get(meta, "progressToken") : NULL;
  if (token && (json_is_string(token) || json_is_integer(token))) {
    c->progress_token = json_incref(token);
    c->ctx.progress = call_progress;
  }
  c->tool = strdup(json_string_value(name));
  c->args = json_is_object(args) ? json_incref(args) : NULL;
  if (as_task) {
    _cleanup_free_ char *msg = NULL;
    c->task = c->tool ? tasks_new(c->ctx.owner, c->tool, c->args, task_param, modern,
                                  &c->ctx.cancelled, out, &msg)
                      : NULL;
    const char *why = msg ? msg : "out of memory for a task; try again";
    if (!c->task && !modern) {
      log_warn("%s", why);
      send_error(out, id, RPC_INTERNAL_ERROR, why);
      call_free(c);
      return;
    }
    /* 2026-07-28: the server decides, so past the caps the call is simply
     * answered when it ends, as without the extension. */
    if (!c->task)
      log_info("%s: %s answered without a task", why, c->tool);
  }
  if (c->task) {
    c->ctx.progress = call_progress;
    /* Answered before the call starts: its id resolves from now on, and
     * nothing of the call can go out before it. */
    send_reply(out, id, tasks_created(c->task, modern), modern, false);
  }

  pthread_mutex_lock(&calls_lock);
  c->next = calls;
  calls = c;
  n_calls++;
  calls_bytes += c->bytes;
  pthread_mutex_unlock(&calls_lock);

  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int err = pthread_create(&t, &attr, call_main, c);
  pthread_attr_destroy(&attr);
  if (err != 0) {
    pthread_mutex_lock(&calls_lock);
    /* Not necessarily the head: HTTP connections start calls concurrently. */
    for (struct call **pp = &calls; *pp; pp = &(*pp)->next)
      if (*pp == c) {
        *pp = c->next;
        break;
      }
    n_calls--;
    calls_bytes -= c->bytes;
    pthread_mutex_unlock(&calls_lock);
    if (c->task)
      tasks_finish(c->task, json_pack("{s:[{s:s, s:s}], s:b}", "content", "type", "text", "text",
                                      "cannot start a thread for this call; try again", "isError",
                                      1));
    else
      send_error(out, id, RPC_INTERNAL_ERROR, "cannot start a thread for this call; try again");
    call_free(c);
  }
}

/* notifications/cancelled: the calls of that id made by the same owner in
 * the same scope (request ids are the client's own: two HTTP clients of one
 * token may both have an id 1). */
static void cancel_call(json_t *params, const char *owner, const char *scope) {
  json_t *rid = json_object_get(params, "requestId");
  if (!rid || !scope)
    return;
  pthread_mutex_lock(&calls_lock);
  for (struct call *c = calls; c; c = c->next)
    if (!c->task && json_equal(c->id, rid) && strcmp(c->ctx.owner, owner) == 0 && c->cancel_scope &&
        strcmp(c->cancel_scope, scope) == 0) {
      atomic_store(&c->ctx.cancelled, true);
      log_info("call %s cancelled by the client", c->tool);
    }
  pthread_mutex_unlock(&calls_lock);
}

void mcp_cancel_out(struct mcp_out *out) {
  pthread_mutex_lock(&calls_lock);
  for (struct call *c = calls; c; c = c->next)
    if (c->out == out && !c->task && !atomic_exchange(&c->ctx.cancelled, true))
      log_info("call %s cancelled: its client closed the connection", c->tool);
  pthread_mutex_unlock(&calls_lock);
  /* A task outlives its connection; a tasks/result waiting on it does not. */
  tasks_drop_out(out);
}

/* ---- methods ---- */

static void do_initialize(struct mcp_out *out, json_t *id, json_t *params) {
  json_t *v = json_object_get(params, "protocolVersion");
  const char *version = LATEST_VERSION;
  if (json_is_string(v) && !has_nul(v))
    for (size_t i = 0; i < ARRAY_SIZE(mcp_supported_versions); i++)
      if (strcmp(json_string_value(v), mcp_supported_versions[i]) == 0)
        version = mcp_supported_versions[i];
  json_t *res = json_pack("{s:s, s:{s:{s:b}, s:{}}, s:{s:s, s:s, s:s}, s:s}", "protocolVersion",
                           version, "capabilities", "tools", "listChanged", 0, "logging",
                           "serverInfo", "name", "ignition-mcp", "version", IGN_VERSION, "title",
                           "ignition-mcp: a sandbox per session", "instructions", instructions);
  /* Tasks came with 2025-11-25: older clients are not told of them. */
  if (res && strcmp(version, LATEST_VERSION) == 0)
    json_object_set_new(json_object_get(res, "capabilities"), "tasks",
                        json_pack("{s:{}, s:{}, s:{s:{s:{}}}}", "list", "cancel", "requests",
                                  "tools", "call"));
  send_result(out, id, res);
}

static void do_set_level(struct mcp_out *out, json_t *id, json_t *params) {
  json_t *l = json_object_get(params, "level");
  int level = json_is_string(l) && !has_nul(l) ? log_level_parse(json_string_value(l)) : -1;
  if (level < 0) {
    send_error(out, id, RPC_INVALID_PARAMS, "logging/setLevel needs params.level, one of debug, info, "
                                       "notice, warning, error, critical, alert, emergency");
    return;
  }
  log_set_client_level((enum log_level)level);
  send_result(out, id, json_object());
}

/* ---- the 2026-07-28 era ---- */

static json_t *discover_result(void) {
  /* No logging capability: logging is deprecated in 2026-07-28 and this
   * server keeps it for legacy clients only. */
  return json_pack("{s:[s], s:{s:{s:b}, s:{s:{}}}, s:s}", "supportedVersions", MODERN_VERSION,
                   "capabilities", "tools", "listChanged", 0, "extensions", TASKS_EXTENSION,
                   "instructions", instructions);
}

/* A modern request: its envelope decides whether it is served at all; the
 * methods are those of 2026-07-28 that this server has. */
static void handle_modern(const struct mcp_req *r, json_t *id, const char *m, json_t *params) {
  struct mcp_out *out = r->out;
  json_t *data = NULL;
  _cleanup_free_ char *msg = NULL;
  int code = mcp_check_envelope(json_object_get(params, "_meta"), &msg, &data);
  if (code) {
    log_info("refused a %.100s request: %s", m, msg);
    mcp_send_error(out, id, code, msg, data);
    return;
  }
  if (strcmp(m, "server/discover") == 0)
    send_reply(out, id, discover_result(), true, true);
  else if (strcmp(m, "tools/list") == 0)
    send_reply(out, id, json_pack("{s:o}", "tools", tools_list(false)), true, true);
  else if (strcmp(m, "tools/call") == 0)
    start_call(r, id, params, true);
  else if (!tasks_handle(r, id, m, params, true)) {
    bool removed = strcmp(m, "initialize") == 0 || strcmp(m, "ping") == 0 ||
                   strcmp(m, "logging/setLevel") == 0;
    _cleanup_free_ char *msg2 = xasprintf(
        "method '%.100s' %s; under %s this server implements server/discover, tools/list, "
        "tools/call, and with the " TASKS_EXTENSION " extension tasks/get, tasks/cancel and "
        "tasks/update (initialize, ping and logging/setLevel are for clients of 2025-11-25 and "
        "earlier, sent without the io.modelcontextprotocol/ _meta)",
        m, removed ? "is not part of protocol " MODERN_VERSION : "not found", MODERN_VERSION);
    send_error(out, id, RPC_METHOD_NOT_FOUND, msg2);
  }
}

static bool valid_id(json_t *id) {
  return json_is_string(id) || json_is_integer(id) || json_is_real(id);
}

void mcp_handle_message(const struct mcp_req *r, json_t *msg) {
  struct mcp_out *out = r->out;
  if (json_is_array(msg)) {
    send_error(out, NULL, RPC_INVALID_REQUEST, "batches are not supported: send one JSON-RPC message "
                                          "per line");
    return;
  }
  if (!json_is_object(msg)) {
    send_error(out, NULL, RPC_INVALID_REQUEST, "a JSON-RPC message must be a JSON object");
    return;
  }
  json_t *id = json_object_get(msg, "id");
  json_t *method = json_object_get(msg, "method");
  json_t *params = json_object_get(msg, "params");
  json_t *version = json_object_get(msg, "jsonrpc");
  if (id && !valid_id(id)) {
    send_error(out, NULL, RPC_INVALID_REQUEST, "the request id must be a string or a number");
    return;
  }
  if (!json_is_string(version) || has_nul(version) || strcmp(json_string_value(version), "2.0") != 0) {
    send_error(out, id, RPC_INVALID_REQUEST, "the message must have \"jsonrpc\": \"2.0\"");
    return;
  }
  if (!method && id && (json_object_get(msg, "result") || json_object_get(msg, "error")))
    return; /* a response to a request we never sent: nothing to do */
  if (!json_is_string(method)) {
    send_error(out, id, RPC_INVALID_REQUEST, "the message needs a \"method\" string");
    return;
  }
  if (has_nul(method)) {
    send_error(out, id, RPC_INVALID_REQUEST, "the \"method\" string contains a NUL character; no "
                                        "method name has one");
    return;
  }
  if (params && !json_is_object(params)) {
    if (id)
      send_error(out, id, RPC_INVALID_PARAMS, "params must be an object");
    return;
  }
  const char *m = json_string_value(method);
  if (!id) {
    if (strcmp(m, "notifications/cancelled") == 0 && params)
      cancel_call(params, r->owner, r->cancel_scope);
    return; /* other notifications need no action and get no answer */
  }
  json_t *empty = params ? NULL : json_object();
  if (!params)
    params = empty;
  if (mcp_request_is_modern(m, params))
    handle_modern(r, id, m, params);
  else if (strcmp(m, "initialize") == 0)
    do_initialize(out, id, params);
  else if (strcmp(m, "ping") == 0)
    send_result(out, id, json_object());
  else if (strcmp(m, "tools/list") == 0)
    send_result(out, id, json_pack("{s:o}", "tools", tools_list(true)));
  else if (strcmp(m, "tools/call") == 0)
    start_call(r, id, params, false);
  else if (strcmp(m, "logging/setLevel") == 0)
    do_set_level(out, id, params);
  else if (!tasks_handle(r, id, m, params, false)) {
    _cleanup_free_ char *msg2 = xasprintf(
        "method '%.100s' not found; this server implements initialize, ping, tools/list, "
        "tools/call, logging/setLevel, tasks/get, tasks/result, tasks/list and tasks/cancel%s",
        m,
        strcmp(m, "server/discover") == 0
            ? " (server/discover is a " MODERN_VERSION " method: send it with params._meta "
              "holding " META_VERSION " and " META_CAPS ")"
            : "");
    send_error(out, id, RPC_METHOD_NOT_FOUND, msg2);
  }
  json_decref(empty);
}

/* Counts the characters that start a value or a key ([ { , :) outside
 * strings: an upper bound of what jansson would allocate for, found in one
 * pass before it allocates anything.  Nesting deeper than jansson's own limit
 * (2048) ends its parse right there, with a clear error of its own. */
static bool too_many_values(const char *s, size_t len) {
  size_t n = 0, depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < len; i++) {
    char c = s[i];
    if (in_string) {
      if (c == '\\')
        i++;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{' || c == ',' || c == ':') {
      if (++n > MAX_JSON_VALUES)
        return true;
      if (c != ',' && c != ':' && ++depth > 2048)
        return false;
    } else if ((c == ']' || c == '}') && depth > 0) {
      depth--;
    }
  }
  return false;
}

json_t *mcp_parse(struct mcp_out *out, const char *s, size_t len) {
  if (len > MAX_JSON_VALUES && too_many_values(s, len)) {
    _cleanup_free_ char *m = xasprintf("message refused: it holds more than %d JSON values and "
                                       "keys, which no MCP request needs; send large data as one "
                                       "string (a file as content_base64)", MAX_JSON_VALUES);
    send_error(out, NULL, RPC_INVALID_REQUEST, m);
    return NULL;
  }
  json_error_t err;
  /* Duplicate keys are refused: a key that means one thing to a proxy that
   * reads the first and another to us must not get through. */
  json_t *msg = json_loadb(s, len, JSON_DECODE_ANY | JSON_ALLOW_NUL | JSON_REJECT_DUPLICATES,
                           &err);
  if (!msg) {
    _cleanup_free_ char *m = xasprintf("parse error at byte %d: %s", err.position, err.text);
    send_error(out, NULL, RPC_PARSE_ERROR, m);
  }
  return msg;
}

static void on_line(void *ctx, char *line, size_t len) {
  (void)ctx;
  size_t i = 0;
  while (i < len && (line[i] == ' ' || line[i] == '\t'))
    i++;
  if (i == len)
    return;
  json_t *msg = mcp_parse(&stdio_out, line, len);
  if (!msg)
    return;
  const struct mcp_req r = {.out = &stdio_out, .bytes = len, .owner = "", .cancel_scope = "stdio"};
  mcp_handle_message(&r, msg);
  json_decref(msg);
}

/* A line over the cap was dropped; the framing found its top-level id (raw
 * JSON, a short string or a number) while dropping it, so the client that
 * sent it learns why at once instead of waiting for its own timeout. */
static void on_oversize(void *ctx, size_t len, const char *id_json) {
  (void)ctx;
  json_t *id = id_json ? json_loads(id_json, JSON_DECODE_ANY, NULL) : NULL;
  if (id && !valid_id(id)) {
    json_decref(id);
    id = NULL;
  }
  _cleanup_free_ char *m = xasprintf("message too large: over %zu bytes (IGN_MCP_MAX_MESSAGE is "
                                     "%zu); it was discarded. Send large files in pieces.",
                                     len, cfg.max_message);
  send_error(&stdio_out, id, RPC_INVALID_REQUEST, m);
  json_decref(id);
}

void mcp_handle_line(char *line, size_t len) { on_line(NULL, line, len); }

unsigned mcp_wait_calls(uint64_t timeout_ms) {
  uint64_t deadline = mono_ms() + timeout_ms;
  pthread_mutex_lock(&calls_lock);
  while (n_calls + n_sending > 0 && mono_ms() < deadline) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, 50);
    pthread_cond_timedwait(&calls_cond, &calls_lock, &ts);
  }
  unsigned left = n_calls + n_sending;
  pthread_mutex_unlock(&calls_lock);
  return left;
}

int mcp_serve(void) {
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGHUP);
  _cleanup_close_ int sfd = signalfd(-1, &mask, SFD_CLOEXEC);
  log_set_client_sink(log_sink);

  struct line_reader lr;
  line_reader_init(&lr, cfg.max_message);
  const struct line_sink sink = {.line = on_line, .oversize = on_oversize};
  const char *why = "stdin closed";
  size_t bufsize = 1 << 16;
  _cleanup_free_ char *buf = malloc(bufsize);
  if (!buf)
    return 1;
  for (;;) {
    struct pollfd p[2] = {{.fd = 0, .events = POLLIN}, {.fd = sfd, .events = POLLIN}};
    if (poll(p, sfd >= 0 ? 2 : 1, -1) < 0) {
      if (errno == EINTR)
        continue;
      why = "poll failed";
      break;
    }
    if (sfd >= 0 && (p[1].revents & POLLIN)) {
      struct signalfd_siginfo si;
      if (read(sfd, &si, sizeof si) == sizeof si) {
        log_info("received %s, shutting down", strsignal((int)si.ssi_signo));
        why = NULL;
        break;
      }
    }
    if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      ssize_t n = read(0, buf, bufsize);
      if (n < 0 && (errno == EINTR || errno == EAGAIN))
        continue;
      if (n <= 0) {
        line_reader_finish(&lr, &sink);
        break;
      }
      if (line_reader_feed(&lr, buf, (size_t)n, &sink) < 0) {
        log_error("out of memory reading a message");
        why = "out of memory";
        break;
      }
    }
    if (stdout_broken) {
      why = "stdout closed";
      break;
    }
  }
  if (why)
    log_info("%s, shutting down", why);
  line_reader_free(&lr);
  /* Closes every session and waits until the sandboxes still starting are
   * destroyed by the calls that started them. */
  sessions_shutdown();
  /* The sandboxes are gone by now, so calls still running end at once with
   * an error that says so; each is answered before the server exits. */
  unsigned left = mcp_wait_calls(SHUTDOWN_WAIT_MS);
  if (left > 0)
    log_warn("exiting with %u call(s) still running after %u s", left, SHUTDOWN_WAIT_MS / 1000);
  return 0;
}
