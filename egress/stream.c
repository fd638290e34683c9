/* stream.c: one TCP connection from a sandbox, decided and relayed
 * (docs/egress-design.md (c), (d)).  On the broker thread only.
 *
 * A stream goes PEEK -> RESOLVE -> CONNECT -> RELAY, or is reset with the
 * reason of the first step that refuses it, in the order of (d): mode, the
 * session's caps, the destination (a synthetic address maps back to its
 * name; another address is a raw IP connect), allow_hosts, the peek (TLS
 * SNI or HTTP Host from the first bytes, before anything is connected, so a
 * name that is not the connection's never reaches anything), the addresses
 * the host resolves the name to now (never what the sandbox saw, never the
 * DNS cache), and the connect.  What the first bytes say is peek.c's verdict.
 *
 * Ports 80 and 443 are web ports whatever the rule says ("good.test:443",
 * "good.test:*"): the first bytes must be TLS or HTTP naming the host, and
 * nothing is connected before they came.  On another port a program may
 * wait for the server to speak first (SSH, SMTP): after
 * EGRESS_FIRST_BYTE_MS without a byte the broker connects, but still holds
 * the program's first bytes until they pass the same check (peek_pending):
 * a ClientHello or an HTTP request naming another host is reset as it is
 * on a web port (and an HTTP request naming none, which a front end serves
 * from its default site, and what could start a request but does not
 * parse, see egress_http_host); bytes that are neither go up.  Once the upstream spoke
 * before the program's first byte (an SMTP greeting) the program's bytes
 * are not read as HTTP: an HTTP server only answers.  After a ClientHello
 * passed, the program's next bytes wait for the server's first handshake
 * message: after a TLS 1.3 HelloRetryRequest the second ClientHello must
 * name the host too (a front end may pick its site by it).
 *
 * Flow control: the agent may send what it was granted (first
 * EGRESS_PEEK_MAX, enough for the peek; once connected up to STREAM_WINDOW
 * outstanding): granted + buffered <= STREAM_WINDOW always, and credit goes
 * back as the upstream socket takes the bytes.  The other way the broker
 * reads one chunk from upstream at a time and stops reading while
 * agent_stream_send cannot take it (-EAGAIN) until writable() or credit()
 * says there is room: a sandbox that reads slowly slows its own download,
 * nothing else. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/config.h"
#include "common/util.h"
#include "egress/egress_int.h"
#include "egress/stream_int.h"

/* stage1's cap (egress_cfg.max_streams, IGN_MCP_EGRESS_STREAMS) may be as
 * high as what one agent connection carries (proto/client.h), no higher. */
_Static_assert(CONFIG_EGRESS_STREAMS_MAX == AGENT_MAX_STREAMS,
               "IGN_MCP_EGRESS_STREAMS may reach what one connection carries");

#define DOWN_CHUNK PROTO_CHUNK
#define PUMP_MAX 4 /* chunks read from one upstream socket per wake-up: fairness */

struct stream *stream_find(struct link *lk, uint32_t sid) {
  for (struct stream *s = lk->streams; s; s = s->next)
    if (s->sid == sid)
      return s;
  return NULL;
}

static void unlink_stream(struct stream *s) {
  for (struct stream **p = &s->lk->streams; *p; p = &(*p)->next)
    if (*p == s) {
      *p = s->next;
      return;
    }
}

void stream_kill(struct stream *s, int err, const char *reason, bool tell_agent) {
  struct egress *e = s->lk->e;
  broker_abandon(s->job);
  if (s->fd >= 0) {
    if (s->watching)
      broker_unwatch(s->fd);
    close(s->fd);
  }
  if (s->st == ST_RELAY) {
    if (reason && !*s->rec.reason)
      snprintf(s->rec.reason, sizeof s->rec.reason, "%s", reason);
    record_connect_end(e->rec, &s->rec);
  } else {
    e->connecting--;
    s->rec.allowed = false;
    snprintf(s->rec.reason, sizeof s->rec.reason, "%s", reason ? reason : "closed before a decision");
    record_connect(e->rec, &s->rec);
  }
  /* Recorded before the reset goes out: whoever sees the reset finds it
   * in the record. */
  if (tell_agent && !s->lk->dead)
    agent_stream_reset(s->lk->c, s->sid, err, reason);
  e->open_streams--;
  unlink_stream(s);
  free(s->up);
  free(s->down);
  free(s);
}

static void refuse(struct stream *s, const char *reason) { stream_kill(s, ECONNREFUSED, reason, true); }

static size_t up_may_send(const struct stream *s);

static void set_watch(struct stream *s) {
  uint32_t want = 0;
  if (s->st == ST_CONNECT)
    want = EPOLLOUT;
  else if (s->st == ST_RELAY)
    want = (!s->up_eof && !s->down_len && !s->down_blocked ? EPOLLIN : 0) |
           (s->up_len && !s->peek_pending && up_may_send(s) ? EPOLLOUT : 0);
  if (want == s->watching)
    return;
  /* Out of the set when nothing is wanted: a socket shut both ways would
   * report EPOLLHUP over and over while the stream waits for the agent. */
  if (!want)
    broker_unwatch(s->fd);
  else if (!s->watching)
    broker_watch(s->fd, want, s);
  else
    broker_rewatch(s->fd, want, s);
  s->watching = want;
}

/* The stream is over both ways: it ends without a reset. */
static bool maybe_finish(struct stream *s) {
  if (s->st != ST_RELAY || !s->agent_shut || !s->up_shut || !s->up_eof || s->down_len ||
      !s->down_shut)
    return false;
  stream_kill(s, 0, NULL, false);
  return true;
}

/* ---- agent -> upstream ---- */

/* More credit for the agent when a quarter of the window is free again. */
static void grant(struct stream *s) {
  if (s->agent_shut || s->lk->dead)
    return;
  size_t room = STREAM_WINDOW - s->granted - s->up_len;
  if (room < STREAM_WINDOW / 4)
    return;
  if (agent_stream_credit(s->lk->c, s->sid, (uint32_t)room) == 0)
    s->granted += (uint32_t)room;
}

/* What of the agent's bytes may go upstream now. */
static size_t up_may_send(const struct stream *s) {
  if (!s->tls_hold)
    return s->up_len;
  uint64_t left = s->tls_pass > s->rec.bytes_up ? s->tls_pass - s->rec.bytes_up : 0;
  return left < s->up_len ? (size_t)left : s->up_len;
}

/* Writes what the agent sent upstream; false when S was ended. */
static bool flush_up(struct stream *s) {
  struct egress *e = s->lk->e;
  if (s->peek_pending)
    return true; /* held until the check passed; no more credit meanwhile */
  while (s->up_len && up_may_send(s)) {
    size_t can = up_may_send(s);
    ssize_t n = send(s->fd, s->up + s->up_off, can, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 && errno == EAGAIN)
      break;
    if (n <= 0) {
      stream_kill(s, ECONNRESET, NULL, true);
      return false;
    }
    s->up_off += (size_t)n;
    s->up_len -= (size_t)n;
    s->rec.bytes_up += (uint64_t)n;
    e->bytes_up += (uint64_t)n;
    s->last_ms = mono_ms();
  }
  if (!s->up_len)
    s->up_off = 0;
  if (s->agent_shut && !s->up_len && !s->up_shut) {
    shutdown(s->fd, SHUT_WR);
    s->up_shut = true;
  }
  grant(s);
  record_connect_update(e->rec, &s->rec);
  return true;
}

static void peek_check(struct stream *s);
static void go_connect(struct stream *s);

void stream_data(struct stream *s, const uint8_t *p, size_t n) {
  struct egress *e = s->lk->e;
  if (n > s->granted || s->up_len + n > STREAM_WINDOW) {
    stream_kill(s, EPROTO, "the sandbox sent beyond its window", true);
    return;
  }
  if (e->bytes_up + s->up_len + n > egress_cfg.max_bytes) {
    if (s->st == ST_RELAY)
      stream_kill(s, ECONNRESET, "byte cap reached", true);
    else
      refuse(s, "byte cap reached");
    return;
  }
  if (s->up_off + s->up_len + n > s->up_cap) {
    if (s->up_off) {
      memmove(s->up, s->up + s->up_off, s->up_len);
      s->up_off = 0;
    }
    if (s->up_len + n > s->up_cap) {
      size_t cap = s->st == ST_PEEK ? EGRESS_PEEK_MAX : STREAM_WINDOW;
      if (cap < s->up_len + n)
        cap = STREAM_WINDOW;
      uint8_t *b = realloc(s->up, cap);
      if (!b) {
        stream_kill(s, ENOMEM, "out of memory", true);
        return;
      }
      s->up = b;
      s->up_cap = cap;
    }
  }
  const char *leak = NULL;
  if (s->scan_tokens && !stream_scan_tokens(s, p, n, &leak)) {
    s->rec.allowed = s->st == ST_RELAY; /* a connection made and cut, or one never made */
    stream_kill(s, ECONNRESET, leak, true);
    return;
  }
  bool first = !s->up_len && !s->rec.bytes_up;
  memcpy(s->up + s->up_off + s->up_len, p, n);
  s->up_len += n;
  s->granted -= (uint32_t)n;
  s->last_ms = mono_ms();
  if (s->st == ST_PEEK) {
    if (first && !s->web) /* a first byte came: the peek may take its time */
      s->deadline = s->last_ms + EGRESS_PEEK_MS;
    peek_check(s);
  } else if (s->peek_pending) {
    if (first)
      s->peek_deadline = s->last_ms + EGRESS_PEEK_MS;
    peek_check(s);
  } else if (s->st == ST_RELAY) {
    if (s->tls_hold && s->tls_hrr && !stream_tls_second_hello(s))
      return;
    if (flush_up(s))
      set_watch(s);
  }
}

/* ---- the peek ---- */

/* A stream connecting or connected before its first bytes were checked
 * is refused: nothing of the program's went up, so it is a denied event. */
static void late_refuse(struct stream *s, const char *why) {
  s->rec.allowed = false;
  stream_kill(s, ECONNREFUSED, why, true);
}

/* Decides once the first bytes say enough: refuses, connects (or lets the
 * held bytes go up), or waits. */
static void peek_check(struct stream *s) {
  const char *why = NULL;
  enum verdict v = stream_peek_verdict(s, &why);
  if (v == V_WAIT)
    return;
  if (s->st == ST_PEEK) {
    if (v == V_PASS)
      go_connect(s);
    else
      refuse(s, why);
    return;
  }
  if (v == V_REFUSE) {
    late_refuse(s, why);
    return;
  }
  s->peek_pending = false;
  s->peek_deadline = 0;
  if (s->st == ST_RELAY && flush_up(s) && !maybe_finish(s))
    set_watch(s); /* else connected() sends them */
}

/* ---- connecting ---- */

static void connected(struct stream *s) {
  struct egress *e = s->lk->e;
  s->st = ST_RELAY;
  e->connecting--;
  s->rec.allowed = true;
  s->last_ms = mono_ms();
  record_connect(e->rec, &s->rec);
  s->down = malloc(DOWN_CHUNK);
  if (!s->down) {
    stream_kill(s, ENOMEM, "out of memory", true);
    return;
  }
  if (!flush_up(s)) /* the peeked bytes first; then the whole window */
    return;
  set_watch(s);
}

static void connect_addr(struct stream *s, int family, const uint8_t *addr) {
  static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (family == AF_INET6 && memcmp(addr, mapped, 12) == 0) {
    family = AF_INET; /* ::ffff:a.b.c.d goes out as v4 */
    addr += 12;
  }
  inet_ntop(family, addr, s->rec.ip, sizeof s->rec.ip);
  /* Whatever admitted it: never a socket of the server's own (self.c). */
  const char *self = egress_self_refusal(family, addr, s->rec.port);
  if (self) {
    refuse(s, self);
    return;
  }
  char why[EGRESS_REASON_MAX];
  if (s->icpt) {
    /* A host of a secret: an interceptor connects it (intercept.c). */
    int r = intercept_start(s, family, addr, s->icpt == ICPT_TLS, &s->fd);
    if (r < 0) {
      if (r == -EAGAIN)
        snprintf(why, sizeof why, "too many intercepted connections");
      else
        snprintf(why, sizeof why, "cannot intercept: %s", strerror(-r));
      stream_kill(s, -r, why, true);
      return;
    }
    snprintf(s->rec.reason, sizeof s->rec.reason, "intercepted");
    connected(s);
    return;
  }
  struct sockaddr_storage ss = {0};
  socklen_t sl;
  if (family == AF_INET) {
    struct sockaddr_in *in = (struct sockaddr_in *)&ss;
    in->sin_family = AF_INET;
    in->sin_port = htons(s->rec.port);
    memcpy(&in->sin_addr, addr, 4);
    sl = sizeof *in;
  } else {
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&ss;
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(s->rec.port);
    memcpy(&in6->sin6_addr, addr, 16);
    sl = sizeof *in6;
  }
  s->fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP);
  if (s->fd < 0) {
    snprintf(why, sizeof why, "connect failed: %s", strerror(errno));
    stream_kill(s, EHOSTUNREACH, why, true);
    return;
  }
  if (connect(s->fd, (struct sockaddr *)&ss, sl) == 0) {
    connected(s);
    return;
  }
  if (errno != EINPROGRESS) {
    int err = errno;
    snprintf(why, sizeof why, "connect failed: %s", strerror(err));
    stream_kill(s, err, why, true);
    return;
  }
  s->st = ST_CONNECT;
  s->deadline = mono_ms() + EGRESS_CONNECT_MS;
  set_watch(s);
}

static void go_connect(struct stream *s) {
  s->st = ST_RESOLVE;
  if (s->raw) {
    connect_addr(s, s->family, s->addr);
    return;
  }
  /* -EBUSY: this session has EGRESS_RESOLVE_JOBS_MAX resolutions out. */
  if (broker_resolve(s->lk->e, s->rec.host, s, true, &s->job) < 0)
    stream_kill(s, EHOSTUNREACH, "resolver busy", true);
}

void stream_resolved(struct stream *s, struct resolve_job *j) {
  s->job = NULL;
  char why[EGRESS_REASON_MAX];
  if (j->gai_err) {
    snprintf(why, sizeof why, "connect failed: %s", gai_strerror(j->gai_err));
    stream_kill(s, EHOSTUNREACH, why, true);
    return;
  }
  const char *first = NULL;
  for (size_t i = 0; i < j->n; i++) {
    const char *refusal = egress_addr_refusal(j->family[i], j->addr[i]);
    if (!*refusal) {
      connect_addr(s, j->family[i], j->addr[i]);
      return;
    }
    if (!first) {
      first = refusal;
      inet_ntop(j->family[i], j->addr[i], s->rec.ip, sizeof s->rec.ip);
    }
  }
  refuse(s, first ? first : "connect failed: no address");
}

/* ---- upstream -> agent ---- */

/* Hands the chunk read to the agent; false when S was ended. */
static bool send_down(struct stream *s) {
  while (s->down_len) {
    /* Counted in the record before the bytes go: once the program has
     * them (and perhaps ended, and its run reported), the record does. */
    size_t want = s->down_len;
    s->rec.bytes_down += want;
    record_connect_update(s->lk->e->rec, &s->rec);
    ssize_t n = agent_stream_send(s->lk->c, s->sid, s->down + s->down_off, s->down_len);
    size_t sent = n > 0 ? (size_t)n : 0;
    if (sent != want) {
      s->rec.bytes_down -= want - sent;
      record_connect_update(s->lk->e->rec, &s->rec);
    }
    if (n == -EAGAIN || n == 0) {
      s->down_blocked = true;
      return true;
    }
    if (n <= 0) { /* the stream or the connection is gone */
      stream_kill(s, ECONNRESET, NULL, n != -ENOENT && n != -EPIPE);
      return false;
    }
    s->down_off += (size_t)n;
    s->down_len -= (size_t)n;
    s->lk->e->bytes_down += (uint64_t)n;
  }
  s->down_off = 0;
  s->down_blocked = false;
  return true;
}

/* Moves bytes from upstream to the agent until either side has to wait;
 * false when S was ended.  Every chunk read is offered at once, so a chunk
 * left over is always one agent_stream_send refused (down_blocked): credit
 * or writable() brings it back here. */
static bool pump_down(struct stream *s) {
  struct egress *e = s->lk->e;
  if (!send_down(s))
    return false;
  for (int i = 0; i < PUMP_MAX && !s->down_len && !s->up_eof; i++) {
    uint64_t left = egress_cfg.max_bytes > e->bytes_down ? egress_cfg.max_bytes - e->bytes_down : 0;
    if (!left) {
      stream_kill(s, ECONNRESET, "byte cap reached", true);
      return false;
    }
    ssize_t n = recv(s->fd, s->down, left < DOWN_CHUNK ? (size_t)left : DOWN_CHUNK, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
      break;
    if (n < 0) {
      stream_kill(s, errno == ECONNRESET ? ECONNRESET : EIO, NULL, true);
      return false;
    }
    s->last_ms = mono_ms();
    if (!n)
      s->up_eof = true;
    else if (s->peek_pending && !s->up_len)
      s->server_first = true;
    if (n > 0 && s->tls_hold && !s->tls_hrr && !stream_tls_server_hello(s, s->down, (size_t)n))
      return false;
    s->down_len = (size_t)n;
    if (!send_down(s))
      return false;
  }
  if (s->up_eof && !s->down_len && !s->down_shut && !s->lk->dead) {
    agent_stream_shut(s->lk->c, s->sid);
    s->down_shut = true;
  }
  return true;
}

void stream_io(struct stream *s, uint32_t events) {
  if (s->st == ST_CONNECT) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
      err = errno;
    if (err) {
      char why[EGRESS_REASON_MAX];
      snprintf(why, sizeof why, "connect failed: %s", strerror(err));
      stream_kill(s, err, why, true);
    } else {
      connected(s);
    }
    return;
  }
  if (s->st != ST_RELAY)
    return;
  if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) && !pump_down(s))
    return;
  if ((events & (EPOLLOUT | EPOLLERR)) && !flush_up(s))
    return;
  if (!maybe_finish(s))
    set_watch(s);
}

void stream_credit(struct stream *s) {
  if (s->st != ST_RELAY || !s->down_blocked)
    return;
  s->down_blocked = false;
  if (pump_down(s) && !maybe_finish(s))
    set_watch(s);
}

void link_writable(struct link *lk) {
  for (struct stream *s = lk->streams, *n; s; s = n) {
    n = s->next;
    stream_credit(s);
  }
}

void stream_agent_shut(struct stream *s) {
  s->agent_shut = true;
  if (s->st == ST_PEEK || s->peek_pending)
    peek_check(s);
  else if (s->st == ST_RELAY && flush_up(s) && !maybe_finish(s))
    set_watch(s);
}

void stream_agent_reset(struct stream *s, int err) {
  (void)err;
  stream_kill(s, 0, s->st == ST_RELAY ? NULL : "closed by the program before a decision", false);
}

/* ---- opening ---- */

/* What E's policy says of S, whose name (or raw address) is known, on
 * PORT: the refusal, or NULL and S's rule set to the one that admits it. */
static const char *policy_refusal(struct egress *e, struct stream *s, uint16_t port) {
  if (e->mode == EGRESS_MODE_NONE)
    return "network is none";
  if (s->raw)
    return e->mode == EGRESS_MODE_ALLOW ? "IP address not in allow_hosts" : NULL;
  if (e->mode == EGRESS_MODE_OPEN)
    return NULL;
  size_t len = strlen(s->rec.host);
  long i = egress_policy_match(&e->pol, s->rec.host, len, port);
  if (i < 0)
    return egress_policy_knows(&e->pol, s->rec.host, len) ? "port not in allow_hosts"
                                                          : "not in allow_hosts";
  egress_rule_format(&e->pol.rules[i], s->rec.rule, sizeof s->rec.rule);
  return NULL;
}

unsigned link_recheck_streams(struct link *lk, bool intercepted_too) {
  unsigned n = 0;
  for (struct stream *s = lk->streams, *next; s; s = next) {
    next = s->next;
    const char *why = policy_refusal(lk->e, s, s->rec.port);
    if (!why && intercepted_too && s->icpt)
      why = "the secrets or request rules of an intercepted connection changed";
    if (!why)
      continue;
    char reason[EGRESS_REASON_MAX];
    snprintf(reason, sizeof reason, "network_update: %s", why);
    stream_kill(s, ECONNRESET, reason, true);
    n++;
  }
  return n;
}

/* The refusal of steps 1-4 of (d) for a stream to O, or NULL; fills S's
 * name, rule and what the peek must see. */
static const char *stage1(struct egress *e, struct stream *s, const struct agent_stream_open *o) {
  if (egress_cfg.off)
    return "egress is off";
  if (e->mode == EGRESS_MODE_NONE)
    return "network is none";
  /* The counts include this stream already. */
  if (e->open_streams > egress_cfg.max_streams || e->connecting > EGRESS_CONNECTS_MAX)
    return "too many connections";
  if (e->bytes_up >= egress_cfg.max_bytes || e->bytes_down >= egress_cfg.max_bytes)
    return "byte cap reached";
  /* Web ports whatever a rule says: "good.test:443" must not make the
   * peek optional. */
  s->web = o->port == 80 || o->port == 443;
  if (names_is_synthetic(o->family, o->addr)) {
    const char *name = names_synthetic(e, o->family, o->addr);
    if (!name)
      return "unknown address";
    snprintf(s->rec.host, sizeof s->rec.host, "%s", name);
    /* A host whose requests are checked is always read before a connect,
     * whatever its port (no timed connect, no server speaking first). */
    if (egress_requests_checked(e, name, o->port))
      s->web = true;
  } else {
    s->raw = true;
    inet_ntop(o->family, o->addr, s->rec.ip, sizeof s->rec.ip);
    if (e->mode == EGRESS_MODE_ALLOW)
      return "IP address not in allow_hosts";
    const char *refusal = egress_addr_refusal(o->family, o->addr);
    if (*refusal)
      return refusal;
  }
  return policy_refusal(e, s, o->port);
}

void stream_open(struct link *lk, uint32_t sid, const struct agent_stream_open *o) {
  struct egress *e = lk->e;
  struct stream *s = calloc(1, sizeof *s);
  if (!s) {
    agent_stream_reset(lk->c, sid, ENOMEM, "out of memory");
    return;
  }
  s->lk = lk;
  s->sid = sid;
  s->fd = -1;
  s->family = o->family;
  memcpy(s->addr, o->addr, o->family == AF_INET ? 4 : 16);
  s->rec.ts_ms = now_ns(CLOCK_REALTIME) / 1000000u;
  s->rec.start_ms = s->last_ms = mono_ms();
  s->rec.port = o->port;
  /* Counted from here, so that stream_kill's accounting holds. */
  e->open_streams++;
  e->connecting++;
  s->next = lk->streams;
  lk->streams = s;
  const char *why = stage1(e, s, o);
  if (why) {
    /* Refused before any resolution: the record names the address the
     * program asked for, whatever refused it (a stand-in address too). */
    if (!*s->rec.ip)
      inet_ntop(o->family, o->addr, s->rec.ip, sizeof s->rec.ip);
    refuse(s, why);
    return;
  }
  if (agent_stream_accept(lk->c, sid, EGRESS_PEEK_MAX) < 0) {
    stream_kill(s, 0, "closed by the program before a decision", false);
    return;
  }
  s->granted = EGRESS_PEEK_MAX;
  s->deadline = s->last_ms + (s->web ? EGRESS_PEEK_MS : EGRESS_FIRST_BYTE_MS);
}

/* ---- time ---- */

static uint64_t state_timers(struct stream *s, uint64_t now) {
  switch (s->st) {
  case ST_PEEK:
    if (now < s->deadline)
      return s->deadline;
    if (!s->up_len && !s->web) {
      s->peek_pending = true; /* a server-first protocol, perhaps (SSH, SMTP) */
      go_connect(s);
    } else
      refuse(s, s->up_len && s->peek_more ? s->peek_more : "no request");
    return 0;
  case ST_RESOLVE:
    if (!s->job || now < s->job->deadline_ms)
      return s->job ? s->job->deadline_ms : 0;
    stream_kill(s, ETIMEDOUT, "connect failed: the name did not resolve in time", true);
    return 0;
  case ST_CONNECT:
    if (now < s->deadline)
      return s->deadline;
    stream_kill(s, ETIMEDOUT, "connect failed: Connection timed out", true);
    return 0;
  case ST_RELAY:
    if (now < s->last_ms + EGRESS_IDLE_MS)
      return s->last_ms + EGRESS_IDLE_MS;
    stream_kill(s, ETIMEDOUT, "idle", true);
    return 0;
  }
  return 0;
}

static uint64_t timers(struct stream *s, uint64_t now) {
  uint64_t peek = s->peek_pending ? s->peek_deadline : 0;
  if (peek && now >= peek) {
    late_refuse(s, s->peek_more ? s->peek_more : "no request");
    return 0;
  }
  uint64_t t = state_timers(s, now); /* S may be gone after it */
  return t && (!peek || t < peek) ? t : peek;
}

uint64_t link_stream_timers(struct link *lk, uint64_t now) {
  uint64_t next = 0;
  for (struct stream *s = lk->streams, *n; s; s = n) {
    n = s->next;
    uint64_t t = timers(s, now);
    if (t && (!next || t < next))
      next = t;
  }
  return next;
}
