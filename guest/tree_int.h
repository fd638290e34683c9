/* tree_int.h: the tree copies' state (tree.c) and what the loop (agent.c)
 * calls: UNPACK / PACK / CREDIT (and their DATA, DATA_END, KILL), the pipes
 * of their tar children, the reaping, the kill deadlines, the shutdown. */
#pragma once

#include <limits.h>
#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "guest/agent_core.h"

#define TREE_MAX 8u                    /* UNPACK and PACK requests at once */

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

/* An all-zero tree_state is a valid empty one. */
struct tree_state {
  struct tree trees[TREE_MAX];
};

/* agent.c: the agent's one tree_state. */
struct tree_state *agent_trees(struct agent *a);

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
