/* ns_stage.h: the ns backend's stage layer, inside sandbox/ (ns_snapshot.c
 * and the unit tests).  A stage of the ns backend is one directory tree,
 * layer/, laid by the agent as an overlay lower layer over the rootfs: a copy of
 * the stage the session started from (hard links) with the session's
 * overlay upper applied on top (ns_stage.c). */
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

/* Bumped when what a layer means changes: part of the inputs id. */
#define NS_LAYER_VERSION "ns-layer v1"
/* The deepest directory a layer may hold (each level holds two fds open
 * while it is copied), and the most entries one commit copies. */
#define NS_LAYER_MAX_DEPTH 128u
#define NS_LAYER_MAX_ENTRIES 1000000u
/* The xattr overlayfs marks an opaque directory with when mounted with
 * userxattr (the agent's overlay: a user namespace may not write trusted.*). */
#define NS_LAYER_OPAQUE_XATTR "user.overlay.opaque"

/* Who the copied entries belong to. */
enum ns_layer_owners {
  NS_LAYER_OWNERS_SELF,  /* the server's own uid (a user server): never chown */
  NS_LAYER_OWNERS_KEEP,  /* as in the source (a stage's own files) */
  NS_LAYER_OWNERS_BLOCK, /* host uid - base (a root server's sandbox block):
                            on-disk k is uid k inside through the idmapped mount */
};

struct ns_layer_opts {
  enum ns_layer_owners owners;
  uid_t base;                   /* NS_LAYER_OWNERS_BLOCK: the block's first host uid/gid */
  /* The most data bytes the applies of one commit copy from the sandbox
   * (its disk: the tmpfs that holds its upper and scratch directories), 0
   * for no cap.  Hard links of the upper stay hard links, so a frozen
   * sandbox never needs more; a running one that writes while it is
   * copied could make the copy grow without end. */
  uint64_t max_bytes;
};

/* What a copy did, for the log. */
struct ns_layer_stats {
  uint64_t entries;
  uint64_t bytes;               /* data bytes copied (hard links: none) */
  uint64_t upper_bytes;         /* ... of them from the sandbox (ns_layer_apply*) */
  uint64_t relinked;            /* hard links of the upper kept as hard links */
  uint64_t linked;              /* entries hard-linked from the parent's layer */
  uint64_t whiteouts;
  uint64_t dropped_special;     /* devices and sockets: not kept */
  uint64_t skipped_owner;       /* owner outside the sandbox's uid block */
  uint64_t unreadable;          /* the server could not open them (a user server) */
  uint64_t vanished;            /* gone between readdir and open */
  uint64_t xattrs_dropped;      /* user.* xattrs the store did not take */
};

/* Makes the empty directory DST_FD a copy of the layer SRC_FD (a stage's,
 * in the same file system): directories made anew with the same owners,
 * modes, user.* xattrs and mtimes; everything else hard-linked (copied when
 * a file has too many links).  0, or a negative errno with *ret_err. */
int ns_layer_link(int src_fd, int dst_fd, const struct ns_layer_opts *o,
                  struct ns_layer_stats *st, char **ret_err);
/* Applies the overlay upper directory UPPER_FD onto the layer DST_FD, as
 * overlayfs would see it: a whiteout (char 0:0) removes the entry and stays
 * a whiteout, an opaque directory replaces the one in DST, a directory
 * merges, anything else replaces (unlinked first: a hard link to a parent
 * stage's inode is never written through).  Files hard-linked together in
 * the upper are one inode in the layer too (copied once: a sandbox cannot
 * make the host's disk hold a file once per link).  DST's own attributes become
 * UPPER's.  The upper is untrusted: no link is followed, opens are
 * O_NOFOLLOW|O_NONBLOCK, entries that vanish are passed over, depth and
 * entries are capped.  Modes lose setuid and setgid; devices and sockets
 * are dropped (a whiteout takes their place).  0, or a negative errno with
 * *ret_err. */
int ns_layer_apply(int upper_fd, int dst_fd, const struct ns_layer_opts *o,
                   struct ns_layer_stats *st, char **ret_err);
/* The directory SRC_FD laid as entry NAME of DST_FD, in place of what was
 * there and opaque (nothing below shows through): the sandbox's /root and
 * /tmp when they were scratch directories apart from the upper (a user
 * server whose rootfs has them owned by an unmapped uid).  Opaque, the
 * stage's sessions see them alone and can write in them. */
int ns_layer_apply_dir(int src_fd, int dst_fd, const char *name, const struct ns_layer_opts *o,
                       struct ns_layer_stats *st, char **ret_err);
