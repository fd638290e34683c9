/* log.h: server logging.  Every line goes to stderr; when the client has
 * asked for it (logging/setLevel), the same message is also sent as a
 * notifications/message.  stdout never carries log text. */
#pragma once

enum log_level {
  LOG_DEBUG = 0,
  LOG_INFO,
  LOG_NOTICE,
  LOG_WARNING,
  LOG_ERROR,
  LOG_CRITICAL,
  LOG_ALERT,
  LOG_EMERGENCY,
};

/* Parse an MCP log level name; -1 when unknown. */
int log_level_parse(const char *name);
const char *log_level_name(enum log_level l);
/* Minimum level written to stderr (IGN_MCP_LOG) and sent to the client. */
void log_set_stderr_level(enum log_level l);
void log_set_client_level(enum log_level l);
/* Called by the MCP layer to forward log lines as notifications. */
void log_set_client_sink(void (*sink)(enum log_level l, const char *msg));

__attribute__((format(printf, 2, 3))) void log_msg(enum log_level l, const char *fmt, ...);
/* The same on stderr whatever IGN_MCP_LOG says: for what a user or a script
 * must always see (the address a server listens on). */
__attribute__((format(printf, 2, 3))) void log_always(enum log_level l, const char *fmt, ...);
#define log_debug(...) log_msg(LOG_DEBUG, __VA_ARGS__)
#define log_info(...) log_msg(LOG_INFO, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_WARNING, __VA_ARGS__)
#define log_error(...) log_msg(LOG_ERROR, __VA_ARGS__)
