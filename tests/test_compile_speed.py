"""What `sinkjax.compile` says about speed, checked against hand counts on compile-only v5e devices (libtpu, no TPU):
the Pallas kernels' cost estimates reach XLA's cost analysis, the report's FLOPs per step count every layer and loop
trip and split off recomputation as the remat policy decides, and --search picks the policy a hand count picks.

Needs libtpu (`pip install 'sinkjax[tpu]'`; .ci/run adds it); skipped with the reason where it is absent."""
import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytest.importorskip("libtpu", reason="libtpu not installed: pip install 'sinkjax[tpu]' (the TPU compile tests)")

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from sinkjax import compile as compile_lib  # noqa: E402
from sinkjax import hlo  # noqa: E402
from sinkjax.config import load_config  # noqa: E402
from sinkjax.kernels import flash_attention  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _causal_tiles(n_blocks):
  """Tiles at or below the diagonal of an n x n grid of equal square blocks (what a causal kernel computes)."""
  return n_blocks * (n_blocks + 1) // 2


def _attention_flops(T, D, fwd_block=512, bwd_block=256):
  """One (row, head) of the Pallas TPU kernel, causal, T = S, default tiles, counted by hand: the forward's 2 matmuls
  per tile, the dk/dv pass's 4 and the dq pass's 3, 2 * bq * bk * D flops each."""
  fwd = 2 * 2 * fwd_block ** 2 * D * _causal_tiles(T // fwd_block)
  bwd = (4 + 3) * 2 * bwd_block ** 2 * D * _causal_tiles(T // bwd_block)
  return fwd, bwd


def test_kernel_cost_estimates_reach_xla_cost_analysis():
  """Flash attention forward + backward on v5e: XLA's cost_analysis() of the compiled program holds the Mosaic
  kernels' FLOPs (before the kernels stated a pl.CostEstimate it saw none), within 10 % of the hand count."""
  devices = compile_lib.tpu_devices(compile_lib.parse_topology("v5e:2x2"))
  mesh = Mesh(np.array(devices).reshape(4, 1, 1), ("data", "fsdp", "tensor"))
  B, T, H, D = 4, 1024, 2, 128
  spec = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))

  def loss(q, k, v):
    out, lse = flash_attention(q, k, v, impl="pallas_tpu")
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
  fwd, bwd = _attention_flops(T, D)
  expected = (B // 4) * H * (fwd + bwd)                   # one row per chip
  assert abs(compiled.cost_analysis()["flops"] / expected - 1) < 0.10, (compiled.cost_analysis()["flops"], expected)
  assert hlo.hlo_costs(compiled.as_text())["flops"] == pytest.approx(expected, rel=0.05)


def test_pallas_gpu_kernels_state_their_cost():
  """The Triton kernels carry a pl.CostEstimate too (forward, dq, dk/dv): their matmul FLOPs over the causally
  visible tiles, counted by hand for the default tiles (forward 128 x 64, backward 64 x 64) at T 256, D 64."""
  B, T, H, D = 1, 256, 2, 64
  q = jnp.zeros((B, T, H, D), jnp.float32)
  f = lambda q, k, v: jnp.sum(flash_attention(q, k, v, impl="pallas_gpu", interpret=True)[0])
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, q, q)
  costs = {}

  def visit(jx):
    for eqn in jx.eqns:
      if eqn.primitive.name == "pallas_call":
        costs[eqn.params["name"]] = eqn.params["cost_estimate"].flops
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jaxpr.jaxpr)
  fwd_tiles = sum(min(4, (i * 128 + 127) // 64 + 1) for i in range(2))       # 2 query blocks x up to 4 key blocks
  bwd_tiles = _causal_tiles(4)
  assert costs == {"sinkjax_flash_fwd": B * H * fwd_tiles * 2 * 2 * 128 * 64 * D,
                   "sinkjax_flash_bwd_dq": B * H * bwd_tiles * 3 * 2 * 64 * 64 * D,
                   "sinkjax_flash_bwd_dkv": B * H * bwd_tiles * 4 * 2 * 64 * 64 * D}, costs


@pytest.mark.parametrize("rows,width,in_vmem", [(16384, 8192, False), (8192, 4096, True)])
def test_hbm_bytes_equal_a_hand_count(rows, width, in_vmem):
  """A scan of 4 layers h = tanh(h @ W[l]) on one v5e chip (bf16). HBM bytes by hand, from what XLA:TPU makes of it:
  with h of 256 MiB (more than the chip's 128 MiB of VMEM) a copy of x into the loop's buffer (2h), then per trip a
  copy of the carried h (2h) and the matmul fusion (reads h and the slice W[l], writes h); with h of 64 MiB, h lives
  in VMEM between trips: x copied in (h), per trip copied out to HBM (h) for the fusion to read (h + W[l]) and write
  back to VMEM, the result copied out (h). The stacked W is read a slice per trip, not whole (the fusion slices it in
  a nested fusion), and an async copy's operand, which its output tuple repeats, counts once."""
  devices = compile_lib.tpu_devices(compile_lib.parse_topology("v5e:2x2"))
  mesh = Mesh(np.array(devices[:1]), ("x",))
  layers = 4
  x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  w = jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  f = lambda x, w: jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]
  compiled = jax.jit(f).lower(x, w).compile()
  h, wl = rows * width * 2, width * width * 2
  per_trip = 2 * h + wl if in_vmem else 4 * h + wl
  costs = hlo.hlo_costs(compiled.as_text())
  assert costs["hbm_bytes"] == pytest.approx(2 * h + layers * per_trip, rel=0.01)
  assert costs["flops"] == 2 * rows * width * width * layers
  if not in_vmem:                      # XLA's own count (all memory spaces) holds the loop body once
    assert compiled.cost_analysis()["bytes accessed"] == pytest.approx(2 * h + per_trip, rel=0.01)
    # the roofline's sequential term: the copies at the HBM bandwidth, each trip's matmul fusion at its own bound
    # (compute here: 2.2e12 FLOPs against 0.67 GB), one after another
    v5e = hlo.CHIPS["v5e"]
    seq = (2 * h + layers * 2 * h) / v5e.hbm_bandwidth + layers * max(2 * rows * width * width / v5e.peak_flops,
                                                                       (2 * h + wl) / v5e.hbm_bandwidth)
    terms = hlo.roofline(costs, v5e, 0.0)["estimated_seconds_by_term"]
    assert terms["sequential"] == pytest.approx(seq, rel=0.01)
    assert terms["sequential"] > max(terms["compute"], terms["hbm"])


# Two layers, bfloat16, the Mosaic kernel, FSDP over 4 chips, AdamW (no matmuls in the optimizer).
L, DM, H, HD, T, V, ROWS = 2, 256, 2, 128, 512, 512, 8
SMALL = [f"model.num_layers={L}", "train.optimizer=adamw", f"model.d_model={DM}", f"model.num_heads={H}",
         f"model.num_kv_heads={H}", f"model.head_dim={HD}", f"data.seq_len={T}", f"model.max_seq_len={T}",
         f"model.vocab_size={V}", f"train.batch_size={ROWS}", "mesh.data=1", "mesh.fsdp=4", "model.dtype=bfloat16"]


@functools.lru_cache(maxsize=None)
def _report(*overrides):
  cfg = load_config(TINY, SMALL + list(overrides))
  topo = compile_lib.parse_topology("v5e:2x2")
  return compile_lib.compile_config(cfg, topo, eval_step=False, devices=compile_lib.tpu_devices(topo))


def _by_hand(policy, loss_chunk=0, rows=ROWS):
  """(FLOPs, recomputed FLOPs) per chip of one train step: 6 x matmul weights x tokens, plus the attention kernels;
  recomputed: the layers' matmuls again (2 x weights x tokens) unless saved (dots, or the ones a policy names),
  except the MLP's down projection, whose output no gradient needs; the kernel's forward unless its outputs are saved
  (save_attention); and with a chunked loss the LM head's matmul (its scan body is rematerialized)."""
  tokens = rows // 4 * T
  layer_weights = 4 * DM * H * HD + 2 * DM * 4 * DM             # q, k, v, o; MLP up and down
  head = DM * V
  fwd, bwd = _attention_flops(T, HD)
  heads = rows // 4 * H * L
  flops = 6 * (L * layer_weights + head) * tokens + heads * (fwd + bwd)
  proj, up = DM * H * HD, DM * 4 * DM                            # one of q, k, v, o; the MLP's up projection
  recompute = {None: 0, "nothing": 2 * L * (4 * proj + up) * tokens + heads * fwd, "dots": heads * fwd,
               # the projections saved before QK-norm: o, up and the kernel's forward run again
               "save_qkv_proj": 2 * L * (proj + up) * tokens + heads * fwd,
               # the attention output saved: q, k, v (QK-norm's backward needs their matmuls' results), up, the kernel
               "save_out_proj": 2 * L * (3 * proj + up) * tokens + heads * fwd,
               "save_attention": 0}[policy] + (2 * head * tokens if loss_chunk else 0)
  return flops + recompute, recompute


# The --search candidates: scanned layers, a chunked loss, data parallel (2 rows per chip; no weight gathers, so the
# policies' step bounds differ by their compute and HBM terms), compiled once per policy by compile.search itself.
SEARCH = SMALL + ["model.scan_layers=true", "mesh.data=4", "mesh.fsdp=1", "train.loss_chunk=128"]
SEARCH_POLICIES = ("nothing", "save_attention")


@functools.lru_cache(maxsize=None)
def _search():
  return compile_lib.search(TINY, SEARCH, compile_lib.parse_topology("v5e:2x2"), SEARCH_POLICIES)


# one policy by default; the others repeat its ~25 s XLA:TPU compile
@pytest.mark.parametrize("policy", [pytest.param(None, marks=pytest.mark.slow), "nothing",
                                    pytest.param("dots", marks=pytest.mark.slow),
                                    pytest.param("save_qkv_proj", marks=pytest.mark.slow),
                                    pytest.param("save_out_proj", marks=pytest.mark.slow),
                                    pytest.param("save_attention", marks=pytest.mark.slow)])
def test_report_flops_equal_a_hand_count(policy):
  """Scanned layers (a while loop of 2 trips) and, with remat, a chunked loss (4 trips): the report counts every
  trip, and its recomputed FLOPs are what the policy recomputes, both within 5 % of the hand count. Without remat:
  FSDP over 4 chips (the weights gathered); nothing and save_attention: the --search candidates (data parallel)."""
  if policy in SEARCH_POLICIES:
    r = next(c for c in _search()["candidates"] if c["remat_policy"] == policy)
    flops, recompute = _by_hand(policy, 128)
    gathered, reduced = "all-reduce", "all-reduce"                  # the gradients, summed over the data axis
  else:
    ov = ["model.scan_layers=true"] + (["model.remat=true", f"model.remat_policy={policy}"] if policy else [])
    chunk = 128 if policy else 0
    r = _report(*ov, f"train.loss_chunk={chunk}")
    flops, recompute = _by_hand(policy, chunk)
    gathered, reduced = "all-gather", "reduce-scatter"              # FSDP gathers the weights
  assert r["flops_per_step"] == pytest.approx(flops, rel=0.05)
  assert r["recompute_flops_per_step"] == pytest.approx(recompute, rel=0.05, abs=0.01 * flops)
  assert r["loops_of_unknown_trips"] == 0
  assert set(r["collective_bytes_per_step"]) >= {"all-gather", "reduce-scatter", "all-reduce"}
  assert r["collective_bytes_per_step"][gathered] > 0 and r["collective_bytes_per_step"][reduced] > 0
  t = r["estimated_seconds_by_term"]
  assert r["estimated_step_seconds"] == max(t.values())
  assert t["compute"] == pytest.approx(r["flops_per_step"] / 197e12)
  assert r["estimated_mfu"] == pytest.approx(r["model_flops_per_step"] / 4 / 197e12 / r["estimated_step_seconds"])


def _hand_pick(candidates, loss_chunk=128):
  """The candidate whose step bound is least when its compute term is its hand-counted FLOPs at v5e's peak and its
  byte terms are the report's."""
  bound = {c["remat_policy"]: max(_by_hand(c["remat_policy"], loss_chunk)[0] / 197e12,
                                  c["estimated_seconds_by_term"]["hbm"], c["estimated_seconds_by_term"]["ici"])
           for c in candidates if c["fits"]}
  return min(bound, key=bound.get)


def test_search_picks_the_policy_a_hand_count_picks():
  """compile.search over nothing and save_attention: both fit, and it picks what the hand count picks."""
  res = _search()
  assert [c["remat_policy"] for c in res["candidates"]] == list(SEARCH_POLICIES)
  assert all(c["fits"] and c["remat"] for c in res["candidates"])
  assert res["picked"]["remat_policy"] == _hand_pick(res["candidates"])


@pytest.mark.slow   # two XLA:TPU compiles (~28 s); the hand count of the flops is checked by default
def test_scanned_and_unscanned_programs_report_the_same_flops():
  """XLA's cost_analysis() counts the scanned program's loop body once; the report counts it per trip."""
  scanned, unrolled = _report("model.scan_layers=true", "train.loss_chunk=0"), _report("model.scan_layers=false")
  assert scanned["flops_per_step"] == pytest.approx(unrolled["flops_per_step"], rel=0.01)


def test_offload_is_refused_where_there_is_no_device_memory():
  from sinkjax.model import REMAT_POLICIES
  with pytest.raises(ValueError, match="model.remat_policy=offload_dots offloads to host memory.*use "
                                       "model.remat_policy=dots"):
    REMAT_POLICIES["offload_dots"]()          # no mesh: the CPU host's program
  assert REMAT_POLICIES["save_attention"]() is not None


@pytest.mark.slow
def test_search_command_prints_the_table_and_the_pick(tmp_path):
  """python -m sinkjax.compile --search on the same candidates: the JSON, the table's marked row and the last line
  name the hand count's pick."""
  out = tmp_path / "s.json"
  r = subprocess.run([sys.executable, "-m", "sinkjax.compile", "--config", TINY, "--topology", "v5e:2x2", "--search",
                      ",".join(SEARCH_POLICIES), "--json", str(out), *SEARCH], cwd=ROOT, capture_output=True,
                     text=True, timeout=1200, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-2000:]
  res = json.loads(out.read_text())
  expected = _hand_pick(res["candidates"])
  assert res["candidates"][res["picked"]]["remat_policy"] == expected
  assert f"picked: model.remat_policy={expected}" in r.stdout and f"| {expected} **picked** |" in r.stdout


@pytest.mark.slow
def test_d20_paper_config_fits_v5e_32_with_no_more_recomputation_than_dots():
  """configs/paper/d20_sink_aux.yaml as configured, at v5e:4x8 (8 rows x 2048 per chip): fits 16 GiB, and its
  compiled FLOPs per chip are not above the dots policy's (~2 x 200-800 s of compiling on 2 cores)."""
  topo = compile_lib.parse_topology("v5e:4x8")
  devices = compile_lib.tpu_devices(topo)
  ov = ["model.vocab_size=65536"]
  cfg = load_config(str(ROOT / "configs/paper/d20_sink_aux.yaml"), ov)
  r = compile_lib.compile_config(cfg, topo, eval_step=False, devices=devices)
  dots = compile_lib.compile_config(load_config(str(ROOT / "configs/paper/d20_sink_aux.yaml"),
                                                ov + ["model.remat_policy=dots"]), topo, eval_step=False,
                                    devices=devices)
  assert r["fits"] and r["rows_per_chip"] == 8 and r["attention_kernel"] == "mosaic"
  assert r["flops_per_step"] <= dots["flops_per_step"]
  for key in ("flops_per_step", "recompute_flops_per_step", "collective_bytes_per_step", "estimated_step_seconds",
              "estimated_mfu"):
    assert key in r


WINDOWED = ROOT / "docs" / "results" / "tpu_compile" / "hlo" / "d20_gated_depth4_v5e-32.hlo.txt.gz"
WINDOWED_ARGS = ("configs/paper/d20_gated_aux.yaml", "v5e:4x8", "model.vocab_size=65536", "model.depth=4",
                 "mesh.collective_matmul=windowed",     # XLA:TPU's windowed einsums (the default gathers the weights)
                 "train.loss_impl=autodiff")            # as recorded: the chunked loss runs the LM head again


def _windowed_by_hand():
  """FLOPs per chip of configs/paper/d20_gated_aux.yaml at depth 4 (4 layers x 256 wide, 2 heads of 128, headwise
  gates, vocabulary 65,536) on v5e-32, 8 rows x 2048 per chip, remat save_attention, chunked loss, Muon: 6 x matmul
  weights x tokens, the chunked loss's LM head again, and the Mosaic kernels' tiles (forward 512-blocks: 10 causal
  tiles x 2 matmuls; backward 256-blocks: 36 tiles x 7 matmuls). Muon's Newton-Schulz work is left out: sharded over
  the 32 chips it is under 0.05 % of the step."""
  layers, d, heads, hd, V, tokens, T = 4, 256, 2, 128, 65536, 8 * 2048, 2048
  weights = layers * (4 * d * d + 2 * d * 4 * d + d * heads) + V * d
  attention = 8 * heads * layers * (2 * 2 * 512 ** 2 * hd * _causal_tiles(T // 512)
                                    + 7 * 2 * 256 ** 2 * hd * _causal_tiles(T // 256))
  return 6 * weights * tokens + 2 * V * d * tokens + attention, 2 * V * d * tokens


def _windowed_program_text():
  import gzip  # pylint: disable=import-outside-toplevel
  return gzip.open(WINDOWED, "rt").read()


def test_windowed_einsum_loops_count_their_trips():
  """FSDP over 32 chips makes XLA:TPU decompose the layers' all-gathered matmuls into `windowed_dot_general` loops
  (23 in this program, recorded from libtpu 0.0.42.1 by the slow twin below): u32 counters stepping by 2, each trip
  two shards' matmuls. Before they were read, every such loop counted once (`loops_of_unknown_trips` 23, FLOPs 1.6e12
  of a hand count of 2.9e12: the d26 / d32 searches compared candidates on such counts); now the count matches the
  hand count within 0.1 %, recomputation exactly."""
  costs = hlo.hlo_costs(_windowed_program_text())
  flops, recompute = _windowed_by_hand()
  assert costs["loops_of_unknown_trips"] == 0
  assert costs["flops"] == pytest.approx(flops, rel=1e-3)
  assert costs["recompute_flops"] == recompute


@pytest.mark.slow  # 45 s of compiling on 2 cores: regenerates the recorded program the test above reads
def test_windowed_einsum_program_compiles_to_the_recorded_counts():
  cfg = load_config(str(ROOT / WINDOWED_ARGS[0]), list(WINDOWED_ARGS[2:]))
  topo = compile_lib.parse_topology(WINDOWED_ARGS[1])
  report = compile_lib.compile_config(cfg, topo, eval_step=False)
  flops, recompute = _windowed_by_hand()
  assert report["loops_of_unknown_trips"] == 0
  assert report["flops_per_step"] == pytest.approx(flops, rel=1e-3)
  assert report["recompute_flops_per_step"] == recompute
