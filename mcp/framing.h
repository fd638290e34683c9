/* framing.h: newline-delimited message framing with a size cap.  A line
 * longer than the cap is never buffered whole: once it passes the cap its
 * bytes are dropped up to the next newline, and the caller is told once, at
 * the end of the line, with the request id the line carried.
 *
 * The id is found while the line is dropped, by a streaming scan of the
 * top-level keys of the JSON object in bounded memory (clients such as the
 * official SDK write "id" last, after a large "params").  The scan keeps the
 * raw JSON text of the value of the one top-level "id" key when it is a
 * string of at most LINE_ID_MAX bytes (as written, quotes and escapes
 * included) or a number; anything else (no id, two ids, a longer string, an
 * object, a line that is not an object) gives no id, and the caller answers
 * with id null.  Keys are decoded as the JSON parser would ("i\u0064" is
 * "id"), so a second id spelt with escapes is seen as one. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define LINE_ID_MAX 128

struct id_scan {
  uint8_t state;
  uint32_t vdepth;       /* nesting inside a value being skipped */
  bool in_str, esc;
  char key[3];           /* the key being read, decoded, enough to tell "id" */
  uint8_t key_len;       /* up to 3: longer keys are not "id" */
  uint8_t key_hex;       /* hex digits of a \uXXXX escape still to come */
  uint16_t key_cp;       /* the escape's code point so far */
  bool is_id;            /* the value being read belongs to "id" */
  unsigned n_ids;        /* top-level "id" keys seen */
  bool id_ok;            /* the value of the last one is usable */
  char id[LINE_ID_MAX + 1];
  size_t id_len;
};

struct line_reader {
  char *buf;
  size_t len, cap;
  size_t max;            /* largest message accepted, in bytes */
  bool skipping;         /* inside an oversized line */
  size_t skipped;        /* its size so far */
  struct id_scan scan;   /* of the oversized line */
};

struct line_sink {
  void (*line)(void *ctx, char *line, size_t len);  /* LINE is NUL-terminated */
  /* At the end of an oversized line: its length, and the raw JSON text of
   * its top-level id (NUL-terminated), or NULL when none was found. */
  void (*oversize)(void *ctx, size_t len, const char *id_json);
  void *ctx;
};

void line_reader_init(struct line_reader *lr, size_t max);
void line_reader_free(struct line_reader *lr);
/* Returns 0 or -ENOMEM. */
int line_reader_feed(struct line_reader *lr, const char *data, size_t n, const struct line_sink *s);
/* At EOF: a last line without a newline is still delivered. */
void line_reader_finish(struct line_reader *lr, const struct line_sink *s);

/* The id scan on its own (for tests): reset, feed bytes, result (NULL: none). */
void id_scan_init(struct id_scan *sc);
void id_scan_feed(struct id_scan *sc, const char *data, size_t n);
const char *id_scan_result(struct id_scan *sc);
