"""Self-contained studies that reproduce results of the source papers (docs/TRIGGER.md, docs/RESULTS.md,
docs/STREAMING.md's passkey probe)."""
from __future__ import annotations

import argparse


def int_at_least(lo: int):
  """argparse type: an integer >= lo, else a one-line usage error."""
  def parse(s):
    try:
      v = int(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {s!r}") from None
    if v < lo:
      raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {s!r}")
    return v
  return parse
