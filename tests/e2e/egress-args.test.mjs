// egress-args.test.mjs: the network arguments and settings, as the client
// and the operator see them (docs/egress-design.md): open_session's and
// sandbox_run's `network` and `allow_hosts` (what is refused, and how it is
// said), the modes IGN_MCP_NET allows, the old IGN_MCP_NET=1 refused at
// startup, the egress summary of open_session, the egress field of run and
// sandbox_run, and network_log (an empty record for a fresh session; an id
// that is not the caller's is an unknown id).  What the broker does with
// real connections is tests/e2e/egress-bypass.test.mjs.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { startServer, call, callErr, SERVER } from './lib.mjs';
import { startHttp, runServer } from './helpers/http.mjs';

const T = { timeout: 120_000 };

/* The lists of an egress report with nothing in them. */
function assertEmptyReport(e, mode, what) {
  assert.ok(e && typeof e === 'object', `${what}: no egress field`);
  assert.equal(e.mode, mode, `${what}: ${JSON.stringify(e)}`);
  for (const k of ['allowed', 'denied', 'dns_queries']) assert.deepEqual(e[k], [], `${what}: ${k}: ${JSON.stringify(e)}`);
}

describe('network arguments (IGN_MCP_NET=allow, the default)', () => {
  let s, c;
  before(async () => {
    s = await startServer();
    c = s.client;
  });
  after(() => s.close());

  for (const tool of ['open_session', 'sandbox_run']) {
    const base = tool === 'sandbox_run' ? { command: 'true' } : {};

    test(`${tool}: a network that is not one of the three strings is refused, naming them`, T, async () => {
      for (const network of [true, false, 1, 'yes', 'ALLOW', '', ['allow'], { mode: 'allow' }]) {
        const e = await callErr(c, tool, { ...base, network });
        assert.match(e, new RegExp(`^${tool}: 'network' must be (a string, )?"none", "allow"`), `${JSON.stringify(network)}: ${e}`);
      }
      /* A boolean (the old form) says what to send instead. */
      for (const network of [true, false]) {
        const e = await callErr(c, tool, { ...base, network });
        assert.match(e, /the boolean form \(true\/false\) is gone: send "allow" with allow_hosts/, e);
      }
      assert.match(await callErr(c, tool, { ...base, network: 'yes' }), /, not "yes"$/);
      assert.match(await callErr(c, tool, { ...base, network: 1 }), /, not an integer$/);
    });

    test(`${tool}: allow_hosts only with network "allow", and not empty there`, T, async () => {
      for (const args of [{ allow_hosts: ['pypi.org'] }, { network: 'none', allow_hosts: ['pypi.org'] }]) {
        const e = await callErr(c, tool, { ...base, ...args });
        assert.match(e, new RegExp(`^${tool}: allow_hosts goes only with network "allow" \\(network is "none"\\)`), `${JSON.stringify(args)}: ${e}`);
      }
      for (const args of [{ network: 'allow' }, { network: 'allow', allow_hosts: [] }, { network: 'allow', allow_hosts: null }]) {
        const e = await callErr(c, tool, { ...base, ...args });
        assert.match(e, new RegExp(`^${tool}: network "allow" needs allow_hosts, a non-empty array of host names`), `${JSON.stringify(args)}: ${e}`);
      }
      for (const network of ['allow', 'none']) {
        const e = await callErr(c, tool, { ...base, network, allow_hosts: 'pypi.org' });
        assert.match(e, new RegExp(`^${tool}: 'allow_hosts' must be an array of host names .*, not a string$`), e);
      }
    });

    test(`${tool}: a bad allow_hosts entry is named by its index`, T, async () => {
      for (const [bad, i] of [[['pypi.org', '93.184.216.34'], 1], [['*.com'], 0], [['a.b', 'ok.example', 'bad host'], 2], [['pypi.org', 7], 1]]) {
        const e = await callErr(c, tool, { ...base, network: 'allow', allow_hosts: bad });
        assert.match(e, new RegExp(`^${tool}: allow_hosts\\[${i}\\] `), `${JSON.stringify(bad)}: ${e}`);
      }
    });

    test(`${tool}: network "open" is over IGN_MCP_NET=allow: refused, naming both`, T, async () => {
      const e = await callErr(c, tool, { ...base, network: 'open' });
      assert.match(e, new RegExp(`^${tool}: network "open" is refused: this server runs with IGN_MCP_NET=allow`), e);
    });
  }

  test('open_session: the egress summary says the mode and the rules; none by default', T, async () => {
    const d = await call(c, 'open_session', {});
    assert.equal(d.egress?.mode, 'none', JSON.stringify(d.egress));
    const a = await call(c, 'open_session', { network: 'allow', allow_hosts: ['pypi.org', '*.pythonhosted.org:443', 'PyPI.org'] });
    assert.equal(a.egress.mode, 'allow', JSON.stringify(a.egress));
    assert.ok(a.egress.allowed_rules.includes('pypi.org'), JSON.stringify(a.egress));
    assert.ok(a.egress.allowed_rules.includes('*.pythonhosted.org:443'), JSON.stringify(a.egress));
    assert.match(a.egress.egress_log_path ?? '', new RegExp(a.session_id.replace(/\./g, '\\.')), JSON.stringify(a.egress));
    /* The explicit none is the default. */
    const n = await call(c, 'open_session', { network: 'none' });
    assert.equal(n.egress.mode, 'none');
    /* A reset keeps the policy. */
    const r = await call(c, 'reset', { session_id: a.session_id });
    assert.equal(r.egress.mode, 'allow', JSON.stringify(r.egress));
    for (const x of [d, a, n]) await call(c, 'close', { session_id: x.session_id });
  });

  test('network_log of a fresh session: empty lists; run and sandbox_run carry an egress field', T, async () => {
    const id = (await call(c, 'open_session', { network: 'allow', allow_hosts: ['pypi.org'] })).session_id;
    const log = await call(c, 'network_log', { session_id: id });
    assertEmptyReport(log, 'allow', 'network_log');
    assert.deepEqual(log.allowed_rules, ['pypi.org']);
    const r = await call(c, 'run', { session_id: id, command: 'true' });
    assertEmptyReport(r.egress, 'allow', 'run');
    const sr = await call(c, 'sandbox_run', { command: 'true' });
    assertEmptyReport(sr.egress, 'none', 'sandbox_run');
    const sa = await call(c, 'sandbox_run', { command: 'true', network: 'allow', allow_hosts: ['pypi.org'] });
    assertEmptyReport(sa.egress, 'allow', 'sandbox_run (allow)');
    await call(c, 'close', { session_id: id });
  });

  test('network_log: an id nobody opened, or no id, is refused as for every session tool', T, async () => {
    assert.match(await callErr(c, 'network_log', { session_id: 's999-0000' }), /unknown session_id 's999-0000'/);
    assert.match(await callErr(c, 'network_log', {}), /session_id/);
    assert.match(await callErr(c, 'network_log', { session_id: 's1-0000', since: 1 }), /network_log has no argument 'since'/);
  });
});

describe('IGN_MCP_NET bounds what sessions may ask', () => {
  test('IGN_MCP_NET=off: only none; allow is refused naming IGN_MCP_NET, none opens', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_NET: 'off' } });
    t.after(() => s.close());
    const e = await callErr(s.client, 'open_session', { network: 'allow', allow_hosts: ['pypi.org'] });
    assert.match(e, /^open_session: network "allow" is refused: this server runs with IGN_MCP_NET=off/, e);
    const e2 = await callErr(s.client, 'sandbox_run', { command: 'true', network: 'allow', allow_hosts: ['pypi.org'] });
    assert.match(e2, /^sandbox_run: network "allow" is refused: this server runs with IGN_MCP_NET=off/, e2);
    const d = await call(s.client, 'open_session', {});
    assert.equal(d.egress.mode, 'none');
    /* tools/list offers what the server allows. */
    const tools = (await s.client.listTools()).tools;
    const open = tools.find((x) => x.name === 'open_session');
    assert.deepEqual(open.inputSchema.properties.network.enum, ['none']);
    assert.equal(tools.find((x) => x.name === 'run').annotations.openWorldHint, false);
    await call(s.client, 'close', { session_id: d.session_id });
  });

  test('IGN_MCP_NET=open: open is accepted; tools/list says so', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_NET: 'open' } });
    t.after(() => s.close());
    const o = await call(s.client, 'open_session', { network: 'open' });
    assert.equal(o.egress.mode, 'open');
    const tools = (await s.client.listTools()).tools;
    assert.deepEqual(tools.find((x) => x.name === 'open_session').inputSchema.properties.network.enum, ['none', 'allow', 'open']);
    assert.equal(tools.find((x) => x.name === 'run').annotations.openWorldHint, true);
    await call(s.client, 'close', { session_id: o.session_id });
  });

  test('the startup line names the policy', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_NET: 'allow' } });
    t.after(() => s.close());
    assert.match(s.stderrText(), /egress: IGN_MCP_NET=allow \(sessions may ask/);
  });

  test('the old IGN_MCP_NET=1 (or any other value) stops the server, saying user-mode networking is gone and what to set', T, async () => {
    for (const v of ['1', 'on', 'true', 'user']) {
      const r = await runServer([], { env: { IGN_MCP_NET: v } });
      assert.equal(r.code, 2, `IGN_MCP_NET=${v}: ${r.stderr}`);
      assert.match(r.stderr, new RegExp(`IGN_MCP_NET=${v} is invalid: user-mode networking is gone`), r.stderr);
      assert.match(r.stderr, /off, allow \(the default[^)]*\) or open/, r.stderr);
    }
  });

  test('the other settings are checked at startup: IGN_MCP_NET_PRIVATE, IGN_MCP_EGRESS_HOSTS, the caps', T, async () => {
    const rows = [
      [{ IGN_MCP_NET_PRIVATE: 'yes' }, /IGN_MCP_NET_PRIVATE=yes is invalid: use 1 .* or 0/],
      [{ IGN_MCP_EGRESS_HOSTS: '/nonexistent/hosts' }, /IGN_MCP_EGRESS_HOSTS=\/nonexistent\/hosts is invalid: give an existing file/],
      [{ IGN_MCP_EGRESS_STREAMS: '0' }, /IGN_MCP_EGRESS_STREAMS=0 is invalid: give a whole number from 1 to 1024/],
      [{ IGN_MCP_EGRESS_MAX_MB: 'x' }, /IGN_MCP_EGRESS_MAX_MB=x is invalid/],
      [{ IGN_MCP_EGRESS_LOG_CAP: '-1' }, /IGN_MCP_EGRESS_LOG_CAP=-1 is invalid/],
    ];
    for (const [env, want] of rows) {
      const r = await runServer([], { env });
      assert.equal(r.code, 2, `${JSON.stringify(env)}: ${r.stderr}`);
      assert.match(r.stderr, want, r.stderr);
    }
  });

  test('a hosts file that exists is taken', T, async (t) => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-egress-hosts-'));
    t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
    const hosts = path.join(dir, 'hosts');
    fs.writeFileSync(hosts, '127.0.0.1 good.test\n');
    const s = await startServer({ env: { IGN_MCP_EGRESS_HOSTS: hosts } });
    t.after(() => s.close());
    const d = await call(s.client, 'open_session', { network: 'allow', allow_hosts: ['good.test'] });
    assert.equal(d.egress.mode, 'allow');
    await call(s.client, 'close', { session_id: d.session_id });
  });
});

/* ---- owners: network_log of another token's session ---- */

const HTTP = /--http/.test(spawnSync(SERVER, ['--help'], { encoding: 'utf8' }).stdout ?? '');

describe('network_log and owners', { skip: HTTP ? false : 'this server has no HTTP transport (--http)' }, () => {
  test('a token cannot read another token\'s network_log: it is an unknown id', T, async (t) => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-egress-owner-'));
    t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
    const tokens = { alice: 'alice-token-0123456789abcdef', bob: 'bob-token-0123456789abcdef0' };
    const file = path.join(dir, 'tokens');
    fs.writeFileSync(file, Object.entries(tokens).map(([n, tok]) => `${n}:${tok}\n`).join(''), { mode: 0o600 });
    const srv = await startHttp({ env: { IGN_MCP_HTTP_TOKENS: file } });
    const clients = [];
    t.after(async () => {
      for (const cl of clients) await cl.close().catch(() => {});
      await srv.close();
    });
    const clientFor = async (token) => {
      const cl = new Client({ name: 'ign-e2e-egress', version: '0.0.1' }, { capabilities: {} });
      await cl.connect(new StreamableHTTPClientTransport(srv.url, { requestInit: { headers: { Authorization: `Bearer ${token}` } } }));
      clients.push(cl);
      return cl;
    };
    const alice = await clientFor(tokens.alice);
    const bob = await clientFor(tokens.bob);
    const a = (await call(alice, 'open_session', { network: 'allow', allow_hosts: ['secret-host.example'] })).session_id;
    const e = await callErr(bob, 'network_log', { session_id: a });
    assert.match(e, /unknown session_id/, e);
    assert.doesNotMatch(e, /secret-host|alice/, e);
    const own = await call(alice, 'network_log', { session_id: a });
    assert.deepEqual(own.allowed_rules, ['secret-host.example']);
    await call(alice, 'close', { session_id: a });
  });
});
