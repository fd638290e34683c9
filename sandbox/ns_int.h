/* ns_int.h: what the files of the namespace backend share (ns.c: the ops
 * table, a started sandbox's life and teardown; ns_create.c: its creation;
 * ns_uid.c: the uid blocks and id mapping; ns_snapshot.c: commits and the
 * inputs id): the sandbox's state, the fds the agent is given, and the
 * functions one file calls in another.  Private to sandbox/ns*.c. */
#pragma once

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>

#include "sandbox/sandbox.h"

/* The fds the agent is given (clone_agent in ns_create.c) or keeps open. */
#define NS_ROOTFS_FD 4            /* the idmapped rootfs in the agent */
#define NS_STAGE_FD 5             /* the idmapped stage layer in the agent */
/* The agent's setup tmpfs (upper/, scratch/), open for its whole life:
 * AGENT_NS_STATE_FD of guest/ns_setup.h. */
#define NS_STATE_FD 6
/* The agent's netfilter netlink socket, opened before it dropped its
 * capabilities, on which the server reads the refusal counters:
 * AGENT_NS_COUNTERS_FD of guest/egress_nl.h. */
#define NS_COUNTERS_FD 7

struct ns_sandbox {
  struct sandbox base;
  struct cgroup *cg;
  struct sandbox_proc proc; /* the agent */
  /* What the agent said on stderr while it started.  Calls that fail
   * together ask why at once: the pipe is read under the lock, and what was
   * read is kept for every one of them. */
  pthread_mutex_t err_lock;
  int err_fd;               /* read end of the agent's stderr, or -1 */
  char err_msg[1024];
  size_t err_len;
  int uid_lock_fds[2];      /* flocks held on the uid block's lock files, or -1 */
  unsigned host_uid;        /* uid 0 inside on the host (the block's first, or ours) */
  unsigned overlay_mb;      /* its disk: the tmpfs of its upper and scratch directories */
  const struct stage *stage; /* the stage it started from (held by the session), or NULL */
  int stage_layer_fd;       /* its layer/ (O_PATH), whatever is moved or renamed since, or -1 */
  char session_id[80];      /* for messages */
  /* The server's copy of the agent's counters socket (ns_ready), or -1 and
   * why not (a negative errno, a message); counters_lock keeps one dump at
   * a time on it. */
  pthread_mutex_t counters_lock;
  int counters_fd;
  int counters_errno;
  char counters_why[160];
};

/* Closes both fds that are open and marks them -1. */
static inline void ns_close_pair(int fds[2]) {
  for (int i = 0; i < 2; i++)
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
}

/* ---- ns_uid.c ---- */

/* Takes a free uid block of the sandboxes from BASE (IGN_MCP_NS_UID_BASE):
 * its first uid, and the flocks that hold it until the sandbox is reaped. */
int ns_uid_take(unsigned base, unsigned *ret_uid, int ret_fds[2], char **ret_err);
/* Writes the uid and gid maps of the child PID's user namespace (UID: the
 * block's first uid, as root). */
int ns_write_maps(pid_t pid, unsigned uid, char **ret_err);
/* An idmapped, read-only mount of a tree for the child PID's user
 * namespace. */
int ns_idmapped_tree(const char *what, const char *rootfs, int tree_fd, pid_t pid, int *ret_fd,
                     char **ret_err);

/* ---- ns_create.c ---- */

int ns_create(const struct sandbox_config *cfg, const char *session_id, struct sandbox **ret,
              char **ret_err);

/* ---- ns_snapshot.c ---- */

int ns_snapshot(struct sandbox *base, const char *dir, struct sandbox_snapshot *ret,
                char **ret_err);
/* Thaws a sandbox a final ns_snapshot left frozen. */
int ns_unpause(struct sandbox *base, char **ret_err);
/* What a sandbox from the base is made of (the agent's and the rootfs's
 * contents): the id stages are keyed by, and its text for humans. */
int ns_inputs_id(char **ret_id, char **ret_text, char **ret_err);
