"""Figures of a run (training curves, head imbalance, layer x head importance), shared by train and eval."""
from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from sinkjax import paths as paths_lib  # noqa: E402


def _series(records, key):
  pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
  return ([p[0] for p in pts], [p[1] for p in pts]) if pts else ([], [])


def plot_training_curves(records: list[dict], out_dir) -> list[pathlib.Path]:
  """Writes loss.png (train loss, aux loss on its own log axis, val BPB) and head_imbalance.png into out_dir, from
  the records of a metrics.jsonl (`sinkjax.run.read_metrics`)."""
  out_dir = paths_lib.as_path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = []

  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  steps, loss = _series(records, "loss")
  axes[0].plot(steps, loss, label="train loss (CE + aux), per logged step")
  _labels(axes[0], "training loss", "nats / token")
  axes[0].legend(fontsize=8)
  s_aux, aux = _series(records, "aux_loss")
  positive = [(s, a) for s, a in zip(s_aux, aux) if a > 0]
  if positive:      # ~1e-4 of the CE: invisible on the loss axis, so it gets its own, logarithmic
    axes[1].plot(*zip(*positive), color="tab:purple")
    axes[1].set_yscale("log")
  else:
    axes[1].text(0.5, 0.5, "no aux loss in this run\n(loss.aux_weight = 0)", ha="center", va="center",
                 transform=axes[1].transAxes)
  _labels(axes[1], "aux loss (eq. 7/8)", "lambda * sum_l H CV^2  (log scale)")
  s_bpb, bpb = _series(records, "val_bpb")
  axes[2].plot(s_bpb, bpb, marker="o", color="tab:green")
  _labels(axes[2], "validation BPB", "bits per byte")
  paths.append(_save(fig, out_dir / "loss.png"))

  fig, ax = plt.subplots(figsize=(6, 4))
  s_hi, hi = _series(records, "head_imbalance")
  ax.plot(s_hi, hi, color="tab:red")
  _labels(ax, "head imbalance (eq. 6)", "mean over layers of CV(Imp[l, :])")
  paths.append(_save(fig, out_dir / "head_imbalance.png"))
  return paths


def _labels(ax, title: str, ylabel: str, xlabel: str = "step") -> None:
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)


def layer_colors(L: int) -> list:
  """One colour per layer from viridis without its pale yellow end (readable on white)."""
  cmap = plt.get_cmap("viridis")
  return [cmap(0.85 * l / max(L - 1, 1)) for l in range(L)]


ANNOTATE_CELLS = 256      # heatmaps with at most this many cells print each value in its cell


def plot_importance_heatmap(imp_lh, path, title: str = "head importance") -> pathlib.Path:
  """A layer x head heatmap of Imp[l, h] (eq. 5) written to `path`. The colour scale spans the data's own range
  (importances often sit within 0.87-0.99, which a 0-1 scale would hide) and small grids print every value."""
  imp = np.asarray(imp_lh, np.float32)
  L, H = imp.shape
  lo, hi = float(imp.min()), float(imp.max())
  if hi - lo < 1e-6:
    lo, hi = lo - 0.5e-3, hi + 0.5e-3
  fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * H + 2.0), max(3.0, 0.4 * L + 1.5)))
  im = ax.imshow(imp, aspect="auto", cmap="viridis", vmin=lo, vmax=hi)
  if L * H <= ANNOTATE_CELLS:
    for l in range(L):
      for h in range(H):
        light = (imp[l, h] - lo) / (hi - lo) > 0.6           # dark text on the pale end of viridis
        ax.text(h, l, f"{imp[l, h]:.3f}", ha="center", va="center", fontsize=7 if H > 8 else 8,
                color="black" if light else "white")
  ax.set_xticks(range(H))
  ax.set_yticks(range(L))
  _labels(ax, title, "layer", xlabel="head")
  ax.grid(False)
  fig.colorbar(im, ax=ax, label=f"Imp = mean gate (range {lo:.3f}-{hi:.3f})")
  return _save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation figures (sinkjax.eval): attention sink diagnostics of one checkpoint
# ---------------------------------------------------------------------------------------------------------------

def _save(fig, path):
  """Writes `fig` as PNG to a local path or an object-store URL (`sinkjax.paths`) and returns the path."""
  path = paths_lib.as_path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  with path.open("wb") as f:
    fig.savefig(f, dpi=110, format="png")
  plt.close(fig)
  return path


def plot_first_token_attention(per_head_lh, path, *, sink_weight=None, title="first-token attention") -> pathlib.Path:
  """Mean attention on each document's first token per layer (line) with every head (dots), as [GatedAttn] Fig. 2;
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
  [Sink-MoE] Fig. 2 (position 0 is the document's first token)."""
  n = np.asarray(norm_by_position, np.float32)
  L, P = n.shape
  fig, ax = plt.subplots(figsize=(7, 4))
  for l, color in enumerate(layer_colors(L)):
    ax.plot(np.arange(P), n[l], marker=".", ms=3, color=color, label=f"layer {l}")
  ax.set_xlabel("position in document (0 = first token)")
  ax.set_ylabel("||v||_2")
  ax.set_ylim(bottom=0)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2 if L > 8 else 1)
  return _save(fig, path)


def plot_gate_histogram(edges, density_lb, path, title="gate distribution") -> pathlib.Path:
  """Distribution of the gate values G on [0, 1] per layer (and over all layers), as [GatedAttn] Fig. 3."""
  edges = np.asarray(edges, np.float32)
  d = np.asarray(density_lb, np.float32)
  L = d.shape[0]
  fig, ax = plt.subplots(figsize=(7, 4))
  for l, color in enumerate(layer_colors(L)):
    ax.stairs(d[l], edges, color=color, alpha=0.6, label=f"layer {l}")
  ax.stairs(d.mean(0), edges, color="black", linewidth=2, label="all layers")
  ax.set_xlabel("gate value G")
  ax.set_ylabel("fraction of gate values")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2 if L > 8 else 1)
  return _save(fig, path)
