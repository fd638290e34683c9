// doctor.test.mjs: `ignition-mcp doctor`, --version, --help, a server that
// starts without a working backend, and `make install` run from where it was
// installed to.
//
// Everything here runs the real binary: doctor on this host (whatever it
// has), doctor and the server with one piece taken away (a path set to
// something that does not exist), the MCP SDK client against the degraded
// server, and an installed tree (make install DESTDIR=<tmp>) started from /
// with no IGN_MCP_* set.  The doctor checks name their backend themselves,
// so they run in both passes; the installed server opens a session on the
// pass's backend.

import { describe, test, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import {
  REPO, SERVER, BACKEND, IS_VM, TOOL_NAMES, serverEnv, startServer, callErr, call, textOf,
  tempStore, tempKernel, run, VM_ONLY, descendants, waitGone, waitUntil, procStart,
  assertNoVmLeftovers, assertNoSanitizerReport, AS_ROOT, ROOTFS_SMALL,
} from './lib.mjs';

const T = { timeout: 60_000 };

/* Every check doctor makes, by the name it prints. */
const CHECKS = ['qemu', 'kvm', 'kernel', 'initramfs', 'image', 'store', 'warm base', 'landlock',
  'agent', 'rootfs', 'namespaces', 'cgroups', 'sandbox', 'seccomp', 'egress', 'session'];

function doctor(env = {}, args = []) {
  const r = spawnSync(SERVER, ['doctor', ...args], {
    env: serverEnv({ env }), cwd: '/', encoding: 'utf8', timeout: 60_000,
  });
  assertNoSanitizerReport(r.stderr ?? '', 'doctor');
  return r;
}

/* Whether the QEMU the servers run has memory-backend-file's rom= (8.2 and
 * later: it maps RAM files read-only). */
function qemuMapsRamReadOnly() {
  const q = process.env.IGN_TEST_QEMU || 'qemu-system-x86_64';
  const r = spawnSync(q, ['-object', 'memory-backend-file,help'], { encoding: 'utf8' });
  return /\n {2}rom=/.test(r.stdout ?? '');
}

/* The line of check NAME: {status, rest}. */
function checkLine(out, name) {
  const re = new RegExp(`^  (ok|warn|missing|fail)\\s+${name.replace(' ', '\\s')}\\s+(.*)$`, 'm');
  const m = out.match(re);
  assert.ok(m, `no line for the check '${name}' in:\n${out}`);
  return { status: m[1], rest: m[2] };
}

/* Every IGN_MCP_ variable the server reads (the settings and the log level). */
function serverVars() {
  const vars = new Set();
  for (const f of ['common/config.c', 'mcp/main.c']) {
    for (const m of fs.readFileSync(path.join(REPO, f), 'utf8').matchAll(/IGN_MCP_[A-Z_]*[A-Z]/g)) vars.add(m[0]);
  }
  return [...vars].sort();
}

describe('doctor on this host', () => {
  test(`exits 0 and prints one line per check (IGN_MCP_BACKEND=${BACKEND})`, T, () => {
    const r = doctor();
    assert.equal(r.status, 0, `doctor failed:\n${r.stdout}\n${r.stderr}`);
    for (const name of CHECKS) {
      const { status, rest } = checkLine(r.stdout, name);
      assert.ok(rest.length > 0, `${name}: says nothing`);
      if (status !== 'ok') assert.match(rest, /fix: \S/, `${name} is ${status} but gives no fix`);
    }
    assert.match(r.stdout, new RegExp(`sessions can open: IGN_MCP_BACKEND=${BACKEND} uses the ${BACKEND} backend`));
    // The pass's backend is the one whose parts are all there.
    for (const name of IS_VM ? ['qemu', 'kernel', 'initramfs', 'image', 'store', 'seccomp'] : ['agent', 'rootfs', 'namespaces', 'sandbox', 'seccomp']) {
      // A QEMU older than 8.2 works, but its RAM files stay writable to it.
      if (name === 'qemu' && !qemuMapsRamReadOnly()) {
        assert.equal(checkLine(r.stdout, name).status, 'warn', r.stdout);
        assert.match(checkLine(r.stdout, name).rest, /opens the warm base's and stages' RAM files read-write .*fix: .*bookworm-backports/, r.stdout);
        continue;
      }
      assert.equal(checkLine(r.stdout, name).status, 'ok', `${name} should be ok here:\n${r.stdout}`);
    }
    if (IS_VM && qemuMapsRamReadOnly()) assert.match(checkLine(r.stdout, 'qemu').rest, /; RAM files read-only to it$/, r.stdout);
  });

  test('--json says the same as one object', T, () => {
    const r = doctor({}, ['--json']);
    assert.equal(r.status, 0, r.stderr);
    const j = JSON.parse(r.stdout);
    assert.deepEqual(j.checks.map((c) => c.name), CHECKS);
    for (const c of j.checks) {
      assert.ok(['ok', 'warn', 'missing', 'fail'].includes(c.status), JSON.stringify(c));
      assert.ok(['vm', 'ns', 'both'].includes(c.backend), JSON.stringify(c));
      if (c.status === 'ok') assert.equal(c.fix, null);
    }
    assert.equal(j.sessions_can_open, true);
    assert.equal(j.backend, BACKEND);
    assert.equal(j.backend_setting, BACKEND);
    assert.equal(j.ready[BACKEND], true);
  });

  test('the egress line: the policy, and whether a sandbox can capture its traffic (a warning, with a fix, when not)', T, () => {
    const r = doctor();
    const { status, rest } = checkLine(r.stdout, 'egress');
    assert.match(rest, /^IGN_MCP_NET=allow \(sessions may ask none or allow\), private networks and this host refused, 64 connections and 1024 MiB each way per session/, rest);
    assert.ok(['ok', 'warn'].includes(status), rest);
    if (status === 'ok') assert.match(rest, /capture works/, rest);
    else {
      assert.match(rest, /sessions have no egress at all/, rest);
      assert.match(rest, /--probe-egress/, rest);
      assert.match(rest, /fix: .*nf_tables/, rest);
    }
    const off = checkLine(doctor({ IGN_MCP_NET: 'off', IGN_MCP_NET_PRIVATE: '1' }).stdout, 'egress');
    assert.equal(off.status, 'ok');
    assert.match(off.rest, /^IGN_MCP_NET=off \(sessions have no network\), private networks allowed \(IGN_MCP_NET_PRIVATE=1\), this host refused, .*capture not checked/, off.rest);
    /* The old setting stops doctor as it stops the server. */
    const old = doctor({ IGN_MCP_NET: '1' });
    assert.equal(old.status, 2);
    assert.match(old.stderr, /user-mode networking is gone/);
  });

  test('a stray argument is refused with exit 2', T, () => {
    const r = doctor({}, ['--bogus']);
    assert.equal(r.status, 2);
    assert.match(r.stderr, /doctor takes only --json, not '--bogus'/);
    const u = spawnSync(SERVER, ['frobnicate'], { encoding: 'utf8' });
    assert.equal(u.status, 2);
    assert.match(u.stderr, /unknown argument 'frobnicate'; see ignition-mcp --help/);
  });
});

describe('doctor names what is missing and its fix', () => {
  const cases = [
    {
      what: 'the guest kernel (IGN_MCP_KERNEL)',
      env: { IGN_MCP_BACKEND: 'vm', IGN_MCP_KERNEL: '/nonexistent/vmlinux' },
      check: 'kernel', status: 'missing',
      says: /IGN_MCP_KERNEL=\/nonexistent\/vmlinux is not a file; fix: unset IGN_MCP_KERNEL/,
    },
    {
      what: 'QEMU (IGN_MCP_QEMU)',
      env: { IGN_MCP_BACKEND: 'vm', IGN_MCP_QEMU: '/nonexistent/qemu' },
      check: 'qemu', status: 'missing',
      says: /IGN_MCP_QEMU=\/nonexistent\/qemu is not an executable file; fix: unset IGN_MCP_QEMU/,
    },
    {
      what: 'QEMU (not in PATH)',
      env: { IGN_MCP_BACKEND: 'vm', PATH: '/nonexistent' },
      check: 'qemu', status: 'missing',
      says: /qemu-system-x86_64 is not in PATH; fix: (sudo )?apt-get install qemu-system-x86/,
    },
    {
      what: 'the agent (IGN_MCP_AGENT)',
      env: { IGN_MCP_BACKEND: 'ns', IGN_MCP_AGENT: '/nonexistent/ign-agent' },
      check: 'agent', status: 'missing',
      says: /IGN_MCP_AGENT=\/nonexistent\/ign-agent is not an executable file; fix: unset IGN_MCP_AGENT/,
    },
    {
      what: 'the rootfs directory (IGN_MCP_ROOTFS)',
      env: { IGN_MCP_BACKEND: 'ns', IGN_MCP_ROOTFS: '/nonexistent/rootfs' },
      check: 'rootfs', status: 'missing',
      says: /IGN_MCP_ROOTFS=\/nonexistent\/rootfs is not a directory; fix: unset IGN_MCP_ROOTFS/,
    },
    {
      what: 'KVM when IGN_MCP_ACCEL=kvm insists and it is not usable',
      env: { IGN_MCP_BACKEND: 'vm', IGN_MCP_ACCEL: 'kvm' },
      check: 'kvm', status: 'fail',
      says: /IGN_MCP_ACCEL=kvm but KVM cannot be used: .+; fix: \S/,
      skip: () => {
        const r = doctor({ IGN_MCP_BACKEND: 'vm' });
        return checkLine(r.stdout, 'kvm').status === 'ok' && 'KVM is usable on this host';
      },
    },
  ];
  for (const c of cases) {
    test(`${c.what}: exit 1, the ${c.check} check says ${c.status} and how to fix it`, T, (t) => {
      const why = c.skip?.();
      if (why) return t.skip(why);
      const r = doctor(c.env);
      assert.equal(r.status, 1, `doctor should fail:\n${r.stdout}\n${r.stderr}`);
      const line = checkLine(r.stdout, c.check);
      assert.equal(line.status, c.status, r.stdout);
      assert.match(line.rest, c.says);
      assert.match(r.stdout, new RegExp(`sessions cannot open with IGN_MCP_BACKEND=${c.env.IGN_MCP_BACKEND}`));
      // Every other check still runs and prints its line.
      for (const name of CHECKS) checkLine(r.stdout, name);
    });
  }

  test('a store that does not exist yet: the check names the directory it would be made in', T, (t) => {
    // Directly under a writable directory: made on first use, so ok (the
    // QEMUs, other uids when we are root, must reach it: 0755).
    const parent = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-doctor-store-'));
    t.after(() => fs.rmSync(parent, { recursive: true, force: true }));
    fs.chmodSync(parent, 0o755);
    const store = path.join(parent, 'store');
    const r = doctor({ IGN_MCP_BACKEND: 'vm', IGN_MCP_STORE: store });
    const line = checkLine(r.stdout, 'store');
    assert.equal(line.status, 'ok', r.stdout);
    assert.equal(line.rest, `${store} is writable (made on first use)`);
    assert.ok(!fs.existsSync(store), 'doctor made the store: it should only check');

    // Directly under /: root may make it there; anyone else is told that /
    // (not the store itself) is not writable.
    const top = '/ign-doctor-test-nonexistent';
    if (fs.existsSync(top)) return t.skip(`${top} exists on this host`);
    t.after(() => fs.rmSync(top, { recursive: true, force: true }));
    const u = doctor({ IGN_MCP_BACKEND: 'vm', IGN_MCP_STORE: top });
    const l2 = checkLine(u.stdout, 'store');
    if (process.getuid() === 0) {
      assert.equal(l2.status, 'ok', u.stdout);
      assert.equal(l2.rest, `${top} is writable (made on first use)`);
    } else {
      assert.equal(l2.status, 'fail', u.stdout);
      assert.match(l2.rest, new RegExp(`^${top} \\(IGN_MCP_STORE\\) does not exist and / is not writable`));
    }
    assert.ok(!fs.existsSync(top), `doctor made ${top}: it should only check`);
  });

  test('ns is ready only when a sandbox really starts: one whose commands cannot run fails the sandbox check', T, (t) => {
    // Every part is there (an agent, a rootfs directory whose /bin/sh is a
    // name, the namespaces), but /bin/sh leads nowhere: the agent starts and
    // answers, and only running a command in the sandbox shows it is broken.
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-doctor-rootfs-'));
    t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
    fs.chmodSync(dir, 0o755);
    fs.mkdirSync(path.join(dir, 'bin'));
    fs.symlinkSync('nowhere', path.join(dir, 'bin/sh'));
    const r = doctor({ IGN_MCP_BACKEND: 'ns', IGN_MCP_ROOTFS: dir });
    assert.equal(r.status, 1, `doctor should fail:\n${r.stdout}\n${r.stderr}`);
    for (const name of ['agent', 'rootfs', 'namespaces']) assert.equal(checkLine(r.stdout, name).status, 'ok', r.stdout);
    const line = checkLine(r.stdout, 'sandbox');
    assert.equal(line.status, 'fail', r.stdout);
    assert.match(line.rest, /does not work: /);
    assert.match(r.stdout, /^ns: cannot open sessions: fix sandbox above$/m);
  });

  test('a host that lets nobody make user namespaces: the namespaces check fails and names the sysctls; the server says why at start', { ...T, skip: IS_VM ? 'the ns pass checks this' : false }, () => {
    // A user namespace of our own where at most one more may be made (the
    // limit is per namespace), then one inside it for a user (uid 1001 there,
    // so the server takes the unprivileged path): the server's own cannot be
    // made, as on a host with user.max_user_namespaces=0.
    const wrap = (args, input) => spawnSync('unshare', ['-Ur', '--', 'sh', '-c',
      'echo 1 > /proc/sys/user/max_user_namespaces && exec unshare --map-user=1001 --map-group=1001 -- "$@"', 'wrap', ...args], {
      env: serverEnv({ env: { IGN_MCP_BACKEND: 'ns' } }), cwd: '/', encoding: 'utf8', timeout: 60_000, input,
    });
    const r = wrap([SERVER, 'doctor']);
    assertNoSanitizerReport(r.stderr ?? '', 'doctor');
    assert.equal(r.status, 1, `doctor should fail:\n${r.stdout}\n${r.stderr}`);
    const line = checkLine(r.stdout, 'namespaces');
    assert.equal(line.status, 'fail', r.stdout);
    assert.match(line.rest, /cannot create user, mount, pid, net, ipc, uts and cgroup namespaces: No space left on device \(this host does not let users create user namespaces: see \/proc\/sys\/user\/max_user_namespaces/);
    assert.match(line.rest, /fix: let users create user namespaces: sudo sysctl -w user.max_user_namespaces=/);
    assert.equal(checkLine(r.stdout, 'sandbox').status, 'warn');
    assert.match(r.stdout, /^ns: cannot open sessions: fix namespaces above$/m);
    // The server starts, says why at once, and exits at the end of its input.
    const srv = wrap([SERVER], '');
    assertNoSanitizerReport(srv.stderr ?? '', 'server');
    assert.match(srv.stderr, /no sandbox backend can run \(IGN_MCP_BACKEND=ns\): the namespace backend cannot run: cannot create user, mount/);
  });

  test('an agent that dies at once fails the sandbox check; it never kills doctor (SIGPIPE)', { ...T, skip: IS_VM ? 'the ns pass checks this' : false }, () => {
    // /bin/true as the agent: the sandbox's first process exits while doctor
    // says HELLO, so the write to its socket races with its end (EPIPE).
    // Thirty tries, for the race to go the bad way at least once.
    for (let i = 0; i < 30; i++) {
      const r = doctor({ IGN_MCP_BACKEND: 'ns', IGN_MCP_AGENT: '/bin/true' });
      assert.equal(r.signal, null, `doctor was killed by ${r.signal} on try ${i + 1}`);
      assert.equal(r.status, 1, `${r.stdout}\n${r.stderr}`);
      const line = checkLine(r.stdout, 'sandbox');
      assert.equal(line.status, 'fail', r.stdout);
      assert.match(line.rest, /does not work: .*exited with status 0/);
    }
  });

  test(`the sandbox check starts one and says which uid and limits it got (as ${AS_ROOT ? 'root' : 'a user'})`, { ...T, skip: IS_VM ? 'the ns pass checks this' : false }, () => {
    const r = doctor({ IGN_MCP_BACKEND: 'ns' });
    const line = checkLine(r.stdout, 'sandbox');
    assert.equal(line.status, 'ok', r.stdout);
    if (AS_ROOT) {
      assert.match(line.rest, /as host uid (\d+), rootfs idmapped\) and ran a command in it; limits: /);
      assert.ok(Number(line.rest.match(/host uid (\d+)/)[1]) >= 0x70000000, line.rest);
      assert.match(checkLine(r.stdout, 'namespaces').rest, /each session gets host uids of its own/);
    } else {
      assert.match(line.rest, new RegExp(`as host uid ${process.getuid()}\\) and ran a command in it; limits: `));
      assert.match(checkLine(r.stdout, 'namespaces').rest, new RegExp(`uid 0 in a session is your uid ${process.getuid()}`));
    }
    // What is not enforced is said, in the sandbox line and the cgroups line.
    if (checkLine(r.stdout, 'cgroups').status !== 'ok') {
      assert.match(line.rest, /memory not enforced/);
      assert.match(checkLine(r.stdout, 'cgroups').rest, /without a memory limit \(not enforced: only each process.s data is limited, by RLIMIT_DATA\)/);
    } else {
      assert.match(line.rest, /limits: memory \d+ MiB, pids \d+/);
    }
  });

  test('with auto, one backend missing a piece leaves the other: exit 0', T, () => {
    const r = doctor({ IGN_MCP_BACKEND: 'auto', IGN_MCP_QEMU: '/nonexistent/qemu' });
    assert.equal(r.status, 0, r.stdout);
    assert.match(r.stdout, /^vm: cannot open sessions: fix qemu above$/m);
    assert.match(r.stdout, /sessions can open: IGN_MCP_BACKEND=auto uses the ns backend/);
  });
});

describe('doctor tells the truth about the vm backend', () => {
  // Ready means a session really starts: doctor starts one QEMU, confined as
  // a session's, and waits for its agent. These run as root and as a user.
  const VT = { timeout: 240_000, skip: VM_ONLY('the trial session is a microVM') };

  test('ready: the session check started a QEMU whose agent answered, and a server with the same settings opens a session', VT, async (t) => {
    const env = { IGN_MCP_BACKEND: 'vm', IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 };
    const r = doctor(env, ['--json']);
    assert.equal(r.status, 0, `${r.stdout}\n${r.stderr}`);
    const j = JSON.parse(r.stdout);
    const sess = j.checks.find((c) => c.name === 'session');
    assert.equal(sess.status, 'ok', JSON.stringify(sess));
    assert.match(sess.found, /^a QEMU started as a session's \((as a uid of its own|confined in a user namespace of its own)\) and its agent answered: (restored from the warm base|cold-booted \(no warm base yet\)), under (kvm|tcg), in \d+ ms$/);
    assert.match(sess.found, process.getuid() === 0 ? /as a uid of its own/ : /user namespace/);
    assert.equal(j.ready.vm, true);
    const s = await startServer({ env });
    t.after(() => s.close());
    const o = await call(s.client, 'open_session', {});
    assert.equal((await run(s.client, o.session_id, 'echo hi')).stdout, 'hi\n');
  });

  test('a kernel that cannot boot passes the file checks, but the trial fails: not ready, exit 1, and open_session fails too', VT, async (t) => {
    const kernel = tempKernel(t, Buffer.alloc(64 << 10, 0x5a));
    const store = tempStore('e2e-doctor-broken');
    t.after(() => store.remove());
    const env = { IGN_MCP_BACKEND: 'vm', IGN_MCP_KERNEL: kernel, IGN_MCP_STORE: store.dir, IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 };
    const r = doctor(env);
    assert.equal(r.status, 1, `doctor should say not ready:\n${r.stdout}\n${r.stderr}`);
    assert.equal(checkLine(r.stdout, 'kernel').status, 'ok', r.stdout);
    const line = checkLine(r.stdout, 'session');
    assert.equal(line.status, 'fail', r.stdout);
    assert.match(line.rest, /^a trial session did not start: .*QEMU said: .*kernel.*; fix: \S/);
    assert.match(r.stdout, /^vm: cannot open sessions: fix session above$/m);
    const j = JSON.parse(doctor(env, ['--json']).stdout);
    assert.equal(j.ready.vm, false);
    assert.equal(j.sessions_can_open, false);
    // What doctor said is what a session finds.
    const s = await startServer({ env });
    t.after(() => s.close());
    const text = await callErr(s.client, 'open_session', {});
    assert.match(text, /kernel/);
  });

  test('a damaged warm base: the trial boots past it, so the backend is still ready, and the session check warns with the fix', VT, (t) => {
    const store = tempStore('e2e-doctor-damaged');
    t.after(() => store.remove());
    const env = { IGN_MCP_BACKEND: 'vm', IGN_MCP_STORE: store.dir };
    const mk = spawnSync(SERVER, ['make-base'], { env: serverEnv({ env }), encoding: 'utf8', timeout: 200_000 });
    assert.equal(mk.status, 0, mk.stderr);
    const base = fs.readdirSync(store.dir).find((n) => /^small-base-[0-9a-f]{16}$/.test(n));
    assert.ok(base, `make-base made no base in ${store.dir}`);
    fs.truncateSync(path.join(store.dir, base, 'state'), 100);
    const r = doctor(env);
    assert.equal(r.status, 0, `${r.stdout}\n${r.stderr}`);
    const line = checkLine(r.stdout, 'session');
    assert.equal(line.status, 'warn', r.stdout);
    assert.match(line.rest, /its agent answered: cold-booted, .*; but the warm base .* did not restore .*; fix: \S+ make-base --force$/);
    assert.match(r.stdout, /^vm: ready: /m);
  });

  test('the KVM decision and its reason: in doctor --json, and the same in the server\'s startup log', VT, async (t) => {
    const j = JSON.parse(doctor({ IGN_MCP_BACKEND: 'vm' }, ['--json']).stdout);
    assert.ok(['kvm', 'tcg'].includes(j.accel.decision), JSON.stringify(j.accel));
    assert.equal(typeof j.accel.reason, 'string');
    assert.ok(j.accel.reason.length > 10, JSON.stringify(j.accel));
    let kvmOpens = true;
    try {
      fs.closeSync(fs.openSync('/dev/kvm', 'r+'));
    } catch {
      kvmOpens = false;
    }
    if (kvmOpens) {
      // The probe ran: a million loop iterations in guest kernel mode, given
      // 100 ms; KVM is used only when it finished (and QEMU may use it).
      const p = j.accel.kvm_probe;
      assert.equal(p.loops, 1000000, JSON.stringify(j.accel));
      assert.equal(p.budget_ms, 100);
      assert.equal(typeof p.finished, 'boolean');
      if (!p.finished) {
        assert.equal(j.accel.decision, 'tcg');
        assert.match(j.accel.reason, /KVM does not help on this host: KVM probe: a guest in kernel mode did not finish 1000000 loop iterations in 100 ms/);
        assert.equal(checkLine(doctor({ IGN_MCP_BACKEND: 'vm' }).stdout, 'kvm').status, 'ok');
      } else {
        assert.ok(p.run_ms <= 100, JSON.stringify(p));
      }
    } else {
      // As a user of this host, /dev/kvm (0600 root) does not open: said so.
      assert.equal(j.accel.kvm_probe, null);
      assert.equal(j.accel.decision, 'tcg');
      assert.match(j.accel.reason, /\/dev\/kvm/);
    }
    const s = await startServer({ env: { IGN_MCP_BACKEND: 'vm', IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0 } });
    t.after(() => s.close());
    const logged = await waitUntil(() => s.stderrText().match(/accelerator: (kvm|tcg) \((.*)\)$/m), { timeoutMs: 5000 });
    assert.ok(logged, `no accelerator line in the startup log:\n${s.stderrText()}`);
    assert.equal(logged[1], j.accel.decision);
    if (j.accel.decision === 'tcg') assert.ok(logged[2].includes(j.accel.why_not_kvm.slice(0, 40)), `${logged[2]} vs ${j.accel.why_not_kvm}`);
  });
});

describe('--version and --help', () => {
  test('--version prints the version the Makefile sets', T, () => {
    const r = spawnSync(SERVER, ['--version'], { encoding: 'utf8' });
    assert.equal(r.status, 0);
    const v = fs.readFileSync(path.join(REPO, 'Makefile'), 'utf8').match(/^VERSION\s*:=\s*(\S+)/m)[1];
    assert.equal(r.stdout, `ignition-mcp ${v}\n`);
  });

  test('--help lists every IGN_MCP_ variable the server reads, with its default, and the subcommands', T, () => {
    const r = spawnSync(SERVER, ['--help'], { encoding: 'utf8' });
    assert.equal(r.status, 0);
    const vars = serverVars();
    assert.ok(vars.length >= 20, `found only ${vars.length} variables in common/config.c and mcp/main.c`);
    for (const v of vars) {
      const m = r.stdout.match(new RegExp(`^  ${v}\\s+(.*)$`, 'm'));
      assert.ok(m, `--help does not list ${v}`);
      // The default: in brackets on its line or the next.
      const at = r.stdout.indexOf(m[0]);
      assert.match(r.stdout.slice(at, at + m[0].length + 80), /\[[^\]]+\]/, `--help gives no default for ${v}`);
    }
    assert.match(r.stdout, /ignition-mcp doctor \[--json\]/);
    assert.match(r.stdout, /ignition-mcp make-base \[--force\]/);
  });

  test('the README table and the man page list every variable too', T, () => {
    const readme = fs.readFileSync(path.join(REPO, 'README.md'), 'utf8');
    const man = fs.readFileSync(path.join(REPO, 'docs/ignition-mcp.1'), 'utf8');
    for (const v of serverVars()) {
      assert.match(readme, new RegExp(`^\\| \`${v}\`|, \`${v}\``, 'm'), `README.md's table does not list ${v}`);
      assert.match(man, new RegExp(`^\\.B ${v}$`, 'm'), `docs/ignition-mcp.1 does not list ${v}`);
    }
  });

  test('the man page renders without a warning', T, (t) => {
    if (spawnSync('man', ['--version']).status !== 0) return t.skip('man is not installed (scripts/setup.sh installs man-db)');
    const r = spawnSync('man', ['--warnings', '-l', path.join(REPO, 'docs/ignition-mcp.1')], {
      encoding: 'utf8', env: { ...process.env, MANWIDTH: '80', LC_ALL: 'C.UTF-8', MANPAGER: 'cat', PAGER: 'cat' },
    });
    assert.equal(r.status, 0, r.stderr);
    assert.equal(r.stderr, '', 'man --warnings complained');
    for (const section of ['NAME', 'SYNOPSIS', 'DESCRIPTION', 'COMMANDS', 'TOOLS', 'ENVIRONMENT', 'FILES', 'EXIT STATUS', 'EXAMPLES', 'SEE ALSO']) {
      assert.match(r.stdout, new RegExp(`^${section}$`, 'm'), `the man page has no ${section} section`);
    }
    for (const tool of TOOL_NAMES) assert.match(r.stdout, new RegExp(`${tool}\\(`), `the man page does not describe ${tool}`);
  });
});

describe('a server whose backend cannot run still serves', () => {
  const cases = [
    {
      backend: 'vm', env: { IGN_MCP_BACKEND: 'vm', IGN_MCP_QEMU: '/nonexistent/qemu' },
      says: [/IGN_MCP_QEMU=\/nonexistent\/qemu is not an executable file/, /missing qemu: .*fix: unset IGN_MCP_QEMU/],
    },
    {
      backend: 'vm', env: { IGN_MCP_BACKEND: 'vm', IGN_MCP_KERNEL: '/nonexistent/vmlinux' },
      says: [/missing kernel: IGN_MCP_KERNEL=\/nonexistent\/vmlinux is not a file; fix: unset IGN_MCP_KERNEL/],
    },
    {
      backend: 'ns', env: { IGN_MCP_BACKEND: 'ns', IGN_MCP_AGENT: '/nonexistent/ign-agent' },
      says: [/missing agent: IGN_MCP_AGENT=\/nonexistent\/ign-agent is not an executable file; fix: unset IGN_MCP_AGENT/],
    },
  ];
  for (const c of cases) {
    const what = Object.entries(c.env).filter(([k]) => k !== 'IGN_MCP_BACKEND').map(([k, v]) => `${k}=${v}`).join(' ');
    test(`${c.backend} with ${what}: initialize, tools/list, and open_session explains`, T, async (t) => {
      const s = await startServer({ env: c.env, listTools: false });
      t.after(() => s.close());
      const tools = await s.client.listTools();
      assert.deepEqual(tools.tools.map((x) => x.name).sort(), [...TOOL_NAMES].sort());
      const text = await callErr(s.client, 'open_session', {});
      assert.match(text, /^no sandbox backend can run here: /);
      assert.match(text, new RegExp(`What \`ignition-mcp doctor\` finds for IGN_MCP_BACKEND=${c.backend}:`));
      for (const re of c.says) assert.match(text, re);
      assert.match(text, /restart the MCP server/);
      // Asking again gives the same answer; the other tools still work.
      assert.equal(await callErr(s.client, 'open_session', {}), text);
      const list = await call(s.client, 'list_sessions', {});
      assert.deepEqual(list.sessions, []);
      const warn = await waitUntil(() => /warning: no sandbox backend can run/.test(s.stderrText()), { timeoutMs: 3000 });
      assert.ok(warn, `no startup warning on stderr:\n${s.stderrText()}`);
      assert.equal(s.stderrText().match(/warning: no sandbox backend can run/g).length, 1, 'the warning should be one line, once');
    });
  }

  test('the checks run when open_session asks, not before initialize', T, async (t) => {
    // The checks take seconds (QEMU twice, a cgroup, namespaces); a client
    // waiting for initialize must not wait for them. The server logs, at
    // debug level, when it runs them for open_session's error.
    const doctorRuns = /running the doctor's checks/;
    const env = { IGN_MCP_BACKEND: 'ns', IGN_MCP_AGENT: '/nonexistent/ign-agent', IGN_MCP_LOG: 'debug' };
    const s = await startServer({ env, listTools: false });
    t.after(() => s.close());
    await s.client.listTools();
    assert.ok(await waitUntil(() => /warning: no sandbox backend can run/.test(s.stderrText()), { timeoutMs: 3000 }),
      `no startup warning on stderr:\n${s.stderrText()}`);
    assert.doesNotMatch(s.stderrText(), doctorRuns, 'the checks ran before initialize was answered');
    const text = await callErr(s.client, 'open_session', {});
    assert.match(text, /missing agent: IGN_MCP_AGENT=\/nonexistent\/ign-agent is not an executable file/);
    assert.ok(await waitUntil(() => doctorRuns.test(s.stderrText()), { timeoutMs: 3000 }),
      `open_session did not run the checks:\n${s.stderrText()}`);
  });
});

describe('make install', () => {
  let root = null;
  after(() => {
    if (root) fs.rmSync(root, { recursive: true, force: true });
  });

  /* The environment a client gives the server: nothing of ours. */
  function cleanEnv(extra = {}) {
    const e = {};
    for (const [k, v] of Object.entries(process.env)) if (!k.startsWith('IGN_MCP_') && !k.startsWith('IGN_TEST_')) e[k] = v;
    return { ...e, ...extra };
  }

  test('installs into DESTDIR+PREFIX; the installed server finds everything from / with no IGN_MCP_* set', {
    timeout: 600_000,
    skip: process.getuid() !== 0 && 'root only: make install copies the rootfs trees, parts of which only root may read (their /root is 0700)',
  }, async (t) => {
    // With no variable set the server wants the tools rootfs.
    if (!fs.lstatSync(path.join(REPO, 'build/rootfs/tools/bin/sh'), { throwIfNoEntry: false })) {
      return t.skip('the tools rootfs is not built (make rootfs-tools): an installed server without it has no default rootfs');
    }
    try {
      fs.readdirSync(path.join(REPO, 'build/rootfs/tools/root'));
    } catch (e) {
      return t.skip(`make install copies the rootfs trees with cp -a, and this user cannot read them (${e.code}: built by root)`);
    }
    const haveVm = fs.existsSync(path.join(REPO, 'build/vm/vmlinux'));
    root = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-install-'));
    // The QEMUs (other uids when we are root) read the images under it.
    fs.chmodSync(root, 0o755);
    const mk = spawnSync('make', ['--no-print-directory', 'install', `DESTDIR=${root}`, 'PREFIX=/usr/local'], {
      cwd: REPO, encoding: 'utf8', timeout: 300_000, env: cleanEnv(),
    });
    assert.equal(mk.status, 0, `make install failed:\n${mk.stdout}\n${mk.stderr}`);
    const P = path.join(root, 'usr/local');
    const lib = path.join(P, 'lib/ignition-mcp');
    for (const f of ['bin/ignition-mcp', 'lib/ignition-mcp/ign-agent', 'share/man/man1/ignition-mcp.1', 'share/doc/ignition-mcp/README.md']) {
      assert.ok(fs.existsSync(path.join(P, f)), `make install did not install ${f}`);
    }
    fs.accessSync(path.join(P, 'bin/ignition-mcp'), fs.constants.X_OK);
    for (const name of ['small', 'tools']) {
      if (!fs.lstatSync(path.join(REPO, 'build/rootfs', name, 'bin/sh'), { throwIfNoEntry: false })) continue;
      const sh = fs.lstatSync(path.join(lib, 'rootfs', name, 'bin/sh'), { throwIfNoEntry: false });
      assert.ok(sh, `the rootfs ${name} was not installed under ${lib}/rootfs`);
    }
    // cp -a kept what a rootfs needs: symlinks, setuid bits, device nodes.
    const su = path.join(lib, 'rootfs/tools/usr/bin/su');
    if (fs.existsSync(su)) assert.ok(fs.statSync(su).mode & 0o4000, 'the setuid bit of su was lost');
    const binLink = path.join(lib, 'rootfs/tools/bin');
    if (fs.existsSync(binLink)) assert.ok(fs.lstatSync(binLink).isSymbolicLink(), 'rootfs/tools/bin should stay a symlink');
    for (const f of ['vmlinux', 'initramfs.cpio', 'rootfs-small.erofs']) {
      if (fs.existsSync(path.join(REPO, 'build/vm', f))) assert.ok(fs.existsSync(path.join(lib, 'vm', f)), `vm/${f} was not installed`);
    }

    const server = path.join(P, 'bin/ignition-mcp');
    const dr = spawnSync(server, ['doctor'], { cwd: '/', env: cleanEnv(), encoding: 'utf8', timeout: 60_000 });
    assert.equal(dr.status, 0, `the installed doctor failed:\n${dr.stdout}\n${dr.stderr}`);
    assert.match(checkLine(dr.stdout, 'agent').rest, new RegExp(`^${lib}/ign-agent$`));
    assert.match(checkLine(dr.stdout, 'rootfs').rest, new RegExp(`^${lib}/rootfs/tools `));
    if (haveVm) {
      assert.match(checkLine(dr.stdout, 'kernel').rest, new RegExp(`^${lib}/vm/vmlinux `));
      assert.match(checkLine(dr.stdout, 'image').rest, new RegExp(`^${lib}/vm/rootfs-tools.erofs `));
    }

    // A session on the pass's backend, through the SDK, from /. The vm pass
    // gets a store of its own (the installed images make a base of their
    // own, which must not replace the ones in the default store) and the
    // small rootfs, whose base is made fastest; the ns pass needs nothing.
    const store = IS_VM ? tempStore('ign-install-store') : null;
    t.after(() => store?.remove());
    const env = cleanEnv(IS_VM
      ? { IGN_MCP_BACKEND: 'vm', IGN_MCP_STORE: store.dir, IGN_MCP_ROOTFS: 'small', IGN_MCP_POOL: '0', IGN_MCP_SPARES: '0' }
      : { IGN_MCP_BACKEND: 'ns' });
    const transport = new StdioClientTransport({ command: server, args: [], env, cwd: '/', stderr: 'pipe' });
    let stderr = '';
    transport.stderr.on('data', (d) => { stderr += d; });
    const client = new Client({ name: 'ign-install-test', version: '0.0.1' }, { capabilities: {} });
    await client.connect(transport);
    const pid = transport.pid;
    let kids = [];
    try {
      const tools = await client.listTools();
      assert.equal(tools.tools.length, TOOL_NAMES.length);
      const opened = await call(client, 'open_session', {}, { timeout: 300_000 });
      assert.equal(opened.backend, BACKEND, stderr);
      const r = await call(client, 'run', { session_id: opened.session_id, command: 'echo hi' });
      assert.equal(r.stdout, 'hi\n');
      assert.equal(r.exit_code, 0);
      kids = descendants(pid);
      await call(client, 'close', { session_id: opened.session_id });
    } finally {
      await client.close().catch(() => {});
    }
    await waitUntil(() => !procStart(pid) || procStart(pid).state === 'Z', { timeoutMs: 6000 });
    assert.deepEqual((await waitGone(kids, 5000)).map((k) => k.cmd), [], 'processes of the installed server outlived it');
    await assertNoVmLeftovers(pid);

    // A piece taken away: doctor names it, and says the server is installed.
    fs.rmSync(path.join(lib, 'vm/vmlinux'), { force: true });
    const dm = spawnSync(server, ['doctor'], { cwd: '/', env: cleanEnv({ IGN_MCP_BACKEND: 'vm' }), encoding: 'utf8', timeout: 60_000 });
    assert.equal(dm.status, 1, dm.stdout);
    assert.match(checkLine(dm.stdout, 'kernel').rest,
      new RegExp(`^vmlinux is neither in ${P}/bin/vm nor in ${lib}/vm; fix: make vm-images && (sudo )?make install \\(in the ignition-mcp source tree`));
    fs.rmSync(path.join(lib, 'ign-agent'), { force: true });
    const da = spawnSync(server, ['doctor'], { cwd: '/', env: cleanEnv({ IGN_MCP_BACKEND: 'ns' }), encoding: 'utf8', timeout: 60_000 });
    assert.equal(da.status, 1, da.stdout);
    assert.match(checkLine(da.stdout, 'agent').rest, new RegExp(`^ign-agent is neither in ${P}/bin nor in ${lib}; fix: make && (sudo )?make install`));

    const un = spawnSync('make', ['--no-print-directory', 'uninstall', `DESTDIR=${root}`, 'PREFIX=/usr/local'], { cwd: REPO, encoding: 'utf8' });
    assert.equal(un.status, 0, un.stderr);
    const left = spawnSync('find', [root, '-not', '-type', 'd'], { encoding: 'utf8' }).stdout.trim();
    assert.equal(left, '', 'make uninstall left files behind');
  });
});
