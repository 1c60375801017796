"""The folders a flow run may read and write, set on the worker host and never by a flow run.

Whoever can create a flow run chooses its parameters, and ``input``, ``output`` and ``manifests`` are paths: without
a bound, a UI user reads and writes wherever the worker's user can. The bounds are the worker's own settings
(``RESIDENT_POOL_INPUT_ROOT``, ``RESIDENT_POOL_OUTPUT_ROOT``, ``RESIDENT_POOL_MANIFESTS``), never a Prefect Block or
Variable, which anyone with API access may edit. A deployment's flow run requires them; a flow run started by
hand (the operator's own) is bounded only when they are set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from ..errors import InputError
from ..settings import Settings

__all__ = ["check_path", "in_deployment"]

Kind = Literal["input", "output", "manifests"]
_WORDS = {"input": "reads inputs", "output": "writes outputs", "manifests": "takes providers"}


def in_deployment() -> bool:
    """Whether this is a deployment's flow run (started from the UI, the API, a schedule or an automation)."""
    from prefect.runtime import deployment

    return deployment.id is not None


def _root(config: Settings, kind: Kind) -> tuple[Path | None, str, str]:
    """The kind's root, the setting that names it (as said in an error), and the variable that allows more."""
    if kind == "input":
        return config.input_root, "RESIDENT_POOL_INPUT_ROOT", "RESIDENT_POOL_INPUT_ROOT"
    if kind == "output":
        if config.output_root is None:  # outputs beside the inputs, as an inbox's <inbox>/screened
            return config.input_root, "RESIDENT_POOL_INPUT_ROOT (RESIDENT_POOL_OUTPUT_ROOT is unset)", \
                "RESIDENT_POOL_OUTPUT_ROOT"
        return config.output_root, "RESIDENT_POOL_OUTPUT_ROOT", "RESIDENT_POOL_OUTPUT_ROOT"
    return config.manifests, "RESIDENT_POOL_MANIFESTS", "RESIDENT_POOL_MANIFESTS"


def check_path(path: str | os.PathLike[str], kind: Kind, config: Settings) -> Path:
    """``path`` made absolute with its links resolved, when this flow run may use it as ``kind``.

    Under the kind's root in ``config`` (the worker host's settings; ``manifests``: the folder itself); else
    InputError naming the setting that allows more. A link inside a root that leads out of it is outside.
    """
    resolved = Path(path).expanduser().resolve()
    root, named_by, variable = _root(config, kind)
    where = {"path": str(path), "kind": kind}
    if root is None:
        if not in_deployment():
            return resolved
        raise InputError(f"{path}: a deployment's flow run {_WORDS[kind]} only under a folder the worker host names, "
                         f"and {variable} is not set in this worker's environment; set it there (in the worker's "
                         "service or shell, never in Prefect)", details=where)
    top = Path(root).expanduser().resolve()
    if kind == "manifests":
        inside, relation = resolved == top, "is not"
    else:
        inside, relation = resolved == top or top in resolved.parents, "is outside"
    if not inside:
        raise InputError(f"{path}: {relation} {top}, the folder {named_by} names; a flow run {_WORDS[kind]} only "
                         f"there: use a path under it, or set {variable} on the worker host to allow more",
                         details={**where, "root": str(top)})
    return resolved
