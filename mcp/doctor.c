/* doctor.c: `ignition-mcp doctor`: everything a session needs, checked on
 * this host, one line per check: a status word (ok, warn, missing, fail),
 * what was found, and for anything not ok the command that fixes it.
 *
 * The checks ask the same code the server runs: the KVM decision and the
 * warm base's fingerprint come from the vm backend (sandbox/vm.c), the
 * cgroup check makes a real group through sandbox/cgroup.c, the namespace
 * check really clones a process into the namespaces the ns backend uses
 * (a user namespace first), the sandbox check starts a real ns sandbox
 * through sandbox/ns.c, exactly as open_session does, runs a command in it
 * and removes it (the ns backend is ready only when that worked; as root
 * that sandbox holds one of the sessions' uid blocks while it runs, made on
 * first use: /run/ignition-mcp-uids and its lock files, which stay), and the
 * session check starts one real QEMU as a session does (its state
 * directory, in the server's runtime directory, which it makes when it is
 * missing, is removed again).  No base is built, no store is made and
 * nothing is installed; besides that, only the cgroup check changes the
 * host.  It makes a test group, ign-mcp-<pid>-doctor, with the
 * session limits and removes it again; but cgroup.c first prepares the
 * parent the way the server does, and that stays.  On cgroup v2 it may move
 * this process into a new leaf group <own group>/ign-mcp-<pid>-server and
 * write "+memory +pids" to <own group>/cgroup.subtree_control, or, where that
 * is refused, create /sys/fs/cgroup/ignition-mcp and write "+memory +pids" to
 * the subtree_control of the root group and of that group.  On cgroup v1 the
 * test group is a directory in each of this process's memory and pids
 * groups; both are removed and nothing else is made.
 *
 * "warn" never stops sessions (KVM missing means TCG, a missing warm base is
 * made on first use, no cgroup limits means sessions without them);
 * "missing" and "fail" stop the backend they belong to.  The same checks
 * explain a server that started without a working backend: each
 * open_session adds doctor_explain()'s text, made when it is asked for (on
 * that call's thread) so that it says how things stand now. */
#include "mcp/doctor.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <linux/landlock.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"
#include "common/config.h"
#include "common/log.h"
#include "sandbox/sandbox.h"
#include "sandbox/vm.h"

extern char **environ;

enum status { ST_OK, ST_WARN, ST_MISSING, ST_FAIL };
static const char *const status_words[] = {"ok", "warn", "missing", "fail"};

/* Which backend a check matters to. */
enum { FOR_VM = 1, FOR_NS = 2 };

struct check {
  unsigned for_backends;
  const char *name;
  enum status status;
  char *found;
  char *fix;                /* NULL when there is nothing to do */
};

#define MAX_CHECKS 24

struct report {
  struct check c[MAX_CHECKS];
  size_t n;
  bool vm_ready, ns_ready;
  const char *accel;        /* what microVMs would run under, or NULL */
  char *accel_why;          /* why not KVM, when not */
  bool vm_tried;            /* a trial session ran (see check_session) */
};

/* Takes FOUND and FIX (either may be NULL). */
static void add(struct report *r, unsigned for_backends, const char *name, enum status st,
                char *found, char *fix) {
  if (r->n == MAX_CHECKS) {
    free(found);
    free(fix);
    return;
  }
  r->c[r->n++] = (struct check){.for_backends = for_backends, .name = name, .status = st,
                                .found = found, .fix = fix};
}

static void report_free(struct report *r) {
  free(r->accel_why);
  for (size_t i = 0; i < r->n; i++) {
    free(r->c[i].found);
    free(r->c[i].fix);
  }
}

/* ---- fixes ---- */

static char *as_root(const char *cmd) {
  return getuid() == 0 ? strdup(cmd) : xasprintf("sudo %s", cmd);
}

/* The source tree the server was built in (<tree>/build/ignition-mcp or
 * <tree>/build/san/ignition-mcp), or NULL for an installed server. */
static char *source_tree(void) {
  const char *const ups[] = {"%s/..", "%s/../.."};
  for (size_t i = 0; i < ARRAY_SIZE(ups); i++) {
    _cleanup_free_ char *d = xasprintf(ups[i], config_exe_dir());
    _cleanup_free_ char *mk = xasprintf("%s/Makefile", d);
    _cleanup_free_ char *src = xasprintf("%s/mcp/doctor.c", d);
    if (access(mk, F_OK) == 0 && access(src, F_OK) == 0)
      return realpath(d, NULL);
  }
  return NULL;
}

/* The command that builds TARGET ("" for the server and the agent). */
static char *make_cmd(const char *target) {
  _cleanup_free_ char *tree = source_tree();
  if (tree)
    return xasprintf("make -C %s%s%s", tree, *target ? " " : "", target);
  return xasprintf("make%s%s && %s (in the ignition-mcp source tree; this server is installed)",
                   *target ? " " : "", target, getuid() == 0 ? "make install" : "sudo make install");
}

static const char *env_set(const char *name) {
  const char *v = getenv(name);
  return v && *v ? v : NULL;
}

static char *size_text(const char *path) {
  struct stat st;
  if (stat(path, &st) < 0)
    return strdup("?");
  double mib = (double)st.st_size / (1 << 20);
  return mib >= 1 ? xasprintf("%.1f MiB", mib) : xasprintf("%lld bytes", (long long)st.st_size);
}

static bool is_regular(const char *p) {
  struct stat st;
  return p && stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

/* ---- running a program ---- */

/* Runs ARGV with stdout and stderr into OUT (NUL-terminated, truncated to
 * SIZE); returns its wait status, or a negative errno.  Killed after 10 s. */
static int run_capture(char *const argv[], char *out, size_t size) {
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
  uint64_t deadline = mono_ms() + 10000;
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

/* ---- the vm backend ---- */

static void check_qemu(struct report *r) {
  if (!cfg.qemu) {
    add(r, FOR_VM, "qemu", ST_MISSING,
        config_missing_why("IGN_MCP_QEMU", "qemu-system-x86_64", "an executable file"),
        env_set("IGN_MCP_QEMU") ? strdup("unset IGN_MCP_QEMU (to use qemu-system-x86_64 from PATH)")
                                : as_root("apt-get install qemu-system-x86"));
    return;
  }
  char out[8192];
  char *argv[] = {cfg.qemu, "--version", NULL};
  int st = run_capture(argv, out, sizeof out);
  if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    out[strcspn(out, "\n")] = '\0';
    add(r, FOR_VM, "qemu", ST_FAIL,
        xasprintf("%s --version does not run: %s", cfg.qemu,
                  st < 0 ? strerror(-st) : *out ? out : "it failed without a message"),
        as_root("apt-get install --reinstall qemu-system-x86"));
    return;
  }
  out[strcspn(out, "\n")] = '\0';
  _cleanup_free_ char *version = strdup(out);
  char *machines[] = {cfg.qemu, "-machine", "help", NULL};
  st = run_capture(machines, out, sizeof out);
  if (st < 0 || !strstr(out, "microvm")) {
    add(r, FOR_VM, "qemu", ST_FAIL,
        xasprintf("%s (%s) has no microvm machine type: QEMU 4.2 or later is needed", cfg.qemu,
                  version),
        as_root("apt-get install qemu-system-x86"));
    return;
  }
  add(r, FOR_VM, "qemu", ST_OK, xasprintf("%s: %s", cfg.qemu, version), NULL);
}

static void check_kvm(struct report *r) {
  _cleanup_free_ char *why = NULL, *fix = NULL;
  r->accel = vm_probe_accel(&why, &fix);
  r->accel_why = why ? strdup(why) : NULL;
  _cleanup_free_ char *probe = vm_kvm_probe_text();
  struct vm_kvm_probe p;
  bool slow = vm_kvm_probe_last(&p, NULL) && !p.finished;
  if (!r->accel)
    add(r, FOR_VM, "kvm", ST_FAIL, xasprintf("IGN_MCP_ACCEL=kvm but KVM cannot be used: %s", why),
        fix ? steal_ptr(fix) : strdup("unset IGN_MCP_ACCEL (to fall back to TCG)"));
  else if (strcmp(r->accel, "kvm") == 0)
    add(r, FOR_VM, "kvm", ST_OK,
        xasprintf("microVMs run under KVM: /dev/kvm opens and creates VMs%s%s", probe ? "; " : "",
                  probe ? probe : ""),
        NULL);
  else if (strcmp(cfg.accel, "tcg") == 0)
    add(r, FOR_VM, "kvm", ST_OK, strdup("not used (IGN_MCP_ACCEL=tcg): microVMs run under TCG"),
        NULL);
  else if (slow)
    /* Nothing to fix: TCG is the faster choice on this host. */
    add(r, FOR_VM, "kvm", ST_OK, xasprintf("not used: %s; microVMs run under TCG", why), NULL);
  else
    add(r, FOR_VM, "kvm", ST_WARN,
        xasprintf("not usable: %s; microVMs run under TCG (slower, still a VM)", why),
        steal_ptr(fix));
}

/* One data file of the vm backend: VAR overrides the default NAME. */
static bool check_vm_file(struct report *r, const char *label, const char *path, const char *var) {
  if (is_regular(path)) {
    _cleanup_free_ char *size = size_text(path);
    add(r, FOR_VM, label, ST_OK, xasprintf("%s (%s)", path, size), NULL);
    return true;
  }
  add(r, FOR_VM, label, ST_MISSING, config_missing_why(var, path, "a file"),
      env_set(var) ? xasprintf("unset %s (to use the one next to the server)", var)
                   : make_cmd("vm-images"));
  return false;
}

static bool check_vm_image(struct report *r) {
  const char *spec = cfg.rootfs_spec;
  if (cfg.vm_image && !is_regular(cfg.vm_image) && !env_set("IGN_MCP_VM_IMAGE") &&
      !strchr(spec, '/') && strcmp(spec, "tools") != 0 && strcmp(spec, "small") != 0) {
    add(r, FOR_VM, "image", ST_MISSING,
        xasprintf("there is no image for a rootfs named '%s' (IGN_MCP_ROOTFS; %s is missing): "
                  "the names are tools and small",
                  spec, cfg.vm_image),
        strdup("unset IGN_MCP_ROOTFS (the default is tools)"));
    return false;
  }
  if (cfg.vm_image)
    return check_vm_file(r, "image", cfg.vm_image, "IGN_MCP_VM_IMAGE");
  add(r, FOR_VM, "image", ST_MISSING,
      xasprintf("IGN_MCP_ROOTFS=%s is neither a rootfs name nor an image file: microVMs boot a "
                "disk image (tools, small or a path to one)",
                cfg.rootfs_spec),
      strdup("unset IGN_MCP_ROOTFS (the default, tools, has an image)"));
  return false;
}

static void check_store(struct report *r) {
  _cleanup_free_ char *err = NULL;
  struct stat st;
  if (stat(cfg.store, &st) == 0) {
    if (!S_ISDIR(st.st_mode) || access(cfg.store, W_OK | X_OK) < 0) {
      add(r, FOR_VM, "store", ST_FAIL,
          xasprintf("%s (IGN_MCP_STORE) is not a writable directory", cfg.store),
          strdup("export IGN_MCP_STORE=\"$HOME/.cache/ignition-mcp\""));
      return;
    }
  } else {
    /* Created on first use: the nearest existing parent must be writable. */
    _cleanup_free_ char *p = strdup(cfg.store);
    for (;;) {
      char *slash = strrchr(p, '/');
      if (!slash) {
        strcpy(p, "."); /* a relative store, under the working directory */
        break;
      }
      if (slash == p) {
        p[1] = '\0';
        break;
      }
      *slash = '\0';
      if (access(p, F_OK) == 0)
        break;
    }
    if (access(p, W_OK | X_OK) < 0) {
      add(r, FOR_VM, "store", ST_FAIL,
          xasprintf("%s (IGN_MCP_STORE) does not exist and %s is not writable", cfg.store, p),
          xasprintf("mkdir -p %s, or export IGN_MCP_STORE=\"$HOME/.cache/ignition-mcp\"",
                    cfg.store));
      return;
    }
  }
  if (vm_check_reachable(cfg.store, "the store (IGN_MCP_STORE)", &err) < 0) {
    add(r, FOR_VM, "store", ST_FAIL, steal_ptr(err), NULL); /* the message names the chmod */
    return;
  }
  add(r, FOR_VM, "store", ST_OK,
      xasprintf("%s is writable%s", cfg.store, stat(cfg.store, &st) == 0 ? "" : " (made on first use)"),
      NULL);
}

static void check_base(struct report *r, bool inputs_ok) {
  if (strcmp(cfg.base, "none") == 0) {
    add(r, FOR_VM, "warm base", ST_OK,
        strdup("IGN_MCP_BASE=none: every session cold-boots (slow; unset it for warm clones)"),
        NULL);
    return;
  }
  _cleanup_free_ char *make_base = xasprintf("%s/ignition-mcp make-base", config_exe_dir());
  if (!inputs_ok || !r->accel) {
    add(r, FOR_VM, "warm base", ST_WARN,
        strdup("not checked: it is made from QEMU and the images above, which are not all there"),
        steal_ptr(make_base));
    return;
  }
  bool complete;
  _cleanup_free_ char *dir = vm_base_path(r->accel, &complete);
  if (complete) {
    add(r, FOR_VM, "warm base", ST_OK,
        xasprintf("%s matches QEMU, the kernel, initramfs and image (%s)", dir, r->accel), NULL);
    return;
  }
  add(r, FOR_VM, "warm base", ST_WARN,
      xasprintf("%s is not made yet for these images: the first session makes it (30-60 s "
                "under TCG, a few s with KVM) unless you make it now",
                dir),
      steal_ptr(make_base));
}

static void check_landlock(struct report *r) {
  long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
  if (abi >= 1)
    add(r, FOR_VM, "landlock", ST_OK,
        xasprintf("ABI %ld: each QEMU may write only to its own state directory", abi), NULL);
  else
    add(r, FOR_VM, "landlock", ST_WARN,
        xasprintf("not available (%s): QEMU's writes are not confined by Landlock (its seccomp "
                  "sandbox, namespaces and own uid still apply)",
                  strerror(errno)),
        strdup("boot a kernel with CONFIG_SECURITY_LANDLOCK=y and landlock in its lsm= list"));
}

/* Ready means a session really starts: one QEMU, confined as a session's,
 * whose agent answers (vm_trial_session).  Only when every other vm check
 * passed and the vm backend is wanted; it takes a few seconds (a restore,
 * or a cold boot when there is no warm base yet). */
static void check_session(struct report *r, bool wanted) {
  bool blocked = false;
  for (size_t i = 0; i < r->n; i++)
    if ((r->c[i].for_backends & FOR_VM) && (r->c[i].status == ST_MISSING || r->c[i].status == ST_FAIL))
      blocked = true;
  if (!wanted) {
    add(r, FOR_VM, "session", ST_WARN,
        xasprintf("not tried (IGN_MCP_BACKEND=%s): whether a microVM session starts is not known",
                  config_backend_name()),
        strdup("IGN_MCP_BACKEND=vm ignition-mcp doctor (to try one)"));
    return;
  }
  if (blocked) {
    add(r, FOR_VM, "session", ST_WARN, strdup("not tried: the checks above are not all met"),
        strdup("fix the vm checks marked missing or fail above"));
    return;
  }
  _cleanup_free_ char *how = NULL, *base_err = NULL, *err = NULL;
  r->vm_tried = true;
  if (vm_trial_session(&how, &base_err, &err) == 0) {
    /* A damaged base does not stop sessions (they make it again first),
     * but each server would spend a base build on it. */
    add(r, FOR_VM, "session", base_err ? ST_WARN : ST_OK,
        xasprintf("a QEMU started as a session's (%s) and its agent answered: %s%s%s",
                  vm_spawn_userns() ? "confined in a user namespace of its own" : "as a uid of its own",
                  how, base_err ? "; but " : "", base_err ? base_err : ""),
        base_err ? xasprintf("%s/ignition-mcp make-base --force", config_exe_dir()) : NULL);
    return;
  }
  bool userns = vm_spawn_userns() && (strstr(err, "user namespace") || strstr(err, "uid_map"));
  add(r, FOR_VM, "session", ST_FAIL, xasprintf("a trial session did not start: %s", err),
      userns ? strdup("allow unprivileged user namespaces (sysctl -w kernel.unprivileged_userns_clone=1 "
                      "user.max_user_namespaces=15000), or run the server as root")
             : strdup("fix what the error above names, then run ignition-mcp doctor again"));
}

/* ---- the ns backend ---- */

static void check_agent(struct report *r) {
  if (cfg.agent) {
    add(r, FOR_NS, "agent", ST_OK, strdup(cfg.agent), NULL);
    return;
  }
  _cleanup_free_ char *deflt = xasprintf("%s/ign-agent", config_exe_dir());
  add(r, FOR_NS, "agent", ST_MISSING,
      config_missing_why("IGN_MCP_AGENT", deflt, "an executable file"),
      env_set("IGN_MCP_AGENT") ? strdup("unset IGN_MCP_AGENT (to use the ign-agent next to the server)")
                               : make_cmd(""));
}

static void check_rootfs(struct report *r) {
  if (cfg.rootfs) {
    _cleanup_free_ char *sh = xasprintf("%s/bin/sh", cfg.rootfs);
    struct stat st;
    if (lstat(sh, &st) < 0)
      add(r, FOR_NS, "rootfs", ST_FAIL, xasprintf("%s has no /bin/sh", cfg.rootfs),
          strchr(cfg.rootfs_spec, '/') ? strdup("unset IGN_MCP_ROOTFS")
                                       : make_cmd(strcmp(cfg.rootfs_spec, "small") == 0
                                                      ? "rootfs-small"
                                                      : "rootfs-tools"));
    else
      add(r, FOR_NS, "rootfs", ST_OK, xasprintf("%s (rootfs %s)", cfg.rootfs, cfg.rootfs_spec),
          NULL);
    return;
  }
  const char *spec = cfg.rootfs_spec;
  if (strchr(spec, '/')) {
    add(r, FOR_NS, "rootfs", ST_MISSING,
        xasprintf("IGN_MCP_ROOTFS=%s is not a directory", spec),
        strdup("unset IGN_MCP_ROOTFS (the default is the tools rootfs)"));
  } else if (strcmp(spec, "tools") == 0 || strcmp(spec, "small") == 0) {
    _cleanup_free_ char *target = xasprintf("rootfs-%s", spec);
    _cleanup_free_ char *deflt = xasprintf("%s/rootfs/%s", config_exe_dir(), spec);
    add(r, FOR_NS, "rootfs", ST_MISSING, config_missing_why(NULL, deflt, "a directory"),
        make_cmd(target));
  } else {
    add(r, FOR_NS, "rootfs", ST_MISSING,
        xasprintf("there is no rootfs named '%s' (IGN_MCP_ROOTFS): the names are tools and small",
                  spec),
        strdup("unset IGN_MCP_ROOTFS (the default is tools)"));
  }
}

/* The first account of the host with a uid in the sessions' blocks, or
 * NULL: such an account would share a uid with a sandbox. */
static char *account_in_blocks(void) {
  unsigned long long lo = cfg.ns_uid_base;
  unsigned long long hi = lo + (unsigned long long)NS_UID_SLOTS * NS_UID_BLOCK;
  char *found = NULL;
  setpwent();
  for (struct passwd *pw; !found && (pw = getpwent());)
    if (pw->pw_uid >= lo && pw->pw_uid < hi)
      found = xasprintf("%s (uid %u)", pw->pw_name, (unsigned)pw->pw_uid);
  endpwent();
  return found;
}

/* Clones a child into the namespaces the ns backend makes (a user namespace
 * first); it exits at once. */
static void check_namespaces(struct report *r) {
  _cleanup_free_ char *why = NULL;
  if (ns_probe(&why) < 0) {
    add(r, FOR_NS, "namespaces", ST_FAIL, steal_ptr(why),
        ns_as_root() ? strdup("run ignition-mcp outside the container or seccomp profile that "
                              "forbids namespaces")
                     : strdup("let users create user namespaces: sudo sysctl -w "
                              "user.max_user_namespaces=15000 (and on Debian/Ubuntu: "
                              "kernel.unprivileged_userns_clone=1, "
                              "kernel.apparmor_restrict_unprivileged_userns=0), or run "
                              "ignition-mcp as root"));
    return;
  }
  if (!ns_as_root()) {
    add(r, FOR_NS, "namespaces", ST_OK,
        xasprintf("user, mount, pid, net, ipc, uts and cgroup namespaces can be made; uid 0 in a "
                  "session is your uid %u, so per-user kernel counts (processes, inotify, "
                  "message queues, pipes) are shared by your sessions and your other processes",
                  (unsigned)geteuid()),
        NULL);
    return;
  }
  unsigned long long last = cfg.ns_uid_base + (unsigned long long)NS_UID_SLOTS * NS_UID_BLOCK - 1;
  _cleanup_free_ char *account = account_in_blocks();
  if (account) {
    add(r, FOR_NS, "namespaces", ST_WARN,
        xasprintf("the account %s has a uid in the sessions' uid blocks %u-%llu: a session "
                  "would share it",
                  account, cfg.ns_uid_base, last),
        strdup("set IGN_MCP_NS_UID_BASE to the start of 256 x 65536 uids no account uses"));
    return;
  }
  add(r, FOR_NS, "namespaces", ST_OK,
      xasprintf("user, mount, pid, net, ipc, uts and cgroup namespaces can be made; each session "
                "gets host uids of its own (a block of %u from %u-%llu, no account there)",
                NS_UID_BLOCK, cfg.ns_uid_base, last),
      NULL);
}

/* Makes and removes a real group with the session limits. */
static void check_cgroups(struct report *r) {
  bool v2 = access("/sys/fs/cgroup/cgroup.controllers", F_OK) == 0;
  const char *version = v2 ? "v2" : access("/sys/fs/cgroup/memory", F_OK) == 0 ? "v1" : NULL;
  char name[64];
  snprintf(name, sizeof name, "ign-mcp-%d-doctor", getpid());
  struct cgroup *cg = NULL;
  _cleanup_free_ char *err = NULL;
  if (cgroup_create(name, cfg.memory_mb, cfg.pids, &cg, &err) == 0) {
    cgroup_destroy(cg);
    add(r, FOR_NS, "cgroups", ST_OK,
        xasprintf("%s: memory and pids limits can be set for each session", version ? version : "?"),
        NULL);
    return;
  }
  add(r, FOR_NS, "cgroups", ST_WARN,
      xasprintf("%s: %s; namespace sessions would run without a memory limit (not enforced: "
                "only each process's data is limited, by RLIMIT_DATA), their processes limited "
                "by RLIMIT_NPROC in their user namespace instead of a pids cgroup",
                version ? version : "no cgroup file system at /sys/fs/cgroup", err),
      getuid() != 0 ? (v2 ? strdup("start the server in a delegated cgroup: systemd-run --user "
                                   "--scope -p Delegate=yes ignition-mcp, or run it as root")
                          : strdup("run ignition-mcp as root (cgroup v1 is not delegated to "
                                   "users)"))
      : v2 ? strdup("start the server in a delegated cgroup: systemd-run --scope -p Delegate=yes "
                    "ignition-mcp")
           : strdup("mount the memory and pids cgroup controllers under /sys/fs/cgroup"));
}

/* Starts a sandbox exactly as open_session does and runs a command in it:
 * what the checks above cannot see (the agent's setup in the namespaces, the
 * idmapped rootfs, the overlay) shows here. */
static void check_sandbox(struct report *r, bool parts_ok) {
  if (!parts_ok) {
    add(r, FOR_NS, "sandbox", ST_WARN,
        strdup("not tried: the agent, the rootfs or the namespaces above are not all there"),
        strdup("fix what is marked above"));
    return;
  }
  struct sandbox_config sc = {
      .rootfs = cfg.rootfs, .agent = cfg.agent, .memory_mb = cfg.memory_mb, .pids = cfg.pids,
      .overlay_mb = cfg.overlay_mb, .ns_uid_base = cfg.ns_uid_base,
  };
  struct sandbox *sb = NULL;
  struct agent_conn *conn = NULL;
  _cleanup_free_ char *err = NULL, *why = NULL;
  struct agent_exec_res res = {0};
  int rc = sandbox_ns_ops.create(&sc, "doctor", &sb, &err);
  if (rc == 0)
    rc = agent_conn_open(sb->fd, 30000, &conn, &err);
  if (rc == 0)
    rc = sb->ops->ready(sb, conn, &err);
  if (rc == 0) {
    struct agent_exec_req req = {
        .command = "id -u && echo ok > /root/.ign-doctor && cat /root/.ign-doctor",
        .timeout_ms = 30000, .out_cap = 4096};
    rc = agent_exec(conn, &req, &(struct agent_ctl){0}, &res, &err);
    if (rc == 0 && (res.exit_code != 0 || res.out_len != 5 || memcmp(res.out, "0\nok\n", 5) != 0)) {
      err = xasprintf("a command in it did not run as root with a writable /root: exit %d, "
                      "stdout '%.*s', stderr '%.*s'",
                      res.exit_code, (int)res.out_len, res.out, (int)res.err_len, res.err);
      rc = -EIO;
    }
  }
  if (rc < 0 && sb && sb->ops->death_reason)
    why = sb->ops->death_reason(sb);
  if (rc < 0) {
    add(r, FOR_NS, "sandbox", ST_FAIL,
        xasprintf("a sandbox started as open_session would start one does not work: %s%s%s",
                  err ? err : strerror(-rc), why ? "; " : "", why ? why : ""),
        strdup("see the message; `IGN_MCP_LOG=debug ignition-mcp doctor` shows more"));
  } else {
    json_t *uid = json_object_get(sb->info, "host_uid");
    add(r, FOR_NS, "sandbox", ST_OK,
        xasprintf("started one as open_session does (as host uid %lld%s) and ran a command in it; "
                  "limits: %s",
                  uid ? (long long)json_integer_value(uid) : -1LL,
                  ns_as_root() ? ", rootfs idmapped" : "", sb->limits),
        NULL);
  }
  agent_exec_res_free(&res);
  agent_conn_free(conn);
  if (sb)
    sb->ops->destroy(sb);
}

/* ---- both ---- */

static void check_seccomp(struct report *r) {
  static const struct {
    unsigned action;
    const char *name;
  } actions[] = {{SECCOMP_RET_KILL_PROCESS, "kill_process"}, {SECCOMP_RET_ERRNO, "errno"}};
  if (prctl(PR_GET_SECCOMP) < 0) {
    add(r, FOR_VM | FOR_NS, "seccomp", ST_FAIL,
        xasprintf("the kernel has no seccomp (%s): the agent's filter (ns) and QEMU's -sandbox "
                  "(vm) need it",
                  strerror(errno)),
        strdup("boot a kernel with CONFIG_SECCOMP_FILTER=y"));
    return;
  }
  for (size_t i = 0; i < ARRAY_SIZE(actions); i++) {
    unsigned a = actions[i].action;
    if (syscall(SYS_seccomp, SECCOMP_GET_ACTION_AVAIL, 0, &a) < 0) {
      add(r, FOR_VM | FOR_NS, "seccomp", ST_FAIL,
          xasprintf("seccomp filters cannot use the %s action (%s): the agent's filter and "
                    "QEMU's -sandbox need it",
                    actions[i].name, strerror(errno)),
          strdup("boot a kernel with CONFIG_SECCOMP_FILTER=y (Linux 4.14 or later)"));
      return;
    }
  }
  add(r, FOR_VM | FOR_NS, "seccomp", ST_OK,
      strdup("filters available (the agent's filter and QEMU's -sandbox)"), NULL);
}

/* The network policy (IGN_MCP_NET and the broker's bounds), and whether a
 * sandbox can route its traffic to the broker at all: `ign-agent
 * --probe-egress` installs the capture (routes, nf_tables redirect) in a
 * throw-away network namespace as a sandbox's agent does and prints "ok" or
 * why not.  Without it a session has no egress whatever it asks: a warning,
 * since sessions still open.  (It checks this host's kernel, which is what
 * ns sandboxes use; a microVM's guest kernel brings its own modules.) */
static void check_egress(struct report *r) {
  _cleanup_free_ char *policy = xasprintf(
      "IGN_MCP_NET=%s (%s), private networks %s%s%s, %u connections and %u MiB each way per "
      "session, %u names under each wildcard rule",
      config_net_name(),
      cfg.net == NET_OFF   ? "sessions have no network"
      : cfg.net == NET_OPEN ? "sessions may ask none, allow or open"
                            : "sessions may ask none or allow",
      cfg.net_host      ? "and this host allowed (IGN_MCP_NET_PRIVATE=host)"
      : cfg.net_private ? "allowed (IGN_MCP_NET_PRIVATE=1), this host refused"
                        : "and this host refused",
      cfg.egress_hosts ? ", hosts file " : "", cfg.egress_hosts ? cfg.egress_hosts : "",
      cfg.egress_streams, cfg.egress_max_mb, cfg.egress_wildcard_names);
  if (cfg.net == NET_OFF) {
    add(r, FOR_VM | FOR_NS, "egress", ST_OK, xasprintf("%s; capture not checked", policy), NULL);
    return;
  }
  if (!cfg.agent) {
    add(r, FOR_VM | FOR_NS, "egress", ST_WARN,
        xasprintf("%s; capture not checked: ign-agent is missing", policy),
        strdup("see the agent line"));
    return;
  }
  char out[512];
  int st = run_capture((char *const[]){cfg.agent, "--probe-egress", NULL}, out, sizeof out);
  /* The first line is the answer (an agent without the option prints
   * getopt's complaint there). */
  out[strcspn(out, "\n")] = '\0';
  if (st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0 && strcmp(out, "ok") == 0) {
    add(r, FOR_VM | FOR_NS, "egress", ST_OK,
        xasprintf("%s; capture works (routes and nf_tables redirect in a fresh network "
                  "namespace)", policy),
        NULL);
    return;
  }
  _cleanup_free_ char *why =
      st < 0 ? xasprintf("%s --probe-egress could not run: %s", cfg.agent, strerror(-st))
      : out[0] ? xasprintf("%s --probe-egress: %s", cfg.agent, out)
               : xasprintf("%s --probe-egress failed without a word (status %d)", cfg.agent, st);
  add(r, FOR_VM | FOR_NS, "egress", ST_WARN,
      xasprintf("%s; but a sandbox cannot route its traffic to the broker here, so sessions "
                "have no egress at all, whatever they ask: %s",
                policy, why),
      strdup("run the server on a kernel with nf_tables and its NAT redirect (CONFIG_NF_TABLES, "
             "CONFIG_NF_TABLES_INET, CONFIG_NFT_NAT, CONFIG_NFT_REDIR, CONFIG_NF_NAT) that allows "
             "them in user namespaces, and an ign-agent that knows --probe-egress (make); or set "
             "IGN_MCP_NET=off to say that sessions have no network"));
}

/* ---- the report ---- */

static bool blocks(const struct check *c, unsigned backend) {
  return (c->for_backends & backend) && (c->status == ST_MISSING || c->status == ST_FAIL);
}

/* Does a check for BACKENDS matter to the configured backend? */
static bool backend_wanted(unsigned backends) {
  return cfg.backend == BACKEND_AUTO || (cfg.backend == BACKEND_VM && (backends & FOR_VM)) ||
         (cfg.backend == BACKEND_NS && (backends & FOR_NS));
}

/* TRY: start a trial session of the vm backend (doctor itself, not the
 * explanation added to a failed open_session, which must answer soon). */
static void run_checks(struct report *r, bool try) {
  memset(r, 0, sizeof *r);
  check_qemu(r);
  check_kvm(r);
  bool inputs = check_vm_file(r, "kernel", cfg.kernel, "IGN_MCP_KERNEL");
  inputs &= check_vm_file(r, "initramfs", cfg.initramfs, "IGN_MCP_INITRAMFS");
  inputs &= check_vm_image(r);
  check_store(r);
  check_base(r, inputs && cfg.qemu);
  check_landlock(r);
  size_t first_ns = r->n;
  check_agent(r);
  check_rootfs(r);
  check_namespaces(r);
  bool ns_parts = true;
  for (size_t i = first_ns; i < r->n; i++)
    ns_parts &= !blocks(&r->c[i], FOR_NS);
  check_cgroups(r);
  check_sandbox(r, ns_parts);
  check_seccomp(r);
  check_egress(r);
  if (try)
    check_session(r, backend_wanted(FOR_VM));
  r->vm_ready = r->ns_ready = true;
  for (size_t i = 0; i < r->n; i++) {
    if (blocks(&r->c[i], FOR_VM))
      r->vm_ready = false;
    if (blocks(&r->c[i], FOR_NS))
      r->ns_ready = false;
  }
  /* Ready only once a session has really started. */
  if (try && !r->vm_tried)
    r->vm_ready = false;
}

/* The backend sessions would open on, or NULL. */
static const char *chosen_backend(const struct report *r) {
  if (cfg.backend != BACKEND_NS && r->vm_ready)
    return "vm";
  if (cfg.backend != BACKEND_VM && r->ns_ready)
    return "ns";
  return NULL;
}

static char *not_ready_list(const struct report *r, unsigned backend) {
  char buf[512] = "";
  for (size_t i = 0; i < r->n; i++)
    if (blocks(&r->c[i], backend)) {
      size_t n = strlen(buf);
      snprintf(buf + n, sizeof buf - n, "%s%s", n ? ", " : "", r->c[i].name);
    }
  return strdup(buf);
}

static void print_section(const struct report *r, unsigned backend, const char *title) {
  printf("\n%s%s\n", title, backend_wanted(backend) ? "" : " (not used: IGN_MCP_BACKEND says otherwise)");
  for (size_t i = 0; i < r->n; i++) {
    const struct check *c = &r->c[i];
    if (c->for_backends != backend)
      continue;
    printf("  %-7s %-10s %s%s%s\n", status_words[c->status], c->name, c->found,
           c->fix ? "; fix: " : "", c->fix ? c->fix : "");
  }
}

static void print_text(const struct report *r) {
  printf("ignition-mcp %s doctor: IGN_MCP_BACKEND=%s, rootfs %s, running as %s\n", IGN_VERSION,
         config_backend_name(), cfg.rootfs_spec, getuid() == 0 ? "root" : "a user");
  print_section(r, FOR_VM, "microVM backend (vm)");
  print_section(r, FOR_NS, "namespace backend (ns)");
  print_section(r, FOR_VM | FOR_NS, "both");
  printf("\n");
  _cleanup_free_ char *vm_missing = not_ready_list(r, FOR_VM);
  _cleanup_free_ char *ns_missing = not_ready_list(r, FOR_NS);
  if (r->vm_ready)
    printf("vm: ready: sessions are QEMU microVMs under %s (isolation microvm/%s); a trial "
           "session started\n",
           strcmp(r->accel, "kvm") == 0 ? "KVM" : "TCG", r->accel);
  else if (!backend_wanted(FOR_VM))
    printf("vm: not tried (IGN_MCP_BACKEND=%s)\n", config_backend_name());
  else
    printf("vm: cannot open sessions: fix %s above\n", vm_missing);
  if (r->ns_ready)
    printf("ns: ready: sessions are namespace sandboxes (isolation namespace)\n");
  else
    printf("ns: cannot open sessions: fix %s above\n", ns_missing);
  const char *chosen = chosen_backend(r);
  if (chosen)
    printf("sessions can open: IGN_MCP_BACKEND=%s uses the %s backend\n", config_backend_name(),
           chosen);
  else
    printf("sessions cannot open with IGN_MCP_BACKEND=%s: fix what is marked missing or fail "
           "above, then restart the server\n",
           config_backend_name());
}

static void print_json(const struct report *r) {
  json_t *checks = json_array();
  for (size_t i = 0; i < r->n; i++) {
    const struct check *c = &r->c[i];
    const char *b = c->for_backends == FOR_VM ? "vm" : c->for_backends == FOR_NS ? "ns" : "both";
    json_t *o = json_pack("{s:s, s:s, s:s, s:s}", "backend", b, "name", c->name, "status",
                          status_words[c->status], "found", c->found);
    json_object_set_new(o, "fix", c->fix ? json_string(c->fix) : json_null());
    json_array_append_new(checks, o);
  }
  const char *chosen = chosen_backend(r);
  /* What microVMs run under, why, and what the KVM probe measured. */
  struct vm_kvm_probe p;
  _cleanup_free_ char *probe_err = NULL, *probe_text = vm_kvm_probe_text();
  json_t *probe = json_null();
  if (vm_kvm_probe_last(&p, &probe_err))
    probe = json_pack("{s:i, s:i, s:b, s:b, s:f, s:f}", "loops", (json_int_t)p.loops, "budget_ms",
                      (json_int_t)p.budget_ms, "finished", p.finished, "stuck", p.stuck, "run_ms",
                      p.run_ns / 1e6, "setup_ms", p.setup_ns / 1e6);
  else if (probe_err)
    probe = json_pack("{s:s}", "error", probe_err);
  json_t *accel = json_pack("{s:o, s:o, s:o, s:o}", "decision",
                            r->accel ? json_string(r->accel) : json_null(), "reason",
                            json_string(r->accel && strcmp(r->accel, "kvm") == 0
                                            ? (probe_text ? probe_text : "/dev/kvm works")
                                        : r->accel_why ? r->accel_why
                                                       : "KVM cannot be used"),
                            "why_not_kvm", r->accel_why ? json_string(r->accel_why) : json_null(),
                            "kvm_probe", probe);
  json_t *out = json_pack("{s:s, s:s, s:s, s:o, s:o, s:{s:b, s:b}, s:o, s:b}", "version",
                          IGN_VERSION, "backend_setting", config_backend_name(), "rootfs",
                          cfg.rootfs_spec, "checks", checks, "accel", accel, "ready", "vm",
                          r->vm_ready, "ns", r->ns_ready,
                          "backend", chosen ? json_string(chosen) : json_null(),
                          "sessions_can_open", chosen != NULL);
  char *s = json_dumps(out, JSON_INDENT(2));
  if (s)
    printf("%s\n", s);
  free(s);
  json_decref(out);
}

int doctor_main(bool as_json) {
  /* The sandbox check talks to an agent that may die at any moment (that
   * is what it checks): a write to its socket must fail with EPIPE, not
   * kill us.  The server ignores SIGPIPE for the same reason. */
  signal(SIGPIPE, SIG_IGN);
  struct report r;
  run_checks(&r, true);
  if (as_json)
    print_json(&r);
  else
    print_text(&r);
  fflush(stdout);
  int status = chosen_backend(&r) ? 0 : 1;
  report_free(&r);
  return status;
}

char *doctor_explain(void) {
  log_debug("running the doctor's checks to explain why no sandbox backend can run");
  struct report r;
  run_checks(&r, false);
  char *text = xasprintf("What `ignition-mcp doctor` finds for IGN_MCP_BACKEND=%s:",
                         config_backend_name());
  size_t shown = 0;
  for (size_t i = 0; i < r.n; i++) {
    const struct check *c = &r.c[i];
    bool relevant = (backend_wanted(FOR_VM) && blocks(c, FOR_VM)) ||
                    (backend_wanted(FOR_NS) && blocks(c, FOR_NS));
    if (!relevant)
      continue;
    shown++;
    char *more = xasprintf("%s\n- %s %s: %s%s%s", text, status_words[c->status], c->name,
                           c->found, c->fix ? "; fix: " : "", c->fix ? c->fix : "");
    free(text);
    text = more;
  }
  if (shown == 0) {
    char *more = xasprintf("%s none of its checks fails now, so what failed above when the server "
                           "started is either fixed since (restart the MCP server) or not one "
                           "it checks (fix that, then restart the server).",
                           text);
    free(text);
    report_free(&r);
    return more;
  }
  char *more = xasprintf("%s\nFix these, then restart the MCP server (in Claude Code: /mcp, "
                         "reconnect); `ignition-mcp doctor` checks again.",
                         text);
  free(text);
  report_free(&r);
  return more;
}
