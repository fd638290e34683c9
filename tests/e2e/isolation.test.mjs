// isolation.test.mjs: what a sandbox must not reach: host files, network,
// kernel knobs, mounts, other sessions. These are rows of the abuse table in
// abuse.test.mjs (which has the fork bomb, memory hog, full overlay, kill -9
// -1 and the rest); like those, every server here runs inside the second
// fence (tests/fence.sh), so a containment bug fails a test instead of
// taking the machine down.
//
// Both backends run these, with the expectation that fits each: in the ns
// backend the sandbox's root is refused mounts, namespaces and kernel knobs;
// in a microVM the guest's root may do anything inside the guest, so there
// the tests check that the host is unaffected and that the session and other
// sessions keep working.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import {
  startServer, openSession, run, sh, uniq, uniqueSleepSecs, findProcs, waitUntil, writeFile, IS_NS,
  IS_VM, NS_ONLY, VM_ONLY, TOOLS_SKIP, sleep, REPO, NEEDS_CGROUPS,
} from './lib.mjs';

const T = { timeout: 90_000 };

/* Fail unless the sandbox runs in its own PID namespace with the agent as
 * PID 1 and no host process visible. */
async function assertOwnPidNamespace(c, sid) {
  const out = await sh(c, sid, 'echo $$; cat /proc/1/comm; readlink /proc/1/exe 2>/dev/null || echo unknown; ls /proc | grep -c "^[0-9][0-9]*$"');
  const [shPid, comm1, exe1, count] = out.trim().split('\n');
  assert.ok(Number(shPid) < 1000, `sandbox shell has pid ${shPid}; not in its own pid namespace?`);
  assert.ok(/ign|agent/.test(comm1) || /ign|agent/.test(exe1), `PID 1 in the sandbox is ${comm1} (${exe1}), not the agent`);
  assert.ok(Number(count) < 20, `${count} processes visible in the sandbox`);
}

/* Fail unless commands run inside the guest kernel: its command line carries
 * the backend's ign.* options (the host's does not), PID 1 is the agent
 * (/init of the initramfs) and few user processes exist. */
async function assertInGuest(c, sid) {
  const host = fs.readFileSync('/proc/cmdline', 'utf8');
  assert.ok(!host.includes('ign.fstype='), 'the host kernel command line looks like a guest one; the check is blind');
  const out = await sh(c, sid, 'cat /proc/cmdline; tr "\\0" " " < /proc/1/cmdline; echo; n=0; for p in /proc/[0-9]*; do [ -s $p/cmdline ] && n=$((n+1)); done; echo $n');
  const [cmdline, init, users] = out.trim().split('\n');
  assert.match(cmdline, /ign\.fstype=/, `not the guest kernel: ${cmdline}`);
  assert.match(init, /^\/init\b/, `PID 1 in the guest is ${init}, not the agent`);
  assert.ok(Number(users) < 10, `${users} user processes in the guest`);
}

const assertSandboxed = IS_NS ? assertOwnPidNamespace : assertInGuest;

describe('host is invisible', () => {
  let s, c, sid;
  const markers = [];
  before(async () => {
    s = await startServer({ fence: true });
    c = s.client;
    sid = await openSession(c);
  });
  after(async () => {
    for (const m of markers) fs.rmSync(m, { force: true });
    await s.close();
  });

  test('host files are not visible', T, async () => {
    // The home of whoever runs the suite: /root, or a user's.
    for (const dir of [os.homedir(), '/tmp']) {
      const m = path.join(dir, uniq('host-marker'));
      fs.writeFileSync(m, 'host secret\n');
      markers.push(m);
      const r = await run(c, sid, `test -e '${m}' && echo VISIBLE || echo absent`);
      assert.equal(r.stdout, 'absent\n', `host file ${m} visible in the sandbox`);
    }
    const hostHostname = fs.existsSync('/etc/hostname') ? fs.readFileSync('/etc/hostname', 'utf8') : null;
    const inside = await run(c, sid, 'cat /etc/hostname 2>/dev/null');
    if (hostHostname !== null) assert.notEqual(inside.stdout, hostHostname, 'sandbox /etc/hostname is the host one');
    // The server's own tree and the host's home are not there either.
    const r = await run(c, sid, `test -e '${REPO}/tests/e2e/lib.mjs' && echo VISIBLE || echo absent`);
    assert.equal(r.stdout, 'absent\n');
  });

  test('the root filesystem is the rootfs, not the host', T, async () => {
    const r = await run(c, sid, 'test -e /work && echo VISIBLE; test -e /proc/1/root/work && echo VISIBLE2; echo done');
    assert.equal(r.stdout, 'done\n');
  });

  test('no host path in the mount table, no server pid in /proc/self/cgroup', T, async () => {
    // The rootfs tree, the build directory and the checkout the server runs
    // from are host paths; so is anything under the setup's /oldroot.
    const rootfs = fs.realpathSync(process.env.IGN_TEST_ROOTFS_SMALL || path.join(REPO, 'build/rootfs/small'));
    const hostPaths = [rootfs, REPO, path.dirname(rootfs), '/oldroot'];
    for (const f of ['/proc/self/mountinfo', '/proc/mounts', '/proc/1/mountinfo']) {
      const text = await sh(c, sid, `cat ${f} 2>/dev/null || true`);
      if (f !== '/proc/1/mountinfo') assert.match(text, / \/ /, `${f} is empty: the check is blind`);
      for (const p of hostPaths) assert.ok(!text.includes(p), `${f} shows the host path ${p}:\n${text}`);
    }
    const cg = await sh(c, sid, 'cat /proc/self/cgroup');
    assert.ok(!/ign-mcp-/.test(cg), `/proc/self/cgroup names the server's groups:\n${cg}`);
    if (IS_NS) {
      // Every hierarchy's path is the root of the session's own namespace.
      const lines = cg.trim().split('\n');
      assert.ok(lines.length >= 1);
      for (const l of lines) assert.match(l, /^\d+:[^:]*:\/$/, `not the namespace's root: ${l}`);
    }
  });

  test('host kernel files in /proc are masked (empty or absent)', { ...T, skip: NS_ONLY('a microVM has its own kernel: its /proc is the guest\'s') }, async () => {
    // crun's, runc's and Docker's masked paths, and the ones they miss.
    const files = ['kcore', 'keys', 'key-users', 'timer_list', 'timer_stats', 'sched_debug', 'latency_stats',
      'interrupts', 'sysrq-trigger', 'slabinfo', 'vmallocinfo', 'config.gz', 'cmdline', 'kallsyms',
      'kpagecount', 'kpageflags', 'kpagecgroup'];
    const dirs = ['acpi', 'asound', 'scsi'];
    // On the host they exist and have content, or the check would be blind.
    const hostHas = files.filter((f) => fs.existsSync(`/proc/${f}`));
    // (Some are root's to read: an ordinary user running the suite skips those.)
    for (const f of ['key-users', 'slabinfo', 'cmdline', 'config.gz', 'interrupts']) {
      let text = null;
      try {
        text = fs.readFileSync(`/proc/${f}`);
      } catch (e) {
        if (e.code !== 'ENOENT' && !(e.code === 'EACCES' && process.getuid() !== 0)) throw e;
      }
      if (text) assert.ok(text.length > 0, `host /proc/${f} is empty`);
    }
    const out = await sh(c, sid, `for f in ${files.join(' ')}; do printf '%s ' $f; if [ -e /proc/$f ]; then head -c 4096 /proc/$f 2>/dev/null | wc -c; else echo absent; fi; done; for d in ${dirs.join(' ')}; do printf '%s ' $d; ls -A /proc/$d 2>/dev/null | wc -l; done`);
    const seen = Object.fromEntries(out.trim().split('\n').map((l) => l.trim().split(/\s+/)));
    for (const f of hostHas) assert.ok(seen[f] === '0' || seen[f] === 'absent', `/proc/${f} shows ${seen[f]} bytes of the host's`);
    for (const d of dirs) assert.equal(seen[d], '0', `/proc/${d} is not empty`);
    // Masks cannot be written through or removed.
    const w = await run(c, sid, 'echo c > /proc/sysrq-trigger; umount /proc/keys; echo rc=$?');
    assert.match(w.stdout, /rc=[1-9]/);
    assert.equal(await sh(c, sid, 'wc -c < /proc/keys'), '0\n');
  });

  test('only lo exists in the network namespace', T, async () => {
    const dev = await sh(c, sid, 'cat /proc/net/dev');
    const ifaces = dev.split('\n').slice(2).map((l) => l.split(':')[0].trim()).filter(Boolean);
    assert.deepEqual(ifaces, ['lo'], dev);
    if (IS_VM) assert.equal(await sh(c, sid, "ls /sys/class/net"), "lo\n");
  });

  test('ps shows only sandbox processes and PID 1 is the agent', T, async () => {
    await assertSandboxed(c, sid);
    const ps = await sh(c, sid, 'for p in /proc/[0-9]*; do tr "\\0" " " < $p/cmdline; echo; done');
    assert.ok(!ps.includes('node'), `host processes visible:\n${ps}`);
    assert.ok(!ps.includes('ignition-mcp'), `server visible:\n${ps}`);
    assert.ok(!ps.includes('qemu'), `QEMU visible:\n${ps}`);
  });

  test(IS_NS ? 'kernel knobs cannot be written' : 'kernel knobs written in the guest do not reach the host', T, async () => {
    const hn = os.hostname();
    const printk = fs.readFileSync('/proc/sys/kernel/printk', 'utf8');
    const hostDomain = IS_VM ? fs.readFileSync('/proc/sys/kernel/domainname', 'utf8') : null;
    try {
      const r1 = await run(c, sid, 'echo e2e-should-fail > /proc/sys/kernel/hostname');
      const r2 = await run(c, sid, 'echo 3 > /proc/sys/vm/drop_caches');
      if (IS_NS) {
        assert.notEqual(r1.exit_code, 0, 'writing /proc/sys/kernel/hostname succeeded');
        assert.notEqual(r2.exit_code, 0, 'writing /proc/sys/vm/drop_caches succeeded');
      } else {
        // The guest's root owns the guest kernel: these work, in the guest.
        assert.equal(r1.exit_code, 0, `the guest root could not set the guest's hostname: ${r1.stderr}`);
        assert.equal(await sh(c, sid, 'hostname'), 'e2e-should-fail\n');
        await sh(c, sid, 'echo e2e-domain > /proc/sys/kernel/domainname');
      }
      // '1' would set the host console log level; it must fail or go nowhere.
      await run(c, sid, 'echo 1 > /proc/sysrq-trigger');
      assert.equal(fs.readFileSync('/proc/sys/kernel/printk', 'utf8'), printk, 'sysrq-trigger reached the host kernel');
      assert.equal(os.hostname(), hn, 'host hostname changed');
      if (IS_VM) assert.equal(fs.readFileSync('/proc/sys/kernel/domainname', 'utf8'), hostDomain, 'host domainname changed');
    } finally {
      if (os.hostname() !== hn) fs.writeFileSync('/proc/sys/kernel/hostname', hn);
      const lvl = printk.split(/\s+/)[0];
      if (fs.readFileSync('/proc/sys/kernel/printk', 'utf8') !== printk) fs.writeFileSync('/proc/sys/kernel/printk', lvl);
      if (IS_VM && fs.readFileSync('/proc/sys/kernel/domainname', 'utf8') !== hostDomain) fs.writeFileSync('/proc/sys/kernel/domainname', hostDomain);
    }
    assert.equal(await sh(c, sid, 'echo ok'), 'ok\n');
  });

  test('mounting is refused', { ...T, skip: NS_ONLY('in a microVM the guest root may mount; the vm variant checks the host') }, async () => {
    const r = await run(c, sid, 'mkdir -p /root/mnt && mount -t tmpfs x /root/mnt');
    assert.notEqual(r.exit_code, 0, 'mount -t tmpfs succeeded');
    assert.equal(await sh(c, sid, 'grep -c " /root/mnt " /proc/mounts || true'), '0\n');
    const r2 = await run(c, sid, 'mkdir -p /mnt 2>/dev/null; mount -t tmpfs x /mnt');
    assert.notEqual(r2.exit_code, 0, 'mount on /mnt succeeded');
  });

  test('mounts made in the guest stay in the guest', { ...T, skip: VM_ONLY('the ns backend refuses mounts (tested above)') }, async () => {
    const name = uniq('guestmnt');
    await sh(c, sid, `mkdir -p /root/${name} && mount -t tmpfs ${name} /root/${name} && grep -c " /root/${name} " /proc/mounts`);
    for (const f of ['/proc/self/mountinfo', '/proc/1/mountinfo']) {
      assert.ok(!fs.readFileSync(f, 'utf8').includes(name), `the guest's mount shows in the host's ${f}`);
    }
    assert.equal(fs.existsSync(`/root/${name}`), false, 'the guest directory appeared on the host');
    await sh(c, sid, `umount /root/${name}`);
    assert.equal(await sh(c, sid, 'echo ok'), 'ok\n');
  });

  test('the sandbox cannot reach a TCP listener on the host', T, async (t) => {
    let conns = 0;
    const srv = net.createServer((sock) => {
      conns++;
      sock.destroy();
    });
    await new Promise((r) => srv.listen(0, '0.0.0.0', r));
    t.after(() => srv.close());
    const port = srv.address().port;
    const addrs = ['127.0.0.1', '10.0.2.2'];
    for (const list of Object.values(os.networkInterfaces())) {
      for (const a of list ?? []) if (a.family === 'IPv4' && !a.internal) addrs.push(a.address);
    }
    // Sanity: the listener really accepts from the host.
    await new Promise((res, rej) => {
      const sock = net.connect(port, '127.0.0.1');
      sock.on('connect', () => {
        sock.destroy();
        res();
      });
      sock.on('error', rej);
    });
    await waitUntil(() => conns === 1);
    assert.equal(conns, 1);
    conns = 0;
    assert.notEqual((await run(c, sid, 'command -v nc')).stdout.trim(), '', 'nc missing in the rootfs');
    // 127.0.0.1 is the sandbox's own loopback: nothing listens there. To
    // any other address the connect itself completes with the sandbox's own
    // agent (which takes every TCP connection for the egress broker); the
    // session's network is "none", so each attempt is reset and recorded,
    // and the host's listener never sees one.
    const local = await run(c, sid, `echo hi | nc -w 2 127.0.0.1 ${port}; echo rc=$?`, { timeout_s: 10 });
    assert.match(local.stderr, /Connection refused/, JSON.stringify(local));
    assert.equal(local.egress.total_events, 0, JSON.stringify(local.egress));
    for (const a of addrs.filter((x) => x !== '127.0.0.1')) {
      const r = await run(c, sid, `echo hi | nc -w 2 ${a} ${port}; echo rc=$?`, { timeout_s: 10 });
      const refused = (r.egress?.denied ?? []).filter((e) => e.kind === 'connect' && e.port === port && e.ip === a);
      assert.equal(refused.length, 1, `nc to ${a}:${port} not refused in the record: ${JSON.stringify(r)}`);
      assert.equal(refused[0].reason, 'network is none', JSON.stringify(refused[0]));
      assert.equal((r.egress?.allowed ?? []).length, 0, JSON.stringify(r.egress));
    }
    await sleep(200);
    assert.equal(conns, 0, 'the host listener saw a connection from the sandbox');
  });
});

/* The lines of `ps` in a session that name `sleep N`. */
async function sleepsIn(c, sid, n) {
  const ps = await sh(c, sid, 'for p in /proc/[0-9]*; do tr "\\0" " " < $p/cmdline; echo; done');
  return ps.split('\n').filter((l) => l.trim() === `sleep ${n}`).length;
}

describe('sessions are isolated from each other', () => {
  test('two sessions see neither files nor processes of the other', T, async (t) => {
    const s = await startServer({ fence: true });
    t.after(() => s.close());
    const a = await openSession(s.client);
    const b = await openSession(s.client);
    const n = uniqueSleepSecs();
    const secret = uniq('secret');
    await sh(s.client, a, `echo x > /root/${secret}; echo y > /tmp/${secret}; sleep ${n} > /dev/null 2>&1 &`);
    // The name travels in env, so that b's own command line does not hold it.
    const r = await run(s.client, b, 'ls -a /root /tmp; test -e "/root/$S" && echo VISIBLE || echo absent; for p in /proc/[0-9]*; do tr "\\0" " " < $p/cmdline; echo; done', { env: { S: secret } });
    assert.ok(!r.stdout.includes(secret), r.stdout);
    const lines = r.stdout.split('\n');
    assert.ok(lines.includes('absent') && !lines.includes('VISIBLE'), r.stdout);
    assert.ok(!r.stdout.includes(`sleep ${n}`), r.stdout);
    assert.ok(r.stdout.includes('ls -a /root /tmp'), 'b does not see its own process either; the check is blind');
    // The sleep runs in a (seen from the host on ns, from inside a on vm).
    if (IS_NS) assert.equal(findProcs(['sleep', String(n)]).length, 1, 'the sleep in session a is not running');
    assert.equal(await sleepsIn(s.client, a, n), 1, 'the sleep in session a is not running');
    const k = await run(s.client, b, `pkill -f 'sleep ${n}' 2>/dev/null; kill -9 -1 2>/dev/null; true`);
    assert.equal(k.exit_code === 0 || k.exit_code === 137, true);
    if (IS_NS) assert.equal(findProcs(['sleep', String(n)]).length, 1, 'session b could kill a process of session a');
    assert.equal(await sleepsIn(s.client, a, n), 1, 'session b could kill a process of session a');
    assert.equal(await sh(s.client, a, `cat /root/${secret}`), 'x\n');
  });
});

/* The abusive guests (fork bomb, memory hog, full overlay, kill -9 -1, ...)
 * are in abuse.test.mjs, one test per row of the table there. */
describe('namespaces and memory, from the tools rootfs', () => {
  test('unshare -U is refused', { ...T, skip: TOOLS_SKIP || NS_ONLY('in a microVM the guest root may make namespaces inside the guest') }, async (t) => {
    const s = await startServer({ tools: true, fence: true });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    const r = await run(s.client, sid, 'command -v unshare && unshare -U true; echo rc=$?');
    assert.match(r.stdout, /unshare/, 'unshare not in the tools rootfs');
    assert.ok(!r.stdout.includes('rc=0'), `unshare -U succeeded: ${JSON.stringify(r)}`);
    const r2 = await run(s.client, sid, 'unshare -Ur true; echo rc=$?');
    assert.ok(!r2.stdout.includes('rc=0'), `unshare -Ur succeeded: ${JSON.stringify(r2)}`);
  });

  test('memory limit: python allocating 512 MiB is killed (tools rootfs)', { ...T, skip: TOOLS_SKIP || (IS_NS && NEEDS_CGROUPS('memory is not enforced without a cgroup')) }, async (t) => {
    // ns: a 128 MiB cgroup; vm: the guest's 256 MiB of RAM.
    const s = await startServer({ tools: true, fence: true, env: IS_NS ? { IGN_MCP_PIDS: 64, IGN_MCP_MEMORY_MB: 128 } : {} });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    const r = await run(s.client, sid, `python3 -c "b=bytearray(512*1024*1024); print('survived', len(b))"`, { timeout_s: 60 });
    assert.notEqual(r.exit_code, 0, `python kept 512 MiB under a smaller limit: ${JSON.stringify(r)}`);
    assert.ok(!r.stdout.includes('survived'));
    // Killed by the OOM killer (SIGKILL) or refused the memory: not some other failure.
    assert.ok(r.exit_code === 137 || /MemoryError/.test(r.stderr), `python failed for another reason: ${JSON.stringify(r)}`);
    assert.deepEqual(await s.client.ping(), {});
    assert.equal(await sh(s.client, sid, 'echo alive'), 'alive\n');
  });
});

describe('network from the tools rootfs', () => {
  test('/dev/tcp to the host listener fails', { ...T, skip: TOOLS_SKIP }, async (t) => {
    let conns = 0;
    const srv = net.createServer((sock) => {
      conns++;
      sock.destroy();
    });
    await new Promise((r) => srv.listen(0, '0.0.0.0', r));
    t.after(() => srv.close());
    const s = await startServer({ tools: true, fence: true });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    const port = srv.address().port;
    const r = await run(s.client, sid, `timeout 5 bash -c 'echo hi > /dev/tcp/127.0.0.1/${port}'; echo rc=$?`, { timeout_s: 20 });
    assert.ok(!r.stdout.includes('rc=0'), JSON.stringify(r));
    const r2 = await run(s.client, sid, `curl -sS -m 5 http://127.0.0.1:${port}/ ; echo rc=$?; curl -sS -m 5 http://10.0.2.2:${port}/ ; echo rc=$?; curl -sS -m 5 http://1.1.1.1/; echo rc=$?`, { timeout_s: 30 });
    assert.ok(!r2.stdout.includes('rc=0'), JSON.stringify(r2));
    assert.equal(conns, 0);
  });
});

/* tests/e2e/seccomp-probe.c built static with the host's compiler, or a
 * reason to skip. */
function buildSeccompProbe() {
  const out = path.join(os.tmpdir(), uniq('ign-seccomp-probe'));
  try {
    execFileSync('gcc', ['-static', '-O1', '-std=gnu17', '-D_GNU_SOURCE', '-I', REPO, '-o', out,
      path.join(REPO, 'tests/e2e/seccomp-probe.c')], { stdio: ['ignore', 'ignore', 'pipe'] });
  } catch (e) {
    return { skip: `cannot build tests/e2e/seccomp-probe.c with gcc -static: ${String(e.stderr || e.message).trim().split('\n')[0]}` };
  }
  const bin = fs.readFileSync(out);
  fs.rmSync(out, { force: true });
  return { bin };
}

// The probe run on the host, without the sandbox's filter: what the kernel
// itself does with a syscall of ABI.
function hostProbe(bin, abi) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-probe-'));
  try {
    const exe = path.join(dir, 'seccomp-probe');
    fs.writeFileSync(exe, bin, { mode: 0o755 });
    const r = spawnSync(exe, [abi], { encoding: 'utf8', timeout: 10000 });
    return { status: r.status, signal: r.signal, stdout: r.stdout };
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

describe('the ns seccomp filter, entry by entry', () => {
  test('every entry of the deny list (guest/confine.h) is refused inside a session with the filter\'s errno', { ...T, skip: NS_ONLY('a microVM\'s guest root owns its kernel; the agent installs no filter there') }, async (t) => {
    const probe = buildSeccompProbe();
    if (probe.skip) return t.skip(probe.skip);
    const s = await startServer({ fence: true });
    t.after(() => s.close());
    const sid = await openSession(s.client);
    await writeFile(s.client, sid, '/root/seccomp-probe', probe.bin, { mode: 0o755 });
    const r = await run(s.client, sid, '/root/seccomp-probe');
    assert.equal(r.exit_code, 0, JSON.stringify(r).slice(0, 500));
    const rows = r.stdout.trim().split('\n').map((l) => l.split(' '));
    const names = rows.map((x) => x[0]);
    // The entries are in the list; the rest comes from the same table.
    for (const want of ['io_uring_setup', 'io_uring_enter', 'io_uring_register', 'socket(AF_VSOCK)',
      'socketpair(AF_VSOCK)', 'socket(AF_NETLINK,NETLINK_KOBJECT_UEVENT)', 'socket(family>=AF_MAX)',
      'userfaultfd', 'perf_event_open', 'bpf', 'keyctl', 'add_key', 'request_key', 'kexec_load',
      'open_by_handle_at', 'name_to_handle_at', 'fsopen', 'fsmount', 'move_mount', 'open_tree',
      'mount', 'unshare', 'setns', 'clone(CLONE_NEWUSER)', 'clone3']) {
      assert.ok(names.includes(want), `${want} is not in the deny list`);
    }
    const wrong = rows.filter(([, want, got]) => got !== want).map((x) => x.join(' '));
    assert.deepEqual(wrong, [], 'entries of the deny list that the sandbox let through (name, errno wanted, errno got)');
    // Syscalls of the other x86 ABIs, whose numbers the filter does not
    // know, kill the process.
    if (process.arch === 'x64') {
      for (const abi of ['i386', 'x32']) {
        const k = await run(s.client, sid, `/root/seccomp-probe ${abi}; echo rc=$?`);
        // A kernel built or booted without that ABI (ia32_emulation=0)
        // faults the instruction before any filter sees it: SIGSEGV on the
        // host too, and the syscall never runs.  The probe run on the host,
        // unfiltered, tells which kernel this is.
        const host = hostProbe(probe.bin, abi);
        if (host.signal === 'SIGSEGV') {
          assert.match(k.stdout, /^rc=(159|139)\n$/, `a ${abi} syscall survived in the session: ${JSON.stringify(k)}`);
          t.diagnostic(`this kernel has no ${abi} syscall entry (the probe faults on the host too): rc ${k.stdout.trim()}`);
        } else {
          assert.equal(host.status, 0, `the ${abi} probe on the host: ${JSON.stringify(host)}`);
          assert.equal(k.stdout, 'rc=159\n', `a ${abi} syscall was not killed by SIGSYS: ${JSON.stringify(k)}`);
        }
      }
    }
    // What stays allowed still works: a socket of an allowed family, a
    // netlink route socket, a fork.
    assert.equal(await sh(s.client, sid, 'echo hi | nc -l -p 7000 & sleep 0.3; nc 127.0.0.1 7000 </dev/null; ip -o link show lo | grep -c lo; wait'), 'hi\n1\n');
    t.diagnostic(`${rows.length} deny-list entries probed inside the session, all refused`);
  });
});
