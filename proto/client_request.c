/* client_request.c: the requests (client.h: HELLO, PING, EGRESS_STATS,
 * EXEC, WRITE, READ, SETUP) and their answers.  The calling side builds a
 * request's frames, queues them (client_writer.c) and waits for its answer
 * (client_call.c); the reader's side (client_request_frame, with c->lock
 * held) checks that a frame answers the request it names and every field of
 * it, and fills the call in.  A new request adds its type to answers(), its
 * answer frames to client_request_frame and its call below; a long one
 * that moves data both ways is built like the trees (client_tree.c). */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "proto/client_int.h"
#include "proto/proto.h"

/* Past a command's own timeout the host waits the connection's grace
 * (AGENT_EXEC_GRACE_MS) for its EXIT, then asks the agent whether it is still
 * there (a PING, which may take as long), and waits on while it answers, up
 * to this far past the timeout: killing thousands of processes in a starved
 * guest can take longer than the grace, and that is not an agent that
 * stopped. */
#define EXEC_MAX_LATE_MS (5u * 60u * 1000u)
/* Longest HELLO_OK info taken from an agent, and EGRESS_ERROR. */
#define MAX_INFO 256u
#define MAX_EGRESS_ERROR 256u
/* Slack on a command's duration as the agent reports it, over what the host
 * measured between sending EXEC and reading EXIT (the clocks differ a little). */
#define DURATION_SLACK_MS 10000u

void agent_exec_res_free(struct agent_exec_res *r) {
  free(r->out);
  free(r->err);
  r->out = r->err = NULL;
}

/* ---- the answers (the reader's side) -------------------------------------- */

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
char *client_request_frame(struct agent_conn *c, const struct proto_header *h,
                           const uint8_t *payload) {
  if (h->id == 0)
    return xasprintf("it sent a %s frame with request id 0", proto_type_name(h->type));
  struct pending *p = client_find_pending(c, h->id);
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
  case PROTO_ERROR:
    return client_end_with_error(p, payload, h->len);
  default:
    return xasprintf("it sent a %s frame, which only the host sends", proto_type_name(h->type));
  }
}

/* ---- the requests (the calling side) ------------------------------------- */

/* Milliseconds left until DEADLINE (a mono_ms() time; 0: none), at least 1;
 * 0 when there is no deadline. */
static uint32_t left_ms(uint64_t deadline) {
  if (!deadline)
    return 0;
  uint64_t now = mono_ms();
  uint64_t left = deadline > now ? deadline - now : 1;
  return left > UINT32_MAX ? UINT32_MAX : (uint32_t)left;
}

/* Queues B, a request's first frame (its bytes are taken), and waits up to
 * TIMEOUT_MS for the answer into *P; a request the agent has and did not
 * answer is given up.  Returns with c->lock held, for client_finish_call. */
static int send_and_wait(struct agent_conn *c, struct proto_buf *b, struct pending *p,
                         const struct agent_ctl *ctl, uint32_t timeout_ms) {
  int r = client_enqueue(c, b, true, ctl, 0, NULL);
  proto_buf_free(b);
  bool sent = r == 0;
  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = client_wait_pending(c, p, ctl, timeout_ms);
  if (r < 0 && sent && !p->done) {
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, p, false, 0, false);
    pthread_mutex_lock(&c->lock);
  }
  return r;
}

/* A request of one empty frame of TYPE and its answer into *P, waited for
 * up to TIMEOUT_MS.  Returns with c->lock held, for client_finish_call. */
static int empty_request(struct agent_conn *c, uint8_t type, uint32_t timeout_ms,
                         struct pending *p) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, type, p->id);
  return send_and_wait(c, &b, p, NULL, timeout_ms);
}

/* SETUP's TLVs (in SETUP, or in HELLO). */
static void put_setup(struct proto_buf *b, const void *entropy, size_t entropy_len,
                      uint64_t time_ns, const char *hostname, const char *machine_id) {
  if (entropy)
    proto_put_bytes(b, TAG_ENTROPY, entropy, entropy_len);
  if (time_ns)
    proto_put_u64(b, TAG_TIME_NS, time_ns);
  if (hostname)
    proto_put_str(b, TAG_HOSTNAME, hostname);
  if (machine_id)
    proto_put_str(b, TAG_MACHINE_ID, machine_id);
}

int client_hello(struct agent_conn *c, uint32_t timeout_ms, const struct agent_setup_req *setup,
                 char **ret_err) {
  struct pending p = {0};
  int r = client_register_pending(c, &p, PROTO_HELLO);
  if (r < 0) {
    client_set_err(ret_err, strdup("the agent connection closed before the greeting"));
    return r;
  }
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_HELLO, p.id);
  proto_put_u32(&b, TAG_VERSION, PROTO_VERSION);
  if (setup)
    put_setup(&b, setup->entropy, setup->entropy_len,
              setup->clock ? now_ns(CLOCK_REALTIME) : 0, setup->hostname, setup->machine_id);
  r = client_enqueue(c, &b, true, NULL, 0, NULL);
  proto_buf_free(&b);
  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = client_wait_pending(c, &p, NULL, timeout_ms);
  if (r != -ETIMEDOUT)
    return client_finish_call(c, &p, r, ret_err);
  client_set_err(ret_err, xasprintf("the sandbox's agent did not answer within %u ms", timeout_ms));
  pthread_mutex_unlock(&c->lock);
  client_unregister_pending(c, &p);
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

/* Queues LEN bytes of DATA for P's request as frames of type DATA_TYPE in
 * PROTO_CHUNK pieces, then END_TYPE; *RET_END_QUEUED says whether END_TYPE
 * went into the queue.  When the agent answers before it has all of it
 * (the request ended early), the rest is taken back and a short END_TYPE
 * tells the agent to stop waiting: 0.  Otherwise 0 or a negative errno
 * (-ECANCELED when CTL cancels it on the way). */
static int upload(struct agent_conn *c, struct pending *p, enum proto_type data_type,
                  enum proto_type end_type, const uint8_t *data, size_t len,
                  const struct agent_ctl *ctl, uint64_t deadline, bool *ret_end_queued) {
  int r = 0;
  *ret_end_queued = false;
  for (size_t off = 0; r == 0 && off < len; off += PROTO_CHUNK) {
    size_t n = len - off < PROTO_CHUNK ? len - off : PROTO_CHUNK;
    r = client_cancelled(ctl) ? -ECANCELED
                              : client_enqueue_data(c, data_type, p, data + off, n, ctl, deadline);
  }
  if (r == 0) {
    r = client_enqueue_data(c, end_type, p, NULL, 0, ctl, deadline);
    *ret_end_queued = r == 0;
  }
  if (r == -EALREADY) {
    client_abandon_request(c, p, false, end_type, false);
    r = 0;
  }
  return r;
}

/* 0 when the agent answers a PING within GRACE_MS, else why not
 * (-ETIMEDOUT, -ECANCELED, the connection's end).  CTL's cancel only: the
 * command's progress is not the PING's. */
static int agent_answers(struct agent_conn *c, const struct agent_ctl *ctl, uint32_t grace_ms) {
  struct agent_ctl cancel_only = {.cancelled = ctl ? ctl->cancelled : NULL};
  struct pending q = {0};
  int r = client_register_pending(c, &q, PROTO_PING);
  if (r < 0)
    return r;
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_PING, q.id);
  r = send_and_wait(c, &b, &q, &cancel_only, grace_ms);
  return client_finish_call(c, &q, r, NULL);
}

/* Waits for P, a command's answer, until DEADLINE; past it, on while the agent
 * answers a PING, up to EXEC_MAX_LATE_MS past the command's timeout.  Called
 * and returns with c->lock held. */
static int exec_wait(struct agent_conn *c, struct pending *p, const struct agent_ctl *ctl,
                     uint64_t deadline, uint32_t timeout_ms) {
  int r = client_wait_pending(c, p, ctl, left_ms(deadline));
  const uint64_t last = p->start_ms + timeout_ms + EXEC_MAX_LATE_MS;
  const uint32_t grace_ms = c->exec_grace_ms;
  while (r == -ETIMEDOUT && deadline && mono_ms() < last) {
    pthread_mutex_unlock(&c->lock);
    int alive = agent_answers(c, ctl, grace_ms);
    pthread_mutex_lock(&c->lock);
    if (p->done)
      return p->result;
    if (alive < 0)
      return alive == -ECANCELED ? alive : c->dead ? client_dead_code(c) : -ETIMEDOUT;
    deadline = mono_ms() + grace_ms;
    if (deadline > last)
      deadline = last;
    r = client_wait_pending(c, p, ctl, left_ms(deadline));
  }
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
  pthread_mutex_lock(&c->lock);
  uint64_t deadline = req->timeout_ms ? p.start_ms + req->timeout_ms + c->exec_grace_ms : 0;
  pthread_mutex_unlock(&c->lock);
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
  /* An answer before all of stdin: the command exited or could not start. */
  if (r == 0 && in)
    r = upload(c, &p, PROTO_STDIN, PROTO_STDIN_END, in, req->stdin_len, ctl, deadline, &end_queued);

  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = exec_wait(c, &p, ctl, deadline, req->timeout_ms);
  if (r < 0 && sent && !p.done) {
    /* Kill the command's process group; its EXIT will find no one waiting. */
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, &p, true, in ? PROTO_STDIN_END : 0, end_queued);
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
  bool end_queued = false;
  /* An answer before all of the data: the agent refused (disk full, say). */
  if (r == 0)
    r = upload(c, &p, PROTO_DATA, PROTO_DATA_END, data, len, ctl, deadline, &end_queued);
  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = client_wait_pending(c, &p, ctl, left_ms(deadline));
  if (r < 0 && sent && !p.done) {
    /* A DATA_END short of SIZE makes the agent drop the temporary file: a
     * cancelled upload never replaces the target. */
    pthread_mutex_unlock(&c->lock);
    client_abandon_request(c, &p, false, PROTO_DATA_END, end_queued);
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
  int r = send_and_wait(c, &b, &p, ctl, FILE_TIMEOUT_MS);
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

int agent_setup_send(struct agent_conn *c, const struct agent_setup_req *req, char **ret_err) {
  /* Registered only for an id no other call has. */
  struct pending p = {0};
  if (client_register_pending(c, &p, PROTO_SETUP) < 0)
    return client_dead_error(c, ret_err);
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_SETUP, p.id);
  put_setup(&b, req->entropy, req->entropy_len, req->clock ? now_ns(CLOCK_REALTIME) : 0,
            req->hostname, req->machine_id);
  int r = client_enqueue(c, &b, true, NULL, 0, NULL);
  proto_buf_free(&b);
  client_unregister_pending(c, &p); /* its answer is dropped as a late one */
  free(p.err_msg);
  if (r < 0)
    return client_dead_error(c, ret_err);
  return 0;
}

int agent_setup(struct agent_conn *c, const void *entropy, size_t entropy_len, uint64_t time_ns,
                const char *hostname, const char *machine_id, char **ret_err) {
  struct pending p = {0};
  if (client_register_pending(c, &p, PROTO_SETUP) < 0)
    return client_dead_error(c, ret_err);
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_SETUP, p.id);
  put_setup(&b, entropy, entropy_len, time_ns, hostname, machine_id);
  int r = send_and_wait(c, &b, &p, NULL, 10000);
  return client_finish_call(c, &p, r, ret_err);
}

