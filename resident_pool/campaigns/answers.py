"""A provider's answer to ``{"inputs": [...]}`` split into one item per input (the campaign's and predict's shape)."""

from __future__ import annotations

from typing import Any

__all__ = ["per_input"]


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
