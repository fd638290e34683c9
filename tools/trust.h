/* trust.h: a command's environment in a session with secrets (trust.c). */
#pragma once

#include <stddef.h>

struct lease;

/* Adds to ENV (*N_ENV of CAP used) the placeholders of the lease's
 * session's secrets and, once its sandbox trusts the broker's CA (made so
 * here on the first call of each sandbox), the trust-store variables the
 * caller did not set.  *RET_OWNED: what to free with trust_env_free after
 * the call (NULL when nothing was added).  0, or -EINVAL with *RET_ERR
 * (a clash with the caller's env, a cap, a CA that cannot be put in). */
int trust_env(struct lease *l, const char *tool, const char **env, size_t *n_env, size_t cap,
              char ***ret_owned, char **ret_err);
void trust_env_free(char **owned);
