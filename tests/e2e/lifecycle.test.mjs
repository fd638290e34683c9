// lifecycle.test.mjs: how the server ends: stdin EOF, SIGTERM, SIGINT,
// SIGKILL; nothing may outlive it (processes, /tmp entries, cgroups; on the
// vm backend its QEMUs and their state directories; vm.test.mjs has more).

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import {
  startRaw, descendants, survivors, waitGone, findProcs, uniqueSleepSecs, waitUntil,
  leftovers, newLeftovers, hardKill, IS_NS, IS_VM, NS_ONLY, sleep, assertNoVmLeftovers, qemuChildren,
  vmStateDirs, SESSION_CGROUPS,
} from './lib.mjs';

const T = { timeout: 90_000 };

/* Start a server with two sessions, each running a background sleep with a
 * recognisable argument and a foreground run still in flight. */
async function busyServer() {
  const raw = startRaw();
  try {
    return await fillServer(raw);
  } catch (e) {
    hardKill(raw.pid);
    throw e;
  }
}

async function fillServer(raw) {
  await raw.initialize();
  const marks = [];
  for (let i = 0; i < 2; i++) {
    const o = await raw.tool('open_session', {});
    const n = uniqueSleepSecs();
    marks.push(n);
    const r = await raw.tool('run', { session_id: o.session_id, command: `sleep ${n} > /dev/null 2>&1 & echo ok` });
    assert.equal(r.stdout, 'ok\n');
  }
  const sid = (await raw.tool('list_sessions', {})).sessions[0].session_id;
  // A process that ignores SIGTERM and SIGHUP must go too.
  const stubborn = uniqueSleepSecs();
  marks.push(stubborn);
  await raw.tool('run', { session_id: sid, command: `(trap '' TERM HUP INT; sleep ${stubborn}) > /dev/null 2>&1 & echo ok` });
  // A run in flight: shutdown must not wait for it.
  await raw.send({ jsonrpc: '2.0', id: 'inflight', method: 'tools/call', params: { name: 'run', arguments: { session_id: sid, command: 'sleep 60' } } });
  if (IS_NS) {
    assert.ok(await waitUntil(() => marks.every((n) => findProcs(['sleep', String(n)]).length === 1), { timeoutMs: 5000 }), 'background sleeps not visible');
  }
  await sleep(300);
  const kids = descendants(raw.pid);
  if (IS_NS) assert.ok(kids.length >= 2, `expected sandbox processes under the server, got ${JSON.stringify(kids)}`);
  return { raw, marks, kids };
}

/* The leftover checks below look for cgroups named ign*: make sure they are
 * not blind, i.e. that a running session's cgroups are seen. */
function assertCgroupsVisible(before) {
  // A user without delegated cgroups: sessions have none (their limits say so).
  if (!IS_NS || !SESSION_CGROUPS) return;
  const now = newLeftovers(before);
  assert.ok(now.cgroups.length > 0, 'no ign* cgroup found under /sys/fs/cgroup while sessions run: the limits are not applied, or the leftover check is blind');
}

async function assertAllGone({ raw, marks, kids }, what) {
  const left = await waitGone(kids, 5000);
  const marked = marks.flatMap((n) => findProcs(['sleep', String(n)]));
  for (const l of left) hardKill(l.pid);
  for (const p of marked) hardKill(p);
  assert.deepEqual(left.map((l) => `${l.pid} ${l.cmd}`), [], `${what}: descendants survived`);
  assert.deepEqual(marked, [], `${what}: sandbox processes survived`);
  assert.deepEqual(raw.badLines, []);
  // vm: its QEMUs too, and the state directories unless it was SIGKILLed.
  await assertNoVmLeftovers(raw.pid, { dirs: what !== 'SIGKILL', what });
}

/* After a clean shutdown (EX from waitExit): exit status 0, no process of
 * the server's left, no temp files or cgroups beyond those in BEFORE. */
async function assertCleanExit(b, ex, what, before) {
  assert.ok(ex, `server did not exit within 10 s of ${what}`);
  assert.equal(ex.code, 0, `exit ${JSON.stringify(ex)}; stderr:\n${b.raw.stderrText().slice(-2000)}`);
  await assertAllGone(b, what === 'stdin EOF' ? 'EOF' : what);
  const extra = await waitUntil(() => {
    const n = newLeftovers(before);
    return n.tmp.length + n.cgroups.length === 0 ? n : null;
  }, { timeoutMs: 3000 });
  assert.ok(extra, `left behind: ${JSON.stringify(newLeftovers(before))}\nserver stderr:\n${b.raw.stderrText().slice(-3000)}`);
}

describe('shutdown', () => {
  test('stdin EOF: exit 0 within a few seconds, nothing left behind', T, async () => {
    const before = leftovers();
    const b = await busyServer();
    try {
      assertCgroupsVisible(before);
      const t0 = Date.now();
      b.raw.endStdin();
      const ex = await b.raw.waitExit(10000);
      assert.ok(Date.now() - t0 < 10000);
      await assertCleanExit(b, ex, 'stdin EOF', before);
    } finally {
      hardKill(b.raw.pid);
    }
  });

  for (const sig of ['SIGTERM', 'SIGINT']) {
    test(`${sig}: exit 0 within a few seconds, nothing left behind`, T, async () => {
      const before = leftovers();
      const b = await busyServer();
      try {
        assertCgroupsVisible(before);
        process.kill(b.raw.pid, sig);
        const ex = await b.raw.waitExit(10000);
        await assertCleanExit(b, ex, sig, before);
      } finally {
        hardKill(b.raw.pid);
      }
    });
  }

  test('SIGKILL of the server takes its sandboxes down too', T, async () => {
    const b = await busyServer();
    try {
      process.kill(b.raw.pid, 'SIGKILL');
      const ex = await b.raw.waitExit(5000);
      assert.equal(ex?.signal, 'SIGKILL');
      await assertAllGone(b, 'SIGKILL');
    } finally {
      hardKill(b.raw.pid);
    }
  });

  test('cgroups a SIGKILLed server left behind are removed by the next server', { ...T, skip: NS_ONLY('cgroups are the ns backend\'s; vm.test.mjs checks that the next server removes a killed one\'s state directories') }, async () => {
    const before = leftovers();
    const b = await busyServer();
    let next;
    try {
      process.kill(b.raw.pid, 'SIGKILL');
      await b.raw.waitExit(5000);
      await assertAllGone(b, 'SIGKILL');
      next = startRaw();
      await next.initialize();
      const o = await next.tool('open_session', {});
      await next.tool('close', { session_id: o.session_id });
      const clean = await waitUntil(() => newLeftovers(before).cgroups.length === 0, { timeoutMs: 5000 });
      assert.ok(clean, `cgroups still there: ${JSON.stringify(newLeftovers(before).cgroups)}`);
    } finally {
      hardKill(b.raw.pid);
      if (next) await next.close();
    }
  });

  test('idle server (no session) exits 0 on EOF and leaves nothing', T, async () => {
    const before = leftovers();
    const raw = startRaw();
    await raw.initialize();
    raw.endStdin();
    const ex = await raw.waitExit(5000);
    assert.ok(ex, 'no exit within 5 s');
    assert.equal(ex.code, 0);
    assert.deepEqual(newLeftovers(before), { tmp: [], cgroups: [] });
    // vm: the pool was being filled; none of it may stay.
    await assertNoVmLeftovers(raw.pid, { what: 'idle server' });
  });

  test('EOF before initialize also exits 0', T, async () => {
    const raw = startRaw();
    raw.endStdin();
    const ex = await raw.waitExit(5000);
    assert.ok(ex);
    assert.equal(ex.code, 0);
  });

  test('stdin EOF right after a request still answers it or exits cleanly', T, async () => {
    const raw = startRaw();
    await raw.initialize();
    await raw.send({ jsonrpc: '2.0', id: 'last', method: 'ping' });
    raw.endStdin();
    const ex = await raw.waitExit(5000);
    assert.ok(ex);
    assert.equal(ex.code, 0);
    assert.deepEqual(raw.badLines, []);
  });

  test(IS_VM ? 'closed sessions leave no QEMU or state directory while the server runs' : 'closed sessions leave no cgroup or /tmp entries while the server runs', T, async () => {
    const before = leftovers();
    // vm: no pool and no spares, so that every QEMU is a session's.
    const raw = startRaw({ env: IS_VM ? { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } : {} });
    try {
      await raw.initialize();
      for (let i = 0; i < 3; i++) {
        const o = await raw.tool('open_session', {});
        await raw.tool('run', { session_id: o.session_id, command: 'echo x > /root/x' });
        await raw.tool('close', { session_id: o.session_id });
      }
      const extra = await waitUntil(() => {
        const n = newLeftovers(before);
        return n.cgroups.length === 0 ? n : null;
      }, { timeoutMs: 3000 });
      assert.ok(extra, `cgroups left by closed sessions: ${JSON.stringify(newLeftovers(before).cgroups)}`);
      if (IS_VM) {
        assert.deepEqual(qemuChildren(raw.pid).map((q) => `${q.pid} ${q.cmd}`), [], 'closed sessions left QEMUs');
        assert.deepEqual(vmStateDirs(raw.pid), [], 'closed sessions left state directories');
      }
      // (A QEMU's command line names /var/lib/ignition-mcp: ignore only the
      // server's own forks before their exec.)
      assert.deepEqual(descendants(raw.pid).filter((d) => !/^\S*ignition-mcp$/.test(d.cmd ?? '')), [], 'closed sessions left processes');
    } finally {
      await raw.close();
    }
  });
});
