/* args.c: see args.h. */
#include "tools/args.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

static const char *type_name(json_t *v) {
  switch (json_typeof(v)) {
  case JSON_OBJECT: return "an object";
  case JSON_ARRAY: return "an array";
  case JSON_STRING: return "a string";
  case JSON_INTEGER: return "an integer";
  case JSON_REAL: return "a number with a fraction";
  case JSON_TRUE: case JSON_FALSE: return "a boolean";
  case JSON_NULL: return "null";
  }
  return "something else";
}

int args_check(json_t *args, const char *tool, const char *const *allowed, char **ret_err) {
  const char *key;
  json_t *v;
  json_object_foreach(args, key, v) {
    bool ok = false;
    for (const char *const *a = allowed; *a; a++)
      if (strcmp(key, *a) == 0)
        ok = true;
    if (!ok) {
      char list[256] = "";
      for (const char *const *a = allowed; *a; a++) {
        strncat(list, a == allowed ? "" : ", ", sizeof list - strlen(list) - 1);
        strncat(list, *a, sizeof list - strlen(list) - 1);
      }
      _cleanup_free_ char *k = utf8_sanitize(key, strlen(key), NULL);
      *ret_err = xasprintf("%s has no argument '%.100s'; its arguments are: %s", tool, k,
                           list[0] ? list : "(none)");
      return -EINVAL;
    }
  }
  return 0;
}

/* What to send instead of a string argument that is too long or missing. */
static const char *string_hint(const char *name) {
  if (strcmp(name, "session_id") == 0)
    return "the id open_session returned";
  if (strcmp(name, "command") == 0)
    return "put a long script in a file with write_file and run that file";
  if (strcmp(name, "path") == 0 || strcmp(name, "cwd") == 0)
    return "use a shorter path";
  return "send a shorter string";
}

int arg_string(json_t *args, const char *tool, const char *name, bool required, size_t min,
               size_t max, const char **ret, size_t *ret_len, char **ret_err) {
  json_t *v = json_object_get(args, name);
  if (!v || (json_is_null(v) && !required)) {
    if (required) {
      *ret_err = strcmp(name, "session_id") == 0
                     ? xasprintf("%s needs the argument 'session_id' (a string: %s)", tool,
                                 string_hint(name))
                     : xasprintf("%s needs the argument '%s' (a string)", tool, name);
      return -EINVAL;
    }
    return 0;
  }
  if (!json_is_string(v)) {
    *ret_err = xasprintf("%s: '%s' must be a string, not %s", tool, name, type_name(v));
    return -EINVAL;
  }
  size_t len = json_string_length(v);
  const char *s = json_string_value(v);
  if (memchr(s, '\0', len)) {
    *ret_err = xasprintf("%s: '%s' contains a NUL character, which no path or command can hold; "
                         "remove it", tool, name);
    return -EINVAL;
  }
  if (len < min) {
    *ret_err = xasprintf("%s: '%s' is empty; give a non-empty string", tool, name);
    return -EINVAL;
  }
  if (len > max) {
    *ret_err = xasprintf("%s: '%s' is %zu bytes, over its cap of %zu bytes; %s", tool, name, len,
                         max, string_hint(name));
    return -EINVAL;
  }
  *ret = s;
  if (ret_len)
    *ret_len = len;
  return 0;
}

int arg_session_id(json_t *args, const char **ret, char **ret_err) {
  return arg_string(args, "this tool", "session_id", true, 1, 64, ret, NULL, ret_err);
}

int arg_int(json_t *args, const char *tool, const char *name, long long min, long long max,
            long long *ret, char **ret_err) {
  json_t *v = json_object_get(args, name);
  if (!v || json_is_null(v))
    return 0;
  long long x;
  if (json_is_integer(v)) {
    x = json_integer_value(v);
  } else if (json_is_real(v) && (json_real_value(v) <= -0x1p62 || json_real_value(v) >= 0x1p62)) {
    /* Checked first: converting 1e308 to long long is undefined. */
    *ret_err = xasprintf("%s: '%s' is %g, outside its range %lld..%lld; give a value in that "
                         "range", tool, name, json_real_value(v), min, max);
    return -EINVAL;
  } else if (json_is_real(v) && json_real_value(v) == (double)(long long)json_real_value(v)) {
    x = (long long)json_real_value(v);
  } else {
    *ret_err = xasprintf("%s: '%s' must be a whole number from %lld to %lld, not %s", tool, name,
                         min, max, type_name(v));
    return -EINVAL;
  }
  if (x < min || x > max) {
    *ret_err = xasprintf("%s: '%s' is %lld, outside its range %lld..%lld; give a value in that "
                         "range", tool, name, x, min, max);
    return -EINVAL;
  }
  *ret = x;
  return 0;
}

int arg_bool(json_t *args, const char *tool, const char *name, bool *ret, char **ret_err) {
  json_t *v = json_object_get(args, name);
  if (!v || json_is_null(v))
    return 0;
  if (!json_is_boolean(v)) {
    *ret_err = xasprintf("%s: '%s' must be true or false, not %s", tool, name, type_name(v));
    return -EINVAL;
  }
  *ret = json_is_true(v);
  return 0;
}

int arg_path(json_t *args, const char *tool, const char **ret, char **ret_err) {
  return arg_string(args, tool, "path", true, 1, ARG_MAX_PATH, ret, NULL, ret_err);
}

int arg_mode(json_t *args, uint32_t *ret, char **ret_err) {
  json_t *v = json_object_get(args, "mode");
  if (!v || json_is_null(v))
    return 0;
  long long m = -1;
  if (json_is_integer(v)) {
    m = json_integer_value(v);
  } else if (json_is_string(v)) {
    const char *s = json_string_value(v);
    if (s[0] == '0' && (s[1] == 'o' || s[1] == 'O'))
      s += 2;
    char *end;
    errno = 0;
    if (*s && strspn(s, "01234567") == strlen(s))
      m = strtoll(s, &end, 8);
  }
  if (m < 0 || m > 07777) {
    *ret_err = strdup("write_file: 'mode' must be permission bits, as an integer (e.g. 493 for "
                      "0755) or an octal string such as \"755\" or \"0644\"");
    return -EINVAL;
  }
  *ret = (uint32_t)m;
  return 0;
}

int arg_stdin(json_t *args, const char *tool, size_t max, const char **ret, size_t *ret_len,
              char **ret_err) {
  json_t *v = json_object_get(args, "stdin");
  if (!v || json_is_null(v))
    return 0;
  if (!json_is_string(v)) {
    *ret_err = xasprintf("%s: 'stdin' must be a string, not %s", tool, type_name(v));
    return -EINVAL;
  }
  if (json_string_length(v) > max) {
    *ret_err = xasprintf("%s: 'stdin' is %zu bytes, over the %zu byte cap (IGN_MCP_MAX_STDIN); "
                         "write the input to a file with write_file and redirect it instead, or "
                         "name a file on the host with 'stdin_file'",
                         tool, json_string_length(v), max);
    return -EINVAL;
  }
  *ret = json_string_value(v);
  *ret_len = json_string_length(v);
  return 0;
}

int arg_env(json_t *args, const char *tool, const char **ret, size_t max, size_t *ret_n,
            char **ret_buf, char **ret_err) {
  json_t *env = json_object_get(args, "env");
  if (!env || json_is_null(env))
    return 0;
  if (!json_is_object(env)) {
    *ret_err = xasprintf("%s: 'env' must be an object of NAME: \"value\" strings, not %s", tool,
                         type_name(env));
    return -EINVAL;
  }
  if (json_object_size(env) > max) {
    *ret_err = xasprintf("%s: 'env' has %zu variables, over the cap of %zu; pass fewer, or write "
                         "them to a file with write_file and source it in the command",
                         tool, json_object_size(env), max);
    return -EINVAL;
  }
  size_t total = 0;
  const char *k;
  json_t *v;
  json_object_foreach(env, k, v) {
    if (!json_is_string(v)) {
      *ret_err = xasprintf("%s: env['%.100s'] must be a string, not %s", tool, k, type_name(v));
      return -EINVAL;
    }
    size_t kl = strlen(k);
    if (kl == 0 || strchr(k, '=') || kl != strcspn(k, " \t\n") ||
        memchr(json_string_value(v), '\0', json_string_length(v))) {
      *ret_err = xasprintf("%s: env has an invalid entry '%.100s': names must be non-empty "
                           "without '=' or spaces, and values cannot contain NUL", tool, k);
      return -EINVAL;
    }
    size_t entry = kl + 1 + json_string_length(v);
    if (entry > PROTO_MAX_ENV_ENTRY) {
      *ret_err = xasprintf("%s: env['%.100s'] is %zu bytes as NAME=value, over the cap of %u for "
                           "one variable; write long values to a file with write_file and read "
                           "it in the command", tool, k, entry, PROTO_MAX_ENV_ENTRY);
      return -EINVAL;
    }
    total += entry + 1;
  }
  if (total > PROTO_MAX_PAYLOAD / 2) {
    *ret_err = xasprintf("%s: 'env' is %zu bytes in all, over the cap of %u; write long values "
                         "to a file with write_file and read it in the command", tool, total,
                         PROTO_MAX_PAYLOAD / 2);
    return -EINVAL;
  }
  char *buf = malloc(total ? total : 1), *p = buf;
  if (!buf) {
    *ret_err = strdup("out of memory");
    return -ENOMEM;
  }
  size_t n = 0;
  json_object_foreach(env, k, v) {
    ret[n++] = p;
    p += sprintf(p, "%s=%s", k, json_string_value(v)) + 1;
  }
  *ret_n = n;
  *ret_buf = buf;
  return 0;
}

int arg_stdin_file(json_t *args, const char *tool, const char **ret, char **ret_err) {
  json_t *in = json_object_get(args, "stdin"), *f = json_object_get(args, "stdin_file");
  if (in && !json_is_null(in) && f && !json_is_null(f)) {
    *ret_err = xasprintf("%s: give either 'stdin' (the text itself) or 'stdin_file' (a file on "
                         "the host), not both", tool);
    return -EINVAL;
  }
  return arg_string(args, tool, "stdin_file", false, 1, ARG_MAX_PATH, ret, NULL, ret_err);
}

/* One path of a copy entry: a non-empty string without NUL, at most
 * ARG_MAX_PATH bytes. */
static int copy_path(json_t *e, const char *tool, const char *name, size_t i, const char *key,
                     const char **ret, char **ret_err) {
  json_t *v = json_object_get(e, key);
  if (!v || json_is_null(v)) {
    *ret_err = xasprintf("%s: %s[%zu] has no '%s'; each entry is an object {%s}", tool, name, i,
                         key, strcmp(name, "copy_in") == 0 ? "host, guest" : "guest, host");
    return -EINVAL;
  }
  if (!json_is_string(v)) {
    *ret_err = xasprintf("%s: %s[%zu].%s must be a string, not %s", tool, name, i, key,
                         type_name(v));
    return -EINVAL;
  }
  size_t len = json_string_length(v);
  if (len == 0 || memchr(json_string_value(v), '\0', len)) {
    *ret_err = xasprintf("%s: %s[%zu].%s is %s; give a path", tool, name, i, key,
                         len ? "a string with a NUL character" : "empty");
    return -EINVAL;
  }
  if (len > ARG_MAX_PATH) {
    *ret_err = xasprintf("%s: %s[%zu].%s is %zu bytes, over its cap of %d bytes; use a shorter "
                         "path", tool, name, i, key, len, ARG_MAX_PATH);
    return -EINVAL;
  }
  *ret = json_string_value(v);
  return 0;
}

int arg_copies(json_t *args, const char *tool, const char *name, struct arg_copy *ret,
               size_t max, size_t *ret_n, char **ret_err) {
  json_t *a = json_object_get(args, name);
  *ret_n = 0;
  if (!a || json_is_null(a))
    return 0;
  bool in = strcmp(name, "copy_in") == 0;
  if (!json_is_array(a)) {
    *ret_err = xasprintf("%s: '%s' must be an array of {%s} objects, not %s", tool, name,
                         in ? "host, guest" : "guest, host", type_name(a));
    return -EINVAL;
  }
  if (json_array_size(a) > max) {
    *ret_err = xasprintf("%s: '%s' has %zu entries, over the cap of %zu; copy a common parent "
                         "directory instead (a directory is copied whole)", tool, name,
                         json_array_size(a), max);
    return -EINVAL;
  }
  size_t i;
  json_t *e;
  json_array_foreach(a, i, e) {
    if (!json_is_object(e)) {
      *ret_err = xasprintf("%s: %s[%zu] must be an object {%s}, not %s", tool, name, i,
                           in ? "host, guest" : "guest, host", type_name(e));
      return -EINVAL;
    }
    const char *key;
    json_t *v;
    json_object_foreach(e, key, v) {
      if (strcmp(key, "host") != 0 && strcmp(key, "guest") != 0) {
        _cleanup_free_ char *k = utf8_sanitize(key, strlen(key), NULL);
        *ret_err = xasprintf("%s: %s[%zu] has no field '%.100s'; each entry is an object {%s}",
                             tool, name, i, k ? k : "?", in ? "host, guest" : "guest, host");
        return -EINVAL;
      }
    }
    if (copy_path(e, tool, name, i, in ? "host" : "guest", in ? &ret[i].host : &ret[i].guest,
                  ret_err) < 0 ||
        copy_path(e, tool, name, i, in ? "guest" : "host", in ? &ret[i].guest : &ret[i].host,
                  ret_err) < 0)
      return -EINVAL;
  }
  *ret_n = json_array_size(a);
  return 0;
}

static int b64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

int base64_decode(const char *in, size_t len, uint8_t **ret, size_t *ret_len, char **ret_err) {
  size_t pad = 0;
  while (len > 0 && in[len - 1] == '=' && pad < 2) {
    len--;
    pad++;
  }
  if (len % 4 == 1 || (pad && (len + pad) % 4 != 0)) {
    *ret_err = strdup("write_file: content_base64 is not valid base64: its length is wrong "
                      "(standard base64 comes in groups of 4 characters, the last one padded "
                      "with '='); encode the bytes again with a standard base64 encoder");
    return -EINVAL;
  }
  uint8_t *out = malloc(len / 4 * 3 + 3);
  if (!out) {
    *ret_err = strdup("out of memory decoding content_base64");
    return -ENOMEM;
  }
  size_t o = 0;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < len; i++) {
    int v = b64_value((unsigned char)in[i]);
    if (v < 0) {
      free(out);
      *ret_err = xasprintf("write_file: content_base64 is not valid base64: byte %zu is %s; use "
                           "the standard alphabet A-Z a-z 0-9 + / with optional = padding and no "
                           "line breaks", i, in[i] == '\n' || in[i] == '\r' ? "a line break"
                                              : in[i] == '=' ? "'=' before the end"
                                                             : "not a base64 character");
      return -EINVAL;
    }
    acc = acc << 6 | (uint32_t)v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out[o++] = (uint8_t)(acc >> bits);
    }
  }
  /* The bits past the last byte must be zero: otherwise two different texts
   * would decode to the same bytes, and the text was not made by a base64
   * encoder. */
  if (acc & ((1u << bits) - 1)) {
    free(out);
    *ret_err = strdup("write_file: content_base64 is not valid base64: its last character "
                      "carries bits past the end of the data; encode the content with a "
                      "standard base64 encoder");
    return -EINVAL;
  }
  *ret = out;
  *ret_len = o;
  return 0;
}

char *base64_encode(const void *data, size_t len) {
  static const char tbl[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const uint8_t *d = data;
  char *out = malloc((len + 2) / 3 * 4 + 1), *p = out;
  if (!out)
    return NULL;
  size_t i = 0;
  for (; i + 2 < len; i += 3) {
    uint32_t v = (uint32_t)d[i] << 16 | (uint32_t)d[i + 1] << 8 | d[i + 2];
    *p++ = tbl[v >> 18];
    *p++ = tbl[(v >> 12) & 63];
    *p++ = tbl[(v >> 6) & 63];
    *p++ = tbl[v & 63];
  }
  if (i < len) {
    uint32_t v = (uint32_t)d[i] << 16 | (i + 1 < len ? (uint32_t)d[i + 1] << 8 : 0);
    *p++ = tbl[v >> 18];
    *p++ = tbl[(v >> 12) & 63];
    *p++ = i + 1 < len ? tbl[(v >> 6) & 63] : '=';
    *p++ = '=';
  }
  *p = '\0';
  return out;
}

/* Length of the valid UTF-8 sequence at S (at most N bytes), or 0. */
static size_t utf8_seq(const unsigned char *s, size_t n) {
  unsigned char c = s[0];
  if (c < 0x80)
    return 1;
  size_t len;
  uint32_t min;
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
    min = 0x80;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    min = 0x800;
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    min = 0x10000;
  } else {
    return 0;
  }
  if (n < len)
    return 0;
  uint32_t cp = c & (0xff >> (len + 1));
  for (size_t i = 1; i < len; i++) {
    if ((s[i] & 0xc0) != 0x80)
      return 0;
    cp = cp << 6 | (s[i] & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
    return 0;
  return len;
}

char *utf8_sanitize(const char *data, size_t len, size_t *ret_len) {
  /* Worst case every byte becomes the 3-byte U+FFFD. */
  char *out = malloc(len * 3 + 1);
  if (!out)
    return NULL;
  const unsigned char *s = (const unsigned char *)data;
  size_t o = 0;
  for (size_t i = 0; i < len;) {
    size_t n = utf8_seq(s + i, len - i);
    if (n) {
      memcpy(out + o, s + i, n);
      o += n;
      i += n;
    } else {
      memcpy(out + o, "\xef\xbf\xbd", 3);
      o += 3;
      i++;
    }
  }
  out[o] = '\0';
  if (ret_len)
    *ret_len = o;
  return out;
}

int arg_string_array(json_t *args, const char *tool, const char *name, size_t max_items,
                     size_t max_len, char **ret_err) {
  json_t *v = json_object_get(args, name);
  if (!v || json_is_null(v))
    return 0;
  if (!json_is_array(v)) {
    *ret_err = xasprintf("%s: '%s' must be an array of strings, not %s", tool, name, type_name(v));
    return -EINVAL;
  }
  if (json_array_size(v) > max_items) {
    *ret_err = xasprintf("%s: '%s' has %zu entries, over the cap of %zu; give fewer", tool, name,
                         json_array_size(v), max_items);
    return -EINVAL;
  }
  size_t i;
  json_t *e;
  json_array_foreach(v, i, e) {
    if (!json_is_string(e)) {
      *ret_err = xasprintf("%s: '%s'[%zu] must be a string, not %s", tool, name, i, type_name(e));
      return -EINVAL;
    }
    if (json_string_length(e) == 0 || json_string_length(e) > max_len) {
      *ret_err = xasprintf("%s: '%s'[%zu] is %zu bytes long; give 1 to %zu", tool, name, i,
                           json_string_length(e), max_len);
      return -EINVAL;
    }
  }
  return 0;
}
