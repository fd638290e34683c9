/* session.h: the session table.  A session is an id plus the sandbox that
 * currently serves it; reset swaps the sandbox under the same id.  Calls
 * take a lease on a session, which keeps its sandbox alive, marks the
 * session busy (the idle reaper skips it) and refreshes its idle timer.
 *
 * Every session belongs to an owner (struct call_ctx.owner: the HTTP
 * token's name, "" on stdio; never NULL), the one that opened it.  Each call
 * that names a session passes the caller's owner: a session of another
 * owner is answered as an unknown id, and list_sessions shows only the
 * caller's.  IGN_MCP_MAX_SESSIONS counts the sessions of all owners. */
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/config.h"
#include "proto/client.h"

/* The longest session id and its NUL: "<host id>." (up to 17), a letter,
 * a 32-bit sequence number, '-' and 4 hex digits. */
#define SESSION_ID_MAX 48

struct session;
struct handle;
struct egress;

struct lease {
  struct session *s;
  struct handle *h;
  uint64_t resumed_ms; /* this call resumed the session, in that many ms (0: it did not) */
};

/* Picks the backend and starts the reaper.  *ret_err explains when no
 * backend can work (sessions then cannot open, the server still runs). */
int sessions_init(char **ret_err);
/* When no backend can work: the text EXPLAIN returns (malloc'd) is added to
 * the error every open_session returns.  It is made on the thread of the
 * open_session that needs it, one call at a time, and kept for a few seconds,
 * so it says how things stand now; call this before serving. */
void sessions_set_unavailable_help(char *(*explain)(void));
/* FN is called by close and reset once the session is known to be the
 * caller's and the call goes ahead, before its sandbox goes, from the
 * calling thread with no lock held: the session's ID and OWNER, and WHY
 * ("was closed", "was reset").  The protocol layer cancels the session's
 * tasks there.  Set before serving. */
void sessions_set_on_end(void (*fn)(const char *id, const char *owner, const char *why));
/* "ns" or "vm" (or "none"). */
const char *sessions_backend(void);

/* Opens a session from stage STAGE (NULL: the base) with network policy
 * EGRESS (egress_new; NULL: none at all, for the bench), which the call
 * takes whatever it returns: the session owns it from then on, through
 * resets, and frees it with its last reference.  *ret is an object with
 * session_id, isolation, backend, limits, stage, stage_id, egress
 * (egress_summary), ... */
int session_open(const char *owner, const char *stage, struct egress *egress, json_t **ret,
                 char **ret_err);
int session_acquire(const char *id, const char *owner, struct lease *ret, char **ret_err);

/* The host part of session id ID into RET_HOST ("h2" of "h2.s3-9f2a"): true
 * when ID has one that follows CONFIG_HOST_ID_RULE and something after the
 * dot.  An id without a dot, or whose part before it breaks the rule, has
 * none. */
bool session_id_host(const char *id, char ret_host[static CONFIG_HOST_ID_MAX + 1]);
/* For an id no session of the caller has: when its host part is another
 * host's (or this server has no IGN_MCP_HOST_ID and the id has a host
 * part), a message (malloc'd) naming the host that holds it and where to
 * send the call; else NULL. */
char *session_id_elsewhere(const char *id);

/* sandbox_run's one-shot sessions.  An ephemeral session counts against the
 * session cap and is listed by list_sessions (with "ephemeral": true, always
 * busy), but no tool reaches it by its id: only the lease *ret, which
 * session_end_ephemeral gives back, destroying the sandbox (shutdown may
 * retire it earlier; its calls then fail with -EPIPE).  EGRESS and
 * *ret_info as session_open's. */
int session_open_ephemeral(const char *owner, const char *stage, struct egress *egress,
                           struct lease *ret, json_t **ret_info, char **ret_err);
void session_end_ephemeral(struct lease *l);
/* Kills the sandbox being started by the session_open_ephemeral that fills
 * L, if there is one: that open then fails at once (a sandbox_run
 * cancelled, or out of time, while it starts).  From any thread. */
void session_kill_starting(const struct lease *l);
/* Asked once, right before a stage is put in place: true when the caller
 * gave up (cancelled, out of time), and then nothing is saved. */
struct commit_stop {
  bool (*gave_up)(void *ctx);
  void *ctx;
};
/* session_commit for the ephemeral session of L (no other call runs in it).
 * STOP (may be NULL): -ECANCELED when it says the caller gave up. */
int session_commit_ephemeral(const struct lease *l, const char *name, bool replace,
                             const struct commit_stop *stop, json_t **ret, char **ret_err);
void session_release(struct lease *l);
struct agent_conn *lease_conn(const struct lease *l);
/* The session's egress (alive while the lease is held), or NULL. */
struct egress *lease_egress(const struct lease *l);
const char *lease_id(const struct lease *l);
bool lease_ephemeral(const struct lease *l);
/* A sentence for a call whose sandbox connection failed: it names the id and
 * says whether the session was closed, reset, or died (and why); for an
 * ephemeral session, that sandbox_run is the call to make again. */
char *lease_failure(const struct lease *l, const char *what_failed);

/* A fresh sandbox under the same id, from stage STAGE (NULL: the base). */
int session_reset(const char *id, const char *owner, const char *stage, json_t **ret,
                  char **ret_err);
/* Saves session ID as stage NAME (replacing one only when REPLACE); *ret:
 * {stage, stage_id, parent, carries, bytes, commit_ms, paused_ms}.  STOP
 * (may be NULL): -ECANCELED, nothing saved, when it says the caller gave up
 * before the stage was put in place. */
int session_commit(const char *id, const char *owner, const char *name, bool replace,
                   const struct commit_stop *stop, json_t **ret, char **ret_err);
/* COUNT new sessions, each a copy of session ID as it is now; *ret:
 * {sessions: [{session_id, isolation, open_ms}], fork_ms, paused_ms, carries}.
 * Each new session gets a copy of ID's network policy with an empty record. */
#define SESSION_FORK_MAX 8
int session_fork(const char *id, const char *owner, unsigned count, json_t **ret, char **ret_err);
/* Hibernates session ID: saved as it is (vm: memory; ns: files), its sandbox
 * gone, its id kept; the next call that names it resumes it.  *ret:
 * {session_id, state, carries, bytes, hibernate_ms, paused_ms,
 * hibernated_at}. */
int session_hibernate(const char *id, const char *owner, json_t **ret, char **ret_err);
int session_close(const char *id, const char *owner, char **ret_err);
/* OWNER's sessions (ephemeral ones too); the cap and idle time. */
json_t *session_list(const char *owner);
/* Closes every session (shutdown). */
void sessions_shutdown(void);
