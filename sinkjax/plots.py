"""Every figure sinkjax draws: a run's (training curves, head imbalance, layer x head importance), shared by train
and eval; a checkpoint's sink diagnostics (eval); and the studies' (sinkjax.experiments compute them, these draw)."""
from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
import numpy as np  # noqa: E402

from sinkjax import choices  # noqa: E402
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


def plot_importance_heatmap(imp_lh, path, title: str = "head importance", layers=None) -> pathlib.Path:
  """A layer x head heatmap of Imp[l, h] (eq. 5) written to `path`. The colour scale spans the data's own range
  (importances often sit within 0.87-0.99, which a 0-1 scale would hide) and small grids print every value.
  `layers`: the model's layer index of each row (`ModelConfig.head_layers`, where some layers have no heads, e.g.
  linear attention); default 0..L-1."""
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
  if layers is not None and list(layers) != list(range(L)):
    ax.set_yticklabels([str(i) for i in layers])
  _labels(ax, title, "layer" if layers is None or list(layers) == list(range(L)) else "layer (with heads)",
          xlabel="head")
  ax.grid(False)
  fig.colorbar(im, ax=ax, label=f"Imp = mean gate (range {lo:.3f}-{hi:.3f})")
  return _save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation figures (sinkjax.eval): attention sink diagnostics of one checkpoint
# ---------------------------------------------------------------------------------------------------------------

def _save(fig, path, dpi: int = 110, tight_layout: bool = True):
  """Writes `fig` as PNG to a local path or an object-store URL (`sinkjax.paths`) and returns the path. A figure laid
  out by its own colorbar axes (tight_layout=False) is cropped to what it draws instead."""
  path = paths_lib.as_path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  if tight_layout:
    fig.tight_layout()
  with path.open("wb") as f:
    fig.savefig(f, dpi=dpi, format="png", bbox_inches=None if tight_layout else "tight")
  plt.close(fig)
  return path


def _layer_index(layers, L: int) -> np.ndarray:
  """The model's layer index of each of L rows: `layers` (`ModelConfig.head_layers`, where some layers have no heads,
  e.g. linear attention) or 0..L-1."""
  idx = np.arange(L) if layers is None else np.asarray(list(layers))
  if idx.shape != (L,):
    raise ValueError(f"layers: {len(idx)} layer indices for {L} rows")
  return idx


def plot_first_token_attention(per_head_lh, path, *, sink_weight=None, title="first-token attention",
                               layers=None) -> pathlib.Path:
  """Mean attention on each document's first token per layer (line) with every head (dots), as [GatedAttn] Fig. 2;
  `sink_weight` [L] (sink attention) adds the weight on the sink logit; `layers`: the model's layer index of each row
  (default 0..L-1)."""
  a = np.asarray(per_head_lh, np.float32)
  L, H = a.shape
  layers = _layer_index(layers, L)
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


def plot_value_norms(norm_by_position, path, title="value norm by position", layers=None) -> pathlib.Path:
  """||v_t||_2 (mean over heads and documents) against the in-document position t, one line per layer, as paper
  [Sink-MoE] Fig. 2 (position 0 is the document's first token); `layers` as in `plot_first_token_attention`."""
  n = np.asarray(norm_by_position, np.float32)
  L, P = n.shape
  idx = _layer_index(layers, L)
  fig, ax = plt.subplots(figsize=(7, 4))
  for l, color in enumerate(layer_colors(L)):
    ax.plot(np.arange(P), n[l], marker=".", ms=3, color=color, label=f"layer {idx[l]}")
  ax.set_xlabel("position in document (0 = first token)")
  ax.set_ylabel("||v||_2")
  ax.set_ylim(bottom=0)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2 if L > 8 else 1)
  return _save(fig, path)


def plot_gate_histogram(edges, density_lb, path, title="gate distribution", layers=None) -> pathlib.Path:
  """Distribution of the gate values G on [0, 1] per layer (and over all layers), as [GatedAttn] Fig. 3; `layers` as
  in `plot_first_token_attention`."""
  edges = np.asarray(edges, np.float32)
  d = np.asarray(density_lb, np.float32)
  L = d.shape[0]
  idx = _layer_index(layers, L)
  fig, ax = plt.subplots(figsize=(7, 4))
  for l, color in enumerate(layer_colors(L)):
    ax.stairs(d[l], edges, color=color, alpha=0.6, label=f"layer {idx[l]}")
  ax.stairs(d.mean(0), edges, color="black", linewidth=2, label="all layers")
  ax.set_xlabel("gate value G")
  ax.set_ylabel("fraction of gate values")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2 if L > 8 else 1)
  return _save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# Study figures: the paper study (sinkjax.experiments.paper) and its report (paper_report)
# ---------------------------------------------------------------------------------------------------------------

LOSS_STYLE = {"base": dict(color="tab:blue", label="base"), "aux": dict(color="tab:orange", label="base + aux")}


def plot_table1(t1: dict, path) -> pathlib.Path:
  """Left: val BPB of every seed, base and aux of the same seed joined (paired). Right: aux - base per seed with the
  mean and +- one std over seeds."""
  variants = list(t1)
  fig, (ax, ax_d) = plt.subplots(1, 2, figsize=(11, 4.2))
  for i, v in enumerate(variants):
    row = t1[v]
    for j, loss in enumerate(LOSS_STYLE):
      if loss in row:
        vals = row[loss]["val_bpb"]["values"]
        ax.scatter([3 * i + j] * len(vals), vals, s=18, alpha=0.6, **LOSS_STYLE[loss])
        ax.plot([3 * i + j - 0.25, 3 * i + j + 0.25], [np.mean(vals)] * 2, color="black", lw=2)
    if "aux_minus_base" in row:
      d = row["aux_minus_base"]["val_bpb"]
      for s in row["aux_minus_base"]["seeds"]:
        ax.plot([3 * i, 3 * i + 1], [row["base"]["val_bpb"]["values"][row["base"]["seeds"].index(s)],
                                     row["aux"]["val_bpb"]["values"][row["aux"]["seeds"].index(s)]],
                color="gray", lw=0.7, alpha=0.6)
      ax_d.scatter([i] * d["n"], d["values"], color="tab:purple", s=18, alpha=0.7)
      ax_d.errorbar([i + 0.15], [d["mean"]], yerr=[d["std"] or 0.0], fmt="s", color="black", capsize=4)
  handles, labels = ax.get_legend_handles_labels()
  keep = dict(zip(labels, handles))
  ax.legend(keep.values(), keep.keys(), fontsize=8)
  ax.set_xticks([3 * i + 0.5 for i in range(len(variants))], variants)
  ax.set_ylabel("val BPB (bits per byte)")
  ax.set_title("validation BPB per seed (black: mean; gray: same seed)")
  ax.grid(alpha=0.3)
  ax_d.axhline(0.0, color="gray", lw=1)
  ax_d.set_xticks(range(len(variants)), variants)
  ax_d.set_xlim(-0.5, len(variants) - 0.5)
  ax_d.set_ylabel("BPB(base + aux) - BPB(base)")
  ax_d.set_title("paired difference per seed (square: mean +- std)")
  ax_d.grid(alpha=0.3)
  return _save(fig, path)


def aligned_curves(curves):
  """Curves [[step, value], ...] cut to the steps they all have -> (steps [S], values [n, S])."""
  common = sorted(set.intersection(*(set(int(s) for s, _ in c) for c in curves)))
  vals = np.array([[dict((int(s), y) for s, y in c)[s] for s in common] for c in curves])
  return np.asarray(common), vals


def plot_imbalance_curves(curves: dict, path) -> pathlib.Path:
  """Fig. 5 analogue: head imbalance (eq. 6) over training per variant, base vs aux; line = mean over seeds,
  band = min..max over seeds, thin lines = single seeds. curves[(variant, loss)] = list of per-seed curves."""
  variants = list(dict.fromkeys(v for v, _ in curves))
  fig, axes = plt.subplots(1, len(variants), figsize=(max(4.6 * len(variants), 8.0), 3.8), squeeze=False)
  for ax, v in zip(axes[0], variants):
    for loss in LOSS_STYLE:
      cs = [c for c in curves.get((v, loss), []) if c]
      if not cs:
        continue
      steps, vals = aligned_curves(cs)
      st = LOSS_STYLE[loss]
      for y in vals:
        ax.plot(steps, y, color=st["color"], lw=0.6, alpha=0.35)
      seeds = f"mean of {len(vals)} seeds" if len(vals) > 1 else "1 seed"
      ax.plot(steps, vals.mean(0), color=st["color"], lw=2, label=f"{st['label']} ({seeds})")
      ax.fill_between(steps, vals.min(0), vals.max(0), color=st["color"], alpha=0.2)
    ax.set_title(f"{v} attention")
    ax.set_xlabel("step")
    ax.set_ylabel("head imbalance: mean_l CV(Imp[l,:])")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle("head imbalance during training ([Sink-MoE] Fig. 5 analogue; band: min-max over seeds)", fontsize=10)
  return _save(fig, path)


def _per_layer(records, key, reduce_heads=False):
  a = np.array([r[key] for r in records], np.float64)
  return a.mean(-1) if reduce_heads else a                  # [n, L]


def plot_first_token(records: list[dict], path) -> pathlib.Path:
  """Per variant and layer: first-token attention (F-Attn, [GatedAttn] Table 4; solid), the sink ratio alpha averaged
  over heads ([Sink-MoE] eq. 9; dashed) and, for sink attention, the weight on the sink logit (dotted); mean +- std
  over seeds."""
  variants = list(dict.fromkeys(r["variant"] for r in records))
  fig, axes = plt.subplots(1, len(variants), figsize=(max(4.6 * len(variants), 8.0), 3.8), squeeze=False)
  for ax, v in zip(axes[0], variants):
    for k, loss in enumerate(LOSS_STYLE):
      rs = [r for r in records if r["variant"] == v and r["loss"] == loss]
      if not rs:
        continue
      series = [("first_token_attention", "-", "F-Attn", False), ("sink_ratio_alpha", "--", "alpha", True)]
      if rs[0]["sink_logit_attention"] is not None:
        series.append(("sink_logit_attention", ":", "sink logit", False))
      for key, ls, what, red in series:
        a = _per_layer(rs, key, red)
        x = np.arange(a.shape[1]) + (k - 0.5) * 0.08
        ax.errorbar(x, a.mean(0), yerr=a.std(0, ddof=1) if len(a) > 1 else None, ls=ls, marker="o", ms=3,
                    capsize=2, color=LOSS_STYLE[loss]["color"], label=f"{what}, {LOSS_STYLE[loss]['label']}")
    ax.set_title(f"{v} attention")
    ax.set_xlabel("layer")
    ax.set_ylabel("attention weight")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(range(len(records[0]["first_token_attention"])))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle("attention on the row's first token per layer (mean +- std over seeds)", fontsize=10)
  return _save(fig, path)


def plot_value_zeroing(rows: list[dict], path, tau: float) -> pathlib.Path:
  """BPB increase over no zeroing when the first token's value is zeroed in all heads / in heads with alpha > tau,
  teacher-forced (left) and after prefill (right, the paper's definition); mean +- std over seeds, means printed."""
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
  names = [f"{r['variant']}\n{r['loss']}\n{r['teacher_forced.num_heads_selected']['mean']:.1f} heads > tau"
           for r in rows]
  x = np.arange(len(rows))
  for ax, defn in zip(axes, ("teacher_forced", "after_prefill")):
    for j, (what, color) in enumerate((("all", "tab:red"), ("selected", "tab:green"))):
      d = [np.subtract(r[f"{defn}.bpb_{what}"]["values"], r[f"{defn}.bpb_none"]["values"]) for r in rows]
      means = [e.mean() for e in d]
      ax.bar(x + (j - 0.5) * 0.38, means, 0.38, color=color, capsize=3,
             yerr=[e.std(ddof=1) if len(e) > 1 else 0.0 for e in d],
             label="all heads" if what == "all" else f"heads with alpha > {tau}")
      for xi, m in zip(x + (j - 0.5) * 0.38, means):
        ax.text(xi, m, f"{m:+.2g}", ha="center", va="bottom" if m >= 0 else "top", fontsize=7)
    ax.axhline(0, color="gray", lw=1)
    ax.set_xticks(x, names, fontsize=7)
    ax.set_ylabel("BPB(zeroed) - BPB(none)")
    ax.set_title("teacher-forced (value zeroed in the forward pass)" if defn == "teacher_forced" else
                 "after prefill (zeroed in the KV cache; the paper's App. A)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle("value zeroing of the first token: BPB change (mean +- std over seeds)", fontsize=10)
  return _save(fig, path)


def plot_importance_grid(records: list[dict], path) -> pathlib.Path:
  """Layer x head importance (eq. 5) of the final checkpoints, mean over seeds: one row per loss, one column per
  variant; every cell printed; each panel on its own colour scale (printed in its title)."""
  variants = list(dict.fromkeys(r["variant"] for r in records))
  fig, axes = plt.subplots(len(LOSS_STYLE), len(variants),
                           figsize=(max(3.8 * len(variants), 8.0), 3.4 * len(LOSS_STYLE)), squeeze=False)
  for i, loss in enumerate(LOSS_STYLE):
    for ax, v in zip(axes[i], variants):
      rs = [r for r in records if r["variant"] == v and r["loss"] == loss]
      ax.axis("off") if not rs else None
      if rs:
        imp = np.mean([r["importance"] for r in rs], axis=0)
        _importance_panel(ax, imp, f"{v}, {LOSS_STYLE[loss]['label']} ({len(rs)} seeds)")
  fig.suptitle("head importance Imp[l,h] = mean gate (eq. 5), final checkpoints", fontsize=10)
  return _save(fig, path)


def _importance_panel(ax, imp, title: str) -> None:
  lo, hi = float(imp.min()), float(imp.max())
  hi = max(hi, lo + 1e-3)
  ax.imshow(imp, cmap="viridis", vmin=lo, vmax=hi, aspect="auto")
  L, H = imp.shape
  for l in range(L):
    for h in range(H):
      ax.text(h, l, f"{imp[l, h]:.3f}", ha="center", va="center", fontsize=7,
              color="black" if (imp[l, h] - lo) / (hi - lo) > 0.6 else "white")
  ax.set_xticks(range(H))
  ax.set_yticks(range(L))
  ax.set_xlabel("head")
  ax.set_ylabel("layer")
  ax.set_title(f"{title}\ncolour scale {lo:.3f}-{hi:.3f}", fontsize=9)


def plot_finetune(ft: dict, path, *, titles: dict, lam: float, m: int) -> pathlib.Path:
  """[Sink-MoE] Fig. 11 analogue: importance before fine-tuning and after each mode (columns), one row per variant; the
  shared heads (top-m per layer before) are boxed in red, one colour scale per row. `titles`: {mode: title} of the
  fine-tuning modes in column order; lam and m: the aux weight and shared heads they used (for the title)."""
  cols = ["before"] + list(titles)
  fig, axes = plt.subplots(len(ft), len(cols), figsize=(3.3 * len(cols), 3.2 * len(ft)), squeeze=False)
  for row, (v, res) in zip(axes, ft.items()):
    imps = [np.asarray(res["before"]["importance"])] + [np.asarray(res["modes"][mode]["importance"]) for mode in titles]
    lo, hi = min(x.min() for x in imps), max(x.max() for x in imps)
    for ax, name, imp in zip(row, cols, imps):
      ax.imshow(imp, cmap="viridis", vmin=lo, vmax=max(hi, lo + 1e-3), aspect="auto")
      for l, top in enumerate(res["modes"]["eq7"]["roles"]["shared_heads"]):
        for h in top:
          ax.add_patch(Rectangle((h - 0.42, l - 0.42), 0.84, 0.84, fill=False, edgecolor="red", lw=2))
      for l in range(imp.shape[0]):
        for h in range(imp.shape[1]):
          ax.text(h, l, f"{imp[l, h]:.3f}", ha="center", va="center", fontsize=6,
                  color="black" if (imp[l, h] - lo) / max(hi - lo, 1e-3) > 0.6 else "white")
      cv = res["before"]["head_imbalance"] if name == "before" else res["modes"][name]["head_imbalance"]
      ax.set_title(f"{v}: {'before fine-tuning' if name == 'before' else titles[name]}\n"
                   f"imbalance {cv:.3f}", fontsize=8)
      ax.set_xticks(range(imp.shape[1]))
      ax.set_yticks(range(imp.shape[0]))
      ax.set_xlabel("head", fontsize=8)
      ax.set_ylabel("layer", fontsize=8)
  fig.suptitle(f"head importance before / after fine-tuning (lambda {lam:g}, m = {m}; red box: "
               f"shared heads = top-{m} per layer before; one colour scale per row)", fontsize=9)
  return _save(fig, path)


def plot_dose(dose: dict, ds: dict, out_dir) -> list[pathlib.Path]:
  """dose_imbalance.png (imbalance during training per lambda, final val BPB per seed, BPB(lambda) - BPB(0) per seed
  with its 95 % t-interval) and dose_importance.png (held-out importance by head rank), from dose.json's runs and
  `paper_report.dose_stats`."""
  from sinkjax import stats  # pylint: disable=import-outside-toplevel
  runs = dose["runs"]
  lambdas = ds["lambdas"]
  colors = plt.cm.viridis(np.linspace(0, 0.9, len(lambdas)))
  fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.6))
  for lam, col in zip(lambdas, colors):
    cs = [r["imbalance_curve"] for r in runs if float(r["lambda"]) == lam and r.get("imbalance_curve")]
    if not cs:
      continue
    common = sorted(set.intersection(*(set(int(s) for s, _ in c) for c in cs)))
    vals = np.array([[dict((int(s), y) for s, y in c)[s] for s in common] for c in cs])
    ax.plot(common, vals.mean(0), color=col, lw=2, label=f"λ = {lam:g} ({len(cs)} seeds)")
    ax.fill_between(common, vals.min(0), vals.max(0), color=col, alpha=0.2)
    bpb = ds["per_lambda"][f"{lam:g}"]["val_bpb"]
    x = lambdas.index(lam)
    ax2.scatter([x] * len(bpb), bpb, color=col, s=25)
    ax2.errorbar([x + 0.12], [np.mean(bpb)], yerr=[np.std(bpb, ddof=1) if len(bpb) > 1 else 0], fmt="s",
                 color="black", capsize=4)
  ax.set_xlabel("step")
  ax.set_ylabel("head imbalance (eq. 6), training batches")
  ax.set_title(f"{ds['variant']} attention: imbalance during training\nline: mean over seeds, band: min–max")
  ax.set_ylim(bottom=0)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  base = dict(zip(ds["per_lambda"]["0"]["seeds"], ds["per_lambda"]["0"]["val_bpb"]))
  for x, (lam, col) in enumerate(zip(lambdas, colors)):
    r = ds["per_lambda"][f"{lam:g}"]
    d = [b - base[s] for s, b in zip(r["seeds"], r["val_bpb"]) if s in base]
    if lam == 0 or not d:
      continue
    ax3.scatter([x] * len(d), d, color=col, s=25)
    t = stats.t_interval(d) if len(d) > 1 else None
    ax3.plot([x - 0.2, x + 0.2], [np.mean(d)] * 2, color="black", lw=2)
    if t is not None:
      ax3.plot([x + 0.25] * 2, [t["low"], t["high"]], color="black", lw=1)
  ax3.axhline(0, color="gray", lw=1)
  ax3.set_xticks(range(len(lambdas)), [f"{lam:g}" for lam in lambdas])
  ax3.set_xlabel("λ (aux weight)")
  ax3.set_ylabel("BPB(λ) − BPB(λ = 0), same seed")
  ax3.set_title("paired difference per seed (bar: mean)\nline: its 95 % t-interval (t with n − 1 df)")
  ax3.grid(alpha=0.3)
  ax2.set_xticks(range(len(lambdas)), [f"{lam:g}" for lam in lambdas])
  ax2.set_xlabel("λ (aux weight)")
  ax2.set_ylabel("val BPB (8 held-out batches)")
  ax2.set_title("final val BPB per seed (square: mean ± std)")
  ax2.grid(alpha=0.3)
  p1 = _save(fig, paths_lib.as_path(out_dir) / "dose_imbalance.png")
  fig, ax = plt.subplots(figsize=(6.5, 4.4))
  for lam, col in zip(lambdas, colors):
    ranks = np.array(ds["per_lambda"][f"{lam:g}"]["importance_by_rank"])          # [seeds, H]
    h = np.arange(1, ranks.shape[1] + 1)
    ax.plot(h, ranks.mean(0), color=col, marker="o", lw=2, label=f"λ = {lam:g}")
    ax.fill_between(h, ranks.min(0), ranks.max(0), color=col, alpha=0.15)
  ax.set_xticks(range(1, ranks.shape[1] + 1))
  ax.set_xlabel("head rank within its layer (1 = strongest)")
  ax.set_ylabel("importance (mean gate, eq. 5), mean over layers")
  ax.set_title(f"{ds['variant']}: held-out head importance by rank\nline: mean over seeds, band: min–max")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  p2 = _save(fig, paths_lib.as_path(out_dir) / "dose_importance.png")
  return [p1, p2]


def _ema(ys, alpha: float = 0.1):
  out, m = [], None
  for y in ys:
    m = y if m is None else (1 - alpha) * m + alpha * y
    out.append(m)
  return out


def plot_runs(runs: list[dict], out_dir, variants=choices.PAPER_VARIANTS) -> list[pathlib.Path]:
  """fig5_imbalance.png (Fig. 5) and fig8_loss_bpb.png (Fig. 8): base vs base + aux over training, a panel per size
  (rows) and attention (columns, in `variants` order, others after); raw values faint, EMA (0.1) solid; several
  runs of a cell each drawn."""
  sizes = sorted({(r["layers"], r["size"]) for r in runs})
  atts = sorted({r["attention"] for r in runs}, key=lambda v: (list(variants).index(v) if v in variants else 99, v))
  colors = {"base": "tab:blue", "aux": "tab:red"}
  written = []
  for name, keys in (("fig5_imbalance.png", ("head_imbalance",)), ("fig8_loss_bpb.png", ("loss", "val_bpb"))):
    nrows = len(sizes) * len(keys)
    fig, axes = plt.subplots(nrows, len(atts), figsize=(4.5 * len(atts), 3.2 * nrows), squeeze=False)
    for i, (_, size) in enumerate(sizes):
      for k, key in enumerate(keys):
        for j, att in enumerate(atts):
          ax = axes[i * len(keys) + k][j]
          for r in runs:
            if r["size"] != size or r["attention"] != att or not r["curves"][key]:
              continue
            x, y = zip(*r["curves"][key])
            label = "base" if r["loss"] == "base" else "base + aux"
            if key != "val_bpb":
              ax.plot(x, y, color=colors[r["loss"]], alpha=0.25, lw=0.8)
              y = _ema(y)
            ax.plot(x, y, color=colors[r["loss"]], lw=1.6, label=label)
          ax.set_title(f"{size}, {att}", fontsize=9)
          ax.set_xlabel("step", fontsize=8)
          ax.set_ylabel({"head_imbalance": "head imbalance (eq. 6)", "loss": "training loss",
                         "val_bpb": "validation BPB"}[key], fontsize=8)
          handles, labels = ax.get_legend_handles_labels()
          if handles:
            uniq = dict(zip(labels, handles))
            ax.legend(uniq.values(), uniq.keys(), fontsize=7)
    written.append(_save(fig, paths_lib.as_path(out_dir) / name))
  return written


# ---------------------------------------------------------------------------------------------------------------
# Study figures: [SinkNecessary]'s trigger task (sinkjax.experiments.trigger, study driver trigger)
# ---------------------------------------------------------------------------------------------------------------

def _attention_panel(fig, ax, a, title, T, vmax=1.0):
  im = ax.imshow(a, aspect="equal", interpolation="nearest", vmin=0.0, vmax=vmax, cmap="Blues")
  ax.set_title(title, fontsize=9)
  ticks = list(range(0, T, 2))
  ax.set_xticks(ticks)
  ax.set_yticks(ticks)
  ax.set_xticklabels([str(t + 1) for t in ticks], fontsize=7)
  ax.set_yticklabels([str(t + 1) for t in ticks], fontsize=7)
  ax.set_xlabel("key position", fontsize=8)
  ax.set_ylabel("query position", fontsize=8)
  fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)


def plot_attention_mean_std(maps: dict, T: int, trigger: int, path) -> pathlib.Path:
  """[SinkNecessary] Fig. 3: mean and std over test sequences of the 1x1 attention maps, one row per variant."""
  names = list(maps)
  fig, axes = plt.subplots(len(names), 2, figsize=(8, 3.6 * len(names)), squeeze=False)
  for r, name in enumerate(names):
    a = maps[name]                                                          # [N,T,T]
    _attention_panel(fig, axes[r, 0], a.mean(0), f"{name}: mean attention", T)
    std = a.std(0)                      # often ~1e-3: on the mean's 0-1 scale it would look blank
    _attention_panel(fig, axes[r, 1], std, f"{name}: std (max {std.max():.2g})", T, vmax=max(float(std.max()), 1e-9))
  fig.suptitle(f"1 layer x 1 head, {maps[names[0]].shape[0]} test sequences, trigger at position {trigger + 1}",
               fontsize=10)
  return _save(fig, path, dpi=120)


def plot_attention_heads(attn, title: str, T: int, path) -> pathlib.Path:
  """[SinkNecessary] Fig. 4-5: one example's attention map for every (layer, head); attn [L,H,T,T]."""
  L, H = attn.shape[:2]
  fig, axes = plt.subplots(L, H, figsize=(3.6 * H, 3.3 * L), squeeze=False)
  for l in range(L):
    for h in range(H):
      _attention_panel(fig, axes[l, h], attn[l, h], f"layer {l + 1}, head {h + 1}", T)
  fig.suptitle(title, fontsize=10)
  return _save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# Study figures: real-model heads and streaming (sinkjax.experiments.heads_real, streaming_real)
# ---------------------------------------------------------------------------------------------------------------

def plot_head_analysis(analysis: dict, path) -> pathlib.Path:
  """[Sink-MoE] Fig. 4 on a real model (heads_real's analysis.json): importance of the pretrained model and of a
  random init, first-token attention, and the per-layer CV of both."""
  imp = np.asarray(analysis["importance"])
  rnd = np.asarray(analysis["random_init"][0]["importance"])
  fta = np.asarray(analysis["first_token_attention_per_head"])
  fig, axes = plt.subplots(1, 4, figsize=(17, 8), gridspec_kw={"width_ratios": [3, 3, 3, 2]})
  for ax, m, title in ((axes[0], imp, f"SmolLM2-135M, importance (eq. 5)\nimbalance {analysis['head_imbalance']:.3f}"),
                       (axes[1], rnd, f"same architecture, random init\nimbalance "
                                      f"{analysis['random_init'][0]['head_imbalance']:.3f}"),
                       (axes[2], fta, "SmolLM2-135M, attention on the\ndocument's first token")):
    im = ax.imshow(m, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(m.shape[1]))
    fig.colorbar(im, ax=ax, fraction=0.05)
  L = imp.shape[0]
  axes[3].barh(range(L), analysis["cv_per_layer"], color="tab:blue", label="pretrained")
  axes[3].plot(analysis["random_init"][0]["cv_per_layer"], range(L), "k.", label="random init")
  axes[3].invert_yaxis()
  axes[3].set_xlabel("CV of importance across heads")
  axes[3].set_ylabel("layer")
  axes[3].set_title("per-layer CV", fontsize=10)
  axes[3].legend(fontsize=8)
  fig.suptitle(f"[Sink-MoE] Fig. 4 on SmolLM2-135M-Instruct: {analysis['documents']} English documents "
               f"({analysis['eval_tokens']:,} tokens), rows of {analysis['seq_len']}", fontsize=11)
  return _save(fig, path)


def plot_streaming(lines, randoms, path, *, window: int, title: str) -> pathlib.Path:
  """Perplexity as the running mean of the NLL over `window` tokens against the position, log scale: one line per
  (label, per-position NLLs) of `lines`, and the min-max band of the `randoms` (per-position NLLs of the random-map
  runs)."""
  curve = lambda nll: np.exp(np.convolve(np.asarray(nll, np.float64), np.ones(window) / window, mode="valid"))
  fig, ax = plt.subplots(figsize=(9, 5))
  x0 = window + 1                   # the first running mean ends at target position window (1-based: token window + 1)
  for label, nll in lines:
    c = curve(nll)
    ax.plot(np.arange(x0, x0 + len(c)), c, lw=1.2, label=label)
  if randoms:
    rs = np.stack([curve(nll) for nll in randoms])
    xs = np.arange(x0, x0 + rs.shape[1])
    ax.fill_between(xs, rs.min(0), rs.max(0), color="gray", alpha=0.35,
                    label=f"hybrid, {len(randoms)} random maps (min-max)")
  ax.set_yscale("log")
  ax.set_xlabel("token position")
  ax.set_ylabel(f"perplexity (running mean of NLL over {window} tokens)")
  ax.set_title(title)
  ax.legend(fontsize=8)
  return _save(fig, path)


def plot_pinning(summary: dict, importance_path, curve_path, *, arms: dict, metrics: dict) -> list[pathlib.Path]:
  """[Sink-MoE] Fig. 11 on the pinning study (`heads_pinning.summarize`'s summary): `importance_path`, layer x head
  importance of the pretrained model and of each arm at the end (one 0-1 scale), then each arm minus the pretrained
  model (one symmetric scale), eq. 8's shared heads boxed; `curve_path`, each metric at the evaluated steps, one
  point per seed and a line through the arms' means. `arms`: {arm: title} in drawing order; `metrics`: {key: label}."""
  maps = summary["importance"]
  pre = np.asarray(maps["pretrained"])
  shared = np.asarray(summary["shared_heads"], bool)
  ends = [(a, np.asarray(maps[a])) for a in arms if a in maps]
  L, H = pre.shape
  how = "full fine-tuning" if summary.get("kind") == "full" else "LoRA"
  n_seeds = len(summary["seeds"])
  k = len(ends)
  fig = plt.figure(figsize=(2.2 * (1 + 2 * k) + 2.2, 10))
  grid = fig.add_gridspec(1, 2 * k + 4, width_ratios=[1] * (k + 1) + [0.08, 0.45] + [1] * k + [0.08], wspace=0.12)
  axes = [fig.add_subplot(grid[0, i]) for i in range(k + 1)]
  axes += [fig.add_subplot(grid[0, k + 3 + i], sharey=axes[0]) for i in range(k)]
  delta = max(float(np.abs(imp - pre).max()) for _, imp in ends) if ends else 1.0
  panels = [(axes[0], pre, "pretrained (step 0)", "viridis", 0.0, 1.0)]
  panels += [(ax, imp, f"{arms[a]}, step {summary['steps']}", "viridis", 0.0, 1.0) for ax, (a, imp) in
             zip(axes[1:1 + k], ends)]
  panels += [(ax, imp - pre, f"{arms[a]} − pretrained", "RdBu_r", -delta, delta) for ax, (a, imp) in
             zip(axes[1 + k:], ends)]
  images = []
  for i, (ax, m, title, cmap, lo, hi) in enumerate(panels):
    images.append(ax.imshow(m, cmap=cmap, vmin=lo, vmax=hi, aspect="auto", interpolation="nearest"))
    for l, h in zip(*np.nonzero(shared)):
      ax.add_patch(Rectangle((h - 0.5, l - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.2))
    ax.set_title(title, fontsize=11)
    ax.set_xticks(range(H))
    ax.set_xlabel("head")
    ax.set_yticks(range(0, L, 2))
    ax.tick_params(labelsize=8, labelleft=i in (0, k + 1))
  axes[0].set_ylabel("layer")
  axes[k + 1].set_ylabel("layer") if k else None
  fig.colorbar(images[0], cax=fig.add_subplot(grid[0, k + 1]), label="importance (eq. 5)")
  if k:
    fig.colorbar(images[-1], cax=fig.add_subplot(grid[0, 2 * k + 3]), label="change against the pretrained model")
  fig.suptitle(f"Head importance on SmolLM2-135M, {how}, one epoch ({summary['steps']} steps): mean over "
               f"{summary['documents']} held-out documents and {n_seeds} seed{'s' if n_seeds > 1 else ''} per arm\n"
               f"black boxes: eq. 8's shared heads (the top {summary['num_shared_heads']} per layer of the pretrained "
               f"model); runs of commit {summary['commit']}", fontsize=12)
  out = [_save(fig, importance_path, tight_layout=False)]

  steps = sorted({int(k.split("@")[1]) for k in summary["curve"]})
  cols = 3
  rows = -(-len(metrics) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
  colors = dict(zip(arms, ("tab:gray", "tab:red", "tab:blue", "tab:green")))
  for ax, (key, label) in zip(axes.flat, metrics.items()):
    for i, a in enumerate(arms):
      pts = [(st, summary["curve"][f"{a}@{st}"]) for st in steps if f"{a}@{st}" in summary["curve"]]
      if not pts:
        continue
      ax.plot([st for st, _ in pts], [c[key] for _, c in pts], "-", color=colors[a], lw=1.5, label=arms[a])
      for st, c in pts:
        vals = c["per_seed"][key]
        ax.plot(np.full(len(vals), st + (i - 1) * 2.5), vals, "o", color=colors[a], ms=3.5, alpha=0.75)
    ax.set_xticks(steps)
    _labels(ax, label, label.split(" (")[0])
  for ax in axes.flat[len(metrics):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=9)
  fig.suptitle(f"{how}: the arms on the held-out documents at steps {', '.join(map(str, steps))} (line: mean over "
               f"seeds; points: each seed, spread sideways; step 0 is the pretrained model); runs of commit "
               f"{summary['commit']}", fontsize=11)
  out.append(_save(fig, curve_path))
  return out

