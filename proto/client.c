/* client.c: host side of the agent protocol (see client.h and proto.h).
 *
 * Reading: one reader thread reads frames, checks each against the request
 * it answers (type, every numeric field in range) and hands it to the
 * pending call with the same id; a frame that breaks the protocol ends the
 * connection.  Frames for ids nobody waits for any more (a cancelled call)
 * are dropped.
 *
 * Writing: calls never write to the socket themselves.  They queue whole
 * frames, and one writer thread sends them with non-blocking writes and
 * poll(), so no call blocks on a guest that stopped reading:
 *   - control frames (a request's first frame, KILL) go before data frames
 *     (stdin, file content) and stream frames (client_stream.c), so a
 *     cancellation is not stuck behind an upload or a download; the frames
 *     of one request keep their order (its first frame is always queued
 *     before its data); data and stream frames go in turn;
 *   - data frames wait for room (AGENT_QUEUE_MAX) in their call, which stays
 *     cancellable while it waits; stream frames have a queue and a budget
 *     of their own (AGENT_STREAM_QUEUE_MAX) and never wait;
 *   - the writer starts a frame only when the socket's buffer has room for
 *     all of it, so a KILL or a PING never waits behind half a data frame;
 *     an agent that takes nothing for the write deadline while a frame
 *     waits ends the connection, and so does one that does not take a
 *     frame larger than the empty buffer (sent in parts) whole within it;
 *   - a cancelled call takes its queued frames back and queues what tells the
 *     agent to drop the request (KILL, or the end frame of a short upload),
 *     then returns at once; the writer finishes or abandons the rest.
 * Calls wait on a shared condition variable with a short tick so they can
 * notice cancellation, send progress and enforce a host-side deadline even if
 * the agent goes silent.
 *
 * This file has the connection, the writer, the reader's dispatch and the
 * simple calls; client_tree.c has the trees (UNPACK, PACK), client_stream.c
 * the streams and lookups, and client_int.h what the parts share. */
#include "proto/client.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/config.h"
#include "common/util.h"
#include "proto/client_int.h"
#include "proto/proto.h"

_Static_assert(CONFIG_EGRESS_STREAMS_MAX == AGENT_MAX_STREAMS,
               "IGN_MCP_EGRESS_STREAMS may reach what one connection carries");

/* How long past a command's own timeout the host waits before declaring the
 * agent unresponsive. */
#define EXEC_GRACE_MS 20000u
/* Longest HELLO_OK info and ERROR message taken from an agent; ours are far
 * shorter (an error quotes at most a few paths). */
#define MAX_INFO 256u
#define MAX_MESSAGE (16u * 1024u)
#define MAX_EGRESS_ERROR 256u
/* Slack on a command's duration as the agent reports it, over what the host
 * measured between sending EXEC and reading EXIT (the clocks differ a little). */
#define DURATION_SLACK_MS 10000u

/* The writer: slack over a frame's length for what the socket is charged
 * beyond its bytes, and how often it looks again for room when poll()
 * cannot say. */
#define OUTQ_SLACK 4096u
#define ROOM_POLL_MS 10u

_Static_assert(AGENT_QUEUE_MAX >= PROTO_HEADER_SIZE + PROTO_CHUNK, "a chunk fits the queue");

void agent_exec_res_free(struct agent_exec_res *r) {
  free(r->out);
  free(r->err);
  r->out = r->err = NULL;
}

void client_set_err(char **ret_err, char *msg) {
  if (ret_err) {
    free(*ret_err);
    *ret_err = msg;
  } else {
    free(msg);
  }
}

/* Marks the connection dead with REASON (taken) unless it already is, and
 * wakes everyone.  With the lock held.  The caller shuts the socket down. */
void client_mark_dead_locked(struct agent_conn *c, char *reason, bool fault) {
  if (!c->dead_reason) {
    c->dead_reason = reason;
    c->fault = fault;
  } else {
    free(reason);
  }
  c->dead = true;
  pthread_cond_broadcast(&c->cond);
  pthread_cond_broadcast(&c->wcond);
  client_wake_writer_locked(c);
}

/* ---- the writer ---------------------------------------------------------- */

void client_frame_free(struct out_frame *f) {
  if (f) {
    free(f->bytes);
    free(f);
  }
}

void client_queue_push(struct frame_queue *q, struct out_frame *f) {
  if (!q->head)
    q->tail = &q->head;
  f->next = NULL;
  *q->tail = f;
  q->tail = &f->next;
}

struct out_frame *client_queue_pop(struct frame_queue *q) {
  struct out_frame *f = q->head;
  if (f) {
    q->head = f->next;
    if (!q->head)
      q->tail = &q->head;
  }
  return f;
}

void client_queue_clear(struct frame_queue *q) {
  struct out_frame *f;
  while ((f = client_queue_pop(q)))
    client_frame_free(f);
}

/* Takes the frames of ID out of Q; returns the types taken as a bit mask
 * (1 << type). */
uint64_t client_queue_purge(struct frame_queue *q, uint32_t id, size_t *ret_bytes) {
  uint64_t types = 0;
  size_t bytes = 0;
  struct out_frame **pp = &q->head, *last = NULL;
  while (*pp) {
    struct out_frame *f = *pp;
    if (f->id == id) {
      *pp = f->next;
      types |= 1ull << f->type;
      bytes += f->len;
      client_frame_free(f);
    } else {
      last = f;
      pp = &f->next;
    }
  }
  q->tail = last ? &last->next : &q->head;
  *ret_bytes = bytes;
  return types;
}

/* Sends F whole: non-blocking writes, and poll() while the socket is full.
 * -ETIMEDOUT when the agent has not taken it whole within DEADLINE_MS. */
static int write_frame(int fd, const struct out_frame *f, uint32_t deadline_ms) {
  size_t off = 0;
  const uint64_t start = mono_ms();
  while (off < f->len) {
    ssize_t w = send(fd, f->bytes + off, f->len - off, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w > 0) {
      off += (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      return -errno;
    if (w == 0)
      return -EPIPE;
    uint64_t waited = mono_ms() - start;
    if (waited >= deadline_ms)
      return -ETIMEDOUT;
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    uint64_t left = deadline_ms - waited;
    if (poll(&p, 1, (int)(left < TICK_MS ? left : TICK_MS)) < 0 && errno != EINTR)
      return -errno;
  }
  return 0;
}

/* The queue the writer takes its next frame from: ctl_q first, then data_q
 * and stream_q in turn (a download never starves a call's stdin or upload,
 * nor the other way round), or NULL when all are empty. */
static struct frame_queue *next_queue(struct agent_conn *c) {
  if (c->ctl_q.head)
    return &c->ctl_q;
  if (c->data_q.head && c->stream_q.head)
    return c->stream_turn ? &c->stream_q : &c->data_q;
  return c->data_q.head ? &c->data_q : c->stream_q.head ? &c->stream_q : NULL;
}

/* What the socket's buffer is charged now (SIOCOUTQ), or -1 when the fd
 * does not say. */
static int socket_outq(const struct agent_conn *c) {
  int outq = 0;
  if (c->sndbuf <= 0 || ioctl(c->fd, SIOCOUTQ, &outq) < 0)
    return -1;
  return outq;
}

/* Whether a frame of LEN bytes goes into the socket whole at once.  A unix
 * socket's buffer is charged the truesize of what it holds (67072 for one
 * 65548-byte frame), hence the slack; a frame larger than an empty buffer
 * takes goes when the buffer is empty, and then in parts. */
static bool frame_fits(const struct agent_conn *c, int outq, size_t len) {
  return outq <= 0 || (size_t)outq + len + OUTQ_SLACK <= (size_t)c->sndbuf;
}

/* Waits (without the lock) until the agent may have taken some of what the
 * socket holds, or a frame is queued, or a short while passed.  A unix
 * socket polls writable only once its charge is down to a quarter of
 * SO_SNDBUF: below that, poll() cannot say when a frame fits, so the
 * writer looks again after ROOM_POLL_MS. */
static void wait_for_room(struct agent_conn *c, int outq) {
  bool pollout = (size_t)outq * 4 > (size_t)c->sndbuf;
  c->writer_polling = true;
  pthread_mutex_unlock(&c->lock);
  struct pollfd p[2] = {{.fd = c->wake_fd, .events = POLLIN},
                        {.fd = c->fd, .events = pollout ? POLLOUT : 0}};
  if (poll(p, 2, pollout ? (int)TICK_MS : (int)ROOM_POLL_MS) > 0 && (p[0].revents & POLLIN)) {
    uint64_t n;
    if (read(c->wake_fd, &n, sizeof n) < 0) {
      /* EAGAIN: another read took it; nothing else can fail here. */
    }
  }
  pthread_mutex_lock(&c->lock);
  c->writer_polling = false;
}

void client_wake_writer_locked(struct agent_conn *c) {
  pthread_cond_signal(&c->wcond);
  if (c->writer_polling) {
    uint64_t one = 1;
    if (write(c->wake_fd, &one, sizeof one) < 0) {
      /* EAGAIN: the counter is full, so the writer wakes anyway. */
    }
  }
}

/* Takes the head of Q for the wire, with its accounting. */
static struct out_frame *take_frame(struct agent_conn *c, struct frame_queue *q) {
  struct out_frame *f = client_queue_pop(q);
  if (q == &c->data_q) {
    c->data_queued -= f->len;
    pthread_cond_broadcast(&c->cond); /* room for a waiting call */
  } else if (q == &c->stream_q) {
    c->stream_queued -= f->len;
    if (c->want_writable && c->stream_queued <= AGENT_STREAM_QUEUE_MAX / 2)
      c->writable_due = true;
  }
  if (q != &c->ctl_q)
    c->stream_turn = q == &c->data_q;
  if (f->id & PROTO_AGENT_ID)
    client_stream_taken_locked(c, f);
  return f;
}

static void writer_fail_locked(struct agent_conn *c, int r, uint32_t deadline) {
  if (r == -ETIMEDOUT)
    client_mark_dead_locked(c,
                            xasprintf("the sandbox's agent stopped reading its channel: it did "
                                      "not take a whole frame within %u ms, so the host gave up "
                                      "on it",
                                      deadline),
                            true);
  else if (r == -EPIPE || r == -ECONNRESET)
    client_mark_dead_locked(c, strdup("the sandbox's agent closed the connection"), false);
  else
    client_mark_dead_locked(c, xasprintf("writing to the sandbox's agent failed: %s",
                                         strerror(-r)), false);
  /* The reader wakes up too, and nothing more goes out. */
  shutdown(c->fd, SHUT_RDWR);
}

/* The writer.  Before it starts a frame it looks at what the socket holds:
 * a frame that does not fit whole stays queued, so that a frame queued
 * later (KILL, PING) never waits behind half a data frame.  The deadline
 * is then "the agent took nothing for write_deadline_ms while a frame
 * waited" (what the socket holds went down, or the frame could go), and,
 * for a frame larger than the empty buffer's room (it goes in parts),
 * "the agent did not take it whole within write_deadline_ms". */
static void *writer_main(void *arg) {
  struct agent_conn *c = arg;
  uint64_t stalled_since = 0; /* a frame waits for room since (mono_ms); 0: none */
  int last_outq = -1;
  pthread_mutex_lock(&c->lock);
  for (;;) {
    struct frame_queue *q;
    while (!c->dead && !c->writable_due && !(q = next_queue(c))) {
      stalled_since = 0;
      pthread_cond_wait(&c->wcond, &c->lock);
    }
    if (c->dead)
      break;
    if (c->writable_due) {
      c->writable_due = c->want_writable = false;
      pthread_mutex_unlock(&c->lock);
      client_stream_writable(c);
      pthread_mutex_lock(&c->lock);
      continue;
    }
    int outq = socket_outq(c);
    if (outq < last_outq)
      stalled_since = 0; /* the agent took something */
    last_outq = outq;
    if (!frame_fits(c, outq, q->head->len)) {
      uint64_t now = mono_ms();
      if (!stalled_since)
        stalled_since = now;
      if (now - stalled_since >= c->write_deadline_ms) {
        client_mark_dead_locked(c,
                                xasprintf("the sandbox's agent stopped reading its channel: it "
                                          "did not take a whole frame within %u ms (it took "
                                          "nothing while frames waited), so the host gave up "
                                          "on it",
                                          c->write_deadline_ms),
                                true);
        shutdown(c->fd, SHUT_RDWR);
        break;
      }
      wait_for_room(c, outq);
      continue;
    }
    stalled_since = 0;
    struct out_frame *f = take_frame(c, q);
    uint32_t deadline = c->write_deadline_ms;
    pthread_mutex_unlock(&c->lock);
    int r = write_frame(c->fd, f, deadline);
    client_frame_free(f);
    int after = socket_outq(c);
    pthread_mutex_lock(&c->lock);
    last_outq = after;
    if (r < 0) {
      writer_fail_locked(c, r, deadline);
      break;
    }
  }
  pthread_mutex_unlock(&c->lock);
  return NULL;
}

/* A frame ready to queue: B's bytes are taken. */
int client_make_frame(struct proto_buf *b, struct out_frame **ret) {
  int r = proto_frame_finish(b);
  if (r < 0)
    return r;
  struct out_frame *f = calloc(1, sizeof *f);
  if (!f)
    return -ENOMEM;
  struct proto_header h;
  proto_header_decode(b->data, &h);
  f->id = h.id;
  f->type = h.type;
  f->len = b->len;
  f->bytes = steal_ptr(b->data);
  proto_buf_free(b);
  *ret = f;
  return 0;
}

/* Milliseconds left until DEADLINE (a mono_ms() time; 0: none), at least 1;
 * 0 when there is no deadline. */
static uint32_t left_ms(uint64_t deadline) {
  if (!deadline)
    return 0;
  uint64_t now = mono_ms();
  uint64_t left = deadline > now ? deadline - now : 1;
  return left > UINT32_MAX ? UINT32_MAX : (uint32_t)left;
}

/* Queues B (its bytes are taken).  A data frame waits for room first, while
 * the call is not cancelled, its DEADLINE (a mono_ms() time; 0: none) has not
 * passed and the connection lives: an agent that takes its data slowly
 * cannot hold the call longer than one that does not answer.  -EALREADY: the
 * agent already answered the call P (NULL: none), which needs no more data. */
int client_enqueue(struct agent_conn *c, struct proto_buf *b, bool control,
                   const struct agent_ctl *ctl, uint64_t deadline, const struct pending *p) {
  struct out_frame *f;
  int r = client_make_frame(b, &f);
  if (r < 0)
    return r;
  pthread_mutex_lock(&c->lock);
  for (;;) {
    if (c->dead) {
      r = client_dead_code(c);
      break;
    }
    if (!control && p && p->done) {
      r = -EALREADY;
      break;
    }
    if (control || c->data_queued == 0 || c->data_queued + f->len <= AGENT_QUEUE_MAX)
      break;
    if (client_cancelled(ctl)) {
      r = -ECANCELED;
      break;
    }
    if (deadline && mono_ms() >= deadline) {
      r = -ETIMEDOUT;
      break;
    }
    struct timespec ts = timespec_in(CLOCK_MONOTONIC, TICK_MS);
    pthread_cond_timedwait(&c->cond, &c->lock, &ts);
  }
  if (r == 0) {
    client_queue_push(control ? &c->ctl_q : &c->data_q, f);
    if (!control)
      c->data_queued += f->len;
    client_wake_writer_locked(c);
  }
  pthread_mutex_unlock(&c->lock);
  if (r < 0)
    client_frame_free(f);
  return r;
}

/* A data frame of the call P. */
int client_enqueue_data(struct agent_conn *c, enum proto_type t, const struct pending *p,
                        const void *raw, size_t n, const struct agent_ctl *ctl,
                        uint64_t deadline) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, t, p->id);
  proto_put_raw(&b, raw, n);
  int r = client_enqueue(c, &b, false, ctl, deadline, p);
  proto_buf_free(&b);
  return r;
}

/* A call that gives up (cancelled, timed out, or failed while sending): its
 * frames still queued are taken back; if the agent already has the request,
 * KILL_IT queues a KILL (a command), and END_TYPE (STDIN_END, DATA_END; 0:
 * none) is queued unless it already went, so that the agent stops waiting for
 * the rest of a stream it will not get.  The agent answers into the void. */
void client_abandon_request(struct agent_conn *c, uint32_t id, bool kill_it, uint8_t end_type,
                            bool end_queued) {
  struct out_frame *kill_f = NULL, *end_f = NULL;
  struct proto_buf b = {0};
  if (kill_it) {
    proto_frame_begin(&b, PROTO_KILL, id);
    if (client_make_frame(&b, &kill_f) < 0)
      kill_f = NULL;
  }
  if (end_type) {
    proto_frame_begin(&b, (enum proto_type)end_type, id);
    if (client_make_frame(&b, &end_f) < 0)
      end_f = NULL;
  }
  proto_buf_free(&b);
  pthread_mutex_lock(&c->lock);
  size_t ctl_bytes, data_bytes;
  uint64_t taken = client_queue_purge(&c->ctl_q, id, &ctl_bytes);
  taken |= client_queue_purge(&c->data_q, id, &data_bytes);
  c->data_queued -= data_bytes;
  /* A request whose first frame never left is unknown to the agent. */
  bool agent_has_it = !(taken & (1ull << PROTO_EXEC | 1ull << PROTO_WRITE | 1ull << PROTO_READ |
                                 1ull << PROTO_PING | 1ull << PROTO_SETUP | 1ull << PROTO_HELLO |
                                 1ull << PROTO_UNPACK | 1ull << PROTO_PACK |
                                 1ull << PROTO_EGRESS_STATS));
  bool end_went = end_queued && !(end_type && (taken & (1ull << end_type)));
  if (!c->dead && agent_has_it) {
    if (kill_f) {
      client_queue_push(&c->ctl_q, steal_ptr(kill_f));
    }
    if (end_f && !end_went) {
      /* Past the room check: an empty frame, at most one per call. */
      client_queue_push(&c->data_q, end_f);
      c->data_queued += end_f->len;
      end_f = NULL;
    }
    client_wake_writer_locked(c);
  }
  pthread_cond_broadcast(&c->cond);
  pthread_mutex_unlock(&c->lock);
  client_frame_free(kill_f);
  client_frame_free(end_f);
}

/* ---- the reader ---------------------------------------------------------- */

static struct pending *find_pending(struct agent_conn *c, uint32_t id) {
  for (struct pending *p = c->pending; p; p = p->next)
    if (p->id == id)
      return p;
  return NULL;
}

static void keep_output(struct pending *p, bool is_err, const uint8_t *d, size_t n) {
  struct agent_exec_res *r = p->res;
  char **buf = is_err ? &r->err : &r->out;
  size_t *len = is_err ? &r->err_len : &r->out_len;
  uint64_t *total = is_err ? &r->err_total : &r->out_total;
  *total += n;
  size_t room = p->out_cap > *len ? p->out_cap - *len : 0;
  size_t keep = n < room ? n : room;
  if (keep) {
    char *nb = realloc(*buf, *len + keep);
    if (nb) {
      memcpy(nb + *len, d, keep);
      *buf = nb;
      *len += keep;
    }
  }
  /* The tail feeds progress messages: the newest bytes of either stream. */
  if (n >= TAIL_SIZE) {
    memcpy(p->tail, d + n - TAIL_SIZE, TAIL_SIZE);
    p->tail_len = TAIL_SIZE;
  } else {
    size_t drop = p->tail_len + n > TAIL_SIZE ? p->tail_len + n - TAIL_SIZE : 0;
    memmove(p->tail, p->tail + drop, p->tail_len - drop);
    p->tail_len -= drop;
    memcpy(p->tail + p->tail_len, d, n);
    p->tail_len += n;
  }
}

/* One field of an agent's frame, checked.  Each returns NULL when fine, or
 * the protocol error (malloc'd).  REQUIRED: absence is an error too. */
char *client_field_u32(const uint8_t *payload, size_t len, uint8_t type, uint16_t tag,
                       const char *name, bool required, uint32_t lo, uint32_t hi, uint32_t *ret) {
  const uint8_t *v;
  uint32_t n;
  int r = proto_find(payload, len, tag, &v, &n);
  if (r < 0)
    return xasprintf("its %s frame has a TLV record that runs past the payload", proto_type_name(type));
  if (r == 0)
    return required ? xasprintf("its %s frame has no %s", proto_type_name(type), name) : NULL;
  uint32_t u;
  if (proto_val_u32(v, n, &u) < 0)
    return xasprintf("its %s frame has a %s of %u bytes, not 4", proto_type_name(type), name, n);
  if (u < lo || u > hi)
    return xasprintf("its %s frame has %s %u, outside %u..%u", proto_type_name(type), name, u, lo, hi);
  *ret = u;
  return NULL;
}

char *client_field_u64(const uint8_t *payload, size_t len, uint8_t type, uint16_t tag,
                       const char *name, bool required, uint64_t hi, uint64_t *ret) {
  const uint8_t *v;
  uint32_t n;
  int r = proto_find(payload, len, tag, &v, &n);
  if (r < 0)
    return xasprintf("its %s frame has a TLV record that runs past the payload", proto_type_name(type));
  if (r == 0)
    return required ? xasprintf("its %s frame has no %s", proto_type_name(type), name) : NULL;
  uint64_t u;
  if (proto_val_u64(v, n, &u) < 0)
    return xasprintf("its %s frame has a %s of %u bytes, not 8", proto_type_name(type), name, n);
  if (u > hi)
    return xasprintf("its %s frame has %s %llu, over %llu", proto_type_name(type), name,
                     (unsigned long long)u, (unsigned long long)hi);
  *ret = u;
  return NULL;
}

char *client_field_str(const uint8_t *payload, size_t len, uint8_t type, uint16_t tag,
                       const char *name, size_t max, char **ret) {
  const uint8_t *v;
  uint32_t n;
  int r = proto_find(payload, len, tag, &v, &n);
  if (r < 0)
    return xasprintf("its %s frame has a TLV record that runs past the payload", proto_type_name(type));
  if (r == 0)
    return NULL;
  if (n > max)
    return xasprintf("its %s frame has a %s of %u bytes, over %zu", proto_type_name(type), name, n, max);
  *ret = strndup((const char *)v, n);
  return NULL;
}

/* The whole TLV payload of a frame: every record within it, and none of
 * the protocol's tags (all below 64) twice but those in REPEATABLE (a mask
 * of 1 << tag), so that no record the field lookups below do not reach (they
 * take the first of a tag) goes unchecked. */
char *client_check_tlvs_but(const uint8_t *payload, size_t len, uint8_t type,
                            uint64_t repeatable) {
  struct proto_tlv_iter it;
  proto_tlv_init(&it, payload, len);
  uint64_t seen = 0;
  for (;;) {
    uint16_t tag;
    const uint8_t *v;
    uint32_t n;
    int r = proto_tlv_next(&it, &tag, &v, &n);
    if (r == 0)
      return NULL;
    if (r < 0)
      return xasprintf("its %s frame has a TLV record that runs past the payload",
                       proto_type_name(type));
    if (tag < 64 && !(repeatable & (1ull << tag))) {
      if (seen & (1ull << tag))
        return xasprintf("its %s frame has tag %u twice", proto_type_name(type), tag);
      seen |= 1ull << tag;
    }
  }
}

char *client_check_tlvs(const uint8_t *payload, size_t len, uint8_t type) {
  return client_check_tlvs_but(payload, len, type, 0);
}

/* An ERROR frame: a positive errno (1..4095) and a message. */
char *client_parse_error(const uint8_t *payload, size_t len, char **ret_msg) {
  char *bad = client_check_tlvs(payload, len, PROTO_ERROR);
  if (bad)
    return bad;
  uint32_t e = EIO;
  bad = client_field_u32(payload, len, PROTO_ERROR, TAG_ERRNO, "ERRNO", false, 1, 4095, &e);
  if (bad)
    return bad;
  char *msg = NULL;
  bad = client_field_str(payload, len, PROTO_ERROR, TAG_MESSAGE, "MESSAGE", MAX_MESSAGE, &msg);
  if (bad)
    return bad;
  *ret_msg = msg ? msg : xasprintf("the agent reported an error (%s)", strerror((int)e));
  return NULL;
}

/* Whether TYPE may answer a request of type REQ. */
static bool answers(uint8_t req, uint8_t type) {
  if (type == PROTO_ERROR)
    return true;
  switch (req) {
  case PROTO_HELLO: return type == PROTO_HELLO_OK;
  case PROTO_PING: return type == PROTO_PONG;
  case PROTO_EXEC: return type == PROTO_STDOUT || type == PROTO_STDERR || type == PROTO_EXIT;
  case PROTO_WRITE:
  case PROTO_SETUP:
  case PROTO_EGRESS_STATS: return type == PROTO_OK;
  case PROTO_READ: return type == PROTO_DATA || type == PROTO_READ_END;
  case PROTO_UNPACK: return type == PROTO_CREDIT || type == PROTO_OK;
  case PROTO_PACK: return type == PROTO_DATA || type == PROTO_PACK_END;
  default: return false;
  }
}

static char *handle_exit(struct pending *p, const uint8_t *payload, size_t len) {
  uint32_t code, sig, timed_out;
  uint64_t dur;
  /* 64 is SIGRTMAX: the largest signal a Linux process can die of. */
  char *bad = client_field_u32(payload, len, PROTO_EXIT, TAG_EXIT_CODE, "EXIT_CODE", true, 0, UINT32_MAX,
                        &code);
  if (!bad)
    bad = client_field_u32(payload, len, PROTO_EXIT, TAG_SIGNAL, "SIGNAL", true, 0, 64, &sig);
  if (!bad)
    bad = client_field_u32(payload, len, PROTO_EXIT, TAG_TIMED_OUT, "TIMED_OUT", true, 0, 1, &timed_out);
  if (!bad) {
    /* The command cannot have run longer than the host waited for it. */
    uint64_t max_us = (mono_ms() - p->start_ms + DURATION_SLACK_MS) * 1000u;
    bad = client_field_u64(payload, len, PROTO_EXIT, TAG_DURATION_US, "DURATION_US", true, max_us, &dur);
  }
  if (bad)
    return bad;
  int32_t status = (int32_t)code;
  if (sig == 0 && (status < 0 || status > 255))
    return xasprintf("its EXIT frame has EXIT_CODE %d for a command that exited (0..255)", status);
  if (sig != 0 && status != -1)
    return xasprintf("its EXIT frame has EXIT_CODE %d with SIGNAL %u (a signalled command has "
                     "EXIT_CODE -1)",
                     status, sig);
  struct agent_exec_res *r = p->res;
  r->exit_code = status;
  r->signal = (int)sig;
  r->timed_out = timed_out != 0;
  r->duration_us = dur;
  client_finish(p, 0);
  return NULL;
}

static char *handle_read_end(struct pending *p, const uint8_t *payload, size_t len) {
  uint64_t size, bytes;
  uint32_t eof;
  /* A file's size is an off_t. */
  char *bad = client_field_u64(payload, len, PROTO_READ_END, TAG_SIZE, "SIZE", true, INT64_MAX, &size);
  if (!bad)
    bad = client_field_u32(payload, len, PROTO_READ_END, TAG_EOF, "EOF", true, 0, 1, &eof);
  if (!bad)
    bad = client_field_u64(payload, len, PROTO_READ_END, TAG_BYTES, "BYTES", true, UINT64_MAX, &bytes);
  if (bad)
    return bad;
  if (bytes != p->data_len)
    return xasprintf("its READ_END frame says %llu bytes were sent, but %zu came",
                     (unsigned long long)bytes, p->data_len);
  p->size = size;
  p->eof = eof != 0;
  client_finish(p, 0);
  return NULL;
}

/* HELLO_OK's EGRESS_ERROR: the agent's words, shown to the user, so only
 * printable ASCII, 1..MAX_EGRESS_ERROR bytes. */
static char *hello_egress_error(struct agent_conn *c, const uint8_t *payload, size_t len) {
  const uint8_t *v;
  uint32_t n;
  if (proto_find(payload, len, TAG_EGRESS_ERROR, &v, &n) <= 0)
    return NULL; /* absent (a malformed payload was refused before) */
  if (n == 0 || n > MAX_EGRESS_ERROR)
    return xasprintf("its HELLO_OK frame has an EGRESS_ERROR of %u bytes, not 1..%u", n,
                     MAX_EGRESS_ERROR);
  for (uint32_t i = 0; i < n; i++)
    if (v[i] < 0x20 || v[i] >= 0x7f)
      return xasprintf("its HELLO_OK frame has an EGRESS_ERROR with byte 0x%02x at %u (only "
                       "printable ASCII)",
                       v[i], i);
  free(c->egress_error);
  c->egress_error = strndup((const char *)v, n);
  return c->egress_error ? NULL : strdup("out of memory for the agent's EGRESS_ERROR");
}

/* EGRESS_STATS' OK: UDP, ICMP and OTHER, each a u64, each once (the
 * generic check sees repeated tags below 64 only). */
static char *handle_egress_stats(struct pending *p, const uint8_t *payload, size_t len) {
  static const struct {
    uint16_t tag;
    const char *name;
  } fields[3] = {{TAG_UDP, "UDP"}, {TAG_ICMP, "ICMP"}, {TAG_OTHER, "OTHER"}};
  unsigned seen[3] = {0};
  struct proto_tlv_iter it;
  proto_tlv_init(&it, payload, len);
  uint16_t tag;
  const uint8_t *v;
  uint32_t n;
  while (proto_tlv_next(&it, &tag, &v, &n) > 0)
    for (size_t i = 0; i < 3; i++)
      seen[i] += tag == fields[i].tag;
  for (size_t i = 0; i < 3; i++) {
    if (seen[i] > 1)
      return xasprintf("its OK frame to EGRESS_STATS has %s %u times", fields[i].name, seen[i]);
    char *bad = client_field_u64(payload, len, PROTO_OK, fields[i].tag, fields[i].name, true,
                                 UINT64_MAX, &p->stats[i]);
    if (bad)
      return bad;
  }
  client_finish(p, 0);
  return NULL;
}

/* Hands one frame to its call.  Returns NULL, or what broke the protocol. */
static char *handle_frame(struct agent_conn *c, const struct proto_header *h,
                          const uint8_t *payload) {
  if (h->id == 0)
    return xasprintf("it sent a %s frame with request id 0", proto_type_name(h->type));
  struct pending *p = find_pending(c, h->id);
  if (!p || p->done)
    return NULL; /* a call that gave up: its late frames are dropped */
  if (!answers(p->type, h->type))
    return xasprintf("it answered a %s request with a %s frame", proto_type_name(p->type),
                     proto_type_name(h->type));
  if (p->tree)
    return client_tree_frame(c, p, h, payload);
  uint32_t version;
  char *bad = NULL;
  /* The frames made of TLV records (not output or file data). */
  if (h->type != PROTO_STDOUT && h->type != PROTO_STDERR && h->type != PROTO_DATA &&
      h->type != PROTO_ERROR && (bad = client_check_tlvs(payload, h->len, h->type)))
    return bad;
  switch (h->type) {
  case PROTO_STDOUT:
  case PROTO_STDERR:
    if (p->on_output)
      p->on_output(p->output_ctx, h->type == PROTO_STDERR ? 2 : 1, payload, h->len);
    keep_output(p, h->type == PROTO_STDERR, payload, h->len);
    return NULL;
  case PROTO_DATA:
    if (p->data_len + h->len > p->data_cap)
      return xasprintf("it sent more than the %zu bytes of file data asked for", p->data_cap);
    memcpy(p->data + p->data_len, payload, h->len);
    p->data_len += h->len;
    return NULL;
  case PROTO_EXIT:
    return handle_exit(p, payload, h->len);
  case PROTO_READ_END:
    return handle_read_end(p, payload, h->len);
  case PROTO_HELLO_OK: {
    char *info = NULL;
    bad = client_field_u32(payload, h->len, h->type, TAG_VERSION, "VERSION", true, PROTO_VERSION,
                    PROTO_VERSION, &version);
    if (!bad)
      bad = client_field_str(payload, h->len, h->type, TAG_INFO, "INFO", MAX_INFO, &info);
    if (!bad)
      bad = hello_egress_error(c, payload, h->len);
    if (bad) {
      free(info);
      return bad;
    }
    free(c->info);
    c->info = info ? info : strdup("ign-agent");
    client_finish(p, 0);
    return NULL;
  }
  case PROTO_PONG:
    bad = client_field_u32(payload, h->len, h->type, TAG_VERSION, "VERSION", false, PROTO_VERSION,
                    PROTO_VERSION, &version);
    if (!bad)
      client_finish(p, 0);
    return bad;
  case PROTO_OK: {
    if (p->type == PROTO_EGRESS_STATS)
      return handle_egress_stats(p, payload, h->len);
    uint64_t size = p->write_size;
    if (p->type == PROTO_WRITE)
      bad = client_field_u64(payload, h->len, h->type, TAG_SIZE, "SIZE", false, UINT64_MAX, &size);
    if (!bad && size != p->write_size)
      bad = xasprintf("its OK frame says %llu bytes were written, but %llu were sent",
                      (unsigned long long)size, (unsigned long long)p->write_size);
    if (!bad)
      client_finish(p, 0);
    return bad;
  }
  case PROTO_ERROR: {
    char *msg = NULL;
    bad = client_parse_error(payload, h->len, &msg);
    if (bad)
      return bad;
    p->err_msg = msg;
    /* The agent's errno stays the agent's: EPIPE from a guest is not the
     * host's connection dying. */
    client_finish(p, -EREMOTEIO);
    return NULL;
  }
  default:
    return xasprintf("it sent a %s frame, which only the host sends", proto_type_name(h->type));
  }
}

static void *reader_main(void *arg) {
  struct agent_conn *c = arg;
  uint8_t *payload = malloc(PROTO_MAX_PAYLOAD);
  char *reason = NULL;
  bool fault = false;
  if (!payload) {
    reason = strdup("out of memory");
  } else {
    for (;;) {
      struct proto_header h;
      int r = proto_read_frame(c->fd, &h, payload);
      if (r < 0) {
        if (r == -ENODATA || r == -ECONNRESET) {
          reason = strdup("the sandbox's agent closed the connection");
        } else if (r == -EPROTO) {
          reason = strdup("the sandbox's agent broke the protocol: it sent a malformed frame "
                          "header; the host closed the connection");
          fault = true;
        } else {
          reason = xasprintf("reading from the sandbox's agent failed: %s", strerror(-r));
        }
        break;
      }
      if (h.id == 0 && h.type == PROTO_ERROR) {
        /* The agent gives up on the connection and says why, in words
         * that are quoted as its own: a guest cannot word the host's. */
        char *msg = NULL;
        char *bad = client_parse_error(payload, h.len, &msg);
        if (!bad) {
          reason = xasprintf("the sandbox's agent closed the connection: %s", msg);
          free(msg);
        } else {
          reason = xasprintf("the sandbox's agent broke the protocol: %s; the host closed the "
                             "connection",
                             bad);
          free(bad);
          fault = true;
        }
        break;
      }
      char *bad;
      if (h.id & PROTO_AGENT_ID) {
        bad = client_stream_frame(c, &h, payload);
      } else {
        pthread_mutex_lock(&c->lock);
        bad = handle_frame(c, &h, payload);
        pthread_mutex_unlock(&c->lock);
        pthread_cond_broadcast(&c->cond);
      }
      if (bad) {
        reason = xasprintf("the sandbox's agent broke the protocol: %s; the host closed the "
                           "connection",
                           bad);
        free(bad);
        fault = true;
        break;
      }
    }
  }
  free(payload);
  pthread_mutex_lock(&c->lock);
  client_mark_dead_locked(c, reason, fault);
  pthread_mutex_unlock(&c->lock);
  /* Whatever the agent sends from now on is not read: stop the writer too. */
  shutdown(c->fd, SHUT_RDWR);
  client_stream_closed(c);
  return NULL;
}

/* ---- the connection ------------------------------------------------------ */

bool agent_conn_alive(struct agent_conn *c) {
  pthread_mutex_lock(&c->lock);
  bool alive = !c->dead;
  pthread_mutex_unlock(&c->lock);
  return alive;
}

const char *agent_conn_info(struct agent_conn *c) { return c->info ? c->info : ""; }

/* Set once, before agent_conn_open returns. */
const char *agent_conn_egress_error(struct agent_conn *c) { return c->egress_error; }

void agent_conn_set_write_deadline(struct agent_conn *c, uint32_t ms) {
  pthread_mutex_lock(&c->lock);
  c->write_deadline_ms = ms ? ms : 1;
  pthread_mutex_unlock(&c->lock);
}

void agent_conn_shutdown(struct agent_conn *c) {
  pthread_mutex_lock(&c->lock);
  client_mark_dead_locked(c, strdup("the session was closed"), false);
  pthread_mutex_unlock(&c->lock);
  shutdown(c->fd, SHUT_RDWR);
}

void agent_conn_free(struct agent_conn *c) {
  if (!c)
    return;
  agent_conn_shutdown(c);
  if (c->reader_started)
    pthread_join(c->reader, NULL);
  if (c->writer_started)
    pthread_join(c->writer, NULL);
  close(c->fd);
  if (c->wake_fd >= 0)
    close(c->wake_fd);
  client_queue_clear(&c->ctl_q);
  client_queue_clear(&c->data_q);
  client_queue_clear(&c->stream_q);
  client_stream_free_all(c);
  free(c->dead_reason);
  free(c->info);
  free(c->egress_error);
  pthread_mutex_destroy(&c->hlock);
  pthread_mutex_destroy(&c->lock);
  pthread_cond_destroy(&c->cond);
  pthread_cond_destroy(&c->wcond);
  free(c);
}

/* Registers P with a fresh id; the caller then queues its frames. */
int client_register_pending(struct agent_conn *c, struct pending *p, uint8_t type) {
  pthread_mutex_lock(&c->lock);
  if (c->dead) {
    pthread_mutex_unlock(&c->lock);
    return -EPIPE;
  }
  /* Ids below 2^31 (the agent's have bit 31), never 0, never one still
   * waiting for its answer. */
  do {
    c->next_id = c->next_id >= PROTO_AGENT_ID - 1 ? 1 : c->next_id + 1;
    p->id = c->next_id;
  } while (find_pending(c, p->id));
  p->type = type;
  p->start_ms = mono_ms();
  p->next = c->pending;
  c->pending = p;
  pthread_mutex_unlock(&c->lock);
  return 0;
}

static void unregister_pending(struct agent_conn *c, struct pending *p) {
  pthread_mutex_lock(&c->lock);
  for (struct pending **pp = &c->pending; *pp; pp = &(*pp)->next)
    if (*pp == p) {
      *pp = p->next;
      break;
    }
  pthread_mutex_unlock(&c->lock);
}

/* The newest non-empty line of the output tail, for a progress message. */
static void last_line(const struct pending *p, char *out, size_t out_size) {
  size_t end = p->tail_len;
  while (end > 0 && (p->tail[end - 1] == '\n' || p->tail[end - 1] == '\r'))
    end--;
  size_t start = end;
  while (start > 0 && p->tail[start - 1] != '\n')
    start--;
  size_t n = end - start;
  if (n >= out_size)
    n = out_size - 1;
  memcpy(out, p->tail + start, n);
  out[n] = '\0';
}

/* Waits until P is done, the connection dies, the call is cancelled or
 * TIMEOUT_MS (0: no limit) passes.  Called and returns with c->lock held. */
static int wait_pending(struct agent_conn *c, struct pending *p, const struct agent_ctl *ctl,
                        uint32_t timeout_ms) {
  uint64_t start = mono_ms(), last_progress = start;
  for (;;) {
    if (p->done)
      return p->result;
    if (c->dead)
      return client_dead_code(c);
    if (client_cancelled(ctl))
      return -ECANCELED;
    uint64_t now = mono_ms();
    if (timeout_ms && now - start >= timeout_ms)
      return -ETIMEDOUT;
    if (ctl && ctl->progress && now - last_progress >= PROGRESS_EVERY_MS) {
      char line[256];
      last_line(p, line, sizeof line);
      last_progress = now;
      pthread_mutex_unlock(&c->lock);
      ctl->progress(ctl->ctx, line, now - start);
      pthread_mutex_lock(&c->lock);
      continue;
    }
    struct timespec ts = timespec_in(CLOCK_MONOTONIC, TICK_MS);
    pthread_cond_timedwait(&c->cond, &c->lock, &ts);
  }
}

/* Ends a call: called with c->lock held, returns without it. */
int client_finish_call(struct agent_conn *c, struct pending *p, int r, char **ret_err) {
  if ((r == -EPIPE || r == -EPROTO) && !p->done)
    client_set_err(ret_err, strdup(c->dead_reason ? c->dead_reason : "the sandbox is gone"));
  else if (r == -ETIMEDOUT)
    client_set_err(ret_err, strdup("the sandbox's agent stopped answering"));
  else if (r == -ECANCELED)
    client_set_err(ret_err, strdup("the call was cancelled"));
  else if (r < 0 && p->err_msg)
    client_set_err(ret_err, steal_ptr(p->err_msg));
  pthread_mutex_unlock(&c->lock);
  unregister_pending(c, p);
  free(p->err_msg);
  return r;
}

int client_dead_error(struct agent_conn *c, char **ret_err) {
  pthread_mutex_lock(&c->lock);
  client_set_err(ret_err, strdup(c->dead_reason ? c->dead_reason : "the sandbox is gone"));
  int r = client_dead_code(c);
  pthread_mutex_unlock(&c->lock);
  return r;
}

int agent_conn_open(int fd, uint32_t timeout_ms, struct agent_conn **ret, char **ret_err) {
  int type = 0;
  socklen_t tlen = sizeof type;
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) < 0 || type != SOCK_STREAM) {
    client_set_err(ret_err, strdup("the agent channel is not a stream socket"));
    close(fd);
    return -ENOTSOCK;
  }
  struct agent_conn *c = calloc(1, sizeof *c);
  if (!c) {
    close(fd);
    return -ENOMEM;
  }
  c->fd = fd;
  c->write_deadline_ms = AGENT_WRITE_DEADLINE_MS;
  c->ctl_q.tail = &c->ctl_q.head;
  c->data_q.tail = &c->data_q.head;
  c->stream_q.tail = &c->stream_q.head;
  c->last_agent_id = PROTO_AGENT_ID;
  /* The writer starts a frame only when it fits what the socket's buffer
   * has room for (SIOCOUTQ against SO_SNDBUF); a channel that cannot say
   * gets frames as they come. */
  socklen_t slen = sizeof c->sndbuf;
  int outq;
  if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &c->sndbuf, &slen) < 0 ||
      ioctl(fd, SIOCOUTQ, &outq) < 0)
    c->sndbuf = 0;
  c->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (c->wake_fd < 0) {
    int e = errno;
    client_set_err(ret_err, xasprintf("cannot make the agent writer's eventfd: %s", strerror(e)));
    close(fd);
    free(c);
    return -e;
  }
  pthread_mutex_init(&c->hlock, NULL);
  pthread_mutex_init(&c->lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&c->cond, &ca);
  pthread_cond_init(&c->wcond, &ca);
  pthread_condattr_destroy(&ca);
  if (pthread_create(&c->reader, NULL, reader_main, c) != 0) {
    client_set_err(ret_err, strdup("cannot start the agent reader thread"));
    agent_conn_free(c);
    return -EAGAIN;
  }
  c->reader_started = true;
  if (pthread_create(&c->writer, NULL, writer_main, c) != 0) {
    client_set_err(ret_err, strdup("cannot start the agent writer thread"));
    agent_conn_free(c);
    return -EAGAIN;
  }
  c->writer_started = true;

  struct pending p = {0};
  int r = client_register_pending(c, &p, PROTO_HELLO);
  if (r == 0) {
    struct proto_buf b = {0};
    proto_frame_begin(&b, PROTO_HELLO, p.id);
    proto_put_u32(&b, TAG_VERSION, PROTO_VERSION);
    r = client_enqueue(c, &b, true, NULL, 0, NULL);
    proto_buf_free(&b);
    pthread_mutex_lock(&c->lock);
    if (r == 0)
      r = wait_pending(c, &p, NULL, timeout_ms);
    if (r == -ETIMEDOUT) {
      client_set_err(ret_err, xasprintf("the sandbox's agent did not answer within %u ms", timeout_ms));
      pthread_mutex_unlock(&c->lock);
      unregister_pending(c, &p);
    } else {
      r = client_finish_call(c, &p, r, ret_err);
    }
  } else {
    client_set_err(ret_err, strdup("the agent connection closed before the greeting"));
  }
  if (r < 0) {
    agent_conn_free(c);
    return r;
  }
  *ret = c;
  return 0;
}

/* A request of one empty frame of TYPE and its answer into *P, waited for
 * up to TIMEOUT_MS.  Returns with c->lock held, for client_finish_call. */
static int empty_request(struct agent_conn *c, uint8_t type, uint32_t timeout_ms,
                         struct pending *p) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, type, p->id);
  int r = client_enqueue(c, &b, true, NULL, 0, NULL);
  proto_buf_free(&b);
  bool sent = r == 0;
  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = wait_pending(c, p, NULL, timeout_ms);
  if (r < 0 && sent && !p->done) {
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, p->id, false, 0, false);
    pthread_mutex_lock(&c->lock);
  }
  return r;
}

int agent_ping(struct agent_conn *c, uint32_t timeout_ms, char **ret_err) {
  struct pending p = {0};
  if (client_register_pending(c, &p, PROTO_PING) < 0)
    return client_dead_error(c, ret_err);
  int r = empty_request(c, PROTO_PING, timeout_ms, &p);
  return client_finish_call(c, &p, r, ret_err);
}

int agent_egress_stats(struct agent_conn *c, uint32_t timeout_ms, uint64_t ret[3],
                       char **ret_err) {
  struct pending p = {0};
  if (client_register_pending(c, &p, PROTO_EGRESS_STATS) < 0)
    return client_dead_error(c, ret_err);
  int r = empty_request(c, PROTO_EGRESS_STATS, timeout_ms, &p);
  uint64_t stats[3];
  memcpy(stats, p.stats, sizeof stats);
  r = client_finish_call(c, &p, r, ret_err);
  if (r == 0)
    memcpy(ret, stats, sizeof stats);
  return r;
}

int agent_exec(struct agent_conn *c, const struct agent_exec_req *req, const struct agent_ctl *ctl,
               struct agent_exec_res *ret, char **ret_err) {
  struct agent_exec_res res = {.exit_code = -1};
  struct pending p = {.res = &res, .out_cap = req->out_cap, .on_output = req->on_output,
                      .output_ctx = req->output_ctx};
  if (client_register_pending(c, &p, PROTO_EXEC) < 0)
    return client_dead_error(c, ret_err);

  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_EXEC, p.id);
  proto_put_str(&b, TAG_COMMAND, req->command);
  if (req->cwd)
    proto_put_str(&b, TAG_CWD, req->cwd);
  for (size_t i = 0; i < req->n_env; i++)
    proto_put_str(&b, TAG_ENV, req->env[i]);
  proto_put_u32(&b, TAG_TIMEOUT_MS, req->timeout_ms);
  proto_put_u32(&b, TAG_HAS_STDIN, req->stdin_data != NULL);
  /* The agent's timer starts when it gets EXEC: the host's, too. */
  uint64_t deadline = req->timeout_ms ? p.start_ms + req->timeout_ms + EXEC_GRACE_MS : 0;
  int r = client_enqueue(c, &b, true, ctl, 0, NULL);
  proto_buf_free(&b);
  if (r == -EMSGSIZE) {
    pthread_mutex_lock(&c->lock);
    p.err_msg = strdup("the command, cwd and env together are too large for one request; "
                       "put long scripts in a file with write_file and run that");
    return client_finish_call(c, &p, -EMSGSIZE, ret_err);
  }
  bool sent = r == 0;
  const uint8_t *in = req->stdin_data;
  bool end_queued = false;
  for (size_t off = 0; r == 0 && in && off < req->stdin_len; off += PROTO_CHUNK) {
    size_t n = req->stdin_len - off < PROTO_CHUNK ? req->stdin_len - off : PROTO_CHUNK;
    r = client_cancelled(ctl) ? -ECANCELED
                       : client_enqueue_data(c, PROTO_STDIN, &p, in + off, n, ctl, deadline);
  }
  if (r == 0 && in) {
    r = client_enqueue_data(c, PROTO_STDIN_END, &p, NULL, 0, ctl, deadline);
    end_queued = r == 0;
  }
  if (r == -EALREADY) {
    /* The agent answered before it had all of stdin (the command exited or
     * could not start): the rest is taken back, and STDIN_END tells the
     * agent to stop waiting for it. */
    client_abandon_request(c, p.id, false, PROTO_STDIN_END, false);
    r = 0;
  }

  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = wait_pending(c, &p, ctl, left_ms(deadline));
  if (r < 0 && sent && !p.done) {
    /* Kill the command's process group; its EXIT will find no one waiting. */
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, p.id, true, in ? PROTO_STDIN_END : 0, end_queued);
    pthread_mutex_lock(&c->lock);
  }
  r = client_finish_call(c, &p, r, ret_err);
  if (r < 0) {
    agent_exec_res_free(&res);
    return r;
  }
  *ret = res;
  return 0;
}

int agent_write_file(struct agent_conn *c, const char *path, uint32_t mode, const void *data,
                     size_t len, const struct agent_ctl *ctl, char **ret_err) {
  struct pending p = {.write_size = len};
  if (client_register_pending(c, &p, PROTO_WRITE) < 0)
    return client_dead_error(c, ret_err);
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_WRITE, p.id);
  proto_put_str(&b, TAG_PATH, path);
  proto_put_u32(&b, TAG_MODE, mode);
  proto_put_u64(&b, TAG_SIZE, len);
  /* The upload counts against the call's deadline, as the answer does. */
  uint64_t deadline = p.start_ms + FILE_TIMEOUT_MS;
  int r = client_enqueue(c, &b, true, ctl, 0, NULL);
  proto_buf_free(&b);
  bool sent = r == 0;
  const uint8_t *d = data;
  for (size_t off = 0; r == 0 && off < len; off += PROTO_CHUNK) {
    if (client_cancelled(ctl)) {
      r = -ECANCELED;
      break;
    }
    size_t n = len - off < PROTO_CHUNK ? len - off : PROTO_CHUNK;
    r = client_enqueue_data(c, PROTO_DATA, &p, d + off, n, ctl, deadline);
  }
  bool end_queued = false;
  if (r == 0) {
    r = client_enqueue_data(c, PROTO_DATA_END, &p, NULL, 0, ctl, deadline);
    end_queued = r == 0;
  }
  if (r == -EALREADY) {
    /* The agent answered early (e.g. it refused: disk full): the rest of
     * the upload is taken back and a short DATA_END ends it. */
    client_abandon_request(c, p.id, false, PROTO_DATA_END, false);
    r = 0;
  }
  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = wait_pending(c, &p, ctl, left_ms(deadline));
  if (r < 0 && sent && !p.done) {
    /* A DATA_END short of SIZE makes the agent drop the temporary file: a
     * cancelled upload never replaces the target. */
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, p.id, false, PROTO_DATA_END, end_queued);
    pthread_mutex_lock(&c->lock);
  }
  return client_finish_call(c, &p, r, ret_err);
}

int agent_read_file(struct agent_conn *c, const char *path, uint64_t offset, uint64_t max,
                    const struct agent_ctl *ctl, void **ret_data, size_t *ret_len,
                    uint64_t *ret_size, bool *ret_eof, char **ret_err) {
  struct pending p = {.data_cap = max};
  p.data = malloc(max ? max : 1);
  if (!p.data) {
    client_set_err(ret_err, strdup("out of memory for the read buffer"));
    return -ENOMEM;
  }
  if (client_register_pending(c, &p, PROTO_READ) < 0) {
    free(p.data);
    return client_dead_error(c, ret_err);
  }
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_READ, p.id);
  proto_put_str(&b, TAG_PATH, path);
  proto_put_u64(&b, TAG_OFFSET, offset);
  proto_put_u64(&b, TAG_MAX, max);
  int r = client_enqueue(c, &b, true, ctl, 0, NULL);
  proto_buf_free(&b);
  bool sent = r == 0;
  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = wait_pending(c, &p, ctl, FILE_TIMEOUT_MS);
  if (r < 0 && sent && !p.done) {
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, p.id, false, 0, false);
    pthread_mutex_lock(&c->lock);
  }
  r = client_finish_call(c, &p, r, ret_err);
  if (r < 0) {
    free(p.data);
    return r;
  }
  *ret_data = p.data;
  *ret_len = p.data_len;
  *ret_size = p.size;
  *ret_eof = p.eof;
  return 0;
}

int agent_setup(struct agent_conn *c, const void *entropy, size_t entropy_len, uint64_t time_ns,
                const char *hostname, const char *machine_id, char **ret_err) {
  struct pending p = {0};
  if (client_register_pending(c, &p, PROTO_SETUP) < 0)
    return client_dead_error(c, ret_err);
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_SETUP, p.id);
  if (entropy)
    proto_put_bytes(&b, TAG_ENTROPY, entropy, entropy_len);
  if (time_ns)
    proto_put_u64(&b, TAG_TIME_NS, time_ns);
  if (hostname)
    proto_put_str(&b, TAG_HOSTNAME, hostname);
  if (machine_id)
    proto_put_str(&b, TAG_MACHINE_ID, machine_id);
  int r = client_enqueue(c, &b, true, NULL, 0, NULL);
  proto_buf_free(&b);
  bool sent = r == 0;
  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = wait_pending(c, &p, NULL, 10000);
  if (r < 0 && sent && !p.done) {
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, p.id, false, 0, false);
    pthread_mutex_lock(&c->lock);
  }
  return client_finish_call(c, &p, r, ret_err);
}

