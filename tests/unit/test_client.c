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

#include "proto/client.h"
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
  /* What the peer saw after HELLO, in order (types), and how many. */
  uint8_t seen[4096];
  _Atomic size_t n_seen; /* published after its entry is written */
  uint64_t data_bytes;
  pthread_t thread;
};

static void send_frame(int fd, struct proto_buf *b) {
  if (proto_frame_finish(b) == 0)
    proto_write_all(fd, b->data, b->len);
  proto_buf_free(b);
}

static void *peer_main(void *arg) {
  struct peer *pe = arg;
  uint8_t *payload = malloc(PROTO_MAX_PAYLOAD);
  struct proto_header h;
  while (proto_read_frame(pe->fd, &h, payload) == 0) {
    if (h.type == PROTO_HELLO) {
      struct proto_buf b = {0};
      proto_frame_begin(&b, PROTO_HELLO_OK, h.id);
      proto_put_u32(&b, TAG_VERSION, PROTO_VERSION);
      proto_put_str(&b, TAG_INFO, "fake agent");
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
    if (pe->n_seen < sizeof pe->seen)
      pe->seen[pe->n_seen++] = h.type;
    if (h.type == PROTO_DATA)
      pe->data_bytes += h.len;
    if (pe->script)
      pe->script(pe, &h, payload);
  }
  free(payload);
  return NULL;
}

static struct agent_conn *peer_start(struct peer *pe, script_fn script, uint64_t arg) {
  /* A peer may still answer after the host closed the connection: EPIPE,
   * not a signal that ends the whole test. */
  signal(SIGPIPE, SIG_IGN);
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
  struct agent_conn *c = NULL;
  char *err = NULL;
  int r = agent_conn_open(sv[0], 5000, &c, &err);
  CHECK_EQ_INT(r, 0);
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
  CHECK(w.err && strstr(w.err, "stopped reading its channel"));
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

TEST_MAIN(TEST(exit_fields_are_range_checked), TEST(read_end_fields_are_range_checked),
          TEST(guest_errno_is_not_a_host_error),
          TEST(agent_farewell_is_the_agents), TEST(answers_must_fit_the_request),
          TEST(stalled_write_hits_its_deadline), TEST(trickled_write_hits_its_deadline),
          TEST(slow_stdin_hits_the_call_deadline), TEST(exited_command_drops_its_stdin),
          TEST(cancel_returns_while_the_peer_does_not_read),
          TEST(control_frames_go_before_queued_data),
          TEST(pack_window_is_what_was_sent))
