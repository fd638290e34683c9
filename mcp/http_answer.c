/* http_answer.c: one Streamable HTTP request's answer (see http.c for the
 * transport).  struct post_out is the request's struct mcp_out: the call
 * thread sends into it, the connection's thread waits on it and answers
 * with one JSON body, or streams it as SSE (progress, then the response)
 * from libmicrohttpd's content callback.  A client that goes away while it
 * waits cancels the call; progress it does not read is capped. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "mcp/http_int.h"
#include "mcp/server.h"

/* How often a waiting connection looks whether its client went away. */
#define POLL_MS 100
/* Progress notifications an SSE client has not read yet, in bytes: past
 * it more are dropped (progress is a hint; the response always goes out),
 * so a client that does not read cannot make the server hold a command's
 * every output line. */
#define SSE_QUEUE_MAX (1u << 20)

/* Whether the client closed its end (or the connection broke). */
static bool peer_gone(int fd) {
  if (fd < 0)
    return false;
  struct pollfd p = {.fd = fd, .events = POLLRDHUP};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* ---- one POST's output ---- */


static void post_send(struct mcp_out *o, json_t *m, char *text, size_t len) {
  struct post_out *p = (struct post_out *)o;
  bool response = !json_object_get(m, "method");
  int code = 0;
  json_t *e = json_object_get(m, "error");
  if (e) {
    code = (int)json_integer_value(json_object_get(e, "code"));
    if (!code)
      code = RPC_INTERNAL_ERROR;
  }
  pthread_mutex_lock(&p->lock);
  if (p->gone || p->done || (!p->sse && !response) ||
      (!response && p->queued + len > SSE_QUEUE_MAX)) {
    pthread_mutex_unlock(&p->lock);
    free(text);
    return;
  }
  struct msg *q = calloc(1, sizeof *q);
  if (q) {
    q->text = text;
    q->len = len;
    if (!response)
      p->queued += len;
    *p->tail = q;
    p->tail = &q->next;
  } else {
    free(text);
  }
  if (response) {
    p->done = true;
    p->error_code = q ? code : RPC_INTERNAL_ERROR;
  }
  pthread_cond_broadcast(&p->cond);
  pthread_mutex_unlock(&p->lock);
}

static void post_hold(struct mcp_out *o) {
  struct post_out *p = (struct post_out *)o;
  pthread_mutex_lock(&p->lock);
  p->refs++;
  pthread_mutex_unlock(&p->lock);
}

void http_post_release(struct mcp_out *o) {
  struct post_out *p = (struct post_out *)o;
  pthread_mutex_lock(&p->lock);
  unsigned left = --p->refs;
  pthread_cond_broadcast(&p->cond);
  pthread_mutex_unlock(&p->lock);
  if (left)
    return;
  while (p->head) {
    struct msg *q = p->head;
    p->head = q->next;
    free(q->text);
    free(q);
  }
  pthread_mutex_destroy(&p->lock);
  pthread_cond_destroy(&p->cond);
  free(p);
}

struct post_out *http_post_new(struct MHD_Connection *c) {
  struct post_out *p = calloc(1, sizeof *p);
  if (!p)
    return NULL;
  p->out = (struct mcp_out){.send = post_send, .hold = post_hold, .release = http_post_release};
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->cond, NULL);
  p->refs = 1;
  p->tail = &p->head;
  const union MHD_ConnectionInfo *i =
      c ? MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD) : NULL;
  p->fd = i ? i->connect_fd : -1;
  p->last_write = mono_ms();
  return p;
}

/* Waits for P's response, for its call to end without one (cancelled), or
 * for the client to go away (which cancels the call).  False: gone. */
bool http_post_wait(struct post_out *p) {
  pthread_mutex_lock(&p->lock);
  while (!p->done && p->refs > 1 && !http_abandoning()) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, POLL_MS);
    pthread_cond_timedwait(&p->cond, &p->lock, &ts);
    if (!p->done && peer_gone(p->fd))
      p->gone = true;
    if (p->gone)
      break;
  }
  bool gone = p->gone;
  pthread_mutex_unlock(&p->lock);
  if (gone)
    mcp_cancel_out(&p->out);
  return !gone;
}

/* ---- responses ---- */

enum MHD_Result http_queue(struct MHD_Connection *c, unsigned status, struct MHD_Response *r) {
  if (!r)
    return MHD_NO;
  enum MHD_Result ret = MHD_queue_response(c, status, r);
  MHD_destroy_response(r);
  return ret;
}

/* A JSON body: TEXT (malloc'd, taken; NULL: no body).  HNAME/HVAL: one more
 * header (or NULL). */
enum MHD_Result http_reply_text(struct MHD_Connection *c, unsigned status, char *text,
                                size_t len, const char *hname, const char *hval) {
  struct MHD_Response *r =
      text ? MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE)
           : MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
  if (!r) {
    free(text);
    return MHD_NO;
  }
  if (text)
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
  if (hname)
    MHD_add_response_header(r, hname, hval);
  return http_queue(c, status, r);
}

/* Answers with P's first message (the response) as the body. */
enum MHD_Result http_reply_post(struct MHD_Connection *c, struct post_out *p, unsigned status,
                                const char *hname, const char *hval) {
  pthread_mutex_lock(&p->lock);
  struct msg *q = p->head;
  char *text = q ? q->text : NULL;
  size_t len = q ? q->len : 0;
  if (q)
    q->text = NULL;
  pthread_mutex_unlock(&p->lock);
  return http_reply_text(c, status, text, len, hname, hval);
}

/* A JSON-RPC error as the body (ID may be NULL; DATA stolen). */
enum MHD_Result http_reply_error_data(struct MHD_Connection *c, unsigned status, json_t *id,
                                      int code, const char *msg, json_t *data,
                                      const char *hname, const char *hval) {
  struct post_out *p = http_post_new(NULL);
  if (!p) {
    json_decref(data);
    return MHD_NO;
  }
  mcp_send_error(&p->out, id, code, msg, data);
  enum MHD_Result r = http_reply_post(c, p, status, hname, hval);
  http_post_release(&p->out);
  return r;
}

enum MHD_Result http_reply_error(struct MHD_Connection *c, unsigned status, json_t *id,
                                 int code, const char *msg) {
  return http_reply_error_data(c, status, id, code, msg, NULL, NULL, NULL);
}

/* The HTTP status of a response with JSON-RPC error CODE (0: a result).
 * Tool errors are results (isError), so 200.  2026-07-28 gives the request
 * errors their statuses; before it, a JSON-RPC error is a 200 like any
 * answer, but a message that is not a request at all is a 400. */
unsigned http_status_of(int code, bool modern) {
  if (code == RPC_PARSE_ERROR || code == RPC_INVALID_REQUEST)
    return MHD_HTTP_BAD_REQUEST;
  if (!modern)
    return MHD_HTTP_OK;
  switch (code) {
  case RPC_METHOD_NOT_FOUND:
    return MHD_HTTP_NOT_FOUND;
  case RPC_INVALID_PARAMS:
  case RPC_UNSUPPORTED_VERSION:
  case RPC_HEADER_MISMATCH:
    return MHD_HTTP_BAD_REQUEST;
  case RPC_INTERNAL_ERROR:
    return MHD_HTTP_INTERNAL_SERVER_ERROR;
  default:
    return MHD_HTTP_OK;
  }
}

/* ---- SSE ---- */

static const char sse_pre[] = "event: message\ndata: ";
static const char sse_post[] = "\n\n";
static const char sse_keepalive[] = ":\n\n";

/* Copies what fits of the first message's event into BUF; drops it once
 * it is all out. */
static size_t sse_copy(struct post_out *p, char *buf, size_t max) {
  struct msg *q = p->head;
  size_t pre = sizeof sse_pre - 1, post = sizeof sse_post - 1;
  size_t total = pre + q->len + post, n = 0;
  while (n < max && q->off < total) {
    size_t off = q->off, chunk;
    if (off < pre) {
      chunk = MIN(pre - off, max - n);
      memcpy(buf + n, sse_pre + off, chunk);
    } else if (off < pre + q->len) {
      chunk = MIN(pre + q->len - off, max - n);
      memcpy(buf + n, q->text + (off - pre), chunk);
    } else {
      chunk = MIN(total - off, max - n);
      memcpy(buf + n, sse_post + (off - pre - q->len), chunk);
    }
    n += chunk;
    q->off += chunk;
  }
  if (q->off == total) {
    if (q->next || !p->done)
      p->queued -= q->len; /* a notification: the response is the last */
    p->head = q->next;
    if (!p->head)
      p->tail = &p->head;
    free(q->text);
    free(q);
  }
  return n;
}

/* Runs on the connection's thread and may block there: it waits for the
 * next message of the call, sends an SSE comment now and then so that no
 * idle timeout ends a quiet call, and ends the stream after the response. */
ssize_t http_sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
  (void)pos;
  struct post_out *p = cls;
  uint64_t keepalive = MIN(http_timeout_ms() / 2, 15000);
  pthread_mutex_lock(&p->lock);
  for (;;) {
    if (p->head) {
      size_t n = sse_copy(p, buf, max);
      p->last_write = mono_ms();
      pthread_mutex_unlock(&p->lock);
      return (ssize_t)n;
    }
    if (p->done || p->refs <= 1) {
      pthread_mutex_unlock(&p->lock);
      return MHD_CONTENT_READER_END_OF_STREAM;
    }
    if (p->gone || http_abandoning())
      break;
    struct timespec ts = timespec_in(CLOCK_REALTIME, POLL_MS);
    pthread_cond_timedwait(&p->cond, &p->lock, &ts);
    if (!p->head && !p->done && peer_gone(p->fd)) {
      p->gone = true;
      break;
    }
    if (!p->head && mono_ms() - p->last_write >= keepalive && max >= sizeof sse_keepalive) {
      p->last_write = mono_ms();
      pthread_mutex_unlock(&p->lock);
      memcpy(buf, sse_keepalive, sizeof sse_keepalive - 1);
      return (ssize_t)(sizeof sse_keepalive - 1);
    }
  }
  pthread_mutex_unlock(&p->lock);
  mcp_cancel_out(&p->out);
  return MHD_CONTENT_READER_END_WITH_ERROR;
}

/* The stream is over, whole or not: a call still running is cancelled
 * (the client closed the stream, or the connection broke). */
void http_sse_free(void *cls) {
  struct post_out *p = cls;
  pthread_mutex_lock(&p->lock);
  bool cancel = !p->done && p->refs > 1;
  p->gone = true;
  pthread_mutex_unlock(&p->lock);
  if (cancel)
    mcp_cancel_out(&p->out);
  http_post_release(&p->out);
}
