// bench.mjs: the benchmark harness of ignition-mcp.
//
//   node bench/bench.mjs [--quick] [--only 1,2,...]
//
// With --only, the sections not named are kept from the last run's
// bench/results.json (each says so in BENCHMARKS.md). BENCH_STORE=DIR runs
// every server on that store instead of the server's default (section 8
// always uses stores of its own); BENCH_QEMU=PATH runs every server with
// that QEMU (IGN_MCP_QEMU: the environment's IGN_MCP_* are not passed on).
//
// Drives the real server (build/ignition-mcp) through the official MCP SDK
// client over stdio, for both backends, and writes bench/BENCHMARKS.md
// (tables of median, p90, p99, samples and the ratio to each section's
// baseline) and bench/results.json (every raw sample). The machine is shared
// and noisy: every figure stands next to a baseline measured in the same
// run, and the ratio is the number to read, not the absolute time.
//
// The layers of the exec path are measured one by one: the host alone
// (fork+exec of sh), the agent over its protocol with no sandbox
// (ign-agent --serve-fd), the server's session layer without MCP
// (build/ign-bench, see ign-bench.c), the server through raw JSON-RPC, and
// the server through the SDK.
//
// The vm backend: every vm row is tried; while IGN_MCP_BACKEND=vm cannot
// open a session, the row says "not measured" with the error open_session
// returned, so the harness picks the vm up by itself once it works.
//   vm, pool hit   IGN_MCP_POOL=2, with a pause between opens for the refill
//   vm, restore    IGN_MCP_POOL=0
//   vm, cold boot  IGN_MCP_BASE=none (no snapshot: every session boots from scratch)
//                  (no snapshot), one fresh server per sample
// The `path` each vm open_session reports (pool, restore, cold) is recorded
// and shown, so a row that did not take the path it names is visible.

import { spawn, spawnSync } from 'node:child_process';
import crypto from 'node:crypto';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import {
  AGENT, CBENCH, REPO, SERVER, VM_DIR, cbench, cbenchServe, cgroupChargeKiB, descendants, killTree, log, machineInfo,
  msSince, nowNs, nsToMs, pssKiB, reapRecords, runChild, serverEnv, setSection, sleep, startRawServer,
  startServer, track, tscKhz, untrack, MODERN_META, startHttpServer, httpClient, rssKiB,
} from './lib.mjs';
import { writeReport } from './report.mjs';

const QUICK = process.argv.includes('--quick');
const onlyArg = process.argv.indexOf('--only');
const ONLY = onlyArg > 0 ? new Set(process.argv[onlyArg + 1].split(',').map(Number)) : null;

/* Sample counts: quick finishes in a few minutes on 2 cores. */
const N = QUICK
  ? { open: 15, openVm: 8, stage: 10, stageVm: 5, cold: 3, bwrap: 20, qemu: 3, exec: 60, f4k: 15, f1m: 8, f32m: 3, tputReps: 3, py: 8, gcc: 4, srt: 10, srtCli: 5, peerOurs: 30, http: 300, httpMem: 3 }
  : { open: 100, openVm: 30, stage: 40, stageVm: 15, cold: 6, bwrap: 100, qemu: 6, exec: 600, f4k: 100, f1m: 40, f32m: 8, tputReps: 5, py: 40, gcc: 20, srt: 60, srtCli: 20, peerOurs: 200, http: 2000, httpMem: 5 };
const RUNS_PER_SESSION = 50;
const POOL_SIZE = 2;
const POOL_REFILL_MS = Number(process.env.BENCH_POOL_REFILL_MS || 1500);

const BWRAP = ['bwrap', '--unshare-all', '--ro-bind', '/', '/', '--dev', '/dev', '--proc', '/proc', '--die-with-parent'];
const KiB = 1024;
const MiB = 1024 * 1024;
const FILE_SIZES = [
  { size: 4 * KiB, label: '4 KiB', n: N.f4k },
  { size: 1 * MiB, label: '1 MiB', n: N.f1m },
  { size: 32 * MiB, label: '32 MiB', n: N.f32m },
];

const BACKENDS = {
  ns: { IGN_MCP_BACKEND: 'ns' },
  vm: { IGN_MCP_BACKEND: 'vm', IGN_MCP_POOL: POOL_SIZE },
};

/* What the vm backend said when it could not open a session (null: works). */
let vmError = null;
let vmInfo = null;

// ---------------------------------------------------------------- helpers

const row = (label, samples, extra = {}) => ({ label, samples, ...extra });
const notMeasured = (label, why, extra = {}) => ({ label, samples: [], notMeasured: why, ...extra });

function countPaths(paths) {
  const c = {};
  for (const p of paths) if (p) c[p] = (c[p] || 0) + 1;
  const s = Object.entries(c).map(([k, v]) => `${k}×${v}`).join(', ');
  return s ? `path: ${s}` : '';
}

function firstLine(s) {
  return String(s).split('\n')[0].slice(0, 400);
}

/* Times fn() n times after `warmup` untimed calls; returns ms samples. */
async function timeN(n, fn, { warmup = 3, label = '' } = {}) {
  const out = [];
  let lastLog = Date.now();
  for (let i = 0; i < n + warmup; i++) {
    const t = nowNs();
    await fn(i);
    const ms = msSince(t);
    if (i >= warmup) out.push(ms);
    if (label && Date.now() - lastLog > 5000) {
      log(`  ${label}: ${out.length}/${n}`);
      lastLog = Date.now();
    }
  }
  return out;
}

const median = (a) => [...a].sort((x, y) => x - y)[Math.floor((a.length - 1) / 2)];

function doneLine(label, samples, unit = 'ms') {
  if (samples.length) log(`  ${label}: median ${median(samples).toFixed(unit === 'ms' ? 2 : 1)} ${unit} (n=${samples.length})`);
}

/* Runs fn with a fresh server (SDK client); closes it after. */
async function withServer(env, fn) {
  const srv = await startServer(env);
  try {
    return await fn(srv);
  } finally {
    await srv.close();
  }
}

/* Runs fn with an open session; closes it after. */
async function withSession(srv, fn) {
  const s = await srv.open();
  try {
    return await fn(s.session_id, s);
  } finally {
    await srv.tool('close', { session_id: s.session_id }).catch(() => {});
  }
}

async function probeVm() {
  try {
    await withServer(BACKENDS.vm, async (srv) => {
      const s = await srv.open();
      vmInfo = s;
      await srv.tool('close', { session_id: s.session_id });
    });
    log(`vm backend works: isolation ${vmInfo.isolation}, path ${vmInfo.path ?? '(none reported)'}`);
  } catch (e) {
    vmError = firstLine(e.message);
    log(`vm backend cannot open a session: ${vmError}; every vm row will say so`);
  }
}

// ---------------------------------------------------------------- 1. session start

/* open_session n times (each closed before the next); per sample the
 * client-side wall time, plus the open_ms and path the server reported.
 * With `fresh`, every sample gets a server of its own, started with the
 * environment fresh() returns ({env, cleanup}). */
async function measureOpens(env, n, { fresh = null, pauseMs = 0, label }) {
  const samples = [];
  const paths = [];
  const serverMs = [];
  let isolation;
  let lastLog = Date.now();
  const one = async (srv, keep) => {
    const t = nowNs();
    const s = await srv.open();
    const ms = msSince(t);
    await srv.tool('close', { session_id: s.session_id });
    isolation = s.isolation;
    if (keep) {
      samples.push(ms);
      paths.push(s.path ?? null);
      serverMs.push(s.open_ms ?? null);
    }
  };
  if (fresh) {
    for (let i = 0; i < n; i++) {
      const f = fresh();
      try {
        await withServer(f.env, (srv) => one(srv, true));
      } finally {
        f.cleanup();
      }
      log(`  ${label}: ${i + 1}/${n}`);
    }
  } else {
    await withServer(env, async (srv) => {
      if (pauseMs) await sleep(pauseMs * 2); // the pool fills after start
      for (let i = 0; i < n + 3; i++) {
        await one(srv, i >= 3);
        if (pauseMs) await sleep(pauseMs);
        if (Date.now() - lastLog > 5000) {
          log(`  ${label}: ${samples.length}/${n}`);
          lastLog = Date.now();
        }
      }
    });
  }
  doneLine(label, samples);
  return { samples, paths, serverMs, isolation };
}

function openRow(label, r, extra = {}) {
  const srvMed = r.serverMs.filter((x) => x != null);
  const notes = [countPaths(r.paths), srvMed.length ? `server open_ms median ${median(srvMed)}` : '', r.isolation ? `isolation ${r.isolation}` : '']
    .filter(Boolean)
    .join('; ');
  return row(label, r.samples, { extra: notes, paths: r.paths, open_ms: r.serverMs, ...extra });
}

/* A bare QEMU cold boot of the guest to its agent answering HELLO, without
 * the server: the floor under the vm cold path. */
function findVmImages() {
  const kernel = path.join(VM_DIR, 'vmlinux');
  const rootfs = path.join(VM_DIR, 'rootfs-tools.erofs');
  let initrd = process.env.BENCH_VM_INITRD;
  if (!initrd && fs.existsSync(VM_DIR)) {
    const c = fs.readdirSync(VM_DIR).filter((f) => /^(initramfs|initrd)/.test(f) && !/\.(stamp|tmp)$/.test(f)).sort();
    if (c.length) initrd = path.join(VM_DIR, c[0]);
  }
  const missing = [['kernel', kernel], ['initramfs', initrd], ['rootfs image', rootfs]].filter(([, p]) => !p || !fs.existsSync(p));
  return missing.length
    ? { missing: missing.map(([what, p]) => `${what} (${p ? path.relative(REPO, p) : `${path.relative(REPO, VM_DIR)}/initramfs*`})`).join(', ') }
    : { kernel, initrd, rootfs };
}

/* The protocol version the agent speaks, from proto/proto.h (a HELLO with
 * any other is answered with an ERROR frame). */
function protoVersion() {
  const m = /#define PROTO_VERSION (\d+)u/.exec(fs.readFileSync(path.join(REPO, 'proto/proto.h'), 'utf8'));
  if (!m) throw new Error('PROTO_VERSION not found in proto/proto.h');
  return Number(m[1]);
}

function helloFrame() {
  const b = Buffer.alloc(12 + 10);
  b.writeUInt32LE(10, 0); // payload length
  b.writeUInt8(1, 4); // HELLO
  b.writeUInt32LE(1, 8); // request id
  b.writeUInt16LE(1, 12); // TAG_VERSION
  b.writeUInt32LE(4, 14);
  b.writeUInt32LE(protoVersion(), 18);
  return b;
}

/* The printable bytes of a frame's payload (an ERROR's message), for a
 * failure that says what the agent said. */
const payloadText = (buf) => buf.subarray(12, 12 + Math.min(buf.readUInt32LE(0), 400)).toString('latin1').replace(/[^\x20-\x7e]+/g, ' ').trim();

async function bareQemuBoot(img, accel, dir) {
  const sock = path.join(dir, `agent-${crypto.randomBytes(4).toString('hex')}.sock`);
  const serial = path.join(dir, 'serial.log');
  const khz = tscKhz();
  // The guest command line of the server's cold boot (sandbox/vm/qemu.c).
  const append = `console=ttyS0 quiet ${khz ? `tsc_early_khz=${khz} ` : ''}nokaslr no_timer_check mitigations=off i8042.noaux i8042.nokbd i8042.nopnp cryptomgr.notests panic=-1 reboot=t${accel === 'tcg' ? ' norandmaps tsc=reliable' : ''} ign.fstype=erofs`;
  const argv = [
    '-M', 'microvm,x-option-roms=off,isa-serial=on,rtc=on,pic=off,pit=off', '-bios', 'qboot.rom',
    '-accel', accel, '-cpu', accel === 'kvm' ? 'host,-arch-capabilities' : 'qemu64', '-smp', '1', '-m', '256M',
    '-nodefaults', '-no-user-config', '-display', 'none', '-no-reboot', '-serial', `file:${serial}`,
    '-kernel', img.kernel, '-initrd', img.initrd, '-append', append,
    '-drive', `file=${img.rootfs},format=raw,if=none,readonly=on,id=root`, '-device', 'virtio-blk-device,drive=root',
    '-chardev', `socket,id=agent,path=${sock},server=on,wait=off`,
    '-device', 'virtio-serial-device,id=vser0', '-device', 'virtserialport,chardev=agent,name=agent,bus=vser0.0',
    '-object', 'rng-random,id=rng0,filename=/dev/urandom', '-device', 'virtio-rng-device,rng=rng0',
  ];
  const t = nowNs();
  const q = spawn('qemu-system-x86_64', argv, { stdio: ['ignore', 'ignore', 'pipe'] });
  track(q.pid, 'qemu (bare boot)');
  let qerr = '';
  q.stderr.on('data', (d) => (qerr += d));
  let exited = false;
  q.on('exit', () => (exited = true));
  try {
    const deadline = Date.now() + 120000;
    let s;
    while (!s) {
      if (exited) throw new Error(`qemu exited: ${qerr.trim().slice(-300)}`);
      if (Date.now() > deadline) throw new Error('no agent socket after 120 s');
      s = await new Promise((resolve) => {
        const c = net.connect(sock, () => resolve(c));
        c.on('error', () => resolve(null));
      });
      if (!s) await sleep(2);
    }
    const ms = await new Promise((resolve, reject) => {
      let buf = Buffer.alloc(0);
      const timer = setTimeout(() => reject(new Error('the agent did not answer HELLO within 120 s')), 120000);
      s.on('data', (d) => {
        buf = Buffer.concat([buf, d]);
        if (buf.length >= 12 && buf.length >= 12 + buf.readUInt32LE(0)) {
          clearTimeout(timer);
          const type = buf.readUInt8(4);
          if (type === 2) resolve(msSince(t));
          else reject(new Error(`the agent answered HELLO with frame type ${type}${type === 3 ? ` (ERROR: ${payloadText(buf)})` : ''}`));
        }
      });
      s.on('close', () => reject(new Error('the agent channel closed before HELLO_OK')));
      s.write(helloFrame());
    });
    s.destroy();
    return { ms, argv };
  } catch (e) {
    let tail = '';
    try {
      tail = fs.readFileSync(serial, 'utf8').trim().split('\n').slice(-3).join(' | ');
    } catch {}
    throw new Error(`${e.message}${tail ? `; serial: ${tail}` : ''}`);
  } finally {
    q.kill('SIGKILL');
    await new Promise((r) => (exited ? r() : q.on('exit', r)));
    untrack(q.pid);
    fs.rmSync(sock, { force: true });
  }
}

async function sectionStart() {
  const rows = [];
  const notes = [];
  log('bwrap --unshare-all ... true (baseline)');
  const bw = await cbench(['spawn', N.bwrap, ...BWRAP, 'true']);
  rows.push(bw.error ? notMeasured('bwrap --unshare-all --ro-bind / / --dev /dev --proc /proc --die-with-parent true', bw.error)
    : row('bwrap --unshare-all --ro-bind / / --dev /dev --proc /proc --die-with-parent true', nsToMs(bw.ns), { baselineRow: true }));
  doneLine('bwrap', rows[0].samples);

  // Bare QEMU cold boot.
  const img = findVmImages();
  const accel = vmInfo?.isolation === 'microvm/kvm' ? 'kvm' : 'tcg';
  const bareLabel = `bare QEMU cold boot to agent HELLO_OK (${accel}, no server)`;
  if (img.missing) {
    rows.push(notMeasured(bareLabel, `skipped: the vm images are not built yet: missing ${img.missing}`));
  } else {
    log(`bare QEMU cold boot (${accel})`);
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-bench-qemu.'));
    try {
      let argv;
      const samples = [];
      for (let i = 0; i < N.qemu; i++) {
        const r = await bareQemuBoot(img, accel, dir);
        samples.push(r.ms);
        argv = r.argv;
        log(`  bare QEMU: ${i + 1}/${N.qemu}: ${r.ms.toFixed(0)} ms`);
      }
      rows.push(row(bareLabel, samples, { argv }));
    } catch (e) {
      rows.push(notMeasured(bareLabel, `failed: ${firstLine(e.message)}`));
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  }

  // vm: pool hit, restore, cold.
  const vmRows = [
    ['vm open_session, pool hit', { ...BACKENDS.vm, IGN_MCP_POOL: POOL_SIZE }, { pauseMs: POOL_REFILL_MS }],
    ['vm open_session, restore (IGN_MCP_POOL=0)', { ...BACKENDS.vm, IGN_MCP_POOL: 0 }, {}],
  ];
  for (const [label, env, opts] of vmRows) {
    if (vmError) {
      rows.push(notMeasured(label, vmError));
      continue;
    }
    log(label);
    try {
      rows.push(openRow(label, await measureOpens(env, N.openVm, { ...opts, label })));
    } catch (e) {
      rows.push(notMeasured(label, firstLine(e.message)));
    }
  }
  const coldLabel = 'vm open_session, cold boot (no snapshot: IGN_MCP_BASE=none)';
  if (vmError) rows.push(notMeasured(coldLabel, vmError));
  else {
    log(coldLabel);
    try {
      rows.push(openRow(coldLabel, await measureOpens({ ...BACKENDS.vm, IGN_MCP_POOL: 0, IGN_MCP_BASE: 'none' }, N.cold, { label: 'vm cold' })));
    } catch (e) {
      rows.push(notMeasured(coldLabel, firstLine(e.message)));
    }
  }

  // ns, through MCP and below it.
  log('ns open_session (MCP, SDK)');
  rows.push(openRow('ns open_session (MCP, SDK client)', await measureOpens(BACKENDS.ns, N.open, { label: 'ns open' })));
  log('ns open without MCP (session layer in ign-bench)');
  const sl = await cbench(['agent', 'session', '--open', N.open], { env: serverEnv(BACKENDS.ns) });
  rows.push(sl.error ? notMeasured('ns session_open, no MCP (session layer)', sl.error)
    : row('ns session_open, no MCP (session layer)', nsToMs(sl.open.ns)));
  log('agent --serve-fd start + HELLO (no sandbox)');
  const fd = await cbench(['agent', 'fd', '--open', N.open], { env: serverEnv(BACKENDS.ns) });
  rows.push(fd.error ? notMeasured('ign-agent --serve-fd: spawn + HELLO, no sandbox', fd.error)
    : row('ign-agent --serve-fd: spawn + HELLO, no sandbox', nsToMs(fd.open.ns)));

  notes.push('Wall time of the open_session call as the client sees it; each session is closed (untimed) before the next open. 3 untimed warm-up opens per server.');
  notes.push(`Pool hit: IGN_MCP_POOL=${POOL_SIZE}, ${POOL_REFILL_MS} ms pause after each close for the pool to refill. Cold boot: IGN_MCP_BASE=none, so every session boots the guest from scratch.`);
  if (!img.missing) notes.push(`The bare QEMU boot uses the microvm flags of QEMU-FACTS.md and the guest command line of the server's cold boot, with build/vm/vmlinux, the initramfs and rootfs-tools.erofs, without the server's -sandbox and bind mounts; timed from spawn to the HELLO_OK frame on the virtio-serial socket.`);
  return { id: 'start', title: '1. Session start', unit: 'ms', baseline: rows[0].label, rows, notes };
}

// ---------------------------------------------------------------- 2. exec

/* The exec rows are measured in one interleaved loop: every iteration takes
 * one sample of every row (the host, the agent, the session layers, the MCP
 * servers), in an order that rotates, so that a noisy spell of the machine
 * (see the notes) lands on all rows alike, and the cost of each layer can be
 * read from differences taken within one iteration. */
async function sectionExec() {
  const n = N.exec;
  const CMDS = ['true', 'echo hello'];
  const samples = new Map(); // row label -> ms samples, index = iteration
  const failed = new Map(); // row label -> why
  const order = [];
  const layers = []; // {label, run(cmd) -> ms}
  const fail = (label, why) => {
    for (const c of CMDS) failed.set(`${label}: ${c}`, why);
  };
  const closers = [];
  try {
    // Host and agent rows: build/ign-bench processes that serve one command
    // per line (the time is taken in C, around the run alone).
    for (const [label, args] of [['host', []], ['host, posix_spawn', ['--posix-spawn']]]) {
      const host = cbenchServe(['spawn-serve', ...args]);
      closers.push(() => host.close());
      const rowOf = (c) => `${label}: sh -c '${c}'`;
      for (const c of CMDS) order.push(rowOf(c));
      layers.push({ label, rowOf, run: async (c) => (await host.run(c)) / 1e6 });
    }
    const cRows = [
      ['agent protocol, no sandbox', ['agent', 'fd', '--serve'], BACKENDS.ns],
      ['ns: session layer, no MCP', ['agent', 'session', '--serve'], BACKENDS.ns],
      ['vm: session layer, no MCP', ['agent', 'session', '--serve'], BACKENDS.vm],
    ];
    for (const [label, args, env] of cRows) {
      for (const c of CMDS) order.push(`${label}: ${c}`);
      if (label.startsWith('vm') && vmError) {
        fail(label, vmError);
        continue;
      }
      const srv = cbenchServe(args, { env: serverEnv(env) });
      closers.push(() => srv.close());
      layers.push({ label, run: async (c) => (await srv.run(c)) / 1e6 });
    }
    // MCP rows: servers and sessions that stay up for the whole loop.
    for (const backend of ['ns', 'vm']) {
      for (const [client, starter] of [['SDK client', startServer], ['raw JSON-RPC client', startRawServer]]) {
        const label = `${backend}: MCP run, ${client}`;
        for (const c of CMDS) order.push(`${label}: ${c}`);
        if (backend === 'vm' && vmError) {
          fail(label, vmError);
          continue;
        }
        try {
          const srv = await starter(BACKENDS[backend]);
          closers.push(() => srv.close());
          const { session_id } = await srv.tool('open_session', {});
          for (const c of CMDS) for (let i = 0; i < 20; i++) await srv.tool('run', { session_id, command: c });
          layers.push({
            label,
            run: async (c) => {
              const t = nowNs();
              const x = await srv.tool('run', { session_id, command: c });
              const ms = msSince(t);
              if (x.exit_code !== 0) throw new Error(`${c} exited ${x.exit_code}`);
              return ms;
            },
          });
        } catch (e) {
          fail(label, firstLine(e.message));
        }
      }
    }
    const rowOf = (l, c) => (l.rowOf ? l.rowOf(c) : `${l.label}: ${c}`);
    const live = () => layers.filter((l) => !failed.has(rowOf(l, CMDS[0])));
    const WARMUP = 3;
    for (let i = -WARMUP; i < n; i++) {
      if (i >= 0 && i % Math.max(1, Math.round(n / 5)) === 0) log(`iteration ${i + 1}/${n}: one sample of each row`);
      for (const c of CMDS) {
        const ls = live();
        for (let k = 0; k < ls.length; k++) {
          const l = ls[(k + Math.max(i, 0)) % ls.length];
          try {
            const ms = await l.run(c);
            if (i >= 0) samples.set(rowOf(l, c), (samples.get(rowOf(l, c)) || []).concat(ms));
          } catch (e) {
            const why = firstLine(e.message);
            for (const cc of CMDS) failed.set(rowOf(l, cc), why);
          }
        }
      }
    }
  } finally {
    for (const close of closers.reverse()) await close().catch(() => {});
  }
  const rows = order.map((l) => (failed.has(l) ? notMeasured(l, failed.get(l)) : row(l, samples.get(l) || [])));
  for (const r of rows) if (!r.notMeasured && r.label.endsWith(': true')) doneLine(r.label, r.samples);
  const notes = [
    `One live session per row; \`run\` returns only when the command has exited and its output is in. The rows are measured in one interleaved loop of ${n} iterations: each iteration takes one sample of every row, for \`true\` then \`echo hello\`, starting at a row that rotates; untimed warm-up calls first (3 iterations of the loop, and 20 calls per MCP server, where the Node client warms up too).`,
    '"host" is fork+execvp+waitpid of `sh -c CMD` from a C loop (build/ign-bench spawn-serve); "host, posix_spawn" the same with posix_spawnp (glibc: clone(CLONE_VM|CLONE_VFORK)), which is how the agent starts commands (clone(CLONE_VM), no page tables copied), and so the base the agent layer is measured from. "agent protocol, no sandbox" is `ign-agent --serve-fd 3` on a socketpair driven by the server\'s own protocol client (proto/client.c), no namespaces. "session layer, no MCP" is the server\'s session and backend code in-process (session_open, then a lease and agent_exec per call, as the run tool does), without JSON-RPC. The C rows are timed in C around the run alone (build/ign-bench ... --serve, one command per line). "MCP" is the real server over stdio, through the official SDK client or a hand-written JSON-RPC client.',
    'On a virtual machine whose host is shared, waking a thread on the other vCPU can wait for the host\'s scheduler tick: samples then come in steps of about 4 ms above the usual value. Medians are robust to it; p90 and p99 are not.',
  ];
  return { id: 'exec', title: '2. Exec round trip', unit: 'ms', baseline: "host: sh -c 'true'", rows, notes, layers: execLayers(rows) };
}

/* The cost each layer of the ns exec path adds to `true`, from paired
 * samples: the k-th sample of every row comes from the same iteration of the
 * loop, so a layer's cost is the median of the differences to the layer
 * below it within each iteration (and p25..p75 of them, the range). Where
 * that range holds 0 the layer's cost is within the noise: it is reported
 * as such, not as a (possibly negative) figure. */
function execLayers(rows) {
  const s = (l) => {
    const r = rows.find((x) => x.label === l);
    return r && !r.notMeasured && r.samples.length ? r.samples : null;
  };
  const q = (a, p) => {
    const b = [...a].sort((x, y) => x - y);
    return b[Math.floor(p * (b.length - 1))]; // the rows' median at p = 0.5
  };
  const steps = [
    ['host posix_spawn+exec of sh', null, "host, posix_spawn: sh -c 'true'"],
    ['agent + protocol (socketpair)', "host, posix_spawn: sh -c 'true'", 'agent protocol, no sandbox: true'],
    ['ns sandbox + session layer', 'agent protocol, no sandbox: true', 'ns: session layer, no MCP: true'],
    ['MCP server (JSON-RPC, tool, stdio) + raw client', 'ns: session layer, no MCP: true', 'ns: MCP run, raw JSON-RPC client: true'],
    ['official SDK client (Node)', 'ns: MCP run, raw JSON-RPC client: true', 'ns: MCP run, SDK client: true'],
  ];
  const out = [];
  for (const [what, from, to] of steps) {
    const t = s(to);
    const b = from ? s(from) : null;
    if (!t || (from && (!b || b.length !== t.length))) continue;
    const d = b ? t.map((x, i) => x - b[i]) : t;
    const median = q(d, 0.5);
    const lo = q(d, 0.25);
    const hi = q(d, 0.75);
    const noise = lo <= 0 && hi >= 0;
    out.push({ layer: what, ms: noise ? 0 : median, median, lo, hi, noise, n: d.length });
  }
  return out;
}

// ---------------------------------------------------------------- 3. files

const hostLabel = (f, op) => `${f.label} ${op}: host tmpfs (C write/read)`;

/* The official SDK's stdio transport refuses a message over 10 MiB
 * (STDIO_DEFAULT_MAX_BUFFER_SIZE), so through it read_file is called in
 * pieces of at most this many bytes. A read_file result carries the content
 * twice (as structuredContent and as its JSON text), so 2 MiB is about
 * 5.6 MB on the wire. */
const SDK_READ_PIECE = 2 * MiB;

/* write_file then read_file (in pieces of at most `piece` bytes) of each
 * size through MCP; returns {size: {write: [ns], read: [ns]}}. */
async function mcpFiles(starter, backend, piece) {
  const res = {};
  const srv = await starter(BACKENDS[backend]);
  try {
    const { session_id } = await srv.tool('open_session', {});
    for (const f of FILE_SIZES) {
      const data = crypto.randomBytes(f.size);
      const b64 = data.toString('base64');
      const p = `/tmp/bench-${f.size}`;
      const w = [];
      const r = [];
      for (let i = 0; i < f.n + 1; i++) {
        let t = nowNs();
        await srv.tool('write_file', { session_id, path: p, content_base64: b64 });
        const wms = msSince(t);
        t = nowNs();
        const got = [];
        for (let off = 0; off < f.size; ) {
          const x = await srv.tool('read_file', { session_id, path: p, offset: off, max_bytes: Math.min(piece, f.size - off) });
          if (!x.bytes) throw new Error(`read_file at offset ${off} of ${f.size} returned nothing`);
          got.push(x.content_base64);
          off += x.bytes;
        }
        const rms = msSince(t);
        if (i === 0 && Buffer.concat(got.map((g) => Buffer.from(g, 'base64'))).compare(data) !== 0) throw new Error('read_file returned other bytes than written');
        if (i > 0) {
          w.push(wms * 1e6);
          r.push(rms * 1e6);
        }
      }
      res[f.size] = { write: w, read: r };
      log(`  ${f.label}: write ${(f.size / 1e6 / (median(w) / 1e9)).toFixed(1)} MB/s, read ${(f.size / 1e6 / (median(r) / 1e9)).toFixed(1)} MB/s`);
    }
    await srv.tool('close', { session_id });
  } finally {
    await srv.close();
  }
  return res;
}

async function sectionFiles() {
  const rows = [];
  const spec = FILE_SIZES.map((f) => `${f.size}:${f.n}`).join(',');
  const add = (j, label, higher = true) => {
    for (const f of FILE_SIZES) {
      for (const op of ['write', 'read']) {
        const l = `${f.label} ${op}: ${label}`;
        if (j.error) rows.push(notMeasured(l, j.error, { group: f.label }));
        else rows.push(row(l, j.files[f.size][op].map((ns) => f.size / 1e6 / (ns / 1e9)), { higherIsBetter: higher, group: f.label, baseline: hostLabel(f, op) }));
      }
    }
  };
  log('host tmpfs write/read (baseline)');
  add(await cbench(['host-files', spec]), 'host tmpfs (C write/read)');
  log('agent protocol, no sandbox');
  add(await cbench(['agent', 'fd', '--files', spec], { env: serverEnv(BACKENDS.ns) }), 'agent protocol, no sandbox');
  for (const backend of ['ns', 'vm']) {
    if (backend === 'vm' && vmError) {
      add({ error: vmError }, 'vm: session layer, no MCP');
      add({ error: vmError }, 'vm: MCP, SDK client');
      add({ error: vmError }, 'vm: MCP, raw JSON-RPC client');
      continue;
    }
    log(`${backend}: session layer, no MCP`);
    add(await cbench(['agent', 'session', '--files', spec], { env: serverEnv(BACKENDS[backend]) }), `${backend}: session layer, no MCP`);
    for (const [client, starter, piece] of [['SDK client', startServer, SDK_READ_PIECE], ['raw JSON-RPC client', startRawServer, SDK_READ_PIECE]]) {
      const label = `${backend}: MCP, ${client}`;
      log(label);
      await mcpFiles(starter, backend, piece).then((res) => add({ files: res }, label), (e) => add({ error: firstLine(e.message) }, label));
    }
  }
  const notes = [
    'MB/s = 10^6 bytes per second of one whole write_file call, or of reading the whole file back with read_file. p90 and p99 are the slow tail: the MB/s of the p90 and p99 durations.',
    `read_file: both clients read in pieces of at most ${SDK_READ_PIECE / MiB} MiB (${(32 * MiB) / SDK_READ_PIECE} calls for 32 MiB), the server's cap per call: a read_file result carries the content twice (structuredContent and the same JSON as text), and the SDK's stdio transport drops the connection on any message over 10 MiB (its default maxBufferSize).`,
    'Through MCP the content travels as base64 inside JSON (4/3 of the bytes), which the SDK client encodes, the server decodes, and back. The sandbox side writes to /tmp, on the overlay\'s tmpfs (ns) or the guest\'s (vm); the host baseline writes to /dev/shm.',
    'Each row\'s ratio is to the host tmpfs row of the same size and operation.',
  ];
  return { id: 'files', title: '3. Files', unit: 'MB/s', higherIsBetter: true, rows, notes, grouped: true };
}

// ---------------------------------------------------------------- 4. throughput

async function sectionThroughput() {
  const rows = [];
  const levels = [1, 2, 4, 8];
  for (const p of levels) {
    log(`host: ${p} × ${RUNS_PER_SESSION} sh -c true at once (baseline)`);
    const rps = [];
    let lat = [];
    for (let rep = 0; rep < N.tputReps; rep++) {
      const j = await cbench(['spawn-par', p, RUNS_PER_SESSION, 'sh', '-c', 'true']);
      if (j.error) throw new Error(j.error);
      rps.push(j.runs / (j.wall_ns / 1e9));
      lat = lat.concat(nsToMs(j.ns));
    }
    rows.push(row(`${p} at once: host sh -c true`, rps, { higherIsBetter: true, group: `${p}`, latency: lat, baseline: `${p} at once: host sh -c true` }));
  }
  for (const backend of ['ns', 'vm']) {
    const label = (p) => `${p} at once: ${backend} sessions, MCP run('true')`;
    if (backend === 'vm' && vmError) {
      for (const p of levels) rows.push(notMeasured(label(p), vmError, { group: `${p}` }));
      continue;
    }
    log(`${backend}: 1, 2, 4, 8 sessions × ${RUNS_PER_SESSION} run('true')`);
    await withServer(BACKENDS[backend], async (srv) => {
      const ids = [];
      try {
        for (const p of levels) {
          while (ids.length < p) ids.push((await srv.open()).session_id);
          for (const id of ids) for (let i = 0; i < 3; i++) await srv.run(id, 'true');
          const rps = [];
          let lat = [];
          for (let rep = 0; rep < N.tputReps; rep++) {
            const t = nowNs();
            const per = await Promise.all(
              ids.slice(0, p).map(async (id) => {
                const l = [];
                for (let i = 0; i < RUNS_PER_SESSION; i++) {
                  const t1 = nowNs();
                  await srv.run(id, 'true');
                  l.push(msSince(t1));
                }
                return l;
              }),
            );
            const wall = msSince(t);
            rps.push((p * RUNS_PER_SESSION) / (wall / 1000));
            lat = lat.concat(per.flat());
          }
          rows.push(row(label(p), rps, { higherIsBetter: true, group: `${p}`, latency: lat, baseline: `${p} at once: host sh -c true` }));
          log(`  ${p} sessions: ${median(rps).toFixed(0)} runs/s`);
        }
      } finally {
        for (const id of ids) await srv.tool('close', { session_id: id }).catch(() => {});
      }
    }).catch((e) => {
      for (const p of levels) if (!rows.some((r) => r.label === label(p))) rows.push(notMeasured(label(p), firstLine(e.message), { group: `${p}` }));
    });
  }
  const notes = [
    `P sessions (one MCP client, one server), each doing ${RUNS_PER_SESSION} run('true') in a row, all P at once; runs/s = P×${RUNS_PER_SESSION} / wall time. One sample per repetition (${N.tputReps} repetitions); p90/p99 are the slow tail of those. The latency column is over every single run.`,
    `Baseline: P host processes at once, each running \`sh -c true\` ${RUNS_PER_SESSION} times (fork+exec+wait from C). The machine has ${os.cpus().length} cores.`,
  ];
  return { id: 'throughput', title: '4. Throughput under concurrency', unit: 'runs/s', higherIsBetter: true, rows, notes, grouped: true };
}

// ---------------------------------------------------------------- 5. memory

async function settle() {
  await sleep(1500);
}

/* PSS (MiB) per sandbox for 1, 4 and 8 idle bwrap sandboxes running sleep. */
async function bwrapMemory(levels) {
  const kids = [];
  const out = {};
  try {
    for (const n of levels) {
      while (kids.length < n) {
        const c = spawn(BWRAP[0], [...BWRAP.slice(1), 'sleep', '100000'], { stdio: 'ignore' });
        track(c.pid, 'bwrap sleep');
        kids.push(c);
      }
      await settle();
      out[n] = kids.slice(0, n).map((c) => [c.pid, ...descendants(c.pid).map((d) => d.pid)].reduce((a, p) => a + pssKiB(p), 0) / 1024);
    }
  } finally {
    for (const c of kids) {
      killTree(c.pid);
      untrack(c.pid);
    }
  }
  return out;
}

async function sectionMemory() {
  const rows = [];
  const levels = [1, 4, 8];
  log('baseline: idle bwrap sandboxes (bwrap --unshare-all ... sleep)');
  const bw = await bwrapMemory(levels);
  for (const n of levels) rows.push(row(`${n} idle: bwrap sandbox running sleep`, bw[n], { group: `${n}`, unit: 'MiB', baseline: `${n} idle: bwrap sandbox running sleep` }));
  for (const backend of ['ns', 'vm']) {
    const label = (n) => `${n} idle: ${backend} sessions`;
    if (backend === 'vm' && vmError) {
      for (const n of levels) rows.push(notMeasured(label(n), vmError, { group: `${n}` }));
      continue;
    }
    log(`${backend}: PSS of 1, 4, 8 idle sessions`);
    // vm without a pool, so the processes that appear with an open are that session's.
    const env = backend === 'vm' ? { ...BACKENDS.vm, IGN_MCP_POOL: 0 } : BACKENDS[backend];
    await withServer(env, async (srv) => {
      await settle();
      const base = new Set(descendants(srv.pid).map((d) => d.pid));
      const server0 = pssKiB(srv.pid);
      const sessions = []; // {id, pids}
      try {
        for (const n of levels) {
          while (sessions.length < n) {
            const before = new Set(descendants(srv.pid).map((d) => d.pid));
            const s = await srv.open();
            await srv.run(s.session_id, 'true');
            const pids = descendants(srv.pid).map((d) => d.pid).filter((p) => !before.has(p) && !base.has(p));
            sessions.push({ id: s.session_id, pids });
          }
          await settle();
          const per = sessions.map((s) => {
            const live = [...new Set([...s.pids, ...s.pids.flatMap((p) => descendants(p).map((d) => d.pid))])];
            return { pss: live.reduce((a, p) => a + pssKiB(p), 0) / 1024, cg: cgroupChargeKiB(s.pids[0]), procs: live.length };
          });
          const serverDelta = (pssKiB(srv.pid) - server0) / 1024 / n;
          const cgs = per.map((x) => x.cg).filter((x) => x != null);
          const extra = [
            `processes per session: ${median(per.map((x) => x.procs))}`,
            `server process +${serverDelta.toFixed(1)} MiB/session`,
            cgs.length ? `cgroup charge median ${(median(cgs) / 1024).toFixed(1)} MiB` : '',
          ].filter(Boolean).join('; ');
          rows.push(row(label(n), per.map((x) => x.pss), { group: `${n}`, unit: 'MiB', extra, baseline: `${n} idle: bwrap sandbox running sleep`, server_delta_mib: serverDelta, cgroup_kib: cgs }));
          log(`  ${n} sessions: median ${median(per.map((x) => x.pss)).toFixed(1)} MiB PSS per session`);
        }
      } finally {
        for (const s of sessions) await srv.tool('close', { session_id: s.id }).catch(() => {});
      }
    }).catch((e) => {
      for (const n of levels) if (!rows.some((r) => r.label === label(n))) rows.push(notMeasured(label(n), firstLine(e.message), { group: `${n}` }));
    });
  }
  const notes = [
    'PSS (from /proc/PID/smaps_rollup) summed over the processes a session owns, 1.5 s after the last open, each session having run one `true`: for ns the sandbox\'s processes (its ign-agent, PID 1 of the sandbox, and anything under it), for vm its QEMU (opened with IGN_MCP_POOL=0, so that the processes that appear with an open are that session\'s). One sample per session. PSS divides shared pages among their users, so it falls as sessions share more.',
    'The server process\'s own growth and, where the sandbox has a memory cgroup of its own, the cgroup\'s charge (which also counts the tmpfs of its overlay and kernel memory) are in the notes.',
  ];
  return { id: 'memory', title: '5. Memory per idle session', unit: 'MiB', rows, notes, grouped: true };
}

// ---------------------------------------------------------------- 6. workload

const HELLO_C = '#include <stdio.h>\nint main(void) { puts("hello"); return 0; }\n';
const WORKLOADS = [
  { key: 'python', label: "python3 -c 'print(1)'", cmd: "python3 -c 'print(1)'", host: ['/usr/bin/python3', '-c', 'print(1)'], n: () => N.py },
  { key: 'gcc', label: 'gcc -o hello hello.c', cmd: 'gcc -o /tmp/hello /tmp/hello.c', host: null, n: () => N.gcc },
];

async function sectionWorkload() {
  const rows = [];
  const dir = fs.mkdtempSync('/dev/shm/ign-bench-work.');
  fs.writeFileSync(path.join(dir, 'hello.c'), HELLO_C);
  try {
    for (const w of WORKLOADS) {
      const argv = w.host ?? ['gcc', '-o', path.join(dir, 'hello'), path.join(dir, 'hello.c')];
      log(`host: ${w.label} (baseline)`);
      const j = await cbench(['spawn', w.n(), ...argv]);
      rows.push(j.error ? notMeasured(`${w.label}: host`, j.error, { group: w.label }) : row(`${w.label}: host`, nsToMs(j.ns), { group: w.label, baseline: `${w.label}: host` }));
    }
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
  for (const backend of ['ns', 'vm']) {
    if (backend === 'vm' && vmError) {
      for (const w of WORKLOADS) rows.push(notMeasured(`${w.label}: vm session (MCP run)`, vmError, { group: w.label }));
      continue;
    }
    log(`${backend}: python3 and gcc in the tools rootfs`);
    await withServer({ ...BACKENDS[backend], IGN_MCP_ROOTFS: 'tools' }, (srv) =>
      withSession(srv, async (sid) => {
        await srv.tool('write_file', { session_id: sid, path: '/tmp/hello.c', content_base64: Buffer.from(HELLO_C).toString('base64') });
        for (const w of WORKLOADS) {
          const samples = await timeN(w.n(), async () => {
            const r = await srv.run(sid, w.cmd);
            if (w.key === 'python' && r.stdout !== '1\n') throw new Error(`python3 printed ${JSON.stringify(r.stdout)}`);
          }, { warmup: 2, label: `${backend} ${w.label}` });
          rows.push(row(`${w.label}: ${backend} session (MCP run)`, samples, { group: w.label, baseline: `${w.label}: host` }));
          doneLine(w.label, samples);
        }
        const r = await srv.run(sid, '/tmp/hello');
        if (r.stdout !== 'hello\n') throw new Error(`the compiled hello printed ${JSON.stringify(r.stdout)}`);
      }),
    ).catch((e) => {
      for (const w of WORKLOADS) {
        const l = `${w.label}: ${backend} session (MCP run)`;
        if (!rows.some((x) => x.label === l)) rows.push(notMeasured(l, firstLine(e.message), { group: w.label }));
      }
    });
  }
  const notes = [
    'In the tools rootfs (IGN_MCP_ROOTFS=tools, Debian bookworm: python3.11, gcc 12), through MCP with the SDK client; hello.c is written once with write_file. 2 untimed warm-up runs.',
    'Host baseline: the same commands run from a C loop (fork+exec+wait) with the host\'s /usr/bin/python3 and gcc, in a /dev/shm directory.',
  ];
  return { id: 'workload', title: '6. A real workload', unit: 'ms', rows, notes, grouped: true };
}

// ---------------------------------------------------------------- 7. peer

const SRT_DIR = path.join(REPO, 'bench/node_modules/@anthropic-ai/sandbox-runtime');

async function sectionPeer() {
  const rows = [];
  const notes = [];
  const shLabel = 'host: sh -c true via Node child_process.spawn';
  const bwLabel = 'bare bwrap --unshare-all ... true via Node child_process.spawn';
  const srtLib = "srt (sandbox-runtime library): wrapWithSandbox('true') + spawn";
  const srtCli = 'srt CLI: `srt true` (a Node process per command)';
  const scratch = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-bench-srt.'));
  try {
    log('baselines and srt library (peer-srt.mjs)');
    const r = await runChild(process.execPath, [path.join(REPO, 'bench/peer-srt.mjs'), N.srt], { cwd: scratch });
    let j;
    try {
      j = JSON.parse(r.stdout.trim().split('\n').pop());
    } catch {
      throw new Error(`peer-srt.mjs failed (exit ${r.code}): ${firstLine(r.stderr)}`);
    }
    rows.push(row(shLabel, j.sh_ms), row(bwLabel, j.bwrap_ms));
    if (j.srt_error) {
      rows.push(notMeasured(srtLib, j.srt_error), notMeasured(srtCli, j.srt_error));
    } else {
      rows.push(row(srtLib, j.srt_ms, { extra: `v${j.version}; wrapWithSandbox alone ${j.wrap_only_ms.toFixed(1)} ms`, wrapped_example: j.wrapped_example }));
      doneLine('srt library', j.srt_ms);
      log('srt CLI: `srt true`');
      const c = await timeN(N.srtCli, async () => {
        const x = await runChild(process.execPath, [path.join(SRT_DIR, 'dist/cli.js'), 'true'], { cwd: scratch });
        if (x.code !== 0) throw new Error(`srt true exited ${x.code}: ${firstLine(x.stderr)}`);
      }, { warmup: 1 });
      rows.push(row(srtCli, c, { extra: `v${j.version}` }));
      doneLine('srt CLI', c);
    }
  } catch (e) {
    for (const l of [shLabel, bwLabel, srtLib, srtCli]) if (!rows.some((x) => x.label === l)) rows.push(notMeasured(l, firstLine(e.message)));
  } finally {
    fs.rmSync(scratch, { recursive: true, force: true });
  }

  log("ours: run('true') in a live ns session (MCP, SDK)");
  await withServer(BACKENDS.ns, (srv) =>
    withSession(srv, async (sid) => {
      const s = await timeN(N.peerOurs, () => srv.run(sid, 'true'));
      rows.push(row("ignition-mcp ns: run('true') through MCP (SDK client), live session", s));
      doneLine('ours', s);
    }),
  );
  if (vmError) rows.push(notMeasured("ignition-mcp vm: run('true') through MCP (SDK client), live session", vmError));
  else {
    await withServer(BACKENDS.vm, (srv) =>
      withSession(srv, async (sid) => {
        const s = await timeN(N.peerOurs, () => srv.run(sid, 'true'));
        rows.push(row("ignition-mcp vm: run('true') through MCP (SDK client), live session", s));
      }),
    ).catch((e) => rows.push(notMeasured("ignition-mcp vm: run('true') through MCP (SDK client), live session", firstLine(e.message))));
  }
  notes.push('srt is Anthropic\'s sandbox runtime (npm @anthropic-ai/sandbox-runtime, installed in bench/node_modules from bench/package-lock.json), built on bubblewrap. Per command it wraps the command (a bwrap command line with its network proxy bridges: socat inside the sandbox, its HTTP/SOCKS proxies on the host) and spawns it through a shell; its library is initialised once (the proxies start then), with the configuration its CLI uses when there is no settings file (no network, no writes). It runs each command in a fresh sandbox; ignition-mcp runs it in a long-lived one, so this compares the cost per command an agent pays, not equal isolation.');
  notes.push('Baseline: `sh -c true` spawned the same way as srt spawns (Node child_process.spawn), from the same small Node process (bench/peer-srt.mjs) as the srt library rows; the srt CLI rows start `node cli.js true` per command from the harness.');
  return { id: 'peer', title: '7. Peer: Anthropic sandbox runtime', unit: 'ms', baseline: rows[0].label, rows, notes };
}

// ---------------------------------------------------------------- 8. stages and forks

/* The allocated bytes of a file (its blocks, not its apparent size). */
function allocatedBytes(file) {
  return fs.statSync(file).blocks * 512;
}

/* The RAM file of the warm base in STORE (the vm backend's
 * <store>/<rootfs>-base-<16 hex>/ram), or null. */
function baseRamFile(store) {
  for (const n of fs.readdirSync(store)) {
    const f = path.join(store, n, 'ram');
    if (/-base-[0-9a-f]{16}$/.test(n) && fs.existsSync(f)) return f;
  }
  return null;
}

const PAUSE_TARGET = 'target: ≤ 10 ms at the median, ≤ 50 ms at p99';

/* N forks of session SID (after one untimed), each timed from the fork call
 * to the answer of run('true') in the fork, which is then closed. */
async function forkRuns(srv, sid, n) {
  const forks = [];
  const pauses = [];
  const forkMs = [];
  for (let i = 0; i < n + 1; i++) {
    const t = nowNs();
    const f = await srv.tool('fork', { session_id: sid, count: 1 });
    await srv.run(f.sessions[0].session_id, 'true');
    const ms = msSince(t);
    await srv.tool('close', { session_id: f.sessions[0].session_id });
    if (i === 0) continue; // one untimed warm-up
    forks.push(ms);
    pauses.push(f.paused_ms);
    forkMs.push(f.fork_ms);
  }
  return { forks, pauses, forkMs };
}

/* A vm session whose guest dirties memory all the time (8 MiB of
 * /dev/urandom written over one file again and again, in the background):
 * commits and forks of it, the source's pause and the fork's first run. */
async function busyRows(srv, n, L, g) {
  const rows = [];
  const src = await srv.open();
  try {
    await srv.run(src.session_id, "nohup sh -c 'while :; do head -c 8M /dev/urandom > /tmp/w; done' >/dev/null 2>&1 &");
    log('vm: commit of a busy session');
    const commits = [];
    const wall = await timeN(n, async (i) => {
      commits.push(await srv.tool('commit', { session_id: src.session_id, name: 'bench/busy', replace: i > 0 }));
    }, { warmup: 1, label: L.busyCommit });
    rows.push(row(L.busyCommit, wall, { group: g, baseline: L.base, extra: 'target under TCG: ≤ 500 ms' }));
    rows.push(row(L.busyCommitPause, commits.slice(1).map((c) => c.paused_ms), { group: g, extra: PAUSE_TARGET }));
    doneLine(L.busyCommit, wall);
    log('vm: fork of a busy session to the first run in the fork');
    const { forks, pauses } = await forkRuns(srv, src.session_id, n);
    rows.push(row(L.busyFork, forks, { group: g, baseline: L.base, extra: 'target under TCG: ≤ 300 ms' }));
    rows.push(row(L.busyForkPause, pauses, { group: g, extra: PAUSE_TARGET }));
    doneLine(L.busyFork, forks);
    await srv.tool('stage_rm', { name: 'bench/busy' });
  } finally {
    await srv.tool('close', { session_id: src.session_id }).catch(() => {});
  }
  return rows;
}

/* The rows of one backend: base restore (the baseline) against
 * open_session(stage), fork to the first run answering in the fork, commit
 * of an idle session, and the sizes. Every server of the backend uses one
 * store of the section's own, so that its base and stages are measured
 * together and nothing is left in the user's store. */
async function stageRows(backend, n) {
  const g = backend === 'vm' ? 'vm (QEMU microVMs, IGN_MCP_POOL=0)' : 'ns (namespaces)';
  const L = {
    base: backend === 'vm' ? 'vm: open_session, base restore' : 'ns: open_session from the base',
    stage: `${backend}: open_session(stage)`,
    fork: `${backend}: fork(count 1) to the first run('true') answering in the fork`,
    forkPause: `${backend}: fork: the source paused (paused_ms)`,
    commit: `${backend}: commit of an idle session (wall)`,
    commitMs: `${backend}: commit of an idle session (commit_ms, server)`,
    commitPause: `${backend}: commit: the source paused (paused_ms)`,
    baseBytes: `${backend}: warm base RAM file, allocated (MiB)`,
    stageBytes: `${backend}: stage of an idle session, allocated (MiB)`,
    ...(backend === 'vm' ? {
      busyCommit: 'vm: commit of a busy session (wall)',
      busyCommitPause: 'vm: commit of a busy session: the source paused (paused_ms)',
      busyFork: 'vm: fork(count 1) of a busy session to the first run(\'true\') in the fork',
      busyForkPause: 'vm: fork of a busy session: the source paused (paused_ms)',
    } : {}),
  };
  const rows = [];
  const all = Object.values(L).filter((l) => backend === 'vm' || l !== L.baseBytes);
  const store = fs.mkdtempSync(path.join(os.tmpdir(), `ign-bench-stages-${backend}.`));
  fs.chmodSync(store, 0o755); // as root the QEMUs run as other uids
  const env = { ...BACKENDS[backend], IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0, IGN_MCP_STORE: store };
  try {
    await withServer(env, async (srv) => {
      const src = await srv.open(); // the base is made here on vm
      await srv.run(src.session_id, 'true');

      log(`${backend}: open_session from the base (baseline)`);
      const base = await timeN(n, async () => {
        const s = await srv.open();
        await srv.tool('close', { session_id: s.session_id });
      }, { warmup: 2, label: L.base });
      rows.push(row(L.base, base, { group: g, baseline: L.base }));
      doneLine(L.base, base);

      log(`${backend}: commit of an idle session`);
      const commits = [];
      const wall = await timeN(n, async (i) => {
        commits.push(await srv.tool('commit', { session_id: src.session_id, name: 'bench/idle', replace: i > 0 }));
      }, { warmup: 1, label: L.commit });
      const kept = commits.slice(1);
      rows.push(row(L.commit, wall, { group: g, baseline: L.base, extra: backend === 'vm' ? 'target under TCG: ≤ 500 ms for an idle 256 MiB guest' : '' }));
      rows.push(row(L.commitMs, kept.map((c) => c.commit_ms), { group: g, baseline: L.base }));
      rows.push(row(L.commitPause, kept.map((c) => c.paused_ms), { group: g, extra: backend === 'vm' ? PAUSE_TARGET : '' }));
      doneLine(L.commit, wall);

      const bytes = kept.map((c) => c.bytes / MiB);
      const ram = backend === 'vm' ? baseRamFile(store) : null;
      if (ram) rows.push(row(L.baseBytes, [allocatedBytes(ram) / MiB], { group: g, unit: 'MiB', baseline: L.baseBytes, extra: `${path.relative(store, ram)}, ${(fs.statSync(ram).size / MiB).toFixed(0)} MiB apparent` }));
      rows.push(row(L.stageBytes, bytes, { group: g, unit: 'MiB', baseline: ram ? L.baseBytes : undefined, extra: ram ? 'target: ≤ 1.1× the base' : 'the layer of an idle session: what it wrote' }));

      log(`${backend}: open_session(stage)`);
      const fromStage = await timeN(n, async () => {
        const s = await srv.tool('open_session', { stage: 'bench/idle' });
        await srv.tool('close', { session_id: s.session_id });
      }, { warmup: 2, label: L.stage });
      rows.push(row(L.stage, fromStage, { group: g, baseline: L.base, extra: backend === 'vm' ? 'target: ≤ 1.2× a base restore' : '' }));
      doneLine(L.stage, fromStage);

      log(`${backend}: fork to the first run in the fork`);
      const { forks, pauses, forkMs } = await forkRuns(srv, src.session_id, n);
      rows.push(row(L.fork, forks, { group: g, baseline: L.base, extra: `${backend === 'vm' ? 'target under TCG: ≤ 300 ms; ' : ''}the server's fork_ms median ${median(forkMs)}` }));
      rows.push(row(L.forkPause, pauses, { group: g, extra: backend === 'vm' ? PAUSE_TARGET : '' }));
      doneLine(L.fork, forks);
      await srv.tool('stage_rm', { name: 'bench/idle' });
      if (backend === 'vm') rows.push(...(await busyRows(srv, n, L, g)));
    });
  } catch (e) {
    for (const l of all) if (!rows.some((r) => r.label === l)) rows.push(notMeasured(l, firstLine(e.message), { group: g }));
  } finally {
    fs.rmSync(store, { recursive: true, force: true });
  }
  return rows;
}

async function sectionStages() {
  const rows = [];
  for (const backend of ['vm', 'ns']) {
    if (backend === 'vm' && vmError) {
      rows.push(notMeasured('vm: stages and forks', vmError, { group: 'vm (QEMU microVMs, IGN_MCP_POOL=0)' }));
      continue;
    }
    rows.push(...(await stageRows(backend, backend === 'vm' ? N.stageVm : N.stage)));
  }
  const notes = [
    'Every row of a backend comes from one server with a store of the section\'s own (made fresh, removed after), IGN_MCP_POOL=0 and IGN_MCP_SPARES=0, so that the base restore (the baseline) and the stage rows take the same path: a new QEMU restored from a RAM file and a device state (vm), a new namespace sandbox (ns).',
    'open_session rows: wall time of the call, each session closed (untimed) before the next. fork: wall time from the fork call to the answer of run(\'true\') in the new session; its close is not timed. The source session is idle (it ran `true` once); in the "busy" rows (vm) it rewrites 8 MiB of /dev/urandom over one file in a loop the whole time.',
    'commit: the same idle session committed again and again under one name (replace: true); wall time of the call as the client sees it, and the commit_ms and paused_ms the server reported. paused_ms is how long the source was stopped, as the backend reports it (vm: from stopping its QEMU to continuing it; ns: how long its cgroup was frozen while its files were copied); the pause rows have no baseline.',
    'Sizes: the bytes the commit reported (allocated blocks of the stage\'s files), against the blocks allocated to the warm base\'s RAM file in the same store (du, not the apparent 256 MiB).',
  ];
  return { id: 'stages', title: '8. Stages and forks', unit: 'ms', rows, notes, grouped: true };
}

/* A tree of FILES files holding BYTES in all, in DIR (nested 50 per
 * directory), from a fixed seed. */
function makeTree(dir, files, bytes) {
  const per = Math.floor(bytes / files);
  const buf = crypto.randomBytes(per);
  for (let i = 0; i < files; i++) {
    const sub = path.join(dir, `d${Math.floor(i / 50)}`);
    if (i % 50 === 0) fs.mkdirSync(sub, { recursive: true });
    buf[0] = i & 0xff;
    fs.writeFileSync(path.join(sub, `f${i}.bin`), buf);
  }
}

async function sectionOneShot() {
  const rows = [];
  const base = fs.mkdtempSync(path.join(os.tmpdir(), 'bench-oneshot-'));
  fs.chmodSync(base, 0o755);
  const root = path.join(base, 'root');
  fs.mkdirSync(root);
  const TREE_FILES = 5000;
  const TREE_BYTES = 50 * 1000 * 1000;
  try {
    log(`making a tree of ${TREE_FILES} files, ${TREE_BYTES / 1e6} MB`);
    makeTree(path.join(root, 'tree'), TREE_FILES, TREE_BYTES);
    const treeBytes = TREE_FILES * Math.floor(TREE_BYTES / TREE_FILES);
    const nTar = QUICK ? 3 : 8;
    log('host: tar -C src -cf - . | tar -C dst -xf - (baseline)');
    const tarMBs = [];
    for (let i = 0; i < nTar + 1; i++) {
      const dst = path.join(base, `tar-dst-${i}`);
      fs.mkdirSync(dst);
      const t = nowNs();
      const r = spawnSync('sh', ['-c', `tar -C "${path.join(root, 'tree')}" -cf - . | tar -C "${dst}" -xf -`]);
      const ms = msSince(t);
      if (r.status !== 0) throw new Error(`tar | tar failed: ${r.stderr}`);
      if (i > 0) tarMBs.push(treeBytes / 1e6 / (ms / 1000));
      fs.rmSync(dst, { recursive: true, force: true });
    }
    const tarLabel = `host: tar | tar, ${TREE_FILES} files, 50 MB`;
    rows.push(row(tarLabel, tarMBs, { group: 'copy_in of a tree', unit: 'MB/s', higherIsBetter: true, baselineRow: true, baseline: tarLabel }));
    doneLine(tarLabel, tarMBs, 'MB/s');

    for (const backend of ['ns', 'vm']) {
      const g = `${backend}: one-shot and copies`;
      const threeLabel = `${backend}: open_session + run('true') + close, three calls`;
      const oneLabel = `${backend}: sandbox_run('true')`;
      const copyLabel = `${backend}: copy_in, ${TREE_FILES} files, 50 MB`;
      if (backend === 'vm' && vmError) {
        for (const l of [threeLabel, oneLabel, copyLabel]) rows.push(notMeasured(l, vmError, { group: g }));
        continue;
      }
      const env = { ...BACKENDS[backend], IGN_MCP_HOST_IO_ROOT: root, IGN_MCP_LOG_DIR: path.join(base, 'logs') };
      const n = backend === 'vm' ? (QUICK ? 8 : 30) : (QUICK ? 20 : 100);
      const pause = backend === 'vm' ? POOL_REFILL_MS : 0;
      await withServer(env, async (srv) => {
        log(`${backend}: ${n} × open_session + run + close, and ${n} × sandbox_run, interleaved`);
        const three = [], one = [], serverTotal = [], paths = [];
        for (let i = 0; i < n + 2; i++) {
          if (pause) await sleep(pause);
          let t = nowNs();
          const s = await srv.open();
          await srv.run(s.session_id, 'true');
          await srv.tool('close', { session_id: s.session_id });
          const a = msSince(t);
          if (pause) await sleep(pause);
          t = nowNs();
          const r = await srv.tool('sandbox_run', { command: 'true' });
          const b = msSince(t);
          if (r.exit_code !== 0) throw new Error(`sandbox_run true exited ${r.exit_code}`);
          if (i >= 2) {
            three.push(a);
            one.push(b);
            serverTotal.push(r.total_ms);
            paths.push(r.path);
          }
        }
        rows.push(row(threeLabel, three, { group: g, baseline: threeLabel, baselineRow: true }));
        rows.push(row(oneLabel, one, { group: g, baseline: threeLabel, extra: `server total_ms median ${median(serverTotal)}; ${countPaths(paths)}` }));
        doneLine(threeLabel, three);
        doneLine(oneLabel, one);

        const s = await srv.open();
        try {
          const nc = backend === 'vm' ? (QUICK ? 2 : 4) : (QUICK ? 3 : 8);
          const mbs = [];
          for (let i = 0; i < nc + 1; i++) {
            const t = nowNs();
            const r = await srv.tool('copy_in', { session_id: s.session_id, host_path: 'tree', guest_path: '/tmp/tree' });
            const ms = msSince(t);
            if (r.copied.files !== TREE_FILES) throw new Error(`copy_in copied ${r.copied.files} files`);
            if (i > 0) mbs.push(r.copied.bytes / 1e6 / (ms / 1000));
          }
          rows.push(row(copyLabel, mbs, { group: 'copy_in of a tree', unit: 'MB/s', higherIsBetter: true, baseline: tarLabel }));
          doneLine(copyLabel, mbs, 'MB/s');
        } finally {
          await srv.tool('close', { session_id: s.session_id }).catch(() => {});
        }
      });
    }
  } finally {
    fs.rmSync(base, { recursive: true, force: true });
  }
  const notes = [
    "sandbox_run('true'): wall time of the call as the SDK client sees it, against open_session, run('true') and close done as three calls by the same client on the same server, interleaved one for one. vm: both with the pool (IGN_MCP_POOL=2), each sample after an untimed pause for the pool to refill, so both take a pool clone.",
    `copy_in: a tree of ${TREE_FILES} files of 10 kB in 100 directories (50 MB of content), copied into a live session's /tmp (the overlay's tmpfs on ns, the guest's on vm) again and again (the destination is replaced whole each time); MB/s of content per whole call. The baseline is \`tar -C src -cf - . | tar -C dst -xf -\` on the host, from the same tree to a fresh directory of the same filesystem.`,
  ];
  return { id: 'oneshot', title: '9. One-shot runs and tree copies', unit: 'ms', rows, notes, grouped: true };
}

// ---------------------------------------------------------------- 10. HTTP

/* The Streamable HTTP transport against stdio, on ns, with raw clients on
 * both sides sending the same 2026-07-28 requests (the _meta envelope; over
 * HTTP also its standard headers), so that the difference is the transport:
 *  - run('true') latency on one live session, one keep-alive connection;
 *  - 32 clients at once against 8 sessions (4 clients per session): over
 *    HTTP 32 keep-alive connections, over stdio 32 callers multiplexed on
 *    the one pipe a stdio server has;
 *  - the server's RSS added per idle keep-alive connection (100 of them). */
async function sectionHttp() {
  const rows = [];
  const notes = [];
  const rounds = QUICK ? 3 : 5;
  const per = Math.ceil(N.http / rounds);
  const CLIENTS = 32;
  const SESSIONS = 8;
  const RUNS = QUICK ? 25 : 50;
  const IDLE = 100;
  const g1 = 'latency, one client';
  const g2 = `${CLIENTS} clients at once, ${SESSIONS} sessions`;
  const g3 = `memory per idle keep-alive connection (${IDLE} connections)`;
  const stdioLabel = "ns: run('true'), stdio, raw client";
  const httpLabel = "ns: run('true'), HTTP keep-alive, raw client";
  const listStdio = "list_sessions, stdio, raw client";
  const listHttp = "list_sessions, HTTP keep-alive, raw client";
  const discStdio = 'server/discover, stdio, raw client';
  const discHttp = 'server/discover, HTTP keep-alive, raw client';
  const tStdio = `${CLIENTS} clients × ${SESSIONS} sessions: stdio (one pipe)`;
  const tHttp = `${CLIENTS} clients × ${SESSIONS} sessions: HTTP (${CLIENTS} keep-alive connections)`;
  const memBase = 'HTTP server RSS with no connection';
  const memPer = 'RSS added per idle keep-alive connection';
  /* info: the HTTP server says where it listens at that level; the stdio
   * server logs at the same level, so both pay the same for logging. */
  const common = { ...BACKENDS.ns, IGN_MCP_LOG: 'info', IGN_MCP_MAX_CALLS: 256 };
  const env = { ...common, IGN_MCP_HTTP_MAX_CONNECTIONS: 4 * IDLE, IGN_MCP_HTTP_TIMEOUT_SECS: 600 };
  let stdio = null;
  let web = null;
  const clients = [];
  try {
    stdio = await startRawServer(common);
    web = await startHttpServer(env);
    const st = async (name, args = {}) => {
      const r = await stdio.request('tools/call', { name, arguments: args, _meta: MODERN_META });
      if (r.isError) throw new Error(textOf(r));
      return r.structuredContent;
    };
    const one = httpClient(web.port);
    clients.push(one);

    // 1. Latency, interleaved rounds on one live session each.
    const sS = (await st('open_session')).session_id;
    const sH = (await one.tool('open_session')).session_id;
    const runS = async () => {
      const x = await st('run', { session_id: sS, command: 'true' });
      if (x.exit_code !== 0) throw new Error(`true exited ${x.exit_code}`);
    };
    const runH = async () => {
      const x = await one.tool('run', { session_id: sH, command: 'true' });
      if (x.exit_code !== 0) throw new Error(`true exited ${x.exit_code}`);
    };
    for (let i = 0; i < 50; i++) {
      await runS();
      await runH();
    }
    const discS = () => stdio.request('server/discover', { _meta: MODERN_META });
    const discH = () => one.request('server/discover');
    for (let i = 0; i < 50; i++) {
      await discS();
      await discH();
    }
    const listS = () => st('list_sessions');
    const listH = () => one.tool('list_sessions');
    for (let i = 0; i < 50; i++) {
      await listS();
      await listH();
    }
    const ls = [];
    const lh = [];
    const ds = [];
    const dh = [];
    const cs = [];
    const ch = [];
    for (let r = 0; r < rounds; r++) {
      log(`latency round ${r + 1}/${rounds}: ${per} run('true'), server/discover and list_sessions each over stdio and HTTP`);
      ls.push(...(await timeN(per, runS, { warmup: 0 })));
      lh.push(...(await timeN(per, runH, { warmup: 0 })));
      ds.push(...(await timeN(per, discS, { warmup: 0 })));
      dh.push(...(await timeN(per, discH, { warmup: 0 })));
      cs.push(...(await timeN(per, listS, { warmup: 0 })));
      ch.push(...(await timeN(per, listH, { warmup: 0 })));
    }
    const q = (a, p) => [...a].sort((x, y) => x - y)[Math.min(a.length - 1, Math.ceil((p / 100) * a.length) - 1)];
    const dMed = median(lh) - median(ls);
    const dP90 = q(lh, 90) - q(ls, 90);
    rows.push(row(stdioLabel, ls, { group: g1, baseline: stdioLabel, extra: `the load average was ${fs.readFileSync('/proc/loadavg', 'utf8').split(' ').slice(0, 3).join(' ')} when the rounds ended` }));
    rows.push(row(httpLabel, lh, {
      group: g1, baseline: stdioLabel,
      extra: `${dMed >= 0 ? '+' : ''}${dMed.toFixed(3)} ms at the median, ${dP90 >= 0 ? '+' : ''}${dP90.toFixed(3)} ms at p90 vs stdio (target: ≤ +0.3 ms at the median)`,
    }));
    const dd = median(dh) - median(ds);
    rows.push(row(discStdio, ds, { group: g1, baseline: discStdio, extra: 'no sandbox: the transport and the JSON-RPC layer alone' }));
    rows.push(row(discHttp, dh, { group: g1, baseline: discStdio, extra: `${dd >= 0 ? '+' : ''}${dd.toFixed(3)} ms at the median vs stdio` }));
    const dc = median(ch) - median(cs);
    rows.push(row(listStdio, cs, { group: g1, baseline: listStdio, extra: 'a tools/call without a sandbox: the call path (its thread, the call registry) on top of the transport' }));
    rows.push(row(listHttp, ch, { group: g1, baseline: listStdio, extra: `${dc >= 0 ? '+' : ''}${dc.toFixed(3)} ms at the median vs stdio` }));
    doneLine(stdioLabel, ls);
    doneLine(httpLabel, lh);
    doneLine(discStdio, ds);
    doneLine(discHttp, dh);
    await st('close', { session_id: sS });
    await one.tool('close', { session_id: sH });

    // 2. Throughput: 32 callers, 8 sessions.
    const idsS = [];
    const idsH = [];
    for (let i = 0; i < SESSIONS; i++) {
      idsS.push((await st('open_session')).session_id);
      idsH.push((await one.tool('open_session')).session_id);
    }
    for (let i = 0; i < CLIENTS; i++) clients.push(httpClient(web.port));
    const load = async (call) => {
      const t = nowNs();
      const lat = await Promise.all(Array.from({ length: CLIENTS }, async (_, c) => {
        const l = [];
        for (let i = 0; i < RUNS; i++) {
          const t1 = nowNs();
          const x = await call(c, c % SESSIONS);
          if (x.exit_code !== 0) throw new Error(`true exited ${x.exit_code}`);
          l.push(msSince(t1));
        }
        return l;
      }));
      return { rps: (CLIENTS * RUNS) / (msSince(t) / 1000), lat: lat.flat() };
    };
    const viaS = (c, s) => st('run', { session_id: idsS[s], command: 'true' });
    const viaH = (c, s) => clients[1 + c].tool('run', { session_id: idsH[s], command: 'true' });
    await load(viaS);
    await load(viaH);
    const rpsS = [], rpsH = [];
    let latS = [], latH = [];
    for (let rep = 0; rep < N.tputReps; rep++) {
      log(`throughput repetition ${rep + 1}/${N.tputReps}: ${CLIENTS} × ${RUNS} run('true') over stdio, then over HTTP`);
      const a = await load(viaS);
      const b = await load(viaH);
      rpsS.push(a.rps);
      rpsH.push(b.rps);
      latS = latS.concat(a.lat);
      latH = latH.concat(b.lat);
    }
    const lq = (l) => `per-run latency ms p50 ${median(l).toFixed(2)} / p90 ${q(l, 90).toFixed(2)} / p99 ${q(l, 99).toFixed(2)}`;
    rows.push(row(tStdio, rpsS, { group: g2, unit: 'runs/s', higherIsBetter: true, baseline: tStdio, latency: latS, extra: lq(latS) }));
    rows.push(row(tHttp, rpsH, {
      group: g2, unit: 'runs/s', higherIsBetter: true, baseline: tStdio, latency: latH,
      extra: `HTTP/stdio ${(100 * median(rpsH) / median(rpsS)).toFixed(0)}% (target ≥ 80%); ${lq(latH)}`,
    }));
    log(`  stdio ${median(rpsS).toFixed(0)} runs/s, HTTP ${median(rpsH).toFixed(0)} runs/s`);
    for (const id of idsS) await st('close', { session_id: id });
    for (const id of idsH) await one.tool('close', { session_id: id });
    for (const c of clients.splice(1)) c.close();

    // 3. Memory: RSS with no connection, then with IDLE idle keep-alive
    // connections (each has served one tools/list).
    one.close();
    const rssNow = async () => {
      await sleep(1000);
      const r = [];
      for (let i = 0; i < 5; i++) {
        r.push(rssKiB(web.pid));
        await sleep(100);
      }
      return median(r);
    };
    const base = [];
    const perConn = [];
    for (let rep = -1; rep < N.httpMem; rep++) {
      const before = await rssNow();
      const idle = Array.from({ length: IDLE }, () => httpClient(web.port));
      await Promise.all(idle.map((c) => c.request('tools/list')));
      const open = idle.reduce((n, c) => n + Object.values(c.agent.freeSockets).flat().length, 0);
      if (open !== IDLE) throw new Error(`${open} of ${IDLE} connections stayed open after their request`);
      const withIdle = await rssNow();
      // Repetition -1 warms up: the first connections' threads also make
      // what the allocator keeps for every later one.
      if (rep >= 0) {
        base.push(before);
        perConn.push((withIdle - before) / IDLE);
      }
      for (const c of idle) c.close();
      await sleep(500);
    }
    rows.push(row(memBase, base, { group: g3, unit: 'KiB', baseline: memBase, extra: 'VmRSS of the server (ns, no session)' }));
    rows.push(row(memPer, perConn, { group: g3, unit: 'KiB', baseline: memBase, extra: `(VmRSS with ${IDLE} idle keep-alive connections − without) / ${IDLE}, in KiB` }));
    log(`  ${median(perConn).toFixed(1)} KiB per idle connection`);
  } finally {
    for (const c of clients) c.close();
    if (stdio) await stdio.close();
    if (web) await web.close();
  }
  notes.push(
    `Raw clients on both transports, sending the same 2026-07-28 requests (the _meta envelope on every request); over HTTP also the standard headers (MCP-Protocol-Version, Mcp-Method, Mcp-Name, Mcp-Param-Session-Id), plain JSON answers (no progressToken), node's http module with a keep-alive agent. Latency: ${rounds} interleaved rounds of ${per} run('true') on one live ns session per transport, after 50 untimed calls each.`,
    `Throughput: ${CLIENTS} callers at once, caller c on session c mod ${SESSIONS}, ${RUNS} run('true') each in a row; runs/s = ${CLIENTS}×${RUNS} / wall time, one sample per repetition (${N.tputReps}), stdio and HTTP alternating. A stdio server has one client: its ${CLIENTS} callers share the pipe (the same load, one connection); over HTTP each caller has its own keep-alive connection.`,
    `Memory: VmRSS of the HTTP server (IGN_MCP_HTTP_MAX_CONNECTIONS=${4 * IDLE}, IGN_MCP_HTTP_TIMEOUT_SECS=600 so that none is closed while measured), median of 5 readings 1 s after the connections are in place, ${N.httpMem} repetitions after an untimed one.`,
  );
  notes.push(`Measured by \`node bench/bench.mjs ${process.argv.slice(2).join(' ')}\` (Node 22 from tests/node_modules/.bin first on PATH; \`make bench\` runs every section).`);
  return { id: 'http', title: '10. HTTP transport', unit: 'ms', rows, notes, grouped: true };
}

// ---------------------------------------------------------------- 11. egress

/* A local HTTP server for section 11: /hello (a short answer) and /big?n=N
 * (N bytes), every connection closed after its answer. */
async function egressHttpServer(tls = null, { h2 = false } = {}) {
  const http = await import(h2 ? 'node:http2' : tls ? 'node:https' : 'node:http');
  const chunk = Buffer.alloc(1 << 16, 'x');
  const handler = (req, res) => {
    if (!h2) res.setHeader('Connection', 'close');
    const u = new URL(req.url, 'http://x');
    if (u.pathname === '/big') {
      const n = Number(u.searchParams.get('n'));
      res.setHeader('Content-Length', String(n));
      let off = 0;
      const more = () => {
        while (off < n) {
          const len = Math.min(chunk.length, n - off);
          off += len;
          if (!res.write(len === chunk.length ? chunk : chunk.subarray(0, len))) return res.once('drain', more);
        }
        res.end();
      };
      more();
    } else res.end('hello\n');
  };
  const srv = h2 ? http.createSecureServer({ ...tls, allowHTTP1: false }, handler)
    : tls ? http.createServer(tls, handler) : http.createServer(handler);
  const sessions = new Set();
  srv.on('session', (x) => { sessions.add(x); x.on('close', () => sessions.delete(x)); });
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  return { port: srv.address().port, close: () => new Promise((r) => { srv.closeAllConnections?.(); for (const x of sessions) x.destroy(); srv.close(r); }) };
}

/* The program that times connections, the same on the host and in the
 * sandbox: N times connect, GET /hello, read to the close; the ms of each. */
const CONNECT_PROBE = `
import json, socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ip = socket.gethostbyname(host)
req = ("GET /hello HTTP/1.1\\r\\nHost: %s:%d\\r\\n\\r\\n" % (host, port)).encode()
out = []
for i in range(n + 5):
    t = time.perf_counter()
    s = socket.create_connection((ip, port))
    s.sendall(req)
    while s.recv(65536):
        pass
    s.close()
    if i >= 5:
        out.append((time.perf_counter() - t) * 1000)
print(json.dumps(out))
`;

/* Connection setup through the broker (the sandbox's connect is taken by
 * its agent, the broker connects on the host) against the host's own
 * connect, and a 100 MiB download through it against the host's curl. */
async function sectionEgress() {
  const rows = [];
  const nConn = QUICK ? 50 : 200;
  const nConnVm = QUICK ? 20 : 50;
  const reps = QUICK ? 3 : 5;
  const size = 100 * MiB;
  const g1 = `connection setup: connect, GET /hello, read to the close (ms each, one program, ${nConn} in a row; vm ${nConnVm})`;
  const g2 = 'a 100 MiB download with curl (MiB/s)';
  const hostConn = 'host: python3 connects to 127.0.0.1';
  const hostDl = 'host: curl from 127.0.0.1';
  const web = await egressHttpServer();
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'bench-egress-'));
  const hosts = path.join(dir, 'hosts');
  fs.writeFileSync(hosts, '127.0.0.1 good.test\n');
  const probe = path.join(dir, 'connect.py');
  fs.writeFileSync(probe, CONNECT_PROBE);
  const url = (h) => `http://${h}:${web.port}/big?n=${size}`;
  const curlArgs = (h) => ['-sS', '-o', '/dev/null', '-w', '%{speed_download}', url(h)];
  try {
    log(`host: ${nConn} connections from python3, ${reps} curl downloads of 100 MiB`);
    const hc = JSON.parse((await runChild('python3', ['-c', CONNECT_PROBE, '127.0.0.1', String(web.port), String(nConn)])).stdout);
    rows.push(row(hostConn, hc, { group: g1, baseline: hostConn, extra: 'the same program as in the sandbox' }));
    doneLine(hostConn, hc);
    const hd = [];
    for (let i = 0; i < reps; i++) hd.push(Number((await runChild('curl', curlArgs('127.0.0.1'))).stdout) / MiB);
    rows.push(row(hostDl, hd, { group: g2, unit: 'MiB/s', higherIsBetter: true, baseline: hostDl }));
    log(`  host curl: median ${median(hd).toFixed(0)} MiB/s`);
    for (const backend of ['ns', 'vm']) {
      const lc = `${backend}: through the broker (good.test → 127.0.0.1)`;
      const ld = `${backend}: curl through the broker`;
      if (backend === 'vm' && vmError) {
        rows.push(notMeasured(lc, vmError, { group: g1 }), notMeasured(ld, vmError, { group: g2 }));
        continue;
      }
      const env = { ...BACKENDS[backend], IGN_MCP_ROOTFS: 'tools', IGN_MCP_NET_PRIVATE: 'host', IGN_MCP_EGRESS_HOSTS: hosts };
      await withServer(env, async (srv) => {
        const s = await srv.tool('open_session', { network: 'allow', allow_hosts: [`good.test:${web.port}`] });
        try {
          const n = backend === 'vm' ? nConnVm : nConn;
          log(`${backend}: ${n} connections through the broker, ${reps} downloads of 100 MiB`);
          await srv.tool('write_file', { session_id: s.session_id, path: '/root/connect.py', content_base64: Buffer.from(CONNECT_PROBE).toString('base64') });
          const r = await srv.run(s.session_id, `python3 /root/connect.py good.test ${web.port} ${n}`, { timeout_s: 600 });
          const sc = JSON.parse(r.stdout);
          const d = median(sc) - median(hc);
          // A guest whose clock ticks coarsely gives samples in steps.
          const steps = sc.every((x) => Math.abs(x / 4 - Math.round(x / 4)) < 0.01) ? '; every sample is a multiple of 4 ms: the guest clock\'s resolution, not a measurement of 4 ms steps' : '';
          rows.push(row(lc, sc, {
            group: g1, baseline: hostConn,
            extra: `${d >= 0 ? '+' : ''}${d.toFixed(3)} ms at the median vs the host${backend === 'ns' ? ' (target: ≤ +1 ms)' : ' (TCG: reported only)'}${steps}`,
          }));
          doneLine(lc, sc);
          const sd = [];
          for (let i = 0; i < reps; i++) {
            const x = await srv.run(s.session_id, `curl ${curlArgs('good.test').map((a) => `'${a}'`).join(' ')}`, { timeout_s: 600 });
            sd.push(Number(x.stdout) / MiB);
          }
          const pct = (100 * median(sd)) / median(hd);
          rows.push(row(ld, sd, {
            group: g2, unit: 'MiB/s', higherIsBetter: true, baseline: hostDl,
            extra: `${pct.toFixed(0)}% of the host's${backend === 'ns' ? ' (target: ≥ 50%)' : ' (TCG: reported only)'}`,
          }));
          log(`  ${backend} curl: median ${median(sd).toFixed(0)} MiB/s (${pct.toFixed(0)}% of the host's)`);
        } finally {
          await srv.tool('close', { session_id: s.session_id }).catch(() => {});
        }
      }).catch((e) => {
        if (!rows.some((x) => x.label === lc)) rows.push(notMeasured(lc, firstLine(e.message), { group: g1 }));
        if (!rows.some((x) => x.label === ld)) rows.push(notMeasured(ld, firstLine(e.message), { group: g2 }));
      });
    }
  } finally {
    await web.close();
    await web2.close();
    fs.rmSync(dir, { recursive: true, force: true });
  }
  const notes = [
    `A local HTTP server (node, in the harness) on 127.0.0.1; the sandbox reaches it as good.test (IGN_MCP_EGRESS_HOSTS pins it to 127.0.0.1, IGN_MCP_NET_PRIVATE=host admits it, allow_hosts ["good.test:PORT"]). Connection setup: one python3 program (the same on the host and in the sandbox, the tools rootfs) makes ${nConn} connections in a row (5 untimed first), each connect, GET /hello, read to the server's close: through the broker that is the agent's accept, STREAM_OPEN, the peek of the request, the broker's connect on the host and the answer relayed back.`,
    `Download: curl -o /dev/null of 100 MiB, its own %{speed_download}, ${reps} times each; the host's curl against the same server is the baseline. The vm rows run under ${vmInfo?.isolation ?? 'the vm backend'}: reported, no target.`,
  ];
  return { id: 'egress', title: '11. Egress through the broker', unit: 'ms', rows, notes, grouped: true };
}

// ---------------------------------------------------------- 14. interception

/* What a secret costs (IGN_MCP_SECRETS): the same HTTPS requests from one
 * ns sandbox to a local server, relayed end to end (no secret for the host)
 * and intercepted (a secret for it: the broker's TLS both ways, the request
 * read and rewritten); a 100 MiB download through interception against the
 * host's own curl. */
async function sectionIntercept() {
  const rows = [];
  const n = QUICK ? 20 : 60;
  const reps = QUICK ? 3 : 5;
  const size = 100 * MiB;
  const g1 = `an HTTPS GET of 6 bytes, a new curl and connection each (ms, ${n} in a row)`;
  const g2 = 'a 100 MiB HTTPS download with curl (MiB/s)';
  const direct = 'ns: relayed end to end (no secret for the host)';
  const hostDl = 'host: curl from 127.0.0.1';
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'bench-icpt-'));
  const key = path.join(dir, 'key.pem'), cert = path.join(dir, 'cert.pem');
  spawnSync('openssl', ['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes',
    '-keyout', key, '-out', cert, '-days', '2', '-subj', '/CN=good.test', '-addext', 'subjectAltName=DNS:good.test,DNS:plain.test',
    '-addext', 'basicConstraints=critical,CA:TRUE'], { stdio: 'pipe' });
  const web = await egressHttpServer({ key: fs.readFileSync(key), cert: fs.readFileSync(cert) });
  const web2 = await egressHttpServer({ key: fs.readFileSync(key), cert: fs.readFileSync(cert) }, { h2: true });
  const hosts = path.join(dir, 'hosts');
  fs.writeFileSync(hosts, '127.0.0.1 good.test plain.test\n');
  const secrets = path.join(dir, 'secrets.json');
  fs.writeFileSync(secrets, JSON.stringify({ BENCH_TOKEN: { value: 'bench-value-0123456789', hosts: [`good.test:${web.port}`, `good.test:${web2.port}`] } }), { mode: 0o600 });
  const loop = (h, p, proto = '--http1.1', port = web.port) => `for i in $(seq ${n + 3}); do curl -sS ${proto} -o /dev/null -w '%{time_total}\\n' --cacert /root/both.pem -H "Authorization: Bearer $BENCH_TOKEN" https://${h}:${port}${p}; done`;
  const times = (out) => out.trim().split('\n').slice(3).map((x) => Number(x) * 1000);
  try {
    const hd = [];
    for (let i = 0; i < reps; i++) hd.push(Number((await runChild('curl', ['-sS', '-k', '-o', '/dev/null', '-w', '%{speed_download}', `https://127.0.0.1:${web.port}/big?n=${size}`])).stdout) / MiB);
    rows.push(row(hostDl, hd, { group: g2, unit: 'MiB/s', higherIsBetter: true, baseline: hostDl }));
    const env = { ...BACKENDS.ns, IGN_MCP_ROOTFS: 'tools', IGN_MCP_NET_PRIVATE: 'host', IGN_MCP_EGRESS_HOSTS: hosts, IGN_MCP_SECRETS: secrets, IGN_MCP_EGRESS_CA: cert };
    await withServer(env, async (srv) => {
      const s = await srv.tool('open_session', { secrets: ['BENCH_TOKEN'], allow_hosts: [`plain.test:${web.port}`] });
      try {
        await srv.tool('write_file', { session_id: s.session_id, path: '/root/cert.pem', content_base64: fs.readFileSync(cert).toString('base64') });
        // The first command puts the broker's CA in the bundle; the server's own cert beside it.
        await srv.run(s.session_id, 'cat "$SSL_CERT_FILE" /root/cert.pem > /root/both.pem');
        log(`ns: ${n} HTTPS requests relayed, ${n} intercepted, ${reps} downloads of 100 MiB intercepted`);
        const d = times((await srv.run(s.session_id, loop('plain.test', '/hello'), { timeout_s: 600 })).stdout);
        rows.push(row(direct, d, { group: g1, baseline: direct }));
        doneLine(direct, d);
        const label = 'ns: intercepted (the secret put in)';
        const ic = times((await srv.run(s.session_id, loop('good.test', '/hello'), { timeout_s: 600 })).stdout);
        const delta = median(ic) - median(d);
        rows.push(row(label, ic, { group: g1, baseline: direct, extra: `+${delta.toFixed(2)} ms at the median: the broker's handshakes both ways, the request read and rewritten` }));
        doneLine(label, ic);
        const label2 = 'ns: intercepted, HTTP/2 with the sandbox (curl --http2)';
        const ic2 = times((await srv.run(s.session_id, loop('good.test', '/hello', '--http2'), { timeout_s: 600 })).stdout);
        rows.push(row(label2, ic2, { group: g1, baseline: direct, extra: `+${(median(ic2) - median(ic)).toFixed(2)} ms against HTTP/1.1 intercepted: the HTTP/2 gateway's thread, its frames, the request carried as HTTP/1.1 inside` }));
        doneLine(label2, ic2);
        const label3 = 'ns: intercepted, HTTP/2 both ways (an HTTP/2-only server)';
        const ic3 = times((await srv.run(s.session_id, loop('good.test', '/hello', '--http2', web2.port), { timeout_s: 600 })).stdout);
        rows.push(row(label3, ic3, { group: g1, baseline: direct, extra: `+${(median(ic3) - median(ic)).toFixed(2)} ms against HTTP/1.1 intercepted: both gateways` }));
        doneLine(label3, ic3);
        // A session of its own per series: a session's egress stops at
        // IGN_MCP_EGRESS_BYTES (1 GiB), and three series of 500 MiB pass it.
        const dl = async (h, proto = '--http1.1', port = web.port) => {
          const v = [];
          const ds = await srv.tool('open_session', { secrets: ['BENCH_TOKEN'], allow_hosts: [`plain.test:${web.port}`] });
          await srv.tool('write_file', { session_id: ds.session_id, path: '/root/cert.pem', content_base64: fs.readFileSync(cert).toString('base64') });
          await srv.run(ds.session_id, 'cat "$SSL_CERT_FILE" /root/cert.pem > /root/both.pem');
          for (let i = 0; i < reps; i++) {
            const x = await srv.run(ds.session_id, `curl -sS ${proto} -o /dev/null -w '%{speed_download}' --cacert /root/both.pem https://${h}:${port}/big?n=${size}`, { timeout_s: 600 });
            v.push(Number(x.stdout) / MiB);
          }
          await srv.tool('close', { session_id: ds.session_id });
          return v;
        };
        const rd = await dl('plain.test');
        rows.push(row('ns: curl relayed end to end', rd, { group: g2, unit: 'MiB/s', higherIsBetter: true, baseline: hostDl, extra: `${((100 * median(rd)) / median(hd)).toFixed(0)}% of the host's` }));
        const sd = await dl('good.test');
        const ld = 'ns: curl through interception';
        rows.push(row(ld, sd, { group: g2, unit: 'MiB/s', higherIsBetter: true, baseline: hostDl, extra: `${((100 * median(sd)) / median(hd)).toFixed(0)}% of the host's, ${((100 * median(sd)) / median(rd)).toFixed(0)}% of the same download relayed end to end` }));
        const sd2 = await dl('good.test', '--http2');
        rows.push(row('ns: curl --http2 through interception', sd2, { group: g2, unit: 'MiB/s', higherIsBetter: true, baseline: hostDl, extra: `${((100 * median(sd2)) / median(sd)).toFixed(0)}% of the same download intercepted over HTTP/1.1` }));
        const sd3 = await dl('good.test', '--http2', web2.port);
        rows.push(row('ns: curl --http2 through interception to an HTTP/2-only server', sd3, { group: g2, unit: 'MiB/s', higherIsBetter: true, baseline: hostDl, extra: `${((100 * median(sd3)) / median(sd)).toFixed(0)}% of the same download intercepted over HTTP/1.1 (both gateways)` }));
        log(`  intercepted download: median ${median(sd).toFixed(0)} MiB/s (HTTP/1.1), ${median(sd2).toFixed(0)} MiB/s (HTTP/2)`);
      } finally {
        await srv.tool('close', { session_id: s.session_id }).catch(() => {});
      }
    });
  } finally {
    await web.close();
    fs.rmSync(dir, { recursive: true, force: true });
  }
  const notes = [
    `A local HTTPS server (node) on 127.0.0.1 with its own certificate, reached from one ns sandbox (tools rootfs) as plain.test (allow_hosts: relayed end to end, the broker only peeks at the SNI) and as good.test (the host of a secret: intercepted). Each request is a new curl process and connection sending the secret's placeholder; the first 3 of each series are not counted. The difference is what interception adds: a TLS handshake with the sandbox (ECDSA P-256 leaf from the server's CA), one with the server, the request parsed and rewritten, the response relayed with Connection: close.`,
    `Download: curl -o /dev/null of 100 MiB over HTTPS, ${reps} times; the host's curl against the same server is the baseline.`,
    'curl speaks HTTP/1.1 (--http1.1) unless a row says HTTP/2. The server speaks HTTP/1.1 only, so an HTTP/2 row goes through the front gateway alone (sandbox h2, broker, server h1), except the rows of the HTTP/2-only server (node http2, no HTTP/1.1): both gateways (sandbox h2, broker h1 inside, server h2).',
  ];
  return { id: 'intercept', title: '14. Secrets: the cost of interception', unit: 'ms', rows, notes, grouped: true };
}

// ---------------------------------------------------------------- 12. tasks

/* MCP Tasks (2025-11-25, params.task) against the same call answered
 * synchronously, on one ns session through the raw client: what making a
 * call a task costs, and how long a long call holds the client's turn. */
async function sectionTasks() {
  const n = QUICK ? 40 : 150;
  const nLong = QUICK ? 4 : 8;
  const sync = "ns: run('true'), synchronous";
  const made = "ns: run('true') as a task: until the task is made (CreateTaskResult)";
  const round = "ns: run('true') as a task: made, then tasks/result (the whole result)";
  const longSync = "ns: run('sleep 1'), synchronous: the client's turn is held";
  const longTask = "ns: run('sleep 1') as a task: the client's turn is held (until the task is made)";
  const order = [sync, made, round];
  const samples = new Map(order.map((l) => [l, []]));
  const longRows = new Map([[longSync, []], [longTask, []]]);
  const srv = await startRawServer(BACKENDS.ns);
  try {
    const { session_id } = await srv.tool('open_session', {});
    const asTask = (command) => srv.request('tools/call', { name: 'run', arguments: { session_id, command }, task: {} });
    const collect = (taskId) => srv.request('tasks/result', { taskId });
    const once = {
      [sync]: async () => {
        const t = nowNs();
        await srv.tool('run', { session_id, command: 'true' });
        return msSince(t);
      },
      [made]: async () => {
        const t = nowNs();
        const r = await asTask('true');
        const ms = msSince(t);
        await collect(r.task.taskId);
        return ms;
      },
      [round]: async () => {
        const t = nowNs();
        const r = await asTask('true');
        const res = await collect(r.task.taskId);
        const ms = msSince(t);
        if (res.structuredContent?.exit_code !== 0) throw new Error(`a task's run failed: ${textOf(res)}`);
        return ms;
      },
    };
    for (let i = 0; i < 10; i++) for (const l of order) await once[l]();
    for (let i = 0; i < n; i++) for (let k = 0; k < order.length; k++) {
      const l = order[(i + k) % order.length];
      samples.get(l).push(await once[l]());
    }
    for (let i = 0; i < nLong; i++) {
      let t = nowNs();
      await srv.tool('run', { session_id, command: 'sleep 1' });
      longRows.get(longSync).push(msSince(t));
      t = nowNs();
      const r = await asTask('sleep 1');
      longRows.get(longTask).push(msSince(t));
      await collect(r.task.taskId);
    }
  } finally {
    await srv.close();
  }
  const rows = [
    ...order.map((l) => row(l, samples.get(l), { group: 'a quick command', baseline: sync })),
    ...[...longRows].map(([l, v]) => row(l, v, { group: 'a command of one second', baseline: longSync })),
  ];
  const notes = [
    `One ns session, the raw JSON-RPC client on stdio (2025-11-25); ${n} samples of each quick row, taken in one interleaved loop whose order rotates, after 10 untimed rounds; ${nLong} of each one-second row.`,
    '"until the task is made": from sending the tools/call with params.task to its CreateTaskResult; the command then runs on, and its result is collected (untimed) before the next sample. "made, then tasks/result": to the whole result, tasks/result waiting for the end.',
    'The one-second rows are what a client that cannot go on while a call is open waits for: the whole call, or only until the task is made.',
  ];
  return { id: 'tasks', title: '12. Long calls as tasks', unit: 'ms', rows, notes, grouped: true };
}

// ---------------------------------------------------------------- 13. hibernate

/* Hibernate and resume on one backend, one server with a store of the
 * section's own (IGN_MCP_POOL=0, IGN_MCP_SPARES=0): the baseline is
 * open_session(stage) of the same session committed, to its first
 * run('true'); against it, a resume: run('true') on the hibernated session,
 * to its answer. Then what a hibernation costs: the hibernate call, the bytes
 * on disk (vm: against the warm base's RAM file). */
async function hibernateRows(backend, n) {
  const g = backend === 'vm' ? 'vm (QEMU microVMs, IGN_MCP_POOL=0)' : 'ns (namespaces)';
  const L = {
    stage: `${backend}: open_session(stage) to its first run('true') answering`,
    resume: `${backend}: resume: run('true') on a hibernated session, to its answer`,
    resumedMs: `${backend}: resume: resumed_ms (server)`,
    hib: `${backend}: hibernate of an idle session (wall)`,
    hibBusy: 'vm: hibernate of a busy session (wall)',
    baseBytes: `${backend}: warm base RAM file, allocated (MiB)`,
    bytes: `${backend}: a hibernated idle session on disk (MiB)`,
  };
  const rows = [];
  const store = fs.mkdtempSync(path.join(os.tmpdir(), `ign-bench-hib-${backend}.`));
  fs.chmodSync(store, 0o755);
  const env = { ...BACKENDS[backend], IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0, IGN_MCP_STORE: store };
  try {
    await withServer(env, async (srv) => {
      const src = await srv.open();
      await srv.run(src.session_id, 'echo ready > /root/mark');
      await srv.tool('commit', { session_id: src.session_id, name: 'bench/hib' });
      log(`${backend}: open_session(stage) to its first run (baseline)`);
      const fromStage = await timeN(n, async () => {
        const s = await srv.tool('open_session', { stage: 'bench/hib' });
        await srv.run(s.session_id, 'true');
        await srv.tool('close', { session_id: s.session_id });
      }, { warmup: 2, label: L.stage });
      rows.push(row(L.stage, fromStage, { group: g, baseline: L.stage }));
      doneLine(L.stage, fromStage);

      log(`${backend}: hibernate, then resume by a run`);
      const hib = [], resume = [], resumedMs = [], bytes = [];
      for (let i = 0; i < n + 1; i++) {
        let t = nowNs();
        const h = await srv.tool('hibernate', { session_id: src.session_id });
        const hMs = msSince(t);
        t = nowNs();
        const r = await srv.tool('run', { session_id: src.session_id, command: 'true' });
        const rMs = msSince(t);
        if (i === 0) continue; // one untimed warm-up
        hib.push(hMs);
        resume.push(rMs);
        resumedMs.push(r.resumed_ms);
        bytes.push(h.bytes / MiB);
      }
      rows.push(row(L.resume, resume, { group: g, baseline: L.stage, extra: 'target: ≤ 1.2× open_session(stage)' }));
      rows.push(row(L.resumedMs, resumedMs, { group: g, baseline: L.stage }));
      rows.push(row(L.hib, hib, { group: g, baseline: L.stage }));
      doneLine(L.resume, resume);
      const ram = backend === 'vm' ? baseRamFile(store) : null;
      if (ram) rows.push(row(L.baseBytes, [allocatedBytes(ram) / MiB], { group: g, unit: 'MiB', baseline: L.baseBytes }));
      rows.push(row(L.bytes, bytes, { group: g, unit: 'MiB', baseline: ram ? L.baseBytes : undefined, extra: ram ? '' : 'the files the session wrote' }));
      if (backend === 'vm') {
        await srv.run(src.session_id, "nohup sh -c 'while :; do head -c 8M /dev/urandom > /tmp/w; done' >/dev/null 2>&1 &");
        const busy = await timeN(Math.max(3, Math.floor(n / 2)), async () => {
          await srv.tool('hibernate', { session_id: src.session_id });
          await srv.run(src.session_id, 'true');
        }, { warmup: 1, label: L.hibBusy });
        rows.push(row(L.hibBusy, busy, { group: g, baseline: L.stage, extra: 'with its resume (a run) after each' }));
      }
      await srv.tool('stage_rm', { name: 'bench/hib' });
    });
  } catch (e) {
    for (const l of Object.values(L)) if (!rows.some((r) => r.label === l) && (backend === 'vm' || !l.startsWith('vm:'))) rows.push(notMeasured(l, firstLine(e.message), { group: g }));
  } finally {
    fs.rmSync(store, { recursive: true, force: true });
  }
  return rows;
}

/* PSS of process PID and everything under it (a server and its QEMUs), MiB. */
function treePssMiB(pid) {
  return [pid, ...descendants(pid).map((d) => d.pid)].reduce((a, p) => a + pssKiB(p), 0) / 1024;
}

/* The blocks allocated under DIR, MiB. */
function treeAllocMiB(dir) {
  let b = 0;
  const walk = (d) => {
    let es = [];
    try {
      es = fs.readdirSync(d, { withFileTypes: true });
    } catch {
      return;
    }
    for (const e of es) {
      const p = path.join(d, e.name);
      try {
        const st = fs.lstatSync(p);
        b += st.blocks * 512;
        if (st.isDirectory()) walk(p);
      } catch {}
    }
  };
  walk(dir);
  return b / MiB;
}

/* Resume in another server: N sessions hibernated by one server, which
 * then exits; the next server on the store resumes each at its first
 * run('true').  Against open_session(stage) (hibernateRows' baseline). */
async function crossServerRows(backend, n, baseline) {
  const g = backend === 'vm' ? 'vm (QEMU microVMs, IGN_MCP_POOL=0)' : 'ns (namespaces)';
  const L = `${backend}: resume in the next server: run('true') on a session the last server hibernated, to its answer`;
  const store = fs.mkdtempSync(path.join(os.tmpdir(), `ign-bench-hibx-${backend}.`));
  fs.chmodSync(store, 0o755);
  const env = { ...BACKENDS[backend], IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0, IGN_MCP_STORE: store, IGN_MCP_SHUTDOWN_ACTION: 'hibernate' };
  try {
    const ids = [];
    await withServer(env, async (srv) => {
      for (let i = 0; i < n + 1; i++) {
        const s = await srv.open();
        await srv.run(s.session_id, 'echo ready > /root/mark');
        await srv.tool('hibernate', { session_id: s.session_id });
        ids.push(s.session_id);
      }
    });
    const samples = [];
    await withServer({ ...env, IGN_MCP_SHUTDOWN_ACTION: 'close' }, async (srv) => {
      for (const [i, id] of ids.entries()) {
        const t = nowNs();
        await srv.run(id, 'true');
        if (i > 0) samples.push(msSince(t)); // the first: untimed warm-up
        await srv.tool('close', { session_id: id });
      }
    });
    doneLine(L, samples);
    return [row(L, samples, { group: g, baseline, extra: 'the stage\'s checksums are verified on this first open' })];
  } catch (e) {
    return [notMeasured(L, firstLine(e.message), { group: g })];
  } finally {
    fs.rmSync(store, { recursive: true, force: true });
  }
}

/* Density (vm): TOTAL sessions opened RUNNING at a time and hibernated,
 * until TOTAL are held; then resumed one by one (each hibernated again
 * after its run).  The server's and its QEMUs' PSS and the store's blocks
 * at each step. */
async function densityRows(total, running) {
  const g = 'vm (QEMU microVMs, IGN_MCP_POOL=0)';
  const L = {
    live: `vm: ${running} sessions running idle: server and QEMU PSS (MiB)`,
    held: `vm: ${total} sessions hibernated, none running: server and QEMU PSS (MiB)`,
    disk: `vm: ${total} sessions hibernated: the store's stages on disk (MiB)`,
    resume: `vm: resume one of ${total} hibernated, run('true'), hibernate it again: the resume (ms)`,
  };
  const store = fs.mkdtempSync(path.join(os.tmpdir(), 'ign-bench-density.'));
  fs.chmodSync(store, 0o755);
  const env = {
    ...BACKENDS.vm, IGN_MCP_POOL: 0, IGN_MCP_SPARES: 0, IGN_MCP_STORE: store,
    // The count of hibernated sessions a server holds is 8 x this.
    IGN_MCP_MAX_SESSIONS: Math.max(running, Math.ceil(total / 8)),
    IGN_MCP_HIBERNATE_MAX_MB: 1 << 20, IGN_MCP_STAGES_MAX_MB: 1 << 20,
  };
  const rows = [];
  const steps = [];
  try {
    await withServer(env, async (srv) => {
      const ids = [];
      let livePss = null;
      while (ids.length < total) {
        const batch = [];
        for (let i = 0; i < running && ids.length + batch.length < total; i++) {
          const s = await srv.open();
          await srv.run(s.session_id, 'echo held > /root/mark');
          batch.push(s.session_id);
        }
        await sleep(1500);
        if (livePss === null && batch.length === running) livePss = treePssMiB(srv.pid);
        for (const id of batch) await srv.tool('hibernate', { session_id: id });
        ids.push(...batch);
        steps.push(`${ids.length} hibernated: PSS ${treePssMiB(srv.pid).toFixed(0)} MiB, stages ${treeAllocMiB(path.join(store, 'stages')).toFixed(0)} MiB`);
        log(`  ${steps.at(-1)}`);
      }
      await sleep(1500);
      const heldPss = treePssMiB(srv.pid);
      const disk = treeAllocMiB(path.join(store, 'stages'));
      if (livePss !== null) rows.push(row(L.live, [livePss], { group: g, unit: 'MiB', baseline: L.live }));
      rows.push(row(L.held, [heldPss], { group: g, unit: 'MiB', baseline: livePss !== null ? L.live : undefined, extra: `${total} sessions held with RAM for ${running}` }));
      rows.push(row(L.disk, [disk], { group: g, unit: 'MiB', extra: `${(disk / total).toFixed(1)} MiB a session` }));
      const resume = [];
      for (const [i, id] of ids.entries()) {
        const r = await srv.run(id, 'cat /root/mark');
        if (r.stdout !== 'held\n') throw new Error(`session ${id} resumed without its file`);
        resume.push(r.resumed_ms);
        await srv.tool('hibernate', { session_id: id });
        if ((i + 1) % running === 0) {
          steps.push(`${i + 1} resumed and hibernated again: PSS ${treePssMiB(srv.pid).toFixed(0)} MiB`);
          log(`  ${steps.at(-1)}`);
        }
      }
      rows.push(row(L.resume, resume, { group: g, extra: 'resumed_ms, the server\'s part' }));
      for (const id of ids) await srv.tool('close', { session_id: id });
    });
  } catch (e) {
    for (const l of Object.values(L)) if (!rows.some((r) => r.label === l)) rows.push(notMeasured(l, firstLine(e.message), { group: g }));
  } finally {
    fs.rmSync(store, { recursive: true, force: true });
  }
  return { rows, steps };
}

async function sectionHibernate() {
  const rows = [];
  let steps = [];
  for (const backend of ['vm', 'ns']) {
    if (backend === 'vm' && vmError) {
      rows.push(notMeasured('vm: hibernate and resume', vmError, { group: 'vm (QEMU microVMs, IGN_MCP_POOL=0)' }));
      continue;
    }
    const n = backend === 'vm' ? N.stageVm : N.stage;
    rows.push(...(await hibernateRows(backend, n)));
    rows.push(...(await crossServerRows(backend, n, `${backend}: open_session(stage) to its first run('true') answering`)));
  }
  if (!vmError) {
    const d = await densityRows(QUICK ? 40 : 200, QUICK ? 4 : 20);
    rows.push(...d.rows);
    steps = d.steps;
  }
  const notes = [
    'One server per backend with a store of the section\'s own (made fresh, removed after), IGN_MCP_POOL=0 and IGN_MCP_SPARES=0: a resume and the baseline take the same path, a new QEMU restored from a RAM file and a device state (vm), a new namespace sandbox over a layer (ns).',
    'Baseline: open_session(stage) of the session committed, then run(\'true\') in it, to its answer (the close untimed). Resume: the session hibernated (untimed in that row), then run(\'true\') on it, to its answer; resumed_ms is the part the server reports for the resume. Hibernate: the wall time of the call on an idle session (vm: the RAM streamed to a file, then the QEMU stopped); in the busy row (vm) the guest rewrites 8 MiB of /dev/urandom in a loop, and each sample is a hibernate and its resume.',
    'Bytes: what the hibernate call reported (allocated blocks of the saved state), against the blocks allocated to the warm base\'s RAM file in the same store.',
    'Resume in the next server: one server opens and hibernates the sessions, then exits (its sessions stay on the store); a second server on the same store times run(\'true\') on each, the first call that names it (the claim of the record, the kept stage opened and its checksums verified, the sandbox started).',
    `Density (vm): sessions opened ${QUICK ? 4 : 20} at a time, each writing a file, then hibernated, until ${QUICK ? 40 : 200} are held; PSS (smaps_rollup) of the server and every process under it, the blocks under the store's stages/. Then each is resumed (run, its file checked), and hibernated again. Steps: ${steps.join('; ') || 'not run'}.`,
  ];
  return { id: 'hibernate', title: '13. Hibernate and resume', unit: 'ms', rows, notes, grouped: true };
}

// ---------------------------------------------------------------- main

async function main() {
  for (const [what, p] of [['server', SERVER], ['agent', AGENT], ['C helper', CBENCH]]) {
    if (!fs.existsSync(p)) throw new Error(`the ${what} ${p} is missing: run \`make bench\` (it builds everything first)`);
  }
  const started = new Date();
  const machine = machineInfo();
  log(`${QUICK ? 'quick' : 'full'} run on ${machine.nproc} cores (${machine.cpu}), kernel ${machine.kernel}, load ${machine.loadavg_at_start}`);
  setSection('probe');
  await probeVm();
  machine.kvm_used = vmError ? 'no (the vm backend did not run)' : vmInfo.isolation === 'microvm/kvm' ? 'yes' : `no (${vmInfo.isolation})`;

  const plan = [
    [1, sectionStart], [2, sectionExec], [3, sectionFiles], [4, sectionThroughput],
    [5, sectionMemory], [6, sectionWorkload], [7, sectionPeer], [8, sectionStages], [9, sectionOneShot],
    [10, sectionHttp], [11, sectionEgress], [12, sectionTasks], [13, sectionHibernate], [14, sectionIntercept],
  ];
  // With --only, the sections not run are kept from the last run's
  // bench/results.json (each says so), so that BENCHMARKS.md stays whole.
  let previous = null;
  if (ONLY) {
    try {
      previous = JSON.parse(fs.readFileSync(path.join(REPO, 'bench/results.json'), 'utf8'));
    } catch {}
  }
  const sections = [];
  for (const [i, fn] of plan) {
    if (ONLY && !ONLY.has(i)) {
      const id = fn.name.replace('section', '').toLowerCase();
      const old = previous?.sections?.find((x) => x.id === id || x.id === fn.name);
      if (old) sections.push({ ...old, kept_from: old.kept_from ?? previous.started });
      continue;
    }
    setSection(`${i}/${plan.length} ${fn.name.replace('section', '').toLowerCase()}`);
    const t = Date.now();
    try {
      const s = await fn();
      s.seconds = Math.round((Date.now() - t) / 1000);
      sections.push(s);
    } catch (e) {
      log(`FAILED: ${e.stack || e.message}`);
      sections.push({ id: fn.name, title: `${i}. ${fn.name.replace('section', '')}`, rows: [], notes: [], failed: firstLine(e.message) });
    }
  }
  setSection('');
  const results = {
    tool: 'ignition-mcp bench',
    mode: QUICK ? 'quick' : 'full',
    started: started.toISOString(),
    seconds: Math.round((Date.now() - started.getTime()) / 1000),
    machine,
    vm: vmError ? { error: vmError } : vmInfo,
    server: path.relative(REPO, SERVER),
    git: spawnSync('git', ['-C', REPO, 'describe', '--always', '--dirty'], { encoding: 'utf8' }).stdout.trim(),
    sections,
  };
  const { md, json } = writeReport(results, path.join(REPO, 'bench'));
  log(`wrote ${path.relative(REPO, md)} and ${path.relative(REPO, json)} in ${results.seconds} s`);
  // Every server and sandbox was closed on the way; anything still under
  // this process is a bug to report (and to kill).
  const left = descendants(process.pid);
  if (left.length) {
    log(`warning: killing leftovers: ${left.map((l) => `${l.pid} ${l.cmd.join(" ")}`).join("; ")}`);
    await reapRecords(left, 100);
  }
}

main().then(
  () => process.exit(0),
  (e) => {
    log(`bench failed: ${e.stack || e.message}`);
    process.exit(1);
  },
);
