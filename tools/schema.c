/* schema.c: what tools/list says about each tool: title, a description
 * written for a model, input and output JSON Schemas, and annotations that
 * tell the truth (no tool reaches the outside world unless IGN_MCP_NET
 * gives sandboxes a network). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "tools/args.h"

static const char session_id_schema[] =
    "{\"type\":\"string\",\"description\":\"The id open_session returned.\"}";

static const char open_session_out[] =
    "{\"type\":\"object\",\"properties\":{"
    "\"session_id\":{\"type\":\"string\"},"
    "\"isolation\":{\"type\":\"string\",\"description\":\"How strongly the session is isolated: "
    "microvm/kvm, microvm/tcg or namespace.\"},"
    "\"backend\":{\"type\":\"string\"},\"rootfs\":{\"type\":\"string\"},"
    "\"limits\":{\"type\":\"string\"},\"open_ms\":{\"type\":\"integer\"},"
    "\"ok\":{\"type\":\"boolean\"}},"
    "\"required\":[\"session_id\",\"isolation\",\"backend\"]}";

static const char run_out[] =
    "{\"type\":\"object\",\"properties\":{"
    "\"stdout\":{\"type\":\"string\"},\"stderr\":{\"type\":\"string\"},"
    "\"exit_code\":{\"type\":\"integer\",\"description\":\"The exit status; 128+N when the command "
    "was killed by signal N.\"},"
    "\"timed_out\":{\"type\":\"boolean\"},"
    "\"signal\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}],"
    "\"description\":\"The signal that killed the command (e.g. SIGKILL), or null.\"},"
    "\"duration_ms\":{\"type\":\"integer\"},"
    "\"stdout_bytes\":{\"type\":\"integer\"},\"stderr_bytes\":{\"type\":\"integer\"},"
    "\"stdout_truncated\":{\"type\":\"boolean\"},\"stderr_truncated\":{\"type\":\"boolean\"}},"
    "\"required\":[\"stdout\",\"stderr\",\"exit_code\",\"timed_out\",\"signal\",\"duration_ms\","
    "\"stdout_bytes\",\"stderr_bytes\",\"stdout_truncated\",\"stderr_truncated\"]}";

static const char write_out[] =
    "{\"type\":\"object\",\"properties\":{\"ok\":{\"type\":\"boolean\"},"
    "\"path\":{\"type\":\"string\"},\"bytes\":{\"type\":\"integer\"}},"
    "\"required\":[\"ok\",\"path\",\"bytes\"]}";

static const char read_out[] =
    "{\"type\":\"object\",\"properties\":{\"content_base64\":{\"type\":\"string\"},"
    "\"bytes\":{\"type\":\"integer\",\"description\":\"Bytes returned in this piece.\"},"
    "\"size\":{\"type\":\"integer\",\"description\":\"The file's size.\"},"
    "\"eof\":{\"type\":\"boolean\",\"description\":\"True when this piece reaches the end of the "
    "file.\"}},\"required\":[\"content_base64\",\"bytes\",\"size\",\"eof\"]}";

static const char close_out[] =
    "{\"type\":\"object\",\"properties\":{\"ok\":{\"type\":\"boolean\"},"
    "\"session_id\":{\"type\":\"string\"}},\"required\":[\"ok\",\"session_id\"]}";

static const char list_out[] =
    "{\"type\":\"object\",\"properties\":{\"sessions\":{\"type\":\"array\",\"items\":{"
    "\"type\":\"object\",\"properties\":{\"session_id\":{\"type\":\"string\"},"
    "\"isolation\":{\"type\":\"string\"},\"age_s\":{\"type\":\"integer\"},"
    "\"idle_s\":{\"type\":\"integer\"},\"busy\":{\"type\":\"boolean\"},"
    "\"alive\":{\"type\":\"boolean\"}},\"required\":[\"session_id\",\"isolation\"]}},"
    "\"max_sessions\":{\"type\":\"integer\"},\"idle_secs\":{\"type\":\"integer\"}},"
    "\"required\":[\"sessions\",\"max_sessions\"]}";

static json_t *parse(const char *s) {
  json_error_t e;
  json_t *j = json_loads(s, 0, &e);
  if (!j) {
    fprintf(stderr, "ignition-mcp: internal schema error: %s\n", e.text);
    abort();
  }
  return j;
}

static json_t *input(json_t *props, const char *const *required) {
  json_t *req = json_array();
  for (const char *const *r = required; *r; r++)
    json_array_append_new(req, json_string(*r));
  return json_pack("{s:s, s:o, s:o, s:b}", "type", "object", "properties", props, "required", req,
                   "additionalProperties", 0);
}

static json_t *tool(const char *name, const char *title, const char *desc, json_t *in,
                    const char *out, bool read_only, bool destructive, bool idempotent,
                    bool open_world) {
  return json_pack("{s:s, s:s, s:s, s:o, s:o, s:{s:s, s:b, s:b, s:b, s:b}}", "name", name, "title",
                   title, "description", desc, "inputSchema", in, "outputSchema", parse(out),
                   "annotations", "title", title, "readOnlyHint", read_only, "destructiveHint",
                   destructive, "idempotentHint", idempotent, "openWorldHint", open_world);
}

json_t *tool_definitions(bool net, size_t output_cap, size_t max_file, size_t max_read) {
  json_t *tools = json_array();
  _cleanup_free_ char *run_desc = xasprintf(
      "Run a shell command in a session's sandbox as `/bin/sh -c COMMAND` and return its stdout, "
      "stderr and exit code. Every run starts a fresh shell in /root (or cwd): `cd` and `export` "
      "do not carry over to the next run, but files do. Background processes (`server &`) keep "
      "running after the call returns. Output beyond %zu bytes per stream is cut (the *_bytes "
      "fields give the full size): redirect big output to a file and use read_file. The command "
      "is killed after timeout_s seconds (default 30, at most 3600).%s",
      output_cap, net ? "" : " The sandbox has no network.");
  _cleanup_free_ char *write_desc = xasprintf(
      "Write a file into a session's sandbox from base64 content (binary-safe, at most %zu "
      "bytes), creating missing parent directories and replacing the file whole. Relative paths "
      "are under /root. Use this instead of echo/heredocs for anything non-trivial.",
      max_file);
  _cleanup_free_ char *read_desc = xasprintf(
      "Read a file from a session's sandbox as base64: up to max_bytes (default 1 MiB, at most "
      "%zu) from offset. `eof` tells whether the end was reached; read large files in pieces by "
      "advancing offset.",
      max_read);

  json_array_append_new(
      tools,
      tool("open_session", "Open a sandbox session",
           "Open a new sandbox session: a private machine (a microVM, or a namespace sandbox where "
           "no VM can run) cloned from a clean image. Returns its session_id, which every other "
           "tool needs, and how it is isolated. Open one per task and reuse it; close it when "
           "done.",
           input(json_object(), (const char *[]){NULL}), open_session_out, false, false, false,
           false));
  json_array_append_new(
      tools,
      tool("run", "Run a command", run_desc,
           input(json_pack("{s:o, s:{s:s, s:s}, s:{s:s, s:i, s:i, s:i, s:s}, s:{s:s, s:s}, "
                           "s:{s:s, s:s}, s:{s:s, s:{s:s}, s:s}}",
                           "session_id", parse(session_id_schema), "command", "type", "string",
                           "description", "Shell command, run with /bin/sh -c.", "timeout_s",
                           "type", "integer", "minimum", 1, "maximum", 3600, "default", 30,
                           "description", "Seconds before the command's process group is killed.",
                           "cwd", "type", "string", "description",
                           "Working directory (default /root).", "stdin", "type", "string",
                           "description", "Text fed to the command's standard input.", "env",
                           "type", "object", "additionalProperties", "type", "string",
                           "description", "Extra environment variables, NAME: value."),
                 (const char *[]){"session_id", "command", NULL}),
           run_out, false, true, false, net));
  json_array_append_new(
      tools,
      tool("write_file", "Write a file", write_desc,
           input(json_pack("{s:o, s:{s:s, s:s}, s:{s:s, s:s}, s:{s:[{s:s}, {s:s}], s:s}}", "session_id",
                           parse(session_id_schema), "path", "type", "string", "description",
                           "Destination path in the sandbox.", "content_base64", "type", "string",
                           "description", "The file's bytes, standard base64.", "mode", "anyOf",
                           "type", "integer", "type", "string", "description",
                           "Permission bits: an integer (493 = 0755) or an octal string like "
                           "\"755\". Default 0644."),
                 (const char *[]){"session_id", "path", "content_base64", NULL}),
           write_out, false, true, true, false));
  json_array_append_new(
      tools,
      tool("read_file", "Read a file", read_desc,
           input(json_pack("{s:o, s:{s:s, s:s}, s:{s:s, s:i, s:i}, s:{s:s, s:i, s:I}}",
                           "session_id", parse(session_id_schema), "path", "type", "string",
                           "description", "File to read in the sandbox.", "offset", "type",
                           "integer", "minimum", 0, "default", 0, "max_bytes", "type", "integer",
                           "minimum", 1, "maximum", (json_int_t)max_read),
                 (const char *[]){"session_id", "path", NULL}),
           read_out, true, false, true, false));
  json_array_append_new(
      tools,
      tool("reset", "Reset a session",
           "Throw away everything in a session (files, processes) and give it a fresh sandbox "
           "under the same session_id. Use it when the environment is broken.",
           input(json_pack("{s:o}", "session_id", parse(session_id_schema)),
                 (const char *[]){"session_id", NULL}),
           open_session_out, false, true, true, false));
  json_array_append_new(
      tools,
      tool("close", "Close a session",
           "Close a session: its sandbox and everything in it are destroyed and the id stops "
           "working.",
           input(json_pack("{s:o}", "session_id", parse(session_id_schema)),
                 (const char *[]){"session_id", NULL}),
           close_out, false, true, false, false));
  json_array_append_new(
      tools,
      tool("list_sessions", "List sessions",
           "List the open sessions with their isolation, age and idle time, and the session cap.",
           input(json_object(), (const char *[]){NULL}), list_out, true, false, true, false));
  return tools;
}
