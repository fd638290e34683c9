/* confine.c: the privilege drop that ends a namespace sandbox's setup.
 *
 * uid stays 0 inside (tools expect root), but root stops meaning anything:
 *   - securebits NOROOT (locked): execve no longer grants root capabilities;
 *   - the bounding set is emptied, ambient cleared, and capset() zeroes the
 *     effective, permitted and inheritable sets of the agent itself;
 *   - not dumpable: commands (same uid) cannot ptrace the agent or open its
 *     /proc entries, and so cannot reach the channel;
 *   - no_new_privs, then a seccomp filter (default allow) that refuses the
 *     syscalls which change mounts, namespaces, the kernel or the clock,
 *     even if a capability came back through a kernel bug.
 * The filter is inherited by every command.  Syscalls of other
 * architectures (i386, x32) kill the process: the filter only knows our
 * own numbering. */
#include <errno.h>
#include <linux/capability.h>
#include <linux/securebits.h>
#include <sched.h>
#include <seccomp.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/util.h"
#include "guest/agent.h"

static const char *const confine_denied_syscalls[] = {
    /* mounts and the root */
    "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr",
    /* namespaces */
    "setns", "unshare",
    /* the machine and the kernel */
    "swapon", "swapoff", "reboot", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "iopl", "ioperm", "acct", "quotactl", "vhangup",
    /* the clock */
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    /* kernel introspection and attack surface */
    "syslog", "bpf", "perf_event_open", "userfaultfd", "lookup_dcookie",
    /* file handles bypass path lookup (the shocker escape) */
    "open_by_handle_at", "name_to_handle_at",
    /* the kernel keyring is not namespaced */
    "keyctl", "add_key", "request_key",
};

static const uint64_t confine_clone_ns_flags[] = {
    CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC,
    CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET,
};

static int confine_drop_caps(void) {
  /* Needs CAP_SETPCAP, so before the sets are cleared. */
  if (prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED |
                                   SECBIT_NO_CAP_AMBIENT_RAISE |
                                   SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED) < 0) {
    int err = errno;
    agent_log("cannot set securebits: %s", strerror(err));
    return -err;
  }
  for (unsigned long cap = 0; cap < 64; cap++) {
    if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0)
      continue;
    if (errno == EINVAL)
      break; /* past the kernel's last capability */
    int err = errno;
    agent_log("cannot drop capability %lu from the bounding set: %s", cap, strerror(err));
    return -err;
  }
  if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL) {
    int err = errno;
    agent_log("cannot clear the ambient capabilities: %s", strerror(err));
    return -err;
  }
  struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
  struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {0};
  if (syscall(SYS_capset, &hdr, data) < 0) {
    int err = errno;
    agent_log("cannot clear the capability sets: %s", strerror(err));
    return -err;
  }
  return 0;
}

static int confine_seccomp(void) {
  int r;
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
  if (!ctx) {
    agent_log("cannot create the seccomp filter");
    return -ENOMEM;
  }
  r = seccomp_attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS);
  if (r < 0)
    goto out;
  for (size_t i = 0; i < ARRAY_SIZE(confine_denied_syscalls); i++) {
    int nr = seccomp_syscall_resolve_name(confine_denied_syscalls[i]);
    if (nr == __NR_SCMP_ERROR)
      continue; /* not a syscall on this architecture (iopl on arm64) */
    r = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), nr, 0);
    if (r < 0)
      goto out;
  }
  /* clone() may not create namespaces (a user namespace would give back
   * capabilities); one rule per flag since a rule cannot test "any bit". */
  for (size_t i = 0; i < ARRAY_SIZE(confine_clone_ns_flags); i++) {
    uint64_t f = confine_clone_ns_flags[i];
#if defined(__s390__) || defined(__s390x__)
    struct scmp_arg_cmp cmp = SCMP_A1(SCMP_CMP_MASKED_EQ, f, f); /* flags come second there */
#else
    struct scmp_arg_cmp cmp = SCMP_A0(SCMP_CMP_MASKED_EQ, f, f);
#endif
    r = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(clone), 1, cmp);
    if (r < 0)
      goto out;
  }
  /* clone3 passes its flags in memory, out of a filter's reach: ENOSYS
   * makes libc fall back to clone(), which the rules above check. */
  r = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0);
  if (r < 0)
    goto out;
  r = seccomp_load(ctx);
out:
  if (r < 0)
    agent_log("cannot install the seccomp filter: %s", strerror(-r));
  seccomp_release(ctx);
  return r;
}

int confine_drop_privileges(void) {
  int r = confine_drop_caps();
  if (r < 0)
    return r;
  if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) {
    int err = errno;
    agent_log("cannot set dumpable=0 and no_new_privs: %s", strerror(err));
    return -err;
  }
  return confine_seccomp();
}
