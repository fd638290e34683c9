// mcp2026.test.mjs: the 2026-07-28 revision of MCP (no initialize, a
// per-request _meta envelope, server/discover) through the official v2
// TypeScript client (@modelcontextprotocol/client), and byte by byte through
// the raw client for what that client would not send; beside it the 1.x SDK
// (lib.mjs) on the same binary, which must see no difference.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Client, SdkError } from '@modelcontextprotocol/client';
import { StdioClientTransport } from '@modelcontextprotocol/client/stdio';
import {
  SERVER, REPO, IS_NS, serverEnv, startRaw, startServer, textOf, sleep, waitUntil, findProcs,
  uniqueSleepSecs, descendants, waitGone, assertNoSanitizerReport, TOOL_NAMES,
} from './lib.mjs';

const T = { timeout: 180_000 };
const V = '2026-07-28';
const ENVELOPE = {
  'io.modelcontextprotocol/protocolVersion': V,
  'io.modelcontextprotocol/clientCapabilities': {},
  'io.modelcontextprotocol/clientInfo': { name: 'ign-e2e-raw', version: '0.0.1' },
};
const meta = (extra = {}) => ({ _meta: { ...ENVELOPE, ...extra } });

/* The server through the v2 client; mode is its versionNegotiation mode
 * (the client's own default is 'legacy'). */
async function start2026({ mode = { pin: V }, tools = false } = {}) {
  const transport = new StdioClientTransport({
    command: SERVER,
    args: [],
    env: serverEnv({ tools }),
    stderr: 'pipe',
    cwd: REPO,
  });
  let stderr = '';
  transport.stderr.on('data', (d) => {
    stderr += d.toString('utf8');
  });
  const client = new Client({ name: 'ign-e2e-v2', version: '0.0.1' }, { capabilities: {}, versionNegotiation: { mode } });
  const errors = [];
  client.onerror = (e) => {
    const m = String(e?.message ?? e);
    if (!/progress notification for an unknown token/.test(m)) errors.push(m);
  };
  try {
    await client.connect(transport);
  } catch (e) {
    await transport.close().catch(() => {});
    throw new Error(`v2 client could not connect to ${SERVER}: ${e.message}\nstderr:\n${stderr}`);
  }
  const pid = transport.pid;
  return {
    client,
    pid,
    stderrText: () => stderr,
    async close() {
      const kids = pid ? descendants(pid) : [];
      await client.close().catch(() => {});
      const left = await waitGone(kids, 8000);
      assert.deepEqual(left.map((l) => `${l.pid} ${l.cmd}`), [], 'processes started by the server outlived it');
      assertNoSanitizerReport(stderr);
      assert.deepEqual(errors, [], 'the v2 client saw protocol errors');
    },
  };
}

async function tool(c, name, args = {}, opts = {}) {
  const res = await c.callTool({ name, arguments: args }, { timeout: 170_000, ...opts });
  assert.equal(res.isError ?? false, false, `${name}(${JSON.stringify(args).slice(0, 200)}) failed: ${textOf(res)}`);
  assert.ok(res.structuredContent && typeof res.structuredContent === 'object', `${name}: no structuredContent`);
  return res.structuredContent;
}

describe('the v2 client in the modern era', () => {
  let s, c, sid;
  before(async () => {
    s = await start2026();
    c = s.client;
  });
  after(() => s?.close());

  test('connect discovers 2026-07-28 with no initialize, and sees who the server is', T, async () => {
    assert.equal(c.getProtocolEra(), 'modern');
    assert.equal(c.getNegotiatedProtocolVersion(), V);
    assert.equal(c.getServerVersion()?.name, 'ignition-mcp');
    const d = c.getDiscoverResult();
    assert.deepEqual(d.supportedVersions, [V]);
    assert.equal(typeof d.capabilities.tools, 'object');
    assert.equal(d.capabilities.logging, undefined, 'logging is deprecated: not offered to modern clients');
    assert.match(c.getInstructions() ?? '', /sh -c/);
    const again = await c.discover();
    assert.deepEqual(again.supportedVersions, [V]);
  });

  test('tools/list: the same tools, and every session_id declares x-mcp-header Session-Id', T, async () => {
    const { tools } = await c.listTools();
    assert.deepEqual(tools.map((t) => t.name).sort(), [...TOOL_NAMES].sort());
    let n = 0;
    for (const t of tools) {
      const p = t.inputSchema.properties?.session_id;
      if (!p) continue;
      n++;
      assert.equal(p['x-mcp-header'], 'Session-Id', `${t.name}: ${JSON.stringify(p)}`);
      assert.equal(p.type, 'string');
    }
    assert.ok(n >= 8, `only ${n} tools take a session_id`);
  });

  test('every session tool: open_session, run, write_file, read_file, reset, list_sessions, close', T, async () => {
    const o = await tool(c, 'open_session');
    sid = o.session_id;
    assert.equal(typeof sid, 'string');
    assert.match(o.isolation, /namespace|microvm/);
    const r = await tool(c, 'run', { session_id: sid, command: 'echo hi; echo err >&2; exit 3' });
    assert.equal(r.stdout, 'hi\n');
    assert.equal(r.stderr, 'err\n');
    assert.equal(r.exit_code, 3);
    const data = Buffer.from([0, 1, 2, 255, 10, 13]);
    const w = await tool(c, 'write_file', { session_id: sid, path: '/root/b.bin', content_base64: data.toString('base64') });
    assert.equal(w.bytes, data.length);
    const rd = await tool(c, 'read_file', { session_id: sid, path: '/root/b.bin' });
    assert.deepEqual(Buffer.from(rd.content_base64, 'base64'), data);
    assert.equal(rd.eof, true);
    const l = await tool(c, 'list_sessions');
    assert.deepEqual(l.sessions.map((x) => x.session_id), [sid]);
    await tool(c, 'reset', { session_id: sid });
    const gone = await tool(c, 'run', { session_id: sid, command: 'test -e /root/b.bin && echo kept || echo wiped' });
    assert.equal(gone.stdout, 'wiped\n');
  });

  test('a run asked for progress streams notifications/progress to onprogress', T, async () => {
    const prog = [];
    const res = await tool(c, 'run', { session_id: sid, command: 'for i in 1 2 3 4; do echo line$i; sleep 1; done' },
      { onprogress: (p) => prog.push(p) });
    assert.equal(res.stdout, 'line1\nline2\nline3\nline4\n');
    assert.ok(prog.length >= 2, `only ${prog.length} progress notifications: ${JSON.stringify(prog)}`);
    for (let i = 1; i < prog.length; i++) assert.ok(prog[i].progress > prog[i - 1].progress, JSON.stringify(prog));
    assert.ok(prog.some((p) => typeof p.message === 'string' && p.message.includes('line')), JSON.stringify(prog));
  });

  test('an AbortSignal cancels a run: the command is killed and the server keeps serving', T, async () => {
    const n = uniqueSleepSecs();
    const ac = new AbortController();
    const p = c.callTool({ name: 'run', arguments: { session_id: sid, command: `sleep ${n}; echo not-killed > /root/cancel.out` } },
      { signal: ac.signal, timeout: 60_000 });
    if (IS_NS) assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length === 1, { timeoutMs: 10000 }), 'sleep never started');
    else await sleep(3000);
    ac.abort('test cancels');
    await assert.rejects(p);
    let ps;
    const killed = await waitUntil(async () => {
      ps = await tool(c, 'run', { session_id: sid, command: 'ps -o args 2>/dev/null || ps' });
      return !ps.stdout.includes(`sleep ${n}`);
    }, { timeoutMs: 10000, intervalMs: 300 });
    assert.ok(killed, `the cancelled sleep still runs:\n${ps.stdout}`);
    const out = await tool(c, 'run', { session_id: sid, command: 'cat /root/cancel.out 2>/dev/null; echo serving' });
    assert.equal(out.stdout, 'serving\n');
  });

  test('close ends the session; its id is then unknown, named in the error', T, async () => {
    const x = await tool(c, 'close', { session_id: sid });
    assert.equal(x.ok, true);
    const res = await c.callTool({ name: 'run', arguments: { session_id: sid, command: 'true' } });
    assert.equal(res.isError, true);
    assert.ok(textOf(res).includes(sid), textOf(res));
  });

  test('sandbox_run: one call, its output, no session left', T, async () => {
    const r = await tool(c, 'sandbox_run', { command: 'echo one-shot; uname -s' });
    assert.equal(r.exit_code, 0);
    assert.equal(r.stdout, 'one-shot\nLinux\n');
    assert.deepEqual((await tool(c, 'list_sessions')).sessions, []);
  });

  test('an unknown tool is a protocol error (-32602)', T, async () => {
    await assert.rejects(c.callTool({ name: 'no_such_tool', arguments: {} }), (e) => e.code === -32602 || /no_such_tool/.test(e.message));
  });
});

describe('negotiation', () => {
  test("'auto' mode probes with server/discover and stays modern", T, async (t) => {
    const s = await start2026({ mode: 'auto' });
    t.after(() => s.close());
    assert.equal(s.client.getProtocolEra(), 'modern');
    assert.equal(s.client.getNegotiatedProtocolVersion(), V);
    const { tools } = await s.client.listTools();
    assert.equal(tools.length, TOOL_NAMES.length);
  });

  test('a pin to a version the server does not speak fails loudly, naming it', T, async () => {
    await assert.rejects(start2026({ mode: { pin: '2099-01-01' } }), (e) => /2099-01-01/.test(e.message));
  });

  test('the 1.x SDK (initialize, 2025-11-25) still works on the same binary, logging included', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    assert.equal(s.client.getServerVersion().name, 'ignition-mcp');
    assert.equal(typeof s.client.getServerCapabilities().logging, 'object');
    await s.client.setLoggingLevel('info');
    const { tools } = await s.client.listTools();
    assert.equal(tools.find((x) => x.name === 'run').inputSchema.properties.session_id['x-mcp-header'], 'Session-Id');
    const o = await s.client.callTool({ name: 'open_session', arguments: {} });
    assert.notEqual(o.isError, true, textOf(o));
    const r = await s.client.callTool({ name: 'run', arguments: { session_id: o.structuredContent.session_id, command: 'echo legacy' } });
    assert.equal(r.structuredContent.stdout, 'legacy\n');
    assert.equal(r.resultType, undefined, 'legacy results carry no resultType');
  });
});

describe('raw lines, modern era', () => {
  let raw;
  before(() => {
    raw = startRaw();
  });
  after(() => raw.close());

  test('server/discover answers the DiscoverResult of the spec', T, async () => {
    const r = await raw.request('server/discover', meta());
    const d = r.result;
    assert.ok(d, JSON.stringify(r));
    assert.equal(d.resultType, 'complete');
    assert.deepEqual(d.supportedVersions, [V]);
    assert.deepEqual(d.capabilities, { tools: { listChanged: false }, extensions: { 'io.modelcontextprotocol/tasks': {} } });
    assert.equal(d._meta['io.modelcontextprotocol/serverInfo'].name, 'ignition-mcp');
    assert.equal(typeof d._meta['io.modelcontextprotocol/serverInfo'].version, 'string');
    assert.ok(Number.isInteger(d.ttlMs) && d.ttlMs >= 0);
    assert.equal(d.cacheScope, 'public');
    assert.match(d.instructions, /open_session/);
  });

  test('tools/list is the same list in both eras but for the legacy execution field; the modern one adds resultType and cache hints', T, async () => {
    const m = (await raw.request('tools/list', meta())).result;
    const l = (await raw.request('tools/list', {})).result;
    // 2025-11-25 says per tool whether it may run as a task; the 2026 Tool has no such field.
    for (const t of l.tools) assert.ok(['optional', 'forbidden'].includes(t.execution?.taskSupport), t.name);
    assert.deepEqual(m.tools, l.tools.map(({ execution, ...t }) => t));
    assert.equal(m.resultType, 'complete');
    assert.equal(m.cacheScope, 'public');
    assert.ok(Number.isInteger(m.ttlMs));
    assert.equal(l.resultType, undefined);
    assert.equal(l.ttlMs, undefined);
    assert.equal(l._meta, undefined);
  });

  test('an unsupported version is -32022 with the supported list and the requested one', T, async () => {
    for (const v of ['1900-01-01', '2025-11-25', '2026-07-28 ']) {
      const r = await raw.request('tools/list', meta({ 'io.modelcontextprotocol/protocolVersion': v }));
      assert.equal(r.error?.code, -32022, JSON.stringify(r));
      assert.deepEqual(r.error.data, { supported: [V], requested: v });
      assert.match(r.error.message, /unsupported protocol version/);
      assert.match(r.error.message, /initialize/);
    }
    const d = await raw.request('server/discover', meta({ 'io.modelcontextprotocol/protocolVersion': '2030-01-01' }));
    assert.equal(d.error?.code, -32022, JSON.stringify(d));
  });

  test('a malformed _meta envelope is -32602 with a message that says what is wrong', T, async () => {
    const cases = [
      [{ _meta: 'x' }, /must be an object/, 'server/discover'],
      [{ _meta: {} }, /has no io.modelcontextprotocol\/protocolVersion/, 'server/discover'],
      [{ _meta: { 'io.modelcontextprotocol/clientCapabilities': {} } }, /has no io.modelcontextprotocol\/protocolVersion/],
      [meta({ 'io.modelcontextprotocol/protocolVersion': 20260728 }), /must be a string/],
      [meta({ 'io.modelcontextprotocol/protocolVersion': '2026-07-28\u0000x' }), /must be a string/],
      [meta({ 'io.modelcontextprotocol/clientCapabilities': undefined }), /clientCapabilities is missing/],
      [meta({ 'io.modelcontextprotocol/clientCapabilities': [] }), /clientCapabilities must be an object/],
      [meta({ 'io.modelcontextprotocol/clientInfo': 'me' }), /clientInfo must be an object/],
      [meta({ 'io.modelcontextprotocol/clientInfo': { name: 'x' } }), /clientInfo must be an object/],
      [meta({ 'io.modelcontextprotocol/logLevel': 'loud' }), /logLevel must be one of/],
    ];
    for (const [params, re, method = 'tools/list'] of cases) {
      const r = await raw.request(method, JSON.parse(JSON.stringify(params)));
      assert.equal(r.error?.code, -32602, `${JSON.stringify(params)}: ${JSON.stringify(r)}`);
      assert.match(r.error.message, re);
    }
    // and the server keeps serving
    assert.ok((await raw.request('server/discover', meta())).result);
  });

  test('initialize, ping and logging/setLevel are not 2026-07-28 methods (-32601); unknown ones neither', T, async () => {
    for (const m of ['initialize', 'ping', 'logging/setLevel', 'resources/list', 'foo/bar']) {
      const r = await raw.request(m, meta());
      assert.equal(r.error?.code, -32601, `${m}: ${JSON.stringify(r)}`);
      assert.match(r.error.message, /server\/discover, tools\/list, tools\/call, and with the io\.modelcontextprotocol\/tasks extension tasks\/get, tasks\/cancel and tasks\/update/);
    }
  });

  test('server/discover without any _meta is a legacy request: -32601 naming what it needs', T, async () => {
    const r = await raw.request('server/discover', {});
    assert.equal(r.error?.code, -32601);
    assert.match(r.error.message, /io.modelcontextprotocol\/protocolVersion/);
  });

  test('tools/call results carry resultType and serverInfo; progress with the token; a cancel ends both', T, async () => {
    const o = await raw.request('tools/call', { name: 'open_session', arguments: {}, ...meta() }, { timeoutMs: 170_000 });
    assert.equal(o.result?.resultType, 'complete', JSON.stringify(o));
    assert.equal(o.result._meta['io.modelcontextprotocol/serverInfo'].name, 'ignition-mcp');
    assert.equal(o.result.ttlMs, undefined, 'a tool result is not cacheable');
    const sidRaw = o.result.structuredContent.session_id;
    const from = raw.messages.length;
    const r = await raw.request('tools/call', {
      name: 'run', arguments: { session_id: sidRaw, command: 'for i in 1 2 3; do echo tick$i; sleep 1; done' },
      ...meta({ progressToken: 'p-2026' }),
    }, { timeoutMs: 60_000 });
    assert.equal(r.result.structuredContent.stdout, 'tick1\ntick2\ntick3\n');
    const ps = raw.since(from).filter((m) => m.method === 'notifications/progress');
    assert.ok(ps.length >= 2, JSON.stringify(ps));
    for (const p of ps) assert.equal(p.params.progressToken, 'p-2026');
    // No notifications/message for a request that set no logLevel.
    assert.deepEqual(raw.since(from).filter((m) => m.method === 'notifications/message'), []);

    // Cancel: no response, no progress after the cancel, the command killed.
    const n = uniqueSleepSecs();
    await raw.send({ jsonrpc: '2.0', id: 'cancel-me', method: 'tools/call', params: {
      name: 'run', arguments: { session_id: sidRaw, command: `while :; do echo t; sleep 0.3; done & sleep ${n}; wait` },
      ...meta({ progressToken: 'p-cancel' }) } });
    await raw.waitFor((m) => m.method === 'notifications/progress' && m.params.progressToken === 'p-cancel', { timeoutMs: 30_000 });
    await raw.notify('notifications/cancelled', { requestId: 'cancel-me', reason: 'test' });
    await sleep(300);
    const afterCancel = raw.messages.length;
    await sleep(2500);
    const late = raw.since(afterCancel).filter((m) => m.id === 'cancel-me' || m.params?.progressToken === 'p-cancel');
    assert.deepEqual(late, [], 'messages for the cancelled call after its cancel');
    const ps2 = await raw.request('tools/call', { name: 'run', arguments: { session_id: sidRaw, command: 'ps -o args 2>/dev/null || ps' }, ...meta() });
    assert.ok(!ps2.result.structuredContent.stdout.includes(`sleep ${n}`), ps2.result.structuredContent.stdout);
    const cl = await raw.request('tools/call', { name: 'close', arguments: { session_id: sidRaw }, ...meta() });
    assert.equal(cl.result.structuredContent.ok, true);
  });

  test('one process serves both eras: an initialize and legacy calls between modern ones', T, async () => {
    const init = await raw.initialize();
    assert.equal(init.protocolVersion, '2025-11-25');
    assert.deepEqual((await raw.request('ping')).result, {});
    const m = await raw.request('tools/list', meta());
    assert.equal(m.result.resultType, 'complete');
    const l = await raw.request('tools/call', { name: 'list_sessions', arguments: {} });
    assert.equal(l.result.resultType, undefined);
    assert.ok(Array.isArray(l.result.structuredContent.sessions));
  });
});
