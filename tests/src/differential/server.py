"""Backend of the differential test: TCP and UDP on one port, answering with the pod's name.

TCP, one command per line: `hello` -> "<pod> <client ip> <client port>" (the address the server
saw); `close` -> "bye <pod>", then the server closes first; `reset` -> the server aborts (RST).
The server closes when the client does. UDP: "echo <nonce> ..." -> "<pod> <ip> <port> <length>
<nonce>", padded to the datagram's length (so a 2000-byte datagram gets a 2000-byte answer).
"""
import socket
import struct
import sys
import threading

POD = sys.argv[1]
PORT = int(sys.argv[2])


def handle(conn, peer):
    buf = b""
    try:
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                command = line.strip()
                if command == b"hello":
                    conn.sendall(("%s %s %d\n" % (POD, peer[0], peer[1])).encode())
                elif command == b"close":
                    conn.sendall(("bye %s\n" % POD).encode())
                    return
                elif command == b"reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
    except OSError:
        pass
    finally:
        conn.close()


def serve_tcp():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", PORT))
    listener.listen(128)
    while True:
        conn, peer = listener.accept()
        threading.Thread(target=handle, args=(conn, peer), daemon=True).start()


def serve_udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", PORT))
    while True:
        data, peer = s.recvfrom(65535)
        fields = data.split(b" ", 2)
        if len(fields) < 2 or fields[0] != b"echo":
            continue
        header = ("%s %s %d %d %s\n" % (POD, peer[0], peer[1], len(data), fields[1].decode(errors="replace"))).encode()
        s.sendto(header + b"x" * max(0, len(data) - len(header)), peer)


threading.Thread(target=serve_udp, daemon=True).start()
serve_tcp()
