/* confine.h: the seccomp deny list of a namespace sandbox, in one table.
 *
 * confine.c builds the filter from confine_rules(); the tests probe the very
 * same list entry by entry (tests/unit/test_agent_ns.c loads the filter of a
 * live sandbox into a process that keeps every capability;
 * tests/e2e/seccomp-probe.c runs inside a session), so a rule added here is
 * tested without anyone writing a test for it, and the tests cannot drift
 * from the filter.
 *
 * The filter is a deny list (default allow), the complement of Docker's
 * default profile where that matters to us; each entry says why it is here.
 * Kept deliberately allowed, with the reason:
 *   - ptrace, process_vm_readv/writev (Docker allows them too), kcmp,
 *     pidfd_getfd: debuggers and strace need them; they reach only processes
 *     of the same sandbox (its own pid namespace, no capabilities) and never
 *     the agent, which is not dumpable; the seccomp bypass through ptrace was
 *     closed in Linux 4.8;
 *   - personality: gdb turns off address randomization with it; the one
 *     dangerous flag, MMAP_PAGE_ZERO, is void without CAP_SYS_RAWIO;
 *   - mbind, get_mempolicy, set_mempolicy, set_mempolicy_home_node,
 *     move_pages: NUMA placement of one's own memory; moving another
 *     process's pages needs CAP_SYS_NICE;
 *   - fanotify_init: without CAP_SYS_ADMIN only its limited mode, which
 *     watches what the caller may read anyway;
 *   - socket families AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK (but
 *     NETLINK_KOBJECT_UEVENT): what programs use on a machine that has only
 *     a loopback interface.  Every other family is refused: AF_VSOCK reaches
 *     the hypervisor's or the host's vsock services whatever the network
 *     namespace, AF_PACKET needs a capability anyway, and the rest (AF_RDS,
 *     AF_TIPC, AF_CAN, AF_ALG, ...) are rarely used code, loaded as a module
 *     on first use, with a long history of escapes.
 * Syscalls newer than this table (a default-allow filter cannot know them)
 * stay allowed: the capabilities are what stands in their way.
 *
 * Each entry carries probe arguments: arguments that make the kernel's own
 * checks fail (EFAULT, EINVAL, EBADF, ...) before the call has any effect,
 * even for root with every capability.  So a probe the filter lets through
 * does nothing, and gives an errno other than the filter's. */
#pragma once

#include <errno.h>
#include <linux/netlink.h>
#include <stdbool.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef CLONE_NEWCGROUP
#define CLONE_NEWCGROUP 0x02000000
#endif
/* Linux 6.15, newer than some C libraries' headers: 467 on every
 * architecture but alpha, whose numbers are its own. */
#if !defined(__NR_open_tree_attr) && !defined(__alpha__)
#define __NR_open_tree_attr 467
#endif

enum confine_cmp_op {
  CONFINE_MASKED_EQ, /* (arg & mask) == datum */
  CONFINE_GE,        /* arg >= datum, all 64 bits */
};

struct confine_cmp {
  unsigned arg;
  enum confine_cmp_op op;
  uint64_t mask, datum;
};

struct confine_rule {
  const char *name;  /* the syscall */
  const char *what;  /* the arguments it applies to ("AF_VSOCK"), or NULL: every call */
  long nr;           /* its number on this architecture */
  int err;           /* the errno the filter answers */
  unsigned n_cmp;    /* conditions that must all hold */
  struct confine_cmp cmp[2];
  long probe[6];
};

#define CONFINE_MAX_RULES 256

/* Open files per process (RLIMIT_NOFILE, soft and hard; raising it needs
 * CAP_SYS_RESOURCE, which is gone).  With the session's pids limit this
 * bounds the files a session holds in its file tables: the host's file
 * table (fs.file-max) is shared with every other process, and without it a
 * session could fill it within its memory limit.  The agent itself needs
 * fewer than 400 (the caps in exec_int.h, files_int.h, tree_int.h and
 * egress_int.h). */
#define CONFINE_MAX_OPEN_FILES 1024

/* Ints are compared on their low 32 bits: the kernel ignores the upper ones,
 * so a filter comparing all 64 could be passed with 1 << 32 | AF_VSOCK. */
#define CONFINE_INT_EQ(a, v) \
  {.arg = (a), .op = CONFINE_MASKED_EQ, .mask = 0xffffffffu, .datum = (uint64_t)(v)}

#define CONFINE_DENY(sys, ...) \
  {.name = #sys, .nr = __NR_##sys, .err = EPERM, .probe = {__VA_ARGS__}}

/* The syscalls refused whatever their arguments. */
static const struct confine_rule confine_plain_rules[] = {
    /* Mounts and the root: the sandbox's view of the filesystem is fixed. */
    CONFINE_DENY(mount, 1, 1, 1, 0, 1),
    CONFINE_DENY(umount2, 0, -1),
    CONFINE_DENY(pivot_root, 1, 1),
    CONFINE_DENY(fsopen, 0, -1),
    CONFINE_DENY(fsconfig, -1, -1, 0, 0, 0),
    CONFINE_DENY(fsmount, -1, -1, 0),
    CONFINE_DENY(fspick, -1, 1, -1),
    CONFINE_DENY(move_mount, -1, 1, -1, 1, -1),
    CONFINE_DENY(open_tree, -1, 1, -1),
    CONFINE_DENY(mount_setattr, -1, 1, -1, 0, 0),
#ifdef __NR_open_tree_attr
    CONFINE_DENY(open_tree_attr, -1, 1, -1, 0, 0),
#endif
    /* Namespaces: a user namespace would give capabilities back. */
    CONFINE_DENY(setns, -1, 0),
    CONFINE_DENY(unshare, -1),
    /* The machine and the kernel. */
    CONFINE_DENY(swapon, 0, -1),
    CONFINE_DENY(swapoff, 1),
    CONFINE_DENY(reboot, 0, 0, 0, 0),
    CONFINE_DENY(kexec_load, 0, 0, 0, -1),
    CONFINE_DENY(kexec_file_load, -1, -1, 0, 0, -1),
    CONFINE_DENY(init_module, 1, 0, 1),
    CONFINE_DENY(finit_module, -1, 1, -1),
    CONFINE_DENY(delete_module, 1, 0),
#ifdef __NR_iopl
    CONFINE_DENY(iopl, 4),
#endif
#ifdef __NR_ioperm
    CONFINE_DENY(ioperm, 0, 0, 1),
#endif
    CONFINE_DENY(acct, 1),
    CONFINE_DENY(quotactl, 0, 1, 0, 0),
    CONFINE_DENY(quotactl_fd, -1, 0, 0, 0),
    /* Without a controlling terminal (the probe's case) it does nothing. */
    CONFINE_DENY(vhangup, 0),
    /* The clock is the host's. */
    CONFINE_DENY(settimeofday, 1, 0),
    CONFINE_DENY(clock_settime, 100, 1),
    CONFINE_DENY(clock_adjtime, 100, 1),
    CONFINE_DENY(adjtimex, 1),
    /* Kernel introspection and attack surface. */
    CONFINE_DENY(syslog, 100, 0, 0),
    CONFINE_DENY(bpf, 1000, 0, 0),
    CONFINE_DENY(perf_event_open, 0, 0, 0, -1, -1),
    CONFINE_DENY(userfaultfd, -1),
#ifdef __NR_lookup_dcookie
    CONFINE_DENY(lookup_dcookie, 0, 0, 0),
#endif
    /* io_uring runs requests in kernel workers, around the filter, and has
     * been the source of many escapes (Docker refuses it too). */
    CONFINE_DENY(io_uring_setup, 0, 1),
    CONFINE_DENY(io_uring_enter, -1, 0, 0, 0, 0, 0),
    CONFINE_DENY(io_uring_register, -1, 0, 0, 0),
    /* File handles bypass path lookup (the shocker escape). */
    CONFINE_DENY(open_by_handle_at, -1, 1, -1),
    CONFINE_DENY(name_to_handle_at, -1, 1, 1, 1, -1),
    /* The kernel keyring is not namespaced. */
    CONFINE_DENY(keyctl, 1000, 0, 0, 0, 0),
    CONFINE_DENY(add_key, 1, 1, 0, 0, 0),
    CONFINE_DENY(request_key, 1, 1, 1, 0),
    /* Obsolete interfaces, as in Docker's profile: the a.out loader, binary
     * sysctl (which writes kernel settings around the read-only /proc/sys),
     * the old module calls, and two that tell about the host's filesystems.
     * Most answer ENOSYS on a current kernel; where one is built in, it is
     * attack surface nothing uses. */
#ifdef __NR_uselib
    CONFINE_DENY(uselib, 1),
#endif
#ifdef __NR__sysctl
    CONFINE_DENY(_sysctl, 1),
#endif
#ifdef __NR_ustat
    CONFINE_DENY(ustat, 0, 1),
#endif
#ifdef __NR_sysfs
    CONFINE_DENY(sysfs, 100, 0, 0),
#endif
#ifdef __NR_nfsservctl
    CONFINE_DENY(nfsservctl, 0, 0, 0),
#endif
#ifdef __NR_create_module
    CONFINE_DENY(create_module, 1, 0),
#endif
#ifdef __NR_get_kernel_syms
    CONFINE_DENY(get_kernel_syms, 1),
#endif
#ifdef __NR_query_module
    CONFINE_DENY(query_module, 1, 0, 0, 0, 0),
#endif
};

/* clone() may not create namespaces: one rule per flag, since a rule cannot
 * test "any of these bits".  The probe adds CLONE_SIGHAND without CLONE_VM,
 * which the kernel refuses (EINVAL) before it creates anything. */
static const struct {
  const char *what;
  uint64_t flag;
} confine_clone_flags[] = {
    {"CLONE_NEWNS", CLONE_NEWNS},         {"CLONE_NEWCGROUP", CLONE_NEWCGROUP},
    {"CLONE_NEWUTS", CLONE_NEWUTS},       {"CLONE_NEWIPC", CLONE_NEWIPC},
    {"CLONE_NEWUSER", CLONE_NEWUSER},     {"CLONE_NEWPID", CLONE_NEWPID},
    {"CLONE_NEWNET", CLONE_NEWNET},
};

/* The socket families a sandbox may use (see the top of the file). */
static inline bool confine_family_allowed(uint64_t family) {
  return family == AF_UNIX || family == AF_INET || family == AF_INET6 || family == AF_NETLINK;
}

static const char *const confine_family_names[] = {
    "AF_UNSPEC", "AF_UNIX", "AF_INET", "AF_AX25", "AF_IPX", "AF_APPLETALK", "AF_NETROM",
    "AF_BRIDGE", "AF_ATMPVC", "AF_X25", "AF_INET6", "AF_ROSE", "AF_DECnet", "AF_NETBEUI",
    "AF_SECURITY", "AF_KEY", "AF_NETLINK", "AF_PACKET", "AF_ASH", "AF_ECONET", "AF_ATMSVC",
    "AF_RDS", "AF_SNA", "AF_IRDA", "AF_PPPOX", "AF_WANPIPE", "AF_LLC", "AF_IB", "AF_MPLS",
    "AF_CAN", "AF_TIPC", "AF_BLUETOOTH", "AF_IUCV", "AF_RXRPC", "AF_ISDN", "AF_PHONET",
    "AF_IEEE802154", "AF_CAIF", "AF_ALG", "AF_NFC", "AF_VSOCK", "AF_KCM", "AF_QIPCRTR",
    "AF_SMC", "AF_XDP", "AF_MCTP",
};

static inline void confine_add(struct confine_rule *ret, size_t max, size_t *n,
                               struct confine_rule r) {
  if (*n < max)
    ret[(*n)++] = r;
}

/* Every rule of the filter, in the order they are added: RET gets at most MAX
 * of them.  Returns how many there are (more than MAX: the table outgrew
 * CONFINE_MAX_RULES). */
static inline size_t confine_rules(struct confine_rule *ret, size_t max) {
  size_t n = 0, want = 0;
  for (size_t i = 0; i < sizeof confine_plain_rules / sizeof *confine_plain_rules; i++, want++)
    confine_add(ret, max, &n, confine_plain_rules[i]);
  for (size_t i = 0; i < sizeof confine_clone_flags / sizeof *confine_clone_flags; i++, want++) {
    uint64_t f = confine_clone_flags[i].flag;
    struct confine_rule r = {
        .name = "clone", .what = confine_clone_flags[i].what, .nr = __NR_clone, .err = EPERM,
        .n_cmp = 1,
#if defined(__s390__) || defined(__s390x__)
        /* The flags come second there. */
        .cmp = {{.arg = 1, .op = CONFINE_MASKED_EQ, .mask = f, .datum = f}},
        .probe = {0, (long)(f | CLONE_SIGHAND)},
#else
        .cmp = {{.arg = 0, .op = CONFINE_MASKED_EQ, .mask = f, .datum = f}},
        .probe = {(long)(f | CLONE_SIGHAND)},
#endif
    };
    confine_add(ret, max, &n, r);
  }
  /* clone3 passes its flags in memory, out of a filter's reach: ENOSYS makes
   * libc fall back to clone(), which the rules above check. */
  want++;
  confine_add(ret, max, &n,
              (struct confine_rule){.name = "clone3", .nr = __NR_clone3, .err = ENOSYS,
                                    .probe = {1, 0}});
  /* Socket families.  The probe's type 999 is refused (EINVAL) before the
   * family's code is reached or its module loaded.  socketpair() creates a
   * socket of the family too (and loads its module) before it fails. */
  static const struct {
    const char *name;
    long nr;
  } sock_calls[] = {{"socket", __NR_socket}, {"socketpair", __NR_socketpair}};
  for (size_t c = 0; c < 2; c++) {
    for (uint64_t f = 0; f < AF_MAX; f++) {
      if (confine_family_allowed(f))
        continue;
      want++;
      confine_add(ret, max, &n,
                  (struct confine_rule){
                      .name = sock_calls[c].name,
                      .what = f < sizeof confine_family_names / sizeof *confine_family_names
                                  ? confine_family_names[f]
                                  : "a family of a newer kernel",
                      .nr = sock_calls[c].nr, .err = EPERM, .n_cmp = 1,
                      .cmp = {CONFINE_INT_EQ(0, f)}, .probe = {(long)f, 999, 0, 1}});
    }
    /* Families this table does not know yet, and any value with its upper
     * 32 bits set (the kernel would read only the lower ones). */
    want++;
    confine_add(ret, max, &n,
                (struct confine_rule){
                    .name = sock_calls[c].name, .what = "family>=AF_MAX",
                    .nr = sock_calls[c].nr, .err = EPERM, .n_cmp = 1,
                    .cmp = {{.arg = 0, .op = CONFINE_GE, .datum = AF_MAX}},
                    .probe = {(long)(1ull << 32 | AF_INET), 999, 0, 1}});
  }
  /* The host's device events (uevents) are broadcast to every network
   * namespace owned by the initial user namespace. */
  want++;
  confine_add(ret, max, &n,
              (struct confine_rule){.name = "socket", .what = "AF_NETLINK,NETLINK_KOBJECT_UEVENT",
                                    .nr = __NR_socket, .err = EPERM, .n_cmp = 2,
                                    .cmp = {CONFINE_INT_EQ(0, AF_NETLINK),
                                            CONFINE_INT_EQ(2, NETLINK_KOBJECT_UEVENT)},
                                    .probe = {AF_NETLINK, 999, NETLINK_KOBJECT_UEVENT}});
  return want;
}

/* Call R's syscall with its probe arguments: 0 if it succeeded, else the
 * errno.  A probe that unexpectedly created a process ends that process. */
static inline int confine_probe(const struct confine_rule *r) {
  long rc = syscall(r->nr, r->probe[0], r->probe[1], r->probe[2], r->probe[3], r->probe[4],
                    r->probe[5]);
  if (rc < 0)
    return errno;
  if (r->nr == __NR_clone && rc == 0)
    _exit(0);
  if (r->nr == __NR_socket || r->nr == __NR_io_uring_setup)
    close((int)rc);
  return 0;
}
