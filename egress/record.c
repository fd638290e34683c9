/* record.c: the flight recorder (docs/egress-design.md (e)).
 *
 * Per session, every connect and lookup the broker decided: in memory, a
 * ring of the latest RING_MAX events plus counts (results, network_log),
 * and on disk as JSON Lines, <log dir>/<session id>.egress.jsonl (0600).
 * A connect event is recorded when decided and updated as its bytes flow;
 * its line is written when it ends (or at once when refused), so the line
 * holds its final counts.  Names only ever pass through egress_name_sanitize
 * (the broker's callers do it; names here are already clean).
 *
 * The lines go to one writer thread through a bounded queue: the broker
 * never waits for a disk.  A full queue drops lines and the next line that
 * fits says how many ({"kind":"dropped"}); a log over the cap gets one
 * {"kind":"truncated"} line and nothing more.  (runlog.c's writer is made
 * for the stdout/stderr pairs of runs; this one is a few lines.)
 *
 * A sandbox chooses how many events it causes, so a flood of refusals must
 * not hide the ones before it: the record keeps the first FIRST_DENIED
 * refusals of the session (and of the events since the last since_last
 * report) apart from the ring, and counts every refused connect and lookup
 * by destination and reason (COUNTS_MAX of each kind, then one "other"
 * count).
 * A log that was cut (or lost lines) ends, when the session ends, with one
 * {"kind":"summary"} line carrying those counts; its truncated line
 * carries them as they were then. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fs.h"
#include "common/log.h"
#include "common/util.h"
#include "egress/egress_int.h"

#define RING_MAX 512u              /* events kept in memory per session */
#define QUEUE_MAX (4u << 20)       /* bytes of lines queued for every log together */
#define FLUSH_WAIT_MS 2000u
#define FIRST_DENIED 16u           /* the first refusals kept whatever comes after */
#define COUNTS_MAX 64u             /* destinations and reasons of each kind counted one by one */

enum ev_type { REC_CONNECT, REC_DNS, REC_PACKETS };

struct rec_ev {
  enum ev_type type;
  struct rec_conn c;           /* CONNECT; DNS uses ts_ms, host (the name), allowed, reason;
                                * PACKETS ts_ms */
  uint16_t qtype;
  uint64_t packets[3];         /* PACKETS: the increases of UDP, ICMP, other */
};

/* A session's log file, shared by its record and the lines queued for it. */
struct jlog {
  char *path, *file;           /* full path; the name in the directory */
  int fd;                      /* -1 until the writer opens it */
  unsigned refs;               /* the record's + queued lines */
  uint64_t accepted;           /* bytes queued so far (the cap counts these) */
  uint64_t dropped;            /* lines the queue had no room for, not yet said */
  unsigned holders;            /* refs of interceptors (record_log_ref), not lines */
  bool truncated, failed;
  bool lost;                   /* lines were dropped or cut: a summary at the end */
};

struct line {
  struct line *next;
  struct jlog *log;
  size_t len;
  char data[];
};

/* The first refusals of a span (the session, or since the last since_last
 * report), and how many it has had. */
struct firsts {
  struct rec_ev ev[FIRST_DENIED];
  uint64_t seq[FIRST_DENIED];  /* each one's place in the ring */
  size_t n;
  uint64_t total;
};

/* Refusals of one destination for one reason. */
struct denied_count {
  bool dns;                    /* a lookup (the name), else a connect (host or ip, :port) */
  char dest[EGRESS_NAME_BUF + INET6_ADDRSTRLEN + 8];
  char reason[EGRESS_REASON_MAX];
  uint64_t n;
};

struct record {
  pthread_mutex_t lock;
  struct rec_ev *ring;         /* grows up to RING_MAX */
  size_t cap;
  uint64_t seq;                /* events ever; event k is ring[(k-1) % RING_MAX] */
  uint64_t mark;               /* the last event of the previous since_last report */
  uint64_t rate_refused;       /* lookups refused by the rate limit */
  uint64_t rate_second;        /* the second of the last one recorded as an event */
  /* The last reading of the refusal counters, and of which attachment. */
  uint64_t pk_last[3], pk_gen;
  struct firsts first_all, first_run;
  /* Up to COUNTS_MAX connects' and as many lookups' (a flood of made-up
   * names does not take the connects' room), allocated at the first. */
  struct denied_count *counts;
  size_t n_counts, n_kind[2];  /* in all; connects', lookups' */
  uint64_t counts_other;       /* refusals past COUNTS_MAX destinations of their kind */
  struct jlog *log;
};

static struct {
  pthread_mutex_t lock;
  pthread_cond_t wake, done;
  pthread_t thread;
  bool started, stop;
  struct line *head, *tail;
  size_t queued;
} w = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER,
       .done = PTHREAD_COND_INITIALIZER};

/* ---- the writer ---- */

static void jlog_unref_locked(struct jlog *l) {
  if (--l->refs)
    return;
  if (l->fd >= 0)
    close(l->fd);
  free(l->path);
  free(l->file);
  free(l);
}

/* On the writer thread, without the lock. */
static int jlog_open(struct jlog *l) {
  int r = fs_mkdir_p(egress_cfg.log_dir, 0700, 0700);
  if (r < 0)
    return r;
  _cleanup_close_ int dfd = open(egress_cfg.log_dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0)
    return -errno;
  int fd = openat(dfd, l->file, O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0)
    return -errno;
  /* Held while the log is open, as the run logs' are: the logs' pruner
   * (common/runlog.c) removes only files nobody holds. */
  if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
    int e = errno;
    close(fd);
    return -e;
  }
  l->fd = fd;
  return 0;
}

static void *writer_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&w.lock);
  for (;;) {
    while (!w.stop && !w.head)
      pthread_cond_wait(&w.wake, &w.lock);
    if (!w.head)
      break;
    struct line *ln = w.head;
    w.head = ln->next;
    if (!w.head)
      w.tail = NULL;
    struct jlog *l = ln->log;
    bool open_it = l->fd < 0 && !l->failed;
    pthread_mutex_unlock(&w.lock);
    int r = open_it ? jlog_open(l) : 0;
    if (r < 0)
      log_warn("egress: cannot write the log %s: %s", l->path, strerror(-r));
    bool ok = r == 0 && l->fd >= 0 && write(l->fd, ln->data, ln->len) == (ssize_t)ln->len;
    pthread_mutex_lock(&w.lock);
    if (!ok && !l->failed && r == 0)
      log_warn("egress: writing the log %s failed: %s", l->path, strerror(errno));
    l->failed |= !ok;
    w.queued -= ln->len;
    jlog_unref_locked(l);
    free(ln);
    pthread_cond_broadcast(&w.done);
  }
  pthread_mutex_unlock(&w.lock);
  return NULL;
}

int record_init(void) {
  pthread_mutex_lock(&w.lock);
  w.stop = false;
  int r = w.started ? 0 : pthread_create(&w.thread, NULL, writer_main, NULL);
  w.started = r == 0;
  pthread_mutex_unlock(&w.lock);
  return -r;
}

void record_shutdown(void) {
  pthread_mutex_lock(&w.lock);
  if (!w.started) {
    pthread_mutex_unlock(&w.lock);
    return;
  }
  w.stop = true; /* the writer ends once the queue is empty */
  pthread_cond_broadcast(&w.wake);
  pthread_mutex_unlock(&w.lock);
  pthread_join(w.thread, NULL);
  w.started = false;
}

/* Queues TEXT (a whole line) for L; under w.lock.  FORCE: the markers. */
static bool queue_line_locked(struct jlog *l, const char *text, size_t len, bool force) {
  if (!w.started || (!force && w.queued + len > QUEUE_MAX))
    return false;
  struct line *ln = malloc(sizeof *ln + len);
  if (!ln)
    return false;
  memcpy(ln->data, text, len);
  ln->len = len;
  ln->log = l;
  ln->next = NULL;
  l->refs++;
  if (w.tail)
    w.tail->next = ln;
  else
    w.head = ln;
  w.tail = ln;
  w.queued += len;
  l->accepted += len;
  pthread_cond_signal(&w.wake);
  return true;
}

/* O as one line of the log (malloc'd, with its newline; *RET_LEN its
 * length), or NULL. */
static char *line_of(json_t *o, size_t *ret_len) {
  char *text = json_dumps(o, JSON_COMPACT);
  if (!text)
    return NULL;
  size_t len = strlen(text);
  text[len++] = '\n'; /* json_dumps's NUL becomes the newline */
  *ret_len = len;
  return text;
}

static json_t *summary_json(struct record *r, const char *kind);

/* One event's line for R's log L: never waits.  The line that would pass
 * the cap is replaced by the truncated line (with R's counts). */
static void log_event(struct record *r, struct jlog *l, json_t *o) {
  if (!l)
    return;
  size_t len, mark_len = 0;
  _cleanup_free_ char *text = line_of(o, &len);
  _cleanup_free_ char *mark = NULL;
  if (!text)
    return;
  pthread_mutex_lock(&w.lock);
  bool cut = !l->truncated && l->accepted + len > egress_cfg.log_cap;
  pthread_mutex_unlock(&w.lock);
  if (cut && r) {
    json_t *m = summary_json(r, "truncated");
    mark = line_of(m, &mark_len);
    json_decref(m);
  }
  char small[160];
  pthread_mutex_lock(&w.lock);
  if (l->truncated) {
  } else if (l->accepted + len > egress_cfg.log_cap) {
    if (!mark) /* no room for the counts: the marker alone */
      mark_len = (size_t)snprintf(small, sizeof small,
                                  "{\"kind\":\"truncated\",\"ts_ms\":%" PRIu64 "}\n",
                                  now_ns(CLOCK_REALTIME) / 1000000u);
    queue_line_locked(l, mark ? mark : small, mark_len, true);
    l->truncated = l->lost = true;
  } else if (w.queued + len > QUEUE_MAX) {
    l->dropped++;
    l->lost = true;
  } else {
    if (l->dropped) {
      int n = snprintf(small, sizeof small, "{\"kind\":\"dropped\",\"lines\":%" PRIu64 "}\n",
                       l->dropped);
      queue_line_locked(l, small, (size_t)n, true);
      l->dropped = 0;
    }
    queue_line_locked(l, text, len, false);
  }
  pthread_mutex_unlock(&w.lock);
}

/* ---- the record ---- */

struct record *record_new(void) {
  struct record *r = calloc(1, sizeof *r);
  if (r)
    pthread_mutex_init(&r->lock, NULL);
  return r;
}

void record_set_log(struct record *r, const char *session_id) {
  if (!egress_cfg.log_dir || !*egress_cfg.log_dir || !egress_cfg.log_cap || r->log)
    return;
  char id[64];
  size_t i = 0;
  for (; session_id && session_id[i] && i + 1 < sizeof id; i++) {
    char c = session_id[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_';
    id[i] = ok ? c : '_';
  }
  id[i] = '\0';
  struct jlog *l = calloc(1, sizeof *l);
  if (!l)
    return;
  l->fd = -1;
  l->refs = 1;
  l->file = xasprintf("%s.egress.jsonl", i ? id : "session");
  l->path = xasprintf("%s/%s", egress_cfg.log_dir, l->file);
  /* A record that goes on (a session resumed by another server) counts
   * what its file holds already against IGN_MCP_EGRESS_LOG_CAP. */
  struct stat st;
  if (lstat(l->path, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0)
    l->accepted = (uint64_t)st.st_size;
  pthread_mutex_lock(&r->lock);
  r->log = l;
  pthread_mutex_unlock(&r->lock);
}

const char *record_log_path(const struct record *r) { return r->log ? r->log->path : NULL; }

void record_free(struct record *r) {
  if (!r)
    return;
  if (r->log) {
    /* A log that lost lines ends with what the record counted. */
    pthread_mutex_lock(&w.lock);
    bool lost = r->log->lost;
    pthread_mutex_unlock(&w.lock);
    size_t len = 0;
    _cleanup_free_ char *sum = NULL;
    if (lost) {
      json_t *o = summary_json(r, "summary");
      sum = line_of(o, &len);
      json_decref(o);
    }
    pthread_mutex_lock(&w.lock);
    if (sum)
      queue_line_locked(r->log, sum, len, true);
    struct timespec until = timespec_in(CLOCK_REALTIME, FLUSH_WAIT_MS);
    /* The queued lines, not the interceptors still holding the log. */
    while (r->log->refs > 1 + r->log->holders && w.started)
      if (pthread_cond_timedwait(&w.done, &w.lock, &until) == ETIMEDOUT)
        break;
    jlog_unref_locked(r->log); /* the writer frees it after its last line, if any */
    pthread_mutex_unlock(&w.lock);
  }
  free(r->ring);
  free(r->counts);
  pthread_mutex_destroy(&r->lock);
  free(r);
}

/* A slot for the next event; under r->lock. */
static struct rec_ev *ring_next_locked(struct record *r) {
  size_t idx = (size_t)(r->seq % RING_MAX);
  if (idx >= r->cap) {
    size_t nc = r->cap ? r->cap * 2 : 16;
    if (nc > RING_MAX)
      nc = RING_MAX;
    struct rec_ev *t = realloc(r->ring, nc * sizeof *t);
    if (!t)
      return NULL;
    r->ring = t;
    r->cap = nc;
  }
  r->seq++;
  return &r->ring[idx];
}

/* Event SEQ if it is still in the ring; under r->lock. */
static struct rec_ev *ring_find_locked(struct record *r, uint64_t seq) {
  if (!seq || seq > r->seq || r->seq - seq >= RING_MAX)
    return NULL;
  return &r->ring[(seq - 1) % RING_MAX];
}

const char *record_qtype_name(uint16_t qtype, char buf[16]) {
  static const struct {
    uint16_t t;
    const char *n;
  } names[] = {{1, "A"},      {2, "NS"},     {5, "CNAME"},  {6, "SOA"},   {12, "PTR"},
               {15, "MX"},    {16, "TXT"},   {28, "AAAA"},  {33, "SRV"},  {35, "NAPTR"},
               {43, "DS"},    {46, "RRSIG"}, {48, "DNSKEY"}, {64, "SVCB"}, {65, "HTTPS"},
               {252, "AXFR"}, {255, "ANY"},  {257, "CAA"}};
  for (size_t i = 0; i < ARRAY_SIZE(names); i++)
    if (names[i].t == qtype)
      return names[i].n;
  snprintf(buf, 16, "TYPE%u", (unsigned)qtype);
  return buf;
}

static json_t *event_json(const struct rec_ev *e, uint64_t now_ms) {
  const struct rec_conn *c = &e->c;
  json_t *o = json_object();
  if (e->type == REC_PACKETS) {
    json_object_set_new(o, "kind", json_string("refused_packets"));
    json_object_set_new(o, "ts_ms", json_integer((json_int_t)c->ts_ms));
    /* In denied[], where every entry says allowed: false. */
    json_object_set_new(o, "allowed", json_false());
    static const char *const keys[3] = {"udp", "icmp", "other"};
    for (int i = 0; i < 3; i++)
      json_object_set_new(o, keys[i], json_integer((json_int_t)(e->packets[i] > INT64_MAX
                                                                    ? INT64_MAX
                                                                    : e->packets[i])));
    return o;
  }
  if (e->type == REC_DNS) {
    char b[16];
    json_object_set_new(o, "kind", json_string("dns"));
    json_object_set_new(o, "ts_ms", json_integer((json_int_t)c->ts_ms));
    json_object_set_new(o, "name", json_string(c->host));
    json_object_set_new(o, "type", json_string(record_qtype_name(e->qtype, b)));
    json_object_set_new(o, "allowed", json_boolean(c->allowed));
    if (*c->reason)
      json_object_set_new(o, "reason", json_string(c->reason));
    return o;
  }
  json_object_set_new(o, "kind", json_string("connect"));
  json_object_set_new(o, "ts_ms", json_integer((json_int_t)c->ts_ms));
  json_object_set_new(o, "host", *c->host ? json_string(c->host) : json_null());
  json_object_set_new(o, "ip", *c->ip ? json_string(c->ip) : json_null());
  json_object_set_new(o, "port", json_integer(c->port));
  json_object_set_new(o, "allowed", json_boolean(c->allowed));
  if (*c->reason)
    json_object_set_new(o, "reason", json_string(c->reason));
  if (*c->rule)
    json_object_set_new(o, "rule", json_string(c->rule));
  if (*c->sni)
    json_object_set_new(o, "sni", json_string(c->sni));
  json_object_set_new(o, "bytes_up", json_integer((json_int_t)c->bytes_up));
  json_object_set_new(o, "bytes_down", json_integer((json_int_t)c->bytes_down));
  uint64_t duration = c->ended ? c->duration_ms : now_ms - c->start_ms;
  json_object_set_new(o, "duration_ms", json_integer((json_int_t)duration));
  if (c->allowed && !c->ended)
    json_object_set_new(o, "open", json_true());
  return o;
}

/* ---- what no flood evicts ---- */

static void firsts_note(struct firsts *f, const struct rec_ev *ev, uint64_t seq) {
  if (f->n < FIRST_DENIED) {
    f->ev[f->n] = *ev;
    f->seq[f->n++] = seq;
  }
  f->total++;
}

static bool firsts_has(const struct firsts *f, uint64_t seq) {
  for (size_t i = 0; i < f->n; i++)
    if (f->seq[i] == seq)
      return true;
  return false;
}

/* A refused connect or lookup EV counted by destination and reason; under
 * r->lock. */
static void count_locked(struct record *r, const struct rec_ev *ev) {
  const struct rec_conn *c = &ev->c;
  bool dns = ev->type == REC_DNS;
  char dest[sizeof r->counts->dest];
  if (dns)
    snprintf(dest, sizeof dest, "%s", c->host);
  else if (*c->host || !strchr(c->ip, ':'))
    snprintf(dest, sizeof dest, "%s:%u", *c->host ? c->host : c->ip, c->port);
  else
    snprintf(dest, sizeof dest, "[%s]:%u", c->ip, c->port);
  for (size_t i = 0; i < r->n_counts; i++) {
    struct denied_count *d = &r->counts[i];
    if (d->dns == dns && strcmp(d->dest, dest) == 0 && strcmp(d->reason, c->reason) == 0) {
      d->n++;
      return;
    }
  }
  if (!r->counts)
    r->counts = calloc(2 * COUNTS_MAX, sizeof *r->counts);
  if (!r->counts || r->n_kind[dns] >= COUNTS_MAX) {
    r->counts_other++;
    return;
  }
  r->n_kind[dns]++;
  struct denied_count *d = &r->counts[r->n_counts++];
  d->dns = dns;
  snprintf(d->dest, sizeof d->dest, "%s", dest);
  snprintf(d->reason, sizeof d->reason, "%s", c->reason);
  d->n = 1;
}

/* EV, event SEQ of the ring, went to denied[]; under r->lock. */
static void denied_locked(struct record *r, const struct rec_ev *ev, uint64_t seq) {
  firsts_note(&r->first_all, ev, seq);
  firsts_note(&r->first_run, ev, seq);
  if (ev->type == REC_CONNECT)
    count_locked(r, ev);
}

/* [{kind, destination, reason, count}..., {kind: "other", count}]; under
 * r->lock. */
static json_t *counts_json_locked(const struct record *r) {
  json_t *a = json_array();
  for (size_t i = 0; i < r->n_counts; i++) {
    const struct denied_count *d = &r->counts[i];
    json_t *o = json_object();
    json_object_set_new(o, "kind", json_string(d->dns ? "dns" : "connect"));
    json_object_set_new(o, "destination", json_string(d->dest));
    json_object_set_new(o, "reason", json_string(d->reason));
    json_object_set_new(o, "count", json_integer((json_int_t)d->n));
    json_array_append_new(a, o);
  }
  if (r->counts_other) {
    json_t *o = json_object();
    json_object_set_new(o, "kind", json_string("other"));
    json_object_set_new(o, "count", json_integer((json_int_t)r->counts_other));
    json_array_append_new(a, o);
  }
  return a;
}

/* The log's truncated or summary line: the session's counts so far. */
static json_t *summary_json(struct record *r, const char *kind) {
  json_t *o = json_object();
  json_object_set_new(o, "kind", json_string(kind));
  json_object_set_new(o, "ts_ms", json_integer((json_int_t)(now_ns(CLOCK_REALTIME) / 1000000u)));
  pthread_mutex_lock(&r->lock);
  json_object_set_new(o, "total_events", json_integer((json_int_t)r->seq));
  json_object_set_new(o, "denied_total", json_integer((json_int_t)r->first_all.total));
  json_object_set_new(o, "denied_counts", counts_json_locked(r));
  if (r->rate_refused)
    json_object_set_new(o, "dns_refused_by_rate", json_integer((json_int_t)r->rate_refused));
  pthread_mutex_unlock(&r->lock);
  return o;
}

void record_connect(struct record *r, struct rec_conn *c) {
  pthread_mutex_lock(&r->lock);
  struct rec_ev *slot = ring_next_locked(r);
  c->seq = slot ? r->seq : 0; /* 0: not in memory (no room), the log still gets it */
  if (!c->allowed) {
    c->ended = true; /* refused at once */
    c->duration_ms = 0;
  }
  if (slot)
    *slot = (struct rec_ev){.type = REC_CONNECT, .c = *c};
  if (!c->allowed)
    denied_locked(r, &(struct rec_ev){.type = REC_CONNECT, .c = *c}, c->seq);
  struct jlog *l = r->log;
  pthread_mutex_unlock(&r->lock);
  if (!c->allowed) {
    struct rec_ev ev = {.type = REC_CONNECT, .c = *c};
    json_t *o = event_json(&ev, 0);
    log_event(r, l, o);
    json_decref(o);
  }
}

void record_connect_update(struct record *r, const struct rec_conn *c) {
  pthread_mutex_lock(&r->lock);
  struct rec_ev *e = ring_find_locked(r, c->seq);
  if (e && e->type == REC_CONNECT) {
    e->c.bytes_up = c->bytes_up;
    e->c.bytes_down = c->bytes_down;
    snprintf(e->c.sni, sizeof e->c.sni, "%s", c->sni);
  }
  pthread_mutex_unlock(&r->lock);
}

void record_connect_end(struct record *r, struct rec_conn *c) {
  c->ended = true;
  c->duration_ms = mono_ms() - c->start_ms;
  pthread_mutex_lock(&r->lock);
  struct rec_ev *e = ring_find_locked(r, c->seq);
  if (e && e->type == REC_CONNECT)
    e->c = *c;
  if (!c->allowed) /* refused once its first bytes came */
    denied_locked(r, &(struct rec_ev){.type = REC_CONNECT, .c = *c}, c->seq);
  struct jlog *l = r->log;
  pthread_mutex_unlock(&r->lock);
  struct rec_ev ev = {.type = REC_CONNECT, .c = *c};
  json_t *o = event_json(&ev, 0);
  log_event(r, l, o);
  json_decref(o);
}

struct jlog *record_log_ref(struct record *r) {
  pthread_mutex_lock(&r->lock);
  struct jlog *l = r->log;
  pthread_mutex_unlock(&r->lock);
  if (l) {
    pthread_mutex_lock(&w.lock);
    l->refs++;
    l->holders++;
    pthread_mutex_unlock(&w.lock);
  }
  return l;
}

void record_log_line(struct jlog *l, json_t *line) {
  json_object_set_new(line, "ts_ms", json_integer((json_int_t)(now_ns(CLOCK_REALTIME) / 1000000u)));
  log_event(NULL, l, line);
}

void record_log_unref(struct jlog *l) {
  if (!l)
    return;
  pthread_mutex_lock(&w.lock);
  l->holders--;
  jlog_unref_locked(l);
  pthread_mutex_unlock(&w.lock);
}

void record_policy(struct record *r, json_t *line) {
  json_object_set_new(line, "ts_ms", json_integer((json_int_t)(now_ns(CLOCK_REALTIME) / 1000000u)));
  pthread_mutex_lock(&r->lock);
  struct jlog *l = r->log;
  pthread_mutex_unlock(&r->lock);
  log_event(r, l, line);
}

static void dns_locked(struct record *r, const char *name, uint16_t qtype, bool allowed,
                       const char *reason, struct rec_ev *out) {
  struct rec_ev *slot = ring_next_locked(r);
  struct rec_ev ev = {.type = REC_DNS, .qtype = qtype};
  ev.c.ts_ms = now_ns(CLOCK_REALTIME) / 1000000u;
  ev.c.allowed = allowed;
  snprintf(ev.c.host, sizeof ev.c.host, "%s", name);
  snprintf(ev.c.reason, sizeof ev.c.reason, "%s", reason ? reason : "");
  if (slot)
    *slot = ev;
  if (!allowed)
    count_locked(r, &ev);
  *out = ev;
}

void record_dns(struct record *r, const char *name, uint16_t qtype, bool allowed,
                const char *reason) {
  struct rec_ev ev;
  pthread_mutex_lock(&r->lock);
  dns_locked(r, name, qtype, allowed, reason, &ev);
  struct jlog *l = r->log;
  pthread_mutex_unlock(&r->lock);
  json_t *o = event_json(&ev, 0);
  log_event(r, l, o);
  json_decref(o);
}

void record_dns_rate(struct record *r, const char *name, uint16_t qtype) {
  uint64_t second = mono_ms() / 1000u;
  struct rec_ev ev;
  pthread_mutex_lock(&r->lock);
  r->rate_refused++;
  bool first = r->rate_second != second;
  r->rate_second = second;
  if (first) {
    dns_locked(r, name, qtype, false, "query rate", &ev);
  } else { /* not an event, but counted */
    ev = (struct rec_ev){.type = REC_DNS, .qtype = qtype};
    snprintf(ev.c.host, sizeof ev.c.host, "%s", name);
    snprintf(ev.c.reason, sizeof ev.c.reason, "query rate");
    count_locked(r, &ev);
  }
  struct jlog *l = r->log;
  pthread_mutex_unlock(&r->lock);
  if (first) {
    json_t *o = event_json(&ev, 0);
    log_event(r, l, o);
    json_decref(o);
  }
}

void record_refused_packets(struct record *r, uint64_t gen, const uint64_t counts[3]) {
  struct rec_ev ev = {.type = REC_PACKETS};
  bool grew = false;
  pthread_mutex_lock(&r->lock);
  if (r->pk_gen != gen) {
    memset(r->pk_last, 0, sizeof r->pk_last);
    r->pk_gen = gen;
  }
  for (int i = 0; i < 3; i++) {
    ev.packets[i] = counts[i] >= r->pk_last[i] ? counts[i] - r->pk_last[i] : 0;
    grew |= ev.packets[i] > 0;
    r->pk_last[i] = counts[i];
  }
  struct jlog *l = r->log;
  if (grew) {
    ev.c.ts_ms = now_ns(CLOCK_REALTIME) / 1000000u;
    struct rec_ev *slot = ring_next_locked(r);
    if (slot)
      *slot = ev;
    denied_locked(r, &ev, slot ? r->seq : 0);
  }
  pthread_mutex_unlock(&r->lock);
  if (grew) {
    json_t *o = event_json(&ev, 0);
    log_event(r, l, o);
    json_decref(o);
  }
}

void record_report(struct record *r, bool since_last, json_t *out) {
  json_t *lists[3] = {json_array(), json_array(), json_array()}; /* allowed, denied, dns */
  size_t counts[3] = {0, 0, 0};
  bool truncated = false;
  uint64_t now = mono_ms();
  pthread_mutex_lock(&r->lock);
  uint64_t from = since_last ? r->mark : 0; /* events after FROM */
  uint64_t oldest_kept = r->seq > RING_MAX ? r->seq - RING_MAX : 0;
  if (from < oldest_kept)
    truncated = true; /* some fell out of the ring */
  /* denied[]: the span's first refusals, then the latest of the others. */
  struct firsts *f = since_last ? &r->first_run : &r->first_all;
  size_t max[3] = {EGRESS_REPORT_MAX, EGRESS_REPORT_MAX - f->n, EGRESS_REPORT_MAX};
  for (uint64_t k = r->seq; k > from && k > oldest_kept; k--) {
    const struct rec_ev *e = &r->ring[(k - 1) % RING_MAX];
    /* Refused packets go with the refused connections. */
    int which = e->type == REC_DNS ? 2 : e->type == REC_CONNECT && e->c.allowed ? 0 : 1;
    if (which == 1 && firsts_has(f, k))
      continue;
    if (counts[which] >= max[which]) {
      truncated = true;
      continue;
    }
    counts[which]++;
    json_array_insert_new(lists[which], 0, event_json(e, now)); /* oldest first */
  }
  for (size_t i = f->n; i > 0; i--)
    json_array_insert_new(lists[1], 0, event_json(&f->ev[i - 1], now));
  uint64_t denied_total = f->total;
  uint64_t omitted = denied_total > f->n + counts[1] ? denied_total - f->n - counts[1] : 0;
  truncated |= omitted > 0;
  json_t *by_dest = since_last ? NULL : counts_json_locked(r);
  uint64_t total = r->seq - from;
  uint64_t rate = r->rate_refused;
  if (since_last) {
    r->mark = r->seq;
    r->first_run.n = 0;
    r->first_run.total = 0;
  }
  pthread_mutex_unlock(&r->lock);
  json_object_set_new(out, "allowed", lists[0]);
  json_object_set_new(out, "denied", lists[1]);
  json_object_set_new(out, "dns_queries", lists[2]);
  json_object_set_new(out, "total_events", json_integer((json_int_t)total));
  json_object_set_new(out, "truncated", json_boolean(truncated));
  json_object_set_new(out, "denied_total", json_integer((json_int_t)denied_total));
  json_object_set_new(out, "denied_omitted", json_integer((json_int_t)omitted));
  if (by_dest)
    json_object_set_new(out, "denied_counts", by_dest);
  if (rate)
    json_object_set_new(out, "dns_refused_by_rate", json_integer((json_int_t)rate));
}
