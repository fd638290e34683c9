/* session_table.c: the session table.  It owns the list of sessions and
 * the count the cap (IGN_MCP_MAX_SESSIONS) is checked against, the ids
 * (session_new) and the lookup by id and owner, the lifetimes of sessions
 * and of their handles (references, retiring, freeing once the lock is
 * dropped), removal from the table, and list_sessions.
 *
 * Owners: every session belongs to the owner that opened it (the HTTP
 * token's name, "" on stdio), passed in by each call.  To any other owner a
 * session does not exist: lookups compare the owner with the id, and the
 * error is the one for an id nobody opened, so a token cannot learn what
 * another holds.  The cap on sessions is the server's, shared by all.
 *
 * Host ids: with IGN_MCP_HOST_ID every id starts with "<host>.", so that a
 * front proxy can route on it; an id of another host gets an error naming
 * that host instead of the one for an unknown id. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/config.h"
#include "common/util.h"
#include "egress/egress.h"
#include "sandbox/stage.h"
#include "session/session_int.h"

pthread_mutex_t session_lock = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t session_cond = PTHREAD_COND_INITIALIZER;
struct session *session_table;
unsigned session_count;
unsigned session_next_seq;
bool session_shutting_down;
bool session_draining;

/* Sessions whose last reference went while the lock was held, linked by
 * next: freed by session_table_unlock once the lock is dropped. */
static struct session *graveyard;

void handle_unref_locked(struct handle *h, struct handle **ret_dead) {
  *ret_dead = --h->refs == 0 ? h : NULL;
}

void handle_free(struct handle *h) {
  if (!h)
    return;
  agent_conn_free(h->conn);
  h->sb->ops->destroy(h->sb);
  if (h->stage) {
    stage_sessions_add(h->stage, -1);
    stage_unref(h->stage);
  }
  free(h);
}

void handle_retire(struct handle *h, const char *why) {
  if (h->retired)
    return;
  h->retired = why;
  if (h->egress)
    egress_detach_why(h->egress, strcmp(why, "hibernated") == 0
                                     ? "the session was hibernated (connections do not "
                                       "survive a hibernation; the sandbox reconnects after "
                                       "its resume)"
                                     : NULL);
  agent_conn_shutdown(h->conn);
  /* The backend kills: it alone knows whether its process was reaped. */
  h->sb->ops->kill(h->sb);
}

void session_free(struct session *s) {
  if (!s)
    return;
  /* The saved state before the record: a record without it reads as lost,
   * a kept stage without its record is an orphan the next sweep removes. */
  if (s->hibernated && !s->outlives)
    stage_discard(s->hibernated);
  stage_unref(s->hibernated);
  session_record_remove(s);
  if (s->egress)
    egress_free(s->egress);
  free(s->isolation_saved);
  free(s->owner);
  free(s);
}

void session_bury_locked(struct session *s) {
  s->next = graveyard;
  graveyard = s;
}

void session_unref_locked(struct session *s) {
  if (--s->refs == 0)
    session_bury_locked(s);
}

void session_table_unlock(void) {
  struct session *dead = steal_ptr(graveyard);
  pthread_mutex_unlock(&session_lock);
  while (dead) {
    struct session *next = dead->next;
    session_free(dead);
    dead = next;
  }
}

unsigned session_local_seq(void) {
  pthread_mutex_lock(&session_lock);
  unsigned v = ++session_next_seq;
  pthread_mutex_unlock(&session_lock);
  return v;
}

/* A new session (one reference) of OWNER with a fresh id: "[<host>.]" then
 * KIND ('s', or 'r' for sandbox_run's), the sequence number SEQ and 16
 * random bits, which keep an id of a server that restarted from naming a
 * session of the one before. */
struct session *session_new(const char *owner, char kind, unsigned seq) {
  struct session *s = calloc(1, sizeof *s);
  if (!s)
    return NULL;
  s->owner = strdup(owner);
  if (!s->owner) {
    free(s);
    return NULL;
  }
  uint16_t rnd = 0;
  if (getrandom(&rnd, sizeof rnd, GRND_NONBLOCK) != sizeof rnd)
    rnd = (uint16_t)mono_us();
  /* At most 16 + 1 + 1 + 10 + 1 + 4 characters: SESSION_ID_MAX holds it. */
  snprintf(s->id, sizeof s->id, "%s%s%c%u-%04x", cfg.host_id, cfg.host_id[0] ? "." : "", kind,
           seq, rnd);
  s->refs = 1;
  s->record_fd = -1;
  return s;
}

struct session *session_find_locked(const char *id, const char *owner) {
  for (struct session *s = session_table; s; s = s->next)
    if (strcmp(s->id, id) == 0 && !s->ephemeral && strcmp(s->owner, owner) == 0)
      return s;
  return NULL;
}

void session_insert_locked(struct session *s) {
  s->created_ms = s->last_used_ms = mono_ms();
  s->next = session_table;
  session_table = s;
}

void session_remove_locked(struct session *s, const char *why) {
  for (struct session **pp = &session_table; *pp; pp = &(*pp)->next)
    if (*pp == s) {
      *pp = s->next;
      break;
    }
  s->removed = true;
  s->removed_why = why;
  /* A hibernated session gave its place back when it was hibernated (a
   * resume under way takes it again, and gives it back if it fails). */
  if (!s->hibernated)
    session_count--;
}

bool session_id_host(const char *id, char ret_host[static CONFIG_HOST_ID_MAX + 1]) {
  const char *dot = strchr(id, '.');
  if (!dot || !config_host_id_valid(id, (size_t)(dot - id)) || !dot[1])
    return false;
  memcpy(ret_host, id, (size_t)(dot - id));
  ret_host[dot - id] = '\0';
  return true;
}

char *session_id_elsewhere(const char *id) {
  char host[CONFIG_HOST_ID_MAX + 1];
  if (!session_id_host(id, host) || strcmp(host, cfg.host_id) == 0)
    return NULL;
  _cleanup_free_ char *here = cfg.host_id[0]
                                  ? xasprintf("this host '%s'", cfg.host_id)
                                  : strdup("this server (it has no IGN_MCP_HOST_ID)");
  return xasprintf("session '%s' is held by host '%s', not %s: send calls for it to %s (a front "
                   "proxy routes on the Mcp-Param-Session-Id header; docs/scale-out.md)",
                   id, host, here, host);
}

/* For an id no session of the caller has.  The same words whether nobody
 * opened it or another owner did: that is not the caller's to know (the
 * store's record of it is read for its owner only). */
char *session_unknown_id(const char *id, const char *owner) {
  /* The store first: hosts that share it know where a session went (held
   * by another server, lost with its server) better than the id's prefix. */
  char *known = session_record_whereabouts(id, owner);
  if (known)
    return known;
  char *elsewhere = session_id_elsewhere(id);
  if (elsewhere)
    return elsewhere;
  return xasprintf("unknown session_id '%s': no open session has this id (it was never opened, "
                   "or it was closed, or reaped after %u s idle). Call open_session to get a new "
                   "one; list_sessions shows the open ones.",
                   id, cfg.idle_secs);
}

struct handle *session_close_locked(struct session *s, const char *why) {
  session_remove_locked(s, why);
  struct handle *dead = NULL;
  if (s->h) {
    struct handle *h = steal_ptr(s->h);
    handle_retire(h, why);
    handle_unref_locked(h, &dead);
  }
  session_unref_locked(s);
  return dead;
}

json_t *session_list(const char *owner) {
  json_t *arr = json_array();
  /* Hibernated by servers that are gone: any call resumes them here. */
  json_t *stored = session_records_kept(owner);
  uint64_t now = mono_ms();
  pthread_mutex_lock(&session_lock);
  for (struct session *s = session_table; s; s = s->next) {
    if (strcmp(s->owner, owner) != 0)
      continue;
    json_t *o = json_pack("{s:s, s:s, s:I, s:I, s:b, s:b, s:o}", "session_id", s->id, "isolation",
                          s->h ? s->h->sb->isolation
                          : s->hibernated && s->isolation ? s->isolation
                                                          : "(resetting)", "age_s",
                          (json_int_t)((now - s->created_ms) / 1000), "idle_s",
                          (json_int_t)(s->busy ? 0 : (now - s->last_used_ms) / 1000), "busy",
                          s->busy > 0, "alive", s->h && agent_conn_alive(s->h->conn), "stage",
                          s->h && s->h->stage && s->h->stage->name ? json_string(s->h->stage->name)
                                                                   : json_null());
    if (s->ephemeral)
      json_object_set_new(o, "ephemeral", json_true());
    json_object_set_new(o, "state", json_string(s->hibernated && !s->resetting ? "hibernated"
                                                                               : "running"));
    if (s->hibernated) {
      json_object_set_new(o, "bytes", json_integer((json_int_t)s->hibernated->bytes));
      json_object_set_new(o, "hibernated_at", json_integer((json_int_t)s->hibernated_at));
      json_object_set_new(o, "carries", json_string(s->carries));
    }
    json_array_append_new(arr, o);
  }
  json_t *closed = session_recently_closed_locked(owner);
  uint64_t hib = session_hibernated_bytes_locked(owner);
  session_table_unlock();
  size_t i;
  json_t *k;
  int64_t wall = (int64_t)time(NULL);
  json_array_foreach(stored, i, k) {
    hib += (uint64_t)json_integer_value(json_object_get(k, "bytes"));
    int64_t at = (int64_t)json_integer_value(json_object_get(k, "hibernated_at"));
    json_object_update_missing_new(
        k, json_pack("{s:s, s:I, s:I, s:b, s:b, s:n, s:b}", "isolation", "(hibernated)", "age_s",
                     (json_int_t)0, "idle_s", (json_int_t)(wall > at ? wall - at : 0), "busy", 0,
                     "alive", 0, "stage", "on_store", 1));
    json_array_append(arr, k);
  }
  json_decref(stored);
  return json_pack("{s:o, s:i, s:i, s:I, s:i, s:o}", "sessions", arr, "max_sessions",
                   (int)cfg.max_sessions, "idle_secs", (int)cfg.idle_secs, "hibernated_bytes",
                   (json_int_t)hib, "hibernate_max_mb", (int)cfg.hibernate_max_mb,
                   "recently_closed", closed);
}
