/* qmp.c: a minimal QMP client for the vm backend.
 *
 * QMP is newline-delimited JSON on a unix socket: a greeting, then
 * qmp_capabilities, then commands, each answered by {"return":...} or
 * {"error":...}, with asynchronous {"event":...} lines in between (skipped
 * here).  Every wait is bounded by a deadline so a stuck QEMU is an error,
 * never a hang.  File descriptors travel with getfd over SCM_RIGHTS. */
#include "sandbox/vm/qmp.h"

#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/util.h"

#define QMP_MAX_LINE (1u << 20)

struct qmp {
  int fd;
  char *buf;
  size_t len, cap;
};

static int wait_fd(int fd, short events, uint64_t deadline_ms) {
  for (;;) {
    uint64_t now = mono_ms();
    if (now >= deadline_ms)
      return -ETIMEDOUT;
    struct pollfd p = {.fd = fd, .events = events};
    int r = poll(&p, 1, (int)(deadline_ms - now));
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return -errno;
    if (r > 0)
      return 0;
  }
}

/* Reads one line into a NUL-terminated json value. */
static int read_json(struct qmp *q, uint64_t deadline_ms, json_t **ret) {
  for (;;) {
    char *nl = q->len ? memchr(q->buf, '\n', q->len) : NULL;
    if (nl) {
      size_t n = (size_t)(nl - q->buf);
      json_error_t e;
      json_t *j = json_loadb(q->buf, n, 0, &e);
      memmove(q->buf, nl + 1, q->len - n - 1);
      q->len -= n + 1;
      if (!j)
        return -EPROTO;
      *ret = j;
      return 0;
    }
    if (q->len >= QMP_MAX_LINE)
      return -EMSGSIZE;
    if (q->cap - q->len < 4096) {
      size_t cap = q->cap ? q->cap * 2 : 8192;
      char *b = realloc(q->buf, cap);
      if (!b)
        return -ENOMEM;
      q->buf = b;
      q->cap = cap;
    }
    int r = wait_fd(q->fd, POLLIN, deadline_ms);
    if (r < 0)
      return r;
    ssize_t n = read(q->fd, q->buf + q->len, q->cap - q->len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return -errno;
    if (n == 0)
      return -ECONNRESET;
    q->len += (size_t)n;
  }
}

static int send_line(struct qmp *q, json_t *msg, int fd_to_pass) {
  _cleanup_free_ char *s = json_dumps(msg, JSON_COMPACT);
  if (!s)
    return -ENOMEM;
  size_t n = strlen(s);
  s[n] = '\n';
  struct iovec iov = {.iov_base = s, .iov_len = n + 1};
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  if (fd_to_pass >= 0) {
    memset(&u, 0, sizeof u);
    mh.msg_control = u.buf;
    mh.msg_controllen = sizeof u.buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd_to_pass, sizeof(int));
  }
  for (;;) {
    ssize_t w = sendmsg(q->fd, &mh, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0)
      return -errno;
    if ((size_t)w != n + 1)
      return -EIO; /* a QMP command is far below the socket buffer */
    return 0;
  }
}

static int exec_cmd(struct qmp *q, const char *cmd, json_t *args, int fd_to_pass,
                    uint32_t timeout_ms, json_t **ret_result, char **ret_err) {
  json_t *msg = json_pack("{s:s}", "execute", cmd);
  if (args)
    json_object_set_new(msg, "arguments", args);
  int r = send_line(q, msg, fd_to_pass);
  json_decref(msg);
  if (r < 0) {
    *ret_err = xasprintf("QMP %s: sending failed: %s", cmd, strerror(-r));
    return r;
  }
  uint64_t deadline = mono_ms() + timeout_ms;
  for (;;) {
    json_t *j;
    r = read_json(q, deadline, &j);
    if (r < 0) {
      *ret_err = xasprintf("QMP %s: %s", cmd,
                           r == -ETIMEDOUT ? "QEMU did not answer in time" : strerror(-r));
      return r;
    }
    json_t *ret = json_object_get(j, "return");
    json_t *err = json_object_get(j, "error");
    if (ret) {
      if (ret_result)
        *ret_result = json_incref(ret);
      json_decref(j);
      return 0;
    }
    if (err) {
      const char *desc = json_string_value(json_object_get(err, "desc"));
      *ret_err = xasprintf("QMP %s failed: %s", cmd, desc ? desc : "unknown error");
      json_decref(j);
      return -EIO;
    }
    json_decref(j); /* an event */
  }
}

int qmp_connect(const char *path, uint32_t timeout_ms, struct qmp **ret, char **ret_err) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof sa.sun_path) {
    *ret_err = xasprintf("QMP socket path too long: %s", path);
    return -ENAMETOOLONG;
  }
  strcpy(sa.sun_path, path);
  uint64_t deadline = mono_ms() + timeout_ms;
  int fd = -1;
  /* QEMU creates the socket shortly after it starts: retry until then. */
  for (;;) {
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
      return -errno;
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0)
      break;
    int e = errno;
    close(fd);
    if ((e != ENOENT && e != ECONNREFUSED) || mono_ms() >= deadline) {
      *ret_err = xasprintf("cannot connect to QEMU's QMP socket %s: %s", path, strerror(e));
      return -e;
    }
    usleep(1000);
  }
  return qmp_open_fd(fd, (uint32_t)(deadline > mono_ms() ? deadline - mono_ms() : 1), ret, ret_err);
}

int qmp_open_fd(int fd, uint32_t timeout_ms, struct qmp **ret, char **ret_err) {
  uint64_t deadline = mono_ms() + timeout_ms;
  struct qmp *q = calloc(1, sizeof *q);
  if (!q) {
    close(fd);
    return -ENOMEM;
  }
  q->fd = fd;
  json_t *greeting;
  int r = read_json(q, deadline, &greeting);
  if (r < 0) {
    *ret_err = xasprintf("QEMU sent no QMP greeting: %s", strerror(-r));
    qmp_free(q);
    return r;
  }
  json_decref(greeting);
  r = exec_cmd(q, "qmp_capabilities", NULL, -1, timeout_ms, NULL, ret_err);
  if (r < 0) {
    qmp_free(q);
    return r;
  }
  *ret = q;
  return 0;
}

int qmp_command(struct qmp *q, const char *cmd, json_t *args, uint32_t timeout_ms,
                json_t **ret_result, char **ret_err) {
  return exec_cmd(q, cmd, args, -1, timeout_ms, ret_result, ret_err);
}

int qmp_getfd(struct qmp *q, int fd, const char *name, uint32_t timeout_ms, char **ret_err) {
  return exec_cmd(q, "getfd", json_pack("{s:s}", "fdname", name), fd, timeout_ms, NULL, ret_err);
}

int qmp_wait_migration(struct qmp *q, uint32_t timeout_ms, char **ret_err) {
  uint64_t deadline = mono_ms() + timeout_ms;
  for (;;) {
    json_t *res = NULL;
    int r = qmp_command(q, "query-migrate", NULL, timeout_ms, &res, ret_err);
    if (r < 0)
      return r;
    const char *status = json_string_value(json_object_get(res, "status"));
    bool done = status && strcmp(status, "completed") == 0;
    bool failed = status && (strcmp(status, "failed") == 0 || strcmp(status, "cancelled") == 0);
    if (failed) {
      const char *desc = json_string_value(json_object_get(res, "error-desc"));
      *ret_err = xasprintf("migration %s%s%s", status, desc ? ": " : "", desc ? desc : "");
    }
    json_decref(res);
    if (done)
      return 0;
    if (failed)
      return -EIO;
    if (mono_ms() >= deadline) {
      *ret_err = strdup("migration did not complete in time");
      return -ETIMEDOUT;
    }
    usleep(500);
  }
}

void qmp_free(struct qmp *q) {
  if (!q)
    return;
  close(q->fd);
  free(q->buf);
  free(q);
}
