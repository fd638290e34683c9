/* runlog.c: the complete stdout and stderr of each run, on the host.
 *
 * The tap runs on a connection's reader thread, so it only copies bytes into
 * a bounded in-memory queue (QUEUE_MAX in all, LOG_QUEUE_MAX per log); one
 * writer thread drains the queue into the files.  A disk slower than the
 * output therefore never slows the run: what does not fit is dropped, and a
 * marker in the file and log_error in the result say how much.  Bytes past
 * the cap are counted, never queued.  A write error (ENOSPC, EIO) stops that
 * log and is reported in the result.
 *
 * Every open log holds an exclusive flock, and the pruner (on the writer
 * thread, now and then) removes only the files it can lock itself: a log
 * still being written, by this server or another one sharing the directory,
 * is never removed.  The directory is checked before use: ours, not a link,
 * not writable by anyone else. */
#include "common/runlog.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fs.h"
#include "common/log.h"
#include "common/util.h"

#define QUEUE_MAX (64u << 20)     /* bytes queued for all logs together */
#define LOG_QUEUE_MAX (32u << 20) /* bytes queued for one log */
#define CHUNK_SIZE (256u << 10)
#define SPARE_MAX 16u             /* written chunks kept for reuse (4 MiB) */
#define CLOSE_WAIT_MS 5000u       /* how long closing waits for queued bytes */
#define PRUNE_EVERY_MS 60000u
#define MAX_NAME_TRIES 1000

struct chunk {
  struct chunk *next;
  size_t len, cap;
  char data[];
};

struct runlog {
  int fd;
  int stream;                 /* 1 stdout, 2 stderr */
  char *path;
  struct chunk *head, *tail;  /* queued, not yet written */
  struct runlog *work_next;   /* in the writer's list while it has chunks */
  bool in_work;
  bool busy;                  /* the writer is writing a chunk of it */
  bool detached;              /* closed before its bytes were written: the writer frees it */
  size_t queued;              /* bytes in head..tail */
  uint64_t total;             /* bytes the run wrote */
  uint64_t written;           /* bytes that reached the file */
  uint64_t dropped;           /* bytes the queue had no room for */
  uint64_t drop_pending;      /* dropped since the last marker */
  uint64_t lost;              /* bytes thrown away after a write error */
  int werr;                   /* the first write error (positive errno) */
};

static struct {
  pthread_mutex_t lock;
  pthread_cond_t wake;        /* the writer: work, a prune, stop */
  pthread_cond_t done;        /* closers: a chunk was written */
  pthread_t thread;
  bool started, stop, prune_due, hold;
  char *dir;
  int dirfd;                  /* -1 until the directory is made and checked */
  size_t cap;
  uint64_t keep_bytes;
  unsigned keep_days;
  size_t queued;
  struct runlog *work_head, *work_tail;
  uint64_t last_prune_ms;
  uint64_t written_since_prune;
  uint64_t seq;
  /* Chunks of CHUNK_SIZE already written, kept for the next bytes: a long
   * output cycles through a few chunks instead of allocating and freeing
   * one per 256 KiB, which an allocator need not give back. */
  struct chunk *spare;
  unsigned n_spare;
} rl = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER,
        .done = PTHREAD_COND_INITIALIZER, .dirfd = -1};

/* ---- the directory ---- */

/* Makes and checks the directory; under rl.lock.  0, or -errno with *ret_err. */
static int dir_ready_locked(char **ret_err) {
  if (rl.dirfd >= 0)
    return 0;
  int r = fs_mkdir_p(rl.dir, 0700, 0700);
  if (r < 0) {
    *ret_err = xasprintf("cannot create the log directory %s: %s; set IGN_MCP_LOG_DIR to a "
                         "directory you own", rl.dir, strerror(-r));
    return r;
  }
  int fd = open(rl.dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (fd < 0 && (errno == ELOOP || errno == ENOTDIR) && lstat(rl.dir, &st) == 0 &&
      S_ISLNK(st.st_mode)) {
    *ret_err = xasprintf("the log directory %s is a symbolic link, which is refused (another "
                         "user could point it elsewhere); set IGN_MCP_LOG_DIR to a real directory",
                         rl.dir);
    return -ELOOP;
  }
  if (fd < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot open the log directory %s: %s; set IGN_MCP_LOG_DIR to a "
                         "directory you own", rl.dir, strerror(errno));
    return r;
  }
  if (fstat(fd, &st) < 0 || st.st_uid != geteuid() || (st.st_mode & 022)) {
    *ret_err = xasprintf("the log directory %s is refused: it must belong to uid %u and not be "
                         "writable by group or others (it is uid %u, mode %04o); fix it with "
                         "chmod 700, or set IGN_MCP_LOG_DIR",
                         rl.dir, (unsigned)geteuid(), (unsigned)st.st_uid,
                         (unsigned)(st.st_mode & 07777));
    close(fd);
    return -EPERM;
  }
  rl.dirfd = fd;
  rl.prune_due = true;
  pthread_cond_signal(&rl.wake);
  return 0;
}

/* ---- pruning ---- */

struct entry {
  char *name;
  time_t mtime;
  off_t size;
};

static int by_mtime(const void *a, const void *b) {
  const struct entry *x = a, *y = b;
  return (x->mtime > y->mtime) - (x->mtime < y->mtime);
}

static bool is_log_name(const char *n) {
  size_t len = strlen(n);
  return n[0] != '.' && ((len > 7 && strcmp(n + len - 7, ".stdout") == 0) ||
                         (len > 7 && strcmp(n + len - 7, ".stderr") == 0) ||
                         (len > 7 && strcmp(n + len - 7, ".serial") == 0) ||
                         (len > 13 && strcmp(n + len - 13, ".egress.jsonl") == 0));
}

/* Removes NAME if no one holds it open (its flock).  Returns true if it went. */
static bool remove_unlocked(int dfd, const char *name, const struct stat *seen) {
  _cleanup_close_ int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) < 0 || st.st_ino != seen->st_ino || st.st_dev != seen->st_dev)
    return false;
  if (flock(fd, LOCK_EX | LOCK_NB) < 0)
    return false; /* open: a run is still writing it */
  return unlinkat(dfd, name, 0) == 0;
}

/* Oldest first: every log older than keep_days, then more until all of them
 * together fit keep_bytes.  0 for either means no such limit.  One pruner at
 * a time (a flock on the directory): two that counted the same total would
 * remove twice what is needed.  WAIT: for the one running, else skip. */
static void prune(int dfd, uint64_t keep_bytes, unsigned keep_days, bool wait) {
  if (!keep_bytes && !keep_days)
    return;
  int own_fd = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (own_fd >= 0 && flock(own_fd, LOCK_EX | (wait ? 0 : LOCK_NB)) < 0) {
    close(own_fd);
    return;
  }
  DIR *d = own_fd >= 0 ? fdopendir(own_fd) : NULL;
  if (!d) {
    if (own_fd >= 0)
      close(own_fd);
    return;
  }
  struct entry *e = NULL;
  size_t n = 0, cap = 0;
  struct dirent *de;
  while ((de = readdir(d))) {
    struct stat st;
    if (!is_log_name(de->d_name) || fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 ||
        !S_ISREG(st.st_mode))
      continue;
    if (n == cap) {
      size_t nc = cap ? 2 * cap : 256;
      struct entry *ne = realloc(e, nc * sizeof *e);
      if (!ne)
        break;
      e = ne;
      cap = nc;
    }
    e[n].name = strdup(de->d_name);
    if (!e[n].name)
      break;
    e[n].mtime = st.st_mtime;
    e[n].size = st.st_size;
    n++;
  }
  if (n > 1)
    qsort(e, n, sizeof *e, by_mtime);
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++)
    total += (uint64_t)e[i].size;
  time_t cutoff = keep_days ? time(NULL) - (time_t)keep_days * 86400 : 0;
  size_t removed = 0;
  for (size_t i = 0; i < n; i++) {
    bool old = keep_days && e[i].mtime < cutoff;
    bool over = keep_bytes && total > keep_bytes;
    if (!old && !over)
      continue;
    struct stat st;
    if (fstatat(dfd, e[i].name, &st, AT_SYMLINK_NOFOLLOW) == 0 && remove_unlocked(dfd, e[i].name, &st)) {
      total -= (uint64_t)e[i].size;
      removed++;
    }
  }
  closedir(d); /* and the pruner's flock with it */
  for (size_t i = 0; i < n; i++)
    free(e[i].name);
  free(e);
  if (removed)
    log_debug("logs: removed %zu old logs (IGN_MCP_LOG_KEEP_DAYS, IGN_MCP_LOG_KEEP_MB)", removed);
}

/* ---- the writer ---- */

/* Under rl.lock. */
static struct chunk *chunk_new_locked(size_t cap) {
  struct chunk *c;
  if (cap == CHUNK_SIZE && rl.spare) {
    c = rl.spare;
    rl.spare = c->next;
    rl.n_spare--;
  } else if (!(c = malloc(sizeof *c + cap)))
    return NULL;
  c->next = NULL;
  c->len = 0;
  c->cap = cap;
  return c;
}

/* Under rl.lock. */
static void chunk_release_locked(struct chunk *c) {
  if (c->cap == CHUNK_SIZE && rl.n_spare < SPARE_MAX && !rl.stop) {
    c->next = rl.spare;
    rl.spare = c;
    rl.n_spare++;
  } else {
    free(c);
  }
}

static void chunks_free(struct chunk *c) {
  while (c) {
    struct chunk *next = c->next;
    chunk_release_locked(c);
    c = next;
  }
}

static void log_free(struct runlog *l) {
  if (l->fd >= 0)
    close(l->fd); /* and its flock with it */
  chunks_free(l->head);
  free(l->path);
  free(l);
}

static void work_push_locked(struct runlog *l) {
  if (l->in_work)
    return;
  l->in_work = true;
  l->work_next = NULL;
  if (rl.work_tail)
    rl.work_tail->work_next = l;
  else
    rl.work_head = l;
  rl.work_tail = l;
  pthread_cond_signal(&rl.wake);
}

static struct runlog *work_pop_locked(void) {
  struct runlog *l = rl.work_head;
  rl.work_head = l->work_next;
  if (!rl.work_head)
    rl.work_tail = NULL;
  l->in_work = false;
  return l;
}

/* Writes all of C; 0 or a positive errno. */
static int write_chunk(int fd, const struct chunk *c, size_t *ret_done) {
  size_t off = 0;
  while (off < c->len) {
    ssize_t w = write(fd, c->data + off, c->len - off);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0) {
      *ret_done = off;
      return w < 0 ? errno : EIO;
    }
    off += (size_t)w;
  }
  *ret_done = off;
  return 0;
}

static void *writer_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&rl.lock);
  for (;;) {
    while (!rl.stop && (rl.hold || !rl.work_head) && !rl.prune_due)
      pthread_cond_wait(&rl.wake, &rl.lock);
    if (rl.work_head && !rl.hold) {
      struct runlog *l = work_pop_locked();
      struct chunk *c = l->head;
      l->head = c->next;
      if (!l->head)
        l->tail = NULL;
      else
        work_push_locked(l); /* one chunk per turn: logs share the disk fairly */
      l->busy = true;
      int fd = l->fd;
      bool failed = l->werr != 0;
      pthread_mutex_unlock(&rl.lock);
      size_t done = 0;
      int err = failed ? 0 : write_chunk(fd, c, &done);
      pthread_mutex_lock(&rl.lock);
      l->busy = false;
      l->queued -= c->len;
      rl.queued -= c->len;
      if (!failed) {
        l->written += done;
        rl.written_since_prune += done;
      }
      if (failed || err) {
        if (!l->werr)
          l->werr = err;
        l->lost += c->len - done;
      }
      chunk_release_locked(c);
      if (l->detached && !l->head)
        log_free(l);
      pthread_cond_broadcast(&rl.done);
      continue;
    }
    if (rl.prune_due && rl.dirfd >= 0) {
      rl.prune_due = false;
      rl.last_prune_ms = mono_ms();
      rl.written_since_prune = 0;
      int dfd = rl.dirfd;
      uint64_t keep = rl.keep_bytes;
      unsigned days = rl.keep_days;
      pthread_mutex_unlock(&rl.lock);
      prune(dfd, keep, days, false);
      pthread_mutex_lock(&rl.lock);
      continue;
    }
    rl.prune_due = false;
    if (rl.stop)
      break;
  }
  pthread_mutex_unlock(&rl.lock);
  return NULL;
}

/* Appends LEN bytes to L's queue; under rl.lock.  FORCE: past the limits
 * (the markers, which are short). */
static bool queue_locked(struct runlog *l, const void *data, size_t len, bool force) {
  if (!force && (rl.queued + len > QUEUE_MAX || l->queued + len > LOG_QUEUE_MAX))
    return false;
  if (l->werr) {
    l->lost += len;
    return true;
  }
  const char *d = data;
  while (len) {
    struct chunk *t = l->tail;
    if (!t || t->len == t->cap) {
      t = chunk_new_locked(len > CHUNK_SIZE ? len : CHUNK_SIZE);
      if (!t)
        return false;
      if (l->tail)
        l->tail->next = t;
      else
        l->head = t;
      l->tail = t;
    }
    size_t n = t->cap - t->len < len ? t->cap - t->len : len;
    memcpy(t->data + t->len, d, n);
    t->len += n;
    l->queued += n;
    rl.queued += n;
    d += n;
    len -= n;
  }
  work_push_locked(l);
  return true;
}

static void queue_drop_marker_locked(struct runlog *l) {
  char m[160];
  int n = snprintf(m, sizeof m,
                   "\n[ignition-mcp: %" PRIu64 " bytes dropped here: the log writer fell behind]\n",
                   l->drop_pending);
  queue_locked(l, m, (size_t)n, true);
  l->drop_pending = 0;
}

void runlog_tap(void *ctx, int stream, const void *data, size_t len) {
  struct runlog **logs = ctx;
  if (!logs || (stream != 1 && stream != 2) || !logs[stream - 1] || !len)
    return;
  struct runlog *l = logs[stream - 1];
  pthread_mutex_lock(&rl.lock);
  uint64_t before = l->total;
  l->total += len;
  if (before < rl.cap) {
    size_t n = rl.cap - before < len ? (size_t)(rl.cap - before) : len;
    /* Room again after a drop: the marker first, where the gap is. */
    if (l->drop_pending && rl.queued + n <= QUEUE_MAX && l->queued + n <= LOG_QUEUE_MAX)
      queue_drop_marker_locked(l);
    if (!queue_locked(l, data, n, false)) {
      l->dropped += n;
      l->drop_pending += n;
    }
  }
  pthread_mutex_unlock(&rl.lock);
}

/* ---- the interface ---- */

void runlog_test_hold_writer(bool hold);
void runlog_test_prune(void);

/* Tests: a writer that takes nothing (a stalled disk). */
void runlog_test_hold_writer(bool hold) {
  pthread_mutex_lock(&rl.lock);
  rl.hold = hold;
  pthread_cond_broadcast(&rl.wake);
  pthread_mutex_unlock(&rl.lock);
}

/* Tests: prune now, on this thread. */
void runlog_test_prune(void) {
  pthread_mutex_lock(&rl.lock);
  int dfd = rl.dirfd;
  pthread_mutex_unlock(&rl.lock);
  if (dfd >= 0)
    prune(dfd, rl.keep_bytes, rl.keep_days, true);
}

int runlog_init(const char *dir, size_t cap, uint64_t keep_bytes, unsigned keep_days,
                char **ret_err) {
  pthread_mutex_lock(&rl.lock);
  if (rl.started) {
    pthread_mutex_unlock(&rl.lock);
    *ret_err = strdup("the logs are set up already");
    return -EALREADY;
  }
  free(rl.dir);
  rl.dir = strdup(dir);
  rl.cap = cap;
  rl.keep_bytes = keep_bytes;
  rl.keep_days = keep_days;
  rl.stop = rl.hold = rl.prune_due = false;
  rl.seq = 0;
  rl.last_prune_ms = mono_ms();
  int r = pthread_create(&rl.thread, NULL, writer_main, NULL);
  if (r) {
    pthread_mutex_unlock(&rl.lock);
    *ret_err = xasprintf("cannot start the log writer: %s", strerror(r));
    return -r;
  }
  rl.started = true;
  /* An existing directory is checked now, so that a bad one is reported
   * at startup; a missing one is made with the first log. */
  struct stat st;
  r = 0;
  if (cap && lstat(dir, &st) == 0)
    r = dir_ready_locked(ret_err);
  pthread_mutex_unlock(&rl.lock);
  return r;
}

void runlog_shutdown(void) {
  pthread_mutex_lock(&rl.lock);
  if (!rl.started) {
    pthread_mutex_unlock(&rl.lock);
    return;
  }
  rl.stop = true;
  rl.hold = false;
  pthread_cond_broadcast(&rl.wake);
  pthread_mutex_unlock(&rl.lock);
  pthread_join(rl.thread, NULL);
  pthread_mutex_lock(&rl.lock);
  rl.started = false;
  while (rl.spare) {
    struct chunk *c = rl.spare;
    rl.spare = c->next;
    free(c);
  }
  rl.n_spare = 0;
  if (rl.dirfd >= 0)
    close(rl.dirfd);
  rl.dirfd = -1;
  pthread_mutex_unlock(&rl.lock);
}

/* A name part from SESSION_ID: what a file name may hold. */
static void safe_name(const char *id, char *out, size_t size) {
  size_t i = 0;
  for (; id[i] && i + 1 < size; i++) {
    char c = id[i];
    out[i] = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                     c == '-' || c == '_'
                 ? c
                 : '_';
  }
  out[i] = '\0';
  if (!i)
    snprintf(out, size, "run");
}

static struct runlog *open_one_locked(const char *stem, int stream, int *ret_errno) {
  _cleanup_free_ char *name = xasprintf("%s.%s", stem, stream == 1 ? "stdout" : "stderr");
  int fd = openat(rl.dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    *ret_errno = errno;
    return NULL;
  }
  /* Held while the log is open: the pruners (ours and other servers')
   * leave it alone. */
  flock(fd, LOCK_EX | LOCK_NB);
  struct runlog *l = calloc(1, sizeof *l);
  if (!l) {
    unlinkat(rl.dirfd, name, 0);
    close(fd);
    *ret_errno = ENOMEM;
    return NULL;
  }
  l->fd = fd;
  l->stream = stream;
  l->path = xasprintf("%s/%s", rl.dir, name);
  return l;
}

int runlog_open_run(const char *session_id, struct runlog *logs[2], char **ret_err) {
  logs[0] = logs[1] = NULL;
  pthread_mutex_lock(&rl.lock);
  if (!rl.started) {
    pthread_mutex_unlock(&rl.lock);
    *ret_err = strdup("the server keeps no logs: its log writer did not start (see its log)");
    return -ENOTCONN;
  }
  if (!rl.cap) {
    pthread_mutex_unlock(&rl.lock);
    return 0; /* IGN_MCP_LOG_CAP=0: no logs, by choice */
  }
  int r = dir_ready_locked(ret_err);
  if (r < 0) {
    pthread_mutex_unlock(&rl.lock);
    return r;
  }
  char id[64];
  safe_name(session_id ? session_id : "", id, sizeof id);
  int e = 0;
  for (int tries = 0; tries < MAX_NAME_TRIES; tries++) {
    char stem[96];
    snprintf(stem, sizeof stem, "%s-%" PRIu64, id, ++rl.seq);
    logs[0] = open_one_locked(stem, 1, &e);
    if (!logs[0] && e == EEXIST)
      continue;
    if (logs[0]) {
      logs[1] = open_one_locked(stem, 2, &e);
      if (!logs[1]) {
        unlinkat(rl.dirfd, strrchr(logs[0]->path, '/') + 1, 0);
        log_free(logs[0]);
        logs[0] = NULL;
        if (e == EEXIST)
          continue;
      }
    }
    break;
  }
  if (!logs[0]) {
    *ret_err = xasprintf("cannot create a log in %s: %s", rl.dir,
                         e ? strerror(e) : "every name is taken");
    pthread_mutex_unlock(&rl.lock);
    return -(e ? e : EEXIST);
  }
  if (mono_ms() - rl.last_prune_ms > PRUNE_EVERY_MS ||
      (rl.keep_bytes && rl.written_since_prune > rl.keep_bytes / 4)) {
    rl.prune_due = true;
    pthread_cond_signal(&rl.wake);
  }
  pthread_mutex_unlock(&rl.lock);
  return 0;
}

static bool pending_locked(const struct runlog *l) { return l && (l->head || l->busy); }

static char *describe_locked(const struct runlog *l, bool late) {
  const char *what = l->stream == 1 ? "stdout" : "stderr";
  if (l->werr)
    return xasprintf("the %s log is incomplete: writing it failed after %" PRIu64 " bytes (%s)",
                     what, l->written, strerror(l->werr));
  if (l->dropped)
    return xasprintf("the %s log is incomplete: %" PRIu64 " bytes were dropped because the disk "
                     "was slower than the output (markers in the file say where)",
                     what, l->dropped);
  if (late)
    return xasprintf("the %s log was not complete when the call returned: the disk took more "
                     "than %u s for its last %zu bytes (they are still being written)",
                     what, CLOSE_WAIT_MS / 1000, l->queued);
  return NULL;
}

void runlog_close_run(struct runlog *logs[2], const char *open_err, json_t *result) {
  if (!logs[0] && !logs[1]) {
    json_object_set_new(result, "stdout_log_path", json_null());
    json_object_set_new(result, "stderr_log_path", json_null());
    if (open_err)
      json_object_set_new(result, "log_error", json_string(open_err));
    return;
  }
  pthread_mutex_lock(&rl.lock);
  for (int i = 0; i < 2; i++) {
    struct runlog *l = logs[i];
    if (!l)
      continue;
    if (l->drop_pending)
      queue_drop_marker_locked(l);
    if (l->total > rl.cap) {
      char m[160];
      int n = snprintf(m, sizeof m, "\n[ignition-mcp: log cut at %zu bytes; the run wrote %" PRIu64 "]\n",
                       rl.cap, l->total);
      queue_locked(l, m, (size_t)n, true);
    }
  }
  struct timespec until = timespec_in(CLOCK_REALTIME, CLOSE_WAIT_MS);
  while (pending_locked(logs[0]) || pending_locked(logs[1]))
    if (pthread_cond_timedwait(&rl.done, &rl.lock, &until) == ETIMEDOUT)
      break;
  _cleanup_free_ char *msg = NULL;
  for (int i = 0; i < 2; i++) {
    struct runlog *l = logs[i];
    if (!l)
      continue;
    json_object_set_new(result, i == 0 ? "stdout_log_path" : "stderr_log_path",
                        json_string(l->path));
    bool late = pending_locked(l);
    _cleanup_free_ char *m = describe_locked(l, late);
    if (m) {
      char *joined = msg ? xasprintf("%s; %s", msg, m) : strdup(m);
      free(msg);
      msg = joined;
    }
    if (late)
      l->detached = true; /* the writer finishes and frees it */
    else
      log_free(l);
    logs[i] = NULL;
  }
  pthread_mutex_unlock(&rl.lock);
  if (open_err && !msg)
    msg = strdup(open_err);
  if (msg)
    json_object_set_new(result, "log_error", json_string(msg));
}

int runlog_keep_serial(const char *session_id, const char *src, char **ret_path,
                       char **ret_err) {
  const char *slash = src ? strrchr(src, '/') : NULL;
  if (!slash || !slash[1])
    return -ENOENT;
  /* The file is in the QEMU's state directory, which the server handed to
   * the QEMU's uid (spawn.c) and only root could give to another: the same
   * checks as the QEMU's log (qemu.c, open_log), relative to the directory,
   * with the directory's owner as the QEMU's uid.  Its parents are the
   * server's. */
  _cleanup_free_ char *dir = strndup(src, (size_t)(slash - src) + (slash == src));
  if (!dir)
    return -ENOMEM;
  _cleanup_close_ int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (dfd < 0 || fstat(dfd, &st) < 0)
    return -ENOENT; /* the VM is gone already: no log to keep */
  _cleanup_close_ int in = -1;
  _cleanup_free_ char *why = NULL;
  int r = fs_open_one_name(dfd, slash + 1, st.st_uid, &in, &why);
  if (r == -ENOENT)
    return r;
  if (r < 0) {
    log_warn("not keeping the serial log of %s: %s is not the log QEMU was given: %s",
             session_id, src, why);
    *ret_err = xasprintf("the guest's serial log was not kept: %s is not the log QEMU was given "
                         "(%s); the server did not read it",
                         src, why);
    return r;
  }
  char stem[80];
  safe_name(session_id, stem, sizeof stem);
  _cleanup_free_ char *name = xasprintf("%s.serial", stem), *err = NULL;
  pthread_mutex_lock(&rl.lock);
  r = rl.cap && rl.dir ? dir_ready_locked(&err) : -ENOENT;
  int out = r < 0 ? -1 : openat(rl.dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (r == 0 && out < 0)
    r = -errno;
  char *path = out >= 0 ? xasprintf("%s/%s", rl.dir, name) : NULL;
  size_t cap = rl.cap;
  pthread_mutex_unlock(&rl.lock);
  if (out < 0) {
    if (r == -ENOENT && !err)
      return r; /* logs are off */
    log_warn("cannot keep the serial log of %s: %s", session_id, err ? err : strerror(-r));
    *ret_err = xasprintf("the guest's serial log was not kept: %s", err ? err : strerror(-r));
    return r;
  }
  char buf[65536];
  for (size_t total = 0; total < cap;) {
    ssize_t n = read(in, buf, cap - total < sizeof buf ? cap - total : sizeof buf);
    if (n <= 0 || write(out, buf, (size_t)n) != n)
      break;
    total += (size_t)n;
  }
  close(out);
  *ret_path = path;
  return 0;
}
