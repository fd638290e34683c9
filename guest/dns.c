/* dns.c: the agent's DNS codec (see dns.h).  No state, no allocation: the
 * agent's egress.c hands it datagrams and TCP messages, the unit test and
 * the fuzz target call it directly.
 *
 * Names: a label is a length byte 0..63 and its bytes; 0xc0 starts a
 * two-byte compression pointer; 0x40 and 0x80 (extended and reserved label
 * types) are refused.  A pointer must point before the start of the part of
 * the name being read, so each jump goes strictly backwards and a name
 * cannot loop; the name expanded is capped at DNS_QNAME_MAX besides. */
#include <string.h>

#include "guest/dns.h"

#define DNS_FLAG_QR 0x8000u
#define DNS_FLAG_OPCODE 0x7800u
#define DNS_FLAG_TC 0x0200u
#define DNS_FLAG_RD 0x0100u
#define DNS_FLAG_RA 0x0080u

static uint16_t be16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }

static void put16(uint8_t *p, unsigned v) {
  p[0] = (uint8_t)(v >> 8);
  p[1] = (uint8_t)v;
}

static void text_put(struct dns_query *q, char c) {
  if (q->name_len < sizeof q->name)
    q->name[q->name_len++] = c;
  else
    q->name_cut = true;
}

/* Appends a label to the dotted text, a '.' in it escaped. */
static void text_label(struct dns_query *q, const uint8_t *s, size_t n) {
  if (q->name_len > 0 || q->name_cut)
    text_put(q, '.');
  for (size_t i = 0; i < n; i++) {
    if (s[i] == '.')
      text_put(q, '\\');
    text_put(q, (char)s[i]);
  }
}

/* Reads the name at OFF, following pointers, into Q's qname and name.
 * *RET_END is the offset just past the name where it started.  0, or -1
 * when the name is malformed or runs past the packet. */
static int read_name(const uint8_t *p, size_t n, size_t off, struct dns_query *q,
                     size_t *ret_end) {
  size_t pos = off, limit = off, end = 0;
  q->qname_len = q->name_len = 0;
  q->name_cut = false;
  for (;;) {
    if (pos >= n)
      return -1;
    uint8_t c = p[pos];
    if (c == 0) {
      if (q->qname_len + 1 > sizeof q->qname)
        return -1;
      q->qname[q->qname_len++] = 0;
      if (!end)
        end = pos + 1;
      break;
    }
    if ((c & 0xc0) == 0xc0) {
      if (pos + 1 >= n)
        return -1;
      size_t target = (size_t)(c & 0x3f) << 8 | p[pos + 1];
      /* Strictly before where this part of the name began: no loops. */
      if (target >= limit)
        return -1;
      if (!end)
        end = pos + 2;
      pos = limit = target;
      continue;
    }
    if (c & 0xc0)
      return -1;
    if (pos + 1 + c > n || q->qname_len + 1 + c + 1 > sizeof q->qname)
      return -1;
    memcpy(q->qname + q->qname_len, p + pos, 1u + c);
    text_label(q, p + pos + 1, c);
    q->qname_len += 1u + c;
    pos += 1u + c;
  }
  if (q->qname_len == 1)
    text_put(q, '.'); /* the root */
  *ret_end = end;
  return 0;
}

/* Skips a name without following its pointer: the offset past it, or 0. */
static size_t skip_name(const uint8_t *p, size_t n, size_t pos) {
  while (pos < n) {
    uint8_t c = p[pos];
    if (c == 0)
      return pos + 1;
    if ((c & 0xc0) == 0xc0)
      return pos + 2 <= n ? pos + 2 : 0;
    if (c & 0xc0)
      return 0;
    pos += 1u + c;
  }
  return 0;
}

enum dns_parse dns_parse_query(const uint8_t *p, size_t n, struct dns_query *ret) {
  if (n < DNS_HEADER_SIZE)
    return DNS_PARSE_DROP;
  uint16_t flags = be16(p + 2);
  /* A response is never answered: two agents (or a program) could
   * otherwise bounce one packet between them. */
  if (flags & DNS_FLAG_QR)
    return DNS_PARSE_DROP;
  ret->id = be16(p);
  ret->flags = flags;
  ret->has_question = false;
  if (flags & DNS_FLAG_OPCODE)
    return DNS_PARSE_NOTIMP;
  if (be16(p + 4) != 1)
    return DNS_PARSE_FORMERR;
  size_t pos;
  if (read_name(p, n, DNS_HEADER_SIZE, ret, &pos) < 0 || pos + 4 > n)
    return DNS_PARSE_FORMERR;
  ret->qtype = be16(p + pos);
  ret->qclass = be16(p + pos + 2);
  pos += 4;
  /* Every record the counts claim must be in the packet (each is at least
   * 11 bytes, so the walk ends within N bytes whatever the counts). */
  unsigned records = (unsigned)be16(p + 6) + be16(p + 8) + be16(p + 10);
  for (unsigned i = 0; i < records; i++) {
    pos = skip_name(p, n, pos);
    if (pos == 0 || pos + 10 > n)
      return DNS_PARSE_FORMERR;
    size_t rdlen = be16(p + pos + 8);
    pos += 10;
    if (pos + rdlen > n)
      return DNS_PARSE_FORMERR;
    pos += rdlen;
  }
  ret->has_question = true;
  return DNS_PARSE_OK;
}

size_t dns_build_response(const struct dns_query *q, unsigned rcode, const struct dns_addr *addrs,
                          size_t n_addrs, uint32_t ttl, uint8_t *out, size_t size) {
  size_t len = DNS_HEADER_SIZE + (q->has_question ? q->qname_len + 4 : 0);
  if (len > size)
    return 0;
  unsigned flags = DNS_FLAG_QR | (q->flags & (DNS_FLAG_OPCODE | DNS_FLAG_RD)) | DNS_FLAG_RA |
                   (rcode & 0xfu);
  memset(out, 0, DNS_HEADER_SIZE);
  put16(out, q->id);
  if (q->has_question) {
    put16(out + 4, 1);
    memcpy(out + DNS_HEADER_SIZE, q->qname, q->qname_len);
    put16(out + DNS_HEADER_SIZE + q->qname_len, q->qtype);
    put16(out + DNS_HEADER_SIZE + q->qname_len + 2, q->qclass);
  }
  unsigned answers = 0;
  if (q->has_question && rcode == 0 && q->qclass == DNS_CLASS_IN) {
    size_t want = q->qtype == DNS_TYPE_A ? 4 : q->qtype == DNS_TYPE_AAAA ? 16 : 0;
    for (size_t i = 0; i < n_addrs && want; i++) {
      if (addrs[i].len != want)
        continue;
      if (len + 12 + want > size) {
        flags |= DNS_FLAG_TC;
        break;
      }
      uint8_t *r = out + len;
      put16(r, 0xc000u | DNS_HEADER_SIZE); /* the question's name */
      put16(r + 2, q->qtype);
      put16(r + 4, DNS_CLASS_IN);
      put16(r + 6, ttl >> 16);
      put16(r + 8, ttl & 0xffffu);
      put16(r + 10, (unsigned)want);
      memcpy(r + 12, addrs[i].b, want);
      len += 12 + want;
      answers++;
    }
  }
  put16(out + 2, flags);
  put16(out + 6, answers);
  return len;
}
