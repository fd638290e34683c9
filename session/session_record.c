/* session_record.c: what the store keeps of each open session, so that
 * session ids are never given twice on one store, across servers and their
 * lifetimes, and an id whose server was killed is answered as lost, not as
 * an id nobody opened.
 *
 * Layout under IGN_MCP_STORE/sessions/ (mode 0700, the server's uid):
 *   .seq                 the last sequence number given (decimal text),
 *                        changed under an flock LOCK_EX on the file
 *   .new-<pid>-<n>/      a record being made; renamed to its id when whole
 *   <id>/meta.json       {id, owner, pid, host, server, opened_at}
 *   <id>/live            flock LOCK_EX by the server that holds the session,
 *                        from before the record is visible until it is gone
 *   <id>/lost_at         written by the first server that finds the lock
 *                        free: the session's server ended without closing it
 *   <id>/hibernated.json present while the session is hibernated
 *                        (session_hibernate.c): what a server needs to resume
 *                        it, its saved state being the kept stage .hib-<id>
 *                        in stages/.  With the lock free, any server of the
 *                        same owner on the store may claim it: the lock,
 *                        taken without waiting, makes the claim exclusive,
 *                        and the file goes once the session is resumed
 * A closed session's record is removed (the id is then unknown again, as
 * before).  The kernel drops the flock however its server dies, so a record
 * whose lock can be taken is a session that was lost with its server: the
 * next server on the store says so, and removes the record a week later.
 * A hibernated session's record is not lost: it is kept until
 * IGN_MCP_HIBERNATE_KEEP_SECS after its hibernation, then removed with its
 * stage by the next server that starts.
 *
 * Without the directory (a store that cannot hold it) ids are unique per
 * server only, as they were before records, and a warning says why. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/config.h"
#include "common/fs.h"
#include "common/log.h"
#include "common/util.h"
#include "sandbox/stage.h"
#include "session/session_int.h"

#define RECORD_META_MAX 4096
/* How long a lost session's record is kept, counted from when a server
 * first found it lost. */
#define RECORD_LOST_KEEP_S (7 * 24 * 3600)
/* A .new- directory this old was left by a server that died making it. */
#define RECORD_NEW_STALE_S 60

/* The directory, as /proc/self/fd/N of the descriptor opened (and checked)
 * at startup: every path below it goes through that descriptor, so a
 * sessions/ renamed or replaced later (by whoever may write in the store)
 * is never followed.  NULL: no records.  records_shown: its name, for
 * messages. */
static char *records_dir;
static char *records_shown;
static char server_token[17]; /* this process's, in each meta.json it writes */
static _Atomic unsigned new_seq;

static char *record_path(const char *id, const char *file) {
  return file ? xasprintf("%s/%s/%s", records_dir, id, file) : xasprintf("%s/%s", records_dir, id);
}

/* An id as session_new makes them: "[<host>.]" 's' digits '-' hex, and
 * nothing that could be a path. */
static bool record_id_ok(const char *id) {
  size_t n = strlen(id);
  if (n == 0 || n >= SESSION_ID_MAX || id[0] == '.')
    return false;
  for (const char *p = id; *p; p++)
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
          *p == '-' || *p == '.' || *p == '_'))
      return false;
  return !strstr(id, "..");
}

/* ---- what a record says ---- */

struct record_meta {
  char *owner; /* malloc'd: compared whole */
  char host[CONFIG_HOST_ID_MAX + 1];
  char server[sizeof server_token];
  long long pid, opened_at;
};

/* Opens NAME in DIR_FD to read: a regular file only, never a link, and
 * without blocking on a FIFO planted there. */
static int open_regular(int dir_fd, const char *name) {
  int fd = openat(dir_fd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  struct stat st;
  if (fd >= 0 && (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))) {
    close(fd);
    errno = EINVAL;
    return -1;
  }
  return fd;
}

static int meta_read(int dir_fd, struct record_meta *m) {
  _cleanup_close_ int fd = open_regular(dir_fd, "meta.json");
  if (fd < 0)
    return -errno;
  char buf[RECORD_META_MAX];
  ssize_t n = read(fd, buf, sizeof buf);
  if (n <= 0)
    return n < 0 ? -errno : -EINVAL;
  json_error_t e;
  json_t *j = json_loadb(buf, (size_t)n, JSON_REJECT_DUPLICATES, &e);
  const char *owner = NULL, *host = "", *server = "";
  json_int_t pid = 0, at = 0;
  int r = j && json_unpack(j, "{s:s, s?s, s?s, s:I, s:I}", "owner", &owner, "host", &host, "server",
                           &server, "pid", &pid, "opened_at", &at) == 0
              ? 0
              : -EINVAL;
  if (r == 0) {
    m->owner = strdup(owner);
    snprintf(m->host, sizeof m->host, "%s", host);
    snprintf(m->server, sizeof m->server, "%s", server);
    m->pid = pid;
    m->opened_at = at;
  }
  json_decref(j);
  return r;
}

/* The directory of OWNER's record of ID, opened (an fd, with *M read; the
 * caller frees M->owner), or -1 when there is none or it is another
 * owner's (compared whole). */
static int record_open_theirs(const char *id, const char *owner, struct record_meta *m) {
  *m = (struct record_meta){0};
  if (!records_dir || !record_id_ok(id))
    return -1;
  _cleanup_free_ char *p = record_path(id, NULL);
  int fd = open(p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0 && meta_read(fd, m) == 0 && m->owner && strcmp(m->owner, owner) == 0)
    return fd;
  if (fd >= 0)
    close(fd);
  free(m->owner);
  m->owner = NULL;
  return -1;
}

/* Whether the record in DIR_FD is held by a live server: 1 held, 0 free
 * (its server is gone), -errno when it cannot be told. */
static int record_held(int dir_fd) {
  _cleanup_close_ int fd = open_regular(dir_fd, "live");
  if (fd < 0)
    return -errno;
  if (flock(fd, LOCK_SH | LOCK_NB) == 0)
    return 0; /* dropped with the fd */
  return errno == EWOULDBLOCK ? 1 : -errno;
}

/* Notes, once, when the record in DIR_FD was first found lost; returns that
 * time. */
static time_t record_lost_at(int dir_fd) {
  time_t now = time(NULL);
  _cleanup_close_ int fd =
      openat(dir_fd, "lost_at", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd >= 0) {
    dprintf(fd, "%lld\n", (long long)now);
    return now;
  }
  struct stat st;
  return fstatat(dir_fd, "lost_at", &st, AT_SYMLINK_NOFOLLOW) == 0 ? st.st_mtime : now;
}

/* hibernated.json at most: a policy of 256 rules and 4096 names of up to 253
 * characters, quoted and separated, and the rest. */
#define RECORD_HIB_MAX ((size_t)2 << 20)

/* The hibernated.json of record ID (in DIR_FD), checked: version 1, its id,
 * an owner, bytes, a time not in the future, what it carries.  0 and *ret (a
 * reference), -ENOENT when there is none, -EBADMSG when it is damaged. */
static int hib_read(int dir_fd, const char *id, json_t **ret) {
  _cleanup_close_ int fd = open_regular(dir_fd, "hibernated.json");
  if (fd < 0)
    return -errno;
  struct stat st;
  if (fstat(fd, &st) < 0 || st.st_size > (off_t)RECORD_HIB_MAX)
    return -EBADMSG;
  json_error_t e;
  json_t *j = json_loadfd(fd, JSON_REJECT_DUPLICATES, &e);
  json_int_t version = 0, bytes = -1, at = -1;
  const char *hid = NULL, *owner = NULL, *carries = NULL;
  bool ok = j && json_unpack(j, "{s:I, s:s, s:s, s:I, s:I, s:s}", "version", &version, "id", &hid,
                             "owner", &owner, "bytes", &bytes, "hibernated_at", &at, "carries",
                             &carries) == 0 &&
            version == 1 && strcmp(hid, id) == 0 && bytes >= 0 && at >= 0 &&
            at <= (json_int_t)time(NULL) + 60 &&
            (strcmp(carries, "memory") == 0 || strcmp(carries, "files") == 0);
  const json_t *iso = j ? json_object_get(j, "isolation") : NULL, *eg = j ? json_object_get(j, "egress") : NULL;
  if (!ok || (iso && (!json_is_string(iso) || json_string_length(iso) > 64)) ||
      (eg && !json_is_object(eg))) {
    json_decref(j);
    return -EBADMSG;
  }
  *ret = j;
  return 0;
}

static int64_t hib_at(const json_t *j) {
  return (int64_t)json_integer_value(json_object_get(j, "hibernated_at"));
}

/* The live file of the record in DIR_FD, locked LOCK_EX without waiting
 * (tried a few times over 100 ms: a probe of another server holds it an
 * instant): its fd, or -1 when a server holds it. */
static int record_take(int dir_fd, int tries) {
  int fd = openat(dir_fd, "live", O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
    if (fd >= 0)
      close(fd);
    return -1;
  }
  for (int i = 0; i < tries; i++) {
    if (flock(fd, LOCK_EX | LOCK_NB) == 0)
      return fd;
    if (errno != EWOULDBLOCK && errno != EINTR)
      break;
    if (i + 1 < tries)
      usleep(20 * 1000);
  }
  close(fd);
  return -1;
}

/* ---- the directory and the counter ---- */

/* Whether the kept stage of KEY belongs to no hibernation: its record is
 * gone, or is held by no server and has no hibernated.json (a server died
 * between the two). */
static bool kept_orphan(const char *key) {
  if (!record_id_ok(key))
    return false;
  _cleanup_free_ char *p = record_path(key, NULL);
  _cleanup_close_ int fd = open(p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT;
  _cleanup_close_ int lock = record_take(fd, 1);
  struct stat st;
  return lock >= 0 && fstatat(fd, "hibernated.json", &st, AT_SYMLINK_NOFOLLOW) < 0 &&
         errno == ENOENT;
}

/* Removes what dead servers left: half-made records, lost ones past
 * RECORD_LOST_KEEP_S, hibernations past IGN_MCP_HIBERNATE_KEEP_SECS, and
 * kept stages no record names. */
static void records_sweep(void) {
  DIR *d = opendir(records_dir);
  if (!d)
    return;
  time_t now = time(NULL);
  struct dirent *e;
  unsigned lost = 0, removed = 0, kept = 0;
  while ((e = readdir(d))) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0 ||
        strcmp(e->d_name, ".seq") == 0)
      continue;
    _cleanup_free_ char *p = record_path(e->d_name, NULL);
    _cleanup_close_ int fd = open(p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0)
      continue;
    if (strncmp(e->d_name, ".new-", 5) == 0) {
      /* Old first: a young one's maker may be about to lock it. */
      if (now - st.st_mtime > RECORD_NEW_STALE_S && record_held(fd) != 1) {
        fs_remove_tree(p);
        removed++;
      }
      continue;
    }
    /* Held by this sweep while it decides and removes: no server claims it
     * meanwhile.  One without a live file (a regular one) no server can
     * hold: it is lost. */
    struct stat ls;
    bool broken = fstatat(fd, "live", &ls, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISREG(ls.st_mode);
    _cleanup_close_ int lock = broken ? -1 : record_take(fd, 1);
    if (lock < 0 && !broken)
      continue;
    json_t *hib = NULL;
    int hr = broken ? -EBADMSG : hib_read(fd, e->d_name, &hib);
    bool gone;
    if (hr == 0) {
      /* Hibernated by a server that ended: kept for another to resume. */
      gone = now - hib_at(hib) >= (int64_t)cfg.hibernate_keep_secs;
      json_decref(hib);
      if (gone)
        log_info("session %s (hibernated) closed: kept %u s (IGN_MCP_HIBERNATE_KEEP_SECS)",
                 e->d_name, cfg.hibernate_keep_secs);
      else
        kept++;
    } else {
      /* Lost with its server (or a damaged hibernation: it cannot be
       * resumed either). */
      lost++;
      gone = now - record_lost_at(fd) > RECORD_LOST_KEEP_S;
    }
    if (gone) {
      stage_remove_kept(e->d_name);
      fs_remove_tree(p);
      removed++;
    }
  }
  closedir(d);
  stage_kept_sweep(kept_orphan);
  if (kept)
    log_info("session records: %u hibernated session%s on the store, resumable by id", kept,
             kept == 1 ? "" : "s");
  if (lost)
    log_info("session records: %u session%s lost with a server that ended without closing them "
             "(their ids answer so); %u record%s removed",
             lost, lost == 1 ? "" : "s", removed, removed == 1 ? "" : "s");
}

void session_records_init(void) {
  uint64_t tok = 0;
  if (getrandom(&tok, sizeof tok, 0) != sizeof tok)
    tok = mono_us() ^ ((uint64_t)getpid() << 32);
  snprintf(server_token, sizeof server_token, "%016" PRIx64, tok);
  _cleanup_free_ char *d = xasprintf("%s/sessions", cfg.store);
  _cleanup_free_ char *err = NULL;
  int fd = -1;
  struct stat st;
  if (fs_own_dir(d, "session directory", 0700, &err) == 0) {
    /* Checked again through the descriptor kept: the name may have been
     * swapped since. */
    fd = open(d, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
      err = xasprintf("cannot open %s: %s", d, strerror(errno));
    else if (fstat(fd, &st) < 0 || st.st_uid != geteuid() || (st.st_mode & 077)) {
      err = xasprintf("%s changed under the server (another owner or mode now)", d);
      closep(&fd);
    }
  }
  if (fd < 0) {
    log_warn("session ids are unique to this server only, not across servers and restarts on "
             "the store: %s",
             err);
    return;
  }
  records_dir = xasprintf("/proc/self/fd/%d", fd);
  records_shown = steal_ptr(d);
  records_sweep();
}

/* The store's counter, moved on by one under its lock; 0 when it cannot be. */
static unsigned records_seq(void) {
  _cleanup_free_ char *p = xasprintf("%s/.seq", records_dir);
  _cleanup_close_ int fd = open(p, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  int r;
  while ((r = fd < 0 ? -1 : flock(fd, LOCK_EX)) < 0 && fd >= 0 && errno == EINTR)
    ;
  if (r < 0)
    return 0;
  char buf[32] = "";
  ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  unsigned long long v = n > 0 ? strtoull(buf, NULL, 10) : 0;
  v = v >= UINT32_MAX ? 1 : v + 1;
  int len = snprintf(buf, sizeof buf, "%llu\n", v);
  if (pwrite(fd, buf, (size_t)len, 0) != len || ftruncate(fd, len) < 0)
    return 0;
  return (unsigned)v;
}

unsigned session_records_next_seq(void) {
  unsigned v = records_dir ? records_seq() : 0;
  if (v)
    return v;
  if (records_dir) {
    static atomic_bool said;
    if (!atomic_exchange(&said, true))
      log_warn("the store's session counter %s/.seq cannot be read or moved on (%s): ids come "
               "from this server's own count until it can, and may repeat ones of before",
               records_shown, strerror(errno));
  }
  return session_local_seq();
}

/* ---- a session's record ---- */

/* Takes a record whose server is gone out of the way of ID, which is to be
 * given again (the counter was reset): 0 when there is none now. */
static int record_clear_lost(const char *id) {
  _cleanup_free_ char *p = record_path(id, NULL);
  _cleanup_close_ int fd = open(p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT ? 0 : -errno;
  struct stat st;
  if (record_held(fd) != 0 || fstatat(fd, "hibernated.json", &st, AT_SYMLINK_NOFOLLOW) == 0)
    return -EEXIST; /* held, or a hibernation kept for its owner */
  fs_remove_tree(p);
  return 0;
}

int session_record_add(struct session *s) {
  if (!records_dir || s->ephemeral)
    return 0;
  if (!record_id_ok(s->id))
    return -EINVAL;
  /* The server's token as well as its pid: servers in other pid
   * namespaces may share the store. */
  _cleanup_free_ char *tmp =
      xasprintf("%s/.new-%s-%d-%u", records_dir, server_token, (int)getpid(), ++new_seq);
  if (mkdir(tmp, 0700) < 0) {
    int r = -errno;
    log_warn("session %s has no record on the store (mkdir in %s: %s)", s->id, records_shown,
             strerror(-r));
    return r;
  }
  int r = 0;
  _cleanup_free_ char *live = xasprintf("%s/live", tmp), *meta = xasprintf("%s/meta.json", tmp);
  int fd = open(live, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  /* Blocking: the file is new, and a sweep's probe lets go at once. */
  int locked = -1;
  while (fd >= 0 && (locked = flock(fd, LOCK_EX)) < 0 && errno == EINTR)
    ;
  if (fd < 0 || locked < 0)
    r = -errno;
  json_t *j = json_pack("{s:s, s:s, s:I, s:s, s:s, s:I}", "id", s->id, "owner", s->owner, "pid",
                        (json_int_t)getpid(), "host", cfg.host_id, "server", server_token,
                        "opened_at", (json_int_t)time(NULL));
  if (r == 0 && (!j || json_dump_file(j, meta, JSON_COMPACT) < 0))
    r = -EIO;
  json_decref(j);
  _cleanup_free_ char *final = record_path(s->id, NULL);
  if (r == 0 && rename(tmp, final) < 0) {
    r = -errno;
    if ((r == -EEXIST || r == -ENOTEMPTY) && record_clear_lost(s->id) == 0)
      r = rename(tmp, final) < 0 ? -errno : 0;
  }
  if (r < 0) {
    if (fd >= 0)
      close(fd);
    fs_remove_tree(tmp);
    log_warn("session %s has no record on the store (%s): if this server is killed, its id "
             "will read as unknown rather than lost",
             s->id, strerror(-r));
    return r;
  }
  s->record_fd = fd;
  return 0;
}

void session_record_remove(struct session *s) {
  if (s->record_fd < 0)
    return;
  if (s->outlives) {
    /* Hibernated, kept for another server: only this one's lock goes. */
    close(s->record_fd);
    s->record_fd = -1;
    return;
  }
  _cleanup_free_ char *p = record_path(s->id, NULL);
  /* The lock is held until the record is gone: no server reads it as lost. */
  fs_remove_tree(p);
  close(s->record_fd);
  s->record_fd = -1;
}

char *session_record_whereabouts(const char *id, const char *owner) {
  struct record_meta m;
  _cleanup_close_ int fd = record_open_theirs(id, owner, &m);
  free(m.owner);
  if (fd < 0)
    return NULL;
  /* This server's own: closed, and going as its last call ends. */
  if (strcmp(m.server, server_token) == 0)
    return NULL;
  char opened[32] = "";
  time_t at = (time_t)m.opened_at;
  struct tm tm;
  if (gmtime_r(&at, &tm))
    strftime(opened, sizeof opened, "%Y-%m-%dT%H:%M:%SZ", &tm);
  _cleanup_free_ char *server =
      m.host[0] ? xasprintf("host '%s', pid %lld", m.host, m.pid) : xasprintf("pid %lld", m.pid);
  int held = record_held(fd);
  json_t *hib = NULL;
  if (held == 1)
    return xasprintf("session '%s' is held by another server on this store (%s), not by this "
                     "one: send calls for it to that server (its client), or call open_session "
                     "here for a new one",
                     id, server);
  if (held < 0)
    return NULL;
  if (hib_read(fd, id, &hib) == 0) {
    /* Hibernated, and being claimed by a server this instant. */
    json_decref(hib);
    return xasprintf("session '%s' is hibernated on this store and is being resumed by a server "
                     "right now: call again",
                     id);
  }
  record_lost_at(fd);
  return xasprintf("session '%s' was lost: its server (%s), where it was opened at %s, ended "
                   "without closing it (it was killed, or crashed), and its sandbox ended with "
                   "it. Call open_session for a new session; what was in the old one is gone.",
                   id, server, opened);
}

/* ---- hibernated sessions ---- */

int session_record_hibernated(struct session *s, json_t *j) {
  if (s->record_fd < 0) {
    json_decref(j);
    return -ENOENT;
  }
  /* Never more than a server reads back. */
  _cleanup_free_ char *text = json_dumps(j, JSON_COMPACT);
  if (!text || strlen(text) > RECORD_HIB_MAX) {
    json_decref(j);
    return text ? -EFBIG : -ENOMEM;
  }
  _cleanup_free_ char *tmp = record_path(s->id, ".hibernated.new"),
                      *final = record_path(s->id, "hibernated.json");
  unlink(tmp);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  int r = fd < 0 ? -errno : json_dumpfd(j, fd, JSON_COMPACT) < 0 ? -EIO : 0;
  if (fd >= 0 && r == 0 && fsync(fd) < 0)
    r = -errno;
  if (fd >= 0)
    close(fd);
  if (r == 0 && rename(tmp, final) < 0)
    r = -errno;
  if (r < 0)
    unlink(tmp);
  json_decref(j);
  return r;
}

void session_record_resumed(struct session *s) {
  if (s->record_fd < 0)
    return;
  _cleanup_free_ char *p = record_path(s->id, "hibernated.json");
  if (unlink(p) < 0 && errno != ENOENT)
    log_warn("cannot remove %s/%s/hibernated.json (%s): another server could resume session "
             "%s a second time",
             records_shown, s->id, strerror(errno), s->id);
}

/* META (json) becomes meta.json in DIR_FD, in one step. */
static void meta_write(int dir_fd, json_t *meta) {
  _cleanup_close_ int fd =
      openat(dir_fd, ".meta.new", O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (meta && fd >= 0 && json_dumpfd(meta, fd, JSON_COMPACT) == 0)
    renameat(dir_fd, ".meta.new", dir_fd, "meta.json");
}

int session_record_claim(const char *id, const char *owner, bool damaged_too,
                         struct record_claim *c, char **ret_err) {
  *c = (struct record_claim){.fd = -1};
  struct record_meta m;
  _cleanup_close_ int dfd = record_open_theirs(id, owner, &m);
  if (dfd < 0)
    return 0;
  /* Without hibernated.json it is lost (or held): no lock taken for that. */
  struct stat st;
  int fd = fstatat(dfd, "hibernated.json", &st, AT_SYMLINK_NOFOLLOW) == 0 ? record_take(dfd, 5) : -1;
  if (fd < 0) {
    free(m.owner);
    return 0; /* held, or lost: whereabouts says which */
  }
  json_t *hib = NULL;
  int r = hib_read(dfd, id, &hib);
  if (r == -ENOENT || (r < 0 && !damaged_too)) {
    close(fd);
    free(m.owner);
    if (r == -ENOENT)
      return 0; /* resumed by another server a moment ago */
    *ret_err = xasprintf("session '%s' is hibernated, but its record on the store (%s/%s/"
                         "hibernated.json) is damaged: it cannot be resumed. Close it.",
                         id, records_shown, id);
    return r;
  }
  /* meta.json names this server from now on (so that another server's
   * answer does); the old one is put back if the claim is let go. */
  c->old_meta = json_pack("{s:s, s:s, s:I, s:s, s:s, s:I}", "id", id, "owner", m.owner, "pid",
                          (json_int_t)m.pid, "host", m.host, "server", m.server, "opened_at",
                          (json_int_t)m.opened_at);
  json_t *now = json_pack("{s:s, s:s, s:I, s:s, s:s, s:I}", "id", id, "owner", m.owner, "pid",
                          (json_int_t)getpid(), "host", cfg.host_id, "server", server_token,
                          "opened_at", (json_int_t)m.opened_at);
  meta_write(dfd, now);
  json_decref(now);
  free(m.owner);
  c->fd = fd;
  c->hib = hib; /* NULL when damaged */
  return 1;
}

void session_record_unclaim(const char *id, struct record_claim *c) {
  if (c->fd >= 0 && c->old_meta && records_dir) {
    _cleanup_free_ char *p = record_path(id, NULL);
    _cleanup_close_ int dfd = open(p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd >= 0)
      meta_write(dfd, c->old_meta);
  }
  if (c->fd >= 0)
    close(c->fd);
  json_decref(c->old_meta);
  json_decref(c->hib);
  *c = (struct record_claim){.fd = -1};
}

int session_record_claimed(struct record_claim *c) {
  json_decref(c->old_meta);
  json_decref(c->hib);
  int fd = c->fd;
  *c = (struct record_claim){.fd = -1};
  return fd;
}

/* Whether record NAME is OWNER's, hibernated and held by no server: its
 * hibernated.json then. */
static json_t *free_hibernated(const char *name, const char *owner) {
  struct record_meta m;
  _cleanup_close_ int dfd = record_open_theirs(name, owner, &m);
  free(m.owner);
  json_t *hib = NULL;
  if (dfd < 0 || record_held(dfd) != 0 || hib_read(dfd, name, &hib) < 0)
    return NULL;
  if ((int64_t)time(NULL) - hib_at(hib) >= (int64_t)cfg.hibernate_keep_secs) {
    json_decref(hib); /* kept long enough: the next claim or sweep removes it */
    return NULL;
  }
  return hib;
}

static int by_hibernated_at(const void *a, const void *b) {
  int64_t x = hib_at(*(json_t *const *)a), y = hib_at(*(json_t *const *)b);
  return x < y ? -1 : x > y;
}

json_t *session_records_kept(const char *owner) {
  json_t *arr = json_array();
  DIR *d = records_dir ? opendir(records_dir) : NULL;
  size_t n = 0, cap = 0;
  json_t **items = NULL;
  struct dirent *e;
  while (d && (e = readdir(d))) {
    if (e->d_name[0] == '.')
      continue;
    json_t *hib = free_hibernated(e->d_name, owner);
    if (!hib)
      continue;
    json_t *o = json_pack("{s:s, s:s, s:I, s:I, s:O?, s:O?}", "session_id", e->d_name, "state",
                          "hibernated", "bytes", json_integer_value(json_object_get(hib, "bytes")),
                          "hibernated_at", (json_int_t)hib_at(hib), "carries",
                          json_object_get(hib, "carries"), "isolation",
                          json_object_get(hib, "isolation"));
    json_decref(hib);
    if (!o)
      continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 16;
      json_t **ni = realloc(items, cap * sizeof *ni);
      if (!ni)
        abort();
      items = ni;
    }
    items[n++] = o;
  }
  if (d)
    closedir(d);
  if (n)
    qsort(items, n, sizeof *items, by_hibernated_at);
  for (size_t i = 0; i < n; i++)
    json_array_append_new(arr, items[i]);
  free(items);
  return arr;
}

bool session_record_drop(const char *id, const char *owner) {
  struct record_claim c;
  _cleanup_free_ char *err = NULL;
  /* A damaged one too: it cannot be resumed, but it can be closed. */
  if (session_record_claim(id, owner, true, &c, &err) != 1)
    return false;
  /* The stage first: a record without it reads as lost, a stage without
   * its record is an orphan the next sweep removes. */
  stage_remove_kept(id);
  _cleanup_free_ char *p = record_path(id, NULL);
  fs_remove_tree(p);
  close(session_record_claimed(&c));
  return true;
}

bool session_record_maybe_hibernated(const char *id, const char *owner) {
  /* Another owner's is none of this caller's business: answered at once,
   * as an id nobody opened is. */
  struct record_meta m;
  _cleanup_close_ int dfd = record_open_theirs(id, owner, &m);
  free(m.owner);
  struct stat st;
  return dfd >= 0 && fstatat(dfd, "hibernated.json", &st, AT_SYMLINK_NOFOLLOW) == 0;
}

void session_record_forget_hibernation(const char *id) {
  _cleanup_free_ char *p = records_dir && record_id_ok(id) ? record_path(id, "hibernated.json") : NULL;
  if (p)
    unlink(p);
}
