"""The `resident-pool` command: one module per part (the pool's commands, status, providers)."""

from __future__ import annotations

# Each module registers its commands on the app as it is imported.
from . import admission, checks, pools, status  # noqa: F401
from .base import app

__all__ = ["app", "main"]


def main() -> None:
    app()
