"""Checkpoint conversion to and from other frameworks: `hf` (Hugging Face transformers, safetensors only) and
`nanochat` (its torch state dicts, read with weights_only=True)."""
from __future__ import annotations

import sys
from sinkjax.cli import UserError


class ConvertError(UserError):
  """A user-facing conversion problem (bad directory, unsupported architecture or option)."""


def run_cli(prog: str, action) -> int:
  """Runs a converter's `action()` (which prints its own summary) and turns a user-facing error into one line on
  stderr, `prog: error: ...`, and exit status 1 (as the trainer and evaluator do)."""
  from sinkjax.checkpoint import CheckpointError  # pylint: disable=import-outside-toplevel
  from sinkjax.config import ConfigError  # pylint: disable=import-outside-toplevel
  try:
    action()
  except (ConvertError, CheckpointError, ConfigError) as e:
    print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 1
  return 0
