/* session.c: ids, the cap, leases, reset, close, the idle reaper, shutdown.
 *
 * Locking: one mutex guards the table and every session's fields.  Sandbox
 * creation (slow) happens outside it: open reserves a slot first, reset marks
 * the session as resetting and callers wait on a condition variable.
 *
 * Owners: every session belongs to the owner that opened it (the HTTP
 * token's name, "" on stdio), passed in by each call.  To any other owner a
 * session does not exist: lookups compare the owner with the id, and the
 * error is the one for an id nobody opened, so a token cannot learn what
 * another holds.  The cap on sessions is the server's, shared by all.
 *
 * Host ids: with IGN_MCP_HOST_ID every id starts with "<host>.", so that a
 * front proxy can route on it; an id of another host gets an error naming
 * that host instead of the one for an unknown id.
 *
 * Lifetimes: a handle (sandbox + agent connection) is reference counted; the
 * table holds one reference and each lease one more.  Retiring a handle
 * (close, reset, reap, shutdown) kills its sandbox at once, which fails the
 * calls still waiting on it; the memory and the cgroup go with the last
 * reference.
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "common/util.h"
#include "egress/egress.h"
#include "common/config.h"
#include "common/log.h"
#include "sandbox/sandbox.h"
#include "sandbox/stage.h"
#include "sandbox/vm.h"

#define HELLO_TIMEOUT_MS 30000u
#define SHUTDOWN_MAKING_WAIT_MS 30000u
/* How long commit and fork wait for the calls running on a session to end. */
#define QUIET_WAIT_MS 10000u

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
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static struct session *table;
static unsigned n_sessions;   /* includes slots reserved by opens in progress */
static unsigned next_seq;
static const struct sandbox_ops *backend;
static char *backend_error;
static struct sandbox_config sb_cfg;
static bool shutting_down;
/* Sandboxes being made (open, reset), not in the table yet: shutdown kills
 * them (their agent then never answers, and the open or reset fails at
 * once) and waits until none is left, so that each is destroyed by its
 * maker before the server exits (see sessions_shutdown for the bound). */
struct making {
  struct making *next;
  const void *owner;        /* what session_kill_starting names it by, or NULL */
  struct sandbox *sb;       /* NULL until the backend's create returned */
};
static struct making *making;
static unsigned n_making;
/* Sessions whose last reference went while the lock was held, linked by
 * next: freed by table_unlock once the lock is dropped. */
static struct session *graveyard;

const char *sessions_backend(void) { return backend ? backend->name : "none"; }

static struct handle *close_locked(struct session *s, const char *why);

static void handle_unref_locked(struct handle *h, struct handle **ret_dead) {
  *ret_dead = --h->refs == 0 ? h : NULL;
}

/* Frees a handle whose last reference is gone; without the lock held. */
static void handle_free(struct handle *h) {
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

/* egress_counters_fn for a backend that reads the refusal counters
 * itself: the egress attachment ends (handle_retire, or the next attach)
 * before the handle and so the sandbox are freed. */
static int sandbox_egress_counters(void *ctx, uint64_t ret[3], char **ret_err) {
  struct sandbox *sb = ctx;
  return sb->ops->egress_counters(sb, ret, ret_err);
}

/* Stops a handle's sandbox now; calls waiting on it fail with -EPIPE.  Its
 * open connections out are ended (and recorded) first. */
static void handle_retire(struct handle *h, const char *why) {
  if (h->retired)
    return;
  h->retired = why;
  if (h->egress)
    egress_detach(h->egress);
  agent_conn_shutdown(h->conn);
  /* The backend kills: it alone knows whether its process was reaped. */
  h->sb->ops->kill(h->sb);
}

static void session_free(struct session *s) {
  if (!s)
    return;
  if (s->egress)
    egress_free(s->egress);
  free(s->owner);
  free(s);
}

/* S, out of the table with no reference left: freed at the next unlock. */
static void bury_locked(struct session *s) {
  s->next = graveyard;
  graveyard = s;
}

static void session_unref_locked(struct session *s) {
  if (--s->refs == 0)
    bury_locked(s);
}

/* Drops the table's lock, then frees what died while it was held. */
static void table_unlock(void) {
  struct session *dead = steal_ptr(graveyard);
  pthread_mutex_unlock(&lock);
  while (dead) {
    struct session *next = dead->next;
    session_free(dead);
    dead = next;
  }
}

/* A new session (one reference) of OWNER with a fresh id: "[<host>.]" then
 * KIND ('s', or 'r' for sandbox_run's), the sequence number SEQ and 16
 * random bits, which keep an id of a server that restarted from naming a
 * session of the one before. */
static struct session *session_new(const char *owner, char kind, unsigned seq) {
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
  return s;
}

static struct session *find_locked(const char *id, const char *owner) {
  for (struct session *s = table; s; s = s->next)
    if (strcmp(s->id, id) == 0 && !s->ephemeral && strcmp(s->owner, owner) == 0)
      return s;
  return NULL;
}

static void remove_locked(struct session *s, const char *why) {
  for (struct session **pp = &table; *pp; pp = &(*pp)->next)
    if (*pp == s) {
      *pp = s->next;
      break;
    }
  s->removed = true;
  s->removed_why = why;
  n_sessions--;
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
 * opened it or another owner did: that is not the caller's to know. */
static char *unknown_id(const char *id) {
  char *elsewhere = session_id_elsewhere(id);
  if (elsewhere)
    return elsewhere;
  return xasprintf("unknown session_id '%s': no open session has this id (it was never opened, "
                   "or it was closed, or reaped after %u s idle). Call open_session to get a new "
                   "one; list_sessions shows the open ones.",
                   id, cfg.idle_secs);
}

static void making_add_locked(struct making *m) {
  m->next = making;
  making = m;
  n_making++;
}

static void making_remove_locked(struct making *m) {
  for (struct making **pp = &making; *pp; pp = &(*pp)->next)
    if (*pp == m) {
      *pp = m->next;
      break;
    }
  n_making--;
  pthread_cond_broadcast(&cond);
}

/* Creates a sandbox, connects to its agent and attaches EGRESS (may be
 * NULL) to the connection.  M, already counted in n_making by the caller
 * (under the lock), is listed for shutdown. */
static int make_handle_listed(struct making *m, const char *id, struct stage *stage,
                              struct egress *egress, struct handle **ret, uint64_t *ret_ms,
                              char **ret_err) {
  uint64_t t0 = mono_us();
  struct sandbox *sb = NULL;
  _cleanup_free_ char *err = NULL;
  struct sandbox_config sc = sb_cfg;
  sc.stage = stage;
  int r = backend->create(&sc, id, &sb, &err);
  if (r < 0) {
    *ret_err = xasprintf("cannot start a sandbox: %s", err ? err : strerror(-r));
    return r;
  }
  pthread_mutex_lock(&lock);
  m->sb = sb;
  if (shutting_down)
    sb->ops->kill(sb);
  table_unlock();
  struct agent_conn *conn = NULL;
  r = agent_conn_open(sb->fd, HELLO_TIMEOUT_MS, &conn, &err);
  if (r == 0)
    r = sb->ops->ready(sb, conn, &err);
  pthread_mutex_lock(&lock);
  m->sb = NULL; /* shutdown no longer reaches it */
  bool stopping = shutting_down;
  table_unlock();
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
static int make_handle_locked(const char *id, struct stage *stage, struct egress *egress,
                              const void *owner, struct handle **ret, uint64_t *ret_ms,
                              char **ret_err) {
  struct making m = {.owner = owner};
  making_add_locked(&m);
  table_unlock();
  struct handle *h = NULL;
  int r = make_handle_listed(&m, id, stage, egress, &h, ret_ms, ret_err);
  pthread_mutex_lock(&lock);
  if (r == 0 && shutting_down) {
    /* Shutdown began after the last look: it is still waiting for this one
     * (n_making), so destroy it now. */
    table_unlock();
    handle_retire(h, "closed");
    handle_free(h);
    *ret_err = strdup("the server is shutting down");
    r = -ESHUTDOWN;
    pthread_mutex_lock(&lock);
  }
  making_remove_locked(&m);
  if (r == 0)
    *ret = h;
  return r;
}

static json_t *describe(const struct session *s, uint64_t open_ms) {
  json_t *o = json_pack("{s:s, s:s, s:s, s:s, s:s}", "session_id", s->id, "isolation",
                        s->h->sb->isolation, "backend", backend->name, "rootfs", cfg.rootfs_spec,
                        "limits", s->h->sb->limits);
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

/* Without a backend, open_session's error explains what is missing.  The
 * explanation runs checks that take seconds, so it is made when asked for,
 * on that call's thread, and reused while it is fresh.  One at a time: the
 * checks make a test cgroup whose name is the same for every call. */
#define HELP_FRESH_MS 5000u

static pthread_mutex_t help_lock = PTHREAD_MUTEX_INITIALIZER;
static char *(*help_explain)(void);
static char *help_text;
static uint64_t help_made_ms;

void sessions_set_unavailable_help(char *(*explain)(void)) { help_explain = explain; }

/* The current explanation (malloc'd), or NULL when there is none. */
static char *unavailable_help(void) {
  if (!help_explain)
    return NULL;
  pthread_mutex_lock(&help_lock);
  if (!help_text || mono_ms() - help_made_ms >= HELP_FRESH_MS) {
    free(help_text);
    help_text = help_explain();
    help_made_ms = mono_ms();
  }
  char *text = help_text ? strdup(help_text) : NULL;
  pthread_mutex_unlock(&help_lock);
  return text;
}

/* Whether the backend can save and start from stages; *ret_err says why not. */
static bool stages_supported(char **ret_err) {
  if (backend && backend->snapshot && backend->inputs_id)
    return true;
  *ret_err = xasprintf("stages are not available: the %s backend cannot save or start from "
                       "them",
                       sessions_backend());
  return false;
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
  if (!stages_supported(ret_err))
    return -EOPNOTSUPP;
  _cleanup_free_ char *inputs = NULL, *text = NULL, *err = NULL;
  r = backend->inputs_id(&inputs, &text, &err);
  if (r < 0) {
    *ret_err = xasprintf("cannot open stage '%s' yet: %s", name, err ? err : strerror(-r));
    return r;
  }
  return stage_open(name, owner, backend->name, inputs, ret, ret_err);
}

/* Opens a session; with LEASE (sandbox_run) an ephemeral one, handed out
 * already leased.  The session takes *EGRESS (and sets it to NULL) once it
 * exists. */
static int open_taking(const char *owner, const char *stage_name, struct egress **egress,
                       struct lease *lease, json_t **ret, char **ret_err) {
  if (!backend) {
    _cleanup_free_ char *help = unavailable_help();
    *ret_err = xasprintf("no sandbox backend can run here: %s%s%s", backend_error,
                         help ? "\n" : "", help ? help : "");
    return -ENODEV;
  }
  pthread_mutex_lock(&lock);
  if (shutting_down) {
    table_unlock();
    *ret_err = strdup("the server is shutting down");
    return -ESHUTDOWN;
  }
  if (n_sessions >= cfg.max_sessions) {
    table_unlock();
    *ret_err = xasprintf("cannot open a session: the limit of %u open sessions is reached "
                         "(IGN_MCP_MAX_SESSIONS). Close one you no longer need with "
                         "close(session_id) (list_sessions shows them), or raise "
                         "IGN_MCP_MAX_SESSIONS.%s",
                         cfg.max_sessions,
                         *owner ? " The limit counts the sessions of every token of this server."
                                : "");
    return -EUSERS;
  }
  n_sessions++;
  unsigned seq = ++next_seq;
  table_unlock();

  /* The stage is checked (and verified, the first time) before anything
   * starts, without the table's lock. */
  struct stage *stage = NULL;
  int r = open_stage(stage_name, owner, &stage, ret_err);
  pthread_mutex_lock(&lock);
  struct session *s = r < 0 ? NULL : session_new(owner, lease ? 'r' : 's', seq);
  if (!s) {
    n_sessions--;
    table_unlock();
    if (stage)
      stage_unref(stage);
    return r < 0 ? r : -ENOMEM;
  }
  s->ephemeral = lease != NULL;
  s->egress = steal_ptr(*egress);
  if (s->egress)
    egress_set_session(s->egress, s->id, s->owner);

  uint64_t ms;
  r = shutting_down ? -ESHUTDOWN
                    : make_handle_locked(s->id, stage, s->egress, lease, &s->h, &ms, ret_err);
  if (r == -ESHUTDOWN && !*ret_err)
    *ret_err = strdup("the server is shutting down");
  if (r < 0) {
    /* (Shutdown makes it fail: the sandbox is destroyed by then.) */
    n_sessions--;
    table_unlock();
    session_free(s);
    if (stage)
      stage_unref(stage);
    return r;
  }
  s->created_ms = s->last_used_ms = mono_ms();
  s->next = table;
  table = s;
  *ret = describe(s, ms);
  if (lease) {
    s->refs++;
    s->busy++;
    s->h->refs++;
    lease->s = s;
    lease->h = s->h;
  }
  table_unlock();
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
  pthread_mutex_lock(&lock);
  /* Shutdown may have closed it already. */
  struct handle *dead = l->s->removed ? NULL : close_locked(l->s, "closed");
  pthread_cond_broadcast(&cond);
  table_unlock();
  handle_free(dead);
  session_release(l); /* the last reference: the sandbox is destroyed here */
  log_info("ephemeral session %s ended", id);
}

void session_kill_starting(const struct lease *l) {
  pthread_mutex_lock(&lock);
  for (struct making *m = making; m; m = m->next)
    if (m->sb && m->owner == l)
      m->sb->ops->kill(m->sb);
  table_unlock();
}

/* For a call that found S in the table and waited for its reset, only to
 * find it gone: what happened to it, not that the id is unknown. */
static char *removed_while_waiting(const struct session *s) {
  return xasprintf("session '%s' was %s while this call waited for its reset. Call open_session "
                   "for a new session.",
                   s->id, s->removed_why);
}

/* Waits, with the lock, until S (found in the table) is not being reset.
 * The waiter holds a reference while it sleeps: a close during the reset
 * drops the table's, and the reset then drops its own.  Returns S with that
 * reference, which the caller keeps or drops. */
static struct session *wait_reset_locked(struct session *s) {
  s->refs++;
  while (s->resetting || s->snapshotting)
    pthread_cond_wait(&cond, &lock);
  return s;
}

/* Session ID once no reset or snapshot is under way on it, with a reference
 * for the caller; NULL and *ret_err when there is none or it has no
 * sandbox (under the lock). */
static struct session *find_serving_locked(const char *id, const char *owner, char **ret_err) {
  struct session *s = find_locked(id, owner);
  if (s)
    wait_reset_locked(s);
  if (!s || s->removed || !s->h) {
    *ret_err = s && s->removed ? removed_while_waiting(s) : unknown_id(id);
    if (s)
      session_unref_locked(s);
    return NULL;
  }
  return s;
}

int session_acquire(const char *id, const char *owner, struct lease *ret, char **ret_err) {
  pthread_mutex_lock(&lock);
  struct session *s = find_serving_locked(id, owner, ret_err);
  if (!s) {
    table_unlock();
    return -ENOENT;
  }
  /* The reference taken while waiting is the lease's. */
  s->busy++;
  s->last_used_ms = mono_ms();
  s->h->refs++;
  ret->s = s;
  ret->h = s->h;
  table_unlock();
  return 0;
}

void session_release(struct lease *l) {
  struct handle *dead;
  pthread_mutex_lock(&lock);
  if (--l->s->busy == 0 && l->s->snapshotting)
    pthread_cond_broadcast(&cond); /* a commit or fork waits for quiet */
  l->s->last_used_ms = mono_ms();
  handle_unref_locked(l->h, &dead);
  session_unref_locked(l->s);
  table_unlock();
  handle_free(dead);
  l->s = NULL;
  l->h = NULL;
}

struct agent_conn *lease_conn(const struct lease *l) { return l->h->conn; }
struct egress *lease_egress(const struct lease *l) { return l->s->egress; }
const char *lease_id(const struct lease *l) { return l->s->id; }
bool lease_ephemeral(const struct lease *l) { return l->s->ephemeral; }

char *lease_failure(const struct lease *l, const char *what_failed) {
  pthread_mutex_lock(&lock);
  const char *retired = l->h->retired;
  const char *removed_why = l->s->removed ? l->s->removed_why : NULL;
  table_unlock();
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

int session_reset(const char *id, const char *owner, const char *stage_name, json_t **ret,
                  char **ret_err) {
  /* An id that is not the caller's is refused before anything else: an
   * error about the stage would tell that the session exists. */
  pthread_mutex_lock(&lock);
  bool known = find_locked(id, owner) != NULL;
  table_unlock();
  if (!known) {
    *ret_err = unknown_id(id);
    return -ENOENT;
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
  pthread_mutex_lock(&lock);
  struct session *s = find_locked(id, owner);
  if (s)
    wait_reset_locked(s);
  if (!s || s->removed) {
    *ret_err = s ? removed_while_waiting(s) : unknown_id(id);
    if (s)
      session_unref_locked(s);
    table_unlock();
    if (stage)
      stage_unref(stage);
    return -ENOENT;
  }
  /* The reference taken while waiting is the reset's. */
  s->resetting = true;
  struct handle *old = steal_ptr(s->h), *dead = NULL;
  handle_retire(old, "reset");
  handle_unref_locked(old, &dead);
  table_unlock();
  handle_free(dead);

  struct handle *h = NULL;
  uint64_t ms;
  int r;
  pthread_mutex_lock(&lock);
  if (shutting_down) {
    *ret_err = strdup("the server is shutting down");
    r = -ESHUTDOWN;
  } else {
    /* The policy and the record go on in the new sandbox. */
    r = make_handle_locked(id, stage, s->egress, NULL, &h, &ms, ret_err);
  }
  s->resetting = false;
  s->last_used_ms = mono_ms();
  if (r == 0 && (s->removed || shutting_down)) {
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
      remove_locked(s, "lost (its reset failed)");
      session_unref_locked(s); /* the table's reference */
    }
    dead = NULL;
    char *msg = xasprintf("%s; session '%s' is closed. Call open_session for a new one.",
                          *ret_err, id);
    free(*ret_err);
    *ret_err = msg;
  }
  session_unref_locked(s);
  pthread_cond_broadcast(&cond);
  table_unlock();
  handle_free(dead);
  if (stage)
    stage_unref(stage); /* the handle holds its own */
  if (r == 0)
    log_info("session %s reset (%" PRIu64 " ms)", id, ms);
  return r;
}

/* Removes S from the table and retires its handle.  Called with the lock;
 * returns a handle to free once the lock is dropped. */
static struct handle *close_locked(struct session *s, const char *why) {
  remove_locked(s, why);
  struct handle *dead = NULL;
  if (s->h) {
    struct handle *h = steal_ptr(s->h);
    handle_retire(h, why);
    handle_unref_locked(h, &dead);
  }
  session_unref_locked(s);
  return dead;
}

int session_close(const char *id, const char *owner, char **ret_err) {
  pthread_mutex_lock(&lock);
  struct session *s = find_locked(id, owner);
  if (!s || s->removed) {
    table_unlock();
    *ret_err = unknown_id(id);
    return -ENOENT;
  }
  /* A reset in progress notices removal and discards its new sandbox. */
  struct handle *dead = close_locked(s, "closed");
  pthread_cond_broadcast(&cond);
  table_unlock();
  handle_free(dead);
  log_info("session %s closed", id);
  return 0;
}

/* ---- commit and fork ---- */

/* Takes session ID for a snapshot: new calls wait (as for a reset) and this
 * waits up to QUIET_WAIT_MS for the calls running on it to end, so that its
 * agent is idle when it is saved.  On success *ret is a lease (the reaper
 * skips the session) to give back with quiet_end. */
static int quiet_begin(const char *id, const char *owner, const char *what, struct lease *ret,
                       char **ret_err) {
  pthread_mutex_lock(&lock);
  struct session *s = find_serving_locked(id, owner, ret_err);
  if (!s) {
    table_unlock();
    return -ENOENT;
  }
  s->snapshotting = true;
  uint64_t deadline = mono_ms() + QUIET_WAIT_MS;
  while (s->busy > 0 && !s->removed && mono_ms() < deadline) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, 100);
    pthread_cond_timedwait(&cond, &lock, &ts);
  }
  if (s->busy > 0 || s->removed || !s->h) {
    *ret_err = s->removed ? removed_while_waiting(s)
                          : xasprintf("cannot %s session '%s': %d call(s) still run in it after "
                                      "%u s. A session is saved only while no call runs in it: "
                                      "wait for them to end (or cancel them), then call %s again.",
                                      what, id, s->busy, QUIET_WAIT_MS / 1000, what);
    s->snapshotting = false;
    pthread_cond_broadcast(&cond);
    session_unref_locked(s);
    table_unlock();
    return -EBUSY;
  }
  s->busy++;
  s->h->refs++;
  ret->s = s;
  ret->h = s->h;
  table_unlock();
  return 0;
}

static void quiet_end(struct lease *l) {
  pthread_mutex_lock(&lock);
  l->s->snapshotting = false;
  pthread_cond_broadcast(&cond);
  table_unlock();
  session_release(l);
}

/* The space a stage of this backend may take before it is made. */
static uint64_t stage_need(void) {
  if (backend == &sandbox_vm_ops)
    return ((uint64_t)cfg.vm_memory_mb + 4) << 20;
  return (uint64_t)sandbox_overlay_mb(cfg.memory_mb, cfg.overlay_mb) << 20;
}

/* Saves the quiet session of L as stage NAME (NULL: anonymous). */
static int snapshot_lease(const struct lease *l, const char *name, bool replace,
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
    r = backend->inputs_id(&inputs, &text, &err);
  if (r < 0) {
    *ret_err = xasprintf("cannot save session '%s': %s", l->s->id, err ? err : strerror(-r));
    return r;
  }
  _cleanup_free_ char *dir = NULL;
  if ((r = stage_begin(stage_need(), &dir, ret_err)) < 0)
    return r;
  r = backend->snapshot(sb, dir, ret_snap, &err);
  if (r < 0) {
    stage_abort(dir);
    _cleanup_free_ char *why = r == -EPIPE ? lease_failure(l, "saving it failed") : NULL;
    *ret_err = why ? steal_ptr(why)
                   : xasprintf("saving session '%s' failed: %s", l->s->id,
                               err ? err : strerror(-r));
    return r;
  }
  /* A guest stopped for the snapshot (vm) has a clock that stood still
   * meanwhile: set it to the host's again, as for a clone. */
  if (ret_snap->carries && strcmp(ret_snap->carries, "memory") == 0) {
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
    *ret_err = strdup("the call ended before the stage was saved, so nothing was saved");
    return -ECANCELED;
  }
  struct stage_new in = {.backend = backend->name, .inputs_id = inputs,
                         .carries = ret_snap->carries, .parent = l->h->stage,
                         .owner = l->s->owner};
  return stage_finish(dir, name, replace, &in, ret, ret_err);
}

/* Saves the quiet session of L as stage NAME; *ret as session_commit's. */
static int commit_lease(const struct lease *l, const char *name, bool replace,
                        const struct commit_stop *stop, uint64_t t0, json_t **ret, char **ret_err) {
  struct stage *st = NULL;
  struct sandbox_snapshot snap = {0};
  int r = snapshot_lease(l, name, replace, stop, &st, &snap, ret_err);
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

int session_commit(const char *id, const char *owner, const char *name, bool replace, json_t **ret,
                   char **ret_err) {
  int r = stage_name_check(name, ret_err);
  if (r < 0)
    return r;
  if (!stages_supported(ret_err))
    return -EOPNOTSUPP;
  uint64_t t0 = mono_us();
  struct lease l;
  if ((r = quiet_begin(id, owner, "commit", &l, ret_err)) < 0)
    return r;
  r = commit_lease(&l, name, replace, NULL, t0, ret, ret_err);
  quiet_end(&l);
  return r;
}

int session_commit_ephemeral(const struct lease *l, const char *name, bool replace,
                             const struct commit_stop *stop, json_t **ret, char **ret_err) {
  int r = stage_name_check(name, ret_err);
  if (r < 0)
    return r;
  if (!stages_supported(ret_err))
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
  pthread_mutex_lock(&lock);
  if (shutting_down) {
    j->r = -ESHUTDOWN;
    j->err = strdup("the server is shutting down");
  } else {
    j->r = make_handle_locked(j->s->id, j->stage, j->s->egress, NULL, &j->s->h, &j->ms, &j->err);
  }
  table_unlock();
  return NULL;
}

int session_fork(const char *id, const char *owner, unsigned count, json_t **ret, char **ret_err) {
  if (!stages_supported(ret_err))
    return -EOPNOTSUPP;
  if (count < 1 || count > SESSION_FORK_MAX) {
    *ret_err = xasprintf("fork: 'count' is %u, outside its range 1..%d", count, SESSION_FORK_MAX);
    return -EINVAL;
  }
  uint64_t t0 = mono_us();
  /* The new sessions' slots first: a fork past the cap changes nothing. */
  pthread_mutex_lock(&lock);
  if (shutting_down) {
    table_unlock();
    *ret_err = strdup("the server is shutting down");
    return -ESHUTDOWN;
  }
  if (n_sessions + count > cfg.max_sessions) {
    *ret_err = xasprintf("cannot fork %u session(s): %u of the %u sessions allowed "
                         "(IGN_MCP_MAX_SESSIONS) are open. Close sessions you no longer need "
                         "(list_sessions shows them), fork fewer, or raise IGN_MCP_MAX_SESSIONS.",
                         count, n_sessions, cfg.max_sessions);
    table_unlock();
    return -EUSERS;
  }
  n_sessions += count;
  table_unlock();

  struct lease l = {0};
  struct stage *st = NULL;
  struct sandbox_snapshot snap = {0};
  /* Each fork gets the source's network policy with a record of its own,
   * copied while the lease keeps the source's egress alive. */
  struct egress *clones[SESSION_FORK_MAX] = {0};
  int r = quiet_begin(id, owner, "fork", &l, ret_err);
  for (unsigned i = 0; r == 0 && l.s->egress && i < count; i++)
    if ((r = egress_clone(l.s->egress, &clones[i])) < 0)
      *ret_err = xasprintf("fork of session '%s' failed: its network policy could not be "
                           "copied (%s)", id, strerror(-r));
  if (r == 0)
    r = snapshot_lease(&l, NULL, false, NULL, &st, &snap, ret_err);
  if (l.s)
    quiet_end(&l);
  struct fork_job jobs[SESSION_FORK_MAX] = {0};
  unsigned made = 0;
  for (unsigned i = 0; r == 0 && i < count; i++, made++) {
    pthread_mutex_lock(&lock);
    unsigned seq = ++next_seq;
    table_unlock();
    /* The forks are the caller's, as the session they copy is. */
    struct session *s = session_new(owner, 's', seq);
    if (!s) {
      r = -ENOMEM;
      break;
    }
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
  pthread_mutex_lock(&lock);
  if (first_err == 0 && shutting_down) {
    /* Shutdown has closed the table already: these would outlive it. */
    first_err = -ESHUTDOWN;
    first_msg = strdup("the server is shutting down");
  }
  for (unsigned i = 0; i < made; i++) {
    struct session *s = jobs[i].s;
    if (first_err == 0) {
      s->created_ms = s->last_used_ms = mono_ms();
      s->next = table;
      table = s;
      json_array_append_new(list, json_pack("{s:s, s:s, s:I}", "session_id", s->id, "isolation",
                                            s->h->sb->isolation, "open_ms", (json_int_t)jobs[i].ms));
    } else {
      /* All or none: the forks that started are closed again. */
      if (s->h) {
        handle_retire(s->h, "closed");
        handle_unref_locked(s->h, &dead[i]);
      }
      bury_locked(s);
    }
  }
  if (first_err < 0)
    n_sessions -= count;
  else
    n_sessions -= count - made; /* (made == count on success) */
  table_unlock();
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

json_t *session_list(const char *owner) {
  json_t *arr = json_array();
  uint64_t now = mono_ms();
  pthread_mutex_lock(&lock);
  for (struct session *s = table; s; s = s->next) {
    if (strcmp(s->owner, owner) != 0)
      continue;
    json_t *o = json_pack("{s:s, s:s, s:I, s:I, s:b, s:b, s:o}", "session_id", s->id, "isolation",
                          s->h ? s->h->sb->isolation : "(resetting)", "age_s",
                          (json_int_t)((now - s->created_ms) / 1000), "idle_s",
                          (json_int_t)(s->busy ? 0 : (now - s->last_used_ms) / 1000), "busy",
                          s->busy > 0, "alive", s->h && agent_conn_alive(s->h->conn), "stage",
                          s->h && s->h->stage && s->h->stage->name ? json_string(s->h->stage->name)
                                                                   : json_null());
    if (s->ephemeral)
      json_object_set_new(o, "ephemeral", json_true());
    json_array_append_new(arr, o);
  }
  table_unlock();
  return json_pack("{s:o, s:i, s:i}", "sessions", arr, "max_sessions", (int)cfg.max_sessions,
                   "idle_secs", (int)cfg.idle_secs);
}

static void *reaper_main(void *unused) {
  (void)unused;
  for (;;) {
    unsigned tick_ms = cfg.idle_secs * 1000 / 4;
    if (tick_ms > 1000)
      tick_ms = 1000;
    if (tick_ms < 100)
      tick_ms = 100;
    usleep(tick_ms * 1000);
    for (;;) {
      pthread_mutex_lock(&lock);
      if (shutting_down) {
        table_unlock();
        return NULL;
      }
      uint64_t now = mono_ms();
      struct session *victim = NULL;
      for (struct session *s = table; s; s = s->next)
        if (!s->busy && !s->resetting && s->h &&
            now - s->last_used_ms >= (uint64_t)cfg.idle_secs * 1000) {
          victim = s;
          break;
        }
      if (!victim) {
        table_unlock();
        break;
      }
      char id[SESSION_ID_MAX];
      memcpy(id, victim->id, sizeof id);
      struct handle *dead = close_locked(victim, "reaped after being idle");
      pthread_cond_broadcast(&cond);
      table_unlock();
      handle_free(dead);
      log_info("session %s reaped after %u s idle", id, cfg.idle_secs);
    }
  }
}

int sessions_init(char **ret_err) {
  sb_cfg = (struct sandbox_config){
      .rootfs = cfg.rootfs, .agent = cfg.agent, .memory_mb = cfg.memory_mb,
      .pids = cfg.pids, .overlay_mb = cfg.overlay_mb,
      .ns_uid_base = cfg.ns_uid_base,
  };
  int r = 0;
  if (cfg.backend != BACKEND_NS) {
    _cleanup_free_ char *err = NULL;
    r = vm_backend_init(&err);
    if (r == 0) {
      backend = &sandbox_vm_ops;
      goto started;
    }
    if (cfg.backend == BACKEND_VM) {
      backend_error = xasprintf("the microVM backend cannot run: %s", err);
      goto started;
    }
    log_info("the microVM backend is not available (%s); using the namespace backend", err);
    r = 0;
  }
  if (!cfg.agent) {
    _cleanup_free_ char *deflt = xasprintf("%s/ign-agent", config_exe_dir());
    backend_error = config_missing_why("IGN_MCP_AGENT", deflt, "an executable file");
    r = -ENOENT;
  } else if (!cfg.rootfs) {
    backend_error = xasprintf("the rootfs '%s' was not found; build the images with `make "
                              "images` (or scripts/setup.sh) or point IGN_MCP_ROOTFS at a rootfs "
                              "directory",
                              cfg.rootfs_spec);
    r = -ENOENT;
  } else {
    /* A user namespace first: as a user, whether the host allows one is
     * the first thing that decides whether the backend can run. */
    _cleanup_free_ char *err = NULL;
    r = ns_probe(&err);
    if (r < 0) {
      backend_error = xasprintf("the namespace backend cannot run: %s", err);
    } else {
      backend = &sandbox_ns_ops;
      cgroup_cleanup_stale();
    }
  }
started:
  if (cfg.host_id[0])
    log_info("host id %s (IGN_MCP_HOST_ID): every session id starts with '%s.'", cfg.host_id,
             cfg.host_id);
  if (r < 0 && ret_err)
    *ret_err = strdup(backend_error);
  /* What servers that died left in the stages (unfinished commits, their
   * forks' anonymous stages). */
  if (backend && backend->snapshot)
    stage_gc();

  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_create(&t, &attr, reaper_main, NULL);
  pthread_attr_destroy(&attr);
  return r;
}

void sessions_shutdown(void) {
  struct handle *dead[1024];
  size_t n_dead = 0;
  pthread_mutex_lock(&lock);
  shutting_down = true;
  while (table) {
    struct handle *d = close_locked(table, "closed (the server is shutting down)");
    if (d && n_dead < ARRAY_SIZE(dead))
      dead[n_dead++] = d;
  }
  /* Sandboxes still starting: their makers see the kill and destroy them. */
  for (struct making *m = making; m; m = m->next)
    if (m->sb)
      m->sb->ops->kill(m->sb);
  pthread_cond_broadcast(&cond);
  table_unlock();
  for (size_t i = 0; i < n_dead; i++)
    handle_free(dead[i]);
  if (backend == &sandbox_vm_ops)
    vm_backend_shutdown();
  /* Then wait for every open and reset still making one, so none is left
   * behind when the server exits.  Those whose sandbox exists were killed
   * and end at once, and a vm create waiting for the warm base gives up
   * when the backend stops; one that is itself making a base again (its
   * inputs changed) may take longer than a shutdown should: that wait is
   * bounded. */
  uint64_t deadline = mono_ms() + SHUTDOWN_MAKING_WAIT_MS;
  pthread_mutex_lock(&lock);
  if (n_making > 0)
    log_info("waiting for %u sandbox(es) still starting to be cleaned up", n_making);
  while (n_making > 0 && mono_ms() < deadline) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, 100);
    pthread_cond_timedwait(&cond, &lock, &ts);
  }
  if (n_making > 0)
    log_warn("%u sandbox(es) still being started after %u s; exiting without them (their "
             "processes die with the server; the next server removes what they left)",
             n_making, SHUTDOWN_MAKING_WAIT_MS / 1000);
  table_unlock();
}
