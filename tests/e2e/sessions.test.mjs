// sessions.test.mjs: the session table: cap, ids, reset, close, idle reaper,
// parallelism and backend selection.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import {
  startServer, startRaw, call, callErr, openSession, run, sh, sleep, waitUntil,
  findProcs, uniqueSleepSecs, IS_NS, IS_VM, VM_ONLY, NS_ONLY, AGENT, writeFile, textOf, descendants, qemuChildren, isAlive, hardKill,
  SERVER, AS_ROOT, serverEnv,
} from './lib.mjs';

const T = { timeout: 60_000 };

/* Starts `sleep` with exactly PID (free again), steering the kernel's next
 * pid through ns_last_pid; other processes on the host may take it first,
 * so it tries a few times.  The child, or null. */
function takePid(pid) {
  for (let i = 0; i < 500; i++) {
    fs.writeFileSync('/proc/sys/kernel/ns_last_pid', String(pid - 1));
    const ch = spawn('sleep', ['1000'], { stdio: 'ignore' });
    if (ch.pid === pid) return ch;
    ch.kill('SIGKILL');
  }
  return null;
}

describe('session cap and ids', () => {
  test('IGN_MCP_MAX_SESSIONS=2: a third open fails naming the limit; closing frees a slot', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_MAX_SESSIONS: 2 } });
    t.after(() => s.close());
    const a = await openSession(s.client);
    const b = await openSession(s.client);
    assert.notEqual(a, b);
    const e = await callErr(s.client, 'open_session', {});
    assert.match(e, /limit|max|2/i, e);
    assert.match(e, /close/i, e);
    const l = await call(s.client, 'list_sessions', {});
    assert.equal(l.max_sessions, 2);
    assert.equal(l.sessions.length, 2);
    await call(s.client, 'close', { session_id: a });
    const c2 = await openSession(s.client);
    assert.ok(![a, b].includes(c2));
    assert.equal(await sh(s.client, c2, 'echo ok'), 'ok\n');
    assert.equal(await sh(s.client, b, 'echo ok'), 'ok\n');
  });

  test('ids are never reused within one server', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const seen = new Set();
    for (let i = 0; i < 5; i++) {
      const id = await openSession(s.client);
      assert.ok(!seen.has(id), `id ${id} reused`);
      seen.add(id);
      await call(s.client, 'close', { session_id: id });
      const e = await callErr(s.client, 'run', { session_id: id, command: 'true' });
      assert.ok(e.includes(id), e);
    }
  });

  test('ids are never reused across servers on one store; a killed server\'s session is answered as lost, a live one\'s as held by that server', T, async (t) => {
    const a = await startServer();
    t.after(() => a.close());
    const b = await startServer();
    t.after(() => b.close());
    const seq = (id) => Number(/s(\d+)-[0-9a-f]{4}$/.exec(id)[1]);
    const idA = await openSession(a.client);
    const idB = await openSession(b.client);
    assert.ok(seq(idB) > seq(idA), `${idB} after ${idA}: the store's counter did not move on`);
    // A's session, asked of B while A holds it.
    const held = await callErr(b.client, 'run', { session_id: idA, command: 'true' });
    assert.match(held, new RegExp(`^session '${idA}' is held by another server on this store \\(pid ${a.pid}\\), not by this one`), held);
    // A closed session's record goes with it: unknown, as before.
    const closed = await openSession(a.client);
    await call(a.client, 'close', { session_id: closed });
    assert.match(await callErr(b.client, 'run', { session_id: closed, command: 'true' }), /unknown session_id/);
    // A killed: its session is lost, and says so to every later server.
    hardKill(a.pid);
    await waitUntil(() => !isAlive(a.pid), { timeoutMs: 10000 });
    // The kernel drops the record's lock once the last of the killed
    // server's threads is gone (one may still be in an uninterruptible wait).
    let lost;
    await waitUntil(async () => !/is held by another server/.test(lost = await callErr(b.client, 'run', { session_id: idA, command: 'true' })), { timeoutMs: 15000, intervalMs: 200 });
    assert.match(lost, new RegExp(`session '${idA}' was lost: its server \\(pid ${a.pid}\\), where it was opened at \\d{4}-\\d\\d-\\d\\dT[0-9:]+Z, ended without closing it \\(it was killed, or crashed\\)`), lost);
    for (const tool of ['read_file', 'close', 'reset']) {
      const args = tool === 'read_file' ? { session_id: idA, path: '/etc/hostname' } : { session_id: idA };
      assert.match(await callErr(b.client, tool, args), /was lost: its server/, tool);
    }
    const c = await startServer();
    t.after(() => c.close());
    assert.match(await callErr(c.client, 'run', { session_id: idA, command: 'true' }), /was lost: its server/);
    const idC = await openSession(c.client);
    assert.ok(seq(idC) > seq(idB), `${idC} after ${idB}`);
    assert.equal(await sh(c.client, idC, 'echo ok'), 'ok\n');
    // B's own session is still B's, and a fresh id nobody opened is unknown.
    assert.equal(await sh(b.client, idB, 'echo ok'), 'ok\n');
    assert.match(await callErr(c.client, 'run', { session_id: `s${seq(idC) + 1000}-0000`, command: 'true' }), /unknown session_id/);
  });

  test('records planted in the store (a FIFO, a link, a file of another owner) hang nothing and are read as no record', { ...T, skip: NS_ONLY('the records are the same on both backends; a fresh vm store would make a base') }, async (t) => {
    const store = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-records-'));
    t.after(() => fs.rmSync(store, { recursive: true, force: true }));
    const dir = path.join(store, 'sessions');
    fs.mkdirSync(path.join(dir, 's1-0000'), { recursive: true, mode: 0o700 });
    execFileSync('mkfifo', [path.join(dir, 's1-0000', 'live'), path.join(dir, 's1-0000', 'meta.json')]);
    fs.mkdirSync(path.join(dir, 's2-0000'), { mode: 0o700 });
    fs.symlinkSync('/etc/passwd', path.join(dir, 's2-0000', 'meta.json'));
    fs.symlinkSync('/etc/hostname', path.join(dir, 's2-0000', 'live'));
    const s = await startServer({ env: { IGN_MCP_STORE: store } });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    assert.equal(await sh(s.client, sid, 'echo ok'), 'ok\n');
    for (const id of ['s1-0000', 's2-0000']) assert.match(await callErr(s.client, 'run', { session_id: id, command: 'true' }), /unknown session_id/, id);
    // A sessions/ swapped for a link after the server started is not followed.
    const elsewhere = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-records-elsewhere-'));
    t.after(() => fs.rmSync(elsewhere, { recursive: true, force: true }));
    fs.renameSync(dir, `${dir}.old`);
    fs.symlinkSync(elsewhere, dir);
    const sid2 = await openSession(s.client);
    assert.deepEqual(fs.readdirSync(elsewhere), [], 'a record went through the swapped link');
    assert.ok(fs.existsSync(path.join(`${dir}.old`, sid2, 'meta.json')), 'the record is not in the directory opened at startup');
  });

  test('list_sessions follows opens and closes', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const l0 = await call(s.client, 'list_sessions', {});
    assert.deepEqual(l0.sessions, []);
    const a = await openSession(s.client);
    const b = await openSession(s.client);
    const l1 = await call(s.client, 'list_sessions', {});
    assert.deepEqual(l1.sessions.map((x) => x.session_id).sort(), [a, b].sort());
    for (const x of l1.sessions) assert.equal(typeof x.isolation, 'string');
    await call(s.client, 'close', { session_id: a });
    const l2 = await call(s.client, 'list_sessions', {});
    assert.deepEqual(l2.sessions.map((x) => x.session_id), [b]);
  });
});

describe('reset and close', () => {
  test('reset keeps the id, drops files and kills background processes', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    const n = uniqueSleepSecs();
    await writeFile(c, sid, '/root/before-reset.txt', 'x');
    await sh(c, sid, `echo y > /tmp/before-reset; sleep ${n} > /dev/null 2>&1 &`);
    if (IS_NS) assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length === 1), 'background sleep not running');
    const r = await call(c, 'reset', { session_id: sid });
    assert.equal(r.session_id, sid);
    assert.equal(await sh(c, sid, 'ls /root/before-reset.txt /tmp/before-reset 2>/dev/null; echo end'), 'end\n');
    const ps = await sh(c, sid, 'ps -o args 2>/dev/null || ps');
    assert.ok(!ps.includes(`sleep ${n}`), ps);
    if (IS_NS) assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length === 0), 'background sleep survived reset');
    const l = await call(c, 'list_sessions', {});
    assert.ok(l.sessions.some((x) => x.session_id === sid));
  });

  test('close kills the sandbox processes', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    const n = uniqueSleepSecs();
    await sh(c, sid, `sleep ${n} > /dev/null 2>&1 &`);
    if (IS_NS) assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length === 1));
    await call(c, 'close', { session_id: sid });
    if (IS_NS) assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length === 0), 'sleep survived close');
    const e = await callErr(c, 'run', { session_id: sid, command: 'true' });
    assert.ok(e.includes(sid));
  });

  test('close while a run is in flight ends that run and frees the session', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    const t0 = Date.now();
    const p = c.callTool({ name: 'run', arguments: { session_id: sid, command: 'sleep 30' } }, undefined, { timeout: 60000 });
    await sleep(1000);
    await call(c, 'close', { session_id: sid });
    const res = await p;
    assert.ok(Date.now() - t0 < 15000, 'the in-flight run was not ended by close');
    // Either an error result or a killed run is fine, but not a clean exit 0.
    assert.ok(res.isError === true || res.structuredContent?.exit_code !== 0, JSON.stringify(res));
    const l = await call(c, 'list_sessions', {});
    assert.ok(!l.sessions.some((x) => x.session_id === sid));
  });
  test('reset, run and close sent back to back: the run waiting on the reset fails cleanly, nothing is used after it is freed', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const c = s.client;
    for (let i = 0; i < 3; i++) {
      const sid = await openSession(c);
      // No await in between: the run waits for the reset, and the close
      // removes the session while both are still going.
      const reset = c.callTool({ name: 'reset', arguments: { session_id: sid } }, undefined, { timeout: 60000 });
      const runP = c.callTool({ name: 'run', arguments: { session_id: sid, command: 'echo x' } }, undefined, { timeout: 60000 });
      const close = c.callTool({ name: 'close', arguments: { session_id: sid } }, undefined, { timeout: 60000 });
      const [rr, ru, rc] = await Promise.all([reset, runP, close]);
      assert.equal(rc.isError ?? false, false, `close failed: ${textOf(rc)}`);
      // The reset and the run either came before the close or fail naming the id.
      for (const [what, r] of [['reset', rr], ['run', ru]])
        if (r.isError) assert.ok(textOf(r).includes(sid), `${what}: ${textOf(r)}`);
      const l = await call(c, 'list_sessions', {});
      assert.ok(!l.sessions.some((x) => x.session_id === sid), `${sid} still listed after its close`);
    }
    // The server is still whole (s.close() also checks its stderr for a sanitizer report).
    const sid = await openSession(c);
    assert.equal(await sh(c, sid, 'echo alive'), 'alive\n');
  });
  test('a run waiting on a reset that fails is told what became of the session, not that its id is unknown', { ...T, skip: NS_ONLY('the new sandbox\'s failure is made with an agent wrapper') }, async (t) => {
    // An agent that, while HOLD exists, waits for it to go and then fails:
    // the reset is held until the run is waiting on it.
    const dir = fs.mkdtempSync('/tmp/e2e-held-agent-');
    fs.chmodSync(dir, 0o755); // the agent starts as the session's own host uid
    t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
    const hold = path.join(dir, 'hold');
    const wrapper = path.join(dir, 'agent');
    fs.writeFileSync(wrapper, `#!/bin/sh\nif [ -e ${hold} ]; then\n  while [ -e ${hold} ]; do sleep 0.1; done\n  echo 'agent: cannot start (a test)' >&2\n  exit 1\nfi\nexec ${AGENT} "$@"\n`, { mode: 0o755 });
    const s = await startServer({ env: { IGN_MCP_AGENT: wrapper } });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    fs.writeFileSync(hold, '');
    const reset = c.callTool({ name: 'reset', arguments: { session_id: sid } }, undefined, { timeout: 60000 });
    assert.ok(await waitUntil(async () => (await call(c, 'list_sessions', {})).sessions.some((x) => x.session_id === sid && x.isolation === '(resetting)'), { timeoutMs: 20000 }), 'the reset did not start');
    const runP = c.callTool({ name: 'run', arguments: { session_id: sid, command: 'true' } }, undefined, { timeout: 60000 });
    // Time for the run to reach the wait (had it not, it would find the id
    // unknown after the reset failed, and the test fails falsely, never
    // passes falsely).
    await sleep(2000);
    fs.rmSync(hold);
    const [rr, ru] = await Promise.all([reset, runP]);
    assert.equal(rr.isError, true, `the reset should fail: ${textOf(rr)}`);
    assert.match(textOf(rr), /agent: cannot start \(a test\)/);
    assert.equal(ru.isError, true, `the run should fail: ${textOf(ru)}`);
    assert.ok(textOf(ru).includes(`session '${sid}' was lost (its reset failed) while this call waited for its reset`), textOf(ru));
    const l = await call(c, 'list_sessions', {});
    assert.ok(!l.sessions.some((x) => x.session_id === sid), `${sid} still listed after its reset failed`);
  });
  test('close after the sandbox died on its own never signals the process that took its pid', { ...T, skip: process.getuid() === 0 ? false : 'needs root to steer pid reuse (/proc/sys/kernel/ns_last_pid)' }, async (t) => {
    // vm: no pool and no spares, so that the only QEMU is the session's.
    const s = await startServer({ env: IS_VM ? { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } : {} });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    const holders = IS_VM ? qemuChildren(s.pid) : descendants(s.pid).filter((d) => /^\S*ign-agent\b/.test(d.cmd ?? ''));
    assert.equal(holders.length, 1, `sandbox processes under the server: ${JSON.stringify(descendants(s.pid))}`);
    const dead = holders[0];
    process.kill(dead.pid, 'SIGKILL');
    // This call finds the sandbox dead: the server reaps it, its pid is free.
    const e = await callErr(c, 'run', { session_id: sid, command: 'true' });
    assert.match(e, /dead/, e);
    assert.ok(await waitUntil(() => !isAlive(dead)), 'the killed sandbox process is still there');
    const victim = takePid(dead.pid);
    assert.ok(victim, `could not start a process with the freed pid ${dead.pid}`);
    t.after(() => victim.kill('SIGKILL'));
    await call(c, 'close', { session_id: sid });
    await sleep(500);
    assert.equal(victim.exitCode, null, 'the process that took the dead sandbox\'s pid exited');
    assert.equal(victim.signalCode, null, 'close signalled the process that took the dead sandbox\'s pid');
  });
});

describe('idle reaper', () => {
  test('IGN_MCP_IDLE_SECS=2 with IGN_MCP_IDLE_ACTION=close reaps an idle session but not a busy one (hibernate.test.mjs: the default, hibernate)', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_IDLE_SECS: 2, IGN_MCP_IDLE_ACTION: 'close' } });
    t.after(() => s.close());
    const c = s.client;
    const idle = await openSession(c);
    const busy = await openSession(c);
    const t0 = Date.now();
    let reapedAt = null;
    while (Date.now() - t0 < 12000) {
      assert.equal(await sh(c, busy, 'echo hi'), 'hi\n');
      const l = await call(c, 'list_sessions', {});
      if (!reapedAt && !l.sessions.some((x) => x.session_id === idle)) reapedAt = Date.now() - t0;
      if (reapedAt && Date.now() - t0 > 6000) break;
      await sleep(1000);
    }
    assert.ok(reapedAt !== null, 'idle session was not reaped within 12 s');
    assert.ok(reapedAt >= 1500, `idle session reaped too early (${reapedAt} ms)`);
    const e = await callErr(c, 'run', { session_id: idle, command: 'true' });
    assert.ok(e.includes(idle), e);
    const l = await call(c, 'list_sessions', {});
    assert.ok(l.sessions.some((x) => x.session_id === busy), 'busy session was reaped');
    assert.equal(await sh(c, busy, 'echo still'), 'still\n');
  });

  test('a run longer than the idle timeout is not reaped under it', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_IDLE_SECS: 2 } });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    const r = await run(s.client, sid, 'sleep 5; echo survived', { timeout_s: 30 });
    assert.equal(r.stdout, 'survived\n');
    assert.equal(r.timed_out, false);
    // The call's end counts as use: the idle clock starts again from there,
    // not from when the call began (which is longer ago than the timeout).
    const l = await call(s.client, 'list_sessions', {});
    const me = l.sessions.find((x) => x.session_id === sid);
    assert.ok(me, `reaped right after its long run: ${JSON.stringify(l)}`);
    assert.equal(me.idle_s, 0, JSON.stringify(me));
    assert.equal(me.busy, false, JSON.stringify(me));
    await sleep(1000);
    assert.equal(await sh(s.client, sid, 'echo still'), 'still\n');
  });
});

describe('parallel sessions', () => {
  test('two sleep 2 runs in two sessions overlap (< 3.5 s together)', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const a = await openSession(s.client);
    const b = await openSession(s.client);
    const t0 = Date.now();
    const [ra, rb] = await Promise.all([run(s.client, a, 'sleep 2; echo a'), run(s.client, b, 'sleep 2; echo b')]);
    const el = Date.now() - t0;
    assert.equal(ra.stdout, 'a\n');
    assert.equal(rb.stdout, 'b\n');
    assert.ok(el < 3500, `took ${el} ms`);
  });

  test('sessions opened concurrently all work', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const ids = await Promise.all([1, 2, 3, 4].map(() => openSession(s.client)));
    assert.equal(new Set(ids).size, 4);
    const outs = await Promise.all(ids.map((id, i) => sh(s.client, id, `echo ${i}`)));
    assert.deepEqual(outs, ['0\n', '1\n', '2\n', '3\n']);
  });
});

describe('backend selection', () => {
  test('IGN_MCP_BACKEND=bogus is refused clearly', T, async (t) => {
    const raw = startRaw({ env: { IGN_MCP_BACKEND: 'bogus' } });
    t.after(() => raw.close({ checkStdout: true }));
    let init;
    try {
      init = await raw.initialize();
    } catch {
      init = null;
    }
    if (!init) {
      const ex = await raw.waitExit(5000);
      assert.ok(ex, 'server neither answered nor exited');
      assert.notEqual(ex.code, 0);
      assert.match(raw.stderrText(), /bogus|backend/i);
      return;
    }
    const r = await raw.callTool('open_session', {});
    assert.equal(r.result?.isError, true, JSON.stringify(r));
    const text = r.result.content.map((x) => x.text).join('\n');
    assert.match(text, /bogus|backend/i);
  });

  test('IGN_MCP_BACKEND=ns opens namespace sessions', { ...T, skip: IS_NS ? false : 'not testing the ns backend' }, async (t) => {
    const s = await startServer({ env: { IGN_MCP_BACKEND: 'ns' } });
    t.after(() => s.close());
    const o = await call(s.client, 'open_session', {});
    assert.equal(o.backend, 'ns');
    assert.equal(o.isolation, 'namespace');
    assert.equal(await sh(s.client, o.session_id, 'echo ns'), 'ns\n');
  });

  for (const b of ['vm', 'auto']) {
    test(`IGN_MCP_BACKEND=${b} opens microVM sessions (QEMU and the images are here)`, { ...T, skip: VM_ONLY('not testing the vm backend') }, async (t) => {
      const s = await startServer({ env: { IGN_MCP_BACKEND: b } });
      t.after(() => s.close());
      const o = await call(s.client, 'open_session', {});
      assert.equal(o.backend, 'vm');
      assert.match(o.isolation, /^microvm\/(kvm|tcg)$/);
      assert.equal(await sh(s.client, o.session_id, 'echo vm'), 'vm\n');
      const l = await call(s.client, 'list_sessions', {});
      assert.equal(l.sessions[0].isolation, o.isolation);
    });
  }

  test('the server works when started from another directory', T, async (t) => {
    const { StdioClientTransport } = await import('@modelcontextprotocol/sdk/client/stdio.js');
    const { Client } = await import('@modelcontextprotocol/sdk/client/index.js');
    const { serverEnv, SERVER, assertNoVmLeftovers, hardKill } = await import('./lib.mjs');
    const tr = new StdioClientTransport({ command: SERVER, env: serverEnv(), cwd: '/', stderr: 'pipe' });
    const cl = new Client({ name: 'cwd-test', version: '1' });
    await cl.connect(tr);
    const pid = tr.pid;
    t.after(() => hardKill(pid));
    const sid = await openSession(cl);
    assert.equal(await sh(cl, sid, 'echo from-root'), 'from-root\n');
    await cl.close();
    await waitUntil(() => !fs.existsSync(`/proc/${pid}/status`) || /State:\s+Z/.test(fs.readFileSync(`/proc/${pid}/status`, 'utf8')), { timeoutMs: 6000 });
    await assertNoVmLeftovers(pid);
  });
});

describe('servers in other pid namespaces', () => {
  test('a server started in a pid namespace of its own leaves the cgroups and sandboxes of a live server outside it alone (a pid free there is not a dead server)', { ...T, skip: !AS_ROOT ? 'root only: a pid namespace and the cgroups of the ns backend' : NS_ONLY('the ns backend\'s cgroups') }, async (t) => {
    const a = await startServer();
    t.after(() => a.close());
    const sid = await openSession(a.client);
    const secs = uniqueSleepSecs();
    await sh(a.client, sid, `(sleep ${secs} > /dev/null 2>&1 &); echo started`);
    // The same cgroup as A, in a pid namespace where A's pid is free.
    const b = spawn('unshare', ['--pid', '--fork', '--mount-proc', SERVER], { env: serverEnv({}), stdio: ['pipe', 'ignore', 'pipe'] });
    let err = '';
    b.stderr.on('data', (d) => (err += d));
    const exited = new Promise((r) => b.on('exit', r));
    t.after(() => b.kill('SIGKILL'));
    assert.ok(await waitUntil(() => /ready: backend/.test(err), { timeoutMs: 30000 }), `the server in the pid namespace did not start: ${err.slice(-2000)}`);
    b.stdin.end();
    await exited;
    assert.doesNotMatch(err, new RegExp(`removing cgroup \\S*ign-mcp-${a.pid}-`), 'it took the live server for a dead one');
    assert.equal(findProcs(['sleep', String(secs)]).length, 1, 'the live server\'s sandbox was killed');
    assert.equal(await sh(a.client, sid, 'echo ok'), 'ok\n');
  });
});

