/* envelope.c: the two protocol eras told apart (MCP 2026-07-28,
 * basic/versioning): a request whose params._meta carries an
 * io.modelcontextprotocol/ key is modern, anything else legacy; and a modern
 * request's envelope checked (its protocol version, client capabilities,
 * client info and log level), with the JSON-RPC error and a message that
 * says what to send instead.  docs/mcp-2026-07-28.md has the wire shapes. */
#include "mcp/server_int.h"

#include <stddef.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "mcp/server.h"

const char *const mcp_supported_versions[4] = {"2025-11-25", "2025-06-18", "2025-03-26",
                                               "2024-11-05"};

static const char *const envelope_keys[] = {META_VERSION, META_CAPS, META_CLIENT, META_LOG_LEVEL};

bool mcp_legacy_version(const char *v) {
  for (size_t i = 0; i < ARRAY_SIZE(mcp_supported_versions); i++)
    if (strcmp(v, mcp_supported_versions[i]) == 0)
      return true;
  return false;
}

bool mcp_request_is_modern(const char *method, json_t *params) {
  json_t *meta = json_object_get(params, "_meta");
  /* server/discover exists only in the modern era: with any _meta at all it
   * is a modern request (and a malformed one when the envelope is not
   * right); without, a legacy client asked for a method it does not have. */
  if (meta && strcmp(method, "server/discover") == 0)
    return true;
  if (!json_is_object(meta))
    return false;
  for (size_t i = 0; i < ARRAY_SIZE(envelope_keys); i++)
    if (json_object_get(meta, envelope_keys[i]))
      return true;
  return false;
}

static const char envelope_help[] =
    "a 2026-07-28 request carries params._meta {\"" META_VERSION "\": \"" MODERN_VERSION
    "\", \"" META_CAPS "\": {...}, \"" META_CLIENT "\": {\"name\": ..., \"version\": ...}}";

int mcp_check_envelope(json_t *meta, char **ret_msg, json_t **ret_data) {
  *ret_data = NULL;
  if (!json_is_object(meta)) {
    *ret_msg = xasprintf("params._meta must be an object: %s", envelope_help);
    return RPC_INVALID_PARAMS;
  }
  json_t *v = json_object_get(meta, META_VERSION);
  if (!v) {
    *ret_msg = xasprintf("params._meta has no %s: %s", META_VERSION, envelope_help);
    return RPC_INVALID_PARAMS;
  }
  if (!json_is_string(v) || has_nul(v)) {
    *ret_msg = xasprintf("params._meta %s must be a string such as \"%s\"", META_VERSION,
                         MODERN_VERSION);
    return RPC_INVALID_PARAMS;
  }
  if (strcmp(json_string_value(v), MODERN_VERSION) != 0) {
    const char *asked = json_string_value(v);
    bool legacy = false;
    for (size_t i = 0; i < ARRAY_SIZE(mcp_supported_versions); i++)
      legacy = legacy || strcmp(asked, mcp_supported_versions[i]) == 0;
    *ret_msg = xasprintf(
        "unsupported protocol version '%.64s'%s: this server speaks %s with the per-request "
        "_meta, and 2025-11-25, 2025-06-18, 2025-03-26 and 2024-11-05 after an initialize "
        "handshake",
        asked, legacy ? " in _meta (it is served only after initialize)" : "", MODERN_VERSION);
    /* supported: the versions a request may name in _meta (as
     * server/discover's supportedVersions). */
    *ret_data = json_pack("{s:[s], s:O}", "supported", MODERN_VERSION, "requested", v);
    return RPC_UNSUPPORTED_VERSION;
  }
  json_t *caps = json_object_get(meta, META_CAPS);
  if (!json_is_object(caps)) {
    *ret_msg = xasprintf("params._meta %s %s: send the capabilities this request may use, {} "
                         "for none",
                         META_CAPS, caps ? "must be an object" : "is missing");
    return RPC_INVALID_PARAMS;
  }
  json_t *who = json_object_get(meta, META_CLIENT);
  if (who && !(json_is_object(who) && json_is_string(json_object_get(who, "name")) &&
               json_is_string(json_object_get(who, "version")))) {
    *ret_msg = xasprintf("params._meta %s must be an object with string \"name\" and "
                         "\"version\"",
                         META_CLIENT);
    return RPC_INVALID_PARAMS;
  }
  json_t *level = json_object_get(meta, META_LOG_LEVEL);
  if (level && !(json_is_string(level) && !has_nul(level) &&
                 log_level_parse(json_string_value(level)) >= 0)) {
    *ret_msg = xasprintf("params._meta %s must be one of debug, info, notice, warning, error, "
                         "critical, alert, emergency",
                         META_LOG_LEVEL);
    return RPC_INVALID_PARAMS;
  }
  *ret_msg = NULL;
  return 0;
}
