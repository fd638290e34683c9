/* fuzz_egress_policy.c: the bytes a sandbox hands the egress broker, and the
 * allow_hosts entries a client hands the server (common/egress_policy.h).
 *
 * Input: u8 which, then the bytes.  which % 4:
 *   0  the first bytes of a stream: TLS SNI and HTTP Host, with every
 *      prefix length the broker could peek at a whole-input multiple of 97
 *      (a result other than MORE must not change when more bytes come,
 *      except that MORE may end in a decision)
 *   1  a name from a DNS query: sanitized (the output is the lowercased
 *      name or "<invalid:N>") and matched against a fixed policy
 *   2  allow_hosts entries, split at '\n', parsed; what parses is
 *      formatted, parsed again and must give the same rule
 *   3  16 or 4 bytes as an address: classified, with a reason for every
 *      class but public */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/egress_policy.h"

static void check(int ok) {
  if (!ok)
    abort();
}

static void peek(const uint8_t *d, size_t n) {
  char out[EGRESS_NAME_BUF], first[EGRESS_NAME_BUF];
  enum egress_peek whole = egress_tls_sni(d, n, out);
  check(strlen(out) < EGRESS_NAME_BUF);
  memcpy(first, out, sizeof out);
  /* A decision seen on a prefix stays the same on the whole. */
  for (size_t cut = 0; cut < n; cut += 97) {
    enum egress_peek r = egress_tls_sni(d, cut, out);
    if (r != EGRESS_PEEK_MORE) {
      check(r == whole);
      check(strcmp(out, first) == 0);
    }
  }
  uint16_t port;
  whole = egress_http_host(d, n, out, &port);
  check(strlen(out) < EGRESS_NAME_BUF);
  if (whole == EGRESS_PEEK_FOUND)
    check(out[0] != '\0');
  memcpy(first, out, sizeof out);
  for (size_t cut = 0; cut < n; cut += 97) {
    uint16_t p2;
    enum egress_peek r = egress_http_host(d, cut, out, &p2);
    if (r != EGRESS_PEEK_MORE && r != EGRESS_PEEK_MALFORMED && whole != EGRESS_PEEK_MALFORMED) {
      check(r == whole);
      check(strcmp(out, first) == 0);
    }
  }
}

static void name(const uint8_t *d, size_t n) {
  char out[EGRESS_NAME_BUF];
  bool ok = egress_name_sanitize(d, n, out);
  check(ok == egress_name_valid((const char *)d, n));
  if (ok) {
    for (const char *p = out; *p; p++)
      check((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '-' || *p == '.');
    check(egress_name_valid(out, strlen(out)));
  } else {
    check(strncmp(out, "<invalid:", 9) == 0);
  }
  static const char *const entries[] = {"pypi.org", "*.example.com:*", "a.b:22"};
  static const size_t lens[] = {8, 15, 6};
  struct egress_policy p;
  char *err = NULL;
  if (egress_policy_parse(entries, lens, 3, &p, &err) != 0)
    abort();
  long m = egress_policy_match(&p, (const char *)d, n, n ? d[0] : 0);
  check(m < 0 || ok);
  check(!egress_policy_knows(&p, (const char *)d, n) || ok);
  egress_policy_free(&p);
}

static void entries(const uint8_t *d, size_t n) {
  const char *e[EGRESS_MAX_RULES + 1];
  size_t l[EGRESS_MAX_RULES + 1], k = 0, start = 0;
  for (size_t i = 0; i <= n && k <= EGRESS_MAX_RULES; i++)
    if (i == n || d[i] == '\n') {
      e[k] = (const char *)d + start;
      l[k++] = i - start;
      start = i + 1;
    }
  struct egress_policy p;
  char *err = NULL;
  if (egress_policy_parse(e, l, k, &p, &err) != 0) {
    check(err && err[0]);
    free(err);
    return;
  }
  for (size_t i = 0; i < p.n; i++) {
    char buf[EGRESS_ENTRY_MAX + 1];
    int w = egress_rule_format(&p.rules[i], buf, sizeof buf);
    check(w > 0 && (size_t)w < sizeof buf);
    struct egress_rule again;
    char *e2 = NULL;
    check(egress_rule_parse(buf, (size_t)w, &again, &e2) == 0);
    check(memcmp(&again.wildcard, &p.rules[i].wildcard, sizeof again.wildcard) == 0);
    check(again.ports == p.rules[i].ports && again.port == p.rules[i].port);
    check(strcmp(again.name, p.rules[i].name) == 0);
  }
  egress_policy_free(&p);
}

static void address(const uint8_t *d, size_t n) {
  uint8_t a[16] = {0};
  memcpy(a, d, n < 16 ? n : 16);
  enum egress_addr_class c = egress_addr_classify(n >= 16 ? AF_INET6 : AF_INET, a);
  check((c == EGRESS_ADDR_PUBLIC) == (egress_addr_reason(c)[0] == '\0'));
  check(!(c == EGRESS_ADDR_PUBLIC && egress_addr_class_private(c)));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0)
    return 0;
  const uint8_t *d = data + 1;
  size_t n = size - 1;
  switch (data[0] % 4) {
  case 0:
    peek(d, n);
    break;
  case 1:
    name(d, n);
    break;
  case 2:
    entries(d, n);
    break;
  case 3:
    address(d, n);
    break;
  }
  return 0;
}
