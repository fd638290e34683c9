/* egress_policy.c: the broker's pure decisions (see egress_policy.h):
 * host names, allow_hosts rules and address classes.  What the first bytes
 * of a stream say they are for (TLS SNI, HTTP Host) is egress_peek.c.
 *
 * Everything that reads bytes from a sandbox (a name in a DNS query, the
 * first bytes of a stream) is bounded by the caps in the header and reads
 * only within the LEN it is given: the inputs are not NUL-terminated and may
 * hold anything.  Names leave this file only as egress_name_sanitize makes
 * them, so a record or a log line never echoes what a sandbox made up. */
#include "common/egress_policy.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/util.h"

/* ---- host names ------------------------------------------------------------ */

static bool is_ldh(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
}

/* Whether NAME (LEN bytes, no trailing dot, LDH checked) is something
 * inet_aton or inet_pton takes for an address: "1.2.3.4", "0x7f000001",
 * "127.1", "017700000001".  getaddrinfo would resolve such a "name" without
 * asking DNS, so it is never a host name here. */
static bool looks_numeric(const char *name, size_t len) {
  char buf[EGRESS_NAME_MAX + 1];
  if (len > EGRESS_NAME_MAX)
    return false;
  memcpy(buf, name, len);
  buf[len] = '\0';
  struct in_addr a;
  return inet_aton(buf, &a) != 0;
}

/* Why NAME (LEN bytes, one trailing dot allowed) is not a host name, or NULL
 * when it is.  *RET_LEN is its length without the trailing dot. */
static const char *name_problem(const char *name, size_t len, size_t *ret_len) {
  if (len == 0)
    return "the name is empty";
  if (len > 1 && name[len - 1] == '.')
    len--;
  if (len > EGRESS_NAME_MAX)
    return "the name is longer than 253 bytes";
  size_t label_start = 0;
  bool last_all_digits = true;
  for (size_t i = 0; i <= len; i++) {
    if (i == len || name[i] == '.') {
      size_t n = i - label_start;
      if (n == 0)
        return "a label is empty (a host name is labels of 1 to 63 letters, digits or hyphens "
               "separated by dots)";
      if (n > EGRESS_LABEL_MAX)
        return "a label is longer than 63 bytes";
      if (name[label_start] == '-' || name[i - 1] == '-')
        return "a label starts or ends with a hyphen";
      label_start = i + 1;
      continue;
    }
    unsigned char c = (unsigned char)name[i];
    if (!is_ldh(c))
      return "it holds a character other than a letter, digit, hyphen or dot (write an "
             "internationalized name in its punycode form, xn--...)";
    if (i == label_start)
      last_all_digits = true;
    if (!ascii_is_digit(c))
      last_all_digits = false;
  }
  /* RFC 3696 2: no top-level domain is all digits; a name ending in one is
   * an address in disguise. */
  if (last_all_digits || looks_numeric(name, len))
    return "it is an IP address, not a host name";
  *ret_len = len;
  return NULL;
}

bool egress_name_valid(const char *name, size_t len) {
  size_t n;
  return name && name_problem(name, len, &n) == NULL;
}

/* Lowercased copy of the first LEN bytes of NAME into OUT (LEN + 1 bytes). */
static void copy_lower(char *out, const char *name, size_t len) {
  for (size_t i = 0; i < len; i++)
    out[i] = ascii_lower(name[i]);
  out[len] = '\0';
}

bool egress_name_sanitize(const void *name, size_t len, char out[EGRESS_NAME_BUF]) {
  size_t n;
  if (name && name_problem(name, len, &n) == NULL) {
    copy_lower(out, name, n);
    return true;
  }
  snprintf(out, EGRESS_NAME_BUF, "<invalid:%zu>", len);
  return false;
}

/* ---- allow_hosts entries ----------------------------------------------------- */

/* An entry as an error message may quote it: printable ASCII only, and not
 * longer than any valid entry; anything else is described by its length. */
static void describe_entry(const char *entry, size_t len, char *out, size_t size) {
  bool printable = len <= EGRESS_ENTRY_MAX;
  for (size_t i = 0; printable && i < len; i++)
    printable = entry[i] > 0x20 && entry[i] < 0x7f && entry[i] != '"' && entry[i] != '\\';
  if (printable)
    snprintf(out, size, "\"%.*s\"", (int)len, entry);
  else
    snprintf(out, size, "of %zu bytes", len);
}

/* Why PATH (N bytes) is not a canonical path (a fixed string), or NULL. */
static const char *path_problem(const char *path, size_t n) {
  if (!n || path[0] != '/')
    return "a path starts with '/'";
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)path[i];
    if (c <= 0x20 || c >= 0x7f || c == '\\')
      return "path not canonical: it holds a space, a control byte, a backslash or a non-ASCII byte";
    if (c == '%' && i + 2 < n && path[i + 1] == '2' && strchr("eEfF", path[i + 2]))
      return "path not canonical: an encoded '.' or '/'";
    if (c == '%' && i + 2 < n && path[i + 1] == '5' && strchr("cC", path[i + 2]))
      return "path not canonical: an encoded backslash";
    if (c == '#')
      return "path not canonical: a '#'";
    if (c == '/') {
      size_t k = i + 1;
      size_t dots = 0;
      while (k < n && path[k] == '.')
        k++, dots++;
      /* "/..;/" too: some servers drop what follows a ';' in a segment. */
      if ((dots == 1 || dots == 2) && (k == n || path[k] == '/' || path[k] == ';'))
        return "path not canonical: a '.' or '..' segment";
    }
  }
  return NULL;
}

/* The " METHOD [/prefix]" part of a request rule (P, N bytes after the
 * space) into R: why not, or NULL. */
static const char *request_part(const char *p, size_t n, struct egress_rule *r) {
  const char *sp = memchr(p, ' ', n);
  size_t ml = sp ? (size_t)(sp - p) : n;
  if (ml == 0 || ml > EGRESS_METHOD_MAX)
    return "a request rule is \"host METHOD /prefix\": the method is missing or too long";
  bool star = ml == 1 && p[0] == '*';
  for (size_t i = 0; i < ml && !star; i++)
    if (p[i] < 'A' || p[i] > 'Z')
      return "a request rule's method is * or upper-case letters (GET, POST, ...)";
  memcpy(r->method, p, ml);
  r->method[ml] = '\0';
  if (!sp)
    return NULL;
  const char *path = sp + 1;
  size_t pl = n - ml - 1;
  if (pl > EGRESS_PATH_MAX)
    return "a request rule's path prefix is longer than 256 bytes";
  const char *why = path_problem(path, pl);
  if (why)
    return why;
  if (memchr(path, '?', pl) || memchr(path, '#', pl))
    return "a request rule's path prefix holds no query or fragment";
  memcpy(r->path, path, pl);
  r->path[pl] = '\0';
  return NULL;
}

/* Why ENTRY is not a valid rule (a fixed string), or NULL with *RET filled. */
static const char *rule_problem(const char *entry, size_t len, struct egress_rule *ret) {
  struct egress_rule r = {.ports = EGRESS_PORTS_WEB};
  if (len == 0)
    return "an entry is a host name or *.domain, optionally with :port or :*; this one is empty";
  if (len > EGRESS_ENTRY_MAX)
    return "it is longer than any host name with a port and a request rule";
  if (memchr(entry, '\0', len))
    return "it holds a NUL byte";
  /* "host[:port] METHOD [/prefix]": a request rule. */
  const char *space = memchr(entry, ' ', len);
  if (space) {
    const char *why = request_part(space + 1, len - (size_t)(space - entry) - 1, &r);
    if (why)
      return why;
    len = (size_t)(space - entry);
    if (len > EGRESS_NAME_MAX + 2u + 6u + 1u)
      return "it is longer than any host name with a port";
  }
  if (entry[0] == '[')
    return "IP addresses are not accepted: name the host (use network \"open\" to reach "
           "any public address)";
  /* Names hold no ':', so the first one starts the port; a second one is an
   * IPv6 address. */
  const char *colon = memchr(entry, ':', len);
  size_t name_len = colon ? (size_t)(colon - entry) : len;
  if (colon) {
    const char *port = colon + 1;
    size_t plen = len - name_len - 1;
    if (memchr(port, ':', plen)) {
      char buf[EGRESS_ENTRY_MAX + 1];
      struct in6_addr a6;
      memcpy(buf, entry, len);
      buf[len] = '\0';
      if (inet_pton(AF_INET6, buf, &a6) == 1)
        return "IP addresses are not accepted: name the host (use network \"open\" to reach "
               "any public address)";
      return "an entry has at most one ':', before its port";
    }
    if (plen == 1 && port[0] == '*') {
      r.ports = EGRESS_PORTS_ANY;
    } else {
      if (plen == 0)
        return "the port after ':' is empty (give a port from 1 to 65535, or * for every port)";
      if (plen > 5 || port[0] == '0')
        return "the port must be a decimal number from 1 to 65535 without leading zeros, or *";
      unsigned v = 0;
      for (size_t i = 0; i < plen; i++) {
        if (!ascii_is_digit((unsigned char)port[i]))
          return "the port must be a decimal number from 1 to 65535 without leading zeros, or *";
        v = v * 10 + (unsigned)(port[i] - '0');
      }
      if (v == 0 || v > 65535)
        return "the port must be a decimal number from 1 to 65535 without leading zeros, or *";
      r.ports = EGRESS_PORTS_ONE;
      r.port = (uint16_t)v;
    }
  }
  const char *name = entry;
  if (name_len >= 2 && name[0] == '*' && name[1] == '.') {
    r.wildcard = true;
    name += 2;
    name_len -= 2;
  }
  if (memchr(name, '*', name_len) || (name_len == 1 && name[0] == '*'))
    return "'*' may only stand first, as in *.example.com (it matches names below "
           "example.com, not example.com itself)";
  if (name_len == 0)
    return r.wildcard ? "nothing follows '*.'" : "the host name is empty";
  {
    char buf[EGRESS_ENTRY_MAX + 1];
    memcpy(buf, name, name_len);
    buf[name_len] = '\0';
    struct in6_addr a6;
    if (inet_pton(AF_INET6, buf, &a6) == 1)
      return "IP addresses are not accepted: name the host (use network \"open\" to reach "
             "any public address)";
  }
  size_t n;
  const char *why = name_problem(name, name_len, &n);
  if (why)
    return why;
  if (r.wildcard && !memchr(name, '.', n))
    return "a wildcard needs a domain of at least two labels (*.example.com, not *.com)";
  copy_lower(r.name, name, n);
  *ret = r;
  return NULL;
}

int egress_rule_parse(const char *entry, size_t len, struct egress_rule *ret, char **ret_err) {
  struct egress_rule r;
  const char *why = rule_problem(entry, len, &r);
  if (why) {
    char what[EGRESS_ENTRY_MAX + 8];
    describe_entry(entry, len, what, sizeof what);
    *ret_err = xasprintf("allow_hosts entry %s: %s", what, why);
    return -EINVAL;
  }
  *ret = r;
  return 0;
}

static bool rule_eq(const struct egress_rule *a, const struct egress_rule *b) {
  return a->wildcard == b->wildcard && a->ports == b->ports && a->port == b->port &&
         strcmp(a->name, b->name) == 0 && strcmp(a->method, b->method) == 0 &&
         strcmp(a->path, b->path) == 0 && a->implied == b->implied;
}

bool egress_rule_same(const struct egress_rule *a, const struct egress_rule *b) { return rule_eq(a, b); }

int egress_policy_parse(const char *const *entries, const size_t *lens, size_t n,
                        struct egress_policy *ret, char **ret_err) {
  if (n > EGRESS_MAX_RULES) {
    *ret_err = xasprintf("allow_hosts has %zu entries; at most %u are accepted", n,
                         EGRESS_MAX_RULES);
    return -EINVAL;
  }
  struct egress_rule *rules = n ? calloc(n, sizeof *rules) : NULL;
  if (n && !rules) {
    *ret_err = strdup("out of memory");
    return -ENOMEM;
  }
  size_t kept = 0;
  for (size_t i = 0; i < n; i++) {
    struct egress_rule r;
    const char *why = rule_problem(entries[i], lens[i], &r);
    if (why) {
      char what[EGRESS_ENTRY_MAX + 8];
      describe_entry(entries[i], lens[i], what, sizeof what);
      *ret_err = xasprintf("allow_hosts[%zu] %s: %s", i, what, why);
      free(rules);
      return -EINVAL;
    }
    bool dup = false;
    for (size_t j = 0; j < kept && !dup; j++)
      dup = rule_eq(&rules[j], &r);
    if (!dup)
      rules[kept++] = r;
  }
  ret->rules = rules;
  ret->n = kept;
  return 0;
}

void egress_policy_free(struct egress_policy *p) {
  free(p->rules);
  p->rules = NULL;
  p->n = 0;
}

int egress_rule_format(const struct egress_rule *r, char *buf, size_t size) {
  const char *star = r->wildcard ? "*." : "";
  const char *sp1 = *r->method ? " " : "", *sp2 = *r->path ? " " : "";
  switch (r->ports) {
  case EGRESS_PORTS_ONE:
    return snprintf(buf, size, "%s%s:%u%s%s%s%s", star, r->name, (unsigned)r->port, sp1, r->method,
                    sp2, r->path);
  case EGRESS_PORTS_ANY:
    return snprintf(buf, size, "%s%s:*%s%s%s%s", star, r->name, sp1, r->method, sp2, r->path);
  case EGRESS_PORTS_WEB:
  default:
    return snprintf(buf, size, "%s%s%s%s%s%s", star, r->name, sp1, r->method, sp2, r->path);
  }
}

static bool rule_name_matches(const struct egress_rule *r, const char *name, size_t n) {
  size_t sl = strlen(r->name);
  if (!r->wildcard)
    return n == sl && memcmp(name, r->name, n) == 0;
  /* Strictly below the suffix: at least one label and a dot before it. */
  return n > sl + 1 && name[n - sl - 1] == '.' && memcmp(name + n - sl, r->name, sl) == 0;
}

static bool rule_port_matches(const struct egress_rule *r, uint16_t port) {
  switch (r->ports) {
  case EGRESS_PORTS_WEB:
    return port == 80 || port == 443;
  case EGRESS_PORTS_ONE:
    return port == r->port;
  case EGRESS_PORTS_ANY:
    return true;
  }
  return false;
}

/* The normalized NAME into BUF, its length; -1 when it is not a host name. */
static long normalize(const char *name, size_t len, char buf[EGRESS_NAME_MAX + 1]) {
  size_t n;
  if (!name || name_problem(name, len, &n))
    return -1;
  copy_lower(buf, name, n);
  return (long)n;
}

long egress_policy_match(const struct egress_policy *p, const char *name, size_t len,
                         uint16_t port) {
  char buf[EGRESS_NAME_MAX + 1];
  long n = normalize(name, len, buf);
  if (n < 0)
    return -1;
  for (size_t i = 0; i < p->n; i++)
    if (rule_port_matches(&p->rules[i], port) && rule_name_matches(&p->rules[i], buf, (size_t)n))
      return (long)i;
  return -1;
}

bool egress_rule_admits(const struct egress_rule *r, const char *name, size_t len, uint16_t port) {
  return rule_port_matches(r, port) && rule_name_matches(r, name, len);
}

bool egress_policy_requests_checked(const struct egress_policy *p, const char *name, size_t len,
                                    uint16_t port) {
  char buf[EGRESS_NAME_MAX + 1];
  long n = normalize(name, len, buf);
  bool any = false;
  for (size_t i = 0; n >= 0 && i < p->n; i++)
    if (!p->rules[i].implied && egress_rule_admits(&p->rules[i], buf, (size_t)n, port)) {
      if (!*p->rules[i].method)
        return false; /* a plain rule of its own admits every request */
      any = true;
    }
  return any;
}

const char *egress_request_refusal(const struct egress_rule *r, size_t n, const char *method,
                                   const char *target) {
  size_t pl = strcspn(target, "?");
  const char *why = path_problem(target, pl);
  if (why)
    return why;
  for (size_t i = 0; i < n; i++) {
    if (r[i].implied)
      continue;
    if (!*r[i].method)
      return NULL;
    if ((strcmp(r[i].method, "*") == 0 || strcmp(r[i].method, method) == 0) &&
        strncmp(target, r[i].path, strlen(r[i].path)) == 0 && strlen(r[i].path) <= pl)
      return NULL;
  }
  return "request not in allow_hosts";
}

bool egress_policy_knows(const struct egress_policy *p, const char *name, size_t len) {
  char buf[EGRESS_NAME_MAX + 1];
  long n = normalize(name, len, buf);
  if (n < 0)
    return false;
  for (size_t i = 0; i < p->n; i++)
    if (rule_name_matches(&p->rules[i], buf, (size_t)n))
      return true;
  return false;
}

/* ---- addresses ---------------------------------------------------------------- */

static bool in4(uint32_t a, uint32_t net, unsigned bits) {
  uint32_t mask = bits == 0 ? 0 : 0xffffffffu << (32 - bits);
  return (a & mask) == net;
}

static enum egress_addr_class classify4(uint32_t a) {
  if (a == 0xffffffffu)
    return EGRESS_ADDR_BROADCAST;
  if (a == 0)
    return EGRESS_ADDR_UNSPECIFIED;
  /* Instance metadata: AWS, GCP, Azure, OpenStack (169.254.169.254), AWS
   * ECS task metadata (169.254.170.2), Alibaba (100.100.100.200).  Checked
   * before their ranges so the record names them. */
  if (a == 0xa9fea9feu || a == 0xa9feaa02u || a == 0x646464c8u)
    return EGRESS_ADDR_METADATA;
  if (in4(a, 0x00000000u, 8))
    return EGRESS_ADDR_THIS_NETWORK;
  if (in4(a, 0x7f000000u, 8))
    return EGRESS_ADDR_LOOPBACK;
  if (in4(a, 0x0a000000u, 8) || in4(a, 0xac100000u, 12) || in4(a, 0xc0a80000u, 16))
    return EGRESS_ADDR_PRIVATE;
  if (in4(a, 0x64400000u, 10))
    return EGRESS_ADDR_SHARED;
  if (in4(a, 0xa9fe0000u, 16))
    return EGRESS_ADDR_LINK_LOCAL;
  if (in4(a, 0xe0000000u, 4))
    return EGRESS_ADDR_MULTICAST;
  if (in4(a, 0xf0000000u, 4))
    return EGRESS_ADDR_RESERVED;
  if (in4(a, 0xc0000200u, 24) || in4(a, 0xc6336400u, 24) || in4(a, 0xcb007100u, 24))
    return EGRESS_ADDR_DOCUMENTATION;
  /* IETF protocol assignments, benchmarking (also where the sandbox's DNS
   * answers point: docs/egress-design.md), the retired 6to4 relay anycast. */
  if (in4(a, 0xc0000000u, 24) || in4(a, 0xc6120000u, 15) || in4(a, 0xc0586300u, 24))
    return EGRESS_ADDR_RESERVED;
  return EGRESS_ADDR_PUBLIC;
}

static uint32_t be32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static bool zero(const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i])
      return false;
  return true;
}

static enum egress_addr_class classify6(const uint8_t *b) {
  static const uint8_t aws_metadata[16] = {0xfd, 0x00, 0x0e, 0xc2, [14] = 0x02, [15] = 0x54};
  if (zero(b, 15) && b[15] == 0)
    return EGRESS_ADDR_UNSPECIFIED;
  if (zero(b, 15) && b[15] == 1)
    return EGRESS_ADDR_LOOPBACK;
  /* ::ffff:a.b.c.d reaches a.b.c.d from a dual-stack socket: its class. */
  if (zero(b, 10) && b[10] == 0xff && b[11] == 0xff)
    return classify4(be32(b + 12));
  /* IPv4-compatible (::a.b.c.d) and SIIT (::ffff:0:a.b.c.d): deprecated or
   * for translators only; nobody routes them to the v4 address. */
  if (zero(b, 12) || (zero(b, 8) && b[8] == 0xff && b[9] == 0xff && b[10] == 0 && b[11] == 0)) {
    enum egress_addr_class c = classify4(be32(b + 12));
    return c != EGRESS_ADDR_PUBLIC ? c : EGRESS_ADDR_RESERVED;
  }
  /* NAT64, well-known prefix 64:ff9b::/96: a translator on the host's
   * network would reach the v4 address. */
  if (b[0] == 0x00 && b[1] == 0x64 && b[2] == 0xff && b[3] == 0x9b && zero(b + 4, 8))
    return classify4(be32(b + 12));
  if (b[0] == 0x00 && b[1] == 0x64 && b[2] == 0xff && b[3] == 0x9b && b[4] == 0 && b[5] == 1)
    return EGRESS_ADDR_NAT64_LOCAL;
  /* Discard-only 100::/64. */
  if (b[0] == 0x01 && b[1] == 0x00 && zero(b + 2, 6))
    return EGRESS_ADDR_RESERVED;
  if (b[0] == 0xff)
    return EGRESS_ADDR_MULTICAST;
  if (b[0] == 0xfe && (b[1] & 0xc0) == 0x80)
    return EGRESS_ADDR_LINK_LOCAL;
  if (b[0] == 0xfe && (b[1] & 0xc0) == 0xc0)
    return EGRESS_ADDR_SITE_LOCAL;
  if (memcmp(b, aws_metadata, 16) == 0)
    return EGRESS_ADDR_METADATA;
  if ((b[0] & 0xfe) == 0xfc)
    return EGRESS_ADDR_PRIVATE;
  /* 6to4 2002:V4ADDR::/48. */
  if (b[0] == 0x20 && b[1] == 0x02)
    return classify4(be32(b + 2));
  if (b[0] == 0x20 && b[1] == 0x01 && b[2] == 0x00 && b[3] == 0x00) {
    /* Teredo 2001:0:SERVER:flags:port:~CLIENT: either end refused is refused. */
    enum egress_addr_class c = classify4(be32(b + 4));
    if (c != EGRESS_ADDR_PUBLIC)
      return c;
    return classify4(~be32(b + 12));
  }
  if (b[0] == 0x20 && b[1] == 0x01 && b[2] == 0x0d && b[3] == 0xb8)
    return EGRESS_ADDR_DOCUMENTATION;
  if (b[0] == 0x3f && b[1] == 0xff && (b[2] & 0xf0) == 0x00)
    return EGRESS_ADDR_DOCUMENTATION; /* 3fff::/20 */
  /* Benchmarking 2001:2::/48, ORCHID 2001:10::/28 and ORCHIDv2 2001:20::/28. */
  if (b[0] == 0x20 && b[1] == 0x01 &&
      ((b[2] == 0x00 && b[3] == 0x02 && b[4] == 0 && b[5] == 0) ||
       (b[2] == 0x00 && (b[3] & 0xf0) == 0x10) || (b[2] == 0x00 && (b[3] & 0xf0) == 0x20)))
    return EGRESS_ADDR_RESERVED;
  /* Global unicast is 2000::/3; the rest is unassigned. */
  if ((b[0] & 0xe0) != 0x20)
    return EGRESS_ADDR_RESERVED;
  return EGRESS_ADDR_PUBLIC;
}

enum egress_addr_class egress_addr_classify(int family, const void *addr) {
  if (family == AF_INET)
    return classify4(be32(addr));
  if (family == AF_INET6)
    return classify6(addr);
  return EGRESS_ADDR_RESERVED;
}

const char *egress_addr_reason(enum egress_addr_class c) {
  switch (c) {
  case EGRESS_ADDR_PUBLIC:
    return "";
  case EGRESS_ADDR_LOOPBACK:
    return "loopback address";
  case EGRESS_ADDR_PRIVATE:
    return "private address";
  case EGRESS_ADDR_SHARED:
    return "shared address (carrier-grade NAT)";
  case EGRESS_ADDR_LINK_LOCAL:
    return "link-local address";
  case EGRESS_ADDR_SITE_LOCAL:
    return "site-local address";
  case EGRESS_ADDR_METADATA:
    return "metadata address";
  case EGRESS_ADDR_UNSPECIFIED:
    return "unspecified address";
  case EGRESS_ADDR_THIS_NETWORK:
    return "this-network address";
  case EGRESS_ADDR_MULTICAST:
    return "multicast address";
  case EGRESS_ADDR_BROADCAST:
    return "broadcast address";
  case EGRESS_ADDR_DOCUMENTATION:
    return "documentation address";
  case EGRESS_ADDR_RESERVED:
    return "reserved address";
  case EGRESS_ADDR_NAT64_LOCAL:
    return "local NAT64 address";
  }
  return "reserved address";
}

bool egress_addr_class_private(enum egress_addr_class c) {
  switch (c) {
  case EGRESS_ADDR_PRIVATE:
  case EGRESS_ADDR_SHARED:
  case EGRESS_ADDR_LINK_LOCAL:
  case EGRESS_ADDR_SITE_LOCAL:
  case EGRESS_ADDR_NAT64_LOCAL:
    return true;
  default:
    return false;
  }
}
