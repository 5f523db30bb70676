"""[Sink-MoE] Table 1's 18 runs on a TPU slice: study kind tpu (configs/studies/paper_tpu.yaml), or
`python -m sinkjax.experiments.paper --scale tpu`.

    python -m sinkjax.experiments.study configs/studies/paper_tpu.yaml study.out=gs://BUCKET tpu.name=sj \
        tpu.zone=us-central1-a [axes.size=[d20]] [tpu.spot=true] [tpu.steps=N] [--dry-run]
    python -m sinkjax.experiments.paper --scale tpu --out gs://BUCKET --name sj --zone us-central1-a
        [--sizes d20,d26,d32] [--variants vanilla,sink,gated] [--seeds 1] [--first-seed 0] [--data gs://BUCKET/data]
        [--type v5litepod-32] [--version v2-alpha-tpuv5-lite] [--project P] [--spot] [--queued] [--interval 300]
        [--delete-when-done] [--steps N] [--dry-run]

The grid is `configs/paper/{size}_{variant}_{loss}.yaml` (3 sizes x 3 attention variants x base / base + aux = 18
runs per seed; seed 0 is the configs' own, seed K > 0 adds `train.seed=K` and `_sK` to the name), in that order
within each seed. Each run is one launch: `launch/tpu_vm.sh babysit --job NAME -- --config configs/paper/NAME.yaml
run.dir=OUT/runs/NAME data.source=... data.val_source=... data.tokenizer=...`, which creates and sets up the slice if
it is missing, starts the run, restarts it after a preemption and returns when the run has ended; the next launch
follows on the same slice. The bucket holds the checkout's tree: the data in DATA (default OUT/data) as the
configs name it locally, `DATA/fineweb-edu/shard_*.parquet`, `DATA/fineweb-edu/val/shard_01822.parquet` and
`DATA/tokenizer/tokenizer.json`; the runs in `OUT/runs/NAME`.

Resumable: before launching, each run's state is read from the bucket (its config.yaml's train.steps and the latest
checkpoint Orbax lists there): a finished run is skipped, an unfinished one is launched again and the trainer resumes
it from that checkpoint. A launch that ends with the run unfinished (stopped, or failing more than babysit's
--max-failures) stops the grid with one line; rerunning the command continues it. --dry-run reads the states and
prints each launch without running anything. Before the first launch the data is checked: the tokenizer, the
validation shard and as many training shards as the largest run needs (`sinkjax.data.fineweb.plan`), else one
line with the command that stages them. Table 1 and Figs. 5 / 8 from the finished runs: `python -m
sinkjax.experiments.paper_report --runs 'OUT/runs/d*'`.
"""
from __future__ import annotations

import dataclasses
import pathlib
import shlex
import subprocess

from sinkjax import choices, paths
from sinkjax.config import key
from sinkjax.experiments.runner import StudyError

REPO = pathlib.Path(__file__).resolve().parents[2]
TPU_VM = "launch/tpu_vm.sh"              # relative to REPO: the launcher, run from the checkout
SIZES = ("d20", "d26", "d32")
VARIANTS = choices.PAPER_VARIANTS
LOSSES = ("base", "aux")
VAL_SHARD = "shard_01822.parquet"         # nanochat's validation shard (sinkjax.data.fineweb: the last one)
NOTE = ("configs/paper/{d20,d26,d32}_{vanilla,sink,gated}_{base,aux}.yaml as they are (the paper's shapes, 2,048-token "
        "rows, 256 rows per step, 20 tokens per parameter; configs/d{20,26,32}.yaml's scan, remat, loss_chunk 256, "
        "FSDP over every chip), one launch per run through launch/tpu_vm.sh babysit")


@dataclasses.dataclass(frozen=True)
class TpuRun:
  size: str
  variant: str
  loss: str
  seed: int

  @property
  def config(self) -> str:
    return f"configs/paper/{self.size}_{self.variant}_{self.loss}.yaml"

  @property
  def name(self) -> str:
    return f"{self.size}_{self.variant}_{self.loss}" + (f"_s{self.seed}" if self.seed else "")


def make_grid(sizes, variants, seeds) -> list[TpuRun]:
  """Seed-major, then size, variant and loss: a grid cut short holds whole seeds of the smaller sizes first."""
  return [TpuRun(z, v, loss, s) for s in seeds for z in sizes for v in variants for loss in LOSSES]


@dataclasses.dataclass(frozen=True)
class Bucket:
  out: str                          # gs://BUCKET[/PREFIX]: runs in OUT/runs/NAME
  data: str                         # DATA: fineweb-edu/ and tokenizer/ as the configs' data/ holds them locally

  def run_dir(self, run: TpuRun) -> str:
    return f"{self.out}/runs/{run.name}"

  @property
  def source(self) -> str:
    return f"{self.data}/fineweb-edu/shard_*.parquet"

  @property
  def val_source(self) -> str:
    return f"{self.data}/fineweb-edu/val/{VAL_SHARD}"

  @property
  def tokenizer(self) -> str:
    return f"{self.data}/tokenizer/tokenizer.json"


def train_args(run: TpuRun, bucket: Bucket, steps: int | None = None) -> list[str]:
  """`sinkjax.train`'s arguments for the run: its config, with the bucket's run dir, data and tokenizer."""
  args = ["--config", run.config, f"run.dir={bucket.run_dir(run)}", f"data.source={bucket.source}",
          f"data.val_source={bucket.val_source}", f"data.tokenizer={bucket.tokenizer}"]
  if run.seed:
    args.append(f"train.seed={run.seed}")
  if steps is not None:
    args.append(f"train.steps={steps}")
  return args


@dataclasses.dataclass(frozen=True)
class Slice:
  """The TPU slice every launch runs on (launch/tpu_vm.sh's options)."""
  name: str
  zone: str
  type: str = "v5litepod-32"
  version: str = "v2-alpha-tpuv5-lite"
  interval: int = 300
  project: str | None = None
  spot: bool = False
  queued: bool = False

  def options(self) -> list[str]:
    opts = ["--name", self.name, "--zone", self.zone, "--type", self.type, "--version", self.version,
            "--interval", str(self.interval)]
    opts += ["--project", self.project] if self.project else []
    return opts + (["--spot"] if self.spot else []) + (["--queued"] if self.queued else [])


def launch_command(run: TpuRun, bucket: Bucket, slice_opts: list[str], steps: int | None = None, *,
                   delete_when_done: bool = False) -> list[str]:
  """The one launch of a run (relative to the checkout)."""
  return ["bash", TPU_VM, "babysit", *slice_opts, *(["--delete-when-done"] if delete_when_done else []),
          "--job", run.name, "--", *train_args(run, bucket, steps)]


# ---------------------------------------------------------------------------------------------------- the bucket

@dataclasses.dataclass(frozen=True)
class RunState:
  latest: int | None                # the latest complete checkpoint's step
  steps: int | None                 # the run's length (its config.yaml's resolved train.steps)

  def finished(self, steps: int | None = None) -> bool:
    want = max(self.steps or 0, steps or 0)
    return self.latest is not None and want > 0 and self.latest >= want

  def describe(self, steps: int | None = None) -> str:
    if self.finished(steps):
      return f"finished at step {self.latest}"
    if self.latest is not None:
      return f"resumes from step {self.latest} of {max(self.steps or 0, steps or 0)}"
    return "started, no checkpoint yet" if self.steps is not None else "to do"


def _read(what: str, fn):
  try:
    return fn()
  except paths.StorageError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # credentials, network, permissions: one line
    raise StudyError(f"cannot read {what}: {paths.describe(e)}") from None


def run_state(run_dir: str) -> RunState:
  """What the bucket holds of a run: its length and its latest complete checkpoint (as Orbax, which the trainer
  resumes with, lists them)."""
  import yaml  # pylint: disable=import-outside-toplevel
  from sinkjax.checkpoint import Checkpointer  # lazy: orbax / jax, not loaded for --help
  from sinkjax.config import CheckpointConfig  # pylint: disable=import-outside-toplevel
  config = paths.as_path(f"{run_dir}/config.yaml", "run directory")
  steps = None
  if _read(str(config), config.exists):
    steps = int((yaml.safe_load(_read(str(config), config.read_text)) or {}).get("train", {}).get("steps") or 0)
  if not _read(f"{run_dir}/checkpoints", paths.as_path(f"{run_dir}/checkpoints").exists):
    return RunState(None, steps)
  latest = _read(f"{run_dir}/checkpoints", lambda: Checkpointer(run_dir, CheckpointConfig(), read_only=True)
                 .latest_step())
  return RunState(latest, steps)


def needed_shards(runs: list[TpuRun], bucket: Bucket, steps: int | None) -> tuple[int, TpuRun]:
  """(training shards the hungriest run reads, that run): `sinkjax.data.fineweb.plan` of each config, with the
  bucket's tokenizer's vocabulary where it can be read."""
  from sinkjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from sinkjax.data import fineweb  # lazy: flax / jax, not loaded for --help
  best, seen = (0, runs[0]), set()
  for run in runs:
    if (run.size, run.variant) in seen:          # the loss does not change the parameters, so neither the steps
      continue
    seen.add((run.size, run.variant))
    cfg = config_lib.load_config(str(REPO / run.config), train_args(run, bucket, steps)[2:])
    n = fineweb.plan(cfg)["train_shards"]
    best = max(best, (n, run), key=lambda x: x[0])
  return best


def check_data(runs: list[TpuRun], bucket: Bucket, steps: int | None) -> str:
  """One line on the data in the bucket; StudyError (one line, with the command that stages it) when it lacks
  what the runs read."""
  tok = paths.as_path(bucket.tokenizer, "data.tokenizer")
  if not _read(bucket.tokenizer, tok.exists):
    raise StudyError(f"no tokenizer at {bucket.tokenizer}; make one (python -m sinkjax.data.tokenizer ... --out "
                     f"data/tokenizer, docs/TRAINING.md) and copy it there: gcloud storage cp "
                     f"data/tokenizer/tokenizer.json {bucket.tokenizer}")
  have = len(_read(bucket.source, lambda: paths.expand_glob(bucket.source)))
  val = _read(bucket.val_source, paths.as_path(bucket.val_source).exists)
  need, hungriest = needed_shards(runs, bucket, steps)
  if have < need or not val:
    lack = (f"{have} training shards in {bucket.data}/fineweb-edu, {hungriest.name} reads {need}" if have < need
            else f"no validation shard {bucket.val_source}")
    raise StudyError(f"{lack}: python -m sinkjax.data.fineweb --tokens-for {hungriest.config} --out "
                     f"{bucket.data}/fineweb-edu")
  return f"data: {have} training shards (the largest run reads {need}), {bucket.val_source}, {bucket.tokenizer}"


# ---------------------------------------------------------------------------------------------------- the driver

def add_arguments(p) -> None:
  g = p.add_argument_group("--scale tpu (configs/paper/ on a TPU slice through launch/tpu_vm.sh babysit)")
  g.add_argument("--name", default=None, help="the TPU VM's name (required with --scale tpu)")
  g.add_argument("--zone", default=None, help="its zone, e.g. us-central1-a (required with --scale tpu)")
  g.add_argument("--project", default=None, help="gcloud project (default: gcloud's)")
  g.add_argument("--type", default="v5litepod-32",
                 help="accelerator type (default v5litepod-32, where all 18 configs fit: docs/TPU.md)")
  g.add_argument("--version", default="v2-alpha-tpuv5-lite", help="TPU runtime (default v5e's)")
  g.add_argument("--spot", action="store_true", help="spot capacity")
  g.add_argument("--queued", action="store_true", help="ask for the slice as a queued resource")
  g.add_argument("--interval", type=int, default=300, help="seconds between babysit's checks (default 300)")
  g.add_argument("--delete-when-done", action="store_true", help="delete the slice after the last run finishes")
  g.add_argument("--sizes", default=",".join(SIZES), help="comma-separated subset of d20,d26,d32 (default: all)")
  g.add_argument("--data", default=None,
                 help="the bucket's data directory: fineweb-edu/ and tokenizer/tokenizer.json (default OUT/data)")


FLAGS = {"it": "--scale tpu", "out": "--out ", "data": "--data", "name": "--name", "zone": "--zone"}
KEYS = {"it": "the tpu study", "out": "study.out=", "data": "tpu.data", "name": "tpu.name", "zone": "tpu.zone"}


def problem(out: str, data: str, name: str | None, zone: str | None, runs: list[TpuRun], say=FLAGS) -> str | None:
  """What keeps the grid from launching (one line naming the flags or keys of `say`), or None: the bucket, the slice
  and the checkout checked."""
  if not out.startswith("gs://"):
    return f"{say['it']} needs {say['out']}gs://BUCKET (the workers share nothing but the bucket), got {out!r}"
  if not data.startswith("gs://"):
    return f"{say['data']} must be in the bucket (gs://...), got {data!r}"
  if not name or not zone:
    return f"{say['it']} needs {say['name']} (the TPU VM's) and {say['zone']}"
  missing = [f for f in (TPU_VM, *{r.config for r in runs}) if not (REPO / f).is_file()]
  if missing:
    return (f"{say['it']} launches from a checkout of sinkjax (launch/, configs/paper/); {REPO} lacks {missing[0]}: "
            "run it from a clone (pip install -e .)")
  return None


def main(args, parser) -> int:
  """The command line's half of `sinkjax.experiments.paper --scale tpu`: its flags checked (a bad one: parser.error)
  and turned into the grid, the bucket and the slice for `run_grid`."""
  out = args.out.rstrip("/")
  data = (args.data or f"{out}/data").rstrip("/")
  if args.lambdas or args.finetune or args.report_only:
    parser.error("--scale tpu runs the main grid only (no --lambdas, --finetune, --report-only); Table 1 from its "
                 "runs: python -m sinkjax.experiments.paper_report --runs 'OUT/runs/d*'")
  sizes = [z.strip() for z in args.sizes.split(",") if z.strip()]
  if not sizes or any(z not in SIZES for z in sizes):
    parser.error(f"--sizes: a comma-separated subset of {','.join(SIZES)}, got {args.sizes!r}")
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  runs = make_grid(sizes, variants, range(args.first_seed, args.first_seed + args.seeds))
  if (bad := problem(args.out, data, args.name, args.zone, runs)) is not None:
    parser.error(bad)
  slice_ = Slice(args.name, args.zone, args.type, args.version, args.interval, args.project, args.spot, args.queued)
  from sinkjax import cli  # pylint: disable=import-outside-toplevel
  return cli.run_main("sinkjax.experiments.paper", lambda: run_grid(
      runs, Bucket(out, data), slice_, steps=args.steps, dry_run=args.dry_run, delete_when_done=args.delete_when_done))


@dataclasses.dataclass
class TpuOptions:
  """The `tpu:` section of a kind-tpu study file (configs/studies/paper_tpu.yaml): the slice and the data."""
  name: str = ""                    # the TPU VM's name (required)
  zone: str = ""                    # its zone, e.g. us-central1-a (required)
  project: str = ""                 # gcloud project ("": gcloud's)
  type: str = "v5litepod-32"        # accelerator type (all 18 configs fit: docs/TPU.md)
  version: str = "v2-alpha-tpuv5-lite"   # TPU runtime (v5e's)
  spot: bool = False                # spot capacity
  queued: bool = False              # ask for the slice as a queued resource
  interval: int = key(300, ">=1")   # seconds between babysit's checks
  delete_when_done: bool = False    # delete the slice after the last run finishes
  data: str = ""                    # the bucket's fineweb-edu/ and tokenizer/tokenizer.json ("": OUT/data)
  steps: int = key(0, ">=0")        # every run's train.steps (a check); 0: the configs' own


def run_plan(plan, *, dry_run: bool = False, report_only: bool = False) -> int:
  """A kind-tpu study file, run (`sinkjax.experiments.study`): the grid of its axes (seed, size, variant, loss; in
  the file's order, seed-major) launched run by run (`run_grid`)."""
  o = plan.options({"tpu": TpuOptions})["tpu"]
  grid = {"seed": None, "size": SIZES, "variant": VARIANTS, "loss": LOSSES}
  for axis, values in plan.axes.items():
    if axis not in grid:
      raise StudyError(f"{plan.path}: the tpu study's axes are {', '.join(grid)}, got {axis}")
    if grid[axis] is not None and any(v not in grid[axis] for v in values):
      raise StudyError(f"axis {axis}: a subset of {', '.join(grid[axis])}, got {values}")
  if report_only:
    raise StudyError("the tpu study writes no report; Table 1 from its runs: python -m "
                     "sinkjax.experiments.paper_report --runs 'OUT/runs/d*'")
  runs = [TpuRun(str(r.get("size", "d20")), str(r.get("variant", "vanilla")), str(r.get("loss", "base")),
                 int(r.get("seed", 0))) for r in plan.runs()]
  out = plan.study.out.rstrip("/")
  data = (o.data or f"{out}/data").rstrip("/")
  if (bad := problem(out, data, o.name, o.zone, runs, KEYS)) is not None:
    raise StudyError(bad)
  slice_ = Slice(o.name, o.zone, o.type, o.version, o.interval, o.project or None, o.spot, o.queued)
  return run_grid(runs, Bucket(out, data), slice_, steps=o.steps or None, dry_run=dry_run,
                  delete_when_done=o.delete_when_done)


def run_grid(runs: list[TpuRun], bucket: Bucket, slice_: Slice, *, steps: int | None = None, dry_run: bool = False,
             delete_when_done: bool = False) -> int:
  """Launches every run the bucket does not hold finished, one at a time (see the module docstring)."""
  out, opts = bucket.out, slice_.options()
  states = {r.name: run_state(bucket.run_dir(r)) for r in runs}
  todo = [r for r in runs if not states[r.name].finished(steps)]
  print(f"scale tpu: {NOTE}; {len(runs) - len(todo)} of {len(runs)} runs finished in {out}/runs", flush=True)
  if todo and not dry_run:
    print(check_data(todo, bucket, steps), flush=True)
  for i, run in enumerate(runs, 1):
    state = states[run.name]
    cmd = launch_command(run, bucket, opts, steps, delete_when_done=bool(delete_when_done and todo and run == todo[-1]))
    head = f"[{i}/{len(runs)}] {run.name}: {state.describe(steps)}"
    if state.finished(steps):
      print(f"{head}, skipped", flush=True)
      continue
    print(f"{head} -> {shlex.join(cmd)}", flush=True)
    if dry_run:
      continue
    rc = subprocess.run(cmd, cwd=REPO, check=False).returncode
    after = run_state(bucket.run_dir(run))
    if rc != 0 or not after.finished(steps):
      raise StudyError(f"run {run.name} ended {after.describe(steps)} (launch/tpu_vm.sh babysit exited {rc}; "
                       f"its logs: launch/tpu_vm.sh logs --name {slice_.name} --zone {slice_.zone} --job {run.name}); "
                       "rerun the same command to continue the grid")
    print(f"[{i}/{len(runs)}] {run.name}: finished at step {after.latest}", flush=True)
  if not dry_run:
    print(f"every run finished; Table 1: python -m sinkjax.experiments.paper_report --runs '{out}/runs/d*' "
          "--out report", flush=True)
  return 0
