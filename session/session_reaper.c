/* session_reaper.c: the idle reaper.  A thread that wakes a few times per
 * IGN_MCP_IDLE_SECS and hibernates (IGN_MCP_IDLE_ACTION=hibernate, where the
 * backend can save sessions) or closes each session no call has used for
 * that long (none busy, resetting, being saved or without a sandbox), and
 * closes what has been hibernated for IGN_MCP_HIBERNATE_KEEP_SECS. */
#include "session/session.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "session/session_int.h"

/* Hibernates idle session ID of OWNER (the lock not held), whose
 * last_used_ms the reaper set to USED_MS; one that cannot be is closed
 * (session_hibernate_idle), unless a call came for it meanwhile. */
static void hibernate_idle(const char *id, const char *owner, uint64_t used_ms) {
  _cleanup_free_ char *err = NULL;
  int r = session_hibernate_idle(id, owner, used_ms, &err);
  if (r == 0)
    log_info("session %s hibernated after %u s idle", id, cfg.idle_secs);
  else if (r == -ECANCELED)
    log_warn("session %s reaped after %u s idle: it could not be hibernated: %s", id,
             cfg.idle_secs, err ? err : "?");
  else
    log_info("session %s was not hibernated (%s); it is in use again", id, err ? err : "?");
}

static void *reaper_main(void *unused) {
  (void)unused;
  for (;;) {
    unsigned tick_ms = cfg.idle_secs * 1000 / 4;
    if (tick_ms > 1000)
      tick_ms = 1000;
    if (tick_ms < 100)
      tick_ms = 100;
    usleep(tick_ms * 1000);
    for (;;) {
      pthread_mutex_lock(&session_lock);
      if (session_shutting_down) {
        session_table_unlock();
        return NULL;
      }
      if (session_expire_hibernated_locked()) {
        pthread_cond_broadcast(&session_cond);
        session_table_unlock();
        continue;
      }
      uint64_t now = mono_ms();
      struct session *victim = NULL;
      for (struct session *s = session_table; s; s = s->next)
        if (!s->busy && !s->resetting && !s->snapshotting && s->h && !s->ephemeral &&
            now - s->last_used_ms >= (uint64_t)cfg.idle_secs * 1000) {
          victim = s;
          break;
        }
      if (!victim) {
        session_table_unlock();
        break;
      }
      char id[SESSION_ID_MAX];
      memcpy(id, victim->id, sizeof id);
      if (cfg.idle_hibernate && cfg.hibernate_max_mb && session_ops && session_ops->snapshot) {
        /* Not picked again while it is being hibernated: it counts as used now. */
        victim->last_used_ms = now;
        _cleanup_free_ char *owner = strdup(victim->owner);
        session_table_unlock();
        if (owner)
          hibernate_idle(id, owner, now);
        continue;
      }
      struct handle *dead = session_close_locked(victim, "reaped after being idle");
      pthread_cond_broadcast(&session_cond);
      session_table_unlock();
      handle_free(dead);
      log_info("session %s reaped after %u s idle", id, cfg.idle_secs);
    }
  }
}

void session_reaper_start(void) {
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_create(&t, &attr, reaper_main, NULL);
  pthread_attr_destroy(&attr);
}
