"""sinkjax.data.fineweb: the shard plan by hand (nanochat's d20 numbers) and the download against a local HTTP server
serving fake shards (no network): resume, range requests, skip, errors, and the files read as data.source /
data.val_source."""
from __future__ import annotations

import functools
import http.server
import math
import threading

import pytest

from sinkjax import config as config_lib
from sinkjax.errors import UserError
from sinkjax.config import DataConfig
from sinkjax.data import fineweb
from sinkjax.data.sources import build_source, source_documents
from tests.helpers import ROOT


def test_plan_of_d20_by_hand():
  """nanochat's d20 (vocabulary 65,536): 20 layers of 4 d^2 attention + 8 d^2 MLP weights, untied embedding and
  unembedding; 20 tokens per parameter in steps of 524,288 tokens; 4.8 characters per token and 250e6 per shard
  (nanochat's speedrun: 216 shards for d20)."""
  cfg = config_lib.load_config(str(ROOT / "configs" / "paper" / "d20_vanilla_base.yaml"))
  pl = fineweb.plan(cfg, vocab_size=65536)
  d, layers, v = 1280, 20, 65536
  params = layers * (4 * d * d + 2 * 4 * d * d) + 2 * v * d
  assert pl["params"] == params == 560_988_160
  steps = 20 * params // (256 * 2048)
  assert pl["steps"] == steps == 21_400
  assert pl["tokens"] == steps * 256 * 2048
  assert pl["train_shards"] == math.ceil(steps * 256 * 2048 * 4.8 / 250e6) == 216
  assert pl["shards"] == 217
  assert fineweb.shards_for_tokens(250_000_000, chars_per_token=1.0) == 1
  assert fineweb.shards_for_tokens(250_000_001, chars_per_token=1.0) == 2


def test_tokens_for_prints_the_plan(capsys):
  assert fineweb.main(["--tokens-for", str(ROOT / "configs" / "tiny.yaml"), "train.steps=10"]) == 0
  out = capsys.readouterr().out
  # tiny: 10 steps x 16 rows x 256 tokens = 40,960 tokens -> 196,608 characters: one shard + validation
  assert "10 steps x 4,096 tokens = 40,960 tokens" in out and "--shards 2" in out, out


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
  """Serves a directory; answers `Range: bytes=N-` with 206 and the rest of the file; records each request."""

  def __init__(self, *a, log=None, **kw):
    self._log = log
    super().__init__(*a, **kw)

  def do_GET(self):  # noqa: N802
    self._log.append((self.path, self.headers.get("Range")))
    rng = self.headers.get("Range")
    path = self.translate_path(self.path)
    if rng is None:
      return super().do_GET()
    try:
      data = open(path, "rb").read()  # pylint: disable=consider-using-with
    except OSError:
      return self.send_error(404)
    start = int(rng.split("=")[1].rstrip("-"))
    self.send_response(206)
    self.send_header("Content-Length", str(len(data) - start))
    self.end_headers()
    self.wfile.write(data[start:])
    return None

  def log_message(self, *a):
    pass


@pytest.fixture
def server(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  served = tmp_path / "served"
  served.mkdir()
  texts = {}
  for i in (0, 1, fineweb.NUM_SHARDS - 1):
    texts[i] = [f"shard {i} document {j} " * (j + 1) for j in range(5)]
    pq.write_table(pa.table({"text": texts[i]}), served / fineweb.shard_name(i), row_group_size=2)
  log = []
  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_RangeHandler, directory=str(served),
                                                                               log=log))
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{httpd.server_address[1]}", served, texts, log
  httpd.shutdown()


def test_download_resumes_and_skips(tmp_path, server):
  url, served, texts, log = server
  out = tmp_path / "out"
  got = fineweb.download(3, str(out), base_url=url, log=lambda *_: None)
  val = fineweb.shard_name(fineweb.NUM_SHARDS - 1)
  assert got == [f"{out}/shard_00000.parquet", f"{out}/shard_00001.parquet", f"{out}/val/{val}"]
  for i, p in zip((0, 1, fineweb.NUM_SHARDS - 1), got):
    assert open(p, "rb").read() == (served / fineweb.shard_name(i)).read_bytes()
  assert [r for r, _ in log] == ["/shard_00000.parquet", "/shard_00001.parquet", f"/{val}"]
  # the files are a training source and its validation file, as the paper configs read them
  cfg = DataConfig(source=str(out / "shard_*.parquet"), val_source=str(out / "val" / val))
  assert sorted(source_documents(build_source(cfg, "train"))) == sorted(texts[0] + texts[1])
  assert source_documents(build_source(cfg, "val")) == texts[fineweb.NUM_SHARDS - 1]

  log.clear()                                   # complete shards are not fetched again
  fineweb.download(3, str(out), base_url=url, log=lambda *_: None)
  assert log == []

  (out / "shard_00001.parquet").unlink()        # an interrupted download: the first 100 bytes are there
  whole = (served / "shard_00001.parquet").read_bytes()
  (out / "shard_00001.parquet.tmp").write_bytes(whole[:100])
  fineweb.download(3, str(out), base_url=url, log=lambda *_: None)
  assert log == [("/shard_00001.parquet", "bytes=100-")]
  assert (out / "shard_00001.parquet").read_bytes() == whole
  assert not (out / "shard_00001.parquet.tmp").exists()


def test_download_errors_are_one_line(tmp_path, server):
  url, _, _, _ = server
  with pytest.raises(UserError, match=r"shard_00002.parquet answered HTTP 404 .*check --base-url") as e:
    fineweb.download(4, str(tmp_path / "o"), base_url=url, log=lambda *_: None)
  assert "\n" not in str(e.value)
  assert not (tmp_path / "o" / "shard_00002.parquet").exists()
  with pytest.raises(UserError, match=r"--shards must be in \[2, 1823\]"):
    fineweb.download(1, str(tmp_path / "o"))
  sleeps = []
  with pytest.raises(UserError, match=r"failed 5 times .*rerun to resume"):
    fineweb.download_shard(0, str(tmp_path / "p"), base_url="http://127.0.0.1:9", log=lambda *_: None,
                           sleep=sleeps.append)
  assert sleeps == [2, 4, 8, 16]


def test_a_host_that_does_not_resolve_is_told_at_once(tmp_path):
  """No DNS for the host (a closed network; `.invalid` never resolves, RFC 2606): one line at the first attempt, no
  retries (it used to retry for ~30 s before saying anything)."""
  sleeps = []
  with pytest.raises(UserError, match=r"cannot resolve no-such-host\.invalid .*no DNS for it") as e:
    fineweb.download_shard(0, str(tmp_path / "p"), base_url="https://no-such-host.invalid/x", log=lambda *_: None,
                           sleep=sleeps.append)
  assert sleeps == [] and "\n" not in str(e.value)
  assert not list((tmp_path / "p").glob("*.parquet"))
