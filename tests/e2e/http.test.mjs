// http.test.mjs: the Streamable HTTP transport (`ignition-mcp --http
// [ADDR:]PORT`, one endpoint /mcp), on both backends.
//
//  - Through the official SDKs: the v2 client (@modelcontextprotocol/client,
//    modern era, stateless requests with the 2026-07-28 headers) and the 1.x
//    client (@modelcontextprotocol/sdk, legacy era: initialize, Mcp-Session-Id,
//    DELETE) each call every tool the server lists and check the results;
//    progress reaches the v2 client over SSE.
//  - Byte by byte through node's http and net modules, for everything a
//    client library would not send: every status code of the transport
//    (202, 400 with -32020/-32022, 400 without Host, 401, 403 Origin/Host, 404,
//    405, 406, 413, 415), a closed connection cancelling its call, a slowloris connection,
//    the connection and call caps, tokens owning sessions, tokens never
//    logged, and what the server refuses at startup.
//
// One session per SDK client (the vm pass pays a microVM per session); the
// servers that open no session run with IGN_MCP_POOL=0.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import crypto from 'node:crypto';
import fs from 'node:fs';
import http from 'node:http';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { Client as Client2 } from '@modelcontextprotocol/client';
import { StreamableHTTPClientTransport as HttpTransport2 } from '@modelcontextprotocol/client';
import { Client as Client1 } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport as HttpTransport1 } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import {
  SERVER, IS_NS, IS_VM, serverEnv, textOf, sleep, waitUntil, findProcs, uniqueSleepSecs, descendants,
  waitGone, assertNoSanitizerReport, assertNoVmLeftovers, hardKill, TOOL_NAMES,
} from './lib.mjs';

const T = { timeout: 240_000 };
const V = '2026-07-28';
const LEGACY_V = '2025-11-25';
const ENVELOPE = {
  'io.modelcontextprotocol/protocolVersion': V,
  'io.modelcontextprotocol/clientCapabilities': {},
  'io.modelcontextprotocol/clientInfo': { name: 'ign-e2e-http', version: '0.0.1' },
};
const meta = (extra = {}) => ({ _meta: { ...ENVELOPE, ...extra } });
/* The servers that open no session need no pool of warm VMs. */
const NO_POOL = { IGN_MCP_POOL: 0 };

// ---------------------------------------------------------------- helpers

const temps = [];
const servers = new Set();
after(() => {
  for (const s of servers) hardKill(s.pid);
  for (const d of temps) fs.rmSync(d, { recursive: true, force: true });
});

/* A directory of the test's own (no "ign" in its name: the leftover checks
 * of other files look for those). */
function tempDir(tag) {
  const d = fs.mkdtempSync(path.join(os.tmpdir(), `e2e-http-${tag}-`));
  fs.chmodSync(d, 0o755);
  temps.push(d);
  return d;
}

const newToken = () => crypto.randomBytes(24).toString('hex');

/* A tokens file (IGN_MCP_HTTP_TOKENS) holding TEXT, mode 0600 unless told. */
function tokensFile(text, mode = 0o600) {
  const f = path.join(tempDir('tokens'), 'tokens');
  fs.writeFileSync(f, text, { mode });
  fs.chmodSync(f, mode);
  return f;
}

/* Spawns `ignition-mcp --http LISTEN`; resolves with {pid, port, url,
 * stderrText(), close()} once the server says where it listens, or rejects
 * with its stderr when it exits first. tokens: {name: token}. */
async function startHttp({ listen = '127.0.0.1:0', env = {}, tokens = null, cwd = null, tools = false } = {}) {
  const e = { ...env };
  if (tokens) e.IGN_MCP_HTTP_TOKENS = tokensFile(Object.entries(tokens).map(([n, t]) => `${n}:${t}\n`).join(''));
  const child = spawn(SERVER, ['--http', listen], {
    env: serverEnv({ env: e, tools }),
    cwd: cwd ?? tempDir('cwd'),
    stdio: ['pipe', 'pipe', 'pipe'],
  });
  const s = { pid: child.pid, child };
  servers.add(s);
  let stderr = '';
  let stdout = '';
  child.stderr.on('data', (d) => (stderr += d.toString('utf8')));
  child.stdout.on('data', (d) => (stdout += d.toString('utf8')));
  child.stdin.on('error', () => {});
  let exited = null;
  const exitP = new Promise((r) => child.on('exit', (code, signal) => r((exited = { code, signal }))));
  const m = await waitUntil(() => exited || stderr.match(/listening on (http:\/\/(\S+):(\d+)\/mcp)/), { timeoutMs: 60_000, intervalMs: 50 });
  if (!m || exited) {
    hardKill(child.pid);
    servers.delete(s);
    throw new Error(`ignition-mcp --http ${listen} did not start (${JSON.stringify(exited)}):\n${stderr}`);
  }
  Object.assign(s, {
    url: m[1],
    host: m[2],
    port: Number(m[3]),
    stderrText: () => stderr,
    stdoutText: () => stdout,
    exited: () => exited,
    /* SIGTERM; no descendant, QEMU or state directory may outlive it, and
     * stderr must hold no sanitizer report. */
    async close() {
      if (!servers.has(s)) return;
      servers.delete(s);
      const kids = exited ? [] : descendants(child.pid);
      child.kill('SIGTERM');
      let t;
      const done = await Promise.race([exitP, new Promise((r) => (t = setTimeout(() => r(null), 15_000)))]);
      clearTimeout(t);
      if (!done) {
        hardKill(child.pid);
        await exitP;
      }
      const left = await waitGone(kids, 8000);
      for (const l of left) {
        try {
          process.kill(l.pid, 'SIGKILL');
        } catch {}
      }
      assert.ok(done, `the server did not exit within 15 s of SIGTERM; stderr:\n${stderr.slice(-3000)}`);
      assert.deepEqual(left.map((l) => `${l.pid} ${l.cmd}`), [], 'processes started by the server outlived it');
      await assertNoVmLeftovers(child.pid);
      assertNoSanitizerReport(stderr);
    },
  });
  return s;
}

/* Runs the server to its end, expecting it to refuse to start: {code,
 * signal, stderr}. */
function startRefused(args, env) {
  return new Promise((resolve, reject) => {
    const child = spawn(SERVER, args, { env: serverEnv({ env: { ...NO_POOL, ...env } }), cwd: tempDir('cwd'), stdio: ['pipe', 'pipe', 'pipe'] });
    let stderr = '';
    child.stderr.on('data', (d) => (stderr += d.toString('utf8')));
    child.stdin.on('error', () => {});
    const timer = setTimeout(() => {
      hardKill(child.pid);
      reject(new Error(`ignition-mcp ${args.join(' ')} still runs after 20 s; stderr:\n${stderr}`));
    }, 20_000);
    child.on('exit', (code, signal) => {
      clearTimeout(timer);
      resolve({ code, signal, stderr });
    });
  });
}

/* One HTTP request through node's http module, every header as given (a
 * header of value undefined is left out). Resolves with {status, headers,
 * text, json, events} (events: the SSE messages, parsed). */
function request(srv, { method = 'POST', path: p = '/mcp', headers = {}, body, agent = false, timeoutMs = 120_000, onResponse } = {}) {
  return new Promise((resolve, reject) => {
    const h = {};
    for (const [k, v] of Object.entries(headers)) if (v !== undefined) h[k] = v;
    const buf = body === undefined ? null : Buffer.isBuffer(body) ? body : Buffer.from(typeof body === 'string' ? body : JSON.stringify(body));
    if (buf && !Object.keys(h).some((k) => k.toLowerCase() === 'content-length' || k.toLowerCase() === 'transfer-encoding')) h['Content-Length'] = buf.length;
    const req = http.request({ host: '127.0.0.1', port: srv.port, method, path: p, headers: h, agent }, (res) => {
      onResponse?.(res, req);
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('error', reject);
      res.on('end', () => {
        const text = Buffer.concat(chunks).toString('utf8');
        let json = null;
        try {
          json = JSON.parse(text);
        } catch {}
        resolve({ status: res.statusCode, headers: res.headers, text, json, events: sseEvents(text) });
      });
    });
    req.setTimeout(timeoutMs, () => req.destroy(new Error(`no answer to ${method} ${p} in ${timeoutMs} ms`)));
    req.on('error', reject);
    if (buf) req.end(buf);
    else req.end();
  });
}

/* The JSON messages of an SSE body (data: lines joined per event). */
function sseEvents(text) {
  const out = [];
  for (const block of text.split(/\r?\n\r?\n/)) {
    const data = block.split(/\r?\n/).filter((l) => l.startsWith('data:')).map((l) => l.slice(5).replace(/^ /, ''));
    if (!data.length) continue;
    try {
      out.push(JSON.parse(data.join('\n')));
    } catch {
      out.push({ unparsable: data.join('\n') });
    }
  }
  return out;
}

/* The headers a modern POST of MSG must carry, with the token. */
function modernHeaders(msg, token) {
  const h = {
    'Content-Type': 'application/json',
    Accept: 'application/json, text/event-stream',
    'MCP-Protocol-Version': msg.params?._meta?.['io.modelcontextprotocol/protocolVersion'] ?? V,
    'Mcp-Method': msg.method,
  };
  if (msg.method.startsWith('tasks/') && typeof msg.params?.taskId === 'string') h['Mcp-Name'] = msg.params.taskId;
  if (msg.method === 'tools/call') {
    h['Mcp-Name'] = msg.params.name;
    const sid = msg.params.arguments?.session_id;
    if (typeof sid === 'string') h['Mcp-Param-Session-Id'] = sid;
  }
  if (token) h.Authorization = `Bearer ${token}`;
  return h;
}

let nextId = 1;
const modernMsg = (method, params = {}, extraMeta = {}) => ({ jsonrpc: '2.0', id: nextId++, method, params: { ...params, ...meta(extraMeta) } });
const callMsg = (name, args = {}, extraMeta = {}) => modernMsg('tools/call', { name, arguments: args }, extraMeta);

/* A modern request with its proper headers; HEADERS changes or removes
 * (undefined) some of them. */
function modern(srv, msg, { token, headers = {}, ...opts } = {}) {
  const h = { ...modernHeaders(msg, token) };
  for (const [k, v] of Object.entries(headers)) {
    for (const hk of Object.keys(h)) if (hk.toLowerCase() === k.toLowerCase()) delete h[hk];
    if (v !== undefined) h[k] = v;
  }
  return request(srv, { headers: h, body: msg, ...opts });
}

/* The JSON-RPC response of an answer, whether plain JSON or SSE. */
function rpcOf(r) {
  if (r.json) return r.json;
  return r.events.find((e) => 'id' in e && ('result' in e || 'error' in e)) ?? null;
}

/* A tools/call over raw HTTP that must succeed: its structuredContent. */
async function rawTool(srv, token, name, args = {}) {
  const r = await modern(srv, callMsg(name, args), { token });
  assert.equal(r.status, 200, `${name}: HTTP ${r.status} ${r.text.slice(0, 500)}`);
  const m = rpcOf(r);
  assert.ok(m?.result, `${name}: ${r.text.slice(0, 500)}`);
  assert.notEqual(m.result.isError, true, `${name}(${JSON.stringify(args).slice(0, 200)}) failed: ${textOf(m.result)}`);
  return m.result.structuredContent;
}

/* A tools/call over raw HTTP that must fail as a tool error: its text. */
async function rawToolErr(srv, token, name, args = {}) {
  const r = await modern(srv, callMsg(name, args), { token });
  assert.equal(r.status, 200, `${name}: HTTP ${r.status} ${r.text.slice(0, 500)}`);
  const m = rpcOf(r);
  assert.equal(m?.result?.isError, true, `${name}(${JSON.stringify(args).slice(0, 200)}) should fail: ${r.text.slice(0, 500)}`);
  return textOf(m.result);
}

/* A legacy (2025-11-25) initialize: the Mcp-Session-Id it mints. */
async function legacyInit(srv, token) {
  const r = await request(srv, {
    headers: { 'Content-Type': 'application/json', Accept: 'application/json, text/event-stream', Authorization: token && `Bearer ${token}` },
    body: { jsonrpc: '2.0', id: nextId++, method: 'initialize', params: { protocolVersion: LEGACY_V, capabilities: {}, clientInfo: { name: 'ign-e2e-http', version: '0.0.1' } } },
  });
  assert.equal(r.status, 200, r.text);
  assert.equal(rpcOf(r)?.result?.protocolVersion, LEGACY_V, r.text);
  const sid = r.headers['mcp-session-id'];
  assert.match(sid ?? '', /^[\x21-\x7e]{16,}$/, `initialize minted no usable Mcp-Session-Id: ${JSON.stringify(r.headers)}`);
  return sid;
}

function legacy(srv, sid, msg, { token, headers = {} } = {}) {
  return request(srv, {
    headers: {
      'Content-Type': 'application/json', Accept: 'application/json, text/event-stream', 'MCP-Protocol-Version': LEGACY_V,
      'Mcp-Session-Id': sid, Authorization: token && `Bearer ${token}`, ...headers,
    },
    body: msg,
  });
}

const b64 = (s) => `=?base64?${Buffer.from(s, 'utf8').toString('base64')}?=`;

/* Every process whose argv is `sleep N`, on ns; on vm, the session's own ps. */
async function sleepRuns(srv, token, sid, n) {
  if (IS_NS) return findProcs(['sleep', String(n)]).length > 0;
  const ps = await rawTool(srv, token, 'run', { session_id: sid, command: 'ps -o args 2>/dev/null || ps' });
  return ps.stdout.split('\n').some((l) => l.trim() === `sleep ${n}` || l.includes(`sleep ${n}`) && !l.includes('ps -o'));
}

// ---------------------------------------------------------------- every tool

/* The same walk through every tool the server lists, for either SDK client:
 * CALL(name, args) resolves with the raw tools/call result. DIR is the
 * server's working directory (its host-I/O root). Returns the names called. */
async function everyTool(listed, callTool, dir) {
  const called = new Set();
  const ok = async (name, args = {}) => {
    const res = await callTool(name, args);
    assert.equal(res.isError ?? false, false, `${name}(${JSON.stringify(args).slice(0, 200)}) failed: ${textOf(res)}`);
    assert.ok(res.structuredContent && typeof res.structuredContent === 'object', `${name}: no structuredContent`);
    called.add(name);
    return res.structuredContent;
  };
  assert.deepEqual([...listed].sort(), [...TOOL_NAMES].sort(), 'tools/list over HTTP');

  const o = await ok('open_session');
  const sid = o.session_id;
  assert.match(sid, /^\S+$/);
  assert.match(o.isolation, IS_VM ? /microvm/ : /namespace/);
  const r = await ok('run', { session_id: sid, command: 'echo out; echo err >&2; exit 7' });
  assert.deepEqual([r.stdout, r.stderr, r.exit_code], ['out\n', 'err\n', 7]);

  const data = crypto.randomBytes(3000);
  const w = await ok('write_file', { session_id: sid, path: '/root/a.bin', content_base64: data.toString('base64') });
  assert.equal(w.bytes, data.length);
  const rd = await ok('read_file', { session_id: sid, path: '/root/a.bin' });
  assert.deepEqual(Buffer.from(rd.content_base64, 'base64'), data);
  assert.equal(rd.eof, true);

  const l = await ok('list_sessions');
  assert.deepEqual(l.sessions.map((x) => x.session_id), [sid]);
  const nl = await ok('network_log', { session_id: sid });
  assert.equal(nl.mode, 'none');
  assert.deepEqual([nl.allowed, nl.denied], [[], []]);
  const nu = await ok('network_update', { session_id: sid, network: 'none' });
  assert.deepEqual([nu.mode, nu.previous.mode, nu.connections_reset], ['none', 'none', 0]);
  const h = await ok('hibernate', { session_id: sid });
  assert.equal(h.state, 'hibernated');
  const back = await ok('read_file', { session_id: sid, path: '/root/a.bin' });
  assert.deepEqual(Buffer.from(back.content_base64, 'base64'), data, 'the file after a resume');
  assert.equal(typeof back.resumed_ms, 'number');

  const marker = crypto.randomBytes(8).toString('hex');
  fs.mkdirSync(path.join(dir, 'in/sub'), { recursive: true });
  fs.writeFileSync(path.join(dir, 'in/sub/f.txt'), `${marker}\n`);
  const ci = await ok('copy_in', { session_id: sid, host_path: 'in', guest_path: '/root/in' });
  assert.equal(ci.copied.files, 1);
  assert.equal((await ok('run', { session_id: sid, command: 'cat /root/in/sub/f.txt' })).stdout, `${marker}\n`);
  await ok('run', { session_id: sid, command: 'echo from-guest > /root/in/sub/g.txt' });
  const co = await ok('copy_out', { session_id: sid, guest_path: '/root/in', host_path: 'out' });
  assert.equal(co.copied.files, 2);
  assert.equal(fs.readFileSync(path.join(dir, 'out/sub/g.txt'), 'utf8'), 'from-guest\n');
  assert.equal(fs.readFileSync(path.join(dir, 'out/sub/f.txt'), 'utf8'), `${marker}\n`);

  const name = `http-${process.pid}-${marker}`;
  const c = await ok('commit', { session_id: sid, name });
  assert.equal(c.stage, name);
  assert.equal(typeof c.stage_id, 'string');
  const sl = await ok('stage_list');
  assert.ok(sl.stages.some((x) => x.name === name && x.stage_id === c.stage_id), JSON.stringify(sl));
  const si = await ok('stage_info', { name });
  assert.equal(si.stage_id, c.stage_id);
  assert.equal(si.sessions, 0);

  const f = await ok('fork', { session_id: sid, count: 1 });
  assert.equal(f.sessions.length, 1);
  const fid = f.sessions[0].session_id;
  assert.notEqual(fid, sid);
  const fr = await ok('read_file', { session_id: fid, path: '/root/a.bin' });
  assert.deepEqual(Buffer.from(fr.content_base64, 'base64'), data, 'the fork lacks the source\'s file');
  assert.equal((await ok('close', { session_id: fid })).ok, true);

  await ok('reset', { session_id: sid });
  assert.equal((await ok('run', { session_id: sid, command: 'test -e /root/a.bin && echo kept || echo wiped' })).stdout, 'wiped\n');

  await ok('stage_rm', { name });
  assert.ok(!(await ok('stage_list')).stages.some((x) => x.name === name), 'stage_rm left the stage listed');

  const one = await ok('sandbox_run', { command: 'echo one-shot; uname -s' });
  assert.deepEqual([one.stdout, one.exit_code], ['one-shot\nLinux\n', 0]);

  assert.equal((await ok('close', { session_id: sid })).ok, true);
  const after = await callTool('run', { session_id: sid, command: 'true' });
  assert.equal(after.isError, true);
  assert.ok(textOf(after).includes(sid), textOf(after));
  return called;
}

// ---------------------------------------------------------------- the SDKs

describe('the v2 SDK client, modern era, over HTTP', () => {
  let srv, client, dir, token, errors;
  before(async () => {
    dir = tempDir('v2');
    token = newToken();
    srv = await startHttp({ tokens: { v2client: token }, cwd: dir });
    client = new Client2({ name: 'ign-e2e-http-v2', version: '0.0.1' }, { capabilities: {}, versionNegotiation: { mode: { pin: V } } });
    errors = [];
    client.onerror = (e) => {
      const m = String(e?.message ?? e);
      if (!/progress notification for an unknown token/.test(m)) errors.push(m);
    };
    const transport = new HttpTransport2(new URL(srv.url), { requestInit: { headers: { Authorization: `Bearer ${token}` } } });
    await client.connect(transport);
  });
  after(async () => {
    await client?.close().catch(() => {});
    await srv?.close();
    assert.deepEqual(errors, [], 'the v2 client saw protocol errors');
  });

  test('connects in the modern era (server/discover over HTTP)', T, async () => {
    assert.equal(client.getProtocolEra(), 'modern');
    assert.equal(client.getNegotiatedProtocolVersion(), V);
    assert.equal(client.getServerVersion()?.name, 'ignition-mcp');
  });

  test('calls every tool the server lists, with real results', T, async () => {
    const { tools } = await client.listTools();
    const called = await everyTool(tools.map((t) => t.name), (name, args) => client.callTool({ name, arguments: args }, { timeout: 200_000 }), dir);
    assert.deepEqual([...called].sort(), tools.map((t) => t.name).sort(), 'a listed tool was not called');
  });

  test('progress over SSE: notifications, in order, then the result', T, async () => {
    const prog = [];
    const res = await client.callTool({ name: 'sandbox_run', arguments: { command: 'for i in 1 2 3; do echo tick$i; sleep 1; done' } },
      { timeout: 200_000, onprogress: (p) => prog.push(p) });
    assert.notEqual(res.isError, true, textOf(res));
    assert.equal(res.structuredContent.stdout, 'tick1\ntick2\ntick3\n');
    assert.ok(prog.length >= 2, `only ${prog.length} progress notifications: ${JSON.stringify(prog)}`);
    for (let i = 1; i < prog.length; i++) assert.ok(prog[i].progress > prog[i - 1].progress, JSON.stringify(prog));
  });
});

describe('the 1.x SDK client, legacy era, over HTTP', () => {
  let srv, client, transport, dir, token, errors;
  before(async () => {
    dir = tempDir('v1');
    token = newToken();
    srv = await startHttp({ tokens: { v1client: token }, cwd: dir });
    client = new Client1({ name: 'ign-e2e-http-v1', version: '0.0.1' }, { capabilities: {} });
    errors = [];
    client.onerror = (e) => {
      const m = String(e?.message ?? e);
      if (!/progress notification for an unknown token/.test(m)) errors.push(m);
    };
    transport = new HttpTransport1(new URL(srv.url), { requestInit: { headers: { Authorization: `Bearer ${token}` } } });
    await client.connect(transport);
  });
  after(async () => {
    await client?.close().catch(() => {});
    await srv?.close();
    assert.deepEqual(errors.filter((m) => !/SSE stream|405/.test(m)), [], 'the 1.x client saw protocol errors');
  });

  test('initialize over HTTP mints an Mcp-Session-Id', T, async () => {
    assert.equal(client.getServerVersion()?.name, 'ignition-mcp');
    assert.match(transport.sessionId ?? '', /^[\x21-\x7e]{16,}$/);
    assert.equal(typeof client.getServerCapabilities()?.tools, 'object');
  });

  test('calls every tool the server lists, with real results', T, async () => {
    const { tools } = await client.listTools();
    const called = await everyTool(tools.map((t) => t.name), (name, args) => client.callTool({ name, arguments: args }, undefined, { timeout: 200_000 }), dir);
    assert.deepEqual([...called].sort(), tools.map((t) => t.name).sort(), 'a listed tool was not called');
  });

  test('progress reaches onprogress; the result follows', T, async () => {
    const prog = [];
    const res = await client.callTool({ name: 'sandbox_run', arguments: { command: 'for i in 1 2 3; do echo tock$i; sleep 1; done' } },
      undefined, { timeout: 200_000, onprogress: (p) => prog.push(p) });
    assert.equal(res.structuredContent.stdout, 'tock1\ntock2\ntock3\n');
    assert.ok(prog.length >= 2, `only ${prog.length} progress notifications`);
  });

  test('terminateSession (DELETE) ends the HTTP session: its id is then unknown (404)', T, async () => {
    const sid = transport.sessionId;
    await transport.terminateSession();
    const r = await legacy(srv, sid, { jsonrpc: '2.0', id: nextId++, method: 'tools/list', params: {} }, { token });
    assert.equal(r.status, 404, r.text);
  });
});

describe('tasks over HTTP: they belong to a token and outlive the connection that made them', () => {
  const EXT = 'io.modelcontextprotocol/tasks';
  const withTasks = { 'io.modelcontextprotocol/clientCapabilities': { extensions: { [EXT]: {} } } };
  let srv, dir, tokA, tokB;
  const v1 = async (token) => {
    const client = new Client1({ name: 'ign-e2e-http-tasks', version: '0.0.1' }, { capabilities: {} });
    await client.connect(new HttpTransport1(new URL(srv.url), { requestInit: { headers: { Authorization: `Bearer ${token}` } } }));
    return client;
  };
  before(async () => {
    dir = tempDir('tasks');
    tokA = newToken();
    tokB = newToken();
    srv = await startHttp({ tokens: { alice: tokA, bob: tokB }, cwd: dir });
  });
  after(async () => {
    await srv?.close();
  });

  test('2025-11-25: a client that disconnects after the task is made collects its result on a new connection; another token\'s client finds no such task', T, async () => {
    const a1 = await v1(tokA);
    const sid = (await a1.callTool({ name: 'open_session', arguments: {} })).structuredContent.session_id;
    const { CallToolResultSchema } = await import('@modelcontextprotocol/sdk/types.js');
    let id;
    const stream = a1.experimental.tasks.callToolStream({ name: 'run', arguments: { session_id: sid, command: 'sleep 3; echo collected' } }, CallToolResultSchema, { task: {} });
    for await (const m of stream) {
      if (m.type === 'taskCreated') {
        id = m.task.taskId;
        break;
      }
    }
    assert.match(id ?? '', /^t[0-9a-f]{32}$/);
    await a1.close();
    const b = await v1(tokB);
    const ofB = await b.experimental.tasks.getTask(id).then(() => null, (e) => e);
    const nobody = await b.experimental.tasks.getTask('t' + 'f'.repeat(32)).then(() => null, (e) => e);
    assert.equal(ofB?.code, -32602);
    assert.equal(ofB.message.replace(id, 'ID'), nobody.message.replace('t' + 'f'.repeat(32), 'ID'), 'another token\'s task must read as an id nobody made');
    await assert.rejects(b.experimental.tasks.cancelTask(id), (e) => e.code === -32602);
    assert.deepEqual((await b.experimental.tasks.listTasks()).tasks, []);
    await b.close();
    const a2 = await v1(tokA);
    const r = await a2.experimental.tasks.getTaskResult(id, CallToolResultSchema);
    assert.equal(r.structuredContent.stdout, 'collected\n');
    assert.equal(r._meta['io.modelcontextprotocol/related-task'].taskId, id);
    await a2.callTool({ name: 'close', arguments: { session_id: sid } });
    await a2.close();
  });

  test('2026-07-28: Mcp-Name must carry the taskId of tasks/get and tasks/cancel; a tasks/get of another token is unknown', T, async () => {
    const sid = await rawTool(srv, tokA, 'open_session', {}).then((s) => s.session_id);
    const made = rpcOf(await modern(srv, callMsg('run', { session_id: sid, command: 'sleep 2; echo modern' }, withTasks), { token: tokA }));
    assert.equal(made.result.resultType, 'task', JSON.stringify(made));
    const id = made.result.taskId;
    const get = (token, headers = {}) => modern(srv, modernMsg('tasks/get', { taskId: id }, withTasks), { token, headers });
    const wrong = await get(tokA, { 'Mcp-Name': 'tother' });
    assert.equal(wrong.status, 400, wrong.text);
    assert.equal(rpcOf(wrong)?.error?.code, -32020);
    assert.match(rpcOf(wrong).error.message, /Mcp-Name header value 'tother' does not match body value '.*' \(params\.taskId\)/);
    const missing = await get(tokA, { 'Mcp-Name': undefined });
    assert.equal(rpcOf(missing)?.error?.code, -32020);
    const other = rpcOf(await get(tokB));
    assert.equal(other?.error?.code, -32602);
    assert.match(other.error.message, /Task not found/);
    const done = await waitUntil(async () => {
      const g = rpcOf(await get(tokA));
      return g?.result?.status === 'completed' ? g : null;
    }, { timeoutMs: 30_000, intervalMs: 500 });
    assert.ok(done, 'the task never completed');
    assert.equal(done.result.result.structuredContent.stdout, 'modern\n');
    await rawTool(srv, tokA, 'close', { session_id: sid });
  });
});

// ---------------------------------------------------------------- raw HTTP

describe('raw HTTP: status codes, headers, tokens', () => {
  let srv;
  const alice = newToken();
  const bob = newToken();
  const ORIGIN_OK = 'https://app.example.test';
  const HOST_OK = 'mcp.example.test';
  before(async () => {
    srv = await startHttp({
      tokens: { alice, bob },
      // A small message cap for the 413 cases; the output cap small too, so
      // that a few calls fit in the calls' byte budget (4 x the message cap).
      env: { IGN_MCP_HTTP_ORIGINS: ORIGIN_OK, IGN_MCP_HTTP_HOSTS: HOST_OK, IGN_MCP_MAX_MESSAGE: 131072, IGN_MCP_OUTPUT_CAP: 4096, IGN_MCP_POOL: IS_VM ? 1 : 0 },
    });
  });
  after(() => srv?.close());

  test('server/discover: 200, application/json, the DiscoverResult', T, async () => {
    const r = await modern(srv, modernMsg('server/discover'), { token: alice });
    assert.equal(r.status, 200, r.text);
    assert.match(r.headers['content-type'], /^application\/json/);
    assert.deepEqual(r.json.result.supportedVersions, [V]);
    assert.equal(r.json.result._meta['io.modelcontextprotocol/serverInfo'].name, 'ignition-mcp');
    assert.equal(r.headers['mcp-session-id'], undefined, 'a modern request got an Mcp-Session-Id');
  });

  test('a notification is 202 with no body (modern and legacy)', T, async () => {
    // A modern notification: the envelope in _meta, the standard headers.
    const n = { jsonrpc: '2.0', method: 'notifications/cancelled', params: { requestId: 999999, reason: 'test', ...meta() } };
    let r = await request(srv, { headers: { 'Content-Type': 'application/json', Accept: 'application/json, text/event-stream', Authorization: `Bearer ${alice}`, 'MCP-Protocol-Version': V, 'Mcp-Method': n.method }, body: n });
    assert.equal(r.status, 202, r.text);
    assert.equal(r.text, '');
    const sid = await legacyInit(srv, alice);
    r = await legacy(srv, sid, { jsonrpc: '2.0', method: 'notifications/initialized' }, { token: alice });
    assert.equal(r.status, 202, r.text);
    assert.equal(r.text, '');
  });

  test('-32020: every missing or mismatched standard header is 400', T, async () => {
    const sidArg = 'no-such-session-0123';
    const cases = [
      ['MCP-Protocol-Version missing', modernMsg('tools/list'), { 'MCP-Protocol-Version': undefined }],
      ['MCP-Protocol-Version mismatched', modernMsg('tools/list'), { 'MCP-Protocol-Version': LEGACY_V }],
      ['Mcp-Method missing', modernMsg('tools/list'), { 'Mcp-Method': undefined }],
      ['Mcp-Method mismatched', modernMsg('tools/list'), { 'Mcp-Method': 'server/discover' }],
      ['Mcp-Name missing', callMsg('list_sessions'), { 'Mcp-Name': undefined }],
      ['Mcp-Name mismatched', callMsg('list_sessions'), { 'Mcp-Name': 'stage_list' }],
      ['Mcp-Param-Session-Id missing', callMsg('run', { session_id: sidArg, command: 'true' }), { 'Mcp-Param-Session-Id': undefined }],
      ['Mcp-Param-Session-Id mismatched', callMsg('run', { session_id: sidArg, command: 'true' }), { 'Mcp-Param-Session-Id': 'another-session' }],
      ['Mcp-Param-Session-Id without the argument', callMsg('list_sessions'), { 'Mcp-Param-Session-Id': sidArg }],
      ['Mcp-Name, base64 of another name', callMsg('list_sessions'), { 'Mcp-Name': b64('stage_list') }],
      ['Mcp-Param-Session-Id, base64 of another id', callMsg('run', { session_id: sidArg, command: 'true' }), { 'Mcp-Param-Session-Id': b64('another') }],
    ];
    for (const [what, msg, headers] of cases) {
      const r = await modern(srv, msg, { token: alice, headers });
      assert.equal(r.status, 400, `${what}: HTTP ${r.status} ${r.text}`);
      assert.equal(r.json?.error?.code, -32020, `${what}: ${r.text}`);
      assert.equal(r.json.id, msg.id, `${what}: the error answers another id`);
      assert.equal(typeof r.json.error.message, 'string');
    }
  });

  test('=?base64?…?= header values are decoded: the same request passes', T, async () => {
    let r = await modern(srv, callMsg('list_sessions'), { token: alice, headers: { 'Mcp-Name': b64('list_sessions') } });
    assert.equal(r.status, 200, r.text);
    assert.ok(Array.isArray(rpcOf(r)?.result?.structuredContent?.sessions), r.text);
    // A session id that could not travel as a plain header value.
    const odd = 'sess\u00e9-\u65e5\u672c';
    r = await modern(srv, callMsg('run', { session_id: odd, command: 'true' }), { token: alice, headers: { 'Mcp-Param-Session-Id': b64(odd) } });
    assert.equal(r.status, 200, r.text);
    const m = rpcOf(r);
    assert.equal(m?.result?.isError, true, r.text);
    assert.match(textOf(m.result), /unknown session_id/, 'the call reached the tool, which did not know the session');
  });

  test('an unsupported protocol version is 400 with -32022', T, async () => {
    const msg = modernMsg('tools/list', {}, { 'io.modelcontextprotocol/protocolVersion': '2099-01-01' });
    const r = await modern(srv, msg, { token: alice });
    assert.equal(r.status, 400, r.text);
    assert.equal(r.json?.error?.code, -32022, r.text);
    assert.deepEqual(r.json.error.data?.supported, [V]);
  });

  test('an unknown method is 404 with -32601; an unknown path 404', T, async () => {
    let r = await modern(srv, modernMsg('foo/bar'), { token: alice });
    assert.equal(r.status, 404, r.text);
    assert.equal(r.json?.error?.code, -32601, r.text);
    r = await modern(srv, modernMsg('tools/list'), { token: alice, path: '/other' });
    assert.equal(r.status, 404, r.text);
    r = await modern(srv, modernMsg('tools/list'), { token: alice, path: '/mcp/x' });
    assert.equal(r.status, 404, r.text);
  });

  test('GET /mcp is 405; a body not application/json 415; an Accept without JSON 406', T, async () => {
    let r = await request(srv, { method: 'GET', headers: { Accept: 'text/event-stream', Authorization: `Bearer ${alice}` } });
    assert.equal(r.status, 405, r.text);
    const msg = modernMsg('tools/list');
    r = await modern(srv, msg, { token: alice, headers: { 'Content-Type': 'text/plain' } });
    assert.equal(r.status, 415, r.text);
    r = await modern(srv, msg, { token: alice, headers: { 'Content-Type': undefined } });
    assert.equal(r.status, 415, r.text);
    r = await modern(srv, msg, { token: alice, headers: { 'Content-Type': 'application/json; charset=utf-8' } });
    assert.equal(r.status, 200, `a charset parameter is still JSON: ${r.text}`);
    r = await modern(srv, msg, { token: alice, headers: { Accept: 'text/html' } });
    assert.equal(r.status, 406, r.text);
  });

  test('a body over IGN_MCP_MAX_MESSAGE is 413 (declared or chunked); the server serves on', T, async () => {
    const big = JSON.stringify(callMsg('run', { session_id: 'x', command: `echo ${'a'.repeat(140_000)}` }));
    const h = modernHeaders(JSON.parse(big), alice);
    let r = await request(srv, { headers: h, body: big });
    assert.equal(r.status, 413, r.text.slice(0, 300));
    r = await request(srv, { headers: { ...h, 'Transfer-Encoding': 'chunked' }, body: big });
    assert.equal(r.status, 413, r.text.slice(0, 300));
    // A Content-Length far over the cap is refused before any of it is sent.
    r = await new Promise((resolve, reject) => {
      const req = http.request({ host: '127.0.0.1', port: srv.port, method: 'POST', path: '/mcp', headers: { ...h, 'Content-Length': 1 << 30 }, agent: false }, (res) => {
        res.resume();
        res.on('end', () => {
          resolve({ status: res.statusCode });
          req.destroy();
        });
      });
      req.on('error', (e) => reject(new Error(`no 413 for a Content-Length of 1 GiB: ${e.message}`)));
      req.write('{');
    });
    assert.equal(r.status, 413);
    r = await modern(srv, modernMsg('tools/list'), { token: alice });
    assert.equal(r.status, 200, 'the server stopped serving after 413s');
    assert.equal(r.json.result.tools.length, TOOL_NAMES.length);
  });

  test('malformed bodies and oversized headers are refused with 4xx; the server serves on', T, async () => {
    const h = { 'Content-Type': 'application/json', Accept: 'application/json, text/event-stream', Authorization: `Bearer ${alice}`, 'MCP-Protocol-Version': V, 'Mcp-Method': 'tools/list' };
    for (const [what, body, code] of [
      ['not JSON', '{"jsonrpc":"2.0","id":1,', -32700],
      ['invalid UTF-8', Buffer.from([0x7b, 0x22, 0xff, 0xfe, 0x22, 0x7d]), -32700],
      ['a batch (an array)', JSON.stringify([modernMsg('tools/list'), modernMsg('tools/list')]), null],
      ['an empty body', '', null],
      ['not JSON-RPC', '{"hello":"world"}', null],
    ]) {
      const r = await request(srv, { headers: h, body });
      assert.ok(r.status >= 400 && r.status < 500, `${what}: HTTP ${r.status} ${r.text.slice(0, 300)}`);
      if (code !== null) assert.equal(r.json?.error?.code, code, `${what}: ${r.text.slice(0, 300)}`);
    }
    // A header of 200 kB: refused (or the connection closed), never served.
    const big = await modern(srv, modernMsg('tools/list'), { token: alice, headers: { 'X-Big': 'b'.repeat(200_000) } })
      .then((r) => r.status, (e) => `closed: ${e.code ?? e.message}`);
    assert.ok(typeof big === 'string' || (big >= 400 && big < 500), `a 200 kB header: ${big}`);
    const r = await modern(srv, modernMsg('tools/list'), { token: alice });
    assert.equal(r.status, 200, 'the server stopped serving');
  });

  test('401 without or with a wrong token, with WWW-Authenticate naming the RFC 9728 metadata', T, async () => {
    const msg = modernMsg('tools/list');
    for (const auth of [undefined, `Bearer ${newToken()}`, `Bearer ${alice}x`, `Bearer ${alice.slice(0, -1)}`, `Basic ${Buffer.from(`alice:${alice}`).toString('base64')}`, 'Bearer ']) {
      const r = await modern(srv, msg, { headers: { Authorization: auth } });
      assert.equal(r.status, 401, `${auth}: ${r.text}`);
      const wa = r.headers['www-authenticate'] ?? '';
      assert.match(wa, /^Bearer /, wa);
      const m = wa.match(/resource_metadata="([^"]+)"/);
      assert.ok(m, `no resource_metadata in ${wa}`);
      assert.equal(new URL(m[1]).pathname, '/.well-known/oauth-protected-resource/mcp');
    }
    // Every method, not only POST.
    for (const method of ['GET', 'DELETE']) {
      const r = await request(srv, { method, headers: { 'Mcp-Session-Id': 'x' } });
      assert.equal(r.status, 401, `${method}: ${r.text}`);
    }
    const md = await request(srv, { method: 'GET', path: '/.well-known/oauth-protected-resource/mcp' });
    assert.equal(md.status, 200, md.text);
    assert.match(md.headers['content-type'], /^application\/json/);
    assert.equal(md.json.resource, srv.url, 'the metadata names the endpoint as the resource');
    if (md.json.bearer_methods_supported) assert.ok(md.json.bearer_methods_supported.includes('header'));
  });

  test('403 for an Origin not local and not in IGN_MCP_HTTP_ORIGINS; local and listed ones pass', T, async () => {
    const msg = modernMsg('tools/list');
    for (const origin of ['http://evil.example', 'https://app.example.test.evil.example', 'null', `http://127.0.0.1.evil.example:${srv.port}`]) {
      const r = await modern(srv, msg, { token: alice, headers: { Origin: origin } });
      assert.equal(r.status, 403, `Origin ${origin}: ${r.text}`);
    }
    for (const origin of [`http://localhost:${srv.port}`, `http://127.0.0.1:${srv.port}`, `http://[::1]:${srv.port}`, ORIGIN_OK]) {
      const r = await modern(srv, msg, { token: alice, headers: { Origin: origin } });
      assert.equal(r.status, 200, `Origin ${origin}: ${r.text}`);
    }
  });

  test('403 for a Host not local (DNS rebinding) and not in IGN_MCP_HTTP_HOSTS; local and listed ones pass', T, async () => {
    const msg = modernMsg('tools/list');
    for (const host of [`evil.example:${srv.port}`, 'evil.example', `localhost.evil.example:${srv.port}`, `${HOST_OK}.evil.example`]) {
      const r = await modern(srv, msg, { token: alice, headers: { Host: host } });
      assert.equal(r.status, 403, `Host ${host}: ${r.text}`);
    }
    for (const host of [`localhost:${srv.port}`, `127.0.0.1:${srv.port}`, `[::1]:${srv.port}`, HOST_OK]) {
      const r = await modern(srv, msg, { token: alice, headers: { Host: host } });
      assert.equal(r.status, 200, `Host ${host}: ${r.text}`);
    }
  });

  test('400 for a request without Host (HTTP/1.0 may leave it out: a sandbox reaching loopback would); with Host it is served', T, async () => {
    const msg = modernMsg('tools/list');
    const body = JSON.stringify(msg);
    /* The bytes as given, over a connection of its own: the whole answer,
     * once the server closed it. */
    const raw = (version, host) => new Promise((resolve, reject) => {
      const h = { ...modernHeaders(msg, alice), 'Content-Length': Buffer.byteLength(body), ...(host ? { Host: host } : {}) };
      const head = `POST /mcp HTTP/${version}\r\n${Object.entries(h).map(([k, v]) => `${k}: ${v}\r\n`).join('')}\r\n`;
      const sock = net.connect(srv.port, '127.0.0.1');
      let got = '';
      const timer = setTimeout(() => sock.destroy(new Error(`no whole answer in 30 s: ${got}`)), 30_000);
      sock.on('data', (d) => (got += d.toString('utf8')));
      sock.on('error', (e) => (clearTimeout(timer), reject(e)));
      sock.on('close', () => (clearTimeout(timer), resolve(got)));
      sock.on('connect', () => sock.write(head + body)); // no half-close: that cancels
    });
    const status = (t) => Number(t.match(/^HTTP\/1\.[01] (\d{3})/)?.[1]);
    const none10 = await raw('1.0', null);
    assert.equal(status(none10), 400, `HTTP/1.0 without Host: ${none10}`);
    assert.match(none10, /no Host header/, 'the 400 does not say what was wrong');
    assert.doesNotMatch(none10, /"tools"/, 'the request without Host was served');
    const none11 = await raw('1.1', null);
    assert.equal(status(none11), 400, `HTTP/1.1 without Host: ${none11}`);
    assert.doesNotMatch(none11, /"tools"/);
    for (const host of [`127.0.0.1:${srv.port}`, `localhost:${srv.port}`, HOST_OK]) {
      const ok = await raw('1.0', host);
      assert.equal(status(ok), 200, `HTTP/1.0 with Host ${host}: ${ok}`);
      assert.match(ok, /"tools"/);
    }
    assert.equal((await raw('1.0', `evil.example:${srv.port}`)).match(/^HTTP\/1\.[01] (\d{3})/)?.[1], '403');
    assert.match(srv.stderrText(), /refused an HTTP request: it has no Host header/);
  });

  test('legacy: initialize mints an id; without it 400, unknown 404, DELETE 204 then 404', T, async () => {
    const sid = await legacyInit(srv, alice);
    const list = () => ({ jsonrpc: '2.0', id: nextId++, method: 'tools/list', params: {} });
    let r = await legacy(srv, sid, list(), { token: alice });
    assert.equal(r.status, 200, r.text);
    assert.equal(rpcOf(r).result.tools.length, TOOL_NAMES.length);
    r = await legacy(srv, undefined, list(), { token: alice });
    assert.equal(r.status, 400, `no Mcp-Session-Id: ${r.text}`);
    r = await legacy(srv, `${sid}0`, list(), { token: alice });
    assert.equal(r.status, 404, `unknown Mcp-Session-Id: ${r.text}`);
    r = await request(srv, { method: 'DELETE', headers: { 'Mcp-Session-Id': sid, Authorization: `Bearer ${alice}` } });
    assert.equal(r.status, 204, r.text);
    r = await legacy(srv, sid, list(), { token: alice });
    assert.equal(r.status, 404, `a deleted Mcp-Session-Id: ${r.text}`);
  });

  test('a progressToken with Accept text/event-stream is answered by SSE: progress, then the response; JSON without it', T, async () => {
    const msg = callMsg('sandbox_run', { command: 'for i in 1 2 3; do echo p$i; sleep 1; done' }, { progressToken: 'tok-sse' });
    const r = await modern(srv, msg, { token: alice });
    assert.equal(r.status, 200, r.text);
    assert.match(r.headers['content-type'], /^text\/event-stream/);
    const ev = r.events;
    const last = ev[ev.length - 1];
    assert.equal(last.id, msg.id, `the last event is not the response: ${r.text.slice(0, 1000)}`);
    assert.equal(last.result.structuredContent.stdout, 'p1\np2\np3\n');
    const prog = ev.slice(0, -1);
    assert.ok(prog.length >= 2, `only ${prog.length} progress events: ${r.text.slice(0, 1000)}`);
    for (const p of prog) {
      assert.equal(p.method, 'notifications/progress', JSON.stringify(p));
      assert.equal(p.params.progressToken, 'tok-sse');
    }
    for (let i = 1; i < prog.length; i++) assert.ok(prog[i].params.progress > prog[i - 1].params.progress);
    // The same call asking only for JSON: one JSON response.
    const j = callMsg('sandbox_run', { command: 'sleep 1; echo j' }, { progressToken: 'tok-json' });
    const rj = await modern(srv, j, { token: alice, headers: { Accept: 'application/json' } });
    assert.equal(rj.status, 200, rj.text);
    assert.match(rj.headers['content-type'], /^application\/json/);
    assert.equal(rj.json.id, j.id);
    assert.equal(rj.json.result.structuredContent.stdout, 'j\n');
  });

  // --- sessions belong to the token that opened them
  let aliceSid;
  test("a second token cannot see or use the first token's sessions and stages", T, async () => {
    aliceSid = (await rawTool(srv, alice, 'open_session')).session_id;
    await rawTool(srv, alice, 'write_file', { session_id: aliceSid, path: '/root/secret', content_base64: Buffer.from('alice only').toString('base64') });
    const stage = `alice-${process.pid}`;
    await rawTool(srv, alice, 'commit', { session_id: aliceSid, name: stage });

    assert.deepEqual((await rawTool(srv, bob, 'list_sessions')).sessions, [], 'bob sees alice\'s session');
    for (const [name, args] of [
      ['run', { session_id: aliceSid, command: 'cat /root/secret' }],
      ['read_file', { session_id: aliceSid, path: '/root/secret' }],
      ['write_file', { session_id: aliceSid, path: '/root/x', content_base64: 'eA==' }],
      ['reset', { session_id: aliceSid }],
      ['fork', { session_id: aliceSid, count: 1 }],
      ['commit', { session_id: aliceSid, name: `bob-${process.pid}` }],
      ['close', { session_id: aliceSid }],
    ]) {
      const e = await rawToolErr(srv, bob, name, args);
      assert.match(e, /unknown session_id/, `${name}: ${e}`);
      assert.doesNotMatch(e, /alice only/);
    }
    assert.ok(!(await rawTool(srv, bob, 'stage_list')).stages.some((x) => x.name === stage), 'bob sees alice\'s stage');
    assert.match(await rawToolErr(srv, bob, 'stage_info', { name: stage }), /no stage named/);
    assert.match(await rawToolErr(srv, bob, 'stage_rm', { name: stage }), /no stage named/);
    assert.match(await rawToolErr(srv, bob, 'open_session', { stage }), /no stage named/);
    // Alice's session and stage are untouched.
    const l = await rawTool(srv, alice, 'list_sessions');
    assert.deepEqual(l.sessions.map((x) => x.session_id), [aliceSid]);
    assert.equal((await rawTool(srv, alice, 'run', { session_id: aliceSid, command: 'cat /root/secret' })).stdout, 'alice only');
    assert.equal((await rawTool(srv, alice, 'stage_info', { name: stage })).name, stage);
    await rawTool(srv, alice, 'stage_rm', { name: stage });
  });

  test("a session lost with its killed server is lost to its token only: to another, on the next server, its id is unknown", T, async (t) => {
    const first = await startHttp({ tokens: { alice, bob }, env: NO_POOL });
    const sid = (await rawTool(first, alice, 'open_session')).session_id;
    hardKill(first.pid);
    await waitUntil(() => first.exited(), { timeoutMs: 10000 });
    const next = await startHttp({ tokens: { alice, bob }, env: NO_POOL });
    t.after(() => next.close());
    const ours = await rawToolErr(next, alice, 'run', { session_id: sid, command: 'true' });
    assert.match(ours, new RegExp(`session '${sid}' was lost: its server \\(pid ${first.pid}\\)`), ours);
    const theirs = await rawToolErr(next, bob, 'run', { session_id: sid, command: 'true' });
    const nobody = await rawToolErr(next, bob, 'run', { session_id: 's4000000000-0000', command: 'true' });
    assert.equal(theirs.replaceAll(sid, 'ID'), nobody.replaceAll('s4000000000-0000', 'ID'), 'bob learns that alice had a session');
  });

  test("a session hibernated on the store is its token's only: to another, on the next server, it is not listed, its id is unknown and cannot be closed", T, async (t) => {
    const first = await startHttp({ tokens: { alice, bob }, env: { ...NO_POOL, IGN_MCP_SHUTDOWN_ACTION: 'hibernate' } });
    const sid = (await rawTool(first, alice, 'open_session')).session_id;
    await rawTool(first, alice, 'run', { session_id: sid, command: 'echo alice > /root/mark' });
    await rawTool(first, alice, 'hibernate', { session_id: sid });
    hardKill(first.pid);
    await waitUntil(() => first.exited(), { timeoutMs: 10000 });
    const next = await startHttp({ tokens: { alice, bob }, env: NO_POOL });
    t.after(() => next.close());
    assert.deepEqual((await rawTool(next, bob, 'list_sessions')).sessions, []);
    const nobody = await rawToolErr(next, bob, 'run', { session_id: 's4000000000-0000', command: 'true' });
    const like = (txt, id) => txt.replaceAll(id, 'ID');
    for (const tool of ['run', 'close', 'hibernate']) {
      const args = tool === 'run' ? { session_id: sid, command: 'true' } : { session_id: sid };
      let theirs;
      // The killed server's lock goes with its last thread.
      await waitUntil(async () => !/held by another/.test(theirs = await rawToolErr(next, bob, tool, args)), { timeoutMs: 10000, intervalMs: 200 });
      const none = tool === 'run' ? nobody : await rawToolErr(next, bob, tool, { session_id: 's4000000000-0000' });
      assert.equal(like(theirs, sid), like(none, 's4000000000-0000'), `${tool}: bob learns of alice's hibernated session`);
    }
    const l = await rawTool(next, alice, 'list_sessions');
    assert.deepEqual(l.sessions.map((x) => [x.session_id, x.state]), [[sid, 'hibernated']]);
    assert.equal((await rawTool(next, alice, 'run', { session_id: sid, command: 'cat /root/mark' })).stdout, 'alice\n');
  });

  test("a legacy Mcp-Session-Id of one token is unknown (404) to another", T, async () => {
    const sid = await legacyInit(srv, alice);
    const r = await legacy(srv, sid, { jsonrpc: '2.0', id: nextId++, method: 'tools/list', params: {} }, { token: bob });
    assert.equal(r.status, 404, r.text);
    const d = await request(srv, { method: 'DELETE', headers: { 'Mcp-Session-Id': sid, Authorization: `Bearer ${bob}` } });
    assert.equal(d.status, 404, d.text);
    const a = await legacy(srv, sid, { jsonrpc: '2.0', id: nextId++, method: 'tools/list', params: {} }, { token: alice });
    assert.equal(a.status, 200, `bob's DELETE ended alice's session: ${a.text}`);
  });

  for (const [how, accept] of [['an SSE response (progressToken)', 'application/json, text/event-stream'], ['a JSON response', 'application/json']]) {
    test(`closing the connection cancels the call (${how}): the command is killed, the session serves on`, T, async () => {
      assert.ok(aliceSid, 'needs the session of the test before');
      const n = uniqueSleepSecs();
      const msg = callMsg('run', { session_id: aliceSid, command: `sleep ${n}; echo not-killed > /root/cancel.out` }, { progressToken: `c-${n}` });
      const h = { ...modernHeaders(msg, alice), Accept: accept };
      const body = Buffer.from(JSON.stringify(msg));
      let req;
      let answered = null;
      const gone = new Promise((resolve) => {
        req = http.request({ host: '127.0.0.1', port: srv.port, method: 'POST', path: '/mcp', headers: { ...h, 'Content-Length': body.length }, agent: false }, (res) => {
          res.on('data', () => {});
          res.on('end', () => (answered = res.statusCode));
          res.on('error', () => {});
        });
        req.on('error', () => {});
        req.on('close', () => resolve());
        req.end(body);
      });
      try {
        const started = await waitUntil(() => sleepRuns(srv, alice, aliceSid, n), { timeoutMs: 30_000, intervalMs: 300 });
        assert.ok(started, `sleep ${n} never started`);
        assert.equal(answered, null, `the call was answered (HTTP ${answered}) while its command runs`);
      } finally {
        req.destroy();
      }
      await gone;
      const killed = await waitUntil(async () => !(await sleepRuns(srv, alice, aliceSid, n)), { timeoutMs: 15_000, intervalMs: 300 });
      assert.ok(killed, `sleep ${n} still runs after its connection closed`);
      const out = await rawTool(srv, alice, 'run', { session_id: aliceSid, command: 'cat /root/cancel.out 2>/dev/null; echo serving' });
      assert.equal(out.stdout, 'serving\n');
    });
  }

  test('notifications/cancelled reaches only the calls of its own legacy Mcp-Session-Id', T, async () => {
    assert.ok(aliceSid, 'needs the session of the tests before');
    const mine = await legacyInit(srv, alice);
    const other = await legacyInit(srv, alice);
    const n = uniqueSleepSecs();
    const rid = 900000 + n;
    const call = legacy(srv, mine, { jsonrpc: '2.0', id: rid, method: 'tools/call', params: { name: 'run', arguments: { session_id: aliceSid, command: `sleep ${n}` } } }, { token: alice, headers: { Accept: 'application/json' } });
    let settled = null;
    call.then((r) => (settled = r.status), () => (settled = 'error'));
    const started = await waitUntil(() => sleepRuns(srv, alice, aliceSid, n), { timeoutMs: 30_000, intervalMs: 300 });
    assert.ok(started, `sleep ${n} never started`);
    const cancel = { jsonrpc: '2.0', method: 'notifications/cancelled', params: { requestId: rid, reason: 'test' } };
    // The same token and request id from another legacy session, and as a
    // 2026-07-28 notification: taken (202), and the call runs on.
    let r = await legacy(srv, other, cancel, { token: alice });
    assert.equal(r.status, 202, r.text);
    const m = { ...cancel, params: { ...cancel.params, ...meta() } };
    r = await request(srv, { headers: { 'Content-Type': 'application/json', Accept: 'application/json, text/event-stream', Authorization: `Bearer ${alice}`, 'MCP-Protocol-Version': V, 'Mcp-Method': m.method }, body: m });
    assert.equal(r.status, 202, r.text);
    await sleep(1500);
    assert.equal(settled, null, `the call ended (${settled}) on a cancel from another session`);
    assert.ok(await sleepRuns(srv, alice, aliceSid, n), `sleep ${n} was killed by a cancel from another session`);
    // From its own session: cancelled, no answer, the command killed.
    r = await legacy(srv, mine, cancel, { token: alice });
    assert.equal(r.status, 202, r.text);
    const ended = await waitUntil(() => settled !== null, { timeoutMs: 15_000, intervalMs: 100 });
    assert.ok(ended, 'the cancelled call never ended');
    assert.notEqual(settled, 200, 'a cancelled call was answered');
    const killed = await waitUntil(async () => !(await sleepRuns(srv, alice, aliceSid, n)), { timeoutMs: 15_000, intervalMs: 300 });
    assert.ok(killed, `sleep ${n} still runs after its cancellation`);
  });

  test('the session of a token is ended only by that token', T, async () => {
    assert.equal((await rawTool(srv, alice, 'close', { session_id: aliceSid })).ok, true);
    assert.deepEqual((await rawTool(srv, alice, 'list_sessions')).sessions, []);
  });

  test('neither token, nor a refused token, nor an Mcp-Session-Id is ever in the log', T, async () => {
    const wrong = newToken();
    const r = await modern(srv, modernMsg('tools/list'), { token: wrong });
    assert.equal(r.status, 401);
    const sid = await legacyInit(srv, bob);
    await legacy(srv, sid, { jsonrpc: '2.0', id: nextId++, method: 'tools/list', params: {} }, { token: bob });
    await request(srv, { method: 'DELETE', headers: { 'Mcp-Session-Id': sid, Authorization: `Bearer ${bob}` } });
    await sleep(300);
    const log = srv.stderrText();
    assert.ok(log.length > 0, 'the server logged nothing at all');
    for (const [what, secret] of [['alice', alice], ['bob', bob], ['the refused token', wrong], ['the Mcp-Session-Id', sid]]) {
      assert.ok(!log.includes(secret), `${what}'s secret is in the log`);
      assert.ok(!log.includes(secret.slice(0, 12)), `a prefix of ${what}'s secret is in the log`);
    }
    assert.equal(srv.stdoutText(), '', 'an HTTP server wrote to stdout');
  });
});

describe('raw HTTP: the caps', () => {
  let srv;
  const tok = newToken();
  const MAXC = 6;
  const TIMEOUT = 3;
  before(async () => {
    srv = await startHttp({
      tokens: { capper: tok },
      env: { IGN_MCP_HTTP_MAX_CONNECTIONS: MAXC, IGN_MCP_HTTP_TIMEOUT_SECS: TIMEOUT, IGN_MCP_MAX_CALLS: 2, ...NO_POOL },
    });
  });
  after(() => srv?.close());

  const list = () => modern(srv, modernMsg('tools/list'), { token: tok });

  test(`a slowloris connection (a header byte a second) is closed within IGN_MCP_HTTP_TIMEOUT_SECS=${TIMEOUT}`, T, async () => {
    const head = Buffer.from(`POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:${srv.port}\r\nAuthorization: Bearer ${tok}\r\nX-Slow: ${'a'.repeat(200)}\r\n`);
    const sock = net.connect(srv.port, '127.0.0.1');
    await new Promise((r, j) => sock.once('connect', r).once('error', j));
    const t0 = Date.now();
    let sent = 0;
    let got = '';
    sock.on('data', (d) => (got += d.toString('latin1')));
    sock.on('error', () => {});
    const closed = new Promise((r) => sock.once('close', () => r(Date.now() - t0)));
    const timer = setInterval(() => {
      if (sent < head.length && !sock.destroyed) sock.write(head.subarray(sent, ++sent));
    }, 1000);
    // Others are served meanwhile.
    await sleep(1500);
    assert.equal((await list()).status, 200, 'the server stopped serving during a slowloris');
    const ms = await Promise.race([closed, sleep((TIMEOUT + 10) * 1000).then(() => null)]);
    clearInterval(timer);
    sock.destroy();
    assert.ok(ms !== null, `the slowloris connection was still open after ${TIMEOUT + 10} s (${sent} bytes sent)`);
    assert.ok(ms <= (TIMEOUT + 2) * 1000, `closed after ${ms} ms, over ${TIMEOUT} s + 2 s`);
    assert.ok(ms >= (TIMEOUT - 1) * 1000, `closed after ${ms} ms, before the ${TIMEOUT} s timeout`);
    assert.doesNotMatch(got, /^HTTP\/1\.1 200/, 'the partial request was served');
  });

  test(`a body trickled a byte a second is cut at IGN_MCP_HTTP_TIMEOUT_SECS=${TIMEOUT} too`, T, async () => {
    const body = Buffer.from(JSON.stringify(modernMsg('tools/list')));
    const head = `POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:${srv.port}\r\nAuthorization: Bearer ${tok}\r\nContent-Type: application/json\r\n` +
      `Accept: application/json, text/event-stream\r\nMCP-Protocol-Version: ${V}\r\nMcp-Method: tools/list\r\nContent-Length: ${body.length}\r\n\r\n`;
    const sock = net.connect(srv.port, '127.0.0.1');
    sock.on('error', () => {});
    await new Promise((r, j) => sock.once('connect', r).once('error', j));
    const t0 = Date.now();
    let got = '';
    sock.on('data', (d) => (got += d.toString('latin1')));
    const closed = new Promise((r) => sock.once('close', () => r(Date.now() - t0)));
    sock.write(head);
    let sent = 0;
    const timer = setInterval(() => {
      if (sent < body.length && !sock.destroyed) sock.write(body.subarray(sent, ++sent));
    }, 1000);
    const ms = await Promise.race([closed, sleep((TIMEOUT + 10) * 1000).then(() => null)]);
    clearInterval(timer);
    sock.destroy();
    assert.ok(ms !== null, `still open after ${TIMEOUT + 10} s (${sent} of ${body.length} body bytes sent)`);
    assert.ok(ms <= (TIMEOUT + 2) * 1000, `closed after ${ms} ms, over ${TIMEOUT} s + 2 s`);
    assert.doesNotMatch(got, /^HTTP\/1\.1 200/, 'the partial request was served');
  });

  test(`an idle keep-alive connection is closed after IGN_MCP_HTTP_TIMEOUT_SECS=${TIMEOUT}; one in use is not`, T, async () => {
    const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
    try {
      let sockets = new Set();
      for (let i = 0; i < 3; i++) {
        const r = await modern(srv, modernMsg('tools/list'), { token: tok, agent, onResponse: (res, req) => sockets.add(req.socket) });
        assert.equal(r.status, 200);
        await sleep(1000); // under the timeout between requests: the same connection
      }
      assert.equal(sockets.size, 1, 'keep-alive requests under the timeout apart did not share one connection');
      const [sock] = sockets;
      const t0 = Date.now();
      const ms = await Promise.race([new Promise((r) => (sock.destroyed ? r(0) : sock.once('close', () => r(Date.now() - t0)))), sleep((TIMEOUT + 10) * 1000).then(() => null)]);
      assert.ok(ms !== null, `an idle keep-alive connection was still open after ${TIMEOUT + 10} s`);
      assert.ok(ms <= (TIMEOUT + 2) * 1000, `closed after ${ms} ms idle`);
      assert.ok(ms >= (TIMEOUT - 1.5) * 1000, `closed after ${ms} ms idle, before the timeout`);
    } finally {
      agent.destroy();
    }
  });

  test(`a call whose request is complete is not cut by the timeout: a run of ${TIMEOUT + 3} s returns`, T, async () => {
    const r = await rawTool(srv, tok, 'sandbox_run', { command: `sleep ${TIMEOUT + 3}; echo slept` });
    assert.equal(r.stdout, 'slept\n');
  });

  test(`IGN_MCP_HTTP_MAX_CONNECTIONS=${MAXC}: one more is refused; once they close, the server serves again`, T, async () => {
    const socks = [];
    for (let i = 0; i < MAXC; i++) {
      const s = net.connect(srv.port, '127.0.0.1');
      s.on('error', () => {});
      await new Promise((r, j) => s.once('connect', r).once('error', j));
      socks.push(s);
    }
    await sleep(200);
    // The one over the cap: refused at once (closed without an answer, or
    // 503), not held until a slot frees.
    const t0 = Date.now();
    const over = await list().then((r) => r.status, (e) => `refused: ${e.code ?? e.message}`);
    const ms = Date.now() - t0;
    assert.notEqual(over, 200, `connection ${MAXC + 1} was served after ${ms} ms (IGN_MCP_HTTP_TIMEOUT_SECS=${TIMEOUT}): held, not refused`);
    assert.ok(over === 503 || typeof over === 'string', `connection ${MAXC + 1}: ${over}`);
    assert.ok(ms < 1000, `connection ${MAXC + 1} was refused only after ${ms} ms`);
    for (const s of socks) s.destroy();
    const back = await waitUntil(async () => (await list().catch(() => ({ status: 0 }))).status === 200, { timeoutMs: 5000, intervalMs: 100 });
    assert.ok(back, 'the server did not serve again after the connections closed');
    // Over and over: no connection slot is lost.
    for (let i = 0; i < 3 * MAXC; i++) assert.equal((await list()).status, 200, `request ${i}`);
  });

  test('IGN_MCP_MAX_CALLS=2: a third call at once is refused as busy; the two finish', T, async () => {
    const held = [1, 2].map((i) => rawTool(srv, tok, 'sandbox_run', { command: `sleep 3; echo ${i}` }));
    await sleep(1000);
    const e = await rawToolErr(srv, tok, 'sandbox_run', { command: 'echo no' });
    assert.match(e, /^server busy: 2 calls in progress/, e);
    assert.deepEqual((await Promise.all(held)).map((r) => r.stdout), ['1\n', '2\n']);
  });
});

describe('startup refusals', () => {
  test('a malformed tokens file: exit 2, naming the file, the line and the reason', T, async () => {
    const good = newToken();
    const cases = [
      ['a short token', `ok:${good}\nshort:abc123\n`, /line 2/, /16/],
      ['no colon', `ok:${good}\n${good}\n`, /line 2/, /./],
      ['a name twice', `ok:${good}\nok:${newToken()}\n`, /line 2/, /ok|twice|duplicate/i],
      ['no entry', '# nothing\n\n', /./, /no (entry|token|name:token)|empty/i],
    ];
    for (const [what, text, where, why] of cases) {
      const f = tokensFile(text);
      const r = await startRefused(['--http', '127.0.0.1:0'], { IGN_MCP_HTTP_TOKENS: f });
      assert.equal(r.code, 2, `${what}: exit ${r.code} ${r.signal ?? ''}\n${r.stderr}`);
      assert.ok(r.stderr.includes(f) || /IGN_MCP_HTTP_TOKENS/.test(r.stderr), `${what}: the message names neither the file nor the variable:\n${r.stderr}`);
      assert.match(r.stderr, where, `${what}:\n${r.stderr}`);
      assert.match(r.stderr, why, `${what}:\n${r.stderr}`);
      assert.doesNotMatch(r.stderr, /listening on/);
      for (const tk of text.split('\n').map((l) => l.split(':')[1]).filter((x) => x && x.length >= 16)) {
        assert.ok(!r.stderr.includes(tk), `${what}: a token is in the message`);
      }
    }
    // Writable by others: refused too; a file that does not exist as well.
    let r = await startRefused(['--http', '127.0.0.1:0'], { IGN_MCP_HTTP_TOKENS: tokensFile(`ok:${good}\n`, 0o666) });
    assert.equal(r.code, 2, `a world-writable tokens file: exit ${r.code}\n${r.stderr}`);
    r = await startRefused(['--http', '127.0.0.1:0'], { IGN_MCP_HTTP_TOKENS: '/nonexistent/tokens' });
    assert.equal(r.code, 2, `a missing tokens file: exit ${r.code}\n${r.stderr}`);
  });

  test('binding a non-loopback address without tokens is refused; with tokens it starts', T, async () => {
    const r = await startRefused(['--http', '0.0.0.0:0'], {});
    assert.notEqual(r.code, 0, r.stderr);
    assert.equal(r.signal, null, r.stderr);
    assert.match(r.stderr, /IGN_MCP_HTTP_TOKENS/, r.stderr);
    assert.doesNotMatch(r.stderr, /listening on/);
    const tok = newToken();
    const srv = await startHttp({ listen: '0.0.0.0:0', tokens: { remote: tok }, env: NO_POOL });
    try {
      assert.equal(srv.host, '0.0.0.0');
      const x = await modern(srv, modernMsg('tools/list'), { token: tok });
      assert.equal(x.status, 200, x.text);
      assert.equal((await modern(srv, modernMsg('tools/list'))).status, 401);
      // Not on loopback: the Host is whatever name the server is reached by.
      const h = await modern(srv, modernMsg('tools/list'), { token: tok, headers: { Host: `mcp.example.test:${srv.port}` } });
      assert.equal(h.status, 200, `a server bound to 0.0.0.0 refused a Host: ${h.text}`);
    } finally {
      await srv.close();
    }
  });

  test('bad --http arguments are refused (exit 2)', T, async () => {
    for (const a of ['127.0.0.1:99999', 'notanaddress:80', '127.0.0.1:-1', '']) {
      const r = await startRefused(['--http', a], {});
      assert.equal(r.code, 2, `--http '${a}': exit ${r.code}\n${r.stderr}`);
      assert.doesNotMatch(r.stderr, /unknown argument/, 'the server does not know --http');
      assert.doesNotMatch(r.stderr, /listening on/);
    }
  });

  test('the default address is 127.0.0.1 and port 0 picks one', T, async () => {
    const srv = await startHttp({ listen: '0', env: NO_POOL });
    try {
      assert.equal(srv.host, '127.0.0.1');
      assert.ok(srv.port > 0 && srv.port < 65536);
      const r = await modern(srv, modernMsg('tools/list'));
      assert.equal(r.status, 200, `no tokens on loopback: no Authorization needed: ${r.text}`);
    } finally {
      await srv.close();
    }
  });
});
