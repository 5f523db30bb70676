"""What `sinkjax.compile` reads off XLA:GPU programs, checked against hand counts: a real H100 compile of the paper's
d20 train step (recorded on a lent H100 by `launch/gpu_measure.sh`, docs/results/gpu_h100/) and a small hand-written
program with each GPU form (a cuBLAS matmul custom call, an async fusion, a Triton kernel naming its cost). No GPU and
no CUDA plugin needed: the programs are text."""
import gzip
import pathlib

import pytest

from sinkjax import compile as compile_lib
from sinkjax.kernels import pallas_gpu

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results" / "gpu_h100"


def test_h100_d20_step_flops_equal_the_hand_count():
  """configs/paper/d20_sink_aux.yaml (vocabulary 65,536, 32 rows x 2048, remat save_attention, Muon) compiled by
  XLA:GPU on an H100: its matmuls are cuBLAS custom calls, 418 of them, most inside the scanned layers' loop. The
  counted FLOPs equal, to the FLOP, the hand count: 6 x the matmul weights x tokens (20 layers of q, k, v, o and the
  4x MLP, and the LM head), the chunked loss's LM head forward again (the only recomputation under save_attention),
  and Muon's 5 Newton-Schulz iterations per layer matrix (4 m^2 n + 2 m^3 each, m <= n). The attention kernels are
  Triton calls that this recording does not cost (it predates their names carrying it)."""
  costs = compile_lib.hlo_costs(gzip.open(RESULTS / "d20.hlo.txt.gz", "rt").read())
  L, d, ff, V, tokens = 20, 1280, 5120, 65536, 32 * 2048
  weights = L * (4 * d * d + 2 * d * ff) + V * d
  lm_head_again = 2 * V * d * tokens
  newton_schulz = L * (4 * 5 * 6 * d ** 3 + 2 * 5 * (4 * d * d * ff + 2 * d ** 3))
  assert costs["flops"] == pytest.approx(6 * weights * tokens + lm_head_again + newton_schulz, rel=1e-6)
  assert costs["recompute_flops"] == pytest.approx(lm_head_again, rel=1e-6)
  assert costs["loops_of_unknown_trips"] == 0


def test_h100_d20_estimate_is_below_the_measured_step():
  """The roofline estimate of that program is a lower bound on its step: the same program measured 705 ms on the H100
  (trainer_d20.log); before the cuBLAS calls and async fusions were read (their FLOPs missed, the whole stacked
  residual buffers counted for every in-place update) it said 740 ms, above the measurement."""
  costs = compile_lib.hlo_costs(gzip.open(RESULTS / "d20.hlo.txt.gz", "rt").read())
  est = compile_lib.roofline(costs, compile_lib.CHIPS["h100"], 2.288e14)
  measured = float(next(line for line in (RESULTS / "trainer_d20.log").read_text().splitlines()
                        if line.startswith("| step, packed")).split("|")[2])
  assert 0.25 * measured < est["estimated_step_seconds"] * 1e3 < measured


HLO = """HloModule gpu_forms, entry_computation_layout={()->bf16[4,8]{1,0}}

%fused_dus (p0: bf16[4,8], p1: bf16[1,8], p2: s32[]) -> bf16[4,8] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = bf16[1,8]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %dus = bf16[4,8]{1,0} dynamic-update-slice(%p0, %p1, %p2, %c)
}

ENTRY %main (a: bf16[64,32], b: bf16[32,16], buf: bf16[4,8], upd: bf16[1,8], i: s32[]) -> bf16[4,8] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %buf = bf16[4,8]{1,0} parameter(2)
  %upd = bf16[1,8]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %custom-call.1 = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}}}
  %fusion-start = ((bf16[4,8]{1,0}, bf16[1,8]{1,0}, s32[]), bf16[4,8]{1,0}, u32[]) fusion-start(%buf, %upd, %i), kind=kLoop, calls=%fused_dus
  %fusion-done = bf16[4,8]{1,0} fusion-done(%fusion-start)
  %pallas_call = bf16[2,4]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/sinkjax_flash_fwd__cost_f1000_t10_b500/pallas_call"}
  ROOT %out = bf16[4,8]{1,0} copy(%fusion-done)
}
"""


def test_gpu_forms_by_hand():
  """FLOPs: the cuBLAS call's 2 x 64 x 16 x 32 plus the Triton kernel's named 1000. Bytes: the matmul reads a and b
  and writes its result, not its s8 workspace (4096 + 1024 + 2048); the async in-place update reads and writes its
  update and index, not the buffer (16 + 4 + 16); the kernel moves its named 500; the copy reads and writes 64 each."""
  costs = compile_lib.hlo_costs(HLO)
  assert costs["flops"] == 2 * 64 * 16 * 32 + 1000
  assert costs["transcendentals"] == 10
  assert costs["hbm_bytes"] == (4096 + 1024 + 2048) + (16 + 4 + 16) + 500 + (64 + 64)


def test_gpu_kernel_names_carry_their_cost(monkeypatch):
  """Compiled for a GPU (not interpreted), a pass's pallas_call is named with its cost estimate in the form
  `compile.GPU_COST_NAME` reads; interpreted, with its plain name."""
  names = []
  monkeypatch.setattr(pallas_gpu.pl, "pallas_call", lambda *a, **kw: names.append(kw["name"]))
  cost = pallas_gpu.pl.CostEstimate(flops=123, transcendentals=4, bytes_accessed=56)
  for interpret in (False, True):
    pallas_gpu._call(None, grid=(1,), in_specs=[], out_specs=[], out_shape=[], Dp=64, interpret=interpret,
                     name="sinkjax_flash_fwd", cost=cost)
  assert names == ["sinkjax_flash_fwd__cost_f123_t4_b56", "sinkjax_flash_fwd"]
  import re
  assert re.search(compile_lib.GPU_COST_NAME, names[0]).groups() == ("123", "4", "56")


FMHA = """HloModule fmha, entry_computation_layout={()->bf16[2,8,4,64]{3,2,1,0}}

ENTRY %main (q: bf16[2,8,4,64], k: bf16[2,8,4,64], v: bf16[2,8,4,64]) -> bf16[2,8,4,64] {
  %q = bf16[2,8,4,64]{3,2,1,0} parameter(0)
  %k = bf16[2,8,4,64]{3,2,1,0} parameter(1)
  %v = bf16[2,8,4,64]{3,2,1,0} parameter(2)
  %fwd = (bf16[2,4,8,64]{3,1,2,0}, f32[2,4,8]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"operation_queue_id": "0", "cudnn_fmha_backend_config": {"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "8", "8"], "tuple_shapes": [], "layout": {"minor_to_major": ["3", "2", "1", "0"]}}, "is_flash_attention": true, "mask_type": "CAUSAL", "max_seg_per_batch": 1}}
  %bwd = (bf16[2,4,8,64]{3,1,2,0}, bf16[2,4,8,64]{3,1,2,0}, bf16[2,4,8,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"operation_queue_id": "0", "cudnn_fmha_backend_config": {"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["2", "4", "8", "8"], "tuple_shapes": [], "layout": {"minor_to_major": ["3", "2", "1", "0"]}}, "is_flash_attention": true, "mask_type": "NO_MASK", "max_seg_per_batch": 1}}
  ROOT %out = bf16[2,8,4,64]{3,2,1,0} copy(%q)
}
"""


def test_cudnn_fused_attention_flops_by_hand():
  """cuDNN's forward, causal over 8 x 8 logits: 36 visible pairs (1 + 2 + ... + 8) x 2 matmuls; its backward without
  a mask: 64 pairs x 5 matmuls; each pair-matmul 2 x D FLOPs, for B 2 x N 4."""
  costs = compile_lib.hlo_costs(FMHA)
  assert costs["flops"] == 2 * 4 * 2 * 64 * (36 * 2 + 64 * 5)
