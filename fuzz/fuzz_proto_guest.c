/* fuzz_proto_guest.c: bytes from the host, as the agent reads them.  The
 * input is the host side of the channel: the real agent (its event loop,
 * exec.c, files.c, tree.c, machine.c) serves it on a socketpair until EOF, exactly as
 * in a sandbox, and its answers are read and dropped.
 *
 * The agent acts on what it reads (it writes files, forks commands, sets the
 * hostname and clock), so the target fences itself first: it becomes PID 1
 * of new user, pid, mount, network, UTS and IPC namespaces whose root is an
 * empty tmpfs (no shell to run, no host file to touch, no capability over
 * the host).  Under libFuzzer the working directory is bind-mounted into it
 * at the same path, for the corpus and crash files. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"
#include "guest/agent.h"

#define NEW_ROOT "/tmp"

static char cwd[PATH_MAX];
static int sigfd = -1;

static void die(const char *what) {
  fprintf(stderr, "fuzz_proto_guest: %s: %m\n", what);
  _exit(1);
}

static void write_file(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text))
    die(path);
  close(fd);
}

static void mkdirs(const char *path) {
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s", path);
  for (char *s = p + 1; *s; s++)
    if (*s == '/') {
      *s = '\0';
      mkdir(p, 0755);
      *s = '/';
    }
  mkdir(p, 0755);
}

static void fence(bool bind_cwd) {
  uid_t uid = getuid();
  gid_t gid = getgid();
  if (unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWUTS |
              CLONE_NEWIPC) < 0)
    die("cannot make the namespaces the agent is fuzzed in (unshare)");
  char map[64];
  write_file("/proc/self/setgroups", "deny");
  snprintf(map, sizeof map, "0 %u 1", (unsigned)uid);
  write_file("/proc/self/uid_map", map);
  snprintf(map, sizeof map, "0 %u 1", (unsigned)gid);
  write_file("/proc/self/gid_map", map);

  pid_t pid = fork();
  if (pid < 0)
    die("fork");
  if (pid > 0) {
    /* The parent stays outside and passes on how the fuzzer ended. */
    int status;
    while (waitpid(pid, &status, 0) < 0)
      if (errno != EINTR)
        die("waitpid");
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  /* PID 1 of the new pid namespace: dies with the parent. */
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
    die("prctl");
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    die("mount --make-rprivate /");
  if (mount("fuzz-root", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=32m,mode=0755") < 0)
    die("mount tmpfs");
  char p[PATH_MAX + 16];
  if (bind_cwd) {
    snprintf(p, sizeof p, NEW_ROOT "%s", cwd);
    mkdirs(p);
    if (mount(cwd, p, NULL, MS_BIND | MS_REC, NULL) < 0)
      die("bind-mount the working directory");
  }
  mkdirs(NEW_ROOT "/proc");
  mkdirs(NEW_ROOT "/dev");
  int fd = open(NEW_ROOT "/dev/null", O_CREAT | O_WRONLY | O_CLOEXEC, 0666);
  if (fd < 0)
    die("create /dev/null");
  close(fd);
  if (mount("/dev/null", NEW_ROOT "/dev/null", NULL, MS_BIND, NULL) < 0)
    die("bind-mount /dev/null");
  if (chdir(NEW_ROOT) < 0 || chroot(".") < 0)
    die("chroot");
  if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
    die("mount /proc");
  if (chdir(bind_cwd ? cwd : "/") < 0)
    die("chdir");
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  if (!getcwd(cwd, sizeof cwd))
    die("getcwd");
  fence(!getenv("IGN_FUZZ_REPLAY"));
  signal(SIGPIPE, SIG_IGN);
  struct agent a = {.mode = AGENT_MODE_FD};
  int r = agent_signals_init(&a);
  if (r < 0) {
    errno = -r;
    die("signals");
  }
  sigfd = a.sigfd;
  return 0;
}

/* ---- the host end ------------------------------------------------------- */

struct host {
  int fd;
  const uint8_t *data;
  size_t size;
};

static void *host_main(void *arg) {
  struct host *h = arg;
  size_t sent = 0;
  bool open = true;
  static char sink[1 << 16];
  if (h->size == 0)
    shutdown(h->fd, SHUT_WR);
  while (open) {
    struct pollfd p = {.fd = h->fd, .events = POLLIN | (sent < h->size ? POLLOUT : 0)};
    if (poll(&p, 1, -1) < 0) {
      if (errno == EINTR)
        continue;
      break;
    }
    if ((p.revents & POLLOUT) && sent < h->size) {
      ssize_t n = send(h->fd, h->data + sent, h->size - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0)
        sent += (size_t)n;
      else if (n < 0 && errno != EAGAIN)
        sent = h->size;
      if (sent == h->size)
        shutdown(h->fd, SHUT_WR);
    }
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      ssize_t n = recv(h->fd, sink, sizeof sink, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
        open = false;
    }
  }
  return NULL;
}

/* ---- what one input left behind ---------------------------------------- */

static int remove_one(const char *path, const struct stat *st, int flag, struct FTW *f) {
  (void)st;
  (void)f;
  if (flag == FTW_DP)
    rmdir(path);
  else
    unlink(path);
  return 0;
}

static void clean_root(void) {
  char keep[PATH_MAX];
  snprintf(keep, sizeof keep, "%s", cwd + 1);
  char *slash = strchr(keep, '/');
  if (slash)
    *slash = '\0';
  DIR *d = opendir("/");
  if (!d)
    return;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, "proc") ||
        !strcmp(e->d_name, "dev") || !strcmp(e->d_name, keep))
      continue;
    char p[PATH_MAX];
    snprintf(p, sizeof p, "/%s", e->d_name);
    nftw(p, remove_one, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
  }
  closedir(d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static struct agent a;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
    die("socketpair");
  memset(&a, 0, sizeof a);
  a.mode = AGENT_MODE_FD;
  a.chan = sv[0];
  a.chan_ok = true;
  a.sigfd = sigfd;
  exec_init(&a.exec);
  files_init(&a.files);
  struct host h = {.fd = sv[1], .data = data, .size = size};
  pthread_t t;
  if (pthread_create(&t, NULL, host_main, &h) != 0)
    die("pthread_create");
  agent_serve(&a); /* closes sv[0] */
  pthread_join(t, NULL);
  close(sv[1]);
  while (waitpid(-1, NULL, WNOHANG) > 0)
    ;
  clean_root();
  return 0;
}
