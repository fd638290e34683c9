/* http_check.c: what a Streamable HTTP request must carry before it is
 * served (see http.c for the transport): the headers a 2026-07-28 request
 * mirrors from its body and their decoding, the Host and Origin checks
 * against DNS rebinding, content negotiation, and the table of legacy MCP
 * sessions (Mcp-Session-Id) a 2025-era client works in. */
#include <errno.h>
#include <nettle/base64.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "mcp/http_int.h"

/* ---- legacy MCP sessions (2025-03-26 ... 2025-11-25) ---- */

struct legacy {
  char id[33]; /* "" when free */
  char *owner;
  uint64_t used;
};
static pthread_mutex_t legacy_lock = PTHREAD_MUTEX_INITIALIZER;
static struct legacy legacy[MAX_LEGACY];

static void legacy_drop(struct legacy *l) {
  l->id[0] = '\0';
  free(l->owner);
  l->owner = NULL;
}

/* The live session ID made by OWNER, or NULL (an expired one is dropped).
 * Called with legacy_lock held. */
static struct legacy *legacy_find(const char *id, const char *owner) {
  uint64_t now = mono_ms();
  for (size_t i = 0; i < MAX_LEGACY; i++) {
    struct legacy *l = &legacy[i];
    if (!l->id[0] || strcmp(l->id, id) != 0)
      continue;
    if (now - l->used > LEGACY_IDLE_MS) {
      legacy_drop(l);
      return NULL;
    }
    /* Another token's session is as unknown as a missing one. */
    return strcmp(l->owner, owner) == 0 ? l : NULL;
  }
  return NULL;
}

bool http_legacy_touch(const char *id, const char *owner) {
  pthread_mutex_lock(&legacy_lock);
  struct legacy *l = legacy_find(id, owner);
  if (l)
    l->used = mono_ms();
  pthread_mutex_unlock(&legacy_lock);
  return l;
}

bool http_legacy_end(const char *id, const char *owner) {
  pthread_mutex_lock(&legacy_lock);
  struct legacy *l = legacy_find(id, owner);
  if (l)
    legacy_drop(l);
  pthread_mutex_unlock(&legacy_lock);
  return l;
}

/* A new session for OWNER in RET (33 bytes): a free or expired slot, else
 * the one idle longest (a client that never sends DELETE must not lock the
 * others out).  -errno when no random bytes could be had. */
int http_legacy_new(const char *owner, char *ret) {
  uint8_t rnd[16];
  if (getrandom(rnd, sizeof rnd, 0) != sizeof rnd)
    return -errno;
  char *o = strdup(owner);
  if (!o)
    return -ENOMEM;
  pthread_mutex_lock(&legacy_lock);
  uint64_t now = mono_ms();
  struct legacy *slot = NULL;
  for (size_t i = 0; i < MAX_LEGACY && !slot; i++)
    if (!legacy[i].id[0] || now - legacy[i].used > LEGACY_IDLE_MS)
      slot = &legacy[i];
  if (!slot) {
    slot = &legacy[0];
    for (size_t i = 1; i < MAX_LEGACY; i++)
      if (legacy[i].used < slot->used)
        slot = &legacy[i];
    log_info("%d legacy MCP sessions are open: the one idle longest was ended for a new one",
             MAX_LEGACY);
  }
  legacy_drop(slot);
  for (size_t i = 0; i < sizeof rnd; i++)
    snprintf(slot->id + 2 * i, 3, "%02x", rnd[i]);
  slot->owner = o;
  slot->used = now;
  memcpy(ret, slot->id, sizeof slot->id);
  pthread_mutex_unlock(&legacy_lock);
  return 0;
}

/* ---- headers ---- */

const char *http_hdr(struct MHD_Connection *c, const char *name) {
  return MHD_lookup_connection_value(c, MHD_HEADER_KIND, name);
}

struct hdr_count {
  const char *name;
  unsigned n;
};

static enum MHD_Result count_one(void *cls, enum MHD_ValueKind kind, const char *key,
                                 const char *value) {
  (void)kind, (void)value;
  struct hdr_count *h = cls;
  if (key && strcasecmp(key, h->name) == 0)
    h->n++;
  return MHD_YES;
}

/* The first header this server decides on that the request sends more than
 * once, or NULL.  Only the first of each is read (hdr), while an
 * intermediary may act on another: one of each is all a request may have. */
const char *http_duplicate_header(struct MHD_Connection *c) {
  static const char *const once[] = {
      MHD_HTTP_HEADER_HOST, MHD_HTTP_HEADER_ORIGIN, MHD_HTTP_HEADER_AUTHORIZATION,
      MHD_HTTP_HEADER_CONTENT_TYPE, "MCP-Protocol-Version", "Mcp-Method", "Mcp-Name",
      "Mcp-Param-Session-Id", "Mcp-Session-Id"};
  for (size_t i = 0; i < sizeof once / sizeof once[0]; i++) {
    struct hdr_count h = {.name = once[i]};
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_one, &h);
    if (h.n > 1)
      return once[i];
  }
  return NULL;
}

/* V (N bytes) as it may appear in a message: cut, non-printables as '?'. */
char *http_quote(const char *v, size_t n) {
  size_t m = MIN(n, (size_t)QUOTE_MAX);
  char *s = malloc(m + 4);
  if (!s)
    return NULL;
  for (size_t i = 0; i < m; i++)
    s[i] = v[i] >= ' ' && v[i] <= '~' ? v[i] : '?';
  strcpy(s + m, n > m ? "..." : "");
  return s;
}

/* A mirrored header's value as the body holds it.  Values a header may not
 * carry plainly come as =?base64?...?= (2026-07-28, "Value Encoding") when
 * B64 is allowed.  NULL with *RET_WHY set when the value is malformed. */
static char *header_decode(const char *v, bool b64, size_t *ret_len, const char **ret_why) {
  size_t n = strlen(v);
  for (size_t i = 0; i < n; i++)
    if ((v[i] < ' ' || v[i] > '~') && v[i] != '\t') {
      *ret_why = "has a character a header value may not hold (use the =?base64?...?= form)";
      return NULL;
    }
  if (b64 && n >= 11 && strncmp(v, "=?base64?", 9) == 0 && strcmp(v + n - 2, "?=") == 0) {
    struct base64_decode_ctx ctx;
    size_t src = n - 11, len = BASE64_DECODE_LENGTH(src);
    char *out = malloc(len + 1);
    if (!out) {
      *ret_why = "could not be decoded (out of memory)";
      return NULL;
    }
    base64_decode_init(&ctx);
    if (!base64_decode_update(&ctx, &len, (uint8_t *)out, src, v + 9) ||
        !base64_decode_final(&ctx)) {
      free(out);
      *ret_why = "is not valid base64 between =?base64? and ?=";
      return NULL;
    }
    *ret_len = len;
    return out;
  }
  *ret_len = n;
  return strdup(v);
}

/* Checks header NAME against the body's value WANT (a string, or NULL when
 * the body has none, and then the header must be absent too).  NULL when
 * they agree, else the HeaderMismatch message (malloc'd). */
static char *header_mismatch(struct MHD_Connection *c, const char *name, json_t *want,
                             const char *field, bool b64) {
  const char *v = http_hdr(c, name);
  if (!want) {
    if (!v)
      return NULL;
    _cleanup_free_ char *hv = http_quote(v, strlen(v));
    return xasprintf("Header mismatch: %s header value '%s' is sent but the body has no %s; "
                     "leave the header out",
                     name, hv ? hv : "", field);
  }
  _cleanup_free_ char *bv = http_quote(json_string_value(want), json_string_length(want));
  if (!v)
    return xasprintf("Header mismatch: the %s header is missing; it must repeat the body's %s "
                     "('%s')",
                     name, field, bv ? bv : "");
  const char *why = NULL;
  size_t len = 0;
  _cleanup_free_ char *dec = header_decode(v, b64, &len, &why);
  _cleanup_free_ char *hv = http_quote(v, strlen(v));
  if (!dec)
    return xasprintf("Header mismatch: the %s header value '%s' %s", name, hv ? hv : "",
                     why ? why : "is invalid");
  if (len != json_string_length(want) || memcmp(dec, json_string_value(want), len) != 0)
    return xasprintf("Header mismatch: %s header value '%s' does not match body value '%s' "
                     "(%s)",
                     name, hv ? hv : "", bv ? bv : "", field);
  return NULL;
}

/* The 2026-07-28 request headers (transports/streamable-http, "Request
 * Metadata"): each must say what the body says, so that an intermediary
 * routing on a header acts on what is executed. */
char *http_modern_mismatch(struct MHD_Connection *c, const char *m, json_t *params) {
  json_t *meta = json_object_get(params, "_meta");
  json_t *mj = json_string(m);
  char *why = header_mismatch(c, "MCP-Protocol-Version", json_object_get(meta, META_VERSION),
                              "params._meta[\"" META_VERSION "\"]", false);
  if (!why)
    why = header_mismatch(c, "Mcp-Method", mj, "method", false);
  json_decref(mj);
  if (!why && strcmp(m, "tools/call") == 0) {
    json_t *name = json_object_get(params, "name");
    if (json_is_string(name))
      why = header_mismatch(c, "Mcp-Name", name, "params.name", true);
    json_t *sid = json_object_get(json_object_get(params, "arguments"), "session_id");
    /* Tools declare session_id with x-mcp-header "Session-Id"; a value of
     * another type is refused by the tool itself. */
    if (!why && (!sid || json_is_null(sid) || json_is_string(sid)))
      why = header_mismatch(c, "Mcp-Param-Session-Id", json_is_string(sid) ? sid : NULL,
                            "params.arguments.session_id", true);
  }
  /* The Tasks extension: tasks/get, tasks/update and tasks/cancel name
   * their task in Mcp-Name. */
  json_t *tid = json_object_get(params, "taskId");
  bool names_task = strcmp(m, "tasks/get") == 0 || strcmp(m, "tasks/update") == 0 ||
                    strcmp(m, "tasks/cancel") == 0;
  if (!why && names_task && json_is_string(tid))
    why = header_mismatch(c, "Mcp-Name", tid, "params.taskId", true);
  return why;
}

/* Whether the comma-separated LIST holds V exactly. */
static bool list_has(const char *list, const char *v, size_t n) {
  for (const char *p = list; p && *p;) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    if (len == n && strncmp(p, v, n) == 0)
      return true;
    p = e ? e + 1 : NULL;
  }
  return false;
}

/* HOST[:PORT] names this machine's loopback (any port). */
static bool loopback_authority(const char *a, size_t n) {
  size_t h = n;
  if (n && a[0] == '[') {
    const char *e = memchr(a, ']', n);
    h = e ? (size_t)(e - a) + 1 : n;
  } else {
    const char *e = memchr(a, ':', n);
    h = e ? (size_t)(e - a) : n;
  }
  for (size_t i = h + 1; i < n; i++)
    if (a[i] < '0' || a[i] > '9')
      return false;
  if (h < n && a[h] != ':')
    return false;
  return (h == 9 && strncasecmp(a, "localhost", 9) == 0) || (h == 9 && strncmp(a, "127.0.0.1", 9) == 0) ||
         (h == 5 && strncmp(a, "[::1]", 5) == 0);
}

/* A loopback server serves only requests that name it (below).  One that
 * names nothing did not come from a browser's page, but it may come from
 * a sandbox whose egress reaches loopback: without Host, nothing says
 * whom the request was meant for, so it is refused, not served. */
bool http_host_missing(struct MHD_Connection *c, bool loopback) {
  return loopback && !http_hdr(c, MHD_HTTP_HEADER_HOST);
}

/* DNS rebinding: a page in a browser may reach a loopback server under a
 * name of the attacker's; its requests then carry that name in Host and the
 * page's origin in Origin. */
const char *http_origin_refusal(struct MHD_Connection *c, bool loopback) {
  const char *h = http_hdr(c, MHD_HTTP_HEADER_HOST);
  if (loopback && h && !loopback_authority(h, strlen(h)) &&
      !list_has(cfg.http_hosts, h, strlen(h)))
    return "Host";
  const char *o = http_hdr(c, MHD_HTTP_HEADER_ORIGIN);
  if (!o || list_has(cfg.http_origins, o, strlen(o)))
    return NULL;
  const char *a = strncmp(o, "http://", 7) == 0    ? o + 7
                  : strncmp(o, "https://", 8) == 0 ? o + 8
                                                   : NULL;
  if (loopback && a && loopback_authority(a, strlen(a)))
    return NULL;
  return "Origin";
}

/* Whether the media range list A names TYPE ("application/json"), or a
 * wildcard that covers it when WILD. */
bool http_accepts(const char *a, const char *type, bool wild) {
  size_t tn = strlen(type);
  const char *slash = strchr(type, '/');
  for (const char *p = a; p && *p;) {
    while (*p == ' ' || *p == '\t' || *p == ',')
      p++;
    size_t n = strcspn(p, ";, \t");
    if ((n == tn && strncasecmp(p, type, n) == 0) ||
        (wild && ((n == 3 && strncmp(p, "*/*", 3) == 0) ||
                  (n == (size_t)(slash - type) + 2 && strncasecmp(p, type, n - 1) == 0 &&
                   p[n - 1] == '*'))))
      return true;
    p = strchr(p, ',');
  }
  return false;
}

void http_legacy_free_all(void) {
  pthread_mutex_lock(&legacy_lock);
  for (size_t i = 0; i < MAX_LEGACY; i++)
    legacy_drop(&legacy[i]);
  pthread_mutex_unlock(&legacy_lock);
}
