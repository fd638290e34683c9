/* confine.c: the privilege drop that ends a namespace sandbox's setup.
 *
 * uid stays 0 inside (tools expect root), but root stops meaning anything:
 *   - open files are capped per process (CONFINE_MAX_OPEN_FILES), for good;
 *   - securebits NOROOT (locked): execve no longer grants root capabilities;
 *   - the bounding set is emptied, ambient cleared, and capset() zeroes the
 *     effective, permitted and inheritable sets of the agent itself;
 *   - not dumpable: commands (same uid) cannot ptrace the agent or open its
 *     /proc entries, and so cannot reach the channel;
 *   - no_new_privs, then a seccomp filter (default allow) that refuses the
 *     syscalls which change mounts, namespaces, the kernel or the clock,
 *     even if a capability came back through a kernel bug, and the kernel
 *     interfaces a sandbox has no use for (io_uring, vsock and other socket
 *     families, uevents, bpf, keyrings, ...): the table in confine.h.
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
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/util.h"
#include "guest/agent_core.h"
#include "guest/confine.h"
#include "guest/ns_setup.h"

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
  struct confine_rule rules[CONFINE_MAX_RULES];
  size_t n = confine_rules(rules, ARRAY_SIZE(rules));
  if (n > ARRAY_SIZE(rules)) {
    agent_log("the seccomp deny list has %zu rules, over CONFINE_MAX_RULES", n);
    return -E2BIG;
  }
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
  if (!ctx) {
    agent_log("cannot create the seccomp filter");
    return -ENOMEM;
  }
  const struct confine_rule *failed = NULL;
  int r = seccomp_attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS);
  for (size_t i = 0; r >= 0 && i < n; i++) {
    struct scmp_arg_cmp cmp[2];
    for (unsigned k = 0; k < rules[i].n_cmp; k++) {
      const struct confine_cmp *c = &rules[i].cmp[k];
      cmp[k] = c->op == CONFINE_GE
                   ? (struct scmp_arg_cmp){.arg = c->arg, .op = SCMP_CMP_GE, .datum_a = c->datum}
                   : (struct scmp_arg_cmp){.arg = c->arg, .op = SCMP_CMP_MASKED_EQ,
                                           .datum_a = c->mask, .datum_b = c->datum};
    }
    r = seccomp_rule_add_array(ctx, SCMP_ACT_ERRNO(rules[i].err), (int)rules[i].nr,
                               rules[i].n_cmp, cmp);
    if (r < 0)
      failed = &rules[i];
  }
  if (r >= 0)
    r = seccomp_load(ctx);
  if (failed)
    agent_log("cannot install the seccomp filter: its rule for %s%s%s%s: %s", failed->name,
              failed->what ? "(" : "", failed->what ? failed->what : "", failed->what ? ")" : "",
              strerror(-r));
  else if (r < 0)
    agent_log("cannot install the seccomp filter: %s", strerror(-r));
  seccomp_release(ctx);
  return r;
}

int confine_drop_privileges(void) {
  struct rlimit nofile = {CONFINE_MAX_OPEN_FILES, CONFINE_MAX_OPEN_FILES};
  if (setrlimit(RLIMIT_NOFILE, &nofile) < 0) {
    int err = errno;
    agent_log("cannot limit open files to %d: %s", CONFINE_MAX_OPEN_FILES, strerror(err));
    return -err;
  }
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
