/* client_writer.c: the connection's writer (see client.c): the frame
 * queues and the thread that puts them on the wire.
 *
 * Calls never write to the socket themselves.  They queue whole frames, and
 * one writer thread sends them with non-blocking writes and poll(), so no
 * call blocks on a guest that stopped reading:
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
 *     agent to drop the request (KILL, or the end frame of a short upload;
 *     client_abandon_request in client_call.c), then returns at once; the
 *     writer finishes or abandons the rest. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/util.h"
#include "proto/client_int.h"
#include "proto/proto.h"

/* Slack over a frame's length for what the socket is charged beyond its
 * bytes, and how often the writer looks again for room when poll() cannot
 * say. */
#define OUTQ_SLACK 4096u
#define ROOM_POLL_MS 10u

_Static_assert(AGENT_QUEUE_MAX >= PROTO_HEADER_SIZE + PROTO_CHUNK, "a chunk fits the queue");

/* ---- frames and queues --------------------------------------------------- */

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

/* ---- the thread --------------------------------------------------------- */

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
void *client_writer_main(void *arg) {
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

/* ---- queueing a call's frames ------------------------------------------- */

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
