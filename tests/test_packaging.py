"""The package carries what it runs: the repository's one copy of the configs and study files (the top-level configs/)
goes into the wheel as sinkjax/configs/, and a bare name (`--config tiny`, `paper/d20_sink_aux`, the study
`trigger_quick`) resolves to them from any directory, from a checkout and from an installed wheel alike; a path still
means a file. A YAML syntax error names the file, its line and column in one line."""
import importlib.util
import os
import pathlib
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile

import pytest

from sinkjax import config as config_lib
from sinkjax.errors import ConfigError
from sinkjax.experiments import runner
from tests.helpers import ROOT


def _repo_configs() -> list[str]:
  """Every YAML file of the repository's configs/, as its path under it (`paper/d20_sink_aux.yaml`)."""
  return sorted(p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  """The wheel built from a copy of what a clone has (pyproject.toml, README.md, sinkjax/, configs/): with this
  environment's setuptools where it has one (no download), else in pip's isolated build environment."""
  isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
  src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, src / name)
  for name in ("sinkjax", "configs"):
    shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", *isolation, "-q",
                      "-w", str(out)], capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  (whl,) = out.glob("sinkjax-*.whl")
  return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> pathlib.Path:
  """A fresh venv with the wheel installed (--no-deps) and this environment's packages visible through a .pth file
  (its dependencies; the .pth files there are not run, so an editable install of sinkjax there stays out): the
  checkout is not on its path. Returns its python."""
  root = tmp_path_factory.mktemp("venv")
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=300)
  python = root / "bin" / "python"
  purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
  deps = [p for p in site.getsitepackages() if pathlib.Path(p).resolve() != ROOT.resolve()]
  pathlib.Path(purelib, "zz_deps.pth").write_text("\n".join(deps) + "\n")
  # --ignore-installed: the editable sinkjax of this environment (seen through the .pth, or PYTHONPATH's checkout)
  # is neither "already installed" there nor uninstalled
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                      "--ignore-installed", "-q", str(wheel)], capture_output=True, text=True, timeout=600, env=env)
  assert r.returncode == 0, r.stderr[-3000:]
  return python


def _run_installed(python, args, cwd, timeout=600) -> subprocess.CompletedProcess:
  """`python ARGS` in `cwd`, with no PYTHONPATH (the checkout out of the path)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_carries_every_config_and_study_file_once(wheel):
  names = zipfile.ZipFile(wheel).namelist()
  packaged = sorted(n.removeprefix("sinkjax/configs/") for n in names if n.startswith("sinkjax/configs/"))
  assert packaged == _repo_configs()
  assert "sinkjax/target_configs/h100_sxm.txtpb" in names
  assert not (ROOT / "sinkjax" / "configs").exists()      # the repository keeps one copy: the top-level configs/


def test_pyprojects_package_list_is_every_package_of_the_tree():
  """pyproject.toml lists the packages by name (so that configs/ maps in): a new subpackage must be listed too."""
  listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
  tree = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "sinkjax").rglob("__init__.py")}
  tree |= {"sinkjax.target_configs"} | {"sinkjax.configs." + d.name for d in (ROOT / "configs").iterdir() if d.is_dir()}
  assert listed == tree | {"sinkjax.configs"}


def test_bare_names_resolve_to_the_packaged_configs_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert config_lib.configs_dir().resolve() == (ROOT / "configs").resolve()    # a checkout: its own configs/
  for name in ("tiny", "tiny.yaml", "configs/tiny.yaml"):
    assert config_lib.find_packaged(name) == config_lib.configs_dir() / "tiny.yaml"
  want = config_lib.load_config(str(ROOT / "configs" / "paper" / "d20_sink_aux.yaml"))
  assert config_lib.load_config("paper/d20_sink_aux") == want
  assert (want.model.attention, want.model.num_layers) == ("sink", 20)
  assert config_lib.find_packaged("trigger_quick", "studies") == config_lib.configs_dir() / "studies" / "trigger_quick.yaml"
  plan = runner.load_plan("trigger_quick")
  assert plan.study.driver == "trigger" and len(plan.runs()) == 4
  assert config_lib.find_packaged("../pyproject") is None and config_lib.find_packaged("nope") is None


def test_a_path_still_means_a_file(tmp_path, monkeypatch):
  """A file of that name here wins over the packaged config; a config of one's own takes a packaged `base:` by name."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "tiny.yaml").write_text("base: tiny\ntrain: {steps: 7}\n")
  assert config_lib.find_packaged("tiny.yaml") is None
  assert config_lib.load_config("tiny.yaml").train.steps == 7
  assert config_lib.load_config("tiny").train.steps == config_lib.load_config(str(ROOT / "configs" / "tiny.yaml")).train.steps != 7
  assert config_lib.load_config("tiny.yaml").model.dtype == "float32"        # tiny's own, through base: tiny


def test_a_missing_config_or_study_lists_the_packaged_names(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError, match=r"config file tinyy does not exist: give a YAML file or a packaged config "
                                        r"by name \(base, d20, .*tiny; paper/: d20_gated_aux, .*d32_vanilla_base\)$"):
    config_lib.load_config("tinyy")
  with pytest.raises(runner.StudyError, match=r"study file trigger_quik does not exist: .* trigger, trigger_quick\)$"):
    runner.load_plan("trigger_quik")


@pytest.mark.parametrize("text, where, problem", [
    ("model:\n  dtype: float32\n train: {steps: 3}\n", ":3:2", "expected <block end>, but found '<block mapping "
                                                          "start>' (while parsing a block mapping at line 1)"),
    ("train: {steps: 3\nmodel: {}\n", ":2:6", "expected ',' or '}', but got ':' (while parsing a flow mapping at line 1)"),
])
def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path, text, where, problem):
  path = tmp_path / "bad.yaml"
  path.write_text(text)
  with pytest.raises(ConfigError) as e:
    config_lib.load_config(str(path))
  assert str(e.value) == f"config file {path}{where} is not valid YAML: {problem}"
  study = tmp_path / "study.yaml"
  study.write_text("study: {driver: trigger}\naxes: [1\n")
  with pytest.raises(ConfigError, match=rf"^study file {study}:3:1 is not valid YAML: "):
    runner.load_plan(study)


def test_the_installed_wheel_resolves_its_packaged_names_from_another_directory(venv, tmp_path):
  """Installed from the wheel, run from an empty directory: the configs are the package's own, and --help and an
  unknown name list them; `study trigger_quick --dry-run` lists its runs."""
  code = ("import sinkjax, sys; from sinkjax import config as c\n"
          "print(sinkjax.__file__); print(c.configs_dir()); print(c.load_config('paper/d20_sink_aux').model.attention)\n"
          f"import pathlib; print(any(p and pathlib.Path(p).resolve() == pathlib.Path({str(ROOT)!r}) for p in sys.path))")
  r = _run_installed(venv, ["-c", code], tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  module, configs, attention, checkout_on_path = r.stdout.split()
  site_dir = pathlib.Path(module).parent
  assert site_dir.is_relative_to(venv.parent.parent), module          # the wheel's sinkjax, in the venv
  assert pathlib.Path(configs) == site_dir / "configs" and attention == "sink" and checkout_on_path == "False"
  r = _run_installed(venv, ["-m", "sinkjax.train", "--help"], tmp_path)
  assert r.returncode == 0 and "tiny" in r.stdout and "d20_sink_aux" in r.stdout, r.stdout + r.stderr[-2000:]
  r = _run_installed(venv, ["-m", "sinkjax.train", "--config", "tinyy"], tmp_path)
  assert r.returncode == 1 and r.stderr.strip().endswith("d32_vanilla_base)") and len(r.stderr.splitlines()) == 1, \
      r.stderr[-3000:]
  r = _run_installed(venv, ["-m", "sinkjax.experiments.study", "trigger_quick", "--dry-run"], tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  assert [l.split(":")[0] for l in r.stdout.splitlines() if l.endswith(": to do")] == \
      ["softmax_1x1", "relu_1x1", "sink_1x1", "gated_1x1"], r.stdout
  assert sorted(os.listdir(tmp_path)) == []          # a dry run writes nothing


@pytest.mark.slow   # a tiny model's compile and 5 steps (~60 s on 2 loaded cores); the fast test above resolves the names
def test_the_installed_wheel_trains_a_packaged_config_from_another_directory(venv, tmp_path):
  r = _run_installed(venv, ["-m", "sinkjax.train", "--config", "tiny", "train.steps=5", f"run.dir={tmp_path / 'run'}"],
                     tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "done: step 5/5" in r.stdout + r.stderr
  assert (tmp_path / "run" / "checkpoints" / "5").is_dir()


def test_training_md_says_what_a_config_without_base_gets(tmp_path):
  """docs/TRAINING.md's paragraph on a config with no `base:`: every `section.key: value` it names is what such a
  config loads with (the defaults of sinkjax/config.py, the same on every machine)."""
  import re  # pylint: disable=import-outside-toplevel
  text = (ROOT / "docs" / "TRAINING.md").read_text()
  para = re.search(r"A config with no `base:`.*?\n\n", text, re.S).group(0)
  claims = re.findall(r"`(\w+)\.(\w+): ([^`]+)`", para)
  assert {(s, k) for s, k, _ in claims} >= {("model", "dtype"), ("train", "steps"), ("run", "dir")}, claims
  path = tmp_path / "mine.yaml"
  path.write_text("loss: {aux_weight: 0.0}\n")                  # a config of one's own, no base:
  cfg = config_lib.load_config(str(path))
  for section, key, value in claims:
    if (section, key) != ("model", "dtype") or value == "bfloat16":       # "write model.dtype: float32" is advice
      assert str(getattr(getattr(cfg, section), key)) == value, (section, key, value)
  m, d = cfg.model, cfg.data
  assert f"{m.num_layers}-layer × {m.num_heads}-head × {m.d_model} {m.attention}" in para
  assert f"{d.seq_len}-byte `{d.packing}` rows, {cfg.train.batch_size} rows per step" in para
  assert (d.source, d.tokenizer) == ("default", "bytes") and "embedded corpus with the\nbytes tokenizer" in para
