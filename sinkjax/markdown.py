"""Markdown tables: the one writer of the tables the reports, benchmarks and commands print (`row` for a table printed
a row at a time, as its rows are measured)."""
from __future__ import annotations


def row(cells) -> str:
  """One line of a table: a list of cells, or a line as it is."""
  return cells if isinstance(cells, str) else "| " + " | ".join(map(str, cells)) + " |"


def table(cols, rows=(), align: str = "") -> list[str]:
  """A markdown table: the header `cols`, its separator (`align`: "l" / "r" a column, default left) and one line per
  row (`row`)."""
  return [row(cols), "|" + "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(cols), "l")),
          *map(row, rows)]
