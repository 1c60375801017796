"""Tables that fit the terminal: short columns never wrap, the text column keeps room to be read.

At 100 columns a table of 14 columns gave its error column five characters, one word per line.
Here each column has a priority; the least needed go first until the text column keeps
``min_text`` characters, and the table says which it left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["Column", "fit_table"]

# Each column of a boxed table with padding 1 costs its width plus 3 (two spaces and a rule); the table 1 more.
_PER_COLUMN = 3


@dataclass(frozen=True)
class Column:
    """``priority``: higher is kept longer; ``text``: a column that wraps (an error, a path), kept whatever the
    width with at least ``min_text`` characters; ``whole``: a text column whose cells never break (file names:
    one cut in two cannot be copied), as wide as its widest cell; every other column stays on one line."""

    name: str
    priority: int = 0
    text: bool = False
    min_text: int = 40
    whole: bool = False


def fit_table(console: Console, title: str, columns: list[Column], rows: list[list[str]]) -> tuple[Table, list[str]]:
    """The table with the columns that fit ``console``'s width, and the names of those left out that had values."""
    kept = list(range(len(columns)))

    def natural(index: int) -> int:
        cells = [Text.from_markup(row[index]).cell_len for row in rows]
        return max([len(columns[index].name), *cells])

    def needed() -> int:
        total = 1
        for index in kept:
            column = columns[index]
            width = min(natural(index), column.min_text) if column.text and not column.whole else natural(index)
            total += width + _PER_COLUMN
        return total

    def empty(index: int) -> bool:
        return not any(Text.from_markup(row[index]).plain.strip() for row in rows)

    while needed() > console.width and len(kept) > 1:
        droppable = [i for i in kept if not columns[i].text] or kept
        # A column empty in every row goes first: leaving it out loses nothing.
        kept.remove(min(droppable, key=lambda i: (not empty(i), columns[i].priority, -i)))
    table = Table(title=title)
    for index in kept:
        column = columns[index]
        if column.whole:
            table.add_column(column.name, no_wrap=True, overflow="fold", min_width=natural(index))
        elif column.text:
            table.add_column(column.name, overflow="fold", min_width=min(natural(index), column.min_text))
        else:
            table.add_column(column.name, no_wrap=True, overflow="ellipsis")
    for row in rows:
        table.add_row(*(row[i] for i in kept))
    return table, [columns[i].name for i in range(len(columns)) if i not in kept and not empty(i)]
