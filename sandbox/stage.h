/* stage.h: stages, the named snapshots of sessions in the store.
 *
 * A stage is a directory of the store (IGN_MCP_STORE/stages/) holding a
 * backend's files (vm: a RAM file and a device state, a base of its own;
 * ns: a layer tree laid over the rootfs) and a meta.json that records what
 * it is: its name, its content id, its parent, the backend and the inputs
 * id it was made over, what it carries, checksums of its files, when it was
 * made.  This file knows nothing of what the files mean; the backends
 * (sandbox_ops.snapshot and create with sandbox_config.stage) do.
 *
 * A stage is written completely or not at all: its files are made in a
 * temporary directory (stage_begin) and the directory is renamed into place
 * with its meta last (stage_finish); a temporary directory of a server that
 * died is removed by the next.  Its files' checksums are verified the first
 * time a server opens the stage, through a descriptor of its directory that
 * the stage keeps (dir_fd): backends open its files relative to that
 * (stage_open_file), so a session gets the files that were checked, whatever
 * another server renames onto the name since.
 *
 * Sharing: servers that use the same store share its stages.  Changes to
 * the names (finish, replace, rm) happen under an flock on stages/.lock; a
 * stage in use by a session of any server is held by a shared flock on its
 * meta.json, and a removed or replaced stage is moved aside and deleted only
 * once nobody holds it.
 *
 * Owners: a stage belongs to the owner that committed it (see session.h;
 * "" for a stage made before owners were recorded).  Open, info, list and
 * rm take the caller's owner and see only its stages: another owner's is
 * "no stage named ...".  Names are shared: a commit under a name another
 * owner's stage has is refused as taken.
 *
 * Anonymous stages (name NULL) are made by fork: they live as long as the
 * references to them in this server (the forked sessions) and are removed
 * when the last goes.  They are not listed. */
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#define STAGE_NAME_MAX 128
#define STAGE_NAME_RULE "[a-z0-9][a-z0-9._/-]{0,127}"

struct stage {
  char *name;               /* NULL: a fork's anonymous stage */
  char *id;                 /* content id: "st-" and 32 hex digits */
  char *parent;             /* the id of the stage it was made from, or NULL (the base) */
  char *parent_name;        /* ... and its name then, or NULL */
  char *backend;            /* "vm", "ns" */
  char *inputs_id;          /* sandbox_ops.inputs_id when it was made */
  char *carries;            /* "memory", "files" */
  char *owner;              /* who committed it; "" for a stage that records none */
  char *dir;                /* the directory with the backend's files, by name (messages) */
  /* That directory as checked when the stage was opened (or made): O_PATH.
   * A backend opens the stage's files relative to it (stage_open_file), never
   * by DIR: another server's commit(..., replace) or stage_rm may rename a
   * different stage onto DIR at any time, and the files this one checked
   * are then elsewhere (held until the last reference goes). */
  int dir_fd;
  uint64_t bytes;           /* allocated on disk (blocks, not apparent sizes) */
  int64_t created;          /* Unix time, seconds */
  /* Private to stage.c. */
  int refs;                 /* under stage.c's lock */
  unsigned sessions;        /* sessions of this server started from it */
  int hold_fd;              /* shared flock on its meta.json */
  bool removed;             /* moved aside (rm, replace): deleted with the last reference */
  bool kept;                /* a kept stage (stage_keep): outlives its last reference */
};

/* 0 when NAME follows STAGE_NAME_RULE; else -EINVAL and *ret_err naming the
 * rule (and what in NAME broke it). */
int stage_name_check(const char *name, char **ret_err);

/* What stage_finish records besides the files. */
struct stage_new {
  const char *backend;
  const char *inputs_id;
  const char *carries;
  const struct stage *parent; /* the stage the session was started from, or NULL */
  const char *owner;          /* who commits it (NULL: "") */
};

/* A new empty directory of the store (mode 0700) in which a backend makes a
 * stage's files; *ret_dir.  NEED is the most the stage may take on disk: it
 * is refused when the stages already use more than IGN_MCP_STAGES_MAX_MB
 * minus NEED (the error names the space used and stage_rm), or when the
 * store has less than NEED free. */
int stage_begin(uint64_t need, char **ret_dir, char **ret_err);
/* Removes a directory from stage_begin that will not become a stage. */
void stage_abort(const char *dir);
/* Turns DIR (from stage_begin) into stage NAME (NULL: anonymous): computes
 * the checksums and the content id, writes meta.json, renames the directory
 * into place.  A stage NAME that exists is replaced only when REPLACE;
 * otherwise -EEXIST with an error that says so.  A stage NAME of another
 * owner is never replaced: -EEXIST, the name is taken.  On success *ret is a
 * reference to the new stage (trusted: no verification on open), and DIR
 * is gone; on failure DIR is removed. */
int stage_finish(const char *dir, const char *name, bool replace, const struct stage_new *in,
                 struct stage **ret, char **ret_err);
/* Opens OWNER's stage NAME for a sandbox of BACKEND whose current inputs id is
 * INPUTS_ID: -ENOENT (unknown name; the error lists how to see them),
 * -EXDEV (made by the other backend), -ESTALE (made over other inputs: the
 * error names both ids and the way out: commit it again from a session on
 * the current base), -EBADMSG (its files fail their checksums, verified on
 * the first open by this server).  *ret is a new reference. */
int stage_open(const char *name, const char *owner, const char *backend, const char *inputs_id,
               struct stage **ret, char **ret_err);
/* Opens NAME (one component) of stage S relative to its checked directory
 * (S->dir_fd), without following a link: FLAGS are openat's (O_NOFOLLOW and
 * O_CLOEXEC are added).  0 and *ret_fd, or -errno with *ret_err naming the
 * stage and the way out (stage_rm, commit again). */
int stage_open_file(const struct stage *s, const char *name, int flags, int *ret_fd,
                    char **ret_err);
void stage_ref(struct stage *s);
/* Drops a reference; the last one of a removed or anonymous stage deletes
 * its files (when no other server holds it). */
void stage_unref(struct stage *s);
/* A session of this server was started from S (DELTA 1), or ended (-1). */
void stage_sessions_add(struct stage *s, int delta);

/* Kept stages: the saved state of a hibernated session, as
 * stages/.hib-<KEY>/ (KEY: the session's id), which outlives its server
 * (stage_gc passes over it) until a server resumes the session or drops it.
 * It counts against IGN_MCP_STAGES_MAX_MB like any stage.
 *
 * Moves anonymous stage S (from stage_finish) to .hib-KEY: it is no longer
 * removed with its last reference.  0, or -errno with *ret_err. */
int stage_keep(struct stage *s, const char *key, char **ret_err);
/* Makes kept stage S anonymous again (a resumed session's: it goes with its
 * last reference, or with this server). */
void stage_unkeep(struct stage *s);
/* Kept stage S is dropped: deleted with its last reference. */
void stage_discard(struct stage *s);
/* Opens KEY's kept stage for OWNER, for a sandbox of BACKEND over INPUTS_ID,
 * and verifies it (see stage_open).  WHAT names it in messages ("session
 * 'X'").  -ENOENT when there is none; -EXDEV, -ESTALE, -EBADMSG as
 * stage_open, with messages about WHAT. */
int stage_open_kept(const char *key, const char *what, const char *owner, const char *backend,
                    const char *inputs_id, struct stage **ret, char **ret_err);
/* Removes KEY's kept stage (nobody holds it: else it is left for later). */
void stage_remove_kept(const char *key);
/* Removes the kept stages nobody holds whose key ORPHAN says belongs to no
 * hibernation any more (a server died between removing a record and its
 * stage). */
void stage_kept_sweep(bool (*orphan)(const char *key));

/* {stages: [{name, stage_id, parent, carries, backend, base_id, bytes,
 * created, sessions}], bytes_used, bytes_max}. */
json_t *stage_list(const char *owner);
/* {name, stage_id, parent, carries, backend, base_id (= inputs_id), bytes, created,
 * sessions}, or -ENOENT with *ret_err. */
int stage_info(const char *name, const char *owner, json_t **ret, char **ret_err);
/* Removes stage NAME: its files go once no session of any server uses it. */
int stage_rm(const char *name, const char *owner, char **ret_err);
/* Removes what servers that died left (temporary and anonymous stages) and
 * stages moved aside that nobody holds any more. */
void stage_gc(void);
/* The bytes allocated on disk under PATH (a file or a tree). */
uint64_t stage_tree_bytes(const char *path);

/* TEST ONLY (tests/unit/test_stage.c): forgets which stage ids this server
 * has verified, as if it had just started. */
void stage_test_forget(void);
