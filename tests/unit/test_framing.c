/* test_framing.c: newline framing with a size cap, and the id scan of an
 * oversized line. */
#include "mcp/framing.h"
#include "test.h"

struct seen {
  char lines[8][64];
  int n_lines;
  int n_over;
  size_t over_len;
  char over_id[LINE_ID_MAX + 1];
  bool over_has_id;
};

static void on_line(void *ctx, char *line, size_t len) {
  struct seen *s = ctx;
  if (s->n_lines < 8)
    snprintf(s->lines[s->n_lines], 64, "%.*s", (int)len, line);
  s->n_lines++;
}

static void on_over(void *ctx, size_t len, const char *id) {
  struct seen *s = ctx;
  s->n_over++;
  s->over_len = len;
  s->over_has_id = id != NULL;
  snprintf(s->over_id, sizeof s->over_id, "%s", id ? id : "");
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

/* Feeds LINE (then a newline) in pieces of STEP bytes to a reader capped at
 * 16 bytes, and returns the id the oversize callback got ("" when none;
 * "!" when the callback did not run). */
static const char *oversize_id(const char *line, size_t step) {
  static struct seen s;
  s = (struct seen){0};
  struct line_sink sink = {on_line, on_over, &s};
  struct line_reader lr;
  line_reader_init(&lr, 16);
  size_t n = strlen(line);
  for (size_t off = 0; off < n; off += step)
    line_reader_feed(&lr, line + off, n - off < step ? n - off : step, &sink);
  line_reader_feed(&lr, "\n", 1, &sink);
  line_reader_free(&lr);
  if (s.n_over != 1 || s.n_lines != 0)
    return "!";
  if (s.over_len != n)
    return "!len";
  return s.over_has_id ? s.over_id : "";
}

static void oversized_line_answers_with_its_id(void) {
  const char *pad = "{\"jsonrpc\":\"2.0\",\"method\":\"tools/call\",\"params\":{\"id\":9,"
                    "\"a\":[1,{\"id\":8}],\"s\":\"x\\\"\\\\\\\",\\\"id\\\":7}\" ,\"t\":true},";
  char line[1024];
  static const size_t steps[] = {1, 3, 7, 1000};
  for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
    size_t st = steps[i];
    /* The id last, as the official SDK writes it; nested ids and ids inside
     * strings are not it. */
    snprintf(line, sizeof line, "%s\"id\":77}", pad);
    CHECK_STREQ(oversize_id(line, st), "77");
    snprintf(line, sizeof line, "%s \"id\" : -1.5e3 }", pad);
    CHECK_STREQ(oversize_id(line, st), "-1.5e3");
    snprintf(line, sizeof line, "%s\"id\":\"req-\\\"q\\\"\"}", pad);
    CHECK_STREQ(oversize_id(line, st), "\"req-\\\"q\\\"\"");
    /* First is fine too. */
    snprintf(line, sizeof line, "{\"id\":\"first\",%s", pad + 1);
    CHECK_STREQ(oversize_id(line, st), "\"first\"");
    /* No usable id: none, twice, null, an object, too long, not an
     * object, cut off inside the id. */
    CHECK_STREQ(oversize_id(pad, st), "");
    snprintf(line, sizeof line, "{\"id\":1,%s\"id\":2}", pad + 1);
    CHECK_STREQ(oversize_id(line, st), "");
    snprintf(line, sizeof line, "%s\"id\":null}", pad);
    CHECK_STREQ(oversize_id(line, st), "");
    snprintf(line, sizeof line, "%s\"id\":{\"a\":1}}", pad);
    CHECK_STREQ(oversize_id(line, st), "");
    char longid[LINE_ID_MAX + 8];
    memset(longid, 'k', sizeof longid - 1);
    longid[sizeof longid - 1] = '\0';
    snprintf(line, sizeof line, "%s\"id\":\"%s\"}", pad, longid);
    CHECK_STREQ(oversize_id(line, st), "");
    /* A key spelt with escapes is the key it spells, as for the JSON
     * parser: "i\u0064" is a second "id" (which the parser would take). */
    snprintf(line, sizeof line, "{\"id\":7,%s\"i\\u0064\":5}", pad + 1);
    CHECK_STREQ(oversize_id(line, st), "");
    snprintf(line, sizeof line, "{\"\\u0069\\u0064\":7,%s\"i\\\"\":5}", pad + 1);
    CHECK_STREQ(oversize_id(line, st), "7");
    snprintf(line, sizeof line, "[%s\"id\":5}]", pad);
    CHECK_STREQ(oversize_id(line, st), "");
    snprintf(line, sizeof line, "%s\"id\":\"cut", pad);
    CHECK_STREQ(oversize_id(line, st), "");
  }
  /* At the cap's edge: the longest string id kept, one more byte refused. */
  char id[LINE_ID_MAX + 1];
  memset(id, 'v', sizeof id);
  id[0] = '"';
  id[LINE_ID_MAX - 1] = '"';
  id[LINE_ID_MAX] = '\0';
  snprintf(line, sizeof line, "%s\"id\":%s}", pad, id);
  CHECK_STREQ(oversize_id(line, 5), id);
}

TEST_MAIN(TEST(splits_lines_across_reads), TEST(oversized_line_is_dropped_not_buffered),
          TEST(oversized_line_answers_with_its_id))
