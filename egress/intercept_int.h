/* intercept_int.h: what intercept.c (an intercepted connection's life:
 * its thread, TLS, upstream, the exchange) and intercept_http.c (the bytes:
 * strict HTTP/1.1 heads and bodies, placeholders, masking) share.  Private
 * to egress/. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <openssl/ssl.h>

#include "egress/egress_int.h"

#define HEAD_MAX 65536u       /* a request's or response's head */
#define HDR_MAX 128u          /* header fields in one */
#define LINE_MAX_ 4096u       /* a chunk-size or trailer line */
#define BUF 16384u
#define HANDSHAKE_MS 10000u
#define HEAD_MS 30000u        /* a whole head, however it trickles in */
#define MASKS_MAX 64u
#define LINGER_MS 2000u       /* a closing connection's last bytes, read and dropped */
#define LINGER_BYTES (1u << 20)

struct end {
  int fd;
  SSL *ssl;
  /* What was read past a head. */
  uint8_t buf[BUF];
  size_t off, len;
};

struct ictx {
  struct end in, up;           /* the sandbox's side, the server's */
  int watch_fd;                /* the broker's end, when a gateway holds in (HTTP/2) */
  struct ic_share *share;      /* its session's count of threads */
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

struct hdr {
  char *name, *value;
};
struct head {
  char *line;
  struct hdr h[HDR_MAX];
  size_t n;
};

enum frame { F_NONE, F_LEN, F_CHUNKED, F_CLOSE };

/* ---- intercept_http.c: I/O, heads, placeholders, bodies ---- */

ssize_t ic_end_read(struct end *e, void *p, size_t n);
/* Closes FD, the broker's end of a connection, once what the sandbox
 * still sends has been read and dropped (its end, or LINGER_MS): closed
 * with bytes unread, the broker would see a reset and could drop the
 * answer still on its way to the sandbox. */
void ic_close_gently(int fd);
int ic_end_write(struct end *e, const void *p, size_t n);
/* The buffered bytes, or a read into the buffer: how many (0: end, -1: error). */
ssize_t ic_end_fill(struct end *e);
/* A head (up to the empty line, within HEAD_MS) into OUT, NUL-terminated,
 * *RET_LEN the bytes with the CRLFCRLF: 0, -EMSGSIZE past HEAD_MAX, -EPIPE
 * at an end before any byte, -ETIMEDOUT, -EIO. */
int ic_read_head(struct end *e, char *out, size_t *ret_len);
bool ic_tchar(char c);
/* The reason phrase of an HTTP status ("Status" for one not listed). */
const char *ic_reason(int status);
/* Splits TEXT (a head read whole) into its line and fields, in place,
 * strictly; false: malformed. */
bool ic_parse_head(char *text, size_t len, struct head *h);
/* The first value of field NAME (any case), *RET_COUNT how many there are. */
const char *ic_field(const struct head *h, const char *name, size_t *ret_count);
/* How the body after H is framed; false when that is ambiguous. */
bool ic_framing(const struct head *h, bool request, enum frame *f, uint64_t *len);
/* P holds no placeholder of a secret that may not go here (without case,
 * percent-decoded); false with c->why. */
bool ic_tokens_ok(struct ictx *c, const char *p, size_t n, const char *where);
/* S with each placeholder of a secret for this host replaced by its value
 * (percent-encoded when PCT): malloc'd. */
char *ic_replace(struct ictx *c, const char *s, size_t len, bool pct, size_t *ret_len);
/* "Basic <b64>" with the placeholders in its credentials replaced, or NULL. */
char *ic_replace_basic(struct ictx *c, const char *b64);
/* Each mask in P becomes as many '*'. */
void ic_mask_values(const struct ictx *c, char *p, size_t n);
size_t ic_longest_value(const struct ictx *c);
void ic_mask_add(struct ictx *c, const char *s, size_t n);
/* A response body, masked across reads (chunked: chunked again). */
int ic_relay_masked(struct ictx *c, struct end *src, struct end *dst, enum frame f, uint64_t len,
                    uint64_t *bytes);
/* A body framed F from SRC to DST as it is (chunk sizes made canonical);
 * SCAN: refused on a placeholder that may not go (c->why). */
int ic_relay_body(struct ictx *c, struct end *src, struct end *dst, enum frame f, uint64_t len,
                  bool scan, uint64_t *bytes);

/* ---- intercept.c: the threads of interception ---- */

/* FN(ARG) on a detached thread counted against the server's cap and SH's
 * (its session's; the thread holds a reference until ic_thread_end):
 * 0, -EAGAIN at a cap, or -errno. */
int ic_spawn(void *(*fn)(void *), void *arg, struct ic_share *sh);
/* The last call of such a thread. */
void ic_thread_end(struct ic_share *sh);

/* ---- intercept_h2.c: HTTP/2 on one side, HTTP/1.1 on the other ---- */

/* E, a TLS end on which ALPN chose "h2", is taken by a gateway thread
 * that speaks HTTP/2 on it (FRONT: as the server, toward the sandbox;
 * else as the client, toward the real server) and HTTP/1.1 on a
 * socketpair: E becomes that socketpair's other end, without TLS.  One
 * request and its response, then the gateway ends.  0, or -errno (E as
 * it was). */
int ic_h2_take(struct end *e, bool front, struct ic_share *sh);
