// transfer.test.mjs: copy_in and copy_out (files and whole trees between the
// host and a session), run's stdin_file, and the host-path policy they share:
// every path is confined to IGN_MCP_HOST_IO_ROOT (symlinks resolved first,
// "link/" and dangling ".." refused), reads take regular files only, writes
// never follow a symlink at the destination and replace it only once
// complete, caps are checked on both sides, and what cannot be copied
// (device nodes, FIFOs, links leading out, setuid bits) is left out and
// listed.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import crypto from 'node:crypto';
import { startServer, call, callErr, openSession, sh, run, sha256, IS_VM } from './lib.mjs';

const T = { timeout: 120_000 };

/* A host-I/O root of the test's own (no "ign" in the name: the leftover
 * checks of other files look for those), and a directory outside it. */
function tempDirs() {
  const base = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-xfer-'));
  fs.chmodSync(base, 0o755);
  const root = path.join(base, 'root');
  const outside = path.join(base, 'outside');
  const logs = path.join(base, 'logs');
  fs.mkdirSync(root);
  fs.mkdirSync(outside);
  fs.writeFileSync(path.join(outside, 'secret'), 'outside the root\n');
  return { base, root, outside, logs, remove: () => fs.rmSync(base, { recursive: true, force: true }) };
}

/* Every file under DIR as {relative path: "mode sha256" or "-> target"}. */
function treeOf(dir) {
  const out = {};
  const walk = (d, rel) => {
    for (const e of fs.readdirSync(d, { withFileTypes: true }).sort((a, b) => a.name.localeCompare(b.name))) {
      const p = path.join(d, e.name);
      const r = rel ? `${rel}/${e.name}` : e.name;
      const st = fs.lstatSync(p);
      if (st.isSymbolicLink()) out[r] = `-> ${fs.readlinkSync(p)}`;
      else if (st.isDirectory()) {
        out[r] = `dir ${(st.mode & 0o7777).toString(8)}`;
        walk(p, r);
      } else out[r] = `${(st.mode & 0o7777).toString(8)} ${sha256(fs.readFileSync(p))}`;
    }
  };
  walk(dir, '');
  return out;
}

/* A small project: nested directories, an executable, a symlink inside. */
function makeProject(dir) {
  fs.mkdirSync(path.join(dir, 'src/lib'), { recursive: true });
  fs.writeFileSync(path.join(dir, 'README'), 'a project\n');
  fs.writeFileSync(path.join(dir, 'src/main.c'), 'int main(void) { return 0; }\n');
  fs.writeFileSync(path.join(dir, 'src/lib/data.bin'), crypto.randomBytes(200_000));
  fs.writeFileSync(path.join(dir, 'run.sh'), '#!/bin/sh\necho ran\n');
  fs.chmodSync(path.join(dir, 'run.sh'), 0o755);
  fs.symlinkSync('src/main.c', path.join(dir, 'main-link'));
}

describe('copy_in and copy_out', () => {
  let s, c, sid, d;
  before(async () => {
    d = tempDirs();
    s = await startServer({ env: { IGN_MCP_HOST_IO_ROOT: d.root, IGN_MCP_LOG_DIR: d.logs } });
    c = s.client;
    sid = await openSession(c);
  });
  after(async () => {
    await s.close();
    d.remove();
  });

  test('a tree goes in and comes back identical (modes, symlinks, content)', T, async () => {
    makeProject(path.join(d.root, 'proj'));
    const i = await call(c, 'copy_in', { session_id: sid, host_path: 'proj', guest_path: '/work/proj' });
    assert.equal(i.ok, true);
    assert.equal(i.guest_path, '/work/proj');
    assert.deepEqual({ files: i.copied.files, dirs: i.copied.dirs, symlinks: i.copied.symlinks, skipped: i.copied.skipped },
      { files: 4, dirs: 3, symlinks: 1, skipped: 0 });
    assert.equal(i.copied.bytes, 200_000 + 10 + 29 + 19);
    assert.equal(typeof i.copy_ms, 'number');
    assert.equal(await sh(c, sid, '/work/proj/run.sh; readlink /work/proj/main-link'), 'ran\nsrc/main.c\n');
    const o = await call(c, 'copy_out', { session_id: sid, guest_path: '/work/proj', host_path: 'back' });
    assert.equal(o.ok, true);
    assert.deepEqual(treeOf(path.join(d.root, 'back')), treeOf(path.join(d.root, 'proj')));
  });

  test('a single file, and relative guest paths are under /root', T, async () => {
    fs.writeFileSync(path.join(d.root, 'one.txt'), 'one file\n');
    await call(c, 'copy_in', { session_id: sid, host_path: 'one.txt', guest_path: 'in/one.txt' });
    assert.equal(await sh(c, sid, 'cat /root/in/one.txt'), 'one file\n');
    await sh(c, sid, 'echo changed > /root/in/one.txt');
    const o = await call(c, 'copy_out', { session_id: sid, guest_path: 'in/one.txt', host_path: path.join(d.root, 'one-back.txt') });
    assert.equal(o.copied.files, 1);
    assert.equal(fs.readFileSync(path.join(d.root, 'one-back.txt'), 'utf8'), 'changed\n');
  });

  test('the destination becomes the copy: an existing tree is replaced whole', T, async () => {
    await sh(c, sid, 'mkdir -p /work/repl && echo stale > /work/repl/stale');
    fs.mkdirSync(path.join(d.root, 'repl'));
    fs.writeFileSync(path.join(d.root, 'repl/fresh'), 'fresh\n');
    await call(c, 'copy_in', { session_id: sid, host_path: 'repl', guest_path: '/work/repl' });
    assert.equal(await sh(c, sid, 'ls /work/repl'), 'fresh\n');
    fs.mkdirSync(path.join(d.root, 'repl-out'));
    fs.writeFileSync(path.join(d.root, 'repl-out/old'), 'old\n');
    await call(c, 'copy_out', { session_id: sid, guest_path: '/work/repl', host_path: 'repl-out' });
    assert.deepEqual(fs.readdirSync(path.join(d.root, 'repl-out')), ['fresh']);
  });

  test('setuid bits, device nodes, FIFOs and links leading out are left out and listed', T, async () => {
    const made = await run(c, sid, [
      'mkdir -p /work/odd && cd /work/odd',
      'echo x > suid && chmod 4755 suid',
      'echo y > groupw && chmod 0777 groupw',
      'ln -s /etc/passwd abs-link',
      'ln -s ../../etc/passwd up-link',
      'mkfifo fifo',
      'mknod null c 1 3 2>/dev/null && echo mknod-ok || true',
    ].join('; '));
    const withDev = made.stdout.includes('mknod-ok');
    const o = await call(c, 'copy_out', { session_id: sid, guest_path: '/work/odd', host_path: 'odd' });
    const skipped = o.copied.skipped_entries.map((e) => e.path.replace(/^odd\//, '')).sort();
    const want = ['abs-link', 'fifo', 'up-link', ...(withDev ? ['null'] : [])].sort();
    assert.deepEqual(skipped, want, JSON.stringify(o.copied));
    assert.equal(o.copied.skipped, want.length);
    for (const e of o.copied.skipped_entries) assert.ok(e.reason.length > 0);
    const st = fs.statSync(path.join(d.root, 'odd/suid'));
    assert.equal(st.mode & 0o7777, 0o755, 'the setuid bit came through');
    assert.equal(fs.statSync(path.join(d.root, 'odd/groupw')).mode & 0o7777, 0o755, 'group/other write came through');
    assert.deepEqual(fs.readdirSync(path.join(d.root, 'odd')).sort(), ['groupw', 'suid']);
  });

  test('a host tree with a link leading out: the link is left out and listed', T, async () => {
    const p = path.join(d.root, 'escapes');
    fs.mkdirSync(p);
    fs.writeFileSync(path.join(p, 'ok'), 'ok\n');
    fs.symlinkSync(path.join(d.outside, 'secret'), path.join(p, 'abs'));
    fs.symlinkSync('../../outside/secret', path.join(p, 'rel'));
    const i = await call(c, 'copy_in', { session_id: sid, host_path: 'escapes', guest_path: '/work/escapes' });
    assert.deepEqual(i.copied.skipped_entries.map((e) => e.path).sort(), ['escapes/abs', 'escapes/rel']);
    assert.equal(await sh(c, sid, 'ls -A /work/escapes'), 'ok\n');
  });

  test('names with control characters are left out and listed, both ways; a leading "-" is kept', T, async () => {
    // In the sandbox: a newline, a terminal escape, DEL, a tab, and a
    // directory with a carriage return (with a file below it).
    await sh(c, sid, [
      'mkdir -p /work/ctl && cd /work/ctl',
      'echo ok > ok && echo dash > ./-rf',
      "printf x > \"$(printf 'new\\nline')\"",
      "printf x > \"$(printf '\\033[31mred')\"",
      "printf x > \"$(printf 'del\\177')\"",
      "printf x > \"$(printf 'tab\\tname')\"",
      "mkdir \"$(printf 'd\\r')\" && printf x > \"$(printf 'd\\r')/inner\"",
      // U+009B, a C1 CSI in UTF-8 (xterm takes it as an escape).
      "printf x > \"$(printf 'csi\\302\\2332J')\"",
    ].join(' && '));
    // What is below a directory left out is listed too.
    const want = ['ctl/new\nline', 'ctl/\x1b[31mred', 'ctl/del\x7f', 'ctl/tab\tname', 'ctl/d\r/', 'ctl/d\r/inner', 'ctl/csi\u009b2J'].sort();
    const o = await call(c, 'copy_out', { session_id: sid, guest_path: '/work/ctl', host_path: 'ctl' });
    assert.deepEqual(o.copied.skipped_entries.map((e) => e.path).sort(), want, JSON.stringify(o.copied));
    for (const e of o.copied.skipped_entries) assert.match(e.reason, /control character/);
    assert.deepEqual(fs.readdirSync(path.join(d.root, 'ctl')).sort(), ['-rf', 'ok']);
    assert.equal(fs.readFileSync(path.join(d.root, 'ctl/-rf'), 'utf8'), 'dash\n');
    // On the host: the same names, copied in.
    const h = path.join(d.root, 'ctl-host');
    fs.mkdirSync(h);
    fs.writeFileSync(path.join(h, 'ok'), 'ok\n');
    fs.writeFileSync(path.join(h, '-rf'), 'dash\n');
    for (const n of ['new\nline', '\x1b[31mred', 'del\x7f', 'tab\tname', 'csi\u009b2J']) fs.writeFileSync(path.join(h, n), 'x');
    fs.mkdirSync(path.join(h, 'd\r'));
    fs.writeFileSync(path.join(h, 'd\r', 'inner'), 'x');
    const i = await call(c, 'copy_in', { session_id: sid, host_path: 'ctl-host', guest_path: '/work/ctl-in' });
    assert.deepEqual(i.copied.skipped_entries.map((e) => e.path).sort(), want.map((n) => n.replace(/^ctl\//, 'ctl-host/')).sort(), JSON.stringify(i.copied));
    for (const e of i.copied.skipped_entries) assert.match(e.reason, /control character/);
    assert.equal(await sh(c, sid, 'ls -A /work/ctl-in'), '-rf\nok\n');
  });

  test('a 60 MiB file with holes keeps them both ways: the copies allocate what its data takes', T, async () => {
    // On the host: data at 1 MiB and at 30 MiB, holes everywhere else.
    const h = path.join(d.root, 'holes');
    const fd = fs.openSync(h, 'w');
    fs.ftruncateSync(fd, 60 * 1024 * 1024);
    fs.writeSync(fd, 'head', 1024 * 1024);
    fs.writeSync(fd, 'tail', 30 * 1024 * 1024);
    fs.closeSync(fd);
    const hostBlocks = fs.statSync(h).blocks * 512;
    assert.ok(hostBlocks < 1024 * 1024, `the host file system keeps no holes here (${hostBlocks} bytes)`);
    const i = await call(c, 'copy_in', { session_id: sid, host_path: 'holes', guest_path: '/work/holes' });
    assert.equal(i.copied.files, 1);
    assert.ok(i.copied.bytes < 1024 * 1024, `copy_in counted ${i.copied.bytes} bytes of content`);
    const [size, blocks, unit, sum] = (await sh(c, sid, "stat -c '%s %b %B' /work/holes | tr '\\n' ' '; sha256sum < /work/holes | cut -d' ' -f1")).trim().split(/\s+/);
    assert.equal(Number(size), 60 * 1024 * 1024);
    assert.ok(Number(blocks) * Number(unit) < 1024 * 1024, `the guest copy allocates ${Number(blocks) * Number(unit)} bytes`);
    assert.equal(sum, sha256(fs.readFileSync(h)));
    // In the sandbox: one made there, all hole but its last bytes.
    await sh(c, sid, 'truncate -s 60M /work/guest-holes && printf end >> /work/guest-holes');
    for (const [g, back] of [['/work/holes', 'holes-back'], ['/work/guest-holes', 'guest-holes']]) {
      const o = await call(c, 'copy_out', { session_id: sid, guest_path: g, host_path: back });
      assert.ok(o.copied.bytes < 1024 * 1024, `copy_out of ${g} counted ${o.copied.bytes} bytes of content`);
      const st = fs.statSync(path.join(d.root, back));
      assert.ok(st.blocks * 512 < 1024 * 1024, `the host copy of ${g} allocates ${st.blocks * 512} bytes`);
    }
    assert.equal(sha256(fs.readFileSync(path.join(d.root, 'holes-back'))), sha256(fs.readFileSync(h)));
    const gh = fs.readFileSync(path.join(d.root, 'guest-holes'));
    assert.equal(gh.length, 60 * 1024 * 1024 + 3);
    assert.equal(gh.subarray(-3).toString(), 'end');
  });

  describe('host paths are confined to IGN_MCP_HOST_IO_ROOT', () => {
    const refused = (msg) => {
      assert.match(msg, /IGN_MCP_HOST_IO_ROOT/, msg);
      assert.ok(msg.includes(d.root), `the refusal does not name the root: ${msg}`);
    };

    test('an absolute path outside, and ".." that leaves the root', T, async () => {
      refused(await callErr(c, 'copy_in', { session_id: sid, host_path: d.outside, guest_path: '/x' }));
      refused(await callErr(c, 'copy_in', { session_id: sid, host_path: '../outside', guest_path: '/x' }));
      await sh(c, sid, 'echo evil > /root/evil');
      refused(await callErr(c, 'copy_out', { session_id: sid, guest_path: '/root/evil', host_path: '../outside/secret' }));
      refused(await callErr(c, 'copy_out', { session_id: sid, guest_path: '/root/evil', host_path: 'a/../../outside/new' }));
      assert.equal(fs.readFileSync(path.join(d.outside, 'secret'), 'utf8'), 'outside the root\n');
      assert.deepEqual(fs.readdirSync(d.outside), ['secret']);
    });

    test('a dangling ".." below a directory that does not exist', T, async () => {
      const m = await callErr(c, 'copy_out', { session_id: sid, guest_path: '/root/evil', host_path: 'nope/../../outside/x' });
      assert.ok(m.length > 0);
      assert.deepEqual(fs.readdirSync(d.outside), ['secret']);
    });

    test('a symlink planted inside the root that points out, spelled "link" and "link/"', T, async () => {
      fs.symlinkSync(d.outside, path.join(d.root, 'link'));
      for (const p of ['link', 'link/', 'link/secret', 'link/.']) {
        refused(await callErr(c, 'copy_in', { session_id: sid, host_path: p, guest_path: '/x' }));
      }
      for (const p of ['link/', 'link/new', 'link/secret']) {
        await callErr(c, 'copy_out', { session_id: sid, guest_path: '/root/evil', host_path: p });
      }
      refused(await callErr(c, 'run', { session_id: sid, command: 'cat', stdin_file: 'link/secret' }));
      assert.deepEqual(fs.readdirSync(d.outside), ['secret']);
      assert.equal(fs.readFileSync(path.join(d.outside, 'secret'), 'utf8'), 'outside the root\n');
    });

    test('a destination that is a symlink is refused, never followed', T, async () => {
      fs.writeFileSync(path.join(d.root, 'target'), 'target\n');
      fs.symlinkSync('target', path.join(d.root, 'dst-link'));
      const m = await callErr(c, 'copy_out', { session_id: sid, guest_path: '/root/evil', host_path: 'dst-link' });
      assert.match(m, /symlink|symbolic link/i, m);
      assert.equal(fs.readlinkSync(path.join(d.root, 'dst-link')), 'target');
      assert.equal(fs.readFileSync(path.join(d.root, 'target'), 'utf8'), 'target\n');
    });

    test('stdin_file: regular files only (a FIFO is refused without blocking), 4 MiB at most', T, async () => {
      fs.writeFileSync(path.join(d.root, 'input.txt'), 'from a host file\n');
      const r = await run(c, sid, 'cat', { stdin_file: 'input.txt' });
      assert.equal(r.stdout, 'from a host file\n');
      const fifo = path.join(d.root, 'fifo');
      await import('node:child_process').then(({ execFileSync }) => execFileSync('mkfifo', [fifo]));
      const t0 = Date.now();
      const m = await callErr(c, 'run', { session_id: sid, command: 'cat', stdin_file: 'fifo' });
      assert.ok(Date.now() - t0 < 10_000, 'stdin_file blocked on a FIFO');
      assert.match(m, /stdin_file/);
      fs.writeFileSync(path.join(d.root, 'big'), Buffer.alloc(4 * 1024 * 1024 + 1));
      assert.match(await callErr(c, 'run', { session_id: sid, command: 'wc -c', stdin_file: 'big' }), /4194304|4 MiB/);
      fs.writeFileSync(path.join(d.root, 'exact'), Buffer.alloc(4 * 1024 * 1024, 0x61));
      assert.equal((await run(c, sid, 'wc -c', { stdin_file: 'exact' })).stdout.trim(), '4194304');
      assert.match(await callErr(c, 'run', { session_id: sid, command: 'cat', stdin_file: 'src-dir-missing' }), /stdin_file/);
    });

    test('a copy that fails partway leaves the destination byte-identical and no staging file', T, async () => {
      // The guest side fails partway: a file it cannot read, after others.
      const dest = path.join(d.root, 'keep');
      fs.mkdirSync(dest);
      fs.writeFileSync(path.join(dest, 'precious'), 'precious\n');
      const before = treeOf(dest);
      const beforeRoot = fs.readdirSync(d.root).sort();
      await sh(c, sid, 'mkdir -p /work/half && for i in 1 2 3; do head -c 100000 /dev/urandom > /work/half/f$i; done');
      // A missing guest source.
      const m1 = await callErr(c, 'copy_out', { session_id: sid, guest_path: '/work/none', host_path: 'keep' });
      assert.match(m1, /sandbox/, m1);
      assert.deepEqual(treeOf(dest), before);
      assert.deepEqual(fs.readdirSync(d.root).sort(), beforeRoot, 'a staging file was left in the root');
    });
  });
});

describe('caps and copy_out=off', () => {
  let s, c, sid, d;
  before(async () => {
    d = tempDirs();
    s = await startServer({ env: { IGN_MCP_HOST_IO_ROOT: d.root, IGN_MCP_LOG_DIR: d.logs, IGN_MCP_COPY_MAX_MB: 1, IGN_MCP_COPY_MAX_FILES: 20 } });
    c = s.client;
    sid = await openSession(c);
  });
  after(async () => {
    await s.close();
    d.remove();
  });

  test('copy_in over the byte cap or the file cap is refused, naming the variable; nothing arrives', T, async () => {
    fs.mkdirSync(path.join(d.root, 'big'));
    fs.writeFileSync(path.join(d.root, 'big/a'), crypto.randomBytes(600_000));
    fs.writeFileSync(path.join(d.root, 'big/b'), crypto.randomBytes(600_000));
    assert.match(await callErr(c, 'copy_in', { session_id: sid, host_path: 'big', guest_path: '/work/big' }), /IGN_MCP_COPY_MAX_MB/);
    fs.mkdirSync(path.join(d.root, 'many'));
    for (let i = 0; i < 30; i++) fs.writeFileSync(path.join(d.root, `many/f${i}`), 'x');
    assert.match(await callErr(c, 'copy_in', { session_id: sid, host_path: 'many', guest_path: '/work/many' }), /IGN_MCP_COPY_MAX_FILES/);
    assert.equal(await sh(c, sid, 'ls -A /work 2>/dev/null | wc -l'), '0\n');
  });

  test('copy_out over the cap fails partway and leaves the host destination byte-identical', T, async () => {
    const dest = path.join(d.root, 'dest');
    fs.mkdirSync(dest);
    fs.writeFileSync(path.join(dest, 'keep'), 'keep me\n');
    const before = treeOf(dest);
    await sh(c, sid, 'mkdir -p /work/out && head -c 300000 /dev/urandom > /work/out/a && head -c 900000 /dev/urandom > /work/out/b');
    const m = await callErr(c, 'copy_out', { session_id: sid, guest_path: '/work/out', host_path: 'dest' });
    assert.match(m, /IGN_MCP_COPY_MAX_MB/);
    assert.deepEqual(treeOf(dest), before);
    assert.deepEqual(fs.readdirSync(d.root).filter((n) => n.startsWith('.')), [], 'staging left behind');
  });

  test('IGN_MCP_COPY_OUT=off: copy_out is refused and nothing is written; copy_in still works', T, async () => {
    const s2 = await startServer({ env: { IGN_MCP_HOST_IO_ROOT: d.root, IGN_MCP_LOG_DIR: d.logs, IGN_MCP_COPY_OUT: 'off' } });
    try {
      const id = await openSession(s2.client);
      await sh(s2.client, id, 'echo x > /root/x');
      const m = await callErr(s2.client, 'copy_out', { session_id: id, guest_path: '/root/x', host_path: 'x-off' });
      assert.match(m, /IGN_MCP_COPY_OUT=off/);
      assert.equal(fs.existsSync(path.join(d.root, 'x-off')), false);
      fs.writeFileSync(path.join(d.root, 'in-ok'), 'in\n');
      await call(s2.client, 'copy_in', { session_id: id, host_path: 'in-ok', guest_path: '/root/in-ok' });
      assert.equal(await sh(s2.client, id, 'cat /root/in-ok'), 'in\n');
    } finally {
      await s2.close();
    }
  });
});
