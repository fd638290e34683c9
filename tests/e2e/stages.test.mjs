// stages.test.mjs: stages and forks (issue #11), end to end through the SDK
// on both backends: commit a live session as a named stage, start sessions
// from it, fork a session, roll one back in place, and manage the stages
// (stage_list, stage_info, stage_rm), with the store they live in checked
// from the outside.
//
// What a stage carries differs by backend and is checked as such: on vm a
// stage is the guest's memory (a background process and its in-memory
// counter go on in every session started from it), on ns the overlay's
// files (the counter's file is there, the process is not).
//
// Every server of this file uses one store of the file's own (on vm the
// warm base is built once, by the first server); the tests that need other
// inputs (a changed kernel or agent) or another cap use stores of their own.
// Stages live in <store>/stages/<name, '/' as '+'>/, with .tmp-<pid>-<n>
// (being written), .anon-<pid>-<n> (forks) and .rm-<pid>-<n> (removed but
// still used) beside them.

import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import {
  startServer, startRaw, call, callErr, sh, sleep, waitUntil, uniq, writeFile,
  IS_VM, IS_NS, BACKEND, AGENT, AS_ROOT, VM_DIR, VM_ONLY, NS_ONLY, tempStore, tempKernel, qemusOf, qemuChildren, qemuProcs, vmStateDirs, hardKill,
} from './lib.mjs';

const T = { timeout: 300_000 };
const T_LONG = { timeout: 600_000 };

/* The file's own store; on vm no pool and no spare QEMU (sessions from a
 * stage never come from the pool, and TCG has two cores to share). */
const STORE = tempStore('e2e-stages');
after(() => STORE.remove());
const NO_POOL = IS_VM ? { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } : {};
const ENV = { ...NO_POOL, IGN_MCP_STORE: STORE.dir };
const CARRIES = IS_VM ? 'memory' : 'files';
const NAME_RULE = '[a-z0-9][a-z0-9._/-]{0,127}';
const STAGE_ID = /^st-[0-9a-f]{32}$/;
/* Whether a session may delete the rootfs's own files: on vm, and on ns for
 * a root server (its idmapped rootfs); a user's ns server sees the rootfs's
 * files as nobody's, so its deletions are tested in /root across a chain. */
const ROOTFS_RW = IS_VM || AS_ROOT;
const BASE_ID = /^b-[0-9a-f]{16}$/;

/* A server on the file's store (or ENV overridden by env), closed (and
 * checked: no process, QEMU or state directory left) after the test. */
async function server(t, env = {}) {
  const s = await startServer({ env: { ...ENV, ...env } });
  SERVERS.add(s.pid);
  t.after(() => s.close());
  return s;
}
/* The pids of every server this file started (for the last test). */
const SERVERS = new Set();

function stagesDir(store = STORE.dir) {
  return path.join(store, 'stages');
}

/* Where stage NAME's files are. */
function stageDir(name, store = STORE.dir) {
  return path.join(stagesDir(store), name.replaceAll('/', '+'));
}

/* The entries of <store>/stages that are not named stages: temporary
 * (.tmp-), anonymous (.anon-) and removed (.rm-) stages; of the server PID
 * only when given (.rm- directories name the server that moved them).  A
 * live vm server may keep a .tmp- directory ready for its next commit, so
 * while servers run only KINDS 'anon' and 'rm' are looked at. */
function hiddenStageDirs(store = STORE.dir, pid = null, kinds = ['tmp', 'anon', 'rm']) {
  let names;
  try {
    names = fs.readdirSync(stagesDir(store));
  } catch {
    return [];
  }
  const re = new RegExp(`^\\.(${kinds.join('|')})-${pid === null ? '' : `${pid}-`}`);
  return names.filter((n) => re.test(n)).sort();
}
const LIVE = ['anon', 'rm'];

async function open(c, stage) {
  const o = await call(c, 'open_session', stage === undefined ? {} : { stage });
  assert.equal(typeof o.session_id, 'string');
  return o;
}

async function commit(c, session_id, name, extra = {}) {
  return call(c, 'commit', { session_id, name, ...extra });
}

/* R (a commit's result or stage_info) names PARENT ({name, id} of the
 * stage, or null for the base) as its parent: by name or by content id
 * (and, when it gives parent_id too, that is the id). */
function assertParent(r, parent, what) {
  if (parent === null) {
    assert.equal(r.parent, null, `${what}: a parent for a stage made from the base: ${JSON.stringify(r)}`);
    return;
  }
  assert.ok(r.parent === parent.name || r.parent === parent.id, `${what}: parent ${JSON.stringify(r.parent)}, not ${parent.name} (${parent.id})`);
  if ('parent_id' in r) assert.equal(r.parent_id, parent.id, `${what}: parent_id`);
}

/* A commit's result, checked against the shape of the issue. */
function checkCommit(r, name, parent) {
  assert.equal(r.stage, name);
  assert.match(r.stage_id, STAGE_ID);
  assertParent(r, parent, `commit of ${name}`);
  assert.equal(r.carries, CARRIES);
  for (const k of ['bytes', 'commit_ms', 'paused_ms']) {
    assert.equal(typeof r[k], 'number', `commit: ${k} is not a number: ${JSON.stringify(r)}`);
    assert.ok(r[k] >= 0, `commit: ${k} < 0: ${JSON.stringify(r)}`);
  }
  assert.ok(r.bytes > 0, `commit: a stage of no bytes: ${JSON.stringify(r)}`);
}

/* What `cat FILE` prints, or "none" when it is not there. */
async function cat(c, sid, file) {
  return (await sh(c, sid, `cat ${file} 2>/dev/null || echo none`)).trim();
}

/* A background shell counting in its own memory and writing the count to
 * /root/counter every second (the counter lives in the shell's variable i:
 * a copy of the file cannot make it go on). */
const COUNTER = [
  'i=0',
  'while :; do',
  '  i=$((i + 1))',
  '  echo $i > /root/counter.new && mv /root/counter.new /root/counter',
  '  sleep 1',
  'done',
  '',
].join('\n');

async function startCounter(c, sid) {
  await writeFile(c, sid, '/root/count.sh', COUNTER);
  await sh(c, sid, 'sh /root/count.sh > /dev/null 2>&1 &');
  const ok = await waitUntil(async () => Number(await cat(c, sid, '/root/counter')) >= 2, { timeoutMs: 20000, intervalMs: 500 });
  assert.ok(ok, `the counter did not start: ${await cat(c, sid, '/root/counter')}`);
}

async function counterRunning(c, sid) {
  const ps = await sh(c, sid, 'ps -o args 2>/dev/null || ps');
  return ps.includes('sh /root/count.sh');
}

/* The counter of session SID, twice 2.5 s apart: [first, second]. */
async function counterTwice(c, sid) {
  const a = Number(await cat(c, sid, '/root/counter'));
  await sleep(2500);
  const b = Number(await cat(c, sid, '/root/counter'));
  return [a, b];
}

/* Checks, in session SID started from a stage committed while the counter
 * read AT_COMMIT or more: on vm the process goes on from where it was (its
 * count is in memory), on ns only its file is there and it stays still. */
async function assertCounterCarried(c, sid, atCommit, what) {
  const [a, b] = await counterTwice(c, sid);
  if (IS_VM) {
    assert.ok(a >= atCommit, `${what}: the counter is at ${a}, below ${atCommit} when it was committed: it started over`);
    assert.ok(b > a, `${what}: the counter does not go on (${a} then ${b}): the process was not carried`);
    assert.ok(await counterRunning(c, sid), `${what}: no counting process`);
  } else {
    assert.ok(a >= atCommit - 1 && a > 0, `${what}: the counter's file is not carried: ${a} (committed at ${atCommit})`);
    assert.equal(b, a, `${what}: the counter goes on in a files-only stage (${a} then ${b})`);
    assert.equal(await counterRunning(c, sid), false, `${what}: a process came along with a files-only stage`);
  }
}

/* 32 random bytes, the machine-id and the hostname, read first thing. */
const IDENTITY = 'head -c 32 /dev/urandom | od -An -tx1 | tr -d " \\n"; echo; cat /etc/machine-id 2>/dev/null || echo none; hostname';

async function identity(c, sid) {
  const [rnd, mid, host] = (await sh(c, sid, IDENTITY)).trim().split('\n');
  assert.match(rnd, /^[0-9a-f]{64}$/);
  return { rnd, mid, host };
}

function assertAllDiffer(list, key, what) {
  const seen = new Map();
  for (const [who, v] of list) {
    assert.ok(!seen.has(v[key]), `${what}: ${who} and ${seen.get(v[key])} share the ${key} ${v[key]}`);
    seen.set(v[key], who);
  }
}

describe('commit and open_session(stage)', () => {
  test('a session from a stage sees the files of the committed session; the stage is in the store', T, async (t) => {
    const s = await server(t);
    const c = s.client;
    const a = await open(c);
    assert.equal(a.stage ?? null, null, 'a session from the base names a stage');
    assert.equal(a.stage_id ?? null, null);
    const data = uniq('payload');
    await writeFile(c, a.session_id, '/root/marker.txt', data);
    await sh(c, a.session_id, 'mkdir -p /opt/app/deps && echo dep > /opt/app/deps/lib.txt && ln -s deps/lib.txt /opt/app/link');
    const name = `commit-${process.pid}/basic`;
    const r = await commit(c, a.session_id, name);
    checkCommit(r, name, null);
    // The files are in the store, in the backend's layout.
    const dir = stageDir(name);
    assert.ok(fs.existsSync(path.join(dir, 'meta.json')), `no ${dir}/meta.json: ${fs.readdirSync(stagesDir())}`);
    for (const f of IS_VM ? ['ram', 'state'] : ['layer']) assert.ok(fs.existsSync(path.join(dir, f)), `no ${f} in ${dir}`);
    assert.equal(fs.statSync(stagesDir()).mode & 0o077, 0, `${stagesDir()} is open to others: ${(fs.statSync(stagesDir()).mode & 0o777).toString(8)}`);
    // The source keeps running, unchanged.
    assert.equal(await cat(c, a.session_id, '/root/marker.txt'), data);
    await sh(c, a.session_id, 'echo after > /root/after-commit');

    const b = await open(c, name);
    assert.equal(b.stage, name);
    assert.equal(b.stage_id, r.stage_id);
    if (IS_VM) {
      assert.equal(b.path, 'stage');
      // As root its QEMU (as every QEMU of the server) runs as a uid of its
      // own, which cannot enter stages/ (0700, the server's). (A user's
      // QEMUs do not see the default store, under the home directory:
      // vm.test.mjs, 'a store and state directory under hidden directories'.)
      if (AS_ROOT) {
        const qs = qemuChildren(s.pid);
        assert.ok(qs.length >= 2, `QEMUs of the server: ${JSON.stringify(qs)}`);
        const owner = fs.statSync(stagesDir()).uid;
        for (const q of qs) {
          const uid = Number(fs.readFileSync(`/proc/${q.pid}/status`, 'utf8').match(/^Uid:\s+(\d+)/m)[1]);
          assert.notEqual(uid, owner, `QEMU ${q.pid} runs as the owner of ${stagesDir()}`);
        }
      }
    }
    assert.notEqual(b.session_id, a.session_id);
    assert.equal(await cat(c, b.session_id, '/root/marker.txt'), data);
    assert.equal(await cat(c, b.session_id, '/opt/app/link'), 'dep');
    assert.equal(await cat(c, b.session_id, '/root/after-commit'), 'none', 'a change made after the commit is in the stage');
    // A session from a stage is a session like any other.
    await writeFile(c, b.session_id, '/root/from-b', 'b');
    assert.equal(await cat(c, a.session_id, '/root/from-b'), 'none', 'the session from the stage wrote into its source');
    const l = await call(c, 'list_sessions', {});
    assert.deepEqual(l.sessions.map((x) => x.session_id).sort(), [a.session_id, b.session_id].sort());
  });

  test(`a background process and its in-memory counter ${IS_VM ? 'go on' : 'do not go on (files only)'} in a session from the stage`, T, async (t) => {
    const s = await server(t);
    const c = s.client;
    const a = await open(c);
    await startCounter(c, a.session_id);
    const before = Number(await cat(c, a.session_id, '/root/counter'));
    const name = `counter-${process.pid}`;
    const r = await commit(c, a.session_id, name);
    assert.equal(r.carries, CARRIES);
    // The source's counter goes on through the commit.
    const [sa, sb] = await counterTwice(c, a.session_id);
    assert.ok(sb > sa && sa >= before, `the source's counter stopped at the commit: ${before}, ${sa}, ${sb}`);
    const b = await open(c, name);
    await assertCounterCarried(c, b.session_id, before, 'a session from the stage');
  });

  test('vm: the stage\'s RAM file stores zero pages as holes, beside the device state', { ...T, skip: VM_ONLY('a RAM file is the vm backend\'s') }, async (t) => {
    const s = await server(t);
    const c = s.client;
    const a = await open(c);
    const name = `holes-${process.pid}`;
    const r = await commit(c, a.session_id, name);
    const ram = fs.statSync(path.join(stageDir(name), 'ram'));
    const state = fs.statSync(path.join(stageDir(name), 'state'));
    assert.equal(ram.size, 256 * 1024 * 1024, 'the RAM file is not the guest\'s 256 MiB');
    assert.ok(state.size > 0);
    const used = ram.blocks * 512;
    assert.ok(used < ram.size * 0.9, `the RAM file of an idle guest has ${used} of ${ram.size} bytes allocated: zero pages were not punched out`);
    assert.ok(r.bytes >= used && r.bytes <= used + state.blocks * 512 + 1024 * 1024, `commit says ${r.bytes} bytes, the files take ${used} + ${state.blocks * 512}`);
    // Against the warm base's RAM file (the issue's target is 1.1x; bench/
    // measures it, here only a bound that catches a RAM file without holes).
    const base = fs.readdirSync(STORE.dir).find((n) => /-base-[0-9a-f]{16}$/.test(n) && fs.existsSync(path.join(STORE.dir, n, 'ram')));
    if (base) {
      const b = fs.statSync(path.join(STORE.dir, base, 'ram')).blocks * 512;
      assert.ok(used <= b * 2, `the stage's RAM file takes ${used} bytes, the base's ${b}`);
    }
  });

  test('ns: the layer in the store keeps whiteouts and opaque directories, and strips setuid and setgid bits', { ...T, skip: NS_ONLY('a layer tree is the ns backend\'s') }, async (t) => {
    const s = await server(t);
    const c = s.client;
    // A first stage with a file and a directory, which a session from it
    // deletes and replaces: a whiteout and an opaque directory in the
    // second stage (and, where the rootfs may be changed, the same over
    // the rootfs's own /etc/group and /var).
    const p = await open(c);
    await sh(c, p.session_id, 'echo d > /root/doomed && mkdir -p /root/dir && echo old > /root/dir/old');
    const parent = `layer-${process.pid}/parent`;
    await commit(c, p.session_id, parent);
    const a = await open(c, parent);
    await sh(c, a.session_id, [
      ...(ROOTFS_RW ? ['rm /etc/group', 'rm -rf /var && mkdir -p /var/fresh'] : []),
      'rm /root/doomed',
      'rm -rf /root/dir && mkdir /root/dir && echo new > /root/dir/new',
      'echo s > /root/suid && chmod 4755 /root/suid',
      'echo g > /root/sgid && chmod 2755 /root/sgid',
      'stat -c %a /root/suid /root/sgid',
    ].join(' && '));
    const name = `layer-${process.pid}/child`;
    await commit(c, a.session_id, name);
    const layer = path.join(stageDir(name), 'layer');
    const opaqueOf = (d) => execFileSync('/usr/bin/python3', ['-c', 'import os, sys\ntry: print(os.getxattr(sys.argv[1], "user.overlay.opaque", follow_symlinks=False).decode())\nexcept OSError as e: print("none", e.errno)', d]).toString().trim();
    for (const [wf, od] of [['root/doomed', 'root/dir'], ...(ROOTFS_RW ? [['etc/group', 'var']] : [])]) {
      const wh = fs.lstatSync(path.join(layer, wf));
      assert.ok(wh.isCharacterDevice() && wh.rdev === 0, `${wf} in the layer is not a whiteout (char 0/0): mode ${wh.mode.toString(8)} rdev ${wh.rdev}`);
      assert.equal(opaqueOf(path.join(layer, od)), 'y', `the replaced ${od} is not an opaque directory in the layer`);
    }
    assert.deepEqual(fs.readdirSync(path.join(layer, 'root/dir')), ['new'], 'the replaced directory holds its old files in the layer');
    for (const f of ['root/suid', 'root/sgid']) {
      const st = fs.lstatSync(path.join(layer, f));
      assert.equal(st.uid, AS_ROOT ? 0 : process.getuid(), `${f} in the store belongs to uid ${st.uid}`);
      const m = st.mode;
      assert.equal(m & 0o6000, 0, `${f} keeps its setuid/setgid bit in the store: ${(m & 0o7777).toString(8)}`);
      assert.equal(m & 0o777, 0o755, `${f} lost its permission bits: ${(m & 0o7777).toString(8)}`);
    }
    const b = await open(c, name);
    assert.equal(await sh(c, b.session_id, 'stat -c %a /root/suid /root/sgid; ls /root/dir; test -e /root/doomed || echo no-doomed'), '755\n755\nnew\nno-doomed\n');
    if (ROOTFS_RW) assert.equal(await sh(c, b.session_id, 'ls /var; test -e /etc/group || echo no-group'), 'fresh\nno-group\n');
  });

  test('a second session from one stage is independent of the first', T, async (t) => {
    const s = await server(t);
    const c = s.client;
    const a = await open(c);
    await writeFile(c, a.session_id, '/root/shared.txt', 'v1');
    const name = `indep-${process.pid}`;
    await commit(c, a.session_id, name);
    const [b1, b2] = [await open(c, name), await open(c, name)];
    await writeFile(c, b1.session_id, '/root/shared.txt', 'changed in b1');
    await writeFile(c, b1.session_id, '/root/only-b1', 'x');
    assert.equal(await cat(c, b2.session_id, '/root/shared.txt'), 'v1');
    assert.equal(await cat(c, b2.session_id, '/root/only-b1'), 'none');
    assert.equal(await cat(c, a.session_id, '/root/only-b1'), 'none');
    // The stage itself is unchanged: a new session still sees v1.
    const b3 = await open(c, name);
    assert.equal(await cat(c, b3.session_id, '/root/shared.txt'), 'v1');
    assert.equal((await call(c, 'stage_info', { name })).sessions, 3);
  });
});

describe('fork', () => {
  for (const count of [1, 3]) {
    test(`fork count ${count}: every fork is an independent copy of the source as of the call; the source is unaffected`, T, async (t) => {
      const s = await server(t);
      const c = s.client;
      const src = await open(c);
      await writeFile(c, src.session_id, '/root/before-fork', 'before');
      const f = await call(c, 'fork', { session_id: src.session_id, count });
      assert.equal(f.sessions.length, count, JSON.stringify(f));
      assert.equal(f.carries, CARRIES);
      for (const k of ['fork_ms', 'paused_ms']) assert.equal(typeof f[k], 'number', `${k}: ${JSON.stringify(f)}`);
      const ids = f.sessions.map((x) => x.session_id);
      assert.equal(new Set([src.session_id, ...ids]).size, count + 1, `fork reused an id: ${ids}`);
      for (const x of f.sessions) {
        assert.equal(typeof x.isolation, 'string');
        assert.equal(typeof x.open_ms, 'number');
      }
      await writeFile(c, src.session_id, '/root/after-fork', 'after');
      for (const [i, id] of ids.entries()) {
        assert.equal(await cat(c, id, '/root/before-fork'), 'before', `fork ${i} lacks the source's file`);
        assert.equal(await cat(c, id, '/root/after-fork'), 'none', `fork ${i} sees a file written in the source after the fork`);
        await writeFile(c, id, `/root/fork-${i}`, String(i));
        await writeFile(c, id, '/root/before-fork', `changed by fork ${i}`);
      }
      for (const [i, id] of ids.entries()) {
        for (let j = 0; j < count; j++) {
          assert.equal(await cat(c, id, `/root/fork-${j}`), i === j ? String(j) : 'none', `fork ${i} and fork-${j}`);
        }
        assert.equal(await cat(c, id, '/root/before-fork'), `changed by fork ${i}`);
      }
      for (let j = 0; j < count; j++) assert.equal(await cat(c, src.session_id, `/root/fork-${j}`), 'none', `the source sees fork ${j}'s file`);
      assert.equal(await cat(c, src.session_id, '/root/before-fork'), 'before', 'a fork changed the source\'s file');
      const l = await call(c, 'list_sessions', {});
      assert.deepEqual(l.sessions.map((x) => x.session_id).sort(), [src.session_id, ...ids].sort());
      // A fork's stage is anonymous: not listed, and gone with its sessions.
      assert.deepEqual((await call(c, 'stage_list', {})).stages.filter((x) => !x.name), [], 'an anonymous stage is listed');
      for (const id of ids) await call(c, 'close', { session_id: id });
      const gone = await waitUntil(() => hiddenStageDirs(STORE.dir, s.pid, LIVE).length === 0, { timeoutMs: 5000 });
      assert.ok(gone, `a fork's stage outlived its sessions: ${hiddenStageDirs(STORE.dir, s.pid, LIVE)}`);
      assert.equal(await cat(c, src.session_id, '/root/before-fork'), 'before');
    });
  }

  test(`a background process and its in-memory counter ${IS_VM ? 'go on in every fork, independently' : 'are not carried by forks (files only)'}`, T, async (t) => {
    const s = await server(t);
    const c = s.client;
    const src = await open(c);
    await startCounter(c, src.session_id);
    const before = Number(await cat(c, src.session_id, '/root/counter'));
    const f = await call(c, 'fork', { session_id: src.session_id, count: 2 });
    assert.equal(f.carries, CARRIES);
    const [f1, f2] = f.sessions.map((x) => x.session_id);
    await assertCounterCarried(c, f1, before, 'fork 1');
    if (IS_VM) {
      // Stopping the counter in one fork leaves the other fork and the source counting.
      await sh(c, f1, 'kill $(ps -o pid,args | awk \'/sh \\/root\\/count.sh/ && !/awk/ { print $1 }\'); true');
      assert.equal(await counterRunning(c, f1), false, 'the counter of fork 1 did not stop');
      const [x1, x2] = await counterTwice(c, f1);
      assert.equal(x2, x1, 'fork 1\'s counter goes on after its process was killed');
    }
    await assertCounterCarried(c, f2, before, 'fork 2');
    const [sa, sb] = await counterTwice(c, src.session_id);
    assert.ok(sb > sa && sa >= before, `the source's counter stopped: ${before}, ${sa}, ${sb}`);
  });

  test('forks and stage sessions never share CRNG state, machine-id or hostname with their source or each other, and have the host clock', T, async (t) => {
    const s = await server(t);
    const c = s.client;
    const src = await open(c);
    await identity(c, src.session_id);
    const name = `crng-${process.pid}`;
    const r = await commit(c, src.session_id, name);
    // Let the stage age: a session from it that kept the stage's clock
    // would be this far behind.
    await sleep(6000);
    const f = await call(c, 'fork', { session_id: src.session_id, count: 2 });
    const st = [await open(c, name), await open(c, name)];
    const who = [
      ['the source', src.session_id],
      ...f.sessions.map((x, i) => [`fork ${i + 1}`, x.session_id]),
      ...st.map((x, i) => [`stage session ${i + 1}`, x.session_id]),
    ];
    // Read at once, before anything else has stirred their pools.
    const got = await Promise.all(who.map(async ([w, id]) => [w, await identity(c, id)]));
    assertAllDiffer(got, 'rnd', '/dev/urandom');
    assertAllDiffer(got, 'host', 'hostname');
    if (IS_VM) {
      for (const [w, v] of got) assert.match(v.mid, /^[0-9a-f]{32}$/, `${w}: machine-id ${v.mid}`);
      assertAllDiffer(got, 'mid', 'machine-id');
    } else {
      // ns: the host's kernel gives each read fresh bytes; the rootfs has no
      // machine-id of its own, and none is made.
      for (const [w, v] of got) assert.equal(v.mid, 'none', `${w}: machine-id ${v.mid}`);
    }
    // The host's clock in every one of them, the source's too (a commit and
    // a fork may stop it for a moment, which must not leave it behind).
    for (const [w, id] of who) {
      const t0 = Date.now() / 1000;
      const g = Number((await sh(c, id, 'date +%s')).trim());
      const t1 = Date.now() / 1000;
      assert.ok(g >= Math.floor(t0) - 2 && g <= Math.ceil(t1) + 2,
        `${w}: clock ${g}, host ${t0.toFixed(1)}..${t1.toFixed(1)} (the commit paused the source ${r.paused_ms} ms, the fork ${f.paused_ms} ms)`);
    }
    // And a second read in each differs from every first one.
    const again = await Promise.all(who.map(async ([w, id]) => [`${w} (again)`, await identity(c, id)]));
    assertAllDiffer([...got, ...again], 'rnd', '/dev/urandom');
  });

  test('fork count 0 and 9 are refused; a fork past IGN_MCP_MAX_SESSIONS is refused cleanly', T, async (t) => {
    const s = await server(t, { IGN_MCP_MAX_SESSIONS: 3 });
    const c = s.client;
    const src = await open(c);
    for (const count of [0, 9]) {
      const e = await callErr(c, 'fork', { session_id: src.session_id, count });
      assert.match(e, /count/, `fork count ${count}: the error does not name count: ${e}`);
      assert.match(e, count ? /8/ : /1/, `fork count ${count}: the error does not give the bound: ${e}`);
    }
    const e = await callErr(c, 'fork', { session_id: src.session_id, count: 3 });
    assert.match(e, /IGN_MCP_MAX_SESSIONS|limit|at most/i, e);
    assert.match(e, /3/, e);
    assert.match(e, /close/i, e);
    // Nothing was left of the refused fork: no session, no anonymous stage.
    assert.deepEqual((await call(c, 'list_sessions', {})).sessions.map((x) => x.session_id), [src.session_id]);
    assert.deepEqual(hiddenStageDirs(STORE.dir, s.pid, LIVE), [], 'a refused fork left its stage');
    const e2 = await callErr(c, 'fork', { session_id: 'no-such-session', count: 1 });
    assert.match(e2, /no-such-session/, e2);
    // Within the cap it works, and the cap is then full.
    const f = await call(c, 'fork', { session_id: src.session_id, count: 2 });
    assert.equal(f.sessions.length, 2);
    await callErr(c, 'open_session', {});
    assert.equal(await sh(c, src.session_id, 'echo ok'), 'ok\n');
  });
});

describe('reset to a stage', () => {
  test('reset(id, stage) rolls the session back in place under the same id; reset(id) goes back to the base', T, async (t) => {
    const s = await server(t);
    const c = s.client;
    const a = await open(c);
    await writeFile(c, a.session_id, '/root/setup-done', 'yes');
    const name = `rollback-${process.pid}`;
    const r = await commit(c, a.session_id, name);
    await writeFile(c, a.session_id, '/root/attempt', 'broken');
    await sh(c, a.session_id, 'rm /root/setup-done');
    const x = await call(c, 'reset', { session_id: a.session_id, stage: name });
    assert.equal(x.session_id, a.session_id);
    if ('stage' in x) assert.equal(x.stage, name);
    if ('stage_id' in x) assert.equal(x.stage_id, r.stage_id);
    assert.equal(await cat(c, a.session_id, '/root/setup-done'), 'yes', 'reset to the stage lost the stage\'s file');
    assert.equal(await cat(c, a.session_id, '/root/attempt'), 'none', 'reset to the stage kept a file written after the commit');
    assert.deepEqual((await call(c, 'list_sessions', {})).sessions.map((y) => y.session_id), [a.session_id]);
    assert.equal((await call(c, 'stage_info', { name })).sessions, 1);
    // Again, after another attempt: the stage itself did not change.
    await writeFile(c, a.session_id, '/root/attempt', 'broken again');
    await call(c, 'reset', { session_id: a.session_id, stage: name });
    assert.equal(await cat(c, a.session_id, '/root/attempt'), 'none');
    // Without a stage: the base.
    await call(c, 'reset', { session_id: a.session_id });
    assert.equal(await cat(c, a.session_id, '/root/setup-done'), 'none', 'reset without a stage kept the stage\'s file');
    assert.equal((await call(c, 'stage_info', { name })).sessions, 0);
    // An unknown stage is refused and leaves the session as it was.
    await writeFile(c, a.session_id, '/root/kept', 'k');
    const e = await callErr(c, 'reset', { session_id: a.session_id, stage: 'no-such-stage' });
    assert.match(e, /no stage named 'no-such-stage'/, e);
    assert.match(e, /stage_list/, e);
    assert.equal(await cat(c, a.session_id, '/root/kept'), 'k');
  });
});

describe('chains', () => {
  test('a stage made from a session started from a stage holds both; deletions carry through', T, async (t) => {
    const s = await server(t);
    const c = s.client;
    const a = await open(c);
    await writeFile(c, a.session_id, '/root/level1', 'one');
    await writeFile(c, a.session_id, '/root/doomed', 'deleted in level 2');
    // A file of the rootfs deleted, and a directory of it replaced (where
    // the rootfs may be changed).
    if (ROOTFS_RW) await sh(c, a.session_id, 'rm /etc/group && rm -rf /var && mkdir -p /var/new && echo v > /var/new/file');
    const n1 = `chain-${process.pid}/one`;
    const r1 = await commit(c, a.session_id, n1);
    const b = await open(c, n1);
    if (ROOTFS_RW) assert.equal(await cat(c, b.session_id, '/etc/group'), 'none', 'a file deleted before the commit is back');
    await writeFile(c, b.session_id, '/root/level2', 'two');
    await sh(c, b.session_id, 'rm /root/doomed');
    const n2 = `chain-${process.pid}/two`;
    const r2 = await commit(c, b.session_id, n2);
    checkCommit(r2, n2, { name: n1, id: r1.stage_id });
    const i2 = await call(c, 'stage_info', { name: n2 });
    assertParent(i2, { name: n1, id: r1.stage_id }, `stage_info(${n2})`);
    const x = await open(c, n2);
    assert.equal(await cat(c, x.session_id, '/root/level1'), 'one');
    assert.equal(await cat(c, x.session_id, '/root/level2'), 'two');
    assert.equal(await cat(c, x.session_id, '/root/doomed'), 'none', 'a file deleted in the second session is back');
    if (ROOTFS_RW) {
      assert.equal(await cat(c, x.session_id, '/etc/group'), 'none', 'a file of the rootfs deleted in the first session is back');
      assert.equal((await sh(c, x.session_id, 'ls /var')).trim(), 'new', 'a directory replaced in the first session is merged with the rootfs\'s');
    }
    assert.equal(await cat(c, x.session_id, '/etc/passwd') === 'none', false, 'the rootfs is not under the stage');
    // The first stage is unchanged by the second.
    const y = await open(c, n1);
    assert.equal(await cat(c, y.session_id, '/root/doomed'), 'deleted in level 2');
    assert.equal(await cat(c, y.session_id, '/root/level2'), 'none');
    // A third level on top, and stage_rm of the middle one: the top stands alone.
    await writeFile(c, x.session_id, '/root/level3', 'three');
    const n3 = `chain-${process.pid}/three`;
    const r3 = await commit(c, x.session_id, n3);
    assertParent(r3, { name: n2, id: r2.stage_id }, `commit of ${n3}`);
    for (const id of [b.session_id, x.session_id]) await call(c, 'close', { session_id: id });
    await call(c, 'stage_rm', { name: n2 });
    const z = await open(c, n3);
    assert.equal(await sh(c, z.session_id, 'cat /root/level1 /root/level2 /root/level3'), 'onetwothree');
  });
});

describe('names and replace', () => {
  test('invalid names are refused with the rule; an existing name only with replace: true', T, async (t) => {
    const s = await server(t);
    const c = s.client;
    const a = await open(c);
    const bad = ['', 'Upper', '.hidden', '-dash', '/abs', 'a b', 'a+b', 'semi;colon', 'ünïcode', 'x'.repeat(129), 'a\nb'];
    // Every refusal is collected, so that the rest of the test runs too.
    const ruleless = [];
    for (const name of bad) {
      const e = await callErr(c, 'commit', { session_id: a.session_id, name });
      if (!e.includes(NAME_RULE)) ruleless.push(`commit(${JSON.stringify(name)}): ${e}`);
    }
    for (const name of ['Upper', '../etc']) {
      const e = await callErr(c, 'open_session', { stage: name });
      assert.ok(e.includes(NAME_RULE) || /no stage named/.test(e), `open_session(${JSON.stringify(name)}): ${e}`);
    }
    assert.deepEqual(hiddenStageDirs(STORE.dir, s.pid, LIVE), [], 'a refused commit left a directory');
    // The longest name, and one with every allowed character.
    const long = `z${process.pid}`.padEnd(128, 'x');
    const odd = `p${process.pid}/a.b_c-d/0`;
    for (const name of [long, odd]) assert.equal((await commit(c, a.session_id, name)).stage, name);
    assert.ok(fs.existsSync(stageDir(odd)), `no ${stageDir(odd)}`);

    const name = `replace-${process.pid}`;
    await writeFile(c, a.session_id, '/root/version', '1');
    const r1 = await commit(c, a.session_id, name);
    await writeFile(c, a.session_id, '/root/version', '2');
    const e = await callErr(c, 'commit', { session_id: a.session_id, name });
    assert.match(e, /exist/i, e);
    assert.match(e, /replace/, e);
    const o1 = await open(c, name);
    assert.equal(await cat(c, o1.session_id, '/root/version'), '1', 'a refused commit changed the stage');
    const r2 = await commit(c, a.session_id, name, { replace: true });
    assert.equal(r2.stage, name);
    assert.notEqual(r2.stage_id, r1.stage_id, 'a stage of other content has the same id');
    const o2 = await open(c, name);
    assert.equal(o2.stage_id, r2.stage_id);
    assert.equal(await cat(c, o2.session_id, '/root/version'), '2');
    // The session from the replaced stage goes on.
    assert.equal(await cat(c, o1.session_id, '/root/version'), '1');
    assert.equal((await call(c, 'stage_list', {})).stages.filter((x) => x.name === name).length, 1);
    assert.deepEqual(ruleless, [], `these errors do not show the rule ${NAME_RULE}`);
  });
});

describe('again and again', () => {
  test('one session committed four times in a row under one name (replace: true): every commit answers, the last one wins', T, async (t) => {
    const s = await server(t);
    const c = s.client;
    const a = await open(c);
    const name = `again-${process.pid}`;
    const ids = [];
    for (let i = 0; i < 4; i++) {
      await writeFile(c, a.session_id, '/root/round', String(i));
      const r = await commit(c, a.session_id, name, { replace: i > 0 });
      ids.push(r.stage_id);
      assert.equal(await cat(c, a.session_id, '/root/round'), String(i), `the source after commit ${i}`);
    }
    assert.equal(new Set(ids).size, 4, `stage ids: ${ids}`);
    const o = await open(c, name);
    assert.equal(o.stage_id, ids[3]);
    assert.equal(await cat(c, o.session_id, '/root/round'), '3');
  });
});

describe('stage_list, stage_info and stage_rm', () => {
  test('stage_list and stage_info give every field', T, async (t) => {
    const MAX_MB = 65536;
    const s = await server(t, { IGN_MCP_STAGES_MAX_MB: MAX_MB });
    const c = s.client;
    const a = await open(c);
    const t0 = Date.now() / 1000;
    const name = `info-${process.pid}`;
    const r = await commit(c, a.session_id, name);
    const t1 = Date.now() / 1000;
    const b = await open(c, name);
    const i = await call(c, 'stage_info', { name });
    assert.equal(i.name, name);
    assert.equal(i.stage_id, r.stage_id);
    assertParent(i, null, 'stage_info');
    assert.equal(i.carries, CARRIES);
    assert.equal(i.backend, BACKEND);
    assert.match(i.base_id, BASE_ID);
    assert.equal(i.bytes, r.bytes);
    assert.equal(i.sessions, 1);
    const created = typeof i.created === 'number' ? i.created : Date.parse(i.created) / 1000;
    assert.ok(created >= Math.floor(t0) - 2 && created <= Math.ceil(t1) + 2, `created ${JSON.stringify(i.created)} is not between ${t0} and ${t1}`);
    // bytes: what the stage's files take on disk (allocated blocks).
    const du = duBytes(stageDir(name));
    assert.ok(Math.abs(du - i.bytes) <= Math.max(64 * 1024, du * 0.05), `stage_info says ${i.bytes} bytes, du says ${du}`);
    const l = await call(c, 'stage_list', {});
    const e = l.stages.find((x) => x.name === name);
    assert.deepEqual(e, i, 'stage_list and stage_info disagree');
    assert.equal(l.bytes_max, MAX_MB * 1024 * 1024);
    const sum = l.stages.reduce((n, x) => n + x.bytes, 0);
    assert.ok(l.bytes_used >= sum, `bytes_used ${l.bytes_used} < the stages' bytes ${sum}`);
    await call(c, 'close', { session_id: b.session_id });
    assert.equal((await call(c, 'stage_info', { name })).sessions, 0);
    const e2 = await callErr(c, 'stage_info', { name: 'no-such-stage' });
    assert.match(e2, /no stage named 'no-such-stage'/, e2);
    assert.match(e2, /stage_list/, e2);
  });

  test('stage_rm while a session from the stage runs: the session goes on, the name goes at once, the files after close', T, async (t) => {
    const s = await server(t);
    const c = s.client;
    const a = await open(c);
    await writeFile(c, a.session_id, '/root/rm-test', 'here');
    const name = `rm-${process.pid}`;
    await commit(c, a.session_id, name);
    const b = await open(c, name);
    const dir = stageDir(name);
    assert.ok(fs.existsSync(dir));
    await call(c, 'stage_rm', { name });
    assert.equal(fs.existsSync(dir), false, `${dir} is still there under its name`);
    assert.ok(!(await call(c, 'stage_list', {})).stages.some((x) => x.name === name), 'stage_list still lists it');
    assert.match(await callErr(c, 'stage_info', { name }), /no stage named/);
    assert.match(await callErr(c, 'open_session', { stage: name }), /no stage named/);
    assert.match(await callErr(c, 'stage_rm', { name }), /no stage named/);
    // The session from it goes on, reads and writes.
    assert.equal(await cat(c, b.session_id, '/root/rm-test'), 'here');
    await writeFile(c, b.session_id, '/root/still', 'alive');
    assert.equal(await cat(c, b.session_id, '/root/still'), 'alive');
    // Its files wait in a .rm- directory until the last session closes.
    assert.equal(hiddenStageDirs(STORE.dir, s.pid, ['rm']).length, 1, `no .rm- directory: ${fs.readdirSync(stagesDir())}`);
    // The name may be used again at once.
    await commit(c, a.session_id, name);
    await call(c, 'close', { session_id: b.session_id });
    const gone = await waitUntil(() => hiddenStageDirs(STORE.dir, s.pid, LIVE).length === 0, { timeoutMs: 5000 });
    assert.ok(gone, `the removed stage's files outlived its last session: ${hiddenStageDirs(STORE.dir, s.pid, LIVE)}`);
    assert.ok(fs.existsSync(dir), 'the new stage of that name is gone too');
    await call(c, 'stage_rm', { name });
    assert.equal(fs.existsSync(dir), false, 'a stage no session uses is not removed at once');
  });
});

describe('space', () => {
  test('IGN_MCP_STAGES_MAX_MB tiny: commit is refused naming the space used and stage_rm', T, async (t) => {
    const store = tempStore('e2e-stages-cap');
    t.after(() => store.remove());
    // On vm a store of its own means a warm base of its own (~10 s).
    const s = await server(t, { IGN_MCP_STORE: store.dir, IGN_MCP_STAGES_MAX_MB: 1 });
    const c = s.client;
    const a = await open(c);
    await sh(c, a.session_id, 'head -c 3000000 /dev/urandom > /root/big');
    const e = await callErr(c, 'commit', { session_id: a.session_id, name: 'too-big' });
    assert.match(e, /IGN_MCP_STAGES_MAX_MB/, e);
    assert.match(e, /MiB/, e);
    assert.match(e, /stage_rm/, e);
    assert.deepEqual((await call(c, 'stage_list', {})).stages, []);
    assert.equal(await sh(c, a.session_id, 'wc -c < /root/big'), '3000000\n', 'the session was harmed by the refused commit');
    const f = await callErr(c, 'fork', { session_id: a.session_id, count: 1 });
    assert.match(f, /IGN_MCP_STAGES_MAX_MB/, f);
    assert.deepEqual((await call(c, 'list_sessions', {})).sessions.map((x) => x.session_id), [a.session_id]);
    await s.close();
    const left = fs.readdirSync(stagesDir(store.dir)).filter((n) => n !== '.lock');
    assert.deepEqual(left, [], 'a refused commit or fork left something in the store');
  });
});

/* The bytes allocated under P (a file or a tree), as du counts them. */
function duBytes(p) {
  const seen = new Set();
  const walk = (q) => {
    const st = fs.lstatSync(q, { bigint: true });
    const key = `${st.dev}:${st.ino}`;
    if (seen.has(key)) return 0n;
    seen.add(key);
    let n = st.blocks * 512n;
    if (st.isDirectory()) for (const e of fs.readdirSync(q)) n += walk(path.join(q, e));
    return n;
  };
  return Number(walk(p));
}

/* Flips one byte of the stage's files, in place (a file of the layer on
 * ns, the device state on vm). */
function corruptStage(dir) {
  const f = IS_VM ? path.join(dir, 'state') : path.join(dir, 'layer/root/marker.txt');
  fs.chmodSync(f, fs.statSync(f).mode | 0o200);
  const fd = fs.openSync(f, 'r+');
  try {
    const size = fs.fstatSync(fd).size;
    assert.ok(size > 0, `${f} is empty`);
    const b = Buffer.alloc(1);
    const at = Math.floor(size / 2);
    fs.readSync(fd, b, 0, 1, at);
    b[0] ^= 0x5a;
    fs.writeSync(fd, b, 0, 1, at);
  } finally {
    fs.closeSync(fd);
  }
  return f;
}

describe('integrity and inputs', () => {
  test('a stage file damaged on disk: a new server refuses to open it, naming it and stage_rm', T, async (t) => {
    const name = `damaged-${process.pid}`;
    const s1 = await server(t);
    const a = await open(s1.client);
    await writeFile(s1.client, a.session_id, '/root/marker.txt', 'a marker of some length');
    await commit(s1.client, a.session_id, name);
    await s1.close();
    const f = corruptStage(stageDir(name));
    const s2 = await server(t);
    const e = await callErr(s2.client, 'open_session', { stage: name });
    assert.match(e, /damaged|checksum|corrupt/i, `${f} was changed: ${e}`);
    assert.ok(e.includes(name), e);
    assert.match(e, /stage_rm/, e);
    // Also through reset and fork's way in (reset to it).
    const b = await open(s2.client);
    await writeFile(s2.client, b.session_id, '/root/kept', 'k');
    assert.match(await callErr(s2.client, 'reset', { session_id: b.session_id, stage: name }), /damaged|checksum|corrupt/i);
    assert.equal(await cat(s2.client, b.session_id, '/root/kept'), 'k', 'a refused reset changed the session');
    assert.deepEqual((await call(s2.client, 'list_sessions', {})).sessions.map((x) => x.session_id), [b.session_id]);
    await call(s2.client, 'stage_rm', { name });
    assert.equal(fs.existsSync(stageDir(name)), false);
  });

  test(`inputs changed (${IS_VM ? 'the kernel' : 'the agent'}): the stage is refused before anything starts, naming both ids and the way out`, T_LONG, async (t) => {
    const store = tempStore('e2e-stages-inputs');
    t.after(() => store.remove());
    const env = { IGN_MCP_STORE: store.dir };
    let changed;
    if (IS_VM) {
      const kernel = tempKernel(t);
      const initramfs = path.join(path.dirname(kernel), 'initramfs.cpio');
      fs.copyFileSync(path.join(VM_DIR, 'initramfs.cpio'), initramfs);
      fs.chmodSync(initramfs, 0o644);
      Object.assign(env, { IGN_MCP_KERNEL: kernel, IGN_MCP_INITRAMFS: initramfs });
      changed = kernel;
    } else {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-agent-'));
      fs.chmodSync(dir, 0o755);
      t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
      const agent = path.join(dir, 'ign-agent');
      fs.copyFileSync(AGENT, agent);
      fs.chmodSync(agent, 0o755);
      env.IGN_MCP_AGENT = agent;
      changed = agent;
    }
    const name = 'inputs/changed';
    const s1 = await server(t, env);
    const a = await open(s1.client);
    await writeFile(s1.client, a.session_id, '/root/x', 'x');
    const r = await commit(s1.client, a.session_id, name);
    const before = (await call(s1.client, 'stage_info', { name })).base_id;
    assert.equal((await open(s1.client, name)).stage_id, r.stage_id);
    await s1.close();

    // The input changes: on vm its mtime (what the base's fingerprint
    // follows); on ns a byte more at its end as well (an ELF ignores it),
    // so that a content hash sees it too.
    if (IS_NS) fs.appendFileSync(changed, Buffer.from([0]));
    const st = fs.statSync(changed);
    fs.utimesSync(changed, st.atime, new Date(st.mtimeMs + 60_000));

    const s2 = await server(t, env);
    const c = s2.client;
    const b = await open(c);
    assert.equal(await sh(c, b.session_id, 'echo on the new inputs'), 'on the new inputs\n');
    const qemus = IS_VM ? qemusOf(s2.pid).length : 0;
    const e = await callErr(c, 'open_session', { stage: name });
    const ids = [...new Set(e.match(/b-[0-9a-f]{16}/g) ?? [])];
    assert.equal(ids.length, 2, `the error does not name both ids: ${e}`);
    assert.ok(ids.includes(before), `the error does not name the stage's base ${before}: ${e}`);
    assert.ok(e.includes(name), e);
    assert.match(e, /commit/, `the error does not give the way out: ${e}`);
    assert.match(e, /replace/, e);
    // reset to it is refused too, and leaves the session as it was.
    await writeFile(c, b.session_id, '/root/kept', 'k');
    const e2 = await callErr(c, 'reset', { session_id: b.session_id, stage: name });
    assert.equal([...new Set(e2.match(/b-[0-9a-f]{16}/g) ?? [])].length, 2, e2);
    assert.equal(await cat(c, b.session_id, '/root/kept'), 'k');
    assert.deepEqual((await call(c, 'list_sessions', {})).sessions.map((x) => x.session_id), [b.session_id]);
    if (IS_VM) assert.equal(qemusOf(s2.pid).length, qemus, 'a QEMU was started for a refused stage');
    // The way out: commit it again from a session on the current base.
    const r2 = await commit(c, b.session_id, name, { replace: true });
    assert.notEqual(r2.stage_id, r.stage_id);
    assert.notEqual((await call(c, 'stage_info', { name })).base_id, before);
    const o = await open(c, name);
    assert.equal(await cat(c, o.session_id, '/root/kept'), 'k');
  });
});

describe('servers and the store', () => {
  test('stages survive a server restart and are shared by two servers on one store', T, async (t) => {
    const n1 = `shared-${process.pid}/one`;
    const n2 = `shared-${process.pid}/two`;
    const s1 = await server(t);
    const s2 = await server(t);
    const a = await open(s1.client);
    await writeFile(s1.client, a.session_id, '/root/from-s1', 's1');
    const r1 = await commit(s1.client, a.session_id, n1);
    // The other server sees it at once, and starts sessions from it.
    assert.ok((await call(s2.client, 'stage_list', {})).stages.some((x) => x.name === n1 && x.stage_id === r1.stage_id));
    const b = await open(s2.client, n1);
    assert.equal(b.stage_id, r1.stage_id);
    assert.equal(await cat(s2.client, b.session_id, '/root/from-s1'), 's1');
    await writeFile(s2.client, b.session_id, '/root/from-s2', 's2');
    const r2 = await commit(s2.client, b.session_id, n2);
    assertParent(r2, { name: n1, id: r1.stage_id }, `commit of ${n2}`);
    // A name one server holds is refused to the other without replace.
    assert.match(await callErr(s1.client, 'commit', { session_id: a.session_id, name: n2 }), /replace/);
    // A stage one server's session uses, removed by the other: the session
    // goes on, and the files go when it closes.
    await call(s1.client, 'stage_rm', { name: n1 });
    assert.equal(await cat(s2.client, b.session_id, '/root/from-s1'), 's1');
    await s1.close();
    await s2.close();
    // A new server: the stage that was not removed is there, with its chain;
    // the removed one's files are gone (at the latest once this server has
    // looked at the store: s2 did not know the stage it used was removed).
    const s3 = await server(t);
    const l = await call(s3.client, 'stage_list', {});
    // The removed stage's files: gone once no session used it (s2 did not
    // know that the stage its session used was removed: the next server to
    // start or to make a stage removes them).
    const gone = await waitUntil(() => hiddenStageDirs(STORE.dir, s1.pid).length + hiddenStageDirs(STORE.dir, s2.pid).length === 0, { timeoutMs: 5000 });
    assert.ok(gone, `left by the servers that closed: ${hiddenStageDirs(STORE.dir, s1.pid)} ${hiddenStageDirs(STORE.dir, s2.pid)}`);
    assert.ok(!l.stages.some((x) => x.name === n1), 'a removed stage came back');
    const i = l.stages.find((x) => x.name === n2);
    assert.ok(i, `${n2} did not survive the restart: ${JSON.stringify(l.stages.map((x) => x.name))}`);
    assert.equal(i.stage_id, r2.stage_id);
    const x = await open(s3.client, n2);
    assert.equal(await sh(s3.client, x.session_id, 'cat /root/from-s1 /root/from-s2'), 's1s2');
    await commit(s3.client, x.session_id, `shared-${process.pid}/three`);
  });

  test('a server killed (SIGKILL) during a commit leaves no stage; the next server removes its temporary directory', T, async (t) => {
    const name = `killed-${process.pid}`;
    const raw = startRaw({ env: ENV });
    SERVERS.add(raw.pid);
    t.after(() => hardKill(raw.pid));
    await raw.initialize();
    const o = await raw.tool('open_session', {});
    // Something to copy, so that the commit takes a while on ns as well (on
    // vm it copies the guest's RAM, which takes long enough).
    if (IS_NS) {
      await raw.tool('run', {
        session_id: o.session_id,
        command: 'mkdir -p /root/many && cd /root/many && i=0; while [ $i -lt 3000 ]; do echo $i > f$i; i=$((i + 1)); done; head -c 40000000 /dev/urandom > /root/big; echo ok',
      }, { timeoutMs: 120000 });
    }
    const ready = hiddenStageDirs(STORE.dir, raw.pid, ['tmp']);
    const from = raw.messages.length;
    await raw.send({ jsonrpc: '2.0', id: 'commit', method: 'tools/call', params: { name: 'commit', arguments: { session_id: o.session_id, name } } });
    // The commit is in flight once a temporary directory appears (on vm
    // one may be ready before: a new one, or the ready one filling).
    const newTmp = () => hiddenStageDirs(STORE.dir, raw.pid, ['tmp']).filter((n) => !ready.includes(n));
    const seen = await waitUntil(() => newTmp().length > 0 || raw.messages.length > from, { timeoutMs: 30000, intervalMs: 2 });
    if (ready.length && !newTmp().length) await sleep(300);
    const tmp = hiddenStageDirs(STORE.dir, raw.pid, ['tmp']);
    process.kill(raw.pid, 'SIGKILL');
    assert.ok(seen && tmp.length > 0 && raw.messages.length === from, `the commit was not caught in flight: temporary directories ${tmp}, ${raw.messages.length - from} answers`);
    assert.ok(await raw.waitExit(10000), 'the server did not die');
    await raw.close();
    assert.equal(fs.existsSync(stageDir(name)), false, 'a stage was left under the name by a killed commit');
    assert.ok(hiddenStageDirs(STORE.dir, raw.pid, ['tmp']).length > 0, 'no temporary directory is left: the check below is blind');
    const s = await server(t);
    try {
      const l = await call(s.client, 'stage_list', {});
      assert.ok(!l.stages.some((x) => x.name === name), 'stage_list lists a stage of a killed commit');
      // A starting server removes what dead servers left.
      const gone = await waitUntil(() => hiddenStageDirs(STORE.dir, raw.pid).length === 0, { timeoutMs: 5000 });
      assert.ok(gone, `the next server left the dead one's temporary directory: ${hiddenStageDirs(STORE.dir, raw.pid)}`);
      assert.match(await callErr(s.client, 'open_session', { stage: name }), /no stage named/);
      // The name can be committed.
      const a = await open(s.client);
      assert.equal((await commit(s.client, a.session_id, name)).stage, name);
    } catch (e) {
      e.message += `\nthe killed server's stderr:\n${raw.stderrText().slice(-3000)}\nthe next server's stderr:\n${s.stderrText().slice(-3000)}`;
      throw e;
    }
  });

  test('after every server closed: no QEMU of this file, no temporary, anonymous or removed stage left', T, async () => {
    assert.ok(fs.existsSync(stagesDir()), `no ${stagesDir()}: no stage was ever made`);
    assert.deepEqual(hiddenStageDirs(STORE.dir), [], `left in ${stagesDir()}`);
    for (const n of fs.readdirSync(stagesDir())) {
      if (n === '.lock') continue;
      assert.ok(fs.existsSync(path.join(stagesDir(), n, 'meta.json')), `${n} in ${stagesDir()} is not a whole stage`);
    }
    // Every server checked its own processes and QEMUs at close; here again
    // for all of them at once, and their state directories.
    assert.ok(SERVERS.size > 5, `only ${SERVERS.size} servers were recorded: the check is blind`);
    if (IS_VM) {
      const left = qemuProcs().filter((q) => SERVERS.has(q.serverPid));
      assert.deepEqual(left.map((q) => `${q.pid} ${q.log}`), [], 'QEMUs of this file\'s servers still run');
      const dirs = [...SERVERS].flatMap((p) => vmStateDirs(p));
      assert.deepEqual(dirs, [], 'state directories of this file\'s servers are left');
    }
  });
});
