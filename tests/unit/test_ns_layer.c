/* test_ns_layer.c: the ns backend's stage layer (sandbox/ns_stage.c) on
 * temporary directories: a parent stage's layer copied as hard links, an
 * overlay upper applied on it by overlayfs's rules (whiteouts, opaque
 * directories, merges), and what a hostile upper cannot do: write through a
 * hard link into the parent, keep a setuid bit or a device, make the copy
 * follow a link, nest without end. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "common/fs.h"
#include "sandbox/ns_stage.h"
#include "test.h"

static char root[256];

/* A fresh tree: ROOT/parent (a stage's layer), ROOT/upper, ROOT/child (the
 * new layer, empty), ROOT/outside (what links point at). */
static void fresh(void) {
  if (root[0])
    fs_remove_tree(root);
  CHECK(test_mkdtemp(root, sizeof root, "test-ns-layer") != NULL);
  static const char *const dirs[] = {"parent", "upper", "child", "outside"};
  for (size_t i = 0; i < 4; i++) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", root, dirs[i]);
    CHECK_EQ_INT(mkdir(p, 0755), 0);
  }
}

static char *at(const char *rel) {
  static char bufs[4][512];
  static int n;
  char *b = bufs[n++ % 4];
  snprintf(b, sizeof bufs[0], "%s/%s", root, rel);
  return b;
}

static void put(const char *rel, const char *text, mode_t mode) {
  int fd = open(at(rel), O_WRONLY | O_CREAT | O_TRUNC, mode);
  CHECK(fd >= 0);
  CHECK_EQ_INT(write(fd, text, strlen(text)), (long long)strlen(text));
  fchmod(fd, mode);
  close(fd);
}

static char *get(const char *rel) {
  static char buf[256];
  int fd = open(at(rel), O_RDONLY | O_NOFOLLOW);
  if (fd < 0)
    return NULL;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  buf[n < 0 ? 0 : n] = '\0';
  return buf;
}

static void whiteout(const char *rel) { CHECK_EQ_INT(mknod(at(rel), S_IFCHR, makedev(0, 0)), 0); }

static bool is_whiteout(const char *rel) {
  struct stat s;
  return lstat(at(rel), &s) == 0 && S_ISCHR(s.st_mode) && s.st_rdev == makedev(0, 0);
}

static bool exists(const char *rel) {
  struct stat s;
  return lstat(at(rel), &s) == 0;
}

/* parent -> child as links, then upper on child. */
static int commit(struct ns_layer_stats *st, char **err) {
  struct ns_layer_opts o = {.owners = NS_LAYER_OWNERS_KEEP};
  int p = open(at("parent"), O_RDONLY | O_DIRECTORY), u = open(at("upper"), O_RDONLY | O_DIRECTORY),
      c = open(at("child"), O_RDONLY | O_DIRECTORY);
  memset(st, 0, sizeof *st);
  int r = ns_layer_link(p, c, &o, st, err);
  if (r == 0)
    r = ns_layer_apply(u, c, &o, st, err);
  close(p);
  close(u);
  close(c);
  return r;
}

static void whiteouts_remove_and_stay(void) {
  fresh();
  mkdir(at("parent/a"), 0755);
  put("parent/a/gone", "1", 0644);
  put("parent/a/kept", "2", 0644);
  mkdir(at("parent/tree"), 0755);
  put("parent/tree/x", "3", 0644);
  whiteout("parent/was-deleted-before");
  mkdir(at("upper/a"), 0755);
  whiteout("upper/a/gone");
  put("upper/a/new", "4", 0644);
  whiteout("upper/tree"); /* a whole directory deleted */
  struct ns_layer_stats st;
  char *err = NULL;
  CHECK_EQ_INT(commit(&st, &err), 0);
  CHECK(is_whiteout("child/a/gone"));
  CHECK_STREQ(get("child/a/kept"), "2");
  CHECK_STREQ(get("child/a/new"), "4");
  CHECK(is_whiteout("child/tree"));
  CHECK(is_whiteout("child/was-deleted-before"));
  CHECK_EQ_INT(st.whiteouts, 2);
  /* The parent is as it was. */
  CHECK_STREQ(get("parent/a/gone"), "1");
  CHECK_STREQ(get("parent/tree/x"), "3");
  free(err);
}

static void opaque_dir_replaces(void) {
  fresh();
  mkdir(at("parent/d"), 0755);
  put("parent/d/old", "1", 0644);
  mkdir(at("parent/m"), 0755);
  CHECK_EQ_INT(setxattr(at("parent/m"), NS_LAYER_OPAQUE_XATTR, "y", 1, 0), 0);
  put("parent/m/p", "1", 0644);
  mkdir(at("upper/d"), 0700);
  CHECK_EQ_INT(setxattr(at("upper/d"), NS_LAYER_OPAQUE_XATTR, "y", 1, 0), 0);
  CHECK_EQ_INT(setxattr(at("upper/d"), "user.overlay.origin", "zz", 2, 0), 0);
  CHECK_EQ_INT(setxattr(at("upper/d"), "user.mine", "v", 1, 0), 0);
  put("upper/d/new", "2", 0644);
  mkdir(at("upper/m"), 0755); /* merged: the parent's opaque mark stays */
  put("upper/m/q", "2", 0644);
  struct ns_layer_stats st;
  char *err = NULL;
  CHECK_EQ_INT(commit(&st, &err), 0);
  CHECK(!exists("child/d/old"));
  CHECK_STREQ(get("child/d/new"), "2");
  char v[8] = "";
  CHECK_EQ_INT(getxattr(at("child/d"), NS_LAYER_OPAQUE_XATTR, v, sizeof v), 1);
  CHECK(v[0] == 'y');
  CHECK_EQ_INT(getxattr(at("child/d"), "user.mine", v, sizeof v), 1);
  CHECK(getxattr(at("child/d"), "user.overlay.origin", v, sizeof v) < 0);
  struct stat s;
  CHECK(stat(at("child/d"), &s) == 0 && (s.st_mode & 07777) == 0700);
  CHECK_STREQ(get("child/m/p"), "1");
  CHECK_STREQ(get("child/m/q"), "2");
  CHECK_EQ_INT(getxattr(at("child/m"), NS_LAYER_OPAQUE_XATTR, v, sizeof v), 1);
  CHECK(exists("parent/d/old"));
  free(err);
}

static void hard_links_never_written_through(void) {
  fresh();
  put("parent/f", "parent's", 0644);
  put("parent/same", "untouched", 0644);
  struct stat before, after, child, same_p, same_c;
  CHECK_EQ_INT(stat(at("parent/f"), &before), 0);
  put("upper/f", "child's", 0600);
  struct ns_layer_stats st;
  char *err = NULL;
  CHECK_EQ_INT(commit(&st, &err), 0);
  CHECK_EQ_INT(stat(at("parent/f"), &after), 0);
  CHECK_EQ_INT(stat(at("child/f"), &child), 0);
  CHECK_EQ_INT(after.st_ino, before.st_ino);
  CHECK_EQ_INT(after.st_mode, before.st_mode);
  CHECK_EQ_INT(after.st_nlink, 1);
  CHECK_STREQ(get("parent/f"), "parent's");
  CHECK_STREQ(get("child/f"), "child's");
  CHECK(child.st_ino != before.st_ino);
  CHECK_EQ_INT(child.st_mode & 07777, 0600);
  /* Unchanged files are the parent's inodes. */
  CHECK_EQ_INT(stat(at("parent/same"), &same_p), 0);
  CHECK_EQ_INT(stat(at("child/same"), &same_c), 0);
  CHECK_EQ_INT(same_p.st_ino, same_c.st_ino);
  CHECK_EQ_INT(st.linked, 2);
  free(err);
}

static void setuid_stripped(void) {
  fresh();
  put("upper/suid", "x", 04755);
  put("upper/sgid", "x", 02755);
  mkdir(at("upper/gdir"), 0755);
  chmod(at("upper/gdir"), 02775);
  struct ns_layer_stats st;
  char *err = NULL;
  CHECK_EQ_INT(commit(&st, &err), 0);
  struct stat s;
  CHECK(stat(at("child/suid"), &s) == 0 && (s.st_mode & 07777) == 0755);
  CHECK(stat(at("child/sgid"), &s) == 0 && (s.st_mode & 07777) == 0755);
  CHECK(stat(at("child/gdir"), &s) == 0 && (s.st_mode & 07777) == 0775);
  free(err);
}

static void links_copied_never_followed(void) {
  fresh();
  CHECK_EQ_INT(symlink("/etc/passwd", at("upper/passwd")), 0);
  /* The parent has a link where the upper has a directory: the copy must
   * replace the link, not write through it into outside/. */
  CHECK_EQ_INT(symlink(at("outside"), at("parent/esc")), 0);
  mkdir(at("upper/esc"), 0755);
  put("upper/esc/planted", "x", 0644);
  /* And a file over a link of the parent. */
  put("outside/target", "outside", 0644);
  CHECK_EQ_INT(symlink(at("outside/target"), at("parent/over")), 0);
  put("upper/over", "inside", 0644);
  struct ns_layer_stats st;
  char *err = NULL;
  CHECK_EQ_INT(commit(&st, &err), 0);
  char target[256] = "";
  CHECK_EQ_INT(readlink(at("child/passwd"), target, sizeof target - 1), 11);
  CHECK_STREQ(target, "/etc/passwd");
  struct stat s;
  CHECK(lstat(at("child/esc"), &s) == 0 && S_ISDIR(s.st_mode));
  CHECK(!exists("outside/planted"));
  CHECK_STREQ(get("outside/target"), "outside");
  CHECK_STREQ(get("child/over"), "inside");
  free(err);
}

static void fifo_kept_devices_dropped(void) {
  fresh();
  CHECK_EQ_INT(mkfifo(at("upper/pipe"), 0640), 0);
  put("parent/null", "a file below", 0644);
  bool root_here = geteuid() == 0;
  if (root_here)
    CHECK_EQ_INT(mknod(at("upper/null"), S_IFCHR | 0666, makedev(1, 3)), 0);
  struct ns_layer_stats st;
  char *err = NULL;
  CHECK_EQ_INT(commit(&st, &err), 0); /* a FIFO never blocks the copy */
  struct stat s;
  CHECK(lstat(at("child/pipe"), &s) == 0 && S_ISFIFO(s.st_mode) && (s.st_mode & 0777) == 0640);
  if (root_here) {
    CHECK(is_whiteout("child/null"));
    CHECK_EQ_INT(st.dropped_special, 1);
  }
  free(err);
}

static void sparse_stays_sparse(void) {
  fresh();
  int fd = open(at("upper/sparse"), O_WRONLY | O_CREAT, 0644);
  CHECK(fd >= 0);
  CHECK_EQ_INT(pwrite(fd, "end", 3, (off_t)1 << 32), 3);
  close(fd);
  struct ns_layer_stats st;
  char *err = NULL;
  CHECK_EQ_INT(commit(&st, &err), 0);
  struct stat s;
  CHECK(stat(at("child/sparse"), &s) == 0 && s.st_size == ((off_t)1 << 32) + 3);
  CHECK(s.st_blocks < 1024);
  CHECK(st.bytes < 1 << 20);
  free(err);
}

static void deep_tree(void) {
  fresh();
  char rel[4096] = "upper";
  for (unsigned i = 0; i < NS_LAYER_MAX_DEPTH; i++) {
    strcat(rel, "/d");
    CHECK_EQ_INT(mkdir(at(rel), 0755), 0);
  }
  strcat(rel, "/leaf");
  put(rel, "deep", 0644);
  struct ns_layer_stats st;
  char *err = NULL;
  CHECK_EQ_INT(commit(&st, &err), 0);
  memcpy(rel, "child", 5);
  CHECK_STREQ(get(rel), "deep");
  /* One level more is refused, saying why. */
  memcpy(rel, "upper", 5);
  *strrchr(rel, '/') = '\0';
  strcat(rel, "/d");
  CHECK_EQ_INT(mkdir(at(rel), 0755), 0);
  fs_remove_tree(at("child"));
  mkdir(at("child"), 0755);
  CHECK_EQ_INT(commit(&st, &err), -ELOOP);
  CHECK(err && strstr(err, "nest deeper"));
  free(err);
}

static void owners_of_the_block(void) {
  if (geteuid() != 0) {
    printf("# skip owners_of_the_block: needs root to chown\n");
    return;
  }
  fresh();
  const uid_t base = 0x70000000u;
  put("upper/mine", "x", 0644);
  CHECK_EQ_INT(chown(at("upper/mine"), base + 1000, base + 1001), 0);
  put("upper/foreign", "x", 0644);
  CHECK_EQ_INT(chown(at("upper/foreign"), 1234, 1234), 0);
  CHECK_EQ_INT(chown(at("upper"), base, base), 0);
  struct ns_layer_opts o = {.owners = NS_LAYER_OWNERS_BLOCK, .base = base};
  struct ns_layer_stats st = {0};
  char *err = NULL;
  int u = open(at("upper"), O_RDONLY | O_DIRECTORY), c = open(at("child"), O_RDONLY | O_DIRECTORY);
  CHECK_EQ_INT(ns_layer_apply(u, c, &o, &st, &err), 0);
  close(u);
  close(c);
  struct stat s;
  CHECK(stat(at("child/mine"), &s) == 0 && s.st_uid == 1000 && s.st_gid == 1001);
  CHECK(!exists("child/foreign"));
  CHECK_EQ_INT(st.skipped_owner, 1);
  CHECK(stat(at("child"), &s) == 0 && s.st_uid == 0);
  free(err);
}

static void scratch_dir_replaces(void) {
  fresh();
  mkdir(at("parent/root"), 0700);
  put("parent/root/old", "1", 0644);
  mkdir(at("upper/scratch"), 0700);
  put("upper/scratch/new", "2", 0644);
  struct ns_layer_opts o = {.owners = NS_LAYER_OWNERS_KEEP};
  struct ns_layer_stats st = {0};
  char *err = NULL;
  int p = open(at("parent"), O_RDONLY | O_DIRECTORY), s = open(at("upper/scratch"), O_RDONLY),
      c = open(at("child"), O_RDONLY | O_DIRECTORY);
  CHECK_EQ_INT(ns_layer_link(p, c, &o, &st, &err), 0);
  CHECK_EQ_INT(ns_layer_apply_dir(s, c, "root", &o, &st, &err), 0);
  close(p);
  close(s);
  close(c);
  /* The scratch directory is all the sandbox saw there: it replaces. */
  CHECK(!exists("child/root/old"));
  CHECK_STREQ(get("parent/root/old"), "1");
  CHECK_STREQ(get("child/root/new"), "2");
  char v[4] = "";
  CHECK_EQ_INT(getxattr(at("child/root"), NS_LAYER_OPAQUE_XATTR, v, sizeof v), 1);
  free(err);
}

/* A file hard-linked many times in the upper costs the host its size once,
 * not once per link: the layer keeps the links. */
static void upper_hard_links_kept(void) {
  fresh();
  static char mib[1 << 20];
  memset(mib, 'x', sizeof mib);
  int fd = open(at("upper/big"), O_WRONLY | O_CREAT, 0644);
  CHECK(fd >= 0);
  CHECK_EQ_INT(write(fd, mib, sizeof mib), sizeof mib);
  close(fd);
  mkdir(at("upper/sub"), 0755);
  char rel[64];
  for (int i = 0; i < 40; i++) {
    snprintf(rel, sizeof rel, "upper/%sl%d", i % 2 ? "sub/" : "", i);
    CHECK_EQ_INT(link(at("upper/big"), at(rel)), 0);
  }
  struct ns_layer_stats st;
  char *err = NULL;
  CHECK_EQ_INT(commit(&st, &err), 0);
  struct stat big, l;
  CHECK_EQ_INT(stat(at("child/big"), &big), 0);
  CHECK_EQ_INT(big.st_nlink, 41);
  CHECK_EQ_INT(stat(at("child/sub/l39"), &l), 0);
  CHECK_EQ_INT(l.st_ino, big.st_ino);
  CHECK_EQ_INT(st.bytes, sizeof mib);
  CHECK_EQ_INT(st.relinked, 40);
  /* And the upper's inode is not the layer's. */
  struct stat u;
  CHECK_EQ_INT(stat(at("upper/big"), &u), 0);
  CHECK(u.st_ino != big.st_ino);
  free(err);
}

/* What the applies copy is capped (a running sandbox that rewrites a file
 * while it is copied cannot make the copy grow without end). */
static void apply_capped(void) {
  fresh();
  static char mib[1 << 20];
  memset(mib, 'y', sizeof mib);
  for (int i = 0; i < 3; i++) {
    char rel[32];
    snprintf(rel, sizeof rel, "upper/f%d", i);
    int fd = open(at(rel), O_WRONLY | O_CREAT, 0644);
    CHECK(fd >= 0);
    CHECK_EQ_INT(write(fd, mib, sizeof mib), sizeof mib);
    close(fd);
  }
  struct ns_layer_opts o = {.owners = NS_LAYER_OWNERS_KEEP, .max_bytes = 2u << 20};
  struct ns_layer_stats st = {0};
  char *err = NULL;
  int u = open(at("upper"), O_RDONLY | O_DIRECTORY), c = open(at("child"), O_RDONLY | O_DIRECTORY);
  CHECK_EQ_INT(ns_layer_apply(u, c, &o, &st, &err), -EFBIG);
  CHECK(err && strstr(err, "more than its disk (2 MiB)") && strstr(err, "commit again"));
  CHECK(st.upper_bytes <= 2u << 20);
  free(err);
  err = NULL;
  o.max_bytes = 3u << 20;
  fs_remove_tree(at("child"));
  mkdir(at("child"), 0755);
  close(c);
  c = open(at("child"), O_RDONLY | O_DIRECTORY);
  memset(&st, 0, sizeof st);
  CHECK_EQ_INT(ns_layer_apply(u, c, &o, &st, &err), 0);
  CHECK_EQ_INT(st.upper_bytes, 3u << 20);
  close(u);
  close(c);
  free(err);
}

/* Only user.* xattrs reach a stage (no trusted.*, security.*: file
 * capabilities, SELinux labels, overlay's trusted marks), user.overlay.* of
 * an upper is overlay's own and is not kept, and many or large ones neither
 * fail the copy nor overflow its buffers. */
static void xattrs_filtered(void) {
  fresh();
  put("upper/f", "x", 0755);
  mkdir(at("upper/d"), 0755);
  put("parent/d", "below", 0644);
  bool root_here = geteuid() == 0;
  if (root_here) {
    /* v3 file capability data: cap_sys_admin, effective. */
    static const unsigned char cap[24] = {0x01, 0, 0, 0x03, 0, 0, 0x20, 0, 0, 0, 0, 0};
    CHECK_EQ_INT(setxattr(at("upper/f"), "trusted.x", "t", 1, 0), 0);
    setxattr(at("upper/f"), "security.capability", cap, sizeof cap, 0);
    CHECK_EQ_INT(setxattr(at("upper/d"), "trusted.overlay.opaque", "y", 1, 0), 0);
  }
  CHECK_EQ_INT(setxattr(at("upper/f"), "user.overlay.redirect", "/etc", 4, 0), 0);
  static char big[4000];
  memset(big, 'v', sizeof big);
  int kept = 0;
  for (int i = 0; i < 64; i++) {
    char name[64];
    snprintf(name, sizeof name, "user.big-%02d-%040d", i, 0);
    if (setxattr(at("upper/f"), name, big, sizeof big, 0) == 0)
      kept++;
  }
  struct ns_layer_stats st;
  char *err = NULL;
  CHECK_EQ_INT(commit(&st, &err), 0);
  char v[4096];
  CHECK(getxattr(at("child/f"), "trusted.x", v, sizeof v) < 0);
  CHECK(getxattr(at("child/f"), "security.capability", v, sizeof v) < 0);
  CHECK(getxattr(at("child/f"), "user.overlay.redirect", v, sizeof v) < 0);
  CHECK(getxattr(at("child/d"), "trusted.overlay.opaque", v, sizeof v) < 0);
  CHECK(getxattr(at("child/d"), NS_LAYER_OPAQUE_XATTR, v, sizeof v) < 0);
  int got = 0;
  for (int i = 0; i < 64; i++) {
    char name[64];
    snprintf(name, sizeof name, "user.big-%02d-%040d", i, 0);
    if (getxattr(at("child/f"), name, v, sizeof v) == (ssize_t)sizeof big)
      got++;
  }
  CHECK(got + (int)st.xattrs_dropped >= kept);
  CHECK(got > 0 || kept == 0);
  struct stat s;
  CHECK(lstat(at("child/d"), &s) == 0 && S_ISDIR(s.st_mode)); /* merged, not opaque */
  free(err);
}

static void cleanup(void) {
  if (root[0])
    fs_remove_tree(root);
  root[0] = '\0';
}

TEST_MAIN(TEST(whiteouts_remove_and_stay), TEST(opaque_dir_replaces),
          TEST(hard_links_never_written_through), TEST(setuid_stripped),
          TEST(links_copied_never_followed), TEST(fifo_kept_devices_dropped),
          TEST(sparse_stays_sparse), TEST(deep_tree), TEST(owners_of_the_block),
          TEST(scratch_dir_replaces), TEST(upper_hard_links_kept), TEST(apply_capped),
          TEST(xattrs_filtered),
          TEST(cleanup))
