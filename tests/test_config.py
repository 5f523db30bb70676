"""The config as a specification: every numeric key has a range that a loaded config is checked against, a bad value
is one line naming the key (and the file or override it came from) and leaves an existing run directory untouched,
unknown keys get the nearest known ones, and resuming with another step count behaves as documented."""
import dataclasses
import hashlib
import math
import pathlib
import re
import typing

import pytest

from sinkjax import config as config_lib
from sinkjax.config import RANGES, Config, ConfigError, load_config
from sinkjax.train import main as train_main
from sinkjax.train import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=16",
         "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=8", "train.log_every=1", "train.eval_batches=1",
         "train.eval_every=0", "checkpoint.every=100"]

# Values outside each range, written by hand from the range's meaning (not generated from the checker).
BAD = {
    ">=1": ["0", "-1"], ">=0": ["-1", "-5"], ">0": ["0", "-0.5"], "[0,1]": ["-0.1", "1.5"], "[0,1)": ["1.0", "-1"],
    "(0,1)": ["0", "1"], "-1|>=1": ["0", "-2"], "any": [".nan", ".inf"],
}


def _numeric_keys():
  for section, typ in typing.get_type_hints(Config).items():
    for f in dataclasses.fields(typ):
      if typing.get_type_hints(typ)[f.name] in (int, float):
        yield f"{section}.{f.name}"


def _digest(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  for p in sorted(path.rglob("*")):
    h.update(str(p.relative_to(path)).encode())
    if p.is_file():
      h.update(p.read_bytes())
  return h.hexdigest()


def test_every_numeric_key_has_a_range():
  """A numeric key added to the config without a range would escape validation."""
  assert set(_numeric_keys()) == set(RANGES)


def test_each_range_admits_its_default():
  for key in RANGES:
    section, name = key.split(".")
    value = getattr(getattr(Config(), section), name)
    load_config(None, [f"{key}={value}"] + (["model.vocab_size=0"] if key != "model.vocab_size" else []))


@pytest.mark.parametrize("key", sorted(RANGES))
def test_out_of_range_values_are_refused(key):
  for value in BAD[RANGES[key]] + ([".nan"] if isinstance(getattr(getattr(Config(), key.split(".")[0]),
                                                                          key.split(".")[1]), float) else []):
    with pytest.raises(ConfigError, match=rf"config key {key} must be .*got .*\(in the override '{key}="):
      load_config(None, [f"{key}={value}"])


def test_a_config_built_in_code_is_range_checked_too():
  cfg = Config()
  cfg.train.steps = -5
  with pytest.raises(ConfigError, match="train.steps must be >= 0"):
    config_lib.validate(cfg)


def test_unknown_keys_suggest_the_nearest_and_name_their_file(tmp_path):
  with pytest.raises(ConfigError, match=r"unknown config key train.stpes in the override .*did you mean train.steps\?"):
    load_config(None, ["train.stpes=4"])
  with pytest.raises(ConfigError, match=r"model.batch_size .*it belongs in train.batch_size"):
    load_config(None, ["model.batch_size=4"])
  child = tmp_path / "child.yaml"
  child.write_text(f"base: {TINY}\nloss:\n  aux_wieght: 0.1\n")
  with pytest.raises(ConfigError, match=rf"loss.aux_wieght in {child}; did you mean loss.aux_weight\?") as e:
    load_config(str(child))
  assert len(str(e.value)) < 200
  bad = tmp_path / "bad.yaml"
  bad.write_text(f"base: {TINY}\ntrain:\n  steps: -5\n")
  with pytest.raises(ConfigError, match=rf"train.steps must be >= 0, got -5 \(in {bad}\)"):
    load_config(str(bad))



@dataclasses.dataclass
class _Renamed:
  """A section whose key `driver` was once spelled `kind` (as the study files' `study:` section's was)."""
  driver: str = config_lib.declare("paper", formerly="kind")
  out: str = "runs/x"


def test_a_renamed_key_is_refused_in_one_line_naming_its_new_spelling(tmp_path):
  """The old spelling of a key declared `declare(formerly=...)` is an unknown key whose one line names the new one, from
  a file's section (config.apply_section) and from a command's options (options.fill); the new spelling is set."""
  from sinkjax import options
  with pytest.raises(ConfigError, match=r"^unknown config key study.kind in f.yaml; it is study.driver now$"):
    config_lib.apply_section(_Renamed(), {"kind": "dose"}, "f.yaml", "study")
  assert config_lib.apply_section(_Renamed(), {"driver": "dose"}, "f.yaml", "study").driver == "dose"
  with pytest.raises(ConfigError, match=r"^unknown option study.kind; it is study.driver now$"):
    options.fill({"study": _Renamed}, [("study.kind", "dose")])
  with pytest.raises(ConfigError, match=r"^unknown option study.knd; the keys of study are study.driver, study.out$"):
    options.fill({"study": _Renamed}, [("study.knd", "dose")])
  assert config_lib.renamed(_Renamed, "kind") == "driver" and config_lib.renamed(_Renamed, "out") is None

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, compile_cache):
  path = tmp_path_factory.mktemp("run")
  train(load_config(TINY, SMALL + ["train.steps=2", f"run.dir={path}"]), progress=False)
  return path


def test_bad_values_leave_an_existing_run_untouched(run_dir, capsys):
  """`python -m sinkjax.train` with each bad value on an existing run: exit 1, one line naming the key, and the run
  directory byte-for-byte as it was (the incident: train.steps=-5 resumed and rewrote a run)."""
  before = _digest(run_dir)
  for key in sorted(RANGES):
    for value in BAD[RANGES[key]][:1]:
      assert train_main(["--config", TINY, *SMALL, f"run.dir={run_dir}", f"{key}={value}"]) == 1
      err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
      assert len(err) == 1 and key in err[0], (key, err)
  assert _digest(run_dir) == before


def test_resume_with_another_step_count(run_dir, capsys):
  """The run was started with train.steps=2. A count derived from the token budget (train.steps=0) or a lower one
  is refused before anything changes; an explicit higher one extends the run and says so first."""
  before = _digest(run_dir)
  with pytest.raises(ConfigError, match=r"started with train.steps=2, and train.steps=0 now derives \d+"):
    train(load_config(TINY, SMALL + ["train.steps=0", f"run.dir={run_dir}"]), progress=False)
  with pytest.raises(ConfigError, match=r"train.steps=1 is below the 2 steps .* train.stop_at_step=1"):
    train(load_config(TINY, SMALL + ["train.steps=1", f"run.dir={run_dir}"]), progress=False)
  assert _digest(run_dir) == before
  capsys.readouterr()
  out = train(load_config(TINY, SMALL + ["train.steps=3", f"run.dir={run_dir}"]), progress=False)
  assert out["start_step"] == 2 and out["end_step"] == 3
  printed = capsys.readouterr().out
  assert f"extending the run in {run_dir} from 2 to 3 steps" in printed
  assert load_config(str(run_dir / "config.yaml")).train.steps == 3
  capsys.readouterr()
  again = train(load_config(TINY, SMALL + ["train.steps=3", f"run.dir={run_dir}", "train.matrix_lr=0.01"]),
                progress=False)
  assert f"resuming {run_dir} with changed settings: train.matrix_lr 0.02 -> 0.01" in capsys.readouterr().out
  assert again["start_step"] == 3 and math.isfinite(out["final_loss"])


def test_model_section_parts_hold_what_their_users_set():
  """ModelConfig is PaperModel + ImportedArchitecture + NanochatCompatibility + AttentionSection (one flat model.*
  section; each key declared in one part): a Hugging Face import sets no nanochat key, configs/nanochat.yaml no
  import key."""
  transformers = pytest.importorskip("transformers", reason="the import check needs transformers (test extra)")
  from sinkjax import config as C
  from sinkjax.convert.hf import model_config_from_hf
  parts = (C.PaperModel, C.ImportedArchitecture, C.NanochatCompatibility, C.AttentionSection)
  names = [[f.name for f in dataclasses.fields(p)] for p in parts]
  assert sorted(f.name for f in dataclasses.fields(C.ModelConfig)) == sorted(sum(names, []))   # disjoint, complete
  default = C.ModelConfig()
  changed = lambda m: {f.name for f in dataclasses.fields(m) if getattr(m, f.name) != getattr(default, f.name)}
  oss = transformers.GptOssConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=64, head_dim=16,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, num_local_experts=4,
                                  num_experts_per_tok=2)
  got = changed(model_config_from_hf(oss.to_dict()))
  assert got & set(names[1]) and not got & set(names[2])
  got = changed(C.load_config(str(ROOT / "configs" / "nanochat.yaml"), []).model)
  assert got & set(names[2]) and not got & set(names[1])


def test_every_key_is_declared_once_with_its_range_and_choices():
  """CHOICES / RANGES are read from the fields' own declarations (`config.declare`): every numeric field of every section
  has a range, every field with a choices tuple is checked against it at parse time."""
  import dataclasses as dc
  from sinkjax import config as c
  for section in dc.fields(c.Config):
    for f in dc.fields(section.default_factory):
      name = f"{section.name}.{f.name}"
      assert (name in c.RANGES) == ("range" in f.metadata) and (name in c.CHOICES) == ("choices" in f.metadata)
      if f.type in ("int", "float", int, float):                    # every number has a declared range
        assert name in c.RANGES, name
  with pytest.raises(c.ConfigError, match="train.decay_frac must be in \\[0, 1\\]"):
    c.load_config(None, ["train.decay_frac=2"])
  with pytest.raises(c.ConfigError, match="model.mlp must be one of relu2|swiglu"):
    c.load_config(None, ["model.mlp=gelu"])


def test_model_keys_are_flat_and_a_nested_spelling_names_the_flat_key(tmp_path):
  """Each model.* key has one spelling, the flat one (SPEC, docs/TRAINING.md, configs/): a mapping under model
  (`attention: {kind: gated}`, `linear: {key_heads: 2}`) or a dotted `model.attention.kind=` is refused in one line
  that names the flat key to write instead."""
  from sinkjax import config as c
  y = tmp_path / "nested.yaml"
  y.write_text("model:\n  num_layers: 4\n  attention:\n    kind: gated\n    gate: elementwise\n")
  cases = [(str(y), [], "write model.attention.kind as model.attention "),
           (None, ["model.attention.gate=elementwise"], "write model.attention.gate as model.gate "),
           (None, ["model.linear.key_heads=2"], "write model.linear.key_heads as model.linear_key_heads "),
           (None, ["model.moe.experts=4"], "write model.moe.experts as model.moe_experts ")]
  for path, overrides, hint in cases:
    section = hint.split()[1].split(".")[1]
    with pytest.raises(c.ConfigError, match=re.escape(f"config key model.{section} is not a section: the model.* keys "
                                                      f"are flat, {hint}")) as e:
      c.load_config(path, overrides)
    assert "\n" not in str(e.value)
  flat = c.load_config(None, ["model.num_layers=4", "model.attention=gated", "model.gate=elementwise",
                              "model.layer_types=[linear,full,linear,full]", "model.linear_key_heads=2"]).model
  assert (flat.attention, flat.gate, flat.linear_key_heads) == ("gated", "elementwise", 2)


def test_attention_config_is_a_view_of_the_model_config():
  """An `AttentionConfig` holds the model config, not copies of its keys: it reads them under their model.* names
  (a change of the model shows), its own fields are only whether the layer is "full" and o_proj's start; the standalone
  keywords are the same model.* names, and the layer's old names (impl=, use_bias=) are refused naming the new one."""
  from sinkjax import config as c
  m = c.ModelConfig(num_layers=3, sliding_window=4, layer_types=["full", "sliding", "sliding"], attention="gated",
                    attn_impl="xla", rope_scaling="llama3", rope_factor=8.0, max_seq_len=64)
  views = [m.attention_config(i) for i in range(3)]
  assert [f.name for f in dataclasses.fields(c.AttentionConfig)] == ["model", "full", "zero_init_output"]
  assert [v.sliding_window for v in views] == [0, 4, 4] and views[1] == views[2] and views[0] != views[1]
  assert (views[1].attention, views[1].attn_impl, views[1].num_heads) == ("gated", "xla", m.num_heads)
  assert views[1].rope == c.RopeScaling("llama3", 8.0, 1.0, 4.0, 64)       # original context 0 = max_seq_len
  m.gate = "elementwise"
  assert views[1].gate == "elementwise"
  with pytest.raises(AttributeError, match="no 'num_layers'"):
    views[1].num_layers                     # pylint: disable=pointless-statement  (not an attention key)
  one = c.AttentionConfig.of(32, 4, attention="sink", attn_bias=True, sink_init=0.5)
  assert (one.num_kv_heads, one.head_dim, one.dtype, one.attn_bias, one.sink_init, one.sliding_window) == \
      (4, 8, "float32", True, 0.5, 0)
  for old, new in (("impl", "attn_impl"), ("use_bias", "attn_bias")):
    with pytest.raises(TypeError, match=f"the attention keyword {old}= is spelled {new}="):
      c.AttentionConfig.of(32, 4, **{old: "xla"})
  with pytest.raises(c.ConfigError, match="^Attention\\(num_heads=6\\) must be a multiple of num_kv_heads=4$"):
    c.AttentionConfig.of(48, 6, 4)                          # a standalone layer's errors name its keywords
  with pytest.raises(c.ConfigError, match="^model.num_heads \\(6\\) must be a multiple of model.num_kv_heads"):
    c.ModelConfig(d_model=48, num_heads=6, num_kv_heads=4).attention_config()     # a model's its model.* keys


def test_the_one_gpu_d20_command_in_scaling_md_is_d20_gpu_yaml():
  """docs/SCALING.md's command for a paper d20 run on one GPU adds keys to configs/paper/d20_sink_aux.yaml: with them
  its model, train, mesh and data sections are configs/d20_gpu.yaml's but for the variant and the aux loss it
  studies (a change to d20_gpu.yaml that the page does not follow fails here)."""
  text = (ROOT / "docs" / "SCALING.md").read_text()
  m = re.search(r"python -m sinkjax\.train --config (configs/paper/d20_sink_aux\.yaml) (.*?)\\\n\s*(.*?)run\.dir=", text)
  assert m, "SCALING.md: the one-GPU d20 command is gone"
  overrides = (m.group(2) + " " + m.group(3)).split()
  paper = load_config(str(ROOT / m.group(1)), overrides)
  gpu = load_config(str(ROOT / "configs" / "d20_gpu.yaml"), [])
  differ = {f"{sec}.{k}" for sec in ("model", "train", "mesh", "data")
            for k, v in dataclasses.asdict(getattr(paper, sec)).items() if v != dataclasses.asdict(getattr(gpu, sec))[k]}
  assert differ == {"model.attention"}, differ
  assert paper.loss.aux_weight > 0 and gpu.loss.aux_weight == 0
