// lib.mjs: helpers shared by the end-to-end tests.
//
// The tests drive the real ignition-mcp binary in two ways:
//  - through the official TypeScript SDK (Client + StdioClientTransport),
//    which is an independent implementation of the MCP client side; and
//  - through a raw client that writes arbitrary bytes to the server's stdin
//    and reads newline-delimited JSON from its stdout, for protocol-level
//    tests that the SDK would refuse to produce.
//
// Every server started here is tracked; close() shuts it down, checks that no
// descendant process survives it and that stderr holds no sanitizer report;
// on the vm backend also that none of its QEMUs survives and that it removed
// its QEMUs' state directories.
//
// IGN_TEST_BACKEND (ns or vm) picks the backend of every server; the rootfs
// is passed by name (small, tools), which both backends understand.

import { spawn } from 'node:child_process';
import assert from 'node:assert/strict';
import { after } from 'node:test';
import crypto from 'node:crypto';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';

export const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..');

function firstExisting(...candidates) {
  for (const c of candidates) if (c && fs.existsSync(c)) return c;
  return candidates[candidates.length - 1];
}

export const SERVER = process.env.IGN_TEST_SERVER ||
  firstExisting(path.join(REPO, 'build/san/ignition-mcp'), path.join(REPO, 'build/ignition-mcp'));
export const AGENT = process.env.IGN_TEST_AGENT || path.join(REPO, 'build/ign-agent');
/* The rootfs trees the ns backend uses for the names below (the server looks
 * for <its dir>/rootfs/NAME; build/san/rootfs links to build/rootfs). */
export const ROOTFS_SMALL = process.env.IGN_TEST_ROOTFS_SMALL || path.join(path.dirname(SERVER), 'rootfs/small');
export const ROOTFS_TOOLS = process.env.IGN_TEST_ROOTFS_TOOLS || path.join(path.dirname(SERVER), 'rootfs/tools');
/* IGN_TEST_BACKEND picks the backend every server of the suite runs on:
 * "ns" (namespaces, the default) or "vm" (QEMU microVMs). The runner runs
 * the suite once per backend. */
export const BACKEND = process.env.IGN_TEST_BACKEND || 'ns';
export const IS_NS = BACKEND === 'ns';
export const IS_VM = BACKEND === 'vm';

/* Where the vm backend's images are: next to the server (build/san/vm is a
 * link to build/vm). */
export const VM_DIR = process.env.IGN_TEST_VM_DIR || path.join(path.dirname(SERVER), 'vm');

/* The rootfs is passed by name: a name works for both backends (ns: the tree
 * <server dir>/rootfs/NAME; vm: <server dir>/vm/rootfs-NAME.erofs), a
 * directory only for ns. */
export const ROOTFS_SMALL_NAME = 'small';
export const ROOTFS_TOOLS_NAME = 'tools';

export const HAVE_TOOLS_ROOTFS = IS_VM
  ? fs.existsSync(path.join(VM_DIR, 'rootfs-tools.erofs'))
  : fs.existsSync(path.join(ROOTFS_TOOLS, 'usr/bin/python3'));
export const TOOLS_SKIP = HAVE_TOOLS_ROOTFS
  ? false
  : IS_VM
    ? `tools rootfs image not built at ${path.join(VM_DIR, 'rootfs-tools.erofs')}`
    : `tools rootfs not built at ${ROOTFS_TOOLS}`;

/* Skip markers for tests whose expectation holds on one backend only; the
 * reason shows in the test output. */
export const NS_ONLY = (why) => (IS_NS ? false : `ns only: ${why}`);
export const VM_ONLY = (why) => (IS_VM ? false : `vm only: ${why}`);
/* The suite runs as root (CI) and as an unprivileged user (IGN_TEST_USER,
 * e.g. through runuser): what only a root server can give is skipped as a
 * user, with the reason. */
export const AS_ROOT = process.getuid() === 0;
export const ROOT_ONLY = (why) => (AS_ROOT ? false : `root only (the suite runs as uid ${process.getuid()}): ${why}`);

/* The store of warm bases the vm servers use unless a test gives its own
 * (tests/run.sh makes a fresh one per run); empty: the server's default. */
export const VM_STORE = process.env.IGN_TEST_VM_STORE || '';
/* IGN_TEST_SOAK=1: the soaks run at full length (sandbox_run's 100 calls,
 * a 200 MiB log); `make check` runs a short version of each. */
export const SOAK = process.env.IGN_TEST_SOAK === '1';
/* Set by tests/run.sh valgrind: the server runs under valgrind, whose own
 * memory makes the server's RSS mean nothing. */
export const UNDER_VALGRIND = process.env.IGN_TEST_VALGRIND === '1';
/* Where the vm backend keeps one state directory per QEMU,
 * <VM_RUN_DIR>/<server pid>-<n> (the servers run as this process's uid). */
export const VM_RUN_DIR = process.getuid() === 0
  ? '/run/ignition-mcp'
  : process.env.XDG_RUNTIME_DIR
    ? path.join(process.env.XDG_RUNTIME_DIR, 'ignition-mcp')
    : `/tmp/ignition-mcp-${process.getuid()}`;

export const TOOL_NAMES = ['open_session', 'run', 'write_file', 'read_file', 'reset', 'close', 'hibernate', 'list_sessions', 'commit', 'fork', 'stage_list', 'stage_info', 'stage_rm', 'sandbox_run', 'copy_in', 'copy_out', 'network_log', 'network_update'];

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/* Poll fn() until it returns a truthy value or the deadline passes; returns
 * the last value (falsy on timeout) so the caller asserts with context. */
export async function waitUntil(fn, { timeoutMs = 5000, intervalMs = 100 } = {}) {
  const deadline = Date.now() + timeoutMs;
  let v;
  for (;;) {
    v = await fn();
    if (v || Date.now() >= deadline) return v;
    await sleep(intervalMs);
  }
}

export function uniq(prefix = 'e2e') {
  return `${prefix}-${process.pid}-${crypto.randomBytes(6).toString('hex')}`;
}

/* A number that can serve as a recognisable `sleep` argument: the process
 * `sleep <n>` is then findable from the host through /proc/<pid>/cmdline. */
export function uniqueSleepSecs() {
  return 100000 + crypto.randomInt(0, 800000);
}

/* The store of this test file's ns servers: made on first use, removed
 * when the file's process exits. */
let nsStoreDir = null;
function nsStore() {
  if (!nsStoreDir) {
    nsStoreDir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-ns-store-'));
    fs.chmodSync(nsStoreDir, 0o755);
    process.on('exit', () => fs.rmSync(nsStoreDir, { recursive: true, force: true }));
  }
  return nsStoreDir;
}

/* The run logs of this test file's servers (IGN_MCP_LOG_DIR), removed at exit. */
let logDirPath = null;
export function logDir() {
  if (!logDirPath) {
    const top = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-logs-'));
    logDirPath = path.join(top, 'logs');
    process.on('exit', () => fs.rmSync(top, { recursive: true, force: true }));
  }
  return logDirPath;
}

export function serverEnv({ env = {}, tools = false } = {}) {
  const e = { ...process.env };
  // The runner may export the server knobs for its own reasons; start clean.
  for (const k of Object.keys(e)) if (k.startsWith('IGN_MCP_')) delete e[k];
  e.IGN_MCP_BACKEND = BACKEND;
  e.IGN_MCP_ROOTFS = tools ? ROOTFS_TOOLS_NAME : ROOTFS_SMALL_NAME;
  // The runner gives the vm pass a store of its own (warm bases); an ns
  // server gets one per test file (stages), never the user's own.
  if (IS_VM && VM_STORE) e.IGN_MCP_STORE = VM_STORE;
  // IGN_TEST_QEMU: another QEMU than the one on PATH (give it an
  // IGN_TEST_VM_STORE of its own: a base is made for one QEMU).
  if (IS_VM && process.env.IGN_TEST_QEMU) e.IGN_MCP_QEMU = process.env.IGN_TEST_QEMU;
  if (IS_NS) e.IGN_MCP_STORE = nsStore();
  // Run logs go to a directory of the test file's own, never the user's.
  e.IGN_MCP_LOG_DIR = logDir();
  if (fs.existsSync(AGENT)) e.IGN_MCP_AGENT = AGENT;
  if (!e.ASAN_OPTIONS) e.ASAN_OPTIONS = 'abort_on_error=0:detect_leaks=1';
  // A server that ends closes its sessions, unless a test asks for them to
  // be hibernated and kept on the (shared) store.
  e.IGN_MCP_SHUTDOWN_ACTION = 'close';
  for (const [k, v] of Object.entries(env)) {
    if (v === undefined || v === null) delete e[k];
    else e[k] = String(v);
  }
  return e;
}

/* A warm-base store of a test's own (for settings that are part of a
 * base's fingerprint, so that they do not replace the suite's bases):
 * {dir, remove()}. The QEMUs run as other uids and must reach it. */
export function tempStore(prefix = 'e2e-store') {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), `${prefix}-`));
  fs.chmodSync(dir, 0o755);
  return { dir, remove: () => fs.rmSync(dir, { recursive: true, force: true }) };
}

/* A guest kernel of the test's own, which it may change or replace: a copy
 * of the VM's kernel, or CONTENT (a Buffer) when given, in a directory QEMU's
 * uid can read; removed after the test T. */
export function tempKernel(t, content) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-kernel-'));
  fs.chmodSync(dir, 0o755);
  t.after(() => fs.rmSync(dir, { recursive: true, force: true }));
  const kernel = path.join(dir, 'vmlinux');
  if (content) fs.writeFileSync(kernel, content);
  else fs.copyFileSync(path.join(VM_DIR, 'vmlinux'), kernel);
  fs.chmodSync(kernel, 0o644);
  return kernel;
}

// ---------------------------------------------------------------- QEMUs

/* Every live QEMU on the host (comm qemu-system-x86), each as {pid, start,
 * log, serverPid}: log is what its stdout is (the vm backend points it at
 * <state dir>/qemu.log), serverPid the pid of the server that started it, read
 * from that path (<pid>-<n> for clones, <base>.tmp-<pid> for a golden VM), or
 * null when it is not one of ours. Other people's QEMUs are left alone. */
export function qemuProcs() {
  const out = [];
  for (const d of fs.readdirSync('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    let comm;
    try {
      comm = fs.readFileSync(`/proc/${d}/comm`, 'utf8').trim();
    } catch {
      continue;
    }
    if (!comm.startsWith('qemu-system')) continue;
    const st = procStart(d);
    if (!st || st.state === 'Z') continue;
    let log = null;
    try {
      log = fs.readlinkSync(`/proc/${d}/fd/1`);
    } catch {}
    const m = log && (log.match(/\/(\d+)-\d+\/qemu\.log/) || log.match(/\.tmp-(\d+)\/qemu\.log/));
    out.push({ pid: Number(d), start: st.start, log, serverPid: m ? Number(m[1]) : null });
  }
  return out;
}

/* The QEMUs started by the server with this pid (alive, whoever their parent
 * is now). */
export function qemusOf(serverPid) {
  return qemuProcs().filter((q) => q.serverPid === serverPid);
}

/* The QEMUs among the server's descendants (what its sessions, pool and
 * spares run on). */
export function qemuChildren(serverPid) {
  return descendants(serverPid).filter((d) => {
    try {
      return fs.readFileSync(`/proc/${d.pid}/comm`, 'utf8').trim().startsWith('qemu-system');
    } catch {
      return false;
    }
  });
}

/* The state directories <VM_RUN_DIR>/<serverPid>-<n> that exist. */
export function vmStateDirs(serverPid) {
  try {
    return fs.readdirSync(VM_RUN_DIR).filter((n) => n.startsWith(`${serverPid}-`)).map((n) => path.join(VM_RUN_DIR, n)).sort();
  } catch {
    return [];
  }
}

/* After a vm server has gone: wait up to timeoutMs for every QEMU it started
 * to be gone; kill what is left and fail naming it. With dirs, also fail
 * when its state directories are still there (a server that shut down
 * cleanly removes them; one that was SIGKILLed cannot). */
export async function assertNoVmLeftovers(serverPid, { dirs = true, timeoutMs = 5000, what = `server ${serverPid}` } = {}) {
  if (!IS_VM || !serverPid) return;
  await waitUntil(() => qemusOf(serverPid).length === 0, { timeoutMs });
  const left = qemusOf(serverPid);
  for (const q of left) {
    try {
      process.kill(q.pid, 'SIGKILL');
    } catch {}
  }
  assert.deepEqual(left.map((q) => `${q.pid} ${q.log}`), [], `${what}: QEMUs outlived it`);
  if (dirs) {
    const d = await waitUntil(() => vmStateDirs(serverPid).length === 0, { timeoutMs: 500 });
    assert.ok(d, `${what}: state directories left behind: ${vmStateDirs(serverPid).join(' ')}`);
  }
}

// ---------------------------------------------------------------- safety net

/* Every server started through this file, until it is closed. A test that
 * fails or times out before its cleanup ran would otherwise leave a server
 * whose pipes keep this test file's process (and the whole run) alive. */
const live = new Map();

function track(pid, destroy) {
  if (pid) live.set(pid, destroy);
}

function untrack(pid) {
  live.delete(pid);
}

function reapAll() {
  for (const [pid, destroy] of live) {
    hardKill(pid);
    try {
      destroy();
    } catch {}
  }
  live.clear();
  for (const f of [...fences]) removeFence(f);
}

// Runs after every test of the importing file, even ones that timed out.
after(reapAll);
process.on('exit', reapAll);

// ---------------------------------------------------------------- processes

/* /proc/<pid>/stat field 22: start time, to tell a pid from a reused one. */
export function procStart(pid) {
  try {
    const s = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
    const rest = s.slice(s.lastIndexOf(')') + 2).split(' ');
    return { state: rest[0], start: rest[19] };
  } catch {
    return null;
  }
}

export function procCmdline(pid) {
  try {
    return fs.readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').filter(Boolean).join(' ');
  } catch {
    return null;
  }
}

/* All descendants of pid (children of every thread, recursively), each as
 * {pid, start, cmd}; zombies are left out (they hold nothing but a pid). */
export function descendants(pid) {
  const out = new Map();
  const stack = [pid];
  while (stack.length) {
    const p = stack.pop();
    let tasks;
    try {
      tasks = fs.readdirSync(`/proc/${p}/task`);
    } catch {
      continue;
    }
    for (const t of tasks) {
      let ch;
      try {
        ch = fs.readFileSync(`/proc/${p}/task/${t}/children`, 'utf8');
      } catch {
        continue;
      }
      for (const c of ch.trim().split(/\s+/).filter(Boolean)) {
        const n = Number(c);
        if (out.has(n)) continue;
        const st = procStart(n);
        if (!st) continue;
        out.set(n, { pid: n, start: st.start, state: st.state, cmd: procCmdline(n) });
        stack.push(n);
      }
    }
  }
  return [...out.values()].filter((d) => d.state !== 'Z');
}

/* Is the recorded process (same pid, same start time) still alive? */
export function isAlive(rec) {
  const st = procStart(rec.pid);
  return !!st && st.start === rec.start && st.state !== 'Z';
}

export function survivors(recs) {
  return recs.filter(isAlive);
}

export async function waitGone(recs, timeoutMs = 5000) {
  await waitUntil(() => survivors(recs).length === 0, { timeoutMs });
  return survivors(recs);
}

/* Every live process on the host whose argv equals the given words, e.g.
 * findProcs(['sleep', '123456']). Matches by the argv tail so busybox
 * ("sleep") and coreutils ("/usr/bin/sleep") both count. */
export function findProcs(words) {
  const hits = [];
  for (const d of fs.readdirSync('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    let argv;
    try {
      argv = fs.readFileSync(`/proc/${d}/cmdline`, 'utf8').split('\0').filter(Boolean);
    } catch {
      continue;
    }
    if (argv.length !== words.length) continue;
    const ok = words.every((w, i) => (i === 0 ? path.basename(argv[0]) === w : argv[i] === w));
    const st = procStart(d);
    if (ok && st && st.state !== 'Z') hits.push(Number(d));
  }
  return hits;
}

export function vmRssKiB(pid, field = 'VmRSS') {
  const s = fs.readFileSync(`/proc/${pid}/status`, 'utf8');
  const m = s.match(new RegExp(`^${field}:\\s+(\\d+) kB`, 'm'));
  return m ? Number(m[1]) : NaN;
}

/* Entries the server might leave behind: names containing "ign" in /tmp,
 * and cgroup directories named ign* anywhere under /sys/fs/cgroup. */
export function tmpIgnEntries() {
  try {
    return fs.readdirSync('/tmp').filter((n) => n.toLowerCase().includes('ign')).sort();
  } catch {
    return [];
  }
}

export function cgroupIgnDirs() {
  const out = [];
  const walk = (dir, depth) => {
    if (depth > 12) return;
    let ents;
    try {
      ents = fs.readdirSync(dir, { withFileTypes: true });
    } catch {
      return;
    }
    for (const e of ents) {
      if (!e.isDirectory()) continue;
      const p = path.join(dir, e.name);
      if (e.name.startsWith('ign')) out.push(p);
      walk(p, depth + 1);
    }
  };
  walk('/sys/fs/cgroup', 0);
  return out.sort();
}

export function leftovers() {
  return { tmp: tmpIgnEntries(), cgroups: cgroupIgnDirs() };
}

/* Could a server started by this process have made the entry at P?  It
 * makes files and cgroups as its uid (this process's), and as root also as
 * the uids of its sandboxes' and QEMUs' blocks (IGN_MCP_NS_UID_BASE, at
 * least 65536, and VM_UID_BASE): what another ordinary user made (a user
 * pass beside a root one), or root made when this is a user (a root pass
 * beside a user one, whose servers' pids this one's pid namespace hides),
 * is not. */
function ownersMayHaveMade(p) {
  let st;
  try {
    st = fs.lstatSync(p);
  } catch {
    return true;
  }
  const me = process.getuid();
  return st.uid === me || (me === 0 && st.uid >= 65536);
}

/* Is `name` (in /tmp, or a cgroup's path) plausibly someone else's? The
 * machine may be shared with other test runs: the runner's own log
 * directory (ign-tests.*), what another uid made, and cgroups whose name
 * carries the pid of another live server are not ours. */
function foreign(name) {
  const base = path.basename(name);
  if (base.startsWith('ign-tests.')) return true;
  // The unit tests' directories (tests/unit/test.h test_mkdtemp: NAME-XXXXXX,
  // a name the server never makes), which a run beside this one may leave
  // in /tmp for a moment.
  if (/^(ign-tree-test|ign-agent-test|ign-test-agent|ign-test-stage|ign-test-vm-snap|ign-agent-ns)-[A-Za-z0-9]{6}$/.test(base)) return true;
  if (!ownersMayHaveMade(path.isAbsolute(name) ? name : path.join('/tmp', name))) return true;
  for (const m of base.matchAll(/\d{2,}/g)) {
    const pid = Number(m[0]);
    if (pid === process.pid || live.has(pid)) continue;
    const cmd = procCmdline(pid);
    if (cmd && /ignition-mcp|ign-agent|test_/.test(cmd)) return true;
  }
  return false;
}

export function newLeftovers(before) {
  const now = leftovers();
  return {
    tmp: now.tmp.filter((x) => !before.tmp.includes(x) && !foreign(x)),
    cgroups: now.cgroups.filter((x) => !before.cgroups.includes(x) && !foreign(x)),
  };
}

const SANITIZER_RE = /ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|SUMMARY: UndefinedBehaviorSanitizer/;

export function assertNoSanitizerReport(stderr, what = 'server') {
  const m = stderr.match(SANITIZER_RE);
  if (m) {
    const at = Math.max(0, m.index - 200);
    assert.fail(`${what} stderr has a sanitizer report:\n${stderr.slice(at, at + 4000)}`);
  }
}

function capAppend(buf, chunk, cap = 4 << 20) {
  buf += chunk;
  return buf.length > cap ? buf.slice(buf.length - cap) : buf;
}

// ---------------------------------------------------------------- fence

/* The second fence around the abusive tests (tests/fence.sh): the server in
 * a pid namespace of its own and in a pids+memory cgroup the test makes, so
 * that a containment bug fails a test instead of taking the machine down.
 * Its figures: at most FENCE_PIDS tasks, FENCE_MEMORY_MB of memory. */
export const FENCE_SCRIPT = path.join(REPO, 'tests/fence.sh');
export const FENCE_PIDS = 4096;
export const FENCE_MEMORY_MB = 6144;
const CG = '/sys/fs/cgroup';
let fenceSeq = 0;
const fences = new Set();

/* This process's (or process PID's) group of CONTROLLER ('' for the v2
 * line) as a path. */
function ownCgroup(controller, pid = 'self') {
  for (const line of fs.readFileSync(`/proc/${pid}/cgroup`, 'utf8').split('\n')) {
    const m = line.match(/^(\d+):([^:]*):(.*)$/);
    if (!m) continue;
    const p = m[3] === '/' ? '' : m[3];
    if (!controller && m[1] === '0' && m[2] === '') return `${CG}${p}`;
    if (controller && m[2].split(',').includes(controller)) return `${CG}/${controller}${p}`;
  }
  return null;
}

export const CGROUP_V2 = fs.existsSync(`${CG}/cgroup.controllers`);

/* Can a server started by this process give its ns sessions cgroups (root,
 * or a user with a delegated group)?  Without, their limits say "no cgroup":
 * pids by RLIMIT_NPROC, memory not enforced. */
function writableDir(d) {
  try {
    fs.accessSync(d, fs.constants.W_OK);
    return true;
  } catch {
    return false;
  }
}
export const SESSION_CGROUPS = process.getuid() === 0 ||
  (CGROUP_V2 ? writableDir(ownCgroup('') ?? '/nonexistent')
    : ['pids', 'memory'].every((c) => writableDir(ownCgroup(c) ?? '/nonexistent')));
export const NEEDS_CGROUPS = (why) => (SESSION_CGROUPS ? false : `needs cgroups for the sessions, which this user cannot make here (cgroup v1, or v2 without delegation): ${why}`);

/* The OOM kills of processes in the memory cgroup that holds process PID
 * (its subgroups included), by any OOM killer, the host's too: {dir, count};
 * null when PID is in the root memory group, where the host's count
 * (/proc/vmstat oom_kill) is the only one.  v2 counts a group's subtree in
 * its memory.events (a group without the memory controller is charged to
 * the nearest one above it); v1 counts each group alone, in
 * memory.oom_control, so the subtree is added up. */
export function oomKillsOf(pid) {
  const num = (file, key) => {
    try {
      const m = fs.readFileSync(file, 'utf8').match(new RegExp(`^${key} (\\d+)$`, 'm'));
      return m ? Number(m[1]) : null;
    } catch {
      return null;
    }
  };
  if (CGROUP_V2) {
    for (let d = ownCgroup('', pid); d && d.startsWith(`${CG}/`); d = path.dirname(d)) {
      const count = num(path.join(d, 'memory.events'), 'oom_kill');
      if (count !== null) return { dir: d, count };
    }
    return null;
  }
  const top = ownCgroup('memory', pid);
  if (!top || top === `${CG}/memory`) return null;
  let count = num(path.join(top, 'memory.oom_control'), 'oom_kill');
  if (count === null) return null;
  const walk = (d, depth) => {
    if (depth > 12) return;
    let ents = [];
    try {
      ents = fs.readdirSync(d, { withFileTypes: true });
    } catch {}
    for (const e of ents) {
      if (!e.isDirectory()) continue;
      count += num(path.join(d, e.name, 'memory.oom_control'), 'oom_kill') ?? 0;
      walk(path.join(d, e.name), depth + 1);
    }
  };
  walk(top, 0);
  return { dir: top, count };
}

/* Where fence NAME's groups will be (what tests/fence.sh makes): v1 one per
 * controller, v2 one (its processes in NAME/server). */
function fenceDirs(name) {
  if (CGROUP_V2) {
    const own = ownCgroup('');
    return [path.join(own, name), path.join(CG, name)];
  }
  return ['pids', 'memory'].map((c) => path.join(ownCgroup(c), name));
}

function newFence() {
  const name = `e2e-fence-${process.pid}-${++fenceSeq}`;
  const f = { name, candidates: fenceDirs(name), runDir: null, scriptPid: null };
  fences.add(f);
  return f;
}

/* The fence's cgroup directories that exist (v2: the one that was made). */
export function fenceCgroupDirs(f) {
  return f.candidates.filter((d) => fs.existsSync(d));
}

/* Every pid in the fence's cgroups (with their subgroups: ns sessions). */
export function fencePids(f) {
  const out = new Set();
  const walk = (d) => {
    try {
      for (const p of fs.readFileSync(path.join(d, 'cgroup.procs'), 'utf8').split('\n')) if (p) out.add(Number(p));
      for (const e of fs.readdirSync(d, { withFileTypes: true })) if (e.isDirectory()) walk(path.join(d, e.name));
    } catch {}
  };
  for (const d of fenceCgroupDirs(f)) walk(d);
  return [...out];
}

/* The fence's pids controller figures: {current, max, events (times the
 * limit refused a fork)}. */
export function fencePidsStat(f) {
  const d = fenceCgroupDirs(f).find((x) => fs.existsSync(path.join(x, 'pids.current')));
  if (!d) return null;
  const rd = (n) => {
    try {
      return fs.readFileSync(path.join(d, n), 'utf8').trim();
    } catch {
      return '';
    }
  };
  const ev = rd('pids.events').match(/max (\d+)/);
  return { dir: d, current: Number(rd('pids.current')), max: rd('pids.max'), events: ev ? Number(ev[1]) : 0 };
}

/* Last resort (the fence script was killed before its own cleanup): kill
 * what is left in the fence and remove its groups and run directory. */
function removeFence(f) {
  for (let i = 0; i < 50 && fenceCgroupDirs(f).length; i++) {
    for (const p of fencePids(f)) {
      try {
        process.kill(p, 'SIGKILL');
      } catch {}
    }
    for (const d of fenceCgroupDirs(f).sort((a, b) => b.length - a.length)) {
      try {
        for (const e of fs.readdirSync(d, { withFileTypes: true })) if (e.isDirectory()) fs.rmdirSync(path.join(d, e.name));
        fs.rmdirSync(d);
      } catch {}
    }
    if (fenceCgroupDirs(f).length) Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 20);
  }
  if (f.runDir) fs.rmSync(f.runDir, { recursive: true, force: true });
  fences.delete(f);
}

/* The server inside a fence: the fence script's descendant that is PID 1 of
 * its own pid namespace. */
function fencedServerPid(scriptPid) {
  for (const d of descendants(scriptPid)) {
    try {
      const st = fs.readFileSync(`/proc/${d.pid}/status`, 'utf8');
      const ns = (st.match(/^NSpid:\s*(.*)$/m) || [])[1]?.trim().split(/\s+/) ?? [];
      if (ns.length >= 2 && ns[ns.length - 1] === '1' && /ignition-mcp/.test(d.cmd ?? '')) return d.pid;
    } catch {}
  }
  return null;
}

// ---------------------------------------------------------------- SDK client

/* Start the server through the SDK.  Returns {client, transport, pid,
 * stderrText(), close()}. Options: env (extra/override variables; a value of
 * undefined removes one), tools (use the tools rootfs), listTools (fetch the
 * tool list so that the SDK validates every structuredContent against its
 * outputSchema; default true). */
/* With fence: true the server runs inside tests/fence.sh (see above); pid is
 * then the server's own pid on the host, and fence describes the fence. */
/* With launcher: [program, args...] the server is started as
 * `program args... SERVER` (a program that execs its last arguments). */
export async function startServer({ env = {}, tools = false, listTools = true, fence = false, launcher = null, cwd = REPO } = {}) {
  const f = fence ? newFence() : null;
  const wrap = !!f;
  const transport = new StdioClientTransport({
    command: wrap ? '/bin/bash' : launcher ? launcher[0] : SERVER,
    args: wrap ? [FENCE_SCRIPT, f.name, String(FENCE_PIDS), String(FENCE_MEMORY_MB), '--', SERVER] : launcher ? [...launcher.slice(1), SERVER] : [],
    env: serverEnv({ env, tools }),
    stderr: 'pipe',
    cwd,
  });
  let stderr = '';
  transport.stderr.on('data', (d) => {
    stderr = capAppend(stderr, d.toString('utf8'));
  });
  const client = new Client({ name: 'ign-e2e', version: '0.0.1' }, { capabilities: {} });
  /* The SDK reports unparsable stdout lines and protocol violations here. */
  const protocolErrors = [];
  /* Not the server's: the SDK dispatches notifications a microtask later than
   * responses, so a progress notification sent just before its call's result
   * can be handled after it, when the token is already forgotten. */
  const sdkRace = /^Received a progress notification for an unknown token/;
  client.onerror = (e) => {
    const m = String(e?.message ?? e);
    if (!sdkRace.test(m)) protocolErrors.push(m);
  };
  try {
    await client.connect(transport);
  } catch (e) {
    await transport.close().catch(() => {});
    throw new Error(`could not start ${SERVER}: ${e.message}\nstderr:\n${stderr}`);
  }
  let pid = transport.pid;
  if (wrap) {
    f.scriptPid = transport.pid;
    f.runDir = path.join(VM_RUN_DIR, `fence-${f.scriptPid}`);
    pid = fencedServerPid(f.scriptPid);
    assert.ok(pid, `no fenced server under ${f.scriptPid}: ${JSON.stringify(descendants(f.scriptPid))}`);
  }
  track(pid, () => transport.close().catch(() => {}));
  if (listTools) await client.listTools();
  let closed = false;
  return {
    client,
    transport,
    pid,
    fence: f,
    stderrText: () => stderr,
    /* Close stdin, let the SDK escalate to SIGTERM/SIGKILL if needed, then
     * verify that no descendant of the server survives and that the
     * sanitizers stayed quiet. Throws (failing the test) otherwise. */
    async close({ checkOrphans = true } = {}) {
      if (closed) return;
      closed = true;
      const kids = pid ? descendants(pid) : [];
      await client.close().catch(() => {});
      await waitUntil(() => !procStart(pid) || procStart(pid).state === 'Z', { timeoutMs: 6000 });
      untrack(pid);
      if (f) {
        // The fence script reports what the server left in its run directory
        // or its cgroup, then removes the fence.
        const gone = await waitUntil(() => !procStart(f.scriptPid) || procStart(f.scriptPid).state === 'Z', { timeoutMs: 6000 });
        const left = fenceCgroupDirs(f);
        const runLeft = fs.existsSync(f.runDir);
        removeFence(f);
        assert.ok(gone, `the fence script ${f.scriptPid} outlived its server`);
        assert.deepEqual(left, [], 'the fence cgroup outlived the test');
        assert.equal(runLeft, false, `the fence run directory ${f.runDir} outlived the test`);
        const m = stderr.match(/^fence: .*$/m);
        assert.equal(m, null, `the fence says: ${m?.[0]}`);
      }
      if (checkOrphans) {
        const left = await waitGone(kids, 5000);
        for (const l of left) {
          try {
            process.kill(l.pid, 'SIGKILL');
          } catch {}
        }
        assert.deepEqual(
          left.map((l) => `${l.pid} ${l.cmd}`),
          [],
          'processes started by the server outlived it',
        );
        // Also QEMUs that were still being started when it shut down.
        await assertNoVmLeftovers(pid);
      }
      assertNoSanitizerReport(stderr);
      assert.deepEqual(protocolErrors, [], 'the SDK client saw protocol errors');
    },
  };
}

export function textOf(res) {
  return (res?.content ?? [])
    .filter((c) => c.type === 'text')
    .map((c) => c.text)
    .join('\n');
}

/* Call a tool, assert it succeeded and return its structuredContent. */
export async function call(client, name, args = {}, opts = {}) {
  const res = await client.callTool({ name, arguments: args }, undefined, { timeout: 120000, ...opts });
  assert.equal(res.isError ?? false, false, `${name}(${JSON.stringify(args).slice(0, 300)}) failed: ${textOf(res)}`);
  assert.ok(res.structuredContent && typeof res.structuredContent === 'object', `${name}: no structuredContent`);
  return res.structuredContent;
}

/* Call a tool that must fail as a tool error; return the error text. */
export async function callErr(client, name, args = {}, opts = {}) {
  const res = await client.callTool({ name, arguments: args }, undefined, { timeout: 120000, ...opts });
  assert.equal(
    res.isError,
    true,
    `${name}(${JSON.stringify(args).slice(0, 300)}) should fail but returned ${JSON.stringify(res).slice(0, 500)}`,
  );
  const t = textOf(res);
  assert.ok(t.length > 0, `${name}: error result without a text message`);
  return t;
}

export async function openSession(client) {
  const s = await call(client, 'open_session', {});
  assert.equal(typeof s.session_id, 'string');
  assert.ok(s.session_id.length > 0);
  return s.session_id;
}

export function run(client, session_id, command, extra = {}, opts = {}) {
  return call(client, 'run', { session_id, command, ...extra }, opts);
}

/* Run a command that must succeed (exit 0); return its stdout. */
export async function sh(client, session_id, command, extra = {}) {
  const r = await run(client, session_id, command, extra);
  assert.equal(r.exit_code, 0, `\`${command}\` exited ${r.exit_code}: stdout=${r.stdout} stderr=${r.stderr}`);
  return r.stdout;
}

export async function writeFile(client, session_id, p, data, extra = {}) {
  const buf = Buffer.isBuffer(data) ? data : Buffer.from(data);
  return call(client, 'write_file', { session_id, path: p, content_base64: buf.toString('base64'), ...extra });
}

/* Read a whole file through read_file, chunk by chunk. */
export async function readWhole(client, session_id, p, chunk = 1 << 20) {
  const parts = [];
  let offset = 0;
  for (let i = 0; i < 10000; i++) {
    const r = await call(client, 'read_file', { session_id, path: p, offset, max_bytes: chunk });
    const b = Buffer.from(r.content_base64, 'base64');
    assert.equal(b.length, r.bytes, 'read_file: bytes does not match the decoded content');
    parts.push(b);
    offset += b.length;
    if (r.eof) return Buffer.concat(parts);
    assert.ok(b.length > 0, 'read_file: no progress and no eof');
  }
  throw new Error('read_file: too many chunks');
}

export const sha256 = (b) => crypto.createHash('sha256').update(b).digest('hex');

// ---------------------------------------------------------------- raw client

/* Spawn the server with plain pipes. send()/sendLine()/sendBytes() write
 * anything; responses are parsed per line from stdout. Every stdout line must
 * be valid UTF-8 JSON-RPC 2.0 (recorded in badLines otherwise). */
export function startRaw({ env = {}, tools = false, extraStdio = [] } = {}) {
  const child = spawn(SERVER, [], {
    env: serverEnv({ env, tools }),
    // extraStdio: more fds for the server to inherit (3, 4, ...).
    stdio: ['pipe', 'pipe', 'pipe', ...extraStdio],
    cwd: REPO,
  });
  track(child.pid, () => {
    child.stdin.destroy();
    child.stdout.destroy();
    child.stderr.destroy();
  });
  const messages = [];
  const badLines = [];
  const waiters = new Set();
  let stderr = '';
  let pending = Buffer.alloc(0);
  let exited = null;
  const exitPromise = new Promise((resolve) => {
    child.on('exit', (code, signal) => {
      exited = { code, signal };
      untrack(child.pid);
      resolve(exited);
      for (const w of [...waiters]) w();
    });
  });
  child.on('error', (e) => {
    stderr += `\n[spawn error] ${e.message}`;
  });
  child.stdin.on('error', () => {});
  child.stderr.on('data', (d) => {
    stderr = capAppend(stderr, d.toString('utf8'));
  });
  const utf8 = new TextDecoder('utf-8', { fatal: true });
  child.stdout.on('data', (d) => {
    pending = Buffer.concat([pending, d]);
    let nl;
    while ((nl = pending.indexOf(10)) >= 0) {
      const lineBuf = pending.subarray(0, nl);
      pending = pending.subarray(nl + 1);
      let line;
      try {
        line = utf8.decode(lineBuf);
      } catch {
        badLines.push({ why: 'invalid UTF-8', line: lineBuf.toString('latin1').slice(0, 300) });
        continue;
      }
      if (line.trim() === '') continue;
      let msg;
      try {
        msg = JSON.parse(line);
      } catch {
        badLines.push({ why: 'not JSON', line: line.slice(0, 300) });
        continue;
      }
      if (!msg || typeof msg !== 'object' || Array.isArray(msg) || msg.jsonrpc !== '2.0') {
        badLines.push({ why: 'not a JSON-RPC 2.0 message', line: line.slice(0, 300) });
      }
      messages.push({ msg, raw: line, at: Date.now() });
      for (const w of [...waiters]) w();
    }
  });

  let nextId = 1000;
  let seen = 0;

  const raw = {
    child,
    pid: child.pid,
    messages,
    badLines,
    stderrText: () => stderr,
    exited: () => exited,
    exitPromise,
    sendBytes(buf) {
      return new Promise((resolve, reject) => {
        if (exited || !child.stdin.writable) return reject(new Error(`server stdin closed (exit ${JSON.stringify(exited)})`));
        if (child.stdin.write(buf)) return resolve();
        const done = (err) => {
          child.stdin.off('drain', onDrain);
          child.off('exit', onExit);
          if (err) reject(err);
          else resolve();
        };
        const onDrain = () => done();
        const onExit = () => done(new Error('server exited while we were writing'));
        child.stdin.on('drain', onDrain);
        child.on('exit', onExit);
      });
    },
    sendLine(str) {
      return raw.sendBytes(Buffer.from(str + '\n'));
    },
    send(obj) {
      return raw.sendLine(JSON.stringify(obj));
    },
    /* Wait for the first message (from index `from` on) matching pred. */
    waitFor(pred, { timeoutMs = 10000, from = 0, what = 'message' } = {}) {
      return new Promise((resolve, reject) => {
        let timer;
        const check = () => {
          for (let i = from; i < messages.length; i++) {
            if (pred(messages[i].msg)) {
              waiters.delete(check);
              clearTimeout(timer);
              resolve(messages[i].msg);
              return true;
            }
          }
          if (exited) {
            waiters.delete(check);
            clearTimeout(timer);
            reject(new Error(`server exited (${JSON.stringify(exited)}) while waiting for ${what}; stderr:\n${stderr.slice(-3000)}`));
            return true;
          }
          return false;
        };
        if (check()) return;
        waiters.add(check);
        timer = setTimeout(() => {
          waiters.delete(check);
          reject(new Error(`timed out after ${timeoutMs} ms waiting for ${what}; got ${JSON.stringify(messages.slice(from).map((m) => m.msg)).slice(0, 1500)}`));
        }, timeoutMs);
      });
    },
    response(id, opts = {}) {
      return raw.waitFor((m) => 'id' in m && m.id === id && ('result' in m || 'error' in m), { what: `response to id ${JSON.stringify(id)}`, ...opts });
    },
    /* Send a request and wait for its response. */
    async request(method, params, { id, timeoutMs = 10000 } = {}) {
      if (id === undefined) id = nextId++;
      const from = messages.length;
      const msg = { jsonrpc: '2.0', id, method };
      if (params !== undefined) msg.params = params;
      await raw.send(msg);
      return raw.response(id, { timeoutMs, from });
    },
    notify(method, params) {
      const msg = { jsonrpc: '2.0', method };
      if (params !== undefined) msg.params = params;
      return raw.send(msg);
    },
    async initialize(protocolVersion = '2025-11-25') {
      const r = await raw.request('initialize', {
        protocolVersion,
        capabilities: {},
        clientInfo: { name: 'ign-e2e-raw', version: '0.0.1' },
      });
      assert.ok(r.result, `initialize failed: ${JSON.stringify(r)}`);
      await raw.notify('notifications/initialized');
      return r.result;
    },
    /* tools/call through the raw channel; returns the JSON-RPC response. */
    callTool(name, args, opts = {}) {
      return raw.request('tools/call', { name, arguments: args, ...(opts.params ?? {}) }, opts);
    },
    async tool(name, args, opts = {}) {
      const r = await raw.callTool(name, args, opts);
      assert.ok(r.result, `${name}: ${JSON.stringify(r.error)}`);
      assert.notEqual(r.result.isError, true, `${name} failed: ${textOf(r.result)}`);
      return r.result.structuredContent;
    },
    /* Messages received since index `from`. */
    since(from) {
      return messages.slice(from).map((m) => m.msg);
    },
    mark() {
      seen = messages.length;
      return seen;
    },
    endStdin() {
      child.stdin.end();
    },
    async waitExit(timeoutMs = 10000) {
      let t;
      const r = await Promise.race([exitPromise, new Promise((res) => (t = setTimeout(() => res(null), timeoutMs)))]);
      clearTimeout(t);
      return r;
    },
    /* Shut down (EOF, then SIGTERM, then SIGKILL), check orphans, stdout
     * hygiene and sanitizer output. */
    async close({ checkOrphans = true, checkStdout = true } = {}) {
      const kids = exited ? [] : descendants(child.pid);
      if (!exited) {
        child.stdin.end();
        if (!(await raw.waitExit(5000))) {
          child.kill('SIGTERM');
          if (!(await raw.waitExit(3000))) {
            child.kill('SIGKILL');
            await raw.waitExit(3000);
          }
        }
      }
      if (checkOrphans) {
        const left = await waitGone(kids, 5000);
        for (const l of left) {
          try {
            process.kill(l.pid, 'SIGKILL');
          } catch {}
        }
        assert.deepEqual(left.map((l) => `${l.pid} ${l.cmd}`), [], 'processes started by the server outlived it');
        // Also QEMUs that were still being started when it shut down; its
        // state directories only when it could clean up (not SIGKILLed).
        await assertNoVmLeftovers(child.pid, { dirs: exited?.signal !== 'SIGKILL' });
      }
      if (checkStdout) assert.deepEqual(badLines, [], 'server wrote something other than JSON-RPC to stdout');
      assertNoSanitizerReport(stderr);
    },
  };
  return raw;
}

/* Kill a raw or SDK server without checks: last-resort cleanup. */
export function hardKill(pid) {
  if (!pid) return;
  for (const d of descendants(pid)) {
    try {
      process.kill(d.pid, 'SIGKILL');
    } catch {}
  }
  try {
    process.kill(pid, 'SIGKILL');
  } catch {}
  // QEMUs of a server that is already gone are no longer its descendants.
  for (const q of qemuProcs()) {
    if (q.serverPid !== pid) continue;
    try {
      process.kill(q.pid, 'SIGKILL');
    } catch {}
  }
}
