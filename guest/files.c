/* files.c: WRITE and READ, binary-safe file transfer in PROTO_CHUNK pieces.
 *
 * A WRITE lands in a temporary file next to its target (".<name>.ign-XXXXXX")
 * and is renamed over the target only when exactly SIZE bytes have arrived,
 * so a reader never sees a half-written file and a failed transfer leaves the
 * old file untouched.  A failure is reported at once with ERROR; the DATA
 * frames already on their way are then dropped until DATA_END.  At most
 * FILES_MAX_WRITES transfers are open at a time; nothing is held in memory
 * but the frame being handled.
 *
 * A READ streams up to MAX bytes from OFFSET with pread(), which also works
 * for files that report size 0 (/proc), then ends with READ_END. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"
#include "guest/agent_core.h"
#include "guest/files_int.h"

/* Room left in a file name for ".<name>.ign-XXXXXX" within NAME_MAX. */
#define FILES_TMP_NAME_MAX 200

void files_init(struct files_state *f) {
  memset(f, 0, sizeof *f);
  for (size_t i = 0; i < FILES_MAX_WRITES; i++)
    f->writes[i].fd = -1;
}

static struct file_write *files_find(struct files_state *f, uint32_t id) {
  for (size_t i = 0; i < FILES_MAX_WRITES; i++)
    if (f->writes[i].used && f->writes[i].id == id)
      return &f->writes[i];
  return NULL;
}

static struct file_write *files_free_slot(struct files_state *f) {
  for (size_t i = 0; i < FILES_MAX_WRITES; i++)
    if (!f->writes[i].used)
      return &f->writes[i];
  return NULL;
}

bool files_id_busy(const struct files_state *f, uint32_t id) {
  for (size_t i = 0; i < FILES_MAX_WRITES; i++)
    if (f->writes[i].used && f->writes[i].id == id)
      return true;
  return false;
}

/* Close and forget a transfer, removing its temporary file if still there. */
static void write_reset(struct file_write *w) {
  closep(&w->fd);
  if (w->tmp[0])
    unlink(w->tmp);
  w->used = false;
  w->fd = -1;
  w->tmp[0] = '\0';
}

/* A transfer failed (its ERROR is sent): drop it and, unless this was its
 * DATA_END, the frames still to come. */
static void write_abandon(struct agent *a, struct file_write *w, bool more_frames) {
  if (more_frames)
    agent_ignore_until(a, w->id, PROTO_DATA_END);
  write_reset(w);
}

static void files_send_write_error(struct agent *a, uint32_t id, const char *path, int err) {
  if (err == ENOSPC || err == EDQUOT)
    agent_send_error(a, id, err, "no space left writing '%s': the sandbox's disk is full", path);
  else
    agent_send_error(a, id, err, "cannot write '%s': %s", path, strerror(err));
}

/* mkdir -p of every directory above PATH's last component. */
static int files_mkdir_parents(const char *path) {
  char buf[PATH_MAX];
  snprintf(buf, sizeof buf, "%s", path);
  for (char *p = buf + 1; *p; p++) {
    if (*p != '/')
      continue;
    *p = '\0';
    int r = mkdir(buf, 0755);
    int err = errno;
    *p = '/';
    if (r < 0 && err != EEXIST)
      return -err;
  }
  return 0;
}

/* ---- WRITE -------------------------------------------------------------- */

struct write_request {
  const uint8_t *path;
  uint32_t path_len;
  bool has_path;
  uint32_t mode;
  uint64_t size;
  bool has_size;
};

static int write_parse(struct agent *a, uint32_t id, const uint8_t *p, size_t n,
                       struct write_request *ret) {
  struct write_request r = {.mode = 0644};
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
    case TAG_MODE:
      if (agent_tlv_u32(a, id, "WRITE", "MODE", v, len, &r.mode) < 0)
        return -EPROTO;
      break;
    case TAG_SIZE:
      if (agent_tlv_u64(a, id, "WRITE", "SIZE", v, len, &r.size) < 0)
        return -EPROTO;
      r.has_size = true;
      break;
    default:
      break;
    }
  }
  if (k < 0) {
    agent_send_error(a, id, EPROTO, "malformed WRITE request: a TLV record runs past the payload");
    return -EPROTO;
  }
  if (!r.has_path || !r.has_size) {
    agent_send_error(a, id, EPROTO, "malformed WRITE request: %s is missing",
                     r.has_path ? "SIZE" : "PATH");
    return -EPROTO;
  }
  *ret = r;
  return 0;
}

static void files_handle_write(struct agent *a, uint32_t id, const uint8_t *p, size_t n) {
  struct write_request r;
  char path[PATH_MAX];
  struct stat st;

  if (agent_id_busy(a, id)) {
    agent_send_error(a, id, EEXIST, "request id %u is already in use by a running request", id);
    return;
  }
  if (write_parse(a, id, p, n, &r) < 0 ||
      agent_resolve_path(a, id, "path", r.path, r.path_len, path) < 0)
    goto ignore;
  if (path[strlen(path) - 1] == '/') {
    agent_send_error(a, id, EISDIR, "'%s' ends with '/'; give a file path", path);
    goto ignore;
  }
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
    agent_send_error(a, id, EISDIR, "'%s' is a directory; give a file path", path);
    goto ignore;
  }
  struct file_write *w = files_free_slot(agent_files(a));
  if (!w) {
    agent_send_error(a, id, EAGAIN, "too many file writes in progress (%u at once)",
                     FILES_MAX_WRITES);
    goto ignore;
  }
  int k = files_mkdir_parents(path);
  if (k < 0) {
    agent_send_error(a, id, -k, "cannot create the parent directories of '%s': %s", path,
                     strerror(-k));
    goto ignore;
  }

  const char *slash = strrchr(path, '/');
  int dir_len = (int)(slash - path);
  int t = snprintf(w->tmp, sizeof w->tmp, "%.*s/.%.*s.ign-XXXXXX", dir_len, path,
                   FILES_TMP_NAME_MAX, slash + 1);
  if (t < 0 || (size_t)t >= sizeof w->tmp) {
    w->tmp[0] = '\0';
    agent_send_error(a, id, ENAMETOOLONG, "path '%s' is too long", path);
    goto ignore;
  }
  w->fd = mkostemp(w->tmp, O_CLOEXEC);
  if (w->fd < 0) {
    int err = errno;
    w->tmp[0] = '\0';
    if (err == ENOSPC || err == EDQUOT)
      files_send_write_error(a, id, path, err);
    else
      agent_send_error(a, id, err, "cannot create '%s': %s", path, strerror(err));
    goto ignore;
  }
  w->used = true;
  w->id = id;
  w->size = r.size;
  w->received = 0;
  snprintf(w->path, sizeof w->path, "%s", path);
  /* mkostemp() made it 0600; the requested mode is exact, not umasked. */
  if (fchmod(w->fd, r.mode & 07777) < 0) {
    int err = errno;
    agent_send_error(a, id, err, "cannot set the mode of '%s': %s", path, strerror(err));
    write_abandon(a, w, true);
  }
  return;

ignore:
  agent_ignore_until(a, id, PROTO_DATA_END);
}

static void files_handle_data(struct agent *a, const struct proto_header *h, const uint8_t *p) {
  bool is_end = h->type == PROTO_DATA_END;
  if (agent_ignoring(a, h->id, PROTO_DATA_END, is_end))
    return;
  struct file_write *w = files_find(agent_files(a), h->id);
  if (!w) {
    agent_send_error(a, h->id, EPROTO, "%s for id %u, which has no WRITE in progress",
                     proto_type_name(h->type), h->id);
    return;
  }

  if (!is_end) {
    if (h->len > w->size - w->received) {
      agent_send_error(a, h->id, EIO, "received more than the announced %llu bytes for '%s'",
                       (unsigned long long)w->size, w->path);
      write_abandon(a, w, true);
      return;
    }
    int r = proto_write_all(w->fd, p, h->len);
    if (r < 0) {
      files_send_write_error(a, h->id, w->path, -r);
      write_abandon(a, w, true);
      return;
    }
    w->received += h->len;
    return;
  }

  if (w->received != w->size) {
    agent_send_error(a, h->id, EIO, "received %llu of %llu bytes for '%s'",
                     (unsigned long long)w->received, (unsigned long long)w->size, w->path);
    write_abandon(a, w, false);
    return;
  }
  /* close() reports delayed write errors on some filesystems. */
  int fd = steal_fd(w->fd);
  if (close(fd) < 0) {
    files_send_write_error(a, h->id, w->path, errno);
    write_abandon(a, w, false);
    return;
  }
  if (rename(w->tmp, w->path) < 0) {
    int err = errno;
    agent_send_error(a, h->id, err, "cannot replace '%s': %s", w->path, strerror(err));
    write_abandon(a, w, false);
    return;
  }
  w->tmp[0] = '\0';
  struct proto_buf *out = agent_frame(a, PROTO_OK, h->id);
  proto_put_u64(out, TAG_SIZE, w->size);
  agent_send(a);
  write_reset(w);
}

/* ---- READ --------------------------------------------------------------- */

static void files_handle_read(struct agent *a, uint32_t id, const uint8_t *p, size_t n) {
  const uint8_t *path_v = NULL;
  uint32_t path_len = 0;
  uint64_t offset = 0, max = FILES_MAX_READ;
  struct proto_tlv_iter it;
  uint16_t tag;
  const uint8_t *v;
  uint32_t len;
  int k;

  proto_tlv_init(&it, p, n);
  while ((k = proto_tlv_next(&it, &tag, &v, &len)) > 0) {
    if (tag == TAG_PATH) {
      path_v = v;
      path_len = len;
    } else if (tag == TAG_OFFSET) {
      if (agent_tlv_u64(a, id, "READ", "OFFSET", v, len, &offset) < 0)
        return;
    } else if (tag == TAG_MAX) {
      if (agent_tlv_u64(a, id, "READ", "MAX", v, len, &max) < 0)
        return;
    }
  }
  if (k < 0) {
    agent_send_error(a, id, EPROTO, "malformed READ request: a TLV record runs past the payload");
    return;
  }
  if (!path_v) {
    agent_send_error(a, id, EPROTO, "malformed READ request: PATH is missing");
    return;
  }
  if (max > FILES_MAX_READ)
    max = FILES_MAX_READ;
  if (offset > (uint64_t)INT64_MAX - max) {
    agent_send_error(a, id, EINVAL, "offset %llu is too large", (unsigned long long)offset);
    return;
  }
  char path[PATH_MAX];
  if (agent_resolve_path(a, id, "path", path_v, path_len, path) < 0)
    return;

  /* O_NONBLOCK: opening a FIFO must not wait for a writer. */
  _cleanup_close_ int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT)
      agent_send_error(a, id, err, "'%s' does not exist in the sandbox", path);
    else
      agent_send_error(a, id, err, "cannot open '%s': %s", path, strerror(err));
    return;
  }
  struct stat st;
  if (fstat(fd, &st) < 0) {
    int err = errno;
    agent_send_error(a, id, err, "cannot stat '%s': %s", path, strerror(err));
    return;
  }
  if (S_ISDIR(st.st_mode)) {
    agent_send_error(a, id, EISDIR, "'%s' is a directory; give a file path", path);
    return;
  }
  if (!S_ISREG(st.st_mode)) {
    agent_send_error(a, id, EINVAL, "'%s' is not a regular file", path);
    return;
  }

  uint64_t bytes = 0;
  bool eof = false;
  while (bytes < max) {
    size_t want = max - bytes < PROTO_CHUNK ? (size_t)(max - bytes) : PROTO_CHUNK;
    ssize_t r = pread(fd, agent_chunk(a), want, (off_t)(offset + bytes));
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0) {
      int err = errno;
      agent_send_error(a, id, err, "cannot read '%s': %s", path, strerror(err));
      return;
    }
    if (r == 0) {
      eof = true;
      break;
    }
    agent_send_data(a, PROTO_DATA, id, agent_chunk(a), (size_t)r);
    bytes += (uint64_t)r;
  }
  if (!eof) {
    /* MAX reached exactly: only a probe tells whether anything follows. */
    uint8_t probe;
    ssize_t r;
    do
      r = pread(fd, &probe, 1, (off_t)(offset + bytes));
    while (r < 0 && errno == EINTR);
    eof = r == 0;
  }
  uint64_t size = (uint64_t)st.st_size;
  if (size == 0 && eof)
    size = offset + bytes; /* /proc and friends report 0 */
  struct proto_buf *out = agent_frame(a, PROTO_READ_END, id);
  proto_put_u64(out, TAG_SIZE, size);
  proto_put_u32(out, TAG_EOF, eof);
  proto_put_u64(out, TAG_BYTES, bytes);
  agent_send(a);
}

void files_handle(struct agent *a, const struct proto_header *h, const uint8_t *payload) {
  switch (h->type) {
  case PROTO_WRITE:
    files_handle_write(a, h->id, payload, h->len);
    break;
  case PROTO_DATA:
  case PROTO_DATA_END:
    files_handle_data(a, h, payload);
    break;
  case PROTO_READ:
    files_handle_read(a, h->id, payload, h->len);
    break;
  default:
    break;
  }
}

void files_shutdown(struct files_state *f) {
  for (size_t i = 0; i < FILES_MAX_WRITES; i++)
    if (f->writes[i].used)
      write_reset(&f->writes[i]);
}
