"""Weights & Biases tracking of a training run (`logging.wandb=true`; pip install 'sinkjax[wandb]').

Process 0 sends what `metrics.jsonl` holds to a W&B run: every record at its training step (loss, ce_loss, aux_loss,
head_imbalance, grad_norm, lr, tokens_per_s, tokens, elapsed_s, finite, val_bpb when measured, and the L x H
importance as one scalar per head, `importance/layer{l}_head{h}`), and the resolved config as the run's config.

The W&B run id is drawn once and stored in the run directory (`wandb_id`), so a resumed training (the same command
again) continues the same W&B run (`resume="allow"`). W&B keeps the steps it already has: the records a resume
logs again (those after the restored checkpoint, which metrics.jsonl drops and rewrites) are recomputed bit for bit
on the same hardware, and W&B ignores a step it has seen. With `WANDB_MODE=offline` nothing is sent and no key is
needed: the run is written under `RUN_DIR/wandb/` (or `$WANDB_DIR`) and `wandb sync` uploads it later. Settings:
`logging.wandb_project`, `logging.wandb_entity`, `logging.wandb_name` (default: the run directory's name),
`logging.wandb_tags`; the environment variables of W&B (WANDB_API_KEY, WANDB_MODE, WANDB_DIR, ...) apply as usual.
"""
from __future__ import annotations

import os
import secrets
import string

from sinkjax import config as config_lib
from sinkjax import paths
from sinkjax.config import Config, ConfigError

ID_FILE = "wandb_id"
INSTALL_HINT = "logging.wandb=true needs the wandb package: pip install 'sinkjax[wandb]'"


def flat_record(rec: dict) -> dict:
  """A metrics.jsonl record as W&B scalars: `step` is the W&B step, the [L][H] importance one key per head."""
  out = {k: v for k, v in rec.items() if k not in ("step", "importance")}
  for l, row in enumerate(rec.get("importance") or []):
    for h, v in enumerate(row):
      out[f"importance/layer{l}_head{h}"] = v
  return out


class WandbRun:
  """One W&B run for one run directory (see the module docstring). Process 0 only."""

  def __init__(self, cfg: Config, run_dir):
    try:
      import wandb  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise ConfigError(INSTALL_HINT) from None
    lg = cfg.logging
    id_path = run_dir / ID_FILE
    run_id = id_path.read_text().strip() if id_path.is_file() else ""
    self.resumed = bool(run_id)
    if not run_id:
      run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
      paths.write_atomic(id_path, run_id + "\n")
    self.run_id = run_id
    kwargs = dict(project=lg.wandb_project or None, entity=lg.wandb_entity or None,
                  name=lg.wandb_name or run_dir.name, tags=[str(t) for t in lg.wandb_tags] or None, id=run_id,
                  resume="allow")
    if not os.environ.get("WANDB_DIR") and not paths.is_remote(run_dir):
      (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
      kwargs["dir"] = str(run_dir)                 # W&B writes RUN_DIR/wandb/
    try:
      self.run = wandb.init(**kwargs)
    except Exception as e:  # pylint: disable=broad-except  # auth, network, bad entity: W&B's own exception types
      why = " ".join(str(e).split())[:300] or type(e).__name__
      raise ConfigError(f"logging.wandb: wandb.init failed ({why}); log in with `wandb login`, or set "
                        "WANDB_MODE=offline to write the run locally and `wandb sync` it later") from None
    resolved = config_lib.to_dict(cfg)
    resolved["train"]["stop_at_step"] = 0          # a property of one invocation, as config.yaml stores it
    self.run.config.update(resolved, allow_val_change=True)   # a resume may change e.g. train.steps

  def log(self, rec: dict) -> None:
    self.run.log(flat_record(rec), step=int(rec["step"]))

  def finish(self, exit_code: int = 0) -> None:
    self.run.finish(exit_code=exit_code)


def require(cfg: Config) -> None:
  """With logging.wandb, a ConfigError naming the extra when wandb is not installed (checked before training)."""
  if cfg.logging.wandb:
    try:
      import wandb  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
      raise ConfigError(INSTALL_HINT) from None


def start(cfg: Config, run_dir):
  """The W&B run of this training (process 0, `logging.wandb`), or None."""
  return WandbRun(cfg, run_dir) if cfg.logging.wandb else None
