/* egress_nl.c: the capture of a sandbox's traffic (docs/egress-design.md,
 * sections (a) and (b)), by raw netlink: the agent is static and libnftnl
 * needs a libmnl that has no static build here.
 *
 * Two steps, in this order:
 *   1. one nfnetlink batch on NETLINK_NETFILTER that creates
 *
 *        table inet ign_egress {
 *          chain nat_out {
 *            type nat hook output priority -100; policy accept;
 *            meta l4proto tcp th dport 53 counter redirect to :15353
 *            meta l4proto udp th dport 53 counter redirect to :15353
 *            ip daddr 127.0.0.0/8 accept
 *            ip6 daddr ::1 accept
 *            meta l4proto tcp counter redirect to :15001
 *          }
 *          chain filter_out {
 *            type filter hook output priority 0; policy accept;
 *            ip daddr 127.0.0.0/8 accept
 *            ip6 daddr ::1 accept
 *            meta l4proto tcp counter reject with tcp reset
 *            meta l4proto udp counter reject comment "ign:udp"
 *            meta l4proto icmp counter reject comment "ign:icmp"
 *            meta l4proto ipv6-icmp counter reject comment "ign:icmp"
 *            counter reject comment "ign:other"
 *          }
 *        }
 *
 *      The kernel applies a batch whole or not at all;
 *   2. the default routes through lo, v4 with source 127.0.0.1 (without it
 *      the reverse NAT of a redirected DNS answer fails) and v6 (rtnetlink).
 *      Without a route a connect fails with ENETUNREACH before any hook runs,
 *      so the routes come last: until they exist nothing can leave, and with
 *      them every packet meets the rules.
 * Every message asks for an ack (NLM_F_ACK) and every ack is read back, so a
 * failure names the message that failed.  On a failure what was done is
 * undone (the table deleted, the v4 route removed): the sandbox then has no
 * route at all, only lo, and nothing of its traffic leaves (fail closed).
 *
 * The comments (NFTA_RULE_USERDATA, in nft's own format, so `nft list`
 * shows them) name the refusal rules whose counters a dump sums for the
 * host (common/nft_counters.c: egress_refused_read() here for EGRESS_STATS,
 * the server itself for an ns sandbox): a dump finds them by comment, not
 * by position, so rules a vm's root adds in between change nothing.
 *
 * The expressions are those `nft --debug=netlink` shows for the ruleset
 * above: "127.0.0.0/8" is a one-byte compare of the address's first byte,
 * and "meta l4proto { tcp, udp }" is two rules, so no set is needed.  Every
 * nf_tables integer attribute is big-endian; NFT_REG_1 is the one register. */
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdalign.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <linux/netfilter.h>
#include <linux/netfilter/nf_nat.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>

#include "common/nft_counters.h"
#include "common/util.h"
#include "guest/egress_nl.h"

#define EGRESS_TABLE NFT_EGRESS_TABLE
#define EGRESS_NL_BUF 8192u      /* the batch is ~3.4 KB */
#define EGRESS_NL_MAX_MSGS 20u   /* messages per send: 17 in the batch */
#define EGRESS_NL_TIMEOUT_S 5    /* for an ack or a dump: the kernel answers at once */

/* ---- messages --------------------------------------------------------- */

/* Messages built back to back in one buffer, each with a sequence number
 * from 1 and a description for the error message. */
struct nl_msgs {
  alignas(struct nlmsghdr) uint8_t buf[EGRESS_NL_BUF];
  size_t len;
  bool full; /* a put did not fit: a bug, reported as E2BIG */
  uint32_t n; /* messages so far; message i has sequence number i + 1 */
  const char *what[EGRESS_NL_MAX_MSGS];
  bool acked[EGRESS_NL_MAX_MSGS];
};

/* N zeroed bytes (padded to 4) at the end, or NULL when they do not fit. */
static void *nl_put(struct nl_msgs *m, size_t n) {
  size_t padded = NLA_ALIGN(n);
  if (m->full || padded > sizeof m->buf - m->len) {
    m->full = true;
    return NULL;
  }
  void *p = m->buf + m->len;
  memset(p, 0, padded);
  m->len += padded;
  return p;
}

/* Start a message; WHAT (NULL: not acked) names it in errors.  FAMILY and
 * RES_ID go in its nfgenmsg, when HDR_LEN is that of one; otherwise HDR, of
 * HDR_LEN bytes, follows the netlink header (rtmsg). */
static size_t nl_begin(struct nl_msgs *m, uint16_t type, uint16_t flags, const char *what,
                       const void *hdr, size_t hdr_len) {
  size_t off = m->len;
  struct nlmsghdr *h = nl_put(m, NLMSG_HDRLEN);
  void *body = nl_put(m, hdr_len);
  if (!h || !body || m->n == EGRESS_NL_MAX_MSGS) {
    m->full = true;
    return off;
  }
  h->nlmsg_type = type;
  h->nlmsg_flags = (uint16_t)(NLM_F_REQUEST | flags | (what ? NLM_F_ACK : 0));
  h->nlmsg_seq = ++m->n;
  m->what[m->n - 1] = what;
  m->acked[m->n - 1] = !what;
  memcpy(body, hdr, hdr_len);
  return off;
}

static void nl_end(struct nl_msgs *m, size_t off) {
  if (!m->full)
    ((struct nlmsghdr *)(m->buf + off))->nlmsg_len = (uint32_t)(m->len - off);
}

/* An nf_tables message: nfgenmsg{FAMILY, NFNETLINK_V0, RES_ID}. */
static size_t nft_begin(struct nl_msgs *m, uint16_t type, uint16_t flags, const char *what,
                        uint8_t family, uint16_t res_id) {
  struct nfgenmsg g = {.nfgen_family = family, .version = NFNETLINK_V0, .res_id = htons(res_id)};
  return nl_begin(m, type, flags, what, &g, sizeof g);
}

static size_t nft_msg(struct nl_msgs *m, uint16_t nft_type, uint16_t flags, const char *what) {
  return nft_begin(m, (uint16_t)(NFNL_SUBSYS_NFTABLES << 8 | nft_type), flags, what,
                   NFPROTO_INET, 0);
}

static void attr(struct nl_msgs *m, uint16_t type, const void *data, size_t len) {
  struct nlattr *a = nl_put(m, NLA_HDRLEN);
  void *p = nl_put(m, len);
  if (!a || !p)
    return;
  a->nla_type = type;
  a->nla_len = (uint16_t)(NLA_HDRLEN + len);
  memcpy(p, data, len);
}

static void attr_str(struct nl_msgs *m, uint16_t type, const char *s) {
  attr(m, type, s, strlen(s) + 1);
}

static void attr_be32(struct nl_msgs *m, uint16_t type, uint32_t v) {
  uint32_t be = htonl(v);
  attr(m, type, &be, sizeof be);
}

static void attr_u32(struct nl_msgs *m, uint16_t type, uint32_t v) {
  attr(m, type, &v, sizeof v);
}

static size_t nest_begin(struct nl_msgs *m, uint16_t type) {
  size_t off = m->len;
  struct nlattr *a = nl_put(m, NLA_HDRLEN);
  if (a)
    a->nla_type = type | NLA_F_NESTED;
  return off;
}

static void nest_end(struct nl_msgs *m, size_t off) {
  if (!m->full)
    ((struct nlattr *)(m->buf + off))->nla_len = (uint16_t)(m->len - off);
}

/* ---- expressions ------------------------------------------------------ */

/* NFTA_LIST_ELEM{NFTA_EXPR_NAME, NFTA_EXPR_DATA{...}}: expr_begin opens
 * both, expr_end closes them. */
struct expr {
  size_t elem, data;
};

static struct expr expr_begin(struct nl_msgs *m, const char *name) {
  struct expr e = {.elem = nest_begin(m, NFTA_LIST_ELEM)};
  attr_str(m, NFTA_EXPR_NAME, name);
  e.data = nest_begin(m, NFTA_EXPR_DATA);
  return e;
}

static void expr_end(struct nl_msgs *m, struct expr e) {
  nest_end(m, e.data);
  nest_end(m, e.elem);
}

/* meta load KEY => r1 */
static void expr_meta(struct nl_msgs *m, uint32_t key) {
  struct expr e = expr_begin(m, "meta");
  attr_be32(m, NFTA_META_DREG, NFT_REG_1);
  attr_be32(m, NFTA_META_KEY, key);
  expr_end(m, e);
}

/* cmp eq r1 DATA */
static void expr_cmp_eq(struct nl_msgs *m, const void *data, size_t len) {
  struct expr e = expr_begin(m, "cmp");
  attr_be32(m, NFTA_CMP_SREG, NFT_REG_1);
  attr_be32(m, NFTA_CMP_OP, NFT_CMP_EQ);
  size_t d = nest_begin(m, NFTA_CMP_DATA);
  attr(m, NFTA_DATA_VALUE, data, len);
  nest_end(m, d);
  expr_end(m, e);
}

/* payload load LEN bytes @ BASE + OFFSET => r1 */
static void expr_payload(struct nl_msgs *m, uint32_t base, uint32_t offset, uint32_t len) {
  struct expr e = expr_begin(m, "payload");
  attr_be32(m, NFTA_PAYLOAD_DREG, NFT_REG_1);
  attr_be32(m, NFTA_PAYLOAD_BASE, base);
  attr_be32(m, NFTA_PAYLOAD_OFFSET, offset);
  attr_be32(m, NFTA_PAYLOAD_LEN, len);
  expr_end(m, e);
}

static void expr_counter(struct nl_msgs *m) {
  expr_end(m, expr_begin(m, "counter"));
}

static void expr_accept(struct nl_msgs *m) {
  struct expr e = expr_begin(m, "immediate");
  attr_be32(m, NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT);
  size_t d = nest_begin(m, NFTA_IMMEDIATE_DATA);
  size_t v = nest_begin(m, NFTA_DATA_VERDICT);
  attr_be32(m, NFTA_VERDICT_CODE, NF_ACCEPT);
  nest_end(m, v);
  nest_end(m, d);
  expr_end(m, e);
}

/* immediate r1 PORT (big-endian); redir proto_min r1 */
static void expr_redirect(struct nl_msgs *m, uint16_t port) {
  struct expr e = expr_begin(m, "immediate");
  attr_be32(m, NFTA_IMMEDIATE_DREG, NFT_REG_1);
  size_t d = nest_begin(m, NFTA_IMMEDIATE_DATA);
  uint16_t be = htons(port);
  attr(m, NFTA_DATA_VALUE, &be, sizeof be);
  nest_end(m, d);
  expr_end(m, e);
  e = expr_begin(m, "redir");
  attr_be32(m, NFTA_REDIR_REG_PROTO_MIN, NFT_REG_1);
  attr_be32(m, NFTA_REDIR_FLAGS, NF_NAT_RANGE_PROTO_SPECIFIED);
  expr_end(m, e);
}

static void expr_reject(struct nl_msgs *m, uint32_t type, uint8_t code) {
  struct expr e = expr_begin(m, "reject");
  attr_be32(m, NFTA_REJECT_TYPE, type);
  attr(m, NFTA_REJECT_ICMP_CODE, &code, 1);
  expr_end(m, e);
}

/* ---- the ruleset ------------------------------------------------------ */

enum verdict { ACCEPT, REDIRECT, REJECT_TCP_RESET, REJECT };

static const struct egress_rule {
  const char *chain;
  const char *text; /* as nft prints it, for messages */
  uint8_t l4proto;  /* 0: any */
  uint16_t dport;   /* 0: any */
  uint8_t lo;       /* 4: ip daddr 127.0.0.0/8, 6: ip6 daddr ::1, 0: any */
  bool counter;
  enum verdict verdict;
  uint16_t to_port; /* REDIRECT */
  int refused;      /* 1 + enum egress_refused_kind: its counter is one of the host's */
} egress_rules[] = {
    {"nat_out", "meta l4proto tcp th dport 53 counter redirect to :15353", IPPROTO_TCP, 53, 0,
     true, REDIRECT, EGRESS_DNS_PORT},
    {"nat_out", "meta l4proto udp th dport 53 counter redirect to :15353", IPPROTO_UDP, 53, 0,
     true, REDIRECT, EGRESS_DNS_PORT},
    {"nat_out", "ip daddr 127.0.0.0/8 accept", 0, 0, 4, false, ACCEPT, 0},
    {"nat_out", "ip6 daddr ::1 accept", 0, 0, 6, false, ACCEPT, 0},
    {"nat_out", "meta l4proto tcp counter redirect to :15001", IPPROTO_TCP, 0, 0, true, REDIRECT,
     EGRESS_TCP_PORT},
    {"filter_out", "ip daddr 127.0.0.0/8 accept", 0, 0, 4, false, ACCEPT, 0},
    {"filter_out", "ip6 daddr ::1 accept", 0, 0, 6, false, ACCEPT, 0},
    {"filter_out", "meta l4proto tcp counter reject with tcp reset", IPPROTO_TCP, 0, 0, true,
     REJECT_TCP_RESET, 0},
    {"filter_out", "meta l4proto udp counter reject comment \"ign:udp\"", IPPROTO_UDP, 0, 0,
     true, REJECT, 0, 1 + EGRESS_REFUSED_UDP},
    {"filter_out", "meta l4proto icmp counter reject comment \"ign:icmp\"", IPPROTO_ICMP, 0, 0,
     true, REJECT, 0, 1 + EGRESS_REFUSED_ICMP},
    {"filter_out", "meta l4proto ipv6-icmp counter reject comment \"ign:icmp\"", IPPROTO_ICMPV6,
     0, 0, true, REJECT, 0, 1 + EGRESS_REFUSED_ICMP},
    {"filter_out", "counter reject comment \"ign:other\"", 0, 0, 0, true, REJECT, 0,
     1 + EGRESS_REFUSED_OTHER},
};

static void add_rule(struct nl_msgs *m, const struct egress_rule *r) {
  size_t msg = nft_msg(m, NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, r->text);
  attr_str(m, NFTA_RULE_TABLE, EGRESS_TABLE);
  attr_str(m, NFTA_RULE_CHAIN, r->chain);
  size_t exprs = nest_begin(m, NFTA_RULE_EXPRESSIONS);
  if (r->lo) {
    static const uint8_t v4_net = 127, v6_lo[16] = {[15] = 1};
    uint8_t nfproto = r->lo == 4 ? NFPROTO_IPV4 : NFPROTO_IPV6;
    expr_meta(m, NFT_META_NFPROTO);
    expr_cmp_eq(m, &nfproto, 1);
    /* The destination: at 16 in an IPv4 header, at 24 in an IPv6 one. */
    expr_payload(m, NFT_PAYLOAD_NETWORK_HEADER, r->lo == 4 ? 16 : 24, r->lo == 4 ? 1 : 16);
    expr_cmp_eq(m, r->lo == 4 ? &v4_net : v6_lo, r->lo == 4 ? 1 : 16);
  }
  if (r->l4proto) {
    expr_meta(m, NFT_META_L4PROTO);
    expr_cmp_eq(m, &r->l4proto, 1);
  }
  if (r->dport) {
    uint16_t be = htons(r->dport);
    expr_payload(m, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2);
    expr_cmp_eq(m, &be, 2);
  }
  if (r->counter)
    expr_counter(m);
  switch (r->verdict) {
  case ACCEPT:
    expr_accept(m);
    break;
  case REDIRECT:
    expr_redirect(m, r->to_port);
    break;
  case REJECT_TCP_RESET:
    expr_reject(m, NFT_REJECT_TCP_RST, 0);
    break;
  case REJECT:
    expr_reject(m, NFT_REJECT_ICMPX_UNREACH, NFT_REJECT_ICMPX_PORT_UNREACH);
    break;
  }
  nest_end(m, exprs);
  if (r->refused) {
    uint8_t ud[NFT_REFUSED_UDATA_MAX];
    attr(m, NFTA_RULE_USERDATA, ud, nft_refused_udata(r->refused - 1, ud));
  }
  nl_end(m, msg);
}

static void add_chain(struct nl_msgs *m, const char *name, const char *type, int32_t priority,
                      const char *what) {
  size_t msg = nft_msg(m, NFT_MSG_NEWCHAIN, NLM_F_CREATE, what);
  attr_str(m, NFTA_CHAIN_TABLE, EGRESS_TABLE);
  attr_str(m, NFTA_CHAIN_NAME, name);
  size_t hook = nest_begin(m, NFTA_CHAIN_HOOK);
  attr_be32(m, NFTA_HOOK_HOOKNUM, NF_INET_LOCAL_OUT);
  attr_be32(m, NFTA_HOOK_PRIORITY, (uint32_t)priority);
  nest_end(m, hook);
  attr_be32(m, NFTA_CHAIN_POLICY, NF_ACCEPT);
  attr_str(m, NFTA_CHAIN_TYPE, type);
  nl_end(m, msg);
}

/* A batch: BATCH_BEGIN, the messages BODY adds, BATCH_END. */
static void batch_begin(struct nl_msgs *m) {
  nl_end(m, nft_begin(m, NFNL_MSG_BATCH_BEGIN, 0, NULL, AF_UNSPEC, NFNL_SUBSYS_NFTABLES));
}

static void batch_end(struct nl_msgs *m) {
  nl_end(m, nft_begin(m, NFNL_MSG_BATCH_END, 0, NULL, AF_UNSPEC, NFNL_SUBSYS_NFTABLES));
}

static void build_ruleset(struct nl_msgs *m) {
  batch_begin(m);
  /* NLM_F_EXCL: a table of that name already there is an error, not
   * something to add rules to twice. */
  size_t msg = nft_msg(m, NFT_MSG_NEWTABLE, NLM_F_CREATE | NLM_F_EXCL, "table inet " EGRESS_TABLE);
  attr_str(m, NFTA_TABLE_NAME, EGRESS_TABLE);
  nl_end(m, msg);
  add_chain(m, "nat_out", "nat", -100, "chain nat_out (type nat hook output)");
  add_chain(m, "filter_out", "filter", 0, "chain filter_out (type filter hook output)");
  for (size_t i = 0; i < ARRAY_SIZE(egress_rules); i++)
    add_rule(m, &egress_rules[i]);
  batch_end(m);
}

static void build_delete_table(struct nl_msgs *m) {
  batch_begin(m);
  size_t msg = nft_msg(m, NFT_MSG_DELTABLE, 0, "deleting table inet " EGRESS_TABLE);
  attr_str(m, NFTA_TABLE_NAME, EGRESS_TABLE);
  nl_end(m, msg);
  batch_end(m);
}

/* RTM_NEWROUTE or RTM_DELROUTE: default dev lo [src 127.0.0.1]. */
static void build_route(struct nl_msgs *m, uint16_t type, int family, const char *what) {
  struct rtmsg r = {
      .rtm_family = (uint8_t)family,
      .rtm_table = RT_TABLE_MAIN,
      .rtm_protocol = RTPROT_BOOT,
      .rtm_scope = type == RTM_NEWROUTE ? RT_SCOPE_LINK : RT_SCOPE_NOWHERE,
      .rtm_type = RTN_UNICAST,
  };
  size_t msg = nl_begin(m, type, type == RTM_NEWROUTE ? NLM_F_CREATE | NLM_F_EXCL : 0, what, &r,
                        sizeof r);
  unsigned lo = if_nametoindex("lo");
  attr_u32(m, RTA_OIF, lo ? lo : 1);
  if (family == AF_INET) {
    struct in_addr src = {htonl(INADDR_LOOPBACK)};
    attr(m, RTA_PREFSRC, &src, sizeof src);
  }
  nl_end(m, msg);
}

/* ---- talking to the kernel -------------------------------------------- */

/* Send M on a new netlink socket of PROTOCOL and read an ack for every
 * message that asked for one.  0, or a negative errno with *WHAT naming
 * the message that failed (NULL: the socket or the batch as a whole). */
static int nl_talk(int protocol, struct nl_msgs *m, const char **what) {
  *what = NULL;
  if (m->full)
    return -E2BIG;
  _cleanup_close_ int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, protocol);
  if (fd < 0)
    return -errno;
  struct timeval tv = {.tv_sec = EGRESS_NL_TIMEOUT_S};
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0)
    return -errno;
  /* An error ack then carries only the header of the failed message. */
  int one = 1;
  setsockopt(fd, SOL_NETLINK, NETLINK_CAP_ACK, &one, sizeof one);
  struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
  if (sendto(fd, m->buf, m->len, 0, (struct sockaddr *)&kernel, sizeof kernel) < 0)
    return -errno;

  int err = 0;
  for (;;) {
    uint32_t pending = 0;
    for (uint32_t i = 0; i < m->n; i++)
      pending += !m->acked[i];
    if (!pending)
      return err;
    alignas(struct nlmsghdr) uint8_t buf[EGRESS_NL_BUF];
    /* After an error, take the acks already queued and stop. */
    ssize_t n = recv(fd, buf, sizeof buf, err ? MSG_DONTWAIT : 0);
    if (n < 0)
      return err ? err : errno == EAGAIN ? -ETIMEDOUT : -errno;
    for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n);
         h = NLMSG_NEXT(h, n)) {
      if (h->nlmsg_type != NLMSG_ERROR || h->nlmsg_len < NLMSG_LENGTH(sizeof(struct nlmsgerr)))
        continue;
      const struct nlmsgerr *e = NLMSG_DATA(h);
      uint32_t seq = e->msg.nlmsg_seq;
      if (seq < 1 || seq > m->n)
        continue;
      m->acked[seq - 1] = true;
      if (e->error && !err) {
        err = e->error < 0 ? e->error : -EPROTO;
        *what = m->what[seq - 1];
      }
    }
  }
}

/* ---- the setup ---------------------------------------------------------- */

static int delete_table(void) {
  struct nl_msgs m = {0};
  const char *what;
  build_delete_table(&m);
  return nl_talk(NETLINK_NETFILTER, &m, &what);
}

static int route(uint16_t type, int family, const char *what, const char **failed) {
  struct nl_msgs m = {0};
  build_route(&m, type, family, what);
  return nl_talk(NETLINK_ROUTE, &m, failed);
}

int egress_capture_setup(char *err, size_t err_size) {
  struct nl_msgs m = {0};
  const char *what;
  build_ruleset(&m);
  int r = nl_talk(NETLINK_NETFILTER, &m, &what);
  if (r < 0) {
    /* No nfnetlink (EPROTONOSUPPORT), no nf_tables behind it (EOPNOTSUPP on
     * the batch), or a part missing: the nat chain type, redir, reject
     * (ENOENT: the kernel found no module for it). */
    bool missing = r == -EPROTONOSUPPORT || r == -EOPNOTSUPP || r == -ENOENT;
    snprintf(err, err_size, "%s: %s%s%s%s",
             missing ? "nf_tables is not available in this kernel" : "cannot install the egress rules",
             what ? "adding " : "", what ? what : "", what ? ": " : "", strerror(-r));
    return r;
  }
  r = route(RTM_NEWROUTE, AF_INET, "default dev lo src 127.0.0.1", &what);
  if (r >= 0) {
    r = route(RTM_NEWROUTE, AF_INET6, "-6 default dev lo", &what);
    if (r < 0) {
      const char *ignored;
      route(RTM_DELROUTE, AF_INET, "deleting the v4 route", &ignored);
    }
  }
  if (r < 0) {
    int d = delete_table();
    snprintf(err, err_size, "cannot add the route %s: %s%s%s", what ? what : "through lo",
             strerror(-r), d < 0 ? "; deleting the table again failed too: " : "",
             d < 0 ? strerror(-d) : "");
    return r;
  }
  return 0;
}

/* ---- the refusal counters ----------------------------------------------- */

int egress_refused_read(uint64_t ret[EGRESS_REFUSED_N], char *err, size_t err_size) {
  _cleanup_close_ int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
  if (fd < 0) {
    int e = errno;
    snprintf(err, err_size, "cannot read the counters of table inet " EGRESS_TABLE ": %s",
             strerror(e));
    return -e;
  }
  return nft_refused_dump(fd, EGRESS_NL_TIMEOUT_S * 1000u, ret, err, err_size);
}

int egress_counters_keep_socket(char *err, size_t err_size) {
  /* Where it goes must be free: dup3 would close what is there. */
  if (fcntl(AGENT_NS_COUNTERS_FD, F_GETFD) >= 0 || errno != EBADF) {
    snprintf(err, err_size, "cannot keep the counters' socket on fd %d: it is in use",
             AGENT_NS_COUNTERS_FD);
    return -EBUSY;
  }
  int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
  int e = errno;
  if (fd >= 0 && fd != AGENT_NS_COUNTERS_FD) {
    int r = dup3(fd, AGENT_NS_COUNTERS_FD, O_CLOEXEC);
    e = errno;
    close(fd);
    fd = r;
  }
  if (fd < 0) {
    snprintf(err, err_size, "cannot keep a netfilter netlink socket on fd %d: %s",
             AGENT_NS_COUNTERS_FD, strerror(e));
    return -e;
  }
  return 0;
}
