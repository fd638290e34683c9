/* test_proto.c: the frame and TLV codec of the agent protocol. */
#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include "proto/proto.h"
#include "test.h"

static void frame_round_trip(void) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_EXEC, 42);
  proto_put_str(&b, TAG_COMMAND, "echo hi");
  proto_put_u32(&b, TAG_TIMEOUT_MS, 1234);
  proto_put_u64(&b, TAG_SIZE, 1ull << 40);
  CHECK_EQ_INT(proto_frame_finish(&b), 0);
  struct proto_header h;
  CHECK_EQ_INT(proto_header_decode(b.data, &h), 0);
  CHECK_EQ_INT(h.type, PROTO_EXEC);
  CHECK_EQ_INT(h.id, 42);
  CHECK_EQ_INT(h.len, b.len - PROTO_HEADER_SIZE);
  const uint8_t *v;
  uint32_t n, t;
  uint64_t big;
  const uint8_t *payload = b.data + PROTO_HEADER_SIZE;
  CHECK_EQ_INT(proto_find(payload, h.len, TAG_COMMAND, &v, &n), 1);
  CHECK_EQ_INT(n, 7);
  CHECK(memcmp(v, "echo hi", 7) == 0);
  CHECK_EQ_INT(proto_find(payload, h.len, TAG_TIMEOUT_MS, &v, &n), 1);
  CHECK_EQ_INT(proto_val_u32(v, n, &t), 0);
  CHECK_EQ_INT(t, 1234);
  CHECK_EQ_INT(proto_find(payload, h.len, TAG_SIZE, &v, &n), 1);
  CHECK_EQ_INT(proto_val_u64(v, n, &big), 0);
  CHECK(big == 1ull << 40);
  CHECK_EQ_INT(proto_val_u32(v, n, &t), -EPROTO); /* wrong width */
  CHECK_EQ_INT(proto_find(payload, h.len, TAG_CWD, &v, &n), 0);
  proto_buf_free(&b);
}

static void header_rejects_bad_input(void) {
  uint8_t hdr[PROTO_HEADER_SIZE];
  struct proto_header h = {.len = PROTO_MAX_PAYLOAD + 1, .type = PROTO_PING, .id = 1};
  struct proto_header out;
  proto_header_encode(hdr, &h);
  CHECK_EQ_INT(proto_header_decode(hdr, &out), -EPROTO);
  h.len = 0;
  h.type = 200;
  proto_header_encode(hdr, &h);
  CHECK_EQ_INT(proto_header_decode(hdr, &out), -EPROTO);
  h.type = PROTO_PING;
  h.flags = 1;
  proto_header_encode(hdr, &h);
  CHECK_EQ_INT(proto_header_decode(hdr, &out), -EPROTO);
  h.flags = 0;
  proto_header_encode(hdr, &h);
  CHECK_EQ_INT(proto_header_decode(hdr, &out), 0);
}

static void tlv_bounds(void) {
  /* A record claiming more bytes than the payload holds. */
  uint8_t p[10] = {TAG_PATH, 0, 100, 0, 0, 0, 'a', 'b', 'c', 'd'};
  struct proto_tlv_iter it;
  uint16_t tag;
  const uint8_t *v;
  uint32_t n;
  proto_tlv_init(&it, p, sizeof p);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), -EPROTO);
  /* A truncated record header. */
  proto_tlv_init(&it, p, 3);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), -EPROTO);
  /* Length 0xffffffff must not wrap. */
  uint8_t q[6] = {1, 0, 0xff, 0xff, 0xff, 0xff};
  proto_tlv_init(&it, q, sizeof q);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), -EPROTO);
  proto_tlv_init(&it, p, 0);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), 0);
  /* The exact edge: a value that fills the rest of the payload (len ==
   * left - 6) is taken whole; one byte more (left - 5) is refused. */
  uint8_t e[6 + 4] = {TAG_PATH, 0, 4, 0, 0, 0, 'w', 'x', 'y', 'z'};
  proto_tlv_init(&it, e, sizeof e);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), 1);
  CHECK_EQ_INT(tag, TAG_PATH);
  CHECK_EQ_INT(n, 4);
  CHECK(v == e + 6 && memcmp(v, "wxyz", 4) == 0);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), 0);
  e[2] = 5;
  proto_tlv_init(&it, e, sizeof e);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), -EPROTO);
  /* The same edge for a second record after a first one. */
  uint8_t f[6 + 1 + 6 + 2] = {1, 0, 1, 0, 0, 0, 'a', 2, 0, 2, 0, 0, 0, 'b', 'c'};
  proto_tlv_init(&it, f, sizeof f);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), 1);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), 1);
  CHECK_EQ_INT(n, 2);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), 0);
  f[9] = 3;
  proto_tlv_init(&it, f, sizeof f);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), 1);
  CHECK_EQ_INT(proto_tlv_next(&it, &tag, &v, &n), -EPROTO);
}

static void oversize_payload_refused(void) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_DATA, 1);
  static uint8_t big[PROTO_MAX_PAYLOAD + 1];
  proto_put_raw(&b, big, sizeof big);
  CHECK(proto_frame_finish(&b) < 0);
  proto_buf_free(&b);
}

static void read_frame_over_socket(void) {
  int sv[2];
  CHECK_EQ_INT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_STDOUT, 9);
  proto_put_raw(&b, "hello", 5);
  CHECK_EQ_INT(proto_frame_finish(&b), 0);
  CHECK_EQ_INT(proto_write_all(sv[0], b.data, b.len), 0);
  static uint8_t payload[PROTO_MAX_PAYLOAD];
  struct proto_header h;
  CHECK_EQ_INT(proto_read_frame(sv[1], &h, payload), 0);
  CHECK_EQ_INT(h.len, 5);
  CHECK(memcmp(payload, "hello", 5) == 0);
  /* A frame cut short by EOF is an error, a clean EOF is -ENODATA. */
  CHECK_EQ_INT(proto_write_all(sv[0], b.data, 8), 0);
  close(sv[0]);
  CHECK_EQ_INT(proto_read_frame(sv[1], &h, payload), -ECONNRESET);
  CHECK_EQ_INT(proto_read_frame(sv[1], &h, payload), -ENODATA);
  close(sv[1]);
  proto_buf_free(&b);
}

TEST_MAIN(TEST(frame_round_trip), TEST(header_rejects_bad_input), TEST(tlv_bounds),
          TEST(oversize_payload_refused), TEST(read_frame_over_socket))
