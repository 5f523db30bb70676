"""The study runner: a study file (`Plan`, `load_plan`) turned into a grid of `Run`s that a `Study` walks in order,
each in its own directory, skipping finished runs, resuming interrupted ones, locking the one it works on and
recording the commit (the format and the walk: docs/COMMANDS.md, "Studies")."""
from __future__ import annotations

import dataclasses
import fcntl
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import time
from typing import Any, Callable

import yaml

from sinkjax import config as config_lib
from sinkjax import paths
from sinkjax import options as options_lib
from sinkjax.errors import UserError
from sinkjax.config import declare

REPO = pathlib.Path(__file__).resolve().parents[2]


class StudyError(UserError):
  """A user-facing problem of a study (the message says what to change)."""


# ------------------------------------------------------------------------------------------------------ files

def read_json(path) -> Any:
  """The JSON at `path`, or None when there is no such file."""
  path = pathlib.Path(path)
  return json.loads(path.read_text()) if path.is_file() else None


def write_json(path, obj) -> None:
  """Writes `obj` as indented JSON through a temporary file (`paths.write_atomic`): a reader never sees half a record."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  paths.write_atomic(path, json.dumps(obj, indent=1))


def git_commit() -> dict:
  """{"commit": HEAD of the checkout this code runs from (or "unknown"), "dirty": whether tracked files differ from
  it}: what a run was made with."""
  try:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True, timeout=30).stdout.strip() != ""
  except (OSError, subprocess.SubprocessError):
    return {"commit": "unknown", "dirty": None}
  return {"commit": head, "dirty": dirty}


def one_commit(records: list[dict]) -> str | None:
  """The commit every record was made with; a StudyError naming them when they differ (None: no records)."""
  by = {}
  for r in records:
    by.setdefault(r.get("commit") or "unrecorded", []).append(r.get("name") or r.get("run_dir") or "?")
  if len(by) > 1:
    raise StudyError("runs of different commits cannot be aggregated: " + "; ".join(
        f"{c}: {', '.join(map(str, names))}" for c, names in sorted(by.items())) + " (rerun them on one commit, or "
        "give each commit its own --out)")
  return next(iter(by), None)


def copy_files(src: pathlib.Path, dst: pathlib.Path, names) -> None:
  """Copies those of `names` that exist in src to dst (created when there is something to copy)."""
  for name in names:
    if (src / name).is_file():
      dst.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src / name, dst / name)


# ------------------------------------------------------------------------------------------------------ locks

def _try_lock(path: pathlib.Path):
  """An open file holding an exclusive flock on `path`, or None when another process holds it. A lock file is
  removed by its holder when done, so after locking, the path must still be the file that was locked (else a
  holder removed it in between and the lock is on a dead file: try again)."""
  while True:
    f = open(path, "a+")  # pylint: disable=consider-using-with
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.close()
      return None
    try:
      if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
        return f
    except FileNotFoundError:
      pass
    f.close()


def _unlock(f, path: pathlib.Path) -> None:
  path.unlink(missing_ok=True)
  f.close()


def exclusive(directory, what: str = "study.out"):
  """An exclusive lock on a whole study directory (DIR/.study.lock, released when the process ends, however it
  ends): for drivers whose invocations must not run side by side; a StudyError when another holds it."""
  directory = pathlib.Path(directory)
  f = _try_lock(directory / ".study.lock")
  if f is None:
    raise StudyError(f"another invocation of the study is running on {what} {directory}; wait for it to finish "
                     f"(then rerun this one: finished runs are skipped) or use another {what}")
  return f


# ------------------------------------------------------------------------------------------------------ the grid

@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a study: its name (its directory under the study's root), the config overrides that make it (for
  the record and for `do`), and what to do in its directory: `do(run_dir) -> (record, what)`."""
  name: str
  do: Callable[[pathlib.Path], tuple[dict, str]]
  overrides: tuple[str, ...] = ()


@dataclasses.dataclass
class Result:
  """What walking one run gave: its record (None when another process holds it), whether `do` ran, whether it
  resumed an interrupted run, and a few words on what happened."""
  run: Run
  record: dict | None
  ran: bool
  what: str
  seconds: float
  resumed: bool = False


SKIPPED = "done before, skipped"
LOCKED = "running in another process, skipped"


class Study:
  """A grid of runs under `root`: run NAME lives in root/layout (layout's "{name}" filled in), finished when its
  record file (`record`, "{name}" filled in) exists there; `raw` (a directory, or None) receives each run's
  `raw_files` in raw/NAME. `stamp` adds the study's commit to the records the runner writes."""

  def __init__(self, root, *, layout: str = "runs/{name}", record: str = "record.json", raw=None,
               raw_files: tuple[str, ...] = (), stamp: bool = True, commit: dict | None = None):
    self.root = pathlib.Path(root)
    self.layout, self.record, self.stamp = layout, record, stamp
    self.raw = None if raw is None else pathlib.Path(raw)
    self.raw_files = tuple(raw_files)
    self.commit = dict(commit) if commit is not None else git_commit()

  def run_dir(self, name: str) -> pathlib.Path:
    return self.root / self.layout.format(name=name)

  def record_path(self, name: str) -> pathlib.Path:
    return self.run_dir(name) / self.record.format(name=name)

  def state(self, name: str) -> str:
    """"done" (its record exists), "started" (its own directory exists without a record: interrupted) or "to do"."""
    if self.record_path(name).is_file():
      return "done"
    d = self.run_dir(name)
    return "started" if d != self.root and d.is_dir() else "to do"

  def keep_raw(self, name: str) -> None:
    """Copies the run's raw files to raw/NAME (nothing when the study keeps none)."""
    if self.raw is not None and self.raw_files:
      copy_files(self.run_dir(name), self.raw / name, self.raw_files)

  def walk_one(self, run: Run) -> Result:
    """Skips, resumes or makes one run (see the module docstring)."""
    t0 = time.perf_counter()
    path = self.record_path(run.name)
    if path.is_file():
      self.keep_raw(run.name)
      return Result(run, read_json(path), False, SKIPPED, time.perf_counter() - t0)
    d = self.run_dir(run.name)
    resumed = self.state(run.name) == "started"
    d.mkdir(parents=True, exist_ok=True)
    lock_path = d / f".{run.name}.lock"
    lock = _try_lock(lock_path)
    if lock is None:
      return Result(run, None, False, LOCKED, time.perf_counter() - t0)
    try:
      if path.is_file():                  # finished by another process between the check above and the lock
        rec, ran, what = read_json(path), False, SKIPPED
      else:
        rec, what = run.do(d)
        ran = True
        if not path.is_file():
          rec = {**rec, **self.commit} if self.stamp else rec
          write_json(path, rec)
    finally:
      _unlock(lock, lock_path)
    self.keep_raw(run.name)
    return Result(run, rec, ran, what, time.perf_counter() - t0, resumed and ran)

  def walk(self, runs: list[Run], on_result: Callable[[int, int, Result], None] | None = None) -> list[Result]:
    """Walks the runs in order (`walk_one`), calling on_result(i, n, result) after each (1-based i)."""
    out = []
    for i, run in enumerate(runs, 1):
      res = self.walk_one(run)
      out.append(res)
      if on_result is not None:
        on_result(i, len(runs), res)
    return out

  def records(self, names) -> dict[str, dict]:
    """{name: record} of the named runs that are finished, in the given order."""
    return {n: r for n in names if (r := read_json(self.record_path(n))) is not None}


# ------------------------------------------------------------------------------------------------- study files

STUDY_DRIVERS = ("paper", "dose", "pinning", "pinning_null", "streaming", "passkey", "trigger", "importance",
               "tpu", "far_context")


@dataclasses.dataclass
class StudySection:
  """The `study:` section of a study file: what the study is, where it writes, and how much it evaluates."""
  driver: str = declare("paper", choices=STUDY_DRIVERS, formerly="kind")   # which module makes the runs and the report
  out: str = "runs/study"           # the study's directory (runs/NAME, raw/NAME, results); gs:// / s3:// for paper
  scale: str = ""                   # the scale's name, recorded (a dose study reuses main-grid runs of its scale)
  note: str = ""                    # one line on the runs' shape, for the report
  eval_batches: int = declare(8, ">=1")  # held-out batches (of train.batch_size rows) per evaluation
  prompt_len: int = declare(64, ">=1")   # after-prefill value zeroing: tokens prefilled before the scored continuation
  finetune: bool = False            # paper: also fine-tune each base run of the first seed, eq. 7 vs eq. 8
  finetune_steps: int = declare(100, ">=1")
  reuse: str = ""                   # dose: a committed main-grid results.json whose runs stand in (same recipe+commit)
  run: str = ""                     # the run studied (pinning, importance, streaming, passkey: an imported model)
  results: str = ""                 # pinning, importance: where the files to commit go (default OUT/results)
  allow_dirty: bool = False         # pinning: run from a checkout with uncommitted changes (records say dirty)


def flatten(tree: dict, prefix: str = "") -> dict:
  """A nested mapping as {dotted.key: value}."""
  out = {}
  for k, v in tree.items():
    out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def _flat(tree: dict) -> list[str]:
  """A config mapping as `dotted.key=value` overrides (values written as YAML / JSON scalars and lists)."""
  return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in flatten(tree).items()]


def _merge(base: dict, tree: dict) -> dict:
  """`tree` over `base`, section by section (an axis of `tree` replaces the same axis of `base`, keeping its place)."""
  out = dict(base)
  for k, v in tree.items():
    if k == "axes":
      out[k] = {**(base.get("axes") or {}), **v}
    elif isinstance(v, dict) and isinstance(out.get(k), dict):
      out[k] = _merge(out[k], v)
    else:
      out[k] = v
  return out


def _read_study(path: pathlib.Path) -> tuple[pathlib.Path | None, dict]:
  """(the recipe config's path or None, the merged tree of the study file and the study files it extends through base:)."""
  if not path.is_file():
    raise StudyError(f"study file {path} does not exist: give a study file or a packaged study by name "
                     f"({config_lib.packaged_list('studies')})")
  tree = config_lib.read_yaml_file(path, "study file") or {}
  if not isinstance(tree, dict) or "study" not in tree and "axes" not in tree:
    raise StudyError(f"{path} is not a study file: it needs study:, axes: and (to train) base: (configs/studies/)")
  if "base" not in tree:
    return None, tree
  name = str(tree.pop("base"))
  base = path.parent / name
  if not base.is_file():            # base: a packaged config or study by name (`base: tiny`)
    base = config_lib.packaged_file(name) or config_lib.packaged_file(name, "studies") or base
  if not base.is_file():
    raise StudyError(f"{path}: base {base} does not exist")
  above = config_lib.read_yaml_file(base, "config file") or {}
  if "axes" in above or "study" in above:              # a study built on another study
    recipe, parent = _read_study(base)
    return recipe, _merge(parent, tree)
  return base, tree


@dataclasses.dataclass
class Plan:
  """A loaded study file: its section, the recipe and the overrides every run gets, the axes of its grid, and the
  sections of its driver's own keys ({name: mapping}, read by the driver with `config.apply_section`)."""
  path: str
  study: StudySection
  recipe: str
  overrides: tuple[str, ...]
  axes: dict
  sections: dict = dataclasses.field(default_factory=dict)
  command: str = ""                 # the command line that ran it, for the records

  def options(self, classes: dict) -> dict:
    """The driver's own sections of the file, {name: dataclass declared with `declare`} -> {name: typed section}, each value
    checked by its declaration as a command's options are (`sinkjax.options.fill`); a section the driver does not read
    is an error naming it."""
    for other in sorted(set(self.sections) - set(classes)):
      raise StudyError(f"{self.path}: unknown section {other} (driver {self.study.driver} reads study, axes and "
                       f"{', '.join(classes)})")
    given = [(f"{name}.{k}", v) for name, keys in self.sections.items() for k, v in keys.items()]
    try:
      return options_lib.fill(classes, given)
    except config_lib.ConfigError as e:
      raise config_lib.ConfigError(f"{e} (in {self.path})") from None

  def results(self) -> pathlib.Path:
    """study.results, or OUT/results."""
    return pathlib.Path(self.study.results) if self.study.results else pathlib.Path(self.study.out) / "results"

  def runs(self) -> list[dict]:
    """Every combination of the axes' values ({key: value}), the first axis outermost."""
    return [dict(zip(self.axes, vs)) for vs in itertools.product(*self.axes.values())]

  def config(self, run: dict, run_dir, extra=()) -> config_lib.Config:
    """The resolved config of one run: the recipe, the study's overrides, the run's axis values, its run.dir."""
    return config_lib.load_config(self.recipe, [*self.overrides, *_flat(run), f"run.dir={run_dir}", *extra])


def load_plan(path, overrides=(), command: str = "") -> Plan:
  """Reads a study file; `overrides` (`key=value`, as on the command line) set config keys of every run,
  `study.KEY=...` the study's own keys and `axes.KEY=[v1, v2]` (or one value) an axis, added last when new."""
  recipe, tree = _read_study(config_lib.find_packaged(path, "studies") or pathlib.Path(path))
  section, axes = tree.pop("study", {}) or {}, dict(tree.pop("axes", {}) or {})
  configs = {f.name for f in dataclasses.fields(config_lib.Config)}
  own = {k: dict(tree.pop(k)) for k in list(tree) if k not in configs}
  flat = []
  for text in overrides:
    k, v = config_lib.parse_override(text)
    head, _, rest = k.partition(".")
    if head == "study":
      section = {**section, rest: v}
    elif head == "axes":
      values = yaml.safe_load(v)
      axes[rest] = values if isinstance(values, list) else [values]
    elif head in configs:
      flat.append(text)
    else:
      own.setdefault(head, {})[rest] = v
  study = config_lib.apply_section(StudySection(), section, str(path), "study")
  for k, vs in axes.items():
    if not isinstance(vs, list) or not vs:
      raise StudyError(f"{path}: axis {k} must be a non-empty list of values, got {vs!r}")
  plan = Plan(str(path), study, str(recipe or ""), tuple(_flat(tree) + flat), axes, own,
              command or f"python -m sinkjax.experiments.study {path} {' '.join(overrides)}".strip())
  if recipe is not None:
    for name in own:
      raise StudyError(f"{path}: unknown config key {name} (the sections are {', '.join(sorted(configs))})")
    plan.config(plan.runs()[0] if axes else {}, "RUN_DIR")        # a bad key or value: one line now, not mid-study
  elif plan.overrides:
    raise StudyError(f"{path}: config keys ({plan.overrides[0]}, ...) need a recipe to apply to (base:)")
  return plan
