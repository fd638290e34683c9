/* egress_peek.c: what the first bytes of a stream say they are for (see
 * egress_policy.h): the server name of a TLS ClientHello, and the host of an
 * HTTP/1 request, read the way the servers behind a front end read them.
 *
 * The bytes come from a sandbox: everything is read only within the LEN it
 * is given (not NUL-terminated, may hold anything), and a name leaves only
 * as egress_name_sanitize makes it.  The HTTP reading fails closed: bytes
 * that may start a request are parsed completely and checked, or refused
 * (docs/egress-design.md (c)). */
#include "common/egress_policy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "common/util.h"

/* ---- TLS ClientHello ------------------------------------------------------------ */

#define TLS_CHANGE_CIPHER_SPEC 20u /* the first record content type */
#define TLS_HANDSHAKE 22u
#define TLS_HEARTBEAT 24u          /* the last */
#define TLS_CLIENT_HELLO 1u
#define TLS_RECORD_MAX 16384u
#define TLS_EXT_SERVER_NAME 0u
#define TLS_SNI_HOST_NAME 0u

/* A bounded reader over a byte range: every get fails once past the end. */
struct rd {
  const uint8_t *p;
  size_t left;
  bool bad;
};

static uint32_t rd_n(struct rd *r, size_t n) {
  if (r->bad || r->left < n) {
    r->bad = true;
    return 0;
  }
  uint32_t v = 0;
  for (size_t i = 0; i < n; i++)
    v = v << 8 | r->p[i];
  r->p += n;
  r->left -= n;
  return v;
}

static const uint8_t *rd_skip(struct rd *r, size_t n) {
  if (r->bad || r->left < n) {
    r->bad = true;
    return NULL;
  }
  const uint8_t *at = r->p;
  r->p += n;
  r->left -= n;
  return at;
}

/* The ClientHello body (after its 4-byte handshake header). */
static enum egress_peek client_hello_sni(const uint8_t *body, size_t n,
                                         char out[EGRESS_NAME_BUF]) {
  struct rd r = {.p = body, .left = n};
  rd_skip(&r, 2 + 32); /* legacy_version, random */
  uint32_t sid = rd_n(&r, 1);
  if (sid > 32)
    return EGRESS_PEEK_MALFORMED;
  rd_skip(&r, sid);
  uint32_t suites = rd_n(&r, 2);
  if (!r.bad && (suites < 2 || suites % 2))
    return EGRESS_PEEK_MALFORMED;
  rd_skip(&r, suites);
  uint32_t comp = rd_n(&r, 1);
  if (!r.bad && comp < 1)
    return EGRESS_PEEK_MALFORMED;
  rd_skip(&r, comp);
  if (r.bad)
    return EGRESS_PEEK_MALFORMED;
  if (r.left == 0)
    return EGRESS_PEEK_ABSENT; /* no extensions at all */
  uint32_t ext_total = rd_n(&r, 2);
  if (r.bad || ext_total != r.left)
    return EGRESS_PEEK_MALFORMED;
  bool seen_sni = false;
  enum egress_peek res = EGRESS_PEEK_ABSENT;
  while (r.left > 0) {
    uint32_t type = rd_n(&r, 2), len = rd_n(&r, 2);
    const uint8_t *v = rd_skip(&r, len);
    if (r.bad)
      return EGRESS_PEEK_MALFORMED;
    if (type != TLS_EXT_SERVER_NAME)
      continue;
    /* RFC 8446 4.2: an extension appears at most once. */
    if (seen_sni)
      return EGRESS_PEEK_MALFORMED;
    seen_sni = true;
    struct rd s = {.p = v, .left = len};
    uint32_t list = rd_n(&s, 2);
    if (s.bad || list != s.left || list == 0)
      return EGRESS_PEEK_MALFORMED;
    bool seen_host = false;
    while (s.left > 0) {
      uint32_t ntype = rd_n(&s, 1), nlen = rd_n(&s, 2);
      const uint8_t *name = rd_skip(&s, nlen);
      if (s.bad)
        return EGRESS_PEEK_MALFORMED;
      if (ntype != TLS_SNI_HOST_NAME)
        continue;
      /* RFC 6066 3: at most one name of a type; a second could let the
       * server and the broker each pick another. */
      if (seen_host || nlen == 0)
        return EGRESS_PEEK_MALFORMED;
      seen_host = true;
      if (!egress_name_sanitize(name, nlen, out))
        return EGRESS_PEEK_MALFORMED;
      res = EGRESS_PEEK_FOUND;
    }
  }
  return res;
}

enum egress_peek egress_tls_sni(const uint8_t *buf, size_t len, char out[EGRESS_NAME_BUF]) {
  out[0] = '\0';
  if (len == 0)
    return EGRESS_PEEK_MORE;
  /* Any record header a TLS server may take as its first: a content type,
   * then a version whose first byte is below 0x10 (Go's crypto/tls, behind
   * Caddy and Traefik, takes any such version before the ClientHello, and
   * drops warning alerts sent before it).  A stream that starts so is a
   * ClientHello checked, or refused: never "neither TLS nor HTTP". */
  if (buf[0] < TLS_CHANGE_CIPHER_SPEC || buf[0] > TLS_HEARTBEAT)
    return EGRESS_PEEK_OTHER;
  if (len >= 2 && buf[1] >= 0x10)
    return EGRESS_PEEK_OTHER;
  if (len > EGRESS_PEEK_MAX)
    len = EGRESS_PEEK_MAX;
  /* The handshake message may be cut over several records: gather it.  Per
   * thread rather than on the stack: 16 KiB is a lot for a broker thread's
   * stack, and the function keeps nothing between calls. */
  static _Thread_local uint8_t hs[TLS_RECORD_MAX];
  size_t hs_len = 0, off = 0;
  for (;;) {
    if (hs_len >= 4) {
      size_t need = 4 + ((size_t)hs[1] << 16 | (size_t)hs[2] << 8 | hs[3]);
      if (hs[0] != TLS_CLIENT_HELLO)
        return EGRESS_PEEK_MALFORMED;
      if (need > sizeof hs)
        return EGRESS_PEEK_MALFORMED; /* longer than any ClientHello we wait for */
      if (hs_len >= need)
        return client_hello_sni(hs + 4, need - 4, out);
    }
    if (len - off < 5)
      return len >= EGRESS_PEEK_MAX ? EGRESS_PEEK_MALFORMED : EGRESS_PEEK_MORE;
    const uint8_t *h = buf + off;
    size_t rlen = (size_t)h[3] << 8 | h[4];
    if (h[0] != TLS_HANDSHAKE || h[1] >= 0x10 || rlen == 0 || rlen > TLS_RECORD_MAX)
      return EGRESS_PEEK_MALFORMED;
    size_t have = len - off - 5 < rlen ? len - off - 5 : rlen;
    if (hs_len + have > sizeof hs)
      return EGRESS_PEEK_MALFORMED;
    memcpy(hs + hs_len, h + 5, have);
    hs_len += have;
    off += 5 + have;
    if (have < rlen) {
      /* The record is cut: decide what can be decided from what came. */
      if (hs_len >= 4 && hs[0] != TLS_CLIENT_HELLO)
        return EGRESS_PEEK_MALFORMED;
      if (hs_len >= 4 && 4 + ((size_t)hs[1] << 16 | (size_t)hs[2] << 8 | hs[3]) > sizeof hs)
        return EGRESS_PEEK_MALFORMED;
      if (hs_len >= 4 && 4 + ((size_t)hs[1] << 16 | (size_t)hs[2] << 8 | hs[3]) <= hs_len)
        continue;
      return len >= EGRESS_PEEK_MAX ? EGRESS_PEEK_MALFORMED : EGRESS_PEEK_MORE;
    }
  }
}

size_t egress_tls_hello_end(const uint8_t *buf, size_t len) {
  size_t off = 0, hs = 0, need = 0, got = 0;
  uint8_t head[4]; /* the handshake header: type, length */
  while (len - off >= 5 && buf[off] == TLS_HANDSHAKE) {
    size_t rlen = (size_t)buf[off + 3] << 8 | buf[off + 4];
    for (size_t i = 0; i < rlen && off + 5 + i < len && got < 4; i++)
      head[got++] = buf[off + 5 + i];
    hs += rlen;
    off += 5 + rlen;
    if (got == 4) {
      need = 4 + ((size_t)head[1] << 16 | (size_t)head[2] << 8 | head[3]);
      if (hs >= need)
        return off;
    }
    if (off >= len)
      break;
  }
  return 0;
}

int egress_tls_hrr(const uint8_t *buf, size_t len) {
  /* SHA-256 of "HelloRetryRequest" (RFC 8446 section 4.1.3). */
  static const uint8_t hrr[32] = {0xcf, 0x21, 0xad, 0x74, 0xe5, 0x9a, 0x61, 0x11, 0xbe, 0x1d, 0x8c,
                                  0x02, 0x1e, 0x65, 0xb8, 0x91, 0xc2, 0xa2, 0x11, 0x16, 0x7a, 0xbb,
                                  0x8c, 0x5e, 0x07, 0x9e, 0x09, 0xe2, 0xc8, 0xa8, 0x33, 0x9c};
  /* record header (5), handshake type and length (4), legacy_version (2), random */
  if (len >= 1 && buf[0] != TLS_HANDSHAKE)
    return 0;
  if (len >= 6 && buf[5] != 2)
    return 0; /* not a ServerHello */
  if (len < 11 + sizeof hrr)
    return -1;
  return memcmp(buf + 11, hrr, sizeof hrr) == 0;
}

long egress_tls_skip_ccs(const uint8_t *buf, size_t len) {
  size_t off = 0;
  while (off < len && buf[off] == TLS_CHANGE_CIPHER_SPEC) {
    if (len - off < 5)
      return -1;
    size_t rlen = (size_t)buf[off + 3] << 8 | buf[off + 4];
    if (len - off - 5 < rlen)
      return -1;
    off += 5 + rlen;
  }
  return (long)off;
}

/* ---- HTTP/1 Host -------------------------------------------------------------- */

static bool is_tchar(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || ascii_is_digit(c) ||
         (c && strchr("!#$%&'*+-.^_`|~", c));
}

static bool ieq(const uint8_t *a, size_t n, const char *lit) {
  if (strlen(lit) != n)
    return false;
  for (size_t i = 0; i < n; i++)
    if (ascii_lower((char)a[i]) != lit[i])
      return false;
  return true;
}

/* An authority "host", "host:port", "[v6]" or "[v6]:port" into OUT (the
 * name lowercased or the literal) and *RET_PORT (0: none).  FOUND, or
 * MALFORMED (OUT may then hold "<invalid:N>"). */
static enum egress_peek parse_authority(const uint8_t *a, size_t n, char out[EGRESS_NAME_BUF],
                                        uint16_t *ret_port) {
  const uint8_t *host = a, *port = NULL;
  size_t host_len = n, port_len = 0;
  char lit[INET6_ADDRSTRLEN + 1];
  bool v6 = false;
  out[0] = '\0';
  if (n > 0 && a[0] == '[') {
    const uint8_t *close = memchr(a, ']', n);
    if (!close)
      return EGRESS_PEEK_MALFORMED;
    host = a + 1;
    host_len = (size_t)(close - a) - 1;
    size_t rest = n - (size_t)(close - a) - 1;
    if (rest > 0) {
      if (close[1] != ':')
        return EGRESS_PEEK_MALFORMED;
      port = close + 2;
      port_len = rest - 1;
    }
    v6 = true;
  } else {
    const uint8_t *colon = memchr(a, ':', n);
    if (colon) {
      host_len = (size_t)(colon - a);
      port = colon + 1;
      port_len = n - host_len - 1;
    }
  }
  *ret_port = 0;
  if (port) {
    if (port_len == 0 || port_len > 5)
      return EGRESS_PEEK_MALFORMED;
    unsigned v = 0;
    for (size_t i = 0; i < port_len; i++) {
      if (!ascii_is_digit(port[i]))
        return EGRESS_PEEK_MALFORMED;
      v = v * 10 + (unsigned)(port[i] - '0');
    }
    if (v == 0 || v > 65535)
      return EGRESS_PEEK_MALFORMED;
    *ret_port = (uint16_t)v;
  }
  if (host_len == 0)
    return EGRESS_PEEK_MALFORMED;
  if (host_len < sizeof lit) {
    memcpy(lit, host, host_len);
    lit[host_len] = '\0';
    uint8_t bin[16];
    if (inet_pton(v6 ? AF_INET6 : AF_INET, lit, bin) == 1) {
      if (v6)
        for (size_t i = 0; i < host_len; i++)
          lit[i] = ascii_lower(lit[i]);
      snprintf(out, EGRESS_NAME_BUF, "%s", lit);
      return EGRESS_PEEK_FOUND;
    }
  }
  if (v6 || !egress_name_sanitize(host, host_len, out))
    return EGRESS_PEEK_MALFORMED;
  return EGRESS_PEEK_FOUND;
}

/* The end of the request head (the index after CRLF CRLF), 0 when not there. */
static size_t head_end(const uint8_t *b, size_t n) {
  for (size_t i = 3; i < n; i++)
    if (b[i] == '\n' && b[i - 1] == '\r' && b[i - 2] == '\n' && b[i - 3] == '\r')
      return i + 1;
  return 0;
}

/* Whether a request line's target starts with "scheme://" (RFC 3986: a
 * letter, then letters, digits, '+', '-' or '.'); *RET_SKIP the length of
 * that prefix. */
static bool target_scheme(const uint8_t *t, size_t n, size_t *ret_skip) {
  if (n == 0 || !((t[0] >= 'a' && t[0] <= 'z') || (t[0] >= 'A' && t[0] <= 'Z')))
    return false;
  size_t i = 1;
  while (i < n && ((t[i] >= 'a' && t[i] <= 'z') || (t[i] >= 'A' && t[i] <= 'Z') ||
                   ascii_is_digit(t[i]) || t[i] == '+' || t[i] == '-' || t[i] == '.'))
    i++;
  if (n - i < 3 || memcmp(t + i, "://", 3) != 0)
    return false;
  *ret_skip = i + 3;
  return true;
}

enum egress_peek egress_http_host(const uint8_t *buf, size_t len, char out[EGRESS_NAME_BUF],
                                  uint16_t *ret_port) {
  out[0] = '\0';
  *ret_port = 0;
  if (len > EGRESS_PEEK_MAX)
    len = EGRESS_PEEK_MAX;
  bool full = len >= EGRESS_PEEK_MAX; /* no more bytes will be looked at */
  /* Empty lines before the request line: servers skip them (RFC 9112
   * section 2.2; nginx and Node skip any CR and LF), so the peek does. */
  size_t skip = 0;
  while (skip < len && (buf[skip] == '\r' || buf[skip] == '\n'))
    skip++;
  buf += skip;
  len -= skip;
  /* The method: any token (servers differ in the methods they take), then
   * SP.  A token followed by other whitespace is a request line to a server
   * that splits on whitespace (RFC 9112 section 3): refused. */
  size_t m = 0;
  while (m < len && is_tchar(buf[m]))
    m++;
  if (m == len)
    return full ? EGRESS_PEEK_MALFORMED : EGRESS_PEEK_MORE;
  if (m == 0)
    return EGRESS_PEEK_OTHER;
  if (buf[m] == '\t' || buf[m] == '\v' || buf[m] == '\f')
    return EGRESS_PEEK_MALFORMED;
  if (buf[m] != ' ')
    return EGRESS_PEEK_OTHER;
  /* From here on this may be a request: it parses completely as
   * "method SP target SP HTTP/1.x CRLF" and is checked, or it is refused
   * (an HTTP/0.9 "GET /" is served from a server's default site).  The one
   * line of this shape that is not HTTP is SSH's identification
   * ("SSH-2.0-software SP comments CRLF", RFC 4253 section 4.2). */
  bool ssh = m > 4 && memcmp(buf, "SSH-", 4) == 0;
  enum egress_peek cut = ssh ? EGRESS_PEEK_OTHER : EGRESS_PEEK_MALFORMED;
  const uint8_t *eol = memchr(buf, '\n', len);
  if (!eol) {
    /* No LF yet: a CR may only be the last byte (its LF still to come). */
    if (memchr(buf, '\0', len) || memchr(buf, '\r', len - 1))
      return cut;
    return full ? cut : EGRESS_PEEK_MORE;
  }
  size_t line_len = (size_t)(eol - buf);
  if (buf[line_len - 1] != '\r')
    return cut;
  line_len--;
  const uint8_t *target = buf + m + 1;
  const uint8_t *sp = memchr(target, ' ', line_len - m - 1);
  if (!sp)
    return cut;
  size_t target_len = (size_t)(sp - target);
  const uint8_t *version = sp + 1;
  size_t version_len = line_len - (size_t)(version - buf);
  if (version_len != 8 || memcmp(version, "HTTP/1.", 7) != 0 ||
      (version[7] != '0' && version[7] != '1'))
    return cut;
  if (target_len == 0)
    return cut;
  for (size_t i = 0; i < target_len; i++)
    if (target[i] <= 0x20 || target[i] >= 0x7f)
      return cut;
  size_t end = head_end(buf, len);
  if (!end) {
    if (memchr(buf, '\0', len))
      return EGRESS_PEEK_MALFORMED;
    return full ? EGRESS_PEEK_MALFORMED : EGRESS_PEEK_MORE;
  }

  /* The target's authority: CONNECT's authority form, or the absolute form
   * of any scheme (servers take the host from it whatever the scheme, RFC
   * 9112 section 3.2.2).  Else the origin form ("/...") or "*"; anything
   * else is a target a server may read a host from some other way. */
  const uint8_t *auth = NULL;
  size_t auth_len = 0, scheme_len = 0;
  if (m == 7 && memcmp(buf, "CONNECT", 7) == 0) {
    auth = target;
    auth_len = target_len;
  } else if (target_scheme(target, target_len, &scheme_len)) {
    auth = target + scheme_len;
    auth_len = target_len - scheme_len;
    for (size_t i = 0; i < auth_len; i++)
      if (auth[i] == '/' || auth[i] == '?' || auth[i] == '#') {
        auth_len = i;
        break;
      }
    if (memchr(auth, '@', auth_len))
      return EGRESS_PEEK_MALFORMED; /* userinfo: a classic way to hide the host */
  } else if (target[0] != '/' && !(target_len == 1 && target[0] == '*')) {
    return EGRESS_PEEK_MALFORMED;
  }

  /* The header lines: CRLF only, no folding, one Host. */
  const uint8_t *host = NULL;
  size_t host_len = 0;
  size_t i = line_len + 2;
  while (i + 2 <= end) {
    if (buf[i] == '\r' && buf[i + 1] == '\n')
      break; /* the empty line */
    size_t j = i;
    while (j < end && buf[j] != '\r' && buf[j] != '\n' && buf[j] != '\0')
      j++;
    if (j + 1 >= end || buf[j] != '\r' || buf[j + 1] != '\n')
      return EGRESS_PEEK_MALFORMED; /* a NUL, a bare CR or LF */
    const uint8_t *line = buf + i;
    size_t n = j - i;
    if (line[0] == ' ' || line[0] == '\t')
      return EGRESS_PEEK_MALFORMED; /* obs-fold */
    size_t k = 0;
    while (k < n && is_tchar(line[k]))
      k++;
    if (k == 0 || k == n || line[k] != ':')
      return EGRESS_PEEK_MALFORMED; /* no name, or space before the colon */
    if (ieq(line, k, "host")) {
      if (host)
        return EGRESS_PEEK_MALFORMED;
      size_t a = k + 1, b = n;
      while (a < b && (line[a] == ' ' || line[a] == '\t'))
        a++;
      while (b > a && (line[b - 1] == ' ' || line[b - 1] == '\t'))
        b--;
      host = line + a;
      host_len = b - a;
    }
    i = j + 2;
  }

  char from_target[EGRESS_NAME_BUF] = "";
  uint16_t target_port = 0;
  if (auth) {
    enum egress_peek r = parse_authority(auth, auth_len, from_target, &target_port);
    if (r != EGRESS_PEEK_FOUND) {
      snprintf(out, EGRESS_NAME_BUF, "%s", from_target);
      return EGRESS_PEEK_MALFORMED;
    }
  }
  if (!host) {
    if (!auth)
      return EGRESS_PEEK_ABSENT;
    snprintf(out, EGRESS_NAME_BUF, "%s", from_target);
    *ret_port = target_port;
    return EGRESS_PEEK_FOUND;
  }
  uint16_t host_port = 0;
  enum egress_peek r = parse_authority(host, host_len, out, &host_port);
  if (r != EGRESS_PEEK_FOUND)
    return r;
  /* Two names (or two ports) in one request: a server may take either. */
  if (auth && (strcmp(out, from_target) != 0 ||
               (host_port && target_port && host_port != target_port)))
    return EGRESS_PEEK_MALFORMED;
  *ret_port = host_port ? host_port : target_port;
  return EGRESS_PEEK_FOUND;
}
