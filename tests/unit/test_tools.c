/* test_tools.c: what the tool layer reserves for a call before it runs
 * (tools_result_cost), which the server's byte budget adds up; the
 * arguments sandbox_run, copy_in, copy_out and run refuse before anything
 * starts; the tools listed. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/util.h"
#include "egress/egress.h"
#include "test.h"
#include "tools/tools.h"

static size_t read_cost(json_t *args) {
  size_t c = tools_result_cost("read_file", args);
  json_decref(args);
  return c;
}

static void read_file_cost_follows_max_bytes_up_to_the_cap(void) {
  cfg.max_file = 64u << 20;
  /* The default piece is 1 MiB; a call may ask for up to 2 MiB, and is
   * charged for what it asked. */
  CHECK_EQ_INT(read_cost(json_pack("{s:s}", "path", "/f")), (1u << 20) * 6);
  CHECK_EQ_INT(read_cost(json_pack("{s:i}", "max_bytes", 4096)), 4096 * 6);
  CHECK_EQ_INT(read_cost(json_pack("{s:i}", "max_bytes", 2 << 20)), (2u << 20) * 6);
  CHECK_EQ_INT(read_cost(json_pack("{s:i}", "max_bytes", 3 << 20)), (2u << 20) * 6);
  /* A smaller IGN_MCP_MAX_FILE caps the piece. */
  cfg.max_file = 65536;
  CHECK_EQ_INT(read_cost(json_pack("{s:i}", "max_bytes", 2 << 20)), 65536 * 6);
  CHECK_EQ_INT(read_cost(json_pack("{s:s}", "path", "/f")), 65536 * 6);
}

static char *call_err(const char *name, const char *json) {
  json_error_t je;
  json_t *args = json_loads(json, 0, &je);
  CHECK(args != NULL);
  struct call_ctx ctx = {0};
  json_t *r = tools_call(name, args, &ctx);
  json_decref(args);
  CHECK(json_is_true(json_object_get(r, "isError")));
  json_t *c = json_array_get(json_object_get(r, "content"), 0);
  char *t = strdup(json_string_value(json_object_get(c, "text")) ?: "");
  json_decref(r);
  return t;
}

#define CHECK_CALL_ERR(name, json, want)                                                        \
  do {                                                                                         \
    char *got_ = call_err(name, json);                                                         \
    CHECK_STREQ(got_, want);                                                                   \
    free(got_);                                                                                \
  } while (0)

/* What sandbox_run, copy_in, copy_out and run refuse before anything starts. */
static void transfer_arguments_are_checked(void) {
  CHECK_CALL_ERR("sandbox_run", "{}", "sandbox_run needs the argument 'command' (a string)");
  CHECK_CALL_ERR("sandbox_run", "{\"command\": \"true\", \"image\": \"x\"}",
                 "sandbox_run has no argument 'image'; its arguments are: command, stage, "
                 "commit_as, network, allow_hosts, secrets, stdin, stdin_file, copy_in, copy_out, env, "
                 "cwd, timeout_s");
  CHECK_CALL_ERR("sandbox_run",
                 "{\"command\": \"cat\", \"stdin\": \"x\", \"stdin_file\": \"f\"}",
                 "sandbox_run: give either 'stdin' (the text itself) or 'stdin_file' (a file on "
                 "the host), not both");
  CHECK_CALL_ERR("sandbox_run", "{\"command\": \"true\", \"timeout_s\": 0}",
                 "sandbox_run: 'timeout_s' is 0, outside its range 1..3600; give a value in "
                 "that range");
  char *e = call_err("sandbox_run", "{\"command\": \"true\", \"commit_as\": \"Bad Name\"}");
  CHECK(strncmp(e, "sandbox_run: 'commit_as': invalid stage name: ", 46) == 0);
  free(e);
  CHECK_CALL_ERR("sandbox_run", "{\"command\": \"true\", \"env\": {\"A\": 1}}",
                 "sandbox_run: env['A'] must be a string, not an integer");
  CHECK_CALL_ERR("copy_in", "{\"session_id\": \"s1\", \"host_path\": \"a\"}",
                 "copy_in needs the argument 'guest_path' (a string)");
  CHECK_CALL_ERR("copy_out", "{\"session_id\": \"s1\", \"guest_path\": \"a\", "
                             "\"host_path\": \"b\", \"mode\": 1}",
                 "copy_out has no argument 'mode'; its arguments are: session_id, host_path, "
                 "guest_path");
  CHECK_CALL_ERR("run",
                 "{\"session_id\": \"s1\", \"command\": \"cat\", \"stdin\": \"x\", "
                 "\"stdin_file\": \"f\"}",
                 "run: give either 'stdin' (the text itself) or 'stdin_file' (a file on the "
                 "host), not both");
}

/* NETWORK_ROWS: the tool's own name, then what the broker's egress_new
 * refuses of `network` and `allow_hosts`, before anything starts; a policy
 * that passes reaches the session layer (which has no backend here), and
 * the egress made for it is freed there (ASan would see a leak). */
static void network_rows(const char *tool, const char *base) {
  static const struct {
    const char *args, *want;
  } rows[] = {
      {"\"network\": true", ": 'network' must be a string, \"none\", \"allow\" or \"open\"; the "
                             "boolean form (true/false) is gone"},
      {"\"network\": \"on\"", ": 'network' must be \"none\", \"allow\" (with allow_hosts) or "
                               "\"open\", not \"on\""},
      {"\"allow_hosts\": [\"pypi.org\"]",
       ": allow_hosts goes only with network \"allow\" (network is \"none\")"},
      {"\"network\": \"none\", \"allow_hosts\": [\"pypi.org\"]",
       ": allow_hosts goes only with network \"allow\" (network is \"none\")"},
      {"\"network\": \"allow\", \"allow_hosts\": []",
       ": network \"allow\" needs allow_hosts, a non-empty array"},
      {"\"network\": \"allow\"", ": network \"allow\" needs allow_hosts, a non-empty array"},
      {"\"network\": \"allow\", \"allow_hosts\": [\"pypi.org\", \"10.0.0.1\"]", "allow_hosts[1]"},
      {"\"network\": \"allow\", \"allow_hosts\": [\"pypi.org\", 7]",
       ": allow_hosts[1] must be a string"},
      {"\"network\": \"open\"",
       ": network \"open\" is refused: this server runs with IGN_MCP_NET=allow"},
  };
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    char *json = xasprintf("{%s%s%s}", base, *base ? ", " : "", rows[i].args);
    char *e = call_err(tool, json);
    CHECK(strncmp(e, tool, strlen(tool)) == 0);
    CHECK(strstr(e, rows[i].want) != NULL);
    if (strncmp(e, tool, strlen(tool)) != 0 || !strstr(e, rows[i].want))
      fprintf(stderr, "# %s %s: %s\n", tool, json, e);
    free(e);
    free(json);
  }
  for (const char *ok = "\"network\": \"allow\", \"allow_hosts\": [\"pypi.org\"]"; ok; ok = NULL) {
    char *json = xasprintf("{%s%s%s}", base, *base ? ", " : "", ok);
    char *e = call_err(tool, json);
    CHECK(strstr(e, "no sandbox backend can run here") != NULL);
    free(e);
    free(json);
  }
}

static void network_arguments_are_checked(void) {
  struct egress_settings es = {.max_mode = EGRESS_MODE_ALLOW, .log_dir = "/nonexistent/logs",
                               .log_cap = 1 << 20, .max_streams = 64, .max_bytes = 1u << 30};
  char *err = NULL;
  CHECK_EQ_INT(egress_init(&es, &err), 0);
  free(err);
  network_rows("open_session", "");
  network_rows("sandbox_run", "\"command\": \"true\"");
  egress_shutdown();
}

static void eighteen_tools_are_listed(void) {
  json_t *t = tools_list(true);
  CHECK_EQ_INT(json_array_size(t), 18);
  const char *last[] = {"sandbox_run", "copy_in", "copy_out", "network_log", "network_update"};
  for (size_t i = 0; i < 5; i++)
    CHECK_STREQ(json_string_value(json_object_get(json_array_get(t, 13 + i), "name")), last[i]);
  /* The long ones may run as tasks (2025-11-25); the others say they may
   * not, and the 2026-07-28 list has no execution at all. */
  const char *may[] = {"run", "sandbox_run", "commit", "fork", "copy_in", "copy_out"};
  size_t optional = 0;
  for (size_t i = 0; i < json_array_size(t); i++) {
    json_t *tool = json_array_get(t, i);
    const char *name = json_string_value(json_object_get(tool, "name"));
    const char *support =
        json_string_value(json_object_get(json_object_get(tool, "execution"), "taskSupport"));
    bool listed = false;
    for (size_t j = 0; j < ARRAY_SIZE(may); j++)
      listed = listed || strcmp(name, may[j]) == 0;
    CHECK_STREQ(support, listed ? "optional" : "forbidden");
    CHECK(tools_task_support(name) == listed);
    optional += listed;
  }
  CHECK_EQ_INT(optional, ARRAY_SIZE(may));
  json_decref(t);
  t = tools_list(false);
  for (size_t i = 0; i < json_array_size(t); i++)
    CHECK(json_object_get(json_array_get(t, i), "execution") == NULL);
  json_decref(t);
  CHECK_CALL_ERR("network_log", "{}",
                 "this tool needs the argument 'session_id' (a string: the id open_session "
                 "returned)");
  CHECK_CALL_ERR("network_log", "{\"session_id\": \"s1\", \"all\": true}",
                 "network_log has no argument 'all'; its arguments are: session_id");
}

TEST_MAIN(TEST(read_file_cost_follows_max_bytes_up_to_the_cap), TEST(transfer_arguments_are_checked),
          TEST(network_arguments_are_checked), TEST(eighteen_tools_are_listed))
