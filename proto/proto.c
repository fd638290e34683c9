/* proto.c: frame and TLV codec for the host <-> agent protocol (see proto.h).
 * Pure code with no allocation beyond the frame builder, shared by the server
 * and the static agent, and fuzzed on its own. */
#include "proto/proto.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void proto_buf_free(struct proto_buf *b) {
  free(b->data);
  *b = (struct proto_buf){0};
}

static void buf_reserve(struct proto_buf *b, size_t extra) {
  if (b->failed)
    return;
  if (extra > PROTO_HEADER_SIZE + PROTO_MAX_PAYLOAD || b->len + extra > PROTO_HEADER_SIZE + PROTO_MAX_PAYLOAD + 64) {
    b->failed = true;
    return;
  }
  if (b->len + extra <= b->cap)
    return;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < b->len + extra)
    cap *= 2;
  uint8_t *d = realloc(b->data, cap);
  if (!d) {
    b->failed = true;
    return;
  }
  b->data = d;
  b->cap = cap;
}

void proto_frame_begin(struct proto_buf *b, enum proto_type type, uint32_t id) {
  b->len = 0;
  b->failed = false;
  buf_reserve(b, PROTO_HEADER_SIZE);
  if (b->failed)
    return;
  struct proto_header h = {.len = 0, .type = (uint8_t)type, .id = id};
  proto_header_encode(b->data, &h);
  b->len = PROTO_HEADER_SIZE;
}

void proto_put_raw(struct proto_buf *b, const void *v, size_t n) {
  buf_reserve(b, n);
  if (b->failed)
    return;
  if (n)
    memcpy(b->data + b->len, v, n);
  b->len += n;
}

void proto_put_bytes(struct proto_buf *b, uint16_t tag, const void *v, size_t n) {
  if (n > PROTO_MAX_PAYLOAD) {
    b->failed = true;
    return;
  }
  uint8_t hdr[6];
  hdr[0] = (uint8_t)tag;
  hdr[1] = (uint8_t)(tag >> 8);
  proto_put_le32(hdr + 2, (uint32_t)n);
  proto_put_raw(b, hdr, sizeof hdr);
  proto_put_raw(b, v, n);
}

void proto_put_str(struct proto_buf *b, uint16_t tag, const char *s) {
  proto_put_bytes(b, tag, s, strlen(s));
}

void proto_put_u32(struct proto_buf *b, uint16_t tag, uint32_t v) {
  uint8_t x[4];
  proto_put_le32(x, v);
  proto_put_bytes(b, tag, x, sizeof x);
}

void proto_put_u64(struct proto_buf *b, uint16_t tag, uint64_t v) {
  uint8_t x[8];
  proto_put_le64(x, v);
  proto_put_bytes(b, tag, x, sizeof x);
}

int proto_frame_finish(struct proto_buf *b) {
  if (b->failed)
    return b->len + 64 > PROTO_HEADER_SIZE + PROTO_MAX_PAYLOAD ? -EMSGSIZE : -ENOMEM;
  if (b->len < PROTO_HEADER_SIZE)
    return -EINVAL;
  size_t payload = b->len - PROTO_HEADER_SIZE;
  if (payload > PROTO_MAX_PAYLOAD)
    return -EMSGSIZE;
  proto_put_le32(b->data, (uint32_t)payload);
  return 0;
}

void proto_header_encode(uint8_t out[PROTO_HEADER_SIZE], const struct proto_header *h) {
  proto_put_le32(out, h->len);
  out[4] = h->type;
  out[5] = h->flags;
  out[6] = (uint8_t)h->rsvd;
  out[7] = (uint8_t)(h->rsvd >> 8);
  proto_put_le32(out + 8, h->id);
}

bool proto_type_known(uint8_t type) {
  switch (type) {
  case PROTO_HELLO: case PROTO_HELLO_OK: case PROTO_ERROR: case PROTO_PING: case PROTO_PONG:
  case PROTO_EXEC: case PROTO_STDIN: case PROTO_STDIN_END: case PROTO_STDOUT:
  case PROTO_STDERR: case PROTO_EXIT: case PROTO_KILL: case PROTO_WRITE: case PROTO_DATA:
  case PROTO_DATA_END: case PROTO_OK: case PROTO_READ: case PROTO_READ_END: case PROTO_SETUP:
  case PROTO_UNPACK: case PROTO_PACK: case PROTO_PACK_END: case PROTO_CREDIT:
  case PROTO_STREAM_OPEN: case PROTO_STREAM_ACCEPT: case PROTO_STREAM_DATA:
  case PROTO_STREAM_CREDIT: case PROTO_STREAM_SHUT: case PROTO_STREAM_RESET: case PROTO_LOOKUP:
  case PROTO_LOOKUP_END: case PROTO_EGRESS_STATS:
    return true;
  default:
    return false;
  }
}

int proto_header_decode(const uint8_t in[PROTO_HEADER_SIZE], struct proto_header *ret) {
  struct proto_header h = {
      .len = proto_le32(in),
      .type = in[4],
      .flags = in[5],
      .rsvd = (uint16_t)(in[6] | in[7] << 8),
      .id = proto_le32(in + 8),
  };
  if (h.len > PROTO_MAX_PAYLOAD || h.flags != 0 || h.rsvd != 0 || !proto_type_known(h.type))
    return -EPROTO;
  *ret = h;
  return 0;
}

void proto_tlv_init(struct proto_tlv_iter *it, const void *payload, size_t len) {
  it->p = payload;
  it->left = len;
}

int proto_tlv_next(struct proto_tlv_iter *it, uint16_t *ret_tag, const uint8_t **ret_val,
                   uint32_t *ret_len) {
  if (it->left == 0)
    return 0;
  if (it->left < 6)
    return -EPROTO;
  uint16_t tag = (uint16_t)(it->p[0] | it->p[1] << 8);
  uint32_t len = proto_le32(it->p + 2);
  if (len > it->left - 6)
    return -EPROTO;
  *ret_tag = tag;
  *ret_val = it->p + 6;
  *ret_len = len;
  it->p += 6 + (size_t)len;
  it->left -= 6 + (size_t)len;
  return 1;
}

int proto_val_u32(const uint8_t *v, uint32_t len, uint32_t *ret) {
  if (len != 4)
    return -EPROTO;
  *ret = proto_le32(v);
  return 0;
}

int proto_val_u64(const uint8_t *v, uint32_t len, uint64_t *ret) {
  if (len != 8)
    return -EPROTO;
  *ret = proto_le64(v);
  return 0;
}

int proto_find(const void *payload, size_t len, uint16_t tag, const uint8_t **ret_val,
               uint32_t *ret_len) {
  struct proto_tlv_iter it;
  proto_tlv_init(&it, payload, len);
  for (;;) {
    uint16_t t;
    const uint8_t *v;
    uint32_t n;
    int r = proto_tlv_next(&it, &t, &v, &n);
    if (r <= 0)
      return r;
    if (t == tag) {
      *ret_val = v;
      *ret_len = n;
      return 1;
    }
  }
}

int proto_write_all(int fd, const void *buf, size_t n) {
  const uint8_t *p = buf;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR)
        continue;
      return -errno;
    }
    if (w == 0)
      return -EPIPE;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

int proto_read_all(int fd, void *buf, size_t n) {
  uint8_t *p = buf;
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, p + got, n - got);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return -errno;
    }
    if (r == 0)
      return got == 0 ? -ENODATA : -ECONNRESET;
    got += (size_t)r;
  }
  return 0;
}

int proto_read_frame(int fd, struct proto_header *ret_h, uint8_t *payload) {
  uint8_t hdr[PROTO_HEADER_SIZE];
  int r = proto_read_all(fd, hdr, sizeof hdr);
  if (r < 0)
    return r;
  struct proto_header h;
  r = proto_header_decode(hdr, &h);
  if (r < 0)
    return r;
  if (h.len) {
    r = proto_read_all(fd, payload, h.len);
    if (r < 0)
      return r == -ENODATA ? -ECONNRESET : r;
  }
  *ret_h = h;
  return 0;
}

const char *proto_type_name(uint8_t type) {
  switch (type) {
  case PROTO_HELLO: return "HELLO";
  case PROTO_HELLO_OK: return "HELLO_OK";
  case PROTO_ERROR: return "ERROR";
  case PROTO_PING: return "PING";
  case PROTO_PONG: return "PONG";
  case PROTO_EXEC: return "EXEC";
  case PROTO_STDIN: return "STDIN";
  case PROTO_STDIN_END: return "STDIN_END";
  case PROTO_STDOUT: return "STDOUT";
  case PROTO_STDERR: return "STDERR";
  case PROTO_EXIT: return "EXIT";
  case PROTO_KILL: return "KILL";
  case PROTO_WRITE: return "WRITE";
  case PROTO_DATA: return "DATA";
  case PROTO_DATA_END: return "DATA_END";
  case PROTO_OK: return "OK";
  case PROTO_READ: return "READ";
  case PROTO_READ_END: return "READ_END";
  case PROTO_SETUP: return "SETUP";
  case PROTO_UNPACK: return "UNPACK";
  case PROTO_PACK: return "PACK";
  case PROTO_PACK_END: return "PACK_END";
  case PROTO_CREDIT: return "CREDIT";
  case PROTO_STREAM_OPEN: return "STREAM_OPEN";
  case PROTO_STREAM_ACCEPT: return "STREAM_ACCEPT";
  case PROTO_STREAM_DATA: return "STREAM_DATA";
  case PROTO_STREAM_CREDIT: return "STREAM_CREDIT";
  case PROTO_STREAM_SHUT: return "STREAM_SHUT";
  case PROTO_STREAM_RESET: return "STREAM_RESET";
  case PROTO_LOOKUP: return "LOOKUP";
  case PROTO_LOOKUP_END: return "LOOKUP_END";
  case PROTO_EGRESS_STATS: return "EGRESS_STATS";
  default: return "unknown";
  }
}
