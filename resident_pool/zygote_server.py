"""The fork server (zygote): the provider's imports paid once, each worker forked from it.

Standard library only: the pool runs this file BY PATH in the provider's own
interpreter and environment, exactly as it would run the worker script, with one
extra argument, the number of its control socket (one end of a socketpair only
the pool holds)::

    <python> zygote_server.py <control fd>

Over that socket, one JSON object per line. The pool sends ``configure``
(the worker script, the modules to preload, an optional load stage), then
``fork`` requests, each with the worker's transcript passed as a file
descriptor. The zygote answers each ``fork`` with the child's pid, and sends an
``exit`` event with the return code (``Popen.returncode``'s convention: negative
for a signal) when it reaps a child: a forked worker is not the pool's child, so
this is the only place its exit status exists. The pool closing the socket ends
the zygote; its children keep running and watch their own heartbeat.

A forked CUDA context is broken, so the zygote checks after every preloaded
module, after the load stage and before every fork that CUDA is untouched, and
refuses (naming the module) once it was.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import time
import traceback

__all__ = ["cuda_touched", "staged"]

_MAX_LINE = 8 * 1024 * 1024  # a fork request carries the worker's whole environment
_CUDA_ERROR_NOT_INITIALIZED = 3
# What a worker finds with worker_base.staged(): the load stage's result, shared copy-on-write.
STAGED_MODULE = "resident_pool_zygote"
staged = None


def cuda_touched() -> str | None:
    """Why CUDA counts as initialized in this process, or None while it is untouched.

    torch says so through ``torch.cuda.is_initialized()``; any other library
    (or torch's own device count, which runs cuInit) shows in the driver: once
    cuInit ran, a loaded libcuda answers ``cuDeviceGetCount`` with anything but
    CUDA_ERROR_NOT_INITIALIZED.
    """
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    is_initialized = getattr(cuda, "is_initialized", None)
    if callable(is_initialized) and is_initialized():
        return "torch.cuda.is_initialized() is True"
    for path in _loaded_libcuda():
        import ctypes

        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            count = ctypes.c_int(0)
            result = lib.cuDeviceGetCount(ctypes.byref(count))
        except (OSError, AttributeError):
            continue  # not a driver library after all
        if result != _CUDA_ERROR_NOT_INITIALIZED:
            return f"the CUDA driver {path} was initialized (cuInit ran; cuDeviceGetCount answered {result})"
    return None


def _loaded_libcuda() -> list[str]:
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ", 5)[-1].strip()
                if os.path.basename(path).startswith("libcuda.so") and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


class _Order:
    """What a freshly forked child runs: the worker script, as ``python script args`` would."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, out_fd: int) -> None:
        self.argv, self.env, self.cwd, self.out_fd = argv, env, cwd, out_fd


class Zygote:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.pid = os.getpid()
        self.buf = bytearray()
        self.fds: list[int] = []  # descriptors received, in order; each fork request takes one
        self.children: set[int] = set()
        self.refused: str | None = None
        self.script = ""

    # -- the control channel ---------------------------------------------------
    def send(self, message: dict) -> None:
        data = (json.dumps(message) + "\n").encode()
        self.control.sendall(data)

    def receive(self) -> list[dict] | None:
        """The complete messages now readable; None when the pool closed the channel."""
        try:
            data, fds, _, _ = socket.recv_fds(self.control, 65536, 16)
        except InterruptedError:
            return []
        self.fds.extend(fds)
        if not data:
            return None
        self.buf += data
        if len(self.buf) > _MAX_LINE:
            raise ValueError("a control message is over the cap")
        messages = []
        while b"\n" in self.buf:
            line, _, rest = bytes(self.buf).partition(b"\n")
            self.buf = bytearray(rest)
            messages.append(json.loads(line))
        return messages

    # -- start: preload --------------------------------------------------------------
    def configure(self, config: dict) -> None:
        """Import what the manifest lists, run the load stage; say what it cost, or why it refuses."""
        global staged  # noqa: PLW0603 - the one value each fork reads back through worker_base.staged()
        self.script = config["script"]
        # As `python script.py` has it: the script's folder first, not this file's (whose
        # neighbours, such as settings.py, would shadow a model's own modules).
        sys.path[0] = os.path.dirname(os.path.abspath(self.script))
        sys.argv = [self.script]
        started = time.monotonic()
        timings = {}
        for name in config.get("preload") or []:
            begun = time.monotonic()
            try:
                importlib.import_module(name)
            except BaseException as exc:  # noqa: BLE001 - any failure to import is reported, then the zygote ends
                self.fail(f"importing {name!r} failed: {type(exc).__name__}: {exc}", "preload_failed")
                return
            timings[name] = round(time.monotonic() - begun, 3)
            touched = cuda_touched()
            if touched:
                self.refuse(f"importing {name!r} initialized CUDA ({touched})")
                return
        load_s = None
        if config.get("load"):
            begun = time.monotonic()
            try:
                staged = self.run_load_stage(config["load"], config.get("weights_root"))
            except BaseException as exc:  # noqa: BLE001 - as above: said, then the zygote ends
                self.fail(f"the load stage {config['load']!r} failed: {type(exc).__name__}: {exc}", "load_failed")
                return
            load_s = round(time.monotonic() - begun, 3)
            touched = cuda_touched()
            if touched:
                self.refuse(f"the load stage {config['load']!r} initialized CUDA ({touched})")
                return
        sys.modules[STAGED_MODULE] = sys.modules[__name__]
        threads = _threads()
        named = [thread.name for thread in threading.enumerate() if thread is not threading.main_thread()]
        print(f"zygote {self.pid}: preloaded {', '.join(timings) or 'nothing'} in "
              f"{time.monotonic() - started:.2f} s" + (f", load stage {load_s:.2f} s" if load_s is not None else "")
              + (f"; {threads} threads run here (Python's: {', '.join(named) or 'none'}; the rest native), and a "
                 "fork copies only the calling one" if threads > 1 else ""), flush=True)
        self.send({"event": "ready", "pid": self.pid, "modules": timings, "load_s": load_s, "threads": threads,
                   "python_threads": named, "python": sys.executable, "paths": _path_stamps(),
                   "files": _module_stamps()})

    def run_load_stage(self, name: str, weights_root: str | None):
        """``name`` is a function of the worker script, called with the weights root; the script's
        ``__main__`` block does not run here (it is imported under another name)."""
        spec = importlib.util.spec_from_file_location("resident_pool_worker_script", self.script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        function = getattr(module, name, None)
        if not callable(function):
            raise AttributeError(f"{self.script} has no function {name}()")
        return function(weights_root)

    def fail(self, why: str, reason: str) -> None:
        print(f"zygote {self.pid}: {why}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        self.refused = why
        self.send({"event": "failed", "error": why, "reason": reason})

    def refuse(self, why: str) -> None:
        print(f"zygote {self.pid}: refusing to fork: {why}; a forked CUDA context is broken", file=sys.stderr,
              flush=True)
        self.refused = why
        self.send({"event": "failed", "error": why, "reason": "cuda_initialized"})

    # -- serving ----------------------------------------------------------------------
    def serve(self) -> _Order | None:
        """Answer fork requests and report exits until the pool goes; returns only in a forked child."""
        messages = self.wait_for_configure()
        if messages is None or self.refused:
            return None
        wake_read, wake_write = socket.socketpair()
        wake_read.setblocking(False)
        wake_write.setblocking(False)
        # The handler only has to exist: the wakeup descriptor is what ends the select.
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(wake_write.fileno())
        selector = selectors.DefaultSelector()
        selector.register(self.control, selectors.EVENT_READ)
        selector.register(wake_read, selectors.EVENT_READ)
        pending = messages
        while True:
            for message in pending:
                order = self.handle(message)
                if order is not None:  # the child: shed the zygote's own descriptors, then run the worker
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    for closing in (wake_read, wake_write, self.control):
                        closing.close()
                    for fd in self.fds:
                        os.close(fd)
                    return order
            pending = []
            events = selector.select(1.0)  # the timeout only guards against a lost wakeup
            for key, _ in events:
                if key.fileobj is wake_read:
                    try:
                        while wake_read.recv(512):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    received = self.receive()
                    if received is None:
                        return None
                    pending.extend(received)
            self.reap()

    def wait_for_configure(self) -> list[dict] | None:
        while True:
            messages = self.receive()
            if messages is None:
                return None
            if messages:
                first, rest = messages[0], messages[1:]
                if first.get("op") != "configure":
                    self.send({"event": "failed", "error": f"expected configure, got {first.get('op')!r}",
                               "reason": "bad_request"})
                    return None
                self.configure(first)
                return rest

    def handle(self, message: dict) -> _Order | None:
        request_id = message.get("id")
        if message.get("op") != "fork":
            self.send({"id": request_id, "ok": False, "error": f"unknown op {message.get('op')!r}",
                       "reason": "unknown_op"})
            return None
        if not self.fds:
            self.send({"id": request_id, "ok": False, "error": "a fork request came without its transcript",
                       "reason": "bad_request"})
            return None
        out_fd = self.fds.pop(0)
        touched = cuda_touched()
        if touched:
            os.close(out_fd)
            self.send({"id": request_id, "ok": False, "reason": "cuda_initialized",
                       "error": f"CUDA was initialized in the zygote after its preload ({touched})"})
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(out_fd)
            self.send({"id": request_id, "ok": False, "error": f"fork failed: {exc}", "reason": "fork_failed"})
            return None
        if pid == 0:
            os.setsid()  # as start_new_session: its own group, so a stop reaches its children and no one else
            return _Order(list(message["argv"]), dict(message["env"]), message["cwd"], out_fd)
        os.close(out_fd)
        self.children.add(pid)
        self.send({"id": request_id, "ok": True, "pid": pid})
        return None

    def reap(self) -> None:
        """Report each child that ended; only our own forks are waited for (a preloaded module's helper
        processes are its business)."""
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                self.children.discard(pid)
                continue
            if done:
                self.children.discard(pid)
                self.send({"event": "exit", "pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _path_stamps() -> dict[str, int]:
    """The import path's folders and their mtimes: an install or upgrade there makes this zygote stale."""
    stamps = {}
    for entry in sys.path:
        try:
            stamps[entry] = os.stat(entry or ".").st_mtime_ns
        except OSError:
            continue
    return stamps


def _module_stamps() -> dict[str, int]:
    """Every loaded module's source file and its mtime: one edited since makes this zygote stale, since a fork
    would run the code it loaded, not the code on disk."""
    stamps = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or path in stamps:
            continue
        try:
            stamps[path] = os.stat(path).st_mtime_ns
        except OSError:
            continue  # a module from a zip or a frozen one: nothing on disk to compare
    return stamps


def run_child(order: _Order) -> None:
    """Become the worker: its transcript, folder, environment and argv, then its script as ``__main__``."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(order.out_fd, 1)
    os.dup2(order.out_fd, 2)
    os.close(order.out_fd)
    os.chdir(order.cwd)
    # The manifest's environment, not the zygote's: os.environ writes through to the C environment.
    os.environ.clear()
    os.environ.update(order.env)
    sys.argv = list(order.argv)
    sys.path[0] = os.path.dirname(os.path.abspath(order.argv[0]))
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # a spawned worker seeds numpy's global generator afresh; so does each fork
        numpy.random.seed()
    runpy.run_path(order.argv[0], run_name="__main__")


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    control.set_inheritable(False)
    zygote = Zygote(control)
    order = zygote.serve()
    if order is None:
        sys.stdout.flush()
        sys.stderr.flush()
        # A preloaded library's thread must not keep the zygote alive once the pool is gone.
        os._exit(0)
    # In the child. Whatever the script raises ends the process as it would end `python script.py`:
    # SystemExit with its code, KeyboardInterrupt by SIGINT, any other error with a traceback and 1.
    run_child(order)


if __name__ == "__main__":
    main()
