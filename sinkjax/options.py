"""A command's options are typed config sections: one command line for every command that has one.

A command declares its options as dataclasses of `sinkjax.config.declare` fields (name, type, default, range, choices,
help, and the short flag people type as `alias`), one section each (`eval`, `generate`, `cache`, ...), and a
`Command` naming them. Its command line is then

    python -m sinkjax.CMD [--config FILE] [--flag VALUE ...] [section.key=value ...]

where every flag is generated from a key's `alias` (`--tau 0.5` = `eval.tau=0.5`), `--config FILE` is a YAML file of
sections (`eval: {tau: 0.5}`), and a `section.key=value` of a section the command does not declare is an override of
the run's config (`model.dtype=float32`) for commands that load a run (`Command.run_overrides`); a flag may be the
alias of such a key of the run's config itself (`Command.run_keys`: eval's `--data X` = `data.source=X`), and one
word without "=" may set the command's operand (`Command.positional`: a trace directory). Later spellings win:
the file, then the `key=value` words, then the flags. Every value is checked by its declaration (type, range,
choices), so a bad one is one line naming the key and its flag (`sinkjax.errors.run_main`: status 1); an unknown flag
or a missing required option is argparse's one line and status 2. The command's function receives the typed
sections and the run overrides, never the parser's namespace.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing

import yaml

from sinkjax import config, errors, paths
from sinkjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Command:
  """A command line: its program name, description, option sections ({name: dataclass of `config.declare` fields}) and
  whether other `section.key=value` words are overrides of the run's config (`run_overrides`)."""
  prog: str
  description: str
  sections: dict
  run_overrides: bool = False
  raw_description: bool = False          # the description printed as written (its own line breaks), not re-wrapped
  options_file: str | None = "--config"   # the flag of a YAML file of option sections (None: a command whose
                                          # --config is a run's config, sinkjax.compile, has none)
  positional: str | None = None           # the key ("section.key") a word without "=" sets: the one operand a command
                                          # names without a flag (a trace directory, a file to convert)
  run_keys: tuple = ()                    # keys of the run's config ("data.source") that have a flag here (the key's
                                          # alias in sinkjax.config): the flag is that key's override, not a second key

  def options(self):
    """(section, field, type hint) of every declared option, in declaration order."""
    return _declared(self.sections)

  def run_options(self):
    """(section, field, type hint) of each of `run_keys`, as the run's config declares it."""
    sections = {f.name: f.default_factory for f in dataclasses.fields(config.Config)}
    for name in self.run_keys:
      section, field = name.split(".")
      yield next(d for d in _declared({section: sections[section]}) if d[1].name == field)


def _declared(classes: dict):
  """(section, field, type hint) of every field of the sections {name: dataclass}."""
  for section, cls in classes.items():
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      yield section, f, hints[f.name]


def _base(hint):
  """The value type of a key's hint: `int | None` -> (int, True); `list[str]` -> (list, False)."""
  args = typing.get_args(hint)
  optional = type(None) in args
  if optional:
    hint = next(a for a in args if a is not type(None))
  return (typing.get_origin(hint) or hint), optional


def _label(section: str, f: dataclasses.Field) -> str:
  alias = f.metadata.get("alias")
  return f"{section}.{f.name}" + (f" ({alias})" if alias else "")


def _help(section: str, f: dataclasses.Field, hint) -> str:
  text = f.metadata["help"]
  typ, _ = _base(hint)
  value = f.default_factory() if f.default is dataclasses.MISSING else f.default   # a list: its factory's
  shown = value not in (None, "", False, []) and typ is not bool
  default = f"; default {', '.join(map(str, value)) if typ is list else value}" if shown else ""
  return f"{text} [{section}.{f.name}{default}]".replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser, section: str, cls) -> None:
  """One flag per declared alias of the section `cls` (its help from the declaration, the key it sets in brackets),
  storing the value's text under "section.key" (absent when not given); `typed` / `section_of` check it."""
  for _, f, hint in _declared({section: cls}):
    alias = f.metadata.get("alias")
    if alias is None:
      continue
    alias = (alias, *f.metadata.get("other_aliases", ()))   # every spelling of the one flag
    typ, _ = _base(hint)
    common = dict(dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                  help=_help(section, f, hint) if "help" in f.metadata else argparse.SUPPRESS)
    if typ is bool:
      parser.add_argument(*alias, action="store_const", const="true", **common)
    elif typ is list:                  # repeatable; "+": several values after one flag too
      parser.add_argument(*alias, action="extend" if f.metadata.get("nargs") == "+" else "append",
                          nargs=f.metadata.get("nargs"), metavar=f.metadata.get("metavar"), **common)
    else:
      choices = f.metadata.get("choices")
      metavar = f.metadata.get("metavar") or ("|".join(choices) if choices else f.name.upper())
      if "const" in f.metadata:         # the flag alone means `const`
        common.update(nargs="?", const=f.metadata["const"])
      parser.add_argument(*alias, metavar=metavar, **common)


def _formatter(command: Command) -> type:
  return argparse.RawDescriptionHelpFormatter if command.raw_description else argparse.HelpFormatter


def build_parser(command: Command) -> errors.Parser:
  """The argparse parser of `command`: --config, the flags of every section (`add_flags`) and the section.key=value
  words. Values stay strings here; `typed` checks them."""
  p = errors.Parser(prog=command.prog, description=command.description, formatter_class=_formatter(command))
  _add_options(p, command)
  return p


def _add_options(p: argparse.ArgumentParser, command: Command) -> None:
  if command.options_file:
    p.add_argument(command.options_file, dest="options_file", metavar="FILE", default=argparse.SUPPRESS,
                   help="a YAML file of option sections (" + ", ".join(f"{s}:" for s in command.sections)
                   + "); flags and key=value words win over it")
  for section, cls in command.sections.items():
    add_flags(p, section, cls)
  for section, f, _ in command.run_options():   # the run's value unless given
    choices = f.metadata.get("choices")
    p.add_argument(f.metadata["alias"], dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                   metavar=f.metadata.get("metavar") or ("|".join(choices) if choices else f.name.upper()),
                   help=f"{f.metadata['help']} [{section}.{f.name}; default: the run's]".replace("%", "%%"))
  what = ("an option of this command (" + ", ".join(f"{s}.*" for s in command.sections) + ")"
          + (", or an override of the run's config (e.g. model.dtype=float32)" if command.run_overrides else ""))
  if command.positional:
    section, name = command.positional.split(".")
    f = next(f for f in dataclasses.fields(command.sections[section]) if f.name == name)
    operand = f.metadata.get("metavar") or name.upper()
    what = f"{operand} (= {command.positional}), or {what}"
  p.add_argument("words", nargs="*", metavar=f"{operand}|section.key=value" if command.positional
                 else "section.key=value", default=[], help=what)


def _coerce(section: str, f: dataclasses.Field, hint, value):
  """One option's value, checked by its declaration (a ConfigError names the key and its flag)."""
  typ, optional = _base(hint)
  label = _label(section, f)
  if optional and (value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null"))):
    return None
  if typ is list:                      # list[int]: each element an int (list: strings)
    element = (typing.get_args(typing.get_args(hint)[0] if optional else hint) or (str,))[0]
    if isinstance(value, str) and value.lstrip().startswith("["):
      try:
        value = yaml.safe_load(value)
      except yaml.YAMLError:
        pass                          # not a YAML list: the text is the one value
    if not isinstance(value, list):   # one value: a list of one
      value = [value]
    return [config._coerce(label, v, element, f.metadata) for v in value]  # pylint: disable=protected-access
  return config._coerce(label, value, typ, f.metadata)  # pylint: disable=protected-access


def _file_words(path: str, command: Command) -> list[tuple[str, object]]:
  """(section.key, value) of a --config YAML file of sections."""
  file = paths.as_path(path, "--config")
  if not file.is_file():
    raise ConfigError(f"--config file {path} does not exist")
  tree = config.read_yaml_file(file, "--config file") or {}
  if not isinstance(tree, dict) or not all(isinstance(v, dict) for v in tree.values()):
    raise ConfigError(f"--config file {path} must be a mapping of sections ("
                      + ", ".join(f"{s}:" for s in command.sections) + ") to mappings of keys")
  return [(f"{section}.{name}", value) for section, keys in tree.items() for name, value in keys.items()]


def _as_text(value) -> str:
  """A YAML value as the text of a `key=value` word (`[1, 2]`, `true`, `1.5`)."""
  return yaml.safe_dump(value, default_flow_style=True).removesuffix("...\n").strip()


def typed(command: Command, namespace: argparse.Namespace) -> tuple[dict, list[str]]:
  """({section: typed section}, run overrides) from a parsed command line; every value checked by its declaration
  (ConfigError, one line: status 1 under `errors.run_main`)."""
  values = vars(namespace)
  words = _file_words(values["options_file"], command) if "options_file" in values else []
  bare = [word for word in values["words"] if "=" not in word]
  if command.positional and len(bare) > 1:
    raise ConfigError(f"one {command.positional} is given without a key, got {' '.join(bare)}")
  words += [(command.positional, word) if command.positional and "=" not in word else config.parse_override(word)
            for word in values["words"]]
  run_flags = {f"{s}.{f.name}": (s, f, hint) for s, f, hint in command.run_options()}
  for name, (section, f, hint) in run_flags.items():   # a run key's flag: that key's override, checked now
    if name in values:
      _coerce(section, f, hint, values[name])
      words.append((name, values[name]))
  given, overrides = [], []
  for name, value in words:
    if name.split(".")[0] in command.sections:
      given.append((name, value))
    elif command.run_overrides:       # the run's config: a YAML value back as the text an override carries
      overrides.append(f"{name}={value if isinstance(value, str) else _as_text(value)}")
    else:
      raise ConfigError(f"{name}={value} is not an option of this command: its keys are "
                        + ", ".join(f"{s}.*" for s in command.sections) + " (see --help)")
  given += [(k, v) for k, v in values.items() if k not in ("options_file", "words", *run_flags)]
  return fill(command.sections, given), overrides


def fill(classes: dict, given: list[tuple[str, object]]) -> dict:
  """{section: cls()} of `classes` with each (section.key, value) of `given` checked by its declaration and set in
  order (a command line's sections, a study file's own sections: `runner.Plan.options`)."""
  fields = {f"{s}.{f.name}": (s, f, hint) for s, f, hint in _declared(classes)}
  sections = {name: cls() for name, cls in classes.items()}
  for name, value in given:
    if name not in fields:
      section, _, leaf = name.partition(".")
      new = config.renamed(classes[section], leaf) if section in classes else None
      keys = [k for k in fields if k.startswith(section + ".")]
      raise ConfigError(f"unknown option {name}; " + (f"it is {section}.{new} now" if new else
                                                      f"the keys of {section} are {', '.join(keys)}"))
    section, f, hint = fields[name]
    setattr(sections[section], f.name, _coerce(section, f, hint, value))
  return sections


def section_of(namespace: argparse.Namespace, section: str, cls):
  """The typed section `cls` from the flags `add_flags` put on a parser of the caller's own (its "section.key"
  attributes), checked by the declarations: where a command keeps its own parser, its main turns the flags into
  the section before calling anything below it."""
  prefix = section + "."
  return fill({section: cls}, [(k, v) for k, v in vars(namespace).items() if k.startswith(prefix)])[section]


def missing(command: Command, sections: dict) -> list[str]:
  """The required options left unset (their flags, or their keys where they have none)."""
  return [f.metadata.get("alias") or f"{s}.{f.name}" for s, f, _ in command.options()
          if f.metadata.get("required") and getattr(sections[s], f.name) in (None, "")]


def main(command: Command, argv, fn, extra_errors: tuple = ()) -> int:
  """Parses `argv` for `command` (argparse errors: one line, status 2) and runs fn(sections, overrides) under
  `errors.run_main` (one line and status 1 for a UserError or one of `extra_errors`), after the declarations checked
  every value (a bad one: one line, status 1)."""
  parser = build_parser(command)
  return _run(command, parser, parser.parse_args(argv), fn, command.prog, extra_errors)


def main_of(prog: str, description: str, commands: dict, argv, fns: dict, extra_errors: tuple = ()) -> int:
  """`main` of a command of subcommands (`python -m sinkjax.data.tokenizer train ...`): `commands` {name: Command},
  `fns` {name: fn(sections, overrides)}; the first word picks one (another: argparse's one line, status 2)."""
  parser = errors.Parser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="subcommand", metavar="|".join(commands), required=True, parser_class=errors.Parser)
  parsers = {}
  for name, command in commands.items():
    parsers[name] = sub.add_parser(name, prog=command.prog, help=command.description,
                                   description=command.description, formatter_class=_formatter(command))
    _add_options(parsers[name], command)
  parser.epilog = "commands (each with --help):\n" + "".join(  # every subcommand's flags on the command's --help
      "  " + p.format_usage().removeprefix("usage: ") for p in parsers.values())
  namespace = parser.parse_args(argv)
  name = vars(namespace).pop("subcommand")
  return _run(commands[name], parsers[name], namespace, fns[name], prog, extra_errors)


def _run(command: Command, parser, namespace, fn, prog: str, extra_errors: tuple) -> int:
  prog = prog.removeprefix("python -m ")

  def checked():
    sections, overrides = typed(command, namespace)
    absent = missing(command, sections)
    if absent:
      parser.error(f"the following arguments are required: {', '.join(absent)}")
    return fn(sections, overrides)
  return errors.run_main(prog, checked, extra_errors)
