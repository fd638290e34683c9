/* schema.c: what tools/list says about each tool: title, a description
 * written for a model, input and output JSON Schemas, and annotations that
 * tell the truth (run and sandbox_run may reach the outside world, through
 * the egress broker, unless IGN_MCP_NET=off). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "tools/args.h"

#define STDIN_FILE_DESC                                                                           \
  "A file on the host fed to standard input instead of stdin: relative to the host-I/O root "    \
  "(IGN_MCP_HOST_IO_ROOT, by default the directory the server was started in) or absolute "    \
  "inside it; a regular file of at most 4 MiB."

/* x-mcp-header (MCP 2026-07-28, server/tools): a client on Streamable HTTP
 * copies the argument into an Mcp-Param-Session-Id header, so a proxy in
 * front of several servers can route a call to the one that holds it. */
static const char session_id_schema[] =
    "{\"type\":\"string\",\"description\":\"The id open_session returned.\","
    "\"x-mcp-header\":\"Session-Id\"}";

/* The network modes a session may ask for under IGN_MCP_NET (the enum of
 * `network`), and the arguments that ask. */
#define NETWORK_DESC                                                                              \
  "The sandbox's network: none (the default: every attempt is refused), allow (only the hosts "   \
  "in allow_hosts) or open (any public host; only when the server runs with IGN_MCP_NET=open). "  \
  "The sandbox has no network device either way: its connections go through the server, which "   \
  "decides each one and records it."
#define ALLOW_HOSTS_DESC                                                                          \
  "With network \"allow\" (and only then; at least one): the hosts the sandbox may reach. "       \
  "Each is a host name (ports 80 and 443), name:PORT, name:* (any port) or *.suffix (names "      \
  "below suffix, which has two labels at least), e.g. pypi.org, *.pythonhosted.org, "             \
  "github.com:22. Names only: IP addresses are refused. A request rule adds a method (or *) "    \
  "and an optional path prefix, e.g. \"api.github.com GET /repos/myorg/\": the server reads "      \
  "each request to that host and refuses (403) those outside every such rule."

#define SECRETS_DESC                                                                              \
  "Names of the operator's secrets (IGN_MCP_SECRETS) this sandbox may use, e.g. "                 \
  "[\"GITHUB_TOKEN\"]: each command gets NAME=<placeholder> in its environment, never the "        \
  "value; the server puts the value in place of the placeholder in requests to that secret's "    \
  "hosts only (which are allowed as if in allow_hosts)."

/* The `egress` field of run and sandbox_run, and network_log's result. */
#define EGRESS_REPORT_SCHEMA                                                                      \
    "{\"type\":\"object\",\"description\":\"What the sandbox tried to reach (run, "               \
    "sandbox_run: since the previous report; network_log: the whole session), newest last, at "   \
    "most 64 per list.\",\"properties\":{"                                                        \
    "\"mode\":{\"type\":\"string\"},"                                                             \
    "\"allowed_rules\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}},"                     \
    "\"allowed\":{\"type\":\"array\",\"items\":{\"type\":\"object\"},"                            \
    "\"description\":\"Connections made: host, ip, port, rule, bytes_up, bytes_down, "            \
    "duration_ms.\"},"                                                                            \
    "\"denied\":{\"type\":\"array\",\"items\":{\"type\":\"object\"},"                          \
    "\"description\":\"Connections refused, each with its reason: the first 16, then the "     \
    "latest.\"},"                                                                              \
    "\"denied_total\":{\"type\":\"integer\",\"description\":\"Refusals in all.\"},"            \
    "\"denied_omitted\":{\"type\":\"integer\",\"description\":\"Refusals between the first "   \
    "and the latest that denied does not list.\"},"                                            \
    "\"denied_counts\":{\"type\":\"array\",\"items\":{\"type\":\"object\"},\"description\":"   \
    "\"network_log: refused connects and lookups counted by destination and reason "           \
    "({kind, destination, reason, count}; past 64 of a kind one {kind: other, count}).\"},"    \
    "\"dns_queries\":{\"type\":\"array\",\"items\":{\"type\":\"object\"}},"                    \
    "\"total_events\":{\"type\":\"integer\"},\"truncated\":{\"type\":\"boolean\"},"            \
    "\"egress_log_path\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}],"                 \
    "\"description\":\"Every event of the session as JSON Lines on the host.\"}},"                \
    "\"required\":[\"mode\",\"allowed\",\"denied\",\"dns_queries\"]}"

static const char open_session_out[] =
    "{\"type\":\"object\",\"properties\":{"
    "\"session_id\":{\"type\":\"string\"},"
    "\"isolation\":{\"type\":\"string\",\"description\":\"How strongly the session is isolated: "
    "microvm/kvm, microvm/tcg or namespace.\"},"
    "\"backend\":{\"type\":\"string\"},\"rootfs\":{\"type\":\"string\"},"
    "\"limits\":{\"type\":\"string\"},\"open_ms\":{\"type\":\"integer\"},"
    "\"stage\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}],\"description\":\"The "
    "stage the sandbox started from, or null (the clean base, or a fork).\"},"
    "\"stage_id\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]},"
    "\"serial_log_path\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}],"
    "\"description\":\"vm: the guest's serial console (kernel messages) on the host, the first "
    "1 MiB; null on namespace sandboxes.\"},"
    "\"egress\":{\"type\":\"object\",\"description\":\"The session's network policy: mode, "
    "allowed_rules, egress_log_path, and capture when the sandbox cannot route its traffic to "
    "the server (it then has no network at all).\",\"properties\":{"
    "\"mode\":{\"type\":\"string\"},"
    "\"allowed_rules\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}},"
    "\"egress_log_path\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]},"
    "\"capture\":{\"type\":\"string\"}},\"required\":[\"mode\"]},"
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
    "\"stdout_truncated\":{\"type\":\"boolean\"},\"stderr_truncated\":{\"type\":\"boolean\"},"
    "\"stdout_log_path\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}],"
    "\"description\":\"The complete stdout on the host (up to IGN_MCP_LOG_CAP bytes, then a "
    "marker line), readable only by the server's user; null when logs are off or could not be "
    "made.\"},"
    "\"stderr_log_path\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}],"
    "\"description\":\"The complete stderr on the host, as stdout_log_path.\"},"
    "\"log_error\":{\"type\":\"string\",\"description\":\"Present when a log is incomplete "
    "or could not be made (full disk, a disk slower than the output, a refused log "
    "directory); the run itself is unaffected.\"},"
    "\"egress\":" EGRESS_REPORT_SCHEMA "},"
    "\"required\":[\"stdout\",\"stderr\",\"exit_code\",\"timed_out\",\"signal\",\"duration_ms\","
    "\"stdout_bytes\",\"stderr_bytes\",\"stdout_truncated\",\"stderr_truncated\","
    "\"stdout_log_path\",\"stderr_log_path\"]}";

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
    "\"alive\":{\"type\":\"boolean\"},"
    "\"stage\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]},"
    "\"state\":{\"type\":\"string\",\"enum\":[\"running\",\"hibernated\"]},"
    "\"bytes\":{\"type\":\"integer\",\"description\":\"Disk a hibernated session takes.\"},"
    "\"hibernated_at\":{\"type\":\"integer\",\"description\":\"Unix time.\"},"
    "\"carries\":{\"type\":\"string\"}},"
    "\"required\":[\"session_id\",\"isolation\",\"state\"]}},"
    "\"max_sessions\":{\"type\":\"integer\"},\"idle_secs\":{\"type\":\"integer\"},"
    "\"hibernated_bytes\":{\"type\":\"integer\"},\"hibernate_max_mb\":{\"type\":\"integer\"},"
    "\"recently_closed\":{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{"
    "\"session_id\":{\"type\":\"string\"},\"why\":{\"type\":\"string\"},"
    "\"at\":{\"type\":\"integer\"}}}}},"
    "\"required\":[\"sessions\",\"max_sessions\"]}";

static const char hibernate_out[] =
    "{\"type\":\"object\",\"properties\":{\"session_id\":{\"type\":\"string\"},"
    "\"state\":{\"type\":\"string\"},"
    "\"carries\":{\"type\":\"string\",\"description\":\"memory: processes, RAM and files go "
    "on after resume; files: only the files (processes end).\"},"
    "\"bytes\":{\"type\":\"integer\"},\"hibernate_ms\":{\"type\":\"integer\"},"
    "\"paused_ms\":{\"type\":\"number\"},\"hibernated_at\":{\"type\":\"integer\"}},"
    "\"required\":[\"session_id\",\"state\",\"carries\",\"bytes\"]}";

static const char stage_name_schema[] =
    "{\"type\":\"string\",\"pattern\":\"^[a-z0-9][a-z0-9._/-]{0,127}$\",\"description\":\"A "
    "stage name, e.g. myproject/data-deps.\"}";

static const char commit_out[] =
    "{\"type\":\"object\",\"properties\":{\"stage\":{\"type\":\"string\"},"
    "\"stage_id\":{\"type\":\"string\"},"
    "\"parent\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]},"
    "\"parent_id\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]},"
    "\"carries\":{\"type\":\"string\",\"description\":\"memory: processes, RAM and files "
    "continue in sessions from the stage; files: only the files.\"},"
    "\"bytes\":{\"type\":\"integer\"},\"commit_ms\":{\"type\":\"integer\"},"
    "\"paused_ms\":{\"type\":\"number\"}},"
    "\"required\":[\"stage\",\"stage_id\",\"parent\",\"carries\",\"bytes\",\"commit_ms\","
    "\"paused_ms\"]}";

static const char fork_out[] =
    "{\"type\":\"object\",\"properties\":{\"sessions\":{\"type\":\"array\",\"items\":{"
    "\"type\":\"object\",\"properties\":{\"session_id\":{\"type\":\"string\"},"
    "\"isolation\":{\"type\":\"string\"},\"open_ms\":{\"type\":\"integer\"}},"
    "\"required\":[\"session_id\",\"isolation\",\"open_ms\"]}},"
    "\"fork_ms\":{\"type\":\"integer\"},\"paused_ms\":{\"type\":\"number\"},"
    "\"carries\":{\"type\":\"string\"},\"source\":{\"type\":\"string\"}},"
    "\"required\":[\"sessions\",\"fork_ms\",\"paused_ms\",\"carries\"]}";

#define STAGE_PROPS                                                                               \
  "\"name\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]},"                          \
  "\"stage_id\":{\"type\":\"string\"},"                                                         \
  "\"parent\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]},"                        \
  "\"carries\":{\"type\":\"string\"},\"backend\":{\"type\":\"string\"},"                          \
  "\"base_id\":{\"type\":\"string\"},\"bytes\":{\"type\":\"integer\"},"                           \
  "\"created\":{\"type\":\"integer\"},\"sessions\":{\"type\":\"integer\"}"

static const char stage_info_out[] =
    "{\"type\":\"object\",\"properties\":{" STAGE_PROPS "},"
    "\"required\":[\"name\",\"stage_id\",\"parent\",\"carries\",\"backend\",\"base_id\","
    "\"bytes\",\"created\",\"sessions\"]}";

static const char stage_list_out[] =
    "{\"type\":\"object\",\"properties\":{\"stages\":{\"type\":\"array\",\"items\":{"
    "\"type\":\"object\",\"properties\":{" STAGE_PROPS "},\"required\":[\"name\",\"stage_id\"]}},"
    "\"bytes_used\":{\"type\":\"integer\"},\"bytes_max\":{\"type\":\"integer\"}},"
    "\"required\":[\"stages\"]}";

static const char stage_rm_out[] =
    "{\"type\":\"object\",\"properties\":{\"ok\":{\"type\":\"boolean\"},"
    "\"name\":{\"type\":\"string\"}},\"required\":[\"ok\",\"name\"]}";

static const char copied_props[] =
    "\"files\":{\"type\":\"integer\"},\"dirs\":{\"type\":\"integer\"},"
    "\"symlinks\":{\"type\":\"integer\"},\"bytes\":{\"type\":\"integer\"},"
    "\"skipped\":{\"type\":\"integer\",\"description\":\"Entries left out (device nodes, FIFOs, "
    "sockets, hard links, symlinks pointing outside the copied tree); setuid/setgid/sticky bits "
    "and group/other write are dropped from what is copied.\"},"
    "\"skipped_entries\":{\"type\":\"array\",\"description\":\"The first 64 skipped entries.\","
    "\"items\":{\"type\":\"object\",\"properties\":{\"path\":{\"type\":\"string\"},"
    "\"reason\":{\"type\":\"string\"}},\"required\":[\"path\",\"reason\"]}}";

static const char copy_out_schema_fmt[] =
    "{\"type\":\"object\",\"properties\":{\"ok\":{\"type\":\"boolean\"},"
    "\"host_path\":{\"type\":\"string\"},\"guest_path\":{\"type\":\"string\"},"
    "\"copied\":{\"type\":\"object\",\"properties\":{%s},"
    "\"required\":[\"files\",\"dirs\",\"symlinks\",\"bytes\",\"skipped\",\"skipped_entries\"]},"
    "\"copy_ms\":{\"type\":\"integer\"}},"
    "\"required\":[\"ok\",\"host_path\",\"guest_path\",\"copied\",\"copy_ms\"]}";

/* sandbox_run's fields besides run's. */
static const char sandbox_run_props[] =
    "{\"total_ms\":{\"type\":\"integer\",\"description\":\"The whole call: start, copies, run, "
    "commit, teardown.\"},"
    "\"path\":{\"type\":\"string\",\"description\":\"How the sandbox was made: pool (a clone "
    "waiting ready), restore (a clone of the warm base), cold (started from scratch) or stage.\"},"
    "\"open_ms\":{\"type\":\"integer\"},\"teardown_ms\":{\"type\":\"integer\"},"
    "\"copy_in_ms\":{\"type\":\"integer\"},\"copy_out_ms\":{\"type\":\"integer\"},"
    "\"commit_ms\":{\"type\":\"integer\"},\"stage_id\":{\"type\":\"string\"},"
    "\"stage_name\":{\"type\":\"string\",\"description\":\"The stage commit_as made.\"},"
    "\"commit_skipped\":{\"type\":\"string\"},\"commit_error\":{\"type\":\"string\"},"
    "\"isolation\":{\"type\":\"string\"},\"vcpus\":{\"type\":\"integer\"},"
    "\"mem_mib\":{\"type\":\"integer\"},"
    "\"serial_log_path\":{\"type\":\"string\",\"description\":\"vm: a copy of the guest's "
    "serial console, kept after the sandbox is gone.\"},"
    "\"serial_log_error\":{\"type\":\"string\",\"description\":\"vm: why the serial "
    "console was not kept (e.g. the file in the VM's directory was not the one QEMU was "
    "given).\"},"
    "\"copied\":{\"type\":\"array\",\"description\":\"One entry per copy_in and copy_out "
    "mapping, in order.\",\"items\":{\"type\":\"object\",\"properties\":{"
    "\"direction\":{\"enum\":[\"in\",\"out\"]},\"host\":{\"type\":\"string\"},"
    "\"guest\":{\"type\":\"string\"},\"ok\":{\"type\":\"boolean\"},"
    "\"error\":{\"type\":\"string\"},\"copy_ms\":{\"type\":\"integer\"},%s},"
    "\"required\":[\"direction\",\"host\",\"guest\"]}}}";

static const char copy_pair_fmt[] =
    "{\"type\":\"array\",\"maxItems\":16,\"description\":\"%s\",\"items\":{\"type\":\"object\","
    "\"properties\":{\"host\":{\"type\":\"string\",\"description\":\"A path on the host, "
    "relative to the host-I/O root (IGN_MCP_HOST_IO_ROOT, by default the directory the server "
    "was started in) or absolute inside it.\"},\"guest\":{\"type\":\"string\",\"description\":"
    "\"A path in the sandbox; relative paths are under /root.\"}},\"required\":[\"host\","
    "\"guest\"],\"additionalProperties\":false}}";

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

/* `network` (the modes IGN_MCP_NET lets a session ask for) and `allow_hosts`. */
static json_t *network_props(const char *net) {
  json_t *modes = json_pack("[s]", "none");
  if (strcmp(net, "off") != 0)
    json_array_append_new(modes, json_string("allow"));
  if (strcmp(net, "open") == 0)
    json_array_append_new(modes, json_string("open"));
  return json_pack("{s:{s:s, s:o, s:s, s:s}, s:{s:s, s:i, s:{s:s, s:i, s:i}, s:s}, "
                   "s:{s:s, s:i, s:{s:s, s:i, s:i}, s:s}}", "network",
                   "type", "string", "enum", modes, "default", "none", "description",
                   NETWORK_DESC, "allow_hosts", "type", "array", "maxItems", 256, "items",
                   "type", "string", "minLength", 1, "maxLength", 540, "description",
                   ALLOW_HOSTS_DESC, "secrets", "type", "array", "maxItems", 256, "items", "type",
                   "string", "minLength", 1, "maxLength", 64, "description", SECRETS_DESC);
}

static json_t *tool(const char *name, const char *title, const char *desc, json_t *in,
                    const char *out, bool read_only, bool destructive, bool idempotent,
                    bool open_world) {
  return json_pack("{s:s, s:s, s:s, s:o, s:o, s:{s:s, s:b, s:b, s:b, s:b}}", "name", name, "title",
                   title, "description", desc, "inputSchema", in, "outputSchema", parse(out),
                   "annotations", "title", title, "readOnlyHint", read_only, "destructiveHint",
                   destructive, "idempotentHint", idempotent, "openWorldHint", open_world);
}

json_t *tool_definitions(const char *net, size_t output_cap, size_t max_file, size_t max_read) {
  json_t *tools = json_array();
  /* Whether a sandbox may reach anything outside (the annotations say so). */
  bool reach = strcmp(net, "off") != 0;
  const char *net_text =
      reach ? " The sandbox has no network device: its connections go out only through the "
              "server, as the session's network policy allows (open_session's network and "
              "allow_hosts; none by default), and every attempt is recorded (the result's egress "
              "field; network_log for the whole session)."
            : " The sandbox has no network: this server allows none (IGN_MCP_NET=off).";
  _cleanup_free_ char *run_desc = xasprintf(
      "Run a shell command in a session's sandbox as `/bin/sh -c COMMAND` and return its stdout, "
      "stderr and exit code. Every run starts a fresh shell in /root (or cwd): `cd` and `export` "
      "do not carry over to the next run, but files do. Background processes (`server &`) keep "
      "running after the call returns. Output beyond %zu bytes per stream is cut (the *_bytes "
      "fields give the full size); the complete output is kept on the host at stdout_log_path "
      "and stderr_log_path. The command "
      "is killed after timeout_s seconds (default 30, at most 3600).%s",
      output_cap, net_text);
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

  _cleanup_free_ char *open_desc = xasprintf(
      "Open a new sandbox session: a private machine (a microVM, or a namespace sandbox where "
      "no VM can run) cloned from a clean image, or from a stage saved with commit. Returns "
      "its session_id, which every other tool needs, and how it is isolated. Open one per "
      "task and reuse it; close it when done.%s",
      reach ? " It has no network unless asked: network \"allow\" with allow_hosts (e.g. "
              "[\"pypi.org\", \"files.pythonhosted.org\"]) lets it reach those hosts only; "
              "every attempt is recorded (network_log)."
            : " It has no network (IGN_MCP_NET=off on this server).");
  json_t *open_props = network_props(net);
  json_object_set_new(open_props, "stage", parse(stage_name_schema));
  json_array_append_new(
      tools, tool("open_session", "Open a sandbox session", open_desc,
                  input(open_props, (const char *[]){NULL}), open_session_out, false, false,
                  false, false));
  json_array_append_new(
      tools,
      tool("run", "Run a command", run_desc,
           input(json_pack("{s:o, s:{s:s, s:s}, s:{s:s, s:i, s:i, s:i, s:s}, s:{s:s, s:s}, "
                           "s:{s:s, s:s}, s:{s:s, s:s}, s:{s:s, s:{s:s}, s:s}}",
                           "session_id", parse(session_id_schema), "command", "type", "string",
                           "description", "Shell command, run with /bin/sh -c.", "timeout_s",
                           "type", "integer", "minimum", 1, "maximum", 3600, "default", 30,
                           "description", "Seconds before the command's process group is killed.",
                           "cwd", "type", "string", "description",
                           "Working directory (default /root).", "stdin", "type", "string",
                           "description", "Text fed to the command's standard input.",
                           "stdin_file", "type", "string", "description", STDIN_FILE_DESC, "env",
                           "type", "object", "additionalProperties", "type", "string",
                           "description", "Extra environment variables, NAME: value."),
                 (const char *[]){"session_id", "command", NULL}),
           run_out, false, true, false, reach));
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
           "under the same session_id: the clean base, or stage `stage` (roll back to a state "
           "saved with commit). Use it when the environment is broken.",
           input(json_pack("{s:o, s:o}", "session_id", parse(session_id_schema), "stage",
                           parse(stage_name_schema)),
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
      tool("hibernate", "Hibernate a session",
           "Save a session you will come back to and free what it holds while it waits: its "
           "sandbox stops and it costs disk only. It keeps its id; the next call that names it "
           "(run, read_file, ...) resumes it, and that call's result has resumed_ms. On a "
           "microVM it carries memory: running processes go on after resume; on a namespace "
           "sandbox it carries files only. Idle sessions are hibernated by the server, not "
           "closed. list_sessions shows hibernated ones; close removes one without resuming it.",
           input(json_pack("{s:o}", "session_id", parse(session_id_schema)),
                 (const char *[]){"session_id", NULL}),
           hibernate_out, false, false, true, false));
  json_array_append_new(
      tools,
      tool("list_sessions", "List sessions",
           "List the open sessions of this client (its token, over HTTP) with their isolation, "
           "age and idle time, and the session cap (shared by every client of the server).",
           input(json_object(), (const char *[]){NULL}), list_out, true, false, true, false));
  json_array_append_new(
      tools,
      tool("commit", "Save a session as a stage",
           "Save a session as it is now as stage `name` (e.g. myproject/data-deps); the session "
           "keeps running. Set an environment up once (install packages, build), commit it, then "
           "open_session(stage) or fork instead of repeating the setup. On a microVM the stage "
           "carries memory: running processes continue in sessions started from it; on a "
           "namespace sandbox it carries files only. A name that exists is replaced only with "
           "replace: true. A stage is a copy of the sandbox: it holds whatever was typed into it.",
           input(json_pack("{s:o, s:o, s:{s:s, s:b, s:s}}", "session_id",
                           parse(session_id_schema), "name", parse(stage_name_schema), "replace",
                           "type", "boolean", "default", 0, "description",
                           "Replace a stage of that name."),
                 (const char *[]){"session_id", "name", NULL}),
           commit_out, false, false, false, false));
  json_array_append_new(
      tools,
      tool("fork", "Fork a session",
           "Make `count` (1-8) new sessions, each an independent copy of a session as it is now "
           "(the source keeps running). Use it to try several approaches from one prepared "
           "state: one fork per attempt, then close the ones you do not keep.",
           input(json_pack("{s:o, s:{s:s, s:i, s:i, s:i}}", "session_id",
                           parse(session_id_schema), "count", "type", "integer", "minimum", 1,
                           "maximum", 8, "default", 1),
                 (const char *[]){"session_id", NULL}),
           fork_out, false, false, false, false));
  json_array_append_new(
      tools,
      tool("stage_list", "List stages",
           "List the stages this client (its token, over HTTP) saved with commit, with their "
           "size and the space all stages may use.",
           input(json_object(), (const char *[]){NULL}), stage_list_out, true, false, true,
           false));
  json_array_append_new(
      tools,
      tool("stage_info", "Describe a stage",
           "Describe stage `name`: its id, parent, what it carries, size, age and how many "
           "sessions run from it.",
           input(json_pack("{s:o}", "name", parse(stage_name_schema)),
                 (const char *[]){"name", NULL}),
           stage_info_out, true, false, true, false));
  json_array_append_new(
      tools,
      tool("stage_rm", "Remove a stage",
           "Remove stage `name`. Sessions running from it keep working; its files are freed when "
           "the last of them closes.",
           input(json_pack("{s:o}", "name", parse(stage_name_schema)),
                 (const char *[]){"name", NULL}),
           stage_rm_out, false, true, true, false));

  _cleanup_free_ char *copied_obj = xasprintf(copy_out_schema_fmt, copied_props);
  _cleanup_free_ char *sbrun_props = xasprintf(sandbox_run_props, copied_props);
  json_t *sbrun_out = parse(run_out);
  json_t *extra = parse(sbrun_props);
  json_object_update(json_object_get(sbrun_out, "properties"), extra);
  json_decref(extra);
  json_t *req = json_object_get(sbrun_out, "required");
  for (const char *const *r = (const char *[]){"total_ms", "path", "open_ms", "teardown_ms",
                                               "isolation", "vcpus", "mem_mib", NULL};
       *r; r++)
    json_array_append_new(req, json_string(*r));
  _cleanup_free_ char *sbrun_out_text = json_dumps(sbrun_out, JSON_COMPACT);
  json_decref(sbrun_out);
  _cleanup_free_ char *copy_in_arr = xasprintf(
      copy_pair_fmt, "Files or directory trees copied from the host into the sandbox before the "
                     "command runs: each guest path becomes a copy of its host path.");
  _cleanup_free_ char *copy_out_arr = xasprintf(
      copy_pair_fmt, "Files or directory trees copied from the sandbox to the host after the "
                     "command ends (whatever its exit code; not after a timeout): each host path "
                     "becomes a copy of its guest path, replaced whole only once complete.");
  _cleanup_free_ char *sbrun_desc = xasprintf(
      "Run one shell command in a fresh sandbox that exists only for this call, and return its "
      "output: the sandbox is made (from a ready pool when there is one, or from stage `stage`), "
      "copy_in puts host files or trees in, the command runs as `/bin/sh -c COMMAND` in /root "
      "(or cwd), copy_out brings files or trees back to the host, commit_as saves the sandbox as "
      "a stage when the command exited 0, and the sandbox is destroyed before the result returns: "
      "nothing else survives. Prefer it to open_session for one-off commands (run a snippet, "
      "build and test a project copied in); use a session when later commands need what earlier "
      "ones left (files, processes). timeout_s (default 30, at most 3600) covers the whole call, "
      "start included. Output beyond %zu bytes per stream is cut; the complete output is kept "
      "on the host at stdout_log_path and stderr_log_path.%s",
      output_cap,
      reach ? " The sandbox has no network device: its connections go out only through the "
              "server, as this call's network and allow_hosts allow (none by default), and "
              "every attempt is recorded (the result's egress field)."
            : " The sandbox has no network: this server allows none (IGN_MCP_NET=off).");
  json_t *sbrun_in = json_pack(
      "{s:{s:s, s:s}, s:o, s:o, s:{s:s, s:s}, s:{s:s, s:s}, s:o, s:o, s:{s:s, s:{s:s}, s:s}, "
      "s:{s:s, s:s}, s:{s:s, s:i, s:i, s:i, s:s}}",
      "command", "type", "string", "description", "Shell command, run with /bin/sh -c.", "stage",
      parse(stage_name_schema), "commit_as", parse(stage_name_schema), "stdin", "type", "string",
      "description", "Text fed to the command's standard input.", "stdin_file", "type", "string",
      "description", STDIN_FILE_DESC, "copy_in", parse(copy_in_arr), "copy_out",
      parse(copy_out_arr), "env", "type", "object", "additionalProperties", "type", "string",
      "description", "Extra environment variables, NAME: value.", "cwd", "type", "string",
      "description", "Working directory (default /root).", "timeout_s", "type", "integer",
      "minimum", 1, "maximum", 3600, "default", 30, "description",
      "Seconds for the whole call, start included.");
  json_object_update_new(sbrun_in, network_props(net));
  json_array_append_new(
      tools,
      tool("sandbox_run", "Run a command in a one-shot sandbox", sbrun_desc,
           input(sbrun_in, (const char *[]){"command", NULL}),
           sbrun_out_text, false, true, false, reach));
  json_array_append_new(
      tools,
      tool("copy_in", "Copy files from the host into a session",
           "Copy a file or a whole directory tree from the host into a session's sandbox, in one "
           "call however many files: guest_path becomes a copy of host_path (replaced whole if "
           "it exists; missing parent directories are made). host_path is relative to the "
           "host-I/O root (IGN_MCP_HOST_IO_ROOT, by default the directory the server was started "
           "in) or absolute inside it; symlinks that would lead out of it are refused. Modes and "
           "symlinks inside the tree are kept; device nodes, FIFOs, sockets, setuid bits and "
           "links pointing outside the tree are left out and listed in the result. Use it to put "
           "the project you work on into a sandbox to build and test it.",
           input(json_pack("{s:o, s:{s:s, s:s}, s:{s:s, s:s}}", "session_id",
                           parse(session_id_schema), "host_path", "type", "string",
                           "description", "File or directory on the host.", "guest_path", "type",
                           "string", "description",
                           "Destination in the sandbox; relative paths are under /root."),
                 (const char *[]){"session_id", "host_path", "guest_path", NULL}),
           copied_obj, false, true, true, false));
  json_array_append_new(
      tools,
      tool("copy_out", "Copy files from a session to the host",
           "Copy a file or a whole directory tree from a session's sandbox to the host: "
           "host_path becomes a copy of guest_path, replaced only once the copy is complete (a "
           "failed copy leaves it as it was). host_path must be inside the host-I/O root "
           "(IGN_MCP_HOST_IO_ROOT) and its parent directory must exist; a symlink there is "
           "refused, never followed. Modes are masked (no setuid, setgid, sticky, group/other "
           "write); device nodes, FIFOs, sockets and links pointing outside the tree are left "
           "out and listed. Refused when the server runs with IGN_MCP_COPY_OUT=off.",
           input(json_pack("{s:o, s:{s:s, s:s}, s:{s:s, s:s}}", "session_id",
                           parse(session_id_schema), "guest_path", "type", "string",
                           "description",
                           "File or directory in the sandbox; relative paths are under /root.",
                           "host_path", "type", "string", "description",
                           "Destination on the host."),
                 (const char *[]){"session_id", "guest_path", "host_path", NULL}),
           copied_obj, false, true, true, false));
  json_array_append_new(
      tools,
      tool("network_log", "Show what a session tried to reach",
           "Everything a session's sandbox tried to reach over the network since it opened: "
           "connections made (host, address, port, bytes each way), connections and DNS lookups "
           "refused with the reason, the DNS queries, and egress_log_path, the complete record "
           "as JSON Lines on the host (each list here holds the latest 64). Each run's result "
           "carries the same for that command alone.",
           input(json_pack("{s:o}", "session_id", parse(session_id_schema)),
                 (const char *[]){"session_id", NULL}),
           EGRESS_REPORT_SCHEMA, true, false, true, false));
  json_t *update_props = network_props(net);
  /* Absent: as it is (not "none"). */
  json_object_del(json_object_get(update_props, "network"), "default");
  json_object_set_new(json_object_get(update_props, "network"), "description",
                      json_string("The sandbox's network from now on: none, allow (the hosts in "
                                  "allow_hosts) or open (only when the server runs with "
                                  "IGN_MCP_NET=open). Absent: as it is, or allow when allow_hosts "
                                  "is given."));
  json_object_set_new(json_object_get(update_props, "secrets"), "description",
                      json_string("The secrets the session has from now on (names of "
                                  "IGN_MCP_SECRETS); a name it had keeps its placeholder. Absent: "
                                  "as it has them."));
  json_object_set_new(update_props, "session_id", parse(session_id_schema));
  json_array_append_new(
      tools,
      tool("network_update", "Change a session's network policy",
           "Replace a running session's network policy: network and allow_hosts as open_session "
           "takes them (allow_hosts alone means network \"allow\"; \"allow\" alone keeps the "
           "hosts it has). It holds from the sandbox's next connection and lookup on; open "
           "connections the new policy refuses are reset (connections_reset) and recorded. E.g. "
           "allow the package registry to install dependencies, then network \"none\" before "
           "running untrusted tests. Forks made later start with the new policy.",
           input(update_props, (const char *[]){"session_id", NULL}),
           "{\"type\":\"object\",\"properties\":{\"session_id\":{\"type\":\"string\"},"
           "\"mode\":{\"type\":\"string\"},"
           "\"allowed_rules\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}},"
           "\"previous\":{\"type\":\"object\",\"properties\":{\"mode\":{\"type\":\"string\"},"
           "\"allowed_rules\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}}}},"
           "\"connections_reset\":{\"type\":\"integer\",\"description\":\"Open connections "
           "the new policy refused.\"},"
           "\"egress_log_path\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]}},"
           "\"required\":[\"session_id\",\"mode\",\"allowed_rules\",\"previous\","
           "\"connections_reset\"]}",
           false, true, true, false));
  return tools;
}
