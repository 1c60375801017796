"""Compile, once after `make setup`'s install, the modules this project's processes import.

Setup installs with pip's --no-compile: pip would compile every module of every package (torch's and sympy's
thousands and transformers' hundreds of models among them), of which a pool, its model workers, a flow run, the
command line and the suite import about a third. This imports what they import, in one process per group at once
(two cores here), each writing the bytecode of what it imported; this project's own package is compiled whole
(a service may import any part of it). A module imported later for the first time is compiled then and kept: make
exports no PYTHONDONTWRITEBYTECODE. A venv its user cannot write (a service's checkout run as its own user) keeps
whatever was compiled here.

Exits non-zero, naming the module, where an installed package fails to import: the install is broken, and saying
so here is better than in the first pool that starts. A package an extra did not install is skipped.
"""

from __future__ import annotations

import compileall
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What the project's processes import, grouped so that each group takes about as long: the orchestration side
# (Prefect's client, server and worker, the pool, the CLI, the suite's own tools) and the demo model's side.
GROUPS = (
    ("prefect", "prefect.server.api.server", "prefect.workers.process", "prefect.testing.utilities",
     "resident_pool.cli", "resident_pool.server.daemon", "resident_pool.prefect", "resident_pool.aio",
     "pytest", "xdist", "hypothesis", "playwright.sync_api"),
    ("torch", "transformers", "sentence_transformers", "numpy", "pyarrow.parquet"),
)


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name.split(".", maxsplit=1)[0]) is not None
    except (ImportError, ValueError):
        return False


def main() -> int:
    sys.dont_write_bytecode = False
    compileall.compile_dir(ROOT / "resident_pool", quiet=1)
    runs = []
    for group in GROUPS:
        names = [name for name in group if installed(name)]
        script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
        runs.append((names, subprocess.Popen([sys.executable, "-c", script, *names], cwd=ROOT,
                                             stderr=subprocess.PIPE, text=True)))
    failed = 0
    for names, run in runs:
        _, errors = run.communicate()
        if run.returncode != 0:
            failed = 1
            print(f"precompile: importing {', '.join(names)} failed (exit {run.returncode}); the install is broken:\n"
                  f"{errors[-3000:]}", file=sys.stderr)
    return failed


if __name__ == "__main__":
    sys.exit(main())
