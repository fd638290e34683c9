/* test_server.c: the server's request loop (mcp/server.c) against a client
 * that sends calls but does not read its results.  The server is the real
 * one without a sandbox backend (every session id is unknown, so each call
 * answers at once); its stdout is a pipe the test reads only at the end. */
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdlib.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "fuzz/fuzz.h"
#include "mcp/server.h"
#include "test.h"

#define MAX_CALLS 16
#define N_CALLS 200

static atomic_bool fed;

static void feed(const char *line) {
  char *copy = strdup(line);
  mcp_handle_line(copy, strlen(copy));
  free(copy);
}

static void *feeder(void *arg) {
  (void)arg;
  for (int i = 0; i < N_CALLS; i++) {
    char line[256];
    snprintf(line, sizeof line,
             "{\"jsonrpc\":\"2.0\",\"id\":%d,\"method\":\"tools/call\",\"params\":{\"name\":"
             "\"run\",\"arguments\":{\"session_id\":\"nope\",\"command\":\"true\"}}}",
             i + 1);
    feed(line);
  }
  atomic_store(&fed, true);
  return NULL;
}

static void *drainer(void *arg) {
  int fd = *(int *)arg;
  char buf[65536];
  while (read(fd, buf, sizeof buf) > 0)
    ;
  return NULL;
}

/* Results the client does not read are held, but no more of them than the
 * caps allow: the server stops taking calls instead. */
static void unread_results_are_bounded(void) {
  /* Caps that refuse none of these calls as busy: only what is held for
   * the client bounds them. */
  setenv("IGN_MCP_MAX_CALLS", "16", 1);
  setenv("IGN_MCP_MAX_MESSAGE", "1048576", 1);
  setenv("IGN_MCP_OUTPUT_CAP", "1024", 1);
  fuzz_server_without_backend();
  int p[2];
  CHECK_EQ_INT(pipe2(p, O_CLOEXEC), 0);
  /* As small as a pipe gets: a few results fill it. */
  fcntl(p[1], F_SETPIPE_SZ, 4096);
  int saved = dup(STDOUT_FILENO);
  CHECK_EQ_INT(dup2(p[1], STDOUT_FILENO), STDOUT_FILENO);
  close(p[1]);
  feed("{\"jsonrpc\":\"2.0\",\"id\":0,\"method\":\"initialize\",\"params\":{\"protocolVersion\":"
       "\"2025-06-18\",\"capabilities\":{},\"clientInfo\":{\"name\":\"t\",\"version\":\"1\"}}}");
  pthread_t t;
  pthread_create(&t, NULL, feeder, NULL);
  /* Watch the calls held until the feeder is done or stuck for a while. */
  unsigned most = 0;
  for (int i = 0; i < 300 && !atomic_load(&fed); i++) {
    unsigned held = mcp_wait_calls(0);
    if (held > most)
      most = held;
    usleep(10000);
  }
  unsigned held = mcp_wait_calls(0);
  if (held > most)
    most = held;
  /* Calls running and results waiting, each at most the cap (one more of
   * each may be on its way in). */
  CHECK(most <= 2 * MAX_CALLS + 2);
  if (most > 2 * MAX_CALLS + 2)
    fprintf(stderr, "  %u calls held for a client that reads nothing\n", most);
  /* The client reads: everything is answered. */
  pthread_t d;
  pthread_create(&d, NULL, drainer, &p[0]);
  pthread_join(t, NULL);
  CHECK_EQ_INT(mcp_wait_calls(60000), 0);
  dup2(saved, STDOUT_FILENO);
  close(saved);
  pthread_join(d, NULL);
  close(p[0]);
}

static json_t *j(const char *text) {
  json_t *v = json_loads(text, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
  if (!v)
    fprintf(stderr, "  bad JSON in the test: %s\n", text);
  return v;
}

#define ENV "\"io.modelcontextprotocol/protocolVersion\":\"2026-07-28\"," \
            "\"io.modelcontextprotocol/clientCapabilities\":{}"

/* The era is the request's own: decided from its params._meta alone. */
static void era_is_decided_per_request(void) {
  static const struct {
    const char *method, *params;
    bool modern;
  } cases[] = {
      {"tools/list", "{}", false},
      {"tools/call", "{\"_meta\":{\"progressToken\":1}}", false},
      {"tools/call", "{\"_meta\":\"x\"}", false},
      {"tools/list", "{\"_meta\":{" ENV "}}", true},
      {"tools/list", "{\"_meta\":{\"io.modelcontextprotocol/clientInfo\":{}}}", true},
      {"tools/list", "{\"_meta\":{\"io.modelcontextprotocol/logLevel\":\"info\"}}", true},
      {"initialize", "{\"protocolVersion\":\"2025-11-25\"}", false},
      {"server/discover", "{}", false},
      {"server/discover", "{\"_meta\":{}}", true},
      {"server/discover", "{\"_meta\":null}", true},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    json_t *params = j(cases[i].params);
    bool modern = mcp_request_is_modern(cases[i].method, params);
    CHECK(modern == cases[i].modern);
    if (modern != cases[i].modern)
      fprintf(stderr, "  %s %s\n", cases[i].method, cases[i].params);
    json_decref(params);
  }
}

static void envelope_errors(void) {
  static const struct {
    const char *meta;
    int code;
  } cases[] = {
      {"{" ENV "}", 0},
      {"{" ENV ",\"io.modelcontextprotocol/clientInfo\":{\"name\":\"a\",\"version\":\"1\"},"
       "\"io.modelcontextprotocol/logLevel\":\"debug\",\"progressToken\":\"t\"}", 0},
      {"7", -32602},
      {"{\"io.modelcontextprotocol/clientCapabilities\":{}}", -32602},
      {"{\"io.modelcontextprotocol/protocolVersion\":true,"
       "\"io.modelcontextprotocol/clientCapabilities\":{}}", -32602},
      {"{\"io.modelcontextprotocol/protocolVersion\":\"2026-07-28\\u0000\","
       "\"io.modelcontextprotocol/clientCapabilities\":{}}", -32602},
      {"{\"io.modelcontextprotocol/protocolVersion\":\"2026-07-28\"}", -32602},
      {"{\"io.modelcontextprotocol/protocolVersion\":\"2026-07-28\","
       "\"io.modelcontextprotocol/clientCapabilities\":null}", -32602},
      {"{" ENV ",\"io.modelcontextprotocol/clientInfo\":{\"name\":1,\"version\":\"1\"}}", -32602},
      {"{" ENV ",\"io.modelcontextprotocol/logLevel\":\"verbose\"}", -32602},
      /* The version is checked before the rest: a client learns what to
       * speak even from a request that is otherwise incomplete. */
      {"{\"io.modelcontextprotocol/protocolVersion\":\"1999-01-01\"}", -32022},
      {"{\"io.modelcontextprotocol/protocolVersion\":\"2025-11-25\","
       "\"io.modelcontextprotocol/clientCapabilities\":{}}", -32022},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    json_t *meta = j(cases[i].meta);
    char *msg = NULL;
    json_t *data = NULL;
    int code = mcp_check_envelope(meta, &msg, &data);
    CHECK_EQ_INT(code, cases[i].code);
    if (code != cases[i].code)
      fprintf(stderr, "  %s: %s\n", cases[i].meta, msg ? msg : "(no message)");
    CHECK((code == 0) == (msg == NULL));
    CHECK((code == -32022) == (data != NULL));
    if (data) {
      json_t *sup = json_object_get(data, "supported");
      CHECK(json_array_size(sup) == 1);
      CHECK_STREQ(json_string_value(json_array_get(sup, 0)), "2026-07-28");
      CHECK(json_equal(json_object_get(data, "requested"),
                       json_object_get(meta, "io.modelcontextprotocol/protocolVersion")));
    }
    free(msg);
    json_decref(data);
    json_decref(meta);
  }
}

TEST_MAIN(TEST(era_is_decided_per_request), TEST(envelope_errors), TEST(unread_results_are_bounded))
