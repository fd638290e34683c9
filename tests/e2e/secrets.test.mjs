// secrets.test.mjs: credentials that never enter the sandbox (IGN_MCP_SECRETS),
// end to end on the real server (both backends, as root and as a user), with
// the outside world servers of this test on loopback: HTTPS with their own
// CA (given to the broker by IGN_MCP_EGRESS_CA) and HTTP, named by
// IGN_MCP_EGRESS_HOSTS.
//  - the sandbox holds a placeholder; the value reaches the secret's host in
//    a header, Basic credentials and the query, over HTTPS and HTTP;
//  - never another host: a placeholder in cleartext to another host, in a
//    DNS label, or of a secret not for the intercepted host is refused and
//    recorded; end-to-end TLS to another host carries only the placeholder;
//    a body is never rewritten;
//  - env, /proc/*/environ, results, the server's log and the flight record
//    show the placeholder only; each intercepted request is recorded;
//  - a program that does not trust the broker's CA fails and is recorded; an
//    upstream the host does not trust is answered 502; the CA key stays on
//    the host;
//  - network_update adds a secret; a fork keeps the placeholders;
//  - a bad secrets file stops the server naming the entry, never a value.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import http from 'node:http';
import https from 'node:https';
import http2 from 'node:http2';
import os from 'node:os';
import path from 'node:path';
import { startServer, startRaw, call, callErr, run, waitUntil, AGENT, TOOLS_SKIP, SERVER, serverEnv } from './lib.mjs';

const T = { timeout: 300_000 };
const VALUE = 'sk-live-Zq8vT3pW9xYk2NcR';
const OTHER_VALUE = 'gh-Hn4Lm7Qw2Rt9Yp3K';
const TOKEN_RE = /^ignph[0-9a-f]{32}$/;

function captureSkip() {
  const r = spawnSync(AGENT, ['--probe-egress'], { encoding: 'utf8', timeout: 20_000 });
  const line = `${r.stdout ?? ''}${r.stderr ?? ''}`.split('\n')[0];
  return r.status === 0 && line === 'ok' ? false : `a sandbox cannot capture its traffic here (${AGENT} --probe-egress: ${line || `status ${r.status}`})`;
}

function makeCert(dir, name, names) {
  const key = path.join(dir, `${name}.key`);
  const cert = path.join(dir, `${name}.pem`);
  execFileSync('openssl', ['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes',
    '-keyout', key, '-out', cert, '-days', '2', '-subj', `/CN=${names[0]}`,
    '-addext', `subjectAltName=${names.map((n) => `DNS:${n}`).join(',')}`, '-addext', 'basicConstraints=critical,CA:TRUE'],
  { stdio: 'pipe' });
  return { key: fs.readFileSync(key), cert: fs.readFileSync(cert), certPath: cert };
}

/* Every request a server got: method, url, host, headers, body. */
function recorder(seen) {
  return (req, res) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => {
      seen.push({ method: req.method, url: req.url, host: req.headers.host ?? req.headers[':authority'], version: req.httpVersion, headers: req.headers, body: Buffer.concat(chunks).toString() });
      if (req.url === '/early') { // a 103 before the answer
        res.writeEarlyHints({ link: '</a.css>; rel=preload' });
        return res.end('early ok\n');
      }
      if (req.url === '/mid') return res.end(Buffer.alloc(100_000, 'm'));
      if (req.url === '/cut') { // 1000 bytes of a body without a length, then the connection goes
        res.writeHead(200, { 'content-type': 'text/plain' });
        res.write('c'.repeat(1000));
        return setTimeout(() => (res.stream ? res.stream.close(http2.constants.NGHTTP2_INTERNAL_ERROR) : req.socket.destroy()), 100);
      }
      if (req.url === '/big') { // 8 MiB, more than any window or buffer on the way
        res.writeHead(200, { 'content-type': 'application/octet-stream' });
        const block = Buffer.alloc(1 << 20, 'x');
        for (let i = 0; i < 7; i++) res.write(block);
        return res.end(block);
      }
      if (req.url === '/echo') { // a server that echoes the request back
        res.writeHead(200, { 'x-echo': req.headers.authorization ?? '' });
        return res.end(`${req.headers.authorization}\n`);
      }
      if (req.url === '/echo-chunked') {
        res.writeHead(200, { 'content-type': 'text/plain' });
        res.write('you sent: ');
        return res.end(`${req.headers.authorization}\n`);
      }
      if (req.url.startsWith('/redirect')) {
        res.writeHead(302, { location: req.url.slice('/redirect?to='.length) });
        return res.end();
      }
      res.end('ok\n');
    });
  };
}

async function listen(server) {
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  return server.address().port;
}

describe('secrets', { skip: captureSkip() || TOOLS_SKIP }, () => {
  let dir, P, c, ports, seen, secretsFile, stderrOf;
  const servers = [];
  before(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-secrets-'));
    fs.chmodSync(dir, 0o755);
    const good = makeCert(dir, 'good', ['api.test', 'other.test']);
    const bad = makeCert(dir, 'bad', ['bad.test']);
    seen = { api: [], other: [] };
    // One HTTPS and one HTTP server per name (a host tells them apart), and
    // one HTTPS server with a certificate the broker does not trust.
    const mk = (tls, sink, cert) => (tls ? https.createServer(cert, recorder(sink)) : http.createServer(recorder(sink)));
    // And api.test over HTTP/2 only (ALPN h2, no HTTP/1.1).
    const h2 = http2.createSecureServer({ key: good.key, cert: good.cert, allowHTTP1: false }, recorder(seen.api));
    const s = [mk(true, seen.api, good), mk(false, seen.api), mk(true, seen.other, good), mk(false, seen.other), mk(true, [], bad), h2];
    servers.push(...s);
    const [aS, aH, oS, oH, bS, a2] = await Promise.all(s.map(listen));
    ports = { aS, aH, oS, oH, bS, a2 };
    const hosts = path.join(dir, 'hosts');
    fs.writeFileSync(hosts, '127.0.0.1 api.test other.test bad.test plain.test\n');
    fs.chmodSync(hosts, 0o644);
    secretsFile = path.join(dir, 'secrets.json');
    fs.writeFileSync(secretsFile, JSON.stringify({
      // cleartext: true lets its value go over plain HTTP (aH) too.
      API_TOKEN: { value: VALUE, hosts: [`api.test:${aS}`, `api.test:${aH}`, `api.test:${a2}`], cleartext: true },
      WEB_TOKEN: { value: 'web-only-over-tls-77', hosts: [`api.test:${aS}`, `api.test:${aH}`] },
      OTHER_TOKEN: { value: OTHER_VALUE, hosts: [`other.test:${oH}`] },
      BAD_TOKEN: { value: 'never-sent-anywhere-1', hosts: [`bad.test:${bS}`] },
    }), { mode: 0o600 });
    P = await startServer({ tools: true, env: {
      IGN_MCP_SECRETS: secretsFile, IGN_MCP_EGRESS_CA: good.certPath, IGN_MCP_EGRESS_HOSTS: hosts, IGN_MCP_NET_PRIVATE: 'host',
    } });
    c = P.client;
    stderrOf = () => P.stderrText();
  });
  after(async () => {
    await P?.close();
    for (const s of servers) s.close();
    if (dir) fs.rmSync(dir, { recursive: true, force: true });
  });

  const sh = async (sid, cmd, extra = {}) => {
    const r = await run(c, sid, cmd, { timeout_s: 60, ...extra });
    assert.ok(!JSON.stringify(r).includes(VALUE), `a result carries the value: ${JSON.stringify(r)}`);
    return r;
  };
  const noValueAnywhere = (what, text) => {
    assert.ok(!text.includes(VALUE) && !text.includes(OTHER_VALUE), `${what} holds a secret's value`);
  };
  const logLines = (file) => fs.readFileSync(file, 'utf8').trimEnd().split('\n').map((l) => JSON.parse(l));

  test('the sandbox holds a placeholder; the value reaches its host in a header, Basic credentials and the query, over HTTPS and HTTP', T, async () => {
    const o = await call(c, 'open_session', { secrets: ['API_TOKEN'], network: 'allow', allow_hosts: [`other.test:${ports.oS}`] });
    const sid = o.session_id;
    assert.equal(o.egress.mode, 'allow');
    assert.ok(o.egress.allowed_rules.includes(`api.test:${ports.aS}`), JSON.stringify(o.egress));
    const env = await sh(sid, 'echo "$API_TOKEN"; tr "\\0" "\\n" < /proc/$$/environ | grep "^API_TOKEN="');
    const [tok, fromProc] = env.stdout.trim().split('\n');
    assert.match(tok, TOKEN_RE);
    assert.equal(fromProc, `API_TOKEN=${tok}`);
    const before = seen.api.length;
    const cmds = [
      `curl -sS -H "Authorization: Bearer $API_TOKEN" https://api.test:${ports.aS}/bearer`,
      `curl -sS -u "me:$API_TOKEN" https://api.test:${ports.aS}/basic`,
      `curl -sS "https://api.test:${ports.aS}/query?key=$API_TOKEN&x=1"`,
      `curl -sS -H "X-Api-Key: $API_TOKEN" http://api.test:${ports.aH}/plain`,
      // Two requests in one curl: kept alive by curl, one per connection here.
      `curl -sS -H "X-Api-Key: $API_TOKEN" https://api.test:${ports.aS}/one https://api.test:${ports.aS}/two`,
    ];
    const r = await sh(sid, cmds.join(' && '));
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.stdout, 'ok\n'.repeat(6));
    noValueAnywhere('a file the sandbox wrote', (await sh(sid, `curl -sS -o /root/got -H "Authorization: Bearer $API_TOKEN" https://api.test:${ports.aS}/echo; cat /root/got`)).stdout);
    const got = seen.api.slice(before);
    const by = Object.fromEntries(got.map((x) => [x.url.split('?')[0], x]));
    assert.equal(by['/bearer'].headers.authorization, `Bearer ${VALUE}`);
    assert.equal(by['/basic'].headers.authorization, `Basic ${Buffer.from(`me:${VALUE}`).toString('base64')}`);
    assert.equal(by['/query'].url, `/query?key=${VALUE}&x=1`);
    assert.equal(by['/plain'].headers['x-api-key'], VALUE);
    assert.equal(by['/one'].headers['x-api-key'], VALUE);
    assert.equal(by['/two'].headers['x-api-key'], VALUE);
    // Echoed back: the value is masked on its way to the sandbox, in the head and the body.
    const stars = '*'.repeat(VALUE.length);
    const echo = await sh(sid, `curl -sS -D - -H "Authorization: Bearer $API_TOKEN" https://api.test:${ports.aS}/echo; curl -sS -H "Authorization: Bearer $API_TOKEN" https://api.test:${ports.aS}/echo-chunked`);
    assert.match(echo.stdout, new RegExp(`x-echo: Bearer \\*{${VALUE.length}}`, 'i'), echo.stdout);
    assert.ok(echo.stdout.includes(`\nBearer ${stars}\n`), echo.stdout);
    assert.ok(echo.stdout.includes(`you sent: Bearer ${stars}\n`), echo.stdout);
    // The flight record: one request line each, naming the secret, never its value.
    const file = o.egress.egress_log_path;
    assert.ok(await waitUntil(() => fs.existsSync(file) && logLines(file).filter((l) => l.kind === 'request').length >= 8, { timeoutMs: 10_000 }), 'request lines missing');
    const reqs = logLines(file).filter((l) => l.kind === 'request');
    for (const p of ['/bearer', '/basic', '/query', '/plain', '/one', '/two']) {
      const l = reqs.find((x) => x.path === p);
      assert.ok(l, `no request line for ${p}: ${JSON.stringify(reqs)}`);
      assert.deepEqual([l.method, l.host, l.status, l.allowed, l.secrets], ['GET', 'api.test', 200, true, ['API_TOKEN']]);
      assert.ok(l.bytes_up > 0 && l.bytes_down > 0);
    }
    noValueAnywhere('the flight record', fs.readFileSync(file, 'utf8'));
    noValueAnywhere('network_log', JSON.stringify(await call(c, 'network_log', { session_id: sid })));
    noValueAnywhere('the server\'s log', stderrOf());
    await call(c, 'close', { session_id: sid });
  });

  test('never another host: cleartext, DNS labels, another secret\'s host, a redirect, a body; end-to-end TLS carries only the placeholder', T, async () => {
    const o = await call(c, 'open_session', { secrets: ['API_TOKEN', 'OTHER_TOKEN', 'WEB_TOKEN'], network: 'allow', allow_hosts: [`other.test:${ports.oS}`, `plain.test:${ports.oH}`] });
    const sid = o.session_id;
    const file = o.egress.egress_log_path;
    const tok = (await sh(sid, 'echo "$API_TOKEN"')).stdout.trim();
    const other = seen.other.length;
    const api = seen.api.length;
    // other.test's own certificate, for the end-to-end connection below.
    await call(c, 'write_file', { session_id: sid, path: '/root/other.pem', content_base64: fs.readFileSync(path.join(dir, 'good.pem')).toString('base64') });
    await sh(sid, 'cat "$SSL_CERT_FILE" /root/other.pem > /root/both.pem');
    // Cleartext to other.test (intercepted for OTHER_TOKEN): API_TOKEN's
    // placeholder there is refused before anything reaches the server.
    const r1 = await sh(sid, `curl -sS -o /dev/null -w "%{http_code}" -H "X-Api-Key: $API_TOKEN" http://other.test:${ports.oH}/leak`);
    assert.equal(r1.stdout, '403');
    // DNS: a placeholder in a label, or split across two.
    const r2 = await sh(sid, 'getent hosts "$API_TOKEN.other.test" || echo refused; t=$API_TOKEN; getent hosts "$(echo $t | cut -c1-20).$(echo $t | cut -c21-).other.test" || echo refused');
    assert.equal(r2.stdout, 'refused\nrefused\n');
    // Another secret's placeholder in a header name, upper-cased, percent-encoded.
    for (const [what, args] of [['a header name', `-H "X-$OTHER_TOKEN: 1" https://api.test:${ports.aS}/hn`],
      ['upper case', `-H "X-K: $(echo $OTHER_TOKEN | tr a-z A-Z)" https://api.test:${ports.aS}/uc`],
      ['percent-encoded', `"https://api.test:${ports.aS}/pe?k=%69$(echo $OTHER_TOKEN | cut -c2-)"`]]) {
      const x = await sh(sid, `curl -sS -o /dev/null -w "%{http_code}" ${args}`);
      assert.equal(x.stdout, '403', `${what}: ${x.stdout} ${x.stderr}`);
    }
    assert.ok(!seen.api.slice(api).some((x) => ['/hn', '/uc'].includes(x.url) || x.url.startsWith('/pe')), 'a refused request reached api.test');
    // Cleartext to a host of no secret: looked through past its first
    // request; a placeholder 70 000 bytes into a body cuts the connection.
    const big = await sh(sid, `head -c 70000 /dev/zero | tr "\\0" a > /root/big; echo "$API_TOKEN" >> /root/big; curl -sS --data-binary @/root/big http://plain.test:${ports.oH}/big; echo " rc=$?"`);
    assert.doesNotMatch(big.stdout, / rc=0$/, big.stdout);
    assert.ok(!seen.other.slice(other).some((x) => x.url === '/big'), 'the body with a placeholder reached plain.test whole');
    // A secret without cleartext: never over plain HTTP, even to its host.
    const clear = await sh(sid, `curl -sS -o /dev/null -w "%{http_code}" -H "X-K: $WEB_TOKEN" http://api.test:${ports.aH}/clear`);
    assert.equal(clear.stdout, '403');
    // A body to its own host is not rewritten (the server gets the placeholder).
    await sh(sid, `curl -sS -d "tok=$API_TOKEN" https://api.test:${ports.aS}/body`);
    const body = seen.api.slice(api).find((x) => x.url === '/body');
    assert.equal(body?.body, `tok=${tok}`);
    // A redirect to another host with the credentials sent again
    // (--location-trusted): end-to-end TLS there, only the placeholder.
    const red = await sh(sid, `curl -sS --cacert /root/both.pem -L --location-trusted -H "Authorization: Bearer $API_TOKEN" "https://api.test:${ports.aS}/redirect?to=https://other.test:${ports.oS}/landed"`);
    assert.equal(red.stdout, 'ok\n', red.stderr);
    const landed = seen.other.slice(other).find((x) => x.url === '/landed');
    assert.ok(landed, 'the redirect did not land');
    assert.equal(landed.headers.authorization, `Bearer ${tok}`);
    // The body of a request to an intercepted host carrying another
    // secret's placeholder never reaches it whole.
    await sh(sid, `curl -sS -d "x=$OTHER_TOKEN" https://api.test:${ports.aS}/otherbody || true`);
    assert.ok(!seen.api.slice(api).some((x) => x.url === '/otherbody'), 'a body with another secret\'s placeholder reached the server');
    for (const x of seen.other.slice(other)) noValueAnywhere(`a request to ${x.host}${x.url}`, JSON.stringify(x));
    assert.ok(!seen.other.slice(other).some((x) => x.url === '/leak'), 'the refused request reached other.test');
    assert.ok(await waitUntil(() => fs.existsSync(file) && logLines(file).some((l) => /secret sent to a host it is not for/.test(l.reason ?? '') && l.kind === 'dns'), { timeoutMs: 10_000 }), 'no DNS refusal recorded');
    const lines = logLines(file);
    assert.ok(lines.some((l) => l.kind === 'request' && l.path === '/leak' && l.status === 403 && /secret sent to a host it is not for \(API_TOKEN/.test(l.reason)), JSON.stringify(lines.filter((l) => l.kind === 'request')));
    assert.ok(lines.some((l) => l.kind === 'request' && l.path === '/clear' && l.status === 403 && /secret not sent without TLS \(WEB_TOKEN/.test(l.reason)), JSON.stringify(lines.filter((l) => l.kind === 'request')));
    assert.ok(lines.some((l) => l.kind === 'connect' && l.host === 'plain.test' && l.reason === 'secret sent to a host it is not for'), 'the cut cleartext connection is not recorded');
    noValueAnywhere('the flight record', fs.readFileSync(file, 'utf8'));
    await call(c, 'close', { session_id: sid });
  });

  test('HTTP/2: with the sandbox, with the server, or both; the value goes, masked on the way back, and nowhere else', T, async () => {
    const o = await call(c, 'open_session', { secrets: ['API_TOKEN', 'OTHER_TOKEN'], network: 'allow', allow_hosts: [`api.test:${ports.a2} GET /rules/`] });
    const sid = o.session_id;
    const file = o.egress.egress_log_path;
    const v = await sh(sid, 'curl --version');
    assert.match(v.stdout, /HTTP2/, 'the tools image\'s curl speaks HTTP/2');
    const before = seen.api.length;
    // %{http_version} is what the sandbox spoke with the broker.
    const w = '-o /dev/null -w "%{http_version} %{http_code}\\n"';
    const cmds = [
      // h2 with the sandbox, HTTP/1.1 with a server that has no h2.
      `curl -sS --http2 ${w} -H "Authorization: Bearer $API_TOKEN" https://api.test:${ports.aS}/h2-to-h1`,
      // h2 both ways; HTTP/1.1 with the sandbox and h2 with the server.
      `curl -sS --http2 ${w} -H "X-Api-Key: $API_TOKEN" "https://api.test:${ports.a2}/rules/both?key=$API_TOKEN"`,
      `curl -sS --http1.1 ${w} -u "me:$API_TOKEN" https://api.test:${ports.a2}/rules/h1-to-h2`,
      // Two requests of one curl on one connection: the second comes on a new one.
      `curl -sS --http2 ${w} ${w} -H "X-Api-Key: $API_TOKEN" https://api.test:${ports.a2}/rules/one https://api.test:${ports.a2}/rules/two`,
    ];
    const r = await sh(sid, cmds.join(' && '));
    assert.equal(r.stdout, '2 200\n2 200\n1.1 200\n2 200\n2 200\n', r.stderr);
    const got = seen.api.slice(before);
    const by = Object.fromEntries(got.map((x) => [x.url.split('?')[0], x]));
    assert.equal(by['/h2-to-h1'].headers.authorization, `Bearer ${VALUE}`);
    assert.equal(by['/h2-to-h1'].version, '1.1');
    assert.equal(by['/rules/both'].headers['x-api-key'], VALUE);
    assert.equal(by['/rules/both'].url, `/rules/both?key=${VALUE}`);
    assert.equal(by['/rules/both'].version, '2.0');
    assert.equal(by['/rules/both'].host, `api.test:${ports.a2}`);
    assert.equal(by['/rules/h1-to-h2'].headers.authorization, `Basic ${Buffer.from(`me:${VALUE}`).toString('base64')}`);
    assert.equal(by['/rules/one'].headers['x-api-key'], VALUE);
    assert.equal(by['/rules/two'].headers['x-api-key'], VALUE);
    // Echoed back over h2 both ways: masked in the head and the body.
    const stars = '*'.repeat(VALUE.length);
    const echo = await sh(sid, `curl -sS --http2 -D - -H "Authorization: Bearer $API_TOKEN" https://api.test:${ports.a2}/rules/../echo --path-as-is; curl -sS --http2 -H "Authorization: Bearer $API_TOKEN" https://api.test:${ports.aS}/echo-chunked`);
    assert.match(echo.stdout, /^HTTP\/2 403/, 'a path that is not canonical is refused over h2 too');
    const echo2 = await call(c, 'open_session', { secrets: ['API_TOKEN'] });
    const e2 = await sh(echo2.session_id, `curl -sS --http2 -D - -H "Authorization: Bearer $API_TOKEN" https://api.test:${ports.a2}/echo`);
    assert.match(e2.stdout, /^HTTP\/2 200/, e2.stdout);
    assert.match(e2.stdout, new RegExp(`x-echo: Bearer \\*{${VALUE.length}}`, 'i'), e2.stdout);
    assert.ok(e2.stdout.includes(`\nBearer ${stars}\n`), e2.stdout);
    assert.ok(echo.stdout.includes(`you sent: Bearer ${stars}\n`), echo.stdout);
    // A body with no length (h2 DATA to the end of the stream), and 8 MiB
    // back through both gateways.
    const up = await sh(echo2.session_id, `printf 'line one\\nline two\\n' | curl -sS --http2 -T - -o /dev/null -w "%{http_code}" https://api.test:${ports.a2}/upload; curl -sS --http2 https://api.test:${ports.a2}/big | wc -c; curl -sS --http2 https://api.test:${ports.aS}/big | sha256sum | cut -c1-16`);
    const bigSum = (await import('node:crypto')).createHash('sha256').update(Buffer.alloc(8 << 20, 'x')).digest('hex').slice(0, 16);
    assert.equal(up.stdout, `200${8 << 20}\n${bigSum}\n`, up.stderr);
    assert.equal(seen.api.find((x) => x.url === '/upload')?.body, 'line one\nline two\n');
    await call(c, 'close', { session_id: echo2.session_id });
    // Refused over h2 as over HTTP/1.1, none reaching the server: another
    // secret's placeholder, another :authority, a request outside the rules.
    const n = seen.api.length;
    const code = async (args, want) => {
      const x = await sh(sid, `curl -sS -v --http2 -o /dev/null -w "%{http_code}" ${args}`);
      assert.equal(x.stdout, want, `curl ${args}: ${x.stderr}`);
    };
    await code(`-H "X-K: $OTHER_TOKEN" https://api.test:${ports.a2}/rules/leak`, '403');
    await code(`-H "Host: other.test:${ports.a2}" https://api.test:${ports.a2}/rules/authority`, '421');
    await code(`-X POST https://api.test:${ports.a2}/rules/post`, '403');
    await code(`https://api.test:${ports.a2}/outside`, '403');
    assert.deepEqual(seen.api.slice(n).map((x) => x.url), [], 'a refused request reached the server');
    assert.ok(await waitUntil(() => fs.existsSync(file) && logLines(file).some((l) => l.kind === 'request' && l.path === '/outside'), { timeoutMs: 10_000 }));
    const reqs = logLines(file).filter((l) => l.kind === 'request');
    assert.ok(reqs.some((l) => l.path === '/rules/both' && l.status === 200 && l.secrets.includes('API_TOKEN')), JSON.stringify(reqs));
    assert.ok(reqs.some((l) => l.path === '/rules/leak' && l.status === 403 && /secret sent to a host it is not for \(OTHER_TOKEN/.test(l.reason)), JSON.stringify(reqs));
    assert.ok(reqs.some((l) => l.path === '/rules/authority' && l.status === 421), JSON.stringify(reqs));
    assert.ok(reqs.some((l) => l.method === 'POST' && l.path === '/rules/post' && l.reason === 'request not in allow_hosts'), JSON.stringify(reqs));
    noValueAnywhere('the flight record', fs.readFileSync(file, 'utf8'));
    await call(c, 'close', { session_id: sid });
  });

  test('HTTP/2 at its edges: cookie crumbs, a 103 before the answer, a body cut short, a client that grants no window', T, async () => {
    const sid = (await call(c, 'open_session', { secrets: ['API_TOKEN'] })).session_id;
    await call(c, 'write_file', { session_id: sid, path: '/root/h2raw.py', content_base64: fs.readFileSync(new URL('./helpers/h2raw.py', import.meta.url)).toString('base64') });
    // Cookie crumbs with a field between them go up as one Cookie field, in
    // order; the connection ends with a GOAWAY after its one request.
    const n = seen.api.length;
    const ck = await sh(sid, `python3 /root/h2raw.py get api.test ${ports.a2} /crumbs cookie=a=1 x-mid=1 cookie=b=2`);
    assert.deepEqual(JSON.parse(ck.stdout || '{}'), { status200: true, body: 3, goaway: true }, ck.stderr);
    assert.equal(seen.api.slice(n).find((x) => x.url === '/crumbs')?.headers.cookie, 'a=1; b=2');
    // 103 Early Hints, then the answer: from an HTTP/2 server to either
    // protocol, and from an HTTP/1.1 server to an HTTP/2 client.
    const early = await sh(sid, `curl -sS --http2 https://api.test:${ports.a2}/early; curl -sS --http1.1 https://api.test:${ports.a2}/early; curl -sS --http2 https://api.test:${ports.aS}/early`);
    assert.equal(early.stdout, 'early ok\n'.repeat(3), early.stderr);
    // A body without a length cut short by the server is seen cut by the
    // program, whatever the protocols on either side (never a clean end).
    const cut = await sh(sid, `for p in --http1.1 --http2; do for port in ${ports.aS} ${ports.a2}; do curl -sS $p -o /dev/null https://api.test:$port/cut; echo "$p $port rc=$?"; done; done`);
    assert.equal((cut.stdout.match(/rc=0$/gm) ?? []).length, 0, `${cut.stdout}${cut.stderr}`);
    assert.equal((cut.stdout.match(/rc=\d+$/gm) ?? []).length, 4, cut.stdout);
    // A client that grants no window and only PINGs: its answer waits, and
    // the server does not spin meanwhile (its CPU over 3 s).
    const tck = Number(execFileSync('getconf', ['CLK_TCK'], { encoding: 'utf8' }));
    const cpu = () => fs.readFileSync(`/proc/${P.pid}/stat`, 'utf8').split(') ')[1].split(' ').slice(11, 13).reduce((a, x) => a + Number(x), 0) / tck;
    await call(c, 'write_file', { session_id: sid, path: '/root/hold.sh', content_base64: Buffer.from(`python3 /root/h2raw.py hold api.test ${ports.aS} /mid 4 > /root/hold.out 2>&1 &\n`).toString('base64') });
    const ready = await sh(sid, 'sh /root/hold.sh; for i in $(seq 600); do grep -q holding /root/hold.out && break; sleep 0.1; done; sleep 0.5; cat /root/hold.out');
    assert.match(ready.stdout, /^holding\n$/, ready.stderr);
    const c0 = cpu();
    await new Promise((r) => setTimeout(r, 2500));
    const spent = cpu() - c0;
    const held = await sh(sid, 'for i in $(seq 600); do grep -q held /root/hold.out && break; sleep 0.1; done; cat /root/hold.out');
    assert.match(held.stdout, /^holding\nheld \d+\n$/, held.stderr);
    assert.ok(spent < 1.5, `the server used ${spent.toFixed(2)} s of CPU in 2.5 s while one client held its window shut`);
    await call(c, 'close', { session_id: sid });
  });

  test('a program that does not trust the broker\'s CA fails and is recorded; an untrusted upstream is 502; the CA key stays on the host', T, async () => {
    const o = await call(c, 'open_session', { secrets: ['API_TOKEN', 'BAD_TOKEN'] });
    const sid = o.session_id;
    const file = o.egress.egress_log_path;
    const pinned = await sh(sid, `curl -sS --cacert /dev/null --capath /nonexistent https://api.test:${ports.aS}/pinned; echo "rc=$?"`);
    assert.match(pinned.stdout, /rc=(60|77|35)/, pinned.stderr);
    const bad = await sh(sid, `curl -sS -w " %{http_code}" https://bad.test:${ports.bS}/x`);
    assert.match(bad.stdout, /upstream certificate not trusted.* 502$/s, bad.stdout);
    assert.ok(await waitUntil(() => fs.existsSync(file) && logLines(file).filter((l) => l.kind === 'request').length >= 2, { timeoutMs: 10_000 }));
    const reqs = logLines(file).filter((l) => l.kind === 'request');
    assert.ok(reqs.some((l) => l.host === 'api.test' && /TLS with the program failed/.test(l.reason)), JSON.stringify(reqs));
    assert.ok(reqs.some((l) => l.host === 'bad.test' && l.status === 502 && /upstream certificate not trusted/.test(l.reason)), JSON.stringify(reqs));
    // The CA: its certificate in the sandbox's bundle, its key only on the host (0600).
    const ca = await sh(sid, 'grep -c "ignition-mcp egress CA" "$SSL_CERT_FILE"');
    assert.equal(ca.stdout, '1\n', ca.stderr);
    const keys = await sh(sid, 'grep -rl "PRIVATE KEY" /etc /root /tmp /var /run 2>/dev/null | head -3; echo end');
    assert.equal(keys.stdout, 'end\n', `a private key in the sandbox: ${keys.stdout}`);
    await call(c, 'close', { session_id: sid });
  });

  test('network_update gives a session a secret; a fork keeps its placeholders', T, async () => {
    const sid = (await call(c, 'open_session', {})).session_id;
    assert.equal((await sh(sid, 'echo "[$API_TOKEN]"')).stdout, '[]\n');
    const u = await call(c, 'network_update', { session_id: sid, secrets: ['API_TOKEN'] });
    assert.equal(u.mode, 'allow');
    assert.ok(u.allowed_rules.includes(`api.test:${ports.aS}`));
    const tok = (await sh(sid, 'echo "$API_TOKEN"')).stdout.trim();
    assert.match(tok, TOKEN_RE);
    const before = seen.api.length;
    assert.equal((await sh(sid, `curl -sS -H "X-Api-Key: $API_TOKEN" https://api.test:${ports.aS}/updated`)).stdout, 'ok\n');
    assert.equal(seen.api.slice(before).find((x) => x.url === '/updated')?.headers['x-api-key'], VALUE);
    const f = await call(c, 'fork', { session_id: sid });
    const fid = f.sessions[0].session_id;
    assert.equal((await sh(fid, 'echo "$API_TOKEN"')).stdout.trim(), tok);
    assert.equal((await sh(fid, `curl -sS -H "X-Api-Key: $API_TOKEN" https://api.test:${ports.aS}/forked`)).stdout, 'ok\n');
    assert.equal(seen.api.find((x) => x.url === '/forked')?.headers['x-api-key'], VALUE);
    // Taken away while a connection to its host is open and not yet used:
    // that connection is reset, and its request never reaches the server.
    const py = `import os,socket,ssl,time
ctx = ssl.create_default_context(cafile=os.environ['SSL_CERT_FILE'])
s = ctx.wrap_socket(socket.create_connection(('api.test', ${ports.aS})), server_hostname='api.test')
open('/root/ready', 'w').close()
while not os.path.exists('/root/go'): time.sleep(0.05)
try:
    s.sendall(b'GET /revoked HTTP/1.1\\r\\nHost: api.test\\r\\nX-K: ' + os.environ['API_TOKEN'].encode() + b'\\r\\n\\r\\n')
    print('got', s.recv(100))
except Exception as e:
    print('reset', type(e).__name__)
`;
    await call(c, 'write_file', { session_id: sid, path: '/root/held.py', content_base64: Buffer.from(py).toString('base64') });
    await sh(sid, '(python3 /root/held.py > /root/held.out 2>&1 &) ; for i in $(seq 100); do [ -e /root/ready ] && break; sleep 0.1; done; ls /root/ready');
    const rv = await call(c, 'network_update', { session_id: sid, secrets: [] });
    assert.equal(rv.connections_reset, 1);
    await sh(sid, 'touch /root/go; for i in $(seq 100); do [ -s /root/held.out ] && break; sleep 0.1; done');
    assert.match((await sh(sid, 'cat /root/held.out')).stdout, /^(reset|got b'')/);
    assert.ok(!seen.api.some((x) => x.url === '/revoked'), 'a request on a connection opened before the secret was taken away reached the server');
    // Taken away: the placeholder is gone from new commands, and the host's rule with it.
    const n = await call(c, 'network_update', { session_id: sid, network: 'none', secrets: [] });
    assert.equal(n.mode, 'none');
    assert.equal((await sh(sid, 'echo "[$API_TOKEN]"')).stdout, '[]\n');
    const e = await callErr(c, 'network_update', { session_id: sid, secrets: ['NOPE'] });
    assert.match(e, /secrets\[0\] "NOPE" is not a secret this server holds/);
    await call(c, 'close', { session_id: fid });
    await call(c, 'close', { session_id: sid });
  });

  test('request rules: a request outside every rule for its host is answered 403 and recorded, over HTTPS and HTTP', T, async () => {
    const o = await call(c, 'open_session', { network: 'allow', allow_hosts: [`api.test:${ports.aS} GET /allowed/`, `api.test:${ports.aH} POST /up`, `other.test:${ports.oS}`] });
    const sid = o.session_id;
    const file = o.egress.egress_log_path;
    assert.ok(o.egress.allowed_rules.includes(`api.test:${ports.aS} GET /allowed/`), JSON.stringify(o.egress));
    const code = async (args) => (await sh(sid, `curl -sS -o /dev/null -w "%{http_code}" ${args}`)).stdout;
    const before = seen.api.length;
    assert.equal(await code(`https://api.test:${ports.aS}/allowed/x?q=1`), '200');
    assert.equal(await code(`-X POST https://api.test:${ports.aS}/allowed/x`), '403');
    assert.equal(await code(`https://api.test:${ports.aS}/other`), '403');
    assert.equal(await code(`--path-as-is https://api.test:${ports.aS}/allowed/../other`), '403');
    assert.equal(await code(`https://api.test:${ports.aS}/allowed/%2e%2e/other`), '403');
    assert.equal(await code(`-d x=1 http://api.test:${ports.aH}/up/load`), '200');
    assert.equal(await code(`http://api.test:${ports.aH}/up/load`), '403');
    // A host with a plain rule is not read (end-to-end TLS: curl needs its CA).
    await call(c, 'write_file', { session_id: sid, path: '/root/other.pem', content_base64: fs.readFileSync(path.join(dir, 'good.pem')).toString('base64') });
    assert.equal(await code(`--cacert /root/other.pem https://other.test:${ports.oS}/anything`), '200');
    const got = seen.api.slice(before).map((x) => `${x.method} ${x.url}`);
    assert.deepEqual(got.sort(), ['GET /allowed/x?q=1', 'POST /up/load'].sort(), 'a refused request reached the server');
    assert.ok(await waitUntil(() => fs.existsSync(file) && logLines(file).filter((l) => l.kind === 'request').length >= 7, { timeoutMs: 10_000 }));
    const reqs = logLines(file).filter((l) => l.kind === 'request');
    assert.ok(reqs.some((l) => l.method === 'POST' && l.path === '/allowed/x' && l.status === 403 && l.reason === 'request not in allow_hosts'), JSON.stringify(reqs));
    assert.ok(reqs.some((l) => l.path === '/allowed/../other' && l.status === 403 && /path not canonical/.test(l.reason)), JSON.stringify(reqs));
    assert.ok(reqs.some((l) => l.method === 'GET' && l.path === '/allowed/x' && l.status === 200 && l.allowed === true && l.secrets.length === 0));
    // A secret for the host does not lift its request rules.
    const both = (await call(c, 'open_session', { secrets: ['API_TOKEN'], network: 'allow', allow_hosts: [`api.test:${ports.aS} GET /allowed/`] })).session_id;
    assert.equal((await sh(both, `curl -sS -o /dev/null -w "%{http_code}" -X POST -H "X-K: $API_TOKEN" https://api.test:${ports.aS}/allowed/x`)).stdout, '403');
    assert.equal((await sh(both, `curl -sS -o /dev/null -w "%{http_code}" -H "X-K: $API_TOKEN" https://api.test:${ports.aS}/allowed/y`)).stdout, '200');
    await call(c, 'close', { session_id: both });
    // Refused as a rule: a method that is not one, a path that is not canonical.
    for (const bad of ['api.test get /x', 'api.test GET /a/../b']) {
      const e = await callErr(c, 'open_session', { network: 'allow', allow_hosts: [bad] });
      assert.match(e, /allow_hosts\[0\]/, e);
    }
    await call(c, 'close', { session_id: sid });
  });

  test('bad secrets files stop the server, naming the entry and never a value', T, async () => {
    const cases = [
      [{ mode: 0o644, json: { A: { value: 'top-secret-v1', hosts: ['a.test'] } } }, /IGN_MCP_SECRETS=.*no one else may read or write/],
      [{ json: { A: { value: 'top-secret-v2', hosts: [] } } }, /entry A: hosts must hold 1 to/],
      [{ json: { 'bad-name': { value: 'top-secret-v3', hosts: ['a.test'] } } }, /the name of an entry is not one/],
      [{ json: { B: { value: 'top-secret-v4', hosts: ['a.test'], extra: 1 } } }, /entry B must be/],
      [{ text: '{"C": {"value": "top-secret-v5", "hosts": ["a.test"]' }, /is not valid JSON \(line 1, column \d+\)/],
      [{ json: { D: { value: 'top\nsecret-v6', hosts: ['a.test'] } } }, /entry D: the value must be 1 to/],
    ];
    for (const [k, [spec, re]] of cases.entries()) {
      const f = path.join(dir, `bad${k}.json`);
      fs.writeFileSync(f, spec.text ?? JSON.stringify(spec.json), { mode: spec.mode ?? 0o600 });
      fs.chmodSync(f, spec.mode ?? 0o600);
      const r = spawnSync(SERVER, [], { env: { ...serverEnv({ env: { IGN_MCP_SECRETS: f } }) }, input: '', encoding: 'utf8', timeout: 60_000 });
      assert.notEqual(r.status, 0, `case ${k}: the server ran`);
      assert.match(r.stderr, re, `case ${k}`);
      assert.doesNotMatch(r.stderr, /top-?\\?n?secret-v/, `case ${k}: a value in the message: ${r.stderr}`);
    }
  });
});
