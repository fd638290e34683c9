/* doctor_trial.c: the trial sessions, the checks that say a backend is
 * ready: a real namespace sandbox started as open_session starts one (as
 * root it holds one of the sessions' uid blocks while it runs) with a
 * command run in it, and one QEMU started and confined as a session's whose
 * agent answers (vm_trial_session).  Each is tried only when the checks of
 * its parts passed; both are removed again. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/util.h"
#include "mcp/doctor_int.h"
#include "sandbox/sandbox.h"
#include "sandbox/vm.h"

/* Starts a sandbox exactly as open_session does and runs a command in it:
 * what the checks above cannot see (the agent's setup in the namespaces, the
 * idmapped rootfs, the overlay) shows here. */
void doctor_check_sandbox(struct report *r, bool parts_ok) {
  if (!parts_ok) {
    add(r, FOR_NS, "sandbox", ST_WARN,
        strdup("not tried: the agent, the rootfs or the namespaces above are not all there"),
        strdup("fix what is marked above"));
    return;
  }
  struct sandbox_config sc = {
      .rootfs = cfg.rootfs, .agent = cfg.agent, .memory_mb = cfg.memory_mb, .pids = cfg.pids,
      .overlay_mb = cfg.overlay_mb, .ns_uid_base = cfg.ns_uid_base,
  };
  struct sandbox *sb = NULL;
  struct agent_conn *conn = NULL;
  _cleanup_free_ char *err = NULL, *why = NULL;
  struct agent_exec_res res = {0};
  int rc = sandbox_ns_ops.create(&sc, "doctor", &sb, &err);
  if (rc == 0)
    rc = sandbox_connect(sb, 30000, &conn, &err);
  if (rc == 0)
    rc = sb->ops->ready(sb, conn, &err);
  if (rc == 0) {
    struct agent_exec_req req = {
        .command = "id -u && echo ok > /root/.ign-doctor && cat /root/.ign-doctor",
        .timeout_ms = 30000, .out_cap = 4096};
    rc = agent_exec(conn, &req, &(struct agent_ctl){0}, &res, &err);
    if (rc == 0 && (res.exit_code != 0 || res.out_len != 5 || memcmp(res.out, "0\nok\n", 5) != 0)) {
      err = xasprintf("a command in it did not run as root with a writable /root: exit %d, "
                      "stdout '%.*s', stderr '%.*s'",
                      res.exit_code, (int)res.out_len, res.out, (int)res.err_len, res.err);
      rc = -EIO;
    }
  }
  if (rc < 0 && sb && sb->ops->death_reason)
    why = sb->ops->death_reason(sb);
  if (rc < 0) {
    add(r, FOR_NS, "sandbox", ST_FAIL,
        xasprintf("a sandbox started as open_session would start one does not work: %s%s%s",
                  err ? err : strerror(-rc), why ? "; " : "", why ? why : ""),
        strdup("see the message; `IGN_MCP_LOG=debug ignition-mcp doctor` shows more"));
  } else {
    json_t *uid = json_object_get(sb->info, "host_uid");
    add(r, FOR_NS, "sandbox", ST_OK,
        xasprintf("started one as open_session does (as host uid %lld%s) and ran a command in it; "
                  "limits: %s",
                  uid ? (long long)json_integer_value(uid) : -1LL,
                  ns_as_root() ? ", rootfs idmapped" : "", sb->limits),
        NULL);
  }
  agent_exec_res_free(&res);
  agent_conn_free(conn);
  if (sb)
    sb->ops->destroy(sb);
}

/* Ready means a session really starts: one QEMU, confined as a session's,
 * whose agent answers (vm_trial_session).  Only when every other vm check
 * passed and the vm backend is wanted; it takes a few seconds (a restore,
 * or a cold boot when there is no warm base yet). */
void doctor_check_session(struct report *r, bool wanted) {
  bool blocked = false;
  for (size_t i = 0; i < r->n; i++)
    if ((r->c[i].for_backends & FOR_VM) && (r->c[i].status == ST_MISSING || r->c[i].status == ST_FAIL))
      blocked = true;
  if (!wanted) {
    add(r, FOR_VM, "session", ST_WARN,
        xasprintf("not tried (IGN_MCP_BACKEND=%s): whether a microVM session starts is not known",
                  config_backend_name()),
        strdup("IGN_MCP_BACKEND=vm ignition-mcp doctor (to try one)"));
    return;
  }
  if (blocked) {
    add(r, FOR_VM, "session", ST_WARN, strdup("not tried: the checks above are not all met"),
        strdup("fix the vm checks marked missing or fail above"));
    return;
  }
  _cleanup_free_ char *how = NULL, *base_err = NULL, *err = NULL;
  r->vm_tried = true;
  if (vm_trial_session(&how, &base_err, &err) == 0) {
    /* A damaged base does not stop sessions (they make it again first),
     * but each server would spend a base build on it. */
    add(r, FOR_VM, "session", base_err ? ST_WARN : ST_OK,
        xasprintf("a QEMU started as a session's (%s) and its agent answered: %s%s%s",
                  vm_spawn_userns() ? "confined in a user namespace of its own" : "as a uid of its own",
                  how, base_err ? "; but " : "", base_err ? base_err : ""),
        base_err ? xasprintf("%s/ignition-mcp make-base --force", config_exe_dir()) : NULL);
    return;
  }
  bool userns = vm_spawn_userns() && (strstr(err, "user namespace") || strstr(err, "uid_map"));
  add(r, FOR_VM, "session", ST_FAIL, xasprintf("a trial session did not start: %s", err),
      userns ? strdup("allow unprivileged user namespaces (sysctl -w kernel.unprivileged_userns_clone=1 "
                      "user.max_user_namespaces=15000), or run the server as root")
             : strdup("fix what the error above names, then run ignition-mcp doctor again"));
}
