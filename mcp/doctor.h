/* doctor.h: `ignition-mcp doctor`: checks everything a session needs and
 * says, for whatever is missing, the command that fixes it. */
#pragma once

#include <stdbool.h>

/* Runs every check and prints one line per check to stdout (a JSON object
 * with AS_JSON).  Returns the exit status: 0 when sessions can open with the
 * configured backend (IGN_MCP_BACKEND), 1 when they cannot.  config_load()
 * must have succeeded. */
int doctor_main(bool as_json);

/* For a server whose backend cannot start: the checks that fail for the
 * configured backend, one per line with their fixes (malloc'd).  It runs
 * every check, which can take seconds (QEMU is started twice, a cgroup and
 * namespaces are made), so it is not for the main thread; calls must not
 * overlap (the test cgroup's name is per process). */
char *doctor_explain(void);
