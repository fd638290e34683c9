#!/usr/bin/env python3
"""make-seeds.py: writes the hand-made seed inputs of each fuzz target into
fuzz/corpus/<target>/seed-*.  libFuzzer grows the corpus from them; run this
again only to add seeds (existing files are rewritten, nothing is removed)."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_VERSION = 3

# proto/proto.h
T = dict(HELLO=1, HELLO_OK=2, ERROR=3, PING=4, PONG=5, EXEC=10, STDIN=11, STDIN_END=12,
         STDOUT=13, STDERR=14, EXIT=15, KILL=16, WRITE=20, DATA=21, DATA_END=22, OK=23,
         READ=24, READ_END=25, SETUP=30, UNPACK=40, PACK=41, PACK_END=42, CREDIT=43,
         EGRESS_STATS=58)
TAG = dict(VERSION=1, INFO=2, ERRNO=3, MESSAGE=4, COMMAND=10, CWD=11, ENV=12, TIMEOUT_MS=13,
           HAS_STDIN=14, EXIT_CODE=15, SIGNAL=16, TIMED_OUT=17, DURATION_US=18, PATH=20,
           MODE=21, SIZE=22, OFFSET=23, MAX=24, EOF=25, BYTES=26, ENTROPY=30, TIME_NS=31,
           HOSTNAME=32, MACHINE_ID=33, MAX_BYTES=40, MAX_FILES=41, WINDOW=42, FILES=43,
           DIRS=44, SYMLINKS=45, TREE_BYTES=46, SKIPPED=47, SKIP_PATH=48, SKIP_REASON=49,
           UDP=70, ICMP=71, OTHER=72)


def tlv(tag, val):
    if isinstance(val, str):
        val = val.encode()
    return struct.pack('<HI', TAG[tag], len(val)) + val


def u32(tag, v):
    return tlv(tag, struct.pack('<I', v & 0xffffffff))


def u64(tag, v):
    return tlv(tag, struct.pack('<Q', v))


def frame(type_, id_, payload=b''):
    return struct.pack('<IBBHI', len(payload), T[type_], 0, 0, id_) + payload


def write(target, name, data):
    d = os.path.join(HERE, 'corpus', target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, 'seed-' + name), 'wb') as f:
        f.write(data)


def rpc(method, params=None, id_=1):
    m = {'jsonrpc': '2.0', 'id': id_, 'method': method}
    if params is not None:
        m['params'] = params
    return json.dumps(m)


TOOL_ARGS = {
    'open_session': {},
    'run': {'session_id': 's-1-abcd', 'command': 'echo hi', 'timeout_s': 30, 'cwd': '/tmp',
            'env': {'A': '1'}, 'stdin': 'input'},
    'write_file': {'session_id': 's-1-abcd', 'path': '/tmp/a', 'content_base64': 'aGVsbG8=',
                   'mode': '0644'},
    'read_file': {'session_id': 's-1-abcd', 'path': '/tmp/a', 'offset': 0, 'max_bytes': 100},
    'reset': {'session_id': 's-1-abcd'},
    'close': {'session_id': 's-1-abcd'},
    'list_sessions': {},
}
TOOLS = list(TOOL_ARGS)


def mcp():
    init = rpc('initialize', {'protocolVersion': '2025-11-25', 'capabilities': {},
                              'clientInfo': {'name': 'fuzz', 'version': '1'}}, 0)
    lines = [init, json.dumps({'jsonrpc': '2.0', 'method': 'notifications/initialized'}),
             rpc('ping', id_='a'), rpc('tools/list', {}, 2.5),
             rpc('logging/setLevel', {'level': 'debug'}, 3)]
    for i, (tool, args) in enumerate(TOOL_ARGS.items()):
        lines.append(rpc('tools/call', {'name': tool, 'arguments': args,
                                        '_meta': {'progressToken': i}}, 10 + i))
    lines.append(json.dumps({'jsonrpc': '2.0', 'method': 'notifications/cancelled',
                             'params': {'requestId': 11, 'reason': 'x'}}))
    write('fuzz_mcp', 'session', ('\n'.join(lines) + '\n').encode())
    write('fuzz_mcp', 'malformed', b'{"jsonrpc":"2.0","id":1,"method":"ping"\n[1,2]\n'
          b'{"jsonrpc":"2.0","id":{},"method":"x"}\r\n\n  \n"\xff\xfe"\n'
          b'{"jsonrpc":"1.0","id":null,"result":1}\n{"a":"\\u0000"}\n')
    write('fuzz_mcp', 'oversize', b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"'
          + b'a' * 5000 + b'"}}\n' + rpc('ping').encode() + b'\n')


def tool_args():
    for i, (tool, args) in enumerate(TOOL_ARGS.items()):
        write('fuzz_tool_args', tool, bytes([i]) + json.dumps(args).encode())
    write('fuzz_tool_args', 'run-bad', bytes([1]) + b'{"session_id":7,"command":"","timeout_s":-1,'
          b'"env":{"A=B":"\\u0000"},"stdin":null}')
    write('fuzz_tool_args', 'base64', bytes([len(TOOLS)]) + b'aGVsbG8gd29ybGQ=')
    write('fuzz_tool_args', 'base64-bad', bytes([len(TOOLS)]) + b'aGVsbG8gd29ybGQ=x=')
    write('fuzz_tool_args', 'utf8', bytes([len(TOOLS) + 1]) + 'héllo €'.encode() + b'\xc3\x28\xf0\x9f\x98')


def proto_host():
    def host(which, hello, answer):
        return bytes([which]) + struct.pack('<H', len(hello)) + hello + answer
    exit_ = frame('EXIT', 0, u32('EXIT_CODE', 0) + u32('SIGNAL', 0) + u32('TIMED_OUT', 0)
                  + u64('DURATION_US', 1234))
    write('fuzz_proto_host', 'ping', host(0, b'', frame('PONG', 0, u32('VERSION', 1))))
    write('fuzz_proto_host', 'exec', host(1, frame('STDOUT', 5, b'noise'),
                                          frame('STDOUT', 0, b'hi\n') + frame('STDERR', 0, b'warn\n')
                                          + exit_))
    write('fuzz_proto_host', 'exec-stdin', host(2, b'', frame('STDOUT', 0, b'x' * 40) + exit_))
    write('fuzz_proto_host', 'read', host(3, b'', frame('DATA', 0, b'host\n') + frame(
        'READ_END', 0, u64('SIZE', 5) + u32('EOF', 1) + u64('BYTES', 5))))
    write('fuzz_proto_host', 'write', host(4, b'', frame('OK', 0)))
    write('fuzz_proto_host', 'write-error', host(4, b'', frame(
        'ERROR', 0, u32('ERRNO', 28) + tlv('MESSAGE', 'No space left on device'))))
    write('fuzz_proto_host', 'setup', host(5, b'', frame('OK', 0)))
    write('fuzz_proto_host', 'egress-stats', host(0xfa, b'', frame(
        'OK', 0, u64('UDP', 3) + u64('ICMP', 1) + u64('OTHER', 0))))
    write('fuzz_proto_host', 'egress-stats-error', host(0xfa, b'', frame(
        'ERROR', 0, u32('ERRNO', 2) + tlv('MESSAGE', 'the sandbox has no capture'))))
    write('fuzz_proto_host', 'hello-error', host(0, frame('ERROR', 0, u32('ERRNO', 71)
                                                          + tlv('MESSAGE', 'bad')), b''))
    def report(stream, skips=()):
        r = (u64('FILES', 1) + u64('DIRS', 1) + u64('SYMLINKS', 0) + u64('TREE_BYTES', 10)
             + u64('SKIPPED', len(skips)))
        for path, why in skips:
            r += tlv('SKIP_PATH', path) + tlv('SKIP_REASON', why)
        return r + u64('BYTES', stream)
    write('fuzz_proto_host', 'unpack', host(0xfd, b'', frame('CREDIT', 0, u32('WINDOW', 1 << 20))
                                           + frame('OK', 0, report(3000, [('src/dev/null', 'a device node')]))))
    write('fuzz_proto_host', 'unpack-credit-trickle',
          host(0xfd, b'', b''.join(frame('CREDIT', 0, u32('WINDOW', 1000)) for _ in range(3))
               + frame('ERROR', 0, u32('ERRNO', 27) + tlv('MESSAGE', 'the copy is larger than its cap'))))
    write('fuzz_proto_host', 'pack', host(0xfc, b'', frame('DATA', 0, b'x' * 1024)
                                         + frame('DATA', 0, b'y' * 100)
                                         + frame('PACK_END', 0, report(1124, [('out/a', 'a FIFO'),
                                                                             ('out/b', 'a socket')]))))
    write('fuzz_proto_host', 'pack-too-long', host(0xfc, b'', frame('DATA', 0, b'z' * 65536) * 2
                                                   + frame('PACK_END', 0, report(131072))))
    write('fuzz_proto_host', 'conn-error', host(1, b'', frame('ERROR', 0, tlv('MESSAGE', 'x'))[:8]
                                                + b'\0\0\0\0' + tlv('MESSAGE', 'x')))
    # Streams (call 9, first byte 0xfb): ids with bit 31, spelt out.
    T.update(STREAM_OPEN=50, STREAM_ACCEPT=51, STREAM_DATA=52, STREAM_CREDIT=53,
             STREAM_SHUT=54, STREAM_RESET=55, LOOKUP=56, LOOKUP_END=57)
    TAG.update(KIND=60, FAMILY=61, ADDR=62, PORT=63, NAME=64, QTYPE=65, TRANSPORT=66,
               RCODE=67, TTL=68, EGRESS_ERROR=69)
    A = 0x80000000
    def open_(n, port=443, family=4, addr=bytes([93, 184, 216, 34]), window=65536):
        return frame('STREAM_OPEN', A | n, u32('KIND', 1) + u32('FAMILY', family)
                     + tlv('ADDR', addr) + u32('PORT', port) + u32('WINDOW', window))
    def lookup(n, name, qtype=1, transport=1):
        return frame('LOOKUP', A | n, tlv('NAME', name) + u32('QTYPE', qtype)
                     + u32('TRANSPORT', transport))
    pong = frame('PONG', 0)
    write('fuzz_proto_host', 'stream', host(0xfb, b'', open_(1) + frame('STREAM_DATA', A | 1, b'GET / HTTP/1.1\r\n')
                                           + frame('STREAM_CREDIT', A | 1, u32('WINDOW', 100))
                                           + frame('STREAM_SHUT', A | 1)
                                           + open_(2, 25) + open_(3, 80, 6, bytes(15) + b'\1')
                                           + frame('STREAM_RESET', A | 3, u32('ERRNO', 104))
                                           + lookup(4, 'pypi.org') + lookup(5, 'evil.example', 16, 2)
                                           + frame('STREAM_DATA', A | 2, b'late') + pong))
    write('fuzz_proto_host', 'stream-over-window', host(0xfb, b'', open_(1, window=10)
                                                       + frame('STREAM_DATA', A | 1, b'x' * 2000) + pong))
    write('fuzz_proto_host', 'stream-ids-down', host(0xfb, b'', open_(2) + open_(1) + pong))
    write('fuzz_proto_host', 'hello-egress-error', host(0, frame('HELLO_OK', 0, u32('VERSION', PROTO_VERSION)
                                                                 + tlv('EGRESS_ERROR', 'no nf_tables')),
                                                         frame('PONG', 0)))


def open_tar_seed():
    """A small tree as the pax tar stream a host sends (made in memory)."""
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode='w', format=tarfile.PAX_FORMAT) as t:
        d = tarfile.TarInfo('dst')
        d.type = tarfile.DIRTYPE
        d.mode = 0o755
        t.addfile(d)
        for name, data in (('dst/a', b'hello\n'), ('dst/sub/b', b'x' * 5000)):
            f = tarfile.TarInfo(name)
            f.size = len(data)
            f.mode = 0o644
            t.addfile(f, io.BytesIO(data))
        s = tarfile.TarInfo('dst/link')
        s.type = tarfile.SYMTYPE
        s.linkname = 'a'
        t.addfile(s)
    return buf.getvalue()


def proto_guest():
    hello = frame('HELLO', 1, u32('VERSION', 1))
    write('fuzz_proto_guest', 'hello-ping', hello + frame('PING', 2))
    write('fuzz_proto_guest', 'exec', hello + frame('EXEC', 3, tlv('COMMAND', 'echo hi')
                                                    + tlv('CWD', '/') + tlv('ENV', 'A=1')
                                                    + u32('TIMEOUT_MS', 1000) + u32('HAS_STDIN', 0)))
    write('fuzz_proto_guest', 'exec-stdin', hello + frame('EXEC', 4, tlv('COMMAND', 'cat')
                                                          + u32('HAS_STDIN', 1))
          + frame('STDIN', 4, b'data') + frame('STDIN_END', 4) + frame('KILL', 4))
    write('fuzz_proto_guest', 'write', hello + frame('WRITE', 5, tlv('PATH', 'dir/f') + u32('MODE', 0o644)
                                                     + u64('SIZE', 8))
          + frame('DATA', 5, b'abcd') + frame('DATA', 5, b'efgh') + frame('DATA_END', 5)
          + frame('READ', 6, tlv('PATH', 'dir/f') + u64('OFFSET', 2) + u64('MAX', 4)))
    write('fuzz_proto_guest', 'read-missing', frame('READ', 7, tlv('PATH', '/nope') + u64('OFFSET', 0)
                                                    + u64('MAX', 10)))
    write('fuzz_proto_guest', 'setup', frame('SETUP', 8, tlv('ENTROPY', b'\1' * 32) + u64('TIME_NS', 1)
                                             + tlv('HOSTNAME', 'fuzz')
                                             + tlv('MACHINE_ID', '0123456789abcdef0123456789abcdef')))
    write('fuzz_proto_guest', 'hello-setup', frame('HELLO', 9, u32('VERSION', PROTO_VERSION)
                                                   + tlv('ENTROPY', b'\2' * 32) + u64('TIME_NS', 2)
                                                   + tlv('HOSTNAME', 'fuzz2'))
          + frame('PING', 10))
    tar = open_tar_seed()
    write('fuzz_proto_guest', 'unpack', hello + frame('UNPACK', 11, tlv('PATH', '/t/made/dst')
                                                      + u64('MAX_BYTES', 1 << 20) + u64('MAX_FILES', 100))
          + frame('DATA', 11, tar[:4096]) + frame('DATA', 11, tar[4096:]) + frame('DATA_END', 11)
          + frame('PACK', 12, tlv('PATH', '/t/made/dst') + u64('MAX_BYTES', 1 << 20)
                  + u64('MAX_FILES', 100) + u32('WINDOW', 512))
          + frame('CREDIT', 12, u32('WINDOW', 4096)) + frame('CREDIT', 12, u32('WINDOW', 1 << 20)))
    write('fuzz_proto_guest', 'unpack-kill', frame('UNPACK', 13, tlv('PATH', 'x') + u64('MAX_BYTES', 10)
                                                   + u64('MAX_FILES', 1))
          + frame('DATA', 13, tar[:1000]) + frame('KILL', 13) + frame('DATA_END', 13)
          + frame('PACK', 14, tlv('PATH', '/nope') + u64('MAX_BYTES', 1) + u64('MAX_FILES', 1)
                  + u32('WINDOW', 1))
          + frame('DATA', 15, b'x') + frame('CREDIT', 16, u32('WINDOW', 0)))
    write('fuzz_proto_guest', 'egress-stats', hello + frame('EGRESS_STATS', 30)
          + frame('EGRESS_STATS', 31, u64('UDP', 1)))
    write('fuzz_proto_guest', 'bad', frame('STDOUT', 9, b'x') + frame('EXEC', 10, b'\1\0\xff\xff\xff\xff'))
    # Streams and lookups (egress): the agent opens them, so what the host
    # sends here is for ids never opened, a host-opened stream, or frames
    # only the agent sends.
    def sframe(type_, id_, payload=b''):
        return struct.pack('<IBBHI', len(payload), type_, 0, 0, id_) + payload
    win = struct.pack('<HI', 42, 4) + struct.pack('<I', 4096)
    rcode = struct.pack('<HI', 67, 4) + struct.pack('<I', 0)
    addr = struct.pack('<HI', 62, 4) + bytes([198, 18, 0, 1])
    write('fuzz_proto_guest', 'streams', hello
          + sframe(50, 20, struct.pack('<HI', 60, 4) + struct.pack('<I', 1)) + sframe(52, 20, b'x')
          + sframe(51, 0x80000001, win) + sframe(52, 0x80000001, b'data')
          + sframe(53, 0x80000001, win) + sframe(54, 0x80000001) + sframe(55, 0x80000001)
          + sframe(56, 21, b'') + sframe(57, 0x80000002, rcode + addr) + sframe(53, 22, win))


def egress_policy():
    """fuzz_egress_policy: first byte 0 streams, 1 names, 2 entries, 3 addresses."""
    def ext_sni(name):
        return struct.pack('>HHHBH', 0, len(name) + 5, len(name) + 3, 0, len(name)) + name

    def hello(exts, frag=16384):
        body = (b'\x03\x03' + bytes(range(32)) + b'\x20' + bytes(32) + b'\x00\x04\x13\x01\x13\x02'
                + b'\x01\x00' + struct.pack('>H', len(exts)) + exts)
        hs = b'\x01' + struct.pack('>I', len(body))[1:] + body
        out = b''
        for i in range(0, len(hs), frag):
            part = hs[i:i + frag]
            out += b'\x16\x03\x01' + struct.pack('>H', len(part)) + part
        return out
    groups = b'\x00\x0a\x00\x04\x00\x02\x00\x1d'
    write('fuzz_egress_policy', 'tls-sni', b'\0' + hello(groups + ext_sni(b'pypi.org')))
    write('fuzz_egress_policy', 'tls-sni-fragmented', b'\0' + hello(ext_sni(b'files.pythonhosted.org'), 9))
    write('fuzz_egress_policy', 'tls-no-sni', b'\0' + hello(groups))
    write('fuzz_egress_policy', 'tls-two-names', b'\0' + hello(ext_sni(b'a.b') + ext_sni(b'c.d')))
    write('fuzz_egress_policy', 'http-host', b'\0GET /simple/ HTTP/1.1\r\nUser-Agent: pip\r\nHost: PyPI.org:443\r\n\r\n')
    write('fuzz_egress_policy', 'http-absolute', b'\0GET http://a.b/x HTTP/1.1\r\nHost: [2001:db8::1]:80\r\n\r\n')
    write('fuzz_egress_policy', 'http-connect', b'\0CONNECT evil.com:443 HTTP/1.1\r\nHost: evil.com:443\r\n\r\n')
    write('fuzz_egress_policy', 'http-folded', b'\0GET / HTTP/1.1\r\nHost: a.b\r\n x\r\nHost: c\r\n\r\n')
    write('fuzz_egress_policy', 'name', b'\1Files.PythonHosted.ORG.')
    write('fuzz_egress_policy', 'name-tunnel', b'\1' + b'q' * 63 + b'.' + b'r' * 63 + b'.t.example.com')
    write('fuzz_egress_policy', 'name-nul', b'\1pypi.org\0.evil.com')
    write('fuzz_egress_policy', 'entries', b'\2pypi.org\n*.example.com:8443\ngit.host.net:*\nPYPI.ORG.')
    write('fuzz_egress_policy', 'entries-bad', b'\2a.b\n0x7f000001\n[::1]:443\n*.com\nfoo..bar')
    write('fuzz_egress_policy', 'addr-v4', b'\3\xa9\xfe\xa9\xfe')
    write('fuzz_egress_policy', 'addr-v6-6to4', b'\3\x20\x02\x7f\x00\x00\x01' + bytes(10))


def dns():
    """fuzz_dns: DNS queries as a program sends them to the agent."""
    def q(name, qtype=1, flags=0x0100, an=0, ns=0, ar=0, qd=1, tail=b''):
        wire = b''.join(bytes([len(l)]) + l for l in name.split(b'.') if l) + b'\0'
        return struct.pack('>HHHHHH', 0x1234, flags, qd, an, ns, ar) + wire + struct.pack('>HH', qtype, 1) + tail
    write('fuzz_dns', 'a', q(b'pypi.org'))
    write('fuzz_dns', 'aaaa', q(b'files.pythonhosted.org', 28))
    write('fuzz_dns', 'txt-tunnel', q(b'.'.join([b'q' * 63] * 4) + b'.evil.example', 16))
    write('fuzz_dns', 'edns', q(b'a.example', 1, ar=1, tail=b'\0\0\x29\x04\xd0\0\0\0\0\0\0'))
    write('fuzz_dns', 'root', q(b'', 2))
    write('fuzz_dns', 'pointer-back', struct.pack('>HHHHHH', 1, 0x100, 1, 0, 0, 0) + b'\1a\xc0\x05\0\1\0\1')
    write('fuzz_dns', 'pointer-loop', struct.pack('>HHHHHH', 1, 0x100, 1, 0, 0, 0) + b'\1a\xc0\x0c\0\1\0\1')
    write('fuzz_dns', 'counts-over', q(b'a.b', an=0xffff))
    write('fuzz_dns', 'label-dot-nul', struct.pack('>HHHHHH', 1, 0x100, 1, 0, 0, 0) + b'\x08evil.com\3a\0b\0\0\1\0\1')
    write('fuzz_dns', 'response', q(b'a.b', flags=0x8180))
    write('fuzz_dns', 'update', q(b'a.b', flags=0x2800))


mcp()
tool_args()
proto_host()
proto_guest()
egress_policy()
dns()
