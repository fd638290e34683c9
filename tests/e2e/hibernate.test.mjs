// hibernate.test.mjs: hibernate and resume within a server: a hibernated
// session keeps its id and costs disk only; the next call that names it
// resumes it (vm: with its processes; ns: with its files); close and reset
// of a hibernated session; the idle reaper hibernates, and closes what was
// kept IGN_MCP_HIBERNATE_KEEP_SECS; IGN_MCP_HIBERNATE_MAX_MB makes room by
// closing the owner's oldest, and refuses one that cannot fit.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import {
  startServer, call, callErr, openSession, sh, sleep, waitUntil, uniqueSleepSecs, findProcs,
  IS_VM, IS_NS, NS_ONLY, qemuChildren, serverEnv,
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

/* The server's hibernations on its store: the anonymous stages it made. */
function anonStages(s) {
  return fs.readdirSync(path.join(storeDir(), 'stages')).filter((n) => n.startsWith(`.anon-${s.pid}-`));
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
    assert.equal(anonStages(s).length, 1, 'no saved state on the store');
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
    assert.ok(await waitUntil(() => anonStages(s).length <= 1, { timeoutMs: 10000 }), `saved states left: ${anonStages(s)}`);
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
    assert.equal(anonStages(s).length, 2);
    assert.deepEqual(await call(c, 'close', { session_id: a }), { ok: true, session_id: a });
    if (IS_VM) assert.equal(guestQemus(s).length, 0, 'close resumed the session');
    assert.ok(await waitUntil(() => anonStages(s).length === 1, { timeoutMs: 10000 }), 'the closed session\'s saved state is still on the store');
    assert.match(await callErr(c, 'run', { session_id: a, command: 'true' }), /unknown session_id/);
    const r = await call(c, 'reset', { session_id: b });
    assert.equal(r.session_id, b);
    assert.equal(await sh(c, b, 'cat /root/mark 2>&1 || echo none'), 'cat: can\'t open \'/root/mark\': No such file or directory\nnone\n');
    assert.ok(await waitUntil(() => anonStages(s).length === 0, { timeoutMs: 10000 }));
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
    assert.ok(await waitUntil(() => anonStages(s).length === 0, { timeoutMs: 10000 }));
  });

  test('an idle session that cannot be hibernated is closed, and the log says why', T, async (t) => {
    // 1 MiB: a vm guest's RAM never fits; an ns session with 2 MB of files neither.
    const s = await startServer({ env: { ...QUIET, IGN_MCP_IDLE_SECS: 2, IGN_MCP_HIBERNATE_MAX_MB: 1 } });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    await sh(c, sid, 'head -c 2000000 /dev/urandom > /root/blob');
    assert.ok(await waitUntil(async () => (await call(c, 'list_sessions', {})).sessions.length === 0, { timeoutMs: 60000, intervalMs: 500 }), 'the idle session that cannot be hibernated was never closed');
    assert.match(s.stderrText(), new RegExp(`session ${sid} reaped after 2 s idle: it could not be hibernated: session '${sid}' takes \\d+ bytes hibernated, more than IGN_MCP_HIBERNATE_MAX_MB \\(1 MiB\\)`));
    assert.match(await callErr(c, 'run', { session_id: sid, command: 'true' }), /unknown session_id/);
    assert.ok(await waitUntil(() => anonStages(s).length === 0, { timeoutMs: 10000 }), 'its refused saved state is still on the store');
    if (IS_VM) assert.equal(guestQemus(s).length, 0);
  });

  test('at most 8 x IGN_MCP_MAX_SESSIONS hibernated sessions: past it the server\'s oldest is closed', { ...T, skip: NS_ONLY('nine hibernations are quick on ns') }, async (t) => {
    const s = await startServer({ env: { ...QUIET, IGN_MCP_MAX_SESSIONS: 1 } });
    t.after(() => s.close());
    const c = s.client;
    const ids = [];
    for (let i = 0; i < 9; i++) {
      const sid = await openSession(c);
      ids.push(sid);
      await call(c, 'hibernate', { session_id: sid });
    }
    const l = await call(c, 'list_sessions', {});
    assert.deepEqual(l.sessions.map((x) => x.session_id).sort(), ids.slice(1).sort());
    assert.match(l.recently_closed.find((x) => x.session_id === ids[0])?.why ?? '', /^closed to make room for a newer hibernation \(this server holds at most 8 hibernated sessions, 8 x IGN_MCP_MAX_SESSIONS; the oldest goes first\)$/, JSON.stringify(l));
  });

  test('IGN_MCP_IDLE_ACTION=close closes idle sessions as before; an invalid action stops the server', T, async (t) => {
    const s = await startServer({ env: { ...QUIET, IGN_MCP_IDLE_SECS: 2, IGN_MCP_IDLE_ACTION: 'close' } });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    assert.ok(await waitUntil(async () => (await call(s.client, 'list_sessions', {})).sessions.length === 0, { timeoutMs: 60000, intervalMs: 500 }));
    assert.match(await callErr(s.client, 'run', { session_id: sid, command: 'true' }), /unknown session_id/);
    assert.equal(anonStages(s).length, 0);
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
