"""The `resident-pool` command: one module per part (the pool's commands, status, providers)."""

from __future__ import annotations

import typer

from ..errors import ResidentPoolError
from ..providers.transcripts import without_controls

# Each module registers its commands on the app as it is imported.
from . import admission, checks, pools, status  # noqa: F401
from .base import app

__all__ = ["app", "main"]


def main() -> None:
    try:
        app()
    except ResidentPoolError as exc:  # one a command did not put in its own words: its sentence, not a traceback
        typer.echo(without_controls(str(exc)), err=True)
        raise SystemExit(2 if exc.reason == "bad_setting" else 1) from None
