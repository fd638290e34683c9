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
 * that is not open has ended.
 *
 * This file owns the listeners, the frames from the host and the loop's
 * hooks; the relay of a connection is egress_stream.c's, the DNS queries
 * egress_dns.c's (guest/egress_int.h). */
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "common/util.h"
#include "guest/egress_int.h"
#include "guest/egress_nl.h"

#define EGRESS_LISTEN_BACKLOG 128

/* ---- shared by the pieces (egress_int.h) ------------------------------ */

void egress_note(struct egress_state *e, const char *fmt, ...) {
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

void egress_close_reset(int fd) {
  struct linger l = {.l_onoff = 1, .l_linger = 0};
  (void)setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  close(fd);
}

uint32_t egress_next_id(struct egress_state *e) {
  if (e->last >= ~PROTO_AGENT_ID)
    return 0;
  return PROTO_AGENT_ID | ++e->last;
}

/* ---- setup ------------------------------------------------------------ */

void egress_capture(struct agent *a) {
  struct egress_state *e = agent_egress(a);
  if (egress_capture_setup(e->error, sizeof e->error) < 0)
    agent_log("egress: %s; the sandbox has no network", e->error);
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
  struct egress_state *e = agent_egress(a);
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
    char msg[sizeof e->error];
    snprintf(msg, sizeof msg, "the agent cannot listen for the sandbox's %s traffic on port %u: %s",
             l[i].what, l[i].port, strerror(-fds[i]));
    agent_log("%s; the sandbox has no network", msg);
    if (!e->error[0])
      snprintf(e->error, sizeof e->error, "%s", msg);
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

/* ---- frames from the host --------------------------------------------- */

static bool host_refused(const struct egress_state *e, uint32_t id) {
  for (size_t i = 0; i < e->n_host_refused; i++)
    if (e->host_refused[i] == id)
      return true;
  return false;
}

/* A STREAM_OPEN from the host: nothing needs one yet. */
static void egress_host_open(struct agent *a, uint32_t id) {
  struct egress_state *e = agent_egress(a);
  if (!host_refused(e, id)) {
    if (e->n_host_refused == EGRESS_HOST_REFUSED) {
      memmove(e->host_refused, e->host_refused + 1,
              (EGRESS_HOST_REFUSED - 1) * sizeof e->host_refused[0]);
      e->n_host_refused--;
    }
    e->host_refused[e->n_host_refused++] = id;
  }
  struct proto_buf *out = agent_frame(a, PROTO_STREAM_RESET, id);
  proto_put_u32(out, TAG_ERRNO, EOPNOTSUPP);
  agent_send(a);
}

void egress_handle(struct agent *a, const struct proto_header *h, const uint8_t *payload) {
  struct egress_state *e = agent_egress(a);
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
  struct egress_stream *s = egress_stream_find(e, id);
  struct egress_lookup *l = s ? NULL : egress_lookup_find(e, id);
  if (s && h->type != PROTO_LOOKUP_END && h->type != PROTO_STREAM_OPEN) {
    egress_stream_frame(a, s, h, payload);
  } else if (l && h->type == PROTO_LOOKUP_END) {
    egress_lookup_end(a, l, payload, h->len);
  } else if (s || l) {
    agent_send_error(a, id, EPROTO, "%s for %s %u", proto_type_name(h->type),
                     s ? "stream" : "lookup", egress_id_n(id));
  } else if (egress_id_n(id) == 0 || egress_id_n(id) > e->last) {
    agent_send_error(a, id, EPROTO, "%s for agent id %u, which was never opened",
                     proto_type_name(h->type), egress_id_n(id));
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
  struct egress_state *e = agent_egress(a);
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
        egress_dns_conn_on_poll(a, c);
      continue;
    }
    struct egress_stream *s = &e->streams[poll_slots[k].slot];
    if (s->id == 0 || s->id != poll_slots[k].id || s->fd != pfd[k].fd)
      continue;
    if ((rev & (POLLOUT | POLLERR | POLLHUP)) && s->ring_len > 0 && !egress_stream_flush(a, s))
      continue;
    if (s->id && (rev & (POLLIN | POLLERR | POLLHUP)) && s->accepted && !s->prog_shut)
      egress_stream_pump(a, s);
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
  struct egress_state *e = agent_egress(a);
  for (size_t i = 0; i < EGRESS_AGENT_MAX_STREAMS; i++)
    if (e->streams[i].id)
      egress_stream_free(e, &e->streams[i], true);
  for (size_t i = 0; i < EGRESS_DNS_TCP_MAX; i++)
    if (e->dns_conns[i].used)
      egress_dns_conn_close(e, &e->dns_conns[i], true);
  memset(e->lookups, 0, sizeof e->lookups);
  e->n_host_refused = 0;
  /* The next host's connection counts from 1 again. */
  e->last = 0;
}

void egress_shutdown(struct agent *a) {
  struct egress_state *e = agent_egress(a);
  egress_cancel_all(a);
  if (!e->on)
    return;
  close(e->tcp_fd);
  close(e->udp_fd);
  close(e->dns_tcp_fd);
  e->on = false;
}
