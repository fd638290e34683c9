/* config.c: IGN_MCP_* settings with defaults, caps and clear refusals.
 *
 * Defaults must work from any working directory (a client starts the server
 * in the user's project), so data files are found relative to the
 * executable: <exe dir>/... in the build tree and
 * <exe dir>/../lib/ignition-mcp/... once installed. */
#include "mcp/config.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

struct config cfg;
static char exe_dir[PATH_MAX];

const char *config_exe_dir(void) { return exe_dir; }

static int parse_uint(const char *name, unsigned long long def, unsigned long long min,
                      unsigned long long max, unsigned long long *ret) {
  const char *v = getenv(name);
  if (!v || !*v) {
    *ret = def;
    return 0;
  }
  char *end;
  errno = 0;
  unsigned long long x = strtoull(v, &end, 10);
  if (errno || *end || v[0] == '-' || x < min || x > max) {
    fprintf(stderr, "ignition-mcp: %s=%s is invalid: give a whole number from %llu to %llu\n",
            name, v, min, max);
    return -EINVAL;
  }
  *ret = x;
  return 0;
}

static bool is_dir(const char *p) {
  struct stat st;
  return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* A rootfs is given by name ("tools", "small") or by path. */
static char *resolve_rootfs(const char *spec) {
  if (strchr(spec, '/'))
    return is_dir(spec) ? realpath(spec, NULL) : NULL;
  const char *const layouts[] = {"%s/rootfs/%s", "%s/../lib/ignition-mcp/rootfs/%s"};
  for (size_t i = 0; i < ARRAY_SIZE(layouts); i++) {
    _cleanup_free_ char *p = xasprintf(layouts[i], exe_dir, spec);
    if (is_dir(p))
      return realpath(p, NULL);
  }
  return NULL;
}

static char *resolve_agent(void) {
  const char *v = getenv("IGN_MCP_AGENT");
  if (v && *v)
    return access(v, X_OK) == 0 ? realpath(v, NULL) : NULL;
  const char *const layouts[] = {"%s/ign-agent", "%s/../lib/ignition-mcp/ign-agent"};
  for (size_t i = 0; i < ARRAY_SIZE(layouts); i++) {
    _cleanup_free_ char *p = xasprintf(layouts[i], exe_dir);
    if (access(p, X_OK) == 0)
      return realpath(p, NULL);
  }
  return NULL;
}

int config_load(void) {
  ssize_t n = readlink("/proc/self/exe", exe_dir, sizeof exe_dir - 1);
  if (n > 0) {
    exe_dir[n] = '\0';
    char *slash = strrchr(exe_dir, '/');
    if (slash)
      *slash = '\0';
  } else {
    strcpy(exe_dir, ".");
  }

  const char *b = getenv("IGN_MCP_BACKEND");
  if (!b || !*b || strcmp(b, "auto") == 0)
    cfg.backend = BACKEND_AUTO;
  else if (strcmp(b, "ns") == 0)
    cfg.backend = BACKEND_NS;
  else if (strcmp(b, "vm") == 0)
    cfg.backend = BACKEND_VM;
  else {
    fprintf(stderr, "ignition-mcp: IGN_MCP_BACKEND=%s is invalid: use auto, vm or ns\n", b);
    return -EINVAL;
  }

  unsigned long long v;
  int r = 0;
#define U(name, def, min, max, field)                   \
  do {                                                  \
    if (parse_uint(name, def, min, max, &v) < 0)        \
      r = -EINVAL;                                      \
    else                                                \
      cfg.field = (__typeof__(cfg.field))v;             \
  } while (0)
  U("IGN_MCP_MAX_SESSIONS", 8, 1, 1024, max_sessions);
  U("IGN_MCP_IDLE_SECS", 600, 1, 30 * 24 * 3600, idle_secs);
  U("IGN_MCP_OUTPUT_CAP", 65536, 0, 16 << 20, output_cap);
  U("IGN_MCP_MAX_MESSAGE", 64 << 20, 4096, 1ull << 30, max_message);
  U("IGN_MCP_MAX_FILE", 32 << 20, 0, 256 << 20, max_file);
  U("IGN_MCP_MAX_STDIN", 8 << 20, 0, 16 << 20, max_stdin);
  U("IGN_MCP_MEMORY_MB", 1024, 16, 1 << 20, memory_mb);
  U("IGN_MCP_PIDS", 1024, 8, 1 << 22, pids);
  U("IGN_MCP_OVERLAY_MB", 1024, 1, 1 << 20, overlay_mb);
#undef U
  if (r < 0)
    return r;
  cfg.net = getenv("IGN_MCP_NET") && *getenv("IGN_MCP_NET");

  const char *rs = getenv("IGN_MCP_ROOTFS");
  cfg.rootfs_spec = strdup(rs && *rs ? rs : "tools");
  cfg.rootfs = resolve_rootfs(cfg.rootfs_spec);
  cfg.agent = resolve_agent();
  return 0;
}
