/* stage_store.c: the stage store's layout on disk (see stage.h): the
 * directory stages/ and who may own it, the paths of stages by name and of
 * directories set aside, the rule for names, and meta.json, the record of
 * what a stage is and whose.
 *
 * Layout under IGN_MCP_STORE/stages/ (mode 0700):
 *   <name, '/' as '+'>/      a named stage: meta.json and the backend's files
 *   .tmp-<pid>-<n>/          being made (stage_begin .. stage_finish)
 *   .anon-<pid>-<n>/         an anonymous stage (a fork's, a resumed session's)
 *   .hib-<session id>/       a hibernated session's kept stage (stage_kept.c):
 *                            it outlives its server; stage_gc passes over it
 *   .rm-<pid>-<n>/           removed or replaced, deleted once nobody holds it
 *   .lock                    flock LOCK_EX around every change of names
 * A stage in use is held by a shared flock on its meta.json, and a .tmp
 * being made by an flock on the directory itself (so that no server, in
 * whatever pid namespace, removes one that is alive); a directory is deleted
 * only under .lock by whoever gets LOCK_EX on it (on its meta for stages).
 * Those rules are stage_lock.c's.
 *
 * Owners: meta.json records the owner that committed the stage ("owner";
 * absent in a stage made before owners were recorded: owner "").  The names
 * are one space for all owners, but a stage of another owner is, to every
 * call but a commit under its name, a name nobody made: the same "no stage
 * named" error.  A commit under it is refused as taken (the name cannot be
 * given twice), with nothing else about the stage. */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/config.h"
#include "common/fs.h"
#include "common/util.h"
#include "sandbox/stage_int.h"

#define STAGE_META_MAX 65536

/* ---- paths and names ---- */

char *stage_store_dir(void) { return xasprintf("%s/stages", cfg.store); }

/* stages/ is the server's (a stage is a copy of a sandbox and may hold
 * secrets typed into it): made 0700, never a link, owned by the server's
 * uid, never open to others nor writable by its group; group read and
 * search given on purpose (the vm backend's QEMUs, group VM_GID, must
 * reach a stage's files as they reach a base's) are kept. */
int stage_store_ensure(char **ret_err) {
  _cleanup_free_ char *d = stage_store_dir();
  return fs_own_dir(d, "stage directory", 0750, ret_err);
}

/* The directory of named stage NAME (already checked). */
char *stage_name_dir(const char *name) {
  _cleanup_free_ char *enc = strdup(name);
  if (!enc)
    abort();
  for (char *p = enc; *p; p++)
    if (*p == '/')
      *p = '+';
  return xasprintf("%s/stages/%s", cfg.store, enc);
}

static _Atomic unsigned seq;

/* A fresh path stages/.KIND-<pid>-<n>. */
char *stage_aside_path(const char *kind) {
  return xasprintf("%s/stages/.%s-%d-%u", cfg.store, kind, (int)getpid(), ++seq);
}

int stage_name_check(const char *name, char **ret_err) {
  const char *why = NULL;
  size_t n = name ? strlen(name) : 0;
  char bad = 0;
  if (!name || n == 0)
    why = "it is empty";
  else if (n > STAGE_NAME_MAX)
    why = "it is longer than 128 characters";
  else if (!((name[0] >= 'a' && name[0] <= 'z') || (name[0] >= '0' && name[0] <= '9')))
    why = "it must start with a lowercase letter or a digit";
  else
    for (size_t i = 1; i < n && !why; i++) {
      char c = name[i];
      if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
            c == '/' || c == '-')) {
        bad = c;
        why = "it holds a character outside a-z 0-9 . _ / -";
      }
    }
  if (!why)
    return 0;
  if (bad && (unsigned char)bad >= 0x20 && bad != 0x7f && !((unsigned char)bad & 0x80))
    *ret_err = xasprintf("invalid stage name: %s ('%c'); a name must match %s, e.g. "
                         "\"myproject/data-deps\"",
                         why, bad, STAGE_NAME_RULE);
  else
    *ret_err = xasprintf("invalid stage name: %s; a name must match %s, e.g. "
                         "\"myproject/data-deps\"",
                         why, STAGE_NAME_RULE);
  return -EINVAL;
}

/* ---- meta.json ---- */

static bool hex_id(const char *s, const char *prefix, size_t nhex) {
  size_t p = strlen(prefix);
  if (!s || strncmp(s, prefix, p) || strlen(s) != p + nhex)
    return false;
  return strspn(s + p, "0123456789abcdef") == nhex;
}

static const char *opt_str(json_t *j, const char *key) {
  json_t *v = json_object_get(j, key);
  return json_is_string(v) ? json_string_value(v) : NULL;
}

/* Reads and checks the meta.json open as FD; *ret_why on failure. */
int stage_meta_read(int fd, struct stage_meta *m, char **ret_why) {
  struct stat st;
  if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size > STAGE_META_MAX) {
    *ret_why = xasprintf("its meta.json is not a regular file of at most %d bytes", STAGE_META_MAX);
    return -EBADMSG;
  }
  _cleanup_free_ char *buf = malloc(STAGE_META_MAX + 1);
  if (!buf)
    return -ENOMEM;
  ssize_t n = pread(fd, buf, STAGE_META_MAX, 0);
  if (n < 0) {
    int r = -errno;
    *ret_why = xasprintf("its meta.json cannot be read: %s", strerror(-r));
    return r;
  }
  json_error_t e;
  json_t *j = json_loadb(buf, (size_t)n, JSON_REJECT_DUPLICATES, &e);
  if (!j) {
    *ret_why = xasprintf("its meta.json is not valid JSON (%s)", e.text);
    return -EBADMSG;
  }
  *m = (struct stage_meta){.j = j};
  m->name = opt_str(j, "name");
  m->id = opt_str(j, "stage_id");
  m->parent = opt_str(j, "parent");
  m->parent_name = opt_str(j, "parent_name");
  m->backend = opt_str(j, "backend");
  m->inputs_id = opt_str(j, "base_id");
  m->carries = opt_str(j, "carries");
  m->digest = opt_str(j, "digest");
  m->owner = opt_str(j, "owner");
  if (!m->owner)
    m->owner = "";
  json_t *b = json_object_get(j, "bytes"), *c = json_object_get(j, "created");
  m->bytes = json_is_integer(b) && json_integer_value(b) >= 0 ? (uint64_t)json_integer_value(b) : 0;
  json_t *ino = json_object_get(j, "inodes");
  m->inodes =
      json_is_integer(ino) && json_integer_value(ino) >= 0 ? (uint64_t)json_integer_value(ino) : 0;
  m->created = json_is_integer(c) ? json_integer_value(c) : 0;
  if (json_integer_value(json_object_get(j, "version")) != 1 || !hex_id(m->id, "st-", 32) ||
      !hex_id(m->digest, "", 32) || !m->backend || !m->inputs_id || !m->carries ||
      (m->parent && !hex_id(m->parent, "st-", 32)) || !json_is_integer(b) || !json_is_integer(c)) {
    json_decref(j);
    m->j = NULL;
    *ret_why = strdup("its meta.json lacks a field or holds a wrong one (version 1 with "
                      "stage_id, digest, backend, base_id, carries, bytes and created)");
    return -EBADMSG;
  }
  return 0;
}

int stage_meta_write(const char *dir, const char *name, const char *id, const char *digest,
                     const struct stage_new *in, uint64_t bytes, uint64_t inodes, int64_t created,
                     char **ret_err) {
  json_t *j = json_pack(
      "{s:i, s:o, s:s, s:o, s:o, s:s, s:s, s:s, s:I, s:I, s:I, s:s}", "version", 1, "name",
      name ? json_string(name) : json_null(), "stage_id", id, "parent",
      in->parent ? json_string(in->parent->id) : json_null(), "parent_name",
      in->parent && in->parent->name ? json_string(in->parent->name) : json_null(), "backend",
      in->backend, "base_id", in->inputs_id, "carries", in->carries, "bytes", (json_int_t)bytes,
      "inodes", (json_int_t)inodes, "created", (json_int_t)created, "digest", digest);
  if (!j)
    abort();
  json_object_set_new(j, "owner", json_string(in->owner ? in->owner : ""));
  _cleanup_free_ char *text = json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS);
  json_decref(j);
  _cleanup_free_ char *p = xasprintf("%s/meta.json", dir);
  _cleanup_close_ int fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  size_t len = strlen(text);
  if (fd < 0 || write(fd, text, len) != (ssize_t)len || write(fd, "\n", 1) != 1 ||
      fsync(fd) < 0) {
    int r = errno ? -errno : -EIO;
    *ret_err = xasprintf("cannot write %s: %s", p, strerror(-r));
    return r;
  }
  return 0;
}

/* The owner recorded by the stage whose directory is DIR, into *RET (to
 * free): 0, or -errno when it has no readable meta. */
static int owner_of(const char *dir, char **ret) {
  _cleanup_free_ char *mp = xasprintf("%s/meta.json", dir);
  _cleanup_close_ int fd = open(mp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  struct stage_meta m;
  _cleanup_free_ char *why = NULL;
  int r = stage_meta_read(fd, &m, &why);
  if (r < 0)
    return r;
  *ret = strdup(m.owner);
  json_decref(m.j);
  return *ret ? 0 : -ENOMEM;
}

/* Whether the stage at DIR is OWNER's; a stage whose meta cannot be read is
 * the owner "" 's, as one made before owners were recorded. */
bool stage_owned_by(const char *dir, const char *owner) {
  _cleanup_free_ char *o = NULL;
  if (owner_of(dir, &o) < 0)
    return !*owner;
  return strcmp(o, owner) == 0;
}
