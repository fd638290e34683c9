/* args.h: argument checking for the tools, and the encodings they need
 * (strict base64, UTF-8 sanitising).  Every checker returns 0, or -EINVAL
 * with *ret_err set to a sentence naming the argument, what was wrong and
 * what to send instead.  Pure code, unit-tested and fuzzed. */
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/proto.h"

/* Refuses arguments not in ALLOWED (NULL-terminated); ARGS may be NULL. */
int args_check(json_t *args, const char *tool, const char *const *allowed, char **ret_err);
int arg_session_id(json_t *args, const char **ret, char **ret_err);
/* A string of MIN..MAX bytes without NUL.  Absent and !REQUIRED: 0 and
 * *ret untouched. */
int arg_string(json_t *args, const char *tool, const char *name, bool required, size_t min,
               size_t max, const char **ret, size_t *ret_len, char **ret_err);
/* An integer MIN..MAX; absent: 0 and *ret untouched. */
int arg_int(json_t *args, const char *tool, const char *name, long long min, long long max,
            long long *ret, char **ret_err);
/* A boolean; absent or null: 0 and *ret untouched. */
int arg_bool(json_t *args, const char *tool, const char *name, bool *ret, char **ret_err);
/* A path or cwd: the kernel's PATH_MAX counts the terminating NUL, so 4095
 * bytes is the longest path any call in the sandbox takes. */
#define ARG_MAX_PATH (PROTO_MAX_PATH - 1)
/* write_file writes "DIR/.NAME.ign-XXXXXX" first and renames it: 12 bytes
 * more than the path. */
#define ARG_MAX_WRITE_PATH (ARG_MAX_PATH - 12)
int arg_path(json_t *args, const char *tool, const char **ret, char **ret_err);
/* mode: an integer 0..07777 or an octal string ("755", "0755", "0o755"). */
int arg_mode(json_t *args, uint32_t *ret, char **ret_err);
/* stdin: a string of at most MAX bytes (may contain NUL). */
int arg_stdin(json_t *args, const char *tool, size_t max, const char **ret, size_t *ret_len,
              char **ret_err);
/* stdin_file: a host path (a string of 1..ARG_MAX_PATH bytes), refused
 * together with stdin.  Absent: 0 and *ret untouched. */
int arg_stdin_file(json_t *args, const char *tool, const char **ret, char **ret_err);
/* NAME, when present and not null: an array of at most MAX_ITEMS strings
 * of 1 to MAX_LEN bytes each.  Only checks. */
int arg_string_array(json_t *args, const char *tool, const char *name, size_t max_items,
                     size_t max_len, char **ret_err);
/* env: an object of string values; fills RET with "NAME=VALUE" pointers into
 * *ret_buf (caller frees). */
int arg_env(json_t *args, const char *tool, const char **ret, size_t max, size_t *ret_n,
            char **ret_buf, char **ret_err);

/* sandbox_run's copy_in ([{host, guest}]) or copy_out ([{guest, host}]),
 * NAME saying which: at most MAX entries, each with both paths and nothing
 * else.  RET points into ARGS.  Absent: 0 entries. */
struct arg_copy {
  const char *host, *guest;
};
int arg_copies(json_t *args, const char *tool, const char *name, struct arg_copy *ret,
               size_t max, size_t *ret_n, char **ret_err);

/* RFC 4648 base64 (padding optional, whitespace refused). */
int base64_decode(const char *in, size_t len, uint8_t **ret, size_t *ret_len, char **ret_err);
char *base64_encode(const void *data, size_t len);
/* A NUL-terminated valid UTF-8 copy of DATA; invalid sequences become
 * U+FFFD.  NUL bytes are kept (JSON can carry them).  *ret_len gets the
 * length when not NULL. */
char *utf8_sanitize(const char *data, size_t len, size_t *ret_len);

/* The tools/list array.  NET is IGN_MCP_NET ("off", "allow" or "open"):
 * the network modes a session may ask for. */
json_t *tool_definitions(const char *net, size_t output_cap, size_t max_file, size_t max_read);
