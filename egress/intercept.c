/* intercept.c: a connection to a host of one of the session's secrets,
 * taken by the broker instead of relayed whole (docs/credentials.md).
 *
 * The broker decided the stream as any other (policy, address, peek) and
 * would connect it; instead it hands one end of a socketpair to a thread
 * of its own here, with the address it checked.  The thread speaks TLS
 * with the sandbox (a certificate for the host from ca.c; the sandbox
 * trusts that CA) when the sandbox spoke TLS, reads one HTTP/1.1 request,
 * checks it, replaces each placeholder by its secret's value where the
 * secret may go (header values, Basic credentials, the query), connects to
 * the real server (TLS verified against the host's trust store), sends the
 * request with "Connection: close", relays the response (also marked
 * "Connection: close"), and ends: one request per connection, so every
 * request is parsed here and none rides a kept-alive connection unseen.
 * Where the sandbox or the server chose HTTP/2 (ALPN), a gateway of
 * intercept_h2.c stands between that TLS end and serve(), which sees one
 * HTTP/1.1 request and its response all the same.
 *
 * Refused, and recorded, without reaching the server: a request that is
 * not strict HTTP/1.1 (fail closed: obs-fold, bare CR or LF, both
 * Content-Length and Transfer-Encoding, ...), another Host (421), and a
 * placeholder of a secret that may not go to this host, anywhere in the
 * request, the body included (403, or the connection reset mid-body).
 * Every request gets a {"kind":"request"} line in the session's log:
 * method, host, path (no query), status, bytes each way, the secrets used.
 * No value is ever written anywhere but into the request to the server.
 *
 * Blocking I/O with timeouts on a thread per connection: at most
 * IGN_MCP_EGRESS_STREAMS per session, and the broker's own loop never
 * waits for a handshake. */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "common/config.h"
#include "common/util.h"
#include "egress/intercept_int.h"
#include "egress/stream_int.h"

/* Threads of interception (an intercepted connection: 1, 2 or 3 with
 * HTTP/2 gateways): a session may have PER_STREAM for each connection it
 * may hold open, and the server room for every session to have as many
 * (so one session cannot use up another's), within these bounds. */
#define PER_STREAM 3u
#define THREADS_MIN 512u
#define THREADS_MAX 16384u

static struct {
  pthread_mutex_t lock;
  pthread_cond_t gone;
  unsigned running;
} I = {.lock = PTHREAD_MUTEX_INITIALIZER, .gone = PTHREAD_COND_INITIALIZER};

/* A session's count of interception threads: its egress and each of its
 * threads hold a reference (a thread may outlive the session). */
struct ic_share {
  unsigned refs, threads;      /* under I.lock */
};

static unsigned server_cap(void) {
  uint64_t n = (uint64_t)PER_STREAM * egress_cfg.max_streams * cfg.max_sessions;
  return n < THREADS_MIN ? THREADS_MIN : n > THREADS_MAX ? THREADS_MAX : (unsigned)n;
}

void intercept_share_unref(struct ic_share *sh) {
  if (!sh)
    return;
  pthread_mutex_lock(&I.lock);
  bool last = --sh->refs == 0;
  pthread_mutex_unlock(&I.lock);
  if (last)
    free(sh);
}

/* ---- answers and the record ---- */

static void answer(struct ictx *c, int code, const char *phrase, const char *body) {
  char buf[512];
  int n = snprintf(buf, sizeof buf,
                   "HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %zu\r\n"
                   "Connection: close\r\n\r\n%s\n",
                   code, phrase, strlen(body) + 1, body);
  if (n > 0 && ic_end_write(&c->in, buf, (size_t)n) == 0)
    c->bytes_down += (uint64_t)n;
  c->status = code;
}

static void refuse(struct ictx *c, int code, const char *why) {
  if (!c->why) {
    snprintf(c->why_buf, sizeof c->why_buf, "%s", why);
    c->why = c->why_buf;
  }
  char body[256];
  snprintf(body, sizeof body, "ignition-mcp egress: %s", c->why);
  answer(c, code, ic_reason(code), body);
}

static void clean_path(struct ictx *c, const char *target) {
  size_t n = 0;
  for (const char *p = target; *p && *p != '?' && *p != '#' && *p != ' ' && n < sizeof c->path - 1; p++)
    c->path[n++] = (*p > 0x20 && *p < 0x7f && *p != '"' && *p != '\\') ? *p : '?';
  c->path[n] = 0;
}

static void record_request(struct ictx *c) {
  if (!c->log)
    return;
  json_t *secrets = json_array();
  for (size_t i = 0; i < c->n_bind; i++)
    if (c->used[i])
      json_array_append_new(secrets, json_string(c->bind[i].s->name));
  json_t *o = json_pack("{s:s, s:s, s:i, s:s, s:s, s:i, s:I, s:I, s:o, s:b}", "kind", "request",
                        "host", c->host, "port", c->port, "method", c->method, "path", c->path,
                        "status", c->status, "bytes_up", (json_int_t)c->bytes_up, "bytes_down",
                        (json_int_t)c->bytes_down, "secrets", secrets, "allowed", c->why == NULL);
  if (o && c->why)
    json_object_set_new(o, "reason", json_string(c->why));
  if (o)
    record_log_line(c->log, o);
  json_decref(o);
}

/* ---- the connection ---- */

/* The protocol ALPN chose on E is HTTP/2. */
static bool alpn_h2(const struct end *e) {
  const unsigned char *p;
  unsigned n;
  SSL_get0_alpn_selected(e->ssl, &p, &n);
  return n == 2 && memcmp(p, "h2", 2) == 0;
}

static int connect_up(struct ictx *c) {
  struct sockaddr_storage ss = {0};
  socklen_t sl;
  if (c->family == AF_INET) {
    struct sockaddr_in *in = (struct sockaddr_in *)&ss;
    in->sin_family = AF_INET;
    in->sin_port = htons(c->port);
    memcpy(&in->sin_addr, c->addr, 4);
    sl = sizeof *in;
  } else {
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&ss;
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(c->port);
    memcpy(&in6->sin6_addr, c->addr, 16);
    sl = sizeof *in6;
  }
  int fd = socket(c->family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP);
  if (fd < 0)
    return -errno;
  if (connect(fd, (struct sockaddr *)&ss, sl) < 0) {
    if (errno != EINPROGRESS) {
      int e = errno;
      close(fd);
      return -e;
    }
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int err = 0;
    socklen_t el = sizeof err;
    if (poll(&p, 1, EGRESS_CONNECT_MS) != 1 ||
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) < 0 || err) {
      close(fd);
      return err ? -err : -ETIMEDOUT;
    }
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  struct timeval tv = {.tv_sec = EGRESS_IDLE_MS / 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  c->up.fd = fd;
  if (!c->tls)
    return 0;
  c->up.ssl = SSL_new(ca_client_ctx());
  if (!c->up.ssl || !SSL_set_fd(c->up.ssl, fd) || !SSL_set_tlsext_host_name(c->up.ssl, c->host) ||
      !SSL_set1_host(c->up.ssl, c->host))
    return -ENOMEM;
  if (SSL_connect(c->up.ssl) != 1) {
    long v = SSL_get_verify_result(c->up.ssl);
    ERR_clear_error();
    if (v != X509_V_OK) {
      snprintf(c->why_buf, sizeof c->why_buf, "upstream certificate not trusted: %s",
               X509_verify_cert_error_string(v));
      c->why = c->why_buf;
      return -EPERM;
    }
    return -EPROTO;
  }
  /* The server chose HTTP/2: serve() speaks HTTP/1.1 to a gateway. */
  int hr = alpn_h2(&c->up) ? ic_h2_take(&c->up, false, c->share) : 0;
  if (hr < 0) {
    c->why = hr == -EAGAIN ? "too many intercepted connections"
                           : "cannot speak HTTP/2 with the server";
    return hr;
  }
  return 0;
}

/* The request head H (its text HT), checked and rewritten into OUT
 * (malloc'd): 0, or an HTTP status to answer with (c->why says why). */
static int rewrite_request(struct ictx *c, struct head *h, char **out, size_t *out_len,
                           bool *expect) {
  char *sp1 = strchr(h->line, ' '), *sp2 = sp1 ? strchr(sp1 + 1, ' ') : NULL;
  if (!sp1 || !sp2 || strchr(sp2 + 1, ' ') || (strcmp(sp2 + 1, "HTTP/1.1") != 0 &&
                                                strcmp(sp2 + 1, "HTTP/1.0") != 0)) {
    c->why = "malformed HTTP request";
    return 400;
  }
  *sp1 = *sp2 = 0;
  const char *method = h->line, *target = sp1 + 1; /* in the record already (serve) */
  for (const char *q = method; *q; q++)
    if (!ic_tchar(*q) || q - method > 24) {
      c->why = "malformed HTTP request";
      return 400;
    }
  if (target[0] != '/') {
    c->why = strcmp(method, "CONNECT") == 0 ? "CONNECT on an intercepted host"
                                            : "request target not in origin form";
    return strcmp(method, "CONNECT") == 0 ? 403 : 400;
  }
  size_t n_host;
  const char *host = ic_field(h, "host", &n_host);
  char want[EGRESS_NAME_BUF + 8];
  snprintf(want, sizeof want, "%s:%u", c->host, c->port);
  if (n_host != 1 || (strcasecmp(host, c->host) != 0 && strcasecmp(host, want) != 0)) {
    c->why = n_host == 1 ? "Host mismatch" : "HTTP request without one Host";
    return n_host == 1 ? 421 : 400;
  }
  /* The request rules of its host, if it has them. */
  if (c->n_rules) {
    const char *why = egress_request_refusal(c->rules, c->n_rules, method, target);
    if (why) {
      snprintf(c->why_buf, sizeof c->why_buf, "%s", why);
      c->why = c->why_buf;
      return 403;
    }
  }
  /* Placeholders: the target first (replaced in the query only). */
  if (!ic_tokens_ok(c, target, strlen(target), "the request target"))
    return 403;
  const char *q = strchr(target, '?');
  size_t path_len = q ? (size_t)(q - target) : strlen(target), ql = 0;
  _cleanup_free_ char *query = q ? ic_replace(c, q, strlen(q), true, &ql) : NULL;
  if (q && !query) {
    c->why = "out of memory";
    return 500;
  }
  size_t cap = HEAD_MAX * 2 + 256, n = 0;
  char *o = malloc(cap);
  if (!o) {
    c->why = "out of memory";
    return 500;
  }
#define PUT(p, len)                                                                               \
  do {                                                                                            \
    size_t l_ = (len);                                                                            \
    if (n + l_ + 64 > cap) {                                                                      \
      free(o);                                                                                    \
      c->why = "request head too large";                                                          \
      return 431;                                                                                 \
    }                                                                                             \
    memcpy(o + n, (p), l_);                                                                       \
    n += l_;                                                                                      \
  } while (0)
  PUT(method, strlen(method));
  PUT(" ", 1);
  PUT(target, path_len);
  if (query)
    PUT(query, ql);
  PUT(" HTTP/1.1\r\n", 11);
  *expect = false;
  for (size_t i = 0; i < h->n; i++) {
    const char *name = h->h[i].name, *v = h->h[i].value;
    if (strcasecmp(name, "connection") == 0 || strcasecmp(name, "keep-alive") == 0 ||
        strcasecmp(name, "proxy-connection") == 0 || strcasecmp(name, "upgrade") == 0 ||
        strcasecmp(name, "te") == 0)
      continue;
    if (strcasecmp(name, "expect") == 0) {
      *expect = strcasecmp(v, "100-continue") == 0;
      continue;
    }
    /* A compressed response would hide a value from the masking. */
    if (c->n_masks && strcasecmp(name, "accept-encoding") == 0)
      continue;
    if (!ic_tokens_ok(c, v, strlen(v), name)) {
      free(o);
      return 403;
    }
    size_t vl;
    bool basic = strncasecmp(v, "Basic ", 6) == 0 && (strcasecmp(name, "authorization") == 0 ||
                                                      strcasecmp(name, "proxy-authorization") == 0);
    char *nv = basic ? ic_replace_basic(c, v + 6) : ic_replace(c, v, strlen(v), false, &vl);
    if (!nv) {
      free(o);
      if (!c->why)
        c->why = "malformed Authorization";
      return c->why[0] == 's' ? 403 : 400;
    }
    PUT(name, strlen(name));
    PUT(": ", 2);
    size_t nl = strlen(nv);
    if (n + nl + 64 > cap) {
      explicit_bzero(nv, nl);
      free(nv);
      free(o);
      c->why = "request head too large";
      return 431;
    }
    PUT(nv, nl);
    explicit_bzero(nv, nl);
    free(nv);
    PUT("\r\n", 2);
  }
  if (c->n_masks)
    PUT("Accept-Encoding: identity\r\n", 27);
  PUT("Connection: close\r\n\r\n", 21);
#undef PUT
  *out = o;
  *out_len = n;
  return 0;
}

static int write_head(struct ictx *c, const struct head *h, size_t hl, bool final);

/* The broker closed its end (the stream was ended): bytes it had passed
 * on may still be queued, but none of them is to go anywhere. */
static bool peer_gone(const struct ictx *c) {
  struct pollfd p = {.fd = c->watch_fd >= 0 ? c->watch_fd : c->in.fd, .events = POLLRDHUP};
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

static void serve(struct ictx *c) {
  char *head = malloc(HEAD_MAX + 1);
  if (!head)
    return;
  size_t hl;
  struct head h;
  int r = ic_read_head(&c->in, head, &hl);
  if (r == -EPIPE) {
    free(head);
    return; /* closed without a request: nothing to record */
  }
  snprintf(c->method, sizeof c->method, "-");
  if (r == -EMSGSIZE) {
    refuse(c, 431, "request head too large");
    goto out;
  }
  if (r < 0 || !ic_parse_head(head, hl, &h)) {
    refuse(c, 400, "malformed HTTP request");
    goto out;
  }
  /* For the record: the method and the path, as the line says them. */
  {
    size_t ml = strcspn(h.line, " ");
    snprintf(c->method, sizeof c->method, "%.*s", (int)(ml < 24 ? ml : 24), h.line);
    for (char *q = c->method; *q; q++)
      if (!ic_tchar(*q))
        *q = '?'; /* the record is JSON: UTF-8 only */
    if (h.line[ml] == ' ')
      clean_path(c, h.line + ml + 1);
    char *sp = strchr(c->path, ' ');
    if (sp)
      *sp = 0;
  }
  /* Anywhere in the head (names, values, the target; its lines now end
   * in NULs), in any case or percent-encoded: another secret's
   * placeholder never goes up. */
  if (!ic_tokens_ok(c, head, hl, "the request head")) {
    explicit_bzero(head, hl);
    refuse(c, 403, c->why);
    goto out;
  }
  char *req = NULL;
  size_t req_len = 0;
  bool expect = false;
  int code = rewrite_request(c, &h, &req, &req_len, &expect);
  enum frame f = F_NONE;
  uint64_t len = 0;
  if (!code && !ic_framing(&h, true, &f, &len)) {
    c->why = "ambiguous request body framing";
    code = 400;
  }
  if (code) {
    explicit_bzero(head, hl);
    free(req);
    refuse(c, code, c->why ? c->why : "refused");
    goto out;
  }
  if (peer_gone(c)) { /* the stream was ended (a policy change): nothing goes up */
    explicit_bzero(req, req_len);
    free(req);
    c->why = "the connection was ended before its request went up";
    goto out;
  }
  int cr = connect_up(c);
  if (cr < 0) {
    explicit_bzero(req, req_len);
    free(req);
    if (!c->why) {
      snprintf(c->why_buf, sizeof c->why_buf, "connect failed: %s", strerror(-cr));
      c->why = c->why_buf;
    }
    refuse(c, 502, c->why);
    goto out;
  }
  int w = ic_end_write(&c->up, req, req_len);
  c->bytes_up += req_len;
  explicit_bzero(req, req_len);
  free(req);
  if (w < 0) {
    c->why = "the server closed the connection";
    goto out;
  }
  if (expect) {
    static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
    ic_end_write(&c->in, cont, sizeof cont - 1);
  }
  bool head_req = strcmp(c->method, "HEAD") == 0;
  if (ic_relay_body(c, &c->in, &c->up, f, len, true, &c->bytes_up) < 0) {
    /* A placeholder where it may not go, or a body that is not what its
     * framing says: the server never gets the rest. */
    if (!c->why)
      c->why = "malformed request body";
    goto out;
  }
  /* The response: interim ones (1xx) first, then the final one. */
  for (int interim = 0;; interim++) {
    r = ic_read_head(&c->up, head, &hl);
    if (r < 0 || !ic_parse_head(head, hl, &h) || strncmp(h.line, "HTTP/1.", 7) != 0 ||
        strlen(h.line) < 12 || h.line[8] != ' ' || !isdigit((unsigned char)h.line[9]) ||
        !isdigit((unsigned char)h.line[10]) || !isdigit((unsigned char)h.line[11]) ||
        (h.line[12] && h.line[12] != ' ') || h.line[9] < '1' || h.line[9] > '5' || interim > 8) {
      refuse(c, 502, "malformed response from the server");
      goto out;
    }
    c->status = atoi(h.line + 9);
    if (c->status >= 200 || c->status == 101)
      break;
    if (write_head(c, &h, hl, false) < 0)
      goto out;
  }
  if (c->status == 101) {
    refuse(c, 502, "protocol upgrade on an intercepted host");
    goto out;
  }
  if (!ic_framing(&h, false, &f, &len)) {
    refuse(c, 502, "ambiguous response body framing");
    goto out;
  }
  if (head_req || c->status == 204 || c->status == 304)
    f = F_NONE;
  /* The head again, with "Connection: close": the sandbox opens a new
   * connection for its next request. */
  bool masking = c->n_masks > 0 && f != F_NONE;
  if (write_head(c, &h, hl, true) < 0)
    goto out;
  if (masking)
    ic_relay_masked(c, &c->up, &c->in, f, len, &c->bytes_down);
  else
    ic_relay_body(c, &c->up, &c->in, f, len, false, &c->bytes_down);
out:
  free(head);
  record_request(c);
}

/* A response head H (HL bytes as read) to the sandbox, masked; the final
 * one (FINAL) says "Connection: close".  0 or -1. */
static int write_head(struct ictx *c, const struct head *h, size_t hl, bool final) {
  (void)hl;
  size_t size = strlen(h->line) + 2 + 24;
  for (size_t i = 0; i < h->n; i++)
    size += strlen(h->h[i].name) + strlen(h->h[i].value) + 4;
  char *o = malloc(size + 1);
  size_t n = 0;
  if (!o)
    return -1;
  n += (size_t)sprintf(o, "%s\r\n", h->line);
  for (size_t i = 0; i < h->n; i++) {
    if (final && (strcasecmp(h->h[i].name, "connection") == 0 ||
                  strcasecmp(h->h[i].name, "keep-alive") == 0))
      continue;
    n += (size_t)sprintf(o + n, "%s: %s\r\n", h->h[i].name, h->h[i].value);
  }
  n += (size_t)sprintf(o + n, final ? "Connection: close\r\n\r\n" : "\r\n");
  ic_mask_values(c, o, n);
  int wr = ic_end_write(&c->in, o, n);
  free(o);
  if (wr == 0)
    c->bytes_down += n;
  return wr;
}

/* C and what it holds: its log reference, its masks (zeroed), its copies. */
static void ictx_free(struct ictx *c) {
  record_log_unref(c->log);
  for (size_t i = 0; i < c->n_masks; i++) {
    explicit_bzero(c->masks[i].s, c->masks[i].n);
    free(c->masks[i].s);
  }
  free(c->bind);
  free(c->rules);
  free(c);
}

static void count_down(struct ic_share *sh);

int ic_spawn(void *(*fn)(void *), void *arg, struct ic_share *sh) {
  unsigned per = PER_STREAM * egress_cfg.max_streams;
  pthread_mutex_lock(&I.lock);
  bool room = I.running < server_cap() && sh->threads < (per ? per : PER_STREAM);
  if (room) {
    I.running++;
    sh->threads++;
    sh->refs++;
  }
  pthread_mutex_unlock(&I.lock);
  if (!room)
    return -EAGAIN;
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&a, 256u << 10);
  pthread_t t;
  int r = -pthread_create(&t, &a, fn, arg);
  pthread_attr_destroy(&a);
  if (r < 0)
    count_down(sh);
  return r;
}

static void count_down(struct ic_share *sh) {
  pthread_mutex_lock(&I.lock);
  sh->threads--;
  bool last = --sh->refs == 0;
  if (--I.running == 0)
    pthread_cond_broadcast(&I.gone);
  pthread_mutex_unlock(&I.lock);
  if (last)
    free(sh);
}

void ic_thread_end(struct ic_share *sh) {
  OPENSSL_thread_stop();
  count_down(sh);
}

/* C ends before any request was read (WHY): its one line in the record. */
static bool ended_early(struct ictx *c, const char *why) {
  snprintf(c->method, sizeof c->method, "-");
  c->why = why;
  record_request(c);
  return false;
}

static void *icpt_main(void *arg) {
  struct ictx *c = arg;
  struct timeval tv = {.tv_sec = HANDSHAKE_MS / 1000};
  setsockopt(c->in.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(c->in.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  bool go = true;
  if (c->tls) {
    c->in.ssl = ca_server_ssl(ca_server_ctx(), c->host);
    if (!c->in.ssl || !SSL_set_fd(c->in.ssl, c->in.fd) || SSL_accept(c->in.ssl) != 1) {
      ERR_clear_error();
      go = ended_early(c, "TLS with the program failed: it may pin its server's certificate or "
                          "carry its own trust store");
    } else {
      const char *sni = SSL_get_servername(c->in.ssl, TLSEXT_NAMETYPE_host_name);
      if (!sni || strcasecmp(sni, c->host) != 0) {
        go = ended_early(c, "SNI mismatch");
      } else if (alpn_h2(&c->in)) {
        /* HTTP/2: a gateway takes the TLS end and gives serve() the
         * request as HTTP/1.1; the broker's end is watched still. */
        c->watch_fd = fcntl(c->in.fd, F_DUPFD_CLOEXEC, 0);
        int hr = c->watch_fd < 0 ? -errno : ic_h2_take(&c->in, true, c->share);
        if (hr < 0)
          go = ended_early(c, hr == -EAGAIN ? "too many intercepted connections"
                                            : "cannot speak HTTP/2 with the program");
      }
    }
  }
  if (go) {
    tv.tv_sec = EGRESS_IDLE_MS / 1000;
    setsockopt(c->in.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(c->in.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    serve(c);
  }
  for (struct end *e = &c->in; e; e = e == &c->in ? &c->up : NULL) {
    if (e->ssl) {
      SSL_shutdown(e->ssl);
      SSL_free(e->ssl);
    }
    if (e->fd >= 0 && e == &c->in && c->watch_fd < 0 && go)
      ic_close_gently(e->fd); /* a body refused early, unread, must not reset the answer */
    else if (e->fd >= 0)
      close(e->fd);
  }
  if (c->watch_fd >= 0)
    close(c->watch_fd);
  ERR_clear_error();
  struct ic_share *sh = c->share;
  ictx_free(c);
  ic_thread_end(sh);
  return NULL;
}

int intercept_start(struct stream *s, int family, const uint8_t *addr, bool tls, int *ret_fd) {
  struct egress *e = s->lk->e;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
    return -errno;
  /* The copy of the session's placeholders of this moment, with which of
   * them may go to this host: the table they point into outlives every
   * interceptor (intercept_shutdown). */
  size_t nb = e->n_bind;
  struct ictx *c = calloc(1, sizeof *c + nb * 3);
  if (!c) {
    close(sv[0]);
    close(sv[1]);
    return -ENOMEM;
  }
  c->in.fd = sv[1];
  c->up.fd = c->watch_fd = -1;
  c->family = family;
  memcpy(c->addr, addr, family == AF_INET ? 4 : 16);
  c->port = s->rec.port;
  c->tls = tls;
  snprintf(c->host, sizeof c->host, "%s", s->rec.host);
  c->bind = malloc(nb ? nb * sizeof *c->bind : 1);
  c->for_host = (bool *)(c + 1);
  c->used = c->for_host + nb;
  c->no_tls = c->used + nb;
  if (!c->bind) {
    free(c);
    close(sv[0]);
    close(sv[1]);
    return -ENOMEM;
  }
  c->n_bind = nb;
  if (nb)
    memcpy(c->bind, e->bind, nb * sizeof *c->bind);
  /* Without TLS a value goes only where its secret says it may
   * (cleartext: true): anyone on the path would read it. */
  for (size_t i = 0; i < nb; i++) {
    bool here = secret_for(c->bind[i].s, c->host, strlen(c->host), c->port);
    c->for_host[i] = here && (tls || c->bind[i].s->cleartext);
    c->no_tls[i] = here && !c->for_host[i];
    if (!c->for_host[i])
      continue;
    const struct secret *sec = c->bind[i].s;
    ic_mask_add(c, sec->value, sec->len);
    char pct[3 * SECRET_VALUE_MAX + 1];
    size_t pn = 0;
    for (size_t k = 0; k < sec->len; k++) {
      unsigned char ch = (unsigned char)sec->value[k];
      if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
          strchr("-._~", ch))
        pct[pn++] = (char)ch;
      else
        pn += (size_t)sprintf(pct + pn, "%%%02X", ch);
    }
    if (pn != sec->len)
      ic_mask_add(c, pct, pn);
    explicit_bzero(pct, pn);
  }
  size_t hl = strlen(c->host);
  if (egress_requests_checked(e, c->host, c->port)) {
    c->rules = malloc(e->pol.n * sizeof *c->rules);
    for (size_t i = 0; c->rules && i < e->pol.n; i++)
      if (egress_rule_admits(&e->pol.rules[i], c->host, hl, c->port))
        c->rules[c->n_rules++] = e->pol.rules[i];
    if (!c->rules) {
      ictx_free(c);
      close(sv[0]);
      close(sv[1]);
      return -ENOMEM;
    }
  }
  c->log = record_log_ref(e->rec);
  int fl = fcntl(sv[0], F_GETFL);
  fcntl(sv[0], F_SETFL, fl | O_NONBLOCK);
  if (!e->icpt) {
    e->icpt = calloc(1, sizeof *e->icpt);
    if (!e->icpt) {
      ictx_free(c);
      close(sv[0]);
      close(sv[1]);
      return -ENOMEM;
    }
    e->icpt->refs = 1; /* the egress's (egress_free) */
  }
  c->share = e->icpt;
  int r = ic_spawn(icpt_main, c, c->share);
  if (r < 0) {
    ictx_free(c);
    close(sv[0]);
    close(sv[1]);
    return r;
  }
  *ret_fd = sv[0];
  return 0;
}

void intercept_shutdown(void) {
  struct timespec until = timespec_in(CLOCK_REALTIME, 2000);
  pthread_mutex_lock(&I.lock);
  while (I.running)
    if (pthread_cond_timedwait(&I.gone, &I.lock, &until) == ETIMEDOUT)
      break;
  pthread_mutex_unlock(&I.lock);
}

bool intercept_idle(void) {
  pthread_mutex_lock(&I.lock);
  bool idle = I.running == 0;
  pthread_mutex_unlock(&I.lock);
  return idle;
}
