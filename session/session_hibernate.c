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
 * Hibernated sessions live in the table, as long as their server: at
 * shutdown they are closed like the others. */
#include "session/session.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
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
static void recent_add_locked(const struct session *s, const char *why) {
  struct recent *r = &recent[recent_next++ % RECENT_MAX];
  free(r->owner);
  free(r->why);
  memcpy(r->id, s->id, sizeof r->id);
  r->owner = strdup(s->owner);
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
  recent_add_locked(s, why);
  struct handle *none = session_close_locked(s, why);
  (void)none; /* a hibernated session has no handle */
  log_info("session %s (hibernated) closed: %s", s->id, why);
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

/* Hibernates session ID of OWNER.  IDLE_SINCE (the reaper's): the session
 * is taken only if no call runs in it nor has used it since that moment,
 * and if it cannot be saved it is closed instead, unless a call came
 * meanwhile (-EBUSY: left as it is). */
static int hibernate(const char *id, const char *owner, const uint64_t *idle_since, json_t **ret,
                     char **ret_err) {
  if (!session_stages_supported(ret_err))
    return -EOPNOTSUPP;
  if (cfg.hibernate_max_mb == 0) {
    *ret_err = strdup("hibernation is off on this server (IGN_MCP_HIBERNATE_MAX_MB=0); close "
                      "the session instead, or ask for a server with room for hibernations");
    return -EOPNOTSUPP;
  }
  uint64_t t0 = mono_us();
  struct lease l;
  int r = session_quiet_take(id, owner, "hibernate", idle_since ? 0 : SESSION_QUIET_WAIT_MS,
                             false, &l, ret_err);
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
    s->hibernated_at = (int64_t)time(NULL);
    static uint64_t order;
    s->hibernated_seq = ++order; /* under the lock */
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
    /* Saved, then refused: it runs on, unless it is gone. */
    if (!gone)
      session_snapshot_unpause(&l, &snap);
    stage_unref(st);
  }
  session_quiet_end(&l);
  if (r == 0)
    log_info("session %s hibernated (%s, %" PRIu64 " ms)", id, snap.carries,
             (mono_us() - t0) / 1000);
  return r;
}

int session_hibernate(const char *id, const char *owner, json_t **ret, char **ret_err) {
  return hibernate(id, owner, NULL, ret, ret_err);
}

int session_hibernate_idle(const char *id, const char *owner, uint64_t idle_since,
                           char **ret_err) {
  json_t *info = NULL;
  int r = hibernate(id, owner, &idle_since, &info, ret_err);
  json_decref(info);
  return r;
}

int session_resume_locked(struct session *s, char **ret_err) {
  if (session_shutting_down) {
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
