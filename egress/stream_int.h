/* stream_int.h: a stream's state, shared by stream.c (its life: connect,
 * relay, flow control) and peek.c (what its first bytes may be for).
 * Private to egress/. */
#ifndef IGN_EGRESS_STREAM_INT_H
#define IGN_EGRESS_STREAM_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "egress/egress_int.h"

enum st { ST_PEEK, ST_RESOLVE, ST_CONNECT, ST_RELAY };

struct stream {
  struct stream *next;
  struct link *lk;
  uint32_t sid;
  enum st st;
  int family;                  /* the destination the program asked for */
  uint8_t addr[16];
  bool raw;                    /* not a synthetic address: a raw IP connect (open mode) */
  bool web;                    /* port 80 or 443: must be TLS or HTTP, peeked before connecting */
  bool peek_pending;           /* connecting or connected, the first bytes not checked yet */
  uint64_t peek_deadline;      /* peek_pending: the first byte came, a decision is due */
  const char *peek_more;       /* the refusal if the peek never completes */
  bool server_first;           /* peek_pending: the upstream sent bytes before the program */
  /* A ClientHello passed the peek: what the program sends after it is held
   * until the server's first handshake message is read; after a TLS 1.3
   * HelloRetryRequest the second ClientHello must name the host too. */
  bool tls_hold;
  /* Decided at the peek, before connecting: the connection goes to an
   * interceptor (intercept.c), which speaks TLS with the program or not. */
  enum { ICPT_NONE, ICPT_TLS, ICPT_HTTP } icpt;
  /* Cleartext HTTP not intercepted, in a session with secrets: every byte
   * up is looked through for a placeholder (the last bytes of the previous
   * piece kept, a placeholder across two found). */
  bool scan_tokens;
  uint8_t scan_carry[SECRET_TOKEN_LEN];
  size_t scan_n;
  bool tls_hrr;                /* tls_hold: the server asked for a second ClientHello */
  uint64_t tls_pass;           /* tls_hold: the bytes that may go up (the first ClientHello's) */
  uint8_t tls_sh[48];          /* tls_hold: the server's first bytes */
  size_t tls_sh_len;
  struct rec_conn rec;
  /* agent -> upstream */
  uint8_t *up;
  size_t up_off, up_len, up_cap;
  uint32_t granted;            /* what the agent may still send */
  bool agent_shut, up_shut;    /* SHUT came; shutdown(SHUT_WR) done */
  /* upstream -> agent */
  uint8_t *down;
  size_t down_off, down_len;
  bool up_eof, down_shut, down_blocked;
  int fd;
  uint32_t watching;           /* the epoll mask; 0: not in the set */
  struct resolve_job *job;
  uint64_t deadline, last_ms;
};

enum verdict { V_WAIT, V_PASS, V_REFUSE };

/* What the first bytes say: V_REFUSE (*RET_WHY the reason), V_PASS, or
 * V_WAIT for more. */
enum verdict stream_peek_verdict(struct stream *s, const char **ret_why);

/* Whether S (named, not connected yet) goes to an interceptor: a secret
 * of its session may go to its host and port. */
bool stream_intercepts(const struct stream *s);
/* Whether P (N bytes, cleartext S is about to send) holds none of its
 * session's placeholders; false with *RET_WHY. */
bool stream_tokens_ok(const struct stream *s, const uint8_t *p, size_t n, const char **ret_why);

/* Whether a later piece P (N bytes) of a scanned stream (scan_tokens)
 * holds a placeholder, alone or with the end of the piece before; false
 * with *RET_WHY. */
bool stream_scan_tokens(struct stream *s, const uint8_t *p, size_t n, const char **ret_why);

/* After a HelloRetryRequest: whether the program's second ClientHello
 * names the host as the first did.  False when S was ended. */
bool stream_tls_second_hello(struct stream *s);

/* The server's first bytes P (N) while the program's bytes after its
 * ClientHello are held.  False when S was ended. */
bool stream_tls_server_hello(struct stream *s, const uint8_t *p, size_t n);

#endif
