"""One place names every RESIDENT_POOL_* variable."""

from __future__ import annotations

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
