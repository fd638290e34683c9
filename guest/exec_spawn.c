/* exec_spawn.c: how exec.c starts a command's shell.
 *
 * The shell is started with clone(CLONE_VM), not fork(): the child runs on
 * a stack of its own in the agent's memory until its execve, and the agent
 * waits for that (the EOF of a close-on-exec pipe) before it goes on.  No
 * page table is copied and no page made copy-on-write, which under TCG is
 * what a fork costs.  The agent is not dumpable, so a command cannot open
 * the memory such a child shares with it. */
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/util.h"
#include "guest/agent_core.h"
#include "guest/exec_int.h"

/* ---- the child ---------------------------------------------------------- */

/* Async-signal-safe: write(2) only.  strerrordesc_np() is a table lookup. */
static void exec_child_say(const char *what, int err) {
  const char *desc = strerrordesc_np(err);
  const char *parts[] = {"ign-agent: ", what, ": ", desc ? desc : "unknown error", "\n"};
  for (size_t i = 0; i < ARRAY_SIZE(parts); i++)
    if (write(STDERR_FILENO, parts[i], strlen(parts[i])) < 0)
      break;
}

/* A command must not reach into the agent and take over its channel:
 * ptrace, pidfd_getfd() and /proc/1/mem all need CAP_SYS_PTRACE over a
 * process whose capabilities are not a subset of the caller's.  In a
 * microVM commands run as root; they lose that one capability, from the
 * bounding set too (so no setuid program gives it back), and keep the rest
 * (tracing their own children still works).  Where the agent holds no
 * capability (ns) there is nothing to drop and the calls change nothing.
 * Raw system calls only: this runs between clone() and execve(). */
static void exec_child_drop_ptrace(void) {
  syscall(SYS_prctl, PR_CAPBSET_DROP, CAP_SYS_PTRACE, 0, 0, 0);
  struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
  struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {0};
  if (syscall(SYS_capget, &hdr, data) < 0)
    return;
  uint32_t bit = CAP_TO_MASK(CAP_SYS_PTRACE);
  struct __user_cap_data_struct *d = &data[CAP_TO_INDEX(CAP_SYS_PTRACE)];
  if (!((d->effective | d->permitted | d->inheritable) & bit))
    return;
  d->effective &= ~bit;
  d->permitted &= ~bit;
  d->inheritable &= ~bit;
  syscall(SYS_capset, &hdr, data);
}


/* The child shares the agent's memory (CLONE_VM), so between clone() and
 * execve() only async-signal-safe calls that touch nothing but its own
 * stack and the (read-only) args.  errno is the agent's too: the agent makes
 * no call that can fail until the child is gone. */
__attribute__((noreturn)) static int exec_child(void *arg) {
  const struct exec_child_args *ca = arg;
  setpgid(0, 0);
  /* Into the commands' cgroup (microVM), so that however many processes a
   * command makes, they share one small CPU weight against the agent's.  A
   * failure leaves the command beside the agent; it still runs. */
  if (ca->cgroup_procs >= 0 && write(ca->cgroup_procs, "0", 1) < 0) {
    /* nothing to do about it here */
  }
  exec_child_drop_ptrace();
  /* The agent ignores SIGPIPE and blocks SIGCHLD (and exec_start() blocked
   * every signal around the clone, so that no handler runs here); commands
   * must not inherit either (ignored dispositions and the mask survive
   * execve). */
  struct sigaction dfl = {.sa_handler = SIG_DFL};
  for (int sig = 1; sig < NSIG; sig++)
    sigaction(sig, &dfl, NULL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  /* fds 0-2 of the agent are always open, so in/out/err are >= 3 and dup2
   * clears their close-on-exec flag on the copies. */
  if (dup2(ca->in, STDIN_FILENO) < 0 || dup2(ca->out, STDOUT_FILENO) < 0 ||
      dup2(ca->err, STDERR_FILENO) < 0)
    _exit(127);
  if (chdir(ca->cwd) < 0) {
    exec_child_say("cannot enter the working directory", errno);
    _exit(127);
  }
  /* Every agent fd is close-on-exec already; this also covers fds a
   * library might have opened without it.  The done pipe stays open (it
   * is close-on-exec): the exec closes it, or _exit does. */
  close_range(3, (unsigned)ca->done - 1, 0);
  close_range((unsigned)ca->done + 1, ~0u, 0);
  execve("/bin/sh", ca->argv, ca->env);
  exec_child_say("cannot run /bin/sh", errno);
  _exit(127);
}

/* ---- starting ----------------------------------------------------------- */

/* The child's stack, mapped once, with a guard page below it. */
static void *exec_child_stack(struct exec_state *e) {
  if (!e->child_stack) {
    void *p = mmap(NULL, EXEC_CHILD_STACK + EXEC_CHILD_GUARD, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (p == MAP_FAILED)
      return NULL;
    if (mprotect(p, EXEC_CHILD_GUARD, PROT_NONE) < 0) {
      munmap(p, EXEC_CHILD_STACK + EXEC_CHILD_GUARD);
      return NULL;
    }
    e->child_stack = p;
  }
  return (uint8_t *)e->child_stack + EXEC_CHILD_GUARD + EXEC_CHILD_STACK;
}

/* Waits until the child has exec'd or exited: the done pipe's write end,
 * close-on-exec, is then closed.  A child stopped on the way (a command may
 * SIGSTOP every process it can) must not hold the agent: after
 * EXEC_CHILD_START_MS it is killed, and its end is reported as for any
 * command killed by a signal. */
static void exec_wait_started(int done, pid_t pid) {
  struct pollfd p = {.fd = done, .events = POLLIN};
  if (poll(&p, 1, EXEC_CHILD_START_MS) == 0) {
    agent_log("command %d did not reach execve within %u ms (stopped?); killing it", (int)pid,
              EXEC_CHILD_START_MS);
    kill(pid, SIGKILL);
  }
  /* EOF only: the child writes nothing.  Blocks until the exec or the exit
   * has closed the last write end. */
  char c;
  while (read(done, &c, 1) < 0 && errno == EINTR)
    ;
}

/* Starts the shell with clone(CLONE_VM) rather than fork(): fork copies the
 * agent's page tables and makes every page copy-on-write, which under TCG
 * costs more than the exec itself.  The agent waits for the child to exec
 * (or exit) before it touches anything the child reads. */
pid_t exec_spawn(struct exec_state *e, const struct exec_child_args *ca_in, int *ret_errno) {
  void *stack = exec_child_stack(e);
  if (!stack) {
    *ret_errno = errno;
    return -1;
  }
  int p[2];
  if (pipe2(p, O_CLOEXEC) < 0) {
    *ret_errno = errno;
    return -1;
  }
  struct exec_child_args ca = *ca_in;
  ca.done = p[1];
  /* Every signal blocked across the clone: a handler must not run in the
   * child, on the agent's memory.  The child unblocks them itself. */
  sigset_t all, old;
  sigfillset(&all);
  sigprocmask(SIG_SETMASK, &all, &old);
  pid_t pid = clone(exec_child, stack, CLONE_VM | SIGCHLD, &ca);
  int err = errno;
  close(p[1]);
  if (pid > 0) {
    /* Also here, so the group exists before any kill(-pid) of ours. */
    setpgid(pid, pid);
    exec_wait_started(p[0], pid);
  }
  close(p[0]);
  sigprocmask(SIG_SETMASK, &old, NULL);
  if (pid < 0)
    *ret_errno = err;
  return pid;
}
