/* test_session.c: the session table's rules that do not need a client.
 * Host ids: IGN_MCP_HOST_ID's rule, the host part of a session id, and the
 * error that names the host holding an id.  Owners, for real on the ns
 * backend (skipped where it cannot run): a session, its forks, its stages
 * and sandbox_run's one-shot sessions are reached only by the owner that
 * made them; to any other the id is unknown in the same words as an id
 * nobody opened.  Egress: a session's network policy (the broker's
 * struct egress) goes with it through reset and is copied by fork; an open
 * that fails frees it (ASan would see it otherwise). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/config.h"
#include "common/fs.h"
#include "common/util.h"
#include "egress/egress.h"
#include "sandbox/stage.h"
#include "session/session.h"
#include "test.h"

static void host_id_rule(void) {
  const char *good[] = {"h", "h1", "host-2", "a0123456789abcde", "edge-eu-west"};
  for (size_t i = 0; i < ARRAY_SIZE(good); i++)
    CHECK(config_host_id_valid(good[i], strlen(good[i])));
  const char *bad[] = {"", "1h", "-h", "H1", "h_1", "h.1", "h 1", "a0123456789abcdef", "hé"};
  for (size_t i = 0; i < ARRAY_SIZE(bad); i++)
    CHECK(!config_host_id_valid(bad[i], strlen(bad[i])));
}

static void host_part_of_an_id(void) {
  char host[CONFIG_HOST_ID_MAX + 1];
  CHECK(session_id_host("h2.s3-9f2a", host));
  CHECK_STREQ(host, "h2");
  CHECK(session_id_host("a0123456789abcde.r4294967295-ffff", host));
  CHECK_STREQ(host, "a0123456789abcde");
  CHECK(session_id_host("h-1.x", host));
  CHECK_STREQ(host, "h-1");
  const char *none[] = {"s3-9f2a", "", ".", "h2.", ".s1-0000", "H2.s1-0000", "2h.s1-0000",
                        "h_2.s1-0000", "a0123456789abcdef.s1-0000", "h 2.s1"};
  for (size_t i = 0; i < ARRAY_SIZE(none); i++)
    CHECK(!session_id_host(none[i], host));
}

static void an_id_of_another_host_names_it(void) {
  char saved[sizeof cfg.host_id];
  memcpy(saved, cfg.host_id, sizeof saved);
  snprintf(cfg.host_id, sizeof cfg.host_id, "h1");
  char *m = session_id_elsewhere("h2.s3-9f2a");
  CHECK(m && strstr(m, "session 'h2.s3-9f2a' is held by host 'h2', not this host 'h1'"));
  CHECK(m && strstr(m, "send calls for it to h2") && strstr(m, "Mcp-Param-Session-Id") &&
        strstr(m, "docs/scale-out.md"));
  free(m);
  /* This host's ids, ids without a host part and malformed ones are
   * answered as unknown ids, not sent elsewhere. */
  const char *here[] = {"h1.s99-ffff", "s1-0000", "H2.s1-0000", "h_2.s1", "h2."};
  for (size_t i = 0; i < ARRAY_SIZE(here); i++) {
    m = session_id_elsewhere(here[i]);
    CHECK(m == NULL);
    free(m);
  }
  /* A server without a host id: every id with a host part is elsewhere. */
  cfg.host_id[0] = '\0';
  m = session_id_elsewhere("h1.s1-0000");
  CHECK(m && strstr(m, "held by host 'h1'") && strstr(m, "no IGN_MCP_HOST_ID"));
  free(m);
  CHECK(session_id_elsewhere("s1-0000") == NULL);
  memcpy(cfg.host_id, saved, sizeof saved);
}

/* ---- owners, on the ns backend ---- */

static char store[256];
static bool ns_up;

static const char *env_or(const char *name, const char *deflt) {
  const char *v = getenv(name);
  return v && *v ? v : deflt;
}

/* An invalid IGN_MCP_HOST_ID stops the server before anything else; a valid
 * one is kept.  The valid load is the one the ns sessions below run on. */
static void host_id_from_the_environment(void) {
  if (!test_mkdtemp(store, sizeof store, "test-session"))
    abort();
  char *rootfs = realpath(env_or("IGN_TEST_ROOTFS_SMALL", "build/rootfs/small"), NULL);
  char *agent = realpath(env_or("IGN_TEST_AGENT", "build/ign-agent"), NULL);
  setenv("IGN_MCP_BACKEND", "ns", 1);
  setenv("IGN_MCP_ROOTFS", rootfs ? rootfs : "/nonexistent", 1);
  setenv("IGN_MCP_AGENT", agent ? agent : "/nonexistent", 1);
  setenv("IGN_MCP_STORE", store, 1);
  setenv("IGN_MCP_MAX_SESSIONS", "6", 1);
  setenv("IGN_MCP_MEMORY_MB", "256", 1);
  setenv("IGN_MCP_LOG_CAP", "0", 1);
  free(rootfs);
  free(agent);
  setenv("IGN_MCP_HOST_ID", "H1", 1);
  CHECK_EQ_INT(config_load(), -EINVAL);
  setenv("IGN_MCP_HOST_ID", "a0123456789abcdef", 1);
  CHECK_EQ_INT(config_load(), -EINVAL);
  setenv("IGN_MCP_HOST_ID", "h1", 1);
  CHECK_EQ_INT(config_load(), 0);
  CHECK_STREQ(cfg.host_id, "h1");
}

static void start_ns(void) {
  if (!cfg.rootfs || !cfg.agent) {
    printf("ok - owners # skip no rootfs or agent (make, make images)\n");
    return;
  }
  char *err = NULL;
  _cleanup_free_ char *logs = xasprintf("%s/logs", store);
  struct egress_settings es = {.max_mode = EGRESS_MODE_ALLOW, .log_dir = logs, .log_cap = 1 << 20,
                               .max_streams = 64, .max_bytes = 1u << 30};
  CHECK_EQ_INT(egress_init(&es, &err), 0);
  free(err);
  err = NULL;
  if (sessions_init(&err) < 0) {
    printf("ok - owners # skip the ns backend cannot run here: %s\n", err);
    free(err);
    return;
  }
  ns_up = true;
}

/* A session's egress as open_session makes it: NETWORK ("none", "allow")
 * with HOST as its one allow_hosts entry (NULL: none). */
static struct egress *policy(const char *network, const char *host) {
  json_t *n = json_string(network);
  json_t *h = host ? json_pack("[s]", host) : NULL;
  struct egress *e = NULL;
  char *err = NULL;
  CHECK_EQ_INT(egress_new("test", n, h, &e, &err), 0);
  if (err)
    fprintf(stderr, "  egress_new: %s\n", err);
  free(err);
  json_decref(n);
  json_decref(h);
  return e;
}

/* INFO's egress (open_session's, reset's) is MODE with RULE as its only
 * rule (NULL: none). */
static void check_summary(json_t *info, const char *mode, const char *rule) {
  json_t *e = json_object_get(info, "egress");
  CHECK_STREQ(json_string_value(json_object_get(e, "mode")), mode);
  json_t *rules = json_object_get(e, "allowed_rules");
  CHECK_EQ_INT(json_array_size(rules), rule ? 1 : 0);
  if (rule)
    CHECK_STREQ(json_string_value(json_array_get(rules, 0)), rule);
}

static json_t *ids_of(json_t *list) {
  json_t *ids = json_array();
  size_t i;
  json_t *v;
  json_array_foreach(json_object_get(list, "sessions"), i, v)
    json_array_append(ids, json_object_get(v, "session_id"));
  json_decref(list);
  return ids;
}

static bool lists(const char *owner, const char *id) {
  json_t *ids = ids_of(session_list(owner));
  bool found = false;
  size_t i;
  json_t *v;
  json_array_foreach(ids, i, v)
    found |= strcmp(json_string_value(v), id) == 0;
  json_decref(ids);
  return found;
}

/* ERR is the unknown-id answer for ID, word for word as for an id nobody
 * ever opened.  Frees ERR. */
static void check_unknown(char *err, const char *id) {
  char *fresh = xasprintf("unknown session_id '%s':", id);
  CHECK(err && strncmp(err, fresh, strlen(fresh)) == 0);
  CHECK(err && strstr(err, "open_session"));
  free(fresh);
  free(err);
}

static void owners_are_apart(void) {
  if (!ns_up)
    return;
  json_t *info = NULL;
  char *err = NULL;
  int r = session_open("alice", NULL, policy("allow", "pypi.org"), &info, &err);
  CHECK_EQ_INT(r, 0);
  if (r < 0) {
    fprintf(stderr, "  open: %s\n", err);
    free(err);
    return;
  }
  char id[SESSION_ID_MAX];
  snprintf(id, sizeof id, "%s", json_string_value(json_object_get(info, "session_id")));
  json_decref(info);
  CHECK(strncmp(id, "h1.s", 4) == 0);

  /* Bob: the id does not exist. */
  struct lease l;
  CHECK_EQ_INT(session_acquire(id, "bob", &l, &err), -ENOENT);
  check_unknown(steal_ptr(err), id);
  CHECK_EQ_INT(session_acquire(id, "", &l, &err), -ENOENT);
  check_unknown(steal_ptr(err), id);
  CHECK_EQ_INT(session_reset(id, "bob", NULL, &info, &err), -ENOENT);
  check_unknown(steal_ptr(err), id);
  /* A stage argument changes nothing: the id is refused first. */
  CHECK_EQ_INT(session_reset(id, "bob", "no/such", &info, &err), -ENOENT);
  check_unknown(steal_ptr(err), id);
  CHECK_EQ_INT(session_commit(id, "bob", "own/bob", false, NULL, &info, &err), -ENOENT);
  check_unknown(steal_ptr(err), id);
  CHECK_EQ_INT(session_fork(id, "bob", 1, &info, &err), -ENOENT);
  free(err); /* (fork adds its own words to the unknown id's) */
  err = NULL;
  CHECK_EQ_INT(session_close(id, "bob", &err), -ENOENT);
  check_unknown(steal_ptr(err), id);
  CHECK(!lists("bob", id));
  CHECK(!lists("", id));

  /* Alice: it is there, and her forks are hers. */
  CHECK(lists("alice", id));
  CHECK_EQ_INT(session_acquire(id, "alice", &l, &err), 0);
  if (!err)
    session_release(&l);
  free(err);
  err = NULL;
  r = session_fork(id, "alice", 1, &info, &err);
  if (r == -EOPNOTSUPP) {
    free(err);
    err = NULL;
  } else {
    CHECK_EQ_INT(r, 0);
    const char *fork_id =
        json_string_value(json_object_get(json_array_get(json_object_get(info, "sessions"), 0),
                                          "session_id"));
    CHECK(fork_id && strncmp(fork_id, "h1.s", 4) == 0);
    CHECK(fork_id && lists("alice", fork_id) && !lists("bob", fork_id));
    if (fork_id) {
      CHECK_EQ_INT(session_close(fork_id, "bob", &err), -ENOENT);
      free(err);
      err = NULL;
      CHECK_EQ_INT(session_close(fork_id, "alice", &err), 0);
    }
    json_decref(info);

    /* Her stage: bob cannot start from it, nor commit under its name. */
    CHECK_EQ_INT(session_commit(id, "alice", "own/alice", false, NULL, &info, &err), 0);
    json_decref(info);
    free(err);
    err = NULL;
    CHECK_EQ_INT(session_open("bob", "own/alice", policy("allow", "pypi.org"), &info, &err), -ENOENT);
    CHECK(err && strstr(err, "no stage named 'own/alice'"));
    free(err);
    err = NULL;
    struct lease e;
    CHECK_EQ_INT(session_open_ephemeral("bob", "own/alice", policy("none", NULL), &e, &info, &err), -ENOENT);
    free(err);
    err = NULL;
    CHECK_EQ_INT(session_open_ephemeral("bob", NULL, policy("none", NULL), &e, &info, &err), 0);
    if (!err) {
      json_decref(info);
      json_t *c = NULL;
      CHECK_EQ_INT(session_commit_ephemeral(&e, "own/alice", true, NULL, &c, &err), -EEXIST);
      CHECK(err && strstr(err, "taken") && strstr(err, "pick another name"));
      free(err);
      err = NULL;
      /* Bob's one-shot session is his alone, listed only to him. */
      json_t *bl = session_list("bob");
      CHECK_EQ_INT(json_array_size(json_object_get(bl, "sessions")), 1);
      json_decref(bl);
      CHECK(!lists("alice", lease_id(&e)));
      CHECK(strncmp(lease_id(&e), "h1.r", 4) == 0);
      session_end_ephemeral(&e);
    }
    free(err);
    err = NULL;
    CHECK_EQ_INT(stage_rm("own/alice", "bob", &err), -ENOENT);
    free(err);
    err = NULL;
    CHECK_EQ_INT(stage_rm("own/alice", "alice", &err), 0);
  }
  free(err);
  err = NULL;
  CHECK_EQ_INT(session_close(id, "alice", &err), 0);
  CHECK(!lists("alice", id));
}

/* The policy a session was opened with holds through reset, and a fork
 * gets a copy of it with a record of its own. */
static void egress_follows_the_session(void) {
  if (!ns_up)
    return;
  json_t *info = NULL;
  char *err = NULL;
  CHECK_EQ_INT(session_open("carol", NULL, policy("allow", "*.pythonhosted.org:443"), &info, &err),
               0);
  if (!info) {
    fprintf(stderr, "  open: %s\n", err);
    free(err);
    return;
  }
  check_summary(info, "allow", "*.pythonhosted.org:443");
  char id[SESSION_ID_MAX];
  snprintf(id, sizeof id, "%s", json_string_value(json_object_get(info, "session_id")));
  json_decref(info);
  CHECK_EQ_INT(session_reset(id, "carol", NULL, &info, &err), 0);
  check_summary(info, "allow", "*.pythonhosted.org:443");
  json_decref(info);
  int r = session_fork(id, "carol", 2, &info, &err);
  if (r == 0) {
    json_t *list = json_object_get(info, "sessions");
    CHECK_EQ_INT(json_array_size(list), 2);
    size_t i;
    json_t *f;
    json_array_foreach(list, i, f) {
      const char *fid = json_string_value(json_object_get(f, "session_id"));
      struct lease l;
      CHECK_EQ_INT(session_acquire(fid, "carol", &l, &err), 0);
      json_t *rep = egress_report(lease_egress(&l), false);
      CHECK_STREQ(json_string_value(json_object_get(rep, "mode")), "allow");
      CHECK_EQ_INT(json_array_size(json_object_get(rep, "allowed_rules")), 1);
      CHECK_EQ_INT(json_array_size(json_object_get(rep, "denied")), 0);
      json_decref(rep);
      session_release(&l);
      CHECK_EQ_INT(session_close(fid, "carol", &err), 0);
    }
    json_decref(info);
  } else {
    CHECK_EQ_INT(r, -EOPNOTSUPP);
  }
  free(err);
  err = NULL;
  /* The lease's egress is the session's: a run's report comes from it. */
  struct lease l;
  CHECK_EQ_INT(session_acquire(id, "carol", &l, &err), 0);
  json_t *rep = egress_report(lease_egress(&l), true);
  CHECK_STREQ(json_string_value(json_object_get(rep, "mode")), "allow");
  json_decref(rep);
  session_release(&l);
  CHECK_EQ_INT(session_close(id, "carol", &err), 0);
  free(err);
}

static void stop_ns(void) {
  if (ns_up)
    sessions_shutdown();
  egress_shutdown();
  fs_remove_tree(store);
}

TEST_MAIN(TEST(host_id_rule), TEST(host_part_of_an_id), TEST(an_id_of_another_host_names_it),
          TEST(host_id_from_the_environment), TEST(start_ns), TEST(owners_are_apart),
          TEST(egress_follows_the_session), TEST(stop_ns))
