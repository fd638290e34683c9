/* test_args.c: argument checks, base64 and UTF-8 sanitising. */
#include "tools/args.h"
#include "test.h"

static void base64_round_trip(void) {
  for (size_t len = 0; len < 40; len++) {
    uint8_t data[40];
    for (size_t i = 0; i < len; i++)
      data[i] = (uint8_t)(i * 37 + len);
    char *enc = base64_encode(data, len);
    uint8_t *dec;
    size_t n;
    char *err = NULL;
    CHECK_EQ_INT(base64_decode(enc, strlen(enc), &dec, &n, &err), 0);
    CHECK_EQ_INT(n, len);
    CHECK(memcmp(dec, data, len) == 0);
    free(dec);
    free(enc);
  }
}

static void base64_refuses_garbage(void) {
  const char *bad[] = {"@@@@", "ab\ncd==", "a=bc", "abcde", "ab==="};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    uint8_t *dec = NULL;
    size_t n;
    char *err = NULL;
    CHECK_EQ_INT(base64_decode(bad[i], strlen(bad[i]), &dec, &n, &err), -EINVAL);
    CHECK(err && strstr(err, "base64"));
    free(err);
    free(dec);
  }
  /* Unpadded input is accepted. */
  uint8_t *dec;
  size_t n;
  char *err = NULL;
  CHECK_EQ_INT(base64_decode("aGk", 3, &dec, &n, &err), 0);
  CHECK_EQ_INT(n, 2);
  CHECK(memcmp(dec, "hi", 2) == 0);
  free(dec);
}

static void utf8_sanitize_replaces_invalid(void) {
  size_t n;
  char *s = utf8_sanitize("a\xff" "b\xc3\xa9" "\xe2\x82", 7, &n);
  CHECK_STREQ(s, "a\xef\xbf\xbd" "b\xc3\xa9\xef\xbf\xbd\xef\xbf\xbd");
  free(s);
  /* Overlong encodings and surrogates are invalid. */
  s = utf8_sanitize("\xc0\xaf\xed\xa0\x80", 5, &n);
  CHECK_EQ_INT(n, 5 * 3);
  free(s);
  /* NUL bytes survive. */
  s = utf8_sanitize("a\0b", 3, &n);
  CHECK_EQ_INT(n, 3);
  CHECK(s[1] == '\0' && s[2] == 'b');
  free(s);
}

static void arg_checks(void) {
  json_t *args = json_pack("{s:s, s:i, s:f, s:s, s:s#}", "session_id", "s1", "timeout_s", 0,
                           "frac", 1.5, "mode", "755", "path", "a\0b", 3);
  char *err = NULL;
  long long t = 30;
  CHECK_EQ_INT(arg_int(args, "run", "timeout_s", 1, 3600, &t, &err), -EINVAL);
  CHECK(err && strstr(err, "timeout_s") && strstr(err, "1..3600"));
  free(err);
  err = NULL;
  CHECK_EQ_INT(arg_int(args, "run", "frac", 1, 3600, &t, &err), -EINVAL);
  free(err);
  err = NULL;
  CHECK_EQ_INT(arg_int(args, "run", "absent", 1, 3600, &t, &err), 0);
  CHECK_EQ_INT(t, 30);
  uint32_t mode = 0;
  CHECK_EQ_INT(arg_mode(args, &mode, &err), 0);
  CHECK_EQ_INT(mode, 0755);
  const char *p;
  CHECK_EQ_INT(arg_path(args, "write_file", &p, &err), -EINVAL);
  CHECK(err && strstr(err, "NUL"));
  free(err);
  err = NULL;
  CHECK_EQ_INT(args_check(args, "run", (const char *[]){"session_id", NULL}, &err), -EINVAL);
  CHECK(err && strstr(err, "has no argument"));
  free(err);
  json_decref(args);
}

static void env_checks(void) {
  const char *env[4];
  size_t n = 0;
  char *buf = NULL, *err = NULL;
  json_t *ok = json_pack("{s:{s:s, s:s}}", "env", "A", "1", "B", "x=y");
  CHECK_EQ_INT(arg_env(ok, "run", env, 4, &n, &buf, &err), 0);
  CHECK_EQ_INT(n, 2);
  CHECK(strcmp(env[0], "A=1") == 0 || strcmp(env[1], "A=1") == 0);
  free(buf);
  json_decref(ok);
  json_t *bad = json_pack("{s:{s:i}}", "env", "A", 1);
  CHECK_EQ_INT(arg_env(bad, "run", env, 4, &n, &buf, &err), -EINVAL);
  free(err);
  json_decref(bad);
  bad = json_pack("{s:{s:s}}", "env", "A=B", "1");
  err = NULL;
  CHECK_EQ_INT(arg_env(bad, "run", env, 4, &n, &buf, &err), -EINVAL);
  free(err);
  json_decref(bad);
}

static void bool_checks(void) {
  json_t *a = json_pack("{s:b, s:s, s:n}", "yes", 1, "word", "true", "none");
  bool v = false;
  char *err = NULL;
  CHECK_EQ_INT(arg_bool(a, "commit", "yes", &v, &err), 0);
  CHECK(v);
  v = false;
  CHECK_EQ_INT(arg_bool(a, "commit", "none", &v, &err), 0);
  CHECK_EQ_INT(arg_bool(a, "commit", "absent", &v, &err), 0);
  CHECK(!v);
  CHECK_EQ_INT(arg_bool(a, "commit", "word", &v, &err), -EINVAL);
  CHECK(err && strstr(err, "'word' must be true or false, not a string"));
  free(err);
  json_decref(a);
}

/* Every tool is described whole; what IGN_MCP_NET allows shows in the
 * annotations (only run and sandbox_run may reach the outside, and only when
 * it is not off) and in the modes `network` offers. */
static void definitions_are_complete(void) {
  static const struct {
    const char *net;
    const char *modes;
  } rows[] = {{"off", "[\"none\"]"}, {"allow", "[\"none\", \"allow\"]"},
              {"open", "[\"none\", \"allow\", \"open\"]"}};
  for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
    json_t *tools = tool_definitions(rows[r].net, 65536, 1 << 20, 1 << 20);
    CHECK_EQ_INT(json_array_size(tools), 18);
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
      const char *name = json_string_value(json_object_get(t, "name"));
      CHECK(json_is_string(json_object_get(t, "title")));
      CHECK(json_is_string(json_object_get(t, "description")));
      json_t *in = json_object_get(t, "inputSchema");
      CHECK(json_is_object(in));
      CHECK(json_is_object(json_object_get(t, "outputSchema")));
      json_t *a = json_object_get(t, "annotations");
      bool reaches = strcmp(rows[r].net, "off") != 0 &&
                     (strcmp(name, "run") == 0 || strcmp(name, "sandbox_run") == 0);
      CHECK(json_is_boolean(json_object_get(a, "openWorldHint")));
      CHECK(json_is_true(json_object_get(a, "openWorldHint")) == reaches);
      json_t *net = json_object_get(json_object_get(in, "properties"), "network");
      bool asks = strcmp(name, "open_session") == 0 || strcmp(name, "sandbox_run") == 0 ||
                  strcmp(name, "network_update") == 0;
      CHECK((net != NULL) == asks);
      if (net) {
        json_t *want = json_loads(rows[r].modes, 0, NULL);
        CHECK(json_equal(json_object_get(net, "enum"), want));
        json_decref(want);
      }
    }
    CHECK_STREQ(json_string_value(json_object_get(json_array_get(tools, 16), "name")),
                "network_log");
    json_decref(tools);
  }
}

static void stdin_file_checks(void) {
  char *err = NULL;
  const char *f = NULL;
  json_t *a = json_pack("{s:s}", "stdin_file", "in.txt");
  CHECK_EQ_INT(arg_stdin_file(a, "run", &f, &err), 0);
  CHECK_STREQ(f, "in.txt");
  json_decref(a);
  a = json_pack("{s:s, s:s}", "stdin", "x", "stdin_file", "in.txt");
  CHECK_EQ_INT(arg_stdin_file(a, "sandbox_run", &f, &err), -EINVAL);
  CHECK_STREQ(err, "sandbox_run: give either 'stdin' (the text itself) or 'stdin_file' (a file "
                   "on the host), not both");
  free(err);
  err = NULL;
  json_decref(a);
  /* null stands for absent, on either side */
  a = json_pack("{s:n, s:s}", "stdin", "stdin_file", "in.txt");
  CHECK_EQ_INT(arg_stdin_file(a, "run", &f, &err), 0);
  json_decref(a);
  a = json_pack("{s:s}", "stdin_file", "");
  CHECK_EQ_INT(arg_stdin_file(a, "run", &f, &err), -EINVAL);
  CHECK_STREQ(err, "run: 'stdin_file' is empty; give a non-empty string");
  free(err);
  err = NULL;
  json_decref(a);
  a = json_pack("{s:i}", "stdin", 3);
  const char *in;
  size_t len;
  CHECK_EQ_INT(arg_stdin(a, "sandbox_run", 10, &in, &len, &err), -EINVAL);
  CHECK_STREQ(err, "sandbox_run: 'stdin' must be a string, not an integer");
  free(err);
  json_decref(a);
}

static void copy_checks(void) {
  struct arg_copy c[4];
  size_t n = 99;
  char *err = NULL;
  json_t *a = json_pack("{s:[{s:s, s:s}, {s:s, s:s}]}", "copy_in", "host", "src", "guest",
                        "/work/src", "guest", "w", "host", "h");
  CHECK_EQ_INT(arg_copies(a, "sandbox_run", "copy_in", c, 4, &n, &err), 0);
  CHECK_EQ_INT(n, 2);
  CHECK_STREQ(c[0].host, "src");
  CHECK_STREQ(c[0].guest, "/work/src");
  CHECK_STREQ(c[1].host, "h");
  CHECK_STREQ(c[1].guest, "w");
  CHECK_EQ_INT(arg_copies(a, "sandbox_run", "copy_out", c, 4, &n, &err), 0);
  CHECK_EQ_INT(n, 0);
  CHECK_EQ_INT(arg_copies(a, "sandbox_run", "copy_in", c, 1, &n, &err), -EINVAL);
  CHECK_STREQ(err, "sandbox_run: 'copy_in' has 2 entries, over the cap of 1; copy a common "
                   "parent directory instead (a directory is copied whole)");
  free(err);
  json_decref(a);

  struct {
    const char *json, *name, *msg;
  } bad[] = {
      {"{\"copy_in\": \"src\"}", "copy_in",
       "sandbox_run: 'copy_in' must be an array of {host, guest} objects, not a string"},
      {"{\"copy_out\": [3]}", "copy_out",
       "sandbox_run: copy_out[0] must be an object {guest, host}, not an integer"},
      {"{\"copy_in\": [{\"host\": \"a\"}]}", "copy_in",
       "sandbox_run: copy_in[0] has no 'guest'; each entry is an object {host, guest}"},
      {"{\"copy_out\": [{\"host\": \"a\"}]}", "copy_out",
       "sandbox_run: copy_out[0] has no 'guest'; each entry is an object {guest, host}"},
      {"{\"copy_in\": [{\"host\": \"a\", \"guest\": \"b\", \"mode\": 1}]}", "copy_in",
       "sandbox_run: copy_in[0] has no field 'mode'; each entry is an object {host, guest}"},
      {"{\"copy_in\": [{\"host\": \"\", \"guest\": \"b\"}]}", "copy_in",
       "sandbox_run: copy_in[0].host is empty; give a path"},
      {"{\"copy_in\": [{\"host\": \"a\", \"guest\": 7}]}", "copy_in",
       "sandbox_run: copy_in[0].guest must be a string, not an integer"},
      {"{\"copy_out\": [{\"host\": \"a\\u0000b\", \"guest\": \"g\"}]}", "copy_out",
       "sandbox_run: copy_out[0].host is a string with a NUL character; give a path"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    json_error_t je;
    a = json_loads(bad[i].json, JSON_ALLOW_NUL, &je);
    CHECK(a != NULL);
    err = NULL;
    CHECK_EQ_INT(arg_copies(a, "sandbox_run", bad[i].name, c, 4, &n, &err), -EINVAL);
    CHECK_STREQ(err, bad[i].msg);
    free(err);
    json_decref(a);
  }
}

TEST_MAIN(TEST(stdin_file_checks), TEST(copy_checks), TEST(base64_round_trip), TEST(base64_refuses_garbage), TEST(utf8_sanitize_replaces_invalid),
          TEST(arg_checks), TEST(env_checks), TEST(bool_checks), TEST(definitions_are_complete))
