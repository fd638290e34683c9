/* agent_core.h: what every request module of ign-agent shares with the
 * loop (agent.c), and nothing else: the log, the frame sender, the table of
 * failed multi-frame requests and of busy ids, and the checks of request
 * fields.  struct agent stays agent.c's (guest/agent.h): a module reaches
 * its own state through the accessor its header declares (agent_exec in
 * guest/exec_int.h, ...) and the channel only through these functions.
 * Every request ends with exactly one terminal frame (EXIT, OK, READ_END,
 * PACK_END or ERROR); handlers send it themselves through these. */
#pragma once

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/proto.h"

struct agent;

__attribute__((format(printf, 1, 2))) void agent_log(const char *fmt, ...);

/* Begins a frame of TYPE for ID in the agent's output buffer and returns
 * the buffer, for the TLV records; agent_send() then sends it. */
struct proto_buf *agent_frame(struct agent *a, enum proto_type type, uint32_t id);
/* Finish the frame begun by agent_frame() and write it.  A write error
 * marks the channel dead (the loop then ends); later sends are no-ops. */
void agent_send(struct agent *a);
void agent_send_empty(struct agent *a, enum proto_type type, uint32_t id);
void agent_send_data(struct agent *a, enum proto_type type, uint32_t id, const void *p, size_t n);
/* ERROR{ERRNO=err (positive), MESSAGE=...} for request ID. */
__attribute__((format(printf, 4, 5))) void agent_send_error(struct agent *a, uint32_t id, int err,
                                                            const char *fmt, ...);
/* Whether the channel still takes frames (false once it hit EOF or an
 * error): output is read from pipes and sockets only while it does. */
bool agent_connected(const struct agent *a);
/* Scratch of PROTO_CHUNK bytes for output and file reads, valid until the
 * next call into the agent. */
uint8_t *agent_chunk(struct agent *a);

/* Remember that ID failed: drop its frames until one of END_TYPE. */
void agent_ignore_until(struct agent *a, uint32_t id, enum proto_type end_type);
/* Whether frames of ID are being dropped until END_TYPE; IS_END forgets it. */
bool agent_ignoring(struct agent *a, uint32_t id, enum proto_type end_type, bool is_end);
/* Whether a command, a file transfer or a tree copy holds ID. */
bool agent_id_busy(struct agent *a, uint32_t id);

/* Typed TLV values; on a wrong width send EPROTO naming REQ and TAG. */
int agent_tlv_u32(struct agent *a, uint32_t id, const char *req, const char *tag,
                  const uint8_t *v, uint32_t n, uint32_t *ret);
int agent_tlv_u64(struct agent *a, uint32_t id, const char *req, const char *tag,
                  const uint8_t *v, uint32_t n, uint64_t *ret);
/* Check a path from the host (WHAT names it in messages) and make it absolute:
 * relative paths are taken from /root.  On failure sends the ERROR. */
int agent_resolve_path(struct agent *a, uint32_t id, const char *what, const uint8_t *v,
                       uint32_t n, char ret_path[PATH_MAX]);
