"""`resident-pool admission-service`: the host-wide admission service, one for every user's pool on the host."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from ..errors import ResidentPoolError
from .base import app, errors, safe

__all__ = ["admission_service"]


@app.command("admission-service")
def admission_service(
    config: Annotated[Path | None, typer.Option("--config", help="Its TOML configuration (quotas, classes, socket); "
                                                "only its owner may be able to write it. Default: "
                                                "RESIDENT_POOL_ADMISSION_CONFIG (/etc/resident-pool/admission.toml)."
                                                )] = None,
    example: Annotated[bool, typer.Option("--example", help="Print an example configuration and exit.")] = False,
) -> None:
    """Run the host-wide admission service: one GPU ledger for every user's pool on this host, with quotas."""
    from ..admission.config import EXAMPLE, load_config
    from ..admission.service import AdmissionService
    from ..settings import settings

    if example:
        typer.echo(EXAMPLE, nl=False)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        service = AdmissionService(load_config(config or settings().admission_config))
        service.serve_forever()
    except ResidentPoolError as exc:
        errors.print(f"[red]{type(exc).__name__}[/]: {safe(exc)}", highlight=False, markup=True)
        raise typer.Exit(2) from None
