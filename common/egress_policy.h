/* egress_policy.h: the pure decisions of the egress broker (docs/egress-design.md):
 * allow_hosts entries, matching a destination against them, the class of an
 * address the broker is about to connect to, host names taken from untrusted
 * code, and the name a stream says it is for (TLS SNI, HTTP/1 Host).
 *
 * Nothing here touches a socket, allocates beyond the parsed rule list, or
 * keeps state: the broker (server side) calls it with bytes it got from a
 * sandbox, and the unit tests and the fuzz target call it with anything.
 *
 * allow_hosts entries (from the MCP client, i.e. the operator's agent):
 *   host            a host name: ports 80 and 443
 *   host:PORT       that port only (1..65535, decimal, no leading zero)
 *   host:*          every port
 *   *.suffix[:...]  any name strictly below suffix (a.suffix, a.b.suffix,
 *                   never suffix itself); suffix has at least two labels
 * A host name is LDH: labels of 1..63 letters, digits and hyphens, not
 * starting or ending with a hyphen, at most 253 bytes in all, one trailing
 * dot allowed and dropped, compared without case.  IDNA names are written in
 * their punycode form (xn--...), which is LDH.  IP literals are refused
 * (a name whose last label is all digits, anything inet_pton or inet_aton
 * takes, brackets): the broker decides by name (SNI and Host are names),
 * resolves names itself and checks the address it connects to; a listed
 * address would let a raw connect skip the name checks, and "open" mode is
 * the way to reach addresses. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define EGRESS_NAME_MAX 253u   /* a host name, without the trailing dot */
#define EGRESS_LABEL_MAX 63u
#define EGRESS_MAX_RULES 256u  /* allow_hosts entries per session */
#define EGRESS_METHOD_MAX 15u  /* a request rule's method */
#define EGRESS_PATH_MAX 256u   /* a request rule's path prefix */
/* The longest entry looked at: a name, "*.", ":65535", a dot, and a
 * request rule's " METHOD /prefix". */
#define EGRESS_ENTRY_MAX (EGRESS_NAME_MAX + 2u + 6u + 1u + 2u + EGRESS_METHOD_MAX + EGRESS_PATH_MAX)
/* Room for a sanitized name: the name and its NUL, or "<invalid:N>". */
#define EGRESS_NAME_BUF (EGRESS_NAME_MAX + 1u)
/* The most bytes of a stream the broker holds back to find its SNI or Host:
 * a ClientHello with post-quantum key shares is about 1.8 KiB, a TLS record
 * at most 16 KiB plus its header. */
#define EGRESS_PEEK_MAX (16u * 1024u + 5u)

enum egress_ports {
  EGRESS_PORTS_WEB, /* no port given: 80 and 443 */
  EGRESS_PORTS_ONE, /* :PORT */
  EGRESS_PORTS_ANY, /* :* */
};

struct egress_rule {
  char name[EGRESS_NAME_MAX + 1]; /* lowercase, no trailing dot; the suffix of a wildcard */
  bool wildcard;                  /* "*.name" */
  enum egress_ports ports;
  uint16_t port;                  /* EGRESS_PORTS_ONE */
  /* A request rule ("host[:port] METHOD [/prefix]"): the method ("*" any)
   * and path prefix ("" any) its requests must have; "" for a plain rule,
   * which admits every request. */
  char method[EGRESS_METHOD_MAX + 1];
  char path[EGRESS_PATH_MAX + 1];
  /* Added for a secret's hosts, not asked for: it admits connections and
   * lookups, but never lifts the request rules of the session's own. */
  bool implied;
};

struct egress_policy {
  struct egress_rule *rules;
  size_t n;
};

/* One entry of LEN bytes (it may hold NULs: it is refused then).  0, or
 * -EINVAL with *ret_err naming the entry and the rule it breaks. */
int egress_rule_parse(const char *entry, size_t len, struct egress_rule *ret, char **ret_err);

/* N entries (ENTRIES[i] of LENS[i] bytes) into *RET, which the caller frees
 * with egress_policy_free.  Duplicates are kept once.  0, or -EINVAL (more
 * than EGRESS_MAX_RULES entries, a bad entry: *ret_err names it and its
 * index), -ENOMEM. */
int egress_policy_parse(const char *const *entries, const size_t *lens, size_t n,
                        struct egress_policy *ret, char **ret_err);
void egress_policy_free(struct egress_policy *p);

/* The rule as the result's allowed_rules list shows it ("*.pypi.org:443",
 * "files.pythonhosted.org"): into BUF of SIZE bytes (EGRESS_ENTRY_MAX + 1
 * always suffices); the length, as snprintf. */
int egress_rule_format(const struct egress_rule *r, char *buf, size_t size);

/* The index of the first rule of P that admits NAME (LEN bytes, any case, a
 * trailing dot ignored) on PORT, or -1.  A NAME that is not a well-formed
 * host name matches nothing. */
long egress_policy_match(const struct egress_policy *p, const char *name, size_t len,
                         uint16_t port);
/* Whether A and B are the same rule (field by field, not byte by byte). */
bool egress_rule_same(const struct egress_rule *a, const struct egress_rule *b);
/* Whether rule R admits NAME (normalized: lowercase, no trailing dot; LEN
 * bytes) on PORT, as a connection. */
bool egress_rule_admits(const struct egress_rule *r, const char *name, size_t len, uint16_t port);
/* Whether every rule of P that admits NAME on PORT is a request rule: its
 * requests must then be read and checked (egress_request_allowed). */
bool egress_policy_requests_checked(const struct egress_policy *p, const char *name, size_t len,
                                    uint16_t port);
/* Whether one of the N rules R admits a request METHOD for TARGET (its
 * origin-form target: the path and query): NULL, or why not.  A target
 * whose path holds a "." or ".." segment, a backslash, or an encoded dot,
 * slash or backslash is refused ("path not canonical"): prefixes are
 * compared byte for byte, and a server may decode what the rule did not. */
const char *egress_request_refusal(const struct egress_rule *r, size_t n, const char *method,
                                   const char *target);
/* Whether some rule admits NAME on some port: DNS answers for it. */
bool egress_policy_knows(const struct egress_policy *p, const char *name, size_t len);

/* NAME (LEN bytes from untrusted code) is a well-formed host name as above,
 * IP literals excluded. */
bool egress_name_valid(const char *name, size_t len);
/* NAME as a record may carry it: the name lowercased without its trailing
 * dot when egress_name_valid, else "<invalid:LEN>".  OUT has at least
 * EGRESS_NAME_BUF bytes.  Returns whether the name was valid. */
bool egress_name_sanitize(const void *name, size_t len, char out[EGRESS_NAME_BUF]);

/* The class of an address the broker would connect to.  EGRESS_ADDR_PUBLIC
 * is the only one allowed without IGN_MCP_NET_PRIVATE; the classes for which
 * egress_addr_class_private() holds are allowed with IGN_MCP_NET_PRIVATE=1;
 * EGRESS_ADDR_LOOPBACK only with IGN_MCP_NET_PRIVATE=host; the others
 * never.  (An address the host itself has, of any class, is the broker's to
 * refuse: it asks the kernel, not this table.) */
enum egress_addr_class {
  EGRESS_ADDR_PUBLIC = 0,
  EGRESS_ADDR_LOOPBACK,      /* 127/8, ::1 */
  EGRESS_ADDR_PRIVATE,       /* 10/8, 172.16/12, 192.168/16, fc00::/7 */
  EGRESS_ADDR_SHARED,        /* 100.64/10 (carrier-grade NAT) */
  EGRESS_ADDR_LINK_LOCAL,    /* 169.254/16, fe80::/10 */
  EGRESS_ADDR_SITE_LOCAL,    /* fec0::/10 (deprecated, still routed inside sites) */
  EGRESS_ADDR_METADATA,      /* cloud instance metadata: 169.254.169.254, ... */
  EGRESS_ADDR_UNSPECIFIED,   /* 0.0.0.0, :: (Linux connects them to the local host) */
  EGRESS_ADDR_THIS_NETWORK,  /* 0/8 */
  EGRESS_ADDR_MULTICAST,     /* 224/4, ff00::/8 */
  EGRESS_ADDR_BROADCAST,     /* 255.255.255.255 */
  EGRESS_ADDR_DOCUMENTATION, /* 192.0.2/24, 198.51.100/24, 203.0.113/24, 2001:db8::/32, 3fff::/20 */
  EGRESS_ADDR_RESERVED,      /* 240/4, 192.0.0/24, 198.18/15, 100::/64, the v6 space no one routes */
  EGRESS_ADDR_NAT64_LOCAL,   /* 64:ff9b:1::/48: a site's own translator */
};

/* FAMILY is AF_INET (ADDR: 4 bytes, network order) or AF_INET6 (16 bytes).
 * IPv6 forms that carry an IPv4 address take its class: mapped
 * ::ffff:0:0/96 (a dual-stack socket reaches the v4 address), NAT64
 * 64:ff9b::/96, 6to4 2002::/16 and Teredo 2001::/32 (server or client,
 * whichever is refused); compatible ::/96 and SIIT ::ffff:0:0:0/96 take a
 * refused class of the v4 address, and are RESERVED otherwise (nothing
 * routes them).  Outside 2000::/3 and the ranges named above, an IPv6
 * address is RESERVED.  Another family is EGRESS_ADDR_RESERVED. */
enum egress_addr_class egress_addr_classify(int family, const void *addr);
/* The reason a record carries ("private address", "metadata address", ...);
 * "" for EGRESS_ADDR_PUBLIC. */
const char *egress_addr_reason(enum egress_addr_class c);
/* Whether IGN_MCP_NET_PRIVATE=1 allows the class (private, shared,
 * link-local but metadata, site-local, local NAT64): not loopback, which
 * reaches the host's own services and needs IGN_MCP_NET_PRIVATE=host. */
bool egress_addr_class_private(enum egress_addr_class c);

/* What the first bytes of a stream say about the name it is for. */
enum egress_peek {
  EGRESS_PEEK_FOUND,     /* a well-formed name: in OUT, lowercased */
  EGRESS_PEEK_MORE,      /* not decided yet: wait for more bytes (up to EGRESS_PEEK_MAX) */
  EGRESS_PEEK_ABSENT,    /* the protocol, but it names no host (ClientHello without SNI,
                          * HTTP request without Host or absolute target) */
  EGRESS_PEEK_OTHER,     /* not this protocol */
  EGRESS_PEEK_MALFORMED, /* this protocol, broken: OUT may hold "<invalid:N>" for a bad name */
};

/* A TLS ClientHello's server_name (host_name type) from the first LEN bytes
 * of a stream, which may span several handshake records.  OUT has
 * EGRESS_NAME_BUF bytes; it is "" unless the result is FOUND, or MALFORMED
 * because the name itself is not a host name.  Bytes that start like any
 * TLS record a server may take first (a content type 20-24, a version byte
 * below 0x10) are TLS: a record before the ClientHello that is not one (a
 * warning alert) is MALFORMED, never OTHER. */
enum egress_peek egress_tls_sni(const uint8_t *buf, size_t len, char out[EGRESS_NAME_BUF]);

/* Where the records that carry the ClientHello at the start of BUF end (an
 * offset from BUF, perhaps past LEN when its last record is still coming),
 * for a BUF egress_tls_sni found a whole ClientHello in; 0 otherwise. */
size_t egress_tls_hello_end(const uint8_t *buf, size_t len);

/* Whether the server's first bytes BUF (LEN) are a TLS 1.3 HelloRetryRequest
 * (a ServerHello whose random is RFC 8446's special value): 1, 0, or -1 when
 * more bytes are needed to tell. */
int egress_tls_hrr(const uint8_t *buf, size_t len);

/* BUF (LEN) with the ChangeCipherSpec records at its start left out: the
 * offset of what follows them, or -1 while one is still coming. */
long egress_tls_skip_ccs(const uint8_t *buf, size_t len);

/* An HTTP/1.x request's Host header (and, for a request in absolute form of
 * any scheme or CONNECT, the authority of its target, which must name the
 * same host and port) from the first LEN bytes of a stream.  OUT as above;
 * *RET_PORT the port Host or the target names, 0 when none.
 *
 * Fail closed: empty lines (CR, LF) before the request line are skipped as
 * servers skip them; any token followed by SP starts a request line, which
 * must be "method SP target SP HTTP/1.0|1 CRLF" with a target "/...", "*",
 * "scheme://authority..." (or CONNECT's authority), else MALFORMED (HTTP/0.9
 * "GET /", h2c's "PRI *", a tab for SP, a cut line).  The one exception is
 * SSH's identification ("SSH-2.0-x comments CRLF"): OTHER.  Bytes that do
 * not start with a token and SP (TLS, binary protocols, "PING\r\n") are
 * OTHER; a token not yet followed by anything is MORE.  More than one Host,
 * a header folded over lines, a bare CR or LF, a NUL or a head longer than
 * EGRESS_PEEK_MAX is MALFORMED.  A Host that is an IP literal is FOUND with
 * OUT the literal (v6 without its brackets): the broker compares it with the
 * address it connects to.  A complete request with neither Host nor an
 * authority in its target is ABSENT: the broker refuses it on a connection
 * to a name (a front end serves it from its default site). */
enum egress_peek egress_http_host(const uint8_t *buf, size_t len, char out[EGRESS_NAME_BUF],
                                  uint16_t *ret_port);
