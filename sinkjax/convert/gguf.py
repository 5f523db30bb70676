"""GGUF files (llama.cpp's format) -> a Hugging Face directory that `sinkjax.convert.hf` imports.

    python -m sinkjax.convert.hf --hf-dir MODEL.gguf --out RUN_DIR      # or a directory holding one .gguf file

The weights are dequantized to float32 by transformers' GGUF reader (`pip install 'sinkjax[gguf]'`: gguf, torch,
transformers); the config comes from the file's metadata as transformers maps it, and the tokenizer (tokenizer.json,
tokenizer_config.json, chat_template.jinja) and generation_config.json from the file's tokenizer fields, including
whether the tokenizer adds BOS (`tokenizer.ggml.add_bos_token`). The result is an ordinary safetensors directory:
transformers refuses `save_pretrained` of a GGUF-loaded model, so the tensors are written here.

A tensor type the `gguf` package cannot dequantize is refused in one line naming the type, before anything is
loaded. Importing dequantizes: the run holds float weights (an import of a Q4 file is the Q4 model, not the model it
was quantized from).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

from sinkjax.convert import ConvertError

INSTALL = "pip install gguf torch transformers (or the gguf extra: pip install 'sinkjax[gguf]')"


def find_gguf(src) -> pathlib.Path | None:
  """The .gguf file `src` names (the file, or a directory holding exactly one and no config.json); None if `src` is
  not a GGUF source (a Hugging Face directory, say). ConvertError for a directory with several."""
  p = pathlib.Path(str(src))
  if p.suffix.lower() == ".gguf":
    if not p.is_file():
      raise ConvertError(f"{p} does not exist; give a .gguf file or a Hugging Face model directory")
    return p
  if not p.is_dir() or (p / "config.json").is_file():
    return None
  files = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf")
  if len(files) > 1:
    raise ConvertError(f"{p} holds {len(files)} .gguf files ({', '.join(f.name for f in files[:3])}...); give one "
                       "of them as --hf-dir")
  return files[0] if files else None


def _gguf():
  try:
    import gguf  # pylint: disable=import-outside-toplevel
    import gguf.quants  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise ConvertError(f"importing a GGUF file needs the gguf package; {INSTALL}") from None
  return gguf


def _field(reader, name: str):
  f = reader.fields.get(name)
  if f is None or not f.data:
    return None
  value = f.parts[f.data[0]]
  if f.types and f.types[0].name == "STRING":
    return bytes(value).decode("utf-8", "replace")
  return value.tolist()[0] if isinstance(value, np.ndarray) and value.size == 1 else value


def inspect(path) -> dict:
  """What the file holds before anything is dequantized: architecture, tensor types (counts) and the tokenizer's
  add_bos flag. ConvertError naming a tensor type the installed gguf package cannot dequantize."""
  gguf = _gguf()
  try:
    reader = gguf.GGUFReader(str(path))
  except Exception as e:  # pylint: disable=broad-except
    raise ConvertError(f"{path} is not a readable GGUF file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
  types: dict[str, int] = {}
  for t in reader.tensors:
    types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
  plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
  readable = plain | set(getattr(gguf.quants, "_type_traits", {}))
  bad = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in readable})
  if bad:
    raise ConvertError(f"{path} holds {bad[0]} tensors ({types[bad[0]]} of them), a quantization type the installed "
                       "gguf package cannot dequantize; re-quantize the model (e.g. to Q8_0) or import its Hugging "
                       "Face safetensors instead")
  add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
  return {"architecture": _field(reader, "general.architecture"), "tensor_types": types,
          "add_bos_token": bool(add_bos) if add_bos is not None else None,
          "context_length": _field(reader, f"{_field(reader, 'general.architecture')}.context_length")}


def to_hf_dir(path, out_dir) -> dict:
  """Writes the GGUF file's model as a Hugging Face directory into `out_dir` (config.json, model.safetensors,
  generation_config.json, the tokenizer files); returns `inspect`'s summary."""
  path, out_dir = pathlib.Path(path), pathlib.Path(out_dir)
  info = inspect(path)
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ConvertError(f"importing a GGUF file needs torch, transformers and safetensors; {INSTALL}") from None
  transformers.logging.set_verbosity_error()
  kw = {"gguf_file": path.name}
  try:
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw)
  except (ValueError, KeyError, NotImplementedError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConvertError(f"transformers cannot read {path.name} (architecture {info['architecture']!r}): {first}") \
        from None
  out_dir.mkdir(parents=True, exist_ok=True)
  cfg = model.config.to_dict()
  for key in ("quantization_config", "_name_or_path", "transformers_version"):
    cfg.pop(key, None)
  cfg["architectures"] = [type(model).__name__]
  (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
  tensors = {}
  for name, t in model.state_dict().items():
    if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
      continue                                   # the embedding, shared
    tensors[name] = t.detach().to(torch.float32).numpy().copy()
  save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
  gen = {k: v for k, v in model.generation_config.to_dict().items()
         if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
  (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
  tok.save_pretrained(str(out_dir))
  tc_path = out_dir / "tokenizer_config.json"
  if info["add_bos_token"] is not None and tc_path.is_file():
    tc = json.loads(tc_path.read_text())
    tc.setdefault("add_bos_token", info["add_bos_token"])      # the GGUF's own flag, which transformers drops
    tc_path.write_text(json.dumps(tc, indent=2))
  return info
