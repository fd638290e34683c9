// peer-srt.mjs: Anthropic's sandbox runtime (@anthropic-ai/sandbox-runtime,
// "srt") running `true` per command, the way an embedding program uses its
// library: initialize once, then for each command wrapWithSandbox() and
// spawn the wrapped string with a shell (what srt's own CLI does), then
// cleanupAfterCommand(). The baselines are spawned the same way from this
// same small process: `sh -c true` and a bare bwrap sandbox.
//
// Run by bench.mjs as a child process in a scratch directory, because the
// library keeps process-wide state (proxies, signal handlers) and places
// mount-point files relative to the working directory, and so that the
// cost of spawning from Node does not depend on the harness's own size.
//
// usage: node peer-srt.mjs N
//   -> one JSON line {sh_ms, bwrap_ms, srt_ms, version, wrap_only_ms} or,
//      when srt cannot run, the baselines and {srt_error}

import { spawn } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const pkgDir = path.join(here, 'node_modules/@anthropic-ai/sandbox-runtime');
const n = Number(process.argv[2] || 20);
const WARMUP = 3;
const BWRAP = ['--unshare-all', '--ro-bind', '/', '/', '--dev', '/dev', '--proc', '/proc', '--die-with-parent', 'true'];

function run(cmd, args, opts) {
  return new Promise((resolve, reject) => {
    const c = spawn(cmd, args, { stdio: 'ignore', ...opts });
    c.on('error', reject);
    c.on('exit', (code, sig) => (code === 0 ? resolve() : reject(new Error(`${cmd} exited ${code ?? sig}`))));
  });
}

async function timeN(fn) {
  const out = [];
  for (let i = 0; i < n + WARMUP; i++) {
    const t0 = process.hrtime.bigint();
    await fn();
    if (i >= WARMUP) out.push(Number(process.hrtime.bigint() - t0) / 1e6);
  }
  return out;
}

const result = {};
let SandboxManager;
try {
  result.sh_ms = await timeN(() => run('sh', ['-c', 'true']));
  result.bwrap_ms = await timeN(() => run('bwrap', BWRAP));
  if (!fs.existsSync(path.join(pkgDir, 'package.json'))) {
    throw new Error('not installed: bench/node_modules/@anthropic-ai/sandbox-runtime is missing (`npm ci` in bench/ failed or was not run; `make bench` runs it)');
  }
  result.version = JSON.parse(fs.readFileSync(path.join(pkgDir, 'package.json'), 'utf8')).version;
  ({ SandboxManager } = await import(pathToFileURL(path.join(pkgDir, 'dist/index.js')).href));
  const dep = SandboxManager.checkDependencies();
  if (dep.errors?.length) throw new Error(`its dependency check fails on this machine: ${dep.errors.join('; ')}`);
  // srt's CLI default when no settings file exists: no network, no writes.
  await SandboxManager.initialize({
    network: { allowedDomains: [], deniedDomains: [] },
    filesystem: { denyRead: [], allowRead: [], allowWrite: [], denyWrite: [] },
  });
  result.srt_ms = await timeN(async () => {
    const wrapped = await SandboxManager.wrapWithSandbox('true');
    await run(wrapped, [], { shell: true });
    SandboxManager.cleanupAfterCommand();
  });
  const t0 = process.hrtime.bigint();
  const wrapped = await SandboxManager.wrapWithSandbox('true');
  result.wrap_only_ms = Number(process.hrtime.bigint() - t0) / 1e6;
  result.wrapped_example = wrapped.slice(0, 4000);
} catch (e) {
  result.srt_error = String(e?.message ?? e);
}
await SandboxManager?.reset?.().catch(() => {});
process.stdout.write(JSON.stringify(result) + '\n');
process.exit(0);
