/* framing.c: see framing.h.  The id scan is a small state machine over the
 * bytes of one line: it follows strings (with escapes) and nesting only far
 * enough to tell the top-level keys apart, and keeps nothing but the id. */
#include "mcp/framing.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

enum {
  SC_START,    /* before the top-level '{' */
  SC_KEY_WAIT, /* before a top-level key */
  SC_KEY,      /* inside a top-level key */
  SC_COLON,    /* after a key */
  SC_VALUE,    /* before a top-level value */
  SC_ID_STR,   /* inside the id, a string */
  SC_ID_NUM,   /* inside the id, a number */
  SC_SKIP,     /* inside another value */
  SC_AFTER,    /* after a top-level value */
  SC_DONE,     /* the object ended, or this is not an object */
};

void id_scan_init(struct id_scan *sc) { *sc = (struct id_scan){.state = SC_START}; }

static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

static void id_put(struct id_scan *sc, char c) {
  if (sc->id_len < LINE_ID_MAX)
    sc->id[sc->id_len] = c;
  /* One past the cap marks it too long. */
  if (sc->id_len <= LINE_ID_MAX)
    sc->id_len++;
}

static void id_done(struct id_scan *sc) {
  sc->n_ids++;
  sc->id_ok = sc->id_len <= LINE_ID_MAX;
  sc->id[sc->id_ok ? sc->id_len : 0] = '\0';
}

static void key_put(struct id_scan *sc, char c) {
  if (sc->key_len < sizeof sc->key)
    sc->key[sc->key_len++] = c;
}

static void scan_char(struct id_scan *sc, char c) {
  switch (sc->state) {
  case SC_START:
    if (!is_ws(c))
      sc->state = c == '{' ? SC_KEY_WAIT : SC_DONE;
    return;
  case SC_KEY_WAIT:
    if (is_ws(c) || c == ',')
      return;
    if (c == '"') {
      sc->state = SC_KEY;
      sc->key_len = 0;
      sc->key_hex = 0;
      sc->esc = false;
    } else {
      sc->state = SC_DONE; /* '}' or not JSON */
    }
    return;
  case SC_KEY:
    if (sc->key_hex) {
      /* A \uXXXX escape: only one below 0x80 can spell a letter of "id";
       * anything else stands as a byte that matches none. */
      int v = c >= '0' && c <= '9'   ? c - '0'
              : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                     : -1;
      sc->key_cp = v < 0 ? 0xffff : (uint16_t)(sc->key_cp << 4 | v);
      if (--sc->key_hex == 0)
        key_put(sc, sc->key_cp < 0x80 ? (char)sc->key_cp : '\x80');
    } else if (sc->esc) {
      sc->esc = false;
      if (c == 'u') {
        sc->key_hex = 4;
        sc->key_cp = 0;
      } else {
        /* \" \\ \/ stand for themselves; \b \f \n \r \t for control
         * characters, none of which is in "id". */
        key_put(sc, c == '"' || c == '\\' || c == '/' ? c : '\x01');
      }
    } else if (c == '\\') {
      sc->esc = true;
    } else if (c == '"') {
      sc->state = SC_COLON;
    } else {
      key_put(sc, c);
    }
    return;
  case SC_COLON:
    if (is_ws(c))
      return;
    sc->is_id = c == ':' && sc->key_len == 2 && sc->key[0] == 'i' && sc->key[1] == 'd';
    sc->state = c == ':' ? SC_VALUE : SC_DONE;
    return;
  case SC_VALUE:
    if (is_ws(c))
      return;
    if (sc->is_id) {
      sc->id_len = 0;
      sc->esc = false;
      if (c == '"' || c == '-' || (c >= '0' && c <= '9')) {
        id_put(sc, c);
        sc->state = c == '"' ? SC_ID_STR : SC_ID_NUM;
        return;
      }
      /* null, an object...: an id, but not one to answer with. */
      sc->n_ids++;
      sc->id_ok = false;
    }
    sc->vdepth = 0;
    sc->in_str = sc->esc = false;
    sc->state = SC_SKIP;
    scan_char(sc, c);
    return;
  case SC_ID_STR:
    id_put(sc, c);
    if (sc->esc)
      sc->esc = false;
    else if (c == '\\')
      sc->esc = true;
    else if (c == '"') {
      id_done(sc);
      sc->state = SC_AFTER;
    }
    return;
  case SC_ID_NUM:
    if ((c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E') {
      id_put(sc, c);
      return;
    }
    id_done(sc);
    sc->state = SC_AFTER;
    scan_char(sc, c);
    return;
  case SC_SKIP:
    if (sc->in_str) {
      if (sc->esc) {
        sc->esc = false;
      } else if (c == '\\') {
        sc->esc = true;
      } else if (c == '"') {
        sc->in_str = false;
        if (sc->vdepth == 0)
          sc->state = SC_AFTER;
      }
    } else if (c == '"') {
      sc->in_str = true;
    } else if (c == '{' || c == '[') {
      sc->vdepth++;
    } else if (c == '}' || c == ']') {
      if (sc->vdepth == 0)
        sc->state = SC_DONE; /* the object closes right after a scalar */
      else if (--sc->vdepth == 0)
        sc->state = SC_AFTER;
    } else if (c == ',' && sc->vdepth == 0) {
      sc->state = SC_KEY_WAIT;
    }
    return;
  case SC_AFTER:
    if (!is_ws(c))
      sc->state = c == ',' ? SC_KEY_WAIT : SC_DONE;
    return;
  default:
    return;
  }
}

void id_scan_feed(struct id_scan *sc, const char *data, size_t n) {
  for (size_t i = 0; i < n && sc->state != SC_DONE; i++) {
    /* The bulk of a large line is the inside of a string: step over it. */
    if (sc->state == SC_SKIP && sc->in_str && !sc->esc) {
      while (i < n && data[i] != '"' && data[i] != '\\')
        i++;
      if (i == n)
        break;
    }
    scan_char(sc, data[i]);
  }
}

const char *id_scan_result(struct id_scan *sc) {
  return sc->n_ids == 1 && sc->id_ok ? sc->id : NULL;
}

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
      id_scan_feed(&lr->scan, data, chunk);
    } else if (lr->len + chunk > lr->max) {
      lr->skipping = true;
      lr->skipped = lr->len + chunk;
      id_scan_init(&lr->scan);
      id_scan_feed(&lr->scan, lr->buf, lr->len);
      id_scan_feed(&lr->scan, data, chunk);
      lr->len = 0;
      free(lr->buf);
      lr->buf = NULL;
      lr->cap = 0;
    } else if (append(lr, data, chunk) < 0) {
      return -ENOMEM;
    }
    if (!nl)
      break;
    if (lr->skipping) {
      s->oversize(s->ctx, lr->skipped, id_scan_result(&lr->scan));
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
  if (lr->skipping) {
    s->oversize(s->ctx, lr->skipped, id_scan_result(&lr->scan));
    lr->skipping = false;
    lr->skipped = 0;
  } else if (lr->len > 0 && append(lr, "", 0) == 0) {
    deliver(lr, s);
  }
}
