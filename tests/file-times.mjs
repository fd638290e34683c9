// A node --test reporter: the time each test file took, one "SECONDS FILE"
// line per file, for the slowest-files table that tests/run.sh prints at
// the end of a run.  A file's time is the sum of its top-level tests'
// durations (its describe() blocks and tests outside them), so it leaves
// out only the start of the file's process.
import path from 'node:path';

export default async function* fileTimes(source) {
  const ms = new Map();
  for await (const event of source) {
    if (event.type !== 'test:pass' && event.type !== 'test:fail') continue;
    const { file, nesting, details } = event.data;
    if (nesting !== 0 || !file) continue;
    ms.set(file, (ms.get(file) ?? 0) + (details?.duration_ms ?? 0));
  }
  for (const [file, total] of ms)
    yield `${(total / 1000).toFixed(1)} ${path.relative(process.cwd(), file)}\n`;
}
