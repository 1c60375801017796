"""The floor for call overhead: a plain AF_UNIX JSON-lines echo between two processes.

No pool, no framing helpers beyond what any JSON-lines server does: read a line,
decode it, encode the reply, write it.
"""

import json
import os
import socket
import sys


def main():
    path = sys.argv[1]
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
        conn.sendall(json.dumps({"ok": True, "id": message["id"], "result": message["payload"]}).encode() + b"\n")
    conn.close()
    os.unlink(path)


if __name__ == "__main__":
    main()
