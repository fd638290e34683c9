// lib.mjs: what the benchmark sections share: paths, progress lines,
// statistics, process bookkeeping (so that nothing outlives the harness),
// memory accounting from /proc, the C helper (build/ign-bench), and two
// MCP clients for the real server: the official SDK over stdio, and a raw
// newline-JSON-RPC client that shows what the SDK itself costs.

import { spawn, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import http from 'node:http';
import path from 'node:path';
import readline from 'node:readline';
import { fileURLToPath, pathToFileURL } from 'node:url';

export const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
export const BUILD = path.resolve(REPO, process.env.BUILD || 'build');
export const SERVER = path.join(BUILD, 'ignition-mcp');
export const AGENT = path.join(BUILD, 'ign-agent');
export const CBENCH = path.join(BUILD, 'ign-bench');
export const VM_DIR = path.join(BUILD, 'vm');

// ---------------------------------------------------------------- progress

const t0 = Date.now();
let sectionTag = '';
export function setSection(tag) {
  sectionTag = tag;
}
export function log(msg) {
  const s = ((Date.now() - t0) / 1000).toFixed(0).padStart(4);
  process.stderr.write(`[bench ${s}s]${sectionTag ? ` ${sectionTag}:` : ''} ${msg}\n`);
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
export const nowNs = () => process.hrtime.bigint();
export const msSince = (t) => Number(process.hrtime.bigint() - t) / 1e6;

// ---------------------------------------------------------------- statistics

/* Nearest-rank percentile of an already sorted array. */
function rank(sorted, p) {
  if (!sorted.length) return NaN;
  const i = Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1));
  return sorted[i];
}

/* median, p90 and p99 of samples. For a measure where higher is better
 * (MB/s, runs/s) the tail percentiles are taken from the low end, so p90
 * and p99 always name the slow tail. */
export function stats(samples, { higherIsBetter = false } = {}) {
  const s = [...samples].sort((a, b) => a - b);
  const tail = (p) => (higherIsBetter ? rank(s, 100 - p) : rank(s, p));
  return { n: s.length, median: rank(s, 50), p90: tail(90), p99: tail(99), min: s[0], max: s[s.length - 1] };
}

// ---------------------------------------------------------------- processes

/* Every process the harness starts is registered here until it is reaped;
 * the exit handlers kill what is left (with its descendants). */
const live = new Map(); // pid -> description

export function track(pid, what) {
  if (pid) live.set(pid, what);
}
export function untrack(pid) {
  live.delete(pid);
}

export function procStat(pid) {
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
    return fs.readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').filter(Boolean);
  } catch {
    return [];
  }
}

/* All live descendants of pid (children of every thread, recursively). */
export function descendants(pid) {
  const out = [];
  const seen = new Set();
  const stack = [pid];
  while (stack.length) {
    const p = stack.pop();
    let tasks = [];
    try {
      tasks = fs.readdirSync(`/proc/${p}/task`);
    } catch {}
    for (const t of tasks) {
      let ch = '';
      try {
        ch = fs.readFileSync(`/proc/${p}/task/${t}/children`, 'utf8');
      } catch {}
      for (const c of ch.trim().split(/\s+/).filter(Boolean)) {
        const n = Number(c);
        if (seen.has(n)) continue;
        seen.add(n);
        const st = procStat(n);
        if (!st || st.state === 'Z') continue;
        out.push({ pid: n, start: st.start, cmd: procCmdline(n) });
        stack.push(n);
      }
    }
  }
  return out;
}

function alive(rec) {
  const st = procStat(rec.pid);
  return !!st && st.start === rec.start && st.state !== 'Z';
}

/* SIGKILL pid and its whole tree. */
export function killTree(pid) {
  const kids = descendants(pid);
  for (const p of [pid, ...kids.map((k) => k.pid)]) {
    try {
      process.kill(p, 'SIGKILL');
    } catch {}
  }
}

/* Wait until the recorded processes are gone; SIGKILL the stragglers.
 * Returns the ones that had to be killed. */
export async function reapRecords(recs, timeoutMs = 5000) {
  const deadline = Date.now() + timeoutMs;
  while (recs.some(alive) && Date.now() < deadline) await sleep(50);
  const left = recs.filter(alive);
  for (const l of left) {
    try {
      process.kill(l.pid, 'SIGKILL');
    } catch {}
  }
  return left;
}

/* Synchronous, for the exit handlers: SIGTERM first (the server and
 * ign-bench then close their sandboxes and remove their cgroups), up to 3 s
 * for that, then SIGKILL for whatever is left. */
function killAll() {
  if (!live.size) return;
  for (const pid of live.keys()) {
    try {
      process.kill(pid, 'SIGTERM');
    } catch {}
  }
  const nap = new Int32Array(new SharedArrayBuffer(4));
  const deadline = Date.now() + 3000;
  const running = () => [...live.keys()].some((p) => {
    const st = procStat(p);
    return st && st.state !== 'Z';
  });
  while (running() && Date.now() < deadline) Atomics.wait(nap, 0, 0, 20);
  for (const pid of live.keys()) killTree(pid);
  live.clear();
}
process.on('exit', killAll);
// Progress goes to stderr; a reader that went away must not kill the run
// half-way (and leave sandboxes behind).
process.stderr.on('error', () => {});
for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP']) {
  process.on(sig, () => {
    log(`${sig}: stopping every server and sandbox the harness started`);
    killAll();
    process.exit(130);
  });
}

/* Run a command to completion, tracked; resolves {code, signal, stdout, stderr}. */
export function runChild(cmd, args, { env, cwd, input, echoStderr = false } = {}) {
  return new Promise((resolve) => {
    const child = spawn(cmd, args, { env: env ?? process.env, cwd, stdio: ['pipe', 'pipe', 'pipe'] });
    track(child.pid, cmd);
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => (stdout += d));
    child.stderr.on('data', (d) => {
      stderr += d;
      if (echoStderr) process.stderr.write(d);
    });
    child.on('error', (e) => {
      untrack(child.pid);
      resolve({ code: -1, signal: null, stdout, stderr: stderr + String(e.message) });
    });
    child.on('close', (code, signal) => {
      untrack(child.pid);
      resolve({ code, signal, stdout, stderr });
    });
    child.stdin.end(input ?? '');
  });
}

// ---------------------------------------------------------------- memory

/* Proportional set size of one process in KiB (0 if it is gone). */
export function pssKiB(pid) {
  try {
    const s = fs.readFileSync(`/proc/${pid}/smaps_rollup`, 'utf8');
    const m = s.match(/^Pss:\s+(\d+) kB/m);
    return m ? Number(m[1]) : 0;
  } catch {
    return 0;
  }
}

/* What the memory cgroup of pid is charged, in KiB, or null when pid sits in
 * the same memory cgroup as this harness (then the charge is not its own). */
export function cgroupChargeKiB(pid) {
  const groupOf = (p) => {
    try {
      let v2 = null;
      for (const line of fs.readFileSync(`/proc/${p}/cgroup`, 'utf8').trim().split('\n')) {
        const [, ctrls, rel] = line.split(':');
        if (ctrls.split(',').includes('memory')) return { v2: false, rel };
        if (ctrls === '') v2 = { v2: true, rel };
      }
      return v2;
    } catch {
      return null;
    }
  };
  const g = groupOf(pid);
  const mine = groupOf(process.pid);
  if (!g || (mine && g.rel === mine.rel)) return null;
  const file = g.v2
    ? path.join('/sys/fs/cgroup', g.rel, 'memory.current')
    : path.join('/sys/fs/cgroup/memory', g.rel, 'memory.usage_in_bytes');
  try {
    return Number(fs.readFileSync(file, 'utf8').trim()) / 1024;
  } catch {
    return null;
  }
}

// ---------------------------------------------------------------- C helper

/* Runs build/ign-bench with args; resolves its JSON, or {error}. */
export async function cbench(args, { env } = {}) {
  const r = await runChild(CBENCH, args.map(String), { env, echoStderr: true });
  const line = r.stdout.trim().split('\n').pop() || '';
  try {
    const j = JSON.parse(line);
    if (r.code !== 0 && !j.error) j.error = `ign-bench exited ${r.code}`;
    return j;
  } catch {
    return { error: `ign-bench ${args[0]} failed (exit ${r.code}): ${r.stderr.trim().split('\n').pop() || 'no output'}` };
  }
}

export const nsToMs = (a) => a.map((x) => x / 1e6);

/* build/ign-bench in a serving mode (spawn-serve, agent ... --serve): one
 * process that stays up; run(cmd) sends one command line and resolves the
 * nanoseconds the C side measured for it (the pipe round trip is outside
 * that time). close() ends it (EOF) and waits for it. */
export function cbenchServe(args, { env } = {}) {
  const child = spawn(CBENCH, args.map(String), { env: env ?? process.env, stdio: ['pipe', 'pipe', 'pipe'] });
  track(child.pid, 'ign-bench (serve)');
  let stderr = '';
  let exited = null;
  const waiting = [];
  const failAll = (why) => {
    while (waiting.length) waiting.shift().reject(new Error(why));
  };
  readline.createInterface({ input: child.stdout }).on('line', (line) => {
    let j;
    try {
      j = JSON.parse(line);
    } catch {
      return;
    }
    if (j.error) failAll(`ign-bench ${args[0]}: ${j.error}`);
    else if (typeof j.ns === 'number' && waiting.length) waiting.shift().resolve(j.ns);
  });
  child.stderr.on('data', (d) => (stderr = (stderr + d).slice(-4000)));
  const done = new Promise((resolve) => child.on('close', (code) => {
    untrack(child.pid);
    exited = code;
    failAll(`ign-bench ${args[0]} exited ${code}: ${stderr.trim().split('\n').pop() || 'no output'}`);
    resolve(code);
  }));
  child.on('error', (e) => failAll(String(e.message)));
  return {
    run(cmd) {
      if (exited !== null) return Promise.reject(new Error(`ign-bench ${args[0]} is not running (exit ${exited})`));
      return new Promise((resolve, reject) => {
        waiting.push({ resolve, reject });
        child.stdin.write(`${cmd}\n`);
      });
    },
    async close() {
      child.stdin.end();
      const t = setTimeout(() => child.kill('SIGTERM'), 30000);
      await done;
      clearTimeout(t);
    },
  };
}

// ---------------------------------------------------------------- environment

/* The server's environment: ours minus every IGN_MCP_* knob, then the
 * given ones (undefined removes). Logs stay at warning so that stderr
 * handling costs nothing measurable. */
export function serverEnv(extra = {}) {
  const e = { ...process.env };
  for (const k of Object.keys(e)) if (k.startsWith('IGN_MCP_')) delete e[k];
  e.IGN_MCP_LOG = 'warning';
  e.IGN_MCP_MAX_SESSIONS = '16';
  // Its sessions end with it (none left hibernated on the store).
  e.IGN_MCP_SHUTDOWN_ACTION = 'close';
  // BENCH_STORE: a store of warm bases other than the server's default
  // (a run that must not touch the user's).
  if (process.env.BENCH_STORE) e.IGN_MCP_STORE = process.env.BENCH_STORE;
  // BENCH_QEMU: the QEMU binary every server runs (IGN_MCP_QEMU), to measure
  // another QEMU than the one on PATH (give it a BENCH_STORE of its own).
  if (process.env.BENCH_QEMU) e.IGN_MCP_QEMU = process.env.BENCH_QEMU;
  for (const [k, v] of Object.entries(extra)) {
    if (v === undefined || v === null) delete e[k];
    else e[k] = String(v);
  }
  return e;
}

// ---------------------------------------------------------------- MCP: SDK

async function importSdk(sub) {
  const dir = path.join(REPO, 'tests/node_modules/@modelcontextprotocol/sdk');
  const pkg = JSON.parse(fs.readFileSync(path.join(dir, 'package.json'), 'utf8'));
  const exact = pkg.exports[sub];
  const target = exact ? exact.import : pkg.exports['./*'].import.replace('*', sub.slice(2));
  return import(pathToFileURL(path.join(dir, target)).href);
}

let sdk = null;
async function loadSdk() {
  if (!sdk) {
    const { Client } = await importSdk('./client/index.js');
    const { StdioClientTransport } = await importSdk('./client/stdio.js');
    sdk = { Client, StdioClientTransport };
  }
  return sdk;
}

export const CALL_TIMEOUT_MS = 600000;

export function textOf(res) {
  return (res?.content ?? []).filter((c) => c.type === 'text').map((c) => c.text).join('\n');
}

/* The real server behind the SDK's StdioClientTransport. */
export async function startServer(env) {
  const { Client, StdioClientTransport } = await loadSdk();
  const transport = new StdioClientTransport({ command: SERVER, args: [], env: serverEnv(env), stderr: 'pipe', cwd: REPO });
  let stderr = '';
  transport.stderr.on('data', (d) => {
    stderr = (stderr + d).slice(-20000);
  });
  const client = new Client({ name: 'ign-bench', version: '0.0.1' }, { capabilities: {} });
  await client.connect(transport);
  const pid = transport.pid;
  track(pid, 'ignition-mcp');
  await client.listTools();
  const srv = {
    client,
    pid,
    stderr: () => stderr,
    /* structuredContent, or throws with the tool's error text. */
    async tool(name, args = {}) {
      const res = await client.callTool({ name, arguments: args }, undefined, { timeout: CALL_TIMEOUT_MS });
      if (res.isError) {
        const e = new Error(textOf(res) || `${name} failed`);
        e.toolError = true;
        throw e;
      }
      return res.structuredContent;
    },
    async open() {
      return srv.tool('open_session');
    },
    async run(session_id, command, extra = {}) {
      const r = await srv.tool('run', { session_id, command, ...extra });
      if (r.exit_code !== 0) throw new Error(`\`${command}\` exited ${r.exit_code}: ${r.stderr.slice(0, 500)}`);
      return r;
    },
    /* Close stdin (the server closes its sessions and exits), then make sure
     * nothing it started survives. */
    async close() {
      const kids = descendants(pid);
      await client.close().catch(() => {});
      const me = { pid, start: procStat(pid)?.start };
      const left = await reapRecords(me.start ? [me, ...kids] : kids, 8000);
      untrack(pid);
      if (left.length) log(`warning: had to kill ${left.map((l) => `${l.pid} ${l.cmd.join(' ')}`).join('; ')}`);
    },
  };
  return srv;
}

// ---------------------------------------------------------------- MCP: raw

/* The same server driven by hand-written newline JSON-RPC: no SDK, no
 * schema validation; the difference to the SDK rows is the client's cost. */
export async function startRawServer(env) {
  const child = spawn(SERVER, [], { env: serverEnv(env), cwd: REPO, stdio: ['pipe', 'pipe', 'pipe'] });
  track(child.pid, 'ignition-mcp (raw)');
  child.stderr.resume();
  const waiting = new Map();
  let nextId = 1;
  /* Chunks of the current line; only each new chunk is searched for the
   * newline, so a 45 MB line costs linear time. */
  let parts = [];
  const deliver = (line) => {
    if (!line.trim()) return;
    const msg = JSON.parse(line);
    const w = waiting.get(msg.id);
    if (w) {
      waiting.delete(msg.id);
      w(msg);
    }
  };
  child.stdout.on('data', (d) => {
    let from = 0;
    let nl;
    while ((nl = d.indexOf(10, from)) >= 0) {
      parts.push(d.subarray(from, nl));
      deliver(Buffer.concat(parts).toString('utf8'));
      parts = [];
      from = nl + 1;
    }
    if (from < d.length) parts.push(d.subarray(from));
  });
  const exited = new Promise((r) => child.on('exit', r));
  const request = (method, params) =>
    new Promise((resolve, reject) => {
      const id = nextId++;
      waiting.set(id, (m) => (m.error ? reject(new Error(JSON.stringify(m.error))) : resolve(m.result)));
      child.stdin.write(JSON.stringify({ jsonrpc: '2.0', id, method, params }) + '\n');
    });
  await request('initialize', { protocolVersion: '2025-11-25', capabilities: {}, clientInfo: { name: 'ign-bench-raw', version: '0' } });
  child.stdin.write(JSON.stringify({ jsonrpc: '2.0', method: 'notifications/initialized' }) + '\n');
  const tool = async (name, args) => {
    const r = await request('tools/call', { name, arguments: args });
    if (r.isError) throw new Error(textOf(r));
    return r.structuredContent;
  };
  return {
    pid: child.pid,
    tool,
    request,
    async close() {
      const kids = descendants(child.pid);
      child.stdin.end();
      await Promise.race([exited, sleep(8000)]);
      await reapRecords(kids, 3000);
      killTree(child.pid);
      untrack(child.pid);
    },
  };
}

// ---------------------------------------------------------------- MCP: HTTP

/* The envelope of a 2026-07-28 request (stateless: on every request). */
export const MODERN_META = {
  'io.modelcontextprotocol/protocolVersion': '2026-07-28',
  'io.modelcontextprotocol/clientCapabilities': {},
  'io.modelcontextprotocol/clientInfo': { name: 'ign-bench', version: '0' },
};

/* The server on its Streamable HTTP transport (`--http 127.0.0.1:0`):
 * {pid, port, url, close()} once it says where it listens. */
export async function startHttpServer(env) {
  const child = spawn(SERVER, ['--http', '127.0.0.1:0'], { env: serverEnv(env), cwd: REPO, stdio: ['pipe', 'ignore', 'pipe'] });
  track(child.pid, 'ignition-mcp --http');
  let stderr = '';
  child.stderr.on('data', (d) => (stderr = (stderr + d).slice(-20000)));
  const exited = new Promise((r) => child.on('exit', r));
  let m = null;
  for (let i = 0; i < 600 && !m; i++) {
    m = stderr.match(/listening on (http:\/\/127\.0\.0\.1:(\d+)\/mcp)/);
    if (!m) {
      if (child.exitCode !== null) break;
      await sleep(50);
    }
  }
  if (!m) {
    killTree(child.pid);
    untrack(child.pid);
    throw new Error(`ignition-mcp --http did not start: ${stderr.split('\n').filter(Boolean).slice(-3).join(' / ')}`);
  }
  return {
    pid: child.pid,
    url: m[1],
    port: Number(m[2]),
    stderr: () => stderr,
    async close() {
      const kids = descendants(child.pid);
      child.kill('SIGTERM');
      await Promise.race([exited, sleep(8000)]);
      await reapRecords(kids, 3000);
      killTree(child.pid);
      untrack(child.pid);
    },
  };
}

/* A client of the HTTP endpoint with one keep-alive connection of its own
 * (raw modern requests with their standard headers, no SDK): tool() gives
 * the structuredContent, or throws with the tool's error text. */
export function httpClient(port, { token = null } = {}) {
  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  let nextId = 1;
  const post = (msg, headers) =>
    new Promise((resolve, reject) => {
      const body = Buffer.from(JSON.stringify(msg));
      const req = http.request({ host: '127.0.0.1', port, method: 'POST', path: '/mcp', agent, headers: { ...headers, 'Content-Length': body.length } }, (res) => {
        const chunks = [];
        res.on('data', (c) => chunks.push(c));
        res.on('error', reject);
        res.on('end', () => {
          const text = Buffer.concat(chunks).toString('utf8');
          if (res.statusCode !== 200) return reject(new Error(`HTTP ${res.statusCode}: ${text.slice(0, 300)}`));
          try {
            resolve(JSON.parse(text));
          } catch (e) {
            reject(new Error(`not JSON: ${text.slice(0, 300)}`));
          }
        });
      });
      req.on('error', reject);
      req.end(body);
    });
  const request = async (method, params = {}) => {
    const msg = { jsonrpc: '2.0', id: nextId++, method, params: { ...params, _meta: MODERN_META } };
    const headers = {
      'Content-Type': 'application/json',
      Accept: 'application/json, text/event-stream',
      'MCP-Protocol-Version': MODERN_META['io.modelcontextprotocol/protocolVersion'],
      'Mcp-Method': method,
    };
    if (method === 'tools/call') {
      headers['Mcp-Name'] = params.name;
      if (typeof params.arguments?.session_id === 'string') headers['Mcp-Param-Session-Id'] = params.arguments.session_id;
    }
    if (token) headers.Authorization = `Bearer ${token}`;
    const r = await post(msg, headers);
    if (r.error) throw new Error(JSON.stringify(r.error));
    return r.result;
  };
  return {
    agent,
    request,
    async tool(name, args = {}) {
      const r = await request('tools/call', { name, arguments: args });
      if (r.isError) throw new Error(textOf(r));
      return r.structuredContent;
    },
    close() {
      agent.destroy();
    },
  };
}

/* VmRSS of a process, KiB. */
export function rssKiB(pid) {
  const m = fs.readFileSync(`/proc/${pid}/status`, 'utf8').match(/^VmRSS:\s+(\d+) kB/m);
  return m ? Number(m[1]) : NaN;
}

// ---------------------------------------------------------------- machine

export function machineInfo() {
  const cpuinfo = fs.readFileSync('/proc/cpuinfo', 'utf8');
  const model = (cpuinfo.match(/^model name\s*:\s*(.*)$/m) || [])[1] || 'unknown';
  const uname = spawnSync('uname', ['-r'], { encoding: 'utf8' }).stdout.trim();
  const osr = (() => {
    try {
      return (fs.readFileSync('/etc/os-release', 'utf8').match(/^PRETTY_NAME="?([^"\n]*)"?/m) || [])[1];
    } catch {
      return undefined;
    }
  })();
  const mem = (fs.readFileSync('/proc/meminfo', 'utf8').match(/^MemTotal:\s+(\d+)/m) || [])[1];
  let kvm = 'absent';
  try {
    fs.accessSync('/dev/kvm', fs.constants.R_OK | fs.constants.W_OK);
    kvm = 'present';
  } catch (e) {
    if (fs.existsSync('/dev/kvm')) kvm = `present but not usable (${e.code})`;
  }
  const load = fs.readFileSync('/proc/loadavg', 'utf8').split(' ').slice(0, 3).join(' ');
  const flags = (cpuinfo.match(/^flags\s*:\s*(.*)$/m) || [])[1] || '';
  return {
    nproc: spawnSync('nproc', { encoding: 'utf8' }).stdout.trim(),
    cpu: model,
    kernel: uname,
    os: osr,
    mem_gib: mem ? +(Number(mem) / 1048576).toFixed(1) : null,
    dev_kvm: kvm,
    virtual_machine: /\bhypervisor\b/.test(flags),
    loadavg_at_start: load,
    node: process.version,
  };
}

/* The host's TSC frequency in kHz, as image/vm-probe.sh finds it. */
export function tscKhz() {
  const cpuinfo = fs.readFileSync('/proc/cpuinfo', 'utf8');
  const mhz = (cpuinfo.match(/^cpu MHz\s*:\s*([\d.]+)/m) || [])[1];
  return mhz ? Math.round(Number(mhz) * 1000) : null;
}
