/* framing.c: see framing.h. */
#include "mcp/framing.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

void line_reader_init(struct line_reader *lr, size_t max) {
  *lr = (struct line_reader){.max = max};
}

void line_reader_free(struct line_reader *lr) {
  free(lr->buf);
  *lr = (struct line_reader){0};
}

static int append(struct line_reader *lr, const char *d, size_t n) {
  if (lr->len + n + 1 > lr->cap) {
    size_t cap = lr->cap ? lr->cap : 4096;
    while (cap < lr->len + n + 1)
      cap *= 2;
    char *b = realloc(lr->buf, cap);
    if (!b)
      return -ENOMEM;
    lr->buf = b;
    lr->cap = cap;
  }
  memcpy(lr->buf + lr->len, d, n);
  lr->len += n;
  return 0;
}

static void deliver(struct line_reader *lr, const struct line_sink *s) {
  size_t n = lr->len;
  if (n && lr->buf[n - 1] == '\r')
    n--;
  lr->buf[n] = '\0';
  s->line(s->ctx, lr->buf, n);
  lr->len = 0;
  /* Do not keep a huge buffer around after one large message. */
  if (lr->cap > (1u << 20)) {
    free(lr->buf);
    lr->buf = NULL;
    lr->cap = 0;
  }
}

int line_reader_feed(struct line_reader *lr, const char *data, size_t n, const struct line_sink *s) {
  while (n > 0) {
    const char *nl = memchr(data, '\n', n);
    size_t chunk = nl ? (size_t)(nl - data) : n;
    if (lr->skipping) {
      lr->skipped += chunk;
    } else if (lr->len + chunk > lr->max) {
      lr->skipping = true;
      lr->skipped = lr->len + chunk;
      lr->len = 0;
      free(lr->buf);
      lr->buf = NULL;
      lr->cap = 0;
      s->oversize(s->ctx, lr->skipped);
    } else if (append(lr, data, chunk) < 0) {
      return -ENOMEM;
    }
    if (!nl)
      break;
    if (lr->skipping) {
      lr->skipping = false;
      lr->skipped = 0;
    } else {
      if (append(lr, "", 0) < 0)
        return -ENOMEM;
      deliver(lr, s);
    }
    data = nl + 1;
    n -= chunk + 1;
  }
  return 0;
}

void line_reader_finish(struct line_reader *lr, const struct line_sink *s) {
  if (!lr->skipping && lr->len > 0 && append(lr, "", 0) == 0)
    deliver(lr, s);
}
