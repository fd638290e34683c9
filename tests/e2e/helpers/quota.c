/* quota.c: takes or tries one per-user kernel count, for userns.test.mjs.
 *
 * Built static by the test, run both inside a sandbox and on the host:
 *   quota inotify-hold | mq-hold | pipe-hold
 *       takes instances until the kernel refuses one, prints
 *       "<what> held=<n> refused=<errno name>" and sleeps, holding them;
 *   quota inotify-try | mq-try | pipe-try
 *       tries one and prints "<what> ok", "<what> refused=<errno name>", or
 *       for pipes "pipe size=<bytes of a new pipe>". */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <mqueue.h>
#include <stdio.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/resource.h>
#include <unistd.h>

static const char *err_name(int e) {
  switch (e) {
  case EMFILE: return "EMFILE";
  case ENFILE: return "ENFILE";
  case ENOMEM: return "ENOMEM";
  case EPERM: return "EPERM";
  case ENOSPC: return "ENOSPC";
  case EACCES: return "EACCES";
  case EEXIST: return "EEXIST";
  default: return strerror(e);
  }
}

static void hold(const char *what, int n, int e) {
  printf("%s held=%d refused=%s\n", what, n, err_name(e));
  fflush(stdout);
  for (;;)
    pause();
}

static int mq_one(int i, char *name, size_t size) {
  struct mq_attr attr = {.mq_maxmsg = 10, .mq_msgsize = 8192};
  snprintf(name, size, "/ign-quota-%d-%d", (int)getpid(), i);
  mqd_t q = mq_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600, &attr);
  return q == (mqd_t)-1 ? -errno : 0;
}

int main(int argc, char **argv) {
  if (argc != 2)
    return 2;
  const char *m = argv[1];
  /* Room for every instance we may take. */
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  if (strcmp(m, "inotify-hold") == 0) {
    int n = 0;
    for (;;) {
      if (inotify_init1(IN_CLOEXEC) < 0)
        hold("inotify", n, errno);
      n++;
    }
  }
  if (strcmp(m, "inotify-try") == 0) {
    int fd = inotify_init1(IN_CLOEXEC);
    if (fd < 0)
      printf("inotify refused=%s\n", err_name(errno));
    else
      printf("inotify ok\n");
    return 0;
  }
  if (strcmp(m, "mq-hold") == 0) {
    char name[64];
    for (int n = 0;; n++) {
      int r = mq_one(n, name, sizeof name);
      if (r < 0)
        hold("mq", n, -r);
    }
  }
  if (strcmp(m, "mq-try") == 0) {
    char name[64];
    int r = mq_one(0, name, sizeof name);
    if (r < 0) {
      printf("mq refused=%s\n", err_name(-r));
    } else {
      mq_unlink(name);
      printf("mq ok\n");
    }
    return 0;
  }
  if (strcmp(m, "pipe-hold") == 0) {
    /* Pipes of 1 MiB (pipe-max-size for users) until the per-user soft
     * limit (pipe-user-pages-soft) refuses to grow one; "refused=EPERM"
     * once new pipes are shrunk. */
    int n = 0, p[2];
    for (;; n++) {
      if (pipe2(p, O_CLOEXEC) < 0)
        hold("pipe", n, errno);
      if (fcntl(p[1], F_SETPIPE_SZ, 1 << 20) < 0)
        break;
    }
    /* The rest with pipes of the default size, until a new one comes out
     * shrunk: the limit is reached. */
    for (;; n++) {
      if (pipe2(p, O_CLOEXEC) < 0)
        hold("pipe", n, errno);
      if (fcntl(p[1], F_GETPIPE_SZ) < 65536)
        hold("pipe", n, EPERM);
    }
  }
  if (strcmp(m, "pipe-try") == 0) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) {
      printf("pipe refused=%s\n", err_name(errno));
      return 0;
    }
    printf("pipe size=%d\n", fcntl(p[1], F_GETPIPE_SZ));
    return 0;
  }
  return 2;
}
