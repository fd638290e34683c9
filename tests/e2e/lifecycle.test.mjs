// lifecycle.test.mjs: how the server ends: stdin EOF, SIGTERM, SIGINT,
// SIGKILL; nothing may outlive it (processes, /tmp entries, cgroups; on the
// vm backend its QEMUs and their state directories; vm.test.mjs has more).

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import {
  startRaw, descendants, survivors, waitGone, findProcs, uniqueSleepSecs, waitUntil,
  leftovers, newLeftovers, hardKill, IS_NS, IS_VM, NS_ONLY, sleep, assertNoVmLeftovers, qemuChildren,
  vmStateDirs, startServer, openSession, sh, call, callErr, AGENT, textOf, assertNoSanitizerReport,
  tempStore, SESSION_CGROUPS,
} from './lib.mjs';
import { execFileSync } from 'node:child_process';
import crypto from 'node:crypto';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

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
  // The run in flight was answered before the server exited (an error: its
  // sandbox went with the shutdown).
  const inflight = b.raw.messages.find((m) => m.msg.id === 'inflight');
  assert.ok(inflight, `${what}: the run in flight got no response`);
  assert.equal(inflight.msg.result?.isError, true, JSON.stringify(inflight.msg).slice(0, 500));
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

  test('stdin EOF right after requests still answers them, then exits cleanly', T, async () => {
    const raw = startRaw();
    await raw.initialize();
    // One answered on the main loop, one on a call thread of its own.
    await raw.send({ jsonrpc: '2.0', id: 'last-ping', method: 'ping' });
    await raw.send({ jsonrpc: '2.0', id: 'last-call', method: 'tools/call', params: { name: 'list_sessions', arguments: {} } });
    raw.endStdin();
    const ex = await raw.waitExit(5000);
    assert.ok(ex);
    assert.equal(ex.code, 0);
    assert.deepEqual(raw.badLines, []);
    const ping = raw.messages.find((m) => m.msg.id === 'last-ping');
    assert.deepEqual(ping?.msg.result, {}, `ping: ${JSON.stringify(ping?.msg)}`);
    const list = raw.messages.find((m) => m.msg.id === 'last-call');
    assert.deepEqual(list?.msg.result?.structuredContent?.sessions, [], `list_sessions: ${JSON.stringify(list?.msg)}`);
  });

  test('an open_session still starting its sandbox at EOF is answered, and its sandbox is destroyed before the server exits', { ...T, skip: NS_ONLY('a slow agent start is made with an agent wrapper') }, async (t) => {
    // An agent that takes long to start: the open is still waiting for it
    // when stdin ends (a vm cold boot under TCG is like it).
    const dir = fs.mkdtempSync('/tmp/e2e-slow-agent-');
    fs.chmodSync(dir, 0o755); // the agent starts as the session's own host uid
    t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
    const wrapper = path.join(dir, 'agent');
    fs.writeFileSync(wrapper, `#!/bin/sh\nsleep 20\nexec ${AGENT} "$@"\n`, { mode: 0o755 });
    const before = leftovers();
    const raw = startRaw({ env: { IGN_MCP_AGENT: wrapper } });
    try {
      await raw.initialize();
      await raw.send({ jsonrpc: '2.0', id: 'opening', method: 'tools/call', params: { name: 'open_session', arguments: {} } });
      assert.ok(await waitUntil(() => descendants(raw.pid).some((d) => /sleep 20/.test(d.cmd ?? '')), { timeoutMs: 10000 }), 'the slow agent did not start');
      const kids = descendants(raw.pid);
      raw.endStdin();
      const ex = await raw.waitExit(15000);
      assert.ok(ex, 'the server did not exit within 15 s of EOF');
      assert.equal(ex.code, 0, `exit ${JSON.stringify(ex)}; stderr:\n${raw.stderrText().slice(-2000)}`);
      const open = raw.messages.find((m) => m.msg.id === 'opening');
      assert.ok(open, `the open_session in flight got no response; stderr:\n${raw.stderrText().slice(-2000)}`);
      assert.equal(open.msg.result?.isError, true, JSON.stringify(open.msg));
      assert.match(textOf(open.msg.result), /shutting down/, JSON.stringify(open.msg));
      const left = await waitGone(kids, 5000);
      for (const l of left) hardKill(l.pid);
      assert.deepEqual(left.map((l) => `${l.pid} ${l.cmd}`), [], 'processes of the sandbox being started survived');
      assert.deepEqual(newLeftovers(before).cgroups, [], 'the cgroup of the sandbox being started was left behind');
      assertNoSanitizerReport(raw.stderrText());
    } finally {
      hardKill(raw.pid);
    }
  });

  test('an open_session waiting for the warm base at EOF is answered, and the server does not wait for the base', { timeout: 240_000, skip: IS_VM ? false : 'vm only: the warm base' }, async (t) => {
    // A golden VM that never boots (QEMU started paused, -S): the base is
    // being made until its boot times out, and an open waits for it.
    const dir = fs.mkdtempSync('/tmp/e2e-paused-qemu-');
    fs.chmodSync(dir, 0o755);
    t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
    const qemu = path.join(dir, 'qemu');
    fs.writeFileSync(qemu, '#!/bin/sh\ncase " $* " in\n*" -kernel "*) exec qemu-system-x86_64 "$@" -S ;;\nesac\nexec qemu-system-x86_64 "$@"\n', { mode: 0o755 });
    const store = tempStore();
    t.after(() => store.remove());
    const raw = startRaw({ env: { IGN_MCP_QEMU: qemu, IGN_MCP_STORE: store.dir, IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } });
    try {
      await raw.initialize();
      assert.ok(await waitUntil(() => qemuChildren(raw.pid).length > 0, { timeoutMs: 30000 }), `no golden QEMU started; stderr:\n${raw.stderrText()}`);
      await raw.send({ jsonrpc: '2.0', id: 'opening', method: 'tools/call', params: { name: 'open_session', arguments: {} } });
      // Time for the call to reach the wait for the base (had it not, it
      // would be refused at once and the test would pass without the wait).
      await sleep(1500);
      raw.endStdin();
      const ex = await raw.waitExit(150000);
      assert.ok(ex, 'the server did not exit');
      assert.equal(ex.code, 0, `exit ${JSON.stringify(ex)}; stderr:\n${raw.stderrText().slice(-2000)}`);
      const open = raw.messages.find((m) => m.msg.id === 'opening');
      assert.ok(open, `the open_session waiting for the base got no response; stderr:\n${raw.stderrText().slice(-2000)}`);
      assert.equal(open.msg.result?.isError, true, JSON.stringify(open.msg));
      assert.match(textOf(open.msg.result), /shutting down/, JSON.stringify(open.msg));
      assert.doesNotMatch(raw.stderrText(), /still being started|still running/, raw.stderrText().slice(-2000));
      await assertNoVmLeftovers(raw.pid);
      assertNoSanitizerReport(raw.stderrText());
    } finally {
      hardKill(raw.pid);
    }
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

/* A process's signal masks from /proc/<pid>/status text, as BigInts. */
function sigMasks(status) {
  const get = (k) => {
    const m = status.match(new RegExp(`^${k}:\\s*([0-9a-f]+)$`, 'm'));
    assert.ok(m, `no ${k} in:\n${status}`);
    return BigInt(`0x${m[1]}`);
  };
  return { blk: get('SigBlk'), ign: get('SigIgn') };
}
const bit = (sig) => 1n << BigInt(sig - 1);
const SIGRTMIN = 34;
const RT_BITS = ((1n << 64n) - 1n) & ~((1n << BigInt(SIGRTMIN - 1)) - 1n);

describe('sandbox processes start with a clean signal state', () => {
  test('the ns agent (PID 1 of the sandbox) blocks only SIGCHLD (its signalfd) and ignores only SIGPIPE (its own choice)', { ...T, skip: NS_ONLY('the ns agent runs on the host kernel; in a VM it is the guest kernel\'s') }, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const sid = await openSession(s.client);
    // The agent blocks every signal while it starts a command, until that
    // command has exec'd (guest/exec_spawn.c): read its mask once the shell
    // of this run is well started, not in that window.
    const st = await sh(s.client, sid, 'sleep 0.3; cat /proc/1/status');
    const { blk, ign } = sigMasks(st);
    t.diagnostic(`agent SigBlk ${blk.toString(16)} SigIgn ${ign.toString(16)}`);
    // Anything else blocked (the server's spawner thread blocks all) would
    // let signals sent from inside queue up against the host uid's limit.
    assert.equal(blk & ~bit(17), 0n, `the agent blocks more than SIGCHLD: SigBlk ${blk.toString(16)}`);
    assert.equal(ign & ~bit(13), 0n, `the agent ignores signals it inherited: SigIgn ${ign.toString(16)}`);
  });

  test('a QEMU blocks no real-time signal and ignores only SIGXFSZ (its log\'s size limit) and SIGPIPE (its own choice)', { ...T, skip: IS_VM ? false : 'vm only: QEMU' }, async (t) => {
    const s = await startServer({ env: { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } });
    t.after(() => s.close());
    await openSession(s.client);
    const qs = qemuChildren(s.pid);
    assert.equal(qs.length, 1, `QEMUs under the server: ${JSON.stringify(qs)}`);
    const { blk, ign } = sigMasks(fs.readFileSync(`/proc/${qs[0].pid}/status`, 'utf8'));
    t.diagnostic(`QEMU SigBlk ${blk.toString(16)} SigIgn ${ign.toString(16)}`);
    assert.equal(blk & RT_BITS, 0n, `QEMU blocks real-time signals: SigBlk ${blk.toString(16)}`);
    assert.equal(blk & (bit(15) | bit(1) | bit(2)), 0n, `QEMU blocks SIGTERM/SIGHUP/SIGINT: SigBlk ${blk.toString(16)}`);
    // (QEMU blocks SIGBUS, SIGUSR1, SIGALRM and SIGIO itself, for its signalfd.)
    assert.equal(ign & ~(bit(25) | bit(13)), 0n, `QEMU ignores signals it inherited: SigIgn ${ign.toString(16)}`);
  });
});

/* A launcher that starts the server with signals ignored and blocked, as a
 * careless parent might: 32 and 33 (the C library's own, which its
 * sigaction() will not touch) to 40 and SIGUSR1 ignored, 41-64 blocked.
 * Built with the host's compiler (raw system calls for 32 and 33). */
function buildSignalLauncher() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-siglaunch-'));
  const src = path.join(dir, 'l.c'), bin = path.join(dir, 'l');
  fs.writeFileSync(src, `#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv) {
  struct { unsigned long h, f, r, m; } ign = {1, 0, 0, 0};
  for (int s = 32; s <= 40; s++) syscall(SYS_rt_sigaction, s, &ign, 0, 8);
  syscall(SYS_rt_sigaction, SIGUSR1, &ign, 0, 8);
  unsigned long rt = ~0UL << 40;
  syscall(SYS_rt_sigprocmask, SIG_BLOCK, &rt, 0, 8);
  if (argc < 2) return 2;
  execv(argv[1], argv + 1);
  return 127;
}
`);
  try {
    execFileSync('gcc', ['-O1', '-o', bin, src], { stdio: ['ignore', 'ignore', 'pipe'] });
  } catch (e) {
    fs.rmSync(dir, { recursive: true, force: true });
    return { skip: `cannot build the launcher with gcc: ${String(e.stderr || e.message).split('\n')[0]}` };
  }
  fs.chmodSync(dir, 0o755);
  return { bin, dir };
}

describe('what the server inherited does not reach its sandboxes', () => {
  test('a server started with signals ignored (even 32 and 33) and real-time signals blocked hands none of that to the ns agent or a QEMU', T, async (t) => {
    const l = buildSignalLauncher();
    if (l.skip) return t.skip(l.skip);
    t.after(() => fs.rmSync(l.dir, { recursive: true, force: true }));
    const s = await startServer({ launcher: [l.bin], env: IS_VM ? { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } : {} });
    t.after(() => s.close());
    const mine = sigMasks(fs.readFileSync(`/proc/${s.pid}/status`, 'utf8'));
    assert.ok(mine.ign & bit(32), `the launcher did not leave signal 32 ignored in the server: SigIgn ${mine.ign.toString(16)}`);
    const sid = await openSession(s.client);
    let st;
    if (IS_NS) {
      // Read once the agent is idle: while it starts a command it blocks
      // every signal for a moment (guest/exec.c), which is its own doing,
      // not something it inherited.
      st = await sh(s.client, sid, 'sleep 1; cat /proc/1/status');
    } else {
      const qs = qemuChildren(s.pid);
      assert.equal(qs.length, 1, `QEMUs under the server: ${JSON.stringify(qs)}`);
      st = fs.readFileSync(`/proc/${qs[0].pid}/status`, 'utf8');
    }
    const { blk, ign } = sigMasks(st);
    t.diagnostic(`server SigIgn ${mine.ign.toString(16)}; sandbox process SigBlk ${blk.toString(16)} SigIgn ${ign.toString(16)}`);
    assert.equal(ign & ~(bit(13) | bit(25)), 0n, `the sandbox process ignores signals the server inherited: SigIgn ${ign.toString(16)}`);
    assert.equal(blk & RT_BITS, 0n, `the sandbox process blocks real-time signals the server inherited blocked: SigBlk ${blk.toString(16)}`);
  });
});

describe('a QEMU\'s state directory belongs to its uid', () => {
  test('a log replaced by a link (symbolic or hard) to a root-only file is never quoted; close removes the directory and follows no link in it', { ...T, skip: !IS_VM ? 'vm only: QEMU state directories' : process.getuid() !== 0 ? 'root only: the QEMU of a user runs as that user, so no file of another uid can be reached through its state directory' : false }, async (t) => {
    // What a compromised QEMU can do in its state directory, done here as
    // root: the server must neither quote nor remove what the links reach.
    const token = `secret-${crypto.randomUUID()}`;
    const secretDir = fs.mkdtempSync('/run/ign-e2e-secret-'); // the state directories' filesystem: a hard link can reach it
    t.after(() => fs.rmSync(secretDir, { recursive: true, force: true }));
    const secret = path.join(secretDir, 'secret');
    // Both log readers would quote it: the panic line and the log's tail.
    fs.writeFileSync(secret, `Kernel panic - not syncing: ${token}\n${token}\n`, { mode: 0o600 });
    const precious = path.join(secretDir, 'precious');
    fs.mkdirSync(precious);
    fs.writeFileSync(path.join(precious, 'keep'), 'x');
    const s = await startServer({ env: { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } });
    t.after(() => s.close());
    const c = s.client;
    for (const how of ['symlink', 'hard link']) {
      const sid = await openSession(c);
      const dirs = vmStateDirs(s.pid);
      const qs = qemuChildren(s.pid);
      assert.equal(dirs.length, 1, `state directories: ${dirs}`);
      assert.equal(qs.length, 1, `QEMUs: ${JSON.stringify(qs)}`);
      const [dir] = dirs;
      const log = path.join(dir, 'qemu.log');
      fs.rmSync(log);
      if (how === 'symlink') fs.symlinkSync(secret, log);
      else fs.linkSync(secret, log);
      fs.symlinkSync(precious, path.join(dir, 'link-to-dir'));
      fs.mkdirSync(path.join(dir, 'sub/deeper'), { recursive: true });
      fs.symlinkSync(path.join(precious, 'keep'), path.join(dir, 'sub/deeper/link'));
      process.kill(qs[0].pid, 'SIGKILL');
      const e = await callErr(c, 'run', { session_id: sid, command: 'true' });
      assert.match(e, /dead/, e);
      assert.ok(!e.includes(token), `${how}: the error quotes the file the log was linked to: ${e}`);
      await call(c, 'close', { session_id: sid });
      assert.ok(await waitUntil(() => !fs.existsSync(dir)), `${how}: the state directory ${dir} is left: ${fs.existsSync(dir) ? fs.readdirSync(dir, { recursive: true }) : ''}`);
      assert.ok(fs.existsSync(path.join(precious, 'keep')), `${how}: removing the state directory followed a link`);
      assert.ok(fs.existsSync(secret), `${how}: removing the state directory removed the linked file`);
    }
    assert.ok(!s.stderrText().includes(token), 'the server logged the linked file');
  });

  test('a tree QEMU made in its state directory, however deep, with FIFOs and links in it, is removed on close', { ...T, skip: !IS_VM ? 'vm only: QEMU state directories' : process.getuid() !== 0 ? 'root only: the targets of the tree are made in /run, which only root may write' : false }, async (t) => {
    // What a compromised QEMU can make in its state directory, made here as
    // root: a chain of directories deeper than any fixed limit, with a file,
    // a FIFO and a link to a directory outside at every level.
    const precious = fs.mkdtempSync('/run/ign-e2e-precious-');
    t.after(() => fs.rmSync(precious, { recursive: true, force: true }));
    fs.writeFileSync(path.join(precious, 'keep'), 'x');
    const s = await startServer({ env: { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    const dirs = vmStateDirs(s.pid);
    assert.equal(dirs.length, 1, `state directories: ${dirs}`);
    const [dir] = dirs;
    let p = dir;
    for (let i = 0; i < 40; i++) {
      p = path.join(p, `d${i}`);
      fs.mkdirSync(p);
      fs.writeFileSync(path.join(p, 'f'), 'x');
      execFileSync('mkfifo', [path.join(p, 'fifo')]);
      fs.symlinkSync(precious, path.join(p, 'link'));
    }
    t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
    await call(c, 'close', { session_id: sid });
    assert.ok(await waitUntil(() => !fs.existsSync(dir)), `the state directory ${dir} is left; server said:\n${s.stderrText().slice(-2000)}`);
    assert.ok(fs.existsSync(path.join(precious, 'keep')), 'removing the state directory followed a link');
  });

  test('the names QEMU gave what it left in its state directory cannot forge lines of the server\'s log', { ...T, skip: !IS_VM ? 'vm only: QEMU state directories' : process.getuid() !== 0 ? 'root only: a failed removal is made with chattr +i, which needs root' : false }, async (t) => {
    // A removal that fails logs the name: a newline in it must not start a
    // line of its own.  (An immutable file, set here as root, is a removal
    // that fails.)
    const s = await startServer({ env: { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    const [dir] = vmStateDirs(s.pid);
    const odd = path.join(dir, 'x\nFORGED ignition-mcp error: a line the server never wrote\x1b[2K');
    fs.mkdirSync(odd);
    fs.writeFileSync(path.join(odd, 'f'), 'x');
    execFileSync('chattr', ['+i', path.join(odd, 'f')]);
    try {
      await call(c, 'close', { session_id: sid });
      assert.ok(await waitUntil(() => /session \S+ closed/.test(s.stderrText())), s.stderrText().slice(-2000));
      const err = s.stderrText();
      assert.match(err, /cannot remove/, 'the failed removal was not logged');
      assert.doesNotMatch(err, /^FORGED/m, `a name from the state directory started a log line:\n${err.slice(-2000)}`);
      assert.ok(!err.includes('\x1b'), 'a control character from the state directory reached the log');
    } finally {
      execFileSync('chattr', ['-i', path.join(odd, 'f')]);
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  test('a panic line in the VM\'s log is quoted without the control characters the guest put in it', { ...T, skip: IS_VM ? false : 'vm only: QEMU\'s log' }, async (t) => {
    // The guest writes its console (the log) as it likes: what it wrote is
    // quoted to the client, but no terminal escape or other control
    // character with it.  (Appended here as root, as the guest's console
    // output would be.)
    const s = await startServer({ env: { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } });
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    const [dir] = vmStateDirs(s.pid);
    const [q] = qemuChildren(s.pid);
    fs.appendFileSync(path.join(dir, 'qemu.log'), '\nKernel panic - not syncing: forged\x1b[2J\x1b]0;title\x07\x08\x7fend\n');
    process.kill(q.pid, 'SIGKILL');
    const e = await callErr(c, 'run', { session_id: sid, command: 'true' });
    assert.match(e, /the guest kernel panicked \(Kernel panic - not syncing: forged/, e);
    assert.match(e, /end\)/, e);
    assert.doesNotMatch(e, /[\x00-\x1f\x7f]/, `control characters from the log reached the client: ${JSON.stringify(e)}`);
  });
});
