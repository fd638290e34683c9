// report.mjs: turns the harness's results into bench/BENCHMARKS.md (a
// headline, then a table per section: median, p90, p99, samples, ratio to the
// section's baseline) and bench/results.json (the same plus every raw sample).

import fs from 'node:fs';
import path from 'node:path';
import { stats } from './lib.mjs';

function fmt(v, unit) {
  if (v == null || Number.isNaN(v)) return '–';
  const a = Math.abs(v);
  const d = unit === 'runs/s' ? 0 : a < 10 ? 2 : a < 100 ? 1 : 0;
  return v.toFixed(d);
}

function ratio(v, b) {
  if (v == null || b == null || !b) return '–';
  const r = v / b;
  return `${r < 0.1 ? r.toPrecision(2) : r < 10 ? r.toFixed(2) : r.toFixed(1)}×`;
}

const esc = (s) => String(s).replace(/\|/g, '\\|').replace(/\n/g, ' ');

/* Adds .stats to every measured row. */
function withStats(section) {
  for (const r of section.rows) {
    if (r.samples?.length) r.stats = stats(r.samples, { higherIsBetter: !!(r.higherIsBetter ?? section.higherIsBetter) });
    if (r.latency?.length) r.latency_stats = stats(r.latency);
  }
}

function findRow(results, id, label) {
  const s = results.sections.find((x) => x.id === id);
  return s?.rows.find((r) => r.label === label);
}

function tableFor(section, rows) {
  /* A group whose rows share a unit of their own is headed by it. */
  const unit = rows[0]?.unit && rows.every((r) => r.unit === rows[0].unit) ? rows[0].unit : section.unit;
  const byLabel = new Map(section.rows.map((r) => [r.label, r]));
  const tput = section.id === 'throughput';
  const head = tput
    ? `| what | runs/s median | p90 | p99 | n | × baseline | per-run latency ms p50 / p90 / p99 | notes |\n|---|---:|---:|---:|---:|---:|---:|---|`
    : `| what | median ${unit} | p90 | p99 | n | × baseline | notes |\n|---|---:|---:|---:|---:|---:|---|`;
  const lines = [head];
  for (const r of rows) {
    const u = r.unit || unit;
    if (r.notMeasured) {
      const cells = tput ? '– | – | – | – | – | –' : '– | – | – | – | –';
      lines.push(`| ${esc(r.label)} | ${cells} | not measured: ${esc(r.notMeasured)} |`);
      continue;
    }
    const base = byLabel.get(r.baseline || section.baseline);
    const isBase = base === r;
    const st = r.stats;
    const rat = isBase ? 'baseline' : ratio(st.median, base?.stats?.median);
    const cells = [fmt(st.median, u), fmt(st.p90, u), fmt(st.p99, u), st.n, rat];
    if (tput) {
      const l = r.latency_stats;
      cells.push(l ? `${fmt(l.median, 'ms')} / ${fmt(l.p90, 'ms')} / ${fmt(l.p99, 'ms')}` : '–');
    }
    lines.push(`| ${esc(r.label)} | ${cells.join(' | ')} | ${esc(r.extra || '')} |`);
  }
  return lines.join('\n');
}

/* A layer's cost as printed: within the noise (its p25..p75 holds 0), or
 * the median of its paired differences.  Layers from a run before the
 * pairing carry only `ms`. */
const layerCost = (l) => (l.noise ? 'within the noise' : fmt(l.ms, 'ms'));

function sectionMd(section) {
  const out = [`## ${section.title}`, ''];
  if (section.kept_from) out.push(`(Not measured again in this run: kept from the run of ${section.kept_from}.)`, '');
  if (section.failed) {
    out.push(`The section failed: ${esc(section.failed)}`, '');
    return out.join('\n');
  }
  if (section.grouped) {
    const groups = [...new Set(section.rows.map((r) => r.group))];
    for (const g of groups) {
      const title = section.id === 'throughput' ? `${g} session${g === '1' ? '' : 's'} at once`
        : section.id === 'memory' ? `${g} idle session${g === '1' ? '' : 's'} (MiB PSS per session)` : g;
      out.push(`### ${title}`, '', tableFor(section, section.rows.filter((r) => r.group === g)), '');
    }
  } else {
    out.push(tableFor(section, section.rows), '');
  }
  if (section.layers?.length) {
    if (section.layers.some((l) => l.lo != null)) {
      out.push('Cost added by each layer of the ns exec path for `true`, from paired samples: within each iteration of the loop, the layer\'s sample minus the sample of the layer below it; the median of those differences and their middle half (p25 to p75). A layer whose middle half holds 0 costs less than the noise can show.', '');
    } else {
      out.push('Cost added by each layer of the ns exec path (differences of the `true` medians above):', '');
    }
    out.push('| layer | adds (ms, median of differences) | p25 … p75 |', '|---|---:|---:|');
    for (const l of section.layers) out.push(`| ${l.layer} | ${layerCost(l)} | ${l.lo == null ? '' : `${fmt(l.lo, 'ms')} … ${fmt(l.hi, 'ms')}`} |`);
    out.push('');
  }
  for (const n of section.notes || []) out.push(`- ${n}`);
  out.push('', `(${section.seconds ?? '?'} s)`, '');
  return out.join('\n');
}

/* "median X, p99 Y = R× baseline (B)[, R2× other (B2)]" for the headline;
 * `also` names further [section, label] baselines. */
function keyLine(results, id, label, baseLabel, unit = 'ms', also = []) {
  const r = findRow(results, id, label);
  if (!r) return null;
  if (r.notMeasured) return r.notMeasured === results.vm?.error ? 'not measured (the vm backend: see above)' : `not measured: ${r.notMeasured}`;
  const st = r.stats;
  const tail = `median ${fmt(st.median, unit)} ${unit}, p99 ${fmt(st.p99, unit)} ${unit}`;
  const vs = [[id, baseLabel], ...also]
    .map(([sid, l]) => findRow(results, sid, l))
    .filter((b) => b?.stats)
    .map((b) => `**${ratio(st.median, b.stats.median)}** ${esc(b.label)} (${fmt(b.stats.median, unit)} ${unit})`);
  return vs.length ? `${tail} = ${vs.join(', ')}` : tail;
}

function headline(results) {
  const m = results.machine;
  const out = ['## Headline', ''];
  out.push(`- Machine: ${m.nproc} cores, ${m.cpu}, ${m.mem_gib} GiB, kernel ${m.kernel}${m.os ? `, ${m.os}` : ''}${m.virtual_machine ? ', itself a virtual machine' : ''}; /dev/kvm ${m.dev_kvm}; KVM used: ${m.kvm_used}. Load average at start: ${m.loadavg_at_start}.`);
  out.push(`- Date: ${results.started} (${results.mode} run, ${results.seconds} s, tree ${results.git}, Node ${m.node}).`);
  out.push(`- vm backend: ${results.vm?.error ? `not measured: ${esc(results.vm.error)}` : `${results.vm?.isolation}, open path ${results.vm?.path ?? 'not reported'}`}.`);
  out.push('- The machine is shared and noisy: read the ratios (to a baseline measured in the same run), not the absolute times.', '');
  const lines = [
    ['ns open_session', 'start', 'ns open_session (MCP, SDK client)', 'bwrap --unshare-all --ro-bind / / --dev /dev --proc /proc --die-with-parent true'],
    ['vm open_session, pool hit', 'start', 'vm open_session, pool hit', 'bwrap --unshare-all --ro-bind / / --dev /dev --proc /proc --die-with-parent true'],
    ['vm open_session, restore', 'start', 'vm open_session, restore (IGN_MCP_POOL=0)', 'bwrap --unshare-all --ro-bind / / --dev /dev --proc /proc --die-with-parent true'],
    ['vm cold boot', 'start', 'vm open_session, cold boot (no snapshot: IGN_MCP_BASE=none)', 'bare QEMU cold boot to agent HELLO_OK (tcg, no server)'],
    ["ns run('true'), MCP", 'exec', 'ns: MCP run, SDK client: true', "host: sh -c 'true'"],
    ["ns run('true'), no MCP", 'exec', 'ns: session layer, no MCP: true', "host: sh -c 'true'"],
    ["vm run('true'), MCP", 'exec', 'vm: MCP run, SDK client: true', "host: sh -c 'true'"],
    ['ns write_file 1 MiB', 'files', '1 MiB write: ns: MCP, SDK client', '1 MiB write: host tmpfs (C write/read)', 'MB/s'],
    ['ns read_file 1 MiB', 'files', '1 MiB read: ns: MCP, SDK client', '1 MiB read: host tmpfs (C write/read)', 'MB/s'],
    ["ns 8 sessions × run('true')", 'throughput', "8 at once: ns sessions, MCP run('true')", '8 at once: host sh -c true', 'runs/s'],
    ['ns memory, 8 idle sessions', 'memory', '8 idle: ns sessions', '8 idle: bwrap sandbox running sleep', 'MiB'],
    ['vm memory, 8 idle sessions', 'memory', '8 idle: vm sessions', '8 idle: bwrap sandbox running sleep', 'MiB'],
    ["ns python3 -c 'print(1)'", 'workload', "python3 -c 'print(1)': ns session (MCP run)", "python3 -c 'print(1)': host"],
    ['ns gcc hello.c', 'workload', 'gcc -o hello hello.c: ns session (MCP run)', 'gcc -o hello hello.c: host'],
    ['vm fork to the first run in the fork', 'stages', "vm: fork(count 1) to the first run('true') answering in the fork", 'vm: open_session, base restore'],
    ['vm commit of an idle session', 'stages', 'vm: commit of an idle session (wall)', 'vm: open_session, base restore'],
    ['vm open_session(stage)', 'stages', 'vm: open_session(stage)', 'vm: open_session, base restore'],
    ['vm stage of an idle session on disk', 'stages', 'vm: stage of an idle session, allocated (MiB)', 'vm: warm base RAM file, allocated (MiB)', 'MiB'],
    ['ns fork to the first run in the fork', 'stages', "ns: fork(count 1) to the first run('true') answering in the fork", 'ns: open_session from the base'],
    ['ns commit of an idle session', 'stages', 'ns: commit of an idle session (wall)', 'ns: open_session from the base'],
    ['ns open_session(stage)', 'stages', 'ns: open_session(stage)', 'ns: open_session from the base'],
    ['srt per command (library)', 'peer', "srt (sandbox-runtime library): wrapWithSandbox('true') + spawn", 'host: sh -c true via Node child_process.spawn'],
    ["ns run('true') over HTTP, keep-alive", 'http', "ns: run('true'), HTTP keep-alive, raw client", "ns: run('true'), stdio, raw client"],
    ['ns 32 clients × 8 sessions over HTTP', 'http', '32 clients × 8 sessions: HTTP (32 keep-alive connections)', '32 clients × 8 sessions: stdio (one pipe)', 'runs/s'],
    ['HTTP memory per idle keep-alive connection', 'http', 'RSS added per idle keep-alive connection', '', 'KiB'],
    ["ours, ns run('true') (same section)", 'peer', "ignition-mcp ns: run('true') through MCP (SDK client), live session", 'host: sh -c true via Node child_process.spawn'],
  ];
  // The bare QEMU row names its accelerator.
  const bare = results.sections.find((s) => s.id === 'start')?.rows.find((r) => r.label.startsWith('bare QEMU'));
  const bwrap = [['start', 'bwrap --unshare-all --ro-bind / / --dev /dev --proc /proc --die-with-parent true']];
  // The vm stage rows also against a cold boot (section 1).
  const cold = [['start', 'vm open_session, cold boot (no snapshot: IGN_MCP_BASE=none)']];
  for (const [what, id, label, base, unit] of lines) {
    const b = id === 'start' && base.startsWith('bare QEMU') && bare ? bare.label : base;
    const also = id === 'exec' ? bwrap : id === 'stages' && label.startsWith('vm') && unit !== 'MiB' ? cold : [];
    const k = keyLine(results, id, label, b, unit, also);
    if (k) out.push(`- ${what}: ${k}`);
  }
  for (const b of ['vm', 'ns']) {
    const f = findRow(results, 'stages', `${b}: fork: the source paused (paused_ms)`);
    const c = findRow(results, 'stages', `${b}: commit: the source paused (paused_ms)`);
    if (f?.stats && c?.stats) out.push(`- ${b}: the source of a fork was paused ${fmt(f.stats.median, 'ms')} ms at the median (p99 ${fmt(f.stats.p99, 'ms')}), of a commit ${fmt(c.stats.median, 'ms')} ms (p99 ${fmt(c.stats.p99, 'ms')}), as the server reports it (paused_ms).`);
  }
  const exec = results.sections.find((s) => s.id === 'exec');
  if (exec?.layers?.length > 1) {
    const [proc, ...ours] = exec.layers;
    const sum = ours.reduce((a, l) => a + l.ms, 0);
    const how = exec.layers.some((l) => l.lo != null) ? 'median of paired differences' : 'differences of medians';
    out.push(`- Exec path of ns run('true'), cost per layer (${how}): ${exec.layers.map((l) => `${l.layer} ${l.noise ? 'within the noise' : `${fmt(l.ms, 'ms')} ms`}`).join('; ')}.`);
    /* The two MCP rows (server, SDK) are one layer for the verdict: each
     * alone is a difference of ~0.1 ms, within the noise between runs. */
    const groups = [
      ['the agent and its protocol', ours.filter((l) => l.layer.startsWith('agent'))],
      ['the ns sandbox and the session layer', ours.filter((l) => l.layer.startsWith('ns sandbox'))],
      ['MCP over stdio (the server\'s JSON-RPC and tool layer, and the client)', ours.filter((l) => /MCP|SDK/.test(l.layer))],
    ].map(([name, ls]) => ({ name, ms: ls.reduce((a, l) => a + l.ms, 0) }));
    const worst = groups.sort((a, b) => b.ms - a.ms)[0];
    if (!(worst.ms > 0)) out.push(`- Every layer ignition-mcp adds to exec is within the noise of this run, next to the ${fmt(proc.ms, 'ms')} ms the process start itself costs.`);
    else out.push(`- The slowest layer ignition-mcp adds to exec is **${worst.name}** (+${fmt(worst.ms, 'ms')} ms); all its layers together add ${fmt(sum, 'ms')} ms to the ${fmt(proc.ms, 'ms')} ms the process start itself costs (a layer within the noise counted as 0).`);
  }
  const srt = findRow(results, 'peer', "srt (sandbox-runtime library): wrapWithSandbox('true') + spawn");
  const ours = findRow(results, 'peer', "ignition-mcp ns: run('true') through MCP (SDK client), live session");
  if (srt?.stats && ours?.stats) out.push(`- Per command, ignition-mcp (ns, live session) vs srt (fresh sandbox per command): **${ratio(srt.stats.median, ours.stats.median)}** faster at the median.`);
  out.push('');
  return out.join('\n');
}

export function writeReport(results, dir) {
  for (const s of results.sections) withStats(s);
  const md = [
    '# ignition-mcp benchmarks',
    '',
    `Written by \`make ${results.mode === 'quick' ? 'bench-quick' : 'bench'}\` (bench/bench.mjs); raw samples in bench/results.json. Each table gives the median, p90 and p99 (nearest rank; with fewer than 100 samples p99 is the largest, and with fewer than 10 p90 is too) of n samples, and the ratio of the median to the section's baseline measured in the same run.`,
    '',
    headline(results),
    ...results.sections.map(sectionMd),
  ].join('\n');
  const mdPath = path.join(dir, 'BENCHMARKS.md');
  const jsonPath = path.join(dir, 'results.json');
  fs.writeFileSync(mdPath, md);
  fs.writeFileSync(jsonPath, JSON.stringify(results, null, 1) + '\n');
  return { md: mdPath, json: jsonPath };
}
