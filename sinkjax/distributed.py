"""Several processes: `jax.distributed.initialize()` when the process is one of several, and their agreement.

Called first thing by the training command line. It initializes when the environment says this is a multi-process
job, from explicit settings or from the cluster:

  SINKJAX_COORDINATOR     host:port of process 0's coordination service (e.g. 127.0.0.1:12345)
  SINKJAX_NUM_PROCESSES   how many processes the job has
  SINKJAX_PROCESS_ID      this process' index, 0 .. SINKJAX_NUM_PROCESSES - 1
  SINKJAX_LAUNCHER_PID    (optional) the launcher's pid: when it disappears, this process stops (no orphans)

(set by launch/local.sh; all three or none), or a Cloud TPU pod slice (more than one worker host), a SLURM job with
several tasks, an explicit `JAX_COORDINATOR_ADDRESS`, or `SINKJAX_DISTRIBUTED=1` (set by launch/slurm_gpu.sh), from
which JAX detects coordinator, process count and process id itself. Single-process runs are left alone.

Before initializing, the gloo implementation of cross-process collectives is selected for CPU devices (so several
CPU processes compute together, the code path of a pod minus the network), and JAX's own preemption service is
switched off: SIGTERM / SIGINT belong to the training loop, which agrees on them across processes (`StopVote`).
"""
from __future__ import annotations

import os
import signal
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sinkjax.config import ConfigError

ENV_COORDINATOR = "SINKJAX_COORDINATOR"
ENV_NUM_PROCESSES = "SINKJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SINKJAX_PROCESS_ID"
ENV_LAUNCHER_PID = "SINKJAX_LAUNCHER_PID"
# After the launcher is gone, how long the SIGTERM-started stop may take before the process ends itself.
ORPHAN_GRACE_S = 120.0


class DistributedError(ConfigError):
  """The multi-process settings are wrong or the processes could not join; the message says what to change."""


def explicit_settings(env=None) -> dict | None:
  """{coordinator_address, num_processes, process_id} from the SINKJAX_* variables, or None when none is set."""
  env = os.environ if env is None else env
  names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
  given = {n: env.get(n, "").strip() for n in names}
  if not any(given.values()):
    return None
  missing = [n for n, v in given.items() if not v]
  if missing:
    raise DistributedError(f"{', '.join(missing)} not set: set all of {', '.join(names)} (or none)")
  host, _, port = given[ENV_COORDINATOR].rpartition(":")
  if not host or not port.isdigit():
    raise DistributedError(f"{ENV_COORDINATOR}={given[ENV_COORDINATOR]!r} must be host:port, e.g. 127.0.0.1:12345")
  try:
    num, pid = int(given[ENV_NUM_PROCESSES]), int(given[ENV_PROCESS_ID])
  except ValueError:
    raise DistributedError(f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be integers, got "
                           f"{given[ENV_NUM_PROCESSES]!r} and {given[ENV_PROCESS_ID]!r}") from None
  if num < 1 or not 0 <= pid < num:
    raise DistributedError(f"{ENV_PROCESS_ID}={pid} must be in [0, {ENV_NUM_PROCESSES}={num}) and {num} >= 1")
  return {"coordinator_address": given[ENV_COORDINATOR], "num_processes": num, "process_id": pid}


def is_multiprocess_env(env=None) -> bool:
  env = os.environ if env is None else env
  settings = explicit_settings(env)
  if settings is not None:
    return settings["num_processes"] > 1
  if env.get("SINKJAX_DISTRIBUTED") == "1" or env.get("JAX_COORDINATOR_ADDRESS"):
    return True
  if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
    return True
  hosts = env.get("TPU_WORKER_HOSTNAMES", "")
  return len([h for h in hosts.split(",") if h]) > 1


def maybe_initialize(env=None) -> bool:
  """Initializes jax.distributed in a multi-process environment; returns whether it did.

  Raises DistributedError (one line) for bad SINKJAX_* settings or when the processes cannot join.
  """
  env = os.environ if env is None else env
  if not is_multiprocess_env(env):
    return False
  if jax.distributed.is_initialized():
    return True
  settings = explicit_settings(env) or {}
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_enable_preemption_service", False)
  try:
    jax.distributed.initialize(**settings)
  except (RuntimeError, ValueError) as e:
    where = settings.get("coordinator_address", "the coordinator the cluster environment names")
    raise DistributedError(f"could not join the other processes at {where}: {' '.join(str(e).split())[:300]}") \
        from None
  launcher = env.get(ENV_LAUNCHER_PID, "")
  if launcher.isdigit() and int(launcher) == os.getppid():
    watch_launcher(int(launcher))
  return True


def watch_launcher(launcher_pid: int, *, poll_s: float = 1.0, grace_s: float = ORPHAN_GRACE_S) -> threading.Thread:
  """Stops this process when its launcher (its parent) is gone, e.g. killed with SIGKILL: SIGTERM to itself (the
  loop saves and stops, agreed with the other processes, which see the same), then a hard exit after `grace_s`."""

  def watch():
    while os.getppid() == launcher_pid:
      time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(1)   # pylint: disable=protected-access

  thread = threading.Thread(target=watch, name="sinkjax-launcher-watch", daemon=True)
  thread.start()
  return thread


class SignalFlag:
  """Turns SIGTERM/SIGINT into a flag the training loop checks after each step and casts in `StopVote` (a second
  signal kills as usual)."""

  def __init__(self):
    self.signum = None
    self._old = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():   # signal handlers only work there
      for s in (signal.SIGTERM, signal.SIGINT):
        self._old[s] = signal.signal(s, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.signum = signum
    for s, h in self._old.items():
      signal.signal(s, h)

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


class StopVote:
  """Agreement on stopping: every process casts its local SIGTERM / SIGINT flag, and all read the same result, the
  largest signal number any process has seen (None when none has). So all processes save the same step and stop
  together, whichever of them the signal reached.

  With several processes the vote is a max over a vector with one element per device of `mesh`, each process
  filling its devices' elements, jitted like any global computation. Cast it before dispatching a step and read it
  after: it then waits only for the previous step, which the loop waits for anyway. One process: no device work.
  """

  def __init__(self, mesh):
    self._multi = jax.process_count() > 1
    if self._multi:
      self._sharding = NamedSharding(mesh, P(mesh.axis_names))
      self._max = jax.jit(lambda v: v.max(), out_shardings=NamedSharding(mesh, P()))
      self._local = len(mesh.local_devices)

  def cast(self, signum: int | None):
    """Dispatches this process' vote (its signal number, or None) and returns the pending result."""
    if not self._multi:
      return signum or 0
    local = np.full((self._local,), signum or 0, np.int32)
    return self._max(jax.make_array_from_process_local_data(self._sharding, local))

  @staticmethod
  def result(vote) -> int | None:
    """The agreed signal number of a cast vote, or None: the same in every process."""
    return int(vote) or None


def barrier(name: str) -> None:
  """Waits until every process has reached the barrier `name` (nothing to wait for with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(name)


def to_host(tree):
  """numpy copies of the arrays of `tree`, the same in every process: an array this process holds only part of
  (split over the devices of several processes) is gathered from the others first, so every process must call this
  at the same point."""
  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(one, tree)


def max_over_processes(value: int) -> int:
  """The largest of one integer each process holds (every process must call this at the same point); itself in a
  single process. `to_host` would not do: an array made from a host value is this process' own, fully addressable."""
  if jax.process_count() == 1:
    return int(value)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return int(np.max(multihost_utils.process_allgather(np.asarray([value], np.int64))))
