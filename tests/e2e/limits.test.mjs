// limits.test.mjs: every cap in the README's "Limits" table, one test per
// row, named after the row. Each test sets the cap small where it has a
// variable (so that the test is cheap) and shows both sides: accepted at the
// cap, refused (or cut, or killed) just past it, with the documented message.
// The first test checks that the README table and this file name the same
// rows, so a new cap cannot be documented without a test or the reverse.
//
// Two rows are tested at their defaults on the vm backend: the guest's RAM
// and its overlay are part of a warm base's fingerprint, and a new base costs
// a cold boot; tests/e2e/isolation.test.mjs also sets IGN_MCP_OVERLAY_MB=16
// on a base of its own.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import http from 'node:http';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { startServer, startRaw, call, callErr, openSession, run, sh, findProcs, uniqueSleepSecs, waitUntil, sleep, textOf, REPO, IS_NS, IS_VM, TOOLS_SKIP, SESSION_CGROUPS, AGENT } from './lib.mjs';

const T = { timeout: 120_000 };
const MiB = 1 << 20;

/* Start an SDK server with env, run fn(client, pid), close it. */
async function withServer(env, fn) {
  const s = await startServer({ env });
  try {
    await fn(s.client, s);
  } finally {
    await s.close();
  }
}

async function withRaw(env, fn) {
  const raw = startRaw({ env });
  try {
    await raw.initialize();
    await fn(raw);
  } finally {
    await raw.close();
  }
}

/* Send one line and return the response with `id`, or (id null) the next
 * error with id null. */
async function lineResponse(raw, line, id) {
  const from = raw.messages.length;
  await raw.sendLine(line);
  return raw.waitFor((m) => 'id' in m && m.id === id && ('result' in m || 'error' in m), { from, timeoutMs: 30_000, what: `response ${id}` });
}

/* A ping line padded with spaces to exactly n bytes (without the newline). */
function pingOfLength(id, n) {
  const base = `{"jsonrpc":"2.0","id":${JSON.stringify(id)},"method":"ping"}`;
  assert.ok(n >= base.length);
  return base.slice(0, -1) + ' '.repeat(n - base.length) + '}';
}

/* A ping whose params hold `values` JSON values and keys as the server
 * counts them: the characters [ { , : outside strings. */
function pingWithValues(id, values) {
  const head = `{"jsonrpc":"2.0","id":${JSON.stringify(id)},"method":"ping","params":{"a":[`;
  const fixed = (head.match(/[[{,:]/g) || []).length; // the array's [ included
  const k = values - fixed + 1; // k elements have k-1 commas
  return `${head}${Array(k).fill('0').join(',')}]}}`;
}

function deepPing(id, arrays) {
  return `{"jsonrpc":"2.0","id":${JSON.stringify(id)},"method":"ping","params":{"a":${'['.repeat(arrays)}${']'.repeat(arrays)}}}`;
}

const envOf = (n, size) => {
  // n variables whose NAME=value entries are `size` bytes each.
  const e = {};
  for (let i = 0; i < n; i++) {
    const name = `V${String(i).padStart(3, '0')}`;
    e[name] = 'v'.repeat(size - name.length - 1);
  }
  return e;
};

/* The egress caps need a sandbox that can route its traffic to the broker:
 * the agent's own probe says whether this host can (ns; a vm guest brings
 * its own kernel, and the same agent). */
function captureSkip() {
  const r = spawnSync(AGENT, ['--probe-egress'], { encoding: 'utf8', timeout: 20_000 });
  const line = `${r.stdout ?? ''}${r.stderr ?? ''}`.split('\n')[0];
  return r.status === 0 && line === 'ok' ? false : `a sandbox cannot capture its traffic here (${AGENT} --probe-egress: ${line || `status ${r.status}`})`;
}

/* A hosts file naming good.test 127.0.0.1 (IGN_MCP_EGRESS_HOSTS), and the
 * settings that let a session reach it: {env, remove()}. */
function goodTest(extra = {}) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-limits-egress-'));
  fs.writeFileSync(path.join(dir, 'hosts'), '127.0.0.1 good.test\n');
  return {
    env: { IGN_MCP_EGRESS_HOSTS: path.join(dir, 'hosts'), IGN_MCP_NET_PRIVATE: 'host', ...extra },
    remove: () => fs.rmSync(dir, { recursive: true, force: true }),
  };
}

const listening = (srv) => new Promise((res) => srv.listen(0, '127.0.0.1', () => res(srv.address().port)));

/* The reasons of a session's refused events (network_log). */
async function deniedReasons(c, sid) {
  const log = await call(c, 'network_log', { session_id: sid });
  return log.denied.map((e) => e.reason ?? '');
}

const ROWS = [
  {
    row: 'message size',
    run: () =>
      withRaw({ IGN_MCP_MAX_MESSAGE: 4096 }, async (raw) => {
        const ok = await lineResponse(raw, pingOfLength('at', 4096), 'at');
        assert.deepEqual(ok.result, {}, 'a 4096-byte line under IGN_MCP_MAX_MESSAGE=4096');
        // Answered with its own id, found while the line was dropped.
        const e = await lineResponse(raw, pingOfLength('past', 4097), 'past');
        assert.equal(e.error.code, -32600);
        assert.match(e.error.message, /^message too large: over 4097 bytes \(IGN_MCP_MAX_MESSAGE is 4096\); it was discarded\. Send large files in pieces\.$/);
        assert.ok(!raw.messages.some((m) => m.msg.id === 'past' && 'result' in m.msg), 'the oversize request ran');
      }),
  },
  {
    row: 'JSON values per message',
    run: () =>
      withRaw({}, async (raw) => {
        const ok = await lineResponse(raw, pingWithValues('at', 100_000), 'at');
        assert.deepEqual(ok.result, {}, '100000 values');
        const e = await lineResponse(raw, pingWithValues('past', 100_001), null);
        assert.equal(e.error.code, -32600);
        assert.match(e.error.message, /^message refused: it holds more than 100000 JSON values and keys, which no MCP request needs; send large data as one string/);
      }),
  },
  {
    row: 'JSON nesting depth',
    run: () =>
      withRaw({}, async (raw) => {
        // The message is one level, params another: 2046 arrays reach 2048.
        const ok = await lineResponse(raw, deepPing('at', 2046), 'at');
        assert.deepEqual(ok.result, {}, 'nesting 2048 deep');
        const e = await lineResponse(raw, deepPing('past', 2047), null);
        assert.equal(e.error.code, -32700);
        assert.match(e.error.message, /^parse error at byte \d+: maximum parsing depth reached/);
      }),
  },
  {
    row: 'inline output',
    run: () =>
      withServer({ IGN_MCP_OUTPUT_CAP: 1000 }, async (c) => {
        const sid = await openSession(c);
        const at = await run(c, sid, "head -c 1000 /dev/zero | tr '\\0' a; head -c 1000 /dev/zero | tr '\\0' b >&2");
        assert.equal(at.stdout, 'a'.repeat(1000));
        assert.equal(at.stderr, 'b'.repeat(1000));
        assert.equal(at.stdout_truncated, false);
        assert.equal(at.stderr_truncated, false);
        const past = await run(c, sid, "head -c 1001 /dev/zero | tr '\\0' a; head -c 5000 /dev/zero | tr '\\0' b >&2");
        assert.equal(past.stdout, 'a'.repeat(1000), 'stdout is cut to the cap');
        assert.equal(past.stdout_bytes, 1001, 'stdout_bytes is the exact total');
        assert.equal(past.stdout_truncated, true);
        assert.equal(past.stderr.length, 1000);
        assert.equal(past.stderr_bytes, 5000);
        assert.equal(past.stderr_truncated, true);
      }),
  },
  {
    row: 'log size',
    run: () =>
      withServer({ IGN_MCP_LOG_CAP: 4096 }, async (c) => {
        const sid = await openSession(c);
        const at = await run(c, sid, "head -c 4096 /dev/zero | tr '\\0' a");
        assert.equal(at.log_error, undefined);
        assert.equal(fs.readFileSync(at.stdout_log_path, 'utf8'), 'a'.repeat(4096), 'a log at the cap is whole, without a marker');
        const past = await run(c, sid, "head -c 5000 /dev/zero | tr '\\0' b");
        assert.equal(past.exit_code, 0, 'the run is unaffected');
        assert.equal(past.stdout_bytes, 5000);
        const log = fs.readFileSync(past.stdout_log_path, 'utf8');
        assert.ok(log.startsWith('b'.repeat(4096)), 'the first 4096 bytes are kept');
        assert.match(log.slice(4096), /^\n?\[ignition-mcp: log cut at 4096 bytes; the run wrote 5000\]\n?$/);
      }),
  },
  {
    row: 'file size',
    run: () =>
      withServer({ IGN_MCP_MAX_FILE: 1024 }, async (c) => {
        const sid = await openSession(c);
        const w = await call(c, 'write_file', { session_id: sid, path: '/root/at', content_base64: Buffer.alloc(1024, 7).toString('base64') });
        assert.equal(w.bytes, 1024);
        const e = await callErr(c, 'write_file', { session_id: sid, path: '/root/past', content_base64: Buffer.alloc(1025, 7).toString('base64') });
        assert.match(e, /^the file is 1025 bytes, over the 1024 byte cap for one file \(IGN_MCP_MAX_FILE\); split it into pieces$/);
        // Far past the cap it is refused before decoding, with the same advice.
        const e2 = await callErr(c, 'write_file', { session_id: sid, path: '/root/past', content_base64: Buffer.alloc(4096, 7).toString('base64') });
        assert.match(e2, /content_base64 decodes to about \d+ bytes, over the 1024 byte cap for one file \(IGN_MCP_MAX_FILE\); split the file/);
        assert.equal((await sh(c, sid, 'wc -c < /root/at; ls /root/past 2>&1 || true')).split('\n')[0].trim(), '1024');
      }),
  },
  {
    row: 'read piece',
    run: async () => {
      await withServer({}, async (c) => {
        const sid = await openSession(c);
        await sh(c, sid, `head -c ${2 * MiB + 1} /dev/zero > /root/big`);
        const r = await call(c, 'read_file', { session_id: sid, path: '/root/big', max_bytes: 2 * MiB });
        assert.equal(r.bytes, 2 * MiB);
        assert.equal(r.size, 2 * MiB + 1);
        assert.equal(r.eof, false);
        const e = await callErr(c, 'read_file', { session_id: sid, path: '/root/big', max_bytes: 2 * MiB + 1 });
        assert.match(e, /^read_file: 'max_bytes' is 2097153, outside its range 1\.\.2097152; give a value in that range$/);
      });
      // A smaller IGN_MCP_MAX_FILE lowers the piece too.
      await withServer({ IGN_MCP_MAX_FILE: 1024 }, async (c) => {
        const sid = await openSession(c);
        await sh(c, sid, 'head -c 2000 /dev/zero > /root/f');
        assert.equal((await call(c, 'read_file', { session_id: sid, path: '/root/f', max_bytes: 1024 })).bytes, 1024);
        assert.match(await callErr(c, 'read_file', { session_id: sid, path: '/root/f', max_bytes: 1025 }), /'max_bytes' is 1025, outside its range 1\.\.1024/);
      });
    },
  },
  {
    row: 'stdin size',
    run: () =>
      withServer({ IGN_MCP_MAX_STDIN: 1024 }, async (c) => {
        const sid = await openSession(c);
        assert.equal(await sh(c, sid, 'wc -c', { stdin: 's'.repeat(1024) }), '1024\n');
        const e = await callErr(c, 'run', { session_id: sid, command: 'wc -c', stdin: 's'.repeat(1025) });
        assert.match(e, /^run: 'stdin' is 1025 bytes, over the 1024 byte cap \(IGN_MCP_MAX_STDIN\); write the input to a file with write_file and redirect it instead, or name a file on the host with 'stdin_file'$/);
      }),
  },
  {
    row: 'calls in progress',
    run: async () => {
      const busy = /^server busy: (\d+) calls in progress hold (\d+) bytes of requests and results, and this one may take (\d+) \(at most (\d+) calls and (\d+) bytes, IGN_MCP_MAX_CALLS and 4 x IGN_MCP_MAX_MESSAGE\); wait for a call to finish, then retry$/;
      // By count: 3 calls may run at once; a 4th sent while they do is refused.
      await withServer({ IGN_MCP_MAX_CALLS: 3 }, async (c) => {
        const sid = await openSession(c);
        const held = [1, 2, 3].map((i) => run(c, sid, `sleep 3; echo ${i}`));
        const m = (await callErr(c, 'run', { session_id: sid, command: 'echo no' })).match(busy);
        assert.ok(m, 'the 4th call is refused as busy');
        assert.equal(m[1], '3');
        assert.equal(m[4], '3');
        const done = await Promise.all(held);
        assert.deepEqual(done.map((r) => r.stdout), ['1\n', '2\n', '3\n'], 'the calls in progress were not disturbed');
        assert.equal((await run(c, sid, 'echo again')).stdout, 'again\n', 'once they finish, calls run again');
      });
      // A call's share is given back before its result is sent: a client
      // that sends its next call the moment it has a result is never told
      // the server is busy with the call it just got.
      await withServer({ IGN_MCP_MAX_CALLS: 1 }, async (c) => {
        const sid = await openSession(c);
        for (let i = 0; i < 40; i++) {
          const r = await c.callTool({ name: i % 2 ? 'list_sessions' : 'run', arguments: i % 2 ? {} : { session_id: sid, command: 'true' } });
          assert.ok(!r.isError, `call ${i} right after the previous result: ${textOf(r)}`);
        }
      });
      // By bytes: IGN_MCP_MAX_MESSAGE=65536 lets calls hold 262144 bytes of
      // requests and results. A run counts its request (60000 bytes of stdin
      // here) and its output at the cap, escaped, in two copies (24 x
      // IGN_MCP_OUTPUT_CAP): about 85 KB, so three fit and a fourth does not.
      await withServer({ IGN_MCP_MAX_MESSAGE: 65536, IGN_MCP_OUTPUT_CAP: 1024 }, async (c) => {
        const sid = await openSession(c);
        const stdin = 'x'.repeat(60_000);
        const held = [1, 2, 3].map(() => run(c, sid, 'wc -c; sleep 3', { stdin }));
        const m = (await callErr(c, 'run', { session_id: sid, command: 'wc -c', stdin })).match(busy);
        assert.ok(m, 'the 4th call is refused as busy');
        assert.equal(m[1], '3');
        const cost = Number(m[3]);
        assert.ok(cost > 60_000 + 24 * 1024 && cost < 60_000 + 24 * 1024 + 1000, `this call's cost ${cost}`);
        assert.ok(Math.abs(Number(m[2]) - 3 * cost) < 30, `three calls like it are held: ${m[2]} vs 3 x ${cost}`);
        assert.ok(3 * cost <= 262_144 && 4 * cost > 262_144);
        assert.equal(m[5], '262144');
        for (const r of await Promise.all(held)) assert.equal(r.stdout.trim(), '60000');
        assert.equal((await run(c, sid, 'wc -c', { stdin })).stdout.trim(), '60000');
      });
    },
  },
  {
    row: 'tasks',
    run: () =>
      withServer({ IGN_MCP_TASKS_MAX: 2 }, async (c) => {
        const sid = await openSession(c);
        const { CallToolResultSchema } = await import('@modelcontextprotocol/sdk/types.js');
        const start = async () => {
          for await (const m of c.experimental.tasks.callToolStream({ name: 'run', arguments: { session_id: sid, command: 'sleep 30' } }, CallToolResultSchema, { task: {} })) {
            if (m.type === 'taskCreated') return m.task.taskId;
            if (m.type === 'error') throw m.error;
          }
          return null;
        };
        const a = await start();
        await start();
        const e = await start().then(() => null, (x) => x);
        assert.match(String(e?.message), /too many tasks: this client holds 2, running or finished \(at most 2, IGN_MCP_TASKS_MAX\); a finished task is kept until its result is collected \(tasks\/result\) or its TTL passes/);
        // A collected task makes room, once its call has ended.
        await c.experimental.tasks.cancelTask(a);
        await c.experimental.tasks.getTaskResult(a, CallToolResultSchema);
        const made = await waitUntil(() => start().catch(() => null), { timeoutMs: 15_000, intervalMs: 200 });
        assert.match(made ?? '', /^t[0-9a-f]{32}$/);
      }),
  },
  {
    row: 'sessions',
    run: () =>
      withServer({ IGN_MCP_MAX_SESSIONS: 2 }, async (c) => {
        const a = await openSession(c);
        await openSession(c);
        const e = await callErr(c, 'open_session', {});
        assert.match(e, /^cannot open a session: the limit of 2 open sessions is reached \(IGN_MCP_MAX_SESSIONS\)\. Close one you no longer need with close\(session_id\)/);
        await call(c, 'close', { session_id: a });
        await openSession(c);
      }),
  },
  {
    row: 'memory',
    run: () =>
      withServer(IS_NS ? { IGN_MCP_MEMORY_MB: 64 } : {}, async (c) => {
        // Without a cgroup (a user on cgroup v1) the session's total is not
        // limited, each process's data is: the hog gets ENOMEM instead of
        // being killed.
        const perProcess = IS_NS && !SESSION_CGROUPS;
        // awk keeps every doubling of a string: about twice the last one in
        // all. ns: a 64 MiB cgroup; vm: the guest's default 256 MiB of RAM.
        const hog = (n) => `awk 'BEGIN { s = "aaaaaaaaaaaaaaaa"; for (i = 0; i < ${n}; i++) { t[i] = s; s = s s }; print "survived", length(s) }'`;
        const sid = await openSession(c);
        const small = IS_NS ? 19 : 21; // 8 MiB (ns) / 32 MiB (vm) at last: well under the cap
        const ok = await run(c, sid, hog(small), { timeout_s: 60 });
        assert.equal(ok.stdout, `survived ${16 * 2 ** small}\n`, JSON.stringify(ok).slice(0, 300));
        const past = await run(c, sid, hog(40), { timeout_s: 60 }, { timeout: 120_000 });
        assert.ok(!past.stdout.includes('survived'), `the hog survived: ${JSON.stringify(past).slice(0, 300)}`);
        if (perProcess) {
          assert.match(await sh(c, sid, 'cat /proc/self/limits'), /^Max data size\s+67108864\s+67108864\s+bytes/m);
          assert.equal(past.exit_code, 1, `the hog did not fail on its own: ${JSON.stringify(past).slice(0, 300)}`);
          assert.match(past.stderr, /out of memory/);
        } else {
          assert.equal(past.exit_code, 137, `not killed by SIGKILL: ${JSON.stringify(past).slice(0, 300)}`);
          assert.equal(past.signal, 'SIGKILL');
        }
        assert.equal(await sh(c, sid, 'echo alive'), 'alive\n');
      }),
  },
  {
    row: 'processes',
    run: () =>
      IS_NS
        ? withServer({ IGN_MCP_PIDS: 16 }, async (c) => {
            const sid = await openSession(c);
            const n = uniqueSleepSecs();
            // A few processes fit; 40 do not (the agent and the shell count too).
            const few = await run(c, sid, `for i in 1 2 3 4 5; do sleep ${n} & done; echo started`);
            assert.equal(few.stdout, 'started\n');
            // The last one may still be between fork and exec.
            assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length === 5), `${findProcs(['sleep', String(n)]).length} of 5 sleeps running`);
            const many = await run(c, sid, `i=0; while [ $i -lt 40 ]; do sleep ${n + 1} & i=$((i+1)); done; echo spawned-all`, { timeout_s: 20 });
            assert.match(many.stderr, /can't fork|Resource temporarily unavailable/i, JSON.stringify(many).slice(0, 300));
            assert.ok(findProcs(['sleep', String(n + 1)]).length <= 16 - 5, 'more processes than IGN_MCP_PIDS');
            await call(c, 'reset', { session_id: sid });
            assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length + findProcs(['sleep', String(n + 1)]).length === 0), 'sleeps outlived the reset');
          })
        : withServer({}, async (c) => {
            // The guest kernel's own limits, sized by its RAM.
            const sid = await openSession(c);
            const [pidMax, threadsMax] = (await sh(c, sid, 'cat /proc/sys/kernel/pid_max /proc/sys/kernel/threads-max')).trim().split('\n').map(Number);
            assert.equal(pidMax, 32768);
            assert.ok(threadsMax > 1000 && threadsMax < 4096, `threads-max ${threadsMax}`);
          }),
  },
  {
    row: 'disk (overlay)',
    run: () =>
      withServer(IS_NS ? { IGN_MCP_OVERLAY_MB: 16 } : {}, async (c) => {
        // ns: IGN_MCP_OVERLAY_MB=16; vm: the default 1024 capped at half the
        // guest RAM, 128 MiB.
        const mb = IS_NS ? 16 : 128;
        const sid = await openSession(c);
        const size = Number((await sh(c, sid, "df -k / | awk 'NR == 2 { print $2 }'")).trim());
        assert.ok(Math.abs(size - mb * 1024) <= mb * 1024 * 0.02, `the overlay is ${size} KiB, not ${mb} MiB`);
        const half = await run(c, sid, `dd if=/dev/zero of=/root/half bs=1M count=${mb / 2} 2>&1; echo rc=$?`, { timeout_s: 60 });
        assert.match(half.stdout, /rc=0/, half.stdout);
        const full = await run(c, sid, `dd if=/dev/zero of=/root/full bs=1M count=${mb} 2>&1; echo rc=$?`, { timeout_s: 60 });
        assert.match(full.stdout, /No space left on device/);
        assert.doesNotMatch(full.stdout, /rc=0/);
        assert.equal(await sh(c, sid, 'rm /root/half /root/full; echo ok > /root/f; cat /root/f'), 'ok\n');
      }),
  },
  {
    row: 'run timeout',
    run: () =>
      withServer({}, async (c) => {
        const tools = (await c.listTools()).tools;
        const ts = tools.find((t) => t.name === 'run').inputSchema.properties.timeout_s;
        assert.deepEqual([ts.minimum, ts.maximum, ts.default], [1, 3600, 30], 'the schema states the range and default');
        const sid = await openSession(c);
        const t0 = Date.now();
        const r = await run(c, sid, 'sleep 5; echo late', { timeout_s: 1 });
        assert.equal(r.timed_out, true);
        assert.equal(r.exit_code, 137);
        assert.equal(r.stdout, '');
        assert.ok(Date.now() - t0 < 4500, `timeout_s 1 took ${Date.now() - t0} ms`);
        assert.equal((await run(c, sid, 'echo ok', { timeout_s: 3600 })).stdout, 'ok\n');
        for (const [bad, re] of [
          [3601, /^run: 'timeout_s' is 3601, outside its range 1\.\.3600; give a value in that range$/],
          [0, /^run: 'timeout_s' is 0, outside its range 1\.\.3600/],
        ]) {
          assert.match(await callErr(c, 'run', { session_id: sid, command: 'true', timeout_s: bad }), re);
        }
      }),
  },
  {
    row: 'hibernated sessions',
    run: () =>
      withServer({ IGN_MCP_HIBERNATE_MAX_MB: 1 }, async (c) => {
        const sid = await openSession(c);
        await sh(c, sid, 'head -c 2000000 /dev/urandom > /root/blob');
        const e = await callErr(c, 'hibernate', { session_id: sid });
        assert.match(e, new RegExp(`^session '${sid}' takes \\d+ bytes hibernated, more than IGN_MCP_HIBERNATE_MAX_MB \\(1 MiB\\) allows; it was not hibernated and goes on running$`), e);
        assert.equal(await sh(c, sid, 'wc -c < /root/blob'), '2000000\n');
        // The eviction of the owner's oldest: hibernate.test.mjs 'IGN_MCP_HIBERNATE_MAX_MB: ...' (ns).
      }),
  },
  {
    row: 'idle sessions',
    run: () =>
      withServer({ IGN_MCP_IDLE_SECS: 2 }, async (c) => {
        const sid = await openSession(c);
        await sleep(1000);
        assert.equal(await sh(c, sid, 'echo used'), 'used\n', 'a session used within IGN_MCP_IDLE_SECS lives');
        const state = async () => (await call(c, 'list_sessions', {})).sessions.find((s) => s.session_id === sid)?.state;
        assert.ok(await waitUntil(async () => (await state()) === 'hibernated', { timeoutMs: 15_000, intervalMs: 500 }), 'the idle session was not hibernated');
      }).then(() =>
        withServer({ IGN_MCP_IDLE_SECS: 2, IGN_MCP_IDLE_ACTION: 'close' }, async (c) => {
          const sid = await openSession(c);
          const reaped = await waitUntil(async () => !(await call(c, 'list_sessions', {})).sessions.some((s) => s.session_id === sid), { timeoutMs: 15_000, intervalMs: 500 });
          assert.ok(reaped, 'the idle session was not reaped');
          const e = await callErr(c, 'run', { session_id: sid, command: 'true' });
          assert.match(e, new RegExp(`^unknown session_id '${sid}': .*reaped after 2 s idle\\)\\. Call open_session`));
        })),
  },
  {
    row: 'commands at once',
    run: () =>
      withServer({}, async (c) => {
        const sid = await openSession(c);
        const rs = await Promise.all(Array.from({ length: 70 }, () => c.callTool({ name: 'run', arguments: { session_id: sid, command: 'sleep 3; echo done' } }, undefined, { timeout: 60_000 })));
        const ok = rs.filter((r) => r.isError !== true);
        const refused = rs.filter((r) => r.isError === true).map(textOf);
        assert.equal(ok.length, 64, `${ok.length} of 70 ran: ${refused.slice(0, 2).join(' / ')}`);
        for (const r of ok) assert.equal(r.structuredContent.stdout, 'done\n');
        for (const e of refused) assert.match(e, new RegExp(`^run failed in session '${sid}': too many commands running \\(64 at once\\); wait for one to finish or kill one$`));
        assert.equal(await sh(c, sid, 'echo alive'), 'alive\n');
      }),
  },
  {
    row: 'command length',
    run: () =>
      withServer({}, async (c) => {
        const sid = await openSession(c);
        const cmd = (n, head = 'echo ok') => `${head} #${'x'.repeat(n - head.length - 2)}`;
        assert.equal(cmd(122880).length, 122880);
        assert.equal((await run(c, sid, cmd(122880))).stdout, 'ok\n');
        // At its cap, with cwd and env at theirs, the request still fits.
        const env = envOf(4, 32767);
        const all = await run(c, sid, cmd(122880, 'echo ${#V000}'), { cwd: '/root', env });
        assert.equal(all.stdout, `${32767 - 5}\n`);
        const e = await callErr(c, 'run', { session_id: sid, command: cmd(122881) });
        assert.match(e, /^run: 'command' is 122881 bytes, over its cap of 122880 bytes; put a long script in a file with write_file and run that file$/);
      }),
  },
  {
    row: 'env variables',
    run: () =>
      withServer({}, async (c) => {
        const sid = await openSession(c);
        const env = envOf(256, 8);
        assert.equal(await sh(c, sid, 'env | grep -c "^V[0-9][0-9][0-9]=vvv$"', { env }), '256\n');
        const e = await callErr(c, 'run', { session_id: sid, command: 'true', env: envOf(257, 8) });
        assert.match(e, /^run: 'env' has 257 variables, over the cap of 256; pass fewer/);
      }),
  },
  {
    row: 'env variable size',
    run: () =>
      withServer({}, async (c) => {
        const sid = await openSession(c);
        assert.equal(await sh(c, sid, 'echo ${#BIG}', { env: { BIG: 'b'.repeat(32768 - 4) } }), `${32768 - 4}\n`);
        const e = await callErr(c, 'run', { session_id: sid, command: 'true', env: { BIG: 'b'.repeat(32768 - 3) } });
        assert.match(e, /^run: env\['BIG'\] is 32769 bytes as NAME=value, over the cap of 32768 for one variable; write long values to a file/);
      }),
  },
  {
    row: 'env size in all',
    run: () =>
      withServer({}, async (c) => {
        const sid = await openSession(c);
        // Four NAME=value entries of 32767 bytes, each counted with its NUL:
        // 131072 bytes.
        const at = envOf(4, 32767);
        assert.equal(await sh(c, sid, 'echo ${#V003}', { env: at }), `${32767 - 5}\n`);
        const past = { ...at, V003: `${at.V003}v` };
        const e = await callErr(c, 'run', { session_id: sid, command: 'true', env: past });
        assert.match(e, /^run: 'env' is 131073 bytes in all, over the cap of 131072; write long values to a file/);
      }),
  },
  {
    row: 'path length',
    run: () =>
      withServer({}, async (c) => {
        const sid = await openSession(c);
        // Paths in components of at most 255 bytes (NAME_MAX).
        const pathOf = (n, last) => {
          let p = '/root';
          while (p.length < n - 201) p += `/${'d'.repeat(200)}`;
          return `${p}/${last.repeat(n - p.length - 1)}`;
        };
        // write_file: 4083 bytes (it writes DIR/.NAME.ign-XXXXXX first).
        const w = pathOf(4083, 'w');
        assert.equal(w.length, 4083);
        assert.equal((await call(c, 'write_file', { session_id: sid, path: w, content_base64: Buffer.from('deep\n').toString('base64') })).bytes, 5);
        assert.match(await callErr(c, 'write_file', { session_id: sid, path: `${w}x`, content_base64: '' }), /^write_file: 'path' is 4084 bytes, over its cap of 4083 bytes; use a shorter path$/);
        // read_file and cwd: 4095 bytes, PATH_MAX less its NUL.
        const r = pathOf(4095, 'r');
        assert.equal(r.length, 4095);
        await sh(c, sid, `echo deeper > ${r}`);
        const got = await call(c, 'read_file', { session_id: sid, path: r });
        assert.equal(Buffer.from(got.content_base64, 'base64').toString(), 'deeper\n');
        assert.match(await callErr(c, 'read_file', { session_id: sid, path: `${r}x` }), /^read_file: 'path' is 4096 bytes, over its cap of 4095 bytes; use a shorter path$/);
        const d = pathOf(4095, 'e');
        await sh(c, sid, `mkdir ${d}`);
        assert.equal(await sh(c, sid, 'pwd | wc -c', { cwd: d }), '4096\n', 'a cwd of 4095 bytes');
        assert.match(await callErr(c, 'run', { session_id: sid, command: 'pwd', cwd: `${d}x` }), /^run: 'cwd' is 4096 bytes, over its cap of 4095 bytes; use a shorter path$/);
      }),
  },
  {
    row: 'open files',
    run: () =>
      withServer({}, async (c) => {
        const sid = await openSession(c);
        // ns: 1024 soft and hard, set by the agent; vm: the guest kernel's
        // defaults for its init, 1024 soft.
        assert.equal(await sh(c, sid, 'ulimit -n'), '1024\n');
        if (IS_NS) {
          assert.equal(await sh(c, sid, 'ulimit -Hn'), '1024\n');
          assert.match((await run(c, sid, 'ulimit -n 1025; echo rc=$?')).stdout, /rc=[1-9]/, 'the limit could be raised');
        }
        // Descriptors 0..1023 all open: fine; one more open: EMFILE.
        const fill = 'i=3; while [ $i -lt 1024 ]; do eval "exec $i</bin/busybox" || break; i=$((i+1)); done; echo filled $i';
        const r = await run(c, sid, `${fill}; head -c 1 /bin/busybox > /dev/null; echo rc=$?`);
        assert.match(r.stdout, /^filled 1024\nrc=[1-9]\n$/, JSON.stringify(r).slice(0, 300));
        assert.match(r.stderr, /Too many open files/);
        assert.equal(await sh(c, sid, 'echo alive'), 'alive\n');
      }),
  },
  {
    row: 'TCP socket buffers',
    skip: IS_NS && !SESSION_CGROUPS && 'needs cgroups for the sessions, which this user cannot make here: the limit is the session\'s memory cgroup\'s',
    run: async (t) => {
      if (TOOLS_SKIP) return t.skip(TOOLS_SKIP);
      // ns: a 64 MiB session, so a 16 MiB limit on v1; vm: the guest's RAM.
      const s = await startServer({ tools: true, env: IS_NS ? { IGN_MCP_MEMORY_MB: 64 } : {} });
      try {
        const c = s.client;
        const sid = await openSession(c);
        // 8 loopback connections written without blocking and never read:
        // the writer gets EAGAIN once the buffers it may have are full.
        const py = 'import socket\nsrv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(8)\nkeep, total = [], 0\nfor i in range(8):\n    w = socket.create_connection(srv.getsockname()); r, _ = srv.accept(); w.setblocking(False); keep.append((w, r))\n    while True:\n        try: total += w.send(b"x" * 65536)\n        except BlockingIOError: break\nprint(total)\n';
        const r = await run(c, sid, `python3 -c '${py}'`, { timeout_s: 60 });
        assert.equal(r.exit_code, 0, JSON.stringify(r).slice(0, 300));
        const queued = Number(r.stdout.trim());
        assert.ok(queued > 0, 'nothing was queued: the check is blind');
        // ns: a quarter of 64 MiB (v1), or within the 64 MiB (v2), plus what
        // the kernel always grants a socket; vm: the guest's 256 MiB.
        const bound = (IS_NS ? 16 << 20 : 256 << 20) + 8 * (128 << 10);
        assert.ok(queued <= bound, `${queued} bytes queued, over ${bound}`);
        assert.equal(await sh(c, sid, 'echo alive'), 'alive\n');
      } finally {
        await s.close();
      }
    },
  },
  {
    row: 'allow_hosts entries',
    run: () =>
      withServer({}, async (c) => {
        const hosts = (n) => Array.from({ length: n }, (_, i) => `h${i}.example`);
        const o = await call(c, 'open_session', { network: 'allow', allow_hosts: hosts(256) });
        assert.equal(o.egress.allowed_rules.length, 256);
        for (const [tool, base] of [['open_session', {}], ['sandbox_run', { command: 'true' }]]) {
          const e = await callErr(c, tool, { ...base, network: 'allow', allow_hosts: hosts(257) });
          assert.equal(e, `${tool}: allow_hosts has 257 entries; at most 256 are accepted`);
        }
        assert.deepEqual((await call(c, 'list_sessions')).sessions.map((x) => x.session_id), [o.session_id], 'a refused call left a session');
        await call(c, 'close', { session_id: o.session_id });
      }),
  },
  {
    row: 'egress connections at once',
    run: async (t) => {
      const skip = captureSkip();
      if (skip) return t.skip(skip);
      const g = goodTest({ IGN_MCP_EGRESS_STREAMS: 2 });
      const held = [];
      const srv = net.createServer((sock) => held.push(sock));
      const port = await listening(srv);
      try {
        await withServer(g.env, async (c) => {
          const o = await call(c, 'open_session', { network: 'allow', allow_hosts: [`good.test:${port}`] });
          // Four connections held open at once: two reach the host.
          await run(c, o.session_id, `for i in 1 2 3 4; do sleep 8 | nc good.test ${port} >/dev/null 2>&1 & done; sleep 4`, { timeout_s: 30 });
          assert.equal(held.length, 2, `${held.length} connections reached the host`);
          assert.ok((await deniedReasons(c, o.session_id)).some((r) => /too many connections/.test(r)), 'no refusal recorded as too many connections');
        });
      } finally {
        for (const s of held) s.destroy();
        srv.close();
        g.remove();
      }
    },
  },
  {
    row: 'egress bytes',
    run: async (t) => {
      const skip = captureSkip();
      if (skip) return t.skip(skip);
      const g = goodTest({ IGN_MCP_EGRESS_MAX_MB: 1 });
      const body = Buffer.alloc(3 * MiB, 'x');
      const srv = http.createServer((req, res) => res.end(req.url === '/big' ? body : 'small\n'));
      const port = await listening(srv);
      try {
        await withServer(g.env, async (c) => {
          const o = await call(c, 'open_session', { network: 'allow', allow_hosts: [`good.test:${port}`] });
          const sid = o.session_id;
          // Under the cap: whole.
          assert.equal((await run(c, sid, `wget -q -O - http://good.test:${port}/small`)).stdout, 'small\n');
          // Past it: the download is cut near 1 MiB, and what follows is refused.
          const r = await run(c, sid, `wget -q -O /tmp/big http://good.test:${port}/big; wc -c < /tmp/big; wget -q -O - http://good.test:${port}/small; echo rc=$?`, { timeout_s: 60 });
          const got = Number(r.stdout.split('\n')[0]);
          assert.ok(got <= 1 * MiB + 256 * 1024, `${got} bytes came in past a 1 MiB cap`);
          assert.match(r.stdout, /rc=[1-9]/, r.stdout);
          assert.ok((await deniedReasons(c, sid)).some((x) => /byte cap/.test(x)), 'no refusal recorded as byte cap reached');
        });
      } finally {
        srv.close();
        g.remove();
      }
    },
  },
  {
    row: 'egress log size',
    run: async (t) => {
      const skip = captureSkip();
      if (skip) return t.skip(skip);
      await withServer({ IGN_MCP_EGRESS_LOG_CAP: 4096 }, async (c) => {
        const o = await call(c, 'open_session', {});
        const file = o.egress.egress_log_path;
        // Refused lookups (network none), each a line of the log (a line is
        // about 100 bytes: 60 lookups are well over the 4096 bytes).
        await run(c, o.session_id, 'for i in $(seq 1 60); do nslookup host$i.example >/dev/null 2>&1; done', { timeout_s: 120 });
        const done = await waitUntil(() => fs.existsSync(file) && /"kind":"truncated"/.test(fs.readFileSync(file, 'utf8')), { timeoutMs: 10_000 });
        assert.ok(done, `${file} has no truncated line`);
        const text = fs.readFileSync(file, 'utf8');
        const lines = text.trimEnd().split('\n');
        assert.match(lines.at(-1), /"kind":"truncated"/);
        assert.ok(Buffer.byteLength(text) - Buffer.byteLength(lines.at(-1)) - 1 <= 4096, `${Buffer.byteLength(text)} bytes in a log capped at 4096`);
        // The record in memory goes on counting.
        const log = await call(c, 'network_log', { session_id: o.session_id });
        assert.ok(log.total_events > lines.length, `${log.total_events} events, ${lines.length} lines`);
      });
    },
  },
  {
    row: 'names under a wildcard rule',
    run: async (t) => {
      const skip = captureSkip();
      if (skip) return t.skip(skip);
      const g = goodTest({ IGN_MCP_EGRESS_WILDCARD_NAMES: 2 });
      fs.writeFileSync(g.env.IGN_MCP_EGRESS_HOSTS, '127.0.0.1 n1.wild.test n2.wild.test n3.wild.test\n');
      try {
        await withServer(g.env, async (c) => {
          const o = await call(c, 'open_session', { network: 'allow', allow_hosts: ['*.wild.test'] });
          // At the cap, answered (a stand-in address); past it, NXDOMAIN.
          const r = await run(c, o.session_id, 'for n in n1 n2 n3 n1; do if nslookup $n.wild.test 2>&1 | grep -q "^Address.*198\\.1[89]\\."; then echo "$n yes"; else echo "$n no"; fi; done', { timeout_s: 60 });
          assert.equal(r.stdout, 'n1 yes\nn2 yes\nn3 no\nn1 yes\n', r.stderr);
          const log = await call(c, 'network_log', { session_id: o.session_id });
          const why = 'over 2 names under one wildcard rule (IGN_MCP_EGRESS_WILDCARD_NAMES)';
          assert.ok(log.dns_queries.some((q) => q.name === 'n3.wild.test' && q.reason === why), `no refusal recorded as "${why}": ${JSON.stringify(log.dns_queries)}`);
        });
      } finally {
        g.remove();
      }
    },
  },
];

/* The rows of the README's "## Limits" table, by their first cell. */
function readmeRows() {
  const text = fs.readFileSync(path.join(REPO, 'README.md'), 'utf8');
  const start = text.indexOf('\n## Limits\n');
  assert.ok(start >= 0, 'README.md has no "## Limits" section');
  const end = text.indexOf('\n## ', start + 1);
  const section = text.slice(start, end < 0 ? undefined : end);
  return section
    .split('\n')
    .filter((l) => l.startsWith('| ') && !l.startsWith('| cap ') && !l.startsWith('|---'))
    .map((l) => l.split('|')[1].trim());
}

describe('limits (README "Limits", one test per row)', () => {
  test('the README table and this file have the same rows', () => {
    assert.deepEqual(readmeRows(), ROWS.map((r) => r.row));
  });
  for (const r of ROWS) test(`limit: ${r.row}`, { ...T, skip: r.skip ?? false }, (t) => r.run(t));
});
