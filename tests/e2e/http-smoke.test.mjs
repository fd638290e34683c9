// http-smoke.test.mjs: the basics of ignition-mcp --http, on both backends.
//
// The official clients run a session over Streamable HTTP: the v2 client
// (@modelcontextprotocol/client) in the 2026-07-28 era, stateless with the
// mirrored headers, and the 1.x SDK (@modelcontextprotocol/sdk) in the
// legacy era, with an Mcp-Session-Id that DELETE ends.  A tokens file makes
// every request need its bearer token.  Raw requests check the refusals:
// 405, 404, 413, 403 for a foreign Origin, 400 for a header that does not
// match the body.  (tests/e2e/http.test.mjs has the exhaustive cases.)

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { Client as Client2 } from '@modelcontextprotocol/client';
import { StreamableHTTPClientTransport as Transport2 } from '@modelcontextprotocol/client';
import { Client as Client1 } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport as Transport1 } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { textOf, waitUntil } from './lib.mjs';
import { startHttp, runServer } from './helpers/http.mjs';

const V = '2026-07-28';
const TIMEOUT = 170_000;

async function tool(c, name, args = {}, opts = {}) {
  const res = await c.callTool({ name, arguments: args }, undefined, { timeout: TIMEOUT, ...opts });
  assert.equal(res.isError ?? false, false, `${name} failed: ${textOf(res)}`);
  return res.structuredContent;
}

/* The v2 client takes its options second (no result schema argument). */
async function tool2(c, name, args = {}, opts = {}) {
  const res = await c.callTool({ name, arguments: args }, { timeout: TIMEOUT, ...opts });
  assert.equal(res.isError ?? false, false, `${name} failed: ${textOf(res)}`);
  return res.structuredContent;
}

async function sessionOverV2(url, requestInit) {
  const client = new Client2({ name: 'ign-e2e-http', version: '0.0.1' }, { capabilities: {}, versionNegotiation: { mode: { pin: V } } });
  const errors = [];
  client.onerror = (e) => {
    const m = String(e?.message ?? e);
    if (!/progress notification for an unknown token/.test(m)) errors.push(m);
  };
  await client.connect(new Transport2(url, requestInit ? { requestInit } : {}));
  assert.equal(client.getProtocolEra(), 'modern');
  const { session_id } = await tool2(client, 'open_session');
  const progress = [];
  const r = await tool2(client, 'run', { session_id, command: 'echo hi' }, { onprogress: (p) => progress.push(p) });
  assert.equal(r.stdout, 'hi\n');
  assert.equal(r.exit_code, 0);
  const closed = await tool2(client, 'close', { session_id });
  assert.ok(closed, 'close answered');
  await client.close();
  assert.deepEqual(errors, [], 'the v2 client saw protocol errors');
}

const ENVELOPE = {
  'io.modelcontextprotocol/protocolVersion': V,
  'io.modelcontextprotocol/clientCapabilities': {},
  'io.modelcontextprotocol/clientInfo': { name: 'ign-e2e-raw', version: '0.0.1' },
};

function modernHeaders(method, name, extra = {}) {
  const h = { 'Content-Type': 'application/json', Accept: 'application/json, text/event-stream', 'MCP-Protocol-Version': V, 'Mcp-Method': method, ...extra };
  if (name) h['Mcp-Name'] = name;
  return h;
}

describe('over HTTP: the official clients', () => {
  let s;
  before(async () => {
    s = await startHttp();
  });
  after(async () => {
    await s?.close();
  });

  it('logs where it listens and that no tokens are in force', () => {
    assert.match(s.stderrText(), /listening on http:\/\/127\.0\.0\.1:\d+\/mcp/);
    assert.match(s.stderrText(), /auth: none/);
  });

  it('the v2 client runs a session in the 2026-07-28 era', async () => {
    await sessionOverV2(s.url);
  });

  it('the 1.x SDK runs a session in the legacy era and DELETE ends it', async () => {
    const transport = new Transport1(s.url);
    const client = new Client1({ name: 'ign-e2e-http-1x', version: '0.0.1' }, { capabilities: {} });
    const errors = [];
    client.onerror = (e) => errors.push(String(e?.message ?? e));
    await client.connect(transport);
    const sid = transport.sessionId;
    assert.match(sid ?? '', /^[0-9a-f]{32}$/, 'initialize returned an Mcp-Session-Id');
    const { session_id } = await tool(client, 'open_session');
    const r = await tool(client, 'run', { session_id, command: 'echo hi' });
    assert.equal(r.stdout, 'hi\n');
    await tool(client, 'close', { session_id });
    await transport.terminateSession();
    await client.close();
    // The legacy session is gone: a request that names it is a 404.
    const res = await fetch(s.url, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', 'Mcp-Session-Id': sid, 'MCP-Protocol-Version': '2025-06-18' },
      body: JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'ping' }),
    });
    assert.equal(res.status, 404);
    assert.deepEqual(errors.filter((e) => !/405|SSE stream/i.test(e)), [], 'the 1.x client saw protocol errors');
  });
});

describe('over HTTP: bearer tokens', () => {
  let s, dir, token;
  before(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-http-tokens-'));
    token = crypto.randomBytes(24).toString('hex');
    const file = path.join(dir, 'tokens');
    fs.writeFileSync(file, `# name:token\nalice:${token}\n`, { mode: 0o600 });
    s = await startHttp({ env: { IGN_MCP_HTTP_TOKENS: file } });
  });
  after(async () => {
    await s?.close();
    fs.rmSync(dir, { recursive: true, force: true });
  });

  it('logs the names in force, never a token', () => {
    assert.match(s.stderrText(), /auth: bearer tokens, 1 names? from /);
    assert.ok(!s.stderrText().includes(token), 'the token is in the log');
  });

  it('refuses a request without a token, or with a wrong one, with 401 and the metadata URL', async () => {
    const body = JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'tools/list', params: { _meta: ENVELOPE } });
    const res = await fetch(s.url, { method: 'POST', headers: modernHeaders('tools/list'), body });
    assert.equal(res.status, 401);
    const www = res.headers.get('www-authenticate');
    assert.match(www, new RegExp(`^Bearer resource_metadata="${s.base}/\\.well-known/oauth-protected-resource/mcp"$`));
    const j = await res.json();
    assert.match(j.error.message, /Authorization: Bearer/);
    const bad = await fetch(s.url, { method: 'POST', headers: { ...modernHeaders('tools/list'), Authorization: 'Bearer nope-not-a-token' }, body });
    assert.equal(bad.status, 401);
    assert.match(bad.headers.get('www-authenticate'), /error="invalid_token"/);
    await bad.text();
    const meta = await fetch(`${s.base}/.well-known/oauth-protected-resource/mcp`);
    assert.equal(meta.status, 200);
    const m = await meta.json();
    assert.equal(m.resource, `${s.base}/mcp`);
    assert.deepEqual(m.bearer_methods_supported, ['header']);
  });

  it('serves the v2 client that sends its token', async () => {
    await sessionOverV2(s.url, { headers: { Authorization: `Bearer ${token}` } });
  });
});

describe('over HTTP: refusals', () => {
  let s;
  before(async () => {
    s = await startHttp({ env: { IGN_MCP_MAX_MESSAGE: 65536 } });
  });
  after(async () => {
    await s?.close();
  });

  it('GET /mcp is 405 with Allow: POST, DELETE', async () => {
    const res = await fetch(s.url);
    assert.equal(res.status, 405);
    assert.equal(res.headers.get('allow'), 'POST, DELETE');
    await res.text();
  });

  it('another path is 404 with a JSON-RPC error', async () => {
    const res = await fetch(`${s.base}/nope`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: '{}' });
    assert.equal(res.status, 404);
    assert.match((await res.json()).error.message, /\/mcp/);
  });

  it('a body over IGN_MCP_MAX_MESSAGE is 413', async () => {
    const body = JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'ping', params: { pad: 'x'.repeat(70000) } });
    const res = await fetch(s.url, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body });
    assert.equal(res.status, 413);
    assert.match((await res.json()).error.message, /IGN_MCP_MAX_MESSAGE/);
  });

  it('a foreign Origin is 403', async () => {
    const body = JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'tools/list', params: { _meta: ENVELOPE } });
    const res = await fetch(s.url, { method: 'POST', headers: { ...modernHeaders('tools/list'), Origin: 'https://evil.example' }, body });
    assert.equal(res.status, 403);
    const j = await res.json();
    assert.equal(j.id, null);
    assert.match(j.error.message, /Origin/);
    const ok = await fetch(s.url, { method: 'POST', headers: { ...modernHeaders('tools/list'), Origin: `http://localhost:${s.port}` }, body });
    assert.equal(ok.status, 200);
    await ok.text();
  });

  it('a header this server decides on, sent twice, is 400', async () => {
    const raw = (extra) => new Promise((resolve, reject) => {
      const body = JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'ping' });
      const sock = net.connect(s.port, '127.0.0.1');
      let got = '';
      sock.on('data', (d) => { got += d.toString('utf8'); });
      sock.on('end', () => resolve(got));
      sock.on('error', reject);
      sock.write(`POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:${s.port}\r\nContent-Type: application/json\r\n` +
                 `Connection: close\r\n${extra}Content-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`);
    });
    for (const extra of ['Host: evil.example\r\n', 'Origin: http://localhost\r\nOrigin: http://evil.example\r\n',
                         'Mcp-Method: ping\r\nMcp-Method: tools/call\r\n']) {
      const r = await raw(extra);
      assert.match(r, /^HTTP\/1\.1 400 /, `${JSON.stringify(extra)}: ${r.slice(0, 300)}`);
      assert.match(r, /more than one/);
    }
  });

  it('a header that does not match the body is 400 HeaderMismatch', async () => {
    const body = JSON.stringify({ jsonrpc: '2.0', id: 7, method: 'tools/call', params: { name: 'list_sessions', arguments: {}, _meta: ENVELOPE } });
    const res = await fetch(s.url, { method: 'POST', headers: modernHeaders('tools/call', 'open_session'), body });
    assert.equal(res.status, 400);
    const j = await res.json();
    assert.equal(j.id, 7);
    assert.equal(j.error.code, -32020);
    assert.match(j.error.message, /Mcp-Name/);
    assert.match(j.error.message, /open_session/);
    assert.match(j.error.message, /list_sessions/);
    // The same request with the right header is served.
    const ok = await fetch(s.url, { method: 'POST', headers: modernHeaders('tools/call', 'list_sessions'), body });
    assert.equal(ok.status, 200);
    assert.equal((await ok.json()).id, 7);
  });

  it('a tools/call with a progressToken is answered as an SSE stream', async () => {
    const body = JSON.stringify({ jsonrpc: '2.0', id: 8, method: 'tools/call', params: { name: 'list_sessions', arguments: {}, _meta: { ...ENVELOPE, progressToken: 'p' } } });
    const res = await fetch(s.url, { method: 'POST', headers: modernHeaders('tools/call', 'list_sessions'), body });
    assert.equal(res.status, 200);
    assert.equal(res.headers.get('content-type'), 'text/event-stream');
    const text = await res.text();
    const events = text.split('\n\n').filter((e) => e.startsWith('event: message\ndata: '));
    const last = JSON.parse(events.at(-1).slice('event: message\ndata: '.length));
    assert.equal(last.id, 8);
    assert.ok(last.result, text);
  });

  it('a notification is 202 without a body; a legacy request without its session is 400, with an unknown one 404', async () => {
    const n = await fetch(s.url, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ jsonrpc: '2.0', method: 'notifications/cancelled', params: { requestId: 99 } }) });
    assert.equal(n.status, 202);
    assert.equal(await n.text(), '');
    const ping = JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'ping' });
    const r1 = await fetch(s.url, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: ping });
    assert.equal(r1.status, 400);
    assert.match((await r1.json()).error.message, /Mcp-Session-Id/);
    const r2 = await fetch(s.url, { method: 'POST', headers: { 'Content-Type': 'application/json', 'Mcp-Session-Id': 'f'.repeat(32) }, body: ping });
    assert.equal(r2.status, 404);
    await r2.text();
    const d = await fetch(s.url, { method: 'DELETE', headers: { 'Mcp-Session-Id': 'f'.repeat(32) } });
    assert.equal(d.status, 404);
    await d.text();
  });

  it('a client that closes the connection cancels its call', async () => {
    const post = (id, name, args, signal) => fetch(s.url, {
      method: 'POST',
      headers: modernHeaders('tools/call', name, args.session_id ? { 'Mcp-Param-Session-Id': args.session_id } : {}),
      body: JSON.stringify({ jsonrpc: '2.0', id, method: 'tools/call', params: { name, arguments: args, _meta: ENVELOPE } }),
      signal,
    });
    const opened = await (await post(1, 'open_session', {})).json();
    const sid = opened.result.structuredContent.session_id;
    const ac = new AbortController();
    const started = Date.now();
    const pending = post(2, 'run', { session_id: sid, command: 'sleep 120', timeout_s: 150 }, ac.signal).catch((e) => e);
    setTimeout(() => ac.abort(), 1500);
    assert.equal((await pending).name, 'AbortError');
    const seen = await waitUntil(() => /call run cancelled: its client closed the connection/.test(s.stderrText()), { timeoutMs: 20000 });
    assert.ok(seen, `no cancellation in the log:\n${s.stderrText().slice(-2000)}`);
    // The session serves the next command as soon as the cancelled call has
    // ended (this server's small IGN_MCP_MAX_MESSAGE lets one run in at a
    // time: until then the next is refused as busy).
    let r;
    await waitUntil(async () => {
      r = await (await post(3, 'run', { session_id: sid, command: 'echo after' })).json();
      return !/^server busy/.test(r.result?.content?.[0]?.text ?? '');
    }, { timeoutMs: 30000, intervalMs: 200 });
    assert.equal(r.result?.structuredContent?.stdout, 'after\n', JSON.stringify(r).slice(0, 1000));
    assert.ok(Date.now() - started < 100_000, 'the cancelled call ran to its end');
    await (await post(4, 'close', { session_id: sid })).json();
  });

  it('binding another address than loopback without IGN_MCP_HTTP_TOKENS is refused', async () => {
    const r = await runServer(['--http', '0.0.0.0:0']);
    assert.equal(r.code, 2);
    assert.match(r.stderr, /IGN_MCP_HTTP_TOKENS/);
  });
});

describe('over HTTP: shutdown', () => {
  it('every call in flight at SIGTERM is answered before the connections close', async () => {
    const s = await startHttp();
    const post = (id, name, args) => fetch(s.url, {
      method: 'POST',
      headers: modernHeaders('tools/call', name, args.session_id ? { 'Mcp-Param-Session-Id': args.session_id } : {}),
      body: JSON.stringify({ jsonrpc: '2.0', id, method: 'tools/call', params: { name, arguments: args, _meta: ENVELOPE } }),
    });
    const opened = await (await post(1, 'open_session', {})).json();
    const sid = opened.result.structuredContent.session_id;
    const calls = [2, 3, 4, 5].map((id) => post(id, 'run', { session_id: sid, command: 'sleep 120', timeout_s: 150 })
      .then(async (r) => ({ status: r.status, body: await r.text() }), (e) => ({ error: String(e?.cause ?? e) })));
    await new Promise((r) => setTimeout(r, 1500));
    const closing = s.close();
    const answers = await Promise.all(calls);
    await closing;
    for (const a of answers) {
      assert.equal(a.error, undefined, `a call got no answer: ${JSON.stringify(answers)}`);
      assert.ok(a.body.length > 0, JSON.stringify(a));
    }
  });
});
