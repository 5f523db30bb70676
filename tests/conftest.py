"""Test session set-up: 8 simulated CPU devices (for the sharding tests) before JAX initializes, XLA's cheaper
compile mode, and one persistent compilation cache per test worker."""
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")
# The suite's time is mostly XLA:CPU compiling small programs that then run for milliseconds: JAX's "disable most
# optimizations" (LLVM at -O0, no expensive passes; the HLO passes still run, so programs and numerics keep their
# form) cuts a test's compile time by about a quarter. Inherited by the commands the tests start. It moves float32
# results by rounding (no fused multiply-adds): a test that compares at that level uses the fixture
# `optimized_compile`; SINKJAX_TEST_OPTIMIZE=1 compiles the whole suite as users do.
if os.environ.get("SINKJAX_TEST_OPTIMIZE", "0") != "1":
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

_CACHE_ENV = {}


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
  """One persistent JAX compilation cache per test worker, shared by every test it runs and every command those tests
  start (they inherit the environment): the tests compile the same tiny programs many times over, in process and in
  subprocesses, and a hit skips XLA (a 1-layer train step is ~2 s of CPU compile). It lives in the worker's base
  temporary directory, which pytest prunes (the last three runs are kept).
  - One per worker, not one for the run: JAX writes an entry with a plain write, so a reader in another process can
    meet a half-written file; a worker's commands run while it waits for them, so within a worker that is rare.
  - No size limit: with one, JAX takes a file lock and sums the sizes of every entry on each write (quadratic in the
    entries: a run with one shared, limited cache took longer than one without a cache).
  - Programs that compile in under 0.2 s are not written: thousands of them, each as cheap to compile as to read."""
  if os.environ.get("SINKJAX_TEST_COMPILE_CACHE", "1") == "0":
    return
  path = config._tmp_path_factory.getbasetemp() / "jax_cache"
  path.mkdir(exist_ok=True)
  settings = {"jax_compilation_cache_dir": str(path), "jax_persistent_cache_min_compile_time_secs": 0.2,
              "jax_persistent_cache_min_entry_size_bytes": 0}
  _CACHE_ENV.update({name.upper(): str(value) for name, value in settings.items()})
  os.environ.update(_CACHE_ENV)
  import jax
  for name, value in settings.items():
    jax.config.update(name, value)


# The files whose tests take longest, longest first (CPU-seconds of a default run on 2 cores, docs/PERF.md, "Start-up
# and the test suite"). `--dist loadfile` hands each worker one file at a time in collection order (`--no-loadscope-reorder`;
# xdist's own reorder counts tests, not seconds, and sent test_real_model's ten long tests last): starting with these
# keeps a long file from running alone at the end while the other worker idles.
LONGEST_FIRST = ("test_train", "test_real_model", "test_generate", "test_kernels", "test_cache_policy", "test_eval",
                 "test_multihost", "test_scale", "test_lm_eval", "test_finetune", "test_pallas_tpu", "test_paper",
                 "test_trigger", "test_qwen3_next", "test_nanochat", "test_analysis", "test_deltanet")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  position = {id(item): i for i, item in enumerate(items)}
  items.sort(key=lambda item: (rank.get(item.path.stem, len(rank)), position[id(item)]))


@pytest.fixture(scope="session")
def compile_cache():
  """The run's compilation cache settings, as environment variables for a command (already in os.environ)."""
  return dict(_CACHE_ENV)


@pytest.fixture
def optimized_compile():
  """The test's programs compiled with every optimization, as users' are (see JAX_DISABLE_MOST_OPTIMIZATIONS above):
  for comparisons at float32 rounding (against transformers' logits, a scanned against an unrolled step)."""
  import jax
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)
