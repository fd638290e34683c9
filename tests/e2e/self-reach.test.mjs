// self-reach.test.mjs: a sandbox never reaches the server it runs under
// (SECURITY.md, "Egress goes only where the policy says"), on both backends,
// as root and as a user.
//
// The attack: `ignition-mcp --http 127.0.0.1:PORT` without tokens, with
// IGN_MCP_NET=open and IGN_MCP_NET_PRIVATE=host (the sandbox may reach the
// host's loopback services), an operator's hosts file mapping good.test to
// 127.0.0.1, and a session allowed good.test:PORT.  From inside, a program
// connects to good.test:PORT (in an allow and in an open session) and
// sends an MCP request that runs `cat /root/secret.txt` in its own
// session: as HTTP/1.0 without Host (which the server once served; the
// broker's peek now refuses it on a name, as "HTTP request without Host"),
// with Host, and as raw bytes.  Each must be refused by the broker (all but
// the Host-less one as "the server's own listening socket") and recorded,
// and the secret must never come back.  The same request sent by
// the test from the host (outside any sandbox) is served: the payload is a
// working attack, refused only for where it comes from.  A control row: a
// loopback server of the test's own, on another port under the same name
// and policy, is reached.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import {
  REPO, SERVER, serverEnv, call, writeFile, waitUntil, descendants, waitGone, hardKill,
  assertNoSanitizerReport, assertNoVmLeftovers, TOOLS_SKIP,
} from './lib.mjs';

const T = { timeout: 300_000 };
const PROBE = fs.readFileSync(path.join(REPO, 'tests/e2e/helpers/egress_probe.py'));
const SELF = "the server's own listening socket";
const NO_HOST = 'HTTP request without Host';
const SECRET = `secret-${process.pid}-${Date.now()}`;
const V = '2026-07-28';

/* `ignition-mcp --http 127.0.0.1:0` with ENV: {pid, port, url, stderr(),
 * close()} once it says where it listens. */
async function startHttp(env, cwd) {
  const child = spawn(SERVER, ['--http', '127.0.0.1:0'], { env: serverEnv({ env, tools: true }), cwd, stdio: ['pipe', 'pipe', 'pipe'] });
  let stderr = '';
  child.stderr.on('data', (d) => (stderr += d.toString('utf8')));
  child.stdout.on('data', () => {});
  child.stdin.on('error', () => {});
  let exited = null;
  const exitP = new Promise((r) => child.on('exit', (code, signal) => r((exited = { code, signal }))));
  const m = await waitUntil(() => exited || stderr.match(/listening on (http:\/\/127\.0\.0\.1:(\d+)\/mcp)/), { timeoutMs: 60_000, intervalMs: 50 });
  if (!m || exited) {
    hardKill(child.pid);
    throw new Error(`ignition-mcp --http did not start (${JSON.stringify(exited)}):\n${stderr}`);
  }
  return {
    pid: child.pid,
    url: m[1],
    port: Number(m[2]),
    stderr: () => stderr,
    async close() {
      const kids = exited ? [] : descendants(child.pid);
      child.kill('SIGTERM');
      let t;
      const done = await Promise.race([exitP, new Promise((r) => (t = setTimeout(() => r(null), 15_000)))]);
      clearTimeout(t);
      if (!done) {
        hardKill(child.pid);
        await exitP;
      }
      for (const l of await waitGone(kids, 8000)) {
        try {
          process.kill(l.pid, 'SIGKILL');
        } catch {}
      }
      assert.ok(done, `the server did not exit within 15 s of SIGTERM; stderr:\n${stderr.slice(-3000)}`);
      await assertNoVmLeftovers(child.pid);
      assertNoSanitizerReport(stderr);
    },
  };
}

/* A 2026-07-28 tools/call of `run` in SID: the whole HTTP/1.0 request, with
 * Host HOST (null: none). */
function attackRequest(sid, host, id) {
  const body = JSON.stringify({
    jsonrpc: '2.0', id, method: 'tools/call',
    params: {
      name: 'run', arguments: { session_id: sid, command: 'cat /root/secret.txt' },
      _meta: {
        'io.modelcontextprotocol/protocolVersion': V,
        'io.modelcontextprotocol/clientCapabilities': {},
        'io.modelcontextprotocol/clientInfo': { name: 'self-reach', version: '0.0.1' },
      },
    },
  });
  const h = {
    ...(host ? { Host: host } : {}),
    'Content-Type': 'application/json', Accept: 'application/json, text/event-stream',
    'MCP-Protocol-Version': V, 'Mcp-Method': 'tools/call', 'Mcp-Name': 'run', 'Mcp-Param-Session-Id': sid,
    'Content-Length': Buffer.byteLength(body),
  };
  return `POST /mcp HTTP/1.0\r\n${Object.entries(h).map(([k, v]) => `${k}: ${v}\r\n`).join('')}\r\n${body}`;
}

/* Sends REQ to 127.0.0.1:PORT from the host; the whole answer. */
function fromHost(port, req) {
  return new Promise((resolve, reject) => {
    const sock = net.connect(port, '127.0.0.1');
    let got = '';
    const timer = setTimeout(() => sock.destroy(new Error(`no whole answer in 60 s: ${got}`)), 60_000);
    sock.on('data', (d) => (got += d.toString('utf8')));
    sock.on('error', (e) => (clearTimeout(timer), reject(e)));
    sock.on('close', () => (clearTimeout(timer), resolve(got)));
    /* No half-close: the server takes one as the client gone, and cancels. */
    sock.on('connect', () => sock.write(req));
  });
}

describe('a sandbox never reaches the server it runs under', { skip: TOOLS_SKIP }, () => {
  let dir, srv, client, control, controlSeen = 0;
  let A, B; // sessions: A allows good.test:PORT and the control port, B is open

  before(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-selfreach-'));
    fs.chmodSync(dir, 0o755);
    // The control: a loopback server of the test's own (another process).
    control = net.createServer((c) => {
      controlSeen++;
      c.on('error', () => {});
      c.once('data', () => c.end('HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\ncontrol reached\n'));
    });
    await new Promise((r, j) => control.once('error', j).listen(0, '127.0.0.1', r));
    const hosts = path.join(dir, 'hosts');
    fs.writeFileSync(hosts, '127.0.0.1 good.test\n');
    fs.chmodSync(hosts, 0o644);
    srv = await startHttp({ IGN_MCP_NET: 'open', IGN_MCP_NET_PRIVATE: 'host', IGN_MCP_EGRESS_HOSTS: hosts }, dir);
    client = new Client({ name: 'ign-e2e-self-reach', version: '0.0.1' }, { capabilities: {} });
    await client.connect(new StreamableHTTPClientTransport(new URL(srv.url)));
    const ctl = control.address().port;
    const a = await call(client, 'open_session', { network: 'allow', allow_hosts: [`good.test:${srv.port}`, `good.test:${ctl}`] });
    const b = await call(client, 'open_session', { network: 'open' });
    A = a.session_id;
    B = b.session_id;
    for (const sid of [A, B]) {
      await writeFile(client, sid, '/root/eg.py', PROBE);
      await writeFile(client, sid, '/root/secret.txt', Buffer.from(`${SECRET}\n`));
    }
  });

  after(async () => {
    await client?.close().catch(() => {});
    await srv?.close();
    await new Promise((r) => (control ? control.close(r) : r()));
    if (dir) fs.rmSync(dir, { recursive: true, force: true });
  });

  /* Runs the probe PROBES ([{host, port, payload}]) in SID; the results, the
   * run's result. */
  async function probe(sid, probes) {
    const code = `from eg import *\nimport base64\nres = []\n${probes.map((p) =>
      `res.append(tcp(${JSON.stringify(p.host)}, ${p.port}, base64.b64decode(${JSON.stringify(Buffer.from(p.payload).toString('base64'))}), timeout=20))`).join('\n')}\nout(res=res)\n`;
    const r = await call(client, 'run', { session_id: sid, command: 'cd /root && python3 -', stdin: code, timeout_s: 120 }, { timeout: 200_000 });
    assert.equal(r.exit_code, 0, `the probe failed: ${r.stderr}\n${r.stdout}`);
    return { res: JSON.parse(r.stdout.trim().split('\n').pop()).res, r };
  }

  /* REASONS: the reason each attempt is refused with, in any order. */
  function assertRefusedAndRecorded(what, results, r, host, ip, reasons) {
    for (const [i, o] of results.entries()) {
      assert.ok(['reset', 'refused'].includes(o.result), `${what} #${i}: the program reached something: ${JSON.stringify(o)}`);
      assert.ok(!JSON.stringify(o).includes(SECRET), `${what} #${i}: the secret came back: ${JSON.stringify(o)}`);
    }
    const denied = r.egress.denied.filter((e) => e.kind === 'connect' && e.port === srv.port);
    assert.equal(denied.length, results.length, `${what}: not every attempt was recorded as denied: ${JSON.stringify(r.egress.denied)}`);
    assert.deepEqual(denied.map((e) => e.reason).sort(), [...reasons].sort(), `${what}: ${JSON.stringify(denied)}`);
    for (const e of denied) {
      // The peek refuses before the name is resolved to an address.
      if (e.reason === SELF) assert.equal(e.ip, ip, `${what}: ${JSON.stringify(e)}`);
      assert.equal(e.host, host);
      assert.equal(e.bytes_up, 0, `${what}: bytes went up: ${JSON.stringify(e)}`);
    }
    assert.ok(!r.egress.allowed.some((e) => e.port === srv.port), `${what}: a connection to the server's port was admitted: ${JSON.stringify(r.egress.allowed)}`);
  }

  test('the attack works from the host: the request runs the command with Host, and is 400 without', T, async () => {
    const ok = await fromHost(srv.port, attackRequest(A, `127.0.0.1:${srv.port}`, 1));
    assert.match(ok, /^HTTP\/1\.[01] 200/, ok);
    assert.ok(ok.includes(SECRET), `the request did not run the command: ${ok}`);
    const none = await fromHost(srv.port, attackRequest(A, null, 2));
    assert.match(none, /^HTTP\/1\.[01] 400/, none);
    assert.ok(!none.includes(SECRET));
  });

  test('allowed good.test:PORT: HTTP/1.0 without Host, with Host, raw bytes, nothing: each refused and recorded', T, async () => {
    const before = controlSeen;
    const { res, r } = await probe(A, [
      { host: 'good.test', port: srv.port, payload: attackRequest(A, null, 3) },
      { host: 'good.test', port: srv.port, payload: attackRequest(A, 'good.test', 4) },
      { host: 'good.test', port: srv.port, payload: '\x01\x02 raw bytes\n' },
      { host: 'good.test', port: srv.port, payload: '' },
    ]);
    assertRefusedAndRecorded('good.test', res, r, 'good.test', '127.0.0.1', [NO_HOST, SELF, SELF, SELF]);
    assert.equal(controlSeen, before);
    const log = await call(client, 'network_log', { session_id: A });
    assert.ok(log.denied.filter((e) => e.reason === SELF || e.reason === NO_HOST).length >= res.length, `network_log lacks the refusals: ${JSON.stringify(log.denied)}`);
  });

  test('an open session (any name): good.test:PORT without Host, with Host, raw bytes: refused and recorded', T, async () => {
    const { res, r } = await probe(B, [
      { host: 'good.test', port: srv.port, payload: attackRequest(B, null, 6) },
      { host: 'good.test', port: srv.port, payload: attackRequest(B, 'good.test', 7) },
      { host: 'good.test', port: srv.port, payload: '\x01\x02 raw bytes\n' },
    ]);
    assertRefusedAndRecorded('open', res, r, 'good.test', '127.0.0.1', [NO_HOST, SELF, SELF]);
  });

  test('control: another loopback server, same name and policy, another port, is reached', T, async () => {
    const before = controlSeen;
    const ctl = control.address().port;
    const { res, r } = await probe(A, [{ host: 'good.test', port: ctl, payload: 'GET / HTTP/1.0\r\nHost: good.test\r\n\r\n' }]);
    assert.equal(res[0].result, 'data', `the control server was not reached: ${JSON.stringify(res[0])}`);
    assert.match(res[0].data, /control reached/);
    assert.equal(controlSeen, before + 1);
    assert.ok(r.egress.allowed.some((e) => e.host === 'good.test' && e.port === ctl), `the control connection was not recorded as allowed: ${JSON.stringify(r.egress)}`);
    // And the open session B.
    const o = await probe(B, [{ host: 'good.test', port: ctl, payload: 'GET / HTTP/1.0\r\nHost: good.test\r\n\r\n' }]);
    assert.equal(o.res[0].result, 'data', JSON.stringify(o.res[0]));
  });
});
