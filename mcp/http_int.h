/* http_int.h: what mcp/http.c (connections, answers, serving a request,
 * start and stop) shares with mcp/http_check.c (what a request must carry:
 * its headers, its origin, its legacy MCP session).  Private to the two. */
#pragma once

#include <jansson.h>
#include <microhttpd.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <pthread.h>
#include <sys/types.h>

#include "mcp/server.h"

/* Legacy MCP sessions: each is a few bytes, but a client that never sends
 * DELETE must not grow the table forever. */
#define MAX_LEGACY 256
#define LEGACY_IDLE_MS (3600ull * 1000)
/* Header values quoted in error messages are cut to this. */
#define QUOTE_MAX 64

#define META_VERSION MCP_META_VERSION

#ifndef MIN
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#endif

/* Legacy MCP sessions (2025-03-26 ... 2025-11-25), each bound to the token
 * name (OWNER) that made it.  touch: whether ID is OWNER's, refreshing its
 * idle time; end: ends it, whether it was; new: mints one into RET (33
 * bytes), ending the longest idle when the table is full; 0 or -errno. */
bool http_legacy_touch(const char *id, const char *owner);
bool http_legacy_end(const char *id, const char *owner);
int http_legacy_new(const char *owner, char *ret);
/* At exit: every legacy MCP session ends. */
void http_legacy_free_all(void);

/* A request header's value, or NULL. */
const char *http_hdr(struct MHD_Connection *c, const char *name);
/* The first header this server decides on that the request sends twice. */
const char *http_duplicate_header(struct MHD_Connection *c);
/* V (N bytes) quoted for a message, cut to QUOTE_MAX; to free. */
char *http_quote(const char *v, size_t n);
/* Why a 2026-07-28 request's headers do not match its body (method M,
 * PARAMS), to free; NULL when they do. */
char *http_modern_mismatch(struct MHD_Connection *c, const char *m, json_t *params);
/* "Host" or "Origin" when that header names someone else (DNS rebinding;
 * Host only when the server is bound to LOOPBACK), NULL when both are fine. */
const char *http_origin_refusal(struct MHD_Connection *c, bool loopback);
/* Whether a server bound to LOOPBACK must refuse the request for having no
 * Host header at all (HTTP/1.0 may leave it out). */
bool http_host_missing(struct MHD_Connection *c, bool loopback);
/* Whether the media range list A names TYPE, or a wildcard covering it when
 * WILD. */
bool http_accepts(const char *a, const char *type, bool wild);

/* ---- the transport (http.c) ---- */

/* IGN_MCP_HTTP_TIMEOUT_SECS in milliseconds. */
uint64_t http_timeout_ms(void);
/* Past the shutdown wait: requests still waiting for an answer give up. */
bool http_abandoning(void);

/* ---- one request's answer (http_answer.c) ---- */

struct msg {
  struct msg *next;
  char *text;
  size_t len, off; /* off: how much of its SSE event went out */
};

struct post_out {
  struct mcp_out out;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  unsigned refs;   /* the connection (or its SSE response) and the call */
  bool sse;        /* notifications are kept and sent as events */
  bool done;       /* the response is queued */
  bool gone;       /* the client went away: nothing more is kept */
  int error_code;  /* the response's JSON-RPC error code, 0 for a result */
  size_t queued;   /* bytes of the notifications in the queue */
  struct msg *head, **tail;
  int fd;
  uint64_t last_write; /* SSE: when the last bytes went out (keep-alives) */
};

/* A request's output, held once by the connection; C (may be NULL) is the
 * connection whose socket tells whether the client went away. */
struct post_out *http_post_new(struct MHD_Connection *c);
void http_post_release(struct mcp_out *o);
/* Waits for P's response, for its call to end without one (cancelled), or
 * for the client to go away (which cancels the call).  False: gone. */
bool http_post_wait(struct post_out *p);
/* Queues R (may be NULL: MHD_NO) with STATUS and drops it. */
enum MHD_Result http_queue(struct MHD_Connection *c, unsigned status, struct MHD_Response *r);
/* Answers with TEXT (LEN bytes, taken; NULL: no body) and, when set, a
 * header HNAME: HVAL. */
enum MHD_Result http_reply_text(struct MHD_Connection *c, unsigned status, char *text,
                                size_t len, const char *hname, const char *hval);
/* Answers with P's response as one JSON body and, when set, a header
 * HNAME: HVAL. */
enum MHD_Result http_reply_post(struct MHD_Connection *c, struct post_out *p, unsigned status,
                                const char *hname, const char *hval);
/* Answers with a JSON-RPC error (DATA taken, may be NULL) and, when set, a
 * header HNAME: HVAL. */
enum MHD_Result http_reply_error_data(struct MHD_Connection *c, unsigned status, json_t *id,
                                      int code, const char *msg, json_t *data,
                                      const char *hname, const char *hval);
enum MHD_Result http_reply_error(struct MHD_Connection *c, unsigned status, json_t *id,
                                 int code, const char *msg);
/* The HTTP status of a response with JSON-RPC error CODE (0: a result). */
unsigned http_status_of(int code, bool modern);
/* libmicrohttpd's content callback and its cleanup for an SSE answer; CLS
 * is the struct post_out. */
ssize_t http_sse_read(void *cls, uint64_t pos, char *buf, size_t max);
void http_sse_free(void *cls);
