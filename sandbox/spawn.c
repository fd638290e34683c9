/* spawn.c: the spawner thread, and the kill/reap mechanics shared by the
 * backends (struct sandbox_proc).
 *
 * PR_SET_PDEATHSIG fires when the *thread* that forked a child exits, not
 * the process.  Tool calls run on short-lived threads, so every sandbox
 * process is forked on this one thread, which lives as long as the server:
 * the death signal then means exactly "the server is gone". */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "sandbox/sandbox.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static bool started;
static int (*job_fn)(void *);
static void *job_arg;
static bool job_done;
static int job_result;

static void *spawner_main(void *unused) {
  (void)unused;
  pthread_mutex_lock(&lock);
  for (;;) {
    while (!job_fn)
      pthread_cond_wait(&cond, &lock);
    int (*fn)(void *) = job_fn;
    void *arg = job_arg;
    pthread_mutex_unlock(&lock);
    int r = fn(arg);
    pthread_mutex_lock(&lock);
    job_fn = NULL;
    job_result = r;
    job_done = true;
    pthread_cond_broadcast(&cond);
  }
  return NULL;
}

int spawner_call(int (*fn)(void *arg), void *arg) {
  pthread_mutex_lock(&call_lock);
  pthread_mutex_lock(&lock);
  if (!started) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* The spawner never runs with signals the main loop waits for. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int r = pthread_create(&t, &attr, spawner_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (r != 0) {
      pthread_mutex_unlock(&lock);
      pthread_mutex_unlock(&call_lock);
      return -r;
    }
    started = true;
  }
  job_fn = fn;
  job_arg = arg;
  job_done = false;
  pthread_cond_broadcast(&cond);
  while (!job_done)
    pthread_cond_wait(&cond, &lock);
  int r = job_result;
  pthread_mutex_unlock(&lock);
  pthread_mutex_unlock(&call_lock);
  return r;
}

/* ---- a sandbox's process: kill and reap behind one lock ---- */

void sandbox_proc_init(struct sandbox_proc *p) {
  *p = (struct sandbox_proc){.pidfd = -1};
  pthread_mutex_init(&p->lock, NULL);
}

void sandbox_proc_set(struct sandbox_proc *p, pid_t pid) {
  pthread_mutex_lock(&p->lock);
  p->pid = pid;
  /* The child is not reaped yet, so PID is still it. */
  p->pidfd = pidfd_open(pid, 0);
  if (p->pidfd < 0)
    log_warn("pidfd_open(%d): %s; signals to it go by pid, under the reap lock", (int)pid,
             strerror(errno));
  pthread_mutex_unlock(&p->lock);
}

/* Called with the lock. */
static void proc_reap_locked(struct sandbox_proc *p, int options) {
  if (p->reaped || p->pid <= 0)
    return;
  int status;
  pid_t r;
  while ((r = waitpid(p->pid, &status, options)) < 0 && errno == EINTR)
    ;
  if (r == p->pid) {
    p->reaped = true;
    p->status = status;
  } else if (r < 0 && errno == ECHILD) {
    /* Only this file reaps these children; ECHILD means it is gone. */
    p->reaped = true;
    p->status = W_EXITCODE(0, SIGKILL);
  }
}

static void proc_kill_locked(struct sandbox_proc *p) {
  if (p->reaped || p->pid <= 0)
    return;
  /* Unreaped, the pid is still the child's: the fallback is safe too. */
  if (p->pidfd >= 0)
    pidfd_send_signal(p->pidfd, SIGKILL, NULL, 0);
  else
    kill(p->pid, SIGKILL);
}

void sandbox_proc_kill(struct sandbox_proc *p) {
  pthread_mutex_lock(&p->lock);
  proc_kill_locked(p);
  pthread_mutex_unlock(&p->lock);
}

bool sandbox_proc_wait(struct sandbox_proc *p, unsigned timeout_ms, int *ret_status) {
  pthread_mutex_lock(&p->lock);
  proc_reap_locked(p, WNOHANG);
  bool wait = !p->reaped && !p->waited && timeout_ms > 0 && p->pid > 0;
  int pidfd = p->pidfd;
  pthread_mutex_unlock(&p->lock);
  if (wait) {
    /* A pidfd polls readable once the process exits.  P (and the pidfd)
     * live until the backend's destroy, which no waiter outlives. */
    uint64_t deadline = mono_ms() + timeout_ms;
    for (;;) {
      uint64_t now = mono_ms();
      if (now >= deadline)
        break;
      if (pidfd >= 0) {
        struct pollfd pfd = {.fd = pidfd, .events = POLLIN};
        int n = poll(&pfd, 1, (int)(deadline - now));
        if (n < 0 && errno == EINTR)
          continue;
        break;
      }
      pthread_mutex_lock(&p->lock);
      proc_reap_locked(p, WNOHANG);
      bool done = p->reaped;
      pthread_mutex_unlock(&p->lock);
      if (done)
        break;
      usleep(10000);
    }
  }
  pthread_mutex_lock(&p->lock);
  proc_reap_locked(p, WNOHANG);
  if (wait)
    p->waited = true;
  bool reaped = p->reaped;
  int status = p->status;
  pthread_mutex_unlock(&p->lock);
  if (reaped && ret_status)
    *ret_status = status;
  return reaped;
}

void sandbox_proc_kill_wait(struct sandbox_proc *p) {
  pthread_mutex_lock(&p->lock);
  proc_kill_locked(p);
  proc_reap_locked(p, 0);
  pthread_mutex_unlock(&p->lock);
}

void sandbox_proc_fini(struct sandbox_proc *p) {
  sandbox_proc_kill_wait(p);
  if (p->pidfd >= 0)
    close(p->pidfd);
  p->pidfd = -1;
  pthread_mutex_destroy(&p->lock);
}
