/* fuzz.h: what the fuzz targets of the server's MCP side share. */
#pragma once

#include <stdlib.h>

#include "common/config.h"
#include "common/log.h"
#include "session/session.h"

/* Settings with no sandbox backend (an agent and a rootfs that do not
 * exist), so that no input can make a target run a command, and a quiet
 * log.  Aborts if a backend starts after all. */
static inline void fuzz_server_without_backend(void) {
  setenv("IGN_MCP_BACKEND", "ns", 1);
  setenv("IGN_MCP_AGENT", "/nonexistent/ign-agent", 1);
  setenv("IGN_MCP_ROOTFS", "/nonexistent/rootfs", 1);
  /* The stage tools read and change the store: never the real one. */
  setenv("IGN_MCP_STORE", "/nonexistent/store", 1);
  log_set_stderr_level(LOG_EMERGENCY);
  if (config_load() < 0)
    abort();
  char *err = NULL;
  if (sessions_init(&err) == 0)
    abort();
  free(err);
}
