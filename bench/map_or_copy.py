"""Received attachments: map them, or read a copy? The figures behind protocol.COPY_BELOW_BYTES.

    python bench/map_or_copy.py [--n 400]

Per size: receive one message carrying one float32 array (a sealed memfd beside
a line, over a socketpair), decode it and read every byte of it (a sum), with
the attachment mapped (``COPY_BELOW_BYTES = 0``) and read as a copy
(``COPY_BELOW_BYTES`` above the size). Prints the median per message and the
ratio copy / map: under 1, copying is the cheaper way to receive that size. A
mapping costs one of the process's ``vm.max_map_count`` memory maps (65530 by
default) for as long as the array lives; a copy costs none.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time

import numpy

from resident_pool import arrays, protocol

PEER = {"version": arrays.VERSION, "max_bytes": protocol.MAX_ATTACHMENT_BYTES}
SIZES = [64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20]


def per_message(size: int, n: int, copy_below: int) -> float:
    """Median seconds to receive, decode and read one message of ``size`` bytes of float32."""
    protocol.COPY_BELOW_BYTES = copy_below
    left, right = socket.socketpair()
    value = numpy.ones(size // 4, numpy.float32)
    encoded = [arrays.encode({"x": value}, PEER, min_bytes=1) for _ in range(n)]  # memfds made up front

    def sender():
        for raw, fds, fresh in encoded:
            protocol.send_raw(left, raw, fds)
            os.close(fresh)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    inbox, samples = protocol.Inbox(), []
    for _ in range(n):
        started = time.perf_counter()
        message = protocol.recv_message(right, inbox)
        got = arrays.decode(message.obj, message.attachments)["x"]
        message.close()
        got.sum(dtype=numpy.float64)
        del got  # unmapped (or freed) here, on the clock
        samples.append(time.perf_counter() - started)
    thread.join()
    left.close()
    right.close()
    return statistics.median(samples[n // 10:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=400)
    args = parser.parse_args()
    print(f"{'size':>10} {'map us':>9} {'copy us':>9} {'copy/map':>9}")
    for size in SIZES:
        n = max(20, min(args.n, (256 << 20) // size))
        mapped = per_message(size, n, 0)
        copied = per_message(size, n, size + 1)
        print(f"{size >> 10:>8}Ki {mapped * 1e6:>9.1f} {copied * 1e6:>9.1f} {copied / mapped:>9.2f}")


if __name__ == "__main__":
    main()
