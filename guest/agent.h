/* agent.h: ign-agent, the process that serves the host <-> agent protocol
 * (proto/proto.h) inside a sandbox.
 *
 * The agent is single-threaded: agent.c owns the event loop and the channel,
 * and hands each request to the module that serves it:
 *   exec.c      EXEC / STDIN / STDIN_END / KILL, output pipes, reaping
 *   files.c     WRITE / DATA / DATA_END / READ
 *   tree.c      UNPACK / PACK / CREDIT (and their DATA, DATA_END, KILL):
 *               tar streams, each in a forked child (common/tarstream.h)
 *   egress.c    the sandbox's TCP connections and DNS queries as streams
 *               and lookups (STREAM_*, LOOKUP, LOOKUP_END); dns.c its codec
 *   machine.c   SETUP, hostname, loopback, resolv.conf and hosts
 *   egress_nl.c the capture of the sandbox's traffic (nftables, routes)
 *   ns_setup.c  the namespace sandbox's mounts (mode --ns)
 *   vm_init.c   PID 1 of a microVM: modules, root disk, overlay, channel
 *   confine.c   the privilege drop: open files, capabilities, no_new_privs,
 *               seccomp (its deny list: confine.h)
 * Every request ends with exactly one terminal frame (EXIT, OK, READ_END,
 * PACK_END or ERROR); handlers send it themselves through the agent_send_* helpers. */
#pragma once

#include <limits.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include <sys/socket.h>

#include "common/nft_counters.h"
#include "guest/dns.h"
#include "proto/proto.h"

#ifndef IGN_VERSION
#define IGN_VERSION "0.1.0"
#endif

/* Caps on what the host can make the agent hold at once. */
#define EXEC_MAX_RUNNING 64u           /* commands started or waiting for stdin */
#define EXEC_MAX_STDIN (16u << 20)     /* bytes of stdin per command */
#define EXEC_MAX_DRAIN 128u            /* pipes of finished commands still read */
#define EXEC_MAX_GROUPS 256u           /* process groups remembered for shutdown */
#define EXEC_POLL_MAX (2u * EXEC_MAX_RUNNING + EXEC_MAX_DRAIN)
#define FILES_MAX_WRITES 16u           /* WRITE requests open at once */
#define FILES_MAX_READ (64u << 20)     /* bytes per READ */
#define AGENT_MAX_IGNORED 64u          /* failed multi-frame requests remembered */
#define TREE_MAX 8u                    /* UNPACK and PACK requests at once */

enum agent_mode {
  AGENT_MODE_FD, /* --serve-fd N: no setup, for tests and benchmarks */
  AGENT_MODE_NS, /* --ns: PID 1 of a namespace sandbox */
  AGENT_MODE_VM, /* PID 1 of a microVM, started by the kernel (vm_init.c) */
};

enum exec_state_kind {
  EXEC_FREE = 0,
  EXEC_WAITING_STDIN, /* EXEC with HAS_STDIN=1 received, collecting STDIN */
  EXEC_RUNNING,       /* the shell has been forked */
};

struct exec_cmd {
  enum exec_state_kind state;
  uint32_t id;
  /* Owned until the shell is forked. */
  char *command;
  char *cwd;
  char **env;
  uint32_t timeout_ms;
  int stdin_fd; /* memfd holding the collected stdin, or -1 */
  uint64_t stdin_bytes;
  /* While running. */
  pid_t pid; /* also the process group id */
  int out_fd, err_fd; /* non-blocking read ends, -1 once at EOF */
  uint64_t started_us;
  uint64_t deadline_ms; /* CLOCK_MONOTONIC, 0 = none */
  bool timed_out;
};

struct exec_state {
  struct exec_cmd cmds[EXEC_MAX_RUNNING];
  /* Read ends of finished commands whose write ends a background process may
   * still hold; read and discarded until EOF, oldest first. */
  int drain[EXEC_MAX_DRAIN];
  size_t n_drain;
  /* Process groups started, so that shutdown can kill what is left. */
  pid_t groups[EXEC_MAX_GROUPS];
  size_t n_groups;
};

struct file_write {
  bool used;
  uint32_t id;
  int fd;
  uint64_t size, received;
  char path[PATH_MAX];
  char tmp[PATH_MAX];
};

struct files_state {
  struct file_write writes[FILES_MAX_WRITES];
};

enum tree_kind { TREE_FREE = 0, TREE_UNPACK, TREE_PACK };

/* One UNPACK or PACK: its tar child and the stream between it and the
 * channel.  An all-zero slot is free. */
struct tree {
  enum tree_kind kind;
  uint32_t id;
  pid_t pid;            /* the tar child; 0 once reaped */
  int status;           /* its wait status, once reaped */
  int fd;               /* UNPACK: the child's input pipe, PACK: its output; -1 once closed */
  int result_fd;        /* memfd the child writes its result (a TLV payload) to */
  char path[PATH_MAX];
  uint64_t stream_bytes; /* DATA payload received (UNPACK) or sent (PACK) */
  /* UNPACK: outstanding + buf_len + uncredited == TREE_WINDOW. */
  uint8_t *buf;         /* received, not yet in the pipe (TREE_WINDOW bytes) */
  size_t buf_off, buf_len;
  uint64_t outstanding; /* granted to the host and not used yet */
  uint64_t uncredited;  /* drained, not granted again yet */
  bool got_end;         /* DATA_END arrived */
  /* PACK: bytes the host lets us send. */
  uint64_t credit;
  /* KILL, or the connection is gone: the child is told to stop, and
   * SIGKILLed if it has not by then. */
  bool killed;
  uint64_t kill_deadline_ms;
  /* Its ERROR went already (the host broke the protocol for it): it ends
   * without another terminal frame. */
  bool answered;
};

struct tree_state {
  struct tree trees[TREE_MAX];
};

/* Egress (egress.c): the listeners the capture rules send the sandbox's
 * traffic to, a stream per TCP connection, a lookup per DNS query. */
#define EGRESS_AGENT_MAX_STREAMS 256u /* program connections at once; more are reset */
#define EGRESS_AGENT_MAX_LOOKUPS 64u  /* queries waiting for the host; more get REFUSED */
#define EGRESS_DNS_TCP_MAX 8u         /* DNS-over-TCP connections at once */
#define EGRESS_HOST_REFUSED 16u       /* host-opened ids remembered after their RESET */
#define EGRESS_POLL_MAX (3u + EGRESS_AGENT_MAX_STREAMS + EGRESS_DNS_TCP_MAX)

/* One TCP connection of a program.  An all-zero slot (id 0) is free. */
struct egress_stream {
  uint32_t id;
  int fd;              /* the program's socket, non-blocking */
  bool accepted;       /* the host's ACCEPT came: reading may start */
  bool host_shut;      /* the host sent SHUT */
  bool prog_shut;      /* the program's EOF was read and SHUT sent */
  bool wr_shut;        /* shutdown(SHUT_WR) done (after host_shut, ring drained) */
  uint32_t credit;     /* bytes the host still lets us send */
  /* Host -> program: outstanding + ring_len + uncredited == STREAM_WINDOW. */
  uint8_t *ring;       /* STREAM_WINDOW bytes, allocated at the first DATA */
  uint32_t ring_head, ring_len;
  uint32_t outstanding; /* granted to the host and not used yet */
  uint32_t uncredited;  /* written to the program, not granted again yet */
};

/* One DNS query waiting for its LOOKUP_END.  Id 0: free. */
struct egress_lookup {
  uint32_t id;
  bool tcp;
  unsigned conn;                /* tcp: the index of its connection */
  struct sockaddr_storage client; /* udp: where the answer goes */
  uint64_t started_ms;
  struct dns_query q;
};

/* A DNS-over-TCP connection: one query at a time. */
struct egress_dns_conn {
  bool used;
  int fd;
  uint32_t lookup;              /* the query in flight, 0: none */
  uint8_t in[2 + DNS_QUERY_MAX];
  size_t in_len;
  uint8_t out[2 + DNS_RESPONSE_MAX];
  size_t out_off, out_len;
};

/* All zero is a valid state with egress off (no listeners). */
struct egress_state {
  bool on;                      /* the listeners are open */
  int tcp_fd, udp_fd, dns_tcp_fd;
  uint32_t last;                /* the n of the last agent id opened (ids PROTO_AGENT_ID | n) */
  size_t n_streams;
  struct egress_stream streams[EGRESS_AGENT_MAX_STREAMS];
  struct egress_lookup lookups[EGRESS_AGENT_MAX_LOOKUPS];
  struct egress_dns_conn dns_conns[EGRESS_DNS_TCP_MAX];
  /* Host-opened streams we reset: their frames still in flight are dropped. */
  uint32_t host_refused[EGRESS_HOST_REFUSED];
  size_t n_host_refused;
  /* Refusals logged at most once a second, the others counted. */
  uint64_t log_ms;
  unsigned log_quiet;
};

/* A failed multi-frame request: frames for ID are dropped until END_TYPE. */
struct agent_ignored {
  uint32_t id;
  uint8_t end_type;
};

struct agent {
  enum agent_mode mode;
  int chan;
  bool chan_ok;     /* false once the channel hit EOF or an error */
  int exit_status;  /* process exit status once the loop ends */
  int sigfd;
  struct proto_buf out;
  uint8_t chunk[PROTO_CHUNK]; /* scratch for output and file reads */
  struct agent_ignored ignored[AGENT_MAX_IGNORED];
  size_t n_ignored;
  struct exec_state exec;
  struct files_state files;
  struct tree_state trees;
  struct egress_state egress;
  /* Why the sandbox's traffic could not be captured (egress_capture_setup
   * failed: it then has no route out at all), "" when it is; HELLO_OK
   * carries it as TAG_EGRESS_ERROR. */
  char egress_error[256];
};

/* agent.c */
__attribute__((format(printf, 1, 2))) void agent_log(const char *fmt, ...);
/* Finish the frame in a->out and write it.  A write error marks the channel
 * dead (the loop then ends); later sends are no-ops. */
void agent_send(struct agent *a);
void agent_send_empty(struct agent *a, enum proto_type type, uint32_t id);
void agent_send_data(struct agent *a, enum proto_type type, uint32_t id, const void *p, size_t n);
/* ERROR{ERRNO=err (positive), MESSAGE=...} for request ID. */
__attribute__((format(printf, 4, 5))) void agent_send_error(struct agent *a, uint32_t id, int err,
                                                            const char *fmt, ...);
/* Remember that ID failed: drop its frames until one of END_TYPE. */
void agent_ignore_until(struct agent *a, uint32_t id, enum proto_type end_type);
/* Whether frames of ID are being dropped until END_TYPE; IS_END forgets it. */
bool agent_ignoring(struct agent *a, uint32_t id, enum proto_type end_type, bool is_end);
bool agent_id_busy(struct agent *a, uint32_t id);
/* Typed TLV values; on a wrong width send EPROTO naming REQ and TAG. */
int agent_tlv_u32(struct agent *a, uint32_t id, const char *req, const char *tag,
                  const uint8_t *v, uint32_t n, uint32_t *ret);
int agent_tlv_u64(struct agent *a, uint32_t id, const char *req, const char *tag,
                  const uint8_t *v, uint32_t n, uint64_t *ret);
/* SIGCHLD (and in fd mode the stop signals) to a->sigfd. */
int agent_signals_init(struct agent *a);
/* The event loop: serves a->chan until EOF or a fatal error, then ends every
 * command and closes the channel.  Returns the exit status.  main() and the
 * fuzz target call it. */
int agent_serve(struct agent *a);
/* egress_capture_setup() as part of a sandbox's setup.  A failure does not
 * stop the sandbox: it runs with no route out (fail closed), the failure is
 * logged and kept in a->egress_error for HELLO_OK. */
void agent_capture_egress(struct agent *a);
/* Check a path from the host (WHAT names it in messages) and make it absolute:
 * relative paths are taken from /root.  On failure sends the ERROR. */
int agent_resolve_path(struct agent *a, uint32_t id, const char *what, const uint8_t *v,
                       uint32_t n, char ret_path[PATH_MAX]);

/* exec.c */
void exec_init(struct exec_state *e);
void exec_handle(struct agent *a, const struct proto_header *h, const uint8_t *payload);
bool exec_id_busy(const struct exec_state *e, uint32_t id);
/* Poll set: exec_pollfds() fills up to EXEC_POLL_MAX entries; exec_on_poll()
 * takes the same entries back after poll(). */
size_t exec_pollfds(const struct exec_state *e, struct pollfd *pfd);
void exec_on_poll(struct agent *a, const struct pollfd *pfd, size_t n);
void exec_reap(struct agent *a);
int exec_poll_timeout(const struct exec_state *e);
void exec_check_timeouts(struct agent *a);
void exec_shutdown(struct exec_state *e);

/* files.c */
void files_init(struct files_state *f);
void files_handle(struct agent *a, const struct proto_header *h, const uint8_t *payload);
bool files_id_busy(const struct files_state *f, uint32_t id);
void files_shutdown(struct files_state *f);

/* tree.c (an all-zero tree_state is a valid empty one) */
void tree_handle(struct agent *a, const struct proto_header *h, const uint8_t *payload);
bool tree_id_busy(const struct tree_state *t, uint32_t id);
size_t tree_pollfds(const struct tree_state *t, struct pollfd *pfd);
void tree_on_poll(struct agent *a, const struct pollfd *pfd, size_t n);
/* A child was reaped: true if it was a tree's. */
bool tree_reaped(struct agent *a, pid_t pid, int status);
/* Poll timeout in ms (-1: none) for the kill deadlines. */
int tree_poll_timeout(const struct tree_state *t);
void tree_check_timeouts(struct agent *a);
/* The host is gone (a vm's port hung up): stop every tree. */
void tree_cancel_all(struct agent *a);
/* The agent is ending: stop every child, wait for them briefly, SIGKILL
 * what is left. */
void tree_shutdown(struct tree_state *t);

/* egress.c */
/* Opens the listeners ([::]:EGRESS_TCP_PORT, UDP and TCP [::]:EGRESS_DNS_PORT,
 * close-on-exec) in the sandbox's network namespace.  On failure logs,
 * fills a->egress_error when it is empty, and leaves egress off (what the
 * rules redirect then finds no listener: it fails, nothing leaves). */
int egress_start(struct agent *a);
/* The stream and lookup frames (STREAM_*, LOOKUP, LOOKUP_END). */
void egress_handle(struct agent *a, const struct proto_header *h, const uint8_t *payload);
size_t egress_pollfds(const struct egress_state *e, struct pollfd *pfd);
void egress_on_poll(struct agent *a, const struct pollfd *pfd, size_t n);
/* The host is gone: every program connection is reset, every query
 * forgotten, and ids count from 1 again for the next host. */
void egress_cancel_all(struct agent *a);
/* The agent is ending: egress_cancel_all and the listeners closed. */
void egress_shutdown(struct agent *a);

/* machine.c */
int machine_set_hostname(const char *name, size_t len);
int machine_loopback_up(void);
/* /etc/resolv.conf naming 127.0.0.1 (where the capture sends DNS) and an
 * /etc/hosts with the localhost lines, each unless the tree has one.  Best
 * effort: a failure is logged. */
void machine_name_files(void);
void machine_handle_setup(struct agent *a, uint32_t id, const uint8_t *payload, size_t len);

/* ns_setup.c */
/* The fd on which a namespace sandbox's agent keeps its setup tmpfs open for
 * its whole life (close-on-exec, so no command inherits it): the server
 * reads a commit's files through /proc/<agent pid>/fd/6
 * (sandbox/ns_snapshot.c).  In that directory, upper/ is the overlay's upper
 * layer and scratch/root and scratch/tmp, when they exist, are what the
 * sandbox sees as /root and /tmp (rootfs directories the sandbox could not
 * write in; see ns_writable_dir).  The agent is not dumpable, so the
 * sandbox's own processes cannot open it. */
#define AGENT_NS_STATE_FD 6
struct ns_options {
  const char *rootfs; /* absolute path of the rootfs tree on the host */
  int rootfs_fd;      /* the server's idmapped mount of it (root server), or -1 */
  /* A stage's layer, laid between the rootfs and the upper: the server's
   * idmapped mount of it (root server), or its host path (a user's). */
  int stage_fd;       /* -1: none */
  const char *stage;  /* NULL: none */
  /* With STAGE: the device and inode of the layer the server checked.  The
   * path is bound by name, and another server may rename a different stage
   * onto it meanwhile: what was bound must be this directory. */
  dev_t stage_dev;
  ino_t stage_ino;
  unsigned overlay_mb;
  const char *hostname;
};
/* args.c: the agent's command line. */
struct agent_options {
  enum agent_mode mode;
  int fd;
  bool egress; /* --serve-fd with --egress */
  struct ns_options ns;
};
/* Parses ARGV into *RET: 0, or -EINVAL with a line on stderr (--help and
 * --version print and exit, --probe-egress runs and exits). */
int agent_parse_args(int argc, char **argv, struct agent_options *ret);
void agent_usage(FILE *f);
/* Tries the egress capture in namespaces of our own: the exit status. */
int agent_probe_egress(void);

/* Build the sandbox's filesystem and identity.  On failure a one-line
 * message has been written to stderr. */
int ns_setup(const struct ns_options *o);

/* vm_init.c */
/* Before anything else as PID 1 of a VM: /dev and the console as fds 0-2. */
void vm_early_init(void);
/* Load modules, mount the root, capture the guest's traffic
 * (agent_capture_egress), open the channel as a->chan.  Logs on failure. */
int vm_setup(struct agent *a);
/* After EOF on the port: wait until a host is connected again. */
void vm_wait_host(int chan);
/* Power off after a fatal error (PID 1 must not exit). */
__attribute__((noreturn)) void vm_fatal(void);

/* egress_nl.c */
/* As PID 1 of a sandbox, with CAP_NET_ADMIN over its network namespace and
 * lo up: the nftables ruleset (table inet ign_egress, docs/egress-design.md
 * section (a)) that sends every TCP connection to a non-loopback address to
 * EGRESS_TCP_PORT and every DNS query (UDP and TCP port 53, any server) to
 * EGRESS_DNS_PORT, and refuses other UDP and everything else; then the
 * default routes through lo (v4 with source 127.0.0.1, v6).  Raw netlink,
 * no library.  0, or a negative errno with ERR (ERR_SIZE bytes) saying what
 * failed; on failure no route was added, so the sandbox has no way out. */
#define EGRESS_TCP_PORT 15001
#define EGRESS_DNS_PORT 15353
int egress_capture_setup(char *err, size_t err_size);
/* The packets the capture's refusal rules counted since it was set up
 * (EGRESS_STATS), by enum egress_refused_kind (common/nft_counters.h): UDP
 * other than DNS, ICMP and ICMPv6, the rest.  Reads them by a dump of table
 * inet ign_egress (NFT_MSG_GETRULE) on a socket of its own, which needs
 * CAP_NET_ADMIN over the network namespace: a vm's agent and --serve-fd.
 * 0, or a negative errno with ERR saying what failed (-ENOENT: the rules
 * are gone). */
int egress_refused_read(uint64_t ret[EGRESS_REFUSED_N], char *err, size_t err_size);
/* An ns sandbox's agent gives up every capability (confine.c), and the
 * kernel answers nf_tables requests, dumps too, only when both the socket's
 * opener and its sender hold CAP_NET_ADMIN over the network namespace
 * (netlink_net_capable).  So before the drop the agent opens a
 * NETLINK_NETFILTER socket (close-on-exec) and keeps it on this fd without
 * ever using it; the server takes a copy with pidfd_getfd once the sandbox
 * is ready and dumps the counters on it itself (sandbox/ns.c): it opened
 * as the capable agent, and the server sends as root, or as the user who
 * owns the sandbox's user namespace.  Left open in the agent it is
 * harmless: after the drop the agent lacks the capability, so the kernel
 * refuses what it would send; no command inherits it, and the agent is not
 * dumpable, so no process of the sandbox can take it. */
#define AGENT_NS_COUNTERS_FD 7
/* Opens that socket on AGENT_NS_COUNTERS_FD (which must be free).  0, or a
 * negative errno with ERR saying what failed. */
int egress_counters_keep_socket(char *err, size_t err_size);

/* confine.c */
/* Drop every capability for good, set no_new_privs, install the seccomp
 * filter.  On failure a one-line message has been written to stderr. */
int confine_drop_privileges(void);
