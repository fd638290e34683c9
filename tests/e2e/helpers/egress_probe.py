# egress_probe.py: what the rows of tests/e2e/egress-bypass.test.mjs run in the
# sandbox (copied to /root/eg.py, imported by each row's snippet).  Every probe
# returns a dict saying what the program saw: "data" (bytes came back),
# "eof", "reset" (ECONNRESET or EPIPE after a reset), "refused"
# (ECONNREFUSED), "timeout", or the errno's name; the row prints one JSON
# line (out()) that the test parses.
import errno
import json
import os
import random
import socket
import ssl
import struct
import sys
import time


def out(**kw):
    print(json.dumps(kw))
    sys.stdout.flush()


def kind(e):
    if isinstance(e, (ConnectionResetError, BrokenPipeError)):
        return "reset"
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "timeout"
    if isinstance(e, ssl.SSLEOFError):
        return "eof"
    if isinstance(e, ssl.SSLError):
        return "ssl:" + str(e.reason)
    if isinstance(e, socket.gaierror):
        return "gai:" + str(e.errno)
    if isinstance(e, OSError) and e.errno:
        return errno.errorcode.get(e.errno, str(e.errno))
    return type(e).__name__


def tcp(host, port, payload=None, fam=None, timeout=15):
    """Connect, send PAYLOAD (by default a GET naming HOST), read once."""
    if fam is None:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    if payload is None:
        name = "[" + host + "]" if ":" in host else host
        payload = b"GET / HTTP/1.0\r\nHost: " + name.encode() + b"\r\n\r\n"
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(timeout)
    stage = "connect"
    try:
        s.connect((host, port))
        stage = "send"
        if payload:
            s.sendall(payload)
        stage = "recv"
        d = s.recv(65536)
        if not d:
            return {"stage": stage, "result": "eof"}
        return {"stage": stage, "result": "data", "data": d[:300].decode("latin1")}
    except Exception as e:  # noqa: BLE001 - every failure is a result here
        return {"stage": stage, "result": kind(e), "err": str(e)}
    finally:
        s.close()


def tls(host, port, sni, cafile=None, timeout=15, request=None):
    """A TLS handshake naming SNI (None: no SNI), then one request."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if cafile:
        ctx.load_verify_locations(cafile)
    stage = "connect"
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        stage = "handshake"
        ss = ctx.wrap_socket(s, server_hostname=sni)
        stage = "send"
        ss.sendall(request or ("GET /hello HTTP/1.0\r\nHost: %s\r\n\r\n" % (sni or host)).encode())
        stage = "recv"
        d = ss.recv(65536)
        ss.close()
        if not d:
            return {"stage": stage, "result": "eof"}
        return {"stage": stage, "result": "data", "data": d[:300].decode("latin1")}
    except Exception as e:  # noqa: BLE001
        return {"stage": stage, "result": kind(e), "err": str(e)}
    finally:
        s.close()


def qname(name):
    """NAME (str or bytes, dotted) in DNS wire form; labels as given, even
    over 63 bytes (the length byte then says what the label holds, mod 256)."""
    if isinstance(name, str):
        name = name.encode("latin1")
    wire = b""
    for label in name.split(b"."):
        if label:
            wire += bytes([len(label) & 0xFF]) + label
    return wire + b"\0"


def dns_packet(name, qtype=1, qid=None):
    qid = random.randrange(1, 65536) if qid is None else qid
    return qid, struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qname(name) + struct.pack("!HH", qtype, 1)


def skip_name(m, off):
    while True:
        n = m[off]
        if n == 0:
            return off + 1
        if n & 0xC0 == 0xC0:
            return off + 2
        off += 1 + n


def parse_answer(m):
    qid, flags, qd, an = struct.unpack("!HHHH", m[:8])
    off = 12
    for _ in range(qd):
        off = skip_name(m, off) + 4
    addrs = []
    for _ in range(an):
        off = skip_name(m, off)
        t, _c, _ttl, ln = struct.unpack("!HHIH", m[off:off + 10])
        off += 10
        if t == 1 and ln == 4:
            addrs.append(socket.inet_ntoa(m[off:off + 4]))
        off += ln
    return {"id": qid, "rcode": flags & 0xF, "addrs": addrs}


def dns(name, server="8.8.8.8", qtype=1, tcp_=False, port=53, timeout=8):
    """One query to SERVER:PORT; {"rcode", "addrs"} or {"result": error}."""
    qid, pkt = dns_packet(name, qtype)
    try:
        if tcp_:
            s = socket.create_connection((server, port), timeout=timeout)
            s.sendall(struct.pack("!H", len(pkt)) + pkt)
            buf = b""
            while len(buf) < 2 or len(buf) < 2 + struct.unpack("!H", buf[:2])[0]:
                d = s.recv(65536)
                if not d:
                    return {"result": "eof", "got": len(buf)}
                buf += d
            s.close()
            m = buf[2:]
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(timeout)
            s.sendto(pkt, (server, port))
            m, src = s.recvfrom(65536)
            s.close()
            if src[0] != server:
                return {"result": "answer from another address", "src": src[0]}
        a = parse_answer(m)
        if a["id"] != qid:
            return {"result": "wrong id"}
        return a
    except Exception as e:  # noqa: BLE001
        return {"result": kind(e), "err": str(e)}


def resolve(name):
    """What the C library says: the address, or the gaierror."""
    try:
        return {"addr": socket.gethostbyname(name)}
    except Exception as e:  # noqa: BLE001
        return {"result": kind(e), "err": str(e)}


def synthetic(addr):
    """In 198.18.0.0/15, where the sandbox's DNS answers point."""
    a = struct.unpack("!I", socket.inet_aton(addr))[0]
    return (a & 0xFFFE0000) == 0xC6120000


def udp_send(host, port, data=b"x"):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_DGRAM)
    try:
        s.sendto(data, (host, port))
        return {"result": "sent"}
    except Exception as e:  # noqa: BLE001
        return {"result": kind(e), "err": str(e)}
    finally:
        s.close()


def icmp_echo(host):
    """An echo request from a raw socket, then from a ping socket."""
    res = {}
    pkt = struct.pack("!BBHHH", 8, 0, 0, 0x1234, 1) + b"egress"
    csum = 0
    for i in range(0, len(pkt), 2):
        csum += (pkt[i] << 8) + (pkt[i + 1] if i + 1 < len(pkt) else 0)
    csum = (csum >> 16) + (csum & 0xFFFF)
    csum = ~(csum + (csum >> 16)) & 0xFFFF
    pkt = pkt[:2] + struct.pack("!H", csum) + pkt[4:]
    for name, typ in (("raw", socket.SOCK_RAW), ("ping", socket.SOCK_DGRAM)):
        stage = "socket"
        try:
            s = socket.socket(socket.AF_INET, typ, socket.IPPROTO_ICMP)
            stage = "send"
            s.settimeout(2)
            s.sendto(pkt, (host, 0))
            stage = "recv"
            s.recvfrom(2048)
            res[name] = {"stage": stage, "result": "data"}
        except Exception as e:  # noqa: BLE001
            res[name] = {"stage": stage, "result": kind(e), "err": str(e)}
    return res


# ---- netlink, for the vm rows (the guest's root speaks it itself) ----

NLM_F_REQUEST, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL = 1, 4, 0x400, 0x200


def nlattr(t, data):
    n = 4 + len(data)
    return struct.pack("=HH", n, t) + data + b"\0" * ((4 - n % 4) % 4)


def nl_acks(s, want, timeout=5):
    """The errors (0 = ok) of the WANT acks that come back."""
    s.settimeout(timeout)
    errs = []
    while len(errs) < want:
        d = s.recv(65536)
        off = 0
        while off + 16 <= len(d):
            ln, typ = struct.unpack("=IH", d[off:off + 6])
            if typ == 2:  # NLMSG_ERROR
                errs.append(-struct.unpack("=i", d[off + 16:off + 20])[0])
            off += (ln + 3) & ~3
            if ln == 0:
                break
    return errs


def nft_delete_table(name="ign_egress"):
    """Deletes the inet table NAME in one nfnetlink batch: the error of the
    delete (0: done; ENOENT: there was none)."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
    s.bind((0, 0))

    def msg(t, flags, seq, fam, res_id, payload):
        body = struct.pack("=BBH", fam, 0, socket.htons(res_id)) + payload
        return struct.pack("=IHHII", 16 + len(body), t, flags, seq, 0) + body

    batch = (msg(0x10, NLM_F_REQUEST, 1, 0, 10, b"")
             + msg((10 << 8) | 2, NLM_F_REQUEST | NLM_F_ACK, 2, 1, 0, nlattr(1, name.encode() + b"\0"))
             + msg(0x11, NLM_F_REQUEST, 3, 0, 10, b""))
    s.send(batch)
    e = nl_acks(s, 1)[0]
    s.close()
    return e


def rtnl(t, flags, body):
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
    s.bind((0, 0))
    s.send(struct.pack("=IHHII", 16 + len(body), t, flags | NLM_F_REQUEST | NLM_F_ACK, 1, 0) + body)
    e = nl_acks(s, 1)[0]
    s.close()
    return e


def link_add(name, kind_):
    """RTM_NEWLINK NAME of type KIND_ ("dummy", "veth", ...): the errno."""
    ifinfo = struct.pack("=BxHiII", 0, 0, 0, 0, 0)
    body = ifinfo + nlattr(3, name.encode() + b"\0") + nlattr(18 | 0x8000, nlattr(1, kind_.encode()))
    return rtnl(16, NLM_F_CREATE | NLM_F_EXCL, body)


def route_add(dst, plen, oif=1, gw=None):
    """RTM_NEWROUTE DST/PLEN out of interface OIF (1: lo), via GW: the errno."""
    rtmsg = struct.pack("=BBBBBBBBI", socket.AF_INET, plen, 0, 0, 254, 3, 0, 1, 0)  # main, boot, universe, unicast
    body = rtmsg + nlattr(1, socket.inet_aton(dst)) + nlattr(4, struct.pack("=I", oif))
    if gw:
        body += nlattr(5, socket.inet_aton(gw))
    return rtnl(24, NLM_F_CREATE, body)
