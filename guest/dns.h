/* dns.h: the agent's DNS codec (guest/dns.c), pure functions over bytes a
 * program in the sandbox sent: parse one query, build its answer.
 *
 * The agent answers every DNS query a program makes (docs/egress-design.md
 * (a), (d)); what the answer says comes from the host (LOOKUP_END), so the
 * codec only has to read a question faithfully and write a response the
 * program's resolver accepts: same id, the question echoed, A/AAAA records
 * built from the host's addresses.  Everything in a query is hostile:
 * compression pointers may only point backwards (so they cannot loop),
 * every count is checked against the bytes that are there, and the name is
 * bounded. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/proto.h"

#define DNS_HEADER_SIZE 12u
/* The longest query the agent reads (a UDP datagram or a TCP message): a
 * query is one question and perhaps an EDNS record, far below this. */
#define DNS_QUERY_MAX 4096u
/* A response over UDP without EDNS fits in 512 bytes; records that do not
 * are left out and TC is set (only possible with a name far over 255). */
#define DNS_UDP_MAX 512u
/* The longest name kept in wire form, compression pointers followed.  RFC
 * 1035 says 255; a longer one is still passed to the host (its text cut at
 * PROTO_MAX_NAME, which the host records as <invalid:N>) so that a tunnel
 * attempt shows in the flight recorder, and echoed whole in the answer:
 * up to what leaves room for the header and the question's type and class
 * in a UDP answer.  Longer: FORMERR. */
#define DNS_QNAME_MAX (DNS_UDP_MAX - DNS_HEADER_SIZE - 4u)
/* Largest response: header, question, PROTO_MAX_ADDRS AAAA records. */
#define DNS_RESPONSE_MAX (DNS_HEADER_SIZE + DNS_QNAME_MAX + 4u + PROTO_MAX_ADDRS * 28u)

#define DNS_TYPE_A 1u
#define DNS_TYPE_AAAA 28u
#define DNS_CLASS_IN 1u
#define DNS_RCODE_NOTIMP 4u

enum dns_parse {
  DNS_PARSE_OK = 0,
  DNS_PARSE_FORMERR, /* the header is readable, the rest is not: answer FORMERR */
  DNS_PARSE_NOTIMP,  /* a readable header, but not a standard query: answer NOTIMP */
  DNS_PARSE_DROP,    /* not a query (shorter than a header, or a response): no answer */
};

struct dns_query {
  uint16_t id;
  uint16_t flags;        /* the query's flags word (opcode, RD, ...) */
  bool has_question;     /* the question was read (only for DNS_PARSE_OK) */
  uint16_t qtype, qclass;
  uint8_t qname[DNS_QNAME_MAX]; /* the name uncompressed, in wire form */
  size_t qname_len;
  /* The name in dotted text as the query spelt it, raw bytes (a NUL stays
   * a NUL); a '.' inside a label is written "\." so that the text is not
   * read as other labels (the host then sees a name that is not a host
   * name and records <invalid:N>).  The root is ".".  Cut at
   * PROTO_MAX_NAME. */
  char name[PROTO_MAX_NAME];
  size_t name_len;
  bool name_cut;         /* the text was longer than PROTO_MAX_NAME */
};

/* One address of an answer: 4 bytes (an A record) or 16 (AAAA). */
struct dns_addr {
  uint8_t len;
  uint8_t b[16];
};

/* Reads the query in P (N bytes).  On DNS_PARSE_OK all of RET is filled; on
 * FORMERR and NOTIMP its id and flags (enough for dns_build_response to
 * answer without a question); on DROP nothing. */
enum dns_parse dns_parse_query(const uint8_t *p, size_t n, struct dns_query *ret);

/* The response to Q with RCODE into OUT (SIZE bytes): the question echoed
 * when Q has one, and for NOERROR the addresses that fit the question (4
 * bytes for QTYPE A, 16 for AAAA, class IN) as records with TTL.  Records
 * that do not fit in SIZE are left out and TC is set.  Returns the length,
 * or 0 when not even the header and question fit. */
size_t dns_build_response(const struct dns_query *q, unsigned rcode, const struct dns_addr *addrs,
                          size_t n_addrs, uint32_t ttl, uint8_t *out, size_t size);
