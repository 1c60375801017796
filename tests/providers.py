"""Build throwaway providers for tests: a manifest folder and a kit venv."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
KITS = Path(__file__).parent / "kits"
# A worker sees only a fixed base of the pool's environment plus what its manifest names: the
# test embedder's knobs must be named.
EMBEDDER_ENV = '[env]\npassthrough = ["EMBEDDER_COUNT", "EMBEDDER_DELAY_S", "EMBEDDER_MARKER"]\n'


def write_provider(root: Path, slug: str, body: str, worker: str | Path = "testworker.py") -> Path:
    """``root/<slug>/manifest.toml`` with ``body`` under a slug line, beside a copy of a test worker
    (a name in tests/workers, or a path)."""
    folder = root / slug
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(worker if isinstance(worker, Path) else WORKERS / worker, folder / "worker.py")
    path = folder / "manifest.toml"
    path.write_text(f'slug = "{slug}"\nworker = "worker.py"\n' + body)
    return path


def make_kit_venv(target: Path, *kits: str, checkout: bool = True, kits_dir: Path = KITS) -> Path:
    """A venv (no pip, fast) holding the named kits (from ``kits_dir``) and toymodel; returns its python.

    ``checkout``: each kit as a developer installs it from its checkout (``pip install -e``): the
    package under ``<target>/<kit>-checkout/src``, so the kit tree two levels up is the checkout.
    Otherwise the package is copied into site-packages, where no kit tree exists.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
    python = target / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    shutil.copy(KITS / "toymodel.py", purelib / "toymodel.py")
    for kit in kits:
        if checkout:
            source = target / f"{kit}-checkout" / "src"
            (target / f"{kit}-checkout" / "opt").mkdir(parents=True)  # where a real kit keeps its model root
            # Sorted before the kit's own .pth, so its autoload finds the package.
            (purelib / f"__editable__.{kit}.pth").write_text(f"{source}\n")
        else:
            source = purelib
        shutil.copytree(kits_dir / kit, source / kit, ignore=shutil.ignore_patterns("__pycache__"))
        autoload = kits_dir / f"{kit}-autoload.pth"
        if autoload.exists():
            shutil.copy(autoload, purelib / autoload.name)
    return python


def lifecycle(way: str = "spawn", **settings) -> str:
    """A ``[lifecycle]`` table with ``settings``; with way "zygote", a preload that makes the pool fork its workers."""
    lines = [f"{name} = {value}" for name, value in settings.items()]
    if way == "zygote":
        lines.append('preload = ["json", "ctypes"]')
    return "[lifecycle]\n" + "".join(f"{line}\n" for line in lines)
