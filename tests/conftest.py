"""Test session set-up: 8 simulated CPU devices (for the sharding tests) before JAX initializes."""
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """A persistent compilation cache for this module (and its subprocesses), removed afterwards."""
  import jax
  path = str(tmp_path_factory.mktemp("jax_cache"))
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  old = {n: getattr(jax.config, n) for n in names}
  for n, v in zip(names, (path, 0, 0)):
    jax.config.update(n, v)
  yield {"JAX_COMPILATION_CACHE_DIR": path, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  for n, v in old.items():
    jax.config.update(n, v)
