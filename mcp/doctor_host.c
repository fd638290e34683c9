/* doctor_host.c: the doctor's checks of this host's kernel and settings:
 * KVM (the vm backend's accelerator decision), Landlock, the namespaces the
 * ns backend makes (and, as root, whether an account has a uid in the
 * sessions' uid blocks), cgroups (a real test group with the session
 * limits, made and removed), seccomp, and egress (the network policy, and
 * whether a sandbox's capture works: `ign-agent --probe-egress` in a
 * throw-away network namespace).  Of these only the cgroup check changes
 * the host (doctor.c says how). */
#include <errno.h>
#include <linux/landlock.h>
#include <linux/seccomp.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/config.h"
#include "common/proc.h"
#include "common/util.h"
#include "mcp/doctor_int.h"
#include "sandbox/sandbox.h"
#include "sandbox/vm.h"

void doctor_check_kvm(struct report *r) {
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

void doctor_check_landlock(struct report *r) {
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
void doctor_check_namespaces(struct report *r) {
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
void doctor_check_cgroups(struct report *r) {
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

void doctor_check_seccomp(struct report *r) {
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
void doctor_check_egress(struct report *r) {
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
  int st = proc_run_capture((char *const[]){cfg.agent, "--probe-egress", NULL}, out, sizeof out, DOCTOR_RUN_MS);
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
