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
 * The listeners are found, not registered: every socket of the process in
 * the listening state (SO_ACCEPTCONN; its descriptors from /proc/self/fd)
 * with the address it is bound to (getsockname), so one that any part of
 * the server makes, at startup or later, counts.  A listener on a wildcard
 * address (0.0.0.0, ::) takes its port on every address of the host:
 * loopback, the interfaces' addresses; one on :: takes the IPv4 ones too
 * unless it is IPV6_V6ONLY.  A destination given as ::ffff:a.b.c.d is
 * a.b.c.d, and 0.0.0.0 or :: is loopback (where Linux connects them).
 *
 * Only an address of the host reaches a listener of the process, so a
 * connect elsewhere costs one routing question (none for loopback); one
 * to the host itself, possible only under IGN_MCP_NET_PRIVATE=host, scans
 * the descriptors afresh (a system call each), so that no listener made
 * since is missed.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "egress/egress_int.h"

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

/* Whether the listening socket FD takes a connect to D, an address of the
 * host. */
static bool listener_takes(int fd, const struct dest *d) {
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0)
    return false; /* closed meanwhile: nothing listens there any more */
  int family = ss.ss_family;
  const uint8_t *a;
  uint16_t port;
  bool v6only = false;
  if (family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)&ss;
    a = (const uint8_t *)&in->sin_addr;
    port = ntohs(in->sin_port);
  } else if (family == AF_INET6) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)&ss;
    a = in6->sin6_addr.s6_addr;
    port = ntohs(in6->sin6_port);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      family = AF_INET;
      a += 12;
    } else {
      int v = 0;
      socklen_t vl = sizeof v;
      v6only = getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v, &vl) == 0 && v;
    }
  } else {
    return false; /* unix and the like: no address a stream reaches */
  }
  if (port != d->port)
    return false;
  if (!all_zero(a, alen(family)))
    return family == d->family && memcmp(a, d->addr, alen(family)) == 0;
  /* A wildcard: every address of the host, v4 ones too on a dual-stack v6. */
  return family == d->family || (family == AF_INET6 && !v6only);
}

const char *egress_self_refusal(int family, const uint8_t *addr, uint16_t port) {
  struct dest d = {.family = family, .port = port};
  if (family == AF_INET6 && IN6_IS_ADDR_V4MAPPED((const struct in6_addr *)addr)) {
    d.family = AF_INET;
    addr += 12;
  } else if (family != AF_INET && family != AF_INET6) {
    return NULL;
  }
  memcpy(d.addr, addr, alen(d.family));
  if (all_zero(d.addr, alen(d.family))) { /* Linux connects 0.0.0.0 and :: to loopback */
    static const uint8_t lo4[4] = {127, 0, 0, 1}, lo6[16] = {[15] = 1};
    memcpy(d.addr, d.family == AF_INET ? lo4 : lo6, alen(d.family));
  }

  int local = dest_local(&d);
  if (!local)
    return NULL;
  if (local < 0)
    return "cannot tell whether the address is the host's own";

  int dfd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *dir = dfd >= 0 ? fdopendir(dfd) : NULL;
  if (!dir) {
    if (dfd >= 0)
      close(dfd);
    return "cannot list the server's own listening sockets (/proc/self/fd)";
  }
  bool found = false;
  for (struct dirent *de; !found && (de = readdir(dir));) {
    char *end;
    long fd = strtol(de->d_name, &end, 10);
    if (*end || end == de->d_name || fd == dfd)
      continue;
    int on = 0;
    socklen_t ol = sizeof on;
    found = getsockopt((int)fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &ol) == 0 && on &&
            listener_takes((int)fd, &d);
  }
  closedir(dir);
  return found ? EGRESS_SELF_REASON : NULL;
}
