/* client.c: host side of the agent protocol (see client.h and proto.h).
 *
 * One reader thread per connection reads frames and hands each to the
 * pending call with the same id; calls wait on a shared condition variable
 * with a short tick so they can notice cancellation, send progress and
 * enforce a host-side deadline even if the agent goes silent.  Frames for ids
 * nobody waits for any more (a cancelled call) are dropped.  Writes are
 * serialised by their own mutex so a long file upload never blocks the reader.
 */
#include "proto/client.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/util.h"
#include "proto/proto.h"

#define TICK_MS 100u
#define PROGRESS_EVERY_MS 1000u
/* How long past a command's own timeout the host waits before declaring the
 * agent unresponsive. */
#define EXEC_GRACE_MS 20000u
#define FILE_TIMEOUT_MS 300000u
#define TAIL_SIZE 512u

struct pending {
  struct pending *next;
  uint32_t id;
  uint8_t type;   /* request type */
  bool done;
  int result;     /* 0, or negative errno */
  char *err_msg;
  /* exec */
  struct agent_exec_res *res;
  size_t out_cap;
  char tail[TAIL_SIZE];
  size_t tail_len;
  /* read */
  uint8_t *data;
  size_t data_len, data_cap;
  uint64_t size;
  bool eof;
};

struct agent_conn {
  int fd;
  pthread_t reader;
  bool reader_started;
  pthread_mutex_t lock;       /* pending list, dead flag */
  pthread_cond_t cond;
  pthread_mutex_t write_lock; /* whole frames on the wire */
  struct pending *pending;
  uint32_t next_id;
  bool dead;
  char *dead_reason;
  char *info;
};

void agent_exec_res_free(struct agent_exec_res *r) {
  free(r->out);
  free(r->err);
  r->out = r->err = NULL;
}

static void set_err(char **ret_err, char *msg) {
  if (ret_err) {
    free(*ret_err);
    *ret_err = msg;
  } else {
    free(msg);
  }
}

static int send_frame(struct agent_conn *c, struct proto_buf *b) {
  int r = proto_frame_finish(b);
  if (r < 0)
    return r;
  pthread_mutex_lock(&c->write_lock);
  r = proto_write_all(c->fd, b->data, b->len);
  pthread_mutex_unlock(&c->write_lock);
  return r < 0 ? -EPIPE : 0;
}

static int send_simple(struct agent_conn *c, enum proto_type t, uint32_t id, const void *raw,
                       size_t n) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, t, id);
  proto_put_raw(&b, raw, n);
  int r = send_frame(c, &b);
  proto_buf_free(&b);
  return r;
}

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

static char *error_message(const uint8_t *payload, size_t len, int *ret_errno) {
  const uint8_t *v;
  uint32_t n, e = EIO;
  if (proto_find(payload, len, TAG_ERRNO, &v, &n) == 1)
    proto_val_u32(v, n, &e);
  /* A positive errno as the protocol says; anything else from a guest that
   * does not follow it would turn an error into a success (or overflow). */
  *ret_errno = e > 0 && e < 4096 ? (int)e : EIO;
  if (proto_find(payload, len, TAG_MESSAGE, &v, &n) == 1)
    return strndup((const char *)v, n);
  return xasprintf("the agent reported an error (%s)", strerror(*ret_errno));
}

static void finish(struct pending *p, int result) {
  p->done = true;
  p->result = result;
}

static void handle_frame(struct agent_conn *c, const struct proto_header *h,
                         const uint8_t *payload) {
  struct pending *p = find_pending(c, h->id);
  if (!p || p->done)
    return;
  const uint8_t *v;
  uint32_t n;
  switch (h->type) {
  case PROTO_STDOUT:
  case PROTO_STDERR:
    if (p->type == PROTO_EXEC)
      keep_output(p, h->type == PROTO_STDERR, payload, h->len);
    break;
  case PROTO_DATA:
    if (p->type != PROTO_READ)
      break;
    if (p->data_len + h->len > p->data_cap) {
      p->err_msg = xasprintf("the agent sent more data than was asked for");
      finish(p, -EPROTO);
      break;
    }
    memcpy(p->data + p->data_len, payload, h->len);
    p->data_len += h->len;
    break;
  case PROTO_EXIT: {
    struct agent_exec_res *r = p->res;
    uint32_t u = 0;
    uint64_t d = 0;
    if (!r)
      break;
    if (proto_find(payload, h->len, TAG_EXIT_CODE, &v, &n) == 1 && proto_val_u32(v, n, &u) == 0)
      r->exit_code = (int32_t)u;
    u = 0;
    if (proto_find(payload, h->len, TAG_SIGNAL, &v, &n) == 1 && proto_val_u32(v, n, &u) == 0)
      r->signal = (int)u;
    u = 0;
    if (proto_find(payload, h->len, TAG_TIMED_OUT, &v, &n) == 1 && proto_val_u32(v, n, &u) == 0)
      r->timed_out = u != 0;
    if (proto_find(payload, h->len, TAG_DURATION_US, &v, &n) == 1 && proto_val_u64(v, n, &d) == 0)
      r->duration_us = d;
    finish(p, 0);
    break;
  }
  case PROTO_READ_END: {
    uint64_t size = 0;
    uint32_t eof = 0;
    if (proto_find(payload, h->len, TAG_SIZE, &v, &n) == 1)
      proto_val_u64(v, n, &size);
    if (proto_find(payload, h->len, TAG_EOF, &v, &n) == 1)
      proto_val_u32(v, n, &eof);
    p->size = size;
    p->eof = eof != 0;
    finish(p, 0);
    break;
  }
  case PROTO_HELLO_OK:
    free(c->info);
    c->info = proto_find(payload, h->len, TAG_INFO, &v, &n) == 1 ? strndup((const char *)v, n)
                                                                 : strdup("ign-agent");
    finish(p, 0);
    break;
  case PROTO_OK:
  case PROTO_PONG:
    finish(p, 0);
    break;
  case PROTO_ERROR: {
    int e;
    p->err_msg = error_message(payload, h->len, &e);
    finish(p, -e);
    break;
  }
  default:
    break;
  }
}

static void *reader_main(void *arg) {
  struct agent_conn *c = arg;
  uint8_t *payload = malloc(PROTO_MAX_PAYLOAD);
  char *reason = NULL;
  if (!payload) {
    reason = strdup("out of memory");
  } else {
    for (;;) {
      struct proto_header h;
      int r = proto_read_frame(c->fd, &h, payload);
      if (r < 0) {
        if (r == -ENODATA || r == -ECONNRESET)
          reason = strdup("the sandbox's agent closed the connection");
        else if (r == -EPROTO)
          reason = strdup("the sandbox's agent sent a malformed frame");
        else
          reason = xasprintf("reading from the sandbox's agent failed: %s", strerror(-r));
        break;
      }
      if (h.id == 0 && h.type == PROTO_ERROR) {
        int e;
        reason = error_message(payload, h.len, &e);
        break;
      }
      pthread_mutex_lock(&c->lock);
      handle_frame(c, &h, payload);
      pthread_mutex_unlock(&c->lock);
      pthread_cond_broadcast(&c->cond);
    }
  }
  free(payload);
  pthread_mutex_lock(&c->lock);
  c->dead = true;
  if (!c->dead_reason)
    c->dead_reason = reason;
  else
    free(reason);
  pthread_mutex_unlock(&c->lock);
  pthread_cond_broadcast(&c->cond);
  return NULL;
}

bool agent_conn_alive(struct agent_conn *c) {
  pthread_mutex_lock(&c->lock);
  bool alive = !c->dead;
  pthread_mutex_unlock(&c->lock);
  return alive;
}

const char *agent_conn_info(struct agent_conn *c) { return c->info ? c->info : ""; }

void agent_conn_shutdown(struct agent_conn *c) {
  pthread_mutex_lock(&c->lock);
  if (!c->dead_reason)
    c->dead_reason = strdup("the session was closed");
  c->dead = true;
  pthread_mutex_unlock(&c->lock);
  shutdown(c->fd, SHUT_RDWR);
  pthread_cond_broadcast(&c->cond);
}

void agent_conn_free(struct agent_conn *c) {
  if (!c)
    return;
  agent_conn_shutdown(c);
  if (c->reader_started)
    pthread_join(c->reader, NULL);
  close(c->fd);
  free(c->dead_reason);
  free(c->info);
  pthread_mutex_destroy(&c->lock);
  pthread_mutex_destroy(&c->write_lock);
  pthread_cond_destroy(&c->cond);
  free(c);
}

/* Registers P with a fresh id; the caller then sends its frames. */
static int register_pending(struct agent_conn *c, struct pending *p, uint8_t type) {
  pthread_mutex_lock(&c->lock);
  if (c->dead) {
    pthread_mutex_unlock(&c->lock);
    return -EPIPE;
  }
  do
    p->id = ++c->next_id;
  while (p->id == 0);
  p->type = type;
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
      return -EPIPE;
    if (ctl && ctl->cancelled && atomic_load(ctl->cancelled))
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

static int finish_call(struct agent_conn *c, struct pending *p, int r, char **ret_err) {
  if (r == -EPIPE && !p->done)
    set_err(ret_err, strdup(c->dead_reason ? c->dead_reason : "the sandbox is gone"));
  else if (r == -ETIMEDOUT)
    set_err(ret_err, strdup("the sandbox's agent stopped answering"));
  else if (r < 0 && p->err_msg)
    set_err(ret_err, steal_ptr(p->err_msg));
  pthread_mutex_unlock(&c->lock);
  unregister_pending(c, p);
  free(p->err_msg);
  return r;
}

int agent_conn_open(int fd, uint32_t timeout_ms, struct agent_conn **ret, char **ret_err) {
  struct agent_conn *c = calloc(1, sizeof *c);
  if (!c) {
    close(fd);
    return -ENOMEM;
  }
  c->fd = fd;
  pthread_mutex_init(&c->lock, NULL);
  pthread_mutex_init(&c->write_lock, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&c->cond, &ca);
  pthread_condattr_destroy(&ca);
  if (pthread_create(&c->reader, NULL, reader_main, c) != 0) {
    set_err(ret_err, strdup("cannot start the agent reader thread"));
    agent_conn_free(c);
    return -EAGAIN;
  }
  c->reader_started = true;

  struct pending p = {0};
  int r = register_pending(c, &p, PROTO_HELLO);
  if (r == 0) {
    struct proto_buf b = {0};
    proto_frame_begin(&b, PROTO_HELLO, p.id);
    proto_put_u32(&b, TAG_VERSION, PROTO_VERSION);
    r = send_frame(c, &b);
    proto_buf_free(&b);
    pthread_mutex_lock(&c->lock);
    if (r == 0)
      r = wait_pending(c, &p, NULL, timeout_ms);
    if (r == -ETIMEDOUT) {
      set_err(ret_err, xasprintf("the sandbox's agent did not answer within %u ms", timeout_ms));
      pthread_mutex_unlock(&c->lock);
      unregister_pending(c, &p);
    } else {
      r = finish_call(c, &p, r, ret_err);
    }
  } else {
    set_err(ret_err, strdup("the agent connection closed before the greeting"));
  }
  if (r < 0) {
    agent_conn_free(c);
    return r;
  }
  *ret = c;
  return 0;
}

int agent_ping(struct agent_conn *c, uint32_t timeout_ms, char **ret_err) {
  struct pending p = {0};
  int r = register_pending(c, &p, PROTO_PING);
  if (r < 0) {
    set_err(ret_err, strdup(c->dead_reason ? c->dead_reason : "the sandbox is gone"));
    return r;
  }
  r = send_simple(c, PROTO_PING, p.id, NULL, 0);
  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = wait_pending(c, &p, NULL, timeout_ms);
  return finish_call(c, &p, r, ret_err);
}

static int dead_error(struct agent_conn *c, char **ret_err) {
  pthread_mutex_lock(&c->lock);
  set_err(ret_err, strdup(c->dead_reason ? c->dead_reason : "the sandbox is gone"));
  pthread_mutex_unlock(&c->lock);
  return -EPIPE;
}

int agent_exec(struct agent_conn *c, const struct agent_exec_req *req, const struct agent_ctl *ctl,
               struct agent_exec_res *ret, char **ret_err) {
  struct agent_exec_res res = {.exit_code = -1};
  struct pending p = {.res = &res, .out_cap = req->out_cap};
  if (register_pending(c, &p, PROTO_EXEC) < 0)
    return dead_error(c, ret_err);

  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_EXEC, p.id);
  proto_put_str(&b, TAG_COMMAND, req->command);
  if (req->cwd)
    proto_put_str(&b, TAG_CWD, req->cwd);
  for (size_t i = 0; i < req->n_env; i++)
    proto_put_str(&b, TAG_ENV, req->env[i]);
  proto_put_u32(&b, TAG_TIMEOUT_MS, req->timeout_ms);
  proto_put_u32(&b, TAG_HAS_STDIN, req->stdin_data != NULL);
  int r = send_frame(c, &b);
  if (r == -EMSGSIZE) {
    pthread_mutex_lock(&c->lock);
    p.err_msg = strdup("the command, cwd and env together are too large for one request; "
                       "put long scripts in a file with write_file and run that");
    proto_buf_free(&b);
    return finish_call(c, &p, -EMSGSIZE, ret_err);
  }
  const uint8_t *in = req->stdin_data;
  for (size_t off = 0; r == 0 && in && off < req->stdin_len; off += PROTO_CHUNK) {
    size_t n = req->stdin_len - off < PROTO_CHUNK ? req->stdin_len - off : PROTO_CHUNK;
    r = send_simple(c, PROTO_STDIN, p.id, in + off, n);
  }
  if (r == 0 && in)
    r = send_simple(c, PROTO_STDIN_END, p.id, NULL, 0);
  proto_buf_free(&b);

  pthread_mutex_lock(&c->lock);
  if (r == 0) {
    uint32_t limit = req->timeout_ms ? req->timeout_ms + EXEC_GRACE_MS : 0;
    r = wait_pending(c, &p, ctl, limit);
  }
  if (r == -ECANCELED || r == -ETIMEDOUT) {
    /* Kill the command's process group; its EXIT will find no one waiting. */
    pthread_mutex_unlock(&c->lock);
    send_simple(c, PROTO_KILL, p.id, NULL, 0);
    pthread_mutex_lock(&c->lock);
  }
  r = finish_call(c, &p, r, ret_err);
  if (r < 0) {
    agent_exec_res_free(&res);
    return r;
  }
  *ret = res;
  return 0;
}

int agent_write_file(struct agent_conn *c, const char *path, uint32_t mode, const void *data,
                     size_t len, const struct agent_ctl *ctl, char **ret_err) {
  struct pending p = {0};
  if (register_pending(c, &p, PROTO_WRITE) < 0)
    return dead_error(c, ret_err);
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_WRITE, p.id);
  proto_put_str(&b, TAG_PATH, path);
  proto_put_u32(&b, TAG_MODE, mode);
  proto_put_u64(&b, TAG_SIZE, len);
  int r = send_frame(c, &b);
  proto_buf_free(&b);
  const uint8_t *d = data;
  for (size_t off = 0; r == 0 && off < len; off += PROTO_CHUNK) {
    /* Stop early when the agent already refused (e.g. disk full). */
    pthread_mutex_lock(&c->lock);
    bool stop = p.done || c->dead || (ctl && ctl->cancelled && atomic_load(ctl->cancelled));
    pthread_mutex_unlock(&c->lock);
    if (stop)
      break;
    size_t n = len - off < PROTO_CHUNK ? len - off : PROTO_CHUNK;
    r = send_simple(c, PROTO_DATA, p.id, d + off, n);
  }
  if (r == 0)
    r = send_simple(c, PROTO_DATA_END, p.id, NULL, 0);
  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = wait_pending(c, &p, ctl, FILE_TIMEOUT_MS);
  return finish_call(c, &p, r, ret_err);
}

int agent_read_file(struct agent_conn *c, const char *path, uint64_t offset, uint64_t max,
                    const struct agent_ctl *ctl, void **ret_data, size_t *ret_len,
                    uint64_t *ret_size, bool *ret_eof, char **ret_err) {
  struct pending p = {.data_cap = max};
  p.data = malloc(max ? max : 1);
  if (!p.data) {
    set_err(ret_err, strdup("out of memory for the read buffer"));
    return -ENOMEM;
  }
  if (register_pending(c, &p, PROTO_READ) < 0) {
    free(p.data);
    return dead_error(c, ret_err);
  }
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_READ, p.id);
  proto_put_str(&b, TAG_PATH, path);
  proto_put_u64(&b, TAG_OFFSET, offset);
  proto_put_u64(&b, TAG_MAX, max);
  int r = send_frame(c, &b);
  proto_buf_free(&b);
  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = wait_pending(c, &p, ctl, FILE_TIMEOUT_MS);
  r = finish_call(c, &p, r, ret_err);
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
  if (register_pending(c, &p, PROTO_SETUP) < 0)
    return dead_error(c, ret_err);
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
  int r = send_frame(c, &b);
  proto_buf_free(&b);
  pthread_mutex_lock(&c->lock);
  if (r == 0)
    r = wait_pending(c, &p, NULL, 10000);
  return finish_call(c, &p, r, ret_err);
}
