/* client_tree.c: trees (agent_unpack, agent_pack; client.h "Trees"), both
 * sides: the reader thread checks each frame of a tree call and moves its
 * data (a PACK's stream into the call's ring), and the calling thread feeds
 * an UNPACK's stream from its fd within the agent's CREDIT, or writes a
 * PACK's ring out and returns window to the agent as it drains. */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"
#include "proto/client_int.h"
#include "proto/proto.h"

/* ---- trees: the reader's side -------------------------------------------- */

static void tree_rep_clear(struct tar_report *r) {
  for (size_t i = 0; i < r->n_listed; i++) {
    free(r->listed[i].path);
    free(r->listed[i].reason);
  }
  *r = (struct tar_report){0};
}

/* A SKIP_PATH or SKIP_REASON: at most MAX bytes, no NUL. */
static char *skip_str(uint8_t type, const char *name, const uint8_t *v, uint32_t n, uint32_t max,
                      char **ret) {
  if (n > max)
    return xasprintf("its %s frame has a %s of %u bytes, over %u", proto_type_name(type), name, n,
                     max);
  if (memchr(v, '\0', n))
    return xasprintf("its %s frame has a %s with a NUL byte", proto_type_name(type), name);
  *ret = strndup((const char *)v, n);
  return *ret ? NULL : strdup("out of memory for a report");
}

/* The report of an UNPACK's OK or a PACK's END, checked against what went
 * through the stream (STREAM bytes) and the call's limits. */
static char *parse_report(struct tree_call *t, uint8_t type, const uint8_t *payload, size_t len,
                          uint64_t stream) {
  char *bad = client_check_tlvs_but(payload, len, type, 1ull << TAG_SKIP_PATH | 1ull << TAG_SKIP_REASON);
  struct tar_report r = {0};
  uint64_t bytes = 0;
  if (!bad)
    bad = client_field_u64(payload, len, type, TAG_FILES, "FILES", true, UINT64_MAX, &r.files);
  if (!bad)
    bad = client_field_u64(payload, len, type, TAG_DIRS, "DIRS", true, UINT64_MAX, &r.dirs);
  if (!bad)
    bad = client_field_u64(payload, len, type, TAG_SYMLINKS, "SYMLINKS", true, UINT64_MAX, &r.symlinks);
  if (!bad)
    bad = client_field_u64(payload, len, type, TAG_TREE_BYTES, "TREE_BYTES", true, t->lim->max_bytes,
                    &r.bytes);
  if (!bad)
    bad = client_field_u64(payload, len, type, TAG_SKIPPED, "SKIPPED", true, UINT64_MAX, &r.skipped);
  if (!bad)
    bad = client_field_u64(payload, len, type, TAG_BYTES, "BYTES", true, UINT64_MAX, &bytes);
  if (bad)
    return bad;
  if (bytes != stream)
    return xasprintf("its %s frame says %llu bytes of stream went through, but %llu did",
                     proto_type_name(type), (unsigned long long)bytes, (unsigned long long)stream);
  uint64_t max = t->lim->max_files;
  if (r.files > max || r.dirs > max - r.files || r.symlinks > max - r.files - r.dirs)
    return xasprintf("its %s frame counts more entries than the %llu allowed",
                     proto_type_name(type), (unsigned long long)max);
  if (r.bytes > stream)
    return xasprintf("its %s frame counts %llu bytes of files in a stream of %llu bytes",
                     proto_type_name(type), (unsigned long long)r.bytes,
                     (unsigned long long)stream);
  /* The listed skips, in pairs. */
  struct proto_tlv_iter it;
  proto_tlv_init(&it, payload, len);
  uint16_t tag;
  const uint8_t *v;
  uint32_t n;
  bool want_reason = false;
  while (!bad && proto_tlv_next(&it, &tag, &v, &n) > 0) {
    if (tag == TAG_SKIP_PATH) {
      if (want_reason)
        bad = xasprintf("its %s frame has a SKIP_PATH without its SKIP_REASON",
                        proto_type_name(type));
      else if (r.n_listed == TAR_SKIPPED_LISTED)
        bad = xasprintf("its %s frame lists more than %u skipped entries", proto_type_name(type),
                        TAR_SKIPPED_LISTED);
      else
        bad = skip_str(type, "SKIP_PATH", v, n, PROTO_MAX_SKIP_PATH,
                       &r.listed[r.n_listed].path);
      if (!bad)
        r.n_listed++;
      want_reason = true;
    } else if (tag == TAG_SKIP_REASON) {
      if (!want_reason)
        bad = xasprintf("its %s frame has a SKIP_REASON without a SKIP_PATH",
                        proto_type_name(type));
      else
        bad = skip_str(type, "SKIP_REASON", v, n, PROTO_MAX_SKIP_REASON,
                       &r.listed[r.n_listed - 1].reason);
      want_reason = false;
    }
  }
  if (!bad && want_reason)
    bad = xasprintf("its %s frame has a SKIP_PATH without its SKIP_REASON", proto_type_name(type));
  if (!bad && r.skipped < r.n_listed)
    bad = xasprintf("its %s frame lists %zu skipped entries but counts %llu",
                    proto_type_name(type), r.n_listed, (unsigned long long)r.skipped);
  if (bad) {
    tree_rep_clear(&r);
    return bad;
  }
  tree_rep_clear(&t->rep);
  t->rep = r;
  return NULL;
}

/* The WINDOW of the CREDIT of request ID that still waits in the control
 * queue (its value sits at a fixed place: the header, a tag and a length),
 * or NULL.  With c->lock held. */
static uint8_t *queued_credit(struct agent_conn *c, uint32_t id) {
  for (struct out_frame *f = c->ctl_q.head; f; f = f->next)
    if (f->id == id && f->type == PROTO_CREDIT)
      return f->bytes + PROTO_HEADER_SIZE + 6;
  return NULL;
}

char *client_tree_frame(struct agent_conn *c, struct pending *p,
                               const struct proto_header *h, const uint8_t *payload) {
  struct tree_call *t = p->tree;
  t->last_ms = mono_ms();
  char *bad = NULL;
  switch (h->type) {
  case PROTO_CREDIT: {
    uint32_t w;
    if (!(bad = client_check_tlvs(payload, h->len, h->type)))
      bad = client_field_u32(payload, h->len, h->type, TAG_WINDOW, "WINDOW", true, 1, TREE_WINDOW, &w);
    if (bad)
      return bad;
    /* What it grants is room in its buffer, which is TREE_WINDOW bytes. */
    if (t->credit + w > TREE_WINDOW)
      return xasprintf("its CREDIT frames grant more than the %u bytes of window", TREE_WINDOW);
    t->credit += w;
    return NULL;
  }
  case PROTO_DATA: {
    /* A grant still in the queue has not reached the agent. */
    const uint8_t *queued = queued_credit(c, h->id);
    uint64_t granted = t->window_left - (queued ? proto_le32(queued) : 0);
    if (h->len > granted)
      return xasprintf("it sent %u bytes of a tree with only %llu granted", h->len,
                       (unsigned long long)granted);
    if (h->len > t->stream_cap - t->received) {
      /* Not a protocol error: the tree is too large, which the agent
       * should have found; the call fails and the agent is stopped. */
      p->err_msg = xasprintf("the sandbox sent more than %llu bytes of tar stream for a tree of "
                             "at most %llu bytes and %llu entries; the copy was stopped",
                             (unsigned long long)t->stream_cap,
                             (unsigned long long)t->lim->max_bytes,
                             (unsigned long long)t->lim->max_files);
      client_finish(p, -EFBIG);
      return NULL;
    }
    size_t end = (t->ring_off + t->ring_len) % TREE_WINDOW;
    size_t first = h->len < TREE_WINDOW - end ? h->len : TREE_WINDOW - end;
    memcpy(t->ring + end, payload, first);
    memcpy(t->ring, payload + first, h->len - first);
    t->ring_len += h->len;
    t->window_left -= h->len;
    t->received += h->len;
    return NULL;
  }
  case PROTO_OK:
  case PROTO_PACK_END:
    t->agent_ended = true;
    bad = parse_report(t, h->type, payload, h->len,
                       h->type == PROTO_OK ? t->sent : t->received);
    if (!bad)
      client_finish(p, 0);
    return bad;
  case PROTO_ERROR:
    t->agent_ended = true;
    return client_end_with_error(p, payload, h->len);
  default:
    return xasprintf("it sent a %s frame, which only the host sends", proto_type_name(h->type));
  }
}

/* ---- trees: the calling thread's side ------------------------------------ */

/* A tree call fails when nothing moved for this long (the agent answers
 * nothing, grants nothing, sends nothing, and the host side is idle too). */
#define TREE_IDLE_MS FILE_TIMEOUT_MS
/* Return window to the agent once this much was written out, or the queue
 * is empty. */
#define TREE_CREDIT_BATCH (TREE_WINDOW / 4u)
/* Tar's headers around each entry: a pax header with a path up to
 * PROTO_MAX_PATH, the entry's header, padding.  Generous on purpose: the cap
 * only stops a stream that is far too long; the content is counted exactly
 * where the stream is unpacked. */
#define TREE_ENTRY_OVERHEAD (8u * 1024u)
#define TREE_STREAM_SLACK (1024u * 1024u)
/* After a stop that came once DATA_END went: how long the agent's answer
 * is waited for (its tar process gets 10 s to stop before a SIGKILL,
 * guest/tree.c's TREE_KILL_GRACE_MS). */
#define TREE_SETTLE_MS 15000u

static uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

static uint64_t tree_stream_cap(const struct tar_limits *lim) {
  uint64_t entries = sat_add(lim->max_files, 16);
  uint64_t headers = entries > UINT64_MAX / TREE_ENTRY_OVERHEAD ? UINT64_MAX
                                                               : entries * TREE_ENTRY_OVERHEAD;
  return sat_add(sat_add(lim->max_bytes, headers), TREE_STREAM_SLACK);
}

/* Waits until READY(t) holds, the call is answered, the connection dies or
 * the call is cancelled or idle for TREE_IDLE_MS.  Called and returns with
 * c->lock held: 0 (ready or answered; check p->done), or a negative errno. */
static int tree_wait(struct agent_conn *c, struct pending *p, const struct agent_ctl *ctl,
                     bool (*ready)(const struct tree_call *t)) {
  uint64_t last_progress = mono_ms();
  for (;;) {
    if (p->done)
      return 0;
    if (c->dead)
      return client_dead_code(c);
    if (client_cancelled(ctl))
      return -ECANCELED;
    if (ready && ready(p->tree))
      return 0;
    uint64_t now = mono_ms();
    if (now - p->tree->last_ms >= TREE_IDLE_MS)
      return -ETIMEDOUT;
    if (ctl && ctl->progress && now - last_progress >= PROGRESS_EVERY_MS) {
      char line[96];
      uint64_t moved = p->type == PROTO_UNPACK ? p->tree->sent : p->tree->received;
      snprintf(line, sizeof line, "%.1f MiB of the tree copied", (double)moved / 1048576.0);
      last_progress = now;
      pthread_mutex_unlock(&c->lock);
      ctl->progress(ctl->ctx, line, now - p->start_ms, moved, 0);
      pthread_mutex_lock(&c->lock);
      continue;
    }
    struct timespec ts = timespec_in(CLOCK_MONOTONIC, TICK_MS);
    pthread_cond_timedwait(&c->cond, &c->lock, &ts);
  }
}

/* Waits up to TICK_MS for FD to be ready for EVENTS, then: 1 ready, 0 not
 * yet, or a negative errno. */
static int tree_fd_ready(int fd, short events) {
  struct pollfd pf = {.fd = fd, .events = events};
  int r = poll(&pf, 1, (int)TICK_MS);
  if (r < 0)
    return errno == EINTR ? 0 : -errno;
  return r > 0;
}

/* A tree request's first frame. */
static int tree_request(struct agent_conn *c, struct pending *p, const char *guest_path,
                        const struct tar_limits *lim, const struct agent_ctl *ctl) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, (enum proto_type)p->type, p->id);
  proto_put_str(&b, TAG_PATH, guest_path);
  proto_put_u64(&b, TAG_MAX_BYTES, lim->max_bytes);
  proto_put_u64(&b, TAG_MAX_FILES, lim->max_files);
  if (p->type == PROTO_PACK)
    proto_put_u32(&b, TAG_WINDOW, TREE_WINDOW);
  int r = client_enqueue(c, &b, true, ctl, 0, NULL);
  proto_buf_free(&b);
  return r;
}

static int tree_check_path(const char *guest_path, char **ret_err) {
  if (!guest_path || guest_path[0] != '/') {
    client_set_err(ret_err, strdup("the sandbox path of a tree copy must be absolute"));
    return -EINVAL;
  }
  if (strlen(guest_path) > PROTO_MAX_PATH) {
    client_set_err(ret_err, xasprintf("the sandbox path is longer than %u bytes", PROTO_MAX_PATH));
    return -ENAMETOOLONG;
  }
  return 0;
}

static bool unpack_ready(const struct tree_call *t) { return t->credit > 0; }

/* A stop that came after DATA_END went: the agent may have put the tree in
 * place already, so a cancel is no proof that GUEST_PATH is as it was.  KILL
 * stops it if it has not, and its answer says which happened: OK (the
 * tree is in place: the call succeeded after all) or an error (it kept
 * GUEST_PATH as it was).  Waited for up to TREE_SETTLE_MS (past the agent's
 * own grace before it SIGKILLs its tar process); without an answer the
 * outcome is unknown: -EINPROGRESS, and the message says so.  Called and
 * returns with c->lock held. */
static int unpack_settle(struct agent_conn *c, struct pending *p, const char *guest_path) {
  if (!p->tree->agent_ended) {
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, p, true, PROTO_DATA_END, true);
    pthread_mutex_lock(&c->lock);
  }
  uint64_t until = mono_ms() + TREE_SETTLE_MS;
  while (!p->done && !c->dead && mono_ms() < until) {
    struct timespec ts = timespec_in(CLOCK_MONOTONIC, TICK_MS);
    pthread_cond_timedwait(&c->cond, &c->lock, &ts);
  }
  if (p->done)
    return p->result;
  p->err_msg = (free(p->err_msg),
                xasprintf("the copy was stopped after the whole stream had reached the sandbox, "
                          "and the sandbox %s whether it had put the new tree in place: '%s' "
                          "may hold the new tree or what it held before; look before relying "
                          "on it",
                          c->dead ? "went away before it said" : "did not say in time",
                          guest_path));
  return -EINPROGRESS;
}

int agent_unpack(struct agent_conn *c, const char *guest_path, int in_fd,
                 const struct tar_limits *lim, const struct agent_ctl *ctl,
                 struct tar_report *ret_rep, char **ret_err) {
  int r = tree_check_path(guest_path, ret_err);
  if (r < 0)
    return r;
  struct tree_call t = {.lim = lim, .stream_cap = tree_stream_cap(lim), .last_ms = mono_ms()};
  struct pending p = {.tree = &t};
  if (client_register_pending(c, &p, PROTO_UNPACK) < 0)
    return client_dead_error(c, ret_err);
  r = tree_request(c, &p, guest_path, lim, ctl);
  bool sent = r == 0, end_queued = false;
  _cleanup_free_ uint8_t *chunk = malloc(PROTO_CHUNK);
  if (!chunk && r == 0)
    r = -ENOMEM;
  char *local_err = NULL;
  while (r == 0) {
    pthread_mutex_lock(&c->lock);
    r = tree_wait(c, &p, ctl, unpack_ready);
    bool answered = p.done;
    size_t want = t.credit < PROTO_CHUNK ? (size_t)t.credit : PROTO_CHUNK;
    pthread_mutex_unlock(&c->lock);
    if (r < 0 || answered)
      break;
    /* Read what the agent has room for; poll so a cancel is seen while
     * the stream's producer is slow. */
    r = tree_fd_ready(in_fd, POLLIN);
    if (r <= 0)
      continue;
    ssize_t n = read(in_fd, chunk, want);
    if (n < 0) {
      r = errno == EINTR || errno == EAGAIN ? 0 : -errno;
      if (r < 0)
        local_err = xasprintf("reading the tree's stream failed: %s", strerror(-r));
      continue;
    }
    if (n == 0) {
      /* EOF is the end of a stream whose producer succeeded only if it
       * did not stop the call first (it sets the stop before it closes):
       * DATA_END would have the agent commit what a failed sender wrote. */
      if (client_cancelled(ctl)) {
        r = -ECANCELED;
        break;
      }
      r = client_enqueue_data(c, PROTO_DATA_END, &p, NULL, 0, ctl, 0);
      end_queued = r == 0;
      break;
    }
    if ((uint64_t)n > t.stream_cap - t.sent) {
      local_err = xasprintf("the tar stream for '%s' is longer than %llu bytes, which a tree "
                            "within the limits (%llu bytes, %llu entries) never is",
                            guest_path, (unsigned long long)t.stream_cap,
                            (unsigned long long)lim->max_bytes,
                            (unsigned long long)lim->max_files);
      r = -EFBIG;
      break;
    }
    pthread_mutex_lock(&c->lock);
    t.credit -= (uint64_t)n;
    t.sent += (uint64_t)n;
    t.last_ms = mono_ms();
    pthread_mutex_unlock(&c->lock);
    r = client_enqueue_data(c, PROTO_DATA, &p, chunk, (size_t)n, ctl, 0);
  }
  if (r == -EALREADY)
    r = 0;
  pthread_mutex_lock(&c->lock);
  if (r == 0 && p.done && !end_queued) {
    /* The agent answered before the end of the stream (it refused, or the
     * tree failed): the rest is taken back and DATA_END ends the id. */
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, &p, false, PROTO_DATA_END, false);
    pthread_mutex_lock(&c->lock);
  }
  if (r == 0 && !p.done)
    r = tree_wait(c, &p, ctl, NULL);
  bool settled = false;
  if (r == -ECANCELED && end_queued) {
    r = unpack_settle(c, &p, guest_path);
    settled = true;
  }
  if (r == 0)
    r = p.result;
  if (r < 0 && sent && !t.agent_ended && !settled) {
    /* KILL stops the tar process (its staging is removed); DATA_END ends
     * the stream unless it already went. */
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, &p, true, PROTO_DATA_END, end_queued);
    pthread_mutex_lock(&c->lock);
  }
  if (local_err)
    p.err_msg = (free(p.err_msg), local_err);
  r = client_finish_call(c, &p, r, ret_err);
  if (r < 0) {
    tree_rep_clear(&t.rep);
    return r;
  }
  *ret_rep = t.rep;
  return 0;
}

static bool pack_ready(const struct tree_call *t) { return t->ring_len > 0; }

/* Gives the agent of the PACK P N more bytes of window.  A CREDIT not sent
 * yet grows instead of queueing another: an agent that stops reading its
 * channel and keeps sending cannot make the host queue a frame for each
 * frame it sends until the write deadline.  With c->lock held. */
static int pack_grant(struct agent_conn *c, struct pending *p, uint32_t n) {
  if (c->dead)
    return client_dead_code(c);
  p->tree->window_left += n;
  uint8_t *queued = queued_credit(c, p->id);
  if (queued) {
    proto_put_le32(queued, proto_le32(queued) + n); /* at most TREE_WINDOW */
    return 0;
  }
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_CREDIT, p->id);
  proto_put_u32(&b, TAG_WINDOW, n);
  struct out_frame *f;
  int r = client_make_frame(&b, &f);
  proto_buf_free(&b);
  if (r < 0)
    return r;
  client_queue_push(&c->ctl_q, f);
  client_wake_writer_locked(c);
  return 0;
}

/* Writes some of BUF (N bytes) to FD without blocking for long: a slow
 * reader of OUT_FD must not hold a cancelled call.  A pipe or socket that
 * polls writable takes PIPE_BUF bytes without blocking; a regular file
 * takes everything.  Returns bytes written (0: not ready yet), or -errno. */
static ssize_t tree_write_some(int fd, bool regular, const uint8_t *buf, size_t n) {
  if (!regular) {
    int r = tree_fd_ready(fd, POLLOUT);
    if (r <= 0)
      return r;
    if (n > PIPE_BUF)
      n = PIPE_BUF;
  }
  ssize_t w = write(fd, buf, n);
  if (w < 0)
    return errno == EINTR || errno == EAGAIN ? 0 : -errno;
  return w;
}

int agent_pack(struct agent_conn *c, const char *guest_path, int out_fd,
               const struct tar_limits *lim, const struct agent_ctl *ctl,
               struct tar_report *ret_rep, char **ret_err) {
  int r = tree_check_path(guest_path, ret_err);
  if (r < 0)
    return r;
  struct stat st;
  bool regular = fstat(out_fd, &st) == 0 && S_ISREG(st.st_mode);
  struct tree_call t = {.lim = lim,
                        .stream_cap = tree_stream_cap(lim),
                        .last_ms = mono_ms(),
                        .window_left = TREE_WINDOW,
                        .ring = malloc(TREE_WINDOW)};
  if (!t.ring) {
    client_set_err(ret_err, strdup("out of memory for the tree's buffer"));
    return -ENOMEM;
  }
  struct pending p = {.tree = &t};
  if (client_register_pending(c, &p, PROTO_PACK) < 0) {
    free(t.ring);
    return client_dead_error(c, ret_err);
  }
  r = tree_request(c, &p, guest_path, lim, ctl);
  bool sent = r == 0;
  char *local_err = NULL;
  uint64_t unreturned = 0;
  pthread_mutex_lock(&c->lock);
  while (r == 0) {
    r = tree_wait(c, &p, ctl, pack_ready);
    if (r < 0 || (p.done && (p.result < 0 || t.ring_len == 0)))
      break;
    if (client_cancelled(ctl)) {
      r = -ECANCELED; /* also while the rest of a finished stream waits */
      break;
    }
    /* The reader only appends past ring_len: this piece stays put while
     * it is written without the lock. */
    size_t off = t.ring_off;
    size_t n = t.ring_len < TREE_WINDOW - off ? t.ring_len : TREE_WINDOW - off;
    pthread_mutex_unlock(&c->lock);
    ssize_t w = tree_write_some(out_fd, regular, t.ring + off, n);
    pthread_mutex_lock(&c->lock);
    if (w < 0) {
      r = (int)w;
      local_err = xasprintf("writing the tree's stream failed: %s", strerror(-r));
      break;
    }
    if (w == 0)
      continue;
    t.ring_off = (t.ring_off + (size_t)w) % TREE_WINDOW;
    t.ring_len -= (size_t)w;
    t.last_ms = mono_ms();
    unreturned += (uint64_t)w;
    if (!p.done && (unreturned >= TREE_CREDIT_BATCH || t.ring_len == 0)) {
      /* The room is the agent's to fill again. */
      r = pack_grant(c, &p, (uint32_t)unreturned);
      unreturned = 0;
    }
  }
  if (r == 0)
    r = p.result;
  if (r < 0 && sent && !t.agent_ended) {
    /* KILL stops the tar process; its late frames are dropped. */
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, &p, true, 0, false);
    pthread_mutex_lock(&c->lock);
  }
  if (local_err)
    p.err_msg = (free(p.err_msg), local_err);
  r = client_finish_call(c, &p, r, ret_err);
  free(t.ring);
  if (r < 0) {
    tree_rep_clear(&t.rep);
    return r;
  }
  *ret_rep = t.rep;
  return 0;
}
