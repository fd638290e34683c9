/* agent_client.h: a small synchronous client of the agent protocol, shared
 * by the agent's unit tests (test_agent.c, test_agent_ns.c).  It speaks to a
 * real ign-agent over a socket with proto/proto.c and nothing else, so the
 * tests need no server code.  Every receive has a timeout: a broken agent
 * fails a test instead of hanging it. */
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proto/proto.h"

#define AC_TIMEOUT_MS 10000

static uint8_t ac_payload[PROTO_MAX_PAYLOAD];

static inline uint64_t ac_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* The agent binary: IGN_AGENT, else IGN_TEST_AGENT (set by tests/run.sh),
 * else build/ign-agent from the top of the tree. */
static const char *ac_agent_path(void) {
  const char *p = getenv("IGN_AGENT");
  if (!p || !*p)
    p = getenv("IGN_TEST_AGENT");
  return p && *p ? p : "build/ign-agent";
}

/* ---- sending ------------------------------------------------------------ */

static int ac_send(int fd, struct proto_buf *b) {
  int r = proto_frame_finish(b);
  if (r == 0)
    r = proto_write_all(fd, b->data, b->len);
  proto_buf_free(b);
  return r;
}

static int ac_send_raw(int fd, uint8_t type, uint32_t id, const void *p, size_t n) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, (enum proto_type)type, id);
  proto_put_raw(&b, p, n);
  return ac_send(fd, &b);
}

/* ---- receiving ---------------------------------------------------------- */

/* Next frame into ac_payload; -ETIMEDOUT if none within TIMEOUT_MS. */
static int ac_recv(int fd, struct proto_header *h, int timeout_ms) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  int r;
  do
    r = poll(&p, 1, timeout_ms);
  while (r < 0 && errno == EINTR);
  if (r < 0)
    return -errno;
  if (r == 0)
    return -ETIMEDOUT;
  return proto_read_frame(fd, h, ac_payload);
}

static bool ac_find(const uint8_t *p, size_t n, uint16_t tag, const uint8_t **v, uint32_t *len) {
  return proto_find(p, n, tag, v, len) == 1;
}

static uint32_t ac_u32(const uint8_t *p, size_t n, uint16_t tag, uint32_t dflt) {
  const uint8_t *v;
  uint32_t len, x;
  return ac_find(p, n, tag, &v, &len) && proto_val_u32(v, len, &x) == 0 ? x : dflt;
}

static uint64_t ac_u64(const uint8_t *p, size_t n, uint16_t tag, uint64_t dflt) {
  const uint8_t *v;
  uint32_t len;
  uint64_t x;
  return ac_find(p, n, tag, &v, &len) && proto_val_u64(v, len, &x) == 0 ? x : dflt;
}

static void ac_str(const uint8_t *p, size_t n, uint16_t tag, char *buf, size_t size) {
  const uint8_t *v;
  uint32_t len;
  buf[0] = '\0';
  if (ac_find(p, n, tag, &v, &len))
    snprintf(buf, size, "%.*s", (int)len, (const char *)v);
}

/* ---- results ------------------------------------------------------------ */

struct ac_bytes {
  uint8_t *data;
  size_t len, cap;
};

static void ac_bytes_add(struct ac_bytes *b, const void *p, size_t n) {
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + n)
      cap *= 2;
    b->data = realloc(b->data, cap);
    if (!b->data)
      abort();
    b->cap = cap;
  }
  memcpy(b->data + b->len, p, n);
  b->len += n;
}

/* Everything the agent said about one request. */
struct ac_result {
  struct ac_bytes out, err, data; /* STDOUT, STDERR, DATA */
  uint8_t terminal;               /* EXIT, OK, READ_END, ERROR, 0 if none */
  uint32_t exit_code, signal, timed_out;
  uint64_t duration_us, size, bytes;
  uint32_t eof;
  uint32_t error; /* ERRNO of an ERROR */
  char message[1024];
  uint64_t elapsed_ms;
};

static void ac_result_free(struct ac_result *r) {
  free(r->out.data);
  free(r->err.data);
  free(r->data.data);
  memset(r, 0, sizeof *r);
}

/* Fold one frame into R; returns true when it was the terminal frame. */
static bool ac_result_take(struct ac_result *r, const struct proto_header *h, const uint8_t *p) {
  switch (h->type) {
  case PROTO_STDOUT:
    ac_bytes_add(&r->out, p, h->len);
    return false;
  case PROTO_STDERR:
    ac_bytes_add(&r->err, p, h->len);
    return false;
  case PROTO_DATA:
    ac_bytes_add(&r->data, p, h->len);
    return false;
  case PROTO_EXIT:
    r->exit_code = ac_u32(p, h->len, TAG_EXIT_CODE, 12345);
    r->signal = ac_u32(p, h->len, TAG_SIGNAL, 12345);
    r->timed_out = ac_u32(p, h->len, TAG_TIMED_OUT, 12345);
    r->duration_us = ac_u64(p, h->len, TAG_DURATION_US, 0);
    break;
  case PROTO_OK:
    r->size = ac_u64(p, h->len, TAG_SIZE, UINT64_MAX);
    break;
  case PROTO_READ_END:
    r->size = ac_u64(p, h->len, TAG_SIZE, UINT64_MAX);
    r->eof = ac_u32(p, h->len, TAG_EOF, 12345);
    r->bytes = ac_u64(p, h->len, TAG_BYTES, UINT64_MAX);
    break;
  case PROTO_ERROR:
    r->error = ac_u32(p, h->len, TAG_ERRNO, 0);
    ac_str(p, h->len, TAG_MESSAGE, r->message, sizeof r->message);
    break;
  default:
    break; /* HELLO_OK, PONG: terminal with nothing to keep */
  }
  r->terminal = h->type;
  return true;
}

/* Collect frames of request ID up to its terminal frame.  A frame for any
 * other id is an error here (tests that multiplex read frames themselves). */
static int ac_collect(int fd, uint32_t id, struct ac_result *r) {
  uint64_t start = ac_now_ms();
  for (;;) {
    struct proto_header h;
    int k = ac_recv(fd, &h, AC_TIMEOUT_MS);
    if (k < 0) {
      fprintf(stderr, "  waiting for id %u: %s\n", id, strerror(-k));
      return k;
    }
    if (h.id != id) {
      fprintf(stderr, "  unexpected frame type %u for id %u while waiting for id %u\n", h.type,
              h.id, id);
      return -EPROTO;
    }
    if (ac_result_take(r, &h, ac_payload))
      break;
  }
  r->elapsed_ms = ac_now_ms() - start;
  return 0;
}

/* ---- requests ----------------------------------------------------------- */

struct ac_exec {
  const char *command;
  const char *cwd;         /* NULL: default */
  const char *const *env;  /* NULL-terminated, or NULL */
  uint32_t timeout_ms;
  bool has_stdin;
  const void *stdin_data;
  size_t stdin_len;
};

static int ac_send_exec(int fd, uint32_t id, const struct ac_exec *e) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_EXEC, id);
  proto_put_str(&b, TAG_COMMAND, e->command);
  if (e->cwd)
    proto_put_str(&b, TAG_CWD, e->cwd);
  for (const char *const *p = e->env; p && *p; p++)
    proto_put_str(&b, TAG_ENV, *p);
  proto_put_u32(&b, TAG_TIMEOUT_MS, e->timeout_ms);
  proto_put_u32(&b, TAG_HAS_STDIN, e->has_stdin);
  int r = ac_send(fd, &b);
  if (r < 0 || !e->has_stdin)
    return r;
  /* Stdin in uneven pieces, to exercise reassembly. */
  const uint8_t *d = e->stdin_data;
  size_t left = e->stdin_len, piece = 1000;
  while (left > 0) {
    size_t n = left < piece ? left : piece;
    if ((r = ac_send_raw(fd, PROTO_STDIN, id, d, n)) < 0)
      return r;
    d += n;
    left -= n;
    piece = piece * 7 > PROTO_CHUNK ? PROTO_CHUNK : piece * 7;
  }
  return ac_send_raw(fd, PROTO_STDIN_END, id, NULL, 0);
}

static int ac_run(int fd, uint32_t id, const struct ac_exec *e, struct ac_result *r) {
  uint64_t start = ac_now_ms();
  int k = ac_send_exec(fd, id, e);
  if (k == 0)
    k = ac_collect(fd, id, r);
  r->elapsed_ms = ac_now_ms() - start;
  return k;
}

/* Run a shell command with defaults; R holds the result. */
static int ac_sh(int fd, uint32_t id, const char *command, struct ac_result *r) {
  struct ac_exec e = {.command = command};
  return ac_run(fd, id, &e, r);
}

static int ac_write_file(int fd, uint32_t id, const char *path, uint32_t mode, const void *data,
                         size_t len, struct ac_result *r) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_WRITE, id);
  proto_put_str(&b, TAG_PATH, path);
  proto_put_u32(&b, TAG_MODE, mode);
  proto_put_u64(&b, TAG_SIZE, len);
  int k = ac_send(fd, &b);
  const uint8_t *d = data;
  for (size_t off = 0; k == 0 && off < len; off += PROTO_CHUNK)
    k = ac_send_raw(fd, PROTO_DATA, id, d + off, len - off < PROTO_CHUNK ? len - off : PROTO_CHUNK);
  if (k == 0)
    k = ac_send_raw(fd, PROTO_DATA_END, id, NULL, 0);
  if (k == 0)
    k = ac_collect(fd, id, r);
  return k;
}

static int ac_read_file(int fd, uint32_t id, const char *path, uint64_t offset, uint64_t max,
                        struct ac_result *r) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_READ, id);
  proto_put_str(&b, TAG_PATH, path);
  proto_put_u64(&b, TAG_OFFSET, offset);
  proto_put_u64(&b, TAG_MAX, max);
  int k = ac_send(fd, &b);
  if (k == 0)
    k = ac_collect(fd, id, r);
  return k;
}

static int ac_hello(int fd, uint32_t id, uint32_t version, struct ac_result *r, char *info,
                    size_t info_size) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_HELLO, id);
  proto_put_u32(&b, TAG_VERSION, version);
  int k = ac_send(fd, &b);
  struct proto_header h;
  if (k == 0)
    k = ac_recv(fd, &h, AC_TIMEOUT_MS);
  if (k < 0)
    return k;
  if (h.id != id)
    return -EPROTO;
  if (info)
    ac_str(ac_payload, h.len, TAG_INFO, info, info_size);
  ac_result_take(r, &h, ac_payload);
  return 0;
}

/* HELLO carrying one of SETUP's string TLVs (TAG = VALUE); R holds the answer. */
static int ac_hello_with(int fd, uint32_t id, uint16_t tag, const char *value,
                         struct ac_result *r) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_HELLO, id);
  proto_put_u32(&b, TAG_VERSION, PROTO_VERSION);
  proto_put_str(&b, tag, value);
  int k = ac_send(fd, &b);
  return k < 0 ? k : ac_collect(fd, id, r);
}

/* An empty SETUP (nothing to set), answered OK: what lets an agent whose
 * last SETUP failed serve requests again. */
static bool ac_empty_setup_ok(int fd, uint32_t id) {
  struct ac_result r = {0};
  bool ok = ac_send_raw(fd, PROTO_SETUP, id, NULL, 0) == 0 && ac_collect(fd, id, &r) == 0 &&
            r.terminal == PROTO_OK;
  ac_result_free(&r);
  return ok;
}

/* PING and expect PONG as the very next frame: proves that the agent is
 * alive and sent nothing stray before it. */
static bool ac_ping_ok(int fd, uint32_t id) {
  struct proto_header h;
  if (ac_send_raw(fd, PROTO_PING, id, NULL, 0) < 0 || ac_recv(fd, &h, AC_TIMEOUT_MS) < 0)
    return false;
  if (h.type != PROTO_PONG || h.id != id) {
    fprintf(stderr, "  expected PONG id %u, got type %u id %u\n", id, h.type, h.id);
    return false;
  }
  return true;
}

/* Wait for PID to exit within TIMEOUT_MS; its wait status, or -1 (then it
 * has been killed and reaped). */
static int ac_wait_exit(pid_t pid, int timeout_ms) {
  uint64_t end = ac_now_ms() + (uint64_t)timeout_ms;
  int status;
  while (ac_now_ms() < end) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid)
      return status;
    if (r < 0)
      return -1;
    usleep(10000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

/* Whether PID is gone or a zombie (killed, not yet reaped by its parent). */
static bool ac_pid_dead(pid_t pid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f)
    return true;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *paren = strrchr(buf, ')');
  return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}
