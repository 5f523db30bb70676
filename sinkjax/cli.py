"""What every command line shares: the user-error type, the argument parser, the main wrapper, one-line warnings.

A problem the user can fix (a bad value, a missing file, an unreachable bucket) is a `UserError` (or a subclass:
`ConfigError`, `DataError`, `CheckpointError`, ...), raised where it is found with a message that says what to change.
`run_main(prog, fn)` turns one into `prog: error: MESSAGE` on stderr (one line) and exit status 1; argparse errors
are `prog: error: ... (see --help)` and status 2. This module imports nothing heavy (no jax), so every layer can
raise these errors.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

_PACKAGE = str(pathlib.Path(__file__).resolve().parent)


class UserError(ValueError):
  """A problem the user can fix; the message says what to change (printed as one line by `run_main`)."""


class ConfigError(UserError):
  """A user-facing configuration problem (the message says what to change)."""


class Parser(argparse.ArgumentParser):
  """argparse with errors as one line that points at --help (exit status 2)."""

  def error(self, message):
    print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
    sys.exit(2)


def run_main(prog: str, fn, extra_errors: tuple = ()) -> int:
  """Runs fn() -> exit status; a UserError (or one of extra_errors) becomes one line on stderr and status 1."""
  one_line_warnings()
  try:
    return fn() or 0
  except (UserError, *extra_errors) as e:
    print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 1


def _one_line(message, category, filename, lineno, line=None) -> str:
  del line           # the source line warnings normally echoes says nothing to a user of a command
  if str(filename).startswith(_PACKAGE):
    return f"sinkjax: warning: {message}\n"
  return f"{filename}:{lineno}: {category.__name__}: {message}\n"


def one_line_warnings() -> None:
  """Each warning as one line: the package's own as 'sinkjax: warning: ...', others with their file and line."""
  warnings.formatwarning = _one_line
