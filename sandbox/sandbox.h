/* sandbox.h: the one interface every backend implements.
 *
 * A backend creates a sandbox with an ign-agent inside and hands back a
 * connected byte stream to that agent; it destroys the sandbox and everything
 * it made (processes, cgroups, sockets, state directories).  Nothing above
 * this interface knows which backend it talks to: sessions speak the agent
 * protocol over the stream and report the backend's isolation string. */
#pragma once

#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include "proto/client.h"

struct stage; /* sandbox/stage.h */

/* What one sandbox is made with.  The session layer fills one per sandbox
 * (from the configuration, plus the stage it starts from); a backend reads
 * only this, never the global configuration, for what may differ per
 * sandbox. */
struct sandbox_config {
  const char *rootfs;       /* resolved absolute path */
  const char *agent;        /* resolved absolute path of ign-agent */
  unsigned memory_mb;
  unsigned pids;
  unsigned overlay_mb;
  unsigned ns_uid_base;     /* first host uid of the ns sandboxes' blocks (root) */
  /* The stage to start from (its files are in stage->dir), or NULL for the
   * base.  The session layer holds a reference to it for as long as the
   * sandbox lives, so a backend may keep this pointer. */
  const struct stage *stage;
  /* A hibernated session resumed from STAGE: the sandbox keeps the identity
   * (hostname, machine id) the stage's memory holds, and gets only fresh
   * entropy and the clock. */
  bool keep_identity;
};

/* What ops->snapshot reports. */
struct sandbox_snapshot {
  /* In: the last snapshot of this sandbox (hibernate): on success its
   * processes stay stopped (vm: the guest; ns: the frozen cgroup, where
   * there is one), so nothing it does after the snapshot is lost or done
   * twice; the caller then destroys it, or calls ops->unpause. */
  bool final;
  const char *carries;      /* "memory" (vm: RAM, processes, files) or "files" (ns) */
  uint64_t paused_us;       /* how long the sandbox's processes were stopped (final: so far) */
};

struct sandbox;

struct sandbox_ops {
  const char *name;         /* "ns", "vm" */
  /* Creates a sandbox for SESSION_ID.  On success *ret owns a stream fd
   * (sandbox_fd) connected to the agent, which may still be starting. */
  int (*create)(const struct sandbox_config *cfg, const char *session_id, struct sandbox **ret,
                char **ret_err);
  /* Called once the agent has answered HELLO: last steps before hand-out. */
  int (*ready)(struct sandbox *sb, struct agent_conn *conn, char **ret_err);
  /* Kills the sandbox's process now, without waiting for it: the calls on
   * it then fail.  Safe from any thread, at any time before destroy, and
   * again after the process died on its own. */
  void (*kill)(struct sandbox *sb);
  /* Kills and removes everything; the stream fd is not touched (the agent
   * connection owns it by then). */
  void (*destroy)(struct sandbox *sb);
  /* Why a sandbox died, when it did on its own; NULL when unknown. */
  char *(*death_reason)(struct sandbox *sb);
  /* The id of everything a stage of this backend is made over (vm: QEMU,
   * kernel, initramfs with the agent, rootfs image, guest RAM, accelerator;
   * ns: the agent and the rootfs tree), as "b-" and 16 hex digits, and the
   * same as text for logs.  A stage whose inputs id differs from the
   * current one is refused before anything starts.  0, or a negative errno
   * with *ret_err (the backend cannot say yet: no base). */
  int (*inputs_id)(char **ret_id, char **ret_text, char **ret_err);
  /* Saves SB as it is now into DIR, an empty directory of the store made by
   * stage_begin (the backend chooses the files in it); SB keeps running.
   * The session layer guarantees that no call runs on SB meanwhile (its
   * agent is idle).  The sandbox's own stage (cfg->stage at create, or
   * NULL) is what DIR's contents are layered on, when the backend layers.
   * Fills *ret; 0, or a negative errno with *ret_err (DIR is then removed
   * by the caller). */
  int (*snapshot)(struct sandbox *sb, const char *dir, struct sandbox_snapshot *ret,
                  char **ret_err);
  /* Lets a sandbox left stopped by a final snapshot run on (the save failed
   * after it); 0, or a negative errno with *ret_err. */
  int (*unpause)(struct sandbox *sb, char **ret_err);
  /* Optional: the capture's refusal counters (UDP, ICMP, other; enum
   * egress_refused_kind of common/nft_counters.h) read by the backend
   * itself, for a sandbox whose agent cannot (ns: it has no capabilities;
   * the server dumps them on the netfilter socket the agent opened before
   * its drop, guest/egress_nl.h AGENT_NS_COUNTERS_FD).  NULL (vm): the broker
   * asks the agent (agent_egress_stats).  Any thread, between ready and
   * destroy; waits a second at most.  0, or a negative errno with *ret_err. */
  int (*egress_counters)(struct sandbox *sb, uint64_t ret[3], char **ret_err);
};

/* The fields common to all backends; a backend embeds this first. */
struct sandbox {
  const struct sandbox_ops *ops;
  int fd;                   /* stream to the agent; moved to agent_conn */
  const char *isolation;    /* "namespace", "microvm/kvm", "microvm/tcg" */
  char limits[192];         /* human summary of the limits in force */
  json_t *info;             /* extra open_session fields (path, phases), or NULL */
  /* What the agent's HELLO sets before it answers (vm: the clock, fresh
   * entropy, and the identity of a clone that has none yet), set by create;
   * zero: nothing (ns). */
  struct agent_setup_req hello;
  /* A connection to the agent its backend opened already (a vm pool
   * clone's, opened as the clone was filled), or NULL: sandbox_connect
   * hands it over. */
  struct agent_conn *conn;
  /* The inputs id (ops->inputs_id) of what this sandbox was made from, set
   * by create: a stage committed from it records this one, not whatever the
   * backend's inputs are by then.  Empty: the session layer asks
   * ops->inputs_id. */
  char inputs_id[24];
};

/* The connection to SB's agent: the one its backend opened (taken from
 * sb->conn), else one opened over sb->fd, whose HELLO carries sb->hello. */
static inline int sandbox_connect(struct sandbox *sb, uint32_t timeout_ms,
                                  struct agent_conn **ret, char **ret_err) {
  if (sb->conn) {
    *ret = sb->conn;
    sb->conn = NULL;
    return 0;
  }
  return agent_conn_open_setup(sb->fd, timeout_ms, &sb->hello, ret, ret_err);
}

extern const struct sandbox_ops sandbox_ns_ops;

/* Does the ns backend run as root here (a uid block and an idmapped rootfs
 * per sandbox), or as a user (the user's own uid, no idmapping)? */
bool ns_as_root(void);
/* Can this process make the namespaces of a sandbox?  0, or a negative
 * errno with *ret_err saying why not. */
int ns_probe(char **ret_err);

/* The size of a sandbox's overlay.  It is a tmpfs whose pages cannot be
 * swapped or reclaimed (guest RAM for a VM, the memory cgroup's charge for
 * ns): one as large as the memory would let a write be OOM-killed instead of
 * getting ENOSPC.  So it is at most half of MEMORY_MB. */
static inline unsigned sandbox_overlay_mb(unsigned memory_mb, unsigned overlay_mb) {
  return overlay_mb < memory_mb / 2 ? overlay_mb : memory_mb / 2;
}

/* In a child between fork and execve: every signal back to SIG_DFL and none
 * blocked.  The spawner thread runs with all signals blocked and the server
 * ignores SIGPIPE; both would pass through execve, and real-time signals
 * sent to a process that blocks them queue up against the sending uid's
 * RLIMIT_SIGPENDING (for a root server, every root process on the host).
 * Only async-signal-safe calls. */
static inline void sandbox_child_reset_signals(void) {
  /* Raw system calls: glibc's sigaction() refuses the two real-time signals
   * it keeps for itself (32 and 33), and the server's parent may have left
   * those ignored too. */
  struct {
    unsigned long handler, flags, restorer, mask;
  } dfl = {0}; /* SIG_DFL, no flags, nothing masked */
  for (int sig = 1; sig <= 64; sig++)
    if (sig != SIGKILL && sig != SIGSTOP)
      syscall(SYS_rt_sigaction, sig, &dfl, NULL, sizeof dfl.mask);
  unsigned long none = 0;
  syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, sizeof none);
}

/* Runs FN(ARG) on the long-lived spawner thread and returns its result.
 * Children that must die with the server (PR_SET_PDEATHSIG) are forked
 * there, because the death signal follows the thread that forked them. */
int spawner_call(int (*fn)(void *arg), void *arg);

/* The process that holds a sandbox (the ns agent, a QEMU), as its backend
 * keeps it.  Signals go through a pidfd, and the process is signalled and
 * reaped only here, under LOCK: once it is reaped its pid may belong to
 * someone else, and nothing sends to it again.  Nobody else may wait for
 * these children. */
struct sandbox_proc {
  pthread_mutex_t lock;
  pid_t pid;                /* 0: none yet */
  int pidfd;                /* -1: none (pidfd_open failed) */
  bool reaped;
  bool waited;              /* a sandbox_proc_wait with a timeout has ended */
  int status;               /* wait status once reaped */
};
void sandbox_proc_init(struct sandbox_proc *p);
/* Takes PID, a child of this process that nobody has reaped. */
void sandbox_proc_set(struct sandbox_proc *p, pid_t pid);
/* SIGKILL, unless it has been reaped; never blocks. */
void sandbox_proc_kill(struct sandbox_proc *p);
/* Reaps it if it has exited, waiting up to TIMEOUT_MS for that (only the
 * first time: a process that outlived one wait is looked at once more, not
 * waited for again, so calls that fail one after another on a hung sandbox
 * do not each wait).  Waiters do not hold the lock while they wait.  True
 * and *ret_status once reaped. */
bool sandbox_proc_wait(struct sandbox_proc *p, unsigned timeout_ms, int *ret_status);
/* Kills and reaps it (blocking), unless that happened already. */
void sandbox_proc_kill_wait(struct sandbox_proc *p);
/* Kills and reaps it, then frees what P holds. */
void sandbox_proc_fini(struct sandbox_proc *p);

/* cgroups (v1 or v2): one group per sandbox with memory and pids limits. */
struct cgroup;
/* Creates the group; returns 0 and *ret, or a negative errno with *ret_err
 * explaining why limits cannot be applied here. */
int cgroup_create(const char *name, unsigned memory_mb, unsigned pids, struct cgroup **ret,
                  char **ret_err);
int cgroup_attach(struct cgroup *cg, pid_t pid);
/* Kills whatever is still inside, waits for it to empty and removes it. */
void cgroup_destroy(struct cgroup *cg);
/* Removes groups left behind by servers that are no longer running. */
void cgroup_cleanup_stale(void);
/* Does CG (or NULL) have a freezer (v2 cgroup.freeze, v1 freezer.state)? */
bool cgroup_can_freeze(const struct cgroup *cg);
/* Thaws CG's processes without waiting (a killed sandbox a final snapshot
 * left frozen: v1 frozen tasks do not die until thawed). */
void cgroup_thaw_now(struct cgroup *cg);
/* Stops (FROZEN) or resumes every process of CG and waits up to TIMEOUT_MS
 * until the kernel says it is done.  0, or a negative errno with *ret_err. */
int cgroup_freeze(struct cgroup *cg, bool frozen, unsigned timeout_ms, char **ret_err);
