// files.test.mjs: write_file and read_file: binary safety, modes, chunked
// reads, caps and errors.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import {
  startServer, call, callErr, openSession, run, sh, writeFile, readWhole, sha256, waitUntil, sleep,
  descendants, qemuChildren, IS_NS,
} from './lib.mjs';

const T = { timeout: 60_000 };

describe('write_file and read_file', () => {
  let s, c, sid;
  before(async () => {
    s = await startServer();
    c = s.client;
    sid = await openSession(c);
  });
  after(() => s.close());

  test('a text file written is seen by run and read back', T, async () => {
    const w = await writeFile(c, sid, '/root/hello.txt', 'hello, world\n');
    assert.deepEqual({ ok: w.ok, path: w.path, bytes: w.bytes }, { ok: true, path: '/root/hello.txt', bytes: 13 });
    assert.equal(await sh(c, sid, 'cat /root/hello.txt'), 'hello, world\n');
    const r = await call(c, 'read_file', { session_id: sid, path: '/root/hello.txt' });
    assert.equal(Buffer.from(r.content_base64, 'base64').toString(), 'hello, world\n');
    assert.equal(r.size, 13);
    assert.equal(r.eof, true);
  });

  test('a file made by run is readable by read_file', T, async () => {
    await sh(c, sid, "printf 'x\\000y\\377' > /tmp/made-by-run");
    const r = await call(c, 'read_file', { session_id: sid, path: '/tmp/made-by-run' });
    assert.deepEqual([...Buffer.from(r.content_base64, 'base64')], [0x78, 0, 0x79, 0xff]);
    assert.equal(r.bytes, 4);
  });

  test('parent directories are created', T, async () => {
    await writeFile(c, sid, '/root/a/b/c/deep.txt', 'deep');
    assert.equal(await sh(c, sid, 'cat /root/a/b/c/deep.txt; test -d /root/a/b && echo', {}), 'deep\n');
  });

  test('writing over a file replaces it entirely', T, async () => {
    await writeFile(c, sid, '/root/over.txt', 'a much longer first content\n');
    const w = await writeFile(c, sid, '/root/over.txt', 'x');
    assert.equal(w.bytes, 1);
    assert.equal(await sh(c, sid, 'cat /root/over.txt'), 'x');
  });

  test('an empty file', T, async () => {
    const w = await writeFile(c, sid, '/root/empty', Buffer.alloc(0));
    assert.equal(w.bytes, 0);
    assert.equal((await sh(c, sid, 'wc -c < /root/empty')).trim(), '0');
    const r = await call(c, 'read_file', { session_id: sid, path: '/root/empty' });
    assert.equal(r.content_base64, '');
    assert.equal(r.bytes, 0);
    assert.equal(r.size, 0);
    assert.equal(r.eof, true);
  });

  test('mode accepts an integer and octal strings', T, async () => {
    const script = '#!/bin/sh\necho ran\n';
    for (const [i, mode] of [[1, 493], [2, '755'], [3, '0755']]) {
      await writeFile(c, sid, `/root/bin/s${i}`, script, { mode });
      assert.equal(await sh(c, sid, `ls -l /root/bin/s${i} | cut -c1-10`), '-rwxr-xr-x\n', `mode ${JSON.stringify(mode)}`);
      assert.equal(await sh(c, sid, `/root/bin/s${i}`), 'ran\n');
    }
    await writeFile(c, sid, '/root/bin/ro', 'x', { mode: 0o600 });
    assert.equal(await sh(c, sid, 'ls -l /root/bin/ro | cut -c1-10'), '-rw-------\n');
  });

  test('an invalid mode is an error', T, async () => {
    for (const mode of ['rwx', '999', -1, 1.5]) {
      const e = await callErr(c, 'write_file', { session_id: sid, path: '/root/badmode', content_base64: 'eA==', mode });
      assert.match(e, /mode/, `${JSON.stringify(mode)}: ${e}`);
    }
  });

  test('5 MiB of random bytes round-trip exactly', { timeout: 120_000 }, async () => {
    const data = crypto.randomBytes(5 * 1024 * 1024 + 123);
    const w = await writeFile(c, sid, '/root/blob.bin', data);
    assert.equal(w.bytes, data.length);
    const back = await readWhole(c, sid, '/root/blob.bin');
    assert.equal(back.length, data.length);
    assert.equal(sha256(back), sha256(data));
    assert.equal((await sh(c, sid, 'sha256sum /root/blob.bin')).split(/\s+/)[0], sha256(data));
  });

  test('read_file in pieces with offset and max_bytes', T, async () => {
    const data = Buffer.from('0123456789abcdefghij');
    await writeFile(c, sid, '/root/pieces', data);
    const r1 = await call(c, 'read_file', { session_id: sid, path: '/root/pieces', offset: 0, max_bytes: 7 });
    assert.equal(Buffer.from(r1.content_base64, 'base64').toString(), '0123456');
    assert.equal(r1.bytes, 7);
    assert.equal(r1.size, 20);
    assert.equal(r1.eof, false);
    const r2 = await call(c, 'read_file', { session_id: sid, path: '/root/pieces', offset: 7, max_bytes: 7 });
    assert.equal(Buffer.from(r2.content_base64, 'base64').toString(), '789abcd');
    assert.equal(r2.eof, false);
    const r3 = await call(c, 'read_file', { session_id: sid, path: '/root/pieces', offset: 14, max_bytes: 100 });
    assert.equal(Buffer.from(r3.content_base64, 'base64').toString(), 'efghij');
    assert.equal(r3.bytes, 6);
    assert.equal(r3.eof, true);
    const r4 = await call(c, 'read_file', { session_id: sid, path: '/root/pieces', offset: 13 });
    assert.equal(Buffer.from(r4.content_base64, 'base64').toString(), 'defghij');
  });

  test('read_file default max_bytes is 1 MiB', T, async () => {
    await sh(c, sid, 'head -c 3000000 /dev/zero > /root/three-mb');
    const r = await call(c, 'read_file', { session_id: sid, path: '/root/three-mb' });
    assert.equal(r.bytes, 1048576);
    assert.equal(r.size, 3000000);
    assert.equal(r.eof, false);
  });

  test('read_file max_bytes above the advertised piece cap or below 1 is an error', T, async () => {
    // The cap is what tools/list advertises (2 MiB by default, so that a
    // result stays under common clients' message limits).
    const { tools } = await c.listTools();
    const cap = tools.find((x) => x.name === 'read_file').inputSchema.properties.max_bytes.maximum;
    assert.ok(Number.isInteger(cap) && cap >= 1 << 20, `read_file.max_bytes.maximum is ${cap}`);
    for (const max_bytes of [cap + 1, 33554433, 0, -1, 'x']) {
      const e = await callErr(c, 'read_file', { session_id: sid, path: '/root/hello.txt', max_bytes });
      assert.match(e, /max_bytes/, e);
    }
    const e = await callErr(c, 'read_file', { session_id: sid, path: '/root/hello.txt', offset: -5 });
    assert.match(e, /offset/, e);
    const ok = await call(c, 'read_file', { session_id: sid, path: '/root/hello.txt', max_bytes: cap });
    assert.equal(ok.eof, true);
    // A piece of exactly the cap comes back whole.
    await sh(c, sid, `head -c ${cap + 10} /dev/zero > /root/cap-plus-10`);
    const big = await call(c, 'read_file', { session_id: sid, path: '/root/cap-plus-10', max_bytes: cap });
    assert.equal(big.bytes, cap);
    assert.equal(big.eof, false);
  });

  // Each error is asserted in the server's own words (the argument checks)
  // or as the server frames the agent's answer ("write_file failed: ..."):
  // a loose /path/ would also match the agent's fallback for a path that
  // slipped past the server's checks.
  test('write_file errors: bad base64, empty path, NUL in path, directory target', T, async () => {
    const e1 = await callErr(c, 'write_file', { session_id: sid, path: '/root/bad64', content_base64: '@@@' });
    assert.match(e1, /base64/i);
    assert.equal((await run(c, sid, 'test -e /root/bad64 && echo exists || echo absent')).stdout, 'absent\n');
    const e2 = await callErr(c, 'write_file', { session_id: sid, path: '', content_base64: 'eA==' });
    assert.equal(e2, "write_file: 'path' is empty; give a non-empty string");
    const e3 = await callErr(c, 'write_file', { session_id: sid, path: '/root/a\u0000b', content_base64: 'eA==' });
    assert.equal(e3, "write_file: 'path' contains a NUL character, which no path or command can hold; remove it");
    const e4 = await callErr(c, 'write_file', { session_id: sid, path: '/tmp', content_base64: 'eA==' });
    assert.equal(e4, "write_file failed: '/tmp' is a directory; give a file path");
    const e5 = await callErr(c, 'write_file', { session_id: sid, path: '/root/nob64' });
    assert.equal(e5, "write_file needs the argument 'content_base64' (a string)");
    assert.equal(await sh(c, sid, 'test -d /tmp && echo dir'), 'dir\n');
  });

  test('read_file errors: missing file names the path, directory, empty path', T, async () => {
    const e1 = await callErr(c, 'read_file', { session_id: sid, path: '/root/does-not-exist-e2e' });
    assert.equal(e1, "read_file failed: '/root/does-not-exist-e2e' does not exist in the sandbox");
    const e2 = await callErr(c, 'read_file', { session_id: sid, path: '/tmp' });
    assert.equal(e2, "read_file failed: '/tmp' is a directory; give a file path");
    const e3 = await callErr(c, 'read_file', { session_id: sid, path: '' });
    assert.equal(e3, "read_file: 'path' is empty; give a non-empty string");
  });

  test('the session keeps working after file errors', T, async () => {
    assert.equal(await sh(c, sid, 'echo fine'), 'fine\n');
  });
});

describe('file size cap', () => {
  test('IGN_MCP_MAX_FILE=65536 refuses a 100 KiB write and accepts a 60 KiB one', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_MAX_FILE: 65536 } });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    const e = await callErr(s.client, 'write_file', {
      session_id: sid,
      path: '/root/too-big',
      content_base64: crypto.randomBytes(100 * 1024).toString('base64'),
    });
    assert.match(e, /65536|64 ?KiB|large|limit|cap|max/i, e);
    const ok = await writeFile(s.client, sid, '/root/fits', crypto.randomBytes(60 * 1024));
    assert.equal(ok.bytes, 60 * 1024);
    assert.equal((await sh(s.client, sid, 'wc -c < /root/fits')).trim(), `${60 * 1024}`);
  });
});

describe('a guest that stops reading its channel', () => {
  /* The sandbox's side of the channel stops taking bytes: its agent (ns) or
   * its QEMU (vm) is stopped from the host, the way a guest's root could
   * stop the agent from inside. A write_file into it must not wedge the
   * session or the server: a cancelled one ends at once (and gives its bytes
   * back to the server's budget), an uncancelled one fails after the write
   * deadline with a clear error, the session is then dead (reset or close
   * it), and other sessions' large calls go on. */
  const MiB = 1 << 20;
  const DEADLINE_S = 30; // AGENT_WRITE_DEADLINE_MS (proto/client.h)

  test('write_file: cancel ends it at once, the deadline fails it clearly, other sessions are served', { timeout: 300_000 }, async (t) => {
    // A budget (4 x IGN_MCP_MAX_MESSAGE = 64 MiB) that three stuck 8 MiB
    // uploads (about 20 MiB each: their request line and decoded content)
    // would nearly fill: a fourth large call would be refused as busy.
    const s = await startServer({ env: { IGN_MCP_MAX_MESSAGE: 16 * MiB, IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } });
    t.after(() => s.close());
    const c = s.client;
    const procsOf = () => (IS_NS
      ? descendants(s.pid).filter((d) => /^\S*ign-agent\b/.test(d.cmd ?? ''))
      : qemuChildren(s.pid));
    const a = await openSession(c);
    const [stuck] = procsOf();
    assert.ok(stuck, 'no agent or QEMU found for the session');
    const b = await openSession(c);
    assert.equal(procsOf().length, 2);
    process.kill(stuck.pid, 'SIGSTOP');
    t.after(() => { try { process.kill(stuck.pid, 'SIGCONT'); } catch { /* gone */ } });

    const big = crypto.randomBytes(8 * MiB).toString('base64');
    const busyA = async () => (await call(c, 'list_sessions', {})).sessions.find((x) => x.session_id === a)?.busy;
    for (let i = 0; i < 3; i++) {
      const ac = new AbortController();
      const p = c.callTool({ name: 'write_file', arguments: { session_id: a, path: `/root/stuck${i}`, content_base64: big } },
        undefined, { signal: ac.signal, timeout: 120000 });
      assert.ok(await waitUntil(busyA, { timeoutMs: 20000 }), 'the upload never started');
      await sleep(500); // into the full socket
      ac.abort('test cancels');
      await assert.rejects(p);
      // The server ended the call: the session is no longer busy (before
      // the write deadline, which is far off).
      assert.ok(await waitUntil(async () => (await busyA()) === false, { timeoutMs: (DEADLINE_S / 3) * 1000 }),
        'the cancelled upload still holds the session');
    }
    // The other session takes a large upload: nothing is held by the
    // cancelled ones.
    const ok = await call(c, 'write_file', { session_id: b, path: '/root/big', content_base64: big }, { timeout: 120000 });
    assert.equal(ok.bytes, 8 * MiB);

    // Uncancelled: it fails once the agent has taken nothing for the write
    // deadline, saying so.
    const e = await callErr(c, 'write_file', { session_id: a, path: '/root/late', content_base64: big }, { timeout: 240000 });
    assert.match(e, new RegExp(`^write_file failed: session '${a}' is dead: the sandbox's agent stopped reading its channel: it did not take a whole frame within ${DEADLINE_S * 1000} ms`), e);
    assert.match(e, new RegExp(`Call reset\\('${a}'\\)`), e);
    const l = (await call(c, 'list_sessions', {})).sessions.find((x) => x.session_id === a);
    assert.equal(l.busy, false);
    assert.equal(l.alive, false);
    // Every later call says the same.
    const e2 = await callErr(c, 'run', { session_id: a, command: 'true' });
    assert.match(e2, /stopped reading its channel/, e2);
    // The session closes, and the other one still serves.
    await call(c, 'close', { session_id: a });
    assert.equal(await sh(c, b, 'wc -c < /root/big'), `${8 * MiB}\n`);
  });
});
