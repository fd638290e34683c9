/* exec.c: commands.  EXEC runs `/bin/sh -c COMMAND` in its own process
 * group, with stdin from a memfd (collected from STDIN frames) or /dev/null,
 * and stdout/stderr on two pipes whose output is forwarded in chunks as it
 * arrives.
 *
 * The shell is started by exec_spawn.c (clone(CLONE_VM), not fork()).
 *
 * A command ends when its shell exits, not when its pipes close: a
 * background process (`server &`) may hold the write ends for hours.  At the
 * shell's exit we read what is already in the pipes, send EXIT, and keep the
 * read ends in a drain list where later output is read and discarded, so the
 * background process never gets SIGPIPE.  Timeouts and KILL send SIGKILL to
 * the whole group.  Zombies are reaped with waitpid(-1): as PID 1 (or a child
 * subreaper) every orphan in the sandbox ends up ours. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"
#include "guest/agent_core.h"
#include "guest/exec_int.h"
#include "guest/tree_int.h"

/* After the shell exits, what it wrote is at most a pipe's capacity (64 KiB
 * by default, 1 MiB with F_SETPIPE_SZ).  Anything beyond this cap is output
 * of a background process racing us, which we must not chase forever. */
#define EXEC_MAX_FINAL_OUTPUT (4u << 20)

enum exec_stream { EXEC_STDOUT = 0, EXEC_STDERR = 1 };

static const char *const exec_default_env[] = {
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/root",
    "USER=root",
    "LOGNAME=root",
    "SHELL=/bin/sh",
    "TERM=dumb",
    "LANG=C.UTF-8",
};

/* EXEC fields as received; pointers into the request payload. */
struct exec_request {
  const uint8_t *command;
  uint32_t command_len;
  bool has_command;
  const uint8_t *cwd;
  uint32_t cwd_len;
  bool has_cwd;
  const uint8_t *env[PROTO_MAX_ENV];
  uint32_t env_len[PROTO_MAX_ENV];
  size_t n_env;
  uint32_t timeout_ms;
  bool has_stdin;
};

static void env_free(char **env) {
  if (!env)
    return;
  for (char **p = env; *p; p++)
    free(*p);
  free(env);
}

static void exec_cmd_reset(struct exec_cmd *c) {
  free(c->command);
  free(c->cwd);
  env_free(c->env);
  closep(&c->stdin_fd);
  closep(&c->out_fd);
  closep(&c->err_fd);
  *c = (struct exec_cmd){.state = EXEC_FREE, .stdin_fd = -1, .out_fd = -1, .err_fd = -1};
}

void exec_init(struct exec_state *e) {
  memset(e, 0, sizeof *e);
  /* Between clone() and execve() a child shares the agent's memory, and
   * from exec_child_drop_ptrace() on its capabilities are a command's: a
   * command could ptrace it (or read /proc/PID/mem) and so write into the
   * agent.  Not dumpable, the memory can be reached only with
   * CAP_SYS_PTRACE, which commands lack.  (The namespace sandbox's
   * confinement sets it again; execve gives each command a dumpable memory
   * of its own, as before.) */
  prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  e->cgroup_procs = -1;
  for (size_t i = 0; i < EXEC_MAX_RUNNING; i++)
    e->cmds[i] = (struct exec_cmd){.state = EXEC_FREE, .stdin_fd = -1, .out_fd = -1, .err_fd = -1};
}

static struct exec_cmd *exec_find(struct exec_state *e, uint32_t id) {
  for (size_t i = 0; i < EXEC_MAX_RUNNING; i++)
    if (e->cmds[i].state != EXEC_FREE && e->cmds[i].id == id)
      return &e->cmds[i];
  return NULL;
}

bool exec_id_busy(const struct exec_state *e, uint32_t id) {
  for (size_t i = 0; i < EXEC_MAX_RUNNING; i++)
    if (e->cmds[i].state != EXEC_FREE && e->cmds[i].id == id)
      return true;
  return false;
}

static struct exec_cmd *exec_find_pid(struct exec_state *e, pid_t pid) {
  for (size_t i = 0; i < EXEC_MAX_RUNNING; i++)
    if (e->cmds[i].state == EXEC_RUNNING && e->cmds[i].pid == pid)
      return &e->cmds[i];
  return NULL;
}

static struct exec_cmd *exec_free_slot(struct exec_state *e) {
  for (size_t i = 0; i < EXEC_MAX_RUNNING; i++)
    if (e->cmds[i].state == EXEC_FREE)
      return &e->cmds[i];
  return NULL;
}

static void exec_kill(const struct exec_cmd *c) {
  if (c->state != EXEC_RUNNING)
    return;
  /* The group id is the shell's pid (set in the child and in the parent). */
  if (kill(-c->pid, SIGKILL) < 0 && errno == ESRCH)
    kill(c->pid, SIGKILL);
}

/* Remember a process group for shutdown.  Bounded: when full, forget the
 * groups that have no process left, then the oldest. */
static void exec_remember_group(struct exec_state *e, pid_t pgid) {
  if (e->n_groups == EXEC_MAX_GROUPS) {
    size_t k = 0;
    for (size_t i = 0; i < e->n_groups; i++)
      if (kill(-e->groups[i], 0) == 0 || errno != ESRCH)
        e->groups[k++] = e->groups[i];
    e->n_groups = k;
  }
  if (e->n_groups == EXEC_MAX_GROUPS) {
    memmove(&e->groups[0], &e->groups[1], (EXEC_MAX_GROUPS - 1) * sizeof e->groups[0]);
    e->n_groups--;
  }
  e->groups[e->n_groups++] = pgid;
}

static void exec_drain_add(struct exec_state *e, int fd) {
  if (fd < 0)
    return;
  if (e->n_drain == EXEC_MAX_DRAIN) {
    close(e->drain[0]);
    memmove(&e->drain[0], &e->drain[1], (EXEC_MAX_DRAIN - 1) * sizeof e->drain[0]);
    e->n_drain--;
  }
  e->drain[e->n_drain++] = fd;
}

static int exec_start(struct agent *a, struct exec_cmd *c) {
  _cleanup_close_ int in = -1, out_r = -1, out_w = -1, err_r = -1, err_w = -1;
  int p[2];

  if (c->stdin_fd >= 0) {
    in = steal_fd(c->stdin_fd);
    if (lseek(in, 0, SEEK_SET) < 0)
      goto fail;
  } else {
    in = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (in < 0)
      goto fail;
  }
  if (pipe2(p, O_CLOEXEC) < 0)
    goto fail;
  out_r = p[0];
  out_w = p[1];
  if (pipe2(p, O_CLOEXEC) < 0)
    goto fail;
  err_r = p[0];
  err_w = p[1];
  /* Non-blocking: at the shell's exit the pipes are read until EAGAIN. */
  if (fcntl(out_r, F_SETFL, O_NONBLOCK) < 0 || fcntl(err_r, F_SETFL, O_NONBLOCK) < 0)
    goto fail;

  char *argv[] = {"sh", "-c", c->command, NULL};
  struct exec_child_args ca = {
      .in = in, .out = out_w, .err = err_w, .cwd = c->cwd, .argv = argv, .env = c->env,
      .cgroup_procs = agent_exec(a)->cgroup_procs,
  };
  int spawn_err = 0;
  uint64_t started_us = mono_us();
  pid_t pid = exec_spawn(agent_exec(a), &ca, &spawn_err);
  if (pid < 0) {
    errno = spawn_err;
    goto fail;
  }

  c->state = EXEC_RUNNING;
  c->pid = pid;
  c->out_fd = steal_fd(out_r);
  c->err_fd = steal_fd(err_r);
  c->started_us = started_us;
  c->deadline_ms = c->timeout_ms ? mono_ms() + c->timeout_ms : 0;
  free(steal_ptr(c->command));
  free(steal_ptr(c->cwd));
  env_free(steal_ptr(c->env));
  exec_remember_group(agent_exec(a), pid);
  return 0;

fail:;
  int err = errno;
  agent_send_error(a, c->id, err, "cannot start the command: %s", strerror(err));
  exec_cmd_reset(c);
  return -err;
}

/* ---- EXEC --------------------------------------------------------------- */

static int exec_parse(struct agent *a, uint32_t id, const uint8_t *p, size_t n,
                      struct exec_request *ret) {
  struct exec_request r = {0};
  struct proto_tlv_iter it;
  uint16_t tag;
  const uint8_t *v;
  uint32_t len, flag;
  int k;

  proto_tlv_init(&it, p, n);
  while ((k = proto_tlv_next(&it, &tag, &v, &len)) > 0) {
    switch (tag) {
    case TAG_COMMAND:
      r.command = v;
      r.command_len = len;
      r.has_command = true;
      break;
    case TAG_CWD:
      r.cwd = v;
      r.cwd_len = len;
      r.has_cwd = true;
      break;
    case TAG_ENV:
      if (r.n_env == PROTO_MAX_ENV) {
        agent_send_error(a, id, E2BIG, "more than %u ENV entries", PROTO_MAX_ENV);
        return -E2BIG;
      }
      r.env[r.n_env] = v;
      r.env_len[r.n_env++] = len;
      break;
    case TAG_TIMEOUT_MS:
      if (agent_tlv_u32(a, id, "EXEC", "TIMEOUT_MS", v, len, &r.timeout_ms) < 0)
        return -EPROTO;
      break;
    case TAG_HAS_STDIN:
      if (agent_tlv_u32(a, id, "EXEC", "HAS_STDIN", v, len, &flag) < 0)
        return -EPROTO;
      if (flag > 1) {
        agent_send_error(a, id, EINVAL, "HAS_STDIN must be 0 or 1, got %u", flag);
        return -EINVAL;
      }
      r.has_stdin = flag;
      break;
    default:
      break; /* optional fields of newer hosts */
    }
  }
  if (k < 0) {
    agent_send_error(a, id, EPROTO, "malformed EXEC request: a TLV record runs past the payload");
    return -EPROTO;
  }
  if (!r.has_command) {
    agent_send_error(a, id, EPROTO, "malformed EXEC request: COMMAND is missing");
    return -EPROTO;
  }
  if (r.command_len > PROTO_MAX_COMMAND) {
    agent_send_error(a, id, E2BIG, "the command is longer than %u bytes", PROTO_MAX_COMMAND);
    return -E2BIG;
  }
  if (memchr(r.command, '\0', r.command_len)) {
    agent_send_error(a, id, EINVAL, "the command contains a NUL byte");
    return -EINVAL;
  }
  for (size_t i = 0; i < r.n_env; i++) {
    const char *e = (const char *)r.env[i];
    uint32_t elen = r.env_len[i];
    if (elen > PROTO_MAX_ENV_ENTRY) {
      agent_send_error(a, id, E2BIG, "ENV entry %zu is longer than %u bytes", i,
                       PROTO_MAX_ENV_ENTRY);
      return -E2BIG;
    }
    if (memchr(e, '\0', elen)) {
      agent_send_error(a, id, EINVAL, "ENV entry %zu contains a NUL byte", i);
      return -EINVAL;
    }
    const char *eq = memchr(e, '=', elen);
    if (!eq || eq == e) {
      agent_send_error(a, id, EINVAL, "ENV entry '%.*s' is not NAME=VALUE", (int)elen, e);
      return -EINVAL;
    }
  }
  *ret = r;
  return 0;
}

/* The default environment with the request's entries overriding or added. */
static char **exec_build_env(const struct exec_request *r) {
  size_t cap = ARRAY_SIZE(exec_default_env) + r->n_env + 1, n = 0;
  char **env = calloc(cap, sizeof *env);
  if (!env)
    return NULL;
  for (size_t i = 0; i < ARRAY_SIZE(exec_default_env); i++) {
    env[n] = strdup(exec_default_env[i]);
    if (!env[n++])
      goto oom;
  }
  for (size_t i = 0; i < r->n_env; i++) {
    const char *e = (const char *)r->env[i];
    size_t name_len = (size_t)((const char *)memchr(e, '=', r->env_len[i]) - e);
    char *s = strndup(e, r->env_len[i]);
    if (!s)
      goto oom;
    size_t j = 0;
    while (j < n && strncmp(env[j], s, name_len + 1) != 0)
      j++;
    if (j < n)
      free(env[j]);
    else
      n++;
    env[j] = s;
  }
  return env;
oom:
  env_free(env);
  return NULL;
}

static bool is_usable_dir(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode) && access(path, X_OK) == 0;
}

static int exec_resolve_cwd(struct agent *a, uint32_t id, const struct exec_request *r,
                            char **ret) {
  char path[PATH_MAX];
  if (!r->has_cwd) {
    /* /root may be missing from a minimal rootfs. */
    snprintf(path, sizeof path, "%s", is_usable_dir("/root") ? "/root" : "/");
  } else {
    int k = agent_resolve_path(a, id, "cwd", r->cwd, r->cwd_len, path);
    if (k < 0)
      return k;
    struct stat st;
    if (stat(path, &st) < 0) {
      int err = errno;
      if (err == ENOENT)
        agent_send_error(a, id, err, "cwd '%s' does not exist in the sandbox", path);
      else if (err == ENOTDIR)
        agent_send_error(a, id, err, "cwd '%s' is not a directory", path);
      else
        agent_send_error(a, id, err, "cannot use cwd '%s': %s", path, strerror(err));
      return -err;
    }
    if (!S_ISDIR(st.st_mode)) {
      agent_send_error(a, id, ENOTDIR, "cwd '%s' is not a directory", path);
      return -ENOTDIR;
    }
  }
  char *s = strdup(path);
  if (!s) {
    agent_send_error(a, id, ENOMEM, "out of memory");
    return -ENOMEM;
  }
  *ret = s;
  return 0;
}

static void exec_handle_exec(struct agent *a, uint32_t id, const uint8_t *p, size_t n) {
  struct exec_cmd nc = {.id = id, .stdin_fd = -1, .out_fd = -1, .err_fd = -1};
  struct exec_request r;
  bool has_stdin = false;

  if (agent_id_busy(a, id)) {
    agent_send_error(a, id, EEXIST, "request id %u is already in use by a running request", id);
    return;
  }
  if (exec_parse(a, id, p, n, &r) < 0) {
    /* Drop the stdin that may follow, if the request announced one. */
    const uint8_t *v;
    uint32_t len, flag;
    if (proto_find(p, n, TAG_HAS_STDIN, &v, &len) == 1 && proto_val_u32(v, len, &flag) == 0 && flag)
      agent_ignore_until(a, id, PROTO_STDIN_END);
    return;
  }
  has_stdin = r.has_stdin;

  struct exec_cmd *slot = exec_free_slot(agent_exec(a));
  if (!slot) {
    agent_send_error(a, id, EAGAIN,
                     "too many commands running (%u at once); wait for one to finish or kill one",
                     EXEC_MAX_RUNNING);
    goto fail;
  }
  if (exec_resolve_cwd(a, id, &r, &nc.cwd) < 0)
    goto fail;
  nc.command = strndup((const char *)r.command, r.command_len);
  nc.env = exec_build_env(&r);
  if (!nc.command || !nc.env) {
    agent_send_error(a, id, ENOMEM, "out of memory preparing the command");
    goto fail;
  }
  nc.timeout_ms = r.timeout_ms;
  if (has_stdin) {
    nc.stdin_fd = memfd_create("ign-stdin", MFD_CLOEXEC);
    if (nc.stdin_fd < 0) {
      int err = errno;
      agent_send_error(a, id, err, "cannot buffer stdin: %s", strerror(err));
      goto fail;
    }
    nc.state = EXEC_WAITING_STDIN;
    *slot = nc;
    return;
  }
  *slot = nc;
  exec_start(a, slot);
  return;

fail:
  exec_cmd_reset(&nc);
  if (has_stdin)
    agent_ignore_until(a, id, PROTO_STDIN_END);
}

/* ---- STDIN, STDIN_END, KILL --------------------------------------------- */

/* End a command that never started, and drop the rest of its stdin. */
static void exec_abandon(struct agent *a, struct exec_cmd *c) {
  agent_ignore_until(a, c->id, PROTO_STDIN_END);
  exec_cmd_reset(c);
}

static void exec_handle_stdin(struct agent *a, const struct proto_header *h, const uint8_t *p) {
  bool is_end = h->type == PROTO_STDIN_END;
  if (agent_ignoring(a, h->id, PROTO_STDIN_END, is_end))
    return;
  struct exec_cmd *c = exec_find(agent_exec(a), h->id);
  if (!c) {
    agent_send_error(a, h->id, EPROTO, "%s for id %u, which has no command waiting for stdin",
                     proto_type_name(h->type), h->id);
    return;
  }
  if (c->state != EXEC_WAITING_STDIN) {
    /* A second terminal frame would confuse the host: only log it. */
    agent_log("ignoring %s for id %u: its command is already running", proto_type_name(h->type),
              h->id);
    return;
  }
  if (is_end) {
    exec_start(a, c);
    return;
  }
  if (c->stdin_bytes + h->len > EXEC_MAX_STDIN) {
    agent_send_error(a, h->id, EFBIG, "stdin is larger than %u MiB", EXEC_MAX_STDIN >> 20);
    exec_abandon(a, c);
    return;
  }
  int r = proto_write_all(c->stdin_fd, p, h->len);
  if (r < 0) {
    agent_send_error(a, h->id, -r, "cannot buffer stdin: %s", strerror(-r));
    exec_abandon(a, c);
    return;
  }
  c->stdin_bytes += h->len;
}

static void exec_send_exit(struct agent *a, uint32_t id, int status, bool timed_out,
                           uint64_t duration_us) {
  uint32_t code = (uint32_t)-1, sig = 0;
  if (WIFEXITED(status))
    code = (uint32_t)WEXITSTATUS(status);
  else if (WIFSIGNALED(status))
    sig = (uint32_t)WTERMSIG(status);
  struct proto_buf *out = agent_frame(a, PROTO_EXIT, id);
  proto_put_u32(out, TAG_EXIT_CODE, code);
  proto_put_u32(out, TAG_SIGNAL, sig);
  proto_put_u32(out, TAG_TIMED_OUT, timed_out);
  proto_put_u64(out, TAG_DURATION_US, duration_us);
  agent_send(a);
}

static void exec_handle_kill(struct agent *a, uint32_t id) {
  struct exec_cmd *c = exec_find(agent_exec(a), id);
  if (!c)
    return; /* already finished, or never existed: nothing to cancel */
  if (c->state == EXEC_RUNNING) {
    exec_kill(c); /* the EXIT follows when the shell is reaped */
    return;
  }
  /* Waiting for stdin: it never started, so it ends here as if killed (a
   * wait status equal to a signal number means "killed by that signal"). */
  exec_send_exit(a, id, SIGKILL, false, 0);
  exec_abandon(a, c);
}

void exec_handle(struct agent *a, const struct proto_header *h, const uint8_t *payload) {
  switch (h->type) {
  case PROTO_EXEC:
    exec_handle_exec(a, h->id, payload, h->len);
    break;
  case PROTO_STDIN:
  case PROTO_STDIN_END:
    exec_handle_stdin(a, h, payload);
    break;
  case PROTO_KILL:
    exec_handle_kill(a, h->id);
    break;
  default:
    break;
  }
}

/* ---- output ------------------------------------------------------------- */

static int *exec_stream_fd(struct exec_cmd *c, enum exec_stream s) {
  return s == EXEC_STDOUT ? &c->out_fd : &c->err_fd;
}

/* One read from a command's pipe, forwarded as one frame.  Returns the bytes
 * read, 0 at EOF (the fd is then closed), -EAGAIN when empty. */
static ssize_t exec_forward(struct agent *a, struct exec_cmd *c, enum exec_stream s) {
  int *fd = exec_stream_fd(c, s);
  uint8_t *chunk = agent_chunk(a);
  ssize_t r;
  do
    r = read(*fd, chunk, PROTO_CHUNK);
  while (r < 0 && errno == EINTR);
  if (r > 0) {
    agent_send_data(a, s == EXEC_STDOUT ? PROTO_STDOUT : PROTO_STDERR, c->id, chunk, (size_t)r);
    return r;
  }
  if (r < 0 && errno == EAGAIN)
    return -EAGAIN;
  closep(fd);
  *fd = -1;
  return 0;
}

size_t exec_pollfds(const struct exec_state *e, struct pollfd *pfd) {
  size_t n = 0;
  for (size_t i = 0; i < EXEC_MAX_RUNNING; i++) {
    const struct exec_cmd *c = &e->cmds[i];
    if (c->state != EXEC_RUNNING)
      continue;
    if (c->out_fd >= 0)
      pfd[n++] = (struct pollfd){.fd = c->out_fd, .events = POLLIN};
    if (c->err_fd >= 0)
      pfd[n++] = (struct pollfd){.fd = c->err_fd, .events = POLLIN};
  }
  for (size_t i = 0; i < e->n_drain; i++)
    pfd[n++] = (struct pollfd){.fd = e->drain[i], .events = POLLIN};
  return n;
}

void exec_on_poll(struct agent *a, const struct pollfd *pfd, size_t n) {
  struct exec_state *e = agent_exec(a);
  size_t k = 0;
  /* Walk in exec_pollfds() order.  Nothing here starts or ends a command,
   * so the order still matches; only fds that were just checked close. */
  for (size_t i = 0; i < EXEC_MAX_RUNNING && k < n; i++) {
    struct exec_cmd *c = &e->cmds[i];
    if (c->state != EXEC_RUNNING)
      continue;
    int fds[2] = {c->out_fd, c->err_fd};
    for (int s = EXEC_STDOUT; s <= EXEC_STDERR; s++) {
      if (fds[s] < 0)
        continue;
      if (pfd[k].revents)
        exec_forward(a, c, (enum exec_stream)s);
      k++;
    }
  }
  size_t kept = 0;
  for (size_t i = 0; i < e->n_drain; i++, k++) {
    int fd = e->drain[i];
    if (k < n && pfd[k].revents) {
      ssize_t r;
      do
        r = read(fd, agent_chunk(a), PROTO_CHUNK);
      while (r < 0 && errno == EINTR);
      if (r == 0 || (r < 0 && errno != EAGAIN)) {
        close(fd);
        continue;
      }
    }
    e->drain[kept++] = fd;
  }
  e->n_drain = kept;
}

/* ---- exits -------------------------------------------------------------- */

static void exec_finish(struct agent *a, struct exec_cmd *c, int status) {
  /* Output the shell wrote before exiting is still in the pipes. */
  for (int s = EXEC_STDOUT; s <= EXEC_STDERR; s++) {
    size_t total = 0;
    while (*exec_stream_fd(c, (enum exec_stream)s) >= 0 && total < EXEC_MAX_FINAL_OUTPUT) {
      ssize_t r = exec_forward(a, c, (enum exec_stream)s);
      if (r <= 0)
        break;
      total += (size_t)r;
    }
  }
  exec_send_exit(a, c->id, status, c->timed_out, mono_us() - c->started_us);
  exec_drain_add(agent_exec(a), steal_fd(c->out_fd));
  exec_drain_add(agent_exec(a), steal_fd(c->err_fd));
  exec_cmd_reset(c);
}

void exec_reap(struct agent *a) {
  for (;;) {
    int status;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno == EINTR)
      continue;
    if (pid <= 0)
      break;
    /* Other pids are tree copies' tar processes (tree.c), or orphans of the
     * sandbox: reaping them is all we do. */
    struct exec_cmd *c = exec_find_pid(agent_exec(a), pid);
    if (c)
      exec_finish(a, c, status);
    else
      tree_reaped(a, pid, status);
  }
}

int exec_poll_timeout(const struct exec_state *e) {
  uint64_t now = mono_ms(), next = UINT64_MAX;
  for (size_t i = 0; i < EXEC_MAX_RUNNING; i++) {
    const struct exec_cmd *c = &e->cmds[i];
    if (c->state != EXEC_RUNNING || !c->deadline_ms)
      continue;
    if (c->deadline_ms <= now)
      return 0;
    if (c->deadline_ms - now < next)
      next = c->deadline_ms - now;
  }
  if (next == UINT64_MAX)
    return -1;
  return next > INT_MAX ? INT_MAX : (int)next;
}

void exec_check_timeouts(struct agent *a) {
  uint64_t now = mono_ms();
  for (size_t i = 0; i < EXEC_MAX_RUNNING; i++) {
    struct exec_cmd *c = &agent_exec(a)->cmds[i];
    if (c->state != EXEC_RUNNING || !c->deadline_ms || now < c->deadline_ms)
      continue;
    exec_kill(c);
    c->timed_out = true;
    c->deadline_ms = 0;
  }
}

void exec_shutdown(struct exec_state *e) {
  for (size_t i = 0; i < EXEC_MAX_RUNNING; i++) {
    exec_kill(&e->cmds[i]);
    exec_cmd_reset(&e->cmds[i]);
  }
  /* Finished commands may have left background processes behind. */
  for (size_t i = 0; i < e->n_groups; i++)
    kill(-e->groups[i], SIGKILL);
  e->n_groups = 0;
  for (size_t i = 0; i < e->n_drain; i++)
    close(e->drain[i]);
  e->n_drain = 0;
  if (e->child_stack)
    munmap(e->child_stack, EXEC_CHILD_STACK + EXEC_CHILD_GUARD);
  e->child_stack = NULL;
}
