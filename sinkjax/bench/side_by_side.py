"""nanochat and sinkjax side by side on one device, in one run: tokens/s and MFU in nanochat's FLOP convention.

    python -m sinkjax.bench.side_by_side [--depth 20 --batch 32 --seq 2048 --vocab 65536] [--nanochat DIR]
                                         [--torch-python PY] [--out FILE] [--steps 4 --rounds 3] [key=value ...]
    python -m sinkjax.bench.side_by_side --ab LEVER [--baseline FILE] [--levers launch/gpu_levers.txt] [...]

Three rows, each in a fresh process of its own, one after the other (no two frameworks hold the device at once):
  nanochat          nanochat's GPT at --depth with its own training settings, timed by launch/nanochat_step.py (its
                    Muon + AdamW, torch.compile, bfloat16 autocast on a GPU, a step as base_train.py times it; median
                    of its timed steps after warm-up), run by --torch-python (a Python with torch: on the GPU image
                    the same python3 that holds jax) on the nanochat tree --nanochat (default
                    $SINKJAX_NANOCHAT_PEERS/nanochat-9d4c9b7, else .peers/nanochat-9d4c9b7, else
                    ../shared/peers/nanochat-9d4c9b7)
  sinkjax sink+aux  sinkjax's trainer at the same shape (model.depth = --depth: depth x 64 wide, heads of 128, the
                    vocabulary, rows and sequence length of nanochat's row) with sink attention and the aux loss
                    (lambda 1e-4), Muon + AdamW: `sinkjax.bench.trainer`'s "train loop" row (the loop of `sinkjax.train`
                    without evaluation and checkpoints), median block of --steps steps over --rounds rounds
  sinkjax vanilla   the same with vanilla attention and no aux term
The config is --config (default configs/d20_gpu.yaml where it exists, else configs/d20.yaml with GPU_D20 below);
trailing key=value words override it for both sinkjax rows (the dry run: model.attn_impl=xla, float32 ...).

MFU is nanochat's: FLOPs per token from `estimate_flops()` (6 x non-embedding parameters + 12 x layers x heads x
head_dim x T; `sinkjax.compile.model_flops_per_step` for sinkjax's rows, the same formula on its own parameter
count), times tokens/s, over --peak-tflops (989: base_train.py's figure, the H100's dense bf16 peak, which is also the
H200's in `sinkjax.hlo.CHIPS`), in percent. The table gives each row's tokens/s as a multiple of nanochat's.

--out FILE: the result as JSON, {"device", "commit", "rows": [{"name", "tokens_per_s", "mfu"} for nanochat, sinkjax
sink+aux, sinkjax vanilla], ...}, written only when all three rows were measured; the command exits 1 when a row
failed (its process exited non-zero, ran past --timeout, or printed no result).

--ab LEVER: the A/B of one lever of launch/gpu_levers.txt (one line per lever: `NAME: key=value ...`): B is the
sink+aux row with the lever's overrides; A is the sink+aux row of --baseline (the side by side's JSON of the same run,
same device) or, without one, measured here first. Prints A, B, B / A in tokens/s and one JSON line; exit 1 when an
arm failed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import threading
import time

from sinkjax import errors, options
from sinkjax.config import declare
from sinkjax.markdown import row, table

REPO = pathlib.Path(__file__).resolve().parents[2]
NANOCHAT_TREE = "nanochat-9d4c9b7"
RUNNER = REPO / "launch" / "nanochat_step.py"
LEVERS = REPO / "launch" / "gpu_levers.txt"
PEAK_TFLOPS = 989.0   # nanochat's base_train.py (H100 dense bf16); sinkjax.hlo.CHIPS gives the H200 the same
# configs/d20.yaml made into the GPU d20 of the side by side, where configs/d20_gpu.yaml does not exist yet: one
# device, the paper's remat policy, cuDNN attention, synthetic byte data (the data does not change the step's work).
# Synthetic byte data for every config (the paper configs read FineWeb-Edu shards a GPU machine does not hold).
DATA = ["data.source=default", "data.val_source=", "data.tokenizer=bytes"]
GPU_D20 = [*DATA, "mesh.data=1", "mesh.fsdp=1", "model.remat_policy=save_attention", "model.attn_impl=cudnn"]
ROWS = {"sinkjax sink+aux": ["model.attention=sink", "loss.aux_weight=0.0001", "loss.aux_term=true"],
        "sinkjax vanilla": ["model.attention=vanilla", "loss.aux_weight=0.0", "loss.aux_term=false"]}
ROW_ORDER = ("nanochat", "sinkjax sink+aux", "sinkjax vanilla")


@dataclasses.dataclass
class SideBySideOptions:
  """The bench_side_by_side.* options (`python -m sinkjax.bench.side_by_side`; each flag the alias of its key)."""
  config: str | None = declare(None, alias="--config", metavar="CONFIG",
                               help="sinkjax's training config (default configs/d20_gpu.yaml, else configs/d20.yaml "
                                    "with the GPU d20 overrides)")
  depth: int = declare(20, ">=1", alias="--depth", help="layers of both models (width 64 x depth, heads of 128)")
  batch: int = declare(32, ">=1", alias="--batch", help="rows per step")
  micro_batch: int = declare(16, ">=1", alias="--micro-batch",
                             help="sinkjax rows: rows per micro-step (16: d20 unscanned fits an 80 GB GPU with no "
                                  "matmul recomputed, docs/PERF.md; the step's tokens stay --batch x --seq)")
  seq: int = declare(2048, ">=1", alias="--seq", help="tokens per row")
  vocab: int = declare(65536, ">=1", alias="--vocab", help="vocabulary (nanochat's tokenizer: 65,536)")
  steps: int = declare(4, ">=1", alias="--steps", help="sinkjax rows: steps per timed block")
  rounds: int = declare(3, ">=1", alias="--rounds", help="sinkjax rows: timed blocks (median)")
  nanochat_warmup: int = declare(5, ">=1", alias="--nanochat-warmup", help="nanochat: untimed steps first")
  nanochat_steps: int = declare(10, ">=1", alias="--nanochat-steps", help="nanochat: timed steps (median)")
  no_compile: bool = declare(False, alias="--no-compile",
                             help="nanochat eager, torch.compile off (the dry run on a CPU: compiling costs minutes)")
  nanochat: str | None = declare(None, alias="--nanochat", metavar="DIR", help="the nanochat tree")
  torch_python: str | None = declare(None, alias="--torch-python", metavar="PY",
                                     help="the Python running nanochat (default $SINKJAX_TORCH_PYTHON, else this one)")
  peak_tflops: float = declare(PEAK_TFLOPS, ">0", alias="--peak-tflops", help="the MFU's peak, TFLOP/s")
  timeout: float = declare(600.0, ">0", alias="--timeout", help="seconds each row's process may take")
  out: str | None = declare(None, alias="--out", metavar="FILE", help="write the result as JSON here")
  ab: str | None = declare(None, alias="--ab", metavar="LEVER", help="the A/B of this lever instead")
  levers: str = declare(str(LEVERS), alias="--levers", metavar="FILE", help="the levers' file (NAME: key=value ...)")
  baseline: str | None = declare(None, alias="--baseline", metavar="FILE",
                                 help="--ab: the side by side's JSON of this run, whose sink+aux row is A")
  row: str | None = declare(None, choices=tuple(ROWS), alias="--row",
                            help="internal: time this sinkjax row in this process and print its JSON line")


COMMAND = options.Command(prog="python -m sinkjax.bench.side_by_side", description=__doc__,
                          sections={"bench_side_by_side": SideBySideOptions}, run_overrides=True, options_file=None,
                          raw_description=True)


def default_config() -> tuple[str, list[str]]:
  """(config, overrides it needs) of the GPU d20: configs/d20_gpu.yaml, else configs/d20.yaml + GPU_D20."""
  if (REPO / "configs" / "d20_gpu.yaml").is_file():
    return "configs/d20_gpu.yaml", list(DATA)
  return "configs/d20.yaml", list(GPU_D20)


def shape_overrides(o: SideBySideOptions) -> list[str]:
  """The sinkjax overrides of nanochat's shape: base_train.py's depth rule (model.depth), rows, T, vocabulary."""
  return [f"model.depth={o.depth}", f"train.batch_size={o.batch}", f"data.seq_len={o.seq}",
          f"model.max_seq_len={o.seq}", f"model.vocab_size={o.vocab}",
          f"train.grad_accum={max(1, o.batch // o.micro_batch)}"]


def nanochat_dir(o: SideBySideOptions) -> pathlib.Path:
  if o.nanochat:
    return pathlib.Path(o.nanochat)
  env = os.environ.get("SINKJAX_NANOCHAT_PEERS")
  for root in ([pathlib.Path(env)] if env else []) + [REPO / ".peers", REPO.parent / "shared" / "peers"]:
    if (root / NANOCHAT_TREE / "nanochat" / "gpt.py").is_file():
      return root / NANOCHAT_TREE
  return pathlib.Path(env or REPO / ".peers") / NANOCHAT_TREE


def git_commit() -> str:
  """The checkout's commit (short), '+dirty' when tracked files differ from it; $SINKJAX_COMMIT where there is no git
  repository (a copy of the tree); else 'unknown'."""
  try:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--"], capture_output=True,
                           timeout=30).returncode
    return head + ("+dirty" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return os.environ.get("SINKJAX_COMMIT", "unknown")


def last_json(stdout: str) -> dict | None:
  """The last line of `stdout` that is a JSON object, or None."""
  for line in reversed(stdout.strip().splitlines()):
    if line.startswith("{"):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        return None
  return None


def _kill_group(proc) -> None:
  """Ends a row's process and everything it started (its own process group: compile workers too)."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


def run_child(name: str, cmd: list[str], timeout: float) -> tuple[dict | None, str]:
  """Runs one row's process in a process group of its own, its output passed through to ours as it comes (a log
  shows a row that hangs); (its JSON result, '') or (None, why it failed). Past `timeout`, or when this process gets
  SIGTERM (the stage's limit in launch/gpu_measure.sh), the row's whole group is killed, so that no row outlives its
  stage and holds the device during the next one."""
  print(f"== {name}: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
  t0 = time.perf_counter()
  lines = []
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                          start_new_session=True)

  def pump():
    for line in proc.stdout:
      print(f"   | {line.rstrip()}", flush=True)
      lines.append(line)

  def on_term(signum, _frame):
    _kill_group(proc)
    sys.exit(128 + signum)
  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  previous = signal.signal(signal.SIGTERM, on_term)
  try:
    rc = proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    _kill_group(proc)
    return None, f"ran past its {timeout:g} s"
  finally:
    signal.signal(signal.SIGTERM, previous)
  reader.join(10)
  print(f"== {name}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
  got = last_json("".join(lines))
  if rc:
    return None, f"its process exited {rc}"
  if got is None or not {"tokens_per_s", "mfu"} <= set(got):
    return None, "its process printed no result"
  return got, ""


def nanochat_cmd(o: SideBySideOptions) -> list[str]:
  py = o.torch_python or os.environ.get("SINKJAX_TORCH_PYTHON") or sys.executable
  return [py, str(RUNNER), "--tree", str(nanochat_dir(o)), "--depth", str(o.depth), "--batch", str(o.batch),
          "--seq", str(o.seq), "--vocab", str(o.vocab), "--warmup", str(o.nanochat_warmup), "--steps",
          str(o.nanochat_steps), "--peak-tflops", str(o.peak_tflops)] + (["--no-compile"] if o.no_compile else [])


def sinkjax_cmd(o: SideBySideOptions, name: str, overrides: list[str]) -> list[str]:
  cmd = [sys.executable, "-m", "sinkjax.bench.side_by_side", "--row", name, "--depth", str(o.depth), "--batch",
         str(o.batch), "--seq", str(o.seq), "--vocab", str(o.vocab), "--steps", str(o.steps), "--rounds",
         str(o.rounds), "--peak-tflops", str(o.peak_tflops)]
  return cmd + (["--config", o.config] if o.config else []) + list(overrides)


def validate(doc: dict) -> None:
  """Raises ValueError unless `doc` is a complete side-by-side result: device and commit strings, and one row per
  name of ROW_ORDER with positive finite tokens_per_s and mfu (percent)."""
  if not isinstance(doc.get("device"), str) or not doc["device"] or not isinstance(doc.get("commit"), str):
    raise ValueError("side_by_side.json needs the device and commit strings")
  rows = {r.get("name"): r for r in doc.get("rows", [])}
  missing = [n for n in ROW_ORDER if n not in rows]
  if missing:
    raise ValueError(f"side_by_side.json misses the row(s) {', '.join(missing)}")
  for name in ROW_ORDER:
    for key in ("tokens_per_s", "mfu"):
      v = rows[name].get(key)
      if not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise ValueError(f"side_by_side.json: row {name!r} has {key} {v!r}, not a positive number")


def side_by_side(o: SideBySideOptions, overrides: list[str]) -> int:
  """The three rows, the table, and --out's JSON; 1 when a row failed."""
  got, failed = {}, {}
  res, why = run_child("nanochat", nanochat_cmd(o), o.timeout)
  (got if res else failed)["nanochat"] = res or why
  for name in ROWS:
    res, why = run_child(name, sinkjax_cmd(o, name, overrides), o.timeout)
    (got if res else failed)[name] = res or why
  print(f"\n# side by side: depth {o.depth}, {o.batch} x {o.seq} tokens per step, vocabulary {o.vocab}; MFU with "
        f"nanochat's estimate_flops over {o.peak_tflops:g} TFLOP/s")
  print("", *table(["row", "device", "step (ms)", "tokens/s", "MFU", "vs nanochat (tokens/s)", "FLOPs / token",
                    "setup"], align="llrrrrrl"), sep="\n")
  ref = got.get("nanochat", {}).get("tokens_per_s")
  for name in ROW_ORDER:
    if name in failed:
      print(row([name, "-", "-", "-", "-", "-", "-", f"FAILED: {failed[name]}"]))
      continue
    r = got[name]
    setup = (f"torch {r.get('torch')}, {'torch.compile' if r.get('compiled') else 'eager'}, autocast "
             f"{r.get('autocast')}" if name == "nanochat" else f"jax {r.get('jax')}, {r.get('params', 0):,} params")
    print(row([name, r.get("device", "?"), f"{r.get('step_ms', 0):.1f}", f"{r['tokens_per_s']:,.0f}",
               f"{r['mfu']:.1f} %", f"{r['tokens_per_s'] / ref:.3f}x" if ref else "-",
               f"{r.get('flops_per_token', 0):.4g}", setup]))
  if failed:
    print(f"\nside_by_side: {len(failed)} row(s) failed: {', '.join(failed)}; no JSON written")
    return 1
  device = got["sinkjax sink+aux"].get("device", "unknown")
  doc = {"device": device, "commit": git_commit(),
         "rows": [{"name": n, "tokens_per_s": got[n]["tokens_per_s"], "mfu": got[n]["mfu"]} for n in ROW_ORDER],
         "date": time.strftime("%Y-%m-%d", time.gmtime()),
         "shape": {"depth": o.depth, "batch": o.batch, "seq": o.seq, "vocab": o.vocab},
         "peak_tflops": o.peak_tflops, "detail": got}
  validate(doc)
  if o.out:
    pathlib.Path(o.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(o.out).write_text(json.dumps(doc, indent=1) + "\n")
    chip = got["sinkjax sink+aux"].get("chip", "unknown")
    print(f"\nside_by_side: {o.out} written ({device}, commit {doc['commit']}); its place in the repository: "
          f"docs/results/gpu_{chip}/side_by_side.json")
  return 0


def read_levers(path: str | os.PathLike) -> dict[str, list[str]]:
  """{lever name: overrides} of a levers file: `NAME: key=value ...` a line; '#' starts a comment."""
  levers = {}
  for n, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    name, sep, rest = line.partition(":")
    words = rest.split()
    if not sep or not name.strip().isidentifier() or not words or any("=" not in w for w in words):
      raise errors.UserError(f"{path}:{n}: a lever line is `NAME: key=value ...` (NAME a word of letters, digits and "
                             f"_), got {line!r}")
    if name.strip() in levers:
      raise errors.UserError(f"{path}:{n}: lever {name.strip()!r} is named twice")
    levers[name.strip()] = words
  return levers


def ab(o: SideBySideOptions, overrides: list[str]) -> int:
  """--ab LEVER: A (the baseline's sink+aux row, or measured here) against B (the same with the lever's overrides)."""
  levers = read_levers(o.levers)
  if o.ab not in levers:
    raise errors.UserError(f"--ab {o.ab}: no such lever in {o.levers} (it has: {', '.join(levers) or 'none'})")
  base = "sinkjax sink+aux"
  a, source = None, "measured here"
  if o.baseline and pathlib.Path(o.baseline).is_file():
    doc = json.loads(pathlib.Path(o.baseline).read_text())
    a = doc.get("detail", {}).get(base) or next((r for r in doc.get("rows", []) if r.get("name") == base), None)
    if a is not None:
      source = f"{o.baseline} (commit {doc.get('commit')})"
  if a is None:
    a, why = run_child(f"A: {base}", sinkjax_cmd(o, base, overrides), o.timeout)
    if a is None:
      print(f"ab {o.ab}: arm A failed: {why}")
      return 1
  b, why = run_child(f"B: {base} + {o.ab}", sinkjax_cmd(o, base, overrides + levers[o.ab]), o.timeout)
  print(f"\n# A/B {o.ab}: {' '.join(levers[o.ab])}; A from {source}")
  print("", *table(["arm", "tokens/s", "MFU", "B / A"], align="lrrr"), sep="\n")
  print(row(["A", f"{a['tokens_per_s']:,.0f}", f"{a['mfu']:.1f} %", ""]))
  if b is None:
    print(row([f"B ({o.ab})", "-", "-", f"FAILED: {why}"]))
    return 1
  print(row([f"B ({o.ab})", f"{b['tokens_per_s']:,.0f}", f"{b['mfu']:.1f} %",
             f"{b['tokens_per_s'] / a['tokens_per_s']:.3f}x"]))
  print(json.dumps({"lever": o.ab, "overrides": levers[o.ab], "a_tokens_per_s": a["tokens_per_s"],
                    "b_tokens_per_s": b["tokens_per_s"], "b_over_a": b["tokens_per_s"] / a["tokens_per_s"],
                    "a_mfu": a["mfu"], "b_mfu": b["mfu"]}))
  return 0


def time_row(o: SideBySideOptions, overrides: list[str]) -> int:
  """--row NAME: the sinkjax row in this process; prints its JSON line."""
  import tempfile  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  from sinkjax import compile as compile_lib  # pylint: disable=import-outside-toplevel
  from sinkjax.bench import trainer as bench_trainer  # pylint: disable=import-outside-toplevel
  from sinkjax.config import load_config  # pylint: disable=import-outside-toplevel
  from sinkjax.train import Trainer  # pylint: disable=import-outside-toplevel
  config, base = (o.config, []) if o.config else default_config()
  ov = base + shape_overrides(o) + ROWS[o.row] + list(overrides)
  with tempfile.TemporaryDirectory(prefix="sinkjax-side-by-side-") as tmp:
    cfg = load_config(str(REPO / config) if not os.path.isabs(config) and not os.path.exists(config) else config,
                      ov + [f"run.dir={tmp}/run", "train.eval_batches=0", "checkpoint.async_save=false"])
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    cfg = trainer.cfg
    runners, log = bench_trainer.build_runners(trainer, cfg, ["train loop"])
    try:
      res = bench_trainer.time_blocks(runners, o.steps, o.rounds)["train loop"]
    finally:
      log.close()
    tokens = cfg.train.batch_size * cfg.data.seq_len
    flops = compile_lib.model_flops_per_step(cfg, trainer.num_params)
    dev = jax.devices()[0]
    chip = bench_trainer.chip_of(dev) or dev.platform
    print(json.dumps({"name": o.row, "tokens_per_s": tokens / res, "mfu": 100 * flops / res / (o.peak_tflops * 1e12),
                      "step_ms": res * 1e3, "flops_per_token": flops / tokens, "params": trainer.num_params,
                      "device": dev.device_kind if dev.platform != "cpu" else "cpu", "chip": chip,
                      "jax": jax.__version__,
                      "config": config, "overrides": ov, "attn_impl": cfg.model.attn_impl,
                      "dtype": cfg.model.dtype, "setup_s": time.perf_counter() - t0}), flush=True)
  return 0


def main(argv=None) -> int:
  def run(sections, overrides):
    o = sections["bench_side_by_side"]
    if o.row:
      return time_row(o, overrides)
    if o.ab:
      return ab(o, overrides)
    return side_by_side(o, overrides)
  return options.main(COMMAND, argv, run)


if __name__ == "__main__":
  sys.exit(main())
