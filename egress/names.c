/* names.c: DNS for a sandbox, answered by the broker (docs/egress-design.md
 * (d)).  A name the policy admits gets, for an A query, a synthetic address
 * from 198.18.0.0/15 that stands for that name in that session (at most
 * EGRESS_SYNTH_MAX names), once the host resolved the name to an address
 * the sandbox may reach; every other type for it gets NOERROR with no
 * answer (programs fall back to A; no HTTPS/SVCB record, so no ECH
 * configuration, reaches them).  A refused name gets NXDOMAIN at once.  At
 * connect time the synthetic address maps back to the name, which the
 * broker resolves again itself: what the sandbox saw is never connected to.
 *
 * The host's answers are cached for a while, per owner (the HTTP token, or
 * stdio): a fast answer must not tell one owner's sandbox which names
 * another owner's sandboxes looked up.  Under a wildcard rule (*.suffix)
 * the sandbox makes up the names, and each one the host resolves reaches
 * that domain's servers with what its labels carry: a session may look up
 * at most IGN_MCP_EGRESS_WILDCARD_NAMES distinct names under each such
 * rule, then NXDOMAIN (recorded, naming the setting).
 *
 * Everything here runs on the broker thread. */
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <nettle/sha2.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/util.h"
#include "egress/egress_int.h"

#define SYNTH_SLOTS (2u * EGRESS_SYNTH_MAX) /* the hash table: half full at most */
#define CACHE_MAX 512u
#define CACHE_MS 30000u

struct lookup {
  struct lookup *next;
  struct link *lk;
  uint32_t lid;
  uint16_t qtype;
  char name[EGRESS_NAME_BUF];
  struct resolve_job *job;
};

/* The host's answers for DNS, shared by the sessions of one owner. */
struct cache_ent {
  uint8_t owner_key[EGRESS_OWNER_KEY];
  char name[EGRESS_NAME_BUF];
  uint64_t expires_ms;         /* 0: empty */
  int gai_err;
  size_t n;
  int family[EGRESS_ADDRS_MAX];
  uint8_t addr[EGRESS_ADDRS_MAX][16];
};
static struct cache_ent cache[CACHE_MAX];

void names_cache_clear(void) { memset(cache, 0, sizeof cache); }

void names_owner_key(const char *owner, uint8_t key[EGRESS_OWNER_KEY]) {
  struct sha256_ctx c;
  sha256_init(&c);
  sha256_update(&c, strlen(owner), (const uint8_t *)owner);
  sha256_digest(&c, EGRESS_OWNER_KEY, key);
}

static bool cache_is(const struct cache_ent *c, const uint8_t *owner_key, const char *name) {
  return memcmp(c->owner_key, owner_key, EGRESS_OWNER_KEY) == 0 && strcmp(c->name, name) == 0;
}

static struct cache_ent *cache_find(const uint8_t *owner_key, const char *name, uint64_t now) {
  for (size_t i = 0; i < CACHE_MAX; i++)
    if (cache[i].expires_ms > now && cache_is(&cache[i], owner_key, name))
      return &cache[i];
  return NULL;
}

static void cache_put(const struct resolve_job *j, uint64_t now, uint64_t ms) {
  struct cache_ent *slot = &cache[0];
  for (size_t i = 0; i < CACHE_MAX; i++) {
    if (cache[i].expires_ms <= now || cache_is(&cache[i], j->owner_key, j->name)) {
      slot = &cache[i];
      break;
    }
    if (cache[i].expires_ms < slot->expires_ms)
      slot = &cache[i]; /* the oldest goes when the cache is full */
  }
  memcpy(slot->owner_key, j->owner_key, EGRESS_OWNER_KEY);
  snprintf(slot->name, sizeof slot->name, "%s", j->name);
  slot->expires_ms = now + ms;
  slot->gai_err = j->gai_err;
  slot->n = j->n;
  memcpy(slot->family, j->family, sizeof slot->family);
  memcpy(slot->addr, j->addr, sizeof slot->addr);
}

void names_cache_job(const struct resolve_job *j) {
  bool settled = !j->gai_err || j->gai_err == EAI_NONAME || j->gai_err == EAI_NODATA;
  cache_put(j, mono_ms(), settled ? CACHE_MS : EGRESS_RESOLVE_FAIL_MS);
}

/* NAME did not resolve in time for OWNER_KEY: not asked again for a while. */
static void cache_timeout(const uint8_t *owner_key, const char *name) {
  struct resolve_job j = {.gai_err = EAI_AGAIN};
  memcpy(j.owner_key, owner_key, EGRESS_OWNER_KEY);
  snprintf(j.name, sizeof j.name, "%s", name);
  cache_put(&j, mono_ms(), EGRESS_RESOLVE_FAIL_MS);
}

/* ---- addresses ---- */

static const uint8_t v4_mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};

/* Whether the kernel routes ADDR to this host itself (RTM_GETROUTE: a
 * route of type RTN_LOCAL, i.e. an address of any interface or a local
 * range): 1, 0, or -errno when it cannot say.  A socket per question: the
 * broker may move between network namespaces (tests do), a kept socket
 * would answer for the old one; the round trip costs some microseconds. */
static int route_is_local(int family, const uint8_t *addr) {
  struct {
    struct nlmsghdr nh;
    struct rtmsg rt;
    struct rtattr dst;
    uint8_t a[16];
  } req = {0};
  size_t alen = family == AF_INET ? 4 : 16;
  req.nh.nlmsg_len = (uint32_t)(NLMSG_LENGTH(sizeof req.rt) + RTA_LENGTH(alen));
  req.nh.nlmsg_type = RTM_GETROUTE;
  req.nh.nlmsg_flags = NLM_F_REQUEST;
  req.nh.nlmsg_seq = 1;
  req.rt.rtm_family = (uint8_t)family;
  req.rt.rtm_dst_len = (uint8_t)(alen * 8);
  req.dst.rta_len = (uint16_t)RTA_LENGTH(alen);
  req.dst.rta_type = RTA_DST;
  memcpy(req.a, addr, alen);
  int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_ROUTE);
  if (fd < 0)
    return -errno;
  int r = -EIO;
  union {
    struct nlmsghdr nh;
    uint8_t b[4096];
  } buf;
  if (send(fd, &req, req.nh.nlmsg_len, 0) < 0) {
    r = -errno;
    goto out;
  }
  struct pollfd p = {.fd = fd, .events = POLLIN};
  if (poll(&p, 1, 1000) != 1) {
    r = -ETIMEDOUT;
    goto out;
  }
  ssize_t n = recv(fd, &buf, sizeof buf, 0);
  if (n < 0) {
    r = -errno;
    goto out;
  }
  struct nlmsghdr *nh = &buf.nh;
  if (!NLMSG_OK(nh, (size_t)n)) {
    r = -EPROTO;
  } else if (nh->nlmsg_type == NLMSG_ERROR) {
    const struct nlmsgerr *e = NLMSG_DATA(nh);
    /* No route at all: nothing local either. */
    r = nh->nlmsg_len < NLMSG_LENGTH(sizeof *e) ? -EPROTO
        : e->error == -ENETUNREACH || e->error == -EHOSTUNREACH ? 0 : e->error ? e->error : -EPROTO;
  } else if (nh->nlmsg_type == RTM_NEWROUTE && nh->nlmsg_len >= NLMSG_LENGTH(sizeof(struct rtmsg))) {
    const struct rtmsg *rt = NLMSG_DATA(nh);
    r = rt->rtm_type == RTN_LOCAL;
  } else {
    r = -EPROTO;
  }
out:
  close(fd);
  return r;
}

/* The same question from the interfaces' addresses, when netlink cannot be
 * asked: 1, 0, or -errno. */
static int ifaddr_is_local(int family, const uint8_t *addr) {
  struct ifaddrs *ifs;
  if (getifaddrs(&ifs) < 0)
    return -errno;
  int r = 0;
  for (struct ifaddrs *i = ifs; i && !r; i = i->ifa_next) {
    const struct sockaddr *sa = i->ifa_addr;
    if (!sa || sa->sa_family != family)
      continue;
    r = family == AF_INET ? memcmp(&((const struct sockaddr_in *)sa)->sin_addr, addr, 4) == 0
                          : memcmp(&((const struct sockaddr_in6 *)sa)->sin6_addr, addr, 16) == 0;
  }
  freeifaddrs(ifs);
  return r;
}

int egress_addr_local(int family, const uint8_t *addr) {
  int local = route_is_local(family, addr);
  return local < 0 ? ifaddr_is_local(family, addr) : local;
}

const char *egress_addr_refusal(int family, const uint8_t *addr) {
  enum egress_addr_class c = egress_addr_classify(family, addr);
  bool host = egress_cfg.allow_host;
  if (c == EGRESS_ADDR_LOOPBACK)
    return host ? "" : egress_addr_reason(c);
  if (c != EGRESS_ADDR_PUBLIC &&
      !((egress_cfg.allow_private || host) && egress_addr_class_private(c)))
    return egress_addr_reason(c);
  if (host)
    return "";
  /* An address the host has (any interface, public or private) reaches
   * the host itself: its services on 0.0.0.0, as loopback would. */
  if (family == AF_INET6 && memcmp(addr, v4_mapped, 12) == 0) {
    family = AF_INET; /* what the connect does with it */
    addr += 12;
  }
  int local = egress_addr_local(family, addr);
  if (local < 0)
    return "cannot tell whether the address is the host's own";
  return local ? "the host's own address" : "";
}

/* ADDR's IPv4 bytes when it is in 198.18.0.0/15 (also as ::ffff:198.18.x.y),
 * else NULL. */
static const uint8_t *synth_v4(int family, const uint8_t *addr) {
  static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (family == AF_INET6 && memcmp(addr, mapped, 12) == 0)
    addr += 12;
  else if (family != AF_INET)
    return NULL;
  return addr[0] == 198 && (addr[1] & 0xfe) == 18 ? addr : NULL;
}

bool names_is_synthetic(int family, const uint8_t *addr) { return synth_v4(family, addr) != NULL; }

const char *names_synthetic(const struct egress *e, int family, const uint8_t *addr) {
  const uint8_t *a = synth_v4(family, addr);
  if (!a)
    return NULL;
  /* 198.18.0.1 is number 1, the first name. */
  uint32_t k = (uint32_t)(a[1] - 18) << 16 | (uint32_t)a[2] << 8 | a[3];
  return k && k <= e->n_synth ? e->synth[k - 1] : NULL;
}

static uint32_t name_hash(const char *s) {
  uint32_t h = 2166136261u;
  for (; *s; s++)
    h = (h ^ (uint8_t)*s) * 16777619u;
  return h;
}

/* NAME's synthetic address number (>= 1), allocated on first use; 0 when
 * the session has EGRESS_SYNTH_MAX names already.  Changes are made under
 * synth_lock (egress_clone reads them from a session thread). */
static uint32_t synth_get(struct egress *e, const char *name) {
  if (e->synth_slot) {
    for (uint32_t i = name_hash(name) % SYNTH_SLOTS; e->synth_slot[i]; i = (i + 1) % SYNTH_SLOTS)
      if (strcmp(e->synth[e->synth_slot[i] - 1], name) == 0)
        return e->synth_slot[i];
  }
  if (e->n_synth >= EGRESS_SYNTH_MAX)
    return 0;
  pthread_mutex_lock(&e->synth_lock);
  uint32_t k = 0;
  if (!e->synth_slot) {
    e->synth_slot = calloc(SYNTH_SLOTS, sizeof *e->synth_slot);
    e->synth = calloc(EGRESS_SYNTH_MAX, sizeof *e->synth);
    if (!e->synth_slot || !e->synth) {
      free(e->synth_slot);
      free(e->synth);
      e->synth_slot = NULL;
      e->synth = NULL;
      goto out;
    }
  }
  uint32_t i = name_hash(name) % SYNTH_SLOTS;
  while (e->synth_slot[i])
    i = (i + 1) % SYNTH_SLOTS;
  if (!(e->synth[e->n_synth] = strdup(name)))
    goto out;
  e->synth_slot[i] = k = ++e->n_synth;
out:
  pthread_mutex_unlock(&e->synth_lock);
  return k;
}

/* Not with the broker touching E: egress_free, after the detach. */
void names_free(struct egress *e) {
  names_wild_free(e);
  for (uint32_t i = 0; e->synth && i < e->n_synth; i++)
    free(e->synth[i]);
  free(e->synth);
  free(e->synth_slot);
  e->synth = NULL;
  e->synth_slot = NULL;
  e->n_synth = 0;
}

/* *DST becomes a copy of the N elements of SIZE bytes at SRC (nothing for
 * none), *RET_N their number.  0 or -ENOMEM. */
static int dup_array(void *dst, size_t *ret_n, const void *src, size_t n, size_t size) {
  void **d = dst;
  if (!n)
    return 0;
  if (!(*d = malloc(n * size)))
    return -ENOMEM;
  memcpy(*d, src, n * size);
  *ret_n = n;
  return 0;
}

int names_copy(struct egress *dst, struct egress *src) {
  pthread_mutex_lock(&src->synth_lock);
  /* The policy, the placeholders and the counts that go by its rules: one
   * moment's. */
  dst->mode = src->mode;
  int r = dup_array(&dst->pol.rules, &dst->pol.n, src->pol.rules, src->pol.n,
                    sizeof *src->pol.rules);
  if (!r)
    r = dup_array(&dst->bind, &dst->n_bind, src->bind, src->n_bind, sizeof *src->bind);
  if (!r && src->synth_slot) {
    dst->synth_slot = malloc(SYNTH_SLOTS * sizeof *dst->synth_slot);
    dst->synth = calloc(EGRESS_SYNTH_MAX, sizeof *dst->synth);
    r = dst->synth_slot && dst->synth ? 0 : -ENOMEM;
    if (!r)
      memcpy(dst->synth_slot, src->synth_slot, SYNTH_SLOTS * sizeof *dst->synth_slot);
    for (uint32_t i = 0; !r && i < src->n_synth; i++, dst->n_synth++)
      if (!(dst->synth[i] = strdup(src->synth[i])))
        r = -ENOMEM;
  }
  /* The names counted under the wildcard rules: a fork does not start
   * its count again. */
  if (!r)
    r = names_wild_copy(dst, src);
  pthread_mutex_unlock(&src->synth_lock);
  if (r < 0)
    names_free(dst);
  return r;
}

int names_restore(struct egress *e, const char *const *names, size_t n) {
  if (n > EGRESS_SYNTH_MAX)
    return -EINVAL;
  for (size_t i = 0; i < n; i++) {
    size_t len = strlen(names[i]);
    if (len == 0 || len >= EGRESS_NAME_BUF || !egress_name_valid(names[i], len))
      return -EINVAL;
    uint32_t k = synth_get(e, names[i]);
    if (k == 0)
      return -ENOMEM;
    if (k != i + 1)
      return -EINVAL; /* a name twice */
  }
  return 0;
}

/* ---- lookups ---- */

static void answer(struct link *lk, uint32_t lid, enum proto_rcode rcode, uint32_t synth) {
  int fam = AF_INET;
  uint8_t a[1][16] = {{198, (uint8_t)(18 + (synth >> 16)), (uint8_t)(synth >> 8), (uint8_t)synth}};
  if (!lk->dead)
    agent_lookup_answer(lk->c, lid, rcode, &fam, a, synth ? 1 : 0, EGRESS_DNS_TTL);
}

static void refuse(struct link *lk, uint32_t lid, const char *name, uint16_t qtype,
                   enum proto_rcode rcode, const char *reason) {
  record_dns(lk->e->rec, name, qtype, false, reason);
  answer(lk, lid, rcode, 0);
}

/* The answer for an A query of an admitted NAME from the host's answer. */
static void decide(struct link *lk, uint32_t lid, const char *name, uint16_t qtype, int gai_err,
                   size_t n, const int *family, const uint8_t (*addr)[16]) {
  if (gai_err) {
    bool none = gai_err == EAI_NONAME || gai_err == EAI_NODATA;
    char why[EGRESS_REASON_MAX];
    snprintf(why, sizeof why, "%s: %s", none ? "no such name" : "resolve failed",
             gai_strerror(gai_err));
    refuse(lk, lid, name, qtype, none ? RCODE_NXDOMAIN : RCODE_SERVFAIL, why);
    return;
  }
  const char *first = NULL;
  for (size_t i = 0; i < n; i++) {
    const char *why = egress_addr_refusal(family[i], addr[i]);
    if (!*why) {
      uint32_t k = synth_get(lk->e, name);
      if (!k) {
        refuse(lk, lid, name, qtype, RCODE_REFUSED, "too many names in this session");
        return;
      }
      record_dns(lk->e->rec, name, qtype, true, NULL);
      answer(lk, lid, RCODE_NOERROR, k);
      return;
    }
    if (!first)
      first = why;
  }
  refuse(lk, lid, name, qtype, RCODE_NXDOMAIN, first ? first : "no address");
}

/* Whether the session's token bucket has a query left. */
static bool rate_ok(struct egress *e) {
  uint64_t now = mono_ms();
  if (!e->dns_refill_ms) {
    e->dns_tokens = EGRESS_DNS_RATE;
  } else {
    e->dns_tokens += (double)(now - e->dns_refill_ms) * EGRESS_DNS_RATE / 1000.0;
    if (e->dns_tokens > EGRESS_DNS_RATE)
      e->dns_tokens = EGRESS_DNS_RATE;
  }
  e->dns_refill_ms = now;
  if (e->dns_tokens < 1.0)
    return false;
  e->dns_tokens -= 1.0;
  return true;
}

void lookup_start(struct link *lk, uint32_t lid, const uint8_t *raw, size_t len, uint16_t qtype) {
  struct egress *e = lk->e;
  char name[EGRESS_NAME_BUF];
  bool valid = egress_name_sanitize(raw, len, name);
  if (egress_cfg.off || e->mode == EGRESS_MODE_NONE) {
    refuse(lk, lid, name, qtype, RCODE_NXDOMAIN,
           egress_cfg.off ? "egress is off" : "network is none");
    return;
  }
  if (!rate_ok(e)) {
    record_dns_rate(e->rec, name, qtype);
    answer(lk, lid, RCODE_REFUSED, 0);
    return;
  }
  /* A placeholder in a name (across labels too) would reach its servers. */
  if (valid && e->n_bind) {
    char flat[EGRESS_NAME_BUF];
    size_t k = 0;
    for (const char *q = name; *q; q++)
      if (*q != '.')
        flat[k++] = *q;
    flat[k] = 0;
    for (size_t i = 0; i < e->n_bind; i++)
      if (strstr(flat, e->bind[i].token)) {
        refuse(lk, lid, name, qtype, RCODE_NXDOMAIN, "secret sent to a host it is not for");
        return;
      }
  }
  if (!valid || (e->mode == EGRESS_MODE_ALLOW && !egress_policy_knows(&e->pol, name, strlen(name)))) {
    refuse(lk, lid, name, qtype, RCODE_NXDOMAIN,
           e->mode == EGRESS_MODE_ALLOW ? "not in allow_hosts" : "invalid name");
    return;
  }
  char why[EGRESS_REASON_MAX];
  if (!names_wild_admit(e, name, why)) {
    refuse(lk, lid, name, qtype, RCODE_NXDOMAIN, why);
    return;
  }
  if (qtype != 1) { /* AAAA, HTTPS, SVCB, TXT...: NOERROR, no answer */
    record_dns(e->rec, name, qtype, true, NULL);
    answer(lk, lid, RCODE_NOERROR, 0);
    return;
  }
  /* A name the hosts file pins, then the cache, then the pool. */
  struct resolve_job pinned;
  snprintf(pinned.name, sizeof pinned.name, "%s", name);
  if (resolve_hosts_answer(&pinned)) {
    decide(lk, lid, name, qtype, 0, pinned.n, pinned.family, pinned.addr);
    return;
  }
  const struct cache_ent *c = cache_find(e->owner_key, name, mono_ms());
  if (c) {
    decide(lk, lid, name, qtype, c->gai_err, c->n, c->family, c->addr);
    return;
  }
  struct lookup *q = calloc(1, sizeof *q);
  if (!q) {
    refuse(lk, lid, name, qtype, RCODE_SERVFAIL, "out of memory");
    return;
  }
  q->lk = lk;
  q->lid = lid;
  q->qtype = qtype;
  snprintf(q->name, sizeof q->name, "%s", name);
  if (broker_resolve(e, name, q, false, &q->job) < 0) {
    /* EGRESS_RESOLVE_JOBS_MAX of this session's are out (or the queue is
     * full): the program may ask again later. */
    free(q);
    refuse(lk, lid, name, qtype, RCODE_REFUSED, "resolver busy");
    return;
  }
  q->next = lk->lookups;
  lk->lookups = q;
}

static void lookup_unlink(struct lookup *q) {
  for (struct lookup **p = &q->lk->lookups; *p; p = &(*p)->next)
    if (*p == q) {
      *p = q->next;
      return;
    }
}

void lookup_resolved(struct lookup *q, struct resolve_job *j) {
  lookup_unlink(q);
  decide(q->lk, q->lid, q->name, q->qtype, j->gai_err, j->n, j->family, j->addr);
  free(q);
}

uint64_t lookup_timers(struct link *lk, uint64_t now) {
  uint64_t next = 0;
  for (struct lookup *q = lk->lookups, *n; q; q = n) {
    n = q->next;
    if (now >= q->job->deadline_ms) {
      /* A name a worker spent most of the time on is slow: asking again
       * soon would only hold another worker.  One still queued says
       * nothing about the name. */
      if (broker_abandon(q->job) >= EGRESS_RESOLVE_MS / 2)
        cache_timeout(lk->e->owner_key, q->name);
      lookup_unlink(q);
      refuse(lk, q->lid, q->name, q->qtype, RCODE_SERVFAIL, "resolve timed out");
      free(q);
    } else if (!next || q->job->deadline_ms < next) {
      next = q->job->deadline_ms;
    }
  }
  return next;
}

unsigned link_recheck_lookups(struct link *lk) {
  struct egress *e = lk->e;
  unsigned n = 0;
  for (struct lookup *q = lk->lookups, *next; q; q = next) {
    next = q->next;
    const char *why = e->mode == EGRESS_MODE_NONE ? "network is none"
                      : e->mode == EGRESS_MODE_ALLOW &&
                              !egress_policy_knows(&e->pol, q->name, strlen(q->name))
                          ? "not in allow_hosts"
                          : NULL;
    if (!why)
      continue;
    /* Out of the queue if no worker took it; one already asking the
     * host's resolver cannot be called back, but its answer goes nowhere. */
    broker_abandon(q->job);
    lookup_unlink(q);
    char reason[EGRESS_REASON_MAX];
    snprintf(reason, sizeof reason, "network_update: %s", why);
    refuse(lk, q->lid, q->name, q->qtype, RCODE_NXDOMAIN, reason);
    free(q);
    n++;
  }
  return n;
}

void lookup_drop_all(struct link *lk) {
  while (lk->lookups) {
    struct lookup *q = lk->lookups;
    lk->lookups = q->next;
    broker_abandon(q->job);
    free(q);
  }
}
