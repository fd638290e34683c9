/* intercept_h2.c: HTTP/2 on an intercepted connection (docs/credentials.md).
 *
 * An intercepted connection is checked in one form: a strict HTTP/1.1
 * request and its response, read by intercept.c.  Where the sandbox or the
 * real server chose HTTP/2 (ALPN "h2"), a gateway thread here speaks it on
 * that TLS end with nghttp2 and HTTP/1.1 on a socketpair toward intercept.c:
 *
 *   sandbox ==h2==> [front gateway] --h1--> intercept.c --h1--> [gateway] ==h2==> server
 *
 * Each gateway carries one request and its response (as intercept.c does
 * with "Connection: close"): the front one announces one stream at a time,
 * refuses (REFUSED_STREAM, which a client retries on a new connection)
 * every stream but the first, and ends with a GOAWAY naming it.  Nothing
 * here looks at a value: every placeholder, rule and mask is applied by
 * intercept.c to the HTTP/1.1 form, which it parses as strictly as one
 * from a socket (nghttp2 has already dropped a field with CR, LF or NUL,
 * and reset a stream with connection-specific fields or bad
 * pseudo-headers).
 *
 * Non-blocking I/O on both sides in one poll loop; a side is read only
 * while what it gave still waits below CAP (back-pressure reaches the peer
 * through TCP and the HTTP/2 windows). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nghttp2/nghttp2.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include "common/util.h"
#include "egress/intercept_int.h"

#define CAP (256u << 10)       /* bytes waiting in one direction */
#define REFUSED_MAX 64u        /* streams refused before the connection goes */
#define WINDOW (1u << 20)      /* what the peer may send on the stream ahead */
#define OUTQ_MAX 64u           /* frames owed to a peer before it is read no more */

struct buf {
  uint8_t *p;
  size_t off, len, cap;        /* the bytes are p[off .. off+len) */
};

struct gw {
  struct ic_share *share;
  bool front;                  /* the HTTP/2 side is the sandbox's */
  int h2fd, h1fd;
  SSL *ssl;
  nghttp2_session *s;
  int32_t sid;                 /* the one stream (0: none yet) */
  unsigned refused;
  struct buf h2out;            /* frames for the HTTP/2 side */
  bool send_full;              /* nghttp2 had more when h2out was full */
  /* HTTP/2 to HTTP/1.1: the message's fields as they come, then its bytes. */
  nghttp2_nv nv[HDR_MAX + 8];
  size_t n_nv, nv_bytes;
  bool head_in;                /* its head went to h1 */
  bool chunked;                /* its body goes chunked */
  bool msg_done;               /* all of it is in h1out */
  struct buf h1out;
  /* HTTP/1.1 to HTTP/2: what came from h1, its head once parsed. */
  struct buf h1in;
  bool h1_eof;
  bool head_out;               /* its head was submitted */
  bool head_req;               /* front: the request was HEAD */
  enum frame f;
  uint64_t left;               /* F_LEN: bytes to come; F_CHUNKED: of this chunk */
  enum { CK_SIZE, CK_DATA, CK_CRLF, CK_TRAILER } ck;
  bool body_done, deferred;
  bool closed;                 /* the stream is closed */
  bool goaway;
  bool h2_eof, fail;
  bool h1_dead;                /* front: intercept.c took no more (its answer is read still) */
  uint64_t moved_ms;           /* when a byte of the exchange last moved */
};

/* ---- buffers ---- */

static int buf_add(struct buf *b, const void *p, size_t n) {
  if (b->off && b->off + b->len + n > b->cap) {
    memmove(b->p, b->p + b->off, b->len);
    b->off = 0;
  }
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 16384;
    while (cap < b->len + n)
      cap *= 2;
    /* Not realloc: the old block may hold values of secrets, and is
     * cleared before it goes. */
    uint8_t *q = malloc(cap);
    if (!q)
      return -1;
    if (b->p) {
      memcpy(q, b->p + b->off, b->len);
      explicit_bzero(b->p, b->cap);
      free(b->p);
      b->off = 0;
    }
    b->p = q;
    b->cap = cap;
  }
  memcpy(b->p + b->off + b->len, p, n);
  b->len += n;
  return 0;
}

static void buf_take(struct buf *b, size_t n) {
  b->off += n;
  b->len -= n;
  if (!b->len)
    b->off = 0;
}

static int buf_printf(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int buf_printf(struct buf *b, const char *fmt, ...) {
  char tmp[64];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  return n < 0 || (size_t)n >= sizeof tmp ? -1 : buf_add(b, tmp, (size_t)n);
}

static void nv_clear(struct gw *g) {
  for (size_t i = 0; i < g->n_nv; i++) {
    free(g->nv[i].name);
    if (g->nv[i].value)
      explicit_bzero(g->nv[i].value, g->nv[i].valuelen);
    free(g->nv[i].value);
  }
  g->n_nv = g->nv_bytes = 0;
}

static const nghttp2_nv *nv_find(const struct gw *g, const char *name) {
  size_t l = strlen(name);
  for (size_t i = 0; i < g->n_nv; i++)
    if (g->nv[i].namelen == l && memcmp(g->nv[i].name, name, l) == 0)
      return &g->nv[i];
  return NULL;
}

/* Connection-specific fields: HTTP/1.1's alone, never carried across. */
static bool hop_field(const char *name) {
  static const char *const hop[] = {"connection", "keep-alive", "proxy-connection",
                                    "transfer-encoding", "upgrade", "te", "host"};
  for (size_t i = 0; i < sizeof hop / sizeof *hop; i++)
    if (strcasecmp(name, hop[i]) == 0)
      return true;
  return false;
}

/* ---- HTTP/2 to HTTP/1.1 ---- */

static int put(struct gw *g, const void *p, size_t n) {
  if (g->h1_dead)
    return 0;
  if (buf_add(&g->h1out, p, n) < 0) {
    g->fail = true;
    return -1;
  }
  return 0;
}

static int put_s(struct gw *g, const char *s) {
  return put(g, s, strlen(s));
}

static int put_nv(struct gw *g, const nghttp2_nv *v) {
  return put(g, v->name, v->namelen) || put(g, ": ", 2) || put(g, v->value, v->valuelen) ||
         put(g, "\r\n", 2);
}

/* The request that came on the stream, as an HTTP/1.1 head (front): its
 * :authority as Host (a different "host" field too, which intercept.c
 * refuses as two), cookie crumbs joined, the body chunked when it has no
 * length.  END: it has no body. */
static int request_head(struct gw *g, bool end) {
  const nghttp2_nv *m = nv_find(g, ":method"), *p = nv_find(g, ":path"),
                   *a = nv_find(g, ":authority"), *h = nv_find(g, "host");
  if (!m)
    return -1;
  bool connect = m->valuelen == 7 && memcmp(m->value, "CONNECT", 7) == 0;
  g->head_req = m->valuelen == 4 && memcmp(m->value, "HEAD", 4) == 0;
  if (put(g, m->value, m->valuelen) || put_s(g, " ") ||
      (p ? put(g, p->value, p->valuelen) : connect && a ? put(g, a->value, a->valuelen) : -1) ||
      put_s(g, " HTTP/1.1\r\n"))
    return -1;
  if (a && (put_s(g, "Host: ") || put(g, a->value, a->valuelen) || put_s(g, "\r\n")))
    return -1;
  if (h && (!a || h->valuelen != a->valuelen || memcmp(h->value, a->value, h->valuelen) != 0) &&
      put_nv(g, h))
    return -1;
  bool cookie = false, length = false;
  for (size_t i = 0; i < g->n_nv; i++) {
    const nghttp2_nv *v = &g->nv[i];
    if (v->name[0] == ':' || hop_field((char *)v->name) || strcmp((char *)v->name, "cookie") == 0)
      continue;
    length |= strcmp((char *)v->name, "content-length") == 0;
    if (put_nv(g, v))
      return -1;
  }
  /* The crumbs of a cookie, in order, as one field (RFC 9113 §8.2.3). */
  for (size_t i = 0; i < g->n_nv; i++) {
    const nghttp2_nv *v = &g->nv[i];
    if (strcmp((char *)v->name, "cookie") != 0)
      continue;
    if ((cookie ? put_s(g, "; ") : put_s(g, "Cookie: ")) || put(g, v->value, v->valuelen))
      return -1;
    cookie = true;
  }
  if (cookie && put_s(g, "\r\n"))
    return -1;
  g->chunked = !end && !length;
  if (g->chunked && put_s(g, "Transfer-Encoding: chunked\r\n"))
    return -1;
  return put_s(g, "\r\n");
}

static const char *reason(int status) {
  switch (status) {
  case 200: return "OK";
  case 201: return "Created";
  case 204: return "No Content";
  case 206: return "Partial Content";
  case 301: return "Moved Permanently";
  case 302: return "Found";
  case 304: return "Not Modified";
  case 400: return "Bad Request";
  case 401: return "Unauthorized";
  case 403: return "Forbidden";
  case 404: return "Not Found";
  case 429: return "Too Many Requests";
  case 500: return "Internal Server Error";
  case 502: return "Bad Gateway";
  case 503: return "Service Unavailable";
  default: return "Status";
  }
}

/* The response that came on the stream, as an HTTP/1.1 head (from the
 * server): without a length its body goes chunked, so that one cut short
 * is seen as such.  END: it has no body. */
static int response_head(struct gw *g, int status, bool end) {
  if (buf_printf(&g->h1out, "HTTP/1.1 %03d %s\r\n", status, reason(status)) < 0)
    return -1;
  for (size_t i = 0; i < g->n_nv; i++)
    if (g->nv[i].name[0] != ':' && !hop_field((char *)g->nv[i].name) && put_nv(g, &g->nv[i]))
      return -1;
  g->chunked = !end && !nv_find(g, "content-length") && !g->head_req && status != 204 &&
               status != 304;
  if (g->chunked && put_s(g, "Transfer-Encoding: chunked\r\n"))
    return -1;
  return put_s(g, "\r\n");
}

static int on_begin_headers(nghttp2_session *s, const nghttp2_frame *fr, void *ud) {
  struct gw *g = ud;
  if (!g->front || fr->hd.type != NGHTTP2_HEADERS || fr->headers.cat != NGHTTP2_HCAT_REQUEST)
    return 0;
  if (!g->sid) {
    g->sid = fr->hd.stream_id;
    return 0;
  }
  /* One request per connection: the client asks again on a new one. */
  nghttp2_submit_rst_stream(s, NGHTTP2_FLAG_NONE, fr->hd.stream_id, NGHTTP2_REFUSED_STREAM);
  if (++g->refused > REFUSED_MAX)
    nghttp2_session_terminate_session(s, NGHTTP2_ENHANCE_YOUR_CALM);
  return 0;
}

static int on_header(nghttp2_session *s, const nghttp2_frame *fr, const uint8_t *name, size_t nl,
                     const uint8_t *value, size_t vl, uint8_t flags, void *ud) {
  (void)s;
  (void)flags;
  struct gw *g = ud;
  if (fr->hd.stream_id != g->sid || fr->hd.type != NGHTTP2_HEADERS)
    return 0;
  /* Trailers: none goes to a server (intercept.c refuses them in
   * requests); a response's are dropped.  (A response's final HEADERS
   * after an interim one come as NGHTTP2_HCAT_HEADERS too.) */
  if (fr->headers.cat == NGHTTP2_HCAT_HEADERS && (g->front || g->head_in))
    return g->front ? NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE : 0;
  g->nv_bytes += nl + vl + 4;
  if (g->n_nv >= sizeof g->nv / sizeof *g->nv || g->nv_bytes > HEAD_MAX)
    return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE; /* the stream is reset */
  nghttp2_nv *v = &g->nv[g->n_nv];
  v->name = malloc(nl + 1);
  v->value = malloc(vl + 1);
  if (v->name && v->value) {
    memcpy(v->name, name, nl);
    v->name[nl] = 0;
    memcpy(v->value, value, vl);
    v->value[vl] = 0;
  }
  if (!v->name || !v->value) {
    free(v->name);
    free(v->value);
    return NGHTTP2_ERR_CALLBACK_FAILURE;
  }
  v->namelen = nl;
  v->valuelen = vl;
  v->flags = NGHTTP2_NV_FLAG_NONE;
  g->n_nv++;
  return 0;
}

static void message_end(struct gw *g) {
  if (g->chunked && put_s(g, "0\r\n\r\n"))
    return;
  g->msg_done = true;
}

static int on_frame_recv(nghttp2_session *s, const nghttp2_frame *fr, void *ud) {
  (void)s;
  struct gw *g = ud;
  if (!g->sid || fr->hd.stream_id != g->sid)
    return 0;
  bool end = fr->hd.flags & NGHTTP2_FLAG_END_STREAM;
  if (fr->hd.type == NGHTTP2_HEADERS && !g->head_in &&
      (fr->headers.cat != NGHTTP2_HCAT_HEADERS || !g->front)) {
    if (g->front) {
      if (request_head(g, end) < 0)
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    } else {
      const nghttp2_nv *st = nv_find(g, ":status");
      int status = st && st->valuelen == 3 ? atoi((const char *)st->value) : 0;
      if (status >= 100 && status < 200) { /* interim: not carried */
        nv_clear(g);
        return 0;
      }
      if (status < 200 || response_head(g, status, end) < 0)
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    }
    nv_clear(g);
    g->head_in = true;
  }
  if (end && g->head_in && !g->msg_done)
    message_end(g);
  return 0;
}

static int on_data(nghttp2_session *s, uint8_t flags, int32_t id, const uint8_t *p, size_t n,
                   void *ud) {
  (void)s;
  (void)flags;
  struct gw *g = ud;
  if (id != g->sid || !g->head_in || g->msg_done || g->h1_dead)
    return 0;
  g->moved_ms = mono_ms();
  if (g->chunked && buf_printf(&g->h1out, "%zx\r\n", n) < 0)
    return NGHTTP2_ERR_CALLBACK_FAILURE;
  if (put(g, p, n) || (g->chunked && put_s(g, "\r\n")))
    return NGHTTP2_ERR_CALLBACK_FAILURE;
  return 0;
}

static int on_stream_close(nghttp2_session *s, int32_t id, uint32_t code, void *ud) {
  struct gw *g = ud;
  if (id != g->sid)
    return 0;
  g->closed = true;
  (void)code;
  if (!g->msg_done && !(g->front && g->head_out && g->body_done))
    g->fail = true; /* cut short: the other side sees its connection end */
  if (g->front && !g->goaway) {
    nghttp2_submit_goaway(s, NGHTTP2_FLAG_NONE, id, NGHTTP2_NO_ERROR, NULL, 0);
    g->goaway = true;
  }
  return 0;
}

/* nghttp2's frames into h2out, flushed by the loop (so a TLS write that
 * must be retried is retried with the same bytes). */
static ssize_t on_send(nghttp2_session *s, const uint8_t *p, size_t n, int flags, void *ud) {
  (void)s;
  (void)flags;
  struct gw *g = ud;
  if (g->h2out.len >= CAP) {
    g->send_full = true;
    return NGHTTP2_ERR_WOULDBLOCK;
  }
  return buf_add(&g->h2out, p, n) < 0 ? NGHTTP2_ERR_CALLBACK_FAILURE : (ssize_t)n;
}

/* ---- HTTP/1.1 to HTTP/2 ---- */

/* Up to N bytes of the HTTP/1.1 message's body from h1in into P, decoded
 * from its framing; body_done at its end, fail on bad chunking. */
static size_t body_take(struct gw *g, uint8_t *p, size_t n) {
  struct buf *b = &g->h1in;
  size_t got = 0;
  while (!g->body_done && !g->fail && got < n) {
    uint8_t *q = b->p + b->off;
    if (g->f == F_NONE) {
      g->body_done = true;
    } else if (g->f == F_LEN || g->f == F_CLOSE || g->ck == CK_DATA) {
      size_t k = b->len < n - got ? b->len : n - got;
      if (g->f != F_CLOSE && k > g->left)
        k = (size_t)g->left;
      memcpy(p + got, q, k);
      got += k;
      buf_take(b, k);
      if (g->f != F_CLOSE)
        g->left -= k;
      if (g->f == F_LEN && !g->left)
        g->body_done = true;
      else if (g->f == F_CLOSE && g->h1_eof && !b->len)
        g->body_done = true;
      else if (g->f == F_CHUNKED && !g->left)
        g->ck = CK_CRLF;
      else if (!k || !b->len)
        break;
    } else if (g->ck == CK_CRLF) {
      if (b->len < 2)
        break;
      if (q[0] != '\r' || q[1] != '\n')
        g->fail = true;
      buf_take(b, 2);
      g->ck = CK_SIZE;
    } else { /* a size line, or a trailer line */
      uint8_t *nl = memchr(q, '\n', b->len);
      if (!nl) {
        g->fail = b->len > LINE_MAX_;
        break;
      }
      size_t ll = (size_t)(nl - q) + 1;
      if (ll < 2 || q[ll - 2] != '\r') {
        g->fail = true;
        break;
      }
      if (g->ck == CK_TRAILER) {
        g->body_done = ll == 2;
      } else {
        uint64_t v = 0;
        size_t d = 0;
        for (; d < ll - 2 && d < 15; d++) {
          int x = q[d] >= '0' && q[d] <= '9' ? q[d] - '0'
                  : (q[d] | 0x20) >= 'a' && (q[d] | 0x20) <= 'f' ? (q[d] | 0x20) - 'a' + 10 : -1;
          if (x < 0)
            break;
          v = v * 16 + (uint64_t)x;
        }
        if (!d || d != ll - 2) {
          g->fail = true;
          break;
        }
        g->left = v;
        g->ck = v ? CK_DATA : CK_TRAILER;
      }
      buf_take(b, ll);
    }
  }
  if (got)
    g->moved_ms = mono_ms();
  /* The body ended before its framing did (what is left cannot be read on). */
  if (!g->body_done && g->h1_eof && got < n && g->f != F_CLOSE)
    g->fail = true;
  return got;
}

static ssize_t on_body_read(nghttp2_session *s, int32_t id, uint8_t *p, size_t n, uint32_t *flags,
                            nghttp2_data_source *src, void *ud) {
  (void)s;
  (void)id;
  (void)src;
  struct gw *g = ud;
  size_t got = body_take(g, p, n);
  if (g->fail)
    return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  if (g->body_done) {
    *flags |= NGHTTP2_DATA_FLAG_EOF;
    return (ssize_t)got;
  }
  if (!got) {
    g->deferred = true;
    return NGHTTP2_ERR_DEFERRED;
  }
  return (ssize_t)got;
}

static int h1_head_parsed(struct gw *g, char *text, size_t hl);

/* The HTTP/1.1 message's head, once h1in holds it all: submitted as the
 * stream's HEADERS (front: the response; else: the request, which opens
 * the stream).  0: not yet, 1: done, 2: an interim head left out, -1: bad. */
static int h1_head(struct gw *g) {
  struct buf *b = &g->h1in;
  uint8_t *q = b->p + b->off;
  size_t hl = 0;
  for (size_t i = 3; i < b->len; i++)
    if (q[i] == '\n' && q[i - 1] == '\r' && q[i - 2] == '\n' && q[i - 3] == '\r') {
      hl = i + 1;
      break;
    }
  if (!hl)
    return b->len > HEAD_MAX || g->h1_eof ? -1 : 0;
  char *text = strndup((char *)q, hl);
  if (!text)
    return -1;
  int r = h1_head_parsed(g, text, hl);
  explicit_bzero(text, hl);
  free(text);
  return r;
}

static int h1_head_parsed(struct gw *g, char *text, size_t hl) {
  struct buf *b = &g->h1in;
  struct head h;
  if (!ic_parse_head(text, hl, &h))
    return -1;
  buf_take(b, hl);
  int status = 0;
  if (g->front) {
    if ((strncmp(h.line, "HTTP/1.1 ", 9) != 0 && strncmp(h.line, "HTTP/1.0 ", 9) != 0) ||
        strlen(h.line) < 12)
      return -1;
    status = atoi(h.line + 9);
    if (status < 100 || status > 599)
      return -1;
    if (status < 200)
      return 2; /* interim (100 Continue): not carried; the next head is read */
  }
  nghttp2_nv nv[HDR_MAX + 8];
  size_t n = 0;
  char st[12], *method = NULL, *target = NULL;
  if (g->front) {
    snprintf(st, sizeof st, "%03d", status);
    nv[n++] = (nghttp2_nv){(uint8_t *)":status", (uint8_t *)st, 7, 3, NGHTTP2_NV_FLAG_NONE};
  } else {
    method = h.line;
    char *sp = strchr(method, ' ');
    if (!sp)
      return -1;
    *sp = 0;
    target = sp + 1;
    sp = strchr(target, ' ');
    if (!sp)
      return -1;
    *sp = 0;
    g->head_req = strcmp(method, "HEAD") == 0;
    const char *host = ic_field(&h, "host", NULL);
    if (!host)
      return -1;
    nv[n++] = (nghttp2_nv){(uint8_t *)":method", (uint8_t *)method, 7, strlen(method), 0};
    nv[n++] = (nghttp2_nv){(uint8_t *)":scheme", (uint8_t *)"https", 7, 5, 0};
    nv[n++] = (nghttp2_nv){(uint8_t *)":authority", (uint8_t *)host, 10, strlen(host), 0};
    nv[n++] = (nghttp2_nv){(uint8_t *)":path", (uint8_t *)target, 5, strlen(target),
                           NGHTTP2_NV_FLAG_NO_INDEX};
  }
  for (size_t i = 0; i < h.n; i++) {
    if (hop_field(h.h[i].name) || strcasecmp(h.h[i].name, "expect") == 0)
      continue;
    for (char *c = h.h[i].name; *c; c++)
      *c = (char)((*c >= 'A' && *c <= 'Z') ? *c + 32 : *c);
    /* Toward a server, fields carry values of secrets: kept out of the
     * HPACK tables. */
    nv[n++] = (nghttp2_nv){(uint8_t *)h.h[i].name, (uint8_t *)h.h[i].value, strlen(h.h[i].name),
                           strlen(h.h[i].value),
                           g->front ? NGHTTP2_NV_FLAG_NONE : NGHTTP2_NV_FLAG_NO_INDEX};
  }
  uint64_t len = 0;
  if (!ic_framing(&h, !g->front, &g->f, &len))
    return -1;
  g->left = len;
  g->ck = CK_SIZE;
  if (g->front && (g->head_req || status == 204 || status == 304))
    g->f = F_NONE;
  nghttp2_data_provider prd = {.read_callback = on_body_read};
  nghttp2_data_provider *body = g->f == F_NONE ? NULL : &prd;
  if (!body)
    g->body_done = true;
  if (g->front) {
    if (nghttp2_submit_response(g->s, g->sid, nv, n, body) != 0)
      return -1;
  } else {
    int32_t id = nghttp2_submit_request(g->s, NULL, nv, n, body, NULL);
    if (id < 0)
      return -1;
    g->sid = id;
  }
  g->head_out = true;
  return 1;
}

/* ---- the loop ---- */

/* The HTTP/2 side may be read: it is there, what it gives has room, and
 * what it is owed does not pile up (a peer that sends and never reads
 * would grow nghttp2's queue of answers, RST_STREAMs, without end). */
static bool h2_room(const struct gw *g) {
  return !g->h2_eof && !g->fail && g->h1out.len < CAP && g->h2out.len < CAP &&
         nghttp2_session_get_outbound_queue_size(g->s) < OUTQ_MAX;
}

/* TLS reads into nghttp2 while there is something to read and room. */
static void h2_read(struct gw *g) {
  uint8_t b[16384];
  while (h2_room(g)) {
    int r = SSL_read(g->ssl, b, sizeof b);
    if (r <= 0) {
      int e = SSL_get_error(g->ssl, r);
      ERR_clear_error();
      if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE)
        g->h2_eof = true;
      return;
    }
    if (nghttp2_session_mem_recv(g->s, b, (size_t)r) < 0) {
      g->fail = true;
      return;
    }
  }
}

static int h2_flush(struct gw *g) {
  while (g->h2out.len) {
    int w = SSL_write(g->ssl, g->h2out.p + g->h2out.off,
                      (int)(g->h2out.len > INT32_MAX ? INT32_MAX : g->h2out.len));
    if (w <= 0) {
      int e = SSL_get_error(g->ssl, w);
      ERR_clear_error();
      return e == SSL_ERROR_WANT_WRITE || e == SSL_ERROR_WANT_READ ? 0 : -1;
    }
    buf_take(&g->h2out, (size_t)w);
  }
  return 0;
}

static void h1_read(struct gw *g) {
  while (!g->h1_eof && g->h1in.len < CAP) {
    uint8_t b[16384];
    ssize_t r = read(g->h1fd, b, sizeof b);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0 && errno == EAGAIN)
      return;
    if (r <= 0) {
      g->h1_eof = true;
      return;
    }
    g->moved_ms = mono_ms();
    if (buf_add(&g->h1in, b, (size_t)r) < 0) {
      g->fail = true;
      return;
    }
  }
}

static int h1_flush(struct gw *g) {
  while (g->h1out.len && !g->h1_dead) {
    ssize_t w = write(g->h1fd, g->h1out.p + g->h1out.off, g->h1out.len);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0 && errno == EAGAIN)
      return 0;
    if (w < 0) {
      if (!g->front)
        return -1;
      /* intercept.c answered without reading the rest (a refusal): its
       * answer is still read and sent; the rest of the request is
       * dropped. */
      g->h1_dead = true;
      explicit_bzero(g->h1out.p, g->h1out.cap);
      g->h1out.off = g->h1out.len = 0;
      return 0;
    }
    g->moved_ms = mono_ms();
    buf_take(&g->h1out, (size_t)w);
  }
  return 0;
}

/* Until the one exchange is over, either side goes, or EGRESS_IDLE_MS
 * pass with no byte of it moving (frames that carry none, PINGs, do not
 * count). */
static void gw_loop(struct gw *g) {
  g->moved_ms = mono_ms();
  for (;;) {
    h2_read(g);
    h1_read(g);
    if (g->fail)
      return; /* the other side sees its connection end */
    if (g->h2_eof) {
      /* The server may end its connection after the whole response:
       * what is left of it still goes to intercept.c. */
      if (g->front || !g->msg_done)
        return;
      g->h2out.off = g->h2out.len = 0;
    }
    /* intercept.c ended: before the request came (front), or while a
     * server answers it (nothing reads the rest). */
    if (g->h1_eof && (!g->front || !g->head_in))
      return;
    if (!g->head_out && (g->front ? g->head_in : true)) {
      int r;
      while ((r = h1_head(g)) == 2)
        ;
      /* Not one (intercept.c ended without an answer: it cut a body): the
       * peer sees its connection end. */
      if (r < 0 || (r == 0 && g->h1_eof))
        return;
    }
    /* The response is out whole while the request still comes: the
     * stream ends here (RFC 9113 §8.1). */
    if (g->front && g->head_out && !g->closed && !g->msg_done && !g->h2out.len &&
        nghttp2_session_get_stream_local_close(g->s, g->sid) == 1)
      nghttp2_submit_rst_stream(g->s, NGHTTP2_FLAG_NONE, g->sid, NGHTTP2_NO_ERROR);
    if (g->deferred && (g->h1in.len || g->h1_eof)) {
      g->deferred = false;
      nghttp2_session_resume_data(g->s, g->sid);
    }
    /* Frames, until nghttp2 has none or the TLS end takes no more: had
     * h2out been full and then flushed whole, nothing would wake the poll
     * below for what nghttp2 still holds. */
    if (!g->h2_eof) {
      do {
        g->send_full = false;
        if (nghttp2_session_send(g->s) != 0 || h2_flush(g) < 0) {
          if (g->front || !g->msg_done)
            return;
          g->h2_eof = true; /* the server went after its whole response: it still goes on */
          g->h2out.off = g->h2out.len = 0;
        }
      } while (!g->h2_eof && g->send_full && !g->h2out.len);
    }
    if (h1_flush(g) < 0)
      return;
    if (!g->front && (g->closed || (g->h2_eof && g->msg_done)) && !g->h1out.len) {
      shutdown(g->h1fd, SHUT_WR); /* the response ends with the connection */
      return;
    }
    if (g->front && g->closed && g->goaway && !g->h2out.len && !nghttp2_session_want_write(g->s))
      return;
    if (!g->h2_eof && !nghttp2_session_want_read(g->s) && !nghttp2_session_want_write(g->s) &&
        !g->h2out.len && !g->h1out.len)
      return;
    uint64_t now = mono_ms();
    if (now - g->moved_ms >= EGRESS_IDLE_MS)
      return;
    struct pollfd p[2] = {
        {.fd = g->h2fd, .events = (short)((h2_room(g) ? POLLIN : 0) |
                                          (g->h2out.len && !g->h2_eof ? POLLOUT : 0))},
        {.fd = g->h1fd, .events = (short)((!g->h1_eof && g->h1in.len < CAP ? POLLIN : 0) |
                                          (g->h1out.len && !g->h1_dead ? POLLOUT : 0))},
    };
    /* An ended side is not polled: it says POLLHUP each time, and the
     * loop would spin on it.  The HTTP/2 side is, while it is there, even
     * for nothing: its end (the broker's, the server's) is seen at once. */
    if (g->h2_eof)
      p[0].fd = -1;
    if (!p[1].events)
      p[1].fd = -1;
    int r = poll(p, 2, (int)(g->moved_ms + EGRESS_IDLE_MS - now));
    if (r < 0 && errno != EINTR)
      return;
    if (r > 0 && (p[0].revents & (POLLERR | POLLNVAL | POLLHUP))) {
      if (g->front || !g->msg_done)
        return;
      g->h2_eof = true; /* the server went after its whole response: it still goes on */
      g->h2out.off = g->h2out.len = 0;
    }
  }
}

static void *gw_main(void *arg) {
  struct gw *g = arg;
  gw_loop(g);
  nv_clear(g);
  nghttp2_session_del(g->s);
  bool gently = !g->fail && !g->h2_eof;
  if (gently)
    SSL_shutdown(g->ssl);
  SSL_free(g->ssl);
  ERR_clear_error();
  if (gently && g->front)
    ic_close_gently(g->h2fd); /* the client's last frames (its ACKs) read, not reset */
  else
    close(g->h2fd);
  close(g->h1fd);
  /* They held the request, values of secrets put in (toward a server). */
  for (struct buf *b = &g->h2out; b; b = b == &g->h2out ? &g->h1out : b == &g->h1out ? &g->h1in : NULL) {
    if (b->p)
      explicit_bzero(b->p, b->cap);
    free(b->p);
  }
  struct ic_share *sh = g->share;
  free(g);
  ic_thread_end(sh);
  return NULL;
}

int ic_h2_take(struct end *e, bool front, struct ic_share *sh) {
  if (e->len)
    return -EPROTO; /* nothing was read as HTTP yet */
  struct gw *g = calloc(1, sizeof *g);
  int sv[2] = {-1, -1};
  nghttp2_session_callbacks *cb = NULL;
  nghttp2_option *opt = NULL;
  int r = -ENOMEM;
  if (!g || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0 ||
      nghttp2_session_callbacks_new(&cb) != 0 || nghttp2_option_new(&opt) != 0)
    goto fail;
  nghttp2_session_callbacks_set_send_callback(cb, on_send);
  nghttp2_session_callbacks_set_on_begin_headers_callback(cb, on_begin_headers);
  nghttp2_session_callbacks_set_on_header_callback(cb, on_header);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cb, on_frame_recv);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, on_data);
  nghttp2_session_callbacks_set_on_stream_close_callback(cb, on_stream_close);
  /* A peer's flood of SETTINGS or PINGs waiting for their ACKs is cut. */
  nghttp2_option_set_max_outbound_ack(opt, 64);
  nghttp2_option_set_max_settings(opt, 32);
  g->front = front;
  if ((front ? nghttp2_session_server_new2(&g->s, cb, g, opt)
             : nghttp2_session_client_new2(&g->s, cb, g, opt)) != 0)
    goto fail;
  nghttp2_settings_entry set[] = {
      {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, 1},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, WINDOW},
      {NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
  };
  if (nghttp2_submit_settings(g->s, NGHTTP2_FLAG_NONE, front ? set : set + 1, front ? 3 : 2) != 0 ||
      nghttp2_session_set_local_window_size(g->s, NGHTTP2_FLAG_NONE, 0, 4 * WINDOW) != 0)
    goto fail;
  g->h2fd = e->fd;
  g->ssl = e->ssl;
  g->h1fd = sv[0];
  fcntl(g->h2fd, F_SETFL, fcntl(g->h2fd, F_GETFL) | O_NONBLOCK);
  fcntl(g->h1fd, F_SETFL, fcntl(g->h1fd, F_GETFL) | O_NONBLOCK);
  SSL_set_mode(g->ssl, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  g->share = sh;
  r = ic_spawn(gw_main, g, sh);
  if (r < 0) {
    fcntl(g->h2fd, F_SETFL, fcntl(g->h2fd, F_GETFL) & ~O_NONBLOCK);
    goto fail;
  }
  nghttp2_session_callbacks_del(cb);
  nghttp2_option_del(opt);
  e->fd = sv[1];
  e->ssl = NULL;
  struct timeval tv = {.tv_sec = EGRESS_IDLE_MS / 1000};
  setsockopt(e->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(e->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  return 0;
fail:
  if (g)
    nghttp2_session_del(g->s);
  free(g);
  nghttp2_session_callbacks_del(cb);
  nghttp2_option_del(opt);
  if (sv[0] >= 0) {
    close(sv[0]);
    close(sv[1]);
  }
  return r;
}
