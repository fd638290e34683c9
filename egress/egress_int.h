/* egress_int.h: what the broker's files share (egress.h is the interface;
 * this is not).  broker.c runs the thread and takes the connections'
 * callbacks, stream.c decides and relays a stream, names.c answers lookups
 * (the synthetic addresses, the DNS cache) and names_wild.c counts the names
 * under wildcard rules, resolve.c resolves names on the host (the pool, the
 * hosts file), record.c keeps the flight record, egress.c makes a session's
 * egress from a tool's arguments, self.c keeps the server's own listening
 * sockets out of reach, secrets.c holds the operator's secrets, ca.c the
 * CA, and intercept.c (intercept_http.c for the bytes) runs a connection
 * to a host of a secret or with request rules.
 *
 * Ownership: everything under "the broker thread's" below is touched only by
 * the broker thread (or by egress_shutdown after that thread ended), so it
 * needs no lock.  See broker.c's top comment for the locks. */
#pragma once

#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/egress_policy.h"
#include "egress/egress.h"
#include "proto/client.h"

/* Limits of docs/egress-design.md (d). */
#define EGRESS_SYNTH_MAX 4096u        /* synthetic addresses (names) per session */
#define EGRESS_CONNECTS_MAX 16u       /* connects in progress per session */
#define EGRESS_DNS_RATE 200u          /* queries a second per session (and the burst) */
#define EGRESS_CONNECT_MS 10000u
#define EGRESS_PEEK_MS 10000u         /* a web port's first request */
#define EGRESS_FIRST_BYTE_MS 500u     /* a port a rule names: then connect without a peek */
#define EGRESS_IDLE_MS 300000u
#define EGRESS_RESOLVE_MS 5000u
#define EGRESS_RESOLVE_JOBS_MAX 16u   /* resolutions out per session (queued or running) */
#define EGRESS_RESOLVE_FAIL_MS 5000u  /* a name that failed or timed out is not asked again */
#define EGRESS_DNS_TTL 60u            /* of a synthetic answer: it never changes in a session */
#define EGRESS_ADDRS_MAX 16u          /* addresses of one name kept from a resolution */
#define EGRESS_REASON_MAX 96u
#define EGRESS_STATS_MS 1000u         /* the agent's answer to EGRESS_STATS */
#define EGRESS_WILDCARD_NAMES 256u    /* IGN_MCP_EGRESS_WILDCARD_NAMES's default */
#define EGRESS_OWNER_KEY 32u          /* an owner's key: the SHA-256 of its name */

/* The settings in force (egress_init's copy; defaults before it). */
extern struct egress_settings egress_cfg;

const char *egress_mode_name(enum egress_mode m);

/* ---- resolve.c -------------------------------------------------------- */

/* A session's share of the resolver pool (resolve.c; under its lock):
 * counted from the submit until a worker finished the job or it left the
 * queue unstarted, so a job its session gave up on still counts while a
 * worker is stuck in it.  Held by the session and by each job it has out. */
struct resolve_quota;

enum resolve_state { JOB_NEW, JOB_QUEUED, JOB_RUNNING, JOB_DONE };

struct resolve_job {
  struct resolve_job *next;
  char name[EGRESS_NAME_BUF];  /* valid (egress_name_valid), lowercase */
  /* resolve.c's, under its lock. */
  struct resolve_quota *quota; /* NULL once done */
  enum resolve_state state;
  uint64_t started_ms;         /* when a worker took it */
  /* The worker's answer: 0 and N addresses, or an EAI_* code. */
  int gai_err;
  size_t n;
  int family[EGRESS_ADDRS_MAX];
  uint8_t addr[EGRESS_ADDRS_MAX][16];
  bool from_hosts;             /* the hosts file answered */
  uint8_t owner_key[EGRESS_OWNER_KEY]; /* whose answer it is (the DNS cache's key) */
  /* The broker thread's: what waits for the answer (NULL: nothing any
   * more, free it when it comes back), and until when. */
  void *owner;
  bool for_stream;
  uint64_t deadline_ms;
  struct resolve_job *wait_next; /* the broker's list of jobs out */
};

/* Reads the hosts file (logged), starts the pool; WAKE is called (from a
 * worker) after an answer was queued.  0 or -errno with *ret_err. */
int resolve_init(const char *hosts_file, void (*wake)(void), char **ret_err);
struct resolve_quota *resolve_quota_new(void);
/* The session is done with Q (it goes when its last job is done). */
void resolve_quota_put(struct resolve_quota *q);
/* When the hosts file pins J's name: its addresses into J (from_hosts set),
 * true; no pool, no waiting (the file is re-read if it changed). */
bool resolve_hosts_answer(struct resolve_job *j);
/* Stops the workers (a worker inside getaddrinfo is waited for at most a
 * second, then left to finish alone) and frees what was queued. */
void resolve_shutdown(void);
/* Queues J for Q's session: 0, -EBUSY when the session has
 * EGRESS_RESOLVE_JOBS_MAX out already, -EAGAIN when the queue is full (the
 * caller keeps J). */
int resolve_submit(struct resolve_job *j, struct resolve_quota *q);
/* Takes J out of the queue and frees it when no worker started it (true);
 * else false, and *RET_RAN_MS says how long a worker has had it (0: it is
 * done already). */
bool resolve_cancel(struct resolve_job *j, uint64_t *ret_ran_ms);
/* The answers that came back since the last call (a list through next). */
struct resolve_job *resolve_take_done(void);
/* The names the hosts file holds now (-1: no hosts file). */
long resolve_hosts_count(void);

/* ---- record.c --------------------------------------------------------- */

struct record;

/* A connect event as the broker keeps it while the connection lives. */
struct rec_conn {
  uint64_t seq;                /* the record's, 0 until recorded */
  uint64_t ts_ms;              /* wall clock at the open */
  uint64_t start_ms;           /* monotonic at the open */
  char host[EGRESS_NAME_BUF];  /* "" for a raw IP connect */
  char ip[INET6_ADDRSTRLEN];
  uint16_t port;
  bool allowed;
  bool ended;
  char reason[EGRESS_REASON_MAX];
  char rule[EGRESS_ENTRY_MAX + 1];
  char sni[EGRESS_NAME_BUF];   /* the SNI or Host the peek found, "" if none */
  uint64_t bytes_up, bytes_down;
  uint64_t duration_ms;        /* once ended */
};

int record_init(void);
/* Waits (bounded) for the queued lines, stops the writer. */
void record_shutdown(void);
struct record *record_new(void);
/* Writes what is queued for R (bounded wait) and frees it. */
void record_free(struct record *r);
/* Names the log <log_dir>/<session id>.egress.jsonl; the file is made with
 * the first line.  No log when the settings have no directory or cap. */
void record_set_log(struct record *r, const char *session_id);
const char *record_log_path(const struct record *r);
/* The event C as decided (C->seq set); a refused one is written to the log
 * at once (it has ended). */
void record_connect(struct record *r, struct rec_conn *c);
/* Bytes so far of a connection C still open. */
void record_connect_update(struct record *r, const struct rec_conn *c);
/* C ended: its final counts, and its line in the log. */
void record_connect_end(struct record *r, struct rec_conn *c);
void record_dns(struct record *r, const char *name, uint16_t qtype, bool allowed,
                const char *reason);
/* R's log file, held (NULL: none) for lines written from another thread
 * than the record's (intercept.c), which may outlive the record: each
 * line is given its ts_ms; a line past the cap is cut as any other. */
struct jlog;
struct jlog *record_log_ref(struct record *r);
void record_log_line(struct jlog *l, json_t *line);
void record_log_unref(struct jlog *l);
/* A change of policy (network_update): LINE ({"kind":"policy", ...}, given
 * its ts_ms here) goes to the log; the ring keeps connects and lookups. */
void record_policy(struct record *r, json_t *line);
/* A reading of the capture's refusal counters (UDP, ICMP, other) from the
 * agent of attachment GEN: what grew since the previous reading of the
 * same attachment (from 0 for a new one) becomes a refused_packets event.
 * A count lower than before (a vm's root flushed the rules) is a new
 * baseline, not a negative increase. */
void record_refused_packets(struct record *r, uint64_t gen, const uint64_t counts[3]);
/* A query refused by the rate limit: counted; the first of each second is
 * recorded as an event too (a flood does not push everything else out). */
void record_dns_rate(struct record *r, const char *name, uint16_t qtype);
/* {allowed[], denied[], dns_queries[], total_events, truncated, ...} into OUT. */
void record_report(struct record *r, bool since_last, json_t *out);
const char *record_qtype_name(uint16_t qtype, char buf[16]);

/* ---- secrets.c, ca.c, intercept.c ------------------------------------- */

#define SECRET_NAME_MAX 64u
#define SECRETS_MAX 256u
#define SECRET_TOKEN_LEN 37u          /* "ignph" and 32 hex digits */
#define SECRET_VALUE_MAX 8192u

/* An operator's secret (IGN_MCP_SECRETS): fixed from startup on. */
struct secret {
  char *name;
  char *value;
  size_t len;
  struct egress_policy hosts;  /* where its value may go */
  bool cleartext;              /* over plain HTTP too ("cleartext": true) */
};

/* A session's placeholder for a secret. */
struct binding {
  const struct secret *s;
  char token[SECRET_TOKEN_LEN + 1];
};

/* Reads PATH (NULL or "": no secrets).  0 or -EINVAL with *RET_ERR. */
int secrets_init(const char *path, char **ret_err);
void secrets_shutdown(void);
size_t secrets_count(void);
const struct secret *secret_find(const char *name);
/* A new placeholder into OUT.  0 or -EIO. */
int secret_token(char out[SECRET_TOKEN_LEN + 1]);
/* Whether S's value may go to NAME (LEN bytes) on PORT. */
static inline bool secret_for(const struct secret *s, const char *name, size_t len, uint16_t port) {
  return egress_policy_match(&s->hosts, name, len, port) >= 0;
}

/* ca.c: loads or makes the CA in DIR (0700, the euid's); EXTRA_CA (or
 * NULL) is trusted toward the real servers besides the system's.  0 or
 * -errno with *RET_ERR. */
int ca_init(const char *dir, const char *extra_ca, char **ret_err);
/* Where ca_ensure makes the CA (or NULL: nowhere, egress is off). */
void ca_configure(const char *dir, const char *extra_ca);
/* The CA, made or loaded on first need (request rules without secrets):
 * 0, or -errno with *RET_ERR.  Any thread. */
int ca_ensure(char **ret_err);
void ca_shutdown(void);
const char *ca_pem(void);
struct ssl_ctx_st;
struct ssl_st;
struct ssl_ctx_st *ca_client_ctx(void);
struct ssl_ctx_st *ca_server_ctx(void);
/* A server-side TLS object presenting a certificate for NAME, or NULL. */
struct ssl_st *ca_server_ssl(struct ssl_ctx_st *ctx, const char *name);

/* intercept.c: the connection of stream S to ADDR (checked by the
 * broker) goes through an interceptor thread instead: *RET_FD is the
 * broker's end of it (nonblocking).  TLS: the sandbox speaks TLS to the
 * broker.  0 or -errno. */
struct stream;
int intercept_start(struct stream *s, int family, const uint8_t *addr, bool tls, int *ret_fd);
/* E's requests to HOST:PORT are each read and checked: the session's own
 * rules for it are request rules (allow mode; a secret's hosts alone are
 * not). */
bool egress_requests_checked(const struct egress *e, const char *host, uint16_t port);
struct ic_share;
/* The egress's reference to its count of interception threads. */
void intercept_share_unref(struct ic_share *sh);
/* Waits (bounded) for the interceptor threads to end. */
void intercept_shutdown(void);
/* No interceptor thread runs (the secrets may be freed). */
bool intercept_idle(void);

/* ---- broker.c / stream.c / names.c ------------------------------------ */

struct link;
struct stream;
struct lookup;

/* A session's egress. */
struct egress {
  /* The policy: changed only on the broker thread (network_update), under
   * synth_lock, which other threads take to read it. */
  enum egress_mode mode;
  struct egress_policy pol;
  char *session_id;
  uint8_t owner_key[EGRESS_OWNER_KEY]; /* the session's owner (egress_set_session) */
  struct record *rec;
  struct resolve_quota *quota;
  struct ic_share *icpt;       /* its interception threads' count (intercept.c), or NULL */
  pthread_mutex_t att_lock;    /* egress_attach/detach/free */
  struct link *link;           /* under att_lock */
  /* The refusal counters (egress_report asks the attached connection):
   * stats_lock keeps the readings in order (held across the agent's
   * answer: no other lock is); under att_lock, the calls on the link's
   * connection in flight, which attach and detach wait out (stats_done)
   * before the connection may go, and the attachment's number (a new
   * agent's counters start from 0). */
  pthread_mutex_t stats_lock;
  pthread_cond_t stats_done;
  unsigned stats_calls;
  uint64_t att_gen;
  /* The broker thread's; it changes them under synth_lock, which
   * egress_clone takes to copy them from another thread. */
  pthread_mutex_t synth_lock;
  char **synth;                /* synthetic address i+1 -> name */
  uint32_t n_synth;
  uint32_t *synth_slot;        /* hash of names: index+1, 0 empty */
  double dns_tokens;
  uint64_t dns_refill_ms;
  /* The broker thread's (names.c; changed under synth_lock, as synth):
   * the names looked up under the wildcard rules, as salted hashes (an
   * open-addressing set, 0 empty), and how many each rule of pol has. */
  uint64_t *wild_set;
  uint32_t wild_slots, wild_n;
  uint32_t *wild_count;
  uint8_t wild_salt[16];
  /* The broker thread's (under synth_lock): the most names counted under
   * each wildcard suffix the session has had a rule for, so a rule dropped
   * and given again does not start from 0. */
  struct wild_hist { char name[EGRESS_NAME_MAX + 1]; uint32_t count; } *wild_hist;
  size_t n_wild_hist;
  /* Where the sandbox of attachment trust_gen has the CA (trust.c's; under
   * att_lock). */
  uint64_t trust_gen;
  const char *trust_path;
  /* network_update's, held across one (egress_update). */
  pthread_mutex_t upd_lock;
  unsigned open_streams, connecting;
  uint64_t bytes_up, bytes_down;
  /* The session's secrets: like the policy, changed on the broker thread
   * under synth_lock. */
  struct binding *bind;
  size_t n_bind;
};

/* One attached connection (the handler's context). */
struct link {
  struct egress *e;
  struct agent_conn *c;
  egress_counters_fn counters; /* NULL: ask the agent on c */
  void *counters_ctx;
  struct agent_stream_handler handler; /* ctx: this link */
  struct link *next;           /* the broker's list */
  /* Under the inbox lock (broker.c): what the callbacks handed over. */
  struct ev *head, *tail;
  bool ready;                  /* in the broker's ready list */
  struct link *ready_next;
  bool writable, closed, broken;
  /* The broker thread's. */
  struct stream *streams;
  struct lookup *lookups;
  bool dead;                   /* closed: no more streams */
};

/* What a callback hands the broker. */
enum ev_kind { EV_OPEN, EV_DATA, EV_CREDIT, EV_SHUT, EV_RESET, EV_LOOKUP };
struct ev {
  struct ev *next;
  enum ev_kind kind;
  uint32_t id;
  uint32_t n;                  /* CREDIT */
  int err;                     /* RESET */
  struct agent_stream_open o;  /* OPEN */
  uint16_t qtype;              /* LOOKUP */
  size_t len;                  /* DATA bytes, LOOKUP name */
  uint8_t data[];
};

/* broker.c: E's policy becomes MODE, *POL and the placeholders *BIND
 * (*N_BIND; each gets the old one back) on the broker thread, LINE goes to
 * E's log, and the streams (*RET_RESET of them) and lookups the new policy
 * refuses are ended.  0, -ENOMEM, or -ESHUTDOWN (the broker is stopping;
 * nothing changed). */
int broker_set_policy(struct egress *e, enum egress_mode mode, struct egress_policy *pol,
                      struct binding **bind, size_t *n_bind, json_t *line, unsigned *ret_reset);
/* broker.c, for stream.c: the broker's epoll set. */
int broker_watch(int fd, uint32_t events, void *ptr);
int broker_rewatch(int fd, uint32_t events, void *ptr);
void broker_unwatch(int fd);
/* broker.c: a resolution of NAME for OWNER (a stream or a lookup) of E's
 * session; the answer comes to stream_resolved or lookup_resolved, later
 * in the broker's loop (a name the hosts file pins is answered without the
 * pool, in the same turn).  0, or -EBUSY (E has EGRESS_RESOLVE_JOBS_MAX
 * out), -EAGAIN (queue full), -ENOMEM. */
int broker_resolve(struct egress *e, const char *name, void *owner, bool for_stream,
                   struct resolve_job **ret);
/* Stops waiting for J (its owner goes away): out of the queue if no
 * worker took it yet.  How long a worker has had it (0: none, or done). */
uint64_t broker_abandon(struct resolve_job *j);

/* stream.c */
void stream_open(struct link *lk, uint32_t sid, const struct agent_stream_open *o);
struct stream *stream_find(struct link *lk, uint32_t sid);
void stream_data(struct stream *s, const uint8_t *p, size_t n);
void stream_credit(struct stream *s);
void stream_agent_shut(struct stream *s);
void stream_agent_reset(struct stream *s, int err);
void stream_io(struct stream *s, uint32_t events);
void stream_resolved(struct stream *s, struct resolve_job *j);
/* Handles the deadlines of LK's streams; the next one (monotonic ms), 0 if none. */
uint64_t link_stream_timers(struct link *lk, uint64_t now);
/* Ends S: RESET to the agent (unless the connection is gone), recorded. */
void stream_kill(struct stream *s, int err, const char *reason, bool tell_agent);
/* The room in the stream queue may let blocked streams go on. */
void link_writable(struct link *lk);
/* After a policy change: ends LK's streams the policy no longer admits
 * (reset, recorded "network_update: <why>"), and with INTERCEPTED_TOO
 * every intercepted one (the secrets or request rules changed); how many. */
unsigned link_recheck_streams(struct link *lk, bool intercepted_too);
/* The same for LK's lookups waiting for the host's resolver: those the
 * policy no longer admits are answered NXDOMAIN (recorded) and their jobs
 * abandoned.  How many. */
unsigned link_recheck_lookups(struct link *lk);

/* names.c */
void lookup_start(struct link *lk, uint32_t lid, const uint8_t *name, size_t len, uint16_t qtype);
void lookup_resolved(struct lookup *q, struct resolve_job *j);
/* The host's answer of a DNS job J (its lookup may be gone) into the
 * cache of J's owner: an address or no such name for 30 s, another failure
 * for EGRESS_RESOLVE_FAIL_MS. */
void names_cache_job(const struct resolve_job *j);
/* Answers SERVFAIL to lookups waiting too long; the next deadline or 0. */
uint64_t lookup_timers(struct link *lk, uint64_t now);
/* Forgets LK's lookups (the connection went away: nobody to answer). */
void lookup_drop_all(struct link *lk);
/* The name behind a synthetic address, or NULL. */
const char *names_synthetic(const struct egress *e, int family, const uint8_t *addr);
bool names_is_synthetic(int family, const uint8_t *addr);
void names_free(struct egress *e);
/* DST gets SRC's policy (mode and rules), synthetic addresses and the
 * names it counted under its wildcard rules, all of one moment (DST has
 * none yet; SRC's may change on the broker thread meanwhile).  0 or
 * -ENOMEM. */
int names_copy(struct egress *dst, struct egress *src);
/* On the broker thread: E's policy becomes MODE and *POL, and *POL gets
 * the old one (for the caller to free); the names counted under a
 * wildcard rule that stays go on counting.  0, or -ENOMEM (nothing
 * changed). */
int names_set_policy(struct egress *e, enum egress_mode *mode_io, struct egress_policy *pol,
                     struct binding **bind, size_t *n_bind);
/* names_wild.c: whether E may look NAME up as far as its wildcard rules go
 * (a new name under one is counted; false past the cap, with WHY); E's
 * counts freed; DST given SRC's (under SRC's synth_lock).  0 or -ENOMEM. */
bool names_wild_admit(struct egress *e, const char *name, char why[EGRESS_REASON_MAX]);
void names_wild_free(struct egress *e);
int names_wild_copy(struct egress *dst, const struct egress *src);
/* Gives N names synthetic addresses 1..N in order (into a new E): 0, or
 * -EINVAL (a name that is not one) / -ENOMEM. */
int names_restore(struct egress *e, const char *const *names, size_t n);
/* The names counted under E's wildcard rules, made again after
 * names_restore: its synthetic names under them, and for each rule i at
 * least COUNTS[i] (N of them). */
int names_restore_wild(struct egress *e, const uint32_t *counts, size_t n);
void names_cache_clear(void);
/* OWNER's key for the DNS cache into KEY. */
void names_owner_key(const char *owner, uint8_t key[EGRESS_OWNER_KEY]);
/* ADDR is one the sandbox may be sent to: its class, and the reason when
 * refused ("" when allowed): a class the operator does not allow, or an
 * address of the host itself ("the host's own address", but with
 * allow_host).  On the broker thread. */
const char *egress_addr_refusal(int family, const uint8_t *addr);
/* Whether ADDR (v4 as AF_INET) is an address of the host, routed locally:
 * 1, 0, or -errno. */
int egress_addr_local(int family, const uint8_t *addr);

/* self.c */
#define EGRESS_SELF_REASON "the server's own listening socket"
/* The refusal of a connect to ADDR:PORT that would reach a socket this
 * process listens on (EGRESS_SELF_REASON, or why that cannot be told), or
 * NULL; whatever the policy and the operator's settings (self.c). */
const char *egress_self_refusal(int family, const uint8_t *addr, uint16_t port);
/* The same answer from a scan of the descriptors alone, without the
 * kernel's socket table: what egress_self_refusal falls back to. */
const char *egress_self_refusal_by_scan(int family, const uint8_t *addr, uint16_t port);
