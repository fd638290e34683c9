/* fuzz_tool_args.c: the tool argument checks, called directly.  The first
 * byte picks a tool (or one of the raw decoders: strict base64, the UTF-8
 * sanitizer); the rest is the JSON text of its arguments.  The session layer
 * has no backend, so nothing runs: a call gets past its argument checks only
 * to be told the session does not exist or cannot open. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/log.h"
#include "fuzz/fuzz.h"
#include "session/session.h"
#include "tools/args.h"
#include "tools/tools.h"

static const char *const tool_names[] = {
    "open_session", "run",    "write_file", "read_file",  "reset",   "close",
    "list_sessions", "commit", "fork",       "stage_list", "stage_info", "stage_rm"};
#define N_TOOLS (sizeof tool_names / sizeof tool_names[0])

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_server_without_backend();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  unsigned pick = data[0] % (N_TOOLS + 2);
  const char *rest = (const char *)data + 1;
  size_t n = size - 1;
  if (pick == N_TOOLS) {
    uint8_t *out = NULL;
    size_t out_len = 0;
    char *err = NULL;
    if (base64_decode(rest, n, &out, &out_len, &err) == 0) {
      /* What decodes must encode back to the same text, but for the
       * padding, which is optional. */
      char *again = base64_encode(out, out_len);
      if (!again)
        abort();
      size_t m = strlen(again), k = n;
      while (m && again[m - 1] == '=')
        m--;
      while (k && rest[k - 1] == '=')
        k--;
      if (m != k || memcmp(again, rest, k) != 0)
        abort();
      free(again);
    }
    free(out);
    free(err);
    return 0;
  }
  if (pick == N_TOOLS + 1) {
    size_t len = 0;
    char *s = utf8_sanitize(rest, n, &len);
    if (s) {
      json_t *j = json_stringn(s, len); /* jansson accepts only valid UTF-8 */
      if (!j)
        abort();
      json_decref(j);
    }
    free(s);
    return 0;
  }
  json_t *args = json_loadb(rest, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
  struct call_ctx ctx = {0};
  json_t *res = tools_call(tool_names[pick], json_is_object(args) ? args : NULL, &ctx);
  /* Every answer is a CallToolResult with text content. */
  if (!json_is_object(res) || !json_is_array(json_object_get(res, "content")))
    abort();
  json_decref(res);
  json_decref(args);
  return 0;
}
