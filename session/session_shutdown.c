/* session_shutdown.c: ending every session when the server exits.  Live
 * sessions are hibernated first, within a bound (IGN_MCP_SHUTDOWN_ACTION,
 * session_hibernate_all), and every hibernated one is left on the store for
 * the next server; then the table is closed at once (each sandbox killed,
 * its calls failing), the sandboxes still being started are killed, and
 * shutdown waits, for a bounded time, until their makers have destroyed
 * them. */
#include "session/session.h"

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "common/log.h"
#include "common/util.h"
#include "sandbox/sandbox.h"
#include "sandbox/stage.h"
#include "sandbox/vm.h"
#include "session/session_int.h"

#define SHUTDOWN_MAKING_WAIT_MS 30000u

void sessions_shutdown(void) {
  struct handle *dead[1024];
  size_t n_dead = 0;
  /* Nothing opened, reset or resumed from here on: what is hibernated now
   * stays so. */
  pthread_mutex_lock(&session_lock);
  session_draining = true;
  session_table_unlock();
  bool keep = session_hibernate_all();
  pthread_mutex_lock(&session_lock);
  session_shutting_down = true;
  unsigned kept = 0;
  for (struct session *s = session_table; s; s = s->next) {
    /* (One taken from the store and not resumed here goes back there.) */
    if ((keep || s->adopted) && s->hibernated && !s->resetting && s->hibernated->kept &&
        s->record_fd >= 0) {
      s->outlives = true;
      kept++;
    } else if (keep && !s->ephemeral && !s->h && !s->hibernated) {
      /* (The ones hibernate_all could not save, it named.) */
      log_warn("session %s is closed with the server, not hibernated: it was being reset",
               s->id);
    }
  }
  if (kept)
    log_info("%u hibernated session(s) stay on the store: a server started on it resumes each "
             "at its first call",
             kept);
  while (session_table) {
    struct handle *d = session_close_locked(session_table, "closed (the server is shutting down)");
    if (d && n_dead < ARRAY_SIZE(dead))
      dead[n_dead++] = d;
  }
  /* Sandboxes still starting: their makers see the kill and destroy them. */
  for (struct making *m = session_making; m; m = m->next)
    if (m->sb)
      m->sb->ops->kill(m->sb);
  pthread_cond_broadcast(&session_cond);
  session_table_unlock();
  for (size_t i = 0; i < n_dead; i++)
    handle_free(dead[i]);
  if (session_ops == &sandbox_vm_ops)
    vm_backend_shutdown();
  /* Then wait for every open and reset still making one, so none is left
   * behind when the server exits.  Those whose sandbox exists were killed
   * and end at once, and a vm create waiting for the warm base gives up
   * when the backend stops; one that is itself making a base again (its
   * inputs changed) may take longer than a shutdown should: that wait is
   * bounded. */
  uint64_t deadline = mono_ms() + SHUTDOWN_MAKING_WAIT_MS;
  pthread_mutex_lock(&session_lock);
  if (session_n_making > 0)
    log_info("waiting for %u sandbox(es) still starting to be cleaned up", session_n_making);
  while (session_n_making > 0 && mono_ms() < deadline) {
    struct timespec ts = timespec_in(CLOCK_REALTIME, 100);
    pthread_cond_timedwait(&session_cond, &session_lock, &ts);
  }
  if (session_n_making > 0)
    log_warn("%u sandbox(es) still being started after %u s; exiting without them (their "
             "processes die with the server; the next server removes what they left)",
             session_n_making, SHUTDOWN_MAKING_WAIT_MS / 1000);
  session_table_unlock();
}
