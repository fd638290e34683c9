// owner.test.mjs: session ids that name their host (IGN_MCP_HOST_ID), so a
// front proxy can route a call to the server that holds its session, and an
// id of another host is answered with that host's name, never as an unknown
// id; and sessions and stages that belong to their HTTP bearer token: two
// tokens on one server, each blind to the other's (skipped, saying so, on a
// server without the HTTP transport).  The session table's own check of
// owners also runs for real in tests/unit/test_session.c.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import {
  startServer, call, callErr, openSession, sh, serverEnv, uniq, SERVER, REPO, NS_ONLY,
} from './lib.mjs';
import { startHttp } from './helpers/http.mjs';

const T = { timeout: 120_000 };

/* The tools that take a session_id, with the other arguments each needs. */
const BY_ID = [
  ['run', { command: 'true' }],
  ['write_file', { path: '/tmp/x', content_base64: '' }],
  ['read_file', { path: '/etc/hostname' }],
  ['reset', {}],
  ['close', {}],
  ['hibernate', {}],
  ['commit', { name: 'owner-test/x' }],
  ['fork', {}],
  ['copy_in', { host_path: 'README.md', guest_path: '/tmp/r' }],
  ['copy_out', { host_path: 'build/owner-test-out', guest_path: '/etc/hostname' }],
  ['network_log', {}],
  ['network_update', { network: 'none' }],
];

describe('host ids', () => {
  test('IGN_MCP_HOST_ID=h1: every id the server mints starts with "h1."; the id works as any other', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_HOST_ID: 'h1' } });
    t.after(() => s.close());
    const id = await openSession(s.client);
    assert.match(id, /^h1\.s\d+-[0-9a-f]{4}$/);
    assert.equal((await sh(s.client, id, 'echo hi')).trim(), 'hi');
    const l = await call(s.client, 'list_sessions', {});
    assert.deepEqual(l.sessions.map((x) => x.session_id), [id]);
    const f = await call(s.client, 'fork', { session_id: id, count: 2 });
    for (const x of f.sessions) assert.match(x.session_id, /^h1\.s\d+-[0-9a-f]{4}$/);
    const r = await call(s.client, 'reset', { session_id: id });
    assert.equal(r.session_id, id);
    await call(s.client, 'close', { session_id: id });
    assert.match(s.stderrText(), /host id h1 \(IGN_MCP_HOST_ID\)/);
  });

  test('an id of host h2 sent to h1 names h2 and the header a proxy routes on, for every tool', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_HOST_ID: 'h1' } });
    t.after(() => s.close());
    for (const [tool, args] of BY_ID) {
      const e = await callErr(s.client, tool, { session_id: 'h2.s1-0000', ...args });
      assert.match(e, /session 'h2\.s1-0000' is held by host 'h2', not this host 'h1'/, `${tool}: ${e}`);
      assert.match(e, /send calls for it to h2/, `${tool}: ${e}`);
      assert.match(e, /Mcp-Param-Session-Id/, `${tool}: ${e}`);
      assert.doesNotMatch(e, /unknown session_id/, `${tool}: ${e}`);
    }
  });

  test('an id of this host that is not open, or with a malformed host part, is an unknown id', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_HOST_ID: 'h1' } });
    t.after(() => s.close());
    for (const id of ['h1.s99-ffff', 'H2.s1-0000', 'h_2.s1-0000', 's1-0000', 'abcdefghijklmnopq.s1-0000']) {
      const e = await callErr(s.client, 'run', { session_id: id, command: 'true' });
      assert.match(e, new RegExp(`unknown session_id '${id.replace(/\./g, '\\.')}'`), e);
      assert.doesNotMatch(e, /held by host/, e);
    }
  });

  test('without IGN_MCP_HOST_ID: ids have no host part, and an id with one names its host', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_HOST_ID: '' } });
    t.after(() => s.close());
    const id = await openSession(s.client);
    assert.match(id, /^s\d+-[0-9a-f]{4}$/);
    const e = await callErr(s.client, 'run', { session_id: 'h2.s1-0000', command: 'true' });
    assert.match(e, /held by host 'h2', not this server \(it has no IGN_MCP_HOST_ID\)/, e);
    await call(s.client, 'close', { session_id: id });
  });

  test('an invalid IGN_MCP_HOST_ID stops the server at startup, naming the rule', T, () => {
    for (const bad of ['H1', '1h', 'h_1', 'h.1', 'a0123456789abcdef']) {
      const r = spawnSync(SERVER, [], {
        env: serverEnv({ env: { IGN_MCP_HOST_ID: bad } }),
        input: '',
        encoding: 'utf8',
        cwd: REPO,
        timeout: 30_000,
      });
      assert.notEqual(r.status, 0, `IGN_MCP_HOST_ID=${bad} was accepted`);
      assert.match(r.stderr, new RegExp(`IGN_MCP_HOST_ID=${bad.replace(/\./g, '\\.')} is invalid`), r.stderr);
      assert.match(r.stderr, /1 to 16 characters of a-z, 0-9 and -, starting with a letter/, r.stderr);
    }
  });
});

/* ---- owners: two bearer tokens on one HTTP server ---- */

const HTTP = /--http/.test(spawnSync(SERVER, ['--help'], { encoding: 'utf8' }).stdout ?? '');
const NO_HTTP = HTTP ? false : 'this server has no HTTP transport (--http); tests/unit/test_session.c checks owners';

/* A server on 127.0.0.1:0 (helpers/http.mjs) with a tokens file of TOKENS
 * ({name: token}); stopped, and checked, after the test. */
async function startOwners(t, tokens, env = {}) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-owner-'));
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  const file = path.join(dir, 'tokens');
  fs.writeFileSync(file, Object.entries(tokens).map(([n, tok]) => `${n}:${tok}\n`).join(''), { mode: 0o600 });
  const srv = await startHttp({ env: { IGN_MCP_HTTP_TOKENS: file, ...env } });
  srv.clients = [];
  /* The clients go first: the server is then left with nothing open. */
  t.after(async () => {
    for (const c of srv.clients) await c.close().catch(() => {});
    await srv.close();
  });
  return srv;
}

async function clientFor(srv, token) {
  const client = new Client({ name: 'ign-e2e-owner', version: '0.0.1' }, { capabilities: {} });
  const transport = new StreamableHTTPClientTransport(srv.url, {
    requestInit: { headers: { Authorization: `Bearer ${token}` } },
  });
  await client.connect(transport);
  srv.clients.push(client);
  return client;
}

/* The unknown-id message for ID, with the id taken out: what an id nobody
 * opened gets. */
const shape = (msg, id) => msg.split(id).join('<id>');

describe('owners: two bearer tokens on one server', { skip: NO_HTTP }, () => {
  const TOKENS = { alice: 'alice-token-0123456789abcdef', bob: 'bob-token-0123456789abcdef0' };

  test('a token cannot run in, read, write, reset, close, commit, fork, copy or list another token\'s session', T, async (t) => {
    const srv = await startOwners(t, TOKENS, { IGN_MCP_HOST_ID: 'h1' });
    const alice = await clientFor(srv, TOKENS.alice);
    const bob = await clientFor(srv, TOKENS.bob);
    const a = await openSession(alice);
    assert.match(a, /^h1\.s/);
    await sh(alice, a, 'echo secret > /root/note');
    /* What bob gets for an id nobody opened, to compare with. */
    const never = shape(await callErr(bob, 'run', { session_id: 'h1.s999-0000', command: 'true' }), 'h1.s999-0000');
    for (const [tool, args] of BY_ID) {
      const e = await callErr(bob, tool, { session_id: a, ...args });
      assert.match(e, /unknown session_id/, `${tool}: ${e}`);
      if (tool === 'run') assert.equal(shape(e, a), never, 'run: not the words of an id nobody opened');
      assert.doesNotMatch(e, /secret|alice/, `${tool}: ${e}`);
    }
    const bl = await call(bob, 'list_sessions', {});
    assert.ok(!bl.sessions.some((x) => x.session_id === a), JSON.stringify(bl));
    /* Hibernated, it is as much alice's: bob neither resumes nor closes it. */
    await call(alice, 'hibernate', { session_id: a });
    for (const [tool, args] of BY_ID) {
      const e = await callErr(bob, tool, { session_id: a, ...args });
      assert.match(e, /unknown session_id/, `hibernated, ${tool}: ${e}`);
    }
    assert.equal((await call(alice, 'list_sessions', {})).sessions.find((x) => x.session_id === a)?.state, 'hibernated');
    assert.ok(!(await call(bob, 'list_sessions', {})).sessions.some((x) => x.session_id === a));
    /* Alice's session is untouched by all that (and resumes for her). */
    assert.equal((await sh(alice, a, 'cat /root/note')).trim(), 'secret');
    const al = await call(alice, 'list_sessions', {});
    assert.ok(al.sessions.some((x) => x.session_id === a));
    /* Bob's own session is his, and alice cannot close it. */
    const b = await openSession(bob);
    assert.match(await callErr(alice, 'close', { session_id: b }), /unknown session_id/);
    await call(bob, 'close', { session_id: b });
    await call(alice, 'close', { session_id: a });
    assert.match(srv.stderrText(), new RegExp(`session ${a.replace('.', '\\.')} opened for token alice`));
  });

  test('a token that fills the server\'s count of hibernated sessions does not keep another from hibernating; the server\'s oldest (the filler\'s) goes back to the store, whole, and nobody learns the other\'s ids', { ...T, skip: NS_ONLY('sixteen hibernations are quick on ns') }, async (t) => {
    const srv = await startOwners(t, TOKENS, { IGN_MCP_MAX_SESSIONS: 1 });
    const alice = await clientFor(srv, TOKENS.alice);
    const bob = await clientFor(srv, TOKENS.bob);
    const bobs = [];
    for (let i = 0; i < 8; i++) {
      const b = await openSession(bob);
      bobs.push(b);
      await call(bob, 'hibernate', { session_id: b });
    }
    const a = await openSession(alice);
    assert.equal((await call(alice, 'hibernate', { session_id: a })).state, 'hibernated');
    const bl = await call(bob, 'list_sessions', {});
    assert.deepEqual(bl.sessions.map((x) => x.session_id).sort(), [...bobs].sort());
    assert.deepEqual(bl.sessions.filter((x) => x.on_store).map((x) => x.session_id), [bobs[0]], JSON.stringify(bl));
    assert.deepEqual(bl.recently_closed, []);
    assert.ok(!JSON.stringify(bl).includes(a), 'bob learns alice\'s id');
    const al = await call(alice, 'list_sessions', {});
    assert.deepEqual(al.recently_closed, []);
    assert.ok(!bobs.some((b) => JSON.stringify(al).includes(b)), 'alice learns bob\'s ids');
    assert.equal(await sh(alice, a, 'echo back'), 'back\n');
    // Bob's oldest comes back when he calls it; taking it lets another of
    // the server's oldest go back to the store, never Alice's own.
    await call(alice, 'hibernate', { session_id: a });
    assert.equal(await sh(bob, bobs[0], 'echo mine'), 'mine\n');
    await call(bob, 'hibernate', { session_id: bobs[0] }); // one running at a time here
    assert.equal(await sh(alice, a, 'echo still'), 'still\n');
    for (const b of bobs) await call(bob, 'close', { session_id: b });
    assert.deepEqual((await call(bob, 'list_sessions', {})).sessions, []);
  });

  test('a token cannot see, open, reset to, remove or take the name of another token\'s stage', T, async (t) => {
    const srv = await startOwners(t, TOKENS);
    const alice = await clientFor(srv, TOKENS.alice);
    const bob = await clientFor(srv, TOKENS.bob);
    const name = `${uniq('owner')}/st`;
    const a = await openSession(alice);
    await sh(alice, a, 'echo from-alice > /root/mark');
    const c = await call(alice, 'commit', { session_id: a, name });
    assert.equal(c.stage, name);

    const bl = await call(bob, 'stage_list', {});
    assert.ok(!bl.stages.some((x) => x.name === name), JSON.stringify(bl));
    assert.match(await callErr(bob, 'stage_info', { name }), /no stage named/);
    assert.match(await callErr(bob, 'open_session', { stage: name }), /no stage named/);
    assert.match(await callErr(bob, 'sandbox_run', { command: 'cat /root/mark', stage: name }), /no stage named/);
    const b = await openSession(bob);
    assert.match(await callErr(bob, 'reset', { session_id: b, stage: name }), /no stage named/);
    for (const replace of [false, true]) {
      const e = await callErr(bob, 'commit', { session_id: b, name, replace });
      assert.match(e, /is taken/, e);
      assert.match(e, /pick another name/, e);
      assert.doesNotMatch(e, new RegExp(c.stage_id), e);
    }
    const r = await call(bob, 'sandbox_run', { command: 'true', commit_as: name });
    assert.match(JSON.stringify(r), /taken/, JSON.stringify(r));
    assert.match(await callErr(bob, 'stage_rm', { name }), /no stage named/);

    /* Alice still has it as she made it. */
    const info = await call(alice, 'stage_info', { name });
    assert.equal(info.stage_id, c.stage_id);
    const a2 = await call(alice, 'open_session', { stage: name });
    assert.equal((await sh(alice, a2.session_id, 'cat /root/mark')).trim(), 'from-alice');
    await call(alice, 'close', { session_id: a2.session_id });
    await call(alice, 'close', { session_id: a });
    await call(bob, 'close', { session_id: b });
    await call(alice, 'stage_rm', { name });
  });
});
