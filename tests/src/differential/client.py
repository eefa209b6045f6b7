"""Client of the differential test: one JSON request per line on stdin, one JSON observation per
line on stdout. Sockets are kept by name between requests, so a scenario can hold a connection
open while the cluster changes, or open a second socket on the same port.

Every observation has an "outcome" (connected, refused, timeout, reset, unreachable, reply, eof,
closed, ...) and, where there is one, what the client saw: the server's answer (its pod name, the
client address it saw), the peer address, the number of bytes received.
"""
import errno
import json
import random
import socket
import struct
import sys

socks = {}


def outcome_of(err):
    if isinstance(err, (socket.timeout, TimeoutError)):
        return "timeout"
    names = {
        errno.ECONNREFUSED: "refused",
        errno.ECONNRESET: "reset",
        errno.EPIPE: "reset",
        errno.ETIMEDOUT: "timeout",
        errno.EHOSTUNREACH: "unreachable",
        errno.ENETUNREACH: "unreachable",
        errno.EADDRNOTAVAIL: "address-not-available",
        errno.EADDRINUSE: "address-in-use",
        errno.ECONNABORTED: "aborted",
        errno.EINVAL: "invalid",
    }
    code = getattr(err, "errno", None)
    if code in names:
        return names[code]
    return "error:" + (errno.errorcode.get(code, str(code)) if code else repr(err))


def addr(pair):
    return "%s:%d" % (pair[0], pair[1])


def new_socket(kind, port):
    s = socket.socket(socket.AF_INET, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    return s


def read_line(s, timeout):
    """One line, or (partial, True) at EOF."""
    s.settimeout(timeout)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            return buf, True
        buf += chunk
    return buf, False


def wait_eof(s, timeout):
    s.settimeout(timeout)
    while True:
        chunk = s.recv(4096)
        if not chunk:
            return


def tcp_connect(r):
    s = new_socket(socket.SOCK_STREAM, r["port"])
    local = s.getsockname()
    s.settimeout(r["timeout"])
    try:
        s.connect((r["ip"], r["dport"]))
    except OSError as err:
        s.close()
        return {"outcome": outcome_of(err), "local": addr(local)}
    socks[r["sock"]] = s
    return {"outcome": "connected", "local": addr(s.getsockname()), "peer": addr(s.getpeername())}


def hello(r):
    s = socks[r["sock"]]
    try:
        s.sendall(b"hello\n")
        line, eof = read_line(s, r["timeout"])
    except OSError as err:
        return {"outcome": outcome_of(err)}
    if eof and not line:
        return {"outcome": "eof"}
    fields = line.decode(errors="replace").split()
    if len(fields) != 3:
        return {"outcome": "bad-reply", "raw": line.decode(errors="replace")}
    return {"outcome": "reply", "server": fields[0], "seen": "%s:%s" % (fields[1], fields[2])}


def server_close(r):
    s = socks.pop(r["sock"])
    try:
        s.sendall(b"close\n")
        line, eof = read_line(s, r["timeout"])
        if not line.startswith(b"bye "):
            return {"outcome": "eof" if eof else "bad-reply", "raw": line.decode(errors="replace")}
        server = line.decode().split()[1]
        if not eof:
            wait_eof(s, r["timeout"])
        return {"outcome": "closed", "server": server}
    except OSError as err:
        return {"outcome": outcome_of(err)}
    finally:
        s.close()


def server_reset(r):
    s = socks.pop(r["sock"])
    try:
        s.sendall(b"reset\n")
        s.settimeout(r["timeout"])
        data = s.recv(4096)
        return {"outcome": "eof" if not data else "bad-reply"}
    except OSError as err:
        return {"outcome": outcome_of(err)}
    finally:
        s.close()


def client_close(r):
    s = socks.pop(r["sock"])
    try:
        s.shutdown(socket.SHUT_WR)
        wait_eof(s, r["timeout"])
        return {"outcome": "closed"}
    except OSError as err:
        return {"outcome": outcome_of(err)}
    finally:
        s.close()


def client_reset(r):
    s = socks.pop(r["sock"])
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    return {"outcome": "reset-sent"}


def udp_open(r):
    s = new_socket(socket.SOCK_DGRAM, r["port"])
    if r.get("ip"):
        s.connect((r["ip"], r["dport"]))
    socks[r["sock"]] = s
    return {"outcome": "open", "local": addr(s.getsockname())}


def exchange(s, r, payload, matches):
    """Sends payload (to r's address, or the connected peer) and waits for an answer `matches`
    accepts (late answers to earlier requests are skipped)."""
    try:
        if r.get("ip"):
            s.sendto(payload, (r["ip"], r["dport"]))
        else:
            s.send(payload)
        s.settimeout(r["timeout"])
        while True:
            data, source = s.recvfrom(65535)
            parsed = matches(data)
            if parsed is not None:
                return data, source, parsed
    except OSError as err:
        return None, None, outcome_of(err)


def udp_echo(r):
    s = socks[r["sock"]]
    nonce = "%016x" % random.getrandbits(64)
    payload = ("echo %s " % nonce).encode()
    payload += b"p" * max(0, r["size"] - len(payload))

    def matches(data):
        fields = data.split(b"\n", 1)[0].decode(errors="replace").split()
        return fields if len(fields) == 5 and fields[4] == nonce else None

    data, source, parsed = exchange(s, r, payload, matches)
    if data is None:
        return {"outcome": parsed}
    return {
        "outcome": "reply",
        "server": parsed[0],
        "seen": "%s:%s" % (parsed[1], parsed[2]),
        "from": addr(source),
        "bytes": len(data),
    }


def dns_query(qid):
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in b"whoami.kproxy.test".split(b"."):
        q += bytes([len(label)]) + label
    return q + b"\x00" + struct.pack(">HH", 16, 1)


def skip_name(msg, i):
    while True:
        n = msg[i]
        if n == 0:
            return i + 1
        if n & 0xC0 == 0xC0:
            return i + 2
        i += n + 1


def txt_answer(msg):
    """The first TXT string of the first answer, or None."""
    if len(msg) < 12 or struct.unpack(">H", msg[6:8])[0] == 0:
        return None
    i = skip_name(msg, 12) + 4
    i = skip_name(msg, i)
    rtype, _, _, length = struct.unpack(">HHIH", msg[i : i + 10])
    if rtype != 16 or length == 0:
        return None
    return msg[i + 11 : i + 11 + msg[i + 10]].decode(errors="replace")


def dns(r):
    s = socks[r["sock"]]
    qid = random.getrandbits(16)

    def matches(data):
        return True if len(data) >= 2 and struct.unpack(">H", data[:2])[0] == qid else None

    data, source, parsed = exchange(s, r, dns_query(qid), matches)
    if data is None:
        return {"outcome": parsed}
    server = txt_answer(data)
    if server is None:
        return {"outcome": "bad-reply", "from": addr(source)}
    return {"outcome": "reply", "server": server, "from": addr(source), "bytes": len(data)}


def tcp_dns(r):
    s = socks[r["sock"]]
    qid = random.getrandbits(16)
    q = dns_query(qid)
    try:
        s.sendall(struct.pack(">H", len(q)) + q)
        s.settimeout(r["timeout"])
        buf = b""
        while len(buf) < 2 or len(buf) < 2 + struct.unpack(">H", buf[:2])[0]:
            chunk = s.recv(4096)
            if not chunk:
                return {"outcome": "eof"}
            buf += chunk
    except OSError as err:
        return {"outcome": outcome_of(err)}
    server = txt_answer(buf[2:])
    if server is None:
        return {"outcome": "bad-reply"}
    return {"outcome": "reply", "server": server, "bytes": len(buf) - 2}


OPS = {
    "tcp_connect": tcp_connect,
    "hello": hello,
    "server_close": server_close,
    "server_reset": server_reset,
    "client_close": client_close,
    "client_reset": client_reset,
    "udp_open": udp_open,
    "udp_echo": udp_echo,
    "dns": dns,
    "tcp_dns": tcp_dns,
}


def main():
    print(json.dumps({"outcome": "ready"}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sock = request.get("sock")
        if request["op"] not in ("tcp_connect", "udp_open") and sock not in socks:
            result = {"outcome": "no-socket"}
        else:
            try:
                result = OPS[request["op"]](request)
            except OSError as err:
                result = {"outcome": outcome_of(err)}
        print(json.dumps(result), flush=True)


main()
