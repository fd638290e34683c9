/* stage_int.h: what the pieces of the stage store share (sandbox/stage*.c;
 * the public side is sandbox/stage.h).  Private to them.
 *
 *   stage_store.c   the layout of stages/ on disk: paths and names, meta.json
 *                   (read, write, whose a stage is)
 *   stage_verify.c  the checksum of a stage's tree (and its usage), the
 *                   content id, the check on the first open, and opening a
 *                   stage's files through the checked directory
 *   stage_lock.c    what servers that share the store agree on: the names
 *                   lock, the hold on a stage in use, deleting what nobody
 *                   holds, the clean-up after servers that died (stage_gc),
 *                   the space quota (IGN_MCP_STAGES_MAX_MB) all stages count
 *                   against
 *   stage_commit.c  making a stage: stage_begin, stage_abort, stage_finish
 *   stage.c         the stages this server holds (refs, sessions) and the
 *                   verbs on names: open, info, list, rm
 *
 * Each uses only those above it, except that stage_commit.c registers the
 * stage it made in stage.c's table (stage_reg_new) and tells it of a stage
 * moved aside (stage_reg_moved).  That table is this server's alone: what
 * must outlive the server (a session's stage kept while no server runs it)
 * is a kind of directory in the layout (stage_store.c) that stage_gc spares
 * (stage_lock.c). */
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "sandbox/stage.h"

#define MiB ((uint64_t)1 << 20)

static inline uint64_t stage_mib_up(uint64_t b) { return (b + MiB - 1) / MiB; }

/* A copy of S, or NULL when S is NULL. */
static inline char *dup_or_null(const char *s) {
  char *d = s ? strdup(s) : NULL;
  if (s && !d)
    abort();
  return d;
}

/* ---- stage_store.c ---- */

/* A stage's meta.json as read (the strings point into J). */
struct stage_meta {
  json_t *j;
  const char *name, *id, *parent, *parent_name, *backend, *inputs_id, *carries, *digest;
  const char *owner;  /* "" when it records none */
  uint64_t bytes;
  uint64_t inodes;  /* 0 in a meta.json written before they were counted */
  int64_t created;
};

/* IGN_MCP_STORE/stages. */
char *stage_store_dir(void);
/* Makes stages/ (0700) or checks the one there: a directory of the server's
 * uid, never writable by its group nor open to others. */
int stage_store_ensure(char **ret_err);
/* The directory of named stage NAME (already checked). */
char *stage_name_dir(const char *name);
/* A fresh path stages/.KIND-<pid>-<n>. */
char *stage_aside_path(const char *kind);
/* Reads and checks the meta.json open as FD; *ret_why on failure.  *M holds
 * a reference the caller drops (json_decref(m->j)) when this returns 0. */
int stage_meta_read(int fd, struct stage_meta *m, char **ret_why);
/* Writes DIR/meta.json (O_EXCL, synced). */
int stage_meta_write(const char *dir, const char *name, const char *id, const char *digest,
                     const struct stage_new *in, uint64_t bytes, uint64_t inodes,
                     int64_t created, char **ret_err);
/* Whether the stage at DIR is OWNER's; a stage whose meta cannot be read is
 * the owner "" 's, as one made before owners were recorded. */
bool stage_owned_by(const char *dir, const char *owner);

/* ---- stage_verify.c ---- */

/* Walks DIR (minus its meta.json): its checksum as 32 hex digits into HEX
 * (when not NULL), its allocated bytes and its inodes. */
int stage_tree_digest(int dir_fd, char hex[33], uint64_t *ret_bytes, uint64_t *ret_inodes,
                      char **ret_err);
/* The bytes allocated under PATH (a file or a tree), and its inodes. */
uint64_t stage_tree_usage(const char *path, uint64_t *ret_inodes);
/* The content id ("st-" and 32 hex digits) of a stage. */
void stage_make_id(const char *digest, const char *parent, const char *inputs_id,
                   const char *backend, char ret[36]);
/* Checks stage NAME of meta M (its directory DIR_FD) against this server
 * (BACKEND, INPUTS_ID) and its files against their checksum, the first time
 * this server opens that id. */
int stage_verify(const char *name, int dir_fd, const struct stage_meta *m, const char *backend,
                 const char *inputs_id, char **ret_err);
/* Records ID as verified (a stage this server made). */
void stage_verified_add(const char *id);

/* ---- stage_lock.c ---- */

/* Takes the names lock (stages/.lock, LOCK_EX; waits a while): the fd, or
 * -errno with *ret_err. */
int stage_names_lock(char **ret_err);
/* A shared flock on DIR/meta.json: the fd, or -errno. */
int stage_hold(const char *dir);
/* Deletes DIR (.rm-*, .anon-*) when nobody holds its meta; under the names
 * lock.  Whether it was deleted. */
bool stage_delete_if_free(const char *dir);
/* The same, taking the names lock. */
void stage_delete_later_or_now(const char *dir);
/* What the quota charges for BYTES of blocks and INODES inodes. */
uint64_t stage_charge(uint64_t bytes, uint64_t inodes);
/* The bytes all stages use as the quota counts them, leaving out the entry
 * SKIP of stages/. */
uint64_t stage_space_used(const char *skip);
bool stage_over_quota(uint64_t used, uint64_t need);
/* The error of a stage refused by the quota. */
char *stage_quota_error(uint64_t used, uint64_t need);

/* ---- stage.c ---- */

/* The table of held stages takes a new stage of meta M at DIR (its
 * directory DIR_FD, its meta held by HOLD_FD, both taken; ST: the meta's
 * stat): one reference. */
struct stage *stage_reg_new(const struct stage_meta *m, const char *dir, int dir_fd, int hold_fd,
                            const struct stat *st);
/* The stage moved from its name to ASIDE (under the names lock): a held
 * one goes with its last reference. */
void stage_reg_moved(const char *aside);
/* Kept stage S is now in DIR (taken), and kept or not (stage_kept.c). */
void stage_reg_relocate(struct stage *s, char *dir, bool kept);
/* stage_open of the stage in DIR (NAME names it in messages); KEPT: a kept
 * stage (stage_keep), registered as such. */
int stage_open_dir(const char *name, const char *dir, bool kept, const char *owner,
                   const char *backend, const char *inputs_id, struct stage **ret,
                   char **ret_err);
