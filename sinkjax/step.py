"""The training step as pure functions of the train state (`sinkjax.train` jits them once, `sinkjax.compile` lowers
the same for a TPU slice): the loss of a batch (cross-entropy, whole or in position blocks, plus the sink-aware
load-balancing term), gradient accumulation inside one step, the optimizer update that leaves a non-finite step
out, and the evaluation step's BPB sums.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sinkjax import analysis, balance
from sinkjax.config import Config
from sinkjax.kernels import dense
from sinkjax.layers import pop_head_importance

TRAIN_FEATURES = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
EVAL_FEATURES = TRAIN_FEATURES + ("target_bytes",)



def token_losses(model, batch, chunk: int = 0):
  """(per-token NLL [B,T] float32, importance [L,H]) of a batch; chunk > 0 computes the logits `chunk` positions of
  every row at a time (`chunked_nll`)."""
  x = model.hidden(batch["inputs"], segment_ids=batch.get("segment_ids"), positions=batch["positions"])
  imp = pop_head_importance(model)
  T = x.shape[1]
  if chunk <= 0 or chunk >= T:
    return optax.softmax_cross_entropy_with_integer_labels(model.logits(x), batch["targets"]), imp
  return chunked_nll(model.logits, x, batch["targets"], chunk), imp


def chunked_nll(logits_fn, x, targets, chunk: int):
  """Cross-entropy [B,T] of logits_fn(x) against targets, `chunk` positions of every row at a time: a scan over
  position blocks whose body is rematerialized, so neither pass ever holds more than [B, chunk, vocab] float32
  logits (the backward recomputes a block's logits, then its gradient). Rows stay whole blocks of the batch axes'
  sharding. Exact: the same per-token values as the whole [B,T,V] computation (T padded up to a multiple of chunk;
  the padding's losses are dropped)."""
  B, T, _ = x.shape
  n = -(-T // chunk)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def block(_, xt):
    xb, tb = xt
    return None, optax.softmax_cross_entropy_with_integer_labels(logits_fn(xb), tb)

  _, nll = jax.lax.scan(block, None, (_blocks(x, n, chunk), _blocks(targets, n, chunk)))
  return nll.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]


def fused_ce_sum(model, x, targets, weights, chunk: int = 0):
  """sum(weights * cross-entropy) [] of model.logits(x) ([B,T,D] hidden) against targets [B,T], its gradient formed
  in the forward pass (train.loss_impl=fused): `chunk` positions of every row at a time (0: all at once), the block's
  logits, their softmax, and the logits' gradient weights * (softmax - one-hot) * the soft-cap's derivative, then the
  hidden's and the LM head's gradients from it (dh = dlogits W^T, dW = h^T dlogits, summed over the blocks). The
  backward only scales them by the loss's cotangent, so the LM head's logits matmul runs once a step, where
  `chunked_nll` under autodiff runs it again in the backward. Only the final norm stays with autodiff. The same
  values as model.logits and optax's cross-entropy (the same matmul in model.dtype, float32 from its output on)."""
  if model.lm_head is None:                             # tied: embed.attend(x) = x @ embedding^T
    w, dtype = model.embed.embedding[...].T, model.embed.dtype
  else:
    w, dtype = model.lm_head.kernel[...], model.lm_head.dtype
  h = model.final_norm(x)
  dtype = jnp.dtype(dtype or jnp.result_type(h, w))
  return _fused_ce(h, w, targets, weights, dtype, model.cfg.vocab_size, float(model.cfg.logit_softcap),
                   chunk if 0 < chunk < x.shape[1] else x.shape[1])


def _blocks(a, n: int, chunk: int):
  """[B, T, ...] -> [n, B, chunk, ...], T padded with zeros up to n * chunk."""
  pad = n * chunk - a.shape[1]
  a = jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
  return a.reshape(a.shape[0], n, chunk, *a.shape[2:]).swapaxes(0, 1)


def _fused_ce_pass(h, w, targets, weights, dtype, vocab, cap, chunk, grads: bool):
  """The blocks of `fused_ce_sum`: (loss sum, per-token NLL [B,T], dh [B,T,D], dW) with grads, else (sum, nll)."""
  B, T, _ = h.shape
  n = -(-T // chunk)
  head = lambda hb, w: dense.dot_general(hb.astype(dtype), w, (((2,), (0,)), ((), ())))
  wc = w.astype(dtype)           # once, not per block (a [D, V] conversion pass each; the blocks' dW sum in float32)

  def capped(logits):                                    # float32 logits, soft-capped: (z, tanh(z / cap) or None)
    z = logits.astype(jnp.float32)
    if cap > 0:
      t = jnp.tanh(z / cap)
      return cap * t, t
    return z, None

  def block(dw, xs):
    hb, tb, wb = xs
    logits, pullback = jax.vjp(head, hb, wc)               # [B, chunk, V padded] in dtype
    z, _ = capped(logits[..., :vocab])
    # capped logits lie in [-cap, cap]: exp(z - cap) neither overflows nor vanishes (>= e^-2cap)
    shift = jnp.float32(cap) if cap > 0 else jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    s = jnp.sum(jnp.exp(z - shift), axis=-1, keepdims=True)
    # The target's logit gathered, not summed out of a one-hot mask: then the pass above is the only one that reads
    # every logit before the gradient's. (An ignored position's target, outside [0, vocab), is clipped into it: its
    # weight is 0, and its one-hot below is empty.)
    picked = jnp.take_along_axis(logits, jnp.clip(tb, 0, vocab - 1)[..., None], axis=-1)
    nll = (shift + jnp.log(s) - capped(picked)[0])[..., 0]
    if not grads:
      return dw, nll
    # The gradient's pass reads the matmul's logits again and recomputes the soft cap and the exponentials from them:
    # left to itself XLA:GPU keeps the capped logits in float32 between the two passes (a [rows, V] float32 array
    # written and read back: twice the logits' bytes), where the barrier leaves it one more read of the logits.
    logits, s = jax.lax.optimization_barrier((logits, s))
    z, t = capped(logits[..., :vocab])
    hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, 2) == tb[..., None]
    dz = (jnp.exp(z - shift) / s - hit) * wb[..., None]
    if cap > 0:
      dz = dz * (1 - t * t)
    dz = jnp.pad(dz, ((0, 0), (0, 0), (0, logits.shape[-1] - vocab))).astype(logits.dtype)
    dh, dwb = pullback(dz)
    return dw + dwb.astype(jnp.float32), (nll, dh)

  xs = (_blocks(h, n, chunk), _blocks(targets, n, chunk), _blocks(weights.astype(jnp.float32), n, chunk))
  dw0 = jnp.zeros(w.shape, jnp.float32) if grads else None
  dw, out = jax.lax.scan(block, dw0, xs)
  unblock = lambda a: a.swapaxes(0, 1).reshape(B, n * chunk, *a.shape[3:])[:, :T]
  nll = unblock(out[0] if grads else out)
  total = jnp.sum(nll * weights)
  return (total, nll, unblock(out[1]), dw.astype(w.dtype)) if grads else (total, nll)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused_ce(h, w, targets, weights, dtype, vocab, cap, chunk):
  return _fused_ce_pass(h, w, targets, weights, dtype, vocab, cap, chunk, grads=False)[0]


def _fused_ce_fwd(h, w, targets, weights, dtype, vocab, cap, chunk):
  total, nll, dh, dw = _fused_ce_pass(h, w, targets, weights, dtype, vocab, cap, chunk, grads=True)
  return total, (nll, dh, dw)


def _fused_ce_bwd(dtype, vocab, cap, chunk, res, g):
  del dtype, vocab, cap, chunk
  nll, dh, dw = res
  return ((g * dh.astype(jnp.float32)).astype(dh.dtype), (g * dw).astype(dw.dtype), None,
          g * nll)


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def loss_fn(params, graphdef, rest, batch, total_weight, loss_cfg, shared, num_micro, chunk=0, impl="autodiff"):
  """One micro-batch's share of the step loss: CE summed over it / tokens of the whole step + aux / micro-batches.

  Summed over the micro-batches this is the masked mean CE over the global batch plus the mean aux loss. impl:
  train.loss_impl (autodiff: `token_losses`; fused: `fused_ce_sum`, the same values).
  """
  model = nnx.merge(graphdef, params, rest)
  if impl == "fused":
    x = model.hidden(batch["inputs"], segment_ids=batch.get("segment_ids"), positions=batch["positions"])
    imp = pop_head_importance(model)
    ce_sum = fused_ce_sum(model, x, batch["targets"], batch["loss_mask"], chunk)
  else:
    nll, imp = token_losses(model, batch, chunk)
    ce_sum = jnp.sum(nll * batch["loss_mask"])
  if loss_cfg.aux_term:            # at every weight, 0 included: lambda = 0 and lambda > 0 run one program
    aux = balance.aux_loss(imp, loss_cfg.aux_weight, loss_cfg.num_shared_heads, shared)
  else:
    aux = jnp.zeros((), jnp.float32)
  return ce_sum / total_weight + aux / num_micro, (ce_sum, aux, imp)


def _all_finite(tree):
  return jax.tree.reduce(lambda a, b: a & b, jax.tree.map(lambda x: jnp.isfinite(x).all(), tree), jnp.array(True))


def make_train_step(cfg: Config, graphdef, rest, tx: optax.GradientTransformation, shared=None):
  """train_step(state, batch, rest=None) -> (state, metrics); batch arrays are [global_batch, T].

  `state["params"]` holds the trained parameters (the LoRA adapters when lora.rank > 0); `rest` is the rest of the
  model (the frozen base weights with LoRA, empty otherwise). Pass it as the third argument so that jit sees it as
  an input rather than a constant baked into the program; None falls back to the `rest` given here.
  """
  default_rest = rest
  A = cfg.train.grad_accum
  one_segment = cfg.data.packing == "stream"
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def train_step(state, batch, rest=None):
    rest = default_rest if rest is None else rest
    if one_segment:      # data.packing=stream rows are one segment: attention without ids (no ids streamed on TPU)
      batch = {k: v for k, v in batch.items() if k != "segment_ids"}
    params = state["params"]
    total = jnp.maximum(batch["loss_mask"].sum(), 1.0)
    run = lambda mb: grad_fn(params, graphdef, rest, mb, total, cfg.loss, shared, A, cfg.train.loss_chunk,
                             cfg.train.loss_impl)
    if A == 1:
      (_, (ce_sum, aux, imp)), grads = run(batch)
    else:
      # [B, ...] -> [A, B/A, ...] taking every A-th row, so each micro-batch stays split over the batch axes.
      micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // A, A, *x.shape[1:]), 0, 1), batch)

      def body(acc, mb):
        (_, out), g = run(mb)
        return jax.tree.map(jnp.add, acc, (g, *out)), None

      L, H = len(cfg.model.head_layers), cfg.model.num_heads       # layers with heads (sinkjax.kinds)
      zero = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(()), jnp.zeros(()), jnp.zeros((L, H)))
      (grads, ce_sum, aux, imp), _ = jax.lax.scan(body, zero, micro)
      aux, imp = aux / A, imp / A
    ce = ce_sum / total
    loss = ce + aux
    grad_norm = optax.global_norm(grads)
    with jax.named_scope("optimizer"):     # what sinkjax.bench.profile_summary counts as the optimizer
      updates, opt_state = tx.update(grads, state["opt_state"], params)
      new_params = optax.apply_updates(params, updates)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite(new_params)
    keep_if_ok = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    new_state = {
        "params": keep_if_ok(new_params, params),
        "opt_state": keep_if_ok(opt_state, state["opt_state"]),
        "step": state["step"] + 1,
        "rng": state["rng"],        # the run's base key; nothing in the step draws from it (kept for checkpoints)
        "nonfinite": jnp.where(ok, 0, state["nonfinite"] + 1),
    }
    metrics = {"loss": loss, "ce_loss": ce, "aux_loss": aux, "importance": imp,
               "head_imbalance": balance.head_imbalance(imp), "grad_norm": grad_norm,
               "finite": ok, "nonfinite": new_state["nonfinite"]}
    return new_state, metrics

  return train_step


def make_eval_step(graphdef, rest, chunk: int = 0):
  """eval_step(params, batch, rest=None) -> (sum of NLL in nats, sum of target bytes) over the batch's loss-mask
  targets with bytes (BPB = nats / ln 2 / bytes, nanochat's rule: `analysis.nll_sums`; `rest` as in
  `make_train_step`)."""
  default_rest = rest

  def eval_step(params, batch, rest=None):
    nll, _ = token_losses(nnx.merge(graphdef, params, default_rest if rest is None else rest), batch, chunk)
    sums = analysis.nll_sums(nll, batch)
    return sums["bpb_nll"], sums["bytes"]
  return eval_step
