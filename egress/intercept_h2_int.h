/* intercept_h2_int.h: what intercept_h2.c (an HTTP/2 gateway's life: its
 * nghttp2 session, callbacks and loop) and intercept_h2_msg.c (the
 * messages between HTTP/2 and HTTP/1.1: heads both ways, bodies, buffers)
 * share.  Private to egress/. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <nghttp2/nghttp2.h>
#include <openssl/ssl.h>

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

/* ---- intercept_h2_msg.c ---- */

int gw_buf_add(struct buf *b, const void *p, size_t n);
void gw_buf_take(struct buf *b, size_t n);
/* The fields collected (values cleared before they go). */
void gw_nv_clear(struct gw *g);
const nghttp2_nv *gw_nv_find(const struct gw *g, const char *name);
/* The collected fields as an HTTP/1.1 head into h1out: the request (front;
 * END: it has no body), or the response with STATUS.  0 or -1. */
int gw_request_head(struct gw *g, bool end);
int gw_response_head(struct gw *g, int status, bool end);
/* The HTTP/2 message's end, and a DATA frame's bytes, into h1out. */
void gw_message_end(struct gw *g);
int gw_body_in(struct gw *g, const uint8_t *p, size_t n);
/* The HTTP/1.1 message's head from h1in submitted as the stream's HEADERS:
 * 0 not yet, 1 done, 2 an interim head left out, -1 bad. */
int gw_h1_head(struct gw *g);

