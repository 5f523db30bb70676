"""Benchmark of the training step: the cost of the sink-aware aux loss, throughput, and a PyTorch peer.

    python -m sinkjax.bench.train [--config configs/tiny.yaml] [--layers 4 --d-model 128 --heads 4 --head-dim 32]
                                  [--seq 256 --batch 16] [--dtype float32] [--repeats 10] [--no-torch]

For each attention variant the full jitted train step (forward, backward through the LSE, optimizer) is timed with
loss.aux_weight = 0 (the aux term is not even traced) and 1e-4 (eq. 7). The two are timed interleaved, step by
step, and compared by their medians (wall time, and this process' CPU time, which a busy machine disturbs less), so
drifts in machine load hit both alike. The paper claims < 2 % overhead.

Throughput: tokens/s and achieved FLOP/s with nanochat's estimate, 6 * (params - embedding) + 12 * L * H * D * T
per token (matmuls forward and backward; attention counted in full, not halved for causality), also as a fraction of
this machine's own float32 matmul rate (a 2048 x 2048 jnp matmul, timed the same way).

Peer: a Hugging Face `LlamaForCausalLM` of equal layers, width, heads, head_dim, vocabulary, sequence length and
batch (SwiGLU hidden size 8/3 * width, so its parameter count matches our ReLU^2 4x MLP), trained with
torch.optim.AdamW in float32 on CPU; sinkjax is also timed with train.optimizer=adamw for a like-for-like row.
Needs `pip install torch transformers` (skipped with a note when missing).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax import optim
from sinkjax.config import load_config
from sinkjax.model import Transformer, count_params
from sinkjax.train import make_train_step

VOCAB = 257   # the byte tokenizer


def flops_per_token(num_params: int, cfg) -> float:
  m = cfg.model
  embedding = m.vocab_size * m.d_model            # a gather, no matmul (the unembedding is a matmul: counted)
  return 6 * (num_params - embedding) + 12 * m.num_layers * m.num_heads * m.head_dim * cfg.data.seq_len


def matmul_flops_per_s(n: int = 2048, dtype=jnp.float32, repeats: int = 10) -> float:
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  f = jax.jit(lambda x, y: x @ y)
  jax.block_until_ready(f(a, a))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(a, a))
    times.append(time.perf_counter() - t0)
  return 2 * n ** 3 / statistics.median(times)


def random_batch(B: int, T: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {"inputs": rng.integers(0, 256, (B, T), dtype=np.int32),
          "targets": rng.integers(0, 256, (B, T), dtype=np.int32),
          "segment_ids": np.ones((B, T), np.int32),
          "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
          "loss_mask": np.ones((B, T), np.float32)}


def build_step(cfg):
  """(jitted step, initial state, parameter count) for a config."""
  model = Transformer(cfg.model, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx, _ = optim.build_optimizer(cfg, 1000)
  state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
           "rng": jax.random.PRNGKey(0), "nonfinite": jnp.zeros((), jnp.int32)}
  return jax.jit(make_train_step(cfg, graphdef, rest, tx)), state, count_params(model)


def time_interleaved(runs: dict, batch, repeats: int, warmup: int = 2) -> dict:
  """{name: (median wall s, median process-CPU s)} per step, the runs timed alternately step by step."""
  states = {}
  for name, (step, state) in runs.items():
    for _ in range(warmup):
      state, m = step(state, batch)
    jax.block_until_ready(m)
    states[name] = state
  wall = {n: [] for n in runs}
  cpu = {n: [] for n in runs}
  for _ in range(repeats):
    for name, (step, _) in runs.items():
      t0, c0 = time.perf_counter(), time.process_time()
      states[name], m = step(states[name], batch)
      jax.block_until_ready(m)
      wall[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in runs}


def torch_peer(cfg, repeats: int, warmup: int = 2):
  """(median s per step, params) of HF LlamaForCausalLM trained with AdamW, or (None, reason)."""
  try:
    import torch
    import transformers
  except ImportError as e:
    return None, f"not run ({e.name} is not installed: pip install torch transformers)"
  m = cfg.model
  torch.manual_seed(0)
  lcfg = transformers.LlamaConfig(
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=int(round(8 * m.d_model / 3)),
      num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
      head_dim=m.head_dim, max_position_embeddings=cfg.data.seq_len, tie_word_embeddings=False)
  lcfg._attn_implementation = "sdpa"
  model = transformers.LlamaForCausalLM(lcfg).float().train()
  opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95))
  b = random_batch(cfg.train.batch_size, cfg.data.seq_len)
  x, y = torch.from_numpy(b["inputs"]).long(), torch.from_numpy(b["targets"]).long()

  def step():
    logits = model(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()

  for _ in range(warmup):
    step()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
  params = sum(p.numel() for p in model.parameters())
  return (statistics.median(times), params), f"torch {torch.__version__}, transformers {transformers.__version__}, " \
      f"{torch.get_num_threads()} threads"


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m sinkjax.bench.train", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/tiny.yaml", help="shapes and recipe to start from")
  p.add_argument("--layers", type=int)
  p.add_argument("--d-model", type=int)
  p.add_argument("--heads", type=int)
  p.add_argument("--head-dim", type=int)
  p.add_argument("--seq", type=int)
  p.add_argument("--batch", type=int)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
  p.add_argument("--variants", nargs="+", default=["vanilla", "sink", "gated"])
  p.add_argument("--repeats", type=int, default=10, help="timed steps per configuration")
  p.add_argument("--no-torch", action="store_true", help="skip the PyTorch / transformers peer")
  args = p.parse_args(argv)

  ov = [f"model.dtype={args.dtype}", f"model.vocab_size={VOCAB}", "train.grad_accum=1"]
  for key, val in (("model.num_layers", args.layers), ("model.d_model", args.d_model),
                   ("model.num_heads", args.heads), ("model.num_kv_heads", args.heads),
                   ("model.head_dim", args.head_dim), ("data.seq_len", args.seq), ("model.max_seq_len", args.seq),
                   ("train.batch_size", args.batch)):
    if val is not None:
      ov.append(f"{key}={val}")
  base = load_config(args.config, ov)
  m = base.model
  B, T = base.train.batch_size, base.data.seq_len
  tokens = B * T
  peak = matmul_flops_per_s()
  print(f"shape: {m.num_layers} layers x {m.num_heads} heads x {m.head_dim} head_dim, width {m.d_model}, vocab "
        f"{m.vocab_size}, seq {T}, batch {B} ({tokens} tokens/step), compute {args.dtype}; "
        f"{jax.device_count()} {jax.default_backend()} device(s); f32 2048^2 matmul: {peak / 1e9:.1f} GFLOP/s")
  batch = random_batch(B, T)

  print("\n| variant | optimizer | params | step, aux off (ms) | step, aux on (ms) | aux overhead (wall) | "
        "aux overhead (CPU time) | tokens/s (aux on) | GFLOP/s | of matmul peak |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  rows = [(v, "muon") for v in args.variants] + [("vanilla", "adamw")]
  for variant, opt_name in rows:
    runs, n_params = {}, None
    for aux in (0.0, 1e-4):
      cfg = load_config(args.config, ov + [f"model.attention={variant}", f"loss.aux_weight={aux!r}",
                                           f"train.optimizer={opt_name}"])
      step, state, n_params = build_step(cfg)
      runs[aux] = (step, state)
    res = time_interleaved(runs, batch, args.repeats)
    (off, cpu_off), (on, cpu_on) = res[0.0], res[1e-4]
    flops = flops_per_token(n_params, cfg) * tokens / on
    print(f"| {variant} | {opt_name} | {n_params:,} | {off * 1e3:.1f} | {on * 1e3:.1f} | "
          f"{(on / off - 1) * 100:+.1f} % | {(cpu_on / cpu_off - 1) * 100:+.1f} % | {tokens / on:,.0f} | "
          f"{flops / 1e9:.1f} | {flops / peak:.0%} |", flush=True)
    if variant == "vanilla" and opt_name == "adamw":
      jax_adamw = (off, n_params)

  if not args.no_torch:
    res, note = torch_peer(base, args.repeats)
    print(f"\nPeer ({note}), float32, same shapes and batch:")
    print("\n| implementation | params | step (ms) | tokens/s | GFLOP/s |")
    print("|---|---|---|---|---|")
    t, n = jax_adamw
    cfg = load_config(args.config, ov + ["model.attention=vanilla"])
    print(f"| sinkjax vanilla, AdamW, aux off | {n:,} | {t * 1e3:.1f} | {tokens / t:,.0f} | "
          f"{flops_per_token(n, cfg) * tokens / t / 1e9:.1f} |")
    if res is not None:
      t, n = res
      print(f"| HF LlamaForCausalLM, torch AdamW | {n:,} | {t * 1e3:.1f} | {tokens / t:,.0f} | "
            f"{flops_per_token(n, cfg) * tokens / t / 1e9:.1f} |")


if __name__ == "__main__":
  main()
