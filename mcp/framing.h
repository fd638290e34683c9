/* framing.h: newline-delimited message framing with a size cap.  A line
 * longer than the cap is never buffered whole: once it passes the cap its
 * bytes are dropped up to the next newline and the caller is told once. */
#pragma once

#include <stdbool.h>
#include <stddef.h>

struct line_reader {
  char *buf;
  size_t len, cap;
  size_t max;            /* largest message accepted, in bytes */
  bool skipping;         /* inside an oversized line */
  size_t skipped;        /* its size so far */
};

struct line_sink {
  void (*line)(void *ctx, char *line, size_t len);  /* LINE is NUL-terminated */
  void (*oversize)(void *ctx, size_t len_so_far);
  void *ctx;
};

void line_reader_init(struct line_reader *lr, size_t max);
void line_reader_free(struct line_reader *lr);
/* Returns 0 or -ENOMEM. */
int line_reader_feed(struct line_reader *lr, const char *data, size_t n, const struct line_sink *s);
/* At EOF: a last line without a newline is still delivered. */
void line_reader_finish(struct line_reader *lr, const struct line_sink *s);
