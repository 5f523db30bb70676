"""sinkjax: sink-aware attention in JAX/Flax."""
import importlib.util
import os

__version__ = "0.1.0"


def _quiet_libtpu_without_tpu() -> None:
  """Where libtpu is installed (the `tpu` extra) but this host has no TPU chip, JAX still starts libtpu,
  which asks the GCE metadata server for the slice's accelerator type and worker hostnames and prints ~5 lines of
  errors when there is none. Naming a one-host slice (env defaults only: a value the user set is kept) silences it;
  compile-only TPU devices (`jax.experimental.topologies`, `sinkjax.compile`) are unaffected. Runs before any JAX
  backend starts (libtpu reads these variables when it starts)."""
  if "TPU_WORKER_HOSTNAMES" in os.environ or "TPU_ACCELERATOR_TYPE" in os.environ:
    return
  if importlib.util.find_spec("libtpu") is None:
    return
  from jax._src import hardware_utils  # pylint: disable=import-outside-toplevel
  if hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0:
    os.environ["TPU_WORKER_HOSTNAMES"] = "localhost"
    os.environ["TPU_ACCELERATOR_TYPE"] = "v5litepod-1"


_quiet_libtpu_without_tpu()
