"""nanochat's own training step, timed as its scripts/base_train.py times it: the peer row of the GPU side by side
(`python -m sinkjax.bench.side_by_side`, stage `side_by_side` of launch/gpu_measure.sh).

    python launch/nanochat_step.py --tree DIR [--depth 20] [--batch 32] [--seq 2048] [--vocab 65536]
                                   [--warmup 5] [--steps 10] [--device cuda|cpu] [--no-compile] [--peak-tflops 989]

It imports nanochat's package from DIR (a nanochat tree, e.g. nanochat-9d4c9b7; nothing of nanochat is copied into
this repository) and builds the model as base_train.py does: depth d gives d layers x 64·d wide, heads of 128 dims
(the head count dividing the width nearest to width / 128), MHA, the GPT made on the meta device, moved to the device
and `init_weights()`; `torch.compile(model, dynamic=False)`; its own optimizers (`setup_optimizers()`: Muon for the
blocks' matrices, fused torch AdamW for the embedding and LM head); bfloat16 autocast on a GPU. One step is what
base_train.py's loop does between its two `synchronize()` calls with one micro-batch (gradient accumulation 1):
forward under autocast, backward, gradient clipping at 1.0 read back to the host, the learning-rate multiplier and
Muon's momentum set, both optimizers stepped, gradients zeroed. The batch is one fixed batch of random token ids (the
data loader is outside base_train.py's timed region too). After --warmup untimed steps (the compiles), --steps steps
are timed one by one; the result is their median.

Prints one JSON line: tokens_per_s, mfu (percent of --peak-tflops, nanochat's `estimate_flops()` per token: its
base_train.py uses 989 TFLOP/s, the H100's dense bf16 peak, which is also the H200's), step_ms, flops_per_token,
params, the shape, torch's version and the device. It needs only torch and the tree (no jax, no sinkjax), so any
Python with torch runs it (SINKJAX_TORCH_PYTHON in launch/gpu_measure.sh).

--no-compile: eager mode, and nanochat's own `@torch.compile` on Muon's Newton-Schulz function off too
(TORCHDYNAMO_DISABLE=1): the dry run on a CPU, where compiling costs minutes on a small machine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys
import time


def heads_for(width: int, head_dim: int = 128) -> int:
  """The head count base_train.py picks: the divisor of `width` nearest to width / head_dim (ties to the larger)."""
  ideal = max(1, round(width / head_dim))
  divisors = [h for h in range(1, width + 1) if width % h == 0]
  return min(divisors, key=lambda h: (abs(h - ideal), -h))


def parse(argv):
  p = argparse.ArgumentParser(prog="python launch/nanochat_step.py", description=__doc__.split("\n\n")[0])
  p.add_argument("--tree", required=True, help="a nanochat tree (holding nanochat/gpt.py)")
  p.add_argument("--depth", type=int, default=20)
  p.add_argument("--batch", type=int, default=32, help="rows per step (base_train.py's device_batch_size)")
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--vocab", type=int, default=65536, help="nanochat's tokenizer has 65,536 tokens")
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where torch sees one")
  p.add_argument("--no-compile", action="store_true", help="eager, nanochat's Muon compile off too")
  p.add_argument("--peak-tflops", type=float, default=989.0)
  a = p.parse_args(argv)
  if not (pathlib.Path(a.tree) / "nanochat" / "gpt.py").is_file():
    p.error(f"--tree {a.tree}: no nanochat/gpt.py there (give a nanochat tree such as .peers/nanochat-9d4c9b7)")
  if min(a.depth, a.batch, a.seq, a.vocab, a.warmup, a.steps) < 1:
    p.error("--depth, --batch, --seq, --vocab, --warmup and --steps must be >= 1")
  return a


def main(argv=None) -> int:
  a = parse(argv)
  if a.no_compile:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"      # read when torch._dynamo is imported: set before torch
  import torch  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, str(pathlib.Path(a.tree).resolve()))
  from nanochat.gpt import GPT, GPTConfig  # pylint: disable=import-outside-toplevel

  device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
  width = a.depth * 64
  heads = heads_for(width)
  torch.manual_seed(0)
  cfg = GPTConfig(sequence_len=a.seq, vocab_size=a.vocab, n_layer=a.depth, n_head=heads, n_kv_head=heads, n_embd=width)
  with torch.device("meta"):
    model = GPT(cfg)
  model.to_empty(device=device)
  model.init_weights()
  orig = model
  if not a.no_compile:
    model = torch.compile(model, dynamic=False)
  optimizers = orig.setup_optimizers()
  muon = optimizers[1]
  cuda = device == "cuda"
  autocast = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  gen = torch.Generator().manual_seed(0)
  x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(device)
  y = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(device)

  def step():
    with autocast:
      loss = model(x, y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(orig.parameters(), 1.0).item()
    for opt in optimizers:
      for group in opt.param_groups:
        group["lr"] = group["initial_lr"] * 1.0        # base_train.py's multiplier before its warmdown
    for group in muon.param_groups:
      group["momentum"] = 0.95
    for opt in optimizers:
      opt.step()
    model.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm

  t_start = time.perf_counter()
  for _ in range(a.warmup):
    step()
  sync()
  warm_s = time.perf_counter() - t_start
  times, loss = [], None
  for _ in range(a.steps):
    sync()
    t0 = time.perf_counter()
    loss, _ = step()
    sync()
    times.append(time.perf_counter() - t0)
  dt = statistics.median(times)
  tokens = a.batch * a.seq
  flops_per_token = orig.estimate_flops()
  out = {"name": "nanochat", "tokens_per_s": tokens / dt, "mfu": 100 * flops_per_token * tokens / dt /
         (a.peak_tflops * 1e12), "step_ms": dt * 1e3, "step_ms_min": min(times) * 1e3,
         "step_ms_max": max(times) * 1e3, "flops_per_token": flops_per_token,
         "params": sum(p.numel() for p in orig.parameters()), "layers": a.depth, "width": width, "heads": heads,
         "batch": a.batch, "seq": a.seq, "vocab": a.vocab, "warmup_steps": a.warmup, "timed_steps": a.steps,
         "warmup_s": warm_s, "loss": float(loss), "device": torch.cuda.get_device_name() if cuda else "cpu",
         "torch": torch.__version__, "compiled": not a.no_compile,
         "autocast": "bfloat16" if cuda else "none (float32)", "tree": pathlib.Path(a.tree).resolve().name,
         "peak_tflops": a.peak_tflops}
  print(json.dumps(out), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
