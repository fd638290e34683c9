// tools.test.mjs: the shape of every tool's result and of its errors.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startServer, call, callErr, openSession, textOf, IS_NS, BACKEND } from './lib.mjs';

const T = { timeout: 60_000 };

/* A successful result must carry structuredContent and the same JSON as a
 * text content block. */
async function callChecked(client, name, args) {
  const res = await client.callTool({ name, arguments: args });
  assert.notEqual(res.isError, true, `${name}: ${textOf(res)}`);
  assert.ok(res.structuredContent, `${name}: no structuredContent`);
  const texts = res.content.filter((c) => c.type === 'text');
  assert.ok(texts.length >= 1, `${name}: no text content block`);
  const parsed = texts.map((c) => {
    try {
      return JSON.parse(c.text);
    } catch {
      return undefined;
    }
  });
  assert.ok(
    parsed.some((p) => JSON.stringify(p) === JSON.stringify(res.structuredContent) || deepEq(p, res.structuredContent)),
    `${name}: no text block holds the structuredContent JSON: ${JSON.stringify(res.content).slice(0, 500)}`,
  );
  return res.structuredContent;
}

function deepEq(a, b) {
  try {
    assert.deepStrictEqual(a, b);
    return true;
  } catch {
    return false;
  }
}

describe('tool results', () => {
  let s;
  let sid;
  before(async () => {
    s = await startServer();
  });
  after(() => s.close());

  test('open_session returns id, isolation and backend', T, async () => {
    const r = await callChecked(s.client, 'open_session', {});
    assert.equal(typeof r.session_id, 'string');
    assert.ok(r.session_id.length > 0);
    assert.equal(typeof r.isolation, 'string');
    assert.equal(r.backend, BACKEND);
    if (IS_NS) assert.equal(r.isolation, 'namespace');
    else assert.match(r.isolation, /^microvm\/(kvm|tcg)$/);
    sid = r.session_id;
  });

  test('run returns every documented field with the right types', T, async () => {
    const r = await callChecked(s.client, 'run', { session_id: sid, command: 'echo out; echo err >&2; exit 3' });
    assert.equal(r.stdout, 'out\n');
    assert.equal(r.stderr, 'err\n');
    assert.equal(r.exit_code, 3);
    assert.equal(r.timed_out, false);
    assert.equal(r.signal, null);
    assert.equal(typeof r.duration_ms, 'number');
    assert.ok(r.duration_ms >= 0);
    assert.equal(r.stdout_bytes, 4);
    assert.equal(r.stderr_bytes, 4);
    assert.equal(r.stdout_truncated, false);
    assert.equal(r.stderr_truncated, false);
  });

  test('write_file returns ok, path and bytes', T, async () => {
    const r = await callChecked(s.client, 'write_file', {
      session_id: sid,
      path: '/root/t.txt',
      content_base64: Buffer.from('hello\n').toString('base64'),
    });
    assert.equal(r.ok, true);
    assert.equal(r.path, '/root/t.txt');
    assert.equal(r.bytes, 6);
  });

  test('read_file returns content_base64, bytes, size and eof', T, async () => {
    const r = await callChecked(s.client, 'read_file', { session_id: sid, path: '/root/t.txt' });
    assert.equal(Buffer.from(r.content_base64, 'base64').toString(), 'hello\n');
    assert.equal(r.bytes, 6);
    assert.equal(r.size, 6);
    assert.equal(r.eof, true);
  });

  test('list_sessions lists open sessions and the cap', T, async () => {
    const r = await callChecked(s.client, 'list_sessions', {});
    assert.ok(Array.isArray(r.sessions));
    assert.equal(typeof r.max_sessions, 'number');
    assert.equal(r.max_sessions, 8, 'default IGN_MCP_MAX_SESSIONS is 8');
    const mine = r.sessions.find((x) => x.session_id === sid);
    assert.ok(mine, `session ${sid} missing from ${JSON.stringify(r)}`);
    assert.equal(typeof mine.isolation, 'string');
  });

  test('reset returns ok and the same id', T, async () => {
    const r = await callChecked(s.client, 'reset', { session_id: sid });
    assert.equal(r.ok, true);
    assert.equal(r.session_id, sid);
  });

  test('close returns ok and the id, then the id is dead for every tool', T, async () => {
    const r = await callChecked(s.client, 'close', { session_id: sid });
    assert.equal(r.ok, true);
    assert.equal(r.session_id, sid);
    const b64 = Buffer.from('x').toString('base64');
    for (const [name, args] of [
      ['run', { session_id: sid, command: 'true' }],
      ['write_file', { session_id: sid, path: '/root/x', content_base64: b64 }],
      ['read_file', { session_id: sid, path: '/root/x' }],
      ['reset', { session_id: sid }],
      ['close', { session_id: sid }],
    ]) {
      const e = await callErr(s.client, name, args);
      assert.ok(e.includes(sid), `${name} error does not name the id: ${e}`);
    }
    const l = await call(s.client, 'list_sessions', {});
    assert.ok(!l.sessions.some((x) => x.session_id === sid));
  });

  test('an id that was never opened is an error naming it, for every tool', T, async () => {
    const bogus = 'no-such-session-4242';
    const b64 = Buffer.from('x').toString('base64');
    for (const [name, args] of [
      ['run', { session_id: bogus, command: 'true' }],
      ['write_file', { session_id: bogus, path: '/root/x', content_base64: b64 }],
      ['read_file', { session_id: bogus, path: '/root/x' }],
      ['reset', { session_id: bogus }],
      ['close', { session_id: bogus }],
    ]) {
      const e = await callErr(s.client, name, args);
      assert.ok(e.includes(bogus), `${name} error does not name the id: ${e}`);
    }
  });

  test('missing or mistyped session_id is a tool error, not a crash', T, async () => {
    const rest = {
      run: { command: 'true' },
      write_file: { path: '/root/x', content_base64: '' },
      read_file: { path: '/root/x' },
      reset: {},
      close: {},
    };
    for (const [name, args] of Object.entries(rest)) {
      const e = await callErr(s.client, name, args);
      assert.match(e, /session_id/, `${name}: ${e}`);
      const e2 = await callErr(s.client, name, { session_id: 12, ...args });
      assert.match(e2, /session_id/, `${name}: ${e2}`);
    }
    // Still serving.
    const l = await call(s.client, 'list_sessions', {});
    assert.ok(Array.isArray(l.sessions));
  });

  test('arguments that are not an object are a clean error', T, async () => {
    for (const args of [[], 'x', 5]) {
      const res = await s.client.request(
        { method: 'tools/call', params: { name: 'list_sessions', arguments: args } },
        (await import('@modelcontextprotocol/sdk/types.js')).CallToolResultSchema,
      ).then(
        (r) => ({ r }),
        (e) => ({ e }),
      );
      // Either a JSON-RPC -32602 or an isError result is acceptable.
      if (res.e) assert.equal(res.e.code, -32602, String(res.e));
      else assert.equal(res.r.isError, true, JSON.stringify(res.r));
    }
  });
});
