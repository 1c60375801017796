"""A stand-in container engine for tests: docker, podman and apptainer, executed the way each engine would.

Run through the wrapper scripts ``install()`` writes (named ``docker``,
``podman``, ``apptainer``, put first on PATH by a test)::

    standin.py STATE_DIR ENGINE ARGS...

What it holds the launch to:
- only ``--env``/``-e`` names (docker, podman) or ``APPTAINERENV_*`` (apptainer
  with ``--cleanenv``) reach the process, over the image's default environment;
- only mounted folders are visible: where this process may make a mount
  namespace (root), the command runs chrooted in a fresh root holding the
  image's system folders read-only plus the mounts; elsewhere every absolute
  path in the command and its environment must lie inside a mount or the image;
- a ``--name`` in use is refused; ``stop``/``kill NAME`` reach the container;
- apptainer, as the real one, also mounts the folders its own environment names
  in ``APPTAINER_BIND``/``APPTAINER_BINDPATH`` (and the ``SINGULARITY_`` ones);
  it does not make the PID namespace ``--containall`` asks for;
- ``docker run`` is a client: the container is not in the client's process
  group (a SIGKILL of the client leaves it running, as with the real engine),
  and SIGTERM/SIGINT/SIGHUP to the client are proxied to it. ``apptainer exec``
  is the container process itself.

Standard library only; it runs as root or not, in any interpreter.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

IMAGE_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE_ENV = ("PATH", "HOSTNAME", "HOME", "LANG")
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


class Refused(Exception):
    """What the real engine would refuse, with its exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def install(bin_dir: Path, state_dir: Path, python: str = sys.executable, isolate: bool = True) -> None:
    """Write ``docker``, ``podman`` and ``apptainer`` into ``bin_dir``, each running this file."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    flag = "" if isolate else "STANDIN_NO_NAMESPACE=1 "
    for engine in ("docker", "podman", "apptainer"):
        script = bin_dir / engine
        script.write_text(f'#!/bin/sh\n{flag}exec {python} {Path(__file__).resolve()} {state_dir} {engine} "$@"\n')
        script.chmod(0o755)


def can_isolate() -> bool:
    """Whether a mount namespace and a chroot can be made here (root with CAP_SYS_ADMIN)."""
    if os.getuid() != 0 or os.environ.get("STANDIN_NO_NAMESPACE"):
        return False
    pid = os.fork()
    if pid == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        os._exit(0 if libc.unshare(CLONE_NEWNS) == 0 and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE,
                                                                      None) == 0 else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


# -- parsing -------------------------------------------------------------------

def _take(args: list[str], i: int, flag: str) -> tuple[str, int]:
    if "=" in flag and flag.startswith("--"):
        return flag.split("=", 1)[1], i + 1
    if i + 1 >= len(args):
        raise Refused(f"flag needs an argument: {flag}", 125)
    return args[i + 1], i + 2


def parse_run(engine: str, args: list[str]) -> dict:
    """``run`` options of docker/podman, the image and the command; unknown flags are refused."""
    options = {"name": None, "env": [], "volumes": [], "gpus": None, "devices": [], "user": None, "rm": False,
               "network": None, "userns": None, "workdir": None, "cap_drop": [], "security_opt": []}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        flag = args[i]
        key = flag.split("=", 1)[0]
        if key in ("--rm", "--init", "-i", "-t", "--interactive", "--tty"):
            options["rm"] = options["rm"] or key == "--rm"
            i += 1
        elif key == "--name":
            options["name"], i = _take(args, i, flag)
        elif key in ("--env", "-e"):
            value, i = _take(args, i, flag)
            options["env"].append(value)
        elif key in ("--volume", "-v"):
            value, i = _take(args, i, flag)
            options["volumes"].append(value)
        elif key == "--gpus" and engine == "docker":
            options["gpus"], i = _take(args, i, flag)
        elif key == "--device":
            value, i = _take(args, i, flag)
            options["devices"].append(value)
        elif key in ("--user", "-u"):
            options["user"], i = _take(args, i, flag)
        elif key in ("--network", "--net"):
            options["network"], i = _take(args, i, flag)
        elif key == "--userns":
            options["userns"], i = _take(args, i, flag)
        elif key in ("--workdir", "-w"):
            options["workdir"], i = _take(args, i, flag)
        elif key == "--cap-drop":
            value, i = _take(args, i, flag)
            options["cap_drop"].append(value)
        elif key == "--security-opt":
            value, i = _take(args, i, flag)
            options["security_opt"].append(value)
        else:
            raise Refused(f"unknown flag: {flag}", 125)
    if i >= len(args):
        raise Refused('"run" requires at least 1 argument (the image)', 125)
    options["image"], options["command"] = args[i], args[i + 1:]
    if not options["command"]:
        raise Refused("no command given and the stand-in images have no default command", 125)
    return options


def parse_volume(text: str, code: int) -> tuple[str, str, bool]:
    parts = text.split(":")
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        return parts[0], parts[1], parts[2] == "ro"
    if len(parts) in (1, 2):
        return parts[0], parts[-1], False
    raise Refused(f"invalid volume specification: {text!r}", code)


def parse_exec(args: list[str]) -> dict:
    """``apptainer exec`` options, the image and the command."""
    options = {"cleanenv": False, "contain": False, "nv": False, "binds": [], "pwd": None}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        flag = args[i]
        key = flag.split("=", 1)[0]
        if key in ("--cleanenv", "-e"):
            options["cleanenv"] = True
            i += 1
        elif key in ("--contain", "-c"):
            options["contain"] = True
            i += 1
        elif key in ("--containall", "-C"):
            options["contain"] = options["cleanenv"] = True
            i += 1
        elif key == "--nv":
            options["nv"] = True
            i += 1
        elif key in ("--bind", "-B"):
            value, i = _take(args, i, flag)
            options["binds"] += value.split(",")  # apptainer's bind list is comma-separated
        elif key == "--pwd":
            options["pwd"], i = _take(args, i, flag)
        else:
            raise Refused(f"unknown flag: {flag}", 255)
    if i + 1 >= len(args):
        raise Refused("exec requires an image and a command", 255)
    options["image"], options["command"] = args[i], args[i + 1:]
    return options


# -- the container process -------------------------------------------------------

def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _encode(value):
    return value.encode() if isinstance(value, str) else value


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    encode = _encode
    if libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"mount {source} on {target}: {os.strerror(number)}")


def _bind(libc, host: str, target: str, read_only: bool) -> None:
    if os.path.isdir(host):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        Path(target).touch()
    _mount(libc, host, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(libc, None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def _isolated_root(state: Path, mounts: list[tuple[str, str, bool]], network_none: bool) -> str:
    """A fresh root in a new mount namespace: the image's system folders read-only, then the mounts."""
    libc = _libc()
    if libc.unshare(CLONE_NEWNS | (CLONE_NEWNET if network_none else 0)) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    (state / "roots").mkdir(parents=True, exist_ok=True)
    root = tempfile.mkdtemp(prefix="root-", dir=state / "roots")  # seen empty from the host
    _mount(libc, "tmpfs", root, "tmpfs", 0, "mode=0755")
    for folder in IMAGE_DIRS:
        if os.path.islink(folder):
            os.symlink(os.readlink(folder), root + folder)
        elif os.path.isdir(folder):
            _bind(libc, folder, root + folder, read_only=True)
    for folder in ("/dev", "/proc"):
        _bind(libc, folder, root + folder, read_only=False)
    os.makedirs(root + "/tmp", mode=0o1777, exist_ok=True)
    os.chmod(root + "/tmp", 0o1777)
    for host, inside, read_only in mounts:
        _bind(libc, host, root + inside, read_only)
    return root


def _visible(path: str, mounts: list[tuple[str, str, bool]]) -> bool:
    inside = [m[1] for m in mounts] + list(IMAGE_DIRS) + ["/dev", "/proc"]  # /tmp inside is a fresh one
    return any(path == top or path.startswith(top.rstrip("/") + "/") for top in inside)


def _check_paths(command: list[str], env: dict[str, str], mounts: list[tuple[str, str, bool]]) -> None:
    """Without a namespace: refuse a command that names a host path the container could not see."""
    passed = [value for name, value in env.items() if name not in IMAGE_ENV]  # the image's own need no mount
    texts = list(command) + [piece for value in passed for piece in value.split(":")]
    for text in texts:
        path = text.split("=", 1)[-1]
        if path.startswith("/") and not _visible(os.path.normpath(path), mounts):
            raise Refused(f"{path}: not visible inside the container (no mount holds it)", 127)


def _which(program: str, env: dict[str, str]) -> str:
    if "/" in program:
        return program
    for folder in env.get("PATH", IMAGE_PATH).split(":"):
        candidate = os.path.join(folder, program)
        if os.access(candidate, os.X_OK):
            return candidate
    raise Refused(f"{program}: executable file not found in $PATH", 127)


def enter(state: Path, command: list[str], env: dict[str, str], mounts: list[tuple[str, str, bool]], *,
          user: str | None = None, workdir: str | None = None, network_none: bool = False) -> None:
    """Become the container's process: isolate (or check paths), then exec. Never returns."""
    for host, _, _ in mounts:
        if not os.path.exists(host):
            raise Refused(f"bind source path does not exist: {host}", 125)
    if os.environ.get("STANDIN_NO_NAMESPACE") or not can_isolate():
        _check_paths(command, env, mounts)
        os.chdir("/")
    else:
        root = _isolated_root(state, mounts, network_none)
        os.chroot(root)
        os.chdir(workdir or "/")
    if user:
        uid, _, gid = user.partition(":")
        if gid and int(gid) != os.getgid():
            os.setgid(int(gid))
        if int(uid) != os.getuid():
            os.setuid(int(uid))
    program = _which(command[0], env)
    os.execve(program, command, env)


# -- registry of names (docker, podman) ----------------------------------------------

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _entry(state: Path, name: str) -> Path:
    return state / "containers" / name


def _read(state: Path, name: str) -> dict | None:
    try:
        return json.loads(_entry(state, name).read_text() or "{}")
    except (OSError, ValueError):
        return None


def reserve(state: Path, name: str) -> None:
    """Claim ``name``; a name held by a live container is refused as the engine refuses it."""
    path = _entry(state, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return
        except FileExistsError:
            held = _read(state, name)
            if held is None or held.get("shim") is None or _alive(held["shim"]):
                raise Refused(f'Conflict. The container name "/{name}" is already in use', 125) from None
            path.unlink(missing_ok=True)  # a shim that died without cleaning up: nothing runs under it
    raise Refused(f'Conflict. The container name "/{name}" is already in use', 125)


# -- commands ------------------------------------------------------------------

def run(engine: str, state: Path, args: list[str]) -> int:
    options = parse_run(engine, args)
    mounts = [parse_volume(text, 125) for text in options["volumes"]]
    env = {"PATH": IMAGE_PATH, "HOSTNAME": "standin", "HOME": "/root" if options["user"] in (None, "0", "0:0")
           else "/"}
    for item in options["env"]:
        name, has_value, value = item.partition("=")
        if has_value:
            env[name] = value
        elif name in os.environ:  # --env NAME: the client's value, if it has one
            env[name] = os.environ[name]
    gpus = options["gpus"]
    cdi = [d.split("=", 1)[1] for d in options["devices"] if d.startswith("nvidia.com/gpu=")]
    if gpus:
        env["NVIDIA_VISIBLE_DEVICES"] = gpus.strip('"').removeprefix("device=")
    elif cdi:
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(cdi)
    name = options["name"] or f"standin-{os.getpid()}"
    reserve(state, name)
    return _client(state, name, options, env, mounts)


def _client(state: Path, name: str, options: dict, env: dict[str, str], mounts) -> int:
    """The engine client: the container runs under a shim in a session of its own."""
    report_r, report_w = os.pipe()
    shim = os.fork()
    if shim == 0:
        os.close(report_r)
        os.setsid()
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        code = 125
        try:
            code = _shim(state, name, options, env, mounts, report_w)
        finally:
            os._exit(code)  # a forked shim never returns into the client's code
    os.close(report_w)
    reader = os.fdopen(report_r)
    line = reader.readline()
    if not line.strip().isdigit():
        os.waitpid(shim, 0)
        _entry(state, name).unlink(missing_ok=True)
        return 125
    container = int(line)

    def proxy(signum, frame):
        try:
            os.kill(container, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, proxy)
    code = reader.readline().strip()
    os.waitpid(shim, 0)
    return int(code) if code.lstrip("-").isdigit() else 125


def _shim(state: Path, name: str, options: dict, env, mounts, report_w: int) -> int:
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(ready_w)
        os.read(ready_r, 1)  # registered first, so a stop always finds it
        try:
            enter(state, options["command"], env, mounts, user=options["user"], workdir=options["workdir"],
                  network_none=options["network"] == "none")
        except Refused as exc:
            sys.stderr.write(f"standin: {exc}\n")
            os._exit(exc.code)
        except OSError as exc:
            sys.stderr.write(f"standin: cannot start the container: {exc}\n")
            os._exit(126)
    os.close(ready_r)
    _entry(state, name).write_text(json.dumps({"pid": child, "shim": os.getpid(), "image": options["image"],
                                               "env": sorted(env)}))
    os.write(ready_w, b"x")
    os.close(ready_w)
    _say(report_w, f"{child}\n")
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    code = 128 - code if code < 0 else code  # killed by signal N: the engine reports 128 + N
    if options["rm"]:
        _entry(state, name).unlink(missing_ok=True)
    _say(report_w, f"{code}\n")
    return code


def _say(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode())
    except OSError:
        pass  # the client was killed: the container still runs to its end, as with the real engine


def stop_or_kill(engine: str, state: Path, command: str, args: list[str]) -> int:
    grace, signum, names = 10.0, signal.SIGKILL, []
    i = 0
    while i < len(args):
        flag = args[i]
        key = flag.split("=", 1)[0]
        if command == "stop" and key in ("-t", "--time", "--timeout"):
            value, i = _take(args, i, flag)
            grace = float(value)
        elif command == "kill" and key in ("-s", "--signal"):
            value, i = _take(args, i, flag)
            signum = getattr(signal, value if value.startswith("SIG") else f"SIG{value}", None) or int(value)
        elif flag.startswith("-"):
            raise Refused(f"unknown flag: {flag}", 125)
        else:
            names.append(flag)
            i += 1
    if not names:
        raise Refused(f'"{command}" requires at least 1 argument', 125)
    failed = 0
    for name in names:
        held = _read(state, name)
        if not held or not held.get("pid") or not _alive(held["pid"]):
            sys.stderr.write(f"Error response from daemon: No such container: {name}\n")
            failed = 1
            continue
        pid = held["pid"]
        if command == "kill":
            os.kill(pid, signum)
        else:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.02)
        print(name)
    return failed


def apptainer(state: Path, args: list[str]) -> int:
    if not args or args[0] != "exec":
        raise Refused(f"the stand-in apptainer knows only exec, not {args[:1]}", 255)
    options = parse_exec(args[1:])
    mounts = [parse_volume(text, 255) for text in options["binds"]]
    for variable in ("APPTAINER_BIND", "APPTAINER_BINDPATH", "SINGULARITY_BIND", "SINGULARITY_BINDPATH"):
        mounts += [parse_volume(text, 255) for text in os.environ.get(variable, "").split(",") if text]
    if options["cleanenv"]:
        env = {"PATH": IMAGE_PATH, "LANG": "C"}
    else:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("APPTAINERENV_", "SINGULARITYENV_"))}
    env.update({k[len("APPTAINERENV_"):]: v for k, v in os.environ.items() if k.startswith("APPTAINERENV_")})
    if not options["contain"]:  # apptainer shares $HOME, /tmp and the working folder unless told to contain
        home = os.path.expanduser("~")
        mounts += [(folder, folder, False) for folder in {home, "/tmp", os.getcwd()} if os.path.isdir(folder)]
    enter(state, options["command"], env, mounts, workdir=options["pwd"])
    return 0


def _log_run(state: Path, engine: str, args: list[str]) -> None:
    """Every command, one JSON line, for tests that read what was run (names, flags)."""
    name = args[args.index("--name") + 1] if "--name" in args[:-1] else None
    state.mkdir(parents=True, exist_ok=True)
    with open(state / "runs.jsonl", "a") as handle:
        handle.write(json.dumps({"engine": engine, "name": name, "argv": args}) + "\n")


def main(argv: list[str]) -> int:
    state, engine, args = Path(argv[1]), argv[2], argv[3:]
    if args[:1] in (["run"], ["exec"]):
        _log_run(state, engine, args)
    try:
        if engine == "apptainer":
            return apptainer(state, args)
        if not args:
            raise Refused("a command is needed: run, stop or kill", 125)
        if args[0] == "run":
            return run(engine, state, args[1:])
        if args[0] in ("stop", "kill"):
            return stop_or_kill(engine, state, args[0], args[1:])
        raise Refused(f"the stand-in {engine} knows run, stop and kill, not {args[0]!r}", 125)
    except Refused as exc:
        sys.stderr.write(f"{engine} (stand-in): {exc}\n")
        return exc.code


if __name__ == "__main__":
    sys.exit(main(sys.argv))

