"""Tests of sinkjax.data on small corpora written into tmp_path (text, JSONL, Parquet, TFDS array_record)."""
from __future__ import annotations

import dataclasses
import json
import re

import grain
import numpy as np
import pytest

from sinkjax.config import DataConfig
from sinkjax.data import (DataError, PackIterDataset, build_source, build_tokenizer, make_eval_batches,
                          make_train_iterator, to_global_batch)
from sinkjax.data.sources import DefaultSource, source_documents

BOS = 256


def _cfg(source, **kw) -> DataConfig:
  kw.setdefault("prefetch", 0)
  return DataConfig(source=str(source), **kw)


def _docs(n: int, seed: int = 0) -> list[str]:
  """Distinct documents with markers (no document is a prefix of another), some longer than a row, non-ASCII."""
  rng = np.random.default_rng(seed)
  words = ["alpha", "béta", "γάμμα", "€uro", "naïve", "🙂", "sink", "token", "x", "\n"]
  docs = []
  for i in range(n):
    length = int(rng.choice([1, 3, 8, 40, 120]))
    body = " ".join(rng.choice(words, size=length))
    docs.append(f"<d{i}>{body}</d{i}>")
  return docs


def _write_txt(tmp_path, docs):
  d = tmp_path / "txt"
  d.mkdir()
  for i, t in enumerate(docs):
    (d / f"{i:03d}.txt").write_text(t, encoding="utf-8")
  return d / "*.txt"


def _write_jsonl(tmp_path, docs, name="c.jsonl", field="text"):
  p = tmp_path / name
  with open(p, "w", encoding="utf-8") as f:
    for i, t in enumerate(docs):
      f.write(json.dumps({field: t, "id": i}) + "\n")
      if i % 5 == 0:
        f.write("\n")   # blank lines are skipped
  return p


def _pieces(batches, bos=BOS):
  """Per row-piece: (token array without BOS) recovered from segment ids, checking per-piece invariants."""
  out = []
  for b in batches:
    for r in range(b["inputs"].shape[0]):
      seg, inp, tgt = b["segment_ids"][r], b["inputs"][r], b["targets"][r]
      lm, pos, tb = b["loss_mask"][r], b["positions"][r], b["target_bytes"][r]
      assert np.all(tb[lm == 0] == 0)
      ids = [s for s in np.unique(seg) if s > 0]
      assert ids == list(range(1, len(ids) + 1))
      for s in ids:
        idx = np.flatnonzero(seg == s)
        assert np.array_equal(idx, np.arange(idx[0], idx[-1] + 1))      # contiguous
        assert inp[idx[0]] == bos and np.array_equal(pos[idx], np.arange(len(idx)))
        assert np.all(lm[idx[:-1]] == 1)                                 # within a piece every target counts
        assert np.all(inp[idx[1:]] != bos)
        out.append(tgt[idx][lm[idx] == 1])
      pad = seg == 0
      assert np.all(inp[pad] == 0) and np.all(pos[pad] == 0) and np.all(lm[pad] == 0)
  return out


def _parse_docs(stream: bytes, docs: list[str], limit: int) -> list[int]:
  """Splits the concatenated token stream into whole documents (by marker); returns their indices in order."""
  enc = [d.encode() for d in docs]
  order, p = [], 0
  while len(order) < limit:
    m = re.match(rb"<d(\d+)>", stream[p:p + 12])
    assert m, stream[p:p + 40]
    i = int(m.group(1))
    assert stream[p:p + len(enc[i])] == enc[i], f"document {i} corrupted"
    order.append(i)
    p += len(enc[i])
  return order


def _stream(it, n_bytes: int) -> bytes:
  """Concatenated real tokens of the pieces of the first batches of `it` until at least n_bytes tokens."""
  out = bytearray()
  while len(out) < n_bytes:
    for piece in _pieces([next(it)]):
      out += bytes(piece.astype(np.uint8).tolist())
  return bytes(out)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same(a, b):
  return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


# ------------------------------------------------------------------------------------------------- packing
def test_hand_built_rows():
  def rows(docs, seq_len):
    blocks = [[(np.array(d, np.int32), np.full(len(d), 2, np.int32)) for d in docs]]
    ds = PackIterDataset(grain.MapDataset.source(blocks).to_iter_dataset(), seq_len=seq_len, bos_id=9)
    return list(ds)

  r = rows([[1, 2], [3, 4, 5]], 8)
  assert len(r) == 1
  r = r[0]
  assert r["inputs"].tolist() == [9, 1, 2, 9, 3, 4, 5, 0]
  assert r["targets"].tolist() == [1, 2, 9, 3, 4, 5, 0, 0]
  assert r["segment_ids"].tolist() == [1, 1, 1, 2, 2, 2, 2, 0]
  assert r["positions"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
  assert r["loss_mask"].tolist() == [1, 1, 0, 1, 1, 1, 0, 0]
  assert r["target_bytes"].tolist() == [2, 2, 0, 2, 2, 2, 0, 0]
  assert r["loss_mask"].dtype == np.float32 and r["inputs"].dtype == np.int32
  # A document longer than the row continues in the next row behind a fresh BOS.
  r1, r2 = rows([[1, 2, 3, 4, 5, 6]], 4)
  assert r1["inputs"].tolist() == [9, 1, 2, 3] and r1["targets"].tolist() == [1, 2, 3, 4]
  assert r1["loss_mask"].tolist() == [1, 1, 1, 1] and r1["positions"].tolist() == [0, 1, 2, 3]
  assert r2["inputs"].tolist() == [9, 5, 6, 0] and r2["loss_mask"].tolist() == [1, 1, 0, 0]
  # One slot left is padded (a lone BOS would predict nothing).
  r1, r2 = rows([[1, 2, 3], [4, 5]], 4)
  assert r1["inputs"].tolist() == [9, 1, 2, 3] and r1["targets"].tolist() == [1, 2, 3, 0]
  assert r1["loss_mask"].tolist() == [1, 1, 1, 0]
  assert r2["inputs"].tolist() == [9, 4, 5, 0] and r2["segment_ids"].tolist() == [1, 1, 1, 0]


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_exact_packing_one_epoch(tmp_path, fmt):
  docs = _docs(30, seed=1)
  if fmt == "txt":
    src = _write_txt(tmp_path, docs)
  elif fmt == "jsonl":
    src = _write_jsonl(tmp_path, docs)
  else:
    import pyarrow as pa
    import pyarrow.parquet as pq
    src = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), src, row_group_size=7)
  cfg = _cfg(src, seq_len=32, val_fraction=0.0, shuffle_batches=0)   # rows in packing order: the stream is whole
  it = make_train_iterator(cfg, build_tokenizer(cfg), batch_size=3, seed=5, process_index=0, process_count=1)
  total = sum(len(d.encode()) for d in docs)
  stream = _stream(it, 2 * total + 1)
  order = _parse_docs(stream, docs, 2 * len(docs))
  assert sorted(order[:len(docs)]) == list(range(len(docs)))     # epoch 1: every document exactly once
  assert sorted(order[len(docs):]) == list(range(len(docs)))     # epoch 2 too ...
  assert order[:len(docs)] != order[len(docs):]                  # ... in a different order


def test_target_bytes_and_bos_with_byte_tokenizer(tmp_path):
  docs = _docs(12, seed=2)
  (tmp_path / "bad.txt").write_bytes(b"ab\xffcd")                # undecodable byte -> U+FFFD (3 bytes)
  src = _write_txt(tmp_path, docs)
  cfg = _cfg(tmp_path / "**" / "*.txt", seq_len=24, val_fraction=1.0)   # everything is validation
  tok = build_tokenizer(cfg)
  assert (tok.vocab_size, tok.bos_id, tok.token_bytes.sum()) == (257, 256, 256)
  batches = make_eval_batches(cfg, tok, batch_size=4, num_batches=1000, process_index=0, process_count=1)
  texts = docs + ["ab\ufffdcd"]
  assert sum(int(b["target_bytes"].sum()) for b in batches) == sum(len(t.encode()) for t in texts)
  assert sum(int(b["loss_mask"].sum()) for b in batches) == sum(len(t.encode()) for t in texts)
  pieces = b"".join(bytes(p.astype(np.uint8).tolist()) for p in _pieces(batches))
  assert pieces.decode() == "ab\ufffdcd" + "".join(docs)       # eval reads in stored (sorted path) order
  assert build_source(_cfg(src, val_fraction=1.0), "val")[0] == [docs[0]]



@pytest.mark.parametrize("add_bos", ["auto", "false"])
def test_a_restored_run_encodes_text_as_training_rows_begin(tmp_path, add_bos):
  """`LoadedRun.tokens(text)` is what a training row holds for that document: the pipeline's own row of a one-document
  source (BOS first with the bytes tokenizer; none when data.add_bos=false), as int32 [1, T]."""
  from sinkjax.config import Config
  from sinkjax.run import LoadedRun
  text = "def main(): é"
  cfg = _cfg(_write_txt(tmp_path, [text]), seq_len=32, val_fraction=1.0, add_bos=add_bos)
  tok = build_tokenizer(cfg)
  row = make_eval_batches(cfg, tok, batch_size=1, num_batches=1, process_index=0, process_count=1)[0]
  trained = row["inputs"][0][row["segment_ids"][0] == 1]
  got = LoadedRun(None, Config(data=cfg), tok, 0).tokens(text)
  assert got.dtype == np.int32 and got.shape == (1, len(trained)) and np.array_equal(got[0], trained)
  assert (int(got[0, 0]) == BOS) == (add_bos == "auto") and tok.encode(text)[0] != BOS

def _train_bpe(tmp_path, texts, lossy=False):
  from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
  if lossy:   # normalizes and drops whitespace: the byte attribution must still be exact
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"])
  else:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  path = tmp_path / ("lossy.json" if lossy else "tokenizer.json")
  tok.save(str(path))
  return path


@pytest.mark.parametrize("lossy", [False, True])
def test_hf_tokenizer_target_bytes(tmp_path, lossy):
  docs = _docs(25, seed=3)
  path = _train_bpe(tmp_path, docs, lossy)
  cfg = _cfg(_write_jsonl(tmp_path, docs), seq_len=16, val_fraction=1.0, tokenizer=str(path))
  tok = build_tokenizer(cfg)
  if lossy:   # no BOS-like special token: a new id is appended
    assert tok.bos_id == tok.vocab_size - 1 and tok.token_bytes[tok.bos_id] == 0
  else:
    from tokenizers import Tokenizer
    assert tok.bos_id == Tokenizer.from_file(str(path)).token_to_id("<|endoftext|>")
    assert tok.token_bytes[tok.bos_id] == 0 and tok.decode(tok.encode(docs[4])) == docs[4]
  batches = make_eval_batches(cfg, tok, batch_size=2, num_batches=10000, process_index=0, process_count=1)
  assert sum(int(b["target_bytes"].sum()) for b in batches) == sum(len(d.encode()) for d in docs)
  ids = np.concatenate(_pieces(batches, tok.bos_id))
  assert np.array_equal(ids, np.concatenate([tok.encode(d) for d in docs]))
  if not lossy:
    assert np.array_equal(tok.token_bytes[ids], np.concatenate([b["target_bytes"][b["loss_mask"] == 1]
                                                                for b in batches]))


def test_row_shuffle_mixes_rows_of_long_documents(tmp_path):
  """With data.shuffle_batches the rows are those of the unshuffled packing, window by window, in another order."""
  docs = ["<d%d>" % i + ("abcdefghij" * 30)[i:] for i in range(4)]       # each document spans ~10 rows of 32
  cfg = _cfg(_write_txt(tmp_path, docs), seq_len=32, val_fraction=0.0, shuffle_batches=0)
  tok = build_tokenizer(cfg)
  mk = lambda c: make_train_iterator(c, tok, batch_size=4, seed=1, process_index=0, process_count=1)
  key = lambda b: [bytes(r.astype(np.uint8).tolist()) for r in b["inputs"]]
  plain = [r for b in _take(mk(cfg), 12) for r in key(b)]
  mixed = [r for b in _take(mk(dataclasses.replace(cfg, shuffle_batches=3)), 12) for r in key(b)]
  for w in range(0, 48, 12):                                              # windows of 3 batches x 4 rows
    assert sorted(mixed[w:w + 12]) == sorted(plain[w:w + 12])
  assert mixed != plain


# ------------------------------------------------------------------------------- determinism, resume, shards
def test_determinism_by_seed(tmp_path):
  cfg = _cfg(_write_jsonl(tmp_path, _docs(40, seed=4)), seq_len=16, val_fraction=0.0, prefetch=2)
  tok = build_tokenizer(cfg)
  mk = lambda seed: make_train_iterator(cfg, tok, batch_size=2, seed=seed, process_index=0, process_count=1)
  a, b, c = _take(mk(7), 6), _take(mk(7), 6), _take(mk(8), 6)
  assert _same(a, b)
  assert not _same(a, c)
  assert all(x["inputs"].shape == (2, 16) for x in a)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_exact_resume_mid_epoch(tmp_path, prefetch):
  docs = _docs(10, seed=5)     # small: the checked span crosses epoch boundaries
  cfg = _cfg(_write_jsonl(tmp_path, docs), seq_len=20, val_fraction=0.0, prefetch=prefetch)
  tok = build_tokenizer(cfg)
  mk = lambda: make_train_iterator(cfg, tok, batch_size=2, seed=3, process_index=0, process_count=1)
  it = mk()
  _take(it, 7)
  state = json.loads(json.dumps(it.get_state()))      # what grain.checkpoint writes
  expected = _take(it, 40)
  it2 = mk()
  _take(it2, 2)
  it2.set_state(state)
  assert _same(_take(it2, 40), expected)
  it3 = mk()
  it3.set_state(state)
  assert _same(_take(it3, 40), expected)


def test_resume_with_grain_checkpoint_handler(tmp_path):
  from etils import epath
  cfg = _cfg(_write_jsonl(tmp_path, _docs(15, seed=6)), seq_len=16, val_fraction=0.0, prefetch=2)
  tok = build_tokenizer(cfg)
  it = make_train_iterator(cfg, tok, batch_size=2, seed=0, process_index=0, process_count=1)
  _take(it, 5)
  handler = grain.checkpoint.CheckpointHandler()
  ckpt = epath.Path(tmp_path / "ckpt")
  ckpt.mkdir()
  handler.save(ckpt, args=grain.checkpoint.CheckpointSave(it))
  expected = _take(it, 10)
  it2 = make_train_iterator(cfg, tok, batch_size=2, seed=0, process_index=0, process_count=1)
  handler.restore(ckpt, args=grain.checkpoint.CheckpointRestore(it2))
  assert _same(_take(it2, 10), expected)


def test_process_shards_disjoint_and_complete(tmp_path):
  docs = _docs(23, seed=7)
  cfg = _cfg(_write_jsonl(tmp_path, docs), seq_len=32, val_fraction=0.0, shuffle_batches=0)
  tok = build_tokenizer(cfg)
  seen = []
  for p in range(2):
    it = make_train_iterator(cfg, tok, batch_size=2, seed=1, process_index=p, process_count=2)
    order = _parse_docs(_stream(it, 2 * sum(len(d.encode()) for d in docs)), docs, len(docs) + 1)
    shard = set()
    for i in order:        # the process' first epoch: everything before the first repeated document
      if i in shard:
        break
      shard.add(i)
    assert len(shard) < len(order)
    seen.append(shard)
  assert not seen[0] & seen[1]
  assert seen[0] | seen[1] == set(range(len(docs)))
  assert abs(len(seen[0]) - len(seen[1])) <= 1


def test_workers_match_in_process(tmp_path):
  cfg = _cfg(_write_jsonl(tmp_path, _docs(20, seed=8)), seq_len=16, val_fraction=0.0)
  tok = build_tokenizer(cfg)
  ref = _take(make_train_iterator(cfg, tok, batch_size=2, seed=2, process_index=0, process_count=1), 8)
  it = make_train_iterator(dataclasses.replace(cfg, num_workers=1), tok, batch_size=2, seed=2,
                           process_index=0, process_count=1)
  try:
    got = _take(it, 4)
    state = it.get_state()
    got += _take(it, 4)
  finally:
    it.close()
  assert _same(got, ref)
  it = make_train_iterator(dataclasses.replace(cfg, num_workers=1), tok, batch_size=2, seed=2,
                           process_index=0, process_count=1)
  try:
    it.set_state(json.loads(json.dumps(state)))
    assert _same(_take(it, 4), ref[4:])
  finally:
    it.close()


# ------------------------------------------------------------------------------------------- sources, misc
def test_default_corpus_train_val_disjoint():
  cfg = DataConfig(seq_len=64, prefetch=0)
  train, val = build_source(cfg, "train"), build_source(cfg, "val")
  assert isinstance(train, DefaultSource) and len(train) > 500 and len(val) > 3
  assert not set(train.keys) & set(val.keys)
  assert set(train.keys) | set(val.keys) == set(DefaultSource("all", 0.0).keys)
  assert train.keys == DefaultSource("train", cfg.val_fraction).keys      # deterministic
  tok = build_tokenizer(cfg)
  b = next(make_train_iterator(cfg, tok, batch_size=4, seed=0, process_index=0, process_count=1))
  assert set(b) == {"inputs", "targets", "segment_ids", "positions", "loss_mask", "target_bytes"}
  assert all(v.shape == (4, 64) for v in b.values())
  ev = make_eval_batches(cfg, tok, batch_size=4, num_batches=2, process_index=0, process_count=1)
  assert len(ev) == 2 and ev[0]["loss_mask"].sum() > 0


def test_tfds_array_record(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  train_docs, val_docs = _docs(12, seed=9), ["<v0>validation one</v0>", "<v1>validation two</v1>"]

  class TinySinkText(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
          {"text": tfds.features.Text(), "idx": tfds.features.Scalar(dtype=np.int32)}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(train_docs), "validation": self._generate_examples(val_docs)}

    def _generate_examples(self, docs):
      for i, t in enumerate(docs):
        yield i, {"text": t, "idx": i}

  TinySinkText(data_dir=str(tmp_path / "tfds"), file_format="array_record").download_and_prepare()
  cfg = _cfg("tfds:tiny_sink_text", tfds_dir=str(tmp_path / "tfds"), seq_len=32, shuffle_batches=0)
  tok = build_tokenizer(cfg)
  it = make_train_iterator(cfg, tok, batch_size=2, seed=0, process_index=0, process_count=1)
  order = _parse_docs(_stream(it, sum(len(d.encode()) for d in train_docs)), train_docs, len(train_docs))
  assert sorted(order) == list(range(len(train_docs)))
  ev = make_eval_batches(cfg, tok, batch_size=2, num_batches=5, process_index=0, process_count=1)
  text = b"".join(bytes(p.astype(np.uint8).tolist()) for p in _pieces(ev)).decode()
  assert sorted(re.findall(r"<v\d>[^<]*</v\d>", text)) == sorted(val_docs)
  with pytest.raises(DataError, match="no feature 'body'"):
    build_source(dataclasses.replace(cfg, text_field="body"), "train")


def test_to_global_batch():
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  cfg = DataConfig(seq_len=32, prefetch=0)
  n = jax.device_count()
  batch = next(make_train_iterator(cfg, build_tokenizer(cfg), batch_size=2 * n, seed=0))
  sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
  g = to_global_batch(batch, sharding)
  for k, v in batch.items():
    assert isinstance(g[k], jax.Array) and g[k].shape == v.shape and g[k].dtype == v.dtype
    assert np.array_equal(np.asarray(g[k]), v) and g[k].sharding == sharding


# ----------------------------------------------------------------------------------------------- bad input
def _err(fn, pattern):
  with pytest.raises(DataError, match=pattern) as e:
    fn()
  assert "\n" not in str(e.value)
  return str(e.value)


def test_bad_inputs(tmp_path):
  tok = build_tokenizer(DataConfig())
  train = lambda cfg: make_train_iterator(cfg, tok, batch_size=2, seed=0, process_index=0, process_count=1)
  msg = _err(lambda: train(_cfg(tmp_path / "x" / "*.txt")), "matched no files")
  assert msg.endswith("give a path or glob of .txt/.jsonl/.parquet files, 'default', or tfds:NAME")
  _err(lambda: train(_cfg(tmp_path / "missing.jsonl")), "matched no files")
  (tmp_path / "t.csv").write_text("a,b\n")
  _err(lambda: train(_cfg(tmp_path / "t.csv")), "not .txt/.jsonl/.parquet")
  (tmp_path / "e").mkdir()
  (tmp_path / "e" / "a.txt").write_text("")
  (tmp_path / "e" / "b.txt").write_text("")
  _err(lambda: train(_cfg(tmp_path / "e")), "contains no documents")
  blank = _write_jsonl(tmp_path, ["", "", ""], name="blank.jsonl")
  _err(lambda: train(_cfg(blank, val_fraction=0.0)), "no non-empty documents in the training split")
  good = _write_jsonl(tmp_path, _docs(5), name="good.jsonl")
  _err(lambda: make_eval_batches(_cfg(good, val_fraction=0.0), tok, batch_size=2, num_batches=1,
                                 process_index=0, process_count=1), "validation split")
  _err(lambda: train(_cfg(good, text_field="content")), "has no field 'content'.*set data.text_field")
  (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
  _err(lambda: build_source(_cfg(tmp_path / "bad.jsonl"), "train")[1], "line 2 is not valid JSON")
  _err(lambda: train(_cfg("tfds:surely_not_a_dataset_xyz", tfds_dir=str(tmp_path))), "does not exist")
  _err(lambda: build_tokenizer(DataConfig(tokenizer=str(tmp_path / "no" / "tokenizer.json"))),
       "data.tokenizer .* does not exist; give 'bytes'")
  (tmp_path / "junk.json").write_text("{not a tokenizer")
  _err(lambda: build_tokenizer(DataConfig(tokenizer=str(tmp_path / "junk.json"))), "not a valid")
  _err(lambda: train(_cfg(good, val_fraction=1.5)), "val_fraction")
  assert issubclass(DataError, ValueError)


def test_two_process_shards_need_enough_blocks(tmp_path):
  one = _write_jsonl(tmp_path, ["only one document"], name="one.jsonl")
  tok = build_tokenizer(DataConfig())
  _err(lambda: make_train_iterator(_cfg(one, val_fraction=0.0), tok, batch_size=1, process_index=0,
                                   process_count=2), "fewer than the 2 JAX processes")


def test_source_documents_txt_one_document_per_file(tmp_path):
  (tmp_path / "a.txt").write_text("para one\n\npara two\n")
  src = build_source(_cfg(tmp_path / "a.txt", val_fraction=0.0), "train")
  assert source_documents(src) == ["para one\n\npara two\n"]


# ------------------------------------------------------------------------------------- data.val_source, epochs
def test_val_source_is_the_validation_split_and_source_trains_whole(tmp_path):
  """data.val_source: validation = every document of those files, training (and 'all') = every document of
  data.source, whatever data.val_fraction says; a validation file inside data.source is refused."""
  train_docs, val_docs = _docs(30, seed=1), [f"<v{i}>held out {i}</v{i}>" for i in range(4)]
  (tmp_path / "train").mkdir()
  _write_jsonl(tmp_path / "train", train_docs, name="shard_00000.jsonl")
  val = _write_jsonl(tmp_path, val_docs, name="shard_00099.jsonl")
  cfg = _cfg(tmp_path / "train" / "*.jsonl", val_source=str(val), val_fraction=0.5)
  assert source_documents(build_source(cfg, "train")) == train_docs
  assert source_documents(build_source(cfg, "all")) == train_docs
  assert source_documents(build_source(cfg, "val")) == val_docs
  tok = build_tokenizer(DataConfig())
  (b,) = make_eval_batches(dataclasses.replace(cfg, seq_len=64), tok, batch_size=8, num_batches=None,
                           process_index=0, process_count=1)
  assert b["target_bytes"].sum() == sum(len(d.encode()) for d in val_docs)     # the val file's text, all of it
  _err(lambda: build_source(_cfg(tmp_path / "**" / "*.jsonl", val_source=str(val)), "train"),
       r"data.val_source file .*shard_00099.jsonl' is also in data.source")
  _err(lambda: build_source(_cfg(tmp_path / "train", val_source=str(tmp_path / "nope.jsonl")), "val"),
       r"data.val_source .*nope.jsonl' matched no files")
  _err(lambda: build_source(_cfg("tfds:x", val_source=str(val)), "val"), "data.val_source is for file sources")


@pytest.mark.parametrize("packing", ["stream", "document"])
def test_second_epoch_prints_one_line_when_it_starts(tmp_path, capfd, packing):
  """The line comes with the first row that needs a token of the second pass (a hand count of the rows one pass
  fills), and only once over three passes."""
  docs = ["a" * 5, "bb" * 7, "c" * 11, "d" * 3]                 # byte tokenizer: a token per byte
  src = _write_jsonl(tmp_path, docs)
  seq_len = 8
  cfg = _cfg(src, val_source=str(_write_jsonl(tmp_path, ["v"], name="v.jsonl")), seq_len=seq_len, packing=packing,
             shuffle_batches=0)
  it = make_train_iterator(cfg, build_tokenizer(cfg), batch_size=1, process_index=0, process_count=1)
  r = seq_len + 1
  if packing == "stream":              # one stream BOS d1 BOS d2 ...: rows of r tokens
    rows_one_pass = sum(len(d) + 1 for d in docs) // r       # rows filled before a token of pass 2 is needed
  else:                                # greedy: a document continues in the next row behind a fresh BOS
    rows_one_pass, fill = 0, 0
    for d in docs:
      left = len(d)
      while left:
        if r - fill < 2:
          rows_one_pass, fill = rows_one_pass + 1, 0
        take = min(r - fill - 1, left)
        fill, left = fill + take + 1, left - take
    rows_one_pass += fill >= r - 1       # a row with < 2 slots left ends before pass 2 is read
  capfd.readouterr()
  for _ in range(rows_one_pass):
    next(it)
  assert "second epoch" not in capfd.readouterr().err
  next(it)
  err = capfd.readouterr().err
  lines = [l for l in err.splitlines() if "second epoch" in l]
  assert len(lines) == 1 and "every one of the 4 blocks of 1 file(s)" in lines[0], err
  _take(it, 3 * rows_one_pass)
  assert "epoch" not in capfd.readouterr().err
