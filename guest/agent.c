/* agent.c: ign-agent's entry point, event loop and request dispatch.
 *
 * Modes (command line):
 *   --serve-fd N [--egress]
 *                  serve the protocol on fd N with no setup (tests, benchmarks);
 *                  --egress captures the traffic of the network namespace
 *                  we run in first (for tests that made one)
 *   --ns --rootfs DIR [--rootfs-fd N] [--stage DIR --stage-inode D:I | --stage-fd N]
 *        --overlay-mb N --hostname H
 *                  PID 1 of a namespace sandbox the server has cloned (root
 *                  of its own user namespace): build the sandbox (ns_setup.c)
 *                  from the rootfs tree, or from the idmapped mount of it on
 *                  fd N, with a stage's layer over it when given (by
 *                  name: it must be the directory D:I the server checked),
 *                  capture
 *                  its traffic (egress_nl.c), drop privileges (confine.c),
 *                  serve on fd 3
 *   --probe-egress try the capture in a user and network namespace of our
 *                  own, print "ok" or what failed (the server's doctor)
 *   (as PID 1, without --ns)
 *                  PID 1 of a microVM (vm_init.c): mount the rootfs disk under
 *                  an overlay, serve on the virtio-serial port "agent".  A
 *                  port reads EOF while no host is connected; there the agent
 *                  waits for the host instead of exiting.
 * Everything after the setup (the loop, every request, SETUP frames for
 * entropy and the clock) is shared by all modes.
 *
 * The loop is single-threaded: poll() over the channel, a signalfd for
 * SIGCHLD, the output pipes of commands, the pipes of tree copies and the
 * egress sockets (egress.c), with a timeout computed from the
 * nearest command deadline.  A readable channel yields one whole frame: the
 * host writes whole frames, so finishing a partial one with blocking reads
 * never stalls for long.  Writes to the channel block; the host always
 * drains it. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"
#include "guest/agent.h"
#include "guest/egress_nl.h"
#include "guest/machine.h"
#include "guest/vm_init.h"

#define AGENT_NS_CHANNEL_FD 3

void agent_log(const char *fmt, ...) {
  static const char prefix[] = "ign-agent: ";
  char line[2048];
  memcpy(line, prefix, sizeof prefix - 1);
  size_t room = sizeof line - (sizeof prefix - 1) - 1; /* keep one byte for '\n' */
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line + sizeof prefix - 1, room, fmt, ap);
  va_end(ap);
  size_t len = sizeof prefix - 1 + (n < 0 ? 0 : (size_t)n < room ? (size_t)n : room - 1);
  line[len++] = '\n';
  /* One write per line, so the server's capture of our stderr never gets
   * two lines interleaved; a failure to log has nowhere to be reported. */
  if (write(STDERR_FILENO, line, len) < 0)
    return;
}

/* ---- the modules' view of the agent (agent_core.h, *_int.h) ------------ */

struct exec_state *agent_exec(struct agent *a) { return &a->exec; }
struct files_state *agent_files(struct agent *a) { return &a->files; }
struct tree_state *agent_trees(struct agent *a) { return &a->trees; }
struct egress_state *agent_egress(struct agent *a) { return &a->egress; }
bool agent_connected(const struct agent *a) { return a->chan_ok; }
uint8_t *agent_chunk(struct agent *a) { return a->chunk; }

/* ---- sending ------------------------------------------------------------ */

struct proto_buf *agent_frame(struct agent *a, enum proto_type type, uint32_t id) {
  proto_frame_begin(&a->out, type, id);
  return &a->out;
}

void agent_send(struct agent *a) {
  if (!a->chan_ok)
    return;
  int r = proto_frame_finish(&a->out);
  if (r < 0) {
    /* Only a bug can build an oversized frame; say so rather than die. */
    agent_log("dropping an outgoing frame: %s", strerror(-r));
    return;
  }
  r = proto_write_all(a->chan, a->out.data, a->out.len);
  if (r < 0 && a->mode == AGENT_MODE_VM) {
    /* No host on the port right now: the frame is lost, the agent is not. */
    agent_log("writing to the channel failed: %s", strerror(-r));
    return;
  }
  if (r < 0) {
    /* The host hanging up is the end of the session, like EOF. */
    bool hangup = r == -EPIPE || r == -ECONNRESET;
    if (!hangup)
      agent_log("writing to the channel failed: %s", strerror(-r));
    a->chan_ok = false;
    a->exit_status = hangup ? 0 : 1;
  }
}

void agent_send_empty(struct agent *a, enum proto_type type, uint32_t id) {
  proto_frame_begin(&a->out, type, id);
  agent_send(a);
}

void agent_send_data(struct agent *a, enum proto_type type, uint32_t id, const void *p, size_t n) {
  proto_frame_begin(&a->out, type, id);
  proto_put_raw(&a->out, p, n);
  agent_send(a);
}

void agent_send_error(struct agent *a, uint32_t id, int err, const char *fmt, ...) {
  /* Messages quote at most a couple of paths (each <= PATH_MAX). */
  static char msg[3 * PATH_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  proto_frame_begin(&a->out, PROTO_ERROR, id);
  proto_put_u32(&a->out, TAG_ERRNO, (uint32_t)err);
  proto_put_str(&a->out, TAG_MESSAGE, msg);
  agent_send(a);
}

/* ---- failed multi-frame requests ---------------------------------------- */

void agent_ignore_until(struct agent *a, uint32_t id, enum proto_type end_type) {
  if (agent_ignoring(a, id, end_type, false))
    return;
  /* Bounded: past the cap the oldest is forgotten, and its late frames get
   * an EPROTO error instead of silence, which is harmless. */
  if (a->n_ignored == AGENT_MAX_IGNORED) {
    memmove(&a->ignored[0], &a->ignored[1], (AGENT_MAX_IGNORED - 1) * sizeof a->ignored[0]);
    a->n_ignored--;
  }
  a->ignored[a->n_ignored++] = (struct agent_ignored){.id = id, .end_type = (uint8_t)end_type};
}

bool agent_ignoring(struct agent *a, uint32_t id, enum proto_type end_type, bool is_end) {
  for (size_t i = 0; i < a->n_ignored; i++) {
    if (a->ignored[i].id != id || a->ignored[i].end_type != end_type)
      continue;
    if (is_end) {
      memmove(&a->ignored[i], &a->ignored[i + 1], (a->n_ignored - i - 1) * sizeof a->ignored[0]);
      a->n_ignored--;
    }
    return true;
  }
  return false;
}

bool agent_id_busy(struct agent *a, uint32_t id) {
  return exec_id_busy(&a->exec, id) || files_id_busy(&a->files, id) ||
         tree_id_busy(&a->trees, id);
}

/* ---- request fields ----------------------------------------------------- */

int agent_tlv_u32(struct agent *a, uint32_t id, const char *req, const char *tag,
                  const uint8_t *v, uint32_t n, uint32_t *ret) {
  if (proto_val_u32(v, n, ret) < 0) {
    agent_send_error(a, id, EPROTO,
                     "malformed %s request: %s must be a 4-byte integer, got %u bytes", req, tag,
                     n);
    return -EPROTO;
  }
  return 0;
}

int agent_tlv_u64(struct agent *a, uint32_t id, const char *req, const char *tag,
                  const uint8_t *v, uint32_t n, uint64_t *ret) {
  if (proto_val_u64(v, n, ret) < 0) {
    agent_send_error(a, id, EPROTO,
                     "malformed %s request: %s must be an 8-byte integer, got %u bytes", req, tag,
                     n);
    return -EPROTO;
  }
  return 0;
}

int agent_resolve_path(struct agent *a, uint32_t id, const char *what, const uint8_t *v,
                       uint32_t n, char ret_path[PATH_MAX]) {
  if (n == 0) {
    agent_send_error(a, id, EINVAL, "%s is empty", what);
    return -EINVAL;
  }
  if (memchr(v, '\0', n)) {
    agent_send_error(a, id, EINVAL, "%s contains a NUL byte", what);
    return -EINVAL;
  }
  if (n > PROTO_MAX_PATH) {
    agent_send_error(a, id, ENAMETOOLONG, "%s is longer than %u bytes", what, PROTO_MAX_PATH);
    return -ENAMETOOLONG;
  }
  const char *prefix = v[0] == '/' ? "" : "/root/";
  int len = snprintf(ret_path, PATH_MAX, "%s%.*s", prefix, (int)n, (const char *)v);
  if (len < 0 || len >= PATH_MAX) {
    agent_send_error(a, id, ENAMETOOLONG, "%s '%s%.*s' is longer than %d bytes", what, prefix,
                     (int)n, (const char *)v, PATH_MAX - 1);
    return -ENAMETOOLONG;
  }
  return 0;
}

/* ---- connection-level requests ------------------------------------------ */

static const char *agent_mode_name(enum agent_mode m) {
  return m == AGENT_MODE_NS ? "ns" : m == AGENT_MODE_VM ? "vm" : "fd";
}

static void agent_handle_hello(struct agent *a, uint32_t id, const uint8_t *p, size_t n) {
  const uint8_t *v;
  uint32_t len, version;
  int r = proto_find(p, n, TAG_VERSION, &v, &len);
  if (r < 0) {
    agent_send_error(a, id, EPROTO, "malformed HELLO request: a TLV record runs past the payload");
    return;
  }
  if (r == 0) {
    agent_send_error(a, id, EPROTO, "malformed HELLO request: VERSION is missing");
    return;
  }
  if (agent_tlv_u32(a, id, "HELLO", "VERSION", v, len, &version) < 0)
    return;
  if (version != PROTO_VERSION) {
    agent_send_error(a, id, EPROTONOSUPPORT, "agent speaks protocol %u, host asked for %u",
                     PROTO_VERSION, version);
    return;
  }
  /* A clone's clock and entropy (and identity) may come with its HELLO. */
  a->setup_failed = machine_setup(a, id, p, n) < 0;
  if (a->setup_failed)
    return;
  char info[64];
  snprintf(info, sizeof info, "ign-agent %s mode=%s", IGN_VERSION, agent_mode_name(a->mode));
  proto_frame_begin(&a->out, PROTO_HELLO_OK, id);
  proto_put_u32(&a->out, TAG_VERSION, PROTO_VERSION);
  proto_put_str(&a->out, TAG_INFO, info);
  if (a->egress.error[0])
    proto_put_str(&a->out, TAG_EGRESS_ERROR, a->egress.error);
  agent_send(a);
}

/* EGRESS_STATS: the capture's refusal counters, read here (a vm's agent
 * and --serve-fd keep their capabilities).  An ns agent has none left: the
 * server reads them itself on AGENT_NS_COUNTERS_FD and never asks. */
static void agent_handle_egress_stats(struct agent *a, uint32_t id) {
  if (a->egress.error[0]) {
    agent_send_error(a, id, ENOENT, "the sandbox has no capture of its traffic: %s",
                     a->egress.error);
    return;
  }
  if (a->mode == AGENT_MODE_NS) {
    agent_send_error(a, id, EPERM, "an ns sandbox's agent cannot read the refusal counters "
                                   "(it has no capabilities): the server reads them itself");
    return;
  }
  uint64_t v[EGRESS_REFUSED_N];
  char err[200];
  int r = egress_refused_read(v, err, sizeof err);
  if (r < 0) {
    agent_send_error(a, id, -r, "%s", err);
    return;
  }
  proto_frame_begin(&a->out, PROTO_OK, id);
  proto_put_u64(&a->out, TAG_UDP, v[EGRESS_REFUSED_UDP]);
  proto_put_u64(&a->out, TAG_ICMP, v[EGRESS_REFUSED_ICMP]);
  proto_put_u64(&a->out, TAG_OTHER, v[EGRESS_REFUSED_OTHER]);
  agent_send(a);
}

/* Refuses a request while the last SETUP failed: a pool clone's SETUP
 * (clock, entropy) is sent at hand-out with the session's first request
 * right behind it, unanswered yet, and that request must not run with the
 * clock and the RNG state the clone had in the pool.  The frames that
 * follow a refused request are dropped.  Whether H was refused. */
static bool agent_refused_unset(struct agent *a, const struct proto_header *h, const uint8_t *p) {
  const uint8_t *v;
  uint32_t len, flag;
  enum proto_type end = 0;
  switch (h->type) {
  case PROTO_EXEC:
    if (proto_find(p, h->len, TAG_HAS_STDIN, &v, &len) == 1 && proto_val_u32(v, len, &flag) == 0 &&
        flag)
      end = PROTO_STDIN_END;
    break;
  case PROTO_WRITE:
  case PROTO_UNPACK:
    end = PROTO_DATA_END;
    break;
  case PROTO_READ:
  case PROTO_PACK:
  case PROTO_EGRESS_STATS:
    break;
  default:
    return false;
  }
  agent_send_error(a, h->id, EAGAIN,
                   "the sandbox's clock and entropy could not be set (the SETUP failed), so "
                   "nothing runs in it; close the session and open another");
  if (end)
    agent_ignore_until(a, h->id, end);
  return true;
}

static void agent_dispatch(struct agent *a, const struct proto_header *h, const uint8_t *p) {
  if (a->setup_failed && agent_refused_unset(a, h, p))
    return;
  switch (h->type) {
  case PROTO_HELLO:
    agent_handle_hello(a, h->id, p, h->len);
    break;
  case PROTO_PING:
    proto_frame_begin(&a->out, PROTO_PONG, h->id);
    proto_put_u32(&a->out, TAG_VERSION, PROTO_VERSION);
    agent_send(a);
    break;
  case PROTO_KILL:
    if (tree_id_busy(&a->trees, h->id))
      tree_handle(a, h, p);
    else
      exec_handle(a, h, p);
    break;
  case PROTO_EXEC:
  case PROTO_STDIN:
  case PROTO_STDIN_END:
    exec_handle(a, h, p);
    break;
  case PROTO_DATA:
  case PROTO_DATA_END:
    if (tree_id_busy(&a->trees, h->id))
      tree_handle(a, h, p);
    else
      files_handle(a, h, p);
    break;
  case PROTO_WRITE:
  case PROTO_READ:
    files_handle(a, h, p);
    break;
  case PROTO_UNPACK:
  case PROTO_PACK:
  case PROTO_CREDIT:
    tree_handle(a, h, p);
    break;
  case PROTO_SETUP:
    a->setup_failed = machine_setup(a, h->id, p, h->len) < 0;
    if (!a->setup_failed)
      agent_send_empty(a, PROTO_OK, h->id);
    break;
  case PROTO_EGRESS_STATS:
    agent_handle_egress_stats(a, h->id);
    break;
  case PROTO_STREAM_OPEN:
  case PROTO_STREAM_ACCEPT:
  case PROTO_STREAM_DATA:
  case PROTO_STREAM_CREDIT:
  case PROTO_STREAM_SHUT:
  case PROTO_STREAM_RESET:
  case PROTO_LOOKUP:
  case PROTO_LOOKUP_END:
    egress_handle(a, h, p);
    break;
  default:
    /* Frames only the agent sends (STDOUT, EXIT, OK, ...). */
    agent_send_error(a, h->id, EPROTO, "unexpected %s frame from the host",
                     proto_type_name(h->type));
    break;
  }
}

static void agent_read_request(struct agent *a) {
  static uint8_t payload[PROTO_MAX_PAYLOAD];
  struct proto_header h;
  int r = proto_read_frame(a->chan, &h, payload);
  if (r == 0) {
    agent_dispatch(a, &h, payload);
    return;
  }
  if (a->mode == AGENT_MODE_VM && (r == -ENODATA || r == -ECONNRESET)) {
    /* Nobody waits for a tree copy, a stream or a lookup any more. */
    tree_cancel_all(a);
    egress_cancel_all(a);
    vm_wait_host(a->chan);
    return;
  }
  /* EOF, or a stream we can no longer follow: stop serving. */
  a->exit_status = 1;
  if (r == -ENODATA) {
    a->exit_status = 0;
  } else if (r == -ECONNRESET) {
    /* The host is gone: it closed the socket with our replies unread, or in
     * the middle of a frame.  The end of the session all the same. */
    agent_log("the host hung up (connection reset or closed mid-frame)");
    a->exit_status = 0;
  } else if (r == -EPROTO) {
    agent_send_error(a, 0, EPROTO, "malformed frame header; closing the connection");
    agent_log("malformed frame header from the host; closing the connection");
  } else {
    agent_log("reading the channel failed: %s", strerror(-r));
  }
  a->chan_ok = false;
}

/* ---- the loop ----------------------------------------------------------- */

/* SIGCHLD goes to a signalfd.  In fd mode SIGTERM, SIGINT and SIGHUP do too,
 * so that a stopped agent still kills its commands.  Not in ns mode: as PID 1
 * of the namespace, a signal left at SIG_DFL cannot be sent to us from inside
 * the sandbox, while a blocked one would be queued and obeyed. */
int agent_signals_init(struct agent *a) {
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGCHLD);
  if (a->mode == AGENT_MODE_FD) {
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGHUP);
  }
  if (sigprocmask(SIG_BLOCK, &mask, NULL) < 0)
    return -errno;
  a->sigfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (a->sigfd < 0)
    return -errno;
  return 0;
}

static void agent_on_signal(struct agent *a) {
  struct signalfd_siginfo si;
  bool child = false;
  for (;;) {
    ssize_t r = read(a->sigfd, &si, sizeof si);
    if (r != (ssize_t)sizeof si)
      break;
    if (si.ssi_signo == SIGCHLD) {
      child = true;
    } else {
      agent_log("stopping on signal %u", si.ssi_signo);
      a->chan_ok = false;
      a->exit_status = 128 + (int)si.ssi_signo;
    }
  }
  if (child)
    exec_reap(a);
}

int agent_serve(struct agent *a) {
  while (a->chan_ok) {
    struct pollfd pfd[2 + EXEC_POLL_MAX + TREE_MAX + EGRESS_POLL_MAX];
    pfd[0] = (struct pollfd){.fd = a->chan, .events = POLLIN};
    pfd[1] = (struct pollfd){.fd = a->sigfd, .events = POLLIN};
    size_t n_exec = exec_pollfds(&a->exec, pfd + 2);
    size_t n_tree = tree_pollfds(&a->trees, pfd + 2 + n_exec);
    size_t n_egress = egress_pollfds(&a->egress, pfd + 2 + n_exec + n_tree);
    int timeout = exec_poll_timeout(&a->exec), tree_timeout = tree_poll_timeout(&a->trees);
    if (tree_timeout >= 0 && (timeout < 0 || tree_timeout < timeout))
      timeout = tree_timeout;
    int r = poll(pfd, 2 + n_exec + n_tree + n_egress, timeout);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      agent_log("poll failed: %m");
      a->exit_status = 1;
      break;
    }
    /* Output first, then exits (which drain what is left), then new work. */
    exec_on_poll(a, pfd + 2, n_exec);
    tree_on_poll(a, pfd + 2 + n_exec, n_tree);
    egress_on_poll(a, pfd + 2 + n_exec + n_tree, n_egress);
    if (pfd[1].revents)
      agent_on_signal(a);
    exec_check_timeouts(a);
    tree_check_timeouts(a);
    if (a->chan_ok && pfd[0].revents)
      agent_read_request(a);
  }
  tree_shutdown(&a->trees);
  egress_shutdown(a);
  exec_shutdown(&a->exec);
  files_shutdown(&a->files);
  proto_buf_free(&a->out);
  close(a->chan);
  a->chan = -1;
  return a->exit_status;
}

/* ---- startup ------------------------------------------------------------ */

/* Commands get fds 0-2 by dup2(); if ours were closed, a pipe could land on
 * one of them and be clobbered, so fill the gaps with /dev/null. */
static int agent_ensure_std_fds(void) {
  for (int fd = 0; fd <= 2; fd++) {
    if (fcntl(fd, F_GETFD) >= 0 || errno != EBADF)
      continue;
    int n = open("/dev/null", O_RDWR);
    if (n < 0)
      return -errno;
    if (n != fd) {
      close(n);
      return -EBADF;
    }
  }
  return 0;
}

/* The inherited channel: close-on-exec, blocking. */
static int agent_adopt_channel(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0)
    return -errno;
  if ((fl & O_NONBLOCK) && fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0)
    return -errno;
  return 0;
}

static int write_file(const char *path, const char *text) {
  _cleanup_close_ int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  if (write(fd, text, strlen(text)) < 0)
    return -errno;
  return 0;
}

/* Root of a new user namespace that owns a new network namespace, our ids
 * mapped to its 0. */
static int probe_enter_namespaces(char *err, size_t err_size) {
  char uid_map[32], gid_map[32];
  snprintf(uid_map, sizeof uid_map, "0 %u 1", (unsigned)geteuid());
  snprintf(gid_map, sizeof gid_map, "0 %u 1", (unsigned)getegid());
  if (unshare(CLONE_NEWUSER | CLONE_NEWNET) < 0) {
    snprintf(err, err_size, "cannot make a user and network namespace to try the capture in: %s",
             strerror(errno));
    return -1;
  }
  int r;
  if ((r = write_file("/proc/self/setgroups", "deny")) < 0 ||
      (r = write_file("/proc/self/uid_map", uid_map)) < 0 ||
      (r = write_file("/proc/self/gid_map", gid_map)) < 0) {
    snprintf(err, err_size, "cannot map our ids in a new user namespace: %s", strerror(-r));
    return -1;
  }
  if ((r = machine_loopback_up()) < 0) {
    snprintf(err, err_size, "cannot bring lo up in a new network namespace: %s", strerror(-r));
    return -1;
  }
  return 0;
}

/* --probe-egress: can this kernel capture a sandbox's traffic?  Tried as an
 * ns sandbox's agent does it, in namespaces of our own (as root or as a
 * user); prints "ok" or what failed on one line. */
int agent_probe_egress(void) {
  char err[256] = "";
  if (probe_enter_namespaces(err, sizeof err) == 0)
    egress_capture_setup(err, sizeof err);
  printf("%s\n", err[0] ? err : "ok");
  return err[0] ? 1 : 0;
}

static int mode_fd(const struct agent_options *o, struct agent *a) {
  /* Orphans of our commands (a daemon started with '&') get reparented to
   * us, so our waitpid(-1) loop reaps them as PID 1 would. */
  if (prctl(PR_SET_CHILD_SUBREAPER, 1) < 0)
    agent_log("cannot become a child subreaper: %m");
  int r = agent_adopt_channel(o->fd);
  if (r < 0) {
    agent_log("fd %d is not usable as the channel: %s", o->fd, strerror(-r));
    return r;
  }
  if (o->egress)
    egress_capture(a);
  a->chan = o->fd;
  return 0;
}

/* /proc/1/cmdline is readable by everyone in the sandbox and would show the
 * host's paths (agent binary, rootfs): overwrite the argument area in place.
 * Only after setup, which still reads the options pointing into it. */
static void agent_hide_args(int argc, char **argv) {
  static const char shown[] = "ign-agent\0--ns";
  char *start = argv[0], *end = argv[argc - 1] + strlen(argv[argc - 1]) + 1;
  memset(start, 0, (size_t)(end - start));
  memcpy(start, shown, (size_t)(end - start) < sizeof shown ? (size_t)(end - start) : sizeof shown);
}

static int mode_ns(const struct agent_options *o, int argc, char **argv, struct agent *a) {
  if (getpid() != 1) {
    agent_log("--ns must run as PID 1 of a new pid namespace (we are pid %d)", (int)getpid());
    return -EINVAL;
  }
  int r = agent_adopt_channel(AGENT_NS_CHANNEL_FD);
  if (r < 0) {
    agent_log("fd %d is not usable as the channel: %s", AGENT_NS_CHANNEL_FD, strerror(-r));
    return r;
  }
  umask(022);
  r = ns_setup(&o->ns);
  if (r < 0)
    return r;
  machine_name_files();
  egress_capture(a);
  if (!a->egress.error[0]) {
    /* Before the drop: the socket the server reads the counters on (see
     * AGENT_NS_COUNTERS_FD); the agent itself never uses it. */
    char err[160];
    if (egress_counters_keep_socket(err, sizeof err) < 0)
      agent_log("egress: %s; refused packets will not be counted", err);
  }
  r = confine_drop_privileges();
  if (r < 0)
    return r;
  agent_hide_args(argc, argv);
  a->chan = AGENT_NS_CHANNEL_FD;
  return 0;
}

int main(int argc, char **argv) {
  static struct agent a;
  struct agent_options o;
  /* PID 1 without --ns is a VM's init; the kernel passes the command line
   * words it does not know (nokaslr, ...) as arguments, which we ignore. */
  bool ns_flag = false;
  for (int i = 1; i < argc; i++)
    ns_flag |= strcmp(argv[i], "--ns") == 0;
  if (getpid() == 1 && !ns_flag) {
    vm_early_init();
    o = (struct agent_options){.mode = AGENT_MODE_VM, .fd = -1};
  } else if (agent_parse_args(argc, argv, &o) < 0) {
    agent_usage(stderr);
    return 2;
  }
  if (agent_ensure_std_fds() < 0)
    return 1;
  /* A host that goes away (or stops reading our stderr) must not kill us
   * before we kill our commands: EPIPE is handled where it happens. */
  signal(SIGPIPE, SIG_IGN);

  a.mode = o.mode;
  a.chan = -1;
  a.sigfd = -1;
  exec_init(&a.exec);
  files_init(&a.files);

  int r;
  switch (o.mode) {
  case AGENT_MODE_FD:
    r = mode_fd(&o, &a);
    break;
  case AGENT_MODE_NS:
    r = mode_ns(&o, argc, argv, &a);
    break;
  case AGENT_MODE_VM:
    r = vm_setup(&a, &a.chan);
    if (r < 0)
      vm_fatal();
    break;
  default:
    r = -EINVAL;
    break;
  }
  if (r < 0)
    return 1;
  r = agent_signals_init(&a);
  if (r < 0) {
    agent_log("cannot set up signal handling: %s", strerror(-r));
    return 1;
  }
  /* Where the capture rules send the sandbox's traffic (fd mode: only
   * with --egress, which sets them up). */
  if (o.mode != AGENT_MODE_FD || o.egress)
    egress_start(&a);
  a.chan_ok = true;
  return agent_serve(&a);
}
