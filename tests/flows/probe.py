"""A flow that reports what its process sees and, asked to, leaves mischief behind (tests/test_forked_runs.py).

Deployed from a copy of this folder; ``probe_local`` is the deployment's own module, ``probe_lib`` one installed on
the worker's path (the zygote keeps the second, never the first).
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import subprocess
import threading
import time

import numpy
import probe_lib
from prefect import flow, get_run_logger
from prefect.settings import get_current_settings
from probe_local import LOCAL_VERSION

VERSION = 1


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as out:
        json.dump(data, out)
    os.replace(path + ".tmp", path)


@flow
def probe(report: str, mischief: bool = False, crash: bool = False, hang: bool = False) -> None:
    name = os.path.basename(report)
    get_run_logger().info("probe-log %s", name)
    print(f"probe-print {name}", flush=True)
    if crash:
        ctypes.string_at(0)  # SIGSEGV: the interpreter itself goes
    if hang:
        sleeper = subprocess.Popen(["sleep", "600"])
        _write(report, {"pid": os.getpid(), "sleeper": sleeper.pid})
        time.sleep(600)
    _write(report, {
        "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
        "threads": sorted(thread.name for thread in threading.enumerate()),
        "leaked_env": os.environ.get("PROBE_LEAKED"), "zygote_env": "PYTORCH_NVML_BASED_CUDA_CHECK" in os.environ,
        "patched": getattr(json, "probe_patched", False), "random": random.random(),
        "numpy": float(numpy.random.random()), "cwd": os.getcwd(),
        "retries": get_current_settings().tasks.default_retries,
        "version": VERSION, "local": LOCAL_VERSION, "lib": probe_lib.VALUE})
    if mischief:  # what a careless flow leaves in its process: none of it may reach the next run
        threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="probe-leak").start()
        os.environ["PROBE_LEAKED"] = "1"
        json.probe_patched = True
        random.seed(0)
        numpy.random.seed(0)
