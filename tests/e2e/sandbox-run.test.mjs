// sandbox-run.test.mjs: the one-shot sandbox_run: the seed's example prompts
// (a Python snippet in one call; a project copied in, built with make and the
// binary copied out; commit_as then stage), its report, its refusals, its
// budget (timeout_s covers the whole call), and that nothing outlives it:
// after 20 calls (100 with IGN_TEST_SOAK=1), cancelled and timed-out ones
// among them, no process, state directory or cgroup is left.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import {
  startServer, call, callErr, openSession, sleep, waitUntil, descendants, qemuChildren, vmStateDirs,
  leftovers, newLeftovers, IS_VM, IS_NS, TOOLS_SKIP, VM_ONLY, SOAK, textOf,
} from './lib.mjs';

const T = { timeout: 300_000 };

function tempDirs() {
  const base = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-sbrun-'));
  fs.chmodSync(base, 0o755);
  const root = path.join(base, 'root');
  const logs = path.join(base, 'logs');
  fs.mkdirSync(root);
  return { base, root, logs, remove: () => fs.rmSync(base, { recursive: true, force: true }) };
}

const REPORT_FIELDS = ['exit_code', 'signal', 'timed_out', 'stdout', 'stderr', 'stdout_bytes', 'stderr_bytes',
  'stdout_truncated', 'stderr_truncated', 'duration_ms', 'total_ms', 'path', 'open_ms', 'teardown_ms',
  'isolation', 'vcpus', 'mem_mib', 'stdout_log_path', 'stderr_log_path'];

function assertReport(r) {
  for (const f of REPORT_FIELDS) assert.ok(f in r, `sandbox_run's report has no ${f}: ${JSON.stringify(r).slice(0, 800)}`);
  assert.ok(['pool', 'restore', 'cold', 'stage'].includes(r.path), `path ${r.path}`);
  assert.ok(r.total_ms >= r.duration_ms);
  assert.ok(r.vcpus >= 1 && r.mem_mib >= 64);
  if (IS_VM) assert.ok(typeof r.serial_log_path === 'string' && fs.existsSync(r.serial_log_path), `serial_log_path: ${r.serial_log_path}`);
}

/* What a server's sandboxes may leave: processes under it (its own forks
 * aside), QEMUs, state directories, cgroups. */
function residue(pid, before) {
  return {
    procs: descendants(pid).filter((x) => !/^\S*ignition-mcp$/.test(x.cmd ?? '')).map((x) => `${x.pid} ${x.cmd}`),
    qemus: IS_VM ? qemuChildren(pid).map((q) => q.pid) : [],
    dirs: IS_VM ? vmStateDirs(pid) : [],
    cgroups: newLeftovers(before).cgroups,
  };
}
const EMPTY = { procs: [], qemus: [], dirs: [], cgroups: [] };

describe('sandbox_run', () => {
  let s, c, d;
  before(async () => {
    d = tempDirs();
    s = await startServer({ tools: !TOOLS_SKIP, env: { IGN_MCP_HOST_IO_ROOT: d.root, IGN_MCP_LOG_DIR: d.logs } });
    c = s.client;
  });
  after(async () => {
    await s.close();
    d.remove();
  });

  test('"run this Python snippet in a sandbox": one call, the output, nothing left', { ...T, skip: TOOLS_SKIP }, async () => {
    const r = await call(c, 'sandbox_run', { command: 'python3 -c "import sys; print(sum(range(10))); print(sys.version_info[0], file=sys.stderr)"' });
    assertReport(r);
    assert.equal(r.exit_code, 0);
    assert.equal(r.stdout, '45\n');
    assert.equal(r.stderr, '3\n');
    assert.equal(fs.readFileSync(r.stdout_log_path, 'utf8'), '45\n');
    assert.equal(fs.statSync(r.stdout_log_path).mode & 0o777, 0o600);
    const l = await call(c, 'list_sessions');
    assert.deepEqual(l.sessions, [], 'the ephemeral session outlived the call');
  });

  test('a shell snippet with stdin, env and cwd', T, async () => {
    const r = await call(c, 'sandbox_run', { command: 'pwd; echo "$GREETING"; tr a-z A-Z', stdin: 'quiet\n', env: { GREETING: 'hi' }, cwd: '/tmp' });
    assertReport(r);
    assert.equal(r.stdout, '/tmp\nhi\nQUIET\n');
    fs.writeFileSync(path.join(d.root, 'in.txt'), 'from the host\n');
    const f = await call(c, 'sandbox_run', { command: 'cat', stdin_file: 'in.txt' });
    assert.equal(f.stdout, 'from the host\n');
  });

  test('a project copied in, built with make, the binary copied out', { ...T, skip: TOOLS_SKIP }, async () => {
    const proj = path.join(d.root, 'hello');
    fs.mkdirSync(proj);
    fs.writeFileSync(path.join(proj, 'hello.c'), '#include <stdio.h>\nint main(void) { puts("hello from the sandbox"); return 0; }\n');
    fs.writeFileSync(path.join(proj, 'Makefile'), 'hello: hello.c\n\tcc -O2 -o hello hello.c\n');
    fs.mkdirSync(path.join(d.root, 'dist'));
    const r = await call(c, 'sandbox_run', {
      command: 'make -C /work/hello && /work/hello/hello',
      copy_in: [{ host: 'hello', guest: '/work/hello' }],
      copy_out: [{ guest: '/work/hello/hello', host: 'dist/hello' }],
      timeout_s: 120,
    });
    assertReport(r);
    assert.equal(r.exit_code, 0, r.stderr);
    assert.match(r.stdout, /hello from the sandbox/);
    assert.equal(typeof r.copy_in_ms, 'number');
    assert.equal(typeof r.copy_out_ms, 'number');
    assert.deepEqual(r.copied.map((e) => [e.direction, e.ok ?? true]), [['in', true], ['out', true]]);
    const bin = fs.readFileSync(path.join(d.root, 'dist/hello'));
    assert.equal(bin.subarray(0, 4).toString('latin1'), '\x7fELF');
    const mode = fs.statSync(path.join(d.root, 'dist/hello')).mode & 0o7777;
    assert.equal(mode & 0o111, 0o111, 'the binary came back without its x bits');
    assert.equal(mode & 0o7022, 0, 'setuid or group/other write came through');
  });

  test('copy_out runs after a failing command, not after a timeout', T, async () => {
    const r = await call(c, 'sandbox_run', { command: 'echo report > /root/report; exit 3', copy_out: [{ guest: '/root/report', host: 'report.txt' }] });
    assert.equal(r.exit_code, 3);
    assert.equal(r.copied[0].ok, true);
    assert.equal(fs.readFileSync(path.join(d.root, 'report.txt'), 'utf8'), 'report\n');
    const t = await call(c, 'sandbox_run', { command: 'echo x > /root/late; sleep 30', timeout_s: 2, copy_out: [{ guest: '/root/late', host: 'late.txt' }] });
    assert.equal(t.timed_out, true);
    assert.equal(t.copied[0].ok, false);
    assert.match(t.copied[0].error, /timed out/);
    assert.equal(fs.existsSync(path.join(d.root, 'late.txt')), false);
    // A copy_out entry that fails is reported, the others still happen.
    const m = await call(c, 'sandbox_run', { command: 'echo ok > /root/ok', copy_out: [{ guest: '/root/none', host: 'none' }, { guest: '/root/ok', host: 'ok.txt' }] });
    assert.equal(m.copied[0].ok, false);
    assert.match(m.copied[0].error, /sandbox/);
    assert.equal(m.copied[1].ok, true);
    assert.equal(fs.readFileSync(path.join(d.root, 'ok.txt'), 'utf8'), 'ok\n');
  });

  test('a copy_in that fails stops the call before the command, naming the entry', T, async () => {
    const m = await callErr(c, 'sandbox_run', { command: 'touch /root/ran', copy_in: [{ host: 'does-not-exist', guest: '/work/x' }] });
    assert.match(m, /copy_in\[0\]/);
    assert.match(m, /host side/);
    assert.match(m, /did not run/);
  });

  test('commit_as then stage: the environment carries over; only an exit 0 commits', T, async () => {
    const name = `e2e/sbrun-${process.pid}`;
    const r = await call(c, 'sandbox_run', { command: 'echo prepared > /root/marker', commit_as: name, timeout_s: 120 });
    assert.equal(r.exit_code, 0);
    assert.equal(r.stage_name, name);
    assert.match(r.stage_id, /./);
    assert.equal(typeof r.commit_ms, 'number');
    const u = await call(c, 'sandbox_run', { command: 'cat /root/marker', stage: name, timeout_s: 120 });
    assert.equal(u.stdout, 'prepared\n');
    assert.equal(u.path, 'stage');
    const f = await call(c, 'sandbox_run', { command: 'echo other > /root/marker; exit 1', commit_as: name });
    assert.equal(f.stage_name, undefined);
    assert.match(f.commit_skipped, /exit 0/);
    const again = await call(c, 'sandbox_run', { command: 'cat /root/marker', stage: name });
    assert.equal(again.stdout, 'prepared\n');
    await call(c, 'stage_rm', { name });
  });

  test('network and allow_hosts are real arguments: a policy runs and is reported; malformed ones are refused', T, async () => {
    const ok = await call(c, 'sandbox_run', { command: 'true', network: 'allow', allow_hosts: ['pypi.org'] });
    assert.equal(ok.exit_code, 0);
    assert.equal(ok.egress.mode, 'allow', JSON.stringify(ok.egress));
    assert.deepEqual(ok.egress.allowed_rules, ['pypi.org']);
    const none = await call(c, 'sandbox_run', { command: 'true', network: 'none' });
    assert.equal(none.egress.mode, 'none');
    assert.match(await callErr(c, 'sandbox_run', { command: 'true', allow_hosts: ['pypi.org'] }), /allow_hosts/);
    assert.match(await callErr(c, 'sandbox_run', { command: 'true', network: true }), /network/);
    assert.match(await callErr(c, 'sandbox_run', { command: 'true', network: false }), /network/);
    assert.match(await callErr(c, 'sandbox_run', { command: 'true', network: 'allow', allow_hosts: ['ok.example', '1.2.3.4'] }), /\[1\]/);
    const l = await call(c, 'list_sessions');
    assert.deepEqual(l.sessions, [], 'a refused call left a session');
  });

  test('refusals: stdin with stdin_file, a bad stage name', T, async () => {
    assert.match(await callErr(c, 'sandbox_run', { command: 'cat', stdin: 'a', stdin_file: 'in.txt' }), /not both/);
    assert.match(await callErr(c, 'sandbox_run', { command: 'true', stage: 'no/such-stage' }), /no-such|no stage|such-stage/);
  });

  test('timeout_s covers the whole call: the command gets what is left', T, async () => {
    const t0 = Date.now();
    const r = await call(c, 'sandbox_run', { command: 'sleep 60', timeout_s: 3 });
    const took = Date.now() - t0;
    assert.equal(r.timed_out, true);
    assert.ok(r.duration_ms <= 3000 + 500, `the command ran ${r.duration_ms} ms of a 3 s budget`);
    assert.ok(took < 3000 + 10_000, `the call took ${took} ms`);
  });

  test('it counts against the session cap while it runs', T, async () => {
    const s2 = await startServer({ env: { IGN_MCP_HOST_IO_ROOT: d.root, IGN_MCP_LOG_DIR: d.logs, IGN_MCP_MAX_SESSIONS: 1 } });
    try {
      const p = s2.client.callTool({ name: 'sandbox_run', arguments: { command: 'sleep 3' } }, undefined, { timeout: 120000 });
      const busy = await waitUntil(async () => (await call(s2.client, 'list_sessions')).sessions.length === 1, { timeoutMs: 60000 });
      assert.ok(busy, 'the running sandbox_run was not listed');
      const l = await call(s2.client, 'list_sessions');
      assert.equal(l.sessions[0].ephemeral, true);
      assert.match(await callErr(s2.client, 'open_session', {}), /IGN_MCP_MAX_SESSIONS/);
      const r = await p;
      assert.equal(r.isError ?? false, false, textOf(r));
      await openSession(s2.client);
      assert.match(await callErr(s2.client, 'sandbox_run', { command: 'true' }), /IGN_MCP_MAX_SESSIONS/);
    } finally {
      await s2.close();
    }
  });
});

describe('nothing outlives sandbox_run', () => {
  // 100 calls with IGN_TEST_SOAK=1, 20 in `make check`: a tenth of them
  // cancelled and a tenth out of time either way.
  const CALLS = SOAK ? 100 : 20;
  test(`${CALLS} calls, cancelled and timed-out ones among them: no process, state directory or cgroup left`, { timeout: 1_200_000 }, async () => {
    const d = tempDirs();
    const before = leftovers();
    // vm: no pool and no spares, so that every QEMU is a call's.
    const s = await startServer({ env: { IGN_MCP_HOST_IO_ROOT: d.root, IGN_MCP_LOG_DIR: d.logs, ...(IS_VM ? { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } : {}) } });
    try {
      const c = s.client;
      let cancelled = 0, timedOut = 0, ok = 0;
      for (let i = 0; i < CALLS; i++) {
        if (i % 10 === 3) {
          const ac = new AbortController();
          const p = c.callTool({ name: 'sandbox_run', arguments: { command: 'sleep 60' } }, undefined, { signal: ac.signal, timeout: 120000 });
          setTimeout(() => ac.abort(), 200 + (i % 7) * 100);
          await assert.rejects(p);
          cancelled++;
        } else if (i % 10 === 7) {
          const r = await call(c, 'sandbox_run', { command: 'sleep 60', timeout_s: 1 });
          assert.equal(r.timed_out, true);
          timedOut++;
        } else {
          const r = await call(c, 'sandbox_run', { command: 'true' });
          assert.equal(r.exit_code, 0);
          ok++;
        }
      }
      assert.deepEqual({ ok, cancelled, timedOut }, { ok: CALLS * 0.8, cancelled: CALLS / 10, timedOut: CALLS / 10 });
      // The cancelled calls end (and clean up) on their own threads.
      const clean = await waitUntil(() => {
        const r = residue(s.pid, before);
        return JSON.stringify(r) === JSON.stringify(EMPTY) ? r : null;
      }, { timeoutMs: 30000 });
      assert.ok(clean, `left behind: ${JSON.stringify(residue(s.pid, before))}`);
      assert.deepEqual((await call(c, 'list_sessions')).sessions, []);
    } finally {
      await s.close();
      d.remove();
    }
  });
});

/* A tree whose copy_out takes seconds in little of the sandbox's memory
 * (its /root is a tmpfs; a VM has 256 MiB): a file of 100 MiB written
 * (not sparse: holes travel as holes, in no time) under ten names, hard
 * links, which a copy sends as ten files, 1000 MiB. */
const MAKE_BIG = 'mkdir /root/big && dd if=/dev/zero of=/root/big/0 bs=1M count=100 2>/dev/null && ' +
  'for i in 1 2 3 4 5 6 7 8 9; do ln /root/big/0 /root/big/$i; done';

/* The staging entries a copy to the host leaves in DIR while it runs. */
const staging = (dir) => fs.readdirSync(dir).filter((n) => /\.ign-\d+-\d+$/.test(n));

describe('sandbox_run cancelled, out of time, or losing its sandbox', () => {
  let s, c, d, before_;
  before(async () => {
    d = tempDirs();
    before_ = leftovers();
    s = await startServer({ env: { IGN_MCP_HOST_IO_ROOT: d.root, IGN_MCP_LOG_DIR: d.logs, ...(IS_VM ? { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } : {}) } });
    c = s.client;
  });
  after(async () => {
    await s.close();
    d.remove();
  });

  test('a call cancelled during its copy_out commits nothing and leaves nothing', T, async () => {
    const name = `e2e/cancel-commit-${process.pid}`;
    const ac = new AbortController();
    const p = c.callTool({ name: 'sandbox_run', arguments: {
      command: MAKE_BIG, commit_as: name,
      copy_out: [{ guest: '/root/big', host: 'big' }], timeout_s: 300,
    } }, undefined, { signal: ac.signal, timeout: 300_000 });
    const seen = await waitUntil(() => staging(d.root).length > 0, { timeoutMs: 120_000, intervalMs: 20 });
    assert.ok(seen, 'copy_out never started');
    ac.abort('test cancels during copy_out');
    await assert.rejects(p);
    const gone = await waitUntil(async () => (await call(c, 'list_sessions')).sessions.length === 0, { timeoutMs: 60_000 });
    assert.ok(gone, 'the cancelled call never ended');
    const st = await c.callTool({ name: 'stage_info', arguments: { name } });
    assert.equal(st.isError, true, `a cancelled call committed stage ${name}: ${textOf(st).slice(0, 300)}`);
    assert.deepEqual(fs.readdirSync(d.root), [], 'the cancelled copy_out left something on the host');
    const clean = await waitUntil(() => JSON.stringify(residue(s.pid, before_)) === JSON.stringify(EMPTY), { timeoutMs: 30000 });
    assert.ok(clean, `left behind: ${JSON.stringify(residue(s.pid, before_))}`);
  });

  test('a call out of time during its copy_out commits nothing and returns within timeout_s', T, async () => {
    const name = `e2e/late-commit-${process.pid}`;
    // The command (making the tree, then sleeping until WAIT seconds from
    // its start) leaves about a second of the budget to copy 1000 MiB out.
    const [wait, budget] = IS_VM ? [12, 15] : [3, 4];
    const t0 = Date.now();
    const r = await c.callTool({ name: 'sandbox_run', arguments: {
      command: `t0=$(date +%s); ${MAKE_BIG}; left=$((${wait} - ($(date +%s) - t0))); if [ $left -gt 0 ]; then sleep $left; fi`, commit_as: name,
      copy_out: [{ guest: '/root/big', host: 'late' }], timeout_s: budget,
    } }, undefined, { timeout: 300_000 });
    const took = Date.now() - t0;
    const o = r.structuredContent;
    assert.equal(r.isError ?? false, false, textOf(r));
    assert.equal(o.timed_out, false, 'the command itself ran out of time: nothing tested');
    assert.equal(o.copied[0].ok, false, `the copy_out fitted in the budget: nothing tested (${JSON.stringify({ ...o.copied[0], skipped_entries: undefined })}, total_ms ${o.total_ms}, duration_ms ${o.duration_ms})`);
    assert.equal(o.stage_name, undefined, `a call out of time committed: ${textOf(r).slice(0, 400)}`);
    assert.match(o.commit_skipped, /timeout_s/);
    const st = await c.callTool({ name: 'stage_info', arguments: { name } });
    assert.equal(st.isError, true, `a call out of time committed stage ${name}`);
    assert.deepEqual(fs.readdirSync(d.root), [], 'the copy_out out of time left something on the host');
    assert.ok(took < budget * 1000 + 5000, `the call took ${took} ms of a ${budget} s budget`);
  });

  test('a sandbox that dies under sandbox_run: the error says to call sandbox_run again, not to reset an id no tool reaches', { ...T, skip: VM_ONLY('a command cannot end a namespace sandbox') }, async () => {
    const m = await callErr(c, 'sandbox_run', { command: 'echo o > /proc/sysrq-trigger; sleep 30', timeout_s: 60 });
    assert.doesNotMatch(m, /reset\(|close it/, m);
    assert.match(m, /sandbox_run again/, m);
  });

  test('the ephemeral session is listed but no other tool reaches it', T, async () => {
    const p = c.callTool({ name: 'sandbox_run', arguments: { command: 'sleep 8', timeout_s: 120 } }, undefined, { timeout: 300_000 });
    const l = await waitUntil(async () => (await call(c, 'list_sessions')).sessions[0], { timeoutMs: 60_000, intervalMs: 50 });
    assert.ok(l, 'never listed');
    assert.equal(l.ephemeral, true);
    const id = l.session_id;
    for (const [tool, args] of [
      ['run', { session_id: id, command: 'true' }],
      ['write_file', { session_id: id, path: '/root/x', content_base64: 'eA==' }],
      ['read_file', { session_id: id, path: '/etc/hostname' }],
      ['copy_in', { session_id: id, host_path: '.', guest_path: '/root/y' }],
      ['copy_out', { session_id: id, guest_path: '/etc/hostname', host_path: 'h' }],
      ['reset', { session_id: id }],
      ['close', { session_id: id }],
      ['commit', { session_id: id, name: 'e2e/steal' }],
      ['fork', { session_id: id }],
    ]) {
      const m = await callErr(c, tool, args);
      assert.match(m, /unknown session_id|sandbox_run/, `${tool}: ${m}`);
    }
    const r = await p;
    assert.equal(r.isError ?? false, false, textOf(r));
    assert.equal(r.structuredContent.exit_code, 0);
  });

  test('a flood of sandbox_run never has more sandboxes than the cap', T, async () => {
    const s2 = await startServer({ env: { IGN_MCP_HOST_IO_ROOT: d.root, IGN_MCP_LOG_DIR: d.logs, IGN_MCP_MAX_SESSIONS: 2 } });
    try {
      let max = 0, stop = false;
      const watch = (async () => {
        while (!stop) {
          const n = (await call(s2.client, 'list_sessions')).sessions.length;
          max = Math.max(max, n);
          await sleep(20);
        }
      })();
      const rs = await Promise.all(Array.from({ length: 8 }, () => s2.client.callTool({ name: 'sandbox_run', arguments: { command: 'sleep 2' } }, undefined, { timeout: 300_000 })));
      stop = true;
      await watch;
      const ok = rs.filter((r) => !r.isError).length;
      assert.ok(ok >= 1 && ok <= 8);
      for (const r of rs.filter((r) => r.isError)) assert.match(textOf(r), /IGN_MCP_MAX_SESSIONS/);
      assert.ok(max <= 2, `${max} sessions at once under a cap of 2`);
    } finally {
      await s2.close();
    }
  });

  test('arguments that cannot work are refused before a sandbox starts', T, async () => {
    fs.mkdirSync(path.join(d.root, 'o'));
    for (const args of [
      { commit_as: 'Bad Name!' },
      { commit_as: '../x' },
      { stdin_file: '/etc/passwd' },
      { stdin_file: '../x' },
    ]) {
      const m = await callErr(c, 'sandbox_run', { command: 'echo ran > /root/f', copy_out: [{ guest: '/root/f', host: 'o/ok' }], ...args });
      assert.doesNotMatch(m, /did not run|sandbox was destroyed/, m);
      assert.equal(fs.existsSync(path.join(d.root, 'o/ok')), false, `ran despite ${JSON.stringify(args)}: ${m}`);
    }
    // A copy_out destination that cannot be written: refused before the
    // start too, naming the entry (the command would leave /root/f... and
    // the second entry, which could be written, is not).
    fs.symlinkSync('/tmp', path.join(d.root, 'o/link'));
    for (const [bad, why] of [['../outside', /outside|leads out|beneath/], ['nodir/x', /missing/], ['o/link', /symbolic link/]]) {
      const m = await callErr(c, 'sandbox_run', { command: 'echo ran > /root/f', copy_out: [{ guest: '/root/f', host: 'o/ok2' }, { guest: '/root/f', host: bad }] });
      assert.match(m, /^sandbox_run: copy_out\[1\]: /, m);
      assert.match(m, why, m);
      assert.equal(fs.existsSync(path.join(d.root, 'o/ok2')), false, `ran despite copy_out to ${bad}: ${m}`);
    }
    assert.equal(fs.readlinkSync(path.join(d.root, 'o/link')), '/tmp', 'the link is left as it was');
  });

  test('cancels landing anywhere (open, copy_in, run, copy_out, commit) leave no session, stage, host file or process', { timeout: 900_000 }, async () => {
    const proj = path.join(d.root, 'proj');
    fs.mkdirSync(proj);
    for (let i = 0; i < 300; i++) fs.writeFileSync(path.join(proj, `f${i}`), Buffer.alloc(20_000, i));
    fs.mkdirSync(path.join(d.root, 'out'));
    const name = `e2e/cancels-${process.pid}`;
    const n = IS_VM ? 12 : 30;
    for (let i = 0; i < n; i++) {
      const ac = new AbortController();
      const p = c.callTool({ name: 'sandbox_run', arguments: {
        command: 'cp -r /work/proj /root/built', commit_as: name, timeout_s: 120,
        copy_in: [{ host: 'proj', guest: '/work/proj' }], copy_out: [{ guest: '/root/built', host: 'out/built' }],
      } }, undefined, { signal: ac.signal, timeout: 300_000 });
      const delay = (IS_VM ? 40 : 8) * i;
      const mark = s.stderrText().length;
      const t = setTimeout(() => ac.abort('test cancels'), delay);
      let done = false;
      try {
        const r = await p;
        done = !r.isError;
      } catch {}
      clearTimeout(t);
      const quiet = await waitUntil(async () => (await call(c, 'list_sessions')).sessions.length === 0, { timeoutMs: 60_000 });
      assert.ok(quiet, `cancel ${i} (${delay} ms): the call never ended`);
      if (done) {
        // It finished before the cancel: the stage and the copy are its to leave.
        await c.callTool({ name: 'stage_rm', arguments: { name } });
        fs.rmSync(path.join(d.root, 'out/built'), { recursive: true, force: true });
        continue;
      }
      const st = await c.callTool({ name: 'stage_info', arguments: { name } });
      if (!st.isError) {
        // Only a cancel that came after the commit's last check may find it
        // (the server logs "saving stage" right before that check).
        const log = s.stderrText().slice(mark);
        const made = log.indexOf(`saving stage ${name}`), cancel = log.indexOf('cancelled by the client');
        assert.ok(made >= 0 && cancel > made, `cancel ${i} (${delay} ms) left stage ${name}:\n${log}`);
        await c.callTool({ name: 'stage_rm', arguments: { name } });
      }
      const host = fs.readdirSync(path.join(d.root, 'out'));
      // A copy_out that completed before the cancel is allowed; nothing half-made is.
      assert.deepEqual(host.filter((x) => x !== 'built'), [], `cancel ${i} (${delay} ms) left ${host}`);
      fs.rmSync(path.join(d.root, 'out/built'), { recursive: true, force: true });
    }
    const clean = await waitUntil(() => JSON.stringify(residue(s.pid, before_)) === JSON.stringify(EMPTY), { timeoutMs: 30000 });
    assert.ok(clean, `left behind: ${JSON.stringify(residue(s.pid, before_))}`);
  });
});
