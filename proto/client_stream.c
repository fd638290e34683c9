/* client_stream.c: the streams and lookups the agent opens (client.h
 * "Streams", proto.h "Streams", docs/egress-design.md section (c)).
 *
 * The table: every stream and lookup the agent opened and the host has not
 * seen the end of, by id (bit 31 set).  The agent's ids count up, so an id
 * at or below the last one that is not in the table was ended (a late
 * frame, dropped) and one above it must open something.  An entry the host
 * ended (RESET, LOOKUP_END) stays as a zombie until the writer takes that
 * frame, so the counts that cap the table (AGENT_MAX_STREAMS,
 * AGENT_MAX_LOOKUPS) also cap the frames the host queues in answer; the
 * answers the connection gives by itself past the caps are capped by
 * AGENT_MAX_REFUSALS queued: an agent that opens and never reads cannot
 * make the host queue without end.
 *
 * Windows, per stream: send_window is what the host may still send (OPEN's
 * WINDOW, grown by the agent's CREDITs); recv_window what the agent may
 * (ACCEPT's, grown by agent_stream_credit), less recv_unsent while the
 * ACCEPT or CREDIT that grants it has not left the queue.
 *
 * Where the frames go: ACCEPT, CREDIT (one per stream at a time, grown by
 * later grants), RESET and LOOKUP_END in ctl_q; DATA and SHUT in stream_q
 * (SHUT after the data), whose bytes are capped by AGENT_STREAM_QUEUE_MAX.
 * An ACCEPT queued before the stream's DATA always leaves before it: the
 * writer empties ctl_q first.
 *
 * Locks: every handler call runs with c->hlock held and c->lock not held,
 * from the reader thread (a frame's call, closed()) or the writer thread
 * (writable()), so calls never overlap and agent_conn_set_streams, which
 * takes c->hlock, returns only when none runs; the handler it replaced is
 * then never called again.  Order: c->hlock, the handler's own locks,
 * c->lock.  agent_stream_* take only c->lock: a handler may call them, and
 * so may any thread holding its own locks.  A call may still come for a
 * stream another thread reset a moment before (the frame was checked
 * first); the handler ignores what it no longer knows. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/util.h"
#include "proto/client_int.h"
#include "proto/proto.h"

/* Answers the connection queues by itself (a refused stream or lookup)
 * that the writer has not taken yet; past it, the agent opens without
 * reading and the connection ends. */
#define AGENT_MAX_REFUSALS (4u * AGENT_MAX_STREAMS)
/* The longest MESSAGE of a host's RESET (for the agent's log). */
#define MAX_RESET_MESSAGE 256u
/* agent_stream_send does not make a frame smaller than this for want of
 * room in the queue (unless that is all there is to send): writable()
 * comes when half the queue is free. */
#define SEND_MIN 4096u

/* ---- the table ----------------------------------------------------------- */

static struct agent_stream **bucket(struct agent_conn *c, uint32_t id) {
  return &c->streams[id % STREAM_BUCKETS];
}

static struct agent_stream *stream_find(struct agent_conn *c, uint32_t id) {
  for (struct agent_stream *s = *bucket(c, id); s; s = s->next)
    if (s->id == id)
      return s;
  return NULL;
}

static struct agent_stream *stream_add(struct agent_conn *c, uint32_t id, bool lookup) {
  struct agent_stream *s = calloc(1, sizeof *s);
  if (!s)
    return NULL;
  s->id = id;
  s->lookup = lookup;
  s->next = *bucket(c, id);
  *bucket(c, id) = s;
  if (lookup)
    c->n_lookups++;
  else
    c->n_streams++;
  return s;
}

/* Takes S's frames that wait in the queues back (they will not be sent). */
static void stream_purge(struct agent_conn *c, struct agent_stream *s) {
  size_t bytes;
  client_queue_purge(&c->ctl_q, s->id, &bytes);
  client_queue_purge(&c->stream_q, s->id, &bytes);
  c->stream_queued -= bytes;
  if (bytes && c->want_writable && c->stream_queued <= AGENT_STREAM_QUEUE_MAX / 2) {
    c->writable_due = true;
    client_wake_writer_locked(c);
  }
  s->credit_f = NULL;
  s->recv_unsent = 0;
}

static void stream_remove(struct agent_conn *c, struct agent_stream *s) {
  stream_purge(c, s);
  for (struct agent_stream **pp = bucket(c, s->id); *pp; pp = &(*pp)->next)
    if (*pp == s) {
      *pp = s->next;
      break;
    }
  if (s->lookup)
    c->n_lookups--;
  else
    c->n_streams--;
  free(s);
}

void client_stream_free_all(struct agent_conn *c) {
  for (size_t i = 0; i < STREAM_BUCKETS; i++)
    while (c->streams[i]) {
      struct agent_stream *s = c->streams[i];
      c->streams[i] = s->next;
      free(s);
    }
  c->n_streams = c->n_lookups = 0;
}

/* ---- frames the host sends ----------------------------------------------- */

/* A frame of TYPE for ID with a u32 field (TAG; 0: none), and a MESSAGE
 * (NULL: none); NULL when out of memory. */
static struct out_frame *small_frame(enum proto_type type, uint32_t id, uint16_t tag, uint32_t v,
                                     const char *msg) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, type, id);
  if (tag)
    proto_put_u32(&b, tag, v);
  if (msg)
    proto_put_bytes(&b, TAG_MESSAGE, msg, strnlen(msg, MAX_RESET_MESSAGE));
  struct out_frame *f = NULL;
  if (client_make_frame(&b, &f) < 0)
    f = NULL;
  proto_buf_free(&b);
  return f;
}

static void push_ctl(struct agent_conn *c, struct out_frame *f) {
  client_queue_push(&c->ctl_q, f);
  client_wake_writer_locked(c);
}

/* The connection answers a stream or lookup it does not hand on: no
 * handler, or over the caps.  Its later frames are dropped (not in the
 * table).  NULL, or what broke the protocol. */
static char *refuse(struct agent_conn *c, uint32_t id, bool lookup) {
  if (c->refusals_queued >= AGENT_MAX_REFUSALS)
    return xasprintf("it opened %u streams and lookups that were refused without reading the "
                     "refusals",
                     AGENT_MAX_REFUSALS);
  struct out_frame *f = lookup ? small_frame(PROTO_LOOKUP_END, id, TAG_RCODE, RCODE_REFUSED, NULL)
                               : small_frame(PROTO_STREAM_RESET, id, TAG_ERRNO, ECONNREFUSED, NULL);
  if (!f)
    return strdup("the host ran out of memory for a refusal");
  f->refusal = true;
  c->refusals_queued++;
  push_ctl(c, f);
  return NULL;
}

/* The host ends live entry S: a RESET (ERR, MSG) or LOOKUP_END{REFUSED}, its
 * queued frames taken back; a zombie until the writer takes the frame. */
static void end_by_host(struct agent_conn *c, struct agent_stream *s, int err, const char *msg) {
  stream_purge(c, s);
  struct out_frame *f = s->lookup
                            ? small_frame(PROTO_LOOKUP_END, s->id, TAG_RCODE, RCODE_REFUSED, NULL)
                            : small_frame(PROTO_STREAM_RESET, s->id, TAG_ERRNO, (uint32_t)err, msg);
  if (!f) {
    /* Out of memory: the agent's side stays open until the connection
     * ends; ours is gone. */
    stream_remove(c, s);
    return;
  }
  s->zombie = true;
  push_ctl(c, f);
}

void client_stream_taken_locked(struct agent_conn *c, const struct out_frame *f) {
  if (f->refusal) {
    c->refusals_queued--;
    return;
  }
  struct agent_stream *s = stream_find(c, f->id);
  if (!s)
    return;
  switch (f->type) {
  case PROTO_STREAM_ACCEPT:
  case PROTO_STREAM_CREDIT:
    /* The grant is the first record's value: the agent has it now. */
    s->recv_unsent -= proto_le32(f->bytes + PROTO_HEADER_SIZE + 6);
    if (f == s->credit_f)
      s->credit_f = NULL;
    break;
  case PROTO_STREAM_SHUT:
    s->host_shut_taken = true;
    if (s->agent_shut)
      stream_remove(c, s); /* both sides shut: the stream ended */
    break;
  case PROTO_STREAM_RESET:
  case PROTO_LOOKUP_END:
    if (s->zombie)
      stream_remove(c, s);
    break;
  default:
    break;
  }
}

/* ---- frames the agent sends ---------------------------------------------- */

enum ev_kind { EV_NONE, EV_OPEN, EV_DATA, EV_CREDIT, EV_SHUT, EV_RESET, EV_LOOKUP };

/* What the handler is told about a frame, once the frame passed. */
struct stream_ev {
  enum ev_kind kind;
  uint32_t id;
  uint32_t n;     /* CREDIT: bytes; RESET: errno */
  const uint8_t *data;
  size_t len;
  struct agent_stream_open open;
  struct agent_lookup lookup;
};

static char *open_stream(struct agent_conn *c, const struct proto_header *h,
                         const uint8_t *payload, struct stream_ev *ev) {
  const uint8_t type = h->type;
  uint32_t kind, family, port, window;
  char *bad = client_check_tlvs(payload, h->len, type);
  if (!bad)
    bad = client_field_u32(payload, h->len, type, TAG_KIND, "KIND", true, STREAM_KIND_TCP,
                           STREAM_KIND_TCP, &kind);
  if (!bad)
    bad = client_field_u32(payload, h->len, type, TAG_FAMILY, "FAMILY", true, 4, 6, &family);
  if (!bad && family == 5)
    bad = strdup("its STREAM_OPEN frame has FAMILY 5, not 4 or 6");
  if (!bad)
    bad = client_field_u32(payload, h->len, type, TAG_PORT, "PORT", true, 1, 65535, &port);
  if (!bad)
    bad = client_field_u32(payload, h->len, type, TAG_WINDOW, "WINDOW", true, 1, STREAM_WINDOW,
                           &window);
  if (bad)
    return bad;
  const uint8_t *addr;
  uint32_t addr_len;
  if (proto_find(payload, h->len, TAG_ADDR, &addr, &addr_len) != 1)
    return strdup("its STREAM_OPEN frame has no ADDR");
  if (addr_len != (family == 4 ? 4u : 16u))
    return xasprintf("its STREAM_OPEN frame has an ADDR of %u bytes for FAMILY %u (%u)", addr_len,
                     family, family == 4 ? 4u : 16u);
  if (!c->h_set || c->n_streams >= AGENT_MAX_STREAMS)
    return refuse(c, h->id, false);
  struct agent_stream *s = stream_add(c, h->id, false);
  if (!s)
    return refuse(c, h->id, false);
  s->send_window = window;
  ev->kind = EV_OPEN;
  ev->open.family = family == 4 ? AF_INET : AF_INET6;
  memcpy(ev->open.addr, addr, addr_len);
  ev->open.port = (uint16_t)port;
  ev->open.window = window;
  return NULL;
}

static char *open_lookup(struct agent_conn *c, const struct proto_header *h,
                         const uint8_t *payload, struct stream_ev *ev) {
  const uint8_t type = h->type;
  uint32_t qtype, transport;
  char *bad = client_check_tlvs(payload, h->len, type);
  if (!bad)
    bad = client_field_u32(payload, h->len, type, TAG_QTYPE, "QTYPE", true, 0, 65535, &qtype);
  if (!bad)
    bad = client_field_u32(payload, h->len, type, TAG_TRANSPORT, "TRANSPORT", true, LOOKUP_UDP,
                           LOOKUP_TCP, &transport);
  if (bad)
    return bad;
  const uint8_t *name;
  uint32_t name_len;
  if (proto_find(payload, h->len, TAG_NAME, &name, &name_len) != 1)
    return strdup("its LOOKUP frame has no NAME");
  if (name_len > PROTO_MAX_NAME)
    return xasprintf("its LOOKUP frame has a NAME of %u bytes, over %u", name_len,
                     PROTO_MAX_NAME);
  if (!c->h_set || c->n_lookups >= AGENT_MAX_LOOKUPS || !stream_add(c, h->id, true))
    return refuse(c, h->id, true);
  ev->kind = EV_LOOKUP;
  ev->lookup.name = name;
  ev->lookup.name_len = name_len;
  ev->lookup.qtype = (uint16_t)qtype;
  ev->lookup.tcp = transport == LOOKUP_TCP;
  return NULL;
}

static char *stream_data(struct agent_stream *s, const struct proto_header *h,
                         const uint8_t *payload, struct stream_ev *ev) {
  if (s->agent_shut)
    return xasprintf("it sent %u bytes on stream %#x after its STREAM_SHUT", h->len, s->id);
  if (h->len > PROTO_CHUNK)
    return xasprintf("it sent a STREAM_DATA frame of %u bytes on stream %#x, over %u", h->len,
                     s->id, PROTO_CHUNK);
  /* A grant still in the queue has not reached the agent. */
  uint32_t granted = s->recv_window - s->recv_unsent;
  if (h->len > granted)
    return xasprintf("it sent %u bytes on stream %#x with only %u granted", h->len, s->id,
                     granted);
  s->recv_window -= h->len;
  if (h->len) {
    ev->kind = EV_DATA;
    ev->data = payload;
    ev->len = h->len;
  }
  return NULL;
}

static char *stream_credit(struct agent_stream *s, const struct proto_header *h,
                           const uint8_t *payload, struct stream_ev *ev) {
  uint32_t w;
  char *bad = client_check_tlvs(payload, h->len, h->type);
  if (!bad)
    bad = client_field_u32(payload, h->len, h->type, TAG_WINDOW, "WINDOW", true, 1, STREAM_WINDOW,
                           &w);
  if (bad)
    return bad;
  if (s->send_window + w > STREAM_WINDOW)
    return xasprintf("its STREAM_CREDIT frames on stream %#x grant more than the %u bytes of "
                     "window (%u more on %u)",
                     s->id, STREAM_WINDOW, w, s->send_window);
  s->send_window += w;
  ev->kind = EV_CREDIT;
  ev->n = w;
  return NULL;
}

/* A frame for live entry S. */
static char *entry_frame(struct agent_conn *c, struct agent_stream *s, const struct proto_header *h,
                         const uint8_t *payload, struct stream_ev *ev) {
  char *bad;
  if (s->lookup)
    return xasprintf("it sent a %s frame for lookup %#x", proto_type_name(h->type), s->id);
  switch (h->type) {
  case PROTO_STREAM_DATA:
    return stream_data(s, h, payload, ev);
  case PROTO_STREAM_CREDIT:
    return stream_credit(s, h, payload, ev);
  case PROTO_STREAM_SHUT:
    if ((bad = client_check_tlvs(payload, h->len, h->type)))
      return bad;
    if (s->agent_shut)
      return xasprintf("it sent STREAM_SHUT twice on stream %#x", s->id);
    s->agent_shut = true;
    ev->kind = EV_SHUT;
    if (s->host_shut_taken)
      stream_remove(c, s); /* both sides shut: the stream ended */
    return NULL;
  case PROTO_STREAM_RESET: {
    uint32_t err;
    bad = client_check_tlvs(payload, h->len, h->type);
    if (!bad)
      bad = client_field_u32(payload, h->len, h->type, TAG_ERRNO, "ERRNO", true, 1, 4095, &err);
    if (bad)
      return bad;
    stream_remove(c, s);
    ev->kind = EV_RESET;
    ev->n = err;
    return NULL;
  }
  default:
    return xasprintf("it sent a %s frame on stream %#x, which only the host sends",
                     proto_type_name(h->type), s->id);
  }
}

/* Checks a frame of an agent's id against the table (c->lock and c->hlock
 * held) and says in EV what the handler is to be told. */
static char *agent_frame_locked(struct agent_conn *c, const struct proto_header *h,
                                const uint8_t *payload, struct stream_ev *ev) {
  ev->id = h->id;
  if (h->type == PROTO_STREAM_OPEN || h->type == PROTO_LOOKUP) {
    if (h->id <= c->last_agent_id)
      return xasprintf("it opened id %#x after %#x: the ids it opens must count up", h->id,
                       c->last_agent_id);
    c->last_agent_id = h->id;
    return h->type == PROTO_STREAM_OPEN ? open_stream(c, h, payload, ev)
                                        : open_lookup(c, h, payload, ev);
  }
  if (h->id > c->last_agent_id)
    return xasprintf("it sent a %s frame for id %#x, which it never opened",
                     proto_type_name(h->type), h->id);
  struct agent_stream *s = stream_find(c, h->id);
  if (!s || s->zombie)
    return NULL; /* ended (by the host, or both sides): a late frame */
  return entry_frame(c, s, h, payload, ev);
}

/* Tells the handler (c->hlock held, c->lock not). */
static void deliver(struct agent_conn *c, const struct stream_ev *ev) {
  const struct agent_stream_handler *h = &c->h;
  switch (ev->kind) {
  case EV_OPEN:
    if (h->open)
      h->open(h->ctx, ev->id, &ev->open);
    break;
  case EV_DATA:
    if (h->data)
      h->data(h->ctx, ev->id, ev->data, ev->len);
    break;
  case EV_CREDIT:
    if (h->credit)
      h->credit(h->ctx, ev->id, ev->n);
    break;
  case EV_SHUT:
    if (h->shut)
      h->shut(h->ctx, ev->id);
    break;
  case EV_RESET:
    if (h->reset)
      h->reset(h->ctx, ev->id, (int)ev->n);
    break;
  case EV_LOOKUP:
    if (h->lookup)
      h->lookup(h->ctx, ev->id, &ev->lookup);
    break;
  case EV_NONE:
    break;
  }
}

char *client_stream_frame(struct agent_conn *c, const struct proto_header *h,
                          const uint8_t *payload) {
  struct stream_ev ev = {.kind = EV_NONE};
  pthread_mutex_lock(&c->hlock);
  pthread_mutex_lock(&c->lock);
  char *bad = agent_frame_locked(c, h, payload, &ev);
  pthread_mutex_unlock(&c->lock);
  /* An entry exists only while a handler is set (set_streams ends them
   * all under hlock), so every event has one to go to. */
  if (!bad && c->h_set)
    deliver(c, &ev);
  pthread_mutex_unlock(&c->hlock);
  return bad;
}

void client_stream_writable(struct agent_conn *c) {
  pthread_mutex_lock(&c->hlock);
  if (c->h_set && c->h.writable)
    c->h.writable(c->h.ctx);
  pthread_mutex_unlock(&c->hlock);
}

void client_stream_closed(struct agent_conn *c) {
  pthread_mutex_lock(&c->hlock);
  c->streams_closed = true;
  if (c->h_set) {
    c->h_set = false;
    if (c->h.closed)
      c->h.closed(c->h.ctx);
  }
  pthread_mutex_unlock(&c->hlock);
}

/* ---- the host's side ----------------------------------------------------- */

void agent_conn_set_streams(struct agent_conn *c, const struct agent_stream_handler *h) {
  pthread_mutex_lock(&c->hlock);
  pthread_mutex_lock(&c->lock);
  /* What the previous handler had open is ended: the new one never heard
   * of it, and its late frames are dropped. */
  for (size_t i = 0; i < STREAM_BUCKETS; i++) {
    struct agent_stream *next;
    for (struct agent_stream *s = c->streams[i]; s; s = next) {
      next = s->next;
      if (!s->zombie)
        end_by_host(c, s, s->accepted ? ECONNRESET : ECONNREFUSED, NULL);
    }
  }
  pthread_mutex_unlock(&c->lock);
  if (h)
    c->h = *h;
  c->h_set = h && !c->streams_closed;
  /* The connection ended before: the new handler hears it at once. */
  if (h && c->streams_closed && h->closed)
    h->closed(h->ctx);
  pthread_mutex_unlock(&c->hlock);
}

/* The live entry SID (a lookup when LOOKUP, else a stream), with c->lock
 * held; NULL with *RET -EPIPE or -ENOENT. */
static struct agent_stream *live(struct agent_conn *c, uint32_t sid, bool lookup, int *ret) {
  if (c->dead) {
    *ret = -EPIPE;
    return NULL;
  }
  struct agent_stream *s = (sid & PROTO_AGENT_ID) ? stream_find(c, sid) : NULL;
  if (!s || s->zombie || s->lookup != lookup) {
    *ret = -ENOENT;
    return NULL;
  }
  return s;
}

int agent_stream_accept(struct agent_conn *c, uint32_t sid, uint32_t window) {
  if (window == 0 || window > STREAM_WINDOW)
    return -EINVAL;
  struct out_frame *f = small_frame(PROTO_STREAM_ACCEPT, sid, TAG_WINDOW, window, NULL);
  if (!f)
    return -ENOMEM;
  int r = 0;
  pthread_mutex_lock(&c->lock);
  struct agent_stream *s = live(c, sid, false, &r);
  if (s && s->accepted)
    r = -EINVAL;
  if (r == 0) {
    s->accepted = true;
    s->recv_window = s->recv_unsent = window;
    push_ctl(c, steal_ptr(f));
  }
  pthread_mutex_unlock(&c->lock);
  client_frame_free(f);
  return r;
}

/* One DATA frame of N bytes of P for S into stream_q; false when out of
 * memory. */
static bool queue_data(struct agent_conn *c, struct agent_stream *s, const uint8_t *p, size_t n) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_STREAM_DATA, s->id);
  proto_put_raw(&b, p, n);
  struct out_frame *f = NULL;
  int r = client_make_frame(&b, &f);
  proto_buf_free(&b);
  if (r < 0)
    return false;
  client_queue_push(&c->stream_q, f);
  c->stream_queued += f->len;
  s->send_window -= (uint32_t)n;
  return true;
}

ssize_t agent_stream_send(struct agent_conn *c, uint32_t sid, const void *p, size_t n) {
  int r = 0;
  size_t taken = 0;
  pthread_mutex_lock(&c->lock);
  struct agent_stream *s = live(c, sid, false, &r);
  if (s && (!s->accepted || s->host_shut))
    r = -EINVAL;
  while (r == 0 && taken < n && s->send_window > 0) {
    size_t want = n - taken;
    if (want > s->send_window)
      want = s->send_window;
    if (want > PROTO_CHUNK)
      want = PROTO_CHUNK;
    size_t room = AGENT_STREAM_QUEUE_MAX - c->stream_queued;
    if (c->stream_queued > AGENT_STREAM_QUEUE_MAX ||
        room < PROTO_HEADER_SIZE + (want < SEND_MIN ? want : SEND_MIN)) {
      c->want_writable = true; /* told when half the queue is free */
      break;
    }
    if (want > room - PROTO_HEADER_SIZE)
      want = room - PROTO_HEADER_SIZE;
    if (!queue_data(c, s, (const uint8_t *)p + taken, want)) {
      r = -ENOMEM;
      break;
    }
    taken += want;
  }
  if (taken)
    client_wake_writer_locked(c);
  pthread_mutex_unlock(&c->lock);
  if (taken || n == 0)
    return (ssize_t)taken;
  return r < 0 ? r : -EAGAIN;
}

int agent_stream_credit(struct agent_conn *c, uint32_t sid, uint32_t n) {
  if (n == 0 || n > STREAM_WINDOW)
    return -EINVAL;
  int r = 0;
  pthread_mutex_lock(&c->lock);
  struct agent_stream *s = live(c, sid, false, &r);
  if (s && (!s->accepted || s->recv_window + n > STREAM_WINDOW))
    r = -EINVAL;
  if (r == 0 && !s->agent_shut) {
    /* (After the agent's SHUT no more comes: nothing to grant.)  A CREDIT
     * that has not left grows instead of queueing another. */
    if (s->credit_f) {
      uint8_t *v = s->credit_f->bytes + PROTO_HEADER_SIZE + 6;
      proto_put_le32(v, proto_le32(v) + n); /* at most STREAM_WINDOW */
    } else {
      struct out_frame *f = small_frame(PROTO_STREAM_CREDIT, sid, TAG_WINDOW, n, NULL);
      if (f) {
        s->credit_f = f;
        push_ctl(c, f);
      } else {
        r = -ENOMEM;
      }
    }
    if (r == 0) {
      s->recv_window += n;
      s->recv_unsent += n;
    }
  }
  pthread_mutex_unlock(&c->lock);
  return r;
}

int agent_stream_shut(struct agent_conn *c, uint32_t sid) {
  struct out_frame *f = small_frame(PROTO_STREAM_SHUT, sid, 0, 0, NULL);
  if (!f)
    return -ENOMEM;
  int r = 0;
  pthread_mutex_lock(&c->lock);
  struct agent_stream *s = live(c, sid, false, &r);
  if (s && (!s->accepted || s->host_shut))
    r = -EINVAL;
  if (r == 0) {
    /* Behind the stream's data, past the queue's cap: 12 bytes, once. */
    s->host_shut = true;
    c->stream_queued += f->len;
    client_queue_push(&c->stream_q, steal_ptr(f));
    client_wake_writer_locked(c);
  }
  pthread_mutex_unlock(&c->lock);
  client_frame_free(f);
  return r;
}

int agent_stream_reset(struct agent_conn *c, uint32_t sid, int err, const char *msg) {
  if (err < 1 || err > 4095)
    return -EINVAL;
  int r = 0;
  pthread_mutex_lock(&c->lock);
  struct agent_stream *s = live(c, sid, false, &r);
  if (r == 0)
    end_by_host(c, s, err, msg);
  pthread_mutex_unlock(&c->lock);
  return r;
}

int agent_lookup_answer(struct agent_conn *c, uint32_t lid, enum proto_rcode rcode,
                        const int *families, const uint8_t (*addrs)[16], size_t n, uint32_t ttl) {
  if ((rcode != RCODE_NOERROR && rcode != RCODE_FORMERR && rcode != RCODE_SERVFAIL &&
       rcode != RCODE_NXDOMAIN && rcode != RCODE_REFUSED) ||
      n > PROTO_MAX_ADDRS || (n && rcode != RCODE_NOERROR))
    return -EINVAL;
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_LOOKUP_END, lid);
  proto_put_u32(&b, TAG_RCODE, rcode);
  for (size_t i = 0; i < n; i++) {
    if (families[i] != AF_INET && families[i] != AF_INET6) {
      proto_buf_free(&b);
      return -EINVAL;
    }
    proto_put_bytes(&b, TAG_ADDR, addrs[i], families[i] == AF_INET ? 4 : 16);
  }
  proto_put_u32(&b, TAG_TTL, ttl);
  struct out_frame *f = NULL;
  int r = client_make_frame(&b, &f);
  proto_buf_free(&b);
  if (r < 0)
    return r;
  pthread_mutex_lock(&c->lock);
  struct agent_stream *s = live(c, lid, true, &r);
  if (r == 0) {
    s->zombie = true; /* answered: gone once the writer takes the answer */
    push_ctl(c, steal_ptr(f));
  }
  pthread_mutex_unlock(&c->lock);
  client_frame_free(f);
  return r;
}
