"""Evaluate a checkpoint: validation BPB, head importance / imbalance and attention-sink diagnostics.

    python -m sinkjax.eval --checkpoint RUN_DIR [--out DIR] [--data SOURCE] [--split val|all] [--max-docs N]
                           [--packing stream|document] [--batches N] [--batch-size B] [--tau 0.75] [--step S]
                           [section.key=value ...]

A `mesh.*` override (`mesh.fsdp=8`, `mesh.tensor=4`; the run's own mesh keys fill the rest) restores every parameter
straight into its training placement on that mesh (`sinkjax.run.load_run(mesh="run")`: FSDP over d_model, tensor over
heads / MLP / vocab), so a model larger than one device is evaluated where it trained; without one the model is
whole on every device. Batch rows are split over mesh.data x mesh.fsdp. Under a launcher (`launch/local.sh --module
sinkjax.eval -- ARGS`, the TPU VM and SLURM scripts) the processes join with `jax.distributed` as sinkjax.train's do,
each reads its part of every batch, and process 0 alone writes the report.

Restores the parameters of RUN_DIR's latest (or --step) checkpoint, runs held-out batches (the validation split
of the run's data, or of --data; `--split all` every document of it, in order, `--max-docs N` the first N) through
the model and writes into --out (default RUN_DIR/eval/):
  report.json   numbers (keys below), report.md   a short summary with the figures,
  importance.png, first_token_attention.png, value_norm.png, gate_histogram.png, and, from RUN_DIR/metrics.jsonl
  when present, loss.png and head_imbalance.png.

Rows and batches are sized to the data and the memory (`sized_batches`): documents are packed at data.seq_len (at most
the model's context), every row is then cut to the longest row's tokens (rounded up to 64), a batch holds as many rows
as half an accelerator's free memory (a quarter of the host's, at most 2 GiB, on a CPU) holds, at most the training
micro-batch (--batch-size sets it), and the diagnostics that record [T, T] attention maps read the first 64 rows.
Each pass shows its progress on stderr; running out of memory is one line saying what to lower.

report.json: packing (data.packing of the batches), split, eval_rows, seq_len (tokens per row), batch_size (rows per
batch), diagnostic_rows (rows the attention diagnostics and sink ratios read), eval_documents (documents in the batches, whole or in
part; null when --batches stopped before the split's end), eval_tokens (scored targets), val_loss (nats/token),
val_bpb; importance [L][H] (eq. 5),
head_imbalance (eq. 6), cv_per_layer;
first_token_attention [L] (+ _per_head [L][H]), sink_logit_attention [L] (sink logit / sink tokens, else null),
sink_ratio_alpha [L][H] (eq. 9); first_token_value_norm / other_value_norm / value_norm_ratio [L],
value_norm_by_position [L][P]; gate_mean, gate_sparsity [L] (fraction of gate values < gate_sparsity_threshold),
gate_histogram; max_activation [L] (+ _first_token / _other), m_act; value_zeroing {tau, bpb_none, bpb_all,
bpb_selected, heads_selected, ...}; definitions (what each quantity means); where the weights lived: mesh
({axis: size}), processes, param_bytes, param_bytes_per_device (the most one device held, from the arrays'
shardings), peak_device_memory (bytes, `device.memory_stats()`; null on backends without it, e.g. CPU).

Downstream tasks (multiple choice, generation, perplexity) are lm-evaluation-harness tasks: `python -m
sinkjax.lm_eval` (a multiple-choice JSONL file, which `--mc` used to read here, is its `--mc FILE.jsonl`).

BPB and importance use the model's own forward pass (the training kernel path, `forward_with_importance`);
the diagnostics use `sinkjax.analysis.recorded_forward` (the model's own forward, recording its attention weights).

Value zeroing ([Sink-MoE] App. A) comes in two definitions: teacher-forced (`value_zeroing`, the report's: the first
token's value zeroed inside one forward pass over the whole row) and after prefill (`prefill_value_zeroing`, the
paper's: zeroed in the KV cache after prefilling a prompt, the continuation decoded token by token against it);
`teacher_forced_value_zeroing` scores the first on the second's targets. `sinkjax.experiments.paper` reports all three.
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":
  errors.require_extra("sinkjax.eval")     # before the imports below: without the train extra, one line naming it

import dataclasses
import json
import math
import pathlib
import sys
import time

import jax
from tqdm import tqdm
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax import analysis, distributed, options, paths, plots
from sinkjax import sharding as sharding_lib
from sinkjax.balance import head_imbalance
from sinkjax.cache import KVCache
from sinkjax.errors import UserError
from sinkjax.config import declare
from sinkjax.data import FEATURES, make_eval_batches, to_global_batch
from sinkjax.markdown import table
from sinkjax.model import forward_with_importance, padded_vocab
from sinkjax.run import asks_for_mesh, load_run, read_metrics

MODEL_FEATURES = FEATURES                # the batch features of sinkjax.data (what the model and BPB read)

DEFINITIONS = {
    "val_bpb": "sum of next-token NLL over the loss_mask targets with > 0 bytes / ln 2 / sum of their UTF-8 bytes "
               "(nanochat's evaluate_bpb: BOS targets, in the loss under data.packing=stream, count in neither)",
    "val_loss": "mean next-token NLL in nats over loss_mask tokens (under data.packing=stream every target, BOS "
                "included)",
    "first_token": "the first key a query can see: its document's BOS under data.packing=document, the row's first "
                   "token under data.packing=stream (one segment per row: the paper's k_0); 'document' in the "
                   "definitions below means this segment",
    "importance": "Imp[l,h] = mean gate G over the batch's valid tokens (eq. 5; padding and, for vanilla, "
                  "first tokens excluded), token-weighted over all eval batches",
    "head_imbalance": "mean over layers of CV(Imp[l,:]) = std/mean over heads, population std (eq. 6)",
    "cv_per_layer": "CV(Imp[l,:]) per layer",
    "first_token_attention": "mean over heads and over valid non-first queries t of A[t, first(t)], the attention "
                             "weight on the first token of t's own document ([GatedAttn] Table 4 F-Attn); for sink "
                             "attention A is the softmax including the sink logit",
    "sink_logit_attention": "mean weight outside the sequence keys over the same queries: on the sink logit (sink "
                            "attention, = 1 - G) and on learnable sink tokens; null when there is neither",
    "sink_ratio_alpha": "alpha[l,h] = (1/T) sum_i A[i, first(i)] over all valid queries i, the document's first "
                        "included ([Sink-MoE] eq. 9)",
    "value_norm": "||v_t||_2 of the value projection, mean over KV heads; first = documents' first tokens, "
                  "other = the remaining valid tokens; by position = in-document position 0..63",
    "gate_mean": "mean gate value G over the importance tokens (implicit gate 1 - A_first for vanilla, "
                 "sigma(LSE - sink) for sink, sigmoid(x W) for gated; elementwise gates count every element)",
    "gate_sparsity": f"fraction of gate values below {analysis.SPARSE_GATE} over the same tokens",
    "max_activation": "max |h| of the hidden state after each block over valid tokens ([GatedAttn] Table 4 "
                      "M-Act); m_act is its mean over layers",
    "value_zeroing": "BPB of the model's forward with every document's first-token value vector set to zero "
                     "in no head (bpb_none), all heads (bpb_all), or heads with alpha > tau (bpb_selected), "
                     "[Sink-MoE] App. A",
}


class EvalError(UserError):
  """A user-facing evaluation problem (bad arguments or inputs)."""


# ---------------------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------------------

def _lm_batch(model, batch):
  """Model forward (training kernel path): LM sums, importance [L,H] and the number of importance tokens."""
  logits, imp = forward_with_importance(model, batch["inputs"], segment_ids=batch["segment_ids"],
                                        positions=batch["positions"])
  B, T = batch["inputs"].shape
  count = _first_attention(model).importance_mask(batch["segment_ids"], B, T).sum().astype(jnp.float32)
  return analysis.lm_sums(logits, batch), imp, count


_lm_batch_jit = analysis.model_jit(_lm_batch)      # outputs only the sums (not a copy of the weights)


def _device_batch(batch) -> dict:
  missing = [k for k in MODEL_FEATURES if k not in batch]
  assert not missing, f"batch lacks {missing}"
  return {k: jnp.asarray(batch[k]) for k in MODEL_FEATURES}


def language_model_metrics(model, batches, options: dict | None = None) -> dict:
  """val_loss, val_bpb and the token-weighted importance over the batches (model forward; `options`: the program's
  compile options, `model_options`)."""
  nll = tokens = nbytes = bpb_nll = 0.0
  imp_sum, imp_count = None, 0.0
  for b in progress(batches, "val BPB and importance"):
    sums, imp, count = distributed.to_host(_lm_batch_jit(model, _device_batch(b), compiler_options=options))
    nll, tokens, nbytes = nll + float(sums["nll"]), tokens + float(sums["tokens"]), nbytes + float(sums["bytes"])
    bpb_nll += float(sums["bpb_nll"])
    weighted = np.asarray(imp, np.float64) * float(count)
    imp_sum = weighted if imp_sum is None else imp_sum + weighted
    imp_count += float(count)
  if tokens == 0 or nbytes == 0:
    raise EvalError("the evaluation batches hold no target tokens; give more or longer documents")
  imp = imp_sum / max(imp_count, 1.0)
  cv = imp.std(-1) / np.maximum(imp.mean(-1), 1e-12)
  return {"val_loss": nll / tokens, "val_bpb": bpb_nll / math.log(2) / nbytes, "eval_tokens": int(tokens),
          "eval_bytes": int(nbytes), "importance": imp.tolist(), "head_imbalance": float(head_imbalance(imp)),
          "cv_per_layer": cv.tolist()}


def sink_diagnostics(model, batches, options: dict | None = None) -> dict:
  """Per-layer diagnostics of `sinkjax.analysis` accumulated over the batches."""
  totals = None
  for b in progress(batches, "attention diagnostics"):
    stats = analysis.batch_statistics_jit(model, _device_batch(b), compiler_options=options)
    totals = analysis.combine(totals, distributed.to_host(stats))
  return analysis.summarize(totals)


def zeroed_bpb(model, batches, zero_lh, options: dict | None = None) -> float:
  """BPB with the first token's value zeroed in the heads where zero_lh [L,Hq] is True ([Sink-MoE] App. A)."""
  zero = jnp.asarray(zero_lh, bool)
  nll = nbytes = 0.0
  for b in progress(batches, "value zeroing"):
    s = distributed.to_host(analysis.zeroed_lm_sums_jit(model, _device_batch(b), zero, compiler_options=options))
    nll, nbytes = nll + float(s["bpb_nll"]), nbytes + float(s["bytes"])
  return nll / math.log(2) / nbytes


def _zeroing_masks(alpha_lh, tau: float) -> dict:
  """The heads whose first value is zeroed, [L,Hq] bool, in the three settings of [Sink-MoE] App. A (Table 3): in no
  head ("none"), in all heads ("all") and in the heads with sink ratio alpha > tau ("selected")."""
  selected = np.asarray(alpha_lh) > tau
  return {"none": np.zeros_like(selected), "all": np.ones_like(selected), "selected": selected}


def value_zeroing(model, batches, alpha_lh, tau: float, options: dict | None = None) -> dict:
  masks = _zeroing_masks(alpha_lh, tau)
  selected = masks["selected"]
  return {
      "tau": tau,
      **{f"bpb_{k}": zeroed_bpb(model, batches, m, options) for k, m in masks.items()},
      "heads_selected": [[int(l), int(h)] for l, h in zip(*np.nonzero(selected))],
      "num_heads_selected": int(selected.sum()),
      "num_heads": int(selected.size),
  }


def _kv_heads_to_keep(zero_lh, num_kv_heads: int) -> np.ndarray:
  """[L, Hkv] bool, False where the first value is zeroed. The cache holds K/V heads, so a query head can be zeroed
  alone only when every head of its GQA group is zeroed alike (MHA: always)."""
  zero = np.asarray(zero_lh, bool)
  groups = zero.reshape(zero.shape[0], num_kv_heads, -1)
  if (groups.any(-1) != groups.all(-1)).any():
    raise ValueError("after-prefill value zeroing acts on K/V heads: every query head of a GQA group must be zeroed "
                     "alike")
  return ~groups[..., 0]


def _prefill_zeroed_logprobs(graphdef, state, inputs, targets, keep_lkv, prompt_len: int):
  model = nnx.merge(graphdef, state)
  B, T = inputs.shape
  cache = KVCache.for_model(model.cfg, B, T)
  _, cache = model(inputs[:, :prompt_len], cache=cache)
  cache = dataclasses.replace(cache, v=tuple(
      vl.at[:, 0].multiply(keep[None, :, None].astype(vl.dtype)) for vl, keep in zip(cache.v, keep_lkv)))

  def step(cache, xs):
    tok, target = xs
    logits, cache = model(tok[:, None], cache=cache)
    logp = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
    return cache, jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0]

  xs = (jnp.swapaxes(inputs[:, prompt_len:], 0, 1), jnp.swapaxes(targets[:, prompt_len:], 0, 1))
  return jnp.swapaxes(jax.lax.scan(step, cache, xs)[1], 0, 1)


_prefill_zeroed_jit = jax.jit(_prefill_zeroed_logprobs, static_argnums=(0, 5))


def prefill_zeroed_logprobs(model, inputs, targets, zero_lh, prompt_len: int):
  """log p(targets[:, t] | inputs[:, :t+1]) for t = prompt_len .. T-1, [B, T - prompt_len]: inputs[:, :prompt_len]
  are prefilled into a full KV cache, the first token's value is then zeroed in the cache where zero_lh [L, Hq]
  ([Sink-MoE] App. A: "zeros out the first token's value vector after generating the KV cache"), and
  inputs[:, prompt_len:] are decoded one by one against it. Rows are plain causal sequences (data.packing=stream:
  slot 0 is the row's first token, the paper's k_0). MHA or GQA groups zeroed alike (`_kv_heads_to_keep` checks)."""
  inputs, targets = jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32)
  if not 0 < prompt_len < inputs.shape[1]:
    raise ValueError(f"prompt_len must be in 1..{inputs.shape[1] - 1}, got {prompt_len}")
  keep = jnp.asarray(_kv_heads_to_keep(zero_lh, model.cfg.num_kv_heads))
  graphdef, state = nnx.split(model)
  return _prefill_zeroed_jit(graphdef, state, inputs, targets, keep, prompt_len)


def prefill_value_zeroing(model, batches, alpha_lh, *, tau: float, prompt_len: int) -> dict:
  """BPB of the continuations (targets prompt_len..T-1 of every row) with the first token's value zeroed in the KV
  cache after prefill: in no head, all heads, and heads with alpha > tau ([Sink-MoE] App. A, Table 3)."""
  masks = _zeroing_masks(alpha_lh, tau)
  nll = {k: 0.0 for k in masks}
  nbytes = 0.0
  for b in batches:
    keep = (np.asarray(b["loss_mask"]) > 0)[:, prompt_len:]
    by = np.where(keep, np.asarray(b["target_bytes"])[:, prompt_len:], 0).astype(np.float64)
    nbytes += by.sum()
    for k, m in masks.items():
      lp = np.asarray(prefill_zeroed_logprobs(model, b["inputs"], b["targets"], m, prompt_len), np.float64)
      nll[k] += float(-(lp * (by > 0)).sum())
  out = {"tau": tau, "prompt_len": prompt_len, "scored_bytes": int(nbytes),
         "num_heads_selected": int(masks["selected"].sum()), "num_heads": int(masks["selected"].size)}
  out.update({f"bpb_{k}": v / math.log(2) / max(nbytes, 1.0) for k, v in nll.items()})
  return out


def teacher_forced_value_zeroing(model, batches, alpha_lh, *, tau: float, prompt_len: int) -> dict:
  """Teacher-forced value zeroing (`zeroed_bpb`: the first token's value zeroed inside one forward pass over the
  whole row) scored on the same targets as `prefill_value_zeroing`: positions prompt_len..T-1 only, so that the two
  definitions differ in what they zero, not in what they score."""
  masks = _zeroing_masks(alpha_lh, tau)
  window = []
  for b in batches:
    b = dict(b)
    mask = np.array(b["loss_mask"], copy=True)
    mask[:, :prompt_len] = 0
    b["loss_mask"] = mask
    window.append(b)
  out = {"tau": tau, "prompt_len": prompt_len, "num_heads_selected": int(masks["selected"].sum()),
         "num_heads": int(masks["selected"].size)}
  out.update({f"bpb_{k}": zeroed_bpb(model, window, m) for k, m in masks.items()})
  return out


def _first_attention(model):
  """The first layer's attention among the layers with heads (the variant's settings are the same in each)."""
  return model.layers[model.cfg.head_layers[0]].attn


def model_options(model, collective_matmul: str = "gather") -> dict | None:
  """The compile options of the eval programs over `model` as its parameters are placed (mesh.collective_matmul on
  TPU, as the train step takes it; none elsewhere)."""
  return sharding_lib.compiler_options(collective_matmul, sharding_lib.mesh_of(nnx.state(model, nnx.Param)))


def evaluate(model, batches, *, tau: float = 0.75, diagnostic_batches=None, collective_matmul: str = "gather") -> dict:
  """Every number of the report except run metadata and multiple choice. The diagnostics that record [T, T]
  attention maps read `diagnostic_batches` (default: all of `batches`; `sized_batches` bounds them). On TPU every
  program compiles with `collective_matmul`'s options (the run's mesh.collective_matmul)."""
  options = model_options(model, collective_matmul)
  report = language_model_metrics(model, batches, options)
  report.update(sink_diagnostics(model, batches if diagnostic_batches is None else diagnostic_batches, options))
  if not _first_attention(model).has_outside_weight:       # no sink logit, no sink tokens: nothing outside the keys
    report["sink_logit_attention"] = None
  report["gate_sparsity_threshold"] = analysis.SPARSE_GATE
  report["value_zeroing"] = value_zeroing(model, batches, report["sink_ratio_alpha"], tau, options)
  return report


# ---------------------------------------------------------------------------------------------------------------
# Sizing: rows as long as the data, batches as large as the memory
# ---------------------------------------------------------------------------------------------------------------

ROW_MULTIPLE = 64          # rows are cut to the data's longest row rounded up to this many tokens
DIAGNOSTIC_ROWS = 64       # the diagnostics that record [T, T] attention maps read at most this many rows
CPU_BUDGET = 2 << 30       # at most this many bytes of activations per forward on a CPU (the host's memory)


def progress(items, what: str):
  """tqdm on stderr for a pass of the evaluation (shown after 2 s, on process 0 only)."""
  return tqdm(items, desc=f"sinkjax.eval: {what}", unit="batch", delay=2.0, file=sys.stderr, leave=False,
              disable=jax.process_index() != 0)


def memory_budget(device=None) -> int:
  """Bytes of activations one evaluation forward may take: half of what an accelerator has free, or a quarter of
  the host's available memory (at most CPU_BUDGET) on a CPU."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and stats.get("bytes_limit"):
    return max((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) // 2, 1)
  try:
    with open("/proc/meminfo", encoding="utf-8") as f:
      avail = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
  except (OSError, StopIteration, ValueError):
    avail = 8 << 30
  return max(min(avail // 4, CPU_BUDGET), 1)


def row_bytes(m, T: int, *, diagnostics: bool = False) -> int:
  """A generous estimate of the activation bytes of one row of T tokens in the evaluation forward: float32 logits
  and their log-softmax over the padded vocabulary, the residual stream and MLP hidden of a layer; with
  `diagnostics`, every head layer's recorded [H, T, T] attention weights, q / k / v and hidden state too (the
  recording keeps them for the whole forward)."""
  b = T * (12 * padded_vocab(m) + 4 * (8 * m.d_model + 2 * m.mlp_width))
  if diagnostics:
    per_layer = m.num_heads * T + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + 2 * m.d_model
    b += len(m.head_layers) * T * 4 * per_layer
  return b


def _group(rows: dict, n: int, size: int, T: int) -> list[dict]:
  """rows[:n] in batches of `size` rows (the last one filled up with padding rows: loss_mask 0), cut to T tokens."""
  out = []
  for start in range(0, n, size):
    b = {f: v[start:min(start + size, n), :T] for f, v in rows.items()}
    pad = size - len(b["inputs"])
    if pad:
      b = {f: np.concatenate([v, np.zeros((pad, T), v.dtype)]) for f, v in b.items()}
    out.append(b)
  return out


def sized_batches(batches: list[dict], m, *, batch_rows: int | None, default_rows: int, budget: int):
  """The evaluation's rows (this process' rows of `batches`, packed at data.seq_len) regrouped to fit the data and the
  memory: every row cut to the longest row's tokens (rounded up to ROW_MULTIPLE; all processes agree), trailing
  all-padding rows dropped (one process), `batch_rows` rows per batch when given, else as many as `budget` bytes
  hold (`row_bytes`), at most `default_rows` and the rows there are; the [T, T] diagnostics on the first
  min(DIAGNOSTIC_ROWS, rows) rows in batches that hold their maps. Returns (batches, diagnostic batches, plan dict)."""
  rows = {f: np.concatenate([np.asarray(b[f]) for b in batches]) for f in MODEL_FEATURES}
  used = (rows["segment_ids"] > 0) | (rows["loss_mask"] > 0)
  full_T = used.shape[1]
  length = int(np.max(np.nonzero(used.any(0))[0], initial=-1)) + 1
  length = distributed.max_over_processes(length)
  T = min(full_T, max(-(-length // ROW_MULTIPLE) * ROW_MULTIPLE, ROW_MULTIPLE))
  n = len(used)
  if jax.process_count() == 1:
    n = int(np.max(np.nonzero(used.any(1))[0], initial=0)) + 1
  fit = max(budget // row_bytes(m, T), 1)
  size = batch_rows or max(min(default_rows, fit, n), 1)
  diag_rows = min(n, DIAGNOSTIC_ROWS)
  diag_size = max(min(size, diag_rows, budget // row_bytes(m, T, diagnostics=True)), 1)
  if jax.process_count() > 1:        # every process' batches have one layout over the mesh (place_batches)
    diag_rows, diag_size = n, size
  plan = {"rows": n * jax.process_count(), "seq_len": T, "batch_size": size * jax.process_count(),
          "diagnostic_rows": diag_rows * jax.process_count(), "memory_budget": int(budget)}
  return _group(rows, n, size, T), _group(rows, diag_rows, diag_size, T), plan


def out_of_memory(e: Exception) -> bool:
  return "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e)


# ---------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------

def write_figures(report: dict, out_dir: pathlib.Path, metrics_path: pathlib.Path | None) -> list[pathlib.Path]:
  variant = report.get("attention", "")
  first = "row" if report.get("packing") == "stream" else "document"
  layers = report.get("layers_with_heads")    # every per-layer row below is a layer with heads
  figures = [
      plots.plot_importance_heatmap(report["importance"], out_dir / "importance.png",
                                    f"head importance ({variant})", layers=layers),
      plots.plot_first_token_attention(report["first_token_attention_per_head"], out_dir / "first_token_attention.png",
                                       sink_weight=report["sink_logit_attention"],
                                       title=f"attention on the {first}'s first token ({variant})", layers=layers),
      plots.plot_value_norms(report["value_norm_by_position"], out_dir / "value_norm.png",
                             f"value norm by position ({variant})", layers=layers),
      plots.plot_gate_histogram(report["gate_histogram"]["edges"], report["gate_histogram"]["density"],
                                out_dir / "gate_histogram.png", f"gate distribution ({variant})", layers=layers),
  ]
  if metrics_path is not None and metrics_path.is_file():
    figures += plots.plot_training_curves(read_metrics(metrics_path), out_dir)
  return figures


def _fmt(x, nd=3):
  return "-" if x is None else f"{x:.{nd}f}"


def markdown(report: dict, figures: list[pathlib.Path]) -> str:
  r = report
  vz = r["value_zeroing"]
  lines = [
      f"# Evaluation of `{r['run_dir']}` (step {r['step']})",
      "",
      f"{r['attention']} attention, {len(r['importance'])} layers x {len(r['importance'][0])} heads; "
      f"{r['eval_batches']} batches, "
      + ("" if r.get("eval_documents") is None else f"{r['eval_documents']:,} documents, ")
      + f"{r['eval_tokens']:,} tokens, {r['eval_bytes']:,} bytes of `{r['data_source']}`"
      f" ({r.get('split', 'val')} split, {r.get('packing', 'document')} packing).",
      "",
      *table(["metric", "value"], [
          ["val BPB", f"{r['val_bpb']:.4f}"], ["val loss (nats/token)", f"{r['val_loss']:.4f}"],
          ["head imbalance (eq. 6)", f"{r['head_imbalance']:.4f}"],
          ["first-token attention, mean over layers", f"{np.mean(r['first_token_attention']):.3f}"],
          ["M-Act (mean over layers of max abs hidden)", f"{r['m_act']:.1f}"],
          [f"value zeroing: BPB none / all heads / alpha > {vz['tau']} ({vz['num_heads_selected']} of "
           f"{vz['num_heads']} heads)", f"{vz['bpb_none']:.4f} / {vz['bpb_all']:.4f} / {vz['bpb_selected']:.4f}"]]),
  ]
  sink = r["sink_logit_attention"]
  layers = r.get("layers_with_heads") or list(range(len(r["importance"])))
  lines += ["", "Per layer:", "",
            *table(["layer", "first-token attn", "sink logit", "CV(Imp)", "value norm first / other", "gate mean",
                    f"gate < {r['gate_sparsity_threshold']}", "max abs h"],
                   ([layers[l], f"{r['first_token_attention'][l]:.3f}", _fmt(sink[l] if sink else None),
                     f"{r['cv_per_layer'][l]:.3f}",
                     f"{r['first_token_value_norm'][l]:.2f} / {r['other_value_norm'][l]:.2f}",
                     f"{r['gate_mean'][l]:.3f}", f"{r['gate_sparsity'][l]:.3f}", f"{r['max_activation'][l]:.1f}"]
                    for l in range(len(r["importance"]))))]
  lines += ["", "Definitions are in `report.json` under `definitions`.", ""]
  for p in figures:
    lines += [f"![{p.stem}]({p.name})", ""]
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class EvalOptions:
  """The eval.* options (`python -m sinkjax.eval`; each flag is the alias of its key: `--tau 0.5` = `eval.tau=0.5`).
  The held-out data is the run's config's (`--data X` is `data.source=X`, `--packing P` `data.packing=P`: the flags of
  those keys, `COMMAND.run_keys`), its validation split unless --split all."""
  checkpoint: str = declare("", alias="--checkpoint", metavar="RUN_DIR", required=True,
                        help="run directory of a training run")
  out: str = declare("", alias="--out", metavar="DIR", help="output directory (default RUN_DIR/eval)")
  step: int | None = declare(None, ">=0", alias="--step", help="checkpoint step (default: the latest)")
  split: str = declare("val", choices=("val", "all"), alias="--split",
                   help="val: the source's validation split (default); all: every document of the source, in order")
  max_docs: int | None = declare(None, ">=1", alias="--max-docs", metavar="N",
                             help="score only the first N documents of the split (in order)")
  batches: int | None = declare(None, ">=1", alias="--batches",
                            help="number of eval batches (default train.eval_batches; with --split all or --max-docs: "
                                 "every batch the documents fill)")
  batch_size: int | None = declare(None, ">=1", alias="--batch-size",
                               help="rows per batch (default: as many as the memory holds, at most the training "
                                    "micro-batch)")
  tau: float = declare(0.75, "[0,1]", alias="--tau",
                   help="sink-ratio threshold of selective value zeroing ([Sink-MoE] App. A)")
  mc: str | None = declare(None, alias="--mc")        # hidden: moved to sinkjax.lm_eval (one line says so)


COMMAND = options.Command(
    prog="python -m sinkjax.eval", sections={"eval": EvalOptions}, run_overrides=True,
    run_keys=("data.source", "data.packing"),
    description="Evaluate a checkpoint: validation BPB, head importance and imbalance, attention-sink diagnostics "
                "(first-token attention, value norms, gates, massive activations, value zeroing); writes report.json, "
                "report.md and PNGs. Downstream tasks: python -m sinkjax.lm_eval.")


def place_batches(batches: list[dict], mesh) -> list[dict]:
  """This process' rows of each eval batch as global arrays split over the mesh's batch axes (mesh.data x
  mesh.fsdp), as training places its batches; in one process, rows that do not divide over those axes stay host
  arrays (each device computes the whole batch)."""
  rows = len(batches[0]["inputs"]) * jax.process_count()
  shards = sharding_lib.batch_shards(mesh)
  if rows % shards:
    if jax.process_count() > 1:
      raise EvalError(f"--batch-size {rows} must be divisible by the {shards} batch shards (mesh.data x mesh.fsdp) "
                      "of a multi-process job")
    return batches
  return [to_global_batch(b, sharding_lib.batch_sharding(mesh)) for b in batches]


def run(opts: EvalOptions, run_overrides: list[str] | tuple = ()) -> dict:
  """Evaluates `opts.checkpoint` (with the run's config overrides `run_overrides`) and writes the report into
  opts.out (default RUN_DIR/eval); returns the report."""
  if opts.mc is not None:
    raise EvalError(f"multiple choice is an lm-evaluation-harness task now: python -m sinkjax.lm_eval --checkpoint "
                    f"{opts.checkpoint} --mc {opts.mc} (docs/EVAL.md)")
  paths.check_bucket(opts.checkpoint, "--checkpoint")   # the flag whose path fails is the one named
  run_dir = paths.as_path(opts.checkpoint, "--checkpoint")
  out = paths.as_path(opts.out, "--out") if opts.out else run_dir / "eval"
  if opts.out:
    paths.check_bucket(out, "--out")        # before the work: a missing bucket is found now, not at the end
  t0 = time.perf_counter()
  # The layers as one scan (numerically the same program per layer): compile time does not grow with depth, which
  # on a CPU is most of an evaluation of a small file. An override on the command line wins.
  overrides = ["model.scan_layers=true"] + list(run_overrides)
  # mesh.* overrides: the model placed on the run's mesh as training places it; else whole on every device
  model, cfg, tokenizer, step = load_run(run_dir, opts.step, overrides,
                                         mesh="run" if asks_for_mesh(run_overrides) else None)
  mesh = sharding_lib.mesh_of(nnx.state(model, nnx.Param))
  batch_size = opts.batch_size or max(cfg.train.batch_size // cfg.train.grad_accum, 1)
  procs = jax.process_count()
  if batch_size % procs:
    raise EvalError(f"--batch-size {batch_size} must be divisible by the {procs} processes")
  whole = opts.split == "all" or opts.max_docs is not None
  num_batches = opts.batches or (None if whole else max(cfg.train.eval_batches, 1))
  if cfg.model.max_seq_len and cfg.data.seq_len > cfg.model.max_seq_len:
    cfg.data.seq_len = cfg.model.max_seq_len           # no row longer than the model's context
  counts = {}
  # Which rows are read is set by the nominal batch (--batches N reads N batches' worth); their shape by the data
  # and the memory (sized_batches).
  rows = make_eval_batches(cfg.data, tokenizer, batch_size=batch_size // procs, num_batches=num_batches,
                           split=opts.split, max_docs=opts.max_docs, counts=counts)
  batches, diagnostic, plan = sized_batches(rows, cfg.model, batch_rows=opts.batch_size and batch_size // procs,
                                            default_rows=batch_size // procs, budget=memory_budget())
  if jax.process_index() == 0:
    print(f"sinkjax.eval: {plan['rows']:,} rows of {plan['seq_len']:,} tokens in {len(batches)} batches of "
          f"{plan['batch_size']} (diagnostics on {plan['diagnostic_rows']} rows)", file=sys.stderr, flush=True)

  report = {"run_dir": str(run_dir), "step": step, "attention": cfg.model.attention,
            "layers_with_heads": list(cfg.model.head_layers),
            "data_source": cfg.data.source, "packing": cfg.data.packing, "split": opts.split,
            "eval_documents": counts["documents"], "eval_batches": len(batches),
            "batch_size": plan["batch_size"], "seq_len": plan["seq_len"], "eval_rows": plan["rows"],
            "diagnostic_rows": plan["diagnostic_rows"], "processes": procs}
  try:
    with jax.set_mesh(mesh):              # as in training: attention runs per shard, kernels follow the mesh
      report.update(evaluate(model, place_batches(batches, mesh), tau=opts.tau,
                             diagnostic_batches=place_batches(diagnostic, mesh),
                             collective_matmul=cfg.mesh.collective_matmul))
  except Exception as e:  # pylint: disable=broad-except  # XLA's allocation failure (JaxRuntimeError)
    if not out_of_memory(e):
      raise
    shorter = (f" or the rows' length (data.seq_len={plan['seq_len'] // 2})" if plan["seq_len"] >= 2 * ROW_MULTIPLE
               else "")
    raise EvalError(f"out of memory scoring batches of {plan['batch_size']} rows x {plan['seq_len']} tokens: "
                    f"lower --batch-size (e.g. --batch-size {max(plan['batch_size'] // 4, 1)}){shorter}") from None
  report.update(sharding_lib.placement(nnx.state(model, nnx.Param)))
  report["definitions"] = DEFINITIONS
  report["eval_seconds"] = time.perf_counter() - t0
  if jax.process_index() != 0:           # one report per job
    return report

  out.mkdir(parents=True, exist_ok=True)
  figures = write_figures(report, out, run_dir / "metrics.jsonl")
  report["figures"] = [p.name for p in figures]
  (out / "report.json").write_text(json.dumps(report, indent=1))
  (out / "report.md").write_text(markdown(report, figures))
  return report


def main(argv=None) -> int:
  def evaluate_and_print(sections, run_overrides):
    opts = sections["eval"]
    distributed.maybe_initialize()    # before anything touches JAX devices (a job of several processes)
    report = run(opts, run_overrides)
    if jax.process_index() != 0:
      return
    out = opts.out or f"{str(opts.checkpoint).rstrip('/')}/eval"
    vz = report["value_zeroing"]
    docs = "" if report["eval_documents"] is None else f"{report['eval_documents']:,} documents, "
    print(f"sinkjax.eval: {docs}{report['eval_tokens']:,} tokens scored; val_bpb {report['val_bpb']:.4f}  "
          f"head_imbalance {report['head_imbalance']:.4f}  "
          f"first-token attention {np.mean(report['first_token_attention']):.3f}  value zeroing all/selected "
          f"{vz['bpb_all']:.4f}/{vz['bpb_selected']:.4f}; mesh {report['mesh']}, "
          f"{report['param_bytes_per_device']:,} parameter bytes per device; wrote {out}/report.json")
  return options.main(COMMAND, argv, evaluate_and_print)


if __name__ == "__main__":
  sys.exit(main())
