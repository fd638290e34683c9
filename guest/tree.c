/* tree.c: UNPACK and PACK, whole trees as tar streams (proto.h's flows).
 *
 * Each tree runs tar_unpack() or tar_pack() (common/tarstream.c) in a forked
 * child; the agent only moves bytes between the channel and the child's pipe,
 * non-blocking, so its loop never waits on a tar process however slow the
 * disk.  The child is not exec'd: the agent is single-threaded, so the child
 * may call anything, and the agent's binary is not on any path inside a
 * sandbox.  It closes every fd it does not need first (the channel, other
 * trees' pipes), so a tree sees EOF exactly when the agent closes its end.
 *
 * Flow control: for UNPACK the agent grants the host CREDIT as what it got
 * drains into the pipe, so at most TREE_WINDOW bytes wait in its buffer; for
 * PACK it reads the child's output only while the host has granted credit,
 * and the child blocks on a full pipe in between.
 *
 * The child writes its result (the report's TLV records, or ERRNO and
 * MESSAGE) to a memfd before it exits; the agent sends it on once it has
 * reaped the child (and, for UNPACK, got DATA_END; for PACK, read the output
 * to EOF).  KILL (or the host going away) tells the child to stop: SIGTERM
 * sets tar's cancel flag, and the agent closes its end of the pipe, so a
 * child blocked on it sees EOF or EPIPE; tar_unpack then removes its staging.
 * A child that has not ended TREE_KILL_GRACE_MS later is SIGKILLed.  An
 * UNPACK whose child put the tree in place before the KILL took effect is
 * answered OK, not cancelled: the host reports what happened. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/tarstream.h"
#include "common/util.h"
#include "guest/agent_core.h"
#include "guest/tree_int.h"

#define TREE_KILL_GRACE_MS 10000u
/* Grant the host more window once this much drained (or the buffer is empty). */
#define TREE_CREDIT_BATCH (TREE_WINDOW / 4u)
/* Chunks read from a PACK child per poll wake-up, so one tree cannot keep the
 * loop from the channel. */
#define TREE_READS_PER_WAKE 4u
#define TREE_SHUTDOWN_WAIT_MS 2000u

/* The child's fds after it has moved them. */
#define CHILD_DATA_FD 3
#define CHILD_RESULT_FD 4
#define CHILD_DIR_FD 5

static struct tree *tree_find(struct tree_state *ts, uint32_t id) {
  for (size_t i = 0; i < TREE_MAX; i++)
    if (ts->trees[i].kind != TREE_FREE && ts->trees[i].id == id)
      return &ts->trees[i];
  return NULL;
}

bool tree_id_busy(const struct tree_state *ts, uint32_t id) {
  for (size_t i = 0; i < TREE_MAX; i++)
    if (ts->trees[i].kind != TREE_FREE && ts->trees[i].id == id)
      return true;
  return false;
}

static void tree_close_data(struct tree *t) {
  if (t->fd >= 0)
    close(t->fd);
  t->fd = -1;
  t->buf_off = t->buf_len = 0;
}

static void tree_free(struct tree *t) {
  tree_close_data(t);
  if (t->result_fd >= 0)
    close(t->result_fd);
  free(t->buf);
  memset(t, 0, sizeof *t);
}

/* ---- the child ---------------------------------------------------------- */

static atomic_bool tree_child_cancelled;

static void tree_child_on_term(int sig) {
  (void)sig;
  atomic_store(&tree_child_cancelled, true);
}

/* The result: the report, or ERRNO and MESSAGE. */
static void tree_child_result(struct proto_buf *b, int r, const char *err,
                              const struct tar_report *rep) {
  if (r < 0) {
    proto_put_u32(b, TAG_ERRNO, (uint32_t)-r);
    char msg[2 * PATH_MAX];
    snprintf(msg, sizeof msg, "%s", err ? err : strerror(-r));
    proto_put_str(b, TAG_MESSAGE, msg);
    return;
  }
  proto_put_u64(b, TAG_FILES, rep->files);
  proto_put_u64(b, TAG_DIRS, rep->dirs);
  proto_put_u64(b, TAG_SYMLINKS, rep->symlinks);
  proto_put_u64(b, TAG_TREE_BYTES, rep->bytes);
  proto_put_u64(b, TAG_SKIPPED, rep->skipped);
  for (size_t i = 0; i < rep->n_listed && i < TAR_SKIPPED_LISTED; i++) {
    const char *p = rep->listed[i].path ? rep->listed[i].path : "";
    const char *why = rep->listed[i].reason ? rep->listed[i].reason : "";
    size_t pn = strlen(p), wn = strlen(why);
    proto_put_bytes(b, TAG_SKIP_PATH, p, pn < PROTO_MAX_SKIP_PATH ? pn : PROTO_MAX_SKIP_PATH);
    proto_put_bytes(b, TAG_SKIP_REASON, why,
                    wn < PROTO_MAX_SKIP_REASON ? wn : PROTO_MAX_SKIP_REASON);
  }
}

__attribute__((noreturn)) static void tree_child(enum tree_kind kind, int data_fd, int result_fd,
                                                 int dir_fd, const char *name,
                                                 const struct tar_limits *lim, pid_t parent) {
  /* In fd mode the agent is an ordinary process: die with it. */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent)
    _exit(1);
  struct sigaction term = {.sa_handler = tree_child_on_term};
  sigaction(SIGTERM, &term, NULL);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigprocmask(SIG_UNBLOCK, &set, NULL);
  /* Keep 0-2, the three fds of this tree at 3-5, and nothing else. */
  int fds[3] = {data_fd, result_fd, dir_fd};
  for (int i = 0; i < 3; i++) {
    fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 16);
    if (fds[i] < 0)
      _exit(1);
  }
  for (int i = 0; i < 3; i++)
    if (dup2(fds[i], CHILD_DATA_FD + i) < 0)
      _exit(1);
  close_range(CHILD_DIR_FD + 1, ~0u, 0);

  struct tar_report rep = {0};
  char *err = NULL;
  int r;
  if (kind == TREE_UNPACK)
    r = tar_unpack(CHILD_DATA_FD, CHILD_DIR_FD, name, lim, &tree_child_cancelled, &rep, &err);
  else
    r = tar_pack(CHILD_DIR_FD, name, name, CHILD_DATA_FD, lim, &tree_child_cancelled, &rep, &err);
  /* PACK: the end of the stream is the pipe's EOF. */
  close(CHILD_DATA_FD);
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_OK, 0);
  tree_child_result(&b, r, err, &rep);
  if (b.failed || proto_write_all(CHILD_RESULT_FD, b.data + PROTO_HEADER_SIZE,
                                  b.len - PROTO_HEADER_SIZE) < 0)
    _exit(2);
  _exit(r < 0 ? 1 : 0);
}

/* ---- starting ----------------------------------------------------------- */

struct tree_request {
  const uint8_t *path;
  uint32_t path_len;
  bool has_path, has_bytes, has_files;
  struct tar_limits lim;
  uint32_t window;
};

static int tree_parse(struct agent *a, uint32_t id, const char *req, const uint8_t *p, size_t n,
                      struct tree_request *ret) {
  struct tree_request r = {0};
  struct proto_tlv_iter it;
  uint16_t tag;
  const uint8_t *v;
  uint32_t len;
  int k;
  proto_tlv_init(&it, p, n);
  while ((k = proto_tlv_next(&it, &tag, &v, &len)) > 0) {
    switch (tag) {
    case TAG_PATH:
      r.path = v;
      r.path_len = len;
      r.has_path = true;
      break;
    case TAG_MAX_BYTES:
      if (agent_tlv_u64(a, id, req, "MAX_BYTES", v, len, &r.lim.max_bytes) < 0)
        return -EPROTO;
      r.has_bytes = true;
      break;
    case TAG_MAX_FILES:
      if (agent_tlv_u64(a, id, req, "MAX_FILES", v, len, &r.lim.max_files) < 0)
        return -EPROTO;
      r.has_files = true;
      break;
    case TAG_WINDOW:
      if (agent_tlv_u32(a, id, req, "WINDOW", v, len, &r.window) < 0)
        return -EPROTO;
      break;
    default:
      break;
    }
  }
  if (k < 0) {
    agent_send_error(a, id, EPROTO, "malformed %s request: a TLV record runs past the payload",
                     req);
    return -EPROTO;
  }
  if (!r.has_path || !r.has_bytes || !r.has_files) {
    agent_send_error(a, id, EPROTO, "malformed %s request: %s is missing", req,
                     !r.has_path ? "PATH" : !r.has_bytes ? "MAX_BYTES" : "MAX_FILES");
    return -EPROTO;
  }
  *ret = r;
  return 0;
}

/* mkdir -p of DIR. */
static int tree_mkdirs(const char *dir) {
  char buf[PATH_MAX];
  snprintf(buf, sizeof buf, "%s", dir);
  size_t n = strlen(buf);
  for (size_t i = 1; i <= n; i++) {
    if (buf[i] != '/' && buf[i] != '\0')
      continue;
    char c = buf[i];
    buf[i] = '\0';
    int r = mkdir(buf, 0755);
    int err = errno;
    buf[i] = c;
    if (r < 0 && err != EEXIST)
      return -err;
  }
  return 0;
}

/* Splits PATH (absolute) in place into its parent directory and last name,
 * trailing slashes dropped.  On failure sends the ERROR. */
static int tree_split(struct agent *a, uint32_t id, char *path, const char **ret_dir,
                      const char **ret_name) {
  size_t n = strlen(path);
  while (n > 1 && path[n - 1] == '/')
    path[--n] = '\0';
  char *slash = strrchr(path, '/');
  const char *name = slash + 1;
  if (!*name || !strcmp(name, ".") || !strcmp(name, "..")) {
    agent_send_error(a, id, EINVAL,
                     "'%s' names no file or directory of its own; give a path such as /work/src",
                     path);
    return -EINVAL;
  }
  *ret_dir = slash == path ? "/" : path;
  *slash = '\0';
  *ret_name = name;
  return 0;
}

static void tree_start(struct agent *a, const struct proto_header *h, const uint8_t *payload) {
  const bool unpack = h->type == PROTO_UNPACK;
  const char *req = proto_type_name(h->type);
  uint32_t id = h->id;
  struct tree_request r;
  char path[PATH_MAX], where[PATH_MAX];
  const char *dir, *name;
  _cleanup_close_ int dir_fd = -1, result_fd = -1, mine = -1, theirs = -1;
  uint8_t *buf = NULL;
  int p[2];

  if (agent_id_busy(a, id)) {
    agent_send_error(a, id, EEXIST, "request id %u is already in use by a running request", id);
    goto ignore;
  }
  if (tree_parse(a, id, req, payload, h->len, &r) < 0 ||
      agent_resolve_path(a, id, "path", r.path, r.path_len, path) < 0)
    goto ignore;
  if (!unpack && (r.window == 0 || r.window > TREE_WINDOW)) {
    agent_send_error(a, id, EPROTO, "malformed PACK request: WINDOW must be 1..%u, got %u",
                     TREE_WINDOW, r.window);
    return;
  }
  struct tree *t = NULL;
  for (size_t i = 0; i < TREE_MAX && !t; i++)
    if (agent_trees(a)->trees[i].kind == TREE_FREE)
      t = &agent_trees(a)->trees[i];
  if (!t) {
    agent_send_error(a, id, EAGAIN,
                     "too many tree copies in progress in this sandbox (%u at once); wait for "
                     "one to finish and try again",
                     TREE_MAX);
    goto ignore;
  }
  snprintf(where, sizeof where, "%s", path);
  if (tree_split(a, id, path, &dir, &name) < 0)
    goto ignore;
  if (unpack) {
    int k = tree_mkdirs(dir);
    if (k < 0) {
      agent_send_error(a, id, -k, "cannot create the parent directories of '%s': %s", where,
                       strerror(-k));
      goto ignore;
    }
  }
  dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) {
    int err = errno;
    if (err == ENOENT)
      agent_send_error(a, id, err, "'%s' does not exist in the sandbox", where);
    else
      agent_send_error(a, id, err, "cannot open the directory of '%s': %s", where, strerror(err));
    goto ignore;
  }
  if (!unpack) {
    struct stat st;
    if (fstatat(dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
      int err = errno;
      if (err == ENOENT)
        agent_send_error(a, id, err, "'%s' does not exist in the sandbox", where);
      else
        agent_send_error(a, id, err, "cannot copy '%s': %s", where, strerror(err));
      return;
    }
  }

  result_fd = memfd_create("ign-tree-result", MFD_CLOEXEC);
  if (result_fd < 0 || pipe2(p, O_CLOEXEC) < 0)
    goto fail;
  mine = unpack ? p[1] : p[0];
  theirs = unpack ? p[0] : p[1];
  if (fcntl(mine, F_SETFL, O_NONBLOCK) < 0)
    goto fail;
  /* Fewer wake-ups; the default size works too. */
  (void)fcntl(mine, F_SETPIPE_SZ, (int)TREE_WINDOW);
  if (unpack && !(buf = malloc(TREE_WINDOW))) {
    errno = ENOMEM;
    goto fail;
  }
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    free(buf);
    goto fail;
  }
  if (pid == 0)
    tree_child(unpack ? TREE_UNPACK : TREE_PACK, theirs, result_fd, dir_fd, name, &r.lim, parent);

  *t = (struct tree){
      .kind = unpack ? TREE_UNPACK : TREE_PACK,
      .id = id,
      .pid = pid,
      .fd = steal_fd(mine),
      .result_fd = steal_fd(result_fd),
      .buf = buf,
      .outstanding = unpack ? TREE_WINDOW : 0,
      .credit = unpack ? 0 : r.window,
  };
  snprintf(t->path, sizeof t->path, "%s", where);
  if (unpack) {
    struct proto_buf *out = agent_frame(a, PROTO_CREDIT, id);
    proto_put_u32(out, TAG_WINDOW, TREE_WINDOW);
    agent_send(a);
  }
  return;

fail:;
  int err = errno;
  agent_send_error(a, id, err, "cannot start copying '%s': %s", where, strerror(err));
ignore:
  if (unpack)
    agent_ignore_until(a, id, PROTO_DATA_END);
}

/* ---- ending ------------------------------------------------------------- */

/* The host broke the protocol for T: ERROR now, and the child is stopped. */
static void tree_refuse(struct agent *a, struct tree *t, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Tells the child to stop; it is reaped (or SIGKILLed) later. */
static void tree_stop(struct tree *t) {
  if (t->killed)
    return;
  t->killed = true;
  t->kill_deadline_ms = mono_ms() + TREE_KILL_GRACE_MS;
  if (t->pid > 0)
    kill(t->pid, SIGTERM);
  tree_close_data(t);
}

/* The child's result, read back from its memfd: 0 and the payload, or -1. */
static ssize_t tree_read_result(const struct tree *t, uint8_t *out, size_t max) {
  size_t got = 0;
  while (got < max) {
    ssize_t r = pread(t->result_fd, out + got, max - got, (off_t)got);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return -1;
    if (r == 0)
      break;
    got += (size_t)r;
  }
  return (ssize_t)got;
}

static void tree_refuse(struct agent *a, struct tree *t, const char *fmt, ...) {
  char msg[2 * PATH_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  agent_send_error(a, t->id, EPROTO, "%s", msg);
  t->answered = true;
  tree_stop(t);
}

/* Sends the terminal frame and frees the slot. */
static void tree_end(struct agent *a, struct tree *t) {
  static uint8_t result[PROTO_MAX_PAYLOAD - 64];
  uint32_t id = t->id;
  bool more_frames = t->kind == TREE_UNPACK && !t->got_end;
  ssize_t n = -1;
  if (WIFEXITED(t->status) && WEXITSTATUS(t->status) <= 1)
    n = tree_read_result(t, result, sizeof result);
  const uint8_t *v;
  uint32_t len, err = 0;
  int found = n >= 0 ? proto_find(result, (size_t)n, TAG_ERRNO, &v, &len) : -1;
  /* A KILL that came after the tar process put the tree in place (it had
   * passed its last look at the stop, or had exited and was not reaped
   * yet): the tree is there, and the answer says so. */
  bool in_place = t->kind == TREE_UNPACK && t->got_end && found == 0 &&
                  WEXITSTATUS(t->status) == 0;
  if (t->answered) {
    /* One terminal frame per request: it went with the protocol error. */
  } else if (t->killed && !in_place) {
    agent_send_error(a, id, ECANCELED, "copying '%s' was cancelled", t->path);
  } else if (n < 0 || found < 0) {
    if (WIFSIGNALED(t->status))
      agent_send_error(a, id, EIO, "copying '%s' failed: its tar process was killed by signal %d",
                       t->path, WTERMSIG(t->status));
    else
      agent_send_error(a, id, EIO, "copying '%s' failed: its tar process ended without a result",
                       t->path);
  } else if (found == 1) {
    if (proto_val_u32(v, len, &err) < 0 || err == 0 || err > 4095)
      err = EIO;
    const uint8_t *m;
    uint32_t mlen;
    if (proto_find(result, (size_t)n, TAG_MESSAGE, &m, &mlen) != 1)
      mlen = 0;
    agent_send_error(a, id, (int)err, "%.*s", (int)mlen, mlen ? (const char *)m : "");
  } else if (WEXITSTATUS(t->status) != 0) {
    agent_send_error(a, id, EIO, "copying '%s' failed", t->path);
  } else {
    struct proto_buf *out = agent_frame(a, t->kind == TREE_UNPACK ? PROTO_OK : PROTO_PACK_END, id);
    proto_put_raw(out, result, (size_t)n);
    proto_put_u64(out, TAG_BYTES, t->stream_bytes);
    agent_send(a);
  }
  if (more_frames)
    agent_ignore_until(a, id, PROTO_DATA_END);
  tree_free(t);
}

static bool tree_failed(const struct tree *t) {
  return t->killed || !WIFEXITED(t->status) || WEXITSTATUS(t->status) != 0;
}

/* Ends T if everything it waits for has happened. */
static void tree_advance(struct agent *a, struct tree *t) {
  if (t->kind == TREE_UNPACK && t->got_end && t->buf_len == 0 && t->fd >= 0 && !t->killed)
    close(steal_fd(t->fd)); /* the child reads EOF */
  if (t->pid != 0)
    return;
  if (tree_failed(t)) {
    tree_end(a, t);
    return;
  }
  /* Succeeded: an UNPACK waits for DATA_END (the stream's padding may come
   * after what tar read), a PACK for the rest of its output. */
  if (t->kind == TREE_UNPACK ? t->got_end : t->fd < 0)
    tree_end(a, t);
}

bool tree_reaped(struct agent *a, pid_t pid, int status) {
  for (size_t i = 0; i < TREE_MAX; i++) {
    struct tree *t = &agent_trees(a)->trees[i];
    if (t->kind == TREE_FREE || t->pid != pid)
      continue;
    t->pid = 0;
    t->status = status;
    if (t->kind == TREE_UNPACK) {
      /* Nothing reads the pipe any more: what is buffered is dropped and
       * handed back as window, so the host can finish sending. */
      t->uncredited += t->buf_len;
      tree_close_data(t);
    } else if (tree_failed(t)) {
      tree_close_data(t);
    }
    tree_advance(a, t);
    return true;
  }
  return false;
}

/* ---- moving bytes ------------------------------------------------------- */

static void tree_grant(struct agent *a, struct tree *t, bool force) {
  if (t->uncredited == 0 || (!force && t->uncredited < TREE_CREDIT_BATCH && t->buf_len > 0))
    return;
  struct proto_buf *out = agent_frame(a, PROTO_CREDIT, t->id);
  proto_put_u32(out, TAG_WINDOW, (uint32_t)t->uncredited);
  agent_send(a);
  t->outstanding += t->uncredited;
  t->uncredited = 0;
}

/* Writes what is buffered into the pipe until it is full. */
static void tree_flush(struct agent *a, struct tree *t) {
  while (t->fd >= 0 && t->buf_len > 0) {
    ssize_t w = write(t->fd, t->buf + t->buf_off, t->buf_len);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0 && errno == EAGAIN)
      break;
    if (w <= 0) {
      /* EPIPE: the child stopped reading (it failed, or tar had all it
       * needed); its exit says which. */
      t->uncredited += t->buf_len;
      tree_close_data(t);
      break;
    }
    t->buf_off += (size_t)w;
    t->buf_len -= (size_t)w;
    t->uncredited += (uint64_t)w;
  }
  if (t->buf_len == 0)
    t->buf_off = 0;
  tree_grant(a, t, false);
}

static void tree_data(struct agent *a, struct tree *t, const struct proto_header *h,
                      const uint8_t *p) {
  if (t->kind != TREE_UNPACK || t->got_end) {
    tree_refuse(a, t, "%s for id %u, which is not an UNPACK taking data",
                proto_type_name(h->type), t->id);
    return;
  }
  if (h->type == PROTO_DATA_END) {
    t->got_end = true;
    tree_advance(a, t);
    return;
  }
  if (h->len > t->outstanding) {
    tree_refuse(a, t, "the host sent %u bytes of data for '%s' with only %llu granted", h->len,
                t->path, (unsigned long long)t->outstanding);
    return;
  }
  t->outstanding -= h->len;
  t->stream_bytes += h->len;
  if (t->fd < 0) {
    /* Nothing reads it (the child ended or was stopped): dropped. */
    t->uncredited += h->len;
    tree_grant(a, t, true);
    return;
  }
  if (t->buf_off + t->buf_len + h->len > TREE_WINDOW) {
    memmove(t->buf, t->buf + t->buf_off, t->buf_len);
    t->buf_off = 0;
  }
  memcpy(t->buf + t->buf_off + t->buf_len, p, h->len);
  t->buf_len += h->len;
  tree_flush(a, t);
}

/* Reads the PACK child's output within the credit and sends it. */
static void tree_pump(struct agent *a, struct tree *t) {
  for (unsigned i = 0; i < TREE_READS_PER_WAKE && t->fd >= 0 && t->credit > 0 && agent_connected(a);
       i++) {
    size_t want = t->credit < PROTO_CHUNK ? (size_t)t->credit : PROTO_CHUNK;
    ssize_t r = read(t->fd, agent_chunk(a), want);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0 && errno == EAGAIN)
      return;
    if (r <= 0) {
      tree_close_data(t);
      tree_advance(a, t);
      return;
    }
    agent_send_data(a, PROTO_DATA, t->id, agent_chunk(a), (size_t)r);
    t->credit -= (uint64_t)r;
    t->stream_bytes += (uint64_t)r;
  }
}

static void tree_credit(struct agent *a, struct tree *t, const uint8_t *p, size_t n) {
  const uint8_t *v;
  uint32_t len, w;
  int k = proto_find(p, n, TAG_WINDOW, &v, &len);
  if (k != 1 || proto_val_u32(v, len, &w) < 0 || w == 0 || t->kind != TREE_PACK ||
      t->credit + w > 2ull * TREE_WINDOW) {
    tree_refuse(a, t,
                "malformed CREDIT for '%s': a WINDOW of 1..%u bytes for a PACK, within what it "
                "was sent",
                t->path, TREE_WINDOW);
    return;
  }
  t->credit += w;
}

void tree_handle(struct agent *a, const struct proto_header *h, const uint8_t *payload) {
  if (h->type == PROTO_UNPACK || h->type == PROTO_PACK) {
    tree_start(a, h, payload);
    return;
  }
  struct tree *t = tree_find(agent_trees(a), h->id);
  if (!t)
    return; /* a CREDIT that crossed the PACK's end */
  switch (h->type) {
  case PROTO_DATA:
  case PROTO_DATA_END:
    if (t->killed) {
      if (h->type == PROTO_DATA_END)
        t->got_end = true;
      return;
    }
    tree_data(a, t, h, payload);
    break;
  case PROTO_CREDIT:
    if (!t->killed)
      tree_credit(a, t, payload, h->len);
    break;
  case PROTO_KILL:
    tree_stop(t);
    if (t->pid == 0)
      tree_end(a, t);
    break;
  default:
    break;
  }
}

/* ---- the loop's hooks --------------------------------------------------- */

size_t tree_pollfds(const struct tree_state *ts, struct pollfd *pfd) {
  size_t n = 0;
  for (size_t i = 0; i < TREE_MAX; i++) {
    const struct tree *t = &ts->trees[i];
    if (t->kind == TREE_UNPACK && t->fd >= 0 && t->buf_len > 0)
      pfd[n++] = (struct pollfd){.fd = t->fd, .events = POLLOUT};
    else if (t->kind == TREE_PACK && t->fd >= 0 && t->credit > 0)
      pfd[n++] = (struct pollfd){.fd = t->fd, .events = POLLIN};
  }
  return n;
}

void tree_on_poll(struct agent *a, const struct pollfd *pfd, size_t n) {
  for (size_t k = 0; k < n; k++) {
    if (!pfd[k].revents)
      continue;
    for (size_t i = 0; i < TREE_MAX; i++) {
      struct tree *t = &agent_trees(a)->trees[i];
      if (t->kind == TREE_FREE || t->fd != pfd[k].fd)
        continue;
      if (t->kind == TREE_UNPACK) {
        tree_flush(a, t);
        tree_advance(a, t);
      } else {
        tree_pump(a, t);
      }
      break;
    }
  }
}

int tree_poll_timeout(const struct tree_state *ts) {
  uint64_t now = mono_ms(), next = UINT64_MAX;
  for (size_t i = 0; i < TREE_MAX; i++) {
    const struct tree *t = &ts->trees[i];
    if (t->kind == TREE_FREE || !t->killed || t->pid == 0)
      continue;
    if (t->kill_deadline_ms <= now)
      return 0;
    if (t->kill_deadline_ms - now < next)
      next = t->kill_deadline_ms - now;
  }
  return next == UINT64_MAX ? -1 : next > INT_MAX ? INT_MAX : (int)next;
}

void tree_check_timeouts(struct agent *a) {
  uint64_t now = mono_ms();
  for (size_t i = 0; i < TREE_MAX; i++) {
    struct tree *t = &agent_trees(a)->trees[i];
    if (t->kind == TREE_FREE || !t->killed || t->pid == 0 || now < t->kill_deadline_ms)
      continue;
    agent_log("the tar process of '%s' did not stop within %u ms; killing it (a staging "
              "directory next to it may be left)",
              t->path, TREE_KILL_GRACE_MS);
    kill(t->pid, SIGKILL);
    t->kill_deadline_ms = UINT64_MAX;
  }
}

void tree_cancel_all(struct agent *a) {
  for (size_t i = 0; i < TREE_MAX; i++) {
    struct tree *t = &agent_trees(a)->trees[i];
    if (t->kind == TREE_FREE)
      continue;
    tree_stop(t);
    /* Its answer would go to a host that no longer waits for it (and
     * whose ids start again).  A tree whose tar process was reaped
     * already gets no reaping to end it: it ends here. */
    t->got_end = true;
    t->answered = true;
    if (t->pid == 0)
      tree_end(a, t);
  }
}

void tree_shutdown(struct tree_state *ts) {
  bool any = false;
  for (size_t i = 0; i < TREE_MAX; i++) {
    struct tree *t = &ts->trees[i];
    if (t->kind != TREE_FREE && t->pid > 0) {
      tree_stop(t);
      any = true;
    }
  }
  /* A short wait lets tar_unpack remove its staging; then SIGKILL. */
  uint64_t deadline = mono_ms() + TREE_SHUTDOWN_WAIT_MS;
  while (any) {
    any = false;
    for (size_t i = 0; i < TREE_MAX; i++) {
      struct tree *t = &ts->trees[i];
      if (t->kind == TREE_FREE || t->pid <= 0)
        continue;
      int status;
      pid_t r = waitpid(t->pid, &status, WNOHANG);
      if (r == t->pid || (r < 0 && errno == ECHILD))
        t->pid = 0;
      else
        any = true;
    }
    if (!any)
      break;
    if (mono_ms() >= deadline) {
      for (size_t i = 0; i < TREE_MAX; i++) {
        struct tree *t = &ts->trees[i];
        if (t->kind != TREE_FREE && t->pid > 0) {
          kill(t->pid, SIGKILL);
          while (waitpid(t->pid, NULL, 0) < 0 && errno == EINTR)
            ;
          t->pid = 0;
        }
      }
      break;
    }
    usleep(10000);
  }
  for (size_t i = 0; i < TREE_MAX; i++)
    if (ts->trees[i].kind != TREE_FREE)
      tree_free(&ts->trees[i]);
}
