/* egress_stream.c: the relay of a program's TCP connection as a stream on
 * the channel (egress.c's head comment says how).  A connection the
 * capture rules redirected to the TCP listener is accepted here, its
 * destination read (SO_ORIGINAL_DST) and announced with STREAM_OPEN; then
 * the bytes move both ways within the windows: the host's DATA waits in
 * the stream's ring until the program reads it and is granted again in
 * batches, and the program's bytes are read only while the host's grant
 * allows.  The host's frames for a stream (ACCEPT, CREDIT, DATA, SHUT,
 * RESET) land in egress_stream_frame. */
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <linux/netfilter_ipv4.h>

#include "guest/egress_int.h"

#ifndef IP6T_SO_ORIGINAL_DST
#define IP6T_SO_ORIGINAL_DST 80
#endif

/* Grant the host more window once this much drained (or the ring is empty). */
#define EGRESS_CREDIT_BATCH (STREAM_WINDOW / 4u)
/* Chunks read from a program's socket per wake-up, so one program cannot
 * keep the loop from the channel. */
#define EGRESS_READS_PER_WAKE 4u

/* ---- streams: ending -------------------------------------------------- */

struct egress_stream *egress_stream_find(struct egress_state *e, uint32_t id) {
  if (!(id & PROTO_AGENT_ID) || id == PROTO_AGENT_ID)
    return NULL;
  for (size_t i = 0; i < EGRESS_AGENT_MAX_STREAMS; i++)
    if (e->streams[i].id == id)
      return &e->streams[i];
  return NULL;
}

/* Frees S; RESET: the program sees a reset, else an orderly close. */
void egress_stream_free(struct egress_state *e, struct egress_stream *s, bool reset) {
  if (reset)
    egress_close_reset(s->fd);
  else
    close(s->fd);
  free(s->ring);
  memset(s, 0, sizeof *s);
  e->n_streams--;
}

/* The program's socket failed (ERR): the host is told, the stream ends. */
static void stream_fail(struct agent *a, struct egress_stream *s, int err) {
  struct proto_buf *out = agent_frame(a, PROTO_STREAM_RESET, s->id);
  proto_put_u32(out, TAG_ERRNO, (uint32_t)err);
  agent_send(a);
  egress_stream_free(agent_egress(a), s, true);
}

/* The host broke the protocol for S: ERROR, and the program's connection
 * is reset. */
__attribute__((format(printf, 3, 4))) static void stream_refuse(struct agent *a,
                                                                struct egress_stream *s,
                                                                const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  agent_send_error(a, s->id, EPROTO, "stream %u: %s", egress_id_n(s->id), msg);
  egress_stream_free(agent_egress(a), s, true);
}

/* Both sides sent SHUT and every byte reached the program: closed. */
static bool stream_maybe_done(struct egress_state *e, struct egress_stream *s) {
  if (!(s->prog_shut && s->host_shut && s->ring_len == 0 && s->wr_shut))
    return false;
  egress_stream_free(e, s, false);
  return true;
}

/* ---- streams: host -> program ----------------------------------------- */

static void stream_grant(struct agent *a, struct egress_stream *s) {
  if (s->uncredited == 0 || s->host_shut ||
      (s->uncredited < EGRESS_CREDIT_BATCH && s->ring_len > 0))
    return;
  struct proto_buf *out = agent_frame(a, PROTO_STREAM_CREDIT, s->id);
  proto_put_u32(out, TAG_WINDOW, s->uncredited);
  agent_send(a);
  s->outstanding += s->uncredited;
  s->uncredited = 0;
}

/* Writes what the ring holds into the program's socket until it is full.
 * Returns false when the stream ended. */
bool egress_stream_flush(struct agent *a, struct egress_stream *s) {
  while (s->ring_len > 0) {
    struct iovec iov[2];
    uint32_t first = STREAM_WINDOW - s->ring_head;
    if (first > s->ring_len)
      first = s->ring_len;
    iov[0] = (struct iovec){s->ring + s->ring_head, first};
    iov[1] = (struct iovec){s->ring, s->ring_len - first};
    ssize_t w = writev(s->fd, iov, iov[1].iov_len ? 2 : 1);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0 && errno == EAGAIN)
      break;
    if (w <= 0) {
      stream_fail(a, s, w < 0 ? errno : EIO);
      return false;
    }
    s->ring_head = (uint32_t)((s->ring_head + (size_t)w) % STREAM_WINDOW);
    s->ring_len -= (uint32_t)w;
    s->uncredited += (uint32_t)w;
  }
  if (s->ring_len == 0)
    s->ring_head = 0;
  stream_grant(a, s);
  if (s->host_shut && s->ring_len == 0 && !s->wr_shut) {
    /* The host's FIN, once the program has every byte before it. */
    (void)shutdown(s->fd, SHUT_WR);
    s->wr_shut = true;
  }
  return !stream_maybe_done(agent_egress(a), s);
}

static void stream_data(struct agent *a, struct egress_stream *s, const uint8_t *p, uint32_t n) {
  if (s->host_shut) {
    stream_refuse(a, s, "the host sent DATA after its SHUT");
    return;
  }
  if (n > s->outstanding) {
    stream_refuse(a, s, "the host sent %u bytes with only %u granted", n, s->outstanding);
    return;
  }
  if (n == 0)
    return;
  if (!s->ring && !(s->ring = malloc(STREAM_WINDOW))) {
    agent_log("egress: no memory for stream %u's buffer", egress_id_n(s->id));
    stream_fail(a, s, ENOMEM);
    return;
  }
  s->outstanding -= n;
  /* outstanding + ring_len + uncredited == STREAM_WINDOW: it fits. */
  uint32_t tail = (s->ring_head + s->ring_len) % STREAM_WINDOW;
  uint32_t first = STREAM_WINDOW - tail < n ? STREAM_WINDOW - tail : n;
  memcpy(s->ring + tail, p, first);
  memcpy(s->ring, p + first, n - first);
  s->ring_len += n;
  egress_stream_flush(a, s);
}

/* ---- streams: program -> host ----------------------------------------- */

/* Reads the program's bytes within the host's grant and sends them. */
void egress_stream_pump(struct agent *a, struct egress_stream *s) {
  for (unsigned i = 0; i < EGRESS_READS_PER_WAKE && s->credit > 0 && agent_connected(a); i++) {
    size_t want = s->credit < PROTO_CHUNK ? s->credit : PROTO_CHUNK;
    ssize_t r = read(s->fd, agent_chunk(a), want);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0 && errno == EAGAIN)
      return;
    if (r < 0) {
      stream_fail(a, s, errno);
      return;
    }
    if (r == 0) {
      agent_send_empty(a, PROTO_STREAM_SHUT, s->id);
      s->prog_shut = true;
      stream_maybe_done(agent_egress(a), s);
      return;
    }
    agent_send_data(a, PROTO_STREAM_DATA, s->id, agent_chunk(a), (size_t)r);
    s->credit -= (uint32_t)r;
  }
}

/* ---- streams: opening ------------------------------------------------- */

/* The destination the program asked for: 4 or 6 into *RET_FAMILY, the
 * address (network order) and port.  -errno when the connection was not
 * redirected (no conntrack entry). */
static int original_dst(int fd, int *ret_family, uint8_t ret_addr[16], uint16_t *ret_port) {
  struct sockaddr_in v4;
  socklen_t len = sizeof v4;
  if (getsockopt(fd, SOL_IP, SO_ORIGINAL_DST, &v4, &len) == 0 && v4.sin_family == AF_INET) {
    *ret_family = 4;
    memcpy(ret_addr, &v4.sin_addr, 4);
    *ret_port = ntohs(v4.sin_port);
    return 0;
  }
  struct sockaddr_in6 v6;
  len = sizeof v6;
  if (getsockopt(fd, SOL_IPV6, IP6T_SO_ORIGINAL_DST, &v6, &len) == 0 &&
      v6.sin6_family == AF_INET6) {
    *ret_family = 6;
    memcpy(ret_addr, &v6.sin6_addr, 16);
    *ret_port = ntohs(v6.sin6_port);
    return 0;
  }
  return -errno;
}

static bool is_loopback(int family, const uint8_t *addr) {
  static const uint8_t v6_loopback[16] = {[15] = 1};
  return family == 4 ? addr[0] == 127 : memcmp(addr, v6_loopback, 16) == 0;
}

static void stream_open(struct agent *a, int fd) {
  struct egress_state *e = agent_egress(a);
  int family = 0;
  uint8_t addr[16] = {0};
  uint16_t port = 0;
  if (e->n_streams >= EGRESS_AGENT_MAX_STREAMS) {
    egress_note(e, "a connection was reset: %u are open already", EGRESS_AGENT_MAX_STREAMS);
    egress_close_reset(fd);
    return;
  }
  int r = original_dst(fd, &family, addr, &port);
  if (r < 0 || is_loopback(family, addr)) {
    /* A direct connect to the listener, not one the rules redirected. */
    egress_note(e, "a connection to the agent's own port was reset: %s",
                r < 0 ? strerror(-r) : "not redirected");
    egress_close_reset(fd);
    return;
  }
  uint32_t id = egress_next_id(e);
  struct egress_stream *s = NULL;
  for (size_t i = 0; i < EGRESS_AGENT_MAX_STREAMS && !s; i++)
    if (e->streams[i].id == 0)
      s = &e->streams[i];
  if (!id || !s) {
    egress_close_reset(fd);
    return;
  }
  *s = (struct egress_stream){.id = id, .fd = fd, .outstanding = STREAM_WINDOW};
  e->n_streams++;
  struct proto_buf *out = agent_frame(a, PROTO_STREAM_OPEN, id);
  proto_put_u32(out, TAG_KIND, STREAM_KIND_TCP);
  proto_put_u32(out, TAG_FAMILY, (uint32_t)family);
  proto_put_bytes(out, TAG_ADDR, addr, family == 4 ? 4 : 16);
  proto_put_u32(out, TAG_PORT, port);
  proto_put_u32(out, TAG_WINDOW, STREAM_WINDOW);
  agent_send(a);
}

void egress_accept_tcp(struct agent *a) {
  for (unsigned i = 0; i < EGRESS_ACCEPTS_PER_WAKE; i++) {
    int fd = accept4(agent_egress(a)->tcp_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
        egress_note(agent_egress(a), "accepting a connection failed: %m");
      return;
    }
    stream_open(a, fd);
  }
}

/* ---- streams: frames from the host ------------------------------------ */

/* WINDOW of an ACCEPT or CREDIT: 1..STREAM_WINDOW, or 0 when malformed. */
static uint32_t frame_window(const uint8_t *p, size_t n) {
  const uint8_t *v;
  uint32_t len, w;
  if (proto_find(p, n, TAG_WINDOW, &v, &len) != 1 || proto_val_u32(v, len, &w) < 0 || w == 0 ||
      w > STREAM_WINDOW)
    return 0;
  return w;
}

void egress_stream_frame(struct agent *a, struct egress_stream *s, const struct proto_header *h,
                         const uint8_t *p) {
  uint32_t w;
  switch (h->type) {
  case PROTO_STREAM_ACCEPT:
    w = frame_window(p, h->len);
    if (s->accepted || w == 0) {
      if (s->accepted)
        stream_refuse(a, s, "a second ACCEPT");
      else
        stream_refuse(a, s, "ACCEPT needs a WINDOW of 1..%u bytes", STREAM_WINDOW);
      return;
    }
    s->accepted = true;
    s->credit = w;
    egress_stream_pump(a, s);
    break;
  case PROTO_STREAM_CREDIT:
    w = frame_window(p, h->len);
    if (!s->accepted || w == 0 || (uint64_t)s->credit + w > STREAM_WINDOW) {
      stream_refuse(a, s, "a CREDIT %s", !s->accepted ? "before ACCEPT"
                                         : w == 0     ? "without a WINDOW of 1..STREAM_WINDOW"
                                                      : "that grants more than STREAM_WINDOW");
      return;
    }
    s->credit += w;
    if (!s->prog_shut)
      egress_stream_pump(a, s);
    break;
  case PROTO_STREAM_DATA:
    stream_data(a, s, p, h->len);
    break;
  case PROTO_STREAM_SHUT:
    if (s->host_shut) {
      stream_refuse(a, s, "a second SHUT");
      return;
    }
    s->host_shut = true;
    egress_stream_flush(a, s);
    break;
  case PROTO_STREAM_RESET:
    egress_stream_free(agent_egress(a), s, true);
    break;
  default:
    stream_refuse(a, s, "a %s frame for a stream", proto_type_name(h->type));
    break;
  }
}

