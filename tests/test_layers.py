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
     "zygote_server", "events", "gpu_memory", "retention", "systemd", "answers", "progress", "report"},
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
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            if node.module:
                target = base.joinpath(*node.module.split("."))
                found.add(target.name if (target / "__init__.py").exists() or target.with_suffix(".py").exists()
                          else node.module.split(".")[-1])
                if (target / "__init__.py").exists() and not target.with_suffix(".py").exists() \
                        and target.name not in _MODULES:
                    found.discard(target.name)
                    found.update(alias.name for alias in node.names)
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("resident_pool"):
            found.add([*node.module.split("."), ""][1] or "__init__")
    return found


def test_every_module_has_a_layer_and_imports_nothing_above_it():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.parent.name if path.stem == "__init__" and path.parent != PACKAGE else path.stem
        if path.stem == "__init__" and path.parent.name in _GROUPS:
            continue
        for imported in _internal_imports(path):
            if _layer(imported) > _layer(module):
                upward.append(f"{module} (layer {_layer(module)}) imports {imported} (layer {_layer(imported)})")
    assert upward == []


def test_the_modules_loaded_by_path_import_only_each_other():
    for module in STANDALONE:
        assert _internal_imports(PACKAGE / f"{module}.py") <= STANDALONE, module


_GROUPS = {"host", "providers", "server", "ops", "campaigns", "validation"}
_MODULES = {name for layer in LAYERS for name in layer}


def test_importing_the_client_loads_nothing_of_the_server():
    code = ("import sys, resident_pool.client; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('resident_pool'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    server = {f"resident_pool.{name}" for name in ("server.pool", "providers.supervisor", "providers.worker_process",
                                                    "admission", "providers.launch", "providers.kit",
                                                    "providers.exec_env", "providers.weights", "providers.manifest",
                                                    "server.replica", "server.breaker")}
    assert "resident_pool.client" in loaded
    assert loaded & server == set()
