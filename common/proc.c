/* proc.c: running a helper program to read what it prints (see proc.h). */
#include "common/proc.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"

extern char **environ;

int proc_run_capture(char *const argv[], char *out, size_t size, int timeout_ms) {
  int p[2];
  if (pipe2(p, O_CLOEXEC) < 0)
    return -errno;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, p[1], 1);
  posix_spawn_file_actions_adddup2(&fa, p[1], 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  pid_t pid;
  int r = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(p[1]);
  if (r != 0) {
    close(p[0]);
    return -r;
  }
  size_t n = 0;
  uint64_t deadline = mono_ms() + (uint64_t)timeout_ms;
  for (;;) {
    uint64_t now = mono_ms();
    struct pollfd pfd = {.fd = p[0], .events = POLLIN};
    if (now >= deadline || poll(&pfd, 1, (int)(deadline - now)) == 0) {
      kill(pid, SIGKILL);
      break;
    }
    char buf[4096];
    ssize_t k = read(p[0], buf, sizeof buf);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0)
      break;
    size_t take = (size_t)k < size - 1 - n ? (size_t)k : size - 1 - n;
    memcpy(out + n, buf, take);
    n += take;
  }
  out[n] = '\0';
  close(p[0]);
  int status;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR)
      return -errno;
  return status;
}
