"""The one command that runs a study file (configs/studies/*.yaml; the format: `sinkjax.experiments.runner`).

    python -m sinkjax.experiments.study FILE [key=value ...] [--dry-run] [--report-only]

`key=value` sets a config key of every run (`train.steps=50`), a key of the study (`study.out=runs/x`) or an axis
(`axes.train.seed=[0,1]`, `axes.model.gate=[headwise,elementwise]`: a new axis is a new line of the grid's product).
The study's `study.kind` says which driver makes its runs and which report reads them:
- `paper`: [Sink-MoE]'s from-scratch grid, results.json / results.md / figures (`sinkjax.experiments.paper`);
- `dose`: the same runs over lambda, dose.json (then `paper_report --dose`);
- `pinning`: App. D on an imported model, one epoch, per-document losses (`sinkjax.experiments.heads_pinning`);
- `streaming`: streaming perplexity of an imported model under each KV cache (`sinkjax.experiments.streaming_real`);
- `passkey`: passkey retrieval of a run per length, depth and KV cache (`sinkjax.experiments.passkey`).
Each run records the commit and config it was made with; a rerun resumes, skipping finished runs.
"""
from __future__ import annotations

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


def run(plan: runner.Plan, *, dry_run: bool = False, report_only: bool = False, command: str = "") -> None:
  """Runs the plan with its kind's driver (imported here: the kinds' modules import the runner, not this one)."""
  if plan.study.kind in ("paper", "dose"):
    from sinkjax.experiments import paper  # pylint: disable=import-outside-toplevel
    paper.run_plan(plan, dry_run_only=dry_run, report_only=report_only, command=command)
  elif plan.study.kind == "pinning":
    from sinkjax.experiments import heads_pinning  # pylint: disable=import-outside-toplevel
    heads_pinning.run_plan(plan, dry_run=dry_run, report_only=report_only)
  elif plan.study.kind == "streaming":
    from sinkjax.experiments import streaming_real  # pylint: disable=import-outside-toplevel
    streaming_real.run_plan(plan, dry_run=dry_run, report_only=report_only)
  else:
    from sinkjax.experiments import passkey  # pylint: disable=import-outside-toplevel
    passkey.run_plan(plan, dry_run=dry_run, report_only=report_only)


def main(argv=None) -> int:
  cli.require_extra("sinkjax.experiments.study")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser().parse_args(argv)
  command = "python -m sinkjax.experiments.study " + " ".join(argv)
  return cli.run_main("sinkjax.experiments.study", lambda: run(
      runner.load_plan(args.file, args.overrides), dry_run=args.dry_run, report_only=args.report_only,
      command=command))


if __name__ == "__main__":
  sys.exit(main())
