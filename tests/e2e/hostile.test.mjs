// hostile.test.mjs: malformed and hostile input through MCP, as a table.
//
// One server (raw stdio, so that any bytes can be sent) serves the whole
// table. Every case sends its bytes and states the outcome it must get: a
// JSON-RPC error with a given code and a message that says what was wrong,
// a tool result with isError and a message that says what was wrong and what
// to do, a normal result, or no response at all (notifications). After every
// case the test checks that
//   - no other response came for it (a ping sent after the case is answered
//     after every inline response, so the count is exact),
//   - the server keeps serving: ping, and a real `run echo ok` in a session,
//   - everything on stdout so far is well-formed JSON-RPC 2.0;
// and around the table that the server's memory stays bounded (below).
//
// The tool cases are partly generated from tools/list: for every property
// of every tool's inputSchema, a value of each JSON type the schema does not
// allow; every required argument left out; an unknown argument.
//
// Memory: the test server is the ASan build. ASan keeps freed blocks in a
// quarantine (256 MiB by default) so that use-after-free is caught, which
// would make RSS measure the sanitizer, not the server; this server runs
// with quarantine_size_mb=0 (leak and overflow checks stay on). The bounds:
//   - while an 80 MiB line streams in, RSS grows by less than 96 MiB: the
//     line reader holds at most IGN_MCP_MAX_MESSAGE (64 MiB) of a line before
//     it gives up on it, plus the old half of its buffer while it grows;
//   - once the big cases are over (and at the end of the table), RSS is
//     less than 64 MiB above where it started: nothing of them is kept.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { startRaw, textOf, vmRssKiB, sleep, IS_VM, assertNoSanitizerReport, REPO } from './lib.mjs';

const T = { timeout: 120_000 };
const NL = Buffer.from('\n');
const MiB = 1 << 20;
const ASAN = [process.env.ASAN_OPTIONS || 'abort_on_error=0:detect_leaks=1', 'quarantine_size_mb=0'].join(':');
const MAX_STDIN = 8 * MiB; // the defaults this server runs with
const MAX_FILE = 32 * MiB;
const MAX_MESSAGE = 64 * MiB;

/* The schemas come from the server itself, so that a new argument gets its
 * wrong-type cases without anyone writing them. */
const schemaServer = startRaw({ env: { IGN_MCP_BACKEND: 'ns' } });
await schemaServer.initialize();
const TOOLS = (await schemaServer.request('tools/list', {})).result.tools;
await schemaServer.close();

let raw; // the server of the table
let sid; // a session that lives through the whole table
const rss = {};

/* ---- helpers ---- */

const j = (o) => JSON.stringify(o);
const req = (id, method, params) => j({ jsonrpc: '2.0', id, method, ...(params === undefined ? {} : { params }) });
const callLine = (id, name, args) => req(id, 'tools/call', { name, arguments: args });
/* Values filled in when a case runs (the session id exists only then). */
const SID = '\u0001SID\u0001';
const fill = (s) => s.split(j(SID)).join(j(sid));

/* Well-formed JSON-RPC 2.0 from a server: a notification, or a response
 * with an id and exactly one of result and error {code: integer, message:
 * non-empty string}. */
function assertWellFormed(m, raw) {
  assert.ok(m && typeof m === 'object' && !Array.isArray(m), `not an object: ${raw}`);
  assert.equal(m.jsonrpc, '2.0', `jsonrpc is not "2.0": ${raw.slice(0, 300)}`);
  if ('method' in m) {
    assert.equal(typeof m.method, 'string', raw.slice(0, 300));
    assert.ok(!('id' in m), `a server notification with an id: ${raw.slice(0, 300)}`);
    return;
  }
  assert.ok('id' in m, `a response without id: ${raw.slice(0, 300)}`);
  assert.ok(['string', 'number'].includes(typeof m.id) || m.id === null, `bad id: ${raw.slice(0, 300)}`);
  assert.equal('result' in m, !('error' in m), `needs exactly one of result and error: ${raw.slice(0, 300)}`);
  if ('error' in m) {
    assert.ok(Number.isInteger(m.error.code), raw.slice(0, 300));
    assert.equal(typeof m.error.message, 'string', raw.slice(0, 300));
    assert.ok(m.error.message.length > 10, `an error message that says nothing: ${raw.slice(0, 300)}`);
  }
}

const isResponse = (m) => 'id' in m && ('result' in m || 'error' in m);

/* Wait for a message entry (from index `from`) matching pred(entry). */
async function waitEntry(pred, from, what, timeoutMs = 60_000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const e = raw.messages.slice(from).find(pred);
    if (e) return e;
    if (raw.exited()) assert.fail(`server exited (${j(raw.exited())}) waiting for ${what}; stderr:\n${raw.stderrText().slice(-3000)}`);
    if (Date.now() > deadline) assert.fail(`no ${what} within ${timeoutMs} ms; got ${j(raw.since(from)).slice(0, 1000)}`);
    await sleep(5);
  }
}

/* What to do: every tool error says it (the case may give a sharper regex). */
const TODO = /\b(give|use|send|call|pass|put|write|split|remove|encode|must be|its arguments are|read)\b/i;

let caseNo = 0;

/* Send a case, check its outcome, then that the server still serves. */
async function runCase(c) {
  const n = ++caseNo;
  const from = raw.messages.length;
  const e = c.expect;
  let got = null;
  if (c.custom) {
    await c.custom();
  } else {
    let bytes = typeof c.send === 'function' ? c.send() : c.send;
    if (typeof bytes === 'string') bytes = Buffer.from(fill(bytes));
    await raw.sendBytes(Buffer.concat([bytes, NL]));
    if (e.none) {
      // nothing to wait for; the ping below proves nothing came
    } else if ('rawId' in e) {
      got = await waitEntry((x) => isResponse(x.msg) && new RegExp(`"id":${e.rawId}[,}]`).test(x.raw), from, `response with id ${e.rawId}`);
    } else {
      const id = e.id === undefined ? null : e.id;
      got = await waitEntry((x) => isResponse(x.msg) && j(x.msg.id) === j(id), from, `response with id ${j(id)}`);
    }
  }
  if (got) {
    const m = got.msg;
    if (e.code !== undefined) {
      assert.ok(m.error, `${c.name}: expected error ${e.code}, got ${got.raw.slice(0, 400)}`);
      assert.equal(m.error.code, e.code, `${c.name}: ${got.raw.slice(0, 400)}`);
      assert.match(m.error.message, e.msg, `${c.name}: message does not say what was wrong`);
      if (e.maxLen) assert.ok(got.raw.length <= e.maxLen, `${c.name}: a ${got.raw.length} byte error for a hostile message`);
    } else if (e.tool) {
      assert.ok(m.result, `${c.name}: expected a tool error result, got ${got.raw.slice(0, 400)}`);
      assert.equal(m.result.isError, true, `${c.name}: expected isError, got ${got.raw.slice(0, 400)}`);
      const t = textOf(m.result);
      assert.match(t, e.tool, `${c.name}: the error does not say what was wrong`);
      assert.match(t, e.todo ?? TODO, `${c.name}: the error does not say what to do: ${t}`);
    } else if (e.ok) {
      assert.ok(m.result, `${c.name}: expected a result, got ${got.raw.slice(0, 400)}`);
      assert.notEqual(m.result.isError, true, `${c.name}: ${textOf(m.result)}`);
      if (e.check) e.check(m.result);
    }
  }
  await assertServing(`after case ${n} (${c.name})`, from, c.custom ? null : e.none ? 0 : 1);
  if (c.post) c.post();
}

/* The server answers a ping and runs a command; nothing but well-formed
 * JSON-RPC on stdout; `expected` responses (if not null) between `from`
 * and the ping. */
async function assertServing(what, from, expected) {
  assert.equal(raw.exited(), null, `${what}: the server died; stderr:\n${raw.stderrText().slice(-3000)}`);
  const pingId = `ping-${what}`;
  const p = await raw.request('ping', undefined, { id: pingId, timeoutMs: 30_000 });
  assert.deepEqual(p.result, {}, `${what}: ping`);
  if (expected !== null) {
    const upto = raw.messages.findIndex((x, i) => i >= from && x.msg.id === pingId);
    const resp = raw.messages.slice(from, upto).filter((x) => isResponse(x.msg));
    assert.equal(resp.length, expected, `${what}: expected ${expected} response(s), got ${j(resp.map((x) => x.raw.slice(0, 200)))}`);
  }
  const r = await raw.callTool('run', { session_id: sid, command: 'echo ok' }, { timeoutMs: 60_000 });
  assert.equal(r.result?.isError, false, `${what}: run echo ok: ${j(r).slice(0, 500)}`);
  assert.equal(r.result.structuredContent.stdout, 'ok\n', `${what}: run echo ok`);
  assert.deepEqual(raw.badLines, [], `${what}: stdout carried something that is not JSON-RPC`);
  for (const x of raw.messages.slice(from)) assertWellFormed(x.msg, x.raw);
}

/* ---- the table ---- */

const BIG_ID = '123456789012345678901234567890';
const deepArrays = () => Buffer.from('['.repeat(100_000) + ']'.repeat(100_000));
const deepObjects = () => Buffer.from('{"a":'.repeat(100_000) + '1' + '}'.repeat(100_000));

/* run with one argument replaced, or write_file / read_file. */
const run = (id, extra) => callLine(id, 'run', { session_id: SID, command: 'echo hostile', ...extra });
const wf = (id, extra) => callLine(id, 'write_file', { session_id: SID, path: '/root/hostile.bin', content_base64: 'aGk=', ...extra });
const rf = (id, extra) => callLine(id, 'read_file', { session_id: SID, path: '/root/hostile.txt', ...extra });

const CASES = [
  // -- not JSON at all
  { name: 'truncated JSON', send: '{"jsonrpc":"2.0","id":1,"method":"pi', expect: { code: -32700, msg: /parse error at byte \d+/ } },
  { name: 'truncated after a complete key', send: '{"jsonrpc":"2.0","id":', expect: { code: -32700, msg: /parse error/ } },
  { name: 'single-quoted JSON', send: "{'jsonrpc':'2.0','id':1,'method':'ping'}", expect: { code: -32700, msg: /parse error.*(invalid|string)/ } },
  { name: 'trailing comma', send: '{"jsonrpc":"2.0","id":1,"method":"ping",}', expect: { code: -32700, msg: /parse error/ } },
  { name: 'two messages on one line', send: `${req(1, 'ping')} ${req(2, 'ping')}`, expect: { code: -32700, msg: /end of file expected/ } },
  { name: 'bare word', send: 'ping', expect: { code: -32700, msg: /invalid token/ } },
  { name: 'NaN is not JSON', send: '{"jsonrpc":"2.0","id":NaN,"method":"ping"}', expect: { code: -32700, msg: /invalid token/ } },
  // -- invalid UTF-8
  { name: 'invalid UTF-8: a lone 0xff', send: Buffer.from([0x7b, 0xff, 0x7d]), expect: { code: -32700, msg: /unable to decode byte 0xff/ } },
  { name: 'invalid UTF-8 in a string', send: Buffer.concat([Buffer.from('{"jsonrpc":"2.0","id":"'), Buffer.from([0xc3, 0x28]), Buffer.from('","method":"ping"}')]), expect: { code: -32700, msg: /unable to decode byte 0xc3/ } },
  { name: 'invalid UTF-8: overlong encoding of /', send: Buffer.concat([Buffer.from('["'), Buffer.from([0xc0, 0xaf]), Buffer.from('"]')]), expect: { code: -32700, msg: /unable to decode byte/ } },
  { name: 'invalid UTF-8: a UTF-16 surrogate', send: Buffer.concat([Buffer.from('["'), Buffer.from([0xed, 0xa0, 0x80]), Buffer.from('"]')]), expect: { code: -32700, msg: /unable to decode byte/ } },
  { name: 'invalid UTF-8: a sequence cut at the end of the line', send: Buffer.concat([Buffer.from('"abc'), Buffer.from([0xe2, 0x82])]), expect: { code: -32700, msg: /unable to decode byte|premature end/ } },
  // -- NUL
  { name: 'a NUL byte between tokens', send: Buffer.from('{"jsonrpc":"2.0",\0"id":1,"method":"ping"}'), expect: { code: -32700, msg: /parse error/ } },
  { name: 'a raw NUL byte inside a string', send: Buffer.from('{"jsonrpc":"2.0","id":"a\0b","method":"ping"}'), expect: { code: -32700, msg: /control character 0x0/ } },
  { name: 'a NUL byte after a complete message', send: Buffer.from(`${req(3, 'ping')}\0`), expect: { code: -32700, msg: /end of file expected/ } },
  { name: '\\u0000 in the method: "ping\\u0000x" is not ping', send: '{"jsonrpc":"2.0","id":4,"method":"ping\\u0000x"}', expect: { id: 4, code: -32600, msg: /"method" string contains a NUL/ } },
  { name: '\\u0000 in the jsonrpc version', send: '{"jsonrpc":"2.0\\u0000x","id":5,"method":"ping"}', expect: { id: 5, code: -32600, msg: /"jsonrpc": "2\.0"/ } },
  { name: '\\u0000 in a tool name: "list_sessions\\u0000x" is not list_sessions', send: '{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"name":"list_sessions\\u0000x","arguments":{}}}', expect: { id: 6, code: -32602, msg: /params\.name contains a NUL/ } },
  { name: '\\u0000 in an object key', send: '{"jsonrpc":"2.0","id":7,"method":"ping","params":{"a\\u0000b":1}}', expect: { code: -32700, msg: /NUL byte in object key/ } },
  { name: '\\u0000 in a command', send: run(8, { command: 'echo a\u0000rm -rf /' }), expect: { id: 8, tool: /'command' contains a NUL character/, todo: /remove it/ } },
  { name: '\\u0000 in a path', send: wf(9, { path: '/root/a\u0000b' }), expect: { id: 9, tool: /'path' contains a NUL character/, todo: /remove it/ } },
  { name: 'a path that is one NUL', send: rf(10, { path: '\u0000' }), expect: { id: 10, tool: /'path' contains a NUL character/, todo: /remove it/ } },
  { name: '\\u0000 in an env value', send: run(11, { env: { A: 'x\u0000y' } }), expect: { id: 11, tool: /values cannot contain NUL/, todo: /must be|cannot/ } },
  // -- size and depth
  {
    name: 'an 80 MiB line (over IGN_MCP_MAX_MESSAGE) is refused without being buffered',
    custom: async () => {
      const from = raw.messages.length;
      const before = vmRssKiB(raw.pid);
      const hwmBefore = vmRssKiB(raw.pid, 'VmHWM');
      await raw.sendBytes(Buffer.from(`{"jsonrpc":"2.0","id":"big","method":"tools/call","params":{"name":"run","arguments":{"session_id":${j(sid)},"command":"echo SHOULD-NOT-RUN","stdin":"`));
      const chunk = Buffer.alloc(MiB, 0x61);
      let peak = before;
      for (let i = 0; i < 80; i++) {
        await raw.sendBytes(chunk);
        if (i % 8 === 0) peak = Math.max(peak, vmRssKiB(raw.pid));
      }
      await raw.sendBytes(Buffer.from('"}}}\n'));
      // Answered with its own id (found while the line was dropped).
      const e = await waitEntry((x) => isResponse(x.msg) && x.msg.id === 'big', from, 'the size error');
      assert.equal(e.msg.error.code, -32600, e.raw);
      assert.match(e.msg.error.message, new RegExp(`message too large: over \\d+ bytes \\(IGN_MCP_MAX_MESSAGE is ${MAX_MESSAGE}\\).*discarded`));
      assert.match(e.msg.error.message, /in pieces/, 'the error says what to do');
      await assertServing('after the 80 MiB line', from, 1);
      assert.ok(!raw.messages.some((x) => x.msg.id === 'big' && 'result' in x.msg), 'the request inside the oversize line was executed');
      // The HWM only counts if it was reached now (it is a lifetime maximum).
      const hwm = vmRssKiB(raw.pid, 'VmHWM');
      peak = Math.max(peak, hwm > hwmBefore ? hwm : 0);
      rss.bigPeakGrowth = (peak - before) / 1024;
      await sleep(500);
      rss.afterBig = vmRssKiB(raw.pid);
      assert.ok(rss.bigPeakGrowth < 96, `RSS grew by ${rss.bigPeakGrowth.toFixed(1)} MiB while an 80 MiB line came in (bound 96 MiB)`);
      const settled = (rss.afterBig - rss.before) / 1024;
      assert.ok(settled < 64, `RSS stayed ${settled.toFixed(1)} MiB above its start after the 80 MiB line (bound 64 MiB)`);
    },
  },
  { name: '100k-deep nested arrays', send: deepArrays, expect: { code: -32700, msg: /maximum parsing depth reached/ } },
  {
    name: '100k-deep nested objects {"a":{"a":...',
    send: deepObjects,
    expect: { code: -32700, msg: /maximum parsing depth reached/ },
    post: () => {
      rss.afterDeep = vmRssKiB(raw.pid);
      const growth = (rss.afterDeep - rss.before) / 1024;
      assert.ok(growth < 64, `RSS is ${growth.toFixed(1)} MiB above its start after the deep nesting (bound 64 MiB)`);
    },
  },
  { name: 'deep nesting inside tool arguments', send: () => Buffer.from(`{"jsonrpc":"2.0","id":12,"method":"tools/call","params":{"name":"run","arguments":{"session_id":"x","command":${'['.repeat(50_000)}${']'.repeat(50_000)}}}}`), expect: { code: -32700, msg: /maximum parsing depth reached/ } },
  { name: '2 million tiny values in one 4 MiB line (parsed, they would take hundreds of MiB)', send: () => Buffer.from(`{"jsonrpc":"2.0","id":13,"method":"ping","params":{"a":[${'0,'.repeat(2 * MiB)}0]}}`), expect: { code: -32600, msg: /more than 100000 JSON values/ } },
  { name: 'an unknown method with a 1 MiB name gets a short error', send: () => req(14, 'x'.repeat(MiB)), expect: { id: 14, code: -32601, msg: /method 'x{100}' not found/, maxLen: 1000 } },
  { name: 'an unknown tool with a 1 MiB name gets a short error', send: () => callLine(15, 'y'.repeat(MiB), {}), expect: { id: 15, code: -32602, msg: /unknown tool 'y{100}'.*tools\/list/, maxLen: 1000 } },
  // A message quotes at most 100 bytes of a name; a character cut there must
  // not cost the answer (found by fuzz_tool_args: the reply was never sent).
  { name: 'an unknown method whose 100th byte is inside a UTF-8 character', send: () => req(16, 'm'.repeat(99) + '\ud375'.repeat(3)), expect: { id: 16, code: -32601, msg: /method 'm{99}\ufffd' not found/ } },
  { name: 'an unknown tool whose 100th byte is inside a UTF-8 character', send: () => callLine(17, 't'.repeat(99) + '\u00e9', {}), expect: { id: 17, code: -32602, msg: /unknown tool 't{99}\ufffd'/ } },
  { name: 'an unknown argument whose 100th byte is inside a UTF-8 character', send: () => callLine(18, 'run', { ['a'.repeat(99) + '\ud375']: 1 }), expect: { id: 18, tool: /run has no argument 'a{99}\ufffd'/, todo: /its arguments are/ } },
  { name: 'an env name whose 100th byte is inside a UTF-8 character', send: () => callLine(19, 'run', { session_id: 'x', command: 'true', env: { ['e'.repeat(99) + '\ud375']: 1 } }), expect: { id: 19, tool: /env\['e{99}\ufffd'\] must be a string/ } },
  // -- batches and non-requests
  { name: 'an empty batch', send: '[]', expect: { code: -32600, msg: /batches are not supported/ } },
  { name: 'a batch of two pings is refused, neither runs', send: `[${req(16, 'ping')},${req(17, 'ping')}]`, expect: { code: -32600, msg: /batches are not supported.*one JSON-RPC message per line/ } },
  { name: 'a batch of a tool call is refused, it does not run', send: `[${callLine(18, 'list_sessions', {})}]`, expect: { code: -32600, msg: /batches are not supported/ } },
  { name: 'a number', send: '42', expect: { code: -32600, msg: /must be a JSON object/ } },
  { name: 'a string', send: '"ping"', expect: { code: -32600, msg: /must be a JSON object/ } },
  { name: 'null', send: 'null', expect: { code: -32600, msg: /must be a JSON object/ } },
  { name: 'an empty object', send: '{}', expect: { code: -32600, msg: /"jsonrpc": "2\.0"/ } },
  { name: 'a response to a request the server never sent', send: '{"jsonrpc":"2.0","id":"never-sent","result":{}}', expect: { none: true } },
  { name: 'an error response to a request the server never sent', send: '{"jsonrpc":"2.0","id":19,"error":{"code":1,"message":"x"}}', expect: { none: true } },
  // -- jsonrpc, method, params
  { name: 'jsonrpc missing', send: '{"id":20,"method":"ping"}', expect: { id: 20, code: -32600, msg: /"jsonrpc": "2\.0"/ } },
  { name: 'jsonrpc "1.0"', send: '{"jsonrpc":"1.0","id":21,"method":"ping"}', expect: { id: 21, code: -32600, msg: /"jsonrpc": "2\.0"/ } },
  { name: 'jsonrpc as the number 2.0', send: '{"jsonrpc":2.0,"id":22,"method":"ping"}', expect: { id: 22, code: -32600, msg: /"jsonrpc": "2\.0"/ } },
  { name: 'method missing', send: '{"jsonrpc":"2.0","id":23}', expect: { id: 23, code: -32600, msg: /needs a "method" string/ } },
  { name: 'method a number', send: '{"jsonrpc":"2.0","id":24,"method":5}', expect: { id: 24, code: -32600, msg: /needs a "method" string/ } },
  { name: 'method null', send: '{"jsonrpc":"2.0","id":25,"method":null}', expect: { id: 25, code: -32600, msg: /needs a "method" string/ } },
  { name: 'method an array', send: '{"jsonrpc":"2.0","id":26,"method":["ping"]}', expect: { id: 26, code: -32600, msg: /needs a "method" string/ } },
  { name: 'method an object', send: '{"jsonrpc":"2.0","id":27,"method":{"name":"ping"}}', expect: { id: 27, code: -32600, msg: /needs a "method" string/ } },
  { name: 'params an array', send: '{"jsonrpc":"2.0","id":28,"method":"ping","params":[1]}', expect: { id: 28, code: -32602, msg: /params must be an object/ } },
  { name: 'params a string', send: '{"jsonrpc":"2.0","id":29,"method":"tools/list","params":"x"}', expect: { id: 29, code: -32602, msg: /params must be an object/ } },
  { name: 'params null', send: '{"jsonrpc":"2.0","id":30,"method":"ping","params":null}', expect: { id: 30, code: -32602, msg: /params must be an object/ } },
  { name: 'duplicate keys: "method" twice', send: '{"jsonrpc":"2.0","id":31,"method":"nope","method":"ping"}', expect: { code: -32700, msg: /duplicate object key/ } },
  { name: 'duplicate keys inside tool arguments', send: '{"jsonrpc":"2.0","id":32,"method":"tools/call","params":{"name":"run","arguments":{"session_id":"a","session_id":"b","command":"true"}}}', expect: { code: -32700, msg: /duplicate object key/ } },
  { name: 'tools/call without params', send: req(33, 'tools/call'), expect: { id: 33, code: -32602, msg: /needs params\.name/ } },
  { name: 'tools/call with a numeric name', send: req(34, 'tools/call', { name: 7 }), expect: { id: 34, code: -32602, msg: /needs params\.name/ } },
  { name: 'tools/call with arguments an array', send: req(35, 'tools/call', { name: 'list_sessions', arguments: [] }), expect: { id: 35, code: -32602, msg: /arguments must be an object/ } },
  { name: 'tools/call with arguments a string', send: req(36, 'tools/call', { name: 'run', arguments: 'echo hi' }), expect: { id: 36, code: -32602, msg: /arguments must be an object/ } },
  { name: 'logging/setLevel with a NUL in the level', send: '{"jsonrpc":"2.0","id":37,"method":"logging/setLevel","params":{"level":"debug\\u0000x"}}', expect: { id: 37, code: -32602, msg: /needs params\.level, one of/ } },
  { name: 'a cancellation naming no call', send: j({ jsonrpc: '2.0', method: 'notifications/cancelled', params: { requestId: { a: [1] } } }), expect: { none: true } },
  // -- MCP Tasks (2025-11-25: params.task, tasks/*): hostile ids and parameters
  { name: 'tasks/get with a numeric taskId', send: req('tk1', 'tasks/get', { taskId: 7 }), expect: { id: 'tk1', code: -32602, msg: /taskId must be a string/ } },
  { name: 'tasks/get without params', send: req('tk2', 'tasks/get'), expect: { id: 'tk2', code: -32602, msg: /taskId must be a string/ } },
  { name: 'tasks/get of an id nobody made', send: req('tk3', 'tasks/get', { taskId: 't' + '0'.repeat(32) }), expect: { id: 'tk3', code: -32602, msg: /Task not found: 't0{32}': no task of this client has that id/ } },
  { name: 'tasks/get with a NUL in the taskId', send: req('tk4', 'tasks/get', { taskId: 't00\u0000x' }), expect: { id: 'tk4', code: -32602, msg: /Task not found: \(an id no task has\)/ } },
  { name: 'tasks/result with a 1 MiB taskId: not echoed', send: () => req('tk5', 'tasks/result', { taskId: 'x'.repeat(MiB) }), expect: { id: 'tk5', code: -32602, msg: /Task not found: \(an id no task has\)/, maxLen: 600 } },
  { name: 'tasks/cancel of an id nobody made', send: req('tk6', 'tasks/cancel', { taskId: '../../etc/passwd' }), expect: { id: 'tk6', code: -32602, msg: /Task not found/ } },
  { name: 'tasks/list with a cursor not given', send: req('tk7', 'tasks/list', { cursor: 'abc' }), expect: { id: 'tk7', code: -32602, msg: /cursor is not one this server gave/ } },
  { name: 'tasks/list with a negative cursor', send: req('tk8', 'tasks/list', { cursor: '-1' }), expect: { id: 'tk8', code: -32602, msg: /cursor is not one/ } },
  { name: 'tasks/list with a huge cursor', send: req('tk9', 'tasks/list', { cursor: '99999999999999999999999' }), expect: { id: 'tk9', code: -32602, msg: /cursor is not one/ } },
  { name: 'tasks/list with a numeric cursor', send: req('tk10', 'tasks/list', { cursor: 50 }), expect: { id: 'tk10', code: -32602, msg: /cursor is not one/ } },
  { name: 'tasks/update is not of this era', send: req('tk11', 'tasks/update', { taskId: 'x' }), expect: { id: 'tk11', code: -32601, msg: /tasks\/get, tasks\/result, tasks\/list and tasks\/cancel/ } },
  { name: 'a task on a quick tool', send: req('tk12', 'tools/call', { name: 'list_sessions', arguments: {}, task: {} }), expect: { id: 'tk12', code: -32601, msg: /cannot run as a task.*call it without params\.task/ } },
  { name: 'params.task a string', send: () => req('tk13', 'tools/call', { name: 'run', arguments: { session_id: sid, command: 'true' }, task: 'yes' }), expect: { id: 'tk13', code: -32602, msg: /params\.task must be an object/ } },
  { name: 'a negative task ttl', send: () => req('tk14', 'tools/call', { name: 'run', arguments: { session_id: sid, command: 'true' }, task: { ttl: -5 } }), expect: { id: 'tk14', code: -32602, msg: /ttl must be a non-negative integer/ } },
  { name: 'a task ttl as a string', send: () => req('tk15', 'tools/call', { name: 'run', arguments: { session_id: sid, command: 'true' }, task: { ttl: '60000' } }), expect: { id: 'tk15', code: -32602, msg: /ttl must be a non-negative integer/ } },
  { name: 'a task ttl of 1e300', send: () => req('tk16', 'tools/call', { name: 'run', arguments: { session_id: sid, command: 'true' }, task: { ttl: 1e300 } }), expect: { id: 'tk16', code: -32602, msg: /ttl must be a non-negative integer/ } },
  { name: 'a task ttl past the cap is cut to it', send: () => req('tk17', 'tools/call', { name: 'run', arguments: { session_id: sid, command: 'true' }, task: { ttl: 2 ** 53 - 1 } }), expect: { ok: true, id: 'tk17', check: (r) => assert.equal(r.task.ttl, 3_600_000) } },
  { name: 'a task for an unknown tool is an unknown tool', send: req('tk18', 'tools/call', { name: 'nope', arguments: {}, task: {} }), expect: { id: 'tk18', code: -32602, msg: /unknown tool 'nope'/ } },
  // -- ids of every JSON type
  { name: 'id a string', send: req('str-id', 'ping'), expect: { ok: true, id: 'str-id' } },
  { name: 'id an empty string', send: req('', 'ping'), expect: { ok: true, id: '' } },
  { name: 'id a negative number', send: req(-41, 'ping'), expect: { ok: true, id: -41 } },
  { name: 'id a float', send: req(4.25, 'ping'), expect: { ok: true, id: 4.25 } },
  { name: 'id 2^53+1 is echoed exactly', send: `{"jsonrpc":"2.0","id":9007199254740993,"method":"ping"}`, expect: { ok: true, rawId: '9007199254740993' } },
  { name: 'id -2^63', send: `{"jsonrpc":"2.0","id":-9223372036854775808,"method":"ping"}`, expect: { ok: true, rawId: '-9223372036854775808' } },
  { name: 'id 1e300', send: `{"jsonrpc":"2.0","id":1e300,"method":"ping"}`, expect: { ok: true, id: 1e300 } },
  { name: 'id too big for any integer', send: `{"jsonrpc":"2.0","id":${BIG_ID},"method":"ping"}`, expect: { code: -32700, msg: /too big integer/ } },
  { name: 'id 1e400 (overflows a double)', send: `{"jsonrpc":"2.0","id":1e400,"method":"ping"}`, expect: { code: -32700, msg: /real number overflow/ } },
  { name: 'id null', send: '{"jsonrpc":"2.0","id":null,"method":"ping"}', expect: { code: -32600, msg: /id must be a string or a number/ } },
  { name: 'id true', send: '{"jsonrpc":"2.0","id":true,"method":"ping"}', expect: { code: -32600, msg: /id must be a string or a number/ } },
  { name: 'id false on a tool call', send: '{"jsonrpc":"2.0","id":false,"method":"tools/call","params":{"name":"list_sessions"}}', expect: { code: -32600, msg: /id must be a string or a number/ } },
  { name: 'id an object', send: '{"jsonrpc":"2.0","id":{"a":1},"method":"ping"}', expect: { code: -32600, msg: /id must be a string or a number/ } },
  { name: 'id an array', send: '{"jsonrpc":"2.0","id":[1],"method":"ping"}', expect: { code: -32600, msg: /id must be a string or a number/ } },
  // -- sessions
  { name: 'an unknown session id', send: callLine(50, 'run', { session_id: 'no-such-session', command: 'true' }), expect: { id: 50, tool: /unknown session_id 'no-such-session'/, todo: /Call open_session/ } },
  { name: 'a session id that looks like a path', send: callLine(51, 'read_file', { session_id: '../../../etc', path: '/etc/passwd' }), expect: { id: 51, tool: /unknown session_id '\.\.\/\.\.\/\.\.\/etc'/, todo: /Call open_session/ } },
  { name: 'a session id with format directives', send: callLine(52, 'close', { session_id: '%s%n%x%p' }), expect: { id: 52, tool: /unknown session_id '%s%n%x%p'/, todo: /Call open_session/ } },
  { name: 'an empty session id', send: callLine(53, 'reset', { session_id: '' }), expect: { id: 53, tool: /'session_id' is empty/, todo: /give a non-empty string/ } },
  { name: 'a 65-byte session id', send: callLine(54, 'run', { session_id: 's'.repeat(65), command: 'true' }), expect: { id: 54, tool: /'session_id' is 65 bytes, over its cap of 64/, todo: /the id open_session returned/ } },
  // -- timeouts
  ...[
    ['0', /'timeout_s' is 0, outside its range 1\.\.3600/],
    ['-1', /'timeout_s' is -1, outside its range/],
    ['3601', /'timeout_s' is 3601, outside its range/],
    ['9223372036854775807', /'timeout_s' is 9223372036854775807, outside its range/],
    ['-9223372036854775808', /'timeout_s' is -9223372036854775808, outside its range/],
    ['1.5', /'timeout_s' must be a whole number from 1 to 3600, not a number with a fraction/],
    ['1e308', /'timeout_s' is 1e\+308, outside its range 1\.\.3600/],
    ['-1e308', /'timeout_s' is -1e\+308, outside its range/],
    ['1e19', /'timeout_s' is 1e\+19, outside its range/],
    ['30.0', null],
    ['"30"', /'timeout_s' must be a whole number from 1 to 3600, not a string/],
  ].map(([v, re], i) => ({
    name: re ? `timeout_s ${v}` : `timeout_s ${v} (a whole number written as a float) is accepted`,
    send: () => fill(`{"jsonrpc":"2.0","id":${60 + i},"method":"tools/call","params":{"name":"run","arguments":{"session_id":${j(SID)},"command":"echo hostile","timeout_s":${v}}}}`),
    expect: re ? { id: 60 + i, tool: re, todo: /give a value in that range|must be a whole number/ } : { id: 60 + i, ok: true, check: (r) => assert.equal(r.structuredContent.stdout, 'hostile\n') },
  })),
  // -- stdin, files, base64, paths
  { name: 'stdin one byte over IGN_MCP_MAX_STDIN', send: () => run(80, { stdin: 'a'.repeat(MAX_STDIN + 1) }), expect: { id: 80, tool: new RegExp(`'stdin' is ${MAX_STDIN + 1} bytes, over the ${MAX_STDIN} byte cap \\(IGN_MCP_MAX_STDIN\\)`), todo: /write the input to a file with write_file/ } },
  { name: 'content_base64 that decodes to more than IGN_MCP_MAX_FILE', send: () => wf(81, { content_base64: 'QUJD'.repeat(MAX_FILE / 3 + 1024) }), expect: { id: 81, tool: new RegExp(`over the ${MAX_FILE} byte cap for one file \\(IGN_MCP_MAX_FILE\\)`), todo: /split the file/ } },
  { name: 'base64 with characters outside the alphabet', send: wf(82, { content_base64: 'QU*D' }), expect: { id: 82, tool: /not valid base64: byte 2 is not a base64 character/, todo: /use the standard alphabet/ } },
  { name: 'base64url instead of base64', send: wf(83, { content_base64: 'ab-_' }), expect: { id: 83, tool: /not valid base64: byte 2/, todo: /use the standard alphabet/ } },
  { name: 'base64 with bad padding', send: wf(84, { content_base64: 'QQ=' }), expect: { id: 84, tool: /not valid base64: its length is wrong/, todo: /encode the bytes again/ } },
  { name: 'base64 with = in the middle', send: wf(85, { content_base64: 'QQ==QUJD' }), expect: { id: 85, tool: /not valid base64: byte 2 is '=' before the end/, todo: /use the standard alphabet/ } },
  { name: 'base64 with a line break', send: wf(86, { content_base64: 'QUJD\nREV' }), expect: { id: 86, tool: /not valid base64: byte 4 is a line break/, todo: /no line breaks/ } },
  { name: 'base64 of one character', send: wf(87, { content_base64: 'Q' }), expect: { id: 87, tool: /its length is wrong/, todo: /encode the bytes again/ } },
  { name: 'an empty path', send: wf(88, { path: '' }), expect: { id: 88, tool: /'path' is empty/, todo: /give a non-empty string/ } },
  { name: 'a path of 4097 bytes', send: rf(89, { path: `/${'p'.repeat(4096)}` }), expect: { id: 89, tool: /'path' is 4097 bytes, over its cap of 4095 bytes/, todo: /use a shorter path/ } },
  { name: 'a cwd of 5000 bytes', send: run(90, { cwd: `/${'c'.repeat(4999)}` }), expect: { id: 90, tool: /'cwd' is 5000 bytes, over its cap of 4095/, todo: /use a shorter path/ } },
  { name: 'a command over its cap', send: () => run(91, { command: `echo ${'x'.repeat(200_000)}` }), expect: { id: 91, tool: /'command' is 200005 bytes, over its cap of 122880 bytes/, todo: /put a long script in a file with write_file/ } },
  { name: 'an empty command', send: run(92, { command: '' }), expect: { id: 92, tool: /'command' is empty/, todo: /give a non-empty string/ } },
  { name: 'mode 4096 (past 07777)', send: wf(93, { mode: 4096 }), expect: { id: 93, tool: /'mode' must be permission bits/, todo: /as an integer .* or an octal string/ } },
  { name: 'mode "999" (not octal)', send: wf(94, { mode: '999' }), expect: { id: 94, tool: /'mode' must be permission bits/ } },
  { name: 'mode -1', send: wf(95, { mode: -1 }), expect: { id: 95, tool: /'mode' must be permission bits/ } },
  { name: 'read_file offset -1', send: rf(96, { offset: -1 }), expect: { id: 96, tool: /'offset' is -1, outside its range/ } },
  { name: 'read_file max_bytes 0', send: rf(97, { max_bytes: 0 }), expect: { id: 97, tool: /'max_bytes' is 0, outside its range 1\.\.2097152/ } },
  { name: 'read_file max_bytes over the 2 MiB piece', send: rf(98, { max_bytes: 2 * MiB + 1 }), expect: { id: 98, tool: /'max_bytes' is 2097153, outside its range 1\.\.2097152/ } },
  // -- env
  { name: 'env an array', send: run(100, { env: ['A=1'] }), expect: { id: 100, tool: /'env' must be an object of NAME: "value" strings, not an array/ } },
  { name: 'env with a number value', send: run(101, { env: { A: 1 } }), expect: { id: 101, tool: /env\['A'\] must be a string, not an integer/ } },
  { name: 'env with = in a name', send: run(102, { env: { 'A=B': '1' } }), expect: { id: 102, tool: /env has an invalid entry 'A=B'/ } },
  { name: 'env with an empty name', send: run(103, { env: { '': '1' } }), expect: { id: 103, tool: /env has an invalid entry ''/ } },
  { name: 'env with 257 variables', send: () => run(104, { env: Object.fromEntries(Array.from({ length: 257 }, (_, i) => [`V${i}`, 'x'])) }), expect: { id: 104, tool: /'env' has 257 variables, over the cap of 256/, todo: /pass fewer/ } },
  { name: 'env with one 40 KB value', send: () => run(105, { env: { BIG: 'v'.repeat(40_000) } }), expect: { id: 105, tool: /env\['BIG'\] is 40004 bytes as NAME=value, over the cap of 32768/, todo: /write long values to a file/ } },
  { name: 'env of 140 KB in all', send: () => run(106, { env: Object.fromEntries(Array.from({ length: 5 }, (_, i) => [`V${i}`, 'v'.repeat(28_000)])) }), expect: { id: 106, tool: /'env' is \d+ bytes in all, over the cap of 131072/, todo: /write long values to a file/ } },
  // -- a session being reset and closed under concurrent calls
  {
    name: 'run, read_file and write_file racing reset and close each get a result or a clear error',
    custom: async () => {
      const s2 = (await raw.tool('open_session', {}, { timeoutMs: 120_000 })).session_id;
      const gone = new RegExp(`session '${s2}' (was (reset|closed)|is dead)|unknown session_id '${s2}'`);
      const seen = { ok: 0, err: 0 };
      for (const op of ['reset', 'reset', 'close']) {
        const calls = [
          raw.callTool('run', { session_id: s2, command: 'sleep 0.3; echo ok' }, { timeoutMs: 120_000 }),
          raw.callTool('write_file', { session_id: s2, path: '/root/race.txt', content_base64: 'aGk=' }, { timeoutMs: 120_000 }),
          raw.callTool('read_file', { session_id: s2, path: '/bin/sh', max_bytes: 64 }, { timeoutMs: 120_000 }),
          raw.callTool('run', { session_id: s2, command: 'cat /root/race.txt' }, { timeoutMs: 120_000 }),
          raw.callTool(op, { session_id: s2 }, { timeoutMs: 120_000 }),
          raw.callTool('run', { session_id: s2, command: 'echo after' }, { timeoutMs: 120_000 }),
          raw.callTool('write_file', { session_id: s2, path: '/root/after.txt', content_base64: 'aGk=' }, { timeoutMs: 120_000 }),
        ];
        const rs = await Promise.all(calls);
        for (const [i, r] of rs.entries()) {
          assert.ok(r.result, `${op} race, call ${i}: a JSON-RPC error ${j(r.error)}`);
          if (i === 4) {
            assert.notEqual(r.result.isError, true, `${op} itself failed: ${textOf(r.result)}`);
            continue;
          }
          if (r.result.isError) {
            seen.err++;
            const t = textOf(r.result);
            assert.match(t, gone, `${op} race, call ${i}: unclear error: ${t}`);
            assert.match(t, /Call (open_session|again|reset)/, `${op} race, call ${i}: no what-to-do: ${t}`);
          } else {
            seen.ok++;
          }
        }
      }
      const after = await raw.callTool('run', { session_id: s2, command: 'true' });
      assert.match(textOf(after.result), new RegExp(`unknown session_id '${s2}'.*Call open_session`));
      assert.ok(seen.ok + seen.err === 18, j(seen));
    },
  },
];

/* Generated from the schemas: a value of every JSON type the schema does
 * not allow, for every argument of every tool; null for an optional
 * argument means "absent" (documented leniency: some clients send null for
 * arguments they leave out), for a required one it is refused. */
const VALUES = { string: 'x', integer: 7, number: 1.5, boolean: true, object: { a: 1 }, array: [1], null: null };
const BASE = {
  open_session: {},
  list_sessions: {},
  run: { session_id: SID, command: 'true' },
  write_file: { session_id: SID, path: '/root/hostile.bin', content_base64: 'aGk=' },
  read_file: { session_id: SID, path: '/root/hostile.txt' },
  reset: { session_id: SID },
  close: { session_id: SID },
  hibernate: { session_id: SID },
  commit: { session_id: SID, name: 'hostile/never' },
  fork: { session_id: SID },
  stage_list: {},
  stage_info: { name: 'hostile/never' },
  stage_rm: { name: 'hostile/never' },
  sandbox_run: { command: 'true' },
  copy_in: { session_id: SID, host_path: 'hostile-never', guest_path: '/root/hostile-in' },
  copy_out: { session_id: SID, guest_path: '/root/hostile.txt', host_path: 'hostile-never' },
  network_log: { session_id: SID },
  network_update: { session_id: SID, network: 'none', secrets: [] },
};
const GENERATED = [];
let gid = 1000;
for (const tool of TOOLS) {
  const props = tool.inputSchema.properties ?? {};
  const required = tool.inputSchema.required ?? [];
  assert.ok(tool.name in BASE, `a tool the table does not know: ${tool.name}`);
  for (const [prop, schema] of Object.entries(props)) {
    const allowed = schema.type ? [schema.type] : schema.anyOf.map((s) => s.type);
    for (const [type, value] of Object.entries(VALUES)) {
      if (allowed.includes(type) || (type === 'integer' && allowed.includes('number'))) continue;
      const id = gid++;
      const args = { ...BASE[tool.name], [prop]: value };
      let expect;
      if (type === 'null' && required.includes(prop)) expect = { id, tool: new RegExp(`'${prop}' must be a string, not null`) };
      else if (type === 'null') expect = { id, ok: true };
      else expect = { id, tool: new RegExp(`'${prop}' must be`) };
      GENERATED.push({ name: `${tool.name}: ${prop} as ${type} (${j(value)})`, send: () => callLine(id, tool.name, args), expect });
    }
  }
  for (const prop of required) {
    const id = gid++;
    const args = { ...BASE[tool.name] };
    delete args[prop];
    GENERATED.push({ name: `${tool.name}: required ${prop} left out`, send: () => callLine(id, tool.name, args), expect: { id, tool: new RegExp(`needs the argument '${prop}'`), todo: /\(a string/ } });
  }
  const id = gid++;
  GENERATED.push({
    name: `${tool.name}: an unknown argument`,
    send: () => callLine(id, tool.name, { ...BASE[tool.name], 'bogus\u00e9': 1 }),
    expect: { id, tool: new RegExp(`${tool.name} has no argument 'bogus\u00e9'`), todo: /its arguments are/ },
  });
}

describe(`hostile input: ${CASES.length} cases by hand, ${GENERATED.length} from the tool schemas`, () => {
  before(async () => {
    raw = startRaw({ env: { ASAN_OPTIONS: ASAN } });
    await raw.initialize();
    sid = (await raw.tool('open_session', {}, { timeoutMs: 120_000 })).session_id;
    await raw.tool('write_file', { session_id: sid, path: '/root/hostile.txt', content_base64: Buffer.from('hostile\n').toString('base64') });
    await assertServing('warm-up', raw.messages.length, null);
    rss.before = vmRssKiB(raw.pid);
  });
  after(async () => {
    if (raw) await raw.close();
  });

  test('the table is as big as promised', () => {
    assert.ok(CASES.length >= 50, `${CASES.length} hand-written cases`);
    // Every tool with arguments gets wrong-type cases for every argument.
    for (const tool of TOOLS) {
      for (const prop of Object.keys(tool.inputSchema.properties ?? {})) {
        assert.ok(GENERATED.some((c) => c.name.startsWith(`${tool.name}: ${prop} as `)), `${tool.name}.${prop} has no wrong-type case`);
      }
    }
  });

  for (const c of CASES) test(c.name, T, () => runCase(c));
  for (const c of GENERATED) test(c.name, T, () => runCase(c));

  test('memory stays bounded over the whole table', T, async (t) => {
    await sleep(500);
    rss.end = vmRssKiB(raw.pid);
    const growth = (rss.end - rss.before) / 1024;
    t.diagnostic(
      `VmRSS before ${rss.before} KiB; peak growth during the 80 MiB line ${rss.bigPeakGrowth?.toFixed(1)} MiB; ` +
        `after it ${rss.afterBig} KiB; after the deep nesting ${rss.afterDeep} KiB; at the end ${rss.end} KiB (growth ${growth.toFixed(1)} MiB); backend ${IS_VM ? 'vm' : 'ns'}`,
    );
    assert.ok(growth < 64, `RSS grew by ${growth.toFixed(1)} MiB over the table (bound 64 MiB)`);
  });
});

/* ---- a hostile agent ----
 *
 * A guest's root can take the agent's place on the channel and answer the
 * host itself. Here a fake agent does so: a node script that the ns backend
 * starts in the agent's place (IGN_MCP_AGENT), speaking the wire protocol
 * (proto/proto.h) with answers no real agent gives. The server must range-
 * check every field: a violation ends that session with a message naming
 * the field, never undefined behaviour (this server is the ASan/UBSan build,
 * which aborts on any), and a guest's error stays the guest's. */

/* The protocol version the server speaks (proto/proto.h), which the fake
 * agent must say it speaks too. */
const HOST_PROTO_VERSION = Number(/#define PROTO_VERSION (\d+)u/.exec(fs.readFileSync(path.join(REPO, 'proto/proto.h'), 'utf8'))[1]);

const FAKE_AGENT = `#!${process.execPath}
'use strict';
const fs = require('fs');
const FD = 3;
const T = { HELLO: 1, HELLO_OK: 2, ERROR: 3, PING: 4, PONG: 5, EXEC: 10, STDOUT: 13, EXIT: 15, KILL: 16, WRITE: 20, DATA: 21, DATA_END: 22, OK: 23, READ: 24, READ_END: 25, SETUP: 30, UNPACK: 40, PACK: 41, PACK_END: 42, CREDIT: 43 };
/* proto/proto.h PROTO_VERSION: the version the fake agent says it speaks. */
const PROTO_VERSION = ${HOST_PROTO_VERSION};
const tlv = (tag, v) => { const h = Buffer.alloc(6); h.writeUInt16LE(tag, 0); h.writeUInt32LE(v.length, 2); return Buffer.concat([h, v]); };
const u32 = (tag, n) => { const b = Buffer.alloc(4); b.writeUInt32LE(n >>> 0); return tlv(tag, b); };
const u64 = (tag, n) => { const b = Buffer.alloc(8); b.writeBigUInt64LE(n); return tlv(tag, b); };
const str = (tag, t) => tlv(tag, Buffer.from(t));
const send = (type, id, ...parts) => {
  const p = Buffer.concat(parts); const h = Buffer.alloc(12);
  h.writeUInt32LE(p.length, 0); h[4] = type; h.writeUInt32LE(id, 8);
  fs.writeSync(FD, Buffer.concat([h, p]));
};
const field = (p, want) => { for (let o = 0; o + 6 <= p.length;) { const t = p.readUInt16LE(o), n = p.readUInt32LE(o + 2); if (t === want) return p.subarray(o + 6, o + 6 + n); o += 6 + n; } return null; };
const exit = (id, { code = 0, sig = 0, dur = 1000n } = {}) => send(T.EXIT, id, u32(15, code), u32(16, sig), u32(17, 0), u64(18, dur));
function answer(type, id, p) {
  if (type === T.HELLO) return send(T.HELLO_OK, id, u32(1, PROTO_VERSION), str(2, 'fake agent'));
  if (type === T.SETUP) return send(T.OK, id);
  if (type === T.PING) return send(T.PONG, id, u32(1, 1));
  if (type === T.EXEC) {
    const cmd = field(p, 10).toString();
    if (cmd === 'signal') return exit(id, { code: -1, sig: 0x7fffffff });
    if (cmd === 'duration') return exit(id, { dur: 2n ** 64n - 1n });
    if (cmd === 'hello') return send(T.HELLO_OK, id, u32(1, 1));
    send(T.STDOUT, id, Buffer.from('fine\\n'));
    return exit(id);
  }
  if (type === T.READ) return send(T.READ_END, id, u64(22, 2n ** 64n - 1n), u32(25, 1), u64(26, 0n));
  if (type === T.WRITE) return send(T.ERROR, id, u32(3, 32 /* EPIPE */), str(4, 'cannot write: Broken pipe (from the guest)'));
  if (type === T.PACK) return pack(id, field(p, 20).toString());
  /* UNPACK of /silent-after-end: the whole window granted, the stream
   * taken, and then no answer at all, to DATA_END or to KILL (as a guest
   * whose tar process hangs after the end, or a hostile one). */
  if (type === T.UNPACK) return send(T.CREDIT, id, u32(42, 1 << 20));
}
/* PACK of /whole-then-error-MS: a whole tar stream (one file "T", end
 * marker and all), then after MS ms an ERROR, as a guest's root can send;
 * of /whole-then-end: the same stream, then PACK_END. */
function tarFile(content) {
  const h = Buffer.alloc(512);
  h.write('T', 0);
  h.write('0000644\\0', 100); h.write('0000000\\0', 108); h.write('0000000\\0', 116);
  h.write(content.length.toString(8).padStart(11, '0') + '\\0', 124);
  h.write('15000000000\\0', 136);
  h.write('0', 156);
  h.write('ustar\\0', 257); h.write('00', 263);
  h.fill(' ', 148, 156);
  let sum = 0;
  for (const b of h) sum += b;
  h.write(sum.toString(8).padStart(6, '0') + '\\0 ', 148);
  const data = Buffer.alloc(512);
  Buffer.from(content).copy(data);
  return Buffer.concat([h, data, Buffer.alloc(1024)]);
}
function pack(id, path) {
  const tar = tarFile('from the guest\\n');
  send(T.DATA, id, tar);
  const m = /^\\/whole-then-error-(\\d+)$/.exec(path);
  if (m) {
    Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, Number(m[1]));
    return send(T.ERROR, id, u32(3, 5 /* EIO */), str(4, 'the guest failed after the stream'));
  }
  send(T.PACK_END, id, u64(43, 1n), u64(44, 0n), u64(45, 0n), u64(46, 15n), u64(47, 0n), u64(26, BigInt(tar.length)));
}
let buf = Buffer.alloc(0);
const chunk = Buffer.alloc(1 << 16);
for (;;) {
  let n;
  try { n = fs.readSync(FD, chunk); } catch (e) { if (e.code === 'EAGAIN') continue; break; }
  if (n === 0) break;
  buf = Buffer.concat([buf, chunk.subarray(0, n)]);
  while (buf.length >= 12 && buf.length >= 12 + buf.readUInt32LE(0)) {
    const len = buf.readUInt32LE(0);
    answer(buf[4], buf.readUInt32LE(8), buf.subarray(12, 12 + len));
    buf = buf.subarray(12 + len);
  }
}
`;

describe('a hostile agent (a fake one in the agent\'s place, ns backend)', { skip: IS_VM && 'the ns backend starts IGN_MCP_AGENT itself; the client code is the same for both' }, () => {
  let hraw;
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-fake-agent-'));
  const agent = path.join(dir, 'fake-agent');
  const root = path.join(dir, 'root');
  before(async () => {
    fs.writeFileSync(agent, FAKE_AGENT, { mode: 0o755 });
    fs.mkdirSync(root);
    fs.chmodSync(dir, 0o755);
    hraw = startRaw({ env: { IGN_MCP_BACKEND: 'ns', IGN_MCP_AGENT: agent, ASAN_OPTIONS: ASAN, IGN_MCP_HOST_IO_ROOT: root } });
    await hraw.initialize();
  });
  after(async () => {
    if (hraw) await hraw.close();
    fs.rmSync(dir, { recursive: true, force: true });
  });

  const open = async () => (await hraw.tool('open_session', {}, { timeoutMs: 60_000 })).session_id;
  const toolErr = async (name, args) => {
    const r = await hraw.callTool(name, args, { timeoutMs: 60_000 });
    assert.ok(r.result, JSON.stringify(r.error));
    assert.equal(r.result.isError, true, `${name} should fail: ${JSON.stringify(r.result).slice(0, 400)}`);
    return textOf(r.result);
  };
  const dead = (tool, sid, what) => new RegExp(`^${tool} failed: session '${sid}' is dead: the sandbox's agent broke the protocol: ${what}; the host closed the connection\\. Call reset\\('${sid}'\\)`);

  const cases = [
    { name: 'EXIT with SIGNAL 0x7fffffff', tool: 'run', args: { command: 'signal' }, says: 'its EXIT frame has SIGNAL 2147483647, outside 0\\.\\.64' },
    { name: 'EXIT with DURATION 2^64-1', tool: 'run', args: { command: 'duration' }, says: 'its EXIT frame has DURATION_US 18446744073709551615, over \\d+' },
    { name: 'READ_END with SIZE 2^64-1', tool: 'read_file', args: { path: '/f' }, says: 'its READ_END frame has SIZE 18446744073709551615, over 9223372036854775807' },
    { name: 'HELLO_OK for a running command', tool: 'run', args: { command: 'hello' }, says: 'it answered a EXEC request with a HELLO_OK frame' },
  ];
  for (const c of cases) {
    test(`${c.name}: the session ends with a message naming it; the server lives`, T, async () => {
      const sid = await open();
      assert.deepEqual((await hraw.tool('run', { session_id: sid, command: 'ok' })).stdout, 'fine\n');
      const e = await toolErr(c.tool, { session_id: sid, ...c.args });
      assert.match(e, dead(c.tool, sid, c.says), e);
      // The session stays dead with the same reason; the server serves on.
      const again = await toolErr('run', { session_id: sid, command: 'ok' });
      assert.match(again, dead('run', sid, c.says), again);
      assert.deepEqual((await hraw.request('ping')).result, {});
      await hraw.tool('close', { session_id: sid });
      assert.equal(hraw.exited(), null, 'server died');
      assertNoSanitizerReport(hraw.stderrText(), 'server');
    });
  }

  /* A whole stream, end marker and all, then an ERROR: the host destination
   * is replaced only after the guest's PACK_END. The error comes soon
   * after the stream (while the host still drains the stream's end) or
   * well after it (past a poll interval of that drain). */
  for (const ms of [50, 600]) {
    test(`copy_out: a whole stream, then an ERROR ${ms} ms later: the host destination is left as it was`, T, async () => {
      const sid = await open();
      const dst = path.join(root, `dst-${ms}`);
      fs.writeFileSync(dst, 'old\n');
      const ino = fs.statSync(dst).ino;
      const e = await toolErr('copy_out', { session_id: sid, guest_path: `/whole-then-error-${ms}`, host_path: dst });
      assert.equal(e, `copy_out failed in the sandbox, reading '/whole-then-error-${ms}': the guest failed after the stream; the host destination was left as it was`);
      assert.equal(fs.readFileSync(dst, 'utf8'), 'old\n');
      assert.equal(fs.statSync(dst).ino, ino);
      assert.deepEqual(fs.readdirSync(root).filter((n) => n.includes(`dst-${ms}`)), [`dst-${ms}`], 'a staging name was left behind');
      const l = (await hraw.tool('list_sessions', {})).sessions.find((x) => x.session_id === sid);
      assert.equal(l.alive, true);
      await hraw.tool('close', { session_id: sid });
      assertNoSanitizerReport(hraw.stderrText(), 'server');
    });
  }

  /* A stop (here timeout_s) once the whole stream went to the sandbox
   * cannot take it back: the sandbox may have put the tree in place. The
   * host tells it to stop and waits for its answer; a sandbox that never
   * answers gets a message that the destination may hold either tree, not
   * that nothing changed. */
  test('copy_in stopped after the end of its stream, with no answer from the sandbox: the error says the destination may hold either tree', { timeout: 90_000 }, async () => {
    const src = path.join(root, 'src-silent');
    fs.writeFileSync(src, 'new\n');
    const t0 = Date.now();
    const e = await toolErr('sandbox_run', { command: 'true', timeout_s: 3, copy_in: [{ host: src, guest: '/silent-after-end' }] });
    assert.match(e, /^sandbox_run: copy_in\[0\] \('.*src-silent' to '\/silent-after-end'\): copy_in of '.*src-silent' was out of time \(timeout_s\): the copy was stopped after the whole stream had reached the sandbox, and the sandbox did not say in time whether it had put the new tree in place: '\/silent-after-end' may hold the new tree or what it held before/);
    assert.doesNotMatch(e, /nothing was changed|left as it was/);
    assert.ok(Date.now() - t0 >= 15_000, 'the answer was waited for');
    assertNoSanitizerReport(hraw.stderrText(), 'server');
  });

  test('copy_out: the same stream followed by PACK_END replaces the host destination', T, async () => {
    const sid = await open();
    const dst = path.join(root, 'dst-ok');
    fs.writeFileSync(dst, 'old\n');
    const r = await hraw.tool('copy_out', { session_id: sid, guest_path: '/whole-then-end', host_path: dst });
    assert.equal(r.copied.files, 1, JSON.stringify(r));
    assert.equal(fs.readFileSync(dst, 'utf8'), 'from the guest\n');
    await hraw.tool('close', { session_id: sid });
  });

  test('a guest ERROR with errno EPIPE is the guest\'s: the call fails with its message, the session lives', T, async () => {
    const sid = await open();
    const e = await toolErr('write_file', { session_id: sid, path: '/root/x', content_base64: 'aGk=' });
    assert.equal(e, 'write_file failed: cannot write: Broken pipe (from the guest)');
    assert.deepEqual((await hraw.tool('run', { session_id: sid, command: 'ok' })).stdout, 'fine\n');
    const l = (await hraw.tool('list_sessions', {})).sessions.find((x) => x.session_id === sid);
    assert.equal(l.alive, true);
    await hraw.tool('close', { session_id: sid });
    assertNoSanitizerReport(hraw.stderrText(), 'server');
  });
});
