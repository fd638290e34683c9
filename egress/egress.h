/* egress.h: the egress broker (docs/egress-design.md).  A sandbox has no
 * network device and no route out; its agent takes every TCP connection and
 * DNS query and hands it over the agent channel as a stream or a lookup
 * (proto/client.h "Streams").  The broker decides each on the host, by the
 * session's policy (network "none", "allow" with allow_hosts, "open") within
 * what the operator allows (IGN_MCP_NET, IGN_MCP_NET_PRIVATE), resolves
 * names itself, checks the address it connects to and what the stream says
 * it is for (TLS SNI, HTTP Host), relays the bytes, and records every
 * attempt (the flight recorder): in memory for results and network_log, and
 * as JSON Lines in <log dir>/<session id>.egress.jsonl.
 *
 * One broker thread per server (epoll over the upstream sockets) and a small
 * resolver pool; nothing in it blocks a session's calls. */
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/client.h"

enum egress_mode {
  EGRESS_MODE_NONE,  /* every attempt refused and recorded */
  EGRESS_MODE_ALLOW, /* only allow_hosts */
  EGRESS_MODE_OPEN,  /* any public destination, recorded */
};

/* The operator's bounds, from the configuration (common/config.c). */
struct egress_settings {
  enum egress_mode max_mode; /* IGN_MCP_NET: off -> NONE, allow (default), open */
  bool off;                  /* IGN_MCP_NET=off: refusals say "egress is off" */
  /* IGN_MCP_NET_PRIVATE: "1" sets allow_private (private networks, CGNAT,
   * link-local but metadata, ...; never loopback nor an address of the
   * host itself); "host" sets both (also loopback and the host's own
   * addresses: services the host runs on 0.0.0.0).  allow_host implies
   * allow_private. */
  bool allow_private;
  bool allow_host;
  const char *hosts_file;    /* IGN_MCP_EGRESS_HOSTS (a hosts(5) file consulted first), or NULL */
  const char *log_dir;       /* the JSON Lines logs go here (IGN_MCP_LOG_DIR) */
  size_t log_cap;            /* IGN_MCP_EGRESS_LOG_CAP: bytes per session's log */
  unsigned max_streams;      /* IGN_MCP_EGRESS_STREAMS: connections open at once per session */
  uint64_t max_bytes;        /* IGN_MCP_EGRESS_MAX_MB: bytes each way per session */
  /* IGN_MCP_EGRESS_WILDCARD_NAMES: distinct names a session may look up
   * under each *.suffix rule of its allow_hosts (0: the default). */
  unsigned wildcard_names;
  /* IGN_MCP_SECRETS (or NULL): with secrets, the broker's CA lives in
   * CA_DIR (<store>/egress-ca) and IGN_MCP_EGRESS_CA (or NULL) is trusted
   * toward the real servers besides the system's trust store. */
  const char *secrets_file;
  const char *ca_dir;
  const char *extra_ca;
};

/* Starts the broker thread and the resolver pool, reads the hosts file.  0,
 * or a negative errno with *ret_err. */
int egress_init(const struct egress_settings *s, char **ret_err);
/* Ends every stream, stops the threads. */
void egress_shutdown(void);
/* The policy in force as one line for the startup log (malloc'd). */
char *egress_policy_line(void);

struct egress;

/* A session's egress from a tool's arguments: NETWORK (NULL when absent:
 * "none"; else must be the string "none", "allow" or "open") and
 * ALLOW_HOSTS (NULL or an array of strings: only with "allow", which needs
 * at least one).  A mode over the operator's IGN_MCP_NET is refused naming
 * both.  TOOL names the tool in messages.  0, or -EINVAL with *ret_err
 * saying what was wrong and what to send instead. */
int egress_new(const char *tool, const json_t *network, const json_t *allow_hosts,
               struct egress **ret, char **ret_err);
/* The same with SECRETS (NULL, or an array of names of the operator's
 * secrets, IGN_MCP_SECRETS): each gets a placeholder of its own in this
 * session (egress_secret_env), and its hosts are allowed as if in
 * allow_hosts (network "none" or absent becomes "allow" for them). */
int egress_new_secrets(const char *tool, const json_t *network, const json_t *allow_hosts,
                       const json_t *secrets, struct egress **ret, char **ret_err);
/* The broker's CA PEM when E has secrets or request rules (else NULL), *RET_GEN the
 * sandbox attached now, and *RET_PATH the bundle it was put in for that
 * sandbox (NULL: not yet; egress_trust_done says it is). */
const char *egress_trust_pem(struct egress *e, uint64_t *ret_gen, const char **ret_path);
void egress_trust_done(struct egress *e, uint64_t gen, const char *path);
/* "NAME=placeholder" for each of E's secrets (*RET_N of them, a
 * NULL-terminated malloc'd array of malloc'd strings), or NULL. */
char **egress_secret_env(const struct egress *e, size_t *ret_n);
/* A copy of E's policy and of its synthetic addresses (a vm fork keeps the
 * answers its programs cached: in the fork they stand for the same names)
 * and of the names it counted under its wildcard rules, with an empty
 * record of its own.  Take it once the source sandbox is
 * paused: a name E's sandbox is given after the copy is not in it. */
int egress_clone(const struct egress *e, struct egress **ret);
/* What a hibernated session keeps of E, to be made again by egress_load
 * in a later server: {mode, allow_hosts, names, bytes_up, bytes_down,
 * wildcard_names} (names: its synthetic addresses' names in order, which a
 * resumed guest may have cached; the bytes, which IGN_MCP_EGRESS_MAX_MB
 * counts; the names counted under each wildcard rule, which
 * IGN_MCP_EGRESS_WILDCARD_NAMES caps). */
json_t *egress_save(const struct egress *e);
/* The egress J (from egress_save) describes, checked as open_session's
 * arguments are (IGN_MCP_NET may have changed since): 0, or -EINVAL with
 * *ret_err. */
int egress_load(const json_t *j, struct egress **ret, char **ret_err);
/* network_update: E's policy becomes NETWORK and ALLOW_HOSTS (checked as
 * open_session's; NULL or null: absent).  allow_hosts alone means
 * "allow"; "allow" alone keeps the rules E has.  From the next connection
 * and lookup on; the connections open that the new policy refuses are
 * reset, recorded "network_update: <why>", and the log gets a
 * {"kind":"policy"} line.  *RET_INFO: egress_summary's fields and
 * previous {mode, allowed_rules}, connections_reset.  0, or a negative
 * errno with *RET_ERR (-EINVAL: the arguments; nothing changed). */
int egress_update(struct egress *e, const json_t *network, const json_t *allow_hosts,
                  const json_t *secrets, json_t **ret_info, char **ret_err);
/* The session id (names the log file) and its owner (call_ctx.owner: the
 * HTTP token's name, "" on stdio; the host's DNS answers are kept per
 * owner).  Once, before egress_attach. */
void egress_set_session(struct egress *e, const char *session_id, const char *owner);
/* Reads the capture's refusal counters of an attached sandbox (UDP, ICMP,
 * other) for a backend that reads them itself (sandbox_ops.egress_counters:
 * ns); 0, or a negative errno with *ret_err. */
typedef int (*egress_counters_fn)(void *ctx, uint64_t ret[3], char **ret_err);
/* The connection to E's sandbox (once it answered HELLO): its streams come
 * to the broker.  A reset detaches the old connection and attaches the new
 * one; the policy and the record go on.  COUNTERS(COUNTERS_CTX) reads the
 * refusal counters for egress_report, until the connection is detached;
 * NULL: egress_report asks the agent on C (EGRESS_STATS).  Not with a
 * broker lock held. */
void egress_attach(struct egress *e, struct agent_conn *c, egress_counters_fn counters,
                   void *counters_ctx);
/* Ends the streams of the attached connection (each recorded) and takes the
 * handler away; a no-op when none is attached. */
void egress_detach(struct egress *e);
/* The same, with WHY (a static string) as what ended the streams in their
 * records, instead of "sandbox connection ended". */
void egress_detach_why(struct egress *e, const char *why);
/* Detaches, flushes the log, frees. */
void egress_free(struct egress *e);

/* For open_session's result: {mode, allowed_rules, egress_log_path} and,
 * when CAPTURE_ERROR (agent_conn_egress_error) is not NULL,
 * "capture": "<why>" (the sandbox then has no egress at all). */
json_t *egress_summary(const struct egress *e, const char *capture_error);
/* A result's `egress` field: {mode, allowed_rules, allowed[], denied[],
 * dns_queries[], total_events, truncated, egress_log_path}.  SINCE_LAST:
 * only the events since the previous egress_report(e, true) (run,
 * sandbox_run); else every event of the session (network_log).  Each list
 * holds at most EGRESS_REPORT_MAX entries (the latest); truncated says one
 * was cut.  A connection still open shows its bytes so far.  It first reads
 * the attached sandbox's capture's refusal counters (the attachment's
 * counters callback, or the agent by EGRESS_STATS; waiting up to a second,
 * a failure is ignored): what grew
 * since the previous reading becomes a refused_packets event, in denied[]
 * and the log. */
#define EGRESS_REPORT_MAX 64u
json_t *egress_report(struct egress *e, bool since_last);
