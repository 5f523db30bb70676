"""The decoder-only language model of the paper's baseline (nanochat-style GPT, [Sink-MoE] Table 1).

Pre-norm blocks with parameter-free RMSNorm, RoPE, QK-norm, ReLU^2 MLP (4x), untied embeddings, no biases,
logit soft-cap, GQA option; the attention variant comes from `sinkjax.layers.Attention`. Model code knows nothing
about training: the loss, the aux loss and the optimizer live in `sinkjax.train`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from sinkjax import choices, kinds
from sinkjax.config import ModelConfig
from sinkjax.kinds import attention_layer, linear  # noqa: F401  (the built-in mixers its layers are built from register)
from sinkjax.kernels import dense
from sinkjax.layers import MLP, Attention, MoE, RMSNorm, default_positions, named_signature, pop_head_importance
from sinkjax.sharding import logical, target_platform

# model.remat_policy: what a rematerialized layer keeps from its forward pass for the backward (everything else is
# recomputed), by the names it saves (`checkpoint_name`: the attention kernel's outputs "attention_out" and
# "attention_lse" in sinkjax.kernels.flash, the projections "q_proj", "k_proj", "v_proj" in sinkjax.layers, the attention
# sublayer's output "out_proj" in Block) and whether it also saves the weight matmuls' results (dots).
#   nothing        only the layer's input (least memory; the whole forward, attention kernel included, runs again)
#   dots           the weight matmuls' results (MaxText's `minimal`); the attention kernel's forward runs again
#   save_qkv_proj  the q, k, v projections' outputs ("q_proj", "k_proj", "v_proj" in sinkjax.layers, before QK-norm
#                  and RoPE; MaxText's save_qkv_proj); the rest of the forward runs again, the attention kernel too
#   save_out_proj  the attention sublayer's output (MaxText's save_out_proj)
#   save_attention dots and the kernel's outputs (out, LSE; MaxText's minimal_flash): nothing but elementwise
#                  work is recomputed (most memory)
# offload_<policy> (dots, qkv_proj, out_proj, attention): the same values moved to host memory and back instead of
# kept in HBM (`jax.checkpoint_policies` offload policies; TPU and GPU only).
_POLICY_NAMES = {"nothing": (False, ()), "dots": (True, ()),
                 "save_qkv_proj": (False, ("q_proj", "k_proj", "v_proj")),
                 "save_out_proj": (False, ("out_proj",)),
                 "save_attention": (True, ("attention_out", "attention_lse"))}


def _remat_policy(name: str):
  """The jax.checkpoint policy of model.remat_policy `name` (see the table above), for the program being traced."""
  offload = name.startswith("offload_")
  kept = name.removeprefix("offload_")
  kept = kept if kept in _POLICY_NAMES else "save_" + kept          # offload_qkv_proj keeps what save_qkv_proj keeps
  dots, names = _POLICY_NAMES[kept]
  cp = jax.checkpoint_policies
  if not offload:
    if dots and names:
      return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names(*names))
    return cp.dots_with_no_batch_dims_saveable if dots else cp.save_only_these_names(*names) if names else \
        cp.nothing_saveable
  if target_platform() == "cpu":
    raise ValueError(f"model.remat_policy={name} offloads to host memory, and a program compiled for the CPU has no "
                     f"device memory to relieve: use model.remat_policy={kept} (offload needs a TPU or GPU target)")
  to_host = dict(offload_src="device", offload_dst="pinned_host")
  named = cp.save_and_offload_only_these_names(names_which_can_be_saved=(), names_which_can_be_offloaded=names,
                                                 **to_host)
  if not dots:
    return named
  dot = cp.offload_dot_with_no_batch_dims(**to_host)
  return lambda prim, *args, **params: dot(prim, *args, **params) if prim is jax.lax.dot_general_p else \
      named(prim, *args, **params)


REMAT_POLICIES = {name: functools.partial(_remat_policy, name) for name in choices.REMAT_POLICIES}


@named_signature
class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)). The attention is built from the config's
  attention section for layer `layer` (its sliding window follows model.layer_types)."""

  def __init__(self, cfg: ModelConfig, *, layer: int = 0, rngs: nnx.Rngs):
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)     # names the config has checked
    norm = dict(eps=cfg.norm_eps, use_scale=cfg.norm_scale, param_dtype=pdt)
    self.attn_norm = RMSNorm(cfg.d_model, **norm)
    self.attn = kinds.mixer_of(cfg, layer).build(cfg, layer, rngs)     # the layer's kind (model.layer_types)
    self.mlp_norm = RMSNorm(cfg.d_model, **norm)
    mlp = dict(kind=cfg.mlp, use_bias=cfg.mlp_bias, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha, dtype=dt,
               param_dtype=pdt, rngs=rngs)
    self.mlp = MoE(cfg.d_model, cfg.mlp_width, cfg.moe_experts, cfg.moe_top_k, router=cfg.moe_router,
                   shared_hidden=cfg.moe_shared_hidden, **mlp) if cfg.moe_experts else MLP(cfg.d_model, cfg.mlp_width, init=cfg.init, **mlp)

  def __call__(self, x, segment_ids, positions, cache=None, record_trace: bool = False, zero_first_token_value=None):
    """x -> x; with a `LayerCache`, (x, updated cache). record_trace / zero_first_token_value: see `Attention.__call__`; with
    record_trace the block also sows its output as `hidden`."""
    h = self.attn(self.attn_norm(x), segment_ids=segment_ids, positions=positions, cache=cache, record_trace=record_trace,
                  zero_first_token_value=zero_first_token_value)
    h, cache = h if cache is not None else (h, None)
    x = x + checkpoint_name(h, "out_proj")         # a name for model.remat_policy=save_out_proj
    x = x + self.mlp(self.mlp_norm(x))
    if record_trace:
      self.sow(nnx.Intermediate, "hidden", x, reduce_fn=lambda _, new: new, init_fn=lambda: None)
    return x if cache is None else (x, cache)


def padded_vocab(cfg: ModelConfig) -> int:
  """Rows of the embedding / LM head: vocab_size rounded up to a multiple of model.vocab_pad_to (nanochat: 64)."""
  return -(-cfg.vocab_size // cfg.vocab_pad_to) * cfg.vocab_pad_to


@named_signature
class Transformer(nnx.Module):
  """The decoder LM: tokens [B,T] int -> logits [B,T,vocab_size] (float32, soft-capped), causal.

  `Transformer(cfg, rngs=nnx.Rngs(0))` with `cfg` a `sinkjax.config.ModelConfig`: its keys are the model.* keys of a
  training config (docs/TRAINING.md), e.g. `ModelConfig(attention="gated", num_layers=2, d_model=64, num_heads=4,
  num_kv_heads=4, head_dim=16, vocab_size=257, dtype="float32")`; model.vocab_size must be set. Each layer is built
  from it (`kinds.mixer_of`: an `Attention.from_config` for "full" / "sliding" layers), and records its head
  importance: `forward_with_importance(model, tokens)` -> (logits, [L, H]), or `pop_head_importance(model)` after a
  call. `__call__(tokens, *, segment_ids=None, positions=None)`: packed documents and RoPE positions as `Attention`
  takes them. A trained one comes back from `sinkjax.run.load_run`.

  nanochat options (configs/nanochat.yaml, `sinkjax.convert.nanochat`): model.vocab_pad_to pads the embedding and
  LM head rows (logits are sliced back to vocab_size before the soft-cap); model.init=nanochat draws the LM head from
  N(0, 0.001) instead of zeros; model.residual_scalars adds the per-layer `resid_lambdas` (init 1) and `x0_lambdas`
  (init 0) of nanochat's later GPT: block i sees resid_lambdas[i] * x + x0_lambdas[i] * x0, x0 the normed embedding.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if cfg.vocab_size < 1:
      raise ValueError("model.vocab_size must be set (the trainer fills it from the tokenizer)")
    self.cfg = cfg
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)     # names the config has checked
    vocab = padded_vocab(cfg)
    self.embed = nnx.Embed(vocab, cfg.d_model, dtype=dt, param_dtype=pdt, embedding_init=nnx.initializers.normal(1.0),
                           embedding_metadata=logical("vocab", "embed"), rngs=rngs)
    self.layers = nnx.List([Block(cfg, layer=i, rngs=rngs) for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, use_scale=cfg.norm_scale, param_dtype=pdt)
    head_init = nnx.initializers.normal(0.001) if cfg.init == "nanochat" else nnx.initializers.zeros_init()
    self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.d_model, vocab, use_bias=False, dtype=dt, param_dtype=pdt, kernel_init=head_init,
        dot_general=dense.dot_general,
        kernel_metadata=logical("embed", "vocab"), rngs=rngs)
    L = cfg.num_layers
    self.resid_lambdas = nnx.Param(jnp.ones((L,), pdt)) if cfg.residual_scalars else None
    self.x0_lambdas = nnx.Param(jnp.zeros((L,), pdt)) if cfg.residual_scalars else None

  def embed_tokens(self, tokens):
    """The residual stream's start x0 [B,T,d_model] (the normed embedding where model.embed_norm, as nanochat).
    The rows are gathered from the table in its own dtype (model.param_dtype) and cast to model.dtype after, not
    cast then gathered as nnx.Embed does: the same values, but the gradient's scatter-add of the B*T rows into the
    table then accumulates in float32. In bfloat16 it was both lossy (a common token's thousands of rows summed
    at 8 bits) and, on a GPU, slow: XLA's bf16 scatter-add on an H100 took 101 of a 127 ms step of
    configs/streaming_vanilla.yaml, and it drew the trainer's step 50 ms apart from bench.train's (docs/journal.md)."""
    table = self.embed.embedding[...]
    x = jnp.take(table, tokens, axis=0).astype(self.embed.dtype or table.dtype)
    return _norm(x, self.cfg.norm_eps) if self.cfg.embed_norm else x

  def block_input(self, i: int, x, x0):
    """What block i reads: x itself, or resid_lambdas[i] * x + x0_lambdas[i] * x0 with model.residual_scalars."""
    if self.resid_lambdas is None:
      return x
    r, a = (p[...][i].astype(x.dtype) for p in (self.resid_lambdas, self.x0_lambdas))
    return r * x + a * x0

  def __call__(self, tokens, *, segment_ids=None, positions=None, cache=None, record_trace: bool = False,
               zero_first_token_value=None):
    """logits; with a `sinkjax.cache.KVCache`, (logits, updated cache): T == 1 decodes one token against the cache,
    T > 1 prefills an EMPTY cache with a prompt (positions 0..T-1). Generation lives in `sinkjax.generate`.
    record_trace / zero_first_token_value ([L, Hq] bool, L the layers with heads): for `sinkjax.analysis`, see
    `Attention.__call__`."""
    if cache is not None:
      B, T = tokens.shape
      positions = default_positions(segment_ids, B, T) if positions is None else positions
      x = x0 = self.embed_tokens(tokens)
      layer_caches = cache.layers(T)
      for i, block in enumerate(self.layers):
        # Block i's weights wait for its input (an optimization barrier): the compiler cannot fetch every layer's
        # weights ahead (under FSDP, gather them: GPT-OSS's decode on a v5e slice held many layers' experts at once).
        graphdef, state = nnx.split(block)
        h, state = jax.lax.optimization_barrier((self.block_input(i, x, x0), state))
        x, layer_caches[i] = nnx.merge(graphdef, state)(h, segment_ids, positions, cache=layer_caches[i])
      return self.logits(x), cache.advance(layer_caches, T)
    return self.logits(self.hidden(tokens, segment_ids=segment_ids, positions=positions, record_trace=record_trace,
                                   zero_first_token_value=zero_first_token_value))

  def hidden(self, tokens, *, segment_ids=None, positions=None, record_trace: bool = False, zero_first_token_value=None):
    """The residual stream after the last block [B,T,d_model] (`logits` turns it into logits). Training runs the
    blocks as model.remat / model.scan_layers say; record_trace / zero_first_token_value always run them one by one."""
    B, T = tokens.shape
    if positions is None:
      positions = default_positions(segment_ids, B, T)
    x = x0 = self.embed_tokens(tokens)
    period = self._block_period() if self.cfg.scan_layers else 0
    if record_trace or zero_first_token_value is not None:
      row = {layer: j for j, layer in enumerate(self.cfg.head_layers)}     # zero_first_token_value: [layers with heads]
      zero = [None if zero_first_token_value is None or i not in row else zero_first_token_value[row[i]]
              for i in range(len(self.layers))]
      if period:
        return self._scanned_blocks(x, x0, segment_ids, positions, period, record_trace=record_trace, zero=zero)
      for i, block in enumerate(self.layers):
        x = block(self.block_input(i, x, x0), segment_ids, positions, record_trace=record_trace, zero_first_token_value=zero[i])
      return x
    if period:
      return self._scanned_blocks(x, x0, segment_ids, positions, period)
    if not self.cfg.remat:
      for i, block in enumerate(self.layers):
        x = block(self.block_input(i, x, x0), segment_ids, positions)
      return x
    imps = []
    for i, block in enumerate(self.layers):
      x, imp = self._layer_fn(nnx.graphdef(block), x0, segment_ids, positions, self._has_heads(i))(
          x, (nnx.state(block), i))
      imps.append(imp)
    return self._sow_importances(x, imps)

  def _has_heads(self, i: int) -> bool:
    """Whether layer i's mixer records head importance (`sinkjax.kinds`: attention yes, linear attention no)."""
    return kinds.mixer_of(self.cfg, i).heads

  def _layer_fn(self, graphdef, x0, segment_ids, positions, heads: bool = True, record_trace: bool = False):
    """(h, (block state, i[, zero_first_token_value row])) -> (block i's output, its head importance [H], or [0] for a
    layer without heads): one layer as a pure function of its parameters, rematerialized with model.remat
    (jax.checkpoint with model.remat_policy). Pure, so it composes with lax.scan and with LoRA's split parameters
    (nnx.remat on the module would write back into them). With `record_trace` (for sinkjax.analysis; never rematerialized)
    the importance comes with what the block sowed: (importance, its attention's trace or None, its hidden)."""
    def layer(h, args):
      state, i, *zero = args
      block = nnx.merge(graphdef, state)
      h = block(self.block_input(i, h, x0), segment_ids, positions, record_trace=record_trace,
                zero_first_token_value=zero[0] if zero else None)
      imp = pop_head_importance(block)[0] if heads else jnp.zeros((0,), jnp.float32)
      if not record_trace:
        return h, imp
      trace = block.attn.trace.get_value() if hasattr(block.attn, "trace") else None
      return h, (imp, trace, block.hidden.get_value())
    if record_trace:
      return layer
    if self.cfg.remat:
      return jax.checkpoint(layer, policy=REMAT_POLICIES[self.cfg.remat_policy](), prevent_cse=False)
    return layer

  def _sow_importances(self, x, imps):
    """Records each layer's importance on its own Attention (what `pop_head_importance` reads); returns x. Layers
    without heads (their entries are [0]) record nothing."""
    for i, (block, imp) in enumerate(zip(self.layers, imps)):
      if not self._has_heads(i):
        continue
      block.attn.sow(nnx.Intermediate, "head_importance", imp, reduce_fn=lambda _, new: new, init_fn=lambda: None)
    return x

  def _block_period(self) -> int:
    """The smallest p such that block i has the structure of block i mod p (1: all alike; 2: GPT-OSS's alternating
    sliding / full layers), or 0 when no p < L divides the stack into repeats."""
    defs = [nnx.graphdef(b) for b in self.layers]
    L = len(defs)
    for p in range(1, L // 2 + 1):
      if L % p == 0 and all(defs[i] == defs[i % p] for i in range(p, L)):
        return p
    return 0

  def _scanned_blocks(self, x, x0, segment_ids, positions, period: int = 1, *, record_trace: bool = False, zero=None):
    """The blocks as one `lax.scan` over their stacked parameters (MaxText's scan_layers), `period` blocks of
    different structure per step (the repeating group): the compiler sees one group, so its FSDP gathers and (with
    model.remat) its saved activations live one group at a time, and compile time does not grow with depth.
    Parameters stay one module per layer (checkpoints are unchanged); the stack is built inside the step. Each
    layer's head importance is sown back on its own Attention afterwards. For sinkjax.analysis, `record_trace` and `zero`
    (per layer: a zero_first_token_value row [Hq] or None) run the same scan, and each layer's trace and hidden state are
    sown back on it as the unscanned blocks sow them."""
    groups = len(self.layers) // period
    stacked = [jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in self.layers[j::period]])
               for j in range(period)]
    layers = [self._layer_fn(nnx.graphdef(self.layers[j]), x0, segment_ids, positions, self._has_heads(j),
                             record_trace=record_trace) for j in range(period)]
    zeros = [None if zero is None or zero[j] is None else jnp.stack(zero[j::period]) for j in range(period)]

    def body(h, args):
      states, g, zs = args
      outs = []
      for j, (layer, state) in enumerate(zip(layers, states)):
        h, out = layer(h, (state, g * period + j) + (() if zs[j] is None else (zs[j],)))
        outs.append(out)
      return h, tuple(outs)     # per group position j: importance [H] ([0] without heads), with record_trace its sowings

    x, outs = jax.lax.scan(body, x, (stacked, jnp.arange(groups), zeros))
    per_layer = [jax.tree.map(lambda a, i=i: a[i // period], outs[i % period]) for i in range(len(self.layers))]
    if not record_trace:
      return self._sow_importances(x, per_layer)
    keep_last = dict(reduce_fn=lambda _, new: new, init_fn=lambda: None)
    for block, (_, trace, hidden) in zip(self.layers, per_layer):
      if trace is not None:
        block.attn.sow(nnx.Intermediate, "trace", trace, **keep_last)
      block.sow(nnx.Intermediate, "hidden", hidden, **keep_last)
    return self._sow_importances(x, [imp for imp, _, _ in per_layer])

  def logits(self, x):
    """Final norm, LM head (vocabulary padding sliced off), float32, soft-cap."""
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    logits = logits[..., :self.cfg.vocab_size].astype(jnp.float32)
    cap = self.cfg.logit_softcap
    return cap * jnp.tanh(logits / cap) if cap > 0 else logits


def _norm(x, eps=1e-6):
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype)


def forward_with_importance(model: Transformer, tokens, *, segment_ids=None, positions=None):
  """(logits, importance [L,H]) in one call; the importances are popped so the model stays clean."""
  logits = model(tokens, segment_ids=segment_ids, positions=positions)
  return logits, pop_head_importance(model)


def count_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
