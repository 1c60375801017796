"""A provider's answer to ``{"inputs": [...]}`` split into one item per input (the campaign's and predict's shape)."""

from __future__ import annotations

from typing import Any

__all__ = ["per_input", "with_refused"]


def per_input(answer: Any, expected: int) -> list[dict[str, Any] | None]:
    """The answer's per-input items; one that is not ``{"items": [one object per input]}`` answers none.

    An array ``<name>s`` beside the items with one row per input (minilm's ``embeddings`` under
    ``encoding = "array"``) gives each item its row as ``<name>``, unless the item has that field.
    """
    items = answer.get("items") if isinstance(answer, dict) else None
    if not isinstance(items, list) or len(items) != expected:
        return [None] * expected
    items = [item if isinstance(item, dict) else None for item in items]
    for name, value in answer.items():
        rows = _rows(value, expected) if name.endswith("s") and len(name) > 1 and name != "items" else None
        for item, row in zip(items, rows or (), strict=False):
            if item is not None:
                item.setdefault(name[:-1], row)
    return items


def _rows(value: Any, expected: int) -> list[Any] | None:
    """An array's rows when it has ``expected`` of them (numpy arrays, or arrays.Array without numpy)."""
    shape = getattr(value, "shape", None)
    if not isinstance(shape, tuple) or not shape or shape[0] != expected or not hasattr(value, "tolist"):
        return None
    return list(value) if hasattr(value, "__getitem__") else value.tolist()


def with_refused(items: list[dict[str, Any] | None], kept: list[int], refused: dict[int, str],
                 count: int) -> list[dict[str, Any] | None]:
    """``count`` items in input order: the answered ones (``items``, for the positions ``kept``) and, at each refused
    position, ``{"ok": false, "reason": "bad_input", "error": why}``, as a campaign's output records a bad input."""
    out: list[dict[str, Any] | None] = [None] * count
    for position, item in zip(kept, items, strict=True):
        out[position] = item
    for position, why in refused.items():
        out[position] = {"ok": False, "reason": "bad_input", "error": why}
    return out
