/* result.c: see result.h. */
#include "tools/result.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "common/call.h"
#include "common/util.h"
#include "tools/args.h"

json_t *text_block(const char *text) {
  json_t *b = json_pack("[{s:s, s:s}]", "type", "text", "text", text);
  if (!b) {
    /* Not UTF-8: a message quoting part of a name can cut a character in
     * two.  Send it with U+FFFD in place of the broken bytes. */
    _cleanup_free_ char *clean = utf8_sanitize(text, strlen(text), NULL);
    if (clean)
      b = json_pack("[{s:s, s:s}]", "type", "text", "text", clean);
  }
  return b;
}

json_t *ok_result(json_t *structured) {
  _cleanup_free_ char *text = json_dumps(structured, JSON_COMPACT | JSON_REAL_PRECISION(12));
  return json_pack("{s:o, s:o, s:b}", "content", text_block(text ? text : "{}"),
                   "structuredContent", structured, "isError", 0);
}

json_t *err_result(const char *msg) {
  /* Only a failed allocation leaves a failure without its message. */
  if (!msg)
    msg = "the server ran out of memory for this call; try again, or close sessions you no "
          "longer need";
  return json_pack("{s:o, s:b}", "content", text_block(msg), "isError", 1);
}

json_t *err_result_free(char *msg) {
  json_t *r = err_result(msg);
  free(msg);
  return r;
}

void on_progress(void *p, const char *last_line, uint64_t elapsed_ms, uint64_t bytes,
                 uint64_t err_bytes) {
  struct call_ctx *call = p;
  _cleanup_free_ char *line = utf8_sanitize(last_line, strlen(last_line), NULL);
  const struct call_progress pr = {
      .message = line, .elapsed_ms = elapsed_ms, .bytes = bytes, .err_bytes = err_bytes};
  if (call->progress)
    call->progress(call, &pr);
}

char *conn_fault(const char *what_failed, const char *id, const char *why) {
  return xasprintf("%s: session '%s' is dead: %s. Call reset('%s') to get a fresh sandbox under "
                   "the same id, or close it.",
                   what_failed, id, why ? why : "its agent broke the protocol", id);
}

char *signal_name(int sig) {
  const char *abbrev = sigabbrev_np(sig);
  return abbrev ? xasprintf("SIG%s", abbrev) : xasprintf("signal %d", sig);
}

json_t *exec_result_json(const struct agent_exec_res *res) {
  size_t out_len = 0, errs_len = 0;
  _cleanup_free_ char *out = utf8_sanitize(res->out, res->out_len, &out_len);
  _cleanup_free_ char *errs = utf8_sanitize(res->err, res->err_len, &errs_len);
  if (!out || !errs)
    return NULL;
  json_t *o = json_object();
  json_object_set_new(o, "stdout", json_stringn(out, out_len));
  json_object_set_new(o, "stderr", json_stringn(errs, errs_len));
  /* The client bounds both (signal 0..64, exit code -1..255): no overflow. */
  json_object_set_new(o, "exit_code",
                      json_integer(res->signal ? 128 + (json_int_t)res->signal : res->exit_code));
  json_object_set_new(o, "timed_out", json_boolean(res->timed_out));
  if (res->signal) {
    _cleanup_free_ char *name = signal_name(res->signal);
    json_object_set_new(o, "signal", json_string(name));
  } else {
    json_object_set_new(o, "signal", json_null());
  }
  json_object_set_new(o, "duration_ms", json_integer((json_int_t)(res->duration_us / 1000)));
  json_object_set_new(o, "stdout_bytes", json_integer((json_int_t)res->out_total));
  json_object_set_new(o, "stderr_bytes", json_integer((json_int_t)res->err_total));
  json_object_set_new(o, "stdout_truncated", json_boolean(res->out_total > res->out_len));
  json_object_set_new(o, "stderr_truncated", json_boolean(res->err_total > res->err_len));
  return o;
}
