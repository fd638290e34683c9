// abuse.test.mjs: abusive guests (issue #5, item 3), one row each, on both
// backends, every one inside the second fence (tests/fence.sh: the server in
// a pid namespace of its own and a pids+memory cgroup the test makes), with
// its figure recorded as a test diagnostic and a neighbour session's `run
// true` latency before and during the abuse.
//
// | row                                   | where                                                          |
// |---------------------------------------|----------------------------------------------------------------|
// | fork bomb                             | here: 'fork bomb'                                              |
// | memory hog                            | here: 'memory hog'; python's 512 MiB: isolation.test.mjs       |
// | filling the overlay                   | here: 'filling the overlay' (both), 'IGN_MCP_OVERLAY_MB=16' (ns)|
// | kill -9 -1 inside                     | here: 'kill -9 -1'                                             |
// | 1 GiB of output                       | here: '1 GiB of output'                                        |
// | closes its stdout and keeps running   | here: 'closes its stdout'                                      |
// | ignores SIGTERM at its timeout        | here: 'ignores SIGTERM'                                        |
// | loading a kernel module               | here: 'loading a kernel module'                                |
// | holding open files                    | here: 'holding open files' (ns)                                |
// | queueing socket buffers               | here: 'queueing socket buffers' (ns)                           |
// | reading host files                    | isolation.test.mjs: 'host files are not visible', 'the root filesystem is the rootfs, not the host' |
// | reaching the network                  | isolation.test.mjs: 'the sandbox cannot reach a TCP listener on the host', '/dev/tcp to the host listener fails' |
// | writing /proc/sys                     | isolation.test.mjs: 'kernel knobs cannot be written' (ns), '... written in the guest do not reach the host' (vm) |
// | mounting                              | isolation.test.mjs: 'mounting is refused' (ns), 'mounts made in the guest stay in the guest' (vm) |
// | reaching another session's sandbox    | isolation.test.mjs: 'two sessions see neither files nor processes of the other' |
// The isolation.test.mjs servers run inside the fence too.
//
// Destructive commands run only after checking that the command runs inside
// a sandbox. Timing figures are recorded, not asserted: the only bound on
// the neighbour is that every call answers within 10 s and the server stays
// up (ratios belong in bench/).

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import {
  startServer, call, openSession, run, sh, uniq, uniqueSleepSecs, findProcs, waitUntil, sleep,
  IS_NS, IS_VM, NS_ONLY, VM_DIR, qemuChildren, descendants, vmRssKiB, textOf, fencePidsStat,
  FENCE_PIDS, TOOLS_SKIP, SESSION_CGROUPS, NEEDS_CGROUPS, oomKillsOf,
} from './lib.mjs';

const T = { timeout: 120_000 };
const NEIGHBOUR_BOUND_MS = 10_000;

/* Fail unless commands run in a sandbox: ns, in a pid namespace of their
 * own with the agent as PID 1; vm, in the guest kernel. */
async function assertSandboxed(c, sid) {
  if (IS_NS) {
    const out = await sh(c, sid, 'echo $$; cat /proc/1/comm; ls /proc | grep -c "^[0-9][0-9]*$"');
    const [shPid, comm1, count] = out.trim().split('\n');
    assert.ok(Number(shPid) < 1000, `sandbox shell has pid ${shPid}; not in its own pid namespace?`);
    assert.match(comm1, /ign|agent/, `PID 1 in the sandbox is ${comm1}, not the agent`);
    assert.ok(Number(count) < 20, `${count} processes visible in the sandbox`);
  } else {
    assert.ok(!fs.readFileSync('/proc/cmdline', 'utf8').includes('ign.fstype='), 'the host command line looks like a guest one');
    assert.match(await sh(c, sid, 'cat /proc/cmdline'), /ign\.fstype=/, 'not the guest kernel');
  }
}

const p50 = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length ? s[Math.floor((s.length - 1) / 2)] : NaN;
};
const ms = (x) => `${x.toFixed(1)} ms`;

/* One `run true` in the neighbour session, timed; fails past the bound. */
async function neighbourCall(c, sid) {
  const t0 = performance.now();
  const r = await c.callTool({ name: 'run', arguments: { session_id: sid, command: 'true' } }, undefined, { timeout: NEIGHBOUR_BOUND_MS + 5000 });
  const dt = performance.now() - t0;
  assert.notEqual(r.isError, true, `the neighbour's run failed: ${textOf(r)}`);
  assert.ok(dt < NEIGHBOUR_BOUND_MS, `the neighbour's run took ${dt.toFixed(0)} ms`);
  return dt;
}

/* Runs ABUSE() (a promise-returning function) while timing the neighbour:
 * {result, before, during} with before/during the p50s, and a line for the
 * diagnostic. At least 3 neighbour calls are made during the abuse. */
async function withNeighbour(s, nb, abuse, { settleMs = 300 } = {}) {
  const pre = [];
  for (let i = 0; i < 10; i++) pre.push(await neighbourCall(s.client, nb));
  let done = false;
  const p = abuse().finally(() => {
    done = true;
  });
  await sleep(settleMs);
  const dur = [];
  while ((!done || dur.length < 3) && dur.length < 400) dur.push(await neighbourCall(s.client, nb));
  const result = await p;
  assert.deepEqual(await s.client.ping(), {});
  const line = `neighbour run p50 ${ms(p50(pre))} -> ${ms(p50(dur))} (${dur.length} calls during, max ${ms(Math.max(...dur))})`;
  return { result, before: p50(pre), during: p50(dur), line };
}

/* ns: the cgroup directories (pids, memory) of the session, found through
 * a process running in it. */
async function sessionCgroups(c, sid) {
  const n = uniqueSleepSecs();
  await sh(c, sid, `sleep ${n} > /dev/null 2>&1 &`);
  const pids = await waitUntil(() => {
    const p = findProcs(['sleep', String(n)]);
    return p.length ? p : null;
  });
  assert.ok(pids, 'the marker sleep is not visible on the host');
  const out = {};
  for (const line of fs.readFileSync(`/proc/${pids[0]}/cgroup`, 'utf8').split('\n')) {
    const m = line.match(/^\d+:([^:]*):(.*)$/);
    if (!m) continue;
    if (m[1] === '' && fs.existsSync('/sys/fs/cgroup/cgroup.controllers')) out.pids = out.memory = `/sys/fs/cgroup${m[2]}`;
    for (const k of ['pids', 'memory']) if (m[1].split(',').includes(k)) out[k] = `/sys/fs/cgroup/${k}${m[2]}`;
  }
  // (The bracket keeps pkill from matching this shell's own command line.)
  await sh(c, sid, `pkill -f 'slee[p] ${n}' || kill $(pidof sleep) 2>/dev/null; true`);
  assert.ok(out.pids && out.memory, `no pids/memory cgroup for the session: ${JSON.stringify(out)}`);
  return out;
}

const readInt = (p) => {
  try {
    return Number(fs.readFileSync(p, 'utf8').trim());
  } catch {
    return NaN;
  }
};
const hostPidCount = () => fs.readdirSync('/proc').filter((d) => /^\d+$/.test(d)).length;
const hostOomKills = () => Number(fs.readFileSync('/proc/vmstat', 'utf8').match(/^oom_kill (\d+)$/m)[1]);

/* The kernel log from a marker on: mark() writes one and returns a
 * function giving the lines after it. */
/* A mark in the kernel log, and a function that returns the lines after
 * it; null where this user may not read the kernel log (an ordinary user on
 * a host with dmesg_restrict). */
function kmsgMark() {
  const tag = uniq('ign-e2e-abuse-mark');
  try {
    fs.writeFileSync('/dev/kmsg', `${tag}\n`);
    execFileSync('dmesg', { stdio: 'ignore' });
  } catch (e) {
    if (process.getuid() === 0) throw e;
    return null;
  }
  return () => {
    const log = execFileSync('dmesg', { encoding: 'utf8', maxBuffer: 64 << 20 });
    const at = log.lastIndexOf(tag);
    return at < 0 ? [] : log.slice(at).split('\n').slice(1);
  };
}

/* The fence's pids controller never had to refuse a fork: the sandbox's
 * own limit contained the abuse. */
function assertFenceUntouched(s, what) {
  // A user who cannot make cgroups gets a fence of RLIMIT_NPROC (tests/fence.sh),
  // which keeps no count of refusals to read.
  if (!SESSION_CGROUPS) return null;
  const f = fencePidsStat(s.fence);
  assert.ok(f, 'no pids figures for the fence');
  assert.equal(f.events, 0, `${what}: the fence's pids limit (${f.max}) was hit: the sandbox did not contain it`);
  return f;
}

describe('abusive guests', () => {
  let s, c, nb;
  before(async () => {
    // ns: a 256 MiB memory limit, so that the hog is quick (the overlay is
    // then at most 128 MiB, like a microVM's with its 256 MiB of RAM).
    s = await startServer({ fence: true, env: IS_NS ? { IGN_MCP_MEMORY_MB: 256 } : {} });
    c = s.client;
    nb = await openSession(c);
    await assertSandboxed(c, nb);
  });
  after(async () => {
    await s?.close();
  });

  /* A fresh session for one row, closed after it. */
  async function victim(t) {
    const sid = await openSession(c);
    await assertSandboxed(c, sid);
    t.after(() => c.callTool({ name: 'close', arguments: { session_id: sid } }).catch(() => {}));
    return sid;
  }

  test('fork bomb: held by the pids limit (ns) or inside the guest (vm); host, server and neighbour carry on', T, async (t) => {
    const sid = await victim(t);
    // ns without cgroups (a user): the pids limit is RLIMIT_NPROC in the
    // session's user namespace, and the peak is counted on the host.
    const cg = IS_NS && SESSION_CGROUPS ? await sessionCgroups(c, sid) : null;
    const hostBefore = hostPidCount();
    const kidsBefore = new Set(descendants(s.pid).map((d) => d.pid));
    let peak = 0, hostPeak = 0, fencePeak = 0;
    const poll = setInterval(() => {
      if (cg) peak = Math.max(peak, readInt(`${cg.pids}/pids.current`) || 0);
      else if (IS_NS) peak = Math.max(peak, descendants(s.pid).length);
      hostPeak = Math.max(hostPeak, hostPidCount());
      fencePeak = Math.max(fencePeak, fencePidsStat(s.fence)?.current ?? 0);
    }, 100);
    let n;
    try {
      n = await withNeighbour(s, nb, () => run(c, sid, 'bomb() { bomb | bomb & }; bomb; sleep 60', { timeout_s: 10 }, { timeout: 60000 }), { settleMs: 2000 });
    } finally {
      clearInterval(poll);
    }
    // The bomb is ended by its timeout; in a microVM the guest's own OOM
    // killer may end it first (256 MiB of guest RAM), which kills the shell
    // with SIGKILL: contained by the guest either way.
    const oomInGuest = IS_VM && !n.result.timed_out && n.result.signal === 'SIGKILL';
    assert.ok(n.result.timed_out === true || oomInGuest, `the bomb ended by itself: ${JSON.stringify(n.result).slice(0, 300)}`);
    // The session answers again, and the bomb's processes are gone: the
    // guest reaps thousands of them under TCG, so this is waited for.
    let last = null;
    const left = await waitUntil(async () => {
      const a = await c.callTool({ name: 'run', arguments: { session_id: sid, command: 'n=0; for p in /proc/[0-9]*; do [ -s $p/cmdline ] && n=$((n+1)); done; echo $n', timeout_s: 10 } }, undefined, { timeout: 30000 });
      if (a.isError) return null;
      last = a.structuredContent;
      return Number(last.stdout) < 10 ? last : null;
    }, { timeoutMs: 60000, intervalMs: 1000 });
    assert.ok(last, 'the bombed session never answered again');
    assert.ok(left, `${last.stdout.trim()} processes still in the sandbox 60 s after the bomb's timeout`);
    const f = assertFenceUntouched(s, 'fork bomb');
    let figure;
    if (IS_NS && !cg) {
      assert.match(await sh(c, sid, 'cat /proc/self/limits'), /^Max processes\s+1024\s+1024\s+processes/m);
      // The server's descendants: every session's processes, the neighbour's included.
      assert.ok(peak <= 1024 + 16, `${peak} processes under the server with a session limited to 1024`);
      // The limit itself refused forks (the peak above is only sampled).
      assert.match(n.result.stderr, /can't fork|Resource temporarily unavailable/, `the bomb never reached the limit: ${n.result.stderr.slice(0, 300)}`);
      figure = `fork bomb (ns, no cgroup): held by RLIMIT_NPROC 1024 (peak ${peak} processes under the server), host pids +${hostPeak - hostBefore} at most`;
    } else if (IS_NS) {
      const max = readInt(`${cg.pids}/pids.max`);
      const refused = Number((fs.readFileSync(`${cg.pids}/pids.events`, 'utf8').match(/max (\d+)/) || [])[1] ?? 0);
      assert.equal(max, 1024, 'the session\'s pids.max is not the default IGN_MCP_PIDS');
      assert.ok(peak <= max, `${peak} tasks in a session limited to ${max}`);
      assert.ok(refused > 0, `the bomb never reached the session's pids limit (peak ${peak})`);
      figure = `fork bomb (ns): session pids.max ${max} reached (peak ${peak}, ${refused} forks refused), host pids +${hostPeak - hostBefore} at most`;
    } else {
      const added = descendants(s.pid).filter((d) => !kidsBefore.has(d.pid) && !/qemu-system|ignition-mcp/.test(d.cmd ?? ''));
      assert.deepEqual(added.map((d) => `${d.pid} ${d.cmd}`), [], 'the fork bomb made processes on the host');
      figure = `fork bomb (vm): contained by the guest kernel (${oomInGuest ? 'ended by the guest\'s OOM killer' : 'ended by its timeout'}), host processes under the server +0, host pids ${hostBefore} -> peak ${hostPeak} (other tenants included)`;
    }
    t.diagnostic(`${figure}; ${f ? `fence peak ${fencePeak} of ${FENCE_PIDS} tasks, never hit (${f.events} refusals)` : `fence: RLIMIT_NPROC ${FENCE_PIDS}`}; ${n.line}`);
  });

  test('memory hog: killed by the session\'s memory limit (ns: cgroup, vm: the guest\'s OOM killer), not the host\'s', { ...T, skip: IS_NS && NEEDS_CGROUPS('memory is not enforced without a cgroup, so the hog would take the host\'s memory') }, async (t) => {
    const sid = await victim(t);
    const cg = IS_NS ? await sessionCgroups(c, sid) : null;
    const qemus = IS_VM ? qemuChildren(s.pid) : [];
    const oomBefore = hostOomKills();
    const kmsg = kmsgMark();
    const fenceOomBefore = kmsg ? null : oomKillsOf(s.pid);
    // awk keeps every doubling of a string: ~2x the last one in all, and no
    // single allocation above the limit, so the OOM killer acts.
    const n = await withNeighbour(s, nb, () => run(c, sid, `awk 'BEGIN { s = "aaaaaaaaaaaaaaaa"; for (i = 0; i < 40; i++) { t[i] = s; s = s s }; print "survived", length(s) }'`, { timeout_s: 60 }, { timeout: 120000 }));
    const r = n.result;
    assert.ok(!r.stdout.includes('survived'), `the hog survived: ${JSON.stringify(r).slice(0, 300)}`);
    assert.equal(r.exit_code, 137, `the hog did not die of SIGKILL: ${JSON.stringify(r).slice(0, 300)}`);
    assert.equal(await sh(c, sid, 'echo alive'), 'alive\n');
    const oomDelta = hostOomKills() - oomBefore;
    // Without the kernel log (a user), a count stands in for its lines: no
    // OOM kill, by any OOM killer, of a process in the memory cgroup the
    // fenced server is in (tests/run.sh's fence around the user pass: the
    // server, its QEMUs and nothing of another pass), as the kernel log
    // shows for root's fence; in no memory cgroup of its own, none on the
    // whole host.
    const kills = kmsg ? kmsg().filter((l) => l.includes('oom-kill:')) : [];
    const ours = kmsg ? kills.filter((l) => l.includes(s.fence.name)) : [];
    let counted = '';
    if (!kmsg) {
      const where = fenceOomBefore ? `the memory cgroup ${fenceOomBefore.dir}` : 'the host';
      const delta = fenceOomBefore ? (oomKillsOf(s.pid)?.count ?? NaN) - fenceOomBefore.count : oomDelta;
      assert.equal(delta, 0, `the OOM killer acted on ${where} while the hog ran`);
      counted = `; OOM kills in ${where} +${delta}`;
    }
    let figure;
    if (IS_NS) {
      // Every OOM kill in the fence was the session's own cgroup's doing.
      const sessionCg = path.basename(cg.memory);
      assert.ok(ours.length >= 1, `no OOM kill in the fence in the kernel log; oom_kill +${oomDelta}`);
      for (const l of ours) assert.match(l, new RegExp(`constraint=CONSTRAINT_MEMCG.*oom_memcg=[^,]*/${sessionCg},`), `an OOM kill not made by the session's limit: ${l}`);
      const limit = readInt(`${cg.memory}/memory.limit_in_bytes`) || readInt(`${cg.memory}/memory.max`);
      const peak = readInt(`${cg.memory}/memory.max_usage_in_bytes`) || readInt(`${cg.memory}/memory.peak`);
      assert.equal(limit, 256 << 20);
      figure = `memory hog (ns): killed at the session's ${limit >> 20} MiB cgroup limit (peak ${(peak / 1048576).toFixed(0)} MiB), ${ours.length} OOM kill(s) all in the session's cgroup`;
    } else {
      assert.deepEqual(ours, [], 'the host OOM killer acted on the fence');
      assert.match(await sh(c, sid, 'dmesg'), /Out of memory: Killed process \d+ \(awk\)/);
      for (const q of qemus) assert.ok(fs.existsSync(`/proc/${q.pid}`), `QEMU ${q.pid} died`);
      const hwm = Math.max(...qemuChildren(s.pid).map((q) => vmRssKiB(q.pid, 'VmHWM') || 0));
      figure = `memory hog (vm): killed by the guest's OOM killer inside 256 MiB of guest RAM; largest QEMU RSS high-water ${(hwm / 1024).toFixed(0)} MiB`;
    }
    t.diagnostic(`${figure}${counted}; host /proc/vmstat oom_kill +${oomDelta}${kmsg ? ` (${kills.length - ours.length} elsewhere on the machine)` : ''}; ${n.line}`);
  });

  test('filling the overlay: ENOSPC at the cap, the session usable after deleting', T, async (t) => {
    const sid = await victim(t);
    const o = (await call(c, 'list_sessions', {})).sessions.find((x) => x.session_id === sid);
    const capMb = Number((await sh(c, sid, "df -m / | awk 'NR == 2 { print $2 }'")).trim());
    assert.ok(capMb > 0 && capMb <= 128, `the overlay is ${capMb} MiB: not capped at half the sandbox's memory (limits: ${o?.limits})`);
    const n = await withNeighbour(s, nb, () => run(c, sid, 'dd if=/dev/zero of=/root/big bs=1M count=2048', { timeout_s: 60 }, { timeout: 120000 }));
    const r = n.result;
    assert.notEqual(r.exit_code, 0, `dd succeeded: ${r.stderr}`);
    assert.equal(r.signal, null, `dd was killed (${r.signal}) instead of getting ENOSPC: ${r.stderr}`);
    assert.match(r.stderr, /No space left on device/);
    const size = Number((await sh(c, sid, 'wc -c < /root/big')).trim());
    assert.ok(size <= (capMb + 1) * 1048576, `wrote ${size} bytes past a ${capMb} MiB cap`);
    assert.equal(await sh(c, sid, 'rm /root/big; echo ok > /root/small; cat /root/small'), 'ok\n');
    t.diagnostic(`overlay fill: ENOSPC at ${(size / 1048576).toFixed(0)} MiB of a ${capMb} MiB overlay, session usable after rm; ${n.line}`);
  });

  test('kill -9 -1 inside: the session, the server and the neighbour answer afterwards', T, async (t) => {
    const sid = await victim(t);
    const qemus = IS_VM ? qemuChildren(s.pid) : [];
    await sh(c, sid, 'sleep 1000 > /dev/null 2>&1 &');
    const n = await withNeighbour(s, nb, () => run(c, sid, 'kill -9 -1', { timeout_s: 10 }));
    const t0 = Date.now();
    assert.equal(await sh(c, sid, 'echo after-kill'), 'after-kill\n');
    const back = Date.now() - t0;
    assert.equal(await sh(c, sid, 'ps | grep -c "[s]leep 1000" || true'), '0\n', 'the background sleep survived kill -9 -1');
    for (const q of qemus) assert.ok(fs.existsSync(`/proc/${q.pid}`), `QEMU ${q.pid} died`);
    t.diagnostic(`kill -9 -1: every other process in the sandbox killed (the shell exited ${n.result.exit_code}), the session answered ${back} ms later; ${n.line}`);
  });

  test('1 GiB of output: the server keeps the cap, counts the total, memory stays bounded', T, async (t) => {
    const sid = await victim(t);
    const GiB = 1 << 30;
    const rss0 = vmRssKiB(s.pid, 'VmRSS');
    if (IS_NS) {
      const t0 = Date.now();
      const n = await withNeighbour(s, nb, () => run(c, sid, `head -c ${GiB} /dev/zero`, { timeout_s: 120 }, { timeout: 180000 }));
      const secs = (Date.now() - t0) / 1000;
      const r = n.result;
      assert.equal(r.exit_code, 0);
      assert.equal(r.stdout_bytes, GiB);
      assert.equal(r.stdout_truncated, true);
      assert.equal(r.stdout.length, 65536);
      const grew = vmRssKiB(s.pid, 'VmRSS') - rss0;
      assert.ok(grew < 64 * 1024, `the server's RSS grew by ${grew} KiB for 1 GiB of output`);
      t.diagnostic(`1 GiB of output (ns): 65536 bytes kept, stdout_bytes ${r.stdout_bytes}, ${(GiB / 1048576 / secs).toFixed(0)} MiB/s, server RSS ${rss0} -> ${rss0 + grew} KiB; ${n.line}`);
      return;
    }
    // vm: under TCG the guest writes some 10-20 MiB/s, so 1 GiB would take a
    // minute or more: an exact count of 64 MiB, then 1 GiB cut off by the
    // call's timeout, with the throughput.
    const exact = await run(c, sid, `head -c ${64 << 20} /dev/zero`, { timeout_s: 60 }, { timeout: 120000 });
    assert.equal(exact.stdout_bytes, 64 << 20);
    assert.equal(exact.stdout_truncated, true);
    assert.equal(exact.stdout.length, 65536);
    const n = await withNeighbour(s, nb, () => run(c, sid, `head -c ${GiB} /dev/zero`, { timeout_s: 15 }, { timeout: 60000 }));
    const r = n.result;
    assert.equal(r.timed_out, true, `1 GiB came through within 15 s: ${JSON.stringify({ ...r, stdout: undefined })}`);
    assert.ok(r.stdout_bytes > 0 && r.stdout_bytes < GiB, `stdout_bytes ${r.stdout_bytes}`);
    assert.equal(r.stdout.length, 65536);
    const grew = vmRssKiB(s.pid, 'VmRSS') - rss0;
    assert.ok(grew < 64 * 1024, `the server's RSS grew by ${grew} KiB`);
    const rate = r.stdout_bytes / 1048576 / (r.duration_ms / 1000);
    t.diagnostic(`output (vm, TCG): 64 MiB counted exactly in ${exact.duration_ms} ms; 1 GiB cut at the 15 s timeout after ${(r.stdout_bytes / 1048576).toFixed(0)} MiB (${rate.toFixed(1)} MiB/s, 1 GiB would take ~${(1024 / rate).toFixed(0)} s); 65536 bytes kept; server RSS ${rss0} -> ${rss0 + grew} KiB; ${n.line}`);
  });

  test('closes its stdout and keeps running: the call returns when the shell exits, or at the timeout', T, async (t) => {
    const sid = await victim(t);
    const k = uniqueSleepSecs();
    // The shell closes stdout and stderr, leaves a process running, exits.
    const n = await withNeighbour(s, nb, () => run(c, sid, `exec >&- 2>&-; sleep ${k} &`, { timeout_s: 30 }));
    const r = n.result;
    assert.equal(r.exit_code, 0);
    assert.equal(r.timed_out, false);
    assert.ok(r.duration_ms < 5000, `the call waited ${r.duration_ms} ms for a background process`);
    assert.equal(await sh(c, sid, `ps | grep -c "[s]leep ${k}" || true`), '1\n', 'the background process did not keep running');
    // The shell itself keeps running with its stdout closed: the call ends at
    // its timeout, not when stdout closes and not later.
    const r2 = await run(c, sid, 'exec >&- 2>&-; sleep 1000', { timeout_s: 3 });
    assert.equal(r2.timed_out, true);
    assert.ok(r2.duration_ms >= 2900 && r2.duration_ms < 8000, `ended after ${r2.duration_ms} ms with a 3 s timeout`);
    await sh(c, sid, `pkill -f 'sleep ${k}'; true`);
    t.diagnostic(`closed stdout: background case returned in ${r.duration_ms} ms (the process kept running), foreground case timed out at ${r2.duration_ms} ms of 3000; ${n.line}`);
  });

  test('ignores SIGTERM at its timeout: killed at the deadline, timed_out true', T, async (t) => {
    const sid = await victim(t);
    const k = uniqueSleepSecs();
    const n = await withNeighbour(s, nb, () => run(c, sid, `trap '' TERM; sleep ${k}; echo finished`, { timeout_s: 2 }));
    const r = n.result;
    assert.equal(r.timed_out, true);
    assert.ok(!r.stdout.includes('finished'));
    assert.ok(r.duration_ms >= 1900 && r.duration_ms < 7000, `ended after ${r.duration_ms} ms with a 2 s timeout`);
    assert.equal(await sh(c, sid, `ps | grep -c "[s]leep ${k}" || true`), '0\n', 'the sleep outlived the timeout');
    t.diagnostic(`SIGTERM ignored: killed ${r.duration_ms - 2000} ms after the 2 s deadline (${r.signal ?? 'no signal'}), its process group gone; ${n.line}`);
  });

  test('loading a kernel module: refused (ns), or loaded in the guest only (vm)', T, async (t) => {
    const sid = await victim(t);
    // A real module of the guest kernel, one nothing depends on: the guest
    // loaded it at boot, so the vm variant unloads it first (this session is
    // closed afterwards). Where the VM images are missing, any file shows the
    // refusal of the ns backend (EPERM comes before the module is read).
    const ko = path.join(VM_DIR, 'modules/virtio-rng.ko');
    const data = fs.existsSync(ko) ? fs.readFileSync(ko) : Buffer.from('not a module');
    await call(c, 'write_file', { session_id: sid, path: '/root/m.ko', content_base64: data.toString('base64') });
    // (/sys/module lists built-in modules too: it exists where /proc/modules
    // does not, on a kernel without loadable modules.)
    const modules = () => fs.readdirSync('/sys/module').sort();
    const hostModules = modules();
    if (IS_VM) await sh(c, sid, 'rmmod virtio_rng && ! grep -q "^virtio_rng " /proc/modules');
    const n = await withNeighbour(s, nb, () => run(c, sid, 'insmod /root/m.ko; echo rc=$?; grep -c "^virtio_rng " /proc/modules || true'));
    const r = n.result;
    const after = modules();
    assert.deepEqual(after, hostModules, 'the host\'s module list changed');
    if (IS_NS) {
      assert.match(r.stdout, /rc=[1-9]/, JSON.stringify(r));
      assert.match(r.stderr, /Operation not permitted/, JSON.stringify(r));
      t.diagnostic(`module load (ns): refused (${r.stderr.trim().split('\n')[0]}), host modules unchanged (${after.length} in /sys/module); ${n.line}`);
    } else {
      assert.ok(fs.existsSync(ko), `${ko} is missing`);
      assert.match(r.stdout, /^rc=0\n1\n$/, `insmod in the guest: ${JSON.stringify(r)}`);
      t.diagnostic(`module load (vm): virtio_rng unloaded and loaded again in the guest kernel; host modules unchanged (${after.length} in /sys/module); ${n.line}`);
    }
  });
});

describe('a cap made small', () => {
  test('IGN_MCP_OVERLAY_MB=16 stops a 64 MB write with ENOSPC', { ...T, skip: NS_ONLY('in a microVM the overlay size is part of the warm base; the default cap is tested above') }, async (t) => {
    const s = await startServer({ fence: true, env: { IGN_MCP_OVERLAY_MB: 16 } });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    const r = await run(s.client, sid, 'dd if=/dev/zero of=/root/big bs=1M count=64', { timeout_s: 60 });
    assert.notEqual(r.exit_code, 0, `dd succeeded: ${r.stderr}`);
    assert.match(r.stderr, /No space/i);
    const size = Number((await sh(s.client, sid, 'wc -c < /root/big')).trim());
    assert.ok(size <= 17 * 1024 * 1024, `wrote ${size} bytes past a 16 MiB cap`);
    assert.equal(await sh(s.client, sid, 'rm /root/big; echo ok > /root/small; cat /root/small'), 'ok\n');
    t.diagnostic(`IGN_MCP_OVERLAY_MB=16: ENOSPC at ${(size / 1048576).toFixed(1)} MiB`);
  });
});

/* The host's file table: files allocated, and its size (fs.file-max). */
const hostFiles = () => {
  const [used, , max] = fs.readFileSync('/proc/sys/fs/file-nr', 'utf8').trim().split(/\s+/).map(Number);
  return { used, max };
};

describe('kernel resources shared with the host (ns)', () => {
  test('holding open files: EMFILE at 1024 per process, so a session holds at most 1024 x its pids limit; the host\'s file table is unaffected', { ...T, skip: NS_ONLY('a microVM\'s files are in its own kernel\'s table') || NEEDS_CGROUPS('the bound is 1024 x the pids limit of the session\'s cgroup') }, async (t) => {
    const PIDS = 24;
    const s = await startServer({ fence: true, env: { IGN_MCP_PIDS: PIDS } });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    await assertSandboxed(s.client, sid);
    const cg = await sessionCgroups(s.client, sid);
    assert.equal(await sh(s.client, sid, 'ulimit -n; ulimit -Hn'), '1024\n1024\n');
    const raise = await run(s.client, sid, 'ulimit -n 1025; echo rc=$?');
    assert.match(raise.stdout, /rc=[1-9]/, `the limit could be raised: ${JSON.stringify(raise)}`);
    // One shell fills every descriptor up to the limit; then a child's
    // open() gets EMFILE.
    const fill = 'i=3; while [ $i -lt 1024 ]; do eval "exec $i</bin/busybox" || break; i=$((i+1)); done';
    const one = await run(s.client, sid, `${fill}; echo filled $i; head -c 1 /bin/busybox > /dev/null; echo rc=$?`);
    assert.match(one.stdout, /^filled 1024\n/, JSON.stringify(one).slice(0, 400));
    assert.match(one.stderr, /Too many open files/, JSON.stringify(one).slice(0, 400));
    assert.match(one.stdout, /rc=[1-9]/);
    // Every process the session may have does the same and keeps them open.
    const before = hostFiles();
    const k = uniqueSleepSecs();
    // The agent, this shell and its sleep take three of the session's pids.
    const holders = PIDS - 3;
    const many = await run(s.client, sid, `n=0; while [ $n -lt ${holders} ]; do (${fill}; exec sleep ${k}) 2>/dev/null & n=$((n+1)); done; sleep 3; echo started`, { timeout_s: 60 });
    assert.equal(many.stdout, 'started\n', JSON.stringify(many).slice(0, 400));
    const during = hostFiles();
    const held = findProcs(['sleep', String(k)]).length;
    const grew = during.used - before.used;
    // Every descriptor of every process in the session, counted from the
    // host: no more than the bound, and the holders did hold theirs.
    const procs = fs.readFileSync(`${cg.pids}/cgroup.procs`, 'utf8').trim().split('\n').filter(Boolean);
    let fds = 0;
    for (const p of procs) {
      try {
        fds += fs.readdirSync(`/proc/${p}/fd`).length;
      } catch {}
    }
    assert.equal(held, holders, `${held} of ${holders} holders running`);
    assert.ok(procs.length <= PIDS, `${procs.length} processes in a session limited to ${PIDS}`);
    assert.ok(fds >= holders * 1000, `the holders hold only ${fds} descriptors: the check is blind`);
    assert.ok(fds <= PIDS * 1024, `the session holds ${fds} descriptors, over ${PIDS} x 1024`);
    // The host can still open files; its table is far from full.
    fs.closeSync(fs.openSync('/proc/self/status', 'r'));
    assert.ok(during.used < during.max / 2, `the host's file table is at ${during.used} of ${during.max}`);
    await sh(s.client, sid, `pkill -f 'slee[p] ${k}'; true`);
    t.diagnostic(`open files: EMFILE at 1024 per process; ${procs.length} processes in the session hold ${fds} descriptors (bound ${PIDS} x 1024 = ${PIDS * 1024}); the host's file table grew by ${grew} meanwhile (other tenants included), to ${during.used} of ${during.max}`);
  });

  test('queueing socket buffers: TCP connections and UDP sockets on loopback, written and never read, stay within a quarter of the memory limit (v1: memory.kmem.tcp)', { ...T, skip: TOOLS_SKIP || NS_ONLY('a microVM\'s sockets are in its own kernel and RAM') || NEEDS_CGROUPS('the limit is the session\'s memory cgroup\'s') }, async (t) => {
    const s = await startServer({ fence: true, tools: true, env: { IGN_MCP_MEMORY_MB: 64 } });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    await assertSandboxed(s.client, sid);
    const cg = await sessionCgroups(s.client, sid);
    const v1 = fs.existsSync(`${cg.memory}/memory.kmem.tcp.limit_in_bytes`);
    const limit = v1 ? readInt(`${cg.memory}/memory.kmem.tcp.limit_in_bytes`) : readInt(`${cg.memory}/memory.max`);
    if (v1) assert.equal(limit, (64 << 20) / 4, 'the session\'s TCP buffer limit is not a quarter of its 64 MiB');
    const sockstat = (proto = 'TCP') => Number(fs.readFileSync('/proc/net/sockstat', 'utf8').match(new RegExp(`^${proto}: .* mem (\\d+)$`, 'm'))[1]) * 4096;
    const hostBefore = sockstat();
    // 29 connections, each written without blocking until the kernel says
    // EAGAIN; the reader never reads.  The writer then holds them open.
    const py = [
      'import socket, sys, time',
      'srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(64)',
      'conns, total = [], 0',
      'for i in range(29):',
      '    c = socket.create_connection(srv.getsockname()); a, _ = srv.accept(); c.setblocking(False); conns.append((c, a))',
      '    while True:',
      '        try: total += c.send(b"x" * 65536)',
      '        except BlockingIOError: break',
      'print(total, flush=True)',
      'time.sleep(30)',
    ].join('\n');
    await call(s.client, 'write_file', { session_id: sid, path: '/root/flood.py', content_base64: Buffer.from(py).toString('base64') });
    const r = await run(s.client, sid, 'python3 /root/flood.py > /root/queued & for i in $(seq 200); do [ -s /root/queued ] && break; sleep 0.1; done; cat /root/queued', { timeout_s: 60 });
    const queued = Number(r.stdout.trim());
    assert.ok(queued > 0, `the writer queued nothing: ${JSON.stringify(r).slice(0, 400)}`);
    const hostDuring = sockstat();
    const peak = v1 ? readInt(`${cg.memory}/memory.kmem.tcp.max_usage_in_bytes`) : readInt(`${cg.memory}/memory.peak`);
    await sh(s.client, sid, 'pkill -f floo[d].py; true');
    assert.equal(await sh(s.client, sid, 'echo alive'), 'alive\n');
    const figure = `${(queued / 1048576).toFixed(1)} MiB queued on 29 unread loopback connections; the session's TCP memory peaked at ${(peak / 1048576).toFixed(1)} MiB of ${(limit / 1048576).toFixed(0)} MiB; host sockstat TCP mem ${(hostBefore / 1048576).toFixed(1)} -> ${(hostDuring / 1048576).toFixed(1)} MiB`;
    // The kernel still grants each socket a little past the limit (the first
    // buffer of a send, a FIN: forced charges), so the bound is the limit
    // plus that much per connection; without the limit the same writer
    // queues some 4 MiB per connection.
    const slack = 29 * (128 << 10);
    assert.ok(queued <= limit + slack, figure);
    if (v1) assert.ok(peak <= limit + slack, figure);

    // UDP: 400 sockets, each sent datagrams until EAGAIN, never read.  The
    // datagrams that do not fit are dropped; what is queued counts against
    // the same limit.  (sockstat's figure is the host's: other tenants add a
    // little.)
    const udp = [
      'import socket, time',
      'keep = []',
      'for i in range(400):',
      '    r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); r.bind(("127.0.0.1", 0))',
      '    w = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); w.setblocking(False); keep.append((r, w))',
      '    for j in range(64):',
      '        try: w.sendto(b"x" * 8000, r.getsockname())',
      '        except BlockingIOError: break',
      'print("sent", flush=True)',
      'time.sleep(30)',
    ].join('\n');
    await call(s.client, 'write_file', { session_id: sid, path: '/root/udp.py', content_base64: Buffer.from(udp).toString('base64') });
    const udpBefore = sockstat('UDP');
    const u = await run(s.client, sid, 'python3 /root/udp.py > /root/sent & for i in $(seq 300); do [ -s /root/sent ] && break; sleep 0.1; done; cat /root/sent', { timeout_s: 60 });
    assert.equal(u.stdout, 'sent\n', JSON.stringify(u).slice(0, 400));
    const udpDuring = sockstat('UDP');
    await sh(s.client, sid, 'pkill -f ud[p].py; true');
    const udpFigure = `UDP: 400 unread sockets queued ${((udpDuring - udpBefore) / 1048576).toFixed(1)} MiB (host sockstat UDP mem ${(udpBefore / 1048576).toFixed(1)} -> ${(udpDuring / 1048576).toFixed(1)} MiB); without the limit each may hold its 208 KiB receive buffer, 81 MiB in all`;
    assert.ok(udpDuring - udpBefore > 1 << 20, `the UDP sockets queued almost nothing: the check is blind; ${udpFigure}`);
    if (v1) assert.ok(udpDuring - udpBefore <= limit + (1 << 20), udpFigure);
    t.diagnostic(`TCP buffers: ${figure}; ${udpFigure}`);
  });
});
