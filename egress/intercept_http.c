/* intercept_http.c: the bytes of an intercepted connection (intercept.c
 * runs its life): reads with timeouts over TLS or not, strict HTTP/1.1
 * heads and body framing (fail closed: what could be read two ways is
 * refused), the placeholders of a session's secrets (found without case and
 * percent-decoded, replaced where their secret may go), and the masking of
 * values in responses. */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>

#include "common/util.h"
#include "egress/intercept_int.h"

/* ---- I/O ---- */

ssize_t ic_end_read(struct end *e, void *p, size_t n) {
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

int ic_end_write(struct end *e, const void *p, size_t n) {
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

void ic_close_gently(int fd) {
  shutdown(fd, SHUT_WR);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  uint64_t until = mono_ms() + LINGER_MS;
  size_t total = 0;
  for (;;) {
    char b[4096];
    ssize_t r = read(fd, b, sizeof b);
    if (r > 0) {
      total += (size_t)r;
      if (total > LINGER_BYTES)
        break;
      continue;
    }
    if (r == 0 || (errno != EAGAIN && errno != EINTR))
      break;
    uint64_t now = mono_ms();
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (now >= until || poll(&p, 1, (int)(until - now)) <= 0)
      break;
  }
  close(fd);
}

/* The buffered bytes, or a read into the buffer: how many are there (0:
 * end, -1: error). */
ssize_t ic_end_fill(struct end *e) {
  if (e->len)
    return (ssize_t)e->len;
  e->off = 0;
  ssize_t r = ic_end_read(e, e->buf, sizeof e->buf);
  e->len = r > 0 ? (size_t)r : 0;
  return r;
}

/* A head (up to the empty line) into OUT (NUL-terminated, *RET_LEN the
 * bytes with the CRLFCRLF): 0, -EMSGSIZE past HEAD_MAX, -EPIPE at an end
 * before any byte, -EIO. */
int ic_read_head(struct end *e, char *out, size_t *ret_len) {
  size_t n = 0;
  uint64_t until = mono_ms() + HEAD_MS;
  for (;;) {
    if (mono_ms() > until)
      return -ETIMEDOUT; /* a head trickled in: its reads each in time, the whole not */
    ssize_t r = ic_end_fill(e);
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

const char *ic_reason(int status) {
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
  case 421: return "Misdirected Request";
  case 429: return "Too Many Requests";
  case 431: return "Request Header Fields Too Large";
  case 500: return "Internal Server Error";
  case 502: return "Bad Gateway";
  case 503: return "Service Unavailable";
  default: return "Status";
  }
}

bool ic_tchar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         (c && strchr("!#$%&'*+-.^_`|~", c));
}

/* Splits TEXT (a head read whole) into its line and fields, in place:
 * strict (no bare CR or LF, no obs-fold, no NUL or control bytes in a
 * value, a token for each name).  False: malformed. */
bool ic_parse_head(char *text, size_t len, struct head *h) {
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
        if (!ic_tchar(*q))
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

const char *ic_field(const struct head *h, const char *name, size_t *ret_count) {
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


/* How the body after head H is framed: false when that is ambiguous
 * (both Content-Length and Transfer-Encoding, two lengths, a coding
 * other than chunked alone). */
bool ic_framing(const struct head *h, bool request, enum frame *f, uint64_t *len) {
  size_t n_cl, n_te;
  const char *cl = ic_field(h, "content-length", &n_cl), *te = ic_field(h, "transfer-encoding", &n_te);
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
bool ic_tokens_ok(struct ictx *c, const char *p, size_t n, const char *where) {
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
char *ic_replace(struct ictx *c, const char *s, size_t len, bool pct, size_t *ret_len) {
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


/* Authorization: Basic with a placeholder in its user:password. */
char *ic_replace_basic(struct ictx *c, const char *b64) {
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
  if (ic_tokens_ok(c, (char *)dec, (size_t)n, "Authorization")) {
    char *plain = ic_replace(c, (char *)dec, (size_t)n, false, &rl);
    if (plain) {
      r = malloc(6 + (rl + 2) / 3 * 4 + 1);
      if (r) {
        memcpy(r, "Basic ", 6);
        EVP_EncodeBlock((unsigned char *)r + 6, (unsigned char *)plain, (int)rl);
        if (strcmp(r + 6, b64) != 0)
          ic_mask_add(c, r + 6, strlen(r + 6)); /* an echo of what went up */
      }
      explicit_bzero(plain, rl);
      free(plain);
    }
  }
  free(dec);
  return r;
}

/* ---- bodies ---- */

/* Each value of the secrets that may go to this host, in P (N bytes),
 * becomes as many '*': a server that echoes a request (an error page, an
 * echo endpoint) does not hand the value to the sandbox.  The length
 * stays, and Content-Length and chunk sizes with it. */
void ic_mask_values(const struct ictx *c, char *p, size_t n) {
  for (size_t i = 0; i < c->n_masks; i++) {
    const char *v = c->masks[i].s;
    size_t vl = c->masks[i].n;
    for (char *q = p; n >= vl && (q = memmem(q, n - (size_t)(q - p), v, vl)); q += vl)
      memset(q, '*', vl);
  }
}

size_t ic_longest_value(const struct ictx *c) {
  size_t m = 0;
  for (size_t i = 0; i < c->n_masks; i++)
    if (c->masks[i].n > m)
      m = c->masks[i].n;
  return m;
}

/* S (N bytes) is masked in responses from now on (a form of a value this
 * connection put in a request). */
void ic_mask_add(struct ictx *c, const char *s, size_t n) {
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
static long long ic_chunk_size(struct end *src) {
  char line[LINE_MAX_];
  size_t n = 0;
  for (;;) {
    if (ic_end_fill(src) <= 0 || n >= sizeof line - 1)
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
static int ic_skip_trailers(struct end *src) {
  for (int lines = 0; lines < (int)HDR_MAX; lines++) {
    size_t n = 0;
    char prev = 0;
    for (;;) {
      if (ic_end_fill(src) <= 0 || n > LINE_MAX_)
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
 * chunked (F_CHUNKED: chunked again as it is sent, the last chunk only at its end)
 * from SRC to DST, masked (mask_values) across reads: the last bytes of
 * each read, which may begin a value, wait for the next.  0 or -1. */
int ic_relay_masked(struct ictx *c, struct end *src, struct end *dst, enum frame f,
                        uint64_t len, uint64_t *bytes) {
  size_t keep = ic_longest_value(c) - 1;
  char *buf = malloc(keep + BUF);
  if (!buf)
    return -1;
  size_t held = 0;
  uint64_t left = f == F_LEN ? len : f == F_CHUNKED ? 0 : UINT64_MAX;
  bool done = false;
  int r = 0;
  for (;;) {
    if (f == F_CHUNKED && left == 0 && !done) {
      long long size = ic_chunk_size(src);
      if (size < 0) {
        r = -1;
        break;
      }
      if (size == 0) {
        done = true;
        if (ic_skip_trailers(src) < 0)
          r = -1;
      }
      left = (uint64_t)size;
    }
    ssize_t got = left && !done ? ic_end_fill(src) : 0;
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
        if (ic_end_fill(src) <= 0)
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
    ic_mask_values(c, buf, n);
    bool last = f == F_CHUNKED ? done : (take == 0 || left == 0);
    size_t out = last ? n : (n > keep ? n - keep : 0);
    /* Chunked: chunked again as it goes, so that a response cut short
     * still lacks its last chunk on the sandbox's side. */
    char sz[24];
    int szl = f == F_CHUNKED && out ? snprintf(sz, sizeof sz, "%zx\r\n", out) : 0;
    if (out && ((szl && ic_end_write(dst, sz, (size_t)szl) < 0) || ic_end_write(dst, buf, out) < 0 ||
                (szl && ic_end_write(dst, "\r\n", 2) < 0))) {
      r = -1;
      break;
    }
    *bytes += out + (szl ? (size_t)szl + 2 : 0);
    if (last && f == F_CHUNKED) {
      if (ic_end_write(dst, "0\r\n\r\n", 5) < 0) {
        r = -1;
        break;
      }
      *bytes += 5;
    }
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
int ic_relay_body(struct ictx *c, struct end *src, struct end *dst, enum frame f,
                      uint64_t len, bool scan, uint64_t *bytes) {
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
        if (ic_end_fill(src) <= 0)
          return -1;
        two[k] = (char)src->buf[src->off++];
        src->len--;
      }
      if (two[0] != '\r' || two[1] != '\n' || ic_end_write(dst, two, 2) < 0)
        return -1;
      *bytes += 2;
      crlf = false;
    }
    if (f == F_CHUNKED && left == 0) {
      /* A chunk-size line (or, after the last chunk, trailer lines). */
      size_t n = 0;
      for (;;) {
        if (ic_end_fill(src) <= 0)
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
      if (scan && !ic_tokens_ok(c, line, n - 2, "a chunk line"))
        return -1;
      if (trailers) {
        /* No trailer fields: nothing after the last chunk but its CRLF. */
        if (n != 2 || ic_end_write(dst, "\r\n", 2) < 0)
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
      if (ic_end_write(dst, canon, (size_t)cn) < 0)
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
    ssize_t r = ic_end_fill(src);
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
      if (!ic_tokens_ok(c, carry, carry_n + head, "the body") || !ic_tokens_ok(c, p, take, "the body"))
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
    if (ic_end_write(dst, p, take) < 0)
      return -1;
    src->off += take;
    src->len -= take;
    *bytes += take;
    if (f != F_CLOSE)
      left -= take;
  }
}
