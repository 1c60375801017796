"""A purpose-built worker for tests: each behaviour the supervisor must handle.

Start-time behaviour comes from argv; per-request behaviour from the payload's
``action``. Loads worker_base by path, exactly as a real provider does.
"""

import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time


def load(name, variable):
    spec = importlib.util.spec_from_file_location(name, os.environ[variable])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class KitRefusal(BaseException):
    """What a kit raises when it must not run: a readable ``.reason``."""

    def __init__(self, reason):
        super().__init__("refused")
        self.reason = reason


def main():
    socket_path = sys.argv[1]
    options = sys.argv[2:]
    print(f"testworker pid {os.getpid()} starting with {options}", flush=True)
    if "--exit-before-bind" in options:
        code = int(options[options.index("--exit-before-bind") + 1])
        print(f"REFUSED: testworker told to exit {code} before binding", file=sys.stderr, flush=True)
        sys.exit(code)
    if "--hang-at-start" in options:
        signal.pause()  # never bind: the supervisor's start timeout must end this
    if "--ignore-term" in options:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    worker_base = load("worker_base", "RESIDENT_POOL_WORKER_BASE")
    if "--load-seconds" in options:  # a model that takes a while to load, before serve()
        time.sleep(float(options[options.index("--load-seconds") + 1]))
    if "--non-daemon-thread" in options:  # what some model libraries leave running
        threading.Thread(target=signal.pause, name="leftover", daemon=False).start()
    releases = []
    real_release = worker_base.release_cublas_workspaces

    def counting_release():
        releases.append(time.monotonic())
        return real_release()

    worker_base.release_cublas_workspaces = counting_release
    state = {"in_flight": 0, "max_in_flight": 0, "children": []}
    lock = threading.Lock()

    def on_predict(payload):
        with lock:
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            return act(payload or {})
        finally:
            with lock:
                state["in_flight"] -= 1

    def act(payload):
        action = payload.get("action", "echo")
        print(f"action {action}", flush=True)
        if action == "echo":
            return {"echo": payload.get("value"), "pid": os.getpid()}
        if action == "sleep":
            started = time.time()
            time.sleep(float(payload["seconds"]))
            if payload.get("marker"):
                with open(payload["marker"], "w") as handle:
                    handle.write("done")
            return {"slept": payload["seconds"], "pid": os.getpid(), "started": started, "ended": time.time()}
        if action == "hold":  # runs until the test lets it go (the file exists), at most ``seconds``
            started = time.time()
            while not os.path.exists(payload["until"]) and time.time() - started < float(payload["seconds"]):
                time.sleep(0.02)
            return {"held": time.time() - started, "pid": os.getpid()}
        if action == "raise":
            raise ValueError(payload.get("message", "bad input"))
        if action == "exit":
            raise SystemExit(payload.get("code", 0))
        if action == "refuse":
            raise KitRefusal(payload.get("reason", "kernel census: route 'fa3' required, 'sdpa' loaded"))
        if action == "os_exit":
            os._exit(int(payload.get("code", 7)))
        if action == "die_once":  # dies the first time, answers once the marker exists
            if not os.path.exists(payload["marker"]):
                open(payload["marker"], "w").close()
                os._exit(9)
            return {"survived": True, "pid": os.getpid()}
        if action == "interrupt":
            raise KeyboardInterrupt
        if action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "abort":
            os.abort()
        if action == "segfault":
            ctypes.string_at(0)
        if action == "spawn_child":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            state["children"].append(child.pid)
            return {"child": child.pid}
        if action == "env":
            return {"env": dict(os.environ)}
        if action == "nan":
            return {"value": float("nan")}
        if action == "big":
            return {"blob": "x" * int(payload["bytes"])}
        raise ValueError(f"unknown action {action!r}")

    def ready():
        if "--ready-raises" in options:
            raise RuntimeError("ready() broke after the model loaded")
        if "--ping-seconds" in options:  # a health check that takes a while: a model that checks its device
            time.sleep(float(options[options.index("--ping-seconds") + 1]))
        if os.environ.get("TESTWORKER_PING_DIR"):  # one line per ping answered, for tests that count them
            with open(os.path.join(os.environ["TESTWORKER_PING_DIR"], f"{os.getpid()}.pings"), "a") as pings:
                pings.write("ping\n")
        return {"releases": len(releases), "max_in_flight": state["max_in_flight"], "options": options}

    worker_base.serve(
        slug=os.environ.get("TESTWORKER_SLUG", "testworker"),
        socket_path=socket_path,
        on_predict=on_predict,
        ready=ready,
        release_cublas="--no-release" not in options,
    )


if __name__ == "__main__":
    main()
