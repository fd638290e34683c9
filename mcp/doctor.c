/* doctor.c: `ignition-mcp doctor`: everything a session needs, checked on
 * this host, one line per check: a status word (ok, warn, missing, fail),
 * what was found, and for anything not ok the command that fixes it.
 *
 * The checks ask the same code the server runs: the KVM decision and the
 * warm base's fingerprint come from the vm backend (sandbox/vm.c), the
 * cgroup check makes a real group through sandbox/cgroup.c, the namespace
 * check really clones a process into the namespaces the ns backend uses
 * (a user namespace first), the sandbox check starts a real ns sandbox
 * through sandbox/ns.c, exactly as open_session does, runs a command in it
 * and removes it (the ns backend is ready only when that worked; as root
 * that sandbox holds one of the sessions' uid blocks while it runs, made on
 * first use: /run/ignition-mcp-uids and its lock files, which stay), and the
 * session check starts one real QEMU as a session does (its state
 * directory, in the server's runtime directory, which it makes when it is
 * missing, is removed again).  No base is built, no store is made and
 * nothing is installed; besides that, only the cgroup check changes the
 * host.  It makes a test group, ign-mcp-<pid>-doctor, with the
 * session limits and removes it again; but cgroup.c first prepares the
 * parent the way the server does, and that stays.  On cgroup v2 it may move
 * this process into a new leaf group <own group>/ign-mcp-<pid>-server and
 * write "+memory +pids" to <own group>/cgroup.subtree_control, or, where that
 * is refused, create /sys/fs/cgroup/ignition-mcp and write "+memory +pids" to
 * the subtree_control of the root group and of that group.  On cgroup v1 the
 * test group is a directory in each of this process's memory and pids
 * groups; both are removed and nothing else is made.
 *
 * "warn" never stops sessions (KVM missing means TCG, a missing warm base is
 * made on first use, no cgroup limits means sessions without them);
 * "missing" and "fail" stop the backend they belong to.  The same checks
 * explain a server that started without a working backend: each
 * open_session adds doctor_explain()'s text, made when it is asked for (on
 * that call's thread) so that it says how things stand now.
 *
 * The checks live by what they look at: doctor_install.c what is built and
 * installed (QEMU, the images, the store and warm base, ign-agent, the
 * rootfs), doctor_host.c this host's kernel and settings (KVM, Landlock,
 * namespaces, cgroups, seccomp, egress), doctor_trial.c the trial sessions
 * of both backends.  This file runs them in order, decides which backend is
 * ready, and prints the report (text or JSON) or the explanation added to a
 * failed open_session; doctor_int.h is what they share. */
#include "mcp/doctor.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"
#include "common/util.h"
#include "mcp/doctor_int.h"
#include "sandbox/vm.h"


static const char *const status_words[] = {"ok", "warn", "missing", "fail"};

static void report_free(struct report *r) {
  free(r->accel_why);
  for (size_t i = 0; i < r->n; i++) {
    free(r->c[i].found);
    free(r->c[i].fix);
  }
}

/* ---- the report ---- */

static bool blocks(const struct check *c, unsigned backend) {
  return (c->for_backends & backend) && (c->status == ST_MISSING || c->status == ST_FAIL);
}

/* Does a check for BACKENDS matter to the configured backend? */
static bool backend_wanted(unsigned backends) {
  return cfg.backend == BACKEND_AUTO || (cfg.backend == BACKEND_VM && (backends & FOR_VM)) ||
         (cfg.backend == BACKEND_NS && (backends & FOR_NS));
}

/* TRY: start a trial session of the vm backend (doctor itself, not the
 * explanation added to a failed open_session, which must answer soon). */
static void run_checks(struct report *r, bool try) {
  memset(r, 0, sizeof *r);
  doctor_check_qemu(r);
  doctor_check_kvm(r);
  bool inputs = doctor_check_vm_file(r, "kernel", cfg.kernel, "IGN_MCP_KERNEL");
  inputs &= doctor_check_vm_file(r, "initramfs", cfg.initramfs, "IGN_MCP_INITRAMFS");
  inputs &= doctor_check_vm_image(r);
  doctor_check_store(r);
  doctor_check_base(r, inputs && cfg.qemu);
  doctor_check_landlock(r);
  size_t first_ns = r->n;
  doctor_check_agent(r);
  doctor_check_rootfs(r);
  doctor_check_namespaces(r);
  bool ns_parts = true;
  for (size_t i = first_ns; i < r->n; i++)
    ns_parts &= !blocks(&r->c[i], FOR_NS);
  doctor_check_cgroups(r);
  doctor_check_sandbox(r, ns_parts);
  doctor_check_seccomp(r);
  doctor_check_egress(r);
  if (try)
    doctor_check_session(r, backend_wanted(FOR_VM));
  r->vm_ready = r->ns_ready = true;
  for (size_t i = 0; i < r->n; i++) {
    if (blocks(&r->c[i], FOR_VM))
      r->vm_ready = false;
    if (blocks(&r->c[i], FOR_NS))
      r->ns_ready = false;
  }
  /* Ready only once a session has really started. */
  if (try && !r->vm_tried)
    r->vm_ready = false;
}

/* The backend sessions would open on, or NULL. */
static const char *chosen_backend(const struct report *r) {
  if (cfg.backend != BACKEND_NS && r->vm_ready)
    return "vm";
  if (cfg.backend != BACKEND_VM && r->ns_ready)
    return "ns";
  return NULL;
}

static char *not_ready_list(const struct report *r, unsigned backend) {
  char buf[512] = "";
  for (size_t i = 0; i < r->n; i++)
    if (blocks(&r->c[i], backend)) {
      size_t n = strlen(buf);
      snprintf(buf + n, sizeof buf - n, "%s%s", n ? ", " : "", r->c[i].name);
    }
  return strdup(buf);
}

static void print_section(const struct report *r, unsigned backend, const char *title) {
  printf("\n%s%s\n", title, backend_wanted(backend) ? "" : " (not used: IGN_MCP_BACKEND says otherwise)");
  for (size_t i = 0; i < r->n; i++) {
    const struct check *c = &r->c[i];
    if (c->for_backends != backend)
      continue;
    printf("  %-7s %-10s %s%s%s\n", status_words[c->status], c->name, c->found,
           c->fix ? "; fix: " : "", c->fix ? c->fix : "");
  }
}

static void print_text(const struct report *r) {
  printf("ignition-mcp %s doctor: IGN_MCP_BACKEND=%s, rootfs %s, running as %s\n", IGN_VERSION,
         config_backend_name(), cfg.rootfs_spec, getuid() == 0 ? "root" : "a user");
  print_section(r, FOR_VM, "microVM backend (vm)");
  print_section(r, FOR_NS, "namespace backend (ns)");
  print_section(r, FOR_VM | FOR_NS, "both");
  printf("\n");
  _cleanup_free_ char *vm_missing = not_ready_list(r, FOR_VM);
  _cleanup_free_ char *ns_missing = not_ready_list(r, FOR_NS);
  if (r->vm_ready)
    printf("vm: ready: sessions are QEMU microVMs under %s (isolation microvm/%s); a trial "
           "session started\n",
           strcmp(r->accel, "kvm") == 0 ? "KVM" : "TCG", r->accel);
  else if (!backend_wanted(FOR_VM))
    printf("vm: not tried (IGN_MCP_BACKEND=%s)\n", config_backend_name());
  else
    printf("vm: cannot open sessions: fix %s above\n", vm_missing);
  if (r->ns_ready)
    printf("ns: ready: sessions are namespace sandboxes (isolation namespace)\n");
  else
    printf("ns: cannot open sessions: fix %s above\n", ns_missing);
  const char *chosen = chosen_backend(r);
  if (chosen)
    printf("sessions can open: IGN_MCP_BACKEND=%s uses the %s backend\n", config_backend_name(),
           chosen);
  else
    printf("sessions cannot open with IGN_MCP_BACKEND=%s: fix what is marked missing or fail "
           "above, then restart the server\n",
           config_backend_name());
}

static void print_json(const struct report *r) {
  json_t *checks = json_array();
  for (size_t i = 0; i < r->n; i++) {
    const struct check *c = &r->c[i];
    const char *b = c->for_backends == FOR_VM ? "vm" : c->for_backends == FOR_NS ? "ns" : "both";
    json_t *o = json_pack("{s:s, s:s, s:s, s:s}", "backend", b, "name", c->name, "status",
                          status_words[c->status], "found", c->found);
    json_object_set_new(o, "fix", c->fix ? json_string(c->fix) : json_null());
    json_array_append_new(checks, o);
  }
  const char *chosen = chosen_backend(r);
  /* What microVMs run under, why, and what the KVM probe measured. */
  struct vm_kvm_probe p;
  _cleanup_free_ char *probe_err = NULL, *probe_text = vm_kvm_probe_text();
  json_t *probe = json_null();
  if (vm_kvm_probe_last(&p, &probe_err))
    probe = json_pack("{s:i, s:i, s:b, s:b, s:f, s:f}", "loops", (json_int_t)p.loops, "budget_ms",
                      (json_int_t)p.budget_ms, "finished", p.finished, "stuck", p.stuck, "run_ms",
                      p.run_ns / 1e6, "setup_ms", p.setup_ns / 1e6);
  else if (probe_err)
    probe = json_pack("{s:s}", "error", probe_err);
  json_t *accel = json_pack("{s:o, s:o, s:o, s:o}", "decision",
                            r->accel ? json_string(r->accel) : json_null(), "reason",
                            json_string(r->accel && strcmp(r->accel, "kvm") == 0
                                            ? (probe_text ? probe_text : "/dev/kvm works")
                                        : r->accel_why ? r->accel_why
                                                       : "KVM cannot be used"),
                            "why_not_kvm", r->accel_why ? json_string(r->accel_why) : json_null(),
                            "kvm_probe", probe);
  json_t *out = json_pack("{s:s, s:s, s:s, s:o, s:o, s:{s:b, s:b}, s:o, s:b}", "version",
                          IGN_VERSION, "backend_setting", config_backend_name(), "rootfs",
                          cfg.rootfs_spec, "checks", checks, "accel", accel, "ready", "vm",
                          r->vm_ready, "ns", r->ns_ready,
                          "backend", chosen ? json_string(chosen) : json_null(),
                          "sessions_can_open", chosen != NULL);
  char *s = json_dumps(out, JSON_INDENT(2));
  if (s)
    printf("%s\n", s);
  free(s);
  json_decref(out);
}

int doctor_main(bool as_json) {
  /* The sandbox check talks to an agent that may die at any moment (that
   * is what it checks): a write to its socket must fail with EPIPE, not
   * kill us.  The server ignores SIGPIPE for the same reason. */
  signal(SIGPIPE, SIG_IGN);
  struct report r;
  run_checks(&r, true);
  if (as_json)
    print_json(&r);
  else
    print_text(&r);
  fflush(stdout);
  int status = chosen_backend(&r) ? 0 : 1;
  report_free(&r);
  return status;
}

char *doctor_explain(void) {
  log_debug("running the doctor's checks to explain why no sandbox backend can run");
  struct report r;
  run_checks(&r, false);
  char *text = xasprintf("What `ignition-mcp doctor` finds for IGN_MCP_BACKEND=%s:",
                         config_backend_name());
  size_t shown = 0;
  for (size_t i = 0; i < r.n; i++) {
    const struct check *c = &r.c[i];
    bool relevant = (backend_wanted(FOR_VM) && blocks(c, FOR_VM)) ||
                    (backend_wanted(FOR_NS) && blocks(c, FOR_NS));
    if (!relevant)
      continue;
    shown++;
    char *more = xasprintf("%s\n- %s %s: %s%s%s", text, status_words[c->status], c->name,
                           c->found, c->fix ? "; fix: " : "", c->fix ? c->fix : "");
    free(text);
    text = more;
  }
  if (shown == 0) {
    char *more = xasprintf("%s none of its checks fails now, so what failed above when the server "
                           "started is either fixed since (restart the MCP server) or not one "
                           "it checks (fix that, then restart the server).",
                           text);
    free(text);
    report_free(&r);
    return more;
  }
  char *more = xasprintf("%s\nFix these, then restart the MCP server (in Claude Code: /mcp, "
                         "reconnect); `ignition-mcp doctor` checks again.",
                         text);
  free(text);
  report_free(&r);
  return more;
}
