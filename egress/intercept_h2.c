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
 * This file runs a gateway's life (its nghttp2 session, the callbacks, the
 * loop); intercept_h2_msg.c writes its messages from one form to the other.
 *
 * Non-blocking I/O on both sides in one poll loop; a side is read only
 * while what it gave still waits below CAP (back-pressure reaches the peer
 * through TCP and the HTTP/2 windows). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
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
#include "egress/intercept_h2_int.h"

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

static int on_frame_recv(nghttp2_session *s, const nghttp2_frame *fr, void *ud) {
  (void)s;
  struct gw *g = ud;
  if (!g->sid || fr->hd.stream_id != g->sid)
    return 0;
  bool end = fr->hd.flags & NGHTTP2_FLAG_END_STREAM;
  if (fr->hd.type == NGHTTP2_HEADERS && !g->head_in &&
      (fr->headers.cat != NGHTTP2_HCAT_HEADERS || !g->front)) {
    if (g->front) {
      if (gw_request_head(g, end) < 0)
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    } else {
      const nghttp2_nv *st = gw_nv_find(g, ":status");
      int status = st && st->valuelen == 3 ? atoi((const char *)st->value) : 0;
      if (status >= 100 && status < 200) { /* interim: not carried */
        gw_nv_clear(g);
        return 0;
      }
      if (status < 200 || gw_response_head(g, status, end) < 0)
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    }
    gw_nv_clear(g);
    g->head_in = true;
  }
  if (end && g->head_in && !g->msg_done)
    gw_message_end(g);
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
  return gw_body_in(g, p, n) < 0 ? NGHTTP2_ERR_CALLBACK_FAILURE : 0;
}

static int on_stream_close(nghttp2_session *s, int32_t id, uint32_t code, void *ud) {
  (void)code;
  struct gw *g = ud;
  if (id != g->sid)
    return 0;
  g->closed = true;
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
  return gw_buf_add(&g->h2out, p, n) < 0 ? NGHTTP2_ERR_CALLBACK_FAILURE : (ssize_t)n;
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
    gw_buf_take(&g->h2out, (size_t)w);
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
    if (gw_buf_add(&g->h1in, b, (size_t)r) < 0) {
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
    gw_buf_take(&g->h1out, (size_t)w);
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
      while ((r = gw_h1_head(g)) == 2)
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
  gw_nv_clear(g);
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
  struct buf *bufs[] = {&g->h2out, &g->h1out, &g->h1in};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) {
    if (bufs[i]->p)
      explicit_bzero(bufs[i]->p, bufs[i]->cap);
    free(bufs[i]->p);
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
