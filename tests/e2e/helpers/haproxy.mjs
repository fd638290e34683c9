// haproxy.mjs: the front proxy of several ignition-mcp hosts, as
// tests/e2e/scaleout.test.mjs runs it and docs/scale-out.md shows it.
//
// haproxyConfig() writes the haproxy.cfg; errorFile() the response HAProxy
// gives in place of a host that cannot be reached.  Both are pure, so the
// test can render them with the document's example values and compare them
// with the document's text: what the document shows is what the test runs.
//
// The routing: a request whose Mcp-Param-Session-Id header starts with
// "hN." goes to host hN and nowhere else; every other request (server/
// discover, tools/list, open_session, sandbox_run) goes round-robin to the
// hosts that pass their health check.

/* What a client reads when HOST (null: any host) cannot answer: 503, the
 * host cannot be reached (connection refused, or down in the health check;
 * also a call under way when it died, which HAProxy sends again); 502, an
 * answer it began and broke off before its headers were whole. */
export function unreachableMessage(host, status = 503) {
  if (!host) return status === 503 ? 'no host is reachable: try again later' : 'the host broke off its answer: try again';
  return status === 503
    ? `host ${host} is unreachable: its sessions are lost; open a new session`
    : `host ${host} broke off its answer: if it died, its sessions are lost; open a new session`;
}

export const ERROR_STATUSES = [502, 503];

/* The whole HTTP response of errorfile STATUS for HOST (null: the
 * round-robin backend).  HAProxy sends the file as it is, so it carries its
 * own Content-Length.  The JSON-RPC error is -32603 (Internal error): the
 * spec keeps -32000..-32019 unused and -32020 and up for its own errors;
 * id is null, as the proxy does not read the request. */
export function errorFile(host, status = 503) {
  const reason = { 502: 'Bad Gateway', 503: 'Service Unavailable' }[status];
  const body = JSON.stringify({
    jsonrpc: '2.0',
    id: null,
    error: { code: -32603, message: unreachableMessage(host, status), data: { host: host ?? null, status } },
  }) + '\n';
  return [
    `HTTP/1.1 ${status} ${reason}`,
    'Content-Type: application/json',
    'Cache-Control: no-store',
    'Connection: close',
    `Content-Length: ${Buffer.byteLength(body)}`,
    '',
    body,
  ].join('\r\n');
}

/* The health check: a real server/discover, as a 2026-07-28 client sends
 * it, with a token of its own (IGN_MCP_CHECK_TOKEN in HAProxy's
 * environment, so that the file holds no secret). */
const DISCOVER = JSON.stringify({
  jsonrpc: '2.0',
  id: 'health',
  method: 'server/discover',
  params: {
    _meta: {
      'io.modelcontextprotocol/protocolVersion': '2026-07-28',
      'io.modelcontextprotocol/clientCapabilities': {},
      'io.modelcontextprotocol/clientInfo': { name: 'haproxy-check', version: '1' },
    },
  },
});

/* The backend of the sessions of host H (one of HOSTS).  SHARED: the hosts
 * share one store, so when H is down (drained and stopped, or dead) its
 * sessions go to the first of the others that is up, which resumes a
 * hibernated one from the store (or says it was lost with its server). */
export function hostBackend({ host: h, hosts, shared = false }) {
  const L = shared
    ? [
      `# A session of ${h.name}: ${h.name} while it is up; when it is down, the first other host`,
      `# that is up, which resumes it from the shared store (docs/scale-out.md).`,
    ]
    : [`# A session of ${h.name}: ${h.name} or an error that names it, never another host.`];
  L.push(
    `backend ${h.name}`,
    `    retry-on conn-failure empty-response`,
    `    server ${h.name} ${h.addr} track any/${h.name}`,
  );
  if (shared) for (const o of hosts.filter((x) => x.name !== h.name)) L.push(`    server ${o.name} ${o.addr} track any/${o.name} backup`);
  for (const s of ERROR_STATUSES) L.push(`    errorfile ${s} errors/${h.name}.${s}.http`);
  return L.join('\n') + '\n';
}

/* haproxy.cfg for HOSTS ([{name: 'h1', addr: '10.0.0.1:8080'}, ...]),
 * listening on LISTEN ('127.0.0.1:8443'); the error files are
 * errors/<host>.<status>.http and the admin socket admin.sock, both beside
 * the configuration file (default-path config).  SHARED: see hostBackend. */
export function haproxyConfig({ listen, hosts, shared = false }) {
  const L = [];
  const add = (...lines) => L.push(...lines);
  add(
    '# haproxy.cfg: ignition-mcp hosts behind one address, routed on Mcp-Param-Session-Id',
    'global',
    '    default-path config',
    '    log stderr format raw local0 info',
    '    stats socket unix@admin.sock mode 600 level admin',
    '',
    'defaults',
    '    mode http',
    '    log global',
    '    option httplog',
    '    timeout connect 2s',
    '    timeout client 70m',
    '    timeout server 70m',
    '    timeout check 2s',
    '    timeout http-keep-alive 10s',
    '    http-reuse never',
    '    retries 2',
    '    default-server inter 1s fall 2 rise 2',
    '    option httpchk',
    '    http-check send meth POST uri /mcp ver HTTP/1.1 hdr Host mcp-health hdr Authorization "Bearer ${IGN_MCP_CHECK_TOKEN}" hdr Content-Type application/json hdr Accept "application/json, text/event-stream" hdr MCP-Protocol-Version 2026-07-28 hdr Mcp-Method server/discover body \'' + DISCOVER + '\'',
    '    http-check expect status 200',
    '',
    'frontend mcp',
    `    bind ${listen}`,
    '    http-request capture req.hdr(Mcp-Param-Session-Id) len 80',
  );
  for (const h of hosts) add(`    use_backend ${h.name} if { req.hdr(Mcp-Param-Session-Id) -m beg ${h.name}. }`);
  for (const h of hosts) add(`    use_backend ${h.name} if { req.hdr(Mcp-Method) -m beg tasks/ } { req.hdr(Mcp-Name) -m beg ${h.name}. }`);
  add(
    '    default_backend any',
    '',
    '# No session named: any healthy host.  A request that could not be sent',
    '# (connection refused) is sent to another host.  Legacy (2025) HTTP',
    '# clients keep their Mcp-Session-Id on the host that gave it.',
    'backend any',
    '    balance roundrobin',
    '    option redispatch',
    '    stick-table type string len 128 size 100k expire 2h',
    '    stick match req.hdr(Mcp-Session-Id)',
    '    stick store-response res.hdr(Mcp-Session-Id)',
  );
  for (const h of hosts) add(`    server ${h.name} ${h.addr} check`);
  for (const s of ERROR_STATUSES) add(`    errorfile ${s} errors/any.${s}.http`);
  for (const h of hosts) add('', hostBackend({ host: h, hosts, shared }).trimEnd());
  return L.join('\n') + '\n';
}

/* Every error file the configuration names: {relative path: content}. */
export function errorFiles(hosts) {
  const out = {};
  for (const s of ERROR_STATUSES) {
    out[`errors/any.${s}.http`] = errorFile(null, s);
    for (const h of hosts) out[`errors/${h.name}.${s}.http`] = errorFile(h.name, s);
  }
  return out;
}

/* `show stat` over the admin socket: {"backend/server": status} */
export function parseShowStat(csv) {
  const lines = csv.split('\n').filter(Boolean);
  const head = lines.shift()?.replace(/^# /, '').split(',') ?? [];
  const px = head.indexOf('pxname'), sv = head.indexOf('svname'), st = head.indexOf('status');
  const out = {};
  for (const l of lines) {
    const f = l.split(',');
    out[`${f[px]}/${f[sv]}`] = f[st];
  }
  return out;
}
