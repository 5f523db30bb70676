"""Figures of a run (training curves, head imbalance, layer x head importance), shared by train and eval."""
from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def read_metrics(metrics_path) -> list[dict]:
  """The records of a metrics.jsonl file (a truncated last line, e.g. from a killed run, is skipped)."""
  records = []
  for line in pathlib.Path(metrics_path).read_text().splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return records


def _series(records, key):
  pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
  return ([p[0] for p in pts], [p[1] for p in pts]) if pts else ([], [])


def plot_training_curves(metrics_path, out_dir) -> list[pathlib.Path]:
  """Writes loss.png (train loss, aux loss, val BPB) and head_imbalance.png into out_dir; returns their paths."""
  records = read_metrics(metrics_path)
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = []

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  steps, loss = _series(records, "loss")
  axes[0].plot(steps, loss, label="train loss (CE + aux)")
  s_aux, aux = _series(records, "aux_loss")
  if any(a for a in aux):
    axes[0].plot(s_aux, aux, label="aux loss (eq. 7/8)")
  axes[0].set_xlabel("step")
  axes[0].set_ylabel("nats / token")
  axes[0].set_title("training loss")
  axes[0].legend()
  axes[0].grid(alpha=0.3)
  s_bpb, bpb = _series(records, "val_bpb")
  axes[1].plot(s_bpb, bpb, marker="o", color="tab:green")
  axes[1].set_xlabel("step")
  axes[1].set_ylabel("bits per byte")
  axes[1].set_title("validation BPB")
  axes[1].grid(alpha=0.3)
  fig.tight_layout()
  paths.append(out_dir / "loss.png")
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 4))
  s_hi, hi = _series(records, "head_imbalance")
  ax.plot(s_hi, hi, color="tab:red")
  ax.set_xlabel("step")
  ax.set_ylabel("mean over layers of CV(Imp[l, :])")
  ax.set_title("head imbalance (eq. 6)")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  paths.append(out_dir / "head_imbalance.png")
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths


def plot_importance_heatmap(imp_lh, path, title: str = "head importance") -> pathlib.Path:
  """A layer x head heatmap of Imp[l, h] (eq. 5) written to `path`."""
  imp = np.asarray(imp_lh, np.float32)
  L, H = imp.shape
  fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * H + 2.0), max(3.0, 0.3 * L + 1.5)))
  im = ax.imshow(imp, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(float(imp.max()), 1e-6))
  ax.set_xlabel("head")
  ax.set_ylabel("layer")
  ax.set_xticks(range(H))
  ax.set_yticks(range(L))
  ax.set_title(title)
  fig.colorbar(im, ax=ax, label="Imp = mean gate")
  fig.tight_layout()
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


# ---------------------------------------------------------------------------------------------------------------
# Evaluation figures (sinkjax.eval): attention sink diagnostics of one checkpoint
# ---------------------------------------------------------------------------------------------------------------

def _save(fig, path) -> pathlib.Path:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_first_token_attention(per_head_lh, path, *, sink_weight=None, title="first-token attention") -> pathlib.Path:
  """Mean attention on each document's first token per layer (line) with every head (dots), as paper 003 Fig. 2;
  `sink_weight` [L] (sink attention) adds the weight on the sink logit."""
  a = np.asarray(per_head_lh, np.float32)
  L, H = a.shape
  layers = np.arange(L)
  fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * L + 3.0), 3.8))
  for h in range(H):
    ax.scatter(layers, a[:, h], s=12, color="tab:blue", alpha=0.35, label="per head" if h == 0 else None)
  ax.plot(layers, a.mean(1), marker="o", color="tab:blue", label="first token (mean over heads)")
  if sink_weight is not None:
    ax.plot(layers, np.asarray(sink_weight), marker="s", color="tab:orange", label="sink logit (1 - gate)")
  ax.set_xlabel("layer")
  ax.set_ylabel("attention weight")
  ax.set_ylim(-0.02, 1.02)
  ax.set_xticks(layers)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, path)


def plot_value_norms(norm_by_position, path, title="value norm by position") -> pathlib.Path:
  """||v_t||_2 (mean over heads and documents) against the in-document position t, one line per layer, as paper
  000 Fig. 2 (position 0 is the document's first token)."""
  n = np.asarray(norm_by_position, np.float32)
  L, P = n.shape
  fig, ax = plt.subplots(figsize=(7, 4))
  cmap = plt.get_cmap("viridis")
  for l in range(L):
    ax.plot(np.arange(P), n[l], marker=".", ms=3, color=cmap(l / max(L - 1, 1)), label=f"layer {l}")
  ax.set_xlabel("position in document (0 = first token)")
  ax.set_ylabel("||v||_2")
  ax.set_ylim(bottom=0)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2 if L > 8 else 1)
  return _save(fig, path)


def plot_gate_histogram(edges, density_lb, path, title="gate distribution") -> pathlib.Path:
  """Distribution of the gate values G on [0, 1] per layer (and over all layers), as paper 003 Fig. 3."""
  edges = np.asarray(edges, np.float32)
  d = np.asarray(density_lb, np.float32)
  L = d.shape[0]
  fig, ax = plt.subplots(figsize=(7, 4))
  cmap = plt.get_cmap("viridis")
  for l in range(L):
    ax.stairs(d[l], edges, color=cmap(l / max(L - 1, 1)), alpha=0.6, label=f"layer {l}")
  ax.stairs(d.mean(0), edges, color="black", linewidth=2, label="all layers")
  ax.set_xlabel("gate value G")
  ax.set_ylabel("fraction of gate values")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2 if L > 8 else 1)
  return _save(fig, path)
