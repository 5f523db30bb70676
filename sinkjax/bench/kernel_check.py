"""Correctness of the attention backends against the materialized reference, with the LSE gradient: the device check.

    python -m sinkjax.bench.kernel_check [--impls cudnn pallas_gpu] [--seq 512] [--dtype bfloat16]

For each case (MHA, GQA 4:1; no segment ids, all-ones ids, packed documents with padding, more documents per row than
the cudnn backend's packed route takes; sink attention with the aux loss) and backend, the largest error of out, lse
and of the gradients dq, dk, dv (and d sink) of a loss through BOTH outputs, relative to the largest reference value,
with cotangents g != 0 on every row and rows whose out cotangent is 0 (the `sinkjax.kernels.fold` substitute rows).
The reference is `sinkjax.kernels.reference` (materialized softmax, float32 math on the same inputs) differentiated
by JAX autodiff.

With cudnn or mosaic_gpu among the backends it also checks the premise of their LSE gradient: cuDNN's (tokamax's)
backward reads the forward output O only through D = rowsum(dO o O). Given O + W (W a large per-row vector orthogonal
to dO, so D is unchanged up to rounding), the backend's backward must agree with a materialized backward that reads O
only through D (`through_d`, FlashAttention-2's formula) given the same O + W; a backward that used O otherwise would
differ at O(1). Its verdict is a failure like any case's (tests/test_kernel_check.py runs it on a backward that reads O
beyond D).

On a CPU (the dry run of launch/gpu_measure.sh --check: `--impls xla cudnn mosaic_gpu pallas_gpu --dtype float32`)
the same cases run on the backends that have a CPU form: xla, pallas_gpu interpreted, mosaic_gpu's (tokamax's XLA
forward, an FA2 backward reading O only through D) where tokamax is installed; cudnn, and mosaic_gpu without tokamax,
get one row saying why they were skipped. On a GPU nothing is skipped: a backend named (or, without --impls, every GPU
backend) that cannot run there fails the check. Prints one table row per (case, backend); exit status 1 if any error
exceeds the tolerance (bf16 2e-2, f16 1e-2, f32 2e-4), a backend fails to run, or a backend is skipped on a GPU.
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from sinkjax import options
from sinkjax.attention import sink_attention
from sinkjax.balance import aux_loss, head_importance
from sinkjax.config import declare
from sinkjax.kernels import flash_attention
from sinkjax.markdown import row, table

TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 2e-4}


def segments(kind: str, B: int, T: int):
  """[B, T] int32 segment ids of a case, or None."""
  if kind == "none":
    return None
  if kind == "ones":
    return jnp.ones((B, T), jnp.int32)
  if kind == "docs":        # row 0: three documents and padding; other rows: two documents
    rows = [[1] * (T // 4) + [2] * (T // 2 - T // 4) + [3] * (T - T // 2 - 7) + [0] * 7]
    rows += [[5] * (T // 3) + [6] * (T - T // 3)] * (B - 1)
    return jnp.array(rows, jnp.int32)
  if kind == "many_docs":   # 20 documents per row: more than the cudnn backend's packed route (its Triton fallback)
    return jnp.broadcast_to(1 + jnp.arange(T, dtype=jnp.int32) * 20 // T, (B, T))
  raise ValueError(kind)


CASES = (("mha", 8, 8, "none"), ("gqa", 8, 2, "none"), ("mha_ones", 8, 8, "ones"), ("gqa_docs", 8, 2, "docs"),
         ("mha_many_docs", 4, 4, "many_docs"), ("sink_aux_gqa_docs", 8, 2, "docs"))


def _inputs(B, T, Hq, Hkv, D, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q = jax.random.normal(ks[0], (B, T, Hq, D)).astype(dtype)
  k = jax.random.normal(ks[1], (B, T, Hkv, D)).astype(dtype)
  v = jax.random.normal(ks[2], (B, T, Hkv, D)).astype(dtype)
  w = jax.random.normal(ks[3], (B, T, Hq, D)).at[:, ::7].set(0.0)       # rows with dO = 0 (and g != 0)
  u = jax.random.normal(ks[4], (B, Hq, T))
  sink = jax.random.normal(ks[5], (Hq,))
  return q, k, v, w, u, sink


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  fin = np.isfinite(b)
  if not np.array_equal(np.isfinite(a), fin):
    return float("inf")
  scale = max(float(np.max(np.abs(b[fin]), initial=0.0)), 1e-30)
  return float(np.max(np.abs(a[fin] - b[fin]), initial=0.0)) / scale


def check_case(name, Hq, Hkv, seg_kind, impl, *, B, T, D, dtype):
  """{"out": err, "lse": err, "dq": ..., "dk": ..., "dv": ...(, "dsink")} of `impl` against the reference."""
  q, k, v, w, u, sink = _inputs(B, T, Hq, Hkv, D, dtype)
  seg = segments(seg_kind, B, T)
  valid = None if seg is None else (seg != 0)

  if name.startswith("sink_aux"):
    def outputs(q, k, v, sink, impl):
      out, gate = sink_attention(q, k, v, sink, segment_ids=seg, impl=impl)
      return out, gate

    def loss(q, k, v, sink, impl):
      out, gate = outputs(q, k, v, sink, impl)
      imp = head_importance(gate, valid)[None]
      return jnp.sum(out.astype(jnp.float32) * w) + aux_loss(imp, weight=1.0)
    args = (q, k, v, sink)
  else:
    def outputs(q, k, v, impl):
      return flash_attention(q, k, v, causal=True, segment_ids=seg, impl=impl)

    def loss(q, k, v, impl):
      out, lse = outputs(q, k, v, impl)
      return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u)
    args = (q, k, v)

  argnums = tuple(range(len(args)))
  run = lambda i: jax.jit(lambda *a: (outputs(*a, i), jax.grad(loss, argnums)(*a, i)))(*args)
  key = (name, B, T, D, jnp.dtype(dtype).name)
  if key not in _REFERENCE:              # computed once per case, shared by the backends checked
    _REFERENCE.clear()
    _REFERENCE[key] = run("reference")
  (o0, l0), g0 = _REFERENCE[key]
  (o1, l1), g1 = run(impl)
  errs = {"out": _rel(o1, o0), "lse" if not name.startswith("sink") else "gate": _rel(l1, l0)}
  for n, a, b in zip(("dq", "dk", "dv", "dsink"), g1, g0):
    errs[n] = _rel(a, b)
  return errs


_REFERENCE = {}


def _raw_bwd(impl: str, interpret: bool):
  """The backend's own backward given (lse, O, dO) with no LSE cotangent: what `fold` feeds a substitute O' to."""
  # pylint: disable=import-outside-toplevel,protected-access
  if impl == "xla":          # a backward that reads O only through D by construction (a control for the check itself)
    from sinkjax.kernels import xla
    return lambda q, k, v, seg, lse, o, d, scale: xla.bwd(q, k, v, seg, seg, o, lse, d, jnp.zeros_like(lse),
                                                          causal=True, scale=scale)
  if impl == "cudnn":
    from sinkjax.kernels import cudnn
    return lambda q, k, v, seg, lse, o, d, scale: cudnn._bwd_call(q, k, v, lse, o, d, True, scale)
  from sinkjax.kernels import mosaic_gpu
  return lambda q, k, v, seg, lse, o, d, scale: mosaic_gpu._kernel_bwd(
      q, k, v, seg, o, lse, d, jnp.zeros_like(lse), causal=True, scale=scale, interpret=interpret, ranged=False)


O_THROUGH_D = ("cudnn", "mosaic_gpu")     # backends whose LSE gradient rests on their backward reading O only via D


def through_d(q, k, v, lse, out, dout, scale):
  """(dq, dk, dv) of causal attention (q, k, v [B, T, H, D], equal heads) by a materialized backward that reads `out`
  only through D = rowsum(dO o O): P = exp(s - lse), dS = P o (dO V^T - D) (FlashAttention-2's backward), float32."""
  q, k, v, out, dout = (x.astype(jnp.float32) for x in (q, k, v, out, dout))
  T, S = q.shape[1], k.shape[1]
  hi = jax.lax.Precision.HIGHEST
  s = jnp.einsum("bthd,bshd->bhts", q, k, precision=hi) * scale
  seen = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + (S - T)
  p = jnp.where(seen, jnp.exp(s - lse[..., None]), 0.0)
  d = jnp.einsum("bthd,bthd->bht", dout, out, precision=hi)
  ds = p * (jnp.einsum("bthd,bshd->bhts", dout, v, precision=hi) - d[..., None])
  return (jnp.einsum("bhts,bshd->bthd", ds, k, precision=hi) * scale,
          jnp.einsum("bhts,bthd->bshd", ds, q, precision=hi) * scale,
          jnp.einsum("bhts,bthd->bshd", p, dout, precision=hi))


def check_o_through_d(impl: str = "cudnn", *, B, T, H, D, dtype=jnp.bfloat16):
  """(err with O, err with O + W): the backend's backward (cuDNN's, tokamax's Mosaic-GPU) against the xla backend's
  given the same O, dO, stats (see the module docstring). Also returns how far O + W is from O (so that a pass is
  not vacuous)."""
  import importlib  # pylint: disable=import-outside-toplevel
  backend = importlib.import_module(f"sinkjax.kernels.{impl}")
  q, k, v, w, _, _ = _inputs(B, T, H, H, D, dtype, seed=1)
  scale = 1.0 / np.sqrt(D)
  ones = jnp.ones((B, T), jnp.int32)
  interpret = not on_gpu()                        # off a GPU (the dry run): mosaic_gpu's CPU form
  kw = {"interpret": True} if interpret else {}
  if impl != "xla":
    kw["segmented"] = False
  out, lse = jax.jit(lambda q, k, v: backend.fwd(q, k, v, ones, ones, causal=True, scale=scale, **kw))(q, k, v)
  dout = w.astype(dtype)
  r = jax.random.normal(jax.random.PRNGKey(9), out.shape)
  do32 = dout.astype(jnp.float32)
  n2 = jnp.maximum(jnp.sum(do32 * do32, -1, keepdims=True), 1e-30)
  perp = r - jnp.sum(r * do32, -1, keepdims=True) / n2 * do32                 # orthogonal to dO per row
  perp = 10.0 * perp / jnp.maximum(jnp.linalg.norm(perp, axis=-1, keepdims=True), 1e-30) * \
      jnp.linalg.norm(out.astype(jnp.float32), axis=-1, keepdims=True)
  moved = (out.astype(jnp.float32) + perp).astype(dtype)
  raw = _raw_bwd(impl, interpret)

  def both(o):
    got = jax.jit(lambda q, k, v, o, d: raw(q, k, v, ones, lse, o, d, scale))(q, k, v, o, dout)
    want = jax.jit(through_d, static_argnums=6)(q, k, v, lse, o, dout, scale)
    return max(_rel(a, b) for a, b in zip(got, want))
  return both(out), both(moved), _rel(moved, out)


@dataclasses.dataclass
class KernelCheckOptions:
  """The bench_kernel_check.* options (`python -m sinkjax.bench.kernel_check`; each flag the alias of its key)."""
  impls: list[str] | None = declare(None, alias="--impls", nargs="+", metavar="IMPL",
                                help="backends to check (default: cudnn mosaic_gpu pallas_gpu on a GPU, xla elsewhere)")
  seq: int = declare(512, ">=1", alias="--seq", help="sequence length")
  batch: int = declare(2, ">=1", alias="--batch", help="rows")
  head_dim: int = declare(128, ">=1", alias="--head-dim", help="head dimension")
  dtype: str | None = declare(None, choices=tuple(sorted(TOL)), alias="--dtype",
                          help="default: bfloat16 on a GPU, float32 elsewhere")
  cases: list[str] | None = declare(None, choices=tuple(c[0] for c in CASES), alias="--cases", nargs="+",
                                metavar="CASE", help="cases to run (default: all)")


COMMAND = options.Command(prog="python -m sinkjax.bench.kernel_check", description=__doc__,
                          sections={"bench_kernel_check": KernelCheckOptions},
                          raw_description=True)


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, _: run(sections["bench_kernel_check"]))


def on_gpu() -> bool:
  """Whether this process runs on a GPU (the device check) rather than a CPU (the dry run)."""
  return jax.default_backend() == "gpu"


GPU_IMPLS = ("cudnn", "mosaic_gpu", "pallas_gpu")     # what a GPU run checks without --impls: every GPU backend


def default_impls(gpu: bool) -> list[str]:
  return list(GPU_IMPLS) if gpu else ["xla"]


def unavailable_here(impl: str, gpu: bool) -> str | None:
  """Why `impl` has no form that runs on this CPU (the dry run, `launch/gpu_measure.sh --check`, names it and skips
  it), or None. On a GPU nothing is skipped: a backend that cannot run there is a failure."""
  if gpu:
    return None
  if impl == "cudnn":
    return "cuDNN's custom calls run only on NVIDIA GPUs (no interpret mode)"
  if impl == "mosaic_gpu":
    from sinkjax.kernels import mosaic_gpu  # pylint: disable=import-outside-toplevel
    try:
      mosaic_gpu._tokamax()  # pylint: disable=protected-access   # its own one-line reason where tokamax is absent
    except ImportError as e:
      return str(e)
  return None


def run(opts: KernelCheckOptions) -> int:
  """Checks every case on every backend against the reference and prints the table; 1 when one failed."""
  gpu = on_gpu()
  impls = opts.impls or default_impls(gpu)
  dtype_name = opts.dtype or ("bfloat16" if gpu else "float32")
  dtype, tol = jnp.dtype(dtype_name), TOL[dtype_name]
  cases = [c for c in CASES if opts.cases is None or c[0] in opts.cases]
  print(f"# kernel check: B={opts.batch} T={opts.seq} D={opts.head_dim} {dtype_name}, causal, loss through out and "
        f"LSE (g != 0; out cotangent 0 on every 7th row), errors relative to the reference's largest value, tolerance "
        f"{tol:g}; {jax.devices()[0].device_kind}")
  print("\n".join(table(["case", "backend", "out", "lse/gate", "dq", "dk", "dv", "dsink", "ok"])))
  failed = 0
  skipped = {impl: why for impl in impls if (why := unavailable_here(impl, gpu))}
  for impl, why in skipped.items():          # on a GPU a skip is a failure: the check would pass without the backend
    failed += gpu
    print(row(["every case", impl, f"skipped{' on a GPU' if gpu else ''}: {why}", *[""] * 5, "NO" if gpu else "-"]),
          flush=True)
  impls = [i for i in impls if i not in skipped]
  for name, Hq, Hkv, seg_kind in cases:
    for impl in impls:
      try:
        errs = check_case(name, Hq, Hkv, seg_kind, impl, B=opts.batch, T=opts.seq, D=opts.head_dim, dtype=dtype)
      except Exception as e:  # pylint: disable=broad-except   # one failing backend must not hide the others
        failed += 1
        print(row([name, impl, f"error: {' '.join(str(e).split())[:160]}", *[""] * 5, "no"]), flush=True)
        continue
      ok = all(x <= tol for x in errs.values())
      failed += not ok
      cells = [f"{errs.get(n, float('nan')):.1e}" if n in errs else "-" for n in ("out",)] + \
          [f"{errs[n]:.1e}" for n in errs if n in ("lse", "gate")] + \
          [f"{errs[n]:.1e}" if n in errs else "-" for n in ("dq", "dk", "dv", "dsink")]
      print(row([name, impl, *cells, "yes" if ok else "NO"]), flush=True)
  for impl in (i for i in O_THROUGH_D if i in impls):
    try:
      e0, e1, moved = check_o_through_d(impl, B=opts.batch, T=opts.seq, H=4, D=opts.head_dim, dtype=dtype)
      ok = e0 <= tol and e1 <= tol and moved > 1.0
      print(f"{impl} reads O only through D: grads vs through_d's given O {e0:.1e}, given O + W {e1:.1e} "
            f"(|W| {moved:.1f}x |O|): {'yes' if ok else 'NO'}", flush=True)
    except Exception as e:  # pylint: disable=broad-except
      ok = False
      print(f"{impl} reads O only through D: error: {' '.join(str(e).split())[:300]}")
    failed += not ok
  print(f"{'all passed' if not failed else f'{failed} FAILED'}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
