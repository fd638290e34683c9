/* peek.c: what a stream's first bytes may be for (docs/egress-design.md
 * (c)): the verdict on a ClientHello's SNI or an HTTP request's Host, read
 * by common/egress_peek.c, against the connection's name and port, and
 * after a TLS 1.3 HelloRetryRequest the check of the second ClientHello.
 * stream.c acts on the verdicts.  On the broker thread only. */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "egress/stream_int.h"

static bool host_is_literal(const char *h) {
  uint8_t a[16];
  return inet_pton(AF_INET, h, a) == 1 || inet_pton(AF_INET6, h, a) == 1;
}

/* Whether the name a peek found may go with this connection. */
static bool peek_name_ok(const struct stream *s, const char *found) {
  if (!s->raw)
    return strcmp(found, s->rec.host) == 0;
  /* A raw connect (open mode): an IP literal must be the address itself. */
  return !host_is_literal(found) || strcmp(found, s->rec.ip) == 0;
}

/* S's host has request rules of the session's own: its requests must be read. */
static bool stream_needs_reading(const struct stream *s) {
  return !s->raw && egress_requests_checked(s->lk->e, s->rec.host, s->rec.port);
}

bool stream_intercepts(const struct stream *s) {
  const struct egress *e = s->lk->e;
  if (s->st != ST_PEEK || s->raw || !ca_pem())
    return false;
  size_t len = strlen(s->rec.host);
  /* Request rules for its host and port: each request is checked. */
  if (egress_requests_checked(e, s->rec.host, s->rec.port))
    return true;
  for (size_t i = 0; i < e->n_bind; i++)
    if (secret_for(e->bind[i].s, s->rec.host, len, s->rec.port))
      return true;
  return false;
}

bool stream_tokens_ok(const struct stream *s, const uint8_t *p, size_t n, const char **ret_why) {
  const struct egress *e = s->lk->e;
  if (!e->n_bind)
    return true;
  /* Without case: a placeholder is lowercase, an upper-cased one is the same. */
  uint8_t *low = malloc(n ? n : 1);
  if (!low) {
    *ret_why = "out of memory";
    return false;
  }
  for (size_t i = 0; i < n; i++)
    low[i] = (uint8_t)tolower(p[i]);
  bool ok = true;
  for (size_t i = 0; ok && i < e->n_bind; i++)
    ok = !memmem(low, n, e->bind[i].token, SECRET_TOKEN_LEN);
  free(low);
  if (!ok)
    *ret_why = "secret sent to a host it is not for";
  return ok;
}

bool stream_scan_tokens(struct stream *s, const uint8_t *p, size_t n, const char **ret_why) {
  if (!s->scan_tokens)
    return true;
  /* The carry and this piece's start, then the piece. */
  size_t head = n < SECRET_TOKEN_LEN ? n : SECRET_TOKEN_LEN;
  uint8_t joint[2 * SECRET_TOKEN_LEN];
  memcpy(joint, s->scan_carry, s->scan_n);
  memcpy(joint + s->scan_n, p, head);
  if (!stream_tokens_ok(s, joint, s->scan_n + head, ret_why) || !stream_tokens_ok(s, p, n, ret_why))
    return false;
  size_t keep = SECRET_TOKEN_LEN - 1, total = s->scan_n + n;
  if (n >= keep) {
    memcpy(s->scan_carry, p + n - keep, keep);
  } else {
    size_t from = total > keep ? total - keep : 0;
    memmove(joint, joint + from, total - from); /* joint holds carry + all of p here */
    memcpy(s->scan_carry, joint, total - from);
    keep = total - from;
  }
  s->scan_n = keep;
  return true;
}

/* Bytes a peek found malformed (R: EGRESS_PEEK_MALFORMED, refused, with
 * what it read recorded), or cut short of what it needs (EGRESS_PEEK_MORE:
 * waited for while more may come, refused as WHY when none will). */
static enum verdict peek_malformed(struct stream *s, enum egress_peek r, const char *out,
                                   const char *why, bool last, const char **ret_why) {
  *ret_why = why;
  if (r == EGRESS_PEEK_MALFORMED) {
    snprintf(s->rec.sni, sizeof s->rec.sni, "%s", out);
    return V_REFUSE;
  }
  s->peek_more = why;
  return last ? V_REFUSE : V_WAIT;
}

/* What the first bytes say: V_REFUSE (*RET_WHY the reason), V_PASS, or
 * V_WAIT for more. */
enum verdict stream_peek_verdict(struct stream *s, const char **ret_why) {
  const uint8_t *b = s->up + s->up_off;
  size_t len = s->up_len;
  bool last = len >= EGRESS_PEEK_MAX || s->agent_shut; /* no more bytes will come */
  char out[EGRESS_NAME_BUF];
  if (!len) {
    if (!s->agent_shut)
      return V_WAIT;
    *ret_why = "no request";
    return s->web ? V_REFUSE : V_PASS;
  }
  enum egress_peek r;
  switch ((r = egress_tls_sni(b, len, out))) {
  case EGRESS_PEEK_FOUND:
    snprintf(s->rec.sni, sizeof s->rec.sni, "%s", out);
    *ret_why = "SNI mismatch";
    if (s->raw)
      return V_PASS;
    if (strcmp(out, s->rec.host) != 0)
      return V_REFUSE;
    if (stream_intercepts(s)) {
      s->icpt = ICPT_TLS; /* the broker answers the ClientHello itself */
      return V_PASS;
    }
    /* The ClientHello goes up; what follows it waits for the server's
     * answer (tls_server_hello). */
    size_t end = egress_tls_hello_end(b, len);
    s->tls_hold = true;
    s->tls_pass = end ? end : len;
    return V_PASS;
  case EGRESS_PEEK_ABSENT:
    /* No SNI: relayed as it is, unless its requests must be read. */
    *ret_why = "no SNI for a host with request rules";
    return stream_needs_reading(s) ? V_REFUSE : V_PASS;
  case EGRESS_PEEK_MALFORMED:
  case EGRESS_PEEK_MORE:
    return peek_malformed(s, r, out, "malformed TLS", last, ret_why);
  case EGRESS_PEEK_OTHER:
    break;
  }
  /* The upstream spoke before the program's first byte: a server-first
   * protocol (SMTP, FTP, IMAP), never an HTTP server, which only answers.
   * Its commands may look like a request line ("EHLO x"). */
  if (s->server_first)
    return V_PASS;
  uint16_t port = 0;
  switch ((r = egress_http_host(b, len, out, &port))) {
  case EGRESS_PEEK_FOUND:
    snprintf(s->rec.sni, sizeof s->rec.sni, "%s", out);
    *ret_why = "Host mismatch";
    if (!peek_name_ok(s, out))
      return V_REFUSE;
    /* A port named (Host: name:port, or the target's) is the port
     * connected to: a front end may route by it.  No port is any port. */
    *ret_why = "Host port mismatch";
    if (port && port != s->rec.port)
      return V_REFUSE;
    if (stream_intercepts(s))
      s->icpt = ICPT_HTTP;
    else if (!stream_tokens_ok(s, b, len, ret_why))
      return V_REFUSE;
    else if (s->lk->e->n_bind) {
      s->scan_tokens = true; /* and every byte after, from the end of these on */
      s->scan_n = len < SECRET_TOKEN_LEN - 1 ? len : SECRET_TOKEN_LEN - 1;
      memcpy(s->scan_carry, b + len - s->scan_n, s->scan_n);
    }
    return V_PASS;
  case EGRESS_PEEK_ABSENT:
    /* A request naming no host is served from a front end's default
     * site, which may be one the policy does not allow.  A raw connect
     * (open mode) allows the address, whatever it serves. */
    *ret_why = "HTTP request without Host";
    return s->raw ? V_PASS : V_REFUSE;
  case EGRESS_PEEK_MALFORMED:
  case EGRESS_PEEK_MORE:
    return peek_malformed(s, r, out, "malformed HTTP request", last, ret_why);
  case EGRESS_PEEK_OTHER:
    break;
  }
  *ret_why = "not TLS or HTTP on a web port";
  return s->web ? V_REFUSE : V_PASS;
}

/* ---- a second ClientHello ---- */

/* After a HelloRetryRequest: the program's second ClientHello (behind any
 * ChangeCipherSpec records) must name the host as the first did, or a
 * front end picking its site by SNI would serve another one.  False when S
 * was ended. */
bool stream_tls_second_hello(struct stream *s) {
  uint64_t unsent = s->tls_pass - s->rec.bytes_up; /* of the first ClientHello */
  if (unsent > s->up_len)
    return true;
  const uint8_t *b = s->up + s->up_off + unsent;
  size_t len = s->up_len - (size_t)unsent;
  bool last = len >= EGRESS_PEEK_MAX || s->agent_shut;
  long skip = egress_tls_skip_ccs(b, len);
  char out[EGRESS_NAME_BUF] = "";
  enum egress_peek r = skip < 0 ? EGRESS_PEEK_MORE : egress_tls_sni(b + skip, len - (size_t)skip, out);
  if (r == EGRESS_PEEK_MORE && !last)
    return true;
  if (r == EGRESS_PEEK_FOUND && strcmp(out, s->rec.host) == 0) {
    s->tls_hold = false;
    return true;
  }
  if (r == EGRESS_PEEK_FOUND)
    snprintf(s->rec.sni, sizeof s->rec.sni, "%s", out);
  stream_kill(s, ECONNRESET, r == EGRESS_PEEK_FOUND ? "SNI mismatch" : "malformed TLS", true);
  return false;
}

/* The server's first bytes P (N) while the program's bytes after its
 * ClientHello are held: a ServerHello lets them go, a HelloRetryRequest
 * makes the next ClientHello checked.  False when S was ended. */
bool stream_tls_server_hello(struct stream *s, const uint8_t *p, size_t n) {
  size_t take = sizeof s->tls_sh - s->tls_sh_len;
  if (take > n)
    take = n;
  memcpy(s->tls_sh + s->tls_sh_len, p, take);
  s->tls_sh_len += take;
  int r = egress_tls_hrr(s->tls_sh, s->tls_sh_len);
  if (r < 0)
    return true;
  if (r == 0) {
    s->tls_hold = false;
    return true;
  }
  s->tls_hrr = true;
  return stream_tls_second_hello(s);
}
