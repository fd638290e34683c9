/* client_call.c: a call's life on the connection (see client.c): its id
 * and its place among the calls waiting for an answer, the wait (cancel,
 * deadline, progress), giving up (its queued frames taken back, the agent
 * told to stop) and its end (the error said once, for the caller), and the
 * checks every frame of the agent's goes through (fields in range, TLVs
 * whole and not repeated, ERROR).  What each request sends and how its
 * answers are read is client_request.c's (client_tree.c's for the trees). */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "proto/client_int.h"
#include "proto/proto.h"

/* Longest ERROR message taken from an agent; ours are far shorter (an error
 * quotes at most a few paths). */
#define MAX_MESSAGE (16u * 1024u)

/* ---- the calls waiting for an answer ------------------------------------- */

/* The call waiting for answer ID, or NULL.  With c->lock held. */
struct pending *client_find_pending(struct agent_conn *c, uint32_t id) {
  for (struct pending *p = c->pending; p; p = p->next)
    if (p->id == id)
      return p;
  return NULL;
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
  } while (client_find_pending(c, p->id));
  p->type = type;
  p->start_ms = mono_ms();
  p->next = c->pending;
  c->pending = p;
  pthread_mutex_unlock(&c->lock);
  return 0;
}

/* Takes P out of the calls waiting for an answer. */
void client_unregister_pending(struct agent_conn *c, struct pending *p) {
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
int client_wait_pending(struct agent_conn *c, struct pending *p, const struct agent_ctl *ctl,
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
      uint64_t out_bytes = p->res ? p->res->out_total : 0, err_bytes = p->res ? p->res->err_total : 0;
      pthread_mutex_unlock(&c->lock);
      ctl->progress(ctl->ctx, line, now - start, out_bytes, err_bytes);
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
  client_unregister_pending(c, p);
  free(p->err_msg);
  return r;
}

/* A call that could not start: the connection's end, as its error. */
int client_dead_error(struct agent_conn *c, char **ret_err) {
  pthread_mutex_lock(&c->lock);
  client_set_err(ret_err, strdup(c->dead_reason ? c->dead_reason : "the sandbox is gone"));
  int r = client_dead_code(c);
  pthread_mutex_unlock(&c->lock);
  return r;
}

/* ---- giving up ----------------------------------------------------------- */

/* A call that gives up (cancelled, timed out, or failed while sending): its
 * frames still queued are taken back; if the agent already has the request,
 * KILL_IT queues a KILL (a command), and END_TYPE (STDIN_END, DATA_END; 0:
 * none) is queued unless it already went, so that the agent stops waiting for
 * the rest of a stream it will not get.  The agent answers into the void. */
void client_abandon_request(struct agent_conn *c, const struct pending *p, bool kill_it,
                            uint8_t end_type, bool end_queued) {
  const uint32_t id = p->id;
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
  /* A request whose first frame (P's type) never left is unknown to the agent. */
  bool agent_has_it = !(taken & (1ull << p->type));
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

/* ---- the checks on an agent's frame ------------------------------------- */

/* Finds TAG in an agent's frame: NULL with *RET_V (NULL when absent and not
 * REQUIRED) and *RET_N set, or the protocol error (malloc'd). */
static char *field_find(const uint8_t *payload, size_t len, uint8_t type, uint16_t tag,
                        const char *name, bool required, const uint8_t **ret_v, uint32_t *ret_n) {
  int r = proto_find(payload, len, tag, ret_v, ret_n);
  if (r < 0)
    return xasprintf("its %s frame has a TLV record that runs past the payload", proto_type_name(type));
  if (r == 0) {
    *ret_v = NULL;
    return required ? xasprintf("its %s frame has no %s", proto_type_name(type), name) : NULL;
  }
  return NULL;
}

/* One field of an agent's frame, checked.  Each returns NULL when fine, or
 * the protocol error (malloc'd).  REQUIRED: absence is an error too. */
char *client_field_u32(const uint8_t *payload, size_t len, uint8_t type, uint16_t tag,
                       const char *name, bool required, uint32_t lo, uint32_t hi, uint32_t *ret) {
  const uint8_t *v;
  uint32_t n;
  char *err = field_find(payload, len, type, tag, name, required, &v, &n);
  if (err || !v)
    return err;
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
  char *err = field_find(payload, len, type, tag, name, required, &v, &n);
  if (err || !v)
    return err;
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

/* An ERROR frame answering P: P ends with its message and -EREMOTEIO (the
 * agent's errno stays the agent's: EPIPE from a guest is not the host's
 * connection dying).  NULL, or the protocol error. */
char *client_end_with_error(struct pending *p, const uint8_t *payload, size_t len) {
  char *msg = NULL;
  char *bad = client_parse_error(payload, len, &msg);
  if (bad)
    return bad;
  p->err_msg = msg;
  client_finish(p, -EREMOTEIO);
  return NULL;
}
