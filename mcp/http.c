/* http.c: MCP over Streamable HTTP (ignition-mcp --http [ADDR:]PORT).
 *
 * One endpoint, /mcp, serves both protocol eras, decided per request as on
 * stdio (server.c): a 2026-07-28 request is stateless and carries its
 * metadata in headers that must match its body (MCP-Protocol-Version,
 * Mcp-Method, Mcp-Name, Mcp-Param-Session-Id); a request of 2025-03-26 ...
 * 2025-11-25 belongs to a legacy MCP session that initialize mints
 * (Mcp-Session-Id) and DELETE ends.  Every POST carries one message and gets
 * its answer on its own response: one JSON body, or, for a tools/call that
 * asked for progress from a client that accepts it, an SSE stream of the
 * progress notifications and then the response.  There is no standalone SSE
 * stream (GET is 405): this server never sends anything a request did not
 * ask for.
 *
 * libmicrohttpd runs a thread per connection, which fits the server's
 * thread per call: the connection's thread dispatches the message, then
 * waits on a condition variable for the call thread's answer (struct
 * post_out, the request's struct mcp_out), polling the socket meanwhile so
 * that a client that closes the connection cancels its call (the transport's
 * cancellation).  Sessions (sandboxes) belong to the bearer token's name
 * (call_ctx.owner), never to a legacy MCP session, which is protocol state
 * only.
 *
 * What a client controls is capped: the body (IGN_MCP_MAX_MESSAGE, refused
 * from Content-Length before it is read, and never buffered past the cap),
 * connections (IGN_MCP_HTTP_MAX_CONNECTIONS), the time to deliver a whole
 * request (IGN_MCP_HTTP_TIMEOUT_SECS, counted from the connection's start or
 * its previous response by a watchdog, since libmicrohttpd's own timeout is
 * per inactivity and a byte every few seconds would hold a thread forever),
 * legacy MCP sessions (256, idle ones expire), calls (IGN_MCP_MAX_CALLS, as
 * on stdio). */
#include "mcp/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <nettle/base64.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/tokens.h"
#include "common/util.h"
#include "mcp/config.h"
#include "mcp/log.h"
#include "mcp/server.h"
#include "session/session.h"

#define MCP_PATH "/mcp"
#define PRM_PATH "/.well-known/oauth-protected-resource"
/* Legacy MCP sessions: each is a few bytes, but a client that never sends
 * DELETE must not grow the table forever. */
#define MAX_LEGACY 256
#define LEGACY_IDLE_MS (3600ull * 1000)
/* How often a waiting connection looks whether its client went away. */
#define POLL_MS 100
/* As on stdio: after the sandboxes are gone, how long the calls still
 * running may take to answer. */
#define SHUTDOWN_WAIT_MS 30000
/* Then how long their answers may take to go out. */
#define FLUSH_WAIT_MS 2000
/* Progress notifications an SSE client has not read yet, in bytes: past
 * it more are dropped (progress is a hint; the response always goes out),
 * so a client that does not read cannot make the server hold a command's
 * every output line. */
#define SSE_QUEUE_MAX (1u << 20)
/* Header values quoted in error messages are cut to this. */
#define QUOTE_MAX 64

#define META_VERSION "io.modelcontextprotocol/protocolVersion"

#ifndef MIN
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#endif

static struct {
  struct MHD_Daemon *d;
  struct tokens *tokens;
  bool loopback;
  const char *spec;        /* --http's argument */
  struct sockaddr_storage ss;
  char addr[160];          /* as in URLs: 127.0.0.1, [::1] */
  char base[192];          /* http://ADDR:PORT as bound */
  atomic_bool stopping;    /* shutting down: new requests get 503 */
  atomic_bool abandon;     /* past the shutdown wait: waiting requests give up */
  pthread_mutex_t wd_lock;
  pthread_cond_t wd_cond;
  bool wd_stop;
  atomic_uint serving;     /* requests being served whose answer is not all out */
} srv = {.wd_lock = PTHREAD_MUTEX_INITIALIZER, .wd_cond = PTHREAD_COND_INITIALIZER};

/* ---- connections and the request watchdog ---- */

struct conn {
  struct conn *next;
  int fd;
  uint64_t deadline; /* mono ms by which a whole request must be in; 0: none */
};
/* Guards the table and every fd in it: MHD closes a connection's fd only
 * after its CLOSED notification, which takes this lock, so the watchdog
 * never shuts down an fd that was closed (and perhaps reused). */
static pthread_mutex_t conns_lock = PTHREAD_MUTEX_INITIALIZER;
static struct conn *conns;

static uint64_t timeout_ms(void) { return (uint64_t)cfg.http_timeout_secs * 1000; }

/* Connections open now.  libmicrohttpd's own limit stops accepting (a
 * client over it waits in the listen backlog until a slot frees); this
 * count lets accept_policy close it at once instead, so a client learns
 * that the server is full.  The library's limit is set a little higher. */
static atomic_uint n_conns;
#define CONN_HEADROOM 16

static enum MHD_Result accept_policy(void *cls, const struct sockaddr *addr, socklen_t len) {
  (void)cls;
  (void)addr;
  (void)len;
  if (atomic_load(&n_conns) < cfg.http_max_connections)
    return MHD_YES;
  log_warn("refused a connection: %u are open, IGN_MCP_HTTP_MAX_CONNECTIONS is %u",
           atomic_load(&n_conns), cfg.http_max_connections);
  return MHD_NO;
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_ctx,
                          enum MHD_ConnectionNotificationCode toe) {
  (void)cls;
  if (toe == MHD_CONNECTION_NOTIFY_STARTED)
    atomic_fetch_add(&n_conns, 1);
  else if (toe == MHD_CONNECTION_NOTIFY_CLOSED)
    atomic_fetch_sub(&n_conns, 1);
  if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
    struct conn *k = calloc(1, sizeof *k);
    if (!k)
      return; /* then only libmicrohttpd's own timeout applies to it */
    const union MHD_ConnectionInfo *i =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    k->fd = i ? i->connect_fd : -1;
    k->deadline = mono_ms() + timeout_ms();
    pthread_mutex_lock(&conns_lock);
    k->next = conns;
    conns = k;
    pthread_mutex_unlock(&conns_lock);
    *socket_ctx = k;
  } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED && *socket_ctx) {
    struct conn *k = *socket_ctx;
    pthread_mutex_lock(&conns_lock);
    for (struct conn **pp = &conns; *pp; pp = &(*pp)->next)
      if (*pp == k) {
        *pp = k->next;
        break;
      }
    pthread_mutex_unlock(&conns_lock);
    free(k);
    *socket_ctx = NULL;
  }
}

/* ARMED: the connection waits for a request, which must be in within the
 * timeout; otherwise a request is being served, for as long as it takes. */
static void conn_arm(struct MHD_Connection *c, bool armed) {
  const union MHD_ConnectionInfo *i =
      MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  struct conn *k = i ? i->socket_context : NULL;
  if (k) {
    pthread_mutex_lock(&conns_lock);
    k->deadline = armed ? mono_ms() + timeout_ms() : 0;
    pthread_mutex_unlock(&conns_lock);
  }
  /* libmicrohttpd's inactivity timeout must not end a long call either. */
  MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT,
                            armed ? cfg.http_timeout_secs : 0u);
}

static void *watchdog_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&srv.wd_lock);
  while (!srv.wd_stop) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, 250);
    pthread_cond_timedwait(&srv.wd_cond, &srv.wd_lock, &ts);
    uint64_t now = mono_ms();
    unsigned n = 0;
    pthread_mutex_lock(&conns_lock);
    for (struct conn *k = conns; k; k = k->next)
      if (k->deadline && now >= k->deadline && k->fd >= 0) {
        /* Its thread sees the socket end and libmicrohttpd closes it. */
        shutdown(k->fd, SHUT_RDWR);
        k->deadline = 0;
        n++;
      }
    pthread_mutex_unlock(&conns_lock);
    if (n)
      log_info("closed %u connection(s) that did not deliver a whole request within %u s "
               "(IGN_MCP_HTTP_TIMEOUT_SECS)",
               n, cfg.http_timeout_secs);
  }
  pthread_mutex_unlock(&srv.wd_lock);
  return NULL;
}

/* Whether the client closed its end (or the connection broke). */
static bool peer_gone(int fd) {
  if (fd < 0)
    return false;
  struct pollfd p = {.fd = fd, .events = POLLRDHUP};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* ---- one POST's output ---- */

struct msg {
  struct msg *next;
  char *text;
  size_t len, off; /* off: how much of its SSE event went out */
};

struct post_out {
  struct mcp_out out;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  unsigned refs;   /* the connection (or its SSE response) and the call */
  bool sse;        /* notifications are kept and sent as events */
  bool done;       /* the response is queued */
  bool gone;       /* the client went away: nothing more is kept */
  int error_code;  /* the response's JSON-RPC error code, 0 for a result */
  size_t queued;   /* bytes of the notifications in the queue */
  struct msg *head, **tail;
  int fd;
  uint64_t last_write; /* SSE: when the last bytes went out (keep-alives) */
};

static void post_send(struct mcp_out *o, json_t *m, char *text, size_t len) {
  struct post_out *p = (struct post_out *)o;
  bool response = !json_object_get(m, "method");
  int code = 0;
  json_t *e = json_object_get(m, "error");
  if (e) {
    code = (int)json_integer_value(json_object_get(e, "code"));
    if (!code)
      code = RPC_INTERNAL_ERROR;
  }
  pthread_mutex_lock(&p->lock);
  if (p->gone || p->done || (!p->sse && !response) ||
      (!response && p->queued + len > SSE_QUEUE_MAX)) {
    pthread_mutex_unlock(&p->lock);
    free(text);
    return;
  }
  struct msg *q = calloc(1, sizeof *q);
  if (q) {
    q->text = text;
    q->len = len;
    if (!response)
      p->queued += len;
    *p->tail = q;
    p->tail = &q->next;
  } else {
    free(text);
  }
  if (response) {
    p->done = true;
    p->error_code = q ? code : RPC_INTERNAL_ERROR;
  }
  pthread_cond_broadcast(&p->cond);
  pthread_mutex_unlock(&p->lock);
}

static void post_hold(struct mcp_out *o) {
  struct post_out *p = (struct post_out *)o;
  pthread_mutex_lock(&p->lock);
  p->refs++;
  pthread_mutex_unlock(&p->lock);
}

static void post_release(struct mcp_out *o) {
  struct post_out *p = (struct post_out *)o;
  pthread_mutex_lock(&p->lock);
  unsigned left = --p->refs;
  pthread_cond_broadcast(&p->cond);
  pthread_mutex_unlock(&p->lock);
  if (left)
    return;
  while (p->head) {
    struct msg *q = p->head;
    p->head = q->next;
    free(q->text);
    free(q);
  }
  pthread_mutex_destroy(&p->lock);
  pthread_cond_destroy(&p->cond);
  free(p);
}

static struct post_out *post_new(struct MHD_Connection *c) {
  struct post_out *p = calloc(1, sizeof *p);
  if (!p)
    return NULL;
  p->out = (struct mcp_out){.send = post_send, .hold = post_hold, .release = post_release};
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->cond, NULL);
  p->refs = 1;
  p->tail = &p->head;
  const union MHD_ConnectionInfo *i =
      c ? MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD) : NULL;
  p->fd = i ? i->connect_fd : -1;
  p->last_write = mono_ms();
  return p;
}

/* Waits for P's response, for its call to end without one (cancelled), or
 * for the client to go away (which cancels the call).  False: gone. */
static bool post_wait(struct post_out *p) {
  pthread_mutex_lock(&p->lock);
  while (!p->done && p->refs > 1 && !atomic_load(&srv.abandon)) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, POLL_MS);
    pthread_cond_timedwait(&p->cond, &p->lock, &ts);
    if (!p->done && peer_gone(p->fd))
      p->gone = true;
    if (p->gone)
      break;
  }
  bool gone = p->gone;
  pthread_mutex_unlock(&p->lock);
  if (gone)
    mcp_cancel_out(&p->out);
  return !gone;
}

/* ---- responses ---- */

static enum MHD_Result queue(struct MHD_Connection *c, unsigned status, struct MHD_Response *r) {
  if (!r)
    return MHD_NO;
  enum MHD_Result ret = MHD_queue_response(c, status, r);
  MHD_destroy_response(r);
  return ret;
}

/* A JSON body: TEXT (malloc'd, taken; NULL: no body).  HNAME/HVAL: one more
 * header (or NULL). */
static enum MHD_Result reply_text(struct MHD_Connection *c, unsigned status, char *text,
                                  size_t len, const char *hname, const char *hval) {
  struct MHD_Response *r =
      text ? MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE)
           : MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
  if (!r) {
    free(text);
    return MHD_NO;
  }
  if (text)
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
  if (hname)
    MHD_add_response_header(r, hname, hval);
  return queue(c, status, r);
}

/* Answers with P's first message (the response) as the body. */
static enum MHD_Result reply_post(struct MHD_Connection *c, struct post_out *p, unsigned status,
                                  const char *hname, const char *hval) {
  pthread_mutex_lock(&p->lock);
  struct msg *q = p->head;
  char *text = q ? q->text : NULL;
  size_t len = q ? q->len : 0;
  if (q)
    q->text = NULL;
  pthread_mutex_unlock(&p->lock);
  return reply_text(c, status, text, len, hname, hval);
}

/* A JSON-RPC error as the body (ID may be NULL; DATA stolen). */
static enum MHD_Result reply_error_data(struct MHD_Connection *c, unsigned status, json_t *id,
                                        int code, const char *msg, json_t *data,
                                        const char *hname, const char *hval) {
  struct post_out *p = post_new(NULL);
  if (!p) {
    json_decref(data);
    return MHD_NO;
  }
  mcp_send_error(&p->out, id, code, msg, data);
  enum MHD_Result r = reply_post(c, p, status, hname, hval);
  post_release(&p->out);
  return r;
}

static enum MHD_Result reply_error(struct MHD_Connection *c, unsigned status, json_t *id,
                                   int code, const char *msg) {
  return reply_error_data(c, status, id, code, msg, NULL, NULL, NULL);
}

/* The HTTP status of a response with JSON-RPC error CODE (0: a result).
 * Tool errors are results (isError), so 200.  2026-07-28 gives the request
 * errors their statuses; before it, a JSON-RPC error is a 200 like any
 * answer, but a message that is not a request at all is a 400. */
static unsigned status_of(int code, bool modern) {
  if (code == RPC_PARSE_ERROR || code == RPC_INVALID_REQUEST)
    return MHD_HTTP_BAD_REQUEST;
  if (!modern)
    return MHD_HTTP_OK;
  switch (code) {
  case RPC_METHOD_NOT_FOUND:
    return MHD_HTTP_NOT_FOUND;
  case RPC_INVALID_PARAMS:
  case RPC_UNSUPPORTED_VERSION:
  case RPC_HEADER_MISMATCH:
    return MHD_HTTP_BAD_REQUEST;
  case RPC_INTERNAL_ERROR:
    return MHD_HTTP_INTERNAL_SERVER_ERROR;
  default:
    return MHD_HTTP_OK;
  }
}

/* ---- SSE ---- */

static const char sse_pre[] = "event: message\ndata: ";
static const char sse_post[] = "\n\n";
static const char sse_keepalive[] = ":\n\n";

/* Copies what fits of the first message's event into BUF; drops it once
 * it is all out. */
static size_t sse_copy(struct post_out *p, char *buf, size_t max) {
  struct msg *q = p->head;
  size_t pre = sizeof sse_pre - 1, post = sizeof sse_post - 1;
  size_t total = pre + q->len + post, n = 0;
  while (n < max && q->off < total) {
    size_t off = q->off, chunk;
    if (off < pre) {
      chunk = MIN(pre - off, max - n);
      memcpy(buf + n, sse_pre + off, chunk);
    } else if (off < pre + q->len) {
      chunk = MIN(pre + q->len - off, max - n);
      memcpy(buf + n, q->text + (off - pre), chunk);
    } else {
      chunk = MIN(total - off, max - n);
      memcpy(buf + n, sse_post + (off - pre - q->len), chunk);
    }
    n += chunk;
    q->off += chunk;
  }
  if (q->off == total) {
    if (q->next || !p->done)
      p->queued -= q->len; /* a notification: the response is the last */
    p->head = q->next;
    if (!p->head)
      p->tail = &p->head;
    free(q->text);
    free(q);
  }
  return n;
}

/* Runs on the connection's thread and may block there: it waits for the
 * next message of the call, sends an SSE comment now and then so that no
 * idle timeout ends a quiet call, and ends the stream after the response. */
static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
  (void)pos;
  struct post_out *p = cls;
  uint64_t keepalive = MIN(timeout_ms() / 2, 15000);
  pthread_mutex_lock(&p->lock);
  for (;;) {
    if (p->head) {
      size_t n = sse_copy(p, buf, max);
      p->last_write = mono_ms();
      pthread_mutex_unlock(&p->lock);
      return (ssize_t)n;
    }
    if (p->done || p->refs <= 1) {
      pthread_mutex_unlock(&p->lock);
      return MHD_CONTENT_READER_END_OF_STREAM;
    }
    if (p->gone || atomic_load(&srv.abandon))
      break;
    struct timespec ts = timespec_in(CLOCK_REALTIME, POLL_MS);
    pthread_cond_timedwait(&p->cond, &p->lock, &ts);
    if (!p->head && !p->done && peer_gone(p->fd)) {
      p->gone = true;
      break;
    }
    if (!p->head && mono_ms() - p->last_write >= keepalive && max >= sizeof sse_keepalive) {
      p->last_write = mono_ms();
      pthread_mutex_unlock(&p->lock);
      memcpy(buf, sse_keepalive, sizeof sse_keepalive - 1);
      return (ssize_t)(sizeof sse_keepalive - 1);
    }
  }
  pthread_mutex_unlock(&p->lock);
  mcp_cancel_out(&p->out);
  return MHD_CONTENT_READER_END_WITH_ERROR;
}

/* The stream is over, whole or not: a call still running is cancelled
 * (the client closed the stream, or the connection broke). */
static void sse_free(void *cls) {
  struct post_out *p = cls;
  pthread_mutex_lock(&p->lock);
  bool cancel = !p->done && p->refs > 1;
  p->gone = true;
  pthread_mutex_unlock(&p->lock);
  if (cancel)
    mcp_cancel_out(&p->out);
  post_release(&p->out);
}

/* ---- legacy MCP sessions (2025-03-26 ... 2025-11-25) ---- */

struct legacy {
  char id[33]; /* "" when free */
  char *owner;
  uint64_t used;
};
static pthread_mutex_t legacy_lock = PTHREAD_MUTEX_INITIALIZER;
static struct legacy legacy[MAX_LEGACY];

static void legacy_drop(struct legacy *l) {
  l->id[0] = '\0';
  free(l->owner);
  l->owner = NULL;
}

/* The live session ID made by OWNER, or NULL (an expired one is dropped).
 * Called with legacy_lock held. */
static struct legacy *legacy_find(const char *id, const char *owner) {
  uint64_t now = mono_ms();
  for (size_t i = 0; i < MAX_LEGACY; i++) {
    struct legacy *l = &legacy[i];
    if (!l->id[0] || strcmp(l->id, id) != 0)
      continue;
    if (now - l->used > LEGACY_IDLE_MS) {
      legacy_drop(l);
      return NULL;
    }
    /* Another token's session is as unknown as a missing one. */
    return strcmp(l->owner, owner) == 0 ? l : NULL;
  }
  return NULL;
}

static bool legacy_touch(const char *id, const char *owner) {
  pthread_mutex_lock(&legacy_lock);
  struct legacy *l = legacy_find(id, owner);
  if (l)
    l->used = mono_ms();
  pthread_mutex_unlock(&legacy_lock);
  return l;
}

static bool legacy_end(const char *id, const char *owner) {
  pthread_mutex_lock(&legacy_lock);
  struct legacy *l = legacy_find(id, owner);
  if (l)
    legacy_drop(l);
  pthread_mutex_unlock(&legacy_lock);
  return l;
}

/* A new session for OWNER in RET (33 bytes): a free or expired slot, else
 * the one idle longest (a client that never sends DELETE must not lock the
 * others out).  -errno when no random bytes could be had. */
static int legacy_new(const char *owner, char *ret) {
  uint8_t rnd[16];
  if (getrandom(rnd, sizeof rnd, 0) != sizeof rnd)
    return -errno;
  char *o = strdup(owner);
  if (!o)
    return -ENOMEM;
  pthread_mutex_lock(&legacy_lock);
  uint64_t now = mono_ms();
  struct legacy *slot = NULL;
  for (size_t i = 0; i < MAX_LEGACY && !slot; i++)
    if (!legacy[i].id[0] || now - legacy[i].used > LEGACY_IDLE_MS)
      slot = &legacy[i];
  if (!slot) {
    slot = &legacy[0];
    for (size_t i = 1; i < MAX_LEGACY; i++)
      if (legacy[i].used < slot->used)
        slot = &legacy[i];
    log_info("%d legacy MCP sessions are open: the one idle longest was ended for a new one",
             MAX_LEGACY);
  }
  legacy_drop(slot);
  for (size_t i = 0; i < sizeof rnd; i++)
    snprintf(slot->id + 2 * i, 3, "%02x", rnd[i]);
  slot->owner = o;
  slot->used = now;
  memcpy(ret, slot->id, sizeof slot->id);
  pthread_mutex_unlock(&legacy_lock);
  return 0;
}

/* ---- headers ---- */

static const char *hdr(struct MHD_Connection *c, const char *name) {
  return MHD_lookup_connection_value(c, MHD_HEADER_KIND, name);
}

struct hdr_count {
  const char *name;
  unsigned n;
};

static enum MHD_Result count_one(void *cls, enum MHD_ValueKind kind, const char *key,
                                 const char *value) {
  (void)kind, (void)value;
  struct hdr_count *h = cls;
  if (key && strcasecmp(key, h->name) == 0)
    h->n++;
  return MHD_YES;
}

/* The first header this server decides on that the request sends more than
 * once, or NULL.  Only the first of each is read (hdr), while an
 * intermediary may act on another: one of each is all a request may have. */
static const char *duplicate_header(struct MHD_Connection *c) {
  static const char *const once[] = {
      MHD_HTTP_HEADER_HOST, MHD_HTTP_HEADER_ORIGIN, MHD_HTTP_HEADER_AUTHORIZATION,
      MHD_HTTP_HEADER_CONTENT_TYPE, "MCP-Protocol-Version", "Mcp-Method", "Mcp-Name",
      "Mcp-Param-Session-Id", "Mcp-Session-Id"};
  for (size_t i = 0; i < sizeof once / sizeof once[0]; i++) {
    struct hdr_count h = {.name = once[i]};
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_one, &h);
    if (h.n > 1)
      return once[i];
  }
  return NULL;
}

/* V (N bytes) as it may appear in a message: cut, non-printables as '?'. */
static char *quote(const char *v, size_t n) {
  size_t m = MIN(n, (size_t)QUOTE_MAX);
  char *s = malloc(m + 4);
  if (!s)
    return NULL;
  for (size_t i = 0; i < m; i++)
    s[i] = v[i] >= ' ' && v[i] <= '~' ? v[i] : '?';
  strcpy(s + m, n > m ? "..." : "");
  return s;
}

/* A mirrored header's value as the body holds it.  Values a header may not
 * carry plainly come as =?base64?...?= (2026-07-28, "Value Encoding") when
 * B64 is allowed.  NULL with *RET_WHY set when the value is malformed. */
static char *header_decode(const char *v, bool b64, size_t *ret_len, const char **ret_why) {
  size_t n = strlen(v);
  for (size_t i = 0; i < n; i++)
    if ((v[i] < ' ' || v[i] > '~') && v[i] != '\t') {
      *ret_why = "has a character a header value may not hold (use the =?base64?...?= form)";
      return NULL;
    }
  if (b64 && n >= 11 && strncmp(v, "=?base64?", 9) == 0 && strcmp(v + n - 2, "?=") == 0) {
    struct base64_decode_ctx ctx;
    size_t src = n - 11, len = BASE64_DECODE_LENGTH(src);
    char *out = malloc(len + 1);
    if (!out) {
      *ret_why = "could not be decoded (out of memory)";
      return NULL;
    }
    base64_decode_init(&ctx);
    if (!base64_decode_update(&ctx, &len, (uint8_t *)out, src, v + 9) ||
        !base64_decode_final(&ctx)) {
      free(out);
      *ret_why = "is not valid base64 between =?base64? and ?=";
      return NULL;
    }
    *ret_len = len;
    return out;
  }
  *ret_len = n;
  return strdup(v);
}

/* Checks header NAME against the body's value WANT (a string, or NULL when
 * the body has none, and then the header must be absent too).  NULL when
 * they agree, else the HeaderMismatch message (malloc'd). */
static char *header_mismatch(struct MHD_Connection *c, const char *name, json_t *want,
                             const char *field, bool b64) {
  const char *v = hdr(c, name);
  if (!want) {
    if (!v)
      return NULL;
    _cleanup_free_ char *hv = quote(v, strlen(v));
    return xasprintf("Header mismatch: %s header value '%s' is sent but the body has no %s; "
                     "leave the header out",
                     name, hv ? hv : "", field);
  }
  _cleanup_free_ char *bv = quote(json_string_value(want), json_string_length(want));
  if (!v)
    return xasprintf("Header mismatch: the %s header is missing; it must repeat the body's %s "
                     "('%s')",
                     name, field, bv ? bv : "");
  const char *why = NULL;
  size_t len = 0;
  _cleanup_free_ char *dec = header_decode(v, b64, &len, &why);
  _cleanup_free_ char *hv = quote(v, strlen(v));
  if (!dec)
    return xasprintf("Header mismatch: the %s header value '%s' %s", name, hv ? hv : "",
                     why ? why : "is invalid");
  if (len != json_string_length(want) || memcmp(dec, json_string_value(want), len) != 0)
    return xasprintf("Header mismatch: %s header value '%s' does not match body value '%s' "
                     "(%s)",
                     name, hv ? hv : "", bv ? bv : "", field);
  return NULL;
}

/* The 2026-07-28 request headers (transports/streamable-http, "Request
 * Metadata"): each must say what the body says, so that an intermediary
 * routing on a header acts on what is executed. */
static char *modern_mismatch(struct MHD_Connection *c, const char *m, json_t *params) {
  json_t *meta = json_object_get(params, "_meta");
  json_t *mj = json_string(m);
  char *why = header_mismatch(c, "MCP-Protocol-Version", json_object_get(meta, META_VERSION),
                              "params._meta[\"" META_VERSION "\"]", false);
  if (!why)
    why = header_mismatch(c, "Mcp-Method", mj, "method", false);
  json_decref(mj);
  if (!why && strcmp(m, "tools/call") == 0) {
    json_t *name = json_object_get(params, "name");
    if (json_is_string(name))
      why = header_mismatch(c, "Mcp-Name", name, "params.name", true);
    json_t *sid = json_object_get(json_object_get(params, "arguments"), "session_id");
    /* Tools declare session_id with x-mcp-header "Session-Id"; a value of
     * another type is refused by the tool itself. */
    if (!why && (!sid || json_is_null(sid) || json_is_string(sid)))
      why = header_mismatch(c, "Mcp-Param-Session-Id", json_is_string(sid) ? sid : NULL,
                            "params.arguments.session_id", true);
  }
  return why;
}

/* Whether the comma-separated LIST holds V exactly. */
static bool list_has(const char *list, const char *v, size_t n) {
  for (const char *p = list; p && *p;) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    if (len == n && strncmp(p, v, n) == 0)
      return true;
    p = e ? e + 1 : NULL;
  }
  return false;
}

/* HOST[:PORT] names this machine's loopback (any port). */
static bool loopback_authority(const char *a, size_t n) {
  size_t h = n;
  if (n && a[0] == '[') {
    const char *e = memchr(a, ']', n);
    h = e ? (size_t)(e - a) + 1 : n;
  } else {
    const char *e = memchr(a, ':', n);
    h = e ? (size_t)(e - a) : n;
  }
  for (size_t i = h + 1; i < n; i++)
    if (a[i] < '0' || a[i] > '9')
      return false;
  if (h < n && a[h] != ':')
    return false;
  return (h == 9 && strncasecmp(a, "localhost", 9) == 0) || (h == 9 && strncmp(a, "127.0.0.1", 9) == 0) ||
         (h == 5 && strncmp(a, "[::1]", 5) == 0);
}

/* DNS rebinding: a page in a browser may reach a loopback server under a
 * name of the attacker's; its requests then carry that name in Host and the
 * page's origin in Origin. */
static const char *origin_refusal(struct MHD_Connection *c) {
  const char *h = hdr(c, MHD_HTTP_HEADER_HOST);
  if (srv.loopback && h && !loopback_authority(h, strlen(h)) &&
      !list_has(cfg.http_hosts, h, strlen(h)))
    return "Host";
  const char *o = hdr(c, MHD_HTTP_HEADER_ORIGIN);
  if (!o || list_has(cfg.http_origins, o, strlen(o)))
    return NULL;
  const char *a = strncmp(o, "http://", 7) == 0    ? o + 7
                  : strncmp(o, "https://", 8) == 0 ? o + 8
                                                   : NULL;
  if (srv.loopback && a && loopback_authority(a, strlen(a)))
    return NULL;
  return "Origin";
}

/* Whether the media range list A names TYPE ("application/json"), or a
 * wildcard that covers it when WILD. */
static bool accepts(const char *a, const char *type, bool wild) {
  size_t tn = strlen(type);
  const char *slash = strchr(type, '/');
  for (const char *p = a; p && *p;) {
    while (*p == ' ' || *p == '\t' || *p == ',')
      p++;
    size_t n = strcspn(p, ";, \t");
    if ((n == tn && strncasecmp(p, type, n) == 0) ||
        (wild && ((n == 3 && strncmp(p, "*/*", 3) == 0) ||
                  (n == (size_t)(slash - type) + 2 && strncasecmp(p, type, n - 1) == 0 &&
                   p[n - 1] == '*'))))
      return true;
    p = strchr(p, ',');
  }
  return false;
}

/* ---- requests ---- */

struct req {
  char *body;
  size_t len, cap;
  size_t received;  /* all body bytes, kept or not */
  bool too_big;     /* over IGN_MCP_MAX_MESSAGE: nothing more is kept */
  bool answered;    /* a response was queued before the body */
  bool json_ok, sse_ok;
  bool serving;     /* counted in srv.serving */
  const char *owner;
};

static enum MHD_Result reply_too_big(struct MHD_Connection *c, size_t n) {
  _cleanup_free_ char *m = xasprintf("message too large: %s%zu bytes (IGN_MCP_MAX_MESSAGE is %zu); "
                                     "it was discarded. Send large files in pieces.",
                                     n > cfg.max_message ? "" : "over ", n, cfg.max_message);
  return reply_error(c, MHD_HTTP_CONTENT_TOO_LARGE, NULL, RPC_INVALID_REQUEST, m);
}

static void base_url(struct MHD_Connection *c, char *buf, size_t size) {
  /* Bound to every address, the name the client used is the one it can
   * reach; bound to one, that address. */
  const char *h = hdr(c, MHD_HTTP_HEADER_HOST);
  bool any = strncmp(srv.base, "http://0.0.0.0:", 15) == 0 || strncmp(srv.base, "http://[::]:", 12) == 0;
  if (any && h && strlen(h) < size - 8 && strspn(h, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-:[]") == strlen(h))
    snprintf(buf, size, "http://%s", h);
  else
    snprintf(buf, size, "%s", srv.base);
}

/* RFC 9728 protected resource metadata.  No authorization_servers: the
 * tokens are static, made by whoever runs the server (IGN_MCP_HTTP_TOKENS),
 * so there is no OAuth server a client could get one from. */
static enum MHD_Result serve_metadata(struct MHD_Connection *c) {
  char base[256];
  base_url(c, base, sizeof base);
  _cleanup_free_ char *resource = xasprintf("%s" MCP_PATH, base);
  json_t *j = json_pack("{s:s, s:[s], s:s}", "resource", resource, "bearer_methods_supported",
                        "header", "resource_name", "ignition-mcp");
  char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
  json_decref(j);
  if (!s)
    return MHD_NO;
  return reply_text(c, MHD_HTTP_OK, s, strlen(s), NULL, NULL);
}

/* The name of the request's token ("" without tokens), or NULL after
 * answering 401. */
static const char *authorize(struct MHD_Connection *c) {
  if (!srv.tokens)
    return "";
  const char *a = hdr(c, MHD_HTTP_HEADER_AUTHORIZATION);
  const char *name = NULL;
  if (a && strncasecmp(a, "Bearer ", 7) == 0) {
    const char *t = a + 7;
    while (*t == ' ')
      t++;
    name = tokens_check(srv.tokens, t, strlen(t));
  }
  if (name)
    return name;
  char base[256];
  base_url(c, base, sizeof base);
  _cleanup_free_ char *www =
      xasprintf("Bearer resource_metadata=\"%s" PRM_PATH MCP_PATH "\"%s", base,
                a ? ", error=\"invalid_token\"" : "");
  /* The header itself is never logged: it holds the token. */
  if (a)
    log_info("refused an HTTP request: its bearer token is not in IGN_MCP_HTTP_TOKENS");
  reply_error_data(c, MHD_HTTP_UNAUTHORIZED, NULL, RPC_INVALID_REQUEST,
                   a ? "the bearer token is not valid: send `Authorization: Bearer <token>` "
                       "with a token from the server's IGN_MCP_HTTP_TOKENS file"
                     : "authorization required: send `Authorization: Bearer <token>` with a "
                       "token from the server's IGN_MCP_HTTP_TOKENS file",
                   NULL, MHD_HTTP_HEADER_WWW_AUTHENTICATE, www);
  return NULL;
}

static enum MHD_Result serve_delete(struct MHD_Connection *c, const char *owner) {
  const char *sid = hdr(c, "Mcp-Session-Id");
  if (!sid)
    return reply_error(c, MHD_HTTP_BAD_REQUEST, NULL, RPC_INVALID_REQUEST,
                       "DELETE " MCP_PATH " ends a legacy MCP session: send its Mcp-Session-Id "
                       "header");
  if (!legacy_end(sid, owner))
    return reply_error(c, MHD_HTTP_NOT_FOUND, NULL, RPC_INVALID_REQUEST,
                       "no such MCP session (it ended, expired after an hour idle, or was "
                       "made with another token)");
  return reply_text(c, MHD_HTTP_NO_CONTENT, NULL, 0, NULL, NULL);
}

/* What can be decided from the request line and headers; true when it
 * was answered (the body is then not read). */
static bool early(struct MHD_Connection *c, const char *url, const char *method, struct req *q,
                  enum MHD_Result *ret) {
  *ret = MHD_YES;
  if (atomic_load(&srv.stopping)) {
    *ret = reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, NULL, RPC_INTERNAL_ERROR,
                       "the server is shutting down");
    return true;
  }
  const char *dup = duplicate_header(c);
  if (dup) {
    log_info("refused an HTTP request: it has more than one %s header", dup);
    _cleanup_free_ char *m = xasprintf("the request has more than one %s header: send it once",
                                       dup);
    *ret = reply_error(c, MHD_HTTP_BAD_REQUEST, NULL, RPC_INVALID_REQUEST, m);
    return true;
  }
  const char *bad = origin_refusal(c);
  if (bad) {
    log_info("refused an HTTP request: its %s header is not allowed", bad);
    _cleanup_free_ char *m = xasprintf(
        "forbidden: the %s header is not allowed (a loopback server answers only localhost, "
        "127.0.0.1 and [::1]; allow more with %s)",
        bad, strcmp(bad, "Host") == 0 ? "IGN_MCP_HTTP_HOSTS" : "IGN_MCP_HTTP_ORIGINS");
    *ret = reply_error(c, MHD_HTTP_FORBIDDEN, NULL, RPC_INVALID_REQUEST, m);
    return true;
  }
  if (strcmp(url, PRM_PATH) == 0 || strcmp(url, PRM_PATH MCP_PATH) == 0) {
    *ret = strcmp(method, MHD_HTTP_METHOD_GET) == 0
               ? serve_metadata(c)
               : reply_error_data(c, MHD_HTTP_METHOD_NOT_ALLOWED, NULL, RPC_INVALID_REQUEST,
                                  "the protected resource metadata is read with GET", NULL,
                                  MHD_HTTP_HEADER_ALLOW, "GET");
    return true;
  }
  if (strcmp(url, MCP_PATH) != 0) {
    _cleanup_free_ char *u = quote(url, strlen(url));
    _cleanup_free_ char *m = xasprintf("no such path '%s': the MCP endpoint is " MCP_PATH,
                                       u ? u : "");
    *ret = reply_error(c, MHD_HTTP_NOT_FOUND, NULL, RPC_INVALID_REQUEST, m);
    return true;
  }
  q->owner = authorize(c);
  if (!q->owner)
    return true;
  if (strcmp(method, MHD_HTTP_METHOD_DELETE) == 0) {
    *ret = serve_delete(c, q->owner);
    return true;
  }
  if (strcmp(method, MHD_HTTP_METHOD_POST) != 0) {
    *ret = reply_error_data(c, MHD_HTTP_METHOD_NOT_ALLOWED, NULL, RPC_INVALID_REQUEST,
                            strcmp(method, MHD_HTTP_METHOD_GET) == 0
                                ? "this server has no standalone SSE stream: send each message "
                                  "as a POST; DELETE ends a legacy MCP session"
                                : "send each message as a POST; DELETE ends a legacy MCP session",
                            NULL, MHD_HTTP_HEADER_ALLOW, "POST, DELETE");
    return true;
  }
  const char *ct = hdr(c, MHD_HTTP_HEADER_CONTENT_TYPE);
  size_t ctn = ct ? strcspn(ct, "; \t") : 0;
  if (!ct || ctn != 16 || strncasecmp(ct, "application/json", 16) != 0) {
    *ret = reply_error(c, MHD_HTTP_UNSUPPORTED_MEDIA_TYPE, NULL, RPC_INVALID_REQUEST,
                       "the body must be one JSON-RPC message with Content-Type: "
                       "application/json");
    return true;
  }
  const char *acc = hdr(c, MHD_HTTP_HEADER_ACCEPT);
  q->json_ok = !acc || accepts(acc, "application/json", true);
  q->sse_ok = acc && accepts(acc, "text/event-stream", false);
  if (!q->json_ok && !q->sse_ok) {
    *ret = reply_error(c, MHD_HTTP_NOT_ACCEPTABLE, NULL, RPC_INVALID_REQUEST,
                       "the Accept header must list application/json or text/event-stream "
                       "(the answer is one or the other)");
    return true;
  }
  const char *cl = hdr(c, MHD_HTTP_HEADER_CONTENT_LENGTH);
  if (cl) {
    unsigned long long n = strtoull(cl, NULL, 10);
    if (n > cfg.max_message) {
      *ret = reply_too_big(c, (size_t)MIN(n, (unsigned long long)SIZE_MAX));
      return true;
    }
  }
  return false;
}

/* Checks a legacy request's protocol state; 0 when it may go ahead, else the
 * HTTP status of the refusal already queued.  *RET_INIT: an initialize
 * that starts a session. */
static unsigned legacy_check(struct MHD_Connection *c, json_t *id, const char *m,
                             const char *owner, bool *ret_init, enum MHD_Result *ret) {
  const char *v = hdr(c, "MCP-Protocol-Version");
  if (v && !mcp_legacy_version(v)) {
    _cleanup_free_ char *hv = quote(v, strlen(v));
    _cleanup_free_ char *msg = xasprintf(
        "unsupported MCP-Protocol-Version '%s' for a request without the 2026-07-28 _meta: use "
        "2025-11-25, 2025-06-18 or 2025-03-26 after initialize, or send %s requests with their "
        "_meta",
        hv ? hv : "", MCP_MODERN_VERSION);
    *ret = reply_error(c, MHD_HTTP_BAD_REQUEST, id, RPC_INVALID_REQUEST, msg);
    return MHD_HTTP_BAD_REQUEST;
  }
  const char *sid = hdr(c, "Mcp-Session-Id");
  if (!sid && strcmp(m, "initialize") == 0) {
    *ret_init = true;
    return 0;
  }
  /* A notification changes no protocol state (notifications/cancelled
   * reaches only its owner's calls): one without a session is taken. */
  if (!sid && !id)
    return 0;
  if (!sid) {
    *ret = reply_error(c, MHD_HTTP_BAD_REQUEST, id, RPC_INVALID_REQUEST,
                       "missing Mcp-Session-Id header: send initialize first and then the "
                       "Mcp-Session-Id it returned with every request (or send 2026-07-28 "
                       "requests, which need no session)");
    return MHD_HTTP_BAD_REQUEST;
  }
  if (!legacy_touch(sid, owner)) {
    *ret = reply_error(c, MHD_HTTP_NOT_FOUND, id, RPC_INVALID_REQUEST,
                       "no such MCP session (it ended, expired after an hour idle, or was "
                       "made with another token): send initialize again without "
                       "Mcp-Session-Id");
    return MHD_HTTP_NOT_FOUND;
  }
  return 0;
}

static enum MHD_Result serve_post(struct MHD_Connection *c, struct req *q) {
  if (q->too_big)
    return reply_too_big(c, q->received);
  struct post_out *p = post_new(c);
  if (!p)
    return MHD_NO;
  json_t *msg = mcp_parse(&p->out, q->body ? q->body : "", q->len);
  free(steal_ptr(q->body)); /* not kept while the call runs */
  if (!msg) {
    enum MHD_Result r = reply_post(c, p, MHD_HTTP_BAD_REQUEST, NULL, NULL);
    post_release(&p->out);
    return r;
  }
  if (json_is_array(msg)) {
    json_decref(msg);
    post_release(&p->out);
    return reply_error(c, MHD_HTTP_BAD_REQUEST, NULL, RPC_INVALID_REQUEST,
                       "batches are not supported: send one JSON-RPC message per POST");
  }
  json_t *id = json_object_get(msg, "id"), *method = json_object_get(msg, "method");
  json_t *params = json_object_get(msg, "params");
  bool modern = false, init = false, progress = false;
  enum MHD_Result ret = MHD_YES;
  if (json_is_string(method) && (!params || json_is_object(params)) &&
      strlen(json_string_value(method)) == json_string_length(method)) {
    const char *m = json_string_value(method);
    modern = mcp_request_is_modern(m, params);
    if (modern && id) {
      json_t *data = NULL;
      _cleanup_free_ char *why = NULL;
      int code = mcp_check_envelope(json_object_get(params, "_meta"), &why, &data);
      if (code) {
        ret = reply_error_data(c, MHD_HTTP_BAD_REQUEST, id, code, why, data, NULL, NULL);
        goto done;
      }
      free(steal_ptr(why));
      why = modern_mismatch(c, m, params);
      if (why) {
        log_info("refused a %.100s request: %s", m, why);
        ret = reply_error(c, MHD_HTTP_BAD_REQUEST, id, RPC_HEADER_MISMATCH, why);
        goto done;
      }
    } else if (!modern) {
      if (legacy_check(c, id, m, q->owner, &init, &ret))
        goto done;
    }
    progress = id && strcmp(m, "tools/call") == 0 &&
               json_object_get(json_object_get(params, "_meta"), "progressToken");
  }
  /* SSE when the call will have progress to send and the client takes it,
   * or when it takes nothing else. */
  p->sse = q->sse_ok && (!q->json_ok || progress);
  /* A legacy client may cancel with notifications/cancelled in its own
   * Mcp-Session-Id; a 2026-07-28 client cancels by closing the connection. */
  const char *scope = modern || !msg ? NULL : hdr(c, "Mcp-Session-Id");
  const struct mcp_req r = {.out = &p->out, .bytes = q->received, .owner = q->owner,
                            .cancel_scope = scope};
  mcp_handle_message(&r, msg);

  char sid[33] = "";
  if (init) {
    pthread_mutex_lock(&p->lock);
    bool ok = p->done && p->error_code == 0;
    pthread_mutex_unlock(&p->lock);
    int e = ok ? legacy_new(q->owner, sid) : 0;
    if (e < 0) {
      log_error("cannot make a legacy MCP session id: %s", strerror(-e));
      ret = reply_error(c, MHD_HTTP_INTERNAL_SERVER_ERROR, id, RPC_INTERNAL_ERROR,
                        "cannot make a session id (no random bytes); try again");
      goto done;
    }
    if (ok)
      log_info("legacy MCP session started%s%s", *q->owner ? " for token " : "", q->owner);
  }
  if (p->sse) {
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 64 * 1024, sse_read, p, sse_free);
    if (!resp) {
      /* No stream to send on: the call is not left to run unobserved. */
      mcp_cancel_out(&p->out);
      ret = MHD_NO;
      goto done;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    if (sid[0])
      MHD_add_response_header(resp, "Mcp-Session-Id", sid);
    json_decref(msg);
    /* The stream sends a keep-alive at least every half timeout while the
     * call is quiet, so only a client that stops reading it goes idle. */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, cfg.http_timeout_secs);
    return queue(c, MHD_HTTP_OK, resp); /* our reference went to the response */
  }
  if (!post_wait(p)) {
    ret = MHD_NO; /* the client is gone: nothing to send */
    goto done;
  }
  /* The answer is whole: a client that does not read it must not hold the
   * connection's thread (and the answer) forever. */
  MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, cfg.http_timeout_secs);
  pthread_mutex_lock(&p->lock);
  bool done = p->done;
  int code = p->error_code;
  pthread_mutex_unlock(&p->lock);
  if (!done)
    /* A notification; or a request whose call was cancelled
     * (notifications/cancelled), which gets no answer. */
    ret = atomic_load(&srv.abandon) && id
              ? reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, id, RPC_INTERNAL_ERROR,
                            "the server is shutting down")
              : reply_text(c, id ? MHD_HTTP_NO_CONTENT : MHD_HTTP_ACCEPTED, NULL, 0, NULL, NULL);
  else
    ret = reply_post(c, p, status_of(code, modern), sid[0] ? "Mcp-Session-Id" : NULL, sid);
done:
  json_decref(msg);
  post_release(&p->out);
  return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls) {
  (void)cls, (void)version;
  struct req *q = *con_cls;
  if (!q) {
    q = calloc(1, sizeof *q);
    if (!q)
      return MHD_NO;
    *con_cls = q;
    enum MHD_Result ret;
    q->answered = early(c, url, method, q, &ret);
    return ret;
  }
  if (*upload_size) {
    size_t n = *upload_size;
    *upload_size = 0;
    q->received += n;
    if (q->answered || q->too_big)
      return MHD_YES;
    if (q->len + n > cfg.max_message) {
      q->too_big = true;
      free(steal_ptr(q->body));
      q->len = q->cap = 0;
      return MHD_YES;
    }
    if (q->len + n > q->cap) {
      size_t cap = MAX(q->cap * 2, q->len + n);
      cap = MIN(MAX(cap, (size_t)4096), cfg.max_message);
      char *b = realloc(q->body, cap);
      if (!b)
        return MHD_NO;
      q->body = b;
      q->cap = cap;
    }
    memcpy(q->body + q->len, upload, n);
    q->len += n;
    return MHD_YES;
  }
  if (q->answered)
    return MHD_YES;
  conn_arm(c, false);
  if (!q->serving) {
    q->serving = true;
    atomic_fetch_add(&srv.serving, 1);
  }
  return serve_post(c, q);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
  (void)cls, (void)toe;
  struct req *q = *con_cls;
  if (q) {
    if (q->serving)
      atomic_fetch_sub(&srv.serving, 1);
    free(q->body);
    free(q);
    *con_cls = NULL;
  }
  conn_arm(c, true);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
  (void)cls;
  _cleanup_free_ char *s = NULL;
  if (vasprintf(&s, fmt, ap) < 0)
    return;
  size_t n = strlen(s);
  while (n && s[n - 1] == '\n')
    s[--n] = '\0';
  log_debug("libmicrohttpd: %s", s);
}

/* ---- start and stop ---- */

/* "PORT", "ADDR:PORT" or "[V6]:PORT" into *SS. */
static int parse_spec(const char *spec, struct sockaddr_storage *ss, char *ret_addr, size_t size) {
  char buf[128];
  if (strlen(spec) >= sizeof buf)
    return -EINVAL;
  strcpy(buf, spec);
  char *addr = "127.0.0.1", *port = buf;
  bool v6 = false;
  if (buf[0] == '[') {
    char *e = strchr(buf, ']');
    if (!e || e[1] != ':')
      return -EINVAL;
    *e = '\0';
    addr = buf + 1;
    port = e + 2;
    v6 = true;
  } else {
    char *colon = strrchr(buf, ':');
    if (colon) {
      *colon = '\0';
      addr = buf;
      port = colon + 1;
    }
  }
  char *end;
  errno = 0;
  unsigned long p = strtoul(port, &end, 10);
  if (!*port || *end || errno || p > 65535 || port[0] == '-' || port[0] == '+')
    return -EINVAL;
  memset(ss, 0, sizeof *ss);
  if (v6) {
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)ss;
    s6->sin6_family = AF_INET6;
    s6->sin6_port = htons((uint16_t)p);
    if (inet_pton(AF_INET6, addr, &s6->sin6_addr) != 1)
      return -EINVAL;
    srv.loopback = IN6_IS_ADDR_LOOPBACK(&s6->sin6_addr);
    snprintf(ret_addr, size, "[%s]", addr);
  } else {
    struct sockaddr_in *s4 = (struct sockaddr_in *)ss;
    s4->sin_family = AF_INET;
    s4->sin_port = htons((uint16_t)p);
    if (inet_pton(AF_INET, addr, &s4->sin_addr) != 1)
      return -EINVAL;
    srv.loopback = (ntohl(s4->sin_addr.s_addr) >> 24) == 127;
    snprintf(ret_addr, size, "%s", addr);
  }
  return 0;
}

int http_prepare(const char *spec) {
  if (parse_spec(spec, &srv.ss, srv.addr, sizeof srv.addr) < 0) {
    fprintf(stderr, "ignition-mcp: --http %s is invalid: give PORT, ADDR:PORT or [IPV6]:PORT "
                    "with a numeric address and a port from 0 (any free one) to 65535, e.g. "
                    "--http 127.0.0.1:8080\n",
            spec);
    return -EINVAL;
  }
  if (cfg.http_tokens) {
    _cleanup_free_ char *warn = NULL, *err = NULL;
    if (tokens_load(cfg.http_tokens, &srv.tokens, &warn, &err) < 0) {
      fprintf(stderr, "ignition-mcp: IGN_MCP_HTTP_TOKENS=%s: %s\n", cfg.http_tokens, err);
      return -EINVAL;
    }
    if (warn)
      log_warn("IGN_MCP_HTTP_TOKENS=%s: %s", cfg.http_tokens, warn);
  } else if (!srv.loopback) {
    fprintf(stderr, "ignition-mcp: --http %s would serve sandboxes to anyone who can reach %s "
                    "without authentication: set IGN_MCP_HTTP_TOKENS to a file of name:token "
                    "lines, or bind 127.0.0.1\n",
            spec, srv.addr);
    return -EINVAL;
  }
  srv.spec = spec;
  return 0;
}

int http_serve(void) {
  unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                   MHD_USE_ERROR_LOG | (srv.ss.ss_family == AF_INET6 ? MHD_USE_IPv6 : 0);
  srv.d = MHD_start_daemon(
      flags, 0, accept_policy, NULL, on_request, NULL, MHD_OPTION_SOCK_ADDR,
      (struct sockaddr *)&srv.ss, MHD_OPTION_CONNECTION_LIMIT,
      (unsigned)(cfg.http_max_connections + CONN_HEADROOM), MHD_OPTION_CONNECTION_TIMEOUT,
      cfg.http_timeout_secs, MHD_OPTION_NOTIFY_CONNECTION, on_connection, NULL,
      MHD_OPTION_NOTIFY_COMPLETED, on_completed, NULL, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log,
      NULL, MHD_OPTION_END);
  if (!srv.d) {
    fprintf(stderr, "ignition-mcp: cannot listen on %s (is the port in use, or the address "
                    "not this machine's?); pick another with --http ADDR:PORT\n",
            srv.spec);
    sessions_shutdown();
    if (srv.tokens)
      tokens_free(srv.tokens);
    return 2;
  }
  const union MHD_DaemonInfo *di = MHD_get_daemon_info(srv.d, MHD_DAEMON_INFO_BIND_PORT);
  unsigned port = di ? di->port : 0;
  snprintf(srv.base, sizeof srv.base, "http://%s:%u", srv.addr, port);
  /* One line: whoever reads the port from it also sees the auth policy. */
  if (srv.tokens)
    log_always(LOG_INFO, "listening on %s" MCP_PATH "; auth: bearer tokens, %zu names from %s", srv.base,
             tokens_count(srv.tokens), cfg.http_tokens);
  else
    log_always(LOG_INFO, "listening on %s" MCP_PATH "; auth: none (IGN_MCP_HTTP_TOKENS is not set; only "
             "this machine can connect)", srv.base);

  pthread_t wd;
  bool have_wd = pthread_create(&wd, NULL, watchdog_main, NULL) == 0;
  if (!have_wd)
    log_warn("cannot start the request watchdog: slow clients are bounded only by "
             "IGN_MCP_HTTP_TIMEOUT_SECS of inactivity");

  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGHUP);
  int sig;
  while (sigwait(&mask, &sig) != 0)
    ;
  log_info("received %s, shutting down", strsignal(sig));
  atomic_store(&srv.stopping, true);
  /* As on stdio: the sandboxes go first, so the calls still running end at
   * once with an error that says so, and each is answered. */
  sessions_shutdown();
  unsigned left = mcp_wait_calls(SHUTDOWN_WAIT_MS);
  if (left > 0)
    log_warn("exiting with %u call(s) still running after %u s", left, SHUTDOWN_WAIT_MS / 1000);
  atomic_store(&srv.abandon, true);
  /* The answers are made, but stopping the daemon shuts every connection
   * at once: let them go out first (a client that does not read its own
   * is not waited for long). */
  for (uint64_t end = mono_ms() + FLUSH_WAIT_MS;
       atomic_load(&srv.serving) > 0 && mono_ms() < end;)
    usleep(10 * 1000);
  MHD_stop_daemon(srv.d);
  if (have_wd) {
    pthread_mutex_lock(&srv.wd_lock);
    srv.wd_stop = true;
    pthread_cond_signal(&srv.wd_cond);
    pthread_mutex_unlock(&srv.wd_lock);
    pthread_join(wd, NULL);
  }
  for (size_t i = 0; i < MAX_LEGACY; i++)
    legacy_drop(&legacy[i]);
  if (srv.tokens)
    tokens_free(srv.tokens);
  return 0;
}
