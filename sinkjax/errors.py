"""The errors a user can fix and how every command reports them: the `UserError` types, the main wrapper
(`run_main`), argparse with one-line errors (`Parser`), the missing-extra check, one-line warnings. The command line
itself (flags, option sections) is `sinkjax.options`.

A problem the user can fix (a bad value, a missing file, an unreachable bucket) is a `UserError` (or a subclass:
`ConfigError`, `DataError`, `CheckpointError`, ...), raised where it is found with a message that says what to change.
`run_main(prog, fn)` turns one into `prog: error: MESSAGE` on stderr (one line) and exit status 1; argparse errors
are `prog: error: ... (see --help)` and status 2; a run stopped by a signal (`Interrupted`) is one line and status
128 + the signal number. A command whose extra is not installed says which one (`require_extra`). This module
imports nothing heavy (no jax), so every layer can raise these errors. A module that is no longer a command says what
replaced it (`moved`).
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import signal
import sys
import warnings

_PACKAGE = str(pathlib.Path(__file__).resolve().parent)


class UserError(ValueError):
  """A problem the user can fix; the message says what to change (printed as one line by `run_main`)."""


class ConfigError(UserError):
  """A user-facing configuration problem (the message says what to change)."""


class Interrupted(Exception):
  """Training stopped by SIGTERM / SIGINT after saving a checkpoint (the same command resumes it)."""

  def __init__(self, signum: int, step: int):
    super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint saved, rerun the same "
                     "command to resume")
    self.signum = signum


# What each extra brings that a command imports at its start (pyproject.toml's optional dependencies).
EXTRAS = {"train": ("grain", "orbax.checkpoint", "tensorflow_datasets", "matplotlib", "tensorboardX", "tqdm")}


def require_extra(prog: str, extra: str = "train") -> None:
  """Where a command starts, before anything imports the extra's packages (a command module: under `if __name__ ==
  "__main__"` above its imports; one that imports them later: first thing in main()): one line naming the extra to
  install and exit status 1 when one is missing (the core install is the layer and the kernels alone)."""
  missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m.split(".")[0]) is None
             or importlib.util.find_spec(m) is None]
  if missing:
    print(f"{prog}: error: {', '.join(missing)} not installed; pip install 'sinkjax[{extra}]'", file=sys.stderr)
    sys.exit(1)


def moved(module: str, replacement: str) -> None:
  """A module that was a command and no longer is, run as one (`python -m`; at the top of the module, under `if
  __name__ == "__main__"`, before its imports): one line naming what replaced it, exit status 2; nothing runs."""
  print(f"{module}: error: no longer a command; run {replacement}", file=sys.stderr)
  sys.exit(2)


class Parser(argparse.ArgumentParser):
  """argparse with errors as one line that points at --help (exit status 2)."""

  def error(self, message):
    print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
    sys.exit(2)


def run_main(prog: str, fn, extra_errors: tuple = ()) -> int:
  """Runs fn() -> exit status (None: 0); a UserError (or one of extra_errors) becomes one line on stderr and status
  1, an `Interrupted` run one line and status 128 + the signal number (Ctrl-C elsewhere: 130)."""
  one_line_warnings()
  try:
    return fn() or 0
  except Interrupted as e:
    print(f"{prog}: {e}", file=sys.stderr)
    return 128 + e.signum
  except KeyboardInterrupt:          # Ctrl-C outside a training loop: end the line, no traceback
    print("", file=sys.stderr)
    return 128 + signal.SIGINT
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
