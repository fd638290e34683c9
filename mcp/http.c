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
 * on stdio).
 *
 * This file has the connections and their watchdog, serving a request, and
 * starting and stopping; http_answer.c a request's answer (JSON or SSE),
 * http_check.c what a request must carry (headers, origin, legacy MCP
 * sessions). */
#include "mcp/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"
#include "common/tokens.h"
#include "common/util.h"
#include "mcp/http_int.h"
#include "mcp/server.h"
#include "session/session.h"

#define MCP_PATH "/mcp"
#define PRM_PATH "/.well-known/oauth-protected-resource"
/* As on stdio: after the sandboxes are gone, how long the calls still
 * running may take to answer. */
#define SHUTDOWN_WAIT_MS 30000
/* Then how long their answers may take to go out. */
#define FLUSH_WAIT_MS 2000

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

uint64_t http_timeout_ms(void) { return (uint64_t)cfg.http_timeout_secs * 1000; }

bool http_abandoning(void) { return atomic_load(&srv.abandon); }

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
    k->deadline = mono_ms() + http_timeout_ms();
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
    k->deadline = armed ? mono_ms() + http_timeout_ms() : 0;
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
  return http_reply_error(c, MHD_HTTP_CONTENT_TOO_LARGE, NULL, RPC_INVALID_REQUEST, m);
}

static void base_url(struct MHD_Connection *c, char *buf, size_t size) {
  /* Bound to every address, the name the client used is the one it can
   * reach; bound to one, that address. */
  const char *h = http_hdr(c, MHD_HTTP_HEADER_HOST);
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
  return http_reply_text(c, MHD_HTTP_OK, s, strlen(s), NULL, NULL);
}

/* The name of the request's token ("" without tokens), or NULL after
 * answering 401. */
static const char *authorize(struct MHD_Connection *c) {
  if (!srv.tokens)
    return "";
  const char *a = http_hdr(c, MHD_HTTP_HEADER_AUTHORIZATION);
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
  http_reply_error_data(c, MHD_HTTP_UNAUTHORIZED, NULL, RPC_INVALID_REQUEST,
                   a ? "the bearer token is not valid: send `Authorization: Bearer <token>` "
                       "with a token from the server's IGN_MCP_HTTP_TOKENS file"
                     : "authorization required: send `Authorization: Bearer <token>` with a "
                       "token from the server's IGN_MCP_HTTP_TOKENS file",
                   NULL, MHD_HTTP_HEADER_WWW_AUTHENTICATE, www);
  return NULL;
}

static enum MHD_Result serve_delete(struct MHD_Connection *c, const char *owner) {
  const char *sid = http_hdr(c, "Mcp-Session-Id");
  if (!sid)
    return http_reply_error(c, MHD_HTTP_BAD_REQUEST, NULL, RPC_INVALID_REQUEST,
                       "DELETE " MCP_PATH " ends a legacy MCP session: send its Mcp-Session-Id "
                       "header");
  if (!http_legacy_end(sid, owner))
    return http_reply_error(c, MHD_HTTP_NOT_FOUND, NULL, RPC_INVALID_REQUEST,
                       "no such MCP session (it ended, expired after an hour idle, or was "
                       "made with another token)");
  return http_reply_text(c, MHD_HTTP_NO_CONTENT, NULL, 0, NULL, NULL);
}

/* What can be decided from the request line and headers; true when it
 * was answered (the body is then not read). */
static bool early(struct MHD_Connection *c, const char *url, const char *method, struct req *q,
                  enum MHD_Result *ret) {
  *ret = MHD_YES;
  if (atomic_load(&srv.stopping)) {
    *ret = http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, NULL, RPC_INTERNAL_ERROR,
                       "the server is shutting down");
    return true;
  }
  const char *dup = http_duplicate_header(c);
  if (dup) {
    log_info("refused an HTTP request: it has more than one %s header", dup);
    _cleanup_free_ char *m = xasprintf("the request has more than one %s header: send it once",
                                       dup);
    *ret = http_reply_error(c, MHD_HTTP_BAD_REQUEST, NULL, RPC_INVALID_REQUEST, m);
    return true;
  }
  if (http_host_missing(c, srv.loopback)) {
    log_info("refused an HTTP request: it has no Host header");
    *ret = http_reply_error(c, MHD_HTTP_BAD_REQUEST, NULL, RPC_INVALID_REQUEST,
                            "the request has no Host header: a loopback server answers only "
                            "requests that name it (Host: 127.0.0.1:PORT, localhost:PORT, "
                            "[::1]:PORT or a name in IGN_MCP_HTTP_HOSTS)");
    return true;
  }
  const char *bad = http_origin_refusal(c, srv.loopback);
  if (bad) {
    log_info("refused an HTTP request: its %s header is not allowed", bad);
    _cleanup_free_ char *m = xasprintf(
        "forbidden: the %s header is not allowed (a loopback server answers only localhost, "
        "127.0.0.1 and [::1]; allow more with %s)",
        bad, strcmp(bad, "Host") == 0 ? "IGN_MCP_HTTP_HOSTS" : "IGN_MCP_HTTP_ORIGINS");
    *ret = http_reply_error(c, MHD_HTTP_FORBIDDEN, NULL, RPC_INVALID_REQUEST, m);
    return true;
  }
  if (strcmp(url, PRM_PATH) == 0 || strcmp(url, PRM_PATH MCP_PATH) == 0) {
    *ret = strcmp(method, MHD_HTTP_METHOD_GET) == 0
               ? serve_metadata(c)
               : http_reply_error_data(c, MHD_HTTP_METHOD_NOT_ALLOWED, NULL, RPC_INVALID_REQUEST,
                                  "the protected resource metadata is read with GET", NULL,
                                  MHD_HTTP_HEADER_ALLOW, "GET");
    return true;
  }
  if (strcmp(url, MCP_PATH) != 0) {
    _cleanup_free_ char *u = http_quote(url, strlen(url));
    _cleanup_free_ char *m = xasprintf("no such path '%s': the MCP endpoint is " MCP_PATH,
                                       u ? u : "");
    *ret = http_reply_error(c, MHD_HTTP_NOT_FOUND, NULL, RPC_INVALID_REQUEST, m);
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
    *ret = http_reply_error_data(c, MHD_HTTP_METHOD_NOT_ALLOWED, NULL, RPC_INVALID_REQUEST,
                            strcmp(method, MHD_HTTP_METHOD_GET) == 0
                                ? "this server has no standalone SSE stream: send each message "
                                  "as a POST; DELETE ends a legacy MCP session"
                                : "send each message as a POST; DELETE ends a legacy MCP session",
                            NULL, MHD_HTTP_HEADER_ALLOW, "POST, DELETE");
    return true;
  }
  const char *ct = http_hdr(c, MHD_HTTP_HEADER_CONTENT_TYPE);
  size_t ctn = ct ? strcspn(ct, "; \t") : 0;
  if (!ct || ctn != 16 || strncasecmp(ct, "application/json", 16) != 0) {
    *ret = http_reply_error(c, MHD_HTTP_UNSUPPORTED_MEDIA_TYPE, NULL, RPC_INVALID_REQUEST,
                       "the body must be one JSON-RPC message with Content-Type: "
                       "application/json");
    return true;
  }
  const char *acc = http_hdr(c, MHD_HTTP_HEADER_ACCEPT);
  q->json_ok = !acc || http_accepts(acc, "application/json", true);
  q->sse_ok = acc && http_accepts(acc, "text/event-stream", false);
  if (!q->json_ok && !q->sse_ok) {
    *ret = http_reply_error(c, MHD_HTTP_NOT_ACCEPTABLE, NULL, RPC_INVALID_REQUEST,
                       "the Accept header must list application/json or text/event-stream "
                       "(the answer is one or the other)");
    return true;
  }
  const char *cl = http_hdr(c, MHD_HTTP_HEADER_CONTENT_LENGTH);
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
  const char *v = http_hdr(c, "MCP-Protocol-Version");
  if (v && !mcp_legacy_version(v)) {
    _cleanup_free_ char *hv = http_quote(v, strlen(v));
    _cleanup_free_ char *msg = xasprintf(
        "unsupported MCP-Protocol-Version '%s' for a request without the 2026-07-28 _meta: use "
        "2025-11-25, 2025-06-18 or 2025-03-26 after initialize, or send %s requests with their "
        "_meta",
        hv ? hv : "", MCP_MODERN_VERSION);
    *ret = http_reply_error(c, MHD_HTTP_BAD_REQUEST, id, RPC_INVALID_REQUEST, msg);
    return MHD_HTTP_BAD_REQUEST;
  }
  const char *sid = http_hdr(c, "Mcp-Session-Id");
  if (!sid && strcmp(m, "initialize") == 0) {
    *ret_init = true;
    return 0;
  }
  /* A notification changes no protocol state (notifications/cancelled
   * reaches only its owner's calls): one without a session is taken. */
  if (!sid && !id)
    return 0;
  if (!sid) {
    *ret = http_reply_error(c, MHD_HTTP_BAD_REQUEST, id, RPC_INVALID_REQUEST,
                       "missing Mcp-Session-Id header: send initialize first and then the "
                       "Mcp-Session-Id it returned with every request (or send 2026-07-28 "
                       "requests, which need no session)");
    return MHD_HTTP_BAD_REQUEST;
  }
  if (!http_legacy_touch(sid, owner)) {
    *ret = http_reply_error(c, MHD_HTTP_NOT_FOUND, id, RPC_INVALID_REQUEST,
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
  struct post_out *p = http_post_new(c);
  if (!p)
    return MHD_NO;
  json_t *msg = mcp_parse(&p->out, q->body ? q->body : "", q->len);
  free(steal_ptr(q->body)); /* not kept while the call runs */
  if (!msg) {
    enum MHD_Result r = http_reply_post(c, p, MHD_HTTP_BAD_REQUEST, NULL, NULL);
    http_post_release(&p->out);
    return r;
  }
  if (json_is_array(msg)) {
    json_decref(msg);
    http_post_release(&p->out);
    return http_reply_error(c, MHD_HTTP_BAD_REQUEST, NULL, RPC_INVALID_REQUEST,
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
        ret = http_reply_error_data(c, MHD_HTTP_BAD_REQUEST, id, code, why, data, NULL, NULL);
        goto done;
      }
      free(steal_ptr(why));
      why = http_modern_mismatch(c, m, params);
      if (why) {
        log_info("refused a %.100s request: %s", m, why);
        ret = http_reply_error(c, MHD_HTTP_BAD_REQUEST, id, RPC_HEADER_MISMATCH, why);
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
  const char *scope = modern || !msg ? NULL : http_hdr(c, "Mcp-Session-Id");
  const struct mcp_req r = {.out = &p->out, .bytes = q->received, .owner = q->owner,
                            .cancel_scope = scope};
  mcp_handle_message(&r, msg);

  char sid[33] = "";
  if (init) {
    pthread_mutex_lock(&p->lock);
    bool ok = p->done && p->error_code == 0;
    pthread_mutex_unlock(&p->lock);
    int e = ok ? http_legacy_new(q->owner, sid) : 0;
    if (e < 0) {
      log_error("cannot make a legacy MCP session id: %s", strerror(-e));
      ret = http_reply_error(c, MHD_HTTP_INTERNAL_SERVER_ERROR, id, RPC_INTERNAL_ERROR,
                        "cannot make a session id (no random bytes); try again");
      goto done;
    }
    if (ok)
      log_info("legacy MCP session started%s%s", *q->owner ? " for token " : "", q->owner);
  }
  if (p->sse) {
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 64 * 1024, http_sse_read, p, http_sse_free);
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
    return http_queue(c, MHD_HTTP_OK, resp); /* our reference went to the response */
  }
  if (!http_post_wait(p)) {
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
              ? http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, id, RPC_INTERNAL_ERROR,
                            "the server is shutting down")
              : http_reply_text(c, id ? MHD_HTTP_NO_CONTENT : MHD_HTTP_ACCEPTED, NULL, 0, NULL, NULL);
  else
    ret = http_reply_post(c, p, http_status_of(code, modern), sid[0] ? "Mcp-Session-Id" : NULL, sid);
done:
  json_decref(msg);
  http_post_release(&p->out);
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
  http_legacy_free_all();
  if (srv.tokens)
    tokens_free(srv.tokens);
  return 0;
}
