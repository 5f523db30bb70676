"""Data pipeline: sources, tokenizers and Grain iterators of packed token batches.

```python
from sinkjax.data import DataError, build_tokenizer, make_train_iterator, make_eval_batches, to_global_batch
tok = build_tokenizer(cfg.data)
it = make_train_iterator(cfg.data, tok, batch_size=local_batch, seed=seed)
batches = make_eval_batches(cfg.data, tok, batch_size=b, num_batches=n)
g = to_global_batch(batch, sharding)
```
See `sources.py` (data.source forms, text decoding, train/val split), `tokenizers.py` (byte and Hugging Face
tokenizers, BOS, byte accounting) and `pipeline.py` (packing, batch features, resuming, sharding).
"""
from sinkjax.data import pipeline, sft
from sinkjax.data.pipeline import FEATURES, PackIterDataset, make_train_dataset, to_global_batch
from sinkjax.data.sources import DataError, build_source
from sinkjax.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer


def make_train_iterator(data_cfg, tokenizer=None, **kw):
  """This process' training batches, forever, for data.format: packed text (`pipeline.make_train_iterator`) or
  SFT examples (`sft.make_sft_iterator`). Same features either way (FEATURES), so training is format-blind."""
  if data_cfg.format == "sft":
    return sft.make_sft_iterator(data_cfg, tokenizer, **kw)
  return pipeline.make_train_iterator(data_cfg, tokenizer, **kw)


def make_eval_batches(data_cfg, tokenizer=None, **kw) -> list[dict]:
  """Deterministic validation batches for data.format (text: `pipeline.make_eval_batches`, sft:
  `sft.make_sft_eval_batches`), so evaluation reads an SFT run's held-out examples like a text run's split."""
  if data_cfg.format == "sft":
    return sft.make_sft_eval_batches(data_cfg, tokenizer, **kw)
  return pipeline.make_eval_batches(data_cfg, tokenizer, **kw)


__all__ = [
    "DataError", "build_tokenizer", "make_train_iterator", "make_eval_batches", "to_global_batch",
    "make_train_dataset", "build_source", "ByteTokenizer", "HFTokenizer", "PackIterDataset", "FEATURES",
]
