/* config.h: the server's settings, read once from IGN_MCP_* variables. */
#pragma once

#include <stdbool.h>
#include <stddef.h>

/* A host id: 1 to 16 of [a-z0-9-], starting with a letter. */
#define CONFIG_HOST_ID_MAX 16
#define CONFIG_HOST_ID_RULE "1 to 16 characters of a-z, 0-9 and -, starting with a letter"

/* The ns backend's uid blocks: NS_UID_SLOTS blocks of NS_UID_BLOCK host
 * uids (and gids) from IGN_MCP_NS_UID_BASE, one per sandbox of a root server
 * (sandbox/ns_uid.c). */
#define NS_UID_BLOCK 65536u
#define NS_UID_SLOTS 256u
#define NS_UID_BASE_DEFAULT 0x70000000u

/* The most IGN_MCP_EGRESS_STREAMS may be: what one agent connection carries
 * (AGENT_MAX_STREAMS, egress/stream.c checks that they agree). */
#define CONFIG_EGRESS_STREAMS_MAX 1024u

enum backend_choice { BACKEND_AUTO, BACKEND_NS, BACKEND_VM };

/* IGN_MCP_NET: the most network a session may ask for (egress/egress.h). */
enum net_policy { NET_OFF, NET_ALLOW, NET_OPEN };

struct config {
  enum backend_choice backend;
  char *rootfs;          /* resolved absolute directory, or NULL if not found */
  char *rootfs_spec;     /* what the user asked for (name or path) */
  char *agent;           /* resolved ign-agent path, or NULL */
  unsigned max_sessions;
  unsigned max_calls;    /* tools/call requests in progress at once */
  unsigned idle_secs;
  bool idle_hibernate;   /* IGN_MCP_IDLE_ACTION=hibernate (default) or close */
  unsigned hibernate_max_mb;   /* IGN_MCP_HIBERNATE_MAX_MB: an owner's hibernations; 0: none */
  unsigned hibernate_keep_secs; /* IGN_MCP_HIBERNATE_KEEP_SECS: then a hibernated one is closed */
  bool shutdown_hibernate; /* IGN_MCP_SHUTDOWN_ACTION=hibernate (default) or close */
  unsigned shutdown_secs;  /* IGN_MCP_SHUTDOWN_SECS: hibernations at shutdown start within it */
  unsigned tasks_max;    /* IGN_MCP_TASKS_MAX: tasks held per owner, running or done */
  unsigned task_ttl_s;   /* IGN_MCP_TASK_TTL_S: the longest a task's result is kept */
  size_t output_cap;
  size_t max_message;
  size_t max_file;
  size_t max_stdin;
  unsigned memory_mb;
  unsigned pids;
  unsigned overlay_mb;
  /* egress (egress/egress.h; docs/egress-design.md) */
  enum net_policy net;   /* IGN_MCP_NET: off, allow (default) or open */
  bool net_private;      /* IGN_MCP_NET_PRIVATE=1 or host: private networks may be reached */
  bool net_host;         /* IGN_MCP_NET_PRIVATE=host: this host too (loopback, its own addresses) */
  char *egress_hosts;    /* IGN_MCP_EGRESS_HOSTS: a hosts(5) file consulted first, or NULL */
  size_t egress_log_cap; /* IGN_MCP_EGRESS_LOG_CAP: bytes of each session's egress log */
  unsigned egress_streams; /* IGN_MCP_EGRESS_STREAMS: connections open at once per session */
  unsigned egress_max_mb;  /* IGN_MCP_EGRESS_MAX_MB: MiB each way per session */
  unsigned egress_wildcard_names; /* IGN_MCP_EGRESS_WILDCARD_NAMES: names per *.suffix rule */
  char *secrets;         /* IGN_MCP_SECRETS: the operator's secrets file, or NULL */
  char *egress_ca;       /* IGN_MCP_EGRESS_CA: more CA certificates the broker trusts upstream */
  unsigned ns_uid_base;  /* IGN_MCP_NS_UID_BASE: the ns sandboxes' uid blocks (root) */
  /* IGN_MCP_HOST_ID: the prefix of every session id this server mints
   * ("h1" -> "h1.s3-9f2a"), so a front proxy can route calls on the id;
   * "" when unset. */
  char host_id[CONFIG_HOST_ID_MAX + 1];
  /* vm backend */
  char *qemu;            /* resolved qemu-system-x86_64, or NULL */
  char *kernel;          /* vmlinux (IGN_MCP_KERNEL) */
  char *initramfs;       /* initramfs.cpio (IGN_MCP_INITRAMFS) */
  char *vm_image;        /* the rootfs disk image, or NULL */
  char *store;           /* IGN_MCP_STORE: warm bases live here */
  char *base;            /* IGN_MCP_BASE; "none": cold boot every session */
  unsigned pool;         /* restored, stopped clones kept ready */
  unsigned spares;       /* QEMUs kept waiting for a restore */
  unsigned vm_memory_mb;
  char *accel;           /* auto, kvm, tcg */
  unsigned stages_max_mb; /* IGN_MCP_STAGES_MAX_MB: the space all stages may use in the store */
  /* host files named by tool arguments (stdin_file, copy_in, copy_out) */
  char *host_io_root;    /* IGN_MCP_HOST_IO_ROOT, resolved; default: the working directory */
  bool copy_out;         /* IGN_MCP_COPY_OUT=off: nothing is written to the host */
  unsigned copy_max_mb;  /* IGN_MCP_COPY_MAX_MB: bytes of one copy_in/copy_out */
  unsigned copy_max_files; /* IGN_MCP_COPY_MAX_FILES: entries of one copy */
  /* complete output logs */
  char *log_dir;         /* IGN_MCP_LOG_DIR */
  size_t log_cap;        /* IGN_MCP_LOG_CAP: bytes kept per log file */
  unsigned log_keep_mb;  /* IGN_MCP_LOG_KEEP_MB: all logs together, oldest removed first */
  unsigned log_keep_days; /* IGN_MCP_LOG_KEEP_DAYS: older logs are removed */
  /* --http (mcp/http.c) */
  char *http_tokens;     /* IGN_MCP_HTTP_TOKENS: the bearer tokens file, or NULL */
  char *http_origins;    /* IGN_MCP_HTTP_ORIGINS: more allowed Origins, comma-separated, or NULL */
  char *http_hosts;      /* IGN_MCP_HTTP_HOSTS: more allowed Host values, comma-separated, or NULL */
  unsigned http_max_connections; /* IGN_MCP_HTTP_MAX_CONNECTIONS */
  unsigned http_timeout_secs;    /* IGN_MCP_HTTP_TIMEOUT_SECS: to deliver a whole request */
};

extern struct config cfg;

/* Reads the environment; on an invalid value prints why to stderr and
 * returns -EINVAL. */
int config_load(void);
/* Whether the N bytes at S are a host id (CONFIG_HOST_ID_RULE). */
bool config_host_id_valid(const char *s, size_t n);
/* Directory holding the running executable. */
const char *config_exe_dir(void);
/* IGN_MCP_NET as a word: "off", "allow" or "open". */
const char *config_net_name(void);
/* IGN_MCP_BACKEND as a word: "auto", "vm" or "ns". */
const char *config_backend_name(void);
/* Why a program or data file the server needs cannot be used, as one phrase
 * without a fix (malloc'd).  VAR (or NULL) is the variable that overrides the
 * default; when it is set, its value is not WHAT ("an executable file", "a
 * file").  Otherwise DEFLT is the default that was looked for: a program name
 * is looked for in PATH; a path under the server's directory, as config_load()
 * makes them, there and in ../lib/ignition-mcp.  For instance
 * "IGN_MCP_QEMU=/x is not an executable file", "qemu-system-x86_64 is not in
 * PATH", "vmlinux is neither in /opt/bin/vm nor in /opt/lib/ignition-mcp/vm". */
char *config_missing_why(const char *var, const char *deflt, const char *what);
