// helpers/http.mjs: the server over Streamable HTTP (ignition-mcp --http)
// for the end-to-end tests.
//
// startHttp() runs the server with the environment lib.mjs gives every
// server (serverEnv), reads the port from its "listening on
// http://ADDR:PORT/mcp" line, and close() stops it with SIGTERM and checks
// what lib.mjs checks of a stdio server: it exits 0, nothing it started
// outlives it, stderr holds no sanitizer report, and stdout stayed empty.

import { spawn } from 'node:child_process';
import assert from 'node:assert/strict';
import { after } from 'node:test';
import { REPO, SERVER, serverEnv, descendants, waitGone, assertNoSanitizerReport } from '../lib.mjs';

const live = new Set();
after(() => {
  for (const c of live) c.kill('SIGKILL');
});

/* Starts `ignition-mcp --http LISTEN` (default 127.0.0.1:0, a free port).
 * Returns {url (the /mcp endpoint), base, port, pid, stderrText(),
 * close()}. */
export async function startHttp({ env = {}, tools = false, listen = '127.0.0.1:0', timeoutMs = 30000 } = {}) {
  const child = spawn(SERVER, ['--http', listen], {
    env: serverEnv({ env, tools }),
    stdio: ['ignore', 'pipe', 'pipe'],
    cwd: REPO,
  });
  live.add(child);
  let stderr = '';
  let stdout = '';
  const exited = new Promise((resolve) => child.on('exit', (code, signal) => {
    live.delete(child);
    resolve({ code, signal });
  }));
  child.stdout.on('data', (d) => { stdout += d.toString('utf8'); });
  const found = await new Promise((resolve) => {
    const timer = setTimeout(() => resolve(null), timeoutMs);
    child.stderr.on('data', (d) => {
      stderr += d.toString('utf8');
      const m = stderr.match(/listening on (http:\/\/(\S+):(\d+))\/mcp/);
      if (m) {
        clearTimeout(timer);
        resolve(m);
      }
    });
    exited.then(() => {
      clearTimeout(timer);
      resolve(null);
    });
  });
  if (!found) {
    child.kill('SIGKILL');
    throw new Error(`${SERVER} --http ${listen} did not report its port:\n${stderr}`);
  }
  const base = found[1];
  const pid = child.pid;
  let closed = false;
  return {
    base,
    url: new URL(`${base}/mcp`),
    port: Number(found[3]),
    pid,
    stderrText: () => stderr,
    async close() {
      if (closed) return;
      closed = true;
      const kids = descendants(pid);
      child.kill('SIGTERM');
      const timer = setTimeout(() => child.kill('SIGKILL'), 60000);
      const { code, signal } = await exited;
      clearTimeout(timer);
      const left = await waitGone(kids, 8000);
      assert.deepEqual(left.map((l) => `${l.pid} ${l.cmd}`), [], 'processes started by the server outlived it');
      assertNoSanitizerReport(stderr);
      assert.equal(stdout, '', 'an HTTP server writes nothing to stdout');
      assert.deepEqual({ code, signal }, { code: 0, signal: null }, `the server did not exit 0 on SIGTERM:\n${stderr.slice(-3000)}`);
    },
  };
}

/* Runs `ignition-mcp ARGS...` to its end (for refusals at startup):
 * {code, stderr}. */
export function runServer(args, { env = {} } = {}) {
  return new Promise((resolve) => {
    const child = spawn(SERVER, args, { env: serverEnv({ env }), stdio: ['ignore', 'ignore', 'pipe'], cwd: REPO });
    let stderr = '';
    child.stderr.on('data', (d) => { stderr += d.toString('utf8'); });
    const timer = setTimeout(() => child.kill('SIGKILL'), 30000);
    child.on('exit', (code) => {
      clearTimeout(timer);
      resolve({ code, stderr });
    });
  });
}
