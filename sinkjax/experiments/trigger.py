"""Trigger-conditional averaging task of [SinkNecessary] ("Attention sinks are provably necessary in softmax
transformers"), trained with softmax, ReLU, sink and gated attention; a study file of driver trigger.

    python -m sinkjax.experiments.study configs/studies/trigger_quick.yaml [study.out=DIR] [trigger.seed=N] ...
    python -m sinkjax.experiments.study configs/studies/trigger.yaml      # + the 2x2 and 4x4 models

The task (§3.2; positions 1-indexed as in the paper, the code 0-indexed), the attention-only models (§3.4, §4.2:
no norms or MLPs, head_dim = d_model, unscaled scores; the prediction is what the layers wrote, h_L - x), the training
of App. A and the `converged` / `solved` (held-out batch) criteria: docs/TRIGGER.md. Each model is a run of
`sinkjax.experiments.runner` in study.out/runs/VARIANT_LxH (record.json, params.npz); study.out then holds
results.json, table.txt and the attention figures (Fig. 3 for 1x1 models, Figs. 4-5 per head for deeper ones).
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":   # a command until the study runner (#50) ran it
  errors.moved("sinkjax.experiments.trigger",
            "python -m sinkjax.experiments.study configs/studies/trigger.yaml (--quick: trigger_quick.yaml; --out "
            "DIR: study.out=DIR)")

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sinkjax import paths
from sinkjax.attention import (gated_attention, relu_attention, relu_attention_weights, sink_attention,
                               vanilla_attention)
from sinkjax.config import declare
from sinkjax.experiments import runner
from sinkjax.experiments.runner import StudyError
from sinkjax.kernels import attention_weights

VARIANTS = ("softmax", "relu", "sink", "gated")
# the variant's own weight: its name in table.txt and in the records
OWN = {"sink": ("sink", "sink_attention"), "gated": ("gate", "gate"), "relu": ("mass", "attention_mass")}
BOS, TRIG, OTHER = 0, 1, 2                   # indicator coordinates (paper's 1, 2, 3)


# ----------------------------------------------------------------------------------------------------- task

def task_targets(x):
  """Targets of [SinkNecessary] §3.2 for inputs x [..., T, d]: zero except at the trigger, where it is the mean of the
  non-BOS tokens up to and including the trigger. The trigger is read from coordinate 2 (index 1)."""
  x = jnp.asarray(x)
  is_trig = x[..., TRIG] > 0.5                                            # [..., T]
  non_bos = (x[..., BOS] < 0.5)[..., None]
  csum = jnp.cumsum(jnp.where(non_bos, x, 0.0), axis=-2)                  # sum of non-BOS tokens up to t
  count = jnp.cumsum(non_bos.astype(x.dtype), axis=-2)                    # number of them
  mean = csum / jnp.maximum(count, 1.0)
  return jnp.where(is_trig[..., None], mean, 0.0)


def make_batch(key, batch: int, seq_len: int, dim: int, trigger_pos: int | None = None, bos: bool = True):
  """(x [B,T,d], y [B,T,d], trigger index [B]) for the task of [SinkNecessary] §3.2, the trigger at `trigger_pos`
  (0-indexed, 1..T-1) or uniform on {1, ..., T-1} (the paper's {2, ..., T}); bos=False: position 0 is an ordinary
  token (the no-BOS ablation of docs/TRIGGER.md)."""
  k_pos, k_content = jax.random.split(key)
  if trigger_pos is None:
    tpos = jax.random.randint(k_pos, (batch,), 1, seq_len)
  else:
    tpos = jnp.full((batch,), trigger_pos, jnp.int32)
  pos = jnp.arange(seq_len)[None, :]
  is_bos = jnp.broadcast_to((pos == 0) & bos, (batch, seq_len))
  is_trig = pos == tpos[:, None]
  is_other = ~is_bos & ~is_trig
  content = jax.random.uniform(k_content, (batch, seq_len, dim - 3), minval=-1.0, maxval=1.0)
  content = jnp.where(is_bos[..., None], 0.0, content)
  ind = jnp.stack([is_bos, is_trig, is_other], axis=-1).astype(jnp.float32)
  x = jnp.concatenate([ind, content], axis=-1)
  return x, task_targets(x), tpos


# ---------------------------------------------------------------------------------------------------- model

def init_params(key, variant: str, layers: int, heads: int, dim: int, init_std: float = 0.02):
  """A list (one per layer) of dicts: wq, wk, wv [d, H, d], wo [H, d, d]; `sink` [H] (sink); `wg` [d, H] (gated)."""
  params = []
  for lk in jax.random.split(key, layers):
    ks = jax.random.split(lk, 5)
    p = {name: init_std * jax.random.normal(k, (dim, heads, dim)) for name, k in zip(("wq", "wk", "wv"), ks)}
    p["wo"] = init_std * jax.random.normal(ks[3], (heads, dim, dim))
    if variant == "sink":
      p["sink"] = jnp.zeros((heads,))
    elif variant == "gated":
      p["wg"] = init_std * jax.random.normal(ks[4], (dim, heads))
    params.append(p)
  return params


def _layer(p, h, bos, variant: str, impl: str, want_maps: bool):
  q = jnp.einsum("btd,dhe->bthe", h, p["wq"])
  k = jnp.einsum("btd,dhe->bthe", h, p["wk"])
  v = jnp.einsum("btd,dhe->bthe", h, p["wv"])
  maps = {}
  if variant == "softmax":
    out, gate = vanilla_attention(q, k, v, scale=1.0, impl=impl)
  elif variant == "relu":
    out, gate = relu_attention(q, k, v, scale=1.0, bos_mask=bos)
  elif variant == "sink":
    out, gate = sink_attention(q, k, v, p["sink"], scale=1.0, impl=impl)
  elif variant == "gated":
    out, gate = gated_attention(q, k, v, jnp.einsum("btd,dh->bth", h, p["wg"]), scale=1.0, impl=impl)
  else:
    raise ValueError(f"unknown variant {variant!r}")
  if want_maps:
    B, T = h.shape[:2]
    if variant == "relu":
      attn = relu_attention_weights(q, k, scale=1.0, bos_mask=bos)                        # [B,H,T,T]
    else:
      seg = jnp.ones((B, T), jnp.int32)
      _, _, probs, _ = attention_weights(q, k, seg, seg, causal=True, scale=1.0)
      # sink: the sink logit sits in the denominator, so the real keys share sigma(LSE - sink) = gate.
      attn = probs * jnp.swapaxes(gate, 1, 2)[..., None] if variant == "sink" else probs
    maps = {"attn": attn, "gate": gate}
  return jnp.einsum("bthe,hed->btd", out, p["wo"]), maps


def forward(params, x, variant: str, impl: str = "reference", return_maps: bool = False):
  """Prediction h_L - x [B,T,d]; with return_maps also per-layer maps {'attn': [L,B,H,T,T], 'gate': [L,B,T,H]}:
  the attention weights (sink: rows sum to 1 - sink mass; relu: the unnormalized ReLU weights) and the gate the
  attention function returns (1 - A_BOS, the non-BOS ReLU mass, sigma(LSE - sink), the sigmoid output gate)."""
  h = x
  bos = x[..., BOS] > 0.5                      # BOS flags from the input (ReLU attention's divisor skips them)
  all_maps = []
  for p in params:
    delta, maps = _layer(p, h, bos, variant, impl, return_maps)
    h = h + delta
    all_maps.append(maps)
  pred = h - x
  if not return_maps:
    return pred
  return pred, {k: jnp.stack([m[k] for m in all_maps]) for k in ("attn", "gate")}


_forward_jit = jax.jit(forward, static_argnames=("variant", "impl", "return_maps"))


def forward_maps(params, x, variant: str, impl: str = "reference"):
  """Jitted `forward(..., return_maps=True)` (one compilation per variant, depth and data shape)."""
  return _forward_jit(params, x, variant=variant, impl=impl, return_maps=True)


def mse(params, x, y, variant, impl):
  pred = forward(params, x, variant, impl)
  return jnp.mean((pred - y) ** 2), pred


# ------------------------------------------------------------------------------------------------- training

def make_train_chunk(variant: str, opt, *, batch: int, seq_len: int, dim: int, stop_linf: float, impl: str,
                     chunk: int, bos: bool = True):
  """A jitted function running `chunk` Adam steps in a lax.scan. Steps after the stopping criterion is met
  (max |pred - y| over a whole training batch < stop_linf, checked on each step's batch, after which that step's
  update is still applied, as in the paper's code) or past the step limit are no-ops."""
  grad_fn = jax.value_and_grad(mse, has_aux=True)

  def step(carry, key):
    params, opt_state, done, n, limit = carry
    x, y, _ = make_batch(key, batch, seq_len, dim, bos=bos)
    (loss, pred), grads = grad_fn(params, x, y, variant, impl)
    linf = jnp.max(jnp.abs(pred - y))
    updates, new_opt_state = opt.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    active = ~done & (n < limit)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(active, a, b), new, old)
    params, opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
    n = n + active.astype(n.dtype)
    done = done | (active & (linf < stop_linf))
    return (params, opt_state, done, n, limit), (loss, linf)

  @jax.jit
  def run(params, opt_state, done, n, limit, key):
    keys = jax.random.split(key, chunk)
    (params, opt_state, done, n, _), (losses, linfs) = jax.lax.scan(
        step, (params, opt_state, done, n, limit), keys)
    return params, opt_state, done, n, losses, linfs

  return run


def train(variant: str, layers: int, heads: int, *, lr: float, max_steps: int, seed: int, batch: int = 128,
          seq_len: int = 16, dim: int = 16, stop_linf: float = 5e-3, impl: str = "reference", chunk: int = 250,
          init_std: float = 0.02, progress: bool = True, bos: bool = True):
  """Train one model; returns (params, info) with info = steps, converged, last batch loss / max error, time."""
  from tqdm import tqdm  # lazy: --help stays light
  k_init, k_data = jax.random.split(jax.random.key(seed))
  params = init_params(k_init, variant, layers, heads, dim, init_std)
  opt = optax.adam(lr, b1=0.9, b2=0.95)
  opt_state = opt.init(params)
  chunk = max(1, min(chunk, max_steps))
  run = make_train_chunk(variant, opt, batch=batch, seq_len=seq_len, dim=dim, stop_linf=stop_linf, impl=impl,
                         chunk=chunk, bos=bos)
  done, n = jnp.array(False), jnp.array(0, jnp.int32)
  curve = []
  t0 = time.perf_counter()
  # No total: runs stop when the max error drops below stop_linf, usually long before the max_steps cap, so a bar
  # counting to the cap would give a misleading time estimate.
  bar = tqdm(desc=f"{variant:7s} {layers}L x {heads}H (until max_err < {stop_linf:g}, cap {max_steps})", unit="step",
             disable=not progress, dynamic_ncols=True, file=sys.stderr)
  steps_done, loss, linf = 0, float("nan"), float("nan")
  while steps_done < max_steps and not bool(done):
    params, opt_state, done, n, losses, linfs = run(params, opt_state, done, n, jnp.int32(max_steps),
                                                    jax.random.fold_in(k_data, len(curve)))   # a key per chunk
    new_steps = int(n)
    last = max(new_steps - steps_done - 1, 0)
    loss, linf = float(losses[last]), float(linfs[last])
    curve.append([new_steps, loss, linf])
    bar.update(new_steps - steps_done)
    bar.set_postfix(loss=f"{loss:.2e}", max_err=f"{linf:.3f}")
    steps_done = new_steps
  bar.close()
  info = {"steps": int(n), "converged": bool(done), "train_loss": loss, "train_max_abs_error": linf,
          "train_time_s": time.perf_counter() - t0, "lr": lr, "curve": curve}
  return params, info


# ----------------------------------------------------------------------------------------------- evaluation

def _masked_mean(a, m, axes):
  m = jnp.broadcast_to(m, a.shape).astype(jnp.float32)
  return jnp.sum(a * m, axis=axes) / jnp.maximum(jnp.sum(m, axis=axes), 1.0)


def value_norms(params, x, variant: str, impl: str = "reference") -> dict[str, Any]:
  """Per layer and head [L][H]: the mean norm of the BOS token's value vector v = h W_V and of the other tokens',
  and of what each writes to the residual stream through W_O (v W_O, the part attention weight multiplies); the
  "BOS value ≈ 0" of a sink is bos / other << 1. Without a BOS token (trigger.bos false) the BOS entries are None."""
  h = x
  bos = x[..., BOS] > 0.5
  has_bos = bool(np.asarray(bos).any())
  out = {k: [] for k in ("bos_value_norm_per_head", "value_norm_per_head", "bos_output_norm_per_head",
                         "output_norm_per_head")}
  for p in params:
    v = jnp.einsum("btd,dhe->bthe", h, p["wv"])                            # [B,T,H,d]
    o = jnp.einsum("bthe,hed->bthd", v, p["wo"])
    for key, a in (("value", v), ("output", o)):
      n = jnp.linalg.norm(a, axis=-1)                                      # [B,T,H]
      out[f"bos_{key}_norm_per_head"].append(np.asarray(_masked_mean(n, bos[..., None], (0, 1))).tolist())
      out[f"{key}_norm_per_head"].append(np.asarray(_masked_mean(n, ~bos[..., None], (0, 1))).tolist())
    h = h + _layer(p, h, bos, variant, impl, False)[0]
  if not has_bos:
    out.update(bos_value_norm_per_head=None, bos_output_norm_per_head=None)
  return out


def evaluate(params, variant: str, x, y, tpos, impl: str = "reference") -> dict[str, Any]:
  """Loss, zero-prediction baseline and attention statistics on evaluation data (docs/TRIGGER.md, "Metrics")."""
  pred, maps = forward_maps(params, x, variant, impl)
  attn, gate = maps["attn"], maps["gate"]                                  # [L,B,H,T,T], [L,B,T,H]
  B, T = x.shape[:2]
  pos = jnp.arange(T)[None, :]
  trig = pos == tpos[:, None]                                              # [B,T]
  nontrig = (pos >= 1) & ~trig                                             # non-BOS non-trigger queries
  pre, post = nontrig & (pos < tpos[:, None]), nontrig & (pos > tpos[:, None])
  bos = jnp.swapaxes(attn[..., 0], 2, 3)                                   # [L,B,T,H]: weight on the BOS key
  per_head = lambda a, m: _masked_mean(a, m[None, :, :, None], (1, 2))    # -> [L,H]
  bos_nt, bos_tr = per_head(bos, nontrig), per_head(bos, trig)
  rec = {
      "final_loss": float(jnp.mean((pred - y) ** 2)),
      "baseline_loss": float(jnp.mean(y ** 2)),
      "bos_attention_nontrigger": float(bos_nt.mean()),
      "bos_attention_trigger": float(bos_tr.mean()),
      "max_abs_error": float(jnp.max(jnp.abs(pred - y))),
      "trigger_loss": float(_masked_mean(jnp.mean((pred - y) ** 2, -1), trig, (0, 1))),
      "nontrigger_loss": float(_masked_mean(jnp.mean((pred - y) ** 2, -1), nontrig, (0, 1))),
      "bos_attention_pretrigger": float(per_head(bos, pre).mean()),
      "bos_attention_posttrigger": float(per_head(bos, post).mean()),
      "bos_attention_nontrigger_per_head": np.asarray(bos_nt).tolist(),
      "bos_attention_trigger_per_head": np.asarray(bos_tr).tolist(),
  }
  rec.update(value_norms(params, x, variant, impl))
  # the variant's own weight beside the BOS key's: the sink logit's mass sigma(sink - LSE), the gate, the ReLU mass
  own = {"sink": lambda: 1.0 - gate, "gated": lambda: gate,
         "relu": lambda: jnp.swapaxes(attn.sum(-1), 2, 3)}.get(variant)                 # [L,B,T,H], only this one
  if own is not None:                    # the means, then the per-head lists (the committed records' key order)
    weight = own()
    v = {f"{OWN[variant][1]}_{where}": per_head(weight, m) for where, m in (("nontrigger", nontrig),
                                                                            ("trigger", trig))}
    rec.update({k: float(h.mean()) for k, h in v.items()})
    rec.update({f"{k}_per_head": np.asarray(h).tolist() for k, h in v.items()})
  if variant == "sink":
    rec["sink_logits"] = [np.asarray(p["sink"]).tolist() for p in params]
  return rec


# --------------------------------------------------------------------------------------------------- driver

def solved_on_heldout(params, variant: str, x, y, stop_linf: float, impl: str = "reference") -> dict[str, Any]:
  """The task's rule (largest absolute error below stop_linf) applied to a held-out batch: {'heldout_max_abs_error',
  'solved'}. Training's own check (`converged`) uses the batch it stopped on, which the rule selected."""
  err = float(jnp.max(jnp.abs(forward(params, x, variant, impl) - y)))
  return {"heldout_max_abs_error": err, "solved": bool(err < stop_linf), "stop_error": stop_linf}


def format_table(records: list[dict[str, Any]]) -> str:
  """One row per model: steps, `conv` (the stop rule met on a training batch), `solved` (met on a held-out batch)
  and that batch's largest error, losses and BOS attention."""
  head = (f"{'variant':8s} {'L':>2s} {'H':>2s} {'steps':>6s} {'conv':>4s} {'solved':>6s} {'max_err':>8s} "
          f"{'final_loss':>10s} {'baseline':>9s} {'BOS@non-trig':>12s} {'BOS@trigger':>11s}  extra")
  lines = [head, "-" * len(head)]
  for r in records:
    short, name = OWN.get(r["variant"], ("", ""))
    extra = f"{short}@non-trig={r[name + '_nontrigger']:.3f} {short}@trig={r[name + '_trigger']:.3f}" if name else ""
    lines.append(f"{r['variant']:8s} {r['layers']:2d} {r['heads']:2d} {r['steps']:6d} "
                 f"{'yes' if r['converged'] else 'no':>4s} {'yes' if r['solved'] else 'no':>6s} "
                 f"{r['heldout_max_abs_error']:8.2e} {r['final_loss']:10.2e} {r['baseline_loss']:9.2e} "
                 f"{r['bos_attention_nontrigger']:12.3f} {r['bos_attention_trigger']:11.3f}  {extra}")
  return "\n".join(lines)


@dataclasses.dataclass
class TriggerOptions:
  """The `trigger:` section of a driver-trigger study file (configs/studies/trigger.yaml); its axes are `shape`
  (LAYERSxHEADS) and `variant`."""
  seed: int = declare(0, ">=0")                   # the study's seed: evaluation batches and every model's init and data
  max_steps: int = declare(50000, ">=1")          # step cap per model
  lr_single: float = declare(1e-3, ">0")          # Adam lr of 1-layer models ([SinkNecessary] App. A)
  lr_multi: float = declare(1e-4, ">0")           # deeper models
  batch_size: int = declare(128, ">=1")
  seq_len: int = declare(16, ">=1")               # >= 3: BOS, a token and a trigger
  dim: int = declare(16, ">=1")                   # token dimension d (3 indicators + d - 3 content), >= 4
  stop_error: float = declare(5e-3, ">0")         # stop when max |pred - target| over a training batch is below this
  eval_size: int = declare(1000, ">=1")           # evaluation sequences
  impl: str = declare("reference", choices=("reference", "xla"))   # backend of the softmax-based variants
  bos: bool = True                            # False: ablation beyond the paper, position 1 an ordinary token
  progress: bool = True                       # tqdm bars


def _shape(text) -> tuple[int, int]:
  """"LxH" -> (layers, heads); a StudyError otherwise."""
  try:
    layers, heads = (int(n) for n in str(text).lower().split("x"))
  except ValueError:
    layers = heads = 0
  if min(layers, heads) < 1:
    raise StudyError(f"axis shape: expected LAYERSxHEADS values like 1x1, 2x2, 4x4; got {text!r}")
  return layers, heads


def run_name(variant: str, layers: int, heads: int) -> str:
  return f"{variant}_{layers}x{heads}"


def _grid(plan: runner.Plan) -> list[tuple[str, int, int]]:
  """(variant, layers, heads) of every run, in the axes' order (shape outermost in the study files)."""
  for axis in set(plan.axes) - {"shape", "variant"}:
    raise StudyError(f"{plan.path}: the trigger study's axes are shape and variant, got {axis}")
  grid = []
  for run in plan.runs():
    variant = str(run.get("variant", "softmax"))
    if variant not in VARIANTS:
      raise StudyError(f"axis variant: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    grid.append((variant, *_shape(run.get("shape", "1x1"))))
  return grid


def _save_params(path, params) -> None:
  np.savez(path, **{f"{i}.{k}": np.asarray(v) for i, p in enumerate(params) for k, v in p.items()})


def _load_params(path) -> list[dict]:
  with np.load(path) as f:
    out: dict[int, dict] = {}
    for name in f.files:
      i, k = name.split(".")
      out.setdefault(int(i), {})[k] = jnp.asarray(f[name])
  return [out[i] for i in sorted(out)]


class _Data:
  """The study's fixed batches: evaluation, the figures' (trigger at position 8), and the held-out batch the "solved"
  rule is applied to (training batch size, keys no training run draws)."""

  def __init__(self, o: TriggerOptions):
    self.fig_trigger = min(7, o.seq_len - 1)                      # position 8 (1-indexed), as in [SinkNecessary]
    eval_key, fig_key = jax.random.split(jax.random.key(10_000 + o.seed))
    self.ev = make_batch(eval_key, o.eval_size, o.seq_len, o.dim, bos=o.bos)
    self.fig = make_batch(fig_key, o.eval_size, o.seq_len, o.dim, trigger_pos=self.fig_trigger, bos=o.bos)
    self.heldout = make_batch(jax.random.key(20_000 + o.seed), o.batch_size, o.seq_len, o.dim, bos=o.bos)


def train_and_evaluate(o: TriggerOptions, data: _Data, variant: str, layers: int, heads: int, run_dir, root) -> dict:
  """One model of the grid: trained (`train`), evaluated (`evaluate`, `solved_on_heldout`); its parameters saved in
  RUN_DIR/params.npz (the figures are drawn from them) and, for a deeper model, its per-head figure drawn."""
  from sinkjax import plots  # pylint: disable=import-outside-toplevel  # matplotlib: slow to import
  lr = o.lr_single if layers == 1 else o.lr_multi
  params, info = train(variant, layers, heads, lr=lr, max_steps=o.max_steps, seed=o.seed * 1000 + 17 * layers + heads,
                       batch=o.batch_size, seq_len=o.seq_len, dim=o.dim, stop_linf=o.stop_error, impl=o.impl,
                       progress=o.progress, bos=o.bos)
  rec = {"variant": variant, "layers": layers, "heads": heads, "bos_token": o.bos}
  rec.update(evaluate(params, variant, *data.ev, o.impl))
  rec.update({k: v for k, v in info.items() if k != "curve"})
  rec.update(solved_on_heldout(params, variant, *data.heldout[:2], o.stop_error, o.impl))
  rec["train_curve"] = info["curve"]
  _save_params(run_dir / "params.npz", params)
  if (layers, heads) != (1, 1):
    attn = np.asarray(forward_maps(params, data.fig[0], variant, o.impl)[1]["attn"])     # [L,N,H,T,T]
    plots.plot_attention_heads(attn[:, 0], f"{variant} attention, {layers} layers x {heads} heads, one test "
                               f"sequence, trigger at position {data.fig_trigger + 1}", o.seq_len,
                               root / f"attention_{variant}_{layers}L{heads}H.png")
  return rec


def report(o: TriggerOptions, grid, study: runner.Study, data: _Data | None = None) -> list[dict]:
  """results.json (the finished runs' records, in grid order), table.txt and the 1x1 models' mean / std attention
  figure ([SinkNecessary] Fig. 3, from their saved parameters)."""
  from sinkjax import plots  # pylint: disable=import-outside-toplevel
  names = [run_name(*g) for g in grid]
  records = list(study.records(names).values())
  runner.write_json(study.root / "results.json", records)
  single = [(v, n) for (v, L, H), n in zip(grid, names)
            if (L, H) == (1, 1) and (study.run_dir(n) / "params.npz").is_file()]
  if single:
    data = data or _Data(o)
    maps = {v: np.asarray(forward_maps(_load_params(study.run_dir(n) / "params.npz"), data.fig[0], v, o.impl)[1]
                          ["attn"])[0, :, 0] for v, n in single}
    plots.plot_attention_mean_std(maps, o.seq_len, data.fig_trigger, study.root / "attention_1L1H.png")
  table = format_table(records)
  table += (f"\n(conv: max error < {o.stop_error:g} on the training batch it stopped on; solved / max_err: on a "
            f"held-out batch of {o.batch_size})")
  if not o.bos:
    table += ("\n(trigger.bos false: there is no BOS token; the BOS columns are the attention on position 1, an "
              "ordinary token)")
  (study.root / "table.txt").write_text(table + "\n")
  print(table)
  return records


def run_plan(plan: runner.Plan, *, dry_run: bool = False, report_only: bool = False) -> None:
  """A driver-trigger study file, run (`sinkjax.experiments.study`): every model of shape x variant not yet trained
  (OUT/runs/VARIANT_LxH/record.json), then the report: OUT/results.json, table.txt and the figures."""
  o = plan.options({"trigger": TriggerOptions})["trigger"]
  if o.seq_len < 3 or o.dim < 4:
    raise StudyError(f"trigger.seq_len must be >= 3 (BOS, a token and a trigger) and trigger.dim >= 4 (3 indicator "
                     f"coordinates + content); got {o.seq_len} and {o.dim}")
  grid = _grid(plan)
  mirror = paths.Mirror(plan.study.out, "study.out")      # local, or gs:// / s3:// (uploaded after each model)
  study = runner.Study(mirror.local)
  if dry_run:
    print("\n".join(f"{run_name(*g)}: {study.state(run_name(*g))}" for g in grid))
    return
  data = None if report_only else _Data(o)
  t0 = time.perf_counter()

  def run(g):
    def do(run_dir):
      rec = train_and_evaluate(o, data, *g, run_dir, study.root)
      return {**rec, "options": dataclasses.asdict(o)}, "trained + evaluated"
    return runner.Run(run_name(*g), do)
  if not report_only:
    study.walk([run(g) for g in grid], lambda i, n, res: mirror.sync())
  report(o, grid, study, data)
  mirror.sync()
  print(f"\nwrote {plan.study.out.rstrip('/')}/results.json, table.txt and the figures "
        f"({time.perf_counter() - t0:.0f} s)")
