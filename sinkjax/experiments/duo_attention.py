"""DuoAttention's head identification (Xiao et al. 2024, arXiv:2410.10819, cited by [Sink-MoE]) on an imported model: a
gate alpha in [0, 1] per KV head mixes the head's full attention with its streaming attention (sinks + window), the
model frozen, and the gates are optimised on synthetic passkey retrieval so that the gated model's last hidden states
match the all-full model's (distillation) while an L1 penalty pushes the gates to 0; the heads with the highest gates
keep a full cache.

    python -m sinkjax.experiments.duo_attention --checkpoint RUN --out DIR [--steps 60] [--seq-len 384]
        [--window 256] [--sinks 4] [--full-heads 0.25] [--l1 0.05] [--lr 0.05] [--seed 0]

The data: `seq_len` tokens of a haystack (the standard-library prose docstrings that the far-context ranking is
calibrated on, `streaming_real.calibration_text`, from a random offset per sample; none of the scored texts) with a
passkey sentence (`sinkjax.data.passkey.NEEDLE`, a random 5-digit key) at a random depth in the first `--depth` of the
text, then the question and the key (`passkey.QUESTION`); the distillation loss is the mean squared difference of the
final hidden states (after the last block, before the final norm) over the last `--answer` positions (the question and
the key, which need the far needle), as DuoAttention distils over the passkey tokens. Loss = distillation + l1 *
sum(alpha) (the paper's L1 over every gate); Adam on alpha only (initialised at 1, clipped to [0, 1] after each step,
as the paper does). The attention is `sinkjax.experiments.head_masks.gated_attention` (exactly the hybrid cache at
alpha 0 / 1).

Writes DIR/duo_gates.json (alpha [L][Hkv], the loss per step, the options, the commit) and DIR/duo_map.json (the
[L][Hkv] 0/1 map: per layer the round(full_heads * Hkv) KV heads of highest alpha, ties to the lower index, the
`cache_policy.top_heads` rule), the `--full-heads-from` format.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import sys
import time

import numpy as np

from sinkjax import options
from sinkjax.config import declare


@dataclasses.dataclass
class DuoOptions:
  """The options of `python -m sinkjax.experiments.duo_attention` (each flag the alias of its key)."""
  checkpoint: str = declare("", alias="--checkpoint", metavar="RUN", required=True, help="an imported model's run dir")
  out: str = declare("", alias="--out", metavar="DIR", required=True, help="where duo_gates.json / duo_map.json go")
  steps: int = declare(60, ">=1", alias="--steps", help="optimisation steps (one sample each)")
  seq_len: int = declare(384, ">=2", alias="--seq-len", help="tokens per sample")
  answer: int = declare(24, ">=1", alias="--answer", help="last positions distilled (question and key)")
  depth: float = declare(0.25, "(0,1]", alias="--depth", help="the needle lies in this first fraction of the text")
  window: int = declare(256, ">=2", alias="--window", help="W: a streaming head's slots, sinks included")
  sinks: int = declare(4, ">=0", alias="--sinks", help="S")
  full_heads: float = declare(0.25, "(0,1)", alias="--full-heads", help="fraction of each layer's KV heads kept full")
  l1: float = declare(0.05, ">=0", alias="--l1", help="weight of the L1 penalty on the gates")
  lr: float = declare(0.05, ">0", alias="--lr", help="Adam's learning rate")
  seed: int = declare(0, alias="--seed", help="the samples' seed")


def gate_map(alpha, amount: float) -> np.ndarray:
  """[L, Hkv] bool: per layer the round(amount * Hkv) KV heads with the highest gate (ties: lower index)."""
  from sinkjax import cache_policy  # pylint: disable=import-outside-toplevel
  return cache_policy.top_heads(np.asarray(alpha, np.float64), amount, "layer")


def samples(tok, haystack: str, opts: DuoOptions):
  """An endless stream of token arrays [seq_len] (see the module docstring), seeded by opts.seed."""
  from sinkjax.data import passkey  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(opts.seed)
  hay = np.asarray(tok.encode_document(haystack), np.int32)
  while True:
    key = passkey.random_key(rng)
    needle = np.asarray(tok.encode_document(" " + passkey.NEEDLE.format(key=key)), np.int32)
    tail = np.asarray(tok.encode_document(" " + passkey.QUESTION + key + "."), np.int32)
    body = opts.seq_len - len(needle) - len(tail)
    if body < 2 or len(hay) < body:
      raise ValueError(f"--seq-len {opts.seq_len} leaves no room for the haystack around the needle and question")
    start = int(rng.integers(0, len(hay) - body))
    at = int(rng.integers(1, max(2, int(opts.depth * body))))
    chunk = hay[start:start + body]
    yield np.concatenate([chunk[:at], needle, chunk[at:], tail])


def optimise(model, batches, opts: DuoOptions, log=None) -> tuple[np.ndarray, list[float]]:
  """The gates alpha [L, Hkv] after opts.steps Adam steps on `batches` (token arrays), and the loss per step."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from sinkjax.experiments import head_masks  # pylint: disable=import-outside-toplevel
  head_masks.check_model(model.cfg)
  L, H = model.cfg.num_layers, model.cfg.num_kv_heads
  graphdef, state = nnx.split(model)
  kw = dict(sink_size=opts.sinks, window=opts.window)

  def hidden(state, tokens, gates):
    m = nnx.merge(graphdef, state)
    return head_masks.hidden_with(m, tokens, gates, head_masks.gated_attention, **kw)[0][:, -opts.answer:]

  @jax.jit
  def teacher(state, tokens):
    return hidden(state, tokens, jnp.ones((L, H), jnp.float32))

  def loss_fn(alpha, state, tokens, target):
    h = hidden(state, tokens, alpha)
    distil = jnp.mean(jnp.square(h.astype(jnp.float32) - target))
    return distil + opts.l1 * jnp.sum(alpha), distil

  tx = optax.adam(opts.lr)

  @jax.jit
  def step(alpha, opt_state, state, tokens):
    target = jax.lax.stop_gradient(teacher(state, tokens))
    (loss, distil), g = jax.value_and_grad(loss_fn, has_aux=True)(alpha, state, tokens, target)
    updates, opt_state = tx.update(g, opt_state, alpha)
    alpha = jnp.clip(optax.apply_updates(alpha, updates), 0.0, 1.0)
    return alpha, opt_state, loss, distil

  alpha = jnp.ones((L, H), jnp.float32)
  opt_state = tx.init(alpha)
  losses = []
  for i in range(opts.steps):
    tokens = jnp.asarray(next(batches), jnp.int32)[None]
    t0 = time.perf_counter()
    alpha, opt_state, loss, distil = step(alpha, opt_state, state, tokens)
    losses.append(float(loss))
    if log:
      log(f"step {i + 1}/{opts.steps}: loss {float(loss):.5f} (distillation {float(distil):.5f}), mean gate "
          f"{float(alpha.mean()):.3f}, {time.perf_counter() - t0:.1f} s")
  return np.asarray(alpha, np.float64), losses


COMMAND = options.Command(prog="python -m sinkjax.experiments.duo_attention", description=__doc__.split("\n\n")[0],
                          sections={"duo": DuoOptions})


def identify(opts: DuoOptions) -> None:
  """Optimises the gates and writes duo_gates.json and duo_map.json (see the module docstring)."""
  from sinkjax.experiments import runner, streaming_real  # pylint: disable=import-outside-toplevel
  from sinkjax.run import load_run  # pylint: disable=import-outside-toplevel
  logging.getLogger("absl").setLevel(logging.ERROR)
  out = pathlib.Path(opts.out)
  model, _, tok, _ = load_run(opts.checkpoint, overrides=["model.dtype=float32"])
  log = lambda s: print(f"[duo_attention] {s}", file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  alpha, losses = optimise(model, samples(tok, streaming_real.calibration_text(), opts), opts, log)
  full = gate_map(alpha, opts.full_heads)
  rec = {"alpha": alpha.round(6).tolist(), "loss": [round(x, 6) for x in losses], "options": dataclasses.asdict(opts),
         "seconds": round(time.perf_counter() - t0, 1), "python": sys.version.split()[0],
         "haystack": "stdlib docstrings (streaming_real.calibration_text), a random offset per sample",
         **runner.git_commit()}
  runner.write_json(out / "duo_gates.json", rec)
  runner.write_json(out / "duo_map.json", full.astype(int).tolist())
  log(f"{out / 'duo_map.json'}: {int(full.sum())} full KV heads; gates per layer "
      f"{np.round(alpha, 2).tolist()}")


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, _: identify(sections["duo"]))


if __name__ == "__main__":
  sys.exit(main())
