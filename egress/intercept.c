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

#include "common/util.h"
#include "egress/egress_int.h"
#include "egress/stream_int.h"

#define HEAD_MAX 65536u       /* a request's or response's head */
#define HDR_MAX 128u          /* header fields in one */
#define LINE_MAX_ 4096u       /* a chunk-size or trailer line */
#define BUF 16384u
#define HANDSHAKE_MS 10000u
#define HEAD_MS 30000u        /* a whole head, however it trickles in */
#define MASKS_MAX 64u
#define THREADS_MAX 512u      /* interceptor threads of the whole server */

struct end {
  int fd;
  SSL *ssl;
  /* What was read past a head. */
  uint8_t buf[BUF];
  size_t off, len;
};

struct ictx {
  struct end in, up;           /* the sandbox's side, the server's */
  int family;
  uint8_t addr[16];
  uint16_t port;
  bool tls;
  char host[EGRESS_NAME_BUF];
  struct jlog *log;
  size_t n_bind;
  struct binding *bind;
  bool *for_host;              /* bind[i]'s value may go to host:port */
  bool *no_tls;                /* ... but for this connection without TLS */
  /* What is masked in responses: each value that may come here, its
   * percent-encoded form, the Basic credentials put in. */
  struct mask {
    char *s;
    size_t n;
  } masks[MASKS_MAX];
  size_t n_masks;
  struct egress_rule *rules;   /* the request rules for host:port (n_rules 0: none) */
  size_t n_rules;
  bool *used;
  /* The record of the request. */
  char method[32];
  char path[257];
  int status;
  uint64_t bytes_up, bytes_down;
  const char *why;             /* the refusal, or NULL */
  char why_buf[160];
};

static struct {
  pthread_mutex_t lock;
  pthread_cond_t gone;
  unsigned running;
} I = {.lock = PTHREAD_MUTEX_INITIALIZER, .gone = PTHREAD_COND_INITIALIZER};

/* ---- I/O ---- */

static ssize_t end_read(struct end *e, void *p, size_t n) {
  if (!e->ssl) {
    ssize_t r;
    do
      r = read(e->fd, p, n);
    while (r < 0 && errno == EINTR);
    return r;
  }
  int r = SSL_read(e->ssl, p, (int)(n > INT32_MAX ? INT32_MAX : n));
  if (r > 0)
    return r;
  int err = SSL_get_error(e->ssl, r);
  ERR_clear_error();
  return err == SSL_ERROR_ZERO_RETURN ? 0 : -1;
}

static int end_write(struct end *e, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n) {
    ssize_t r;
    if (e->ssl) {
      int k = SSL_write(e->ssl, b, (int)(n > BUF ? BUF : n));
      if (k <= 0) {
        ERR_clear_error();
        return -1;
      }
      r = k;
    } else {
      r = write(e->fd, b, n);
      if (r < 0 && errno == EINTR)
        continue;
      if (r <= 0)
        return -1;
    }
    b += r;
    n -= (size_t)r;
  }
  return 0;
}

/* The buffered bytes, or a read into the buffer: how many are there (0:
 * end, -1: error). */
static ssize_t end_fill(struct end *e) {
  if (e->len)
    return (ssize_t)e->len;
  e->off = 0;
  ssize_t r = end_read(e, e->buf, sizeof e->buf);
  e->len = r > 0 ? (size_t)r : 0;
  return r;
}

/* A head (up to the empty line) into OUT (NUL-terminated, *RET_LEN the
 * bytes with the CRLFCRLF): 0, -EMSGSIZE past HEAD_MAX, -EPIPE at an end
 * before any byte, -EIO. */
static int read_head(struct end *e, char *out, size_t *ret_len) {
  size_t n = 0;
  uint64_t until = mono_ms() + HEAD_MS;
  for (;;) {
    if (mono_ms() > until)
      return -ETIMEDOUT; /* a head trickled in: its reads each in time, the whole not */
    ssize_t r = end_fill(e);
    if (r <= 0)
      return n == 0 && r == 0 ? -EPIPE : -EIO;
    size_t take = e->len;
    /* Byte by byte up to the end of the head: what follows stays. */
    for (size_t i = 0; i < take; i++) {
      if (n >= HEAD_MAX)
        return -EMSGSIZE;
      out[n++] = (char)e->buf[e->off + i];
      if (n >= 4 && memcmp(out + n - 4, "\r\n\r\n", 4) == 0) {
        e->off += i + 1;
        e->len -= i + 1;
        out[n] = 0;
        *ret_len = n;
        return 0;
      }
    }
    e->off += take;
    e->len = 0;
  }
}

/* ---- heads ---- */

struct hdr {
  char *name, *value;
};
struct head {
  char *line;
  struct hdr h[HDR_MAX];
  size_t n;
};

static bool tchar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         (c && strchr("!#$%&'*+-.^_`|~", c));
}

/* Splits TEXT (a head read whole) into its line and fields, in place:
 * strict (no bare CR or LF, no obs-fold, no NUL or control bytes in a
 * value, a token for each name).  False: malformed. */
static bool parse_head(char *text, size_t len, struct head *h) {
  h->n = 0;
  if (memchr(text, 0, len))
    return false;
  char *p = text, *end = text + len - 2; /* the final CRLF */
  h->line = NULL;
  while (p < end) {
    char *cr = memchr(p, '\r', (size_t)(end - p));
    if (!cr || cr[1] != '\n')
      return false;
    *cr = 0;
    if (memchr(p, '\n', (size_t)(cr - p)))
      return false;
    if (!h->line) {
      h->line = p;
    } else {
      if (*p == ' ' || *p == '\t' || h->n >= HDR_MAX)
        return false;
      char *colon = strchr(p, ':');
      if (!colon || colon == p)
        return false;
      for (char *q = p; q < colon; q++)
        if (!tchar(*q))
          return false;
      *colon = 0;
      char *v = colon + 1;
      while (*v == ' ' || *v == '\t')
        v++;
      char *ve = v + strlen(v);
      while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
        *--ve = 0;
      for (char *q = v; *q; q++)
        if ((unsigned char)*q < 0x20 && *q != '\t')
          return false;
      h->h[h->n++] = (struct hdr){p, v};
    }
    p = cr + 2;
  }
  return h->line != NULL;
}

static const char *field(const struct head *h, const char *name, size_t *ret_count) {
  const char *v = NULL;
  size_t n = 0;
  for (size_t i = 0; i < h->n; i++)
    if (strcasecmp(h->h[i].name, name) == 0) {
      v = v ? v : h->h[i].value;
      n++;
    }
  if (ret_count)
    *ret_count = n;
  return v;
}

enum frame { F_NONE, F_LEN, F_CHUNKED, F_CLOSE };

/* How the body after head H is framed: false when that is ambiguous
 * (both Content-Length and Transfer-Encoding, two lengths, a coding
 * other than chunked alone). */
static bool framing(const struct head *h, bool request, enum frame *f, uint64_t *len) {
  size_t n_cl, n_te;
  const char *cl = field(h, "content-length", &n_cl), *te = field(h, "transfer-encoding", &n_te);
  if (n_te) {
    if (n_cl || n_te > 1 || strcasecmp(te, "chunked") != 0)
      return false;
    *f = F_CHUNKED;
    return true;
  }
  if (n_cl) {
    if (n_cl > 1 || !*cl || strspn(cl, "0123456789") != strlen(cl) || strlen(cl) > 15)
      return false;
    *len = strtoull(cl, NULL, 10);
    *f = *len ? F_LEN : F_NONE;
    return true;
  }
  *f = request ? F_NONE : F_CLOSE;
  return true;
}

/* ---- placeholders ---- */

/* The placeholders in P (N bytes), compared without case and after
 * percent-decoding: each of a secret that may not go here (another host,
 * or no TLS) refuses (false, c->why set).  The ones that may are replaced
 * by the caller where they stand as such. */
static bool tokens_ok(struct ictx *c, const char *p, size_t n, const char *where) {
  bool any = false;
  for (size_t i = 0; i < c->n_bind; i++)
    any |= !c->for_host[i];
  if (!any || !n)
    return true;
  char *norm = malloc(n);
  if (!norm) {
    c->why = "out of memory";
    return false;
  }
  size_t m = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned char ch = (unsigned char)p[i];
    if (ch == '%' && i + 2 < n && isxdigit((unsigned char)p[i + 1]) &&
        isxdigit((unsigned char)p[i + 2])) {
      char hx[3] = {p[i + 1], p[i + 2], 0};
      ch = (unsigned char)strtoul(hx, NULL, 16);
      i += 2;
    }
    norm[m++] = (char)tolower(ch);
  }
  bool ok = true;
  for (size_t i = 0; ok && i < c->n_bind; i++) {
    if (c->for_host[i] || !memmem(norm, m, c->bind[i].token, SECRET_TOKEN_LEN))
      continue;
    snprintf(c->why_buf, sizeof c->why_buf, "%s (%s, in %s)",
             c->no_tls[i] ? "secret not sent without TLS" : "secret sent to a host it is not for",
             c->bind[i].s->name, where);
    c->why = c->why_buf;
    ok = false;
  }
  free(norm);
  return ok;
}

/* S with each placeholder of a secret for this host replaced by its value
 * (percent-encoded when PCT): malloc'd. */
static char *replace(struct ictx *c, const char *s, size_t len, bool pct, size_t *ret_len) {
  size_t cap = len + 1, n = 0;
  char *out = malloc(cap);
  if (!out)
    return NULL;
  for (size_t i = 0; i < len;) {
    const struct binding *hit = NULL;
    size_t k = 0;
    if (len - i >= SECRET_TOKEN_LEN && s[i] == 'i')
      for (k = 0; k < c->n_bind; k++)
        if (c->for_host[k] && memcmp(s + i, c->bind[k].token, SECRET_TOKEN_LEN) == 0) {
          hit = &c->bind[k];
          break;
        }
    size_t need = hit ? hit->s->len * (pct ? 3 : 1) : 1;
    if (n + need + 1 > cap) {
      cap = (n + need + 1) * 2;
      char *m = realloc(out, cap);
      if (!m) {
        free(out);
        return NULL;
      }
      out = m;
    }
    if (!hit) {
      out[n++] = s[i++];
      continue;
    }
    c->used[k] = true;
    for (size_t j = 0; j < hit->s->len; j++) {
      unsigned char ch = (unsigned char)hit->s->value[j];
      if (!pct || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
          strchr("-._~", ch))
        out[n++] = (char)ch;
      else
        n += (size_t)sprintf(out + n, "%%%02X", ch);
    }
    i += SECRET_TOKEN_LEN;
  }
  out[n] = 0;
  *ret_len = n;
  return out;
}

static void mask_add(struct ictx *c, const char *s, size_t n);

/* Authorization: Basic with a placeholder in its user:password. */
static char *replace_basic(struct ictx *c, const char *b64) {
  size_t len = strlen(b64);
  if (len % 4 || len > 8192)
    return NULL;
  unsigned char *dec = malloc(len / 4 * 3 + 1);
  if (!dec)
    return NULL;
  int n = EVP_DecodeBlock(dec, (const unsigned char *)b64, (int)len);
  if (n < 0) {
    free(dec);
    return NULL;
  }
  while (len && b64[len - 1] == '=' && n > 0) { /* DecodeBlock counts the padding */
    n--;
    len--;
  }
  char *r = NULL;
  size_t rl;
  if (tokens_ok(c, (char *)dec, (size_t)n, "Authorization")) {
    char *plain = replace(c, (char *)dec, (size_t)n, false, &rl);
    if (plain) {
      r = malloc(6 + (rl + 2) / 3 * 4 + 1);
      if (r) {
        memcpy(r, "Basic ", 6);
        EVP_EncodeBlock((unsigned char *)r + 6, (unsigned char *)plain, (int)rl);
        if (strcmp(r + 6, b64) != 0)
          mask_add(c, r + 6, strlen(r + 6)); /* an echo of what went up */
      }
      explicit_bzero(plain, rl);
      free(plain);
    }
  }
  free(dec);
  return r;
}

/* ---- answers and the record ---- */

static void answer(struct ictx *c, int code, const char *phrase, const char *body) {
  char buf[512];
  int n = snprintf(buf, sizeof buf,
                   "HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %zu\r\n"
                   "Connection: close\r\n\r\n%s\n",
                   code, phrase, strlen(body) + 1, body);
  if (n > 0 && end_write(&c->in, buf, (size_t)n) == 0)
    c->bytes_down += (uint64_t)n;
  c->status = code;
}

static void refuse(struct ictx *c, int code, const char *phrase, const char *why) {
  if (!c->why) {
    snprintf(c->why_buf, sizeof c->why_buf, "%s", why);
    c->why = c->why_buf;
  }
  char body[256];
  snprintf(body, sizeof body, "ignition-mcp egress: %s", c->why);
  answer(c, code, phrase, body);
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

/* ---- bodies ---- */

/* Each value of the secrets that may go to this host, in P (N bytes),
 * becomes as many '*': a server that echoes a request (an error page, an
 * echo endpoint) does not hand the value to the sandbox.  The length
 * stays, and Content-Length and chunk sizes with it. */
static void mask_values(const struct ictx *c, char *p, size_t n) {
  for (size_t i = 0; i < c->n_masks; i++) {
    const char *v = c->masks[i].s;
    size_t vl = c->masks[i].n;
    for (char *q = p; n >= vl && (q = memmem(q, n - (size_t)(q - p), v, vl)); q += vl)
      memset(q, '*', vl);
  }
}

static size_t longest_value(const struct ictx *c) {
  size_t m = 0;
  for (size_t i = 0; i < c->n_masks; i++)
    if (c->masks[i].n > m)
      m = c->masks[i].n;
  return m;
}

/* S (N bytes) is masked in responses from now on (a form of a value this
 * connection put in a request). */
static void mask_add(struct ictx *c, const char *s, size_t n) {
  if (!n || c->n_masks >= MASKS_MAX)
    return;
  char *d = malloc(n);
  if (!d)
    return;
  memcpy(d, s, n);
  c->masks[c->n_masks++] = (struct mask){d, n};
}

/* A strict chunk-size line ("1*HEXDIG [; ext]" CRLF) from SRC: the size,
 * or -1. */
static long long chunk_size(struct end *src) {
  char line[LINE_MAX_];
  size_t n = 0;
  for (;;) {
    if (end_fill(src) <= 0 || n >= sizeof line - 1)
      return -1;
    char ch = (char)src->buf[src->off++];
    src->len--;
    line[n++] = ch;
    if (n >= 2 && line[n - 2] == '\r' && ch == '\n')
      break;
    if (ch == '\n' || (n >= 2 && line[n - 2] == '\r'))
      return -1;
  }
  line[n - 2] = 0;
  size_t hex = strspn(line, "0123456789abcdefABCDEF");
  if (hex == 0 || hex > 10 || (line[hex] && line[hex] != ';'))
    return -1;
  line[hex] = 0;
  return strtoll(line, NULL, 16);
}

/* Reads and drops the trailers after a last chunk, up to the empty line:
 * 0 or -1. */
static int skip_trailers(struct end *src) {
  for (int lines = 0; lines < (int)HDR_MAX; lines++) {
    size_t n = 0;
    char prev = 0;
    for (;;) {
      if (end_fill(src) <= 0 || n > LINE_MAX_)
        return -1;
      char ch = (char)src->buf[src->off++];
      src->len--;
      n++;
      if (prev == '\r' && ch == '\n')
        break;
      if (ch == '\n' || prev == '\r')
        return -1;
      prev = ch;
    }
    if (n == 2)
      return 0;
  }
  return -1;
}

/* A response body of LEN bytes (F_LEN), up to the end (F_CLOSE), or
 * chunked (F_CHUNKED: sent on de-chunked, the sandbox reads to the close)
 * from SRC to DST, masked (mask_values) across reads: the last bytes of
 * each read, which may begin a value, wait for the next.  0 or -1. */
static int relay_masked(struct ictx *c, struct end *src, struct end *dst, enum frame f,
                        uint64_t len, uint64_t *bytes) {
  size_t keep = longest_value(c) - 1;
  char *buf = malloc(keep + BUF);
  if (!buf)
    return -1;
  size_t held = 0;
  uint64_t left = f == F_LEN ? len : f == F_CHUNKED ? 0 : UINT64_MAX;
  bool done = false;
  int r = 0;
  for (;;) {
    if (f == F_CHUNKED && left == 0 && !done) {
      long long size = chunk_size(src);
      if (size < 0) {
        r = -1;
        break;
      }
      if (size == 0) {
        done = true;
        if (skip_trailers(src) < 0)
          r = -1;
      }
      left = (uint64_t)size;
    }
    ssize_t got = left && !done ? end_fill(src) : 0;
    if (got < 0 || (got == 0 && f != F_CLOSE && left)) {
      r = -1;
      break;
    }
    size_t take = got > 0 ? (src->len < left ? src->len : (size_t)left) : 0;
    memcpy(buf + held, src->buf + src->off, take);
    src->off += take;
    src->len -= take;
    if (f != F_CLOSE)
      left -= take;
    if (f == F_CHUNKED && take && left == 0) {
      /* The CRLF after a chunk's data. */
      char two[2];
      for (int k = 0; k < 2 && r == 0; k++) {
        if (end_fill(src) <= 0)
          r = -1;
        else {
          two[k] = (char)src->buf[src->off++];
          src->len--;
        }
      }
      if (r < 0 || two[0] != '\r' || two[1] != '\n') {
        r = -1;
        break;
      }
    }
    size_t n = held + take;
    mask_values(c, buf, n);
    bool last = f == F_CHUNKED ? done : (take == 0 || left == 0);
    size_t out = last ? n : (n > keep ? n - keep : 0);
    if (out && end_write(dst, buf, out) < 0) {
      r = -1;
      break;
    }
    *bytes += out;
    memmove(buf, buf + out, n - out);
    held = n - out;
    if (last)
      break;
  }
  explicit_bzero(buf, keep + BUF);
  free(buf);
  return r;
}

/* Relays a body framed F (LEN bytes) from SRC (its buffered bytes first)
 * to DST; SCAN: each piece is checked for placeholders that may not go
 * (a carry of SECRET_TOKEN_LEN - 1 bytes across pieces).  0, or -1 (an
 * end failed, the framing was broken, or a placeholder was found: c->why
 * says which). */
static int relay_body(struct ictx *c, struct end *src, struct end *dst, enum frame f,
                      uint64_t len, bool scan, bool mask, uint64_t *bytes) {
  char carry[2 * SECRET_TOKEN_LEN];
  size_t carry_n = 0;
  char line[LINE_MAX_];
  bool trailers = false, crlf = false;
  uint64_t left = f == F_LEN ? len : 0;
  for (;;) {
    if (f == F_NONE || (f == F_LEN && left == 0))
      return 0;
    if (f == F_CHUNKED && left == 0 && crlf) {
      /* The CRLF that ends a chunk's data, and nothing else. */
      char two[2];
      for (int k = 0; k < 2; k++) {
        if (end_fill(src) <= 0)
          return -1;
        two[k] = (char)src->buf[src->off++];
        src->len--;
      }
      if (two[0] != '\r' || two[1] != '\n' || end_write(dst, two, 2) < 0)
        return -1;
      *bytes += 2;
      crlf = false;
    }
    if (f == F_CHUNKED && left == 0) {
      /* A chunk-size line (or, after the last chunk, trailer lines). */
      size_t n = 0;
      for (;;) {
        if (end_fill(src) <= 0)
          return -1;
        char ch = (char)src->buf[src->off++];
        src->len--;
        if (n >= sizeof line - 1)
          return -1;
        line[n++] = ch;
        if (n >= 2 && line[n - 2] == '\r' && ch == '\n')
          break;
        if (ch == '\n' || (n >= 2 && line[n - 2] == '\r'))
          return -1; /* bare LF or CR */
      }
      line[n - 2] = 0;
      if (scan && !tokens_ok(c, line, n - 2, "a chunk line"))
        return -1;
      if (trailers) {
        /* No trailer fields: nothing after the last chunk but its CRLF. */
        if (n != 2 || end_write(dst, "\r\n", 2) < 0)
          return -1;
        *bytes += 2;
        return 0;
      }
      /* "1*HEXDIG [; ext]" only, sent on as its size alone. */
      size_t hex = strspn(line, "0123456789abcdefABCDEF");
      if (hex == 0 || hex > 10 || (line[hex] && line[hex] != ';'))
        return -1;
      line[hex] = 0;
      unsigned long long size = strtoull(line, NULL, 16);
      char canon[24];
      int cn = snprintf(canon, sizeof canon, "%llx\r\n", size);
      if (end_write(dst, canon, (size_t)cn) < 0)
        return -1;
      *bytes += (uint64_t)cn;
      if (size == 0) {
        trailers = true;
        continue;
      }
      left = size;
      crlf = true; /* after the data */
    }
    if (f == F_CLOSE)
      left = UINT64_MAX;
    ssize_t r = end_fill(src);
    if (r == 0 && f == F_CLOSE)
      return 0;
    if (r <= 0)
      return -1;
    size_t take = src->len < left ? src->len : (size_t)left;
    const char *p = (const char *)src->buf + src->off;
    if (scan) {
      /* The carry and the start of this piece: a placeholder across them. */
      size_t head = take < SECRET_TOKEN_LEN ? take : SECRET_TOKEN_LEN;
      memcpy(carry + carry_n, p, head);
      if (!tokens_ok(c, carry, carry_n + head, "the body") || !tokens_ok(c, p, take, "the body"))
        return -1;
      size_t keep = SECRET_TOKEN_LEN - 1;
      if (take >= keep) {
        memcpy(carry, p + take - keep, keep);
        carry_n = keep;
      } else {
        size_t total = carry_n + take;
        size_t from = total > keep ? total - keep : 0;
        memmove(carry, carry + from, total - from);
        carry_n = total - from;
      }
    }
    if (mask) /* within this read (a value split across reads of a chunk is not seen) */
      mask_values(c, (char *)src->buf + src->off, take);
    if (end_write(dst, p, take) < 0)
      return -1;
    src->off += take;
    src->len -= take;
    *bytes += take;
    if (f != F_CLOSE)
      left -= take;
  }
}

/* ---- the connection ---- */

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
  const char *method = h->line, *target = sp1 + 1;
  snprintf(c->method, sizeof c->method, "%s", method);
  for (const char *q = method; *q; q++)
    if (!tchar(*q) || q - method > 24) {
      c->why = "malformed HTTP request";
      return 400;
    }
  clean_path(c, target);
  if (target[0] != '/') {
    c->why = strcmp(method, "CONNECT") == 0 ? "CONNECT on an intercepted host"
                                            : "request target not in origin form";
    return strcmp(method, "CONNECT") == 0 ? 403 : 400;
  }
  size_t n_host;
  const char *host = field(h, "host", &n_host);
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
  if (!tokens_ok(c, target, strlen(target), "the request target"))
    return 403;
  const char *q = strchr(target, '?');
  size_t path_len = q ? (size_t)(q - target) : strlen(target), ql = 0;
  _cleanup_free_ char *query = q ? replace(c, q, strlen(q), true, &ql) : NULL;
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
    if (!tokens_ok(c, v, strlen(v), name)) {
      free(o);
      return 403;
    }
    size_t vl;
    bool basic = strncasecmp(v, "Basic ", 6) == 0 && (strcasecmp(name, "authorization") == 0 ||
                                                      strcasecmp(name, "proxy-authorization") == 0);
    char *nv = basic ? replace_basic(c, v + 6) : replace(c, v, strlen(v), false, &vl);
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

static int write_head(struct ictx *c, const struct head *h, size_t hl, bool final, bool dechunk);

/* The broker closed its end (the stream was ended): bytes it had passed
 * on may still be queued, but none of them is to go anywhere. */
static bool peer_gone(const struct ictx *c) {
  struct pollfd p = {.fd = c->in.fd, .events = POLLRDHUP};
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

static void serve(struct ictx *c) {
  char *head = malloc(HEAD_MAX + 1);
  if (!head)
    return;
  size_t hl;
  struct head h;
  int r = read_head(&c->in, head, &hl);
  if (r == -EPIPE) {
    free(head);
    return; /* closed without a request: nothing to record */
  }
  snprintf(c->method, sizeof c->method, "-");
  if (r == -EMSGSIZE) {
    refuse(c, 431, "Request Header Fields Too Large", "request head too large");
    goto out;
  }
  if (r < 0 || !parse_head(head, hl, &h)) {
    refuse(c, 400, "Bad Request", "malformed HTTP request");
    goto out;
  }
  /* For the record: the method and the path, as the line says them. */
  {
    size_t ml = strcspn(h.line, " ");
    snprintf(c->method, sizeof c->method, "%.*s", (int)(ml < 24 ? ml : 24), h.line);
    for (char *q = c->method; *q; q++)
      if (!tchar(*q))
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
  if (!tokens_ok(c, head, hl, "the request head")) {
    explicit_bzero(head, hl);
    refuse(c, 403, "Forbidden", c->why);
    goto out;
  }
  char *req = NULL;
  size_t req_len = 0;
  bool expect = false;
  int code = rewrite_request(c, &h, &req, &req_len, &expect);
  enum frame f = F_NONE;
  uint64_t len = 0;
  if (!code && !framing(&h, true, &f, &len)) {
    c->why = "ambiguous request body framing";
    code = 400;
  }
  if (code) {
    explicit_bzero(head, hl);
    free(req);
    refuse(c, code,
           code == 403 ? "Forbidden" : code == 421 ? "Misdirected Request"
           : code == 431 ? "Request Header Fields Too Large" : code == 500 ? "Internal Server Error"
                                                                          : "Bad Request",
           c->why ? c->why : "refused");
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
    refuse(c, 502, "Bad Gateway", c->why);
    goto out;
  }
  int w = end_write(&c->up, req, req_len);
  c->bytes_up += req_len;
  explicit_bzero(req, req_len);
  free(req);
  if (w < 0) {
    c->why = "the server closed the connection";
    goto out;
  }
  if (expect) {
    static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
    end_write(&c->in, cont, sizeof cont - 1);
  }
  bool head_req = strcmp(c->method, "HEAD") == 0;
  if (relay_body(c, &c->in, &c->up, f, len, true, false, &c->bytes_up) < 0) {
    /* A placeholder where it may not go, or a body that is not what its
     * framing says: the server never gets the rest. */
    if (!c->why)
      c->why = "malformed request body";
    goto out;
  }
  /* The response: interim ones (1xx) first, then the final one. */
  for (int interim = 0;; interim++) {
    r = read_head(&c->up, head, &hl);
    if (r < 0 || !parse_head(head, hl, &h) || strncmp(h.line, "HTTP/1.", 7) != 0 ||
        strlen(h.line) < 12 || h.line[8] != ' ' || !isdigit((unsigned char)h.line[9]) ||
        !isdigit((unsigned char)h.line[10]) || !isdigit((unsigned char)h.line[11]) ||
        (h.line[12] && h.line[12] != ' ') || h.line[9] < '1' || h.line[9] > '5' || interim > 8) {
      refuse(c, 502, "Bad Gateway", "malformed response from the server");
      goto out;
    }
    c->status = atoi(h.line + 9);
    if (c->status >= 200 || c->status == 101)
      break;
    if (write_head(c, &h, hl, false, false) < 0)
      goto out;
  }
  if (c->status == 101) {
    refuse(c, 502, "Bad Gateway", "protocol upgrade on an intercepted host");
    goto out;
  }
  if (!framing(&h, false, &f, &len)) {
    refuse(c, 502, "Bad Gateway", "ambiguous response body framing");
    goto out;
  }
  if (head_req || c->status == 204 || c->status == 304)
    f = F_NONE;
  /* The head again, with "Connection: close": the sandbox opens a new
   * connection for its next request. */
  bool masking = c->n_masks > 0 && f != F_NONE;
  if (write_head(c, &h, hl, true, masking && f == F_CHUNKED) < 0)
    goto out;
  if (masking)
    relay_masked(c, &c->up, &c->in, f, len, &c->bytes_down);
  else
    relay_body(c, &c->up, &c->in, f, len, false, false, &c->bytes_down);
out:
  free(head);
  record_request(c);
}

/* A response head H (HL bytes as read) to the sandbox, masked; the final
 * one (FINAL) says "Connection: close".  0 or -1. */
static int write_head(struct ictx *c, const struct head *h, size_t hl, bool final, bool dechunk) {
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
    if (dechunk && (strcasecmp(h->h[i].name, "transfer-encoding") == 0 ||
                    strcasecmp(h->h[i].name, "trailer") == 0))
      continue; /* sent on de-chunked: read to the close */
    n += (size_t)sprintf(o + n, "%s: %s\r\n", h->h[i].name, h->h[i].value);
  }
  n += (size_t)sprintf(o + n, final ? "Connection: close\r\n\r\n" : "\r\n");
  mask_values(c, o, n);
  int wr = end_write(&c->in, o, n);
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
      snprintf(c->method, sizeof c->method, "-");
      c->why = "TLS with the program failed: it may pin its server's certificate or carry "
               "its own trust store";
      record_request(c);
      go = false;
    } else {
      const char *sni = SSL_get_servername(c->in.ssl, TLSEXT_NAMETYPE_host_name);
      if (!sni || strcasecmp(sni, c->host) != 0) {
        snprintf(c->method, sizeof c->method, "-");
        c->why = "SNI mismatch";
        record_request(c);
        go = false;
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
    if (e->fd >= 0)
      close(e->fd);
  }
  ERR_clear_error();
  ictx_free(c);
  OPENSSL_thread_stop();
  pthread_mutex_lock(&I.lock);
  if (--I.running == 0)
    pthread_cond_broadcast(&I.gone);
  pthread_mutex_unlock(&I.lock);
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
  c->up.fd = -1;
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
    mask_add(c, sec->value, sec->len);
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
      mask_add(c, pct, pn);
    explicit_bzero(pct, pn);
  }
  size_t hl = strlen(c->host);
  if (e->mode == EGRESS_MODE_ALLOW && egress_policy_requests_checked(&e->pol, c->host, hl, c->port)) {
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
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&a, 256u << 10);
  pthread_mutex_lock(&I.lock);
  bool room = I.running < THREADS_MAX;
  if (room)
    I.running++;
  pthread_mutex_unlock(&I.lock);
  if (!room) {
    pthread_attr_destroy(&a);
    ictx_free(c);
    close(sv[0]);
    close(sv[1]);
    return -EAGAIN;
  }
  pthread_t t;
  int r = -pthread_create(&t, &a, icpt_main, c);
  pthread_attr_destroy(&a);
  if (r < 0) {
    pthread_mutex_lock(&I.lock);
    I.running--;
    pthread_mutex_unlock(&I.lock);
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
