"""The layers: nothing imports upward, and a client never loads the server."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import resident_pool

PACKAGE = Path(resident_pool.__file__).parent

# Bottom to top. A module may import only from its own layer or below.
LAYERS = [
    {"states", "exits", "protocol", "arrays", "procs", "version", "worker_base", "kit_probe", "env_probe", "golden",
     "zygote_server", "events", "gpu_memory", "retention", "systemd"},
    {"errors"},
    {"settings", "inputs"},
    {"trust"},
    {"paths", "transcripts", "manifest", "breaker", "replica", "hibernate", "jit_cache"},
    {"worker_process", "weights", "exec_env", "admission", "results", "expected", "metrics"},
    {"campaign"},
    {"supervisor", "kit", "client"},
    {"provenance"},
    {"launch", "zygote", "observing"},
    {"pool", "check"},
    {"cli", "prefect", "__init__", "__main__"},
]
# Standard library only: loaded by path inside the model's own environment.
STANDALONE = {"protocol", "arrays", "worker_base", "kit_probe", "env_probe", "zygote_server"}


def _layer(module: str) -> int:
    for number, layer in enumerate(LAYERS):
        if module in layer:
            return number
    raise AssertionError(f"resident_pool.{module} is in no layer of tests/test_layers.py; add it where it belongs")


def _internal_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("resident_pool"):
            found.add([*node.module.split("."), ""][1] or "__init__")
    return found


def test_every_module_has_a_layer_and_imports_nothing_above_it():
    upward = []
    for path in sorted(PACKAGE.glob("*.py")):
        module = path.stem
        for imported in _internal_imports(path):
            if _layer(imported) > _layer(module):
                upward.append(f"{module} (layer {_layer(module)}) imports {imported} (layer {_layer(imported)})")
    assert upward == []


def test_the_modules_loaded_by_path_import_only_each_other():
    for module in STANDALONE:
        assert _internal_imports(PACKAGE / f"{module}.py") <= STANDALONE, module


def test_importing_the_client_loads_nothing_of_the_server():
    code = ("import sys, resident_pool.client; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('resident_pool'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    server = {f"resident_pool.{name}" for name in ("pool", "supervisor", "worker_process", "admission", "launch",
                                                    "kit", "exec_env", "weights", "manifest", "replica", "breaker")}
    assert "resident_pool.client" in loaded
    assert loaded & server == set()
