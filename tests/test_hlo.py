"""What `sinkjax.hlo` reads off the text of compiled programs, checked against hand counts: small hand-written
programs with each form the walk reads (while loops with their trip counts, nested and unknown; collectives, sync and
async, in XLA's three spellings of replica groups; partial reads; stack frames, categories and passes; the roofline's
terms), the XLA:GPU forms (a cuBLAS matmul custom call, an async fusion, a Triton kernel naming its cost, cuDNN's fused
attention), and a real H100 compile of the paper's d20 train step (recorded on an H100 by
`launch/gpu_measure.sh`, docs/results/gpu_h100/). No TPU, GPU, libtpu or CUDA plugin needed: the programs are text."""
import gzip
import pathlib
import re

import pytest

from sinkjax import hlo
from sinkjax.kernels import pallas_gpu

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results" / "gpu_h100"


# ------------------------------------------------------------------------------------------- hand-written programs

# A loop of 3 trips (the counter starts at 1, steps by 2, stops at 7) multiplying h [64, 32] by w [32, 32], its
# matmul placed by its stack frames in the chunked loss; after it a matmul JAX names as recomputed in the backward, a
# dynamic slice of one row, and three collectives of h: an all-gather over groups of 4 ([2,4]<=[8]), an all-reduce
# over groups of 2 ({{0,1},{2,3}}), and an async all-gather over the 4 chips of a mesh axis (start and done).
LOOPS = """HloModule loops_and_collectives, entry_computation_layout={(f32[64,32]{1,0}, f32[32,32]{1,0})->f32[64,32]{1,0}}

FileNames
1 "/src/sinkjax/step.py"
2 "/src/sinkjax/model.py"

FunctionNames
1 "loss_fn"
2 "chunked_nll.<locals>.block"

FileLocations
1 {file_name_id=1 function_name_id=1 line=20 end_line=20 column=1 end_column=1}
2 {file_name_id=2 function_name_id=2 line=10 end_line=10 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], f32[64,32], f32[32,32])) -> pred[] {
  %p = (s32[], f32[64,32]{1,0}, f32[32,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[64,32], f32[32,32])) -> (s32[], f32[64,32], f32[32,32]) {
  %p = (s32[], f32[64,32]{1,0}, f32[32,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %h = f32[64,32]{1,0} get-tuple-element(%p), index=1
  %w = f32[32,32]{1,0} get-tuple-element(%p), index=2
  %dot = f32[64,32]{1,0} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/jvp(block)/dot_general" stack_frame_id=2}
  %two = s32[] constant(2)
  %next = s32[] add(%i, %two)
  ROOT %t = (s32[], f32[64,32]{1,0}, f32[32,32]{1,0}) tuple(%next, %dot, %w)
}

ENTRY %main (x: f32[64,32], w: f32[32,32]) -> f32[64,32] {
  %x = f32[64,32]{1,0} parameter(0)
  %w = f32[32,32]{1,0} parameter(1)
  %one = s32[] constant(1)
  %init = (s32[], f32[64,32]{1,0}, f32[32,32]{1,0}) tuple(%one, %x, %w)
  %loop = (s32[], f32[64,32]{1,0}, f32[32,32]{1,0}) while(%init), condition=%cond, body=%body
  %h = f32[64,32]{1,0} get-tuple-element(%loop), index=1
  %again = f32[64,32]{1,0} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/transpose(jvp(block))/rematted_computation/dot_general"}
  %row = f32[1,32]{1,0} dynamic-slice(%x, %one, %one), dynamic_slice_sizes={1,32}
  %ag = f32[64,128]{1,0} all-gather(%h), channel_id=1, replica_groups=[2,4]<=[8], dimensions={1}
  %ar = f32[64,32]{1,0} all-reduce(%h), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%sum, metadata={op_name="jit(f)/transpose(jvp(block))/psum"}
  %ags = (f32[64,32]{1,0}, f32[64,128]{1,0}) all-gather-start(%h), channel_id=3, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={1}
  %agd = f32[64,128]{1,0} all-gather-done(%ags)
  ROOT %out = f32[64,32]{1,0} copy(%again)
}
"""

H, W, ROW = 64 * 32 * 4, 32 * 32 * 4, 32 * 4          # bytes of h (and x), of w, of one row
MATMUL = 2 * 64 * 32 * 32                             # FLOPs of one [64, 32] x [32, 32] matmul
GATHERED = 64 * 128 * 4                               # bytes of an all-gather's output


def test_parse_hlo_reads_computations_and_instructions():
  comps, entry = hlo.parse_hlo(LOOPS)
  assert entry == "main" and list(comps) == ["sum", "cond", "body", "main"]
  dot = comps["body"]["dot"]
  assert (dot.opcode, dot.type, dot.operands) == ("dot", "f32[64,32]{1,0}", ["h", "w"])
  assert comps["main"]["loop"].callees("body") == ["body"] and comps["main"]["ar"].callees() == ["sum"]
  assert list(comps["body"])[-1] == "t"                 # program order: the root last


def test_loop_trips_collectives_and_bytes_by_hand():
  """FLOPs: 3 trips of the loop's matmul (ceil((7 - 1) / 2)) and the matmul after it, which is also all of
  `recompute_flops`. Bytes: each trip's matmul reads h and w and writes h, its counter's add reads two s32 and writes
  one; the recomputed matmul the same once; the dynamic slice reads its row and two indices and writes the row; the
  copy reads and writes h; each all-gather reads h and writes its gathered output (the async one's operand, which
  its output tuple repeats, counts once); the all-reduce reads and writes h. Collectives: the arrays gathered and
  reduced; ring traffic (n - 1) / n of a gather over n = 4 chips (both the [2,4]<=[8] and the mesh-axis spelling),
  2 (n - 1) / n of an all-reduce over n = 2."""
  costs = hlo.hlo_costs(LOOPS)
  assert costs["flops"] == 3 * MATMUL + MATMUL and costs["recompute_flops"] == MATMUL
  assert costs["loops_of_unknown_trips"] == 0
  loop = 3 * ((2 * H + W) + 3 * 4)
  rest = (2 * H + W) + (ROW + 2 * 4 + ROW) + 2 * H + 2 * (H + GATHERED) + 2 * H
  assert costs["hbm_bytes"] == loop + rest
  assert costs["collective_bytes"] == {"all-gather": 2 * GATHERED, "reduce-scatter": 0, "all-reduce": H,
                                       "all-to-all": 0, "collective-permute": 0}
  assert costs["ici_bytes"] == 2 * GATHERED * 3 / 4 + H * 2 * 1 / 2
  assert costs["host_bytes"] == 0 and costs["transcendentals"] == 0


def test_breakdown_by_category_pass_and_source():
  """The loop's matmul sits under `chunked_nll` in its stack (the loss), 3 trips inside the loop `body`, in the
  forward (its op name under jvp), with sinkjax's source lines innermost first; the matmul after the loop has no
  stack frame (a matmul) and is recomputed; the collectives are collectives (the all-reduce, named under transpose,
  in the backward); the row a slice; the counter's add elementwise. Every category and every pass adds up to the totals."""
  costs = hlo.hlo_costs(LOOPS)
  b = costs["breakdown"]
  rows = {r["instruction"]: r for r in b["top"]}
  dot = rows["dot"]
  assert (dot["category"], dot["phase"], dot["trips"]) == ("loss", "forward", 3)
  assert dot["loops"] == [{"trips": 3, "body": "body"}] and (dot["hbm_bytes"], dot["flops"]) == (3 * (2 * H + W),
                                                                                                 3 * MATMUL)
  assert dot["source"] == ["sinkjax/model.py:10 chunked_nll.<locals>.block", "sinkjax/step.py:20 loss_fn"]
  assert (rows["again"]["category"], rows["again"]["phase"], rows["again"]["source"]) == ("matmuls", "recompute", [])
  assert {rows[n]["category"] for n in ("ag", "ar", "ags")} == {"collectives"}
  assert rows["ar"]["phase"] == "backward" and rows["ag"]["phase"] == "other"
  assert rows["row"]["category"] == "copies / transposes / slices"
  assert rows["next"]["category"] == "elementwise / other fusions" and rows["next"]["trips"] == 3
  assert "agd" not in rows                             # the done half moves nothing of its own
  for table in ("by_category", "by_pass"):
    assert sum(c["hbm_bytes"] for c in b[table].values()) == costs["hbm_bytes"]
    assert sum(c["flops"] for c in b[table].values()) == costs["flops"]
  assert [r["hbm_bytes"] for r in b["top"]] == sorted((r["hbm_bytes"] for r in b["top"]), reverse=True)


def test_roofline_terms_by_hand():
  """Compute, HBM and ICI at the chip's peaks; `sequential`: the synchronous instructions (not the collectives, not
  an async start) one after another, each at the longer of its FLOPs at peak and its bytes at the HBM bandwidth (on
  this chip every one is bytes-bound); the bound is the largest term, here the ICI; the MFU bound the model FLOPs
  over that time at peak."""
  chip = hlo.Chip(peak_flops=1e12, hbm_bandwidth=1e9, ici_bandwidth=1e8, source="by hand")
  costs = hlo.hlo_costs(LOOPS)
  est = hlo.roofline(costs, chip, 1e6)
  terms = est["estimated_seconds_by_term"]
  synchronous = 3 * ((2 * H + W) + 3 * 4) + (2 * H + W) + (ROW + 2 * 4 + ROW) + 2 * H
  ici = 2 * GATHERED * 3 / 4 + H
  assert terms["compute"] == pytest.approx(4 * MATMUL / 1e12)
  assert terms["hbm"] == pytest.approx(costs["hbm_bytes"] / 1e9)
  assert terms["sequential"] == pytest.approx(synchronous / 1e9)
  assert terms["ici"] == pytest.approx(ici / 1e8)
  assert est["estimated_bound"] == "ici" and est["estimated_step_seconds"] == pytest.approx(ici / 1e8)
  assert est["estimated_mfu"] == pytest.approx(1e6 / (ici / 1e8 * 1e12))


# Loops in loops multiply (4 outer trips of 3 inner ones); a loop whose bound is a value of the loop, not a constant,
# counts once and is said to.
NESTED = """HloModule nested

%inner_cond (p: (s32[], f32[8,8])) -> pred[] {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%inner_body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = f32[8,8]{1,0} get-tuple-element(%p), index=1
  %d = f32[8,8]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,8]{1,0}) tuple(%next, %d)
}

%outer_cond (p: (s32[], f32[8,8])) -> pred[] {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = f32[8,8]{1,0} get-tuple-element(%p), index=1
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%zero, %a)
  %inner = (s32[], f32[8,8]{1,0}) while(%init), condition=%inner_cond, body=%inner_body
  %a2 = f32[8,8]{1,0} get-tuple-element(%inner), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,8]{1,0}) tuple(%next, %a2)
}

%free_cond (p: (s32[], s32[], f32[8,8])) -> pred[] {
  %p = (s32[], s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=1
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%free_body (p: (s32[], s32[], f32[8,8])) -> (s32[], s32[], f32[8,8]) {
  %p = (s32[], s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=1
  %a = f32[8,8]{1,0} get-tuple-element(%p), index=2
  %d = f32[8,8]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], s32[], f32[8,8]{1,0}) tuple(%next, %n, %d)
}

ENTRY %main (a: f32[8,8], n: s32[]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %n = s32[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%zero, %a)
  %outer = (s32[], f32[8,8]{1,0}) while(%init), condition=%outer_cond, body=%outer_body
  %init2 = (s32[], s32[], f32[8,8]{1,0}) tuple(%zero, %n, %a)
  %free = (s32[], s32[], f32[8,8]{1,0}) while(%init2), condition=%free_cond, body=%free_body
  ROOT %out = f32[8,8]{1,0} get-tuple-element(%free), index=2
}
"""


def test_nested_loops_multiply_and_an_unknown_bound_counts_once():
  costs = hlo.hlo_costs(NESTED)
  matmul = 2 * 8 * 8 * 8
  assert costs["flops"] == 4 * 3 * matmul + matmul
  assert costs["loops_of_unknown_trips"] == 1
  inner = next(r for r in costs["breakdown"]["top"] if r["computation"] == "inner_body" and r["opcode"] == "dot")
  assert inner["trips"] == 12 and [lp["trips"] for lp in inner["loops"]] == [4, 3]
  assert [lp["body"] for lp in inner["loops"]] == ["outer_body", "inner_body"]
  free = next(r for r in costs["breakdown"]["top"] if r["computation"] == "free_body" and r["opcode"] == "dot")
  assert free["trips"] == 1 and free["loops"] == [{"trips": None, "body": "free_body"}]


# ------------------------------------------------------------------------------------------- XLA:GPU programs

def test_h100_d20_step_flops_equal_the_hand_count():
  """configs/paper/d20_sink_aux.yaml (vocabulary 65,536, 32 rows x 2048, remat save_attention, Muon) compiled by
  XLA:GPU on an H100: its matmuls are cuBLAS custom calls, 418 of them, most inside the scanned layers' loop. The
  counted FLOPs equal, to the FLOP, the hand count: 6 x the matmul weights x tokens (20 layers of q, k, v, o and the
  4x MLP, and the LM head), the chunked loss's LM head forward again (the only recomputation under save_attention),
  and Muon's 5 Newton-Schulz iterations per layer matrix (4 m^2 n + 2 m^3 each, m <= n). The attention kernels are
  Triton calls that this recording does not cost (it predates their names carrying it)."""
  costs = hlo.hlo_costs(gzip.open(RESULTS / "d20.hlo.txt.gz", "rt").read())
  L, d, ff, V, tokens = 20, 1280, 5120, 65536, 32 * 2048
  weights = L * (4 * d * d + 2 * d * ff) + V * d
  lm_head_again = 2 * V * d * tokens
  newton_schulz = L * (4 * 5 * 6 * d ** 3 + 2 * 5 * (4 * d * d * ff + 2 * d ** 3))
  assert costs["flops"] == pytest.approx(6 * weights * tokens + lm_head_again + newton_schulz, rel=1e-6)
  assert costs["recompute_flops"] == pytest.approx(lm_head_again, rel=1e-6)
  assert costs["loops_of_unknown_trips"] == 0


def test_h100_d20_mosaic_gpu_step_flops_equal_the_hand_count():
  """The same d20 step with `model.attn_impl=mosaic_gpu` (tokamax's kernels, jax 0.12, compiled for a compile-only
  H100): the hand count above plus, per layer, causal attention over 2048 x 2049 / 2 pairs for 32 rows x 10 heads x
  D 128 with 2 (forward) + 3 (dQ) + 4 (dK, dV) matmuls; the forward is not recomputed (save_attention keeps O and
  the LSE)."""
  text = gzip.open(RESULTS / "d20_mosaic_gpu.hlo.txt.gz", "rt").read()
  costs = hlo.hlo_costs(text)
  L, d, ff, V, B, T, H, D = 20, 1280, 5120, 65536, 32, 2048, 10, 128
  tokens = B * T
  weights = L * (4 * d * d + 2 * d * ff) + V * d
  lm_head_again = 2 * V * d * tokens
  newton_schulz = L * (4 * 5 * 6 * d ** 3 + 2 * 5 * (4 * d * d * ff + 2 * d ** 3))
  attention = L * 2 * (2 + 3 + 4) * B * H * (T * (T + 1) // 2) * D
  assert costs["flops"] == pytest.approx(6 * weights * tokens + lm_head_again + newton_schulz + attention, rel=1e-6)
  assert hlo.attention_kernel(text, "mosaic_gpu") == "mosaic_gpu"


def test_h100_d20_estimate_is_below_the_measured_step():
  """The roofline estimate of that program is a lower bound on its step: the same program measured 705 ms on the H100
  (trainer_d20.log); before the cuBLAS calls and async fusions were read (their FLOPs missed, the whole stacked
  residual buffers counted for every in-place update) it said 740 ms, above the measurement."""
  costs = hlo.hlo_costs(gzip.open(RESULTS / "d20.hlo.txt.gz", "rt").read())
  est = hlo.roofline(costs, hlo.CHIPS["h100"], 2.288e14)
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
  costs = hlo.hlo_costs(HLO)
  assert costs["flops"] == 2 * 64 * 16 * 32 + 1000
  assert costs["transcendentals"] == 10
  assert costs["hbm_bytes"] == (4096 + 1024 + 2048) + (16 + 4 + 16) + 500 + (64 + 64)


def test_gpu_kernel_names_carry_their_cost(monkeypatch):
  """Compiled for a GPU (not interpreted), a pass's pallas_call is named with its cost estimate in the form
  `hlo.GPU_COST_NAME` reads; interpreted, with its plain name."""
  names = []
  monkeypatch.setattr(pallas_gpu.pl, "pallas_call", lambda *a, **kw: names.append(kw["name"]))
  cost = pallas_gpu.pl.CostEstimate(flops=123, transcendentals=4, bytes_accessed=56)
  for interpret in (False, True):
    pallas_gpu._call(None, grid=(1,), in_specs=[], out_specs=[], out_shape=[], Dp=64, interpret=interpret,
                     name="sinkjax_flash_fwd", cost=cost)
  assert names == ["sinkjax_flash_fwd__cost_f123_t4_b56", "sinkjax_flash_fwd"]
  assert re.search(hlo.GPU_COST_NAME, names[0]).groups() == ("123", "4", "56")


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
  costs = hlo.hlo_costs(FMHA)
  assert costs["flops"] == 2 * 4 * 2 * 64 * (36 * 2 + 64 * 5)


def _tokamax_call(name, out_type, op, causal):
  mask = '{\\"offset\\":0,\\"window_size\\":null}' if causal else "null"
  payload = (f'tokamax:{{\\"op\\":{{\\"__type\\":\\"tokamax._src.ops.attention.{op}\\",\\"config\\":{{}}}},'
             f'\\"arguments\\":{{\\"k\\":\\"bf16[2,8,2,64]\\",\\"mask\\":{{\\"causal_mask\\":{mask}}},'
             f'\\"q\\":\\"bf16[2,8,4,64]\\"}}}}')
  return (f'  %{name} = {out_type} custom-call(%q, %k, %v), custom_call_target="mosaic_gpu_v2", '
          f'api_version=API_VERSION_TYPED_FFI, metadata={{op_name="jit(f)/sinkjax_attention/mpmd_map" '
          f'metadata_payload="{payload}"}}')


MOSAIC = "\n".join([
    "HloModule mosaic, entry_computation_layout={()->bf16[2,8,4,64]{3,2,1,0}}", "",
    "ENTRY %main (q: bf16[2,8,4,64], k: bf16[2,8,2,64], v: bf16[2,8,2,64]) -> bf16[2,8,4,64] {",
    "  %q = bf16[2,8,4,64]{3,2,1,0} parameter(0)",
    "  %k = bf16[2,8,2,64]{3,2,1,0} parameter(1)",
    "  %v = bf16[2,8,2,64]{3,2,1,0} parameter(2)",
    _tokamax_call("fwd", "(bf16[2,8,4,64]{3,2,1,0}, f32[2,4,8]{2,1,0}, f32[2,4,8]{2,1,0})",
                  "pallas_mosaic_gpu.PallasMosaicGpuFlashAttention", True),
    _tokamax_call("dq", "bf16[2,8,4,64]{3,2,1,0}", "pallas_mosaic_gpu_vjp.PallasMosaicGpuFlashAttentionVjp", True),
    _tokamax_call("dkv", "(bf16[2,8,2,64]{3,2,1,0}, bf16[2,8,2,64]{3,2,1,0})",
                  "pallas_mosaic_gpu_vjp.PallasMosaicGpuFlashAttentionVjp", False),
    "  ROOT %out = bf16[2,8,4,64]{3,2,1,0} copy(%q)", "}", ""])


def test_tokamax_mosaic_attention_flops_by_hand():
  """tokamax's Mosaic-GPU kernels (the `mosaic_gpu` backend): the forward, causal over 8 x 8 (36 visible pairs) x 2
  matmuls; the dQ kernel, causal, 3 matmuls; the dK/dV kernel without a mask, 64 pairs x 4 matmuls; each
  pair-matmul 2 x D FLOPs for B 2 x 4 query heads (GQA 4:2: the query heads count)."""
  costs = hlo.hlo_costs(MOSAIC)
  assert costs["flops"] == 2 * 2 * 4 * 64 * (36 * 2 + 36 * 3 + 64 * 4)
  assert hlo.attention_kernel(MOSAIC, "mosaic_gpu") == "mosaic_gpu"


GATHER_HLO = """HloModule gather_view, entry_computation_layout={()->(bf16[4,1]{1,0}, bf16[4,64]{1,0})}

%fused_pick (p0: bf16[4,64], p1: s32[4,1]) -> bf16[4,1] {
  %p0 = bf16[4,64]{1,0} parameter(0)
  %p1 = s32[4,1]{1,0} parameter(1)
  %view = bf16[1,4,64]{2,1,0} bitcast(%p0)
  %idx = s32[4,2]{1,0} concatenate(%p1, %p1), dimensions={1}
  ROOT %g = bf16[4,1]{1,0} gather(%view, %idx), offset_dims={1}, collapsed_slice_dims={0,1}, start_index_map={1,2}, index_vector_dim=1, slice_sizes={1,1,1}
}

%fused_scale (q0: bf16[4,64]) -> bf16[4,64] {
  %q0 = bf16[4,64]{1,0} parameter(0)
  %v = bf16[1,4,64]{2,1,0} bitcast(%q0)
  %two = bf16[1,4,64]{2,1,0} add(%v, %v)
  ROOT %back = bf16[4,64]{1,0} bitcast(%two)
}

ENTRY %main (logits: bf16[4,64], targets: s32[4,1]) -> (bf16[4,1], bf16[4,64]) {
  %logits = bf16[4,64]{1,0} parameter(0)
  %targets = s32[4,1]{1,0} parameter(1)
  %pick = bf16[4,1]{1,0} fusion(%logits, %targets), kind=kLoop, calls=%fused_pick
  %scaled = bf16[4,64]{1,0} fusion(%logits), kind=kLoop, calls=%fused_scale
  ROOT %out = (bf16[4,1]{1,0}, bf16[4,64]{1,0}) tuple(%pick, %scaled)
}
"""


def test_a_fusion_gathering_from_a_view_of_its_operand_reads_the_gathered_elements():
  """The fused loss picks each target's logit with a gather from a [B, T, V] bitcast of the [B*T, V] logits: the
  fusion reads the 4 gathered bf16 values (8 bytes) and the 4 s32 targets (16), and writes 8; a fusion that uses the
  same view elementwise reads all of it (512) and writes 512."""
  costs = hlo.hlo_costs(GATHER_HLO)
  assert costs["hbm_bytes"] == (8 + 16 + 8) + (512 + 512)


def test_by_source_groups_every_instruction_by_its_line_and_pass():
  """`by_source` adds up every instruction of a line, pass and category (the loop's matmul counts its 3 trips, the
  instructions without a sinkjax line group under ""), sorted by bytes, and its groups add up to the program."""
  costs = hlo.hlo_costs(LOOPS)
  b = costs["breakdown"]
  groups = {(g["source"], g["phase"], g["category"]): g for g in b["by_source"]}
  dot = groups["sinkjax/model.py:10 chunked_nll.<locals>.block", "forward", "loss"]
  assert (dot["hbm_bytes"], dot["flops"], dot["instructions"]) == (3 * (2 * H + W), 3 * MATMUL, 1)
  assert sum(g["hbm_bytes"] for g in b["by_source"]) == costs["hbm_bytes"]
  assert sum(g["instructions"] for g in b["by_source"]) == sum(c["instructions"] for c in b["by_category"].values())
  assert [g["hbm_bytes"] for g in b["by_source"]] == sorted((g["hbm_bytes"] for g in b["by_source"]), reverse=True)
