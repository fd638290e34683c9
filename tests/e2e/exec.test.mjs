// exec.test.mjs: the run tool: shell semantics, output caps, timeouts,
// background processes, progress, cancellation and concurrency.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import {
  startServer, startRaw, call, callErr, openSession, run, sh, sleep, waitUntil,
  findProcs, uniqueSleepSecs, IS_NS, textOf, SOAK,
} from './lib.mjs';

const T = { timeout: 60_000 };

describe('run basics', () => {
  let s, c, sid;
  before(async () => {
    s = await startServer();
    c = s.client;
    sid = await openSession(c);
  });
  after(() => s.close());

  test('stdout, stderr and exit code are separate and exact', T, async () => {
    const r = await run(c, sid, 'printf "a\\nb"; printf "E" >&2; exit 42');
    assert.equal(r.stdout, 'a\nb');
    assert.equal(r.stderr, 'E');
    assert.equal(r.exit_code, 42);
    assert.equal(r.timed_out, false);
    assert.equal(r.stdout_bytes, 3);
    assert.equal(r.stderr_bytes, 1);
  });

  test('each run is a fresh sh -c: cd and export do not carry over', T, async () => {
    await sh(c, sid, 'cd /tmp && export IGN_E2E_X=1 && E2E_Y=2');
    assert.equal(await sh(c, sid, 'pwd'), '/root\n');
    assert.equal(await sh(c, sid, 'echo "[$IGN_E2E_X][$E2E_Y]"'), '[][]\n');
  });

  test('files written by one run persist to the next', T, async () => {
    await sh(c, sid, 'echo persisted > /root/p.txt; mkdir -p /tmp/d && echo t > /tmp/d/f');
    assert.equal(await sh(c, sid, 'cat /root/p.txt /tmp/d/f'), 'persisted\nt\n');
  });

  test('default cwd is /root; cwd changes it for one run', T, async () => {
    assert.equal(await sh(c, sid, 'pwd'), '/root\n');
    assert.equal(await sh(c, sid, 'pwd', { cwd: '/tmp' }), '/tmp\n');
    assert.equal(await sh(c, sid, 'pwd'), '/root\n');
  });

  test('a nonexistent cwd is an error mentioning it', T, async () => {
    const e = await callErr(c, 'run', { session_id: sid, command: 'pwd', cwd: '/no/such/dir-e2e' });
    assert.match(e, /cwd|\/no\/such\/dir-e2e/);
  });

  test('stdin is fed to the command', T, async () => {
    const r = await run(c, sid, 'cat; echo; wc -l', { stdin: 'hello\nworld\n' });
    assert.equal(r.stdout.split('\n')[0], 'hello');
    assert.equal(r.stdout.split('\n')[1], 'world');
    const r2 = await run(c, sid, 'wc -c', { stdin: 'héllo' });
    assert.equal(r2.stdout.trim(), '6');
  });

  test('without stdin the command sees EOF, not a hang', T, async () => {
    const r = await run(c, sid, 'cat; echo done', { timeout_s: 10 });
    assert.equal(r.timed_out, false);
    assert.equal(r.stdout, 'done\n');
  });

  test('env sets variables for one run only', T, async () => {
    const r = await run(c, sid, 'echo "$FOO|$BAR"', { env: { FOO: 'bar baz', BAR: '' } });
    assert.equal(r.stdout, 'bar baz|\n');
    assert.equal(await sh(c, sid, 'echo "[$FOO]"'), '[]\n');
  });

  test('a signal death is 128+N with the signal name', T, async () => {
    const r = await run(c, sid, 'kill -9 $$');
    assert.equal(r.exit_code, 137);
    assert.equal(r.signal, 'SIGKILL');
    const r2 = await run(c, sid, 'kill -TERM $$');
    assert.equal(r2.exit_code, 143);
    assert.equal(r2.signal, 'SIGTERM');
    const r3 = await run(c, sid, 'exit 0');
    assert.equal(r3.signal, null);
  });

  test('invalid UTF-8 output comes back as valid JSON with exact byte counts', T, async () => {
    const r = await run(c, sid, "printf '\\377\\376abc'; printf '\\300' >&2");
    assert.equal(r.stdout_bytes, 5);
    assert.equal(r.stderr_bytes, 1);
    assert.ok(r.stdout.endsWith('abc'), JSON.stringify(r.stdout));
    assert.ok(r.stdout.includes('\uFFFD'), JSON.stringify(r.stdout));
    assert.ok(r.stderr.includes('\uFFFD'), JSON.stringify(r.stderr));
    const ok = await run(c, sid, "printf 'h\\303\\251\\342\\202\\254'");
    assert.equal(ok.stdout, 'hé€');
    assert.equal(ok.stdout_bytes, 6);
  });

  test('NUL bytes and control characters in output survive JSON', T, async () => {
    const r = await run(c, sid, "printf 'a\\000b\\001\\033c\\t\"\\\\'");
    assert.equal(r.stdout_bytes, 9);
    assert.ok(r.stdout.startsWith('a'));
    assert.ok(r.stdout.endsWith('c\t"\\'), JSON.stringify(r.stdout));
  });

  test('default output cap is 64 KiB per stream with exact counts', T, async () => {
    const r = await run(c, sid, "head -c 200000 /dev/zero | tr '\\0' b; head -c 100 /dev/zero | tr '\\0' e >&2");
    assert.equal(r.stdout_bytes, 200000);
    assert.equal(r.stdout_truncated, true);
    assert.ok(r.stdout.length <= 65536 && r.stdout.length >= 60000, `stdout length ${r.stdout.length}`);
    assert.match(r.stdout, /^b+$/);
    assert.equal(r.stderr_bytes, 100);
    assert.equal(r.stderr_truncated, false);
    assert.equal(r.stderr, 'e'.repeat(100));
    assert.equal(r.exit_code, 0);
  });

  test('a large output is drained: the command is not blocked by the cap', T, async () => {
    const r = await run(c, sid, 'head -c 20000000 /dev/zero; echo fin >&2', { timeout_s: 30 });
    assert.equal(r.timed_out, false);
    assert.equal(r.exit_code, 0);
    assert.equal(r.stdout_bytes, 20000000);
    assert.equal(r.stderr, 'fin\n');
  });

  test('timeout_s kills the command, reports timed_out, and the session lives on', T, async () => {
    const t0 = Date.now();
    const r = await run(c, sid, 'echo before; sleep 10; echo after', { timeout_s: 1 });
    const el = Date.now() - t0;
    assert.equal(r.timed_out, true);
    assert.ok(el >= 900 && el < 5000, `took ${el} ms`);
    assert.equal(r.stdout, 'before\n');
    assert.notEqual(r.exit_code, 0);
    assert.equal(await sh(c, sid, 'echo alive'), 'alive\n');
  });

  test('timeout kills the whole process group, including children', T, async () => {
    const n = uniqueSleepSecs();
    const r = await run(c, sid, `sleep ${n} & sleep ${n + 1}; wait`, { timeout_s: 1 });
    assert.equal(r.timed_out, true);
    const left = await run(c, sid, `ps -o pid,args 2>/dev/null || ps; true`);
    const alive = left.stdout.split('\n').filter((l) => l.includes(`sleep ${n}`) || l.includes(`sleep ${n + 1}`));
    assert.deepEqual(alive, []);
    if (IS_NS) assert.deepEqual(findProcs(['sleep', String(n)]), []);
  });

  test('timeout_s outside 1..3600 or not an integer is an error naming the range', T, async () => {
    for (const bad of [0, 3601, -1, 'abc', 1.5, true, '30']) {
      const e = await callErr(c, 'run', { session_id: sid, command: 'true', timeout_s: bad });
      assert.match(e, /timeout_s/, `${JSON.stringify(bad)}: ${e}`);
      assert.match(e, /3600/, `${JSON.stringify(bad)}: ${e}`);
    }
    const ok = await run(c, sid, 'echo ok', { timeout_s: 3600 });
    assert.equal(ok.stdout, 'ok\n');
    const ok1 = await run(c, sid, 'echo ok', { timeout_s: 1 });
    assert.equal(ok1.stdout, 'ok\n');
  });

  test('missing, empty or non-string command is an error', T, async () => {
    for (const args of [{}, { command: '' }, { command: 5 }, { command: ['ls'] }]) {
      const e = await callErr(c, 'run', { session_id: sid, ...args });
      assert.match(e, /command/, e);
    }
  });

  test('bad env and stdin types are errors', T, async () => {
    const e1 = await callErr(c, 'run', { session_id: sid, command: 'true', env: { A: 1 } });
    assert.match(e1, /env/);
    const e2 = await callErr(c, 'run', { session_id: sid, command: 'true', env: 'A=1' });
    assert.match(e2, /env/);
    const e3 = await callErr(c, 'run', { session_id: sid, command: 'true', stdin: 7 });
    assert.match(e3, /stdin/);
  });

  test('a background process does not hold run open, and survives it', T, async () => {
    // The sleep outlasts the call's timeout by far: a run held open by it
    // would end timed out. (No wall-clock bound: a loaded host is slow.)
    const n = uniqueSleepSecs();
    const r = await run(c, sid, `sleep ${n} & echo $! > /root/bg.pid; echo started`, { timeout_s: 30 });
    assert.equal(r.stdout, 'started\n');
    assert.equal(r.timed_out, false);
    assert.equal(await sh(c, sid, 'kill -0 $(cat /root/bg.pid) && echo alive'), 'alive\n');
    // The shell's child may still be between fork and exec on a loaded host.
    if (IS_NS) assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length === 1, { timeoutMs: 10000 }), 'background sleep not visible on the host');
    await sh(c, sid, 'kill $(cat /root/bg.pid)');
  });

  test('a background writer that keeps stdout open does not keep run open', T, async () => {
    // The loop keeps writing to the inherited stdout after the shell exits;
    // run must end when the shell exits.
    const r = await run(c, sid, '(while :; do echo spam; sleep 1; done) & echo $! > /root/spam.pid; echo fg', { timeout_s: 20 });
    assert.equal(r.timed_out, false);
    assert.ok(r.stdout.includes('fg\n'), JSON.stringify(r.stdout.slice(0, 100)));
    await sh(c, sid, 'kill $(cat /root/spam.pid)');
  });
});

describe('commands cannot reach into the agent', () => {
  /* The agent holds the sandbox's end of the channel. A command that could
   * trace it, take its fds (pidfd_getfd) or write its memory could answer
   * the host in its place. In a microVM commands run as root: they lose
   * CAP_SYS_PTRACE (bounding set included), so PID 1, which keeps all its
   * capabilities, is out of their reach; on the ns backend they hold no
   * capability at all and the agent is not dumpable. */
  test('no CAP_SYS_PTRACE; PID 1\'s fds and executable cannot be looked into', T, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const sid = await openSession(s.client);
    const r = await run(s.client, sid, [
      'for k in CapEff CapPrm CapBnd; do echo "$k $(sed -n "s/^$k:[[:space:]]*//p" /proc/self/status)"; done',
      'readlink /proc/1/exe >/dev/null 2>&1 && echo exe-readable || echo exe-denied',
      'readlink /proc/1/fd/0 >/dev/null 2>&1 && echo fd-readable || echo fd-denied',
      // The open is what is checked (a read at offset 0 fails anyway).
      '(exec 3</proc/1/mem) 2>/dev/null && echo mem-openable || echo mem-denied',
    ].join('; '));
    const lines = r.stdout.trim().split('\n');
    const CAP_SYS_PTRACE = 19n;
    for (const l of lines.slice(0, 3)) {
      const [k, hex] = l.split(' ');
      assert.equal((BigInt(`0x${hex}`) >> CAP_SYS_PTRACE) & 1n, 0n, `${k} ${hex} holds CAP_SYS_PTRACE`);
    }
    assert.deepEqual(lines.slice(3), ['exe-denied', 'fd-denied', 'mem-denied'], r.stdout);
    // The command itself still runs, as root where it did.
    assert.equal(await sh(s.client, sid, 'id -u'), '0\n');
  });

  /* The agent starts a command with clone(CLONE_VM): until its execve the
   * child shares the agent's memory, and from the capability drop on it
   * holds no more than a command does. A racer in the sandbox looks for such
   * children (the agent's name, not PID 1) and tries to open their memory
   * for writing; the agent is not dumpable, so it must never succeed. It
   * catches a window only now and then (a few in a thousand starts): the
   * soak starts enough commands to be sure it tried. */
  test('a command still being started (sharing the agent\'s memory) cannot be opened', { timeout: SOAK ? 600_000 : 60_000 }, async (t) => {
    const s = await startServer();
    t.after(() => s.close());
    const sid = await openSession(s.client);
    // Shell builtins only (no fork per probe): the small rootfs has no
    // python. The open with <> asks for write access, as ptrace's would;
    // on `true`, not `:`, whose failed redirection would end the shell.
    // execve gives the child a memory of its own a moment before its name
    // changes: an open that lands there (its exe is then the shell's, or
    // gone with the process) is the command's own memory, not the agent's,
    // and does not count.
    const racer = [
      'read -r l < /proc/1/stat; a=${l#*(}; a=${a%%)*}; seen=0; opened=0; me=$(readlink /proc/$$/exe)',
      'while [ ! -e /root/racer.stop ]; do',
      '  for d in /proc/[0-9]*; do',
      '    [ "$d" = /proc/1 ] && continue',
      '    { read -r l < $d/stat; } 2>/dev/null || continue',
      '    case "$l" in *" ($a) "*) ;; *) continue ;; esac',
      '    seen=$((seen + 1))',
      '    { true 3<>$d/mem; } 2>/dev/null || continue',
      '    x=$(readlink $d/exe)',
      '    [ -n "$x" ] && [ "$x" != "$me" ] && opened=$((opened + 1))',
      '  done',
      'done',
      'echo $seen $opened',
    ].join('\n');
    await run(s.client, sid, 'cat > /root/racer.sh', { stdin: racer });
    await run(s.client, sid, 'sh /root/racer.sh > /root/racer.out 2>/dev/null &');
    const starts = SOAK ? 3000 : 150;
    for (let i = 0; i < starts; i++) await run(s.client, sid, 'true');
    const out = await sh(s.client, sid, 'touch /root/racer.stop; for i in $(seq 300); do [ -s /root/racer.out ] && break; sleep 0.1; done; cat /root/racer.out');
    const [seen, opened] = out.trim().split(' ').map(Number);
    assert.ok(Number.isInteger(seen) && Number.isInteger(opened), `the racer said: ${out}`);
    t.diagnostic(`the racer caught ${seen} of ${starts} commands before their execve`);
    assert.equal(opened, 0, `${opened} of the ${seen} commands caught before their execve had the agent's memory opened for writing`);
    if (SOAK) assert.ok(seen > 0, `the racer caught none of ${starts} commands before their execve: it tried nothing`);
  });
});

describe('output cap setting', () => {
  test('IGN_MCP_OUTPUT_CAP=1000 caps each stream and keeps exact counts', T, async (t) => {
    const s = await startServer({ env: { IGN_MCP_OUTPUT_CAP: 1000 } });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    const r = await run(s.client, sid, "head -c 5000 /dev/zero | tr '\\0' a; head -c 3000 /dev/zero | tr '\\0' e >&2");
    assert.ok(Buffer.byteLength(r.stdout) <= 1000, `stdout ${Buffer.byteLength(r.stdout)} bytes`);
    assert.ok(r.stdout.length > 0);
    assert.match(r.stdout, /^a+$/);
    assert.equal(r.stdout_bytes, 5000);
    assert.equal(r.stdout_truncated, true);
    assert.ok(Buffer.byteLength(r.stderr) <= 1000);
    assert.equal(r.stderr_bytes, 3000);
    assert.equal(r.stderr_truncated, true);
    const small = await run(s.client, sid, "head -c 1000 /dev/zero | tr '\\0' a");
    assert.equal(small.stdout.length, 1000);
    assert.equal(small.stdout_truncated, false);
  });
});

describe('progress, cancellation, concurrency', () => {
  let s, c, sid;
  before(async () => {
    s = await startServer();
    c = s.client;
    sid = await openSession(c);
  });
  after(() => s.close());

  test('a run with a progressToken streams progress with the newest output line', T, async () => {
    const prog = [];
    const res = await c.callTool(
      { name: 'run', arguments: { session_id: sid, command: 'for i in 1 2 3 4 5; do echo line$i; sleep 1; done' } },
      undefined,
      { onprogress: (p) => prog.push(p), timeout: 60000 },
    );
    assert.notEqual(res.isError, true, textOf(res));
    assert.equal(res.structuredContent.stdout, 'line1\nline2\nline3\nline4\nline5\n');
    assert.ok(prog.length >= 2, `only ${prog.length} progress notifications: ${JSON.stringify(prog)}`);
    for (let i = 1; i < prog.length; i++) assert.ok(prog[i].progress > prog[i - 1].progress, `progress not increasing: ${JSON.stringify(prog)}`);
    assert.ok(prog.some((p) => typeof p.message === 'string' && p.message.includes('line')), JSON.stringify(prog));
  });

  test('progress notifications carry the request token (raw)', T, async (t) => {
    const raw = startRaw();
    t.after(() => raw.close());
    await raw.initialize();
    const o = await raw.tool('open_session', {});
    const from = raw.messages.length;
    const r = await raw.request(
      'tools/call',
      { name: 'run', arguments: { session_id: o.session_id, command: 'for i in 1 2 3 4; do echo tick$i; sleep 1; done' }, _meta: { progressToken: 'tok-1' } },
      { timeoutMs: 30000 },
    );
    assert.equal(r.result.isError ?? false, false);
    const ps = raw.since(from).filter((m) => m.method === 'notifications/progress');
    assert.ok(ps.length >= 2, JSON.stringify(ps));
    for (const p of ps) assert.equal(p.params.progressToken, 'tok-1');
    // No progress after the response.
    const idx = raw.messages.findIndex((m) => m.msg === r);
    await sleep(300);
    assert.deepEqual(raw.since(idx + 1).filter((m) => m.method === 'notifications/progress' && m.params.progressToken === 'tok-1'), []);
  });

  test('without a progressToken no progress is sent', T, async (t) => {
    const raw = startRaw();
    t.after(() => raw.close());
    await raw.initialize();
    const o = await raw.tool('open_session', {});
    const from = raw.messages.length;
    await raw.tool('run', { session_id: o.session_id, command: 'echo a; sleep 2; echo b' }, { timeoutMs: 30000 });
    assert.deepEqual(raw.since(from).filter((m) => m.method === 'notifications/progress'), []);
  });

  test('cancelling a run (SDK AbortSignal) kills the command and the server keeps serving', T, async () => {
    const n = uniqueSleepSecs();
    const ac = new AbortController();
    const p = c.callTool(
      { name: 'run', arguments: { session_id: sid, command: `echo $$ > /root/cancel.pid; sleep ${n}; echo not-killed > /root/cancel.out` } },
      undefined,
      { signal: ac.signal, timeout: 60000 },
    );
    // Wait until the command is really running (seen from the host on the
    // namespace backend; a fixed pause elsewhere).
    if (IS_NS) assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length === 1, { timeoutMs: 10000 }), 'sleep never started');
    else await sleep(2000);
    ac.abort('test cancels');
    await assert.rejects(p);
    if (IS_NS) assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length === 0, { timeoutMs: 5000 }), 'cancelled sleep still alive');
    const pid = (await sh(c, sid, 'cat /root/cancel.pid')).trim();
    assert.match(pid, /^\d+$/);
    // The kill travels to the agent on its own; on the vm backend there is no
    // host-side view to wait on, so wait for it inside the sandbox.
    let ps;
    const gone = await waitUntil(async () => {
      ps = await run(c, sid, 'ps -o args 2>/dev/null || ps');
      return !ps.stdout.includes(`sleep ${n}`);
    }, { timeoutMs: 5000, intervalMs: 200 });
    assert.ok(gone, `cancelled sleep still running in the sandbox:\n${ps.stdout}`);
    assert.equal(await sh(c, sid, `kill -0 ${pid} 2>/dev/null && echo alive || echo gone`), 'gone\n');
    assert.equal(await sh(c, sid, 'echo still-serving'), 'still-serving\n');
  });

  test('notifications/cancelled: no response for the cancelled call, the whole command killed (raw)', T, async (t) => {
    const raw = startRaw();
    t.after(() => raw.close());
    await raw.initialize();
    const o = await raw.tool('open_session', {});
    const n = uniqueSleepSecs();
    const from = raw.messages.length;
    // The shell stays (it waits), and the sleep is its child: were only the
    // shell killed, the sleep would live on.
    await raw.send({ jsonrpc: '2.0', id: 'to-cancel', method: 'tools/call', params: { name: 'run', arguments: { session_id: o.session_id, command: `sleep ${n} & echo $! > /root/child.pid; wait` } } });
    if (IS_NS) assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length === 1, { timeoutMs: 10000 }), 'sleep never started');
    else await sleep(1500);
    let child;
    assert.ok(await waitUntil(async () => {
      child = (await raw.tool('run', { session_id: o.session_id, command: 'cat /root/child.pid 2>/dev/null' })).stdout.trim();
      return /^\d+$/.test(child);
    }, { timeoutMs: 10000, intervalMs: 200 }), 'the child never wrote its pid');
    assert.equal((await raw.tool('run', { session_id: o.session_id, command: `kill -0 ${child} && echo alive` })).stdout, 'alive\n');
    await raw.notify('notifications/cancelled', { requestId: 'to-cancel', reason: 'test' });
    const p = await raw.request('ping', undefined, { id: 'after-cancel' });
    assert.deepEqual(p.result, {});
    if (IS_NS) assert.ok(await waitUntil(() => findProcs(['sleep', String(n)]).length === 0, { timeoutMs: 5000 }), 'the cancelled command\'s child still alive');
    // Inside the sandbox too (the only view on the vm backend); the kill may
    // land a moment after the ping's answer.
    let ps;
    const gone = await waitUntil(async () => {
      ps = await raw.tool('run', { session_id: o.session_id, command: `ps -o args 2>/dev/null || ps` });
      return !ps.stdout.includes(`sleep ${n}`);
    }, { timeoutMs: 5000, intervalMs: 200 });
    assert.ok(gone, `the cancelled command's child still running in the sandbox:\n${ps.stdout}`);
    assert.equal((await raw.tool('run', { session_id: o.session_id, command: `kill -0 ${child} 2>/dev/null && echo alive || echo gone` })).stdout, 'gone\n');
    await sleep(500);
    assert.deepEqual(raw.since(from).filter((m) => m.id === 'to-cancel'), [], 'the cancelled request got a response');
  });

  test('cancelling an unknown or finished request is harmless', T, async (t) => {
    const raw = startRaw();
    t.after(() => raw.close());
    await raw.initialize();
    await raw.notify('notifications/cancelled', { requestId: 'never-sent' });
    await raw.notify('notifications/cancelled', { requestId: 12345 });
    await raw.notify('notifications/cancelled', {});
    const r = await raw.request('ping', undefined, { id: 'p1' });
    assert.deepEqual(r.result, {});
    await raw.notify('notifications/cancelled', { requestId: 'p1' });
    assert.deepEqual((await raw.request('ping')).result, {});
  });

  test('a long run does not delay ping nor a run in another session', T, async () => {
    const sid2 = await openSession(c);
    const order = [];
    const long = run(c, sid, 'sleep 5; echo long', { timeout_s: 30 }).then((r) => {
      order.push('long');
      return r;
    });
    await sleep(300);
    const t0 = Date.now();
    await c.ping();
    const pingMs = Date.now() - t0;
    const other = await run(c, sid2, 'echo other');
    order.push('other');
    assert.equal(other.stdout, 'other\n');
    assert.ok(pingMs < 1000, `ping took ${pingMs} ms while a run was in flight`);
    const lr = await long;
    assert.equal(lr.stdout, 'long\n');
    assert.deepEqual(order, ['other', 'long']);
    await call(c, 'close', { session_id: sid2 });
  });

  test('two runs in the same session can be in flight at once', T, async () => {
    const t0 = Date.now();
    const [a, b] = await Promise.all([run(c, sid, 'sleep 2; echo a'), run(c, sid, 'sleep 2; echo b')]);
    const el = Date.now() - t0;
    assert.equal(a.stdout, 'a\n');
    assert.equal(b.stdout, 'b\n');
    assert.ok(el < 3500, `two concurrent 2 s runs in one session took ${el} ms`);
  });
});
