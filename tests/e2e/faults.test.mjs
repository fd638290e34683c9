// faults.test.mjs: faults of the parts around a session (issue #5, item 4),
// each one a clear error and then a recovery:
//
// | fault                                   | backend | error seen                                | recovery                  |
// |-----------------------------------------|---------|-------------------------------------------|---------------------------|
// | QEMU killed mid-run                     | vm      | the run fails: session '<id>' is dead      | reset                     |
// | the agent dies (SIGKILL from the host)  | ns      | session '<id>' is dead (killed by signal 9) | reset                    |
// | SIGSEGV to the agent from the host      | ns      | none: ignored (PID 1 of its pid namespace, no handler) | -             |
// | the guest kernel panics (its PID 1 dies) | vm      | session '<id>' is dead (the guest kernel panicked ...) | reset       |
// | signals to PID 1 from inside            | both    | none: ignored, the session lives on        | -                         |
// | the warm base truncated or with flipped bytes (state, RAM) | vm | logged: "is damaged" naming the file | made again; open_session works |
// | the warm base moved away under a running server | vm | none: logged "is gone"               | made again by the next clone |
// | the warm base with a file missing (RAM, state) | vm | none: logged "has files missing" / "is gone" | set aside, made again |
// | the store's filesystem full             | vm      | open_session: "the store <path> is full"   | free space, open again    |
// | the guest cannot boot (not a kernel)     | vm      | open_session: the cause; again at once, "not tried again yet" (no new boot) | change the images (or wait 60 s), open again |
// | the images change to ones that cannot boot, under a running server | vm | open_session: the cause, then "not tried again yet"; the pool does not retry either | change the images (or wait 60 s), open again |
// | the server SIGKILLed with sessions running | both | -                                         | no process outlives it; the next server removes its cgroups and state directories |
// (a full overlay is the abuse table's: abuse.test.mjs)
//
// These servers run without the fence of abuse.test.mjs on purpose: its pid
// namespace would kill whatever a dead server leaves, and hide exactly the
// orphans the last row looks for.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import {
  startServer, startRaw, call, callErr, openSession, run, sh, sleep, waitUntil, uniqueSleepSecs,
  findProcs, descendants, qemuChildren, qemusOf, vmStateDirs, isAlive, tempStore, tempKernel, hardKill,
  leftovers, newLeftovers, textOf, IS_NS, IS_VM, NS_ONLY, VM_ONLY, VM_DIR, SESSION_CGROUPS,
} from './lib.mjs';

const T = { timeout: 180_000 };
const NO_POOL = { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 };

/* A store of the test's own holding a warm base that a first server made
 * (and then stopped); env points a server at it, with no pool. */
async function storeWithBase(t) {
  const store = tempStore();
  t.after(() => store.remove());
  const env = { ...NO_POOL, IGN_MCP_STORE: store.dir };
  const s0 = await startServer({ env });
  await openSession(s0.client);
  await s0.close();
  return { store, env };
}

/* The session dies under a call in flight: that call and the next fail
 * naming the session as dead; reset brings it back. Returns the texts. */
async function assertDeadThenReset(c, sid, inflight, { within = 10000, t0 }) {
  const r = await inflight;
  const took = Date.now() - t0;
  assert.ok(took < within, `the in-flight run ended ${took} ms after the fault`);
  assert.equal(r.isError, true, `the run did not fail: ${JSON.stringify(r).slice(0, 300)}`);
  const text = textOf(r);
  assert.ok(text.includes(sid), text);
  assert.match(text, /dead/, text);
  const e = await callErr(c, 'run', { session_id: sid, command: 'true' });
  assert.ok(e.includes(sid), e);
  assert.match(e, /dead/, e);
  assert.match(e, /reset/, e);
  const rr = await call(c, 'reset', { session_id: sid });
  assert.equal(rr.session_id, sid);
  assert.equal(await sh(c, sid, 'echo back'), 'back\n');
  return { text, next: e, took };
}

describe('a session\'s sandbox dies', () => {
  test('kill -9 of the QEMU mid-run: the call fails naming the session as dead; reset brings it back', { ...T, skip: VM_ONLY('QEMU') }, async (t) => {
    const s = await startServer({ env: NO_POOL });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    const [q] = qemuChildren(s.pid);
    assert.ok(q, 'no QEMU for the session');
    const inflight = c.callTool({ name: 'run', arguments: { session_id: sid, command: 'sleep 30; echo finished' } }, undefined, { timeout: 60000 });
    await sleep(1000);
    const t0 = Date.now();
    process.kill(q.pid, 'SIGKILL');
    const d = await assertDeadThenReset(c, sid, inflight, { t0 });
    assert.match(d.text, /killed by signal 9/, d.text);
    const [q2] = qemuChildren(s.pid);
    assert.ok(q2 && q2.pid !== q.pid, 'reset did not start a new QEMU');
    t.diagnostic(`QEMU SIGKILLed: the run failed ${d.took} ms later: ${d.text.slice(0, 160)}`);
  });

  test('the agent dies (SIGKILL from the host; SIGSEGV does not reach it): a clear error, reset recovers', { ...T, skip: NS_ONLY('the ns agent is a host process; the vm variant is the guest panic below') }, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    // The only session: the only agent (PID 1 of its sandbox) under the server.
    const agents = descendants(s.pid).filter((d) => /^\S*ign-agent\b/.test(d.cmd ?? ''));
    assert.equal(agents.length, 1, `agents under the server: ${JSON.stringify(descendants(s.pid))}`);
    const [agent] = agents;
    // PID 1 of a pid namespace gets from outside only the signals it handles,
    // and SIGKILL: a SIGSEGV sent from the host is dropped (a real crash is
    // the kernel's own SIGSEGV, which is forced; SIGKILL stands in for it).
    process.kill(agent.pid, 'SIGSEGV');
    await sleep(300);
    assert.ok(isAlive(agent), 'the agent died of a SIGSEGV sent from the host');
    assert.equal(await sh(c, sid, 'echo still'), 'still\n');
    const inflight = c.callTool({ name: 'run', arguments: { session_id: sid, command: 'sleep 30; echo finished' } }, undefined, { timeout: 60000 });
    await sleep(500);
    const t0 = Date.now();
    process.kill(agent.pid, 'SIGKILL');
    const d = await assertDeadThenReset(c, sid, inflight, { t0 });
    assert.match(d.next, /killed by signal 9/, d.next);
    assert.ok(await waitUntil(() => !isAlive(agent)), 'the killed agent is still there');
    t.diagnostic(`agent: SIGSEGV from the host ignored; SIGKILL: the run failed ${d.took} ms later; next call: ${d.next.slice(0, 200)}`);
  });

  test('the guest kernel panics (as when its PID 1, the agent, dies): QEMU exits, a clear error, reset recovers', { ...T, skip: VM_ONLY('a guest kernel') }, async (t) => {
    const s = await startServer({ env: NO_POOL });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    const [q] = qemuChildren(s.pid);
    const t0 = Date.now();
    const inflight = c.callTool({ name: 'run', arguments: { session_id: sid, command: 'echo c > /proc/sysrq-trigger; sleep 30; echo survived' } }, undefined, { timeout: 60000 });
    const d = await assertDeadThenReset(c, sid, inflight, { t0 });
    assert.match(d.text, /the guest kernel panicked \(Kernel panic - not syncing: sysrq triggered crash\) and its QEMU exited/, d.text);
    assert.ok(await waitUntil(() => !isAlive(q)), 'the panicked guest\'s QEMU is still running');
    t.diagnostic(`guest kernel panic: the run failed ${d.took} ms later: ${d.text.slice(0, 200)}`);
  });

  test('signals to PID 1 from inside the sandbox are ignored: the session lives on', T, async (t) => {
    const s = await startServer({ env: IS_VM ? NO_POOL : {} });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    const r = await run(s.client, sid, 'kill -SEGV 1; kill -TERM 1; kill -KILL 1; sleep 0.3; echo alive');
    assert.equal(r.stdout, 'alive\n');
    assert.match(await sh(s.client, sid, 'cat /proc/1/comm'), /ign|agent|init/);
    t.diagnostic('kill -SEGV/-TERM/-KILL 1 inside: ignored (PID 1 of its namespace or guest)');
  });
});

/* The one base in a store, its directory. */
function soleBase(store) {
  const b = fs.readdirSync(store).filter((n) => /^small-base-[0-9a-f]{16}$/.test(n));
  assert.equal(b.length, 1, `bases in ${store}: ${fs.readdirSync(store)}`);
  return path.join(store, b[0]);
}

describe('the warm base is damaged', () => {
  const corruptions = [
    ['the state file truncated', (dir) => fs.truncateSync(path.join(dir, 'state'), 1000), /state is 1000 bytes instead of/],
    ['the RAM file truncated', (dir) => fs.truncateSync(path.join(dir, 'ram'), 64 << 20), /ram is 67108864 bytes instead of/],
    ['a byte flipped in the state file', (dir) => flip(path.join(dir, 'state'), 30000), /state does not match its checksum/],
    ['a byte flipped in the RAM file', (dir) => flip(path.join(dir, 'ram'), 100 << 20), /ram does not match its checksum/],
  ];
  function flip(file, at) {
    const fd = fs.openSync(file, 'r+');
    const b = Buffer.alloc(1);
    fs.readSync(fd, b, 0, 1, at);
    b[0] ^= 0xff;
    fs.writeSync(fd, b, 0, 1, at);
    fs.closeSync(fd);
  }

  test('each damage is detected by the checksum, the base is made again, and open_session works', { ...T, timeout: 400_000, skip: VM_ONLY('warm bases') }, async (t) => {
    // A base, made by a first server; a second one checks it (the cost).
    const { store, env } = await storeWithBase(t);
    const s1 = await startServer({ env });
    const o1 = await call(s1.client, 'open_session', {});
    await s1.close();
    assert.equal(o1.path, 'restore');
    const checked = s1.stderrText().match(/warm base \S+ checked in (\d+) ms/);
    assert.ok(checked, `the intact base was not checked: ${s1.stderrText().slice(-1500)}`);
    const meta = fs.readFileSync(path.join(soleBase(store.dir), 'meta'), 'utf8');
    assert.match(meta, /^xxh3 ram 268435456 [0-9a-f]{16}$/m);
    assert.match(meta, /^xxh3 state \d+ [0-9a-f]{16}$/m);
    const figures = [`checking an intact base: ${checked[1]} ms`];
    for (const [what, damage, said] of corruptions) {
      const dir = soleBase(store.dir);
      damage(dir);
      const s = await startServer({ env });
      const t0 = Date.now();
      const o = await s.client.callTool({ name: 'open_session', arguments: {} }, undefined, { timeout: 150000 });
      const took = Date.now() - t0;
      const err = s.stderrText();
      assert.notEqual(o.isError, true, `${what}: open_session failed: ${textOf(o)}`);
      assert.match(err, /the warm base \S+ is damaged: /, `${what}: not detected; stderr: ${err.slice(-1500)}`);
      assert.match(err, said, `${what}: ${err.slice(-1500)}`);
      assert.equal(await sh(s.client, o.structuredContent.session_id, 'echo ok'), 'ok\n');
      await s.close();
      // The new base is whole, and the damaged one is gone.
      assert.deepEqual(fs.readdirSync(store.dir).filter((n) => /damaged|\.tmp-/.test(n)), [], `${what}: leftovers in the store`);
      figures.push(`${what}: detected, base made again, open_session ${took} ms`);
    }
    t.diagnostic(figures.join('; '));
  });
});

describe('the warm base goes away under a running server', () => {
  test('moved aside (as another server does with a base it finds damaged): the next clone makes it again instead of failing', { ...T, skip: VM_ONLY('warm bases') }, async (t) => {
    const store = tempStore();
    t.after(() => store.remove());
    const s = await startServer({ env: { ...NO_POOL, IGN_MCP_STORE: store.dir } });
    t.after(() => s.close());
    await openSession(s.client);
    const dir = soleBase(store.dir);
    fs.renameSync(dir, `${dir}.damaged-1`);
    const o = await call(s.client, 'open_session', {});
    assert.equal(await sh(s.client, o.session_id, 'echo ok'), 'ok\n');
    assert.match(s.stderrText(), /the warm base \S+ is gone; checking or making it again/);
    for (const f of ['ram', 'state', 'meta']) assert.ok(fs.existsSync(path.join(dir, f)), `${f} missing in the base made again`);
  });
});

describe('the warm base has files missing', () => {
  test('its RAM file deleted before a server starts, its state file under a running one: each time the base is made again and open_session works', { ...T, skip: VM_ONLY('warm bases') }, async (t) => {
    const { store, env } = await storeWithBase(t);
    const dir = soleBase(store.dir);
    // What is left (the meta, golden-boot.log) must not stay in the new base's way.
    fs.rmSync(path.join(dir, 'ram'));
    const s = await startServer({ env });
    t.after(() => s.close());
    const o1 = await call(s.client, 'open_session', {});
    assert.equal(await sh(s.client, o1.session_id, 'echo ok'), 'ok\n');
    assert.match(s.stderrText(), /the warm base \S+ has files missing; making it again/);
    fs.rmSync(path.join(dir, 'state'));
    const o2 = await call(s.client, 'open_session', {});
    assert.equal(await sh(s.client, o2.session_id, 'echo ok'), 'ok\n');
    assert.match(s.stderrText(), /the warm base \S+ is gone; checking or making it again/);
    for (const f of ['ram', 'state', 'meta']) assert.ok(fs.existsSync(path.join(dir, f)), `${f} missing in the base made again`);
    await s.close();
    assert.deepEqual(fs.readdirSync(store.dir).filter((n) => /damaged|\.tmp-/.test(n)), [], 'leftovers in the store');
  });
});

describe('the store is full', () => {
  test('a store on a full filesystem: open_session says so and where; after it grows, a retry works', {
    ...T,
    skip: VM_ONLY('the store of warm bases') ||
      (process.getuid() !== 0 && 'root only: the full filesystem is a small tmpfs this test mounts (and grows), which needs root'),
  }, async (t) => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-full-store-'));
    fs.chmodSync(dir, 0o755);
    execFileSync('mount', ['-t', 'tmpfs', '-o', 'size=8m,mode=0755', 'e2e-full-store', dir]);
    t.after(() => {
      try {
        execFileSync('umount', ['-l', dir]);
      } catch {}
      fs.rmSync(dir, { recursive: true, force: true });
    });
    const s = await startServer({ env: { ...NO_POOL, IGN_MCP_STORE: dir } });
    t.after(() => s.close());
    const t0 = Date.now();
    const e = await callErr(s.client, 'open_session', {});
    const took = Date.now() - t0;
    assert.match(e, /is full/, e);
    assert.ok(e.includes(dir), `the error does not say where: ${e}`);
    assert.match(e, /IGN_MCP_STORE/, e);
    assert.ok(took < 30000, `the error took ${took} ms`);
    // A full store is the store's fault: under KVM it must not mark KVM unusable.
    assert.equal(fs.existsSync(path.join(dir, 'kvm-unusable')), false, 'a full store marked KVM unusable');
    // The same server, once the filesystem is larger.
    execFileSync('mount', ['-o', 'remount,size=600m', dir]);
    const t1 = Date.now();
    const o = await call(s.client, 'open_session', {});
    const took2 = Date.now() - t1;
    assert.equal(await sh(s.client, o.session_id, 'echo ok'), 'ok\n');
    t.diagnostic(`store full (8 MiB tmpfs): error after ${took} ms: ${e.slice(0, 240)}; after growing it, open_session made the base and opened in ${took2} ms`);
  });
});

describe('QEMU cannot be started', () => {
  test('a QEMU binary that cannot be executed: open_session says which step failed and why, not just "no QMP greeting"', { ...T, skip: VM_ONLY('QEMU') }, async (t) => {
    // An executable file whose interpreter does not exist: it passes the
    // server's check (it is executable) and fails at execve in the child,
    // after every confinement step, as a step of the spawn would.
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-bad-qemu-'));
    fs.chmodSync(dir, 0o755);
    t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
    const qemu = path.join(dir, 'qemu-system-x86_64');
    fs.writeFileSync(qemu, '#!/nonexistent/interpreter\n', { mode: 0o755 });
    const store = tempStore();
    t.after(() => store.remove());
    const s = await startServer({ env: { ...NO_POOL, IGN_MCP_QEMU: qemu, IGN_MCP_STORE: store.dir } });
    t.after(() => s.close());
    const e = await callErr(s.client, 'open_session', {});
    assert.ok(e.includes(`ignition-mcp: cannot execute QEMU ${qemu}: errno 2 (ENOENT)`), e);
  });
});

describe('the guest cannot boot', () => {
  test('a warm base that fails for the guest\'s reason is not made again on every open_session; changed images are tried at once', { ...T, skip: VM_ONLY('warm bases') }, async (t) => {
    const store = tempStore();
    t.after(() => store.remove());
    // Not a kernel: QEMU refuses it at once (no minutes of a cold boot per try).
    const kernel = tempKernel(t, Buffer.alloc(64 << 10));
    const s = await startServer({ env: { ...NO_POOL, IGN_MCP_STORE: store.dir, IGN_MCP_KERNEL: kernel } });
    t.after(() => s.close());
    const tries = () => (s.stderrText().match(/trying again to make the warm base/g) ?? []).length;
    const e1 = await callErr(s.client, 'open_session', {});
    assert.match(e1, /cannot start sessions: .*warm base|QEMU/, e1);
    // Nothing has changed: the same cause at once, saying when it is tried again.
    const t0 = Date.now();
    const e2 = await callErr(s.client, 'open_session', {});
    const took = Date.now() - t0;
    assert.match(e2, /not tried again yet/, e2);
    assert.match(e2, /once the VM images change/, e2);
    assert.ok(took < 5000, `the cached error took ${took} ms`);
    assert.equal(tries(), 0, `a new try without a change: ${s.stderrText().slice(-1500)}`);
    // The kernel changes (its mtime is in the base's fingerprint): tried again at once.
    const st = fs.statSync(kernel);
    fs.utimesSync(kernel, st.atime, new Date(st.mtimeMs + 60_000));
    const e3 = await callErr(s.client, 'open_session', {});
    assert.equal(tries(), 1, `the changed kernel was not tried: ${e3}`);
    assert.doesNotMatch(e3, /not tried again yet/, e3);
    const e4 = await callErr(s.client, 'open_session', {});
    assert.match(e4, /not tried again yet/, e4);
    assert.equal(tries(), 1);
    // The guest's failure under TCG says nothing about KVM.
    assert.equal(fs.existsSync(path.join(store.dir, 'kvm-unusable')), false);
    t.diagnostic(`a guest that cannot boot: the repeated open_session answered in ${took} ms without a new try: ${e2.slice(0, 300)}`);
  });
});

describe('the VM images change under a running server to ones that cannot boot', () => {
  test('the new base is tried once, not again by the pool or by every open_session, until the images change again', { ...T, skip: VM_ONLY('warm bases') }, async (t) => {
    const store = tempStore();
    t.after(() => store.remove());
    const kernel = tempKernel(t);
    const s = await startServer({ env: { IGN_MCP_POOL: 1, IGN_MCP_SPARES: 0, IGN_MCP_STORE: store.dir, IGN_MCP_KERNEL: kernel } });
    t.after(() => s.close());
    const tries = () => (s.stderrText().match(/the VM images changed; making a new warm base/g) ?? []).length;
    await openSession(s.client);
    assert.ok(await waitUntil(() => qemuChildren(s.pid).length >= 2, { timeoutMs: 30000 }), 'the pool did not fill');
    // Files are replaced whole (written aside, then renamed), as an install
    // does: a server that looked while a copy was half written would see
    // images changing twice.
    const replace = (write) => {
      write(`${kernel}.new`);
      fs.renameSync(`${kernel}.new`, kernel);
    };
    // Not a kernel (QEMU refuses it at once); its new size and mtime are a new fingerprint.
    replace((f) => fs.writeFileSync(f, Buffer.alloc(64 << 10)));
    // Taking the pool's clone wakes the pool, which finds the images changed
    // (or, when the clone is not ready yet, this call does).
    await s.client.callTool({ name: 'open_session', arguments: {} }, undefined, { timeout: 60000 });
    assert.ok(await waitUntil(() => tries() >= 1, { timeoutMs: 30000 }), 'the pool did not try the new images');
    // Nothing changes: the pool does not try again (it used to every 5 s) ...
    await sleep(7000);
    assert.equal(tries(), 1, `the pool tried again without a change: ${s.stderrText().slice(-1500)}`);
    // ... and neither does an open_session, which gets the last failure at
    // once (after any clone the pool had made before the change).
    let e, took;
    for (let i = 0; i < 3 && e === undefined; i++) {
      const t0 = Date.now();
      const r = await s.client.callTool({ name: 'open_session', arguments: {} }, undefined, { timeout: 60000 });
      took = Date.now() - t0;
      if (r.isError) e = textOf(r);
    }
    assert.ok(e !== undefined, 'open_session kept working with images that cannot boot');
    assert.match(e, /not tried again yet/, e);
    assert.ok(took < 5000, `the cached error took ${took} ms`);
    assert.equal(tries(), 1);
    // The images change again (a working kernel): the next open_session tries at once.
    replace((f) => fs.copyFileSync(path.join(VM_DIR, 'vmlinux'), f));
    const o = await call(s.client, 'open_session', {});
    assert.equal(await sh(s.client, o.session_id, 'echo ok'), 'ok\n');
    assert.equal(tries(), 2, s.stderrText().slice(-1500));
    t.diagnostic(`a rebuild that fails: tried once, then the cached error in ${took} ms: ${e.slice(0, 240)}`);
  });
});

describe('the server is SIGKILLed with sessions running', () => {
  test('nothing outlives it; the next server removes what it left (cgroups, state directories)', T, async (t) => {
    const before = leftovers();
    const raw = startRaw();
    t.after(() => hardKill(raw.pid));
    await raw.initialize();
    const marks = [];
    for (let i = 0; i < 2; i++) {
      const o = await raw.tool('open_session', {});
      const n = uniqueSleepSecs();
      marks.push(n);
      await raw.tool('run', { session_id: o.session_id, command: `sleep ${n} > /dev/null 2>&1 & (trap '' TERM HUP; sleep ${n + 1}) > /dev/null 2>&1 & echo ok` });
    }
    const sid = (await raw.tool('list_sessions', {})).sessions[0].session_id;
    await raw.send({ jsonrpc: '2.0', id: 'inflight', method: 'tools/call', params: { name: 'run', arguments: { session_id: sid, command: 'sleep 60' } } });
    await sleep(IS_VM ? 3000 : 500); // vm: let the pool fill too
    const kids = descendants(raw.pid);
    const qemus = IS_VM ? qemuChildren(raw.pid) : [];
    const cgroups = newLeftovers(before).cgroups;
    const dirs = IS_VM ? vmStateDirs(raw.pid) : [];
    if (IS_NS) {
      assert.ok(marks.every((n) => findProcs(['sleep', String(n)]).length === 1), 'the sessions\' sleeps are not running');
      // A user without delegated cgroups: sessions have none.
      if (SESSION_CGROUPS) assert.ok(cgroups.length >= 2, `the sessions' cgroups are not seen: ${JSON.stringify(cgroups)}`);
    } else {
      assert.ok(qemus.length >= 2 && dirs.length >= 2, `QEMUs ${qemus.length}, state directories ${dirs.length}`);
    }
    process.kill(raw.pid, 'SIGKILL');
    const ex = await raw.waitExit(5000);
    assert.equal(ex?.signal, 'SIGKILL');
    const t0 = Date.now();
    const gone = await waitUntil(() => kids.every((k) => !isAlive(k)) && qemusOf(raw.pid).length === 0 &&
      marks.every((n) => findProcs(['sleep', String(n)]).length + findProcs(['sleep', String(n + 1)]).length === 0), { timeoutMs: 5000 });
    const orphans = kids.filter(isAlive).map((k) => `${k.pid} ${k.cmd}`);
    for (const k of kids) hardKill(k.pid);
    assert.ok(gone, `processes outlived the SIGKILLed server: ${JSON.stringify(orphans)}`);
    const tookGone = Date.now() - t0;
    assert.deepEqual(newLeftovers(before).tmp, [], 'temporary files left');
    // What only the next server can remove.
    const leftCg = cgroups.filter((d) => fs.existsSync(d));
    const leftDirs = dirs.filter((d) => fs.existsSync(d));
    const next = startRaw(IS_VM ? { env: NO_POOL } : {});
    t.after(() => next.close());
    await next.initialize();
    const o = await next.tool('open_session', {});
    assert.equal((await next.tool('run', { session_id: o.session_id, command: 'echo ok' })).stdout, 'ok\n');
    await next.tool('close', { session_id: o.session_id });
    const clean = await waitUntil(() => cgroups.every((d) => !fs.existsSync(d)) && dirs.every((d) => !fs.existsSync(d)), { timeoutMs: 5000 });
    assert.ok(clean, `the next server left the dead one's cgroups ${JSON.stringify(cgroups.filter((d) => fs.existsSync(d)))} and state directories ${JSON.stringify(dirs.filter((d) => fs.existsSync(d)))}`);
    t.diagnostic(`server SIGKILL: ${kids.length} processes (${qemus.length} QEMUs) gone within ${tookGone} ms; left for the next server: ${leftCg.length} cgroups, ${leftDirs.length} state directories, all removed by it`);
  });
});
