/* tasks.c: the table of MCP tasks and their methods (see tasks.h).
 *
 * A task is a tools/call that answered at once with an id: its call runs on
 * its own thread as any other (server.c) and hands its result here.  A task
 * belongs to the owner that made it (the HTTP token's name, "" on stdio):
 * another owner's id is answered exactly as an id nobody made.  It outlives
 * the request and the connection that made it, not the server.  A finished
 * task keeps its result for its TTL, counted from its creation (the
 * client's wish, capped by IGN_MCP_TASK_TTL_S), and at least as long again
 * after it finished, up to a minute; a running one is never dropped.  An owner holds at most
 * IGN_MCP_TASKS_MAX tasks, running or finished, and results of at most
 * 4 x IGN_MCP_MAX_MESSAGE bytes; a finished task whose result was collected
 * makes room for a new one.  Past the caps, 2025-11-25 (which asked for a
 * task) gets an error; 2026-07-28 (where the server decides) gets the
 * synchronous answer.
 *
 * The two eras read the same task differently (docs/mcp-tasks.md):
 * 2025-11-25 says failed for a result with isError and hands the result to
 * tasks/result, which waits for the end; 2026-07-28 says completed and puts
 * the result in tasks/get.  A cancelled task is cancelled in both, at once:
 * its call is told to stop (a command's process group is killed, a copy or
 * a commit ends as a cancelled call does) and whatever it returns is
 * dropped. */
#include "mcp/tasks.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "mcp/server_int.h"
#include "session/session.h"
#include "tools/tools.h"

/* "h1." and "t" and 32 hex digits: 128 random bits, not guessable. */
#define TASK_ID_MAX (CONFIG_HOST_ID_MAX + 40)
/* Longer ids are answered as unknown without being quoted. */
#define TASK_ID_QUOTE 100
#define POLL_INTERVAL_MS 1000
/* A finished task is kept at least this long after its end (or its TTL,
 * when shorter), so a call that outlived its TTL can still be collected. */
#define KEEP_AFTER_END_MS 60000
/* tasks/list pages. */
#define LIST_PAGE 50
/* A tasks/result waiting for its task holds its request id: ids longer than
 * this are refused, and an owner has at most IGN_MCP_TASKS_MAX waiting. */
#define WAITER_ID_MAX 256
#define META_RELATED "io.modelcontextprotocol/related-task"
#define META_IMMEDIATE "io.modelcontextprotocol/model-immediate-response"
#define META_PROGRESS "ignition-mcp/progress"

enum task_state { TASK_WORKING, TASK_DONE, TASK_CANCELLED };

/* A tasks/result request waiting for its task to end; also what goes out
 * once the lock is let go (struct outbox). */
struct waiter {
  struct waiter *next;
  json_t *id;
  struct mcp_out *out;
  json_t *msg;  /* in an outbox: the whole message to send */
  bool release; /* in an outbox: OUT is released once MSG is sent */
  char *log;    /* in an outbox: a line to log (then OUT is NULL) */
};

/* Messages and log lines made with the lock held and sent after it is let
 * go, so that no output is written to (a stdio pipe the client does not
 * read, where the log goes too) while every task waits. */
struct outbox {
  struct waiter *head, **tail;
};

struct task {
  struct task *next;
  char id[TASK_ID_MAX];
  char *owner;
  char *session_id; /* the session its call names, or NULL */
  char *tool;
  bool command;           /* run or sandbox_run: its progress is output, not a copy's bytes */
  enum task_state state;
  bool is_error;          /* its result has isError */
  char *status_message;   /* NULL: none */
  int64_t created_ms, updated_ms; /* wall clock, for createdAt and lastUpdatedAt */
  uint64_t created_mono, ended_mono;
  uint64_t ttl_ms;
  json_t *result;         /* the CallToolResult, once done */
  size_t result_bytes;
  atomic_bool *cancelled; /* its call's flag while the call runs; then NULL */
  bool running;           /* its call has not ended: T is never freed */
  bool collected;         /* its end was seen by tasks/result or tasks/get */
  /* Cancelled, but its call had done its work by then: RESULT is what it
   * returned, and 2026-07-28 (where a cancel is eventually consistent)
   * reads the task as completed. */
  bool done_anyway;
  uint64_t seq;           /* creation order: the tasks/list cursor */
  struct waiter *waiters;
  /* Where 2025-11-25 status notifications go: the output the task was made
   * on when it lives as long as the process (stdio), else NULL. */
  struct mcp_out *notify;
  bool modern;
  /* progress so far */
  uint64_t bytes, err_bytes, elapsed_ms;
  bool has_progress;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct task *tasks; /* newest first */
static uint64_t next_seq = 1;

static int64_t wall_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static json_t *iso_time(int64_t ms) {
  time_t s = (time_t)(ms / 1000);
  struct tm tm;
  char buf[40];
  gmtime_r(&s, &tm);
  size_t n = strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(buf + n, sizeof buf - n, ".%03dZ", (int)(ms % 1000));
  return json_string(buf);
}

/* A task is freed once ended (its waiters were answered then) or before it
 * was ever in the table. */
static void task_free(struct task *t) {
  json_decref(t->result);
  free(t->status_message);
  free(t->owner);
  free(t->session_id);
  free(t->tool);
  free(t);
}

/* The response to request ID: RESULT (stolen), or an error when it could
 * not be built. */
static json_t *response(json_t *id, json_t *result, bool modern) {
  if (modern)
    result = mcp_modern_result(result, false);
  if (!result)
    return json_pack("{s:s, s:O, s:{s:i, s:s}}", "jsonrpc", "2.0", "id", id, "error", "code",
                     RPC_INTERNAL_ERROR, "message",
                     "the result could not be built (out of memory); try again");
  return json_pack("{s:s, s:O, s:o}", "jsonrpc", "2.0", "id", id, "result", result);
}

static void send_result(struct mcp_out *out, json_t *id, json_t *result, bool modern) {
  mcp_send(out, response(id, result, modern));
}

/* Queues MSG (stolen) for OUT in BOX; W (may be NULL) is reused. */
static void post(struct outbox *box, struct waiter *w, struct mcp_out *out, json_t *msg,
                 bool release) {
  if (!w && !(w = calloc(1, sizeof *w))) {
    json_decref(msg);
    if (release && out->release)
      out->release(out);
    return;
  }
  json_decref(w->id);
  w->id = NULL;
  w->out = out;
  w->msg = msg;
  w->release = release;
  w->next = NULL;
  *box->tail = w;
  box->tail = &w->next;
}

/* Logs LINE (malloc'd; NULL: nothing) from BOX. */
static void note(struct outbox *box, char *line) {
  struct waiter *w = line ? calloc(1, sizeof *w) : NULL;
  if (!w) {
    free(line);
    return;
  }
  w->log = line;
  *box->tail = w;
  box->tail = &w->next;
}

/* Sends what BOX holds, the lock let go. */
static void flush(struct outbox *box) {
  while (box->head) {
    struct waiter *w = box->head;
    box->head = w->next;
    if (w->msg)
      mcp_send(w->out, w->msg);
    if (w->release && w->out->release)
      w->out->release(w->out);
    if (w->log)
      log_info("%s", w->log);
    free(w->log);
    free(w);
  }
  box->tail = &box->head;
}

static bool expired(const struct task *t, uint64_t now) {
  if (t->running)
    return false;
  uint64_t keep = t->ttl_ms < KEEP_AFTER_END_MS ? t->ttl_ms : KEEP_AFTER_END_MS;
  return now - t->created_mono >= t->ttl_ms && now - t->ended_mono >= keep;
}

/* Drops the finished tasks past their time.  With the lock held. */
static void sweep(struct outbox *box) {
  uint64_t now = mono_ms();
  for (struct task **pp = &tasks; *pp;) {
    struct task *t = *pp;
    if (expired(t, now)) {
      *pp = t->next;
      note(box, xasprintf("task %s (%s) expired: its result was not kept longer", t->id, t->tool));
      task_free(t);
    } else {
      pp = &t->next;
    }
  }
}

bool tasks_declared(json_t *params) {
  json_t *caps = json_object_get(json_object_get(params, "_meta"), META_CAPS);
  return json_is_object(json_object_get(json_object_get(caps, "extensions"), TASKS_EXTENSION));
}

int tasks_check_param(json_t *task, const char *tool, char **ret_msg) {
  if (!tools_task_support(tool)) {
    *ret_msg = xasprintf("tool '%s' cannot run as a task (its execution.taskSupport is "
                         "\"forbidden\": it answers at once); call it without params.task. The "
                         "tools that can: %s",
                         tool, tools_task_names());
    return RPC_METHOD_NOT_FOUND;
  }
  if (!json_is_object(task)) {
    *ret_msg = strdup("params.task must be an object, {} or {\"ttl\": milliseconds}");
    return RPC_INVALID_PARAMS;
  }
  json_t *ttl = json_object_get(task, "ttl");
  if (ttl && !json_is_null(ttl) && !(json_is_integer(ttl) && json_integer_value(ttl) >= 0)) {
    *ret_msg = strdup("params.task.ttl must be a non-negative integer, in milliseconds (or "
                       "left out for the server's longest)");
    return RPC_INVALID_PARAMS;
  }
  return 0;
}

/* What OWNER holds (with the lock held): tasks, bytes of results, waiting
 * tasks/result requests. */
struct held {
  unsigned tasks, waiters;
  size_t bytes;
};
static struct held owner_holds(const char *owner) {
  struct held h = {0};
  for (struct task *t = tasks; t; t = t->next)
    if (strcmp(t->owner, owner) == 0) {
      h.tasks++;
      h.bytes += t->result_bytes;
      for (struct waiter *w = t->waiters; w; w = w->next)
        h.waiters++;
    }
  return h;
}

/* Makes room for a task of OWNER (with the lock held): drops its oldest
 * finished task whose end was already collected.  False: none. */
static bool evict_collected(const char *owner, struct outbox *box) {
  struct task **oldest = NULL;
  for (struct task **pp = &tasks; *pp; pp = &(*pp)->next)
    if (!(*pp)->running && (*pp)->collected && strcmp((*pp)->owner, owner) == 0)
      oldest = pp;
  if (!oldest)
    return false;
  struct task *t = *oldest;
  *oldest = t->next;
  note(box, xasprintf("task %s (%s) dropped to make room: its result was collected", t->id, t->tool));
  task_free(t);
  return true;
}

struct task *tasks_new(const char *owner, const char *tool, json_t *args, json_t *task_param,
                       bool modern, atomic_bool *cancelled, struct mcp_out *out, char **ret_msg) {
  uint64_t cap_ms = (uint64_t)cfg.task_ttl_s * 1000;
  uint64_t ttl = cap_ms;
  json_t *asked = task_param ? json_object_get(task_param, "ttl") : NULL;
  if (json_is_integer(asked) && (uint64_t)json_integer_value(asked) < cap_ms)
    ttl = (uint64_t)json_integer_value(asked);
  unsigned char rnd[16];
  if (getrandom(rnd, sizeof rnd, 0) != sizeof rnd) {
    *ret_msg = xasprintf("cannot make a task id: getrandom: %s", strerror(errno));
    return NULL;
  }
  struct task *t = calloc(1, sizeof *t);
  /* Only an id a session may have is kept: no other can be closed. */
  json_t *sid = json_object_get(args, "session_id");
  bool keep_sid = json_is_string(sid) && json_string_length(sid) < SESSION_ID_MAX && !has_nul(sid);
  if (!t || !(t->owner = strdup(owner)) || !(t->tool = strdup(tool)) ||
      (keep_sid && !(t->session_id = strdup(json_string_value(sid))))) {
    if (t)
      task_free(t);
    *ret_msg = strdup("out of memory for a task; try again");
    return NULL;
  }
  size_t n = (size_t)snprintf(t->id, sizeof t->id, "%s%st", cfg.host_id, *cfg.host_id ? "." : "");
  for (size_t i = 0; i < sizeof rnd; i++)
    n += (size_t)snprintf(t->id + n, sizeof t->id - n, "%02x", rnd[i]);
  t->created_ms = t->updated_ms = wall_ms();
  t->created_mono = mono_ms();
  t->ttl_ms = ttl;
  t->command = strcmp(tool, "run") == 0 || strcmp(tool, "sandbox_run") == 0;
  t->cancelled = cancelled;
  t->running = true;
  t->modern = modern;
  t->notify = out && !out->hold ? out : NULL;
  /* Each owner's byte budget of kept results: as the calls in progress
   * have. */
  size_t budget = cfg.max_message * 4;
  struct outbox box = {.tail = &box.head};
  pthread_mutex_lock(&lock);
  sweep(&box);
  struct held h = owner_holds(owner);
  while ((h.tasks >= cfg.tasks_max || h.bytes >= budget) && evict_collected(owner, &box))
    h = owner_holds(owner);
  if (h.tasks >= cfg.tasks_max || h.bytes >= budget) {
    pthread_mutex_unlock(&lock);
    flush(&box);
    *ret_msg = h.tasks >= cfg.tasks_max
                   ? xasprintf("too many tasks: this client holds %u, running or finished (at "
                               "most %u, IGN_MCP_TASKS_MAX); a finished task is kept until its "
                               "result is collected (tasks/result) or its TTL passes: collect "
                               "results, or call without a task",
                               h.tasks, cfg.tasks_max)
                   : xasprintf("too many task results kept: this client's finished tasks hold "
                               "%zu bytes (at most %zu, 4 x IGN_MCP_MAX_MESSAGE); collect them "
                               "with tasks/result, or call without a task",
                               h.bytes, budget);
    task_free(t);
    return NULL;
  }
  t->seq = next_seq++;
  t->next = tasks;
  tasks = t;
  pthread_mutex_unlock(&lock);
  flush(&box);
  log_info("task %s: %s started as a task", t->id, tool);
  return t;
}

/* The Task object of T (with the lock held) as ERA says it: legacy
 * {taskId, status, statusMessage?, createdAt, lastUpdatedAt, ttl,
 * pollInterval}; modern the same with ttlMs and pollIntervalMs. */
static json_t *task_json(const struct task *t, bool modern) {
  const char *status = t->state == TASK_CANCELLED && !(modern && t->done_anyway) ? "cancelled"
                       : t->state == TASK_WORKING                             ? "working"
                       : !modern && t->is_error                               ? "failed"
                                                                              : "completed";
  json_t *o = json_pack("{s:s, s:s, s:o, s:o, s:I, s:i}", "taskId", t->id, "status", status,
                        "createdAt", iso_time(t->created_ms), "lastUpdatedAt",
                        iso_time(t->updated_ms), modern ? "ttlMs" : "ttl", (json_int_t)t->ttl_ms,
                        modern ? "pollIntervalMs" : "pollInterval", POLL_INTERVAL_MS);
  if (o && t->status_message)
    json_object_set_new(o, "statusMessage", json_string(t->status_message));
  if (o && t->has_progress && t->state == TASK_WORKING) {
    json_t *p = t->command ? json_pack("{s:I, s:I, s:I}", "elapsed_ms", (json_int_t)t->elapsed_ms,
                                    "stdout_bytes", (json_int_t)t->bytes, "stderr_bytes",
                                    (json_int_t)t->err_bytes)
                        : json_pack("{s:I, s:I}", "elapsed_ms", (json_int_t)t->elapsed_ms,
                                    "bytes_copied", (json_int_t)t->bytes);
    json_object_set_new(o, "_meta", json_pack("{s:o}", META_PROGRESS, p));
  }
  return o;
}

json_t *tasks_created(struct task *t, bool modern) {
  pthread_mutex_lock(&lock);
  json_t *o = task_json(t, modern);
  pthread_mutex_unlock(&lock);
  if (!o)
    return NULL;
  if (modern) {
    json_object_del(o, "_meta");
    json_object_set_new(o, "resultType", json_string("task"));
    return o;
  }
  _cleanup_free_ char *say = xasprintf(
      "%s started as task %s; it runs on while you work. Poll tasks/get, collect its result "
      "with tasks/result, stop it with tasks/cancel.",
      t->tool, t->id);
  return json_pack("{s:o, s:{s:s}}", "task", o, "_meta", META_IMMEDIATE, say);
}

void tasks_progress(struct task *t, const struct call_progress *p) {
  /* Made before the lock; T->command never changes. */
  const char *line = p->message ? p->message : "";
  char *msg = t->command ? xasprintf("running for %" PRIu64 " s; stdout %" PRIu64
                                     " bytes, stderr %" PRIu64 " bytes%s%s",
                                     p->elapsed_ms / 1000, p->bytes, p->err_bytes,
                                     *line ? "; last line: " : "", line)
                         : xasprintf("running for %" PRIu64 " s%s%s", p->elapsed_ms / 1000,
                                     *line ? "; " : "", line);
  pthread_mutex_lock(&lock);
  if (t->state == TASK_WORKING) {
    free(t->status_message);
    t->status_message = msg;
    msg = NULL;
    t->bytes = p->bytes;
    t->err_bytes = p->err_bytes;
    t->elapsed_ms = p->elapsed_ms;
    t->has_progress = true;
    t->updated_ms = wall_ms();
  }
  pthread_mutex_unlock(&lock);
  free(msg);
}

/* What tasks/result answers for T, ended (with the lock held): the call's
 * exact result, or for a cancelled task a tool error saying why, with the
 * related-task _meta. */
static json_t *payload(const struct task *t) {
  json_t *r = t->result
                  ? json_copy(t->result)
                  : json_pack("{s:[{s:s, s:s}], s:b}", "content", "type", "text", "text",
                              t->status_message ? t->status_message : "the task was cancelled",
                              "isError", 1);
  if (!r)
    return NULL;
  json_t *meta = json_object_get(r, "_meta");
  meta = json_is_object(meta) ? json_copy(meta) : json_object();
  json_object_set_new(meta, META_RELATED, json_pack("{s:s}", "taskId", t->id));
  json_object_set_new(r, "_meta", meta);
  return r;
}

/* T has ended (with the lock held): a stdio client of 2025-11-25 gets its
 * status notification, then the waiting tasks/result requests its payload
 * (which collects it), all from BOX once the lock is let go. */
static void ended(struct task *t, struct outbox *box) {
  t->ended_mono = mono_ms();
  t->updated_ms = wall_ms();
  if (t->notify && !t->modern)
    post(box, NULL, t->notify,
         json_pack("{s:s, s:s, s:o}", "jsonrpc", "2.0", "method", "notifications/tasks/status",
                   "params", task_json(t, false)),
         false);
  while (t->waiters) {
    struct waiter *w = t->waiters;
    t->waiters = w->next;
    json_t *id = json_incref(w->id);
    post(box, w, w->out, response(id, payload(t), false), true);
    json_decref(id);
    t->collected = true;
  }
}

/* The first 1000 bytes of a result's first text, not cutting a UTF-8
 * character in two. */
static char *first_text(json_t *result) {
  json_t *text = json_object_get(json_array_get(json_object_get(result, "content"), 0), "text");
  if (!json_is_string(text))
    return NULL;
  const char *s = json_string_value(text);
  size_t n = strnlen(s, 1000);
  if (n == 1000)
    while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80)
      n--;
  return strndup(s, n);
}

void tasks_finish(struct task *t, json_t *result) {
  if (!result)
    result = json_pack("{s:[{s:s, s:s}], s:b}", "content", "type", "text", "text",
                       "the result could not be built (out of memory)", "isError", 1);
  /* Measured, and its error text taken, before the lock. */
  char *s = result ? json_dumps(result, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
  size_t bytes = s ? strlen(s) : 0;
  free(s);
  bool is_error = json_is_true(json_object_get(result, "isError"));
  char *text = is_error ? first_text(result) : NULL;
  struct outbox box = {.tail = &box.head};
  pthread_mutex_lock(&lock);
  if (t->state == TASK_WORKING) {
    t->state = TASK_DONE;
    t->result = result;
    result = NULL;
    t->result_bytes = bytes;
    t->is_error = is_error;
    free(t->status_message);
    t->status_message = text;
    text = NULL;
    note(&box, xasprintf("task %s (%s) %s", t->id, t->tool, t->is_error ? "failed" : "completed"));
    ended(t, &box);
  } else if (t->state == TASK_CANCELLED && result && !is_error) {
    /* The cancel came too late to stop the work (a commit already saved,
     * a fork already made, a copy already in place): say so, and keep what
     * the call returned rather than hide it. */
    t->done_anyway = true;
    t->result = result;
    result = NULL;
    t->result_bytes = bytes;
    char *m = xasprintf("%s, but the call had already done its work: tasks/result returns what "
                        "it did",
                        t->status_message ? t->status_message : "cancelled");
    if (m) {
      free(t->status_message);
      t->status_message = m;
    }
    t->updated_ms = wall_ms();
    note(&box, xasprintf("task %s (%s) was cancelled after its work was done", t->id, t->tool));
  }
  t->running = false;
  t->cancelled = NULL;
  pthread_mutex_unlock(&lock);
  flush(&box);
  free(text);
  json_decref(result);
}

/* Cancels T (with the lock held); false when it had already ended. */
static bool cancel(struct task *t, const char *why, struct outbox *box) {
  if (t->state != TASK_WORKING)
    return false;
  t->state = TASK_CANCELLED;
  free(t->status_message);
  t->status_message = strdup(why);
  /* Its call is still ending: it stays counted among the calls in progress
   * until it has, and tasks_finish then drops what it returns. */
  if (t->cancelled)
    atomic_store(t->cancelled, true);
  note(box, xasprintf("task %s (%s) %s", t->id, t->tool, why));
  ended(t, box);
  return true;
}

void tasks_cancel_session(const char *sid, const char *owner, const char *why) {
  struct outbox box = {.tail = &box.head};
  pthread_mutex_lock(&lock);
  for (struct task *t = tasks; t; t = t->next)
    if (t->session_id && strcmp(t->session_id, sid) == 0 && strcmp(t->owner, owner) == 0) {
      _cleanup_free_ char *msg = xasprintf("cancelled: session '%s' %s", sid, why);
      cancel(t, msg, &box);
    }
  pthread_mutex_unlock(&lock);
  flush(&box);
}

void tasks_drop_out(struct mcp_out *out) {
  struct outbox box = {.tail = &box.head};
  pthread_mutex_lock(&lock);
  for (struct task *t = tasks; t; t = t->next) {
    if (t->notify == out)
      t->notify = NULL;
    for (struct waiter **pp = &t->waiters; *pp;) {
      struct waiter *w = *pp;
      if (w->out != out) {
        pp = &w->next;
        continue;
      }
      *pp = w->next;
      json_decref(w->id);
      w->id = NULL;
      post(&box, w, out, NULL, true);
    }
  }
  pthread_mutex_unlock(&lock);
  flush(&box);
}

/* ---- the methods ---- */

/* The task PARAMS.taskId names, of OWNER (with the lock held), or NULL
 * after answering the request with "not found". */
static json_t *error_msg(json_t *id, int code, const char *msg) {
  return json_pack("{s:s, s:O, s:{s:i, s:s}}", "jsonrpc", "2.0", "id", id, "error", "code", code,
                   "message", msg);
}

static struct task *find(struct mcp_out *out, json_t *id, json_t *params, const char *owner,
                         struct outbox *box) {
  json_t *tid = json_object_get(params, "taskId");
  if (!json_is_string(tid)) {
    post(box, NULL, out,
         error_msg(id, RPC_INVALID_PARAMS,
                   "params.taskId must be a string, the id tools/call answered with"),
         false);
    return NULL;
  }
  sweep(box);
  if (!has_nul(tid) && json_string_length(tid) < TASK_ID_MAX)
    for (struct task *t = tasks; t; t = t->next)
      if (strcmp(t->id, json_string_value(tid)) == 0 && strcmp(t->owner, owner) == 0)
        return t;
  bool quote = !has_nul(tid) && json_string_length(tid) <= TASK_ID_QUOTE;
  _cleanup_free_ char *msg = xasprintf(
      "Failed to retrieve task: Task not found: %s%s%s: no task of this client has that id (it "
      "was never made, belongs to another client, or finished more than its TTL ago)",
      quote ? "'" : "", quote ? json_string_value(tid) : "(an id no task has)", quote ? "'" : "");
  post(box, NULL, out, error_msg(id, RPC_INVALID_PARAMS, msg ? msg : "Task not found"), false);
  return NULL;
}

static void do_get(const struct mcp_req *r, json_t *id, json_t *params, bool modern) {
  struct outbox box = {.tail = &box.head};
  pthread_mutex_lock(&lock);
  struct task *t = find(r->out, id, params, r->owner, &box);
  json_t *o = t ? task_json(t, modern) : NULL;
  if (o && modern && (t->state == TASK_DONE || t->done_anyway)) {
    json_object_set(o, "result", t->result);
    t->collected = true;
  }
  pthread_mutex_unlock(&lock);
  flush(&box);
  if (t)
    send_result(r->out, id, o, modern);
}

static void do_result(const struct mcp_req *r, json_t *id, json_t *params) {
  struct outbox box = {.tail = &box.head};
  json_t *answer = NULL;
  pthread_mutex_lock(&lock);
  struct task *t = find(r->out, id, params, r->owner, &box);
  struct held h = t ? owner_holds(r->owner) : (struct held){0};
  struct waiter *w = NULL;
  if (!t) {
    /* answered by find() */
  } else if (t->state != TASK_WORKING) {
    answer = response(id, payload(t), false);
    t->collected = true;
  } else if (h.waiters >= cfg.tasks_max) {
    _cleanup_free_ char *msg = xasprintf(
        "too many tasks/result requests waiting: this client has %u (at most %u, "
        "IGN_MCP_TASKS_MAX); poll with tasks/get instead",
        h.waiters, cfg.tasks_max);
    answer = error_msg(id, RPC_INVALID_PARAMS, msg ? msg : "too many tasks/result requests");
  } else if (json_is_string(id) && json_string_length(id) > WAITER_ID_MAX) {
    answer = error_msg(id, RPC_INVALID_PARAMS,
                       "a tasks/result that waits keeps its request id: use an id of at most "
                       "256 characters");
  } else if (!(w = calloc(1, sizeof *w))) {
    answer = error_msg(id, RPC_INTERNAL_ERROR, "out of memory; try again");
  } else {
    /* The answer waits for the end (2025-11-25 MUST), without holding the
     * thread that reads requests. */
    w->id = json_incref(id);
    w->out = r->out;
    if (r->out->hold)
      r->out->hold(r->out);
    w->next = t->waiters;
    t->waiters = w;
  }
  pthread_mutex_unlock(&lock);
  flush(&box);
  if (answer)
    mcp_send(r->out, answer);
}

/* Newest first, LIST_PAGE at a time; the cursor is the creation number of
 * the last task given, so tasks made or dropped between pages neither
 * repeat nor push others out. */
static void do_list(const struct mcp_req *r, json_t *id, json_t *params) {
  json_t *cursor = json_object_get(params, "cursor");
  unsigned long long below = UINT64_MAX;
  if (cursor && !json_is_null(cursor)) {
    const char *c = json_is_string(cursor) && !has_nul(cursor) ? json_string_value(cursor) : "";
    char *end;
    errno = 0;
    below = strtoull(c, &end, 10);
    if (!ascii_is_digit((unsigned char)*c) || *end || errno || below == 0) {
      mcp_send_error(r->out, id, RPC_INVALID_PARAMS,
                     "params.cursor is not one this server gave: pass the nextCursor of the "
                     "previous tasks/list, or none for the first page",
                     NULL);
      return;
    }
  }
  json_t *list = json_array();
  uint64_t last = 0;
  bool more = false;
  struct outbox box = {.tail = &box.head};
  pthread_mutex_lock(&lock);
  sweep(&box);
  for (struct task *t = tasks; t; t = t->next) {
    if (strcmp(t->owner, r->owner) != 0 || t->seq >= below)
      continue;
    if (json_array_size(list) == LIST_PAGE) {
      more = true;
      break;
    }
    json_array_append_new(list, task_json(t, false));
    last = t->seq;
  }
  pthread_mutex_unlock(&lock);
  flush(&box);
  json_t *res = json_pack("{s:o}", "tasks", list);
  if (res && more) {
    char next[24];
    snprintf(next, sizeof next, "%" PRIu64, last);
    json_object_set_new(res, "nextCursor", json_string(next));
  }
  send_result(r->out, id, res, false);
}

static void do_cancel(const struct mcp_req *r, json_t *id, json_t *params, bool modern) {
  struct outbox box = {.tail = &box.head};
  json_t *answer = NULL;
  pthread_mutex_lock(&lock);
  struct task *t = find(r->out, id, params, r->owner, &box);
  if (t) {
    bool was_working = cancel(t, "cancelled by tasks/cancel; its work was stopped", &box);
    if (!was_working && !modern) {
      const char *status = t->state == TASK_CANCELLED ? "cancelled"
                           : t->is_error              ? "failed"
                                                      : "completed";
      _cleanup_free_ char *msg =
          xasprintf("Cannot cancel task: already in terminal status '%s'", status);
      answer = error_msg(id, RPC_INVALID_PARAMS, msg ? msg : "Cannot cancel task");
    } else {
      answer = response(id, modern ? json_object() : task_json(t, false), modern);
    }
  }
  pthread_mutex_unlock(&lock);
  flush(&box);
  if (answer)
    mcp_send(r->out, answer);
}

/* tasks/update answers the input a task asked for; no tool of this server
 * ever asks, so a known task gets the empty acknowledgement and its
 * inputResponses are ignored (what the extension says for keys not
 * outstanding). */
static void do_update(const struct mcp_req *r, json_t *id, json_t *params) {
  struct outbox box = {.tail = &box.head};
  pthread_mutex_lock(&lock);
  struct task *t = find(r->out, id, params, r->owner, &box);
  pthread_mutex_unlock(&lock);
  flush(&box);
  if (t)
    send_result(r->out, id, json_object(), true);
}

bool tasks_handle(const struct mcp_req *r, json_t *id, const char *m, json_t *params,
                  bool modern) {
  if (strncmp(m, "tasks/", 6) != 0)
    return false;
  const char *what = m + 6;
  if (modern) {
    if (strcmp(what, "get") != 0 && strcmp(what, "cancel") != 0 && strcmp(what, "update") != 0)
      return false;
    if (!tasks_declared(params)) {
      _cleanup_free_ char *msg = xasprintf(
          "%s needs the " TASKS_EXTENSION " extension declared in this request's "
          "params._meta[\"" META_CAPS "\"].extensions",
          m);
      mcp_send_error(r->out, id, RPC_MISSING_CAPABILITY, msg,
                     json_pack("{s:{s:{s:{}}}}", "requiredCapabilities", "extensions",
                               TASKS_EXTENSION));
      return true;
    }
    if (strcmp(what, "get") == 0)
      do_get(r, id, params, true);
    else if (strcmp(what, "cancel") == 0)
      do_cancel(r, id, params, true);
    else
      do_update(r, id, params);
    return true;
  }
  if (strcmp(what, "get") == 0)
    do_get(r, id, params, false);
  else if (strcmp(what, "result") == 0)
    do_result(r, id, params);
  else if (strcmp(what, "list") == 0)
    do_list(r, id, params);
  else if (strcmp(what, "cancel") == 0)
    do_cancel(r, id, params, false);
  else
    return false;
  return true;
}
