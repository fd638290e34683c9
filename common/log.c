/* log.c: see log.h.  A mutex keeps stderr lines whole across threads. */
#include "common/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static const char *const level_names[] = {"debug", "info", "notice", "warning",
                                          "error", "critical", "alert", "emergency"};
static _Atomic int stderr_level = LOG_INFO;
static _Atomic int client_level = LOG_EMERGENCY + 1; /* off until setLevel */
static void (*_Atomic client_sink)(enum log_level, const char *);
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;

int log_level_parse(const char *name) {
  for (size_t i = 0; i < sizeof level_names / sizeof level_names[0]; i++)
    if (strcmp(name, level_names[i]) == 0)
      return (int)i;
  return -1;
}

const char *log_level_name(enum log_level l) {
  return (unsigned)l < sizeof level_names / sizeof level_names[0] ? level_names[l] : "info";
}

void log_set_stderr_level(enum log_level l) { stderr_level = l; }
void log_set_client_level(enum log_level l) { client_level = l; }
void log_set_client_sink(void (*sink)(enum log_level, const char *)) { client_sink = sink; }

static void vlog(enum log_level l, bool always, const char *fmt, va_list ap) {
  bool to_stderr = always || (int)l >= stderr_level;
  bool to_client = (int)l >= client_level && client_sink;
  if (!to_stderr && !to_client)
    return;
  char buf[2048];
  vsnprintf(buf, sizeof buf, fmt, ap);
  if (to_stderr) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    pthread_mutex_lock(&log_lock);
    fprintf(stderr, "%02d:%02d:%02d.%03ld ignition-mcp %s: %s\n", tm.tm_hour, tm.tm_min,
            tm.tm_sec, ts.tv_nsec / 1000000, log_level_name(l), buf);
    pthread_mutex_unlock(&log_lock);
  }
  if (to_client)
    client_sink(l, buf);
}

void log_msg(enum log_level l, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vlog(l, false, fmt, ap);
  va_end(ap);
}

void log_always(enum log_level l, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vlog(l, true, fmt, ap);
  va_end(ap);
}
