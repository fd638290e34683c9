/* fuzz_proto_host.c: bytes from a sandbox's agent, which the server must
 * treat as hostile (a guest can replace its agent).  A peer thread plays the
 * agent on a socketpair: it answers HELLO with the first part of the input
 * followed by a proper HELLO_OK, and the call that follows with the rest of
 * the input, then hangs up.  The server side is the real client (client.c)
 * with its reader thread; the first byte picks the call.
 *
 * Call 6 (first byte 0xfe) is an upload larger than the client's send
 * queue, cancelled from the start: it gives up after the WRITE, takes its
 * queued frames back and ends the upload short, whatever the peer answers.
 * Calls 7 (0xfd) and 8 (0xfc) are trees: an UNPACK that sends a short
 * stream within the CREDIT the peer grants, and a PACK whose DATA goes to
 * /dev/null, with small caps.  Call 9 (0xfb) sets a stream handler that
 * accepts every stream, echoes its data back within the windows, returns
 * the credit, shuts when the agent shuts and answers every lookup, then
 * PINGs: the answer's stream and lookup frames (ids with bit 31, which the
 * input spells out) reach client_stream.c; the handler is taken away while
 * streams may be open.
 *
 * Call 10 (0xfa) is EGRESS_STATS: its OK's three counts are checked.
 *
 * Input:  u8 call, u16 LE length of the HELLO answer, HELLO answer, call answer.
 * In both answers a frame header whose id is 0 gets the id of the request it
 * answers, so the fuzzer need not guess ids. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/util.h"
#include "proto/client.h"
#include "proto/proto.h"

struct peer {
  int fd;
  const uint8_t *hello;
  size_t hello_len;
  const uint8_t *answer;
  size_t answer_len;
};

/* Copy of SRC with id 0 in each frame header it can walk replaced by ID;
 * *RET_WHOLE says whether SRC is whole frames. */
static uint8_t *with_ids(const uint8_t *src, size_t n, uint32_t id, bool *ret_whole) {
  uint8_t *p = malloc(n ? n : 1);
  if (!p)
    abort();
  memcpy(p, src, n);
  size_t o = 0;
  while (n - o >= PROTO_HEADER_SIZE) {
    if (proto_le32(p + o + 8) == 0)
      proto_put_le32(p + o + 8, id);
    uint32_t len = proto_le32(p + o);
    if (len > n - o - PROTO_HEADER_SIZE)
      break;
    o += PROTO_HEADER_SIZE + len;
  }
  if (ret_whole)
    *ret_whole = o == n;
  return p;
}

static void *peer_main(void *arg) {
  struct peer *pe = arg;
  uint8_t *payload = malloc(PROTO_MAX_PAYLOAD);
  if (!payload)
    abort();
  struct proto_header h;
  if (proto_read_frame(pe->fd, &h, payload) == 0 && h.type == PROTO_HELLO) {
    /* A partial frame at the end would swallow the HELLO_OK and leave the
     * client waiting for its timeout: then hang up after it instead. */
    bool whole;
    _cleanup_free_ uint8_t *a = with_ids(pe->hello, pe->hello_len, h.id, &whole);
    struct proto_buf b = {0};
    proto_frame_begin(&b, PROTO_HELLO_OK, h.id);
    proto_put_u32(&b, TAG_VERSION, PROTO_VERSION);
    proto_put_str(&b, TAG_INFO, "ign-agent fuzz");
    if (proto_frame_finish(&b) < 0)
      abort();
    if (proto_write_all(pe->fd, a, pe->hello_len) == 0 && whole &&
        proto_write_all(pe->fd, b.data, b.len) == 0 &&
        proto_read_frame(pe->fd, &h, payload) == 0) {
      _cleanup_free_ uint8_t *c = with_ids(pe->answer, pe->answer_len, h.id, NULL);
      proto_write_all(pe->fd, c, pe->answer_len);
    }
    proto_buf_free(&b);
  }
  /* Hang up, then take whatever the client still sends until it closes. */
  shutdown(pe->fd, SHUT_WR);
  while (proto_read_frame(pe->fd, &h, payload) == 0)
    ;
  free(payload);
  return NULL;
}

/* Call 9's handler: the broker's side in miniature, from the reader thread. */
static void fz_open(void *ctx, uint32_t sid, const struct agent_stream_open *o) {
  struct agent_conn *c = ctx;
  if (o->port == 25)
    agent_stream_reset(c, sid, ECONNREFUSED, "port 25");
  else
    agent_stream_accept(c, sid, o->window > 1000 ? 1000 : o->window);
}
static void fz_data(void *ctx, uint32_t sid, const uint8_t *p, size_t n) {
  struct agent_conn *c = ctx;
  agent_stream_send(c, sid, p, n);
  agent_stream_credit(c, sid, (uint32_t)n);
}
static void fz_credit(void *ctx, uint32_t sid, uint32_t n) {
  (void)ctx;
  (void)sid;
  (void)n;
}
static void fz_shut(void *ctx, uint32_t sid) { agent_stream_shut(ctx, sid); }
static void fz_reset(void *ctx, uint32_t sid, int err) {
  (void)ctx;
  (void)sid;
  (void)err;
}
static void fz_lookup(void *ctx, uint32_t lid, const struct agent_lookup *q) {
  static const uint8_t addrs[1][16] = {{198, 18, 0, 1}};
  static const int fams[1] = {AF_INET};
  if (q->qtype == 1)
    agent_lookup_answer(ctx, lid, RCODE_NOERROR, fams, addrs, 1, 30);
  else
    agent_lookup_answer(ctx, lid, RCODE_NXDOMAIN, NULL, NULL, 0, 30);
}
static void fz_none(void *ctx) { (void)ctx; }

static void call(struct agent_conn *c, unsigned which) {
  atomic_bool cancelled = false;
  const struct agent_ctl ctl = {.cancelled = &cancelled};
  char *err = NULL;
  switch (which) {
  case 0:
    agent_ping(c, 5000, &err);
    break;
  case 1:
  case 2: {
    const char *env[] = {"A=1", "B=2"};
    const struct agent_exec_req req = {
        .command = "echo hi",
        .cwd = which == 2 ? "/tmp" : NULL,
        .env = env,
        .n_env = 2,
        .timeout_ms = 5000,
        .stdin_data = which == 2 ? "input\n" : NULL,
        .stdin_len = which == 2 ? 6 : 0,
        .out_cap = which == 2 ? 16 : 65536,
    };
    struct agent_exec_res res = {0};
    if (agent_exec(c, &req, &ctl, &res, &err) == 0)
      agent_exec_res_free(&res);
    break;
  }
  case 3: {
    void *data = NULL;
    size_t len = 0;
    uint64_t size = 0;
    bool eof = false;
    if (agent_read_file(c, "/etc/hostname", 0, 4096, &ctl, &data, &len, &size, &eof, &err) == 0)
      free(data);
    break;
  }
  case 4: {
    static const char data[3000] = "file data";
    agent_write_file(c, "/tmp/f", 0644, data, sizeof data, &ctl, &err);
    break;
  }
  case 6: {
    static const char data[AGENT_QUEUE_MAX * 2] = "file data";
    atomic_store(&cancelled, true);
    agent_write_file(c, "/tmp/f", 0644, data, sizeof data, &ctl, &err);
    break;
  }
  case 7:
  case 8: {
    static const uint8_t stream[3000] = "tar stream";
    const struct tar_limits lim = {.max_bytes = 4096, .max_files = 8};
    struct tar_report rep = {0};
    int r;
    if (which == 7) {
      int pfd[2];
      if (pipe2(pfd, O_CLOEXEC) < 0)
        abort();
      if (write(pfd[1], stream, sizeof stream) != (ssize_t)sizeof stream)
        abort();
      close(pfd[1]);
      r = agent_unpack(c, "/work/src", pfd[0], &lim, &ctl, &rep, &err);
      close(pfd[0]);
    } else {
      int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
      if (fd < 0)
        abort();
      r = agent_pack(c, "/work/out", fd, &lim, &ctl, &rep, &err);
      close(fd);
    }
    if (r == 0)
      for (size_t i = 0; i < rep.n_listed; i++) {
        free(rep.listed[i].path);
        free(rep.listed[i].reason);
      }
    break;
  }
  case 9: {
    const struct agent_stream_handler h = {
        .open = fz_open, .data = fz_data, .credit = fz_credit, .shut = fz_shut,
        .reset = fz_reset, .lookup = fz_lookup, .writable = fz_none, .closed = fz_none,
        .ctx = c};
    agent_conn_set_streams(c, &h);
    agent_ping(c, 5000, &err);
    agent_conn_set_streams(c, NULL);
    break;
  }
  case 10: {
    uint64_t counts[3];
    agent_egress_stats(c, 5000, counts, &err);
    break;
  }
  default:
    agent_setup(c, "0123456789abcdef0123456789abcdef", 32, 1, "fuzz",
                "0123456789abcdef0123456789abcdef", &err);
    break;
  }
  free(err);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  /* As in the server: a peer that hung up is an error return, not a signal. */
  signal(SIGPIPE, SIG_IGN);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 3)
    return 0;
  /* 0xfe, 0xfd, 0xfc, 0xfb, 0xfa pick calls 6, 7, 8, 9, 10 (no input of
   * the corpus before them started so). */
  unsigned which = data[0] >= 0xfa && data[0] <= 0xfe ? 6u + (0xfeu - data[0]) : data[0] % 6u;
  size_t hello_len = data[1] | (size_t)data[2] << 8;
  data += 3;
  size -= 3;
  if (hello_len > size)
    hello_len = size;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
    abort();
  struct peer pe = {.fd = sv[1],
                    .hello = data,
                    .hello_len = hello_len,
                    .answer = data + hello_len,
                    .answer_len = size - hello_len};
  pthread_t t;
  if (pthread_create(&t, NULL, peer_main, &pe) != 0)
    abort();
  struct agent_conn *c = NULL;
  char *err = NULL;
  if (agent_conn_open(sv[0], 5000, &c, &err) == 0) {
    call(c, which);
    agent_conn_free(c);
  }
  free(err);
  pthread_join(t, NULL);
  close(sv[1]);
  return 0;
}
