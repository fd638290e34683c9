/* trust.c: what a command of a session with secrets gets besides its own
 * env: each secret's placeholder (NAME=ignph...), and the broker's CA in
 * its trust store with the variables the common runtimes read it from.
 *
 * The CA goes in once per sandbox (a reset, a fork or a resume is a new
 * one): the system bundle is read through the agent, any earlier copy of
 * the CA cut out, the CA added after a marker line, and written back; where
 * the bundle cannot be written (an ns sandbox of a server run as a user:
 * its /etc belongs to an unmapped uid) the same bundle goes to BUNDLE_TMP.
 * The key never leaves the server (egress/ca.c). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "egress/egress.h"
#include "session/session.h"
#include "tools/args.h"
#include "tools/result.h"
#include "tools/trust.h"

#define BUNDLE "/etc/ssl/certs/ca-certificates.crt"
#define BUNDLE_TMP "/tmp/.ignition-mcp-ca-bundle.crt"
#define BUNDLE_MAX (8u << 20)
#define MARK "# ignition-mcp egress CA (the server's; requests to hosts of secrets go through it)\n"

/* The bundle at PATH in the sandbox with the CA PEM after it, any copy of
 * it there before cut out: malloc'd, or NULL. */
static char *bundle_with(struct agent_conn *c, const char *pem, size_t *ret_len) {
  void *data = NULL;
  size_t len = 0;
  uint64_t size = 0;
  bool eof = false;
  char *err = NULL;
  if (agent_read_file(c, BUNDLE, 0, BUNDLE_MAX, NULL, &data, &len, &size, &eof, &err) < 0) {
    free(err);
    data = NULL;
    len = 0; /* none (a minimal image): the CA alone, and the system's trust is empty anyway */
  }
  char *mark = data ? memmem(data, len, MARK, strlen(MARK)) : NULL;
  if (mark)
    len = (size_t)(mark - (char *)data);
  size_t pl = strlen(pem);
  char *out = malloc(len + 1 + strlen(MARK) + pl + 1);
  if (out) {
    size_t n = 0;
    if (len)
      memcpy(out, data, len);
    n = len;
    if (n && out[n - 1] != '\n')
      out[n++] = '\n';
    memcpy(out + n, MARK, strlen(MARK));
    n += strlen(MARK);
    memcpy(out + n, pem, pl);
    n += pl;
    out[n] = 0;
    *ret_len = n;
  }
  free(data);
  return out;
}

int trust_env(struct lease *l, const char *tool, const char **env, size_t *n_env, size_t cap,
              char ***ret_owned, char **ret_err) {
  *ret_owned = NULL;
  struct egress *e = lease_egress(l);
  size_t ns = 0;
  char **sec = e ? egress_secret_env(e, &ns) : NULL;
  uint64_t gen = 0;
  const char *path = NULL;
  const char *pem = e ? egress_trust_pem(e, &gen, &path) : NULL;
  if (!pem) { /* no secrets, no request rules */
    for (size_t i = 0; i < ns; i++)
      free(sec[i]);
    free(sec);
    return 0;
  }
  if (!sec && (sec = calloc(1, sizeof *sec)) == NULL) {
    *ret_err = strdup("out of memory");
    return -ENOMEM;
  }
  /* A name the caller's env gives too would hide the placeholder. */
  for (size_t i = 0; i < ns; i++) {
    size_t kl = strcspn(sec[i], "=");
    for (size_t k = 0; k < *n_env; k++)
      if (strncmp(env[k], sec[i], kl + 1) == 0) {
        *ret_err = xasprintf("%s: env sets %.*s, the name of one of this session's secrets "
                             "(its placeholder is in every command's environment): leave it out",
                             tool, (int)kl, sec[i]);
        goto fail;
      }
  }
  if (!path) {
    /* Not in this sandbox yet. */
    struct agent_conn *c = lease_conn(l);
    size_t len;
    _cleanup_free_ char *b = bundle_with(c, pem, &len);
    char *err = NULL;
    if (!b) {
      *ret_err = strdup("out of memory");
      goto fail;
    }
    path = BUNDLE;
    if (agent_write_file(c, BUNDLE, 0644, b, len, NULL, &err) < 0) {
      free(err);
      err = NULL;
      path = BUNDLE_TMP;
      if (agent_write_file(c, BUNDLE_TMP, 0644, b, len, NULL, &err) < 0) {
        *ret_err = xasprintf("%s: cannot put the broker's CA in the sandbox's trust store: %s",
                             tool, err ? err : "write failed");
        free(err);
        goto fail;
      }
    }
    egress_trust_done(e, gen, path);
  }
  static const char *const vars[] = {"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
                                     "NODE_EXTRA_CA_CERTS", "PIP_CERT", "GIT_SSL_CAINFO"};
  size_t nv = path ? ARRAY_SIZE(vars) : 0;
  if (*n_env + ns + nv > cap) {
    *ret_err = xasprintf("%s: env has %zu variables; with this session's %zu secrets and the %zu "
                         "trust-store variables that is over the cap of %zu", tool, *n_env, ns,
                         nv, cap);
    goto fail;
  }
  char **owned = realloc(sec, (ns + nv + 1) * sizeof *owned);
  if (!owned) {
    *ret_err = strdup("out of memory");
    goto fail;
  }
  sec = owned;
  size_t n = ns;
  for (size_t i = 0; i < nv; i++) {
    /* The caller's own setting wins. */
    bool set = false;
    for (size_t k = 0; k < *n_env && !set; k++)
      set = strncmp(env[k], vars[i], strlen(vars[i])) == 0 && env[k][strlen(vars[i])] == '=';
    if (!set && !(owned[n] = xasprintf("%s=%s", vars[i], path)))
      break;
    if (!set)
      n++;
  }
  owned[n] = NULL;
  for (size_t i = 0; i < n; i++)
    env[(*n_env)++] = owned[i];
  *ret_owned = owned;
  return 0;
fail:
  for (size_t i = 0; i < ns; i++)
    free(sec[i]);
  free(sec);
  return -EINVAL;
}

void trust_env_free(char **owned) {
  for (size_t i = 0; owned && owned[i]; i++)
    free(owned[i]);
  free(owned);
}
