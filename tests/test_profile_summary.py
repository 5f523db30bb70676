"""`sinkjax.bench.profile_summary` on a real CPU trace: a jitted step with a matmul, the attention kernel (xla
backend, under its `sinkjax_attention` name scope) and an optax update (under `optimizer`), traced by jax.profiler.
The categories' times add up to the device events' total read straight from the trace file, each expected category
is non-empty, and the ops are classified from the compiled HLO (op_name metadata), not guessed."""
import gzip
import json

import jax
import jax.numpy as jnp
import optax

from sinkjax.bench import profile_summary
from sinkjax.kernels import flash_attention


def test_cpu_trace_by_category(tmp_path, capsys):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 128, 2, 32))
  w = jnp.eye(32) + 0.01
  opt = optax.adamw(1e-3)

  def step(w, st, x):
    def loss(w):
      y = jnp.einsum("bthd,de->bthe", x, w)
      o, l = flash_attention(y, y, y, impl="xla")
      return jnp.sum(o) + jnp.sum(l)
    g = jax.grad(loss)(w)
    with jax.named_scope("optimizer"):
      u, st = opt.update(g, st, w)
      return optax.apply_updates(w, u), st

  compiled = jax.jit(step).lower(w, opt.init(w), x).compile()
  st = opt.init(w)
  w, st = compiled(w, st, x)
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(2):
      w, st = compiled(w, st, x)
    jax.block_until_ready(w)
  hlo = compiled.as_text()
  s = profile_summary.summarize(tmp_path, [hlo], steps=2)
  trace = json.load(gzip.open(next(tmp_path.rglob("*.trace.json.gz")), "rt"))
  ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "hlo_op" in e.get("args", {})
         and not e["args"]["hlo_op"].startswith(("while", "conditional", "call"))]   # containers: bodies counted
  assert s["events"] == len(ops) > 0
  assert abs(s["total_us"] - sum(e["dur"] for e in ops) / 2) < 1e-6 * s["total_us"]
  assert abs(sum(s["by_category"].values()) - s["total_us"]) < 1e-6 * s["total_us"]
  for cat in ("attention", "optimizer", "matmuls"):
    assert s["by_category"][cat] > 0, (cat, s["by_category"], s["top"][:10])
  assert s["by_category"]["collectives"] == 0 and s["classified_by_hlo"]
  info = profile_summary.parse_hlo(hlo)
  assert any("sinkjax_attention" in i["op_name"] for i in info.values())
  span = max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)
  assert abs(sum(s["in_flight_us"].values()) - span / 2) < 1e-6 * span       # the CPU trace's wall, split by ops running
  assert 0 < sum(s["alone_us"].values()) <= s["in_flight_us"][1] + 1e-6
  assert profile_summary.main([str(tmp_path), "--steps", "2"]) == 0       # by name alone: still a table
  out = capsys.readouterr().out
  assert "| attention |" in out and "ops in flight" in out


def test_in_flight_by_hand():
  """Ops a [0, 10), b [5, 15), a [20, 25): 1 op for 0-5, 2 for 5-10, 1 for 10-15, none for 15-20, 1 for 20-25; a alone
  5 + 5 µs, b alone 5 µs; an op ending where another starts is not counted as overlapping."""
  hist, alone = profile_summary.in_flight([(0, 10, "a"), (5, 10, "b"), (20, 5, "a"), (25, 5, "b")])
  assert hist == {0: 5, 1: 20, 2: 5} and alone == {"a": 10, "b": 10}


def test_categorize_gpu_kernel_names():
  """Names of GPU kernels without HLO: NCCL, cuDNN's flash kernels, cuBLAS / nvjet GEMMs, XLA fusions."""
  c = profile_summary.categorize
  assert c("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "collectives"
  assert c("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
  assert c("nvjet_tst_192x192_64x3_1x2_h_bz_coopB_TNT") == "matmuls"
  assert c("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmuls"
  assert c("loop_multiply_fusion_3") == "elementwise"
  assert c("input_reduce_fusion", {"opcode": "fusion", "op_name": "jit(step)/optimizer/mul"}) == "optimizer"
  assert c("fusion_9", {"opcode": "fusion", "has_dot": True, "op_name": "jit(step)/dot_general"}) == "matmuls"
  assert c("all-gather-start", {"opcode": "all-gather-start"}) == "collectives"
