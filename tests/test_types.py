"""The pool server type-checks strictly: mypy --strict over resident_pool/server (pyproject's [tool.mypy])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_pool_server_passes_mypy_strict(tmp_path):
    ran = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
    assert "Success: no issues found" in ran.stdout
