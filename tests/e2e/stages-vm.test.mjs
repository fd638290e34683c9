// stages-vm.test.mjs: the vm backend's snapshots (commit, fork) when the
// QEMUs around them fail, through the real server and SDK: the loader QEMU
// that receives a snapshot dies before or during the stream; the session
// being saved must run on, its error must say what failed (not that the
// session died), and no stage, loader RAM file or QEMU may be left over.
// Also: a stage's RAM file stays the server's and unchanged by the sessions
// started from it (QEMU 7.2 opens it read-write; share=off keeps their
// writes private).
//
// The file has a store of its own (IGN_MCP_STORE), so that the rows can look
// into it; the pool is off and one loader waits (IGN_MCP_POOL 0: only the
// snapshot's loader is pre-started).

import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import fs from 'node:fs';
import path from 'node:path';
import { startServer, call, callErr, openSession, sh, sleep, waitUntil, qemuChildren, tempStore, VM_ONLY } from './lib.mjs';

const T = { timeout: 300_000 };
const STORE = tempStore('e2e-stages-vm');
after(() => STORE.remove());
const ENV = { IGN_MCP_STORE: STORE.dir, IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 };

/* The loader QEMUs of server PID: started with -S (they never run a guest). */
const loaders = (pid) => qemuChildren(pid).filter((q) => / -S( |$)/.test(q.cmd));

/* Leftovers of snapshots in the store: stages being written, loader RAM
 * files. */
function storeLeftovers() {
  const top = fs.readdirSync(STORE.dir).filter((n) => n.startsWith('.loader-'));
  const sd = path.join(STORE.dir, 'stages');
  const st = fs.existsSync(sd) ? fs.readdirSync(sd).filter((n) => n.startsWith('.tmp-')) : [];
  return [...top, ...st];
}

/* The loaders' RAM files waiting in the store. */
const loaderFiles = () => fs.readdirSync(STORE.dir).filter((n) => n.startsWith('.loader-'));

/* A session with a background counter in its memory (/tmp/cnt, 10 a second). */
async function counting(c) {
  const id = await openSession(c);
  await sh(c, id, '(i=0; while true; do i=$((i+1)); echo $i > /tmp/cnt; sleep 0.1; done) >/dev/null 2>&1 &');
  return id;
}

/* The session's counter goes on: it is running, not stopped. */
async function assertRuns(c, id) {
  const a = Number(await sh(c, id, 'cat /tmp/cnt'));
  await sleep(600);
  const b = Number(await sh(c, id, 'cat /tmp/cnt'));
  assert.ok(b > a, `the source's counter stood still (${a} then ${b}): the source was left stopped`);
}

describe('vm stages: failing loaders', { skip: VM_ONLY('QEMU loaders'), ...T }, () => {
  test('a waiting loader that died: the next commit starts another and succeeds; the source runs on', T, async (t) => {
    const srv = await startServer({ env: ENV });
    t.after(() => srv.close());
    const c = srv.client;
    const id = await counting(c);
    await call(c, 'commit', { session_id: id, name: 'rev2/first' });
    // The pool starts the next waiting loader after a snapshot took one.
    assert.ok(await waitUntil(() => loaders(srv.pid).length === 1, { timeoutMs: 30000 }), 'no waiting loader');
    const [l] = loaders(srv.pid);
    process.kill(l.pid, 'SIGKILL');
    await waitUntil(() => !loaders(srv.pid).some((q) => q.pid === l.pid), { timeoutMs: 5000 });
    const r = await call(c, 'commit', { session_id: id, name: 'rev2/second' });
    assert.equal(r.carries, 'memory');
    await assertRuns(c, id);
    const s2 = await call(c, 'open_session', { stage: 'rev2/second' });
    assert.ok(Number(await sh(c, s2.session_id, 'cat /tmp/cnt')) > 0);
    await srv.close();
    assert.deepEqual(storeLeftovers(), [], 'snapshot files left in the store');
  });

  test('a loader killed during the stream: the commit fails saying so, the session is not called dead and runs on', T, async (t) => {
    const srv = await startServer({ env: ENV });
    t.after(() => srv.close());
    const c = srv.client;
    const id = await counting(c);
    // Enough memory in use that the stream lasts long enough to be cut.
    await sh(c, id, 'dd if=/dev/urandom of=/tmp/r bs=1M count=60 2>/dev/null');
    // A loader waits once a snapshot was made.
    await call(c, 'commit', { session_id: id, name: 'rev2/pre', replace: true });
    assert.ok(await waitUntil(() => loaders(srv.pid).length === 1, { timeoutMs: 30000 }), 'no waiting loader');
    const [l] = loaders(srv.pid);
    const [ram] = loaderFiles();
    const p = callErr(c, 'commit', { session_id: id, name: 'rev2/cut' });
    // Killed once the commit has taken it (its RAM file moves into the stage
    // being made, and the stream follows), not before: a loader killed
    // while it waits is only replaced.
    await waitUntil(() => !loaderFiles().includes(ram), { timeoutMs: 10000, intervalMs: 5 });
    process.kill(l.pid, 'SIGKILL');
    const err = await p;
    assert.match(err, /saving the session's VM failed/);
    assert.doesNotMatch(err, /is dead/, `the error calls the running session dead: ${err}`);
    await assertRuns(c, id);
    assert.deepEqual(storeLeftovers().filter((n) => n.startsWith('.tmp-')), [], 'a half stage was left');
    await callErr(c, 'stage_info', { name: 'rev2/cut' });
    // The next commit works (another loader).
    await call(c, 'commit', { session_id: id, name: 'rev2/cut' });
    await srv.close();
    assert.deepEqual(storeLeftovers(), [], 'snapshot files left in the store');
  });

  test('a loader that hangs during the stream: the source, stopped for it, runs again within seconds, not at the 60 s deadline', T, async (t) => {
    const srv = await startServer({ env: ENV });
    t.after(() => srv.close());
    const c = srv.client;
    const id = await counting(c);
    await sh(c, id, 'dd if=/dev/urandom of=/tmp/r bs=1M count=60 2>/dev/null');
    await call(c, 'commit', { session_id: id, name: 'rev2/pre', replace: true });
    assert.ok(await waitUntil(() => loaders(srv.pid).length === 1, { timeoutMs: 30000 }), 'no waiting loader');
    const [l] = loaders(srv.pid);
    const t0 = Date.now();
    const p = callErr(c, 'commit', { session_id: id, name: 'rev2/hung' });
    await sleep(150);
    process.kill(l.pid, 'SIGSTOP');
    const err = await p;
    const ms = Date.now() - t0;
    try {
      process.kill(l.pid, 'SIGCONT');
    } catch {}
    assert.match(err, /no progress/);
    assert.ok(ms < 20000, `the commit (and the stopped source) waited ${ms} ms for a hung loader`);
    await assertRuns(c, id);
    await srv.close();
    assert.deepEqual(storeLeftovers(), [], 'snapshot files left in the store');
  });

  test('the source QEMU killed during the stream: the commit says the session is dead; no half stage is left', T, async (t) => {
    const srv = await startServer({ env: ENV });
    t.after(() => srv.close());
    const c = srv.client;
    const id = await counting(c);
    await sh(c, id, 'dd if=/dev/urandom of=/tmp/r bs=1M count=60 2>/dev/null');
    await call(c, 'commit', { session_id: id, name: 'rev2/pre', replace: true });
    const src = qemuChildren(srv.pid).filter((q) => !/ -S( |$)/.test(q.cmd));
    assert.equal(src.length, 1, `one session QEMU expected: ${JSON.stringify(src)}`);
    const p = callErr(c, 'commit', { session_id: id, name: 'rev2/src-killed' });
    await sleep(150);
    process.kill(src[0].pid, 'SIGKILL');
    const err = await p;
    assert.match(err, /is dead/, `the error does not say the session died: ${err}`);
    await callErr(c, 'stage_info', { name: 'rev2/src-killed' });
    assert.deepEqual(storeLeftovers().filter((n) => n.startsWith('.tmp-')), [], 'a half stage was left');
    await srv.close();
    assert.deepEqual(storeLeftovers(), [], 'snapshot files left in the store');
  });

  test("a stage's RAM file: the server's, not world-readable, unchanged by sessions that write their memory", T, async (t) => {
    const srv = await startServer({ env: ENV });
    t.after(() => srv.close());
    const c = srv.client;
    const id = await openSession(c);
    await call(c, 'commit', { session_id: id, name: 'rev2/ram' });
    const ram = path.join(STORE.dir, 'stages', 'rev2+ram', 'ram');
    const st = fs.statSync(ram);
    assert.equal(st.uid, process.getuid(), 'the RAM file is not the server uid\'s');
    assert.equal(st.mode & 0o007, 0, `the RAM file is open to others: ${(st.mode & 0o777).toString(8)}`);
    const hash = () => crypto.createHash('sha256').update(fs.readFileSync(ram)).digest('hex');
    const h0 = hash();
    const s2 = await call(c, 'open_session', { stage: 'rev2/ram' });
    await sh(c, s2.session_id, 'dd if=/dev/urandom of=/tmp/x bs=1M count=60 2>/dev/null; dd if=/dev/urandom of=/dev/shm/y bs=1M count=30 2>/dev/null; sync');
    await call(c, 'close', { session_id: s2.session_id });
    assert.equal(hash(), h0, 'a session from the stage changed its RAM file');
  });
});
