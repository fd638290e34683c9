/* transfer.c: copy_in, copy_out, stdin_file and sandbox_run.
 *
 * A tree copy is two tar streams joined by a pipe: one side packs, the other
 * unpacks, each in its own thread, each under the same caps (the guest is not
 * trusted to honour them; common/tarstream.h has the rules).  copy_in packs
 * the host path (hostio_copy_from, a thread) while the call's thread streams
 * the pipe to the agent (agent_unpack); copy_out is the mirror image.  Either
 * side failing stops the other: a side that fails sets the call's stop flag
 * before it closes its end of the pipe, so the receiver ends with an error
 * instead of taking a cut stream for a whole one, and the destination keeps
 * what it held (both unpackers stage and rename).  A whole stream is not a
 * sender's success either: the receiver commits only at the pipe's EOF with
 * no stop (tar_unpack), agent_pack returns 0 only after the agent's
 * PACK_END, and agent_unpack sends DATA_END only for an EOF with no stop.
 * A stop after DATA_END went is answered by what the agent did (its tree
 * in place: the copy is reported done; kept as it was: the stop), or, when
 * it does not say, by a message that says the outcome is unknown.
 * The error names the side that failed first and says what to do.
 *
 * sandbox_run is a whole ephemeral session per call: open (a pool clone when
 * there is one), copy_in, run (with the complete logs), copy_out, commit_as,
 * destroy, one report.  A watcher thread turns the call's cancellation and
 * its deadline (timeout_s covers everything from the top) into the stop flag,
 * and kills a sandbox still starting; whatever happens, the session is ended
 * before the result goes back, so nothing outlives the call. */
#include "tools/transfer.h"
#include "tools/trust.h"

#include <errno.h>
#include <inttypes.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/config.h"
#include "common/hostio.h"
#include "common/log.h"
#include "common/runlog.h"
#include "common/tarstream.h"
#include "common/util.h"
#include "egress/egress.h"
#include "sandbox/stage.h"
#include "session/session.h"
#include "tools/args.h"
#include "tools/result.h"

/* A pipe this large keeps both sides busy with fewer wake-ups. */
#define COPY_PIPE_SIZE (1 << 20)
#define WATCH_TICK_MS 10

/* ---- the watcher: cancellation and deadline as one stop flag ---- */

struct watch {
  pthread_t thread;
  bool started;
  atomic_bool stop;       /* the call is cancelled or out of time */
  _Atomic(atomic_bool *) copy_stop; /* the copy under way's own stop flag */
  atomic_bool done;
  atomic_bool expired;    /* the deadline passed (not a cancel) */
  atomic_bool opening;    /* a sandbox is being started for LEASE */
  struct call_ctx *ctx;
  uint64_t deadline_ms;   /* mono_ms; 0: none */
  const struct lease *lease;
};

static void *watch_main(void *arg) {
  struct watch *w = arg;
  while (!atomic_load(&w->done)) {
    bool cancelled = atomic_load(&w->ctx->cancelled);
    bool late = w->deadline_ms && mono_ms() >= w->deadline_ms;
    if (late && !cancelled)
      atomic_store(&w->expired, true);
    if (cancelled || late) {
      atomic_store(&w->stop, true);
      atomic_bool *cs = atomic_load(&w->copy_stop);
      if (cs)
        atomic_store(cs, true);
      /* Kills the sandbox being started, if any (until the open returns). */
      if (atomic_load(&w->opening))
        session_kill_starting(w->lease);
    }
    usleep(WATCH_TICK_MS * 1000);
  }
  return NULL;
}

/* The watcher's test, made now rather than at its next tick: the commit
 * asks it at the last moment before its stage is in place. */
static bool watch_gave_up(void *arg) {
  struct watch *w = arg;
  bool cancelled = atomic_load(&w->ctx->cancelled);
  bool late = w->deadline_ms && mono_ms() >= w->deadline_ms;
  if (late && !cancelled)
    atomic_store(&w->expired, true);
  return cancelled || late || atomic_load(&w->stop);
}

static int watch_start(struct watch *w, struct call_ctx *ctx, uint64_t deadline_ms,
                       const struct lease *l) {
  *w = (struct watch){.ctx = ctx, .deadline_ms = deadline_ms, .lease = l};
  if (pthread_create(&w->thread, NULL, watch_main, w) != 0)
    return -EAGAIN;
  w->started = true;
  return 0;
}

static void watch_stop(struct watch *w) {
  if (!w->started)
    return;
  atomic_store(&w->done, true);
  pthread_join(w->thread, NULL);
  w->started = false;
}

/* ---- reports ---- */

static json_t *skipped_json(const struct tar_report *a, const struct tar_report *b) {
  json_t *arr = json_array();
  const struct tar_report *reps[2] = {a, b};
  for (int k = 0; k < 2; k++)
    for (size_t i = 0; reps[k] && i < reps[k]->n_listed; i++) {
      const struct tar_skip *sk = &reps[k]->listed[i];
      if (json_array_size(arr) >= TAR_SKIPPED_LISTED)
        break;
      /* Names come from a tree the sandbox may have made: valid UTF-8 only. */
      _cleanup_free_ char *p = utf8_sanitize(sk->path ? sk->path : "", strlen(sk->path ? sk->path : ""), NULL);
      _cleanup_free_ char *r =
          utf8_sanitize(sk->reason ? sk->reason : "", strlen(sk->reason ? sk->reason : ""), NULL);
      json_array_append_new(arr, json_pack("{s:s, s:s}", "path", p ? p : "", "reason", r ? r : ""));
    }
  return arr;
}

/* What a copy did: the receiver's counts (what was written), and what either
 * side left out. */
static json_t *copied_json(const struct tar_report *sender, const struct tar_report *receiver) {
  return json_pack("{s:I, s:I, s:I, s:I, s:I, s:o}", "files", (json_int_t)receiver->files, "dirs",
                   (json_int_t)receiver->dirs, "symlinks", (json_int_t)receiver->symlinks, "bytes",
                   (json_int_t)receiver->bytes, "skipped",
                   (json_int_t)(sender->skipped + receiver->skipped), "skipped_entries",
                   skipped_json(sender, receiver));
}

/* ---- one copy ---- */

enum side { SIDE_NONE, SIDE_HOST, SIDE_GUEST };

struct copy {
  bool in;                    /* copy_in (host -> guest), else copy_out */
  const char *host, *guest;   /* guest: absolute */
  struct tar_limits lim;
  struct watch *w;
  /* the host side, in its thread */
  int host_fd;
  int host_r;
  char *host_err;
  struct tar_report host_rep;
  /* the guest side, in the call's thread */
  int guest_r;
  char *guest_err;
  struct tar_report guest_rep;
  atomic_int first;           /* enum side: which failed first */
  atomic_bool stop;           /* what both sides poll: set by either side failing, or the
                               * watcher */
  uint64_t ms;
};

static void copy_free(struct copy *c) {
  free(c->host_err);
  free(c->guest_err);
  tar_report_free(&c->host_rep);
  tar_report_free(&c->guest_rep);
}

static void copy_failed(struct copy *c, enum side side) {
  int none = SIDE_NONE;
  atomic_compare_exchange_strong(&c->first, &none, (int)side);
  /* Before the failing side closes its end: the other side must see a stop,
   * not a stream that merely ended. */
  atomic_store(&c->stop, true);
}

static void *host_main(void *arg) {
  struct copy *c = arg;
  if (c->in)
    c->host_r = hostio_copy_from(c->host, c->host_fd, &c->lim, &c->stop, &c->host_rep,
                                 &c->host_err);
  else
    c->host_r = hostio_copy_to(c->host_fd, c->host, &c->lim, &c->stop, &c->host_rep,
                               &c->host_err);
  if (c->host_r < 0)
    copy_failed(c, SIDE_HOST);
  close(c->host_fd);
  return NULL;
}

static int copy_run_watched(struct copy *c, struct agent_conn *conn);

/* Runs copy C on the agent connection CONN: 0, or a negative errno (the
 * caller shapes the message with copy_error). */
static int copy_run(struct copy *c, struct agent_conn *conn) {
  uint64_t t0 = mono_us();
  atomic_store(&c->w->copy_stop, &c->stop);
  if (atomic_load(&c->w->stop))
    atomic_store(&c->stop, true);
  int r = copy_run_watched(c, conn);
  atomic_store(&c->w->copy_stop, NULL);
  c->ms = (mono_us() - t0) / 1000;
  return r;
}

static int copy_run_watched(struct copy *c, struct agent_conn *conn) {
  int p[2];
  if (pipe2(p, O_CLOEXEC) < 0) {
    c->host_r = -errno;
    c->host_err = xasprintf("cannot make a pipe: %s", strerror(errno));
    atomic_store(&c->first, SIDE_HOST);
    return c->host_r;
  }
  (void)fcntl(p[1], F_SETPIPE_SZ, COPY_PIPE_SIZE); /* best effort */
  /* copy_in: the host writes p[1], the agent call reads p[0]; copy_out the
   * other way round. */
  int guest_fd = c->in ? p[0] : p[1];
  c->host_fd = c->in ? p[1] : p[0];
  pthread_t t;
  if (pthread_create(&t, NULL, host_main, c) != 0) {
    close(p[0]);
    close(p[1]);
    c->host_r = -EAGAIN;
    c->host_err = strdup("cannot start a thread for the host side");
    atomic_store(&c->first, SIDE_HOST);
    return -EAGAIN;
  }
  struct agent_ctl ctl = {.cancelled = &c->stop};
  if (c->in)
    c->guest_r = agent_unpack(conn, c->guest, guest_fd, &c->lim, &ctl, &c->guest_rep,
                              &c->guest_err);
  else
    c->guest_r = agent_pack(conn, c->guest, guest_fd, &c->lim, &ctl, &c->guest_rep,
                            &c->guest_err);
  if (c->guest_r < 0 && c->guest_r != -ECANCELED)
    copy_failed(c, SIDE_GUEST);
  else if (c->guest_r == -ECANCELED && !atomic_load(&c->stop))
    copy_failed(c, SIDE_GUEST);
  /* Closing our end ends the host side: EOF (copy_out) or EPIPE (copy_in). */
  close(guest_fd);
  pthread_join(t, NULL);
  if (c->host_r < 0 || c->guest_r < 0)
    return c->guest_r < 0 && atomic_load(&c->first) != SIDE_HOST ? c->guest_r : c->host_r;
  return 0;
}

/* The message for a failed copy C of TOOL, for session ID: which side failed
 * and how to fix it.  *ret_dead: the session's connection is gone. */
static char *copy_error(struct copy *c, const char *tool, const struct lease *l, int r,
                        bool *ret_dead) {
  *ret_dead = false;
  const char *id = lease_id(l);
  /* A stop that came once the whole stream was in the sandbox, which did
   * not say whether it kept the tree: neither "as it was" nor done. */
  if (c->in && r == -EINPROGRESS)
    return xasprintf("%s of '%s' was %s: %s", tool, c->host,
                     atomic_load(&c->w->expired) ? "out of time (timeout_s)"
                     : atomic_load(&c->w->ctx->cancelled) ? "cancelled"
                                                          : "stopped",
                     c->guest_err ? c->guest_err : strerror(-r));
  if (atomic_load(&c->w->expired))
    return xasprintf("%s of '%s' ran out of time (timeout_s) after %" PRIu64 " ms; nothing was "
                     "changed at the destination. Raise timeout_s, or copy less.",
                     tool, c->in ? c->host : c->guest, c->ms);
  if (atomic_load(&c->w->ctx->cancelled))
    return xasprintf("the call was cancelled; %s stopped and the destination was left as it "
                     "was", tool);
  if (atomic_load(&c->first) == SIDE_HOST)
    return xasprintf("%s failed on the host side, %s '%s' (host paths are under %s, "
                     "IGN_MCP_HOST_IO_ROOT): %s",
                     tool, c->in ? "reading" : "writing", c->host, hostio_root(),
                     c->host_err ? c->host_err : strerror(-c->host_r));
  if (r == -EPIPE) {
    *ret_dead = true;
    return lease_failure(l, c->in ? "copy_in failed" : "copy_out failed");
  }
  if (r == -EPROTO) {
    *ret_dead = true;
    if (lease_ephemeral(l))
      return xasprintf("%s failed: the sandbox's agent broke the protocol (%s); the sandbox is "
                       "destroyed. Call sandbox_run again.",
                       tool, c->guest_err ? c->guest_err : "?");
    return conn_fault(c->in ? "copy_in failed" : "copy_out failed", id, c->guest_err);
  }
  return xasprintf("%s failed in the sandbox, %s '%s': %s%s", tool, c->in ? "writing" : "reading",
                   c->guest, c->guest_err ? c->guest_err : strerror(-r),
                   c->in ? "" : "; the host destination was left as it was");
}

static struct tar_limits copy_limits(void) {
  return (struct tar_limits){.max_bytes = (uint64_t)cfg.copy_max_mb << 20,
                             .max_files = cfg.copy_max_files};
}

/* A guest path as the agent takes it: relative ones are under /root, as for
 * write_file and run's cwd. */
static char *guest_abs(const char *p) {
  return p[0] == '/' ? strdup(p) : xasprintf("/root/%s", p);
}

static const char *copy_out_off =
    "copy_out is off on this server (IGN_MCP_COPY_OUT=off): nothing from a sandbox is written "
    "to the host. Read files with read_file instead, or ask the user to turn it on.";

/* copy_in and copy_out: the session tools. */
static json_t *tool_copy(json_t *args, struct call_ctx *ctx, bool in) {
  const char *tool = in ? "copy_in" : "copy_out";
  char *err = NULL;
  if (args_check(args, tool, (const char *[]){"session_id", "host_path", "guest_path", NULL},
                 &err) < 0)
    return err_result_free(err);
  const char *id, *host, *guest;
  if (arg_session_id(args, &id, &err) < 0 ||
      arg_string(args, tool, "host_path", true, 1, ARG_MAX_PATH, &host, NULL, &err) < 0 ||
      arg_string(args, tool, "guest_path", true, 1, ARG_MAX_PATH - 6, &guest, NULL, &err) < 0)
    return err_result_free(err);
  if (!in && !hostio_copy_out_enabled())
    return err_result(copy_out_off);
  _cleanup_free_ char *gpath = guest_abs(guest);
  if (!gpath)
    return err_result(NULL);
  struct watch w;
  struct lease l;
  if (session_acquire(id, call_owner(ctx), &l, &err) < 0)
    return err_result_free(err);
  if (watch_start(&w, ctx, 0, &l) < 0) {
    session_release(&l);
    return err_result("cannot start a thread for this call; try again");
  }
  struct copy c = {.in = in, .host = host, .guest = gpath, .lim = copy_limits(), .w = &w};
  int r = copy_run(&c, lease_conn(&l));
  watch_stop(&w);
  json_t *out;
  if (r < 0) {
    bool dead;
    out = err_result_free(copy_error(&c, tool, &l, r, &dead));
  } else {
    const struct tar_report *sender = in ? &c.host_rep : &c.guest_rep;
    const struct tar_report *receiver = in ? &c.guest_rep : &c.host_rep;
    out = ok_result(json_pack("{s:b, s:s, s:s, s:o, s:I}", "ok", 1, "host_path", host,
                              "guest_path", gpath, "copied", copied_json(sender, receiver),
                              "copy_ms", (json_int_t)c.ms));
  }
  copy_free(&c);
  session_release(&l);
  return out;
}

json_t *tool_copy_in(json_t *args, struct call_ctx *ctx) { return tool_copy(args, ctx, true); }
json_t *tool_copy_out(json_t *args, struct call_ctx *ctx) { return tool_copy(args, ctx, false); }

int stdin_file_load(const char *tool, const char *path, void **ret_data, size_t *ret_len,
                    char **ret_err) {
  _cleanup_free_ char *err = NULL;
  int r = hostio_read_file(path, STDIN_FILE_MAX, ret_data, ret_len, &err);
  if (r < 0)
    *ret_err = xasprintf("%s: stdin_file '%s': %s", tool, path, err ? err : strerror(-r));
  return r;
}

/* ---- sandbox_run ---- */

struct sbrun {
  /* arguments */
  const char *command, *stage, *commit_as, *cwd, *in, *in_file;
  size_t in_len;
  long long timeout_s;
  struct arg_copy cin[SANDBOX_RUN_MAX_COPIES], cout[SANDBOX_RUN_MAX_COPIES];
  size_t n_cin, n_cout;
  const char *env[MAX_ENV];
  size_t n_env;
  struct egress *egress;   /* the sandbox's network policy: the session takes it */
};

static int sbrun_args(json_t *args, struct sbrun *a, char **env_buf, char **ret_err) {
  const char *tool = "sandbox_run";
  if (args_check(args, tool,
                 (const char *[]){"command", "stage", "commit_as", "network", "allow_hosts",
                                  "secrets", "stdin", "stdin_file", "copy_in", "copy_out", "env",
                                  "cwd", "timeout_s", NULL},
                 ret_err) < 0)
    return -EINVAL;
  a->timeout_s = DEFAULT_TIMEOUT_S;
  if (arg_string(args, tool, "command", true, 1, MAX_COMMAND, &a->command, NULL, ret_err) < 0 ||
      arg_string(args, tool, "stage", false, 0, ARG_MAX_PATH, &a->stage, NULL, ret_err) < 0 ||
      arg_string(args, tool, "commit_as", false, 0, ARG_MAX_PATH, &a->commit_as, NULL,
                 ret_err) < 0 ||
      arg_stdin_file(args, tool, &a->in_file, ret_err) < 0 ||
      arg_stdin(args, tool, cfg.max_stdin, &a->in, &a->in_len, ret_err) < 0 ||
      arg_copies(args, tool, "copy_in", a->cin, SANDBOX_RUN_MAX_COPIES, &a->n_cin, ret_err) < 0 ||
      arg_copies(args, tool, "copy_out", a->cout, SANDBOX_RUN_MAX_COPIES, &a->n_cout, ret_err) <
          0 ||
      arg_string(args, tool, "cwd", false, 1, ARG_MAX_PATH, &a->cwd, NULL, ret_err) < 0 ||
      arg_int(args, tool, "timeout_s", 1, MAX_TIMEOUT_S, &a->timeout_s, ret_err) < 0 ||
      arg_env(args, tool, a->env, MAX_ENV, &a->n_env, env_buf, ret_err) < 0)
    return -EINVAL;
  const char *names[2][2] = {{"stage", a->stage}, {"commit_as", a->commit_as}};
  for (int i = 0; i < 2; i++) {
    _cleanup_free_ char *e = NULL;
    if (names[i][1] && stage_name_check(names[i][1], &e) < 0) {
      *ret_err = xasprintf("sandbox_run: '%s': %s", names[i][0], e);
      return -EINVAL;
    }
  }
  if (a->n_cout && !hostio_copy_out_enabled()) {
    *ret_err = xasprintf("sandbox_run: %s", copy_out_off);
    return -EPERM;
  }
  /* A destination that cannot be written is refused before a sandbox
   * starts, not found out after the command ran. */
  for (size_t i = 0; i < a->n_cout; i++) {
    _cleanup_free_ char *e = NULL;
    if (hostio_check_write(a->cout[i].host, &e) < 0) {
      *ret_err = xasprintf("sandbox_run: copy_out[%zu]: %s", i, e ? e : "cannot be written");
      return -EINVAL;
    }
  }
  /* Last: nothing after it can fail and leave it behind. */
  return egress_new_secrets(tool, json_object_get(args, "network"),
                            json_object_get(args, "allow_hosts"), json_object_get(args, "secrets"),
                            &a->egress, ret_err);
}

static json_t *copy_entry(const struct copy *c, const char *host, const char *guest) {
  const struct tar_report *sender = c->in ? &c->host_rep : &c->guest_rep;
  const struct tar_report *receiver = c->in ? &c->guest_rep : &c->host_rep;
  json_t *e = json_pack("{s:s, s:s, s:s}", "direction", c->in ? "in" : "out", "host", host,
                        "guest", guest);
  json_object_update_new(e, copied_json(sender, receiver));
  json_object_set_new(e, "copy_ms", json_integer((json_int_t)c->ms));
  return e;
}

json_t *tool_sandbox_run(json_t *args, struct call_ctx *ctx) {
  uint64_t t0 = mono_ms();
  char *err = NULL;
  struct sbrun a = {0};
  _cleanup_free_ char *env_buf = NULL;
  if (sbrun_args(args, &a, &env_buf, &err) < 0)
    return err_result_free(err);
  _cleanup_free_ void *in_owned = NULL;
  if (a.in_file) {
    if (stdin_file_load("sandbox_run", a.in_file, &in_owned, &a.in_len, &err) < 0) {
      egress_free(a.egress);
      return err_result_free(err);
    }
    a.in = in_owned;
  }
  uint64_t deadline = t0 + (uint64_t)a.timeout_s * 1000;

  struct lease l = {0};
  struct watch w;
  if (watch_start(&w, ctx, deadline, &l) < 0) {
    egress_free(a.egress);
    return err_result("cannot start a thread for this call; try again");
  }

  /* Open (the session takes the egress, whatever happens). */
  atomic_store(&w.opening, true);
  json_t *info = NULL;
  int r = session_open_ephemeral(call_owner(ctx), a.stage, a.egress, &l, &info, &err);
  atomic_store(&w.opening, false);
  if (r < 0) {
    watch_stop(&w);
    json_t *out;
    if (atomic_load(&w.expired))
      out = err_result_free(xasprintf("sandbox_run: the sandbox did not start within timeout_s "
                                      "(%lld s), which covers the whole call including the "
                                      "start; nothing was left behind. Raise timeout_s.",
                                      a.timeout_s));
    else if (atomic_load(&ctx->cancelled))
      out = err_result("the call was cancelled while the sandbox started; nothing was left "
                       "behind");
    else
      out = err_result_free(xasprintf("sandbox_run: %s", err ? err : strerror(-r)));
    free(err);
    return out;
  }
  const char *id = lease_id(&l);
  json_t *o = NULL;          /* the report */
  json_t *copied = json_array();
  char *fail = NULL;         /* a failure that ends the call as an error */
  struct runlog *logs[2] = {NULL, NULL};
  _cleanup_free_ char *log_err = NULL;

  /* copy_in: every entry must arrive, or the command does not run. */
  uint64_t copy_in_ms = 0;
  for (size_t i = 0; i < a.n_cin && !fail; i++) {
    _cleanup_free_ char *g = guest_abs(a.cin[i].guest);
    struct copy c = {.in = true, .host = a.cin[i].host, .guest = g, .lim = copy_limits(), .w = &w};
    r = g ? copy_run(&c, lease_conn(&l)) : -ENOMEM;
    copy_in_ms += c.ms;
    if (r < 0) {
      bool dead;
      _cleanup_free_ char *m = copy_error(&c, "copy_in", &l, r, &dead);
      fail = xasprintf("sandbox_run: copy_in[%zu] ('%s' to '%s'): %s; the command did not run "
                       "and the sandbox was destroyed", i, a.cin[i].host, a.cin[i].guest,
                       m ? m : "out of memory");
    } else {
      json_array_append_new(copied, copy_entry(&c, a.cin[i].host, g));
    }
    copy_free(&c);
  }

  /* The command, with whatever is left of the budget. */
  struct agent_exec_res res = {0};
  bool ran = false;
  if (!fail) {
    uint64_t now = mono_ms();
    if (now >= deadline) {
      fail = xasprintf("sandbox_run: timeout_s (%lld s) was spent before the command could "
                       "start (starting the sandbox took %" PRIu64 " ms, copy_in %" PRIu64
                       " ms); nothing was left behind. Raise timeout_s.",
                       a.timeout_s, now - t0 - copy_in_ms, copy_in_ms);
    } else {
      if (runlog_open_run(id, logs, &log_err) < 0 && !log_err)
        log_err = strdup("the logs could not be opened");
      char **trust = NULL;
      char *terr = NULL;
      if (trust_env(&l, "sandbox_run", a.env, &a.n_env, MAX_ENV, &trust, &terr) < 0)
        fail = terr;
      struct agent_exec_req req = {
          .command = a.command, .cwd = a.cwd, .env = a.env, .n_env = a.n_env,
          .timeout_ms = (uint32_t)(deadline - now), .stdin_data = a.in,
          .stdin_len = a.in ? a.in_len : 0, .out_cap = cfg.output_cap,
          .on_output = logs[0] || logs[1] ? runlog_tap : NULL, .output_ctx = logs,
      };
      /* The run ends by its own timeout; only the call's cancel stops it. */
      struct agent_ctl ctl = {.cancelled = &ctx->cancelled,
                              .progress = ctx->progress ? on_progress : NULL, .ctx = ctx};
      _cleanup_free_ char *xerr = NULL;
      r = fail ? -EINVAL : agent_exec(lease_conn(&l), &req, &ctl, &res, &xerr);
      trust_env_free(trust);
      if (fail)
        ; /* the secrets' env was refused: the command did not run */
      else if (r == -ECANCELED)
        fail = strdup("the call was cancelled; the command was killed and the sandbox destroyed");
      else if (r == -EPIPE)
        fail = lease_failure(&l, "sandbox_run failed");
      else if (r < 0)
        fail = xasprintf("sandbox_run failed: %s", xerr ? xerr : strerror(-r));
      else
        ran = true;
      if (ran) {
        o = exec_result_json(&res);
        if (!o)
          fail = strdup("out of memory shaping the output; lower IGN_MCP_OUTPUT_CAP");
      }
      json_t *logged = json_object();
      runlog_close_run(logs, log_err, logged);
      if (o)
        json_object_update(o, logged);
      json_decref(logged);
    }
  }

  /* copy_out: after the command whatever its exit code (a failed build's
   * reports are what one wants to see), each entry on its own; not after a
   * timeout (the budget is spent). */
  uint64_t copy_out_ms = 0;
  if (o && a.n_cout) {
    for (size_t i = 0; i < a.n_cout; i++) {
      _cleanup_free_ char *g = guest_abs(a.cout[i].guest);
      if (res.timed_out || atomic_load(&w.stop)) {
        json_array_append_new(copied, json_pack("{s:s, s:s, s:s, s:b, s:s}", "direction", "out",
                                                "host", a.cout[i].host, "guest", g ? g : "", "ok",
                                                0, "error",
                                                res.timed_out ? "not copied: the command timed out"
                                                              : "not copied: out of time"));
        continue;
      }
      struct copy c = {.in = false, .host = a.cout[i].host, .guest = g, .lim = copy_limits(),
                       .w = &w};
      r = g ? copy_run(&c, lease_conn(&l)) : -ENOMEM;
      copy_out_ms += c.ms;
      json_t *e = copy_entry(&c, a.cout[i].host, g ? g : "");
      json_object_set_new(e, "ok", json_boolean(r == 0));
      if (r < 0) {
        bool dead;
        _cleanup_free_ char *m = copy_error(&c, "copy_out", &l, r, &dead);
        json_object_set_new(e, "error", json_string(m ? m : "out of memory"));
      }
      json_array_append_new(copied, e);
      copy_free(&c);
    }
  }

  /* commit_as: only a command that exited 0, and only while the call is
   * neither cancelled nor out of time (a cancelled call leaves no stage). */
  if (o && a.commit_as) {
    if (atomic_load(&w.stop)) {
      json_object_set_new(o, "commit_skipped",
                          json_string(atomic_load(&w.expired)
                                          ? "timeout_s was spent before the commit, so nothing "
                                            "was committed; raise timeout_s"
                                          : "the call was cancelled, so nothing was committed"));
    } else if (res.exit_code == 0 && !res.signal && !res.timed_out) {
      json_t *ci = NULL;
      _cleanup_free_ char *cerr = NULL;
      const struct commit_stop stop = {.gave_up = watch_gave_up, .ctx = &w};
      int cr = session_commit_ephemeral(&l, a.commit_as, true, &stop, &ci, &cerr);
      if (cr == 0) {
        json_object_set(o, "stage_name", json_object_get(ci, "stage"));
        json_object_set(o, "stage_id", json_object_get(ci, "stage_id"));
        json_object_set(o, "commit_ms", json_object_get(ci, "commit_ms"));
        json_decref(ci);
      } else if (cr == -ECANCELED) {
        json_object_set_new(o, "commit_skipped",
                            json_string(atomic_load(&w.expired)
                                            ? "timeout_s was spent while the stage was being "
                                              "saved, so nothing was committed; raise timeout_s"
                                            : "the call was cancelled while the stage was being "
                                              "saved, so nothing was committed"));
      } else {
        json_object_set_new(o, "commit_error", json_string(cerr ? cerr : "the commit failed"));
      }
    } else {
      json_object_set_new(o, "commit_skipped",
                          json_string("the command did not exit 0, so nothing was committed"));
    }
  }

  /* What the sandbox tried to reach; its connections still open are ended
   * by the teardown. */
  json_t *egress = o && lease_egress(&l) ? egress_report(lease_egress(&l), true) : NULL;
  if (egress)
    json_object_set_new(o, "egress", egress);

  /* Teardown: nothing outlives the call. */
  json_t *sinfo = json_object_get(info, "serial_log_path");
  _cleanup_free_ char *serial = NULL, *serial_err = NULL;
  if (o)
    runlog_keep_serial(id, json_string_value(sinfo), &serial, &serial_err);
  uint64_t td0 = mono_ms();
  session_end_ephemeral(&l);
  uint64_t teardown_ms = mono_ms() - td0;
  watch_stop(&w);
  agent_exec_res_free(&res);

  if (fail || !o) {
    json_decref(o);
    json_decref(copied);
    json_decref(info);
    return err_result_free(fail);
  }
  const char *path = json_string_value(json_object_get(info, "path"));
  if (!path)
    path = a.stage ? "stage" : "cold";
  bool vm = strcmp(sessions_backend(), "vm") == 0;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  json_object_set_new(o, "total_ms", json_integer((json_int_t)(mono_ms() - t0)));
  json_object_set_new(o, "path", json_string(path));
  json_object_set(o, "open_ms", json_object_get(info, "open_ms"));
  json_object_set_new(o, "teardown_ms", json_integer((json_int_t)teardown_ms));
  if (a.n_cin)
    json_object_set_new(o, "copy_in_ms", json_integer((json_int_t)copy_in_ms));
  if (a.n_cout)
    json_object_set_new(o, "copy_out_ms", json_integer((json_int_t)copy_out_ms));
  json_object_set(o, "isolation", json_object_get(info, "isolation"));
  json_object_set_new(o, "vcpus", json_integer(vm ? 1 : cpus > 0 ? cpus : 1));
  json_object_set_new(o, "mem_mib", json_integer(vm ? cfg.vm_memory_mb : cfg.memory_mb));
  if (serial)
    json_object_set_new(o, "serial_log_path", json_string(serial));
  else if (serial_err)
    json_object_set_new(o, "serial_log_error", json_string(serial_err));
  if (json_array_size(copied))
    json_object_set_new(o, "copied", copied);
  else
    json_decref(copied);
  json_decref(info);
  return ok_result(o);
}
