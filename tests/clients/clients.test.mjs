// clients.test.mjs: ignition-mcp registered in real MCP clients, the way the
// README tells users to do it, and each client's own check that it connects.
//
//   Claude Code  `claude mcp add --scope local`, a project .mcp.json, the plugin
//                (--plugin-dir, and installed from the repository's marketplace),
//                and `claude mcp add --transport http` with a bearer token against
//                the server's HTTP endpoint (`ignition-mcp --http`); over stdio it
//                speaks 2026-07-28 (server/discover, no initialize)
//   Codex        ~/.codex/config.toml; `codex mcp list/get`, and its app-server
//                connecting to the server, listing the tools and calling them
//   Gemini CLI   ~/.gemini/settings.json and a project .gemini/settings.json;
//                `gemini mcp list`
//   the plugin's launcher (bin/ignition-mcp-launch) on its own
//
// The clients come from npm: scripts/setup.sh runs `npm ci` in clients/ (the
// lockfile pins their versions). A client that is not installed is skipped,
// with the reason. None of this needs a login or the network: the checks only
// start the server and talk MCP to it. Every client runs with a HOME of its
// own in a temporary directory, so no user configuration is read or changed.
//
// Environment: IGN_TEST_CLIENT_SERVER, the server to register (default
// build/ignition-mcp, which finds its images next to itself);
// IGN_TEST_CLIENTS_DIR, where the clients are installed (default clients/).

import { test, describe, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFile, spawn } from 'node:child_process';
import crypto from 'node:crypto';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import readline from 'node:readline';
import { fileURLToPath } from 'node:url';

const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..');
const SERVER = path.resolve(process.env.IGN_TEST_CLIENT_SERVER || path.join(REPO, 'build/ignition-mcp'));
const CLIENTS = path.resolve(process.env.IGN_TEST_CLIENTS_DIR || path.join(REPO, 'clients'));
const BIN = path.join(CLIENTS, 'node_modules/.bin');
const LAUNCHER = path.join(REPO, 'bin/ignition-mcp-launch');
const TOOLS = ['close', 'commit', 'hibernate', 'fork', 'list_sessions', 'open_session', 'read_file', 'reset', 'run', 'stage_info', 'stage_list', 'stage_rm', 'write_file', 'sandbox_run', 'copy_in', 'copy_out', 'network_log', 'network_update'].sort();
const CMD_TIMEOUT_MS = 120_000;

const serverMissing = fs.existsSync(SERVER) ? null : `no server at ${SERVER}: build it with make (or scripts/setup.sh)`;

/* Why CLIENT cannot be tested here, or null when it can. */
function whyNot(client, pkg) {
  if (serverMissing) return serverMissing;
  const bin = path.join(BIN, client);
  if (!fs.existsSync(bin)) {
    return `${pkg} is not installed in ${CLIENTS}: run scripts/setup.sh (or: cd clients && npm ci)`;
  }
  return null;
}

/* test(), skipped with REASON when there is one: every test of a client that
 * cannot run is reported as skipped, with the reason. */
function testsIf(reason) {
  return (name, fn) => test(name, { skip: reason || false }, fn);
}

const temps = [];
after(() => {
  for (const d of temps) fs.rmSync(d, { recursive: true, force: true });
});

function tempDir(tag) {
  const d = fs.mkdtempSync(path.join(os.tmpdir(), `ign-clients-${tag}-`));
  temps.push(d);
  return d;
}

/* A fresh HOME (with its XDG directories inside it) and a project directory,
 * and the environment the clients run with: PATH has the installed clients
 * and the node running this test first (gemini is a node script). */
function sandboxEnv(tag, extra = {}) {
  const home = tempDir(`${tag}-home`);
  const project = tempDir(`${tag}-project`);
  const env = { ...process.env };
  for (const k of Object.keys(env)) {
    if (/^(CLAUDE_|ANTHROPIC_|CODEX_|OPENAI_|GEMINI_|GOOGLE_|XDG_|IGN_MCP_)/.test(k)) delete env[k];
  }
  Object.assign(env, {
    HOME: home,
    XDG_CONFIG_HOME: path.join(home, '.config'),
    XDG_CACHE_HOME: path.join(home, '.cache'),
    XDG_DATA_HOME: path.join(home, '.local/share'),
    XDG_STATE_HOME: path.join(home, '.local/state'),
    PATH: [BIN, path.dirname(process.execPath), process.env.PATH].join(path.delimiter),
    // No update checks, telemetry or other traffic the checks do not need.
    DISABLE_AUTOUPDATER: '1',
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC: '1',
    NO_COLOR: '1',
    CI: '1',
    ...extra,
  });
  return { home, project, env };
}

/* Run a client command; resolve with {code, stdout, stderr, out} (out is both
 * streams, for messages a client prints to either). Never rejects on a
 * non-zero exit: the assertions look at the output. */
function sh(cmd, args, { cwd, env, input } = {}) {
  return new Promise((resolve, reject) => {
    const child = execFile(cmd, args, { cwd, env, timeout: CMD_TIMEOUT_MS, killSignal: 'SIGKILL', maxBuffer: 16 << 20 },
      (err, stdout, stderr) => {
        if (err && err.killed) return reject(new Error(`${cmd} ${args.join(' ')} timed out after ${CMD_TIMEOUT_MS} ms\n${stdout}\n${stderr}`));
        if (err && typeof err.code !== 'number') return reject(err);
        resolve({ code: err ? err.code : 0, stdout, stderr, out: `${stdout}\n${stderr}` });
      });
    if (input != null) child.stdin.end(input);
    else child.stdin.end();
  });
}

function show(r) {
  return `exit ${r.code}\n--- stdout\n${r.stdout}\n--- stderr\n${r.stderr}`;
}

function escapeRe(s) {
  return s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
}

function writeJson(file, value) {
  fs.mkdirSync(path.dirname(file), { recursive: true });
  fs.writeFileSync(file, JSON.stringify(value, null, 2) + '\n');
}

/* The server on its HTTP endpoint (`--http 127.0.0.1:0`) with one bearer
 * token: {url, token, stderr(), close()} once it says where it listens. */
async function startHttpServer() {
  const dir = tempDir('http');
  const token = crypto.randomBytes(24).toString('hex');
  const tokens = path.join(dir, 'tokens');
  fs.writeFileSync(tokens, `claude:${token}\n`, { mode: 0o600 });
  const env = { ...process.env, IGN_MCP_HTTP_TOKENS: tokens };
  for (const k of Object.keys(env)) if (k.startsWith('IGN_MCP_') && k !== 'IGN_MCP_HTTP_TOKENS') delete env[k];
  const child = spawn(SERVER, ['--http', '127.0.0.1:0'], { cwd: dir, env, stdio: ['pipe', 'ignore', 'pipe'] });
  let stderr = '';
  child.stderr.on('data', (d) => (stderr += d));
  const exited = new Promise((r) => child.on('exit', r));
  let m = null;
  for (let i = 0; i < 600 && !m && child.exitCode === null; i++) {
    m = stderr.match(/listening on (http:\/\/127\.0\.0\.1:\d+\/mcp)/);
    if (!m) await new Promise((r) => setTimeout(r, 50));
  }
  if (!m) {
    child.kill('SIGKILL');
    throw new Error(`${SERVER} --http 127.0.0.1:0 did not start:\n${stderr}`);
  }
  return {
    url: m[1],
    token,
    stderr: () => stderr,
    async close() {
      child.kill('SIGTERM');
      const t = setTimeout(() => child.kill('SIGKILL'), 10_000);
      await exited;
      clearTimeout(t);
    },
  };
}

// ---------------------------------------------------------------- Claude Code

describe('Claude Code', () => {
  const it = testsIf(whyNot('claude', '@anthropic-ai/claude-code'));
  const claude = path.join(BIN, 'claude');

  it('claude --version runs here', async () => {
    const { env, project } = sandboxEnv('claude-version');
    const r = await sh(claude, ['--version'], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.stdout, /\(Claude Code\)/, show(r));
  });

  it('claude mcp add --scope local, then mcp list and mcp get: Connected', async () => {
    const { env, project, home } = sandboxEnv('claude-local');
    let r = await sh(claude, ['mcp', 'add', '--scope', 'local', 'ignition', '--', SERVER], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.out, /Added stdio MCP server ignition/, show(r));
    const cfg = JSON.parse(fs.readFileSync(path.join(home, '.claude.json'), 'utf8'));
    assert.equal(cfg.projects?.[project]?.mcpServers?.ignition?.command, SERVER, 'the local registration is in ~/.claude.json under the project');

    r = await sh(claude, ['mcp', 'list'], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.stdout, new RegExp(`^ignition: ${escapeRe(SERVER)}\\s+- ✔ Connected$`, 'm'), show(r));

    r = await sh(claude, ['mcp', 'get', 'ignition'], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.stdout, /Scope: Local config/, show(r));
    assert.match(r.stdout, /Status: ✔ Connected/, show(r));

    // Local scope is private to that project: another directory has no server.
    const elsewhere = tempDir('claude-elsewhere');
    r = await sh(claude, ['mcp', 'list'], { cwd: elsewhere, env });
    assert.doesNotMatch(r.stdout, /^ignition:/m, show(r));
  });

  it('a project .mcp.json: pending until approved, then Connected', async () => {
    const { env, project, home } = sandboxEnv('claude-project');
    writeJson(path.join(project, '.mcp.json'), { mcpServers: { ignition: { command: SERVER, args: [] } } });
    let r = await sh(claude, ['mcp', 'list'], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.stdout, /^ignition: .*⏸ Pending approval/m, show(r));

    // What approving it in `claude` records; here in the user's settings.
    writeJson(path.join(home, '.claude/settings.json'), { enabledMcpjsonServers: ['ignition'] });
    r = await sh(claude, ['mcp', 'list'], { cwd: project, env });
    assert.match(r.stdout, new RegExp(`^ignition: ${escapeRe(SERVER)}\\s+- ✔ Connected$`, 'm'), show(r));
    r = await sh(claude, ['mcp', 'get', 'ignition'], { cwd: project, env });
    assert.match(r.stdout, /Scope: Project config/, show(r));
    assert.match(r.stdout, /Status: ✔ Connected/, show(r));
  });

  it('over stdio Claude Code speaks 2026-07-28: server/discover first, no initialize, and the server answers it', async () => {
    const { env, project } = sandboxEnv('claude-wire');
    // The registered command records what Claude Code writes to the server.
    const rec = path.join(project, 'rec.sh');
    const wire = path.join(project, 'wire.log');
    fs.writeFileSync(rec, `#!/bin/sh\ntee '${wire}' | '${SERVER}'\n`, { mode: 0o755 });
    let r = await sh(claude, ['mcp', 'add', '--scope', 'local', 'ignition', '--', rec], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    r = await sh(claude, ['mcp', 'list'], { cwd: project, env });
    assert.match(r.stdout, new RegExp(`^ignition: ${escapeRe(rec)}\\s+- ✔ Connected$`, 'm'), show(r));
    const sent = fs.readFileSync(wire, 'utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l));
    const methods = sent.map((m) => m.method);
    assert.equal(methods[0], 'server/discover', `first message: ${JSON.stringify(sent[0]).slice(0, 300)}`);
    assert.equal(sent[0].params?._meta?.['io.modelcontextprotocol/protocolVersion'], '2026-07-28');
    assert.ok(!methods.includes('initialize'), `Claude Code sent initialize: ${methods.join(', ')}`);
  });

  it('claude mcp add --transport http with a bearer token: mcp list and mcp get show it Connected; a wrong token does not connect', async () => {
    const srv = await startHttpServer();
    try {
      const { env, project, home } = sandboxEnv('claude-http');
      let r = await sh(claude, ['mcp', 'add', '--transport', 'http', 'ignition-http', srv.url, '--header', `Authorization: Bearer ${srv.token}`], { cwd: project, env });
      assert.equal(r.code, 0, show(r));
      assert.match(r.out, new RegExp(`Added HTTP MCP server ignition-http with URL: ${escapeRe(srv.url)}`), show(r));
      assert.doesNotMatch(r.out, new RegExp(srv.token), 'claude printed the token when adding');
      const cfg = JSON.parse(fs.readFileSync(path.join(home, '.claude.json'), 'utf8'));
      const reg = cfg.projects?.[project]?.mcpServers?.['ignition-http'];
      assert.equal(reg?.type, 'http', JSON.stringify(reg));
      assert.equal(reg?.url, srv.url);

      r = await sh(claude, ['mcp', 'list'], { cwd: project, env });
      assert.equal(r.code, 0, show(r));
      assert.match(r.stdout, new RegExp(`^ignition-http: ${escapeRe(srv.url)} \\(HTTP\\) - ✔ Connected$`, 'm'), show(r));

      r = await sh(claude, ['mcp', 'get', 'ignition-http'], { cwd: project, env });
      assert.equal(r.code, 0, show(r));
      assert.match(r.stdout, /Status: ✔ Connected/, show(r));
      assert.match(r.stdout, /Type: http/, show(r));
      assert.match(r.stdout, new RegExp(`URL: ${escapeRe(srv.url)}`), show(r));

      // The same server with a token it does not know: refused (401), not Connected.
      const other = sandboxEnv('claude-http-wrong');
      const wrong = crypto.randomBytes(24).toString('hex');
      r = await sh(claude, ['mcp', 'add', '--transport', 'http', 'ignition-http', srv.url, '--header', `Authorization: Bearer ${wrong}`], { cwd: other.project, env: other.env });
      assert.equal(r.code, 0, show(r));
      r = await sh(claude, ['mcp', 'list'], { cwd: other.project, env: other.env });
      assert.match(r.stdout, /^ignition-http: /m, show(r));
      assert.doesNotMatch(r.stdout, /^ignition-http: .*✔ Connected/m, show(r));
      assert.ok(!srv.stderr().includes(srv.token) && !srv.stderr().includes(wrong), 'a token is in the server log');
    } finally {
      await srv.close();
    }
  });

  /* The plugin's launcher finds build/ignition-mcp in the repository; when
   * the server under test is another one, IGN_MCP_SERVER points it there. */
  const pluginEnv = SERVER === path.join(REPO, 'build/ignition-mcp') ? {} : { IGN_MCP_SERVER: SERVER };

  it('claude plugin validate: the manifest and the marketplace pass', async () => {
    const { env, project } = sandboxEnv('claude-validate');
    const r = await sh(claude, ['plugin', 'validate', REPO], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.out, /✔ Validation passed/, show(r));
    assert.match(r.out, /mcpServers: ignition stdio \$\{CLAUDE_PLUGIN_ROOT\}\/bin\/ignition-mcp-launch/, show(r));
    assert.match(r.out, /skills: ignition:ignition/, show(r));
    assert.doesNotMatch(r.out, /✘|error/i, show(r));
  });

  it('claude --plugin-dir: the plugin server Connected, the skill loaded', async () => {
    const { env, project } = sandboxEnv('claude-plugin', pluginEnv);
    let r = await sh(claude, ['--plugin-dir', REPO, 'mcp', 'list'], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.stdout, new RegExp(`^plugin:ignition:ignition: ${escapeRe(LAUNCHER)}\\s+- ✔ Connected$`, 'm'), show(r));

    r = await sh(claude, ['--plugin-dir', REPO, 'plugin', 'details', 'ignition'], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.stdout, /Skills \(1\)\s+ignition/, show(r));
    assert.match(r.stdout, /MCP servers \(1\)\s+ignition/, show(r));
  });

  it('the plugin installed from the marketplace: enabled, Connected', async () => {
    // The marketplace is a directory holding only the plugin's tracked parts
    // (a marketplace added from a path is read in place, but copied whole into
    // ~/.claude/plugins/cache first: the repository with build/ would be GBs).
    const market = tempDir('claude-market');
    for (const part of ['.claude-plugin', 'bin', 'skill']) {
      fs.cpSync(path.join(REPO, part), path.join(market, part), { recursive: true });
    }
    const { env, project } = sandboxEnv('claude-market', { IGN_MCP_SERVER: SERVER });
    let r = await sh(claude, ['plugin', 'marketplace', 'add', market], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.out, /Successfully added marketplace: ignition-mcp/, show(r));
    r = await sh(claude, ['plugin', 'install', 'ignition@ignition-mcp'], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.out, /Successfully installed plugin: ignition@ignition-mcp/, show(r));
    r = await sh(claude, ['plugin', 'list'], { cwd: project, env });
    assert.match(r.stdout, /ignition@ignition-mcp\s+Version: 0\.1\.0[\s\S]*?Status: ✔ enabled/, show(r));

    // That copy has no build/: the launcher takes the server from IGN_MCP_SERVER.
    r = await sh(claude, ['mcp', 'list'], { cwd: project, env });
    assert.match(r.stdout, /^plugin:ignition:ignition: \S+\/bin\/ignition-mcp-launch\s+- ✔ Connected$/m, show(r));
  });
});

// ---------------------------------------------------------------------- Codex

/* Codex's app-server (JSON-RPC over stdio, what its IDE extension uses)
 * starts the configured MCP servers without a login: list them with their
 * tools, and call tools through it. */
class CodexAppServer {
  constructor(codex, { cwd, env }) {
    this.child = spawn(codex, ['app-server'], { cwd, env, stdio: ['pipe', 'pipe', 'pipe'] });
    this.stderr = '';
    this.child.stderr.on('data', (d) => { this.stderr += d; });
    this.pending = new Map();
    this.next = 1;
    this.exited = new Promise((resolve) => this.child.on('exit', (code, signal) => resolve({ code, signal })));
    readline.createInterface({ input: this.child.stdout }).on('line', (line) => {
      let m;
      try { m = JSON.parse(line); } catch { return; }
      if (m.id != null && !m.method && this.pending.has(m.id)) {
        this.pending.get(m.id)(m);
        this.pending.delete(m.id);
      }
    });
  }

  request(method, params, timeoutMs = CMD_TIMEOUT_MS) {
    const id = this.next++;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.pending.delete(id);
        reject(new Error(`codex app-server: no answer to ${method} in ${timeoutMs} ms; stderr:\n${this.stderr}`));
      }, timeoutMs);
      this.pending.set(id, (m) => {
        clearTimeout(timer);
        if (m.error) reject(new Error(`codex app-server: ${method} failed: ${JSON.stringify(m.error)}`));
        else resolve(m.result);
      });
      this.child.stdin.write(JSON.stringify({ jsonrpc: '2.0', id, method, params }) + '\n');
    });
  }

  async start() {
    await this.request('initialize', { clientInfo: { name: 'ignition-mcp-tests', version: '0.1.0' } });
    this.child.stdin.write(JSON.stringify({ jsonrpc: '2.0', method: 'initialized' }) + '\n');
  }

  async close() {
    this.child.stdin.end();
    const t = setTimeout(() => this.child.kill('SIGKILL'), 10_000);
    const r = await this.exited;
    clearTimeout(t);
    return r;
  }
}

describe('Codex', () => {
  const skip = whyNot('codex', '@openai/codex');
  const it = testsIf(skip);
  const codex = path.join(BIN, 'codex');
  let ctx;

  before(() => {
    if (skip) return;
    ctx = sandboxEnv('codex');
    // As the README shows it.
    fs.mkdirSync(path.join(ctx.home, '.codex'), { recursive: true });
    fs.writeFileSync(path.join(ctx.home, '.codex/config.toml'),
      `[mcp_servers.ignition]\ncommand = ${JSON.stringify(SERVER)}\n`);
  });

  it('codex mcp list and mcp get show the server from config.toml', async () => {
    let r = await sh(codex, ['mcp', 'list'], { cwd: ctx.project, env: ctx.env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.stdout, new RegExp(`^ignition\\s+${escapeRe(SERVER)}\\s+-\\s+-\\s+-\\s+enabled\\b`, 'm'), show(r));

    r = await sh(codex, ['mcp', 'list', '--json'], { cwd: ctx.project, env: ctx.env });
    assert.equal(r.code, 0, show(r));
    const list = JSON.parse(r.stdout);
    const ign = list.find((s) => s.name === 'ignition');
    assert.ok(ign, show(r));
    assert.equal(ign.enabled, true);
    assert.equal(ign.transport.type, 'stdio');
    assert.equal(ign.transport.command, SERVER);

    r = await sh(codex, ['mcp', 'get', 'ignition'], { cwd: ctx.project, env: ctx.env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.stdout, /transport: stdio/, show(r));
    assert.match(r.stdout, new RegExp(`command: ${escapeRe(SERVER)}`), show(r));
  });

  it('codex mcp add writes the same config', async () => {
    const own = sandboxEnv('codex-add');
    const r = await sh(codex, ['mcp', 'add', 'ignition', '--', SERVER], { cwd: own.project, env: own.env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.out, /Added global MCP server 'ignition'/, show(r));
    const toml = fs.readFileSync(path.join(own.home, '.codex/config.toml'), 'utf8');
    assert.match(toml, /^\[mcp_servers\.ignition\]$/m, toml);
    assert.match(toml, new RegExp(`^command = "${escapeRe(SERVER)}"$`, 'm'), toml);
  });

  it('codex app-server connects: server info and the eighteen tools', async () => {
    const app = new CodexAppServer(codex, { cwd: ctx.project, env: ctx.env });
    try {
      await app.start();
      const res = await app.request('mcpServerStatus/list', {});
      const ign = res.data.find((s) => s.name === 'ignition');
      assert.ok(ign, `no ignition in ${JSON.stringify(res).slice(0, 2000)}`);
      assert.equal(ign.serverInfo?.name, 'ignition-mcp', JSON.stringify(ign).slice(0, 2000));
      assert.deepEqual(Object.keys(ign.tools).sort(), TOOLS);
      assert.ok(ign.tools.run.inputSchema.required.includes('command'));
    } finally {
      await app.close();
    }
  });

  it('codex app-server calls the tools: open_session, run, close', async () => {
    const app = new CodexAppServer(codex, { cwd: ctx.project, env: ctx.env });
    try {
      await app.start();
      const thread = await app.request('thread/start', { cwd: ctx.project, ephemeral: true });
      const threadId = thread.thread.id;
      const call = async (tool, args) => {
        const r = await app.request('mcpServer/tool/call', { server: 'ignition', threadId, tool, arguments: args });
        assert.notEqual(r.isError, true, `${tool}: ${JSON.stringify(r).slice(0, 1000)}`);
        return r.structuredContent;
      };
      const opened = await call('open_session', {});
      assert.match(opened.session_id, /\S/);
      assert.match(opened.isolation, /^(microvm\/kvm|microvm\/tcg|namespace)$/);
      const ran = await call('run', { session_id: opened.session_id, command: 'echo hello from codex; echo err >&2; exit 3' });
      assert.equal(ran.stdout, 'hello from codex\n');
      assert.equal(ran.stderr, 'err\n');
      assert.equal(ran.exit_code, 3);
      const closed = await call('close', { session_id: opened.session_id });
      assert.equal(closed.ok, true);
    } finally {
      await app.close();
    }
  });
});

// ----------------------------------------------------------------- Gemini CLI

describe('Gemini CLI', () => {
  const it = testsIf(whyNot('gemini', '@google/gemini-cli'));
  const gemini = path.join(BIN, 'gemini');

  it('~/.gemini/settings.json: Disabled in an untrusted folder, Connected once trusted', async () => {
    const { env, project, home } = sandboxEnv('gemini-user');
    writeJson(path.join(home, '.gemini/settings.json'), { mcpServers: { ignition: { command: SERVER, args: [] } } });
    let r = await sh(gemini, ['mcp', 'list'], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.out, new RegExp(`ignition: ${escapeRe(SERVER)}\\s+\\(stdio\\) - Disabled`), show(r));
    assert.match(r.out, /this folder is untrusted/, show(r));

    // What answering "trust this folder" in gemini records.
    writeJson(path.join(home, '.gemini/trustedFolders.json'), { [project]: 'TRUST_FOLDER' });
    r = await sh(gemini, ['mcp', 'list'], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.out, new RegExp(`✓ ignition: ${escapeRe(SERVER)}\\s+\\(stdio\\) - Connected`), show(r));
  });

  it('gemini mcp add --scope user writes the same settings', async () => {
    const { env, project, home } = sandboxEnv('gemini-add');
    const r = await sh(gemini, ['mcp', 'add', '--scope', 'user', 'ignition', SERVER], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    const settings = JSON.parse(fs.readFileSync(path.join(home, '.gemini/settings.json'), 'utf8'));
    assert.equal(settings.mcpServers?.ignition?.command, SERVER);
  });

  it('a project .gemini/settings.json in a trusted folder: Connected', async () => {
    const { env, project, home } = sandboxEnv('gemini-project');
    writeJson(path.join(project, '.gemini/settings.json'), { mcpServers: { ignition: { command: SERVER, args: [] } } });
    writeJson(path.join(home, '.gemini/trustedFolders.json'), { [project]: 'TRUST_FOLDER' });
    const r = await sh(gemini, ['mcp', 'list'], { cwd: project, env });
    assert.equal(r.code, 0, show(r));
    assert.match(r.out, new RegExp(`✓ ignition: ${escapeRe(SERVER)}\\s+\\(stdio\\) - Connected`), show(r));
  });
});

// ---------------------------------------------------------- the plugin launcher

describe('bin/ignition-mcp-launch', () => {
  const it = testsIf(serverMissing);
  const init = JSON.stringify({
    jsonrpc: '2.0', id: 1, method: 'initialize',
    params: { protocolVersion: '2025-06-18', capabilities: {}, clientInfo: { name: 'launch-test', version: '1' } },
  }) + '\n';

  it('IGN_MCP_SERVER: execs that server, which answers initialize', async () => {
    const { env, project } = sandboxEnv('launch-env', { IGN_MCP_SERVER: SERVER });
    const r = await sh(LAUNCHER, [], { cwd: project, env, input: init });
    const first = JSON.parse(r.stdout.split('\n')[0]);
    assert.equal(first.id, 1, show(r));
    assert.equal(first.result?.serverInfo?.name, 'ignition-mcp', show(r));
  });

  it('IGN_MCP_SERVER that is not a server: exit 127, stdout empty, a message on stderr', async () => {
    const { env, project } = sandboxEnv('launch-bad', { IGN_MCP_SERVER: path.join(tempDir('launch-scratch'), 'nope') });
    const r = await sh(LAUNCHER, [], { cwd: project, env, input: init });
    assert.equal(r.code, 127, show(r));
    assert.equal(r.stdout, '');
    assert.match(r.stderr, /IGN_MCP_SERVER=.*is not an executable file/, show(r));
  });

  it('no server anywhere: exit 127 without reading stdin, stdout empty, how to build or install', async (t) => {
    const installed = ['/usr/local/bin/ignition-mcp', '/usr/bin/ignition-mcp'].find((f) => fs.existsSync(f));
    if (installed) return t.skip(`${installed} is installed, so the launcher finds a server`);
    const copy = tempDir('launch-copy');
    fs.mkdirSync(path.join(copy, 'bin'));
    fs.copyFileSync(LAUNCHER, path.join(copy, 'bin/ignition-mcp-launch'));
    fs.chmodSync(path.join(copy, 'bin/ignition-mcp-launch'), 0o755);
    const { env, project } = sandboxEnv('launch-none', { PATH: '/usr/bin:/bin' });
    // stdin stays open: the launcher must exit anyway.
    const child = spawn(path.join(copy, 'bin/ignition-mcp-launch'), [], { cwd: project, env, stdio: ['pipe', 'pipe', 'pipe'] });
    let stdout = '', stderr = '';
    child.stdout.on('data', (d) => { stdout += d; });
    child.stderr.on('data', (d) => { stderr += d; });
    const code = await new Promise((resolve) => {
      const timer = setTimeout(() => child.kill('SIGKILL'), 10_000);
      child.on('exit', (c) => { clearTimeout(timer); resolve(c); });
    });
    child.stdin.destroy();
    assert.equal(code, 127, stderr);
    assert.equal(stdout, '');
    assert.match(stderr, /no ignition-mcp server found/);
    assert.match(stderr, /sudo scripts\/setup\.sh/);
    assert.match(stderr, /make install/);
  });
});
