#!/usr/bin/env node
// stdio <-> Streamable HTTP bridge, for testing a stdio-only MCP server with
// tools that speak only Streamable HTTP (the official conformance suite).
//
//   node tests/bridge/stdio-http-bridge.mjs [options] -- COMMAND [ARGS...]
//
// Each HTTP session (created by an `initialize` POST without an
// Mcp-Session-Id header) gets its own child process running COMMAND; messages
// are forwarded both ways unchanged. DELETE ends the session and the child;
// the child exiting ends the session. The HTTP side is the SDK's own
// StreamableHTTPServerTransport (session ids, Accept and protocol-version
// checks, SSE framing, GET streams) and the child side is the SDK's
// StdioClientTransport, so the bridge itself only routes messages.
//
// The one thing a byte-for-byte bridge cannot know is which HTTP stream a
// server-initiated message belongs to (stdio has a single stream). Progress
// notifications go to the request that carried their progressToken,
// notifications/cancelled to the request it names, and other notifications and
// server->client requests to the newest request still in flight (or to the
// standalone GET stream when nothing is in flight).
//
// Listens on 127.0.0.1 only, and rejects requests whose Host or Origin is not
// a loopback name (DNS rebinding protection, as the spec requires of local
// servers). Prints one line "listening URL" on stdout when ready.

import http from 'node:http';
import { randomUUID } from 'node:crypto';
import { writeFileSync } from 'node:fs';
import process from 'node:process';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';

const USAGE = `usage: stdio-http-bridge.mjs [options] -- COMMAND [ARGS...]
  --host ADDR        address to listen on (default 127.0.0.1; loopback only)
  --port N           port (default 0: pick a free one)
  --path P           endpoint path (default /mcp)
  --url-file F       write the endpoint URL to F once listening
  --json             answer POSTs with plain JSON instead of SSE streams
  --idle-secs N      end sessions idle for N seconds (default 300; 0 = never)
  --max-sessions N   refuse new sessions past N live ones (default 64)
  --quiet            log only errors
Each HTTP session spawns COMMAND once; the child inherits the environment,
cwd and stderr of the bridge.`;

const MAX_BODY = 4 * 1024 * 1024;
const LOOPBACK = new Set(['localhost', '127.0.0.1', '[::1]', '::1']);

function parseArgs(argv) {
  const o = { host: '127.0.0.1', port: 0, path: '/mcp', urlFile: null, json: false,
              idleSecs: 300, maxSessions: 64, quiet: false, command: null, args: [] };
  let i = 0;
  const need = (name) => {
    if (i + 1 >= argv.length) die(`${name} needs a value\n${USAGE}`);
    return argv[++i];
  };
  const num = (name, v) => {
    const n = Number(v);
    if (!Number.isInteger(n) || n < 0) die(`${name}: not a non-negative integer: ${v}`);
    return n;
  };
  args: for (; i < argv.length; i++) {
    const a = argv[i];
    if (a === '--') { i++; break; }
    switch (a) {
      case '--host': o.host = need(a); break;
      case '--port': o.port = num(a, need(a)); break;
      case '--path': o.path = need(a); break;
      case '--url-file': o.urlFile = need(a); break;
      case '--json': o.json = true; break;
      case '--idle-secs': o.idleSecs = num(a, need(a)); break;
      case '--max-sessions': o.maxSessions = num(a, need(a)); break;
      case '--quiet': o.quiet = true; break;
      case '-h': case '--help': process.stdout.write(USAGE + '\n'); process.exit(0); break;
      default:
        if (a.startsWith('-')) die(`unknown option ${a}\n${USAGE}`);
        break args; // the first word that is not an option starts the command
    }
  }
  if (i >= argv.length) die(`no server command given\n${USAGE}`);
  o.command = argv[i];
  o.args = argv.slice(i + 1);
  if (!['127.0.0.1', 'localhost', '::1'].includes(o.host)) die(`--host must be a loopback address, got ${o.host}`);
  if (!o.path.startsWith('/')) die(`--path must start with /, got ${o.path}`);
  return o;
}

function die(msg) {
  process.stderr.write(`stdio-http-bridge: ${msg}\n`);
  process.exit(2);
}

const opt = parseArgs(process.argv.slice(2));
const log = (...a) => { if (!opt.quiet) process.stderr.write(`[bridge] ${a.join(' ')}\n`); };
const logErr = (...a) => process.stderr.write(`[bridge] ${a.join(' ')}\n`);

/** @type {Map<string, Session>} */
const sessions = new Map();
let pendingSessions = 0;

function jsonError(res, status, code, message, headers = {}) {
  if (res.headersSent) { res.end(); return; }
  res.writeHead(status, { 'Content-Type': 'application/json', ...headers });
  res.end(JSON.stringify({ jsonrpc: '2.0', error: { code, message }, id: null }));
}

// DNS rebinding protection: Host (and Origin, when sent) must name loopback.
function hostAllowed(req) {
  const host = req.headers.host;
  if (!host) return false;
  let name;
  try { name = new URL(`http://${host}`).hostname; } catch { return false; }
  if (!LOOPBACK.has(name)) return false;
  const origin = req.headers.origin;
  if (origin !== undefined && origin !== 'null') {
    try { if (!LOOPBACK.has(new URL(origin).hostname)) return false; } catch { return false; }
  }
  return true;
}

function readBody(req) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    let size = 0;
    req.on('data', (c) => {
      size += c.length;
      if (size > MAX_BODY) { reject(Object.assign(new Error('too large'), { status: 413 })); req.destroy(); return; }
      chunks.push(c);
    });
    req.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')));
    req.on('error', reject);
  });
}

const isRequest = (m) => m && typeof m === 'object' && 'method' in m && 'id' in m;
const isResponse = (m) => m && typeof m === 'object' && !('method' in m) && 'id' in m;
const isInitialize = (m) => isRequest(m) && m.method === 'initialize';

class Session {
  constructor() {
    this.id = undefined;
    this.closed = false;
    this.lastActive = Date.now();
    this.seq = 0;
    /** client request id -> order it arrived in (requests still awaiting a response) */
    this.inflight = new Map();
    /** progressToken -> client request id */
    this.progress = new Map();
    this.stdio = new StdioClientTransport({
      command: opt.command, args: opt.args, env: process.env, stderr: 'inherit',
    });
    this.http = new StreamableHTTPServerTransport({
      sessionIdGenerator: () => randomUUID(),
      enableJsonResponse: opt.json,
      onsessioninitialized: (id) => { this.id = id; sessions.set(id, this); log(`session ${id}: child pid ${this.stdio.pid}`); },
    });
    this.http.onmessage = (msg) => this.fromClient(msg);
    this.http.onerror = (err) => log(`session ${this.id ?? '(new)'}: http: ${err.message}`);
    this.http.onclose = () => { this.close('closed by client'); };
    this.stdio.onmessage = (msg) => this.fromServer(msg);
    this.stdio.onerror = (err) => logErr(`session ${this.id ?? '(new)'}: child: ${err.message}`);
    this.stdio.onclose = () => { this.close('server process exited'); };
  }

  async start() { await this.stdio.start(); }

  fromClient(msg) {
    this.lastActive = Date.now();
    if (isRequest(msg)) {
      this.inflight.set(msg.id, ++this.seq);
      const tok = msg.params?._meta?.progressToken;
      if (tok !== undefined) this.progress.set(tok, msg.id);
    }
    this.stdio.send(msg).catch((err) => logErr(`session ${this.id}: cannot write to child: ${err.message}`));
  }

  relatedRequest(msg) {
    if (msg.method === 'notifications/progress') {
      const id = this.progress.get(msg.params?.progressToken);
      if (id !== undefined && this.inflight.has(id)) return id;
    }
    if (msg.method === 'notifications/cancelled' && this.inflight.has(msg.params?.requestId)) {
      return msg.params.requestId;
    }
    let newest, best = -1;
    for (const [id, seq] of this.inflight) if (seq > best) { best = seq; newest = id; }
    return newest;
  }

  fromServer(msg) {
    this.lastActive = Date.now();
    let options;
    if (isResponse(msg)) {
      this.inflight.delete(msg.id);
      for (const [tok, id] of this.progress) if (id === msg.id) this.progress.delete(tok);
    } else {
      const related = this.relatedRequest(msg);
      if (related !== undefined) options = { relatedRequestId: related };
    }
    this.http.send(msg, options).catch((err) => log(`session ${this.id}: dropped a message: ${err.message}`));
  }

  close(why) {
    if (this.closed) return Promise.resolve();
    this.closed = true;
    if (this.id) sessions.delete(this.id);
    log(`session ${this.id ?? '(new)'}: ending (${why})`);
    return Promise.allSettled([this.http.close(), this.stdio.close()]);
  }
}

async function handle(req, res) {
  if (!hostAllowed(req)) {
    jsonError(res, 403, -32000, 'Forbidden: Host/Origin is not a loopback name');
    return;
  }
  const url = new URL(req.url ?? '/', 'http://localhost');
  if (url.pathname !== opt.path) { jsonError(res, 404, -32000, `Not found: the endpoint is ${opt.path}`); return; }
  if (!['POST', 'GET', 'DELETE'].includes(req.method)) {
    jsonError(res, 405, -32000, 'Method not allowed', { Allow: 'GET, POST, DELETE' });
    return;
  }
  const sid = req.headers['mcp-session-id'];
  if (sid !== undefined) {
    const s = sessions.get(String(sid));
    if (!s) { jsonError(res, 404, -32001, 'Session not found'); return; }
    s.lastActive = Date.now();
    await s.http.handleRequest(req, res);
    return;
  }
  if (req.method !== 'POST') { jsonError(res, 400, -32000, 'Bad Request: Mcp-Session-Id header is required'); return; }

  // No session yet: only an initialize request may start one.
  let body;
  try {
    body = JSON.parse(await readBody(req));
  } catch (err) {
    if (err.status === 413) jsonError(res, 413, -32000, `Request body exceeds ${MAX_BODY} bytes`);
    else jsonError(res, 400, -32700, 'Parse error: Invalid JSON');
    return;
  }
  const msgs = Array.isArray(body) ? body : [body];
  if (!msgs.some(isInitialize)) {
    jsonError(res, 400, -32000, 'Bad Request: No valid session ID provided');
    return;
  }
  if (sessions.size + pendingSessions >= opt.maxSessions) {
    jsonError(res, 503, -32000, `Too many sessions (${opt.maxSessions}); DELETE one first`);
    return;
  }
  const s = new Session();
  pendingSessions++;
  try {
    await s.start();
  } catch (err) {
    pendingSessions--;
    logErr(`cannot start ${opt.command}: ${err.message}`);
    jsonError(res, 502, -32603, `Bridge could not start the server: ${err.message}`);
    return;
  }
  pendingSessions--;
  await s.http.handleRequest(req, res, body);
  if (!s.id) s.close('initialize was rejected');
}

const server = http.createServer((req, res) => {
  handle(req, res).catch((err) => {
    logErr(`internal error: ${err.stack ?? err}`);
    jsonError(res, 500, -32603, 'Internal error in bridge');
  });
});

if (opt.idleSecs > 0) {
  setInterval(() => {
    const now = Date.now();
    for (const s of sessions.values()) {
      if (s.inflight.size === 0 && now - s.lastActive > opt.idleSecs * 1000) s.close(`idle for ${opt.idleSecs}s`);
    }
  }, Math.min(10_000, opt.idleSecs * 1000)).unref();
}

let stopping = false;
async function shutdown(sig) {
  if (stopping) return;
  stopping = true;
  log(`${sig}: closing ${sessions.size} session(s)`);
  server.close();
  server.closeAllConnections?.();
  await Promise.allSettled([...sessions.values()].map((s) => s.close('bridge stopping')));
  process.exit(0);
}
process.on('SIGTERM', () => shutdown('SIGTERM'));
process.on('SIGINT', () => shutdown('SIGINT'));

server.on('error', (err) => die(`cannot listen on ${opt.host}:${opt.port}: ${err.message}`));
server.listen(opt.port, opt.host, () => {
  const { port } = server.address();
  const host = opt.host.includes(':') ? `[${opt.host}]` : opt.host;
  const endpoint = `http://${host}:${port}${opt.path}`;
  if (opt.urlFile) writeFileSync(opt.urlFile, endpoint + '\n');
  process.stdout.write(`listening ${endpoint}\n`);
  log(`serving ${[opt.command, ...opt.args].join(' ')} at ${endpoint}`);
});
