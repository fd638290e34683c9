// network-update.test.mjs: a session's network policy changed while it runs
// (network_update), end to end on the real server (both backends, as root and
// as a user), with the outside world an HTTP server of this test on loopback
// (named by IGN_MCP_EGRESS_HOSTS, reachable with IGN_MCP_NET_PRIVATE=host):
//  - widened (none -> allow) the sandbox reaches the host from its next
//    connection on; narrowed (-> none) a download in flight is reset, the
//    call says so (connections_reset) and the flight record has the policy
//    lines and the reset connection's reason;
//  - "allow" alone keeps the hosts; allow_hosts alone means "allow";
//  - more than IGN_MCP_NET allows is refused as open_session refuses it, bad
//    arguments change nothing;
//  - a fork made after the change starts with the new policy, and so does a
//    session hibernated and resumed.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import http from 'node:http';
import os from 'node:os';
import path from 'node:path';
import { startServer, call, callErr, run, sh, waitUntil, AGENT } from './lib.mjs';

const T = { timeout: 300_000 };

function captureSkip() {
  const r = spawnSync(AGENT, ['--probe-egress'], { encoding: 'utf8', timeout: 20_000 });
  const line = `${r.stdout ?? ''}${r.stderr ?? ''}`.split('\n')[0];
  return r.status === 0 && line === 'ok' ? false : `a sandbox cannot capture its traffic here (${AGENT} --probe-egress: ${line || `status ${r.status}`})`;
}

/* /hello answers "hello"; /slow sends 1 KiB every 50 ms until the client goes. */
const slowOpen = new Set();
let slowSeen = 0;
const srv = http.createServer((req, res) => {
  if (req.url === '/slow') {
    slowSeen++;
    res.writeHead(200, { 'content-type': 'application/octet-stream' });
    const iv = setInterval(() => res.write(Buffer.alloc(1024, 120)), 50);
    slowOpen.add(res);
    res.on('close', () => {
      clearInterval(iv);
      slowOpen.delete(res);
    });
    return;
  }
  res.end('hello');
});

describe('network_update', { skip: captureSkip() }, () => {
  let dir, P, c, port, rule;
  before(async () => {
    await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
    port = srv.address().port;
    rule = `dl.test:${port}`;
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-netupdate-'));
    fs.chmodSync(dir, 0o755);
    const hosts = path.join(dir, 'hosts');
    fs.writeFileSync(hosts, '127.0.0.1 dl.test other.test\n');
    fs.chmodSync(hosts, 0o644);
    P = await startServer({ env: { IGN_MCP_EGRESS_HOSTS: hosts, IGN_MCP_NET_PRIVATE: 'host' } });
    c = P.client;
  });
  after(async () => {
    await P?.close();
    for (const r of slowOpen) r.destroy();
    srv.close();
    if (dir) fs.rmSync(dir, { recursive: true, force: true });
  });

  // busybox wget: 0, or 1 for any failure (a name that does not resolve too).
  const hello = (sid) => sh(c, sid, `wget -q -O - http://dl.test:${port}/hello 2>/dev/null; echo " rc=$?"`);

  test('widened, the sandbox reaches the host; narrowed, a download in flight is reset and recorded', T, async () => {
    const o = await call(c, 'open_session', {});
    const sid = o.session_id;
    const file = o.egress.egress_log_path;
    assert.match(await hello(sid), /^ rc=1$/m, 'network none: the name does not resolve');

    const w = await call(c, 'network_update', { session_id: sid, allow_hosts: [rule] });
    assert.equal(w.session_id, sid);
    assert.equal(w.mode, 'allow');
    assert.deepEqual(w.allowed_rules, [rule]);
    assert.deepEqual(w.previous, { mode: 'none', allowed_rules: [] });
    assert.equal(w.connections_reset, 0);
    assert.equal(await hello(sid), 'hello rc=0\n');

    // A download that goes on until something ends it.
    const seen = slowSeen;
    await sh(c, sid, `(wget -q -O /root/dl.out http://dl.test:${port}/slow; echo $? > /root/dl.rc) >/dev/null 2>&1 &`);
    assert.ok(await waitUntil(() => slowSeen > seen && slowOpen.size > 0, { timeoutMs: 30_000 }), 'the download never reached the server');
    const n = await call(c, 'network_update', { session_id: sid, network: 'none' });
    assert.equal(n.mode, 'none');
    assert.deepEqual(n.allowed_rules, []);
    assert.deepEqual(n.previous, { mode: 'allow', allowed_rules: [rule] });
    assert.equal(n.connections_reset, 1);
    // The server never stops sending: only the reset ends the download.
    let rc = '';
    assert.ok(await waitUntil(async () => (rc = await sh(c, sid, 'cat /root/dl.rc 2>/dev/null || true')) !== '', { timeoutMs: 60_000, intervalMs: 500 }), 'the download was not ended');
    assert.notEqual(rc.trim(), '0', 'the download completed');
    assert.ok(await waitUntil(() => slowOpen.size === 0, { timeoutMs: 10_000 }), 'the upstream connection stayed open');
    assert.match(await hello(sid), /^ rc=1$/m, 'network none again: the name does not resolve');

    // The record: the reset connection with its reason, in network_log and
    // in the log file, after the policy line that caused it.
    const log = await call(c, 'network_log', { session_id: sid });
    assert.equal(log.mode, 'none');
    const why = 'network_update: network is none';
    const conn = [...log.allowed, ...log.denied].find((x) => x.port === port && x.reason === why);
    assert.ok(conn, `no connection ended "${why}": ${JSON.stringify(log)}`);
    const lines = () => fs.readFileSync(file, 'utf8').trimEnd().split('\n').map((l) => JSON.parse(l));
    assert.ok(await waitUntil(() => fs.existsSync(file) && lines().some((l) => l.reason === why), { timeoutMs: 10_000 }), `${file} has no line "${why}"`);
    const all = lines();
    const policies = all.filter((l) => l.kind === 'policy');
    assert.deepEqual(policies.map((l) => [l.previous_mode, l.mode, l.allow_hosts]),
      [['none', 'allow', [rule]], ['allow', 'none', []]], JSON.stringify(policies));
    assert.ok(policies.every((l) => typeof l.ts_ms === 'number'));
    assert.ok(all.findIndex((l) => l.reason === why) > all.indexOf(policies[1]), 'the reset is recorded before the policy that caused it');
    await call(c, 'close', { session_id: sid });
  });

  test('"allow" alone keeps the hosts; a narrower rule list resets only what it no longer admits', T, async () => {
    const o = await call(c, 'open_session', { network: 'allow', allow_hosts: [rule, 'other.test:1'] });
    const sid = o.session_id;
    const k = await call(c, 'network_update', { session_id: sid, network: 'allow' });
    assert.deepEqual(k.allowed_rules, [rule, 'other.test:1']);
    assert.equal(k.connections_reset, 0);
    // A download; rules that still admit its host and port leave it be.
    await sh(c, sid, `(wget -q -O /dev/null http://dl.test:${port}/slow; echo $? > /root/a.rc) >/dev/null 2>&1 &`);
    assert.ok(await waitUntil(() => slowOpen.size > 0, { timeoutMs: 30_000 }), 'the download never reached the server');
    const m = await call(c, 'network_update', { session_id: sid, allow_hosts: [rule] });
    assert.equal(m.connections_reset, 0, 'a connection the new rules admit was reset');
    assert.equal(await sh(c, sid, 'cat /root/a.rc 2>/dev/null || echo running'), 'running\n');
    // The port rule gone: the download goes.
    const g = await call(c, 'network_update', { session_id: sid, allow_hosts: ['dl.test:1'] });
    assert.equal(g.connections_reset, 1);
    const log = await call(c, 'network_log', { session_id: sid });
    assert.ok([...log.allowed, ...log.denied].some((x) => x.port === port && x.reason === 'network_update: port not in allow_hosts'), JSON.stringify(log));
    await call(c, 'close', { session_id: sid });
  });

  test('bad arguments and more than IGN_MCP_NET allows are refused, and change nothing', T, async () => {
    const o = await call(c, 'open_session', { network: 'allow', allow_hosts: [rule] });
    const sid = o.session_id;
    const cases = [
      [{}, /nothing to change: send network/],
      [{ network: 'open' }, /network "open" is refused: this server runs with IGN_MCP_NET=allow/],
      [{ network: 'none', allow_hosts: [rule] }, /allow_hosts goes only with network "allow"/],
      [{ network: 'maybe' }, /'network' must be "none", "allow" \(with allow_hosts\) or "open"/],
      [{ allow_hosts: [] }, /network "allow" needs allow_hosts, a non-empty array/],
      [{ allow_hosts: ['10.0.0.1'] }, /allow_hosts/],
      [{ allow_hosts: 'dl.test' }, /'allow_hosts' must be an array/],
      [{ network: true }, /boolean form/],
      [{ secret: 'x' }, /network_update has no argument 'secret'/],
    ];
    for (const [args, re] of cases) {
      const e = await callErr(c, 'network_update', { session_id: sid, ...args });
      assert.match(e, re, `${JSON.stringify(args)}: ${e}`);
    }
    const log = await call(c, 'network_log', { session_id: sid });
    assert.equal(log.mode, 'allow');
    assert.deepEqual(log.allowed_rules, [rule]);
    assert.equal(await hello(sid), 'hello rc=0\n');
    // "allow" alone on a session without hosts has none to keep.
    const none = (await call(c, 'open_session', {})).session_id;
    assert.match(await callErr(c, 'network_update', { session_id: none, network: 'allow' }), /network "allow" needs allow_hosts \(the session's network is "none"/);
    assert.match(await callErr(c, 'network_update', { session_id: 'nope', network: 'none' }), /unknown session_id/);
    await call(c, 'close', { session_id: none });
    await call(c, 'close', { session_id: sid });
  });

  test('request rules given by network_update need no secrets: each request is read, one outside them refused', T, async () => {
    const sid = (await call(c, 'open_session', {})).session_id;
    const u = await call(c, 'network_update', { session_id: sid, allow_hosts: [`${rule} GET /hello`] });
    assert.deepEqual(u.allowed_rules, [`${rule} GET /hello`]);
    assert.equal(await hello(sid), 'hello rc=0\n');
    const seen = slowSeen;
    assert.equal(await sh(c, sid, `wget -q -O - http://dl.test:${port}/slow 2>&1; echo " rc=$?"`), 'wget: server returned error: HTTP/1.1 403 Forbidden\n rc=1\n');
    assert.equal(slowSeen, seen, 'a request outside the rules reached the server');
    await call(c, 'close', { session_id: sid });
  });

  test('a fork made after the change, and a session hibernated and resumed, keep the new policy', T, async () => {
    const sid = (await call(c, 'open_session', {})).session_id;
    await call(c, 'network_update', { session_id: sid, allow_hosts: [rule] });
    const f = await call(c, 'fork', { session_id: sid });
    const fid = f.sessions[0].session_id;
    const fl = await call(c, 'network_log', { session_id: fid });
    assert.equal(fl.mode, 'allow');
    assert.deepEqual(fl.allowed_rules, [rule]);
    assert.equal(await hello(fid), 'hello rc=0\n');
    // The source narrowed after the fork: the fork keeps its own.
    await call(c, 'network_update', { session_id: sid, network: 'none' });
    assert.equal(await hello(fid), 'hello rc=0\n');
    assert.match(await hello(sid), /^ rc=1$/m);
    // Hibernated with the widened policy, resumed with it.
    await call(c, 'hibernate', { session_id: fid });
    assert.equal(await hello(fid), 'hello rc=0\n');
    const rl = await call(c, 'network_log', { session_id: fid });
    assert.deepEqual([rl.mode, rl.allowed_rules], ['allow', [rule]]);
    await call(c, 'close', { session_id: fid });
    await call(c, 'close', { session_id: sid });
  });
});
