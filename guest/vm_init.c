/* vm_init.c: the agent as PID 1 of a microVM (no arguments, pid 1).
 *
 * The kernel starts us from the initramfs.  We:
 *   1. mount devtmpfs, proc and sysfs, and give ourselves the console as
 *      fds 0-2 (the initramfs has no /dev/console node);
 *   2. load the kernel modules the guest needs, in the order listed in
 *      /lib/modules/modules.order (virtio transport, block, console, overlay,
 *      the rootfs's filesystem, nf_tables and the parts of it the capture
 *      uses), before the warm snapshot is taken, so clones never pay for it;
 *   3. mount the read-only rootfs disk (/dev/vda), a size-capped tmpfs, and
 *      an overlay of the two, move /dev, /proc and /sys into it and make it
 *      the root (the initramfs stays behind, unreachable);
 *   4. put commands in a cgroup of their own with a small CPU weight;
 *   5. write /etc/resolv.conf and /etc/hosts when the rootfs has none, bring
 *      lo up and capture the guest's traffic (egress_nl.c: the guest has no
 *      NIC, only lo; the rules are in RAM when the warm snapshot is taken);
 *   6. open the virtio-serial port named "agent" as the channel.
 * Kernel command line options: ign.fstype=erofs|ext4|squashfs (default:
 * try each), ign.overlay_mb=N (default 1024).
 *
 * PID 1 must never exit (the kernel would panic): a setup failure is printed
 * on the console, which the host keeps as the serial log, and the VM powers
 * off.  A virtio-serial port reads EOF whenever no host is connected (a
 * clone resumes before its host connects): vm_wait_host() waits for one
 * instead of ending the session. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/util.h"
#include "guest/agent_core.h"
#include "guest/egress_int.h"
#include "guest/exec_int.h"
#include "guest/machine.h"
#include "guest/vm_init.h"

#define VM_ROOT_DEV "/dev/vda"
#define VM_PORT_NAME "agent"
#define VM_DEVICE_WAIT_MS 10000

void vm_early_init(void) {
  mkdir("/dev", 0755);
  mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
  int fd = open("/dev/console", O_RDWR | O_NOCTTY);
  if (fd >= 0) {
    for (int i = 0; i <= 2; i++)
      if (fd != i)
        dup2(fd, i);
    if (fd > 2)
      close(fd);
  }
}

void vm_fatal(void) {
  agent_log("the guest cannot start; powering off");
  sync();
  reboot(RB_POWER_OFF);
  for (;;)
    pause();
}

static int vm_fail(const char *what) {
  int err = errno ? errno : EINVAL;
  agent_log("vm setup: %s: %s", what, strerror(err));
  return -err;
}

/* The value of NAME= on the kernel command line, or NULL. */
static char *cmdline_value(const char *cmdline, const char *name) {
  size_t n = strlen(name);
  for (const char *p = cmdline; (p = strstr(p, name)); p += n) {
    if ((p != cmdline && p[-1] != ' ') || p[n] != '=')
      continue;
    const char *v = p + n + 1;
    return strndup(v, strcspn(v, " \n"));
  }
  return NULL;
}

static int load_modules(void) {
  _cleanup_fclose_ FILE *f = fopen("/lib/modules/modules.order", "re");
  if (!f)
    return 0; /* a kernel with everything built in */
  char name[256];
  while (fgets(name, sizeof name, f)) {
    name[strcspn(name, "\n")] = '\0';
    if (!name[0])
      continue;
    char path[300];
    snprintf(path, sizeof path, "/lib/modules/%s", name);
    _cleanup_close_ int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      return vm_fail(path);
    if (syscall(SYS_finit_module, fd, "", 0) < 0 && errno != EEXIST)
      return vm_fail(path);
  }
  return 0;
}

static int wait_for(const char *path) {
  uint64_t deadline = mono_ms() + VM_DEVICE_WAIT_MS;
  while (access(path, F_OK) < 0) {
    if (mono_ms() >= deadline) {
      errno = ENODEV;
      return vm_fail(path);
    }
    usleep(1000);
  }
  return 0;
}

static int mount_root(const char *fstype, unsigned overlay_mb) {
  static const char *const types[] = {"erofs", "ext4", "squashfs"};
  if (mkdir("/lower", 0755) < 0 && errno != EEXIST)
    return vm_fail("mkdir /lower");
  int r = -1;
  for (size_t i = 0; i < ARRAY_SIZE(types) && r < 0; i++) {
    if (fstype && strcmp(fstype, types[i]) != 0)
      continue;
    r = mount(VM_ROOT_DEV, "/lower", types[i], MS_RDONLY, NULL);
  }
  if (r < 0)
    return vm_fail("mounting the rootfs disk " VM_ROOT_DEV);

  char opts[64];
  snprintf(opts, sizeof opts, "size=%um,mode=0755", overlay_mb);
  if (mkdir("/rw", 0755) < 0 && errno != EEXIST)
    return vm_fail("mkdir /rw");
  if (mount("tmpfs", "/rw", "tmpfs", 0, opts) < 0)
    return vm_fail("mounting the overlay's tmpfs");
  if (mkdir("/rw/upper", 0755) < 0 || mkdir("/rw/work", 0755) < 0 ||
      (mkdir("/newroot", 0755) < 0 && errno != EEXIST))
    return vm_fail("mkdir for the overlay");
  if (mount("overlay", "/newroot", "overlay", 0,
            "lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work") < 0)
    return vm_fail("mounting the overlay");

  static const char *const moves[] = {"dev", "proc", "sys"};
  for (size_t i = 0; i < ARRAY_SIZE(moves); i++) {
    char src[16], dst[32];
    snprintf(src, sizeof src, "/%s", moves[i]);
    snprintf(dst, sizeof dst, "/newroot/%s", moves[i]);
    mkdir(dst, 0755);
    if (mount(src, dst, NULL, MS_MOVE, NULL) < 0)
      return vm_fail(dst);
  }
  if (chdir("/newroot") < 0 || mount(".", "/", NULL, MS_MOVE, NULL) < 0 || chroot(".") < 0 ||
      chdir("/") < 0)
    return vm_fail("switching to the new root");

  mkdir("/dev/pts", 0755);
  mkdir("/dev/shm", 01777);
  mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666");
  mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
  /* Best effort, like the mkdirs around them: a guest without these links
   * still runs commands. */
  if (symlink("pts/ptmx", "/dev/ptmx") < 0 && errno != EEXIST)
    agent_log("vm setup: no /dev/ptmx link: %s", strerror(errno));
  if (symlink("/proc/self/fd", "/dev/fd") < 0 && errno != EEXIST)
    agent_log("vm setup: no /dev/fd link: %s", strerror(errno));
  mkdir("/tmp", 01777);
  mkdir("/root", 0700);
  return 0;
}

/* The cgroup commands run in: every process of every command shares one
 * CPU weight of 1 against the agent's 100-odd (the agent stays in the root
 * cgroup), so a fork bomb or a build on every core still leaves the agent
 * the CPU to notice a timeout, kill the group and answer the host.  Only the
 * cpu controller: memory is the guest's, and the kernel never OOM-kills PID
 * 1.  favordynmods makes joining it (a write per command) cheap; a kernel
 * without that option mounts without it.  Best effort: a guest without it
 * still runs commands, next to the agent.  Returns the open cgroup.procs. */
#define VM_CGROUP "/sys/fs/cgroup"
#define VM_COMMANDS_CGROUP VM_CGROUP "/commands"

static int write_file(const char *path, const char *text) {
  _cleanup_close_ int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0 || write(fd, text, strlen(text)) < 0)
    return -errno;
  return 0;
}

static int commands_cgroup(void) {
  const unsigned long flags = MS_NOSUID | MS_NODEV | MS_NOEXEC;
  if (mount("cgroup2", VM_CGROUP, "cgroup2", flags, "favordynmods") < 0 &&
      mount("cgroup2", VM_CGROUP, "cgroup2", flags, NULL) < 0)
    return -errno;
  int r;
  if ((r = write_file(VM_CGROUP "/cgroup.subtree_control", "+cpu")) < 0)
    return r;
  if (mkdir(VM_COMMANDS_CGROUP, 0755) < 0 && errno != EEXIST)
    return -errno;
  if ((r = write_file(VM_COMMANDS_CGROUP "/cpu.weight", "1")) < 0)
    return r;
  int fd = open(VM_COMMANDS_CGROUP "/cgroup.procs", O_WRONLY | O_CLOEXEC);
  return fd < 0 ? -errno : fd;
}

/* /dev/vportNpM whose /sys/class/virtio-ports/.../name is "agent". */
static int open_port(void) {
  uint64_t deadline = mono_ms() + VM_DEVICE_WAIT_MS;
  for (;;) {
    DIR *d = opendir("/sys/class/virtio-ports");
    struct dirent *e;
    while (d && (e = readdir(d))) {
      if (e->d_name[0] == '.')
        continue;
      char path[300], name[64] = "";
      snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", e->d_name);
      _cleanup_fclose_ FILE *f = fopen(path, "re");
      if (!f || !fgets(name, sizeof name, f))
        continue;
      name[strcspn(name, "\n")] = '\0';
      if (strcmp(name, VM_PORT_NAME) != 0)
        continue;
      snprintf(path, sizeof path, "/dev/%s", e->d_name);
      closedir(d);
      int fd = open(path, O_RDWR | O_CLOEXEC);
      if (fd < 0)
        return vm_fail(path);
      return fd;
    }
    if (d)
      closedir(d);
    if (mono_ms() >= deadline) {
      errno = ENODEV;
      return vm_fail("no virtio-serial port named \"" VM_PORT_NAME "\"");
    }
    usleep(1000);
  }
}

int vm_setup(struct agent *a, int *ret_chan) {
  umask(022);
  mkdir("/proc", 0755);
  mkdir("/sys", 0755);
  if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
    return vm_fail("mounting /proc");
  if (mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
    return vm_fail("mounting /sys");
  char cmdline[4096] = "";
  {
    _cleanup_fclose_ FILE *f = fopen("/proc/cmdline", "re");
    if (f && !fgets(cmdline, sizeof cmdline, f))
      cmdline[0] = '\0';
  }
  _cleanup_free_ char *fstype = cmdline_value(cmdline, "ign.fstype");
  _cleanup_free_ char *overlay = cmdline_value(cmdline, "ign.overlay_mb");
  unsigned overlay_mb = overlay ? (unsigned)strtoul(overlay, NULL, 10) : 1024;
  if (overlay_mb == 0)
    overlay_mb = 1024;

  int r = load_modules();
  if (r < 0)
    return r;
  if ((r = wait_for(VM_ROOT_DEV)) < 0)
    return r;
  if ((r = mount_root(fstype, overlay_mb)) < 0)
    return r;
  r = commands_cgroup();
  if (r < 0)
    agent_log("vm setup: commands run beside the agent, without a cgroup of their own: %s",
              strerror(-r));
  else
    agent_exec(a)->cgroup_procs = r;
  machine_name_files();
  machine_set_hostname("ignition", strlen("ignition"));
  r = machine_loopback_up();
  if (r < 0)
    agent_log("bringing up loopback: %s", strerror(-r));
  egress_capture(a);
  int fd = open_port();
  if (fd < 0)
    return fd;
  *ret_chan = fd;
  return 0;
}

void vm_wait_host(int chan) {
  /* While no host is connected the port polls as POLLHUP and reads return
   * 0 at once; nothing wakes us when one connects, so look every few ms. */
  for (;;) {
    struct pollfd p = {.fd = chan, .events = POLLIN};
    if (poll(&p, 1, 0) >= 0 && !(p.revents & POLLHUP))
      return;
    usleep(2000);
  }
}
