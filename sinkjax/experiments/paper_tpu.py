"""[Sink-MoE] Table 1's 18 runs on a TPU slice: study driver tpu (configs/studies/paper_tpu.yaml).

    python -m sinkjax.experiments.study configs/studies/paper_tpu.yaml study.out=gs://BUCKET tpu.name=sj \
        tpu.zone=us-central1-a [axes.size=[d20]] [axes.seed=[0,1]] [tpu.spot=true] [tpu.steps=N] [--dry-run]

The grid is `configs/paper/{size}_{variant}_{loss}.yaml` (seed 0 is the configs' own, seed K > 0 adds `train.seed=K`
and `_sK` to the name), seed-major. Each run is one launch: `launch/tpu_vm.sh babysit --job NAME -- --config
configs/paper/NAME.yaml run.dir=OUT/runs/NAME data.source=... data.val_source=... data.tokenizer=...`, which creates
and sets up the slice if it is missing, starts the run, restarts it after a preemption and returns when the run has
ended. The bucket holds the data in DATA (default OUT/data: `fineweb-edu/shard_*.parquet`,
`fineweb-edu/val/shard_01822.parquet`, `tokenizer/tokenizer.json`) and the runs in `OUT/runs/NAME`.

Resumable: each run's state is read from the bucket (its config.yaml's train.steps and the latest checkpoint Orbax
lists there): a finished run is skipped, an unfinished one launched again (the trainer resumes it). A launch that ends
with the run unfinished stops the grid with one line; rerunning the command continues it. Before the first launch the
data is checked against what the largest run reads (`sinkjax.data.fineweb.plan`). --report-only: Table 1 and Figs. 5
/ 8 of the finished runs, written to OUT/report (`paper_report.runs_report`). docs/SCALING.md describes the whole path.
"""
from __future__ import annotations

import dataclasses
import shlex
import subprocess

from sinkjax import paths
from sinkjax.config import declare
from sinkjax.experiments.paper_report import LOSSES, VARIANTS, runs_report
from sinkjax.experiments.runner import REPO, StudyError

TPU_VM = "launch/tpu_vm.sh"              # relative to REPO: the launcher, run from the checkout
SIZES = ("d20", "d26", "d32")
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


@dataclasses.dataclass
class TpuOptions:
  """The `tpu:` section of a driver-tpu study file (configs/studies/paper_tpu.yaml): the slice and the data."""
  name: str = ""                    # the TPU VM's name (required)
  zone: str = ""                    # its zone, e.g. us-central1-a (required)
  project: str = ""                 # gcloud project ("": gcloud's)
  type: str = "v5litepod-32"        # accelerator type (all 18 configs fit: docs/TPU.md)
  version: str = "v2-alpha-tpuv5-lite"   # TPU runtime (v5e's)
  spot: bool = False                # spot capacity
  queued: bool = False              # ask for the slice as a queued resource
  interval: int = declare(300, ">=0")   # seconds between babysit's checks
  delete_when_done: bool = False    # delete the slice after the last run finishes
  data: str = ""                    # the bucket's fineweb-edu/ and tokenizer/tokenizer.json ("": OUT/data)
  steps: int = declare(0, ">=0")        # every run's train.steps (a check); 0: the configs' own


def launch_command(run: TpuRun, bucket: Bucket, o: TpuOptions, *, delete_when_done: bool = False) -> list[str]:
  """The one launch of a run on the slice `o` names (relative to the checkout)."""
  opts = ["--name", o.name, "--zone", o.zone, "--type", o.type, "--version", o.version, "--interval", str(o.interval)]
  opts += (["--project", o.project] if o.project else []) + (["--spot"] if o.spot else [])
  opts += (["--queued"] if o.queued else []) + (["--delete-when-done"] if delete_when_done else [])
  return ["bash", TPU_VM, "babysit", *opts, "--job", run.name, "--", *train_args(run, bucket, o.steps or None)]


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

def run_plan(plan, *, dry_run: bool = False, report_only: bool = False) -> None:
  """A driver-tpu study file, run (`sinkjax.experiments.study`): the grid of its axes (seed, size, variant, loss; in
  the file's order, seed-major) launched run by run (`run_grid`), or with report_only Table 1 of its finished runs."""
  o = plan.options({"tpu": TpuOptions})["tpu"]
  grid = {"seed": None, "size": SIZES, "variant": VARIANTS, "loss": tuple(LOSSES)}
  for axis, values in plan.axes.items():
    if axis not in grid:
      raise StudyError(f"{plan.path}: the tpu study's axes are {', '.join(grid)}, got {axis}")
    if grid[axis] is not None and any(v not in grid[axis] for v in values):
      raise StudyError(f"axis {axis}: a subset of {', '.join(grid[axis])}, got {values}")
  runs = [TpuRun(str(r.get("size", "d20")), str(r.get("variant", "vanilla")), str(r.get("loss", "base")),
                 int(r.get("seed", 0))) for r in plan.runs()]
  out = plan.study.out.rstrip("/")
  data = (o.data or f"{out}/data").rstrip("/")
  if not out.startswith("gs://"):
    raise StudyError(f"the tpu study needs study.out=gs://BUCKET (the workers share nothing but the bucket), got {out!r}")
  if report_only:
    runs_report([f"{out}/runs/d*"], f"{out}/report")
    return
  if not data.startswith("gs://"):
    raise StudyError(f"tpu.data must be in the bucket (gs://...), got {data!r}")
  if not o.name or not o.zone:
    raise StudyError("the tpu study needs tpu.name (the TPU VM's) and tpu.zone")
  missing = [f for f in (TPU_VM, *{r.config for r in runs}) if not (REPO / f).is_file()]
  if missing:
    raise StudyError(f"the tpu study launches from a checkout of sinkjax (launch/, configs/paper/); {REPO} lacks "
                     f"{missing[0]}: run it from a clone (pip install -e .)")
  run_grid(runs, Bucket(out, data), o, dry_run=dry_run)


def run_grid(runs: list[TpuRun], bucket: Bucket, o: TpuOptions, *, dry_run: bool = False) -> None:
  """Launches every run the bucket does not hold finished, one at a time (see the module docstring)."""
  out, steps = bucket.out, o.steps or None
  states = {r.name: run_state(bucket.run_dir(r)) for r in runs}
  todo = [r for r in runs if not states[r.name].finished(steps)]
  print(f"scale tpu: {NOTE}; {len(runs) - len(todo)} of {len(runs)} runs finished in {out}/runs", flush=True)
  if todo and not dry_run:
    print(check_data(todo, bucket, steps), flush=True)
  for i, run in enumerate(runs, 1):
    state = states[run.name]
    cmd = launch_command(run, bucket, o, delete_when_done=o.delete_when_done and run in todo[-1:])
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
                       f"its logs: launch/tpu_vm.sh logs --name {o.name} --zone {o.zone} --job {run.name}); "
                       "rerun the same command to continue the grid")
    print(f"[{i}/{len(runs)}] {run.name}: finished at step {after.latest}", flush=True)
  if not dry_run:
    print(f"every run finished; Table 1 and Figs. 5 / 8 in {out}/report: the same command with --report-only",
          flush=True)
