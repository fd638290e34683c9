/* spawn.c: the spawner thread and child reaping shared by the backends.
 *
 * PR_SET_PDEATHSIG fires when the *thread* that forked a child exits, not
 * the process.  Tool calls run on short-lived threads, so every sandbox
 * process is forked on this one thread, which lives as long as the server:
 * the death signal then means exactly "the server is gone". */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/wait.h>

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

void sandbox_kill_wait(pid_t pid) {
  if (pid <= 0)
    return;
  kill(pid, SIGKILL);
  while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
    ;
}
