"""What every command line shares: warnings as one line each."""
from __future__ import annotations

import pathlib
import warnings

_PACKAGE = str(pathlib.Path(__file__).resolve().parent)


def _one_line(message, category, filename, lineno, line=None) -> str:
  del line           # the source line warnings normally echoes says nothing to a user of a command
  if str(filename).startswith(_PACKAGE):
    return f"sinkjax: warning: {message}\n"
  return f"{filename}:{lineno}: {category.__name__}: {message}\n"


def one_line_warnings() -> None:
  """Each warning as one line: the package's own as 'sinkjax: warning: ...', others with their file and line."""
  warnings.formatwarning = _one_line
