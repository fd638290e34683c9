// scaleout.test.mjs: several ignition-mcp hosts behind one HAProxy, for
// real, on one machine (docs/scale-out.md).
//
// Three servers, h1, h2 and h3 (IGN_MCP_HOST_ID), each in a network
// namespace of its own joined to this one by a veth pair on a /30 of a
// 10.x.y.0/24 that nothing on the machine uses, each serving
// `--http 10.x.y.z:PORT` with the same IGN_MCP_HTTP_TOKENS file.  In front,
// Debian's HAProxy with the configuration of tests/e2e/helpers/haproxy.mjs,
// on 127.0.0.1: a request whose Mcp-Param-Session-Id starts with "hN." goes
// to hN, any other round-robin to the healthy hosts.  The official v2 client
// (2026-07-28, Streamable HTTP, a bearer token) opens sessions through it and
// works in them; then h2 is SIGKILLed, and later started again under the
// same host id.  At the end everything is torn down and the test checks
// that nothing is left: processes, network namespaces, veth links, cgroups,
// files.
//
// ns backend only: the test proves routing, which does not depend on the
// backend.  Root only (network namespaces, veth links); skipped, saying so,
// where HAProxy, ip or nsenter is missing.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import crypto from 'node:crypto';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { Client, StreamableHTTPClientTransport } from '@modelcontextprotocol/client';
import { Client as Client1 } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport as Transport1 } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import {
  SERVER, REPO, IS_NS, IS_VM, AS_ROOT, serverEnv, descendants, isAlive, procStart, waitUntil,
  assertNoSanitizerReport, cgroupIgnDirs, textOf, sleep,
} from './lib.mjs';
import { haproxyConfig, hostBackend, errorFiles, errorFile, parseShowStat } from './helpers/haproxy.mjs';

const T = { timeout: 300_000 };
const V = '2026-07-28';
const HAPROXY = '/usr/sbin/haproxy';
const PORT = 8080; /* each server's, in its own network namespace */
const HOSTS = ['h1', 'h2', 'h3'];

function which(cmd) {
  for (const d of (process.env.PATH || '/usr/sbin:/usr/bin:/sbin:/bin').split(':').concat(['/usr/sbin', '/sbin'])) {
    if (d && fs.existsSync(path.join(d, cmd))) return path.join(d, cmd);
  }
  return null;
}
const IP = which('ip');
const NSENTER = which('nsenter');

/* What the drain needs of the machine (both backends). */
const SKIP_DRAIN = !AS_ROOT
  ? `root only (the suite runs as uid ${process.getuid()}): network namespaces and veth links need root`
  : !fs.existsSync(HAPROXY) ? `${HAPROXY} is missing (apt-get install haproxy)` : !IP ? 'ip is missing' : !NSENTER ? 'nsenter is missing' : false;

const SKIP = !IS_NS
  ? 'ns only: this test proves the routing of requests to hosts, which does not depend on the backend'
  : !AS_ROOT
    ? `root only (the suite runs as uid ${process.getuid()}): network namespaces and veth links need root`
    : !fs.existsSync(HAPROXY)
      ? `${HAPROXY} is missing (apt-get install haproxy)`
      : !IP
        ? 'ip is missing (apt-get install iproute2)'
        : !NSENTER
          ? 'nsenter is missing (apt-get install util-linux)'
          : false;

// ---------------------------------------------------------------- the document

/* The values docs/scale-out.md shows its configuration with. */
const DOC_HOSTS = HOSTS.map((name, i) => ({ name, addr: `10.0.0.${i + 1}:8080` }));
const DOC_LISTEN = '127.0.0.1:8443';

/* The fenced block that follows the line holding MARK in the document. */
function docBlock(doc, mark) {
  const at = doc.indexOf(mark);
  assert.ok(at >= 0, `docs/scale-out.md has no "${mark}"`);
  const m = doc.slice(at).match(/\n```[a-z]*\n([\s\S]*?)\n```\n/);
  assert.ok(m, `docs/scale-out.md: no fenced block after "${mark}"`);
  return m[1] + '\n';
}

describe('docs/scale-out.md', () => {
  test('shows the haproxy.cfg and the error file this test runs, byte for byte', () => {
    const doc = fs.readFileSync(path.join(REPO, 'docs/scale-out.md'), 'utf8');
    assert.equal(docBlock(doc, '<!-- haproxy.cfg -->'), haproxyConfig({ listen: DOC_LISTEN, hosts: DOC_HOSTS }));
    assert.equal(docBlock(doc, '<!-- haproxy.cfg, shared store: backend h1 -->'), hostBackend({ host: DOC_HOSTS[0], hosts: DOC_HOSTS, shared: true }));
    assert.equal(docBlock(doc, '<!-- errors/h2.503.http -->'), errorFile('h2', 503).replaceAll('\r\n', '\n'));
  });
});

// ---------------------------------------------------------------- the machine

function ip(args, { ns = null, ok = true } = {}) {
  const r = spawnSync(IP, ns ? ['-n', ns, ...args] : args, { encoding: 'utf8' });
  if (ok && r.status !== 0) throw new Error(`ip ${ns ? `-n ${ns} ` : ''}${args.join(' ')}: ${r.stderr || r.error}`);
  return r;
}

/* 10.A.B.0/24 that overlaps no address or route of this machine. */
function freeSubnet() {
  const taken = [];
  for (const args of [['-4', '-j', 'route', 'show', 'table', 'all'], ['-4', '-j', 'addr']]) {
    let j = [];
    try {
      j = JSON.parse(ip(args).stdout || '[]');
    } catch {}
    for (const e of j) {
      if (e.dst && e.dst !== 'default') taken.push(e.dst);
      for (const a of e.addr_info ?? []) taken.push(`${a.local}/${a.prefixlen}`);
    }
  }
  const toInt = (a) => a.split('.').reduce((n, o) => n * 256 + Number(o), 0);
  const range = (cidr) => {
    const [a, l = '32'] = cidr.split('/');
    if (!/^\d+\.\d+\.\d+\.\d+$/.test(a)) return null;
    const size = 2 ** (32 - Number(l));
    const lo = Math.floor(toInt(a) / size) * size;
    return [lo, lo + size - 1];
  };
  const used = taken.map(range).filter(Boolean);
  for (let i = 0; i < 200; i++) {
    const a = 128 + crypto.randomInt(0, 127), b = crypto.randomInt(0, 256);
    const lo = toInt(`10.${a}.${b}.0`), hi = lo + 255;
    if (!used.some(([ulo, uhi]) => ulo <= hi && lo <= uhi)) return `10.${a}.${b}`;
  }
  throw new Error(`no free 10.x.y.0/24 for the hosts' links (taken: ${taken.join(' ')})`);
}

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.on('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

/* One line of the haproxy admin socket, answered whole. */
function adminCommand(sock, cmd) {
  return new Promise((resolve, reject) => {
    const c = net.createConnection(sock);
    let out = '';
    c.on('connect', () => c.write(cmd + '\n'));
    c.on('data', (d) => (out += d));
    c.on('end', () => resolve(out));
    c.on('error', reject);
  });
}

/* Starts a child, keeps its stderr (capped), and waits for a line of it
 * that matches RE; the child is {proc, pid, start, stderr(), exited}. */
async function startChild(cmd, args, { env, cwd, ready, what, timeoutMs = 60_000 }) {
  const proc = spawn(cmd, args, { env, cwd, stdio: ['pipe', 'pipe', 'pipe'] });
  const c = { proc, pid: proc.pid, start: procStart(proc.pid)?.start, err: '', exited: null, what };
  proc.stdin.on('error', () => {});
  proc.stdout.on('data', () => {});
  proc.stderr.on('data', (d) => {
    c.err += d.toString('utf8');
    if (c.err.length > 4 << 20) c.err = c.err.slice(-(2 << 20));
  });
  c.exit = new Promise((resolve) => proc.on('exit', (code, signal) => resolve((c.exited = { code, signal }))));
  c.stderr = () => c.err;
  if (ready) {
    const ok = await waitUntil(() => ready.test(c.err) || c.exited, { timeoutMs, intervalMs: 50 });
    if (!ok || c.exited) {
      try {
        proc.kill('SIGKILL');
      } catch {}
      throw new Error(`${what} did not start (${c.exited ? `exit ${JSON.stringify(c.exited)}` : `no line matching ${ready} in ${timeoutMs} ms`}); stderr:\n${c.err.slice(-4000)}`);
    }
  }
  return c;
}

/* SIGTERM, then SIGKILL after timeoutMs; resolves to how it ended. */
async function stopChild(c, timeoutMs = 10_000) {
  if (c.exited) return c.exited;
  try {
    c.proc.kill('SIGTERM');
  } catch {}
  let t;
  const r = await Promise.race([c.exit, new Promise((res) => (t = setTimeout(() => res(null), timeoutMs)))]);
  clearTimeout(t);
  if (r) return r;
  try {
    c.proc.kill('SIGKILL');
  } catch {}
  return { ...(await c.exit), forced: true };
}

/* The network namespaces of an earlier run of this test that was killed
 * (SIGKILL leaves no chance to clean up): its pid is in their name. */
function removeStaleNetns() {
  for (const l of ip(['netns', 'list'], { ok: false }).stdout.split('\n')) {
    const m = l.match(/^(ign-scaleout-(\d+)-\S+)/);
    if (m && Number(m[2]) !== process.pid && !procStart(m[2])) ip(['netns', 'del', m[1]], { ok: false });
  }
}

/* Three hosts, each in its network namespace, and HAProxy in front.
 * SHARED: the hosts share one store, and the proxy sends a host's sessions
 * to another while it is down (hostBackend); ENV: more for every server. */
class World {
  constructor({ shared = false, env = {} } = {}) {
    this.shared = shared;
    this.env = env;
    this.tag = crypto.randomBytes(3).toString('hex').slice(0, 5);
    this.dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-scaleout-'));
    fs.chmodSync(this.dir, 0o755);
    this.net = freeSubnet();
    this.hosts = {};
    this.netns = [];
    this.links = [];
    this.pids = []; /* every process started here, {pid, start} */
    this.serverPids = [];
    this.clients = [];
    this.token = crypto.randomBytes(24).toString('hex');
    this.checkToken = crypto.randomBytes(24).toString('hex');
    this.tokens = path.join(this.dir, 'tokens');
    fs.writeFileSync(this.tokens, `# name:token\ne2e:${this.token}\nhaproxy-check:${this.checkToken}\n`, { mode: 0o600 });
    this.torn = false;
    /* Last resort when the test process ends without its teardown: on
     * exit, and on the SIGTERM or SIGINT of a runner that gives up on it
     * (which would otherwise end it without 'exit' and leave the network
     * namespaces behind). */
    this.onExit = () => this.hardTeardown();
    this.onSignal = (sig) => process.exit(sig === 'SIGINT' ? 130 : 143);
    process.on('exit', this.onExit);
    process.on('SIGTERM', this.onSignal);
    process.on('SIGINT', this.onSignal);
    removeStaleNetns();
  }

  async up() {
    for (const [i, name] of HOSTS.entries()) {
      const n = i + 1;
      const ns = `ign-scaleout-${process.pid}-${this.tag}-${name}`;
      const link = `igs${this.tag}${n}`;
      ip(['netns', 'add', ns]);
      this.netns.push(ns);
      ip(['link', 'add', link, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', ns]);
      this.links.push(link);
      ip(['addr', 'add', `${this.net}.${4 * n + 1}/30`, 'dev', link]);
      ip(['link', 'set', link, 'up']);
      ip(['addr', 'add', `${this.net}.${4 * n + 2}/30`, 'dev', 'eth0'], { ns });
      ip(['link', 'set', 'eth0', 'up'], { ns });
      ip(['link', 'set', 'lo', 'up'], { ns });
      const home = path.join(this.dir, name);
      fs.mkdirSync(path.join(home, 'store'), { recursive: true, mode: 0o755 });
      if (this.shared) fs.mkdirSync(path.join(this.dir, 'store'), { recursive: true, mode: 0o755 });
      fs.chmodSync(home, 0o755);
      fs.chmodSync(path.join(home, 'store'), 0o755);
      this.hosts[name] = { name, ns, link, home, addr: `${this.net}.${4 * n + 2}`, server: null };
      await this.startServer(name);
    }
    await this.startProxy();
  }

  async startServer(name) {
    const h = this.hosts[name];
    const env = serverEnv({
      env: {
        IGN_MCP_HOST_ID: name,
        IGN_MCP_HTTP_TOKENS: this.tokens,
        // Shared: one store for all (a vm pass's, with its warm bases).
        IGN_MCP_STORE: !this.shared ? path.join(h.home, 'store') : IS_VM ? serverEnv({}).IGN_MCP_STORE : path.join(this.dir, 'store'),
        IGN_MCP_LOG_DIR: path.join(this.shared ? this.dir : h.home, 'logs'),
        ...this.env,
      },
    });
    const listen = `${h.addr}:${PORT}`;
    h.server = await startChild(NSENTER, [`--net=/run/netns/${h.ns}`, '--', SERVER, '--http', listen], {
      env,
      cwd: h.home,
      ready: new RegExp(`listening on http://${listen.replaceAll('.', '\\.')}/mcp`),
      what: `the ${name} server (${SERVER} --http ${listen} in ${h.ns})`,
    });
    this.pids.push({ pid: h.server.pid, start: h.server.start });
    this.serverPids.push(h.server.pid);
    h.url = `http://${listen}/mcp`;
    return h.server;
  }

  async startProxy() {
    this.port = await freePort();
    const hosts = HOSTS.map((name) => ({ name, addr: `${this.hosts[name].addr}:${PORT}` }));
    this.cfg = path.join(this.dir, 'haproxy.cfg');
    fs.writeFileSync(this.cfg, haproxyConfig({ listen: `127.0.0.1:${this.port}`, hosts, shared: this.shared }));
    fs.mkdirSync(path.join(this.dir, 'errors'));
    for (const [p, c] of Object.entries(errorFiles(hosts))) fs.writeFileSync(path.join(this.dir, p), c);
    this.admin = path.join(this.dir, 'admin.sock');
    this.proxy = await startChild(HAPROXY, ['-db', '-f', this.cfg], {
      env: { PATH: process.env.PATH, IGN_MCP_CHECK_TOKEN: this.checkToken },
      cwd: this.dir,
      what: `HAProxy (${HAPROXY} -db -f ${this.cfg})`,
    });
    this.pids.push({ pid: this.proxy.pid, start: this.proxy.start });
    this.url = `http://127.0.0.1:${this.port}/mcp`;
    const up = await waitUntil(async () => {
      if (this.proxy.exited) return true;
      const st = await this.stat().catch(() => null);
      return st && HOSTS.every((h) => /^UP/.test(st[`any/${h}`] ?? ''));
    }, { timeoutMs: 20_000, intervalMs: 200 });
    assert.ok(up && !this.proxy.exited, `HAProxy did not see the three hosts up (${JSON.stringify(await this.stat().catch((e) => e.message))}); its stderr:\n${this.proxy.stderr().slice(-4000)}`);
  }

  async stat() {
    return parseShowStat(await adminCommand(this.admin, 'show stat'));
  }

  async waitStatus(host, re, timeoutMs = 15_000) {
    let st;
    const ok = await waitUntil(async () => {
      st = await this.stat().catch(() => null);
      return st && re.test(st[`any/${host}`] ?? '');
    }, { timeoutMs, intervalMs: 200 });
    assert.ok(ok, `HAProxy: any/${host} is not ${re} after ${timeoutMs} ms: ${JSON.stringify(st)}`);
  }

  /* The proxy's log lines: {backend, server, status, sid}. */
  proxyLog() {
    const out = [];
    for (const l of this.proxy.stderr().split('\n')) {
      const m = l.match(/\smcp (\S+)\/(\S+) \S+ (\d{3}) .*\{([^}]*)\} "POST \/mcp/);
      if (m) out.push({ backend: m[1], server: m[2], status: Number(m[3]), sid: m[4] });
    }
    return out;
  }

  /* The v2 client, 2026-07-28, over Streamable HTTP with the bearer token.
   * Every POST's MCP headers are recorded in .sent. */
  async connect(url) {
    const sent = [];
    const transport = new StreamableHTTPClientTransport(new URL(url), {
      authProvider: { token: async () => this.token },
      fetch: async (u, init) => {
        const h = new Headers(init?.headers);
        if (init?.method === 'POST') sent.push({ method: h.get('mcp-method'), name: h.get('mcp-name'), sid: h.get('mcp-param-session-id'), auth: !!h.get('authorization') });
        return fetch(u, init);
      },
    });
    const client = new Client({ name: 'ign-e2e-scaleout', version: '0.0.1' }, { capabilities: {}, versionNegotiation: { mode: { pin: V } } });
    const errors = [];
    client.onerror = (e) => errors.push(String(e?.message ?? e));
    await client.connect(transport);
    assert.equal(client.getProtocolEra(), 'modern');
    /* The tools' x-mcp-header declarations: without them in the client's
     * cache, calls would carry no Mcp-Param-Session-Id. */
    const { tools } = await client.listTools();
    assert.ok(tools.some((t) => t.name === 'run'), `tools/list through ${url}: ${tools.map((t) => t.name)}`);
    const c = { client, sent, errors, url };
    this.clients.push(c);
    return c;
  }

  /* Stops everything in order; returns what was left (empty: nothing). */
  async teardown() {
    if (this.torn) return [];
    this.torn = true;
    const left = [];
    for (const c of this.clients) await c.client.close().catch(() => {});
    if (this.proxy) {
      const r = await stopChild(this.proxy);
      if (r.forced) left.push('HAProxy did not stop on SIGTERM');
    }
    for (const h of Object.values(this.hosts)) {
      if (!h.server || h.server.exited) continue;
      const kids = descendants(h.server.pid);
      const r = await stopChild(h.server);
      if (r.forced) left.push(`the ${h.name} server did not stop on SIGTERM`);
      const alive = await waitUntil(() => kids.filter(isAlive).length === 0, { timeoutMs: 5000 });
      if (!alive) left.push(...kids.filter(isAlive).map((k) => `${k.pid} ${k.cmd} (of ${h.name})`));
      for (const k of kids) {
        try {
          process.kill(k.pid, 'SIGKILL');
        } catch {}
      }
      try {
        assertNoSanitizerReport(h.server.stderr(), `the ${h.name} server`);
      } catch (e) {
        left.push(e.message);
      }
    }
    // A veth pair goes with its host end at once; deleting only the
    // namespace leaves the host end until the kernel's namespace cleanup
    // runs, which a busy host puts off past the check below.
    for (const l of this.links) ip(['link', 'del', l], { ok: false });
    for (const ns of this.netns) ip(['netns', 'del', ns], { ok: false });
    fs.rmSync(this.dir, { recursive: true, force: true });
    process.off('exit', this.onExit);
    process.off('SIGTERM', this.onSignal);
    process.off('SIGINT', this.onSignal);
    return left;
  }

  /* Synchronous, for process exit: kill, delete, remove; no checks. */
  hardTeardown() {
    for (const p of this.pids) {
      const st = procStart(p.pid);
      if (st && st.start === p.start) {
        for (const d of descendants(p.pid)) {
          try {
            process.kill(d.pid, 'SIGKILL');
          } catch {}
        }
        try {
          process.kill(p.pid, 'SIGKILL');
        } catch {}
      }
    }
    for (const l of this.links) spawnSync(IP, ['link', 'del', l]);
    for (const ns of this.netns) spawnSync(IP, ['netns', 'del', ns]);
    fs.rmSync(this.dir, { recursive: true, force: true });
  }
}

// ---------------------------------------------------------------- calls

const CALL = { timeout: 120_000 };

async function tool(c, name, args = {}) {
  const res = await c.client.callTool({ name, arguments: args }, CALL);
  assert.equal(res.isError ?? false, false, `${name}(${JSON.stringify(args).slice(0, 200)}) through ${c.url} failed: ${textOf(res)}`);
  return res.structuredContent;
}

/* A call that must not succeed: the text of its tool error, or the message
 * of the error it was rejected with (HTTP status and body included). */
async function failure(c, name, args = {}) {
  let res;
  try {
    res = await c.client.callTool({ name, arguments: args }, CALL);
  } catch (e) {
    const status = e?.data?.status ?? e?.status;
    const cause = e?.cause ? ` (${e.cause.message ?? e.cause}${e.cause.cause ? `: ${e.cause.cause.message ?? e.cause.cause}` : ''})` : '';
    return `${status ? `HTTP ${status}: ` : ''}${e?.message ?? e}${cause} ${e?.data?.text ?? ''}`;
  }
  assert.equal(res.isError, true, `${name}(${JSON.stringify(args).slice(0, 200)}) through ${c.url} should fail but returned ${JSON.stringify(res).slice(0, 400)}`);
  return textOf(res);
}

const hostOf = (sid) => sid.split('.')[0];

async function openOn(c) {
  const o = await tool(c, 'open_session', {});
  assert.match(o.session_id, /^h[123]\.\S+$/, `open_session gave ${o.session_id}: no host prefix`);
  return o.session_id;
}

/* A command and a file in session SID: the command's output, and the file
 * written by write_file read back by run and by read_file. */
async function workIn(c, sid, mark) {
  const r = await tool(c, 'run', { session_id: sid, command: 'echo "ran in $0"; cat /tmp/mark 2>/dev/null || echo no-mark' });
  assert.equal(r.exit_code, 0, `run in ${sid}: ${JSON.stringify(r)}`);
  if (mark === undefined) return r.stdout;
  await tool(c, 'write_file', { session_id: sid, path: '/tmp/mark', content_base64: Buffer.from(mark).toString('base64') });
  const r2 = await tool(c, 'run', { session_id: sid, command: 'cat /tmp/mark' });
  assert.equal(r2.stdout, mark, `${sid}: run read back another file`);
  const rd = await tool(c, 'read_file', { session_id: sid, path: '/tmp/mark' });
  assert.equal(Buffer.from(rd.content_base64, 'base64').toString(), mark, `${sid}: read_file read back another file`);
  return r.stdout;
}

// ---------------------------------------------------------------- the test

describe('three hosts behind HAProxy, routed on Mcp-Param-Session-Id', { skip: SKIP }, () => {
  let w, c;
  const sessions = []; /* {sid, mark} */
  let ourCgroups = () => [];

  before(async () => {
    w = new World();
    ourCgroups = () => cgroupIgnDirs().filter((d) => w.serverPids.some((p) => path.basename(d).startsWith(`ign-mcp-${p}-`)));
    await w.up();
  });
  after(async () => {
    await w?.teardown().catch(() => {});
  });

  test('sessions opened through the proxy land on all three hosts, and every call of a session reaches its host', T, async (t) => {
    c = await w.connect(w.url);
    for (let i = 0; i < 6; i++) {
      const sid = await openOn(c);
      sessions.push({ sid, mark: `session ${i} ${sid} ${crypto.randomBytes(8).toString('hex')}\n` });
    }
    const on = [...new Set(sessions.map((s) => hostOf(s.sid)))].sort();
    assert.deepEqual(on, HOSTS, `6 sessions through round-robin landed on ${on} only: ${sessions.map((s) => s.sid)}`);
    for (const s of sessions) {
      const out = await workIn(c, s.sid, s.mark);
      assert.match(out, /^ran in \S+\nno-mark\n$/, `${s.sid}: a fresh session already had /tmp/mark`);
    }
    // Again in another order: each session still has its own file.
    for (const s of [...sessions].reverse()) {
      const out = await workIn(c, s.sid);
      assert.ok(out.startsWith('ran in ') && out.endsWith(`\n${s.mark}`), `${s.sid} later: ${JSON.stringify(out)}`);
    }
    // The client named the session in a header on every call of one...
    const calls = c.sent.filter((x) => x.method === 'tools/call');
    for (const x of calls.filter((x) => x.name !== 'open_session')) assert.ok(x.sid && /^h[123]\./.test(x.sid), `a ${x.name} call went without Mcp-Param-Session-Id: ${JSON.stringify(x)}`);
    assert.ok(c.sent.every((x) => x.auth), 'a request went without the bearer token');
    // ...and HAProxy sent each one to the host its prefix names, the rest round-robin.
    const log = w.proxyLog();
    const named = log.filter((l) => l.sid);
    assert.ok(named.length >= 6 * 4, `HAProxy logged ${named.length} requests that name a session: ${w.proxy.stderr().slice(-2000)}`);
    for (const l of named) assert.equal(`${l.backend}/${l.server}`, `${hostOf(l.sid)}/${hostOf(l.sid)}`, `HAProxy sent a call for ${l.sid} to ${l.backend}/${l.server}`);
    const free = log.filter((l) => !l.sid);
    assert.ok(free.every((l) => l.backend === 'any'), `a request without a session went to ${JSON.stringify(free.filter((l) => l.backend !== 'any'))}`);
    assert.ok(log.every((l) => l.status === 200), `HAProxy logged failures: ${JSON.stringify(log.filter((l) => l.status !== 200))}`);
    t.diagnostic(`sessions: ${sessions.map((s) => s.sid).join(' ')}; ${named.length} calls routed by header, ${free.length} round-robin (${HOSTS.map((h) => `${h} ${free.filter((l) => l.server === h).length}`).join(', ')})`);
  });

  test('a call for an h3 session sent straight to h1 says that h3 holds it', T, async (t) => {
    const s3 = sessions.find((s) => hostOf(s.sid) === 'h3');
    const direct = await w.connect(w.hosts.h1.url);
    const text = await failure(direct, 'run', { session_id: s3.sid, command: 'echo should-not-run' });
    assert.match(text, /\bh3\b/, `h1 on a session of h3 said: ${text}`);
    assert.doesNotMatch(text, /should-not-run/);
    t.diagnostic(`h1 said: ${text.slice(0, 240)}`);
    // Through the proxy it is served, by h3, as before.
    assert.equal((await tool(c, 'run', { session_id: s3.sid, command: 'cat /tmp/mark' })).stdout, s3.mark);
  });

  test('a task (2026-07-28) of an h2 session has an id of h2, and every tasks/get through the proxy reaches h2', T, async (t) => {
    const s2 = sessions.find((s) => hostOf(s.sid) === 'h2');
    const EXT = 'io.modelcontextprotocol/tasks';
    let n = 0;
    const post = async (method, params, name, sid) => {
      const body = { jsonrpc: '2.0', id: `task-${++n}`, method, params: { ...params, _meta: {
        'io.modelcontextprotocol/protocolVersion': '2026-07-28',
        'io.modelcontextprotocol/clientCapabilities': { extensions: { [EXT]: {} } },
        'io.modelcontextprotocol/clientInfo': { name: 'e2e-scaleout', version: '0' } } } };
      const headers = {
        Authorization: `Bearer ${w.token}`, 'Content-Type': 'application/json', Accept: 'application/json, text/event-stream',
        'MCP-Protocol-Version': '2026-07-28', 'Mcp-Method': method, 'Mcp-Name': name,
      };
      if (sid) headers['Mcp-Param-Session-Id'] = sid;
      const r = await fetch(w.url, { method: 'POST', headers, body: JSON.stringify(body) });
      const text = await r.text();
      assert.equal(r.status, 200, `${method} through the proxy: HTTP ${r.status} ${text.slice(0, 300)}`);
      return JSON.parse(text);
    };
    const before = w.proxyLog().length;
    const made = await post('tools/call', { name: 'run', arguments: { session_id: s2.sid, command: 'sleep 1; cat /tmp/mark' } }, 'run', s2.sid);
    assert.equal(made.result?.resultType, 'task', JSON.stringify(made).slice(0, 300));
    const id = made.result.taskId;
    assert.match(id, /^h2\.t[0-9a-f]{32}$/);
    let last;
    for (let i = 0; i < 6 || last.result?.status === 'working'; i++) {
      last = await post('tasks/get', { taskId: id }, id);
      assert.ok(last.result, `tasks/get ${i} through the proxy did not find the task: ${JSON.stringify(last).slice(0, 300)}`);
      if (i > 60) assert.fail('the task never ended');
      await sleep(200);
    }
    assert.equal(last.result.status, 'completed');
    assert.equal(last.result.result.structuredContent.stdout, s2.mark);
    const gets = w.proxyLog().slice(before).filter((l) => !l.sid);
    assert.ok(gets.length >= 6, `HAProxy logged ${gets.length} tasks/get`);
    for (const l of gets) assert.equal(`${l.backend}/${l.server}`, 'h2/h2', `a tasks/get of an h2 task went to ${l.backend}/${l.server}`);
    t.diagnostic(`${gets.length} tasks/get of ${id}, all to h2`);
  });

  test('a legacy (2025) client through the proxy stays on the host that gave it its Mcp-Session-Id', T, async (t) => {
    /* The 1.x SDK: initialize, then Mcp-Session-Id on every request and no
     * Mcp-Param-Session-Id; the proxy's stick table keeps it on one host. */
    const transport = new Transport1(new URL(w.url), { requestInit: { headers: { Authorization: `Bearer ${w.token}` } } });
    const client = new Client1({ name: 'ign-e2e-scaleout-1x', version: '0.0.1' }, { capabilities: {} });
    const errors = [];
    client.onerror = (e) => errors.push(String(e?.message ?? e));
    await client.connect(transport);
    const legacy = { client: { callTool: (p, o) => client.callTool(p, undefined, o) }, url: w.url };
    try {
      assert.match(transport.sessionId ?? '', /^\S+$/, 'initialize through the proxy returned no Mcp-Session-Id');
      const sids = [];
      for (let i = 0; i < 4; i++) sids.push(await openOn(legacy));
      const on = [...new Set(sids.map(hostOf))];
      assert.equal(on.length, 1, `the legacy client's sessions went to several hosts: ${sids}`);
      for (const sid of sids) {
        await workIn(legacy, sid, `legacy ${sid}\n`);
        await tool(legacy, 'close', { session_id: sid });
      }
      t.diagnostic(`legacy Mcp-Session-Id ${transport.sessionId.slice(0, 8)}…: ${sids.length} sessions, all on ${on[0]}`);
    } finally {
      await transport.terminateSession().catch(() => {});
      await client.close().catch(() => {});
    }
    assert.deepEqual(errors.filter((e) => !/405|SSE stream/i.test(e)), [], 'the 1.x client saw protocol errors');
  });

  test('h2 drained (weight 0 in the rotation): its sessions go on, new sessions go to h1 and h3', T, async () => {
    const ofH2 = sessions.filter((s) => hostOf(s.sid) === 'h2');
    assert.equal((await adminCommand(w.admin, 'set weight any/h2 0')).trim(), '');
    try {
      const fresh = [];
      for (let i = 0; i < 4; i++) fresh.push(await openOn(c));
      assert.ok(fresh.every((sid) => hostOf(sid) !== 'h2'), `open_session with h2 drained gave ${fresh}`);
      for (const s of ofH2) assert.equal((await tool(c, 'run', { session_id: s.sid, command: 'cat /tmp/mark' })).stdout, s.mark);
      for (const sid of fresh) await tool(c, 'close', { session_id: sid });
    } finally {
      await adminCommand(w.admin, 'set weight any/h2 1');
    }
  });

  test('h2 is SIGKILLed: its sessions fail with an error naming h2, h1 and h3 carry on, new sessions go to h1 and h3', T, async (t) => {
    const h2 = w.hosts.h2;
    const ofH2 = sessions.filter((s) => hostOf(s.sid) === 'h2');
    const others = sessions.filter((s) => hostOf(s.sid) !== 'h2');
    assert.ok(ofH2.length > 0 && others.length > 0);
    // A call under way on h2 when it dies: h2 closes the connection unanswered.
    const inflight = failure(c, 'run', { session_id: ofH2[0].sid, command: 'sleep 60' });
    await waitUntil(() => descendants(h2.server.pid).some((d) => /sleep 60/.test(d.cmd ?? '')), { timeoutMs: 10_000 });
    const kids = descendants(h2.server.pid);
    process.kill(h2.server.pid, 'SIGKILL');
    assert.equal((await h2.server.exit).signal, 'SIGKILL');
    /* HAProxy sends it again (retry-on empty-response), is refused and
     * answers with the 503; 502 if it could not send it again. */
    const broken = await inflight;
    assert.match(broken, /HTTP 50[23]: .*host h2 (is unreachable|broke off its answer)\b.*its sessions are lost; open a new session/, `the call under way on h2 when it died: ${broken}; HAProxy: ${w.proxy.stderr().slice(-1500)}`);
    // Before the health check has seen it (the connection is refused: 503;
    // or, when the call met a connection h2 was holding as it died, 502) and after.
    const early = await failure(c, 'run', { session_id: ofH2[0].sid, command: 'true' });
    assert.match(early, /host h2 (is unreachable|broke off its answer)\b.*its sessions are lost; open a new session/, `a call for ${ofH2[0].sid} right after h2 died: ${early}`);
    await w.waitStatus('h2', /^DOWN/);
    for (const s of ofH2) {
      for (const [name, args] of [['run', { command: 'true' }], ['read_file', { path: '/tmp/mark' }]]) {
        const text = await failure(c, name, { session_id: s.sid, ...args });
        assert.match(text, /host h2 is unreachable/, `${name} for ${s.sid} with h2 down: ${text}`);
        assert.match(text, /HTTP 503/, `${name} for ${s.sid} with h2 down: ${text}`);
      }
    }
    // Nothing of h2's sessions outlives it.
    const gone = await waitUntil(() => kids.every((k) => !isAlive(k)), { timeoutMs: 5000 });
    assert.ok(gone, `processes outlived the SIGKILLed h2: ${JSON.stringify(kids.filter(isAlive))}`);
    // h1 and h3 carry on, their files where they were.
    for (const s of others) assert.equal((await tool(c, 'run', { session_id: s.sid, command: 'cat /tmp/mark' })).stdout, s.mark);
    // New sessions: never on h2.
    for (let i = 0; i < 4; i++) {
      const sid = await openOn(c);
      assert.notEqual(hostOf(sid), 'h2', `open_session with h2 down gave ${sid}`);
      const mark = `late ${i} ${sid}\n`;
      await workIn(c, sid, mark);
      sessions.push({ sid, mark, late: true });
    }
    t.diagnostic(`h2's error: ${early.slice(0, 200)}; for the call under way: ${broken.slice(0, 200)}`);
  });

  test('h2 started again under the same host id: an empty session table, and back in the rotation', T, async (t) => {
    const deadPid = w.hosts.h2.server.pid;
    const old = sessions.find((s) => hostOf(s.sid) === 'h2');
    await w.startServer('h2');
    await w.waitStatus('h2', /^UP/);
    // The old id reaches the new h2, which finds on its store that the
    // session was lost with the killed server.
    const text = await failure(c, 'run', { session_id: old.sid, command: 'true' });
    assert.ok(text.includes(`session '${old.sid}' was lost: its server (host 'h2', pid ${deadPid})`), `an h2 session of before the restart: ${text}`);
    t.diagnostic(`the new h2 on ${old.sid}: ${text.slice(0, 200)}`);
    let sid;
    for (let i = 0; i < 6 && !sid; i++) {
      const s = await openOn(c);
      if (hostOf(s) === 'h2') sid = s;
    }
    assert.ok(sid, 'no new session landed on the restarted h2 in 6 tries');
    await workIn(c, sid, `after the restart ${sid}\n`);
    // What the SIGKILLed server could not remove, the new one has.
    const clean = await waitUntil(() => cgroupIgnDirs().every((d) => !path.basename(d).startsWith(`ign-mcp-${deadPid}-`)), { timeoutMs: 5000 });
    assert.ok(clean, `the dead h2's cgroups are still there: ${cgroupIgnDirs().filter((d) => path.basename(d).startsWith(`ign-mcp-${deadPid}-`))}`);
  });

  test('everything is torn down: servers, HAProxy, network namespaces, links, cgroups, files', T, async () => {
    const pids = [...w.pids];
    const netns = [...w.netns];
    const links = [...w.links];
    const dir = w.dir;
    const left = await w.teardown();
    assert.deepEqual(left, [], 'teardown');
    assert.deepEqual(pids.filter(isAlive).map((p) => `${p.pid} ${procStart(p.pid)?.state}`), [], 'servers or HAProxy outlived the teardown');
    const listed = ip(['netns', 'list']).stdout;
    assert.deepEqual(netns.filter((n) => listed.includes(n)), [], 'network namespaces left');
    assert.deepEqual(netns.filter((n) => fs.existsSync(`/run/netns/${n}`)), [], 'network namespace files left');
    assert.deepEqual(links.filter((l) => ip(['link', 'show', l], { ok: false }).status === 0), [], 'veth links left');
    assert.equal(fs.existsSync(dir), false, `${dir} left`);
    const cg = await waitUntil(() => ourCgroups().length === 0, { timeoutMs: 5000 });
    assert.ok(cg, `cgroups left: ${ourCgroups()}`);
  });
});

// ---------------------------------------------------------------- a drain

describe('three hosts on one store behind HAProxy: a host drained with SIGTERM hibernates its sessions, and the others resume them', { skip: SKIP_DRAIN }, () => {
  const N = 10;
  let w;
  before(async () => {
    w = new World({ shared: true, env: { IGN_MCP_SHUTDOWN_ACTION: 'hibernate', IGN_MCP_SHUTDOWN_SECS: 240, IGN_MCP_MAX_SESSIONS: N + 2, IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } });
    await w.up();
  });
  after(async () => {
    await w?.teardown().catch(() => {});
  });

  test(`${N} sessions on h1; h1 drained and stopped; every one answers through the proxy on another host, with its files (vm: and its background process)`, { timeout: 900_000 }, async (t) => {
    const direct = await w.connect(w.hosts.h1.url);
    const c = await w.connect(w.url);
    const sessions = [];
    for (let i = 0; i < N; i++) {
      const sid = await openOn(direct);
      assert.equal(hostOf(sid), 'h1');
      const secs = 100000 + crypto.randomInt(0, 800000);
      const mark = `drained ${i} ${sid}\n`;
      await tool(c, 'write_file', { session_id: sid, path: '/root/mark', content_base64: Buffer.from(mark).toString('base64') });
      await tool(c, 'run', { session_id: sid, command: `(sleep ${secs} > /dev/null 2>&1 &); echo started` });
      sessions.push({ sid, mark, secs });
    }
    // Drain: out of the rotation, then told to stop.
    assert.equal((await adminCommand(w.admin, 'set weight any/h1 0')).trim(), '');
    const t0 = Date.now();
    const h1 = w.hosts.h1.server;
    const ended = await stopChild(h1, 300_000);
    assert.equal(ended.forced, undefined, `h1 did not exit on SIGTERM: ${h1.stderr().slice(-3000)}`);
    const drainMs = Date.now() - t0;
    assert.match(h1.stderr(), new RegExp(`${N} of ${N} session\\(s\\) hibernated before exiting`), h1.stderr().slice(-3000));
    await w.waitStatus('h1', /^DOWN/);
    // Every id h1 minted answers on the others, with what it had.
    const t1 = Date.now();
    for (const s of sessions) {
      const alive = `if for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < $f; echo; done 2>/dev/null | grep -q "^slee[p] ${s.secs} $"; then echo alive; else echo gone; fi`;
      const r = await tool(c, 'run', { session_id: s.sid, command: `cat /root/mark; ${alive}` });
      assert.equal(r.stdout, `${s.mark}${IS_VM ? 'alive' : 'gone'}\n`, `${s.sid} after the drain`);
      assert.ok(Number.isInteger(r.resumed_ms), JSON.stringify(r));
    }
    const resumeMs = Date.now() - t1;
    // The proxy sent them to h1's backend, served by a backup host.
    let log = [];
    await waitUntil(() => (log = w.proxyLog().filter((l) => l.sid && hostOf(l.sid) === 'h1' && l.server !== 'h1')).length >= N, { timeoutMs: 10_000 });
    assert.equal(log.length, N, JSON.stringify(w.proxyLog().slice(-N - 4)));
    for (const l of log) assert.ok(l.backend === 'h1' && l.server !== 'h1' && l.status === 200, `a call for ${l.sid} after the drain: ${JSON.stringify(l)}`);
    // And go on there: a second call is not a resume.
    const again = await tool(c, 'run', { session_id: sessions[0].sid, command: 'true' });
    assert.equal(again.resumed_ms, undefined);
    // New sessions go to h2 and h3.
    const fresh = await openOn(c);
    assert.notEqual(hostOf(fresh), 'h1');
    for (const s of sessions) await tool(c, 'close', { session_id: s.sid });
    await tool(c, 'close', { session_id: fresh });
    t.diagnostic(`h1 hibernated ${N} sessions and exited in ${drainMs} ms; the ${N} resumed on the others in ${resumeMs} ms`);
  });

  test('everything is torn down', T, async () => {
    const left = await w.teardown();
    assert.deepEqual(left, [], 'teardown');
  });
});
