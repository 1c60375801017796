"""The asyncio client: ``AsyncPool`` and its ``AsyncSession`` (docs/asyncio.md)."""

from __future__ import annotations

from .pool import AsyncPool
from .session import AsyncSession

__all__ = ["AsyncPool", "AsyncSession"]
