"""The one table printer of the suites: a header and rows of cells, rendered as Markdown (the
form docs/benchmarks.md quotes) or as plain text in aligned columns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Table:
    """Rows of cells under a header, every row as long as the header."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    align: str = ""
    """One letter a column, "l" (left) or "r" (right); empty: the first column left, the
    others right."""

    def __post_init__(self) -> None:
        width = len(self.header)
        bad = [row for row in self.rows if len(row) != width]
        if bad:
            raise ValueError(f"a row of {len(bad[0])} cells under a header of {width}")
        if self.align and (len(self.align) != width or set(self.align) - {"l", "r"}):
            raise ValueError(f"align {self.align!r}: one of l/r for each of {width} columns")

    @classmethod
    def of(cls, header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> Table:
        return cls(tuple(header), tuple(tuple(row) for row in rows), align)

    @property
    def aligns(self) -> str:
        return self.align or "l" + "r" * (len(self.header) - 1)

    def markdown(self) -> str:
        rule = "|" + "|".join("---:" if a == "r" else "---" for a in self.aligns) + "|"
        lines = ["| " + " | ".join(self.header) + " |", rule]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)

    def plain(self) -> str:
        """Columns padded to their widest cell and two spaces apart (no trailing spaces)."""
        columns = zip(self.header, *self.rows, strict=True)
        widths = [max(len(cell) for cell in column) for column in columns]
        lines = []
        for row in (self.header, *self.rows):
            cells = [
                cell.rjust(w) if a == "r" else cell.ljust(w)
                for cell, w, a in zip(row, widths, self.aligns, strict=True)
            ]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def render(self, markdown: bool = True) -> str:
        return self.markdown() if markdown else self.plain()
