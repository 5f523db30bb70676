"""Markdown tables: the one writer of the tables the reports, benchmarks and commands print."""
from __future__ import annotations


def table(cols, rows, align: str = "") -> list[str]:
  """A markdown table: the header `cols`, its separator (`align`: "l" / "r" a column, default left) and one line per
  row (a list of cells, or a line as it is)."""
  line = lambda cells: cells if isinstance(cells, str) else "| " + " | ".join(map(str, cells)) + " |"
  return [line(cols), "|" + "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(cols), "l")),
          *map(line, rows)]
