"""Multiple-choice scoring by log-likelihood (the ARC / HellaSwag / PIQA protocol of lm-evaluation-harness).

Input: a local JSONL file, one item per line (blank lines are skipped):

    {"context": "The capital of France is", "choices": [" Paris", " Rome", " Berlin"], "label": 0}

`context` is a string, `choices` a non-empty list of strings, `label` the 0-based index of the correct choice.
Each choice is scored as the sum of the log-probabilities of its tokens given BOS + context
(`log p(choice | context)`, context and choice tokenized separately and concatenated, as lm-evaluation-harness
does). The prediction is the arg-max choice; `accuracy` uses the raw sum, `accuracy_norm` the sum divided by the
choice's UTF-8 byte length (length-normalized, harness "acc_norm"-style). Contexts too long for the model are
truncated from the left (BOS is kept).
"""
from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax.model import forward_with_importance
from sinkjax.cli import UserError


class MCError(UserError):
  """A malformed multiple-choice file (the message names the file and line)."""


def load_items(path) -> list[dict]:
  """Reads and validates a multiple-choice JSONL file."""
  from sinkjax import paths  # pylint: disable=import-outside-toplevel
  path = paths.as_path(path, "--mc")
  if not path.is_file():
    raise MCError(f"multiple-choice file {path} does not exist")
  items = []
  for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    where = f"{path}:{n}"
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise MCError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
      raise MCError(f"{where}: expected an object {{\"context\": str, \"choices\": [str, ...], \"label\": int}}")
    ctx, choices, label = obj.get("context"), obj.get("choices"), obj.get("label")
    if not isinstance(ctx, str):
      raise MCError(f"{where}: 'context' must be a string")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
      raise MCError(f"{where}: 'choices' must be a non-empty list of non-empty strings")
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
      raise MCError(f"{where}: 'label' must be an integer index into 'choices' (0..{len(choices) - 1})")
    items.append({"context": ctx, "choices": choices, "label": label})
  if not items:
    raise MCError(f"multiple-choice file {path} holds no items")
  return items


def encode_pair(tokenizer, context: str, choice: str, max_len: int) -> tuple[list[int], int]:
  """(token ids BOS + context + choice, index of the first choice token), left-truncated to max_len tokens."""
  ctx = tokenizer.encode(context)
  cont = tokenizer.encode(choice)
  if len(cont) + 1 > max_len:
    raise MCError(f"a choice of {len(cont)} tokens does not fit the model's context of {max_len} tokens")
  keep = max_len - 1 - len(cont)
  ctx = ctx[max(len(ctx) - keep, 0):]
  ids = [tokenizer.bos_id] + ctx + cont
  return ids, 1 + len(ctx)


def _sequence_logprobs(model, tokens, segment_ids):
  """log p(tokens[:, t+1] | tokens[:, :t+1]) for every t, [B, T-1]."""
  # forward_with_importance pops the importances the layers sow, so the model's graph (and the jit cache key)
  # stays the same from call to call
  logits, _ = forward_with_importance(model, tokens[:, :-1], segment_ids=segment_ids[:, :-1])
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


_sequence_logprobs_jit = nnx.jit(_sequence_logprobs)


def choice_logprobs(model, tokenizer, items, *, max_len: int, batch_size: int = 16) -> list[list[float]]:
  """Sum of log-probabilities (nats) of each choice's tokens given its context: [item][choice]."""
  seqs = []                                    # (item, choice, ids, start)
  for i, it in enumerate(items):
    for c, choice in enumerate(it["choices"]):
      ids, start = encode_pair(tokenizer, it["context"], choice, max_len)
      seqs.append((i, c, ids, start))
  out = [[0.0] * len(it["choices"]) for it in items]
  order = sorted(range(len(seqs)), key=lambda j: len(seqs[j][2]))
  for b in range(0, len(order), batch_size):
    chunk = [seqs[j] for j in order[b:b + batch_size]]
    longest = max(len(s[2]) for s in chunk)
    T = min(max_len, 1 << (longest - 1).bit_length())      # power-of-two buckets: few recompilations
    T = max(T, longest)
    tokens = np.zeros((batch_size, T), np.int32)
    seg = np.zeros((batch_size, T), np.int32)              # 0 = padding (also for the rows that fill the batch)
    for r, (_, _, ids, _) in enumerate(chunk):
      tokens[r, :len(ids)] = ids
      seg[r, :len(ids)] = 1
    lp = np.asarray(_sequence_logprobs_jit(model, jnp.asarray(tokens), jnp.asarray(seg)))
    for r, (i, c, ids, start) in enumerate(chunk):
      out[i][c] = float(lp[r, start - 1:len(ids) - 1].sum())   # position t predicts token t+1
  return out


def score(model, tokenizer, items, *, max_len: int, batch_size: int = 16) -> dict:
  """Accuracy (raw and byte-length-normalized log-likelihood) and per-item detail."""
  lps = choice_logprobs(model, tokenizer, items, max_len=max_len, batch_size=batch_size)
  correct = correct_norm = 0
  detail = []
  for it, lp in zip(items, lps):
    norm = [v / max(len(ch.encode("utf-8")), 1) for v, ch in zip(lp, it["choices"])]
    pred, pred_norm = int(np.argmax(lp)), int(np.argmax(norm))
    correct += pred == it["label"]
    correct_norm += pred_norm == it["label"]
    detail.append({"label": it["label"], "pred": pred, "pred_norm": pred_norm, "logprobs": lp})
  n = len(items)
  return {"num_items": n, "accuracy": correct / n, "accuracy_norm": correct_norm / n, "items": detail}
