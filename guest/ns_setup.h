/* ns_setup.h: the setup of a namespace sandbox (mode --ns): its filesystem
 * and identity (ns_setup.c), built from the options on the agent's command
 * line (args.c), and the privilege drop that ends it (confine.c). */
#pragma once

#include <sys/types.h>

/* The fd on which a namespace sandbox's agent keeps its setup tmpfs open for
 * its whole life (close-on-exec, so no command inherits it): the server
 * reads a commit's files through /proc/<agent pid>/fd/6 (sandbox/ns_snapshot.c).  In
 * that directory, upper/ is the overlay's upper layer and scratch/root and
 * scratch/tmp, when they exist, are what the sandbox sees as /root and /tmp
 * (rootfs directories the sandbox could not write in; see ns_writable_dir).
 * The agent is not dumpable, so the sandbox's own processes cannot open it. */
#define AGENT_NS_STATE_FD 6
struct ns_options {
  const char *rootfs; /* absolute path of the rootfs tree on the host */
  int rootfs_fd;      /* the server's idmapped mount of it (root server), or -1 */
  /* A stage's layer, laid between the rootfs and the upper: the server's
   * idmapped mount of it (root server), or its host path (a user's). */
  int stage_fd;       /* -1: none */
  const char *stage;  /* NULL: none */
  /* With STAGE: the device and inode of the layer the server checked.  The
   * path is bound by name, and another server may rename a different stage
   * onto it meanwhile: what was bound must be this directory. */
  dev_t stage_dev;
  ino_t stage_ino;
  unsigned overlay_mb;
  const char *hostname;
};

/* Build the sandbox's filesystem and identity.  On failure a one-line
 * message has been written to stderr. */
int ns_setup(const struct ns_options *o);

/* confine.c: drop every capability for good, set no_new_privs, install the
 * seccomp filter.  On failure a one-line message has been written to stderr. */
int confine_drop_privileges(void);
