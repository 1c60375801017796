"""Build throwaway providers for tests: a manifest folder and a kit venv."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
KITS = Path(__file__).parent / "kits"


def write_provider(root: Path, slug: str, body: str, worker: str = "testworker.py") -> Path:
    """``root/<slug>/manifest.toml`` with ``body`` under a slug line, beside a copy of a test worker."""
    folder = root / slug
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(WORKERS / worker, folder / "worker.py")
    path = folder / "manifest.toml"
    path.write_text(f'slug = "{slug}"\nworker = "worker.py"\n' + body)
    return path


def make_kit_venv(target: Path) -> Path:
    """A venv (no pip, fast) whose site-packages hold the test kits and toymodel; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
    python = target / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    for item in KITS.iterdir():
        if item.name == "README.md":
            continue
        destination = Path(purelib) / item.name
        if item.is_dir():
            shutil.copytree(item, destination, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(item, destination)
    return python


