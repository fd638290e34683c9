/* machine.c: the sandbox's identity and kernel state: hostname, loopback,
 * the name files (/etc/resolv.conf, /etc/hosts), and the SETUP request.
 *
 * SETUP exists for clones of a warm VM snapshot: every clone wakes with the
 * snapshot's clock and the same RNG state, so the host pushes fresh entropy
 * (added with RNDADDENTROPY, then RNDRESEEDCRNG so the CRNG uses it at once),
 * the time, and the clone's own hostname and machine id.  The same TLVs may
 * come in HELLO (a session's first request): they are set before HELLO is
 * answered, so before anything the session runs, at no extra round trip.
 * In the namespace sandbox these need privileges the agent has dropped, so
 * they fail with EPERM there, which the host expects. */
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <net/if.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/util.h"
#include "guest/agent_core.h"
#include "guest/machine.h"

#define MACHINE_MAX_ENTROPY 4096u
#define MACHINE_HOSTNAME_MAX 64u /* HOST_NAME_MAX */
#define MACHINE_ID_LEN 32u

int machine_set_hostname(const char *name, size_t len) {
  if (sethostname(name, len) < 0)
    return -errno;
  return 0;
}

int machine_loopback_up(void) {
  _cleanup_close_ int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s < 0)
    return -errno;
  struct ifreq ifr = {0};
  snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
  if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
    return -errno;
  ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
  if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
    return -errno;
  return 0;
}

/* Write CONTENT to PATH unless something (a file, a link) is there already. */
static int machine_write_if_missing(const char *path, const char *content) {
  _cleanup_close_ int fd =
      open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0)
    return errno == EEXIST ? 0 : -errno;
  int r = proto_write_all(fd, content, strlen(content));
  if (r < 0)
    return r;
  if (close(steal_fd(fd)) < 0)
    return -errno;
  return 0;
}

void machine_name_files(void) {
  /* Any server a program names is redirected to the agent's DNS port, but
   * programs need one named; the rootfs trees have none.  A tree's own file
   * is kept (glibc asks 127.0.0.1 when there is none, so a dangling link
   * does no harm either), and a tree without /etc (a test's busybox) is
   * left as it is.  An ns sandbox of a server run as a user cannot create
   * files in the rootfs's /etc (its owner is not mapped there): it has none,
   * and resolvers ask 127.0.0.1 all the same. */
  static const char resolv[] = "nameserver 127.0.0.1\n";
  static const char hosts[] = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";
  struct stat st;
  int r;
  if (stat("/etc", &st) < 0)
    return;
  if ((r = machine_write_if_missing("/etc/resolv.conf", resolv)) < 0)
    agent_log("cannot write /etc/resolv.conf: %s", strerror(-r));
  if ((r = machine_write_if_missing("/etc/hosts", hosts)) < 0)
    agent_log("cannot write /etc/hosts: %s", strerror(-r));
}

static int machine_add_entropy(const uint8_t *p, size_t n) {
  _Alignas(struct rand_pool_info) uint8_t raw[sizeof(struct rand_pool_info) + MACHINE_MAX_ENTROPY];
  struct rand_pool_info *info = (struct rand_pool_info *)raw;
  if (n > MACHINE_MAX_ENTROPY)
    return -E2BIG;
  info->entropy_count = (int)(n * 8);
  info->buf_size = (int)n;
  memcpy(info->buf, p, n);
  _cleanup_close_ int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  if (ioctl(fd, RNDADDENTROPY, info) < 0)
    return -errno;
  /* Kernels before 4.17 have no RNDRESEEDCRNG; entropy still went in. */
  if (ioctl(fd, RNDRESEEDCRNG) < 0 && errno != ENOTTY && errno != EINVAL)
    return -errno;
  return 0;
}

static int machine_set_clock(uint64_t ns) {
  struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
  if (clock_settime(CLOCK_REALTIME, &ts) < 0)
    return -errno;
  return 0;
}

static int machine_write_machine_id(const uint8_t *id) {
  char line[MACHINE_ID_LEN + 1];
  memcpy(line, id, MACHINE_ID_LEN);
  line[MACHINE_ID_LEN] = '\n';
  _cleanup_close_ int fd =
      open("/etc/machine-id", O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0444);
  if (fd < 0)
    return -errno;
  int r = proto_write_all(fd, line, sizeof line);
  if (r < 0)
    return r;
  if (close(steal_fd(fd)) < 0)
    return -errno;
  return 0;
}

static bool is_lower_hex(const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f')))
      return false;
  return true;
}

struct setup_request {
  const uint8_t *entropy, *hostname, *machine_id;
  uint32_t entropy_len, hostname_len, machine_id_len;
  uint64_t time_ns;
  bool has_time;
};

static int setup_parse(struct agent *a, uint32_t id, const uint8_t *p, size_t n,
                       struct setup_request *ret) {
  struct setup_request r = {0};
  struct proto_tlv_iter it;
  uint16_t tag;
  const uint8_t *v;
  uint32_t len;
  int k;

  proto_tlv_init(&it, p, n);
  while ((k = proto_tlv_next(&it, &tag, &v, &len)) > 0) {
    switch (tag) {
    case TAG_ENTROPY:
      r.entropy = v;
      r.entropy_len = len;
      break;
    case TAG_TIME_NS:
      if (agent_tlv_u64(a, id, "SETUP", "TIME_NS", v, len, &r.time_ns) < 0)
        return -EPROTO;
      r.has_time = true;
      break;
    case TAG_HOSTNAME:
      r.hostname = v;
      r.hostname_len = len;
      break;
    case TAG_MACHINE_ID:
      r.machine_id = v;
      r.machine_id_len = len;
      break;
    default:
      break;
    }
  }
  if (k < 0) {
    agent_send_error(a, id, EPROTO, "malformed SETUP request: a TLV record runs past the payload");
    return -EPROTO;
  }
  if (r.entropy && (r.entropy_len == 0 || r.entropy_len > MACHINE_MAX_ENTROPY)) {
    agent_send_error(a, id, EINVAL, "ENTROPY must hold 1 to %u bytes, got %u", MACHINE_MAX_ENTROPY,
                     r.entropy_len);
    return -EINVAL;
  }
  if (r.hostname && (r.hostname_len == 0 || r.hostname_len > MACHINE_HOSTNAME_MAX ||
                     memchr(r.hostname, '\0', r.hostname_len))) {
    agent_send_error(a, id, EINVAL, "HOSTNAME must be 1 to %u bytes without NUL",
                     MACHINE_HOSTNAME_MAX);
    return -EINVAL;
  }
  if (r.machine_id &&
      (r.machine_id_len != MACHINE_ID_LEN || !is_lower_hex(r.machine_id, MACHINE_ID_LEN))) {
    agent_send_error(a, id, EINVAL, "MACHINE_ID must be %u lowercase hex characters",
                     MACHINE_ID_LEN);
    return -EINVAL;
  }
  *ret = r;
  return 0;
}

/* Append "; WHAT: strerror" to the failure list; keep the first errno. */
static void setup_note(char *msg, size_t size, int *first_err, const char *what, int r) {
  if (r >= 0)
    return;
  size_t used = strlen(msg);
  snprintf(msg + used, size - used, "%s%s: %s", used ? "; " : "", what, strerror(-r));
  if (!*first_err)
    *first_err = -r;
}

int machine_setup(struct agent *a, uint32_t id, const uint8_t *payload, size_t len) {
  struct setup_request r;
  if (setup_parse(a, id, payload, len, &r) < 0)
    return -EINVAL;

  /* Apply everything that was asked even when one part fails, so that one
   * missing privilege does not leave the rest undone. */
  char msg[512] = "";
  int first_err = 0;
  if (r.entropy)
    setup_note(msg, sizeof msg, &first_err, "ENTROPY (adding to /dev/urandom)",
               machine_add_entropy(r.entropy, r.entropy_len));
  if (r.has_time)
    setup_note(msg, sizeof msg, &first_err, "TIME_NS (setting the clock)",
               machine_set_clock(r.time_ns));
  if (r.hostname)
    setup_note(msg, sizeof msg, &first_err, "HOSTNAME (sethostname)",
               machine_set_hostname((const char *)r.hostname, r.hostname_len));
  if (r.machine_id)
    setup_note(msg, sizeof msg, &first_err, "MACHINE_ID (writing /etc/machine-id)",
               machine_write_machine_id(r.machine_id));
  if (first_err) {
    agent_send_error(a, id, first_err, "SETUP failed: %s", msg);
    return -first_err;
  }
  return 0;
}

