/* doctor_install.c: the doctor's checks of what is built and installed,
 * and the commands that fix what is missing: QEMU and its microvm machine,
 * the vm backend's kernel, initramfs and image, the store and its warm base,
 * and the ns backend's ign-agent and rootfs.  A fix names `make -C <tree>
 * <target>` for a server run from its source tree, `make <target> && make
 * install` for an installed one.  Nothing is built or installed here. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/config.h"
#include "common/proc.h"
#include "common/util.h"
#include "mcp/doctor_int.h"
#include "sandbox/vm.h"

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

/* ---- the vm backend ---- */

void doctor_check_qemu(struct report *r) {
  if (!cfg.qemu) {
    add(r, FOR_VM, "qemu", ST_MISSING,
        config_missing_why("IGN_MCP_QEMU", "qemu-system-x86_64", "an executable file"),
        env_set("IGN_MCP_QEMU") ? strdup("unset IGN_MCP_QEMU (to use qemu-system-x86_64 from PATH)")
                                : as_root("apt-get install qemu-system-x86"));
    return;
  }
  char out[8192];
  char *argv[] = {cfg.qemu, "--version", NULL};
  int st = proc_run_capture(argv, out, sizeof out, DOCTOR_RUN_MS);
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
  st = proc_run_capture(machines, out, sizeof out, DOCTOR_RUN_MS);
  if (st < 0 || !strstr(out, "microvm")) {
    add(r, FOR_VM, "qemu", ST_FAIL,
        xasprintf("%s (%s) has no microvm machine type: QEMU 4.2 or later is needed", cfg.qemu,
                  version),
        as_root("apt-get install qemu-system-x86"));
    return;
  }
  /* An older QEMU still works, but opens the warm base's and stages' RAM
   * files read-write (SECURITY.md). */
  if (!vm_qemu_ram_readonly()) {
    add(r, FOR_VM, "qemu", ST_WARN,
        xasprintf("%s: %s; it opens the warm base's and stages' RAM files read-write (mapped "
                  "private: guests never change them, but a QEMU taken over by its guest could); "
                  "QEMU 8.2 or later maps them from a read-only file",
                  cfg.qemu, version),
        as_root("apt-get install -t bookworm-backports qemu-system-x86 (QEMU 10 on Debian 12)"));
    return;
  }
  add(r, FOR_VM, "qemu", ST_OK,
      xasprintf("%s: %s; RAM files read-only to it", cfg.qemu, version), NULL);
}

/* One data file of the vm backend: VAR overrides the default NAME. */
bool doctor_check_vm_file(struct report *r, const char *label, const char *path, const char *var) {
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

bool doctor_check_vm_image(struct report *r) {
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
    return doctor_check_vm_file(r, "image", cfg.vm_image, "IGN_MCP_VM_IMAGE");
  add(r, FOR_VM, "image", ST_MISSING,
      xasprintf("IGN_MCP_ROOTFS=%s is neither a rootfs name nor an image file: microVMs boot a "
                "disk image (tools, small or a path to one)",
                cfg.rootfs_spec),
      strdup("unset IGN_MCP_ROOTFS (the default, tools, has an image)"));
  return false;
}

void doctor_check_store(struct report *r) {
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

void doctor_check_base(struct report *r, bool inputs_ok) {
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

/* ---- the ns backend ---- */

void doctor_check_agent(struct report *r) {
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

void doctor_check_rootfs(struct report *r) {
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
