"""A GGUF file is converted tensor by tensor (sinkjax.convert.gguf): the directory it writes holds exactly the tensors
transformers' whole-model `from_pretrained(gguf_file=)` loads in float32, while the host holds one tensor and the
safetensors file being filled, not the model. On the real SmolLM2-135M GGUF (tests/real_model.py says where it is)."""
import json
import pathlib
import tracemalloc

import numpy as np
import pytest
from safetensors.numpy import load_file

from sinkjax.convert import gguf as gguf_lib
from tests import real_model

torch = pytest.importorskip("torch", reason="the reference is transformers on torch (the test extra)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers (the test extra)")
pytest.importorskip("gguf", reason="the GGUF reader is the gguf package (the test extra)")

SHARD = 32 * 2**20          # small enough that SmolLM2's 538 MB of float32 make many files


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
  """(the .gguf file, the directory to_hf_dir wrote with SHARD-byte files, its summary with `traced_peak`: the most
  bytes Python's allocator (numpy's arrays included) held at once while the tensors were converted, by tracemalloc;
  and `parsed`: the files gguf.GGUFReader was called on, by anyone, during the conversion)."""
  import gguf
  tmp = tmp_path_factory.mktemp("gguf")
  path = real_model.smollm2_gguf(tmp)
  write, traced, parse, parsed = gguf_lib._write_tensors, {}, gguf.GGUFReader, []

  def counted_parse(*args, **kwargs):
    parsed.append(args[0] if args else kwargs)
    return parse(*args, **kwargs)

  def traced_write(*args, **kwargs):
    tracemalloc.start()
    try:
      return write(*args, **kwargs)
    finally:
      traced["peak"] = tracemalloc.get_traced_memory()[1]
      tracemalloc.stop()

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(gguf_lib, "_write_tensors", traced_write)
    mp.setattr(gguf, "GGUFReader", counted_parse)
    info = gguf_lib.to_hf_dir(path, tmp / "hf", shard_bytes=SHARD)
  return path, tmp / "hf", {**info, "traced_peak": traced["peak"], "parsed": parsed}


def test_the_file_is_parsed_once(streamed):
  """gguf.GGUFReader reads the file's metadata (SmolLM2's 49k-token vocabulary and merges: ~5 s on 2 cores) once:
  transformers' tokenizer and config readers, which open the file themselves, are handed that reader."""
  path, _, info = streamed
  assert [str(p) for p in info["parsed"]] == [str(path)]


def _files(out: pathlib.Path) -> dict:
  """{safetensors file: {tensor name: array}} as the index lists them."""
  weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
  files = {f: load_file(str(out / f)) for f in sorted(set(weight_map.values()))}
  assert {n: f for f, ts in files.items() for n in ts} == weight_map
  return files


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (q / k rows reordered for its rotary layout)."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_each_tensor_is_the_file_tensor_dequantized(streamed):
  """Against the file itself: every Hugging Face tensor written is its GGUF tensor dequantized by the gguf package,
  llama.cpp's own q / k permutation applied to ours giving back the file's rows (9 query / 3 KV heads)."""
  import gguf
  path, out, _ = streamed
  got = {n: a for ts in _files(out).values() for n, a in ts.items()}
  reader = gguf.GGUFReader(str(path))
  names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_norm": "input_layernorm",
           "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
           "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
  assert len(got) == len(reader.tensors) == 272
  for t in reader.tensors:
    parts = t.name.split(".")
    hf = f"model.layers.{parts[1]}.{names[parts[2]]}.weight" if parts[0] == "blk" else f"{names[parts[0]]}.weight"
    ours = got[hf]
    if parts[-2] in ("attn_q", "attn_k"):
      ours = _llama_cpp_permute(ours, 9 if parts[-2] == "attn_q" else 3)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(t.data, t.tensor_type), err_msg=t.name)


@pytest.mark.slow
def test_the_tensors_are_the_whole_model_conversion(streamed):
  """Same names, same float32 values as transformers' own whole-model load of the file (its q/k un-permuted, the
  tied lm_head left to the embedding); config.json and generation_config.json as that model's."""
  path, out, _ = streamed
  transformers.logging.set_verbosity_error()
  whole = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32)
  assert whole.config.tie_word_embeddings
  expected = {n: t.detach().numpy() for n, t in whole.state_dict().items() if n != "lm_head.weight"}
  got = {n: a for ts in _files(out).values() for n, a in ts.items()}
  assert sorted(got) == sorted(expected)
  for name, want in expected.items():
    assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
    np.testing.assert_array_equal(got[name], want, err_msg=name)
  cfg = json.loads((out / "config.json").read_text())
  ref = whole.config.to_dict()
  for key in ("quantization_config", "_name_or_path", "transformers_version"):
    ref.pop(key, None)
  assert cfg == json.loads(json.dumps({**ref, "architectures": ["LlamaForCausalLM"]}))
  gen = json.loads((out / "generation_config.json").read_text())
  assert gen == {k: getattr(whole.generation_config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def test_the_host_holds_one_tensor_and_one_file_not_the_model(streamed):
  """Each file written holds at most SHARD bytes (or one tensor alone); the host mark is the largest tensor (the
  Q8_0 embedding, dequantized) or a file's worth, far below the model's 538 MB; tracemalloc sees no more allocated
  at once than that and one dequantization chunk's temporaries; the summary line says so."""
  _, out, info = streamed
  files = _files(out)
  sizes = {n: a.nbytes for ts in files.values() for n, a in ts.items()}
  for f, ts in files.items():
    assert len(ts) == 1 or sum(a.nbytes for a in ts.values()) <= SHARD, f
  largest, total = max(sizes.values()), sum(sizes.values())
  assert largest == 49152 * 576 * 4 and total == info["tensor_bytes"] and len(files) == info["shards"] > 10
  assert largest <= info["host_peak_bytes"] <= max(SHARD, largest) + largest < total / 2
  # measured: what was allocated at once is that mark and the temporaries of dequantizing one chunk
  assert info["host_peak_bytes"] <= info["traced_peak"] <= info["host_peak_bytes"] + 4 * gguf_lib.CHUNK_BYTES
  assert info["host_peak_tensor"] == "token_embd.weight"            # the embedding, whole, in its own file
  line = gguf_lib.summary(info)
  assert f"at most {info['host_peak_bytes']:,} bytes" in line and "\n" not in line


def test_the_tokenizer_files_keep_the_files_add_bos(streamed):
  """The tokenizer comes out as before the change: transformers' own, with the GGUF's add_bos_token (false)."""
  _, out, info = streamed
  assert info["add_bos_token"] is False
  assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is False
  assert (out / "tokenizer.json").is_file()


def test_moe_experts_are_assembled_from_their_gguf_tensors(tmp_path):
  """A Qwen3-MoE layer's gate and up expert stacks (two GGUF tensors) come out as one gate_up_proj = [gate | up]
  along the intermediate axis, written after their block is read even when a file is written in between; every
  other tensor as stored. Tiny float32 tensors through transformers' own qwen3moe processor and weights map."""
  import gguf
  from transformers import modeling_gguf_pytorch_utils as hf_gguf
  from types import SimpleNamespace
  config = transformers.Qwen3MoeConfig(num_hidden_layers=2, hidden_size=8, moe_intermediate_size=4, num_experts=4,
                                       num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=4, vocab_size=16, tie_word_embeddings=False)
  with torch.device("meta"):
    skeleton = transformers.AutoModelForCausalLM.from_config(config)
  processor = hf_gguf.TENSOR_PROCESSORS["qwen3moe"](config=config.to_dict())
  names = hf_gguf.get_gguf_hf_weights_map(skeleton, processor)
  rng = np.random.default_rng(0)
  shapes = {n: tuple(t.shape) for n, t in skeleton.state_dict().items()}
  stored = {}
  for g, hf in names.items():
    shape = shapes[hf]
    if g.endswith(("_gate_exps", "_up_exps")):
      shape = (shape[0], shape[1] // 2, shape[2])
    stored[g + ("" if g.endswith(".weight") else ".weight")] = rng.standard_normal(shape).astype(np.float32)
  order = sorted(stored, key=lambda n: (n.startswith("output"), n))     # token_embd, blk.0.*, blk.1.*, output*
  reader = SimpleNamespace(tensors=[SimpleNamespace(name=n, data=stored[n], n_elements=stored[n].size,
                                                    tensor_type=gguf.GGMLQuantizationType.F32) for n in order])
  info = gguf_lib._write_tensors(reader, processor, names, tmp_path, 1024)   # a file every ~1 KB: mid-layer too
  got = {n: a for ts in _files(tmp_path).values() for n, a in ts.items()}
  assert sorted(got) == sorted(shapes) and info["shards"] > 4
  for layer in (0, 1):
    np.testing.assert_array_equal(got[f"model.layers.{layer}.mlp.experts.gate_up_proj"], np.concatenate(
        [stored[f"blk.{layer}.ffn_gate_exps.weight"], stored[f"blk.{layer}.ffn_up_exps.weight"]], axis=1))
  for g, hf in names.items():
    if "_gate_exps" not in g and "_up_exps" not in g:
      np.testing.assert_array_equal(got[hf], stored[g + ("" if g.endswith(".weight") else ".weight")], err_msg=g)
