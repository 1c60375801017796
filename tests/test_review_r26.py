"""Review r26 of issue 26 (the Prefect face): reproductions of defects found, each failing at the reviewed commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).with_name("resident-pool"))
ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, cwd=None, env=None):
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=180, check=False, cwd=cwd, env=env)


def test_the_shipped_echo_provider_answers_through_the_console_script(isolated_dirs):
    """Any worker start fails at HEAD: Starter.run writes self.workers, an attribute Starter does not have."""
    done = _cli("predict", "echo", "--payload", '{"ping": "hello"}', "--manifests", str(ROOT / "manifests"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["ping"] == "hello"
