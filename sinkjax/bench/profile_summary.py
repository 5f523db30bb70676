"""A jax.profiler trace summarised into device time per kernel category: where a step's time goes.

    python -m sinkjax.bench.profile_summary TRACE_DIR [--hlo STEP.hlo.txt ...] [--steps N] [--top 8]

TRACE_DIR is a `jax.profiler.trace` log directory (the newest `*.trace.json.gz` under it is read; `jax.profiler`
writes one beside its xplane). The device's events are the kernels on a GPU's streams (processes named
/device:GPU:N), or on a CPU the XLA ops the runtime executes (events naming an `hlo_op`). Each is put in one category:

  collectives   all-reduce / all-gather / reduce-scatter / collective-permute / all-to-all, NCCL kernels
  attention     the attention kernel and its own elementwise work: HLO ops under the `sinkjax_attention` name scope
                (`sinkjax.kernels.flash`), cuDNN's fused attention, kernels named like flash / fmha / sdpa
  optimizer     HLO ops under the `optimizer` name scope (`sinkjax.step`: the optax update and its application)
  matmuls       dots and convolutions: HLO dot ops, fusions whose computation holds a dot, cuBLAS / GEMM kernels
  elementwise   everything else (norms, activations, gates, the loss, copies, ...)

An event is classified by its HLO op (`hlo_op` in the trace) looked up in the compiled program's text (--hlo: the
`Compiled.as_text()` of the step; the op's opcode, custom-call target, called computation and `op_name` metadata);
without it, or for an op not found there, by its names alone. A kernel that XLA:GPU ran inside a CUDA graph (`hlo_op`
"command_buffer_N") is classified and listed by its own name (an XLA fusion's instruction name, or cuBLAS's / cuDNN's
kernel name). Times are the sum of the events' durations (kernels
that overlap on several streams or CPU threads count in full), divided by --steps when given; loops, branches and
calls (XLA:CPU traces them around their bodies' ops) are left out, their bodies' ops counted instead.
"""
from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import pathlib
import re
import sys

from sinkjax import config, errors, hlo, options
from sinkjax.markdown import table

CATEGORIES = ("matmuls", "attention", "elementwise", "optimizer", "collectives")
_COLLECTIVE = re.compile(r"all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|nccl|allreduce|"
                         r"allgather|reducescatter", re.I)
_ATTENTION = re.compile(r"sinkjax_attention|sinkjax_flash|cudnn\$fmha|fmha|flash|sdpa|attention|cudnn::fusion::", re.I)
_MATMUL = re.compile(r"gemm|cublas|nvjet|xmma|cutlass|matmul|\bdot\b|dot\.|dot_general|convolution", re.I)
_CONTAINERS = ("while", "conditional", "call")
_CONTAINER = re.compile(r"^(while|conditional|call)(\.\d+)?$")
# XLA:GPU runs runs of kernels as CUDA graphs ("command buffers", formed on the thunks, so not in the HLO text); the
# profiler names each kernel in one by its graph (`hlo_op` "command_buffer_N"): such a kernel is known by its own name
# (the fusion's instruction name for XLA's kernels, the library's for cuBLAS / cuDNN)
_COMMAND_BUFFER = re.compile(r"^command_buffer(_\d+)?$")

def parse_hlo(text: str) -> dict:
  """{instruction name: category hint} of an HLO module's text (`hlo.parse_hlo`): for each instruction its opcode,
  custom-call target, op_name metadata and, for fusions and calls, whether the called computation holds a dot."""
  comps, _ = hlo.parse_hlo(text)
  target = {c: {n: _attr("custom_call_target", i.attrs) for n, i in body.items()} for c, body in comps.items()}
  has_dot = {c: any(i.opcode in ("dot", "convolution") or (target[c][n] and _MATMUL.search(target[c][n]))
                    for n, i in body.items()) for c, body in comps.items()}
  out = {}
  for c, body in comps.items():
    for name, i in body.items():
      calls = i.callees("calls|to_apply|body|condition")
      out[name] = dict(opcode=i.opcode, target=target[c][name], op_name=_attr("op_name", i.attrs), calls=calls,
                       has_dot=any(has_dot.get(callee, False) for callee in calls))
  return out


def _attr(name: str, attrs: str) -> str:
  m = re.search(name + r'="([^"]*)"', attrs)
  return m.group(1) if m else ""


def categorize(name: str, info: dict | None = None) -> str:
  """The category of one device event: its kernel / op name and, when known, its HLO instruction's info."""
  info = info or {}
  opcode, target, op_name = info.get("opcode", ""), info.get("target", ""), info.get("op_name", "")
  if _COLLECTIVE.search(opcode) or _COLLECTIVE.search(name):
    return "collectives"
  if "sinkjax_attention" in op_name or _ATTENTION.search(target) or (not info and _ATTENTION.search(name)):
    return "attention"
  if re.search(r"(^|/)optimizer(/|$)", op_name):
    return "optimizer"
  if opcode in ("dot", "convolution") or _MATMUL.search(target) or info.get("has_dot") or \
      (not info and _MATMUL.search(name)):
    return "matmuls"
  return "elementwise"


def _trace_file(path: pathlib.Path) -> pathlib.Path:
  if path.is_file():
    return path
  files = sorted(path.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
  if not files:
    raise FileNotFoundError(f"no *.trace.json.gz under {path}: pass the log directory of a jax.profiler.trace")
  return files[-1]


def device_events(trace: dict) -> list:
  """[(name, hlo_op or "", hlo_module or "", duration µs, start µs)] of the device's work in a Chrome-format trace."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpu = _gpu_pids(events)
  out = []
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    args = e.get("args", {}) or {}
    if gpu:
      if e.get("pid") not in gpu:
        continue
    elif "hlo_op" not in args:
      continue
    out.append((e.get("name", ""), str(args.get("hlo_op", "")), str(args.get("hlo_module", "")), float(e["dur"]),
                float(e.get("ts", 0.0))))
  return out


def in_flight(intervals) -> tuple[dict, collections.Counter]:
  """Over [first start, last end] of `intervals` [(start, duration, category)]: {ops running at once (0, 1, 2, ...):
  µs} and, per category, the µs its ops ran while no other op did. On a CPU the ops are XLA:CPU's thunks, run on its
  thread pool (independent thunks at once); the worker threads an op splits its own work over are not events, so
  one op in flight is not always one busy core (a large matmul fills both), but an elementwise op or a loop step
  alone is."""
  points = sorted([(t, +1, i) for i, (t, _, _) in enumerate(intervals)] +
                  [(t + d, -1, i) for i, (t, d, _) in enumerate(intervals)], key=lambda p: (p[0], p[1]))
  hist, alone, running = collections.Counter(), collections.Counter(), set()
  last = points[0][0] if points else 0.0
  for t, step, i in points:
    hist[len(running)] += t - last
    if len(running) == 1:
      alone[intervals[next(iter(running))][2]] += t - last
    last = t
    (running.add if step > 0 else running.discard)(i)
  return dict(sorted(hist.items())), alone


def summarize(trace_path, hlo_texts=(), steps: int | None = None) -> dict:
  """{"by_category": {category: µs}, "total_us", "top": [(name, category, µs)], "events": n} (per step if steps)."""
  trace = json.load(gzip.open(_trace_file(pathlib.Path(trace_path)), "rt"))
  info = {}
  for text in hlo_texts:
    info.update(parse_hlo(text))
  by_cat, by_name = collections.Counter({c: 0.0 for c in CATEGORIES}), collections.Counter()
  cat_of = {}
  intervals = []
  for name, op, _, dur, ts in device_events(trace):
    if _COMMAND_BUFFER.match(op) and op not in info:
      op = ""                   # a kernel in a CUDA graph: known by its own name
    hint = _hint(info, op, name)
    if (hint or {}).get("opcode") in _CONTAINERS or (not hint and _CONTAINER.match(op or name)):
      continue                  # a loop / branch / call whose body's ops are events of their own (XLA:CPU)
    cat = categorize(name, hint)
    by_cat[cat] += dur
    key = op or name
    by_name[key] += dur
    cat_of[key] = cat
    intervals.append((ts, dur, cat))
  div = steps or 1
  out = {"by_category": {c: by_cat[c] / div for c in CATEGORIES}, "total_us": sum(by_cat.values()) / div,
         "top": [(n, cat_of[n], t / div) for n, t in by_name.most_common()], "events": len(intervals),
         "classified_by_hlo": bool(info)}
  if intervals and not _gpu_pids(trace["traceEvents"] if isinstance(trace, dict) else trace):
    hist, alone = in_flight(intervals)
    out["in_flight_us"] = {k: v / div for k, v in hist.items()}
    out["alone_us"] = {c: alone[c] / div for c in CATEGORIES}
  return out


def _hint(info: dict, op: str, name: str) -> dict | None:
  """The HLO instruction of an event: its hlo_op, else its kernel's name, which XLA:GPU writes with the instruction
  name's last '.' as '_' ("loop_multiply_fusion_4" for %loop_multiply_fusion.4)."""
  return info.get(op) or info.get(name) or info.get(re.sub(r"_(\d+)$", r".\1", name))


def _gpu_pids(events) -> set:
  """The trace's processes named /device:GPU:N (a GPU's streams); empty for a CPU trace."""
  return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
          and re.search(r"/device:GPU", e.get("args", {}).get("name", ""))}


def format_summary(s: dict, top: int = 8, per: str = "step") -> str:
  total = s["total_us"] or 1.0
  lines = table(["category", f"ms / {per}", "share"],
                [*([c, f"{s['by_category'][c] / 1e3:.3f}", f"{s['by_category'][c] / total:.1%}"] for c in CATEGORIES),
                 f"| total (device busy) | {s['total_us'] / 1e3:.3f} | |"], "lrr")
  lines.append(f"\n{s['events']} device events, classified by {'the HLO' if s['classified_by_hlo'] else 'name'}; "
               f"top {top} ops:")
  lines += [f"  {t / 1e3:9.3f} ms  {c:<12} {n[:90]}" for n, c, t in s["top"][:top]]
  if "in_flight_us" in s:
    span = sum(s["in_flight_us"].values()) or 1.0
    lines.append(f"\nops in flight (XLA:CPU thunks; wall {span / 1e3:.3f} ms / {per}, from the first op to the last): " +
                 ", ".join(f"{k}: {v / 1e3:.3f} ms ({v / span:.0%})" for k, v in s["in_flight_us"].items()))
    lines.append("one op alone, by category: " + ", ".join(f"{c} {s['alone_us'][c] / 1e3:.3f} ms" for c in CATEGORIES
                                                           if s["alone_us"][c]))
  return "\n".join(lines)


@dataclasses.dataclass
class ProfileSummaryOptions:
  """The profile_summary.* options (`python -m sinkjax.bench.profile_summary TRACE_DIR ...`; the trace is the one word
  without "=", or --trace; each flag the alias of its key)."""
  trace: str = config.declare("", alias="--trace", metavar="TRACE_DIR", required=True,
                          help="a jax.profiler.trace log directory (or one *.trace.json.gz)")
  hlo: list = config.declare([], alias="--hlo", nargs="+", metavar="STEP.hlo.txt",
                         help="compiled program text(s) of the traced step (as_text())")
  steps: int | None = config.declare(None, ">=1", alias="--steps", help="steps in the trace (times are divided by it)")
  top: int = config.declare(8, ">=1", alias="--top", help="ops listed under the table")


COMMAND = options.Command(prog="python -m sinkjax.bench.profile_summary", description=__doc__,
                          sections={"profile_summary": ProfileSummaryOptions}, positional="profile_summary.trace",
                          raw_description=True)


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, _: print_summary(sections["profile_summary"]))


def print_summary(opts: ProfileSummaryOptions) -> None:
  try:
    s = summarize(opts.trace, [pathlib.Path(h).read_text() for h in opts.hlo], opts.steps)
  except FileNotFoundError as e:
    raise errors.UserError(str(e)) from None
  print(format_summary(s, opts.top, "step" if opts.steps else "trace"))


if __name__ == "__main__":
  sys.exit(main())
