/* exec_int.h: the commands' state (exec.c) and what the loop (agent.c)
 * calls: EXEC / STDIN / STDIN_END / KILL, the output pipes, the reaping of
 * children, the deadlines and the shutdown. */
#pragma once

#include <poll.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "guest/agent_core.h"

/* Caps on what the host can make the agent hold at once. */
#define EXEC_MAX_RUNNING 64u           /* commands started or waiting for stdin */
#define EXEC_MAX_STDIN (16u << 20)     /* bytes of stdin per command */
#define EXEC_MAX_DRAIN 128u            /* pipes of finished commands still read */
#define EXEC_MAX_GROUPS 256u           /* process groups remembered for shutdown */
#define EXEC_POLL_MAX (2u * EXEC_MAX_RUNNING + EXEC_MAX_DRAIN)

/* The shell is started with clone(CLONE_VM) on a stack of its own (exec.c). */
#define EXEC_CHILD_STACK (64u << 10)
#define EXEC_CHILD_GUARD 4096u
/* How long the agent waits for a child to reach execve before killing it. */
#define EXEC_CHILD_START_MS 10000u

enum exec_state_kind {
  EXEC_FREE = 0,
  EXEC_WAITING_STDIN, /* EXEC with HAS_STDIN=1 received, collecting STDIN */
  EXEC_RUNNING,       /* the shell has been started */
};

struct exec_cmd {
  enum exec_state_kind state;
  uint32_t id;
  /* Owned until the shell is started. */
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
  /* The children's stack (EXEC_CHILD_GUARD + EXEC_CHILD_STACK bytes), mapped
   * at the first command; one child at a time uses it. */
  void *child_stack;
  /* microVM: cgroup.procs of the cgroup commands run in (vm_init.c), which
   * each child joins before its execve; -1 elsewhere. */
  int cgroup_procs;
};

/* agent.c: the agent's one exec_state. */
struct exec_state *agent_exec(struct agent *a);

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

/* What the child needs, all of it prepared before clone(): it runs in the
 * agent's memory, on a stack of its own, and may not allocate. */
struct exec_child_args {
  int in, out, err;
  int done; /* write end of the CLOEXEC pipe whose EOF says the child is gone */
  int cgroup_procs; /* a cgroup.procs to join, or -1 */
  const char *cwd;
  char *const *argv;
  char *const *env;
};

/* exec_spawn.c: starts the shell of CA (fds, cwd, argv, env) in a process
 * group of its own and returns once it has exec'd or exited: its pid, or -1
 * with *RET_ERRNO set. */
pid_t exec_spawn(struct exec_state *e, const struct exec_child_args *ca, int *ret_errno);
