"""A command's options are typed config sections (sinkjax.options): each option declared once with `config.declare`, its
flag generated from the declaration, its value checked by the declaration, and no parser namespace below a main."""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import typing

import types

import pytest
import yaml

import sinkjax
from sinkjax import cache_policy, options
from sinkjax import compile as compile_lib
from sinkjax import eval as ev
from sinkjax import generate as gen
from sinkjax import lm_eval
from sinkjax import train as train_lib
from sinkjax.bench import attention as bench_attention
from sinkjax.bench import data as bench_data
from sinkjax.bench import kernel_check, profile_summary
from sinkjax.bench import side_by_side as bench_side_by_side
from sinkjax.bench import train as bench_train
from sinkjax.bench import trainer as bench_trainer
from sinkjax.errors import ConfigError
from sinkjax.convert import hf as convert_hf
from sinkjax.convert import nanochat as convert_nanochat
from sinkjax.data import acereason, fineweb
from sinkjax.data import passkey as passkey_data
from sinkjax.data import tokenizer as tokenizer_cli
from sinkjax.experiments import paper_report, passkey, study

ROOT = pathlib.Path(sinkjax.__file__).parent


def _subcommand(module, word):
  """A subcommand of a command of several (`sinkjax.data.tokenizer train ...`: a Command each, `options.main_of`) as a
  command of its own for the checks below: its Command, and the module's main with the subcommand's word in front."""
  return types.SimpleNamespace(COMMAND=module.COMMANDS[word], main=lambda argv: module.main([word, *argv]),
                               __file__=module.__file__)


COMMANDS = {"eval": ev, "generate generate": _subcommand(gen, "generate"), "generate chat": _subcommand(gen, "chat"),
            "generate perplexity": _subcommand(gen, "perplexity"), "lm_eval": lm_eval, "compile": compile_lib, "train": train_lib,
            "bench.attention": bench_attention, "bench.data": bench_data, "bench.train": bench_train,
            "bench.trainer": bench_trainer, "bench.kernel_check": kernel_check,
            "bench.profile_summary": profile_summary, "bench.side_by_side": bench_side_by_side, "convert.hf": convert_hf, "convert.nanochat": convert_nanochat,
            "data.fineweb": fineweb, "data.acereason": acereason, "data.passkey": passkey_data,
            "data.tokenizer train": _subcommand(tokenizer_cli, "train"),
            "data.tokenizer from-tiktoken": _subcommand(tokenizer_cli, "from-tiktoken"),
            "experiments.paper_report": paper_report,
            "experiments.study": study}
RUN_COMMANDS = {k: COMMANDS[k] for k in ("eval", "generate generate", "generate chat", "generate perplexity",
                                          "lm_eval")}     # those that take --checkpoint RUN_DIR

# Modules whose functions below main still take the parser's namespace (none now). The test fails when one of them
# no longer does (take it off the list) or when another module starts to.
NOT_CONVERTED: set[str] = set()


def _flags(parser) -> list[str]:
  return [s for a in parser._actions for s in a.option_strings]  # pylint: disable=protected-access


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_declared_once_and_its_flag_generated(name):
  """Each command's options: one key per section.name, one flag per alias, every flag of the parser an alias of a
  declared key (besides -h/--help and --config), and no hand-written add_argument in the command's module."""
  command = COMMANDS[name].COMMAND
  keys = [f"{s}.{f.name}" for s, f, _ in command.options()]
  declared = list(command.options()) + list(command.run_options())     # run_keys: the run config's own declarations
  aliases = [a for _, f, _ in declared if "alias" in f.metadata
             for a in (f.metadata["alias"], *f.metadata.get("other_aliases", ()))]
  assert len(keys) == len(set(keys)) and len(aliases) == len(set(aliases)), (keys, aliases)
  flags = _flags(options.build_parser(command))
  assert sorted(flags) == sorted(aliases + ["-h", "--help"] + ([command.options_file] if command.options_file else []))
  source = pathlib.Path(COMMANDS[name].__file__).read_text()
  assert "add_argument(" not in source and "ArgumentParser(" not in source and "Parser(" not in source


def test_each_option_section_is_declared_in_one_module():
  """An options section (a dataclass named *Options) is defined once in the package; commands that share one (the
  head-cache policy of generate and passkey) import it."""
  where: dict[str, list[str]] = {}
  for path in ROOT.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef) and node.name.endswith("Options"):
        where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
  assert {k: v for k, v in where.items() if len(v) > 1} == {}
  assert where["CacheOptions"] == ["cache_policy.py"]
  assert gen.COMMANDS["generate"].sections["cache"] is gen.COMMANDS["perplexity"].sections["cache"] \
      is cache_policy.CacheOptions
  assert gen.COMMANDS["generate"].sections["sampling"] is gen.COMMANDS["chat"].sections["sampling"]
  assert passkey.SECTIONS["cache"] is cache_policy.CacheOptions


# streaming_real's and far_context's studies and duo_attention's map declare the one fraction of their hybrid (a
# float), not the policy's F[,F...] list.
NOT_THE_POLICY = {"StreamingOptions": ["full_heads"], "FarOptions": ["full_heads"], "DuoOptions": ["full_heads"]}


def test_the_shared_cache_policy_is_not_redeclared():
  """The head policy's keys (cache.full_heads, cache.full_heads_random, ...) are declared in CacheOptions only: no
  other options section of the package declares a field of the same name (a copy mapped back by hand, as the passkey
  probe's section once was), besides the listed ones that mean something else."""
  policy = {f.name for f in dataclasses.fields(cache_policy.CacheOptions)}
  assert len(policy) == 7
  copies = {}
  for path in ROOT.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef) and node.name.endswith("Options") and node.name != "CacheOptions":
        names = {a.target.id for a in node.body if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
        if names & policy:
          copies[node.name] = sorted(names & policy)
  assert copies == NOT_THE_POLICY


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_lists_every_visible_option_with_its_help(name, capsys):
  command = COMMANDS[name].COMMAND
  with pytest.raises(SystemExit) as e:
    COMMANDS[name].main(["--help"])
  assert e.value.code == 0
  text = " ".join(capsys.readouterr().out.split())
  for section, f, _ in command.options():
    if "help" in f.metadata:
      assert f.metadata["alias"] in text and f"[{section}.{f.name}" in text, f.name
      assert " ".join(f.metadata["help"].split())[:40] in text, f.name


def _function_params(tree):
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
      yield node, params


def _takes_namespace(node, params) -> bool:
  """A parameter annotated argparse.Namespace, or one named `args` whose attributes the function reads (`args.x`:
  a namespace; a tuple of scan or kernel arguments is indexed or unpacked, not read by attribute)."""
  if node.name in ("main", "build_parser"):
    return False
  read = {n.value.id for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
  for p in params:
    annotation = ast.unparse(p.annotation) if p.annotation is not None else ""
    if (p.arg == "args" and "args" in read) or "Namespace" in annotation:
      return True
  return False


def test_no_parser_namespace_below_a_main():
  """No function of sinkjax/ other than a command's main / build_parser takes the parser's namespace (a parameter
  named `args` or annotated argparse.Namespace; `options.typed` / `options.section_of`, which turn one into typed
  sections, are the only readers), outside the modules listed as not converted yet."""
  takers = {}
  for path in ROOT.rglob("*.py"):
    rel = str(path.relative_to(ROOT))
    found = [node.name for node, params in _function_params(ast.parse(path.read_text()))
             if _takes_namespace(node, params)]
    if found:
      takers[rel] = found
  allowed_readers = {"options.py": ["typed", "section_of"]}
  unexpected = {k: v for k, v in takers.items() if k not in NOT_CONVERTED and allowed_readers.get(k) != v}
  assert unexpected == {}
  stale = sorted(NOT_CONVERTED - set(takers))
  assert stale == [], f"converted now, take them off NOT_CONVERTED: {stale}"


def test_argparse_is_imported_by_the_options_machinery_alone():
  """Commands declare their options (`options.Command`); only errors.py and options.py build parsers, so only they
  import argparse (function-level imports included)."""
  importers = set()
  for path in ROOT.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) else [])
      if "argparse" in names:
        importers.add(str(path.relative_to(ROOT)))
  assert importers == {"errors.py", "options.py"}


def test_library_functions_take_the_typed_sections():
  """The converted commands' library functions name their typed sections (not a namespace)."""
  import inspect
  assert list(inspect.signature(cache_policy.policies_from).parameters)[:3] == ["opts", "cfg", "run_dir"]
  assert inspect.signature(ev.run).parameters["opts"].annotation in ("EvalOptions", ev.EvalOptions)
  for fn, cls in ((gen.run_generate, "GenerateOptions"), (gen.run_chat, "ChatOptions"),
                  (gen.run_perplexity, "PerplexityOptions")):
    assert inspect.signature(fn).parameters["opts"].annotation == cls, fn
  assert inspect.signature(lm_eval.run).parameters["opts"].annotation in ("LMEvalOptions", lm_eval.LMEvalOptions)
  for fn, cls in ((convert_hf.run, "HFConvertOptions"), (convert_nanochat.run, "NanochatConvertOptions"),
                  (fineweb.plan_and_download, "FineWebOptions"),
                  (profile_summary.print_summary, "ProfileSummaryOptions"),
                  (tokenizer_cli.train_and_save, "TokenizerTrainOptions"),
                  (tokenizer_cli.convert_and_save, "FromTiktokenOptions")):
    assert inspect.signature(fn).parameters["opts"].annotation == cls, fn


def test_eval_data_is_the_flag_of_the_run_key_data_source():
  """`--data X` is `data.source=X` (and `--packing P` `data.packing=P`): the flags of the run config's keys, declared
  there once, with no eval.* key for the same thing; the flag wins over the key word, and a bad packing is the
  declaration's one line before any work."""
  assert {f.name for f in dataclasses.fields(ev.EvalOptions)} & {"data", "packing", "source"} == set()
  parser = options.build_parser(ev.COMMAND)
  _, by_flag = options.typed(ev.COMMAND, parser.parse_args(["--data", "docs.jsonl", "--packing", "stream"]))
  _, by_key = options.typed(ev.COMMAND, parser.parse_args(["data.source=docs.jsonl", "data.packing=stream"]))
  assert by_flag == by_key == ["data.source=docs.jsonl", "data.packing=stream"]
  _, both = options.typed(ev.COMMAND, parser.parse_args(["data.source=a.jsonl", "--data", "b.jsonl"]))
  assert both[-1] == "data.source=b.jsonl"
  with pytest.raises(ConfigError, match=r"^config key data.packing \(--packing\) must be one of"):
    options.typed(ev.COMMAND, parser.parse_args(["--packing", "rows"]))


def test_a_positional_word_is_its_key():
  """profile_summary's TRACE_DIR and from-tiktoken's PKL: the one word without "=" sets the key (as its flag does);
  two such words are one line."""
  parser = options.build_parser(profile_summary.COMMAND)
  by_word, _ = options.typed(profile_summary.COMMAND, parser.parse_args(["runs/trace", "--steps", "2"]))
  by_flag, _ = options.typed(profile_summary.COMMAND, parser.parse_args(["--trace", "runs/trace", "--steps", "2"]))
  assert by_word == by_flag and by_word["profile_summary"].trace == "runs/trace"
  with pytest.raises(ConfigError, match="one profile_summary.trace is given without a key, got a b"):
    options.typed(profile_summary.COMMAND, parser.parse_args(["a", "b"]))
  command = tokenizer_cli.COMMANDS["from-tiktoken"]
  sections, _ = options.typed(command, options.build_parser(command).parse_args(["t.pkl", "--out", "d"]))
  assert (sections["from_tiktoken"].pkl, sections["from_tiktoken"].out) == ("t.pkl", "d")


def test_another_spelling_of_a_flag_sets_the_same_key():
  parser = options.build_parser(convert_hf.COMMAND)
  by_gguf, _ = options.typed(convert_hf.COMMAND, parser.parse_args(["--gguf", "m.gguf", "--out", "r"]))
  by_hf_dir, _ = options.typed(convert_hf.COMMAND, parser.parse_args(["--hf-dir", "m.gguf", "--out", "r"]))
  assert by_gguf == by_hf_dir and by_gguf["convert"].hf_dir == "m.gguf"


# A value each kind of option accepts, as typed and as the declaration should read it (independent of the code).
def _sample(f: dataclasses.Field, hint) -> tuple[list[str], str, object]:
  """(flag words, key=value text, expected typed value) for an option."""
  typ, optional = options._base(hint)  # pylint: disable=protected-access
  alias = f.metadata["alias"]
  allowed = list(f.metadata.get("choices") or ())
  if typ is bool:
    return [alias], "true", True
  if typ is list:
    element = typing.get_args(typing.get_args(hint)[0] if optional else hint)
    if allowed:
      return [alias, allowed[-1]], allowed[-1], [allowed[-1]]
    if element == (int,):
      return [alias, "3"], "3", [3]
    return [alias, "a prompt: yes"], "a prompt: yes", ["a prompt: yes"]
  if allowed:
    return [alias, allowed[-1]], allowed[-1], allowed[-1]
  if typ is int:
    return [alias, "3"], "3", 3
  if typ is float:
    return [alias, "0.5"], "0.5", 0.5
  return [alias, "some/dir"], "some/dir", "some/dir"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_flag_and_its_key_give_the_same_typed_section(name, tmp_path):
  """`--flag V`, `section.key=V` and a --config file's `section: {key: V}` give equal typed sections, holding the
  value the declaration's type makes of V; a word of another section is an override of the run."""
  command = COMMANDS[name].COMMAND
  parser = options.build_parser(command)
  for section, f, hint in command.options():
    if "alias" not in f.metadata:
      continue
    flag_words, text, expected = _sample(f, hint)
    run_words = ["model.dtype=float32"] if command.run_overrides else []
    by_flag, overrides = options.typed(command, parser.parse_args(run_words + flag_words))
    by_key, _ = options.typed(command, parser.parse_args([f"{section}.{f.name}={text}"]))
    assert getattr(by_flag[section], f.name) == expected, f.name
    assert by_flag == by_key, f.name
    if command.options_file:
      file = tmp_path / f"{f.name}.yaml"
      as_text = isinstance(expected, str) or (isinstance(expected, list) and isinstance(expected[0], str))
      file.write_text(yaml.safe_dump({section: {f.name: text if as_text else yaml.safe_load(text)}}))
      by_file, _ = options.typed(command, parser.parse_args([command.options_file, str(file)]))
      assert by_file == by_flag, f.name
    assert overrides == run_words
    default = command.sections[section]()
    others = {k: v for k, v in dataclasses.asdict(by_flag[section]).items() if k != f.name}
    assert others == {k: v for k, v in dataclasses.asdict(default).items() if k != f.name}


def test_flags_win_over_key_words_over_the_file(tmp_path):
  file = tmp_path / "eval.yaml"
  file.write_text("eval:\n  tau: 0.1\n  split: all\n  batches: 4\nmodel:\n  dtype: float32\n")
  parser = options.build_parser(ev.COMMAND)
  sections, overrides = options.typed(ev.COMMAND, parser.parse_args(
      ["--config", str(file), "eval.tau=0.2", "eval.batches=5", "--tau", "0.3"]))
  e = sections["eval"]
  assert (e.tau, e.split, e.batches) == (0.3, "all", 5)
  assert overrides == ["model.dtype=float32"]


# Out-of-range and unknown values, and the one line each gives (written out here, not read from the code).
BAD = [
    ("eval", ["--tau", "1.5"], "config key eval.tau (--tau) must be in [0, 1], got 1.5"),
    ("eval", ["eval.batches=0"], "config key eval.batches (--batches) must be >= 1, got 0"),
    ("eval", ["--split", "train"], "config key eval.split (--split) must be one of val|all, got 'train'"),
    ("eval", ["--max-docs", "many"], "config key eval.max_docs (--max-docs) must be int, got 'many'"),
    ("generate generate", ["--top-p", "1.5"], "config key sampling.top_p (--top-p) must be in (0, 1], got 1.5"),
    ("generate perplexity", ["--max-tokens", "1"],
     "config key perplexity.max_tokens (--max-tokens) must be >= 2, got 1"),
    ("generate generate", ["--full-heads-scope", "model"],
     "config key cache.full_heads_scope (--full-heads-scope) must be one of layer|global, got 'model'"),
    ("lm_eval", ["--limit", "0"], "config key lm_eval.limit (--limit) must be > 0, got 0.0"),
    ("lm_eval", ["--bootstrap-iters", "-1"],
     "config key lm_eval.bootstrap_iters (--bootstrap-iters) must be >= 0, got -1"),
    ("eval", ["eval.tua=1"], "unknown option eval.tua; the keys of eval are"),
    ("compile", ["--eval", "0"], "config key compile.eval (--eval) must be >= 1, got 0"),
    ("train", ["train_command.confg=x"],
     "unknown option train_command.confg; the keys of train_command are train_command.config"),
    ("convert.hf", ["--dtype", "float64"],
     "config key convert.dtype (--dtype) must be one of float32|bfloat16|float16, got 'float64'"),
    ("convert.nanochat", ["--step", "-1"], "config key convert.step (--step) must be >= 0, got -1"),
    ("data.fineweb", ["--shards", "1"], "config key fineweb.shards (--shards) must be >= 2, got 1"),
    ("data.acereason", ["--category", "poetry"],
     "config key acereason.category (--category) must be one of math|code, got 'poetry'"),
    ("bench.profile_summary", ["--top", "0"], "config key profile_summary.top (--top) must be >= 1, got 0"),
]
# What each command needs besides the bad value (the value is refused before any of it is used).
REQUIRED = {**{name: ["--checkpoint", "/nonexistent/run"] for name in RUN_COMMANDS},
            "compile": ["--config", "/nonexistent.yaml"], "train": ["--config", "/nonexistent.yaml"],
            "convert.hf": ["--hf-dir", "/nonexistent", "--out", "/x"],
            "convert.nanochat": ["--checkpoint", "/nonexistent", "--out", "/x"], "data.fineweb": ["--out", "/x"],
            "data.acereason": ["--source", "/nonexistent", "--out", "/x"], "bench.profile_summary": ["/nonexistent"]}


@pytest.mark.parametrize("name,argv,message", BAD)
def test_a_bad_value_is_one_line_from_its_declaration(name, argv, message, capsys):
  module = COMMANDS[name]
  with pytest.raises(ConfigError) as e:
    options.typed(module.COMMAND, options.build_parser(module.COMMAND).parse_args(argv))
  assert str(e.value).startswith(message), str(e.value)
  assert module.main(REQUIRED[name] + argv) == 1        # before any work: the value
  err = capsys.readouterr().err
  assert err.strip().splitlines() == [f"sinkjax.{name.split()[0]}: error: {str(e.value)}"], err   # a subcommand's:
                                                                                               # the command's name


def test_every_range_and_choice_is_checked(capsys):
  """Each ranged or enumerated option of every command refuses a value outside its declaration, naming its key."""
  outside = {">=0": "-1", ">=1": "0", ">0": "0", ">=2": "1", "[0,1]": "1.5", "(0,1]": "0"}
  for name, module in COMMANDS.items():
    parser = options.build_parser(module.COMMAND)
    for section, f, _ in module.COMMAND.options():
      bad = outside.get(f.metadata.get("range")) or ("no-such-choice" if f.metadata.get("choices") else None)
      if bad is None:
        continue
      with pytest.raises(ConfigError, match=rf"^config key {section}\.{f.name} \({f.metadata['alias']}\) must be"):
        options.typed(module.COMMAND, parser.parse_args([f"{section}.{f.name}={bad}"]))
  capsys.readouterr()


def test_an_unknown_flag_or_a_missing_checkpoint_is_argparse_one_line(capsys):
  for module in RUN_COMMANDS.values():
    with pytest.raises(SystemExit) as e:
      module.main(["--checkpoint", "x", "--frob"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
      module.main([])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "unrecognized arguments: --frob" in err[0], err
    assert "the following arguments are required: --checkpoint" in err[1], err


def test_a_key_spelling_of_a_required_option_is_enough():
  parser = options.build_parser(ev.COMMAND)
  sections, _ = options.typed(ev.COMMAND, parser.parse_args(["eval.checkpoint=runs/tiny"]))
  assert options.missing(ev.COMMAND, sections) == []
  assert sections["eval"].checkpoint == "runs/tiny"
