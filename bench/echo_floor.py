"""The floor for call overhead: a plain AF_UNIX JSON-lines echo between two processes.

No pool, no framing helpers beyond what any JSON-lines server does: read a line,
decode it, encode the reply, write it. An optional second argument, seconds, is
a pause before each reply: a peer that thinks, so its client waits on the socket.
"""

import json
import os
import socket
import sys
import time


def main():
    path = sys.argv[1]
    think_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    print("ready", flush=True)
    conn, _ = listener.accept()
    reader = conn.makefile("rb")
    for line in reader:
        message = json.loads(line)
        if message.get("op") == "shutdown":
            break
        if think_s:
            time.sleep(think_s)
        conn.sendall(json.dumps({"ok": True, "id": message["id"], "result": message["payload"]}).encode() + b"\n")
    conn.close()
    os.unlink(path)


if __name__ == "__main__":
    main()
