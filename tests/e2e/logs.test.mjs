// logs.test.mjs: the complete stdout and stderr of run on the host
// (stdout_log_path, stderr_log_path): byte-exact up to a 32 MiB output (200
// MiB with IGN_TEST_SOAK=1), readable by the server's user only, cut with a
// marker at IGN_MCP_LOG_CAP, and a log directory that cannot be used reported
// in the result while the run still succeeds.  vm sessions give their serial console too.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { startServer, call, openSession, run, logDir, IS_VM, IS_NS, SOAK } from './lib.mjs';

const T = { timeout: 120_000 };

function assertPrivate(p) {
  const st = fs.lstatSync(p);
  assert.ok(st.isFile(), `${p} is a regular file`);
  assert.equal(st.mode & 0o7777, 0o600, `${p} is 0600`);
  assert.equal(st.uid, process.getuid());
}

function seqOutput(n) {
  let s = '';
  for (let i = 1; i <= n; i++) s += `${i}\n`;
  return s;
}

describe('run logs', () => {
  let s, c, sid;
  before(async () => {
    s = await startServer({ env: { IGN_MCP_LOG_CAP: 256 << 20 } });
    c = s.client;
    sid = await openSession(c);
  });
  after(() => s.close());

  test('both streams land whole in files only the server user can read', T, async () => {
    const r = await run(c, sid, 'printf "out\\0put"; printf "E" >&2; exit 3');
    assert.equal(r.exit_code, 3);
    assert.equal(r.log_error, undefined);
    assert.equal(typeof r.stdout_log_path, 'string');
    assert.equal(path.dirname(r.stdout_log_path), logDir());
    assert.ok(path.basename(r.stdout_log_path).startsWith(`${sid}-`));
    assertPrivate(r.stdout_log_path);
    assertPrivate(r.stderr_log_path);
    assert.deepEqual(fs.readFileSync(r.stdout_log_path), Buffer.from('out\0put'));
    assert.equal(fs.readFileSync(r.stderr_log_path, 'utf8'), 'E');
    assert.equal(fs.statSync(logDir()).mode & 0o7777, 0o700);
    // Each run its own pair.
    const r2 = await run(c, sid, 'true');
    assert.notEqual(r2.stdout_log_path, r.stdout_log_path);
    assert.equal(fs.statSync(r2.stdout_log_path).size, 0);
  });

  test('the log holds what the inline head cuts', T, async () => {
    const r = await run(c, sid, 'seq 1 100000');
    const want = seqOutput(100000);
    assert.equal(r.stdout_truncated, true);
    assert.equal(r.stdout_bytes, want.length);
    assert.equal(fs.readFileSync(r.stdout_log_path, 'utf8'), want);
  });

  // 200 MiB with IGN_TEST_SOAK=1; 32 MiB in `make check`, still far past
  // the inline head and the channel's windows.
  const MIB = SOAK ? 200 : 32, BYTES = MIB << 20;
  test(`a ${MIB} MiB output is byte-exact in its log`, { timeout: 600_000 }, async () => {
    // The guest hashes what it writes; the host hashes the log.
    const cmd =
      'rm -f /tmp/f /tmp/sum; mkfifo /tmp/f; (sha256sum < /tmp/f > /tmp/sum) & ' +
      `head -c ${BYTES} /dev/urandom | tee /tmp/f; wait; cut -d" " -f1 /tmp/sum >&2`;
    const t0 = Date.now();
    const r = await run(c, sid, cmd, { timeout_s: 600 }, { timeout: 600_000 });
    const secs = (Date.now() - t0) / 1000;
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.log_error, undefined);
    assert.equal(r.stdout_bytes, BYTES);
    assert.equal(fs.statSync(r.stdout_log_path).size, BYTES);
    const h = crypto.createHash('sha256');
    const fd = fs.openSync(r.stdout_log_path, 'r');
    const buf = Buffer.alloc(1 << 20);
    let n;
    while ((n = fs.readSync(fd, buf, 0, buf.length, null)) > 0) h.update(buf.subarray(0, n));
    fs.closeSync(fd);
    assert.equal(h.digest('hex'), r.stderr.trim());
    console.log(`# ${MIB} MiB through run with its log: ${secs.toFixed(1)} s`);
    fs.rmSync(r.stdout_log_path);
  });
});

describe('run logs: the cap', () => {
  let s, c, sid;
  before(async () => {
    s = await startServer({ env: { IGN_MCP_LOG_CAP: 1000 } });
    c = s.client;
    sid = await openSession(c);
  });
  after(() => s.close());

  test('a log is cut at IGN_MCP_LOG_CAP with a marker that says so', T, async () => {
    const r = await run(c, sid, 'seq 1 10000; echo small >&2');
    const want = seqOutput(10000);
    assert.equal(r.log_error, undefined);
    const got = fs.readFileSync(r.stdout_log_path, 'utf8');
    assert.equal(
      got,
      want.slice(0, 1000) + `\n[ignition-mcp: log cut at 1000 bytes; the run wrote ${want.length}]\n`,
    );
    assert.equal(fs.readFileSync(r.stderr_log_path, 'utf8'), 'small\n');
  });
});

describe('run logs: a log directory that cannot be used', () => {
  let s, c, sid, top;
  before(async () => {
    // A link is refused even for root (whom no mode stops).
    top = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-badlogs-'));
    fs.mkdirSync(path.join(top, 'real'), { mode: 0o700 });
    fs.symlinkSync(path.join(top, 'real'), path.join(top, 'link'));
    s = await startServer({ env: { IGN_MCP_LOG_DIR: path.join(top, 'link') } });
    c = s.client;
    sid = await openSession(c);
  });
  after(async () => {
    await s.close();
    fs.rmSync(top, { recursive: true, force: true });
  });

  test('the run succeeds and its result says why there is no log', T, async () => {
    const r = await run(c, sid, 'echo fine');
    assert.equal(r.exit_code, 0);
    assert.equal(r.stdout, 'fine\n');
    assert.equal(r.stdout_log_path, null);
    assert.equal(r.stderr_log_path, null);
    assert.match(r.log_error, /symbolic link/);
    assert.match(r.log_error, /IGN_MCP_LOG_DIR/);
    assert.deepEqual(fs.readdirSync(path.join(top, 'real')), []);
    assert.match(s.stderrText(), /run logs: .*symbolic link/);
  });
});

describe('serial log', () => {
  let s, c;
  before(async () => {
    s = await startServer();
    c = s.client;
  });
  after(() => s.close());

  test('vm: open_session gives the guest serial console, 0600, gone with the session; ns: null', T, async () => {
    const o = await call(c, 'open_session', {});
    if (IS_NS) {
      assert.equal(o.serial_log_path, null);
    } else {
      assert.ok(IS_VM);
      assert.equal(typeof o.serial_log_path, 'string');
      const st = fs.lstatSync(o.serial_log_path);
      assert.ok(st.isFile());
      assert.equal(st.mode & 0o077, 0, 'no access for group or others');
      // What the guest kernel writes to its console lands there.
      await run(c, o.session_id, 'echo "<2>ign-serial-e2e" > /dev/kmsg || echo ign-serial-e2e > /dev/console');
      await new Promise((r) => setTimeout(r, 500));
      assert.match(fs.readFileSync(o.serial_log_path, 'utf8'), /ign-serial-e2e/);
    }
    await call(c, 'close', { session_id: o.session_id });
    if (IS_VM) assert.equal(fs.existsSync(o.serial_log_path), false);
  });
});
