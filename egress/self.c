/* self.c: a sandbox never reaches the server it runs under.
 *
 * Under IGN_MCP_NET_PRIVATE=host a session may reach the host's loopback,
 * and with it the server's own --http endpoint, where a loopback server
 * without tokens serves whoever connects: from inside, a program could
 * list the server's sessions and run commands in them.  So before every
 * connect the broker asks whether the destination is a socket this process
 * listens on, whatever the session's policy and the operator's settings
 * say, and refuses it with a reason of its own.
 *
 * The listeners are found, not registered: every TCP socket listening in
 * the server's network namespace that is one of the process's descriptors,
 * so one that any part of the server makes, at startup or later, counts
 * (its --http socket, and any other).  A listener on a wildcard
 * address (0.0.0.0, ::) takes its port on every address of the host:
 * loopback, the interfaces' addresses; one on :: takes the IPv4 ones too
 * unless it is IPV6_V6ONLY.  A destination given as ::ffff:a.b.c.d is
 * a.b.c.d, and 0.0.0.0 or :: is loopback (where Linux connects them).
 *
 * Only an address of the host reaches a listener of the process, so a
 * connect elsewhere costs one routing question (none for loopback).  One to
 * the host itself (possible only under IGN_MCP_NET_PRIVATE=host) asks the
 * kernel's socket table (sock_diag) which TCP sockets listening in the
 * server's network namespace, any process's, take that address and port:
 * none, and it goes on; for each one, whether it is the server's, known by
 * its inode from an earlier look or, for an inode not seen before, by
 * scanning the server's descriptors (fstat of each) once.  A listener made
 * since is a new inode, so it is never missed; an inode found to be
 * another process's is trusted for SELF_FOREIGN_MS only.  Where the socket
 * table cannot be asked, every connect to the host scans the descriptors
 * for listening sockets (SO_ACCEPTCONN) and their addresses instead.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"
#include "egress/egress_int.h"

#define SELF_TAKERS_MAX 32u   /* listeners taking one destination; more: scan instead */
#define SELF_CACHE 64u        /* inodes remembered */
#define SELF_FOREIGN_MS 10000u
#define SELF_DIAG_MS 1000     /* the kernel's answer */

/* The destination, as the connect will reach it. */
struct dest {
  int family;
  uint8_t addr[16];
  uint16_t port;
};

static bool all_zero(const uint8_t *a, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (a[i])
      return false;
  return true;
}

static size_t alen(int family) { return family == AF_INET ? 4 : 16; }

/* Whether D is an address of the host (loopback included): 1, 0, -errno. */
static int dest_local(const struct dest *d) {
  if (d->family == AF_INET && d->addr[0] == 127)
    return 1;
  if (d->family == AF_INET6 && all_zero(d->addr, 15) && d->addr[15] == 1)
    return 1;
  return egress_addr_local(d->family, d->addr);
}

/* A listening socket, as bound. */
struct listener {
  int family;               /* a v4-mapped address as AF_INET */
  const uint8_t *addr;
  uint16_t port;
  bool v6only;
};

/* Whether L takes a connect to D, an address of the host. */
static bool takes(const struct listener *l, const struct dest *d) {
  if (l->port != d->port)
    return false;
  if (!all_zero(l->addr, alen(l->family)))
    return l->family == d->family && memcmp(l->addr, d->addr, alen(l->family)) == 0;
  /* A wildcard: every address of the host, v4 ones too on a dual-stack v6. */
  return l->family == d->family || (l->family == AF_INET6 && !l->v6only);
}

/* L from a socket address (family, address, port), v4-mapped as v4. */
static bool listener_of(struct listener *l, int family, const uint8_t *a6or4, uint16_t port,
                        bool v6only) {
  static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (family != AF_INET && family != AF_INET6)
    return false; /* unix and the like: no address a stream reaches */
  *l = (struct listener){.family = family, .addr = a6or4, .port = port, .v6only = v6only};
  if (family == AF_INET6 && memcmp(a6or4, mapped, 12) == 0) {
    l->family = AF_INET;
    l->addr += 12;
  }
  return true;
}

/* Whether the listening socket FD takes a connect to D. */
static bool fd_takes(int fd, const struct dest *d) {
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0)
    return false; /* closed meanwhile: nothing listens there any more */
  struct listener l;
  if (ss.ss_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)&ss;
    return listener_of(&l, AF_INET, (const uint8_t *)&in->sin_addr, ntohs(in->sin_port), false) &&
           takes(&l, d);
  }
  if (ss.ss_family != AF_INET6)
    return false;
  const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)&ss;
  int v = 0;
  socklen_t vl = sizeof v;
  bool v6only = getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v, &vl) == 0 && v;
  return listener_of(&l, AF_INET6, in6->sin6_addr.s6_addr, ntohs(in6->sin6_port), v6only) &&
         takes(&l, d);
}

/* The descriptors of this process, one by one: FN(fd, ctx) until it says
 * true (then true).  -errno when they cannot be listed. */
static int each_fd(bool (*fn)(int fd, void *ctx), void *ctx) {
  int dfd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *dir = dfd >= 0 ? fdopendir(dfd) : NULL;
  if (!dir) {
    int err = -errno;
    if (dfd >= 0)
      close(dfd);
    return err;
  }
  bool stop = false;
  for (struct dirent *de; !stop && (de = readdir(dir));) {
    char *end;
    long fd = strtol(de->d_name, &end, 10);
    if (!*end && end != de->d_name && fd != dfd)
      stop = fn((int)fd, ctx);
  }
  closedir(dir);
  return stop;
}

static bool fd_listens_and_takes(int fd, void *ctx) {
  int on = 0;
  socklen_t ol = sizeof on;
  return getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &ol) == 0 && on && fd_takes(fd, ctx);
}

/* ---- the kernel's socket table ---- */

/* The inodes of the TCP sockets listening in this network namespace (any
 * process's) of FAMILY that take D, added to RET (*RET_N of them,
 * SELF_TAKERS_MAX at most).  0, or -errno (-E2BIG: too many). */
static int diag_family(int family, const struct dest *d, uint32_t *ret, size_t *ret_n) {
  struct {
    struct nlmsghdr nh;
    struct inet_diag_req_v2 r;
  } req = {
      .nh = {.nlmsg_len = sizeof req, .nlmsg_type = SOCK_DIAG_BY_FAMILY,
             .nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP, .nlmsg_seq = 1},
      .r = {.sdiag_family = (uint8_t)family, .sdiag_protocol = IPPROTO_TCP,
            .idiag_states = 1u << TCP_LISTEN},
  };
  _cleanup_close_ int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0)
    return -errno;
  if (send(fd, &req, sizeof req, 0) < 0)
    return -errno;
  union {
    struct nlmsghdr nh;
    uint8_t b[32768];
  } buf;
  for (;;) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, SELF_DIAG_MS) != 1)
      return -ETIMEDOUT;
    ssize_t n = recv(fd, &buf, sizeof buf, 0);
    if (n < 0)
      return -errno;
    for (struct nlmsghdr *nh = &buf.nh; NLMSG_OK(nh, (size_t)n); nh = NLMSG_NEXT(nh, n)) {
      if (nh->nlmsg_type == NLMSG_DONE)
        return 0;
      if (nh->nlmsg_type == NLMSG_ERROR) {
        const struct nlmsgerr *e = NLMSG_DATA(nh);
        return nh->nlmsg_len >= NLMSG_LENGTH(sizeof *e) && e->error ? e->error : -EPROTO;
      }
      if (nh->nlmsg_type != SOCK_DIAG_BY_FAMILY || nh->nlmsg_len < NLMSG_LENGTH(sizeof(struct inet_diag_msg)))
        return -EPROTO;
      const struct inet_diag_msg *m = NLMSG_DATA(nh);
      bool v6only = false;
      int alen_ = (int)(nh->nlmsg_len - NLMSG_LENGTH(sizeof *m));
      for (const struct rtattr *a = (const struct rtattr *)(m + 1); RTA_OK(a, alen_);
           a = RTA_NEXT(a, alen_))
        if (a->rta_type == INET_DIAG_SKV6ONLY && RTA_PAYLOAD(a) >= 1)
          v6only = *(const uint8_t *)RTA_DATA(a);
      struct listener l;
      if (!listener_of(&l, m->idiag_family, (const uint8_t *)m->id.idiag_src,
                       ntohs(m->id.idiag_sport), v6only) ||
          !takes(&l, d))
        continue;
      if (*ret_n >= SELF_TAKERS_MAX)
        return -E2BIG;
      ret[(*ret_n)++] = m->idiag_inode;
    }
  }
}

/* ---- which inodes are the server's ---- */

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  uint32_t ino;            /* 0: free */
  bool own;
  uint64_t until_ms;       /* another process's: trusted until then */
} cache[SELF_CACHE];
static size_t cache_next;

/* 1 the server's, 0 another process's, -1 not known.  Under cache_lock. */
static int cache_get(uint32_t ino, uint64_t now) {
  for (size_t i = 0; i < SELF_CACHE; i++)
    if (cache[i].ino == ino && (cache[i].own || now < cache[i].until_ms))
      return cache[i].own;
  return -1;
}

static void cache_put(uint32_t ino, bool own, uint64_t now) {
  size_t slot = cache_next;
  for (size_t i = 0; i < SELF_CACHE; i++)
    if (cache[i].ino == ino)
      slot = i;
  if (slot == cache_next)
    cache_next = (cache_next + 1) % SELF_CACHE;
  cache[slot].ino = ino;
  cache[slot].own = own;
  cache[slot].until_ms = now + SELF_FOREIGN_MS;
}

struct wanted {
  const uint32_t *ino;
  size_t n;
  bool *own;
};

static bool fd_is_wanted(int fd, void *ctx) {
  struct wanted *w = ctx;
  struct stat st;
  if (fstat(fd, &st) < 0 || !S_ISSOCK(st.st_mode))
    return false;
  for (size_t i = 0; i < w->n; i++)
    if ((uint32_t)st.st_ino == w->ino[i])
      w->own[i] = true;
  return false;
}

/* Whether one of the N listeners INO is the server's: 1, 0, or -errno. */
static int any_own(const uint32_t *ino, size_t n) {
  uint64_t now = mono_ms();
  uint32_t unknown[SELF_TAKERS_MAX];
  size_t nu = 0;
  pthread_mutex_lock(&cache_lock);
  int r = 0;
  for (size_t i = 0; i < n && !r; i++) {
    int c = cache_get(ino[i], now);
    if (c < 0)
      unknown[nu++] = ino[i];
    r = c == 1;
  }
  pthread_mutex_unlock(&cache_lock);
  if (r || !nu)
    return r;
  bool own[SELF_TAKERS_MAX] = {0};
  struct wanted w = {.ino = unknown, .n = nu, .own = own};
  int e = each_fd(fd_is_wanted, &w);
  if (e < 0)
    return e;
  pthread_mutex_lock(&cache_lock);
  for (size_t i = 0; i < nu; i++) {
    cache_put(unknown[i], own[i], now);
    r |= own[i];
  }
  pthread_mutex_unlock(&cache_lock);
  return r;
}

/* D normalized from FAMILY/ADDR; false for a family no stream has. */
static bool dest_of(struct dest *d, int family, const uint8_t *addr, uint16_t port) {
  *d = (struct dest){.family = family, .port = port};
  if (family == AF_INET6 && IN6_IS_ADDR_V4MAPPED((const struct in6_addr *)addr)) {
    d->family = AF_INET;
    addr += 12;
  } else if (family != AF_INET && family != AF_INET6) {
    return false;
  }
  memcpy(d->addr, addr, alen(d->family));
  if (all_zero(d->addr, alen(d->family))) { /* Linux connects 0.0.0.0 and :: to loopback */
    static const uint8_t lo4[4] = {127, 0, 0, 1}, lo6[16] = {[15] = 1};
    memcpy(d->addr, d->family == AF_INET ? lo4 : lo6, alen(d->family));
  }
  return true;
}

static const char *scan_refusal(const struct dest *d) {
  int r = each_fd(fd_listens_and_takes, (void *)d);
  if (r < 0)
    return "cannot list the server's own listening sockets (/proc/self/fd)";
  return r ? EGRESS_SELF_REASON : NULL;
}

const char *egress_self_refusal_by_scan(int family, const uint8_t *addr, uint16_t port) {
  struct dest d;
  if (!dest_of(&d, family, addr, port))
    return NULL;
  int local = dest_local(&d);
  if (local < 0)
    return "cannot tell whether the address is the host's own";
  return local ? scan_refusal(&d) : NULL;
}

const char *egress_self_refusal(int family, const uint8_t *addr, uint16_t port) {
  struct dest d;
  if (!dest_of(&d, family, addr, port))
    return NULL;
  int local = dest_local(&d);
  if (!local)
    return NULL;
  if (local < 0)
    return "cannot tell whether the address is the host's own";
  uint32_t ino[SELF_TAKERS_MAX];
  size_t n = 0;
  int r = d.family == AF_INET ? diag_family(AF_INET, &d, ino, &n) : 0;
  if (r == 0)
    r = diag_family(AF_INET6, &d, ino, &n);
  if (r < 0) /* no socket table here (or too many takers): the descriptors */
    return scan_refusal(&d);
  if (!n)
    return NULL;
  r = any_own(ino, n);
  if (r < 0)
    return "cannot list the server's own sockets (/proc/self/fd)";
  return r ? EGRESS_SELF_REASON : NULL;
}
