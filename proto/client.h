/* client.h: the host side of the agent protocol.  One agent_conn per
 * sandbox: a reader thread demultiplexes frames to the calls waiting on
 * them, a writer thread puts the calls' frames on the wire, so several calls
 * can use one sandbox at once.  Every call is bounded: output beyond the
 * caller's cap is counted, not kept; a frame the agent does not take within
 * the write deadline ends the connection; a cancelled call returns at once.
 *
 * Everything the agent sends is hostile input: a guest's root can replace the
 * agent.  A frame that breaks the protocol (a type that does not answer the
 * request, a field out of range, more data than asked for) ends the
 * connection with a message that says what was wrong. */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/tarstream.h"
#include "proto/proto.h"

struct agent_conn;

/* What a waiting call can be interrupted or informed by. */
struct agent_ctl {
  atomic_bool *cancelled;    /* set by the MCP layer; the call ends with -ECANCELED */
  /* Every few seconds while the call waits: the newest output line (or how
   * much of a tree was copied), the time so far and the bytes so far: of
   * stdout and stderr for a command, of the tree and 0 for a copy. */
  void (*progress)(void *ctx, const char *last_line, uint64_t elapsed_ms, uint64_t bytes,
                   uint64_t err_bytes);
  void *ctx;
};

struct agent_exec_req {
  const char *command;
  const char *cwd;           /* NULL: the agent's default */
  const char *const *env;    /* "NAME=VALUE" */
  size_t n_env;
  uint32_t timeout_ms;
  const void *stdin_data;    /* NULL: no stdin */
  size_t stdin_len;
  size_t out_cap;            /* bytes kept per stream */
  /* Called with every byte of output as it arrives, before the cap (the
   * complete logs); from the connection's reader thread, so it must not
   * block.  STREAM is 1 (stdout) or 2 (stderr).  NULL: none. */
  void (*on_output)(void *ctx, int stream, const void *data, size_t len);
  void *output_ctx;
};

struct agent_exec_res {
  char *out, *err;           /* malloc'd, not NUL-terminated; *_len bytes kept */
  size_t out_len, err_len;
  uint64_t out_total, err_total; /* exact byte counts */
  int exit_code;             /* -1 when signalled */
  int signal;                /* 0 when exited */
  bool timed_out;
  uint64_t duration_us;
};

void agent_exec_res_free(struct agent_exec_res *r);

/* How long the agent may take nothing from its channel while a frame waits
 * (or take a frame larger than the socket's buffer, sent in parts, whole)
 * before the connection is declared dead: a guest that stops reading cannot
 * hold its session or the server's byte budget for longer. */
#define AGENT_WRITE_DEADLINE_MS 30000u
/* Bytes of data frames (stdin, file content) queued per connection; a call
 * with more waits (cancellable) for the writer to make room. */
#define AGENT_QUEUE_MAX (4u * (64u * 1024u + 12u))

/* What a SETUP sets in the sandbox; each part is optional (NULL, 0, false:
 * left as it is).  HELLO may carry it too: the agent then sets it before it
 * answers, so nothing the session runs can come before it. */
struct agent_setup_req {
  const void *entropy;       /* added to the guest's pool, then the CRNG reseeded */
  size_t entropy_len;
  bool clock;                /* the host's CLOCK_REALTIME, read as the frame is made */
  const char *hostname;
  const char *machine_id;    /* 32 lowercase hex characters */
};

/* Takes ownership of FD (a connected stream socket to an agent), says HELLO
 * and waits up to TIMEOUT_MS for the answer.  On failure *ret_err explains. */
int agent_conn_open(int fd, uint32_t timeout_ms, struct agent_conn **ret, char **ret_err);
/* The same, with SETUP (may be NULL) in the HELLO: the connection comes up
 * only once the agent has set it. */
int agent_conn_open_setup(int fd, uint32_t timeout_ms, const struct agent_setup_req *setup,
                          struct agent_conn **ret, char **ret_err);
/* The write deadline (AGENT_WRITE_DEADLINE_MS unless set, e.g. by tests). */
void agent_conn_set_write_deadline(struct agent_conn *c, uint32_t ms);
/* How long past a command's timeout the host waits for its EXIT before it
 * PINGs the agent, and how long the PING may take (AGENT_EXEC_GRACE_MS
 * unless set, e.g. by tests). */
#define AGENT_EXEC_GRACE_MS 20000u
void agent_conn_set_exec_grace(struct agent_conn *c, uint32_t ms);
/* Ends the connection: every waiting call fails with -EPIPE.  Idempotent. */
void agent_conn_shutdown(struct agent_conn *c);
/* Shuts down, joins the reader and frees. */
void agent_conn_free(struct agent_conn *c);
bool agent_conn_alive(struct agent_conn *c);
/* The agent's HELLO_OK info string. */
const char *agent_conn_info(struct agent_conn *c);

/* Each call returns 0, or a negative errno with *ret_err saying why:
 *   -ECANCELED   ctl->cancelled was set (a running command is killed)
 *   -EPIPE       the connection ended: the agent hung up or the host closed it
 *   -EPROTO      the host ended the connection because the agent broke the
 *                protocol or stopped reading its channel (see above)
 *   -ETIMEDOUT   the agent stopped answering this call
 *   -EREMOTEIO   the agent refused the request (ERROR frame); the message is
 *                the agent's.  A guest's errno never stands for a host error.
 *   other        a host-side failure (-ENOMEM, -EMSGSIZE, ...) */
int agent_ping(struct agent_conn *c, uint32_t timeout_ms, char **ret_err);
/* EGRESS_STATS: the packets the sandbox's capture refused since it was set
 * up: RET[0] UDP (not DNS), RET[1] ICMP and ICMPv6, RET[2] the rest.  The
 * agent's numbers, checked for form only: counts a guest's root may have
 * reset (flushed rules) or made up.  -EREMOTEIO when it has no capture. */
int agent_egress_stats(struct agent_conn *c, uint32_t timeout_ms, uint64_t ret[3],
                       char **ret_err);
int agent_exec(struct agent_conn *c, const struct agent_exec_req *req, const struct agent_ctl *ctl,
               struct agent_exec_res *ret, char **ret_err);
int agent_write_file(struct agent_conn *c, const char *path, uint32_t mode, const void *data,
                     size_t len, const struct agent_ctl *ctl, char **ret_err);
int agent_read_file(struct agent_conn *c, const char *path, uint64_t offset, uint64_t max,
                    const struct agent_ctl *ctl, void **ret_data, size_t *ret_len,
                    uint64_t *ret_size, bool *ret_eof, char **ret_err);
/* SETUP sent and not waited for (its answer is dropped): for what must come
 * before the next request at no round trip of its own.  Frames go out in
 * order, and an agent whose SETUP failed refuses every request after it
 * (EAGAIN) until one succeeds, so nothing sent later runs without it. */
int agent_setup_send(struct agent_conn *c, const struct agent_setup_req *req, char **ret_err);
/* SETUP: entropy (may be NULL), realtime ns (0: skip), hostname and
 * machine id (NULL: skip). */
int agent_setup(struct agent_conn *c, const void *entropy, size_t entropy_len, uint64_t time_ns,
                const char *hostname, const char *machine_id, char **ret_err);

/* Trees (copy_in, copy_out), streamed as tar with flow control in both
 * directions, so a tree of any size passes in bounded memory and a slow side
 * never stalls the connection's other calls.
 *
 * agent_unpack: reads a tar stream (as tar_pack() writes it) from IN_FD until
 * EOF and sends it to the agent, which makes the tree at GUEST_PATH (absolute)
 * as tar_unpack() does, within LIM.  *ret_rep gets the agent's report.  The
 * stream's producer says it failed by stopping the call (CTL's cancelled)
 * before it closes IN_FD: EOF then is a cancel, the agent is stopped and
 * keeps GUEST_PATH as it was, instead of being told the stream is whole.
 * A stop once DATA_END went cannot take the tree back: the agent is told
 * to stop and its answer is waited for (bounded): 0 when it had put the
 * tree in place, its error when it kept GUEST_PATH as it was, -EINPROGRESS
 * (and a message saying GUEST_PATH may hold either) when it did not say.
 *
 * agent_pack: the agent packs GUEST_PATH (absolute) as tar_pack() does, naming
 * the top entry after GUEST_PATH's last component, and the stream is written
 * to OUT_FD (the host checks LIM on what it receives as well: the agent is
 * not trusted to).  A write to OUT_FD that fails (EPIPE: the reader gave up)
 * ends the call with that error and stops the agent.  It returns 0 only
 * after the agent's PACK_END: a caller that feeds OUT_FD to tar_unpack
 * closes it only then, or stops that unpack first when this failed.
 *
 * Both return 0 or a negative errno with *ret_err, as the calls above;
 * -EREMOTEIO carries the agent's refusal (e.g. "/x: no such file or
 * directory", "the tree is over 1024 MiB"). */
int agent_unpack(struct agent_conn *c, const char *guest_path, int in_fd,
                 const struct tar_limits *lim, const struct agent_ctl *ctl,
                 struct tar_report *ret_rep, char **ret_err);
int agent_pack(struct agent_conn *c, const char *guest_path, int out_fd,
               const struct tar_limits *lim, const struct agent_ctl *ctl,
               struct tar_report *ret_rep, char **ret_err);

/* Streams (egress; proto.h "Streams").  The agent opens a stream for every
 * TCP connection a program in the sandbox makes and a lookup for every DNS
 * query.  The connection checks each stream frame against the protocol
 * (states, windows, ids counting up; a frame that breaks it ends the
 * connection like any other) and hands what passes to the connection's
 * stream handler, from the reader thread: a handler must not block, and
 * must not call agent_conn_set_streams or agent_conn_free.  Until a handler
 * is set (and after it is taken away), the connection itself refuses every
 * stream (STREAM_RESET{ECONNREFUSED}) and lookup (LOOKUP_END{REFUSED}).
 *
 * Flow control: the connection tracks both windows.  What the host may send
 * on a stream starts at OPEN's window and grows by the agent's CREDITs;
 * agent_stream_send never sends beyond it.  What the agent may send starts
 * at agent_stream_accept's window and grows by agent_stream_credit; the
 * handler's data() never gets more than that.  Stream frames the host sends
 * wait in a queue of their own (AGENT_STREAM_QUEUE_MAX bytes per connection,
 * taken in turn with the calls' data), so a stream whose sandbox reads
 * slowly never holds a session's calls; when it is full, agent_stream_send
 * returns -EAGAIN and writable() says when there is room again. */
#define AGENT_STREAM_QUEUE_MAX (512u * 1024u)
/* Streams and lookups open on one connection at once (a protocol bound; a
 * handler may keep lower caps of its own): more are refused by the
 * connection. */
#define AGENT_MAX_STREAMS 1024u
#define AGENT_MAX_LOOKUPS 256u

struct agent_stream_open {
  int family;        /* AF_INET or AF_INET6 */
  uint8_t addr[16];  /* the destination the program asked for (4 or 16 bytes used) */
  uint16_t port;     /* 1..65535 */
  uint32_t window;   /* what the host may send before a credit (<= STREAM_WINDOW) */
};

struct agent_lookup {
  const uint8_t *name; /* as the query spelt it: untrusted, not NUL-terminated */
  size_t name_len;     /* <= PROTO_MAX_NAME */
  uint16_t qtype;
  bool tcp;            /* asked over TCP (else UDP) */
};

struct agent_stream_handler {
  void (*open)(void *ctx, uint32_t sid, const struct agent_stream_open *o);
  void (*data)(void *ctx, uint32_t sid, const uint8_t *p, size_t n);
  void (*credit)(void *ctx, uint32_t sid, uint32_t n); /* the host may send N more */
  void (*shut)(void *ctx, uint32_t sid);                /* the program sends no more */
  void (*reset)(void *ctx, uint32_t sid, int err);      /* terminal */
  void (*lookup)(void *ctx, uint32_t lid, const struct agent_lookup *q);
  void (*writable)(void *ctx);  /* room in the stream queue again */
  void (*closed)(void *ctx);    /* the connection ended: every stream and lookup is gone */
  void *ctx;
};

/* Sets (H) or takes away (NULL) the stream handler.  When it returns, no
 * handler call of the previous one runs or will start; its open streams and
 * lookups are reset/refused.  Not from a handler, and not with a lock held
 * that a handler takes. */
void agent_conn_set_streams(struct agent_conn *c, const struct agent_stream_handler *h);
/* The agent's TAG_EGRESS_ERROR: why the sandbox could not capture its
 * traffic (it then has no route out at all), or NULL when it can. */
const char *agent_conn_egress_error(struct agent_conn *c);

/* Each returns 0, -EPIPE when the connection is dead, -ENOENT when SID is
 * not open (reset or ended meanwhile), -EINVAL when the call breaks the
 * protocol (a second accept, data after shut, more than the window). */
int agent_stream_accept(struct agent_conn *c, uint32_t sid, uint32_t window);
/* Sends at most what the agent's window and the stream queue allow: returns
 * the bytes taken (up to N, possibly fewer, in PROTO_CHUNK frames), or
 * -EAGAIN when none could be (queue full or window closed: writable() or
 * credit() will say when to try again). */
ssize_t agent_stream_send(struct agent_conn *c, uint32_t sid, const void *p, size_t n);
int agent_stream_credit(struct agent_conn *c, uint32_t sid, uint32_t n);
int agent_stream_shut(struct agent_conn *c, uint32_t sid);
/* ERR (positive: ECONNREFUSED, ETIMEDOUT, ...) and MSG (may be NULL: for the
 * agent's log) end the stream; frames of it that still arrive are dropped. */
int agent_stream_reset(struct agent_conn *c, uint32_t sid, int err, const char *msg);
/* Answers lookup LID: RCODE, and for NOERROR up to PROTO_MAX_ADDRS addresses
 * (FAMILIES[i] AF_INET/AF_INET6, ADDRS[i] 4 or 16 bytes) with TTL. */
int agent_lookup_answer(struct agent_conn *c, uint32_t lid, enum proto_rcode rcode,
                        const int *families, const uint8_t (*addrs)[16], size_t n, uint32_t ttl);
