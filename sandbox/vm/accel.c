/* accel.c: does KVM help on this host, and why (not).
 *
 * /dev/kvm existing and opening says little: a host may hand it out from a
 * paravirtual or nested hypervisor that runs guest kernel-mode code a
 * thousand times slower than native (measured on such a host: a stock guest
 * kernel took 22 s to print its first line under KVM, 0.4 s under TCG).
 * Booting a real guest to find out takes tens of seconds and answers late
 * and coarsely.  So this probe asks the question directly, with the KVM
 * ioctls: a VM with one vCPU in 64-bit long mode at ring 0 (what a guest
 * kernel runs in), a page of code that counts down a loop of
 * KVM_PROBE_LOOPS iterations, then OUT to a port and HLT.  On real KVM that
 * answers in about a millisecond; a host where it takes longer than
 * KVM_PROBE_BUDGET_MS runs guest kernels far slower than TCG would, and KVM
 * "does not help".  KVM_RUN runs on a thread of its own; at the deadline it
 * is kicked out with immediate_exit and a signal, and a vCPU that does not
 * come back even then is left behind (its thread detached) rather than
 * waited for: the probe never hangs its caller. */
#include <errno.h>
#include <grp.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <linux/kvm.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "sandbox/vm/internal.h"

#define GUEST_MEM (64 << 10)
#define CODE_ADDR 0x4000
#define PROBE_PORT 0x10
#define KICK_SIGNAL (SIGRTMIN + 6)

struct probe {
  int kvm, vm, vcpu;
  struct kvm_run *run;
  size_t run_size;
  void *mem;
  /* Shared with the vCPU thread, under lock. */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  bool done, abandoned;
  int result;              /* 0: the guest reached its OUT; or -errno */
  uint32_t exit_reason;
  uint64_t run_ns;
};

static void probe_free(struct probe *p) {
  if (p->run)
    munmap(p->run, p->run_size);
  if (p->mem)
    munmap(p->mem, GUEST_MEM);
  if (p->vcpu >= 0)
    close(p->vcpu);
  if (p->vm >= 0)
    close(p->vm);
  if (p->kvm >= 0)
    close(p->kvm);
  pthread_mutex_destroy(&p->lock);
  pthread_cond_destroy(&p->cond);
  free(p);
}

static void kick_handler(int sig) { (void)sig; }

/* Identity-mapped page tables for the first 2 MiB (one large page), the
 * loop, and the vCPU in long mode at ring 0. */
static int setup_guest(struct probe *p, uint32_t loops, char **ret_err) {
  uint8_t *m = p->mem;
  uint64_t *pml4 = (uint64_t *)(m + 0x1000), *pdpt = (uint64_t *)(m + 0x2000),
           *pd = (uint64_t *)(m + 0x3000);
  pml4[0] = 0x2000 | 3;  /* present, writable */
  pdpt[0] = 0x3000 | 3;
  pd[0] = 0 | 0x83;      /* present, writable, 2 MiB page */
  const uint8_t code[] = {
      0xb9, (uint8_t)loops, (uint8_t)(loops >> 8), (uint8_t)(loops >> 16),
      (uint8_t)(loops >> 24),       /* mov ecx, loops */
      0xff, 0xc9,                   /* 1: dec ecx */
      0x75, 0xfc,                   /* jnz 1b */
      0xb0, 0x2a,                   /* mov al, 42 */
      0xe6, PROBE_PORT,             /* out PROBE_PORT, al */
      0xf4,                         /* hlt */
  };
  memcpy(m + CODE_ADDR, code, sizeof code);

  struct kvm_userspace_memory_region region = {
      .slot = 0, .guest_phys_addr = 0, .memory_size = GUEST_MEM, .userspace_addr = (uintptr_t)m};
  if (ioctl(p->vm, KVM_SET_USER_MEMORY_REGION, &region) < 0) {
    *ret_err = xasprintf("KVM_SET_USER_MEMORY_REGION: %s", strerror(errno));
    return -errno;
  }
  /* Long mode needs the LM bit in the guest's CPUID. */
  enum { N_CPUID = 256 };
  _cleanup_free_ struct kvm_cpuid2 *cpuid =
      calloc(1, sizeof *cpuid + N_CPUID * sizeof(struct kvm_cpuid_entry2));
  if (!cpuid)
    return -ENOMEM;
  cpuid->nent = N_CPUID;
  if (ioctl(p->kvm, KVM_GET_SUPPORTED_CPUID, cpuid) < 0 ||
      ioctl(p->vcpu, KVM_SET_CPUID2, cpuid) < 0) {
    *ret_err = xasprintf("setting the vCPU's CPUID: %s", strerror(errno));
    return -errno;
  }
  struct kvm_sregs sregs;
  if (ioctl(p->vcpu, KVM_GET_SREGS, &sregs) < 0) {
    *ret_err = xasprintf("KVM_GET_SREGS: %s", strerror(errno));
    return -errno;
  }
  struct kvm_segment cs = {.base = 0, .limit = 0xffffffff, .selector = 8, .type = 11,
                           .present = 1, .dpl = 0, .db = 0, .s = 1, .l = 1, .g = 1};
  struct kvm_segment ds = cs;
  ds.type = 3;
  ds.selector = 16;
  ds.l = 0;
  ds.db = 1;
  sregs.cs = cs;
  sregs.ds = sregs.es = sregs.fs = sregs.gs = sregs.ss = ds;
  sregs.cr3 = 0x1000;
  sregs.cr4 = 1u << 5;                               /* PAE */
  sregs.cr0 = 1u | (1u << 4) | (1u << 5) | (1u << 31); /* PE, ET, NE, PG */
  sregs.efer = (1u << 8) | (1u << 10);               /* LME, LMA */
  if (ioctl(p->vcpu, KVM_SET_SREGS, &sregs) < 0) {
    *ret_err = xasprintf("KVM_SET_SREGS (long mode): %s", strerror(errno));
    return -errno;
  }
  struct kvm_regs regs = {.rip = CODE_ADDR, .rflags = 2, .rsp = 0x1000};
  if (ioctl(p->vcpu, KVM_SET_REGS, &regs) < 0) {
    *ret_err = xasprintf("KVM_SET_REGS: %s", strerror(errno));
    return -errno;
  }
  return 0;
}

static void *vcpu_thread(void *arg) {
  struct probe *p = arg;
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, KICK_SIGNAL);
  pthread_sigmask(SIG_UNBLOCK, &set, NULL);
  uint64_t t0 = now_ns(CLOCK_MONOTONIC);
  int r = 0;
  for (;;) {
    if (ioctl(p->vcpu, KVM_RUN, 0) < 0) {
      r = -errno;
      break;
    }
    if (p->run->exit_reason == KVM_EXIT_IO && p->run->io.port == PROBE_PORT)
      break;
    /* Anything else (a hypervisor's own exits): go on, the deadline bounds it. */
    if (p->run->exit_reason != KVM_EXIT_INTR && p->run->exit_reason != KVM_EXIT_IO) {
      r = -EIO;
      break;
    }
  }
  uint64_t t1 = now_ns(CLOCK_MONOTONIC);
  pthread_mutex_lock(&p->lock);
  p->result = r;
  p->exit_reason = p->run->exit_reason;
  p->run_ns = t1 - t0;
  p->done = true;
  bool abandoned = p->abandoned;
  pthread_cond_broadcast(&p->cond);
  pthread_mutex_unlock(&p->lock);
  if (abandoned)
    probe_free(p);
  return NULL;
}

int vm_kvm_probe(uint32_t loops, unsigned budget_ms, struct vm_kvm_probe *ret, char **ret_err) {
  struct probe *p = calloc(1, sizeof *p);
  if (!p)
    return -ENOMEM;
  p->kvm = p->vm = p->vcpu = -1;
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->cond, NULL);
  uint64_t t_setup = now_ns(CLOCK_MONOTONIC);
  int r = 0;
  p->kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
  if (p->kvm < 0) {
    r = -errno;
    *ret_err = xasprintf("/dev/kvm cannot be opened: %s", strerror(errno));
    goto out;
  }
  if ((p->vm = ioctl(p->kvm, KVM_CREATE_VM, 0)) < 0 ||
      (p->vcpu = ioctl(p->vm, KVM_CREATE_VCPU, 0)) < 0) {
    r = -errno;
    *ret_err = xasprintf("%s: %s", p->vm < 0 ? "KVM_CREATE_VM" : "KVM_CREATE_VCPU", strerror(errno));
    goto out;
  }
  int run_size = ioctl(p->kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
  p->mem = mmap(NULL, GUEST_MEM, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  void *run = run_size > 0 ? mmap(NULL, (size_t)run_size, PROT_READ | PROT_WRITE, MAP_SHARED,
                                  p->vcpu, 0)
                           : MAP_FAILED;
  if (p->mem == MAP_FAILED || run == MAP_FAILED) {
    r = -errno;
    *ret_err = xasprintf("mapping the probe's memory: %s", strerror(errno));
    if (p->mem == MAP_FAILED)
      p->mem = NULL;
    goto out;
  }
  p->run = run;
  p->run_size = (size_t)run_size;
  if ((r = setup_guest(p, loops, ret_err)) < 0)
    goto out;
  uint64_t setup_ns = now_ns(CLOCK_MONOTONIC) - t_setup;

  struct sigaction sa = {.sa_handler = kick_handler};
  sigemptyset(&sa.sa_mask);
  sigaction(KICK_SIGNAL, &sa, NULL);
  pthread_t t;
  if ((r = -pthread_create(&t, NULL, vcpu_thread, p)) < 0) {
    *ret_err = xasprintf("cannot start the vCPU thread: %s", strerror(-r));
    goto out;
  }
  pthread_detach(t);
  pthread_mutex_lock(&p->lock);
  struct timespec deadline = timespec_in(CLOCK_REALTIME, budget_ms);
  while (!p->done && pthread_cond_timedwait(&p->cond, &p->lock, &deadline) != ETIMEDOUT)
    ;
  bool in_time = p->done;
  if (!p->done) {
    /* Out of KVM_RUN now: immediate_exit for the next entry, a signal for
     * this one; then a little while for it to come back. */
    p->run->immediate_exit = 1;
    pthread_kill(t, KICK_SIGNAL);
    struct timespec grace = timespec_in(CLOCK_REALTIME, 1000);
    while (!p->done && pthread_cond_timedwait(&p->cond, &p->lock, &grace) != ETIMEDOUT)
      ;
  }
  struct vm_kvm_probe res = {.loops = loops, .budget_ms = budget_ms, .setup_ns = setup_ns};
  if (p->done && p->result == 0 && in_time) {
    res.finished = true;
    res.run_ns = p->run_ns;
  } else if (p->done && p->result < 0 && p->result != -EINTR) {
    r = p->result;
    *ret_err = r == -EIO ? xasprintf("the probe's vCPU stopped with KVM exit reason %u",
                                     p->exit_reason)
                         : xasprintf("KVM_RUN: %s", strerror(-r));
  } else {
    res.run_ns = (uint64_t)budget_ms * 1000000u;
  }
  if (!p->done) {
    /* The vCPU is stuck in the hypervisor: its thread frees the probe if it
     * ever comes back. */
    p->abandoned = true;
    res.stuck = true;
    pthread_mutex_unlock(&p->lock);
    p = NULL;
  } else {
    pthread_mutex_unlock(&p->lock);
  }
  if (r == 0)
    *ret = res;
out:
  if (p)
    probe_free(p);
  return r;
}

/* Why /dev/kvm cannot make a VM for this process, or NULL when it can. */
static char *kvm_open_why(char **ret_fix) {
  _cleanup_close_ int fd = open("/dev/kvm", O_RDWR | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) {
    *ret_fix = strdup("if grep -qwE 'vmx|svm' /proc/cpuinfo, load the module: modprobe kvm_intel "
                      "or modprobe kvm_amd (as root); in a virtual machine, enable nested "
                      "virtualisation on its host; nothing is needed to keep running under TCG");
    return strdup("/dev/kvm does not exist (the host offers no hardware virtualisation to this "
                  "machine, or the kvm module is not loaded)");
  }
  if (fd < 0 && errno == EACCES) {
    /* Say which: a device only root may use, or a group this user is not in. */
    struct stat st;
    struct group *g = getgrnam("kvm");
    bool kvm_group = stat("/dev/kvm", &st) == 0 && g && st.st_gid == g->gr_gid &&
                     (st.st_mode & 0060) == 0060;
    if (kvm_group) {
      *ret_fix = strdup("sudo usermod -aG kvm \"$USER\" (then log in again)");
      return strdup("/dev/kvm cannot be opened: Permission denied (it belongs to group kvm, "
                    "which this user is not in)");
    }
    *ret_fix = strdup("sudo chgrp kvm /dev/kvm && sudo chmod 0660 /dev/kvm && sudo usermod -aG kvm "
                      "\"$USER\" (then log in again); or run the server as root");
    return xasprintf("/dev/kvm cannot be opened: Permission denied (mode %03o, owner %u, group %u: "
                     "only root may use KVM on this host, so as a user it is not usable)",
                     (unsigned)(st.st_mode & 0777), (unsigned)st.st_uid, (unsigned)st.st_gid);
  }
  if (fd < 0)
    return xasprintf("/dev/kvm cannot be opened: %s", strerror(errno));
  if (ioctl(fd, KVM_GET_API_VERSION, 0) != KVM_API_VERSION)
    return strdup("/dev/kvm speaks another KVM API version");
  int vm = ioctl(fd, KVM_CREATE_VM, 0);
  if (vm < 0)
    return xasprintf("/dev/kvm opens but cannot create a VM: %s", strerror(errno));
  close(vm);
  return NULL;
}

/* Sets the accelerator the backend uses (and says in its isolation). */
void vm_set_accel(const char *accel) {
  pthread_mutex_lock(&vmb.lock);
  vmb.accel = accel;
  snprintf(vmb.isolation, sizeof vmb.isolation, "microvm/%s", accel);
  pthread_mutex_unlock(&vmb.lock);
}

/* QEMUs of a root server run as unprivileged uids with the kvm group: they
 * can use /dev/kvm only if that group may read and write it. */
static bool kvm_reachable(char **ret_why, char **ret_fix) {
  if (getuid() != 0)
    return true;
  struct stat st;
  struct group *g = getgrnam("kvm");
  if (stat("/dev/kvm", &st) < 0)
    return false;
  if ((st.st_mode & 0006) == 0006 || (g && st.st_gid == g->gr_gid && (st.st_mode & 0060) == 0060))
    return true;
  *ret_why = xasprintf("/dev/kvm (mode %03o, gid %u) cannot be opened by the unprivileged QEMU "
                       "user: give it to group kvm with mode 0660 (Debian's udev rules do)",
                       st.st_mode & 0777, (unsigned)st.st_gid);
  *ret_fix = strdup(g ? "chgrp kvm /dev/kvm && chmod 0660 /dev/kvm"
                      : "groupadd --system kvm && chgrp kvm /dev/kvm && chmod 0660 /dev/kvm");
  return false;
}

/* The KVM probe runs once per process (the doctor and the backend ask the
 * same question), under this lock. */
static pthread_mutex_t probe_lock = PTHREAD_MUTEX_INITIALIZER;
static bool probe_ran;
static int probe_rc;
static struct vm_kvm_probe probe_res;
static char *probe_err;

bool vm_kvm_probe_last(struct vm_kvm_probe *ret, char **ret_err) {
  pthread_mutex_lock(&probe_lock);
  bool ran = probe_ran;
  if (ran && probe_rc == 0)
    *ret = probe_res;
  if (ran && probe_rc < 0 && ret_err)
    *ret_err = strdup(probe_err);
  pthread_mutex_unlock(&probe_lock);
  return ran && probe_rc == 0;
}

char *vm_kvm_probe_text(void) {
  struct vm_kvm_probe p;
  _cleanup_free_ char *err = NULL;
  if (!vm_kvm_probe_last(&p, &err))
    return err ? xasprintf("the KVM probe could not run: %s", err) : NULL;
  if (p.finished)
    return xasprintf("KVM probe: a guest in kernel mode ran %u loop iterations in %.2f ms (budget "
                     "%u ms; VM set up in %.2f ms)",
                     p.loops, p.run_ns / 1e6, p.budget_ms, p.setup_ns / 1e6);
  return xasprintf("KVM probe: a guest in kernel mode did not finish %u loop iterations in %u ms%s "
                   "(real KVM takes about 1 ms; VM set up in %.2f ms)",
                   p.loops, p.budget_ms, p.stuck ? ", and its vCPU did not come back when stopped" : "",
                   p.setup_ns / 1e6);
}

/* Why KVM does not help on this host (it runs guest kernel code far slower
 * than TCG would), or NULL when it does. */
static char *kvm_slow_why(char **ret_fix) {
  pthread_mutex_lock(&probe_lock);
  if (!probe_ran) {
    probe_rc = vm_kvm_probe(KVM_PROBE_LOOPS, KVM_PROBE_BUDGET_MS, &probe_res, &probe_err);
    probe_ran = true;
  }
  int rc = probe_rc;
  struct vm_kvm_probe p = probe_res;
  pthread_mutex_unlock(&probe_lock);
  if (rc == 0 && p.finished)
    return NULL;
  _cleanup_free_ char *text = vm_kvm_probe_text();
  *ret_fix = strdup("nothing to do: TCG is faster here (IGN_MCP_ACCEL=kvm would insist on KVM)");
  if (rc < 0)
    return xasprintf("KVM opens but cannot run a guest: %s", text);
  return xasprintf("KVM does not help on this host: %s, so guest kernels would run far slower "
                   "than under TCG (a paravirtual or nested hypervisor)",
                   text);
}

const char *vm_probe_accel(char **ret_why, char **ret_fix) {
  *ret_why = *ret_fix = NULL;
  if (strcmp(cfg.accel, "tcg") == 0) {
    *ret_why = strdup("IGN_MCP_ACCEL=tcg");
    return "tcg";
  }
  char *why = kvm_open_why(ret_fix);
  if (!why) {
    why = kvm_slow_why(ret_fix);
    /* IGN_MCP_ACCEL=kvm insists on a KVM that works, however slow. */
    if (why && strcmp(cfg.accel, "kvm") == 0) {
      log_warn("%s; using it anyway (IGN_MCP_ACCEL=kvm)", why);
      free(steal_ptr(why));
      free(steal_ptr(*ret_fix));
    }
  }
  if (!why)
    kvm_reachable(&why, ret_fix);
  /* A guest that failed under KVM once is not retried (IGN_MCP_ACCEL=kvm
   * insists). */
  _cleanup_free_ char *marker = xasprintf("%s/kvm-unusable", cfg.store);
  if (!why && strcmp(cfg.accel, "auto") == 0 && file_exists(marker)) {
    why = xasprintf("a guest did not boot under KVM on this host before (the marker %s says so)",
                    marker);
    *ret_fix = xasprintf("rm %s (to try KVM again)", marker);
  }
  if (!why)
    return "kvm";
  *ret_why = why;
  return strcmp(cfg.accel, "kvm") == 0 ? NULL : "tcg";
}
