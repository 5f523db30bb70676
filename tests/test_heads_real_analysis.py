"""Fig. 4 as a study file (configs/studies/heads_fig4.yaml, driver importance): analysis.json and its heatmap, without
the former fine-tuning part's before.json. A tiny byte-level model stands in for SmolLM2
(the slow tests/test_real_model.py runs the documented command on the real one)."""
import json

import matplotlib.image
import numpy as np
from flax import nnx

from sinkjax.config import Config, ModelConfig
from sinkjax.experiments import heads_real, study
from sinkjax.model import Transformer
from sinkjax.run import save_params_run
from tests.helpers import ROOT, call_main, one_error_line


def test_only_analysis_writes_the_fig4_heatmap(tmp_path, monkeypatch, capsys):
  cfg = Config()
  cfg.model = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=257,
                          max_seq_len=256, dtype="float32")
  cfg.data.seq_len = 256
  save_params_run(tmp_path / "run", cfg, Transformer(cfg.model, rngs=nnx.Rngs(0)))
  monkeypatch.setattr(heads_real, "ANALYSIS_DOCS", 16)       # a few documents: the path, not the numbers
  monkeypatch.setattr(heads_real, "HELDOUT_DOCS", 4)
  out = tmp_path / "study"
  args = [ROOT / "configs" / "studies" / "heads_fig4.yaml", f"study.run={tmp_path / 'run'}", f"study.out={out}"]
  assert "analysis.json: to do" in call_main(study.main, [*args, "--dry-run"], capsys).stdout
  res = call_main(study.main, args, capsys)
  assert res.returncode == 0, res.stderr[-2000:]
  analysis = json.loads((out / "analysis.json").read_text())
  assert analysis["documents"] == 16 and np.asarray(analysis["importance"]).shape == (2, 4)
  image = matplotlib.image.imread(out / "results" / "analysis.png")
  assert image.shape[0] > 300 and image.shape[1] > 600 and image[..., :3].std() > 0.05    # a drawn figure
  assert (out / "results" / "analysis.json").is_file()
  assert not (out / "before.json").exists()       # the fine-tuning part did not run
  (out / "results" / "analysis.png").unlink()
  res = call_main(study.main, [*args, "--report-only"], capsys)       # the figure again, from analysis.json alone
  assert res.returncode == 0 and (out / "results" / "analysis.png").is_file()
  assert "random inits [0], not [0, 1]" in one_error_line(call_main(study.main, [*args, "axes.random_init=[0,1]"],
                                                                     capsys))
