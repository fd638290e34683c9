/* egress.c: the agent's side of egress (docs/egress-design.md (a), (c),
 * (d); proto.h "Streams").
 *
 * The capture rules (egress_nl.c) send every TCP connection a program makes
 * to [::]:EGRESS_TCP_PORT and every DNS query to [::]:EGRESS_DNS_PORT.  The
 * agent decides nothing: it accepts the connection, reads the destination
 * the program asked for (SO_ORIGINAL_DST) and opens a stream on the
 * channel; the host refuses it (RESET) or accepts it, and the agent then
 * moves bytes both ways within the windows.  A DNS query becomes a LOOKUP,
 * and the host's LOOKUP_END becomes the answer.
 *
 * Flow control is the tree streams' (tree.c): the host may send what we
 * granted (OPEN's WINDOW, then our CREDITs); what it sends waits in the
 * stream's ring until the program reads it, and is granted again in
 * batches of a quarter window as it drains.  We read from the program only
 * while the host's grant (ACCEPT's WINDOW, then its CREDITs) allows, so a
 * program that writes faster than the host takes waits in its own socket,
 * and a program that does not read holds at most one window here.  The
 * loop never blocks on a program's socket.
 *
 * A host that breaks the protocol for a stream (DATA beyond the window or
 * after SHUT, a CREDIT over the window, a frame for an id never opened) gets
 * ERROR{EPROTO} for the id, as for the other requests, and the program's
 * connection is reset.  Frames for a stream that ended are dropped: ids are
 * never reused while the connection lives, so any id up to the last opened
 * that is not open has ended. */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <linux/netfilter_ipv4.h>

#include "common/util.h"
#include "guest/agent.h"

#ifndef IP6T_SO_ORIGINAL_DST
#define IP6T_SO_ORIGINAL_DST 80
#endif

/* Grant the host more window once this much drained (or the ring is empty). */
#define EGRESS_CREDIT_BATCH (STREAM_WINDOW / 4u)
/* Chunks read from a program's socket per wake-up, and connections or
 * datagrams taken per wake-up, so one program cannot keep the loop from
 * the channel. */
#define EGRESS_READS_PER_WAKE 4u
#define EGRESS_ACCEPTS_PER_WAKE 16u
/* A lookup the host has not answered in this long is forgotten when its
 * slot is needed (the program's resolver has given up on it by then). */
#define EGRESS_LOOKUP_STALE_MS 10000u
#define EGRESS_LISTEN_BACKLOG 128

/* ---- small helpers ---------------------------------------------------- */

static uint32_t stream_n(uint32_t id) { return id & ~PROTO_AGENT_ID; }

/* Logs a refusal, at most once a second; the others are counted. */
__attribute__((format(printf, 2, 3))) static void egress_note(struct egress_state *e,
                                                              const char *fmt, ...) {
  uint64_t now = mono_ms();
  if (e->log_ms && now - e->log_ms < 1000) {
    e->log_quiet++;
    return;
  }
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (e->log_quiet)
    agent_log("egress: %s (and %u more refusals in the second before)", msg, e->log_quiet);
  else
    agent_log("egress: %s", msg);
  e->log_ms = now;
  e->log_quiet = 0;
}

/* Closes FD so that the peer sees a reset, not an orderly end. */
static void close_reset(int fd) {
  struct linger l = {.l_onoff = 1, .l_linger = 0};
  (void)setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  close(fd);
}

/* The next agent id, or 0 when the 31 bits are used up. */
static uint32_t egress_next_id(struct egress_state *e) {
  if (e->last >= ~PROTO_AGENT_ID)
    return 0;
  return PROTO_AGENT_ID | ++e->last;
}

/* ---- listeners -------------------------------------------------------- */

/* A dual-stack socket on [::]:PORT (0.0.0.0 where the kernel has no IPv6).
 * No SO_REUSEPORT: nobody else may share the port. */
static int egress_listen_on(int type, uint16_t port) {
  int fd = socket(AF_INET6, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    int off = 0;
    struct sockaddr_in6 sa = {.sin6_family = AF_INET6, .sin6_port = htons(port),
                              .sin6_addr = IN6ADDR_ANY_INIT};
    if (setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off) < 0 ||
        bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0)
      goto fail;
  } else if (errno == EAFNOSUPPORT) {
    fd = socket(AF_INET, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
      return -errno;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0)
      goto fail;
  } else {
    return -errno;
  }
  if (type == SOCK_STREAM && listen(fd, EGRESS_LISTEN_BACKLOG) < 0)
    goto fail;
  return fd;
fail:;
  int err = errno;
  close(fd);
  return -err;
}

int egress_start(struct agent *a) {
  struct egress_state *e = &a->egress;
  static const struct {
    int type;
    uint16_t port;
    const char *what;
  } l[3] = {
      {SOCK_STREAM, EGRESS_TCP_PORT, "TCP"},
      {SOCK_DGRAM, EGRESS_DNS_PORT, "DNS (UDP)"},
      {SOCK_STREAM, EGRESS_DNS_PORT, "DNS (TCP)"},
  };
  int fds[3];
  for (int i = 0; i < 3; i++) {
    fds[i] = egress_listen_on(l[i].type, l[i].port);
    if (fds[i] >= 0)
      continue;
    char msg[sizeof a->egress_error];
    snprintf(msg, sizeof msg, "the agent cannot listen for the sandbox's %s traffic on port %u: %s",
             l[i].what, l[i].port, strerror(-fds[i]));
    agent_log("%s; the sandbox has no network", msg);
    if (!a->egress_error[0])
      snprintf(a->egress_error, sizeof a->egress_error, "%s", msg);
    for (int k = 0; k < i; k++)
      close(fds[k]);
    return fds[i];
  }
  e->tcp_fd = fds[0];
  e->udp_fd = fds[1];
  e->dns_tcp_fd = fds[2];
  e->on = true;
  return 0;
}

/* ---- streams: ending -------------------------------------------------- */

static struct egress_stream *stream_find(struct egress_state *e, uint32_t id) {
  if (!(id & PROTO_AGENT_ID) || id == PROTO_AGENT_ID)
    return NULL;
  for (size_t i = 0; i < EGRESS_AGENT_MAX_STREAMS; i++)
    if (e->streams[i].id == id)
      return &e->streams[i];
  return NULL;
}

/* Frees S; RESET: the program sees a reset, else an orderly close. */
static void stream_free(struct egress_state *e, struct egress_stream *s, bool reset) {
  if (reset)
    close_reset(s->fd);
  else
    close(s->fd);
  free(s->ring);
  memset(s, 0, sizeof *s);
  e->n_streams--;
}

/* The program's socket failed (ERR): the host is told, the stream ends. */
static void stream_fail(struct agent *a, struct egress_stream *s, int err) {
  proto_frame_begin(&a->out, PROTO_STREAM_RESET, s->id);
  proto_put_u32(&a->out, TAG_ERRNO, (uint32_t)err);
  agent_send(a);
  stream_free(&a->egress, s, true);
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
  agent_send_error(a, s->id, EPROTO, "stream %u: %s", stream_n(s->id), msg);
  stream_free(&a->egress, s, true);
}

/* Both sides sent SHUT and every byte reached the program: closed. */
static bool stream_maybe_done(struct egress_state *e, struct egress_stream *s) {
  if (!(s->prog_shut && s->host_shut && s->ring_len == 0 && s->wr_shut))
    return false;
  stream_free(e, s, false);
  return true;
}

/* ---- streams: host -> program ----------------------------------------- */

static void stream_grant(struct agent *a, struct egress_stream *s) {
  if (s->uncredited == 0 || s->host_shut ||
      (s->uncredited < EGRESS_CREDIT_BATCH && s->ring_len > 0))
    return;
  proto_frame_begin(&a->out, PROTO_STREAM_CREDIT, s->id);
  proto_put_u32(&a->out, TAG_WINDOW, s->uncredited);
  agent_send(a);
  s->outstanding += s->uncredited;
  s->uncredited = 0;
}

/* Writes what the ring holds into the program's socket until it is full.
 * Returns false when the stream ended. */
static bool stream_flush(struct agent *a, struct egress_stream *s) {
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
  return !stream_maybe_done(&a->egress, s);
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
    agent_log("egress: no memory for stream %u's buffer", stream_n(s->id));
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
  stream_flush(a, s);
}

/* ---- streams: program -> host ----------------------------------------- */

/* Reads the program's bytes within the host's grant and sends them. */
static void stream_pump(struct agent *a, struct egress_stream *s) {
  for (unsigned i = 0; i < EGRESS_READS_PER_WAKE && s->credit > 0 && a->chan_ok; i++) {
    size_t want = s->credit < PROTO_CHUNK ? s->credit : PROTO_CHUNK;
    ssize_t r = read(s->fd, a->chunk, want);
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
      stream_maybe_done(&a->egress, s);
      return;
    }
    agent_send_data(a, PROTO_STREAM_DATA, s->id, a->chunk, (size_t)r);
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
  struct egress_state *e = &a->egress;
  int family = 0;
  uint8_t addr[16] = {0};
  uint16_t port = 0;
  if (e->n_streams >= EGRESS_AGENT_MAX_STREAMS) {
    egress_note(e, "a connection was reset: %u are open already", EGRESS_AGENT_MAX_STREAMS);
    close_reset(fd);
    return;
  }
  int r = original_dst(fd, &family, addr, &port);
  if (r < 0 || is_loopback(family, addr)) {
    /* A direct connect to the listener, not one the rules redirected. */
    egress_note(e, "a connection to the agent's own port was reset: %s",
                r < 0 ? strerror(-r) : "not redirected");
    close_reset(fd);
    return;
  }
  uint32_t id = egress_next_id(e);
  struct egress_stream *s = NULL;
  for (size_t i = 0; i < EGRESS_AGENT_MAX_STREAMS && !s; i++)
    if (e->streams[i].id == 0)
      s = &e->streams[i];
  if (!id || !s) {
    close_reset(fd);
    return;
  }
  *s = (struct egress_stream){.id = id, .fd = fd, .outstanding = STREAM_WINDOW};
  e->n_streams++;
  proto_frame_begin(&a->out, PROTO_STREAM_OPEN, id);
  proto_put_u32(&a->out, TAG_KIND, STREAM_KIND_TCP);
  proto_put_u32(&a->out, TAG_FAMILY, (uint32_t)family);
  proto_put_bytes(&a->out, TAG_ADDR, addr, family == 4 ? 4 : 16);
  proto_put_u32(&a->out, TAG_PORT, port);
  proto_put_u32(&a->out, TAG_WINDOW, STREAM_WINDOW);
  agent_send(a);
}

static void egress_accept_tcp(struct agent *a) {
  for (unsigned i = 0; i < EGRESS_ACCEPTS_PER_WAKE; i++) {
    int fd = accept4(a->egress.tcp_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
        egress_note(&a->egress, "accepting a connection failed: %m");
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

static void stream_frame(struct agent *a, struct egress_stream *s, const struct proto_header *h,
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
    stream_pump(a, s);
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
      stream_pump(a, s);
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
    stream_flush(a, s);
    break;
  case PROTO_STREAM_RESET:
    stream_free(&a->egress, s, true);
    break;
  default:
    stream_refuse(a, s, "a %s frame for a stream", proto_type_name(h->type));
    break;
  }
}

/* ---- lookups ---------------------------------------------------------- */

static struct egress_lookup *lookup_find(struct egress_state *e, uint32_t id) {
  if (!(id & PROTO_AGENT_ID) || id == PROTO_AGENT_ID)
    return NULL;
  for (size_t i = 0; i < EGRESS_AGENT_MAX_LOOKUPS; i++)
    if (e->lookups[i].id == id)
      return &e->lookups[i];
  return NULL;
}

static void dns_conn_close(struct egress_state *e, struct egress_dns_conn *c, bool reset);

/* Sends the answer to where the query came from. */
static void dns_reply(struct egress_state *e, bool tcp, unsigned conn,
                      const struct sockaddr_storage *client, const struct dns_query *q,
                      unsigned rcode, const struct dns_addr *addrs, size_t n, uint32_t ttl) {
  if (!tcp) {
    uint8_t out[DNS_UDP_MAX];
    size_t len = dns_build_response(q, rcode, addrs, n, ttl, out, sizeof out);
    socklen_t cl = client->ss_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                 : sizeof(struct sockaddr_in);
    if (len && sendto(e->udp_fd, out, len, MSG_DONTWAIT, (const struct sockaddr *)client, cl) < 0)
      egress_note(e, "a DNS answer could not be sent: %m");
    return;
  }
  struct egress_dns_conn *c = &e->dns_conns[conn];
  size_t len = dns_build_response(q, rcode, addrs, n, ttl, c->out + 2, sizeof c->out - 2);
  if (!len) {
    dns_conn_close(e, c, true);
    return;
  }
  c->out[0] = (uint8_t)(len >> 8);
  c->out[1] = (uint8_t)len;
  c->out_off = 0;
  c->out_len = 2 + len;
}

/* A parsed query: a LOOKUP to the host, or REFUSED here when too many wait. */
static void lookup_start(struct agent *a, const struct dns_query *q, bool tcp, unsigned conn,
                         const struct sockaddr_storage *client) {
  struct egress_state *e = &a->egress;
  struct egress_lookup *l = NULL, *stale = NULL;
  uint64_t now = mono_ms();
  for (size_t i = 0; i < EGRESS_AGENT_MAX_LOOKUPS && !l; i++) {
    struct egress_lookup *x = &e->lookups[i];
    if (x->id == 0)
      l = x;
    else if (!stale && !x->tcp && now - x->started_ms >= EGRESS_LOOKUP_STALE_MS)
      stale = x;
  }
  if (!l)
    l = stale;
  uint32_t id = l ? egress_next_id(e) : 0;
  if (!id) {
    egress_note(e, "a DNS query was refused: %u wait for the host already",
                EGRESS_AGENT_MAX_LOOKUPS);
    dns_reply(e, tcp, conn, client, q, RCODE_REFUSED, NULL, 0, 0);
    return;
  }
  *l = (struct egress_lookup){.id = id, .tcp = tcp, .conn = conn, .started_ms = now, .q = *q};
  if (client)
    l->client = *client;
  if (tcp)
    e->dns_conns[conn].lookup = id;
  proto_frame_begin(&a->out, PROTO_LOOKUP, id);
  proto_put_bytes(&a->out, TAG_NAME, q->name, q->name_len);
  proto_put_u32(&a->out, TAG_QTYPE, q->qtype);
  proto_put_u32(&a->out, TAG_TRANSPORT, tcp ? LOOKUP_TCP : LOOKUP_UDP);
  agent_send(a);
}

/* A query from a program: answered here when it cannot be read, else a
 * lookup. */
static void dns_query(struct agent *a, const uint8_t *p, size_t n, bool tcp, unsigned conn,
                      const struct sockaddr_storage *client) {
  static struct dns_query q;
  switch (dns_parse_query(p, n, &q)) {
  case DNS_PARSE_OK:
    lookup_start(a, &q, tcp, conn, client);
    break;
  case DNS_PARSE_FORMERR:
    dns_reply(&a->egress, tcp, conn, client, &q, RCODE_FORMERR, NULL, 0, 0);
    break;
  case DNS_PARSE_NOTIMP:
    dns_reply(&a->egress, tcp, conn, client, &q, DNS_RCODE_NOTIMP, NULL, 0, 0);
    break;
  case DNS_PARSE_DROP:
    if (tcp)
      dns_conn_close(&a->egress, &a->egress.dns_conns[conn], true);
    break;
  }
}

/* LOOKUP_END: RCODE, ADDR* (4 or 16 bytes, at most PROTO_MAX_ADDRS), TTL. */
static int lookup_end_parse(const uint8_t *p, size_t n, unsigned *ret_rcode,
                            struct dns_addr *addrs, size_t *ret_n, uint32_t *ret_ttl,
                            const char **ret_why) {
  struct proto_tlv_iter it;
  uint16_t tag;
  const uint8_t *v;
  uint32_t len, x;
  bool has_rcode = false;
  int k;
  *ret_n = 0;
  *ret_ttl = 0;
  proto_tlv_init(&it, p, n);
  while ((k = proto_tlv_next(&it, &tag, &v, &len)) > 0) {
    if (tag == TAG_RCODE) {
      if (proto_val_u32(v, len, &x) < 0 || x > 15)
        return *ret_why = "RCODE must be a 4-byte integer 0..15", -EPROTO;
      *ret_rcode = x;
      has_rcode = true;
    } else if (tag == TAG_ADDR) {
      if (len != 4 && len != 16)
        return *ret_why = "an ADDR must be 4 or 16 bytes", -EPROTO;
      if (*ret_n == PROTO_MAX_ADDRS)
        return *ret_why = "more than PROTO_MAX_ADDRS addresses", -EPROTO;
      addrs[*ret_n].len = (uint8_t)len;
      memcpy(addrs[*ret_n].b, v, len);
      ++*ret_n;
    } else if (tag == TAG_TTL) {
      if (proto_val_u32(v, len, ret_ttl) < 0)
        return *ret_why = "TTL must be a 4-byte integer", -EPROTO;
    }
  }
  if (k < 0)
    return *ret_why = "a TLV record runs past the payload", -EPROTO;
  if (!has_rcode)
    return *ret_why = "RCODE is missing", -EPROTO;
  return 0;
}

static void lookup_end(struct agent *a, struct egress_lookup *l, const uint8_t *p, size_t n) {
  struct egress_state *e = &a->egress;
  struct dns_addr addrs[PROTO_MAX_ADDRS];
  size_t n_addrs;
  unsigned rcode = RCODE_SERVFAIL;
  uint32_t ttl;
  const char *why;
  struct egress_lookup done = *l;
  memset(l, 0, sizeof *l);
  if (done.tcp)
    e->dns_conns[done.conn].lookup = 0;
  if (lookup_end_parse(p, n, &rcode, addrs, &n_addrs, &ttl, &why) < 0) {
    agent_send_error(a, done.id, EPROTO, "malformed LOOKUP_END for lookup %u: %s",
                     stream_n(done.id), why);
    rcode = RCODE_SERVFAIL;
    n_addrs = 0;
  }
  dns_reply(e, done.tcp, done.conn, &done.client, &done.q, rcode, addrs, n_addrs, ttl);
}

/* ---- DNS sockets ------------------------------------------------------ */

static void egress_read_udp(struct agent *a) {
  static uint8_t buf[DNS_QUERY_MAX];
  for (unsigned i = 0; i < EGRESS_ACCEPTS_PER_WAKE; i++) {
    struct sockaddr_storage from;
    socklen_t fl = sizeof from;
    memset(&from, 0, sizeof from);
    ssize_t n = recvfrom(a->egress.udp_fd, buf, sizeof buf, MSG_TRUNC | MSG_DONTWAIT,
                         (struct sockaddr *)&from, &fl);
    if (n < 0)
      return;
    /* A query longer than any real one: its header still gets FORMERR. */
    size_t len = (size_t)n > sizeof buf ? DNS_HEADER_SIZE : (size_t)n;
    if ((size_t)n > sizeof buf) {
      static struct dns_query q;
      if (dns_parse_query(buf, len, &q) != DNS_PARSE_DROP)
        dns_reply(&a->egress, false, 0, &from, &q, RCODE_FORMERR, NULL, 0, 0);
      continue;
    }
    dns_query(a, buf, len, false, 0, &from);
  }
}

static void dns_conn_close(struct egress_state *e, struct egress_dns_conn *c, bool reset) {
  if (c->lookup) {
    /* Its answer has nowhere to go: forgotten, the LOOKUP_END dropped. */
    struct egress_lookup *l = lookup_find(e, c->lookup);
    if (l)
      memset(l, 0, sizeof *l);
  }
  if (reset)
    close_reset(c->fd);
  else
    close(c->fd);
  memset(c, 0, sizeof *c);
}

static void egress_accept_dns(struct agent *a) {
  struct egress_state *e = &a->egress;
  for (unsigned i = 0; i < EGRESS_ACCEPTS_PER_WAKE; i++) {
    int fd = accept4(e->dns_tcp_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0)
      return;
    struct egress_dns_conn *c = NULL;
    for (size_t k = 0; k < EGRESS_DNS_TCP_MAX && !c; k++)
      if (!e->dns_conns[k].used)
        c = &e->dns_conns[k];
    if (!c) {
      egress_note(e, "a DNS-over-TCP connection was reset: %u are open already",
                  EGRESS_DNS_TCP_MAX);
      close_reset(fd);
      continue;
    }
    c->used = true;
    c->fd = fd;
  }
}

/* Takes the next whole message out of C's input, if any. */
static void dns_conn_next(struct agent *a, struct egress_dns_conn *c) {
  unsigned conn = (unsigned)(c - a->egress.dns_conns);
  if (c->lookup || c->out_len || c->in_len < 2)
    return;
  size_t len = (size_t)c->in[0] << 8 | c->in[1];
  if (len > DNS_QUERY_MAX) {
    egress_note(&a->egress, "a DNS-over-TCP query of %zu bytes was refused", len);
    dns_conn_close(&a->egress, c, true);
    return;
  }
  if (c->in_len < 2 + len)
    return;
  static uint8_t msg[DNS_QUERY_MAX];
  memcpy(msg, c->in + 2, len);
  memmove(c->in, c->in + 2 + len, c->in_len - 2 - len);
  c->in_len -= 2 + len;
  dns_query(a, msg, len, true, conn, NULL);
}

static void dns_conn_on_poll(struct agent *a, struct egress_dns_conn *c) {
  while (c->used && c->out_len) {
    ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0 && errno == EAGAIN)
      return;
    if (w <= 0) {
      dns_conn_close(&a->egress, c, true);
      return;
    }
    c->out_off += (size_t)w;
    if (c->out_off == c->out_len)
      c->out_off = c->out_len = 0;
  }
  if (c->used && !c->lookup && c->in_len < sizeof c->in) {
    ssize_t r = read(c->fd, c->in + c->in_len, sizeof c->in - c->in_len);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
      dns_conn_close(&a->egress, c, r < 0);
      return;
    }
    if (r > 0)
      c->in_len += (size_t)r;
  }
  if (c->used)
    dns_conn_next(a, c);
}

/* ---- frames from the host --------------------------------------------- */

static bool host_refused(const struct egress_state *e, uint32_t id) {
  for (size_t i = 0; i < e->n_host_refused; i++)
    if (e->host_refused[i] == id)
      return true;
  return false;
}

/* A STREAM_OPEN from the host: nothing needs one yet. */
static void egress_host_open(struct agent *a, uint32_t id) {
  struct egress_state *e = &a->egress;
  if (!host_refused(e, id)) {
    if (e->n_host_refused == EGRESS_HOST_REFUSED) {
      memmove(e->host_refused, e->host_refused + 1,
              (EGRESS_HOST_REFUSED - 1) * sizeof e->host_refused[0]);
      e->n_host_refused--;
    }
    e->host_refused[e->n_host_refused++] = id;
  }
  proto_frame_begin(&a->out, PROTO_STREAM_RESET, id);
  proto_put_u32(&a->out, TAG_ERRNO, EOPNOTSUPP);
  agent_send(a);
}

void egress_handle(struct agent *a, const struct proto_header *h, const uint8_t *payload) {
  struct egress_state *e = &a->egress;
  uint32_t id = h->id;
  if (h->type == PROTO_LOOKUP) {
    agent_send_error(a, id, EPROTO, "unexpected LOOKUP frame from the host");
    return;
  }
  if (!(id & PROTO_AGENT_ID)) {
    if (h->type == PROTO_STREAM_OPEN)
      egress_host_open(a, id);
    else if (!host_refused(e, id))
      agent_send_error(a, id, EPROTO, "%s for id %u, which is no stream", proto_type_name(h->type),
                       id);
    return;
  }
  struct egress_stream *s = stream_find(e, id);
  struct egress_lookup *l = s ? NULL : lookup_find(e, id);
  if (s && h->type != PROTO_LOOKUP_END && h->type != PROTO_STREAM_OPEN) {
    stream_frame(a, s, h, payload);
  } else if (l && h->type == PROTO_LOOKUP_END) {
    lookup_end(a, l, payload, h->len);
  } else if (s || l) {
    agent_send_error(a, id, EPROTO, "%s for %s %u", proto_type_name(h->type),
                     s ? "stream" : "lookup", stream_n(id));
  } else if (stream_n(id) == 0 || stream_n(id) > e->last) {
    agent_send_error(a, id, EPROTO, "%s for agent id %u, which was never opened",
                     proto_type_name(h->type), stream_n(id));
  }
  /* Else the stream or lookup ended already: dropped. */
}

/* ---- the loop's hooks ------------------------------------------------- */

/* Which slot each entry of the last egress_pollfds stands for (entries
 * from 3 on): a stream's index and id, or a DNS connection's index.  The
 * agent has one egress_state and one loop, so one table serves.  Matching
 * entries to slots by their order would go wrong once a slot is freed
 * between the two calls (every later entry skipped) or an fd number is
 * reused (events handed to another socket's handler). */
static struct {
  bool dns;
  uint16_t slot;
  uint32_t id;
} poll_slots[EGRESS_POLL_MAX];

size_t egress_pollfds(const struct egress_state *e, struct pollfd *pfd) {
  if (!e->on)
    return 0;
  size_t n = 0;
  pfd[n++] = (struct pollfd){.fd = e->tcp_fd, .events = POLLIN};
  pfd[n++] = (struct pollfd){.fd = e->udp_fd, .events = POLLIN};
  pfd[n++] = (struct pollfd){.fd = e->dns_tcp_fd, .events = POLLIN};
  for (size_t i = 0; i < EGRESS_AGENT_MAX_STREAMS; i++) {
    const struct egress_stream *s = &e->streams[i];
    if (s->id == 0)
      continue;
    short ev = (short)((s->ring_len > 0 ? POLLOUT : 0) |
                       (s->accepted && s->credit > 0 && !s->prog_shut ? POLLIN : 0));
    /* A socket nothing is wanted from is left out: its hang-up would
     * otherwise wake the loop again and again. */
    if (!ev)
      continue;
    poll_slots[n].dns = false;
    poll_slots[n].slot = (uint16_t)i;
    poll_slots[n].id = s->id;
    pfd[n++] = (struct pollfd){.fd = s->fd, .events = ev};
  }
  for (size_t i = 0; i < EGRESS_DNS_TCP_MAX; i++) {
    const struct egress_dns_conn *c = &e->dns_conns[i];
    if (!c->used)
      continue;
    short ev = (short)(c->out_len ? POLLOUT : !c->lookup ? POLLIN : 0);
    if (!ev)
      continue;
    poll_slots[n].dns = true;
    poll_slots[n].slot = (uint16_t)i;
    poll_slots[n].id = 0;
    pfd[n++] = (struct pollfd){.fd = c->fd, .events = ev};
  }
  return n;
}

void egress_on_poll(struct agent *a, const struct pollfd *pfd, size_t n) {
  struct egress_state *e = &a->egress;
  if (!e->on || n < 3)
    return;
  /* An entry whose slot was freed, or holds another stream or socket by
   * now, is skipped: its events were not this one's. */
  for (size_t k = 3; k < n && k < EGRESS_POLL_MAX; k++) {
    short rev = pfd[k].revents;
    if (!rev)
      continue;
    if (poll_slots[k].dns) {
      struct egress_dns_conn *c = &e->dns_conns[poll_slots[k].slot];
      if (c->used && c->fd == pfd[k].fd)
        dns_conn_on_poll(a, c);
      continue;
    }
    struct egress_stream *s = &e->streams[poll_slots[k].slot];
    if (s->id == 0 || s->id != poll_slots[k].id || s->fd != pfd[k].fd)
      continue;
    if ((rev & (POLLOUT | POLLERR | POLLHUP)) && s->ring_len > 0 && !stream_flush(a, s))
      continue;
    if (s->id && (rev & (POLLIN | POLLERR | POLLHUP)) && s->accepted && !s->prog_shut)
      stream_pump(a, s);
  }
  /* New connections and queries after the old ones moved. */
  if (pfd[0].revents)
    egress_accept_tcp(a);
  if (pfd[1].revents)
    egress_read_udp(a);
  if (pfd[2].revents)
    egress_accept_dns(a);
}

void egress_cancel_all(struct agent *a) {
  struct egress_state *e = &a->egress;
  for (size_t i = 0; i < EGRESS_AGENT_MAX_STREAMS; i++)
    if (e->streams[i].id)
      stream_free(e, &e->streams[i], true);
  for (size_t i = 0; i < EGRESS_DNS_TCP_MAX; i++)
    if (e->dns_conns[i].used)
      dns_conn_close(e, &e->dns_conns[i], true);
  memset(e->lookups, 0, sizeof e->lookups);
  e->n_host_refused = 0;
  /* The next host's connection counts from 1 again. */
  e->last = 0;
}

void egress_shutdown(struct agent *a) {
  struct egress_state *e = &a->egress;
  egress_cancel_all(a);
  if (!e->on)
    return;
  close(e->tcp_fd);
  close(e->udp_fd);
  close(e->dns_tcp_fd);
  e->on = false;
}
