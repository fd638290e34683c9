/* util.h: small helpers shared by the server and the agent: cleanup
 * attributes for memory and fds, monotonic time, and checked string
 * formatting.  Header-only so the static agent links nothing extra. */
#pragma once

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define UNUSED __attribute__((unused))

static inline void freep(void *p) { free(*(void **)p); }
/* Closes *FD and sets it to -1: a variable closed early by hand and closed
 * again by _cleanup_close_ at the end of its scope must not close the fd
 * number a second time (by then another thread may have it: a QEMU's
 * pidfd, say). */
static inline void closep(int *fd) {
  if (*fd >= 0) {
    int saved = errno;
    close(*fd);
    errno = saved;
    *fd = -1;
  }
}
static inline void fclosep(FILE **f) {
  if (*f)
    fclose(*f);
}

#define _cleanup_free_ __attribute__((cleanup(freep)))
#define _cleanup_close_ __attribute__((cleanup(closep)))
#define _cleanup_fclose_ __attribute__((cleanup(fclosep)))

/* Move ownership out of a cleanup variable. */
#define steal_ptr(p)            \
  ({                            \
    __typeof__(p) _tmp_ = (p);  \
    (p) = NULL;                 \
    _tmp_;                      \
  })
#define steal_fd(fd)    \
  ({                    \
    int _tmp_ = (fd);   \
    (fd) = -1;          \
    _tmp_;              \
  })

/* ASCII only, whatever the locale: for bytes from outside. */
static inline bool ascii_is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static inline char ascii_lower(char c) { return c >= 'A' && c <= 'Z' ? (char)(c - 'A' + 'a') : c; }

static inline uint64_t now_ns(clockid_t clk) {
  struct timespec ts;
  clock_gettime(clk, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
/* The time MS milliseconds from now on clock CLK, for timed waits. */
static inline struct timespec timespec_in(clockid_t clk, uint64_t ms) {
  struct timespec ts;
  clock_gettime(clk, &ts);
  ts.tv_sec += (time_t)(ms / 1000);
  ts.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  return ts;
}

static inline uint64_t mono_ms(void) { return now_ns(CLOCK_MONOTONIC) / 1000000ull; }
static inline uint64_t mono_us(void) { return now_ns(CLOCK_MONOTONIC) / 1000ull; }

/* asprintf that aborts on allocation failure: used only for short messages. */
__attribute__((format(printf, 1, 2))) static inline char *xasprintf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *s = NULL;
  int r = vasprintf(&s, fmt, ap);
  va_end(ap);
  if (r < 0)
    abort();
  return s;
}
