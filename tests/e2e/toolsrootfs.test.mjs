// toolsrootfs.test.mjs: the Debian tools rootfs works for real work:
// python3, a C toolchain, git, make.

import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startServer, openSession, run, sh, writeFile, TOOLS_SKIP } from './lib.mjs';

const T = { timeout: 120_000, skip: TOOLS_SKIP };

describe('tools rootfs', { skip: TOOLS_SKIP }, () => {
  let s, c, sid;
  before(async () => {
    s = await startServer({ tools: true });
    c = s.client;
    sid = await openSession(c);
  });
  after(() => s?.close());

  test("python3 -c 'print(1)' prints 1", T, async () => {
    const r = await run(c, sid, "python3 -c 'print(1)'");
    assert.equal(r.exit_code, 0, r.stderr);
    assert.equal(r.stdout, '1\n');
  });

  test('gcc compiles and runs a hello world written with write_file', T, async () => {
    await writeFile(c, sid, '/root/src/hello.c', '#include <stdio.h>\nint main(void){puts("hello from gcc");return 7;}\n');
    await sh(c, sid, 'gcc -O2 -o /root/src/hello /root/src/hello.c', { timeout_s: 120 });
    const r = await run(c, sid, './hello', { cwd: '/root/src' });
    assert.equal(r.stdout, 'hello from gcc\n');
    assert.equal(r.exit_code, 7);
  });

  test('make and git work', T, async () => {
    await writeFile(c, sid, '/root/proj/Makefile', 'all:\n\t@echo built > out.txt\n');
    await sh(c, sid, 'make -s', { cwd: '/root/proj' });
    assert.equal(await sh(c, sid, 'cat out.txt', { cwd: '/root/proj' }), 'built\n');
    const out = await sh(
      c,
      sid,
      'git init -q . && git -c user.email=e@x -c user.name=e add -A && git -c user.email=e@x -c user.name=e commit -qm init && git log --oneline | wc -l',
      { cwd: '/root/proj' },
    );
    assert.equal(out.trim(), '1');
  });

  test('python sees a fresh CRNG: two sessions draw different random bytes', T, async () => {
    const other = await openSession(c);
    const cmd = "python3 -c 'import os; print(os.urandom(16).hex())'";
    const [a, b] = await Promise.all([sh(c, sid, cmd), sh(c, other, cmd)]);
    assert.match(a, /^[0-9a-f]{32}\n$/);
    assert.notEqual(a, b);
  });
});
