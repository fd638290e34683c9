/* intercept_h2_msg.c: the messages of an HTTP/2 gateway (intercept_h2.c
 * runs its life): an HTTP/2 request or response, as nghttp2 hands over its
 * fields and DATA, written as HTTP/1.1 for intercept.c, and an HTTP/1.1
 * one from intercept.c submitted as HTTP/2 (its head as HEADERS, its body,
 * decoded from its framing, as DATA).  Buffers that may hold values of
 * secrets are cleared before they go. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/util.h"
#include "egress/intercept_h2_int.h"

/* ---- buffers ---- */

int gw_buf_add(struct buf *b, const void *p, size_t n) {
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

void gw_buf_take(struct buf *b, size_t n) {
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
  return n < 0 || (size_t)n >= sizeof tmp ? -1 : gw_buf_add(b, tmp, (size_t)n);
}

void gw_nv_clear(struct gw *g) {
  for (size_t i = 0; i < g->n_nv; i++) {
    free(g->nv[i].name);
    if (g->nv[i].value)
      explicit_bzero(g->nv[i].value, g->nv[i].valuelen);
    free(g->nv[i].value);
  }
  g->n_nv = g->nv_bytes = 0;
}

const nghttp2_nv *gw_nv_find(const struct gw *g, const char *name) {
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
  if (gw_buf_add(&g->h1out, p, n) < 0) {
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
int gw_request_head(struct gw *g, bool end) {
  const nghttp2_nv *m = gw_nv_find(g, ":method"), *p = gw_nv_find(g, ":path"),
                   *a = gw_nv_find(g, ":authority"), *h = gw_nv_find(g, "host");
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

/* The response that came on the stream, as an HTTP/1.1 head (from the
 * server): without a length its body goes chunked, so that one cut short
 * is seen as such.  END: it has no body. */
int gw_response_head(struct gw *g, int status, bool end) {
  if (buf_printf(&g->h1out, "HTTP/1.1 %03d %s\r\n", status, ic_reason(status)) < 0)
    return -1;
  for (size_t i = 0; i < g->n_nv; i++)
    if (g->nv[i].name[0] != ':' && !hop_field((char *)g->nv[i].name) && put_nv(g, &g->nv[i]))
      return -1;
  g->chunked = !end && !gw_nv_find(g, "content-length") && !g->head_req && status != 204 &&
               status != 304;
  if (g->chunked && put_s(g, "Transfer-Encoding: chunked\r\n"))
    return -1;
  return put_s(g, "\r\n");
}

void gw_message_end(struct gw *g) {
  if (g->chunked && put_s(g, "0\r\n\r\n"))
    return;
  g->msg_done = true;
}

int gw_body_in(struct gw *g, const uint8_t *p, size_t n) {
  if (g->chunked && buf_printf(&g->h1out, "%zx\r\n", n) < 0)
    return -1;
  if (put(g, p, n) || (g->chunked && put_s(g, "\r\n")))
    return -1;
  return 0;
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
      gw_buf_take(b, k);
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
      gw_buf_take(b, 2);
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
      gw_buf_take(b, ll);
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
int gw_h1_head(struct gw *g) {
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
  gw_buf_take(b, hl);
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
