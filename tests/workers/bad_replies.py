"""A worker not built on worker_base that answers each predict with the malformed reply its payload names.

``{"bad": KIND}``: garbage, not_object, other_id, huge, regular_file, pipe, socket, dev_zero, unsealed_memfd,
wrong_size, offset_past_end, many_fds, stale_then_good, extra_after, close; anything else is a good reply.
"""

import fcntl
import importlib.util
import os
import socket
import sys
import threading

spec = importlib.util.spec_from_file_location("protocol", os.environ["RESIDENT_POOL_PROTOCOL"])
protocol = importlib.util.module_from_spec(spec)
spec.loader.exec_module(protocol)

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK


def memfd(size, seal=True):
    fd = os.memfd_create("bad", os.MFD_ALLOW_SEALING)
    os.write(fd, b"\0" * size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def with_fds(conn, obj, fds):
    conn.sendmsg([protocol.encode_line(obj)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(
        b for fd in fds for b in fd.to_bytes(4, sys.byteorder)))])
    for fd in fds:
        os.close(fd)


def answer(conn, request):
    rid, kind = request.get("id"), (request.get("payload") or {}).get("bad")
    good = {"ok": True, "id": rid, "result": {"good": True, "pid": os.getpid()}}
    array = {"ok": True, "id": rid, "buffers": [8], "result": {"$buffer": 0, "dtype": "float32", "shape": [2]}}
    if kind == "garbage":
        conn.sendall(b"this is no reply\n")
    elif kind == "not_object":
        conn.sendall(b"[1, 2, 3]\n")
    elif kind == "other_id":
        protocol.send_line(conn, {**good, "id": rid + 1000})
    elif kind == "huge":
        conn.sendall(b"x" * (protocol.MAX_LINE_BYTES + 1024))
    elif kind == "regular_file":
        with_fds(conn, array, [os.open(__file__, os.O_RDONLY)])
    elif kind == "pipe":
        read, write = os.pipe()
        os.close(write)
        with_fds(conn, array, [read])
    elif kind == "socket":
        left, right = socket.socketpair()
        right.close()
        with_fds(conn, array, [left.detach()])
    elif kind == "dev_zero":
        with_fds(conn, array, [os.open("/dev/zero", os.O_RDONLY)])
    elif kind == "unsealed_memfd":
        with_fds(conn, array, [memfd(8, seal=False)])
    elif kind == "wrong_size":
        with_fds(conn, array, [memfd(4)])
    elif kind == "offset_past_end":
        with_fds(conn, {**array, "result": {"$buffer": 0, "dtype": "float32", "shape": [2], "offset": 64}}, [memfd(8)])
    elif kind == "many_fds":  # more than one message may carry (253): sent over two sendmsg calls
        line = protocol.encode_line({**array, "buffers": [8] * 300})
        for part, count in ((line[:8], 200), (line[8:], 100)):
            fds = [memfd(8) for _ in range(count)]
            conn.sendmsg([part], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(
                b for fd in fds for b in fd.to_bytes(4, sys.byteorder)))])
            for fd in fds:
                os.close(fd)
    elif kind == "stale_then_good":
        protocol.send_line(conn, {**good, "id": rid - 1, "result": {"good": False}})
        protocol.send_line(conn, good)
    elif kind == "extra_after":
        protocol.send_line(conn, good)
        protocol.send_line(conn, good)
    elif kind == "close":
        conn.close()
        return False
    else:
        protocol.send_line(conn, good)
    return True


def serve(conn):
    buf = bytearray()
    with conn:
        while True:
            try:
                request = protocol.recv_line(conn, buf)
            except (OSError, protocol.ProtocolError):
                return
            if request is None:
                return
            op = request.get("op")
            if op == "ping":
                reply = {"ok": True, "id": request.get("id"), "ready": True, "recall": True}
                if "attachments" in request:
                    reply["attachments"] = {"version": 1, "max_bytes": 1 << 20}
                protocol.send_line(conn, reply)
            elif op == "recall":
                protocol.send_line(conn, {"ok": True, "id": request.get("id"), "idle_s": 0.0, "served": 0})
            elif op == "shutdown":
                protocol.send_line(conn, {"ok": True, "id": request.get("id"), "stopping": True})
                os._exit(0)
            elif op == "predict":
                try:
                    if not answer(conn, request):
                        return
                except OSError:
                    return
            else:
                protocol.send_line(conn, {"ok": False, "id": request.get("id"), "reason": "unknown_op", "error": op})


def main():
    listener = protocol.bind_unix(sys.argv[1])
    print(f"bad_replies pid {os.getpid()} listening", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
