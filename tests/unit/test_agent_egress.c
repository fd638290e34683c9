/* test_agent_egress.c: ign-agent --serve-fd N --egress, for real, with the
 * test as the host.  The test process enters a user namespace of its own
 * once, and a fresh network namespace per test; there the agent installs
 * its capture rules (guest/egress_nl.c) and listeners (guest/egress.c), and
 * the test's own sockets play the sandbox's programs: a connect to
 * 93.184.216.34:443 or a DNS query to 8.8.8.8 is captured like a program's
 * would be.  Checked: the STREAM_OPEN and LOOKUP frames, data and SHUT both
 * ways, the windows (the agent never sends beyond the grant, CREDITs come
 * back as the program drains), RESET seen by the program as ECONNRESET,
 * the DNS answers, the connection cap, and the protocol errors.
 *
 * Needs user and network namespaces; where they cannot be made it prints
 * one "ok - ... # skip" line. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "guest/egress_int.h"
#include "guest/egress_nl.h"
/* This test speaks the stream frames itself and uses few of its helpers. */
#pragma GCC diagnostic ignored "-Wunused-function"
#include "tests/unit/agent_client.h"
#include "tests/unit/test.h"

#define ID1 (PROTO_AGENT_ID | 1u)
#define QUIET_MS 300

struct conn {
  pid_t pid;
  int fd;
};

static bool write_text(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  bool ok = fd >= 0 && write(fd, text, strlen(text)) == (ssize_t)strlen(text);
  if (fd >= 0)
    close(fd);
  return ok;
}

/* A user namespace of our own, in which we may make network namespaces. */
static const char *enter_userns(void) {
  uid_t uid = getuid();
  gid_t gid = getgid();
  if (unshare(CLONE_NEWUSER) < 0)
    return "cannot make a user namespace (unshare)";
  char map[64];
  snprintf(map, sizeof map, "0 %u 1", (unsigned)uid);
  if (!write_text("/proc/self/setgroups", "deny") || !write_text("/proc/self/uid_map", map))
    return "cannot map our uid in the user namespace";
  snprintf(map, sizeof map, "0 %u 1", (unsigned)gid);
  if (!write_text("/proc/self/gid_map", map))
    return "cannot map our gid in the user namespace";
  return NULL;
}

static bool lo_up(void) {
  int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct ifreq ifr = {0};
  snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
  bool ok = s >= 0 && ioctl(s, SIOCGIFFLAGS, &ifr) == 0;
  ifr.ifr_flags |= IFF_UP;
  ok = ok && ioctl(s, SIOCSIFFLAGS, &ifr) == 0;
  if (s >= 0)
    close(s);
  return ok;
}

/* A fresh network namespace, the agent in it (with --egress when EGRESS),
 * HELLO done. */
static bool conn_start_with(struct conn *c, bool egress) {
  if (unshare(CLONE_NEWNET) < 0 || !lo_up()) {
    fprintf(stderr, "  cannot make a network namespace: %s\n", strerror(errno));
    return false;
  }
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
    return false;
  pid_t pid = fork();
  if (pid < 0)
    return false;
  if (pid == 0) {
    if (dup2(sv[1], 3) < 0)
      _exit(126);
    execl(ac_agent_path(), "ign-agent", "--serve-fd", "3", egress ? "--egress" : (char *)NULL,
          (char *)NULL);
    _exit(127);
  }
  close(sv[1]);
  c->pid = pid;
  c->fd = sv[0];
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_HELLO, 1);
  proto_put_u32(&b, TAG_VERSION, PROTO_VERSION);
  struct proto_header h;
  if (ac_send(c->fd, &b) < 0 || ac_recv(c->fd, &h, AC_TIMEOUT_MS) < 0 ||
      h.type != PROTO_HELLO_OK) {
    fprintf(stderr, "  the agent did not answer HELLO\n");
    return false;
  }
  char err[512];
  ac_str(ac_payload, h.len, TAG_EGRESS_ERROR, err, sizeof err);
  if (err[0]) {
    fprintf(stderr, "  the agent could not capture: %s\n", err);
    return false;
  }
  return true;
}

static bool conn_start(struct conn *c) {
  return conn_start_with(c, true);
}

static int conn_stop(struct conn *c) {
  close(c->fd);
  return ac_wait_exit(c->pid, 5000);
}

#define START(c)                                                                  \
  struct conn c;                                                                  \
  if (!conn_start(&c)) {                                                          \
    CHECK(!"cannot start the agent with egress");                                 \
    return;                                                                       \
  }
#define STOP(c) CHECK_EQ_INT(conn_stop(&c), 0)

/* ---- frames ------------------------------------------------------------- */

static struct proto_header last;

/* The next frame must be TYPE for ID (within the timeout). */
static bool expect(int fd, uint8_t type, uint32_t id) {
  int r = ac_recv(fd, &last, AC_TIMEOUT_MS);
  if (r < 0) {
    fprintf(stderr, "  waiting for %s id %#x: %s\n", proto_type_name(type), id, strerror(-r));
    return false;
  }
  if (last.type != type || last.id != id) {
    char msg[256];
    ac_str(ac_payload, last.len, TAG_MESSAGE, msg, sizeof msg);
    fprintf(stderr, "  expected %s id %#x, got %s id %#x %s\n", proto_type_name(type), id,
            proto_type_name(last.type), last.id, msg);
    return false;
  }
  return true;
}

/* No frame at all for MS. */
static bool quiet(int fd, int ms) {
  int r = ac_recv(fd, &last, ms);
  if (r == -ETIMEDOUT)
    return true;
  fprintf(stderr, "  expected silence, got %s id %#x (%u bytes)\n",
          r < 0 ? strerror(-r) : proto_type_name(last.type), last.id, last.len);
  return false;
}

static void send_window(int fd, uint8_t type, uint32_t id, uint32_t w) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, (enum proto_type)type, id);
  proto_put_u32(&b, TAG_WINDOW, w);
  CHECK_EQ_INT(ac_send(fd, &b), 0);
}

static void send_reset(int fd, uint32_t id, uint32_t err) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_STREAM_RESET, id);
  proto_put_u32(&b, TAG_ERRNO, err);
  CHECK_EQ_INT(ac_send(fd, &b), 0);
}

/* ---- programs ------------------------------------------------------------ */

static int connect_to(int family, const char *ip, uint16_t port) {
  int s = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0)
    return -1;
  struct sockaddr_storage ss = {0};
  socklen_t len;
  if (family == AF_INET) {
    struct sockaddr_in *a = (struct sockaddr_in *)&ss;
    a->sin_family = AF_INET;
    a->sin_port = htons(port);
    inet_pton(AF_INET, ip, &a->sin_addr);
    len = sizeof *a;
  } else {
    struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(port);
    inet_pton(AF_INET6, ip, &a->sin6_addr);
    len = sizeof *a;
  }
  if (connect(s, (struct sockaddr *)&ss, len) < 0) {
    fprintf(stderr, "  connect %s:%u: %s\n", ip, port, strerror(errno));
    close(s);
    return -1;
  }
  return s;
}

/* Reads exactly N bytes from S (with a timeout). */
static bool read_exact(int s, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    struct pollfd p = {.fd = s, .events = POLLIN};
    if (poll(&p, 1, AC_TIMEOUT_MS) <= 0)
      return false;
    ssize_t r = read(s, (uint8_t *)buf + got, n - got);
    if (r <= 0)
      return false;
    got += (size_t)r;
  }
  return true;
}

/* What a read on S ends with after waiting: 0 EOF, or -errno. */
static int read_end(int s) {
  struct pollfd p = {.fd = s, .events = POLLIN};
  if (poll(&p, 1, AC_TIMEOUT_MS) <= 0)
    return -ETIMEDOUT;
  char c;
  ssize_t r = read(s, &c, 1);
  return r < 0 ? -errno : r == 0 ? 0 : 1;
}

/* Reads S until its end: 0 at EOF, or -errno; *RET_N counts the bytes. */
static int drain_end(int s, size_t *ret_n) {
  static uint8_t buf[PROTO_CHUNK];
  for (;;) {
    struct pollfd p = {.fd = s, .events = POLLIN};
    if (poll(&p, 1, AC_TIMEOUT_MS) <= 0)
      return -ETIMEDOUT;
    ssize_t r = read(s, buf, sizeof buf);
    if (r <= 0)
      return r < 0 ? -errno : 0;
    *ret_n += (size_t)r;
  }
}

/* The STREAM_OPEN of a new connection: checks its fields. */
static bool expect_open(int fd, uint32_t id, int family, const void *addr, uint16_t port) {
  if (!expect(fd, PROTO_STREAM_OPEN, id))
    return false;
  const uint8_t *v;
  uint32_t len;
  bool ok = ac_u32(ac_payload, last.len, TAG_KIND, 0) == STREAM_KIND_TCP &&
            ac_u32(ac_payload, last.len, TAG_FAMILY, 0) == (uint32_t)family &&
            ac_u32(ac_payload, last.len, TAG_PORT, 0) == port &&
            ac_u32(ac_payload, last.len, TAG_WINDOW, 0) == STREAM_WINDOW &&
            ac_find(ac_payload, last.len, TAG_ADDR, &v, &len) && len == (family == 4 ? 4u : 16u) &&
            memcmp(v, addr, len) == 0;
  if (!ok)
    fprintf(stderr, "  STREAM_OPEN %#x has other fields than expected\n", id);
  return ok;
}

/* ---- tests --------------------------------------------------------------- */

static const uint8_t example_v4[4] = {93, 184, 216, 34};

static void test_stream_both_ways(void) {
  START(c);
  int s = connect_to(AF_INET, "93.184.216.34", 443);
  CHECK(s >= 0);
  CHECK(expect_open(c.fd, ID1, 4, example_v4, 443));
  /* Before ACCEPT nothing is read from the program. */
  CHECK_EQ_INT(write(s, "hello", 5), 5);
  CHECK(quiet(c.fd, QUIET_MS));
  /* ACCEPT's window: 3 bytes, then nothing until a CREDIT. */
  send_window(c.fd, PROTO_STREAM_ACCEPT, ID1, 3);
  CHECK(expect(c.fd, PROTO_STREAM_DATA, ID1));
  CHECK(last.len == 3 && memcmp(ac_payload, "hel", 3) == 0);
  CHECK(quiet(c.fd, QUIET_MS));
  send_window(c.fd, PROTO_STREAM_CREDIT, ID1, 100);
  CHECK(expect(c.fd, PROTO_STREAM_DATA, ID1));
  CHECK(last.len == 2 && memcmp(ac_payload, "lo", 2) == 0);
  /* Host -> program; the drained bytes are granted again. */
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STREAM_DATA, ID1, "world", 5), 0);
  char buf[16];
  CHECK(read_exact(s, buf, 5) && memcmp(buf, "world", 5) == 0);
  CHECK(expect(c.fd, PROTO_STREAM_CREDIT, ID1));
  CHECK_EQ_INT(ac_u32(ac_payload, last.len, TAG_WINDOW, 0), 5);
  /* The program's FIN, then the host's. */
  CHECK_EQ_INT(shutdown(s, SHUT_WR), 0);
  CHECK(expect(c.fd, PROTO_STREAM_SHUT, ID1));
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STREAM_SHUT, ID1, NULL, 0), 0);
  CHECK_EQ_INT(read_end(s), 0);
  /* Closed: later frames for it are dropped, and nothing else came. */
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STREAM_DATA, ID1, "x", 1), 0);
  CHECK(ac_ping_ok(c.fd, 9));
  close(s);
  STOP(c);
}

static void test_ipv6_destination(void) {
  START(c);
  int s = connect_to(AF_INET6, "2606:2800:220:1::1", 80);
  CHECK(s >= 0);
  uint8_t want[16];
  inet_pton(AF_INET6, "2606:2800:220:1::1", want);
  CHECK(expect_open(c.fd, ID1, 6, want, 80));
  /* The host's FIN first: the program reads EOF, and can still send. */
  send_window(c.fd, PROTO_STREAM_ACCEPT, ID1, 10);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STREAM_SHUT, ID1, NULL, 0), 0);
  CHECK_EQ_INT(read_end(s), 0);
  CHECK_EQ_INT(write(s, "up", 2), 2);
  CHECK(expect(c.fd, PROTO_STREAM_DATA, ID1));
  CHECK(last.len == 2 && memcmp(ac_payload, "up", 2) == 0);
  close(s);
  CHECK(expect(c.fd, PROTO_STREAM_SHUT, ID1));
  CHECK(ac_ping_ok(c.fd, 9));
  STOP(c);
}

static void test_host_reset(void) {
  START(c);
  /* Refused before ACCEPT. */
  int s = connect_to(AF_INET, "93.184.216.34", 443);
  CHECK(expect_open(c.fd, ID1, 4, example_v4, 443));
  send_reset(c.fd, ID1, ECONNREFUSED);
  CHECK_EQ_INT(read_end(s), -ECONNRESET);
  close(s);
  /* Reset in the middle of a transfer. */
  s = connect_to(AF_INET, "93.184.216.34", 443);
  CHECK(expect_open(c.fd, ID1 + 1, 4, example_v4, 443));
  send_window(c.fd, PROTO_STREAM_ACCEPT, ID1 + 1, 1000);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STREAM_DATA, ID1 + 1, "abc", 3), 0);
  char buf[3];
  CHECK(read_exact(s, buf, 3));
  CHECK(expect(c.fd, PROTO_STREAM_CREDIT, ID1 + 1));
  send_reset(c.fd, ID1 + 1, ETIMEDOUT);
  CHECK_EQ_INT(read_end(s), -ECONNRESET);
  close(s);
  CHECK(ac_ping_ok(c.fd, 9));
  STOP(c);
}

/* The program writes far more than the host grants: exactly the grant
 * comes, and every further byte waits for a CREDIT. */
static void test_agent_sends_within_the_grant(void) {
  START(c);
  int s = connect_to(AF_INET, "93.184.216.34", 443);
  CHECK(expect_open(c.fd, ID1, 4, example_v4, 443));
  static uint8_t big[1 << 20];
  memset(big, 'p', sizeof big);
  CHECK(fcntl(s, F_SETFL, O_NONBLOCK) == 0);
  size_t wrote = 0;
  for (ssize_t w; (w = write(s, big + wrote, sizeof big - wrote)) > 0;)
    wrote += (size_t)w;
  CHECK(wrote > 100000);
  uint32_t grants[] = {1000, 70000, 5};
  size_t got = 0, granted = 0;
  send_window(c.fd, PROTO_STREAM_ACCEPT, ID1, grants[0]);
  for (size_t g = 0; g < 3; g++) {
    if (g)
      send_window(c.fd, PROTO_STREAM_CREDIT, ID1, grants[g]);
    granted += grants[g];
    while (got < granted) {
      if (!expect(c.fd, PROTO_STREAM_DATA, ID1))
        break;
      CHECK(last.len <= PROTO_CHUNK);
      got += last.len;
    }
    CHECK_EQ_INT(got, granted);
    CHECK(quiet(c.fd, QUIET_MS));
  }
  close(s);
  STOP(c);
}

/* The host sends what its window allows (OPEN's, then the CREDITs) while
 * the program does not read, until nothing more is granted: the agent
 * holds at most the window, and CREDITs come again as the program reads.
 * The bytes arrive in order through the ring; DATA beyond the window is a
 * protocol error. */
struct host_side {
  uint64_t window, sent, credited;
};

static uint8_t pattern(uint64_t i) { return (uint8_t)(i % 251); }

/* Sends within the window, taking CREDITs, until none came for QUIET_MS
 * with the window used up. */
static void host_fill(int fd, struct host_side *h) {
  static uint8_t chunk[PROTO_CHUNK];
  for (int rounds = 0; rounds < 10000; rounds++) {
    while (h->window > 0) {
      size_t n = h->window < PROTO_CHUNK ? (size_t)h->window : PROTO_CHUNK;
      for (size_t i = 0; i < n; i++)
        chunk[i] = pattern(h->sent + i);
      CHECK_EQ_INT(ac_send_raw(fd, PROTO_STREAM_DATA, ID1, chunk, n), 0);
      h->window -= n;
      h->sent += n;
    }
    int r = ac_recv(fd, &last, QUIET_MS);
    if (r == -ETIMEDOUT)
      return;
    CHECK(r == 0 && last.type == PROTO_STREAM_CREDIT && last.id == ID1);
    if (r < 0 || last.type != PROTO_STREAM_CREDIT)
      return;
    uint32_t w = ac_u32(ac_payload, last.len, TAG_WINDOW, 0);
    h->window += w;
    h->credited += w;
    /* Never more granted than was sent; never more than a window out. */
    CHECK(h->credited <= h->sent);
    CHECK(h->window <= STREAM_WINDOW);
  }
}

static void test_host_window_and_credits(void) {
  START(c);
  int s = connect_to(AF_INET, "93.184.216.34", 443);
  CHECK(expect_open(c.fd, ID1, 4, example_v4, 443));
  send_window(c.fd, PROTO_STREAM_ACCEPT, ID1, 1);
  struct host_side h = {.window = STREAM_WINDOW};
  host_fill(c.fd, &h);
  /* Stalled: the program's socket is full and the agent holds the rest,
   * exactly one window granted and not drained. */
  CHECK_EQ_INT(h.window, 0);
  CHECK_EQ_INT(h.sent - h.credited, STREAM_WINDOW);
  /* The program reads, the bytes in order, until CREDITs come (how much
   * it takes is the kernel's: the agent writes on POLLOUT, which waits
   * for half its send buffer to be free). */
  static uint8_t buf[PROTO_CHUNK];
  uint64_t got = 0, before = h.credited;
  while (got < h.sent && h.credited == before) {
    if (!read_exact(s, buf, sizeof buf))
      break;
    for (size_t i = 0; i < sizeof buf; i++)
      if (buf[i] != pattern(got + i)) {
        CHECK(!"the program read bytes out of order");
        break;
      }
    got += sizeof buf;
    if (ac_recv(c.fd, &last, 0) == 0) {
      CHECK(last.type == PROTO_STREAM_CREDIT && last.id == ID1);
      uint32_t w = ac_u32(ac_payload, last.len, TAG_WINDOW, 0);
      h.window += w;
      h.credited += w;
    }
  }
  CHECK(h.credited > before);
  host_fill(c.fd, &h);
  CHECK_EQ_INT(h.window, 0);
  CHECK_EQ_INT(h.sent - h.credited, STREAM_WINDOW);
  /* One byte beyond the window. */
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STREAM_DATA, ID1, "!", 1), 0);
  CHECK(expect(c.fd, PROTO_ERROR, ID1));
  CHECK_EQ_INT(ac_u32(ac_payload, last.len, TAG_ERRNO, 0), EPROTO);
  /* The program's connection was reset (after what reached it). */
  size_t rest = 0;
  CHECK_EQ_INT(drain_end(s, &rest), -ECONNRESET);
  CHECK(got + rest < h.sent);
  close(s);
  STOP(c);
}

static void test_protocol_errors(void) {
  START(c);
  /* A host-opened stream: not supported; its later frames are dropped. */
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_STREAM_OPEN, 40);
  proto_put_u32(&b, TAG_KIND, STREAM_KIND_TCP);
  CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  CHECK(expect(c.fd, PROTO_STREAM_RESET, 40));
  CHECK_EQ_INT(ac_u32(ac_payload, last.len, TAG_ERRNO, 0), EOPNOTSUPP);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STREAM_DATA, 40, "x", 1), 0);
  CHECK(ac_ping_ok(c.fd, 9));
  /* Frames for agent ids never opened, a host id never opened, LOOKUP. */
  const uint32_t ids[] = {ID1, PROTO_AGENT_ID, 41};
  const uint8_t types[] = {PROTO_STREAM_DATA, PROTO_LOOKUP_END, PROTO_STREAM_CREDIT};
  for (size_t i = 0; i < 3; i++) {
    CHECK_EQ_INT(ac_send_raw(c.fd, types[i], ids[i], NULL, 0), 0);
    CHECK(expect(c.fd, PROTO_ERROR, ids[i]));
    CHECK_EQ_INT(ac_u32(ac_payload, last.len, TAG_ERRNO, 0), EPROTO);
  }
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_LOOKUP, 42, NULL, 0), 0);
  CHECK(expect(c.fd, PROTO_ERROR, 42));
  /* DATA after SHUT, a second ACCEPT. */
  int s = connect_to(AF_INET, "10.1.2.3", 22);
  const uint8_t ten[4] = {10, 1, 2, 3};
  CHECK(expect_open(c.fd, ID1, 4, ten, 22));
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STREAM_SHUT, ID1, NULL, 0), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STREAM_DATA, ID1, "x", 1), 0);
  CHECK(expect(c.fd, PROTO_ERROR, ID1));
  size_t n = 0;
  int end = drain_end(s, &n); /* the host's FIN came first, then the reset */
  CHECK(end == 0 || end == -ECONNRESET);
  CHECK_EQ_INT(n, 0);
  close(s);
  s = connect_to(AF_INET, "10.1.2.3", 22);
  CHECK(expect_open(c.fd, ID1 + 1, 4, ten, 22));
  send_window(c.fd, PROTO_STREAM_ACCEPT, ID1 + 1, 10);
  send_window(c.fd, PROTO_STREAM_ACCEPT, ID1 + 1, 10);
  CHECK(expect(c.fd, PROTO_ERROR, ID1 + 1));
  CHECK_EQ_INT(read_end(s), -ECONNRESET);
  close(s);
  /* A CREDIT that grants more than STREAM_WINDOW outstanding (the program
   * sends nothing, so the whole first grant is still there). */
  s = connect_to(AF_INET, "10.1.2.3", 22);
  CHECK(expect_open(c.fd, ID1 + 2, 4, ten, 22));
  send_window(c.fd, PROTO_STREAM_ACCEPT, ID1 + 2, STREAM_WINDOW);
  send_window(c.fd, PROTO_STREAM_CREDIT, ID1 + 2, 1);
  CHECK(expect(c.fd, PROTO_ERROR, ID1 + 2));
  CHECK_EQ_INT(read_end(s), -ECONNRESET);
  close(s);
  /* A CREDIT before ACCEPT. */
  s = connect_to(AF_INET, "10.1.2.3", 22);
  CHECK(expect_open(c.fd, ID1 + 3, 4, ten, 22));
  send_window(c.fd, PROTO_STREAM_CREDIT, ID1 + 3, 1);
  CHECK(expect(c.fd, PROTO_ERROR, ID1 + 3));
  close(s);
  CHECK(ac_ping_ok(c.fd, 9));
  STOP(c);
}

/* A connect straight to the agent's port was not redirected: reset, and
 * the host hears nothing of it. */
static void test_direct_connect_refused(void) {
  START(c);
  int s = connect_to(AF_INET, "127.0.0.1", EGRESS_TCP_PORT);
  CHECK(s >= 0);
  CHECK_EQ_INT(read_end(s), -ECONNRESET);
  close(s);
  CHECK(quiet(c.fd, QUIET_MS));
  STOP(c);
}

static void test_connection_cap(void) {
  START(c);
  static int socks[EGRESS_AGENT_MAX_STREAMS + 1];
  size_t n = 0;
  for (; n < EGRESS_AGENT_MAX_STREAMS; n++) {
    socks[n] = connect_to(AF_INET, "93.184.216.34", 443);
    if (socks[n] < 0 || !expect(c.fd, PROTO_STREAM_OPEN, ID1 + (uint32_t)n))
      break;
  }
  CHECK_EQ_INT(n, EGRESS_AGENT_MAX_STREAMS);
  /* The 257th: reset at once, no frame. */
  int extra = connect_to(AF_INET, "93.184.216.34", 443);
  CHECK_EQ_INT(read_end(extra), -ECONNRESET);
  close(extra);
  CHECK(quiet(c.fd, QUIET_MS));
  /* One ends: room for the next, which gets the next id. */
  send_reset(c.fd, ID1, ECONNREFUSED);
  CHECK_EQ_INT(read_end(socks[0]), -ECONNRESET);
  CHECK(ac_ping_ok(c.fd, 9));
  extra = connect_to(AF_INET, "93.184.216.34", 443);
  CHECK(expect(c.fd, PROTO_STREAM_OPEN, ID1 + EGRESS_AGENT_MAX_STREAMS));
  close(extra);
  for (size_t i = 0; i < n; i++)
    close(socks[i]);
  STOP(c);
}

/* ---- DNS ----------------------------------------------------------------- */

static size_t make_query(uint8_t *q, uint16_t id, const char *name, uint16_t qtype) {
  size_t n = 0;
  const uint8_t head[12] = {(uint8_t)(id >> 8), (uint8_t)id, 1, 0, 0, 1};
  memcpy(q, head, 12);
  n = 12;
  for (const char *s = name; *s;) {
    const char *dot = strchr(s, '.');
    size_t l = dot ? (size_t)(dot - s) : strlen(s);
    q[n++] = (uint8_t)l;
    memcpy(q + n, s, l);
    n += l;
    s += l + (dot ? 1 : 0);
  }
  q[n++] = 0;
  q[n++] = (uint8_t)(qtype >> 8);
  q[n++] = (uint8_t)qtype;
  q[n++] = 0;
  q[n++] = 1;
  return n;
}

static bool expect_lookup(int fd, uint32_t id, const char *name, uint32_t qtype,
                          uint32_t transport) {
  if (!expect(fd, PROTO_LOOKUP, id))
    return false;
  char got[PROTO_MAX_NAME + 1];
  ac_str(ac_payload, last.len, TAG_NAME, got, sizeof got);
  bool ok = strcmp(got, name) == 0 && ac_u32(ac_payload, last.len, TAG_QTYPE, 0) == qtype &&
            ac_u32(ac_payload, last.len, TAG_TRANSPORT, 0) == transport;
  if (!ok)
    fprintf(stderr, "  LOOKUP for \"%s\" type %u transport %u\n", got,
            ac_u32(ac_payload, last.len, TAG_QTYPE, 0),
            ac_u32(ac_payload, last.len, TAG_TRANSPORT, 0));
  return ok;
}

static void send_lookup_end(int fd, uint32_t id, uint32_t rcode, const uint8_t *v4,
                            const uint8_t *v6, uint32_t ttl) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_LOOKUP_END, id);
  proto_put_u32(&b, TAG_RCODE, rcode);
  if (v6)
    proto_put_bytes(&b, TAG_ADDR, v6, 16);
  if (v4)
    proto_put_bytes(&b, TAG_ADDR, v4, 4);
  proto_put_u32(&b, TAG_TTL, ttl);
  CHECK_EQ_INT(ac_send(fd, &b), 0);
}

static void test_dns_udp(void) {
  START(c);
  int u = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in google = {.sin_family = AF_INET, .sin_port = htons(53)};
  inet_pton(AF_INET, "8.8.8.8", &google.sin_addr);
  uint8_t q[512], ans[1024];
  size_t qn = make_query(q, 0xbeef, "pypi.org", 1);
  CHECK_EQ_INT(sendto(u, q, qn, 0, (struct sockaddr *)&google, sizeof google), (ssize_t)qn);
  CHECK(expect_lookup(c.fd, ID1, "pypi.org", 1, LOOKUP_UDP));
  const uint8_t v4[4] = {198, 18, 0, 7}, v6[16] = {0x20, 1, 0xd, 0xb8, [15] = 1};
  send_lookup_end(c.fd, ID1, RCODE_NOERROR, v4, v6, 60);
  struct pollfd p = {.fd = u, .events = POLLIN};
  CHECK(poll(&p, 1, AC_TIMEOUT_MS) == 1);
  struct sockaddr_in from;
  socklen_t fl = sizeof from;
  ssize_t n = recvfrom(u, ans, sizeof ans, MSG_DONTWAIT, (struct sockaddr *)&from, &fl);
  /* From the server asked (the redirect undone), our id, one A record. */
  CHECK(from.sin_addr.s_addr == google.sin_addr.s_addr && from.sin_port == htons(53));
  CHECK_EQ_INT(n, (ssize_t)qn + 16);
  if (n == (ssize_t)qn + 16) {
    CHECK(ans[0] == 0xbe && ans[1] == 0xef && ans[2] == 0x81 && ans[3] == 0x80);
    CHECK(ans[5] == 1 && ans[7] == 1);
    CHECK(memcmp(ans + 12, q + 12, qn - 12) == 0);
    CHECK(memcmp(ans + n - 4, v4, 4) == 0);
    CHECK(ans[n - 7] == 60);
  }
  /* NXDOMAIN for a TXT query to another server. */
  qn = make_query(q, 7, "evil.example", 16);
  struct sockaddr_in quad9 = {.sin_family = AF_INET, .sin_port = htons(53)};
  inet_pton(AF_INET, "9.9.9.9", &quad9.sin_addr);
  CHECK_EQ_INT(sendto(u, q, qn, 0, (struct sockaddr *)&quad9, sizeof quad9), (ssize_t)qn);
  CHECK(expect_lookup(c.fd, ID1 + 1, "evil.example", 16, LOOKUP_UDP));
  send_lookup_end(c.fd, ID1 + 1, RCODE_NXDOMAIN, NULL, NULL, 0);
  CHECK(poll(&p, 1, AC_TIMEOUT_MS) == 1);
  n = recv(u, ans, sizeof ans, MSG_DONTWAIT);
  CHECK_EQ_INT(n, (ssize_t)qn);
  CHECK(n >= 12 && ans[0] == 0 && ans[1] == 7 && (ans[3] & 0xf) == RCODE_NXDOMAIN && ans[7] == 0);
  /* A packet that is not a query: FORMERR at once, no LOOKUP. */
  q[5] = 2;
  CHECK_EQ_INT(sendto(u, q, qn, 0, (struct sockaddr *)&quad9, sizeof quad9), (ssize_t)qn);
  CHECK(poll(&p, 1, AC_TIMEOUT_MS) == 1);
  n = recv(u, ans, sizeof ans, MSG_DONTWAIT);
  CHECK(n == 12 && (ans[3] & 0xf) == RCODE_FORMERR);
  CHECK(quiet(c.fd, QUIET_MS));
  close(u);
  STOP(c);
}

static void test_dns_tcp_and_lookup_cap(void) {
  START(c);
  int t = connect_to(AF_INET, "1.1.1.1", 53);
  uint8_t q[514], ans[1024];
  size_t qn = make_query(q + 2, 0x0102, "Good.Test", 1);
  q[0] = 0;
  q[1] = (uint8_t)qn;
  CHECK_EQ_INT(write(t, q, qn + 2), (ssize_t)qn + 2);
  CHECK(expect_lookup(c.fd, ID1, "Good.Test", 1, LOOKUP_TCP));
  send_lookup_end(c.fd, ID1, RCODE_NXDOMAIN, NULL, NULL, 0);
  CHECK(read_exact(t, ans, 2 + qn));
  CHECK(ans[0] == 0 && ans[1] == qn && ans[2] == 1 && ans[3] == 2 && (ans[5] & 0xf) == 3);
  close(t);

  /* EGRESS_AGENT_MAX_LOOKUPS wait for the host: the next is REFUSED here. */
  int u = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in dst = {.sin_family = AF_INET, .sin_port = htons(53)};
  inet_pton(AF_INET, "8.8.8.8", &dst.sin_addr);
  for (uint32_t i = 0; i < EGRESS_AGENT_MAX_LOOKUPS; i++) {
    qn = make_query(q, (uint16_t)i, "a.example", 1);
    CHECK_EQ_INT(sendto(u, q, qn, 0, (struct sockaddr *)&dst, sizeof dst), (ssize_t)qn);
    CHECK(expect_lookup(c.fd, ID1 + 1 + i, "a.example", 1, LOOKUP_UDP));
  }
  qn = make_query(q, 999, "a.example", 1);
  CHECK_EQ_INT(sendto(u, q, qn, 0, (struct sockaddr *)&dst, sizeof dst), (ssize_t)qn);
  struct pollfd p = {.fd = u, .events = POLLIN};
  CHECK(poll(&p, 1, AC_TIMEOUT_MS) == 1);
  ssize_t n = recv(u, ans, sizeof ans, MSG_DONTWAIT);
  CHECK(n == (ssize_t)qn && ans[0] == 999 >> 8 && ans[1] == (999 & 0xff) &&
        (ans[3] & 0xf) == RCODE_REFUSED);
  CHECK(quiet(c.fd, QUIET_MS));
  /* A malformed LOOKUP_END: EPROTO, and the program gets SERVFAIL. */
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_LOOKUP_END, ID1 + 1, NULL, 0), 0);
  CHECK(expect(c.fd, PROTO_ERROR, ID1 + 1));
  CHECK(poll(&p, 1, AC_TIMEOUT_MS) == 1);
  n = recv(u, ans, sizeof ans, MSG_DONTWAIT);
  CHECK(n > 12 && ans[1] == 0 && (ans[3] & 0xf) == RCODE_SERVFAIL);
  close(u);
  STOP(c);
}

/* ---- EGRESS_STATS -------------------------------------------------------- */

/* EGRESS_STATS as request ID: the counts of its OK (all three required). */
static bool ask_stats(int fd, uint32_t id, uint64_t ret[3]) {
  CHECK_EQ_INT(ac_send_raw(fd, PROTO_EGRESS_STATS, id, NULL, 0), 0);
  if (!expect(fd, PROTO_OK, id))
    return false;
  static const uint16_t tags[3] = {TAG_UDP, TAG_ICMP, TAG_OTHER};
  for (int i = 0; i < 3; i++) {
    const uint8_t *v;
    uint32_t len;
    if (!ac_find(ac_payload, last.len, tags[i], &v, &len) || len != 8)
      return false;
    ret[i] = ac_u64(ac_payload, last.len, tags[i], 0);
  }
  return true;
}

static int send_to(int type, int proto, const char *ip, uint16_t port, const void *p, size_t n) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
  inet_pton(AF_INET, ip, &a.sin_addr);
  int s = socket(AF_INET, type | SOCK_CLOEXEC, proto);
  if (s < 0)
    return errno;
  int r = sendto(s, p, n, 0, (struct sockaddr *)&a, sizeof a) < 0 ? errno : 0;
  close(s);
  return r;
}

static void test_egress_stats(void) {
  START(c);
  uint64_t v[3] = {9, 9, 9};
  CHECK(ask_stats(c.fd, 7, v));
  CHECK(v[0] == 0 && v[1] == 0 && v[2] == 0);
  /* The test is a program of the sandbox here: its refused packets count. */
  CHECK_EQ_INT(send_to(SOCK_DGRAM, 0, "8.8.8.8", 123, "x", 1), EPERM);
  CHECK_EQ_INT(send_to(SOCK_DGRAM, 0, "192.0.2.1", 5000, "x", 1), EPERM);
  static const uint8_t echo[8] = {8, 0, 0xf7, 0xff};
  CHECK_EQ_INT(send_to(SOCK_RAW, IPPROTO_ICMP, "8.8.8.8", 0, echo, sizeof echo), EPERM);
  CHECK(ask_stats(c.fd, 8, v));
  CHECK_EQ_INT(v[0], 2);
  CHECK_EQ_INT(v[1], 1);
  CHECK_EQ_INT(v[2], 0);
  /* A payload is ignored; the connection goes on. */
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_EGRESS_STATS, 9, "junk", 4), 0);
  CHECK(expect(c.fd, PROTO_OK, 9));
  STOP(c);

  /* No capture: an ERROR that says so, and the agent serves on. */
  struct conn d;
  if (!conn_start_with(&d, false)) {
    CHECK(!"cannot start the agent");
    return;
  }
  CHECK_EQ_INT(ac_send_raw(d.fd, PROTO_EGRESS_STATS, 7, NULL, 0), 0);
  CHECK(expect(d.fd, PROTO_ERROR, 7));
  char msg[256];
  ac_str(ac_payload, last.len, TAG_MESSAGE, msg, sizeof msg);
  CHECK(strstr(msg, "gone (or there is no capture)") != NULL);
  CHECK_EQ_INT(ac_u32(ac_payload, last.len, TAG_ERRNO, 0), ENOENT);
  CHECK_EQ_INT(ac_send_raw(d.fd, PROTO_PING, 8, NULL, 0), 0);
  CHECK(expect(d.fd, PROTO_PONG, 8));
  CHECK_EQ_INT(conn_stop(&d), 0);
}

int main(void) {
  static const struct test_case cases[] = {
      TEST(test_stream_both_ways),
      TEST(test_ipv6_destination),
      TEST(test_host_reset),
      TEST(test_agent_sends_within_the_grant),
      TEST(test_host_window_and_credits),
      TEST(test_protocol_errors),
      TEST(test_direct_connect_refused),
      TEST(test_connection_cap),
      TEST(test_dns_udp),
      TEST(test_dns_tcp_and_lookup_cap),
      TEST(test_egress_stats),
  };
  signal(SIGPIPE, SIG_IGN);
  const char *skip = enter_userns();
  if (skip) {
    printf("ok - test_agent_egress # skip %s\n0 passed, 0 failed, 1 skipped\n", skip);
    return 0;
  }
  return test_run_all(cases, sizeof cases / sizeof cases[0]);
}
