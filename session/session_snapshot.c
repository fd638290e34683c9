/* session_snapshot.c: commit and fork.  A commit saves a session as it is
 * now as a named stage that new sessions start from; a fork saves it as an
 * anonymous stage and starts COUNT new sessions from it at once, all or
 * none.  Both take the session quiet first (session_quiet_begin: no call
 * runs in it while it is saved). */
#include "session/session.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "egress/egress.h"
#include "sandbox/sandbox.h"
#include "sandbox/stage.h"
#include "sandbox/vm.h"
#include "session/session_int.h"

/* The space a stage of this backend may take before it is made. */
static uint64_t stage_need(void) {
  if (session_ops == &sandbox_vm_ops)
    return ((uint64_t)cfg.vm_memory_mb + 4) << 20;
  return (uint64_t)sandbox_overlay_mb(cfg.memory_mb, cfg.overlay_mb) << 20;
}

int session_snapshot_lease(const struct lease *l, const char *name, bool replace,
                           const struct commit_stop *stop, struct stage **ret,
                           struct sandbox_snapshot *ret_snap, char **ret_err) {
  struct sandbox *sb = l->h->sb;
  if (!agent_conn_alive(l->h->conn)) {
    *ret_err = lease_failure(l, "cannot save it");
    return -EPIPE;
  }
  _cleanup_free_ char *inputs = NULL, *text = NULL, *err = NULL;
  int r = 0;
  if (sb->inputs_id[0])
    inputs = strdup(sb->inputs_id);
  else
    r = session_ops->inputs_id(&inputs, &text, &err);
  if (r < 0) {
    *ret_err = xasprintf("cannot save session '%s': %s", l->s->id, err ? err : strerror(-r));
    return r;
  }
  _cleanup_free_ char *dir = NULL;
  if ((r = stage_begin(stage_need(), &dir, ret_err)) < 0)
    return r;
  r = session_ops->snapshot(sb, dir, ret_snap, &err);
  if (r < 0) {
    stage_abort(dir);
    _cleanup_free_ char *why = r == -EPIPE ? lease_failure(l, "saving it failed") : NULL;
    *ret_err = why ? steal_ptr(why)
                   : xasprintf("saving session '%s' failed: %s", l->s->id,
                               err ? err : strerror(-r));
    return r;
  }
  /* A guest stopped for the snapshot (vm) has a clock that stood still
   * meanwhile: set it to the host's again, as for a clone (not one that
   * stays stopped: it is about to end). */
  if (!ret_snap->final && ret_snap->carries && strcmp(ret_snap->carries, "memory") == 0) {
    _cleanup_free_ char *clock_err = NULL;
    if (agent_setup(l->h->conn, NULL, 0, now_ns(CLOCK_REALTIME), NULL, NULL, &clock_err) < 0)
      log_warn("session %s: its clock could not be set after the snapshot: %s", l->s->id,
               clock_err ? clock_err : "?");
  }
  /* The last moment a caller that gave up can still have nothing saved:
   * the stage is not there until stage_finish() renames it into place.  The
   * line is logged before the check, so a log that has it before the
   * caller's cancel is the only kind that can go with a saved stage. */
  log_info("session %s: saving stage %s", l->s->id, name ? name : "(a fork's)");
  if (stop && stop->gave_up(stop->ctx)) {
    stage_abort(dir);
    session_snapshot_unpause(l, ret_snap);
    *ret_err = strdup("the call ended before the stage was saved, so nothing was saved");
    return -ECANCELED;
  }
  struct stage_new in = {.backend = session_ops->name, .inputs_id = inputs,
                         .carries = ret_snap->carries, .parent = l->h->stage,
                         .owner = l->s->owner};
  r = stage_finish(dir, name, replace, &in, ret, ret_err);
  if (r < 0)
    session_snapshot_unpause(l, ret_snap);
  return r;
}

void session_snapshot_unpause(const struct lease *l, const struct sandbox_snapshot *snap) {
  if (!snap->final || !l->h->sb->ops->unpause)
    return;
  _cleanup_free_ char *err = NULL;
  if (l->h->sb->ops->unpause(l->h->sb, &err) < 0)
    log_warn("session %s: it stays stopped after a save that failed: %s", l->s->id,
             err ? err : "?");
}

/* Saves the quiet session of L as stage NAME; *ret as session_commit's. */
static int commit_lease(const struct lease *l, const char *name, bool replace,
                        const struct commit_stop *stop, uint64_t t0, json_t **ret, char **ret_err) {
  struct stage *st = NULL;
  struct sandbox_snapshot snap = {0};
  int r = session_snapshot_lease(l, name, replace, stop, &st, &snap, ret_err);
  if (r < 0)
    return r;
  const struct stage *parent = l->h->stage;
  *ret = json_pack("{s:s, s:s, s:o, s:o, s:s, s:I, s:I, s:f}", "stage", st->name, "stage_id",
                   st->id, "parent", parent && parent->name ? json_string(parent->name)
                                                            : json_null(),
                   "parent_id", parent ? json_string(parent->id) : json_null(), "carries",
                   st->carries, "bytes", (json_int_t)st->bytes, "commit_ms",
                   (json_int_t)((mono_us() - t0) / 1000), "paused_ms", snap.paused_us / 1000.0);
  log_info("session %s committed as stage %s (%s, %" PRIu64 " bytes)", l->s->id, st->name, st->id,
           st->bytes);
  stage_unref(st);
  return 0;
}

int session_commit(const char *id, const char *owner, const char *name, bool replace,
                   const struct commit_stop *stop, json_t **ret, char **ret_err) {
  int r = stage_name_check(name, ret_err);
  if (r < 0)
    return r;
  if (!session_stages_supported(ret_err))
    return -EOPNOTSUPP;
  uint64_t t0 = mono_us();
  struct lease l;
  if ((r = session_quiet_begin(id, owner, "commit", &l, ret_err)) < 0)
    return r;
  r = commit_lease(&l, name, replace, stop, t0, ret, ret_err);
  session_quiet_end(&l);
  return r;
}

int session_commit_ephemeral(const struct lease *l, const char *name, bool replace,
                             const struct commit_stop *stop, json_t **ret, char **ret_err) {
  int r = stage_name_check(name, ret_err);
  if (r < 0)
    return r;
  if (!session_stages_supported(ret_err))
    return -EOPNOTSUPP;
  /* Only the caller's lease reaches an ephemeral session: it is quiet. */
  return commit_lease(l, name, replace, stop, mono_us(), ret, ret_err);
}

struct fork_job {
  pthread_t thread;
  struct session *s;
  struct stage *stage;
  int r;
  uint64_t ms;
  char *err;
};

static void *fork_main(void *arg) {
  struct fork_job *j = arg;
  pthread_mutex_lock(&session_lock);
  if (session_shutting_down) {
    j->r = -ESHUTDOWN;
    j->err = strdup("the server is shutting down");
  } else {
    j->r = session_make_handle_locked(j->s->id, j->stage, j->s->egress, NULL, &j->s->h, &j->ms,
                                      &j->err);
  }
  session_table_unlock();
  return NULL;
}

int session_fork(const char *id, const char *owner, unsigned count, json_t **ret, char **ret_err) {
  if (!session_stages_supported(ret_err))
    return -EOPNOTSUPP;
  if (count < 1 || count > SESSION_FORK_MAX) {
    *ret_err = xasprintf("fork: 'count' is %u, outside its range 1..%d", count, SESSION_FORK_MAX);
    return -EINVAL;
  }
  uint64_t t0 = mono_us();
  /* The new sessions' slots first: a fork past the cap changes nothing. */
  pthread_mutex_lock(&session_lock);
  if (session_shutting_down) {
    session_table_unlock();
    *ret_err = strdup("the server is shutting down");
    return -ESHUTDOWN;
  }
  if (session_count + count > cfg.max_sessions) {
    *ret_err = xasprintf("cannot fork %u session(s): %u of the %u sessions allowed "
                         "(IGN_MCP_MAX_SESSIONS) are open. Close sessions you no longer need "
                         "(list_sessions shows them), fork fewer, or raise IGN_MCP_MAX_SESSIONS.",
                         count, session_count, cfg.max_sessions);
    session_table_unlock();
    return -EUSERS;
  }
  session_count += count;
  session_table_unlock();

  struct lease l = {0};
  struct stage *st = NULL;
  struct sandbox_snapshot snap = {0};
  /* Each fork gets the source's network policy with a record of its own,
   * copied while the lease keeps the source's egress alive. */
  struct egress *clones[SESSION_FORK_MAX] = {0};
  int r = session_quiet_begin(id, owner, "fork", &l, ret_err);
  for (unsigned i = 0; r == 0 && l.s->egress && i < count; i++)
    if ((r = egress_clone(l.s->egress, &clones[i])) < 0)
      *ret_err = xasprintf("fork of session '%s' failed: its network policy could not be "
                           "copied (%s)", id, strerror(-r));
  if (r == 0)
    r = session_snapshot_lease(&l, NULL, false, NULL, &st, &snap, ret_err);
  if (l.s)
    session_quiet_end(&l);
  struct fork_job jobs[SESSION_FORK_MAX] = {0};
  unsigned made = 0;
  for (unsigned i = 0; r == 0 && i < count; i++, made++) {
    /* The forks are the caller's, as the session they copy is. */
    struct session *s = session_new(owner, 's', session_records_next_seq());
    if (!s) {
      r = -ENOMEM;
      break;
    }
    session_record_add(s);
    s->egress = steal_ptr(clones[i]);
    if (s->egress)
      egress_set_session(s->egress, s->id, s->owner);
    jobs[i] = (struct fork_job){.s = s, .stage = st};
    if (pthread_create(&jobs[i].thread, NULL, fork_main, &jobs[i]) != 0) {
      session_free(s);
      jobs[i].s = NULL;
      r = -EAGAIN;
      break;
    }
  }
  int first_err = r;
  char *first_msg = NULL;
  for (unsigned i = 0; i < made; i++) {
    pthread_join(jobs[i].thread, NULL);
    if (jobs[i].r < 0 && first_err == 0) {
      first_err = jobs[i].r;
      first_msg = steal_ptr(jobs[i].err);
    }
    free(jobs[i].err);
  }
  for (unsigned i = 0; i < count; i++)
    if (clones[i])
      egress_free(clones[i]);
  if (st)
    stage_unref(st); /* the forks' handles hold it */
  json_t *list = json_array();
  struct handle *dead[SESSION_FORK_MAX] = {0};
  pthread_mutex_lock(&session_lock);
  if (first_err == 0 && session_shutting_down) {
    /* Shutdown has closed the table already: these would outlive it. */
    first_err = -ESHUTDOWN;
    first_msg = strdup("the server is shutting down");
  }
  for (unsigned i = 0; i < made; i++) {
    struct session *s = jobs[i].s;
    if (first_err == 0) {
      session_insert_locked(s);
      json_array_append_new(list, json_pack("{s:s, s:s, s:I}", "session_id", s->id, "isolation",
                                            s->h->sb->isolation, "open_ms",
                                            (json_int_t)jobs[i].ms));
    } else {
      /* All or none: the forks that started are closed again. */
      if (s->h) {
        handle_retire(s->h, "closed");
        handle_unref_locked(s->h, &dead[i]);
      }
      session_bury_locked(s);
    }
  }
  if (first_err < 0)
    session_count -= count;
  else
    session_count -= count - made; /* (made == count on success) */
  session_table_unlock();
  for (unsigned i = 0; i < made; i++)
    handle_free(dead[i]);
  if (first_err < 0) {
    json_decref(list);
    if (first_msg) {
      free(*ret_err);
      *ret_err = xasprintf("fork of session '%s' failed: %s; no session was made", id, first_msg);
    } else if (!*ret_err) {
      *ret_err = xasprintf("fork of session '%s' failed: %s", id, strerror(-first_err));
    }
    free(first_msg);
    return first_err;
  }
  *ret = json_pack("{s:o, s:I, s:f, s:s, s:s}", "sessions", list, "fork_ms",
                   (json_int_t)((mono_us() - t0) / 1000), "paused_ms", snap.paused_us / 1000.0,
                   "carries", snap.carries ? snap.carries : "", "source", id);
  log_info("session %s forked %u time(s)", id, count);
  return 0;
}
