/* stage_kept.c: kept stages, the saved state of hibernated sessions (see
 * stage.h).  A hibernation is made as an anonymous stage (.anon-<pid>-<n>,
 * which goes with its server), then moved to .hib-<session id>, which
 * stage_gc passes over: it stays on the store, held by nobody, until a
 * server resumes the session (moved back to .anon- of that server, which
 * the running session uses) or drops it (closed, expired, evicted).  Every
 * move is made under the names lock, as for named stages. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "sandbox/stage_int.h"

/* A key is one path component of safe characters (a session id). */
static bool key_ok(const char *key) {
  size_t n = strlen(key);
  if (n == 0 || n > 64 || key[0] == '.')
    return false;
  for (const char *p = key; *p; p++)
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
          *p == '-' || *p == '.' || *p == '_'))
      return false;
  return true;
}

static char *kept_dir(const char *key) { return xasprintf("%s/stages/.hib-%s", cfg.store, key); }

int stage_keep(struct stage *s, const char *key, char **ret_err) {
  if (!key_ok(key) || s->name) {
    *ret_err = xasprintf("'%s' cannot name a kept stage", key);
    return -EINVAL;
  }
  int lock = stage_names_lock(ret_err);
  if (lock < 0)
    return lock;
  char *dir = kept_dir(key);
  int r = 0;
  if (renameat2(AT_FDCWD, s->dir, AT_FDCWD, dir, RENAME_NOREPLACE) < 0) {
    r = -errno;
    /* One left by a resume that could not move it back: nobody's now. */
    if (r == -EEXIST && stage_delete_if_free(dir))
      r = renameat2(AT_FDCWD, s->dir, AT_FDCWD, dir, RENAME_NOREPLACE) < 0 ? -errno : 0;
  }
  close(lock);
  if (r < 0) {
    *ret_err = xasprintf("cannot move %s to %s: %s", s->dir, dir, strerror(-r));
    free(dir);
    return r;
  }
  stage_reg_relocate(s, dir, true);
  return 0;
}

void stage_unkeep(struct stage *s) {
  _cleanup_free_ char *err = NULL;
  char *anon = stage_aside_path("anon");
  int lock = stage_names_lock(&err);
  if (lock >= 0 && renameat2(AT_FDCWD, s->dir, AT_FDCWD, anon, RENAME_NOREPLACE) == 0) {
    close(lock);
    stage_reg_relocate(s, anon, false);
    return;
  }
  if (lock >= 0) {
    err = xasprintf("cannot move %s to %s: %s", s->dir, anon, strerror(errno));
    close(lock);
  }
  /* Left where it is: it goes with its last reference all the same (or,
   * if this server dies first, with the sweep of the next: its record no
   * longer says it is hibernated). */
  log_warn("%s; %s is removed when its session ends", err, s->dir);
  free(anon);
  stage_reg_relocate(s, NULL, false);
}

void stage_discard(struct stage *s) { stage_reg_relocate(s, NULL, false); }

int stage_open_kept(const char *key, const char *what, const char *owner, const char *backend,
                    const char *inputs_id, struct stage **ret, char **ret_err) {
  if (!key_ok(key)) {
    *ret_err = xasprintf("%s has no saved state on the store", what);
    return -ENOENT;
  }
  _cleanup_free_ char *dir = kept_dir(key), *name = xasprintf("hibernation of %s", key);
  _cleanup_free_ char *err = NULL;
  int r = stage_open_dir(name, dir, true, owner, backend, inputs_id, ret, &err);
  if (r == 0)
    return 0;
  if (r == -ENOENT)
    *ret_err = xasprintf("%s has no saved state on the store any more (%s was removed)", what,
                         dir);
  else if (r == -EXDEV)
    *ret_err = xasprintf("%s was hibernated by a server of another backend; this server runs "
                         "the %s backend: resume it on a server of the other, or close it",
                         what, backend);
  else if (r == -ESTALE)
    *ret_err = xasprintf("%s was hibernated over other inputs than this server's (the kernel, "
                         "QEMU, image or agent changed; base %s now): it cannot resume safely "
                         "and was not started. Resume it on a server with the inputs it was "
                         "saved over, or close it. (%s)",
                         what, inputs_id, err);
  else
    *ret_err = xasprintf("%s cannot be resumed: its saved state on the store fails its checks "
                         "(%s); close it",
                         what, r == -EBADMSG ? "its files do not match their checksums" : strerror(-r));
  return r;
}

void stage_remove_kept(const char *key) {
  if (!key_ok(key))
    return;
  _cleanup_free_ char *dir = kept_dir(key);
  stage_delete_later_or_now(dir);
}

void stage_kept_sweep(bool (*orphan)(const char *key)) {
  _cleanup_free_ char *sd = stage_store_dir();
  DIR *d = opendir(sd);
  struct dirent *e;
  unsigned n = 0;
  while (d && (e = readdir(d))) {
    if (strncmp(e->d_name, ".hib-", 5) != 0 || !key_ok(e->d_name + 5) || !orphan(e->d_name + 5))
      continue;
    _cleanup_free_ char *dir = kept_dir(e->d_name + 5), *err = NULL;
    int lock = stage_names_lock(&err);
    if (lock < 0)
      break;
    n += stage_delete_if_free(dir);
    close(lock);
  }
  if (d)
    closedir(d);
  if (n)
    log_info("removed %u kept stage(s) of hibernations whose records are gone", n);
}
