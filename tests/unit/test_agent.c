/* test_agent.c: ign-agent in --serve-fd mode, for real.  Each test starts
 * the agent binary (IGN_AGENT, default build/ign-agent) on a socketpair,
 * speaks the protocol through agent_client.h and checks what comes back:
 * output bytes, exit statuses, timeouts, cancellation, background processes,
 * files, and the errors for bad requests.  Files go to a fresh directory
 * under /tmp that each test removes. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/unit/agent_client.h"
#include "tests/unit/test.h"

struct conn {
  pid_t pid;
  int fd;
};

static bool conn_start(struct conn *c) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
    return false;
  pid_t pid = fork();
  if (pid < 0)
    return false;
  if (pid == 0) {
    if (sv[1] == 3)
      fcntl(3, F_SETFD, 0);
    else if (dup2(sv[1], 3) < 0)
      _exit(126);
    execl(ac_agent_path(), "ign-agent", "--serve-fd", "3", (char *)NULL);
    _exit(127);
  }
  close(sv[1]);
  c->pid = pid;
  c->fd = sv[0];
  return true;
}

/* Close the channel; the agent must exit 0 at EOF.  Returns its status. */
static int conn_stop(struct conn *c) {
  close(c->fd);
  int status = ac_wait_exit(c->pid, 5000);
  c->fd = -1;
  return status;
}

#define START(c)                                                                  \
  struct conn c;                                                                  \
  if (!conn_start(&c)) {                                                          \
    CHECK(!"cannot start the agent");                                             \
    return;                                                                       \
  }
#define STOP(c) CHECK_EQ_INT(conn_stop(&c), 0)

static bool bytes_eq(const struct ac_bytes *b, const void *p, size_t n) {
  return b->len == n && (n == 0 || memcmp(b->data, p, n) == 0);
}

static char *make_tmpdir(void) {
  char tmpl[256];
  char *d = test_mkdtemp(tmpl, sizeof tmpl, "ign-agent-test");
  return d ? strdup(d) : NULL;
}

static void remove_tree(char *dir) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  CHECK_EQ_INT(system(cmd), 0);
  free(dir);
}

/* ---- connection --------------------------------------------------------- */

static void test_hello_and_version_mismatch(void) {
  START(c);
  struct ac_result r = {0};
  char info[256];
  CHECK_EQ_INT(ac_hello(c.fd, 1, PROTO_VERSION, &r, info, sizeof info), 0);
  CHECK_EQ_INT(r.terminal, PROTO_HELLO_OK);
  CHECK(strstr(info, "ign-agent ") == info);
  CHECK(strstr(info, "mode=fd") != NULL);
  ac_result_free(&r);

  CHECK_EQ_INT(ac_hello(c.fd, 2, PROTO_VERSION + 1, &r, NULL, 0), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EPROTONOSUPPORT);
  char want[80];
  snprintf(want, sizeof want, "agent speaks protocol %u, host asked for %u", PROTO_VERSION,
           PROTO_VERSION + 1);
  CHECK_STREQ(r.message, want);
  ac_result_free(&r);

  /* SETUP's TLVs in HELLO are set before the answer: one that is wrong
   * makes the HELLO fail (a clone must not come up without its clock and
   * entropy), and says why.  (Valid ones would change this host.) */
  CHECK_EQ_INT(ac_hello_with(c.fd, 3, TAG_MACHINE_ID, "not-hex", &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EINVAL);
  CHECK(r.message && strstr(r.message, "MACHINE_ID") != NULL);
  ac_result_free(&r);
  STOP(c);
}

static void test_ping(void) {
  START(c);
  CHECK(ac_ping_ok(c.fd, 77));
  CHECK(ac_ping_ok(c.fd, 0xfffffffe));
  STOP(c);
}

/* ---- exec --------------------------------------------------------------- */

static void test_stdout_stderr_exact(void) {
  START(c);
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_sh(c.fd, 5, "printf 'out\\000put\\n'; printf 'to err' >&2", &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_EXIT);
  CHECK(bytes_eq(&r.out, "out\0put\n", 8));
  CHECK(bytes_eq(&r.err, "to err", 6));
  CHECK_EQ_INT(r.exit_code, 0);
  CHECK_EQ_INT(r.signal, 0);
  CHECK_EQ_INT(r.timed_out, 0);
  CHECK(r.duration_us > 0 && r.duration_us < 5000000);
  ac_result_free(&r);
  STOP(c);
}

static void test_exit_code(void) {
  START(c);
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_sh(c.fd, 6, "exit 3", &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_EXIT);
  CHECK_EQ_INT(r.exit_code, 3);
  CHECK_EQ_INT(r.signal, 0);
  ac_result_free(&r);
  STOP(c);
}

static void test_signal(void) {
  START(c);
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_sh(c.fd, 7, "kill -9 $$", &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_EXIT);
  CHECK_EQ_INT(r.signal, 9);
  CHECK_EQ_INT(r.exit_code, 0xffffffffu);
  CHECK_EQ_INT(r.timed_out, 0);
  ac_result_free(&r);
  STOP(c);
}

static void test_stdin_roundtrip(void) {
  START(c);
  size_t n = 300000;
  uint8_t *in = malloc(n);
  for (size_t i = 0; i < n; i++)
    in[i] = (uint8_t)(i * 7 + i / 256); /* every byte value, NUL included */
  struct ac_exec e = {.command = "cat", .has_stdin = true, .stdin_data = in, .stdin_len = n};
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_run(c.fd, 8, &e, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_EXIT);
  CHECK_EQ_INT(r.exit_code, 0);
  CHECK_EQ_INT(r.out.len, n);
  CHECK(bytes_eq(&r.out, in, n));
  ac_result_free(&r);

  /* Empty stdin: the command sees EOF at once. */
  e = (struct ac_exec){.command = "wc -c", .has_stdin = true};
  CHECK_EQ_INT(ac_run(c.fd, 9, &e, &r), 0);
  CHECK(bytes_eq(&r.out, "0\n", 2));
  ac_result_free(&r);

  /* Without stdin it is /dev/null, not the agent's own stdin. */
  CHECK_EQ_INT(ac_sh(c.fd, 10, "wc -c", &r), 0);
  CHECK(bytes_eq(&r.out, "0\n", 2));
  ac_result_free(&r);
  free(in);
  STOP(c);
}

static void test_stdin_too_large(void) {
  START(c);
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_EXEC, 11);
  proto_put_str(&b, TAG_COMMAND, "cat >/dev/null");
  proto_put_u32(&b, TAG_HAS_STDIN, 1);
  CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  static uint8_t chunk[PROTO_CHUNK];
  for (size_t sent = 0; sent <= (16u << 20); sent += sizeof chunk)
    CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STDIN, 11, chunk, sizeof chunk), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STDIN_END, 11, NULL, 0), 0);
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_collect(c.fd, 11, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EFBIG);
  CHECK_STREQ(r.message, "stdin is larger than 16 MiB");
  ac_result_free(&r);
  /* The rest of that stdin was dropped silently. */
  CHECK(ac_ping_ok(c.fd, 12));
  STOP(c);
}

static void test_env_and_cwd(void) {
  START(c);
  char *dir = make_tmpdir();
  const char *env[] = {"FOO=bar baz", "TERM=xterm", "EMPTY=", NULL};
  struct ac_exec e = {
      .command = "printf '%s|%s|%s|%s|%s|' \"$FOO\" \"$TERM\" \"$HOME\" \"$LANG\" \"$(pwd)\";"
                 " env | grep -c '^TERM='; printf '%s' \"${EMPTY-unset}\"",
      .cwd = dir,
      .env = env,
  };
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_run(c.fd, 13, &e, &r), 0);
  char want[512];
  snprintf(want, sizeof want, "bar baz|xterm|/root|C.UTF-8|%s|1\n", dir);
  CHECK_EQ_INT(r.exit_code, 0);
  CHECK(bytes_eq(&r.out, want, strlen(want)));
  ac_result_free(&r);

  /* A relative cwd is taken from /root (usable only by root on a host). */
  if (geteuid() == 0) {
    e = (struct ac_exec){.command = "pwd", .cwd = "."};
    CHECK_EQ_INT(ac_run(c.fd, 14, &e, &r), 0);
    CHECK(bytes_eq(&r.out, "/root\n", 6));
    ac_result_free(&r);
  }
  remove_tree(dir);
  STOP(c);
}

static void test_cwd_errors(void) {
  START(c);
  struct ac_exec e = {.command = "true", .cwd = "/nonexistent/ign-agent-test"};
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_run(c.fd, 15, &e, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, ENOENT);
  CHECK_STREQ(r.message, "cwd '/nonexistent/ign-agent-test' does not exist in the sandbox");
  ac_result_free(&r);

  e.cwd = "/etc/passwd";
  CHECK_EQ_INT(ac_run(c.fd, 16, &e, &r), 0);
  CHECK_EQ_INT(r.error, ENOTDIR);
  CHECK(strstr(r.message, "is not a directory") != NULL);
  ac_result_free(&r);
  CHECK(ac_ping_ok(c.fd, 17));
  STOP(c);
}

static void test_timeout(void) {
  START(c);
  struct ac_exec e = {.command = "echo begin; sleep 10; echo never", .timeout_ms = 300};
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_run(c.fd, 18, &e, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_EXIT);
  CHECK_EQ_INT(r.timed_out, 1);
  CHECK_EQ_INT(r.signal, 9);
  CHECK(bytes_eq(&r.out, "begin\n", 6));
  CHECK(r.elapsed_ms >= 250 && r.elapsed_ms < 3000);
  ac_result_free(&r);
  STOP(c);
}

static void test_kill_cancels(void) {
  START(c);
  struct ac_exec e = {.command = "echo ready; sleep 10 & sleep 10; echo never"};
  CHECK_EQ_INT(ac_send_exec(c.fd, 19, &e), 0);
  struct proto_header h;
  CHECK_EQ_INT(ac_recv(c.fd, &h, AC_TIMEOUT_MS), 0);
  CHECK_EQ_INT(h.type, PROTO_STDOUT);
  uint64_t start = ac_now_ms();
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_KILL, 19, NULL, 0), 0);
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_collect(c.fd, 19, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_EXIT);
  CHECK_EQ_INT(r.signal, 9);
  CHECK_EQ_INT(r.timed_out, 0);
  CHECK(r.out.len == 0); /* "never" was not printed */
  CHECK(ac_now_ms() - start < 3000);
  ac_result_free(&r);

  /* KILL for an id nobody uses is ignored: no frame comes back. */
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_KILL, 4242, NULL, 0), 0);
  CHECK(ac_ping_ok(c.fd, 20));

  /* KILL of a command still waiting for its stdin ends it at once. */
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_EXEC, 21);
  proto_put_str(&b, TAG_COMMAND, "cat");
  proto_put_u32(&b, TAG_HAS_STDIN, 1);
  CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_KILL, 21, NULL, 0), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STDIN, 21, "late", 4), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STDIN_END, 21, NULL, 0), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 21, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_EXIT);
  CHECK_EQ_INT(r.signal, 9);
  ac_result_free(&r);
  CHECK(ac_ping_ok(c.fd, 22));
  STOP(c);
}

/* The pid a command printed with `echo $!` (alone on its stream). */
static pid_t output_pid(const struct ac_bytes *out) {
  char buf[32];
  if (out->len == 0 || out->len >= sizeof buf)
    return 0;
  memcpy(buf, out->data, out->len);
  buf[out->len] = '\0';
  return (pid_t)atoi(buf);
}

static void test_background_process(void) {
  START(c);
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_sh(c.fd, 23, "sleep 300 & echo $!", &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_EXIT);
  CHECK_EQ_INT(r.exit_code, 0);
  CHECK(r.elapsed_ms < 2000);
  pid_t bg = output_pid(&r.out);
  CHECK(bg > 1);
  ac_result_free(&r);

  /* Still running for a later call. */
  char cmd[64];
  snprintf(cmd, sizeof cmd, "kill -0 %d && echo alive", (int)bg);
  CHECK_EQ_INT(ac_sh(c.fd, 24, cmd, &r), 0);
  CHECK(bytes_eq(&r.out, "alive\n", 6));
  ac_result_free(&r);

  /* A background process that keeps writing to the inherited stdout must
   * neither leak into later results nor die of SIGPIPE. */
  CHECK_EQ_INT(ac_sh(c.fd, 25, "(while :; do echo tick; sleep 0.05; done) & echo $! >&2", &r), 0);
  pid_t ticker = output_pid(&r.err); /* stdout may already hold a tick */
  CHECK(ticker > 1);
  ac_result_free(&r);
  usleep(300000);
  CHECK_EQ_INT(ac_sh(c.fd, 26, "echo next", &r), 0);
  CHECK(bytes_eq(&r.out, "next\n", 5));
  ac_result_free(&r);
  CHECK(!ac_pid_dead(ticker));

  /* At EOF the agent exits 0 and takes its commands' groups with it. */
  STOP(c);
  usleep(100000);
  CHECK(ac_pid_dead(bg));
  CHECK(ac_pid_dead(ticker));
}

static void test_concurrent_execs(void) {
  START(c);
  struct ac_exec a = {.command = "for i in 1 2 3 4; do echo a$i; sleep 0.1; done"};
  struct ac_exec b = {.command = "for i in 1 2 3 4; do echo b$i; sleep 0.1; done; exit 4"};
  CHECK_EQ_INT(ac_send_exec(c.fd, 30, &a), 0);
  CHECK_EQ_INT(ac_send_exec(c.fd, 31, &b), 0);
  struct ac_result ra = {0}, rb = {0};
  int switches = 0;
  uint32_t last = 0;
  while (!ra.terminal || !rb.terminal) {
    struct proto_header h;
    if (ac_recv(c.fd, &h, AC_TIMEOUT_MS) < 0) {
      CHECK(!"timed out waiting for the two commands");
      break;
    }
    CHECK(h.id == 30 || h.id == 31);
    if (last && h.id != last)
      switches++;
    last = h.id;
    ac_result_take(h.id == 30 ? &ra : &rb, &h, ac_payload);
  }
  CHECK(bytes_eq(&ra.out, "a1\na2\na3\na4\n", 12));
  CHECK(bytes_eq(&rb.out, "b1\nb2\nb3\nb4\n", 12));
  CHECK_EQ_INT(ra.exit_code, 0);
  CHECK_EQ_INT(rb.exit_code, 4);
  CHECK(switches >= 3); /* the two streams were interleaved, not serialized */
  ac_result_free(&ra);
  ac_result_free(&rb);
  STOP(c);
}

static void test_big_output(void) {
  START(c);
  size_t n = 1u << 20;
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_sh(c.fd, 32, "yes 0123456789abcdef | head -c 1048576", &r), 0);
  CHECK_EQ_INT(r.exit_code, 0);
  CHECK_EQ_INT(r.out.len, n);
  bool same = r.out.len == n;
  for (size_t i = 0; same && i < n; i++)
    same = r.out.data[i] == "0123456789abcdef\n"[i % 17];
  CHECK(same);
  CHECK_EQ_INT(r.err.len, 0);
  ac_result_free(&r);
  STOP(c);
}

static void test_too_many_and_duplicate(void) {
  START(c);
  struct ac_exec e = {.command = "sleep 30"};
  for (uint32_t id = 100; id < 164; id++)
    CHECK_EQ_INT(ac_send_exec(c.fd, id, &e), 0);
  CHECK(ac_ping_ok(c.fd, 1)); /* all 64 started without a word */

  struct ac_result r = {0};
  CHECK_EQ_INT(ac_run(c.fd, 164, &e, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EAGAIN);
  CHECK(strstr(r.message, "too many commands") != NULL);
  ac_result_free(&r);

  CHECK_EQ_INT(ac_run(c.fd, 100, &e, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EEXIST);
  ac_result_free(&r);

  for (uint32_t id = 100; id < 164; id++)
    CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_KILL, id, NULL, 0), 0);
  int exits = 0;
  for (int i = 0; i < 64; i++) {
    struct proto_header h;
    if (ac_recv(c.fd, &h, AC_TIMEOUT_MS) < 0)
      break;
    if (h.type == PROTO_EXIT && ac_u32(ac_payload, h.len, TAG_SIGNAL, 0) == 9)
      exits++;
  }
  CHECK_EQ_INT(exits, 64);
  STOP(c);
}

/* ---- files -------------------------------------------------------------- */

static void test_write_read_roundtrip(void) {
  START(c);
  char *dir = make_tmpdir();
  char path[512];
  snprintf(path, sizeof path, "%s/a/b/c.bin", dir);
  size_t n = 200000;
  uint8_t *data = malloc(n);
  for (size_t i = 0; i < n; i++)
    data[i] = (uint8_t)(i * 31 + 7 + i / 251);
  data[0] = 0;

  struct ac_result r = {0};
  CHECK_EQ_INT(ac_write_file(c.fd, 40, path, 0640, data, n, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_OK);
  CHECK_EQ_INT(r.size, n);
  ac_result_free(&r);
  struct stat st;
  CHECK_EQ_INT(stat(path, &st), 0);
  CHECK_EQ_INT(st.st_mode & 07777, 0640);
  CHECK_EQ_INT(st.st_size, n);

  /* Whole file. */
  CHECK_EQ_INT(ac_read_file(c.fd, 41, path, 0, UINT64_MAX, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_READ_END);
  CHECK(bytes_eq(&r.data, data, n));
  CHECK_EQ_INT(r.size, n);
  CHECK_EQ_INT(r.bytes, n);
  CHECK_EQ_INT(r.eof, 1);
  ac_result_free(&r);

  /* A window in the middle: not the end. */
  CHECK_EQ_INT(ac_read_file(c.fd, 42, path, 1000, 5000, &r), 0);
  CHECK(bytes_eq(&r.data, data + 1000, 5000));
  CHECK_EQ_INT(r.bytes, 5000);
  CHECK_EQ_INT(r.eof, 0);
  CHECK_EQ_INT(r.size, n);
  ac_result_free(&r);

  /* MAX lands exactly on the end: EOF is still reported. */
  CHECK_EQ_INT(ac_read_file(c.fd, 43, path, n - 100, 100, &r), 0);
  CHECK(bytes_eq(&r.data, data + n - 100, 100));
  CHECK_EQ_INT(r.eof, 1);
  ac_result_free(&r);

  /* The tail, shorter than MAX; and past the end. */
  CHECK_EQ_INT(ac_read_file(c.fd, 44, path, n - 10, 100, &r), 0);
  CHECK(bytes_eq(&r.data, data + n - 10, 10));
  CHECK_EQ_INT(r.bytes, 10);
  CHECK_EQ_INT(r.eof, 1);
  ac_result_free(&r);
  CHECK_EQ_INT(ac_read_file(c.fd, 45, path, n + 5, 100, &r), 0);
  CHECK_EQ_INT(r.bytes, 0);
  CHECK_EQ_INT(r.eof, 1);
  ac_result_free(&r);

  /* Overwrite: the new content replaces the old, default mode 0644. */
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_WRITE, 46);
  proto_put_str(&b, TAG_PATH, path);
  proto_put_u64(&b, TAG_SIZE, 3);
  CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_DATA, 46, "new", 3), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_DATA_END, 46, NULL, 0), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 46, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_OK);
  ac_result_free(&r);
  CHECK_EQ_INT(stat(path, &st), 0);
  CHECK_EQ_INT(st.st_mode & 07777, 0644);
  CHECK_EQ_INT(ac_read_file(c.fd, 47, path, 0, 1000, &r), 0);
  CHECK(bytes_eq(&r.data, "new", 3));
  ac_result_free(&r);

  /* A file that reports size 0 (/proc): SIZE is what was read. */
  CHECK_EQ_INT(ac_read_file(c.fd, 48, "/proc/self/status", 0, 1 << 20, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_READ_END);
  CHECK(r.bytes > 0);
  CHECK_EQ_INT(r.size, r.bytes);
  CHECK_EQ_INT(r.eof, 1);
  CHECK(r.data.len > 5 && memcmp(r.data.data, "Name:", 5) == 0);
  ac_result_free(&r);

  /* A relative path lands under /root (writable only by root on a host). */
  if (geteuid() == 0) {
    char rel[128], abs[160];
    snprintf(rel, sizeof rel, ".ign-agent-test-%d", (int)getpid());
    snprintf(abs, sizeof abs, "/root/%s", rel);
    CHECK_EQ_INT(ac_write_file(c.fd, 49, rel, 0600, "x", 1, &r), 0);
    CHECK_EQ_INT(r.terminal, PROTO_OK);
    ac_result_free(&r);
    CHECK_EQ_INT(access(abs, F_OK), 0);
    unlink(abs);
  }

  free(data);
  remove_tree(dir);
  STOP(c);
}

static bool has_temp_files(const char *dir) {
  DIR *d = opendir(dir);
  if (!d)
    return false;
  bool found = false;
  for (struct dirent *e; (e = readdir(d));)
    found |= strstr(e->d_name, ".ign-") != NULL;
  closedir(d);
  return found;
}

static void test_write_errors(void) {
  START(c);
  char *dir = make_tmpdir();
  char path[512];
  struct ac_result r = {0};

  CHECK_EQ_INT(ac_write_file(c.fd, 50, "", 0644, "x", 1, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EINVAL);
  CHECK_STREQ(r.message, "path is empty");
  ac_result_free(&r);

  CHECK_EQ_INT(ac_write_file(c.fd, 51, dir, 0644, "x", 1, &r), 0);
  CHECK_EQ_INT(r.error, EISDIR);
  char want[600];
  snprintf(want, sizeof want, "'%s' is a directory; give a file path", dir);
  CHECK_STREQ(r.message, want);
  ac_result_free(&r);

  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_WRITE, 52);
  proto_put_bytes(&b, TAG_PATH, "/tmp/a\0b", 8);
  proto_put_u64(&b, TAG_SIZE, 0);
  CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_DATA_END, 52, NULL, 0), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 52, &r), 0);
  CHECK_EQ_INT(r.error, EINVAL);
  ac_result_free(&r);
  CHECK(ac_ping_ok(c.fd, 53)); /* its DATA_END was dropped silently */

  /* Short: SIZE 10, 5 bytes sent.  Nothing is created. */
  snprintf(path, sizeof path, "%s/short", dir);
  proto_frame_begin(&b, PROTO_WRITE, 54);
  proto_put_str(&b, TAG_PATH, path);
  proto_put_u64(&b, TAG_SIZE, 10);
  CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_DATA, 54, "12345", 5), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_DATA_END, 54, NULL, 0), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 54, &r), 0);
  CHECK_EQ_INT(r.error, EIO);
  snprintf(want, sizeof want, "received 5 of 10 bytes for '%s'", path);
  CHECK_STREQ(r.message, want);
  ac_result_free(&r);
  CHECK(access(path, F_OK) < 0);

  /* Too long: the ERROR comes at once; the rest of the id is dropped. */
  proto_frame_begin(&b, PROTO_WRITE, 55);
  proto_put_str(&b, TAG_PATH, path);
  proto_put_u64(&b, TAG_SIZE, 3);
  CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_DATA, 55, "12345", 5), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 55, &r), 0);
  CHECK_EQ_INT(r.error, EIO);
  ac_result_free(&r);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_DATA, 55, "67", 2), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_DATA_END, 55, NULL, 0), 0);
  CHECK(ac_ping_ok(c.fd, 56));
  CHECK(access(path, F_OK) < 0);
  CHECK(!has_temp_files(dir));

  /* A parent that is a file. */
  snprintf(path, sizeof path, "%s/file", dir);
  CHECK_EQ_INT(ac_write_file(c.fd, 57, path, 0644, "f", 1, &r), 0);
  ac_result_free(&r);
  snprintf(path, sizeof path, "%s/file/sub/x", dir);
  CHECK_EQ_INT(ac_write_file(c.fd, 58, path, 0644, "x", 1, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, ENOTDIR);
  ac_result_free(&r);

  /* DATA for an id with no WRITE. */
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_DATA, 59, "x", 1), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 59, &r), 0);
  CHECK_EQ_INT(r.error, EPROTO);
  ac_result_free(&r);

  remove_tree(dir);
  STOP(c);
}

static void test_read_errors(void) {
  START(c);
  char *dir = make_tmpdir();
  char path[512], want[600];
  struct ac_result r = {0};

  snprintf(path, sizeof path, "%s/missing", dir);
  CHECK_EQ_INT(ac_read_file(c.fd, 60, path, 0, 100, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, ENOENT);
  snprintf(want, sizeof want, "'%s' does not exist in the sandbox", path);
  CHECK_STREQ(r.message, want);
  ac_result_free(&r);

  CHECK_EQ_INT(ac_read_file(c.fd, 61, dir, 0, 100, &r), 0);
  CHECK_EQ_INT(r.error, EISDIR);
  ac_result_free(&r);

  snprintf(path, sizeof path, "%s/fifo", dir);
  CHECK_EQ_INT(mkfifo(path, 0600), 0);
  CHECK_EQ_INT(ac_read_file(c.fd, 62, path, 0, 100, &r), 0);
  CHECK_EQ_INT(r.error, EINVAL);
  snprintf(want, sizeof want, "'%s' is not a regular file", path);
  CHECK_STREQ(r.message, want);
  ac_result_free(&r);

  CHECK_EQ_INT(ac_read_file(c.fd, 63, "", 0, 100, &r), 0);
  CHECK_EQ_INT(r.error, EINVAL);
  ac_result_free(&r);
  remove_tree(dir);
  STOP(c);
}

/* ---- malformed input ---------------------------------------------------- */

static void test_malformed_requests(void) {
  START(c);
  struct ac_result r = {0};

  /* A TLV whose length runs past the payload. */
  uint8_t bad[] = {TAG_COMMAND, 0, 0xff, 0, 0, 0, 'e', 'c', 'h', 'o'};
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_EXEC, 70, bad, sizeof bad), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 70, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EPROTO);
  CHECK(strstr(r.message, "runs past the payload") != NULL);
  ac_result_free(&r);

  /* A truncated TLV header. */
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_READ, 71, "\x14\x00\x01", 3), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 71, &r), 0);
  CHECK_EQ_INT(r.error, EPROTO);
  ac_result_free(&r);

  /* An integer of the wrong width. */
  struct proto_buf b = {0};
  proto_frame_begin(&b, PROTO_EXEC, 72);
  proto_put_str(&b, TAG_COMMAND, "true");
  proto_put_bytes(&b, TAG_TIMEOUT_MS, "\x01\x02", 2);
  CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 72, &r), 0);
  CHECK_EQ_INT(r.error, EPROTO);
  CHECK(strstr(r.message, "TIMEOUT_MS") != NULL);
  ac_result_free(&r);

  /* A missing required field. */
  proto_frame_begin(&b, PROTO_EXEC, 73);
  proto_put_u32(&b, TAG_TIMEOUT_MS, 5);
  CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 73, &r), 0);
  CHECK_EQ_INT(r.error, EPROTO);
  CHECK(strstr(r.message, "COMMAND is missing") != NULL);
  ac_result_free(&r);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_HELLO, 74, NULL, 0), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 74, &r), 0);
  CHECK_EQ_INT(r.error, EPROTO);
  ac_result_free(&r);

  /* Bad values. */
  const char *env[] = {"NOEQUALS", NULL};
  struct ac_exec e = {.command = "true", .env = env};
  CHECK_EQ_INT(ac_run(c.fd, 75, &e, &r), 0);
  CHECK_EQ_INT(r.error, EINVAL);
  ac_result_free(&r);
  proto_frame_begin(&b, PROTO_EXEC, 76);
  proto_put_bytes(&b, TAG_COMMAND, "echo\0x", 6);
  CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 76, &r), 0);
  CHECK_EQ_INT(r.error, EINVAL);
  ac_result_free(&r);

  /* A frame type only the agent sends. */
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_STDOUT, 77, "x", 1), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 77, &r), 0);
  CHECK_EQ_INT(r.error, EPROTO);
  CHECK_STREQ(r.message, "unexpected STDOUT frame from the host");
  ac_result_free(&r);

  /* SETUP with an invalid field changes nothing and says why; an empty one
   * is fine.  (Valid fields would change this host: not tested here.) */
  proto_frame_begin(&b, PROTO_SETUP, 78);
  proto_put_str(&b, TAG_MACHINE_ID, "not-hex");
  CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  CHECK_EQ_INT(ac_collect(c.fd, 78, &r), 0);
  CHECK_EQ_INT(r.error, EINVAL);
  ac_result_free(&r);
  /* Until a SETUP succeeds nothing runs (a request sent right behind a
   * SETUP that failed must not run without it), and the stdin that
   * follows a refused command is dropped. */
  struct ac_exec refused = {.command = "cat", .has_stdin = true, .stdin_data = "x", .stdin_len = 1};
  CHECK_EQ_INT(ac_run(c.fd, 81, &refused, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EAGAIN);
  ac_result_free(&r);
  CHECK(ac_empty_setup_ok(c.fd, 79));

  /* Still serving. */
  CHECK_EQ_INT(ac_sh(c.fd, 80, "echo fine", &r), 0);
  CHECK(bytes_eq(&r.out, "fine\n", 5));
  ac_result_free(&r);
  STOP(c);
}

static void test_bad_header_closes(void) {
  START(c);
  uint8_t hdr[PROTO_HEADER_SIZE];
  struct proto_header h = {.len = 0, .type = PROTO_PING, .flags = 1, .id = 5};
  proto_header_encode(hdr, &h);
  CHECK_EQ_INT(proto_write_all(c.fd, hdr, sizeof hdr), 0);
  struct ac_result r = {0};
  CHECK_EQ_INT(ac_collect(c.fd, 0, &r), 0);
  CHECK_EQ_INT(r.terminal, PROTO_ERROR);
  CHECK_EQ_INT(r.error, EPROTO);
  ac_result_free(&r);
  /* Then the connection closes and the agent exits non-zero. */
  CHECK_EQ_INT(ac_recv(c.fd, &h, AC_TIMEOUT_MS), -ENODATA);
  int status = conn_stop(&c);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 1);
}

/* ---- trees -------------------------------------------------------------- */

/* A tree the host breaks the protocol for (a CREDIT for an UNPACK, DATA for
 * a PACK) ends with one ERROR, not a second one when its tar process is
 * reaped: a request has exactly one terminal frame. */
static void test_tree_violation_answers_once(void) {
  START(c);
  char *dir = make_tmpdir();
  CHECK(dir != NULL);
  if (!dir)
    return;
  char path[512];
  snprintf(path, sizeof path, "%s/t", dir);
  mkdir(path, 0755);
  for (uint32_t id = 60; id <= 61; id++) {
    struct proto_buf b = {0};
    proto_frame_begin(&b, id == 60 ? PROTO_UNPACK : PROTO_PACK, id);
    proto_put_str(&b, TAG_PATH, path);
    proto_put_u64(&b, TAG_MAX_BYTES, 1 << 20);
    proto_put_u64(&b, TAG_MAX_FILES, 100);
    if (id == 61)
      proto_put_u32(&b, TAG_WINDOW, 1); /* the child blocks on its pipe */
    CHECK_EQ_INT(ac_send(c.fd, &b), 0);
  }
  struct proto_buf cr = {0};
  proto_frame_begin(&cr, PROTO_CREDIT, 60);
  proto_put_u32(&cr, TAG_WINDOW, 4096);
  CHECK_EQ_INT(ac_send(c.fd, &cr), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_DATA, 61, "x", 1), 0);
  CHECK_EQ_INT(ac_send_raw(c.fd, PROTO_DATA_END, 60, NULL, 0), 0);
  /* Both tar processes end within moments of being told to stop. */
  int errors[2] = {0, 0};
  struct proto_header h;
  uint64_t end = ac_now_ms() + 2000;
  while (ac_now_ms() < end) {
    int r = ac_recv(c.fd, &h, 100);
    if (r == -ETIMEDOUT)
      continue;
    CHECK_EQ_INT(r, 0);
    if (r < 0)
      break;
    if (h.type == PROTO_ERROR && (h.id == 60 || h.id == 61))
      errors[h.id - 60]++;
  }
  CHECK_EQ_INT(errors[0], 1);
  CHECK_EQ_INT(errors[1], 1);
  CHECK(ac_ping_ok(c.fd, 62));
  STOP(c);
  remove_tree(dir);
}

TEST_MAIN(TEST(test_hello_and_version_mismatch), TEST(test_ping), TEST(test_stdout_stderr_exact),
          TEST(test_exit_code), TEST(test_signal), TEST(test_stdin_roundtrip),
          TEST(test_stdin_too_large), TEST(test_env_and_cwd), TEST(test_cwd_errors),
          TEST(test_timeout), TEST(test_kill_cancels), TEST(test_background_process),
          TEST(test_concurrent_execs), TEST(test_big_output), TEST(test_too_many_and_duplicate),
          TEST(test_write_read_roundtrip), TEST(test_write_errors), TEST(test_read_errors),
          TEST(test_malformed_requests), TEST(test_bad_header_closes),
          TEST(test_tree_violation_answers_once))
