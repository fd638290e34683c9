# h2raw.py: an HTTP/2 client made of hand-built frames, for what curl will
# not send (tests/e2e/secrets.test.mjs copies it to /root/h2raw.py):
#   h2raw.py get HOST PORT PATH [NAME=VALUE ...]
#       one GET with these fields in this order (a name may repeat: cookie
#       crumbs), read to the GOAWAY or the end; prints one JSON line:
#       status200 (the response's first field is the indexed ":status:
#       200"), body (bytes of DATA), goaway.
#   h2raw.py hold HOST PORT PATH SECONDS
#       a GET from a client that grants no window (SETTINGS_INITIAL_WINDOW_SIZE
#       0) and PINGs every half second, for SECONDS; prints "holding" once
#       its request is sent, "held N" at the end (N: the frames it got).
# HPACK: literals without indexing, no Huffman (what it sends); of what it
# gets only the first byte of the response's field block is looked at.
import json
import os
import socket
import ssl
import struct
import sys
import time

DATA, HEADERS, RST, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
END_STREAM, END_HEADERS, ACK = 1, 4, 1


def frame(typ, flags, sid, payload=b''):
    return struct.pack('>I', len(payload))[1:] + bytes([typ, flags]) + struct.pack('>I', sid) + payload


def length(n):  # an HPACK integer, 7-bit prefix, no Huffman
    if n < 127:
        return bytes([n])
    out, n = [127], n - 127
    while n >= 128:
        out.append(n & 127 | 128)
        n >>= 7
    return bytes(out + [n])


def literal(name, value):
    name, value = name.encode(), value.encode()
    return b'\x00' + length(len(name)) + name + length(len(value)) + value


def connect(host, port, window=None):
    ctx = ssl.create_default_context(cafile=os.environ['SSL_CERT_FILE'])
    ctx.set_alpn_protocols(['h2'])
    t = ctx.wrap_socket(socket.create_connection((host, port), timeout=20), server_hostname=host)
    assert t.selected_alpn_protocol() == 'h2', t.selected_alpn_protocol()
    settings = b'' if window is None else struct.pack('>HI', 4, window)
    t.sendall(b'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n' + frame(SETTINGS, 0, 0, settings))
    return t


def request(t, host, port, path, fields=()):
    block = b''.join(literal(n, v) for n, v in
                     [(':method', 'GET'), (':scheme', 'https'), (':path', path),
                      (':authority', '%s:%d' % (host, port))] + list(fields))
    t.sendall(frame(HEADERS, END_STREAM | END_HEADERS, 1, block))


class Reader:
    def __init__(self, t):
        self.t, self.buf = t, b''

    def next(self):
        while len(self.buf) < 9 or len(self.buf) < 9 + int.from_bytes(self.buf[:3], 'big'):
            try:
                d = self.t.recv(65536)
            except (ssl.SSLError, OSError):
                d = b''
            if not d:
                return None
            self.buf += d
        n = int.from_bytes(self.buf[:3], 'big')
        f = (self.buf[3], self.buf[4], int.from_bytes(self.buf[5:9], 'big') & 0x7fffffff, self.buf[9:9 + n])
        self.buf = self.buf[9 + n:]
        return f


def get(host, port, path, fields):
    t = connect(host, port)
    request(t, host, port, path, fields)
    r = Reader(t)
    out = {'status200': None, 'body': 0, 'goaway': False}
    while True:
        f = r.next()
        if f is None:
            break
        typ, flags, sid, p = f
        if typ == SETTINGS and not flags & ACK:
            t.sendall(frame(SETTINGS, ACK, 0))
        elif typ == HEADERS and sid == 1 and out['status200'] is None:
            out['status200'] = p[:1] == b'\x88'
        elif typ == DATA and sid == 1:
            out['body'] += len(p)
        elif typ == GOAWAY:
            out['goaway'] = True
        if typ == RST or typ == GOAWAY:
            break  # after the answer, the broker ends the connection with a GOAWAY
    print(json.dumps(out))


def hold(host, port, path, seconds):
    t = connect(host, port, window=0)
    request(t, host, port, path)
    print('holding', flush=True)
    t.settimeout(0.5)
    r = Reader(t)
    got, until = 0, time.time() + seconds
    while time.time() < until:
        try:
            t.sendall(frame(PING, 0, 0, b'12345678'))
        except OSError:
            break
        try:
            while r.next() is not None:
                got += 1
        except socket.timeout:
            pass
    print('held', got)


if __name__ == '__main__':
    mode, host, port, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if mode == 'get':
        get(host, port, path, [tuple(a.split('=', 1)) for a in sys.argv[5:]])
    else:
        hold(host, port, path, float(sys.argv[5]))
