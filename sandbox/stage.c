/* stage.c: the stage store's verbs on names (see stage.h), and the stages
 * this server holds: a table of them by the inode of their meta.json (a
 * stage's identity while it is held), with their references and the
 * sessions started from them.  Opening a stage holds its meta and its
 * directory under the names lock, then checks it (stage_verify.c); info and
 * list read the metas; rm moves a stage aside, to be deleted when nobody
 * holds it (stage_lock.c).  The rest of the store: see stage_int.h. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "sandbox/stage_int.h"

/* ---- the registry of open stages ---- */

/* A struct stage with what only this file sees. */
struct stage_obj {
  struct stage s;
  dev_t dev;      /* meta.json's inode: the stage's identity while held */
  ino_t ino;
  char *old_dir;  /* the dir before it was moved aside (a caller may still read it) */
};

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static struct stage_obj **reg;
static size_t reg_n, reg_cap;

static struct stage_obj *reg_find(dev_t dev, ino_t ino) {
  for (size_t i = 0; i < reg_n; i++)
    if (reg[i]->dev == dev && reg[i]->ino == ino)
      return reg[i];
  return NULL;
}

static void reg_add(struct stage_obj *o) {
  if (reg_n == reg_cap) {
    reg_cap = reg_cap ? reg_cap * 2 : 8;
    struct stage_obj **n = realloc(reg, reg_cap * sizeof *n);
    if (!n)
      abort();
    reg = n;
  }
  reg[reg_n++] = o;
}

static void reg_del(struct stage_obj *o) {
  for (size_t i = 0; i < reg_n; i++)
    if (reg[i] == o) {
      reg[i] = reg[--reg_n];
      return;
    }
}

static struct stage_obj *obj_new(const struct stage_meta *m, const char *dir, int dir_fd,
                                 int hold_fd, const struct stat *st) {
  struct stage_obj *o = calloc(1, sizeof *o);
  if (!o)
    abort();
  o->s.name = dup_or_null(m->name);
  o->s.id = dup_or_null(m->id);
  o->s.parent = dup_or_null(m->parent);
  o->s.parent_name = dup_or_null(m->parent_name);
  o->s.backend = dup_or_null(m->backend);
  o->s.inputs_id = dup_or_null(m->inputs_id);
  o->s.carries = dup_or_null(m->carries);
  o->s.owner = dup_or_null(m->owner ? m->owner : "");
  o->s.dir = dup_or_null(dir);
  o->s.bytes = m->bytes;
  o->s.created = m->created;
  o->s.refs = 1;
  o->s.hold_fd = hold_fd;
  o->s.dir_fd = dir_fd;
  o->dev = st->st_dev;
  o->ino = st->st_ino;
  return o;
}

static void obj_free(struct stage_obj *o) {
  if (o->s.hold_fd >= 0)
    close(o->s.hold_fd);
  if (o->s.dir_fd >= 0)
    close(o->s.dir_fd);
  free(o->s.name);
  free(o->s.id);
  free(o->s.parent);
  free(o->s.parent_name);
  free(o->s.backend);
  free(o->s.inputs_id);
  free(o->s.carries);
  free(o->s.owner);
  free(o->s.dir);
  free(o->old_dir);
  free(o);
}

struct stage *stage_reg_new(const struct stage_meta *m, const char *dir, int dir_fd, int hold_fd,
                            const struct stat *st) {
  struct stage_obj *o = obj_new(m, dir, dir_fd, hold_fd, st);
  pthread_mutex_lock(&reg_lock);
  reg_add(o);
  pthread_mutex_unlock(&reg_lock);
  return &o->s;
}

/* The stage moved from its name to ASIDE (under the names lock): a held
 * one goes with its last reference. */
void stage_reg_moved(const char *aside) {
  _cleanup_free_ char *meta = xasprintf("%s/meta.json", aside);
  struct stat st;
  if (stat(meta, &st) < 0)
    return;
  pthread_mutex_lock(&reg_lock);
  struct stage_obj *o = reg_find(st.st_dev, st.st_ino);
  if (o) {
    free(o->old_dir);
    o->old_dir = o->s.dir;
    o->s.dir = dup_or_null(aside);
    o->s.removed = true;
  }
  pthread_mutex_unlock(&reg_lock);
}

void stage_reg_relocate(struct stage *s, char *dir, bool kept) {
  pthread_mutex_lock(&reg_lock);
  if (dir) {
    free(s->dir);
    s->dir = dir;
  }
  s->kept = kept;
  pthread_mutex_unlock(&reg_lock);
}

/* ---- opening ---- */

static char *no_such(const char *name) {
  return xasprintf("no stage named '%s' (stage_list shows the stages in %s)", name, cfg.store);
}

/* Reads the meta of stage NAME from FD for OWNER: another owner's stage is
 * not there for it, and whose a damaged meta is cannot be read, so only the
 * owner of old stages, "", hears that it is damaged.  *M holds a reference
 * the caller drops (json_decref(m->j)) when this returns 0. */
static int meta_read_owned(int fd, const char *name, const char *owner, struct stage_meta *m,
                           char **ret_err) {
  _cleanup_free_ char *why = NULL;
  int r = stage_meta_read(fd, m, &why);
  if (r < 0) {
    *ret_err = *owner ? no_such(name)
                      : xasprintf("stage '%s' is damaged: %s; remove it with stage_rm and "
                                  "commit it again",
                                  name, why);
    return *owner ? -ENOENT : r;
  }
  if (strcmp(m->owner, owner) != 0) {
    json_decref(m->j);
    *ret_err = no_such(name);
    return -ENOENT;
  }
  return 0;
}

/* Opens and holds NAME's meta.json, and opens its directory, under the
 * names lock, so that neither is moved aside in between: the meta's fd
 * (*RET_DIR_FD the directory's, O_PATH: the stage is checked through it and
 * its files are opened relative to it), or -errno with *ret_err. */
static int open_held(const char *name, const char *dir, int *ret_dir_fd, char **ret_err) {
  int lock = stage_names_lock(ret_err);
  if (lock < 0)
    return lock;
  int fd = stage_hold(dir);
  int dfd = fd >= 0 ? open(dir, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : -1;
  int e = errno;
  close(lock);
  if (fd >= 0 && dfd < 0) {
    close(fd);
    fd = -e;
  }
  if (fd == -ENOENT || fd == -ENOTDIR || fd == -ELOOP) {
    struct stat st;
    if (fd == -ENOENT && lstat(dir, &st) == 0) {
      *ret_err = xasprintf("stage '%s' has no meta.json (it is damaged): remove it with "
                           "stage_rm and commit it again",
                           name);
      return -EBADMSG;
    }
    *ret_err = no_such(name);
    return -ENOENT;
  }
  if (fd < 0)
    *ret_err = xasprintf("cannot open stage '%s' (%s/meta.json): %s", name, dir, strerror(-fd));
  else
    *ret_dir_fd = dfd;
  return fd;
}

int stage_open(const char *name, const char *owner, const char *backend, const char *inputs_id,
               struct stage **ret, char **ret_err) {
  int r = stage_name_check(name, ret_err);
  if (r < 0)
    return r;
  _cleanup_free_ char *dir = stage_name_dir(name);
  return stage_open_dir(name, dir, false, owner, backend, inputs_id, ret, ret_err);
}

int stage_open_dir(const char *name, const char *dir, bool kept, const char *owner,
                   const char *backend, const char *inputs_id, struct stage **ret,
                   char **ret_err) {
  int r;
  _cleanup_close_ int dir_fd = -1;
  _cleanup_close_ int fd = open_held(name, dir, &dir_fd, ret_err);
  if (fd == -EBADMSG && *owner) {
    /* No meta, so no owner: the owner "" 's, to anyone else a name nobody made. */
    free(*ret_err);
    *ret_err = no_such(name);
    return -ENOENT;
  }
  if (fd < 0)
    return fd;
  struct stat st;
  if (fstat(fd, &st) < 0) {
    r = -errno;
    *ret_err = xasprintf("cannot open stage '%s': %s", name, strerror(errno));
    return r;
  }
  struct stage_meta m;
  if ((r = meta_read_owned(fd, name, owner, &m, ret_err)) < 0)
    return r;
  if ((r = stage_verify(name, dir_fd, &m, backend, inputs_id, ret_err)) == 0) {
    pthread_mutex_lock(&reg_lock);
    struct stage_obj *o = reg_find(st.st_dev, st.st_ino);
    if (o) {
      o->s.refs++;
    } else {
      m.name = kept ? NULL : name; /* where it is now, whatever it was made as */
      o = obj_new(&m, dir, steal_fd(dir_fd), steal_fd(fd), &st);
      o->s.kept = kept;
      reg_add(o);
    }
    pthread_mutex_unlock(&reg_lock);
    *ret = &o->s;
  }
  json_decref(m.j);
  return r;
}

void stage_ref(struct stage *s) {
  pthread_mutex_lock(&reg_lock);
  s->refs++;
  pthread_mutex_unlock(&reg_lock);
}

void stage_unref(struct stage *s) {
  if (!s)
    return;
  struct stage_obj *o = (struct stage_obj *)s;
  pthread_mutex_lock(&reg_lock);
  bool last = --s->refs == 0;
  if (last)
    reg_del(o);
  pthread_mutex_unlock(&reg_lock);
  if (!last)
    return;
  bool gone = (s->removed || !s->name) && !s->kept;
  /* Moved aside by another server (or by an rm of this one that raced this
   * last reference): the name holds another inode, or none. */
  bool moved = false;
  if (!gone) {
    _cleanup_free_ char *meta = xasprintf("%s/meta.json", s->dir);
    struct stat st;
    moved = lstat(meta, &st) < 0 || st.st_dev != o->dev || st.st_ino != o->ino;
  }
  _cleanup_free_ char *dir = gone ? strdup(s->dir) : NULL;
  obj_free(o); /* closes hold_fd */
  if (dir)
    stage_delete_later_or_now(dir);
  else if (moved)
    stage_gc();
}

void stage_sessions_add(struct stage *s, int delta) {
  pthread_mutex_lock(&reg_lock);
  if (delta < 0 && s->sessions < (unsigned)-delta)
    s->sessions = 0;
  else
    s->sessions += (unsigned)delta;
  pthread_mutex_unlock(&reg_lock);
}

/* ---- listing ---- */

/* The sessions of this server started from the stage whose meta is FD. */
static unsigned sessions_of(int fd) {
  struct stat st;
  if (fstat(fd, &st) < 0)
    return 0;
  pthread_mutex_lock(&reg_lock);
  struct stage_obj *o = reg_find(st.st_dev, st.st_ino);
  unsigned n = o ? o->s.sessions : 0;
  pthread_mutex_unlock(&reg_lock);
  return n;
}

/* NAME is where the stage is (its meta's name is what it was made as). */
static json_t *meta_json(const char *name, const struct stage_meta *m, unsigned sessions) {
  json_t *j = json_pack("{s:s?, s:s, s:s?, s:s?, s:s, s:s, s:s, s:I, s:I, s:i}", "name", name,
                        "stage_id", m->id, "parent", m->parent_name ? m->parent_name : m->parent,
                        "parent_id", m->parent, "carries", m->carries, "backend", m->backend,
                        "base_id", m->inputs_id, "bytes", (json_int_t)m->bytes, "created",
                        (json_int_t)m->created, "sessions", (int)sessions);
  if (!j)
    abort();
  return j;
}

static int cmp_stage_names(const void *a, const void *b) {
  json_t *const *x = a, *const *y = b;
  return strcmp(json_string_value(json_object_get(*x, "name")),
                json_string_value(json_object_get(*y, "name")));
}

json_t *stage_list(const char *owner) {
  json_t *arr = json_array();
  _cleanup_free_ char *sd = stage_store_dir();
  DIR *d = opendir(sd);
  size_t n = 0, cap = 0;
  json_t **items = NULL;
  struct dirent *e;
  while (d && (e = readdir(d))) {
    if (e->d_name[0] == '.')
      continue;
    _cleanup_free_ char *name = strdup(e->d_name), *bad = NULL;
    if (!name)
      abort();
    for (char *p = name; *p; p++)
      if (*p == '+')
        *p = '/';
    if (stage_name_check(name, &bad) < 0)
      continue; /* not made by a server: no name could open it */
    _cleanup_free_ char *mp = xasprintf("%s/%s/meta.json", sd, e->d_name);
    _cleanup_close_ int fd = open(mp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    struct stage_meta m;
    _cleanup_free_ char *why = NULL;
    if (fd < 0 || stage_meta_read(fd, &m, &why) < 0) {
      log_warn("stage '%s' is not listed: %s; remove it with stage_rm", name,
               why ? why : "it has no meta.json");
      continue;
    }
    if (strcmp(m.owner, owner) != 0) {
      json_decref(m.j);
      continue;
    }
    if (n == cap) {
      cap = cap ? cap * 2 : 16;
      json_t **ni = realloc(items, cap * sizeof *ni);
      if (!ni)
        abort();
      items = ni;
    }
    items[n++] = meta_json(name, &m, sessions_of(fd));
    json_decref(m.j);
  }
  if (d)
    closedir(d);
  if (n)
    qsort(items, n, sizeof *items, cmp_stage_names);
  for (size_t i = 0; i < n; i++)
    json_array_append_new(arr, items[i]);
  free(items);
  json_t *j = json_pack("{s:o, s:I, s:I}", "stages", arr, "bytes_used",
                        (json_int_t)stage_space_used(NULL), "bytes_max",
                        (json_int_t)((uint64_t)cfg.stages_max_mb * MiB));
  if (!j)
    abort();
  return j;
}

int stage_info(const char *name, const char *owner, json_t **ret, char **ret_err) {
  int r = stage_name_check(name, ret_err);
  if (r < 0)
    return r;
  _cleanup_free_ char *dir = stage_name_dir(name);
  _cleanup_free_ char *mp = xasprintf("%s/meta.json", dir);
  _cleanup_close_ int fd = open(mp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    r = -errno;
    *ret_err = r == -ENOENT || r == -ENOTDIR ? no_such(name)
                                            : xasprintf("cannot read %s: %s", mp, strerror(-r));
    return r == -ENOTDIR ? -ENOENT : r;
  }
  struct stage_meta m;
  if ((r = meta_read_owned(fd, name, owner, &m, ret_err)) < 0)
    return r;
  *ret = meta_json(name, &m, sessions_of(fd));
  json_decref(m.j);
  return 0;
}

int stage_rm(const char *name, const char *owner, char **ret_err) {
  int r = stage_name_check(name, ret_err);
  if (r < 0)
    return r;
  _cleanup_free_ char *dir = stage_name_dir(name);
  _cleanup_free_ char *rm = stage_aside_path("rm");
  int lock = stage_names_lock(ret_err);
  if (lock < 0)
    return lock;
  /* Checked under the names lock: the stage cannot be replaced by another
   * owner's between the check and the rename. */
  struct stat st;
  if (lstat(dir, &st) == 0 && !stage_owned_by(dir, owner)) {
    *ret_err = no_such(name);
    r = -ENOENT;
  } else if (renameat2(AT_FDCWD, dir, AT_FDCWD, rm, RENAME_NOREPLACE) < 0) {
    r = -errno;
    *ret_err = r == -ENOENT ? no_such(name)
                            : xasprintf("cannot move %s aside to %s: %s", dir, rm, strerror(-r));
  } else {
    stage_reg_moved(rm);
    if (!stage_delete_if_free(rm))
      log_info("stage '%s' is removed; its files go when its last session ends", name);
  }
  close(lock);
  return r;
}
