/* session_lease.c: leases.  A call holds a lease on a session while it
 * works: the lease keeps the session and its sandbox's handle alive, marks
 * the session busy (the idle reaper skips it) and refreshes its idle timer
 * when given back.  New leases wait while a reset, commit or fork is under
 * way; a commit or fork waits (session_quiet_begin) for the leases held to
 * be given back.  When the sandbox fails under a lease, lease_failure says
 * what happened to the session. */
#include "session/session.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "sandbox/sandbox.h"
#include "session/session_int.h"

/* How long commit and fork wait for the calls running on a session to end. */

char *session_removed_while_waiting(const struct session *s) {
  return xasprintf("session '%s' was %s while this call waited for its reset. Call open_session "
                   "for a new session.",
                   s->id, s->removed_why);
}

/* Waits, with the lock, until S (found in the table) is not being reset.
 * The waiter holds a reference while it sleeps: a close during the reset
 * drops the table's, and the reset then drops its own.  Returns S with that
 * reference, which the caller keeps or drops. */
struct session *session_wait_reset_locked(struct session *s) {
  s->refs++;
  while (s->resetting || s->snapshotting)
    pthread_cond_wait(&session_cond, &session_lock);
  return s;
}

/* Session ID once no reset or snapshot is under way on it, with a reference
 * for the caller (under the lock); a hibernated one is resumed first, unless
 * !RESUME (then NULL with *ret_err NULL and *ret_hibernated set).  NULL and
 * *ret_err when it has no sandbox; NULL and *ret_err NULL when the table has
 * no such session: the caller says so with session_unknown_id once the lock
 * is dropped (it reads the store). */
static struct session *find_serving_locked(const char *id, const char *owner, bool resume,
                                           bool *ret_hibernated, char **ret_err) {
  struct session *s = session_find_locked(id, owner);
  if (s)
    session_wait_reset_locked(s);
  if (s && !s->removed && !s->h && s->hibernated) {
    if (!resume) {
      *ret_hibernated = true;
      session_unref_locked(s);
      return NULL;
    }
    /* This call resumes it (others wait, as for a reset). */
    if (session_resume_locked(s, ret_err) < 0) {
      if (s->removed && !*ret_err)
        *ret_err = session_removed_while_waiting(s);
      session_unref_locked(s);
      return NULL;
    }
  }
  if (!s || s->removed || !s->h) {
    if (s && s->removed)
      *ret_err = session_removed_while_waiting(s);
    if (s)
      session_unref_locked(s);
    return NULL;
  }
  return s;
}

/* find_serving_locked, and for an id the table does not have, OWNER's
 * session hibernated on the store by a server that is gone, taken into the
 * table first (session_adopt; the lock is dropped meanwhile). */
static struct session *find_or_adopt_locked(const char *id, const char *owner, bool resume,
                                            bool *ret_hibernated, char **ret_err) {
  struct session *s = find_serving_locked(id, owner, resume, ret_hibernated, ret_err);
  if (s || *ret_err || *ret_hibernated || session_find_locked(id, owner))
    return s;
  session_table_unlock();
  int r = session_adopt(id, owner, ret_err);
  pthread_mutex_lock(&session_lock);
  return r > 0 ? find_serving_locked(id, owner, resume, ret_hibernated, ret_err) : NULL;
}

/* After find_serving_locked failed and the lock was dropped: the words for
 * an id the table did not have. */
static void unknown_unless_said(const char *id, const char *owner, char **ret_err) {
  if (!*ret_err)
    *ret_err = session_unknown_id(id, owner);
}

/* S, found with a reference for the caller, leased into RET (the reference
 * becomes the lease's), with what the resume that found it took. */
static void lease_fill_locked(struct session *s, struct lease *ret) {
  s->busy++;
  s->h->refs++;
  ret->s = s;
  ret->h = s->h;
  ret->resumed_ms = s->resumed_ms;
  s->resumed_ms = 0;
}

int session_acquire(const char *id, const char *owner, struct lease *ret, char **ret_err) {
  pthread_mutex_lock(&session_lock);
  bool hibernated = false;
  struct session *s = find_or_adopt_locked(id, owner, true, &hibernated, ret_err);
  if (!s) {
    session_table_unlock();
    unknown_unless_said(id, owner, ret_err);
    return -ENOENT;
  }
  /* The reference taken while waiting is the lease's. */
  s->last_used_ms = mono_ms();
  lease_fill_locked(s, ret);
  session_table_unlock();
  return 0;
}

void session_release(struct lease *l) {
  struct handle *dead;
  pthread_mutex_lock(&session_lock);
  if (--l->s->busy == 0 && l->s->snapshotting)
    pthread_cond_broadcast(&session_cond); /* a commit or fork waits for quiet */
  l->s->last_used_ms = mono_ms();
  handle_unref_locked(l->h, &dead);
  session_unref_locked(l->s);
  session_table_unlock();
  handle_free(dead);
  l->s = NULL;
  l->h = NULL;
}

struct agent_conn *lease_conn(const struct lease *l) { return l->h->conn; }
struct egress *lease_egress(const struct lease *l) { return l->s->egress; }
const char *lease_id(const struct lease *l) { return l->s->id; }
bool lease_ephemeral(const struct lease *l) { return l->s->ephemeral; }

char *lease_failure(const struct lease *l, const char *what_failed) {
  pthread_mutex_lock(&session_lock);
  const char *retired = l->h->retired;
  const char *removed_why = l->s->removed ? l->s->removed_why : NULL;
  session_table_unlock();
  if (l->s->ephemeral) {
    /* No tool reaches it by its id: say what to call instead. */
    _cleanup_free_ char *why =
        removed_why || !l->h->sb->ops->death_reason ? NULL : l->h->sb->ops->death_reason(l->h->sb);
    return xasprintf("%s: its one-shot sandbox %s%s%s; it is destroyed and nothing was left "
                     "behind.%s",
                     what_failed, removed_why ? "was " : "died (",
                     removed_why ? removed_why : why ? why : "its sandbox exited",
                     removed_why ? "" : ")",
                     removed_why ? "" : " Call sandbox_run again (a command that stops the "
                                        "sandbox itself fails the same way).");
  }
  if (removed_why)
    return xasprintf("%s: session '%s' was %s while this call ran. Call open_session for a new "
                     "session.",
                     what_failed, l->s->id, removed_why);
  if (retired)
    return xasprintf("%s: session '%s' was %s while this call ran; its files and processes are "
                     "gone. Call again on the fresh sandbox.",
                     what_failed, l->s->id, retired);
  _cleanup_free_ char *why = l->h->sb->ops->death_reason ? l->h->sb->ops->death_reason(l->h->sb)
                                                         : NULL;
  return xasprintf("%s: session '%s' is dead (%s). Call reset('%s') to get a fresh sandbox under "
                   "the same id, or close it.",
                   what_failed, l->s->id, why ? why : "its sandbox exited", l->s->id);
}

/* Takes session ID for a snapshot: new calls wait (as for a reset) and this
 * waits up to WAIT_MS (0: not at all) for the calls running on it to end, so that its
 * agent is idle when it is saved.  On success *ret is a lease (the reaper
 * skips the session) to give back with session_quiet_end. */
int session_quiet_take(const char *id, const char *owner, const char *what, uint32_t wait_ms,
                       bool resume, struct lease *ret, char **ret_err) {
  pthread_mutex_lock(&session_lock);
  bool hibernated = false;
  struct session *s = find_or_adopt_locked(id, owner, resume, &hibernated, ret_err);
  if (!s) {
    session_table_unlock();
    if (hibernated)
      return -EALREADY;
    unknown_unless_said(id, owner, ret_err);
    return -ENOENT;
  }
  s->snapshotting = true;
  uint64_t deadline = mono_ms() + wait_ms;
  while (s->busy > 0 && !s->removed && mono_ms() < deadline) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, 100);
    pthread_cond_timedwait(&session_cond, &session_lock, &ts);
  }
  if (s->busy > 0 || s->removed || !s->h) {
    *ret_err = s->removed ? session_removed_while_waiting(s)
                          : xasprintf("cannot %s session '%s': %d call(s) still run in it after "
                                      "%u s. A session is saved only while no call runs in it: "
                                      "wait for them to end (or cancel them), then call %s again.",
                                      what, id, s->busy, wait_ms / 1000, what);
    s->snapshotting = false;
    pthread_cond_broadcast(&session_cond);
    session_unref_locked(s);
    session_table_unlock();
    return -EBUSY;
  }
  lease_fill_locked(s, ret);
  session_table_unlock();
  return 0;
}

int session_quiet_begin(const char *id, const char *owner, const char *what, struct lease *ret,
                        char **ret_err) {
  return session_quiet_take(id, owner, what, SESSION_QUIET_WAIT_MS, true, ret, ret_err);
}

void session_quiet_end(struct lease *l) {
  pthread_mutex_lock(&session_lock);
  l->s->snapshotting = false;
  pthread_cond_broadcast(&session_cond);
  session_table_unlock();
  session_release(l);
}
