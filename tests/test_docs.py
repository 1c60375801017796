"""The README and the manual (docs/, MkDocs): it builds with every link and anchor resolved, and names real paths."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")
README_LINES = 300
# A path into the repository, as the prose names it: `resident_pool/server/states.py`, `infra/systemd/`.
REPO_PATH = re.compile(r"`((?:resident_pool|tests|infra|flows|bench|manifests|data|docs)/[\w./-]*)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTPUTS = {"bench/results/latest.json"}  # written by `make bench`, not kept in the repository


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_manual_builds_strict_so_a_broken_link_or_anchor_fails_the_suite(tmp_path):
    if not MKDOCS.exists():
        pytest.fail(f"{MKDOCS} is missing: mkdocs is in the test extra; run `make setup`")
    done = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "settings" / "index.html").exists()


def test_the_readme_fits_on_a_screen_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (ROOT / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert broken == []


def test_every_path_the_readme_and_the_manual_name_exists():
    missing = []
    for page in _pages():
        for path in REPO_PATH.findall(page.read_text()):
            if any(mark in path for mark in "<*…") or re.search(r"/[A-Z]+(/|$)", path):
                continue  # a pattern (`manifests/<slug>/`, `manifests/SLUG/`), not a path
            if path not in OUTPUTS and not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert missing == []
