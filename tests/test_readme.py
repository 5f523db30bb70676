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
  """A newcomer's page: at most 170 lines (150 of issue 50, and issue 60's runnable "Use the layer in your own
  model"); detail goes to docs/."""
  assert len(README.splitlines()) <= 170, len(README.splitlines())
