/* vm_spawn.c: starting one QEMU, confined (the seed's Seatbelt, on Linux).
 *
 * Every QEMU the vm backend starts runs:
 *   - with QEMU's own seccomp sandbox (-sandbox on,obsolete=deny,...);
 *   - with no_new_privs;
 *   - in a network namespace of its own with no interfaces (unless
 *     IGN_MCP_NET asks for user-mode networking);
 *   - in a mount namespace where /home, /root and /run/user are empty
 *     tmpfs mounts, so the host's home directories and credentials are not
 *     visible;
 *   - as an unprivileged uid of its own when the server runs as root (one
 *     uid per QEMU, so one escaped QEMU cannot ptrace another), in the group
 *     that may open the golden RAM file;
 *   - with Landlock confining its writes to its state directory and the
 *     golden RAM file (which QEMU 7.2 opens read-write even for a private
 *     mapping), where the kernel has Landlock;
 *   - with RLIMIT_FSIZE bounding the serial log it writes.
 * Its QMP monitor and agent channel are sockets we pass as fds 3 and 4, so
 * there are no socket files to leave behind.  The fork happens on the
 * spawner thread (PR_SET_PDEATHSIG), and between fork and execve only raw
 * system calls run: everything is prepared beforehand. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/landlock.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/util.h"
#include "mcp/log.h"
#include "sandbox/vm.h"

#define SERIAL_LOG_MAX (1 << 20)

static const char *const hidden_dirs[] = {"/home", "/root", "/run/user"};

struct spawn_job {
  const char *qemu;
  char *const *argv;
  char *const *envp;
  int qmp_fd, agent_fd, log_fd, null_fd;
  bool unshare_net;
  bool hide[ARRAY_SIZE(hidden_dirs)];
  uid_t uid;
  gid_t gid;
  gid_t groups[2];
  int n_groups;
  bool drop_uid;
  int ll_ruleset;           /* landlock ruleset fd, or -1 */
  bool limit_fsize;
  const char *bind_src[4];
  char bind_dst[4][4096];
  bool bind_ro[4];
  int n_binds;
  pid_t parent;
  pid_t ret_pid;
};

static int spawn_on_thread(void *p) {
  struct spawn_job *j = p;
  j->parent = getpid();
  pid_t pid = fork();
  if (pid < 0)
    return -errno;
  if (pid > 0) {
    j->ret_pid = pid;
    return 0;
  }
  /* Child: raw system calls only from here to execve. */
  if (dup2(j->null_fd, 0) < 0 || dup2(j->log_fd, 1) < 0 || dup2(j->log_fd, 2) < 0 ||
      dup2(j->qmp_fd, 3) < 0 || dup2(j->agent_fd, 4) < 0)
    _exit(126);
  if (unshare(CLONE_NEWNS | (j->unshare_net ? CLONE_NEWNET : 0)) < 0)
    _exit(125);
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    _exit(124);
  for (int i = 0; i < j->n_binds; i++) {
    if (mount(j->bind_src[i], j->bind_dst[i], NULL, MS_BIND, NULL) < 0)
      _exit(118);
    if (j->bind_ro[i] &&
        mount(NULL, j->bind_dst[i], NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV,
              NULL) < 0)
      _exit(118);
  }
  for (size_t i = 0; i < ARRAY_SIZE(hidden_dirs); i++)
    if (j->hide[i])
      mount("tmpfs", hidden_dirs[i], "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY,
            "size=4k,mode=0755");
  if (j->drop_uid) {
    if (setgroups((size_t)j->n_groups, j->groups) < 0 || setresgid(j->gid, j->gid, j->gid) < 0 ||
        setresuid(j->uid, j->uid, j->uid) < 0)
      _exit(123);
  }
  /* The death signal is cleared by a uid change, so it is set after it; a
   * server that died in between is seen through getppid(). */
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != j->parent)
    _exit(120);
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
    _exit(122);
  if (j->ll_ruleset >= 0 && syscall(SYS_landlock_restrict_self, j->ll_ruleset, 0) < 0)
    _exit(121);
  /* Nothing the server holds (client files, other sandboxes' fds) may
   * reach QEMU; fds below 5 are its stdio, QMP and agent channel. */
  if (syscall(SYS_close_range, 5, ~0U, 0) < 0)
    _exit(119);
  struct rlimit rl = {SERIAL_LOG_MAX, SERIAL_LOG_MAX};
  if (j->limit_fsize)
    setrlimit(RLIMIT_FSIZE, &rl);
  sandbox_child_reset_signals();
  /* Past the limit, writes fail with EFBIG instead of killing QEMU. */
  struct sigaction sa = {.sa_handler = SIG_IGN};
  sigaction(SIGXFSZ, &sa, NULL);
  execve(j->qemu, j->argv, j->envp);
  _exit(127);
}

/* A Landlock ruleset that lets the process write only under DIR and to FILE.
 * -1 when the kernel has no Landlock (the caller logs it once). */
static int landlock_ruleset(const char *dir, const char *file) {
  int abi = (int)syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
  if (abi < 1)
    return -1;
  __u64 write_dir = LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_REMOVE_DIR |
                    LANDLOCK_ACCESS_FS_REMOVE_FILE | LANDLOCK_ACCESS_FS_MAKE_CHAR |
                    LANDLOCK_ACCESS_FS_MAKE_DIR | LANDLOCK_ACCESS_FS_MAKE_REG |
                    LANDLOCK_ACCESS_FS_MAKE_SOCK | LANDLOCK_ACCESS_FS_MAKE_FIFO |
                    LANDLOCK_ACCESS_FS_MAKE_BLOCK | LANDLOCK_ACCESS_FS_MAKE_SYM;
  struct landlock_ruleset_attr attr = {.handled_access_fs = write_dir};
  int rs = (int)syscall(SYS_landlock_create_ruleset, &attr, sizeof attr, 0);
  if (rs < 0)
    return -1;
  /* QEMU also opens /dev/null (lock probing) and /dev/kvm read-write. */
  struct {
    const char *path;
    __u64 access;
  } rules[] = {{dir, write_dir},
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

int vm_spawn(const struct vm_spawn_req *req, pid_t *ret_pid, char **ret_err) {
  _cleanup_close_ int null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  char log_path[4096];
  snprintf(log_path, sizeof log_path, "%s/qemu.log", req->dir);
  _cleanup_close_ int log_fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
  if (null_fd < 0 || log_fd < 0) {
    *ret_err = xasprintf("cannot open %s: %s", log_path, strerror(errno));
    return -errno;
  }
  struct spawn_job j = {
      .qemu = req->qemu, .argv = req->argv, .envp = (char *const[]){"PATH=/usr/bin:/bin", NULL},
      .qmp_fd = req->qmp_fd, .agent_fd = req->agent_fd, .log_fd = log_fd, .null_fd = null_fd,
      .unshare_net = !req->net, .ll_ruleset = -1,
      /* The golden VM creates its RAM file; clones only write their log. */
      .limit_fsize = req->ram_file_writable != NULL,
  };
  for (size_t i = 0; i < ARRAY_SIZE(req->binds) && req->binds[i].src; i++) {
    struct vm_bind b = req->binds[i];
    snprintf(j.bind_dst[i], sizeof j.bind_dst[i], "%s/%s", req->dir, b.name);
    _cleanup_close_ int fd = open(j.bind_dst[i], O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
      *ret_err = xasprintf("cannot create %s: %s", j.bind_dst[i], strerror(errno));
      return -errno;
    }
    j.bind_src[i] = b.src;
    j.bind_ro[i] = !b.writable;
    j.n_binds++;
  }
  for (size_t i = 0; i < ARRAY_SIZE(hidden_dirs); i++) {
    struct stat st;
    /* Never hide what QEMU itself must read. */
    j.hide[i] = stat(hidden_dirs[i], &st) == 0 && S_ISDIR(st.st_mode);
    for (size_t k = 0; j.hide[i] && k < ARRAY_SIZE(req->needed) && req->needed[k]; k++)
      if (path_under(req->needed[k], hidden_dirs[i]))
        j.hide[i] = false;
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
  int r = spawner_call(spawn_on_thread, &j);
  if (j.ll_ruleset >= 0)
    close(j.ll_ruleset);
  if (r < 0) {
    *ret_err = xasprintf("cannot start QEMU: %s", strerror(-r));
    return r;
  }
  *ret_pid = j.ret_pid;
  return 0;
}
