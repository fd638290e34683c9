/* test_broker.c: the egress broker (egress/) with real parts: the real
 * agent_conn (proto/client.c) over a socketpair whose other end this test
 * speaks as the agent, frame by frame (HELLO answered, then LOOKUP,
 * STREAM_OPEN, STREAM_DATA, ...), a real TCP server on 127.0.0.1 that the
 * broker connects to (IGN_MCP_NET_PRIVATE=host and a hosts file mapping
 * good.test to 127.0.0.1; in a child process, since the broker never
 * connects to a socket its own process listens on), and the JSON Lines log
 * on disk.
 *
 * Some tests need a network of their own: they run in a child in new user,
 * network and mount namespaces (in_netns), where they give lo another
 * address (the host's own, not loopback) or put a resolv.conf naming a DNS
 * server that never answers over /etc/resolv.conf, as a hostile sandbox's
 * names would behave; where the namespaces cannot be made they say so and
 * skip. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/egress_policy.h"
#include "common/util.h"
#include "egress/egress.h"
#include "egress/egress_int.h" /* EGRESS_RESOLVE_JOBS_MAX */
#include "proto/client.h"
#include "proto/proto.h"
#include "test.h"

/* ---- the fake agent ------------------------------------------------------ */

struct frame {
  struct frame *next;
  struct proto_header h;
  uint8_t p[];
};

struct agent {
  int fd;
  pthread_t thread;
  pthread_mutex_t lock, wlock;
  pthread_cond_t cond;
  struct frame *head;
  bool eof;
  uint32_t next_id;
  struct agent_conn *c;
  /* EGRESS_STATS: answered OK{stats} (ERROR when stats_error, not at all
   * when stats_silent), under lock; how many came. */
  uint64_t stats[3];
  bool stats_error, stats_silent;
  unsigned stats_asked;
};

static void agent_send(struct agent *a, struct proto_buf *b);
static void stats_answer(struct agent *a, uint32_t id);

static void *agent_main(void *arg) {
  struct agent *a = arg;
  uint8_t *payload = malloc(PROTO_MAX_PAYLOAD);
  struct proto_header h;
  while (proto_read_frame(a->fd, &h, payload) == 0) {
    if (h.type == PROTO_HELLO) {
      struct proto_buf b = {0};
      proto_frame_begin(&b, PROTO_HELLO_OK, h.id);
      proto_put_u32(&b, TAG_VERSION, PROTO_VERSION);
      proto_put_str(&b, TAG_INFO, "fake agent");
      if (proto_frame_finish(&b) == 0) {
        pthread_mutex_lock(&a->wlock);
        proto_write_all(a->fd, b.data, b.len);
        pthread_mutex_unlock(&a->wlock);
      }
      proto_buf_free(&b);
      continue;
    }
    if (h.type == PROTO_EGRESS_STATS) {
      stats_answer(a, h.id);
      continue;
    }
    struct frame *f = malloc(sizeof *f + h.len);
    f->h = h;
    f->next = NULL;
    memcpy(f->p, payload, h.len);
    pthread_mutex_lock(&a->lock);
    struct frame **t = &a->head;
    while (*t)
      t = &(*t)->next;
    *t = f;
    pthread_cond_broadcast(&a->cond);
    pthread_mutex_unlock(&a->lock);
  }
  pthread_mutex_lock(&a->lock);
  a->eof = true;
  pthread_cond_broadcast(&a->cond);
  pthread_mutex_unlock(&a->lock);
  free(payload);
  return NULL;
}

static void agent_start(struct agent *a) {
  signal(SIGPIPE, SIG_IGN);
  memset(a, 0, sizeof *a);
  pthread_mutex_init(&a->lock, NULL);
  pthread_mutex_init(&a->wlock, NULL);
  pthread_cond_init(&a->cond, NULL);
  a->next_id = PROTO_AGENT_ID;
  int sv[2];
  CHECK_EQ_INT(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  a->fd = sv[1];
  pthread_create(&a->thread, NULL, agent_main, a);
  char *err = NULL;
  CHECK_EQ_INT(agent_conn_open(sv[0], 5000, &a->c, &err), 0);
  free(err);
}

static void agent_stop(struct agent *a) {
  agent_conn_free(a->c);
  pthread_join(a->thread, NULL);
  close(a->fd);
  while (a->head) {
    struct frame *f = a->head;
    a->head = f->next;
    free(f);
  }
}

/* The first frame for ID within MS (the caller frees it), or NULL. */
static struct frame *agent_wait(struct agent *a, uint32_t id, unsigned ms) {
  struct timespec until = timespec_in(CLOCK_REALTIME, ms);
  pthread_mutex_lock(&a->lock);
  for (;;) {
    for (struct frame **p = &a->head; *p; p = &(*p)->next)
      if ((*p)->h.id == id) {
        struct frame *f = *p;
        *p = f->next;
        pthread_mutex_unlock(&a->lock);
        return f;
      }
    if (a->eof || pthread_cond_timedwait(&a->cond, &a->lock, &until) == ETIMEDOUT)
      break;
  }
  pthread_mutex_unlock(&a->lock);
  return NULL;
}

/* The first frame of TYPE for ID, skipping (and freeing) CREDITs. */
static struct frame *agent_expect(struct agent *a, uint32_t id, uint8_t type, unsigned ms) {
  for (;;) {
    struct frame *f = agent_wait(a, id, ms);
    if (!f || f->h.type == type)
      return f;
    if (f->h.type != PROTO_STREAM_CREDIT) {
      const uint8_t *v;
      uint32_t len = 0;
      if (proto_find(f->p, f->h.len, TAG_MESSAGE, &v, &len) != 1)
        len = 0;
      fprintf(stderr, "  id %#x: %s (%.*s), expected %s\n", id, proto_type_name(f->h.type),
              (int)len, len ? (const char *)v : "", proto_type_name(type));
      free(f);
      return NULL;
    }
    free(f);
  }
}

static void agent_send(struct agent *a, struct proto_buf *b) {
  if (proto_frame_finish(b) == 0) {
    pthread_mutex_lock(&a->wlock);
    proto_write_all(a->fd, b->data, b->len);
    pthread_mutex_unlock(&a->wlock);
  }
  proto_buf_free(b);
}

/* EGRESS_STATS as the fake agent answers it: OK with a->stats, ERROR when
 * a->stats_error, nothing when a->stats_silent; every request counted. */
static void stats_answer(struct agent *a, uint32_t id) {
  pthread_mutex_lock(&a->lock);
  a->stats_asked++;
  bool silent = a->stats_silent, error = a->stats_error;
  uint64_t v[3] = {a->stats[0], a->stats[1], a->stats[2]};
  pthread_mutex_unlock(&a->lock);
  if (silent)
    return;
  struct proto_buf b = {0};
  proto_frame_begin(&b, error ? PROTO_ERROR : PROTO_OK, id);
  if (error) {
    proto_put_u32(&b, TAG_ERRNO, ENOENT);
    proto_put_str(&b, TAG_MESSAGE, "the sandbox has no capture of its traffic");
  } else {
    proto_put_u64(&b, TAG_UDP, v[0]);
    proto_put_u64(&b, TAG_ICMP, v[1]);
    proto_put_u64(&b, TAG_OTHER, v[2]);
  }
  agent_send(a, &b);
}

static uint32_t ag_lookup(struct agent *a, const void *name, size_t len, uint16_t qtype) {
  uint32_t id = ++a->next_id;
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_LOOKUP, id);
  proto_put_bytes(&b, TAG_NAME, name, len);
  proto_put_u32(&b, TAG_QTYPE, qtype);
  proto_put_u32(&b, TAG_TRANSPORT, LOOKUP_UDP);
  agent_send(a, &b);
  return id;
}

static uint32_t ag_open(struct agent *a, const uint8_t addr[4], uint16_t port) {
  uint32_t id = ++a->next_id;
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_STREAM_OPEN, id);
  proto_put_u32(&b, TAG_KIND, STREAM_KIND_TCP);
  proto_put_u32(&b, TAG_FAMILY, 4);
  proto_put_bytes(&b, TAG_ADDR, addr, 4);
  proto_put_u32(&b, TAG_PORT, port);
  proto_put_u32(&b, TAG_WINDOW, STREAM_WINDOW);
  agent_send(a, &b);
  return id;
}

static void ag_simple(struct agent *a, uint8_t type, uint32_t id, const void *p, size_t n) {
  struct proto_buf b = {0};
  proto_frame_begin(&b, type, id);
  if (type == PROTO_STREAM_RESET)
    proto_put_u32(&b, TAG_ERRNO, ECONNRESET);
  else if (n)
    proto_put_raw(&b, p, n);
  agent_send(a, &b);
}

static uint32_t tlv_u32(const struct frame *f, uint16_t tag) {
  const uint8_t *v;
  uint32_t len, x = UINT32_MAX;
  if (proto_find(f->p, f->h.len, tag, &v, &len) == 1)
    proto_val_u32(v, len, &x);
  return x;
}

/* A lookup's answer within MS: its RCODE (-1: none came), the first
 * address in A. */
static int lookup_rcode_within(struct agent *a, uint32_t id, uint8_t addr[4], size_t *ret_n,
                               unsigned ms) {
  struct frame *f = agent_expect(a, id, PROTO_LOOKUP_END, ms);
  if (!f)
    return -1;
  int rcode = (int)tlv_u32(f, TAG_RCODE);
  struct proto_tlv_iter it;
  proto_tlv_init(&it, f->p, f->h.len);
  uint16_t tag;
  const uint8_t *v;
  uint32_t len;
  size_t n = 0;
  while (proto_tlv_next(&it, &tag, &v, &len) == 1)
    if (tag == TAG_ADDR && len == 4) {
      if (!n && addr)
        memcpy(addr, v, 4);
      n++;
    }
  if (ret_n)
    *ret_n = n;
  free(f);
  return rcode;
}

static int lookup_rcode(struct agent *a, uint32_t id, uint8_t addr[4], size_t *ret_n) {
  return lookup_rcode_within(a, id, addr, ret_n, 5000);
}

/* A stream's reset: its errno, MESSAGE into MSG. -1: something else came. */
static int reset_of(struct agent *a, uint32_t id, char *msg, size_t size) {
  msg[0] = '\0';
  struct frame *f = agent_expect(a, id, PROTO_STREAM_RESET, 5000);
  if (!f)
    return -1;
  int err = (int)tlv_u32(f, TAG_ERRNO);
  const uint8_t *v;
  uint32_t len;
  msg[0] = '\0';
  if (proto_find(f->p, f->h.len, TAG_MESSAGE, &v, &len) == 1)
    snprintf(msg, size, "%.*s", (int)len, (const char *)v);
  free(f);
  return err;
}

/* ---- the server the broker connects to ----------------------------------- */

/* It runs in a child process: the broker refuses every socket its own
 * process listens on (egress/self.c), and this test is that process.  Its
 * counts are in memory shared with the child. */
struct srv_shared {
  atomic_int accepts;
  atomic_long bytes;           /* what reached the server */
};
static struct {
  uint16_t port;
  pid_t pid;
  struct srv_shared *sh;
  const char *greeting; /* sent first on each connection (a server-first protocol) */
} srv;
#define srv_accepts (srv.sh->accepts)
#define srv_bytes (srv.sh->bytes)

/* The child: echoes each connection on LFD until its EOF, one at a time,
 * until killed.  Only async-signal-safe calls after the fork. */
static _Noreturn void server_main(int lfd) {
  for (;;) {
    int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0)
      continue;
    atomic_fetch_add(&srv_accepts, 1);
    if (srv.greeting && write(c, srv.greeting, strlen(srv.greeting)) < 0) {
      close(c);
      continue;
    }
    char buf[4096];
    for (ssize_t n; (n = read(c, buf, sizeof buf)) > 0;) {
      atomic_fetch_add(&srv_bytes, n);
      if (write(c, buf, (size_t)n) != n)
        break;
    }
    close(c);
  }
}

/* The echo server on ADDR (host order), a port of its own. */
static void server_start_on(uint32_t addr) {
  if (!srv.sh) {
    srv.sh = mmap(NULL, sizeof *srv.sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (srv.sh == MAP_FAILED)
      abort();
  }
  int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in in = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(addr)};
  CHECK_EQ_INT(bind(lfd, (struct sockaddr *)&in, sizeof in), 0);
  CHECK_EQ_INT(listen(lfd, 16), 0);
  socklen_t sl = sizeof in;
  getsockname(lfd, (struct sockaddr *)&in, &sl);
  srv.port = ntohs(in.sin_port);
  atomic_store(&srv_accepts, 0);
  atomic_store(&srv_bytes, 0);
  srv.pid = fork();
  if (srv.pid == 0) {
    /* Nothing of the parent's but the socket: a copy of a session's
     * socketpair here would hide its end from the other side. */
    if (lfd != 3 && dup2(lfd, 3) != 3)
      _exit(1);
    close_range(4, ~0u, 0);
    server_main(3);
  }
  CHECK(srv.pid > 0);
  close(lfd); /* the child's only: this process listens on nothing */
}

static void server_start(void) { server_start_on(INADDR_LOOPBACK); }

/* Waits up to MS for the server to have accepted N connections. */
static bool server_accepted(int n, unsigned ms) {
  for (unsigned i = 0; i < ms / 10 && atomic_load(&srv_accepts) < n; i++)
    usleep(10000);
  return atomic_load(&srv_accepts) >= n;
}

static void server_stop(void) {
  if (srv.pid > 0) {
    kill(srv.pid, SIGKILL);
    waitpid(srv.pid, NULL, 0);
  }
  srv.pid = 0;
}

/* ---- fixtures ------------------------------------------------------------ */

static char tmp[64], hosts_path[128];

static void write_hosts(const char *text) {
  FILE *f = fopen(hosts_path, "w");
  fputs(text, f);
  fclose(f);
}

/* IGN_MCP_NET_PRIVATE as the operator sets it. */
enum private { PRIV_NONE, PRIV_ONE, PRIV_HOST };

/* IGN_MCP_EGRESS_WILDCARD_NAMES and IGN_MCP_EGRESS_LOG_CAP for the next
 * init_broker (0: the defaults here). */
static unsigned wildcard_names;
static size_t log_cap;

static void init_broker(enum private priv, unsigned max_streams) {
  struct egress_settings s = {.max_mode = EGRESS_MODE_OPEN, .allow_private = priv == PRIV_ONE,
                              .allow_host = priv == PRIV_HOST, .hosts_file = hosts_path,
                              .log_dir = tmp, .log_cap = log_cap ? log_cap : 1u << 20,
                              .max_streams = max_streams, .max_bytes = 1ull << 30,
                              .wildcard_names = wildcard_names};
  char *err = NULL;
  int r = egress_init(&s, &err);
  CHECK_EQ_INT(r, 0);
  if (r)
    fprintf(stderr, "  egress_init: %s\n", err);
  free(err);
}

/* A session of OWNER with MODE and ALLOW (a JSON array text, or NULL),
 * attached. */
static struct egress *session_of(const char *owner, const char *mode, const char *allow,
                                 const char *sid, struct agent *a) {
  json_t *net = json_string(mode), *hosts = allow ? json_loads(allow, 0, NULL) : NULL;
  struct egress *e = NULL;
  char *err = NULL;
  int r = egress_new("open_session", net, hosts, &e, &err);
  CHECK_EQ_INT(r, 0);
  if (r)
    fprintf(stderr, "  egress_new: %s\n", err);
  free(err);
  json_decref(net);
  json_decref(hosts);
  if (!e)
    return NULL;
  egress_set_session(e, sid, owner);
  agent_start(a);
  egress_attach(e, a->c, NULL, NULL);
  return e;
}

/* The same, for stdio's owner. */
static struct egress *session(const char *mode, const char *allow, const char *sid,
                              struct agent *a) {
  return session_of("", mode, allow, sid, a);
}

static void session_end(struct egress *e, struct agent *a) {
  egress_free(e);
  agent_stop(a);
}

/* The synthetic address of NAME, by a lookup. */
static bool resolve(struct agent *a, const char *name, uint8_t addr[4]) {
  size_t n = 0;
  int rc = lookup_rcode(a, ag_lookup(a, name, strlen(name), 1), addr, &n);
  CHECK_EQ_INT(rc, RCODE_NOERROR);
  CHECK_EQ_INT(n, 1);
  return rc == RCODE_NOERROR && n == 1;
}

/* The last entry of report list LIST, or NULL. */
static json_t *last_of(json_t *rep, const char *list) {
  json_t *l = json_object_get(rep, list);
  size_t n = json_array_size(l);
  return n ? json_array_get(l, n - 1) : NULL;
}

static const char *str_of(json_t *o, const char *key) {
  return json_string_value(json_object_get(o, key));
}

/* ---- tests --------------------------------------------------------------- */

static void check_new_refused(const char *net_json, const char *allow_json, const char *says) {
  json_t *net = net_json ? json_loads(net_json, JSON_DECODE_ANY, NULL) : NULL;
  json_t *hosts = allow_json ? json_loads(allow_json, JSON_DECODE_ANY, NULL) : NULL;
  struct egress *e = NULL;
  char *err = NULL;
  CHECK_EQ_INT(egress_new("open_session", net, hosts, &e, &err), -EINVAL);
  CHECK(e == NULL);
  CHECK(err && strstr(err, says) && strstr(err, "open_session"));
  if (err && !strstr(err, says))
    fprintf(stderr, "  %s / %s: \"%s\", expected it to say \"%s\"\n", net_json, allow_json, err, says);
  free(err);
  json_decref(net);
  json_decref(hosts);
}

static void new_refuses_bad_arguments(void) {
  struct egress_settings s = {.max_mode = EGRESS_MODE_ALLOW, .hosts_file = hosts_path,
                              .log_dir = tmp, .log_cap = 1u << 20, .max_streams = 64,
                              .max_bytes = 1ull << 30};
  char *err = NULL;
  CHECK_EQ_INT(egress_init(&s, &err), 0);
  free(err);
  check_new_refused("true", NULL, "boolean form (true/false) is gone");
  check_new_refused("false", NULL, "boolean form");
  check_new_refused("\"bogus\"", NULL, "not \"bogus\"");
  check_new_refused("3", NULL,
                    "'network' must be \"none\", \"allow\" (with allow_hosts) or \"open\", "
                    "not an integer");
  check_new_refused("\"open\"", NULL, "IGN_MCP_NET=allow");
  check_new_refused("\"open\"", "[\"pypi.org\"]", "IGN_MCP_NET");
  check_new_refused("\"none\"", "[\"pypi.org\"]", "only with network \"allow\"");
  check_new_refused(NULL, "[\"pypi.org\"]", "only with network \"allow\"");
  check_new_refused("\"allow\"", NULL, "needs allow_hosts");
  check_new_refused("\"allow\"", "[]", "needs allow_hosts");
  check_new_refused("\"allow\"", "\"pypi.org\"", "'allow_hosts' must be an array of host names");
  check_new_refused("\"allow\"", "[\"pypi.org\", 7]", "allow_hosts[1] must be a string");
  check_new_refused("\"allow\"", "[\"pypi.org\", \"*.com\"]", "allow_hosts[1]");
  check_new_refused("\"allow\"", "[\"1.2.3.4\"]", "it is an IP address");
  /* What passes. */
  struct egress *e = NULL;
  json_t *net = json_string("allow"), *hosts = json_loads("[\"PyPI.org\", \"*.x.org:8080\"]", 0, NULL);
  CHECK_EQ_INT(egress_new("open_session", net, hosts, &e, &err), 0);
  json_t *sum = e ? egress_summary(e, "no nf_tables") : NULL;
  CHECK_STREQ(str_of(sum, "mode"), "allow");
  CHECK_STREQ(json_string_value(json_array_get(json_object_get(sum, "allowed_rules"), 0)), "pypi.org");
  CHECK_STREQ(json_string_value(json_array_get(json_object_get(sum, "allowed_rules"), 1)), "*.x.org:8080");
  CHECK_STREQ(str_of(sum, "capture"), "no nf_tables");
  CHECK(json_is_null(json_object_get(sum, "egress_log_path"))); /* no session id yet */
  json_decref(sum);
  egress_free(e);
  e = NULL;
  CHECK_EQ_INT(egress_new("open_session", NULL, NULL, &e, &err), 0); /* absent: none */
  sum = e ? egress_summary(e, NULL) : NULL;
  CHECK_STREQ(str_of(sum, "mode"), "none");
  CHECK(!json_object_get(sum, "capture"));
  json_decref(sum);
  egress_free(e);
  json_decref(net);
  json_decref(hosts);
  egress_shutdown();
}

/* What a hibernated session keeps of its egress is made again the same:
 * mode, rules, and the synthetic names in order; a damaged save, or one
 * the operator's IGN_MCP_NET no longer allows, is refused. */
static void saved_egress_is_made_again(void) {
  struct egress_settings s = {.max_mode = EGRESS_MODE_ALLOW, .hosts_file = hosts_path,
                              .log_dir = tmp, .log_cap = 1u << 20, .max_streams = 64,
                              .max_bytes = 1ull << 30};
  char *err = NULL;
  CHECK_EQ_INT(egress_init(&s, &err), 0);
  free(steal_ptr(err));
  struct egress *e = NULL, *back = NULL;
  json_t *net = json_string("allow"), *hosts = json_loads("[\"PyPI.org\", \"*.x.org:8080\"]", 0, NULL);
  CHECK_EQ_INT(egress_new("open_session", net, hosts, &e, &err), 0);
  const char *names[] = {"pypi.org", "files.x.org", "evil.example"};
  CHECK_EQ_INT(e ? names_restore(e, names, 3) : -1, 0);
  json_t *saved = e ? egress_save(e) : NULL;
  CHECK_STREQ(str_of(saved, "mode"), "allow");
  CHECK_EQ_INT(json_array_size(json_object_get(saved, "allow_hosts")), 2);
  CHECK_STREQ(json_string_value(json_array_get(json_object_get(saved, "allow_hosts"), 1)), "*.x.org:8080");
  CHECK_EQ_INT(json_array_size(json_object_get(saved, "names")), 3);
  CHECK_EQ_INT(egress_load(saved, &back, &err), 0);
  json_t *again = back ? egress_save(back) : NULL;
  /* Counted again under its wildcard rule: the name it was given. */
  json_t *wild = json_loads("[0, 1]", 0, NULL);
  CHECK(again && json_equal(json_object_get(again, "wildcard_names"), wild));
  json_decref(wild);
  json_object_del(saved, "wildcard_names");
  if (again)
    json_object_del(again, "wildcard_names");
  CHECK(again && json_equal(saved, again));
  /* The same names stand for the same addresses. */
  for (int i = 0; back && i < 3; i++) {
    uint8_t a[4] = {198, 18, 0, (uint8_t)(i + 1)};
    CHECK_STREQ(names_synthetic(back, AF_INET, a), names[i]);
  }
  json_decref(again);
  egress_free(back);
  back = NULL;
  /* Damaged: a name twice, a name that is not one, a mode that is not a string. */
  const char *bad[] = {"{\"mode\":\"none\",\"names\":[\"a.org\",\"a.org\"]}",
                       "{\"mode\":\"none\",\"names\":[\"../x\"]}", "{\"mode\":7}",
                       "{\"mode\":\"allow\",\"allow_hosts\":[]}"};
  for (size_t i = 0; i < ARRAY_SIZE(bad); i++) {
    json_t *j = json_loads(bad[i], 0, NULL);
    CHECK_EQ_INT(egress_load(j, &back, &err), -EINVAL);
    CHECK(err != NULL);
    free(steal_ptr(err));
    json_decref(j);
  }
  /* A mode past the operator's, now: refused, not widened. */
  json_t *open = json_loads("{\"mode\":\"open\"}", 0, NULL);
  CHECK_EQ_INT(egress_load(open, &back, &err), -EINVAL);
  CHECK(err && strstr(err, "IGN_MCP_NET"));
  free(steal_ptr(err));
  json_decref(open);
  json_decref(saved);
  egress_free(e);
  json_decref(net);
  json_decref(hosts);
  egress_shutdown();
}

/* network_update: the new rules in force, what it was before, the names
 * counted under a wildcard rule that stays go on counting; a refused
 * update changes nothing. */
static void updated_policy_keeps_what_stays(void) {
  struct egress_settings s = {.max_mode = EGRESS_MODE_ALLOW, .hosts_file = hosts_path,
                              .log_dir = tmp, .log_cap = 1u << 20, .max_streams = 64,
                              .max_bytes = 1ull << 30};
  char *err = NULL;
  CHECK_EQ_INT(egress_init(&s, &err), 0);
  free(steal_ptr(err));
  struct egress *e = NULL;
  json_t *net = json_string("allow"), *hosts = json_loads("[\"*.x.org\", \"a.org\"]", 0, NULL);
  CHECK_EQ_INT(egress_new("open_session", net, hosts, &e, &err), 0);
  const char *names[] = {"f1.x.org", "f2.x.org", "a.org"};
  CHECK_EQ_INT(e ? names_restore(e, names, 3) : -1, 0);
  CHECK_EQ_INT(e ? names_restore_wild(e, (uint32_t[]){2, 0}, 2) : -1, 0);
  json_t *info = NULL;
  json_t *wider = json_loads("[\"b.org:8443\", \"*.x.org\"]", 0, NULL);
  CHECK_EQ_INT(egress_update(e, NULL, wider, NULL, &info, &err), 0);
  CHECK_STREQ(str_of(info, "mode"), "allow");
  CHECK_STREQ(json_string_value(json_array_get(json_object_get(info, "allowed_rules"), 0)), "b.org:8443");
  CHECK_STREQ(str_of(json_object_get(info, "previous"), "mode"), "allow");
  CHECK_EQ_INT(json_array_size(json_object_get(json_object_get(info, "previous"), "allowed_rules")), 2);
  CHECK_EQ_INT(json_integer_value(json_object_get(info, "connections_reset")), 0);
  json_decref(info);
  json_t *saved = egress_save(e);
  json_t *wild = json_loads("[0, 2]", 0, NULL);
  CHECK(json_equal(json_object_get(saved, "wildcard_names"), wild));
  json_decref(wild);
  json_decref(saved);
  /* Refused: nothing to change, open past IGN_MCP_NET, hosts with none. */
  json_t *open = json_string("open"), *none = json_string("none");
  CHECK_EQ_INT(egress_update(e, NULL, NULL, NULL, &info, &err), -EINVAL);
  CHECK(err && strstr(err, "nothing to change"));
  free(steal_ptr(err));
  CHECK_EQ_INT(egress_update(e, open, NULL, NULL, &info, &err), -EINVAL);
  CHECK(err && strstr(err, "IGN_MCP_NET=allow"));
  free(steal_ptr(err));
  CHECK_EQ_INT(egress_update(e, none, hosts, NULL, &info, &err), -EINVAL);
  free(steal_ptr(err));
  saved = egress_save(e);
  CHECK_EQ_INT(json_array_size(json_object_get(saved, "allow_hosts")), 2);
  json_decref(saved);
  /* "allow" alone keeps the rules; "none" drops them. */
  CHECK_EQ_INT(egress_update(e, net, NULL, NULL, &info, &err), 0);
  CHECK_EQ_INT(json_array_size(json_object_get(info, "allowed_rules")), 2);
  json_decref(info);
  CHECK_EQ_INT(egress_update(e, none, NULL, NULL, &info, &err), 0);
  CHECK_STREQ(str_of(info, "mode"), "none");
  CHECK_EQ_INT(json_array_size(json_object_get(info, "allowed_rules")), 0);
  json_decref(info);
  CHECK_EQ_INT(egress_update(e, net, NULL, NULL, &info, &err), -EINVAL);
  CHECK(err && strstr(err, "has none to keep"));
  free(steal_ptr(err));
  /* A wildcard rule given back after "none" goes on from its count. */
  json_t *xonly = json_loads("[\"*.x.org\"]", 0, NULL);
  CHECK_EQ_INT(egress_update(e, NULL, xonly, NULL, &info, &err), 0);
  json_decref(info);
  saved = egress_save(e);
  wild = json_loads("[2]", 0, NULL);
  CHECK(json_equal(json_object_get(saved, "wildcard_names"), wild));
  json_decref(wild);
  json_decref(saved);
  json_decref(xonly);
  json_decref(open);
  json_decref(none);
  json_decref(wider);
  json_decref(net);
  json_decref(hosts);
  egress_free(e);
  egress_shutdown();
}

static void policy_line_says_the_bounds(void) {
  init_broker(PRIV_HOST, 64);
  char *line = egress_policy_line();
  CHECK(strstr(line, "IGN_MCP_NET=open (sessions may ask none, allow or open)"));
  CHECK(strstr(line, "private destinations allowed"));
  CHECK(strstr(line, hosts_path) && strstr(line, "(2 names)"));
  free(line);
  egress_shutdown();
}

static void dns_answers_by_policy(void) {
  init_broker(PRIV_HOST, 64);
  struct agent a;
  struct egress *e = session("allow", "[\"good.test\"]", "dns1", &a);
  uint8_t addr[4] = {0}, again[4] = {0};
  if (resolve(&a, "good.test", addr)) {
    CHECK_EQ_INT(addr[0], 198);
    CHECK(addr[1] == 18 || addr[1] == 19);
  }
  resolve(&a, "GOOD.test.", again); /* the same name: the same address */
  CHECK(memcmp(addr, again, 4) == 0);
  size_t n = 9;
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "good.test", 9, 28), NULL, &n), RCODE_NOERROR);
  CHECK_EQ_INT(n, 0); /* AAAA: no answer */
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "good.test", 9, 65), NULL, &n), RCODE_NOERROR);
  CHECK_EQ_INT(n, 0); /* HTTPS: no answer, no ECH configuration */
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "evil.example", 12, 1), NULL, &n), RCODE_NXDOMAIN);
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "bad\0name", 8, 16), NULL, &n), RCODE_NXDOMAIN);
  json_t *rep = egress_report(e, false);
  json_t *dns = json_object_get(rep, "dns_queries");
  CHECK_EQ_INT(json_array_size(dns), 6);
  json_t *ev = json_array_get(dns, 0);
  CHECK_STREQ(str_of(ev, "kind"), "dns");
  CHECK_STREQ(str_of(ev, "name"), "good.test");
  CHECK_STREQ(str_of(ev, "type"), "A");
  CHECK(json_is_true(json_object_get(ev, "allowed")));
  CHECK(json_integer_value(json_object_get(ev, "ts_ms")) > 1700000000000);
  CHECK_STREQ(str_of(json_array_get(dns, 2), "type"), "AAAA");
  CHECK_STREQ(str_of(json_array_get(dns, 3), "type"), "HTTPS");
  ev = json_array_get(dns, 4);
  CHECK_STREQ(str_of(ev, "name"), "evil.example");
  CHECK(json_is_false(json_object_get(ev, "allowed")));
  CHECK_STREQ(str_of(ev, "reason"), "not in allow_hosts");
  ev = json_array_get(dns, 5);
  CHECK_STREQ(str_of(ev, "name"), "<invalid:8>");
  CHECK_STREQ(str_of(ev, "type"), "TXT");
  json_decref(rep);
  session_end(e, &a);
  egress_shutdown();
}

static void relay_both_ways_and_count(void) {
  init_broker(PRIV_HOST, 64);
  server_start();
  char allow[96];
  snprintf(allow, sizeof allow, "[\"good.test:%u\"]", srv.port);
  struct agent a;
  struct egress *e = session("allow", allow, "relay1", &a);
  uint8_t addr[4];
  if (resolve(&a, "good.test", addr)) {
    uint32_t sid = ag_open(&a, addr, srv.port);
    struct frame *f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
    CHECK(f != NULL);
    if (f)
      CHECK_EQ_INT(tlv_u32(f, TAG_WINDOW), EGRESS_PEEK_MAX);
    free(f);
    static const char req[] = "GET / HTTP/1.1\r\nHost: good.test\r\n\r\n";
    ag_simple(&a, PROTO_STREAM_DATA, sid, req, sizeof req - 1);
    char got[256];
    size_t n = 0;
    while (n < sizeof req - 1 && (f = agent_expect(&a, sid, PROTO_STREAM_DATA, 5000))) {
      memcpy(got + n, f->p, f->h.len < sizeof got - n ? f->h.len : sizeof got - n);
      n += f->h.len;
      free(f);
    }
    CHECK_EQ_INT(n, sizeof req - 1);
    CHECK(memcmp(got, req, sizeof req - 1) == 0);
    /* Still open: the report shows its bytes so far (the broker counts
     * them just after the agent may have seen them: a moment later). */
    json_t *rep = NULL, *ev = NULL;
    for (int i = 0; i < 100; i++) {
      json_decref(rep);
      rep = egress_report(e, false);
      ev = last_of(rep, "allowed");
      if (json_integer_value(json_object_get(ev, "bytes_down")) == sizeof req - 1)
        break;
      usleep(10000);
    }
    CHECK(json_is_true(json_object_get(ev, "open")));
    CHECK_EQ_INT(json_integer_value(json_object_get(ev, "bytes_up")), sizeof req - 1);
    CHECK_EQ_INT(json_integer_value(json_object_get(ev, "bytes_down")), sizeof req - 1);
    json_decref(rep);
    ag_simple(&a, PROTO_STREAM_SHUT, sid, NULL, 0);
    f = agent_expect(&a, sid, PROTO_STREAM_SHUT, 5000); /* the server closed after our FIN */
    CHECK(f != NULL);
    free(f);
    usleep(100000);
    rep = egress_report(e, true);
    ev = last_of(rep, "allowed");
    CHECK_STREQ(str_of(ev, "kind"), "connect");
    CHECK_STREQ(str_of(ev, "host"), "good.test");
    CHECK_STREQ(str_of(ev, "ip"), "127.0.0.1");
    CHECK_EQ_INT(json_integer_value(json_object_get(ev, "port")), srv.port);
    char rule[64];
    snprintf(rule, sizeof rule, "good.test:%u", srv.port);
    CHECK_STREQ(str_of(ev, "rule"), rule);
    CHECK_STREQ(str_of(ev, "sni"), "good.test");
    CHECK_EQ_INT(json_integer_value(json_object_get(ev, "bytes_up")), sizeof req - 1);
    CHECK_EQ_INT(json_integer_value(json_object_get(ev, "bytes_down")), sizeof req - 1);
    CHECK(!json_object_get(ev, "open"));
    CHECK(!json_object_get(ev, "reason"));
    json_decref(rep);
  }
  CHECK_EQ_INT(atomic_load(&srv_accepts), 1);
  session_end(e, &a);
  server_stop();
  egress_shutdown();
}

/* 600 KiB up and echoed back down: the agent sends only what it was
 * granted and credits what it read, as the real one does; the broker
 * relays within both windows and counts every byte. */
static void relay_within_the_windows(void) {
  init_broker(PRIV_HOST, 64);
  server_start();
  char allow[96];
  snprintf(allow, sizeof allow, "[\"good.test:%u\"]", srv.port);
  struct agent a;
  struct egress *e = session("allow", allow, "relay2", &a);
  uint8_t addr[4];
  enum { TOTAL = 600 * 1024 };
  static uint8_t chunk[PROTO_CHUNK];
  size_t sent = 0, recvd = 0, grant = 0;
  bool order_ok = true, shut = false;
  if (resolve(&a, "good.test", addr)) {
    uint32_t sid = ag_open(&a, addr, srv.port);
    struct frame *f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
    grant = f ? tlv_u32(f, TAG_WINDOW) : 0;
    free(f);
    while (f || !shut) {
      while (sent < TOTAL && grant) {
        size_t n = TOTAL - sent < sizeof chunk ? TOTAL - sent : sizeof chunk;
        n = n < grant ? n : grant;
        for (size_t i = 0; i < n; i++)
          chunk[i] = (uint8_t)((sent + i) * 7 + 1);
        ag_simple(&a, PROTO_STREAM_DATA, sid, chunk, n);
        sent += n;
        grant -= n;
      }
      if (sent == TOTAL && !shut) {
        ag_simple(&a, PROTO_STREAM_SHUT, sid, NULL, 0);
        shut = true;
      }
      f = agent_wait(&a, sid, 5000);
      if (!f) {
        fprintf(stderr, "  nothing more came: sent %zu, received %zu, grant %zu, alive %d\n", sent,
                recvd, grant, agent_conn_alive(a.c));
        break;
      }
      if (f->h.type == PROTO_STREAM_CREDIT) {
        grant += tlv_u32(f, TAG_WINDOW);
      } else if (f->h.type == PROTO_STREAM_DATA) {
        for (size_t i = 0; i < f->h.len; i++)
          order_ok &= f->p[i] == (uint8_t)((recvd + i) * 7 + 1);
        recvd += f->h.len;
        struct proto_buf b = {0};
        proto_frame_begin(&b, PROTO_STREAM_CREDIT, sid);
        proto_put_u32(&b, TAG_WINDOW, f->h.len);
        agent_send(&a, &b);
      } else {
        CHECK_EQ_INT(f->h.type, PROTO_STREAM_SHUT);
        free(f);
        break;
      }
      free(f);
    }
  }
  CHECK_EQ_INT(sent, TOTAL);
  CHECK_EQ_INT(recvd, TOTAL);
  CHECK(order_ok);
  usleep(100000);
  json_t *rep = egress_report(e, false);
  json_t *ev = last_of(rep, "allowed");
  CHECK_EQ_INT(json_integer_value(json_object_get(ev, "bytes_up")), TOTAL);
  CHECK_EQ_INT(json_integer_value(json_object_get(ev, "bytes_down")), TOTAL);
  CHECK(!json_object_get(ev, "sni")); /* neither TLS nor HTTP: on an explicit port, no peek name */
  json_decref(rep);
  session_end(e, &a);
  server_stop();
  egress_shutdown();
}

/* Opens a stream to ADDR:PORT and expects a reset at once saying WHY. */
static void check_reset(struct agent *a, const uint8_t addr[4], uint16_t port, const char *why) {
  char msg[128];
  uint32_t sid = ag_open(a, addr, port);
  CHECK_EQ_INT(reset_of(a, sid, msg, sizeof msg), ECONNREFUSED);
  CHECK_STREQ(msg, why);
}

static void refusals_at_open(void) {
  init_broker(PRIV_HOST, 64);
  server_start();
  char allow[96];
  snprintf(allow, sizeof allow, "[\"good.test:%u\"]", srv.port);
  struct agent a;
  struct egress *e = session("allow", allow, "open1", &a);
  uint8_t addr[4];
  if (resolve(&a, "good.test", addr)) {
    check_reset(&a, (uint8_t[4]){93, 184, 216, 34}, 443, "IP address not in allow_hosts");
    check_reset(&a, (uint8_t[4]){127, 0, 0, 1}, srv.port, "IP address not in allow_hosts");
    check_reset(&a, (uint8_t[4]){198, 18, 200, 1}, 443, "unknown address");
    check_reset(&a, addr, 8443, "port not in allow_hosts");
  }
  json_t *rep = egress_report(e, false);
  json_t *denied = json_object_get(rep, "denied");
  CHECK_EQ_INT(json_array_size(denied), 4);
  json_t *ev = json_array_get(denied, 0);
  CHECK_STREQ(str_of(ev, "ip"), "93.184.216.34");
  CHECK(json_is_null(json_object_get(ev, "host")));
  CHECK_STREQ(str_of(ev, "reason"), "IP address not in allow_hosts");
  CHECK_EQ_INT(json_integer_value(json_object_get(ev, "duration_ms")), 0);
  ev = json_array_get(denied, 3);
  CHECK_STREQ(str_of(ev, "host"), "good.test");
  CHECK_EQ_INT(json_integer_value(json_object_get(ev, "port")), 8443);
  json_decref(rep);
  CHECK_EQ_INT(atomic_load(&srv_accepts), 0);
  session_end(e, &a);
  server_stop();
  egress_shutdown();
}

/* A TLS ClientHello naming NAME (server_name its one extension) into OUT;
 * its length. */
static size_t client_hello(const char *name, uint8_t *out) {
  size_t n = strlen(name), body = 52 + n, o = 0;
  uint8_t *p = out;
  p[o++] = 22, p[o++] = 3, p[o++] = 1, p[o++] = (uint8_t)((body + 4) >> 8), p[o++] = (uint8_t)(body + 4);
  p[o++] = 1, p[o++] = 0, p[o++] = (uint8_t)(body >> 8), p[o++] = (uint8_t)body;
  p[o++] = 3, p[o++] = 3;
  for (int i = 0; i < 32; i++)
    p[o++] = (uint8_t)i;                                /* random */
  p[o++] = 0;                                           /* session id */
  p[o++] = 0, p[o++] = 2, p[o++] = 0x13, p[o++] = 0x01; /* one suite */
  p[o++] = 1, p[o++] = 0;                               /* null compression */
  p[o++] = 0, p[o++] = (uint8_t)(9 + n);                /* extensions */
  p[o++] = 0, p[o++] = 0, p[o++] = 0, p[o++] = (uint8_t)(5 + n);
  p[o++] = 0, p[o++] = (uint8_t)(3 + n), p[o++] = 0, p[o++] = 0, p[o++] = (uint8_t)n;
  memcpy(p + o, name, n);
  return o + n;
}

static void peek_mismatch_reaches_nothing(void) {
  init_broker(PRIV_HOST, 64);
  server_start();
  char allow[96];
  snprintf(allow, sizeof allow, "[\"good.test:%u\"]", srv.port);
  struct agent a;
  struct egress *e = session("allow", allow, "peek1", &a);
  uint8_t addr[4];
  uint8_t hello_evil[128];
  size_t hello_len = client_hello("evil.com", hello_evil);
  static const char host_evil[] = "GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n";
  static const char two_hosts[] = "GET / HTTP/1.1\r\nHost: good.test\r\nHost: evil.example\r\n\r\n";
  /* Shapes a server takes as a request for evil.example. */
  static const char any_scheme[] = "GET xyz://evil.example/ HTTP/1.1\r\nHost: good.test\r\n\r\n";
  static const char lead_crlf[] = "\r\nGET / HTTP/1.1\r\nHost: evil.example\r\n\r\n";
  static const char lower[] = "get / HTTP/1.1\r\nHost: evil.example\r\n\r\n";
  static const char long_method[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZ / HTTP/1.1\r\nHost: evil.example\r\n\r\n";
  static const char http09[] = "GET /\r\n";
  /* No host at all: a front end serves its default site. */
  static const char no_host10[] = "GET / HTTP/1.0\r\n\r\n";
  static const char no_host11[] = "\r\nGET / HTTP/1.1\r\nAccept: */*\r\n\r\n";
  static const char no_host_star[] = "OPTIONS * HTTP/1.1\r\n\r\n";
  char port_host[128];
  int port_host_len = snprintf(port_host, sizeof port_host,
                               "GET / HTTP/1.1\r\nHost: good.test:%u\r\n\r\n", srv.port + 1u);
  char port_target[128];
  int port_target_len = snprintf(port_target, sizeof port_target,
                                 "GET http://good.test:%u/ HTTP/1.1\r\n\r\n", srv.port + 1u);
  struct {
    const void *p;
    size_t n;
    const char *why;
  } rows[] = {{hello_evil, hello_len, "SNI mismatch"},
              {host_evil, sizeof host_evil - 1, "Host mismatch"},
              {two_hosts, sizeof two_hosts - 1, "malformed HTTP request"},
              {any_scheme, sizeof any_scheme - 1, "malformed HTTP request"},
              {lead_crlf, sizeof lead_crlf - 1, "Host mismatch"},
              {lower, sizeof lower - 1, "Host mismatch"},
              {long_method, sizeof long_method - 1, "Host mismatch"},
              {http09, sizeof http09 - 1, "malformed HTTP request"},
              {no_host10, sizeof no_host10 - 1, "HTTP request without Host"},
              {no_host11, sizeof no_host11 - 1, "HTTP request without Host"},
              {no_host_star, sizeof no_host_star - 1, "HTTP request without Host"},
              {port_host, (size_t)port_host_len, "Host port mismatch"},
              {port_target, (size_t)port_target_len, "Host port mismatch"}};
  if (resolve(&a, "good.test", addr))
    for (size_t i = 0; i < ARRAY_SIZE(rows); i++) {
      uint32_t sid = ag_open(&a, addr, srv.port);
      struct frame *f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
      CHECK(f != NULL);
      free(f);
      ag_simple(&a, PROTO_STREAM_DATA, sid, rows[i].p, rows[i].n);
      char msg[128];
      CHECK_EQ_INT(reset_of(&a, sid, msg, sizeof msg), ECONNREFUSED);
      CHECK_STREQ(msg, rows[i].why);
    }
  json_t *rep = egress_report(e, false);
  json_t *ev = json_array_get(json_object_get(rep, "denied"), 0);
  CHECK_STREQ(str_of(ev, "reason"), "SNI mismatch");
  CHECK_STREQ(str_of(ev, "sni"), "evil.com");
  ev = json_array_get(json_object_get(rep, "denied"), 1);
  CHECK_STREQ(str_of(ev, "sni"), "evil.example");
  json_decref(rep);
  CHECK_EQ_INT(atomic_load(&srv_accepts), 0); /* nothing reached the server */
  session_end(e, &a);
  server_stop();
  egress_shutdown();
}

static void private_refused_without_allow_private(void) {
  init_broker(PRIV_NONE, 64);
  struct agent a;
  struct egress *e = session("allow", "[\"good.test\", \"ten.test\", \"re.test\"]", "priv1", &a);
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "good.test", 9, 1), NULL, NULL), RCODE_NXDOMAIN);
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "ten.test", 8, 1), NULL, NULL), RCODE_NXDOMAIN);
  json_t *rep = egress_report(e, false);
  json_t *dns = json_object_get(rep, "dns_queries");
  CHECK_STREQ(str_of(json_array_get(dns, 0), "reason"), "loopback address");
  CHECK_STREQ(str_of(json_array_get(dns, 1), "reason"), "private address");
  json_decref(rep);
  /* Rebinding: the name was public when the sandbox asked, it is loopback
   * when it connects; the connect resolves the name again (the hosts file
   * is re-read when it changed), never from what the sandbox was told. */
  write_hosts("1.1.1.1 re.test\n");
  uint8_t addr[4];
  if (resolve(&a, "re.test", addr)) {
    write_hosts("127.0.0.1 re.test\n");
    uint32_t sid = ag_open(&a, addr, 80);
    struct frame *f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
    CHECK(f != NULL);
    free(f);
    static const char req[] = "GET / HTTP/1.1\r\nHost: re.test\r\n\r\n";
    ag_simple(&a, PROTO_STREAM_DATA, sid, req, sizeof req - 1);
    char msg[128];
    CHECK_EQ_INT(reset_of(&a, sid, msg, sizeof msg), ECONNREFUSED);
    CHECK_STREQ(msg, "loopback address");
    rep = egress_report(e, false);
    json_t *ev = last_of(rep, "denied");
    CHECK_STREQ(str_of(ev, "reason"), "loopback address");
    CHECK_STREQ(str_of(ev, "ip"), "127.0.0.1");
    json_decref(rep);
  }
  write_hosts("127.0.0.1 good.test\n10.0.0.5 ten.test\n");
  session_end(e, &a);
  egress_shutdown();
}

static void too_many_connections(void) {
  init_broker(PRIV_HOST, 2);
  struct agent a;
  struct egress *e = session("allow", "[\"good.test\"]", "many1", &a);
  uint8_t addr[4];
  if (resolve(&a, "good.test", addr)) {
    uint32_t s1 = ag_open(&a, addr, 80), s2 = ag_open(&a, addr, 443);
    for (int i = 0; i < 2; i++) {
      struct frame *f = agent_expect(&a, i ? s2 : s1, PROTO_STREAM_ACCEPT, 5000);
      CHECK(f != NULL);
      free(f);
    }
    check_reset(&a, addr, 80, "too many connections");
    ag_simple(&a, PROTO_STREAM_RESET, s1, NULL, 0); /* the program gave one up */
    usleep(100000);
    uint32_t s3 = ag_open(&a, addr, 80);
    struct frame *f = agent_expect(&a, s3, PROTO_STREAM_ACCEPT, 5000);
    CHECK(f != NULL);
    free(f);
  }
  session_end(e, &a);
  egress_shutdown();
}

static void mode_none_refuses_everything(void) {
  init_broker(PRIV_HOST, 64);
  struct agent a;
  struct egress *e = session("none", NULL, "none1", &a);
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "good.test", 9, 1), NULL, NULL), RCODE_NXDOMAIN);
  check_reset(&a, (uint8_t[4]){93, 184, 216, 34}, 443, "network is none");
  json_t *rep = egress_report(e, false);
  CHECK_STREQ(str_of(last_of(rep, "dns_queries"), "reason"), "network is none");
  CHECK_STREQ(str_of(last_of(rep, "denied"), "reason"), "network is none");
  json_decref(rep);
  session_end(e, &a);
  egress_shutdown();
}

static void dns_rate_limited(void) {
  init_broker(PRIV_HOST, 64);
  struct agent a;
  struct egress *e = session("allow", "[\"good.test\"]", "rate1", &a);
  uint32_t ids[250];
  for (size_t i = 0; i < ARRAY_SIZE(ids); i++)
    ids[i] = ag_lookup(&a, "evil.example", 12, 1);
  unsigned refused = 0, first_refused = 0;
  for (size_t i = 0; i < ARRAY_SIZE(ids); i++) {
    int rc = lookup_rcode(&a, ids[i], NULL, NULL);
    if (rc == RCODE_REFUSED && !refused++)
      first_refused = (unsigned)i;
  }
  CHECK(refused >= 20 && refused <= 50); /* 200 in the bucket, some refill while we send */
  CHECK(first_refused >= 200);
  json_t *rep = egress_report(e, false);
  CHECK_EQ_INT(json_integer_value(json_object_get(rep, "dns_refused_by_rate")), refused);
  /* The first refusal of the second is an event (the rest are counted):
   * the refill may admit a later query again. */
  json_t *dns = json_object_get(rep, "dns_queries");
  size_t rate_events = 0;
  for (size_t i = 0; i < json_array_size(dns); i++)
    rate_events += strcmp(str_of(json_array_get(dns, i), "reason"), "query rate") == 0;
  CHECK(rate_events >= 1 && rate_events <= 2);
  json_decref(rep);
  session_end(e, &a);
  egress_shutdown();
}

static void report_since_last_and_log(void) {
  init_broker(PRIV_HOST, 64);
  struct agent a;
  struct egress *e = session("allow", "[\"good.test\"]", "rep1", &a);
  resolve(&a, "good.test", (uint8_t[4]){0});
  check_reset(&a, (uint8_t[4]){93, 184, 216, 34}, 443, "IP address not in allow_hosts");
  json_t *rep = egress_report(e, true);
  static const char *keys[] = {"mode", "allowed_rules", "allowed", "denied", "dns_queries",
                               "total_events", "truncated", "egress_log_path"};
  for (size_t i = 0; i < ARRAY_SIZE(keys); i++)
    CHECK(json_object_get(rep, keys[i]) != NULL);
  CHECK_STREQ(str_of(rep, "mode"), "allow");
  CHECK_EQ_INT(json_integer_value(json_object_get(rep, "total_events")), 2);
  CHECK(json_is_false(json_object_get(rep, "truncated")));
  char path[192];
  snprintf(path, sizeof path, "%s/rep1.egress.jsonl", tmp);
  CHECK_STREQ(str_of(rep, "egress_log_path"), path);
  json_decref(rep);
  rep = egress_report(e, true); /* nothing since */
  CHECK_EQ_INT(json_integer_value(json_object_get(rep, "total_events")), 0);
  CHECK_EQ_INT(json_array_size(json_object_get(rep, "dns_queries")), 0);
  CHECK_EQ_INT(json_array_size(json_object_get(rep, "denied")), 0);
  json_decref(rep);
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "x.example", 9, 1), NULL, NULL), RCODE_NXDOMAIN);
  rep = egress_report(e, true);
  CHECK_EQ_INT(json_integer_value(json_object_get(rep, "total_events")), 1);
  CHECK_STREQ(str_of(last_of(rep, "dns_queries"), "name"), "x.example");
  json_decref(rep);
  rep = egress_report(e, false); /* the whole session */
  CHECK_EQ_INT(json_integer_value(json_object_get(rep, "total_events")), 3);
  CHECK_EQ_INT(json_array_size(json_object_get(rep, "dns_queries")), 2);
  json_decref(rep);
  /* More than EGRESS_REPORT_MAX: the latest are kept, truncated says so. */
  for (unsigned i = 0; i < EGRESS_REPORT_MAX + 6; i++) {
    char name[32];
    snprintf(name, sizeof name, "n%u.example", i);
    CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, name, strlen(name), 1), NULL, NULL), RCODE_NXDOMAIN);
  }
  rep = egress_report(e, true);
  CHECK_EQ_INT(json_array_size(json_object_get(rep, "dns_queries")), EGRESS_REPORT_MAX);
  CHECK(json_is_true(json_object_get(rep, "truncated")));
  CHECK_EQ_INT(json_integer_value(json_object_get(rep, "total_events")), EGRESS_REPORT_MAX + 6);
  char want[32];
  snprintf(want, sizeof want, "n%u.example", EGRESS_REPORT_MAX + 5);
  CHECK_STREQ(str_of(last_of(rep, "dns_queries"), "name"), want);
  json_decref(rep);
  session_end(e, &a); /* flushes the log */
  struct stat st;
  CHECK_EQ_INT(stat(path, &st), 0);
  CHECK_EQ_INT(st.st_mode & 0777, 0600);
  FILE *f = fopen(path, "r");
  char line[2048];
  unsigned lines = 0, dns = 0, connects = 0;
  while (f && fgets(line, sizeof line, f)) {
    json_t *o = json_loads(line, 0, NULL);
    CHECK(o != NULL);
    lines++;
    dns += strcmp(str_of(o, "kind") ? str_of(o, "kind") : "", "dns") == 0;
    if (strcmp(str_of(o, "kind") ? str_of(o, "kind") : "", "connect") == 0) {
      connects++;
      CHECK_STREQ(str_of(o, "reason"), "IP address not in allow_hosts");
      CHECK(json_is_false(json_object_get(o, "allowed")));
      CHECK(json_is_integer(json_object_get(o, "bytes_up")));
      CHECK(json_is_integer(json_object_get(o, "duration_ms")));
    }
    json_decref(o);
  }
  if (f)
    fclose(f);
  CHECK_EQ_INT(connects, 1);
  CHECK_EQ_INT(dns, 2 + EGRESS_REPORT_MAX + 6);
  CHECK_EQ_INT(lines, connects + dns);
  egress_shutdown();
}


/* ---- names under a wildcard rule ---------------------------------------- */

/* The last dns_queries entry of E's whole record. */
static void check_last_dns(struct egress *e, const char *name, const char *reason_has) {
  json_t *rep = egress_report(e, false);
  json_t *q = last_of(rep, "dns_queries");
  CHECK_STREQ(str_of(q, "name"), name);
  CHECK(json_is_false(json_object_get(q, "allowed")));
  const char *why = str_of(q, "reason");
  CHECK(why && strstr(why, reason_has));
  if (!why || !strstr(why, reason_has))
    fprintf(stderr, "  %s refused for \"%s\", expected \"%s\"\n", name, why ? why : "(none)",
            reason_has);
  json_decref(rep);
}

/* A session may look up IGN_MCP_EGRESS_WILDCARD_NAMES distinct names under
 * each *.suffix rule (each would reach that domain's servers); then
 * NXDOMAIN, recorded with a reason naming the setting.  A name asked again
 * (any type) costs nothing; a name listed exactly is never counted; each
 * rule has its own count, each session too; a fork goes on with its
 * source's. */
static void wildcard_names_capped(void) {
  write_hosts("127.0.0.1 good.test a.w.test b.w.test c.w.test d.w.test x.w.test a.v.test\n");
  wildcard_names = 3;
  init_broker(PRIV_HOST, 64);
  struct agent a, b;
  const char *allow = "[\"*.w.test\", \"*.v.test\", \"x.w.test\"]";
  struct egress *e = session("allow", allow, "wild1", &a);
  uint8_t addr[4];
  resolve(&a, "a.w.test", addr);
  resolve(&a, "b.w.test", addr);
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "c.w.test", 8, 28), NULL, NULL), RCODE_NOERROR);
  resolve(&a, "A.w.test.", addr); /* the same name again */
  resolve(&a, "c.w.test", addr);  /* asked before as AAAA */
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "d.w.test", 8, 1), NULL, NULL), RCODE_NXDOMAIN);
  check_last_dns(e, "d.w.test", "over 3 names under one wildcard rule (IGN_MCP_EGRESS_WILDCARD_NAMES)");
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "e.w.test", 8, 28), NULL, NULL), RCODE_NXDOMAIN);
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "q.e.w.test", 10, 1), NULL, NULL), RCODE_NXDOMAIN);
  check_last_dns(e, "q.e.w.test", "IGN_MCP_EGRESS_WILDCARD_NAMES");
  resolve(&a, "b.w.test", addr); /* still answered */
  resolve(&a, "x.w.test", addr); /* listed exactly */
  resolve(&a, "a.v.test", addr); /* another rule */
  /* A fork goes on with its source's count. */
  struct egress *c = NULL;
  CHECK_EQ_INT(egress_clone(e, &c), 0);
  if (c) {
    egress_set_session(c, "wildfork", "");
    agent_start(&b);
    egress_attach(c, b.c, NULL, NULL);
    resolve(&b, "b.w.test", addr);
    CHECK_EQ_INT(lookup_rcode(&b, ag_lookup(&b, "d.w.test", 8, 1), NULL, NULL), RCODE_NXDOMAIN);
    check_last_dns(c, "d.w.test", "IGN_MCP_EGRESS_WILDCARD_NAMES");
    session_end(c, &b);
  }
  /* Another session counts its own. */
  struct egress *f = session("allow", allow, "wild2", &b);
  resolve(&b, "d.w.test", addr);
  session_end(f, &b);
  session_end(e, &a);
  egress_shutdown();
  wildcard_names = 0;
  write_hosts("# test names\n127.0.0.1 good.test\n10.0.0.5 ten.test\n");
}

/* ---- a flood of refusals ------------------------------------------------- */

/* The value of KEY in O as an integer (-1 when absent). */
static long long int_of(json_t *o, const char *key) {
  json_t *v = json_object_get(o, key);
  return json_is_integer(v) ? json_integer_value(v) : -1;
}

/* The count of DEST refused for REASON in COUNTS (denied_counts), -1 if absent. */
static long long count_of(json_t *counts, const char *kind, const char *dest, const char *reason) {
  for (size_t i = 0; i < json_array_size(counts); i++) {
    json_t *c = json_array_get(counts, i);
    const char *k = str_of(c, "kind"), *d = str_of(c, "destination"), *r = str_of(c, "reason");
    if (k && strcmp(k, kind) == 0 && (!dest || (d && strcmp(d, dest) == 0)) &&
        (!reason || (r && strcmp(r, reason) == 0)))
      return int_of(c, "count");
  }
  return -1;
}

/* One refused connect to 10.1.2.3:1, then FLOOD to 10.1.2.3:2: network_log
 * still lists the first (and the latest), says how many it left out, and
 * counts each destination and reason whatever the flood; a run's report
 * keeps its own first ones.  The log, cut at a small cap, carries the
 * counts in its truncated line and ends with a summary of them. */
static void refusals_survive_a_flood(void) {
  enum { FLOOD = 120 };
  log_cap = 4096;
  init_broker(PRIV_HOST, 64);
  struct agent a;
  struct egress *e = session("none", NULL, "flood1", &a);
  check_reset(&a, (uint8_t[4]){10, 1, 2, 3}, 1, "network is none");
  json_t *rep = egress_report(e, true);
  json_decref(rep);
  for (unsigned i = 0; i < FLOOD; i++)
    check_reset(&a, (uint8_t[4]){10, 1, 2, 3}, 2, "network is none");
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "x.example", 9, 1), NULL, NULL), RCODE_NXDOMAIN);
  /* The whole session. */
  rep = egress_report(e, false);
  json_t *denied = json_object_get(rep, "denied");
  CHECK_EQ_INT(json_array_size(denied), EGRESS_REPORT_MAX);
  CHECK_EQ_INT(int_of(json_array_get(denied, 0), "port"), 1);
  CHECK_EQ_INT(int_of(last_of(rep, "denied"), "port"), 2);
  CHECK_EQ_INT(int_of(rep, "denied_total"), FLOOD + 1);
  CHECK_EQ_INT(int_of(rep, "denied_omitted"), FLOOD + 1 - EGRESS_REPORT_MAX);
  CHECK(json_is_true(json_object_get(rep, "truncated")));
  json_t *counts = json_object_get(rep, "denied_counts");
  CHECK_EQ_INT(count_of(counts, "connect", "10.1.2.3:1", "network is none"), 1);
  CHECK_EQ_INT(count_of(counts, "connect", "10.1.2.3:2", "network is none"), FLOOD);
  CHECK_EQ_INT(count_of(counts, "dns", "x.example", "network is none"), 1);
  json_decref(rep);
  /* Since the first report: the flood's own first one leads. */
  rep = egress_report(e, true);
  denied = json_object_get(rep, "denied");
  CHECK_EQ_INT(json_array_size(denied), EGRESS_REPORT_MAX);
  CHECK_EQ_INT(int_of(json_array_get(denied, 0), "port"), 2);
  CHECK_EQ_INT(int_of(rep, "denied_total"), FLOOD);
  CHECK_EQ_INT(int_of(rep, "denied_omitted"), FLOOD - EGRESS_REPORT_MAX);
  CHECK(json_object_get(rep, "denied_counts") == NULL); /* network_log's */
  json_decref(rep);
  /* Past 64 destinations of a kind, the rest is one count; made-up names
   * do not take the connects' room. */
  for (unsigned i = 0; i < 70; i++) {
    char name[32];
    snprintf(name, sizeof name, "f%u.example", i);
    CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, name, strlen(name), 1), NULL, NULL), RCODE_NXDOMAIN);
  }
  for (unsigned i = 0; i < 70; i++)
    check_reset(&a, (uint8_t[4]){10, 1, 3, (uint8_t)i}, 443, "network is none");
  rep = egress_report(e, false);
  counts = json_object_get(rep, "denied_counts");
  CHECK_EQ_INT(json_array_size(counts), 64 + 64 + 1);
  CHECK_EQ_INT(count_of(counts, "other", NULL, NULL), (72 - 64) + (71 - 64));
  CHECK_EQ_INT(count_of(counts, "connect", "10.1.2.3:1", "network is none"), 1);
  CHECK_EQ_INT(count_of(counts, "connect", "10.1.3.0:443", "network is none"), 1);
  CHECK_EQ_INT(count_of(counts, "dns", "f0.example", "network is none"), 1);
  json_decref(rep);
  char path[192];
  snprintf(path, sizeof path, "%s/flood1.egress.jsonl", tmp);
  session_end(e, &a); /* flushes the log, and ends it */
  FILE *f = fopen(path, "r");
  CHECK(f != NULL);
  char *line = NULL, *last = NULL;
  size_t cap = 0;
  bool cut_counts = false;
  while (f && getline(&line, &cap, f) > 0) {
    free(last);
    last = strdup(line);
    json_t *o = json_loads(line, 0, NULL);
    if (strcmp(str_of(o, "kind") ? str_of(o, "kind") : "", "truncated") == 0)
      cut_counts = count_of(json_object_get(o, "denied_counts"), "connect", "10.1.2.3:1",
                            "network is none") == 1;
    json_decref(o);
  }
  if (f)
    fclose(f);
  free(line);
  CHECK(cut_counts);
  json_t *sum = last ? json_loads(last, 0, NULL) : NULL;
  CHECK_STREQ(str_of(sum, "kind"), "summary");
  counts = json_object_get(sum, "denied_counts");
  CHECK_EQ_INT(count_of(counts, "connect", "10.1.2.3:2", "network is none"), FLOOD);
  CHECK_EQ_INT(count_of(counts, "other", NULL, NULL), (72 - 64) + (71 - 64));
  CHECK_EQ_INT(int_of(sum, "denied_total"), FLOOD + 1 + 70);
  if (!sum || strcmp(str_of(sum, "kind") ? str_of(sum, "kind") : "", "summary") != 0)
    fprintf(stderr, "  the log's last line: %s", last ? last : "(none)\n");
  json_decref(sum);
  free(last);
  egress_shutdown();
  log_cap = 0;
}

/* ---- in a network of its own -------------------------------------------- */

static bool write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  bool ok = f && fputs(text, f) >= 0;
  if (f)
    ok = fclose(f) == 0 && ok;
  return ok;
}

/* New user, network and mount namespaces for this (single-threaded) child,
 * lo up, mounts private.  NULL, or why not. */
static const char *netns_enter(void) {
  uid_t uid = getuid();
  gid_t gid = getgid();
  if (unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS) < 0)
    return "cannot make user, network and mount namespaces (unshare)";
  char map[64];
  snprintf(map, sizeof map, "0 %u 1", (unsigned)uid);
  if (!write_file("/proc/self/setgroups", "deny") || !write_file("/proc/self/uid_map", map))
    return "cannot map our uid in the user namespace";
  snprintf(map, sizeof map, "0 %u 1", (unsigned)gid);
  if (!write_file("/proc/self/gid_map", map))
    return "cannot map our gid in the user namespace";
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    return "cannot make the mounts private";
  int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct ifreq ifr = {0};
  snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
  bool ok = s >= 0 && ioctl(s, SIOCGIFFLAGS, &ifr) == 0;
  ifr.ifr_flags |= IFF_UP;
  ok = ok && ioctl(s, SIOCSIFFLAGS, &ifr) == 0;
  if (s >= 0)
    close(s);
  return ok ? NULL : "cannot bring lo up in the network namespace";
}

/* Runs FN in a child in namespaces of its own; its failed checks fail the
 * test here.  The child ends with _exit: resolver workers it leaves stuck
 * in getaddrinfo go with it. */
static void in_netns(const char *name, void (*fn)(void)) {
  fflush(stdout);
  fflush(stderr);
  int before = test_failures_;
  pid_t pid = fork();
  if (pid == 0) {
    const char *why = netns_enter();
    if (why) {
      fprintf(stderr, "  # skip %s: %s\n", name, why);
      _exit(77);
    }
    fn();
    fflush(stderr);
    _exit(test_failures_ > before ? 1 : 0);
  }
  int st = 0;
  CHECK(pid > 0 && waitpid(pid, &st, 0) == pid);
  if (WIFEXITED(st) && WEXITSTATUS(st) == 77)
    return;
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  if (!WIFEXITED(st))
    fprintf(stderr, "  %s: the child ended by signal %d\n", name, WTERMSIG(st));
}

/* Binds FILE's text over TARGET in this mount namespace. */
static bool bind_text(const char *file, const char *text, const char *target) {
  if (!write_file(file, text) || mount(file, target, NULL, MS_BIND, NULL) < 0) {
    fprintf(stderr, "  cannot put %s over %s: %s\n", file, target, strerror(errno));
    return false;
  }
  return true;
}

/* Gives lo the address IP/32 too: an address of "the host" that is not
 * loopback. */
static bool lo_alias(const char *ip) {
  int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct ifreq ifr = {0};
  snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo:1");
  struct sockaddr_in *in = (struct sockaddr_in *)&ifr.ifr_addr;
  in->sin_family = AF_INET;
  inet_pton(AF_INET, ip, &in->sin_addr);
  bool ok = s >= 0 && ioctl(s, SIOCSIFADDR, &ifr) == 0;
  /* /32: on lo a prefix would make every address in it local. */
  inet_pton(AF_INET, "255.255.255.255", &in->sin_addr);
  ok = ok && ioctl(s, SIOCSIFNETMASK, &ifr) == 0;
  if (!ok)
    fprintf(stderr, "  cannot give lo the address %s: %s\n", ip, strerror(errno));
  if (s >= 0)
    close(s);
  return ok;
}

/* ---- the resolver under a flood ------------------------------------------ */

/* Session A asks for names whose DNS server never answers (a resolv.conf
 * naming a UDP socket that reads nothing), as fast as it may; session B's
 * name pinned by the hosts file, and a name the host's /etc/hosts knows
 * (which goes through the pool), still resolve and connect at once.  A has
 * at most EGRESS_RESOLVE_JOBS_MAX resolutions out: the rest are REFUSED
 * "resolver busy"; a timed-out name is not asked again for a while; jobs A
 * gave up on before a worker took them leave the queue (A may ask again). */
static void flood_child(void) {
  char path[192], etc_hosts[192];
  snprintf(path, sizeof path, "%s/resolv.conf", tmp);
  snprintf(etc_hosts, sizeof etc_hosts, "%s/etc_hosts", tmp);
  int dns_fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in in = {.sin_family = AF_INET, .sin_port = htons(53),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (dns_fd < 0 || bind(dns_fd, (struct sockaddr *)&in, sizeof in) < 0) {
    CHECK(!"cannot bind the silent DNS server to 127.0.0.1:53");
    return;
  }
  if (!bind_text(path, "nameserver 127.0.0.1\noptions timeout:30 attempts:1\n", "/etc/resolv.conf") ||
      !bind_text(etc_hosts, "127.0.0.1 localhost\n127.0.0.1 fast.test\n", "/etc/hosts")) {
    CHECK(!"cannot set up the resolver");
    return;
  }
  init_broker(PRIV_HOST, 64);
  server_start();
  char allow[96];
  snprintf(allow, sizeof allow, "[\"good.test:%u\", \"fast.test:%u\"]", srv.port, srv.port);
  struct agent a, b;
  struct egress *ea = session("allow", "[\"*.slow.test\"]", "floodA", &a);
  struct egress *eb = session("allow", allow, "floodB", &b);
  enum { N = EGRESS_RESOLVE_JOBS_MAX + 4 };
  uint32_t ids[N];
  char name[64];
  for (unsigned i = 0; i < N; i++) {
    snprintf(name, sizeof name, "n%u.slow.test", i);
    ids[i] = ag_lookup(&a, name, strlen(name), 1);
  }
  for (unsigned i = EGRESS_RESOLVE_JOBS_MAX; i < N; i++)
    CHECK_EQ_INT(lookup_rcode(&a, ids[i], NULL, NULL), RCODE_REFUSED);
  /* B, meanwhile: the pinned name, then one the pool resolves. */
  static const char *names[] = {"good.test", "fast.test"};
  for (size_t k = 0; k < ARRAY_SIZE(names); k++) {
    uint64_t t0 = mono_ms();
    uint8_t addr[4];
    if (!resolve(&b, names[k], addr))
      continue;
    uint32_t sid = ag_open(&b, addr, srv.port);
    struct frame *f = agent_expect(&b, sid, PROTO_STREAM_ACCEPT, 5000);
    CHECK(f != NULL);
    free(f);
    ag_simple(&b, PROTO_STREAM_DATA, sid, "ping\n", 5); /* a bare word may start a request */
    f = agent_expect(&b, sid, PROTO_STREAM_DATA, 5000);
    CHECK(f && f->h.len == 5 && memcmp(f->p, "ping\n", 5) == 0);
    free(f);
    uint64_t took = mono_ms() - t0;
    CHECK(took < 2000);
    if (took >= 2000)
      fprintf(stderr, "  %s took %llu ms to resolve and connect\n", names[k],
              (unsigned long long)took);
    ag_simple(&b, PROTO_STREAM_RESET, sid, NULL, 0);
  }
  /* A's first ones wait (nothing answered them yet), then time out. */
  struct frame *early = agent_wait(&a, ids[0], 0);
  CHECK(early == NULL);
  free(early);
  for (unsigned i = 0; i < EGRESS_RESOLVE_JOBS_MAX; i++) /* EGRESS_RESOLVE_MS, and slack */
    CHECK_EQ_INT(lookup_rcode_within(&a, ids[i], NULL, NULL, 10000), RCODE_SERVFAIL);
  json_t *rep = egress_report(ea, false);
  json_t *dns = json_object_get(rep, "dns_queries");
  unsigned busy = 0, timed_out = 0;
  for (size_t i = 0; i < json_array_size(dns); i++) {
    const char *why = str_of(json_array_get(dns, i), "reason");
    busy += why && strcmp(why, "resolver busy") == 0;
    timed_out += why && strcmp(why, "resolve timed out") == 0;
  }
  CHECK_EQ_INT(busy, N - EGRESS_RESOLVE_JOBS_MAX);
  CHECK_EQ_INT(timed_out, EGRESS_RESOLVE_JOBS_MAX);
  json_decref(rep);
  /* n0 held a worker all that time: asked again, it fails at once. */
  uint64_t t0 = mono_ms();
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "n0.slow.test", 12, 1), NULL, NULL), RCODE_SERVFAIL);
  CHECK(mono_ms() - t0 < 1000);
  /* The jobs no worker had started left with their lookups: A has only
   * the ones still stuck in a worker out, and may ask that many fewer. */
  for (unsigned i = 0; i < EGRESS_RESOLVE_JOBS_MAX; i++) {
    snprintf(name, sizeof name, "m%u.slow.test", i);
    ids[i] = ag_lookup(&a, name, strlen(name), 1);
  }
  usleep(500 * 1000); /* the refusals come at once, the others not for seconds */
  unsigned refused = 0;
  for (unsigned i = 0; i < EGRESS_RESOLVE_JOBS_MAX; i++) {
    struct frame *f = agent_wait(&a, ids[i], 0);
    refused += f != NULL;
    free(f);
  }
  /* n0 and n1 hold the two general workers A may have: 2 out. */
  CHECK_EQ_INT(refused, 2);
  if (refused != 2)
    fprintf(stderr, "  %u of A's new lookups were refused at once\n", refused);
  session_end(ea, &a);
  session_end(eb, &b);
  server_stop();
  egress_shutdown();
}

static void resolver_flood_spares_other_sessions(void) {
  in_netns("resolver_flood_spares_other_sessions", flood_child);
}


/* ---- the DNS cache, per owner -------------------------------------------- */

/* A DNS server on 127.0.0.1:53 that answers every query NXDOMAIN and counts
 * them. */
static struct {
  int fd;
  atomic_int queries;
  atomic_bool stop;
  pthread_t thread;
} dnsd;

static void *dnsd_main(void *arg) {
  (void)arg;
  uint8_t buf[1500];
  while (!atomic_load(&dnsd.stop)) {
    struct pollfd p = {.fd = dnsd.fd, .events = POLLIN};
    if (poll(&p, 1, 50) <= 0)
      continue;
    struct sockaddr_in from;
    socklen_t fl = sizeof from;
    ssize_t n = recvfrom(dnsd.fd, buf, sizeof buf, 0, (struct sockaddr *)&from, &fl);
    if (n < 12)
      continue;
    atomic_fetch_add(&dnsd.queries, 1);
    buf[2] |= 0x80;        /* a response */
    buf[3] = 0x80 | 3;     /* recursion available, NXDOMAIN */
    sendto(dnsd.fd, buf, (size_t)n, 0, (struct sockaddr *)&from, fl);
  }
  return NULL;
}

/* The host's answers are cached per owner: a sandbox of "bob" asking for a
 * name a sandbox of "alice" just looked up makes the host ask its DNS
 * server again (no quick answer tells bob what alice asked), while
 * another session of alice's is answered from her cache.  And a name past
 * the wildcard cap is never asked of the DNS server. */
static void cache_child(void) {
  char path[192], etc_hosts[192];
  snprintf(path, sizeof path, "%s/resolv.conf.cache", tmp);
  snprintf(etc_hosts, sizeof etc_hosts, "%s/etc_hosts.cache", tmp);
  dnsd.fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in in = {.sin_family = AF_INET, .sin_port = htons(53),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (dnsd.fd < 0 || bind(dnsd.fd, (struct sockaddr *)&in, sizeof in) < 0) {
    CHECK(!"cannot bind the DNS server to 127.0.0.1:53");
    return;
  }
  if (!bind_text(path, "nameserver 127.0.0.1\noptions timeout:2 attempts:1\n", "/etc/resolv.conf") ||
      !bind_text(etc_hosts, "127.0.0.1 localhost\n", "/etc/hosts")) {
    CHECK(!"cannot set up the resolver");
    return;
  }
  atomic_store(&dnsd.stop, false);
  pthread_create(&dnsd.thread, NULL, dnsd_main, NULL);
  wildcard_names = 2; /* this child's */
  init_broker(PRIV_HOST, 64);
  struct agent a1, a2, b;
  const char *allow = "[\"*.cache.test\"]";
  struct egress *ea1 = session_of("alice", "allow", allow, "cacheA1", &a1);
  struct egress *ea2 = session_of("alice", "allow", allow, "cacheA2", &a2);
  struct egress *eb = session_of("bob", "allow", allow, "cacheB", &b);
  CHECK_EQ_INT(lookup_rcode(&a1, ag_lookup(&a1, "x.cache.test", 12, 1), NULL, NULL), RCODE_NXDOMAIN);
  int asked = atomic_load(&dnsd.queries);
  CHECK(asked > 0);
  CHECK_EQ_INT(lookup_rcode(&a2, ag_lookup(&a2, "x.cache.test", 12, 1), NULL, NULL), RCODE_NXDOMAIN);
  CHECK_EQ_INT(atomic_load(&dnsd.queries), asked); /* alice's cache */
  CHECK_EQ_INT(lookup_rcode(&b, ag_lookup(&b, "x.cache.test", 12, 1), NULL, NULL), RCODE_NXDOMAIN);
  CHECK(atomic_load(&dnsd.queries) > asked); /* bob's own question */
  if (atomic_load(&dnsd.queries) <= asked)
    fprintf(stderr, "  bob's lookup was answered from alice's cache (%d queries)\n", asked);
  asked = atomic_load(&dnsd.queries);
  CHECK_EQ_INT(lookup_rcode(&b, ag_lookup(&b, "x.cache.test", 12, 1), NULL, NULL), RCODE_NXDOMAIN);
  CHECK_EQ_INT(atomic_load(&dnsd.queries), asked); /* bob's cache now */
  /* Past IGN_MCP_EGRESS_WILDCARD_NAMES (2 here), a name under the
   * wildcard never reaches the DNS server. */
  asked = atomic_load(&dnsd.queries);
  CHECK_EQ_INT(lookup_rcode(&b, ag_lookup(&b, "y.cache.test", 12, 1), NULL, NULL), RCODE_NXDOMAIN);
  CHECK(atomic_load(&dnsd.queries) > asked);
  asked = atomic_load(&dnsd.queries);
  CHECK_EQ_INT(lookup_rcode(&b, ag_lookup(&b, "z.cache.test", 12, 1), NULL, NULL), RCODE_NXDOMAIN);
  CHECK_EQ_INT(atomic_load(&dnsd.queries), asked);
  check_last_dns(eb, "z.cache.test", "over 2 names under one wildcard rule");
  session_end(ea1, &a1);
  session_end(ea2, &a2);
  session_end(eb, &b);
  egress_shutdown();
  atomic_store(&dnsd.stop, true);
  pthread_join(dnsd.thread, NULL);
  close(dnsd.fd);
}

static void dns_cache_per_owner(void) { in_netns("dns_cache_per_owner", cache_child); }

/* ---- the host's own addresses -------------------------------------------- */

/* lo gets 10.9.8.7 too, and a server listens on every address: that is the
 * host itself, not a private network, whatever IGN_MCP_NET_PRIVATE=1 lets
 * through; =host lets it through. */
static void own_address_child(void) {
  /* This child's own hosts file (the parent's stays as it is). */
  snprintf(hosts_path, sizeof hosts_path, "%s/hosts_own", tmp);
  if (!lo_alias("10.9.8.7") ||
      !write_file(hosts_path, "127.0.0.1 good.test\n10.9.8.7 own.test\n10.1.2.3 ten.test\n")) {
    CHECK(!"cannot set up the network");
    return;
  }
  server_start_on(INADDR_ANY);
  char allow[128];
  snprintf(allow, sizeof allow, "[\"good.test:%u\", \"own.test:%u\", \"ten.test:%u\"]", srv.port,
           srv.port, srv.port);
  init_broker(PRIV_ONE, 64);
  struct agent a;
  struct egress *e = session("allow", allow, "own1", &a);
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "own.test", 8, 1), NULL, NULL), RCODE_NXDOMAIN);
  CHECK_EQ_INT(lookup_rcode(&a, ag_lookup(&a, "good.test", 9, 1), NULL, NULL), RCODE_NXDOMAIN);
  uint8_t addr[4];
  resolve(&a, "ten.test", addr); /* private, not the host's: allowed */
  json_t *rep = egress_report(e, false);
  json_t *dns = json_object_get(rep, "dns_queries");
  CHECK_STREQ(str_of(json_array_get(dns, 0), "reason"), "the host's own address");
  CHECK_STREQ(str_of(json_array_get(dns, 1), "reason"), "loopback address");
  CHECK(json_is_true(json_object_get(json_array_get(dns, 2), "allowed")));
  json_decref(rep);
  session_end(e, &a);
  /* Open mode: the raw address is refused before anything is connected. */
  e = session("open", NULL, "own2", &a);
  check_reset(&a, (uint8_t[4]){10, 9, 8, 7}, srv.port, "the host's own address");
  check_reset(&a, (uint8_t[4]){127, 0, 0, 1}, srv.port, "loopback address");
  session_end(e, &a);
  egress_shutdown();
  CHECK_EQ_INT(atomic_load(&srv_accepts), 0);
  /* IGN_MCP_NET_PRIVATE=host: the same name reaches the server. */
  init_broker(PRIV_HOST, 64);
  e = session("allow", allow, "own3", &a);
  if (resolve(&a, "own.test", addr)) {
    uint32_t sid = ag_open(&a, addr, srv.port);
    struct frame *f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
    CHECK(f != NULL);
    free(f);
    ag_simple(&a, PROTO_STREAM_DATA, sid, "hi\n", 3);
    f = agent_expect(&a, sid, PROTO_STREAM_DATA, 5000);
    CHECK(f && f->h.len == 3);
    free(f);
  }
  CHECK_EQ_INT(atomic_load(&srv_accepts), 1);
  session_end(e, &a);
  egress_shutdown();
  server_stop();
}

static void host_own_address_refused(void) {
  in_netns("host_own_address_refused", own_address_child);
}

/* ---- the peek on ports a rule names ---------------------------------------- */

/* "good.test:*" names 443 and 80 too: they are web ports still, and a
 * program that sends nothing is not connected after 500 ms; its
 * ClientHello or request then names the host or is refused. */
static void web_ports_always_peeked(void) {
  init_broker(PRIV_HOST, 64);
  struct agent a;
  struct egress *e = session("allow", "[\"good.test:*\"]", "webport1", &a);
  uint8_t addr[4];
  if (resolve(&a, "good.test", addr)) {
    uint32_t s443 = ag_open(&a, addr, 443), s80 = ag_open(&a, addr, 80);
    for (int i = 0; i < 2; i++) {
      struct frame *f = agent_expect(&a, i ? s80 : s443, PROTO_STREAM_ACCEPT, 5000);
      CHECK(f != NULL);
      free(f);
    }
    usleep(1200 * 1000); /* over EGRESS_FIRST_BYTE_MS */
    for (int i = 0; i < 2; i++) {
      struct frame *f = agent_wait(&a, i ? s80 : s443, 0);
      CHECK(f == NULL); /* no connect was tried: nothing came */
      if (f)
        fprintf(stderr, "  port %d: %s came\n", i ? 80 : 443, proto_type_name(f->h.type));
      free(f);
    }
    uint8_t hello[128];
    size_t n = client_hello("evil.com", hello);
    ag_simple(&a, PROTO_STREAM_DATA, s443, hello, n);
    static const char req[] = "GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n";
    ag_simple(&a, PROTO_STREAM_DATA, s80, req, sizeof req - 1);
    char msg[128];
    CHECK_EQ_INT(reset_of(&a, s443, msg, sizeof msg), ECONNREFUSED);
    CHECK_STREQ(msg, "SNI mismatch");
    CHECK_EQ_INT(reset_of(&a, s80, msg, sizeof msg), ECONNREFUSED);
    CHECK_STREQ(msg, "Host mismatch");
    /* A request naming no host, on 80 and in plain text on 443. */
    static const char no_host[] = "GET / HTTP/1.0\r\n\r\n";
    for (int i = 0; i < 2; i++) {
      uint32_t sid = ag_open(&a, addr, i ? 80 : 443);
      struct frame *f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
      CHECK(f != NULL);
      free(f);
      ag_simple(&a, PROTO_STREAM_DATA, sid, no_host, sizeof no_host - 1);
      CHECK_EQ_INT(reset_of(&a, sid, msg, sizeof msg), ECONNREFUSED);
      CHECK_STREQ(msg, "HTTP request without Host");
    }
    json_t *rep = egress_report(e, false);
    json_t *ev = last_of(rep, "denied");
    CHECK_STREQ(str_of(ev, "reason"), "HTTP request without Host");
    CHECK_EQ_INT(json_integer_value(json_object_get(ev, "port")), 80);
    json_decref(rep);
  }
  session_end(e, &a);
  egress_shutdown();
}

/* A request naming no host: refused on a connection to a name, in open
 * mode too (the front end behind the name chooses the site); a raw address
 * open mode allows is the address, whatever it serves. */
static void host_less_request_only_on_raw_addresses(void) {
  init_broker(PRIV_HOST, 64);
  server_start();
  struct agent a;
  struct egress *e = session("open", NULL, "nohost1", &a);
  static const char no_host[] = "GET / HTTP/1.0\r\n\r\n";
  uint8_t addr[4];
  if (resolve(&a, "good.test", addr)) {
    uint32_t sid = ag_open(&a, addr, srv.port);
    struct frame *f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
    CHECK(f != NULL);
    free(f);
    ag_simple(&a, PROTO_STREAM_DATA, sid, no_host, sizeof no_host - 1);
    char msg[128];
    CHECK_EQ_INT(reset_of(&a, sid, msg, sizeof msg), ECONNREFUSED);
    CHECK_STREQ(msg, "HTTP request without Host");
    json_t *rep = egress_report(e, false);
    json_t *ev = last_of(rep, "denied");
    CHECK_STREQ(str_of(ev, "reason"), "HTTP request without Host");
    CHECK_STREQ(str_of(ev, "host"), "good.test");
    json_decref(rep);
  }
  CHECK_EQ_INT(atomic_load(&srv_accepts), 0);
  uint32_t sid = ag_open(&a, (uint8_t[4]){127, 0, 0, 1}, srv.port);
  struct frame *f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
  CHECK(f != NULL);
  free(f);
  ag_simple(&a, PROTO_STREAM_DATA, sid, no_host, sizeof no_host - 1);
  f = agent_expect(&a, sid, PROTO_STREAM_DATA, 5000); /* echoed */
  CHECK(f && f->h.len == sizeof no_host - 1 && memcmp(f->p, no_host, f->h.len) == 0);
  free(f);
  CHECK_EQ_INT(atomic_load(&srv_accepts), 1);
  session_end(e, &a);
  server_stop();
  egress_shutdown();
}

/* Another port a rule names: after 500 ms of silence the broker connects
 * (the server may speak first), but the program's first bytes are still
 * looked at before they go up. */
static void server_first_port_still_checks_the_first_bytes(void) {
  init_broker(PRIV_HOST, 64);
  server_start();
  char allow[96];
  snprintf(allow, sizeof allow, "[\"good.test:%u\"]", srv.port);
  struct agent a;
  struct egress *e = session("allow", allow, "sfirst1", &a);
  uint8_t addr[4];
  if (resolve(&a, "good.test", addr)) {
    uint32_t sid = ag_open(&a, addr, srv.port);
    struct frame *f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
    CHECK(f != NULL);
    free(f);
    CHECK(server_accepted(1, 3000)); /* connected without a byte */
    static const char req[] = "GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n";
    ag_simple(&a, PROTO_STREAM_DATA, sid, req, sizeof req - 1);
    char msg[128];
    CHECK_EQ_INT(reset_of(&a, sid, msg, sizeof msg), ECONNREFUSED);
    CHECK_STREQ(msg, "Host mismatch");
    /* The same with a ClientHello naming another host. */
    sid = ag_open(&a, addr, srv.port);
    f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
    free(f);
    CHECK(server_accepted(2, 3000));
    uint8_t hello[128];
    size_t n = client_hello("evil.com", hello);
    ag_simple(&a, PROTO_STREAM_DATA, sid, hello, n);
    CHECK_EQ_INT(reset_of(&a, sid, msg, sizeof msg), ECONNREFUSED);
    CHECK_STREQ(msg, "SNI mismatch");
    usleep(100000);
    CHECK_EQ_INT(atomic_load(&srv_bytes), 0); /* none of it reached the server */
    json_t *rep = egress_report(e, false);
    json_t *ev = last_of(rep, "denied");
    CHECK_STREQ(str_of(ev, "reason"), "SNI mismatch");
    CHECK_STREQ(str_of(ev, "sni"), "evil.com");
    CHECK_EQ_INT(json_integer_value(json_object_get(ev, "bytes_up")), 0);
    json_decref(rep);
    /* Bytes that are neither TLS nor HTTP go up. */
    sid = ag_open(&a, addr, srv.port);
    f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
    free(f);
    CHECK(server_accepted(3, 3000));
    static const char ssh[] = "SSH-2.0-test\r\n";
    ag_simple(&a, PROTO_STREAM_DATA, sid, ssh, sizeof ssh - 1);
    f = agent_expect(&a, sid, PROTO_STREAM_DATA, 5000);
    CHECK(f && f->h.len == sizeof ssh - 1 && memcmp(f->p, ssh, sizeof ssh - 1) == 0);
    free(f);
    ag_simple(&a, PROTO_STREAM_RESET, sid, NULL, 0); /* the server takes one at a time */
    /* A request behind an empty line, and a command shaped like a request
     * line to a server that did not speak first: refused, nothing up. */
    static const char *const late[] = {"\r\nGET / HTTP/1.1\r\nHost: evil.example\r\n\r\n",
                                       "EHLO x\r\n"};
    static const char *const late_why[] = {"Host mismatch", "malformed HTTP request"};
    long up = atomic_load(&srv_bytes);
    for (int i = 0; i < 2; i++) {
      sid = ag_open(&a, addr, srv.port);
      f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
      free(f);
      CHECK(server_accepted(4 + i, 3000));
      ag_simple(&a, PROTO_STREAM_DATA, sid, late[i], strlen(late[i]));
      CHECK_EQ_INT(reset_of(&a, sid, msg, sizeof msg), ECONNREFUSED);
      CHECK_STREQ(msg, late_why[i]);
    }
    usleep(100000);
    CHECK_EQ_INT(atomic_load(&srv_bytes), up);
  }
  session_end(e, &a);
  server_stop();
  egress_shutdown();
}

/* A server that speaks first (SMTP's "220" greeting) is not an HTTP server,
 * which only answers: the program's commands then go up, whatever their
 * shape.  The same command sent before the greeting is refused. */
static void server_first_greeting_lets_commands_pass(void) {
  init_broker(PRIV_HOST, 64);
  srv.greeting = "220 good.test ESMTP\r\n";
  server_start();
  char allow[96];
  snprintf(allow, sizeof allow, "[\"good.test:%u\"]", srv.port);
  struct agent a;
  struct egress *e = session("allow", allow, "sfirst2", &a);
  uint8_t addr[4];
  if (resolve(&a, "good.test", addr)) {
    static const char ehlo[] = "EHLO client.example\r\n";
    uint32_t sid = ag_open(&a, addr, srv.port);
    struct frame *f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
    CHECK(f != NULL);
    free(f);
    f = agent_expect(&a, sid, PROTO_STREAM_DATA, 5000); /* the greeting, after 500 ms */
    CHECK(f && f->h.len == strlen(srv.greeting) && memcmp(f->p, srv.greeting, f->h.len) == 0);
    free(f);
    ag_simple(&a, PROTO_STREAM_DATA, sid, ehlo, sizeof ehlo - 1);
    f = agent_expect(&a, sid, PROTO_STREAM_DATA, 5000);
    CHECK(f && f->h.len == sizeof ehlo - 1 && memcmp(f->p, ehlo, sizeof ehlo - 1) == 0);
    free(f);
    /* The program that speaks first is looked at as on any port. */
    sid = ag_open(&a, addr, srv.port);
    f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
    free(f);
    ag_simple(&a, PROTO_STREAM_DATA, sid, ehlo, sizeof ehlo - 1);
    char msg[128];
    CHECK_EQ_INT(reset_of(&a, sid, msg, sizeof msg), ECONNREFUSED);
    CHECK_STREQ(msg, "malformed HTTP request");
  }
  session_end(e, &a);
  server_stop();
  srv.greeting = NULL;
  egress_shutdown();
}

/* ---- forks ----------------------------------------------------------------- */

/* A fork's programs keep the addresses the source's DNS gave them: in the
 * clone they stand for the same names, and new names get new numbers. */
static void clone_keeps_synthetic_addresses(void) {
  init_broker(PRIV_HOST, 64);
  server_start();
  char allow[96];
  snprintf(allow, sizeof allow, "[\"good.test:%u\", \"ten.test:%u\"]", srv.port, srv.port);
  struct agent a, b;
  struct egress *e = session("allow", allow, "src1", &a);
  uint8_t ten[4] = {0}, good[4] = {0};
  resolve(&a, "ten.test", ten);
  resolve(&a, "good.test", good);
  struct egress *c = NULL;
  CHECK_EQ_INT(egress_clone(e, &c), 0);
  if (c) {
    egress_set_session(c, "fork1", "");
    agent_start(&b);
    egress_attach(c, b.c, NULL, NULL);
    uint32_t sid = ag_open(&b, good, srv.port);
    struct frame *f = agent_expect(&b, sid, PROTO_STREAM_ACCEPT, 5000);
    CHECK(f != NULL);
    free(f);
    ag_simple(&b, PROTO_STREAM_DATA, sid, "fork\n", 5);
    f = agent_expect(&b, sid, PROTO_STREAM_DATA, 5000);
    CHECK(f && f->h.len == 5 && memcmp(f->p, "fork\n", 5) == 0);
    free(f);
    uint8_t again[4] = {0};
    resolve(&b, "good.test", again);
    CHECK(memcmp(again, good, 4) == 0);
    json_t *rep = egress_report(c, false);
    CHECK_STREQ(str_of(last_of(rep, "allowed"), "host"), "good.test");
    json_decref(rep);
    session_end(c, &b);
  }
  session_end(e, &a);
  server_stop();
  egress_shutdown();
}

/* ---- the hosts file ---------------------------------------------------------- */

/* A line longer than fgets' buffer once had its tail read as a line of its
 * own (here: a comment whose tail pins tail.test); a line over the cap is
 * dropped whole. */
static void hosts_file_long_lines(void) {
  static char text[8192];
  size_t n = 0;
  n += (size_t)snprintf(text + n, sizeof text - n, "127.0.0.1 good.test\n# ");
  memset(text + n, 'x', 1021);
  n += 1021;
  n += (size_t)snprintf(text + n, sizeof text - n, " 10.0.0.6 tail.test\n10.0.0.7 long.test");
  memset(text + n, ' ', 5000);
  n += 5000;
  snprintf(text + n, sizeof text - n, "\n10.0.0.5 ten.test\n");
  write_hosts(text);
  init_broker(PRIV_HOST, 64);
  char *line = egress_policy_line();
  CHECK(strstr(line, "(2 names)"));
  if (!strstr(line, "(2 names)"))
    fprintf(stderr, "  %s\n", line);
  free(line);
  egress_shutdown();
  write_hosts("# test names\n127.0.0.1 good.test\n10.0.0.5 ten.test\n");
}

static void set_stats(struct agent *a, uint64_t udp, uint64_t icmp, uint64_t other) {
  pthread_mutex_lock(&a->lock);
  a->stats[0] = udp, a->stats[1] = icmp, a->stats[2] = other;
  pthread_mutex_unlock(&a->lock);
}

/* The refused_packets events of report list denied[] (the latest in *LAST). */
static size_t packet_events(json_t *rep, json_t **last) {
  json_t *denied = json_object_get(rep, "denied");
  size_t n = 0;
  *last = NULL;
  for (size_t i = 0; i < json_array_size(denied); i++) {
    json_t *ev = json_array_get(denied, i);
    if (str_of(ev, "kind") && strcmp(str_of(ev, "kind"), "refused_packets") == 0) {
      n++;
      *last = ev;
    }
  }
  return n;
}

static bool packets_are(json_t *ev, json_int_t udp, json_int_t icmp, json_int_t other) {
  bool ok = ev && json_integer_value(json_object_get(ev, "udp")) == udp &&
            json_integer_value(json_object_get(ev, "icmp")) == icmp &&
            json_integer_value(json_object_get(ev, "other")) == other &&
            json_is_false(json_object_get(ev, "allowed")) &&
            json_integer_value(json_object_get(ev, "ts_ms")) > 1700000000000;
  if (!ok) {
    char *text = ev ? json_dumps(ev, JSON_COMPACT) : NULL;
    fprintf(stderr, "  expected udp %lld icmp %lld other %lld, got %s\n", (long long)udp,
            (long long)icmp, (long long)other, text ? text : "no event");
    free(text);
  }
  return ok;
}

static void refused_packets_recorded(void) {
  init_broker(PRIV_HOST, 64);
  struct agent a;
  struct egress *e = session("allow", "[\"good.test\"]", "pk1", &a);
  json_t *ev;
  /* Nothing refused yet: no event. */
  json_t *rep = egress_report(e, true);
  CHECK_EQ_INT(packet_events(rep, &ev), 0);
  CHECK_EQ_INT(json_integer_value(json_object_get(rep, "total_events")), 0);
  json_decref(rep);
  CHECK_EQ_INT(a.stats_asked, 1);
  /* Counts grew: one event with what grew, in denied[] and the log. */
  set_stats(&a, 3, 1, 0);
  rep = egress_report(e, true);
  CHECK_EQ_INT(packet_events(rep, &ev), 1);
  CHECK(packets_are(ev, 3, 1, 0));
  CHECK_EQ_INT(json_integer_value(json_object_get(rep, "total_events")), 1);
  json_decref(rep);
  /* The same counts: nothing new. */
  rep = egress_report(e, true);
  CHECK_EQ_INT(packet_events(rep, &ev), 0);
  json_decref(rep);
  /* UDP lower (the rules were flushed and made again): a new baseline, not
   * a negative increase; OTHER grew. */
  set_stats(&a, 1, 1, 2);
  rep = egress_report(e, true);
  CHECK_EQ_INT(packet_events(rep, &ev), 1);
  CHECK(packets_are(ev, 0, 0, 2));
  json_decref(rep);
  set_stats(&a, 4, 1, 2);
  rep = egress_report(e, true);
  CHECK_EQ_INT(packet_events(rep, &ev), 1);
  CHECK(packets_are(ev, 3, 0, 0));
  json_decref(rep);
  /* An agent that refuses, or does not answer: no event, the report comes
   * all the same (within about a second). */
  pthread_mutex_lock(&a.lock);
  a.stats_error = true;
  a.stats[0] = 100;
  pthread_mutex_unlock(&a.lock);
  rep = egress_report(e, true);
  CHECK_EQ_INT(packet_events(rep, &ev), 0);
  json_decref(rep);
  pthread_mutex_lock(&a.lock);
  a.stats_error = false;
  a.stats_silent = true;
  pthread_mutex_unlock(&a.lock);
  uint64_t t0 = mono_ms();
  rep = egress_report(e, false);
  uint64_t took = mono_ms() - t0;
  CHECK(took >= 900 && took < 3000);
  /* The whole session: the three events so far. */
  CHECK_EQ_INT(packet_events(rep, &ev), 3);
  json_decref(rep);
  /* A new connection (a reset): its agent's counts start from 0. */
  struct agent b;
  agent_start(&b);
  set_stats(&b, 2, 0, 0);
  egress_attach(e, b.c, NULL, NULL);
  rep = egress_report(e, true);
  CHECK_EQ_INT(packet_events(rep, &ev), 1);
  CHECK(packets_are(ev, 2, 0, 0));
  json_decref(rep);
  CHECK_EQ_INT(b.stats_asked, 1);
  session_end(e, &a); /* flushes the log */
  agent_stop(&b);
  /* The log has the four events, as the lists showed them. */
  char path[192];
  snprintf(path, sizeof path, "%s/pk1.egress.jsonl", tmp);
  FILE *f = fopen(path, "r");
  CHECK(f != NULL);
  char line[1024];
  unsigned n = 0;
  json_int_t udp = 0, other = 0;
  while (f && fgets(line, sizeof line, f)) {
    json_t *o = json_loads(line, 0, NULL);
    if (o && str_of(o, "kind") && strcmp(str_of(o, "kind"), "refused_packets") == 0) {
      n++;
      udp += json_integer_value(json_object_get(o, "udp"));
      other += json_integer_value(json_object_get(o, "other"));
    }
    json_decref(o);
  }
  if (f)
    fclose(f);
  CHECK_EQ_INT(n, 4);
  CHECK_EQ_INT(udp, 3 + 3 + 2);
  CHECK_EQ_INT(other, 2);
  egress_shutdown();
}

/* A backend that reads the counters itself (ns): what its callback says,
 * the agent never asked; a failure leaves the record as it is. */
struct backend_counters {
  uint64_t counts[3];
  int r;
  unsigned calls;
};

static int backend_counters(void *ctx, uint64_t ret[3], char **ret_err) {
  struct backend_counters *b = ctx;
  b->calls++;
  if (b->r < 0) {
    *ret_err = strdup("no counters here");
    return b->r;
  }
  memcpy(ret, b->counts, sizeof b->counts);
  return 0;
}

static void backend_counters_instead_of_the_agent(void) {
  init_broker(PRIV_HOST, 64);
  struct agent a;
  struct egress *e = session("none", NULL, "pk2", &a);
  struct backend_counters b = {.counts = {5, 0, 1}};
  egress_attach(e, a.c, backend_counters, &b);
  set_stats(&a, 100, 100, 100); /* never read */
  json_t *ev, *rep = egress_report(e, true);
  CHECK_EQ_INT(packet_events(rep, &ev), 1);
  CHECK(packets_are(ev, 5, 0, 1));
  json_decref(rep);
  b.r = -EPERM;
  b.counts[0] = 9;
  rep = egress_report(e, true);
  CHECK_EQ_INT(packet_events(rep, &ev), 0);
  json_decref(rep);
  CHECK_EQ_INT(b.calls, 2);
  /* Detached: the callback is not called again. */
  egress_detach(e);
  rep = egress_report(e, true);
  json_decref(rep);
  CHECK_EQ_INT(b.calls, 2);
  CHECK_EQ_INT(a.stats_asked, 0);
  session_end(e, &a);
  egress_shutdown();
}

/* Refused before any resolution, for any reason: ip is the address the
 * program asked for. */
static void early_refusals_name_the_address(void) {
  init_broker(PRIV_HOST, 64);
  struct agent a;
  struct egress *e = session("allow", "[\"good.test\"]", "ip1", &a);
  check_reset(&a, (uint8_t[4]){198, 19, 255, 254}, 443, "unknown address");
  json_t *rep = egress_report(e, true);
  json_t *ev = last_of(rep, "denied");
  CHECK_STREQ(str_of(ev, "ip"), "198.19.255.254");
  CHECK(json_is_null(json_object_get(ev, "host")));
  json_decref(rep);
  session_end(e, &a);
  e = session("none", NULL, "ip2", &a);
  check_reset(&a, (uint8_t[4]){93, 184, 216, 34}, 443, "network is none");
  check_reset(&a, (uint8_t[4]){198, 18, 0, 1}, 80, "network is none");
  rep = egress_report(e, true);
  CHECK_EQ_INT(json_array_size(json_object_get(rep, "denied")), 2);
  CHECK_STREQ(str_of(json_array_get(json_object_get(rep, "denied"), 0), "ip"), "93.184.216.34");
  CHECK_STREQ(str_of(json_array_get(json_object_get(rep, "denied"), 1), "ip"), "198.18.0.1");
  json_decref(rep);
  session_end(e, &a);
  egress_shutdown();
  /* IGN_MCP_NET=off */
  struct egress_settings s = {.max_mode = EGRESS_MODE_NONE, .off = true, .hosts_file = hosts_path,
                              .log_dir = tmp, .log_cap = 1u << 20, .max_streams = 64,
                              .max_bytes = 1ull << 30};
  char *err = NULL;
  CHECK_EQ_INT(egress_init(&s, &err), 0);
  free(err);
  e = session("none", NULL, "ip3", &a);
  check_reset(&a, (uint8_t[4]){10, 1, 2, 3}, 22, "egress is off");
  rep = egress_report(e, true);
  CHECK_STREQ(str_of(last_of(rep, "denied"), "ip"), "10.1.2.3");
  CHECK_STREQ(str_of(last_of(rep, "denied"), "reason"), "egress is off");
  json_decref(rep);
  session_end(e, &a);
  egress_shutdown();
}

/* ---- the server's own listening sockets ------------------------------------ */

/* A TCP socket of this process bound to ADDR (FAMILY, host bytes; NULL: the
 * wildcard) on port 0, listening when LISTENING; its port in *RET_PORT.
 * -1 when the family cannot be had here. */
static int own_socket(int family, const char *addr, bool v6only, bool listening,
                      uint16_t *ret_port) {
  int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  struct sockaddr_storage ss = {0};
  socklen_t sl;
  if (family == AF_INET) {
    struct sockaddr_in *in = (struct sockaddr_in *)&ss;
    in->sin_family = AF_INET;
    if (addr)
      inet_pton(AF_INET, addr, &in->sin_addr);
    sl = sizeof *in;
  } else {
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&ss;
    in6->sin6_family = AF_INET6;
    if (addr)
      inet_pton(AF_INET6, addr, &in6->sin6_addr);
    int v = v6only;
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v, sizeof v);
    sl = sizeof *in6;
  }
  if (bind(fd, (struct sockaddr *)&ss, sl) < 0 || (listening && listen(fd, 4) < 0) ||
      getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) {
    close(fd);
    return -1;
  }
  *ret_port = ntohs(family == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port
                                      : ((struct sockaddr_in6 *)&ss)->sin6_port);
  return fd;
}

/* Whether a connect to ADDR (text):PORT is refused as the server's own;
 * the kernel's socket table and the scan of the descriptors (the fallback)
 * must agree. */
static bool self_refused(const char *addr, uint16_t port) {
  uint8_t a[16];
  int family = strchr(addr, ':') ? AF_INET6 : AF_INET;
  if (inet_pton(family, addr, a) != 1)
    abort();
  const char *why = egress_self_refusal(family, a, port);
  const char *scan = egress_self_refusal_by_scan(family, a, port);
  if (why && strcmp(why, EGRESS_SELF_REASON) != 0)
    fprintf(stderr, "  %s:%u: %s\n", addr, port, why);
  if (!why != !scan)
    fprintf(stderr, "  %s:%u: the socket table says %s, the scan %s\n", addr, port,
            why ? why : "reachable", scan ? scan : "reachable");
  CHECK(!why == !scan);
  return why && strcmp(why, EGRESS_SELF_REASON) == 0;
}

/* An address of this host other than loopback (text), or false. */
static bool host_address(char *out, size_t size) {
  struct ifaddrs *ifs;
  if (getifaddrs(&ifs) < 0)
    return false;
  bool found = false;
  for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET)
      continue;
    const struct in_addr *in = &((const struct sockaddr_in *)i->ifa_addr)->sin_addr;
    if ((ntohl(in->s_addr) >> 24) == 127)
      continue;
    found = inet_ntop(AF_INET, in, out, (socklen_t)size) != NULL;
  }
  freeifaddrs(ifs);
  return found;
}

/* Which destinations reach a listener of this process: its own address and
 * port; with a wildcard bind every address of the host on its port (the
 * v6 one takes v4 too, unless IPV6_V6ONLY); v4-mapped and unspecified
 * destinations as the kernel connects them; nothing once it is closed, a
 * socket that only is bound, another port or an address not the host's. */
static void self_refusal_covers_every_address(void) {
  uint16_t p, w, q;
  int lo = own_socket(AF_INET, "127.0.0.1", false, true, &p);
  int wild = own_socket(AF_INET, NULL, false, true, &w);
  int bound = own_socket(AF_INET, "127.0.0.1", false, false, &q);
  CHECK(lo >= 0 && wild >= 0 && bound >= 0);
  CHECK(self_refused("127.0.0.1", p));
  CHECK(self_refused("::ffff:127.0.0.1", p));
  CHECK(self_refused("0.0.0.0", p));
  CHECK(!self_refused("127.0.0.2", p)); /* bound to 127.0.0.1 only */
  CHECK(!self_refused("93.184.216.34", p));
  CHECK(!self_refused("127.0.0.1", q)); /* bound, not listening */
  CHECK(self_refused("127.0.0.1", w));
  CHECK(self_refused("127.9.9.9", w));
  CHECK(self_refused("0.0.0.0", w));
  CHECK(self_refused("::ffff:127.0.0.1", w));
  CHECK(!self_refused("::1", w)); /* a v4 listener */
  CHECK(!self_refused("93.184.216.34", w));
  char own[INET_ADDRSTRLEN];
  if (host_address(own, sizeof own))
    CHECK(self_refused(own, w));
  else
    fprintf(stderr, "  (no address but loopback here: the host's own address is not tried)\n");
  close(lo);
  CHECK(!self_refused("127.0.0.1", p)); /* closed: found afresh */
  /* A new listener on the same port (a new socket): found at once. */
  lo = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in again = {.sin_family = AF_INET, .sin_port = htons(p),
                              .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  int one = 1;
  setsockopt(lo, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(lo, (struct sockaddr *)&again, sizeof again) == 0 && listen(lo, 4) == 0)
    CHECK(self_refused("127.0.0.1", p));
  else
    fprintf(stderr, "  (port %u could not be bound again: not tried)\n", p);
  close(lo);
  /* Another process's listener is not the server's. */
  server_start();
  CHECK(!self_refused("127.0.0.1", srv.port));
  CHECK(!self_refused("127.0.0.1", srv.port)); /* known now */
  server_stop();
  close(wild);
  CHECK(!self_refused("127.0.0.1", w));
  close(bound);

  uint16_t x, y, z;
  int wild6 = own_socket(AF_INET6, NULL, false, true, &x);
  int only6 = own_socket(AF_INET6, NULL, true, true, &y);
  int lo6 = own_socket(AF_INET6, "::1", true, true, &z);
  if (wild6 < 0 || only6 < 0 || lo6 < 0) {
    fprintf(stderr, "  (no IPv6 loopback here: the v6 listeners are not tried)\n");
  } else {
    CHECK(self_refused("::1", x));
    CHECK(self_refused("::", x));
    CHECK(self_refused("127.0.0.1", x)); /* dual-stack: v4 too */
    CHECK(self_refused("::ffff:127.0.0.1", x));
    CHECK(!self_refused("2606:2800:220:1::1", x));
    CHECK(self_refused("::1", y));
    CHECK(!self_refused("127.0.0.1", y)); /* IPV6_V6ONLY */
    CHECK(self_refused("::1", z));
    CHECK(!self_refused("127.0.0.1", z));
  }
  if (wild6 >= 0)
    close(wild6);
  if (only6 >= 0)
    close(only6);
  if (lo6 >= 0)
    close(lo6);
}

/* With the descriptors of a busy server open (sockets that do not listen,
 * other files), the answers stay right, by the kernel's socket table and
 * the inodes known: nothing elsewhere is the server's, its listener is.
 * What the check costs a connect is measured in bench/ (section 11). */
static void self_refusal_with_many_descriptors(void) {
  int fds[256];
  int n = 0;
  for (; n < 256; n++) {
    fds[n] = n % 2 ? open("/dev/null", O_RDONLY | O_CLOEXEC)
                   : socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fds[n] < 0)
      break;
  }
  uint16_t p;
  int lfd = own_socket(AF_INET, NULL, false, true, &p);
  static const uint8_t away4[4] = {93, 184, 216, 34}, home4[4] = {127, 0, 0, 1};
  for (int i = 0; i < 16; i++) {
    CHECK(!egress_self_refusal(AF_INET, away4, 443));
    CHECK(egress_self_refusal(AF_INET, home4, p) != NULL);
    CHECK(!egress_self_refusal(AF_INET, home4, (uint16_t)(p == 65535 ? 1 : p + 1)) ||
          p == 65535);
  }
  close(lfd);
  while (n--)
    close(fds[n]);
}

/* A sandbox allowed good.test:P under IGN_MCP_NET_PRIVATE=host, with
 * good.test at 127.0.0.1 and the server itself listening on 127.0.0.1:P,
 * never reaches it: by name (a request naming good.test in its target or
 * its Host, raw bytes, nothing), by raw address in open mode (a request
 * without Host, which the peek passes on a raw address); each
 * refusal recorded with its reason.  Another loopback server (the echo
 * server, another process) stays reachable under the same policy. */
static void own_listener_never_reached(void) {
  init_broker(PRIV_HOST, 64);
  server_start();
  uint16_t p;
  int lfd = own_socket(AF_INET, "127.0.0.1", false, true, &p);
  CHECK(lfd >= 0);
  char allow[128];
  snprintf(allow, sizeof allow, "[\"good.test:%u\", \"good.test:%u\"]", p, srv.port);
  struct agent a;
  struct egress *e = session("allow", allow, "self1", &a);
  uint8_t addr[4];
  static const char no_host[] = "GET /mcp HTTP/1.0\r\n\r\n";
  static const char with_host[] = "GET /mcp HTTP/1.0\r\nHost: good.test\r\n\r\n";
  static const char in_target[] = "GET http://good.test/mcp HTTP/1.0\r\n\r\n";
  char msg[128];
  if (resolve(&a, "good.test", addr)) {
    const char *payloads[] = {in_target, with_host, "\x01\x02raw"};
    for (size_t i = 0; i < ARRAY_SIZE(payloads); i++) {
      uint32_t sid = ag_open(&a, addr, p);
      struct frame *f = agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000);
      CHECK(f != NULL);
      free(f);
      ag_simple(&a, PROTO_STREAM_DATA, sid, payloads[i], strlen(payloads[i]));
      CHECK_EQ_INT(reset_of(&a, sid, msg, sizeof msg), ECONNREFUSED);
      CHECK_STREQ(msg, EGRESS_SELF_REASON);
    }
    /* Nothing sent: the broker connects after EGRESS_FIRST_BYTE_MS (a
     * server-first protocol), or would. */
    uint32_t sid = ag_open(&a, addr, p);
    free(agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000));
    CHECK_EQ_INT(reset_of(&a, sid, msg, sizeof msg), ECONNREFUSED);
    CHECK_STREQ(msg, EGRESS_SELF_REASON);
    /* The other loopback server, same name, same policy: reached. */
    sid = ag_open(&a, addr, srv.port);
    free(agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000));
    ag_simple(&a, PROTO_STREAM_DATA, sid, with_host, sizeof with_host - 1);
    struct frame *f = agent_expect(&a, sid, PROTO_STREAM_DATA, 5000);
    CHECK(f && f->h.len > 0);
    free(f);
    CHECK(server_accepted(1, 5000));
  }
  json_t *rep = egress_report(e, true);
  json_t *denied = json_object_get(rep, "denied");
  CHECK_EQ_INT(json_array_size(denied), 4);
  for (size_t i = 0; i < json_array_size(denied); i++) {
    json_t *ev = json_array_get(denied, i);
    CHECK_STREQ(str_of(ev, "reason"), EGRESS_SELF_REASON);
    CHECK_STREQ(str_of(ev, "host"), "good.test");
    CHECK_STREQ(str_of(ev, "ip"), "127.0.0.1");
    CHECK_EQ_INT(json_integer_value(json_object_get(ev, "port")), p);
  }
  json_decref(rep);
  session_end(e, &a);
  /* Open mode, a raw address: the same. */
  e = session("open", NULL, "self2", &a);
  uint32_t sid = ag_open(&a, (uint8_t[4]){127, 0, 0, 1}, p);
  free(agent_expect(&a, sid, PROTO_STREAM_ACCEPT, 5000));
  ag_simple(&a, PROTO_STREAM_DATA, sid, no_host, sizeof no_host - 1);
  CHECK_EQ_INT(reset_of(&a, sid, msg, sizeof msg), ECONNREFUSED);
  CHECK_STREQ(msg, EGRESS_SELF_REASON);
  session_end(e, &a);
  egress_shutdown();
  /* Nothing ever reached the listener. */
  struct pollfd pf = {.fd = lfd, .events = POLLIN};
  CHECK_EQ_INT(poll(&pf, 1, 0), 0);
  close(lfd);
  server_stop();
}

static void setup(void) {
  if (!test_mkdtemp(tmp, sizeof tmp, "test_broker"))
    abort();
  snprintf(hosts_path, sizeof hosts_path, "%s/hosts", tmp);
  write_hosts("# test names\n127.0.0.1 good.test\n10.0.0.5 ten.test\n");
}

static void teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
  if (system(cmd) != 0)
    fprintf(stderr, "  could not remove %s\n", tmp);
}

int main(void) {
  setup();
  static const struct test_case cases[] = {
      TEST(new_refuses_bad_arguments), TEST(saved_egress_is_made_again),  TEST(updated_policy_keeps_what_stays),
      TEST(policy_line_says_the_bounds),
      TEST(dns_answers_by_policy),      TEST(relay_both_ways_and_count), TEST(relay_within_the_windows),
      TEST(refusals_at_open),           TEST(peek_mismatch_reaches_nothing),
      TEST(private_refused_without_allow_private), TEST(too_many_connections),
      TEST(mode_none_refuses_everything), TEST(dns_rate_limited),
      TEST(report_since_last_and_log),
      TEST(resolver_flood_spares_other_sessions), TEST(host_own_address_refused),
      TEST(web_ports_always_peeked), TEST(host_less_request_only_on_raw_addresses),
      TEST(server_first_port_still_checks_the_first_bytes),
      TEST(server_first_greeting_lets_commands_pass),
      TEST(clone_keeps_synthetic_addresses), TEST(hosts_file_long_lines),
      TEST(refused_packets_recorded), TEST(backend_counters_instead_of_the_agent),
      TEST(early_refusals_name_the_address), TEST(wildcard_names_capped),
      TEST(refusals_survive_a_flood), TEST(dns_cache_per_owner),
      TEST(self_refusal_covers_every_address), TEST(self_refusal_with_many_descriptors),
      TEST(own_listener_never_reached),
  };
  int r = test_run_all(cases, ARRAY_SIZE(cases));
  teardown();
  return r;
}
