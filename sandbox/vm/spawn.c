/* vm_spawn.c: starting one QEMU, confined (the seed's Seatbelt, on Linux).
 *
 * Every QEMU the vm backend starts runs:
 *   - with QEMU's own seccomp sandbox (-sandbox on,obsolete=deny,...);
 *   - with no_new_privs and no capabilities;
 *   - as PID 1 of a pid namespace of its own, with a /proc of that
 *     namespace, so that it cannot see or name any other process;
 *   - in a network namespace of its own with no interfaces (the guest has
 *     no network device either: its connections go over the agent channel
 *     to the server's egress broker);
 *   - in a mount namespace where /home, /root, /run/user and the directory
 *     of all the server's state directories are empty tmpfs mounts, so the
 *     host's home directories, credentials and the other QEMUs' state are
 *     not visible; its own state directory is mounted back in its place
 *     when it lies under one of them (a user's store in ~/.cache);
 *   - as root: as an unprivileged uid of its own (one uid per QEMU, so one
 *     escaped QEMU cannot signal or ptrace another), in the group that may
 *     open the golden RAM file;
 *   - as a user (no root): inside a user namespace of its own, which owns
 *     the namespaces above and maps only the user's uid and gid, so that
 *     they can be made at all and QEMU keeps no capability after execve;
 *   - with Landlock confining its writes to its state directory and the
 *     golden RAM file (which QEMU 7.2 opens read-write even for a private
 *     mapping), where the kernel has Landlock;
 *   - with RLIMIT_FSIZE bounding the serial log it writes.
 * Its QMP monitor and agent channel are sockets we pass as fds 3 and 4, so
 * there are no socket files to leave behind.  The clone happens on the
 * spawner thread (PR_SET_PDEATHSIG), and between clone and execve only raw
 * system calls run: everything is prepared beforehand.  A step that fails
 * there is written to the VM's log, which the server's error quotes. */
#include <errno.h>
#include <fcntl.h>
#include <linux/landlock.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "sandbox/vm.h"

#define SERIAL_LOG_MAX (1 << 20)

/* Hidden in every QEMU's mount namespace, with the directory of all the
 * server's state directories (vm_spawn_req.hide) as the last. */
static const char *const hidden_dirs[] = {"/home", "/root", "/run/user"};
#define N_HIDDEN (ARRAY_SIZE(hidden_dirs) + 1)

struct spawn_job {
  const char *qemu;
  char *const *argv;
  char *const *envp;
  int qmp_fd, agent_fd, log_fd, null_fd;
  int server_pidfd;         /* the server, to see that it died before PDEATHSIG was set */
  unsigned long clone_flags;
  bool userns;              /* the confinement is built in a user namespace of its own */
  char uid_map[48], gid_map[48];
  const char *hidden[N_HIDDEN];
  bool hide[N_HIDDEN];
  int reveal_in;            /* the hidden dir the state directory is under, or -1 */
  char reveal[4096];        /* the state directory, shown again inside it */
  uid_t uid;
  gid_t gid;
  gid_t groups[2];
  int n_groups;
  bool drop_uid;
  int ll_ruleset;           /* landlock ruleset fd, or -1 */
  bool limit_fsize;
  char bind_src[VM_SPAWN_BINDS][4096]; /* where each input is now (the server opened it) */
  char bind_dst[VM_SPAWN_BINDS][4096];
  dev_t bind_dev[VM_SPAWN_BINDS];      /* ... and what it is: the bind must be that file */
  ino_t bind_ino[VM_SPAWN_BINDS];
  unsigned long bind_flags[VM_SPAWN_BINDS]; /* MS_* the read-only remount must keep (see bind_flags) */
  bool bind_ro[VM_SPAWN_BINDS];
  int n_binds;
  pid_t ret_pid;
};

/* ---- the child: raw system calls only ---- */

static size_t str_len(const char *s) {
  size_t n = 0;
  while (s[n])
    n++;
  return n;
}

static void put(int fd, const char *s) {
  ssize_t r = write(fd, s, str_len(s));
  (void)r; /* nothing to do about a log that cannot be written */
}

/* "ignition-mcp: cannot WHAT [PATH]: errno N (NAME)" into the VM's log,
 * then exit with CODE: the server quotes the log's tail in its error, so the
 * client learns which step failed instead of "no QMP greeting". */
static _Noreturn void child_fail(int log_fd, const char *what, const char *path, int code) {
  int e = errno;
  static const char *const names[] = {[EPERM] = "EPERM",   [ENOENT] = "ENOENT",
                                      [EACCES] = "EACCES", [EBUSY] = "EBUSY",
                                      [EINVAL] = "EINVAL", [ENOSPC] = "ENOSPC",
                                      [ENOSYS] = "ENOSYS", [EROFS] = "EROFS",
                                      [ENOEXEC] = "ENOEXEC", [ESTALE] = "ESTALE"};
  char num[16];
  size_t n = sizeof num - 1;
  num[n] = '\0';
  unsigned v = (unsigned)e;
  do
    num[--n] = (char)('0' + v % 10);
  while ((v /= 10) && n > 0);
  const char *name = (size_t)e < ARRAY_SIZE(names) ? names[e] : NULL;
  put(log_fd, "ignition-mcp: cannot ");
  put(log_fd, what);
  if (path) {
    put(log_fd, " ");
    put(log_fd, path);
  }
  put(log_fd, ": errno ");
  put(log_fd, num + n);
  if (name) {
    put(log_fd, " (");
    put(log_fd, name);
    put(log_fd, ")");
  }
  put(log_fd, "\n");
  _exit(code);
}

static int write_file(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0)
    return -1;
  size_t n = str_len(text);
  ssize_t w = write(fd, text, n);
  int e = errno;
  close(fd);
  errno = e;
  return w == (ssize_t)n ? 0 : -1;
}

/* The server died before the death signal was armed: a poll of its pidfd
 * (a new pid namespace hides the parent from getppid()). */
static bool server_gone(int pidfd) {
  struct pollfd p = {.fd = pidfd, .events = POLLIN};
  return poll(&p, 1, 0) != 0;
}

static _Noreturn void spawn_child(const struct spawn_job *cj) {
  struct spawn_job *j = (struct spawn_job *)cj; /* our own copy of the server's memory */
  int log_fd = j->log_fd;
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || server_gone(j->server_pidfd))
    _exit(VM_SPAWN_EXIT_PARENT);
  /* Without root, the namespaces below are owned by a user namespace of
   * this QEMU's own, in which only the server's uid and gid exist. */
  if (j->userns &&
      (write_file("/proc/self/setgroups", "deny") < 0 || write_file("/proc/self/uid_map", j->uid_map) < 0 ||
       write_file("/proc/self/gid_map", j->gid_map) < 0))
    child_fail(log_fd, "map the server's uid and gid into QEMU's user namespace", NULL,
               VM_SPAWN_EXIT_USERNS);
  if (dup2(j->null_fd, 0) < 0 || dup2(j->log_fd, 1) < 0 || dup2(j->log_fd, 2) < 0 ||
      dup2(j->qmp_fd, 3) < 0 || dup2(j->agent_fd, 4) < 0)
    child_fail(log_fd, "give QEMU its stdio and channels (dup2)", NULL, VM_SPAWN_EXIT_FDS);
  log_fd = 2;
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    child_fail(log_fd, "make QEMU's mounts private", NULL, VM_SPAWN_EXIT_BIND);
  for (int i = 0; i < j->n_binds; i++) {
    struct stat st;
    if (mount(j->bind_src[i], j->bind_dst[i], NULL, MS_BIND, NULL) < 0)
      child_fail(log_fd, "bind-mount an input of QEMU onto", j->bind_dst[i], VM_SPAWN_EXIT_BIND);
    /* The server opened the input and gave its name; a name can be given
     * to another file meanwhile (a stage replaced by another server). */
    if (stat(j->bind_dst[i], &st) < 0 || st.st_dev != j->bind_dev[i] ||
        st.st_ino != j->bind_ino[i]) {
      errno = ESTALE;
      child_fail(log_fd, "bind-mount the input the server opened (another file has its name now) onto",
                 j->bind_dst[i], VM_SPAWN_EXIT_BIND);
    }
    if (j->bind_ro[i] && mount(NULL, j->bind_dst[i], NULL,
                               MS_BIND | MS_REMOUNT | MS_RDONLY | j->bind_flags[i], NULL) < 0)
      child_fail(log_fd, "bind-mount an input of QEMU onto", j->bind_dst[i], VM_SPAWN_EXIT_BIND);
  }
  /* A /proc of QEMU's own pid namespace: the host's would show every other
   * process, other QEMUs of the same uid among them.  Where the kernel
   * refuses a new proc in a user namespace (a host whose /proc has parts
   * masked, as in some containers), an empty one: QEMU runs without it. */
  if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0 &&
      mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY,
            "size=4k,mode=0555") < 0)
    child_fail(log_fd, "mount a /proc for QEMU's pid namespace", NULL, VM_SPAWN_EXIT_PROC);
  /* The state directory with the binds in it, taken before its parents are
   * hidden. */
  int tree = -1;
  if (j->reveal_in >= 0 &&
      (tree = (int)syscall(SYS_open_tree, AT_FDCWD, j->reveal, OPEN_TREE_CLONE | AT_RECURSIVE | O_CLOEXEC)) < 0)
    child_fail(log_fd, "show QEMU its state directory", j->reveal, VM_SPAWN_EXIT_HIDE);
  for (size_t i = 0; i < N_HIDDEN; i++) {
    if (!j->hide[i])
      continue;
    const char *d = j->hidden[i];
    bool reveal = j->reveal_in == (int)i;
    unsigned long fl = MS_NOSUID | MS_NODEV | MS_NOEXEC;
    if (mount("tmpfs", d, "tmpfs", fl | (reveal ? 0 : MS_RDONLY), "size=16k,mode=0755") < 0)
      child_fail(log_fd, "hide from QEMU", d, VM_SPAWN_EXIT_HIDE);
    if (!reveal)
      continue;
    /* Its path inside the empty tmpfs, the state directory mounted there,
     * then the tmpfs made read-only. */
    for (char *s = j->reveal + str_len(d) + 1; *s; s++)
      if (*s == '/') {
        *s = '\0';
        int r = mkdir(j->reveal, 0755);
        *s = '/';
        if (r < 0 && errno != EEXIST)
          child_fail(log_fd, "show QEMU its state directory", j->reveal, VM_SPAWN_EXIT_HIDE);
      }
    if ((mkdir(j->reveal, 0755) < 0 && errno != EEXIST) ||
        syscall(SYS_move_mount, tree, "", AT_FDCWD, j->reveal, MOVE_MOUNT_F_EMPTY_PATH) < 0 ||
        mount(NULL, d, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | fl, NULL) < 0)
      child_fail(log_fd, "show QEMU its state directory", j->reveal, VM_SPAWN_EXIT_HIDE);
  }
  if (j->drop_uid) {
    /* Raw system calls: glibc's wrappers in a threaded process (the
     * server's memory says it is one) go through __nptl_setxid, which takes
     * a lock another thread of the server may have held at the clone, and
     * signals threads this child does not have. */
    if (syscall(SYS_setgroups, (size_t)j->n_groups, j->groups) < 0 ||
        syscall(SYS_setresgid, j->gid, j->gid, j->gid) < 0 ||
        syscall(SYS_setresuid, j->uid, j->uid, j->uid) < 0)
      child_fail(log_fd, "change to QEMU's uid", NULL, VM_SPAWN_EXIT_UID);
    /* A uid change clears the death signal: armed again, and the server
     * that died in between is seen through its pidfd. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || server_gone(j->server_pidfd))
      _exit(VM_SPAWN_EXIT_PARENT);
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
    child_fail(log_fd, "set no_new_privs", NULL, VM_SPAWN_EXIT_NNP);
  if (j->ll_ruleset >= 0 && syscall(SYS_landlock_restrict_self, j->ll_ruleset, 0) < 0)
    child_fail(log_fd, "confine QEMU with Landlock", NULL, VM_SPAWN_EXIT_LANDLOCK);
  /* Nothing the server holds (client files, other sandboxes' fds) may
   * reach QEMU; fds below 5 are its stdio, QMP and agent channel. */
  if (syscall(SYS_close_range, 5, ~0U, 0) < 0)
    child_fail(log_fd, "close the server's other fds (close_range)", NULL, VM_SPAWN_EXIT_FDS);
  struct rlimit rl = {SERIAL_LOG_MAX, SERIAL_LOG_MAX};
  if (j->limit_fsize)
    setrlimit(RLIMIT_FSIZE, &rl);
  /* QEMU tries a file name (-bios qboot.rom, its default firmware) as a
   * path relative to its working directory before its data directory: the
   * server's working directory is the client's, often a project a sandbox
   * or a stranger wrote, and a qboot.rom there would be the firmware of a
   * warm base every later session starts from. */
  if (syscall(SYS_chdir, "/") < 0)
    child_fail(log_fd, "change QEMU's working directory to", "/", VM_SPAWN_EXIT_EXEC);
  sandbox_child_reset_signals();
  /* Past the limit, writes fail with EFBIG instead of killing QEMU. */
  struct sigaction sa = {.sa_handler = SIG_IGN};
  sigaction(SIGXFSZ, &sa, NULL);
  execve(j->qemu, j->argv, j->envp);
  child_fail(log_fd, "execute QEMU", j->qemu, VM_SPAWN_EXIT_EXEC);
}

/* QEMU starts in new pid, mount and network namespaces, and without root in a new user namespace that owns them: a
 * raw clone, so that it is PID 1 of its pid namespace and can mount a /proc
 * that shows only itself. */
static int spawn_on_thread(void *p) {
  struct spawn_job *j = p;
  long pid = syscall(SYS_clone, j->clone_flags | SIGCHLD, NULL, NULL, NULL, NULL);
  if (pid < 0)
    return -errno;
  if (pid == 0)
    spawn_child(j);
  j->ret_pid = (pid_t)pid;
  return 0;
}

/* Landlock's later rights and scopes, for headers older than the kernel. */
#ifndef LANDLOCK_ACCESS_FS_TRUNCATE
#define LANDLOCK_ACCESS_FS_TRUNCATE (1ULL << 14)
#endif
#ifndef LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET
#define LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0)
#define LANDLOCK_SCOPE_SIGNAL (1ULL << 1)
#endif
/* The kernel's struct landlock_ruleset_attr as of ABI 6. */
struct ruleset_attr {
  __u64 handled_access_fs, handled_access_net, scoped;
};

/* A Landlock ruleset that lets the process write only under DIR and to FILE.
 * A right the ruleset does not handle stays allowed everywhere: truncate(2)
 * (ABI 3) is handled where the kernel has it, or an escaped QEMU could cut
 * any file its uid may write to (another user's world-writable file, the
 * user's own, a base's RAM file) to nothing.  From ABI 6 the domain is also
 * scoped: no abstract unix socket made outside it can be reached and no
 * process outside it signalled.  -1 when the kernel has no Landlock (the
 * caller logs it once). */
static int landlock_ruleset(const char *dir, const char *file) {
  int abi = (int)syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
  if (abi < 1)
    return -1;
  __u64 write_dir = LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_REMOVE_DIR |
                    LANDLOCK_ACCESS_FS_REMOVE_FILE | LANDLOCK_ACCESS_FS_MAKE_CHAR |
                    LANDLOCK_ACCESS_FS_MAKE_DIR | LANDLOCK_ACCESS_FS_MAKE_REG |
                    LANDLOCK_ACCESS_FS_MAKE_SOCK | LANDLOCK_ACCESS_FS_MAKE_FIFO |
                    LANDLOCK_ACCESS_FS_MAKE_BLOCK | LANDLOCK_ACCESS_FS_MAKE_SYM;
  if (abi >= 3)
    write_dir |= LANDLOCK_ACCESS_FS_TRUNCATE;
  struct ruleset_attr attr = {
      .handled_access_fs = write_dir,
      .scoped = abi >= 6 ? LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL : 0};
  /* An older kernel takes the struct it knows (the rest is zero anyway). */
  size_t size = abi >= 6 ? sizeof attr : abi >= 4 ? 2 * sizeof(__u64) : sizeof(__u64);
  int rs = (int)syscall(SYS_landlock_create_ruleset, &attr, size, 0);
  if (rs < 0)
    return -1;
  /* QEMU also opens /dev/null (lock probing) and /dev/kvm read-write. */
  struct {
    const char *path;
    __u64 access;
  } rules[] = {{dir, write_dir},
               /* written never, opened read-write by QEMU: not truncated */
               {file, LANDLOCK_ACCESS_FS_WRITE_FILE},
               {"/dev/null", LANDLOCK_ACCESS_FS_WRITE_FILE},
               {access("/dev/kvm", F_OK) == 0 ? "/dev/kvm" : NULL, LANDLOCK_ACCESS_FS_WRITE_FILE}};
  for (size_t i = 0; i < ARRAY_SIZE(rules); i++) {
    if (!rules[i].path)
      continue;
    _cleanup_close_ int fd = open(rules[i].path, O_PATH | O_CLOEXEC);
    if (fd < 0) {
      close(rs);
      return -1;
    }
    struct landlock_path_beneath_attr pb = {.allowed_access = rules[i].access, .parent_fd = fd};
    if (syscall(SYS_landlock_add_rule, rs, LANDLOCK_RULE_PATH_BENEATH, &pb, 0) < 0) {
      close(rs);
      return -1;
    }
  }
  return rs;
}

bool vm_landlock_available(void) {
  return syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION) >= 1;
}

static bool path_under(const char *path, const char *dir) {
  size_t n = strlen(dir);
  return path && strncmp(path, dir, n) == 0 && (path[n] == '/' || path[n] == '\0');
}

/* The flags a read-only remount of a bind of PATH must keep: inside a user
 * namespace the kernel refuses to drop what the host mount has (nosuid,
 * nodev, noexec, its atime rule). */
static unsigned long bind_flags(const char *path) {
  struct statvfs sv;
  unsigned long fl = MS_NOSUID | MS_NODEV;
  if (statvfs(path, &sv) < 0)
    return fl;
  if (sv.f_flag & ST_NOEXEC)
    fl |= MS_NOEXEC;
  if (sv.f_flag & ST_NOATIME)
    fl |= MS_NOATIME;
  else if (sv.f_flag & ST_RELATIME)
    fl |= MS_RELATIME;
  if (sv.f_flag & ST_NODIRATIME)
    fl |= MS_NODIRATIME;
  return fl;
}

/* Opens SRC, an input of QEMU, as the child will bind it (links followed):
 * *ret_fd (O_PATH), where it is now (*ret_path, SIZE bytes) and what it is
 * (*ret_dev, *ret_ino).  SRC may name a file the caller holds open
 * (/proc/self/fd/N): the child then binds that very file. */
static int bind_source(const char *src, int *ret_fd, char *ret_path, size_t size, dev_t *ret_dev,
                       ino_t *ret_ino, char **ret_err) {
  _cleanup_close_ int fd = open(src, O_PATH | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) < 0) {
    int r = -errno;
    *ret_err = xasprintf("cannot open %s, an input of QEMU: %s", src, strerror(errno));
    return r;
  }
  char proc[64];
  snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(proc, ret_path, size);
  if (n <= 0 || (size_t)n >= size || ret_path[0] != '/') {
    int r = n < 0 ? -errno : -ENAMETOOLONG;
    *ret_err = xasprintf("cannot locate %s, an input of QEMU (%s): is /proc mounted?", src,
                         strerror(-r));
    return r;
  }
  ret_path[n] = '\0';
  *ret_dev = st.st_dev;
  *ret_ino = st.st_ino;
  *ret_fd = steal_fd(fd);
  return 0;
}

static void close_sources(int (*fds)[VM_SPAWN_BINDS]) {
  for (size_t i = 0; i < VM_SPAWN_BINDS; i++)
    closep(&(*fds)[i]);
}

bool vm_spawn_userns(void) { return getuid() != 0; }

int vm_spawn(const struct vm_spawn_req *req, pid_t *ret_pid, char **ret_err) {
  _cleanup_close_ int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  char log_path[4096];
  snprintf(log_path, sizeof log_path, "%s/qemu.log", req->dir);
  _cleanup_close_ int log_fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (null_fd < 0 || log_fd < 0) {
    *ret_err = xasprintf("cannot open %s: %s", log_path, strerror(errno));
    return -errno;
  }
  _cleanup_free_ char *dir = realpath(req->dir, NULL);
  if (!dir || strlen(dir) >= sizeof ((struct spawn_job *)0)->reveal) {
    *ret_err = xasprintf("cannot resolve the VM's state directory %s: %s", req->dir,
                         dir ? strerror(ENAMETOOLONG) : strerror(errno));
    return -EINVAL;
  }
  /* Above fd 4, so that the child's dup2s onto 0-4 leave it open. */
  _cleanup_close_ int pidfd = (int)syscall(SYS_pidfd_open, getpid(), 0);
  if (pidfd >= 0 && pidfd < 5) {
    int high = fcntl(pidfd, F_DUPFD_CLOEXEC, 5);
    close(pidfd);
    pidfd = high;
  }
  if (pidfd < 0) {
    *ret_err = xasprintf("pidfd_open: %s (Linux 5.3 or later is needed)", strerror(errno));
    return -errno;
  }
  struct spawn_job j = {
      .qemu = req->qemu, .argv = req->argv, .envp = (char *const[]){"PATH=/usr/bin:/bin", NULL},
      .qmp_fd = req->qmp_fd, .agent_fd = req->agent_fd, .log_fd = log_fd, .null_fd = null_fd,
      .server_pidfd = pidfd, .ll_ruleset = -1, .reveal_in = -1,
      .clone_flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET,
      .userns = vm_spawn_userns(),
      /* The golden VM creates its RAM file; clones and cold VMs (whose
       * guests are the sessions') only write their log. */
      .limit_fsize = !req->makes_ram_file,
  };
  if (j.userns) {
    /* Only the server's own uid and gid exist in QEMU's user namespace
     * (mapped to themselves): QEMU has no capability there after execve,
     * and files it makes are the server's user's. */
    j.clone_flags |= CLONE_NEWUSER;
    snprintf(j.uid_map, sizeof j.uid_map, "%u %u 1\n", (unsigned)getuid(), (unsigned)getuid());
    snprintf(j.gid_map, sizeof j.gid_map, "%u %u 1\n", (unsigned)getgid(), (unsigned)getgid());
  }
  /* Each input is opened here (following links, as a bind would) and held
   * until QEMU has it: the child binds it by the name it has now, from
   * /proc/self/fd (a bind cannot take a descriptor of the server's mount
   * namespace), and checks that what it bound is this file. */
  __attribute__((cleanup(close_sources))) int src_fds[VM_SPAWN_BINDS] = {-1, -1, -1, -1};
  int r = 0;
  for (size_t i = 0; i < ARRAY_SIZE(req->binds) && req->binds[i].src && r == 0; i++) {
    struct vm_bind b = req->binds[i];
    snprintf(j.bind_dst[i], sizeof j.bind_dst[i], "%s/%s", dir, b.name);
    _cleanup_close_ int fd = open(j.bind_dst[i], O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
      r = -errno;
      *ret_err = xasprintf("cannot create %s: %s", j.bind_dst[i], strerror(errno));
      break;
    }
    r = bind_source(b.src, &src_fds[i], j.bind_src[i], sizeof j.bind_src[i], &j.bind_dev[i],
                    &j.bind_ino[i], ret_err);
    j.bind_ro[i] = !b.writable;
    j.bind_flags[i] = bind_flags(j.bind_src[i]);
    j.n_binds++;
  }
  if (r < 0)
    return r;
  for (size_t i = 0; i < N_HIDDEN; i++) {
    struct stat st;
    const char *h = j.hidden[i] = i < ARRAY_SIZE(hidden_dirs) ? hidden_dirs[i] : req->hide;
    /* Never hide what QEMU itself must read by its own name (its binary);
     * its state directory, where everything else is, is shown again. */
    j.hide[i] = h && stat(h, &st) == 0 && S_ISDIR(st.st_mode);
    for (size_t k = 0; j.hide[i] && k < ARRAY_SIZE(req->needed) && req->needed[k]; k++)
      if (path_under(req->needed[k], h))
        j.hide[i] = false;
    /* Under a directory hidden already: nothing more to hide. */
    for (size_t k = 0; j.hide[i] && k < i; k++)
      if (j.hide[k] && path_under(h, j.hidden[k]))
        j.hide[i] = false;
    if (j.hide[i] && path_under(dir, h) && strcmp(dir, h) != 0) {
      j.reveal_in = (int)i;
      strcpy(j.reveal, dir);
    }
  }
  if (getuid() == 0 && req->uid) {
    j.drop_uid = true;
    j.uid = req->uid;
    j.gid = req->gid;
    j.groups[j.n_groups++] = req->gid;
    if (req->kvm_gid)
      j.groups[j.n_groups++] = req->kvm_gid;
    if (chown(req->dir, req->uid, req->gid) < 0 || fchown(log_fd, req->uid, req->gid) < 0) {
      *ret_err = xasprintf("cannot hand %s to uid %u: %s", req->dir, req->uid, strerror(errno));
      return -errno;
    }
  }
  j.ll_ruleset = landlock_ruleset(req->dir, req->ram_file_writable);
  r = spawner_call(spawn_on_thread, &j);
  if (j.ll_ruleset >= 0)
    close(j.ll_ruleset);
  if (r < 0) {
    *ret_err = xasprintf("cannot start QEMU: %s%s", strerror(-r),
                         j.userns && r == -EPERM
                             ? " (without root, QEMU is confined in a user namespace of its own: "
                               "unprivileged user namespaces must be allowed, e.g. sysctl "
                               "kernel.unprivileged_userns_clone=1 or "
                               "user.max_user_namespaces > 0)"
                             : "");
    return r;
  }
  *ret_pid = j.ret_pid;
  return 0;
}
