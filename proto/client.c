/* client.c: host side of the agent protocol (see client.h and proto.h):
 * the connection, its life (open, HELLO, shutdown, free) and its reader.
 *
 * Reading: one reader thread reads frames, checks each against the request
 * it answers (type, every numeric field in range) and hands it to the
 * pending call with the same id; a frame that breaks the protocol ends the
 * connection.  Frames for ids nobody waits for any more (a cancelled call)
 * are dropped.
 *
 * Writing: calls never write to the socket themselves; they queue whole
 * frames and one writer thread puts them on the wire (client_writer.c).
 * Calls wait on a shared condition variable with a short tick so they can
 * notice cancellation, send progress and enforce a host-side deadline even if
 * the agent goes silent (client_call.c).
 *
 * The parts: this file the connection and the reader; client_writer.c the
 * frame queues and the writer; client_call.c a call's life (its id, the
 * wait, giving up, the checks on the agent's frames); client_request.c the
 * requests and their answers; client_tree.c the trees (UNPACK, PACK);
 * client_stream.c the streams and lookups; client_int.h what they share. */
#include "proto/client.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/util.h"
#include "proto/client_int.h"
#include "proto/proto.h"

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

/* ---- the reader ---------------------------------------------------------- */

/* The reader: every frame to its call (client_request_frame, client_tree.c)
 * or its stream (client_stream.c) until the connection ends or the agent
 * breaks the protocol. */
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
        bad = client_request_frame(c, &h, payload);
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

void agent_conn_set_exec_grace(struct agent_conn *c, uint32_t ms) {
  pthread_mutex_lock(&c->lock);
  c->exec_grace_ms = ms ? ms : 1;
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

int agent_conn_open(int fd, uint32_t timeout_ms, struct agent_conn **ret, char **ret_err) {
  return agent_conn_open_setup(fd, timeout_ms, NULL, ret, ret_err);
}

int agent_conn_open_setup(int fd, uint32_t timeout_ms, const struct agent_setup_req *setup,
                          struct agent_conn **ret, char **ret_err) {
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
  c->exec_grace_ms = AGENT_EXEC_GRACE_MS;
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
  if (pthread_create(&c->writer, NULL, client_writer_main, c) != 0) {
    client_set_err(ret_err, strdup("cannot start the agent writer thread"));
    agent_conn_free(c);
    return -EAGAIN;
  }
  c->writer_started = true;

  int r = client_hello(c, timeout_ms, setup, ret_err);
  if (r < 0) {
    agent_conn_free(c);
    return r;
  }
  *ret = c;
  return 0;
}

