/* session_hibernate.c: hibernate and resume.  A hibernated session keeps its
 * id, its owner and its network policy and record, but no sandbox: what it
 * was is an anonymous stage (vm: memory, so processes go on after resume;
 * ns: files), and it costs disk only.  The next call that names it resumes
 * it (find_serving_locked): a sandbox is made from that stage under the same
 * id, with the identity it had (hostname, machine id) and, like every clone,
 * fresh entropy and the host's clock.  The idle reaper hibernates instead of
 * closing (IGN_MCP_IDLE_ACTION), and closes what has been hibernated for
 * IGN_MCP_HIBERNATE_KEEP_SECS.  IGN_MCP_HIBERNATE_MAX_MB caps what an owner's
 * hibernated sessions take together: past it, that owner's oldest are closed
 * first.
 *
 * At most 8 x IGN_MCP_MAX_SESSIONS are hibernated in one server, all owners
 * together: past it the server's oldest goes, whoever's.
 *
 * On the store: a hibernation's stage is kept as stages/.hib-<id>
 * (stage_keep) and its record gets hibernated.json (session_record.c), so
 * it outlives its server.  While the server lives, its lock on the record
 * keeps the session its own; at shutdown (IGN_MCP_SHUTDOWN_ACTION=hibernate)
 * it hibernates its live sessions within IGN_MCP_SHUTDOWN_SECS and leaves
 * them all on the store.  A server that finds no session ID of its own
 * claims the record (session_adopt: the record's lock, taken without
 * waiting, makes it one server's), opens the kept stage (checked against
 * this server's inputs: a kernel, QEMU, image or agent changed since is
 * refused before anything starts), makes the egress policy again
 * (egress_load) and takes the session into its table as hibernated; the
 * call then resumes it as any other. */
#include "session/session.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "egress/egress.h"
#include "sandbox/sandbox.h"
#include "sandbox/stage.h"
#include "session/session_int.h"

/* Sessions closed to make room or because they were kept long enough, for
 * list_sessions to name (the newest RECENT_MAX, any owner's). */
#define RECENT_MAX 32u

struct recent {
  char id[SESSION_ID_MAX];
  char *owner;
  char *why;
  int64_t at;
};
static struct recent recent[RECENT_MAX];
static unsigned recent_next;

/* Under the lock. */
static void recent_add_locked(const char *id, const char *owner, const char *why) {
  struct recent *r = &recent[recent_next++ % RECENT_MAX];
  free(r->owner);
  free(r->why);
  snprintf(r->id, sizeof r->id, "%s", id);
  r->owner = strdup(owner);
  r->why = strdup(why);
  r->at = (int64_t)time(NULL);
}

json_t *session_recently_closed_locked(const char *owner) {
  json_t *a = json_array();
  for (unsigned i = 0; i < RECENT_MAX; i++) {
    const struct recent *r = &recent[i];
    if (r->owner && r->why && strcmp(r->owner, owner) == 0)
      json_array_append_new(a, json_pack("{s:s, s:s, s:I}", "session_id", r->id, "why", r->why,
                                         "at", (json_int_t)r->at));
  }
  return a;
}

/* The order of hibernations (under the lock): the oldest goes first. */
static uint64_t hibernation_order;

/* Hibernated sessions that are not being resumed. */
static bool kept_locked(const struct session *s) { return s->hibernated && !s->resetting; }

uint64_t session_hibernated_bytes_locked(const char *owner) {
  uint64_t sum = 0;
  for (struct session *s = session_table; s; s = s->next)
    if (kept_locked(s) && strcmp(s->owner, owner) == 0)
      sum += s->hibernated->bytes;
  return sum;
}

static unsigned hibernated_count_locked(void) {
  unsigned n = 0;
  for (struct session *s = session_table; s; s = s->next)
    n += kept_locked(s);
  return n;
}

/* How many hibernated sessions a server holds at most, all owners together:
 * each holds a few descriptors and its place in the table. */
static unsigned hibernated_max(void) { return 8 * cfg.max_sessions; }

/* Closes hibernated session S (under the lock), noting WHY for list_sessions;
 * the stage it held goes when S is freed. */
static void close_hibernated_locked(struct session *s, const char *why) {
  recent_add_locked(s->id, s->owner, why);
  struct handle *none = session_close_locked(s, why);
  (void)none; /* a hibernated session has no handle */
  log_info("session %s (hibernated) closed: %s", s->id, why);
}

/* Lets hibernated session S (under the lock) go back to the store, where it
 * stays for any server of its owner (this one too) to take again: nothing
 * of it is lost.  False when it has nothing on the store to go back to. */
static bool release_locked(struct session *s) {
  if (s->record_fd < 0 || !s->hibernated || !s->hibernated->kept)
    return false;
  s->outlives = true;
  struct handle *none = session_close_locked(s, "released to the store");
  (void)none;
  log_info("session %s (hibernated) left on the store, to make room in this server", s->id);
  return true;
}

/* OWNER's (NULL: anyone's) oldest hibernated session other than SELF, or
 * NULL. */
static struct session *oldest_locked(const char *owner, const struct session *self) {
  struct session *oldest = NULL;
  for (struct session *s = session_table; s; s = s->next)
    if (s != self && kept_locked(s) && (!owner || strcmp(s->owner, owner) == 0) &&
        (!oldest || s->hibernated_seq < oldest->hibernated_seq))
      oldest = s;
  return oldest;
}

/* Makes room for one more hibernation of OWNER taking BYTES: closes that
 * owner's oldest hibernated sessions until its bytes fit
 * IGN_MCP_HIBERNATE_MAX_MB (never another owner's), then the server's
 * oldest, whoever's, until its count fits hibernated_max() (so that no
 * owner can fill the server's count and leave another none; never SELF).
 * False (*ret_why says which) when they cannot. */
static bool make_room_locked(const char *owner, const struct session *self, uint64_t bytes,
                             const char **ret_why) {
  const uint64_t max = (uint64_t)cfg.hibernate_max_mb << 20;
  if (bytes > max) {
    *ret_why = "bytes";
    return false;
  }
  for (;;) {
    bool over_bytes = session_hibernated_bytes_locked(owner) + bytes > max;
    bool over_count = hibernated_count_locked() + 1 > hibernated_max();
    if (!over_bytes && !over_count)
      return true;
    struct session *oldest = oldest_locked(over_bytes ? owner : NULL, self);
    if (!oldest) {
      *ret_why = over_bytes ? "bytes" : "count";
      return false;
    }
    /* Past the count, one kept on the store goes back there, not away. */
    if (!over_bytes && release_locked(oldest))
      continue;
    _cleanup_free_ char *why =
        over_bytes ? xasprintf("closed to make room for the hibernation of session %s "
                               "(IGN_MCP_HIBERNATE_MAX_MB=%u)",
                               self->id, cfg.hibernate_max_mb)
                   /* Maybe another owner's: not named. */
                   : xasprintf("closed to make room for a newer hibernation (this server "
                               "holds at most %u hibernated sessions, 8 x "
                               "IGN_MCP_MAX_SESSIONS; the oldest goes first)",
                               hibernated_max());
    close_hibernated_locked(oldest, why);
  }
}

/* What an already hibernated session of OWNER says; -ENOENT when ID is not one. */
static int already_locked(const char *id, const char *owner, json_t **ret) {
  struct session *s = session_find_locked(id, owner);
  if (!s || s->removed || !kept_locked(s))
    return -ENOENT;
  *ret = json_pack("{s:s, s:s, s:s, s:I, s:I, s:I, s:b}", "session_id", id, "state", "hibernated",
                   "carries", s->carries, "bytes", (json_int_t)s->hibernated->bytes,
                   "hibernate_ms", (json_int_t)0, "hibernated_at", (json_int_t)s->hibernated_at,
                   "already", 1);
  return 0;
}

/* Keeps S's hibernation ST on the store (no lock held): the stage as
 * .hib-<id> and the record's hibernated.json, so that another server can
 * resume S once this one is gone.  Whether it is; if not, S is hibernated
 * in this server only (logged). */
static bool keep_on_store(struct session *s, struct stage *st, const char *carries,
                          const char *isolation, int64_t at) {
  if (s->record_fd < 0)
    return false;
  _cleanup_free_ char *err = NULL;
  if (stage_keep(st, s->id, &err) < 0) {
    log_warn("session %s is hibernated in this server only: %s", s->id, err);
    return false;
  }
  json_t *j = json_pack("{s:i, s:s, s:s, s:s, s:s, s:s, s:I, s:I, s:o*}", "version", 1, "id",
                        s->id, "owner", s->owner, "backend", session_ops->name, "isolation",
                        isolation, "carries", carries, "bytes", (json_int_t)st->bytes,
                        "hibernated_at", (json_int_t)at, "egress",
                        s->egress ? egress_save(s->egress) : NULL);
  int r = j ? session_record_hibernated(s, j) : -ENOMEM;
  if (r < 0) {
    log_warn("session %s is hibernated in this server only: its record on the store cannot be "
             "written (%s)",
             s->id, strerror(-r));
    stage_unkeep(st);
    return false;
  }
  return true;
}

/* Closes OWNER's oldest hibernations on the store that no server holds
 * until, with this server's, they fit IGN_MCP_HIBERNATE_MAX_MB (no lock
 * held; after a hibernation is made, never before: one refused must cost
 * nothing). */
static void trim_store(const char *owner) {
  const uint64_t max = (uint64_t)cfg.hibernate_max_mb << 20;
  pthread_mutex_lock(&session_lock);
  uint64_t used = session_hibernated_bytes_locked(owner);
  session_table_unlock();
  json_t *kept = session_records_kept(owner);
  uint64_t on_store = 0;
  size_t i;
  json_t *k;
  json_array_foreach(kept, i, k) on_store += (uint64_t)json_integer_value(json_object_get(k, "bytes"));
  json_array_foreach(kept, i, k) {
    if (used + on_store <= max)
      break;
    const char *id = json_string_value(json_object_get(k, "session_id"));
    if (!session_record_drop(id, owner))
      continue;
    on_store -= (uint64_t)json_integer_value(json_object_get(k, "bytes"));
    _cleanup_free_ char *why = xasprintf("closed to make room for a newer hibernation "
                                         "(IGN_MCP_HIBERNATE_MAX_MB=%u)",
                                         cfg.hibernate_max_mb);
    pthread_mutex_lock(&session_lock);
    recent_add_locked(id, owner, why);
    session_table_unlock();
    log_info("session %s (hibernated, on the store) closed: %s", id, why);
  }
  json_decref(kept);
}

/* Hibernates session ID of OWNER.  IDLE_SINCE (the reaper's): the session
 * is taken only if no call runs in it nor has used it since that moment,
 * and if it cannot be saved it is closed instead, unless a call came
 * meanwhile (-EBUSY: left as it is). */
static int hibernate(const char *id, const char *owner, const uint64_t *idle_since,
                     uint32_t wait_ms, json_t **ret, char **ret_err) {
  if (!session_stages_supported(ret_err))
    return -EOPNOTSUPP;
  if (cfg.hibernate_max_mb == 0) {
    *ret_err = strdup("hibernation is off on this server (IGN_MCP_HIBERNATE_MAX_MB=0); close "
                      "the session instead, or ask for a server with room for hibernations");
    return -EOPNOTSUPP;
  }
  uint64_t t0 = mono_us();
  struct lease l;
  int r = session_quiet_take(id, owner, "hibernate", idle_since ? 0 : wait_ms, false, &l,
                             ret_err);
  if (r == -EALREADY) {
    /* Hibernated already (by another call, or meanwhile): said so. */
    pthread_mutex_lock(&session_lock);
    r = already_locked(id, owner, ret);
    session_table_unlock();
    if (r < 0)
      *ret_err = session_unknown_id(id, owner);
    return r;
  }
  if (r < 0)
    return r;
  struct session *s = l.s;
  if (idle_since) {
    pthread_mutex_lock(&session_lock);
    bool used = s->last_used_ms != *idle_since;
    session_table_unlock();
    if (used) {
      session_quiet_end(&l);
      *ret_err = strdup("a call used it meanwhile");
      return -EBUSY;
    }
  }
  struct stage *st = NULL;
  /* Final: its processes stay stopped from the snapshot on, so that
   * nothing they do afterwards is lost, or done twice after the resume. */
  struct sandbox_snapshot snap = {.final = true};
  r = session_snapshot_lease(&l, NULL, false, NULL, &st, &snap, ret_err);
  int64_t at = (int64_t)time(NULL);
  bool on_store = false;
  if (r == 0)
    on_store = keep_on_store(s, st, snap.carries, l.h->sb->isolation, at);
  pthread_mutex_lock(&session_lock);
  const char *full = NULL;
  if (r == 0 && s->removed) {
    *ret_err = session_removed_while_waiting(s);
    r = -ENOENT;
  } else if (r == 0 && !make_room_locked(owner, s, st->bytes, &full)) {
    *ret_err = strcmp(full, "bytes") == 0
                   ? xasprintf("session '%s' takes %" PRIu64 " bytes hibernated, more than "
                               "IGN_MCP_HIBERNATE_MAX_MB (%u MiB) allows; it was not "
                               "hibernated and goes on running",
                               id, st->bytes, cfg.hibernate_max_mb)
                   : xasprintf("this server can hold no more hibernated sessions (8 x "
                               "IGN_MCP_MAX_SESSIONS); session '%s' was not hibernated and goes "
                               "on running",
                               id);
    r = -ENOSPC;
  }
  struct handle *dead = NULL;
  if (r == 0) {
    /* The quiet lease holds a reference to the handle; the table's goes. */
    struct handle *h = steal_ptr(s->h);
    s->isolation = h->sb->isolation;
    handle_retire(h, "hibernated");
    handle_unref_locked(h, &dead);
    s->hibernated = steal_ptr(st);
    s->hibernated_at = at;
    s->hibernated_seq = ++hibernation_order;
    s->carries = snap.carries;
    session_count--; /* a hibernated session holds no sandbox */
    *ret = json_pack("{s:s, s:s, s:s, s:I, s:I, s:f, s:I}", "session_id", id, "state",
                     "hibernated", "carries", s->carries, "bytes",
                     (json_int_t)s->hibernated->bytes, "hibernate_ms",
                     (json_int_t)((mono_us() - t0) / 1000), "paused_ms", snap.paused_us / 1000.0,
                     "hibernated_at", (json_int_t)s->hibernated_at);
  } else if (idle_since && !s->removed && s->refs == 2) {
    /* The reaper's, and no call waits for it (the table's reference and
     * the quiet lease's are all): it is closed, as an idle session was
     * before hibernation. */
    dead = session_close_locked(s, "reaped after being idle (it could not be hibernated)");
    r = -ECANCELED;
  }
  bool gone = s->removed;
  pthread_cond_broadcast(&session_cond);
  session_table_unlock();
  handle_free(dead);
  if (r < 0 && st) {
    /* Saved, then refused: it runs on, unless it is gone; the save goes. */
    if (on_store)
      session_record_resumed(s);
    if (!gone)
      session_snapshot_unpause(&l, &snap);
    stage_discard(st);
    stage_unref(st);
  }
  session_quiet_end(&l);
  if (r == 0) {
    log_info("session %s hibernated (%s, %" PRIu64 " ms)", id, snap.carries,
             (mono_us() - t0) / 1000);
    /* Made: the owner's oldest on the store go now if it passed the cap. */
    if (on_store)
      trim_store(owner);
  }
  return r;
}

int session_hibernate(const char *id, const char *owner, json_t **ret, char **ret_err) {
  return hibernate(id, owner, NULL, SESSION_QUIET_WAIT_MS, ret, ret_err);
}

static int hibernate_within(const char *id, const char *owner, uint32_t wait_ms, json_t **ret,
                            char **ret_err) {
  return hibernate(id, owner, NULL, wait_ms, ret, ret_err);
}

int session_hibernate_idle(const char *id, const char *owner, uint64_t idle_since,
                           char **ret_err) {
  json_t *info = NULL;
  int r = hibernate(id, owner, &idle_since, 0, &info, ret_err);
  json_decref(info);
  return r;
}

int session_resume_locked(struct session *s, char **ret_err) {
  if (session_shutting_down || session_draining) {
    *ret_err = strdup("the server is shutting down");
    return -ESHUTDOWN;
  }
  if (session_count >= cfg.max_sessions) {
    *ret_err = xasprintf("cannot resume session '%s': the limit of %u running sessions is "
                         "reached (IGN_MCP_MAX_SESSIONS; hibernated ones do not count). Close or "
                         "hibernate one, then call again.",
                         s->id, cfg.max_sessions);
    return -EUSERS;
  }
  session_count++;
  s->resetting = true; /* other calls wait, as for a reset */
  struct stage *st = s->hibernated;
  uint64_t t0 = mono_us(), ms;
  struct handle *h = NULL;
  int r = session_make_handle_kept_locked(s->id, st, s->egress, &h, &ms, ret_err);
  if (r == 0 && st->kept && !s->removed && !session_shutting_down) {
    /* Resumed: not on the store any more (the record's hibernated.json
     * and the stage's kept name go; the lock dropped, other calls still
     * wait). */
    pthread_mutex_unlock(&session_lock);
    stage_unkeep(st);
    session_record_resumed(s);
    pthread_mutex_lock(&session_lock);
  }
  s->resetting = false;
  pthread_cond_broadcast(&session_cond);
  if (r == 0 && (s->removed || session_shutting_down)) {
    struct handle *dead = NULL;
    handle_retire(h, "closed");
    handle_unref_locked(h, &dead);
    /* Freed without the lock, as always. */
    pthread_mutex_unlock(&session_lock);
    handle_free(dead);
    pthread_mutex_lock(&session_lock);
    *ret_err = xasprintf("session '%s' was closed while it was being resumed", s->id);
    r = -ENOENT;
  }
  if (r < 0) {
    session_count--;
    if (r != -ENOENT) {
      char *m = xasprintf("session '%s' could not be resumed: %s; it stays hibernated (close "
                          "it, or call again)",
                          s->id, *ret_err);
      free(*ret_err);
      *ret_err = m;
    }
    return r;
  }
  s->h = h;
  s->hibernated = NULL;
  s->adopted = false;
  s->resumed_ms = (mono_us() - t0) / 1000;
  s->last_used_ms = mono_ms();
  log_info("session %s resumed (%" PRIu64 " ms)", s->id, s->resumed_ms);
  /* The handle holds its own reference to the stage: this one is never
   * the last, so dropping it here does no I/O. */
  stage_unref(st);
  return 0;
}

bool session_expire_hibernated_locked(void) {
  int64_t now = (int64_t)time(NULL);
  for (struct session *s = session_table; s; s = s->next)
    if (s->hibernated && !s->busy && !s->resetting &&
        now - s->hibernated_at >= (int64_t)cfg.hibernate_keep_secs) {
      _cleanup_free_ char *why = xasprintf("closed after %u s hibernated "
                                           "(IGN_MCP_HIBERNATE_KEEP_SECS)",
                                           cfg.hibernate_keep_secs);
      close_hibernated_locked(s, why);
      return true;
    }
  return false;
}

/* One claim at a time in this server: a call that waited finds the session
 * the other took into the table. */
static pthread_mutex_t adopt_lock = PTHREAD_MUTEX_INITIALIZER;

/* "memory" or "files": the static strings s->carries points to. */
static const char *carries_static(const char *c) {
  return c && strcmp(c, "memory") == 0 ? "memory" : "files";
}

int session_adopt(const char *id, const char *owner, char **ret_err) {
  _cleanup_free_ char *why_not = NULL, *inputs = NULL, *text = NULL, *err = NULL, *what = NULL;
  /* Most misses are ids with no hibernation on the store: answered without
   * waiting for another call's claim. */
  if (!session_stages_supported(&why_not) || !session_record_maybe_hibernated(id, owner))
    return 0;
  pthread_mutex_lock(&adopt_lock);
  pthread_mutex_lock(&session_lock);
  bool have = session_find_locked(id, owner) != NULL;
  bool stopping = session_shutting_down || session_draining;
  session_table_unlock();
  int r = have ? 1 : 0;
  struct record_claim c = {.fd = -1};
  struct stage *st = NULL;
  struct egress *e = NULL;
  if (!have && stopping) {
    *ret_err = strdup("the server is shutting down: call again once a server runs on the store");
    r = -ESHUTDOWN;
    goto out;
  }
  if (have || (r = session_record_claim(id, owner, false, &c, ret_err)) <= 0)
    goto out;
  int64_t at = (int64_t)json_integer_value(json_object_get(c.hib, "hibernated_at"));
  if ((int64_t)time(NULL) - at >= (int64_t)cfg.hibernate_keep_secs) {
    /* Kept long enough: gone, as the reaper would have closed it. */
    session_record_unclaim(id, &c);
    if (session_record_drop(id, owner))
      log_info("session %s (hibernated) closed: kept %u s (IGN_MCP_HIBERNATE_KEEP_SECS)", id,
               cfg.hibernate_keep_secs);
    r = 0;
    goto out;
  }
  what = xasprintf("session '%s'", id);
  r = session_ops->inputs_id(&inputs, &text, &err);
  if (r < 0) {
    *ret_err = xasprintf("session '%s' is hibernated, but cannot be resumed yet: %s", id,
                         err ? err : strerror(-r));
    goto out;
  }
  r = stage_open_kept(id, what, owner, session_ops->name, inputs, &st, ret_err);
  if (r == -ENOENT) {
    /* Its saved state is gone (a server died while resuming it): the
     * record says lost from now on, not hibernated. */
    session_record_forget_hibernation(id);
    free(steal_ptr(*ret_err));
    *ret_err = xasprintf("session '%s' was lost: its saved state is no longer on the store (a "
                         "server that was resuming it ended first). Call open_session for a "
                         "new session.",
                         id);
  }
  if (r < 0)
    goto out;
  const json_t *saved = json_object_get(c.hib, "egress");
  if (saved && (r = egress_load(saved, &e, &err)) < 0) {
    *ret_err = xasprintf("session '%s' cannot be resumed: %s", id, err);
    goto out;
  }
  if (e)
    egress_set_session(e, id, owner);
  struct session *s = calloc(1, sizeof *s);
  if (!s || !(s->owner = strdup(owner))) {
    free(s);
    *ret_err = strdup("out of memory");
    r = -ENOMEM;
    goto out;
  }
  snprintf(s->id, sizeof s->id, "%s", id);
  s->refs = 1;
  s->egress = steal_ptr(e);
  s->hibernated = steal_ptr(st);
  s->hibernated_at = (int64_t)json_integer_value(json_object_get(c.hib, "hibernated_at"));
  const char *iso = json_string_value(json_object_get(c.hib, "isolation"));
  s->isolation_saved = iso ? strndup(iso, 64) : NULL;
  s->isolation = s->isolation_saved;
  s->carries = carries_static(json_string_value(json_object_get(c.hib, "carries")));
  s->record_fd = session_record_claimed(&c);
  s->adopted = true;
  pthread_mutex_lock(&session_lock);
  /* Past the server's count, its oldest goes back to the store first (it
   * loses nothing). */
  while (hibernated_count_locked() >= hibernated_max()) {
    struct session *oldest = oldest_locked(NULL, NULL);
    if (!oldest || !release_locked(oldest))
      break;
  }
  s->hibernated_seq = ++hibernation_order;
  session_insert_locked(s);
  session_table_unlock();
  log_info("session %s (hibernated on the store) taken by this server", id);
  r = 1;
out:
  pthread_mutex_unlock(&adopt_lock);
  /* Not taken: the record is free again, as it was, for a server that can. */
  session_record_unclaim(id, &c);
  if (st)
    stage_unref(st); /* kept: it stays */
  if (e)
    egress_free(e);
  return r;
}

int session_adopted_close(const char *id, const char *owner) {
  if (!session_record_maybe_hibernated(id, owner))
    return 0;
  pthread_mutex_lock(&adopt_lock);
  pthread_mutex_lock(&session_lock);
  bool have = session_find_locked(id, owner) != NULL;
  session_table_unlock();
  int r = have ? 2 : session_record_drop(id, owner) ? 1 : 0;
  pthread_mutex_unlock(&adopt_lock);
  return r;
}

/* ---- at shutdown ---- */

bool session_hibernate_all(void) {
  if (!cfg.shutdown_hibernate || !cfg.hibernate_max_mb || !session_ops || !session_ops->snapshot)
    return false;
  uint64_t deadline = mono_ms() + (uint64_t)cfg.shutdown_secs * 1000;
  struct {
    char id[SESSION_ID_MAX];
    char *owner;
  } todo[1024];
  size_t n = 0;
  pthread_mutex_lock(&session_lock);
  /* The idle ones first: a busy one may take the time left waiting for
   * its calls. */
  for (int busy = 0; busy < 2; busy++)
    for (struct session *s = session_table; s && n < ARRAY_SIZE(todo); s = s->next)
      if (s->h && !s->hibernated && !s->ephemeral && s->record_fd >= 0 && (s->busy > 0) == busy) {
        memcpy(todo[n].id, s->id, sizeof todo[n].id);
        todo[n++].owner = strdup(s->owner);
      }
  session_table_unlock();
  if (n)
    log_info("hibernating %zu session(s) before exiting (IGN_MCP_SHUTDOWN_SECS=%u)", n,
             cfg.shutdown_secs);
  unsigned saved = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t now = mono_ms();
    _cleanup_free_ char *err = NULL;
    json_t *info = NULL;
    int r = -ETIMEDOUT;
    pthread_mutex_lock(&session_lock);
    struct session *s = session_find_locked(todo[i].id, todo[i].owner ? todo[i].owner : "");
    /* Being saved or reset by another call: waiting for it is not bounded. */
    bool saving = s && (s->snapshotting || s->resetting);
    session_table_unlock();
    if (saving) {
      r = -EBUSY;
      err = strdup("another call was saving or resetting it");
    } else if (todo[i].owner && now < deadline) {
      uint64_t left = deadline - now;
      r = hibernate_within(todo[i].id, todo[i].owner,
                           (uint32_t)(left < SESSION_QUIET_WAIT_MS ? left : SESSION_QUIET_WAIT_MS),
                           &info, &err);
    }
    json_decref(info);
    if (r == 0)
      saved++;
    else
      log_warn("session %s is closed, not hibernated, as the server exits: %s", todo[i].id,
               r == -ETIMEDOUT ? "no time was left (IGN_MCP_SHUTDOWN_SECS)" : err ? err : "?");
    free(todo[i].owner);
  }
  if (n)
    log_info("%u of %zu session(s) hibernated before exiting", saved, n);
  return true;
}
