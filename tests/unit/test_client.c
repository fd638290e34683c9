/* test_client.c: the host side of the agent protocol (proto/client.c)
 * against a hostile or stuck agent.  The client is the real one, with its
 * reader and writer threads; the agent is a fake peer on a socketpair that
 * answers each request with what a script says, or stops reading. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/util.h"
#include "proto/client.h"
#include "proto/client_int.h"
#include "proto/proto.h"
#include "test.h"

struct peer;
/* Answers one frame from the host (not HELLO, which the peer answers). */
typedef void (*script_fn)(struct peer *pe, const struct proto_header *h, const uint8_t *payload);

struct peer {
  int fd;
  script_fn script;
  uint64_t arg;
  /* Stop reading after HELLO until `resume` is set. */
  bool stall;
  atomic_bool resume;
  /* Read up to 2 KiB every trickle_ms after HELLO, trickle_reads times,
   * then stop reading until the host hangs up; trickle_eof: the hang-up
   * came while it was still trickling.  small_sndbuf: the host's socket
   * buffer is made as small as it gets, so each read lets it send more. */
  unsigned trickle_ms, trickle_reads;
  bool small_sndbuf;
  bool trickle_eof;
  struct agent_conn *_Atomic conn; /* set once open returned */
  atomic_bool call_done;           /* stop trickling: the call returned */
  /* What the peer saw after HELLO, in order (types and ids), and how many. */
  uint8_t seen[4096];
  uint32_t seen_id[4096];
  _Atomic size_t n_seen; /* published after its entry is written */
  uint64_t data_bytes;
  /* What the host's HELLO carries (SETUP, NULL: none) and what came. */
  const struct agent_setup_req *setup;
  uint8_t hello[512];
  size_t hello_len;
  /* HELLO_OK's EGRESS_ERROR (NULL: none), egress_error_len bytes. */
  const char *egress_error;
  size_t egress_error_len;
  /* Stream frames from the host: DATA bytes and frames, the last ACCEPT's
   * window, CREDIT bytes, SHUTs, the last RESET's errno and message, the
   * last LOOKUP_END's rcode (-1: none yet), address count and TTL, and
   * how many RESETs and LOOKUP_ENDs. */
  _Atomic uint64_t stream_bytes, stream_frames, credits;
  _Atomic uint32_t accept_window, shuts, resets, lookup_ends, reset_errno, lookup_addrs, lookup_ttl;
  _Atomic int lookup_rcode;
  char reset_msg[300];
  /* answer_exit_late: the EXEC's id and the PINGs answered. */
  uint32_t exec_id;
  _Atomic unsigned pings;
  pthread_t thread;
};

/* The test thread speaks for the agent too (its stream frames): whole
 * frames only, one writer at a time. */
static pthread_mutex_t send_lock = PTHREAD_MUTEX_INITIALIZER;

static void send_frame(int fd, struct proto_buf *b) {
  if (proto_frame_finish(b) == 0) {
    pthread_mutex_lock(&send_lock);
    proto_write_all(fd, b->data, b->len);
    pthread_mutex_unlock(&send_lock);
  }
  proto_buf_free(b);
}

/* Notes a stream frame from the host. */
static void peer_stream_frame(struct peer *pe, const struct proto_header *h,
                              const uint8_t *payload) {
  uint32_t v = 0;
  const uint8_t *val;
  uint32_t n;
  switch (h->type) {
  case PROTO_STREAM_DATA:
    pe->stream_bytes += h->len;
    pe->stream_frames++;
    break;
  case PROTO_STREAM_ACCEPT:
    if (proto_find(payload, h->len, TAG_WINDOW, &val, &n) == 1 && proto_val_u32(val, n, &v) == 0)
      pe->accept_window = v;
    break;
  case PROTO_STREAM_CREDIT:
    if (proto_find(payload, h->len, TAG_WINDOW, &val, &n) == 1 && proto_val_u32(val, n, &v) == 0)
      pe->credits += v;
    break;
  case PROTO_STREAM_SHUT:
    pe->shuts++;
    break;
  case PROTO_STREAM_RESET:
    if (proto_find(payload, h->len, TAG_ERRNO, &val, &n) == 1 && proto_val_u32(val, n, &v) == 0)
      pe->reset_errno = v;
    if (proto_find(payload, h->len, TAG_MESSAGE, &val, &n) == 1 && n < sizeof pe->reset_msg) {
      memcpy(pe->reset_msg, val, n);
      pe->reset_msg[n] = '\0';
    }
    pe->resets++;
    break;
  case PROTO_LOOKUP_END: {
    struct proto_tlv_iter it;
    uint16_t tag;
    uint32_t addrs = 0, ttl = 0;
    proto_tlv_init(&it, payload, h->len);
    while (proto_tlv_next(&it, &tag, &val, &n) > 0) {
      addrs += tag == TAG_ADDR;
      if (tag == TAG_TTL)
        proto_val_u32(val, n, &ttl);
    }
    if (proto_find(payload, h->len, TAG_RCODE, &val, &n) == 1 && proto_val_u32(val, n, &v) == 0) {
      pe->lookup_addrs = addrs;
      pe->lookup_ttl = ttl;
      pe->lookup_rcode = (int)v;
    }
    pe->lookup_ends++;
    break;
  }
  default:
    break;
  }
}

static void *peer_main(void *arg) {
  struct peer *pe = arg;
  uint8_t *payload = malloc(PROTO_MAX_PAYLOAD);
  struct proto_header h;
  while (proto_read_frame(pe->fd, &h, payload) == 0) {
    if (h.type == PROTO_HELLO) {
      pe->hello_len = h.len < sizeof pe->hello ? h.len : sizeof pe->hello;
      memcpy(pe->hello, payload, pe->hello_len);
      struct proto_buf b = {0};
      proto_frame_begin(&b, PROTO_HELLO_OK, h.id);
      proto_put_u32(&b, TAG_VERSION, PROTO_VERSION);
      proto_put_str(&b, TAG_INFO, "fake agent");
      if (pe->egress_error)
        proto_put_bytes(&b, TAG_EGRESS_ERROR, pe->egress_error, pe->egress_error_len);
      send_frame(pe->fd, &b);
      while (pe->stall && !atomic_load(&pe->resume))
        usleep(10000);
      if (pe->trickle_ms) {
        char bytes[2048];
        unsigned i = 0;
        for (; i < pe->trickle_reads; i++) {
          usleep(pe->trickle_ms * 1000u);
          struct agent_conn *c = atomic_load(&pe->conn);
          if ((c && !agent_conn_alive(c)) || atomic_load(&pe->call_done) ||
              read(pe->fd, bytes, sizeof bytes) <= 0)
            break;
        }
        pe->trickle_eof = i < pe->trickle_reads;
        break;
      }
      continue;
    }
    size_t i = pe->n_seen;
    if (i < sizeof pe->seen) {
      pe->seen[i] = h.type;
      pe->seen_id[i] = h.id;
      pe->n_seen = i + 1;
    }
    if (h.type == PROTO_DATA)
      pe->data_bytes += h.len;
    peer_stream_frame(pe, &h, payload);
    if (pe->script)
      pe->script(pe, &h, payload);
  }
  free(payload);
  return NULL;
}

/* Starts the peer and opens the connection: 0 or what agent_conn_open
 * returned, with *RET_ERR. */
static int peer_start_r(struct peer *pe, script_fn script, uint64_t arg, struct agent_conn **ret,
                        char **ret_err) {
  /* A peer may still answer after the host closed the connection: EPIPE,
   * not a signal that ends the whole test. */
  signal(SIGPIPE, SIG_IGN);
  pe->lookup_rcode = -1;
  int sv[2];
  CHECK_EQ_INT(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  if (pe->small_sndbuf) {
    int small = 1;
    CHECK_EQ_INT(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof small), 0);
  }
  pe->fd = sv[1];
  pe->script = script;
  pe->arg = arg;
  pthread_create(&pe->thread, NULL, peer_main, pe);
  return agent_conn_open_setup(sv[0], 5000, pe->setup, ret, ret_err);
}

static struct agent_conn *peer_start(struct peer *pe, script_fn script, uint64_t arg) {
  struct agent_conn *c = NULL;
  char *err = NULL;
  int r = peer_start_r(pe, script, arg, &c, &err);
  CHECK_EQ_INT(r, 0);
  if (r < 0)
    fprintf(stderr, "  %s\n", err);
  free(err);
  return c;
}

static void peer_stop(struct peer *pe, struct agent_conn *c) {
  atomic_store(&pe->resume, true);
  agent_conn_free(c);
  pthread_join(pe->thread, NULL);
  close(pe->fd);
}

/* ---- answers ------------------------------------------------------------- */

/* EXIT with the fields in pe->arg's pattern: 0 normal, 1 SIGNAL=0x7fffffff,
 * 2 DURATION=2^64-1, 3 EXIT_CODE 300, 4 signal with an exit code, 5 no
 * SIGNAL, 6 TIMED_OUT=2, 7 EXIT_CODE -1 and SIGNAL 9 (a good kill), 8 good
 * fields then a record cut short, 9 good fields then EXIT_CODE again. */
static void answer_exit(struct peer *pe, const struct proto_header *h, const uint8_t *payload) {
  (void)payload;
  if (h->type != PROTO_EXEC)
    return;
  uint32_t code = 0, sig = 0, to = 0;
  uint64_t dur = 1000;
  switch (pe->arg) {
  case 1: code = (uint32_t)-1; sig = 0x7fffffff; break;
  case 2: dur = UINT64_MAX; break;
  case 3: code = 300; break;
  case 4: code = 3; sig = 9; break;
  case 6: to = 2; break;
  case 7: code = (uint32_t)-1; sig = 9; break;
  default: break;
  }
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_STDOUT, h->id);
  proto_put_raw(&b, "out\n", 4);
  send_frame(pe->fd, &b);
  proto_frame_begin(&b, PROTO_EXIT, h->id);
  proto_put_u32(&b, TAG_EXIT_CODE, code);
  if (pe->arg != 5)
    proto_put_u32(&b, TAG_SIGNAL, sig);
  proto_put_u32(&b, TAG_TIMED_OUT, to);
  proto_put_u64(&b, TAG_DURATION_US, dur);
  if (pe->arg == 8)
    proto_put_raw(&b, "\x0f\x00\x04", 3); /* a record cut short */
  if (pe->arg == 9)
    proto_put_u32(&b, TAG_EXIT_CODE, 1); /* a second, different exit code */
  send_frame(pe->fd, &b);
}

static int run_exec(struct agent_conn *c, struct agent_exec_res *res, char **err) {
  const struct agent_exec_req req = {.command = "true", .timeout_ms = 5000, .out_cap = 1024};
  return agent_exec(c, &req, NULL, res, err);
}

static void exit_fields_are_range_checked(void) {
  static const struct {
    uint64_t pattern;
    const char *says;
  } bad[] = {
      {1, "SIGNAL 2147483647, outside 0..64"},
      {2, "DURATION_US 18446744073709551615, over"},
      {3, "EXIT_CODE 300 for a command that exited"},
      {4, "EXIT_CODE 3 with SIGNAL 9"},
      {5, "no SIGNAL"},
      {6, "TIMED_OUT 2, outside 0..1"},
      {8, "its EXIT frame has a TLV record that runs past the payload"},
      {9, "its EXIT frame has tag 15 twice"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct peer pe = {0};
    struct agent_conn *c = peer_start(&pe, answer_exit, bad[i].pattern);
    struct agent_exec_res res = {0};
    char *err = NULL;
    CHECK_EQ_INT(run_exec(c, &res, &err), -EPROTO);
    CHECK(err && strstr(err, "broke the protocol") && strstr(err, bad[i].says));
    if (err && !strstr(err, bad[i].says))
      fprintf(stderr, "  pattern %llu: %s\n", (unsigned long long)bad[i].pattern, err);
    CHECK(!agent_conn_alive(c));
    free(err);
    err = NULL;
    /* Every later call says the same, not "the sandbox exited". */
    CHECK_EQ_INT(agent_ping(c, 1000, &err), -EPROTO);
    CHECK(err && strstr(err, bad[i].says));
    free(err);
    peer_stop(&pe, c);
  }
  /* The good ones pass, with their values. */
  for (uint64_t pattern = 0; pattern <= 7; pattern += 7) {
    struct peer pe = {0};
    struct agent_conn *c = peer_start(&pe, answer_exit, pattern);
    struct agent_exec_res res = {0};
    char *err = NULL;
    CHECK_EQ_INT(run_exec(c, &res, &err), 0);
    CHECK_EQ_INT(res.exit_code, pattern ? -1 : 0);
    CHECK_EQ_INT(res.signal, pattern ? 9 : 0);
    CHECK_EQ_INT(res.duration_us, 1000);
    CHECK_EQ_INT(res.out_total, 4);
    CHECK(agent_conn_alive(c));
    agent_exec_res_free(&res);
    free(err);
    peer_stop(&pe, c);
  }
}

/* READ: DATA of pe->arg & 0xff bytes, then READ_END per pattern (arg >> 8):
 * 0 good, 1 SIZE=2^64-1, 2 BYTES that disagree, 3 EOF=7. */
static void answer_read(struct peer *pe, const struct proto_header *h, const uint8_t *payload) {
  (void)payload;
  if (h->type != PROTO_READ)
    return;
  uint8_t data[255];
  size_t n = pe->arg & 0xff;
  memset(data, 'r', sizeof data);
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_DATA, h->id);
  proto_put_raw(&b, data, n);
  send_frame(pe->fd, &b);
  unsigned pattern = (unsigned)(pe->arg >> 8);
  proto_frame_begin(&b, PROTO_READ_END, h->id);
  proto_put_u64(&b, TAG_SIZE, pattern == 1 ? UINT64_MAX : 100);
  proto_put_u32(&b, TAG_EOF, pattern == 3 ? 7 : 1);
  proto_put_u64(&b, TAG_BYTES, pattern == 2 ? n + 1 : n);
  send_frame(pe->fd, &b);
}

static int run_read(struct agent_conn *c, uint64_t max, size_t *ret_len, uint64_t *ret_size,
                    char **err) {
  void *data = NULL;
  bool eof;
  int r = agent_read_file(c, "/f", 0, max, NULL, &data, ret_len, ret_size, &eof, err);
  free(data);
  return r;
}

static void read_end_fields_are_range_checked(void) {
  static const struct {
    uint64_t arg;
    uint64_t max;
    const char *says;
  } bad[] = {
      {1 << 8 | 10, 100, "SIZE 18446744073709551615, over 9223372036854775807"},
      {2 << 8 | 10, 100, "says 11 bytes were sent, but 10 came"},
      {3 << 8 | 10, 100, "EOF 7, outside 0..1"},
      {0 << 8 | 200, 100, "more than the 100 bytes of file data asked for"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct peer pe = {0};
    struct agent_conn *c = peer_start(&pe, answer_read, bad[i].arg);
    size_t len = 0;
    uint64_t size = 0;
    char *err = NULL;
    CHECK_EQ_INT(run_read(c, bad[i].max, &len, &size, &err), -EPROTO);
    CHECK(err && strstr(err, bad[i].says));
    if (err && !strstr(err, bad[i].says))
      fprintf(stderr, "  %s\n", err);
    free(err);
    peer_stop(&pe, c);
  }
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_read, 10);
  size_t len = 0;
  uint64_t size = 0;
  char *err = NULL;
  CHECK_EQ_INT(run_read(c, 100, &len, &size, &err), 0);
  CHECK_EQ_INT(len, 10);
  CHECK_EQ_INT(size, 100);
  free(err);
  peer_stop(&pe, c);
}

/* Every request refused with ERROR{ERRNO=pe->arg}. */
static void answer_error(struct peer *pe, const struct proto_header *h, const uint8_t *payload) {
  (void)payload;
  if (h->type != PROTO_WRITE && h->type != PROTO_EXEC && h->type != PROTO_PING)
    return;
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_ERROR, h->id);
  proto_put_u32(&b, TAG_ERRNO, (uint32_t)pe->arg);
  if (pe->arg == EPIPE)
    proto_put_str(&b, TAG_MESSAGE, "guest says: broken pipe");
  send_frame(pe->fd, &b);
}

static void guest_errno_is_not_a_host_error(void) {
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_error, EPIPE);
  char *err = NULL;
  static const char data[100000];
  /* A guest's EPIPE is the guest's: the call fails with its message, the
   * connection (and so the session) lives on. */
  CHECK_EQ_INT(agent_write_file(c, "/f", 0644, data, sizeof data, NULL, &err), -EREMOTEIO);
  CHECK_STREQ(err, "guest says: broken pipe");
  CHECK(agent_conn_alive(c));
  free(err);
  err = NULL;
  struct agent_exec_res res = {0};
  CHECK_EQ_INT(run_exec(c, &res, &err), -EREMOTEIO);
  CHECK(agent_conn_alive(c));
  free(err);
  peer_stop(&pe, c);

  /* ERRNO outside 1..4095 is a protocol error. */
  for (uint32_t e = 0; e <= 5000; e += 5000) {
    struct peer pe2 = {0};
    c = peer_start(&pe2, answer_error, e);
    err = NULL;
    CHECK_EQ_INT(agent_ping(c, 5000, &err), -EPROTO);
    CHECK(err && strstr(err, "ERRNO") && strstr(err, "outside 1..4095"));
    free(err);
    peer_stop(&pe2, c);
  }
}

/* EGRESS_STATS answered as pe->arg says: 0 good (3, 1, 2^64-1), 1 no
 * OTHER, 2 a UDP of 4 bytes, 3 UDP twice, 4 ERROR{ENOENT}, 5 a PONG, 6 no
 * answer, 7 good with a tag of no meaning besides. */
static void answer_stats(struct peer *pe, const struct proto_header *h, const uint8_t *payload) {
  (void)payload;
  if (h->type != PROTO_EGRESS_STATS || pe->arg == 6)
    return;
  struct proto_buf b = {0};
  proto_frame_begin(&b, pe->arg == 4 ? PROTO_ERROR : pe->arg == 5 ? PROTO_PONG : PROTO_OK, h->id);
  if (pe->arg == 4) {
    proto_put_u32(&b, TAG_ERRNO, ENOENT);
    proto_put_str(&b, TAG_MESSAGE, "the sandbox has no capture of its traffic");
  } else if (pe->arg != 5) {
    if (pe->arg == 2)
      proto_put_u32(&b, TAG_UDP, 3);
    else
      proto_put_u64(&b, TAG_UDP, 3);
    if (pe->arg == 3)
      proto_put_u64(&b, TAG_UDP, 4);
    proto_put_u64(&b, TAG_ICMP, 1);
    if (pe->arg != 1)
      proto_put_u64(&b, TAG_OTHER, UINT64_MAX);
    if (pe->arg == 7)
      proto_put_u64(&b, 999, 5);
  }
  send_frame(pe->fd, &b);
}

static void egress_stats_are_checked(void) {
  static const struct {
    uint64_t arg;
    int r;
    const char *says;
  } cases[] = {
      {1, -EPROTO, "its OK frame has no OTHER"},
      {2, -EPROTO, "its OK frame has a UDP of 4 bytes, not 8"},
      {3, -EPROTO, "its OK frame to EGRESS_STATS has UDP 2 times"},
      {4, -EREMOTEIO, "the sandbox has no capture of its traffic"},
      {5, -EPROTO, "answered a EGRESS_STATS request with a PONG frame"},
      {6, -ETIMEDOUT, "stopped answering"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    struct peer pe = {0};
    struct agent_conn *c = peer_start(&pe, answer_stats, cases[i].arg);
    uint64_t v[3] = {7, 7, 7};
    char *err = NULL;
    CHECK_EQ_INT(agent_egress_stats(c, 300, v, &err), cases[i].r);
    CHECK(err && strstr(err, cases[i].says));
    if (err && !strstr(err, cases[i].says))
      fprintf(stderr, "  %s\n", err);
    /* Nothing written on a failure. */
    CHECK(v[0] == 7 && v[1] == 7 && v[2] == 7);
    /* A refusal or a late answer leaves the connection; a broken answer
     * ends it. */
    CHECK_EQ_INT(agent_conn_alive(c), cases[i].r != -EPROTO);
    free(err);
    peer_stop(&pe, c);
  }
  for (uint64_t arg = 0; arg <= 7; arg += 7) {
    struct peer pe = {0};
    struct agent_conn *c = peer_start(&pe, answer_stats, arg);
    uint64_t v[3] = {0};
    char *err = NULL;
    CHECK_EQ_INT(agent_egress_stats(c, 5000, v, &err), 0);
    CHECK(v[0] == 3 && v[1] == 1 && v[2] == UINT64_MAX);
    CHECK(err == NULL);
    free(err);
    peer_stop(&pe, c);
  }
}

/* Ends the connection with ERROR{id 0} that reads like the host's words. */
static void answer_goodbye(struct peer *pe, const struct proto_header *h, const uint8_t *payload) {
  (void)payload;
  (void)h;
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_ERROR, 0);
  proto_put_u32(&b, TAG_ERRNO, ENOMEM);
  proto_put_str(&b, TAG_MESSAGE, "the server is out of memory");
  send_frame(pe->fd, &b);
}

/* The agent's farewell is quoted as the agent's: the guest cannot word the
 * host's own reasons. */
static void agent_farewell_is_the_agents(void) {
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_goodbye, 0);
  char *err = NULL;
  CHECK_EQ_INT(agent_ping(c, 5000, &err), -EPIPE);
  CHECK_STREQ(err, "the sandbox's agent closed the connection: the server is out of memory");
  CHECK(!agent_conn_alive(c));
  free(err);
  peer_stop(&pe, c);
}

/* Answers any request with a frame of type pe->arg & 0xff, id pe->arg >> 8
 * (0: the request's). */
static void answer_wrong(struct peer *pe, const struct proto_header *h, const uint8_t *payload) {
  (void)payload;
  if (h->type == PROTO_DATA || h->type == PROTO_DATA_END)
    return;
  struct proto_buf b = {0};
  uint32_t id = (uint32_t)(pe->arg >> 8);
  proto_frame_begin(&b, (enum proto_type)(pe->arg & 0xff), id == 0xffff ? 0 : id ? id : h->id);
  proto_put_u32(&b, TAG_VERSION, PROTO_VERSION);
  send_frame(pe->fd, &b);
}

static void answers_must_fit_the_request(void) {
  static const struct {
    uint64_t arg;
    const char *says;
  } bad[] = {
      {PROTO_HELLO_OK, "answered a PING request with a HELLO_OK frame"},
      {PROTO_OK, "answered a PING request with a OK frame"},
      {PROTO_EXIT, "answered a PING request with a EXIT frame"},
      {PROTO_STDOUT | 0xffffull << 8, "a STDOUT frame with request id 0"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct peer pe = {0};
    struct agent_conn *c = peer_start(&pe, answer_wrong, bad[i].arg);
    char *err = NULL;
    CHECK_EQ_INT(agent_ping(c, 5000, &err), -EPROTO);
    CHECK(err && strstr(err, bad[i].says));
    if (err && !strstr(err, bad[i].says))
      fprintf(stderr, "  %s\n", err);
    free(err);
    peer_stop(&pe, c);
  }
  /* HELLO_OK for a pending WRITE, too. */
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_wrong, PROTO_HELLO_OK);
  char *err = NULL;
  CHECK_EQ_INT(agent_write_file(c, "/f", 0644, "x", 1, NULL, &err), -EPROTO);
  CHECK(err && strstr(err, "answered a WRITE request with a HELLO_OK frame"));
  free(err);
  peer_stop(&pe, c);
}

/* ---- a peer that stops reading ------------------------------------------ */

#define BIG (8u << 20)

struct writer_call {
  struct agent_conn *c;
  atomic_bool cancelled;
  int r;
  char *err;
};

static void *write_big(void *arg) {
  struct writer_call *w = arg;
  uint8_t *data = calloc(1, BIG);
  const struct agent_ctl ctl = {.cancelled = &w->cancelled};
  w->r = agent_write_file(w->c, "/big", 0644, data, BIG, &ctl, &w->err);
  free(data);
  return NULL;
}

static void stalled_write_hits_its_deadline(void) {
  struct peer pe = {.stall = true};
  struct agent_conn *c = peer_start(&pe, NULL, 0);
  agent_conn_set_write_deadline(c, 300);
  struct writer_call w = {.c = c};
  write_big(&w);
  CHECK_EQ_INT(w.r, -EPROTO);
  CHECK(w.err && strstr(w.err, "stopped reading its channel") &&
        strstr(w.err, "took nothing while frames waited"));
  CHECK(!agent_conn_alive(c));
  free(w.err);
  peer_stop(&pe, c);
}

/* A guest that takes a little now and then, always within the write
 * deadline, must not hold a frame for longer than the deadline: the host
 * ends the connection while the guest is still trickling. */
static void trickled_write_hits_its_deadline(void) {
  /* 100 reads at one per 100 ms take 10 s, ten times the deadline; a
   * 64 KiB frame at 2 KiB per read takes 3 s. */
  struct peer pe = {.trickle_ms = 100, .trickle_reads = 100, .small_sndbuf = true};
  struct agent_conn *c = peer_start(&pe, NULL, 0);
  atomic_store(&pe.conn, c);
  agent_conn_set_write_deadline(c, 1000);
  struct writer_call w = {.c = c};
  write_big(&w);
  CHECK_EQ_INT(w.r, -EPROTO);
  CHECK(w.err && strstr(w.err, "stopped reading its channel"));
  CHECK(!agent_conn_alive(c));
  pthread_join(pe.thread, NULL);
  CHECK(pe.trickle_eof);
  free(w.err);
  agent_conn_free(c);
  close(pe.fd);
}

/* A command's stdin that the agent takes slowly (each frame within the write
 * deadline) does not hold the call past the command's timeout and the
 * host's grace: the host's deadline counts from the call's start, not from
 * when the last of its stdin was queued. */
static void slow_stdin_hits_the_call_deadline(void) {
  /* 300 reads at one per 100 ms take 30 s, past the call's 1 s + 20 s. */
  struct peer pe = {.trickle_ms = 100, .trickle_reads = 300, .small_sndbuf = true};
  struct agent_conn *c = peer_start(&pe, NULL, 0);
  atomic_store(&pe.conn, c);
  agent_conn_set_write_deadline(c, 10000);
  uint8_t *in = calloc(1, BIG);
  const struct agent_exec_req req = {.command = "cat", .timeout_ms = 1000, .out_cap = 1024,
                                     .stdin_data = in, .stdin_len = BIG};
  struct agent_exec_res res = {0};
  char *err = NULL;
  int r = agent_exec(c, &req, NULL, &res, &err);
  atomic_store(&pe.call_done, true);
  CHECK_EQ_INT(r, -ETIMEDOUT);
  CHECK(err && strstr(err, "stopped answering"));
  pthread_join(pe.thread, NULL);
  /* It gave up while the agent was still reading its stdin. */
  CHECK(pe.trickle_eof);
  free(err);
  free(in);
  agent_conn_free(c);
  close(pe.fd);
}

/* Answers EXEC with EXIT 0 at once, then reads nothing more until resumed
 * (a command that exits without reading its stdin, on a busy agent); then
 * answers PING. */
static void answer_exit_then_stall(struct peer *pe, const struct proto_header *h,
                                   const uint8_t *payload) {
  (void)payload;
  struct proto_buf b = {0};
  if (h->type == PROTO_PING) {
    proto_frame_begin(&b, PROTO_PONG, h->id);
    send_frame(pe->fd, &b);
    return;
  }
  if (h->type != PROTO_EXEC)
    return;
  proto_frame_begin(&b, PROTO_EXIT, h->id);
  proto_put_u32(&b, TAG_EXIT_CODE, 0);
  proto_put_u32(&b, TAG_SIGNAL, 0);
  proto_put_u32(&b, TAG_TIMED_OUT, 0);
  proto_put_u64(&b, TAG_DURATION_US, 1000);
  send_frame(pe->fd, &b);
  while (!atomic_load(&pe->resume))
    usleep(10000);
}

/* A command that exited has its result at once, however much of its stdin
 * was still to go: the rest is not sent, and the agent is told it ended. */
static void exited_command_drops_its_stdin(void) {
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_exit_then_stall, 0);
  agent_conn_set_write_deadline(c, 600000);
  uint8_t *in = calloc(1, BIG);
  const struct agent_exec_req req = {.command = "true", .timeout_ms = 1000, .out_cap = 1024,
                                     .stdin_data = in, .stdin_len = BIG};
  struct agent_exec_res res = {0};
  char *err = NULL;
  CHECK_EQ_INT(agent_exec(c, &req, NULL, &res, &err), 0);
  CHECK_EQ_INT(res.exit_code, 0);
  agent_exec_res_free(&res);
  free(err);
  err = NULL;
  atomic_store(&pe.resume, true);
  CHECK_EQ_INT(agent_ping(c, 60000, &err), 0);
  free(err);
  /* PING is a control frame and overtakes the queued stdin, so the PONG
   * can come back before the peer has read STDIN_END: wait for it. */
  bool saw_end = false;
  uint64_t stdin_frames = 0;
  for (int tries = 0; !saw_end && tries < 500; tries++) {
    if (tries)
      usleep(10000);
    stdin_frames = 0;
    size_t n = atomic_load(&pe.n_seen);
    for (size_t i = 0; i < n; i++) {
      saw_end |= pe.seen[i] == PROTO_STDIN_END;
      stdin_frames += pe.seen[i] == PROTO_STDIN;
    }
  }
  CHECK(saw_end);
  CHECK(stdin_frames < BIG / PROTO_CHUNK);
  free(in);
  peer_stop(&pe, c);
}

/* Answers PING with PONG. */
static void answer_ping(struct peer *pe, const struct proto_header *h, const uint8_t *payload) {
  (void)payload;
  if (h->type != PROTO_PING)
    return;
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_PONG, h->id);
  send_frame(pe->fd, &b);
}

static bool peer_saw(struct peer *pe, uint8_t type);

/* An agent killing a command that takes long to die: EXEC is answered only
 * once pe->arg PINGs have been (each with a PONG); pe->arg 0: an agent that
 * stopped, answering neither. */
static void answer_exit_late(struct peer *pe, const struct proto_header *h,
                             const uint8_t *payload) {
  (void)payload;
  if (h->type == PROTO_EXEC)
    pe->exec_id = h->id;
  if (h->type != PROTO_PING || !pe->arg)
    return;
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_PONG, h->id);
  send_frame(pe->fd, &b);
  if (++pe->pings != pe->arg)
    return;
  proto_frame_begin(&b, PROTO_EXIT, pe->exec_id);
  proto_put_u32(&b, TAG_EXIT_CODE, (uint32_t)-1);
  proto_put_u32(&b, TAG_SIGNAL, 9);
  proto_put_u32(&b, TAG_TIMED_OUT, 1);
  proto_put_u64(&b, TAG_DURATION_US, 1000);
  send_frame(pe->fd, &b);
}

/* Past a command's timeout and the grace the host PINGs the agent and waits
 * on while it answers: a guest slow to tear down a fork bomb is not an agent
 * that stopped.  One that answers no PING is. */
static void late_exit_waits_while_the_agent_answers(void) {
  const struct agent_exec_req req = {.command = "bomb", .timeout_ms = 100, .out_cap = 1024};
  for (uint64_t pings = 0; pings <= 3; pings += 3) {
    struct peer pe = {0};
    struct agent_conn *c = peer_start(&pe, answer_exit_late, pings);
    agent_conn_set_exec_grace(c, 200);
    struct agent_exec_res res = {0};
    char *err = NULL;
    uint64_t t0 = mono_ms();
    int r = agent_exec(c, &req, NULL, &res, &err);
    uint64_t took = mono_ms() - t0;
    if (pings) {
      /* 100 + 200, then three PINGs 200 ms apart, the third with the EXIT. */
      CHECK_EQ_INT(r, 0);
      CHECK(res.timed_out && res.signal == 9);
      CHECK_EQ_INT((int)pe.pings, 3);
      CHECK(took >= 700);
    } else {
      /* 100 + 200, then a PING unanswered for 200: given up. */
      CHECK_EQ_INT(r, -ETIMEDOUT);
      CHECK(err && strstr(err, "stopped answering"));
      CHECK(took >= 500 && took < 5000);
      /* The KILL is queued as the call returns; the peer reads it soon after. */
      for (int i = 0; i < 200 && !peer_saw(&pe, PROTO_KILL); i++)
        usleep(10000);
      CHECK(peer_saw(&pe, PROTO_PING) && peer_saw(&pe, PROTO_KILL));
    }
    agent_exec_res_free(&res);
    free(err);
    peer_stop(&pe, c);
  }
}

struct ping_call {
  struct agent_conn *c;
  int r;
};

static void *ping_main(void *arg) {
  struct ping_call *p = arg;
  char *err = NULL;
  p->r = agent_ping(p->c, 60000, &err);
  free(err);
  return NULL;
}

static void cancel_returns_while_the_peer_does_not_read(void) {
  struct peer pe = {.stall = true};
  struct agent_conn *c = peer_start(&pe, answer_ping, 0);
  /* Far past the test's own timeout: only the cancellation can end it. */
  agent_conn_set_write_deadline(c, 600000);
  struct writer_call w = {.c = c};
  pthread_t t;
  pthread_create(&t, NULL, write_big, &w);
  /* Let the upload fill the socket and the queue: wait until the socket
   * holds the WRITE and some of its data (a loaded machine may take a
   * while to run the writer; cancelled before the WRITE left, the upload
   * would be unknown to the peer and this test would test nothing). */
  for (int i = 0; i < 1000; i++) {
    int queued = 0;
    if (ioctl(pe.fd, FIONREAD, &queued) == 0 && queued >= 2 * (int)PROTO_CHUNK)
      break;
    usleep(10000);
  }
  usleep(200000);
  struct ping_call pc = {.c = c};
  pthread_t tp;
  pthread_create(&tp, NULL, ping_main, &pc);
  usleep(100000);
  atomic_store(&w.cancelled, true);
  pthread_join(t, NULL);
  CHECK_EQ_INT(w.r, -ECANCELED);
  CHECK(agent_conn_alive(c));
  free(w.err);
  /* The agent reads again: the connection is whole (every frame it gets
   * parses), the PING queued during the upload went before the upload's
   * queued data, the upload ends short (so the agent drops it) and the
   * PING is answered. */
  atomic_store(&pe.resume, true);
  pthread_join(tp, NULL);
  CHECK_EQ_INT(pc.r, 0);
  CHECK(agent_conn_alive(c));
  char *err = NULL;
  CHECK_EQ_INT(agent_ping(c, 5000, &err), 0);
  free(err);
  /* The short DATA_END waits in the data queue, behind which a PING may
   * go first (requests are not held behind data): give it time to arrive. */
  for (int i = 0; i < 500; i++) {
    bool seen_end = false;
    for (size_t j = 0; j < pe.n_seen; j++)
      seen_end |= pe.seen[j] == PROTO_DATA_END;
    if (seen_end)
      break;
    usleep(10000);
  }
  size_t ping_at = 0, end_at = 0, n_data = 0;
  for (size_t i = 0; i < pe.n_seen; i++) {
    if (pe.seen[i] == PROTO_PING && !ping_at)
      ping_at = i;
    if (pe.seen[i] == PROTO_DATA_END)
      end_at = i;
    if (pe.seen[i] == PROTO_DATA && !ping_at)
      n_data++;
  }
  CHECK_EQ_INT(pe.seen[0], PROTO_WRITE);
  CHECK(ping_at > 0 && end_at > 0);
  CHECK(pe.data_bytes < BIG);
  /* Before the PING, at most what the socket and the queue held. */
  CHECK(n_data < BIG / PROTO_CHUNK);
  peer_stop(&pe, c);
}

/* A request queued behind an upload goes out right after the frame on the
 * wire, not after the upload's queued data.  The host's socket buffer is
 * made as small as it gets, so that what the agent reads first is exactly
 * the frame the writer was sending when the request came. */
static void control_frames_go_before_queued_data(void) {
  struct peer pe = {.stall = true};
  int sv[2];
  CHECK_EQ_INT(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  int small = 1;
  CHECK_EQ_INT(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof small), 0);
  pe.fd = sv[1];
  pe.script = answer_ping;
  pthread_create(&pe.thread, NULL, peer_main, &pe);
  struct agent_conn *c = NULL;
  char *err = NULL;
  CHECK_EQ_INT(agent_conn_open(sv[0], 5000, &c, &err), 0);
  free(err);
  agent_conn_set_write_deadline(c, 600000);
  struct writer_call w = {.c = c};
  pthread_t t;
  pthread_create(&t, NULL, write_big, &w);
  usleep(300000); /* the upload fills the socket and the queue */
  struct ping_call pc = {.c = c};
  pthread_t tp;
  pthread_create(&tp, NULL, ping_main, &pc);
  usleep(100000);
  atomic_store(&pe.resume, true);
  pthread_join(tp, NULL);
  CHECK_EQ_INT(pc.r, 0);
  atomic_store(&w.cancelled, true);
  pthread_join(t, NULL);
  size_t ping_at = 0;
  for (size_t i = 0; i < pe.n_seen && !ping_at; i++)
    if (pe.seen[i] == PROTO_PING)
      ping_at = i;
  CHECK_EQ_INT(pe.seen[0], PROTO_WRITE);
  /* WRITE, the DATA frame that was on the wire (if one was yet), then the
   * PING: a queue in arrival order would put the queued DATA frames first. */
  CHECK(ping_at >= 1 && ping_at <= 2);
  if (ping_at > 2)
    fprintf(stderr, "  the PING came after %zu DATA frames\n", ping_at - 1);
  free(w.err);
  peer_stop(&pe, c);
}

/* ---- trees --------------------------------------------------------------- */

/* PACK answered by an agent that never reads its channel again: it sends
 * pe->arg bytes of DATA in 4 KiB frames, paced so that the host keeps up,
 * then PACK_END.  Whatever the host grants it cannot read. */
static void answer_pack_unread(struct peer *pe, const struct proto_header *h,
                               const uint8_t *payload) {
  (void)payload;
  if (h->type != PROTO_PACK)
    return;
  static uint8_t chunk[4096];
  uint64_t sent = 0;
  while (sent < pe->arg) {
    struct proto_buf b = {0};
    proto_frame_begin(&b, PROTO_DATA, h->id);
    proto_put_raw(&b, chunk, sizeof chunk);
    if (proto_frame_finish(&b) < 0 || proto_write_all(pe->fd, b.data, b.len) < 0) {
      proto_buf_free(&b);
      return;
    }
    proto_buf_free(&b);
    sent += sizeof chunk;
    usleep(1000);
  }
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_PACK_END, h->id);
  proto_put_u64(&b, TAG_FILES, 0);
  proto_put_u64(&b, TAG_DIRS, 0);
  proto_put_u64(&b, TAG_SYMLINKS, 0);
  proto_put_u64(&b, TAG_TREE_BYTES, 0);
  proto_put_u64(&b, TAG_SKIPPED, 0);
  proto_put_u64(&b, TAG_BYTES, sent);
  send_frame(pe->fd, &b);
}

/* A PACK's window is what the agent was sent, not what the host queued: an
 * agent that stops reading its channel and keeps sending (each frame the
 * host writes out would queue a CREDIT that never leaves, one per DATA, until
 * the write deadline) breaks the protocol once it is past what reached it. */
static void pack_window_is_what_was_sent(void) {
  struct peer pe = {.small_sndbuf = true};
  struct agent_conn *c = peer_start(&pe, answer_pack_unread, 3ull * TREE_WINDOW);
  agent_conn_set_write_deadline(c, 600000);
  int out = open("/dev/null", O_WRONLY | O_CLOEXEC);
  const struct tar_limits lim = {.max_bytes = 1ull << 30, .max_files = 1000};
  struct tar_report rep = {0};
  char *err = NULL;
  int r = agent_pack(c, "/x", out, &lim, NULL, &rep, &err);
  CHECK_EQ_INT(r, -EPROTO);
  CHECK(err && strstr(err, "granted"));
  CHECK(!agent_conn_alive(c));
  if (r == 0)
    tar_report_free(&rep);
  free(err);
  close(out);
  peer_stop(&pe, c);
}

/* UNPACK answered as an agent does: the whole window granted, and a KILL
 * answered with ECANCELED (DATA_END gets no answer: a commit is not what
 * the test waits for). */
static void answer_unpack(struct peer *pe, const struct proto_header *h,
                          const uint8_t *payload) {
  (void)payload;
  struct proto_buf b = {0};
  if (h->type == PROTO_UNPACK) {
    proto_frame_begin(&b, PROTO_CREDIT, h->id);
    proto_put_u32(&b, TAG_WINDOW, TREE_WINDOW);
    send_frame(pe->fd, &b);
  } else if (h->type == PROTO_KILL) {
    proto_frame_begin(&b, PROTO_ERROR, h->id);
    proto_put_u32(&b, TAG_ERRNO, ECANCELED);
    proto_put_str(&b, TAG_MESSAGE, "copying '/x' was cancelled");
    send_frame(pe->fd, &b);
  }
}

struct unpack_call {
  struct agent_conn *c;
  int fd;
  atomic_bool stop;
  int r;
  char *err;
};

static void *unpack_main(void *arg) {
  struct unpack_call *u = arg;
  const struct tar_limits lim = {.max_bytes = 1ull << 30, .max_files = 1000};
  const struct agent_ctl ctl = {.cancelled = &u->stop};
  struct tar_report rep = {0};
  u->r = agent_unpack(u->c, "/x", u->fd, &lim, &ctl, &rep, &u->err);
  if (u->r == 0)
    tar_report_free(&rep);
  return NULL;
}

/* The stream's producer failed: it stops the call, then closes its end.
 * The EOF that follows is not the end of a whole stream: the agent gets a
 * KILL (it keeps the destination as it was), never DATA_END first (it
 * would commit what came, which may be a whole stream, end marker and
 * all). */
static void unpack_eof_after_a_stop_is_no_end(void) {
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_unpack, 0);
  int p[2];
  CHECK_EQ_INT(pipe2(p, O_CLOEXEC), 0);
  static uint8_t stream[4096];
  CHECK_EQ_INT(write(p[1], stream, sizeof stream), (ssize_t)sizeof stream);
  struct unpack_call u = {.c = c, .fd = p[0]};
  pthread_t t;
  pthread_create(&t, NULL, unpack_main, &u);
  for (int i = 0; i < 500 && pe.data_bytes < sizeof stream; i++)
    usleep(10000);
  CHECK_EQ_INT(pe.data_bytes, sizeof stream);
  usleep(30000); /* the call waits on the pipe again */
  atomic_store(&u.stop, true);
  close(p[1]);
  pthread_join(t, NULL);
  close(p[0]);
  CHECK_EQ_INT(u.r, -ECANCELED);
  /* The call returns once its KILL is queued: the peer reads it a little
   * later. */
  int first = -1;
  for (int k = 0; k < 500 && first < 0; k++) {
    for (size_t i = 0; i < pe.n_seen && first < 0; i++)
      if (pe.seen[i] == PROTO_KILL || pe.seen[i] == PROTO_DATA_END)
        first = pe.seen[i];
    if (first < 0)
      usleep(10000);
  }
  CHECK_EQ_INT(first, PROTO_KILL);
  free(u.err);
  peer_stop(&pe, c);
}

/* UNPACK answered as an agent whose tar process put the tree in place just
 * as the KILL came: DATA_END gets no answer yet, KILL gets OK with the
 * report (pe->arg 1: KILL gets no answer at all). */
static void answer_unpack_late(struct peer *pe, const struct proto_header *h,
                               const uint8_t *payload) {
  (void)payload;
  struct proto_buf b = {0};
  if (h->type == PROTO_UNPACK) {
    proto_frame_begin(&b, PROTO_CREDIT, h->id);
    proto_put_u32(&b, TAG_WINDOW, TREE_WINDOW);
    send_frame(pe->fd, &b);
  } else if (h->type == PROTO_KILL && pe->arg == 0) {
    proto_frame_begin(&b, PROTO_OK, h->id);
    proto_put_u64(&b, TAG_FILES, 1);
    proto_put_u64(&b, TAG_DIRS, 0);
    proto_put_u64(&b, TAG_SYMLINKS, 0);
    proto_put_u64(&b, TAG_TREE_BYTES, 100);
    proto_put_u64(&b, TAG_SKIPPED, 0);
    proto_put_u64(&b, TAG_BYTES, pe->data_bytes);
    send_frame(pe->fd, &b);
  }
}

static bool peer_saw(struct peer *pe, uint8_t type) {
  for (size_t i = 0; i < pe->n_seen; i++)
    if (pe->seen[i] == type)
      return true;
  return false;
}

/* A whole stream, DATA_END sent, then the stop: the agent may have put the
 * tree in place already, so the call waits for its answer and reports
 * what it did (OK: done), or, when it says nothing, that the destination
 * may hold either tree, never that it was left as it was. */
static void unpack_stop_after_the_end_waits_for_the_agent(void) {
  for (uint64_t silent = 0; silent < 2; silent++) {
    struct peer pe = {0};
    struct agent_conn *c = peer_start(&pe, answer_unpack_late, silent);
    int p[2];
    CHECK_EQ_INT(pipe2(p, O_CLOEXEC), 0);
    static uint8_t stream[4096];
    CHECK_EQ_INT(write(p[1], stream, sizeof stream), (ssize_t)sizeof stream);
    close(p[1]);
    struct unpack_call u = {.c = c, .fd = p[0]};
    pthread_t t;
    pthread_create(&t, NULL, unpack_main, &u);
    for (int i = 0; i < 500 && !peer_saw(&pe, PROTO_DATA_END); i++)
      usleep(10000);
    CHECK(peer_saw(&pe, PROTO_DATA_END));
    uint64_t t0 = mono_ms();
    atomic_store(&u.stop, true);
    pthread_join(t, NULL);
    close(p[0]);
    CHECK(peer_saw(&pe, PROTO_KILL));
    if (!silent) {
      CHECK_EQ_INT(u.r, 0);
    } else {
      CHECK_EQ_INT(u.r, -EINPROGRESS);
      CHECK(u.err && strstr(u.err, "may hold the new tree or what it held before"));
      CHECK(mono_ms() - t0 >= 10000); /* past the agent's own grace */
    }
    if (u.r < 0 && u.r != -EINPROGRESS)
      fprintf(stderr, "  silent=%d: %d %s\n", (int)silent, u.r, u.err ? u.err : "");
    free(u.err);
    peer_stop(&pe, c);
  }
}

/* ---- streams -------------------------------------------------------------- */

#define SID(n) (PROTO_AGENT_ID | (n))
/* Polls COND for up to 5 s. */
#define WAIT_FOR(cond)                                   \
  do {                                                   \
    for (int w_ = 0; w_ < 500 && !(cond); w_++)          \
      usleep(10000);                                     \
  } while (0)

/* The agent's frames. */
static void agent_open(struct peer *pe, uint32_t n, uint32_t family, uint32_t addr_len,
                       uint32_t port, uint32_t window, uint32_t kind) {
  static const uint8_t addr[16] = {93, 184, 216, 34};
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_STREAM_OPEN, SID(n));
  proto_put_u32(&b, TAG_KIND, kind);
  proto_put_u32(&b, TAG_FAMILY, family);
  proto_put_bytes(&b, TAG_ADDR, addr, addr_len);
  proto_put_u32(&b, TAG_PORT, port);
  proto_put_u32(&b, TAG_WINDOW, window);
  send_frame(pe->fd, &b);
}

static void agent_tcp(struct peer *pe, uint32_t n, uint32_t window) {
  agent_open(pe, n, 4, 4, 443, window, STREAM_KIND_TCP);
}

static void agent_data(struct peer *pe, uint32_t id, size_t len) {
  static uint8_t bytes[PROTO_MAX_PAYLOAD];
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_STREAM_DATA, id);
  proto_put_raw(&b, bytes, len);
  send_frame(pe->fd, &b);
}

/* A frame of TYPE for ID with one u32 record (TAG 0: none). */
static void agent_u32(struct peer *pe, uint8_t type, uint32_t id, uint16_t tag, uint32_t v) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, (enum proto_type)type, id);
  if (tag)
    proto_put_u32(&b, tag, v);
  send_frame(pe->fd, &b);
}

static void agent_lookup(struct peer *pe, uint32_t n, const char *name, size_t name_len,
                         uint32_t qtype, uint32_t transport) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_LOOKUP, SID(n));
  proto_put_bytes(&b, TAG_NAME, name, name_len);
  proto_put_u32(&b, TAG_QTYPE, qtype);
  proto_put_u32(&b, TAG_TRANSPORT, transport);
  send_frame(pe->fd, &b);
}

/* A stream handler that records what it is told, accepts every stream with
 * accept_window (0: leaves it), and counts calls made while `forbidden`. */
struct rec {
  struct agent_conn *c;
  uint32_t accept_window;
  _Atomic unsigned opens, shuts, resets, lookups, writables, closed, violations;
  _Atomic uint64_t data_bytes, credit_bytes;
  _Atomic uint32_t last_sid;
  _Atomic int last_err;
  atomic_bool forbidden;
  struct agent_stream_open open;
  char name[PROTO_MAX_NAME + 1];
  uint16_t qtype;
  bool tcp;
};

static void rec_call(struct rec *r, uint32_t sid) {
  if (atomic_load(&r->forbidden))
    r->violations++;
  r->last_sid = sid;
}
static void rec_open(void *ctx, uint32_t sid, const struct agent_stream_open *o) {
  struct rec *r = ctx;
  rec_call(r, sid);
  r->open = *o;
  if (r->accept_window)
    CHECK_EQ_INT(agent_stream_accept(r->c, sid, r->accept_window), 0);
  r->opens++;
}
static void rec_data(void *ctx, uint32_t sid, const uint8_t *p, size_t n) {
  (void)p;
  rec_call(ctx, sid);
  ((struct rec *)ctx)->data_bytes += n;
}
static void rec_credit(void *ctx, uint32_t sid, uint32_t n) {
  rec_call(ctx, sid);
  ((struct rec *)ctx)->credit_bytes += n;
}
static void rec_shut(void *ctx, uint32_t sid) {
  rec_call(ctx, sid);
  ((struct rec *)ctx)->shuts++;
}
static void rec_reset(void *ctx, uint32_t sid, int err) {
  struct rec *r = ctx;
  rec_call(r, sid);
  r->last_err = err;
  r->resets++;
}
static void rec_lookup(void *ctx, uint32_t lid, const struct agent_lookup *q) {
  struct rec *r = ctx;
  rec_call(r, lid);
  memcpy(r->name, q->name, q->name_len);
  r->name[q->name_len] = '\0';
  r->qtype = q->qtype;
  r->tcp = q->tcp;
  r->lookups++;
}
static void rec_writable(void *ctx) {
  rec_call(ctx, 0);
  ((struct rec *)ctx)->writables++;
}
static void rec_closed(void *ctx) {
  rec_call(ctx, 0);
  ((struct rec *)ctx)->closed++;
}

static void rec_set(struct rec *r, struct agent_conn *c) {
  const struct agent_stream_handler h = {
      .open = rec_open, .data = rec_data, .credit = rec_credit, .shut = rec_shut,
      .reset = rec_reset, .lookup = rec_lookup, .writable = rec_writable, .closed = rec_closed,
      .ctx = r};
  r->c = c;
  agent_conn_set_streams(c, &h);
}

/* A PING that gets its PONG: every frame the peer sent before was taken. */
static void check_alive(struct agent_conn *c) {
  char *err = NULL;
  CHECK_EQ_INT(agent_ping(c, 5000, &err), 0);
  if (err)
    fprintf(stderr, "  %s\n", err);
  free(err);
}

static void stream_flows_both_ways(void) {
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_ping, 0);
  struct rec r = {.accept_window = 1000};
  rec_set(&r, c);
  agent_tcp(&pe, 1, 100000);
  WAIT_FOR(pe.accept_window == 1000);
  CHECK_EQ_INT(r.opens, 1);
  CHECK_EQ_INT(r.last_sid, SID(1));
  CHECK_EQ_INT(r.open.family, AF_INET);
  CHECK_EQ_INT(r.open.port, 443);
  CHECK_EQ_INT(r.open.window, 100000);
  CHECK(memcmp(r.open.addr, "\x5d\xb8\xd8\x22", 4) == 0);
  /* The agent's data, within the grant. */
  agent_data(&pe, SID(1), 600);
  WAIT_FOR(r.data_bytes == 600);
  CHECK_EQ_INT(r.data_bytes, 600);
  /* The host's: as much as the window, in chunks, then nothing. */
  static uint8_t buf[150000];
  CHECK_EQ_INT(agent_stream_send(c, SID(1), buf, sizeof buf), 100000);
  CHECK_EQ_INT(agent_stream_send(c, SID(1), buf, 10), -EAGAIN);
  WAIT_FOR(pe.stream_bytes == 100000);
  CHECK_EQ_INT(pe.stream_bytes, 100000);
  CHECK_EQ_INT(pe.stream_frames, 2); /* 65536 + 34464 */
  /* Credits both ways. */
  agent_u32(&pe, PROTO_STREAM_CREDIT, SID(1), TAG_WINDOW, 5000);
  WAIT_FOR(r.credit_bytes == 5000);
  CHECK_EQ_INT(agent_stream_send(c, SID(1), buf, 10000), 5000);
  CHECK_EQ_INT(agent_stream_credit(c, SID(1), 400), 0);
  CHECK_EQ_INT(agent_stream_credit(c, SID(1), STREAM_WINDOW), -EINVAL);
  WAIT_FOR(pe.credits == 400);
  CHECK_EQ_INT(pe.credits, 400);
  agent_data(&pe, SID(1), 800); /* the 400 left and the 400 more */
  WAIT_FOR(r.data_bytes == 1400);
  CHECK_EQ_INT(r.data_bytes, 1400);
  /* Shut both ways: then the stream is gone, and its late frames dropped. */
  CHECK_EQ_INT(agent_stream_shut(c, SID(1)), 0);
  CHECK_EQ_INT(agent_stream_shut(c, SID(1)), -EINVAL);
  CHECK_EQ_INT(agent_stream_send(c, SID(1), buf, 1), -EINVAL);
  WAIT_FOR(pe.shuts == 1);
  agent_u32(&pe, PROTO_STREAM_SHUT, SID(1), 0, 0);
  WAIT_FOR(r.shuts == 1);
  CHECK_EQ_INT(r.shuts, 1);
  WAIT_FOR(agent_stream_credit(c, SID(1), 1) == -ENOENT);
  CHECK_EQ_INT(agent_stream_credit(c, SID(1), 1), -ENOENT);
  agent_u32(&pe, PROTO_STREAM_CREDIT, SID(1), TAG_WINDOW, 1000);
  check_alive(c);
  CHECK_EQ_INT(r.credit_bytes, 5000);
  CHECK_EQ_INT(r.closed, 0);
  peer_stop(&pe, c);
  CHECK_EQ_INT(r.closed, 1);
}

/* Stream frames that break the protocol, after a handler that accepts with
 * a window of 100 (row 1: leaves the stream unaccepted). */
static void stream_row(struct peer *pe, unsigned row) {
  static const char long_name[300] = "x";
  switch (row) {
  case 0: agent_tcp(pe, 1, 1000); WAIT_FOR(pe->accept_window == 100);
          agent_data(pe, SID(1), 200); break;
  case 1: agent_tcp(pe, 1, 1000); agent_data(pe, SID(1), 1); break;
  case 2: agent_tcp(pe, 1, 1000); agent_u32(pe, PROTO_STREAM_SHUT, SID(1), 0, 0);
          agent_data(pe, SID(1), 10); break;
  case 3: agent_tcp(pe, 1, STREAM_WINDOW);
          agent_u32(pe, PROTO_STREAM_CREDIT, SID(1), TAG_WINDOW, 1); break;
  case 4: agent_tcp(pe, 1, 1000); agent_tcp(pe, 1, 1000); break;
  case 5: agent_tcp(pe, 2, 1000); agent_tcp(pe, 1, 1000); break;
  case 6: agent_tcp(pe, 1, 1000); agent_data(pe, SID(5), 10); break;
  case 7: agent_open(pe, 1, 6, 4, 443, 1000, STREAM_KIND_TCP); break;
  case 8: agent_open(pe, 1, 4, 4, 0, 1000, STREAM_KIND_TCP); break;
  case 9: agent_open(pe, 1, 4, 4, 70000, 1000, STREAM_KIND_TCP); break;
  case 10: agent_open(pe, 1, 4, 4, 443, 0, STREAM_KIND_TCP); break;
  case 11: agent_open(pe, 1, 4, 4, 443, STREAM_WINDOW + 1, STREAM_KIND_TCP); break;
  case 12: agent_open(pe, 1, 4, 4, 443, 1000, 2); break;
  case 13: agent_open(pe, 1, 5, 4, 443, 1000, STREAM_KIND_TCP); break;
  case 14: agent_lookup(pe, 1, long_name, 256, 1, LOOKUP_UDP); break;
  case 15: agent_lookup(pe, 1, "a.test", 6, 70000, LOOKUP_UDP); break;
  case 16: agent_lookup(pe, 1, "a.test", 6, 1, 3); break;
  case 17: agent_tcp(pe, 1, 1000); agent_u32(pe, PROTO_STREAM_ACCEPT, SID(1), TAG_WINDOW, 10);
           break;
  case 18: agent_tcp(pe, 1, 1000); agent_u32(pe, PROTO_STREAM_SHUT, SID(1), 0, 0);
           agent_u32(pe, PROTO_STREAM_SHUT, SID(1), 0, 0); break;
  case 19: agent_lookup(pe, 1, "a.test", 6, 1, LOOKUP_UDP); agent_data(pe, SID(1), 1); break;
  case 20: agent_tcp(pe, 1, 1000); agent_u32(pe, PROTO_STREAM_RESET, SID(1), TAG_ERRNO, 0); break;
  case 21: agent_tcp(pe, 1, 1000); WAIT_FOR(pe->accept_window == 100);
           agent_data(pe, SID(1), 50); agent_data(pe, SID(1), 51); break;
  case 22: agent_u32(pe, PROTO_STREAM_OPEN, PROTO_AGENT_ID, 0, 0); break;
  case 23: agent_tcp(pe, 1, 1000); agent_u32(pe, PROTO_STREAM_CREDIT, SID(1), 0, 0); break;
  default: break;
  }
}

static void stream_frames_are_checked(void) {
  static const char *says[] = {
      "sent 200 bytes on stream 0x80000001 with only 100 granted",
      "sent 1 bytes on stream 0x80000001 with only 0 granted",
      "sent 10 bytes on stream 0x80000001 after its STREAM_SHUT",
      "grant more than the 262144 bytes of window",
      "opened id 0x80000001 after 0x80000001: the ids it opens must count up",
      "opened id 0x80000001 after 0x80000002",
      "STREAM_DATA frame for id 0x80000005, which it never opened",
      "ADDR of 4 bytes for FAMILY 6",
      "PORT 0, outside 1..65535",
      "PORT 70000, outside 1..65535",
      "WINDOW 0, outside 1..262144",
      "WINDOW 262145, outside 1..262144",
      "KIND 2, outside 1..1",
      "FAMILY 5, not 4 or 6",
      "NAME of 256 bytes, over 255",
      "QTYPE 70000, outside 0..65535",
      "TRANSPORT 3, outside 1..2",
      "STREAM_ACCEPT frame on stream 0x80000001, which only the host sends",
      "STREAM_SHUT twice on stream 0x80000001",
      "STREAM_DATA frame for lookup 0x80000001",
      "ERRNO 0, outside 1..4095",
      "sent 51 bytes on stream 0x80000001 with only 50 granted",
      "opened id 0x80000000 after 0x80000000",
      "its STREAM_CREDIT frame has no WINDOW",
  };
  for (unsigned i = 0; i < sizeof says / sizeof says[0]; i++) {
    struct peer pe = {0};
    struct agent_conn *c = peer_start(&pe, answer_ping, 0);
    struct rec r = {.accept_window = i == 1 ? 0 : 100};
    rec_set(&r, c);
    stream_row(&pe, i);
    char *err = NULL;
    CHECK_EQ_INT(agent_ping(c, 5000, &err), -EPROTO);
    CHECK(err && strstr(err, "broke the protocol") && strstr(err, says[i]));
    if (!err || !strstr(err, says[i]))
      fprintf(stderr, "  row %u: %s\n", i, err ? err : "(none)");
    CHECK(!agent_conn_alive(c));
    free(err);
    peer_stop(&pe, c);
    CHECK_EQ_INT(r.closed, 1);
  }
}

static void stream_reset_drops_late_frames(void) {
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_ping, 0);
  struct rec r = {.accept_window = 1000};
  rec_set(&r, c);
  /* The host resets a stream it is sending on. */
  agent_tcp(&pe, 1, STREAM_WINDOW);
  WAIT_FOR(pe.accept_window == 1000);
  static uint8_t buf[STREAM_WINDOW];
  CHECK_EQ_INT(agent_stream_send(c, SID(1), buf, sizeof buf), STREAM_WINDOW);
  CHECK_EQ_INT(agent_stream_reset(c, SID(1), ECONNREFUSED, "refused: not in allow_hosts"), 0);
  CHECK_EQ_INT(agent_stream_reset(c, SID(1), ECONNREFUSED, NULL), -ENOENT);
  CHECK_EQ_INT(agent_stream_send(c, SID(1), buf, 1), -ENOENT);
  CHECK_EQ_INT(agent_stream_credit(c, SID(1), 1), -ENOENT);
  WAIT_FOR(pe.resets == 1);
  CHECK_EQ_INT(pe.reset_errno, ECONNREFUSED);
  CHECK_STREQ(pe.reset_msg, "refused: not in allow_hosts");
  CHECK(pe.stream_bytes <= STREAM_WINDOW);
  /* What the agent sent meanwhile, within its old grant or not, is dropped. */
  agent_data(&pe, SID(1), 5000);
  agent_u32(&pe, PROTO_STREAM_CREDIT, SID(1), TAG_WINDOW, STREAM_WINDOW);
  agent_u32(&pe, PROTO_STREAM_SHUT, SID(1), 0, 0);
  agent_u32(&pe, PROTO_STREAM_RESET, SID(1), TAG_ERRNO, EPIPE);
  check_alive(c);
  CHECK_EQ_INT(r.data_bytes, 0);
  CHECK_EQ_INT(r.credit_bytes, 0);
  CHECK_EQ_INT(r.shuts + r.resets, 0);
  /* The agent resets one: the handler hears it, and later frames drop.  It
   * sends only once the host's accept of stream 2 has reached it (the
   * window seen for stream 1 is forgotten first). */
  pe.accept_window = 0;
  agent_tcp(&pe, 2, 1000);
  WAIT_FOR(pe.accept_window == 1000 && r.opens == 2);
  agent_data(&pe, SID(2), 10);
  agent_u32(&pe, PROTO_STREAM_RESET, SID(2), TAG_ERRNO, ECONNRESET);
  WAIT_FOR(r.resets == 1);
  CHECK_EQ_INT(r.last_err, ECONNRESET);
  CHECK_EQ_INT(agent_stream_send(c, SID(2), buf, 1), -ENOENT);
  agent_data(&pe, SID(2), 5000);
  check_alive(c);
  CHECK_EQ_INT(r.data_bytes, 10);
  /* Ids below the last one stay closed, above it open nothing unasked. */
  CHECK_EQ_INT(agent_stream_send(c, SID(7), buf, 1), -ENOENT);
  CHECK_EQ_INT(agent_stream_accept(c, 5, 100), -ENOENT);
  peer_stop(&pe, c);
}

static void no_handler_refuses(void) {
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_ping, 0);
  agent_tcp(&pe, 1, 1000);
  agent_lookup(&pe, 2, "pypi.org", 8, 1, LOOKUP_UDP);
  WAIT_FOR(pe.resets == 1 && pe.lookup_ends == 1);
  CHECK_EQ_INT(pe.reset_errno, ECONNREFUSED);
  CHECK_EQ_INT(pe.lookup_rcode, RCODE_REFUSED);
  agent_data(&pe, SID(1), 10); /* refused: dropped */
  check_alive(c);
  /* A handler that leaves everything open: past the caps the connection
   * refuses by itself, and the handler hears nothing of it. */
  struct rec r = {0};
  rec_set(&r, c);
  uint32_t n = 3;
  for (unsigned i = 0; i <= AGENT_MAX_LOOKUPS; i++)
    agent_lookup(&pe, n++, "a.test", 6, 1, LOOKUP_TCP);
  for (unsigned i = 0; i <= AGENT_MAX_STREAMS; i++)
    agent_tcp(&pe, n++, 1000);
  WAIT_FOR(pe.lookup_ends == 2 && pe.resets == 2);
  check_alive(c);
  CHECK_EQ_INT(pe.lookup_ends, 2);
  CHECK_EQ_INT(pe.resets, 2);
  CHECK_EQ_INT(r.lookups, AGENT_MAX_LOOKUPS);
  CHECK_EQ_INT(r.opens, AGENT_MAX_STREAMS);
  /* Taking the handler away ends what it had open. */
  agent_conn_set_streams(c, NULL);
  WAIT_FOR(pe.resets == 2 + AGENT_MAX_STREAMS && pe.lookup_ends == 2 + AGENT_MAX_LOOKUPS);
  CHECK_EQ_INT(pe.resets, 2 + AGENT_MAX_STREAMS);
  CHECK_EQ_INT(pe.lookup_ends, 2 + AGENT_MAX_LOOKUPS);
  CHECK_EQ_INT(pe.reset_errno, ECONNREFUSED);
  peer_stop(&pe, c);
  CHECK_EQ_INT(r.closed, 0);
}

static void lookup_is_answered(void) {
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_ping, 0);
  struct rec r = {0};
  rec_set(&r, c);
  agent_lookup(&pe, 1, "PyPI.org.", 9, 28, LOOKUP_TCP);
  WAIT_FOR(r.lookups == 1);
  CHECK_STREQ(r.name, "PyPI.org.");
  CHECK_EQ_INT(r.qtype, 28);
  CHECK(r.tcp);
  const int fams[2] = {AF_INET, AF_INET6};
  const uint8_t addrs[2][16] = {{198, 18, 0, 7}, {0x20, 0x01, 0x0d, 0xb8}};
  const int bad_fam[1] = {99};
  CHECK_EQ_INT(agent_lookup_answer(c, SID(1), RCODE_NXDOMAIN, fams, addrs, 1, 30), -EINVAL);
  CHECK_EQ_INT(agent_lookup_answer(c, SID(1), RCODE_NOERROR, bad_fam, addrs, 1, 30), -EINVAL);
  CHECK_EQ_INT(agent_lookup_answer(c, SID(1), (enum proto_rcode)4, NULL, NULL, 0, 30), -EINVAL);
  CHECK_EQ_INT(agent_lookup_answer(c, SID(1), RCODE_NOERROR, fams, addrs, 9, 30), -EINVAL);
  CHECK_EQ_INT(agent_stream_accept(c, SID(1), 100), -ENOENT); /* a lookup, not a stream */
  CHECK_EQ_INT(agent_lookup_answer(c, SID(1), RCODE_NOERROR, fams, addrs, 2, 30), 0);
  CHECK_EQ_INT(agent_lookup_answer(c, SID(1), RCODE_NOERROR, fams, addrs, 2, 30), -ENOENT);
  WAIT_FOR(pe.lookup_ends == 1);
  CHECK_EQ_INT(pe.lookup_rcode, RCODE_NOERROR);
  CHECK_EQ_INT(pe.lookup_addrs, 2);
  CHECK_EQ_INT(pe.lookup_ttl, 30);
  check_alive(c);
  peer_stop(&pe, c);
}

/* Opens, credits, lookups and ends, as fast as the peer can, until
 * stopped (no data: it would not wait for the ACCEPT). */
struct flood {
  struct peer *pe;
  atomic_bool stop;
};

static void *flood_main(void *arg) {
  struct flood *f = arg;
  for (uint32_t n = 1; !atomic_load(&f->stop) && n < 0x7ffffff0u; n += 2) {
    agent_tcp(f->pe, n, 1000);
    agent_lookup(f->pe, n + 1, "a.test", 6, 1, LOOKUP_UDP);
    agent_u32(f->pe, PROTO_STREAM_CREDIT, SID(n), TAG_WINDOW, 10);
    agent_u32(f->pe, PROTO_STREAM_SHUT, SID(n), 0, 0);
    if (n % 3 == 0)
      agent_u32(f->pe, PROTO_STREAM_RESET, SID(n), TAG_ERRNO, ECONNRESET);
    if (n % 32 == 1)
      usleep(100);
  }
  return NULL;
}

/* When agent_conn_set_streams returns, the handler it replaced is never
 * called again, whatever arrives meanwhile. */
static void set_streams_stops_the_old_handler(void) {
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_ping, 0);
  struct flood f = {.pe = &pe};
  pthread_t t;
  pthread_create(&t, NULL, flood_main, &f);
  struct rec r = {.accept_window = 100};
  unsigned calls = 0;
  for (int i = 0; i < 200; i++) {
    atomic_store(&r.forbidden, false);
    rec_set(&r, c);
    usleep((unsigned)(i % 7) * 300);
    agent_conn_set_streams(c, NULL);
    atomic_store(&r.forbidden, true);
    calls = r.opens;
    usleep(200);
  }
  atomic_store(&f.stop, true);
  pthread_join(t, NULL);
  check_alive(c);
  CHECK_EQ_INT(r.violations, 0);
  CHECK(calls > 0); /* the handler was called at all */
  /* A handler set at the end hears the end once. */
  struct rec last = {0};
  rec_set(&last, c);
  peer_stop(&pe, c);
  CHECK_EQ_INT(last.closed, 1);
  CHECK_EQ_INT(r.closed, 0);
}

/* Frames in the peer's receive queue, peeked: whether they are whole, how
 * many, and where the first PING is (-1: none). */
static bool peek_frames(int fd, size_t *ret_n, long *ret_ping) {
  static uint8_t buf[1u << 20];
  ssize_t got = recv(fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
  size_t o = 0, n = 0;
  *ret_ping = -1;
  while (got > 0 && o + PROTO_HEADER_SIZE <= (size_t)got) {
    if (buf[o + 4] == PROTO_PING && *ret_ping < 0)
      *ret_ping = (long)n;
    o += PROTO_HEADER_SIZE + proto_le32(buf + o);
    n++;
  }
  *ret_n = n;
  return got > 0 && o == (size_t)got;
}

/* An agent that stops reading its channel while the host sends on its
 * streams: the socket holds whole frames only, so the PING queued beside
 * them is behind no half frame; agent_stream_send says -EAGAIN once the
 * stream queue is full, and writable() once it drained. */
static void stalled_stream_beside_a_ping(void) {
  struct peer pe = {.stall = true};
  struct agent_conn *c = peer_start(&pe, answer_ping, 0);
  struct rec r = {.accept_window = 1000};
  rec_set(&r, c);
  for (uint32_t n = 1; n <= 4; n++)
    agent_tcp(&pe, n, STREAM_WINDOW);
  WAIT_FOR(r.opens == 4);
  static uint8_t buf[PROTO_CHUNK];
  uint64_t taken = 0;
  bool full = false;
  for (int round = 0; round < 8 && !full; round++)
    for (uint32_t n = 1; n <= 4; n++) {
      ssize_t w = agent_stream_send(c, SID(n), buf, sizeof buf);
      if (w == -EAGAIN) {
        full = true;
        break;
      }
      CHECK(w > 0);
      taken += w > 0 ? (uint64_t)w : 0;
    }
  CHECK(full);
  /* The queue, not the windows, said no: it holds its bytes less the
   * frames' headers and what is too little to make a frame of. */
  CHECK(taken >= AGENT_STREAM_QUEUE_MAX - 8192 && taken < 4ull * STREAM_WINDOW);
  if (taken < AGENT_STREAM_QUEUE_MAX - 8192 || taken >= 4ull * STREAM_WINDOW)
    fprintf(stderr, "  %llu bytes taken\n", (unsigned long long)taken);
  struct ping_call pc = {.c = c};
  pthread_t tp;
  pthread_create(&tp, NULL, ping_main, &pc);
  usleep(300000);
  size_t in_socket = 0;
  long ping_at = -1;
  CHECK(peek_frames(pe.fd, &in_socket, &ping_at));
  CHECK(in_socket > 0);
  CHECK(agent_conn_alive(c));
  CHECK_EQ_INT(r.writables, 0);
  atomic_store(&pe.resume, true);
  pthread_join(tp, NULL);
  CHECK_EQ_INT(pc.r, 0);
  WAIT_FOR(r.writables == 1);
  CHECK_EQ_INT(r.writables, 1);
  /* The PING went in among the whole frames the socket held, or right
   * after them: not behind the queue. */
  size_t ping_seen = 0;
  for (size_t i = 0; i < pe.n_seen; i++)
    if (pe.seen[i] == PROTO_PING) {
      ping_seen = i;
      break;
    }
  CHECK(ping_seen <= in_socket);
  CHECK(ping_at < 0 || (size_t)ping_at == ping_seen);
  CHECK(agent_conn_alive(c));
  WAIT_FOR(pe.stream_bytes == taken);
  CHECK_EQ_INT(pe.stream_bytes, taken);
  peer_stop(&pe, c);
}

/* PING answered, but not the one with id pe->arg. */
static void answer_ping_but(struct peer *pe, const struct proto_header *h, const uint8_t *payload) {
  if (h->id != pe->arg)
    answer_ping(pe, h, payload);
}

struct slow_ping {
  struct agent_conn *c;
  int r;
};

static void *slow_ping_main(void *arg) {
  struct slow_ping *p = arg;
  char *err = NULL;
  p->r = agent_ping(p->c, 1500, &err);
  free(err);
  return NULL;
}

/* Request ids stay below 2^31 (the agent's have bit 31), wrap to 1, and
 * skip one still waiting. */
static void request_ids_wrap_below_the_agents(void) {
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, answer_ping_but, 1);
  pthread_mutex_lock(&c->lock);
  c->next_id = 0;
  pthread_mutex_unlock(&c->lock);
  struct slow_ping sp = {.c = c};
  pthread_t t;
  pthread_create(&t, NULL, slow_ping_main, &sp);
  WAIT_FOR(pe.n_seen == 1);
  pthread_mutex_lock(&c->lock);
  c->next_id = PROTO_AGENT_ID - 2;
  pthread_mutex_unlock(&c->lock);
  check_alive(c);
  check_alive(c);
  pthread_join(t, NULL);
  CHECK_EQ_INT(sp.r, -ETIMEDOUT);
  CHECK_EQ_INT(pe.n_seen, 3);
  CHECK_EQ_INT(pe.seen_id[0], 1);
  CHECK_EQ_INT(pe.seen_id[1], PROTO_AGENT_ID - 1);
  CHECK_EQ_INT(pe.seen_id[2], 2);
  peer_stop(&pe, c);
}

static void egress_error_is_checked(void) {
  struct peer pe = {0};
  struct agent_conn *c = peer_start(&pe, NULL, 0);
  CHECK(agent_conn_egress_error(c) == NULL);
  peer_stop(&pe, c);
  struct peer pe2 = {.egress_error = "no nf_tables in the kernel", .egress_error_len = 26};
  c = peer_start(&pe2, NULL, 0);
  CHECK_STREQ(agent_conn_egress_error(c), "no nf_tables in the kernel");
  peer_stop(&pe2, c);
  static const char long_msg[257] = "x";
  static const struct {
    const char *msg;
    size_t len;
    const char *says;
  } bad[] = {
      {"bad\x1b[31m", 8, "EGRESS_ERROR with byte 0x1b at 3"},
      {"nul\0hidden", 10, "EGRESS_ERROR with byte 0x00 at 3"},
      {long_msg, 257, "EGRESS_ERROR of 257 bytes, not 1..256"},
      {"", 0, "EGRESS_ERROR of 0 bytes"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct peer pe3 = {.egress_error = bad[i].msg, .egress_error_len = bad[i].len};
    char *err = NULL;
    c = NULL;
    CHECK_EQ_INT(peer_start_r(&pe3, NULL, 0, &c, &err), -EPROTO);
    CHECK(c == NULL);
    CHECK(err && strstr(err, bad[i].says));
    if (err && !strstr(err, bad[i].says))
      fprintf(stderr, "  %s\n", err);
    free(err);
    pthread_join(pe3.thread, NULL);
    close(pe3.fd);
  }
}

/* A clone's clock and entropy (and identity) ride in its HELLO: set
 * before the agent answers, at no round trip of their own. */
static void hello_carries_the_setup(void) {
  uint8_t entropy[32];
  memset(entropy, 0xa5, sizeof entropy);
  struct agent_setup_req req = {
      .entropy = entropy, .entropy_len = sizeof entropy, .clock = true, .hostname = "ign-x"};
  struct peer pe = {.setup = &req};
  uint64_t t0 = now_ns(CLOCK_REALTIME);
  struct agent_conn *c = peer_start(&pe, NULL, 0);
  uint64_t t1 = now_ns(CLOCK_REALTIME), t = 0;
  const uint8_t *v;
  uint32_t n;
  CHECK(proto_find(pe.hello, pe.hello_len, TAG_ENTROPY, &v, &n) == 1 && n == sizeof entropy &&
        memcmp(v, entropy, n) == 0);
  CHECK(proto_find(pe.hello, pe.hello_len, TAG_TIME_NS, &v, &n) == 1 &&
        proto_val_u64(v, n, &t) == 0);
  CHECK(t >= t0 && t <= t1);
  CHECK(proto_find(pe.hello, pe.hello_len, TAG_HOSTNAME, &v, &n) == 1 && n == 5 &&
        memcmp(v, "ign-x", 5) == 0);
  CHECK_EQ_INT(proto_find(pe.hello, pe.hello_len, TAG_MACHINE_ID, &v, &n), 0);
  peer_stop(&pe, c);

  /* Without one: VERSION alone. */
  struct peer pe2 = {0};
  c = peer_start(&pe2, NULL, 0);
  CHECK_EQ_INT(proto_find(pe2.hello, pe2.hello_len, TAG_VERSION, &v, &n), 1);
  CHECK_EQ_INT(proto_find(pe2.hello, pe2.hello_len, TAG_ENTROPY, &v, &n), 0);
  CHECK_EQ_INT(proto_find(pe2.hello, pe2.hello_len, TAG_TIME_NS, &v, &n), 0);
  peer_stop(&pe2, c);
}

TEST_MAIN(TEST(hello_carries_the_setup), TEST(exit_fields_are_range_checked), TEST(read_end_fields_are_range_checked),
          TEST(guest_errno_is_not_a_host_error),
          TEST(agent_farewell_is_the_agents), TEST(answers_must_fit_the_request),
          TEST(stalled_write_hits_its_deadline), TEST(trickled_write_hits_its_deadline),
          TEST(slow_stdin_hits_the_call_deadline), TEST(late_exit_waits_while_the_agent_answers),
          TEST(exited_command_drops_its_stdin),
          TEST(cancel_returns_while_the_peer_does_not_read),
          TEST(control_frames_go_before_queued_data),
          TEST(pack_window_is_what_was_sent), TEST(unpack_eof_after_a_stop_is_no_end),
          TEST(unpack_stop_after_the_end_waits_for_the_agent), TEST(stream_flows_both_ways),
          TEST(stream_frames_are_checked), TEST(stream_reset_drops_late_frames),
          TEST(no_handler_refuses), TEST(lookup_is_answered),
          TEST(set_streams_stops_the_old_handler), TEST(stalled_stream_beside_a_ping),
          TEST(request_ids_wrap_below_the_agents), TEST(egress_error_is_checked),
          TEST(egress_stats_are_checked))
