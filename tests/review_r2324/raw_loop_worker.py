"""A worker with its own accept loop, as the original's serve() wrote it: only protocol() from the base.

Its loop leaves a connection when recv_line raises ProtocolError, as the original's does: the original's
recv_line raises at the end of the stream (its serve() has no other way out of a connection).
"""
import importlib.util
import os
import socket
import sys

spec = importlib.util.spec_from_file_location("_tu_worker_base", os.environ["TOOLUNIVERSE_REMOTE_WORKER_BASE"])
wb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wb)
P = wb.protocol()

srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1])
srv.listen(4)
while True:
    conn, _ = srv.accept()
    buf = bytearray()
    try:
        while True:
            try:
                req = P.recv_line(conn, buf)
            except P.ProtocolError:
                break
            op = req.get("op")  # AttributeError when recv_line returned None at the end of the stream
            P.send_line(conn, {"ok": True, "op": op})
            if op == P.OP_SHUTDOWN:
                sys.exit(0)
    finally:
        conn.close()
