// egress-record.test.mjs: what a sandbox cannot do to the record of its own
// egress, and DNS as a channel out under a wildcard rule, end to end on the
// real server (both backends, as root and as a user):
//  - a flood of refused connects does not push the session's first refusal
//    out of network_log; every refusal is counted by destination and reason;
//    a JSON Lines log cut at IGN_MCP_EGRESS_LOG_CAP carries the counts in its
//    truncated line and ends, when the session closes, with a summary of them;
//  - past IGN_MCP_EGRESS_WILDCARD_NAMES distinct names under a *.suffix rule,
//    lookups are NXDOMAIN and recorded with a reason naming the setting.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { startServer, call, run, waitUntil, AGENT } from './lib.mjs';

const T = { timeout: 300_000 };
const FLOOD = 120;

/* The sandbox must be able to capture its traffic for the broker to see it
 * (the agent's own probe says whether this host can). */
function captureSkip() {
  const r = spawnSync(AGENT, ['--probe-egress'], { encoding: 'utf8', timeout: 20_000 });
  const line = `${r.stdout ?? ''}${r.stderr ?? ''}`.split('\n')[0];
  return r.status === 0 && line === 'ok' ? false : `a sandbox cannot capture its traffic here (${AGENT} --probe-egress: ${line || `status ${r.status}`})`;
}

async function withServer(env, fn) {
  const s = await startServer({ env });
  try {
    await fn(s.client);
  } finally {
    await s.close();
  }
}

/* One refused connect to 10.1.2.3:1, then FLOOD to 10.1.2.3:2 (busybox nc:
 * the handshake completes with the agent, the refusal is a reset). */
const FLOOD_SH = `echo x | nc -w 3 10.1.2.3 1 >/dev/null 2>&1; for i in $(seq 1 ${FLOOD}); do echo x | nc -w 3 10.1.2.3 2; done >/dev/null 2>&1; echo done`;

const countOf = (counts, dest) => counts.find((x) => x.kind === 'connect' && x.destination === dest && x.reason === 'network is none')?.count;

describe('egress record', { skip: captureSkip() }, () => {
  test('the first refusal outlives 120 more, counted by destination and reason; the cut log ends with the counts', T, async () => {
    await withServer({ IGN_MCP_EGRESS_LOG_CAP: 4096 }, async (c) => {
      const o = await call(c, 'open_session', {});
      const sid = o.session_id;
      const file = o.egress.egress_log_path;
      assert.equal(typeof file, 'string');
      const r = await run(c, sid, FLOOD_SH, { timeout_s: 150 }, { timeout: 200_000 });
      assert.equal(r.exit_code, 0, `${r.stdout} ${r.stderr}`);
      assert.match(r.stdout, /done/);
      // The run's own record starts with its first refusal too.
      assert.equal(r.egress.denied[0].port, 1, JSON.stringify(r.egress.denied[0]));
      const log = await call(c, 'network_log', { session_id: sid });
      assert.equal(log.denied.length, 64);
      const first = log.denied[0];
      assert.equal(first.kind, 'connect');
      assert.equal(first.ip, '10.1.2.3');
      assert.equal(first.port, 1, `network_log lost the first refusal: denied[0] is ${JSON.stringify(first)}`);
      assert.equal(first.reason, 'network is none');
      assert.equal(log.denied.at(-1).port, 2);
      assert.equal(log.denied_total, FLOOD + 1);
      assert.equal(log.denied_omitted, FLOOD + 1 - 64);
      assert.equal(log.truncated, true);
      assert.equal(countOf(log.denied_counts, '10.1.2.3:1'), 1, JSON.stringify(log.denied_counts));
      assert.equal(countOf(log.denied_counts, '10.1.2.3:2'), FLOOD, JSON.stringify(log.denied_counts));
      // The log was cut at 4096 bytes: its truncated line has the counts of then.
      const cut = await waitUntil(() => fs.existsSync(file) && /"kind":"truncated"/.test(fs.readFileSync(file, 'utf8')), { timeoutMs: 10_000 });
      assert.ok(cut, `${file} has no truncated line`);
      const marker = JSON.parse(fs.readFileSync(file, 'utf8').trimEnd().split('\n').find((l) => /"kind":"truncated"/.test(l)));
      assert.equal(countOf(marker.denied_counts, '10.1.2.3:1'), 1, JSON.stringify(marker));
      // Closed: the last line has the final counts.
      await call(c, 'close', { session_id: sid });
      const ended = await waitUntil(() => /"kind":"summary"/.test(fs.readFileSync(file, 'utf8')), { timeoutMs: 10_000 });
      assert.ok(ended, `${file} has no summary line`);
      const last = JSON.parse(fs.readFileSync(file, 'utf8').trimEnd().split('\n').at(-1));
      assert.equal(last.kind, 'summary', JSON.stringify(last));
      assert.equal(last.denied_total, FLOOD + 1);
      assert.equal(countOf(last.denied_counts, '10.1.2.3:1'), 1, JSON.stringify(last));
      assert.equal(countOf(last.denied_counts, '10.1.2.3:2'), FLOOD, JSON.stringify(last));
    });
  });

  test('past IGN_MCP_EGRESS_WILDCARD_NAMES names under a wildcard rule, lookups are refused and recorded', T, async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-egress-record-'));
    fs.chmodSync(dir, 0o755);
    const hosts = path.join(dir, 'hosts');
    fs.writeFileSync(hosts, '127.0.0.1 n1.wild.test n2.wild.test n3.wild.test n4.wild.test n5.wild.test exact.wild.test\n');
    try {
      await withServer({ IGN_MCP_EGRESS_HOSTS: hosts, IGN_MCP_NET_PRIVATE: 'host', IGN_MCP_EGRESS_WILDCARD_NAMES: 3 }, async (c) => {
        const o = await call(c, 'open_session', { network: 'allow', allow_hosts: ['*.wild.test', 'exact.wild.test'] });
        const sid = o.session_id;
        // busybox nslookup: an answer is a stand-in address (198.18.0.0/15).
        const r = await run(c, sid, 'for n in n1 n2 n3 n1 n4 n5 exact n2; do if nslookup $n.wild.test 2>&1 | grep -q "^Address.*198\\.1[89]\\."; then echo "$n yes"; else echo "$n no"; fi; done', { timeout_s: 90 });
        assert.equal(r.stdout, 'n1 yes\nn2 yes\nn3 yes\nn1 yes\nn4 no\nn5 no\nexact yes\nn2 yes\n', r.stderr);
        const log = await call(c, 'network_log', { session_id: sid });
        const why = 'over 3 names under one wildcard rule (IGN_MCP_EGRESS_WILDCARD_NAMES)';
        for (const n of ['n4', 'n5']) {
          assert.ok(log.dns_queries.some((q) => q.name === `${n}.wild.test` && q.allowed === false && q.reason === why),
            `no refusal of ${n}.wild.test for "${why}": ${JSON.stringify(log.dns_queries)}`);
          assert.ok(log.denied_counts.some((x) => x.kind === 'dns' && x.destination === `${n}.wild.test` && x.reason === why), JSON.stringify(log.denied_counts));
        }
        assert.ok(!log.dns_queries.some((q) => ['n1', 'n2', 'n3', 'exact'].some((n) => q.name === `${n}.wild.test`) && q.allowed === false),
          `a name within the cap was refused: ${JSON.stringify(log.dns_queries)}`);
      });
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});
