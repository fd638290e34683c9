/* session_backend.c: the sandbox backend that serves sessions.
 * sessions_init picks it (the microVM one, or the namespace one, as
 * IGN_MCP_BACKEND and the host allow) and starts the idle reaper; without
 * one, open_session's error says why and what to do.  Also whether the
 * backend can save and start from stages. */
#include "session/session.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "sandbox/sandbox.h"
#include "sandbox/stage.h"
#include "sandbox/vm.h"
#include "session/session_int.h"

const struct sandbox_ops *session_ops;
char *session_backend_error;
struct sandbox_config session_sb_cfg;

const char *sessions_backend(void) { return session_ops ? session_ops->name : "none"; }

/* Without a backend, open_session's error explains what is missing.  The
 * explanation runs checks that take seconds, so it is made when asked for,
 * on that call's thread, and reused while it is fresh.  One at a time: the
 * checks make a test cgroup whose name is the same for every call. */
#define HELP_FRESH_MS 5000u

static pthread_mutex_t help_lock = PTHREAD_MUTEX_INITIALIZER;
static char *(*help_explain)(void);
static char *help_text;
static uint64_t help_made_ms;

void sessions_set_unavailable_help(char *(*explain)(void)) { help_explain = explain; }

/* The current explanation (malloc'd), or NULL when there is none. */
char *session_unavailable_help(void) {
  if (!help_explain)
    return NULL;
  pthread_mutex_lock(&help_lock);
  if (!help_text || mono_ms() - help_made_ms >= HELP_FRESH_MS) {
    free(help_text);
    help_text = help_explain();
    help_made_ms = mono_ms();
  }
  char *text = help_text ? strdup(help_text) : NULL;
  pthread_mutex_unlock(&help_lock);
  return text;
}

bool session_stages_supported(char **ret_err) {
  if (session_ops && session_ops->snapshot && session_ops->inputs_id)
    return true;
  *ret_err = xasprintf("stages are not available: the %s backend cannot save or start from "
                       "them",
                       sessions_backend());
  return false;
}

int sessions_init(char **ret_err) {
  session_sb_cfg = (struct sandbox_config){
      .rootfs = cfg.rootfs, .agent = cfg.agent, .memory_mb = cfg.memory_mb,
      .pids = cfg.pids, .overlay_mb = cfg.overlay_mb,
      .ns_uid_base = cfg.ns_uid_base,
  };
  int r = 0;
  if (cfg.backend != BACKEND_NS) {
    _cleanup_free_ char *err = NULL;
    r = vm_backend_init(&err);
    if (r == 0) {
      session_ops = &sandbox_vm_ops;
      goto started;
    }
    if (cfg.backend == BACKEND_VM) {
      session_backend_error = xasprintf("the microVM backend cannot run: %s", err);
      goto started;
    }
    log_info("the microVM backend is not available (%s); using the namespace backend", err);
    r = 0;
  }
  if (!cfg.agent) {
    _cleanup_free_ char *deflt = xasprintf("%s/ign-agent", config_exe_dir());
    session_backend_error = config_missing_why("IGN_MCP_AGENT", deflt, "an executable file");
    r = -ENOENT;
  } else if (!cfg.rootfs) {
    session_backend_error = xasprintf("the rootfs '%s' was not found; build the images with "
                                      "`make images` (or scripts/setup.sh) or point "
                                      "IGN_MCP_ROOTFS at a rootfs directory",
                                      cfg.rootfs_spec);
    r = -ENOENT;
  } else {
    /* A user namespace first: as a user, whether the host allows one is
     * the first thing that decides whether the backend can run. */
    _cleanup_free_ char *err = NULL;
    r = ns_probe(&err);
    if (r < 0) {
      session_backend_error = xasprintf("the namespace backend cannot run: %s", err);
    } else {
      session_ops = &sandbox_ns_ops;
      cgroup_cleanup_stale();
    }
  }
started:
  session_records_init();
  if (cfg.host_id[0])
    log_info("host id %s (IGN_MCP_HOST_ID): every session id starts with '%s.'", cfg.host_id,
             cfg.host_id);
  if (r < 0 && ret_err)
    *ret_err = strdup(session_backend_error);
  /* What servers that died left in the stages (unfinished commits, their
   * forks' anonymous stages). */
  if (session_ops && session_ops->snapshot)
    stage_gc();

  session_reaper_start();
  return r;
}
