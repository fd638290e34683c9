/* secrets.c: the operator's secrets (IGN_MCP_SECRETS), read once at
 * startup, and a session's placeholders for them.
 *
 * The file is {"NAME": {"value": "...", "hosts": ["api.example.com",
 * "*.example.org"], "cleartext": false}} (cleartext: the value may go over
 * plain HTTP too; by default only over TLS): it must be the server user's regular file, read by
 * nobody else.  A bad file stops the server with a message naming the
 * entry, never a value (jansson's own error text may quote the file, so
 * only its line and column are given).  Values stay in this process: a
 * sandbox sees a placeholder per session (SECRET_TOKEN_LEN characters),
 * which intercept.c replaces by the value in requests to the secret's
 * hosts only.  The table never changes after startup and is freed only at
 * shutdown, once no connection uses it. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"
#include "egress/egress_int.h"

#define SECRETS_FILE_MAX (1u << 20)

static struct secret *table;
static size_t n_table;

static bool name_ok(const char *n) {
  size_t len = strlen(n);
  if (!len || len > SECRET_NAME_MAX || !(n[0] == '_' || (n[0] >= 'A' && n[0] <= 'Z')))
    return false;
  for (size_t i = 1; i < len; i++)
    if (!(n[i] == '_' || (n[i] >= 'A' && n[i] <= 'Z') || (n[i] >= '0' && n[i] <= '9')))
      return false;
  return true;
}

static bool value_ok(const char *v, size_t len) {
  if (!len || len > SECRET_VALUE_MAX || strlen(v) != len)
    return false;
  for (size_t i = 0; i < len; i++)
    if (v[i] < 0x20 || v[i] > 0x7e)
      return false;
  return true;
}

static void secret_free(struct secret *s) {
  free(s->name);
  if (s->value) {
    explicit_bzero(s->value, s->len);
    free(s->value);
  }
  egress_policy_free(&s->hosts);
}

/* One entry, NAME: V.  0 or -EINVAL with *RET_ERR naming it. */
static int entry(const char *path, const char *name, const json_t *v, struct secret *out,
                 char **ret_err) {
  if (!name_ok(name)) {
    *ret_err = xasprintf("%s: the name of an entry is not one: names are A-Z, 0-9 and _, "
                         "not starting with a digit, at most %u characters (it becomes an "
                         "environment variable)", path, SECRET_NAME_MAX);
    return -EINVAL;
  }
  const json_t *value = json_object_get(v, "value"), *hosts = json_object_get(v, "hosts"),
               *clear = json_object_get(v, "cleartext");
  if (!json_is_object(v) || json_object_size(v) != 2u + (clear != NULL) || !json_is_string(value) ||
      !json_is_array(hosts) || (clear && !json_is_boolean(clear))) {
    *ret_err = xasprintf("%s: entry %s must be {\"value\": \"...\", \"hosts\": [...]} and "
                         "optionally \"cleartext\": true, nothing else", path, name);
    return -EINVAL;
  }
  out->cleartext = json_is_true(clear);
  if (!value_ok(json_string_value(value), json_string_length(value))) {
    *ret_err = xasprintf("%s: entry %s: the value must be 1 to %u printable ASCII characters "
                         "(no newline, tab or NUL)", path, name, SECRET_VALUE_MAX);
    return -EINVAL;
  }
  size_t n = json_array_size(hosts);
  if (!n || n > EGRESS_MAX_RULES) {
    *ret_err = xasprintf("%s: entry %s: hosts must hold 1 to %u host names in allow_hosts "
                         "syntax", path, name, EGRESS_MAX_RULES);
    return -EINVAL;
  }
  const char *entries[EGRESS_MAX_RULES];
  size_t lens[EGRESS_MAX_RULES];
  for (size_t i = 0; i < n; i++) {
    const json_t *h = json_array_get(hosts, i);
    if (!json_is_string(h)) {
      *ret_err = xasprintf("%s: entry %s: hosts[%zu] must be a string", path, name, i);
      return -EINVAL;
    }
    entries[i] = json_string_value(h);
    lens[i] = json_string_length(h);
  }
  _cleanup_free_ char *err = NULL;
  if (egress_policy_parse(entries, lens, n, &out->hosts, &err) < 0) {
    *ret_err = xasprintf("%s: entry %s: %s", path, name, err ? err : "hosts are not valid");
    return -EINVAL;
  }
  for (size_t i = 0; i < out->hosts.n; i++)
    if (*out->hosts.rules[i].method) {
      *ret_err = xasprintf("%s: entry %s: hosts[%zu] is a request rule; a secret's hosts are "
                           "host names (a session's allow_hosts may limit its requests)",
                           path, name, i);
      return -EINVAL;
    }
  out->name = strdup(name);
  out->len = json_string_length(value);
  out->value = strdup(json_string_value(value));
  if (!out->name || !out->value) {
    *ret_err = strdup("out of memory");
    return -ENOMEM;
  }
  return 0;
}

int secrets_init(const char *path, char **ret_err) {
  if (!path || !*path)
    return 0;
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    *ret_err = xasprintf("IGN_MCP_SECRETS=%s: %s%s", path, strerror(errno),
                         errno == ELOOP ? " (a symlink: name the file itself)" : "");
    return -EINVAL;
  }
  struct stat st;
  if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      (st.st_mode & 077) || st.st_size > SECRETS_FILE_MAX) {
    *ret_err = xasprintf("IGN_MCP_SECRETS=%s must be a regular file of this server's user "
                         "(uid %u) that no one else may read or write (chmod 600), of at "
                         "most %u bytes", path, (unsigned)geteuid(), SECRETS_FILE_MAX);
    close(fd);
    return -EINVAL;
  }
  json_error_t je;
  json_t *j = json_loadfd(fd, JSON_REJECT_DUPLICATES, &je);
  close(fd);
  if (!j || !json_is_object(j)) {
    /* je.text may quote what it read: a value.  Line and column only. */
    *ret_err = j ? xasprintf("IGN_MCP_SECRETS=%s must hold one JSON object of entries", path)
                 : xasprintf("IGN_MCP_SECRETS=%s is not valid JSON (line %d, column %d), or "
                             "names an entry twice", path, je.line, je.column);
    json_decref(j);
    return -EINVAL;
  }
  size_t n = json_object_size(j);
  if (n > SECRETS_MAX) {
    *ret_err = xasprintf("IGN_MCP_SECRETS=%s has %zu entries; at most %u", path, n, SECRETS_MAX);
    json_decref(j);
    return -EINVAL;
  }
  struct secret *t = calloc(n ? n : 1, sizeof *t);
  size_t i = 0;
  const char *name;
  json_t *v;
  int r = t ? 0 : -ENOMEM;
  json_object_foreach(j, name, v) {
    if (r < 0)
      break;
    r = entry(path, name, v, &t[i], ret_err);
    i++;
  }
  json_decref(j);
  if (r < 0) {
    for (size_t k = 0; t && k < i; k++)
      secret_free(&t[k]);
    free(t);
    if (!*ret_err)
      *ret_err = strdup("out of memory");
    return r;
  }
  table = t;
  n_table = n;
  return 0;
}

void secrets_shutdown(void) {
  for (size_t i = 0; i < n_table; i++)
    secret_free(&table[i]);
  free(table);
  table = NULL;
  n_table = 0;
}

size_t secrets_count(void) { return n_table; }

const struct secret *secret_find(const char *name) {
  for (size_t i = 0; i < n_table; i++)
    if (strcmp(table[i].name, name) == 0)
      return &table[i];
  return NULL;
}

int secret_token(char out[SECRET_TOKEN_LEN + 1]) {
  uint8_t b[16];
  if (getrandom(b, sizeof b, 0) != sizeof b)
    return -EIO;
  static const char hex[] = "0123456789abcdef";
  memcpy(out, "ignph", 5);
  for (size_t i = 0; i < sizeof b; i++) {
    out[5 + 2 * i] = hex[b[i] >> 4];
    out[6 + 2 * i] = hex[b[i] & 15];
  }
  out[SECRET_TOKEN_LEN] = 0;
  return 0;
}
