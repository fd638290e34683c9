/* test_vm_snapshot.c: the vm backend's snapshot of a running session and
 * sessions started from it (issue #11), for real: a QEMU clone runs a
 * background counter and keeps a file; ops->snapshot saves it into a stage
 * directory while it runs; a sandbox created from that stage has the file,
 * the live process and its counter, and a CRNG of its own; the source runs
 * on, unaffected by the fork; a stage replaced under its name by another
 * server after it was opened still starts from the files that were
 * checked; a stage with a short RAM file is refused at once.  With
 * IGN_TEST_SOAK=1, a soak: a source rewrites self-checking 2 MiB files
 * while it is snapshotted IGN_TEST_SNAP_RUNS times (20) in a row, and every
 * file in a session from each snapshot must check (a page the stream lost
 * shows as a bad file or a guest that panicked; docs/vm-recipe.md 5b).
 *
 * Needs QEMU and the VM images (build/vm, `make vm-images`); without them
 * it prints one "ok - ... # skip" line.  The warm base is made in
 * IGN_TEST_VM_STORE when set (and kept there), else in a temporary store
 * removed afterwards (the first boot then takes a minute under TCG). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/config.h"
#include "common/fs.h"
#include "common/util.h"
#include "proto/client.h"
#include "sandbox/sandbox.h"
#include "sandbox/stage.h"
#include "sandbox/vm.h"
#include "test.h"

static char store[PATH_MAX];
static bool own_store;

struct box {
  struct sandbox *sb;
  struct agent_conn *conn;
};

static bool box_open(const struct stage *st, struct box *b) {
  struct sandbox_config sc = {.memory_mb = 256, .pids = 256, .overlay_mb = 64, .stage = st};
  char *err = NULL;
  uint64_t t0 = mono_us();
  int r = sandbox_vm_ops.create(&sc, "test", &b->sb, &err);
  if (r == 0) {
    r = sandbox_connect(b->sb, 20000, &b->conn, &err);
    b->sb->fd = -1;
  }
  if (r == 0)
    r = sandbox_vm_ops.ready(b->sb, b->conn, &err);
  if (r < 0) {
    char *why = b->sb ? sandbox_vm_ops.death_reason(b->sb) : NULL;
    fprintf(stderr, "  create%s: %s (%s)\n", st ? " from the stage" : "", err, why ? why : "");
    free(why);
    free(err);
    return false;
  }
  printf("# %s sandbox answered in %.1f ms\n", st ? "stage" : "base", (mono_us() - t0) / 1000.0);
  return true;
}

static void box_close(struct box *b) {
  agent_conn_free(b->conn);
  if (b->sb)
    sandbox_vm_ops.destroy(b->sb);
  *b = (struct box){0};
}

/* Runs CMD in B; its stdout (NUL-terminated, trailing newline cut), or NULL. */
static char *run(struct box *b, const char *cmd) {
  struct agent_exec_req req = {.command = cmd, .timeout_ms = 20000, .out_cap = 4096};
  struct agent_exec_res res;
  char *err = NULL;
  if (agent_exec(b->conn, &req, NULL, &res, &err) < 0) {
    fprintf(stderr, "  exec %s: %s\n", cmd, err);
    free(err);
    return NULL;
  }
  char *out = strndup(res.out ? res.out : "", res.out_len);
  if (res.exit_code != 0)
    fprintf(stderr, "  exec %s: exit %d: %.*s\n", cmd, res.exit_code, (int)res.err_len, res.err);
  agent_exec_res_free(&res);
  size_t n = strlen(out);
  while (n && out[n - 1] == '\n')
    out[--n] = '\0';
  return out;
}

static bool setup(void) {
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0)
    return false;
  exe[n] = '\0';
  *strrchr(exe, '/') = '\0'; /* build/test */
  char vm[PATH_MAX + 8];
  snprintf(vm, sizeof vm, "%s/../vm", exe);
  char files[3][PATH_MAX + 40];
  snprintf(files[0], sizeof files[0], "%s/vmlinux", vm);
  snprintf(files[1], sizeof files[1], "%s/initramfs.cpio", vm);
  snprintf(files[2], sizeof files[2], "%s/rootfs-small.erofs", vm);
  for (int i = 0; i < 3; i++)
    if (access(files[i], R_OK) < 0) {
      printf("ok - vm_snapshot # skip %s is missing (make vm-images)\n", files[i]);
      return false;
    }
  if (access("/usr/bin/qemu-system-x86_64", X_OK) < 0) {
    printf("ok - vm_snapshot # skip no qemu-system-x86_64\n");
    return false;
  }
  const char *given = getenv("IGN_TEST_VM_STORE");
  if (given && *given) {
    snprintf(store, sizeof store, "%s", given);
  } else {
    if (!test_mkdtemp(store, sizeof store, "ign-test-vm-snap") || chmod(store, 0755) < 0)
      return false;
    own_store = true;
  }
  setenv("IGN_MCP_STORE", store, 1);
  setenv("IGN_MCP_BACKEND", "vm", 1);
  setenv("IGN_MCP_ROOTFS", "small", 1);
  setenv("IGN_MCP_KERNEL", files[0], 1);
  setenv("IGN_MCP_INITRAMFS", files[1], 1);
  setenv("IGN_MCP_VM_IMAGE", files[2], 1);
  setenv("IGN_MCP_POOL", getenv("IGN_TEST_POOL") ? getenv("IGN_TEST_POOL") : "0", 1);
  setenv("IGN_MCP_SPARES", "0", 1);
  if (config_load() < 0)
    return false;
  char *err = NULL;
  if (vm_backend_init(&err) < 0) {
    printf("ok - vm_snapshot # skip the vm backend cannot start here: %s\n", err);
    free(err);
    return false;
  }
  return true;
}

/* Bytes allocated on disk by DIR's ram and state. */
static uint64_t dir_bytes(const char *dir) {
  uint64_t n = 0;
  const char *names[] = {"ram", "state"};
  for (int i = 0; i < 2; i++) {
    char *p = xasprintf("%s/%s", dir, names[i]);
    struct stat st;
    if (stat(p, &st) == 0)
      n += (uint64_t)st.st_blocks * 512;
    free(p);
  }
  return n;
}

static char *make_stage_dir(const char *name) {
  char *dir = xasprintf("%s/stage-test-%s-%d", store, name, getpid());
  fs_remove_tree(dir);
  if (mkdir(dir, 0700) < 0) {
    fprintf(stderr, "  mkdir %s: %s\n", dir, strerror(errno));
    free(dir);
    return NULL;
  }
  return dir;
}

/* Turns DIR (a snapshot's) into stage NAME, as the session layer does. */
static int finish_stage(const char *dir, const char *name, const char *carries, struct stage **ret,
                        char **err) {
  char *inputs = NULL, *inputs_text = NULL;
  int r = sandbox_vm_ops.inputs_id(&inputs, &inputs_text, err);
  struct stage_new in = {.backend = "vm", .inputs_id = inputs, .carries = carries};
  if (r == 0)
    r = stage_finish(dir, name, true, &in, ret, err);
  free(inputs);
  free(inputs_text);
  if (r < 0)
    fprintf(stderr, "  stage_finish: %s\n", *err);
  return r;
}

static void snapshot_and_fork(void) {
  struct box src = {0}, fork1 = {0}, fork2 = {0};
  char *err = NULL, *dir = NULL, *bg = NULL;
  struct stage *st = NULL;
  int r;
  CHECK(box_open(NULL, &src));
  if (!src.conn)
    goto out;
  char *o = run(&src, "echo before > /tmp/marker; (i=0; while :; do i=$((i+1)); echo $i > "
                      "/tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done) </dev/null >/dev/null 2>&1 & echo $!");
  CHECK(o && *o);
  bg = o;
  o = NULL;
  usleep(300000);

  /* The inputs id names the base. */
  char *id = NULL, *text = NULL;
  CHECK_EQ_INT(sandbox_vm_ops.inputs_id(&id, &text, &err), 0);
  CHECK(id && strncmp(id, "b-", 2) == 0 && strlen(id) == 18);
  CHECK(text && strstr(text, "accel="));
  free(id);
  free(text);

  /* Into a directory of the stage store, as the session layer does. */
  r = stage_begin(((uint64_t)cfg.vm_memory_mb + 4) << 20, &dir, &err);
  if (r < 0)
    fprintf(stderr, "  stage_begin: %s\n", err);
  CHECK(dir);
  if (!dir)
    goto out;
  struct sandbox_snapshot snap = {0};
  uint64_t t0 = mono_us();
  r = sandbox_vm_ops.snapshot(src.sb, dir, &snap, &err);
  uint64_t took = mono_us() - t0;
  if (r < 0)
    fprintf(stderr, "  snapshot: %s\n", err);
  CHECK_EQ_INT(r, 0);
  if (r < 0)
    goto out;
  CHECK_STREQ(snap.carries, "memory");
  uint64_t bytes = dir_bytes(dir);
  printf("# snapshot: %.1f ms, source paused %.2f ms, %" PRIu64 " MiB on disk\n", took / 1000.0,
         snap.paused_us / 1000.0, bytes >> 20);
  /* Stopped or live (SNAPSHOT_LIVE_QEMU): bounded, not timed (a loaded host). */
  CHECK(snap.paused_us < 20000000);
  CHECK(bytes < (256ull << 20));

  /* The source runs on. */
  o = run(&src, "echo after > /tmp/marker; cat /tmp/marker");
  CHECK(o && strcmp(o, "after") == 0);
  free(o);

  r = finish_stage(dir, "test-vm-snapshot", snap.carries, &st, &err);
  CHECK_EQ_INT(r, 0);
  free(steal_ptr(dir)); /* it is the stage's now */
  if (r < 0)
    goto out;
  printf("# stage %s: %" PRIu64 " MiB allocated\n", st->id, st->bytes >> 20);
  CHECK(st->bytes < (256ull << 20));
  /* Another server sharing the store commits with replace under the name
   * now: a stage with a RAM file of 4096 bytes.  This server's sessions of
   * the stage it holds still start from the files it made (and checked). */
  pid_t other = fork();
  if (other == 0) {
    char *odir = NULL, *oerr = NULL;
    struct stage *ost = NULL;
    if (stage_begin(1 << 20, &odir, &oerr) < 0)
      _exit(1);
    _cleanup_free_ char *oram = xasprintf("%s/ram", odir), *ostate = xasprintf("%s/state", odir);
    int ofd = open(oram, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (ofd < 0 || ftruncate(ofd, 4096) < 0)
      _exit(1);
    close(ofd);
    ofd = open(ostate, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (ofd < 0 || write(ofd, "x", 1) != 1)
      _exit(1);
    close(ofd);
    struct stage_new oin = {.backend = "vm", .inputs_id = st->inputs_id, .carries = "memory"};
    _exit(stage_finish(odir, "test-vm-snapshot", true, &oin, &ost, &oerr) == 0 ? 0 : 1);
  }
  int other_status = 0;
  waitpid(other, &other_status, 0);
  CHECK(WIFEXITED(other_status) && WEXITSTATUS(other_status) == 0);
  CHECK(box_open(st, &fork1));
  CHECK(box_open(st, &fork2));
  if (!fork1.conn || !fork2.conn)
    goto out;
  /* The fork has the source's file as of the snapshot, and its process. */
  o = run(&fork1, "cat /tmp/marker");
  CHECK(o && strcmp(o, "before") == 0);
  free(o);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "kill -0 %s && echo alive", bg);
  o = run(&fork1, cmd);
  CHECK(o && strcmp(o, "alive") == 0);
  free(o);
  /* Its counter goes on from where it was. */
  char *c1 = run(&fork1, "cat /tmp/count");
  usleep(400000);
  char *c2 = run(&fork1, "cat /tmp/count");
  CHECK(c1 && c2 && atoi(c2) > atoi(c1) && atoi(c1) > 0);
  free(c1);
  free(c2);
  /* The forks diverge from the source and from each other. */
  free(run(&fork1, "echo one > /tmp/marker"));
  o = run(&fork2, "cat /tmp/marker");
  CHECK(o && strcmp(o, "before") == 0);
  free(o);
  o = run(&src, "cat /tmp/marker");
  CHECK(o && strcmp(o, "after") == 0);
  free(o);
  /* The CRNG was reseeded in each: no two give the same bytes. */
  const char *rnd = "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'";
  char *r0 = run(&src, rnd), *r1 = run(&fork1, rnd), *r2 = run(&fork2, rnd);
  CHECK(r0 && r1 && r2 && strcmp(r0, r1) != 0 && strcmp(r1, r2) != 0 && strcmp(r0, r2) != 0);
  free(r0);
  free(r1);
  free(r2);
  /* A chain: a stage of a session started from a stage, made with the
   * loader the first snapshot left waiting. */
  usleep(300000);
  struct box chain = {0};
  char *dir2 = NULL;
  struct stage *st2 = NULL;
  CHECK_EQ_INT(stage_begin(((uint64_t)cfg.vm_memory_mb + 4) << 20, &dir2, &err), 0);
  if (dir2) {
    t0 = mono_us();
    r = sandbox_vm_ops.snapshot(fork1.sb, dir2, &snap, &err);
    if (r < 0)
      fprintf(stderr, "  second snapshot: %s\n", err);
    CHECK_EQ_INT(r, 0);
    printf("# second snapshot (a chain): %.1f ms, source paused %.2f ms\n",
           (mono_us() - t0) / 1000.0, snap.paused_us / 1000.0);
    struct stage_new in2 = {.backend = "vm", .inputs_id = st->inputs_id, .carries = "memory",
                            .parent = st};
    if (r == 0 && stage_finish(dir2, NULL, false, &in2, &st2, &err) == 0) {
      CHECK(box_open(st2, &chain));
      o = chain.conn ? run(&chain, "cat /tmp/marker") : NULL;
      CHECK(o && strcmp(o, "one") == 0);
      free(o);
    } else {
      stage_abort(dir2);
    }
    free(dir2);
  }
  box_close(&chain);
  if (st2)
    stage_unref(st2);
  o = run(&fork1, "hostname");
  char *h2 = run(&fork2, "hostname");
  CHECK(o && h2 && strcmp(o, h2) != 0);
  free(o);
  free(h2);

out:
  box_close(&fork1);
  box_close(&fork2);
  box_close(&src);
  free(bg);
  if (dir)
    fs_remove_tree(dir);
  free(dir);
  free(err);
  if (st) {
    char *rm_err = NULL;
    CHECK_EQ_INT(stage_rm("test-vm-snapshot", "", &rm_err), 0);
    free(rm_err);
    stage_unref(st);
  }
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* Snapshots SRC into a new stage "soak", opens a session from it, runs
 * CHECK there; its output, or NULL (the guest panicked, or a step failed). */
static char *snapshot_and_check(struct box *src, const char *check, uint64_t *ret_paused_us) {
  char *dir = NULL, *err = NULL, *out = NULL;
  struct stage *st = NULL;
  if (stage_begin(((uint64_t)cfg.vm_memory_mb + 4) << 20, &dir, &err) < 0) {
    fprintf(stderr, "  stage_begin: %s\n", err);
    free(err);
    return NULL;
  }
  struct sandbox_snapshot snap = {0};
  int r = sandbox_vm_ops.snapshot(src->sb, dir, &snap, &err);
  if (r < 0) {
    fprintf(stderr, "  snapshot: %s\n", err);
    stage_abort(dir);
  } else {
    *ret_paused_us = snap.paused_us;
    finish_stage(dir, "soak", snap.carries, &st, &err);
  }
  free(dir);
  free(err);
  if (!st)
    return NULL;
  struct box f = {0};
  if (box_open(st, &f))
    out = run(&f, check);
  if (!out && f.sb) {
    char *why = sandbox_vm_ops.death_reason(f.sb);
    fprintf(stderr, "  the session from the snapshot: %s\n", why ? why : "?");
    free(why);
  }
  box_close(&f);
  char *rm_err = NULL;
  stage_rm("soak", "", &rm_err);
  free(rm_err);
  stage_unref(st);
  return out;
}

static void snapshot_soak(void) {
  const char *runs_env = getenv("IGN_TEST_SNAP_RUNS");
  int runs = runs_env && atoi(runs_env) > 0 ? atoi(runs_env) : 20;
  if (runs > 1000)
    runs = 1000;
  struct box src = {0};
  CHECK(box_open(NULL, &src));
  if (!src.conn)
    return;
  /* Each file: 2 MiB of random bytes, then their MD5; written beside and
   * renamed into place, so every /tmp/pN there is whole. */
  char *writer = run(&src, "(i=0; while :; do f=/tmp/p$((i%8)); head -c 2097152 /dev/urandom > $f.t; "
                           "head -c 2097152 $f.t | md5sum | cut -c1-32 >> $f.t; mv $f.t $f; i=$((i+1)); "
                           "echo $i > /tmp/iter; done) </dev/null >/dev/null 2>&1 & echo $!");
  CHECK(writer && *writer);
  usleep(1000000);
  /* In the session from the snapshot: the writer stopped first (a file it
   * renames while it is read would not check), then every file checked. */
  _cleanup_free_ char *check = xasprintf(
      "kill %s; sleep 0.3; ok=0; bad=0; for f in /tmp/p?; do [ -e $f ] || continue; "
      "a=$(head -c 2097152 $f | md5sum | cut -c1-32); b=$(tail -c 33 $f | head -c 32); "
      "if [ \"$a\" = \"$b\" ]; then ok=$((ok+1)); else bad=$((bad+1)); fi; done; echo $ok $bad",
      writer ? writer : "0");
  uint64_t *paused = calloc((size_t)runs, sizeof *paused);
  int good = 0;
  for (int i = 0; i < runs && paused; i++) {
    int ok = -1, bad = -1;
    char *o = snapshot_and_check(&src, check, &paused[i]);
    if (o)
      sscanf(o, "%d %d", &ok, &bad);
    bool pass = ok > 0 && bad == 0;
    printf("# snapshot %d: %s: source paused %.2f ms, files whole %d, bad %d\n", i + 1,
           pass ? "consistent" : "LOST PAGES", paused[i] / 1000.0, ok, bad);
    good += pass;
    free(o);
  }
  if (paused) {
    qsort(paused, (size_t)runs, sizeof *paused, cmp_u64);
    printf("# %d of %d snapshots consistent; source paused median %.2f ms, max %.2f ms\n", good,
           runs, paused[runs / 2] / 1000.0, paused[runs - 1] / 1000.0);
  }
  CHECK_EQ_INT(good, runs);
  free(paused);
  char *o = run(&src, "cat /tmp/iter");
  CHECK(o && atoi(o) > 0); /* the source runs on */
  free(o);
  free(writer);
  box_close(&src);
}

static void a_short_stage_is_refused(void) {
  char *dir = make_stage_dir("short");
  CHECK(dir);
  if (!dir)
    return;
  char *ram = xasprintf("%s/ram", dir), *state = xasprintf("%s/state", dir);
  int fd = open(ram, O_WRONLY | O_CREAT, 0600);
  CHECK(fd >= 0 && ftruncate(fd, 4096) == 0);
  close(fd);
  fd = open(state, O_WRONLY | O_CREAT, 0600);
  CHECK(fd >= 0 && write(fd, "x", 1) == 1);
  close(fd);
  struct stage st = {.name = "short", .id = "st-short", .dir = dir,
                     .dir_fd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC)};
  CHECK(st.dir_fd >= 0);
  struct sandbox_config sc = {.stage = &st};
  struct sandbox *sb = NULL;
  char *err = NULL;
  uint64_t t0 = mono_ms();
  CHECK_EQ_INT(sandbox_vm_ops.create(&sc, "test", &sb, &err), -EBADMSG);
  CHECK(mono_ms() - t0 < 1000);
  CHECK(err && strstr(err, "4096 bytes") && strstr(err, "stage_rm"));
  if (err)
    printf("# %s\n", err);
  free(err);
  if (st.dir_fd >= 0)
    close(st.dir_fd);
  fs_remove_tree(dir);
  free(dir);
  free(ram);
  free(state);
}

int main(void) {
  if (!setup()) {
    if (own_store)
      fs_remove_tree(store);
    printf("0 passed, 0 failed, 1 skipped\n");
    return 0;
  }
  static const struct test_case cases[] = {
      {"snapshot_and_fork", snapshot_and_fork},
      {"a_short_stage_is_refused", a_short_stage_is_refused},
      {"snapshot_soak", snapshot_soak},
  };
  const char *soak = getenv("IGN_TEST_SOAK");
  bool soaks = soak && strcmp(soak, "1") == 0;
  int r = test_run_all(cases, ARRAY_SIZE(cases) - !soaks);
  vm_backend_shutdown();
  if (own_store)
    fs_remove_tree(store);
  return r;
}
