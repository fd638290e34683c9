/* runlog.h: the complete stdout and stderr of every run and sandbox_run, on
 * the host, behind the inline heads a result carries.
 *
 * Logs live in cfg.log_dir (made 0700; files 0600, readable by the user who
 * started the server and nobody else), one pair per call:
 * <session_id>-<seq>.stdout / .stderr.  Each is cut at cfg.log_cap bytes with a
 * marker line.  Writing never slows or blocks a session: output is queued
 * (bounded) to one writer thread; what the queue cannot hold is dropped and
 * the log says so (a marker, and log_error in the result); a full disk is
 * reported in the result, never fatal.  Old logs are removed by age
 * (cfg.log_keep_days) and total size (cfg.log_keep_mb), oldest first, never
 * one that is still being written. */
#pragma once

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

struct runlog;

/* Starts the writer thread.  Nothing is created on disk until the first
 * log.  A failure is logged and logs are then reported unavailable in
 * results. */
int runlog_init(const char *dir, size_t cap, uint64_t keep_bytes, unsigned keep_days,
                char **ret_err);
void runlog_shutdown(void);

/* Opens the pair for one call of SESSION_ID.  On failure both are NULL and
 * *ret_err says why (the call goes on without logs). */
int runlog_open_run(const char *session_id, struct runlog *logs[2], char **ret_err);
/* agent_exec_req.on_output with ctx = logs (the array): queues, never blocks. */
void runlog_tap(void *ctx, int stream, const void *data, size_t len);
/* Finishes the pair (waits for its queued bytes to be written, bounded) and
 * adds stdout_log_path and stderr_log_path to RESULT (a JSON object), or
 * log_error when the logs are incomplete or could not be opened (OPEN_ERR). */
void runlog_close_run(struct runlog *logs[2], const char *open_err, json_t *result);

/* Copies the serial log SRC of a microVM that is going away into the log
 * directory as <session_id>.serial (at most the cap; pruned like the
 * others).  SRC lies in the QEMU's state directory: it is read only when it
 * is a regular file with one name that belongs to the directory's owner (the
 * QEMU's uid), opened relative to the directory without following a link.
 * 0 and *ret_path (malloc'd); -ENOENT when there is none or logs are off;
 * another -errno and *ret_err (for the result) when it was not kept. */
int runlog_keep_serial(const char *session_id, const char *src, char **ret_path,
                       char **ret_err);
