/* client_int.h: what the parts of the host's agent client share (see
 * client.h): the connection, a call waiting for its answer, the frame
 * queues, the streams' table, and the helpers the parts use.  client.c has
 * the connection and the reader; client_writer.c the queues and the writer;
 * client_call.c a call's life and the checks on the agent's frames;
 * client_request.c the requests and their answers; client_tree.c both sides
 * of UNPACK and PACK; client_stream.c the streams and lookups the agent
 * opens.  Private to proto/client*.c. */
#pragma once

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/client.h"
#include "proto/proto.h"

/* How often a waiting call looks at its cancellation and deadline. */
#define TICK_MS 100u
#define PROGRESS_EVERY_MS 1000u
#define FILE_TIMEOUT_MS 300000u
#define TAIL_SIZE 512u

struct pending {
  struct pending *next;
  uint32_t id;
  uint8_t type;   /* request type */
  bool done;
  int result;     /* 0, or negative errno */
  char *err_msg;
  uint64_t start_ms;
  /* exec */
  struct agent_exec_res *res;
  size_t out_cap;
  void (*on_output)(void *ctx, int stream, const void *data, size_t len);
  void *output_ctx;
  char tail[TAIL_SIZE];
  size_t tail_len;
  /* read */
  uint8_t *data;
  size_t data_len, data_cap;
  uint64_t size;
  bool eof;
  /* write: the size announced */
  uint64_t write_size;
  /* unpack, pack */
  struct tree_call *tree;
  /* egress stats: UDP, ICMP, OTHER */
  uint64_t stats[3];
};

/* The state of an agent_unpack() or agent_pack() that the reader thread
 * shares with the calling thread (under c->lock). */
struct tree_call {
  const struct tar_limits *lim;
  uint64_t stream_cap;   /* stream bytes either side may move */
  uint64_t last_ms;      /* the last progress of any kind (mono_ms) */
  /* UNPACK: bytes the agent lets us send, and bytes sent. */
  uint64_t credit, sent;
  /* PACK: the stream received and not written to OUT_FD yet (a ring of
   * TREE_WINDOW bytes), what the agent may still send (counting a CREDIT
   * still queued, which it may not use yet), and bytes received. */
  uint8_t *ring;
  size_t ring_off, ring_len;
  uint64_t window_left, received;
  struct tar_report rep; /* from the terminal frame */
  bool agent_ended;      /* the agent sent its terminal frame */
};

struct out_frame {
  struct out_frame *next;
  uint32_t id;
  uint8_t type;
  bool refusal;   /* a stream or lookup the connection refused itself */
  size_t len;
  uint8_t *bytes; /* header and payload */
};

struct frame_queue {
  struct out_frame *head, **tail;
};

/* A stream or lookup the agent opened (client_stream.c).  Windows count
 * DATA payload bytes. */
struct agent_stream {
  struct agent_stream *next;  /* in its bucket */
  uint32_t id;
  bool lookup;
  /* The host ended it (RESET, LOOKUP_END): its last frame waits in a queue,
   * the agent's frames of it are dropped; gone once the writer took it. */
  bool zombie;
  bool accepted;
  bool agent_shut, host_shut, host_shut_taken;
  uint32_t send_window;       /* what the host may still send */
  /* What the host granted and has not received, and the part of it whose
   * ACCEPT or CREDIT still waits in ctl_q (the agent does not have it). */
  uint32_t recv_window, recv_unsent;
  struct out_frame *credit_f; /* a CREDIT still in ctl_q, grown by later grants */
};

#define STREAM_BUCKETS 256u

struct agent_conn {
  int fd;
  int wake_fd;                /* an eventfd: wakes the writer while it polls for room */
  pthread_t reader, writer;
  bool reader_started, writer_started;
  /* The stream handler: every call of it runs with hlock held (and not
   * lock); order hlock, then the handler's own locks, then lock. */
  pthread_mutex_t hlock;
  struct agent_stream_handler h; /* under hlock */
  bool h_set;                 /* under hlock */
  bool streams_closed;        /* under hlock: closed() was called, the reader ended */
  pthread_mutex_t lock;       /* everything below */
  pthread_cond_t cond;        /* calls: a frame arrived, room in the queue, death */
  pthread_cond_t wcond;       /* the writer: a frame was queued, death */
  struct pending *pending;
  uint32_t next_id;
  bool dead;
  bool fault;                 /* the host ended it: protocol broken or a write stalled */
  char *dead_reason;
  char *info;
  char *egress_error;
  struct frame_queue ctl_q, data_q, stream_q;
  size_t data_queued;         /* bytes in data_q */
  size_t stream_queued;       /* bytes in stream_q */
  bool stream_turn;           /* the writer takes stream_q next (else data_q) */
  bool writer_polling;        /* the writer waits in poll(): wake it by wake_fd */
  uint32_t write_deadline_ms;
  uint32_t exec_grace_ms;     /* EXEC_GRACE_MS unless set (tests) */
  int sndbuf;                 /* SO_SNDBUF; 0: SIOCOUTQ does not work on the fd */
  /* Streams: the table (live ones and zombies), counts, the last id the
   * agent opened, refusals the connection queued and the writer has not
   * taken, and whether writable() is owed (want) and due. */
  struct agent_stream *streams[STREAM_BUCKETS];
  unsigned n_streams, n_lookups;
  uint32_t last_agent_id;
  unsigned refusals_queued;
  bool want_writable, writable_due;
};

/* ---- client.c ------------------------------------------------------------ */

/* Gives MSG (taken) to *RET_ERR, or frees it when RET_ERR is NULL. */
void client_set_err(char **ret_err, char *msg);
static inline int client_dead_code(const struct agent_conn *c) {
  return c->fault ? -EPROTO : -EPIPE;
}
static inline bool client_cancelled(const struct agent_ctl *ctl) {
  return ctl && ctl->cancelled && atomic_load(ctl->cancelled);
}
static inline void client_finish(struct pending *p, int result) {
  p->done = true;
  p->result = result;
}
void client_mark_dead_locked(struct agent_conn *c, char *reason, bool fault);

/* ---- client_writer.c ----------------------------------------------------- */

/* The writer thread (ARG: the connection). */
void *client_writer_main(void *arg);
/* Tells the writer a frame was queued (or the connection died). */
void client_wake_writer_locked(struct agent_conn *c);

/* Frames and their queues (with c->lock held). */
void client_frame_free(struct out_frame *f);
void client_queue_push(struct frame_queue *q, struct out_frame *f);
struct out_frame *client_queue_pop(struct frame_queue *q);
void client_queue_clear(struct frame_queue *q);
uint64_t client_queue_purge(struct frame_queue *q, uint32_t id, size_t *ret_bytes);
int client_make_frame(struct proto_buf *b, struct out_frame **ret);

/* Queueing a call's frames. */
int client_enqueue(struct agent_conn *c, struct proto_buf *b, bool control,
                   const struct agent_ctl *ctl, uint64_t deadline, const struct pending *p);
int client_enqueue_data(struct agent_conn *c, enum proto_type t, const struct pending *p,
                        const void *raw, size_t n, const struct agent_ctl *ctl,
                        uint64_t deadline);

/* ---- client_call.c ------------------------------------------------------- */

/* A call: registered (a fresh id), waited for, given up, finished (see
 * client_call.c). */
int client_register_pending(struct agent_conn *c, struct pending *p, uint8_t type);
void client_unregister_pending(struct agent_conn *c, struct pending *p);
struct pending *client_find_pending(struct agent_conn *c, uint32_t id);
int client_wait_pending(struct agent_conn *c, struct pending *p, const struct agent_ctl *ctl,
                        uint32_t timeout_ms);
void client_abandon_request(struct agent_conn *c, const struct pending *p, bool kill_it,
                            uint8_t end_type, bool end_queued);
int client_finish_call(struct agent_conn *c, struct pending *p, int r, char **ret_err);
int client_dead_error(struct agent_conn *c, char **ret_err);

/* The checks on an agent's frame: each returns NULL when fine, or what
 * broke the protocol (malloc'd). */
char *client_field_u32(const uint8_t *payload, size_t len, uint8_t type, uint16_t tag,
                       const char *name, bool required, uint32_t lo, uint32_t hi, uint32_t *ret);
char *client_field_u64(const uint8_t *payload, size_t len, uint8_t type, uint16_t tag,
                       const char *name, bool required, uint64_t hi, uint64_t *ret);
char *client_field_str(const uint8_t *payload, size_t len, uint8_t type, uint16_t tag,
                       const char *name, size_t max, char **ret);
char *client_check_tlvs_but(const uint8_t *payload, size_t len, uint8_t type,
                            uint64_t repeatable);
char *client_check_tlvs(const uint8_t *payload, size_t len, uint8_t type);
char *client_parse_error(const uint8_t *payload, size_t len, char **ret_msg);
char *client_end_with_error(struct pending *p, const uint8_t *payload, size_t len);

/* ---- client_request.c ---------------------------------------------------- */

/* HELLO, with SETUP's TLVs when SETUP is given, and its answer within
 * TIMEOUT_MS (agent_conn_open_setup). */
int client_hello(struct agent_conn *c, uint32_t timeout_ms, const struct agent_setup_req *setup,
                 char **ret_err);
/* Hands a frame that answers a call (an id without PROTO_AGENT_ID) to it;
 * from the reader thread, with c->lock held.  NULL, or what broke the
 * protocol. */
char *client_request_frame(struct agent_conn *c, const struct proto_header *h,
                           const uint8_t *payload);

/* ---- client_tree.c ------------------------------------------------------- */

/* Hands a frame that answers the tree call P (UNPACK, PACK) to it; with
 * c->lock held.  NULL, or what broke the protocol. */
char *client_tree_frame(struct agent_conn *c, struct pending *p, const struct proto_header *h,
                        const uint8_t *payload);

/* ---- client_stream.c ----------------------------------------------------- */

/* A frame whose id has PROTO_AGENT_ID set: checked, and handed to the
 * handler (from the reader thread, without c->lock).  NULL, or what broke
 * the protocol. */
char *client_stream_frame(struct agent_conn *c, const struct proto_header *h,
                          const uint8_t *payload);
/* The writer took F (an agent id's) from its queue.  With c->lock held. */
void client_stream_taken_locked(struct agent_conn *c, const struct out_frame *f);
/* writable(), from the writer, without c->lock. */
void client_stream_writable(struct agent_conn *c);
/* The reader ends: closed(), once. */
void client_stream_closed(struct agent_conn *c);
/* agent_conn_free: the table's entries. */
void client_stream_free_all(struct agent_conn *c);
