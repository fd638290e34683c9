// vm.test.mjs: what only the microVM backend promises, checked from the
// outside: clones of one snapshot get fresh identities and the host's clock,
// open_session says how a clone was made, every QEMU is confined, the guest
// never has a network device (egress goes through the broker), QEMUs and their state directories live exactly
// as long as their session and server, and the store of warm bases follows
// its inputs. Runs only with IGN_TEST_BACKEND=vm (tests/run.sh e2e-vm).
//
// QEMUs are found among the server's descendants (comm qemu-system-x86), or,
// once their server is gone, by their stdout: <run dir>/<server pid>-<n>/
// qemu.log. A clone's hostname is ign-<server pid>-<n>, the same <n>.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import {
  startServer, startRaw, call, callErr, openSession, run, sh, sleep, waitUntil, uniq, uniqueSleepSecs,
  VM_ONLY, VM_DIR, VM_RUN_DIR, qemuChildren, qemusOf, vmStateDirs, isAlive, tempStore, tempKernel,
  hardKill,
} from './lib.mjs';

const SKIP = VM_ONLY('IGN_TEST_BACKEND=vm');
const T = { timeout: 180_000, skip: SKIP };
const VM_UID_BASE = 0x49474e00;
const VM_UID_SPAN = 4096;
/* No pool and no waiting QEMU: the only QEMUs are the sessions' own. */
const NO_POOL = { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 };
/* The suite runs as root or as an ordinary user (then QEMUs are confined in
 * user namespaces instead of running as uids of their own). */
const AS_ROOT = process.getuid() === 0;
/* A home directory the QEMUs must not see, which this user may write to. */
const HOME = AS_ROOT ? '/root' : os.homedir();
const REAL_QEMU = process.env.IGN_TEST_QEMU || '/usr/bin/qemu-system-x86_64';

/* Exactly one QEMU child of the server (with NO_POOL and one session). */
async function soleQemu(serverPid) {
  const qs = await waitUntil(() => {
    const q = qemuChildren(serverPid);
    return q.length === 1 ? q : null;
  }, { timeoutMs: 5000 });
  assert.ok(qs, `expected exactly one QEMU under server ${serverPid}: ${JSON.stringify(qemuChildren(serverPid))}`);
  return qs[0];
}

function status(pid) {
  const s = fs.readFileSync(`/proc/${pid}/status`, 'utf8');
  const get = (k) => (s.match(new RegExp(`^${k}:\\s*(.*)$`, 'm')) || [])[1];
  return { get, text: s };
}

/* The state directory of the session whose guest has this hostname. */
function stateDirOf(hostname) {
  const m = hostname.trim().match(/^ign-(\d+-\d+)$/);
  assert.ok(m, `hostname ${JSON.stringify(hostname)} is not ign-<server pid>-<n>`);
  return path.join(VM_RUN_DIR, m[1]);
}

/* Wait until the pool has filled: QEMUs = sessions + pool + spares, plus a
 * moment for the last clone to be restored, run once and stopped. */
async function poolFilled(serverPid, sessions, pool = 2, spares = 1) {
  const ok = await waitUntil(() => qemuChildren(serverPid).length >= sessions + pool + spares, { timeoutMs: 30000, intervalMs: 100 });
  assert.ok(ok, `the pool did not fill: ${qemuChildren(serverPid).length} QEMUs for ${sessions} sessions`);
  await sleep(2000);
}

/* The guest's clock against the host's, in seconds, with the host's before
 * and after the call around it. */
async function assertClockClose(c, sid, what) {
  const t0 = Date.now() / 1000;
  const g = Number((await sh(c, sid, 'date +%s')).trim());
  const t1 = Date.now() / 1000;
  assert.ok(g >= Math.floor(t0) - 2 && g <= Math.ceil(t1) + 2, `${what}: guest clock ${g}, host ${t0.toFixed(1)}..${t1.toFixed(1)}`);
}

function bases(store) {
  try {
    return fs.readdirSync(store).filter((n) => /^small-base-[0-9a-f]{16}$/.test(n)).sort();
  } catch {
    return [];
  }
}

describe('clones of one snapshot', () => {
  for (const [how, env] of [['restored on demand', NO_POOL], ['handed out from the pool', {}]]) {
    test(`two clones ${how} differ in random bytes, machine-id and hostname`, T, async (t) => {
      const s = await startServer({ env });
      t.after(() => s.close());
      const c = s.client;
      if (how.includes('pool')) await poolFilled(s.pid, 0);
      const a = await call(c, 'open_session', {});
      const b = await call(c, 'open_session', {});
      assert.equal(a.path, how.includes('pool') ? 'pool' : 'restore');
      assert.equal(b.path, a.path);
      // The random bytes first: nothing has stirred the pool since the SETUP.
      const cmd = 'head -c 32 /dev/urandom | od -An -tx1 | tr -d " \\n"; echo; cat /etc/machine-id; hostname';
      const [oa, ob] = await Promise.all([sh(c, a.session_id, cmd), sh(c, b.session_id, cmd)]);
      const [ra, ma, ha] = oa.trim().split('\n');
      const [rb, mb, hb] = ob.trim().split('\n');
      assert.match(ra, /^[0-9a-f]{64}$/);
      assert.notEqual(ra, rb, 'two clones read the same bytes from /dev/urandom');
      for (const m of [ma, mb]) {
        assert.match(m, /^[0-9a-f]{32}$/);
        assert.notEqual(m, '0'.repeat(32), 'the machine-id is the placeholder of the pool warm-up');
      }
      assert.notEqual(ma, mb, 'two clones share a machine-id');
      assert.notEqual(ha, hb, 'two clones share a hostname');
      for (const h of [ha, hb]) {
        assert.match(h, new RegExp(`^ign-${s.pid}-\\d+$`));
        assert.ok(fs.existsSync(path.join(stateDirOf(h), 'qemu.log')), `no state directory for ${h}`);
      }
      // And again after a reset: a new identity, not the old one back.
      await call(c, 'reset', { session_id: a.session_id });
      const [ra2, ma2, ha2] = (await sh(c, a.session_id, cmd)).trim().split('\n');
      assert.ok(![ra, rb].includes(ra2) && ![ma, mb].includes(ma2) && ![ha, hb].includes(ha2), `reset kept an identity: ${ra2} ${ma2} ${ha2}`);
    });
  }
});

describe('the agent\'s share of the guest', () => {
  test('commands run in a cgroup of their own with CPU weight 1, the agent (PID 1) in the root one, also in background processes and after a reset', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const c = s.client;
    const sid = await openSession(c);
    const look = 'cat /proc/self/cgroup; cat /proc/1/cgroup; cat /sys/fs/cgroup/commands/cpu.weight; (sh -c "cat /proc/self/cgroup" &); wait; sleep 0.2';
    for (const when of ['a clone', 'after a reset']) {
      const [self, agent, weight, bg] = (await sh(c, sid, look)).trim().split('\n');
      assert.equal(self, '0::/commands', `${when}: a command's cgroup`);
      assert.equal(agent, '0::/', `${when}: the agent's cgroup`);
      assert.equal(weight, '1', `${when}: the commands' cpu.weight`);
      assert.equal(bg, '0::/commands', `${when}: a background process's cgroup`);
      await call(c, 'reset', { session_id: sid });
    }
  });
});

describe('clock', () => {
  test('a clone of an older snapshot has the host clock (restored on demand, and from the pool)', T, async (t) => {
    const store = tempStore();
    t.after(() => store.remove());
    const env = { ...NO_POOL, IGN_MCP_STORE: store.dir };
    // A fresh store: the first open makes the base.
    const s1 = await startServer({ env });
    const first = await call(s1.client, 'open_session', {});
    await s1.close();
    const [base] = bases(store.dir);
    assert.ok(base, `no base in ${store.dir}: ${fs.readdirSync(store.dir)}`);
    const made = fs.statSync(path.join(store.dir, base, 'state')).mtimeMs;
    // Let the snapshot age: a clone that kept its snapshot's clock would be
    // this far behind.
    await sleep(Math.max(0, made + 6000 - Date.now()));
    assert.ok(Date.now() - made >= 5000);

    const s2 = await startServer({ env });
    t.after(() => s2.close());
    const o = await call(s2.client, 'open_session', {});
    assert.equal(o.path, 'restore');
    assert.deepEqual(bases(store.dir), [base], 'the base was made again');
    await assertClockClose(s2.client, o.session_id, `restored from a ${((Date.now() - made) / 1000).toFixed(0)} s old snapshot`);
    assert.ok(first.session_id);

    // A pool clone is stopped from when it is made until it is handed out.
    const s3 = await startServer({ env: { IGN_MCP_STORE: store.dir } });
    t.after(() => s3.close());
    await poolFilled(s3.pid, 0);
    await sleep(5000);
    const p = await call(s3.client, 'open_session', {});
    assert.equal(p.path, 'pool');
    await assertClockClose(s3.client, p.session_id, 'a clone stopped in the pool for 5 s and more');
  });

  // A busy host delays a guest's timer interrupts, which the kernel's
  // clocksource watchdog took for a bad TSC: the guest fell back to
  // refined-jiffies, a clock in 4 ms steps, and a resolver's A and AAAA
  // queries, made in one step, got the same ID (glibc takes it from the
  // clock), so nslookup dropped the AAAA answer and waited out its 5 s on
  // every name. Stopping the QEMU three times for 300 ms did it every time.
  test('a guest stopped by a busy host keeps its fine clock, and a resolver\'s queries are each answered once', T, async (t) => {
    const s = await startServer({ env: NO_POOL });
    t.after(() => s.close());
    const c = s.client;
    const o = await call(c, 'open_session', {});
    const q = await soleQemu(s.pid);
    for (let k = 0; k < 3; k++) {
      process.kill(q.pid, 'SIGSTOP');
      await sleep(300);
      process.kill(q.pid, 'SIGCONT');
      await sleep(700);
    }
    const cs = (await sh(c, o.session_id, 'cat /sys/devices/system/clocksource/clocksource0/current_clocksource')).trim();
    assert.match(cs, /^(tsc|kvm-clock)$/, `the guest's clocksource is ${cs}`);
    const names = ['n1', 'n2', 'n3'].map((n) => `${n}-${s.pid}.example`);
    const r = await run(c, o.session_id, names.map((n) => `nslookup ${n} >/dev/null 2>&1`).join('; '), { timeout_s: 60 });
    assert.equal(r.timed_out, false);
    const log = await call(c, 'network_log', { session_id: o.session_id });
    for (const n of names) {
      const asked = log.dns_queries.filter((x) => x.name === n).map((x) => x.type).sort();
      assert.deepEqual(asked, ['A', 'AAAA'], `${n} was asked ${JSON.stringify(asked)}: an answer went unread and the query was sent again`);
    }
  });
});

describe('how a clone was made', () => {
  test('default pool: a hit once the pool has filled says "pool", with no spawn or restore time', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const first = await call(s.client, 'open_session', {});
    assert.ok(['pool', 'restore'].includes(first.path), first.path);
    await poolFilled(s.pid, 1);
    const o = await call(s.client, 'open_session', {});
    assert.equal(o.backend, 'vm');
    assert.match(o.isolation, /^microvm\/(kvm|tcg)$/);
    assert.equal(o.isolation, `microvm/${o.accel}`);
    assert.equal(o.path, 'pool');
    assert.equal(o.phases_ms.spawn, 0);
    assert.equal(o.phases_ms.restore, 0);
    for (const k of ['cont', 'hello']) assert.equal(typeof o.phases_ms[k], 'number', k);
    assert.equal(typeof o.open_ms, 'number');
    assert.equal(o.rootfs, 'small');
    assert.equal(await sh(s.client, o.session_id, 'echo pooled'), 'pooled\n');
  });

  test('IGN_MCP_POOL=0 gives "restore"; with no spares either, no QEMU runs before a session', T, async (t) => {
    const s = await startServer({ env: NO_POOL });
    t.after(() => s.close());
    await sleep(2000);
    assert.deepEqual(qemuChildren(s.pid), [], 'QEMUs wait although IGN_MCP_POOL=0 and IGN_MCP_SPARES=0');
    for (let i = 0; i < 2; i++) {
      const o = await call(s.client, 'open_session', {});
      assert.equal(o.path, 'restore');
      assert.ok(o.phases_ms.restore > 0, JSON.stringify(o.phases_ms));
      assert.equal(await sh(s.client, o.session_id, 'echo restored'), 'restored\n');
    }
    assert.equal(qemuChildren(s.pid).length, 2);
  });

  test('IGN_MCP_BASE=none gives "cold": a boot per session, no base and no pool', T, async (t) => {
    const store = tempStore();
    t.after(() => store.remove());
    const s = await startServer({ env: { IGN_MCP_BASE: 'none', IGN_MCP_STORE: store.dir } });
    t.after(() => s.close());
    await sleep(2000);
    assert.deepEqual(qemuChildren(s.pid), [], 'QEMUs wait although there is no base to restore');
    const o = await call(s.client, 'open_session', {});
    assert.equal(o.path, 'cold');
    assert.match(await sh(s.client, o.session_id, 'echo booted; hostname'), new RegExp(`^booted\nign-${s.pid}-\\d+\n$`));
    const r = await call(s.client, 'reset', { session_id: o.session_id });
    assert.equal(r.path, 'cold');
    // No base and no stage: only the records of open sessions (sessions/)
    // and the egress broker's CA (egress-ca/).
    assert.deepEqual(fs.readdirSync(store.dir).filter((n) => !n.startsWith('kvm-') && n !== 'sessions' && n !== 'egress-ca'), [], 'something was put in the store');
  });
});

describe('QEMU confinement, from the outside', () => {
  test('seccomp, no_new_privs, its own uid (root) or user namespace (a user), pid, network and mount namespaces; no host home; its own state directory', T, async (t) => {
    const marker = uniq('host-marker');
    fs.writeFileSync(path.join(HOME, marker), 'host secret\n');
    t.after(() => fs.rmSync(path.join(HOME, marker), { force: true }));
    const s = await startServer({ env: NO_POOL });
    t.after(() => s.close());
    const o = await call(s.client, 'open_session', {});
    const q = await soleQemu(s.pid);
    const st = status(q.pid);
    assert.equal(st.get('Seccomp'), '2', 'QEMU runs without a seccomp filter');
    assert.equal(st.get('NoNewPrivs'), '1');
    assert.equal(st.get('CapEff'), '0000000000000000');
    const uids = st.get('Uid').split(/\s+/).map(Number);
    const gids = st.get('Gid').split(/\s+/).map(Number);
    const ns = (pid, n) => fs.readlinkSync(`/proc/${pid}/ns/${n}`);
    if (AS_ROOT) {
      assert.equal(new Set(uids).size, 1, `real, effective, saved and fs uids differ: ${uids}`);
      assert.ok(uids[0] >= VM_UID_BASE && uids[0] < VM_UID_BASE + VM_UID_SPAN, `QEMU runs as uid ${uids[0]}`);
      assert.deepEqual(new Set(gids), new Set([VM_UID_BASE]), `QEMU runs as gid ${gids}`);
      assert.ok(!st.get('Groups').split(/\s+/).includes('0'), `QEMU is in group 0: ${st.get('Groups')}`);
    } else {
      // Without root: the server's uid, in a user namespace of QEMU's own
      // where only that uid exists (and no capability survives execve).
      assert.deepEqual(new Set(uids), new Set([process.getuid()]), `QEMU runs as uid ${uids}`);
      assert.notEqual(ns(q.pid, 'user'), ns(s.pid, 'user'), 'QEMU shares the server user namespace');
      const map = fs.readFileSync(`/proc/${q.pid}/uid_map`, 'utf8').trim().split(/\s+/).map(Number);
      assert.deepEqual(map, [process.getuid(), process.getuid(), 1], 'QEMU\'s user namespace maps more than the server\'s uid');
      assert.equal(fs.readFileSync(`/proc/${q.pid}/setgroups`, 'utf8').trim(), 'deny');
    }
    assert.notEqual(ns(q.pid, 'net'), ns(s.pid, 'net'), 'QEMU shares the server network namespace');
    assert.notEqual(ns(q.pid, 'mnt'), ns(s.pid, 'mnt'), 'QEMU shares the server mount namespace');
    // PID 1 of a pid namespace of its own, whose /proc shows only itself.
    assert.notEqual(ns(q.pid, 'pid'), ns(s.pid, 'pid'), 'QEMU shares the server pid namespace');
    assert.deepEqual(st.get('NSpid').split(/\s+/).map(Number), [q.pid, 1], 'QEMU is not PID 1 of its own pid namespace');
    const seen = fs.readdirSync(`/proc/${q.pid}/root/proc`).filter((n) => /^\d+$/.test(n));
    assert.deepEqual(seen, ['1'], `QEMU's /proc shows other processes: ${seen}`);
    // What QEMU sees of the host: /home, /root and /run/user are empty.
    assert.ok(fs.existsSync(path.join(HOME, marker)));
    assert.equal(fs.existsSync(`/proc/${q.pid}/root${HOME}/${marker}`), false, `the host ${HOME} is visible to QEMU`);
    for (const d of ['/root', '/home', '/run/user']) {
      if (!fs.existsSync(d)) continue;
      assert.deepEqual(fs.readdirSync(`/proc/${q.pid}/root${d}`).filter((n) => !VM_RUN_DIR.startsWith(`${d}/${n}/`)), [], `${d} is not empty for QEMU`);
    }
    assert.match(fs.readFileSync(`/proc/${q.pid}/cmdline`, 'utf8').split('\0').join(' '), / -sandbox on,[^ ]*spawn=deny/);
    // Its stdin is /dev/null and its stdout/stderr the qemu.log of the
    // state directory named by the guest's hostname, which it owns.
    const dir = stateDirOf(await sh(s.client, o.session_id, 'hostname'));
    assert.equal(fs.readlinkSync(`/proc/${q.pid}/fd/0`), '/dev/null');
    for (const fd of [1, 2]) assert.equal(fs.readlinkSync(`/proc/${q.pid}/fd/${fd}`), path.join(dir, 'qemu.log'));
    if (AS_ROOT) assert.equal(fs.statSync(dir).uid, uids[0], 'the state directory is not the QEMU uid\'s');
    // Its qemu.log is the guest's serial console.
    const line = uniq('console-line');
    await sh(s.client, o.session_id, `echo ${line} > /dev/console`);
    assert.ok(await waitUntil(() => fs.readFileSync(path.join(dir, 'qemu.log'), 'utf8').includes(line), { timeoutMs: 3000 }), `${line} written to the guest console is not in ${dir}/qemu.log`);
    assert.equal(fs.statSync(dir).mode & 0o077, 0, `the state directory is open to others: ${(fs.statSync(dir).mode & 0o777).toString(8)}`);
    // A second session's QEMU runs as another uid (root), or in user and pid
    // namespaces of its own (a user: the same uid, so these are what keep
    // one QEMU from signalling or tracing the other).
    await call(s.client, 'open_session', {});
    const both = qemuChildren(s.pid);
    assert.equal(both.length, 2);
    if (AS_ROOT) {
      const u = both.map((x) => status(x.pid).get('Uid').split(/\s+/)[0]);
      assert.notEqual(u[0], u[1], 'two QEMUs share a uid');
    } else {
      assert.notEqual(ns(both[0].pid, 'user'), ns(both[1].pid, 'user'), 'two QEMUs share a user namespace');
    }
    assert.notEqual(ns(both[0].pid, 'pid'), ns(both[1].pid, 'pid'), 'two QEMUs share a pid namespace');
    // Neither sees the other's state directory (its console log, its
    // sockets' peer files): where they all are, each sees only its own.
    for (const x of both) {
      const own = path.dirname(fs.readlinkSync(`/proc/${x.pid}/fd/1`));
      assert.equal(path.dirname(own), VM_RUN_DIR);
      assert.deepEqual(fs.readdirSync(`/proc/${x.pid}/root${VM_RUN_DIR}`), [path.basename(own)], `QEMU ${x.pid} sees other state directories`);
    }
  });

  test('a store and state directory under hidden directories: QEMU sees only its state directory there', { ...T, timeout: 300_000 }, async (t) => {
    // As a user the store is in the home directory (~/.cache) and the state
    // directories may be in /run/user/UID: QEMU still sees nothing else of
    // them, while the golden VM writes its RAM file and clones read it.
    // (As root the QEMUs run as other uids and must reach the store: /home.)
    const under = AS_ROOT ? '/home' : HOME;
    const store = fs.mkdtempSync(path.join(under, '.e2e-store-'));
    fs.chmodSync(store, 0o755);
    t.after(() => fs.rmSync(store, { recursive: true, force: true }));
    const runtime = AS_ROOT ? null : fs.mkdtempSync(path.join(HOME, '.e2e-run-'));
    if (runtime) t.after(() => fs.rmSync(runtime, { recursive: true, force: true }));
    const marker = path.join(under, uniq('host-marker'));
    fs.writeFileSync(marker, 'host secret\n');
    t.after(() => fs.rmSync(marker, { force: true }));
    const s = await startServer({ env: { ...NO_POOL, IGN_MCP_STORE: store, ...(runtime ? { XDG_RUNTIME_DIR: runtime } : {}) } });
    t.after(() => s.close());
    const o = await call(s.client, 'open_session', {});
    assert.match(o.isolation, /^microvm\//);
    assert.equal((await run(s.client, o.session_id, 'echo ok')).stdout, 'ok\n');
    const q = await soleQemu(s.pid);
    const m = (await sh(s.client, o.session_id, 'hostname')).trim().match(/^ign-(\d+-\d+)$/);
    const dir = path.join(runtime ? path.join(runtime, 'ignition-mcp') : VM_RUN_DIR, m[1]);
    assert.ok(fs.existsSync(path.join(dir, 'qemu.log')), `no state directory ${dir}`);
    assert.equal(fs.existsSync(`/proc/${q.pid}/root${marker}`), false, `${marker} is visible to QEMU`);
    assert.equal(fs.existsSync(`/proc/${q.pid}/root${store}`), false, 'the store is visible to a clone');
    assert.ok(fs.existsSync(`/proc/${q.pid}/root${dir}/qemu.log`), 'the state directory is not visible to QEMU');
  });

  test('QEMU holds no file descriptor the server inherited from its client', T, async (t) => {
    // The server gets an open file (fd 7) and an open directory (fd 8) from
    // its parent, as a client may leak them; neither may reach a QEMU, where
    // they would outflank its mount namespace and Landlock.
    const leak = path.join(os.tmpdir(), uniq('e2e-leaked-fd'));
    fs.writeFileSync(leak, 'secret\n');
    const fd = fs.openSync(leak, 'r');
    const dfd = fs.openSync(HOME, 'r');
    t.after(() => {
      fs.closeSync(fd);
      fs.closeSync(dfd);
      fs.rmSync(leak, { force: true });
    });
    const raw = startRaw({ env: NO_POOL, extraStdio: ['ignore', 'ignore', 'ignore', 'ignore', fd, dfd] });
    t.after(() => raw.close());
    await raw.initialize();
    assert.equal(fs.readlinkSync(`/proc/${raw.pid}/fd/7`), leak, 'the server did not get the extra fds; the check is blind');
    assert.equal(fs.readlinkSync(`/proc/${raw.pid}/fd/8`), HOME);
    await raw.tool('open_session', {});
    const q = await soleQemu(raw.pid);
    const fds = Object.fromEntries(fs.readdirSync(`/proc/${q.pid}/fd`).map((f) => {
      try {
        return [f, fs.readlinkSync(`/proc/${q.pid}/fd/${f}`)];
      } catch {
        return [f, '?'];
      }
    }));
    const leaked = Object.entries(fds).filter(([, v]) => v === leak || v === HOME);
    assert.deepEqual(leaked, [], `QEMU holds fds it inherited: ${JSON.stringify(fds)}`);
  });
});

/* A QEMU that does one hostile thing before it execs the real one: it runs
 * confined as QEMU is (after every step of the spawn), so what it can do is
 * what a QEMU taken over by its guest could. */
function hostileQemu(t, script) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-hostile-qemu-'));
  fs.chmodSync(dir, 0o755);
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  const qemu = path.join(dir, 'qemu-system-x86_64');
  fs.writeFileSync(qemu, `#!/bin/sh\n${script}\nexec ${REAL_QEMU} "$@"\n`, { mode: 0o755 });
  return { dir, qemu };
}

/* Whether the QEMU maps a read-only RAM file private and writable (8.2 and
 * later: memory-backend-file has rom=). */
function qemuMapsRamReadOnly() {
  try {
    return /\n {2}rom=/.test(execFileSync(REAL_QEMU, ['-object', 'memory-backend-file,help'], { encoding: 'utf8' }));
  } catch {
    return false;
  }
}

/* The bytes a hostile clone QEMU tries to write into its RAM file. */
const SCRIBBLE = 'IGN-SCRIBBLED-RAM';

describe('an escaped QEMU, confined', () => {
  test('cannot truncate a file outside its state directory that its uid may write to', T, async (t) => {
    // Landlock confines writes; truncate(2) is a write of its own (Landlock
    // ABI 3), which a ruleset must name or it is left allowed.
    // truncate(2) by path: truncate(1) opens the file for writing first,
    // which Landlock's write rule refuses already.
    const h = hostileQemu(t, 'python3 -c "import os, sys; os.truncate(sys.argv[1], 0)" "$(dirname "$0")/victim"');
    const victim = path.join(h.dir, 'victim');
    fs.writeFileSync(victim, 'the user\'s data\n');
    fs.chmodSync(victim, 0o666); // as root: writable by the QEMU's uid too
    const store = tempStore();
    t.after(() => store.remove());
    const s = await startServer({ env: { ...NO_POOL, IGN_MCP_BASE: 'none', IGN_MCP_QEMU: h.qemu, IGN_MCP_STORE: store.dir } });
    t.after(() => s.close());
    const o = await call(s.client, 'open_session', {});
    assert.equal(await sh(s.client, o.session_id, 'echo ok'), 'ok\n');
    assert.equal(fs.readFileSync(victim, 'utf8'), 'the user\'s data\n', 'QEMU truncated a file outside its state directory');
  });

  test('cannot write the warm base\'s RAM file nor a stage\'s: both are read-only to the QEMUs of their sessions', {
    ...T,
    skip: SKIP || (!qemuMapsRamReadOnly() && `${REAL_QEMU} maps a RAM file only from a writable file (QEMU 8.2 or later is needed; SECURITY.md says so)`),
  }, async (t) => {
    // A clone's QEMU (share=off over the base's or a stage's RAM) first tries
    // to write into its RAM file, as an escaped QEMU could: by the file's own
    // name in its state directory, after trying to make it writable (a
    // user's QEMU owns it), and says on its log what it got.
    const h = hostileQemu(t, `
for a in "$@"; do
  case "$a" in memory-backend-file*share=off*) ram=$(printf '%s\\n' "$a" | sed -n 's/.*mem-path=\\([^,]*\\).*/\\1/p') ;; esac
done
if [ -n "$ram" ]; then
  chmod 0666 "$ram" 2>/dev/null
  if printf '${SCRIBBLE}' | dd of="$ram" bs=1 seek=8192 conv=notrunc 2>/dev/null; then echo "hostile: wrote $ram"; else echo "hostile: refused $ram"; fi
fi`);
    const store = tempStore();
    t.after(() => store.remove());
    const s = await startServer({ env: { ...NO_POOL, IGN_MCP_QEMU: h.qemu, IGN_MCP_STORE: store.dir } });
    t.after(() => s.close());
    const verdict = async (what) => {
      const q = await waitUntil(() => qemusOf(s.pid).find((x) => x.log && /share=off/.test(fs.readFileSync(`/proc/${x.pid}/cmdline`, 'utf8')) &&
        /hostile: /.test(fs.readFileSync(x.log, 'utf8'))), { timeoutMs: 5000 });
      assert.ok(q, `no clone QEMU of ${what} said what it tried: the check is blind`);
      const log = fs.readFileSync(q.log, 'utf8');
      assert.match(log, /hostile: refused /, `${what}: ${log.split('\n').find((l) => l.startsWith('hostile: '))}`);
      return q;
    };
    const scribbled = (file) => fs.readFileSync(file).subarray(8192, 8192 + SCRIBBLE.length).toString('latin1') === SCRIBBLE;
    const o = await call(s.client, 'open_session', {});
    assert.equal(await sh(s.client, o.session_id, 'echo ok'), 'ok\n');
    await verdict('a session from the warm base');
    const baseRam = fs.readdirSync(store.dir).filter((n) => /-base-/.test(n)).map((n) => path.join(store.dir, n, 'ram')).find((f) => fs.existsSync(f));
    assert.ok(baseRam, `no warm base's RAM file in ${store.dir}`);
    assert.equal(scribbled(baseRam), false, `${baseRam} was written`);
    await call(s.client, 'commit', { session_id: o.session_id, name: 'ro/ram' });
    await call(s.client, 'close', { session_id: o.session_id });
    const o2 = await call(s.client, 'open_session', { stage: 'ro/ram' });
    assert.equal(await sh(s.client, o2.session_id, 'echo ok'), 'ok\n');
    await verdict('a session from a stage');
    const find = (d) => fs.readdirSync(d, { withFileTypes: true }).flatMap((e) =>
      e.isDirectory() ? find(path.join(d, e.name)) : e.name === 'ram' && d !== path.dirname(baseRam) ? [path.join(d, e.name)] : []);
    const stageRams = find(store.dir);
    assert.equal(stageRams.length, 1, `expected one stage RAM file in ${store.dir}: ${stageRams}`);
    assert.equal(scribbled(stageRams[0]), false, `${stageRams[0]} was written`);
    if (AS_ROOT) {
      for (const f of [baseRam, stageRams[0]]) assert.equal(fs.statSync(f).mode & 0o222, 0o200, `${f} is writable by more than its owner`);
    }
  });

  test('a qboot.rom in the server\'s working directory is not the firmware of the base it makes', T, async (t) => {
    // QEMU looks for -bios qboot.rom in its working directory first; a
    // server started in a project holding one must not boot it.
    const store = tempStore();
    t.after(() => store.remove());
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-cwd-'));
    t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
    fs.chmodSync(dir, 0o755);
    fs.writeFileSync(path.join(dir, 'qboot.rom'), Buffer.alloc(65536, 0xf4), { mode: 0o644 }); // hlt, hlt, ...
    const s = await startServer({ env: { ...NO_POOL, IGN_MCP_STORE: store.dir }, cwd: dir });
    t.after(() => s.close());
    const o = await call(s.client, 'open_session', {});
    assert.equal((await sh(s.client, o.session_id, 'echo booted')).trim(), 'booted');
    assert.equal(bases(store.dir).length, 1, `no base in ${store.dir}`);
  });

  test('a cold-booted QEMU\'s log is bounded as a clone\'s is', T, async (t) => {
    // Its stdout is qemu.log (the guest's console): without the size limit a
    // guest, or QEMU, fills the state directory's filesystem (/run).
    const h = hostileQemu(t, 'head -c 3000000 /dev/zero');
    const store = tempStore();
    t.after(() => store.remove());
    const s = await startServer({ env: { ...NO_POOL, IGN_MCP_BASE: 'none', IGN_MCP_QEMU: h.qemu, IGN_MCP_STORE: store.dir } });
    t.after(() => s.close());
    const o = await call(s.client, 'open_session', {});
    const dir = stateDirOf(await sh(s.client, o.session_id, 'hostname'));
    const size = fs.statSync(path.join(dir, 'qemu.log')).size;
    assert.ok(size <= 1 << 20, `a cold QEMU wrote ${size} bytes to its log`);
  });
});

describe('the state directories of a user\'s server', () => {
  test('a runtime directory others may write to is refused, and open_session says so', {
    ...T,
    skip: SKIP || (AS_ROOT && 'a user\'s server only: as root the state directories are in /run/ignition-mcp'),
  }, async (t) => {
    // Another user could make /tmp/ignition-mcp-UID first, or a group could
    // write to it: then it is not the user's alone, and it is not used.
    const runtime = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-runtime-'));
    t.after(() => fs.rmSync(runtime, { recursive: true, force: true }));
    fs.mkdirSync(path.join(runtime, 'ignition-mcp'));
    fs.chmodSync(path.join(runtime, 'ignition-mcp'), 0o777);
    const s = await startServer({ env: { ...NO_POOL, XDG_RUNTIME_DIR: runtime } });
    t.after(() => s.close());
    const e = await callErr(s.client, 'open_session', {});
    assert.match(e, new RegExp(`${path.join(runtime, 'ignition-mcp')}, where the QEMUs' state directories go, is not a directory of this user's that only it may write to`));
    assert.deepEqual(fs.readdirSync(path.join(runtime, 'ignition-mcp')), [], 'the server used it');
  });
});

describe('network', () => {
  // No guest has a network device, whatever the operator allows or the
  // session asks: its connections go over the agent channel to the broker.
  for (const [env, args] of [[{}, {}], [{ IGN_MCP_NET: 'allow' }, { network: 'allow', allow_hosts: ['pypi.org'] }], [{ IGN_MCP_NET: 'open' }, { network: 'open' }]]) {
    test(`never a network device: the guest has only lo (${JSON.stringify({ ...env, ...args })})`, T, async (t) => {
      const s = await startServer({ env: { ...NO_POOL, ...env } });
      t.after(() => s.close());
      const o = await call(s.client, 'open_session', args);
      assert.equal(await sh(s.client, o.session_id, 'ls /sys/class/net'), 'lo\n');
      assert.doesNotMatch(fs.readFileSync(`/proc/${(await soleQemu(s.pid)).pid}/cmdline`, 'utf8'), /netdev|virtio-net/);
    });
  }
});

describe('QEMU lifecycle', () => {
  test('close removes the session\'s QEMU and its state directory', T, async (t) => {
    const s = await startServer({ env: NO_POOL });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    const q = await soleQemu(s.pid);
    const dir = stateDirOf(await sh(s.client, sid, 'hostname'));
    assert.ok(fs.existsSync(dir));
    await call(s.client, 'close', { session_id: sid });
    assert.ok(await waitUntil(() => !isAlive(q), { timeoutMs: 5000 }), `QEMU ${q.pid} outlived close`);
    assert.ok(await waitUntil(() => !fs.existsSync(dir), { timeoutMs: 2000 }), `${dir} outlived close`);
    assert.deepEqual(qemuChildren(s.pid), []);
  });

  test('reset replaces the QEMU: the old one and its directory go, a new one answers', T, async (t) => {
    const s = await startServer({ env: NO_POOL });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    await sh(s.client, sid, 'echo x > /root/before-reset');
    const q = await soleQemu(s.pid);
    const dir = stateDirOf(await sh(s.client, sid, 'hostname'));
    const r = await call(s.client, 'reset', { session_id: sid });
    assert.equal(r.ok, true);
    assert.equal(r.path, 'restore');
    assert.ok(await waitUntil(() => !isAlive(q), { timeoutMs: 5000 }), `the old QEMU ${q.pid} outlived reset`);
    const q2 = await soleQemu(s.pid);
    assert.notEqual(q2.pid, q.pid);
    const dir2 = stateDirOf(await sh(s.client, sid, 'hostname'));
    assert.notEqual(dir2, dir);
    assert.equal(fs.existsSync(dir), false, `${dir} outlived reset`);
    assert.equal(await sh(s.client, sid, 'test -e /root/before-reset && echo kept || echo gone'), 'gone\n');
  });

  // A QEMU killed mid-run is in faults.test.mjs, with the other faults.

  /* A server with two sessions, a background process in each and a run in
   * flight, plus its pool; returns its QEMUs. */
  async function busyVmServer() {
    const raw = startRaw();
    try {
      await raw.initialize();
      for (let i = 0; i < 2; i++) {
        const o = await raw.tool('open_session', {});
        await raw.tool('run', { session_id: o.session_id, command: `sleep ${uniqueSleepSecs()} > /dev/null 2>&1 & echo ok` });
      }
      const sid = (await raw.tool('list_sessions', {})).sessions[0].session_id;
      await raw.send({ jsonrpc: '2.0', id: 'inflight', method: 'tools/call', params: { name: 'run', arguments: { session_id: sid, command: 'sleep 60' } } });
      await poolFilled(raw.pid, 2);
      const qemus = qemuChildren(raw.pid);
      assert.ok(qemus.length >= 5, `expected 2 sessions + pool + spare QEMUs, got ${qemus.length}`);
      assert.ok(vmStateDirs(raw.pid).length >= 5, `state directories: ${vmStateDirs(raw.pid)}`);
      return { raw, qemus };
    } catch (e) {
      hardKill(raw.pid);
      throw e;
    }
  }

  for (const how of ['stdin EOF', 'SIGTERM', 'SIGKILL']) {
    test(`${how} of the server leaves no QEMU${how === 'SIGKILL' ? '; the next server removes its state directories' : ' and no state directory'}`, T, async (t) => {
      const { raw, qemus } = await busyVmServer();
      t.after(() => hardKill(raw.pid));
      if (how === 'stdin EOF') raw.endStdin();
      else process.kill(raw.pid, how);
      const ex = await raw.waitExit(10000);
      assert.ok(ex, `the server did not exit within 10 s of ${how}`);
      if (how !== 'SIGKILL') assert.equal(ex.code, 0, JSON.stringify(ex));
      const gone = await waitUntil(() => qemus.every((q) => !isAlive(q)) && qemusOf(raw.pid).length === 0, { timeoutMs: 5000 });
      assert.ok(gone, `QEMUs outlived the server (${how}): ${qemus.filter(isAlive).map((q) => q.pid)} ${qemusOf(raw.pid).map((q) => q.pid)}`);
      if (how !== 'SIGKILL') {
        assert.deepEqual(vmStateDirs(raw.pid), [], `state directories outlived the server (${how})`);
        await raw.close();
        return;
      }
      // A SIGKILLed server cannot clean up; the next one does.
      const leftDirs = vmStateDirs(raw.pid);
      assert.ok(leftDirs.length > 0, 'no state directory left by a SIGKILLed server: the check below is blind');
      const next = startRaw({ env: NO_POOL });
      t.after(() => next.close());
      await next.initialize();
      const o = await next.tool('open_session', {});
      const r = await next.tool('run', { session_id: o.session_id, command: 'echo ok' });
      assert.equal(r.stdout, 'ok\n');
      assert.deepEqual(leftDirs.filter((d) => fs.existsSync(d)), [], 'the next server left the dead one\'s state directories');
      await raw.close({ checkOrphans: true });
    });
  }

  test('a shutdown while the pool is being refilled leaves no QEMU and no state directory', T, async () => {
    // Right after an open_session the pool thread is making a clone; the
    // server must not leave that one behind either.
    const bad = [];
    for (const delay of [0, 30, 60, 100, 150]) {
      const raw = startRaw();
      try {
        await raw.initialize();
        await raw.tool('open_session', {});
        await sleep(delay);
        raw.endStdin();
        const ex = await raw.waitExit(10000);
        assert.equal(ex?.code, 0, JSON.stringify(ex));
        await waitUntil(() => qemusOf(raw.pid).length === 0, { timeoutMs: 5000 });
        await sleep(200);
        const q = qemusOf(raw.pid).map((x) => x.pid);
        const d = vmStateDirs(raw.pid);
        if (q.length || d.length) bad.push(`EOF ${delay} ms after open_session: QEMUs ${JSON.stringify(q)}, directories ${JSON.stringify(d)}`);
      } finally {
        hardKill(raw.pid);
        for (const d of vmStateDirs(raw.pid)) fs.rmSync(d, { recursive: true, force: true });
      }
    }
    assert.deepEqual(bad, []);
  });
});

describe('the store of warm bases', () => {
  test('the files servers lock (the store\'s .lock, a base\'s meta) cannot be locked by another user or a QEMU\'s uid, also when made open before', {
    ...T, timeout: 300_000,
    skip: SKIP || (!AS_ROOT && 'a root server\'s store: other uids are needed'),
  }, async (t) => {
    // An flock needs only a read-only descriptor: whoever may open these
    // could hold them, and servers would wait on a base's meta without end
    // (under the store lock) and on the store's lock until builds fail.
    const store = tempStore();
    t.after(() => store.remove());
    const env = { ...NO_POOL, IGN_MCP_STORE: store.dir };
    const locked = () => {
      const files = [path.join(store.dir, '.lock'), ...bases(store.dir).map((b) => path.join(store.dir, b, 'meta'))];
      assert.equal(files.length, 2, `no base in ${store.dir}: ${fs.readdirSync(store.dir)}`);
      const who = [[VM_UID_BASE + VM_UID_SPAN - 1, VM_UID_BASE], [65534, 65534]];
      const taken = [];
      for (const f of files) {
        for (const [uid, gid] of who) {
          try {
            execFileSync('setpriv', [`--reuid=${uid}`, `--regid=${gid}`, '--clear-groups', '/usr/bin/python3', '-c',
              'import fcntl, sys; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)', f], { stdio: 'ignore' });
            taken.push(`${f} by uid ${uid}`);
          } catch {}
        }
      }
      return taken;
    };
    const s1 = await startServer({ env });
    await call(s1.client, 'open_session', {});
    await s1.close();
    assert.deepEqual(locked(), [], 'other uids may lock the files servers wait on');
    // A store and base made by an earlier version, open to everyone.
    fs.chmodSync(path.join(store.dir, '.lock'), 0o644);
    fs.chmodSync(path.join(store.dir, bases(store.dir)[0], 'meta'), 0o644);
    const s2 = await startServer({ env });
    t.after(() => s2.close());
    await call(s2.client, 'open_session', {});
    assert.deepEqual(locked(), [], 'a lock file open to others is used as it is');
  });

  test('a fresh store gets a base on first use; a touched kernel makes a new base and the old one goes', T, async (t) => {
    const store = tempStore();
    t.after(() => store.remove());
    // A copy of the kernel whose mtime the test may change.
    const kernel = tempKernel(t);
    const env = { ...NO_POOL, IGN_MCP_STORE: store.dir, IGN_MCP_KERNEL: kernel };
    assert.deepEqual(bases(store.dir), []);

    const s1 = await startServer({ env });
    const o1 = await call(s1.client, 'open_session', {});
    assert.equal(o1.path, 'restore');
    assert.equal(await sh(s1.client, o1.session_id, 'echo one'), 'one\n');
    await s1.close();
    const first = bases(store.dir);
    assert.equal(first.length, 1, `bases after the first use: ${fs.readdirSync(store.dir)}`);
    const dir1 = path.join(store.dir, first[0]);
    for (const f of ['ram', 'state', 'meta']) assert.ok(fs.existsSync(path.join(dir1, f)), `${f} missing in ${dir1}`);
    assert.ok(fs.readFileSync(path.join(dir1, 'meta'), 'utf8').includes(kernel), 'the base\'s meta does not name the kernel it was made from');

    // Same inputs: the base is reused.
    const s2 = await startServer({ env });
    await call(s2.client, 'open_session', {});
    await s2.close();
    assert.deepEqual(bases(store.dir), first, 'the base was made again from the same inputs');

    // Only the kernel's mtime changes.
    const st = fs.statSync(kernel);
    fs.utimesSync(kernel, st.atime, new Date(st.mtimeMs + 60_000));
    const s3 = await startServer({ env });
    t.after(() => s3.close());
    const o3 = await call(s3.client, 'open_session', {});
    assert.equal(await sh(s3.client, o3.session_id, 'echo three'), 'three\n');
    const now = await waitUntil(() => {
      const b = bases(store.dir);
      return b.length === 1 && b[0] !== first[0] ? b : null;
    }, { timeoutMs: 10000 });
    assert.ok(now, `expected one new base in place of ${first[0]}: ${fs.readdirSync(store.dir)}`);
    assert.equal(fs.existsSync(dir1), false, `the outdated base ${dir1} was not removed`);
    assert.deepEqual(fs.readdirSync(store.dir).filter((n) => n.includes('.tmp-')), [], 'a half-made base is left');
  });
});
