"""Benchmark of the training step: the cost of the sink-aware aux loss, throughput, and a PyTorch peer.

    python -m sinkjax.bench.train [--config configs/tiny.yaml] [--layers 4 --d-model 128 --heads 4 --head-dim 32]
                                  [--seq 256 --batch 16] [--preset cpu-peer] [--dtype float32] [--repeats 10]
                                  [--no-torch] [--nanochat DIR] [--apart ROUNDS]

For each attention variant the full jitted train step (forward, backward through the LSE, optimizer) is timed with
loss.aux_weight = 0 and loss.aux_term=false (the aux term is not traced) and 1e-4 (eq. 7). Everything (every variant with and without
the aux loss, the matmul reference, the PyTorch peer) is timed round-robin, one step of each per round (after one
untimed step of the same row, which pays for switching from the previous row: caches, the other framework's threads),
and reported by medians over the rounds, so that drifts in the load of a shared machine hit all rows alike. Besides
wall time the tables give this process' CPU time per step, which a busy machine disturbs less. The paper claims < 2 %
overhead.

Throughput: tokens/s and achieved FLOP/s with nanochat's estimate, 6 * (params - embedding) + 12 * L * H * D * T
per token (matmuls forward and backward; attention counted in full, not halved for causality), also as a fraction of
this machine's own matmul rate in the compute dtype (a jnp matmul of 2048^2 on CPU, 8192^2 on accelerators, timed the
same way).

Peers, trained with torch.optim.AdamW in float32, eager mode; sinkjax is also timed with train.optimizer=adamw for
like-for-like rows (vanilla without the aux loss, sink with it), and the table gives each row's tokens/s as a multiple
of nanochat's:
  - nanochat's own PyTorch GPT (the model sinkjax's recipe follows: same blocks, ReLU^2 MLP, QK-norm, soft-cap, its
    vocabulary padded to 64), imported from the nanochat tree given by --nanochat (default
    $SINKJAX_NANOCHAT_PEERS/nanochat-9d4c9b7, else ../shared/peers/nanochat-9d4c9b7 next to this checkout); skipped
    with a note when the tree or torch is absent, or when heads x head_dim != width (nanochat derives head_dim).
  - a Hugging Face `LlamaForCausalLM` of equal layers, width, heads, head_dim, vocabulary, sequence length and batch
    (SwiGLU hidden size 8/3 * width, so its parameter count matches our ReLU^2 4x MLP).
Both need `pip install torch` (the Llama row also transformers; skipped with a note when missing).
Muon's cost: the Muon and AdamW rows of the same model give Muon's extra time per step, printed next to the share of
the step's FLOPs that its Newton-Schulz iterations add (5 quintic iterations per matrix: 4 m^2 n + 2 m^3 each, m <= n).

--apart ROUNDS: the same comparison with each framework alone in its process. The round robin above runs XLA's and
torch's thread pools in one process; on 2 cores that costs sinkjax a few per cent against nanochat (docs/PERF.md,
"Training step on a CPU"). With --apart every round starts a fresh process for sinkjax's sink + aux + AdamW step and
one for nanochat's (--repeats timed steps each after 3 untimed, the first arm alternating by round) and the per-round
ratio nanochat / sinkjax is read over the rounds as a paired effect on the log scale (geometric mean, 95 % t-interval).
nanochat's process runs under $SINKJAX_TORCH_PYTHON when set (a Python with torch, where this one has none).

--preset cpu-peer: the shape of issue 20, the first run a person makes on a CPU (4 layers x 256 wide, 4 heads x 64,
T 512, batch 8, vocabulary 257, float32).
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":
  errors.require_extra("sinkjax.bench.train")   # before the imports below, which need the train extra

import dataclasses
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax import choices, optim, options
from sinkjax.config import declare, load_config
from sinkjax.markdown import row, table
from sinkjax.model import Transformer, count_params
from sinkjax.step import make_train_step

VOCAB = 257   # the byte tokenizer
APART_ARMS = ("sinkjax", "nanochat")     # --apart: sinkjax's sink + aux + AdamW step, nanochat's GPT + torch AdamW
PRESETS = {"cpu-peer": dict(layers=4, d_model=256, heads=4, head_dim=64, seq=512, batch=8)}
NANOCHAT_TREE = "nanochat-9d4c9b7"


def flops_per_token(num_params: int, cfg) -> float:
  m = cfg.model
  embedding = m.vocab_size * m.d_model            # a gather, no matmul (the unembedding is a matmul: counted)
  return 6 * (num_params - embedding) + 12 * m.num_layers * m.num_heads * m.head_dim * cfg.data.seq_len


def matmul_runner(n: int = 2048, dtype=jnp.float32):
  """(run_once, FLOPs per run) of an n x n jnp matmul: the machine's own matmul rate is the reference."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  f = jax.jit(lambda x, y: x @ y)
  return (lambda: jax.block_until_ready(f(a, a))), 2 * n ** 3


def random_batch(B: int, T: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {"inputs": rng.integers(0, 256, (B, T), dtype=np.int32),
          "targets": rng.integers(0, 256, (B, T), dtype=np.int32),
          "segment_ids": np.ones((B, T), np.int32),
          "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
          "loss_mask": np.ones((B, T), np.float32)}


def jax_runner(cfg, batch):
  """(run_once, parameter count): one blocking sinkjax train step per call, on its own evolving state."""
  model = Transformer(cfg.model, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx, _ = optim.build_optimizer(cfg, 1000)
  box = [{"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
          "rng": jax.random.PRNGKey(0), "nonfinite": jnp.zeros((), jnp.int32)}]
  step = jax.jit(make_train_step(cfg, graphdef, rest, tx))
  batch = jax.device_put(batch)

  def run_once():
    box[0], m = step(box[0], batch)
    jax.block_until_ready(m)
  return run_once, count_params(model)


def model_params(cfg):
  """The parameter pytree of a sinkjax model of `cfg` (for counting what Muon orthogonalizes)."""
  return nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(0)), nnx.Param)


def torch_runner(cfg, batch):
  """(run_once, parameter count, description) of HF LlamaForCausalLM + torch AdamW, or (None, None, reason)."""
  try:
    import torch  # optional: the PyTorch oracle row (test / oracle extra)
    import transformers
  except ImportError as e:
    return None, None, f"not run ({e.name} is not installed: pip install torch transformers)"
  m = cfg.model
  _torch_threads(torch)
  torch.manual_seed(0)
  lcfg = transformers.LlamaConfig(
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=int(round(8 * m.d_model / 3)),
      num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
      head_dim=m.head_dim, max_position_embeddings=cfg.data.seq_len, tie_word_embeddings=False)
  lcfg._attn_implementation = "sdpa"
  model = transformers.LlamaForCausalLM(lcfg).float().train()

  def loss_of(x, y):
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
  return _adamw_step(torch, model, loss_of, batch), sum(p.numel() for p in model.parameters()), \
      f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, sdpa"


def _adamw_step(torch, model, loss_of, batch):
  """One torch training step on `batch` (the peers' common part): loss_of(inputs, targets), backward, clipping at
  1.0 as the sinkjax step does, torch AdamW. Returns the step's loss (a detached tensor: reading it is the caller's
  choice, the timing does not)."""
  opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95))
  x, y = torch.from_numpy(batch["inputs"]).long(), torch.from_numpy(batch["targets"]).long()

  def run_once():
    loss = loss_of(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()
  return run_once


def default_nanochat_dir() -> pathlib.Path:
  """$SINKJAX_NANOCHAT_PEERS/nanochat-9d4c9b7, else ../shared/peers/nanochat-9d4c9b7 next to this checkout."""
  env = os.environ.get("SINKJAX_NANOCHAT_PEERS")
  root = pathlib.Path(env) if env else pathlib.Path(__file__).resolve().parents[3] / "shared" / "peers"
  return root / NANOCHAT_TREE


def import_nanochat_gpt(tree: pathlib.Path):
  """nanochat's `gpt` module from a nanochat tree on disk (the package `nanochat` is imported from `tree` and
  removed from sys.modules again, so it cannot shadow or be shadowed by another copy)."""
  saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "nanochat" or k.startswith("nanochat.")}
  sys.path.insert(0, str(tree))
  try:
    import nanochat.gpt as gpt  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.remove(str(tree))
    for k in [k for k in sys.modules if k == "nanochat" or k.startswith("nanochat.")]:
      del sys.modules[k]
    sys.modules.update(saved)
  return gpt


def _torch_threads(torch):
  """At most one torch thread per CPU this process may run on (`taskset -c 1 python -m sinkjax.bench.train` gives
  both frameworks one core; torch's default, the machine's core count, would oversubscribe it)."""
  torch.set_num_threads(min(torch.get_num_threads(), len(os.sched_getaffinity(0))))


def nanochat_runner(tree, cfg, batch):
  """(run_once, parameter count, description) of nanochat's GPT (eager) + torch AdamW, or (None, None, why not)."""
  tree = pathlib.Path(tree)
  if not (tree / "nanochat" / "gpt.py").is_file():
    return None, None, (f"not run (no nanochat tree at {tree}: pass --nanochat DIR or set SINKJAX_NANOCHAT_PEERS to "
                        f"a directory holding {NANOCHAT_TREE}/)")
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None, None, "not run (torch is not installed: pip install torch)"
  m = cfg.model
  if m.num_heads * m.head_dim != m.d_model or m.num_kv_heads != m.num_heads:
    return None, None, (f"not run (nanochat's GPT has head_dim = width / heads and no GQA here; got {m.num_heads} "
                        f"heads x {m.head_dim} for width {m.d_model}, {m.num_kv_heads} KV heads)")
  gpt = import_nanochat_gpt(tree)
  _torch_threads(torch)
  torch.manual_seed(0)
  model = gpt.GPT(gpt.GPTConfig(sequence_len=cfg.data.seq_len, vocab_size=m.vocab_size, n_layer=m.num_layers,
                                n_head=m.num_heads, n_kv_head=m.num_kv_heads, n_embd=m.d_model))
  model.init_weights()
  model.train()                 # float32 parameters on a CPU (its rotary tables stay bfloat16, as nanochat asserts)
  return _adamw_step(torch, model, model, batch), sum(p.numel() for p in model.parameters()), \
      f"{tree.name} GPT, torch {torch.__version__}, {torch.get_num_threads()} threads, eager"


def newton_schulz_flops(params, steps: int = 5) -> int:
  """FLOPs of Muon's Newton-Schulz iterations per optimizer step over the parameters Muon takes (`optim.param_labels`
  "matrix"): per matrix (m <= n after orientation) and iteration X X^T (2 m^2 n), A A (2 m^3), (.) X (2 m^2 n)."""
  total = 0
  for leaf, label in zip(jax.tree.leaves(params), jax.tree.leaves(optim.param_labels(params))):
    if label != "matrix":
      continue
    m, n = sorted(leaf.shape[-2:])
    total += int(np.prod(leaf.shape[:-2], dtype=np.int64)) * steps * (4 * m * m * n + 2 * m ** 3)
  return total


def time_round_robin(runners: dict, repeats: int, warmup: int = 2, settle: int = 1, rounds: dict | None = None
                     ) -> dict:
  """{name: (median wall s, median process-CPU s)} per call, one timed call of each runner per round, after `settle`
  untimed calls of it in the same round (a runner's first call after another one pays for the switch: caches, the
  other framework's threads going idle, allocator state; measured in one process, this cost fell unevenly on torch
  and XLA depending on which rows ran before them). `rounds`, when given, receives each runner's wall times in round
  order (for paired ratios, `paired_ratio`)."""
  for run in runners.values():
    for _ in range(warmup):
      run()
  wall = {n: [] for n in runners}
  cpu = {n: [] for n in runners}
  for _ in range(repeats):
    for name, run in runners.items():
      for _ in range(settle):
        run()
      t0, c0 = time.perf_counter(), time.process_time()
      run()
      wall[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  if rounds is not None:
    rounds.update(wall)
  return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in runners}


def paired_ratio(reference: list, other: list) -> tuple:
  """(median, min, max) over the rounds of reference / other wall time, each pair taken in the same round: how many
  times faster `other` ran than `reference`, with the drift of a shared machine's speed between rounds divided out."""
  r = [a / b for a, b in zip(reference, other)]
  return statistics.median(r), min(r), max(r)


@dataclasses.dataclass
class TrainBenchOptions:
  """The bench_train.* options (`python -m sinkjax.bench.train`; each flag the alias of its key). Its --config is the
  training config the shapes start from, so the command has no file of options."""
  config: str = declare("configs/tiny.yaml", alias="--config", metavar="CONFIG", help="shapes and recipe to start from")
  layers: int | None = declare(None, ">=1", alias="--layers", help="model.num_layers")
  d_model: int | None = declare(None, ">=1", alias="--d-model", help="model.d_model")
  heads: int | None = declare(None, ">=1", alias="--heads", help="model.num_heads (and num_kv_heads)")
  head_dim: int | None = declare(None, ">=1", alias="--head-dim", help="model.head_dim")
  seq: int | None = declare(None, ">=1", alias="--seq", help="data.seq_len (and model.max_seq_len)")
  batch: int | None = declare(None, ">=1", alias="--batch", help="train.batch_size")
  dtype: str = declare("float32", choices=("float32", "bfloat16"), alias="--dtype", help="compute dtype")
  variants: list[str] = declare(["vanilla", "sink", "gated"], choices=choices.ATTENTION_VARIANTS, alias="--variants",
                            nargs="+", metavar="VARIANT", help="model.attention values timed with Muon")
  repeats: int = declare(12, ">=1", alias="--repeats", help="timed rounds")
  preset: str | None = declare(None, choices=tuple(sorted(PRESETS)), alias="--preset",
                           help="a named shape (flags given as well override it)")
  no_torch: bool = declare(False, alias="--no-torch", help="skip the PyTorch peers (nanochat and transformers)")
  nanochat: str | None = declare(None, alias="--nanochat", metavar="NANOCHAT",
                             help=f"a nanochat tree (holding nanochat/gpt.py) whose GPT is timed as a peer; default "
                                  f"$SINKJAX_NANOCHAT_PEERS/{NANOCHAT_TREE} or ../shared/peers/{NANOCHAT_TREE}")
  apart: int | None = declare(None, ">=2", alias="--apart", metavar="ROUNDS",
                          help="instead of the one-process round robin: ROUNDS rounds, each timing sinkjax's sink + aux "
                               "+ AdamW step and nanochat's step in a fresh process of its own (--repeats steps each, "
                               "the order alternating), so that neither framework's threads share a process with the "
                               "other's")
  child: str | None = declare(None, choices=APART_ARMS, alias="--child",
                          help="internal (--apart): time this one arm in this process and print its JSON line")


COMMAND = options.Command(prog="python -m sinkjax.bench.train", description=__doc__,
                          sections={"bench_train": TrainBenchOptions}, options_file=None,
                          raw_description=True)


def with_preset(opts: TrainBenchOptions) -> TrainBenchOptions:
  """The options with --preset's shape filled in where no flag set it."""
  unset = {k: v for k, v in PRESETS.get(opts.preset, {}).items() if getattr(opts, k) is None}
  return dataclasses.replace(opts, **unset)


def main(argv=None) -> int:
  def run(sections, _):
    opts = with_preset(sections["bench_train"])
    if opts.child:
      return time_child(opts)
    return measure_apart(opts) if opts.apart else measure(opts)
  return options.main(COMMAND, argv, run)


def shape_overrides(opts: TrainBenchOptions) -> list[str]:
  """The config overrides of the options' dtype and shape flags."""
  ov = [f"model.dtype={opts.dtype}", f"model.vocab_size={VOCAB}", "train.grad_accum=1"]
  for name, val in (("model.num_layers", opts.layers), ("model.d_model", opts.d_model),
                    ("model.num_heads", opts.heads), ("model.num_kv_heads", opts.heads),
                    ("model.head_dim", opts.head_dim), ("data.seq_len", opts.seq), ("model.max_seq_len", opts.seq),
                    ("train.batch_size", opts.batch)):
    if val is not None:
      ov.append(f"{name}={val}")
  return ov


def time_child(opts: TrainBenchOptions) -> None:
  """--child ARM: 3 untimed steps, then --repeats timed ones; one JSON line {arm, ms (median), cpu_s (median), steps}."""
  ov = shape_overrides(opts)
  base = load_config(opts.config, ov)
  batch = random_batch(base.train.batch_size, base.data.seq_len)
  if opts.child == "nanochat":
    tree = pathlib.Path(opts.nanochat) if opts.nanochat else default_nanochat_dir()
    run, _, note = nanochat_runner(tree, base, batch)
    if run is None:
      raise errors.UserError(f"--apart needs nanochat's step: {note}")
  else:
    run, _ = jax_runner(load_config(opts.config, ov + ["model.attention=sink", "loss.aux_weight=0.0001",
                                                       "loss.aux_term=true", "train.optimizer=adamw"]), batch)
  wall, cpu = time_round_robin({opts.child: run}, opts.repeats, warmup=3, settle=0)[opts.child]
  print(json.dumps({"arm": opts.child, "ms": wall * 1e3, "cpu_s": cpu, "steps": opts.repeats}), flush=True)


def apart_pythons() -> dict:
  """{arm: the interpreter its --apart process runs}: sinkjax's arm this one; nanochat's $SINKJAX_TORCH_PYTHON when set
  (a Python with torch and this package's train extra, e.g. the py311 leg's, where this one has no torch), else this
  one."""
  return {"sinkjax": sys.executable, "nanochat": os.environ.get("SINKJAX_TORCH_PYTHON") or sys.executable}


def measure_apart(opts: TrainBenchOptions) -> None:
  """--apart ROUNDS: each round runs both arms in fresh processes one after the other (order alternating by round) and
  prints their step times; then the ratio nanochat / sinkjax per round, read as a paired effect over rounds on the
  log scale (`sinkjax.stats.t_interval`: the geometric mean ratio with its 95 % t-interval)."""
  from sinkjax import stats  # pylint: disable=import-outside-toplevel
  flags = ["--config", opts.config, "--dtype", opts.dtype, "--repeats", str(opts.repeats)]
  for flag, val in (("--layers", opts.layers), ("--d-model", opts.d_model), ("--heads", opts.heads),
                    ("--head-dim", opts.head_dim), ("--seq", opts.seq), ("--batch", opts.batch),
                    ("--nanochat", opts.nanochat)):
    if val is not None:
      flags += [flag, str(val)]
  print(f"--apart: {opts.apart} rounds, each arm in a fresh process per round ({opts.repeats} timed steps after 3 "
        f"untimed); sinkjax: sink attention, aux loss 1e-4, AdamW; nanochat: its GPT, torch AdamW; "
        f"{' '.join(shape_overrides(opts))}", flush=True)
  print("", *table(["round", "first", "sinkjax (ms)", "sinkjax CPU s", "nanochat (ms)", "nanochat CPU s",
                    "nanochat / sinkjax"]), sep="\n", flush=True)
  ratios = []
  python = apart_pythons()
  for r in range(opts.apart):
    got = {}
    for arm in APART_ARMS[::1 if r % 2 == 0 else -1]:
      proc = subprocess.run([python[arm], "-m", "sinkjax.bench.train", *flags, "--child", arm],
                            capture_output=True, text=True, check=False)
      if proc.returncode:
        raise errors.UserError(f"--apart: the {arm} process failed: {proc.stderr.strip().splitlines()[-1:]}")
      got[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
    ratios.append(got["nanochat"]["ms"] / got["sinkjax"]["ms"])
    print(row([str(r + 1), APART_ARMS[r % 2], f"{got['sinkjax']['ms']:.1f}", f"{got['sinkjax']['cpu_s']:.2f}",
               f"{got['nanochat']['ms']:.1f}", f"{got['nanochat']['cpu_s']:.2f}", f"{ratios[-1]:.3f}x"]), flush=True)
  t = stats.t_interval([math.log(x) for x in ratios])
  print(f"\nnanochat / sinkjax step time over {len(ratios)} rounds (> 1: sinkjax faster): geometric mean "
        f"{math.exp(t['mean']):.3f}x, 95 % t-interval {math.exp(t['low']):.3f}-{math.exp(t['high']):.3f}x "
        f"(t_{t['df']} = {t['t']:+.2f}, p = {stats.fmt_p(t['p'])})")


def measure(opts: TrainBenchOptions) -> None:
  """Times every row's step (and the peers') in round-robin rounds and prints the tables."""
  ov = shape_overrides(opts)
  base = load_config(opts.config, ov)
  batch = random_batch(base.train.batch_size, base.data.seq_len)

  runners, params, rows = {}, {}, [(v, "muon") for v in opts.variants] + [("vanilla", "adamw"), ("sink", "adamw")]
  for variant, opt_name in rows:
    for aux in (0.0, 1e-4):
      cfg = load_config(opts.config, ov + [f"model.attention={variant}", f"loss.aux_weight={aux!r}",
                                           f"loss.aux_term={aux > 0}", f"train.optimizer={opt_name}"])
      runners[(variant, opt_name, aux)], params[(variant, opt_name)] = jax_runner(cfg, batch)
  mm_n = 2048 if jax.default_backend() == "cpu" else 8192
  runners["matmul"], mm_flops = matmul_runner(mm_n, jnp.dtype(opts.dtype))
  torch_note = nanochat_note = "skipped (--no-torch)"
  if not opts.no_torch:
    tree = pathlib.Path(opts.nanochat) if opts.nanochat else default_nanochat_dir()
    run, n, nanochat_note = nanochat_runner(tree, base, batch)
    if run is not None:
      runners["nanochat"], params["nanochat"] = run, n
    run, n, torch_note = torch_runner(base, batch)
    if run is not None:
      runners["torch"], params["torch"] = run, n
  rounds = {}
  res = time_round_robin(runners, opts.repeats, rounds=rounds)
  print_tables(opts, base, ov, rows, res, rounds, params, mm_n, mm_flops, nanochat_note, torch_note)


def print_tables(opts: TrainBenchOptions, base, ov, rows, res, rounds, params, mm_n, mm_flops, nanochat_note,
                 torch_note):
  """The three outputs of `main`: the variants' aux-loss table, the peers' table, Muon's cost."""
  m = base.model
  B, T = base.train.batch_size, base.data.seq_len
  tokens = B * T
  peak = mm_flops / res["matmul"][0]
  print(f"shape: {m.num_layers} layers x {m.num_heads} heads x {m.head_dim} head_dim, width {m.d_model}, vocab "
        f"{m.vocab_size}, seq {T}, batch {B} ({tokens} tokens/step), compute {opts.dtype}; "
        f"{jax.device_count()} {jax.default_backend()} device(s); {opts.dtype} {mm_n}^2 jnp matmul: {peak / 1e9:.1f} "
        f"GFLOP/s "
        f"(median of {opts.repeats} rounds)")
  print("", *table(["variant", "optimizer", "params", "step, aux off (ms)", "step, aux on (ms)", "aux overhead (wall)",
                    "aux overhead (CPU time)", "tokens/s (aux on)", "GFLOP/s", "of matmul rate"]), sep="\n")
  for variant, opt_name in rows:
    (off, cpu_off), (on, cpu_on) = res[(variant, opt_name, 0.0)], res[(variant, opt_name, 1e-4)]
    n = params[(variant, opt_name)]
    flops = flops_per_token(n, base) * tokens / on
    print(row([variant, opt_name, f"{n:,}", f"{off * 1e3:.1f}", f"{on * 1e3:.1f}", f"{(on / off - 1) * 100:+.1f} %",
               f"{(cpu_on / cpu_off - 1) * 100:+.1f} %", f"{tokens / on:,.0f}", f"{flops / 1e9:.1f}", f"{flops / peak:.0%}"]))

  print(f"\nPeers, float32, same shapes and batch, timed in the same rounds: nanochat: {nanochat_note}; "
        f"HF Llama: {torch_note}")
  print("", *table(["implementation", "params", "step (ms)", "CPU s / step", "tokens/s",
                    "vs nanochat (per-round: median, min-max)", "GFLOP/s", "of matmul rate"]), sep="\n")
  peers = [("sinkjax vanilla, AdamW, aux off", ("vanilla", "adamw", 0.0), params[("vanilla", "adamw")]),
           ("sinkjax sink, AdamW, aux on", ("sink", "adamw", 1e-4), params[("sink", "adamw")]),
           ("sinkjax vanilla, Muon, aux off", ("vanilla", "muon", 0.0), params.get(("vanilla", "muon")))]
  if "nanochat" in res:
    peers.append(("nanochat GPT (PyTorch eager), torch AdamW", "nanochat", params["nanochat"]))
  if "torch" in res:
    peers.append(("HF LlamaForCausalLM, torch AdamW", "torch", params["torch"]))
  for label, arm, n in peers:
    if arm not in res:
      continue
    t, c = res[arm]
    flops = flops_per_token(n, base) * tokens / t
    ratio = "-"
    if "nanochat" in res:
      mid, lo, hi = paired_ratio(rounds["nanochat"], rounds[arm])
      ratio = f"{mid:.2f}x ({lo:.2f}-{hi:.2f})"
    print(row([label, f"{n:,}", f"{t * 1e3:.1f}", f"{c:.2f}", f"{tokens / t:,.0f}", ratio, f"{flops / 1e9:.1f}",
               f"{flops / peak:.0%}"]))

  if ("vanilla", "muon", 0.0) in res:
    muon_t, adamw_t = res[("vanilla", "muon", 0.0)][0], res[("vanilla", "adamw", 0.0)][0]
    ns = newton_schulz_flops(model_params(load_config(opts.config, ov + ["model.attention=vanilla"])))
    step_flops = flops_per_token(params[("vanilla", "adamw")], base) * tokens
    print(f"\nMuon vs AdamW (vanilla, aux off): {(muon_t / adamw_t - 1) * 100:+.1f} % step time; its Newton-Schulz "
          f"iterations are {ns / 1e9:.2f} GFLOP per step, {ns / step_flops:.1%} of the step's {step_flops / 1e9:.1f} "
          f"GFLOP (at the step's own FLOP rate: {ns / step_flops * 100:+.1f} %)")


if __name__ == "__main__":
  sys.exit(main())
