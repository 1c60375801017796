"""One place names every RESIDENT_POOL_* variable."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

import resident_pool
from resident_pool.errors import ResidentPoolError
from resident_pool.settings import WORKER_SIDE, Settings, settings

ROOT = Path(resident_pool.__file__).parents[1]
NAME = re.compile(r"RESIDENT_POOL_[A-Z0-9_]*[A-Z0-9]")
READ = re.compile(r"""environ(\.get\(|\[)\s*["']RESIDENT_POOL_|["']RESIDENT_POOL_[A-Z_]+["']\s+(not\s+)?in\s+os\.environ""")


def declared() -> set[str]:
    return {f"RESIDENT_POOL_{field.upper()}" for field in Settings.model_fields} | set(WORKER_SIDE)


def test_every_variable_the_code_reads_is_declared_in_settings():
    used = set()
    for folder in ("resident_pool", "flows", "manifests"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(NAME.findall(path.read_text()))
    assert used - declared() == set()


def test_every_declared_variable_has_a_row_in_the_manuals_settings_table_and_every_row_is_declared():
    rows = set(re.findall(r"^\| `(RESIDENT_POOL_[A-Z0-9_]+)` \|", (ROOT / "docs" / "settings.md").read_text(), re.M))
    assert declared() - rows == set()  # missing from docs/settings.md
    assert rows - declared() == set()  # documented but no longer read


def test_a_bad_value_names_its_variable(monkeypatch):
    monkeypatch.setenv("RESIDENT_POOL_GPU_HEADROOM_GB", "lots")
    with pytest.raises(ResidentPoolError, match="RESIDENT_POOL_GPU_HEADROOM_GB='lots'"):
        settings()


def test_a_variable_is_read_under_exactly_the_names_pydantic_settings_matched():
    """``Settings`` was pydantic-settings' ``BaseSettings`` (case-insensitive, prefix ``RESIDENT_POOL_``): a variable
    set a field when its whole name, lowercased, was ``resident_pool_<field>``. The hand-written reader matched
    ``name.upper()`` against the prefix, and so also read names no one means as this one, whose prefix upper-cases
    to it: a dotless i (U+0131) or a long s (U+017F) in it set tick_s to 1.0 where pydantic-settings kept 0.25."""
    given = {"resident_pool_tick_s": "1", "Resident_Pool_Max_Connections": "8", "RESIDENT_POOL_aging_s": "5",
             "RES\u0131DENT_POOL_KEEPALIVE_S": "3", "re\u017fident_pool_liveness_timeout_s": "4",
             "RESIDENT_POOL_NOT_A_FIELD": "x", "RESIDENT_POOL_": "x"}
    config = Settings.from_environment(given)
    assert (config.tick_s, config.max_connections, config.aging_s) == (1.0, 8, 5.0)
    assert (config.keepalive_s, config.liveness_timeout_s) == (10.0, 10.0)  # the defaults: neither name is read


def test_modules_other_than_settings_and_the_worker_side_do_not_read_the_environment_for_these_names():
    readers = []
    for path in sorted((ROOT / "resident_pool").rglob("*.py")):
        if path.stem in ("settings", "worker_base"):
            continue
        readers += [f"{path.name}: {line.strip()}" for line in path.read_text().splitlines() if READ.search(line)]
    assert readers == []


HOST_FOLDERS = ("/etc/resident-pool", "/run/resident-pool", "/var/lib/resident-pool")


def test_every_test_runs_with_admission_settings_of_its_own_never_the_hosts(isolated_dirs):
    """Issue 31 finding 7: with /etc/resident-pool/admission.toml and a service on /run/resident-pool on the host,
    26 tests failed ("the admission service socket ... is served by uid 999"): the suite read the host's
    configuration. Each test's settings name its own files (the conftest's), whatever the host has."""
    from resident_pool.admission.remote import service_socket

    config = settings()
    assert service_socket(config) is None  # this user's own ledger, as on a host without the service
    assert Path(isolated_dirs["state"]).parent in config.admission_config.parents
    named = {name: value for name, value in os.environ.items() if name.startswith("RESIDENT_POOL_")}
    assert not {name for name, value in named.items() if any(folder in value for folder in HOST_FOLDERS)}, named


# The edges: where the settings are read from the environment, each once per command, pool, client or flow run.
# Everything below them takes the values (and the folders, as one ``Paths``) as arguments.
EDGES = {
    "cli/base.py": {"configured"},  # every command but one, through it
    "cli/admission.py": {"admission_service"},  # the host admission service's start
    "server/pool.py": {"PoolServer.__init__"},  # a pool made without settings (a test's) reads them
    "server/daemon.py": {"run"},  # the pool's process: `resident-pool daemon` and what a client starts
    "client.py": {"Pool.__init__"},  # Pool(): a client's settings are those of when it was made
    "providers/supervisor.py": {"ResidentWorker.__init__"},  # a standalone worker: the original design's entry
    "prefect/__init__.py": {"host_settings"},  # the flows and the helpers their tasks call
    "prefect/worker.py": {"ResidentProcessWorker.__init__"},  # the resident-process worker's start (Prefect makes it)
}


def _readers(source: str) -> set[str]:
    """The functions (qualified names; ``<module>`` for top-level code) of ``source`` that read the settings from
    the environment: ``settings()`` under any name it is imported as, ``Settings.from_environment()``, or
    ``Settings()`` built directly (which reads nothing: the defaults, whatever the variables say)."""
    tree = ast.parse(source)
    readers_of = {"settings", "Settings"}  # what resident_pool.settings exports that reads the environment
    aliases: dict[str, str] = {}  # local name -> what it is: one of readers_of, or "module" (resident_pool.settings)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[-1] == "settings" and (node.level or module.startswith("resident_pool")):
                aliases.update({a.asname or a.name: a.name for a in node.names if a.name in readers_of})
            elif node.level or module == "resident_pool":  # `from .. import settings`: the module
                aliases.update({a.asname or a.name: "module" for a in node.names if a.name == "settings"})
        elif isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: "module" for a in node.names if a.name == "resident_pool.settings"})
    found = set()

    def visit(node: ast.AST, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*where, child.name])
                continue
            if isinstance(child, ast.Call):
                called = child.func
                if isinstance(called, ast.Attribute) and called.attr == "from_environment":
                    called = called.value  # Settings.from_environment(): a reading, as Settings() is
                    if isinstance(called, ast.Attribute) and called.attr != "Settings":
                        called = None
                direct = isinstance(called, ast.Name) and aliases.get(called.id) in readers_of
                through = (isinstance(called, ast.Attribute) and called.attr in readers_of
                           and isinstance(called.value, ast.Name) and aliases.get(called.value.id) == "module")
                if direct or through:
                    found.add(".".join(where) or "<module>")
            visit(child, where)

    visit(tree, [])
    return found


def test_the_reader_finds_settings_called_under_any_name_and_a_settings_object_built_directly():
    source = ("from ..settings import settings as read\nfrom .. import settings as module\n"
              "from resident_pool.settings import Settings\n"
              "def plain():\n    return read().tick_s\n"
              "class Deep:\n    def method(self):\n        return module.settings()\n"
              "def built():\n    return Settings()\n"
              "def read_now():\n    return Settings.from_environment().tick_s\n"
              "def through_module():\n    return module.Settings.from_environment()\n"
              "def typed(config: Settings) -> float:\n    return config.tick_s\n")
    assert _readers(source) == {"plain", "Deep.method", "built", "read_now", "through_module"}


def test_only_the_edges_read_the_settings_everything_below_takes_them_as_values():
    """Issue 32: ``settings()`` was called 22 times in 16 modules (host/paths.py three times), so a module deep in
    the pool read the environment whenever it ran and a test could configure it only through variables."""
    package = ROOT / "resident_pool"
    readers = {}
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        if name == "settings.py":
            continue
        found = _readers(path.read_text())
        if found:
            readers[name] = found
    outside = {name: functions - EDGES.get(name, set()) for name, functions in readers.items()}
    assert {name: functions for name, functions in outside.items() if functions} == {}
    assert readers == EDGES  # every edge named here still reads them: the list says where they are read
