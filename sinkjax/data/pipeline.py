"""Grain pipelines: packed, fixed-length training / evaluation batches of token ids.

Training pipeline (per JAX process):

  blocks of documents (sources.py)             grain.MapDataset.source
  -> this process' shard                       ds[process_index::process_count]
  -> shuffle blocks, new order every epoch     .shuffle(seed).repeat()      (epochs forever; one line on stderr
                                                                            when the second epoch starts)
  -> tokenize (+ shuffle docs inside a block)  .map_with_index(...)         (read threads)
  -> pack into rows of seq_len + 1 tokens      PackIterDataset              (data.packing; checkpointable, exact)
  -> shuffle rows in windows of a few batches  WindowShuffleIterDataset     (data.shuffle_batches)
  -> batch                                     .batch(batch_size)
  -> prefetch                                  .mp_prefetch(num_workers) or a prefetch thread

Two packings (`data.packing`); both take the documents in shuffled order, each preceded by BOS, and fill rows of
seq_len + 1 tokens `x`; no token is lost or duplicated. A tokenizer whose `add_bos` is false (a model's tokenizer
that adds none, e.g. Qwen's or SmolLM2's: sinkjax.data.tokenizers) gets no BOS in `document` packing (each piece
starts with its own first token, which is then no target) and its end-of-text token (`eot_id`) as the separator of
the `stream` (the layout such models were pretrained on).

- `document` (greedy concatenate-and-split with segment ids): documents are written one after another into a row.
  When a document does not fit in what is left of the row, the row is filled with its beginning and the rest
  continues at the start of the next row behind a fresh BOS (position 0 again). So a document longer than a row is
  split into pieces of at most seq_len tokens, each starting with BOS. A row ends in padding only when a single slot
  is left (a lone BOS would carry no target) or when a finite (validation) stream runs out.
- `stream` (nanochat's dataloader): the documents form one token stream BOS d1 BOS d2 ..., and each row is the next
  seq_len + 1 tokens of it, so a row may start mid-document and holds every document boundary as a BOS. Rows are
  always full: a finite (validation) stream drops its last, partial row. Unlike nanochat, which takes B*T + 1
  tokens per batch (its rows share their boundary token), every row here is its own seq_len + 1 tokens, so that rows
  can be shuffled and sharded one by one; one token in seq_len + 1 is a target only.

Batch features (all [batch, seq_len]): `inputs = x[:-1]`, `targets = x[1:]`, `segment_ids` and `positions` of the
inputs, `loss_mask` (float32) and `target_bytes` (UTF-8 bytes of each target's text where loss_mask, else 0).
- `document`: segment_ids 1, 2, ... per document piece in the row (0 = padding), positions 0 at each BOS, loss_mask
  1 iff the target belongs to the same piece as its input (0 on padding, at a piece's last token and wherever the
  target is a BOS).
- `stream`: one segment (segment_ids all 1, which the model treats exactly as no segment ids: plain causal
  attention over the row, the vanilla gate's first key is the row's first token), positions 0..seq_len-1 and
  loss_mask 1 on every target, BOS included; a BOS target has 0 bytes.
Over a pass target_bytes sums to the UTF-8 size of the text, so BPB = sum(loss_nats over targets with bytes > 0) /
(ln 2 * sum(target_bytes)), nanochat's evaluate_bpb (`sinkjax.analysis.nll_sums`).

Resuming: the packer's state is (the parent's state before the current block, document index in the block, token
offset in the document, named `offset` or `stream_offset` by packing); restoring re-reads and re-tokenizes that block
and continues from the same token, so a restored iterator yields exactly the batches an uninterrupted one would. With
`data.num_workers > 0` each Grain worker packs its own slice of the block stream; output is deterministic for a fixed
worker count (resume with the same `data.num_workers`).
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import grain
import numpy as np

from sinkjax.data.sources import DataError, build_source
from sinkjax.data.tokenizers import ByteTokenizer

FEATURES = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "target_bytes")
_READ_THREADS = 2
_READ_BUFFER = 16


class _Block(list):
  """A tokenized block: its documents' (ids, nbytes), and `starts_epoch`, the epoch (0 = first pass) it opens when it
  is the first block of a repeat of the source (else 0)."""
  starts_epoch = 0


class _Tokenize:
  """Block of texts -> list of (ids int32, nbytes int32) per non-empty document, docs shuffled by (seed, index).
  `epoch_blocks`: the blocks in one pass over the source (the repeated dataset's index // epoch_blocks is the epoch)."""

  def __init__(self, tokenizer, seed: int | None, epoch_blocks: int | None = None):
    self._tok = tokenizer
    self._seed = seed
    self._epoch_blocks = epoch_blocks

  def __call__(self, index: int, docs: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    if self._seed is not None and len(docs) > 1:
      order = np.random.default_rng([self._seed, int(index)]).permutation(len(docs))
      docs = [docs[i] for i in order]
    out = _Block()
    if self._epoch_blocks and index and index % self._epoch_blocks == 0:
      out.starts_epoch = index // self._epoch_blocks
    for text in docs:
      if not text:
        continue
      ids, nbytes = self._tok.encode_with_bytes(text)
      if len(ids):
        out.append((ids, nbytes))
    return out


def row_features(tokens: np.ndarray, segs: np.ndarray, pos: np.ndarray, nbytes: np.ndarray,
                 loss_on: np.ndarray | None = None) -> dict:
  """Batch features of one packed row x of seq_len + 1 tokens (see module docstring). `loss_on` [seq_len + 1] bool
  restricts the loss to targets where it is set (SFT: the response tokens)."""
  same = (segs[1:] == segs[:-1]) & (segs[:-1] != 0)
  if loss_on is not None:
    same &= loss_on[1:]
  return {
      "inputs": tokens[:-1].copy(),
      "targets": tokens[1:].copy(),
      "segment_ids": segs[:-1].copy(),
      "positions": pos[:-1].copy(),
      "loss_mask": same.astype(np.float32),
      "target_bytes": np.where(same, nbytes[1:], 0).astype(np.int32),
  }


class _BlockPacker(grain.DatasetIterator):
  """What both packers share: reads tokenized blocks from the parent and remembers where it is, as (the parent's
  state before the current block, document index in the block, token offset in the document), so that a restored
  iterator re-reads that block and continues from the same token (exact resume)."""

  OFFSET = "offset"   # the offset's name in the state; each packing has its own, so a checkpoint of one is refused
                      # by the other (sinkjax.checkpoint compares the state's field names)

  def __init__(self, parent: grain.DatasetIterator, seq_len: int, bos_id: int | None, max_empty: int | None,
               repeat_note: str | None = None):
    super().__init__(parent)
    self._row = seq_len + 1
    self._bos = bos_id            # None (document packing): documents start with their own first token
    self._max_empty = max_empty
    self._repeat_note = repeat_note
    self._block_state = self._parent.get_state()
    self._block: list | None = None
    self._doc = 0
    self._off = 0
    self._empty = 0

  def _next_block(self) -> bool:
    self._block_state = self._parent.get_state()
    try:
      self._block = next(self._parent)
    except StopIteration:
      self._block = None
      return False
    self._doc = 0
    self._off = 0
    if self._repeat_note and getattr(self._block, "starts_epoch", 0) == 1:
      # One line, by whichever packer (process, worker) reads the first block of the second pass
      print(self._repeat_note, file=sys.stderr, flush=True)
    if not self._block:
      self._empty += 1
      if self._max_empty is not None and self._empty > self._max_empty:
        raise DataError(f"the data pipeline read {self._empty} blocks in a row without any text (every document "
                        "empty or in the other split); check data.source, data.text_field and data.val_fraction")
    return True

  def _document(self) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids, nbytes) of the document being packed, reading blocks as needed; None where a finite stream ends."""
    while self._block is None or self._doc >= len(self._block):
      if not self._next_block():
        return None
    self._empty = 0
    return self._block[self._doc]

  def _done_with(self, length: int) -> None:
    """Moves to the next document once the offset has passed `length` tokens of this one."""
    if self._off >= length:
      self._doc += 1
      self._off = 0

  def get_state(self) -> dict[str, Any]:
    return {"parent": self._block_state, "loaded": self._block is not None, "doc": self._doc, self.OFFSET: self._off}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._block_state = state["parent"]
    self._block = None
    self._empty = 0
    if state["loaded"]:
      try:
        self._block = next(self._parent)
      except StopIteration:
        self._block = None
    self._doc = int(state["doc"])
    self._off = int(state[self.OFFSET])

  def __str__(self) -> str:
    return f"{type(self).__name__}(row={self._row})"


class _PackIterator(_BlockPacker):
  """data.packing=document: greedy concatenate-and-split of documents (BOS-prefixed unless the packer's BOS is None)
  with segment ids."""

  def __next__(self) -> dict:
    r = self._row
    tokens = np.zeros(r, np.int32)
    segs = np.zeros(r, np.int32)
    pos = np.zeros(r, np.int32)
    nbytes = np.zeros(r, np.int32)
    fill = 0
    seg = 0
    b = 0 if self._bos is None else 1          # the BOS slot before each piece
    while r - fill >= 2:
      doc = self._document()
      if doc is None:
        break
      ids, nb = doc
      take = min(r - fill - b, len(ids) - self._off)
      seg += 1
      if b:
        tokens[fill] = self._bos
      tokens[fill + b:fill + b + take] = ids[self._off:self._off + take]
      nbytes[fill + b:fill + b + take] = nb[self._off:self._off + take]
      segs[fill:fill + b + take] = seg
      pos[fill:fill + b + take] = np.arange(take + b, dtype=np.int32)
      fill += take + b
      self._off += take
      self._done_with(len(ids))
    if fill == 0:
      raise StopIteration
    return row_features(tokens, segs, pos, nbytes)


class _StreamIterator(_BlockPacker):
  """data.packing=stream (nanochat's): consecutive seq_len + 1 tokens of the stream BOS doc BOS doc ...; the offset
  counts the document's BOS, so offset k means k tokens of [BOS, *ids] are already in earlier rows."""

  OFFSET = "stream_offset"

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._one_segment = np.ones(self._row, np.int32)
    self._positions = np.arange(self._row, dtype=np.int32)

  def __next__(self) -> dict:
    r = self._row
    tokens = np.zeros(r, np.int32)
    nbytes = np.zeros(r, np.int32)       # BOS: 0 bytes
    fill = 0
    while fill < r:
      doc = self._document()
      if doc is None:
        raise StopIteration              # a finite stream's last, partial row is dropped: rows are always full
      ids, nb = doc
      if self._off == 0:
        tokens[fill] = self._bos
        fill += 1
        self._off = 1
      take = min(r - fill, len(ids) + 1 - self._off)
      tokens[fill:fill + take] = ids[self._off - 1:self._off - 1 + take]
      nbytes[fill:fill + take] = nb[self._off - 1:self._off - 1 + take]
      fill += take
      self._off += take
      self._done_with(len(ids) + 1)
    return row_features(tokens, self._one_segment, self._positions, nbytes)


_PACKERS = {"document": _PackIterator, "stream": _StreamIterator}


class PackIterDataset(grain.IterDataset):
  """Packs tokenized blocks (lists of (ids, nbytes)) into rows of `seq_len + 1` tokens; yields feature dicts.

  packing: "document" (segment ids per document piece) or "stream" (rows cut from one token stream); see the module
  docstring."""

  def __init__(self, parent: grain.IterDataset, *, seq_len: int, bos_id: int | None, max_empty: int | None = None,
               packing: str = "document", repeat_note: str | None = None):
    super().__init__(parent)
    if packing not in _PACKERS:
      raise DataError(f"data.packing must be one of {'|'.join(_PACKERS)}, got {packing!r}")
    self._seq_len = seq_len
    self._bos = bos_id
    self._max_empty = max_empty
    self._packing = packing
    self._repeat_note = repeat_note    # printed (stderr) when the parent's first block of a second pass arrives

  def __iter__(self) -> _BlockPacker:
    return _PACKERS[self._packing](self._parent.__iter__(), self._seq_len, self._bos, self._max_empty,
                                   self._repeat_note)

  def __str__(self) -> str:
    return f"PackIterDataset(seq_len={self._seq_len}, packing={self._packing})"


def _check(data_cfg, tokenizer, batch_size: int) -> None:
  if data_cfg.seq_len < 1:
    raise DataError(f"data.seq_len must be >= 1, got {data_cfg.seq_len}")
  if batch_size < 1:
    raise DataError(f"batch size must be >= 1, got {batch_size}")
  if getattr(data_cfg, "shuffle_batches", 0) < 0:
    raise DataError(f"data.shuffle_batches must be >= 0 (0 = no row shuffle), got {data_cfg.shuffle_batches}")
  if data_cfg.packing not in _PACKERS:
    raise DataError(f"data.packing must be one of {'|'.join(_PACKERS)}, got {data_cfg.packing!r}")
  if not hasattr(tokenizer, "encode_with_bytes"):
    raise TypeError(f"tokenizer must come from sinkjax.data.build_tokenizer, got {type(tokenizer).__name__}")


def _separator(tokenizer, packing: str) -> int | None:
  """The token before each document: BOS where the tokenizer adds one; else none (document packing) or its
  end-of-text token (stream packing, which needs a boundary between documents)."""
  if getattr(tokenizer, "add_bos", True):
    return tokenizer.bos_id
  return None if packing == "document" else tokenizer.eot_id


def _process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
  if process_index is None or process_count is None:
    import jax  # pylint: disable=import-outside-toplevel
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} must be in [0, process_count={process_count})")
  return int(process_index), int(process_count)


def _ensure_absl_flags() -> None:
  """Grain's worker processes read absl flags; programs not started through absl.app never parse them."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def _read_options() -> grain.ReadOptions:
  return grain.ReadOptions(num_threads=_READ_THREADS, prefetch_buffer_size=_READ_BUFFER)


def make_train_dataset(data_cfg, tokenizer=None, *, batch_size: int, seed: int = 0,
                       process_index: int | None = None, process_count: int | None = None) -> grain.IterDataset:
  """The infinite training `grain.IterDataset` of this process (see the module docstring)."""
  tokenizer = tokenizer or ByteTokenizer()
  _check(data_cfg, tokenizer, batch_size)
  pi, pc = _process(process_index, process_count)
  src = build_source(data_cfg, "train")
  if len(src) < pc:
    raise DataError(f"data.source {data_cfg.source!r} has {len(src)} training block(s), fewer than the "
                    f"{pc} JAX processes that each need a shard; add documents (or, for parquet, row groups)")
  ds = grain.MapDataset.source(src)
  if pc > 1:
    ds = ds[pi::pc]
  n_blocks = len(ds)
  seed32 = int(seed) % 2**32
  ds = ds.shuffle(seed=seed32).repeat(None)
  ds = ds.map_with_index(_Tokenize(tokenizer, seed32, epoch_blocks=n_blocks))
  ds = ds.to_iter_dataset(_read_options())
  # Every block is visited once per epoch; with worker slicing a worker sees them all within ~num_workers epochs.
  max_empty = 4 * n_blocks * max(1, data_cfg.num_workers) + 64
  ds = PackIterDataset(ds, seq_len=data_cfg.seq_len, bos_id=_separator(tokenizer, data_cfg.packing),
                       max_empty=max_empty, packing=data_cfg.packing,
                       repeat_note=f"sinkjax.data: the training data starts its second epoch (every one of the "
                                   f"{n_blocks:,} blocks of {src.description} read once"
                                   + (f" by process {pi}" if pc > 1 else "") + "); from here on the run repeats "
                                   "documents: add data or lower train.steps")
  if data_cfg.shuffle_batches > 0:
    # Packing puts a long document's pieces in consecutive rows; mixing rows over several batches keeps one document
    # from filling a batch. Grain's window shuffle restores exactly (it re-reads the window from its start state).
    ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=data_cfg.shuffle_batches * batch_size,
                                                     seed=seed32 % 2**30)   # grain adds the window index
  ds = ds.batch(batch_size, drop_remainder=True)
  if data_cfg.num_workers > 0:
    _ensure_absl_flags()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=data_cfg.num_workers,
                                                     per_worker_buffer_size=max(1, data_cfg.prefetch)))
  elif data_cfg.prefetch > 0:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=data_cfg.prefetch)
  return ds


def make_train_iterator(data_cfg, tokenizer=None, *, batch_size: int, seed: int = 0,
                        process_index: int | None = None, process_count: int | None = None):
  """Grain iterator of this process' training batches, forever.

  `batch_size` is the per-process (local) batch: the global batch divided by `jax.process_count()`. The process
  reads its own shard of the corpus (`process_index`/`process_count` default to JAX's). The iterator supports
  `get_state()` / `set_state()` (JSON-serializable) and `grain.checkpoint.CheckpointSave/Restore`.
  """
  return iter(make_train_dataset(data_cfg, tokenizer, batch_size=batch_size, seed=seed,
                                 process_index=process_index, process_count=process_count))


def _empty_row(seq_len: int) -> dict:
  z = np.zeros(seq_len + 1, np.int32)
  return row_features(z, z, z, z)


class _FirstDocuments:
  """The first `max_docs` non-empty documents of a block source, one block each, in stored order."""

  def __init__(self, src, max_docs: int):
    self.docs = []
    for i in range(len(src)):
      self.docs += [d for d in src[i] if d][:max_docs - len(self.docs)]
      if len(self.docs) >= max_docs:
        break

  def __len__(self) -> int:
    return len(self.docs)

  def __getitem__(self, index: int) -> list[str]:
    return [self.docs[index]]


def make_eval_batches(data_cfg, tokenizer=None, *, batch_size: int, num_batches: int | None,
                      process_index: int | None = None, process_count: int | None = None, split: str = "val",
                      max_docs: int | None = None, counts: dict | None = None) -> list[dict]:
  """Deterministic evaluation batches (this process' part of each global batch), packed like training (data.packing).

  The `split` ('val': the validation split; 'all': every document of data.source) is read in its stored order (no
  shuffle), at most its first `max_docs` documents, and packed into rows; global batch k consists of rows
  [k * G, (k + 1) * G) with G = batch_size * process_count, of which this process gets its `batch_size` rows.
  Returns `num_batches` batches (None: as many as the documents fill), or fewer if the split is smaller (the last one
  padded with all-padding rows, loss_mask 0). DataError if the split has no text. `counts`, a dict, receives
  "documents": how many documents the batches hold (whole or in part; None where that would need a second pass).
  """
  tokenizer = tokenizer or ByteTokenizer()
  _check(data_cfg, tokenizer, batch_size)
  if num_batches is not None and num_batches < 1:
    raise DataError(f"number of eval batches must be >= 1, got {num_batches}")
  if max_docs is not None and max_docs < 1:
    raise DataError(f"the number of documents must be >= 1, got {max_docs}")
  pi, pc = _process(process_index, process_count)
  src = build_source(data_cfg, split)
  if max_docs is not None:
    src = _FirstDocuments(src, max_docs)
  tokenize = _Tokenize(tokenizer, None)
  ds = grain.MapDataset.source(src).map_with_index(tokenize)
  packer = PackIterDataset(ds.to_iter_dataset(_read_options()), seq_len=data_cfg.seq_len,
                           bos_id=_separator(tokenizer, data_cfg.packing), packing=data_cfg.packing)
  g = batch_size * pc
  need = None if num_batches is None else num_batches * g
  rows = []
  it = iter(packer)
  for row in it:
    rows.append(row)
    if need is not None and len(rows) >= need:
      break
  if counts is not None:
    counts["documents"] = None
    if need is None or len(rows) < need:       # the whole split went in: count its documents
      counts["documents"] = sum(1 for i in range(len(src)) for d in src[i] if d)
  if not rows:
    what = ("has no text" if data_cfg.packing == "document" else
            f"holds fewer than data.seq_len + 1 = {data_cfg.seq_len + 1} tokens (data.packing=stream keeps full rows "
            "only)")
    if split == "val" and (getattr(data_cfg, "val_source", "") or "").strip():
      raise DataError(f"data.val_source {data_cfg.val_source!r} {what}; give validation files with more text")
    which = "the whole" if split == "all" else "the validation split of"
    raise DataError(f"{which} data.source {data_cfg.source!r} {what}; "
                    + ("add documents" if split == "all" else "raise data.val_fraction or add documents"))
  n = -(-len(rows) // g)
  rows += [_empty_row(data_cfg.seq_len)] * (n * g - len(rows))
  batches = []
  for k in range(n):
    mine = rows[k * g + pi * batch_size:k * g + (pi + 1) * batch_size]
    batches.append({f: np.stack([r[f] for r in mine]) for f in FEATURES})
  return batches


def to_global_batch(batch: Mapping[str, np.ndarray], sharding) -> dict:
  """Assembles each process' local batch into global `jax.Array`s (leading axis = global batch).

  `sharding` is a `jax.sharding.Sharding` (e.g. `NamedSharding(mesh, P(('data', 'fsdp')))`) or a mapping from feature
  name to sharding. Every process must call this with its own local batch of the same shape.
  """
  import jax  # pylint: disable=import-outside-toplevel
  out = {}
  for k, v in batch.items():
    s = sharding[k] if isinstance(sharding, Mapping) else sharding
    out[k] = jax.make_array_from_process_local_data(s, np.asarray(v))
  return out

