/* egress_dns.c: the sandbox's DNS queries as lookups on the channel.  The
 * capture rules send every query (UDP and TCP port 53, any server) to the
 * agent's DNS listeners; a query that parses (dns.c) becomes a LOOKUP, and
 * the host's LOOKUP_END becomes the answer, sent back where the query came
 * from.  What cannot be read is answered here (FORMERR, NOTIMP), and so is
 * a query when too many wait for the host (REFUSED).  A DNS-over-TCP
 * connection carries one query at a time. */
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/util.h"
#include "guest/egress_int.h"

/* A lookup the host has not answered in this long is forgotten when its
 * slot is needed (the program's resolver has given up on it by then). */
#define EGRESS_LOOKUP_STALE_MS 10000u

/* ---- lookups ---------------------------------------------------------- */

struct egress_lookup *egress_lookup_find(struct egress_state *e, uint32_t id) {
  if (!(id & PROTO_AGENT_ID) || id == PROTO_AGENT_ID)
    return NULL;
  for (size_t i = 0; i < EGRESS_AGENT_MAX_LOOKUPS; i++)
    if (e->lookups[i].id == id)
      return &e->lookups[i];
  return NULL;
}

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
    egress_dns_conn_close(e, c, true);
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
  struct egress_state *e = agent_egress(a);
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
  struct proto_buf *out = agent_frame(a, PROTO_LOOKUP, id);
  proto_put_bytes(out, TAG_NAME, q->name, q->name_len);
  proto_put_u32(out, TAG_QTYPE, q->qtype);
  proto_put_u32(out, TAG_TRANSPORT, tcp ? LOOKUP_TCP : LOOKUP_UDP);
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
    dns_reply(agent_egress(a), tcp, conn, client, &q, RCODE_FORMERR, NULL, 0, 0);
    break;
  case DNS_PARSE_NOTIMP:
    dns_reply(agent_egress(a), tcp, conn, client, &q, DNS_RCODE_NOTIMP, NULL, 0, 0);
    break;
  case DNS_PARSE_DROP:
    if (tcp)
      egress_dns_conn_close(agent_egress(a), &agent_egress(a)->dns_conns[conn], true);
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

void egress_lookup_end(struct agent *a, struct egress_lookup *l, const uint8_t *p, size_t n) {
  struct egress_state *e = agent_egress(a);
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
                     egress_id_n(done.id), why);
    rcode = RCODE_SERVFAIL;
    n_addrs = 0;
  }
  dns_reply(e, done.tcp, done.conn, &done.client, &done.q, rcode, addrs, n_addrs, ttl);
}

/* ---- DNS sockets ------------------------------------------------------ */

void egress_read_udp(struct agent *a) {
  static uint8_t buf[DNS_QUERY_MAX];
  for (unsigned i = 0; i < EGRESS_ACCEPTS_PER_WAKE; i++) {
    struct sockaddr_storage from;
    socklen_t fl = sizeof from;
    memset(&from, 0, sizeof from);
    ssize_t n = recvfrom(agent_egress(a)->udp_fd, buf, sizeof buf, MSG_TRUNC | MSG_DONTWAIT,
                         (struct sockaddr *)&from, &fl);
    if (n < 0)
      return;
    /* A query longer than any real one: its header still gets FORMERR. */
    size_t len = (size_t)n > sizeof buf ? DNS_HEADER_SIZE : (size_t)n;
    if ((size_t)n > sizeof buf) {
      static struct dns_query q;
      if (dns_parse_query(buf, len, &q) != DNS_PARSE_DROP)
        dns_reply(agent_egress(a), false, 0, &from, &q, RCODE_FORMERR, NULL, 0, 0);
      continue;
    }
    dns_query(a, buf, len, false, 0, &from);
  }
}

void egress_dns_conn_close(struct egress_state *e, struct egress_dns_conn *c, bool reset) {
  if (c->lookup) {
    /* Its answer has nowhere to go: forgotten, the LOOKUP_END dropped. */
    struct egress_lookup *l = egress_lookup_find(e, c->lookup);
    if (l)
      memset(l, 0, sizeof *l);
  }
  if (reset)
    egress_close_reset(c->fd);
  else
    close(c->fd);
  memset(c, 0, sizeof *c);
}

void egress_accept_dns(struct agent *a) {
  struct egress_state *e = agent_egress(a);
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
      egress_close_reset(fd);
      continue;
    }
    c->used = true;
    c->fd = fd;
  }
}

/* Takes the next whole message out of C's input, if any. */
static void dns_conn_next(struct agent *a, struct egress_dns_conn *c) {
  unsigned conn = (unsigned)(c - agent_egress(a)->dns_conns);
  if (c->lookup || c->out_len || c->in_len < 2)
    return;
  size_t len = (size_t)c->in[0] << 8 | c->in[1];
  if (len > DNS_QUERY_MAX) {
    egress_note(agent_egress(a), "a DNS-over-TCP query of %zu bytes was refused", len);
    egress_dns_conn_close(agent_egress(a), c, true);
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

void egress_dns_conn_on_poll(struct agent *a, struct egress_dns_conn *c) {
  while (c->used && c->out_len) {
    ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0 && errno == EAGAIN)
      return;
    if (w <= 0) {
      egress_dns_conn_close(agent_egress(a), c, true);
      return;
    }
    c->out_off += (size_t)w;
    if (c->out_off == c->out_len)
      c->out_off = c->out_len = 0;
  }
  if (c->used && !c->lookup && c->in_len < sizeof c->in) {
    ssize_t r = read(c->fd, c->in + c->in_len, sizeof c->in - c->in_len);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
      egress_dns_conn_close(agent_egress(a), c, r < 0);
      return;
    }
    if (r > 0)
      c->in_len += (size_t)r;
  }
  if (c->used)
    dns_conn_next(a, c);
}

