/* test_egress_policy.c: the broker's pure decisions (common/egress_policy.h):
 * allow_hosts entries and their error messages, matching, address classes
 * with the reason a record carries, names from untrusted code, and the SNI
 * and Host a stream's first bytes name, each against hostile inputs
 * (truncation at every byte, huge lengths, NULs, duplicates). */
#include <arpa/inet.h>
#include <stdint.h>
#include <sys/socket.h>

#include "common/egress_policy.h"
#include "common/util.h"
#include "test.h"

/* ---- entries ------------------------------------------------------------------ */

static bool parses(const char *entry, struct egress_rule *r) {
  char *err = NULL;
  int rc = egress_rule_parse(entry, strlen(entry), r, &err);
  free(err);
  return rc == 0;
}

/* The error for ENTRY contains WANT. */
static void check_refused(const char *entry, size_t len, const char *want) {
  struct egress_rule r;
  char *err = NULL;
  int rc = egress_rule_parse(entry, len, &r, &err);
  CHECK_EQ_INT(rc, -EINVAL);
  if (!err || !strstr(err, want)) {
    fprintf(stderr, "  entry of %zu bytes: error \"%s\", expected it to contain \"%s\"\n", len,
            err ? err : "(null)", want);
    test_failures_++;
  }
  free(err);
}
#define REFUSED(e, want) check_refused((e), strlen(e), (want))

static void test_rule_forms(void) {
  struct egress_rule r;
  CHECK(parses("pypi.org", &r));
  CHECK_STREQ(r.name, "pypi.org");
  CHECK(!r.wildcard);
  CHECK_EQ_INT(r.ports, EGRESS_PORTS_WEB);

  CHECK(parses("Files.PythonHosted.ORG.", &r)); /* case and the trailing dot go */
  CHECK_STREQ(r.name, "files.pythonhosted.org");

  CHECK(parses("*.example.com:8443", &r));
  CHECK(r.wildcard);
  CHECK_STREQ(r.name, "example.com");
  CHECK_EQ_INT(r.ports, EGRESS_PORTS_ONE);
  CHECK_EQ_INT(r.port, 8443);

  CHECK(parses("git.example.com:*", &r));
  CHECK_EQ_INT(r.ports, EGRESS_PORTS_ANY);
  CHECK(parses("a.b:1", &r));
  CHECK_EQ_INT(r.port, 1);
  CHECK(parses("a.b:65535", &r));
  CHECK_EQ_INT(r.port, 65535);
  CHECK(parses("localhost", &r)); /* one label is a name; its address is checked later */
  CHECK(parses("xn--bcher-kva.example", &r)); /* punycode is LDH */
  CHECK_STREQ(r.name, "xn--bcher-kva.example");
  CHECK(parses("1password.com", &r)); /* digits first in a label are fine */
  CHECK(parses("a.b.123abc", &r));     /* a top label that is not all digits */

  /* 63-byte labels and a 253-byte name are the limits. */
  char name[300];
  memset(name, 'a', 63);
  strcpy(name + 63, ".com");
  CHECK(parses(name, &r));
  /* 4 labels of 61 and a dot = 248, then "abcde" = 253 */
  size_t n = 0;
  for (int i = 0; i < 4; i++) {
    memset(name + n, 'b', 61);
    n += 61;
    name[n++] = '.';
  }
  memcpy(name + n, "abcde", 6);
  CHECK_EQ_INT(strlen(name), 253);
  CHECK(parses(name, &r));
  strcat(name, "."); /* the trailing dot does not count */
  CHECK(parses(name, &r));

  char buf[EGRESS_ENTRY_MAX + 1];
  CHECK(parses("*.Example.com:*", &r));
  egress_rule_format(&r, buf, sizeof buf);
  CHECK_STREQ(buf, "*.example.com:*");
  CHECK(parses("pypi.org", &r));
  egress_rule_format(&r, buf, sizeof buf);
  CHECK_STREQ(buf, "pypi.org");
  CHECK(parses("a.b:22", &r));
  egress_rule_format(&r, buf, sizeof buf);
  CHECK_STREQ(buf, "a.b:22");
}

static void test_rule_refusals(void) {
  REFUSED("", "empty");
  REFUSED("foo..com", "allow_hosts entry \"foo..com\": a label is empty");
  REFUSED(".com", "a label is empty");
  REFUSED("foo.com..", "a label is empty");
  REFUSED("-foo.com", "hyphen");
  REFUSED("foo-.com", "hyphen");
  REFUSED("foo_bar.com", "character other than a letter, digit, hyphen or dot");
  REFUSED("bücher.example", "punycode");
  REFUSED("foo.com/path", "character");
  REFUSED("https://foo.com", "the port must be");
  REFUSED("foo.com:", "the port after ':' is empty");
  REFUSED("foo.com:0", "1 to 65535");
  REFUSED("foo.com:65536", "1 to 65535");
  REFUSED("foo.com:99999", "1 to 65535");
  REFUSED("foo.com:123456", "1 to 65535");
  REFUSED("foo.com:080", "leading zeros");
  REFUSED("foo.com:-1", "1 to 65535");
  REFUSED("foo.com:+1", "1 to 65535");
  REFUSED("foo.com:**", "1 to 65535");
  REFUSED("*", "'*' may only stand first");
  REFUSED("*.", "nothing follows");
  REFUSED("*foo.com", "'*' may only stand first");
  REFUSED("a.*.com", "'*' may only stand first");
  REFUSED("*.*.com", "'*' may only stand first");
  REFUSED("**.com", "'*' may only stand first");
  REFUSED("foo.*", "'*' may only stand first");
  REFUSED("*.com", "at least two labels");
  REFUSED("*.com:443", "at least two labels");
  /* IP literals in every spelling. */
  REFUSED("1.2.3.4", "IP address");
  REFUSED("1.2.3.4:443", "IP address");
  REFUSED("127.1", "IP address");
  REFUSED("0x7f000001", "IP address");
  REFUSED("017700000001", "IP address");
  REFUSED("2130706433", "IP address");
  REFUSED("::1", "IP addresses are not accepted");
  REFUSED("[::1]", "IP addresses are not accepted");
  REFUSED("[::1]:443", "IP addresses are not accepted");
  REFUSED("fe80::1", "IP addresses are not accepted");
  REFUSED("2001:db8::1:443", "IP addresses are not accepted");
  REFUSED("a.b:80:", "at most one ':'");
  REFUSED("a.b:*:*", "at most one ':'");
  REFUSED("example.123", "IP address");
  /* Lengths. */
  char name[700];
  memset(name, 'a', 64);
  strcpy(name + 64, ".com");
  REFUSED(name, "longer than 63");
  size_t n = 0;
  for (int i = 0; i < 4; i++) {
    memset(name + n, 'b', 62);
    n += 62;
    name[n++] = '.';
  }
  memcpy(name + n, "abcde", 6); /* 252 + 5 = 257 */
  REFUSED(name, "longer than 253");
  memset(name, 'c', 599);
  name[599] = '\0';
  REFUSED(name, "allow_hosts entry of 599 bytes: it is longer");
  /* A NUL inside: refused and never quoted. */
  check_refused("pypi.org\0evil.com", 17, "allow_hosts entry of 17 bytes: it holds a NUL");
  /* Unprintable or quoting bytes are not echoed. */
  REFUSED("a\"b.com", "allow_hosts entry of 7 bytes");
  REFUSED("a\nb.com", "allow_hosts entry of 7 bytes");
  REFUSED("a b.com", "allow_hosts entry of 7 bytes");
}

static void test_policy_parse(void) {
  const char *e[] = {"pypi.org", "PYPI.org.", "*.pythonhosted.org", "a.b:22"};
  size_t l[] = {8, 9, 18, 6};
  struct egress_policy p = {0};
  char *err = NULL;
  CHECK_EQ_INT(egress_policy_parse(e, l, 4, &p, &err), 0);
  CHECK_EQ_INT(p.n, 3); /* the duplicate is kept once */
  egress_policy_free(&p);
  CHECK(p.rules == NULL);

  const char *bad[] = {"pypi.org", "x..y"};
  size_t bl[] = {8, 4};
  CHECK_EQ_INT(egress_policy_parse(bad, bl, 2, &p, &err), -EINVAL);
  CHECK(err && strstr(err, "allow_hosts[1] \"x..y\": a label is empty"));
  free(err);
  err = NULL;

  const char *many[EGRESS_MAX_RULES + 1];
  size_t ml[EGRESS_MAX_RULES + 1];
  for (size_t i = 0; i <= EGRESS_MAX_RULES; i++) {
    many[i] = "a.b";
    ml[i] = 3;
  }
  CHECK_EQ_INT(egress_policy_parse(many, ml, EGRESS_MAX_RULES + 1, &p, &err), -EINVAL);
  CHECK(err && strstr(err, "at most 256"));
  free(err);
  err = NULL;
  CHECK_EQ_INT(egress_policy_parse(many, ml, EGRESS_MAX_RULES, &p, &err), 0);
  CHECK_EQ_INT(p.n, 1);
  egress_policy_free(&p);

  CHECK_EQ_INT(egress_policy_parse(NULL, NULL, 0, &p, &err), 0);
  CHECK_EQ_INT(p.n, 0);
  CHECK_EQ_INT(egress_policy_match(&p, "a.b", 3, 443), -1);
  egress_policy_free(&p);
}

/* ---- matching ------------------------------------------------------------------ */

static long match(const struct egress_policy *p, const char *name, uint16_t port) {
  return egress_policy_match(p, name, strlen(name), port);
}

static void test_match(void) {
  const char *e[] = {"pypi.org", "*.example.com", "git.host.net:22", "any.host.net:*"};
  size_t l[4];
  for (int i = 0; i < 4; i++)
    l[i] = strlen(e[i]);
  struct egress_policy p;
  char *err = NULL;
  CHECK_EQ_INT(egress_policy_parse(e, l, 4, &p, &err), 0);

  CHECK_EQ_INT(match(&p, "pypi.org", 443), 0);
  CHECK_EQ_INT(match(&p, "pypi.org", 80), 0);
  CHECK_EQ_INT(match(&p, "PyPI.ORG.", 443), 0); /* case, trailing dot */
  CHECK_EQ_INT(match(&p, "pypi.org", 8080), -1);
  CHECK_EQ_INT(match(&p, "pypi.org", 22), -1);
  CHECK_EQ_INT(match(&p, "www.pypi.org", 443), -1); /* no implicit subdomains */
  CHECK_EQ_INT(match(&p, "pypi.org.evil.com", 443), -1);
  CHECK_EQ_INT(match(&p, "evilpypi.org", 443), -1);

  CHECK_EQ_INT(match(&p, "a.example.com", 443), 1);
  CHECK_EQ_INT(match(&p, "a.b.example.com", 80), 1);
  CHECK_EQ_INT(match(&p, "A.Example.Com.", 443), 1);
  CHECK_EQ_INT(match(&p, "example.com", 443), -1); /* not the suffix itself */
  CHECK_EQ_INT(match(&p, "badexample.com", 443), -1);
  CHECK_EQ_INT(match(&p, ".example.com", 443), -1);
  CHECK_EQ_INT(match(&p, "a.example.com.evil", 443), -1);

  CHECK_EQ_INT(match(&p, "git.host.net", 22), 2);
  CHECK_EQ_INT(match(&p, "git.host.net", 443), -1);
  CHECK_EQ_INT(match(&p, "any.host.net", 1), 3);
  CHECK_EQ_INT(match(&p, "any.host.net", 65535), 3);

  /* Names that are not host names match nothing. */
  CHECK_EQ_INT(egress_policy_match(&p, "pypi.org\0x", 10, 443), -1);
  CHECK_EQ_INT(match(&p, "", 443), -1);
  CHECK_EQ_INT(match(&p, "pypi..org", 443), -1);
  CHECK_EQ_INT(egress_policy_match(&p, NULL, 0, 443), -1);

  CHECK(egress_policy_knows(&p, "pypi.org", 8));
  CHECK(egress_policy_knows(&p, "x.example.com", 13));
  CHECK(egress_policy_knows(&p, "git.host.net", 12));
  CHECK(!egress_policy_knows(&p, "example.com", 11));
  CHECK(!egress_policy_knows(&p, "evil.com", 8));
  egress_policy_free(&p);
}

/* ---- names ---------------------------------------------------------------------- */

static void test_sanitize(void) {
  char out[EGRESS_NAME_BUF];
  CHECK(egress_name_sanitize("PyPI.Org.", 9, out));
  CHECK_STREQ(out, "pypi.org");
  CHECK(egress_name_sanitize("xn--80ak6aa92e.com", 18, out));
  CHECK_STREQ(out, "xn--80ak6aa92e.com");
  CHECK(!egress_name_sanitize("evil.com\0.pypi.org", 18, out));
  CHECK_STREQ(out, "<invalid:18>");
  CHECK(!egress_name_sanitize("", 0, out));
  CHECK_STREQ(out, "<invalid:0>");
  CHECK(!egress_name_sanitize(NULL, 5, out));
  CHECK_STREQ(out, "<invalid:5>");
  CHECK(!egress_name_sanitize("a\x1b[31mred.com", 14, out));
  CHECK_STREQ(out, "<invalid:14>");
  CHECK(!egress_name_sanitize("10.0.0.1", 8, out)); /* an address is not a name */
  CHECK_STREQ(out, "<invalid:8>");
  CHECK(!egress_name_sanitize("_dmarc.example.com", 18, out));
  CHECK(!egress_name_sanitize(".", 1, out));
  CHECK(!egress_name_sanitize("a..", 3, out));
  /* DNS tunnelling: a long query is counted, never echoed. */
  char big[70000];
  memset(big, 'a', sizeof big);
  CHECK(!egress_name_sanitize(big, sizeof big, out));
  CHECK_STREQ(out, "<invalid:70000>");
  /* 63-byte labels of base32 data are valid names: kept (the policy refuses them). */
  memset(big, 'q', 63);
  memcpy(big + 63, ".t.example", 11);
  CHECK(egress_name_sanitize(big, 73, out));
  CHECK_EQ_INT(strlen(out), 73);
  CHECK(egress_name_valid("a", 1));
  CHECK(!egress_name_valid("a.1", 3));
  CHECK(egress_name_valid("a1.b2", 5));
}

/* ---- addresses ------------------------------------------------------------------ */

static void check_class(const char *text, enum egress_addr_class want, const char *reason) {
  uint8_t b[16];
  int fam = strchr(text, ':') ? AF_INET6 : AF_INET;
  if (inet_pton(fam, text, b) != 1) {
    fprintf(stderr, "  bad test address %s\n", text);
    test_failures_++;
    return;
  }
  enum egress_addr_class c = egress_addr_classify(fam, b);
  if (c != want || strcmp(egress_addr_reason(c), reason) != 0) {
    fprintf(stderr, "  %s: class %d \"%s\", expected %d \"%s\"\n", text, c,
            egress_addr_reason(c), want, reason);
    test_failures_++;
  }
}
#define PUB(t) check_class((t), EGRESS_ADDR_PUBLIC, "")

static void test_classify_v4(void) {
  PUB("93.184.216.34");
  PUB("8.8.8.8");
  PUB("1.1.1.1");
  PUB("172.15.255.255");
  PUB("172.32.0.0");
  PUB("100.63.255.255");
  PUB("100.128.0.0");
  PUB("192.169.0.1");
  PUB("223.255.255.255");
  check_class("127.0.0.1", EGRESS_ADDR_LOOPBACK, "loopback address");
  check_class("127.255.255.254", EGRESS_ADDR_LOOPBACK, "loopback address");
  check_class("10.0.0.1", EGRESS_ADDR_PRIVATE, "private address");
  check_class("172.16.0.1", EGRESS_ADDR_PRIVATE, "private address");
  check_class("172.31.255.255", EGRESS_ADDR_PRIVATE, "private address");
  check_class("192.168.1.1", EGRESS_ADDR_PRIVATE, "private address");
  check_class("100.64.0.1", EGRESS_ADDR_SHARED, "shared address (carrier-grade NAT)");
  check_class("100.127.255.255", EGRESS_ADDR_SHARED, "shared address (carrier-grade NAT)");
  check_class("169.254.1.1", EGRESS_ADDR_LINK_LOCAL, "link-local address");
  check_class("169.254.169.254", EGRESS_ADDR_METADATA, "metadata address");
  check_class("169.254.170.2", EGRESS_ADDR_METADATA, "metadata address");
  check_class("100.100.100.200", EGRESS_ADDR_METADATA, "metadata address");
  check_class("0.0.0.0", EGRESS_ADDR_UNSPECIFIED, "unspecified address");
  check_class("0.1.2.3", EGRESS_ADDR_THIS_NETWORK, "this-network address");
  check_class("224.0.0.1", EGRESS_ADDR_MULTICAST, "multicast address");
  check_class("239.255.255.250", EGRESS_ADDR_MULTICAST, "multicast address");
  check_class("255.255.255.255", EGRESS_ADDR_BROADCAST, "broadcast address");
  check_class("240.0.0.1", EGRESS_ADDR_RESERVED, "reserved address");
  check_class("192.0.0.8", EGRESS_ADDR_RESERVED, "reserved address");
  check_class("198.18.0.5", EGRESS_ADDR_RESERVED, "reserved address");
  check_class("198.19.255.255", EGRESS_ADDR_RESERVED, "reserved address");
  check_class("192.88.99.1", EGRESS_ADDR_RESERVED, "reserved address");
  check_class("192.0.2.1", EGRESS_ADDR_DOCUMENTATION, "documentation address");
  check_class("198.51.100.7", EGRESS_ADDR_DOCUMENTATION, "documentation address");
  check_class("203.0.113.9", EGRESS_ADDR_DOCUMENTATION, "documentation address");
}

static void test_classify_v6(void) {
  PUB("2606:2800:220:1:248:1893:25c8:1946");
  PUB("2a00:1450:4001:82b::200e");
  PUB("::ffff:93.184.216.34"); /* mapped public is the public v4 */
  PUB("64:ff9b::808:808");     /* NAT64 of 8.8.8.8 */
  PUB("2002:808:808::1");      /* 6to4 of 8.8.8.8 */
  check_class("::", EGRESS_ADDR_UNSPECIFIED, "unspecified address");
  check_class("::1", EGRESS_ADDR_LOOPBACK, "loopback address");
  check_class("fe80::1", EGRESS_ADDR_LINK_LOCAL, "link-local address");
  check_class("febf::1", EGRESS_ADDR_LINK_LOCAL, "link-local address");
  check_class("fec0::1", EGRESS_ADDR_SITE_LOCAL, "site-local address");
  check_class("fc00::1", EGRESS_ADDR_PRIVATE, "private address");
  check_class("fd12:3456::1", EGRESS_ADDR_PRIVATE, "private address");
  check_class("fd00:ec2::254", EGRESS_ADDR_METADATA, "metadata address");
  check_class("ff02::1", EGRESS_ADDR_MULTICAST, "multicast address");
  check_class("2001:db8::1", EGRESS_ADDR_DOCUMENTATION, "documentation address");
  check_class("3fff:fff::1", EGRESS_ADDR_DOCUMENTATION, "documentation address");
  check_class("100::1", EGRESS_ADDR_RESERVED, "reserved address");
  check_class("2001:2::1", EGRESS_ADDR_RESERVED, "reserved address");
  check_class("2001:10::1", EGRESS_ADDR_RESERVED, "reserved address");
  check_class("4000::1", EGRESS_ADDR_RESERVED, "reserved address");
  check_class("::2", EGRESS_ADDR_THIS_NETWORK, "this-network address"); /* compatible 0.0.0.2 */
  /* IPv4 addresses inside IPv6 ones. */
  check_class("::ffff:127.0.0.1", EGRESS_ADDR_LOOPBACK, "loopback address");
  check_class("::ffff:169.254.169.254", EGRESS_ADDR_METADATA, "metadata address");
  check_class("::ffff:10.1.2.3", EGRESS_ADDR_PRIVATE, "private address");
  check_class("::127.0.0.1", EGRESS_ADDR_LOOPBACK, "loopback address");
  check_class("::8.8.8.8", EGRESS_ADDR_RESERVED, "reserved address");
  check_class("::ffff:0:10.0.0.1", EGRESS_ADDR_PRIVATE, "private address");
  check_class("::ffff:0:8.8.8.8", EGRESS_ADDR_RESERVED, "reserved address");
  check_class("64:ff9b::7f00:1", EGRESS_ADDR_LOOPBACK, "loopback address");
  check_class("64:ff9b::a9fe:a9fe", EGRESS_ADDR_METADATA, "metadata address");
  check_class("64:ff9b::c0a8:101", EGRESS_ADDR_PRIVATE, "private address");
  check_class("64:ff9b:1::a00:1", EGRESS_ADDR_NAT64_LOCAL, "local NAT64 address");
  check_class("2002:7f00:1::", EGRESS_ADDR_LOOPBACK, "loopback address");
  check_class("2002:a9fe:a9fe::1", EGRESS_ADDR_METADATA, "metadata address");
  check_class("2002:c0a8:101::1", EGRESS_ADDR_PRIVATE, "private address");
  /* Teredo: server 10.0.0.1; client ~(0x7f000001) = 80ff:fffe. */
  check_class("2001:0:a00:1::1", EGRESS_ADDR_PRIVATE, "private address");
  check_class("2001:0:808:808::80ff:fffe", EGRESS_ADDR_LOOPBACK, "loopback address");
  PUB("2001:0:808:808::f7f7:f7f7"); /* client ~0x08080808 */
}

static void test_classify_private(void) {
  CHECK(!egress_addr_class_private(EGRESS_ADDR_LOOPBACK)); /* only IGN_MCP_NET_PRIVATE=host */
  CHECK(egress_addr_class_private(EGRESS_ADDR_PRIVATE));
  CHECK(egress_addr_class_private(EGRESS_ADDR_SHARED));
  CHECK(egress_addr_class_private(EGRESS_ADDR_LINK_LOCAL));
  CHECK(egress_addr_class_private(EGRESS_ADDR_SITE_LOCAL));
  CHECK(egress_addr_class_private(EGRESS_ADDR_NAT64_LOCAL));
  CHECK(!egress_addr_class_private(EGRESS_ADDR_PUBLIC));
  CHECK(!egress_addr_class_private(EGRESS_ADDR_METADATA));
  CHECK(!egress_addr_class_private(EGRESS_ADDR_UNSPECIFIED));
  CHECK(!egress_addr_class_private(EGRESS_ADDR_THIS_NETWORK));
  CHECK(!egress_addr_class_private(EGRESS_ADDR_MULTICAST));
  CHECK(!egress_addr_class_private(EGRESS_ADDR_BROADCAST));
  CHECK(!egress_addr_class_private(EGRESS_ADDR_DOCUMENTATION));
  CHECK(!egress_addr_class_private(EGRESS_ADDR_RESERVED));
  uint8_t b[4] = {1, 2, 3, 4};
  CHECK_EQ_INT(egress_addr_classify(AF_UNIX, b), EGRESS_ADDR_RESERVED);
}

/* ---- TLS ------------------------------------------------------------------------- */

struct bytes {
  uint8_t b[70000];
  size_t n;
};
static void put8(struct bytes *o, unsigned v) { o->b[o->n++] = (uint8_t)v; }
static void put16(struct bytes *o, unsigned v) {
  put8(o, v >> 8);
  put8(o, v & 0xff);
}
static void put24(struct bytes *o, unsigned v) {
  put8(o, v >> 16);
  put16(o, v & 0xffff);
}
static void putn(struct bytes *o, const void *p, size_t n) {
  memcpy(o->b + o->n, p, n);
  o->n += n;
}

/* A ClientHello body with the extensions block EXT (NULL: none). */
static void hello_body(struct bytes *o, const struct bytes *ext) {
  put16(o, 0x0303);
  for (int i = 0; i < 32; i++)
    put8(o, i);
  put8(o, 32);
  for (int i = 0; i < 32; i++)
    put8(o, 0xa0 + i);
  put16(o, 4);
  put16(o, 0x1301);
  put16(o, 0x1302);
  put8(o, 1);
  put8(o, 0);
  if (ext) {
    put16(o, (unsigned)ext->n);
    putn(o, ext->b, ext->n);
  }
}

/* The server_name extension naming NAME (LEN bytes). */
static void ext_sni(struct bytes *e, const char *name, size_t len) {
  put16(e, 0);
  put16(e, (unsigned)(len + 5));
  put16(e, (unsigned)(len + 3));
  put8(e, 0);
  put16(e, (unsigned)len);
  putn(e, name, len);
}

/* A whole ClientHello record (or records of at most FRAG bytes) around BODY. */
static void hello_records(struct bytes *o, const struct bytes *body, size_t frag) {
  static struct bytes hs;
  hs.n = 0;
  put8(&hs, 1);
  put24(&hs, (unsigned)body->n);
  putn(&hs, body->b, body->n);
  for (size_t off = 0; off < hs.n; off += frag) {
    size_t n = hs.n - off < frag ? hs.n - off : frag;
    put8(o, 22);
    put16(o, 0x0301);
    put16(o, (unsigned)n);
    putn(o, hs.b + off, n);
  }
}

static struct bytes ext, body, rec;

static void make_hello(const char *name, size_t frag) {
  ext.n = body.n = rec.n = 0;
  put16(&ext, 0x000a); /* supported_groups, before the SNI */
  put16(&ext, 4);
  put16(&ext, 2);
  put16(&ext, 0x001d);
  if (name)
    ext_sni(&ext, name, strlen(name));
  put16(&ext, 0x002b); /* supported_versions, after */
  put16(&ext, 3);
  put8(&ext, 2);
  put16(&ext, 0x0304);
  hello_body(&body, &ext);
  hello_records(&rec, &body, frag);
}

static void test_sni(void) {
  char out[EGRESS_NAME_BUF];
  make_hello("PyPI.org", 16384);
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_FOUND);
  CHECK_STREQ(out, "pypi.org");
  /* Every cut before the end waits for more, and decides nothing else. */
  for (size_t cut = 0; cut < rec.n; cut++)
    if (egress_tls_sni(rec.b, cut, out) != EGRESS_PEEK_MORE) {
      fprintf(stderr, "  cut at %zu of %zu is not MORE\n", cut, rec.n);
      test_failures_++;
      break;
    }
  /* Bytes after the ClientHello (early data) change nothing. */
  memset(rec.b + rec.n, 0x17, 100);
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n + 100, out), EGRESS_PEEK_FOUND);

  /* Fragmented over records of 7 bytes (legal, if odd). */
  make_hello("files.pythonhosted.org", 7);
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_FOUND);
  CHECK_STREQ(out, "files.pythonhosted.org");
  for (size_t cut = 0; cut < rec.n; cut++)
    if (egress_tls_sni(rec.b, cut, out) != EGRESS_PEEK_MORE) {
      fprintf(stderr, "  fragmented: cut at %zu of %zu is not MORE\n", cut, rec.n);
      test_failures_++;
      break;
    }

  make_hello(NULL, 16384);
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_ABSENT);
  CHECK_STREQ(out, "");
  /* No extensions block at all. */
  body.n = rec.n = 0;
  hello_body(&body, NULL);
  hello_records(&rec, &body, 16384);
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_ABSENT);

  /* Not TLS. */
  CHECK_EQ_INT(egress_tls_sni((const uint8_t *)"GET / HTTP/1.1\r\n", 16, out), EGRESS_PEEK_OTHER);
  CHECK_EQ_INT(egress_tls_sni((const uint8_t *)"\x16\x10", 2, out), EGRESS_PEEK_OTHER);
  CHECK_EQ_INT(egress_tls_sni((const uint8_t *)"\x13\x03", 2, out), EGRESS_PEEK_OTHER);
  CHECK_EQ_INT(egress_tls_sni((const uint8_t *)"\x19\x03", 2, out), EGRESS_PEEK_OTHER);
  CHECK_EQ_INT(egress_tls_sni((const uint8_t *)"SSH-2.0-x", 9, out), EGRESS_PEEK_OTHER);
  CHECK_EQ_INT(egress_tls_sni((const uint8_t *)"", 0, out), EGRESS_PEEK_MORE);
  CHECK_EQ_INT(egress_tls_sni((const uint8_t *)"\x16", 1, out), EGRESS_PEEK_MORE);
}

/* The same first bytes may go to a server that takes any TLS record
 * header as its first (Go's crypto/tls, behind Caddy and Traefik: a
 * version below 0x1000, warning alerts before the ClientHello dropped): on
 * a port other than 443 they were passed as neither TLS nor HTTP, and such
 * a front end served the SNI's site.  They are TLS: the ClientHello's SNI
 * is checked, and a record before it that is not one is refused. */
static void test_sni_any_first_record(void) {
  char out[EGRESS_NAME_BUF];
  static const uint8_t alerts[][7] = {
      {21, 3, 3, 0, 2, 1, 90}, /* a warning (user_canceled), TLS 1.2's version */
      {21, 0, 1, 0, 2, 1, 90}, /* the same, version 0x0001 */
      {20, 3, 3, 0, 1, 1},     /* a ChangeCipherSpec */
      {23, 3, 3, 0, 2, 0, 0},  /* application data */
      {24, 3, 3, 0, 2, 1, 0},  /* a heartbeat */
  };
  for (size_t i = 0; i < sizeof alerts / sizeof alerts[0]; i++) {
    size_t hn = alerts[i][0] == 20 ? 6 : 7;
    make_hello("evil.test", 16384);
    static struct bytes both;
    both.n = 0;
    putn(&both, alerts[i], hn);
    putn(&both, rec.b, rec.n);
    CHECK_EQ_INT(egress_tls_sni(both.b, both.n, out), EGRESS_PEEK_MALFORMED);
    for (size_t cut = 1; cut < 5; cut++) /* a record header still coming */
      CHECK_EQ_INT(egress_tls_sni(both.b, cut, out), EGRESS_PEEK_MORE);
  }
  /* A ClientHello in records of another version: its SNI, checked. */
  static const unsigned versions[] = {0x0103, 0x0001, 0x0f03, 0x0300};
  for (size_t i = 0; i < sizeof versions / sizeof versions[0]; i++) {
    make_hello("evil.test", 7);
    for (size_t off = 0; off < rec.n; off += 5 + ((size_t)rec.b[off + 3] << 8 | rec.b[off + 4])) {
      rec.b[off + 1] = (uint8_t)(versions[i] >> 8);
      rec.b[off + 2] = (uint8_t)versions[i];
    }
    CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_FOUND);
    CHECK_STREQ(out, "evil.test");
  }
  /* Two bytes a server takes for a record header: wait for the rest. */
  CHECK_EQ_INT(egress_tls_sni((const uint8_t *)"\x16\x02", 2, out), EGRESS_PEEK_MORE);
  CHECK_EQ_INT(egress_tls_sni((const uint8_t *)"\x15\x03", 2, out), EGRESS_PEEK_MORE);
}

/* What the broker needs to hold the bytes after a ClientHello until the
 * server answered, and to check a second ClientHello after a
 * HelloRetryRequest. */
static void test_tls_retry(void) {
  make_hello("good.test", 16384);
  CHECK_EQ_INT((int)egress_tls_hello_end(rec.b, rec.n), (int)rec.n);
  CHECK_EQ_INT((int)egress_tls_hello_end(rec.b, rec.n - 1), (int)rec.n); /* its last bytes coming */
  CHECK_EQ_INT((int)egress_tls_hello_end(rec.b, 20), (int)rec.n); /* its length is known */
  CHECK_EQ_INT((int)egress_tls_hello_end(rec.b, 7), 0);             /* not yet */
  size_t one = rec.n;
  memset(rec.b + rec.n, 0x17, 10); /* what follows it is not part of it */
  CHECK_EQ_INT((int)egress_tls_hello_end(rec.b, one + 10), (int)one);
  make_hello("good.test", 7); /* records of 7 bytes: the end of the last one */
  CHECK_EQ_INT((int)egress_tls_hello_end(rec.b, rec.n), (int)rec.n);

  static const uint8_t random_hrr[32] = {
      0xcf, 0x21, 0xad, 0x74, 0xe5, 0x9a, 0x61, 0x11, 0xbe, 0x1d, 0x8c, 0x02, 0x1e, 0x65, 0xb8, 0x91,
      0xc2, 0xa2, 0x11, 0x16, 0x7a, 0xbb, 0x8c, 0x5e, 0x07, 0x9e, 0x09, 0xe2, 0xc8, 0xa8, 0x33, 0x9c};
  uint8_t sh[43] = {22, 3, 3, 0, 38, 2, 0, 0, 34, 3, 3};
  memcpy(sh + 11, random_hrr, 32);
  CHECK_EQ_INT(egress_tls_hrr(sh, sizeof sh), 1);
  for (size_t cut = 0; cut < sizeof sh; cut++)
    CHECK_EQ_INT(egress_tls_hrr(sh, cut), -1);
  sh[42] ^= 1; /* an ordinary ServerHello */
  CHECK_EQ_INT(egress_tls_hrr(sh, sizeof sh), 0);
  sh[5] = 8; /* not a ServerHello */
  CHECK_EQ_INT(egress_tls_hrr(sh, 6), 0);
  CHECK_EQ_INT(egress_tls_hrr((const uint8_t *)"HTTP/1.1 400", 12), 0);

  static const uint8_t ccs2[] = {20, 3, 3, 0, 1, 1, 20, 3, 3, 0, 1, 1, 22};
  CHECK_EQ_INT((int)egress_tls_skip_ccs(ccs2, sizeof ccs2), 12);
  CHECK_EQ_INT((int)egress_tls_skip_ccs(ccs2, 9), -1);
  CHECK_EQ_INT((int)egress_tls_skip_ccs(ccs2 + 12, 1), 0);
}

static void test_sni_hostile(void) {
  char out[EGRESS_NAME_BUF];
  /* A name with a NUL: malformed, recorded by its length only. */
  ext.n = body.n = rec.n = 0;
  ext_sni(&ext, "pypi.org\0evil", 13);
  hello_body(&body, &ext);
  hello_records(&rec, &body, 16384);
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_MALFORMED);
  CHECK_STREQ(out, "<invalid:13>");

  /* Two host_name entries in one extension. */
  ext.n = body.n = rec.n = 0;
  put16(&ext, 0);
  put16(&ext, 2 + 2 * (3 + 3));
  put16(&ext, 2 * (3 + 3));
  put8(&ext, 0);
  put16(&ext, 3);
  putn(&ext, "a.b", 3);
  put8(&ext, 0);
  put16(&ext, 3);
  putn(&ext, "c.d", 3);
  hello_body(&body, &ext);
  hello_records(&rec, &body, 16384);
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_MALFORMED);

  /* Two server_name extensions. */
  ext.n = body.n = rec.n = 0;
  ext_sni(&ext, "a.b", 3);
  ext_sni(&ext, "c.d", 3);
  hello_body(&body, &ext);
  hello_records(&rec, &body, 16384);
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_MALFORMED);

  /* An empty name, and an empty list. */
  ext.n = body.n = rec.n = 0;
  ext_sni(&ext, "", 0);
  hello_body(&body, &ext);
  hello_records(&rec, &body, 16384);
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_MALFORMED);
  ext.n = body.n = rec.n = 0;
  put16(&ext, 0);
  put16(&ext, 2);
  put16(&ext, 0);
  hello_body(&body, &ext);
  hello_records(&rec, &body, 16384);
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_MALFORMED);

  /* An extension length running past its block. */
  make_hello("a.b", 16384);
  size_t sni_len_at = 5 + 4 + 2 + 32 + 1 + 32 + 2 + 4 + 1 + 1 + 2 + 8 + 2;
  CHECK_EQ_INT(rec.b[sni_len_at] << 8 | rec.b[sni_len_at + 1], 8);
  rec.b[sni_len_at] = 0xff;
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_MALFORMED);

  /* Huge lengths: a record over 2^14, a handshake message over our cap, a
   * session id over 32. */
  const uint8_t big_rec[] = {22, 3, 1, 0x40, 0x01, 1, 0, 0, 10};
  CHECK_EQ_INT(egress_tls_sni(big_rec, sizeof big_rec, out), EGRESS_PEEK_MALFORMED);
  const uint8_t big_hs[] = {22, 3, 1, 0, 4, 1, 0xff, 0xff, 0xff};
  CHECK_EQ_INT(egress_tls_sni(big_hs, sizeof big_hs, out), EGRESS_PEEK_MALFORMED);
  const uint8_t big_hs_cut[] = {22, 3, 1, 0x10, 0, 1, 0x01, 0, 0};
  CHECK_EQ_INT(egress_tls_sni(big_hs_cut, sizeof big_hs_cut, out), EGRESS_PEEK_MALFORMED);
  make_hello("a.b", 16384);
  rec.b[5 + 4 + 2 + 32] = 33;
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_MALFORMED);

  /* Not a ClientHello; an empty record; an alert in the middle. */
  const uint8_t server_hello[] = {22, 3, 3, 0, 4, 2, 0, 0, 0};
  CHECK_EQ_INT(egress_tls_sni(server_hello, sizeof server_hello, out), EGRESS_PEEK_MALFORMED);
  const uint8_t empty_rec[] = {22, 3, 1, 0, 0};
  CHECK_EQ_INT(egress_tls_sni(empty_rec, sizeof empty_rec, out), EGRESS_PEEK_MALFORMED);
  make_hello("a.b", 10);
  rec.b[15] = 21; /* the second record's type */
  CHECK_EQ_INT(egress_tls_sni(rec.b, rec.n, out), EGRESS_PEEK_MALFORMED);

  /* A stream of endless tiny records never decides beyond the peek cap. */
  static uint8_t tiny[EGRESS_PEEK_MAX + 64];
  size_t n = 0;
  tiny[n++] = 22, tiny[n++] = 3, tiny[n++] = 1, tiny[n++] = 0, tiny[n++] = 4;
  tiny[n++] = 1, tiny[n++] = 0, tiny[n++] = 0x3f, tiny[n++] = 0xf0; /* 16368 bytes to come */
  while (n + 6 <= sizeof tiny) {
    tiny[n++] = 22, tiny[n++] = 3, tiny[n++] = 1, tiny[n++] = 0, tiny[n++] = 1;
    tiny[n++] = 0;
  }
  enum egress_peek r = egress_tls_sni(tiny, n, out);
  CHECK(r == EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(egress_tls_sni(tiny, 100, out), EGRESS_PEEK_MORE);

  /* Garbage after a valid record header never reads past LEN (ASan). */
  for (size_t cut = 0; cut < 64; cut++) {
    uint8_t *g = malloc(cut ? cut : 1);
    for (size_t i = 0; i < cut; i++)
      g[i] = (uint8_t)(i == 0 ? 22 : i == 1 ? 3 : 0xff);
    (void)egress_tls_sni(g, cut, out);
    free(g);
  }
}

/* ---- HTTP ------------------------------------------------------------------------ */

static enum egress_peek host_of(const char *req, char out[EGRESS_NAME_BUF], uint16_t *port) {
  return egress_http_host((const uint8_t *)req, strlen(req), out, port);
}

static void test_http(void) {
  char out[EGRESS_NAME_BUF];
  uint16_t port;
  const char *req = "GET /simple/ HTTP/1.1\r\nUser-Agent: pip\r\nHost: PyPI.org\r\n\r\n";
  CHECK_EQ_INT(host_of(req, out, &port), EGRESS_PEEK_FOUND);
  CHECK_STREQ(out, "pypi.org");
  CHECK_EQ_INT(port, 0);
  for (size_t cut = 0; cut < strlen(req); cut++)
    if (egress_http_host((const uint8_t *)req, cut, out, &port) != EGRESS_PEEK_MORE) {
      fprintf(stderr, "  cut at %zu is not MORE\n", cut);
      test_failures_++;
      break;
    }
  CHECK_EQ_INT(host_of("POST /x HTTP/1.0\r\nhOsT:   a.b:8080 \t\r\n\r\nbody", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_STREQ(out, "a.b");
  CHECK_EQ_INT(port, 8080);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: 93.184.216.34\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_STREQ(out, "93.184.216.34");
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: [2001:DB8::1]:81\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_STREQ(out, "2001:db8::1");
  CHECK_EQ_INT(port, 81);
  /* Absolute form: the target's host, which must agree with Host. */
  CHECK_EQ_INT(host_of("GET http://a.b/x HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_EQ_INT(host_of("GET http://evil.com/x HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET HTTP://Evil.com:81?q HTTP/1.0\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_STREQ(out, "evil.com");
  CHECK_EQ_INT(port, 81);
  CHECK_EQ_INT(host_of("GET http://a.b@evil.com/ HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("CONNECT evil.com:443 HTTP/1.1\r\nHost: evil.com:443\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_STREQ(out, "evil.com");
  CHECK_EQ_INT(port, 443);
  CHECK_EQ_INT(host_of("CONNECT evil.com:443 HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  /* No Host and no authority in the target: ABSENT, whatever else the head
   * holds (the broker refuses it on a connection to a name). */
  CHECK_EQ_INT(host_of("GET / HTTP/1.0\r\n\r\n", out, &port), EGRESS_PEEK_ABSENT);
  CHECK_STREQ(out, "");
  CHECK_EQ_INT(port, 0);
  CHECK_EQ_INT(host_of("\r\nGET / HTTP/1.1\r\nAccept: */*\r\nX-Host: evil.com\r\n\r\n", out,
                       &port),
               EGRESS_PEEK_ABSENT);
  CHECK_EQ_INT(host_of("OPTIONS * HTTP/1.1\r\n\r\n", out, &port), EGRESS_PEEK_ABSENT);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost:\r\n\r\n", out, &port), EGRESS_PEEK_MALFORMED);
  /* Not HTTP/1. */
  CHECK_EQ_INT(host_of("\x16\x03\x01", out, &port), EGRESS_PEEK_OTHER);
  CHECK_EQ_INT(host_of("SSH-2.0-OpenSSH\r\n", out, &port), EGRESS_PEEK_OTHER);
  /* SSH's identification with comments has the shape of a request line. */
  CHECK_EQ_INT(host_of("SSH-2.0-OpenSSH_9.6p1 Debian-3ubuntu13.5\r\n", out, &port),
               EGRESS_PEEK_OTHER);
  CHECK_EQ_INT(host_of("SSH-2.0-x / HTTP/1.1\r\nHost: evil.com\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND); /* unless it is a whole request line */
  CHECK_STREQ(out, "evil.com");
  CHECK_EQ_INT(host_of("*1\r\n$4\r\nPING\r\n", out, &port), EGRESS_PEEK_OTHER); /* RESP */
  CHECK_EQ_INT(host_of("PING\r\n", out, &port), EGRESS_PEEK_OTHER);
  CHECK_EQ_INT(host_of("{\"a\": 1}\n", out, &port), EGRESS_PEEK_OTHER);
  CHECK_EQ_INT(host_of(" x", out, &port), EGRESS_PEEK_OTHER);
}

/* Bytes that may be the start of a request are parsed completely and
 * checked, or refused: never passed as "not HTTP". */
static void test_http_fail_closed(void) {
  char out[EGRESS_NAME_BUF];
  uint16_t port;
  /* An absolute-form target of any scheme names the host, as http:// does. */
  CHECK_EQ_INT(host_of("GET xyz://evil.com/ HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET a+b-c.d://Evil.com:81/x HTTP/1.1\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_STREQ(out, "evil.com");
  CHECK_EQ_INT(port, 81);
  CHECK_EQ_INT(host_of("GET ws://a.b/ HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_EQ_INT(host_of("GET xyz://u@evil.com/ HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  /* A target that is neither "/...", "*" nor scheme://authority. */
  CHECK_EQ_INT(host_of("GET xyz:evil.com/ HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET evil.com:80 HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET 1http://evil.com/ HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("OPTIONS * HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  /* Empty lines before the request line are skipped, as servers do. */
  const char *lead = "\r\n\n\r\nGET / HTTP/1.1\r\nHost: evil.com\r\n\r\n";
  CHECK_EQ_INT(host_of(lead, out, &port), EGRESS_PEEK_FOUND);
  CHECK_STREQ(out, "evil.com");
  for (size_t cut = 0; cut < strlen(lead); cut++)
    if (egress_http_host((const uint8_t *)lead, cut, out, &port) != EGRESS_PEEK_MORE) {
      fprintf(stderr, "  cut at %zu is not MORE\n", cut);
      test_failures_++;
      break;
    }
  /* Any token is a method: lowercase, long, unusual. */
  CHECK_EQ_INT(host_of("get / HTTP/1.1\r\nHost: evil.com\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_STREQ(out, "evil.com");
  CHECK_EQ_INT(host_of("ABCDEFGHIJKLMNOPQRSTUVWXYZ / HTTP/1.1\r\nHost: evil.com\r\n\r\n", out,
                       &port),
               EGRESS_PEEK_FOUND);
  CHECK_EQ_INT(host_of("M-SEARCH* / HTTP/1.1\r\nHost: evil.com\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_EQ_INT(egress_http_host((const uint8_t *)"abcdefghijklmnopqrstuvwxyz", 26, out, &port),
               EGRESS_PEEK_MORE);
  /* A line that starts like a request and is cut or unusual is refused. */
  static const char *const bad[] = {
      "GET /\r\n",                             /* HTTP/0.9: a server's default site */
      "GET /\r\nHost: a.b\r\n\r\n",
      "get /a b HTTP/1.1\r\nHost: a.b\r\n\r\n", /* a SP in the target */
      "GET / HTTP/1.2\r\nHost: a.b\r\n\r\n",
      "GET / HTTP/2.0\r\nHost: a.b\r\n\r\n",
      "GET / http/1.1\r\nHost: a.b\r\n\r\n",
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",     /* h2c: its authority is in a frame */
      "GET / HTTP/1.1\nHost: a.b\r\n\r\n",      /* LF alone ends the line */
      "GET\t/ HTTP/1.1\r\nHost: a.b\r\n\r\n",  /* whitespace for SP */
      "GET\f/ HTTP/1.1\r\n",
      "GET /\t HTTP/1.1\r\nHost: a.b\r\n\r\n",
      "GET / HTTP/1.1 \r\nHost: a.b\r\n\r\n",
      "EHLO x\r\n",
      "GET /\r x HTTP/1.1\r\n",
      "\r\nGET /\x7f HTTP/1.1\r\nHost: a.b\r\n\r\n",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
    if (host_of(bad[i], out, &port) != EGRESS_PEEK_MALFORMED) {
      fprintf(stderr, "  bad[%zu] is not MALFORMED\n", i);
      test_failures_++;
    }
  const char nul[] = "GET /\0 HTTP/1.1\r\n";
  CHECK_EQ_INT(egress_http_host((const uint8_t *)nul, sizeof nul - 1, out, &port),
               EGRESS_PEEK_MALFORMED);
  /* Cut at the peek cap: a token, a line, empty lines that never end. */
  static uint8_t big[EGRESS_PEEK_MAX + 10];
  memset(big, 'A', sizeof big);
  CHECK_EQ_INT(egress_http_host(big, EGRESS_PEEK_MAX - 1, out, &port), EGRESS_PEEK_MORE);
  CHECK_EQ_INT(egress_http_host(big, sizeof big, out, &port), EGRESS_PEEK_MALFORMED);
  big[3] = ' ';
  CHECK_EQ_INT(egress_http_host(big, EGRESS_PEEK_MAX - 1, out, &port), EGRESS_PEEK_MORE);
  CHECK_EQ_INT(egress_http_host(big, sizeof big, out, &port), EGRESS_PEEK_MALFORMED);
  memset(big, '\n', sizeof big);
  CHECK_EQ_INT(egress_http_host(big, EGRESS_PEEK_MAX - 1, out, &port), EGRESS_PEEK_MORE);
  CHECK_EQ_INT(egress_http_host(big, sizeof big, out, &port), EGRESS_PEEK_MALFORMED);
}

/* The port a request names (Host's, or the target's) is returned for the
 * broker to compare with the port connected to; two that differ are two
 * destinations. */
static void test_http_ports(void) {
  char out[EGRESS_NAME_BUF];
  uint16_t port;
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: a.b:8443\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_EQ_INT(port, 8443);
  CHECK_EQ_INT(host_of("GET http://a.b:8443/ HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_EQ_INT(port, 8443);
  CHECK_EQ_INT(host_of("GET http://a.b/ HTTP/1.1\r\nHost: a.b:8443\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_EQ_INT(port, 8443);
  CHECK_EQ_INT(host_of("GET http://a.b:80/ HTTP/1.1\r\nHost: a.b:80\r\n\r\n", out, &port),
               EGRESS_PEEK_FOUND);
  CHECK_EQ_INT(port, 80);
  CHECK_EQ_INT(host_of("GET http://a.b:80/ HTTP/1.1\r\nHost: a.b:8443\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("CONNECT a.b:443 HTTP/1.1\r\nHost: a.b:80\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port), EGRESS_PEEK_FOUND);
  CHECK_EQ_INT(port, 0);
}

static void test_http_hostile(void) {
  char out[EGRESS_NAME_BUF];
  uint16_t port;
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: a.b\r\nHost: evil.com\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: a.b\r\n evil.com\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED); /* folded */
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost : a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED); /* space before the colon */
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\nHost: a.b\n\n", out, &port), EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nX: 1\nHost: evil.com\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED); /* bare LF hides a header from some servers */
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nX: 1\rHost: evil.com\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost:\r\n\r\n", out, &port), EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: a.b:0\r\n\r\n", out, &port), EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: a.b:70000\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: a.b:\r\n\r\n", out, &port), EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: [::1\r\n\r\n", out, &port), EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: [a.b]\r\n\r\n", out, &port), EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET / HTTP/1.1\r\nHost: EVIL_NAME.com\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_STREQ(out, "<invalid:13>");
  CHECK_EQ_INT(host_of("GET /a b HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port),
               EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(host_of("GET  HTTP/1.1\r\nHost: a.b\r\n\r\n", out, &port), EGRESS_PEEK_MALFORMED);
  /* A NUL in the head. */
  const char nul[] = "GET / HTTP/1.1\r\nHost: a.b\0evil.com\r\n\r\n";
  CHECK_EQ_INT(egress_http_host((const uint8_t *)nul, sizeof nul - 1, out, &port),
               EGRESS_PEEK_MALFORMED);
  const char nul2[] = "GET / HTTP/1.1\r\nX: \0";
  CHECK_EQ_INT(egress_http_host((const uint8_t *)nul2, sizeof nul2 - 1, out, &port),
               EGRESS_PEEK_MALFORMED);
  /* A head longer than the peek cap never ends: malformed at the cap. */
  static uint8_t big[EGRESS_PEEK_MAX + 100];
  size_t n = (size_t)snprintf((char *)big, sizeof big, "GET / HTTP/1.1\r\nX: ");
  memset(big + n, 'x', sizeof big - n);
  CHECK_EQ_INT(egress_http_host(big, EGRESS_PEEK_MAX - 1, out, &port), EGRESS_PEEK_MORE);
  CHECK_EQ_INT(egress_http_host(big, EGRESS_PEEK_MAX, out, &port), EGRESS_PEEK_MALFORMED);
  CHECK_EQ_INT(egress_http_host(big, sizeof big, out, &port), EGRESS_PEEK_MALFORMED);
  /* A request line that never ends. */
  n = (size_t)snprintf((char *)big, sizeof big, "GET /");
  memset(big + n, 'a', sizeof big - n);
  CHECK_EQ_INT(egress_http_host(big, sizeof big, out, &port), EGRESS_PEEK_MALFORMED);
  /* A Host after the head (in the body) is not the request's. */
  CHECK_EQ_INT(host_of("GET / HTTP/1.0\r\n\r\nHost: evil.com\r\n\r\n", out, &port),
               EGRESS_PEEK_ABSENT);
}

/* Request rules: "host[:port] METHOD [/prefix]". */
static void test_request_rules(void) {
  const char *e[] = {"api.x.test GET /repos/me/", "api.x.test:8443 * /v1/", "up.x.test POST",
                     "plain.x.test"};
  size_t l[4];
  for (int i = 0; i < 4; i++)
    l[i] = strlen(e[i]);
  struct egress_policy p = {0};
  char *err = NULL;
  CHECK_EQ_INT(egress_policy_parse(e, l, 4, &p, &err), 0);
  char buf[EGRESS_ENTRY_MAX + 1];
  egress_rule_format(&p.rules[0], buf, sizeof buf);
  CHECK_STREQ(buf, "api.x.test GET /repos/me/");
  egress_rule_format(&p.rules[2], buf, sizeof buf);
  CHECK_STREQ(buf, "up.x.test POST");
  /* Connections: a request rule admits its host and port. */
  CHECK_EQ_INT(egress_policy_match(&p, "api.x.test", 10, 443), 0);
  CHECK(egress_policy_requests_checked(&p, "api.x.test", 10, 443));
  CHECK(!egress_policy_requests_checked(&p, "plain.x.test", 12, 443));
  CHECK(!egress_policy_requests_checked(&p, "other.test", 10, 443));
  /* Requests. */
  const struct egress_rule *r0 = &p.rules[0];
  CHECK(egress_request_refusal(r0, 1, "GET", "/repos/me/x?y=1") == NULL);
  CHECK(egress_request_refusal(r0, 1, "GET", "/repos/me/") == NULL);
  CHECK(egress_request_refusal(r0, 1, "POST", "/repos/me/x") != NULL);
  CHECK(egress_request_refusal(r0, 1, "GET", "/repos/other/x") != NULL);
  CHECK(egress_request_refusal(r0, 1, "GET", "/repos?/me/") != NULL);
  CHECK(egress_request_refusal(r0, 1, "GET", "/repos/me/../other") != NULL);
  CHECK(egress_request_refusal(r0, 1, "GET", "/repos/me/%2e%2e/other") != NULL);
  CHECK(egress_request_refusal(r0, 1, "GET", "/repos/me/..%2Fother") != NULL);
  CHECK(egress_request_refusal(r0, 1, "GET", "/repos/me/.") != NULL);
  CHECK(egress_request_refusal(r0, 1, "GET", "/repos/me/#/../../admin") != NULL);
  CHECK(egress_request_refusal(r0, 1, "GET", "/repos/me/..;/admin") != NULL);
  CHECK(egress_request_refusal(&p.rules[1], 1, "DELETE", "/v1/a") == NULL);
  CHECK(egress_request_refusal(&p.rules[2], 1, "POST", "/anything") == NULL);
  CHECK(egress_request_refusal(&p.rules[2], 1, "GET", "/anything") != NULL);
  egress_policy_free(&p);
  /* Refused: a method that is not one, a path that is not canonical. */
  const char *bad[] = {"a.test get /x", "a.test GET x", "a.test GET /a/../b", "a.test GET /a?b",
                       "a.test  GET", "a.test GET /a b", "a.test GETTTTTTTTTTTTTTTT"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    size_t bl = strlen(bad[i]);
    CHECK_EQ_INT(egress_policy_parse(&bad[i], &bl, 1, &p, &err), -EINVAL);
    free(err);
    err = NULL;
  }
}

TEST_MAIN(TEST(test_request_rules), TEST(test_rule_forms), TEST(test_rule_refusals), TEST(test_policy_parse),
          TEST(test_match), TEST(test_sanitize), TEST(test_classify_v4), TEST(test_classify_v6),
          TEST(test_classify_private), TEST(test_sni), TEST(test_sni_any_first_record), TEST(test_tls_retry),
          TEST(test_sni_hostile), TEST(test_http), TEST(test_http_hostile),
          TEST(test_http_fail_closed), TEST(test_http_ports))
