/* test_stage.c: the stage store on a real directory: names, making,
 * opening, listing, replacing and removing stages, references that keep a
 * removed stage's files, anonymous stages, the quota, checksums that catch
 * a flipped byte, the clean-up of dead servers' leftovers, content ids, and
 * trees a sandbox may have filled with links, FIFOs and deep directories. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "common/config.h"
#include "common/fs.h"
#include "common/util.h"
#include "sandbox/stage.h"
#include "test.h"

static char store[256];

static const struct stage_new vm_new = {
    .backend = "vm", .inputs_id = "b-aaaa", .carries = "memory", .parent = NULL};

static void write_file(const char *dir, const char *name, const char *content) {
  _cleanup_free_ char *p = xasprintf("%s/%s", dir, name);
  int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  CHECK(fd >= 0);
  if (fd >= 0) {
    CHECK(write(fd, content, strlen(content)) == (ssize_t)strlen(content));
    close(fd);
  }
}

static bool exists(const char *p) {
  struct stat st;
  return lstat(p, &st) == 0;
}

/* A stage of NAME (NULL: anonymous) holding files "ram" and "state". */
static struct stage *make(const char *name, const char *ram, bool replace, int *ret_r,
                          char **ret_err) {
  char *dir = NULL, *err = NULL;
  struct stage *s = NULL;
  int r = stage_begin(1 << 20, &dir, &err);
  CHECK_EQ_INT(r, 0);
  if (r < 0) {
    fprintf(stderr, "  %s\n", err);
    free(err);
    return NULL;
  }
  write_file(dir, "ram", ram);
  write_file(dir, "state", "device state");
  r = stage_finish(dir, name, replace, &vm_new, &s, &err);
  CHECK(!exists(dir) || r == 0);
  free(dir);
  if (ret_r)
    *ret_r = r;
  if (ret_err)
    *ret_err = err;
  else
    free(err);
  return r == 0 ? s : NULL;
}

static size_t count_entries(const char *prefix) {
  _cleanup_free_ char *sd = xasprintf("%s/stages", store);
  size_t n = 0;
  DIR *d = opendir(sd);
  struct dirent *e;
  while (d && (e = readdir(d)))
    if (!strncmp(e->d_name, prefix, strlen(prefix)))
      n++;
  if (d)
    closedir(d);
  return n;
}

static void name_rules(void) {
  char *err = NULL;
  CHECK_EQ_INT(stage_name_check("myproject/data-deps", &err), 0);
  CHECK_EQ_INT(stage_name_check("a", &err), 0);
  CHECK_EQ_INT(stage_name_check("0.x_y-z/w", &err), 0);
  const char *bad[] = {"", "Abc", ".hidden", "-x", "/x", "a+b", "a b", "a\nb", "é", "a:b"};
  for (size_t i = 0; i < ARRAY_SIZE(bad); i++) {
    err = NULL;
    CHECK_EQ_INT(stage_name_check(bad[i], &err), -EINVAL);
    CHECK(err && strstr(err, STAGE_NAME_RULE) && strstr(err, "myproject/data-deps"));
    free(err);
  }
  char longname[STAGE_NAME_MAX + 2];
  memset(longname, 'a', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  err = NULL;
  CHECK_EQ_INT(stage_name_check(longname, &err), -EINVAL);
  free(err);
  longname[STAGE_NAME_MAX] = '\0';
  CHECK_EQ_INT(stage_name_check(longname, &err), 0);
}

/* Only directories from stage_begin are turned into stages or removed. */
static void only_begin_dirs_are_taken(void) {
  char outside[256];
  CHECK(test_mkdtemp(outside, sizeof outside, "test-stage-outside") != NULL);
  write_file(outside, "keep", "mine");
  char *err = NULL;
  struct stage *s = NULL;
  CHECK_EQ_INT(stage_finish(outside, "x", false, &vm_new, &s, &err), -EINVAL);
  free(err);
  err = NULL;
  stage_abort(outside);
  _cleanup_free_ char *keep = xasprintf("%s/keep", outside);
  CHECK(exists(keep));
  fs_remove_tree(outside);
  /* A bad name fails finish, and its directory goes. */
  char *dir = NULL;
  CHECK_EQ_INT(stage_begin(0, &dir, &err), 0);
  CHECK_EQ_INT(stage_finish(dir, "Bad Name", false, &vm_new, &s, &err), -EINVAL);
  CHECK(err && strstr(err, STAGE_NAME_RULE));
  CHECK(dir && !exists(dir));
  free(err);
  free(dir);
}

static void make_open_list_info_rm(void) {
  struct stage *s = make("proj/one", "hello ram", false, NULL, NULL);
  CHECK(s != NULL);
  if (!s)
    return;
  CHECK_STREQ(s->name, "proj/one");
  CHECK(strncmp(s->id, "st-", 3) == 0 && strlen(s->id) == 35);
  CHECK(s->parent == NULL);
  CHECK_STREQ(s->carries, "memory");
  CHECK(s->bytes > 0);
  _cleanup_free_ char *dir = xasprintf("%s/stages/proj+one", store);
  CHECK_STREQ(s->dir, dir);
  _cleanup_free_ char *meta = xasprintf("%s/meta.json", dir);
  struct stat st;
  CHECK(stat(meta, &st) == 0 && (st.st_mode & 0777) == 0600);
  _cleanup_free_ char *sd = xasprintf("%s/stages", store);
  CHECK(stat(sd, &st) == 0 && (st.st_mode & 0777) == 0700);

  struct stage *o = NULL;
  char *err = NULL;
  CHECK_EQ_INT(stage_open("proj/one", "", "vm", "b-aaaa", &o, &err), 0);
  CHECK(o == s); /* one struct per stage */
  CHECK_EQ_INT(s->refs, 2);
  stage_sessions_add(o, 1);

  json_t *info = NULL;
  CHECK_EQ_INT(stage_info("proj/one", "", &info, &err), 0);
  CHECK_STREQ(json_string_value(json_object_get(info, "stage_id")), s->id);
  CHECK_STREQ(json_string_value(json_object_get(info, "backend")), "vm");
  CHECK_STREQ(json_string_value(json_object_get(info, "base_id")), "b-aaaa");
  CHECK_EQ_INT(json_integer_value(json_object_get(info, "sessions")), 1);
  CHECK(json_is_null(json_object_get(info, "parent")));
  json_decref(info);

  json_t *list = stage_list("");
  json_t *arr = json_object_get(list, "stages");
  CHECK_EQ_INT(json_array_size(arr), 1);
  CHECK_STREQ(json_string_value(json_object_get(json_array_get(arr, 0), "name")), "proj/one");
  CHECK(json_integer_value(json_object_get(list, "bytes_used")) >= (json_int_t)s->bytes);
  CHECK_EQ_INT(json_integer_value(json_object_get(list, "bytes_max")),
               (json_int_t)cfg.stages_max_mb << 20);
  json_decref(list);

  /* Wrong backend, other inputs, unknown name. */
  struct stage *x = NULL;
  CHECK_EQ_INT(stage_open("proj/one", "", "ns", "b-aaaa", &x, &err), -EXDEV);
  CHECK(err && strstr(err, "made by the vm backend; this server runs the ns backend"));
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_open("proj/one", "", "vm", "b-bbbb", &x, &err), -ESTALE);
  CHECK(err && strstr(err, "b-aaaa") && strstr(err, "b-bbbb") && strstr(err, s->id) &&
        strstr(err, "replace: true"));
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_open("nope", "", "vm", "b-aaaa", &x, &err), -ENOENT);
  CHECK(err && strstr(err, "no stage named 'nope'") && strstr(err, "stage_list"));
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_info("nope", "", &info, &err), -ENOENT);
  free(err);
  err = NULL;

  /* A child records its parent. */
  char *cdir = NULL;
  struct stage *c = NULL;
  CHECK_EQ_INT(stage_begin(0, &cdir, &err), 0);
  write_file(cdir, "ram", "child");
  struct stage_new cn = vm_new;
  cn.parent = s;
  CHECK_EQ_INT(stage_finish(cdir, "proj/child", false, &cn, &c, &err), 0);
  free(cdir);
  CHECK(c && c->parent && !strcmp(c->parent, s->id) && !strcmp(c->parent_name, "proj/one"));
  CHECK_EQ_INT(stage_info("proj/child", "", &info, &err), 0);
  CHECK_STREQ(json_string_value(json_object_get(info, "parent")), "proj/one");
  json_decref(info);

  /* rm while held: the name goes at once, the files with the last reference. */
  CHECK_EQ_INT(stage_rm("proj/one", "", &err), 0);
  CHECK(!exists(dir));
  CHECK(s->removed);
  CHECK(exists(s->dir));
  _cleanup_free_ char *aside = strdup(s->dir);
  CHECK_EQ_INT(stage_open("proj/one", "", "vm", "b-aaaa", &x, &err), -ENOENT);
  free(err);
  err = NULL;
  stage_gc(); /* held: gc leaves it */
  CHECK(exists(aside));
  stage_sessions_add(o, -1);
  stage_unref(o);
  CHECK(exists(aside));
  stage_unref(s);
  CHECK(!exists(aside));
  CHECK_EQ_INT(stage_rm("proj/one", "", &err), -ENOENT);
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_rm("proj/child", "", &err), 0);
  stage_unref(c);
  CHECK_EQ_INT(count_entries(".rm-"), 0);
  CHECK_EQ_INT(count_entries("proj"), 0);
}

static void replace_only_when_asked(void) {
  struct stage *a = make("rep", "first", false, NULL, NULL);
  int r;
  char *err = NULL;
  struct stage *b = make("rep", "second", false, &r, &err);
  CHECK(b == NULL);
  CHECK_EQ_INT(r, -EEXIST);
  CHECK(err && strstr(err, "exists already") && strstr(err, "replace: true"));
  free(err);
  err = NULL;
  CHECK_EQ_INT(count_entries(".tmp-"), 0);
  /* Replaced while A is held: the name holds the new one at once; A's
   * files stay until A's last reference. */
  b = make("rep", "second", true, &r, &err);
  CHECK(b != NULL);
  CHECK(a && a->removed && exists(a->dir));
  CHECK(b && a && strcmp(a->id, b->id) != 0);
  struct stage *o = NULL;
  CHECK_EQ_INT(stage_open("rep", "", "vm", "b-aaaa", &o, &err), 0);
  CHECK(o == b);
  _cleanup_free_ char *aside = a ? strdup(a->dir) : NULL;
  stage_unref(a);
  CHECK(!aside || !exists(aside));
  /* Replaced while nobody holds the old one: it goes at once. */
  stage_unref(o);
  stage_unref(b);
  struct stage *c = make("rep", "third", true, &r, &err);
  CHECK(c != NULL);
  CHECK_EQ_INT(count_entries(".rm-"), 0);
  stage_unref(c);
  CHECK_EQ_INT(stage_rm("rep", "", &err), 0);
}

/* A stage of OWNER named NAME. */
static struct stage *make_owned(const char *name, const char *owner, const char *ram, bool replace,
                                int *ret_r, char **ret_err) {
  char *dir = NULL, *err = NULL;
  struct stage *s = NULL;
  int r = stage_begin(1 << 20, &dir, &err);
  CHECK_EQ_INT(r, 0);
  if (r < 0) {
    free(err);
    return NULL;
  }
  write_file(dir, "ram", ram);
  write_file(dir, "state", "device state");
  struct stage_new in = vm_new;
  in.owner = owner;
  r = stage_finish(dir, name, replace, &in, &s, &err);
  free(dir);
  *ret_r = r;
  *ret_err = err;
  return r == 0 ? s : NULL;
}

static bool listed(const char *owner, const char *name) {
  json_t *list = stage_list(owner);
  bool found = false;
  size_t i;
  json_t *v;
  json_array_foreach(json_object_get(list, "stages"), i, v)
    found |= strcmp(json_string_value(json_object_get(v, "name")), name) == 0;
  json_decref(list);
  return found;
}

/* A stage is its owner's: to another owner it is a name nobody made, except
 * that the name cannot be taken again (and that refusal tells nothing about
 * it). */
static void stages_belong_to_their_owner(void) {
  int r;
  char *err = NULL;
  struct stage *a = make_owned("own/secret", "alice", "alice's ram", false, &r, &err);
  CHECK(a != NULL);
  CHECK(a && a->owner && strcmp(a->owner, "alice") == 0);
  free(err);
  err = NULL;
  CHECK(listed("alice", "own/secret"));
  CHECK(!listed("bob", "own/secret"));
  CHECK(!listed("", "own/secret"));

  json_t *info = NULL;
  struct stage *o = NULL;
  CHECK_EQ_INT(stage_info("own/secret", "bob", &info, &err), -ENOENT);
  CHECK(err && strstr(err, "no stage named 'own/secret'"));
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_open("own/secret", "bob", "vm", "b-aaaa", &o, &err), -ENOENT);
  CHECK(err && strstr(err, "no stage named 'own/secret'"));
  free(err);
  err = NULL;
  /* Another backend's stage would say so to its owner; to bob it is unknown. */
  CHECK_EQ_INT(stage_open("own/secret", "", "ns", "b-aaaa", &o, &err), -ENOENT);
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_rm("own/secret", "bob", &err), -ENOENT);
  CHECK(err && strstr(err, "no stage named 'own/secret'"));
  free(err);
  err = NULL;

  /* Bob cannot take the name, not even with replace, and learns nothing of
   * alice's stage (its id, size, parent) from the refusal. */
  for (int replace = 0; replace < 2; replace++) {
    struct stage *b = make_owned("own/secret", "bob", "bob's ram", replace, &r, &err);
    CHECK(b == NULL);
    CHECK_EQ_INT(r, -EEXIST);
    CHECK(err && strstr(err, "'own/secret' is taken") && strstr(err, "pick another name"));
    CHECK(err && a && !strstr(err, a->id) && !strstr(err, "alice") && !strstr(err, "replace"));
    free(err);
    err = NULL;
    stage_unref(b);
  }
  CHECK_EQ_INT(count_entries(".tmp-"), 0);

  /* Alice still has it, unchanged, and sees it as before. */
  CHECK_EQ_INT(stage_open("own/secret", "alice", "vm", "b-aaaa", &o, &err), 0);
  CHECK(o == a);
  stage_unref(o);
  CHECK_EQ_INT(stage_info("own/secret", "alice", &info, &err), 0);
  CHECK(a && strcmp(json_string_value(json_object_get(info, "stage_id")), a->id) == 0);
  json_decref(info);
  /* Her own replace works. */
  struct stage *a2 = make_owned("own/secret", "alice", "alice's new ram", true, &r, &err);
  CHECK(a2 != NULL);
  free(err);
  err = NULL;
  stage_unref(a);
  stage_unref(a2);
  CHECK_EQ_INT(stage_rm("own/secret", "alice", &err), 0);
  CHECK(!listed("alice", "own/secret"));
}

/* A stage made before owners were recorded (no "owner" in its meta) is the
 * owner "" 's: stdio and HTTP without tokens keep their stages. */
static void stages_without_an_owner_are_the_empty_owners(void) {
  int r;
  char *err = NULL;
  struct stage *s = make_owned("old/one", NULL, "old ram", false, &r, &err);
  CHECK(s != NULL);
  free(err);
  err = NULL;
  if (!s)
    return;
  /* Rewrite its meta as an older server wrote it: no owner field. */
  _cleanup_free_ char *mp = xasprintf("%s/meta.json", s->dir);
  json_error_t je;
  json_t *m = json_load_file(mp, 0, &je);
  CHECK(m && json_is_string(json_object_get(m, "owner")));
  CHECK(m && strcmp(json_string_value(json_object_get(m, "owner")), "") == 0);
  json_object_del(m, "owner");
  CHECK_EQ_INT(json_dump_file(m, mp, JSON_SORT_KEYS), 0);
  json_decref(m);
  stage_unref(s);
  CHECK(listed("", "old/one"));
  CHECK(!listed("alice", "old/one"));
  struct stage *o = NULL;
  CHECK_EQ_INT(stage_open("old/one", "alice", "vm", "b-aaaa", &o, &err), -ENOENT);
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_open("old/one", "", "vm", "b-aaaa", &o, &err), 0);
  stage_unref(o);
  CHECK_EQ_INT(stage_rm("old/one", "alice", &err), -ENOENT);
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_rm("old/one", "", &err), 0);

  /* A stage that lost its meta records no owner either: damaged to "",
   * unknown to everyone else. */
  s = make_owned("old/broken", NULL, "ram", false, &r, &err);
  CHECK(s != NULL);
  free(err);
  err = NULL;
  if (!s)
    return;
  _cleanup_free_ char *bp = xasprintf("%s/meta.json", s->dir);
  stage_unref(s);
  CHECK_EQ_INT(unlink(bp), 0);
  CHECK_EQ_INT(stage_open("old/broken", "alice", "vm", "b-aaaa", &o, &err), -ENOENT);
  CHECK(err && strstr(err, "no stage named 'old/broken'") && !strstr(err, "damaged"));
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_open("old/broken", "", "vm", "b-aaaa", &o, &err), -EBADMSG);
  CHECK(err && strstr(err, "damaged"));
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_rm("old/broken", "alice", &err), -ENOENT);
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_rm("old/broken", "", &err), 0);
}

static void anonymous_goes_with_last_ref(void) {
  struct stage *s = make(NULL, "fork", false, NULL, NULL);
  CHECK(s && s->name == NULL);
  if (!s)
    return;
  CHECK(strstr(s->dir, "/.anon-") != NULL && exists(s->dir));
  _cleanup_free_ char *dir = strdup(s->dir);
  json_t *list = stage_list("");
  CHECK_EQ_INT(json_array_size(json_object_get(list, "stages")), 0);
  json_decref(list);
  stage_ref(s);
  stage_gc();
  CHECK(exists(dir));
  stage_unref(s);
  CHECK(exists(dir));
  stage_unref(s);
  CHECK(!exists(dir));
}

/* A kept stage: moved to .hib-<key>, spared by gc and by its last
 * reference, opened again by key (checked against backend and inputs), made
 * anonymous again (then it goes with its last reference), or discarded. */
static void kept_stages_outlive_their_references(void) {
  struct stage *s = make(NULL, "hibernated", false, NULL, NULL);
  CHECK(s != NULL);
  if (!s)
    return;
  char *err = NULL;
  CHECK_EQ_INT(stage_keep(s, "../escape", &err), -EINVAL);
  free(steal_ptr(err));
  CHECK_EQ_INT(stage_keep(s, "s7-abcd", &err), 0);
  _cleanup_free_ char *kept = xasprintf("%s/stages/.hib-s7-abcd", store);
  CHECK(s->kept && strcmp(s->dir, kept) == 0 && exists(kept));
  CHECK_EQ_INT(count_entries(".anon-"), 0);
  stage_unref(s);
  stage_gc();
  CHECK(exists(kept)); /* no reference, no server: still there */
  /* Opened by key, for its owner and over its inputs only. */
  struct stage *o = NULL;
  CHECK_EQ_INT(stage_open_kept("s7-abcd", "session 's7-abcd'", "", "vm", "b-bbbb", &o, &err), -ESTALE);
  CHECK(err && strstr(err, "session 's7-abcd' was hibernated over other inputs"));
  free(steal_ptr(err));
  CHECK_EQ_INT(stage_open_kept("s7-abcd", "session 's7-abcd'", "", "ns", "b-aaaa", &o, &err), -EXDEV);
  free(steal_ptr(err));
  CHECK_EQ_INT(stage_open_kept("s7-abcd", "session 's7-abcd'", "bob", "vm", "b-aaaa", &o, &err), -ENOENT);
  free(steal_ptr(err));
  CHECK_EQ_INT(stage_open_kept("s7-0000", "session 's7-0000'", "", "vm", "b-aaaa", &o, &err), -ENOENT);
  free(steal_ptr(err));
  CHECK_EQ_INT(stage_open_kept("s7-abcd", "session 's7-abcd'", "", "vm", "b-aaaa", &o, &err), 0);
  CHECK(o && o->kept && o->name == NULL);
  if (!o)
    return;
  /* Resumed: anonymous again, and gone with its last reference. */
  stage_unkeep(o);
  CHECK(!o->kept && !exists(kept) && strstr(o->dir, "/.anon-") != NULL);
  _cleanup_free_ char *anon = strdup(o->dir);
  stage_unref(o);
  CHECK(!exists(anon));
  /* Discarded while kept: gone with its last reference too. */
  struct stage *d = make(NULL, "dropped", false, NULL, NULL);
  CHECK(d && stage_keep(d, "s8-abcd", &err) == 0);
  _cleanup_free_ char *kept2 = xasprintf("%s/stages/.hib-s8-abcd", store);
  stage_discard(d);
  stage_unref(d);
  CHECK(!exists(kept2));
  /* Removed by key (nobody holds it). */
  struct stage *r = make(NULL, "removed", false, NULL, NULL);
  CHECK(r && stage_keep(r, "s9-abcd", &err) == 0);
  stage_unref(r);
  _cleanup_free_ char *kept3 = xasprintf("%s/stages/.hib-s9-abcd", store);
  CHECK(exists(kept3));
  stage_remove_kept("s9-abcd");
  CHECK(!exists(kept3));
  free(err);
}

static void quota_refused_with_the_way_out(void) {
  unsigned saved = cfg.stages_max_mb;
  cfg.stages_max_mb = 1;
  char *dir = NULL, *err = NULL;
  CHECK_EQ_INT(stage_begin(2 << 20, &dir, &err), -ENOSPC);
  CHECK(err && strstr(err, "the stages in ") && strstr(err, "of the 1 MiB IGN_MCP_STAGES_MAX_MB") &&
        strstr(err, "this one may need 2 MiB") && strstr(err, "stage_rm") &&
        strstr(err, "stage_list"));
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_begin(UINT64_MAX, &dir, &err), -ENOSPC); /* no wrap-around */
  free(err);
  err = NULL;
  /* begin lets a small one start; finish measures it and refuses. */
  CHECK_EQ_INT(stage_begin(0, &dir, &err), 0);
  _cleanup_free_ char *big = xasprintf("%s/ram", dir);
  int fd = open(big, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  static char buf[1 << 20];
  memset(buf, 'x', sizeof buf);
  CHECK(write(fd, buf, sizeof buf) == sizeof buf && write(fd, buf, sizeof buf) == sizeof buf);
  close(fd);
  struct stage *s = NULL;
  CHECK_EQ_INT(stage_finish(dir, "big", false, &vm_new, &s, &err), -ENOSPC);
  CHECK(err && strstr(err, "IGN_MCP_STAGES_MAX_MB"));
  CHECK(!exists(dir));
  free(dir);
  free(err);
  cfg.stages_max_mb = saved;
}

/* A stage of NAME whose "ram" is MIB MiB of written bytes: 0 and the
 * stage, or stage_finish's error (*RET_ERR, to free). */
static int make_mib(const char *name, unsigned mib, struct stage **ret, char **ret_err) {
  char *dir = NULL;
  int r = stage_begin(0, &dir, ret_err);
  if (r < 0)
    return r;
  _cleanup_free_ char *p = xasprintf("%s/ram", dir);
  int fd = open(p, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  static char buf[1 << 20];
  memset(buf, 'q', sizeof buf);
  for (unsigned i = 0; i < mib && fd >= 0; i++)
    CHECK(write(fd, buf, sizeof buf) == sizeof buf);
  if (fd >= 0)
    close(fd);
  r = stage_finish(dir, name, false, &vm_new, ret, ret_err);
  free(dir);
  return r;
}

/* The quota counts what is used plus the new stage: two stages that each
 * fit under the cap alone but not together, the second is refused, both
 * when it is begun (its announced need) and when it is finished (its
 * measured size); a small one that fits beside the first is taken. */
static void quota_counts_used_plus_new(void) {
  unsigned saved = cfg.stages_max_mb;
  cfg.stages_max_mb = 3;
  struct stage *first = NULL, *second = NULL, *small = NULL;
  char *err = NULL, *dir = NULL;
  CHECK_EQ_INT(make_mib("quota/first", 2, &first, &err), 0);
  CHECK(first != NULL);
  free(err);
  err = NULL;
  /* 2 MiB used, 2 MiB more announced: fits alone, not together. */
  CHECK_EQ_INT(stage_begin(2 << 20, &dir, &err), -ENOSPC);
  CHECK(dir == NULL && err && strstr(err, "this one may need 2 MiB") &&
        strstr(err, "of the 3 MiB IGN_MCP_STAGES_MAX_MB"));
  if (dir)
    stage_abort(dir);
  free(dir);
  free(err);
  err = NULL;
  /* Announced as nothing, measured at finish. */
  CHECK_EQ_INT(make_mib("quota/second", 2, &second, &err), -ENOSPC);
  CHECK(second == NULL && err && strstr(err, "IGN_MCP_STAGES_MAX_MB") && strstr(err, "stage_rm"));
  _cleanup_free_ char *second_dir = xasprintf("%s/stages/quota+second", store);
  CHECK(!exists(second_dir));
  free(err);
  err = NULL;
  CHECK_EQ_INT(make_mib("quota/small", 0, &small, &err), 0);
  free(err);
  err = NULL;
  if (second) { /* only when the cap let it through */
    stage_unref(second);
    stage_rm("quota/second", "", &err);
  }
  stage_unref(small);
  stage_unref(first);
  CHECK_EQ_INT(stage_rm("quota/small", "", &err), 0);
  CHECK_EQ_INT(stage_rm("quota/first", "", &err), 0);
  free(err);
  cfg.stages_max_mb = saved;
}

static void flipped_byte_fails_first_open(void) {
  struct stage *s = make("flip", "0123456789", false, NULL, NULL);
  if (!s)
    return;
  _cleanup_free_ char *ram = xasprintf("%s/ram", s->dir);
  stage_unref(s);
  /* Trusted by the server that made it; a fresh server checks. */
  stage_test_forget();
  struct stage *o = NULL;
  char *err = NULL;
  CHECK_EQ_INT(stage_open("flip", "", "vm", "b-aaaa", &o, &err), 0);
  stage_unref(o);
  int fd = open(ram, O_WRONLY | O_CLOEXEC);
  CHECK(pwrite(fd, "X", 1, 3) == 1);
  close(fd);
  CHECK_EQ_INT(stage_open("flip", "", "vm", "b-aaaa", &o, &err), 0); /* verified once: cached */
  stage_unref(o);
  stage_test_forget();
  CHECK_EQ_INT(stage_open("flip", "", "vm", "b-aaaa", &o, &err), -EBADMSG);
  CHECK(err && strstr(err, "'flip'") && strstr(err, "stage_rm") && strstr(err, "commit"));
  free(err);
  err = NULL;
  /* A file added is caught too. */
  fd = open(ram, O_WRONLY | O_CLOEXEC);
  CHECK(pwrite(fd, "3", 1, 3) == 1);
  close(fd);
  CHECK_EQ_INT(stage_open("flip", "", "vm", "b-aaaa", &o, &err), 0);
  stage_unref(o);
  stage_test_forget();
  _cleanup_free_ char *dir = xasprintf("%s/stages/flip", store);
  write_file(dir, "extra", "");
  CHECK_EQ_INT(stage_open("flip", "", "vm", "b-aaaa", &o, &err), -EBADMSG);
  free(err);
  err = NULL;
  /* A meta whose inputs were edited to pass the inputs check is caught by
   * its content id. */
  _cleanup_free_ char *extra = xasprintf("%s/extra", dir);
  unlink(extra);
  stage_test_forget();
  CHECK_EQ_INT(stage_open("flip", "", "vm", "b-aaaa", &o, &err), 0);
  stage_unref(o);
  _cleanup_free_ char *meta = xasprintf("%s/meta.json", dir);
  char text[4096];
  int mfd = open(meta, O_RDWR | O_CLOEXEC);
  ssize_t n = pread(mfd, text, sizeof text - 1, 0);
  CHECK(n > 0);
  text[n > 0 ? n : 0] = '\0';
  char *at = strstr(text, "b-aaaa");
  CHECK(at != NULL);
  if (at) {
    memcpy(at, "b-cccc", 6);
    CHECK(pwrite(mfd, text, (size_t)n, 0) == n);
  }
  close(mfd);
  stage_test_forget();
  CHECK_EQ_INT(stage_open("flip", "", "vm", "b-cccc", &o, &err), -EBADMSG);
  free(err);
  err = NULL;
  CHECK_EQ_INT(stage_rm("flip", "", &err), 0);
}

static void gc_removes_dead_servers_leftovers(void) {
  pid_t pid = fork();
  if (pid == 0)
    _exit(0);
  waitpid(pid, NULL, 0);
  _cleanup_free_ char *tmp = xasprintf("%s/stages/.tmp-%d-1", store, (int)pid);
  _cleanup_free_ char *anon = xasprintf("%s/stages/.anon-%d-1", store, (int)pid);
  char *mine = NULL, *err = NULL;
  CHECK_EQ_INT(stage_begin(0, &mine, &err), 0);
  CHECK(mkdir(tmp, 0700) == 0 && mkdir(anon, 0700) == 0);
  write_file(tmp, "ram", "half");
  write_file(anon, "meta.json", "{}");
  write_file(anon, "ram", "");
  write_file(store, "stages/.rm-1-1", "not even a directory");
  stage_gc();
  CHECK(!exists(tmp));
  CHECK(!exists(anon));
  CHECK(exists(mine)); /* being made by a live server (this one) */
  _cleanup_free_ char *rmfile = xasprintf("%s/stages/.rm-1-1", store);
  CHECK(!exists(rmfile));
  /* A pid that lives (this one) does not keep a .tmp nobody holds. */
  _cleanup_free_ char *stale = xasprintf("%s/stages/.tmp-%d-999999", store, (int)getpid());
  CHECK(mkdir(stale, 0700) == 0);
  stage_gc();
  CHECK(!exists(stale));
  stage_abort(mine);
  CHECK(!exists(mine));
  free(mine);
}

static void ids_follow_content(void) {
  struct stage *a = make(NULL, "same", false, NULL, NULL);
  struct stage *b = make(NULL, "same", false, NULL, NULL);
  struct stage *c = make(NULL, "other", false, NULL, NULL);
  CHECK(a && b && c);
  if (a && b && c) {
    CHECK_STREQ(a->id, b->id);
    CHECK(strcmp(a->id, c->id) != 0);
  }
  stage_unref(a);
  stage_unref(b);
  stage_unref(c);
  CHECK_EQ_INT(count_entries(".anon-"), 0);

  /* An opaque dir (user.overlay.opaque) differs from a plain one; the mode
   * of a file counts; the time of a file does not. */
  char *ids[4] = {NULL};
  for (int i = 0; i < 4; i++) {
    char *dir = NULL, *err = NULL;
    struct stage *s = NULL;
    CHECK_EQ_INT(stage_begin(0, &dir, &err), 0);
    _cleanup_free_ char *sub = xasprintf("%s/d", dir);
    CHECK(mkdir(sub, 0755) == 0);
    write_file(sub, "f", "content");
    _cleanup_free_ char *f = xasprintf("%s/f", sub);
    if (i == 1 && setxattr(sub, "user.overlay.opaque", "y", 1, 0) < 0)
      fprintf(stderr, "  (no user xattrs here: %s)\n", strerror(errno));
    if (i == 2)
      CHECK(chmod(f, 0755) == 0);
    if (i == 3) {
      struct timespec ts[2] = {{.tv_sec = 1}, {.tv_sec = 1}};
      CHECK(utimensat(AT_FDCWD, f, ts, 0) == 0);
    }
    CHECK_EQ_INT(stage_finish(dir, NULL, false, &vm_new, &s, &err), 0);
    free(dir);
    ids[i] = s ? strdup(s->id) : NULL;
    stage_unref(s);
  }
  CHECK(ids[0] && ids[1] && ids[2] && ids[3]);
  if (ids[0] && ids[1] && ids[2] && ids[3]) {
    CHECK(strcmp(ids[0], ids[2]) != 0);
    CHECK_STREQ(ids[0], ids[3]);
    char probe[256];
    if (test_mkdtemp(probe, sizeof probe, "test-stage-xattr")) {
      if (setxattr(probe, "user.x", "y", 1, 0) == 0)
        CHECK(strcmp(ids[0], ids[1]) != 0);
      rmdir(probe);
    }
  }
  for (int i = 0; i < 4; i++)
    free(ids[i]);
}

/* Holes and explicit zeros hash the same; a 256 MiB sparse RAM file hashes
 * fast. */
static void sparse_ram_hashes_fast(void) {
  char *dirs[2] = {NULL, NULL}, *err = NULL;
  struct stage *s[2] = {NULL, NULL};
  uint64_t ms[2];
  static char buf[1 << 20];
  for (int i = 0; i < 2; i++) {
    CHECK_EQ_INT(stage_begin(0, &dirs[i], &err), 0);
    _cleanup_free_ char *ram = xasprintf("%s/ram", dirs[i]);
    int fd = open(ram, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    CHECK(ftruncate(fd, 256 << 20) == 0);
    memset(buf, 0, sizeof buf);
    if (i == 1) /* the other one has 2 MiB of real zeros in its holes */
      CHECK(pwrite(fd, buf, sizeof buf, 10 << 20) == sizeof buf &&
            pwrite(fd, buf, sizeof buf, 100 << 20) == sizeof buf);
    memset(buf, 0x5a, sizeof buf);
    for (int k = 0; k < 16; k++)
      CHECK(pwrite(fd, buf, sizeof buf, (off_t)k * (8 << 20) + 4096) == sizeof buf);
    close(fd);
    uint64_t t0 = mono_ms();
    CHECK_EQ_INT(stage_finish(dirs[i], NULL, false, &vm_new, &s[i], &err), 0);
    ms[i] = mono_ms() - t0;
    free(dirs[i]);
  }
  CHECK(s[0] && s[1] && !strcmp(s[0]->id, s[1]->id));
  CHECK(s[0] && s[0]->bytes < (64u << 20));
  fprintf(stderr, "  256 MiB sparse RAM file with 16 MiB of data: finished in %llu and %llu ms\n",
          (unsigned long long)ms[0], (unsigned long long)ms[1]);
  CHECK(ms[0] < 2000); /* ASan, and a loaded host: the plain build takes a fraction */
  stage_unref(s[0]);
  stage_unref(s[1]);
}

/* What a sandbox may leave: a link out, a FIFO, a whiteout, an opaque dir,
 * a tree deeper than a stage may be. */
static void hostile_tree_neither_followed_nor_hanging(void) {
  char *dir = NULL, *err = NULL;
  struct stage *s = NULL;
  CHECK_EQ_INT(stage_begin(0, &dir, &err), 0);
  _cleanup_free_ char *layer = xasprintf("%s/layer", dir);
  _cleanup_free_ char *lnk = xasprintf("%s/passwd", layer);
  _cleanup_free_ char *fifo = xasprintf("%s/fifo", layer);
  _cleanup_free_ char *wh = xasprintf("%s/gone", layer);
  CHECK(mkdir(layer, 0755) == 0);
  CHECK(symlink("/etc/passwd", lnk) == 0);
  CHECK(mkfifo(fifo, 0600) == 0);
  CHECK(mknod(wh, S_IFCHR | 0000, makedev(0, 0)) == 0 || errno == EPERM);
  setxattr(layer, "user.overlay.opaque", "y", 1, 0); /* where the fs allows it */
  uint64_t t0 = mono_ms();
  CHECK_EQ_INT(stage_finish(dir, "hostile", false, &vm_new, &s, &err), 0);
  CHECK(mono_ms() - t0 < 5000);
  free(dir);
  if (s) {
    _cleanup_free_ char *moved = xasprintf("%s/layer/passwd", s->dir);
    char target[64] = "";
    CHECK(readlink(moved, target, sizeof target - 1) > 0 && !strcmp(target, "/etc/passwd"));
    stage_unref(s);
    stage_test_forget();
    CHECK_EQ_INT(stage_open("hostile", "", "vm", "b-aaaa", &s, &err), 0);
    stage_unref(s);
  }
  CHECK_EQ_INT(stage_rm("hostile", "", &err), 0);
  CHECK(exists("/etc/passwd"));

  /* 600 directories deep: refused with a clear error, and removed. */
  CHECK_EQ_INT(stage_begin(0, &dir, &err), 0);
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  for (int i = 0; i < 600 && fd >= 0; i++) {
    CHECK(mkdirat(fd, "d", 0700) == 0);
    int nfd = openat(fd, "d", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    close(fd);
    fd = nfd;
  }
  if (fd >= 0)
    close(fd);
  s = NULL;
  CHECK_EQ_INT(stage_finish(dir, "deep", false, &vm_new, &s, &err), -ELOOP);
  CHECK(err && strstr(err, "512 directories deep"));
  CHECK(!exists(dir));
  free(err);
  free(dir);
  CHECK_EQ_INT(count_entries(".tmp-"), 0);
  CHECK_EQ_INT(count_entries("deep"), 0);
}


/* Another server (a child process with the same store) holds a stage this
 * one removes: the name goes, the files stay until that server lets go. */
static void held_by_another_server(void) {
  struct stage *s = make("shared", "ram of a shared stage", false, NULL, NULL);
  if (!s)
    return;
  stage_unref(s);
  int up[2], down[2];
  CHECK(pipe(up) == 0 && pipe(down) == 0);
  pid_t pid = fork();
  if (pid == 0) {
    struct stage *o = NULL;
    char *err = NULL;
    int r = stage_open("shared", "", "vm", "b-aaaa", &o, &err);
    char c = r == 0 ? 'y' : 'n';
    if (write(up[1], &c, 1) != 1 || read(down[0], &c, 1) < 0)
      _exit(2);
    _exit(r == 0 ? 0 : 1);
  }
  char c = 0;
  CHECK(read(up[0], &c, 1) == 1 && c == 'y');
  char *err = NULL;
  CHECK_EQ_INT(stage_rm("shared", "", &err), 0);
  CHECK_EQ_INT(count_entries(".rm-"), 1);
  stage_gc();
  CHECK_EQ_INT(count_entries(".rm-"), 1);
  CHECK(write(down[1], "x", 1) == 1);
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  stage_gc();
  CHECK_EQ_INT(count_entries(".rm-"), 0);
  close(up[0]), close(up[1]), close(down[0]), close(down[1]);

  /* The other way round: another server removes a stage this one holds;
   * this one's last reference frees it, with no clean-up called. */
  s = make("shared2", "ram", false, NULL, NULL);
  if (!s)
    return;
  pid = fork();
  if (pid == 0) {
    char *e = NULL;
    _exit(stage_rm("shared2", "", &e) == 0 ? 0 : 1);
  }
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK_EQ_INT(count_entries(".rm-"), 1);
  stage_unref(s);
  CHECK_EQ_INT(count_entries(".rm-"), 0);
}

/* A stage of NAME whose "ram" and "layer/file" hold CONTENT. */
static int make_with_layer(const char *name, const char *content, bool replace,
                           struct stage **ret) {
  char *dir = NULL, *err = NULL;
  int r = stage_begin(1 << 20, &dir, &err);
  if (r == 0) {
    write_file(dir, "ram", content);
    write_file(dir, "state", "device state");
    _cleanup_free_ char *layer = xasprintf("%s/layer", dir);
    CHECK(mkdir(layer, 0755) == 0);
    write_file(layer, "file", content);
    r = stage_finish(dir, name, replace, &vm_new, ret, &err);
  }
  if (r < 0)
    fprintf(stderr, "  %s\n", err);
  free(dir);
  free(err);
  return r;
}

/* The first bytes of the file at PATH, as a string (malloc'd), or NULL. */
static char *read_path(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  char buf[256];
  ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof buf - 1);
  if (fd >= 0)
    close(fd);
  if (n < 0)
    return NULL;
  buf[n] = '\0';
  return strdup(buf);
}

/* What stage_open_file gives for NAME (a file, or DIR/file) of S. */
static char *read_through(const struct stage *s, const char *name) {
  char *err = NULL;
  int fd = -1;
  bool in_layer = strcmp(name, "layer") == 0;
  if (stage_open_file(s, name, in_layer ? O_PATH | O_DIRECTORY : O_RDONLY, &fd, &err) < 0) {
    fprintf(stderr, "  stage_open_file %s: %s\n", name, err);
    free(err);
    return NULL;
  }
  if (in_layer) {
    int dfd = fd;
    fd = openat(dfd, "file", O_RDONLY | O_CLOEXEC);
    close(dfd);
  }
  char buf[256];
  ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof buf - 1);
  if (fd >= 0)
    close(fd);
  if (n < 0)
    return NULL;
  buf[n] = '\0';
  return strdup(buf);
}

/* Another server (another process sharing the store) commits with replace
 * under the name of a stage this server has opened and checked, after the
 * check and before a session is laid over it: what this server's session
 * gets through the stage (its RAM and state, its layer) is still what was
 * checked, whose stage_id it reports; the name holds the other stage. */
static void replaced_by_another_server_after_the_check(void) {
  struct stage *made = NULL, *s = NULL;
  char *err = NULL;
  CHECK_EQ_INT(make_with_layer("swap/opened", "checked content", false, &made), 0);
  if (!made)
    return;
  _cleanup_free_ char *checked_id = strdup(made->id);
  stage_unref(made);
  stage_test_forget(); /* opened as a server that did not make it: checked now */
  CHECK_EQ_INT(stage_open("swap/opened", "", "vm", "b-aaaa", &s, &err), 0);
  free(err);
  err = NULL;
  /* One made by this server is held the same way. */
  CHECK_EQ_INT(make_with_layer("swap/made", "checked content", false, &made), 0);
  if (!s || !made)
    goto out;
  CHECK_STREQ(s->id, checked_id);

  pid_t pid = fork();
  if (pid == 0) {
    struct stage *o1 = NULL, *o2 = NULL;
    int r1 = make_with_layer("swap/opened", "another server's", true, &o1);
    int r2 = make_with_layer("swap/made", "another server's", true, &o2);
    _exit(r1 == 0 && r2 == 0 ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);

  struct stage *both[] = {s, made};
  for (size_t i = 0; i < 2; i++) {
    /* The name is the other stage's now ... */
    _cleanup_free_ char *by_name = xasprintf("%s/stages/%s/ram", store,
                                             i == 0 ? "swap+opened" : "swap+made");
    _cleanup_free_ char *there = read_path(by_name);
    CHECK(there && strcmp(there, "another server's") == 0);
    json_t *info = NULL;
    CHECK_EQ_INT(stage_info(i == 0 ? "swap/opened" : "swap/made", "", &info, &err), 0);
    CHECK(info && strcmp(json_string_value(json_object_get(info, "stage_id")), both[i]->id) != 0);
    json_decref(info);
    /* ... and the files through the stage are the checked ones. */
    static const char *const names[] = {"ram", "state", "layer"};
    for (size_t k = 0; k < ARRAY_SIZE(names); k++) {
      _cleanup_free_ char *got = read_through(both[i], names[k]);
      CHECK_STREQ(got, k == 1 ? "device state" : "checked content");
    }
    CHECK_STREQ(both[i]->id, checked_id);
  }
out:
  stage_unref(s);
  stage_unref(made);
  CHECK_EQ_INT(stage_rm("swap/opened", "", &err), 0);
  CHECK_EQ_INT(stage_rm("swap/made", "", &err), 0);
  free(err);
  stage_gc();
  CHECK_EQ_INT(count_entries(".rm-"), 0);
}

static void *open_many(void *arg) {
  struct stage **out = arg;
  char *err = NULL;
  for (int i = 0; i < 8; i++)
    if (stage_open("threads", "", "vm", "b-aaaa", &out[i], &err) < 0) {
      free(err);
      out[i] = NULL;
    }
  return NULL;
}

/* Opens from many threads share one struct and count every reference; a
 * fresh server verifies concurrently without harm. */
static void concurrent_opens_share_one_stage(void) {
  struct stage *s = make("threads", "threaded ram", false, NULL, NULL);
  if (!s)
    return;
  stage_unref(s);
  stage_test_forget();
  enum { T = 4 };
  struct stage *got[T][8];
  pthread_t t[T];
  for (int i = 0; i < T; i++)
    pthread_create(&t[i], NULL, open_many, got[i]);
  for (int i = 0; i < T; i++)
    pthread_join(t[i], NULL);
  struct stage *first = got[0][0];
  CHECK(first != NULL);
  for (int i = 0; i < T; i++)
    for (int k = 0; k < 8; k++)
      CHECK(got[i][k] == first);
  if (first)
    CHECK_EQ_INT(first->refs, T * 8);
  for (int i = 0; i < T; i++)
    for (int k = 0; k < 8; k++)
      stage_unref(got[i][k]);
  char *err = NULL;
  CHECK_EQ_INT(stage_rm("threads", "", &err), 0);
  CHECK_EQ_INT(count_entries(".rm-"), 0);
}

static int count_fds(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  while (d && readdir(d))
    n++;
  if (d)
    closedir(d);
  return n;
}

static int fds_at_start;

/* Inodes count against the quota (4 KiB each): empty files take no block,
 * and without this a sandbox's million empty files made a stage of a few
 * MiB of directories that took a million of the store's inodes. */
static void quota_counts_inodes(void) {
  unsigned old_max = cfg.stages_max_mb;
  cfg.stages_max_mb = 8;
  char *dir = NULL, *err = NULL;
  struct stage *s = NULL;
  CHECK_EQ_INT(stage_begin(1 << 20, &dir, &err), 0);
  for (int i = 0; i < 3000 && dir; i++) {
    _cleanup_free_ char *p = xasprintf("%s/e%d", dir, i);
    int fd = open(p, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    CHECK(fd >= 0);
    close(fd);
  }
  CHECK_EQ_INT(stage_finish(dir, "inodes/many", false, &vm_new, &s, &err), -ENOSPC);
  CHECK(err && strstr(err, "IGN_MCP_STAGES_MAX_MB") && strstr(err, "stage_rm") &&
        strstr(err, "4 KiB"));
  CHECK(s == NULL && !exists(dir));
  free(dir);
  free(err);
  dir = err = NULL;
  /* A few hundred fit, and are recorded in the meta. */
  CHECK_EQ_INT(stage_begin(1 << 20, &dir, &err), 0);
  for (int i = 0; i < 300 && dir; i++) {
    _cleanup_free_ char *p = xasprintf("%s/e%d", dir, i);
    int fd = open(p, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    close(fd);
  }
  CHECK_EQ_INT(stage_finish(dir, "inodes/few", false, &vm_new, &s, &err), 0);
  if (s) {
    _cleanup_free_ char *mp = xasprintf("%s/meta.json", s->dir);
    json_t *j = json_load_file(mp, 0, NULL);
    CHECK(j && json_integer_value(json_object_get(j, "inodes")) == 301); /* the directory and its files */
    json_decref(j);
    stage_unref(s);
  }
  CHECK_EQ_INT(stage_rm("inodes/few", "", &err), 0);
  free(dir);
  free(err);
  cfg.stages_max_mb = old_max;
}

/* stages/ of another uid is refused (its owner could plant or swap
 * stages); one its group may write in loses the group's write right. */
static void stages_dir_only_the_servers(void) {
  _cleanup_free_ char *sd = xasprintf("%s/stages", store);
  char *dir = NULL, *err = NULL;
  if (geteuid() == 0) {
    CHECK_EQ_INT(chown(sd, 4242, 4242), 0);
    CHECK_EQ_INT(stage_begin(1 << 20, &dir, &err), -EPERM);
    CHECK(err && strstr(err, "belongs to uid 4242") && strstr(err, "move it away"));
    CHECK(dir == NULL);
    free(err);
    err = NULL;
    CHECK_EQ_INT(chown(sd, 0, 0), 0);
  } else {
    printf("# skip the owner half of stages_dir_only_the_servers: needs root to chown\n");
  }
  CHECK_EQ_INT(chmod(sd, 0775), 0);
  CHECK_EQ_INT(stage_begin(1 << 20, &dir, &err), 0);
  struct stat st;
  CHECK(stat(sd, &st) == 0 && (st.st_mode & 07777) == 0750);
  stage_abort(dir);
  free(dir);
  free(err);
  CHECK_EQ_INT(chmod(sd, 0700), 0);
}

static void setup(void) {
  fds_at_start = count_fds();
  if (!test_mkdtemp(store, sizeof store, "test-stage"))
    abort();
  cfg.store = store;
  cfg.stages_max_mb = 1024;
  /* Made open to others by someone before: closed on first use. */
  _cleanup_free_ char *sd = xasprintf("%s/stages", store);
  CHECK(mkdir(sd, 0705) == 0 && chmod(sd, 0705) == 0);
}

static void stage_gone_after_all(void) {
  stage_gc();
  CHECK_EQ_INT(count_fds(), fds_at_start); /* no fd left open by the store */
  CHECK_EQ_INT(count_entries(".tmp-") + count_entries(".rm-") + count_entries(".anon-") +
                   count_entries(".hib-"),
               0);
  fs_remove_tree(store);
  CHECK(!exists(store));
}

static void run_setup(void) { setup(); }

TEST_MAIN(TEST(run_setup), TEST(name_rules), TEST(only_begin_dirs_are_taken),
          TEST(make_open_list_info_rm),
          TEST(replace_only_when_asked), TEST(stages_belong_to_their_owner),
          TEST(stages_without_an_owner_are_the_empty_owners), TEST(anonymous_goes_with_last_ref),
          TEST(kept_stages_outlive_their_references), TEST(quota_refused_with_the_way_out), TEST(quota_counts_used_plus_new), TEST(flipped_byte_fails_first_open),
          TEST(gc_removes_dead_servers_leftovers), TEST(ids_follow_content),
          TEST(sparse_ram_hashes_fast), TEST(held_by_another_server),
          TEST(replaced_by_another_server_after_the_check),
          TEST(concurrent_opens_share_one_stage), TEST(hostile_tree_neither_followed_nor_hanging),
          TEST(stages_dir_only_the_servers), TEST(quota_counts_inodes), TEST(stage_gone_after_all))
