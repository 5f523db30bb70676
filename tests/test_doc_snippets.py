"""Every fenced ```python block of README.md and docs/*.md runs as written, so that no snippet drifts from the code.

Each block runs alone, in a fresh namespace (what a reader copies is one block: it must bring its own imports), in
this process, with the working directory a temporary one that holds `runs/tiny`: a run directory of configs/tiny.yaml
at test shapes (an untrained model, saved as the converters save one) for the blocks that restore the README's main
job. Two markers, an HTML comment on the line right before the fence, which a rendered page does not show:
- `<!-- not run: REASON -->`: the block is skipped, with its reason (a model download, a TPU slice, ...);
- `<!-- setup: CODE -->`: CODE runs first in the block's namespace (the caller's arrays a reference block leaves
  out, e.g. `q = k = v = ...`).
An unmarked block that raises fails, naming its file and line. The layer-kind registries are restored after each
block (docs/KINDS.md registers a kind of its own).
"""
import contextlib
import os
import pathlib
import re

import pytest

from tests.helpers import ROOT, TINY

NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->$")
SETUP = re.compile(r"^<!--\s*setup:\s*(.+?)\s*-->$")


def python_blocks(path: pathlib.Path):
  """(line of the opening fence, code, marker line before it) for each ```python block of a Markdown file."""
  lines = path.read_text().splitlines()
  i = 0
  while i < len(lines):
    if lines[i].strip() == "```python":
      indent = len(lines[i]) - len(lines[i].lstrip())
      end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
      code = "\n".join(line[indent:] for line in lines[i + 1:end])
      yield i + 1, code, lines[i - 1].strip() if i else ""
      i = end
    i += 1


def _pages():
  return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


BLOCKS = [(page, line, code, marker) for page in _pages() for line, code, marker in python_blocks(page)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A directory holding runs/tiny (configs/tiny.yaml at test shapes, untrained, at step 0), the cwd of every block."""
  from flax import nnx
  from sinkjax.config import load_config
  from sinkjax.model import Transformer
  from sinkjax.run import save_params_run
  root = tmp_path_factory.mktemp("doc_snippets")
  cfg = load_config(TINY, ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=2",
                           "model.head_dim=16", "model.vocab_size=257", "run.dir=runs/tiny"])
  save_params_run(root / "runs" / "tiny", cfg, Transformer(cfg.model, rngs=nnx.Rngs(0)))
  return root


@contextlib.contextmanager
def _registries_kept():
  from sinkjax import kinds
  saved = dict(kinds.ATTENTION), dict(kinds.MIXERS)
  try:
    yield
  finally:
    for table, before in zip((kinds.ATTENTION, kinds.MIXERS), saved):
      table.clear()
      table.update(before)


def run_block(code: str, marker: str, where: str):
  """Runs one block (after its setup marker's code) in a fresh namespace; an exception names `where`."""
  setup = SETUP.match(marker)
  source = (setup.group(1) + "\n" if setup else "") + code
  try:
    exec(compile(source, where, "exec"), {"__name__": "__doc_snippet__"})     # pylint: disable=exec-used
  except Exception as e:     # pylint: disable=broad-except
    raise AssertionError(f"the ```python block at {where} raised {type(e).__name__}: {e} (fix the block, or mark it "
                         f"<!-- not run: REASON --> on the line before its fence)") from e


@pytest.mark.parametrize("page,line,code,marker", BLOCKS,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _, _ in BLOCKS])
def test_the_python_blocks_of_the_docs_run(page, line, code, marker, workdir, capsys):
  skip = NOT_RUN.match(marker)
  if skip:
    pytest.skip(f"marked not runnable: {skip.group(1)}")
  cwd = os.getcwd()
  os.chdir(workdir)
  try:
    with _registries_kept():
      run_block(code, marker, f"{page.relative_to(ROOT)}:{line}")
  finally:
    os.chdir(cwd)


def test_the_runner_fails_on_a_block_that_raises_and_honours_its_markers(tmp_path):
  """The harness itself: a raising unmarked block fails naming its line; a setup marker's code runs first; a block
  marked not runnable is read as such; indented fences (in lists) are found."""
  page = tmp_path / "page.md"
  page.write_text("text\n\n```python\nx = 1\n```\n\n<!-- setup: y = 2 -->\n```python\nassert y == 2\n```\n\n"
                  "<!-- not run: needs a TPU slice -->\n```python\nraise SystemError\n```\n\n"
                  "- a list\n  ```python\n  z = undefined_name\n  ```\n")
  blocks = list(python_blocks(page))
  assert [(line, code) for line, code, _ in blocks] == [(3, "x = 1"), (8, "assert y == 2"), (13, "raise SystemError"),
                                                         (18, "z = undefined_name")]
  run_block(blocks[0][1], blocks[0][2], "page.md:3")
  run_block(blocks[1][1], blocks[1][2], "page.md:8")
  assert NOT_RUN.match(blocks[2][2]).group(1) == "needs a TPU slice"
  with pytest.raises(AssertionError, match=r"page.md:18 raised NameError"):
    run_block(blocks[3][1], blocks[3][2], "page.md:18")
  assert len(BLOCKS) >= 5 and any(p.name == "README.md" for p, *_ in BLOCKS)
