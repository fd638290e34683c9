// userns.test.mjs: an ns sandbox is a user namespace of its own, owned by and
// mapped to a host uid of its own, so the kernel's per-user counts are the
// sandbox's and not host root's or a neighbour's (SECURITY.md, "The
// namespace backend's user").
//
// As root every sandbox gets a block of 65536 host uids (IGN_MCP_NS_UID_BASE)
// and sees the rootfs through an idmapped mount; as a user (the suite run
// through runuser) uid 0 inside is the user's own uid.  The quota rows
// exhaust one count in one session (inotify instances, POSIX message queue
// bytes, pipe pages) and check that the host (this test process) and a
// second session can still take one; they need a uid per session, which
// only a root server gives, and are skipped as a user.  A static helper
// (helpers/quota.c, built here with cc) takes and tries the counts, in the
// sandbox and on the host alike.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import {
  startServer, call, run, sh, writeFile, descendants, serverEnv, assertNoSanitizerReport,
  REPO, SERVER, IS_NS, AS_ROOT, ROOT_ONLY, ROOTFS_SMALL,
} from './lib.mjs';

const T = { timeout: 120_000 };
const SKIP = IS_NS ? false : 'ns backend only: a microVM has its own kernel and counts';
const UID_BASE = 0x70000000;
const BLOCK = 65536;
const SHARED_UID = 'a server run as a user maps every session to the user\'s own uid, so per-user counts are shared by design (README, "Without root")';

let helper = null;
function quotaHelper() {
  if (helper) return helper;
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-quota-'));
  helper = path.join(dir, 'quota');
  execFileSync('cc', ['-O2', '-static', '-o', helper, path.join(REPO, 'tests/e2e/helpers/quota.c')]);
  return helper;
}
after(() => {
  if (helper) fs.rmSync(path.dirname(helper), { recursive: true, force: true });
});

/* The host's view of a process: its uid line (real, effective, saved, fs). */
function hostUids(pid) {
  const m = fs.readFileSync(`/proc/${pid}/status`, 'utf8').match(/^Uid:\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)/m);
  return m.slice(1).map(Number);
}

async function installHelper(c, sid) {
  await writeFile(c, sid, '/root/quota', fs.readFileSync(quotaHelper()));
  await sh(c, sid, 'chmod 755 /root/quota');
}

/* Starts `quota MODE-hold` in the background of the session and returns
 * what it printed once it holds everything it could take. */
async function holdIn(c, sid, what) {
  return (await sh(c, sid, `/root/quota ${what}-hold > /root/${what}.out 2>&1 &
for i in $(seq 200); do test -s /root/${what}.out && break; sleep 0.1; done; cat /root/${what}.out`)).trim();
}
const tryIn = async (c, sid, what) => (await sh(c, sid, `/root/quota ${what}-try`)).trim();
const tryOnHost = (what) => execFileSync(quotaHelper(), [`${what}-try`], { encoding: 'utf8' }).trim();

describe('the ns sandbox is a user namespace of its own', { skip: SKIP }, () => {
  let s;
  before(async () => {
    s = await startServer();
  });
  after(async () => {
    await s?.close();
  });

  test('root inside is a host uid of its own, never the server\'s nor another session\'s', T, async () => {
    const a = await call(s.client, 'open_session', {});
    const b = await call(s.client, 'open_session', {});
    try {
      for (const o of [a, b]) {
        assert.equal(typeof o.host_uid, 'number', `open_session says no host_uid: ${JSON.stringify(o)}`);
        assert.equal(await sh(s.client, o.session_id, 'id -u'), '0\n');
        const map = (await sh(s.client, o.session_id, 'cat /proc/self/uid_map')).trim().split(/\s+/).map(Number);
        if (AS_ROOT) {
          assert.deepEqual(map, [0, o.host_uid, BLOCK], 'uid 0..65535 inside are not the session\'s block');
          assert.ok(o.host_uid >= UID_BASE && (o.host_uid - UID_BASE) % BLOCK === 0, `host uid ${o.host_uid} is not a block from ${UID_BASE}`);
        } else {
          assert.deepEqual(map, [0, process.getuid(), 1]);
          assert.equal(o.host_uid, process.getuid());
        }
      }
      if (AS_ROOT) assert.notEqual(a.host_uid, b.host_uid, 'two live sessions share a uid block');
      // The host sees the agent and the commands as that uid, not as root.
      const kids = descendants(s.pid);
      for (const o of [a, b]) {
        const mine = kids.filter((k) => { try { return hostUids(k.pid)[0] === o.host_uid; } catch { return false; } });
        assert.ok(mine.length >= 1, `no process of the server runs as host uid ${o.host_uid}: ${JSON.stringify(kids)}`);
        for (const k of mine) assert.deepEqual(hostUids(k.pid), [o.host_uid, o.host_uid, o.host_uid, o.host_uid]);
      }
      if (AS_ROOT) {
        for (const k of kids) {
          if (k.pid === s.pid) continue;
          let u;
          try { u = hostUids(k.pid); } catch { continue; }
          assert.ok(u[0] !== 0, `process ${k.pid} (${k.cmd}) of a sandbox runs as host root`);
        }
      }
    } finally {
      await call(s.client, 'close', { session_id: a.session_id });
      await call(s.client, 'close', { session_id: b.session_id });
    }
  });

  test('the rootfs is root\'s inside: its files can be changed (idmapped), device nodes still cannot be made', { ...T, skip: ROOT_ONLY('an idmapped mount needs host root; as a user, files of a rootfs owned by another uid stay read-only (next test)') }, async (t) => {
    const o = await call(s.client, 'open_session', {});
    try {
      const c = s.client, sid = o.session_id;
      // valgrind (the valgrind pass) knows neither open_tree nor mount_setattr.
      if (/rootfs read-only/.test(o.limits)) return t.skip(`no idmapped mount could be made here: ${o.limits}`);
      // The host's tree as it was: every change below must stay in the overlay.
      const host = (p) => path.join(ROOTFS_SMALL, p);
      const hostPasswd = fs.readFileSync(host('etc/passwd'));
      const hostTrue = fs.lstatSync(host('bin/true'));
      assert.equal(await sh(c, sid, 'stat -c "%u:%g" /etc/passwd /bin/busybox /root'), '0:0\n0:0\n0:0\n');
      assert.equal(await sh(c, sid, 'echo "extra:x:5000:5000::/:/bin/sh" >> /etc/passwd && tail -n 1 /etc/passwd'), 'extra:x:5000:5000::/:/bin/sh\n');
      assert.equal(await sh(c, sid, 'mkdir -p /usr/local/new && echo hi > /usr/local/new/f && cat /usr/local/new/f && rm /bin/true && test ! -e /bin/true && echo gone'), 'hi\ngone\n');
      // Overlay keeps its metadata in user.* xattrs here (userxattr): a
      // directory of the rootfs removed and made again is empty (opaque), and
      // one renamed keeps its files (redirect).
      assert.equal(await sh(c, sid, 'rm -rf /var && mkdir /var && ls -A /var | wc -l'), '0\n');
      assert.equal(await sh(c, sid, 'mv /etc /etc2 && test ! -e /etc && cat /etc2/passwd | head -n 1 | cut -d: -f1'), 'root\n');
      // A device node made inside cannot be opened (nodev, no CAP_MKNOD).
      const d = await run(c, sid, 'mknod /tmp/mem c 1 1 2>&1; echo rc=$?');
      assert.match(d.stdout, /rc=[1-9]/, `mknod worked in the sandbox: ${d.stdout}`);
      // A whiteout (0:0, what overlay itself makes) may be made, but not opened.
      assert.equal(await sh(c, sid, 'mknod /dev/wh c 0 0 && { cat /dev/wh 2>/dev/null; echo rc=$?; }'), 'rc=1\n');
      assert.deepEqual(fs.readFileSync(host('etc/passwd')), hostPasswd, 'the host rootfs\'s /etc/passwd changed');
      const nowTrue = fs.lstatSync(host('bin/true'));
      assert.deepEqual([nowTrue.ino, nowTrue.mode, nowTrue.uid], [hostTrue.ino, hostTrue.mode, hostTrue.uid], 'the host rootfs\'s /bin/true changed');
      assert.ok(fs.existsSync(host('var')) && fs.existsSync(host('etc/passwd')), 'a directory of the host rootfs went');
      assert.ok(!fs.existsSync(host('usr/local/new')) && !fs.existsSync(host('etc2')), 'a file made in the sandbox reached the host rootfs');
    } finally {
      await call(s.client, 'close', { session_id: o.session_id });
    }
  });

  test('a rootfs that cannot be idmapped (on ramfs): sessions open with it read-only, and say so', { ...T, skip: ROOT_ONLY('mounting a ramfs needs root') }, async (t) => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-ramfs-'));
    execFileSync('mount', ['-t', 'ramfs', '-o', 'mode=0755', 'ign-e2e', dir]);
    t.after(() => {
      execFileSync('umount', [dir]);
      fs.rmdirSync(dir);
    });
    execFileSync('cp', ['-a', `${path.join(REPO, 'build/rootfs/small')}/.`, dir]);
    const srv = await startServer({ env: { IGN_MCP_ROOTFS: dir } });
    try {
      const o = await call(srv.client, 'open_session', {});
      assert.match(o.limits, /; rootfs read-only \(no idmapped mount\)$/);
      assert.match(srv.stderrText(), /cannot make an idmapped mount of the rootfs .* \(mount_setattr: Invalid argument\): its file system does not support idmapped mounts/);
      const c = srv.client, sid = o.session_id;
      assert.equal(await sh(c, sid, 'echo a > /root/f && echo b > /tmp/f && cat /root/f /tmp/f'), 'a\nb\n');
      assert.notEqual((await run(c, sid, 'echo x >> /etc/passwd')).exit_code, 0, 'a file of the unmapped rootfs was changed');
      assert.equal(fs.readFileSync(path.join(dir, 'etc/passwd'), 'utf8'), fs.readFileSync(path.join(REPO, 'build/rootfs/small/etc/passwd'), 'utf8'));
    } finally {
      await srv.close();
    }
  });

  test('as a user: /root and /tmp are writable, files of a rootfs owned by another uid are read-only', { ...T, skip: AS_ROOT ? 'as root the rootfs is idmapped and fully writable (test above)' : false }, async () => {
    const o = await call(s.client, 'open_session', {});
    try {
      const c = s.client, sid = o.session_id;
      assert.equal(await sh(c, sid, 'echo a > /root/f && echo b > /tmp/f && cat /root/f /tmp/f'), 'a\nb\n');
      const owner = fs.statSync(path.join(REPO, 'build/rootfs/small/etc/passwd')).uid;
      const r = await run(c, sid, 'echo x >> /etc/passwd');
      if (owner === process.getuid()) assert.equal(r.exit_code, 0, r.stderr);
      else assert.notEqual(r.exit_code, 0, 'a file of an unmapped owner was changed');
    } finally {
      await call(s.client, 'close', { session_id: o.session_id });
    }
  });
});

describe('per-user kernel counts are the session\'s own', { skip: SKIP || ROOT_ONLY(SHARED_UID) }, () => {
  let s;
  before(async () => {
    s = await startServer();
  });
  after(async () => {
    await s?.close();
  });

  for (const [what, exhausted] of [
    ['inotify', /^inotify held=\d+ refused=EMFILE$/],
    ['mq', /^mq held=\d+ refused=EMFILE$/],
  ]) {
    test(`${what}: one session holding all it may take leaves the host's root and a second session theirs`, T, async () => {
      assert.match(tryOnHost(what), new RegExp(`^${what} ok$`), 'the host cannot take one even before the test');
      const a = await call(s.client, 'open_session', {});
      const b = await call(s.client, 'open_session', {});
      try {
        await installHelper(s.client, a.session_id);
        await installHelper(s.client, b.session_id);
        const held = await holdIn(s.client, a.session_id, what);
        assert.match(held, exhausted, `the session did not run out: ${held}`);
        assert.ok(Number(held.match(/held=(\d+)/)[1]) > 0, held);
        // The count is exhausted for the session itself...
        assert.match(await tryIn(s.client, a.session_id, what), new RegExp(`^${what} refused=`));
        // ... and for nobody else.
        assert.equal(tryOnHost(what), `${what} ok`, `host root cannot take one while session ${a.session_id} holds all of its own`);
        assert.equal(await tryIn(s.client, b.session_id, what), `${what} ok`, 'a second session cannot take one');
      } finally {
        await call(s.client, 'close', { session_id: a.session_id });
        await call(s.client, 'close', { session_id: b.session_id });
      }
    });
  }

  test('pipes: one session holding its pipe pages leaves a second session full-size pipes', T, async () => {
    const a = await call(s.client, 'open_session', {});
    const b = await call(s.client, 'open_session', {});
    try {
      await installHelper(s.client, a.session_id);
      await installHelper(s.client, b.session_id);
      assert.equal(await tryIn(s.client, b.session_id, 'pipe'), 'pipe size=65536');
      const held = await holdIn(s.client, a.session_id, 'pipe');
      assert.match(held, /^pipe held=\d+ refused=EPERM$/, `the session did not reach its soft limit: ${held}`);
      // New pipes of the session itself are shrunk (pipe-user-pages-soft) ...
      assert.equal(await tryIn(s.client, a.session_id, 'pipe'), 'pipe size=8192');
      // ... not those of another session.
      assert.equal(await tryIn(s.client, b.session_id, 'pipe'), 'pipe size=65536', 'a second session\'s new pipes are shrunk');
    } finally {
      await call(s.client, 'close', { session_id: a.session_id });
      await call(s.client, 'close', { session_id: b.session_id });
    }
  });
});

describe('uid blocks', { skip: SKIP || ROOT_ONLY('uid blocks are given only by a root server') }, () => {
  test('sessions of two servers never share a block, and a closed session\'s block is free again', T, async () => {
    const s1 = await startServer();
    const s2 = await startServer();
    try {
      const opened = [];
      for (const srv of [s1, s2, s1, s2]) opened.push([srv, await call(srv.client, 'open_session', {})]);
      const uids = opened.map(([, o]) => o.host_uid);
      assert.equal(new Set(uids).size, uids.length, `two live sessions share a block: ${uids}`);
      // Every block of a live session is locked; a closed one is not.
      const [srv0, o0] = opened[0];
      await call(srv0.client, 'close', { session_id: o0.session_id });
      // The lock files name host uids (uid / 65536), not a server's slots.
      const r = execFileSync('flock', ['-n', '-E', '75', `/run/ignition-mcp-uids/${o0.host_uid / BLOCK}`, 'true'], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
      assert.equal(r, '');
      let busy = 0;
      try {
        execFileSync('flock', ['-n', '-E', '75', `/run/ignition-mcp-uids/${opened[1][1].host_uid / BLOCK}`, 'true'], { stdio: 'ignore' });
      } catch (e) {
        busy = e.status;
      }
      assert.equal(busy, 75, 'the block of a live session is not locked');
    } finally {
      await s1.close();
      await s2.close();
    }
  });
});

describe('uid blocks of servers with different bases', { skip: SKIP || ROOT_ONLY('uid blocks are given only by a root server') }, () => {
  /* A second server whose IGN_MCP_NS_UID_BASE is one block above the
   * first's: its slot n is the first's slot n + 1.  Fenced, both servers are
   * PID 1 and start their search at the same slot, so the second server's
   * first session lands exactly on the uids of the first server's second
   * session unless the locks name uids rather than slots. */
  test('two live sessions never share a uid, even of servers whose IGN_MCP_NS_UID_BASE differ by one block', T, async () => {
    const s1 = await startServer({ fence: true });
    const s2 = await startServer({ fence: true, env: { IGN_MCP_NS_UID_BASE: String(UID_BASE + BLOCK) } });
    try {
      const a1 = await call(s1.client, 'open_session', {});
      const a2 = await call(s1.client, 'open_session', {});
      await call(s1.client, 'close', { session_id: a1.session_id });
      const live = [a2];
      for (let i = 0; i < 2; i++) live.push(await call(s2.client, 'open_session', {}));
      const uids = live.map((o) => o.host_uid);
      for (let i = 0; i < uids.length; i++) {
        for (let j = i + 1; j < uids.length; j++) {
          assert.ok(Math.abs(uids[i] - uids[j]) >= BLOCK,
            `live sessions of two servers share uids: blocks from ${uids[i]} and ${uids[j]} (all: ${uids})`);
        }
      }
    } finally {
      await s1.close();
      await s2.close();
    }
  });
});

describe('limits without a cgroup', { skip: SKIP }, () => {
  test('IGN_MCP_PIDS=16 stops the 17th process of a session, with or without a cgroup', T, async () => {
    const s = await startServer({ env: { IGN_MCP_PIDS: '16' } });
    try {
      const o = await call(s.client, 'open_session', {});
      if (/no cgroup/.test(o.limits)) {
        assert.match(o.limits, /pids 16 \(RLIMIT_NPROC\)/);
        assert.match(o.limits, /memory not enforced/);
      } else {
        assert.match(o.limits, /memory \d+ MiB, pids 16/);
      }
      // An inner shell starts sleeps until fork fails (which ends it); they
      // are counted by the outer shell's own glob: no fork is left for a
      // command.
      const r = await run(s.client, o.session_id, 'sh -c \'i=0; while [ $i -lt 40 ]; do sleep 300 & i=$((i+1)); done\' 2>/dev/null; set -- /proc/[0-9]*; echo $#', { timeout_s: 60 });
      const n = Number(r.stdout.trim());
      assert.ok(n > 2 && n <= 16, `${n} processes run in a session limited to 16 (limits: ${o.limits})`);
    } finally {
      await s.close();
    }
  });
});

/* CI runs as root: the unprivileged path is tested there too, with a server
 * started as IGN_TEST_USER (an account without privileges, e.g. made for
 * the tests; runuser needs root).  Run as that user, the whole suite covers
 * it instead. */
const TEST_USER = process.env.IGN_TEST_USER || '';
const USER_SKIP = SKIP || (!AS_ROOT ? 'the suite runs as a user already: every test above is the unprivileged path'
  : !TEST_USER ? 'IGN_TEST_USER is not set: name an unprivileged account to test a server run without root'
    : false);

describe(`a server run as IGN_TEST_USER (${TEST_USER || 'unset'}) from a root suite`, { skip: USER_SKIP }, () => {
  const uid = () => Number(execFileSync('id', ['-u', TEST_USER], { encoding: 'utf8' }).trim());

  test('doctor as the user: the sandbox check runs one as the user\'s uid and says memory is not enforced without a cgroup', T, () => {
    const r = spawnSync('runuser', ['-u', TEST_USER, '--', SERVER, 'doctor'], {
      env: serverEnv({ env: { IGN_MCP_BACKEND: 'ns' } }), cwd: '/', encoding: 'utf8', timeout: 60_000,
    });
    assertNoSanitizerReport(r.stderr ?? '', 'doctor');
    assert.equal(r.status, 0, `${r.stdout}\n${r.stderr}`);
    assert.match(r.stdout, /running as a user/);
    assert.match(r.stdout, new RegExp(`^  ok +sandbox +started one as open_session does \\(as host uid ${uid()}\\) and ran a command in it; limits: `, 'm'));
    assert.match(r.stdout, new RegExp(`^  ok +namespaces +.*uid 0 in a session is your uid ${uid()}`, 'm'));
    if (/^  warn +cgroups /m.test(r.stdout)) {
      assert.match(r.stdout, /^  warn +cgroups +.*without a memory limit \(not enforced: only each process.s data is limited, by RLIMIT_DATA\)/m);
      assert.match(r.stdout, /^  ok +sandbox +.*limits: pids \d+ \(RLIMIT_NPROC\), overlay \d+ MiB; memory not enforced \(no cgroup; \d+ MiB data per process\)$/m);
    }
  });

  test('a session of the user\'s server: root inside is the user\'s uid, /root and /tmp writable, limits say what is enforced', T, async () => {
    const transport = new StdioClientTransport({
      command: 'runuser', args: ['-u', TEST_USER, '--', SERVER],
      env: serverEnv({ env: { IGN_MCP_BACKEND: 'ns' } }), stderr: 'pipe', cwd: '/',
    });
    let stderr = '';
    transport.stderr.on('data', (d) => { stderr += d.toString('utf8'); });
    const client = new Client({ name: 'ign-e2e-user', version: '0.0.1' }, { capabilities: {} });
    await client.connect(transport);
    try {
      const o = await call(client, 'open_session', {});
      assert.equal(o.host_uid, uid());
      assert.equal(await sh(client, o.session_id, 'id -u; cat /proc/self/uid_map | tr -s " " | sed "s/^ //"'), `0\n0 ${uid()} 1\n`);
      assert.equal(await sh(client, o.session_id, 'echo a > /root/f && echo b > /tmp/f && cat /root/f /tmp/f'), 'a\nb\n');
      if (/no cgroup/.test(o.limits)) assert.match(o.limits, /^pids \d+ \(RLIMIT_NPROC\), overlay \d+ MiB; memory not enforced \(no cgroup; \d+ MiB data per process\)$/);
      else assert.match(o.limits, /^memory \d+ MiB, pids \d+/);
    } finally {
      await client.close();
    }
    assertNoSanitizerReport(stderr, 'server');
  });
});
