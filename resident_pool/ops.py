"""Operator calls to the pool that the client's ``Pool`` does not wrap: warm-up and the metrics text."""

from __future__ import annotations

from typing import Any

from .client import Pool

__all__ = ["metrics_text", "warm"]


def warm(pool: Pool, slug: str, replicas: int = 1) -> dict[str, Any]:
    """Start ``slug``'s workers until ``replicas`` of them run (and answer); returns what was started."""
    reply = pool._call({"op": "warm", "slug": slug, "replicas": replicas, "manifests": str(pool.manifests)})
    reply.pop("ok", None)
    return reply


def metrics_text(pool: Pool) -> str:
    """The pool's metrics in Prometheus's text format."""
    return pool._call({"op": "metrics"})["text"]
