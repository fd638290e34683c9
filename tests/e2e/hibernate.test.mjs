// hibernate.test.mjs: hibernate and resume within a server: a hibernated
// session keeps its id and costs disk only; the next call that names it
// resumes it (vm: with its processes; ns: with its files); close and reset
// of a hibernated session; the idle reaper hibernates, and closes what was
// kept IGN_MCP_HIBERNATE_KEEP_SECS; IGN_MCP_HIBERNATE_MAX_MB makes room by
// closing the owner's oldest, and refuses one that cannot fit.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import {
  startServer, call, callErr, openSession, sh, sleep, waitUntil, uniqueSleepSecs, findProcs,
  IS_VM, IS_NS, NS_ONLY, qemuChildren, serverEnv, hardKill, AGENT, run,
} from './lib.mjs';

const T = { timeout: 180_000 };
/* No pool or spare QEMUs: the QEMUs a server has are its sessions'. */
const QUIET = { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 };
const IDENTITY = 'hostname; cat /etc/machine-id 2>/dev/null || echo none; head -c 16 /dev/urandom | od -An -tx1 | tr -d " \\n"; echo';

/* The store the tests' servers use (the server's default without one). */
function storeDir() {
  const e = serverEnv({});
  if (e.IGN_MCP_STORE) return e.IGN_MCP_STORE;
  return process.getuid() === 0 ? '/var/lib/ignition-mcp' : path.join(os.homedir(), '.cache/ignition-mcp');
}

/* The server's saved states on its store: the anonymous stages it made
 * (a resumed session's, a hibernation being made) and the kept stages of
 * the hibernated sessions it holds (.hib-<id>, whose record names it). */
function savedStates(s) {
  return fs.readdirSync(path.join(storeDir(), 'stages')).filter((n) => {
    if (n.startsWith(`.anon-${s.pid}-`)) return true;
    return n.startsWith('.hib-') && recordOf(n.slice(5))?.meta?.pid === s.pid;
  });
}

/* What the store keeps of session ID: {meta, hibernated} (each null when
 * absent), or null without a record. */
function recordOf(id) {
  const dir = path.join(storeDir(), 'sessions', id);
  if (!fs.existsSync(dir)) return null;
  const read = (f) => {
    try {
      return JSON.parse(fs.readFileSync(path.join(dir, f), 'utf8'));
    } catch {
      return null;
    }
  };
  return { meta: read('meta.json'), hibernated: read('hibernated.json') };
}

/* Whether session ID's kept stage is on the store. */
function keptStage(id) {
  return fs.existsSync(path.join(storeDir(), 'stages', `.hib-${id}`));
}

/* The server's QEMUs that run a guest: not the loader it keeps waiting for a
 * snapshot's stream (started with -S, its guest never runs). */
function guestQemus(s) {
  return qemuChildren(s.pid).filter((q) => {
    try {
      return !fs.readFileSync(`/proc/${q.pid}/cmdline`, 'utf8').split('\0').includes('-S');
    } catch {
      return false;
    }
  });
}

describe('hibernate and resume', () => {
  test('hibernate frees the sandbox and keeps the id; the next call resumes it with its files (vm: and processes), its identity and fresh random bytes', T, async (t) => {
    const s = await startServer({ env: QUIET });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    const secs = uniqueSleepSecs();
    await sh(c, sid, `echo kept > /root/mark; (sleep ${secs} > /dev/null 2>&1 &) ; echo started`);
    const [host0, mid0, rnd0] = (await sh(c, sid, IDENTITY)).trim().split('\n');
    const before = IS_VM ? guestQemus(s).length : findProcs(['sleep', String(secs)]).length;
    assert.equal(before, 1, 'the session\'s QEMU (vm) or its sleep (ns) is not there to begin with');

    const h = await call(c, 'hibernate', { session_id: sid });
    assert.equal(h.session_id, sid);
    assert.equal(h.state, 'hibernated');
    assert.equal(h.carries, IS_VM ? 'memory' : 'files');
    assert.ok(h.bytes > 0 && Number.isInteger(h.hibernate_ms) && h.hibernated_at > 1.7e9, JSON.stringify(h));
    // Its sandbox is gone: the QEMU (vm), the processes (ns).
    if (IS_VM) assert.ok(await waitUntil(() => guestQemus(s).length === 0, { timeoutMs: 10000 }), 'the QEMU of a hibernated session still runs');
    else assert.ok(await waitUntil(() => findProcs(['sleep', String(secs)]).length === 0, { timeoutMs: 10000 }), 'a process of a hibernated session still runs');
    assert.equal(savedStates(s).length, 1, 'no saved state on the store');
    const l = await call(c, 'list_sessions', {});
    const e = l.sessions.find((x) => x.session_id === sid);
    assert.equal(e.state, 'hibernated', JSON.stringify(l));
    assert.equal(e.bytes, h.bytes);
    assert.equal(e.hibernated_at, h.hibernated_at);
    assert.equal(e.carries, h.carries);
    assert.match(e.isolation, IS_VM ? /^microvm\/(kvm|tcg)$/ : /^namespace$/);
    assert.equal(l.hibernated_bytes, h.bytes);
    // Asked again: it says so, nothing resumed.
    const again = await call(c, 'hibernate', { session_id: sid });
    assert.equal(again.already, true);
    assert.equal(again.bytes, h.bytes);

    // A run resumes it, and says how long that took.
    const r = await call(c, 'run', { session_id: sid, command: `cat /root/mark; if for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < $f; echo; done 2>/dev/null | grep -q "^slee[p] ${secs} $"; then echo alive; else echo gone; fi` });
    assert.ok(Number.isInteger(r.resumed_ms) && r.resumed_ms >= 0, JSON.stringify(r));
    assert.equal(r.stdout, `kept\n${IS_VM ? 'alive' : 'gone'}\n`, 'vm: processes go on; ns: files only');
    const [host1, mid1, rnd1] = (await sh(c, sid, IDENTITY)).trim().split('\n');
    assert.equal(host1, host0, 'the hostname changed');
    assert.equal(mid1, mid0, 'the machine id changed');
    assert.notEqual(rnd1, rnd0, 'a resumed guest read the same random bytes again');
    const next = await call(c, 'run', { session_id: sid, command: 'true' });
    assert.equal(next.resumed_ms, undefined, 'only the call that resumed says resumed_ms');
    const l2 = await call(c, 'list_sessions', {});
    assert.equal(l2.sessions.find((x) => x.session_id === sid).state, 'running');
    assert.equal(l2.hibernated_bytes, 0);
    // read_file and write_file resume as well.
    await call(c, 'hibernate', { session_id: sid });
    const rf = await call(c, 'read_file', { session_id: sid, path: '/root/mark' });
    assert.equal(Buffer.from(rf.content_base64, 'base64').toString(), 'kept\n');
    assert.ok(Number.isInteger(rf.resumed_ms), JSON.stringify(rf));
    await call(c, 'hibernate', { session_id: sid });
    const wf = await call(c, 'write_file', { session_id: sid, path: '/root/w', content_base64: 'eA==' });
    assert.ok(Number.isInteger(wf.resumed_ms), JSON.stringify(wf));
    // Only the one saved state at a time: the earlier ones went.
    assert.ok(await waitUntil(() => savedStates(s).length <= 1, { timeoutMs: 10000 }), `saved states left: ${savedStates(s)}`);
  });

  test('calls sent while a session hibernates wait, then resume it exactly once', T, async (t) => {
    const s = await startServer({ env: QUIET });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    await sh(c, sid, 'echo 1 > /root/n');
    // A call holds the session; the hibernate waits for it, and the four
    // runs sent after the hibernate wait for the hibernation.
    const busy = call(c, 'run', { session_id: sid, command: 'sleep 2; echo held' });
    await sleep(500);
    const hib = call(c, 'hibernate', { session_id: sid });
    await sleep(500);
    const runs = Array.from({ length: 4 }, () => call(c, 'run', { session_id: sid, command: 'cat /root/n' }));
    const [b, h, ...rs] = await Promise.all([busy, hib, ...runs]);
    assert.equal(b.stdout, 'held\n');
    assert.equal(h.state, 'hibernated', JSON.stringify(h));
    assert.equal(h.already, undefined, JSON.stringify(h));
    for (const r of rs) assert.equal(r.stdout, '1\n');
    assert.equal(rs.filter((r) => r.resumed_ms !== undefined).length, 1, 'not resumed exactly once');
    if (IS_VM) assert.equal(guestQemus(s).length, 1, 'not one QEMU for the session');
  });

  test('close removes a hibernated session without resuming it, and its saved state goes; reset starts one afresh', T, async (t) => {
    const s = await startServer({ env: QUIET });
    t.after(() => s.close());
    const c = s.client;
    const a = await openSession(c);
    const b = await openSession(c);
    await sh(c, b, 'echo old > /root/mark');
    await call(c, 'hibernate', { session_id: a });
    await call(c, 'hibernate', { session_id: b });
    assert.equal(savedStates(s).length, 2);
    assert.deepEqual(await call(c, 'close', { session_id: a }), { ok: true, session_id: a });
    if (IS_VM) assert.equal(guestQemus(s).length, 0, 'close resumed the session');
    assert.ok(await waitUntil(() => savedStates(s).length === 1, { timeoutMs: 10000 }), 'the closed session\'s saved state is still on the store');
    assert.match(await callErr(c, 'run', { session_id: a, command: 'true' }), /unknown session_id/);
    const r = await call(c, 'reset', { session_id: b });
    assert.equal(r.session_id, b);
    assert.equal(await sh(c, b, 'cat /root/mark 2>&1 || echo none'), 'cat: can\'t open \'/root/mark\': No such file or directory\nnone\n');
    assert.ok(await waitUntil(() => savedStates(s).length === 0, { timeoutMs: 10000 }));
    const l = await call(c, 'list_sessions', {});
    assert.deepEqual(l.sessions.map((x) => [x.session_id, x.state]), [[b, 'running']]);
  });

  test('hibernated sessions do not count against IGN_MCP_MAX_SESSIONS; a resume past it is refused and the session stays hibernated', T, async (t) => {
    const s = await startServer({ env: { ...QUIET, IGN_MCP_MAX_SESSIONS: 1 } });
    t.after(() => s.close());
    const c = s.client;
    const a = await openSession(c);
    await call(c, 'hibernate', { session_id: a });
    const b = await openSession(c);
    const e = await callErr(c, 'run', { session_id: a, command: 'true' });
    assert.match(e, new RegExp(`^cannot resume session '${a}': the limit of 1 running sessions is reached \\(IGN_MCP_MAX_SESSIONS; hibernated ones do not count\\)`), e);
    assert.equal((await call(c, 'list_sessions', {})).sessions.find((x) => x.session_id === a).state, 'hibernated');
    await call(c, 'hibernate', { session_id: b });
    assert.equal(await sh(c, a, 'echo back'), 'back\n');
  });

  test('mistakes: an unknown id, a sandbox_run, hibernation off (IGN_MCP_HIBERNATE_MAX_MB=0)', T, async (t) => {
    const s = await startServer({ env: { ...QUIET, IGN_MCP_HIBERNATE_MAX_MB: 0 } });
    t.after(() => s.close());
    const c = s.client;
    assert.match(await callErr(c, 'hibernate', { session_id: 's999999-0000' }), /hibernation is off on this server \(IGN_MCP_HIBERNATE_MAX_MB=0\)/);
    assert.match(await callErr(c, 'hibernate', {}), /session_id/);
    const s2 = await startServer({ env: QUIET });
    t.after(() => s2.close());
    assert.match(await callErr(s2.client, 'hibernate', { session_id: 's999999-0000' }), /unknown session_id 's999999-0000'/);
  });
});

describe('the idle reaper and the caps', () => {
  test('IGN_MCP_IDLE_SECS=2: an idle session is hibernated, not closed, and resumes; after IGN_MCP_HIBERNATE_KEEP_SECS it is closed, and list_sessions says why', T, async (t) => {
    const s = await startServer({ env: { ...QUIET, IGN_MCP_IDLE_SECS: 2, IGN_MCP_HIBERNATE_KEEP_SECS: 6 } });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    await sh(c, sid, 'echo idle > /root/mark');
    const state = async () => (await call(c, 'list_sessions', {})).sessions.find((x) => x.session_id === sid)?.state;
    assert.ok(await waitUntil(async () => (await state()) === 'hibernated', { timeoutMs: 60000, intervalMs: 500 }), 'the idle session was not hibernated');
    const r = await call(c, 'run', { session_id: sid, command: 'cat /root/mark' });
    assert.equal(r.stdout, 'idle\n');
    assert.ok(Number.isInteger(r.resumed_ms));
    // Idle again, hibernated again, then kept its 6 s and closed.
    assert.ok(await waitUntil(async () => (await state()) === undefined, { timeoutMs: 90000, intervalMs: 500 }), 'the hibernated session was never closed');
    const l = await call(c, 'list_sessions', {});
    const gone = l.recently_closed.find((x) => x.session_id === sid);
    assert.ok(gone, JSON.stringify(l));
    assert.match(gone.why, /closed after 6 s hibernated \(IGN_MCP_HIBERNATE_KEEP_SECS\)/);
    assert.match(await callErr(c, 'run', { session_id: sid, command: 'true' }), /unknown session_id/);
    assert.ok(await waitUntil(() => savedStates(s).length === 0, { timeoutMs: 10000 }));
  });

  test('an idle session that cannot be hibernated is closed, and the log says why', T, async (t) => {
    // 1 MiB: a vm guest's RAM never fits; an ns session with 2 MB of files neither.
    const s = await startServer({ env: { ...QUIET, IGN_MCP_IDLE_SECS: 2, IGN_MCP_HIBERNATE_MAX_MB: 1 } });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    await sh(c, sid, 'head -c 2000000 /dev/urandom > /root/blob');
    assert.ok(await waitUntil(async () => (await call(c, 'list_sessions', {})).sessions.length === 0, { timeoutMs: 60000, intervalMs: 500 }), 'the idle session that cannot be hibernated was never closed');
    // The session leaves the table first; its sandbox and saved state go,
    // and the line is logged, just after (on a busy host, seconds after).
    const why = new RegExp(`session ${sid} reaped after 2 s idle: it could not be hibernated: session '${sid}' takes \\d+ bytes hibernated, more than IGN_MCP_HIBERNATE_MAX_MB \\(1 MiB\\)`);
    assert.ok(await waitUntil(() => why.test(s.stderrText()), { timeoutMs: 30000 }), `the log does not say why: ${s.stderrText().slice(-2000)}`);
    assert.match(await callErr(c, 'run', { session_id: sid, command: 'true' }), /unknown session_id/);
    assert.ok(await waitUntil(() => savedStates(s).length === 0, { timeoutMs: 10000 }), 'its refused saved state is still on the store');
    if (IS_VM) assert.ok(await waitUntil(() => guestQemus(s).length === 0, { timeoutMs: 10000 }), 'its QEMU is still running');
  });

  test('at most 8 x IGN_MCP_MAX_SESSIONS hibernated sessions in a server: past it the server\'s oldest goes back to the store, whole, and comes back when called', { ...T, skip: NS_ONLY('nine hibernations are quick on ns') }, async (t) => {
    const s = await startServer({ env: { ...QUIET, IGN_MCP_MAX_SESSIONS: 1 } });
    t.after(() => s.close());
    const c = s.client;
    const ids = [];
    for (let i = 0; i < 9; i++) {
      const sid = await openSession(c);
      ids.push(sid);
      await sh(c, sid, `echo ${i} > /root/mark`);
      await call(c, 'hibernate', { session_id: sid });
    }
    const l = await call(c, 'list_sessions', {});
    assert.deepEqual(l.sessions.map((x) => x.session_id).sort(), [...ids].sort(), JSON.stringify(l));
    assert.deepEqual(l.sessions.filter((x) => x.on_store).map((x) => x.session_id), [ids[0]]);
    assert.deepEqual(l.recently_closed, []);
    assert.ok(recordOf(ids[0])?.hibernated && keptStage(ids[0]));
    assert.match(s.stderrText(), new RegExp(`session ${ids[0]} \\(hibernated\\) left on the store, to make room in this server`));
    // Called, it comes back (and the next oldest makes room for it).
    assert.equal(await sh(c, ids[0], 'cat /root/mark'), '0\n');
    assert.deepEqual((await call(c, 'list_sessions', {})).sessions.filter((x) => x.on_store).map((x) => x.session_id), [ids[1]]);
    // Closed, in the server and on the store alike: nothing is left.
    for (const id of ids) await call(c, 'close', { session_id: id });
    assert.deepEqual((await call(c, 'list_sessions', {})).sessions, []);
    assert.equal(recordOf(ids[1]), null);
  });

  test('IGN_MCP_IDLE_ACTION=close closes idle sessions as before; an invalid action stops the server', T, async (t) => {
    const s = await startServer({ env: { ...QUIET, IGN_MCP_IDLE_SECS: 2, IGN_MCP_IDLE_ACTION: 'close' } });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    assert.ok(await waitUntil(async () => (await call(s.client, 'list_sessions', {})).sessions.length === 0, { timeoutMs: 60000, intervalMs: 500 }));
    assert.match(await callErr(s.client, 'run', { session_id: sid, command: 'true' }), /unknown session_id/);
    assert.equal(savedStates(s).length, 0);
    await assert.rejects(startServer({ env: { IGN_MCP_IDLE_ACTION: 'sleep' } }), /IGN_MCP_IDLE_ACTION=sleep is invalid: use hibernate or close/);
  });

  test('IGN_MCP_HIBERNATE_MAX_MB: the owner\'s oldest hibernation is closed to make room, and one that cannot fit is refused and goes on running', { ...T, skip: NS_ONLY('vm hibernations are the guest RAM, tens of MiB each') }, async (t) => {
    const s = await startServer({ env: { ...QUIET, IGN_MCP_HIBERNATE_MAX_MB: 2 } });
    t.after(() => s.close());
    const c = s.client;
    const [a, b, big] = [await openSession(c), await openSession(c), await openSession(c)];
    for (const sid of [a, b]) await sh(c, sid, 'head -c 1200000 /dev/urandom > /root/blob');
    await sh(c, big, 'head -c 3000000 /dev/urandom > /root/blob');
    await call(c, 'hibernate', { session_id: a });
    await call(c, 'hibernate', { session_id: b });
    const l = await call(c, 'list_sessions', {});
    assert.deepEqual(l.sessions.filter((x) => x.state === 'hibernated').map((x) => x.session_id), [b]);
    const gone = l.recently_closed.find((x) => x.session_id === a);
    assert.match(gone?.why ?? '', new RegExp(`closed to make room for the hibernation of session ${b} \\(IGN_MCP_HIBERNATE_MAX_MB=2\\)`), JSON.stringify(l));
    const e = await callErr(c, 'hibernate', { session_id: big });
    assert.match(e, new RegExp(`^session '${big}' takes \\d+ bytes hibernated, more than IGN_MCP_HIBERNATE_MAX_MB \\(2 MiB\\) allows; it was not hibernated and goes on running`), e);
    assert.equal(await sh(c, big, 'wc -c < /root/blob'), '3000000\n');
    assert.equal((await call(c, 'run', { session_id: b, command: 'wc -c < /root/blob' })).stdout, '1200000\n');
  });
});

/* Servers that keep their hibernated sessions on the store when they end. */
const KEEP = { ...QUIET, IGN_MCP_SHUTDOWN_ACTION: 'hibernate' };
const ALIVE = (secs) => `if for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < $f; echo; done 2>/dev/null | grep -q "^slee[p] ${secs} $"; then echo alive; else echo gone; fi`;

/* Whether a sandbox can capture its traffic here (the agent's own probe). */
function captures() {
  const r = spawnSync(AGENT, ['--probe-egress'], { encoding: 'utf8', timeout: 20_000 });
  return r.status === 0 && `${r.stdout ?? ''}`.split('\n')[0] === 'ok';
}

/* Waits until process PID is gone (or a zombie). */
async function gone(pid) {
  return waitUntil(() => {
    try {
      return /^State:\s+Z/m.test(fs.readFileSync(`/proc/${pid}/status`, 'utf8'));
    } catch {
      return true;
    }
  }, { timeoutMs: 15000 });
}

describe('across servers', () => {
  test('a hibernated session outlives its server: the next server on the store lists it and resumes it by id, with its files (vm: and processes), its identity and its network policy', T, async (t) => {
    const a = await startServer({ env: KEEP });
    t.after(() => a.close());
    const open = await call(a.client, 'open_session', { network: 'allow', allow_hosts: ['example.com', '*.example.org'] });
    const sid = open.session_id;
    const secs = uniqueSleepSecs();
    await sh(a.client, sid, `echo kept > /root/mark; (sleep ${secs} > /dev/null 2>&1 &) ; echo started`);
    // A refused connect goes into the flight record before the hibernation.
    const capture = captures();
    if (capture) await run(a.client, sid, 'echo x | nc -w 2 10.1.2.3 1 >/dev/null 2>&1; true');
    const [host0, mid0] = (await sh(a.client, sid, IDENTITY)).trim().split('\n');
    const h = await call(a.client, 'hibernate', { session_id: sid });
    // On the store at once: the record says hibernated, the stage is kept.
    const rec = recordOf(sid);
    assert.equal(rec?.hibernated?.id, sid, JSON.stringify(rec));
    assert.equal(rec.hibernated.bytes, h.bytes);
    assert.equal(rec.hibernated.egress.mode, 'allow');
    assert.deepEqual(rec.hibernated.egress.allow_hosts, ['example.com', '*.example.org']);
    assert.ok(keptStage(sid));
    await a.close();

    const b = await startServer({ env: KEEP });
    t.after(() => b.close());
    const l = await call(b.client, 'list_sessions', {});
    const e = l.sessions.find((x) => x.session_id === sid);
    assert.deepEqual([e?.state, e?.on_store, e?.bytes, e?.hibernated_at, e?.carries], ['hibernated', true, h.bytes, h.hibernated_at, h.carries], JSON.stringify(l));
    assert.equal(l.hibernated_bytes, h.bytes);
    const r = await call(b.client, 'run', { session_id: sid, command: `cat /root/mark; ${ALIVE(secs)}` });
    assert.ok(Number.isInteger(r.resumed_ms), JSON.stringify(r));
    assert.equal(r.stdout, `kept\n${IS_VM ? 'alive' : 'gone'}\n`, 'vm: processes go on; ns: files only');
    const [host1, mid1] = (await sh(b.client, sid, IDENTITY)).trim().split('\n');
    assert.deepEqual([host1, mid1], [host0, mid0], 'the identity changed');
    // Its policy came with it.
    const log = await call(b.client, 'network_log', { session_id: sid });
    assert.equal(log.mode, 'allow', JSON.stringify(log));
    assert.deepEqual(log.allowed_rules, ['example.com', '*.example.org']);
    // The flight record goes on in the same file, after what came before.
    if (capture) {
      await run(b.client, sid, 'echo x | nc -w 2 10.1.2.3 2 >/dev/null 2>&1; true');
      const after = await call(b.client, 'network_log', { session_id: sid });
      assert.equal(after.egress_log_path ?? open.egress.egress_log_path, open.egress.egress_log_path);
      assert.ok(after.denied.some((d) => d.ip === '10.1.2.3' && d.port === 2), JSON.stringify(after.denied));
      // The record's writer puts the line in the file a moment after.
      const ports = () => fs.readFileSync(open.egress.egress_log_path, 'utf8').trimEnd().split('\n').map((x) => JSON.parse(x)).filter((x) => x.ip === '10.1.2.3').map((x) => x.port);
      await waitUntil(() => ports().length >= 2, { timeoutMs: 10000 });
      assert.deepEqual(ports(), [1, 2], fs.readFileSync(open.egress.egress_log_path, 'utf8'));
    }
    // Resumed: no longer on the store as hibernated; this server holds it.
    const rec2 = recordOf(sid);
    assert.equal(rec2.hibernated, null);
    assert.equal(rec2.meta.pid, b.pid);
    assert.equal(keptStage(sid), false);
    assert.equal((await call(b.client, 'list_sessions', {})).sessions.find((x) => x.session_id === sid).state, 'running');
    await call(b.client, 'close', { session_id: sid });
    assert.equal(recordOf(sid), null);
    assert.ok(await waitUntil(() => savedStates(b).length === 0, { timeoutMs: 10000 }));
  });

  test('a server told to stop hibernates its live sessions within IGN_MCP_SHUTDOWN_SECS; one still busy is closed and named; the next server resumes the others', T, async (t) => {
    const a = await startServer({ env: { ...KEEP, IGN_MCP_SHUTDOWN_SECS: 3 } });
    t.after(() => a.close());
    const [x, y, busy] = [await openSession(a.client), await openSession(a.client), await openSession(a.client)];
    await sh(a.client, x, 'echo x > /root/mark');
    await sh(a.client, y, 'echo y > /root/mark');
    // A call that outlasts the bound holds `busy` while stdin closes (the
    // server is left to exit by itself: the SDK's close would send SIGTERM
    // after 2 s and SIGKILL 2 s later).
    const held = a.client.callTool({ name: 'run', arguments: { session_id: busy, command: 'sleep 600' } }, undefined, { timeout: 120000 }).catch((err) => err);
    await sleep(500);
    a.transport._process.stdin.end();
    assert.ok(await gone(a.pid), 'the server did not exit within the bound');
    await held;
    await a.close();
    const err = a.stderrText();
    assert.match(err, /hibernating 3 session\(s\) before exiting \(IGN_MCP_SHUTDOWN_SECS=3\)/);
    assert.match(err, new RegExp(`session ${busy} is closed, not hibernated, as the server exits: (cannot hibernate session '${busy}': 1 call\\(s\\) still run in it|no time was left)`), err.slice(-3000));
    assert.match(err, /2 of 3 session\(s\) hibernated before exiting/);
    assert.match(err, /2 hibernated session\(s\) stay on the store/);
    assert.equal(recordOf(busy), null);

    const b = await startServer({ env: KEEP });
    t.after(() => b.close());
    assert.equal(await sh(b.client, x, 'cat /root/mark'), 'x\n');
    assert.equal(await sh(b.client, y, 'cat /root/mark'), 'y\n');
    assert.match(await callErr(b.client, 'run', { session_id: busy, command: 'true' }), /unknown session_id/);
    // b ends: x and y are hibernated again, for the next.
    b.transport._process.stdin.end();
    assert.ok(await gone(b.pid));
    await b.close();
    assert.ok(recordOf(x)?.hibernated && recordOf(y)?.hibernated, JSON.stringify([recordOf(x), recordOf(y)]));
    // IGN_MCP_SHUTDOWN_ACTION=close: they end with the server that has them.
    const c = await startServer({ env: { ...QUIET, IGN_MCP_SHUTDOWN_ACTION: 'close' } });
    t.after(() => c.close());
    assert.equal(await sh(c.client, x, 'cat /root/mark'), 'x\n');
    await c.close();
    assert.equal(recordOf(x), null, 'closed with its server');
    assert.equal(keptStage(x), false);
    assert.ok(recordOf(y)?.hibernated, 'one that server never took stays');
    // close removes one on the store without resuming it.
    const d = await startServer({ env: QUIET });
    t.after(() => d.close());
    assert.deepEqual(await call(d.client, 'close', { session_id: y }), { ok: true, session_id: y });
    assert.equal(recordOf(y), null);
    assert.equal(keptStage(y), false);
    await assert.rejects(startServer({ env: { IGN_MCP_SHUTDOWN_ACTION: 'nap' } }), /IGN_MCP_SHUTDOWN_ACTION=nap is invalid: use hibernate or close/);
  });

  test('a server killed with SIGKILL: what it had hibernated is resumed by the next; what ran is lost', T, async (t) => {
    const a = await startServer({ env: QUIET });
    t.after(() => a.close({ checkOrphans: false }));
    const [hib, live] = [await openSession(a.client), await openSession(a.client)];
    await sh(a.client, hib, 'echo saved > /root/mark');
    await call(a.client, 'hibernate', { session_id: hib });
    hardKill(a.pid);
    assert.ok(await gone(a.pid));
    const b = await startServer({ env: QUIET });
    t.after(() => b.close());
    let out;
    // The kernel drops the killed server's locks once its last thread is gone.
    assert.ok(await waitUntil(async () => {
      const res = await b.client.callTool({ name: 'run', arguments: { session_id: hib, command: 'cat /root/mark' } }, undefined, { timeout: 120000 });
      out = res.isError ? res.content?.[0]?.text : res.structuredContent.stdout;
      return !res.isError || !/held by another server/.test(out);
    }, { timeoutMs: 15000, intervalMs: 300 }));
    assert.equal(out, 'saved\n');
    assert.match(await callErr(b.client, 'run', { session_id: live, command: 'true' }), /was lost: its server/);
  });

  test('one hibernation is resumed by one server: of two racing for it, the other says where it went', T, async (t) => {
    const a = await startServer({ env: QUIET });
    t.after(() => a.close());
    const sid = await openSession(a.client);
    await sh(a.client, sid, 'echo once > /root/mark');
    await call(a.client, 'hibernate', { session_id: sid });
    hardKill(a.pid); // what it hibernated stays, whatever the shutdown action
    assert.ok(await gone(a.pid));
    const [b, c] = await Promise.all([startServer({ env: QUIET }), startServer({ env: QUIET })]);
    t.after(() => b.close());
    t.after(() => c.close());
    await sleep(300);
    const ask = (srv) => srv.client.callTool({ name: 'run', arguments: { session_id: sid, command: 'cat /root/mark' } }, undefined, { timeout: 120000 });
    const res = await Promise.all([ask(b), ask(c)]);
    const ok = res.filter((r) => !r.isError);
    assert.equal(ok.length, 1, JSON.stringify(res));
    assert.equal(ok[0].structuredContent.stdout, 'once\n');
    const other = res.find((r) => r.isError).content[0].text;
    const winner = res[0].isError ? c : b;
    assert.match(other, new RegExp(`^session '${sid}' (is held by another server on this store \\(pid ${winner.pid}\\)|is hibernated on this store and is being resumed by a server right now)`), other);
    if (IS_VM) assert.equal(guestQemus(res[0].isError ? b : c).length, 0, 'the loser started a sandbox');
  });

  test('a hibernation over other inputs (another agent) is refused before it starts and stays for a server that can; one kept past IGN_MCP_HIBERNATE_KEEP_SECS is removed', { ...T, skip: NS_ONLY('a vm base is rebuilt for new inputs; the refusal is the same code') }, async (t) => {
    const a = await startServer({ env: QUIET });
    t.after(() => a.close());
    const sid = await openSession(a.client);
    await sh(a.client, sid, 'echo inputs > /root/mark');
    await call(a.client, 'hibernate', { session_id: sid });
    hardKill(a.pid);
    assert.ok(await gone(a.pid));
    // Another agent: the same program with a byte more.
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-agent-'));
    t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
    const agent2 = path.join(dir, 'ign-agent');
    fs.writeFileSync(agent2, Buffer.concat([fs.readFileSync(AGENT), Buffer.from([0])]), { mode: 0o755 });
    fs.chmodSync(dir, 0o755);
    const b = await startServer({ env: { ...QUIET, IGN_MCP_AGENT: agent2 } });
    t.after(() => b.close());
    let e;
    assert.ok(await waitUntil(async () => !/held by another server/.test(e = await callErr(b.client, 'run', { session_id: sid, command: 'true' })), { timeoutMs: 15000, intervalMs: 300 }));
    assert.match(e, new RegExp(`^session '${sid}' was hibernated over other inputs than this server's \\(the kernel, QEMU, image or agent changed; base \\S+ now\\): it cannot resume safely and was not started`), e);
    assert.ok(recordOf(sid)?.hibernated && keptStage(sid), 'the refused hibernation left the store');
    await b.close();
    const c = await startServer({ env: QUIET });
    t.after(() => c.close());
    assert.equal(await sh(c.client, sid, 'cat /root/mark'), 'inputs\n');
    await call(c.client, 'hibernate', { session_id: sid });
    hardKill(c.pid);
    assert.ok(await gone(c.pid));
    await sleep(2100);
    const d = await startServer({ env: { ...QUIET, IGN_MCP_HIBERNATE_KEEP_SECS: 1 } });
    t.after(() => d.close());
    assert.match(d.stderrText(), new RegExp(`session ${sid} \\(hibernated\\) closed: kept 1 s`));
    assert.equal(recordOf(sid), null);
    assert.equal(keptStage(sid), false);
    assert.match(await callErr(d.client, 'run', { session_id: sid, command: 'true' }), /unknown session_id/);
  });

  test('IGN_MCP_HIBERNATE_MAX_MB counts the owner\'s hibernations on the store: the oldest there is closed to make room', { ...T, skip: NS_ONLY('vm hibernations are the guest RAM, tens of MiB each') }, async (t) => {
    const a = await startServer({ env: { ...KEEP, IGN_MCP_HIBERNATE_MAX_MB: 2 } });
    t.after(() => a.close());
    const old = await openSession(a.client);
    await sh(a.client, old, 'head -c 1200000 /dev/urandom > /root/blob');
    await call(a.client, 'hibernate', { session_id: old });
    await a.close();
    const b = await startServer({ env: { ...KEEP, IGN_MCP_HIBERNATE_MAX_MB: 2 } });
    t.after(() => b.close());
    // One refused (bigger than the cap alone) costs the stored ones nothing.
    const big = await openSession(b.client);
    await sh(b.client, big, 'head -c 3000000 /dev/urandom > /root/blob');
    assert.match(await callErr(b.client, 'hibernate', { session_id: big }), /more than IGN_MCP_HIBERNATE_MAX_MB \(2 MiB\) allows; it was not hibernated and goes on running/);
    assert.ok(recordOf(old)?.hibernated && keptStage(old), 'a refused hibernation closed a stored one');
    await call(b.client, 'close', { session_id: big });
    const nu = await openSession(b.client);
    await sh(b.client, nu, 'head -c 1200000 /dev/urandom > /root/blob');
    await call(b.client, 'hibernate', { session_id: nu });
    const l = await call(b.client, 'list_sessions', {});
    assert.deepEqual(l.sessions.filter((x) => x.state === 'hibernated').map((x) => x.session_id), [nu], JSON.stringify(l));
    assert.match(l.recently_closed.find((x) => x.session_id === old)?.why ?? '', /closed to make room for a newer hibernation \(IGN_MCP_HIBERNATE_MAX_MB=2\)/, JSON.stringify(l));
    assert.equal(recordOf(old), null);
    assert.equal(keptStage(old), false);
    await call(b.client, 'close', { session_id: nu });
  });

  test('a damaged record on the store is refused, and close removes it with its saved state; a kept stage no record names is removed by the next server', { ...T, skip: NS_ONLY('the records are the same on both backends') }, async (t) => {
    const a = await startServer({ env: QUIET });
    t.after(() => a.close({ checkOrphans: false }));
    const sid = await openSession(a.client);
    await call(a.client, 'hibernate', { session_id: sid });
    hardKill(a.pid);
    assert.ok(await gone(a.pid));
    const file = path.join(storeDir(), 'sessions', sid, 'hibernated.json');
    const rec = JSON.parse(fs.readFileSync(file, 'utf8'));
    fs.writeFileSync(file, JSON.stringify({ ...rec, id: 's1-ffff' }));
    // A kept stage that no record names (its server died between the two).
    const orphan = path.join(storeDir(), 'stages', '.hib-s4000000000-0000');
    fs.mkdirSync(orphan, { mode: 0o700 });
    fs.writeFileSync(path.join(orphan, 'ram'), 'x');
    const b = await startServer({ env: QUIET });
    t.after(() => b.close());
    assert.equal(fs.existsSync(orphan), false, 'the orphaned kept stage is still there');
    assert.ok(keptStage(sid), 'a damaged hibernation\'s stage went before its owner closed it');
    let e;
    await waitUntil(async () => !/held by another server/.test(e = await callErr(b.client, 'run', { session_id: sid, command: 'true' })), { timeoutMs: 15000, intervalMs: 300 });
    assert.match(e, new RegExp(`^session '${sid}' is hibernated, but its record on the store \\(.*\\) is damaged: it cannot be resumed\\. Close it\\.$`), e);
    assert.deepEqual(await call(b.client, 'close', { session_id: sid }), { ok: true, session_id: sid });
    assert.equal(recordOf(sid), null);
    assert.equal(keptStage(sid), false);
  });
});
