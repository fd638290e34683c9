/* session_reaper.c: the idle reaper.  A thread that wakes a few times per
 * IGN_MCP_IDLE_SECS and closes each session no call has used for that long
 * (none busy, resetting or without a sandbox).  This is where an idle
 * session ends. */
#include "session/session.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "session/session_int.h"

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
      uint64_t now = mono_ms();
      struct session *victim = NULL;
      for (struct session *s = session_table; s; s = s->next)
        if (!s->busy && !s->resetting && s->h &&
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
