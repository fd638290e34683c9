/* test_dns.c: the agent's DNS codec (guest/dns.c): what it reads out of a
 * query a program sent (name, type, the packet's own counts and pointers
 * distrusted) and the exact bytes of the answers it builds. */
#include <stdint.h>
#include <string.h>

#include "guest/dns.h"
#include "tests/unit/test.h"

/* A query packet built by hand. */
struct pkt {
  uint8_t b[2048];
  size_t n;
};

static void put(struct pkt *p, const void *s, size_t n) {
  memcpy(p->b + p->n, s, n);
  p->n += n;
}

static void put16(struct pkt *p, unsigned v) {
  uint8_t b[2] = {(uint8_t)(v >> 8), (uint8_t)v};
  put(p, b, 2);
}

/* Header: id 0x1234, RD, QDCOUNT qd, the other counts AN, NS, AR. */
static void header(struct pkt *p, unsigned flags, unsigned qd, unsigned an, unsigned ns,
                   unsigned ar) {
  p->n = 0;
  put16(p, 0x1234);
  put16(p, flags);
  put16(p, qd);
  put16(p, an);
  put16(p, ns);
  put16(p, ar);
}

/* A dotted name in wire form (no dots inside labels). */
static void name(struct pkt *p, const char *dotted) {
  const char *s = dotted;
  while (*s) {
    const char *dot = strchr(s, '.');
    size_t n = dot ? (size_t)(dot - s) : strlen(s);
    uint8_t len = (uint8_t)n;
    put(p, &len, 1);
    put(p, s, n);
    s += n + (dot ? 1 : 0);
  }
  put(p, "", 1);
}

static void query(struct pkt *p, const char *dotted, unsigned qtype) {
  header(p, 0x0100, 1, 0, 0, 0);
  name(p, dotted);
  put16(p, qtype);
  put16(p, 1);
}

static bool name_is(const struct dns_query *q, const char *want, size_t n) {
  bool ok = q->name_len == n && memcmp(q->name, want, n) == 0;
  if (!ok)
    fprintf(stderr, "  name is \"%.*s\" (%zu bytes), expected \"%.*s\"\n", (int)q->name_len,
            q->name, q->name_len, (int)n, want);
  return ok;
}

static void test_plain_query(void) {
  struct pkt p;
  struct dns_query q;
  query(&p, "pypi.org", DNS_TYPE_A);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  CHECK_EQ_INT(q.id, 0x1234);
  CHECK_EQ_INT(q.qtype, DNS_TYPE_A);
  CHECK_EQ_INT(q.qclass, DNS_CLASS_IN);
  CHECK(q.has_question);
  CHECK(!q.name_cut);
  CHECK(name_is(&q, "pypi.org", 8));
  CHECK_EQ_INT(q.qname_len, 10);
  CHECK(memcmp(q.qname, "\4pypi\3org\0", 10) == 0);

  query(&p, "Files.PythonHosted.ORG", 16); /* TXT, case kept */
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  CHECK_EQ_INT(q.qtype, 16);
  CHECK(name_is(&q, "Files.PythonHosted.ORG", 22));

  /* The root. */
  header(&p, 0, 1, 0, 0, 0);
  put(&p, "\0\0\2\0\1", 5);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  CHECK(name_is(&q, ".", 1));
  CHECK_EQ_INT(q.qname_len, 1);
}

static void test_edns_record_is_walked(void) {
  struct pkt p;
  struct dns_query q;
  query(&p, "a.example", DNS_TYPE_AAAA);
  p.b[11] = 1; /* ARCOUNT 1: an OPT record */
  put(&p, "\0", 1);
  put16(&p, 41);
  put16(&p, 1232);
  put(&p, "\0\0\0\0", 4);
  put16(&p, 4);
  put(&p, "\0\12\0\0", 4);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  /* The record one byte short: the count claims more than is there. */
  CHECK_EQ_INT(dns_parse_query(p.b, p.n - 1, &q), DNS_PARSE_FORMERR);
}

static void test_counts_beyond_the_packet(void) {
  struct pkt p;
  struct dns_query q;
  query(&p, "a.example", DNS_TYPE_A);
  p.b[7] = 1; /* ANCOUNT 1, nothing there */
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
  CHECK_EQ_INT(q.id, 0x1234);
  CHECK(!q.has_question);
  query(&p, "a.example", DNS_TYPE_A);
  p.b[8] = p.b[9] = p.b[10] = p.b[11] = 0xff; /* 65535 NS and AR records */
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
  /* QDCOUNT 0 and 2. */
  header(&p, 0x0100, 0, 0, 0, 0);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
  query(&p, "a.b", 1);
  name(&p, "c.d");
  put16(&p, 1);
  put16(&p, 1);
  p.b[5] = 2;
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
}

static void test_truncated_packets(void) {
  struct pkt p;
  struct dns_query q;
  query(&p, "pypi.org", DNS_TYPE_A);
  /* Every cut inside the question is FORMERR, inside the header dropped. */
  for (size_t cut = 0; cut < p.n; cut++) {
    enum dns_parse r = dns_parse_query(p.b, cut, &q);
    CHECK_EQ_INT(r, cut < DNS_HEADER_SIZE ? DNS_PARSE_DROP : DNS_PARSE_FORMERR);
  }
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
}

static void test_responses_and_opcodes(void) {
  struct pkt p;
  struct dns_query q;
  query(&p, "pypi.org", DNS_TYPE_A);
  p.b[2] |= 0x80; /* QR: a response is never answered */
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_DROP);
  query(&p, "pypi.org", DNS_TYPE_A);
  p.b[2] |= 0x28; /* opcode 5, UPDATE */
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_NOTIMP);
  uint8_t out[DNS_RESPONSE_MAX];
  size_t n = dns_build_response(&q, DNS_RCODE_NOTIMP, NULL, 0, 0, out, sizeof out);
  static const uint8_t want[] = {0x12, 0x34, 0xa9, 0x84, 0, 0, 0, 0, 0, 0, 0, 0};
  CHECK_EQ_INT(n, sizeof want);
  CHECK(memcmp(out, want, sizeof want) == 0);
}

static void test_compression_pointers(void) {
  struct pkt p;
  struct dns_query q;
  header(&p, 0x0100, 1, 0, 0, 0);
  put(&p, "\3www\7example\3com\0", 17);
  put16(&p, 1);
  put16(&p, 1);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);

  /* A pointer to the header bytes (backwards: allowed, read as labels):
   * offsets 4..11 hold 00 01 00 00 00 00 00 00, so a pointer to 5 reads
   * \1 followed by one byte 00, then a 0 label: the name "\0". */
  header(&p, 0x0100, 1, 0, 0, 0);
  put(&p, "\1a\xc0\x05", 4);
  put16(&p, 1);
  put16(&p, 1);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  CHECK(name_is(&q, "a.\0", 3));
  CHECK_EQ_INT(q.qname_len, 5);
  CHECK(memcmp(q.qname, "\1a\1\0\0", 5) == 0);

  /* A pointer to itself, and one pointing forward. */
  header(&p, 0x0100, 1, 0, 0, 0);
  put(&p, "\xc0\x0c", 2);
  put16(&p, 1);
  put16(&p, 1);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
  header(&p, 0x0100, 1, 0, 0, 0);
  put(&p, "\1a\xc0\x10\0\0\1\0\1", 9);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
  /* Extended and reserved label types. */
  header(&p, 0x0100, 1, 0, 0, 0);
  put(&p, "\x41" "a\0\0\1\0\1", 7);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
  /* A pointer cut in half at the end of the packet. */
  header(&p, 0x0100, 1, 0, 0, 0);
  put(&p, "\1a\xc0", 3);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
}

static void test_pointer_loops(void) {
  struct pkt p;
  struct dns_query q;
  /* Two pointers pointing at each other, both placed where a record could
   * be and reached from the question by a backwards jump: the question at
   * 12 is "\1a" then a pointer to 12 (the start of its own part). */
  header(&p, 0x0100, 1, 0, 0, 0);
  put(&p, "\1a\xc0\x0c", 4);
  put16(&p, 1);
  put16(&p, 1);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
  /* A chain through the header: 12 -> 6 -> 6 would loop; 6 -> 6 is not
   * strictly before the part's start (6). */
  header(&p, 0x0100, 1, 0xc0, 0x06, 0);
  p.b[6] = 0xc0;
  p.b[7] = 0x06;
  put(&p, "\xc0\x06", 2);
  put16(&p, 1);
  put16(&p, 1);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
  /* Every jump must go strictly backwards, so the question (at 12) can
   * only point into the header: a chain 12 -> 10 -> 8 through the counts
   * ends (it then fails on ARCOUNT 0xc008 claiming records not there). */
  header(&p, 0x0100, 1, 0, 0, 0xc008);
  put(&p, "\1a\xc0\x0a", 4);
  put16(&p, 1);
  put16(&p, 1);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
}

static void test_long_names(void) {
  struct pkt p;
  struct dns_query q;
  /* 4 labels of 63 under evil.example: 270 bytes in wire form.  Kept and
   * echoed whole; its text is cut at PROTO_MAX_NAME. */
  char dotted[400];
  memset(dotted, 'q', 63);
  dotted[63] = '.';
  memset(dotted + 64, 'r', 63);
  dotted[127] = '.';
  memset(dotted + 128, 's', 63);
  dotted[191] = '.';
  memset(dotted + 192, 't', 63);
  strcpy(dotted + 255, ".evil.example");
  query(&p, dotted, 16);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  CHECK_EQ_INT(q.qname_len, 270);
  CHECK(q.name_cut);
  CHECK_EQ_INT(q.name_len, PROTO_MAX_NAME);
  CHECK(memcmp(q.name, dotted, PROTO_MAX_NAME) == 0);
  uint8_t out[DNS_RESPONSE_MAX];
  size_t n = dns_build_response(&q, 3, NULL, 0, 0, out, DNS_UDP_MAX);
  CHECK_EQ_INT(n, 12 + 270 + 4);
  CHECK(memcmp(out + 12, p.b + 12, 274) == 0);

  /* 253 bytes of text (the longest host name): not cut. */
  char full[260];
  memset(full, 'a', 253);
  for (int i = 63; i < 253; i += 64)
    full[i] = '.';
  full[253] = '\0';
  query(&p, full, 1);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  CHECK(!q.name_cut);
  CHECK(name_is(&q, full, 253));

  /* A name longer than DNS_QNAME_MAX: FORMERR. */
  header(&p, 0x0100, 1, 0, 0, 0);
  for (int i = 0; i < 9; i++) {
    uint8_t len = 63;
    put(&p, &len, 1);
    for (int k = 0; k < 63; k++)
      put(&p, "x", 1);
  }
  put(&p, "\0\0\1\0\1", 5);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR); /* 577 > DNS_QNAME_MAX */
  CHECK_EQ_INT(DNS_QNAME_MAX, 496);
}

static void test_labels_with_dots_and_nuls(void) {
  struct pkt p;
  struct dns_query q;
  header(&p, 0x0100, 1, 0, 0, 0);
  put(&p, "\x08" "evil.com\4good\4test\0", 20);
  put16(&p, 1);
  put16(&p, 1);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  /* The '.' inside a label is escaped: not the name evil.com.good.test. */
  CHECK(name_is(&q, "evil\\.com.good.test", 19));

  header(&p, 0x0100, 1, 0, 0, 0);
  put(&p, "\x08" "pypi\0org\4evil\0", 15);
  put16(&p, 1);
  put16(&p, 1);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  CHECK(name_is(&q, "pypi\0org.evil", 13));
}

/* The exact bytes of an answer with addresses of both sizes. */
static void test_response_bytes(void) {
  struct pkt p;
  struct dns_query q;
  query(&p, "a.bc", DNS_TYPE_A);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  struct dns_addr addrs[3] = {
      {4, {198, 18, 0, 7}},
      {16, {0x20, 0x01, 0x0d, 0xb8, [15] = 1}},
      {4, {198, 18, 0, 8}},
  };
  uint8_t out[DNS_RESPONSE_MAX];
  size_t n = dns_build_response(&q, 0, addrs, 3, 0x01020304, out, sizeof out);
  static const uint8_t want[] = {
      0x12, 0x34, 0x81, 0x80, 0, 1, 0, 2, 0, 0, 0, 0,        /* QR RD RA, 1 question, 2 answers */
      1, 'a', 2, 'b', 'c', 0, 0, 1, 0, 1,                    /* the question */
      0xc0, 12, 0, 1, 0, 1, 1, 2, 3, 4, 0, 4, 198, 18, 0, 7, /* A 198.18.0.7, ttl 0x01020304 */
      0xc0, 12, 0, 1, 0, 1, 1, 2, 3, 4, 0, 4, 198, 18, 0, 8,
  };
  CHECK_EQ_INT(n, sizeof want);
  CHECK(n == sizeof want && memcmp(out, want, n) == 0);

  /* AAAA: only the 16-byte address; RD clear in the query stays clear. */
  query(&p, "a.bc", DNS_TYPE_AAAA);
  p.b[2] = 0;
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  n = dns_build_response(&q, 0, addrs, 3, 60, out, sizeof out);
  static const uint8_t want6[] = {
      0x12, 0x34, 0x80, 0x80, 0, 1, 0, 1, 0, 0, 0, 0,
      1, 'a', 2, 'b', 'c', 0, 0, 28, 0, 1,
      0xc0, 12, 0, 28, 0, 1, 0, 0, 0, 60, 0, 16,
      0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
  };
  CHECK_EQ_INT(n, sizeof want6);
  CHECK(n == sizeof want6 && memcmp(out, want6, n) == 0);

  /* NXDOMAIN and TXT: the question, no answers (addresses ignored). */
  query(&p, "a.bc", 16);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  n = dns_build_response(&q, 3, addrs, 3, 60, out, sizeof out);
  static const uint8_t nx[] = {0x12, 0x34, 0x81, 0x83, 0, 1, 0, 0, 0, 0, 0, 0,
                               1, 'a', 2, 'b', 'c', 0, 0, 16, 0, 1};
  CHECK_EQ_INT(n, sizeof nx);
  CHECK(n == sizeof nx && memcmp(out, nx, n) == 0);
  n = dns_build_response(&q, 0, addrs, 3, 60, out, sizeof out);
  CHECK_EQ_INT(n, sizeof nx);
  CHECK_EQ_INT(out[3], 0x80);
  CHECK_EQ_INT(out[7], 0);

  /* FORMERR for a packet whose question cannot be read: no question. */
  query(&p, "a.bc", 1);
  p.b[5] = 2;
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_FORMERR);
  n = dns_build_response(&q, 1, addrs, 3, 60, out, sizeof out);
  static const uint8_t fe[] = {0x12, 0x34, 0x81, 0x81, 0, 0, 0, 0, 0, 0, 0, 0};
  CHECK_EQ_INT(n, sizeof fe);
  CHECK(n == sizeof fe && memcmp(out, fe, n) == 0);
}

static void test_response_that_does_not_fit(void) {
  struct pkt p;
  struct dns_query q;
  query(&p, "a.bc", DNS_TYPE_A);
  CHECK_EQ_INT(dns_parse_query(p.b, p.n, &q), DNS_PARSE_OK);
  struct dns_addr addrs[2] = {{4, {1, 2, 3, 4}}, {4, {5, 6, 7, 8}}};
  uint8_t out[64];
  /* Room for the question and one record: the second is left out, TC set. */
  size_t n = dns_build_response(&q, 0, addrs, 2, 1, out, 22 + 16);
  CHECK_EQ_INT(n, 22 + 16);
  CHECK_EQ_INT(out[2], 0x83);
  CHECK_EQ_INT(out[7], 1);
  /* No room for the question: nothing. */
  CHECK_EQ_INT(dns_build_response(&q, 0, addrs, 2, 1, out, 21), 0);
}

TEST_MAIN(TEST(test_plain_query), TEST(test_edns_record_is_walked),
          TEST(test_counts_beyond_the_packet), TEST(test_truncated_packets),
          TEST(test_responses_and_opcodes), TEST(test_compression_pointers),
          TEST(test_pointer_loops), TEST(test_long_names), TEST(test_labels_with_dots_and_nuls),
          TEST(test_response_bytes), TEST(test_response_that_does_not_fit))
