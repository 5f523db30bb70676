"""sinkjax as an lm-evaluation-harness model (`sinkjax.lm_eval`), checked against lm-eval's own `hf` backend.

The reference is independent of sinkjax: a random Llama built with transformers (2 layers) and a byte-level BPE
tokenizer trained here with `tokenizers` on a few standard-library sources, saved as a Hugging Face directory, run
through lm-eval's `hf` backend (PyTorch). The same directory is imported with `python -m sinkjax.convert.hf --dtype
float32` and run through `python -m sinkjax.lm_eval`. Both see the same local tasks (JSONL data and task YAML
written here, nothing downloaded): multiple choice with one few-shot example, a loglikelihood task (one empty
context, one context ending in a space), rolling log-likelihood on texts longer than the model's 64 positions, and
greedy generation with `until` strings. Per-document log-likelihoods agree within 1e-3, perplexity metrics within
1e-4 relative, greedy generations exactly.

A nanochat-architecture run (soft-capped logits, ReLU^2, parameter-free norms, padded vocabulary; no Hugging Face
class has it) is trained here for a few steps with `python -m sinkjax.train` and evaluated end to end; batch sizes 1
and 8 give the same log-likelihoods; an unknown task or a missing run is one line and exit 1.
"""
from __future__ import annotations

import glob
import json
import math
import os
import pathlib
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install "
                                                "'sinkjax[eval]')")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")      # local JSON files only: never reach the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from sinkjax import lm_eval as sj  # noqa: E402  (after the environment above)
from tests.helpers import call_main  # noqa: E402


REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_LEN = 64                                              # the toy's max_position_embeddings: rolling windows cut


# ---------------------------------------------------------------------------------------------------------------
# Local tasks
# ---------------------------------------------------------------------------------------------------------------

def _stdlib_texts() -> list[str]:
  std = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return [(std / f).read_text() for f in ("textwrap.py", "string.py", "fnmatch.py", "this.py")]


MC_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "label": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "label": 0},
    {"question": "A function in Python is defined with", "choices": ["def", "func", "lambda x", "define"],
     "label": 0},
    {"question": "The opposite of up is", "choices": ["down", "left", "sideways"], "label": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "twenty-two"], "label": 0},
]
LL_DOCS = [
    {"context": "", "target": "import string"},
    {"context": "def wrap(text, width=70, ", "target": "**kwargs):"},
    {"context": "The quick brown fox", "target": " jumps over the lazy dog"},
]


def write_tasks(root: pathlib.Path) -> pathlib.Path:
  """Task YAML + JSONL data for the four request kinds; returns the include directory."""
  texts = _stdlib_texts()
  data = root / "data"
  data.mkdir(parents=True)
  rows = {
      "mc_train": [{"question": "The color of the sky is", "choices": ["blue", "green"], "label": 0}],
      "mc_test": MC_DOCS,
      "ll_test": LL_DOCS,
      "ppl_test": [{"text": texts[0][:900]}, {"text": texts[1][300:1400]}, {"text": "short text"},
                   {"text": texts[3][:500]}],
      "gen_test": [{"prompt": texts[0][:120], "answer": "x"}, {"prompt": texts[2][200:260], "answer": "y"},
                   {"prompt": "def main():\n    ", "answer": "z"}, {"prompt": texts[1][:40], "answer": "w"}],
  }
  for name, docs in rows.items():
    (data / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
  tasks = root / "tasks"
  tasks.mkdir()

  def files(**splits):
    return "dataset_path: json\ndataset_kwargs:\n  data_files:\n" + "".join(
        f"    {k}: {json.dumps(str(data / (v + '.jsonl')))}\n" for k, v in splits.items())

  (tasks / "toy_mc.yaml").write_text(f"""task: toy_mc
{files(train="mc_train", test="mc_test")}output_type: multiple_choice
training_split: train
fewshot_split: train
test_split: test
num_fewshot: 1
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
""")
  (tasks / "toy_ll.yaml").write_text(f"""task: toy_ll
{files(test="ll_test")}output_type: loglikelihood
test_split: test
doc_to_text: context
doc_to_target: target
target_delimiter: ""
metric_list:
  - metric: perplexity
  - metric: acc
""")
  (tasks / "toy_ppl.yaml").write_text(f"""task: toy_ppl
{files(test="ppl_test")}output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
  (tasks / "toy_gen.yaml").write_text(f"""task: toy_gen
{files(test="gen_test")}output_type: generate_until
test_split: test
doc_to_text: prompt
doc_to_target: answer
generation_kwargs:
  until: ["\\n\\n", "ing"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""")
  return tasks


TASKS = ["toy_mc", "toy_ll", "toy_ppl", "toy_gen"]


def samples_of(out: pathlib.Path) -> dict:
  """{task: {doc_id: sample}} from lm-eval's samples_<task>_<date>.jsonl files under `out`."""
  got = {}
  for path in glob.glob(str(out / "**" / "samples_*.jsonl"), recursive=True):
    task = pathlib.Path(path).name[len("samples_"):].rsplit("_", 1)[0]
    got[task] = {s["doc_id"]: s for s in map(json.loads, pathlib.Path(path).read_text().splitlines())}
  return got


def results_of(out: pathlib.Path) -> dict:
  files = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
  assert len(files) == 1, files
  return json.loads(pathlib.Path(files[0]).read_text())


# ---------------------------------------------------------------------------------------------------------------
# The reference: a random Llama with a real BPE tokenizer, run through lm-eval's hf backend
# ---------------------------------------------------------------------------------------------------------------

def make_toy_llama(out: pathlib.Path) -> pathlib.Path:
  torch = pytest.importorskip("torch", reason="torch is not installed (the oracle: pip install -e '.[test]')")
  transformers = pytest.importorskip("transformers", reason="transformers is not installed (the oracle)")
  pytest.importorskip("accelerate", reason="accelerate is not installed (lm-eval's hf backend needs it)")
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(_stdlib_texts(), trainers.BpeTrainer(
      vocab_size=384, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                     special_tokens=[("<s>", bos)])   # Llama's: BOS first
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       clean_up_tokenization_spaces=False).save_pretrained(out)
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=MAX_LEN, bos_token_id=bos, eos_token_id=eos,
                                 initializer_range=0.2, tie_word_embeddings=False)
  transformers.LlamaForCausalLM(cfg).eval().save_pretrained(out)
  return out


def hf_reference(hf_dir, tasks, include, out) -> tuple[dict, dict]:
  """lm-eval's hf backend on `tasks` (batch 1, float32, CPU), its samples written and read back as lm-eval logs them:
  (results, {task: {doc_id: sample}})."""
  from lm_eval.loggers import EvaluationTracker
  from lm_eval.tasks import TaskManager
  res = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32",
                                                        "device": "cpu"},
                                tasks=tasks, batch_size=1, log_samples=True, bootstrap_iters=0,
                                task_manager=TaskManager(include_path=str(include), include_defaults=False))
  tracker = EvaluationTracker(output_path=str(out))
  tracker.general_config_tracker.log_experiment_args("hf", {"pretrained": "hf"}, None, None, True)
  samples = res.pop("samples")
  tracker.save_results_aggregated(results=res, samples=samples)
  for task in tasks:
    tracker.save_results_samples(task_name=task, samples=samples[task])
  return res, samples_of(pathlib.Path(out))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  """(hf dir, sinkjax run dir, task dir, hf backend's samples, hf backend's results)."""
  root = tmp_path_factory.mktemp("lm_eval_toy")
  hf_dir = make_toy_llama(root / "hf")
  run_dir = root / "run"
  res = subprocess.run([sys.executable, "-m", "sinkjax.convert.hf", "--hf-dir", str(hf_dir), "--out", str(run_dir),
                        "--dtype", "float32"], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert res.returncode == 0, res.stderr
  tasks = write_tasks(root)
  ref, ref_samples = hf_reference(hf_dir, TASKS, tasks, root / "hf_out")
  return hf_dir, run_dir, tasks, ref_samples, ref["results"]


@pytest.fixture(scope="module")
def toy_sinkjax(toy, tmp_path_factory):
  """python -m sinkjax.lm_eval on the imported toy (in-process: the CLI's main), its outputs and printed table."""
  _, run_dir, tasks, _, _ = toy
  out = tmp_path_factory.mktemp("lm_eval_out")
  code = sj.main(["--checkpoint", str(run_dir), "--tasks", ",".join(TASKS), "--include-path", str(tasks),
                  "--batch-size", "4", "--output-path", str(out), "--log-samples", "--bootstrap-iters", "0"])
  assert code == 0
  return out


def test_multiple_choice_and_loglikelihood_match_the_hf_backend(toy, toy_sinkjax):
  ref = toy[3]
  got = samples_of(toy_sinkjax)
  worst = 0.0
  for task in ("toy_mc", "toy_ll"):
    assert sorted(got[task]) == sorted(ref[task]), task
    for doc_id, r in ref[task].items():
      g = got[task][doc_id]
      assert g["arguments"] == r["arguments"], (task, doc_id)                     # the same requests
      for (lp_r, greedy_r), (lp_g, greedy_g) in zip((x[0] for x in r["resps"]), (x[0] for x in g["resps"])):
        worst = max(worst, abs(float(lp_r) - float(lp_g)))
        assert abs(float(lp_r) - float(lp_g)) < 1e-3, (task, doc_id, lp_r, lp_g)
        assert bool(greedy_r) == bool(greedy_g), (task, doc_id)
  print(f"max |loglikelihood difference| vs hf: {worst:.2e}")
  res = results_of(toy_sinkjax)["results"]
  for key in ("acc,none", "acc_norm,none"):
    assert res["toy_mc"][key] == pytest.approx(toy[4]["toy_mc"][key], abs=1e-12)
  assert res["toy_ll"]["perplexity,none"] == pytest.approx(toy[4]["toy_ll"]["perplexity,none"], rel=1e-3)


def test_rolling_loglikelihood_and_perplexities_match_the_hf_backend(toy, toy_sinkjax):
  ref, ref_res = toy[3]["toy_ppl"], toy[4]["toy_ppl"]
  got = samples_of(toy_sinkjax)["toy_ppl"]
  worst = 0.0
  for doc_id, r in ref.items():
    lp_r, lp_g = float(r["resps"][0][0]), float(got[doc_id]["resps"][0][0])
    worst = max(worst, abs(lp_r - lp_g))
    assert abs(lp_r - lp_g) < 1e-3, (doc_id, lp_r, lp_g)
  res = results_of(toy_sinkjax)["results"]["toy_ppl"]
  rel = {}
  for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
    rel[key] = abs(res[key] / ref_res[key] - 1)
    assert res[key] == pytest.approx(ref_res[key], rel=1e-4), key
  print(f"rolling: max |dlogL| {worst:.2e} per document; relative metric differences {rel}")
  # some texts are longer than the model: the windows really were cut
  import tokenizers
  tok = tokenizers.Tokenizer.from_file(str(toy[0] / "tokenizer.json"))
  assert max(len(tok.encode(r["doc"]["text"]).ids) for r in ref.values()) > 2 * MAX_LEN


def test_greedy_generations_equal_the_hf_backend(toy, toy_sinkjax):
  ref = toy[3]["toy_gen"]
  got = samples_of(toy_sinkjax)["toy_gen"]
  gens = []
  for doc_id, r in ref.items():
    assert got[doc_id]["resps"] == r["resps"], (doc_id, got[doc_id]["resps"], r["resps"])
    gens.append(r["resps"][0][0])
  assert any(gens), gens                                 # not all empty


def test_standard_outputs_and_the_results_record(toy, toy_sinkjax):
  res = results_of(toy_sinkjax)
  assert set(TASKS) <= set(res["results"])
  assert res["config"]["model"] == "sinkjax"
  assert res["config"]["model_args"]["pretrained"] == str(toy[1])
  assert res["config"]["sinkjax_step"] == 0 and res["config"]["max_length"] == MAX_LEN
  assert res["n-shot"]["toy_mc"] == 1
  assert set(samples_of(toy_sinkjax)) == set(TASKS)


@pytest.mark.slow
def test_a_trained_lora_run_matches_the_hf_backend_on_its_export(toy, tmp_path):
  """The imported toy fine-tuned by python -m sinkjax.train (LoRA rank 4, 6 steps), exported with convert.hf
  --export (adapters merged): lm-eval's hf backend on the export and sinkjax.lm_eval on the run (which merges the
  adapters itself) give the same per-document log-likelihoods, perplexities and greedy generations."""
  hf_dir, run_dir, tasks = toy[0], toy[1], toy[2]
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  text = "".join(_stdlib_texts())
  for i in range(0, len(text), 600):
    (corpus / f"doc{i // 600:03d}.txt").write_text(text[i:i + 600])
  ft, exported = tmp_path / "ft", tmp_path / "ft_hf"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  res = subprocess.run([sys.executable, "-m", "sinkjax.train", "--config", str(REPO / "configs" / "tiny.yaml"),
                        f"train.init_from={run_dir}", "model.num_layers=2", "model.d_model=64", "model.num_heads=4",
                        "model.num_kv_heads=2", "model.head_dim=16", "model.dtype=float32",
                        f"data.tokenizer={hf_dir / 'tokenizer.json'}", f"data.source={corpus}",
                        f"data.seq_len={MAX_LEN}", "data.val_fraction=0.25", "lora.rank=4", "train.optimizer=adamw",
                        "train.adamw_lr=0.01", "train.batch_size=8", "train.steps=6", "train.eval_every=6",
                        "train.eval_batches=1", "checkpoint.every=6", f"run.dir={ft}"],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
  assert res.returncode == 0, res.stderr[-2000:]
  res = subprocess.run([sys.executable, "-m", "sinkjax.convert.hf", "--export", str(ft), "--out", str(exported)],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
  assert res.returncode == 0, res.stderr[-2000:]
  ref_res, ref = hf_reference(exported, TASKS, tasks, tmp_path / "hf_out")
  out = tmp_path / "out"
  assert sj.main(["--checkpoint", str(ft), "--tasks", ",".join(TASKS), "--include-path", str(tasks),
                  "--output-path", str(out), "--log-samples", "--bootstrap-iters", "0"]) == 0
  got = samples_of(out)
  for task in ("toy_mc", "toy_ll", "toy_ppl"):
    for doc_id, r in ref[task].items():
      for x, y in zip(r["resps"], got[task][doc_id]["resps"]):
        assert abs(float(x[0][0] if task != "toy_ppl" else x[0]) - float(y[0][0] if task != "toy_ppl" else y[0])) \
            < 1e-3, (task, doc_id, x, y)
  for doc_id, r in ref["toy_gen"].items():
    assert got["toy_gen"][doc_id]["resps"] == r["resps"], doc_id
  res = results_of(out)["results"]["toy_ppl"]
  for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
    assert res[key] == pytest.approx(ref_res["results"]["toy_ppl"][key], rel=1e-4), key


# ---------------------------------------------------------------------------------------------------------------
# A nanochat-architecture run (no Hugging Face class): end to end, batch sizes, errors
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nanochat_run(tmp_path_factory):
  """configs/nanochat.yaml at a tiny size (2 layers x 4 heads x 64, vanilla, soft-cap, padded vocabulary, stream
  packing), trained 8 steps on a few standard-library texts with the bytes tokenizer."""
  root = tmp_path_factory.mktemp("nanochat_run")
  corpus = root / "corpus"
  corpus.mkdir()
  text = "".join(_stdlib_texts())
  for i in range(0, len(text), 600):                       # ~60 documents: a validation split of several
    (corpus / f"doc{i // 600:03d}.txt").write_text(text[i:i + 600])
  run_dir = root / "run"
  cmd = [sys.executable, "-m", "sinkjax.train", "--config", str(REPO / "configs" / "nanochat.yaml"),
         "model.depth=0", "model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=4",
         "model.head_dim=16", f"model.max_seq_len={MAX_LEN}", "model.dtype=float32", "data.tokenizer=bytes",
         f"data.source={corpus}", f"data.seq_len={MAX_LEN}", "data.val_fraction=0.25", "train.batch_size=8",
         "train.steps=8", "train.eval_every=8", "train.eval_batches=1", "checkpoint.every=8",
         "train.muon_momentum_warmup=0", f"run.dir={run_dir}"]
  res = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert res.returncode == 0, res.stderr[-2000:]
  return run_dir


@pytest.mark.slow   # a CLI training run then lm-eval over it (~30 s); lm-eval's agreement with the hf backend is checked by default
def test_a_nanochat_architecture_run_evaluates_end_to_end(nanochat_run, toy, tmp_path, capsys):
  from sinkjax.run import read_run_config
  m = read_run_config(nanochat_run).model
  assert (m.logit_softcap, m.mlp, m.norm_scale, m.vocab_pad_to, m.init) == (15.0, "relu2", False, 64, "nanochat")
  out = tmp_path / "out"
  code = sj.main(["--checkpoint", str(nanochat_run), "--tasks", ",".join(TASKS), "--include-path", str(toy[2]),
                  "--output-path", str(out), "--log-samples", "--limit", "3", "--bootstrap-iters", "0"])
  printed = capsys.readouterr().out
  assert code == 0
  res = results_of(out)["results"]
  for task, key in (("toy_mc", "acc,none"), ("toy_ll", "perplexity,none"), ("toy_ppl", "bits_per_byte,none"),
                    ("toy_gen", "exact_match,none")):
    assert math.isfinite(res[task][key]), (task, res[task])
  assert 0 < res["toy_ppl"]["bits_per_byte,none"] < 20
  assert "toy_ppl" in printed and "bits_per_byte" in printed            # lm-eval's table
  assert set(samples_of(out)) == set(TASKS)


@pytest.fixture(scope="module")
def nanochat_lm(nanochat_run):
  return sj.SinkjaxLM(pretrained=str(nanochat_run), batch_size=8, seed=3)


def test_batch_sizes_one_and_eight_give_the_same_loglikelihoods(nanochat_lm, optimized_compile):
  """And both equal a direct forward of each unpadded row (no HF class for this architecture: the reference is the
  model itself, one sequence at a time, log-softmax in NumPy)."""
  from lm_eval.api.instance import Instance
  texts = _stdlib_texts()
  pairs = [(texts[0][i * 37:i * 37 + 30], texts[0][i * 37 + 30:i * 37 + 45]) for i in range(11)] + [("", "def f():")]
  ll = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
  rolling = [Instance("loglikelihood_rolling", {}, (t[:300],), i) for i, t in enumerate(texts)]
  outs, lm = [], nanochat_lm
  for bs in (1, 8):
    lm.batch_size_per_device = bs
    outs.append((lm.loglikelihood(ll, disable_tqdm=True), lm.loglikelihood_rolling(rolling, disable_tqdm=True)))
  (ll1, r1), (ll8, r8) = outs
  d_ll = np.max(np.abs(np.array([x[0] for x in ll1]) - [x[0] for x in ll8]))
  d_r = np.max(np.abs(np.array(r1) - r8) / np.abs(r8))
  print(f"batch 1 vs 8: max |dlogL| {d_ll:.2e}, rolling max relative {d_r:.2e}")
  np.testing.assert_allclose([x[0] for x in ll1], [x[0] for x in ll8], rtol=0, atol=1e-4)
  assert [x[1] for x in ll1] == [x[1] for x in ll8]
  np.testing.assert_allclose(r1, r8, rtol=1e-6)
  # the direct computation: BOS + context + continuation (bytes), no segment ids; lm-eval's rule moves a context's
  # trailing whitespace to the continuation. Rows are filled up to a common length with ordinary tokens after
  # their end, which causal attention keeps from influencing the positions scored (one plain forward for all).
  bos = lm.tok.bos_id
  rows = []
  for ctx, cont in pairs:
    n = len(ctx) - len(ctx.rstrip())
    ctx, cont = (ctx[:-n], ctx[-n:] + cont) if n else (ctx, cont)
    rows.append(([bos] + list(ctx.encode()) + list(cont.encode()), len(cont.encode())))
  T = max(len(ids) for ids, _ in rows)
  x = np.full((len(rows), T), ord("z"), np.int32)
  for r, (ids, _) in enumerate(rows):
    x[r, :len(ids)] = ids
  logits = np.asarray(lm.model(x)).astype(np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  for r, ((ids, c), (got, _)) in enumerate(zip(rows, ll8)):
    want = sum(logp[r, t - 1, ids[t]] for t in range(len(ids) - c, len(ids)))
    assert abs(got - want) < 1e-3, (pairs[r], got, want)


@pytest.mark.slow   # ~25 s; greedy generation against the hf backend is checked by default
def test_sampling_follows_the_generation_kwargs(nanochat_lm):
  """top_k=1 sampling is greedy decoding; temperature sampling draws other continuations; max_gen_toks caps."""
  from lm_eval.api.instance import Instance
  lm = nanochat_lm
  prompt = _stdlib_texts()[1][:50]

  def gen(**kw):
    return lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], **kw}), 0)],
                             disable_tqdm=True)[0]

  greedy = gen(max_gen_toks=16, do_sample=False)
  assert gen(max_gen_toks=16, do_sample=True, temperature=1.0, top_k=1) == greedy
  sampled = {gen(max_gen_toks=16, do_sample=True, temperature=1.5) for _ in range(4)}
  assert len(sampled) > 1 or greedy not in sampled, sampled
  assert len(gen(max_gen_toks=3, do_sample=False).encode()) <= 3                  # bytes tokenizer: 3 tokens


# ---------------------------------------------------------------------------------------------------------------
# Errors and the multiple-choice file format (what sinkjax.eval --mc read)
# ---------------------------------------------------------------------------------------------------------------

def _one_line_error(capsys, argv) -> str:
  assert sj.main(argv) == 1
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and err.startswith("sinkjax.lm_eval: error:"), err
  return err


def test_errors_are_one_line_and_exit_1(toy, tmp_path, capsys):
  res = call_main(sj.main, ["--checkpoint", tmp_path / "nope", "--tasks", "arc_easy"], capsys)
  assert res.returncode == 1
  assert res.stderr.strip() == f"sinkjax.lm_eval: error: run directory {tmp_path / 'nope'} does not exist"
  (tmp_path / "empty").mkdir()
  assert "not a run directory" in _one_line_error(capsys, ["--checkpoint", str(tmp_path / "empty"), "--tasks",
                                                           "toy_mc", "--include-path", str(toy[2])])
  err = _one_line_error(capsys, ["--checkpoint", str(toy[1]), "--tasks", "toy_mc,no_such_task",
                                 "--include-path", str(toy[2])])
  assert "unknown task: no_such_task" in err, err
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"context": "a", "choices": [" b"], "label": 3}) + "\n")
  assert "bad.jsonl:1" in _one_line_error(capsys, ["--checkpoint", str(toy[1]), "--mc", str(bad)])
  assert "--tasks names no task" in _one_line_error(capsys, ["--checkpoint", str(toy[1])])
  with pytest.raises(SystemExit) as e:
    sj.main(["--tasks", "x"])                                                    # --checkpoint is required
  assert e.value.code == 2


def test_missing_lm_eval_is_one_line_naming_the_extra(tmp_path):
  code = ("import sys; sys.modules['lm_eval'] = None\n"
          "import sinkjax.lm_eval as m\n"
          "sys.exit(m.main(['--checkpoint', 'x', '--tasks', 'arc_easy']))")
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert res.returncode == 1
  assert res.stderr.strip() == "sinkjax.lm_eval: error: lm-evaluation-harness is not installed; pip install " \
                               "'sinkjax[eval]'"
  res = subprocess.run([sys.executable, "-c", "import sys, sinkjax; print('lm_eval' in sys.modules)"],
                       capture_output=True, text=True)
  assert res.stdout.strip() == "False"                 # import sinkjax never imports lm-eval


@pytest.mark.parametrize("line,msg", [
    ("{oops", "not valid JSON"),
    (json.dumps([1, 2]), "expected an object"),
    (json.dumps({"context": 1, "choices": ["a"], "label": 0}), "'context' must be a string"),
    (json.dumps({"context": "c", "choices": [], "label": 0}), "'choices' must be a non-empty list"),
    (json.dumps({"context": "c", "choices": ["a", "b"], "label": 2}), "'label' must be an integer index"),
    (json.dumps({"context": "c", "choices": ["a", "b"], "label": True}), "'label' must be an integer index"),
])
def test_mc_file_errors_name_the_line(tmp_path, line, msg):
  path = tmp_path / "items.jsonl"
  path.write_text(json.dumps({"context": "ok", "choices": [" a"], "label": 0}) + "\n\n" + line + "\n")
  with pytest.raises(sj.LMEvalError, match=msg) as e:
    sj.load_mc_items(path)
  assert "items.jsonl:3" in str(e.value)


def test_an_mc_file_is_a_local_task_scored_like_the_hf_backend(toy, tmp_path):
  """--mc FILE.jsonl: each choice appended to its context as is; the same log-likelihoods as the hf backend on the
  same task file."""
  items = [{"context": d["question"], "choices": [" " + c for c in d["choices"]], "label": d["label"]}
           for d in MC_DOCS]
  path = tmp_path / "quiz.jsonl"
  path.write_text("".join(json.dumps(i) + "\n" for i in items))
  task_dir = tmp_path / "task"
  task_dir.mkdir()
  assert sj.write_mc_task(path, task_dir) == "mc_quiz"
  ref, ref_samples = hf_reference(toy[0], ["mc_quiz"], task_dir, tmp_path / "hf_out")
  out = tmp_path / "out"
  assert sj.main(["--checkpoint", str(toy[1]), "--mc", str(path), "--output-path", str(out), "--log-samples",
                  "--bootstrap-iters", "0"]) == 0
  got = samples_of(out)["mc_quiz"]
  for doc_id, s in ref_samples["mc_quiz"].items():
    g = got[doc_id]
    assert g["arguments"]["gen_args_0"]["arg_1"] == s["arguments"]["gen_args_0"]["arg_1"]   # " Paris": as given
    for r, x in zip(s["resps"], g["resps"]):
      assert abs(float(r[0][0]) - float(x[0][0])) < 1e-3
  assert results_of(out)["results"]["mc_quiz"]["acc,none"] == ref["results"]["mc_quiz"]["acc,none"]


# ------------------------------------------------------------------------------------------------------------
# Table 2's tasks (paper-ft, ProcessBench), offline failures, HumanEval's requirements
# ------------------------------------------------------------------------------------------------------------
from sinkjax import lm_eval_tasks  # noqa: E402

LM_EVAL_TASKS = pathlib.Path(lm_eval.__file__).parent / "tasks"


def test_paper_ft_names_are_lm_eval_tasks(tmp_path):
  """Every name of --tasks paper-ft is defined (task: / group:) in the installed lm-eval's task YAMLs or is ours, and
  the Table 2 benchmarks map as documented; ours index in lm-eval's TaskManager."""
  from lm_eval.tasks import TaskManager
  names = sj.expand_tasks("paper-ft")
  assert names == ["arc_challenge", "leaderboard_musr", "gsm8k", "minerva_math500", "minerva_math", "processbench",
                   "longbench_hotpotqa", "longbench_qasper", "longbench_triviaqa", "longbench_narrativeqa",
                   "longbench_2wikimqa", "longbench_multifieldqa_en"]
  for n in names:
    if n != "processbench":
      assert lm_eval_tasks._task_files(n, [LM_EVAL_TASKS]), n          # pylint: disable=protected-access
  assert lm_eval_tasks.task_datasets("minerva_math500", [LM_EVAL_TASKS]) == {"HuggingFaceH4/MATH-500"}
  assert lm_eval_tasks.task_datasets("longbench_qasper", [LM_EVAL_TASKS]) == {"Xnhyacinth/LongBench"}
  assert "EleutherAI/hendrycks_math" in lm_eval_tasks.task_datasets("minerva_math", [LM_EVAL_TASKS])
  lm_eval_tasks.write_tasks(tmp_path)
  manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
  assert all(manager.match_tasks([n]) for n in lm_eval_tasks.NAMES)
  from lm_eval.tasks._yaml_loader import load_yaml    # lm-eval's own loader: !function resolved
  cfg = load_yaml(tmp_path / "processbench" / "processbench_math.yaml")
  assert cfg["test_split"] == "math" and cfg["dataset_path"] == "Qwen/ProcessBench"
  assert cfg["process_results"] is lm_eval_tasks.process_results
  assert cfg["metric_list"][0]["aggregation"] is lm_eval_tasks.f1
  assert load_yaml(tmp_path / "processbench" / "_processbench.yaml")["task"] == list(lm_eval_tasks.NAMES[1:])


def test_processbench_prompt_and_f1_by_hand():
  doc = {"problem": "1+1?", "steps": ["1+1=3.", "So 3."], "label": 0}
  assert lm_eval_tasks.doc_to_text(doc) == (
      "The following is a math problem and a solution (split into paragraphs, enclosed with tags and indexed from 0):"
      "\n\n[Math Problem]\n\n1+1?\n\n[Solution]\n\n<paragraph_0>\n1+1=3.\n</paragraph_0>\n\n<paragraph_1>\nSo 3.\n"
      "</paragraph_1>\n\nYour task is to review and critique the solution paragraph by paragraph. Once you identify an "
      "error in a paragraph, return the index of the paragraph where the earliest error occurs. Otherwise, return the "
      "index of -1 (which typically denotes \"not found\").\n\nPlease put your final answer (i.e., the index) in "
      "\\boxed{}.")
  assert lm_eval_tasks.process_results(doc, ["maybe \\boxed{1}... no: \\boxed{ 0 }"]) == {"f1": (0, 0)}
  assert lm_eval_tasks.process_results(doc, ["no box"]) == {"f1": (0, None)}
  # errors: 2 of 3 found; correct solutions: 1 of 2 called correct -> F1 = 2 (2/3)(1/2) / (2/3 + 1/2) = 4/7
  items = [(2, 2), (0, 1), (1, 1), (-1, -1), (-1, 3)]
  assert lm_eval_tasks.f1(items) == pytest.approx(100 * 4 / 7)
  assert lm_eval_tasks.f1([(2, 2)]) == 0.0


def _offline_env(tmp_path, **extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
  return {**env, "JAX_PLATFORMS": "cpu", "HF_HOME": str(tmp_path / "hf"), **extra}


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "no network"])
def test_offline_fails_in_one_line_within_seconds(tmp_path, how):
  """--tasks arc_easy with the hub unreachable (HF_HUB_OFFLINE=1, or an endpoint nothing listens on) and an empty
  cache: one line naming the task and its dataset, in well under 10 s (no hub retries, no task index, no model)."""
  import time
  (tmp_path / "run").mkdir()
  extra = {"HF_HUB_OFFLINE": "1"} if how == "HF_HUB_OFFLINE" else {"HF_ENDPOINT": "http://127.0.0.1:9"}
  t0 = time.perf_counter()
  res = subprocess.run([sys.executable, "-m", "sinkjax.lm_eval", "--checkpoint", str(tmp_path / "run"), "--tasks",
                        "arc_easy"], capture_output=True, text=True, env=_offline_env(tmp_path, **extra), cwd=REPO)
  elapsed = time.perf_counter() - t0
  lines = res.stderr.strip().splitlines()
  assert res.returncode == 1 and len(lines) == 1, res.stderr[-2000:]
  assert lines[0].startswith("sinkjax.lm_eval: error: the Hugging Face hub is unreachable") and \
      "arc_easy (allenai/ai2_arc)" in lines[0], lines[0]
  assert elapsed < 10, elapsed


def test_cached_datasets_pass_the_offline_check(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_HOME", str(tmp_path))
  monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
  monkeypatch.delenv("HF_HUB_CACHE", raising=False)
  with pytest.raises(sj.UserError, match=r"arc_easy \(allenai/ai2_arc\)"):
    lm_eval_tasks.check_hub(["arc_easy"], [])
  (tmp_path / "datasets" / "allenai___ai2_arc").mkdir(parents=True)        # the datasets library's cache layout
  lm_eval_tasks.check_hub(["arc_easy"], [])
  (tmp_path / "hub" / "datasets--openai--gsm8k").mkdir(parents=True)       # the hub's
  lm_eval_tasks.check_hub(["arc_easy", "gsm8k"], [])


def test_humaneval_requirements_are_one_line(tmp_path, capsys, monkeypatch):
  (tmp_path / "run").mkdir()
  monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
  err = _one_line_error(capsys, ["--checkpoint", str(tmp_path / "run"), "--tasks", "humaneval"])
  assert "humaneval executes model-written code and needs HF_ALLOW_CODE_EVAL=1 in the environment; " \
         "--confirm-run-unsafe-code" in err, err
  monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
  monkeypatch.setattr(lm_eval_tasks.importlib.util, "find_spec", lambda name: None)
  err = _one_line_error(capsys, ["--checkpoint", str(tmp_path / "run"), "--tasks", "paper"])
  assert "needs the evaluate package (pip install evaluate" in err and "--confirm-run-unsafe-code" in err, err
