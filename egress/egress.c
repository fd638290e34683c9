/* egress.c: a session's egress from a tool's arguments (network,
 * allow_hosts) within the operator's bounds, what results say about it,
 * and the startup log's line.  The checks answer the MCP client (an AI
 * agent), so each message says what was wrong and what to send instead. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "egress/egress_int.h"

const char *egress_mode_name(enum egress_mode m) {
  return m == EGRESS_MODE_OPEN ? "open" : m == EGRESS_MODE_ALLOW ? "allow" : "none";
}

/* What IGN_MCP_NET lets sessions ask, for messages. */
static const char *modes_allowed(void) {
  switch (egress_cfg.max_mode) {
  case EGRESS_MODE_OPEN:
    return "\"none\", \"allow\" or \"open\"";
  case EGRESS_MODE_ALLOW:
    return "\"none\" or \"allow\"";
  default:
    return "only \"none\"";
  }
}

static const char *net_setting(void) {
  return egress_cfg.off ? "off" : egress_mode_name(egress_cfg.max_mode);
}

/* The JSON type of V as a message names it. */
static const char *json_type_word(const json_t *v) {
  switch (json_typeof(v)) {
  case JSON_OBJECT: return "an object";
  case JSON_ARRAY: return "an array";
  case JSON_STRING: return "a string";
  case JSON_INTEGER: return "an integer";
  case JSON_REAL: return "a number";
  case JSON_TRUE:
  case JSON_FALSE: return "a boolean";
  default: return "null";
  }
}

static int parse_mode(const char *tool, const json_t *network, enum egress_mode *ret,
                      char **ret_err) {
  if (!network || json_is_null(network)) {
    *ret = EGRESS_MODE_NONE;
    return 0;
  }
  if (json_is_boolean(network)) {
    *ret_err = xasprintf("%s: 'network' must be a string, \"none\", \"allow\" or \"open\"; the "
                         "boolean form (true/false) is gone: send \"allow\" with allow_hosts to "
                         "reach listed hosts, \"open\" for any public destination, or \"none\"",
                         tool);
    return -EINVAL;
  }
  const char *s = json_string_value(network);
  if (s && strcmp(s, "none") == 0)
    *ret = EGRESS_MODE_NONE;
  else if (s && strcmp(s, "allow") == 0)
    *ret = EGRESS_MODE_ALLOW;
  else if (s && strcmp(s, "open") == 0)
    *ret = EGRESS_MODE_OPEN;
  else {
    *ret_err = xasprintf("%s: 'network' must be \"none\", \"allow\" (with allow_hosts) or "
                         "\"open\", not %s%.40s%s",
                         tool, s ? "\"" : "", s ? s : json_type_word(network), s ? "\"" : "");
    return -EINVAL;
  }
  if (*ret > egress_cfg.max_mode) {
    *ret_err = xasprintf("%s: network \"%s\" is refused: this server runs with IGN_MCP_NET=%s, "
                         "which lets sessions ask %s; ask for one of those, or have the operator "
                         "set IGN_MCP_NET", tool, s, net_setting(), modes_allowed());
    return -EINVAL;
  }
  return 0;
}

static int parse_hosts(const char *tool, enum egress_mode mode, const json_t *allow_hosts,
                       struct egress_policy *ret, char **ret_err) {
  bool given = allow_hosts && !json_is_null(allow_hosts);
  if (given && !json_is_array(allow_hosts)) {
    *ret_err = xasprintf("%s: 'allow_hosts' must be an array of host names such as [\"pypi.org\", "
                         "\"*.pythonhosted.org\", \"example.com:8443\"], not %s",
                         tool, json_type_word(allow_hosts));
    return -EINVAL;
  }
  if (mode != EGRESS_MODE_ALLOW) {
    if (!given)
      return 0;
    *ret_err = xasprintf("%s: allow_hosts goes only with network \"allow\" (network is \"%s\"): "
                         "send network \"allow\" with it, or leave allow_hosts out",
                         tool, egress_mode_name(mode));
    return -EINVAL;
  }
  if (!given || !json_array_size(allow_hosts)) {
    *ret_err = xasprintf("%s: network \"allow\" needs allow_hosts, a non-empty array of host "
                         "names such as [\"pypi.org\", \"*.pythonhosted.org\", \"example.com:8443\"]",
                         tool);
    return -EINVAL;
  }
  size_t n = json_array_size(allow_hosts);
  if (n > EGRESS_MAX_RULES) {
    *ret_err = xasprintf("%s: allow_hosts has %zu entries; at most %u are accepted", tool, n,
                         EGRESS_MAX_RULES);
    return -EINVAL;
  }
  const char *entries[EGRESS_MAX_RULES];
  size_t lens[EGRESS_MAX_RULES];
  for (size_t i = 0; i < n; i++) {
    const json_t *v = json_array_get(allow_hosts, i);
    if (!json_is_string(v)) {
      *ret_err = xasprintf("%s: allow_hosts[%zu] must be a string: a host name such as "
                           "\"pypi.org\", \"*.pypi.org\" or \"pypi.org:443\"", tool, i);
      return -EINVAL;
    }
    entries[i] = json_string_value(v);
    lens[i] = json_string_length(v);
  }
  _cleanup_free_ char *err = NULL;
  int r = egress_policy_parse(entries, lens, n, ret, &err);
  if (r < 0)
    *ret_err = xasprintf("%s: %s", tool, err ? err : "allow_hosts is not valid");
  return r;
}

static struct egress *egress_alloc(enum egress_mode mode) {
  struct egress *e = calloc(1, sizeof *e);
  if (!e)
    return NULL;
  e->mode = mode;
  pthread_mutex_init(&e->att_lock, NULL);
  pthread_mutex_init(&e->stats_lock, NULL);
  pthread_cond_init(&e->stats_done, NULL);
  pthread_mutex_init(&e->synth_lock, NULL);
  pthread_mutex_init(&e->upd_lock, NULL);
  names_owner_key("", e->owner_key); /* stdio's, until egress_set_session */
  e->rec = record_new();
  e->quota = resolve_quota_new();
  if (!e->rec || !e->quota) {
    egress_free(e);
    return NULL;
  }
  return e;
}

/* SECRETS (NULL, or an array of names) as a session's placeholders; KEEP
 * (N_KEEP) are the ones it has: a name it keeps keeps its placeholder (its
 * programs hold it).  0 or -EINVAL with *RET_ERR. */
static int parse_secrets(const char *tool, const json_t *secrets, const struct binding *keep,
                         size_t n_keep, struct binding **ret, size_t *ret_n, char **ret_err) {
  *ret = NULL;
  *ret_n = 0;
  if (!secrets || json_is_null(secrets))
    return 0;
  size_t n = json_array_size(secrets);
  if (!json_is_array(secrets) || n > SECRETS_MAX) {
    *ret_err = xasprintf("%s: 'secrets' must be an array of at most %u secret names, such as "
                         "[\"GITHUB_TOKEN\"]", tool, SECRETS_MAX);
    return -EINVAL;
  }
  if (n && !secrets_count()) {
    *ret_err = xasprintf("%s: this server holds no secrets (the operator names them in a file "
                         "given by IGN_MCP_SECRETS); leave 'secrets' out", tool);
    return -EINVAL;
  }
  struct binding *b = calloc(n ? n : 1, sizeof *b);
  if (!b) {
    *ret_err = strdup("out of memory");
    return -ENOMEM;
  }
  for (size_t i = 0; i < n; i++) {
    const char *name = json_string_value(json_array_get(secrets, i));
    const struct secret *s = name ? secret_find(name) : NULL;
    bool twice = false;
    for (size_t k = 0; s && k < i; k++)
      twice |= b[k].s == s;
    if (!s || twice) {
      *ret_err = !name ? xasprintf("%s: secrets[%zu] must be a string, the name of a secret", tool, i)
                 : twice ? xasprintf("%s: secrets names %.64s twice", tool, name)
                         : xasprintf("%s: secrets[%zu] \"%.64s\" is not a secret this server "
                                     "holds (the operator names them in IGN_MCP_SECRETS)",
                                     tool, i, name);
      free(b);
      return -EINVAL;
    }
    b[i].s = s;
    const struct binding *had = NULL;
    for (size_t k = 0; k < n_keep; k++)
      if (keep[k].s == s)
        had = &keep[k];
    if (had)
      memcpy(b[i].token, had->token, sizeof b[i].token);
    else if (secret_token(b[i].token) < 0) {
      *ret_err = strdup("cannot make a placeholder: no randomness");
      free(b);
      return -EIO;
    }
  }
  *ret = b;
  *ret_n = n;
  return 0;
}

/* POL gains the hosts of each secret of B (its values may go there, so
 * the sandbox may reach them), each rule once.  0 or -EINVAL. */
static int add_secret_hosts(const char *tool, struct egress_policy *pol, const struct binding *b,
                            size_t n, char **ret_err) {
  for (size_t i = 0; i < n; i++)
    for (size_t k = 0; k < b[i].s->hosts.n; k++) {
      struct egress_rule r0 = b[i].s->hosts.rules[k];
      r0.implied = true;
      r0.method[0] = r0.path[0] = 0;
      const struct egress_rule *r = &r0;
      bool have = false;
      for (size_t j = 0; j < pol->n && !have; j++)
        have = egress_rule_same(&pol->rules[j], r);
      if (have)
        continue;
      if (pol->n >= EGRESS_MAX_RULES) {
        *ret_err = xasprintf("%s: allow_hosts and the hosts of the secrets come to over %u rules",
                             tool, EGRESS_MAX_RULES);
        return -EINVAL;
      }
      struct egress_rule *m = realloc(pol->rules, (pol->n + 1) * sizeof *m);
      if (!m) {
        *ret_err = strdup("out of memory");
        return -ENOMEM;
      }
      pol->rules = m;
      pol->rules[pol->n++] = *r;
    }
  return 0;
}

/* The policy of NETWORK, ALLOW_HOSTS and the secrets B (N_B): "none" with
 * secrets is "allow" for their hosts, unless NONE_IS_NONE (network_update
 * was sent network "none"). */
static int make_policy(const char *tool, const json_t *network, const json_t *allow_hosts,
                       const struct binding *b, size_t n_b, bool none_is_none,
                       enum egress_mode *ret_mode, struct egress_policy *ret_pol, char **ret_err) {
  enum egress_mode mode;
  int r = parse_mode(tool, network, &mode, ret_err);
  if (r < 0)
    return r;
  if (n_b && mode == EGRESS_MODE_NONE && !none_is_none) {
    json_t *allow = json_string("allow");
    r = parse_mode(tool, allow, &mode, ret_err); /* IGN_MCP_NET=off refuses it */
    json_decref(allow);
    if (r < 0)
      return r;
  }
  struct egress_policy pol = {0};
  bool hosts = allow_hosts && !json_is_null(allow_hosts);
  if (mode != EGRESS_MODE_ALLOW || hosts || !n_b)
    r = parse_hosts(tool, mode, allow_hosts, &pol, ret_err);
  if (r == 0 && mode == EGRESS_MODE_ALLOW)
    r = add_secret_hosts(tool, &pol, b, n_b, ret_err);
  for (size_t i = 0; r == 0 && i < pol.n; i++)
    if (*pol.rules[i].method) {
      _cleanup_free_ char *why = NULL;
      if (ca_ensure(&why) < 0) {
        *ret_err = xasprintf("%s: allow_hosts has a request rule (\"host METHOD /prefix\"), "
                             "which the broker checks by reading the requests, but it has no CA "
                             "to do so: %s; use plain host rules", tool, why ? why : "?");
        r = -EINVAL;
      }
      break;
    }
  if (r < 0) {
    egress_policy_free(&pol);
    return r;
  }
  *ret_mode = mode;
  *ret_pol = pol;
  return 0;
}

int egress_new_secrets(const char *tool, const json_t *network, const json_t *allow_hosts,
                       const json_t *secrets, struct egress **ret, char **ret_err) {
  struct binding *b;
  size_t n_b;
  int r = parse_secrets(tool, secrets, NULL, 0, &b, &n_b, ret_err);
  if (r < 0)
    return r;
  enum egress_mode mode;
  struct egress_policy pol = {0};
  r = make_policy(tool, network, allow_hosts, b, n_b, false, &mode, &pol, ret_err);
  if (r < 0) {
    free(b);
    return r;
  }
  struct egress *e = egress_alloc(mode);
  if (!e) {
    egress_policy_free(&pol);
    free(b);
    *ret_err = strdup("out of memory");
    return -ENOMEM;
  }
  e->pol = pol;
  e->bind = b;
  e->n_bind = n_b;
  *ret = e;
  return 0;
}

int egress_new(const char *tool, const json_t *network, const json_t *allow_hosts,
               struct egress **ret, char **ret_err) {
  return egress_new_secrets(tool, network, allow_hosts, NULL, ret, ret_err);
}

const char *egress_trust_pem(struct egress *e, uint64_t *ret_gen, const char **ret_path) {
  pthread_mutex_lock(&e->synth_lock);
  bool any = e->n_bind > 0;
  for (size_t i = 0; !any && i < e->pol.n; i++)
    any = *e->pol.rules[i].method != 0; /* request rules: their hosts are intercepted */
  pthread_mutex_unlock(&e->synth_lock);
  pthread_mutex_lock(&e->att_lock);
  *ret_gen = e->att_gen;
  *ret_path = e->trust_gen == e->att_gen ? e->trust_path : NULL;
  pthread_mutex_unlock(&e->att_lock);
  return any ? ca_pem() : NULL;
}

void egress_trust_done(struct egress *e, uint64_t gen, const char *path) {
  pthread_mutex_lock(&e->att_lock);
  e->trust_gen = gen;
  e->trust_path = path; /* a string constant of trust.c */
  pthread_mutex_unlock(&e->att_lock);
}

char **egress_secret_env(const struct egress *e, size_t *ret_n) {
  pthread_mutex_lock((pthread_mutex_t *)&e->synth_lock);
  size_t n = e->n_bind;
  char **v = calloc(n + 1, sizeof *v);
  for (size_t i = 0; v && i < n; i++)
    if (!(v[i] = xasprintf("%s=%s", e->bind[i].s->name, e->bind[i].token))) {
      for (size_t k = 0; k < i; k++)
        free(v[k]);
      free(v);
      v = NULL;
    }
  pthread_mutex_unlock((pthread_mutex_t *)&e->synth_lock);
  *ret_n = v ? n : 0;
  return v;
}

int egress_clone(const struct egress *src, struct egress **ret) {
  struct egress *e = egress_alloc(EGRESS_MODE_NONE); /* names_copy sets it */
  if (!e)
    return -ENOMEM;
  /* The policy of this moment, and the fork's programs hold the source's
   * answers: the same address must stand for the same name (and a new
   * name must not take its number). */
  if (names_copy(e, (struct egress *)src) < 0) {
    egress_free(e);
    return -ENOMEM;
  }
  memcpy(e->owner_key, src->owner_key, EGRESS_OWNER_KEY);
  *ret = e;
  return 0;
}

/* P's rules as allow_hosts entries (the ones added for secrets too, when
 * IMPLIED). */
static json_t *policy_json_of(const struct egress_policy *p, bool implied) {
  json_t *a = json_array();
  for (size_t i = 0; i < p->n; i++) {
    if (p->rules[i].implied && !implied)
      continue;
    char buf[EGRESS_ENTRY_MAX + 1];
    egress_rule_format(&p->rules[i], buf, sizeof buf);
    json_array_append_new(a, json_string(buf));
  }
  return a;
}

static json_t *policy_json(const struct egress_policy *p) { return policy_json_of(p, true); }

bool egress_requests_checked(const struct egress *e, const char *host, uint16_t port) {
  return e->mode == EGRESS_MODE_ALLOW &&
         egress_policy_requests_checked(&e->pol, host, strlen(host), port);
}

/* E's mode and rules, read together (the broker may be changing them). */
static json_t *rules_json(const struct egress *e, enum egress_mode *ret_mode) {
  pthread_mutex_lock((pthread_mutex_t *)&e->synth_lock);
  json_t *a = policy_json(&e->pol);
  *ret_mode = e->mode;
  pthread_mutex_unlock((pthread_mutex_t *)&e->synth_lock);
  return a;
}

json_t *egress_save(const struct egress *e) {
  json_t *names = json_array();
  json_t *wild = json_array();
  pthread_mutex_lock((pthread_mutex_t *)&e->synth_lock);
  json_t *rules = policy_json_of(&e->pol, false); /* the secrets' hosts come with them */
  enum egress_mode mode = e->mode;
  for (uint32_t i = 0; i < e->n_synth; i++)
    json_array_append_new(names, json_string(e->synth[i]));
  for (size_t i = 0; e->wild_count && i < e->pol.n; i++)
    json_array_append_new(wild, json_integer(e->wild_count[i]));
  pthread_mutex_unlock((pthread_mutex_t *)&e->synth_lock);
  /* The bytes it moved and the names it looked up under each wildcard
   * rule: IGN_MCP_EGRESS_MAX_MB and IGN_MCP_EGRESS_WILDCARD_NAMES go on
   * counting from them. */
  json_t *sec = json_array();
  pthread_mutex_lock((pthread_mutex_t *)&e->synth_lock);
  for (size_t i = 0; i < e->n_bind; i++)
    json_array_append_new(sec, json_pack("{s:s, s:s}", "name", e->bind[i].s->name, "token",
                                         e->bind[i].token));
  pthread_mutex_unlock((pthread_mutex_t *)&e->synth_lock);
  return json_pack("{s:s, s:o, s:o, s:I, s:I, s:o, s:o}", "mode", egress_mode_name(mode),
                   "allow_hosts", rules, "names", names, "bytes_up", (json_int_t)e->bytes_up,
                   "bytes_down", (json_int_t)e->bytes_down, "wildcard_names", wild, "secrets", sec);
}

int egress_load(const json_t *j, struct egress **ret, char **ret_err) {
  const json_t *mode = json_object_get(j, "mode"), *hosts = json_object_get(j, "allow_hosts"),
               *names = json_object_get(j, "names");
  if (!json_is_string(mode) || (hosts && !json_is_array(hosts)) ||
      (names && !json_is_array(names))) {
    *ret_err = strdup("its saved network policy is damaged");
    return -EINVAL;
  }
  /* "none" and "open" take no allow_hosts. */
  bool allow = strcmp(json_string_value(mode), "allow") == 0;
  /* "allow" for the hosts of its secrets alone: made as "none", then
   * those hosts are added (below). */
  bool only_secrets = allow && !json_array_size(hosts) &&
                      json_array_size(json_object_get(j, "secrets"));
  struct egress *e = NULL;
  json_t *none = json_string("none");
  int r = egress_new("its saved network policy", only_secrets ? none : mode,
                     allow && !only_secrets ? hosts : NULL, &e, ret_err);
  json_decref(none);
  if (r < 0)
    return r;
  if (only_secrets) {
    enum egress_mode m;
    if ((r = parse_mode("its saved network policy", mode, &m, ret_err)) < 0) {
      egress_free(e);
      return r;
    }
    e->mode = m;
  }
  size_t n = json_array_size(names);
  const char **v = n ? calloc(n, sizeof *v) : NULL;
  for (size_t i = 0; v && i < n; i++)
    v[i] = json_string_value(json_array_get(names, i));
  for (size_t i = 0; v && i < n; i++)
    if (!v[i])
      r = -EINVAL;
  if (r == 0 && n)
    r = v ? names_restore(e, v, n) : -ENOMEM;
  free(v);
  if (r < 0) {
    egress_free(e);
    *ret_err = strdup("its saved network policy is damaged (the names its sandbox was given)");
    return r;
  }
  const json_t *wild = json_object_get(j, "wildcard_names");
  size_t nw = json_array_size(wild) < e->pol.n ? json_array_size(wild) : e->pol.n;
  uint32_t counts[EGRESS_MAX_RULES] = {0};
  for (size_t i = 0; i < nw; i++) {
    json_int_t c = json_integer_value(json_array_get(wild, i));
    counts[i] = c > 0 ? (c > UINT32_MAX ? UINT32_MAX : (uint32_t)c) : 0;
  }
  if (names_restore_wild(e, counts, nw) < 0) {
    egress_free(e);
    *ret_err = strdup("out of memory");
    return -ENOMEM;
  }
  /* The placeholders its programs hold: the same secrets, if this server
   * still has them. */
  const json_t *sec = json_object_get(j, "secrets");
  size_t ns = json_array_size(sec);
  if (ns > SECRETS_MAX || (sec && !json_is_array(sec))) {
    egress_free(e);
    *ret_err = strdup("its saved network policy is damaged (its secrets)");
    return -EINVAL;
  }
  e->bind = calloc(ns ? ns : 1, sizeof *e->bind);
  for (size_t i = 0; e->bind && i < ns; i++) {
    const json_t *x = json_array_get(sec, i);
    const char *name = json_string_value(json_object_get(x, "name")),
               *tok = json_string_value(json_object_get(x, "token"));
    const struct secret *s = name ? secret_find(name) : NULL;
    if (!s || !tok || strlen(tok) != SECRET_TOKEN_LEN || strncmp(tok, "ignph", 5) != 0 ||
        strspn(tok + 5, "0123456789abcdef") != SECRET_TOKEN_LEN - 5) {
      *ret_err = s || !name ? strdup("its saved network policy is damaged (its secrets)")
                            : xasprintf("its secret %.64s is not one this server holds "
                                        "(IGN_MCP_SECRETS)", name);
      egress_free(e);
      return -EINVAL;
    }
    e->bind[i].s = s;
    memcpy(e->bind[i].token, tok, SECRET_TOKEN_LEN + 1);
    e->n_bind = i + 1;
  }
  /* The hosts of its secrets, as they were added at open. */
  if (e->mode == EGRESS_MODE_ALLOW && add_secret_hosts("its saved network policy", &e->pol, e->bind,
                                                       e->n_bind, ret_err) < 0) {
    egress_free(e);
    return -EINVAL;
  }
  json_int_t up = json_integer_value(json_object_get(j, "bytes_up")),
             down = json_integer_value(json_object_get(j, "bytes_down"));
  e->bytes_up = up > 0 ? (uint64_t)up : 0;
  e->bytes_down = down > 0 ? (uint64_t)down : 0;
  *ret = e;
  return 0;
}

static int update_locked(struct egress *e, bool net_given, bool hosts_given, bool secrets_given,
                         const json_t *network, const json_t *allow_hosts, const json_t *secrets,
                         json_t **ret_info, char **ret_err);

int egress_update(struct egress *e, const json_t *network, const json_t *allow_hosts,
                  const json_t *secrets, json_t **ret_info, char **ret_err) {
  static const char tool[] = "network_update";
  bool net_given = network && !json_is_null(network),
       hosts_given = allow_hosts && !json_is_null(allow_hosts),
       secrets_given = secrets && !json_is_null(secrets);
  if (!net_given && !hosts_given && !secrets_given) {
    *ret_err = xasprintf("%s: nothing to change: send network (\"none\", \"allow\" or "
                         "\"open\"), allow_hosts (which alone means network \"allow\") or "
                         "secrets", tool);
    return -EINVAL;
  }
  /* One update at a time: what it reads as the policy now stays so until
   * its own is in place (only an update changes it). */
  pthread_mutex_lock(&e->upd_lock);
  int res = update_locked(e, net_given, hosts_given, secrets_given, network, allow_hosts,
                          secrets, ret_info, ret_err);
  pthread_mutex_unlock(&e->upd_lock);
  return res;
}

static int update_locked(struct egress *e, bool net_given, bool hosts_given, bool secrets_given,
                         const json_t *network, const json_t *allow_hosts, const json_t *secrets,
                         json_t **ret_info, char **ret_err) {
  static const char tool[] = "network_update";
  /* What the session has now. */
  pthread_mutex_lock(&e->synth_lock);
  enum egress_mode was = e->mode;
  json_t *prev_rules = policy_json_of(&e->pol, false);
  json_t *prev_shown = policy_json(&e->pol);
  size_t n_had = e->n_bind;
  struct binding *had = calloc(n_had ? n_had : 1, sizeof *had);
  if (had && n_had)
    memcpy(had, e->bind, n_had * sizeof *had);
  pthread_mutex_unlock(&e->synth_lock);
  struct binding *b = NULL;
  size_t n_b = 0;
  int r = had ? 0 : -ENOMEM;
  if (r == 0 && secrets_given)
    r = parse_secrets(tool, secrets, had, n_had, &b, &n_b, ret_err);
  else if (r == 0) {
    b = steal_ptr(had);
    n_b = n_had;
  }
  /* allow_hosts alone: "allow" with those; secrets alone: the mode it has. */
  /* "allow" only for the hosts of secrets it no longer has: "none". */
  bool none_left = !net_given && !hosts_given && was == EGRESS_MODE_ALLOW && !n_b &&
                   !json_array_size(prev_rules);
  json_t *mode_arg = net_given ? json_incref((json_t *)network)
                     : json_string(hosts_given ? "allow" : none_left ? "none" : egress_mode_name(was));
  /* "allow" without allow_hosts keeps the rules it has (but for the hosts
   * of secrets it no longer has: those are added again from B). */
  const json_t *hosts_arg = allow_hosts;
  bool keep = !hosts_given && was == EGRESS_MODE_ALLOW;
  if (r == 0 && !hosts_given && json_string_value(mode_arg) &&
      strcmp(json_string_value(mode_arg), "allow") == 0 && !keep && !n_b) {
    *ret_err = xasprintf("%s: network \"allow\" needs allow_hosts (the session's network is "
                         "\"%s\", so it has none to keep): send allow_hosts too, such as "
                         "[\"pypi.org\", \"*.pythonhosted.org\"]", tool, egress_mode_name(was));
    r = -EINVAL;
  }
  enum egress_mode mode = EGRESS_MODE_NONE;
  struct egress_policy pol = {0};
  bool to_allow = json_string_value(mode_arg) && strcmp(json_string_value(mode_arg), "allow") == 0;
  if (r == 0)
    r = make_policy(tool, mode_arg,
                    keep && to_allow ? (json_array_size(prev_rules) ? prev_rules : NULL) : hosts_arg,
                    b, n_b, net_given,
                    &mode, &pol, ret_err);
  json_decref(mode_arg);
  free(had);
  if (r < 0) {
    if (r == -ENOMEM && !*ret_err)
      *ret_err = xasprintf("%s: out of memory", tool);
    egress_policy_free(&pol);
    free(b);
    json_decref(prev_rules);
    json_decref(prev_shown);
    return r;
  }
  json_decref(prev_rules);
  json_t *line = json_object();
  json_object_set_new(line, "kind", json_string("policy"));
  json_object_set_new(line, "mode", json_string(egress_mode_name(mode)));
  json_object_set_new(line, "allow_hosts", policy_json(&pol));
  json_t *names = json_array();
  for (size_t i = 0; i < n_b; i++)
    json_array_append_new(names, json_string(b[i].s->name));
  json_object_set_new(line, "secrets", names);
  json_object_set_new(line, "previous_mode", json_string(egress_mode_name(was)));
  unsigned reset = 0;
  struct binding *old_b = b;
  size_t old_n = n_b;
  r = broker_set_policy(e, mode, &pol, &old_b, &old_n, line, &reset);
  json_decref(line);
  egress_policy_free(&pol); /* the old one, or the new one when nothing changed */
  free(old_b);
  if (r < 0) {
    json_decref(prev_shown);
    *ret_err = r == -ESHUTDOWN ? xasprintf("%s: the server is shutting down", tool)
                               : xasprintf("%s: out of memory", tool);
    return r;
  }
  json_t *o = egress_summary(e, NULL);
  json_object_set_new(o, "previous",
                      json_pack("{s:s, s:o}", "mode", egress_mode_name(was), "allowed_rules",
                                prev_shown));
  json_object_set_new(o, "connections_reset", json_integer(reset));
  *ret_info = o;
  return 0;
}

void egress_set_session(struct egress *e, const char *session_id, const char *owner) {
  if (e->session_id)
    return;
  names_owner_key(owner ? owner : "", e->owner_key);
  e->session_id = strdup(session_id ? session_id : "");
  record_set_log(e->rec, session_id);
}

void egress_free(struct egress *e) {
  if (!e)
    return;
  egress_detach(e);
  if (e->rec)
    record_free(e->rec);
  if (e->quota)
    resolve_quota_put(e->quota);
  intercept_share_unref(e->icpt);
  egress_policy_free(&e->pol);
  names_free(e);
  pthread_mutex_destroy(&e->synth_lock);
  pthread_mutex_destroy(&e->upd_lock);
  free(e->bind);
  pthread_mutex_destroy(&e->att_lock);
  pthread_mutex_destroy(&e->stats_lock);
  pthread_cond_destroy(&e->stats_done);
  free(e->session_id);
  free(e);
}

static json_t *log_path_json(const struct egress *e) {
  const char *p = record_log_path(e->rec);
  return p ? json_string(p) : json_null();
}

json_t *egress_summary(const struct egress *e, const char *capture_error) {
  json_t *o = json_object();
  enum egress_mode mode;
  json_t *rules = rules_json(e, &mode);
  json_object_set_new(o, "mode", json_string(egress_mode_name(mode)));
  json_object_set_new(o, "allowed_rules", rules);
  json_object_set_new(o, "egress_log_path", log_path_json(e));
  if (capture_error)
    json_object_set_new(o, "capture", json_string(capture_error));
  return o;
}

/* The capture's refusal counters of the attached sandbox, read by its
 * backend (ns) or asked of its agent, when they come within
 * EGRESS_STATS_MS (a failure leaves the record as it is): no broker lock
 * is held meanwhile.  The attachment is not detached (and its sandbox not
 * destroyed) until the reading is over (stats_calls). */
static void read_refused_packets(struct egress *e) {
  pthread_mutex_lock(&e->stats_lock);
  pthread_mutex_lock(&e->att_lock);
  struct agent_conn *c = e->link ? e->link->c : NULL;
  egress_counters_fn counters = e->link ? e->link->counters : NULL;
  void *ctx = e->link ? e->link->counters_ctx : NULL;
  uint64_t gen = e->att_gen;
  if (c)
    e->stats_calls++;
  pthread_mutex_unlock(&e->att_lock);
  if (c) {
    uint64_t counts[3];
    char *err = NULL;
    int r = counters ? counters(ctx, counts, &err)
                     : agent_egress_stats(c, EGRESS_STATS_MS, counts, &err);
    free(err);
    pthread_mutex_lock(&e->att_lock);
    if (--e->stats_calls == 0)
      pthread_cond_broadcast(&e->stats_done);
    pthread_mutex_unlock(&e->att_lock);
    if (r == 0)
      record_refused_packets(e->rec, gen, counts);
  }
  pthread_mutex_unlock(&e->stats_lock);
}

json_t *egress_report(struct egress *e, bool since_last) {
  read_refused_packets(e);
  json_t *o = json_object();
  enum egress_mode mode;
  json_t *rules = rules_json(e, &mode);
  json_object_set_new(o, "mode", json_string(egress_mode_name(mode)));
  json_object_set_new(o, "allowed_rules", rules);
  record_report(e->rec, since_last, o);
  json_object_set_new(o, "egress_log_path", log_path_json(e));
  return o;
}

char *egress_policy_line(void) {
  if (egress_cfg.off)
    return strdup("egress: IGN_MCP_NET=off (every connection and lookup from a sandbox is "
                  "refused and recorded)");
  long names = resolve_hosts_count();
  char hosts[512];
  if (names < 0)
    snprintf(hosts, sizeof hosts, "no hosts file");
  else
    snprintf(hosts, sizeof hosts, "hosts file %s (%ld name%s)", egress_cfg.hosts_file, names,
             names == 1 ? "" : "s");
  return xasprintf("egress: IGN_MCP_NET=%s (sessions may ask %s), private destinations %s, %s",
                   net_setting(),
                   egress_cfg.max_mode == EGRESS_MODE_OPEN ? "none, allow or open"
                   : egress_cfg.max_mode == EGRESS_MODE_ALLOW ? "none or allow" : "none",
                   egress_cfg.allow_host ? "allowed, loopback and the host's own addresses "
                                           "too (IGN_MCP_NET_PRIVATE=host)"
                   : egress_cfg.allow_private ? "allowed, but not loopback nor the host's own "
                                                "addresses (IGN_MCP_NET_PRIVATE=1)"
                                              : "refused",
                   hosts);
}
