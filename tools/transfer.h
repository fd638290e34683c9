/* transfer.h: the tools that move files between the host and a sandbox
 * (copy_in, copy_out, stdin_file) and the one-shot sandbox_run. */
#pragma once

#include <jansson.h>
#include <stddef.h>

#include "common/call.h"

/* stdin_file's cap: the file is read whole into the request. */
#define STDIN_FILE_MAX (4u << 20)
/* Entries of sandbox_run's copy_in and copy_out, each. */
#define SANDBOX_RUN_MAX_COPIES 16

json_t *tool_copy_in(json_t *args, struct call_ctx *ctx);
json_t *tool_copy_out(json_t *args, struct call_ctx *ctx);
json_t *tool_sandbox_run(json_t *args, struct call_ctx *ctx);

/* Reads host file PATH for TOOL's stdin_file (confined, regular files only,
 * at most STDIN_FILE_MAX bytes); *ret_err names the argument. */
int stdin_file_load(const char *tool, const char *path, void **ret_data, size_t *ret_len,
                    char **ret_err);
