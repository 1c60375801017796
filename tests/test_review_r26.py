"""Review r26 of issue 26 (the Prefect face): reproductions of defects found, each failing at the reviewed commit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).with_name("resident-pool"))
ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, cwd=None, env=None):
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in {"COLUMNS", "LINES"} - set(env or {})}
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=180, check=False, cwd=cwd, env=env)


def _letters(n: int) -> str:
    letters = "ACDEFGHIKLMNPQRSTVWY"
    return "".join(letters[n // 20 ** k % 20] for k in range(4))


def _readme_ui_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("## From the Prefect UI", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_ui_path_says_how_to_get_past_the_login_page():
    """`make stack-up` starts the server with an auth string, so the UI opens on a Login page ("admin:pass");
    the README's UI path says to open the UI and choose Deployments, and never where the string is."""
    assert "auth" in _readme_ui_section()


def test_the_readmes_stack_up_output_is_what_stack_up_prints():
    """The README shows stack-up's "real output", but stack.sh now also prints the relay, the auth string's file and
    where flow runs read and write; the README's lines come from an older stack.sh."""
    script = (ROOT / "infra" / "local" / "stack.sh").read_text()
    shown = _readme_ui_section().split("```console", 1)[1].split("```", 1)[0]
    assert "relay started" in shown and "relay" in script
    assert "registered paused (resume it in the UI)" not in shown, "a line stack.sh no longer prints"


def test_the_readme_says_which_toggle_runs_the_schedules():
    """The issue: "the README says which toggle runs them". The README says only "registered paused (resume it in
    the UI)"; which of the deployment page's two toggles is meant is in docs/prefect-ui.md alone."""
    assert "toggle" in (ROOT / "README.md").read_text().lower()
