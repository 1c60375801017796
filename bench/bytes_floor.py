"""The floor for moving bytes: a raw AF_UNIX echo of length-prefixed bytes between two processes.

Each message is a 16-byte header (length, mode) and the bytes; mode 0 sends
the bytes back, mode 1 reads them (the same sum the array provider computes)
and answers 8 bytes. Buffers are allocated once and reused: the best case for
a socket, two copies through the kernel each way.
"""

import os
import socket
import struct
import sys

import numpy
from array_worker import checksum  # beside this script: the same read as the array provider


def recv_exactly(conn, view):
    done = 0
    while done < len(view):
        got = conn.recv_into(view[done:])
        if not got:
            return False
        done += got
    return True


def main():
    path = sys.argv[1]
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    print("ready", flush=True)
    conn, _ = listener.accept()
    header = bytearray(16)
    buffer = bytearray(0)
    while recv_exactly(conn, memoryview(header)):
        length, mode = struct.unpack("<QQ", header)
        if len(buffer) < length:
            buffer = bytearray(length)
        view = memoryview(buffer)[:length]
        if not recv_exactly(conn, view):
            break
        if mode == 0:
            conn.sendall(view)
        else:
            conn.sendall(struct.pack("<Q", checksum(numpy.frombuffer(view, numpy.uint8)) % 2**64))
    conn.close()
    os.unlink(path)


if __name__ == "__main__":
    main()
