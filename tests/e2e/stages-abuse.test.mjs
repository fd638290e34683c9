// stages-abuse.test.mjs: a hostile sandbox against commit, fork and the
// stage store (ns backend).  Every row is an attack through the real server
// and SDK, run fenced (tests/fence.sh: its own cgroup and pid namespace), and
// asserts that the attack failed and that the stage and the host are intact:
// the store holds only what the sandbox owned, sized by what it really used;
// sessions from a stage, and forks, neither change the stage nor see each
// other.
//
// Each file gets a store of its own (IGN_MCP_STORE), so that the rows can
// look into stages/ on the host.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { startServer, call, callErr, openSession, sh, run, sleep, waitUntil, waitGone, descendants, NS_ONLY } from './lib.mjs';

const T = { timeout: 300_000 };
const MiB = 1 << 20;

const store = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-stages-abuse-'));
fs.chmodSync(store, 0o755);
process.on('exit', () => fs.rmSync(store, { recursive: true, force: true }));

const stageDir = (name) => path.join(store, 'stages', name.replaceAll('/', '+'));
const layerOf = (name) => path.join(stageDir(name), 'layer');

/* The entries of stages/ that are not stages (being made, anonymous,
 * removed); the lock file aside. */
const leftovers = () =>
  fs.existsSync(path.join(store, 'stages'))
    ? fs.readdirSync(path.join(store, 'stages')).filter((n) => n.startsWith('.') && n !== '.lock')
    : [];

const leftoversIn = (st) =>
  fs.existsSync(path.join(st, 'stages'))
    ? fs.readdirSync(path.join(st, 'stages')).filter((n) => n.startsWith('.') && n !== '.lock')
    : [];

/* Every path under DIR with lstat, no link followed. */
function walk(dir, out = []) {
  for (const e of fs.readdirSync(dir)) {
    const p = path.join(dir, e);
    const st = fs.lstatSync(p);
    out.push({ p, st });
    if (st.isDirectory()) walk(p, out);
  }
  return out;
}

describe('stages: a hostile sandbox', { skip: NS_ONLY('the ns layer copy'), ...T }, () => {
  let srv;
  before(async () => {
    srv = await startServer({ fence: true, env: { IGN_MCP_STORE: store, IGN_MCP_OVERLAY_MB: 64 } });
  });
  after(async () => {
    await srv?.close();
  });

  test('a file hard-linked many times costs the store its size once', T, async () => {
    const c = srv.client;
    const sid = await openSession(c);
    // 4 MiB, then 200 more names for it: 804 MiB if each were copied.
    await sh(c, sid, 'dd if=/dev/urandom of=/root/big bs=1M count=4 2>/dev/null && mkdir /root/l && ' +
      'i=0; while [ $i -lt 200 ]; do ln /root/big /root/l/$i; i=$((i+1)); done; stat -c %h /root/big');
    const r = await call(c, 'commit', { session_id: sid, name: 'abuse/links' });
    assert.ok(r.bytes < 8 * MiB, `the stage takes ${r.bytes} bytes for a 4 MiB file`);
    const big = fs.statSync(path.join(layerOf('abuse/links'), 'root/big'));
    assert.equal(big.nlink, 201);
    // The links work in a session from the stage, and are one file there.
    const s2 = (await call(c, 'open_session', { stage: 'abuse/links' })).session_id;
    assert.equal((await sh(c, s2, 'cmp /root/big /root/l/199 && stat -c %h /root/l/7')).trim(), '201');
    await call(c, 'close', { session_id: s2 });
    await call(c, 'close', { session_id: sid });
    await call(c, 'stage_rm', { name: 'abuse/links' });
  });

  test('setuid bits, links out, FIFOs, odd names and huge sparse files', T, async () => {
    const c = srv.client;
    const sid = await openSession(c);
    await sh(c, sid, [
      'cp /bin/busybox /root/suid && chmod 4755 /root/suid',
      'ln -s /etc/shadow /root/shadow-link && ln -s ../../../../../../etc /root/up',
      'mknod /root/fifo p',
      "touch \"/root/new\nline\" && touch \"/root/-dash\" && mkdir '/root/ sp ace'",
      'dd if=/dev/zero of=/root/sparse bs=1 count=1 seek=100G 2>/dev/null',
    ].join(' && '));
    const r = await call(c, 'commit', { session_id: sid, name: 'abuse/odd' });
    assert.ok(r.bytes < 4 * MiB + 2 * MiB, `a 100 GiB sparse file made a stage of ${r.bytes} bytes`);
    for (const { p, st } of walk(layerOf('abuse/odd'))) {
      assert.equal(st.mode & 0o6000, 0, `${p} keeps a setuid or setgid bit in the store`);
      assert.ok(!st.isBlockDevice() && !(st.isCharacterDevice() && st.rdev !== 0), `${p} is a device`);
    }
    // Nobody but the server's uid reaches a stage's files.
    for (const d of [path.join(store, 'stages'), stageDir('abuse/odd')]) {
      const st = fs.statSync(d);
      assert.equal(st.mode & 0o027, 0, `${d} is open to others or writable by its group (${(st.mode & 0o777).toString(8)})`);
      assert.equal(st.uid, process.getuid());
    }
    const root = path.join(layerOf('abuse/odd'), 'root');
    assert.equal(fs.readlinkSync(path.join(root, 'shadow-link')), '/etc/shadow');
    assert.ok(fs.lstatSync(path.join(root, 'fifo')).isFIFO());
    assert.ok(fs.existsSync(path.join(root, 'new\nline')));
    const s2 = (await call(c, 'open_session', { stage: 'abuse/odd' })).session_id;
    const out = await sh(c, s2, 'stat -c %a /root/suid; ls /root/up/ | head -3; ls /root | wc -l; ' +
      'stat -c %s /root/sparse');
    const [mode, ...rest] = out.trim().split('\n');
    assert.equal(mode, '755');
    assert.ok(rest.includes(String(100 * 1024 ** 3 + 1)), out);
    await call(c, 'close', { session_id: s2 });
    await call(c, 'close', { session_id: sid });
    await call(c, 'stage_rm', { name: 'abuse/odd' });
  });

  test('a session from a stage cannot change the stage; forks do not see each other', T, async () => {
    const c = srv.client;
    const sid = await openSession(c);
    await sh(c, sid, 'echo base > /root/marker && echo 0 > /root/counter && mkdir /root/d && echo x > /root/d/f');
    await call(c, 'commit', { session_id: sid, name: 'abuse/base' });
    const layer = layerOf('abuse/base');
    const before = fs.readFileSync(path.join(layer, 'root/marker'), 'utf8');
    const s2 = (await call(c, 'open_session', { stage: 'abuse/base' })).session_id;
    // Every way of writing a file of the stage: in place, by truncation,
    // by a new name, by removal; and its directory.
    await sh(c, s2, 'echo changed >> /root/marker; : > /root/counter; mv /root/d/f /root/d/g; ' +
      'rm -rf /root/d; chmod 777 /root; touch -d 2001-01-01 /root/marker; true');
    assert.equal(fs.readFileSync(path.join(layer, 'root/marker'), 'utf8'), before);
    assert.equal(fs.readFileSync(path.join(layer, 'root/counter'), 'utf8'), '0\n');
    assert.equal(fs.readFileSync(path.join(layer, 'root/d/f'), 'utf8'), 'x\n');
    // A commit of that session (a child stage) does not change its parent.
    await call(c, 'commit', { session_id: s2, name: 'abuse/child' });
    assert.equal(fs.readFileSync(path.join(layer, 'root/marker'), 'utf8'), before);
    assert.equal(fs.readFileSync(path.join(layer, 'root/d/f'), 'utf8'), 'x\n');
    const s3 = (await call(c, 'open_session', { stage: 'abuse/base' })).session_id;
    assert.equal(await sh(c, s3, 'cat /root/marker /root/counter /root/d/f'), 'base\n0\nx\n');
    // Forks: each its own copy.
    const f = await call(c, 'fork', { session_id: s3, count: 2 });
    const [a, b] = f.sessions.map((s) => s.session_id);
    await sh(c, a, 'echo from-a > /root/sibling && echo a >> /root/marker');
    assert.equal((await run(c, b, 'cat /root/sibling')).exit_code !== 0, true);
    assert.equal(await sh(c, b, 'cat /root/marker'), 'base\n');
    assert.equal(await sh(c, s3, 'cat /root/marker'), 'base\n');
    for (const s of [s2, s3, a, b, sid]) await call(c, 'close', { session_id: s });
    for (const n of ['abuse/base', 'abuse/child']) await call(c, 'stage_rm', { name: n });
  });

  test("a stage's layer swapped for a link after it was checked is not laid", T, async () => {
    const c = srv.client;
    const sid = await openSession(c);
    await sh(c, sid, 'echo mine > /root/mine');
    await call(c, 'commit', { session_id: sid, name: 'abuse/swap' });
    // Checked once by this server: later opens trust it.
    const s1 = (await call(c, 'open_session', { stage: 'abuse/swap' })).session_id;
    await call(c, 'close', { session_id: s1 });
    const outside = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-outside-'));
    try {
      fs.mkdirSync(path.join(outside, 'root'));
      fs.writeFileSync(path.join(outside, 'root', 'host-secret'), 'host\n');
      const layer = layerOf('abuse/swap');
      fs.renameSync(layer, `${layer}.real`);
      fs.symlinkSync(outside, layer);
      const res = await c.callTool({ name: 'open_session', arguments: { stage: 'abuse/swap' } });
      if (!res.isError) {
        const s2 = res.structuredContent.session_id;
        const r = await run(c, s2, 'cat /root/host-secret');
        await call(c, 'close', { session_id: s2 });
        assert.fail(`a session was laid over the link's target (cat: ${r.exit_code} ${r.stdout})`);
      }
      const text = res.content.map((x) => x.text).join('');
      assert.match(text, /layer is not a directory of its own.*stage_rm/s);
      fs.unlinkSync(layer);
      fs.renameSync(`${layer}.real`, layer);
      const s3 = (await call(c, 'open_session', { stage: 'abuse/swap' })).session_id;
      assert.equal(await sh(c, s3, 'cat /root/mine'), 'mine\n');
      await call(c, 'close', { session_id: s3 });
    } finally {
      fs.rmSync(outside, { recursive: true, force: true });
    }
    await call(c, 'close', { session_id: sid });
    await call(c, 'stage_rm', { name: 'abuse/swap' });
  });

  test("a commit builds on the layer its session was laid over, though another server gave the name to another stage", T, async () => {
    const c = srv.client;
    const s0 = await openSession(c);
    await sh(c, s0, 'echo old > /root/which');
    await call(c, 'commit', { session_id: s0, name: 'abuse/moved' });
    const s1 = (await call(c, 'open_session', { stage: 'abuse/moved' })).session_id;
    await sh(c, s1, 'echo s1 > /root/own');
    // What another server's stage_rm does: the stage goes aside (held, it
    // stays), and the name is free for a new stage.
    const aside = path.join(store, 'stages', '.rm-999999-1');
    fs.renameSync(stageDir('abuse/moved'), aside);
    await sh(c, s0, 'echo new > /root/which');
    await call(c, 'commit', { session_id: s0, name: 'abuse/moved' });
    await call(c, 'commit', { session_id: s1, name: 'abuse/after' });
    const s2 = (await call(c, 'open_session', { stage: 'abuse/after' })).session_id;
    assert.equal(await sh(c, s2, 'cat /root/which /root/own'), 'old\ns1\n');
    for (const s of [s0, s1, s2]) await call(c, 'close', { session_id: s });
    for (const n of ['abuse/moved', 'abuse/after']) await call(c, 'stage_rm', { name: n });
    fs.rmSync(aside, { recursive: true, force: true });
  });

  test('a stage name cannot leave the store', T, async () => {
    const c = srv.client;
    const sid = await openSession(c);
    for (const name of ['../x', '/etc', '.tmp-1-1', 'a\nb', 'A', '', 'x'.repeat(129), 'a+b']) {
      const e = await callErr(c, 'commit', { session_id: sid, name });
      assert.match(e, /invalid stage name|'name' is empty|over its cap of 128/);
    }
    // Dots and slashes are allowed, and stay one directory of stages/.
    await call(c, 'commit', { session_id: sid, name: 'a/../../x' });
    assert.ok(fs.lstatSync(path.join(store, 'stages', 'a+..+..+x')).isDirectory());
    assert.equal((await call(c, 'stage_info', { name: 'a/../../x' })).name, 'a/../../x');
    await call(c, 'stage_rm', { name: 'a/../../x' });
    await call(c, 'close', { session_id: sid });
    assert.deepEqual(fs.readdirSync(path.join(store, 'stages')).filter((n) => !n.startsWith('.')), []);
  });

  test('the sandbox cannot reach the setup tmpfs its agent keeps for commits', T, async () => {
    const c = srv.client;
    const sid = await openSession(c);
    for (const cmd of ['ls /proc/1/fd/6/upper', 'ls /proc/1/root/', 'cat /proc/1/fd/6', 'ls /proc/1/cwd/']) {
      const r = await run(c, sid, cmd);
      assert.notEqual(r.exit_code, 0, `\`${cmd}\` worked in the sandbox: ${r.stdout}`);
    }
    await call(c, 'close', { session_id: sid });
  });

  test('a sandbox that renames, relinks and swaps links while it is committed gets nothing of the host', T, async () => {
    const c = srv.client;
    const marker = path.join(os.tmpdir(), `e2e-host-marker-${process.pid}`);
    fs.writeFileSync(marker, 'host marker\n', { mode: 0o644 });
    const hostInodes = new Set([marker, '/etc/passwd', '/etc/hostname', '/bin/sh'].filter((p) => fs.existsSync(p))
      .map((p) => { const st = fs.statSync(p); return `${st.dev}:${st.ino}`; }));
    try {
      const sid = await openSession(c);
      await sh(c, sid, 'mkdir -p /root/r && cd /root/r && (while :; do mkdir -p d; echo a > d/f; ln d/f d/g 2>/dev/null; ' +
        'ln d/f h 2>/dev/null; mv d e; ln -sfn / d; ln -sfn /etc e/l; rm -rf d e h; mknod p p 2>/dev/null; rm -f p; done) >/dev/null 2>&1 &');
      for (let i = 0; i < 5; i++) {
        const r = await c.callTool({ name: 'commit', arguments: { session_id: sid, name: 'race/swap', replace: true } });
        if (r.isError) continue; // (a file that vanished mid-copy may fail it; never a host file)
        for (const { p, st } of walk(layerOf('race/swap'))) {
          assert.ok(!hostInodes.has(`${st.dev}:${st.ino}`), `${p} is a host file's inode`);
          if (st.isFile()) assert.notEqual(fs.readFileSync(p, 'utf8'), 'host marker\n', `${p} holds a host file`);
        }
      }
      await call(c, 'close', { session_id: sid });
      await c.callTool({ name: 'stage_rm', arguments: { name: 'race/swap' } });
    } finally {
      fs.rmSync(marker, { force: true });
    }
  });

  test('commit, fork, reset, close and stage_rm all at once leave the table and the store right', T, async () => {
    const c = srv.client;
    for (let round = 0; round < 4; round++) {
      const sid = await openSession(c);
      await sh(c, sid, `echo ${round} > /root/round && (while :; do echo x >> /root/busy; sleep 0.01; done) >/dev/null 2>&1 &`);
      const calls = [
        c.callTool({ name: 'commit', arguments: { session_id: sid, name: 'race/a', replace: true } }),
        c.callTool({ name: 'fork', arguments: { session_id: sid, count: 2 } }),
        c.callTool({ name: 'commit', arguments: { session_id: sid, name: 'race/b', replace: true } }),
        c.callTool({ name: 'reset', arguments: { session_id: sid, stage: 'race/a' } }),
        c.callTool({ name: 'stage_rm', arguments: { name: 'race/a' } }),
        sleep(round * 15).then(() => c.callTool({ name: 'close', arguments: { session_id: sid } })),
        c.callTool({ name: 'fork', arguments: { session_id: sid, count: 1 } }),
      ];
      const res = await Promise.all(calls);
      for (const r of res) {
        if (r.isError) assert.ok(r.content[0].text.length > 0);
        for (const f of r.structuredContent?.sessions ?? []) {
          // A fork that was made runs and holds the files of the source (or
          // of race/a of an earlier round, when the reset to it came first).
          const got = Number(await sh(c, f.session_id, 'cat /root/round'));
          assert.ok(got >= 0 && got <= round, `a fork of round ${round} holds round ${got}`);
          await call(c, 'close', { session_id: f.session_id });
        }
      }
      await c.callTool({ name: 'close', arguments: { session_id: sid } });
    }
    // The table is empty, every slot is free again, nothing is left.
    assert.deepEqual((await call(c, 'list_sessions')).sessions, []);
    const ids = [];
    for (let i = 0; i < 8; i++) ids.push(await openSession(c));
    for (const id of ids) await call(c, 'close', { session_id: id });
    for (const n of ['race/a', 'race/b']) await c.callTool({ name: 'stage_rm', arguments: { name: n } });
    assert.ok(await waitUntil(() => leftovers().length === 0, { timeoutMs: 5000 }), `left in stages/: ${leftovers()}`);
  });
});

describe('stages: the quota', { skip: NS_ONLY('the ns layer copy'), ...T }, () => {
  test('neither fork nor replace nor many small commits go past IGN_MCP_STAGES_MAX_MB', T, async () => {
    const qStore = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-stages-quota-'));
    fs.chmodSync(qStore, 0o755);
    const srv = await startServer({ fence: true, env: { IGN_MCP_STORE: qStore, IGN_MCP_OVERLAY_MB: 32, IGN_MCP_STAGES_MAX_MB: 48 } });
    const c = srv.client;
    const used = () => {
      let n = 0;
      for (const { st } of walk(path.join(qStore, 'stages'))) n += st.blocks * 512;
      return n;
    };
    try {
      const sid = await openSession(c);
      await sh(c, sid, 'dd if=/dev/urandom of=/root/a bs=1M count=20 2>/dev/null');
      await call(c, 'commit', { session_id: sid, name: 'q/one' });
      for (const [tool, args] of [['commit', { session_id: sid, name: 'q/two' }], ['fork', { session_id: sid, count: 1 }],
        ['commit', { session_id: sid, name: 'q/one', replace: true }]]) {
        const e = await callErr(c, tool, args);
        assert.match(e, /IGN_MCP_STAGES_MAX_MB.*stage_rm|stage_rm.*IGN_MCP_STAGES_MAX_MB/s, `${tool}: ${e}`);
      }
      assert.ok(used() <= 48 * MiB, `the stages take ${used()} bytes`);
      assert.deepEqual(leftoversIn(qStore), []);
      await call(c, 'stage_rm', { name: 'q/one' });
      await call(c, 'commit', { session_id: sid, name: 'q/two' });
      await call(c, 'close', { session_id: sid });
      await call(c, 'stage_rm', { name: 'q/two' });
    } finally {
      await srv.close();
      fs.rmSync(qStore, { recursive: true, force: true });
    }
  });
});

describe('stages: shutdown during a fork', { skip: NS_ONLY('the ns layer copy'), ...T }, () => {
  test('a server told to stop while it forks and commits leaves no session, process or stage file', T, async () => {
    const sStore = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-stages-stop-'));
    fs.chmodSync(sStore, 0o755);
    try {
      for (const delay of [0, 30, 120]) {
        const srv = await startServer({ fence: true, env: { IGN_MCP_STORE: sStore } });
        const c = srv.client;
        const sid = await openSession(c);
        await sh(c, sid, 'dd if=/dev/urandom of=/root/r bs=1M count=8 2>/dev/null');
        const inflight = [
          c.callTool({ name: 'fork', arguments: { session_id: sid, count: 4 } }),
          c.callTool({ name: 'commit', arguments: { session_id: sid, name: 'stop/a' } }),
        ].map((p) => p.catch(() => null));
        await sleep(delay);
        await srv.close(); // checks that no process of it outlives it
        await Promise.all(inflight);
        // What it left in the store is a whole stage or nothing.
        // A server that stops cleans up after itself (no clean-up by the next).
        assert.deepEqual(leftoversIn(sStore), [], 'left in stages/ by a server that stopped');
        const left = leftoversIn(sStore);
        const srv2 = await startServer({ fence: true, env: { IGN_MCP_STORE: sStore } });
        assert.deepEqual(leftoversIn(sStore), [], `left by the stopped server: ${left}`);
        await srv2.client.callTool({ name: 'stage_rm', arguments: { name: 'stop/a' } });
        await srv2.close();
      }
    } finally {
      fs.rmSync(sStore, { recursive: true, force: true });
    }
  });
});

/* The v1 freezer groups of server PID that are frozen now. */
function frozenGroupsOf(pid) {
  const base = '/sys/fs/cgroup/freezer';
  if (!fs.existsSync(base)) return [];
  return fs.readdirSync(base).filter((n) => n.startsWith(`ign-mcp-${pid}-`)).filter((n) => {
    try {
      return fs.readFileSync(path.join(base, n, 'freezer.state'), 'utf8').trim() !== 'THAWED';
    } catch {
      return false;
    }
  });
}

// Not fenced: the fence makes the server PID 1 of a pid namespace, which
// takes every process of its own with it (also the freezer's watchdog).
describe('stages: a server killed mid-commit', { skip: NS_ONLY('the ns layer copy'), ...T }, () => {
  test('leaves no half stage, no frozen sandbox, and the next server removes what it left', T, async () => {
    const killStore = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-stages-kill-'));
    fs.chmodSync(killStore, 0o755);
    const env = { IGN_MCP_STORE: killStore, IGN_MCP_OVERLAY_MB: 256 };
    try {
      const srv = await startServer({ env });
      const c = srv.client;
      const sid = await openSession(c);
      // Many files: the copy takes a while.
      await sh(c, sid, 'mkdir /root/m && cd /root/m && i=0; while [ $i -lt 3000 ]; do echo $i > f$i; i=$((i+1)); done; ' +
        'dd if=/dev/urandom of=/root/big bs=1M count=96 2>/dev/null');
      const kids = descendants(srv.pid);
      assert.ok(kids.some((k) => /ign-agent/.test(k.cmd)), JSON.stringify(kids));
      let settled = null;
      const pending = c.callTool({ name: 'commit', arguments: { session_id: sid, name: 'killed/mid' } }).catch(() => null)
        .then((r) => (settled = r ?? { isError: true }));
      const sd = path.join(killStore, 'stages');
      const v1 = fs.existsSync('/sys/fs/cgroup/freezer');
      // Killed while its sandbox is frozen (v1), or while the stage is made.
      await waitUntil(() => settled || (v1 ? frozenGroupsOf(srv.pid).length > 0
        : fs.existsSync(sd) && fs.readdirSync(sd).some((n) => n.startsWith('.tmp-') || n === 'killed+mid')),
      { timeoutMs: 30000, intervalMs: 1 });
      process.kill(srv.pid, 'SIGKILL');
      await pending;
      const left = await waitGone(kids, 5000);
      for (const g of frozenGroupsOf(srv.pid)) fs.writeFileSync(`/sys/fs/cgroup/freezer/${g}/freezer.state`, 'THAWED');
      assert.deepEqual(left.map((l) => `${l.pid} ${l.cmd}`), [], 'the sandbox of a server killed mid-commit outlived it');
      await srv.close({ checkOrphans: false }).catch(() => {});
      assert.ok(!fs.existsSync(path.join(sd, 'killed+mid')) || fs.existsSync(path.join(sd, 'killed+mid', 'meta.json')),
        'a stage without its meta is in place');
      const srv2 = await startServer({ env });
      try {
        const list = await call(srv2.client, 'stage_list');
        // Either the commit finished before the kill (a whole stage) or nothing.
        for (const st of list.stages) assert.equal(st.name, 'killed/mid');
        if (list.stages.length) {
          const s2 = (await call(srv2.client, 'open_session', { stage: 'killed/mid' })).session_id;
          assert.equal((await sh(srv2.client, s2, 'ls /root/m | wc -l')).trim(), '3000');
          await call(srv2.client, 'close', { session_id: s2 });
        }
        assert.deepEqual(fs.readdirSync(sd).filter((n) => n.startsWith('.') && n !== '.lock'), []);
        assert.deepEqual(frozenGroupsOf(srv.pid), []);
      } finally {
        await srv2.close();
      }
    } finally {
      fs.rmSync(killStore, { recursive: true, force: true });
    }
  });
});
