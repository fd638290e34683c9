// pagecheck.test.mjs: a vm snapshot (commit, fork) of a session whose memory
// is being written is consistent: no page lost, stale or torn in any fork, in
// any session from a committed stage, or in the source after it.
//
// tests/guest/pagecheck.c runs in the session: a writer that rewrites 2 MiB
// page after page for ever, as fast as it can (each page its index, a
// generation, a fill and a checksum; its own generation and cursor in its
// memory); `pagecheck verify` has the writer check every page against its
// own state.  The file forks and commits the source in a row while it runs,
// and verifies every copy and the source after each.  Its first test shows
// that the check finds a page changed behind the writer's back (`pagecheck
// tear`).  IGN_TEST_SOAK=1: 20 rounds (the soak); `make check` runs one.
//
// Measured with the source left running during the stream on QEMU 7.2
// (TCG; a server whose SNAPSHOT_LIVE_QEMU was 7): this writer lost its process in both sessions of one
// fork in 4 rounds (16 copies); the same writer beside a CPU hog in the
// session (0 of 16 copies bad), and a 64 or 128 MiB one with or without the
// hog, paced or not (0 of about 60), found nothing: a small buffer written
// by one process that is never switched out is what shows the loss.
//
// Every result line goes to the test's diagnostics, so that a run with the
// source left running during the stream (on QEMU 10 and later, or with
// SNAPSHOT_LIVE_QEMU in sandbox/vm/internal.h lowered) shows what was lost
// (docs/vm-recipe.md §5b).

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { startServer, call, sh, uniq, waitUntil, writeFile, REPO, SOAK, VM_ONLY } from './lib.mjs';

const T = { timeout: SOAK ? 3_600_000 : 600_000 };
/* Snapshot rounds, each a fork into two sessions, a commit and a session
 * from it (~30 s under TCG, most of it the stream with the source stopped). */
const ROUNDS = SOAK ? 20 : 1;
const WRITER_MIB = 2;
const SKIP = VM_ONLY('only a microVM\'s snapshot carries the memory of running processes');

/* build/guest/pagecheck (make check builds it) when it is newer than its
 * source, else built here with the host's compiler; or a reason to skip. */
function pagecheck() {
  const src = path.join(REPO, 'tests/guest/pagecheck.c');
  const built = path.join(REPO, process.env.BUILD || 'build', 'guest/pagecheck');
  if (fs.existsSync(built) && fs.statSync(built).mtimeMs >= fs.statSync(src).mtimeMs) return { bin: fs.readFileSync(built) };
  const out = path.join(os.tmpdir(), uniq('ign-pagecheck'));
  try {
    execFileSync('gcc', ['-static', '-O2', '-o', out, src], { stdio: ['ignore', 'ignore', 'pipe'] });
    return { bin: fs.readFileSync(out) };
  } catch (e) {
    return { skip: `cannot build tests/guest/pagecheck.c with gcc -static: ${String(e.stderr || e.message).trim().split('\n')[0]}` };
  } finally {
    fs.rmSync(out, { force: true });
  }
}

const PROG = SKIP ? null : pagecheck();
/* A server of the test's own (no pool, no spare: TCG has two cores to
 * share), closed and checked after it. */
async function client(t) {
  const srv = await startServer({ env: { IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } });
  t.after(() => srv.close());
  return srv.client;
}

/* A session running the writer over MIB MiB. */
async function writing(c, mib) {
  const { session_id: id } = await call(c, 'open_session', {});
  await writeFile(c, id, '/root/pagecheck', PROG.bin, { mode: 0o755 });
  await sh(c, id, `/root/pagecheck write ${mib} >/dev/null 2>/tmp/pagecheck.err &
    i=0; while [ ! -s /tmp/pagecheck.pid ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
    [ -s /tmp/pagecheck.pid ] || { cat /tmp/pagecheck.err; exit 1; }`, { timeout_s: 90 });
  return id;
}

/* `pagecheck verify` in session ID: {ok, line} (line: its answer, or why
 * there was none: the run failed, the guest is gone). */
async function verify(c, id) {
  const res = await c.callTool({ name: 'run', arguments: { session_id: id, command: '/root/pagecheck verify 30', timeout_s: 45 } },
    undefined, { timeout: 120000 });
  const r = res.structuredContent;
  if (res.isError || !r) return { ok: false, line: `run failed: ${(res.content ?? []).map((x) => x.text).join(' ').slice(0, 300)}` };
  const line = `${r.stdout.trim()}${r.exit_code === 0 ? '' : ` (exit ${r.exit_code}${r.stderr ? `, ${r.stderr.trim().slice(0, 200)}` : ''})`}`;
  const ok = r.exit_code === 0 && r.stdout.startsWith('ok ');
  if (ok || r.exit_code !== 2) return { ok, line };
  // No writer, or no answer: what the guest's kernel said about it.
  const k = await c.callTool({ name: 'run', arguments: { session_id: id, command: 'dmesg | tail -n 3', timeout_s: 20 } }, undefined, { timeout: 60000 });
  return { ok, line: `${line}; dmesg: ${(k.structuredContent?.stdout ?? '(none)').trim().replace(/\n/g, ' | ')}` };
}

describe('vm snapshots lose no page', { skip: SKIP || PROG?.skip, ...T }, () => {
  test('the check finds a page changed behind the writer\'s back', T, async (t) => {
    const c = await client(t);
    const id = await writing(c, 16);
    const v0 = await verify(c, id);
    assert.ok(v0.ok, `a writer left alone: ${v0.line}`);
    const r = await call(c, 'run', { session_id: id, command: '/root/pagecheck tear' });
    assert.match(r.stdout, /^bad [12] of \d+ pages \(stale 0, ahead 0, torn [12]\): first page \d+: found index \d+ gen \d+ checksum bad fill bad/, JSON.stringify(r));
    assert.equal(r.exit_code, 1);
    // The writer rewrites the torn pages on its next pass.
    assert.ok(await waitUntil(async () => (await verify(c, id)).ok, { timeoutMs: 20000 }), 'the writer did not mend the torn pages');
    await call(c, 'close', { session_id: id });
  });

  test(`${ROUNDS} fork(s) into two and ${ROUNDS} commit(s) of a session writing ${WRITER_MIB} MiB: every copy and the source are consistent`, T, async (t) => {
    const c = await client(t);
    const src = await writing(c, WRITER_MIB);
    const results = [];
    const record = (what, v) => {
      results.push({ what, ...v });
      t.diagnostic(`${what}: ${v.line}`);
    };
    const stage = `pagecheck/${uniq('r')}`;
    for (let i = 0; i < ROUNDS; i++) {
      const f = await c.callTool({ name: 'fork', arguments: { session_id: src, count: 2 } }, undefined, { timeout: 120000 });
      if (f.isError) record(`fork ${i}`, { ok: false, line: `fork failed: ${f.content?.[0]?.text}` });
      for (const [k, { session_id: fid }] of (f.isError ? [] : f.structuredContent.sessions).entries()) {
        record(`fork ${i}.${k} (paused ${Math.round(f.structuredContent.paused_ms)} ms)`, await verify(c, fid));
        await c.callTool({ name: 'close', arguments: { session_id: fid } });
      }
      record(`source after fork ${i}`, await verify(c, src));

      const name = `${stage}-${i}`;
      const m = await call(c, 'commit', { session_id: src, name });
      record(`source after commit ${i}`, await verify(c, src));
      const o = await c.callTool({ name: 'open_session', arguments: { stage: name } }, undefined, { timeout: 120000 });
      if (o.isError) record(`stage ${i}`, { ok: false, line: `open_session failed: ${o.content?.[0]?.text}` });
      else {
        record(`stage ${i} (paused ${Math.round(m.paused_ms)} ms)`, await verify(c, o.structuredContent.session_id));
        await c.callTool({ name: 'close', arguments: { session_id: o.structuredContent.session_id } });
      }
      await call(c, 'stage_rm', { name });
    }
    const bad = results.filter((r) => !r.ok);
    t.diagnostic(`${bad.length} of ${results.length} checks bad`);
    assert.deepEqual(bad.map((r) => `${r.what}: ${r.line}`), [], 'copies or a source with lost, stale or torn pages');
    await call(c, 'close', { session_id: src });
  });
});
