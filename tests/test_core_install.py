"""The core install (pyproject.toml's dependencies: jax, flax, optax, numpy, pyyaml) is the layer and the kernels: they
import nothing of the `train` extra (data, checkpoints, plots, logs), and a command run without that extra says in
one line which extra to install instead of a traceback."""
import json
import subprocess
import sys
import tomllib

import pytest

from sinkjax import errors
from tests.helpers import ROOT

TRAIN_EXTRA_MODULES = ("grain", "tensorflow_datasets", "orbax", "matplotlib", "tensorboardX", "tqdm")


def _python(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_layer_and_kernels_import_nothing_of_the_train_extra():
  r = _python("import json, sys\nimport sinkjax.layers, sinkjax.kernels, sinkjax.balance\n"
              "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
  assert r.returncode == 0, r.stderr[-3000:]
  loaded = set(json.loads(r.stdout))
  assert "flax" in loaded and not loaded & set(TRAIN_EXTRA_MODULES), sorted(loaded & set(TRAIN_EXTRA_MODULES))


def test_the_extra_the_commands_check_is_pyprojects():
  """sinkjax.errors.EXTRAS['train'] names a module of each distribution of pyproject's `train` extra, and the core
  dependencies hold none of them."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  dist = {"grain": "grain", "orbax.checkpoint": "orbax-checkpoint", "tensorflow_datasets": "tensorflow-datasets",
          "matplotlib": "matplotlib", "tensorboardX": "tensorboardX", "tqdm": "tqdm"}
  extra = {r.split(">")[0].split("=")[0].strip() for r in project["optional-dependencies"]["train"]}
  assert {dist[m] for m in errors.EXTRAS["train"]} == extra - {"importlib_resources"}
  core = {r.split(">")[0].split("=")[0].strip() for r in project["dependencies"]}
  assert core == {"jax", "flax", "optax", "numpy", "pyyaml"}


@pytest.mark.parametrize("module", ["sinkjax.train", "sinkjax.eval", "sinkjax.generate", "sinkjax.convert.hf",
                                    "sinkjax.convert.nanochat", "sinkjax.experiments.study",
                                    "sinkjax.bench.data", "sinkjax.bench.train"])
def test_a_command_without_the_train_extra_names_it_in_one_line(module):
  """`python -m MODULE` with grain hidden (as an install without the extra lacks it): status 1 and one line."""
  r = _python("import runpy, sys\nsys.modules['grain'] = None         # what `import grain` finds without the extra\n"
              f"sys.argv = [{module!r}, '--help']\nrunpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert r.returncode == 1 and lines == [f"{module}: error: grain not installed; pip install 'sinkjax[train]'"], \
      (r.returncode, r.stderr[-3000:])
