// protocol.test.mjs: JSON-RPC framing, MCP lifecycle and error codes, spoken
// both through the SDK and byte by byte through the raw client.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { LoggingMessageNotificationSchema } from '@modelcontextprotocol/sdk/types.js';
import fs from 'node:fs';
import path from 'node:path';
import { startRaw, startServer, TOOL_NAMES, vmRssKiB, sleep, textOf, UNDER_VALGRIND, REPO } from './lib.mjs';

const T = { timeout: 60_000 };

describe('initialize', () => {
  for (const [asked, expected] of [
    ['2025-11-25', '2025-11-25'],
    ['2025-06-18', '2025-06-18'],
    ['2025-03-26', '2025-03-26'],
    ['2024-11-05', '2024-11-05'],
    ['1999-01-01', '2025-11-25'],
  ]) {
    test(`protocolVersion ${asked} is answered with ${expected}`, T, async (t) => {
      const raw = startRaw();
      t.after(() => raw.close());
      const r = await raw.request('initialize', {
        protocolVersion: asked,
        capabilities: {},
        clientInfo: { name: 'v', version: '1' },
      });
      assert.ok(r.result, JSON.stringify(r));
      assert.equal(r.result.protocolVersion, expected);
    });
  }

  test('result carries serverInfo, capabilities and instructions', T, async (t) => {
    const raw = startRaw();
    t.after(() => raw.close());
    const res = await raw.initialize();
    assert.equal(res.serverInfo.name, 'ignition-mcp');
    assert.equal(typeof res.serverInfo.version, 'string');
    assert.ok(res.serverInfo.version.length > 0);
    assert.equal(typeof res.serverInfo.title, 'string');
    assert.ok(res.serverInfo.title.length > 0);
    assert.deepEqual(typeof res.capabilities.tools, 'object');
    assert.deepEqual(typeof res.capabilities.logging, 'object');
    assert.notEqual(res.capabilities.tools, null);
    assert.notEqual(res.capabilities.logging, null);
    const ins = res.instructions;
    assert.equal(typeof ins, 'string');
    assert.ok(ins.length > 40, 'instructions too short');
    assert.match(ins, /sh -c/, 'instructions should say each run is a fresh sh -c');
    assert.match(ins, /cwd|working directory/i, 'instructions should say cwd does not carry over');
    assert.match(ins, /env/i, 'instructions should say env does not carry over');
    assert.match(ins, /persist/i, 'instructions should say files persist');
  });

  test('the SDK client connects and sees the server identity', T, async (t) => {
    const s = await startServer({ listTools: false });
    t.after(() => s.close());
    const v = s.client.getServerVersion();
    assert.equal(v.name, 'ignition-mcp');
    assert.ok(s.client.getServerCapabilities().tools);
    assert.ok(s.client.getInstructions()?.length > 0);
  });
});

describe('basic requests', () => {
  let raw;
  before(async () => {
    raw = startRaw();
    await raw.initialize();
  });
  after(() => raw.close());

  test('ping answers with an empty result', T, async () => {
    const r = await raw.request('ping');
    assert.deepEqual(r.result, {});
    assert.equal(r.error, undefined);
  });

  test('tools/list lists the eighteen tools with schemas and annotations', T, async () => {
    const r = await raw.request('tools/list', {});
    const tools = r.result.tools;
    assert.deepEqual(tools.map((x) => x.name).sort(), [...TOOL_NAMES].sort());
    for (const tool of tools) {
      const n = tool.name;
      assert.equal(typeof tool.title, 'string', `${n}.title`);
      assert.ok(tool.title.length > 0, `${n}.title empty`);
      assert.equal(typeof tool.description, 'string', `${n}.description`);
      assert.ok(tool.description.length > 10, `${n}.description too short`);
      assert.equal(tool.inputSchema?.type, 'object', `${n}.inputSchema.type`);
      assert.equal(tool.outputSchema?.type, 'object', `${n}.outputSchema.type`);
      const a = tool.annotations;
      assert.ok(a, `${n}.annotations`);
      for (const h of ['readOnlyHint', 'destructiveHint', 'idempotentHint', 'openWorldHint']) {
        assert.equal(typeof a[h], 'boolean', `${n}.annotations.${h}`);
      }
      // Only the commands reach out (through the egress broker; IGN_MCP_NET=allow).
      assert.equal(a.openWorldHint, n === 'run' || n === 'sandbox_run', `${n}.openWorldHint`);
    }
    const by = Object.fromEntries(tools.map((x) => [x.name, x]));
    assert.equal(by.list_sessions.annotations.readOnlyHint, true);
    assert.equal(by.close.annotations.destructiveHint, true);
    const props = (n) => Object.keys(by[n].inputSchema.properties ?? {});
    for (const p of ['session_id', 'command', 'timeout_s', 'cwd', 'stdin', 'env']) assert.ok(props('run').includes(p), `run.${p}`);
    for (const p of ['session_id', 'path', 'content_base64', 'mode']) assert.ok(props('write_file').includes(p), `write_file.${p}`);
    for (const p of ['session_id', 'path', 'offset', 'max_bytes']) assert.ok(props('read_file').includes(p), `read_file.${p}`);
    for (const n of ['reset', 'close']) assert.ok(props(n).includes('session_id'), `${n}.session_id`);
    assert.deepEqual([...(by.run.inputSchema.required ?? [])].sort(), ['command', 'session_id']);
    for (const f of ['stdout', 'stderr', 'exit_code', 'timed_out']) {
      assert.ok(Object.keys(by.run.outputSchema.properties ?? {}).includes(f), `run outputSchema lacks ${f}`);
    }
  });

  test('logging/setLevel with an invalid level is -32602', T, async () => {
    const r = await raw.request('logging/setLevel', { level: 'chatty' });
    assert.equal(r.error?.code, -32602, JSON.stringify(r));
  });

  test('tools/call with an unknown tool name is -32602', T, async () => {
    const r = await raw.request('tools/call', { name: 'no_such_tool', arguments: {} });
    assert.equal(r.error?.code, -32602, JSON.stringify(r));
    assert.equal(r.result, undefined);
  });

  test('unknown methods are -32601 after initialize', T, async () => {
    for (const m of ['server/discover', 'foo/bar', 'resources/list_everything']) {
      const r = await raw.request(m, {});
      assert.equal(r.error?.code, -32601, `${m}: ${JSON.stringify(r)}`);
    }
  });

  test('ids are echoed with their JSON type', T, async () => {
    for (const [id, rawText] of [
      ['abc', '"abc"'],
      ['', '""'],
      [7, '7'],
      [0, '0'],
      [-3, '-3'],
      [9007199254740991, '9007199254740991'],
      [1.5, '1.5'],
    ]) {
      const from = raw.messages.length;
      await raw.sendLine(`{"jsonrpc":"2.0","id":${rawText},"method":"ping"}`);
      const r = await raw.response(id, { from });
      assert.deepEqual(r.result, {});
      assert.equal(typeof r.id, typeof id);
      const line = raw.messages.find((m) => m.msg === r).raw;
      assert.match(line, new RegExp(`"id"\\s*:\\s*${rawText.replace(/[.\\"]/g, '\\$&')}\\s*[,}]`), `id not echoed verbatim: ${line}`);
    }
  });

  test('notifications never get a response', T, async () => {
    const from = raw.messages.length;
    await raw.notify('notifications/initialized');
    await raw.notify('notifications/whatever', { x: 1 });
    await raw.notify('ping'); // a request without id is a notification
    await raw.notify('tools/list');
    await raw.notify('foo/bar');
    const r = await raw.request('ping', undefined, { id: 'after-notifications' });
    assert.deepEqual(r.result, {});
    await sleep(300);
    const got = raw.since(from).filter((m) => 'result' in m || 'error' in m);
    assert.deepEqual(got.map((m) => m.id), ['after-notifications'], JSON.stringify(got));
  });
});

describe('malformed input', () => {
  let raw;
  before(async () => {
    raw = startRaw();
    await raw.initialize();
  });
  after(() => raw.close());

  const errorAfter = async (line, from) => {
    await raw.sendLine(line);
    return raw.waitFor((m) => 'error' in m, { from, what: `error for ${line.slice(0, 80)}` });
  };

  test('invalid JSON is -32700 with id null, and the server keeps serving', T, async () => {
    for (const bad of ['{not json', '{"jsonrpc":"2.0","id":1,"method":"ping"', '\u00ff\u00fe', '"unterminated']) {
      const from = raw.messages.length;
      const e = await errorAfter(bad, from);
      assert.equal(e.error.code, -32700, `${bad}: ${JSON.stringify(e)}`);
      assert.equal(e.id, null);
      const p = await raw.request('ping');
      assert.deepEqual(p.result, {});
    }
  });

  test('invalid UTF-8 bytes in a line do not kill the server', T, async () => {
    const from = raw.messages.length;
    await raw.sendBytes(Buffer.from([0x7b, 0xff, 0xfe, 0x80, 0x7d, 0x0a]));
    const e = await raw.waitFor((m) => 'error' in m, { from });
    assert.ok([-32700, -32600].includes(e.error.code), JSON.stringify(e));
    assert.deepEqual((await raw.request('ping')).result, {});
  });

  test('valid JSON that is not a request is -32600', T, async () => {
    for (const [line, id] of [
      ['42', null],
      ['"ping"', null],
      ['null', null],
      ['{}', null],
      ['{"jsonrpc":"2.0"}', null],
      ['{"id":11,"method":"ping"}', 11],
      ['{"jsonrpc":"1.0","id":12,"method":"ping"}', 12],
      ['{"jsonrpc":2,"id":13,"method":"ping"}', 13],
      ['{"jsonrpc":"2.0","id":14,"method":5}', 14],
      ['{"jsonrpc":"2.0","id":15,"method":null}', 15],
      ['{"jsonrpc":"2.0","id":{"a":1},"method":"ping"}', null],
    ]) {
      const from = raw.messages.length;
      const e = await errorAfter(line, from);
      assert.equal(e.error.code, -32600, `${line}: ${JSON.stringify(e)}`);
      assert.ok(e.id === null || e.id === id, `${line}: id ${JSON.stringify(e.id)}`);
      assert.equal(typeof e.error.message, 'string');
    }
    assert.deepEqual((await raw.request('ping')).result, {});
  });

  test('a batch (JSON array) is -32600, not executed', T, async () => {
    for (const line of ['[{"jsonrpc":"2.0","id":21,"method":"ping"},{"jsonrpc":"2.0","id":22,"method":"ping"}]', '[]']) {
      const from = raw.messages.length;
      const e = await errorAfter(line, from);
      assert.equal(e.error.code, -32600, JSON.stringify(e));
      assert.equal(e.id, null);
      await sleep(200);
      const answered = raw.since(from).filter((m) => m.id === 21 || m.id === 22);
      assert.deepEqual(answered, [], 'batched requests must not be executed');
    }
    assert.deepEqual((await raw.request('ping')).result, {});
  });

  test('empty lines and CRLF line ends are tolerated', T, async () => {
    await raw.sendLine('');
    await raw.sendLine('   ');
    const from = raw.messages.length;
    await raw.sendBytes(Buffer.from('{"jsonrpc":"2.0","id":"crlf","method":"ping"}\r\n'));
    const r = await raw.response('crlf', { from });
    assert.deepEqual(r.result, {});
  });
});

describe('before initialize', () => {
  test('unknown methods are -32601 before initialize, and ping works', T, async (t) => {
    const raw = startRaw();
    t.after(() => raw.close());
    for (const m of ['server/discover', 'foo/bar']) {
      const r = await raw.request(m, {});
      assert.equal(r.error?.code, -32601, `${m}: ${JSON.stringify(r)}`);
    }
    assert.deepEqual((await raw.request('ping')).result, {});
    const init = await raw.initialize();
    assert.equal(init.protocolVersion, '2025-11-25');
  });
});

describe('message size cap', () => {
  test('a line over IGN_MCP_MAX_MESSAGE gets -32600 with its own id (found while it is dropped), and the server survives', T, async (t) => {
    const raw = startRaw({ env: { IGN_MCP_MAX_MESSAGE: 1048576 } });
    t.after(() => raw.close());
    await raw.initialize();
    const from = raw.messages.length;
    const pad = 'a'.repeat(3 * 1024 * 1024);
    // The official SDK writes "id" last, after a large "params".
    await raw.sendLine(`{"jsonrpc":"2.0","method":"ping","params":{"pad":"${pad}","id":5},"id":77}`);
    const e = await raw.waitFor((m) => 'error' in m, { from, what: 'size error' });
    assert.equal(e.error.code, -32600, JSON.stringify(e).slice(0, 300));
    assert.equal(e.id, 77);
    assert.match(e.error.message, /^message too large: over \d+ bytes \(IGN_MCP_MAX_MESSAGE is 1048576\); it was discarded\. Send large files in pieces\.$/);
    // A string id, first this time; a string id over the small cap gets null.
    const from1 = raw.messages.length;
    await raw.sendLine(`{"id":"big-\\"one\\"","jsonrpc":"2.0","method":"ping","params":{"pad":"${pad}"}}`);
    const e1 = await raw.waitFor((m) => 'error' in m, { from: from1, what: 'size error (string id)' });
    assert.equal(e1.id, 'big-"one"');
    const from2 = raw.messages.length;
    await raw.sendLine(`{"jsonrpc":"2.0","method":"ping","params":{"pad":"${pad}"},"id":"${'k'.repeat(200)}"}`);
    const e2 = await raw.waitFor((m) => 'error' in m, { from: from2, what: 'size error (long id)' });
    assert.equal(e2.id, null);
    assert.equal(e2.error.code, -32600);
    assert.equal(raw.exited(), null, 'server died');
    assert.deepEqual((await raw.request('ping')).result, {});
    // Just under the cap is still accepted.
    const ok = 'b'.repeat(1024 * 1024 - 200);
    const from3 = raw.messages.length;
    await raw.sendLine(`{"jsonrpc":"2.0","id":78,"method":"ping","params":{"pad":"${ok}"}}`);
    const r = await raw.response(78, { from: from3 });
    assert.deepEqual(r.result, {});
  });

  test('a 100 MiB line does not make the server buffer it (default 64 MiB cap)', { timeout: 120_000, skip: UNDER_VALGRIND && 'RSS under valgrind is valgrind\'s' }, async (t) => {
    // ASan's quarantine keeps freed blocks resident by design; switch it off
    // so that RSS measures the server's buffering, not the sanitizer's.
    const asan = [process.env.ASAN_OPTIONS || 'detect_leaks=1', 'quarantine_size_mb=0'].join(':');
    const raw = startRaw({ env: { ASAN_OPTIONS: asan } });
    t.after(() => raw.close());
    await raw.initialize();
    const before = vmRssKiB(raw.pid);
    const chunk = Buffer.alloc(1 << 20, 0x61);
    await raw.sendBytes(Buffer.from('{"jsonrpc":"2.0","id":5,"method":"ping","params":{"pad":"'));
    let peak = before;
    for (let i = 0; i < 100; i++) {
      await raw.sendBytes(chunk);
      if (i % 10 === 0) peak = Math.max(peak, vmRssKiB(raw.pid));
    }
    const from = 0;
    await raw.sendBytes(Buffer.from('"}}\n'));
    const e = await raw.waitFor((m) => 'error' in m && m.id === 5, { from, timeoutMs: 30000, what: 'size error' });
    assert.equal(e.error.code, -32600);
    assert.deepEqual((await raw.request('ping')).result, {});
    const hwm = vmRssKiB(raw.pid, 'VmHWM');
    peak = Math.max(peak, hwm);
    const growthMiB = (peak - before) / 1024;
    t.diagnostic(`RSS before ${before} KiB, peak ${peak} KiB, growth ${growthMiB.toFixed(1)} MiB`);
    assert.ok(growthMiB < 80, `server RSS grew by ${growthMiB.toFixed(1)} MiB for a 100 MiB line`);
    // The request inside the oversize line must not have been executed.
    assert.equal(raw.messages.filter((m) => m.msg.id === 5 && 'result' in m.msg).length, 0);
  });
});

describe('logging', () => {
  test('logging/setLevel debug returns {} and the server then sends notifications/message', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const logs = [];
    s.client.setNotificationHandler(LoggingMessageNotificationSchema, (n) => logs.push(n.params));
    const r = await s.client.setLoggingLevel('debug');
    assert.deepEqual(r, {});
    const o = await s.client.callTool({ name: 'open_session', arguments: {} });
    assert.notEqual(o.isError, true, textOf(o));
    const sid = o.structuredContent.session_id;
    await s.client.callTool({ name: 'close', arguments: { session_id: sid } });
    const deadline = Date.now() + 5000;
    while (logs.length === 0 && Date.now() < deadline) await sleep(50);
    assert.ok(logs.length > 0, 'no notifications/message after setLevel debug and open/close');
    for (const l of logs) {
      assert.ok(['debug', 'info', 'notice', 'warning', 'error', 'critical', 'alert', 'emergency'].includes(l.level), JSON.stringify(l));
      assert.ok('data' in l);
    }
  });

  test('at level error, opening a session sends no debug/info messages', T, async (t) => {
    const raw = startRaw();
    t.after(() => raw.close());
    await raw.initialize();
    const r = await raw.request('logging/setLevel', { level: 'error' });
    assert.deepEqual(r.result, {});
    const from = raw.messages.length;
    const o = await raw.tool('open_session', {});
    await raw.tool('close', { session_id: o.session_id });
    await sleep(300);
    const low = raw.since(from).filter((m) => m.method === 'notifications/message' && ['debug', 'info', 'notice'].includes(m.params?.level));
    assert.deepEqual(low, []);
  });
});

describe('threads', () => {
  /* Every thread (one per call, two per session) gets a copy of the
   * thread-local block; a buffer there costs its size per thread. */
  test('the server binaries carry no large thread-local storage', () => {
    // The builds themselves (under valgrind the test server is a wrapper).
    const build = path.resolve(REPO, process.env.BUILD || 'build');
    const bins = [path.join(build, 'ignition-mcp'), path.join(build, 'san/ignition-mcp')].filter((f) => fs.existsSync(f));
    assert.ok(bins.length > 0, `no server binary in ${build}`);
    for (const bin of bins) {
      const elf = fs.readFileSync(bin);
      assert.equal(elf.readUInt32BE(0), 0x7f454c46, `${bin} is not an ELF file`);
      assert.equal(elf[4], 2, `${bin} is not a 64-bit ELF file`);
      const phoff = Number(elf.readBigUInt64LE(0x20));
      const phentsize = elf.readUInt16LE(0x36);
      const phnum = elf.readUInt16LE(0x38);
      let tls = 0;
      for (let i = 0; i < phnum; i++) {
        const ph = phoff + i * phentsize;
        if (elf.readUInt32LE(ph) === 7 /* PT_TLS */) tls += Number(elf.readBigUInt64LE(ph + 0x28));
      }
      assert.ok(tls <= 16 * 1024, `${bin} has ${tls} bytes of thread-local storage per thread`);
    }
  });
});
