/* main.c: ignition-mcp's entry point: settings, signals, backend, serve. */
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/hostio.h"
#include "common/log.h"
#include "common/runlog.h"
#include "common/util.h"
#include "egress/egress.h"
#include "mcp/doctor.h"
#include "mcp/http.h"
#include "mcp/server.h"
#include "mcp/tasks.h"
#include "sandbox/vm.h"
#include "session/session.h"

static void usage(void) {
  printf("ignition-mcp %s: an MCP server that gives each session its own sandbox.\n"
         "\n"
         "Usage: ignition-mcp            serve MCP on stdin/stdout (what a client runs)\n"
         "       ignition-mcp --http [ADDR:]PORT\n"
         "                               serve MCP over Streamable HTTP at\n"
         "                               http://ADDR:PORT/mcp until SIGTERM (ADDR\n"
         "                               127.0.0.1 unless given, [::1] for IPv6; PORT 0\n"
         "                               picks a free one); another address needs\n"
         "                               IGN_MCP_HTTP_TOKENS\n"
         "       ignition-mcp doctor [--json]\n"
         "                               check everything a session needs, one line per\n"
         "                               check, with the command that fixes what is\n"
         "                               missing; exit 0 when sessions can open\n"
         "       ignition-mcp make-base [--force]\n"
         "                               make the warm microVM base for the configured\n"
         "                               rootfs now (the server also does it on demand)\n"
         "       ignition-mcp --version  print the version\n"
         "       ignition-mcp --help     this text\n"
         "\n"
         "Environment (defaults in brackets):\n"
         "  IGN_MCP_BACKEND       auto | ns | vm [auto]\n"
         "  IGN_MCP_ROOTFS        rootfs name (tools, small) or directory [tools]\n"
         "  IGN_MCP_AGENT         path of ign-agent [next to the server]\n"
         "  IGN_MCP_MAX_SESSIONS  open sessions at most [8]\n"
         "  IGN_MCP_MAX_CALLS     tools/call requests in progress at once [128]; together\n"
         "                        they may hold 4 x IGN_MCP_MAX_MESSAGE bytes of requests\n"
         "                        and results\n"
         "  IGN_MCP_IDLE_SECS     idle seconds before a session is hibernated [600]\n"
         "  IGN_MCP_IDLE_ACTION   hibernate or close an idle session [hibernate]\n"
         "  IGN_MCP_HIBERNATE_MAX_MB  MiB an owner's hibernated sessions take at most,\n"
         "                        the oldest closed past it; 0: none [10240]\n"
         "  IGN_MCP_HIBERNATE_KEEP_SECS  seconds a session stays hibernated [86400]\n"
         "  IGN_MCP_SHUTDOWN_ACTION  at exit, hibernate the sessions (kept on the store\n"
         "                        for the next server) or close them [hibernate]\n"
         "  IGN_MCP_SHUTDOWN_SECS  seconds in which hibernations at exit may start [3]\n"
         "  IGN_MCP_TASKS_MAX     tasks a client holds at once, running or finished [64]\n"
         "  IGN_MCP_TASK_TTL_S    longest a finished task's result is kept [3600]\n"
         "  IGN_MCP_HOST_ID       prefix of every session id: h1 gives h1.s3-9f2a [unset]\n"
         "  IGN_MCP_OUTPUT_CAP    inline bytes kept per output stream [65536]\n"
         "  IGN_MCP_MAX_MESSAGE   largest JSON-RPC message in bytes [67108864]\n"
         "  IGN_MCP_MAX_FILE      largest write_file/read_file in bytes [33554432]\n"
         "  IGN_MCP_MAX_STDIN     largest run stdin in bytes [8388608]\n"
         "  IGN_MCP_MEMORY_MB     memory limit per session [1024]\n"
         "  IGN_MCP_PIDS          process limit per session [1024]\n"
         "  IGN_MCP_NS_UID_BASE   ns as root: first host uid of the sessions' 256 blocks\n"
         "                        of 65536 uids [1879048192]\n"
         "  IGN_MCP_OVERLAY_MB    writable disk per session [1024]\n"
         "  IGN_MCP_NET           off | allow | open: the most network a session may\n"
         "                        ask for [allow]; no sandbox has a network device, its\n"
         "                        connections go through the server's egress broker\n"
         "  IGN_MCP_NET_PRIVATE   1: sessions may reach private networks (10/8, ...);\n"
         "                        host: also this host (loopback, its addresses) [0]\n"
         "  IGN_MCP_EGRESS_HOSTS  a hosts(5) file the broker consults before DNS [unset]\n"
         "  IGN_MCP_SECRETS       the operator's secrets file (JSON; 0600, the server user's);\n"
         "                        sessions name them and hold placeholders [unset]\n"
         "  IGN_MCP_EGRESS_CA     more CA certificates (PEM) the broker trusts toward the\n"
         "                        servers it intercepts, beside the system's [unset]\n"
         "  IGN_MCP_EGRESS_LOG_CAP bytes of each session's egress log [8388608]\n"
         "  IGN_MCP_EGRESS_STREAMS connections a session may have open at once [64]\n"
         "  IGN_MCP_EGRESS_MAX_MB MiB a session may send, and receive, in all [1024]\n"
         "  IGN_MCP_EGRESS_WILDCARD_NAMES distinct names a session may look up under\n"
         "                        each *.suffix rule of allow_hosts [256]\n"
         "  IGN_MCP_STORE         where warm bases and stages live [/var/lib/ignition-mcp\n"
         "                        as root, else ~/.cache/ignition-mcp]\n"
         "  IGN_MCP_STAGES_MAX_MB space all stages may use in the store [10240]\n"
         "  IGN_MCP_BASE          warm base name; none = cold boot [<rootfs>-base]\n"
         "  IGN_MCP_KERNEL        guest kernel [vm/vmlinux next to the server]\n"
         "  IGN_MCP_INITRAMFS     guest initramfs [vm/initramfs.cpio next to the server]\n"
         "  IGN_MCP_VM_IMAGE      guest rootfs disk image [vm/rootfs-<rootfs>.erofs next\n"
         "                        to the server]\n"
         "  IGN_MCP_POOL          restored clones kept ready [2]\n"
         "  IGN_MCP_SPARES        QEMUs kept waiting for a restore [1]\n"
         "  IGN_MCP_VM_MEMORY_MB  guest RAM of each microVM [256]\n"
         "  IGN_MCP_ACCEL         auto | kvm | tcg [auto]\n"
         "  IGN_MCP_QEMU          QEMU binary [qemu-system-x86_64 from PATH]\n"
         "  IGN_MCP_HOST_IO_ROOT  the host directory stdin_file, copy_in and copy_out\n"
         "                        are confined to [the working directory]\n"
         "  IGN_MCP_COPY_OUT      on | off: off never writes to the host [on]\n"
         "  IGN_MCP_COPY_MAX_MB   bytes of one copy_in or copy_out, in MiB [1024]\n"
         "  IGN_MCP_COPY_MAX_FILES entries of one copy_in or copy_out [100000]\n"
         "  IGN_MCP_LOG_DIR       complete stdout/stderr logs [$XDG_STATE_HOME/ignition-mcp/\n"
         "                        logs, else ~/.local/state/ignition-mcp/logs]\n"
         "  IGN_MCP_LOG_CAP       bytes kept per log file [67108864]\n"
         "  IGN_MCP_LOG_KEEP_MB   all logs together; the oldest go first [1024]\n"
         "  IGN_MCP_LOG_KEEP_DAYS logs older than this are removed [7]\n"
         "  IGN_MCP_LOG           stderr log level: debug, info, warning, error [info]\n"
         "  IGN_MCP_HTTP_TOKENS   --http: file of name:token lines; every request then\n"
         "                        needs Authorization: Bearer <token> [unset]\n"
         "  IGN_MCP_HTTP_ORIGINS  --http: more allowed Origin values, comma-separated\n"
         "                        [loopback origins when bound to loopback]\n"
         "  IGN_MCP_HTTP_HOSTS    --http: more allowed Host values, comma-separated\n"
         "                        [localhost, 127.0.0.1, [::1]]\n"
         "  IGN_MCP_HTTP_MAX_CONNECTIONS  --http: connections at once [64]\n"
         "  IGN_MCP_HTTP_TIMEOUT_SECS     --http: seconds a connection has to deliver a\n"
         "                        whole request [30]\n"
         "\n"
         "\"Next to the server\" is the server's directory, or ../lib/ignition-mcp from it\n"
         "once installed.  man ignition-mcp has the details.\n",
         IGN_VERSION);
}

int main(int argc, char **argv) {
  if (argc > 1) {
    if (strcmp(argv[1], "--version") == 0) {
      printf("ignition-mcp %s\n", IGN_VERSION);
      return 0;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
      usage();
      return 0;
    }
    if (strcmp(argv[1], "--http") == 0 && argc != 3) {
      fprintf(stderr, "ignition-mcp: --http takes one argument, [ADDR:]PORT (e.g. --http "
                      "127.0.0.1:8080); see ignition-mcp --help\n");
      return 2;
    }
    const char *opt = strcmp(argv[1], "--http") == 0        ? argv[2]
                      : strcmp(argv[1], "make-base") == 0 ? "--force"
                      : strcmp(argv[1], "doctor") == 0  ? "--json"
                                                        : NULL;
    if (!opt) {
      fprintf(stderr, "ignition-mcp: unknown argument '%s'; see ignition-mcp --help\n", argv[1]);
      return 2;
    }
    if (argc > 3 || (argc == 3 && strcmp(argv[2], opt) != 0)) {
      fprintf(stderr, "ignition-mcp: %s takes only %s, not '%s'; see ignition-mcp --help\n",
              argv[1], opt, argv[argc == 3 ? 2 : 3]);
      return 2;
    }
  }
  const char *lv = getenv("IGN_MCP_LOG");
  if (lv && *lv) {
    int l = log_level_parse(lv);
    if (l < 0) {
      fprintf(stderr, "ignition-mcp: IGN_MCP_LOG=%s is invalid: use debug, info, warning or error\n",
              lv);
      return 2;
    }
    log_set_stderr_level((enum log_level)l);
  }
  if (config_load() < 0)
    return 2;
  if (argc > 1 && strcmp(argv[1], "doctor") == 0)
    return doctor_main(argc > 2);
  if (argc > 1 && strcmp(argv[1], "make-base") == 0) {
    bool force = argc > 2 && strcmp(argv[2], "--force") == 0;
    _cleanup_free_ char *err = NULL;
    if (vm_make_base(force, &err) < 0) {
      fprintf(stderr, "ignition-mcp: cannot make the warm base: %s\n", err);
      return 1;
    }
    return 0;
  }

  if (argc > 1 && http_prepare(argv[2]) < 0)
    return 2;

  /* Termination signals are read through a signalfd by the main loop; every
   * thread inherits this mask.  A client that goes away must not kill us
   * with SIGPIPE before the sandboxes are cleaned up. */
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &mask, NULL);
  signal(SIGPIPE, SIG_IGN);

  _cleanup_free_ char *log_err = NULL;
  if (runlog_init(cfg.log_dir, cfg.log_cap, (uint64_t)cfg.log_keep_mb << 20, cfg.log_keep_days,
                  &log_err) < 0)
    log_warn("run logs: %s; results carry log_error until this is fixed", log_err);
  else if (cfg.log_cap)
    log_info("run logs: %s, %zu bytes per stream, kept %u days and %u MiB in all", cfg.log_dir,
             cfg.log_cap, cfg.log_keep_days, cfg.log_keep_mb);
  else
    log_info("run logs: off (IGN_MCP_LOG_CAP=0)");

  /* The broker: without it no session could have egress, and a server that
   * runs anyway would hide why. */
  struct egress_settings es = {
      .max_mode = cfg.net == NET_OPEN ? EGRESS_MODE_OPEN
                  : cfg.net == NET_OFF ? EGRESS_MODE_NONE
                                       : EGRESS_MODE_ALLOW,
      .off = cfg.net == NET_OFF, .allow_private = cfg.net_private,
      .allow_host = cfg.net_host,
      .hosts_file = cfg.egress_hosts, .log_dir = cfg.log_dir, .log_cap = cfg.egress_log_cap,
      .max_streams = cfg.egress_streams, .max_bytes = (uint64_t)cfg.egress_max_mb << 20,
      .wildcard_names = cfg.egress_wildcard_names,
      .secrets_file = cfg.secrets, .extra_ca = cfg.egress_ca,
  };
  _cleanup_free_ char *ca_dir = xasprintf("%s/egress-ca", cfg.store);
  es.ca_dir = ca_dir;
  _cleanup_free_ char *eg_err = NULL;
  if (egress_init(&es, &eg_err) < 0) {
    fprintf(stderr, "ignition-mcp: cannot start the egress broker: %s\n",
            eg_err ? eg_err : "(no reason given)");
    return 2;
  }
  {
    _cleanup_free_ char *line = egress_policy_line();
    log_always(LOG_INFO, "%s", line ? line : "egress: (the policy line could not be made)");
  }

  _cleanup_free_ char *err = NULL;
  {
    /* Host paths: without the root, the tools that name one say why. */
    _cleanup_free_ char *herr = NULL;
    if (hostio_init(cfg.host_io_root, cfg.copy_out, &herr) < 0)
      log_warn("%s; stdin_file, copy_in and copy_out will fail until it is fixed", herr);
  }
  /* Closing or resetting a session cancels its tasks, saying so, before
   * their calls see the sandbox go. */
  sessions_set_on_end(tasks_cancel_session);
  if (sessions_init(&err) < 0) {
    /* Still serve: the client connects, lists the tools, and every
     * open_session says what is missing and how to fix it. */
    log_warn("no sandbox backend can run (IGN_MCP_BACKEND=%s): %s; open_session will fail "
             "until this is fixed (`ignition-mcp doctor` lists the checks and their fixes)",
             config_backend_name(), err);
    /* The doctor's checks take seconds: open_session runs them when asked. */
    sessions_set_unavailable_help(doctor_explain);
  } else
    log_info("ignition-mcp %s ready: backend %s, rootfs %s", IGN_VERSION, sessions_backend(),
             cfg.rootfs);
  int r = argc > 1 ? http_serve() : mcp_serve();
  /* The sessions are closed by now (each freed its egress). */
  egress_shutdown();
  return r;
}
