/* session.c: opening, resetting and closing a session: making the sandbox
 * that serves it (from the base or a stage) and connecting to its agent,
 * with the session's network policy attached; the sandboxes still being
 * made (which shutdown kills and waits for); sandbox_run's ephemeral
 * sessions; and the answer that describes a session.
 *
 * Egress: every session owns its struct egress (the tool made it from its
 * arguments), which outlives its sandboxes: a handle attaches it to its
 * agent connection once the agent said HELLO, and detaches it when the
 * handle is retired (before the connection is shut down), so a reset moves
 * the policy and the record on to the new sandbox.  Detaching waits for the
 * broker's stream callbacks that run; those never take the table's lock, so
 * it may be held.  The egress goes with the session's last reference, after
 * the lock is dropped (freeing it flushes its log). */
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
#include "session/session_int.h"

#define HELLO_TIMEOUT_MS 30000u

struct making *session_making;
unsigned session_n_making;

static void making_add_locked(struct making *m) {
  m->next = session_making;
  session_making = m;
  session_n_making++;
}

static void making_remove_locked(struct making *m) {
  for (struct making **pp = &session_making; *pp; pp = &(*pp)->next)
    if (*pp == m) {
      *pp = m->next;
      break;
    }
  session_n_making--;
  pthread_cond_broadcast(&session_cond);
}

/* egress_counters_fn for a backend that reads the refusal counters
 * itself: the egress attachment ends (handle_retire, or the next attach)
 * before the handle and so the sandbox are freed. */
static int sandbox_egress_counters(void *ctx, uint64_t ret[3], char **ret_err) {
  struct sandbox *sb = ctx;
  return sb->ops->egress_counters(sb, ret, ret_err);
}

/* Creates a sandbox, connects to its agent and attaches EGRESS (may be
 * NULL) to the connection.  M, already counted in session_n_making by the caller
 * (under the lock), is listed for shutdown. */
static int make_handle_listed(struct making *m, const char *id, struct stage *stage,
                              bool keep_identity, struct egress *egress, struct handle **ret,
                              uint64_t *ret_ms, char **ret_err) {
  uint64_t t0 = mono_us();
  struct sandbox *sb = NULL;
  _cleanup_free_ char *err = NULL;
  struct sandbox_config sc = session_sb_cfg;
  sc.stage = stage;
  sc.keep_identity = keep_identity;
  int r = session_ops->create(&sc, id, &sb, &err);
  if (r < 0) {
    *ret_err = xasprintf("cannot start a sandbox: %s", err ? err : strerror(-r));
    return r;
  }
  pthread_mutex_lock(&session_lock);
  m->sb = sb;
  if (session_shutting_down)
    sb->ops->kill(sb);
  session_table_unlock();
  struct agent_conn *conn = NULL;
  r = sandbox_connect(sb, HELLO_TIMEOUT_MS, &conn, &err);
  if (r == 0)
    r = sb->ops->ready(sb, conn, &err);
  pthread_mutex_lock(&session_lock);
  m->sb = NULL; /* shutdown no longer reaches it */
  bool stopping = session_shutting_down;
  session_table_unlock();
  if (stopping) {
    /* Killed by shutdown, or made just as it began: nobody will use it. */
    *ret_err = strdup("the server is shutting down");
    agent_conn_free(conn);
    sb->ops->destroy(sb);
    return -ESHUTDOWN;
  }
  if (r < 0) {
    _cleanup_free_ char *why = sb->ops->death_reason ? sb->ops->death_reason(sb) : NULL;
    *ret_err = xasprintf("the sandbox started but its agent did not come up: %s%s%s",
                         err ? err : strerror(-r), why ? "; " : "", why ? why : "");
    agent_conn_free(conn);
    sb->ops->destroy(sb);
    return r;
  }
  struct handle *h = calloc(1, sizeof *h);
  if (!h) {
    agent_conn_free(conn);
    sb->ops->destroy(sb);
    return -ENOMEM;
  }
  h->refs = 1;
  h->sb = sb;
  h->conn = conn;
  if (stage) {
    stage_ref(stage);
    stage_sessions_add(stage, 1);
    h->stage = stage;
  }
  if (egress) {
    bool own = sb->ops->egress_counters != NULL;
    egress_attach(egress, conn, own ? sandbox_egress_counters : NULL, own ? sb : NULL);
    h->egress = egress;
  }
  *ret = h;
  *ret_ms = (mono_us() - t0) / 1000;
  return 0;
}

/* make_handle_listed for a caller that holds the lock and has checked that
 * the server is not shutting down; returns with the lock held again, and on
 * success the server is still not shutting down. */
static int make_handle_locked(const char *id, struct stage *stage, bool keep_identity,
                              struct egress *egress, const void *owner, struct handle **ret,
                              uint64_t *ret_ms, char **ret_err) {
  struct making m = {.owner = owner};
  making_add_locked(&m);
  session_table_unlock();
  struct handle *h = NULL;
  int r = make_handle_listed(&m, id, stage, keep_identity, egress, &h, ret_ms, ret_err);
  pthread_mutex_lock(&session_lock);
  if (r == 0 && session_shutting_down) {
    /* Shutdown began after the last look: it is still waiting for this one
     * (session_n_making), so destroy it now. */
    session_table_unlock();
    handle_retire(h, "closed");
    handle_free(h);
    *ret_err = strdup("the server is shutting down");
    r = -ESHUTDOWN;
    pthread_mutex_lock(&session_lock);
  }
  making_remove_locked(&m);
  if (r == 0)
    *ret = h;
  return r;
}

int session_make_handle_locked(const char *id, struct stage *stage, struct egress *egress,
                               const void *owner, struct handle **ret, uint64_t *ret_ms,
                               char **ret_err) {
  return make_handle_locked(id, stage, false, egress, owner, ret, ret_ms, ret_err);
}

int session_make_handle_kept_locked(const char *id, struct stage *stage, struct egress *egress,
                                    struct handle **ret, uint64_t *ret_ms, char **ret_err) {
  return make_handle_locked(id, stage, true, egress, NULL, ret, ret_ms, ret_err);
}

static json_t *describe(const struct session *s, uint64_t open_ms) {
  json_t *o = json_pack("{s:s, s:s, s:s, s:s, s:s}", "session_id", s->id, "isolation",
                        s->h->sb->isolation, "backend", session_ops->name, "rootfs",
                        cfg.rootfs_spec, "limits", s->h->sb->limits);
  if (open_ms != UINT64_MAX)
    json_object_set_new(o, "open_ms", json_integer((json_int_t)open_ms));
  const struct stage *st = s->h->stage;
  json_object_set_new(o, "stage", st && st->name ? json_string(st->name) : json_null());
  json_object_set_new(o, "stage_id", st ? json_string(st->id) : json_null());
  if (s->h->sb->info)
    json_object_update(o, s->h->sb->info);
  if (s->egress)
    json_object_set_new(o, "egress",
                        egress_summary(s->egress, agent_conn_egress_error(s->h->conn)));
  /* Only a vm has a serial console. */
  if (!json_object_get(o, "serial_log_path"))
    json_object_set_new(o, "serial_log_path", json_null());
  return o;
}

/* Opens stage NAME for a sandbox of this server's backend (NULL and 0 when
 * NAME is NULL). */
static int open_stage(const char *name, const char *owner, struct stage **ret, char **ret_err) {
  *ret = NULL;
  if (!name)
    return 0;
  int r = stage_name_check(name, ret_err);
  if (r < 0)
    return r;
  if (!session_stages_supported(ret_err))
    return -EOPNOTSUPP;
  _cleanup_free_ char *inputs = NULL, *text = NULL, *err = NULL;
  r = session_ops->inputs_id(&inputs, &text, &err);
  if (r < 0) {
    *ret_err = xasprintf("cannot open stage '%s' yet: %s", name, err ? err : strerror(-r));
    return r;
  }
  return stage_open(name, owner, session_ops->name, inputs, ret, ret_err);
}

/* Opens a session; with LEASE (sandbox_run) an ephemeral one, handed out
 * already leased.  The session takes *EGRESS (and sets it to NULL) once it
 * exists. */
static int open_taking(const char *owner, const char *stage_name, struct egress **egress,
                       struct lease *lease, json_t **ret, char **ret_err) {
  if (!session_ops) {
    _cleanup_free_ char *help = session_unavailable_help();
    *ret_err = xasprintf("no sandbox backend can run here: %s%s%s", session_backend_error,
                         help ? "\n" : "", help ? help : "");
    return -ENODEV;
  }
  pthread_mutex_lock(&session_lock);
  if (session_shutting_down || session_draining) {
    session_table_unlock();
    *ret_err = strdup("the server is shutting down");
    return -ESHUTDOWN;
  }
  if (session_count >= cfg.max_sessions) {
    session_table_unlock();
    *ret_err = xasprintf("cannot open a session: the limit of %u open sessions is reached "
                         "(IGN_MCP_MAX_SESSIONS). Close one you no longer need with "
                         "close(session_id) (list_sessions shows them), or raise "
                         "IGN_MCP_MAX_SESSIONS.%s",
                         cfg.max_sessions,
                         *owner ? " The limit counts the sessions of every token of this server."
                                : "");
    return -EUSERS;
  }
  session_count++;
  session_table_unlock();

  /* The stage is checked (and verified, the first time) before anything
   * starts, and the id recorded on the store, without the table's lock. */
  struct stage *stage = NULL;
  int r = open_stage(stage_name, owner, &stage, ret_err);
  struct session *s = r < 0 ? NULL : session_new(owner, lease ? 'r' : 's',
                                                 session_records_next_seq());
  if (s) {
    s->ephemeral = lease != NULL;
    session_record_add(s);
  }
  pthread_mutex_lock(&session_lock);
  if (!s) {
    session_count--;
    session_table_unlock();
    if (stage)
      stage_unref(stage);
    return r < 0 ? r : -ENOMEM;
  }
  s->egress = steal_ptr(*egress);
  if (s->egress)
    egress_set_session(s->egress, s->id, s->owner);

  uint64_t ms;
  r = session_shutting_down
          ? -ESHUTDOWN
          : session_make_handle_locked(s->id, stage, s->egress, lease, &s->h, &ms, ret_err);
  if (r == -ESHUTDOWN && !*ret_err)
    *ret_err = strdup("the server is shutting down");
  if (r < 0) {
    /* (Shutdown makes it fail: the sandbox is destroyed by then.) */
    session_count--;
    session_table_unlock();
    session_free(s);
    if (stage)
      stage_unref(stage);
    return r;
  }
  session_insert_locked(s);
  *ret = describe(s, ms);
  if (lease) {
    s->refs++;
    s->busy++;
    s->h->refs++;
    lease->s = s;
    lease->h = s->h;
    lease->resumed_ms = 0;
  }
  session_table_unlock();
  if (stage)
    stage_unref(stage); /* the handle holds its own */
  log_info("%ssession %s opened%s%s (%s, %" PRIu64 " ms)", lease ? "ephemeral " : "", s->id,
           *owner ? " for token " : "", owner, s->h->sb->isolation, ms);
  return 0;
}

static int open_common(const char *owner, const char *stage_name, struct egress *egress,
                       struct lease *lease, json_t **ret, char **ret_err) {
  int r = open_taking(owner, stage_name, &egress, lease, ret, ret_err);
  if (egress) /* the session did not take it */
    egress_free(egress);
  return r;
}

int session_open(const char *owner, const char *stage_name, struct egress *egress, json_t **ret,
                 char **ret_err) {
  return open_common(owner, stage_name, egress, NULL, ret, ret_err);
}

int session_open_ephemeral(const char *owner, const char *stage_name, struct egress *egress,
                           struct lease *ret, json_t **ret_info, char **ret_err) {
  return open_common(owner, stage_name, egress, ret, ret_info, ret_err);
}

void session_end_ephemeral(struct lease *l) {
  char id[SESSION_ID_MAX];
  memcpy(id, l->s->id, sizeof id);
  pthread_mutex_lock(&session_lock);
  /* Shutdown may have closed it already. */
  struct handle *dead = l->s->removed ? NULL : session_close_locked(l->s, "closed");
  pthread_cond_broadcast(&session_cond);
  session_table_unlock();
  handle_free(dead);
  session_release(l); /* the last reference: the sandbox is destroyed here */
  log_info("ephemeral session %s ended", id);
}

void session_kill_starting(const struct lease *l) {
  pthread_mutex_lock(&session_lock);
  for (struct making *m = session_making; m; m = m->next)
    if (m->sb && m->owner == l)
      m->sb->ops->kill(m->sb);
  session_table_unlock();
}

static void (*on_end)(const char *id, const char *owner, const char *why);

void sessions_set_on_end(void (*fn)(const char *id, const char *owner, const char *why)) {
  on_end = fn;
}

int session_reset(const char *id, const char *owner, const char *stage_name, json_t **ret,
                  char **ret_err) {
  /* An id that is not the caller's is refused before anything else: an
   * error about the stage would tell that the session exists. */
  pthread_mutex_lock(&session_lock);
  bool known = session_find_locked(id, owner) != NULL;
  session_table_unlock();
  int ar = known ? 1 : session_adopt(id, owner, ret_err);
  if (ar <= 0) {
    if (!*ret_err)
      *ret_err = session_unknown_id(id, owner);
    return ar < 0 ? ar : -ENOENT;
  }
  /* A stage that cannot be used is refused before the sandbox is thrown
   * away. */
  struct stage *stage = NULL;
  int sr = open_stage(stage_name, owner, &stage, ret_err);
  if (sr < 0) {
    char *m = xasprintf("%s; session '%s' was not reset", *ret_err, id);
    free(*ret_err);
    *ret_err = m;
    return sr;
  }
  if (on_end)
    on_end(id, owner, "was reset");
  pthread_mutex_lock(&session_lock);
  struct session *s = session_find_locked(id, owner);
  if (s)
    session_wait_reset_locked(s);
  if (!s || s->removed) {
    if (s) {
      *ret_err = session_removed_while_waiting(s);
      session_unref_locked(s);
      session_table_unlock();
    } else {
      session_table_unlock();
      *ret_err = session_unknown_id(id, owner); /* reads the store: unlocked */
    }
    if (stage)
      stage_unref(stage);
    return -ENOENT;
  }
  struct stage *hibernated = NULL;
  if (s->hibernated) {
    /* A reset of a hibernated session starts it afresh: it takes a place
     * among the running ones again, and what it was is dropped. */
    if (session_count >= cfg.max_sessions) {
      *ret_err = xasprintf("cannot reset session '%s': it is hibernated, and the limit of %u "
                           "running sessions is reached (IGN_MCP_MAX_SESSIONS). Close one, then "
                           "call again.",
                           id, cfg.max_sessions);
      session_unref_locked(s);
      session_table_unlock();
      if (stage)
        stage_unref(stage);
      return -EUSERS;
    }
    session_count++;
    hibernated = steal_ptr(s->hibernated);
    stage_discard(hibernated);
  }
  /* The reference taken while waiting is the reset's. */
  s->resetting = true;
  struct handle *old = steal_ptr(s->h), *dead = NULL;
  if (old) {
    handle_retire(old, "reset");
    handle_unref_locked(old, &dead);
  }
  session_table_unlock();
  handle_free(dead);
  if (hibernated)
    session_record_resumed(s); /* what it was is dropped */
  stage_unref(hibernated);

  struct handle *h = NULL;
  uint64_t ms;
  int r;
  pthread_mutex_lock(&session_lock);
  if (session_shutting_down || session_draining) {
    *ret_err = strdup("the server is shutting down");
    r = -ESHUTDOWN;
  } else {
    /* The policy and the record go on in the new sandbox. */
    r = session_make_handle_locked(id, stage, s->egress, NULL, &h, &ms, ret_err);
  }
  s->resetting = false;
  s->last_used_ms = mono_ms();
  if (r == 0 && (s->removed || session_shutting_down)) {
    handle_retire(h, "closed");
    handle_unref_locked(h, &dead);
    *ret_err = xasprintf("session '%s' was closed during the reset. Call open_session for a new "
                         "session.", id);
    r = -ENOENT;
  } else if (r == 0) {
    s->h = h;
    *ret = describe(s, ms);
    dead = NULL;
  } else {
    /* Without a sandbox the session cannot serve: drop it. */
    if (!s->removed) {
      session_remove_locked(s, "lost (its reset failed)");
      session_unref_locked(s); /* the table's reference */
    }
    dead = NULL;
    char *msg = xasprintf("%s; session '%s' is closed. Call open_session for a new one.",
                          *ret_err, id);
    free(*ret_err);
    *ret_err = msg;
  }
  session_unref_locked(s);
  pthread_cond_broadcast(&session_cond);
  session_table_unlock();
  handle_free(dead);
  if (stage)
    stage_unref(stage); /* the handle holds its own */
  if (r == 0)
    log_info("session %s reset (%" PRIu64 " ms)", id, ms);
  return r;
}

int session_close(const char *id, const char *owner, char **ret_err) {
  pthread_mutex_lock(&session_lock);
  struct session *s = session_find_locked(id, owner);
  bool known = s && !s->removed;
  session_table_unlock();
  /* One hibernated on the store by a server that is gone is removed there,
   * without being resumed (or, taken by another call of this server
   * meanwhile, closed here). */
  int dropped = s ? 0 : session_adopted_close(id, owner);
  if (dropped == 1) {
    log_info("session %s (hibernated, on the store) closed", id);
    return 0;
  }
  if (dropped == 2) {
    pthread_mutex_lock(&session_lock);
    s = session_find_locked(id, owner);
    known = s && !s->removed;
    session_table_unlock();
  }
  if (known && on_end)
    on_end(id, owner, "was closed");
  /* Found again: it may have gone meanwhile. */
  pthread_mutex_lock(&session_lock);
  s = known ? session_find_locked(id, owner) : NULL;
  if (!s || s->removed) {
    session_table_unlock();
    *ret_err = session_unknown_id(id, owner);
    return -ENOENT;
  }
  /* A reset in progress notices removal and discards its new sandbox. */
  struct handle *dead = session_close_locked(s, "closed");
  pthread_cond_broadcast(&session_cond);
  session_table_unlock();
  handle_free(dead);
  log_info("session %s closed", id);
  return 0;
}
