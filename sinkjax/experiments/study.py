"""The one command that runs a study file (configs/studies/*.yaml; the format and the drivers: docs/COMMANDS.md).

    python -m sinkjax.experiments.study FILE [key=value ...] [--dry-run] [--report-only]

`key=value` sets a config key of every run (`train.steps=50`), a key of the study (`study.out=runs/x`) or an axis
(`axes.train.seed=[0,1]`: a new axis is a new line of the grid's product). `study.driver` picks the module (`DRIVERS`)
that makes the runs and writes the report; each run records the commit and config it was made with.
"""
from __future__ import annotations

import dataclasses
import importlib
import sys

from sinkjax import config, errors, options
from sinkjax.config import declare
from sinkjax.experiments import runner


@dataclasses.dataclass
class StudyCommandOptions:
  """The command's own options; every other `key=value` word is a key of the study file (`runner.load_plan`)."""
  file: str | None = declare(None, alias="--file", metavar="FILE", required=True,
                         help="the study file, or a packaged study by name (also the one word without '='): "
                              + config.packaged_list("studies"))
  dry_run: bool = declare(False, alias="--dry-run", help="list the grid and what is done, run nothing")
  report_only: bool = declare(False, alias="--report-only", help="run nothing: the report of the runs finished so far")


COMMAND = options.Command(
    prog="python -m sinkjax.experiments.study", description=__doc__.split("\n\n")[0],
    sections={"study_command": StudyCommandOptions}, run_overrides=True, options_file=None,
    positional="study_command.file")


# driver -> the module whose run_plan(plan, dry_run=, report_only=) makes its runs and calls its report (imported
# when a study of that driver runs: the drivers' modules import the runner, not this command)
DRIVERS = {"paper": "sinkjax.experiments.paper", "dose": "sinkjax.experiments.paper",
         "pinning": "sinkjax.experiments.heads_pinning", "streaming": "sinkjax.experiments.streaming_real",
         "passkey": "sinkjax.experiments.passkey", "trigger": "sinkjax.experiments.trigger",
         "importance": "sinkjax.experiments.heads_real", "pinning_null": "sinkjax.experiments.heads_pinning",
         "tpu": "sinkjax.experiments.paper_tpu", "far_context": "sinkjax.experiments.far_context"}
assert set(DRIVERS) == set(runner.STUDY_DRIVERS)


def run(plan: runner.Plan, *, dry_run: bool = False, report_only: bool = False) -> None:
  """Runs the plan with its driver."""
  importlib.import_module(DRIVERS[plan.study.driver]).run_plan(plan, dry_run=dry_run, report_only=report_only)


def main(argv=None) -> int:
  errors.require_extra("sinkjax.experiments.study")
  argv = sys.argv[1:] if argv is None else list(argv)
  command = "python -m sinkjax.experiments.study " + " ".join(argv)

  def go(sections, overrides):
    opts = sections["study_command"]
    return run(runner.load_plan(opts.file, overrides, command=command), dry_run=opts.dry_run,
               report_only=opts.report_only)
  return options.main(COMMAND, argv, go)


if __name__ == "__main__":
  sys.exit(main())
