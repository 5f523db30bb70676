"""The one command that runs a study file (configs/studies/*.yaml; the format and the kinds: docs/COMMANDS.md).

    python -m sinkjax.experiments.study FILE [key=value ...] [--dry-run] [--report-only]

`key=value` sets a config key of every run (`train.steps=50`), a key of the study (`study.out=runs/x`) or an axis
(`axes.train.seed=[0,1]`: a new axis is a new line of the grid's product). `study.kind` picks the module (`KINDS`)
that makes the runs and writes the report; each run records the commit and config it was made with.
"""
from __future__ import annotations

import importlib
import sys

from sinkjax import cli
from sinkjax.experiments import runner


def build_parser() -> cli.Parser:
  p = cli.Parser(prog="python -m sinkjax.experiments.study", description=__doc__.split("\n\n")[0])
  p.add_argument("file", help="the study file (configs/studies/*.yaml)")
  p.add_argument("overrides", nargs="*", metavar="key=value",
                 help="a config key of every run, study.KEY, or axes.KEY=[v1,v2] (an axis)")
  p.add_argument("--dry-run", action="store_true", help="list the grid and what is done, run nothing")
  p.add_argument("--report-only", action="store_true", help="run nothing: the report of the runs finished so far")
  return p


# kind -> the module whose run_plan(plan, dry_run=, report_only=) makes its runs and calls its report (imported when
# a study of that kind runs: the kinds' modules import the runner, not this command)
KINDS = {"paper": "sinkjax.experiments.paper", "dose": "sinkjax.experiments.paper",
         "pinning": "sinkjax.experiments.heads_pinning", "streaming": "sinkjax.experiments.streaming_real",
         "passkey": "sinkjax.experiments.passkey", "trigger": "sinkjax.experiments.trigger",
         "importance": "sinkjax.experiments.heads_real", "pinning_null": "sinkjax.experiments.heads_pinning",
         "tpu": "sinkjax.experiments.paper_tpu"}
assert set(KINDS) == set(runner.STUDY_KINDS)


def run(plan: runner.Plan, *, dry_run: bool = False, report_only: bool = False) -> None:
  """Runs the plan with its kind's driver."""
  importlib.import_module(KINDS[plan.study.kind]).run_plan(plan, dry_run=dry_run, report_only=report_only)


def main(argv=None) -> int:
  cli.require_extra("sinkjax.experiments.study")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser().parse_args(argv)
  command = "python -m sinkjax.experiments.study " + " ".join(argv)
  return cli.run_main("sinkjax.experiments.study", lambda: run(
      runner.load_plan(args.file, args.overrides, command=command), dry_run=args.dry_run,
      report_only=args.report_only))


if __name__ == "__main__":
  sys.exit(main())
