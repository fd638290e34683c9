/* fuzz_dns.c: a DNS query as a program in the sandbox sends it to the
 * agent (guest/dns.c).  The input is the packet.  What parses must give a
 * bounded name and an answer that parses back as a response (never as a
 * query: the agent must not answer its own answers), whose question is the
 * query's, with every record inside the size it was given. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "guest/dns.h"

#define check(ok)                                                    \
  do {                                                               \
    if (!(ok)) {                                                     \
      fprintf(stderr, "fuzz_dns: line %d: %s\n", __LINE__, #ok);     \
      abort();                                                       \
    }                                                                \
  } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static struct dns_query q, again;
  static uint8_t out[DNS_RESPONSE_MAX];
  enum dns_parse r = dns_parse_query(data, size, &q);
  if (r == DNS_PARSE_DROP) {
    check(size < DNS_HEADER_SIZE || (data[2] & 0x80));
    return 0;
  }
  check(q.has_question == (r == DNS_PARSE_OK));
  if (r == DNS_PARSE_OK) {
    check(q.name_len > 0 && q.name_len <= PROTO_MAX_NAME);
    check(q.qname_len > 0 && q.qname_len <= DNS_QNAME_MAX && q.qname[q.qname_len - 1] == 0);
  }
  /* Addresses of both sizes; the answer at the UDP size and at full size. */
  static const struct dns_addr addrs[PROTO_MAX_ADDRS] = {
      {4, {198, 18, 0, 1}}, {16, {0x20, 1, 0xd, 0xb8, [15] = 1}}, {4, {198, 18, 0, 2}},
      {4, {198, 18, 0, 3}}, {16, {0xfe, 0x80, [15] = 2}},          {4, {198, 18, 0, 4}},
      {4, {198, 18, 0, 5}}, {4, {198, 18, 0, 6}},
  };
  unsigned rcode = size ? data[size - 1] % 6 : 0;
  size_t limits[2] = {DNS_UDP_MAX, sizeof out};
  for (int i = 0; i < 2; i++) {
    size_t n = dns_build_response(&q, rcode, addrs, PROTO_MAX_ADDRS, 300, out, limits[i]);
    check(n >= DNS_HEADER_SIZE && n <= limits[i]);
    check(out[0] == data[0] && out[1] == data[1]);
    check((out[2] & 0x80) && (out[3] & 0x0f) == rcode);
    check(dns_parse_query(out, n, &again) == DNS_PARSE_DROP);
    if (q.has_question) {
      check(out[4] == 0 && out[5] == 1);
      check(memcmp(out + DNS_HEADER_SIZE, q.qname, q.qname_len) == 0);
      /* As a query (QR cleared, answers counted as records) it reads back
       * to the same question. */
      out[2] &= 0x7f;
      check(dns_parse_query(out, n, &again) == DNS_PARSE_OK);
      check(again.qname_len == q.qname_len && memcmp(again.qname, q.qname, q.qname_len) == 0);
      check(again.qtype == q.qtype && again.qclass == q.qclass);
    }
  }
  return 0;
}
