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
from sinkjax.data.pipeline import (FEATURES, PackIterDataset, make_eval_batches, make_train_dataset,
                                   make_train_iterator, to_global_batch)
from sinkjax.data.sources import DataError, build_source
from sinkjax.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = [
    "DataError", "build_tokenizer", "make_train_iterator", "make_eval_batches", "to_global_batch",
    "make_train_dataset", "build_source", "ByteTokenizer", "HFTokenizer", "PackIterDataset", "FEATURES",
]
