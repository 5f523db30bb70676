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


# CI's two legs. .ci/run runs the README's test command on Python 3.12 with the newest jax ("py312": tokamax's tests)
# and on Python 3.11 with jax 0.10.2 ("py311": the torch / transformers / nanochat oracles), and tells the tests which
# leg they are on (SINKJAX_CI_LEG). Everywhere else (SINKJAX_CI_LEG unset: a contributor's one Python) every test
# runs. In CI:
# - ONE_LEG: checks that give the same verdict on either leg run on the leg named: they exercise nothing that differs
#   between the legs' stacks (documents and reports checked as text, numpy and scipy hand counts, command-line
#   parsing, shell scripts, the study runner's bookkeeping on toy runs).
# - DEALT: a parametrized test whose cases take one path each through the same code (a variant, a size, a setting)
#   has its cases dealt between the legs in DEAL_ORDER: each leg runs the test on some of its cases, and every case
#   runs once. Only tests that run on both legs (no torch, tokamax or libtpu) and no kernel's own
#   tests (Pallas, Mosaic, cuDNN lowerings differ between jax versions): those run every case on both legs.
# Keys: a test file's stem, or "stem::test_function" (without the parameters).
CI_LEGS = ("py312", "py311")
# How a dealt test's cases go round the legs: the first to py312, the second to py311, the third to py312, and again.
# A test of two or more cases runs on both legs; py312 takes two of every three cases, as py311 alone runs the oracle
# files (torch, transformers, nanochat, lm-eval), so the two legs take about as long.
DEAL_ORDER = ("py312", "py311", "py312")
ONE_LEG = {
  # documents, reports and committed results checked as text, with numpy and scipy
  "test_readme": "py312", "test_docs_reference": "py312", "test_results_docs": "py312",
  "test_heads_real_docs": "py312", "test_streaming_real_docs": "py312", "test_heads_real": "py312",
  "test_paper_report_runs": "py312", "test_stats": "py312", "test_far_context_docs": "py312",
  # the import graph read with ast; shell scripts and their dry runs; command-line options; toy studies and a
  # stand-in trainer; downloads from a local HTTP server; SFT records
  "test_imports": "py312", "test_launch": "py312", "test_options": "py312", "test_runner": "py312",
  "test_paper_tpu": "py312", "test_fineweb": "py312", "test_sft_corpus": "py312",
  # the study command's bookkeeping end to end (skip what finished, --report-only, a dose study reusing the grid's
  # run): its 2-step trainings and evaluations are sinkjax.train's and paper's, tested in process on both legs. On
  # py311, whose leg has the time (a clean-clone .ci/run at 5ae962d: py312 581 s, py311 524 s, this test 32 s)
  "test_paper::test_grid_runner_writes_every_artefact_and_a_rerun_skips_finished_runs": "py311",
  "test_paper::test_report_write_regenerates_the_committed_reports": "py312",
  # configs/tiny.yaml as a command, then its user errors: the loop, the run directory's files and the checkpoints are
  # each tested in process on both legs (test_train), the config errors on py312 (test_config, below), and
  # two-process commands run on both
  "test_train::test_cli_smoke_and_user_errors": "py312",
  # launch/gpu_measure.sh's stages against a stand-in Python and the side by side's result files (nanochat's runner
  # needs torch: the torch leg); the wheel's contents and its install into a venv; the tokenizer command (tokenizers,
  # tiktoken); W&B's offline records against metrics.jsonl; Fig. 4's study file writing its analysis and heatmap
  "test_side_by_side": "py312", "test_side_by_side::test_nanochat_runner_counts_flops_as_estimate_flops": "py311",
  "test_packaging": "py312", "test_tokenizer_cli": "py312", "test_wandb": "py312", "test_heads_real_analysis": "py312",
  # the studies' drivers (head pinning, the trigger maps, hybrid head masks, the far-context maps and DuoAttention's
  # gates, the passkey probe): their model calls are the layers', the cache's and the analysis' (tested on both legs);
  # what they add is the study's own arithmetic, bookkeeping and files
  "test_heads_pinning": "py312", "test_trigger": "py312", "test_head_masks": "py312", "test_far_context": "py312",
  "test_duo_attention": "py312", "test_passkey": "py312",
  # orbax-checkpoint, tensorstore, grain and the storage clients are the same versions on both legs: the checkpoint
  # failures (kill -9, a damaged newest step, a failed write) and the runs in a bucket on one; saving and exact
  # resume run on both (test_train, test_data, test_scale's device-count move)
  "test_scale::test_kill_9_resumes_from_the_last_complete_checkpoint": "py312",
  "test_scale::test_corrupted_latest_checkpoint_falls_back_with_a_warning": "py312",
  "test_scale::test_failed_checkpoint_write_is_one_clear_line": "py312", "test_bucket": "py312",
  # the config files' keys, ranges and errors (Python and YAML); the docs' examples, run as a user of the default
  # stack runs them. (The kernel check's verdicts run on both: they run each leg's kernels, 7 s.)
  "test_config": "py312", "test_doc_snippets": "py312",
}
DEALT = (
  # the attention variants, gate settings and cache layouts against their materialized references
  "test_attention::test_vanilla_gate_is_one_minus_first_token_weight_packed",
  "test_attention::test_sink_attention_equals_sink_column_softmax",
  "test_attention::test_gated_attention_is_sdpa_times_sigmoid",
  "test_gating::test_g2_gates_each_value_before_attention", "test_gating::test_g1_gates_the_sdpa_output",
  "test_gating::test_attention_layer_matches_the_papers_gate", "test_gating::test_tiny_model_trains_one_step",
  "test_gating::test_gate_parameter_counts",
  "test_layers::test_the_layer_is_causal_and_rotates_at_document_positions",
  "test_layers::test_nnx_host_trains_and_aux_loss_balances",
  "test_model::test_forward_matches_materialized_reference", "test_model::test_paper_run_configs",
  "test_model::test_paper_param_count",
  "test_deltanet::test_chunked_equals_recurrent_in_value_and_gradient",
  "test_deltanet::test_unit_lower_inverse_is_the_inverse",
  "test_train::test_loss_finite_and_decreasing", "test_train::test_memory_settings_change_nothing_but_memory",
  "test_stream::test_vanilla_gate_on_stream_rows_is_one_minus_attention_on_the_rows_first_token",
  "test_stream::test_stream_exact_resume",
  "test_generate::test_greedy_with_cache_is_argmax_of_full_recomputation",
  "test_generate::test_blockwise_scores_equal_token_by_token",
  "test_generate::test_streaming_with_window_larger_than_text_equals_full_cache",
  "test_generate::test_streaming_decode_equals_forward_over_kept_tokens",
  "test_generate::test_sink_tokens_hand_built_positions_and_visibility",
  "test_generate_sharded::test_the_cache_is_split_over_rows_and_kv_heads",
  "test_cache_policy::test_chunks_equal_per_head_masked_attention",
  "test_cache_policy::test_mixed_policy_equals_per_head_masked_attention",
  "test_cache_policy::test_no_head_full_is_the_streaming_cache_bit_for_bit",
  "test_cache_policy::test_every_head_full_is_the_full_cache_bit_for_bit",
  "test_cache_policy::test_cache_memory_matches_the_formula",
  "test_analysis::test_diagnostics_equal_materialized_reference_and_logits_equal_the_model",
  "test_analysis::test_far_attention_is_the_weight_a_sinks_window_cache_evicts",
  "test_eval::test_recorded_forward_is_the_model_forward",
  "test_eval::test_recorded_and_zeroed_forwards_are_the_same_with_the_layers_scanned",
  "test_data::test_exact_packing_one_epoch", "test_data::test_exact_resume_mid_epoch",
  "test_data::test_second_epoch_prints_one_line_when_it_starts",
  "test_data::test_a_restored_run_encodes_text_as_training_rows_begin",
  "test_fused_loss::test_fused_matches_materialized_reference",
  # user errors, one line each
  "test_generate::test_cli_errors_are_one_line",
  "test_generate::test_the_command_line_before_the_subcommands_is_refused_with_its_new_spelling",
  "test_cache_policy::test_cli_errors_are_one_line", "test_cache_policy::test_passkey_study_errors",
  "test_core_install::test_a_command_without_the_train_extra_names_it_in_one_line",
  "test_paper::test_bad_keys_are_one_line_errors",
)


def _key(nodeid: str) -> tuple[str, str]:
  path, _, name = nodeid.partition("::")
  return path.rsplit("/", 1)[-1].removesuffix(".py"), name.split("[")[0]


def one_leg(nodeid: str):
  """The leg a test runs on in CI when it runs on one only (None: both, or dealt)."""
  stem, name = _key(nodeid)
  return ONE_LEG.get(f"{stem}::{name}", ONE_LEG.get(stem))


def ci_legs(items) -> dict:
  """{id(item): the leg it runs on in CI, or None for both}."""
  legs, seen = {}, {}
  for item in items:
    stem, name = _key(item.nodeid)
    leg = one_leg(item.nodeid)
    if leg is None and "[" in item.nodeid and (stem in DEALT or f"{stem}::{name}" in DEALT):
      n = seen[stem, name] = seen.get((stem, name), -1) + 1
      leg = DEAL_ORDER[n % len(DEAL_ORDER)]
    legs[id(item)] = leg
  return legs


@pytest.hookimpl(trylast=True)      # after `-m 'not slow'` has deselected: the cases dealt are the ones that run
def pytest_collection_modifyitems(config, items):
  leg = os.environ.get("SINKJAX_CI_LEG")
  if leg:
    if leg not in CI_LEGS:
      raise pytest.UsageError(f"SINKJAX_CI_LEG={leg}: one of {', '.join(CI_LEGS)} (or unset: every test runs)")
    legs = ci_legs(items)
    other = [item for item in items if legs[id(item)] not in (None, leg)]
    if other:
      config.hook.pytest_deselected(items=other)
      items[:] = [item for item in items if legs[id(item)] in (None, leg)]
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
