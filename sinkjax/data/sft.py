"""Supervised fine-tuning data: JSONL conversations with the loss on the response tokens only.

Each line of a `.jsonl` file is one example, either
  {"prompt": "...", "response": "..."}                       (also "completion" for "response")
  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
A prompt/response pair is the conversation [user: prompt, assistant: response]. Conversations are rendered with the
tokenizer's chat template when it has one (`tokenizer.chat`, sinkjax.data.tokenizers: tokenizer_config.json's
`chat_template` or chat_template.jinja, rendered as transformers does), else with a plain "User: ... / Assistant:
..." layout. The text of each assistant
turn (and the template's end-of-turn after it) carries loss; everything else is context (loss_mask 0).

Batches have the features of `sinkjax.data.pipeline` (inputs, targets, segment_ids, positions, loss_mask,
target_bytes), examples packed greedily into rows of seq_len + 1 tokens with one segment each (an example longer than
a row is truncated to its first seq_len + 1 tokens, and dropped when no response token is left; `counts` says how
many, and the trainer prints it: `truncation_note`), so the trainer, the model and the BPB accounting need nothing new.
The training iterator repeats the examples forever, or stops after `epochs` passes (train.epochs; `epoch_steps` is the
number of steps those passes make):

    it = make_sft_iterator(cfg.data, tokenizer, batch_size=8, seed=0)      # Grain iterator (checkpointable)
    batches = make_sft_eval_batches(cfg.data, tokenizer, batch_size=8, num_batches=4)
"""
from __future__ import annotations

import json

import grain
import numpy as np

from sinkjax import paths
from sinkjax.data.pipeline import FEATURES, _process, row_features
from sinkjax.data.sources import DataError, expand_files

_ROLES = ("system", "user", "assistant")


def read_examples(pattern: str) -> list[list[dict]]:
  """Conversations (lists of {role, content}) of the JSONL files matching `pattern`, in file and line order."""
  files = [f for f in expand_files(pattern) if f.endswith(".jsonl")]
  if not files:
    raise DataError(f"data.source {pattern!r} matches no .jsonl file (SFT data is JSONL: prompt/response or messages)")
  out = []
  for f in files:
    with paths.as_path(f).open("r", encoding="utf-8") as fh:
      for n, line in enumerate(fh, 1):
        if not line.strip():
          continue
        try:
          rec = json.loads(line)
        except json.JSONDecodeError as e:
          raise DataError(f"{f}:{n} is not valid JSON ({e.msg})") from None
        out.append(_conversation(rec, f"{f}:{n}"))
  if not out:
    raise DataError(f"data.source {pattern!r} holds no examples")
  return out


def _conversation(rec, where: str) -> list[dict]:
  if isinstance(rec, dict) and isinstance(rec.get("messages"), list):
    msgs = rec["messages"]
    if not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in _ROLES
               for m in msgs) or not any(m["role"] == "assistant" for m in msgs):
      raise DataError(f"{where}: messages must be {{role: system|user|assistant, content: str}} with at least one "
                      "assistant turn")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]
  if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
    response = rec.get("response", rec.get("completion"))
    if isinstance(response, str):
      return [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": response}]
  raise DataError(f"{where}: an SFT example needs 'prompt' and 'response' strings or a 'messages' list")


def tokenize_example(msgs, tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(ids, is_response, nbytes) of one conversation in the tokenizer's chat layout, BOS first where the tokenizer
  adds one (unless the template already put it there)."""
  ids, resp, nbytes = [], [], []
  for text, is_resp in tokenizer.chat.pieces(msgs):
    t, b = tokenizer.encode_with_bytes(text)
    ids.append(t)
    nbytes.append(b)
    resp.append(np.full(len(t), is_resp))
  ids, resp, nbytes = (np.concatenate(x) if x else np.zeros(0) for x in (ids, resp, nbytes))
  if tokenizer.add_bos and (not len(ids) or ids[0] != tokenizer.bos_id):
    ids, resp, nbytes = np.r_[tokenizer.bos_id, ids], np.r_[False, resp], np.r_[0, nbytes]
  return ids.astype(np.int32), resp.astype(bool), nbytes.astype(np.int32)


def pack_rows(examples, seq_len: int, counts: dict | None = None) -> list[dict]:
  """Greedy packing of (ids, is_response, nbytes) examples into rows of seq_len + 1 tokens (one segment each).
  `counts` receives "truncated" (examples longer than seq_len + 1 tokens, cut to that and kept) and "dropped"
  (examples with no response token within the row)."""
  rows, cur = [], []
  truncated = dropped = 0

  def flush():
    if not cur:
      return
    x = np.zeros(seq_len + 1, np.int32)
    seg, pos, resp, nb = (np.zeros(seq_len + 1, np.int32) for _ in range(4))
    at = 0
    for s, (ids, r, b) in enumerate(cur, 1):
      n = len(ids)
      x[at:at + n], seg[at:at + n], pos[at:at + n] = ids, s, np.arange(n)
      resp[at:at + n], nb[at:at + n] = r, b
      at += n
    rows.append(row_features(x, seg, pos, nb, loss_on=resp > 0))     # the text rows' features, loss on responses
    cur.clear()

  used = 0
  for ids, r, b in examples:
    cut = len(ids) > seq_len + 1
    ids, r, b = ids[:seq_len + 1], r[:seq_len + 1], b[:seq_len + 1]
    if len(ids) < 2 or not r[1:].any():
      dropped += 1
      continue                                    # nothing to learn from (no response token left after truncation)
    truncated += cut
    if used + len(ids) > seq_len + 1:
      flush()
      used = 0
    cur.append((ids, r, b))
    used += len(ids)
  flush()
  if counts is not None:
    counts.update(truncated=truncated, dropped=dropped)
  return rows


def _split(convs: list, data_cfg, split: str) -> list:
  """Deterministic train/val split by example index (every k-th example is validation); 'all' keeps every one."""
  if split == "all":
    return convs
  k = max(2, round(1 / max(data_cfg.val_fraction, 1e-9)))
  keep = [c for i, c in enumerate(convs) if (i % k == k - 1) == (split == "val")]
  if not keep:
    raise DataError(f"the {split} split of data.source {data_cfg.source!r} is empty ({len(convs)} examples, "
                    f"data.val_fraction {data_cfg.val_fraction}); add examples or change data.val_fraction")
  return keep


def sft_rows(data_cfg, tokenizer, split: str = "train", max_docs: int | None = None, counts: dict | None = None
             ) -> list[dict]:
  convs = _split(read_examples(data_cfg.source), data_cfg, split)[:max_docs]
  if counts is not None:
    counts["documents"] = len(convs)
  rows = pack_rows((tokenize_example(c, tokenizer) for c in convs), data_cfg.seq_len, counts)
  if not rows:
    raise DataError(f"data.source {data_cfg.source!r}: no {split} example keeps a response token within "
                    f"data.seq_len={data_cfg.seq_len}")
  return rows


def _stack(rows):
  return {f: np.stack([r[f] for r in rows]) for f in FEATURES}


def make_sft_iterator(data_cfg, tokenizer, *, batch_size: int, seed: int = 0, epochs: int = 0,
                      process_index: int | None = None, process_count: int | None = None,
                      counts: dict | None = None):
  """Grain iterator of shuffled (new order each epoch) training batches of packed SFT rows: forever (epochs 0), or
  `epochs` passes over the rows, as whole global batches (the rows of a last, partial one are left out), then
  StopIteration.

  `batch_size` is the per-process batch. Every process shuffles all rows alike and takes its own slice of each global
  batch of batch_size x process_count rows (`process_index`/`process_count` default to JAX's), so the processes read
  disjoint rows and together the rows one process would read with the global batch. `counts` receives the training
  split's "documents", "truncated" and "dropped" (`pack_rows`) and "rows".
  """
  pi, pc = _process(process_index, process_count)
  counts = {} if counts is None else counts
  rows = sft_rows(data_cfg, tokenizer, "train", counts=counts)
  counts["rows"] = len(rows)
  ds = grain.MapDataset.source(rows).shuffle(seed=seed)
  if epochs:
    ds = ds.repeat(epochs).batch(batch_size, batch_fn=_stack, drop_remainder=True)
    ds = ds[:len(ds) // pc * pc]            # every process gets the same number of batches
  else:
    ds = ds.repeat().batch(batch_size, batch_fn=_stack)
  if pc > 1:
    ds = ds[pi::pc]             # local batch j of global batch k is batch k * pc + j of the shuffled rows
  return iter(ds.to_iter_dataset())


def epoch_steps(data_cfg, tokenizer, *, batch_size: int, epochs: int) -> int:
  """The optimizer steps (global batches of `batch_size` rows) that `epochs` passes over the training rows make: what
  `make_sft_iterator(..., epochs=epochs)` yields. Tokenizes the training examples (once more) to count the rows."""
  n = len(sft_rows(data_cfg, tokenizer, "train"))
  if epochs * n < batch_size:
    raise DataError(f"train.epochs={epochs} pass(es) over data.source {data_cfg.source!r} make {epochs * n} packed "
                    f"rows, fewer than one batch of train.batch_size={batch_size}; add examples or raise train.epochs")
  return epochs * n // batch_size


def truncation_note(counts: dict, seq_len: int) -> str:
  """One line: how many training examples were truncated to data.seq_len + 1 tokens, and dropped."""
  n, t, d = counts.get("documents", 0), counts.get("truncated", 0), counts.get("dropped", 0)
  return (f"sinkjax.data.sft: {t:,} of {n:,} training examples longer than data.seq_len + 1 = {seq_len + 1:,} tokens, "
          f"truncated; {d:,} dropped (no response token within the row)" + ("; raise data.seq_len to keep them whole"
                                                                            if t or d else ""))


def make_sft_eval_batches(data_cfg, tokenizer, *, batch_size: int, num_batches: int | None,
                          process_index: int | None = None, process_count: int | None = None, split: str = "val",
                          max_docs: int | None = None, counts: dict | None = None) -> list[dict]:
  """The first rows of the `split` ('val', or 'all' the examples; at most the first `max_docs`) as `num_batches`
  global batches (None: all of them) of batch_size x process_count rows (the last one padded with rows of loss_mask
  0); this process gets its `batch_size` rows of each. `counts` receives "documents", the examples read."""
  pi, pc = _process(process_index, process_count)
  g = batch_size * pc
  rows = sft_rows(data_cfg, tokenizer, split, max_docs, counts)
  if num_batches is not None:
    if counts is not None and len(rows) > g * num_batches:
      counts["documents"] = None                      # the batches stop before the split's end
    rows = rows[:g * num_batches]
  pad = {f: np.zeros_like(v) for f, v in rows[0].items()}
  rows += [pad] * (-len(rows) % g)
  return [_stack(rows[k + pi * batch_size:k + (pi + 1) * batch_size]) for k in range(0, len(rows), g)]
