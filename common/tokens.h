/* tokens.h: the HTTP transport's bearer tokens (IGN_MCP_HTTP_TOKENS).
 *
 * The file holds one `name:token` per line (blank lines and lines starting
 * with # are ignored).  Only a SHA-256 of each token is kept in memory; a
 * presented token is hashed and compared with every entry in constant time,
 * so neither a match nor its position shows in the timing.  The name is what
 * owns the sessions a token opens; it is safe to log, the token never is. */
#pragma once

#include <stdbool.h>
#include <stddef.h>

struct tokens;

/* Reads PATH.  Refuses (-1, *RET_ERR saying which line and why, to free) a
 * file that is not a regular file owned by the user, is writable by others,
 * has a malformed line, a name that is not [A-Za-z0-9_.-]{1,64}, a token
 * shorter than 16 or longer than 4096 bytes or with whitespace or control
 * characters, a name or a token twice, or no entry at all.  A file readable
 * by others is accepted with a warning in *RET_WARN (to free; NULL if none). */
int tokens_load(const char *path, struct tokens **ret, char **ret_warn, char **ret_err);
void tokens_free(struct tokens *t);
size_t tokens_count(const struct tokens *t);
/* The name the token (LEN bytes, not NUL-terminated) belongs to, or NULL.
 * Takes the same time whichever entry matches, or none. */
const char *tokens_check(const struct tokens *t, const char *token, size_t len);
