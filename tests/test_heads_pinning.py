"""The one-epoch pinning study's pieces, on a tiny model and hand-written records: per-document evaluation against
each document run alone, Holm's correction by hand, the report's statistics against scipy / numpy written here, the
dirty-tree refusal, the dropping of an interrupted run, and the null arm's study file."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as sps

from sinkjax import stats
from sinkjax.config import load_config
from sinkjax.data import build_tokenizer
from sinkjax.experiments import heads_pinning as hp
from sinkjax.experiments import runner, study
from sinkjax.layers import pop_head_importance
from sinkjax.model import Transformer
from tests.helpers import TINY

SMALL = ["model.num_layers=2", "model.d_model=32", "model.num_heads=3", "model.num_kv_heads=3", "model.head_dim=8",
         "model.max_seq_len=64", "model.attention=vanilla"]


def test_doc_eval_is_each_document_alone(tmp_path):
  """A document's NLL and importance from doc_eval (padded rows, vmapped in chunks) equal those of the model run on
  that document alone, unpadded, with the cross-entropy computed here (log-softmax of the logits)."""
  cfg = load_config(TINY, SMALL)
  tok = build_tokenizer(cfg.data)
  cfg.model.vocab_size = tok.vocab_size
  model = Transformer(cfg.model, rngs=nnx.Rngs(3))
  texts = ["A short document.", "A somewhat longer document, with a comma and more words in it than the first.",
           "Mid-sized text here, not too long."]
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  rows, cut = hp.doc_rows(tok, path, T=48)
  assert cut == sum(len(tok.encode_with_bytes(t)[0]) > 49 for t in texts)
  shared = np.arange(cfg.model.num_layers * 3, dtype=np.float64).reshape(-1, 3)
  ev = hp.doc_eval(model, rows, shared, m=1, chunk=2)
  for i, text in enumerate(texts):
    ids = np.asarray(tok.encode_with_bytes(text)[0][:49])    # the row: the first T + 1 = 49 tokens
    inputs = ids[:48]                                         # every token of the document is a query (as in the
    k = len(inputs)                                           # pipeline's rows), the targets are the next tokens
    x = model.hidden(jnp.asarray(inputs[None]), segment_ids=jnp.ones((1, k), jnp.int32),
                     positions=jnp.arange(k)[None])
    imp = np.asarray(pop_head_importance(model))
    logp = np.asarray(jax.nn.log_softmax(model.logits(x)[0].astype(jnp.float32), -1))
    n = len(ids) - 1
    nll = -logp[np.arange(n), ids[1:]].sum()
    assert ev["tokens"][i] == n
    assert ev["nll_sum"][i] == pytest.approx(nll, rel=1e-5)
    assert ev["val_loss"][i] == pytest.approx(nll / n, rel=1e-5)
    routed = imp[:, :2]                       # shared = the top-1 of each layer of `shared`: the last head
    assert ev["shared_importance"][i] == pytest.approx(imp[:, 2].mean(), rel=1e-5)
    assert ev["routed_importance"][i] == pytest.approx(routed.mean(), rel=1e-5)
    assert ev["routed_cv"][i] == pytest.approx(np.mean(routed.std(-1) / routed.mean(-1)), rel=1e-4, abs=1e-7)


def _fake_results(root, seeds=(0, 1, 2), docs=20, steps=40, kind="lora"):
  """Raw files as the study writes them: each seed shifts every document of its runs (a seed effect), each document
  every run (a document effect), on top of the arms' shifts; importance maps of 3 layers x 4 heads."""
  rng = np.random.default_rng(1)
  commit = {"commit": "abc", "dirty": False}
  doc_effect = 0.05 * rng.standard_normal(docs)

  def nll_file(shift, seed_shift=0.0):
    tokens = rng.integers(50, 120, docs)
    loss = 3 + shift + seed_shift + doc_effect + 0.1 * rng.standard_normal(docs)
    d = {"tokens": tokens.tolist(), "nll_sum": (tokens * loss).tolist()}
    d["val_loss"] = (np.asarray(d["nll_sum"]) / tokens).tolist()
    for k in ("imbalance", "shared_importance", "routed_importance", "routed_cv", "mean_importance"):
      d[k] = (0.5 + shift + seed_shift + doc_effect + 0.05 * rng.standard_normal(docs)).tolist()
    return {**d, "importance": (0.5 + shift + 0.1 * rng.random((3, 4))).tolist(), **commit}

  (root / "raw").mkdir(parents=True)
  (root / "shared_heads.json").write_text(json.dumps({"importance": rng.random((3, 4)).tolist(), "documents": 8,
                                                      **commit}))
  (root / "nll_step0.json").write_text(json.dumps({**nll_file(0.0), "documents": docs}))
  shifts = {"base": 0.0, "eq7": 0.03, "eq8": 0.01}
  seed_shift = {s: 0.02 * rng.standard_normal() for s in seeds}
  for arm, s in hp.run_order(seeds):
    d = root / "raw" / hp.run_name(arm, s, kind)
    d.mkdir()
    for st in hp._eval_steps(steps):                     # pylint: disable=protected-access
      (d / f"nll_step{st}.json").write_text(json.dumps(nll_file(shifts[arm] * st / steps, seed_shift[s] * st / steps)))
    (d / "record.json").write_text(json.dumps({"name": d.name, "arm": arm, "seed": s, "steps": steps,
                                               "train_seconds": 100.0 + s, **commit}))


def test_report_statistics(tmp_path):
  """summarize: eq. 8 − eq. 7 first; the t over seeds equals scipy's on the per-seed means; the document interval
  and p agree with a bootstrap and a sign-flip test written here (within Monte-Carlo error); the crossed test is
  stats.crossed of the seeds x documents table; Holm per column over the family of 10, none outside it."""
  _fake_results(tmp_path)
  s = hp.summarize(tmp_path)
  assert s["commit"] == "abc" and s["dirty"] == [False] and s["steps"] == 40
  assert s["effects"][0]["contrast"] == "eq8-eq7" and len(s["effects"]) == 3 * len(hp.METRICS)
  read = lambda arm, seed, key: np.asarray(json.loads(
      (tmp_path / "raw" / hp.run_name(arm, seed) / "nll_step40.json").read_text())[key])
  rng = np.random.default_rng(7)
  for e in s["effects"]:
    t, c = e["contrast"].split("-")
    per_seed = [read(t, k, e["metric"]).mean() - read(c, k, e["metric"]).mean() for k in (0, 1, 2)]
    assert e["mean"] == pytest.approx(np.mean(per_seed))
    assert e["p_t"] == pytest.approx(sps.ttest_1samp(per_seed, 0).pvalue)
    d = np.mean([read(t, k, e["metric"]) - read(c, k, e["metric"]) for k in (0, 1, 2)], axis=0)
    boot = np.quantile([rng.choice(d, d.size).mean() for _ in range(4000)], [0.025, 0.975])
    width = boot[1] - boot[0]
    assert abs(e["doc_low"] - boot[0]) < 0.1 * width and abs(e["doc_high"] - boot[1]) < 0.1 * width
    table = np.array([read(t, k, e["metric"]) - read(c, k, e["metric"]) for k in (0, 1, 2)])   # seeds x documents
    assert table.shape == (3, 20)
    ref = stats.crossed(table)
    assert (e["crossed_low"], e["crossed_high"], e["p_crossed"], e["crossed_df"]) == pytest.approx(
        (ref["low"], ref["high"], ref["p"], ref["df"]))
  family = [e for e in s["effects"] if e["in_family"]]
  assert len(family) == 10 and {e["contrast"] for e in family} == {"eq8-eq7", "eq7-base"}
  assert "mean_importance" not in {e["metric"] for e in family}
  for col in ("p_t", "p_doc", "p_crossed"):            # Holm over the family, none outside it
    assert [e[col + "_holm"] for e in family] == pytest.approx(stats.holm([e[col] for e in family]))
    assert all(e[col + "_holm"] is None for e in s["effects"] if not e["in_family"])
  md = hp.markdown(s)
  assert "| eq. 8 − eq. 7, held-out loss (nats/token) |" in md and "| base@40 | 3 |" in md
  assert "Holm's family: the 10 tests of eq. 8 − eq. 7 and eq. 7 − base" in md and "One seed" not in md


def test_mean_importance_and_the_third_contrast_are_linear_in_the_family():
  """Why they are outside Holm's family: per document the mean importance is (m·shared + (H − m)·routed)/H of the
  shared and routed means (on the committed LoRA study's raw files), and eq. 8 − base is (eq. 8 − eq. 7) + (eq. 7 −
  base) in every per-seed mean."""
  path = runner.REPO / "docs" / "results" / "heads_pinning"
  d = json.loads((path / "raw" / "eq7_lora_s0" / "nll_step183.json").read_text())
  H, m = 9, 2
  want = (m * np.asarray(d["shared_importance"]) + (H - m) * np.asarray(d["routed_importance"])) / H
  np.testing.assert_allclose(d["mean_importance"], want, rtol=1e-12)
  s = hp.summarize(path)
  e = {(x["contrast"], x["metric"]): x for x in s["effects"]}
  np.testing.assert_allclose(e["eq8-base", "val_loss"]["per_seed"],
                             np.add(e["eq8-eq7", "val_loss"]["per_seed"], e["eq7-base", "val_loss"]["per_seed"]))


def test_report_with_one_seed_is_document_level_only_and_draws_its_figures(tmp_path):
  """One seed per arm (full fine-tuning today): no t and no crossed test (—), the report says so; the two figures are
  written beside results.md."""
  _fake_results(tmp_path, seeds=(0,), kind="full")
  s = hp.report(tmp_path, seeds=(0,), kind="full")
  assert all(e["p_t"] is None and e["p_crossed"] is None and e["p_doc"] is not None for e in s["effects"])
  md = (tmp_path / "results.md").read_text()
  assert "One seed: document-level only" in md and "full fine-tuning (every weight)" in md
  for name in hp.FIGURES:
    assert (tmp_path / name).stat().st_size > 10_000, name


def test_report_of_three_full_seeds(tmp_path):
  """Full fine-tuning with 3 seeds per arm (`--report-only` on heads_pinning_full.yaml with axes.train.seed=[0,1,2]):
  every effect gets its t over seeds and its crossed test."""
  _fake_results(tmp_path, kind="full")
  s = hp.summarize(tmp_path, seeds=(0, 1, 2), kind="full")
  assert s["runs"][0] == "base_full_s0" and len(s["runs"]) == 9
  assert all(e["p_t"] is not None and e["p_crossed"] is not None for e in s["effects"])
  assert "One seed" not in hp.markdown(s)


def test_report_refuses_mixed_commits(tmp_path):
  _fake_results(tmp_path)
  rec = tmp_path / "raw" / "eq8_lora_s1" / "record.json"
  rec.write_text(json.dumps({**json.loads(rec.read_text()), "commit": "def"}))
  with pytest.raises(hp.StudyError, match="runs of different commits cannot be aggregated"):
    hp.summarize(tmp_path)


def test_study_refuses_a_dirty_tree(tmp_path, monkeypatch, capsys):
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.yaml").write_text("model: {}\n")
  monkeypatch.setattr(hp, "_commit", lambda: {"commit": "abc123", "dirty": True})
  assert study.main([str(hp.STUDY_FILE), f"study.run={run}", f"study.out={tmp_path / 'out'}"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "uncommitted changes" in err[0] and "study.allow_dirty=true" in err[0]
  assert not (tmp_path / "out").exists()


def test_interrupted_run_is_emptied_but_its_lock_kept(tmp_path):
  d = tmp_path / "eq7_lora_s0"
  (d / "checkpoints" / "10").mkdir(parents=True)
  (d / "metrics.jsonl").write_text("{}\n")
  (d / ".eq7_lora_s0.lock").write_text("")
  assert hp._empty(d) is True                               # pylint: disable=protected-access
  assert sorted(p.name for p in d.iterdir()) == [".eq7_lora_s0.lock"]
  assert hp._empty(d) is False                              # pylint: disable=protected-access


def test_plan_runs_the_contrast_first_and_seeds_whole():
  assert hp.run_order((0, 1))[:3] == [("eq7", 0), ("eq8", 0), ("base", 0)]
  assert [s for _, s in hp.run_order((0, 1))] == [0, 0, 0, 1, 1, 1]


def test_study_file_gives_each_arm_the_papers_lora_and_its_loss(tmp_path):
  """configs/studies/heads_pinning.yaml plus a run's overrides: LoRA rank 16 / alpha 32 ([Sink-MoE]'s), eq. 8's
  λ 1e-2 and m = 2 with the shared set from OUT/shared_heads.json, the seed, one epoch's steps and checkpoints at the
  evaluated steps only (30, 100 kept besides the end's)."""
  from sinkjax.experiments import runner
  plan = runner.load_plan(hp.STUDY_FILE, [f"study.out={tmp_path}", "study.run=runs/smollm2"])
  corpus = {n: {"path": str(tmp_path / f"{n}.jsonl")} for n in ("train", "heldout")}
  cfg = plan.config({}, "X", hp.finetune_overrides("runs/smollm2", "eq8", 1, corpus, tmp_path, 183))
  assert (cfg.lora.rank, cfg.lora.alpha, cfg.loss.aux_weight, cfg.loss.num_shared_heads) == (16, 32.0, 1e-2, 2)
  assert cfg.loss.shared_heads_from == str(tmp_path / "shared_heads.json") and cfg.train.seed == 1
  assert (cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.keep, cfg.checkpoint.keep_steps) == (183, 183, 1,
                                                                                                    [30, 100])
  assert cfg.run.dir == str(tmp_path / "runs" / "eq8_lora_s1") and cfg.data.source == corpus["train"]["path"]
  assert plan.axes == {"train.seed": [0, 1, 2]} and hp.tuning_kind(plan) == "lora"


def test_full_study_file_is_the_lora_one_on_every_weight(tmp_path):
  """configs/studies/heads_pinning_full.yaml: the same arms on every weight (lora.rank 0, lr 3e-5), run names
  {arm}_full_s{seed}, one seed."""
  from sinkjax.experiments import runner
  plan = runner.load_plan(runner.REPO / "configs" / "studies" / "heads_pinning_full.yaml",
                          [f"study.out={tmp_path}", "study.run=runs/smollm2"])
  corpus = {n: {"path": str(tmp_path / f"{n}.jsonl")} for n in ("train", "heldout")}
  kind = hp.tuning_kind(plan)
  cfg = plan.config({}, "X", hp.finetune_overrides("runs/smollm2", "eq7", 0, corpus, tmp_path, 183, kind))
  assert (kind, cfg.lora.rank, cfg.train.adamw_lr, cfg.loss.aux_weight, cfg.loss.num_shared_heads) == (
      "full", 0, 3e-5, 1e-2, 0)
  assert cfg.run.dir == str(tmp_path / "runs" / "eq7_full_s0") and plan.axes == {"train.seed": [0]}


def test_null_arm_is_a_study_file(tmp_path, monkeypatch, capsys):
  """heads_pinning_null.yaml (driver pinning_null) runs `null_check` and writes study.results/null.json, as the
  former `--only null` did (docs/results/null_arm/null.json)."""
  grids = []
  monkeypatch.setattr(hp, "null_check", lambda plan: grids.append(plan.runs()) or {"runs": [], "what": "stand-in"})
  path = runner.REPO / "configs" / "studies" / "heads_pinning_null.yaml"
  args = [str(path), f"study.out={tmp_path}"]
  assert study.main([*args, "--dry-run"]) == 0 and "to do" in capsys.readouterr().out
  assert study.main(args) == 0
  assert json.loads((tmp_path / "results" / "null.json").read_text()) == {"runs": [], "what": "stand-in"}
  assert len(grids[0]) == 16 and grids[0][:2] == [{"train.optimizer": "adamw", "model.attention": "vanilla",
                                                   "loss.aux_weight": 0.0}] * 2
  assert study.main([*args, "--dry-run"]) == 0 and "done" in capsys.readouterr().out


def test_null_check_compares_each_weight_with_the_first_zero():
  """The null arm on one optimizer and attention for two steps: the file's four weights in order, labelled as the
  committed null.json labels them; every λ runs the program of the first λ 0 (constants apart: a step that built
  the aux term only for λ > 0 fails here); λ 0 again is bit-identical to the first λ 0, and every run is compared
  over the same elements."""
  path = runner.REPO / "configs" / "studies" / "heads_pinning_null.yaml"
  plan = runner.load_plan(path, ["axes.train.optimizer=[adamw]", "axes.model.attention=[vanilla]", "train.steps=2"])
  rec = hp.null_check(plan)
  assert rec["steps"] == 2 and [r["label"] for r in rec["runs"]] == [
      "lambda 0", "lambda 0, again", "lambda 1e-30", "lambda 1e-8"]
  committed = json.loads((runner.REPO / "docs" / "results" / "null_arm" / "null.json").read_text())
  assert [r["label"] for r in committed["runs"][:4]] == [r["label"] for r in rec["runs"]]
  assert all(r["same_program"] for r in rec["runs"])
  for r in rec["runs"][:2]:
    assert r["after_step_1"]["bit_identical"] and r["after_step_2"]["bit_identical"] and not r["differ_after_step_1"]
  assert len({r["after_step_2"]["elements"] for r in rec["runs"]}) == 1


def test_same_program_masks_constants_only():
  """Lowered text: a changed constant is the same program, a dropped or changed operation is not."""
  a = "%0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>\n%1 = stablehlo.multiply %0, %arg0 : tensor<f32>"
  assert hp.same_program(a, a.replace("0.000000e+00", "9.99999993E-9"))
  assert not hp.same_program(a, a.replace("multiply", "add"))
  assert not hp.same_program(a, a.splitlines()[0])


def _assert_same_tree(a, b, where="results.json"):
  """Equal JSON trees, floats to 1e-9 relative."""
  if isinstance(a, dict):
    assert isinstance(b, dict) and sorted(a) == sorted(b), where
    for k in a:
      _assert_same_tree(a[k], b[k], f"{where}.{k}")
  elif isinstance(a, list):
    assert isinstance(b, list) and len(a) == len(b), where
    for i, (x, y) in enumerate(zip(a, b)):
      _assert_same_tree(x, y, f"{where}[{i}]")
  elif isinstance(a, float) or isinstance(b, float):
    assert b == pytest.approx(a, rel=1e-9, abs=1e-12, nan_ok=True), where
  else:
    assert a == b, where


@pytest.mark.parametrize("results,kind", [("heads_pinning", "lora"), ("heads_pinning_full", "full")])
def test_committed_reports_are_what_the_report_makes_of_their_raw_files(results, kind):
  """docs/results/heads_pinning*/results.md and .json are `--report-only`'s output on the committed raw files (the
  numbers in them are checked against independent computations in test_heads_real_docs)."""
  path = runner.REPO / "docs" / "results" / results
  summary = hp.summarize(path, kind=kind)
  assert hp.markdown(summary) == (path / "results.md").read_text()
  # the JSON's floats to 1e-9 (not to the bit: numpy / scipy of the two CI legs round the statistics' last digits
  # differently; the markdown above, every printed figure, is equal to the letter)
  _assert_same_tree(json.loads(json.dumps(summary)), json.loads((path / "results.json").read_text()))
  assert all((path / name).is_file() for name in hp.FIGURES)
