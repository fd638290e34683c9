/* test_egress_nl.c: egress_capture_setup (guest/egress_nl.c) for real.  Each
 * test forks a child that unshares a user and a network namespace (as root
 * and as a user alike), brings lo up, installs the capture and checks what
 * it does to traffic, not the ruleset's text: TCP to any address reaches
 * one dual-stack listener on EGRESS_TCP_PORT with SO_ORIGINAL_DST naming
 * the address asked for, DNS to any server reaches EGRESS_DNS_PORT and the
 * answer seems to come from that server, loopback stays loopback, other UDP
 * is refused, and a process without capabilities cannot remove the rules.
 * A kernel that refuses unprivileged user namespaces skips the tests. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "guest/egress_nl.h"
#include "tests/unit/test.h"

#define ORIGINAL_DST 80 /* SO_ORIGINAL_DST on SOL_IP, IP6T_SO_ORIGINAL_DST on SOL_IPV6 */

static const char *skip_reason;

/* ---- the namespace ------------------------------------------------------- */

static int write_file(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0)
    return -1;
  ssize_t n = write(fd, text, strlen(text));
  close(fd);
  return n < 0 ? -1 : 0;
}

/* Root of a new user namespace owning a new network namespace, lo up. */
static int enter_netns(void) {
  char map[32];
  unsigned uid = (unsigned)geteuid(), gid = (unsigned)getegid();
  if (unshare(CLONE_NEWUSER | CLONE_NEWNET) < 0)
    return -errno;
  snprintf(map, sizeof map, "0 %u 1", uid);
  if (write_file("/proc/self/setgroups", "deny") < 0 || write_file("/proc/self/uid_map", map) < 0)
    return -errno;
  snprintf(map, sizeof map, "0 %u 1", gid);
  if (write_file("/proc/self/gid_map", map) < 0)
    return -errno;
  int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct ifreq ifr = {.ifr_name = "lo"};
  int r = s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr) < 0 ? -errno : 0;
  ifr.ifr_flags |= IFF_UP;
  if (r == 0 && ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
    r = -errno;
  if (s >= 0)
    close(s);
  return r;
}

/* Run FN in a child inside its own namespaces; its failed checks count here. */
static void in_netns(void (*fn)(void)) {
  if (skip_reason)
    return;
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    test_failures_ = 0; /* the parent counts its own */
    int r = enter_netns();
    if (r < 0) {
      fprintf(stderr, "  cannot enter a user and network namespace: %s\n", strerror(-r));
      _exit(101);
    }
    fn();
    fflush(NULL);
    _exit(test_failures_ > 100 ? 100 : test_failures_);
  }
  int status;
  CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
  if (pid <= 0)
    return;
  CHECK(WIFEXITED(status));
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
    test_failures_ += WEXITSTATUS(status);
}

static void setup_capture(void) {
  char err[256] = "";
  int r = egress_capture_setup(err, sizeof err);
  if (r < 0)
    fprintf(stderr, "  egress_capture_setup: %s\n", err);
  CHECK_EQ_INT(r, 0);
  CHECK_STREQ(err, "");
}

/* ---- sockets ------------------------------------------------------------- */

static void timeouts(int fd) {
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

/* A dual-stack socket of TYPE bound to [::]:PORT (listening for TCP). */
static int listen_any(int type, uint16_t port) {
  int fd = socket(AF_INET6, type | SOCK_CLOEXEC, 0), zero = 0;
  struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons(port),
                           .sin6_addr = IN6ADDR_ANY_INIT};
  CHECK(fd >= 0);
  CHECK(setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero) == 0);
  CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
  if (type == SOCK_STREAM)
    CHECK(listen(fd, 16) == 0);
  timeouts(fd);
  return fd;
}

static socklen_t sockaddr_of(const char *ip, uint16_t port, struct sockaddr_storage *ret) {
  memset(ret, 0, sizeof *ret);
  struct sockaddr_in *v4 = (struct sockaddr_in *)ret;
  struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)ret;
  if (inet_pton(AF_INET, ip, &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    return sizeof *v4;
  }
  CHECK(inet_pton(AF_INET6, ip, &v6->sin6_addr) == 1);
  v6->sin6_family = AF_INET6;
  v6->sin6_port = htons(port);
  return sizeof *v6;
}

/* A socket of TYPE connected to IP:PORT, or -1 with errno. */
static int connect_to(int type, const char *ip, uint16_t port) {
  struct sockaddr_storage a;
  socklen_t len = sockaddr_of(ip, port, &a);
  int fd = socket(a.ss_family, type | SOCK_CLOEXEC, 0);
  CHECK(fd >= 0);
  timeouts(fd);
  if (connect(fd, (struct sockaddr *)&a, len) < 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

/* "ip:port" of a sockaddr; a v4-mapped v6 address is shown as v4. */
static const char *addr_str(const struct sockaddr_storage *a, char buf[64]) {
  char ip[INET6_ADDRSTRLEN] = "?";
  unsigned port = 0;
  if (a->ss_family == AF_INET) {
    const struct sockaddr_in *v4 = (const struct sockaddr_in *)a;
    inet_ntop(AF_INET, &v4->sin_addr, ip, sizeof ip);
    port = ntohs(v4->sin_port);
  } else if (a->ss_family == AF_INET6) {
    const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)a;
    if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr))
      inet_ntop(AF_INET, &v6->sin6_addr.s6_addr[12], ip, sizeof ip);
    else
      inet_ntop(AF_INET6, &v6->sin6_addr, ip, sizeof ip);
    port = ntohs(v6->sin6_port);
  }
  snprintf(buf, 64, "%s:%u", ip, port);
  return buf;
}

/* The original destination of an accepted connection, as the agent asks
 * for it: SOL_IP for v4 (also on a dual-stack socket), else SOL_IPV6. */
static const char *original_dst(int fd, char buf[64]) {
  struct sockaddr_storage a = {0};
  socklen_t len = sizeof(struct sockaddr_in);
  if (getsockopt(fd, SOL_IP, ORIGINAL_DST, &a, &len) < 0) {
    len = sizeof(struct sockaddr_in6);
    if (getsockopt(fd, SOL_IPV6, ORIGINAL_DST, &a, &len) < 0) {
      snprintf(buf, 64, "(%s)", strerror(errno));
      return buf;
    }
  }
  return addr_str(&a, buf);
}

/* Connect to IP:PORT; the connection must arrive at LISTENER with ORIGINAL
 * as its original destination. */
static void expect_tcp_at(int listener, const char *ip, uint16_t port, const char *original) {
  int c = connect_to(SOCK_STREAM, ip, port);
  if (c < 0)
    fprintf(stderr, "  connect %s port %u: %s\n", ip, port, strerror(errno));
  CHECK(c >= 0);
  if (c < 0)
    return;
  int s = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
  CHECK(s >= 0);
  if (s >= 0) {
    char buf[64];
    if (original)
      CHECK_STREQ(original_dst(s, buf), original);
    close(s);
  }
  close(c);
}

/* ---- the tests ------------------------------------------------------------ */

static void tcp_redirected_body(void) {
  setup_capture();
  int l = listen_any(SOCK_STREAM, EGRESS_TCP_PORT);
  expect_tcp_at(l, "93.184.216.34", 443, "93.184.216.34:443");
  expect_tcp_at(l, "2606:2800:220:1::1", 80, "2606:2800:220:1::1:80");
  expect_tcp_at(l, "10.1.2.3", 22, "10.1.2.3:22");
  /* Straight to the agent's port: no NAT, so the "original" is the port
   * itself (the agent refuses it as not redirected). */
  expect_tcp_at(l, "127.0.0.1", EGRESS_TCP_PORT, "127.0.0.1:15001");
  close(l);
}

static void tcp_to_any_address_reaches_the_listener(void) {
  in_netns(tcp_redirected_body);
}

static void dns_redirected_body(void) {
  setup_capture();
  int d = listen_any(SOCK_DGRAM, EGRESS_DNS_PORT);
  int u = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  timeouts(u);
  struct sockaddr_storage to, from, peer;
  socklen_t to_len = sockaddr_of("8.8.8.8", 53, &to), len;
  char buf[64], got[8];
  CHECK(sendto(u, "q", 1, 0, (struct sockaddr *)&to, to_len) == 1);
  len = sizeof peer;
  CHECK(recvfrom(d, got, sizeof got, 0, (struct sockaddr *)&peer, &len) == 1);
  CHECK(sendto(d, "a", 1, 0, (struct sockaddr *)&peer, len) == 1);
  len = sizeof from;
  memset(&from, 0, sizeof from);
  CHECK(recvfrom(u, got, sizeof got, 0, (struct sockaddr *)&from, &len) == 1);
  /* glibc drops an answer from another address than it asked. */
  CHECK_STREQ(addr_str(&from, buf), "8.8.8.8:53");
  close(u);
  close(d);

  /* DNS over TCP, to another server, reaches the same port. */
  int t = listen_any(SOCK_STREAM, EGRESS_DNS_PORT);
  expect_tcp_at(t, "1.1.1.1", 53, "1.1.1.1:53");
  close(t);
}

static void dns_to_any_server_reaches_the_dns_port(void) {
  in_netns(dns_redirected_body);
}

static void local_body(void) {
  setup_capture();
  int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_storage a;
  socklen_t len = sockaddr_of("127.0.0.1", 8080, &a);
  CHECK(bind(l, (struct sockaddr *)&a, len) == 0 && listen(l, 4) == 0);
  timeouts(l);
  expect_tcp_at(l, "127.0.0.1", 8080, NULL);
  close(l);
  /* Nothing listens on [::1]:8080: refused there, not redirected. */
  CHECK(connect_to(SOCK_STREAM, "::1", 8080) < 0 && errno == ECONNREFUSED);
}

static void loopback_stays_local(void) {
  in_netns(local_body);
}

static void udp_refused_body(void) {
  setup_capture();
  int u = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct sockaddr_storage to;
  socklen_t len = sockaddr_of("8.8.8.8", 123, &to);
  errno = 0;
  CHECK(sendto(u, "x", 1, 0, (struct sockaddr *)&to, len) < 0);
  CHECK_EQ_INT(errno, EPERM);
  close(u);
}

static void other_udp_is_refused(void) {
  in_netns(udp_refused_body);
}

/* A line of PATH that contains every one of the words. */
static bool file_has_line(const char *path, const char *a, const char *b) {
  FILE *f = fopen(path, "re");
  char line[512];
  bool found = false;
  while (f && !found && fgets(line, sizeof line, f))
    found = strstr(line, a) && strstr(line, b);
  if (f)
    fclose(f);
  return found;
}

static void routes_body(void) {
  setup_capture();
  /* Iface, destination 0.0.0.0, gateway 0.0.0.0. */
  CHECK(file_has_line("/proc/net/route", "lo\t00000000\t00000000", ""));
  /* ::/0, no gateway, through lo. */
  CHECK(file_has_line("/proc/net/ipv6_route", "00000000000000000000000000000000 00 ", " lo\n"));
}

static void default_routes_through_lo(void) {
  in_netns(routes_body);
}

/* ---- raw netlink for the refusal tests ------------------------------------ */

/* Send MSG (LEN bytes) on a netlink socket of PROTOCOL; the first error ack,
 * 0 for none. */
static int nl_request(int protocol, const void *msg, size_t len) {
  int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, protocol);
  if (fd < 0)
    return -errno;
  timeouts(fd);
  struct sockaddr_nl k = {.nl_family = AF_NETLINK};
  int r = 0;
  if (sendto(fd, msg, len, 0, (struct sockaddr *)&k, sizeof k) < 0)
    r = -errno;
  _Alignas(struct nlmsghdr) char buf[8192];
  ssize_t n = r ? 0 : recv(fd, buf, sizeof buf, 0);
  for (struct nlmsghdr *h = (struct nlmsghdr *)buf; n > 0 && NLMSG_OK(h, (size_t)n) && !r;
       h = NLMSG_NEXT(h, n))
    if (h->nlmsg_type == NLMSG_ERROR)
      r = ((struct nlmsgerr *)NLMSG_DATA(h))->error;
  close(fd);
  return r;
}

struct nl_msg {
  struct nlmsghdr h;
  struct nfgenmsg g;
  char attrs[64];
};

static size_t nl_add(char *p, size_t off, struct nlmsghdr h, struct nfgenmsg g, const char *table) {
  struct nl_msg m = {.h = h, .g = g};
  size_t len = NLMSG_LENGTH(sizeof g);
  if (table) {
    struct nlattr *a = (struct nlattr *)m.attrs;
    a->nla_type = NFTA_TABLE_NAME;
    a->nla_len = (uint16_t)(NLA_HDRLEN + strlen(table) + 1);
    memcpy(m.attrs + NLA_HDRLEN, table, strlen(table) + 1);
    len += NLA_ALIGN(a->nla_len);
  }
  m.h.nlmsg_len = (uint32_t)len;
  memcpy(p + off, &m, len);
  return off + NLMSG_ALIGN(len);
}

/* delete table inet ign_egress, as a batch: 0 or the kernel's error. */
static int delete_table(void) {
  _Alignas(struct nlmsghdr) char buf[256] = {0};
  struct nfgenmsg batch = {.nfgen_family = AF_UNSPEC, .res_id = htons(NFNL_SUBSYS_NFTABLES)};
  struct nfgenmsg inet = {.nfgen_family = NFPROTO_INET};
  size_t off = nl_add(buf, 0, (struct nlmsghdr){.nlmsg_type = NFNL_MSG_BATCH_BEGIN,
                                                .nlmsg_flags = NLM_F_REQUEST, .nlmsg_seq = 1},
                      batch, NULL);
  off = nl_add(buf, off,
               (struct nlmsghdr){.nlmsg_type = NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_DELTABLE,
                                 .nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK, .nlmsg_seq = 2},
               inet, "ign_egress");
  off = nl_add(buf, off, (struct nlmsghdr){.nlmsg_type = NFNL_MSG_BATCH_END,
                                           .nlmsg_flags = NLM_F_REQUEST, .nlmsg_seq = 3},
               batch, NULL);
  return nl_request(NETLINK_NETFILTER, buf, off);
}

/* ip -6 route add default dev lo */
static int add_v6_default_route(void) {
  struct {
    struct nlmsghdr h;
    struct rtmsg r;
    struct nlattr a;
    uint32_t oif;
  } m = {
      .h = {.nlmsg_len = sizeof m, .nlmsg_type = RTM_NEWROUTE,
            .nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL},
      .r = {.rtm_family = AF_INET6, .rtm_table = RT_TABLE_MAIN, .rtm_protocol = RTPROT_BOOT,
            .rtm_scope = RT_SCOPE_UNIVERSE, .rtm_type = RTN_UNICAST},
      .a = {.nla_len = NLA_HDRLEN + 4, .nla_type = RTA_OIF},
      .oif = if_nametoindex("lo"),
  };
  return nl_request(NETLINK_ROUTE, &m, sizeof m);
}

static void no_caps_body(void) {
  setup_capture();
  /* Every capability gone, as in the ns sandbox after confine. */
  struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3};
  struct __user_cap_data_struct d[2] = {0};
  CHECK(syscall(SYS_capset, &h, d) == 0);
  CHECK_EQ_INT(delete_table(), -EPERM);
  /* And the capture is still there. */
  int l = listen_any(SOCK_STREAM, EGRESS_TCP_PORT);
  expect_tcp_at(l, "93.184.216.34", 443, "93.184.216.34:443");
  close(l);
}

static void without_capabilities_the_rules_stay(void) {
  in_netns(no_caps_body);
}

static void twice_body(void) {
  setup_capture();
  char err[256] = "";
  CHECK_EQ_INT(egress_capture_setup(err, sizeof err), -EEXIST);
  CHECK(strstr(err, "table inet ign_egress") != NULL);
  /* The first capture is untouched. */
  int l = listen_any(SOCK_STREAM, EGRESS_TCP_PORT);
  expect_tcp_at(l, "10.1.2.3", 22, "10.1.2.3:22");
  close(l);
}

static void a_second_setup_fails_and_keeps_the_first(void) {
  in_netns(twice_body);
}

static void undo_body(void) {
  /* The v6 route is there already: its RTM_NEWROUTE fails, the last step. */
  CHECK_EQ_INT(add_v6_default_route(), 0);
  char err[256] = "";
  CHECK_EQ_INT(egress_capture_setup(err, sizeof err), -EEXIST);
  CHECK(strstr(err, "route -6 default dev lo") != NULL);
  /* Undone: the table (deleting it again finds none), the v4 route. */
  CHECK_EQ_INT(delete_table(), -ENOENT);
  CHECK(connect_to(SOCK_STREAM, "93.184.216.34", 443) < 0 && errno == ENETUNREACH);
  CHECK(!file_has_line("/proc/net/route", "lo\t00000000\t00000000", ""));
}

static void a_failed_route_undoes_the_rest(void) {
  in_netns(undo_body);
}

/* ---- the refusal counters ------------------------------------------------- */

static void read_counts(uint64_t ret[EGRESS_REFUSED_N]) {
  char err[256] = "";
  int r = egress_refused_read(ret, err, sizeof err);
  if (r < 0)
    fprintf(stderr, "  egress_refused_read: %s\n", err);
  CHECK_EQ_INT(r, 0);
}

/* sendto IP:PORT on a socket of FAMILY, TYPE, PROTO: 0 or the errno. */
static int send_one(int type, int proto, const char *ip, uint16_t port, const void *p, size_t n) {
  struct sockaddr_storage to;
  socklen_t len = sockaddr_of(ip, port, &to);
  int fd = socket(to.ss_family, type | SOCK_CLOEXEC, proto);
  if (fd < 0)
    return errno;
  int r = sendto(fd, p, n, 0, (struct sockaddr *)&to, len) < 0 ? errno : 0;
  close(fd);
  return r;
}

static void counters_body(void) {
  setup_capture();
  uint64_t c[EGRESS_REFUSED_N] = {9, 9, 9};
  read_counts(c);
  CHECK_EQ_INT(c[EGRESS_REFUSED_UDP], 0);
  CHECK_EQ_INT(c[EGRESS_REFUSED_ICMP], 0);
  CHECK_EQ_INT(c[EGRESS_REFUSED_OTHER], 0);
  /* UDP, v4 and v6: refused and counted. */
  CHECK_EQ_INT(send_one(SOCK_DGRAM, 0, "8.8.8.8", 123, "x", 1), EPERM);
  CHECK_EQ_INT(send_one(SOCK_DGRAM, 0, "8.8.8.8", 123, "x", 1), EPERM);
  CHECK_EQ_INT(send_one(SOCK_DGRAM, 0, "2001:4860:4860::8888", 123, "x", 1), EPERM);
  /* Not refused, not counted: DNS (redirected), loopback, TCP (redirected). */
  CHECK_EQ_INT(send_one(SOCK_DGRAM, 0, "8.8.8.8", 53, "x", 1), 0);
  CHECK_EQ_INT(send_one(SOCK_DGRAM, 0, "127.0.0.1", 9, "x", 1), 0);
  CHECK(connect_to(SOCK_STREAM, "93.184.216.34", 443) < 0);
  /* Root of the user namespace has CAP_NET_RAW in its network namespace:
   * an echo request by a raw socket, v4 and v6, and a protocol of no name
   * (253, for experiments). */
  static const uint8_t echo4[8] = {8, 0, 0xf7, 0xff}, echo6[8] = {128, 0};
  CHECK_EQ_INT(send_one(SOCK_RAW, IPPROTO_ICMP, "8.8.8.8", 0, echo4, sizeof echo4), EPERM);
  CHECK_EQ_INT(send_one(SOCK_RAW, IPPROTO_ICMPV6, "2001:4860:4860::8888", 0, echo6, sizeof echo6),
               EPERM);
  CHECK_EQ_INT(send_one(SOCK_RAW, 253, "8.8.8.8", 0, "x", 1), EPERM);
  read_counts(c);
  CHECK_EQ_INT(c[EGRESS_REFUSED_UDP], 3);
  CHECK_EQ_INT(c[EGRESS_REFUSED_ICMP], 2);
  CHECK_EQ_INT(c[EGRESS_REFUSED_OTHER], 1);
  /* The rules gone (a vm's root may flush them): an error that says so. */
  CHECK_EQ_INT(delete_table(), 0);
  char err[256] = "";
  CHECK_EQ_INT(egress_refused_read(c, err, sizeof err), -ENOENT);
  CHECK(strstr(err, "gone") != NULL);
}

static void refused_packets_are_counted(void) {
  in_netns(counters_body);
}

/* ---- the counters read from outside (ns) ------------------------------------ */

/* One byte each way on FD; false at EOF or on an error. */
static bool put_byte(int fd, char c) { return write(fd, &c, 1) == 1; }
static bool get_byte(int fd, char want) {
  char c;
  return read(fd, &c, 1) == 1 && c == want;
}

#define OTHER_OPENER_FD (AGENT_NS_COUNTERS_FD + 1)

/* The ns agent's part, in its own user and network namespaces: the capture
 * and the counters' socket, then no capability (as confine.c leaves it);
 * its own dump on the socket is refused.  A second socket opened after the
 * drop stands for one a process without the capability opened.  Then it
 * sends one refused UDP packet when told ('u') and waits for EOF. */
static void agent_side(int to_host, int from_host, uid_t host_euid) {
  if (enter_netns() < 0)
    _exit(101);
  setup_capture();
  char err[256] = "";
  close(AGENT_NS_COUNTERS_FD);
  int r = egress_counters_keep_socket(err, sizeof err);
  if (r < 0)
    fprintf(stderr, "  egress_counters_keep_socket: %s\n", err);
  CHECK_EQ_INT(r, 0);
  CHECK(fcntl(AGENT_NS_COUNTERS_FD, F_GETFD) == FD_CLOEXEC);
  struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3};
  struct __user_cap_data_struct d[2] = {0};
  CHECK(syscall(SYS_capset, &h, d) == 0);
  /* Not dumpable, as the agent is.  The kernel then asks for ptrace
   * capability over the user namespace the process was exec'd in: the
   * sandbox's for the agent, but ours here (we only forked), where a user
   * has none; so only as root. */
  if (host_euid == 0)
    CHECK(prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0);
  uint64_t c[EGRESS_REFUSED_N];
  CHECK_EQ_INT(nft_refused_dump(AGENT_NS_COUNTERS_FD, 1000, c, err, sizeof err), -EPERM);
  CHECK(strstr(err, "not permitted") != NULL);
  int other = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
  CHECK(other >= 0 && dup3(other, OTHER_OPENER_FD, O_CLOEXEC) == OTHER_OPENER_FD);
  put_byte(to_host, 'r');
  if (get_byte(from_host, 'u')) {
    CHECK_EQ_INT(send_one(SOCK_DGRAM, 0, "8.8.8.8", 123, "x", 1), EPERM);
    put_byte(to_host, 's');
  }
  char x;
  while (read(from_host, &x, 1) > 0)
    ;
}

static void dump_ok(int fd, uint64_t c[EGRESS_REFUSED_N]) {
  char err[256] = "";
  int r = nft_refused_dump(fd, 1000, c, err, sizeof err);
  if (r < 0)
    fprintf(stderr, "  nft_refused_dump: %s\n", err);
  CHECK_EQ_INT(r, 0);
}

/* The server's part (sandbox/ns.c), from outside the namespaces: a copy of
 * the agent's socket by pidfd_getfd, on which the dump is answered
 * (opened capable, sent by root or by the namespace's owner); on the
 * socket opened without the capability it is refused. */
static void the_host_reads_the_counters_on_the_agents_socket(void) {
  if (skip_reason)
    return;
  int up[2], down[2];
  CHECK(pipe2(up, O_CLOEXEC) == 0 && pipe2(down, O_CLOEXEC) == 0);
  uid_t host_euid = geteuid();
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    test_failures_ = 0;
    close(up[0]);
    close(down[1]);
    agent_side(up[1], down[0], host_euid);
    fflush(NULL);
    _exit(test_failures_ > 100 ? 100 : test_failures_);
  }
  close(up[1]);
  close(down[0]);
  CHECK(pid > 0);
  if (pid > 0 && get_byte(up[0], 'r')) {
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    CHECK(pidfd >= 0);
    int fd = (int)syscall(SYS_pidfd_getfd, pidfd, AGENT_NS_COUNTERS_FD, 0);
    if (fd < 0)
      fprintf(stderr, "  pidfd_getfd: %s\n", strerror(errno));
    CHECK(fd >= 0);
    CHECK(fd < 0 || fcntl(fd, F_GETFD) == FD_CLOEXEC);
    uint64_t c[EGRESS_REFUSED_N] = {9, 9, 9};
    dump_ok(fd, c);
    CHECK_EQ_INT(c[EGRESS_REFUSED_UDP], 0);
    CHECK(put_byte(down[1], 'u') && get_byte(up[0], 's'));
    dump_ok(fd, c);
    CHECK_EQ_INT(c[EGRESS_REFUSED_UDP], 1);
    CHECK_EQ_INT(c[EGRESS_REFUSED_ICMP], 0);
    CHECK_EQ_INT(c[EGRESS_REFUSED_OTHER], 0);
    /* Again on the same socket: the answers are told apart by sequence. */
    dump_ok(fd, c);
    CHECK_EQ_INT(c[EGRESS_REFUSED_UDP], 1);
    /* Sent without an address, the opener's capability counts too. */
    int other = (int)syscall(SYS_pidfd_getfd, pidfd, OTHER_OPENER_FD, 0);
    CHECK(other >= 0);
    char err[256] = "";
    CHECK_EQ_INT(nft_refused_dump(other, 1000, c, err, sizeof err), -EPERM);
    close(other);
    close(fd);
    close(pidfd);
  }
  close(down[1]);
  close(up[0]);
  int status;
  CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
    test_failures_ += WEXITSTATUS(status);
}

/* Whether user namespaces can be made here at all. */
static const char *check_userns(void) {
  pid_t pid = fork();
  if (pid == 0)
    _exit(enter_netns() < 0 ? 1 : 0);
  int status;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status))
    return "cannot make a user and network namespace here";
  return NULL;
}

int main(void) {
  static const struct test_case cases[] = {
      TEST(tcp_to_any_address_reaches_the_listener),
      TEST(dns_to_any_server_reaches_the_dns_port),
      TEST(loopback_stays_local),
      TEST(other_udp_is_refused),
      TEST(default_routes_through_lo),
      TEST(without_capabilities_the_rules_stay),
      TEST(a_second_setup_fails_and_keeps_the_first),
      TEST(a_failed_route_undoes_the_rest),
      TEST(refused_packets_are_counted),
      TEST(the_host_reads_the_counters_on_the_agents_socket),
  };
  skip_reason = check_userns();
  if (skip_reason) {
    printf("ok - test_egress_nl # skip %s\n0 passed, 0 failed, 1 skipped\n", skip_reason);
    return 0;
  }
  return test_run_all(cases, sizeof cases / sizeof cases[0]);
}
