/* test_framing.c: newline framing with a size cap. */
#include "mcp/framing.h"
#include "test.h"

struct seen {
  char lines[8][64];
  int n_lines;
  int n_over;
  size_t over_len;
};

static void on_line(void *ctx, char *line, size_t len) {
  struct seen *s = ctx;
  if (s->n_lines < 8)
    snprintf(s->lines[s->n_lines], 64, "%.*s", (int)len, line);
  s->n_lines++;
}

static void on_over(void *ctx, size_t len) {
  struct seen *s = ctx;
  s->n_over++;
  s->over_len = len;
}

static void splits_lines_across_reads(void) {
  struct seen s = {0};
  struct line_sink sink = {on_line, on_over, &s};
  struct line_reader lr;
  line_reader_init(&lr, 100);
  CHECK_EQ_INT(line_reader_feed(&lr, "ab", 2, &sink), 0);
  CHECK_EQ_INT(line_reader_feed(&lr, "c\nde\r\n\nf", 8, &sink), 0);
  CHECK_EQ_INT(s.n_lines, 3);
  CHECK_STREQ(s.lines[0], "abc");
  CHECK_STREQ(s.lines[1], "de");
  CHECK_STREQ(s.lines[2], "");
  line_reader_finish(&lr, &sink);
  CHECK_EQ_INT(s.n_lines, 4);
  CHECK_STREQ(s.lines[3], "f");
  line_reader_free(&lr);
}

static void oversized_line_is_dropped_not_buffered(void) {
  struct seen s = {0};
  struct line_sink sink = {on_line, on_over, &s};
  struct line_reader lr;
  line_reader_init(&lr, 10);
  char big[64];
  memset(big, 'x', sizeof big);
  for (int i = 0; i < 100; i++)
    CHECK_EQ_INT(line_reader_feed(&lr, big, sizeof big, &sink), 0);
  CHECK(lr.cap <= 64); /* never grew past the cap */
  CHECK_EQ_INT(line_reader_feed(&lr, "\nok\n", 4, &sink), 0);
  CHECK_EQ_INT(s.n_over, 1);
  CHECK(s.over_len > 10);
  CHECK_EQ_INT(s.n_lines, 1);
  CHECK_STREQ(s.lines[0], "ok");
  /* Exactly at the cap is fine. */
  CHECK_EQ_INT(line_reader_feed(&lr, "0123456789\n", 11, &sink), 0);
  CHECK_EQ_INT(s.n_lines, 2);
  CHECK_EQ_INT(s.n_over, 1);
  line_reader_free(&lr);
}

TEST_MAIN(TEST(splits_lines_across_reads), TEST(oversized_line_is_dropped_not_buffered))
