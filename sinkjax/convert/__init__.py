"""Checkpoint conversion to and from other frameworks: `hf` (Hugging Face transformers, safetensors only) and
`nanochat` (its torch state dicts, read with weights_only=True)."""
from __future__ import annotations

from sinkjax.errors import UserError


class ConvertError(UserError):
  """A user-facing conversion problem (bad directory, unsupported architecture or option)."""
