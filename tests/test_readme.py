"""The README as a newcomer reads it: its test command is the one CI runs, and every script it runs directly can be
run (its execute bit is set in git, which a test that calls scripts through `bash` would never notice)."""
import importlib
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _code_lines():
  """The command lines of the README's ```bash blocks (comments and blank lines dropped)."""
  for block in re.findall(r"```bash\n(.*?)```", README, re.S):
    for line in block.splitlines():
      line = line.split("  #")[0].strip()
      if line and not line.startswith("#"):
        yield line


def test_the_readme_test_command_is_what_ci_runs():
  two = README[README.index("## The two commands"):]
  block = re.search(r"```bash\n(.*?)```", two, re.S).group(1)
  test_cmd = [l for l in block.splitlines() if "pytest" in l]
  assert len(test_cmd) == 1, block
  ci = (ROOT / ".ci" / "run").read_text()
  ci_cmd = [l.strip() for l in ci.splitlines() if "pytest" in l and not l.lstrip().startswith("#")]
  assert ci_cmd == [test_cmd[0] + ' "$@"'], (ci_cmd, test_cmd)


def _extra(name, extras):
  """The requirements an extra brings, the project's own extras (`sinkjax[train]`) expanded."""
  out = []
  for req in extras[name]:
    own = re.match(r"sinkjax\[([\w,-]+)\]", req)
    out += [r for e in own.group(1).split(",") for r in _extra(e, extras)] if own else [req]
  return out


def test_the_test_extra_leaves_libtpu_out_and_ci_adds_it():
  """libtpu in an environment makes plain `import jax; jax.numpy.ones(1)` print libtpu's errors on a machine without a
  TPU: the README's test install brings none (nor does what it pulls in of ours), and .ci/run adds the `tpu` extra
  before the README's command so the TPU compile tests still run in CI."""
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  test = _extra("test", extras)
  assert not [r for r in test if "tpu" in r.lower()], test
  assert any(r.startswith("jax[tpu]") for r in _extra("tpu", extras)), extras["tpu"]
  ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines() if not l.lstrip().startswith("#")]
  add = [i for i, l in enumerate(ci) if l.startswith('python -m pip install -e ".[test,tpu]"')]
  readme = [i for i, l in enumerate(ci) if "pytest" in l]
  assert len(add) == 1 and len(readme) == 1 and add[0] < readme[0], (add, readme)
  assert '-e ".[test,tpu]"' in README


def _git_modes():
  try:
    out = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return None
  return {line.split("\t")[1]: line.split()[0] for line in out.splitlines() if "\t" in line}


def test_scripts_the_readme_runs_directly_are_executable():
  scripts = {shlex.split(l)[0] for l in _code_lines() if re.match(r"^(\./)?[\w.-]+/[\w./-]+\.sh\b|^\.ci/run", l)}
  scripts.add(".ci/run")
  assert "launch/local.sh" in scripts and "launch/tpu_vm.sh" in scripts, scripts
  modes = _git_modes()
  for script in sorted(scripts):
    path = script.removeprefix("./")
    assert (ROOT / path).is_file(), f"the README runs {script}, which does not exist"
    if modes is None:
      pytest.skip("not a git checkout: only the files' own modes can be read")
    assert modes.get(path) == "100755", f"{path} has mode {modes.get(path)} in git: run `git update-index " \
                                         f"--chmod=+x {path}`"
    assert os.access(ROOT / path, os.X_OK), path


def test_every_module_command_in_the_readme_exists_with_its_flags(capsys):
  """Each `python -m sinkjax...` line of the README names a command whose --help lists every flag the line uses (the
  commands themselves ran as written on a fresh clone when the README was last rewritten; this keeps them honest).
  Each module's main(argv), which its `python -m` block runs, is called in this process: no interpreter start-up per
  command."""
  calls = {}
  for line in _code_lines():
    for part in line.split("&&"):
      words = shlex.split(part)
      if len(words) > 2 and words[:2] == ["python", "-m"] and words[2].startswith("sinkjax."):
        calls.setdefault(words[2], set()).update(w.split("=")[0] for w in words[3:] if w.startswith("--"))
  assert "sinkjax.train" in calls and "sinkjax.eval" in calls, calls
  for module, flags in sorted(calls.items()):
    main = importlib.import_module(module).main
    assert "sys.exit(main())" in pathlib.Path(sys.modules[module].__file__).read_text(), module
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
      main(["--help"])
    out = capsys.readouterr()
    assert e.value.code in (0, None), (module, out.err[-500:])
    missing = [f for f in flags if f not in out.out]
    assert not missing, f"README runs {module} with {missing}, which its --help does not list"


def test_the_readme_stays_short():
  """A newcomer's page: at most 172 lines (150 of issue 50, issue 60's runnable "Use the layer in your own model" and
  issue 66's packed documents and their loss mask in it); detail goes to docs/."""
  assert len(README.splitlines()) <= 172, len(README.splitlines())


def _extra_requirements(extra: str, extras: dict) -> set[str]:
  """The distributions an extra of pyproject.toml brings, through the extras it names (`sinkjax[train]`)."""
  out = set()
  for req in extras[extra]:
    name = re.split(r"[<>=;\[ ]", req, maxsplit=1)[0].strip()
    if name == "sinkjax":
      for inner in re.search(r"\[(.*?)\]", req).group(1).split(","):
        out |= _extra_requirements(inner.strip(), extras)
    else:
      out.add(name)
  return out


def test_the_tokenizer_line_after_the_main_job_runs_with_the_first_commands_install_or_names_its_extra(tmp_path):
  """The README's tokenizer line, run as written (cwd: an empty directory) with the modules of the `hf` extra that the
  first command's `[train]` lacks hidden, unless the line installs an extra that brings them: a line that needs
  more than `[train]` names its extra (issue 66: it failed with `[train]` alone)."""
  import tomllib  # pylint: disable=import-outside-toplevel
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  part = README[README.index("## After the main job"):]
  block = re.search(r"```bash\n(.*?)```", part, re.S).group(1)
  (line,) = [l.split("  #")[0].strip() for l in block.splitlines() if "sinkjax.data.tokenizer" in l]
  *installs, command = [shlex.split(p) for p in line.split("&&")]
  named = {e for words in installs for w in words for e in re.findall(r"\[(.*?)\]", w)}
  assert named <= set(extras), named
  brought = _extra_requirements("train", extras).union(*(_extra_requirements(e, extras) for e in named))
  hidden = sorted(_extra_requirements("hf", extras) - brought)
  assert command[:3] == ["python", "-m", "sinkjax.data.tokenizer"], command
  code = (f"import runpy, sys\nfor m in {hidden!r}: sys.modules[m] = None   # not installed with [train] alone\n"
          f"sys.argv = {command[2:]!r}\nrunpy.run_module({command[2]!r}, run_name='__main__', alter_sys=True)")
  r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, (hidden, r.stderr[-2000:])
  out = pathlib.Path(tmp_path, command[command.index("--out") + 1])
  assert (out / "tokenizer.json").is_file() or any(out.iterdir()), sorted(os.listdir(tmp_path))


def test_the_readme_loss_mask_for_packed_documents_is_the_document_packings():
  """The loss mask of "Use the layer in your own model", evaluated on a packed row of three documents and padding,
  is the one sinkjax's `document` packing gives that row (`sinkjax.data.pipeline.row_features`)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from sinkjax.data.pipeline import row_features  # pylint: disable=import-outside-toplevel
  part = README[README.index("## Use the layer in your own model"):]
  expr = re.search(r"^\s*mask = (.+?)\s+#", part, re.M).group(1)
  segs = np.array([1, 1, 1, 2, 2, 3, 3, 3, 0, 0])
  want = row_features(np.arange(10), segs, np.zeros(10, int), np.ones(10, int))["loss_mask"]
  got = np.asarray(eval(expr, {"seg": segs[None]}))[0]  # pylint: disable=eval-used
  np.testing.assert_array_equal(got.astype(np.float32), want)
  assert want.tolist() == [1, 1, 0, 1, 0, 1, 1, 0, 0]      # by hand: no target across a boundary or from padding
