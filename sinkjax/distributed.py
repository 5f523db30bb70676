"""Multi-host start-up: `jax.distributed.initialize()` when the process is one of several.

Called first thing by the command lines. It initializes when the environment says this is a multi-process job:
a Cloud TPU pod slice (more than one worker host), a SLURM job with several tasks, an explicit coordinator
(`JAX_COORDINATOR_ADDRESS`), or `SINKJAX_DISTRIBUTED=1` (set by launch/slurm_gpu.sh). JAX then auto-detects the
coordinator, process count and process id from that environment. Single-process runs are left alone.
"""
from __future__ import annotations

import os

import jax


def is_multiprocess_env(env=None) -> bool:
  env = os.environ if env is None else env
  if env.get("SINKJAX_DISTRIBUTED") == "1" or env.get("JAX_COORDINATOR_ADDRESS"):
    return True
  if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
    return True
  hosts = env.get("TPU_WORKER_HOSTNAMES", "")
  return len([h for h in hosts.split(",") if h]) > 1


def maybe_initialize(env=None) -> bool:
  """Initializes jax.distributed in a multi-process environment; returns whether it did."""
  if not is_multiprocess_env(env):
    return False
  if jax.distributed.is_initialized():
    return True
  jax.distributed.initialize()
  return True
