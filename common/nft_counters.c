/* nft_counters.c: the refusal counters' dump, shared by the agent and the
 * server (nft_counters.h).  The answers are the kernel's, but every length
 * in them is checked all the same: the server reads them from a socket a
 * sandbox's agent handed over. */
#include <endian.h>
#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <linux/netfilter.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netlink.h>

#include "common/nft_counters.h"

#define DUMP_BUF 32768u          /* one recv of a dump: the kernel fills <= 32 KiB */
#define DUMP_MAX_MSGS 4096u      /* rules a dump may list before we give up */
#define DRAIN_MAX_RECVS 256u     /* leftovers of an earlier dump read before this one */

size_t nft_refused_udata(int kind, uint8_t out[NFT_REFUSED_UDATA_MAX]) {
  static const char *const names[EGRESS_REFUSED_N] = {
      [EGRESS_REFUSED_UDP] = "ign:udp", [EGRESS_REFUSED_ICMP] = "ign:icmp",
      [EGRESS_REFUSED_OTHER] = "ign:other"};
  if (kind < 0 || kind >= EGRESS_REFUSED_N)
    return 0;
  size_t n = strlen(names[kind]) + 1;
  out[0] = 0;
  out[1] = (uint8_t)n;
  memcpy(out + 2, names[kind], n);
  return 2 + n;
}

/* The next attribute of [*P, *P + *LEFT), or NULL at the end or at one that
 * runs past it (the kernel's own data, but checked all the same). */
static const struct nlattr *nla_next(const uint8_t **p, size_t *left) {
  if (*left < NLA_HDRLEN)
    return NULL;
  const struct nlattr *a = (const struct nlattr *)*p;
  if (a->nla_len < NLA_HDRLEN || a->nla_len > *left)
    return NULL;
  size_t step = (size_t)NLA_ALIGN(a->nla_len);
  if (step > *left)
    step = *left;
  *p += step;
  *left -= step;
  return a;
}

#define NLA_BODY(a) ((const uint8_t *)(a) + NLA_HDRLEN)
#define NLA_BODY_LEN(a) ((size_t)(a)->nla_len - NLA_HDRLEN)
#define NLA_TYPE(a) ((a)->nla_type & NLA_TYPE_MASK)

static bool nla_is_str(const struct nlattr *a, const char *s) {
  size_t n = strlen(s) + 1;
  return NLA_BODY_LEN(a) == n && memcmp(NLA_BODY(a), s, n) == 0;
}

/* The packet count of the first counter in NFTA_RULE_EXPRESSIONS EXPRS;
 * false when it has none. */
static bool rule_counter(const struct nlattr *exprs, uint64_t *ret) {
  const uint8_t *p = NLA_BODY(exprs);
  size_t left = NLA_BODY_LEN(exprs);
  for (const struct nlattr *elem; (elem = nla_next(&p, &left));) {
    if (NLA_TYPE(elem) != NFTA_LIST_ELEM)
      continue;
    const uint8_t *q = NLA_BODY(elem);
    size_t qleft = NLA_BODY_LEN(elem);
    bool counter = false;
    const struct nlattr *data = NULL;
    for (const struct nlattr *a; (a = nla_next(&q, &qleft));) {
      if (NLA_TYPE(a) == NFTA_EXPR_NAME)
        counter = nla_is_str(a, "counter");
      else if (NLA_TYPE(a) == NFTA_EXPR_DATA)
        data = a;
    }
    if (!counter || !data)
      continue;
    const uint8_t *d = NLA_BODY(data);
    size_t dleft = NLA_BODY_LEN(data);
    for (const struct nlattr *a; (a = nla_next(&d, &dleft));) {
      if (NLA_TYPE(a) == NFTA_COUNTER_PACKETS && NLA_BODY_LEN(a) == 8) {
        uint64_t be;
        memcpy(&be, NLA_BODY(a), 8);
        *ret = be64toh(be);
        return true;
      }
    }
  }
  return false;
}

/* One rule of the dump: when it is a refusal rule of ours (table, chain and
 * comment), its count is added to RET and its kind marked in *FOUND. */
static void refused_rule(const struct nlmsghdr *h, uint64_t ret[EGRESS_REFUSED_N],
                         unsigned *found) {
  if (h->nlmsg_len < NLMSG_LENGTH(sizeof(struct nfgenmsg)))
    return;
  const uint8_t *p = (const uint8_t *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct nfgenmsg));
  size_t left = h->nlmsg_len - NLMSG_LENGTH(NLMSG_ALIGN(sizeof(struct nfgenmsg)));
  bool table = false, chain = false;
  int kind = -1;
  const struct nlattr *exprs = NULL;
  for (const struct nlattr *a; (a = nla_next(&p, &left));) {
    switch (NLA_TYPE(a)) {
    case NFTA_RULE_TABLE:
      table = nla_is_str(a, NFT_EGRESS_TABLE);
      break;
    case NFTA_RULE_CHAIN:
      chain = nla_is_str(a, "filter_out");
      break;
    case NFTA_RULE_EXPRESSIONS:
      exprs = a;
      break;
    case NFTA_RULE_USERDATA:
      for (int k = 0; k < EGRESS_REFUSED_N; k++) {
        uint8_t ud[NFT_REFUSED_UDATA_MAX];
        size_t n = nft_refused_udata(k, ud);
        if (NLA_BODY_LEN(a) == n && memcmp(NLA_BODY(a), ud, n) == 0)
          kind = k;
      }
      break;
    }
  }
  uint64_t packets;
  if (table && chain && kind >= 0 && exprs && rule_counter(exprs, &packets)) {
    ret[kind] += packets;
    *found |= 1u << kind;
  }
}


/* The request: NFT_MSG_GETRULE, a dump of the one table's and chain's
 * rules (the kernel filters by both). */
struct dump_req {
  struct nlmsghdr h;
  struct nfgenmsg g;
  uint8_t attrs[64];
};

static size_t put_str(uint8_t *p, uint16_t type, const char *s) {
  size_t n = strlen(s) + 1;
  struct nlattr a = {.nla_len = (uint16_t)(NLA_HDRLEN + n), .nla_type = type};
  memcpy(p, &a, sizeof a);
  memcpy(p + NLA_HDRLEN, s, n);
  return NLA_ALIGN(NLA_HDRLEN + n);
}

static size_t dump_req(struct dump_req *q, uint32_t seq) {
  memset(q, 0, sizeof *q);
  size_t n = put_str(q->attrs, NFTA_RULE_TABLE, NFT_EGRESS_TABLE);
  n += put_str(q->attrs + n, NFTA_RULE_CHAIN, "filter_out");
  q->h.nlmsg_len = (uint32_t)(NLMSG_LENGTH(sizeof q->g) + n);
  q->h.nlmsg_type = NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETRULE;
  q->h.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
  q->h.nlmsg_seq = seq;
  q->g = (struct nfgenmsg){.nfgen_family = NFPROTO_INET, .version = NFNETLINK_V0};
  return q->h.nlmsg_len;
}

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Reads whatever waits on FD without blocking (an earlier dump cut short
 * by its timeout goes on as it is read).  0, or -EBUSY when it does not
 * end. */
static int drain(int fd, uint8_t *buf) {
  for (unsigned i = 0; i < DRAIN_MAX_RECVS; i++) {
    ssize_t n = recv(fd, buf, DUMP_BUF, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return 0;
  }
  return -EBUSY;
}

/* Sends the dump and sums the answers with sequence number SEQ until
 * NLMSG_DONE.  0 or a negative errno. */
static int dump(int fd, unsigned timeout_ms, uint32_t seq, uint8_t *buf,
                uint64_t sum[EGRESS_REFUSED_N], unsigned *found) {
  struct dump_req q;
  size_t len = dump_req(&q, seq);
  /* send, not sendto the kernel's address: the same destination, but a
   * message with an address (NETLINK_SKB_DST) skips the kernel's check of
   * the socket's opener, and we want both checks (nft_counters.h). */
  if (send(fd, &q, len, MSG_DONTWAIT | MSG_NOSIGNAL) < 0)
    return errno == EAGAIN ? -ETIMEDOUT : -errno;
  uint64_t deadline = now_ms() + timeout_ms;
  unsigned msgs = 0;
  for (;;) {
    uint64_t now = now_ms();
    if (now >= deadline)
      return -ETIMEDOUT;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int pr = poll(&p, 1, (int)(deadline - now));
    if (pr < 0 && errno != EINTR)
      return -errno;
    if (pr <= 0)
      continue;
    struct iovec iov = {.iov_base = buf, .iov_len = DUMP_BUF};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR)
        continue;
      return -errno;
    }
    if (n == 0)
      return -EPROTO;
    if (mh.msg_flags & MSG_TRUNC)
      return -EMSGSIZE;
    for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n);
         h = NLMSG_NEXT(h, n)) {
      if (h->nlmsg_seq != seq)
        continue; /* an answer to an earlier request */
      if (h->nlmsg_type == NLMSG_DONE)
        return 0;
      if (h->nlmsg_type == NLMSG_ERROR) {
        const struct nlmsgerr *e = NLMSG_DATA(h);
        return h->nlmsg_len < NLMSG_LENGTH(sizeof *e) ? -EPROTO
               : e->error < 0                         ? e->error
                                                      : -EPROTO;
      }
      if (++msgs > DUMP_MAX_MSGS)
        return -E2BIG;
      if (h->nlmsg_type == (NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_NEWRULE))
        refused_rule(h, sum, found);
    }
  }
}

int nft_refused_dump(int fd, unsigned timeout_ms, uint64_t ret[EGRESS_REFUSED_N], char *err,
                     size_t err_size) {
  /* Told apart from an earlier request's answers; the kernel only echoes it. */
  static uint32_t seq_counter;
  uint32_t seq = __atomic_add_fetch(&seq_counter, 1, __ATOMIC_RELAXED);
  uint64_t sum[EGRESS_REFUSED_N] = {0};
  unsigned found = 0;
  uint8_t *buf = malloc(DUMP_BUF); /* malloc aligns it for the headers */
  int r = !buf ? -ENOMEM : drain(fd, buf);
  if (r == 0)
    r = dump(fd, timeout_ms, seq, buf, sum, &found);
  free(buf);
  if (r == 0 && found != (1u << EGRESS_REFUSED_N) - 1)
    r = -ENOENT;
  if (r < 0) {
    snprintf(err, err_size, "cannot read the counters of table inet " NFT_EGRESS_TABLE ": %s",
             r == -ENOENT  ? "its refusal rules are gone (or there is no capture)"
             : r == -EPERM ? "not permitted (no CAP_NET_ADMIN over its network namespace)"
                           : strerror(-r));
    return r;
  }
  memcpy(ret, sum, sizeof sum);
  return 0;
}
