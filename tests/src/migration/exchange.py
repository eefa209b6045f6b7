"""Both ends of the migration test's long-lived exchanges (tests/tests/migration.rs).

Every end keeps a record in its own directory: `events.log`, one line per receipt or send
(`<wall time> rx|tx <bytes received> <bytes sent>`, from which the test cuts each step's
figures), and `status.json`, rewritten (atomically) as it goes: bytes and sha256 of everything
received and sent, the largest gap between two receipts (the gap still open counts while the
exchange runs), resets and other errors, and `done` once the exchange ended cleanly.

    server POD DIR TCP_PORT UDP_PORT
        TCP: a connection's first line names it (DIR/<name>/); from then on it sends CHUNK random
        bytes every INTERVAL and counts what comes, until the client shuts its side: then it
        sends what is left, shuts its own and is done. UDP: each datagram ("<name> <seq> ...")
        is answered with "<POD> " and the datagram, recorded under DIR/<name>/ with every source
        address:port it came from.
    tcp-client NAME DIR HOST PORT [SOURCE_PORT [RECEIPTS]]
        Connects (from SOURCE_PORT, 0: any), sends "NAME\\n", then CHUNK random bytes every
        INTERVAL and counts what comes, until DIR/stop exists (or RECEIPTS receipts): then it
        shuts its side and waits for the server's end of stream.
    udp-client NAME DIR HOST PORT SOURCE_PORT [RECEIPTS]
        From one socket bound to SOURCE_PORT (the CoreDNS case: a client that keeps its source
        port), a datagram to HOST:PORT every INTERVAL with sendto; counts the answers, their
        sources (an answer must come from HOST:PORT) and the backends that sent them, until
        DIR/stop exists (or RECEIPTS answers), then waits STRAGGLERS for answers in flight.
"""
import hashlib
import json
import os
import select
import socket
import sys
import threading
import time

INTERVAL = 0.1
CHUNK = 256
# How long a stopping end waits for its peer (flushing, end of stream, answers in flight).
STOP_GRACE = 3.0
STRAGGLERS = 1.0


class Record:
    """What one end of one exchange observed."""

    def __init__(self, directory):
        os.makedirs(directory, exist_ok=True)
        self.dir = directory
        self.rx = self.tx = 0
        self.receipts = self.sends = 0
        self.rx_sha = hashlib.sha256()
        self.tx_sha = hashlib.sha256()
        self.last_rx = None
        self.max_gap = 0.0
        # Gaps count while the exchange runs: not before the first receipt, not once stopping.
        self.counting_gaps = True
        self.errors = []
        self.done = False
        self.info = {}
        self.log = open(os.path.join(directory, "events.log"), "a", buffering=1)
        self.lock = threading.Lock()

    def open_gap(self, now):
        if self.last_rx is None or not self.counting_gaps:
            return 0.0
        return now - self.last_rx

    def received(self, data):
        with self.lock:
            now = time.time()
            if self.last_rx is not None and self.counting_gaps:
                self.max_gap = max(self.max_gap, now - self.last_rx)
            self.last_rx = now
            self.rx += len(data)
            self.receipts += 1
            self.rx_sha.update(data)
            self.log.write("%.6f rx %d %d\n" % (now, self.rx, self.tx))
        self.write()

    def sent(self, data):
        with self.lock:
            now = time.time()
            self.tx += len(data)
            self.sends += 1
            self.tx_sha.update(data)
            self.log.write("%.6f tx %d %d\n" % (now, self.rx, self.tx))
        self.write()

    def stop_counting_gaps(self):
        with self.lock:
            self.max_gap = max(self.max_gap, self.open_gap(time.time()))
            self.counting_gaps = False

    def error(self, what):
        with self.lock:
            self.errors.append(what)
        self.write()

    def finish(self):
        self.stop_counting_gaps()
        self.done = True
        self.write()

    def write(self):
        with self.lock:
            now = time.time()
            status = {
                "rx": self.rx,
                "tx": self.tx,
                "receipts": self.receipts,
                "sends": self.sends,
                "rx_sha256": self.rx_sha.hexdigest(),
                "tx_sha256": self.tx_sha.hexdigest(),
                "max_gap": max(self.max_gap, self.open_gap(now)),
                "last_rx": self.last_rx,
                "errors": list(self.errors),
                "done": self.done,
                "written": now,
            }
            status.update(self.info)
            path = os.path.join(self.dir, "status.json")
            with open(path + ".tmp", "w") as out:
                json.dump(status, out)
            os.replace(path + ".tmp", path)


def describe(error):
    if isinstance(error, ConnectionResetError):
        return "reset"
    return "%s: %s" % (type(error).__name__, error)


def tcp_exchange(sock, record, out, should_stop):
    """Sends CHUNK bytes every INTERVAL and counts what comes. `should_stop()` true: the client
    side ends; None: the server side, which ends when the client has shut its side."""
    sock.setblocking(False)
    out = bytearray(out)
    next_tick = time.monotonic()
    sending, shut, peer_eof, deadline = True, False, False, None
    while True:
        now = time.monotonic()
        if sending and ((should_stop is not None and should_stop()) or peer_eof):
            sending = False
            record.stop_counting_gaps()
            deadline = now + STOP_GRACE
        if sending and now >= next_tick:
            out += os.urandom(CHUNK)
            next_tick += INTERVAL
        if out:
            try:
                n = sock.send(out)
                record.sent(bytes(out[:n]))
                del out[:n]
            except BlockingIOError:
                pass
            except OSError as e:
                record.error(describe(e))
                return
        if not sending and not out and not shut:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError as e:
                record.error(describe(e))
                return
            shut = True
        if shut and peer_eof:
            record.finish()
            return
        if deadline is not None and now > deadline:
            record.error(
                "stopping: after %.0f s, %d bytes still unsent, %s" % (
                    STOP_GRACE, len(out), "end of stream seen" if peer_eof else "no end of stream from the peer"))
            return
        wait = max(0.0, min(next_tick - now, 0.05)) if sending else 0.05
        readable, _, _ = select.select([] if peer_eof else [sock], [sock] if out else [], [], wait)
        if readable and not peer_eof:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError as e:
                record.error(describe(e))
                return
            if data:
                record.received(data)
            else:
                peer_eof = True


def serve_tcp_connection(conn, base):
    conn.settimeout(10)
    first = b""
    try:
        while b"\n" not in first:
            data = conn.recv(4096)
            if not data:
                return
            first += data
    except OSError:
        return
    name = first.split(b"\n", 1)[0].decode(errors="replace").strip() or "unnamed"
    record = Record(os.path.join(base, name))
    peer = conn.getpeername()
    record.info["peer"] = "%s:%d" % peer
    record.received(first)
    try:
        tcp_exchange(conn, record, b"", None)
    finally:
        record.write()
        conn.close()


def serve(pod, base, tcp_port, udp_port):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", tcp_port))
    listener.listen(64)

    def accept():
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve_tcp_connection, args=(conn, base), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", udp_port))
    records = {}
    while True:
        data, peer = udp.recvfrom(65535)
        name = data.split(b" ", 1)[0].decode(errors="replace") or "unnamed"
        record = records.get(name)
        if record is None:
            record = records[name] = Record(os.path.join(base, name))
        # A stateful UDP server sees a new client when the source port changes.
        peers = set(record.info.get("peers", [])) | {"%s:%d" % peer}
        record.info["peers"] = sorted(peers)
        record.received(data)
        answer = pod.encode() + b" " + data
        try:
            udp.sendto(answer, peer)
            record.sent(answer)
        except OSError as e:
            record.error(describe(e))


def tcp_client(name, base, host, port, source_port, receipts):
    record = Record(base)
    stop = os.path.join(base, "stop")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        if source_port:
            sock.bind(("0.0.0.0", source_port))
        sock.settimeout(5)
        sock.connect((host, port))
    except OSError as e:
        record.error("connect: " + describe(e))
        return 1
    record.info["local"] = "%s:%d" % sock.getsockname()
    record.info["peer"] = "%s:%d" % sock.getpeername()
    record.write()

    def should_stop():
        return os.path.exists(stop) or (receipts and record.receipts >= receipts)

    tcp_exchange(sock, record, name.encode() + b"\n", should_stop)
    record.write()
    sock.close()
    return 0 if record.done and not record.errors else 1


def udp_client(name, base, host, port, source_port, receipts):
    record = Record(base)
    stop = os.path.join(base, "stop")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", source_port))
    sock.setblocking(False)
    target = (socket.gethostbyname(host), port)
    backends, sources = set(), set()
    record.info["local"] = "%s:%d" % sock.getsockname()
    seq = 0
    next_tick = time.monotonic()
    stopping = None
    while True:
        now = time.monotonic()
        if stopping is None and (os.path.exists(stop) or (receipts and record.receipts >= receipts)):
            record.stop_counting_gaps()
            stopping = now
        if stopping is None and now >= next_tick:
            datagram = ("%s %d " % (name, seq)).encode() + os.urandom(24).hex().encode()
            seq += 1
            next_tick += INTERVAL
            try:
                sock.sendto(datagram, target)
                record.sent(datagram)
            except OSError as e:
                record.error("sendto: " + describe(e))
        if stopping is not None and (record.receipts >= record.sends or now - stopping > STRAGGLERS):
            break
        wait = max(0.0, min(next_tick - now, 0.05)) if stopping is None else 0.05
        readable, _, _ = select.select([sock], [], [], wait)
        while readable:
            try:
                data, source = sock.recvfrom(65535)
            except BlockingIOError:
                break
            except OSError as e:
                record.error("recvfrom: " + describe(e))
                break
            source = "%s:%d" % source
            if source != "%s:%d" % target and source not in sources:
                record.error("an answer came from %s, not %s:%d" % (source, target[0], target[1]))
            sources.add(source)
            backends.add(data.split(b" ", 1)[0].decode(errors="replace"))
            record.info["backends"] = sorted(backends)
            record.info["sources"] = sorted(sources)
            record.received(data)
    record.info["unanswered"] = record.sends - record.receipts
    record.finish()
    return 0 if not record.errors and record.receipts == record.sends else 1


def main(argv):
    mode = argv[1]
    if mode == "server":
        serve(argv[2], argv[3], int(argv[4]), int(argv[5]))
    elif mode == "tcp-client":
        extra = [int(a) for a in argv[6:8]] + [0, 0]
        return tcp_client(argv[2], argv[3], argv[4], int(argv[5]), extra[0], extra[1])
    elif mode == "udp-client":
        receipts = int(argv[7]) if len(argv) > 7 else 0
        return udp_client(argv[2], argv[3], argv[4], int(argv[5]), int(argv[6]), receipts)
    else:
        raise SystemExit("unknown mode " + mode)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
