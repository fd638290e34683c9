// tasks.test.mjs: long calls as MCP Tasks on stdio (README "Tasks";
// docs/mcp-tasks.md has the wire shapes).  The 2025-11-25 era through the
// 1.x SDK's own task support (client.experimental.tasks), the 2026-07-28 era
// with the Tasks extension as raw JSON-RPC lines (no SDK speaks it yet), on
// the backend of the pass.  HTTP (other tokens, a client that reconnects,
// Mcp-Name) is in http.test.mjs; hostile task ids and parameters in
// hostile.test.mjs.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { CallToolResultSchema } from '@modelcontextprotocol/sdk/types.js';
import { McpError } from '@modelcontextprotocol/sdk/types.js';
import { startServer, startRaw, call, textOf, sleep, waitUntil, IS_VM } from './lib.mjs';

const T = { timeout: 180_000 };
const V = '2026-07-28';
const EXT = 'io.modelcontextprotocol/tasks';
const TASKS = ['run', 'sandbox_run', 'commit', 'fork', 'copy_in', 'copy_out'];

/* Processes of the sandbox whose argv is `sleep N` for an N in NS, counted
 * from /proc inside it (the pattern matches no grep's own argv). */
const countSleeps = (ns) => `grep -la 'sleep.\\(${ns.join('\\|')}\\)' /proc/[0-9]*/cmdline 2>/dev/null | wc -l`;
async function sleepsIn(client, sid, ns) {
  const r = await call(client, 'run', { session_id: sid, command: countSleeps(ns) });
  return Number(r.stdout.trim());
}

/* A run's result without what differs between two runs of one command
 * (its time, the log files of its output). */
function sameAsSync(r) {
  const s = structuredClone(r);
  delete s._meta;
  for (const k of ['duration_ms', 'stdout_log_path', 'stderr_log_path']) delete s.structuredContent?.[k];
  s.content = [{ type: 'text', text: JSON.stringify(s.structuredContent) }];
  return s;
}

/* A raw server (2025-11-25, initialized) with ENV and one open session,
 * closed after FN(raw, sid). */
async function withRawSession(env, fn) {
  if (typeof env === 'function') [env, fn] = [{}, env];
  const raw = startRaw({ env });
  try {
    await raw.initialize();
    await fn(raw, (await raw.tool('open_session', {})).session_id);
  } finally {
    await raw.close();
  }
}

/* Drains a callToolStream to its end: the messages it yielded. */
async function drain(stream, onCreated) {
  const seen = [];
  for await (const m of stream) {
    seen.push(m);
    if (m.type === 'taskCreated' && onCreated) await onCreated(m.task);
  }
  return seen;
}

describe('tasks, 2025-11-25 era (1.x SDK, stdio)', () => {
  let srv, c, sid, long, longId, longCreatedMs, meanwhile;
  before(async () => {
    srv = await startServer();
    c = srv.client;
    sid = (await call(c, 'open_session', {})).session_id;
  });
  after(async () => {
    await srv?.close();
  });

  test('initialize declares tasks (list, cancel, tools/call); tools/list says which tools may be tasks', T, async () => {
    assert.deepEqual(c.getServerCapabilities().tasks, { list: {}, cancel: {}, requests: { tools: { call: {} } } });
    const { tools } = await c.listTools();
    for (const t of tools) assert.equal(t.execution?.taskSupport, TASKS.includes(t.name) ? 'optional' : 'forbidden', t.name);
  });

  test('a 20 s run started as a task answers at once; another call on the same session works meanwhile', T, async () => {
    const cmd = 'i=0; while [ $i -lt 20 ]; do i=$((i+1)); echo tick$i; sleep 1; done; echo done >&2';
    const t0 = Date.now();
    let created;
    const stream = c.experimental.tasks.callToolStream({ name: 'run', arguments: { session_id: sid, command: cmd, timeout_s: 120 } },
      CallToolResultSchema, { task: { ttl: 600_000 }, timeout: 120_000 });
    long = (async () => {
      const seen = [];
      for await (const m of stream) {
        seen.push(m);
        if (m.type === 'taskCreated') created(m.task);
      }
      return seen;
    })();
    const task = await new Promise((r) => (created = r));
    longCreatedMs = Date.now() - t0;
    longId = task.taskId;
    assert.match(task.taskId, /^t[0-9a-f]{32}$/);
    assert.equal(task.status, 'working');
    assert.equal(task.ttl, 600_000);
    assert.equal(task.pollInterval, 1000);
    assert.ok(longCreatedMs < 10_000, `the task took ${longCreatedMs} ms to be created`);
    const m0 = Date.now();
    meanwhile = await call(c, 'run', { session_id: sid, command: 'echo meanwhile' });
    assert.equal(meanwhile.stdout, 'meanwhile\n');
    assert.ok(Date.now() - m0 < 15_000, 'a call on the same session waited for the task');
  });

  test('while it runs, tasks/get says working, with the output so far; list_sessions shows the session busy', T, async () => {
    const st = await waitUntil(async () => {
      const g = await c.experimental.tasks.getTask(longId);
      return g._meta?.['ignition-mcp/progress']?.stdout_bytes > 0 ? g : null;
    }, { timeoutMs: 20_000, intervalMs: 500 });
    assert.ok(st, 'no progress in tasks/get');
    assert.equal(st.status, 'working');
    assert.match(st.statusMessage, /^running for \d+ s; stdout \d+ bytes, stderr 0 bytes; last line: tick\d+$/);
    assert.ok(Date.parse(st.lastUpdatedAt) >= Date.parse(st.createdAt));
    const listed = (await call(c, 'list_sessions', {})).sessions.find((s) => s.session_id === sid);
    assert.equal(listed?.busy, true, JSON.stringify(listed));
  });

  test('tasks/result of a finished task equals what the same call returns synchronously (exit code, streams, sizes)', T, async () => {
    const args = { session_id: sid, command: 'echo out; echo err >&2; exit 3' };
    const seen = await drain(c.experimental.tasks.callToolStream({ name: 'run', arguments: args }, CallToolResultSchema, { task: {} }));
    const created = seen.find((m) => m.type === 'taskCreated').task;
    // An exit code is not a tool error: the task completed.
    const g = await c.experimental.tasks.getTask(created.taskId);
    assert.equal(g.status, 'completed');
    const viaTask = await c.experimental.tasks.getTaskResult(created.taskId, CallToolResultSchema);
    assert.deepEqual(viaTask._meta, { 'io.modelcontextprotocol/related-task': { taskId: created.taskId } });
    const sync = await c.callTool({ name: 'run', arguments: args });
    assert.deepEqual(sameAsSync(viaTask), sameAsSync(sync));
    assert.equal(viaTask.structuredContent.exit_code, 3);
  });

  test('a tool error makes the task failed; tasks/result still returns the exact error result', T, async () => {
    const args = { session_id: 'no-such-session', command: 'true' };
    const seen = await drain(c.experimental.tasks.callToolStream({ name: 'run', arguments: args }, CallToolResultSchema, { task: {} }));
    const id = seen.find((m) => m.type === 'taskCreated').task.taskId;
    const g = await c.experimental.tasks.getTask(id);
    assert.equal(g.status, 'failed');
    assert.match(g.statusMessage, /no-such-session/);
    const viaTask = await c.experimental.tasks.getTaskResult(id, CallToolResultSchema);
    const sync = await c.callTool({ name: 'run', arguments: args });
    assert.equal(viaTask.isError, true);
    assert.equal(textOf(viaTask), textOf(sync));
  });

  test('a failed task keeps its statusMessage when the error is long and not ASCII (cut on a character boundary)', T, async () => {
    const args = { session_id: sid, host_path: `no-such-dir-${'é'.repeat(900)}`, guest_path: '/tmp/x' };
    const seen = await drain(c.experimental.tasks.callToolStream({ name: 'copy_in', arguments: args }, CallToolResultSchema, { task: {} }));
    const id = seen.find((m) => m.type === 'taskCreated').task.taskId;
    const g = await c.experimental.tasks.getTask(id);
    assert.equal(g.status, 'failed');
    assert.ok(g.statusMessage?.length > 100, JSON.stringify(g).slice(0, 300));
    assert.ok(Buffer.byteLength(g.statusMessage) <= 1000);
    assert.ok(!g.statusMessage.includes('\ufffd'), 'a character was cut in two');
  });

  test('tasks/cancel stops the command at once: the task is cancelled, its processes are gone from the sandbox', T, async () => {
    let id;
    const seen = drain(c.experimental.tasks.callToolStream({ name: 'run', arguments: { session_id: sid, command: 'sleep 301 & sleep 302' } },
      CallToolResultSchema, { task: {} }), (t) => {
      id = t.taskId;
    });
    await waitUntil(() => id, { timeoutMs: 10_000 });
    assert.ok(await waitUntil(async () => (await sleepsIn(c, sid, [301, 302])) === 2, { timeoutMs: 20_000, intervalMs: 300 }), 'the task\'s sleeps never ran');
    const r = await c.experimental.tasks.cancelTask(id);
    assert.equal(r.status, 'cancelled');
    assert.match(r.statusMessage, /cancelled by tasks\/cancel/);
    await seen.catch(() => {});
    assert.ok(await waitUntil(async () => (await sleepsIn(c, sid, [301, 302])) === 0, { timeoutMs: 15_000, intervalMs: 300 }), 'a cancelled task left its processes running');
    // Terminal: cancelling again is refused, as 2025-11-25 says.
    await assert.rejects(c.experimental.tasks.cancelTask(id), (e) => e instanceof McpError && e.code === -32602 && /already in terminal status 'cancelled'/.test(e.message));
    const res = await c.experimental.tasks.getTaskResult(id, CallToolResultSchema);
    assert.equal(res.isError, true);
    assert.match(textOf(res), /cancelled by tasks\/cancel/);
  });

  test('a cancelled commit or fork tells the truth: nothing was done, or the task says it was done and returns it', T, async () => {
    const stage = `task-cancel-${process.pid}`;
    for (const [name, args] of [['commit', { session_id: sid, name: stage, replace: true }], ['fork', { session_id: sid, count: 1 }]]) {
      const before = (await call(c, 'list_sessions', {})).sessions.map((s) => s.session_id);
      let id;
      const seen = drain(c.experimental.tasks.callToolStream({ name, arguments: args }, CallToolResultSchema, { task: {} }), async (t) => {
        id = t.taskId;
        await c.experimental.tasks.cancelTask(id);
      });
      await seen.catch(() => {});
      await waitUntil(() => id, { timeoutMs: 10_000 });
      // The call ends soon after the cancel; then what the task says is final.
      const g = await waitUntil(async () => {
        const x = await c.experimental.tasks.getTask(id);
        return /already done its work/.test(x.statusMessage ?? '') || x.statusMessage === 'cancelled by tasks/cancel; its work was stopped' ? x : null;
      }, { timeoutMs: 60_000, intervalMs: 300 });
      assert.equal(g.status, 'cancelled');
      await sleep(IS_VM ? 3000 : 1000);
      const final = await c.experimental.tasks.getTask(id);
      const res = await c.experimental.tasks.getTaskResult(id, CallToolResultSchema);
      const after = (await call(c, 'list_sessions', {})).sessions.map((s) => s.session_id);
      const stages = (await call(c, 'stage_list', {})).stages.map((s) => s.name);
      if (/already done its work/.test(final.statusMessage)) {
        assert.equal(res.isError, false, textOf(res));
        if (name === 'commit') assert.ok(stages.includes(stage), 'the task says the stage was saved, but it is not there');
        else for (const s of res.structuredContent.sessions) assert.ok(after.includes(s.session_id), `the fork ${s.session_id} the task returned is not open`);
      } else {
        assert.equal(res.isError, true);
        if (name === 'commit') assert.ok(!stages.includes(stage), 'the task says nothing was saved, but the stage is there');
        else assert.deepEqual(after.sort(), before.sort(), 'the task says the fork was stopped, but new sessions are open');
      }
      for (const s of after.filter((x) => !before.includes(x))) await call(c, 'close', { session_id: s });
      if (stages.includes(stage)) await call(c, 'stage_rm', { name: stage });
    }
  });

  test('closing or resetting a session cancels its tasks, saying so', T, async () => {
    for (const what of ['close', 'reset']) {
      const s2 = (await call(c, 'open_session', {})).session_id;
      let id;
      const seen = drain(c.experimental.tasks.callToolStream({ name: 'run', arguments: { session_id: s2, command: 'sleep 303' } },
        CallToolResultSchema, { task: {} }), (t) => {
        id = t.taskId;
      });
      await waitUntil(() => id, { timeoutMs: 10_000 });
      // A close or reset that is refused cancels nothing.
      const refused = await c.callTool({ name: what, arguments: { session_id: s2, ...(what === 'reset' ? { stage: 'no-such-stage' } : { bogus: 1 }) } });
      assert.equal(refused.isError, true, JSON.stringify(refused).slice(0, 300));
      assert.equal((await c.experimental.tasks.getTask(id)).status, 'working');
      await call(c, what, { session_id: s2 });
      const g = await c.experimental.tasks.getTask(id);
      assert.equal(g.status, 'cancelled', JSON.stringify(g));
      assert.equal(g.statusMessage, `cancelled: session '${s2}' was ${what === 'close' ? 'closed' : 'reset'}`);
      await seen.catch(() => {});
      if (what === 'reset') {
        assert.equal(await sleepsIn(c, s2, [303]), 0);
        await call(c, 'close', { session_id: s2 });
      }
    }
  });

  test('the 20 s task ends completed with its whole output; tasks/list lists this client\'s tasks', T, async () => {
    const seen = await long;
    const types = seen.map((m) => m.type);
    assert.equal(types[0], 'taskCreated');
    assert.ok(types.includes('taskStatus'), `the SDK polled nothing: ${types}`);
    assert.equal(types.at(-1), 'result', JSON.stringify(seen.at(-1)).slice(0, 500));
    const r = seen.at(-1).result;
    assert.equal(r.structuredContent.stdout, Array.from({ length: 20 }, (_, i) => `tick${i + 1}\n`).join(''));
    assert.equal(r.structuredContent.stderr, 'done\n');
    assert.ok(r.structuredContent.duration_ms >= 19_000);
    const g = await c.experimental.tasks.getTask(longId);
    assert.equal(g.status, 'completed');
    assert.equal(g.statusMessage, undefined);
    const { tasks } = await c.experimental.tasks.listTasks();
    assert.ok(tasks.some((t) => t.taskId === longId && t.status === 'completed'), JSON.stringify(tasks).slice(0, 500));
    assert.ok(tasks.length >= 6, `${tasks.length} tasks listed`);
  });

  test('a copy_out and a commit run as tasks too', T, async () => {
    const seen = await drain(c.experimental.tasks.callToolStream({ name: 'commit', arguments: { session_id: sid, name: `task-stage-${process.pid}`, replace: true } },
      CallToolResultSchema, { task: {}, timeout: 170_000 }));
    const last = seen.at(-1);
    assert.equal(last.type, 'result', JSON.stringify(last).slice(0, 500));
    assert.equal(last.result.structuredContent.stage, `task-stage-${process.pid}`);
    await call(c, 'stage_rm', { name: `task-stage-${process.pid}` });
  });
});

describe('tasks, 2026-07-28 era with the Tasks extension (raw lines, stdio)', () => {
  let raw, sid;
  let n = 0;
  const envelope = (ext = true) => ({
    'io.modelcontextprotocol/protocolVersion': V,
    'io.modelcontextprotocol/clientCapabilities': ext ? { extensions: { [EXT]: {} } } : {},
    'io.modelcontextprotocol/clientInfo': { name: 'ign-e2e-tasks', version: '0.0.1' },
  });
  const req = (method, params = {}, ext = true) => raw.request(method, { ...params, _meta: envelope(ext) }, { id: `m${++n}`, timeoutMs: 60_000 });
  const callTool = (name, args, ext = true, extra = {}) => req('tools/call', { name, arguments: args, ...extra }, ext);

  before(async () => {
    raw = startRaw();
    const r = await callTool('open_session', {}, false);
    sid = r.result.structuredContent.session_id;
  });
  after(async () => {
    await raw?.close();
  });

  test('server/discover declares the extension; tools/list of this era has no execution field', T, async () => {
    const d = await req('server/discover', {}, false);
    assert.deepEqual(d.result.capabilities.extensions, { [EXT]: {} });
    assert.equal(d.result.capabilities.tasks, undefined);
    const l = await req('tools/list', {}, true);
    for (const t of l.result.tools) assert.equal(t.execution, undefined, t.name);
  });

  test('without the extension a run answers synchronously, as before; with it, a task (resultType "task", ttlMs, pollIntervalMs)', T, async () => {
    const sync = await callTool('run', { session_id: sid, command: 'echo hi' }, false);
    assert.equal(sync.result.resultType, 'complete');
    assert.equal(sync.result.structuredContent.stdout, 'hi\n');
    const r = await callTool('run', { session_id: sid, command: 'sleep 3; echo hi' });
    const t = r.result;
    assert.equal(t.resultType, 'task', JSON.stringify(r));
    assert.match(t.taskId, /^t[0-9a-f]{32}$/);
    assert.equal(t.status, 'working');
    assert.equal(t.ttlMs, 3_600_000);
    assert.equal(t.pollIntervalMs, 1000);
    assert.equal(t.task, undefined);
    assert.equal(t.ttl, undefined);
    const working = await req('tasks/get', { taskId: t.taskId });
    assert.equal(working.result.status, 'working');
    assert.equal(working.result.result, undefined);
    const done = await waitUntil(async () => {
      const g = await req('tasks/get', { taskId: t.taskId });
      return g.result?.status === 'completed' ? g : null;
    }, { timeoutMs: 30_000, intervalMs: 500 });
    assert.ok(done, 'the task never completed');
    assert.equal(done.result.resultType, 'complete');
    assert.equal(done.result.result.structuredContent.stdout, 'hi\n');
    const { resultType: _r, _meta: _m, ...plain } = sync.result;
    assert.deepEqual(sameAsSync(done.result.result), sameAsSync(plain));
  });

  test('a tool error is a completed task whose result has isError (this era keeps failed for JSON-RPC errors)', T, async () => {
    const t = (await callTool('run', { session_id: 'no-such-session', command: 'true' })).result;
    const g = await waitUntil(async () => {
      const x = await req('tasks/get', { taskId: t.taskId });
      return x.result?.status !== 'working' ? x : null;
    }, { timeoutMs: 20_000, intervalMs: 200 });
    assert.equal(g.result.status, 'completed');
    assert.equal(g.result.result.isError, true);
    assert.match(textOf(g.result.result), /no-such-session/);
  });

  test('tasks/cancel answers an empty acknowledgement and ends the command; tasks/update is acknowledged and ignored', T, async () => {
    const t = (await callTool('run', { session_id: sid, command: 'sleep 304' })).result;
    await waitUntil(async () => (await callTool('run', { session_id: sid, command: countSleeps([304]) }, false)).result.structuredContent.stdout.trim() === '1', { timeoutMs: 20_000, intervalMs: 300 });
    const u = await req('tasks/update', { taskId: t.taskId, inputResponses: { x: { action: 'accept' } } });
    assert.deepEqual(Object.keys(u.result).sort(), ['_meta', 'resultType']);
    const a = await req('tasks/cancel', { taskId: t.taskId });
    assert.equal(a.result.resultType, 'complete');
    assert.equal(a.result.status, undefined);
    assert.equal((await req('tasks/get', { taskId: t.taskId })).result.status, 'cancelled');
    assert.ok(await waitUntil(async () => (await callTool('run', { session_id: sid, command: countSleeps([304]) }, false)).result.structuredContent.stdout.trim() === '0', { timeoutMs: 15_000, intervalMs: 300 }), 'the cancelled command still runs');
  });

  test('without the extension the task methods answer -32021; tasks/result and tasks/list are not of this era (-32601)', T, async () => {
    const t = (await callTool('run', { session_id: sid, command: 'true' })).result;
    for (const m of ['tasks/get', 'tasks/cancel', 'tasks/update']) {
      const e = (await req(m, { taskId: t.taskId }, false)).error;
      assert.equal(e?.code, -32021, m);
      assert.deepEqual(e.data, { requiredCapabilities: { extensions: { [EXT]: {} } } });
      assert.match(e.message, /needs the io\.modelcontextprotocol\/tasks extension/);
    }
    for (const m of ['tasks/result', 'tasks/list']) assert.equal((await req(m, { taskId: t.taskId })).error?.code, -32601, m);
  });

  test('a quick tool answers synchronously even with the extension; a legacy params.task means nothing here', T, async () => {
    const r = await callTool('list_sessions', {}, true, { task: {} });
    assert.equal(r.result.resultType, 'complete');
    assert.ok(Array.isArray(r.result.structuredContent.sessions));
  });

  test('a task made in one era is read in the other by the same owner, each in its own shape', T, async () => {
    const t = (await callTool('run', { session_id: sid, command: 'exit 1' })).result;
    await waitUntil(async () => (await req('tasks/get', { taskId: t.taskId })).result.status !== 'working', { timeoutMs: 20_000, intervalMs: 200 });
    const g = await raw.request('tasks/get', { taskId: t.taskId }, { id: `l${++n}` });
    assert.equal(g.result.status, 'completed');
    assert.equal(g.result.ttl, 3_600_000);
    assert.equal(g.result.ttlMs, undefined);
  });
});

describe('tasks at their cap (IGN_MCP_TASKS_MAX)', () => {
  test('200 tasks at once: 64 are made, the others refused with a clear error; the 64 complete; tasks/list pages them', T, async () => {
    await withRawSession({ IGN_MCP_TASKS_MAX: '64', IGN_MCP_MAX_CALLS: '256' }, async (raw, sid) => {
      const from = raw.messages.length;
      const lines = [];
      for (let i = 0; i < 200; i++) lines.push(JSON.stringify({ jsonrpc: '2.0', id: `c${i}`, method: 'tools/call', params: { name: 'run', arguments: { session_id: sid, command: `echo ${i}` }, task: {} } }));
      await raw.sendBytes(Buffer.from(lines.join('\n') + '\n'));
      const answers = await Promise.all(lines.map((_, i) => raw.response(`c${i}`, { from, timeoutMs: 120_000 })));
      const made = answers.filter((a) => a.result?.task);
      const refused = answers.filter((a) => a.error);
      assert.equal(made.length, 64);
      assert.equal(refused.length, 136);
      for (const a of refused) {
        assert.equal(a.error.code, -32603);
        assert.match(a.error.message, /too many tasks: this client holds 64, running or finished \(at most 64, IGN_MCP_TASKS_MAX\)/);
      }
      const ids = made.map((a) => a.result.task.taskId);
      assert.equal(new Set(ids).size, 64);
      const all = [];
      let cursor;
      for (let page = 0; page < 5; page++) {
        const l = await raw.request('tasks/list', cursor ? { cursor } : {}, { timeoutMs: 30_000 });
        all.push(...l.result.tasks);
        cursor = l.result.nextCursor;
        if (!cursor) break;
      }
      assert.deepEqual(all.map((t) => t.taskId).sort(), [...ids].sort());
      const done = await waitUntil(async () => {
        const l = await raw.request('tasks/list', {}, { timeoutMs: 30_000 });
        const l2 = l.result.nextCursor ? await raw.request('tasks/list', { cursor: l.result.nextCursor }, { timeoutMs: 30_000 }) : { result: { tasks: [] } };
        return [...l.result.tasks, ...l2.result.tasks].every((t) => t.status === 'completed');
      }, { timeoutMs: 120_000, intervalMs: 1000 });
      assert.ok(done, 'not every task completed');
      const outs = await Promise.all(made.slice(0, 5).map((a) => raw.request('tasks/result', { taskId: a.result.task.taskId }, { timeoutMs: 30_000 })));
      for (const [k, o] of outs.entries()) assert.equal(o.result.structuredContent.stdout, `${made[k].id.slice(1)}\n`);
      // A collected task makes room for a new one; the others hold theirs.
      const more = async (k) => raw.request('tools/call', { name: 'run', arguments: { session_id: sid, command: `echo more${k}` }, task: {} }, { timeoutMs: 30_000 });
      for (let k = 0; k < 5; k++) assert.ok((await more(k)).result?.task, `collected task ${k} made no room`);
      assert.match((await more(5)).error?.message ?? '', /too many tasks/);
      // 2026-07-28, where the server decides: past the cap the call is answered when it ends.
      const env = { 'io.modelcontextprotocol/protocolVersion': '2026-07-28', 'io.modelcontextprotocol/clientCapabilities': { extensions: { [EXT]: {} } } };
      const sync = await raw.request('tools/call', { name: 'run', arguments: { session_id: sid, command: 'echo inline' }, _meta: env }, { timeoutMs: 30_000 });
      assert.equal(sync.result.resultType, 'complete', JSON.stringify(sync).slice(0, 300));
      assert.equal(sync.result.structuredContent.stdout, 'inline\n');
      assert.deepEqual((await raw.request('ping', {})).result, {});
    });
  });
});

describe('a task past its TTL', () => {
  test('is gone: tasks/get answers as for an id nobody made', T, async () => {
    await withRawSession(async (raw, sid) => {
      const c = await raw.request('tools/call', { name: 'run', arguments: { session_id: sid, command: 'echo short' }, task: { ttl: 800 } }, { timeoutMs: 60_000 });
      const id = c.result.task.taskId;
      assert.equal(c.result.task.ttl, 800);
      const done = await waitUntil(async () => (await raw.request('tasks/get', { taskId: id })).result?.status === 'completed', { timeoutMs: 20_000, intervalMs: 100 });
      assert.ok(done, 'the task never completed');
      const gone = await waitUntil(async () => (await raw.request('tasks/get', { taskId: id })).error, { timeoutMs: 10_000, intervalMs: 200 });
      assert.equal(gone?.code, -32602);
      assert.match(gone.message, /Task not found/);
      assert.ok(Date.now() - Date.parse(c.result.task.createdAt) >= 800);
    });
  });
});

describe('a tasks/result that waits', () => {
  test('waits for the end without holding other requests; a status notification follows on stdio', T, async () => {
    await withRawSession(async (raw, sid) => {
      const c = await raw.request('tools/call', { name: 'run', arguments: { session_id: sid, command: 'sleep 2; echo late' }, task: {} }, { timeoutMs: 60_000 });
      const id = c.result.task.taskId;
      const long = await raw.request('tasks/result', { taskId: id }, { id: 'w'.repeat(300), timeoutMs: 5000 });
      assert.equal(long.error?.code, -32602);
      assert.match(long.error.message, /use an id of at most 256 characters/);
      const from = raw.messages.length;
      await raw.send({ jsonrpc: '2.0', id: 'wait', method: 'tasks/result', params: { taskId: id } });
      const p = await raw.request('ping', {}, { timeoutMs: 5000 });
      assert.deepEqual(p.result, {});
      assert.equal(raw.since(from).some((m) => m.id === 'wait'), false, 'tasks/result answered before the task ended');
      const r = await raw.response('wait', { from, timeoutMs: 60_000 });
      assert.equal(r.result.structuredContent.stdout, 'late\n');
      assert.equal(r.result._meta['io.modelcontextprotocol/related-task'].taskId, id);
      const note = raw.since(from).find((m) => m.method === 'notifications/tasks/status');
      assert.equal(note?.params?.taskId, id);
      assert.equal(note.params.status, 'completed');
    });
  });
});
