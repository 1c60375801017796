"""The layers, read from the packages: nothing imports upward, and a client never loads the server.

Each sub-package of ``resident_pool`` is one part, each top-level module another; the parts'
imports must form no cycle (so there is an order in which each imports only what lies below
it), and neither may the modules' inside a part. No list here says which part is above which:
the imports themselves say it, and a cycle is the error. An import made for type hints only
(under ``TYPE_CHECKING``) is an edge too: a lower module types a call back up with a
``typing.Protocol`` of its own.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import resident_pool

PACKAGE = Path(resident_pool.__file__).parent
# Standard library only: loaded by path inside the model's own environment.
STANDALONE = {"protocol", "arrays", "worker_base", "kit_probe", "env_probe", "zygote_server"}
CLASS_LINES = 400


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module by dotted name below the package (``server.core``, ``errors``, ``prefect``)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts) or "__init__"] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path, modules: dict[str, Path] = MODULES) -> set[str]:
    """The package's own modules ``name`` imports, anywhere in it (inside functions, and for type hints, too)."""
    here = name.split(".") if path.name != "__init__.py" else [*name.split("."), "__init__"]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("resident_pool")):
            if node.level:
                base = here[: len(here) - node.level]
                target = [*base, *(node.module.split(".") if node.module else [])]
            else:
                target = node.module.split(".")[1:]
            for alias in node.names:  # `from . import paths` names a module; `from .x import y` a name in x
                dotted = ".".join([*target, alias.name])
                found.add(dotted if dotted in modules else ".".join(target))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("resident_pool."):
                    found.add(alias.name.removeprefix("resident_pool."))
    return {module for module in found if module in modules and module != name}


def _part(module: str) -> str:
    return module.split(".", maxsplit=1)[0]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _graphs(found: dict[str, Path] = MODULES) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    parts: dict[str, set[str]] = {}
    modules: dict[str, set[str]] = {}
    for name, path in found.items():  # every module: the package's face, its aliases and __main__ too
        imported = _imports(name, path, found)
        modules[name] = imported
        parts.setdefault(_part(name), set()).update(_part(m) for m in imported if _part(m) != _part(name))
    return parts, modules


def test_the_parts_import_each_other_without_a_cycle_so_each_imports_only_what_lies_below_it():
    parts, _ = _graphs()
    assert {"server", "providers", "host", "campaigns", "validation", "ops", "admission", "prefect", "cli"} <= set(parts)
    assert _cycle(parts) is None, f"these parts import each other in a circle: {' -> '.join(_cycle(parts))}"


def test_no_module_imports_a_module_that_imports_it_back():
    _, modules = _graphs()
    assert _cycle(modules) is None, f"import cycle: {' -> '.join(_cycle(modules))}"


def test_nothing_below_the_pool_server_imports_it():
    _, modules = _graphs()
    importers = {name for name, imported in modules.items() if any(_part(m) == "server" for m in imported)}
    assert {_part(name) for name in importers} <= {"server", "cli"}


def test_the_modules_loaded_by_path_import_only_each_other():
    for module in STANDALONE:
        assert _imports(module, MODULES[module]) <= STANDALONE, module


def test_no_class_is_longer_than_about_400_lines():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_importing_the_client_loads_nothing_of_the_server():
    code = ("import sys, resident_pool.client; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('resident_pool'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert "resident_pool.client" in loaded
    assert {m for m in loaded if _part(m.removeprefix("resident_pool.")) in ("server", "providers", "admission")} == set()


@pytest.mark.parametrize("module", ["resident_pool.worker_base", "resident_pool.zygote_server",
                                    "resident_pool.server.daemon"])
def test_a_model_worker_a_zygote_and_the_pool_load_none_of_the_clients_modules_at_start(module):
    """Every process of the pool imports the package; its ``__init__`` loaded the clients (settings, filelock,
    asyncio) eagerly, 0.15 s of CPU at every model worker's start for nothing. The daemon loads settings on its own
    when it runs, not at import."""
    code = (f"import sys, {module}; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('resident_pool', 'pydantic_settings', "
            "'filelock', 'asyncio')))))")
    loaded = set(subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                                check=True).stdout.split())
    assert module in loaded
    assert loaded & {"resident_pool.client", "resident_pool.aio", "resident_pool.settings", "pydantic_settings",
                     "filelock", "asyncio"} == set()


def test_the_packages_lazy_names_are_the_ones_it_exports():
    code = ("import resident_pool as r; print(r.Pool.__module__, r.Session.__module__, r.AsyncPool.__module__, "
            "r.AsyncSession.__module__, r.ResidentWorker.__module__, 'Pool' in dir(r))")
    said = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert said == ["resident_pool.client", "resident_pool.client", "resident_pool.aio.pool",
                    "resident_pool.aio.session", "resident_pool.providers.supervisor", "True"]
    assert set(resident_pool.__all__) <= set(dir(resident_pool))


def test_a_plain_import_still_reaches_the_submodules_the_eager_package_made_reachable():
    """The package loads its clients on first use (0632ea7): a plain ``import resident_pool`` then
    ``resident_pool.arrays.Array`` (the type docs/arrays.md names; a worker script or a payload builder touches it
    before any Pool) raised AttributeError, as did ``.client``, ``.aio``, ``.settings`` and the other modules the
    eager import had made attributes of the package. Each is reachable again, loaded when first named, and a plain
    import still loads none of them."""
    code = ("import sys, resident_pool as r; print('resident_pool.client' in sys.modules, r.arrays.Array.__name__, "
            "r.client.Pool.__name__, r.aio.AsyncPool.__name__, r.settings.Settings.__name__, "
            "' '.join(m.__name__ for m in (r.protocol, r.lease, r.messages, r.priority)))")
    said = subprocess.run([sys.executable, "-P", "-c", code], check=False, capture_output=True, text=True)
    assert said.returncode == 0, said.stderr[-2000:]
    assert said.stdout.split() == ["False", "Array", "Pool", "AsyncPool", "Settings", "resident_pool.protocol",
                                   "resident_pool.lease", "resident_pool.messages", "resident_pool.priority"]


def test_a_two_way_pair_hidden_behind_type_checking_is_an_import_cycle(tmp_path):
    """server/pool.py <-> status.py, runtime.py <-> starts.py and lifecycle.py <-> drains.py each hid their back edge
    behind TYPE_CHECKING, which this test skipped: a planted pair must fail it."""
    (tmp_path / "part").mkdir()
    (tmp_path / "part" / "__init__.py").write_text("")
    (tmp_path / "part" / "upper.py").write_text("from .lower import helper\n")
    (tmp_path / "part" / "lower.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .upper import Upper\n")
    _, modules = _graphs(_modules(tmp_path))
    assert _cycle(modules) == ["part.lower", "part.upper", "part.lower"]


def test_every_module_is_in_the_graph_whatever_its_text_says(tmp_path):
    """A module was left out when its text held ``sys.modules[__name__]`` (zygote_server.py does, and is no alias):
    a cycle through one must fail the test, and the package's face, its aliases and ``__main__`` are nodes too."""
    (tmp_path / "part").mkdir()
    (tmp_path / "part" / "__init__.py").write_text("")
    (tmp_path / "part" / "upper.py").write_text("from .lower import helper\n")
    (tmp_path / "part" / "lower.py").write_text(
        "import sys\n\nfrom .upper import Upper\n\nsys.modules['staged'] = sys.modules[__name__]\n")
    _, modules = _graphs(_modules(tmp_path))
    assert _cycle(modules) == ["part.lower", "part.upper", "part.lower"]
    _, real = _graphs()
    assert set(real) == set(MODULES) and {"zygote_server", "supervisor", "__init__", "__main__"} <= set(real)
