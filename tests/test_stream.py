"""data.packing=stream (nanochat's token stream) against independent references: rows cut by hand from the
BOS-separated stream, materialized softmax attention over the whole row, nanochat's BPB rule by hand, exact resume,
process shards, and a CLI run that trains, resumes and evaluates."""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sinkjax import analysis
from sinkjax import eval as ev
from sinkjax.attention import vanilla_attention
from sinkjax.config import ConfigError, DataConfig, ModelConfig, load_config
from sinkjax.data import DataError, build_tokenizer, make_eval_batches, make_train_iterator
from sinkjax.model import Transformer, forward_with_importance
from tests.helpers import finish, losses, start_command

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOS = 256                                   # byte tokenizer
FEATURES = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "target_bytes")


def _docs(n: int, seed: int = 0) -> list[str]:
  """Distinct marked documents of very different lengths (shorter and longer than a row), non-ASCII included."""
  rng = np.random.default_rng(seed)
  words = ["sink", "béta", "γάμμα", "🙂", "token", "x", "\n"]
  return [f"<d{i}>" + " ".join(rng.choice(words, size=int(rng.choice([1, 4, 30, 90])))) + f"</d{i}>"
          for i in range(n)]


def _jsonl(tmp_path, docs, name="c.jsonl"):
  path = tmp_path / name
  path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
  return path


def _cfg(source, **kw) -> DataConfig:
  kw.setdefault("prefetch", 0)
  return DataConfig(source=str(source), packing="stream", **kw)


def reference_rows(token_lists, bos: int, seq_len: int, token_bytes) -> list[dict]:
  """nanochat's stream by hand: BOS + tokens of every document, concatenated, cut into seq_len + 1 token rows (a
  partial last row dropped); one segment, positions 0..T-1, loss on every target, bytes per target (BOS: 0)."""
  stream = np.concatenate([np.r_[bos, t] for t in token_lists]).astype(np.int32)
  n = len(stream) // (seq_len + 1)
  rows = []
  for x in stream[:n * (seq_len + 1)].reshape(n, seq_len + 1):
    rows.append({"inputs": x[:-1], "targets": x[1:], "segment_ids": np.ones(seq_len, np.int32),
                 "positions": np.arange(seq_len), "loss_mask": np.ones(seq_len, np.float32),
                 "target_bytes": np.asarray([token_bytes(int(t)) for t in x[1:]])})
  return rows


def _rows(batches):
  return [{k: b[k][r] for k in FEATURES} for b in batches for r in range(b["inputs"].shape[0])]


def _assert_rows_equal(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    for k in FEATURES:
      np.testing.assert_array_equal(g[k], w[k], err_msg=k)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same(a, b):
  return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


# ---------------------------------------------------------------------------------------------------------- rows
def test_stream_rows_equal_hand_cut_stream_bytes(tmp_path):
  """Validation (stored order): rows are the byte stream BOS d0 BOS d1 ... cut into seq_len + 1 chunks."""
  docs = _docs(20, seed=1)
  cfg = _cfg(_jsonl(tmp_path, docs), seq_len=24, val_fraction=1.0)
  got = _rows(make_eval_batches(cfg, build_tokenizer(cfg), batch_size=3, num_batches=1000, process_index=0,
                                process_count=1))
  want = reference_rows([list(d.encode()) for d in docs], BOS, 24, lambda t: 0 if t == BOS else 1)
  _assert_rows_equal(got[:len(want)], want)
  assert len(got) - len(want) < 3                     # the last batch is filled up with all-padding rows (no loss)
  assert all(r["loss_mask"].sum() == 0 and (r["segment_ids"] == 0).all() for r in got[len(want):])
  assert any(BOS in r["inputs"][1:] for r in want) and any(r["inputs"][0] != BOS for r in want)   # mid-row docs


def test_stream_rows_with_a_hugging_face_tokenizer(tmp_path):
  """Token ids from the `tokenizers` library itself; a target's bytes are its byte-level token's length."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  docs = _docs(15, seed=2)
  hf = Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  hf.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|bos|>"],
                                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  hf.save(str(tmp_path / "tokenizer.json"))
  cfg = _cfg(_jsonl(tmp_path, docs), seq_len=16, val_fraction=1.0, tokenizer=str(tmp_path / "tokenizer.json"))
  tok = build_tokenizer(cfg)
  bos = hf.token_to_id("<|bos|>")
  assert tok.bos_id == bos
  got = _rows(make_eval_batches(cfg, tok, batch_size=1, num_batches=10000, process_index=0, process_count=1))
  want = reference_rows([hf.encode(d, add_special_tokens=False).ids for d in docs], bos, 16,
                        lambda t: 0 if t == bos else len(hf.id_to_token(t)))   # byte-level: one char per byte
  _assert_rows_equal(got, want)


def test_training_rows_are_one_stream_of_whole_documents(tmp_path):
  """Unshuffled training rows, glued back together, are BOS-prefixed documents, every one once per epoch."""
  docs = _docs(12, seed=3)
  cfg = _cfg(_jsonl(tmp_path, docs), seq_len=20, val_fraction=0.0, shuffle_batches=0)
  it = make_train_iterator(cfg, build_tokenizer(cfg), batch_size=2, seed=4, process_index=0, process_count=1)
  total = sum(len(d.encode()) + 1 for d in docs)
  rows = _rows(_take(it, 2 * total // 40 + 2))
  for r in rows:
    assert r["loss_mask"].all() and (r["segment_ids"] == 1).all() and (r["positions"] == np.arange(20)).all()
  stream = np.concatenate([np.r_[r["inputs"], r["targets"][-1]] for r in rows])
  assert stream[0] == BOS
  pieces = bytes(np.where(stream == BOS, ord("|"), stream).astype(np.uint8).tolist()).split(b"|")[1:-1]
  order = [docs.index(p.decode()) for p in pieces]      # ValueError if a document were cut or corrupted
  assert sorted(order[:len(docs)]) == list(range(len(docs)))
  assert order[:len(docs)] != list(range(len(docs)))    # shuffled document order


# -------------------------------------------------------------------------------------- resume, shuffle, shards
@pytest.mark.parametrize("shuffle_batches", [0, 3])
def test_stream_exact_resume(tmp_path, shuffle_batches):
  cfg = _cfg(_jsonl(tmp_path, _docs(10, seed=5)), seq_len=20, val_fraction=0.0, shuffle_batches=shuffle_batches)
  tok = build_tokenizer(cfg)
  mk = lambda: make_train_iterator(cfg, tok, batch_size=2, seed=3, process_index=0, process_count=1)
  it = mk()
  _take(it, 7)
  state = json.loads(json.dumps(it.get_state()))       # what grain.checkpoint writes
  expected = _take(it, 40)                             # crosses epoch boundaries
  again = mk()
  _take(again, 3)
  again.set_state(state)
  assert _same(_take(again, 40), expected)
  fresh = mk()
  fresh.set_state(state)
  assert _same(_take(fresh, 40), expected)


def test_stream_row_shuffle_permutes_windows(tmp_path):
  cfg = _cfg(_jsonl(tmp_path, _docs(10, seed=6)), seq_len=16, val_fraction=0.0, shuffle_batches=0)
  tok = build_tokenizer(cfg)
  mk = lambda c: make_train_iterator(c, tok, batch_size=4, seed=1, process_index=0, process_count=1)
  key = lambda b: [r.tobytes() for r in b["inputs"]]
  plain = [r for b in _take(mk(cfg), 12) for r in key(b)]
  mixed = [r for b in _take(mk(dataclasses.replace(cfg, shuffle_batches=3)), 12) for r in key(b)]
  for w in range(0, 48, 12):
    assert sorted(mixed[w:w + 12]) == sorted(plain[w:w + 12])
  assert mixed != plain


def _doc_ids(rows) -> set[int]:
  """The documents whose start marker appears in the stream of consecutive rows."""
  stream = np.concatenate([np.r_[r["inputs"], r["targets"][-1]] for r in rows])
  return {int(m) for m in re.findall(rb"<d(\d+)>", np.where(stream == BOS, 0, stream).astype(np.uint8).tobytes())}


def test_stream_process_shards_are_disjoint(tmp_path):
  docs = _docs(16, seed=7)
  cfg = _cfg(_jsonl(tmp_path, docs), seq_len=16, val_fraction=0.0, shuffle_batches=0)
  tok = build_tokenizer(cfg)
  seen = []
  for p in range(2):
    it = make_train_iterator(cfg, tok, batch_size=2, seed=1, process_index=p, process_count=2)
    n = sum(len(d.encode()) + 1 for d in docs) // (2 * 17) + 2        # more than one epoch of the process' shard
    seen.append(_doc_ids(_rows(_take(it, n))))
  assert seen[0] and seen[1] and not seen[0] & seen[1]
  assert seen[0] | seen[1] == set(range(len(docs)))
  # Validation: the processes' parts of each global batch are consecutive rows of the one stream.
  val = _cfg(_jsonl(tmp_path, docs, "v.jsonl"), seq_len=16, val_fraction=1.0)
  parts = [make_eval_batches(val, tok, batch_size=2, num_batches=3, process_index=p, process_count=2)
           for p in range(2)]
  both = make_eval_batches(val, tok, batch_size=4, num_batches=3, process_index=0, process_count=1)
  for a, b, whole in zip(*parts, both):
    assert _same([{k: np.concatenate([a[k], b[k]]) for k in FEATURES}], [whole])


def test_checkpoint_of_the_other_packing_is_refused(tmp_path):
  from sinkjax.checkpoint import Checkpointer, DataStateMismatch
  from sinkjax.config import CheckpointConfig
  cfg = _cfg(_jsonl(tmp_path, _docs(6)), seq_len=16, val_fraction=0.0)
  tok = build_tokenizer(cfg)
  mk = lambda packing: make_train_iterator(dataclasses.replace(cfg, packing=packing), tok, batch_size=2,
                                           process_index=0, process_count=1)
  ck = Checkpointer(tmp_path / "run", CheckpointConfig(async_save=False))
  it = mk("document")
  next(it)
  params, train_state = {"w": jnp.ones((2,))}, {"step": jnp.zeros((), jnp.int32)}
  ck.save(1, params, train_state, it, force=True)
  ck.wait()
  abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  with pytest.raises(DataStateMismatch, match="data.packing"):
    ck.restore_latest(abstract(params), abstract(train_state), mk("stream"))
  assert ck.restore_latest(abstract(params), abstract(train_state), mk("document"))[0] == 1
  ck.close()


# ------------------------------------------------------------------------------------- the model on stream rows
def _stream_batch(tmp_path, seq_len=24, rows=3):
  docs = [f"doc {i}: " + "sink γ " * (i % 4 + 1) for i in range(16)]       # short: several per row
  cfg = _cfg(_jsonl(tmp_path, docs), seq_len=seq_len, val_fraction=1.0)
  b = make_eval_batches(cfg, build_tokenizer(cfg), batch_size=rows, num_batches=1, process_index=0,
                        process_count=1)[0]
  assert b["loss_mask"].all() and (b["inputs"][:, 1:] == BOS).any()       # full rows with documents inside
  return b


def _perturbed_model(attention="vanilla", seed=0) -> Transformer:
  """A small model with every parameter randomized (zero-initialized heads would hide the attention)."""
  cfg = ModelConfig(attention=attention, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                    vocab_size=257, dtype="float32", max_seq_len=64)
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  state = nnx.state(model, nnx.Param)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  nnx.update(model, jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
                                              for x, k in zip(leaves, keys)]))
  return model


def _np_causal_softmax(q, k):
  """softmax(q k^T / sqrt(D) + causal mask) over the whole row, float64, K/V heads repeated: [B,H,T,T]."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  z = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
  T = q.shape[1]
  z = np.where(np.tril(np.ones((T, T), bool)), z, -np.inf)
  p = np.exp(z - z.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_vanilla_gate_on_stream_rows_is_one_minus_attention_on_the_rows_first_token(tmp_path, impl):
  seg = jnp.asarray(_stream_batch(tmp_path)["segment_ids"])
  B, T = seg.shape
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (B, T, h, 8)) for i, h in enumerate((4, 2, 2)))
  out, gate = vanilla_attention(q, k, v, segment_ids=seg, impl=impl)
  p = _np_causal_softmax(q, k)
  want = 1.0 - np.swapaxes(p[..., 0], 1, 2)                 # [B,T,H]: A[t, 0], key 0 = the row's first token
  np.testing.assert_allclose(np.asarray(gate), want, atol=2e-5)
  assert np.all(np.asarray(gate)[:, 0] == 0)
  vv = np.repeat(np.asarray(v, np.float64), 2, axis=2)
  np.testing.assert_allclose(np.asarray(out), np.einsum("bhts,bshd->bthd", p, vv), atol=2e-5)


def test_model_on_stream_rows_is_plain_causal_and_gates_on_the_rows_first_token(tmp_path):
  """The model's logits on a stream batch equal its logits without segment ids; in every layer its vanilla gate is
  1 - A[t, 0] of the materialized row softmax, and head importance averages it over every query but t = 0."""
  b = {k: jnp.asarray(v) for k, v in _stream_batch(tmp_path).items()}
  model = _perturbed_model()
  fwd = nnx.jit(lambda m, x, s, p: forward_with_importance(m, x, segment_ids=s, positions=p))
  logits, imp = fwd(model, b["inputs"], b["segment_ids"], b["positions"])
  plain, imp_plain = fwd(model, b["inputs"], None, None)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(plain), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(imp), np.asarray(imp_plain), rtol=1e-5, atol=1e-6)
  _, traces = analysis.recorded_forward(model, b["inputs"], segment_ids=b["segment_ids"],
                                            positions=b["positions"])
  for l, trace in enumerate(traces):
    want = 1.0 - np.swapaxes(_np_causal_softmax(trace.q, trace.k)[..., 0], 1, 2)       # [B,T,H]
    np.testing.assert_allclose(np.asarray(trace.gate), want, atol=2e-5)
    np.testing.assert_allclose(np.asarray(imp[l]), want[:, 1:].mean((0, 1)), rtol=1e-4)


def test_stream_bpb_is_nanochats_rule_by_hand(tmp_path):
  """BPB: NLL of the targets with bytes (BOS targets left out) / ln 2 / their bytes; val_loss: every target."""
  from sinkjax.step import make_eval_step
  b = _stream_batch(tmp_path)
  model = _perturbed_model()
  logits = np.asarray(forward_with_importance(model, jnp.asarray(b["inputs"]))[0], np.float64)   # plain causal
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, b["targets"][..., None], -1)[..., 0]
  is_bos = b["targets"] == BOS
  assert is_bos.any() and (b["target_bytes"][is_bos] == 0).all()
  want_bpb = nll[~is_bos].sum() / math.log(2) / (~is_bos).sum()             # byte tokenizer: 1 byte per token
  got = ev.language_model_metrics(model, [b])
  np.testing.assert_allclose(got["val_bpb"], want_bpb, rtol=1e-5)
  np.testing.assert_allclose(got["val_loss"], nll.mean(), rtol=1e-5)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  nats, nbytes = make_eval_step(graphdef, rest)(params, {k: jnp.asarray(v) for k, v in b.items()})
  np.testing.assert_allclose(float(nats) / math.log(2) / float(nbytes), want_bpb, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ user errors
def test_stream_config_errors(tmp_path):
  with pytest.raises(ConfigError, match=r"data.packing must be one of stream\|document"):
    load_config(str(ROOT / "configs" / "tiny.yaml"), ["data.packing=rows"])
  with pytest.raises(ConfigError, match="set data.packing=document") as e:
    load_config(str(ROOT / "configs" / "tiny.yaml"), ["data.format=sft", "data.packing=stream"])
  assert "\n" not in str(e.value)
  assert load_config(str(ROOT / "configs" / "tiny.yaml")).data.packing == "document"
  assert load_config(str(ROOT / "configs" / "paper" / "d20_vanilla_aux.yaml")).data.packing == "stream"
  short = _cfg(_jsonl(tmp_path, ["tiny"]), seq_len=64, val_fraction=1.0)
  with pytest.raises(DataError, match="fewer than data.seq_len \\+ 1 = 65 tokens"):
    make_eval_batches(short, build_tokenizer(short), batch_size=1, num_batches=1, process_index=0, process_count=1)


def test_runs_predating_packing_resume_with_document_packing(tmp_path):
  from sinkjax.run import legacy_data_settings as _legacy_data_settings
  cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), [f"run.dir={tmp_path}", "data.packing=stream"])
  (tmp_path / "config.yaml").write_text("data:\n  source: default\n  shuffle_batches: 8\n")
  _legacy_data_settings(cfg)
  assert cfg.data.packing == "document" and cfg.data.shuffle_batches == 8
  (tmp_path / "config.yaml").write_text("data:\n  packing: stream\n  shuffle_batches: 8\n")
  cfg.data.packing = "stream"
  _legacy_data_settings(cfg)
  assert cfg.data.packing == "stream"


# ---------------------------------------------------------------------------------------------------------- CLI
SMALL = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=16",
         "model.attention=vanilla", "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=8",
         "train.log_every=1", "train.eval_batches=2", "train.eval_every=2", "checkpoint.every=100",
         "data.packing=stream"]


def _finish(proc):
  r = finish(proc)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout


@pytest.mark.slow   # the CLI twin (~50 s) of the in-process stream resume and BPB tests above
def test_cli_trains_resumes_and_evaluates_with_stream_packing(tmp_path, compile_cache):
  """tiny.yaml with data.packing=stream: 4 steps in one go equal 2 + 2 resumed steps (losses, val_bpb), and
  sinkjax.eval on the run reads stream batches and reproduces the trainer's last val_bpb."""
  train_args = ["--config", "configs/tiny.yaml", *SMALL, "train.steps=4"]
  whole = start_command("sinkjax.train", *train_args, f"run.dir={tmp_path / 'a'}", env=compile_cache)
  first = start_command("sinkjax.train", *train_args, f"run.dir={tmp_path / 'b'}", "train.stop_at_step=2",
                        env=compile_cache)
  _finish(whole)
  _finish(first)
  out = _finish(start_command("sinkjax.train", *train_args, f"run.dir={tmp_path / 'b'}", env=compile_cache))
  assert "resuming from step 2" in out
  assert losses(tmp_path / "a") == losses(tmp_path / "b") and len(losses(tmp_path / "a")) == 4
  assert load_config(str(tmp_path / "b" / "config.yaml")).data.packing == "stream"
  _finish(start_command("sinkjax.eval", "--checkpoint", tmp_path / "b", "--out", tmp_path / "eval",
                        env=compile_cache))
  report = json.loads((tmp_path / "eval" / "report.json").read_text())
  last = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines() if "val_bpb" in l]
  assert report["packing"] == "stream" and report["eval_tokens"] == 2 * 8 * 32      # full rows, every target
  np.testing.assert_allclose(report["val_bpb"], last[-1]["val_bpb"], rtol=1e-5)
