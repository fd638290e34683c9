// owner.test.mjs: session ids that name their host (IGN_MCP_HOST_ID), so a
// front proxy can route a call to the server that holds its session, and an
// id of another host is answered with that host's name, never as an unknown
// id.  Owner separation of sessions and stages between HTTP tokens is in the
// "owners" suite below when the server has an HTTP transport; the session
// table's own check of owners runs for real in tests/unit/test_session.c.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import {
  startServer, call, callErr, openSession, sh, serverEnv, SERVER, REPO,
} from './lib.mjs';

const T = { timeout: 120_000 };

/* The tools that take a session_id, with the other arguments each needs. */
const BY_ID = [
  ['run', { command: 'true' }],
  ['write_file', { path: '/tmp/x', content_base64: '' }],
  ['read_file', { path: '/etc/hostname' }],
  ['reset', {}],
  ['close', {}],
  ['commit', { name: 'owner-test/x' }],
  ['fork', {}],
  ['copy_in', { host_path: 'README.md', guest_path: '/tmp/r' }],
  ['copy_out', { host_path: 'build/owner-test-out', guest_path: '/etc/hostname' }],
];

describe('host ids', () => {
  test('IGN_MCP_HOST_ID=h1: every id the server mints starts with "h1."; the id works as any other', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_HOST_ID: 'h1' } });
    t.after(() => s.close());
    const id = await openSession(s.client);
    assert.match(id, /^h1\.s\d+-[0-9a-f]{4}$/);
    assert.equal((await sh(s.client, id, 'echo hi')).trim(), 'hi');
    const l = await call(s.client, 'list_sessions', {});
    assert.deepEqual(l.sessions.map((x) => x.session_id), [id]);
    const f = await call(s.client, 'fork', { session_id: id, count: 2 });
    for (const x of f.sessions) assert.match(x.session_id, /^h1\.s\d+-[0-9a-f]{4}$/);
    const r = await call(s.client, 'reset', { session_id: id });
    assert.equal(r.session_id, id);
    await call(s.client, 'close', { session_id: id });
    assert.match(s.stderrText(), /host id h1 \(IGN_MCP_HOST_ID\)/);
  });

  test('an id of host h2 sent to h1 names h2 and the header a proxy routes on, for every tool', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_HOST_ID: 'h1' } });
    t.after(() => s.close());
    for (const [tool, args] of BY_ID) {
      const e = await callErr(s.client, tool, { session_id: 'h2.s1-0000', ...args });
      assert.match(e, /session 'h2\.s1-0000' is held by host 'h2', not this host 'h1'/, `${tool}: ${e}`);
      assert.match(e, /send calls for it to h2/, `${tool}: ${e}`);
      assert.match(e, /Mcp-Param-Session-Id/, `${tool}: ${e}`);
      assert.doesNotMatch(e, /unknown session_id/, `${tool}: ${e}`);
    }
  });

  test('an id of this host that is not open, or with a malformed host part, is an unknown id', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_HOST_ID: 'h1' } });
    t.after(() => s.close());
    for (const id of ['h1.s99-ffff', 'H2.s1-0000', 'h_2.s1-0000', 's1-0000', 'abcdefghijklmnopq.s1-0000']) {
      const e = await callErr(s.client, 'run', { session_id: id, command: 'true' });
      assert.match(e, new RegExp(`unknown session_id '${id.replace(/\./g, '\\.')}'`), e);
      assert.doesNotMatch(e, /held by host/, e);
    }
  });

  test('without IGN_MCP_HOST_ID: ids have no host part, and an id with one names its host', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_HOST_ID: '' } });
    t.after(() => s.close());
    const id = await openSession(s.client);
    assert.match(id, /^s\d+-[0-9a-f]{4}$/);
    const e = await callErr(s.client, 'run', { session_id: 'h2.s1-0000', command: 'true' });
    assert.match(e, /held by host 'h2', not this server \(it has no IGN_MCP_HOST_ID\)/, e);
    await call(s.client, 'close', { session_id: id });
  });

  test('an invalid IGN_MCP_HOST_ID stops the server at startup, naming the rule', T, () => {
    for (const bad of ['H1', '1h', 'h_1', 'h.1', 'a0123456789abcdef']) {
      const r = spawnSync(SERVER, [], {
        env: serverEnv({ env: { IGN_MCP_HOST_ID: bad } }),
        input: '',
        encoding: 'utf8',
        cwd: REPO,
        timeout: 30_000,
      });
      assert.notEqual(r.status, 0, `IGN_MCP_HOST_ID=${bad} was accepted`);
      assert.match(r.stderr, new RegExp(`IGN_MCP_HOST_ID=${bad.replace(/\./g, '\\.')} is invalid`), r.stderr);
      assert.match(r.stderr, /1 to 16 characters of a-z, 0-9 and -, starting with a letter/, r.stderr);
    }
  });
});
