/* broker.c: the egress broker's thread (docs/egress-design.md (c), (d)).
 *
 * One thread per server does every stream's and lookup's I/O: an epoll set
 * over the upstream sockets and one eventfd.  The connections' stream
 * callbacks run on their reader threads and must not block, so they only
 * copy what they were handed into an event (bounded: data never exceeds the
 * windows the broker granted, lookups and streams are capped by the
 * connection) on their link's inbox and wake the broker; the resolver pool
 * hands its answers back the same way.  Session threads attach and detach
 * connections through requests the broker thread carries out, and wait for
 * them: once egress_detach returns, the broker no longer touches the
 * connection.
 *
 * Locks, in the order they may be taken:
 *   egress.stats_lock (egress_report's reading of the refusal counters,
 *                      held across the agent's answer, bounded by
 *                      EGRESS_STATS_MS; only egress_report takes it)
 *   egress.att_lock   (egress_attach/detach/free, held across
 *                      agent_conn_set_streams and the broker request; never
 *                      taken by a callback or by the broker thread)
 *   B.lock            (the inbox: links' event lists, the ready list, the
 *                      requests; held only to move pointers: never while
 *                      calling agent_* or doing I/O)
 *   record locks, the log writer's lock, the resolver's locks (leaves)
 * A callback takes only B.lock.  The broker thread calls agent_* with no
 * lock held.  egress_detach must not be called with B.lock held (it waits in
 * agent_conn_set_streams for running callbacks, which take it).
 *
 * Stream and lookup state (stream.c, names.c) belongs to the broker thread
 * alone and has no lock. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/fs.h"
#include "common/log.h"
#include "common/util.h"
#include "egress/egress_int.h"

struct egress_settings egress_cfg = {
    .max_mode = EGRESS_MODE_ALLOW, .log_cap = 8u << 20, .max_streams = 64,
    .max_bytes = 1ull << 30, .wildcard_names = EGRESS_WILDCARD_NAMES};

enum req_kind { REQ_ATTACH, REQ_DETACH, REQ_POLICY };
struct req {
  struct req *next;
  enum req_kind kind;
  struct link *lk;
  const char *why; /* REQ_DETACH: what the streams' records say ended them */
  /* REQ_POLICY: the session, its new policy (the old one back), the log's
   * line; the answer. */
  struct egress *e;
  enum egress_mode mode;
  struct egress_policy *pol;
  struct binding **bind;
  size_t *n_bind;
  json_t *line;
  int res;
  unsigned reset;
  bool done;
};

static struct {
  pthread_mutex_t lock;
  pthread_cond_t req_done;
  pthread_t thread;
  bool running, stop;
  int epfd, evfd;
  struct link *ready;          /* links with events, under lock */
  struct req *reqs;            /* under lock */
  struct link *links;          /* the broker thread's */
  struct resolve_job *pinned;  /* the broker thread's: answered from the hosts file */
  char *hosts_file, *log_dir;  /* egress_cfg's strings */
} B = {.lock = PTHREAD_MUTEX_INITIALIZER, .req_done = PTHREAD_COND_INITIALIZER,
       .epfd = -1, .evfd = -1};

/* The eventfd's own epoll tag: no stream has this address. */
static char evfd_tag;

static void wake(void) {
  uint64_t one = 1;
  int fd = __atomic_load_n(&B.evfd, __ATOMIC_ACQUIRE);
  if (fd >= 0 && write(fd, &one, sizeof one) < 0) {
    /* EAGAIN: the counter is full, the broker is woken anyway */
  }
}

/* ---- the epoll set (for stream.c) ---- */

int broker_watch(int fd, uint32_t events, void *ptr) {
  struct epoll_event ev = {.events = events, .data.ptr = ptr};
  return epoll_ctl(B.epfd, EPOLL_CTL_ADD, fd, &ev) < 0 ? -errno : 0;
}

int broker_rewatch(int fd, uint32_t events, void *ptr) {
  struct epoll_event ev = {.events = events, .data.ptr = ptr};
  return epoll_ctl(B.epfd, EPOLL_CTL_MOD, fd, &ev) < 0 ? -errno : 0;
}

void broker_unwatch(int fd) { epoll_ctl(B.epfd, EPOLL_CTL_DEL, fd, NULL); }

/* ---- the resolver (for stream.c, names.c) ---- */

int broker_resolve(struct egress *e, const char *name, void *owner, bool for_stream,
                   struct resolve_job **ret) {
  struct resolve_job *j = calloc(1, sizeof *j);
  if (!j)
    return -ENOMEM;
  snprintf(j->name, sizeof j->name, "%s", name);
  memcpy(j->owner_key, e->owner_key, EGRESS_OWNER_KEY);
  j->owner = owner;
  j->for_stream = for_stream;
  j->deadline_ms = mono_ms() + EGRESS_RESOLVE_MS;
  if (resolve_hosts_answer(j)) {
    /* Answered in this turn of the loop (resolver_answers), never behind
     * another session's jobs in the pool. */
    j->state = JOB_DONE;
    j->next = B.pinned;
    B.pinned = j;
    *ret = j;
    return 0;
  }
  int r = resolve_submit(j, e->quota);
  if (r < 0) {
    free(j);
    return r;
  }
  *ret = j;
  return 0;
}

/* A job a worker has, or that is done, is freed when it comes back. */
uint64_t broker_abandon(struct resolve_job *j) {
  if (!j)
    return 0;
  uint64_t ran = 0;
  if (!resolve_cancel(j, &ran))
    j->owner = NULL;
  return ran;
}

static void answer_jobs(struct resolve_job *j) {
  for (struct resolve_job *next; j; j = next) {
    next = j->next;
    if (!j->for_stream && !j->from_hosts)
      names_cache_job(j);
    if (j->owner && j->for_stream)
      stream_resolved(j->owner, j);
    else if (j->owner)
      lookup_resolved(j->owner, j);
    free(j);
  }
}

static void resolver_answers(void) {
  /* No answer starts another resolution: one round suffices. */
  struct resolve_job *pinned = B.pinned;
  B.pinned = NULL;
  answer_jobs(pinned);
  answer_jobs(resolve_take_done());
}

/* ---- the callbacks (reader threads) ---- */

enum { FLAG_WRITABLE = 1, FLAG_CLOSED = 2 };

/* Hands EV (NULL: none, or lost to a failed allocation when FLAGS is 0)
 * and FLAGS to LK's inbox, and wakes the broker. */
static void push(struct link *lk, struct ev *ev, int flags) {
  pthread_mutex_lock(&B.lock);
  if (!B.running) {
    pthread_mutex_unlock(&B.lock);
    free(ev);
    return;
  }
  if (ev) {
    ev->next = NULL;
    if (lk->tail)
      lk->tail->next = ev;
    else
      lk->head = ev;
    lk->tail = ev;
  } else if (!flags) {
    lk->broken = true;
  }
  lk->writable |= (flags & FLAG_WRITABLE) != 0;
  lk->closed |= (flags & FLAG_CLOSED) != 0;
  if (!lk->ready) {
    lk->ready = true;
    lk->ready_next = B.ready;
    B.ready = lk;
  }
  pthread_mutex_unlock(&B.lock);
  wake();
}

static struct ev *ev_new(enum ev_kind kind, uint32_t id, const void *data, size_t len) {
  struct ev *ev = calloc(1, sizeof *ev + len);
  if (!ev)
    return NULL;
  ev->kind = kind;
  ev->id = id;
  ev->len = len;
  if (len)
    memcpy(ev->data, data, len);
  return ev;
}

static void cb_open(void *ctx, uint32_t sid, const struct agent_stream_open *o) {
  struct ev *ev = ev_new(EV_OPEN, sid, NULL, 0);
  if (ev)
    ev->o = *o;
  push(ctx, ev, 0);
}

static void cb_data(void *ctx, uint32_t sid, const uint8_t *p, size_t n) {
  push(ctx, ev_new(EV_DATA, sid, p, n), 0);
}

static void cb_credit(void *ctx, uint32_t sid, uint32_t n) {
  struct ev *ev = ev_new(EV_CREDIT, sid, NULL, 0);
  if (ev)
    ev->n = n;
  push(ctx, ev, 0);
}

static void cb_shut(void *ctx, uint32_t sid) { push(ctx, ev_new(EV_SHUT, sid, NULL, 0), 0); }

static void cb_reset(void *ctx, uint32_t sid, int err) {
  struct ev *ev = ev_new(EV_RESET, sid, NULL, 0);
  if (ev)
    ev->err = err;
  push(ctx, ev, 0);
}

static void cb_lookup(void *ctx, uint32_t lid, const struct agent_lookup *q) {
  size_t len = q->name_len > PROTO_MAX_NAME ? PROTO_MAX_NAME : q->name_len;
  struct ev *ev = ev_new(EV_LOOKUP, lid, q->name, len);
  if (ev)
    ev->qtype = q->qtype;
  push(ctx, ev, 0);
}

/* The flags need no allocation: they cannot be lost. */
static void cb_writable(void *ctx) { push(ctx, NULL, FLAG_WRITABLE); }
static void cb_closed(void *ctx) { push(ctx, NULL, FLAG_CLOSED); }

/* ---- the broker thread ---- */

/* Ends every stream and lookup of LK; TELL: reset them on the channel too. */
static void link_teardown(struct link *lk, bool tell, const char *reason) {
  while (lk->streams)
    stream_kill(lk->streams, ECONNRESET, reason, tell);
  lookup_drop_all(lk);
}

static void link_events(struct link *lk, struct ev *ev, bool writable, bool closed,
                        bool broken) {
  for (struct ev *next; ev; ev = next) {
    next = ev->next;
    struct stream *s = ev->kind == EV_OPEN || ev->kind == EV_LOOKUP || lk->dead
                           ? NULL : stream_find(lk, ev->id);
    if (lk->dead) {
    } else if (ev->kind == EV_OPEN) {
      stream_open(lk, ev->id, &ev->o);
    } else if (ev->kind == EV_LOOKUP) {
      lookup_start(lk, ev->id, ev->data, ev->len, ev->qtype);
    } else if (s && ev->kind == EV_DATA) {
      stream_data(s, ev->data, ev->len);
    } else if (s && ev->kind == EV_CREDIT) {
      stream_credit(s);
    } else if (s && ev->kind == EV_SHUT) {
      stream_agent_shut(s);
    } else if (s && ev->kind == EV_RESET) {
      stream_agent_reset(s, ev->err);
    }
    free(ev);
  }
  if (lk->dead)
    return;
  if (broken) /* an event was lost: the streams' states cannot be trusted */
    link_teardown(lk, true, "out of memory");
  if (writable)
    link_writable(lk);
  if (closed) {
    link_teardown(lk, false, "sandbox connection ended");
    lk->dead = true;
  }
}

static void do_requests(struct req *r) {
  for (struct req *next; r; r = next) {
    next = r->next;
    if (r->kind == REQ_ATTACH) {
      r->lk->next = B.links;
      B.links = r->lk;
    } else if (r->kind == REQ_POLICY) {
      /* The line before the resets it causes; every stream decided from
       * here on sees the new policy. */
      r->res = names_set_policy(r->e, &r->mode, r->pol, r->bind, r->n_bind);
      if (r->res == 0) {
        /* An intercepted connection took the secrets and request rules of
         * its start: with others now, it goes. */
        struct egress *e = r->e;
        /* r->mode, *r->pol, *r->bind: the old ones now. */
        bool stale = r->mode != e->mode || *r->n_bind != e->n_bind || r->pol->n != e->pol.n;
        for (size_t i = 0; !stale && i < e->n_bind; i++)
          stale = (*r->bind)[i].s != e->bind[i].s ||
                  strcmp((*r->bind)[i].token, e->bind[i].token) != 0;
        for (size_t i = 0; !stale && i < e->pol.n; i++)
          stale = !egress_rule_same(&r->pol->rules[i], &e->pol.rules[i]);
        record_policy(e->rec, r->line);
        for (struct link *lk = B.links; lk; lk = lk->next)
          if (lk->e == e && !lk->dead) {
            r->reset += link_recheck_streams(lk, stale);
            link_recheck_lookups(lk);
          }
      }
    } else {
      link_teardown(r->lk, false, r->why ? r->why : "sandbox connection ended");
      r->lk->dead = true;
      for (struct link **p = &B.links; *p; p = &(*p)->next)
        if (*p == r->lk) {
          *p = r->lk->next;
          break;
        }
    }
    pthread_mutex_lock(&B.lock);
    r->done = true;
    pthread_cond_broadcast(&B.req_done);
    pthread_mutex_unlock(&B.lock);
  }
}

/* Takes the requests, then handles the inbox until it is empty, then the
 * requests: every event of a link came before its detach request (the
 * handler was taken away before the request was made), so none is left for
 * a link that is going. */
static void do_inbox(void) {
  pthread_mutex_lock(&B.lock);
  struct req *reqs = B.reqs;
  B.reqs = NULL;
  while (B.ready) {
    struct link *lk = B.ready;
    B.ready = lk->ready_next;
    lk->ready = false;
    struct ev *ev = lk->head;
    bool writable = lk->writable, closed = lk->closed, broken = lk->broken;
    lk->head = lk->tail = NULL;
    lk->writable = lk->closed = lk->broken = false;
    pthread_mutex_unlock(&B.lock);
    link_events(lk, ev, writable, closed, broken);
    pthread_mutex_lock(&B.lock);
  }
  pthread_mutex_unlock(&B.lock);
  do_requests(reqs);
}

static uint64_t do_timers(void) {
  uint64_t now = mono_ms(), next = 0;
  for (struct link *lk = B.links; lk; lk = lk->next) {
    uint64_t t[2] = {lookup_timers(lk, now), link_stream_timers(lk, now)};
    for (int i = 0; i < 2; i++)
      if (t[i] && (!next || t[i] < next))
        next = t[i];
  }
  return next;
}

static void *broker_main(void *arg) {
  (void)arg;
  struct epoll_event evs[64];
  uint64_t next = 0;
  for (;;) {
    uint64_t now = mono_ms();
    int timeout = next ? (next > now ? (int)(next - now) : 0) : 1000;
    if (timeout > 1000)
      timeout = 1000;
    if (B.pinned) /* a timer's connect was answered from the hosts file */
      timeout = 0;
    int n = epoll_wait(B.epfd, evs, ARRAY_SIZE(evs), timeout);
    for (int i = 0; i < n; i++) {
      if (evs[i].data.ptr == &evfd_tag) {
        uint64_t v;
        if (read(B.evfd, &v, sizeof v) < 0) {
          /* EAGAIN: another wake-up took it */
        }
      } else {
        stream_io(evs[i].data.ptr, evs[i].events);
      }
    }
    do_inbox();
    resolver_answers();
    next = do_timers();
    pthread_mutex_lock(&B.lock);
    bool stop = B.stop && !B.reqs;
    pthread_mutex_unlock(&B.lock);
    if (stop)
      break;
  }
  for (struct link *lk = B.links; lk; lk = lk->next) {
    link_teardown(lk, true, "the server is shutting down");
    lk->dead = true;
  }
  answer_jobs(B.pinned); /* abandoned by the teardown: only freed */
  B.pinned = NULL;
  return NULL;
}

/* Carries out R on the broker thread and waits for it; false when the
 * broker is stopping (it takes no more requests). */
static bool request(struct req *r) {
  pthread_mutex_lock(&B.lock);
  if (!B.running || B.stop) {
    pthread_mutex_unlock(&B.lock);
    return false;
  }
  /* In order: two updates of one session are carried out as they came. */
  r->next = NULL;
  struct req **tail = &B.reqs;
  while (*tail)
    tail = &(*tail)->next;
  *tail = r;
  pthread_mutex_unlock(&B.lock);
  wake();
  pthread_mutex_lock(&B.lock);
  while (!r->done)
    pthread_cond_wait(&B.req_done, &B.lock);
  pthread_mutex_unlock(&B.lock);
  return true;
}

/* ---- the interface ---- */

int egress_init(const struct egress_settings *s, char **ret_err) {
  if (B.running) {
    *ret_err = strdup("the egress broker is running already");
    return -EALREADY;
  }
  free(B.hosts_file);
  free(B.log_dir);
  egress_cfg = *s;
  B.hosts_file = s->hosts_file ? strdup(s->hosts_file) : NULL;
  B.log_dir = s->log_dir ? strdup(s->log_dir) : NULL;
  egress_cfg.hosts_file = B.hosts_file;
  egress_cfg.log_dir = B.log_dir;
  if (egress_cfg.off)
    egress_cfg.max_mode = EGRESS_MODE_NONE;
  if (egress_cfg.allow_host)
    egress_cfg.allow_private = true; /* "host" is "1" and more */
  if (!egress_cfg.wildcard_names)
    egress_cfg.wildcard_names = EGRESS_WILDCARD_NAMES;
  names_cache_clear();
  int r = secrets_init(s->secrets_file, ret_err);
  if (r < 0)
    return r;
  /* The CA: now with secrets (a server that cannot intercept their hosts
   * does not start), else when a request rule first needs it. */
  ca_configure(s->off ? NULL : s->ca_dir, s->extra_ca);
  if (secrets_count()) {
    _cleanup_free_ char *err = NULL;
    r = ca_ensure(&err);
    if (r < 0) {
      *ret_err = xasprintf("IGN_MCP_SECRETS is set, so the broker needs its CA: %s",
                           err ? err : "no directory for it");
      secrets_shutdown();
      return r;
    }
  }
  r = record_init();
  if (r < 0) {
    *ret_err = xasprintf("cannot start the egress log writer: %s", strerror(-r));
    return r;
  }
  r = resolve_init(B.hosts_file, wake, ret_err);
  if (r < 0) {
    record_shutdown();
    ca_shutdown();
    secrets_shutdown();
    return r;
  }
  B.epfd = epoll_create1(EPOLL_CLOEXEC);
  int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &evfd_tag};
  if (B.epfd < 0 || efd < 0 || epoll_ctl(B.epfd, EPOLL_CTL_ADD, efd, &ev) < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot set up the egress broker: %s", strerror(errno));
    goto fail;
  }
  __atomic_store_n(&B.evfd, efd, __ATOMIC_RELEASE);
  B.stop = false;
  B.running = true;
  r = -pthread_create(&B.thread, NULL, broker_main, NULL);
  if (r < 0) {
    B.running = false;
    *ret_err = xasprintf("cannot start the egress broker: %s", strerror(-r));
    goto fail;
  }
  return 0;
fail:
  if (efd >= 0)
    close(efd);
  __atomic_store_n(&B.evfd, -1, __ATOMIC_RELEASE);
  if (B.epfd >= 0)
    close(B.epfd);
  B.epfd = -1;
  resolve_shutdown();
  record_shutdown();
  ca_shutdown();
  secrets_shutdown();
  return r;
}

void egress_shutdown(void) {
  pthread_mutex_lock(&B.lock);
  bool running = B.running;
  B.stop = true;
  pthread_mutex_unlock(&B.lock);
  if (!running)
    return;
  wake();
  pthread_join(B.thread, NULL);
  pthread_mutex_lock(&B.lock);
  B.running = false; /* callbacks from here on drop their events */
  pthread_cond_broadcast(&B.req_done); /* detaches waiting for the thread's end */
  for (struct link *lk = B.ready; lk; lk = lk->ready_next) {
    while (lk->head) {
      struct ev *ev = lk->head;
      lk->head = ev->next;
      free(ev);
    }
    lk->tail = NULL;
    lk->ready = false;
  }
  B.ready = NULL;
  pthread_mutex_unlock(&B.lock);
  resolve_shutdown();
  /* The interceptors end once the streams did (their sockets closed); the
   * secrets and the CA they use go only when none is left. */
  intercept_shutdown();
  if (intercept_idle()) {
    ca_shutdown();
    secrets_shutdown();
  }
  record_shutdown();
  close(B.evfd);
  __atomic_store_n(&B.evfd, -1, __ATOMIC_RELEASE);
  close(B.epfd);
  B.epfd = -1;
  names_cache_clear();
}

int broker_set_policy(struct egress *e, enum egress_mode mode, struct egress_policy *pol,
                      struct binding **bind, size_t *n_bind, json_t *line, unsigned *ret_reset) {
  struct req r = {.kind = REQ_POLICY, .e = e, .mode = mode, .pol = pol, .bind = bind,
                  .n_bind = n_bind, .line = line};
  if (!request(&r))
    return -ESHUTDOWN;
  *ret_reset = r.reset;
  return r.res;
}

/* Takes the handler away, lets the broker end LK's streams, frees LK. */
static void detach_link(struct link *lk, const char *why) {
  agent_conn_set_streams(lk->c, NULL);
  struct req r = {.kind = REQ_DETACH, .lk = lk, .why = why};
  if (!request(&r)) {
    /* Shutting down: the thread tears every link down as it ends; wait
     * for that, then only the list is left. */
    pthread_mutex_lock(&B.lock);
    while (B.running)
      pthread_cond_wait(&B.req_done, &B.lock);
    pthread_mutex_unlock(&B.lock);
    for (struct link **p = &B.links; *p; p = &(*p)->next)
      if (*p == lk) {
        *p = lk->next;
        break;
      }
  }
  free(lk);
}

/* e->att_lock is held across the whole of an attach or a detach, so two
 * session threads cannot interleave them; the broker thread and the
 * callbacks never take it. */
/* The counters' readings on the attached connection are over (it may go
 * once it is detached); under att_lock. */
static void stats_wait_locked(struct egress *e) {
  while (e->stats_calls)
    pthread_cond_wait(&e->stats_done, &e->att_lock);
}

void egress_attach(struct egress *e, struct agent_conn *c, egress_counters_fn counters,
                   void *counters_ctx) {
  pthread_mutex_lock(&e->att_lock);
  stats_wait_locked(e);
  e->att_gen++;
  if (e->link) {
    detach_link(e->link, NULL);
    e->link = NULL;
  }
  struct link *lk = c ? calloc(1, sizeof *lk) : NULL;
  if (c && !lk)
    log_error("egress: out of memory: session %s has no egress", e->session_id ? e->session_id : "?");
  if (!lk) {
    pthread_mutex_unlock(&e->att_lock);
    return; /* the connection refuses every stream itself */
  }
  lk->e = e;
  lk->c = c;
  lk->counters = counters;
  lk->counters_ctx = counters_ctx;
  lk->handler = (struct agent_stream_handler){
      .open = cb_open, .data = cb_data, .credit = cb_credit, .shut = cb_shut,
      .reset = cb_reset, .lookup = cb_lookup, .writable = cb_writable, .closed = cb_closed,
      .ctx = lk};
  struct req r = {.kind = REQ_ATTACH, .lk = lk};
  if (!request(&r)) {
    log_warn("egress: the broker is not running: session %s has no egress",
             e->session_id ? e->session_id : "?");
    free(lk);
    pthread_mutex_unlock(&e->att_lock);
    return;
  }
  agent_conn_set_streams(c, &lk->handler);
  e->link = lk;
  pthread_mutex_unlock(&e->att_lock);
}

void egress_detach(struct egress *e) { egress_detach_why(e, NULL); }

void egress_detach_why(struct egress *e, const char *why) {
  pthread_mutex_lock(&e->att_lock);
  stats_wait_locked(e);
  if (e->link)
    detach_link(e->link, why);
  e->link = NULL;
  pthread_mutex_unlock(&e->att_lock);
}
