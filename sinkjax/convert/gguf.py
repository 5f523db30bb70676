"""GGUF files (llama.cpp's format) -> a Hugging Face directory that `sinkjax.convert.hf` imports.

    python -m sinkjax.convert.hf --hf-dir MODEL.gguf --out RUN_DIR      # or a directory holding one .gguf file

The weights are read tensor by tensor (`pip install 'sinkjax[gguf]'`: gguf, torch, transformers): each one is
dequantized to float32 by the gguf package, renamed and un-permuted by transformers' own GGUF processors (those of
`load_gguf_checkpoint`), and added to a safetensors file that is written out every `SHARD_BYTES`, so the host never
holds more than that file and the tensor being converted (`summary` reports the mark), not the whole model. The
config comes from the file's metadata as transformers maps it, and the tokenizer (tokenizer.json,
tokenizer_config.json, chat_template.jinja) and generation_config.json from the file's tokenizer fields, including
whether the tokenizer adds BOS (`tokenizer.ggml.add_bos_token`). The result is an ordinary sharded safetensors
directory, equal tensor for tensor to what transformers' `from_pretrained(gguf_file=)` loads in float32.

A tensor type the `gguf` package cannot dequantize is refused in one line naming the type, before anything is
loaded. Importing dequantizes: the run holds float weights (an import of a Q4 file is the Q4 model, not the model it
was quantized from).
"""
from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import re
import unittest.mock

import numpy as np

from sinkjax.convert import ConvertError
from sinkjax.convert.place import HostMeter

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


def _open(path):
  gguf = _gguf()
  try:
    return gguf.GGUFReader(str(path))
  except Exception as e:  # pylint: disable=broad-except
    raise ConvertError(f"{path} is not a readable GGUF file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def inspect(path, reader=None) -> dict:
  """What the file holds before anything is dequantized: architecture, tensor types (counts) and the tokenizer's
  add_bos flag. ConvertError naming a tensor type the installed gguf package cannot dequantize."""
  gguf = _gguf()
  reader = _open(path) if reader is None else reader
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


SHARD_BYTES = 128 * 2**20       # the safetensors file being written is held in host memory until it is written


@contextlib.contextmanager
def sharing_reader(path, reader):
  """Within the block, gguf.GGUFReader(path), called by anyone (transformers' GGUF tokenizer, config and tensor
  loaders each open the file themselves), returns `reader`, the file already parsed: parsing the metadata (a
  50k-token vocabulary and its merges) takes seconds. Other files and other arguments are parsed as usual."""
  gguf = _gguf()
  parse, path = gguf.GGUFReader, pathlib.Path(path).resolve()

  def reuse(file, *args, **kwargs):
    same = not args and not kwargs and pathlib.Path(file).resolve() == path
    return reader if same else parse(file, *args, **kwargs)

  with unittest.mock.patch.object(gguf, "GGUFReader", reuse):
    yield


def to_hf_dir(path, out_dir, *, shard_bytes: int = SHARD_BYTES) -> dict:
  """Writes the GGUF file's model as a Hugging Face directory into `out_dir` (config.json, safetensors files of at
  most `shard_bytes` each (or one tensor) with model.safetensors.index.json, generation_config.json, the tokenizer
  files), tensor by tensor; returns `inspect`'s summary with what the tensors took (`summary` says it in a line):
  tensors, tensor_bytes (float32, written), shards, host_peak_bytes and host_peak_tensor (`_write_tensors`)."""
  path, out_dir = pathlib.Path(path), pathlib.Path(out_dir)
  reader = _open(path)
  info = inspect(path, reader)
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    from transformers import modeling_gguf_pytorch_utils as hf_gguf  # pylint: disable=import-outside-toplevel
    import safetensors.numpy  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise ConvertError(f"importing a GGUF file needs torch, transformers and safetensors; {INSTALL}") from None
  transformers.logging.set_verbosity_error()
  arch = info["architecture"]
  if _block_loaded(arch):
    raise ConvertError(f"{path.name} is a {arch!r} model, which transformers reads with its own block loader, not "
                       "tensor by tensor; import the model's Hugging Face safetensors instead")
  gguf = _gguf()
  try:
    with sharing_reader(path, reader):       # transformers parses the file for the tokenizer and for the config
      tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
      parsed = hf_gguf.load_gguf_checkpoint(str(path), return_tensors=False)["config"]   # metadata only
    config = transformers.AutoConfig.for_model(**parsed)                # as AutoConfig.from_pretrained(gguf_file=)
    with torch.device("meta"):                                          # names only: nothing allocated
      skeleton = transformers.AutoModelForCausalLM.from_config(config)
    processor = hf_gguf.TENSOR_PROCESSORS.get(arch, hf_gguf.TensorProcessor)(config=parsed)
    # GGUF tensor name -> Hugging Face name. transformers rebuilds gguf's name table (arch, layers) for every
    # submodule it recurses into (seconds for 30 layers, quadratic in depth): the same table, built once.
    with unittest.mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
      names = hf_gguf.get_gguf_hf_weights_map(skeleton, processor)
  except (ValueError, KeyError, NotImplementedError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConvertError(f"transformers cannot read {path.name} (architecture {arch!r}): {first}") from None
  out_dir.mkdir(parents=True, exist_ok=True)
  cfg = config.to_dict()
  for key in ("quantization_config", "_name_or_path", "transformers_version"):
    cfg.pop(key, None)
  cfg["architectures"] = [type(skeleton).__name__]
  cfg["dtype"] = "float32"                                              # what the tensors are written in
  (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
  info.update(_write_tensors(reader, processor, names, out_dir, shard_bytes))
  gen = {k: v for k, v in transformers.GenerationConfig.from_model_config(config).to_dict().items()
         if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
  (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
  tok.save_pretrained(str(out_dir))
  tc_path = out_dir / "tokenizer_config.json"
  if info["add_bos_token"] is not None and tc_path.is_file():
    tc = json.loads(tc_path.read_text())
    tc.setdefault("add_bos_token", info["add_bos_token"])      # the GGUF's own flag, which transformers drops
    tc_path.write_text(json.dumps(tc, indent=2))
  return info


def _block_loaded(arch: str) -> bool:
  """Whether transformers loads `arch` files with its newer GGUF loader (transformers.integrations.gguf: qwen35,
  lfm2, ...) rather than `load_gguf_checkpoint`'s tensor processors, which this follows."""
  try:
    from transformers.integrations.gguf.utils import is_gguf_arch_supported  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  return is_gguf_arch_supported(arch)


CHUNK_BYTES = 16 * 2**20        # a tensor is dequantized this many float32 bytes of rows at a time


def _dequantize(gguf, t) -> np.ndarray:
  """The GGUF tensor `t` in float32, as `gguf.quants.dequantize` gives it, filled CHUNK_BYTES of rows at a time: that
  function keeps every row group's output until it concatenates them (twice the tensor), this the tensor and one
  chunk."""
  rows = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data[None]
  width = gguf.quants.dequantize(rows[:1], t.tensor_type).shape[-1]
  out = np.empty((rows.shape[0], width), np.float32)
  step = max(1, CHUNK_BYTES // (4 * width))
  for i in range(0, rows.shape[0], step):
    out[i:i + step] = gguf.quants.dequantize(rows[i:i + step], t.tensor_type)
  return out.reshape(*t.data.shape[:-1], width)


def _block(name: str):
  m = re.match(r"blk\.(\d+)\.", name)
  return int(m.group(1)) if m else name


def _write_tensors(reader, processor, names: dict, out_dir: pathlib.Path, shard_bytes: int) -> dict:
  """Dequantizes the file's tensors one at a time, undoes llama.cpp's changes with transformers' own processor (as
  `load_gguf_checkpoint` does: the q/k row permutation of Llama-family attention, MoE expert stacks), and adds each
  float32 result to the safetensors file being filled, which is written out once the next tensor would take it past
  `shard_bytes`. Tensors transformers assembles from several GGUF ones (a Qwen-MoE gate_up_proj) are kept until
  the GGUF block (layer) they come from has been read.

  The host mark (`place.HostMeter`) counts the arrays this holds at once: the file being filled, tensors being
  assembled, and the tensor being converted with its dequantized form when the processor copied it (a q / k
  un-permutation does); not the temporaries of dequantizing one CHUNK_BYTES chunk. The GGUF file is memory-mapped."""
  gguf = _gguf()
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  meter = HostMeter()
  last = {_block(t.name): i for i, t in enumerate(reader.tensors)}
  shard: dict[str, np.ndarray] = {}
  files: list[dict[str, str]] = []                    # per file written: {tensor name: file name}
  assembling = {"tensors": {}}         # load_gguf_checkpoint's parsed_parameters, where MoE processors assemble
  total = [0, 0]                       # tensors, bytes written

  def flush():
    if shard:
      fname = f"model-{len(files) + 1:05d}.safetensors"
      save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
      files.append({n: fname for n in shard})
      shard.clear()
      meter.release()
      meter.hold(sum(v.nbytes for v in assembling["tensors"].values()), "")

  def add(name: str, value: np.ndarray):
    shard[name] = value
    total[0] += 1
    total[1] += value.nbytes

  for i, t in enumerate(reader.tensors):
    if shard and meter.held + 4 * int(t.n_elements) > shard_bytes:
      flush()                                                           # before the next tensor is dequantized
    raw = _dequantize(gguf, t)
    before = sum(v.nbytes for v in assembling["tensors"].values())
    out = processor.process(weights=raw, name=t.name, tensor_key_mapping=names, parsed_parameters=assembling)
    if out.name in names:
      value = np.ascontiguousarray(out.weights, dtype=np.float32)
      meter.hold(value.nbytes, t.name, transient=0 if np.may_share_memory(value, raw) else raw.nbytes)
      add(names[out.name], value)
      del value
    else:                                                               # assembled, or not a model tensor
      meter.hold(sum(v.nbytes for v in assembling["tensors"].values()) - before, t.name, transient=raw.nbytes)
    del raw, out                                                        # only the shard refers to the tensor now
    if last[_block(t.name)] == i:                                       # the block is read: its assemblies are whole
      for name, tensor in assembling["tensors"].items():
        add(name, tensor.detach().float().numpy())
      assembling["tensors"].clear()
  flush()
  n = len(files)
  weight_map = {}
  for k, names_in in enumerate(files):             # final names as transformers writes them: model-K-of-N
    fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
    (out_dir / f"model-{k + 1:05d}.safetensors").rename(out_dir / fname)
    weight_map.update({name: fname for name in names_in})
  if n > 1:
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total[1]}, "weight_map": weight_map}, indent=2))
  return {"tensors": total[0], "tensor_bytes": total[1], "shards": n, "host_peak_bytes": meter.peak,
          "host_peak_tensor": meter.at}


def summary(info: dict) -> str:
  """One line: what `to_hf_dir` wrote and the most host memory its arrays held at once."""
  return (f"dequantized {info['tensors']} GGUF tensors ({info['tensor_bytes']:,} float32 bytes) into "
          f"{info['shards']} safetensors file(s), tensor by tensor; the host held at most {info['host_peak_bytes']:,} "
          f"bytes at once ({info['host_peak_tensor']})")
