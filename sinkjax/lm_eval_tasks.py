"""sinkjax.lm_eval's task groups (`--tasks paper`, `--tasks paper-ft`), a task of our own that lm-eval 0.4.x lacks
(ProcessBench), and the checks that run in seconds before lm-eval is imported, its task index read or a model loaded
(standard library only; `sinkjax.lm_eval.run` calls them first): HumanEval's requirements, and the
tasks' datasets when the Hugging Face hub is unreachable (`check_hub`: the task YAMLs read as text for their
dataset_path, the local `datasets` / hub caches looked at).

ProcessBench (Zheng et al., 2024; Qwen/ProcessBench on the Hugging Face hub, splits gsm8k, math, olympiadbench,
omnimath; records: problem, steps (the solution's paragraphs), label = the index of the earliest wrong paragraph, -1
when none): the model reads the problem and the paragraphs tagged <paragraph_i> and answers the earliest wrong index
in \\boxed{} (ProcessBench's critic prompt, as its evaluation code words it). Per split the score is the F1 of the two
accuracies, on the solutions with an error (label >= 0) and on the correct ones (label -1), x 100 as the paper reports;
`processbench` is the plain mean of the four splits' F1 (ProcessBench's average). Generation is greedy, up to
MAX_GEN_TOKS tokens (our choice; reasoning models write long critiques), with the model's end-of-turn as the stop.
Run it with --apply-chat-template for chat models (the paper's fine-tuned ones).

`write_tasks(task_dir)` writes the task YAMLs (and a two-line utils.py that imports the functions below) into a
directory that `sinkjax.lm_eval` adds to lm-eval's include path.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import socket
import urllib.parse

from sinkjax import paths
from sinkjax.errors import UserError

SPLITS = ("gsm8k", "math", "olympiadbench", "omnimath")     # ProcessBench's
GROUP = "processbench"
DATASET = "Qwen/ProcessBench"
# The downstream columns of the paper's Table 1 ([Sink-MoE] §5.1): (column, lm-eval task, metric keys of lm-eval's
# results_*.json in order of preference). The paper states neither metric nor shots (docs/EVAL.md); ours: acc for the
# multiple-choice tasks, GSM8K's strict-match exact match, HumanEval's greedy pass@1.
TABLE1_COLUMNS = (
    ("MMLU", "mmlu", ("acc,none",)),
    ("GSM8K", "gsm8k", ("exact_match,strict-match", "exact_match,flexible-extract")),
    ("HumanEval", "humaneval", ("pass@1,create_test", "pass@1,none")),
    ("ARC-E", "arc_easy", ("acc,none",)),
    ("ARC-C", "arc_challenge", ("acc,none",)),
    ("HellaSwag", "hellaswag", ("acc,none",)),
    ("PIQA", "piqa", ("acc,none",)),
    ("OpenBookQA", "openbookqa", ("acc,none",)),
    ("BoolQ", "boolq", ("acc,none",)),
    ("Winogrande", "winogrande", ("acc,none",)),
)
PAPER_TASKS = tuple(task for _, task, _ in TABLE1_COLUMNS)
# [Sink-MoE] Table 2's fine-tuning benchmarks (§5.3) as lm-eval 0.4.x names: ARC (the Challenge set: our reading), MuSR
# (the Open LLM Leaderboard's three), GSM8K, MATH-500, Competition-Math (MATH's 5,000 test problems, minerva_math's 7
# subjects), ProcessBench (ours: sinkjax.lm_eval_tasks), and LongBench's HotpotQA, Qasper, TriviaQA, NarrativeQA,
# 2WikiMQA and MultiFieldQA (English).
PAPER_FT_TASKS = ("arc_challenge", "leaderboard_musr", "gsm8k", "minerva_math500", "minerva_math",
                  GROUP, "longbench_hotpotqa", "longbench_qasper", "longbench_triviaqa",
                  "longbench_narrativeqa", "longbench_2wikimqa", "longbench_multifieldqa_en")
TASK_GROUPS = {"paper": PAPER_TASKS, "paper-ft": PAPER_FT_TASKS}


MAX_GEN_TOKS = 4096
NAMES = (GROUP, *(f"{GROUP}_{s}" for s in SPLITS))

PROMPT = """\
The following is a math problem and a solution (split into paragraphs, enclosed with tags and indexed from 0):

[Math Problem]

{problem}

[Solution]

{tagged_response}

Your task is to review and critique the solution paragraph by paragraph. Once you identify an error in a paragraph, \
return the index of the paragraph where the earliest error occurs. Otherwise, return the index of -1 (which typically \
denotes "not found").

Please put your final answer (i.e., the index) in \\boxed{{}}."""

TASK_TEMPLATE = """\
task: {task}
dataset_path: {dataset}
test_split: {split}
output_type: generate_until
doc_to_text: !function utils.doc_to_text
doc_to_target: label
process_results: !function utils.process_results
generation_kwargs:
  until: ["<|im_end|>", "<|eot_id|>", "<|endoftext|>"]
  do_sample: false
  max_gen_toks: {max_gen_toks}
metric_list:
  - metric: f1
    aggregation: !function utils.f1
    higher_is_better: true
metadata:
  version: 1.0
"""

GROUP_TEMPLATE = """\
group: {group}
task: [{tasks}]
aggregate_metric_list:
  - metric: f1
    aggregation: mean
    weight_by_size: false
metadata:
  version: 1.0
"""

UTILS = "from sinkjax.lm_eval_tasks import doc_to_text, process_results, f1  # noqa: F401\n"


def doc_to_text(doc: dict) -> str:
  tagged = "\n\n".join(f"<paragraph_{i}>\n{step}\n</paragraph_{i}>" for i, step in enumerate(doc["steps"]))
  return PROMPT.format(problem=doc["problem"], tagged_response=tagged)


_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


def extract_index(text: str) -> int | None:
  """The integer in the last \\boxed{...} of a reply (None without one)."""
  found = _BOXED.findall(text)
  return int(found[-1]) if found else None


def process_results(doc: dict, results: list[str]) -> dict:
  return {"f1": (int(doc["label"]), extract_index(results[0]))}


def f1(items) -> float:
  """ProcessBench's F1 (x 100) of (label, predicted index) pairs: the harmonic mean of the accuracy on the solutions
  with an error and on the correct ones (0 where either is 0 or missing)."""
  err = [p == y for y, p in items if y != -1]
  ok = [p == -1 for y, p in items if y == -1]
  if not err or not ok:
    return 0.0
  a, b = sum(err) / len(err), sum(ok) / len(ok)
  return 0.0 if a + b == 0 else 100.0 * 2 * a * b / (a + b)


def write_tasks(task_dir) -> list[str]:
  """The ProcessBench task YAMLs (four splits and the group) and their utils.py in task_dir; returns NAMES."""
  d = pathlib.Path(task_dir) / GROUP
  d.mkdir(parents=True, exist_ok=True)
  (d / "utils.py").write_text(UTILS)
  for s in SPLITS:
    (d / f"{GROUP}_{s}.yaml").write_text(TASK_TEMPLATE.format(task=f"{GROUP}_{s}", dataset=DATASET, split=s,
                                                                max_gen_toks=MAX_GEN_TOKS))
  (d / f"_{GROUP}.yaml").write_text(GROUP_TEMPLATE.format(group=GROUP, tasks=", ".join(NAMES[1:])))
  return list(NAMES)


# ------------------------------------------------------------------------------------------------ quick checks
def check_unsafe_code(names: list[str], confirmed: bool) -> None:
  """HumanEval executes the model's code: lm-eval needs the `evaluate` package (its code_eval metric),
  HF_ALLOW_CODE_EVAL=1 and --confirm-run-unsafe-code. One line naming what is missing."""
  code = [n for n in names if n.startswith("humaneval")]
  if not code:
    return
  missing = []
  if importlib.util.find_spec("evaluate") is None:
    missing.append("the evaluate package (pip install evaluate: its code_eval metric runs the code)")
  if os.environ.get("HF_ALLOW_CODE_EVAL") != "1":
    missing.append("HF_ALLOW_CODE_EVAL=1 in the environment")
  if not confirmed:
    missing.append("--confirm-run-unsafe-code")
  if missing:
    raise UserError(f"{', '.join(code)} executes model-written code and needs {'; '.join(missing)}")


_TRUE = ("1", "true", "yes", "on")


def hub_unreachable(timeout: float = 3.0) -> str | None:
  """Why the Hugging Face hub cannot be reached (an offline setting, or no TCP connection within `timeout` s), or
  None (reachable, or behind a proxy: then the downloads say)."""
  for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
    if os.environ.get(var, "").strip().lower() in _TRUE:
      return f"{var}={os.environ[var]}"
  if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
    return None
  url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
  port = url.port or (80 if url.scheme == "http" else 443)
  try:
    socket.create_connection((url.hostname, port), timeout=timeout).close()
  except OSError as e:
    return f"no connection to {url.hostname}:{port}: {paths.describe(e)}"
  return None


_TEXTS: dict[pathlib.Path, str] = {}


def _text(f: pathlib.Path) -> str:
  """A task file's text, read once per process (a group's lookups scan the same files many times)."""
  if f not in _TEXTS:
    _TEXTS[f] = f.read_text(errors="replace")
  return _TEXTS[f]


@functools.lru_cache(maxsize=8)
def _yaml_files(roots: tuple[pathlib.Path, ...]) -> list[pathlib.Path]:
  return [f for r in roots for f in sorted(r.rglob("*.yaml"))]


def _task_files(name: str, roots: list[pathlib.Path]) -> list[pathlib.Path]:
  """The YAML file(s) defining task or group `name` (files named like it first, else a scan of every YAML)."""
  pattern = re.compile(rf"^(?:task|group):\s*['\"]?{re.escape(name)}['\"]?\s*$", re.M)
  candidates = _yaml_files(tuple(roots))
  likely = [f for f in candidates if name in f.stem or f.stem.lstrip("_") in name]
  for files in (likely, candidates):
    found = [f for f in files if pattern.search(_text(f))]
    if found:
      return found
  return []


_DATASET = re.compile(r"^dataset_path:\s*['\"]?([^'\"\s#]+)", re.M)
_INCLUDE = re.compile(r"^include:\s*['\"]?([^'\"\s#]+)", re.M)


def task_datasets(name: str, roots: list[pathlib.Path], _depth: int = 0) -> set[str]:
  """The hub datasets (dataset_path) a task reads, through its `include:` chain; for a group, those of the tasks it
  lists, else of every YAML beside it. Empty when none is found (the run then finds out)."""
  if name in NAMES:                            # ours (written by the command into its include path)
    return {DATASET}
  out = set()
  for f in _task_files(name, roots):
    text, at, m = _text(f), f, None
    for _ in range(5):                         # the include chain
      m = _DATASET.search(text)
      inc = _INCLUDE.search(text)
      if m or not inc or not (at.parent / inc.group(1)).is_file():
        break
      at = at.parent / inc.group(1)
      text = _text(at)
    if m:
      out.add(m.group(1))
      continue
    text = _text(f)
    if not re.search(r"^group:", text, re.M):
      continue
    if _depth < 3:                             # the group's listed tasks
      for sub in re.findall(r"^\s+-\s+([\w.-]+)\s*$", text, re.M):
        out |= task_datasets(sub, roots, _depth + 1)
    if not out:                                # tasks by tag: the YAMLs beside the group
      out |= {d.group(1) for g in f.parent.rglob("*") if g.is_file() and "yaml" in g.name
              for d in _DATASET.finditer(_text(g))}
  return {d for d in out if re.fullmatch(r"[\w.-]+/[\w.-]+", d) and not pathlib.Path(d).exists()}


def _hf_caches() -> tuple[pathlib.Path, pathlib.Path]:
  home = pathlib.Path(os.environ.get("HF_HOME") or pathlib.Path.home() / ".cache" / "huggingface")
  datasets_cache = pathlib.Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets")
  hub_cache = pathlib.Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub")
  return datasets_cache, hub_cache


def is_cached(dataset: str) -> bool:
  """Whether a hub dataset has a copy in the local `datasets` or hub cache."""
  datasets_cache, hub_cache = _hf_caches()
  org, repo = dataset.split("/", 1)
  return any(p.is_dir() for p in (datasets_cache / f"{org}___{repo}", datasets_cache / f"{org}___{repo}".lower(),
                                  hub_cache / f"datasets--{org}--{repo}"))


def check_hub(names: list[str], include_paths: list[str]) -> None:
  """With the hub unreachable, every dataset the tasks read must be cached locally; one line naming those that are
  not. Reads the task YAMLs as text (seconds), not lm-eval's task index."""
  why = hub_unreachable()
  if why is None:
    return
  spec = importlib.util.find_spec("lm_eval")        # its directory, without importing it (seconds)
  roots = [pathlib.Path(p) for p in include_paths] + [pathlib.Path(spec.submodule_search_locations[0]) / "tasks"]
  missing = [(n, d) for n in names if not n.endswith(".yaml") for d in sorted(task_datasets(n, roots))
             if not is_cached(d)]
  if missing:
    listed = ", ".join(f"{n} ({d})" for n, d in missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6
                                                                  else "")
    raise UserError(f"the Hugging Face hub is unreachable ({why}) and these tasks' datasets are not in the local "
                      f"cache ({_hf_caches()[0]}): {listed}; run once with network access to cache them, or point "
                      "HF_HOME / HF_DATASETS_CACHE at a cache that holds them")
