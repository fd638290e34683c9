/* test_hostio.c: host-path confinement (hostio) and tree copies
 * (tarstream): every way out of the root the issue lists, hostile tar
 * streams made with libarchive here, caps, and copies that fail partway
 * leaving the destination as it was.  Each test works in a fresh directory
 * under /tmp: ROOT is the host I/O root, OUT a directory beside it that
 * nothing may reach. */
#include <archive.h>
#include <archive_entry.h>
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/hostio.h"
#include "common/tarstream.h"
#include "common/tarstream_int.h"
#include "common/util.h"
#include "test.h"

static char base[PATH_MAX], root[PATH_MAX + 8], out[PATH_MAX + 8];

__attribute__((format(printf, 1, 2))) static int sh(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *cmd;
  if (vasprintf(&cmd, fmt, ap) < 0)
    abort();
  va_end(ap);
  int r = system(cmd);
  free(cmd);
  return r;
}

/* A fresh ROOT and OUT, hostio confined to ROOT, copy_out on. */
static void setup(void) {
  alarm(60); /* a test that blocks (on a FIFO, say) fails instead of hanging */
  if (!test_mkdtemp(base, sizeof base, "test_hostio"))
    abort();
  snprintf(root, sizeof root, "%s/root", base);
  snprintf(out, sizeof out, "%s/out", base);
  sh("mkdir -p %s %s && echo secret > %s/secret", root, out, out);
  char *err = NULL;
  CHECK_EQ_INT(hostio_init(root, true, &err), 0);
  free(err);
}

static void teardown(void) {
  sh("chmod -R u+rwx %s 2>/dev/null; rm -rf %s", base, base);
  alarm(0);
}

static int mem_fd(void) {
  int fd = memfd_create("stream", MFD_CLOEXEC);
  if (fd < 0)
    abort();
  return fd;
}

static const struct tar_limits big = {1ull << 30, 100000};

/* Copies host SRC to host DST through a stream (pack, then unpack); the
 * packing side's report in *REP_OUT. */
static int copy_via_stream(const char *src, const char *dst, const struct tar_limits *lim,
                           struct tar_report *rep_out, char **ret_err) {
  int fd = mem_fd();
  struct tar_report packed = {0}, rep = {0};
  int r = hostio_copy_from(src, fd, lim, NULL, rep_out ? rep_out : &packed, ret_err);
  tar_report_free(&packed);
  if (r == 0) {
    lseek(fd, 0, SEEK_SET);
    r = hostio_copy_to(fd, dst, lim, NULL, &rep, ret_err);
    /* What the packing side skipped never reaches the other side. */
    CHECK_EQ_INT(rep.skipped, 0);
    if (rep_out) {
      CHECK_EQ_INT(rep.files, rep_out->files);
      CHECK_EQ_INT(rep.dirs, rep_out->dirs);
      CHECK_EQ_INT(rep.symlinks, rep_out->symlinks);
      CHECK_EQ_INT(rep.bytes, rep_out->bytes);
    }
  }
  tar_report_free(&rep);
  close(fd);
  return r;
}

static mode_t mode_of(const char *rel) {
  char p[PATH_MAX * 2];
  snprintf(p, sizeof p, "%s/%s", root, rel);
  struct stat st;
  if (lstat(p, &st) < 0)
    return (mode_t)-1;
  return st.st_mode & 07777;
}

static bool exists(const char *rel) { return mode_of(rel) != (mode_t)-1; }

/* No staging name (".NAME.ign-...") is left in ROOT. */
static bool no_staging(void) {
  DIR *d = opendir(root);
  bool clean = true;
  struct dirent *de;
  while ((de = readdir(d)))
    if (strstr(de->d_name, ".ign-")) {
      fprintf(stderr, "  staging left behind: %s\n", de->d_name);
      clean = false;
    }
  closedir(d);
  return clean;
}

static bool skipped_with(const struct tar_report *rep, const char *path_part, const char *why) {
  for (size_t i = 0; i < rep->n_listed; i++)
    if (strstr(rep->listed[i].path, path_part) && strstr(rep->listed[i].reason, why))
      return true;
  return false;
}

/* ------------------------------------------------------------ hostile */

struct ent {
  const char *name;
  mode_t type; /* AE_IFREG, AE_IFDIR, AE_IFLNK, AE_IFCHR, AE_IFIFO */
  mode_t perm;
  const char *data;     /* file content */
  const char *link;     /* symlink target */
  const char *hardlink; /* makes it a hard link */
  int64_t size;         /* declared size when data is NULL */
  bool sparse;          /* a sparse entry of SIZE bytes with 16 real ones */
};

/* A stream of ENTS in a memfd, at offset 0. */
static int build_stream(const struct ent *ents, size_t n) {
  struct archive *a = archive_write_new();
  archive_write_set_format_pax(a);
  int fd = mem_fd();
  archive_write_open_fd(a, fd);
  struct archive_entry *e = archive_entry_new();
  for (size_t i = 0; i < n; i++) {
    archive_entry_clear(e);
    archive_entry_copy_pathname(e, ents[i].name);
    archive_entry_set_filetype(e, ents[i].type);
    archive_entry_set_perm(e, ents[i].perm ? ents[i].perm : 0644);
    archive_entry_set_mtime(e, 1000000000, 0);
    if (ents[i].link)
      archive_entry_copy_symlink(e, ents[i].link);
    if (ents[i].hardlink)
      archive_entry_copy_hardlink(e, ents[i].hardlink);
    if (ents[i].type == AE_IFCHR)
      archive_entry_set_rdev(e, makedev(1, 3));
    int64_t size = ents[i].data ? (int64_t)strlen(ents[i].data) : ents[i].size;
    archive_entry_set_size(e, size);
    if (ents[i].sparse)
      archive_entry_sparse_add_entry(e, 0, 16);
    if (archive_write_header(a, e) < ARCHIVE_WARN)
      fprintf(stderr, "  build_stream %s: %s\n", ents[i].name, archive_error_string(a));
    if (ents[i].data)
      archive_write_data(a, ents[i].data, strlen(ents[i].data));
    else if (ents[i].sparse) {
      char zeros[16] = "0123456789abcdef";
      archive_write_data(a, zeros, sizeof zeros);
    }
  }
  archive_entry_free(e);
  archive_write_close(a);
  archive_write_free(a);
  lseek(fd, 0, SEEK_SET);
  return fd;
}

static int unpack_into_root(int fd, const char *name, const struct tar_limits *lim,
                            struct tar_report *rep, char **err) {
  int dfd = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
  int r = tar_unpack(fd, dfd, name, lim, NULL, rep, err);
  close(dfd);
  return r;
}

/* ------------------------------------------------------------------ tests */

static void round_trip_keeps_tree_modes_and_inner_symlinks(void) {
  setup();
  sh("cd %s && mkdir -p src/a/b/c src/empty src/private src/ro && "
     "printf 'hello' > src/a/f && : > src/a/b/empty && head -c 300000 /dev/urandom > src/big && "
     "echo x > src/private/p && echo r > src/ro/r && "
     "chmod 0755 src/a/f && chmod 0644 src/big && chmod 0700 src/private && chmod 0555 src/ro && "
     "echo s > src/suid && chmod 4755 src/suid && echo w > src/gw && chmod 0666 src/gw && "
     "chmod 1777 src/empty && "
     "ln -s ../f src/a/b/up && ln -s a/b/c src/inner && ln -s b/../../../x src/a/tricky && "
     "ln -s /etc/passwd src/abs && ln -s ../../x src/a/esc",
     root);
  struct tar_report rep = {0};
  char *err = NULL;
  CHECK_EQ_INT(copy_via_stream("src", "dst", &big, &rep, &err), 0);
  if (err)
    fprintf(stderr, "  %s\n", err);
  free(err);
  /* Same content, inner symlinks kept as symlinks. */
  CHECK_EQ_INT(sh("cd %s && diff -r --no-dereference -x abs -x esc -x tricky src dst", root), 0);
  char buf[64];
  char p[PATH_MAX * 2];
  snprintf(p, sizeof p, "%s/dst/a/b/up", root);
  ssize_t n = readlink(p, buf, sizeof buf - 1);
  CHECK(n == 4 && memcmp(buf, "../f", 4) == 0);
  CHECK_EQ_INT(mode_of("dst/a/f"), 0755);
  CHECK_EQ_INT(mode_of("dst/big"), 0644);
  CHECK_EQ_INT(mode_of("dst/private"), 0700);
  CHECK_EQ_INT(mode_of("dst/ro"), 0555);
  CHECK_EQ_INT(mode_of("dst/a/b/empty"), 0644);
  /* Never setuid, setgid or sticky, never group/other writable. */
  CHECK_EQ_INT(mode_of("dst/suid"), 0755);
  CHECK_EQ_INT(mode_of("dst/gw"), 0644);
  CHECK_EQ_INT(mode_of("dst/empty"), 0755);
  /* Links that leave the tree are skipped and reported. */
  CHECK(!exists("dst/abs") && !exists("dst/a/esc") && !exists("dst/a/tricky"));
  CHECK(skipped_with(&rep, "src/abs", "outside"));
  CHECK(skipped_with(&rep, "src/a/esc", "outside"));
  CHECK(skipped_with(&rep, "src/a/tricky", "outside"));
  CHECK_EQ_INT(rep.skipped, 3);
  CHECK_EQ_INT(rep.symlinks, 2);
  CHECK_EQ_INT(rep.files, 7);
  CHECK_EQ_INT(rep.dirs, 7);
  CHECK_EQ_INT(rep.bytes, 5 + 300000 + 2 + 2 + 2 + 2);
  tar_report_free(&rep);

  /* Again onto the existing tree: it is replaced whole. */
  sh("cd %s && echo stale > dst/stale", root);
  CHECK_EQ_INT(copy_via_stream("src", "dst", &big, NULL, &err), 0);
  CHECK(!exists("dst/stale"));
  CHECK(no_staging());
  /* A single file, absolute and inside the root, onto a new name. */
  char abs_src[PATH_MAX * 2];
  snprintf(abs_src, sizeof abs_src, "%s/src/a/f", root);
  CHECK_EQ_INT(copy_via_stream(abs_src, "single", &big, NULL, &err), 0);
  CHECK_EQ_INT(sh("cmp -s %s/src/a/f %s/single", root, root), 0);
  /* A file onto an existing file. */
  CHECK_EQ_INT(copy_via_stream("src/big", "single", &big, NULL, &err), 0);
  CHECK_EQ_INT(sh("cmp -s %s/src/big %s/single", root, root), 0);
  /* The root itself is copied under its own name. */
  sh("mkdir -p %s/sub", root);
  int fd = mem_fd();
  struct tar_report r2 = {0};
  CHECK_EQ_INT(hostio_copy_from(".", fd, &big, NULL, &r2, &err), 0);
  tar_report_free(&r2);
  close(fd);
  CHECK(no_staging());
  teardown();
}

static void read_refuses_paths_that_leave_the_root(void) {
  setup();
  sh("cd %s && echo inside > f && ln -s %s/secret outlink && ln -s %s outdir && "
     "mkdir d && ln -s ../../out/secret d/up",
     root, out, out);
  const char *bad[] = {"outlink",  "outdir/secret", "outdir/",       "../out/secret",
                       "d/../../out/secret", "d/up", "/etc/passwd", "..",
                       "d/../.."};
  for (size_t i = 0; i < ARRAY_SIZE(bad); i++) {
    void *data = NULL;
    size_t len;
    char *err = NULL;
    int r = hostio_read_file(bad[i], 4096, &data, &len, &err);
    CHECK(r < 0);
    if (r == 0) {
      fprintf(stderr, "  %s was read\n", bad[i]);
      free(data);
      continue;
    }
    if (strcmp(bad[i], "outdir/") != 0) {
      /* Refusals name the root and its variable. */
      CHECK(err && strstr(err, root) && strstr(err, "IGN_MCP_HOST_IO_ROOT"));
      if (!(err && strstr(err, "IGN_MCP_HOST_IO_ROOT")))
        fprintf(stderr, "  %s: %s\n", bad[i], err ? err : "(null)");
    }
    free(err);
  }
  /* Inside: relative, absolute, through a symlink that stays inside. */
  sh("cd %s && ln -s f inlink", root);
  char absf[PATH_MAX * 2];
  snprintf(absf, sizeof absf, "%s/f", root);
  const char *good[] = {"f", absf, "inlink", "d/../f", "./f"};
  for (size_t i = 0; i < ARRAY_SIZE(good); i++) {
    void *data = NULL;
    size_t len = 0;
    char *err = NULL;
    CHECK_EQ_INT(hostio_read_file(good[i], 4096, &data, &len, &err), 0);
    CHECK(len == 7 && data && memcmp(data, "inside\n", 7) == 0);
    free(data);
    free(err);
  }
  /* A path that only looks like it starts with the root. */
  char look[PATH_MAX * 2];
  snprintf(look, sizeof look, "%sx/f", root);
  void *data = NULL;
  size_t len;
  char *err = NULL;
  CHECK_EQ_INT(hostio_read_file(look, 4096, &data, &len, &err), -EACCES);
  free(err);
  err = NULL;
  /* The size cap. */
  CHECK_EQ_INT(hostio_read_file("f", 3, &data, &len, &err), -EFBIG);
  CHECK(err && strstr(err, "7 bytes"));
  free(err);
  err = NULL;
  /* A directory is not a file. */
  CHECK_EQ_INT(hostio_read_file("d", 4096, &data, &len, &err), -EISDIR);
  free(err);
  teardown();
}

static void fifo_is_refused_without_blocking(void) {
  setup();
  sh("cd %s && mkfifo pipe && mkdir tree && echo a > tree/a && mkfifo tree/p", root);
  void *data = NULL;
  size_t len;
  char *err = NULL;
  CHECK_EQ_INT(hostio_read_file("pipe", 4096, &data, &len, &err), -EINVAL);
  CHECK(err && strstr(err, "FIFO"));
  free(err);
  err = NULL;
  /* Copying it is refused too; inside a tree it is skipped. */
  int fd = mem_fd();
  struct tar_report rep = {0};
  CHECK_EQ_INT(hostio_copy_from("pipe", fd, &big, NULL, &rep, &err), -EINVAL);
  free(err);
  err = NULL;
  CHECK_EQ_INT(hostio_copy_from("tree", fd, &big, NULL, &rep, &err), 0);
  CHECK(skipped_with(&rep, "tree/p", "FIFO"));
  CHECK_EQ_INT(rep.files, 1);
  tar_report_free(&rep);
  close(fd);
  teardown();
}

static void device_nodes_are_skipped(void) {
  if (geteuid() != 0) {
    fprintf(stderr, "  skipped: making a device node needs root\n");
    return;
  }
  setup();
  sh("cd %s && mkdir tree && mknod tree/null c 1 3 && echo a > tree/a", root);
  struct tar_report rep = {0};
  char *err = NULL;
  CHECK_EQ_INT(copy_via_stream("tree", "copy", &big, NULL, &err), 0);
  int fd = mem_fd();
  CHECK_EQ_INT(hostio_copy_from("tree", fd, &big, NULL, &rep, &err), 0);
  CHECK(skipped_with(&rep, "tree/null", "device"));
  CHECK(!exists("copy/null") && exists("copy/a"));
  tar_report_free(&rep);
  close(fd);
  /* Nor is one read as stdin_file (never opened). */
  void *data = NULL;
  size_t len;
  CHECK_EQ_INT(hostio_read_file("tree/null", 4096, &data, &len, &err), -EINVAL);
  CHECK(err && strstr(err, "device"));
  free(err);
  teardown();
}

static void destination_symlink_is_refused(void) {
  setup();
  sh("cd %s && mkdir src && echo new > src/f && ln -s %s dst && ln -s %s/secret fl && "
     "ln -s %s outparent",
     root, out, out, out);
  char *err = NULL;
  CHECK_EQ_INT(copy_via_stream("src", "dst", &big, NULL, &err), -ELOOP);
  CHECK(err && strstr(err, "symlink"));
  free(err);
  err = NULL;
  /* "dst/" is the same name: the trailing slash does not get past. */
  CHECK_EQ_INT(copy_via_stream("src", "dst/", &big, NULL, &err), -ELOOP);
  free(err);
  err = NULL;
  CHECK_EQ_INT(copy_via_stream("src/f", "fl", &big, NULL, &err), -ELOOP);
  free(err);
  err = NULL;
  /* A parent that leads out. */
  CHECK_EQ_INT(copy_via_stream("src", "outparent/x", &big, NULL, &err), -EXDEV);
  CHECK(err && strstr(err, "IGN_MCP_HOST_IO_ROOT"));
  free(err);
  err = NULL;
  /* A missing parent is not created. */
  CHECK_EQ_INT(copy_via_stream("src", "no/such/dst", &big, NULL, &err), -ENOENT);
  CHECK(err && strstr(err, "create it first"));
  free(err);
  err = NULL;
  /* The root itself is not a destination. */
  CHECK_EQ_INT(copy_via_stream("src", ".", &big, NULL, &err), -EINVAL);
  free(err);
  err = NULL;
  CHECK_EQ_INT(sh("test \"$(cat %s/secret)\" = secret && test ! -e %s/f && test ! -e %s/x", out,
                  out, out),
               0);
  CHECK(no_staging());
  teardown();
}

static void copy_out_off_refuses_writes(void) {
  setup();
  char *err = NULL;
  CHECK_EQ_INT(hostio_init(root, false, &err), 0);
  CHECK(!hostio_copy_out_enabled());
  int fd = mem_fd();
  CHECK_EQ_INT(hostio_copy_to(fd, "x", &big, NULL, NULL, &err), -EPERM);
  CHECK(err && strstr(err, "IGN_MCP_COPY_OUT=off"));
  free(err);
  close(fd);
  CHECK(!exists("x"));
  teardown();
}

/* The existing destination DST survives a failed copy byte for byte, and
 * no staging is left. */
static void check_untouched(void) {
  CHECK_EQ_INT(sh("cd %s && diff -r --no-dereference ref dst", root), 0);
  CHECK_EQ_INT(mode_of("dst/sub"), 0700);
  CHECK(no_staging());
}

static void failed_copy_leaves_destination_intact(void) {
  setup();
  sh("cd %s && mkdir -p src/d dst/sub && head -c 200000 /dev/urandom > src/d/big && "
     "for i in 1 2 3 4 5 6; do echo $i > src/f$i; done && echo old > dst/old && "
     "ln -s old dst/l && chmod 0700 dst/sub && cp -a dst ref",
     root);
  int fd = mem_fd();
  char *err = NULL;
  struct tar_report rep = {0};
  CHECK_EQ_INT(hostio_copy_from("src", fd, &big, NULL, &rep, &err), 0);
  tar_report_free(&rep);
  off_t total = lseek(fd, 0, SEEK_END);
  /* Cut in the middle of the big file, and at an entry boundary (a
   * sender that stopped between two entries: libarchive alone would take
   * that for a whole stream). */
  off_t cuts[] = {total / 2, 512 * 3, total - 1024, total - 2048, 0};
  for (size_t i = 0; i < ARRAY_SIZE(cuts); i++) {
    int cut = mem_fd();
    char buf[4096];
    lseek(fd, 0, SEEK_SET);
    for (off_t left = cuts[i]; left > 0;) {
      ssize_t n = read(fd, buf, left < (off_t)sizeof buf ? (size_t)left : sizeof buf);
      if (n <= 0)
        break;
      if (write(cut, buf, (size_t)n) != n)
        abort();
      left -= n;
    }
    lseek(cut, 0, SEEK_SET);
    int r = hostio_copy_to(cut, "dst", &big, NULL, NULL, &err);
    CHECK(r < 0);
    if (r == 0)
      fprintf(stderr, "  a stream cut at %lld of %lld was taken whole\n", (long long)cuts[i],
              (long long)total);
    free(err);
    err = NULL;
    close(cut);
    check_untouched();
  }
  /* Over the byte cap, and over the entry cap. */
  struct tar_limits small_bytes = {100000, 100000}, few_files = {1ull << 30, 4};
  lseek(fd, 0, SEEK_SET);
  CHECK_EQ_INT(hostio_copy_to(fd, "dst", &small_bytes, NULL, NULL, &err), -EFBIG);
  CHECK(err && strstr(err, "IGN_MCP_COPY_MAX_MB"));
  free(err);
  err = NULL;
  check_untouched();
  lseek(fd, 0, SEEK_SET);
  CHECK_EQ_INT(hostio_copy_to(fd, "dst", &few_files, NULL, NULL, &err), -E2BIG);
  CHECK(err && strstr(err, "IGN_MCP_COPY_MAX_FILES"));
  free(err);
  err = NULL;
  check_untouched();
  /* The sending side checks the caps too. */
  int o = mem_fd();
  CHECK_EQ_INT(hostio_copy_from("src", o, &small_bytes, NULL, NULL, &err), -EFBIG);
  free(err);
  err = NULL;
  CHECK_EQ_INT(hostio_copy_from("src", o, &few_files, NULL, NULL, &err), -E2BIG);
  free(err);
  err = NULL;
  close(o);
  /* Cancelled. */
  atomic_bool cancel = true;
  lseek(fd, 0, SEEK_SET);
  CHECK_EQ_INT(hostio_copy_to(fd, "dst", &big, &cancel, NULL, &err), -ECANCELED);
  free(err);
  err = NULL;
  check_untouched();
  /* An empty stream. */
  int empty = mem_fd();
  CHECK_EQ_INT(hostio_copy_to(empty, "dst", &big, NULL, NULL, &err), -ENODATA);
  free(err);
  close(empty);
  check_untouched();
  close(fd);
  teardown();
}

static void hostile_names_are_skipped(void) {
  setup();
  const struct ent ents[] = {
      {"../x", AE_IFREG, 0, "escaped", NULL, NULL, 0, false},
      {"T", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      {"/abs", AE_IFREG, 0, "abs", NULL, NULL, 0, false},
      {"T/../../y", AE_IFREG, 0, "escaped", NULL, NULL, 0, false},
      {"T/ok", AE_IFREG, 0644, "fine", NULL, NULL, 0, false},
      {"T//empty", AE_IFREG, 0, "x", NULL, NULL, 0, false},
      {"T/./dot", AE_IFREG, 0, "x", NULL, NULL, 0, false},
      {"U/other", AE_IFREG, 0, "x", NULL, NULL, 0, false},
      {"T/hard", AE_IFREG, 0, NULL, NULL, "T/ok", 0, false},
      {"T/etc", AE_IFREG, 0, NULL, NULL, "/etc/passwd", 0, false},
      {"T/dev", AE_IFCHR, 0666, NULL, NULL, NULL, 0, false},
      {"T/fifo", AE_IFIFO, 0644, NULL, NULL, NULL, 0, false},
      {"T/suid", AE_IFREG, 06777, "s", NULL, NULL, 0, false},
      {"T/missing/parent", AE_IFREG, 0, "x", NULL, NULL, 0, false},
  };
  int fd = build_stream(ents, ARRAY_SIZE(ents));
  struct tar_report rep = {0};
  char *err = NULL;
  CHECK_EQ_INT(unpack_into_root(fd, "dst", &big, &rep, &err), 0);
  if (err)
    fprintf(stderr, "  %s\n", err);
  free(err);
  close(fd);
  CHECK(exists("dst/ok") && exists("dst/suid"));
  CHECK_EQ_INT(mode_of("dst/suid"), 0755);
  CHECK(!exists("x") && !exists("y") && !exists("dst/hard") && !exists("dst/etc") &&
        !exists("dst/dev") && !exists("dst/fifo") && !exists("dst/empty") &&
        !exists("dst/dot") && !exists("dst/missing"));
  CHECK(sh("test -e %s/x || test -e %s/y || test -e /abs || test -e %s/../x", base, base, root) !=
        0);
  CHECK(skipped_with(&rep, "../x", ".."));
  CHECK(skipped_with(&rep, "/abs", "absolute"));
  CHECK(skipped_with(&rep, "T/../../y", ".."));
  CHECK(skipped_with(&rep, "T//empty", "empty"));
  CHECK(skipped_with(&rep, "T/./dot", "\".\""));
  CHECK(skipped_with(&rep, "U/other", "outside the copied tree"));
  CHECK(skipped_with(&rep, "T/hard", "hard link"));
  CHECK(skipped_with(&rep, "T/etc", "hard link"));
  CHECK(skipped_with(&rep, "T/dev", "device"));
  CHECK(skipped_with(&rep, "T/fifo", "FIFO"));
  CHECK(skipped_with(&rep, "T/missing/parent", "not in the stream"));
  CHECK_EQ_INT(rep.files, 2);
  CHECK_EQ_INT(rep.dirs, 1);
  CHECK_EQ_INT(rep.skipped, 11);
  tar_report_free(&rep);
  CHECK(no_staging());
  teardown();
}

static void symlink_then_write_through_is_refused(void) {
  setup();
  sh("mkdir -p %s/victim && echo keep > %s/victim/f && mkdir -p %s/sub", out, out, root);
  char outv[PATH_MAX * 2];
  snprintf(outv, sizeof outv, "%s/victim", out);
  const struct ent ents[] = {
      {"T", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      /* escaping links: skipped, so their names are not there later */
      {"T/abs", AE_IFLNK, 0, NULL, outv, NULL, 0, false},
      {"T/abs/f", AE_IFREG, 0, "pwned", NULL, NULL, 0, false},
      {"T/up", AE_IFLNK, 0, NULL, "../../out/victim", NULL, 0, false},
      {"T/up/f", AE_IFREG, 0, "pwned", NULL, NULL, 0, false},
      /* a link that stays inside is kept, and still never written
       * through */
      {"T/real", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      {"T/in", AE_IFLNK, 0, NULL, "real", NULL, 0, false},
      {"T/in/f", AE_IFREG, 0, "through", NULL, NULL, 0, false},
      {"T/in", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      {"T/ln", AE_IFLNK, 0, NULL, "real/g", NULL, 0, false},
      {"T/ln", AE_IFREG, 0, "over the link", NULL, NULL, 0, false},
      /* a link to "." then a name through it twice and up */
      {"T/here", AE_IFLNK, 0, NULL, ".", NULL, 0, false},
      {"T/esc", AE_IFLNK, 0, NULL, "here/here/../../out", NULL, 0, false},
  };
  int fd = build_stream(ents, ARRAY_SIZE(ents));
  struct tar_report rep = {0};
  char *err = NULL;
  CHECK_EQ_INT(unpack_into_root(fd, "dst", &big, &rep, &err), 0);
  free(err);
  close(fd);
  CHECK_EQ_INT(sh("test \"$(cat %s/victim/f)\" = keep && test ! -e %s/real/f && "
                  "test ! -e %s/dst/real/f && test ! -e %s/dst/real/g",
                  out, root, root, root),
               0);
  CHECK(skipped_with(&rep, "T/abs", "outside"));
  CHECK(skipped_with(&rep, "T/up", "outside"));
  CHECK(skipped_with(&rep, "T/in/f", "symlink"));
  CHECK(skipped_with(&rep, "T/ln", "twice"));
  CHECK(skipped_with(&rep, "T/esc", "outside"));
  CHECK(exists("dst/in") && exists("dst/here"));
  CHECK_EQ_INT(rep.symlinks, 3); /* in, ln, here */
  tar_report_free(&rep);
  CHECK(no_staging());
  teardown();
}

/* The symlink-inside check at its boundary: a link whose ".." reach
 * exactly the top of the copied tree is kept, one more ".." is outside.
 * Read straight, and at each depth of a hostile stream and of a packed
 * host tree (the depth each side passes is what is checked here). */
static void symlink_reaching_the_top_is_kept_one_above_is_not(void) {
  CHECK(tar_symlink_inside(".", 0));
  CHECK(!tar_symlink_inside("..", 0));
  CHECK(!tar_symlink_inside("../x", 0));
  CHECK(tar_symlink_inside("..", 1));
  CHECK(tar_symlink_inside("../x", 1));
  CHECK(!tar_symlink_inside("../..", 1));
  CHECK(!tar_symlink_inside("../../x", 1));
  CHECK(tar_symlink_inside("../../x", 2));
  CHECK(!tar_symlink_inside("../../../x", 2));
  CHECK(!tar_symlink_inside("a/../../x", 2)); /* ".." after a name: never */

  setup();
  const struct ent ents[] = {
      {"T", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      {"T/f", AE_IFREG, 0644, "top", NULL, NULL, 0, false},
      {"T/here", AE_IFLNK, 0, NULL, "f", NULL, 0, false},
      {"T/up", AE_IFLNK, 0, NULL, "../f", NULL, 0, false},
      {"T/d", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      {"T/d/top", AE_IFLNK, 0, NULL, "../f", NULL, 0, false},
      {"T/d/up", AE_IFLNK, 0, NULL, "../../f", NULL, 0, false},
      {"T/d/e", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      {"T/d/e/top", AE_IFLNK, 0, NULL, "../../f", NULL, 0, false},
      {"T/d/e/up", AE_IFLNK, 0, NULL, "../../../f", NULL, 0, false},
  };
  int fd = build_stream(ents, ARRAY_SIZE(ents));
  struct tar_report rep = {0};
  char *err = NULL;
  CHECK_EQ_INT(unpack_into_root(fd, "dst", &big, &rep, &err), 0);
  free(err);
  close(fd);
  CHECK(exists("dst/here") && exists("dst/d/top") && exists("dst/d/e/top"));
  CHECK(!exists("dst/up") && !exists("dst/d/up") && !exists("dst/d/e/up"));
  CHECK(skipped_with(&rep, "T/up", "outside"));
  CHECK(skipped_with(&rep, "T/d/up", "outside"));
  CHECK(skipped_with(&rep, "T/d/e/up", "outside"));
  CHECK_EQ_INT(rep.symlinks, 3);
  CHECK_EQ_INT(rep.skipped, 3);
  tar_report_free(&rep);

  /* The same tree on the host, packed: the same three are left out. */
  CHECK_EQ_INT(sh("cd %s && mkdir -p src/d/e && echo top > src/f && ln -s f src/here && "
                  "ln -s ../f src/up && ln -s ../f src/d/top && ln -s ../../f src/d/up && "
                  "ln -s ../../f src/d/e/top && ln -s ../../../f src/d/e/up",
                  root),
               0);
  char src[PATH_MAX * 2];
  snprintf(src, sizeof src, "%s/src", root);
  fd = mem_fd();
  rep = (struct tar_report){0};
  CHECK_EQ_INT(hostio_copy_from(src, fd, &big, NULL, &rep, &err), 0);
  free(err);
  close(fd);
  CHECK(skipped_with(&rep, "src/up", "outside"));
  CHECK(skipped_with(&rep, "src/d/up", "outside"));
  CHECK(skipped_with(&rep, "src/d/e/up", "outside"));
  CHECK_EQ_INT(rep.symlinks, 3);
  CHECK_EQ_INT(rep.skipped, 3);
  tar_report_free(&rep);
  CHECK(no_staging());
  teardown();
}

/* Names with a control byte (a newline, a terminal escape, DEL, a tab)
 * below the top are left out and listed, with what is below them; so is a
 * symlink whose target has one.  A name that begins with '-' is kept. */
static void names_with_control_bytes_are_skipped(void) {
  setup();
  const struct ent ents[] = {
      {"T", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      {"T/ok", AE_IFREG, 0644, "ok", NULL, NULL, 0, false},
      {"T/-rf", AE_IFREG, 0644, "dash", NULL, NULL, 0, false},
      {"T/new\nline", AE_IFREG, 0644, "x", NULL, NULL, 0, false},
      {"T/\x1b[31mred", AE_IFREG, 0644, "x", NULL, NULL, 0, false},
      {"T/del\x7f", AE_IFREG, 0644, "x", NULL, NULL, 0, false},
      {"T/tab\tname", AE_IFREG, 0644, "x", NULL, NULL, 0, false},
      {"T/d\r", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      {"T/d\r/inner", AE_IFREG, 0644, "x", NULL, NULL, 0, false},
      {"T/link", AE_IFLNK, 0, NULL, "ok\n", NULL, 0, false},
      {"T/sub", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      {"T/sub/\x01", AE_IFREG, 0644, "x", NULL, NULL, 0, false},
      {"T/sub/fine~", AE_IFREG, 0644, "x", NULL, NULL, 0, false},
      {"T/csi\xc2\x9b" "2J", AE_IFREG, 0644, "x", NULL, NULL, 0, false},
      {"T/nel\xc2\x85", AE_IFREG, 0644, "x", NULL, NULL, 0, false},
      {"T/caf\xc3\xa9\xc2\xa0", AE_IFREG, 0644, "x", NULL, NULL, 0, false},
  };
  int fd = build_stream(ents, ARRAY_SIZE(ents));
  struct tar_report rep = {0};
  char *err = NULL;
  CHECK_EQ_INT(unpack_into_root(fd, "dst", &big, &rep, &err), 0);
  free(err);
  close(fd);
  CHECK(exists("dst/ok") && exists("dst/-rf") && exists("dst/sub/fine~"));
  CHECK(exists("dst/caf\xc3\xa9\xc2\xa0")); /* U+00E9, U+00A0: not controls */
  /* Nothing with a control byte anywhere below ROOT. */
  CHECK_EQ_INT(sh("test -z \"$(find %s -name '*[[:cntrl:]]*')\"", root), 0);
  CHECK(!exists("dst/link"));
  const char *why = "control character";
  CHECK(skipped_with(&rep, "T/new\nline", why));
  CHECK(skipped_with(&rep, "T/\x1b[31mred", why));
  CHECK(skipped_with(&rep, "T/del\x7f", why));
  CHECK(skipped_with(&rep, "T/tab\tname", why));
  CHECK(skipped_with(&rep, "T/d\r", why));
  CHECK(skipped_with(&rep, "T/d\r/inner", why));
  CHECK(skipped_with(&rep, "T/link", "target has a control character"));
  CHECK(skipped_with(&rep, "T/sub/\x01", why));
  CHECK(skipped_with(&rep, "T/csi\xc2\x9b" "2J", why)); /* U+009B: CSI */
  CHECK(skipped_with(&rep, "T/nel\xc2\x85", why));     /* U+0085: NEL */
  CHECK_EQ_INT(rep.skipped, 10);
  CHECK_EQ_INT(rep.files, 4);
  tar_report_free(&rep);
  CHECK(no_staging());
  teardown();
}

/* Allocated bytes of ROOT/REL (st_blocks), or -1. */
static long long allocated(const char *rel) {
  char p[PATH_MAX * 2];
  snprintf(p, sizeof p, "%s/%s", root, rel);
  struct stat st;
  return lstat(p, &st) < 0 ? -1 : (long long)st.st_blocks * 512;
}

/* A 60 MiB file with two small data regions and holes around them, and
 * one that is all hole, keep their holes through a copy (pack and
 * unpack): the stream is small, the copy allocates what the original
 * does, its content is the same.  The cap counts the logical size, holes
 * included, on both sides. */
static void sparse_files_keep_their_holes(void) {
  setup();
  CHECK_EQ_INT(sh("cd %s && mkdir src && truncate -s 60M src/holes && "
                  "printf head | dd of=src/holes bs=1 seek=1048576 conv=notrunc 2>/dev/null && "
                  "printf tail | dd of=src/holes bs=1 seek=31457280 conv=notrunc 2>/dev/null && "
                  "truncate -s 60M src/empty && echo dense > src/dense",
                  root),
               0);
  if (allocated("src/holes") > 1024 * 1024) {
    fprintf(stderr, "  skipped: %s keeps no holes\n", root);
    teardown();
    return;
  }
  char src[PATH_MAX * 2], dst[PATH_MAX * 2];
  snprintf(src, sizeof src, "%s/src", root);
  snprintf(dst, sizeof dst, "%s/dst", root);
  int fd = mem_fd();
  struct tar_report packed = {0}, rep = {0};
  char *err = NULL;
  CHECK_EQ_INT(hostio_copy_from(src, fd, &big, NULL, &packed, &err), 0);
  struct stat st;
  fstat(fd, &st);
  fprintf(stderr, "  stream %lld bytes; %llu bytes of content packed\n", (long long)st.st_size,
          (unsigned long long)packed.bytes);
  CHECK(st.st_size < 1024 * 1024);
  lseek(fd, 0, SEEK_SET);
  CHECK_EQ_INT(hostio_copy_to(fd, dst, &big, NULL, &rep, &err), 0);
  if (err)
    fprintf(stderr, "  %s\n", err);
  free(err);
  err = NULL;
  close(fd);
  CHECK_EQ_INT(rep.files, 3);
  CHECK_EQ_INT(rep.bytes, packed.bytes);
  CHECK(rep.bytes < 1024 * 1024); /* the data regions, not the holes */
  fprintf(stderr, "  allocated: holes %lld -> %lld, empty %lld -> %lld\n",
          allocated("src/holes"), allocated("dst/holes"), allocated("src/empty"),
          allocated("dst/empty"));
  CHECK(allocated("dst/holes") <= allocated("src/holes") + 64 * 1024);
  CHECK(allocated("dst/empty") <= 64 * 1024);
  CHECK_EQ_INT(sh("cd %s && cmp src/holes dst/holes && cmp src/empty dst/empty && "
                  "cmp src/dense dst/dense && test $(stat -c %%s dst/holes) = 62914560",
                  root),
               0);
  tar_report_free(&packed);
  tar_report_free(&rep);

  /* The cap counts the holes: 60 MiB is over a 10 MiB cap, either side. */
  const struct tar_limits small = {10 * 1024 * 1024, 100};
  fd = mem_fd();
  CHECK_EQ_INT(hostio_copy_from(src, fd, &small, NULL, &packed, &err), -EFBIG);
  CHECK(err && strstr(err, "IGN_MCP_COPY_MAX_MB"));
  free(err);
  err = NULL;
  tar_report_free(&packed);
  close(fd);
  fd = mem_fd();
  CHECK_EQ_INT(hostio_copy_from(src, fd, &big, NULL, &packed, &err), 0);
  tar_report_free(&packed);
  lseek(fd, 0, SEEK_SET);
  snprintf(dst, sizeof dst, "%s/capped", root);
  CHECK_EQ_INT(hostio_copy_to(fd, dst, &small, NULL, &rep, &err), -EFBIG);
  CHECK(err && strstr(err, "IGN_MCP_COPY_MAX_MB"));
  free(err);
  tar_report_free(&rep);
  close(fd);
  CHECK(!exists("capped"));
  CHECK(no_staging());
  teardown();
}

static void hostile_sizes_hit_the_caps(void) {
  setup();
  sh("mkdir -p %s/dst && echo old > %s/dst/old && cp -a %s/dst %s/ref && mkdir %s/dst/sub && "
     "chmod 0700 %s/dst/sub && cp -a %s/dst/sub %s/ref/",
     root, root, root, root, root, root, root, root);
  struct tar_limits lim = {1024 * 1024, 10};
  char *err = NULL;
  /* A declared size over the cap: refused before any of it is read. */
  const struct ent huge[] = {
      {"T", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      {"T/huge", AE_IFREG, 0644, NULL, NULL, NULL, 1ll << 40, true},
  };
  int fd = build_stream(huge, ARRAY_SIZE(huge));
  CHECK_EQ_INT(unpack_into_root(fd, "dst", &lim, NULL, &err), -EFBIG);
  free(err);
  err = NULL;
  close(fd);
  check_untouched();
  /* Many small files together over the cap. */
  static char chunk[300 * 1024];
  memset(chunk, 'a', sizeof chunk - 1);
  const struct ent many[] = {
      {"T", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false},
      {"T/1", AE_IFREG, 0644, chunk, NULL, NULL, 0, false},
      {"T/2", AE_IFREG, 0644, chunk, NULL, NULL, 0, false},
      {"T/3", AE_IFREG, 0644, chunk, NULL, NULL, 0, false},
      {"T/4", AE_IFREG, 0644, chunk, NULL, NULL, 0, false},
  };
  fd = build_stream(many, ARRAY_SIZE(many));
  CHECK_EQ_INT(unpack_into_root(fd, "dst", &lim, NULL, &err), -EFBIG);
  free(err);
  err = NULL;
  close(fd);
  check_untouched();
  /* Over max_files, skipped entries counted too. */
  struct ent files[14];
  char names[14][16];
  files[0] = (struct ent){"T", AE_IFDIR, 0755, NULL, NULL, NULL, 0, false};
  for (int i = 1; i < 14; i++) {
    snprintf(names[i], sizeof names[i], i % 2 ? "T/f%d" : "../f%d", i);
    files[i] = (struct ent){names[i], AE_IFREG, 0644, "x", NULL, NULL, 0, false};
  }
  fd = build_stream(files, ARRAY_SIZE(files));
  CHECK_EQ_INT(unpack_into_root(fd, "dst", &lim, NULL, &err), -E2BIG);
  free(err);
  close(fd);
  check_untouched();
  teardown();
}

/* Through a pipe between two processes, both ends non-blocking as the
 * agent's are: the sender finishes cleanly (its padding after the end
 * marker is read, not cut off with SIGPIPE). */
static void stream_through_a_pipe(void) {
  setup();
  sh("cd %s && mkdir -p src/d && head -c 3000000 /dev/urandom > src/d/big && "
     "for i in $(seq 1 200); do echo $i > src/f$i; done",
     root);
  int p[2];
  CHECK_EQ_INT(pipe2(p, O_CLOEXEC | O_NONBLOCK), 0);
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    char *err = NULL;
    struct tar_report rep = {0};
    int r = hostio_copy_from("src", p[1], &big, NULL, &rep, &err);
    _exit(r == 0 && rep.files == 201 ? 0 : 1);
  }
  close(p[1]);
  struct tar_report rep = {0};
  char *err = NULL;
  CHECK_EQ_INT(hostio_copy_to(p[0], "dst", &big, NULL, &rep, &err), 0);
  if (err)
    fprintf(stderr, "  %s\n", err);
  free(err);
  close(p[0]);
  int status;
  CHECK_EQ_INT(waitpid(pid, &status, 0), pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK_EQ_INT(rep.files, 201);
  CHECK_EQ_INT(rep.bytes, 3000000 + 9 * 2 + 90 * 3 + 101 * 4);
  CHECK_EQ_INT(sh("cd %s && diff -r src dst", root), 0);
  tar_report_free(&rep);
  teardown();
}

TEST_MAIN(TEST(stream_through_a_pipe), TEST(round_trip_keeps_tree_modes_and_inner_symlinks),
          TEST(read_refuses_paths_that_leave_the_root), TEST(fifo_is_refused_without_blocking),
          TEST(device_nodes_are_skipped), TEST(destination_symlink_is_refused),
          TEST(copy_out_off_refuses_writes), TEST(failed_copy_leaves_destination_intact),
          TEST(hostile_names_are_skipped), TEST(symlink_then_write_through_is_refused),
          TEST(symlink_reaching_the_top_is_kept_one_above_is_not),
          TEST(names_with_control_bytes_are_skipped), TEST(sparse_files_keep_their_holes),
          TEST(hostile_sizes_hit_the_caps))
