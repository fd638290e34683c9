// build.test.mjs: how the server is built.  A root server parses hostile
// input (JSON-RPC from the client, frames from every guest), so the plain
// build carries the usual hardening; and `make` compiles each source once per
// flavour, so a change rebuilds only what depends on it.  These look at the
// binaries and the Makefile, not at a backend: they run in the ns pass only.

import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { REPO, IS_NS } from './lib.mjs';

/* As make knows it (relative to the checkout, as tests/run.sh passes it):
 * the objects' dependency files name their targets that way. */
const BUILD = process.env.BUILD || 'build';
const PLAIN = path.resolve(REPO, BUILD, 'ignition-mcp');
const skip = !IS_NS ? 'the build is checked once, in the ns pass'
  : !fs.existsSync(PLAIN) ? `no plain build at ${PLAIN} (make)` : false;

const readelf = (...args) => execFileSync('readelf', ['-W', ...args, PLAIN], { encoding: 'utf8' });

describe('the plain server is hardened', { skip }, () => {
  test('it is a position-independent executable', () => {
    assert.match(readelf('-h'), /Type:\s+DYN /, 'not PIE: the build lost -fPIE/-pie');
  });

  test('its relocations are read-only after start (full RELRO)', () => {
    assert.match(readelf('-l'), /GNU_RELRO/, 'no GNU_RELRO segment: the build lost -z relro');
    assert.match(readelf('-d'), /\(FLAGS\)[^\n]*BIND_NOW|\(FLAGS_1\)[^\n]*NOW/, 'no BIND_NOW: the build lost -z now');
  });

  test('its stack is not executable', () => {
    const stack = readelf('-l').split('\n').find((l) => /GNU_STACK/.test(l));
    assert.ok(stack, 'no GNU_STACK header');
    assert.doesNotMatch(stack, /RWE/, `executable stack: ${stack.trim()}`);
  });

  test('it calls the stack protector and the fortified libc functions', () => {
    const syms = readelf('--dyn-syms');
    assert.match(syms, /__stack_chk_fail/, 'no __stack_chk_fail: the build lost -fstack-protector-strong');
    assert.match(syms, /__\w+_chk@/, 'no fortified (_chk) libc call: the build lost -D_FORTIFY_SOURCE');
  });
});

describe('make compiles each source once per flavour', { skip }, () => {
  /* What make would run after SRC changed, for the plain server, the
   * sanitizer server and one unit test binary. */
  const plan = (src) =>
    execFileSync('make', ['-n', '-C', REPO, `BUILD=${BUILD}`, '-W', src,
      `${BUILD}/ignition-mcp`, `${BUILD}/san/ignition-mcp`, `${BUILD}/test/test_proto`],
    { encoding: 'utf8' }).split('\n');

  /* Objects not built yet (a unit test not made before this run) are
   * compiled whatever changed: leave them out. */
  const compiled = (lines) => lines.filter((l) => / -c /.test(l))
    .filter((l) => fs.existsSync(path.resolve(REPO, l.match(/ -o (\S+)/)[1])));

  test('a changed source is compiled once for each flavour that links it, and nothing else is', () => {
    const lines = plan('common/log.c');
    const compiles = compiled(lines);
    assert.equal(compiles.length, 2, `expected common/log.c compiled for plain and san only:\n${compiles.join('\n')}`);
    for (const l of compiles) assert.match(l, / common\/log\.c$/, `something else was compiled: ${l}`);
    const links = lines.filter((l) => / -o \S+\/(ignition-mcp|test_proto) /.test(l));
    assert.equal(links.length, 3, `expected three links:\n${links.join('\n')}`);
  });

  test('a changed header recompiles the sources that include it, and not the others', () => {
    const compiles = compiled(plan('proto/proto.h')).map((l) => l.split(' ').pop());
    assert.ok(compiles.includes('proto/client.c'), `proto/client.c not recompiled after proto/proto.h changed:\n${compiles.join('\n')}`);
    for (const other of ['common/log.c', 'mcp/framing.c'])
      assert.ok(!compiles.includes(other), `${other} recompiled although it does not include proto/proto.h`);
  });
});
