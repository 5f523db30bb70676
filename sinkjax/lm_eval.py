"""sinkjax runs as an lm-evaluation-harness model (`sinkjax`), and a command line around lm-eval's evaluation.

    python -m sinkjax.lm_eval --checkpoint RUN --tasks T1,T2 [--include-path DIR] [--num-fewshot K] [--limit N]
        [--batch-size B] [--output-path DIR] [--log-samples] [--apply-chat-template] [--model-args k=v,...]
        [--mc FILE.jsonl] [--confirm-run-unsafe-code] [--seed S] [--bootstrap-iters N] [section.key=value ...]

`--tasks paper` is the downstream half of the paper's Table 1 (`PAPER_TASKS`), `--tasks paper-ft` Table 2's
fine-tuning benchmarks (`PAPER_FT_TASKS`; ProcessBench is a task of ours, `sinkjax.lm_eval_tasks`); `--mc FILE.jsonl`
evaluates a sinkjax multiple-choice file as a local lm-eval task (`MC_TASK_TEMPLATE`). Before the model loads or
lm-eval's task index is read, the command checks what it can in seconds and stops with one line: HumanEval's
requirements (the `evaluate` package, HF_ALLOW_CODE_EVAL=1, --confirm-run-unsafe-code), and, when the Hugging Face hub
is unreachable (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, or no connection), the tasks' datasets missing from the local
cache; a hub error during the run is one line too. The command is a thin wrapper over
lm-eval's own `simple_evaluate`: lm-eval builds the prompts, few-shot contexts, filters and metrics; this module
only answers its three kinds of request with a sinkjax model, then writes lm-eval's standard outputs under
`--output-path` (`results_<date>.json`, and with `--log-samples` `samples_<task>_<date>.jsonl`) and prints its table.

`SinkjaxLM` (registered as `sinkjax` when this module is imported) loads any run `sinkjax.run.load_run` reads:
trained, imported from Hugging Face or nanochat, a LoRA run (adapters merged with `sinkjax.lora.merge`), local or
gs://. It mirrors lm-eval's `hf` backend request by request, so the numbers compare with `--model hf` on the same
weights:
- `loglikelihood`: lm-eval's `TemplateLM` splits each (context, continuation) into tokens as the hf backend does
  (whole string encoded, the context's tokens cut off; trailing spaces of the context move to the continuation;
  an empty context becomes the prefix token); each row is the last `max_length + 1` tokens of context +
  continuation, scored in batches of `batch_size` rows (right-padded, padding masked by segment id 0); the answer is
  (sum of the continuation's log-probabilities, whether every continuation token is the argmax).
- `loglikelihood_rolling`: the text is encoded with `tok_encode` (BOS when the tokenizer adds one) and cut into
  lm-eval's rolling windows (`get_rolling_token_windows` with the prefix token, `max_length`, context 1, then
  `make_disjoint_window`), the hf backend's rule; every token is predicted once.
- `generate_until`: the context (left-truncated to `max_length - max_gen_toks` tokens) goes through the project's
  fixed-shape KV cache by the loop `sinkjax.generate` runs (`sinkjax.generate.Generator.generate_batch`): requests
  with the same generation settings, longest first, `batch_size` at a time as the rows of one batch (each row's
  cache holds exactly its own tokens: no padding is attended; the prefill is right-padded to a power of two and cut
  back, so a few prefill shapes serve every prompt), decoded token by token: greedy, or sampling (`temperature`,
  `top_k`, `top_p`, one draw per step for the batch) when lm-eval's normalized `do_sample` is true; a row stops at an
  end-of-text token, at `max_gen_toks` tokens, or once its decoded text holds an `until` string, and the text is cut
  at the first stop string as lm-eval does.

Model arguments (`--model-args k=v,...`, or lm-eval's `--model_args`): `checkpoint` (or `pretrained`) the run
directory, `step` a checkpoint step, `batch_size`, `max_length` (default `model.max_seq_len`), `max_gen_toks`
(default 256), `add_bos_token` (default: the tokenizer's own rule when the run's tokenizer sits in a Hugging Face
model directory, else true: sinkjax and nanochat train every document behind BOS), `prefix_token_id` (default
BOS), `dtype` (compute dtype; default the run's `model.dtype`), `seed` (sampling).

Placement: by default every device holds the whole model and the rows of a batch (scored or generated) are split
over the devices. Config
overrides after the options (or the `overrides` model argument, a list) change the run's config; a `mesh.*` override
(`mesh.fsdp=8`) restores each parameter into its training placement on that mesh (`sinkjax.run.load_run(mesh="run")`),
rows split over mesh.data x mesh.fsdp (the KV cache's rows too, its KV heads over mesh.tensor where they divide),
so a model larger than one device is evaluated where it trained. Under a
launcher (`launch/local.sh --module sinkjax.lm_eval -- ARGS`, the TPU VM and SLURM scripts) the processes join with
`jax.distributed` as sinkjax.train's do; every process answers every request (one global computation per batch, each
process feeding its own devices' rows) and process 0 alone writes the results and prints the table.
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":
  errors.require_extra("sinkjax.lm_eval")   # before the imports below: a run is read with the train extra's Orbax

import contextlib
import dataclasses
import functools
import json
import logging
import pathlib
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax import choices, distributed, lm_eval_tasks, lora, options, paths
from sinkjax import sharding as sharding_lib
from sinkjax.errors import UserError
from sinkjax.config import MeshConfig, declare
from sinkjax.generate import Generator
from sinkjax.model import Transformer
from sinkjax.run import asks_for_mesh, load_run

try:                      # lm-eval is an extra (pip install 'sinkjax[eval]'); sinkjax itself never imports this module
  from lm_eval.api.model import TemplateLM as _Base
  HAVE_LM_EVAL = True
except ImportError:       # the CLI says how to install it; the class below refuses to be built
  _Base = object
  HAVE_LM_EVAL = False

INSTALL_HINT = "lm-evaluation-harness is not installed; pip install 'sinkjax[eval]'"

# Table 1's downstream tasks, Table 2's fine-tuning benchmarks (sinkjax.lm_eval_tasks: where they are listed)
PAPER_TASKS, PAPER_FT_TASKS, TASK_GROUPS = (lm_eval_tasks.PAPER_TASKS, lm_eval_tasks.PAPER_FT_TASKS,
                                            lm_eval_tasks.TASK_GROUPS)


class LMEvalError(UserError):
  """A user-facing problem (the message says what to change)."""


def _bucket(n: int, cap: int, least: int = 64) -> int:
  """The padded length of n tokens: the next power of two (at least `least`), at most `cap` (and at least n)."""
  return max(n, min(cap, max(least, 1 << (max(n, 1) - 1).bit_length())))


def _as_bool(value, name: str):
  if value is None or isinstance(value, bool):
    return value
  text = str(value).strip().lower()
  if text in ("true", "1", "yes"):
    return True
  if text in ("false", "0", "no"):
    return False
  raise LMEvalError(f"model argument {name} must be true or false, got {value!r}")


@functools.partial(jax.jit, static_argnums=0)
def _score_rows(graphdef, state, tokens, targets, segment_ids):
  """(log p(target) [B,T] float32, target == argmax [B,T]) of every position of every row."""
  logits = nnx.merge(graphdef, state)(tokens, segment_ids=segment_ids).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return (jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0],
          jnp.argmax(logits, axis=-1) == targets)


class SinkjaxLM(_Base):
  """An lm-evaluation-harness model backed by a sinkjax run (see the module docstring)."""

  def __init__(self, checkpoint: str | None = None, pretrained: str | None = None, step=None, batch_size=8,
               max_batch_size=None, max_length=None, max_gen_toks=256, add_bos_token=None, prefix_token_id=None,
               dtype: str | None = None, seed=0, device=None, overrides=(), **kwargs):
    if not HAVE_LM_EVAL:
      raise LMEvalError(INSTALL_HINT)
    super().__init__()
    del max_batch_size, device                  # lm-eval passes them to every model; devices are JAX's
    for name in ("trust_remote_code",):
      kwargs.pop(name, None)
    if kwargs:
      raise LMEvalError(f"unknown model argument(s) for sinkjax: {', '.join(sorted(kwargs))} (known: checkpoint, "
                        "step, batch_size, max_length, max_gen_toks, add_bos_token, prefix_token_id, dtype, seed, "
                        "overrides)")
    run_dir = checkpoint or pretrained
    if not run_dir:
      raise LMEvalError("the sinkjax model needs checkpoint=RUN_DIR (a run directory)")
    logging.getLogger("absl").setLevel(logging.ERROR)    # Orbax's read-only notices
    self.run_dir = str(run_dir)
    overrides = overrides.split() if isinstance(overrides, str) else list(overrides or ())
    placed = asks_for_mesh(overrides)      # mesh.* given: the training placement on that mesh
    model, cfg, tok, self.step = load_run(run_dir, None if step in (None, "") else int(step), overrides,
                                          mesh="run" if placed else None)
    mesh = sharding_lib.mesh_of(nnx.state(model, nnx.Param)) if placed else None
    self._setup(model, cfg, tok, batch_size=batch_size, max_length=max_length, max_gen_toks=max_gen_toks,
                add_bos_token=add_bos_token, prefix_token_id=prefix_token_id, dtype=dtype, seed=seed, mesh=mesh)

  @classmethod
  def from_model(cls, model, cfg, tokenizer, **kwargs) -> "SinkjaxLM":
    """An lm-eval model of an in-memory sinkjax model (`cfg` its Config, `tokenizer` a sinkjax tokenizer), e.g. to
    evaluate inside a Python session: `lm_eval.simple_evaluate(model=SinkjaxLM.from_model(...), tasks=[...])`.
    Keyword arguments as for the constructor (batch_size, max_length, add_bos_token, ...), and `mesh`: the mesh the
    model's parameters are already placed on (`sinkjax.run.load_run(mesh=...)`); without it they are put whole on
    every device."""
    if not HAVE_LM_EVAL:
      raise LMEvalError(INSTALL_HINT)
    lm = cls.__new__(cls)
    _Base.__init__(lm)
    lm.run_dir, lm.step = None, None
    lm._setup(model, cfg, tokenizer, **kwargs)    # pylint: disable=protected-access
    return lm

  def _setup(self, model, cfg, tok, *, batch_size=8, max_length=None, max_gen_toks=256, add_bos_token=None,
             prefix_token_id=None, dtype=None, seed=0, mesh=None):
    model = lora.merge(model)
    if dtype and dtype != cfg.model.dtype:
      model = self._with_dtype(model, cfg, dtype)
    self.cfg, self.tok, self.model = cfg, tok, model
    self.batch_size_per_device = self._batch_size(batch_size)
    self._max_length = int(max_length) if max_length not in (None, "") else cfg.model.max_seq_len
    self._max_gen_toks = int(max_gen_toks)
    self.seed = int(seed)
    # The tokenizer's own special tokens (sinkjax.data.tokenizers): whether it adds BOS, its EOS, its stop ids.
    self.add_bos_token = _as_bool(add_bos_token, "add_bos_token")
    if self.add_bos_token is None:
      self.add_bos_token = tok.add_bos
    self._bos_text = tok.token_text(tok.bos_id) if hasattr(tok, "token_text") else None
    self.custom_prefix_token_id = None if prefix_token_id in (None, "") else int(prefix_token_id)
    vocab = cfg.model.vocab_size
    eos = [i for i in tok.eos_ids if 0 <= i < vocab]
    self._eot = eos[0] if eos else tok.bos_id
    self._stop_ids = set(tok.stop_ids)
    if self._eot == tok.bos_id:
      self._stop_ids.add(tok.bos_id)       # sinkjax documents are separated by BOS: BOS ends a generation
    self._placed = mesh is not None          # the parameters sit where load_run put them (mesh.* overrides)
    self.mesh = mesh if self._placed else sharding_lib.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1))
    self._rows = sharding_lib.batch_sharding(self.mesh)
    self._shards = sharding_lib.batch_shards(self.mesh)
    self.graphdef, self.state = nnx.split(model)
    if self._shards > 1 and not self._placed:   # rows are split over the devices: every device holds the weights
      self.state = jax.device_put(self.state, sharding_lib.replicated(self.mesh))
    self._generator = None
    self._Generator = Generator
    self._key = jax.random.PRNGKey(self.seed)     # raw uint32: every process builds the same one
    self._draws = 0

  # ------------------------------------------------------------------------------------------------ set-up helpers

  @staticmethod
  def _batch_size(value) -> int:
    if value in (None, "", "auto") or str(value).startswith("auto"):
      return 8
    try:
      n = int(value)
    except (TypeError, ValueError):
      raise LMEvalError(f"batch_size must be a positive integer, got {value!r}") from None
    if n < 1:
      raise LMEvalError(f"batch_size must be >= 1, got {n}")
    return n

  @staticmethod
  def _with_dtype(model, cfg, dtype: str):
    """The same parameters in a model of another compute dtype."""
    if dtype not in choices.DTYPES:
      raise LMEvalError(f"dtype must be one of {'|'.join(choices.DTYPES)}, got {dtype!r}")
    cfg.model = dataclasses.replace(cfg.model, dtype=dtype)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))

  # ------------------------------------------------------------------------------------------- lm-eval's interface

  @property
  def eot_token_id(self) -> int:
    return self._eot

  @property
  def prefix_token_id(self) -> int:
    if self.custom_prefix_token_id is not None:
      return self.custom_prefix_token_id
    bos = self.tok.bos_id
    return bos if bos < self.cfg.model.vocab_size else self._eot

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def batch_size(self) -> int:
    return self.batch_size_per_device

  @property
  def tokenizer_name(self) -> str:
    return str(self.cfg.data.tokenizer).replace("/", "__")

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                 **kwargs) -> list[int]:
    """Token ids of `string`, BOS first when `add_special_tokens` (None: `add_bos_token`, and no BOS when the text
    already starts with the BOS token's text), as the hf backend encodes."""
    del kwargs
    add = self.add_bos_token if add_special_tokens is None else add_special_tokens
    if add_special_tokens is None and self._bos_text and string.startswith(self._bos_text):
      add = False
    ids = list(self.tok.encode(string))
    if add:
      ids = [self.tok.bos_id] + ids
    if left_truncate_len:
      ids = ids[-left_truncate_len:]
    return ids

  def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
    del skip_special_tokens
    return self.tok.decode([tokens] if isinstance(tokens, int) else list(tokens))

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
    """(sum of log p(continuation), is greedy) of each (strings, context ids, continuation ids) request."""
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    del override_bs
    L = self.max_length
    rows = []
    for _, ctx, cont in requests:
      if not ctx or not cont:
        raise LMEvalError("a loglikelihood request needs context and continuation tokens")
      if len(cont) > L:
        raise LMEvalError(f"a continuation of {len(cont)} tokens does not fit the model's {L} tokens")
      rows.append(((ctx + cont)[-(L + 1):], len(cont)))
    order = sorted(range(len(rows)), key=lambda j: (-len(rows[j][0]), tuple(rows[j][0])))   # the hf backend's order
    out = [None] * len(rows)
    B = self.batch_size
    width = -(-B // self._shards) * self._shards
    bar = tqdm(total=len(rows), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
    for start in range(0, len(order), B):
      chunk = order[start:start + B]
      T = _bucket(max(len(rows[j][0]) - 1 for j in chunk), L)
      lp, greedy = self._score([rows[j][0] for j in chunk], width, T)
      for r, j in enumerate(chunk):
        seq, c = rows[j]
        n = len(seq) - 1
        ans = (float(lp[r, n - c:n].astype("float64").sum()), bool(greedy[r, n - c:n].all()))
        out[j] = ans
        strings = requests[j][0]
        if strings is not None:
          self.cache_hook.add_partial("loglikelihood", strings, ans)
      bar.update(len(chunk))
    bar.close()
    return out

  def _score(self, seqs, width: int, T: int):
    """Scores rows `seqs` (each input + its last target) in one [width, T] batch; numpy (lp, greedy)."""
    tokens = np.zeros((width, T), np.int32)
    targets = np.zeros((width, T), np.int32)
    seg = np.zeros((width, T), np.int32)        # 0 = padding (right of each row, and the rows that fill the batch)
    for r, seq in enumerate(seqs):
      n = len(seq) - 1
      tokens[r, :n], targets[r, :n], seg[r, :n] = seq[:-1], seq[1:], 1
    rows = self._rows if self._shards > 1 else sharding_lib.replicated(self.mesh)
    put = lambda x: sharding_lib.put_global(x, rows)     # every process holds the same rows; it fills its devices
    with self._mesh_context():
      lp, greedy = _score_rows(self.graphdef, self.state, put(tokens), put(targets), put(seg))
    return distributed.to_host((lp, greedy))

  def _mesh_context(self):
    return jax.set_mesh(self.mesh) if self._shards > 1 or self._placed else contextlib.nullcontext()

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Log-likelihood of each whole text over lm-eval's disjoint rolling windows (the hf backend's rule)."""
    from lm_eval import utils  # pylint: disable=import-outside-toplevel
    windows, counts = [], []
    for (string,) in [req.args for req in requests]:
      ws = [(None,) + w for w in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
          token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
          context_len=1))]
      windows.extend(ws)
      counts.append(len(ws))
    scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm) if windows else []
    out, at = [], 0
    for req, n in zip(requests, counts):
      total = float(sum(s[0] for s in scores[at:at + n]))
      at += n
      out.append(total)
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return out

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Continuations of each (context, generation kwargs) request (see the module docstring): requests with the same
    generation settings, longest prompt first (the hf backend's order), `batch_size` at a time as the rows of one
    `Generator.generate_batch` (rows split over the mesh's batch axes)."""
    from lm_eval.models.utils import (  # pylint: disable=import-outside-toplevel
        handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text)
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    jobs = []
    for req in requests:
      context, gen_kwargs = req.args
      if not isinstance(gen_kwargs, dict):
        raise LMEvalError(f"generation kwargs must be a mapping, got {gen_kwargs!r}")
      kw = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
      until = handle_stop_sequences(kw.pop("until", None), eos=self.tok_decode([self.eot_token_id]) or None)
      max_gen = int(kw.pop("max_gen_toks"))
      max_ctx = self.max_length - max_gen
      if max_ctx <= 0:
        raise LMEvalError(f"max_gen_toks {max_gen} leaves no room for the context in the model's "
                          f"{self.max_length} tokens")
      sample = bool(kw.get("do_sample"))
      temperature = float(kw.get("temperature") or 0.0) if sample else 0.0
      if sample and temperature <= 0:
        temperature = 1.0
      ids = self.tok_encode(context, left_truncate_len=max_ctx) or [self.prefix_token_id]
      settings = (tuple(until), max_gen, temperature, int(kw.get("top_k") or 0), float(kw.get("top_p") or 1.0))
      jobs.append((ids, settings))
    out = [None] * len(jobs)
    bar = tqdm(total=len(jobs), disable=disable_tqdm or self.rank != 0, desc="Running generate_until requests")
    groups: dict = {}
    for j in sorted(range(len(jobs)), key=lambda j: -len(jobs[j][0])):
      groups.setdefault(jobs[j][1], []).append(j)
    for (until, max_gen, temperature, top_k, top_p), members in groups.items():
      for start in range(0, len(members), self.batch_size):
        chunk = members[start:start + self.batch_size]
        news = self._generate_rows([jobs[j][0] for j in chunk], max_gen, list(until), temperature=temperature,
                                   top_k=top_k, top_p=top_p)
        for j, new in zip(chunk, news):
          out[j] = postprocess_generated_text(self.tok_decode(new), list(until), None)
          self.cache_hook.add_partial("generate_until", requests[j].args, out[j])
        bar.update(len(chunk))
    bar.close()
    return out

  def _generate(self, ids: list[int], max_new: int, until: list[str], *, temperature: float, top_k: int,
                top_p: float) -> list[int]:
    """Up to `max_new` tokens after `ids` (one request alone, see `_generate_rows`)."""
    return self._generate_rows([ids], max_new, until, temperature=temperature, top_k=top_k, top_p=top_p)[0]

  def _generate_rows(self, prompts: list[list[int]], max_new: int, until: list[str], *, temperature: float,
                     top_k: int, top_p: float) -> list[list[int]]:
    """Up to `max_new` tokens after each of at most `batch_size` prompts, generated together by the Generator
    (`sinkjax.generate.Generator.generate_batch`, the loop `sinkjax.generate` runs; rows split over the mesh's batch
    axes, the parameters where they are); a row stops at a stop token or once its text holds an `until` string.
    The prefill is right-padded to a power of two (`_bucket`), so a few prefill shapes serve every prompt."""
    if self._generator is None:
      width = -(-self.batch_size // self._shards) * self._shards
      self._generator = self._Generator(nnx.merge(self.graphdef, self.state), capacity=self.max_length,
                                        batch=width, mesh=self.mesh,
                                        collective_matmul=self.cfg.mesh.collective_matmul)
    key = np.asarray(jax.random.fold_in(self._key, self._draws))
    self._draws += 1
    stop = (lambda _, toks: any(u and u in self.tok.decode(toks) for u in until)) if until else None
    return self._generator.generate_batch(prompts, max_new, temperature=temperature, top_k=top_k, top_p=top_p,
                                          key=key, stop_token=self._stop_ids, stop=stop,
                                          prefill_to=lambda n: _bucket(n, self.max_length))

  # ------------------------------------------------------------------------------------------------ chat templates

  def chat_template(self, chat_template=False) -> str | None:
    if chat_template is False or chat_template is None:
      return None
    return self.tok.chat.source or "plain"

  def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
    """The conversation as the run was fine-tuned on it (the tokenizer's `chat`: its chat template when it has one,
    else sinkjax's plain "User: ... / Assistant: ..." layout)."""
    msgs = [{"role": m["role"], "content": m["content"]} for m in chat_history]
    return self.tok.chat.render(msgs, add_generation_prompt)

  def get_model_info(self) -> dict:
    m = self.cfg.model
    return {"sinkjax_run": self.run_dir, "sinkjax_step": self.step, "attention": m.attention,
            "num_layers": m.num_layers, "d_model": m.d_model, "dtype": m.dtype, "max_length": self.max_length,
            "add_bos_token": self.add_bos_token, **sharding_lib.placement(self.state)}


# ----------------------------------------------------------------------------------------------------------------
# Multiple choice from a JSONL file (what `sinkjax.eval --mc` was): a local lm-eval task
# ----------------------------------------------------------------------------------------------------------------

MC_TASK_TEMPLATE = """\
# A sinkjax multiple-choice file as an lm-eval task (written by sinkjax.lm_eval --mc): one JSON object per line,
# {{"context": str, "choices": [str, ...], "label": int}}; each choice is scored as log p(choice | context) with the
# choice appended to the context as it is (no delimiter: give choices their leading space, " Paris").
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
output_type: multiple_choice
test_split: test
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def load_mc_items(path) -> list[dict]:
  """Reads and checks a multiple-choice JSONL file; a bad line is an LMEvalError naming the file and line."""
  path = paths.as_path(path, "--mc")
  if not path.is_file():
    raise LMEvalError(f"multiple-choice file {path} does not exist")
  items = []
  for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    where = f"{path}:{n}"
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise LMEvalError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
      raise LMEvalError(f"{where}: expected an object {{\"context\": str, \"choices\": [str, ...], \"label\": int}}")
    ctx, choices, label = obj.get("context"), obj.get("choices"), obj.get("label")
    if not isinstance(ctx, str):
      raise LMEvalError(f"{where}: 'context' must be a string")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
      raise LMEvalError(f"{where}: 'choices' must be a non-empty list of non-empty strings")
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
      raise LMEvalError(f"{where}: 'label' must be an integer index into 'choices' (0..{len(choices) - 1})")
    items.append({"context": ctx, "choices": choices, "label": label})
  if not items:
    raise LMEvalError(f"multiple-choice file {path} holds no items")
  return items


def write_mc_task(path, task_dir) -> str:
  """Checks the multiple-choice file `path` and writes its lm-eval task YAML into `task_dir`; returns the task name
  (`mc_<file stem>`)."""
  load_mc_items(path)
  where = str(path) if paths.is_remote(path) else str(pathlib.Path(path).resolve())
  task = "mc_" + re.sub(r"[^A-Za-z0-9_]+", "_", pathlib.PurePosixPath(str(path)).stem)
  (pathlib.Path(task_dir) / f"{task}.yaml").write_text(MC_TASK_TEMPLATE.format(task=task, path=json.dumps(where)))
  return task


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LMEvalOptions:
  """The lm_eval.* options (`python -m sinkjax.lm_eval`; each flag the alias of its key: `--tasks paper` =
  `lm_eval.tasks=paper`)."""
  checkpoint: str = declare("", alias="--checkpoint", metavar="RUN_DIR", required=True,
                        help="run directory (trained or imported)")
  tasks: str = declare("", alias="--tasks",
                   help="comma-separated lm-eval task or group names (or task YAML files), 'paper' for Table 1's "
                        "downstream tasks (" + ", ".join(PAPER_TASKS) + ") or 'paper-ft' for Table 2's ("
                        + ", ".join(PAPER_FT_TASKS) + ")")
  mc: str | None = declare(None, alias="--mc", metavar="FILE.jsonl",
                       help='a multiple-choice file, one {"context": str, "choices": [str, ...], "label": int} per '
                            "line, evaluated as a local lm-eval task mc_<file stem> (acc, acc_norm)")
  include_path: str | None = declare(None, alias="--include-path", metavar="DIR",
                                 help="a directory of extra task YAML files")
  num_fewshot: int | None = declare(None, ">=0", alias="--num-fewshot", metavar="K",
                                help="few-shot examples per prompt (default: each task's own)")
  limit: float | None = declare(None, ">0", alias="--limit", metavar="N",
                            help="at most N documents per task (a fraction if < 1; for trials, not for reported "
                                 "numbers)")
  batch_size: int = declare(8, ">=1", alias="--batch-size", metavar="B", help="rows per forward pass (default 8)")
  output_path: str | None = declare(None, alias="--output-path", metavar="DIR",
                                help="where lm-eval writes results_*.json")
  log_samples: bool = declare(False, alias="--log-samples",
                          help="also write every document's samples_<task>_*.jsonl")
  apply_chat_template: bool = declare(False, alias="--apply-chat-template",
                                  help="render prompts as chat turns (the tokenizer's chat template, else "
                                       "User:/Assistant:)")
  model_args: str = declare("", alias="--model-args", metavar="k=v,...",
                        help="SinkjaxLM arguments: step, max_length, max_gen_toks, add_bos_token, prefix_token_id, "
                             "dtype, seed")
  confirm_run_unsafe_code: bool = declare(False, alias="--confirm-run-unsafe-code",
                                      help="allow tasks that execute model-written code (humaneval: also set "
                                           "HF_ALLOW_CODE_EVAL=1 and install evaluate, whose code_eval metric runs "
                                           "it)")
  seed: int = declare(0, alias="--seed", help="seed of lm-eval's few-shot sampling and of Python/NumPy")
  bootstrap_iters: int = declare(100000, ">=0", alias="--bootstrap-iters", metavar="N",
                             help="bootstrap resamples for the stderr of metrics without a closed form (lm-eval's "
                                  "default 100000; 0 = none)")


COMMAND = options.Command(
    prog="python -m sinkjax.lm_eval", sections={"lm_eval": LMEvalOptions}, run_overrides=True,
    description="Evaluate a sinkjax run with EleutherAI's lm-evaluation-harness (its tasks, prompts, few-shot "
                "contexts and metrics); writes lm-eval's results_*.json (and samples_*.jsonl) under --output-path and "
                "prints its table.")


def expand_tasks(text: str, *, allow_empty: bool = False) -> list[str]:
  names = []
  for t in (x.strip() for x in text.split(",")):
    if not t:
      continue
    for name in TASK_GROUPS.get(t, (t,)):
      if name not in names:
        names.append(name)
  if not names and not allow_empty:
    raise LMEvalError("--tasks names no task (give --tasks T1,T2, --tasks paper, --tasks paper-ft or --mc FILE.jsonl)")
  return names


def _hub_error(e: BaseException) -> bool:
  return isinstance(e, (ConnectionError, TimeoutError)) or type(e).__module__.split(".")[0] in (
      "huggingface_hub", "requests", "urllib3", "httpx", "datasets", "fsspec")


def resolve_tasks(names: list[str], include_paths: list[str]):
  """(task manager, names) with every name checked against lm-eval's task index and the include paths. When the
  include paths hold every name, lm-eval's own index (~10 s to build) is not read."""
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  yaml_files = [n for n in names if n.endswith(".yaml")]
  missing = [n for n in yaml_files if not pathlib.Path(n).is_file()]
  if missing:
    raise LMEvalError(f"task file{'s' if len(missing) > 1 else ''} not found: {', '.join(missing)}")
  wanted = [n for n in names if not n.endswith(".yaml")]
  manager = None
  if include_paths and not yaml_files:
    local = TaskManager(include_path=list(include_paths), include_defaults=False)
    if all(local.match_tasks([n]) for n in wanted):
      manager = local
  if manager is None:
    manager = TaskManager(include_path=list(include_paths) or None)
  resolved, missing = [], []
  for name in names:
    found = [str(pathlib.Path(name).absolute())] if name.endswith(".yaml") else manager.match_tasks([name])
    if not found:
      missing.append(name)
    resolved += [f for f in found if f not in resolved]
  if missing:
    raise LMEvalError(f"unknown task{'s' if len(missing) > 1 else ''}: {', '.join(missing)} (lm-eval lists its "
                      "tasks with `lm_eval ls tasks`; local YAML tasks need --include-path DIR)")
  return manager, resolved


def _model_args(text: str) -> dict:
  out = {}
  for part in (p.strip() for p in text.split(",")):
    if not part:
      continue
    if "=" not in part:
      raise LMEvalError(f"--model-args entry {part!r} must look like key=value")
    k, v = part.split("=", 1)
    out[k.strip()] = v.strip()
  return out


def run(opts: LMEvalOptions, run_overrides: list[str] | tuple = ()) -> dict:
  """Loads the run (with the run's config overrides `run_overrides`), evaluates the tasks with lm-eval's
  `simple_evaluate`, saves and returns lm-eval's results."""
  if not HAVE_LM_EVAL:
    raise LMEvalError(INSTALL_HINT)
  if opts.log_samples and not opts.output_path:
    raise LMEvalError("--log-samples needs --output-path DIR (where the samples are written)")
  extra = _model_args(opts.model_args)
  if "checkpoint" in extra or "pretrained" in extra:
    raise LMEvalError("give the run with --checkpoint, not in --model-args")
  names = expand_tasks(opts.tasks, allow_empty=opts.mc is not None)
  if opts.include_path is not None and not pathlib.Path(opts.include_path).is_dir():
    raise LMEvalError(f"--include-path {opts.include_path} is not a directory")
  paths.check_bucket(opts.checkpoint, "--checkpoint")
  if not paths.as_path(opts.checkpoint, "--checkpoint").is_dir():
    raise LMEvalError(f"run directory {opts.checkpoint} does not exist")
  lm_eval_tasks.check_unsafe_code(names, opts.confirm_run_unsafe_code)
  with tempfile.TemporaryDirectory(prefix="sinkjax_lm_eval_") as task_dir:
    includes = [opts.include_path] if opts.include_path else []
    if opts.mc is not None:
      names.append(write_mc_task(opts.mc, task_dir))
    if set(names) & set(lm_eval_tasks.NAMES):
      lm_eval_tasks.write_tasks(task_dir)
    if opts.mc is not None or set(names) & set(lm_eval_tasks.NAMES):
      includes.append(task_dir)
    lm_eval_tasks.check_hub(names, includes)             # seconds: no task index, no model, no lm-eval import
    from lm_eval import simple_evaluate  # pylint: disable=import-outside-toplevel
    from lm_eval.loggers import EvaluationTracker  # pylint: disable=import-outside-toplevel
    manager, tasks = resolve_tasks(names, includes)      # before the model loads: a typo fails at once
    tracker = EvaluationTracker(output_path=opts.output_path) if opts.output_path else None
    limit = opts.limit
    if limit is not None and limit >= 1 and float(limit).is_integer():
      limit = int(limit)
    # lm-eval builds the model from its registry, as `lm_eval --model sinkjax --model_args pretrained=RUN,...` does
    try:
      results = simple_evaluate(
          model="sinkjax", model_args={"pretrained": str(opts.checkpoint), **extra,
                                       **({"overrides": list(run_overrides)} if run_overrides else {})},
          batch_size=opts.batch_size,
          tasks=tasks, num_fewshot=opts.num_fewshot, limit=limit, log_samples=opts.log_samples,
          evaluation_tracker=tracker, apply_chat_template=opts.apply_chat_template, task_manager=manager,
          confirm_run_unsafe_code=opts.confirm_run_unsafe_code, random_seed=opts.seed, numpy_random_seed=opts.seed,
          torch_random_seed=opts.seed, fewshot_random_seed=opts.seed, bootstrap_iters=opts.bootstrap_iters)
    except Exception as e:  # pylint: disable=broad-except
      if not _hub_error(e):
        raise
      raise LMEvalError(f"lm-eval could not fetch a task's data from the Hugging Face hub ({paths.describe(e)}); "
                        "check the network (HF_ENDPOINT, a proxy) or run where the datasets are cached") from None
  if results is None:
    raise LMEvalError("lm-eval returned no results")
  if tracker is not None and jax.process_index() == 0:     # one copy of the outputs per job
    samples = results.pop("samples", None) if opts.log_samples else None
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples is not None:
      for task_name in results["configs"]:
        tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
      results["samples"] = samples
  return results


def main(argv=None) -> int:
  def action(sections, run_overrides) -> int:
    opts = sections["lm_eval"]
    distributed.maybe_initialize()    # before anything touches JAX devices (a job of several processes)
    import multiprocessing  # pylint: disable=import-outside-toplevel
    # lm-eval's bootstrap stderr runs a multiprocessing pool; forking this process (JAX's threads) can deadlock
    method = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)
    try:
      results = run(opts, run_overrides)
    finally:
      multiprocessing.set_start_method(method, force=True)
    if jax.process_index() != 0:
      return 0
    from lm_eval.utils import make_table  # pylint: disable=import-outside-toplevel
    print(f"sinkjax ({opts.checkpoint}, step {results['config'].get('sinkjax_step', '?')}), limit: {opts.limit}, "
          f"num_fewshot: {opts.num_fewshot}, batch_size: {opts.batch_size}")
    print(make_table(results))
    if "groups" in results:
      print(make_table(results, "groups"))
    if opts.output_path:
      print(f"sinkjax.lm_eval: wrote {opts.output_path}", file=sys.stderr)
    return 0

  return options.main(COMMAND, argv, action)


def register() -> None:
  """Registers `SinkjaxLM` as lm-eval's model `sinkjax` (done when this module is imported), lazily by name, so that
  `python -m sinkjax.lm_eval` (this file as __main__) and `import sinkjax.lm_eval` register the same thing."""
  if not HAVE_LM_EVAL:
    return
  import lm_eval.models  # pylint: disable=import-outside-toplevel,unused-import  # lm-eval's own names first
  from lm_eval.api.registry import model_registry  # pylint: disable=import-outside-toplevel
  if "sinkjax" not in model_registry:
    model_registry.register("sinkjax", target="sinkjax.lm_eval:SinkjaxLM")


register()


if __name__ == "__main__":
  from sinkjax.lm_eval import main as _main   # the module's own classes (lm-eval builds the model from there)
  sys.exit(_main())
