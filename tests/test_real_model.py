"""A real pretrained LLM end to end (SmolLM2-135M-Instruct from its GGUF file; tests/real_model.py says where it is
found), against transformers reading the same file: the import, the tokenizer's own special tokens (no BOS added, its
EOS, its chat template), float32 logits on English text, greedy chat generation, and the bfloat16 agreement that
docs/CONVERT.md states."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sinkjax.config import Config
from sinkjax.convert import hf as hf_convert
from sinkjax.data import make_eval_batches
from sinkjax.generate import Generator, TextStream, prompt_ids
from sinkjax.run import load_run
from tests import real_model
from tests.helpers import ROOT

# one worker imports the model once; compiled with every optimization (tests/conftest.py): a 30-layer model's
# generation and forward passes run long enough that the cheaper compile mode costs more than it saves
pytestmark = pytest.mark.usefixtures("optimized_compile")

torch = pytest.importorskip("torch", reason="the reference is transformers on torch (the test extra)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers (the test extra)")
pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package (the test extra)")

# Plain English prose (written for this test), about 400 tokens.
TEXT = (
    "The Pacific Ocean is the largest and deepest of the world's five oceanic divisions. It extends from the Arctic "
    "Ocean in the north to the Southern Ocean in the south, and is bounded by the continents of Asia and Australia in "
    "the west and the Americas in the east. Covering about one third of the surface of the planet, it is larger than "
    "all of the land on Earth put together. Its waters hold more than half of the free water on the globe.\n\n"
    "Sailors have crossed it for thousands of years. Long before European ships arrived, people from the islands of "
    "Southeast Asia set out in canoes and settled places as far apart as Hawaii, New Zealand and Easter Island, "
    "finding their way by the stars, the swell of the sea and the flight of birds. Their voyages are among the great "
    "feats of human exploration, and the knowledge they carried was passed from one generation to the next by "
    "teaching and song rather than by writing.\n\n"
    "The ocean floor is far from flat. Long chains of underwater mountains rise from the plains of the deep sea, and "
    "in the west a series of trenches plunges to depths greater than the height of the tallest mountains on land. "
    "Around its edge runs a belt of volcanoes and earthquakes, where the plates of the crust slide beneath one "
    "another. Warm currents carry heat from the tropics toward the poles, and every few years a change in the winds "
    "and the water temperature near the equator alters the weather of many countries, bringing floods to some and "
    "droughts to others. Scientists watch these changes closely, because farmers, fishermen and whole cities depend "
    "on the rain that the ocean sends or withholds.")
# One chat prompt: its greedy reply is 24 tokens, then <|im_end|> (a second prompt would add a decode loop of the
# 30-layer model on both sides and test nothing new)
PROMPTS = ("What is the largest ocean on Earth?",)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
  """(the imported float32 run, its model / config / tokenizer, transformers' model and tokenizer of the file)."""
  tmp = tmp_path_factory.mktemp("smollm2")
  gguf = real_model.smollm2_gguf(tmp)
  run = tmp / "run"
  hf_convert.convert(gguf, run, dtype="float32")
  model, cfg, tok, _ = load_run(run)
  transformers.logging.set_verbosity_error()
  with real_model.parsed_once(gguf):
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                 dtype=torch.float32).eval()
  return {"gguf": gguf, "run": run, "model": model, "cfg": cfg, "tok": tok, "hf_tok": hf_tok, "hf": hf_model}


def _hf_logits(hf_model, ids):
  with torch.no_grad():
    return hf_model(torch.tensor([ids])).logits[0].float().numpy()


def test_import_records_the_model_and_its_tokens(smol):
  cfg, tok = smol["cfg"], smol["tok"]
  m = cfg.model
  assert (m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (30, 576, 9, 3, 64, 49152)
  assert m.tie_embeddings and m.rope_theta == 100000.0
  assert m.max_seq_len == 8192 and cfg.data.seq_len == 8192          # the model's context, not a default
  assert (smol["run"] / "tokenizer" / "chat_template.jinja").is_file()
  assert not tok.add_bos                                               # its tokenizer adds none
  assert tok.stop_ids == [2] and tok.eos_ids[0] == 2                  # <|im_end|>
  assert tok.token_text(2) == smol["hf_tok"].eos_token == "<|im_end|>"
  assert not tok.chat.plain


def test_tokenization_equals_the_hf_tokenizer(smol, tmp_path):
  tok, hf_tok = smol["tok"], smol["hf_tok"]
  for text in (TEXT, "Hello world", " leading space and ünïcödé — dashes"):
    assert tok.encode_document(text) == hf_tok(text).input_ids       # no BOS the model never saw
  # The data pipeline packs the same ids: a document row starts with the text's first token, not a BOS.
  (tmp_path / "doc.txt").write_text(TEXT)
  cfg = Config()
  cfg.data.source, cfg.data.seq_len = str(tmp_path / "doc.txt"), 64
  ids = hf_tok(TEXT).input_ids
  (batch,) = make_eval_batches(cfg.data, tok, batch_size=1, num_batches=1, split="all")
  assert batch["inputs"][0].tolist() == ids[:64] and batch["targets"][0].tolist() == ids[1:65]


def test_float32_logits_match_transformers_on_english_text(smol):
  ids = smol["hf_tok"](TEXT).input_ids
  assert len(ids) >= 256, len(ids)
  ours = np.asarray(smol["model"](np.asarray([ids], np.int32)))[0]
  ref = _hf_logits(smol["hf"], ids)
  err = np.abs(ours - ref).max()
  assert err <= 1e-3, err
  assert (ours.argmax(-1) == ref.argmax(-1)).mean() == 1.0


def test_chat_greedy_generation_matches_transformers(smol):
  tok, hf_tok, model = smol["tok"], smol["hf_tok"], smol["model"]
  chats = [prompt_ids(tok, prompt, chat=True) for prompt in PROMPTS]
  gen = Generator(model, capacity=max(len(ids) for _, ids in chats) + 32)
  for prompt, (text, ids) in zip(PROMPTS, chats):
    ref_text = hf_tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=False)
    assert text == ref_text
    ref_ids = hf_tok(ref_text, add_special_tokens=False).input_ids
    assert ids == ref_ids
    with torch.no_grad():
      out = smol["hf"].generate(torch.tensor([ref_ids]), max_new_tokens=32, do_sample=False)
    ref_new = out[0, len(ref_ids):].tolist()
    assert ref_new[-1] == 2 and len(ref_new) < 32                   # transformers stopped at <|im_end|>
    shown = []
    ours = gen.generate(ids, 32, temperature=0.0, stop_token=tok.stop_ids, on_token=shown.append)
    assert ours == ref_new[:-1]                                       # the same tokens, stopped at the same EOS
    stream = TextStream(tok, out=open(os.devnull, "w"), skip_special_tokens=False)
    for t in shown:
      stream(t)
    assert stream.text() == hf_tok.decode(ref_new[:-1], skip_special_tokens=False)


@pytest.mark.slow   # a second compile of the 30-layer model (~35 s); the float32 agreement is checked by default
def test_bfloat16_agreement_with_transformers(smol):
  """bfloat16 forward passes disagree with float32 in the argmax at a few per cent of positions, transformers' own
  as much as ours: the figures docs/CONVERT.md states."""
  ids = smol["hf_tok"](TEXT).input_ids
  ref32 = _hf_logits(smol["hf"], ids).argmax(-1)
  hf16 = _hf_logits(smol["hf"].to(torch.bfloat16), ids).argmax(-1)
  smol["hf"].to(torch.float32)
  ours16_model, _, _, _ = load_run(smol["run"], overrides=["model.dtype=bfloat16"])
  ours16 = np.asarray(ours16_model(np.asarray([ids], np.int32)), np.float32)[0].argmax(-1)
  agree_hf = float((ours16 == hf16).mean())
  hf_self = float((hf16 == ref32).mean())
  ours_self = float((ours16 == ref32).mean())
  print(f"argmax agreement over {len(ids)} tokens: sinkjax bf16 vs transformers bf16 {agree_hf:.3f}; "
        f"transformers bf16 vs f32 {hf_self:.3f}; sinkjax bf16 vs f32 {ours_self:.3f}")
  assert agree_hf >= 0.9 and hf_self >= 0.9 and ours_self >= 0.9
  assert ours_self >= hf_self - 0.05


def test_export_writes_the_tokenizer_back(smol, tmp_path):
  """The exported model carries its tokenizer files, chat template included: transformers renders the same chat."""
  out = hf_convert.export(smol["run"], tmp_path / "hf", dtype="bfloat16")
  assert (out / "chat_template.jinja").is_file() and (out / "generation_config.json").is_file()
  back = transformers.AutoTokenizer.from_pretrained(str(out))
  msgs = [{"role": "user", "content": PROMPTS[0]}]
  assert back.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
      smol["hf_tok"].apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
  assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_an_unreadable_quantization_type_is_one_line(tmp_path):
  """A GGUF tensor type the gguf package cannot dequantize is named before anything is loaded."""
  import gguf
  from sinkjax.convert import ConvertError
  w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.int8), raw_dtype=gguf.GGMLQuantizationType.I8)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ConvertError, match=r"holds I8 tensors .* cannot dequantize") as e:
    hf_convert.convert(tmp_path, tmp_path / "run")                  # the directory holding the file
  assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_commands_on_the_real_model(smol, tmp_path):
  """As a user: generate's chat answers and stops; eval --split all scores every document of a file."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}   # one CPU device, as a user has (not the 8 of the tests)
  r = subprocess.run([sys.executable, "-m", "sinkjax.generate", "chat", "--checkpoint", str(smol["run"]),
                      "--prompt", PROMPTS[0], "--max-new-tokens", "60", "--temperature", "0"],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "Pacific" in r.stdout and "reached --max-new-tokens" not in r.stderr     # it stopped at <|im_end|>
  assert "<|im_start|>" not in r.stdout            # the reply, not the chat template's rendering (that is --echo)
  # docs/CONVERT.md's eval command as printed (no batch or row settings: sized to the data)
  docs = [json.dumps({"text": p}) for p in TEXT.split("\n\n")]
  (tmp_path / "docs.jsonl").write_text("\n".join(docs) + "\n")
  r = subprocess.run([sys.executable, "-m", "sinkjax.eval", "--checkpoint", str(smol["run"]), "--data",
                      str(tmp_path / "docs.jsonl"), "--split", "all", "--out", str(tmp_path / "eval")],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
  assert r.returncode == 0, r.stderr[-2000:]
  report = json.loads((tmp_path / "eval" / "report.json").read_text())
  n_tokens = sum(len(smol["hf_tok"](p).input_ids) - 1 for p in TEXT.split("\n\n"))   # no first token of a
  assert n_tokens == 319                                                                 # document is a target
  assert report["eval_documents"] == 3 and report["eval_tokens"] == n_tokens
  assert "3 documents" in r.stdout
  # 40 one-line documents (the case: 13 minutes, then 27 GB asked of XLA): every one reported
  sentences = [s.strip() + "." for s in TEXT.replace("\n\n", " ").split(". ") if s.strip()][:40]
  assert len(sentences) >= 10                      # 12 sentences, each used three or four times
  lines = [sentences[i % len(sentences)] for i in range(40)]
  (tmp_path / "lines.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
  r = subprocess.run([sys.executable, "-m", "sinkjax.eval", "--checkpoint", str(smol["run"]), "--data",
                      str(tmp_path / "lines.jsonl"), "--split", "all", "--out", str(tmp_path / "eval40")],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
  assert r.returncode == 0, r.stderr[-2000:]
  report = json.loads((tmp_path / "eval40" / "report.json").read_text())
  assert report["eval_documents"] == 40 and "40 documents" in r.stdout
  n40 = sum(len(smol["hf_tok"](t).input_ids) - 1 for t in lines)
  # the 40 documents (n40 targets + 40 first tokens) pack into one row of data.seq_len 8192, cut to its used tokens
  # rounded up to 64, not 8192 long
  assert report["eval_tokens"] == n40 and report["eval_rows"] == 1 and report["seq_len"] == 64 * -(-(n40 + 40) // 64)


@pytest.mark.slow   # the analysis reads 512 documents with the model and a random init (minutes on 2 cores)
def test_fig4_analysis_command_writes_its_heatmap(smol, tmp_path):
  """docs/RESULTS.md's Fig. 4 command, the analysis part alone: analysis.json and the heatmap, exit 0."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}   # one CPU device, as a user has (not the 8 of the tests)
  r = subprocess.run([sys.executable, "-m", "sinkjax.experiments.study", "configs/studies/heads_fig4.yaml",
                      f"study.run={smol['run']}", f"study.out={tmp_path / 'heads_real'}"],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=3000)
  assert r.returncode == 0, r.stderr[-2000:]
  analysis = json.loads((tmp_path / "heads_real" / "analysis.json").read_text())
  assert np.asarray(analysis["importance"]).shape == (30, 9) and analysis["documents"] == 512
  assert (tmp_path / "heads_real" / "results" / "analysis.png").stat().st_size > 20_000


@pytest.mark.slow   # nine runs over 2,048 tokens and the importance of 256 documents (~10 minutes on 2 cores)
def test_streaming_quick_command_as_documented(smol, tmp_path):
  """docs/STREAMING.md's quick form of the streaming comparison, as printed (run dir and --out in a temp dir)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}   # one CPU device, as a user has (not the 8 of the tests)
  out = tmp_path / "streaming_quick"
  r = subprocess.run([sys.executable, "-m", "sinkjax.experiments.study", "configs/studies/streaming_real.yaml",
                      f"study.run={smol['run']}", "streaming.tokens=2048", "axes.random_map=[0,1]", f"study.out={out}"],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=3000)
  assert r.returncode == 0, r.stderr[-2000:]
  results = json.loads((out / "results.json").read_text())
  assert results and (out / "results.md").is_file() and (out / "streaming_real.png").stat().st_size > 20_000
