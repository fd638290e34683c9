/* egress_int.h: the sandbox's TCP connections and DNS queries as streams
 * and lookups on the channel (proto.h "Streams"): the state, what the loop
 * (agent.c) calls, and what the three pieces share: egress.c (the
 * listeners, the frames from the host, the loop's hooks), egress_stream.c
 * (the relay of one TCP connection) and egress_dns.c (the DNS queries, over
 * UDP and TCP, as lookups; dns.c is their codec). */
#pragma once

#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "guest/agent_core.h"
#include "guest/dns.h"

#define EGRESS_AGENT_MAX_STREAMS 256u /* program connections at once; more are reset */
#define EGRESS_AGENT_MAX_LOOKUPS 64u  /* queries waiting for the host; more get REFUSED */
#define EGRESS_DNS_TCP_MAX 8u         /* DNS-over-TCP connections at once */
#define EGRESS_HOST_REFUSED 16u       /* host-opened ids remembered after their RESET */
#define EGRESS_POLL_MAX (3u + EGRESS_AGENT_MAX_STREAMS + EGRESS_DNS_TCP_MAX)
/* Connections or datagrams taken per wake-up, so one program cannot keep
 * the loop from the channel. */
#define EGRESS_ACCEPTS_PER_WAKE 16u

/* One TCP connection of a program.  An all-zero slot (id 0) is free. */
struct egress_stream {
  uint32_t id;
  int fd;              /* the program's socket, non-blocking */
  bool accepted;       /* the host's ACCEPT came: reading may start */
  bool host_shut;      /* the host sent SHUT */
  bool prog_shut;      /* the program's EOF was read and SHUT sent */
  bool wr_shut;        /* shutdown(SHUT_WR) done (after host_shut, ring drained) */
  uint32_t credit;     /* bytes the host still lets us send */
  /* Host -> program: outstanding + ring_len + uncredited == STREAM_WINDOW. */
  uint8_t *ring;       /* STREAM_WINDOW bytes, allocated at the first DATA */
  uint32_t ring_head, ring_len;
  uint32_t outstanding; /* granted to the host and not used yet */
  uint32_t uncredited;  /* written to the program, not granted again yet */
};

/* One DNS query waiting for its LOOKUP_END.  Id 0: free. */
struct egress_lookup {
  uint32_t id;
  bool tcp;
  unsigned conn;                /* tcp: the index of its connection */
  struct sockaddr_storage client; /* udp: where the answer goes */
  uint64_t started_ms;
  struct dns_query q;
};

/* A DNS-over-TCP connection: one query at a time. */
struct egress_dns_conn {
  bool used;
  int fd;
  uint32_t lookup;              /* the query in flight, 0: none */
  uint8_t in[2 + DNS_QUERY_MAX];
  size_t in_len;
  uint8_t out[2 + DNS_RESPONSE_MAX];
  size_t out_off, out_len;
};

/* All zero is a valid state with egress off (no listeners). */
struct egress_state {
  bool on;                      /* the listeners are open */
  int tcp_fd, udp_fd, dns_tcp_fd;
  uint32_t last;                /* the n of the last agent id opened (ids PROTO_AGENT_ID | n) */
  size_t n_streams;
  struct egress_stream streams[EGRESS_AGENT_MAX_STREAMS];
  struct egress_lookup lookups[EGRESS_AGENT_MAX_LOOKUPS];
  struct egress_dns_conn dns_conns[EGRESS_DNS_TCP_MAX];
  /* Host-opened streams we reset: their frames still in flight are dropped. */
  uint32_t host_refused[EGRESS_HOST_REFUSED];
  size_t n_host_refused;
  /* Refusals logged at most once a second, the others counted. */
  uint64_t log_ms;
  unsigned log_quiet;
  /* Why the sandbox's traffic could not be captured (egress_capture_setup
   * failed: it then has no route out at all) or its listeners not opened,
   * "" when all is well; HELLO_OK carries it as TAG_EGRESS_ERROR. */
  char error[256];
};

/* agent.c: the agent's one egress_state. */
struct egress_state *agent_egress(struct agent *a);

/* ---- egress.c: what the agent's setup and loop call ---- */

/* egress_capture_setup() as part of a sandbox's setup.  A failure does not
 * stop the sandbox: it runs with no route out (fail closed), the failure is
 * logged and kept in the state's error for HELLO_OK. */
void egress_capture(struct agent *a);
/* Opens the listeners ([::]:EGRESS_TCP_PORT, UDP and TCP [::]:EGRESS_DNS_PORT,
 * close-on-exec) in the sandbox's network namespace.  On failure logs,
 * fills the state's error when it is empty, and leaves egress off (what the
 * rules redirect then finds no listener: it fails, nothing leaves). */
int egress_start(struct agent *a);
/* The stream and lookup frames (STREAM_*, LOOKUP, LOOKUP_END). */
void egress_handle(struct agent *a, const struct proto_header *h, const uint8_t *payload);
size_t egress_pollfds(const struct egress_state *e, struct pollfd *pfd);
void egress_on_poll(struct agent *a, const struct pollfd *pfd, size_t n);
/* The host is gone: every program connection is reset, every query
 * forgotten, and ids count from 1 again for the next host. */
void egress_cancel_all(struct agent *a);
/* The agent is ending: egress_cancel_all and the listeners closed. */
void egress_shutdown(struct agent *a);

/* ---- egress.c: shared by the pieces ---- */

/* The n of an agent id (PROTO_AGENT_ID | n), as messages name it. */
static inline uint32_t egress_id_n(uint32_t id) { return id & ~PROTO_AGENT_ID; }
/* Logs a refusal, at most once a second; the others are counted. */
__attribute__((format(printf, 2, 3))) void egress_note(struct egress_state *e, const char *fmt,
                                                       ...);
/* Closes FD so that the peer sees a reset, not an orderly end. */
void egress_close_reset(int fd);
/* The next agent id, or 0 when the 31 bits are used up. */
uint32_t egress_next_id(struct egress_state *e);

/* ---- egress_stream.c: the relay of the program's TCP connections ---- */

/* The open stream ID, or NULL. */
struct egress_stream *egress_stream_find(struct egress_state *e, uint32_t id);
/* Frees S; RESET: the program sees a reset, else an orderly close. */
void egress_stream_free(struct egress_state *e, struct egress_stream *s, bool reset);
/* Writes what the ring holds into the program's socket until it is full.
 * Returns false when the stream ended. */
bool egress_stream_flush(struct agent *a, struct egress_stream *s);
/* Reads the program's bytes within the host's grant and sends them. */
void egress_stream_pump(struct agent *a, struct egress_stream *s);
/* A frame from the host for the open stream S. */
void egress_stream_frame(struct agent *a, struct egress_stream *s, const struct proto_header *h,
                         const uint8_t *p);
/* New connections on the TCP listener: a STREAM_OPEN each. */
void egress_accept_tcp(struct agent *a);

/* ---- egress_dns.c: the DNS queries as lookups ---- */

/* The lookup ID waiting for its LOOKUP_END, or NULL. */
struct egress_lookup *egress_lookup_find(struct egress_state *e, uint32_t id);
/* The host's LOOKUP_END for L: the answer goes to the program, L is freed. */
void egress_lookup_end(struct agent *a, struct egress_lookup *l, const uint8_t *p, size_t n);
/* Queries on the UDP listener. */
void egress_read_udp(struct agent *a);
/* New connections on the DNS-over-TCP listener. */
void egress_accept_dns(struct agent *a);
/* C's socket is ready: the answer written, the next query read. */
void egress_dns_conn_on_poll(struct agent *a, struct egress_dns_conn *c);
/* Closes C (RESET: the program sees a reset) and forgets its query. */
void egress_dns_conn_close(struct egress_state *e, struct egress_dns_conn *c, bool reset);
