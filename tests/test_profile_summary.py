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
  assert c("void cudnn::fusion::compute_do<__nv_bfloat16, 128>(...)") == "attention"   # cuDNN's D = rowsum(dO * O)
  assert c("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmuls"
  assert c("loop_multiply_fusion_3") == "elementwise"
  assert c("input_reduce_fusion", {"opcode": "fusion", "op_name": "jit(step)/optimizer/mul"}) == "optimizer"
  assert c("fusion_9", {"opcode": "fusion", "has_dot": True, "op_name": "jit(step)/dot_general"}) == "matmuls"
  assert c("all-gather-start", {"opcode": "all-gather-start"}) == "collectives"


def test_kernels_in_a_command_buffer_are_listed_by_their_own_names(tmp_path):
  """XLA:GPU's CUDA graphs: every kernel in one carries hlo_op "command_buffer_N" (not an HLO instruction). Each is
  classified and listed by its own name: a cuBLAS kernel as a matmul, cuDNN's as attention, an XLA fusion by its HLO
  instruction (here one under the optimizer scope; the kernel's name writes the instruction's ".4" as "_4"), never all under the graph with one category (by hand: 5 + 2 + 3
  + 4 µs)."""
  hlo_text = """HloModule jit_train_step, entry_computation_layout={()->f32[4]{0}}

%fused_multiply (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %multiply.1 = f32[4]{0} multiply(%param_0, %param_0), metadata={op_name="jit(train_step)/optimizer/mul"}
}

ENTRY %main.2 () -> f32[4] {
  %constant.1 = f32[4]{0} constant({1, 2, 3, 4})
  ROOT %loop_multiply_fusion.4 = f32[4]{0} fusion(%constant.1), kind=kLoop, calls=%fused_multiply, """ \
      """metadata={op_name="jit(train_step)/optimizer/mul" scheduling_name="loop_multiply_fusion.4"}
}
"""
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
  kernels = [("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", 0, 5), ("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", 5, 2),
             ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 7, 3),
             ("loop_multiply_fusion_4", 10, 4)]
  events = meta + [{"ph": "X", "pid": 1, "tid": 14, "name": n, "ts": ts, "dur": d,
                    "args": {"hlo_op": "command_buffer_138", "hlo_module": "jit_train_step"}} for n, ts, d in kernels]
  d = tmp_path / "plugins" / "profile" / "x"
  d.mkdir(parents=True)
  with gzip.open(d / "vm.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  s = profile_summary.summarize(tmp_path, [hlo_text])
  assert s["by_category"] == {"matmuls": 7.0, "attention": 3.0, "elementwise": 0.0, "optimizer": 4.0,
                              "collectives": 0.0}
  top = {n: (c, t) for n, c, t in s["top"]}
  assert top == {"nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT": ("matmuls", 7.0),
                 "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": ("attention", 3.0),
                 "loop_multiply_fusion_4": ("optimizer", 4.0)}
