/* config.c: IGN_MCP_* settings with defaults, caps and clear refusals.
 *
 * Defaults must work from any working directory (a client starts the server
 * in the user's project), so data files are found relative to the
 * executable: <exe dir>/... in the build tree and
 * <exe dir>/../lib/ignition-mcp/... once installed. */
#include "common/config.h"

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

const char *config_net_name(void) {
  return cfg.net == NET_OFF ? "off" : cfg.net == NET_OPEN ? "open" : "allow";
}

const char *config_backend_name(void) {
  return cfg.backend == BACKEND_VM ? "vm" : cfg.backend == BACKEND_NS ? "ns" : "auto";
}

char *config_missing_why(const char *var, const char *deflt, const char *what) {
  const char *v = var ? getenv(var) : NULL;
  if (v && *v)
    return xasprintf("%s=%s is not %s", var, v, what);
  if (!strchr(deflt, '/'))
    return xasprintf("%s is not in PATH", deflt);
  size_t n = strlen(exe_dir);
  if (strncmp(deflt, exe_dir, n) != 0 || deflt[n] != '/')
    return xasprintf("%s does not exist", deflt);
  /* <exe dir>/SUB/NAME: the two places a default is looked for. */
  const char *rel = deflt + n + 1, *name = strrchr(rel, '/');
  int sub_len = name ? (int)(name - rel) : 0;
  name = name ? name + 1 : rel;
  _cleanup_free_ char *lib = xasprintf("%s/../lib/ignition-mcp", exe_dir);
  _cleanup_free_ char *lib_real = realpath(lib, NULL);
  return xasprintf("%s is neither in %s%s%.*s nor in %s%s%.*s", name, exe_dir,
                   sub_len ? "/" : "", sub_len, rel, lib_real ? lib_real : lib,
                   sub_len ? "/" : "", sub_len, rel);
}

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

bool config_host_id_valid(const char *s, size_t n) {
  if (n < 1 || n > CONFIG_HOST_ID_MAX || !(s[0] >= 'a' && s[0] <= 'z'))
    return false;
  for (size_t i = 1; i < n; i++)
    if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '-'))
      return false;
  return true;
}

/* IGN_MCP_HOST_ID: checked here, so that a server behind a front proxy never
 * starts with an id the proxy could not route on. */
static int load_host_id(void) {
  const char *v = getenv("IGN_MCP_HOST_ID");
  cfg.host_id[0] = '\0';
  if (!v || !*v)
    return 0;
  if (!config_host_id_valid(v, strlen(v))) {
    fprintf(stderr, "ignition-mcp: IGN_MCP_HOST_ID=%s is invalid: a host id is %s (e.g. h1); "
                    "it starts every session id this server makes\n",
            v, CONFIG_HOST_ID_RULE);
    return -EINVAL;
  }
  memcpy(cfg.host_id, v, strlen(v) + 1);
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

static bool is_file(const char *p) {
  struct stat st;
  return p && stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

/* A data file of the vm backend: the variable, else <exe>/vm/NAME, else the
 * installed layout. */
static char *resolve_vm_file(const char *var, const char *name) {
  const char *v = getenv(var);
  if (v && *v)
    return is_file(v) ? realpath(v, NULL) : strdup(v);
  const char *const layouts[] = {"%s/vm/%s", "%s/../lib/ignition-mcp/vm/%s"};
  for (size_t i = 0; i < ARRAY_SIZE(layouts); i++) {
    _cleanup_free_ char *p = xasprintf(layouts[i], exe_dir, name);
    if (is_file(p))
      return realpath(p, NULL);
  }
  return xasprintf("%s/vm/%s", exe_dir, name); /* named in messages, checked later */
}

static char *find_in_path(const char *prog) {
  const char *path = getenv("PATH");
  _cleanup_free_ char *copy = strdup(path && *path ? path : "/usr/local/bin:/usr/bin:/bin");
  for (char *save = NULL, *d = strtok_r(copy, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
    _cleanup_free_ char *p = xasprintf("%s/%s", d, prog);
    if (access(p, X_OK) == 0)
      return realpath(p, NULL);
  }
  return NULL;
}

static void load_vm(void) {
  const char *q = getenv("IGN_MCP_QEMU");
  cfg.qemu = q && *q ? (access(q, X_OK) == 0 ? strdup(q) : NULL)
                     : find_in_path("qemu-system-x86_64");
  cfg.kernel = resolve_vm_file("IGN_MCP_KERNEL", "vmlinux");
  cfg.initramfs = resolve_vm_file("IGN_MCP_INITRAMFS", "initramfs.cpio");
  if (is_file(cfg.rootfs_spec)) {
    cfg.vm_image = realpath(cfg.rootfs_spec, NULL);
  } else if (!strchr(cfg.rootfs_spec, '/')) {
    _cleanup_free_ char *name = xasprintf("rootfs-%s.erofs", cfg.rootfs_spec);
    cfg.vm_image = resolve_vm_file("IGN_MCP_VM_IMAGE", name);
  }
  const char *store = getenv("IGN_MCP_STORE");
  if (store && *store) {
    cfg.store = strdup(store);
  } else if (getuid() == 0) {
    cfg.store = strdup("/var/lib/ignition-mcp");
  } else {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    cfg.store = xdg && *xdg ? xasprintf("%s/ignition-mcp", xdg)
                            : xasprintf("%s/.cache/ignition-mcp", home ? home : "/tmp");
  }
  const char *base = getenv("IGN_MCP_BASE");
  if (base && *base) {
    cfg.base = strdup(base);
  } else {
    const char *slash = strrchr(cfg.rootfs_spec, '/');
    cfg.base = xasprintf("%s-base", slash ? slash + 1 : cfg.rootfs_spec);
  }
  const char *accel = getenv("IGN_MCP_ACCEL");
  cfg.accel = strdup(accel && *accel ? accel : "auto");
}

/* IGN_MCP_HOST_IO_ROOT: an existing directory, resolved (symlinks and all)
 * once, so every host path a tool names is checked against its real name. */
static int load_host_io(void) {
  const char *v = getenv("IGN_MCP_HOST_IO_ROOT");
  _cleanup_free_ char *cwd = getcwd(NULL, 0);
  const char *root = v && *v ? v : cwd;
  if (!root) {
    fprintf(stderr, "ignition-mcp: the working directory cannot be read (%m); set "
                    "IGN_MCP_HOST_IO_ROOT to the directory host paths are confined to\n");
    return -EINVAL;
  }
  cfg.host_io_root = realpath(root, NULL);
  if (!cfg.host_io_root || !is_dir(cfg.host_io_root)) {
    fprintf(stderr, "ignition-mcp: IGN_MCP_HOST_IO_ROOT=%s is invalid: give an existing "
                    "directory (host paths of stdin_file, copy_in and copy_out are confined "
                    "to it)\n", root);
    return -EINVAL;
  }
  const char *c = getenv("IGN_MCP_COPY_OUT");
  if (!c || !*c || strcmp(c, "on") == 0)
    cfg.copy_out = true;
  else if (strcmp(c, "off") == 0)
    cfg.copy_out = false;
  else {
    fprintf(stderr, "ignition-mcp: IGN_MCP_COPY_OUT=%s is invalid: use on or off\n", c);
    return -EINVAL;
  }
  return 0;
}

/* IGN_MCP_IDLE_ACTION: what the idle reaper does with an idle session. */
static int load_idle_action(void) {
  const char *a = getenv("IGN_MCP_IDLE_ACTION");
  if (!a || !*a || strcmp(a, "hibernate") == 0)
    cfg.idle_hibernate = true;
  else if (strcmp(a, "close") == 0)
    cfg.idle_hibernate = false;
  else {
    fprintf(stderr, "ignition-mcp: IGN_MCP_IDLE_ACTION=%s is invalid: use hibernate or close\n",
            a);
    return -EINVAL;
  }
  return 0;
}

/* IGN_MCP_SHUTDOWN_ACTION: what a server told to stop does with its live
 * sessions. */
static int load_shutdown_action(void) {
  const char *a = getenv("IGN_MCP_SHUTDOWN_ACTION");
  if (!a || !*a || strcmp(a, "hibernate") == 0)
    cfg.shutdown_hibernate = true;
  else if (strcmp(a, "close") == 0)
    cfg.shutdown_hibernate = false;
  else {
    fprintf(stderr,
            "ignition-mcp: IGN_MCP_SHUTDOWN_ACTION=%s is invalid: use hibernate or close\n", a);
    return -EINVAL;
  }
  return 0;
}

/* IGN_MCP_LOG_DIR, else $XDG_STATE_HOME/ignition-mcp/logs, else
 * ~/.local/state/ignition-mcp/logs, else /tmp/ignition-mcp-<uid>/logs.  Made
 * (0700) when the first log is written. */
static int load_log_dir(void) {
  const char *v = getenv("IGN_MCP_LOG_DIR"), *xdg = getenv("XDG_STATE_HOME"),
             *home = getenv("HOME");
  if (v && *v) {
    if (v[0] != '/') {
      fprintf(stderr, "ignition-mcp: IGN_MCP_LOG_DIR=%s is invalid: give an absolute path\n", v);
      return -EINVAL;
    }
    cfg.log_dir = strdup(v);
  } else if (xdg && xdg[0] == '/')
    cfg.log_dir = xasprintf("%s/ignition-mcp/logs", xdg);
  else if (home && home[0] == '/')
    cfg.log_dir = xasprintf("%s/.local/state/ignition-mcp/logs", home);
  else
    cfg.log_dir = xasprintf("/tmp/ignition-mcp-%u/logs", (unsigned)getuid());
  return 0;
}

/* A comma-separated list of exact values (Origins, Host values): printable
 * ASCII without spaces, so that what is compared is what was meant. */
static int load_list(const char *var, char **ret) {
  const char *v = getenv(var);
  *ret = NULL;
  if (!v || !*v)
    return 0;
  for (const char *p = v; *p; p++)
    if (*p <= ' ' || *p > '~') {
      fprintf(stderr, "ignition-mcp: %s=%s is invalid: give exact values separated by commas, "
                      "without spaces (e.g. https://app.example.com,http://localhost:3000)\n",
              var, v);
      return -EINVAL;
    }
  *ret = strdup(v);
  return 0;
}

/* IGN_MCP_NET and the broker's bounds.  IGN_MCP_NET once switched on QEMU's
 * user-mode network (any value); that is gone, and a value from then must
 * not be taken for one of today's, so anything but the three words stops
 * the server. */
static int load_net(void) {
  const char *v = getenv("IGN_MCP_NET");
  if (!v || !*v || strcmp(v, "allow") == 0)
    cfg.net = NET_ALLOW;
  else if (strcmp(v, "off") == 0)
    cfg.net = NET_OFF;
  else if (strcmp(v, "open") == 0)
    cfg.net = NET_OPEN;
  else {
    fprintf(stderr, "ignition-mcp: IGN_MCP_NET=%s is invalid: user-mode networking is gone "
                    "(no sandbox has a network device; its connections go through the "
                    "server's egress broker, by each session's network policy). Set "
                    "IGN_MCP_NET to off, allow (the default: sessions may ask for an "
                    "allow-list) or open (sessions may also ask for any public host), or "
                    "unset it\n", v);
    return -EINVAL;
  }
  const char *p = getenv("IGN_MCP_NET_PRIVATE");
  cfg.net_private = cfg.net_host = false;
  if (!p || !*p || strcmp(p, "0") == 0)
    ;
  else if (strcmp(p, "1") == 0)
    cfg.net_private = true;
  else if (strcmp(p, "host") == 0)
    cfg.net_private = cfg.net_host = true;
  else {
    fprintf(stderr, "ignition-mcp: IGN_MCP_NET_PRIVATE=%s is invalid: use 1 (sessions may "
                    "reach private networks, e.g. 10.0.0.0/8), host (those and this host "
                    "itself: its loopback and its own addresses) or 0 (the default)\n", p);
    return -EINVAL;
  }
  const char *sf = getenv("IGN_MCP_SECRETS");
  free(cfg.secrets);
  cfg.secrets = sf && *sf ? strdup(sf) : NULL; /* checked by the broker, naming the entry */
  const char *ca = getenv("IGN_MCP_EGRESS_CA");
  free(cfg.egress_ca);
  cfg.egress_ca = NULL;
  if (ca && *ca) {
    cfg.egress_ca = is_file(ca) ? realpath(ca, NULL) : NULL;
    if (!cfg.egress_ca) {
      fprintf(stderr, "ignition-mcp: IGN_MCP_EGRESS_CA=%s is invalid: give an existing file of "
                      "PEM certificates the broker should trust besides the system's, or unset "
                      "it\n", ca);
      return -EINVAL;
    }
  }
  const char *h = getenv("IGN_MCP_EGRESS_HOSTS");
  cfg.egress_hosts = NULL;
  if (h && *h) {
    cfg.egress_hosts = is_file(h) ? realpath(h, NULL) : NULL;
    if (!cfg.egress_hosts) {
      fprintf(stderr, "ignition-mcp: IGN_MCP_EGRESS_HOSTS=%s is invalid: give an existing "
                      "file in hosts(5) format (address, then names), or unset it\n", h);
      return -EINVAL;
    }
  }
  return 0;
}

static int load_http(void) {
  const char *t = getenv("IGN_MCP_HTTP_TOKENS");
  cfg.http_tokens = t && *t ? strdup(t) : NULL;
  if (load_list("IGN_MCP_HTTP_ORIGINS", &cfg.http_origins) < 0 ||
      load_list("IGN_MCP_HTTP_HOSTS", &cfg.http_hosts) < 0)
    return -EINVAL;
  return 0;
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

  /* Before anything is allocated: a refusal leaves nothing behind. */
  if (load_host_id() < 0)
    return -EINVAL;

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
  U("IGN_MCP_MAX_CALLS", 128, 1, 4096, max_calls);
  U("IGN_MCP_IDLE_SECS", 600, 1, 30 * 24 * 3600, idle_secs);
  U("IGN_MCP_HIBERNATE_MAX_MB", 10240, 0, 1u << 30, hibernate_max_mb);
  U("IGN_MCP_HIBERNATE_KEEP_SECS", 86400, 1, 365 * 24 * 3600, hibernate_keep_secs);
  U("IGN_MCP_SHUTDOWN_SECS", 3, 0, 600, shutdown_secs);
  U("IGN_MCP_TASKS_MAX", 64, 1, 4096, tasks_max);
  U("IGN_MCP_TASK_TTL_S", 3600, 1, 7 * 24 * 3600, task_ttl_s);
  U("IGN_MCP_OUTPUT_CAP", 65536, 0, 16 << 20, output_cap);
  U("IGN_MCP_MAX_MESSAGE", 64 << 20, 4096, 1ull << 30, max_message);
  U("IGN_MCP_MAX_FILE", 32 << 20, 0, 256 << 20, max_file);
  U("IGN_MCP_MAX_STDIN", 8 << 20, 0, 16 << 20, max_stdin);
  U("IGN_MCP_MEMORY_MB", 1024, 16, 1 << 20, memory_mb);
  U("IGN_MCP_PIDS", 1024, 8, 1 << 22, pids);
  U("IGN_MCP_OVERLAY_MB", 1024, 1, 1 << 20, overlay_mb);
  U("IGN_MCP_POOL", 2, 0, 64, pool);
  U("IGN_MCP_SPARES", 1, 0, 64, spares);
  U("IGN_MCP_VM_MEMORY_MB", 256, 64, 1 << 16, vm_memory_mb);
  U("IGN_MCP_STAGES_MAX_MB", 10240, 0, 1u << 30, stages_max_mb);
  U("IGN_MCP_COPY_MAX_MB", 1024, 1, 1 << 20, copy_max_mb);
  U("IGN_MCP_COPY_MAX_FILES", 100000, 1, 1 << 24, copy_max_files);
  U("IGN_MCP_LOG_CAP", 64ull << 20, 0, 1ull << 40, log_cap);
  U("IGN_MCP_LOG_KEEP_MB", 1024, 0, 1u << 30, log_keep_mb);
  U("IGN_MCP_LOG_KEEP_DAYS", 7, 0, 3650, log_keep_days);
  U("IGN_MCP_EGRESS_LOG_CAP", 8u << 20, 0, 1ull << 40, egress_log_cap);
  /* A session's connections at once: below what one agent connection
   * carries. */
  U("IGN_MCP_EGRESS_STREAMS", 64, 1, CONFIG_EGRESS_STREAMS_MAX, egress_streams);
  U("IGN_MCP_EGRESS_MAX_MB", 1024, 1, 1u << 30, egress_max_mb);
  /* Distinct names a session may look up under each *.suffix rule (each
   * reaches that domain's servers): a package manager needs a few. */
  U("IGN_MCP_EGRESS_WILDCARD_NAMES", 256, 1, 16384, egress_wildcard_names);
  /* Each connection is a thread of its own (mcp/http.c). */
  U("IGN_MCP_HTTP_MAX_CONNECTIONS", 64, 1, 1024, http_max_connections);
  U("IGN_MCP_HTTP_TIMEOUT_SECS", 30, 1, 3600, http_timeout_secs);
  /* Above the uids of accounts (< 65536), every block below 2^32 - 1. */
  U("IGN_MCP_NS_UID_BASE", NS_UID_BASE_DEFAULT, 65536,
    0xffffffffull - (unsigned long long)NS_UID_SLOTS * NS_UID_BLOCK, ns_uid_base);
#undef U
  if (r < 0)
    return r;

  if (load_net() < 0 || load_host_io() < 0 || load_log_dir() < 0 || load_http() < 0 ||
      load_idle_action() < 0 || load_shutdown_action() < 0)
    return -EINVAL;

  const char *rs = getenv("IGN_MCP_ROOTFS");
  cfg.rootfs_spec = strdup(rs && *rs ? rs : "tools");
  cfg.rootfs = resolve_rootfs(cfg.rootfs_spec);
  cfg.agent = resolve_agent();
  load_vm();
  if (strcmp(cfg.accel, "auto") != 0 && strcmp(cfg.accel, "kvm") != 0 &&
      strcmp(cfg.accel, "tcg") != 0) {
    fprintf(stderr, "ignition-mcp: IGN_MCP_ACCEL=%s is invalid: use auto, kvm or tcg\n", cfg.accel);
    return -EINVAL;
  }
  return 0;
}
