/* proto.h: the host <-> ign-agent wire protocol, shared by the server (host
 * side) and ign-agent (guest side).
 *
 * A connection is a byte stream (a socketpair for the ns backend, a
 * virtio-serial port for the vm backend).  It carries frames:
 *
 *   u32 len    payload length in bytes, <= PROTO_MAX_PAYLOAD
 *   u8  type   enum proto_type
 *   u8  flags  0 (reserved)
 *   u16 rsvd   0
 *   u32 id     request id chosen by the host; 0 for connection-level frames
 *   u8  payload[len]
 *
 * All integers are little-endian.  Requests are multiplexed: the host picks a
 * fresh id per request, and every frame that belongs to it carries that id.
 * Each request ends with exactly one terminal frame from the agent (EXIT, OK,
 * READ_END, PACK_END or ERROR).
 *
 * Payloads of control frames are TLV records: u16 tag, u32 len, value.  Fixed
 * width integers are encoded LE with len 4 or 8; strings are raw bytes (no
 * terminating NUL).  Data frames (STDIN, STDOUT, STDERR, DATA) carry raw bytes.
 *
 * Flows:
 *   HELLO{VERSION,ENTROPY?,TIME_NS?,HOSTNAME?,MACHINE_ID?}
 *                                     -> HELLO_OK{VERSION,INFO} | ERROR
 *     (SETUP's TLVs, set before the answer: a clone's first request)
 *   PING                              -> PONG
 *   EXEC{COMMAND,CWD?,ENV*,TIMEOUT_MS,HAS_STDIN}
 *     [STDIN* STDIN_END when HAS_STDIN=1]
 *                                     -> STDOUT* STDERR* (interleaved) EXIT | ERROR
 *   KILL (same id as a running EXEC)  -> (the EXEC ends with EXIT, SIGNAL=9)
 *   WRITE{PATH,MODE,SIZE} DATA* DATA_END -> OK | ERROR (ERROR may come early;
 *                                        the agent ignores the rest of the id)
 *   READ{PATH,OFFSET,MAX}             -> DATA* READ_END{SIZE,EOF,BYTES} | ERROR
 *   SETUP{ENTROPY?,TIME_NS?,HOSTNAME?,MACHINE_ID?} -> OK | ERROR
 *   UNPACK{PATH,MAX_BYTES,MAX_FILES}  -> CREDIT{WINDOW} (the first grant)
 *     DATA* DATA_END (a tar stream, never more bytes than granted)
 *                                     <- CREDIT* (more window as it drains)
 *                                     -> OK{report, BYTES} | ERROR (ERROR may
 *                                        come early; the agent ignores the
 *                                        rest of the id up to DATA_END)
 *   PACK{PATH,MAX_BYTES,MAX_FILES,WINDOW}
 *     CREDIT* (more window as the host writes the stream out)
 *                                     -> DATA* (within the window)
 *                                        PACK_END{report, BYTES} | ERROR
 *   KILL (same id as an UNPACK/PACK)  -> (ends with ERROR; an UNPACK's tree is
 *                                        left as it was, no staging behind)
 *
 * Trees (UNPACK, PACK) are tar streams (common/tarstream.h) with flow control
 * in both directions: the receiver grants CREDIT{WINDOW=n} (n more bytes of
 * DATA payload) as it drains what it got, so neither side buffers more than
 * one window (TREE_WINDOW) per tree, and a slow tar process or a slow host
 * file never stalls the other requests on the channel.  For UNPACK the agent
 * grants, for PACK the host (its first grant is PACK's WINDOW).  The report
 * is FILES, DIRS, SYMLINKS, TREE_BYTES (file content), SKIPPED (a count) and
 * up to TAR_SKIPPED_LISTED pairs of SKIP_PATH, SKIP_REASON (in that order,
 * repeated); BYTES is the length of the stream that went through DATA.
 *
 * A host that gives up on a request (cancelled, timed out) sends KILL for a
 * command (then STDIN_END if its stdin was not finished), or DATA_END before
 * SIZE bytes for an upload (the agent drops the file); the agent's answers
 * to it are then dropped.  Every answer must match its request (a HELLO_OK
 * only answers HELLO) and every numeric field must be in range: the host
 * ends the connection on a frame that is not.
 *
 * Streams (egress, docs/egress-design.md): the agent takes every TCP
 * connection and DNS query a program in the sandbox makes and opens a
 * stream or a lookup for it.  Ids of what the agent opens have bit 31 set
 * (PROTO_AGENT_ID), count up from 0x80000001 and are never reused while the
 * connection lives; the host's requests keep ids below 2^31.
 *   STREAM_OPEN{KIND,FAMILY,ADDR,PORT,WINDOW}   agent -> host
 *                                     <- STREAM_ACCEPT{WINDOW} | STREAM_RESET
 *   STREAM_DATA (raw bytes, <= PROTO_CHUNK)     both ways, never beyond the
 *                                        window the receiver granted
 *   STREAM_CREDIT{WINDOW}             both ways: the receiver drained N bytes
 *                                        and grants them again
 *   STREAM_SHUT                       both ways: the sender sends no more
 *                                        (FIN: the agent shuts its socket's
 *                                        write side)
 *   STREAM_RESET{ERRNO,MESSAGE?}      both ways, terminal: later frames of
 *                                        the id are dropped
 *   LOOKUP{NAME,QTYPE,TRANSPORT}      agent -> host
 *                                     <- LOOKUP_END{RCODE,ADDR*,TTL}
 *   EGRESS_STATS                      host -> agent (no TLVs)
 *                                     -> OK{UDP,ICMP,OTHER} | ERROR (no capture,
 *                                        or its rules are gone)
 *     the packets the capture's rules refused since it was set up (u64
 *     counts: UDP other than DNS, ICMP and ICMPv6, every other protocol);
 *     a vm's root can flush the rules, so a count may start again from 0.
 * OPEN's WINDOW is what the host may send before a CREDIT, ACCEPT's what the
 * agent may; neither side ever grants more than STREAM_WINDOW outstanding.
 * DATA beyond the grant, DATA after SHUT, a CREDIT over STREAM_WINDOW, an
 * agent id that does not count up, a frame for an id never opened: the
 * host ends the connection.  A stream ends when both sides sent SHUT, or at
 * one RESET.  The host may open streams too (ids below 2^31); the agent
 * answers them STREAM_RESET{EOPNOTSUPP} until something needs them.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* 3: HELLO carries SETUP's TLVs (an agent of 2 would ignore them, and a
 * clone would run with the RNG state of its siblings). */
#define PROTO_VERSION 3u
#define PROTO_HEADER_SIZE 12u
/* Largest payload either side accepts.  Output and file data are chunked to
 * PROTO_CHUNK, so every buffer on both sides stays bounded. */
#define PROTO_MAX_PAYLOAD (256u * 1024u)
#define PROTO_CHUNK (64u * 1024u)
/* Caps the agent enforces on fields it receives. */
#define PROTO_MAX_PATH 4096u
#define PROTO_MAX_COMMAND (1024u * 1024u)
#define PROTO_MAX_ENV 256u
#define PROTO_MAX_ENV_ENTRY 32768u
/* Trees: the window each side grants at most (and the agent's buffer per
 * UNPACK), and the longest SKIP_PATH / SKIP_REASON in a report (longer
 * ones are cut), so a report of TAR_SKIPPED_LISTED entries fits a frame. */
#define TREE_WINDOW (1024u * 1024u)
#define PROTO_MAX_SKIP_PATH 1024u
#define PROTO_MAX_SKIP_REASON 256u
/* Streams: bit 31 marks the ids the agent opens; the most bytes either side
 * grants a stream outstanding; the longest LOOKUP name (a DNS name in
 * dotted form: 253, a trailing dot, and room for what a hostile query
 * packs into labels is cut here) and the most addresses in a LOOKUP_END. */
#define PROTO_AGENT_ID 0x80000000u
#define STREAM_WINDOW (256u * 1024u)
#define PROTO_MAX_NAME 255u
#define PROTO_MAX_ADDRS 8u

enum proto_type {
  PROTO_HELLO = 1,
  PROTO_HELLO_OK = 2,
  PROTO_ERROR = 3,
  PROTO_PING = 4,
  PROTO_PONG = 5,
  PROTO_EXEC = 10,
  PROTO_STDIN = 11,
  PROTO_STDIN_END = 12,
  PROTO_STDOUT = 13,
  PROTO_STDERR = 14,
  PROTO_EXIT = 15,
  PROTO_KILL = 16,
  PROTO_WRITE = 20,
  PROTO_DATA = 21,
  PROTO_DATA_END = 22,
  PROTO_OK = 23,
  PROTO_READ = 24,
  PROTO_READ_END = 25,
  PROTO_SETUP = 30,
  PROTO_UNPACK = 40,
  PROTO_PACK = 41,
  PROTO_PACK_END = 42,
  PROTO_CREDIT = 43,
  PROTO_STREAM_OPEN = 50,
  PROTO_STREAM_ACCEPT = 51,
  PROTO_STREAM_DATA = 52,
  PROTO_STREAM_CREDIT = 53,
  PROTO_STREAM_SHUT = 54,
  PROTO_STREAM_RESET = 55,
  PROTO_LOOKUP = 56,
  PROTO_LOOKUP_END = 57,
  PROTO_EGRESS_STATS = 58,
};

enum proto_stream_kind { STREAM_KIND_TCP = 1 };
enum proto_lookup_transport { LOOKUP_UDP = 1, LOOKUP_TCP = 2 };
/* DNS response codes a LOOKUP_END carries. */
enum proto_rcode { RCODE_NOERROR = 0, RCODE_FORMERR = 1, RCODE_SERVFAIL = 2, RCODE_NXDOMAIN = 3,
                   RCODE_REFUSED = 5 };

enum proto_tag {
  TAG_VERSION = 1,     /* u32 */
  TAG_INFO = 2,        /* string */
  TAG_ERRNO = 3,       /* u32, positive errno */
  TAG_MESSAGE = 4,     /* string */
  TAG_COMMAND = 10,    /* string, run as /bin/sh -c COMMAND */
  TAG_CWD = 11,        /* string */
  TAG_ENV = 12,        /* string "NAME=VALUE", repeatable */
  TAG_TIMEOUT_MS = 13, /* u32, 0 = no timeout */
  TAG_HAS_STDIN = 14,  /* u32 0/1 */
  TAG_EXIT_CODE = 15,  /* u32 holding an int32: exit status, or -1 if signalled */
  TAG_SIGNAL = 16,     /* u32, 0 if exited normally */
  TAG_TIMED_OUT = 17,  /* u32 0/1 */
  TAG_DURATION_US = 18, /* u64 */
  TAG_PATH = 20,       /* string */
  TAG_MODE = 21,       /* u32 permission bits */
  TAG_SIZE = 22,       /* u64 */
  TAG_OFFSET = 23,     /* u64 */
  TAG_MAX = 24,        /* u64 */
  TAG_EOF = 25,        /* u32 0/1 */
  TAG_BYTES = 26,      /* u64 bytes sent in DATA frames */
  TAG_ENTROPY = 30,    /* bytes */
  TAG_TIME_NS = 31,    /* u64 CLOCK_REALTIME in ns */
  TAG_HOSTNAME = 32,   /* string */
  TAG_MACHINE_ID = 33, /* string, 32 hex chars */
  TAG_MAX_BYTES = 40,  /* u64, tar_limits.max_bytes */
  TAG_MAX_FILES = 41,  /* u64, tar_limits.max_files */
  TAG_WINDOW = 42,     /* u32, bytes of DATA granted (1..TREE_WINDOW) */
  TAG_FILES = 43,      /* u64 */
  TAG_DIRS = 44,       /* u64 */
  TAG_SYMLINKS = 45,   /* u64 */
  TAG_TREE_BYTES = 46, /* u64, file content */
  TAG_SKIPPED = 47,    /* u64, entries left out */
  TAG_SKIP_PATH = 48,  /* string, repeatable, each followed by its SKIP_REASON */
  TAG_SKIP_REASON = 49, /* string, repeatable */
  TAG_KIND = 60,       /* u32, enum proto_stream_kind */
  TAG_FAMILY = 61,     /* u32, 4 or 6 */
  TAG_ADDR = 62,       /* 4 or 16 bytes, network order; repeatable in LOOKUP_END */
  TAG_PORT = 63,       /* u32, 1..65535 */
  TAG_NAME = 64,       /* bytes, <= PROTO_MAX_NAME: a DNS name as the query spelt it */
  TAG_QTYPE = 65,      /* u32, the DNS QTYPE (1 A, 28 AAAA, 16 TXT, ...) */
  TAG_TRANSPORT = 66,  /* u32, enum proto_lookup_transport */
  TAG_RCODE = 67,      /* u32, enum proto_rcode */
  TAG_TTL = 68,        /* u32 seconds */
  TAG_EGRESS_ERROR = 69, /* string in HELLO_OK: why the sandbox has no capture
                          * (then it has no route out at all); absent when it has */
  TAG_UDP = 70,        /* u64 in EGRESS_STATS' OK: UDP packets refused (not DNS) */
  TAG_ICMP = 71,       /* u64: ICMP and ICMPv6 packets refused */
  TAG_OTHER = 72,      /* u64: packets of any other protocol refused */
};

struct proto_header {
  uint32_t len;
  uint8_t type;
  uint8_t flags;
  uint16_t rsvd;
  uint32_t id;
};

/* A growable buffer used to build a frame.  proto_frame_begin() reserves the
 * header; proto_frame_finish() fills it in.  On allocation failure the buffer
 * is marked failed and every later call is a no-op; check
 * proto_frame_finish()'s result once. */
struct proto_buf {
  uint8_t *data;
  size_t len;
  size_t cap;
  bool failed;
};

void proto_buf_free(struct proto_buf *b);
void proto_frame_begin(struct proto_buf *b, enum proto_type type, uint32_t id);
void proto_put_bytes(struct proto_buf *b, uint16_t tag, const void *v, size_t n);
void proto_put_str(struct proto_buf *b, uint16_t tag, const char *s);
/* A frame type's name, for messages ("EXEC"), or "unknown". */
const char *proto_type_name(uint8_t type);
void proto_put_u32(struct proto_buf *b, uint16_t tag, uint32_t v);
void proto_put_u64(struct proto_buf *b, uint16_t tag, uint64_t v);
void proto_put_raw(struct proto_buf *b, const void *v, size_t n);
/* 0, or -EMSGSIZE when the payload is over PROTO_MAX_PAYLOAD, -ENOMEM. */
int proto_frame_finish(struct proto_buf *b);

/* Header codec.  proto_header_decode() returns 0, or -EPROTO when the header
 * is invalid (payload too large, reserved bits set, unknown type). */
void proto_header_encode(uint8_t out[PROTO_HEADER_SIZE], const struct proto_header *h);
int proto_header_decode(const uint8_t in[PROTO_HEADER_SIZE], struct proto_header *ret);
bool proto_type_known(uint8_t type);

/* TLV iteration over a control payload.  proto_tlv_next() returns 1 and fills
 * the out-parameters for the next record, 0 at the end, -EPROTO when a
 * record runs past the payload. */
struct proto_tlv_iter {
  const uint8_t *p;
  size_t left;
};
void proto_tlv_init(struct proto_tlv_iter *it, const void *payload, size_t len);
int proto_tlv_next(struct proto_tlv_iter *it, uint16_t *ret_tag, const uint8_t **ret_val,
                   uint32_t *ret_len);

/* Typed readers for one TLV value: -EPROTO when the width is wrong. */
int proto_val_u32(const uint8_t *v, uint32_t len, uint32_t *ret);
int proto_val_u64(const uint8_t *v, uint32_t len, uint64_t *ret);

/* Convenience: find the first record with TAG.  Returns 1 found, 0 absent,
 * -EPROTO malformed. */
int proto_find(const void *payload, size_t len, uint16_t tag, const uint8_t **ret_val,
               uint32_t *ret_len);

/* Blocking helpers on a file descriptor, retrying EINTR and short transfers.
 * Return 0, or a negative errno (-EPIPE/-ECONNRESET when the peer left,
 * -ENODATA on a clean EOF before the first byte of a frame). */
int proto_write_all(int fd, const void *buf, size_t n);
int proto_read_all(int fd, void *buf, size_t n);
/* Read one frame into *payload (a buffer of at least PROTO_MAX_PAYLOAD). */
int proto_read_frame(int fd, struct proto_header *ret_h, uint8_t *payload);

static inline uint32_t proto_le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t proto_le64(const uint8_t *p) {
  return (uint64_t)proto_le32(p) | (uint64_t)proto_le32(p + 4) << 32;
}
static inline void proto_put_le32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16);
  p[3] = (uint8_t)(v >> 24);
}
static inline void proto_put_le64(uint8_t *p, uint64_t v) {
  proto_put_le32(p, (uint32_t)v);
  proto_put_le32(p + 4, (uint32_t)(v >> 32));
}
