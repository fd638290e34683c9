/* session_int.h: what the pieces of session/ share, private to them: the
 * table (session_table.c: ids, the cap, lookups, the lifetimes of sessions
 * and handles), leases (session_lease.c), open, reset and close
 * (session.c), commit and fork (session_snapshot.c), the backend
 * (session_backend.c), the idle reaper (session_reaper.c) and shutdown
 * (session_shutdown.c).
 *
 * Locking: one mutex (session_lock) guards the table and every session's
 * fields.  Sandbox creation (slow) happens outside it: open reserves a slot
 * first, reset marks the session as resetting and callers wait on a
 * condition variable (session_cond).
 *
 * Lifetimes: a handle (sandbox + agent connection) is reference counted; the
 * table holds one reference and each lease one more.  Retiring a handle
 * (close, reset, reap, shutdown) kills its sandbox at once, which fails the
 * calls still waiting on it; the memory and the cgroup go with the last
 * reference. */
#pragma once

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "sandbox/sandbox.h"
#include "session/session.h"

struct handle {
  int refs;                 /* under table lock */
  struct sandbox *sb;
  struct agent_conn *conn;
  const char *retired;      /* NULL while in service, else "closed", "reset", ... */
  struct stage *stage;      /* the stage it was started from (a reference), or NULL */
  struct egress *egress;    /* the session's, attached to conn until retired; or NULL */
};

struct session {
  struct session *next;
  int refs;
  char id[SESSION_ID_MAX];
  char *owner;              /* who opened it (a fork: who forked it); never NULL */
  struct handle *h;         /* NULL while (re)creating */
  bool resetting;
  bool snapshotting;        /* commit or fork: new calls wait, as for a reset */
  bool removed;             /* no longer in the table */
  bool ephemeral;           /* sandbox_run's: only its lease reaches it (no id lookup) */
  const char *removed_why;
  struct egress *egress;    /* owned; NULL only for the bench's sessions */
  int busy;
  uint64_t created_ms, last_used_ms;
  int record_fd;            /* its record's live lock (session_record.c), or -1 */
  /* Hibernated (session_hibernate.c): no handle, what it was is this stage
   * (a reference), since hibernated_at (Unix time); carries "memory" or
   * "files".  resumed_ms: how long the last resume took, for the call that
   * made it (taken by its lease). */
  struct stage *hibernated;
  int64_t hibernated_at;
  uint64_t hibernated_seq;  /* the order of hibernations (the oldest goes first) */
  const char *carries;
  const char *isolation;    /* what it ran in (the backend's string, static; or
                             * isolation_saved, read from the store) */
  char *isolation_saved;
  uint64_t resumed_ms;
  /* Hibernated, and kept on the store when this server ends (its record and
   * its kept stage stay for another server to resume): set at shutdown. */
  bool outlives;
  /* Taken from the store (session_adopt) and not resumed here since: at
   * shutdown it goes back there whatever IGN_MCP_SHUTDOWN_ACTION says. */
  bool adopted;
};

/* ---- the table (session_table.c) ---- */

extern pthread_mutex_t session_lock;
extern pthread_cond_t session_cond;
extern struct session *session_table;
extern unsigned session_count;   /* includes slots reserved by opens in progress */
extern unsigned session_next_seq;
extern bool session_shutting_down;
/* Set (under the lock) while a server told to stop hibernates its sessions:
 * nothing is opened, reset or resumed any more. */
extern bool session_draining;

void handle_unref_locked(struct handle *h, struct handle **ret_dead);
/* Frees a handle whose last reference is gone; without the lock held. */
void handle_free(struct handle *h);
/* Stops a handle's sandbox now; calls waiting on it fail with -EPIPE.  Its
 * open connections out are ended (and recorded) first. */
void handle_retire(struct handle *h, const char *why);

/* A new session (one reference) of OWNER with a fresh id: "[<host>.]" then
 * KIND ('s', or 'r' for sandbox_run's), the sequence number SEQ and 16
 * random bits. */
struct session *session_new(const char *owner, char kind, unsigned seq);
/* This server's own next sequence number (the lock not held): when the
 * store's cannot be had. */
unsigned session_local_seq(void);
void session_free(struct session *s);
/* S, out of the table with no reference left: freed at the next unlock. */
void session_bury_locked(struct session *s);
void session_unref_locked(struct session *s);
/* Drops the table's lock, then frees what died while it was held. */
void session_table_unlock(void);
/* S, new and with its sandbox, into the table (its idle time starts). */
void session_insert_locked(struct session *s);
struct session *session_find_locked(const char *id, const char *owner);
void session_remove_locked(struct session *s, const char *why);
/* Removes S from the table and retires its handle.  Called with the lock;
 * returns a handle to free once the lock is dropped. */
struct handle *session_close_locked(struct session *s, const char *why);
/* For an id no session of OWNER has (malloc'd): what the store knows of it
 * (another server holds it, or it was lost with its server), else that
 * nobody opened it. */
char *session_unknown_id(const char *id, const char *owner);

/* ---- records on the store (session_record.c) ---- */

/* Makes IGN_MCP_STORE/sessions/ and removes what dead servers left there;
 * without it, ids are unique to this server only (a warning says why). */
void session_records_init(void);
/* The sequence number of a new id: the store's, given once across servers
 * and their lifetimes on it; without records, this server's. */
unsigned session_records_next_seq(void);
/* S's record (not for an ephemeral session): sessions/<id>/, locked while
 * S lives.  0 or -errno (logged: S then has none). */
int session_record_add(struct session *s);
/* Removes S's record and drops its lock (session_free). */
void session_record_remove(struct session *s);
/* What the store knows of ID for OWNER, as the sentence for a call
 * (malloc'd), or NULL when nothing. */
char *session_record_whereabouts(const char *id, const char *owner);

/* S is hibernated: J (taken) becomes its record's hibernated.json, which
 * lets another server resume it once this one is gone.  0, or -errno
 * (-ENOENT: S has no record). */
int session_record_hibernated(struct session *s, json_t *j);
/* S was resumed (or reset, or its hibernation undone): the record's
 * hibernated.json goes. */
void session_record_resumed(struct session *s);
/* A claim of a hibernated session's record (session_record_claim): its live
 * file, locked (the record's lock from now on); its hibernated.json (NULL
 * when damaged); the meta.json it had, put back if the claim is let go. */
struct record_claim {
  int fd;
  json_t *hib;
  json_t *old_meta;
};
/* Claims OWNER's record of ID when it is hibernated and held by no server
 * (a lock held an instant by another server's probe is waited for, 100 ms
 * at most): 1 and *C, meta.json naming this server; 0 when there is
 * nothing to claim (no such record, another owner's, held by a server,
 * lost); -EBADMSG with *ret_err when its hibernated.json is damaged, unless
 * DAMAGED_TOO (then 1, C->hib NULL). */
int session_record_claim(const char *id, const char *owner, bool damaged_too,
                         struct record_claim *c, char **ret_err);
/* Lets claim C of ID go, its meta.json as it was. */
void session_record_unclaim(const char *id, struct record_claim *c);
/* Claim C is kept: its fd, the record's lock, for the session. */
int session_record_claimed(struct record_claim *c);
/* OWNER's hibernated sessions on the store that no server holds, oldest
 * first: [{session_id, state, bytes, hibernated_at, carries}]. */
json_t *session_records_kept(const char *owner);
/* Removes OWNER's hibernated session ID from the store (its record and its
 * kept stage) if no server holds it: whether it did. */
bool session_record_drop(const char *id, const char *owner);
/* Whether OWNER's record of ID has a hibernated.json on the store (held or
 * not): a cheap test before a claim. */
bool session_record_maybe_hibernated(const char *id, const char *owner);
/* The record of ID (claimed) is no longer hibernated: its saved state is
 * gone, so it reads as lost. */
void session_record_forget_hibernation(const char *id);

/* ---- the backend (session_backend.c) ---- */

extern const struct sandbox_ops *session_ops;   /* NULL when none can run */
extern char *session_backend_error;             /* why none can */
extern struct sandbox_config session_sb_cfg;
/* Whether the backend can save and start from stages; *ret_err says why not. */
bool session_stages_supported(char **ret_err);
/* Without a backend: what sessions_set_unavailable_help's EXPLAIN says now
 * (malloc'd), or NULL when there is none. */
char *session_unavailable_help(void);

/* ---- open, reset and close (session.c) ---- */

/* Sandboxes being made (open, reset, fork), not in the table yet: shutdown
 * kills them (their agent then never answers, and the open or reset fails
 * at once) and waits until none is left, so that each is destroyed by its
 * maker before the server exits (see sessions_shutdown for the bound). */
struct making {
  struct making *next;
  const void *owner;        /* what session_kill_starting names it by, or NULL */
  struct sandbox *sb;       /* NULL until the backend's create returned */
};
extern struct making *session_making;
extern unsigned session_n_making;

/* A sandbox for session ID from STAGE (NULL: the base) with EGRESS (may be
 * NULL) attached, listed in session_making under OWNER while it starts.
 * For a caller that holds the lock and has checked that the server is not
 * shutting down; returns with the lock held again, and on success the
 * server is still not shutting down. */
int session_make_handle_locked(const char *id, struct stage *stage, struct egress *egress,
                               const void *owner, struct handle **ret, uint64_t *ret_ms,
                               char **ret_err);
/* The same for a resume: the sandbox keeps the identity STAGE's memory
 * holds (sandbox_config.keep_identity). */
int session_make_handle_kept_locked(const char *id, struct stage *stage, struct egress *egress,
                                    struct handle **ret, uint64_t *ret_ms, char **ret_err);

/* ---- commit and fork (session_snapshot.c) ---- */

/* Saves the quiet session of L as stage NAME (NULL: anonymous); STOP (may
 * be NULL) is asked last whether the caller gave up. */
int session_snapshot_lease(const struct lease *l, const char *name, bool replace,
                           const struct commit_stop *stop, struct stage **ret,
                           struct sandbox_snapshot *ret_snap, char **ret_err);

/* After a final snapshot (SNAP->final) whose save then failed: lets the
 * sandbox of L run on. */
void session_snapshot_unpause(const struct lease *l, const struct sandbox_snapshot *snap);

/* ---- hibernate and resume (session_hibernate.c) ---- */

/* Resumes hibernated session S, found in the table (under the lock, which
 * is dropped while its sandbox starts): 0, or -errno and *ret_err with S
 * still hibernated (or removed meanwhile). */
int session_resume_locked(struct session *s, char **ret_err);
/* The idle reaper's hibernation of session ID of OWNER, idle since
 * IDLE_SINCE (its last_used_ms, which the reaper set): 0 hibernated;
 * -EBUSY a call came meanwhile (left as it is); -ECANCELED it could not be
 * hibernated and was closed (*ret_err says why); else it could not be
 * hibernated and a call waits for it (left as it is). */
int session_hibernate_idle(const char *id, const char *owner, uint64_t idle_since,
                           char **ret_err);
/* Closes one session hibernated for IGN_MCP_HIBERNATE_KEEP_SECS; true when
 * it did (call again). */
bool session_expire_hibernated_locked(void);
/* What OWNER's hibernated sessions take, and the sessions of OWNER closed
 * to make room or after being kept (for list_sessions). */
uint64_t session_hibernated_bytes_locked(const char *owner);
json_t *session_recently_closed_locked(const char *owner);
/* For an id the table does not have (no lock held): OWNER's session ID
 * hibernated on the store by a server that is gone is taken into the table,
 * hibernated (the call then resumes it as any other): 1; 0 when there is
 * none to take; -errno and *ret_err when there is one this server cannot
 * resume (its inputs changed, its saved state is damaged: it stays on the
 * store for a server that can). */
int session_adopt(const char *id, const char *owner, char **ret_err);
/* close of ID, which the table did not have: 1, OWNER's hibernation of it on
 * the store was removed (not resumed); 2, another call of this server took
 * it into the table meanwhile (close it there); 0, neither. */
int session_adopted_close(const char *id, const char *owner);
/* At shutdown, before the table is closed (session_draining set): hibernates
 * every live session (IGN_MCP_SHUTDOWN_ACTION=hibernate), each started
 * within IGN_MCP_SHUTDOWN_SECS (one started runs to its end), each one that
 * cannot be named in the log.  Whether the hibernated sessions are to
 * outlive the server (false: hibernation at shutdown is off). */
bool session_hibernate_all(void);

/* ---- leases (session_lease.c) ---- */

/* For a call that found S in the table and waited for its reset, only to
 * find it gone: what happened to it, not that the id is unknown. */
char *session_removed_while_waiting(const struct session *s);
/* Waits, with the lock, until S (found in the table) is not being reset or
 * saved; returns S with a reference for the caller. */
struct session *session_wait_reset_locked(struct session *s);
/* Takes session ID for a snapshot (commit, fork): new calls wait and this
 * waits for the calls running on it to end.  On success *ret is a lease to
 * give back with session_quiet_end. */
int session_quiet_begin(const char *id, const char *owner, const char *what, struct lease *ret,
                        char **ret_err);
void session_quiet_end(struct lease *l);
/* How long commit, fork and hibernate wait for the calls running on a
 * session to end. */
#define SESSION_QUIET_WAIT_MS 10000u
/* session_quiet_begin waiting at most WAIT_MS for the calls running; with
 * !RESUME, a hibernated session is left so: -EALREADY. */
int session_quiet_take(const char *id, const char *owner, const char *what, uint32_t wait_ms,
                       bool resume, struct lease *ret, char **ret_err);

/* ---- the idle reaper (session_reaper.c) ---- */

/* Starts the thread that closes sessions idle for IGN_MCP_IDLE_SECS. */
void session_reaper_start(void);
