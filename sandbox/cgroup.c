/* cgroup.c: memory and pids limits for one sandbox, on cgroup v1 or v2.
 * On v1 the TCP socket buffers, which it counts apart, get a quarter of the
 * memory limit; v2 counts them in the memory limit.
 *
 * Each sandbox gets a group named ign-mcp-<server pid>-<n> beside the
 * server's own group (so a server started under a delegated cgroup keeps
 * its sandboxes inside it).  On v1 (and hybrid hosts) that is one group per
 * controller; on v2 one group with both controllers enabled in the parent's
 * subtree.  v2 lets a group enable controllers for its children only while
 * it holds no process itself (except the root group), so the server first
 * moves itself into a leaf of its own group, ign-mcp-<pid>-server, as crun and
 * systemd do; the sandboxes' groups are then its siblings, still inside
 * whatever group (and limits) the server was started in.  Where the group also
 * holds processes that are not ours (a login session's scope), the sandboxes'
 * groups go under a group below the root, /sys/fs/cgroup/ignition-mcp (root
 * may make it; the ns backend runs as root), with a warning: they no longer
 * count against the server's group.  The server pid in the name lets the next
 * server remove groups a killed server left behind; as a pid is only one pid
 * namespace's word, a server also holds each of its groups with a shared
 * flock on the directory for as long as it lives, and a group another
 * server holds is never taken for a dead one's.
 *
 * Freezing (a commit copies a sandbox's files while its processes are
 * stopped): v2 has cgroup.freeze in the same group; v1 gets a group in the
 * freezer hierarchy too when it is there and writable (freezer.state), and
 * the session runs without one otherwise.  v1 frozen tasks do not die until
 * thawed, so a group is thawed before it is destroyed, and a v1 group is
 * frozen only with a watchdog beside it: a process of the server's that
 * thaws it when the server dies before it does (a killed server would
 * otherwise leave its sandboxes frozen for ever: unkillable, their pid
 * namespaces never torn down).  A server that is PID 1 of a pid namespace
 * takes its watchdog with it; the next server thaws the groups of dead
 * servers before it removes them. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "sandbox/sandbox.h"

#define CG_ROOT "/sys/fs/cgroup"
#define CG_PREFIX "ign-mcp-"
#define CG_V2_SHARED CG_ROOT "/ignition-mcp"
/* v1: TCP socket buffers get the memory limit >> this (a quarter). */
#define CG_TCP_SHIFT 2

struct cgroup {
  char *dirs[3];
  int n;
  /* The group whose freezer stops the sandbox's processes (the v2 group,
   * or the v1 freezer group), or NULL when there is none (a v1 host
   * without a writable freezer hierarchy: not a reason to refuse the
   * session, only to commit it while it runs). */
  const char *freezer;
  bool v2;
  pid_t watchdog;       /* v1 while frozen: thaws the group if we die first, or 0 */
  int watchdog_fd;      /* its pipe: EOF (our exit, or our death) makes it thaw */
  int hold[3];          /* each dir open with LOCK_SH while we live, or -1 */
};

/* Holds directory DIR with a shared flock for as long as this process lives
 * (the kernel drops it however it dies): a server in whatever pid
 * namespace that finds the group cannot take it LOCK_EX, so it never takes
 * a live server's group for a dead one's.  The fd, or -1. */
static int hold_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0 && flock(fd, LOCK_SH | LOCK_NB) < 0) {
    close(fd);
    fd = -1;
  }
  return fd;
}

static int write_file(const char *dir, const char *name, const char *value) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  _cleanup_close_ int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  ssize_t n = write(fd, value, strlen(value));
  if (n < 0)
    return -errno;
  return 0;
}

static bool is_v2(void) { return access(CG_ROOT "/cgroup.controllers", F_OK) == 0; }

/* The server's own group for CONTROLLER (NULL: the v2 line) as a path. */
static char *own_group(const char *controller) {
  _cleanup_fclose_ FILE *f = fopen("/proc/self/cgroup", "re");
  if (!f)
    return NULL;
  char line[4096];
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = '\0';
    char *c1 = strchr(line, ':');
    char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (!c2)
      continue;
    *c2 = '\0';
    const char *ctrls = c1 + 1, *path = c2 + 1;
    if (strcmp(path, "/") == 0)
      path = "";
    if (!controller) {
      if (strcmp(line, "0") == 0 && *ctrls == '\0')
        return xasprintf(CG_ROOT "%s", path);
      continue;
    }
    /* ctrls is a comma separated list such as "cpu,cpuacct". */
    size_t n = strlen(controller);
    for (const char *p = ctrls; *p;) {
      const char *e = strchrnul(p, ',');
      if ((size_t)(e - p) == n && strncmp(p, controller, n) == 0)
        return xasprintf(CG_ROOT "/%s%s", controller, path);
      p = *e ? e + 1 : e;
    }
  }
  return NULL;
}

static void destroy_dir(const char *dir) {
  write_file(dir, "cgroup.kill", "1");
  for (int attempt = 0; attempt < 200; attempt++) {
    if (rmdir(dir) == 0 || errno == ENOENT)
      return;
    if (errno != EBUSY)
      break;
    char path[4096];
    snprintf(path, sizeof path, "%s/cgroup.procs", dir);
    _cleanup_fclose_ FILE *f = fopen(path, "re");
    int pid;
    while (f && fscanf(f, "%d", &pid) == 1)
      kill(pid, SIGKILL);
    usleep(10000);
  }
  log_warn("cannot remove cgroup %s: %s", dir, strerror(errno));
}

/* v2: the group the sandboxes' groups go in, found (and prepared) once. */
static pthread_mutex_t v2_lock = PTHREAD_MUTEX_INITIALIZER;
static char *v2_base;

static int v2_parent_locked(const char **ret, char **ret_err) {
  if (v2_base) {
    *ret = v2_base;
    return 0;
  }
  _cleanup_free_ char *base = own_group(NULL);
  if (!base) {
    *ret_err = strdup("cannot find the server's cgroup in /proc/self/cgroup");
    return -ENOENT;
  }
  int r = write_file(base, "cgroup.subtree_control", "+memory +pids");
  if (r == -EBUSY) {
    /* Our group holds processes, us among them: move into a leaf. */
    _cleanup_free_ char *leaf = xasprintf("%s/" CG_PREFIX "%d-server", base, (int)getpid());
    if ((mkdir(leaf, 0755) == 0 || errno == EEXIST) && write_file(leaf, "cgroup.procs", "0") == 0) {
      static int leaf_hold = -1; /* held for the server's life */
      if (leaf_hold < 0)
        leaf_hold = hold_dir(leaf);
      r = write_file(base, "cgroup.subtree_control", "+memory +pids");
    }
  }
  if (r < 0) {
    /* Our group holds processes that are not ours (or is not ours to
     * change): use a group of our own below the root, which holds none. */
    int r2 = mkdir(CG_V2_SHARED, 0755) < 0 && errno != EEXIST ? -errno : 0;
    if (r2 == 0)
      r2 = write_file(CG_ROOT, "cgroup.subtree_control", "+memory +pids");
    if (r2 == 0)
      r2 = write_file(CG_V2_SHARED, "cgroup.subtree_control", "+memory +pids");
    if (r2 < 0) {
      *ret_err = xasprintf("cannot enable the memory and pids controllers under %s (%s) nor "
                           "under " CG_V2_SHARED " (%s); run the server as root, or start it "
                           "in a cgroup of its own, e.g. with systemd-run --scope -p "
                           "Delegate=yes",
                           base, strerror(-r), strerror(-r2));
      return r2;
    }
    log_warn("cgroup v2: %s holds other processes (%s), so sessions' cgroups go under "
             CG_V2_SHARED " and do not count against the server's group; start the server "
             "in a cgroup of its own (e.g. systemd-run --scope -p Delegate=yes) to keep them "
             "inside it",
             base, strerror(-r));
    free(base);
    base = strdup(CG_V2_SHARED);
    if (!base)
      return -ENOMEM;
  }
  v2_base = steal_ptr(base);
  *ret = v2_base;
  return 0;
}

static int v2_parent(const char **ret, char **ret_err) {
  pthread_mutex_lock(&v2_lock);
  int r = v2_parent_locked(ret, ret_err);
  pthread_mutex_unlock(&v2_lock);
  return r;
}

/* v1: a freezer group too, where the hierarchy is there and ours to write;
 * without it the session still runs (its commits copy a running sandbox). */
static void v1_add_freezer(struct cgroup *cg, const char *name) {
  _cleanup_free_ char *base = own_group("freezer");
  if (!base || access(base, W_OK) < 0)
    return;
  char *dir = xasprintf("%s/%s", base, name);
  /* One that exists is another server's (one with our pid in another pid
   * namespace): freezing or destroying it would stop or kill its sandbox. */
  if (mkdir(dir, 0755) < 0) {
    log_warn("cannot create the freezer cgroup %s (%s%s): commits of its session copy a running "
             "sandbox",
             dir, strerror(errno),
             errno == EEXIST ? "; a server with the same pid in another pid namespace has it" : "");
    free(dir);
    return;
  }
  cg->dirs[cg->n++] = dir;
  cg->freezer = dir;
}

int cgroup_create(const char *name, unsigned memory_mb, unsigned pids, struct cgroup **ret,
                  char **ret_err) {
  _cleanup_free_ struct cgroup *cg = calloc(1, sizeof *cg);
  if (!cg)
    return -ENOMEM;
  for (size_t i = 0; i < ARRAY_SIZE(cg->hold); i++)
    cg->hold[i] = -1;
  char mem[32], pid_max[32];
  snprintf(mem, sizeof mem, "%llu", (unsigned long long)memory_mb << 20);
  snprintf(pid_max, sizeof pid_max, "%u", pids);

  if (is_v2()) {
    const char *base;
    int r = v2_parent(&base, ret_err);
    if (r < 0)
      return r;
    char *dir = xasprintf("%s/%s", base, name);
    if (mkdir(dir, 0755) < 0) {
      r = -errno;
      *ret_err = xasprintf("cannot create cgroup %s: %s", dir, strerror(errno));
      free(dir);
      return r;
    }
    cg->dirs[cg->n++] = dir;
    if ((r = write_file(dir, "memory.max", mem)) < 0 ||
        (r = write_file(dir, "pids.max", pid_max)) < 0) {
      *ret_err = xasprintf("cannot set limits in %s: %s", dir, strerror(-r));
      cgroup_destroy(steal_ptr(cg));
      return r;
    }
    write_file(dir, "memory.swap.max", "0");
    cg->freezer = dir;
    cg->v2 = true;
    cg->hold[0] = hold_dir(dir);
    *ret = steal_ptr(cg);
    return 0;
  }

  static const char *const controllers[] = {"memory", "pids"};
  for (size_t i = 0; i < ARRAY_SIZE(controllers); i++) {
    _cleanup_free_ char *base = own_group(controllers[i]);
    if (!base || access(base, W_OK) < 0) {
      *ret_err = xasprintf("the %s cgroup controller is not available or not writable%s%s",
                           controllers[i], base ? " at " : "", base ? base : "");
      cgroup_destroy(steal_ptr(cg));
      return -ENOENT;
    }
    char *dir = xasprintf("%s/%s", base, name);
    if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
      int r = -errno;
      *ret_err = xasprintf("cannot create cgroup %s: %s", dir, strerror(errno));
      free(dir);
      cgroup_destroy(steal_ptr(cg));
      return r;
    }
    cg->dirs[cg->n++] = dir;
    int r = i == 0 ? write_file(dir, "memory.limit_in_bytes", mem)
                   : write_file(dir, "pids.max", pid_max);
    if (r < 0) {
      *ret_err = xasprintf("cannot set the %s limit in %s: %s", controllers[i], dir, strerror(-r));
      cgroup_destroy(steal_ptr(cg));
      return r;
    }
    if (i == 0) {
      write_file(dir, "memory.memsw.limit_in_bytes", mem);
      /* v1 charges TCP socket buffers to a counter of their own, unlimited
       * by default: a session could queue the host's TCP memory on loopback
       * connections it never reads, past its memory limit.  Once the
       * counter is limited, UDP buffers are charged to it too (without, to
       * nothing).  v2 charges them all to memory.max. */
      char tcp[32];
      snprintf(tcp, sizeof tcp, "%llu", (unsigned long long)memory_mb << 20 >> CG_TCP_SHIFT);
      if ((r = write_file(dir, "memory.kmem.tcp.limit_in_bytes", tcp)) < 0)
        log_warn("cannot limit the TCP buffers of cgroup %s: %s; a session can queue host TCP "
                 "memory past its memory limit",
                 dir, strerror(-r));
    }
  }
  v1_add_freezer(cg, name);
  for (int i = 0; i < cg->n && i < (int)ARRAY_SIZE(cg->hold); i++)
    cg->hold[i] = hold_dir(cg->dirs[i]);
  *ret = steal_ptr(cg);
  return 0;
}

int cgroup_attach(struct cgroup *cg, pid_t pid) {
  char s[32];
  snprintf(s, sizeof s, "%d", pid);
  for (int i = 0; i < cg->n; i++) {
    int r = write_file(cg->dirs[i], "cgroup.procs", s);
    if (r < 0)
      return r;
  }
  return 0;
}

static void watchdog_stop(struct cgroup *cg);

void cgroup_destroy(struct cgroup *cg) {
  if (!cg)
    return;
  watchdog_stop(cg);
  /* v1 frozen tasks do not die until thawed. */
  if (cg->freezer)
    write_file(cg->freezer, cg->v2 ? "cgroup.freeze" : "freezer.state", cg->v2 ? "0" : "THAWED");
  for (int i = 0; i < cg->n; i++) {
    if (i < (int)ARRAY_SIZE(cg->hold) && cg->hold[i] >= 0)
      close(cg->hold[i]);
    destroy_dir(cg->dirs[i]);
    free(cg->dirs[i]);
  }
  free(cg);
}

bool cgroup_can_freeze(const struct cgroup *cg) { return cg && cg->freezer; }

void cgroup_thaw_now(struct cgroup *cg) {
  if (cg && cg->freezer)
    write_file(cg->freezer, cg->v2 ? "cgroup.freeze" : "freezer.state", cg->v2 ? "0" : "THAWED");
}

/* Reads NAME of the freezer group into BUF (NUL-terminated). */
static int read_small(const char *dir, const char *name, char *buf, size_t size) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  _cleanup_close_ int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  ssize_t n = read(fd, buf, size - 1);
  if (n < 0)
    return -errno;
  buf[n] = '\0';
  return 0;
}

/* Has the freezer group reached the state asked for? */
static bool freezer_reached(const struct cgroup *cg, bool frozen) {
  char buf[512];
  if (cg->v2) {
    if (read_small(cg->freezer, "cgroup.events", buf, sizeof buf) < 0)
      return false;
    const char *f = strstr(buf, "frozen ");
    return f && (f[7] == '1') == frozen;
  }
  if (read_small(cg->freezer, "freezer.state", buf, sizeof buf) < 0)
    return false;
  buf[strcspn(buf, "\n")] = '\0';
  return strcmp(buf, frozen ? "FROZEN" : "THAWED") == 0;
}

/* v1: a child that writes THAWED into the group's freezer.state when its
 * pipe reaches EOF: when cgroup_freeze thaws (it closes the pipe), or when
 * this process dies.  Not in the group (it stays in ours), in a session of
 * its own (a signal to our process group is not its), holding no fd of
 * ours but the pipe and the state file. */
static int watchdog_start(struct cgroup *cg, char **ret_err) {
  char path[4096];
  snprintf(path, sizeof path, "%s/freezer.state", cg->freezer);
  int state = open(path, O_WRONLY | O_CLOEXEC);
  int p[2];
  if (state < 0 || pipe2(p, O_CLOEXEC) < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot prepare the freezer's watchdog (%s): %s", path, strerror(errno));
    if (state >= 0)
      close(state);
    return r;
  }
  pid_t pid = fork();
  if (pid == 0) {
    /* Async-signal-safe calls only: the parent has threads. */
    setsid();
    if (dup2(p[0], 0) < 0 || dup2(state, 1) < 0)
      _exit(1);
    close_range(2, ~0U, 0);
    char c;
    while (read(0, &c, 1) != 0 && errno == EINTR)
      ;
    (void)!write(1, "THAWED", 6);
    _exit(0);
  }
  int e = errno;
  close(p[0]);
  close(state);
  if (pid < 0) {
    close(p[1]);
    *ret_err = xasprintf("cannot start the freezer's watchdog: %s", strerror(e));
    return -e;
  }
  cg->watchdog = pid;
  cg->watchdog_fd = p[1];
  return 0;
}

/* Lets the watchdog go (it thaws: the group is thawed already or being
 * destroyed) and reaps it. */
static void watchdog_stop(struct cgroup *cg) {
  if (cg->watchdog <= 0)
    return;
  close(cg->watchdog_fd);
  while (waitpid(cg->watchdog, NULL, 0) < 0 && errno == EINTR)
    ;
  cg->watchdog = 0;
  cg->watchdog_fd = -1;
}

int cgroup_freeze(struct cgroup *cg, bool frozen, unsigned timeout_ms, char **ret_err) {
  if (!cgroup_can_freeze(cg)) {
    *ret_err = strdup("the sandbox has no freezer cgroup");
    return -EOPNOTSUPP;
  }
  const char *file = cg->v2 ? "cgroup.freeze" : "freezer.state";
  const char *value = cg->v2 ? (frozen ? "1" : "0") : (frozen ? "FROZEN" : "THAWED");
  int r;
  if (frozen && !cg->v2 && cg->watchdog <= 0 && (r = watchdog_start(cg, ret_err)) < 0)
    return r;
  r = write_file(cg->freezer, file, value);
  if (!frozen && !cg->v2 && r == 0)
    watchdog_stop(cg);
  if (r < 0) {
    *ret_err = xasprintf("cannot write %s to %s/%s: %s", value, cg->freezer, file, strerror(-r));
    return r;
  }
  /* v2 reports frozen in cgroup.events once every task stopped; v1 says
   * FREEZING until then.  Polled: the wait is short (tasks stop at their
   * next return to user space), and a task stuck in the kernel makes it
   * time out rather than hang the caller. */
  for (unsigned waited = 0; !freezer_reached(cg, frozen); waited++) {
    if (waited >= timeout_ms * 10) {
      *ret_err = xasprintf("the processes of cgroup %s did not %s within %u ms", cg->freezer,
                           frozen ? "stop" : "resume", timeout_ms);
      return -ETIMEDOUT;
    }
    usleep(100);
  }
  return 0;
}

static void cleanup_stale_in(const char *base) {
  DIR *d = opendir(base);
  if (!d)
    return;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (strncmp(e->d_name, CG_PREFIX, strlen(CG_PREFIX)) != 0)
      continue;
    long pid = strtol(e->d_name + strlen(CG_PREFIX), NULL, 10);
    if (pid <= 0 || pid == getpid() || (kill((pid_t)pid, 0) == 0 || errno != ESRCH))
      continue;
    char *dir = xasprintf("%s/%s", base, e->d_name);
    /* A pid is only this pid namespace's word: a server in another one (a
     * container, a fenced test) may be alive under a pid that is free
     * here.  A live server holds its groups (hold_dir). */
    _cleanup_close_ int probe = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (probe >= 0 && flock(probe, LOCK_EX | LOCK_NB) < 0 && errno == EWOULDBLOCK) {
      free(dir);
      continue;
    }
    log_info("removing cgroup %s left by a server (pid %ld) that is gone", dir, pid);
    /* v1: a group its server froze and could not thaw (it died in a
     * commit): its tasks die only once thawed. */
    write_file(dir, "freezer.state", "THAWED");
    destroy_dir(dir);
    free(dir);
  }
  closedir(d);
}

void cgroup_cleanup_stale(void) {
  if (is_v2()) {
    _cleanup_free_ char *base = own_group(NULL);
    if (base)
      cleanup_stale_in(base);
    cleanup_stale_in(CG_V2_SHARED);
    return;
  }
  static const char *const controllers[] = {"memory", "pids", "freezer"};
  for (size_t i = 0; i < ARRAY_SIZE(controllers); i++) {
    _cleanup_free_ char *base = own_group(controllers[i]);
    if (base)
      cleanup_stale_in(base);
  }
}
