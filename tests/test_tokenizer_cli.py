"""`python -m sinkjax.data.tokenizer`: a BPE trained on local parquet in nanochat's layout, and nanochat's tiktoken
pickle converted to a tokenizer.json that gives tiktoken's own ids."""
import collections
import os
import pathlib
import pickle
import random

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers")
regex = pytest.importorskip("regex")

from sinkjax.config import DataConfig  # noqa: E402
from sinkjax.data import tokenizer as tokenizer_cli  # noqa: E402
from sinkjax.data.tokenizers import _bytes_to_unicode, build_tokenizer  # noqa: E402
from tests.helpers import one_error_line, run_command, run_ok  # noqa: E402

MODULE = "sinkjax.data.tokenizer"
# nanochat/tokenizer.py at 9d4c9b7, copied as written there: the references for the split and the special tokens.
NANOCHAT_SPLIT = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
NANOCHAT_SPECIALS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                     "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]
TEXT = ("<|bos|>Hello world! This is a test.\nNumbers: 123, 4567, 89\nContractions: I'm, you're, it's, WE'LL\n"
        "Special chars: @#$%^&*()\t\tUnicode: 你好世界 🌍 café\n\n   indented    spaces\r\n"
        "<|user_start|>what is 2+2?<|user_end|><|assistant_start|>4<|assistant_end|>aaaaaaaaaaaa  self.x = f(x)\n")


def _documents(n=40):
  """Deterministic text: Python's own standard-library sources (as sinkjax's `default` data source)."""
  lib = pathlib.Path(os.__file__).parent
  return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(lib.glob("*.py"))[:n]]


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
  path = tmp_path_factory.mktemp("corpus") / "shard_00000.parquet"
  pq.write_table(pa.table({"text": _documents()}), path, row_group_size=8)
  return path


def _pieces_of(tok, text):
  """The pieces tok's pre-tokenizer cuts text into, as text (the byte-level characters mapped back)."""
  back = {c: b for b, c in _bytes_to_unicode().items()}
  return [bytes(back[c] for c in piece).decode("utf-8") for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)]


def test_train_on_parquet_gives_nanochat_layout_bos_and_round_trip(parquet, tmp_path):
  out = tmp_path / "tok"
  r = run_ok(MODULE, "train", "--source", parquet, "--vocab-size", 700, "--out", out, "--max-chars", 150_000,
             "--val-fraction", 0, timeout=120)
  tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
  assert tok.get_vocab_size() == 700
  # nanochat's layout: the merged tokens, then the nine special tokens, <|bos|> first of them.
  assert [tok.id_to_token(700 - 9 + i) for i in range(9)] == NANOCHAT_SPECIALS
  assert sorted(tok.get_added_tokens_decoder()) == list(range(691, 700))
  loaded = build_tokenizer(DataConfig(tokenizer=str(out)))
  assert loaded.vocab_size == 700 and loaded.bos_id == 691 and loaded.add_bos
  ids = loaded.encode(TEXT)
  assert ids.count(691) == 1 and ids[0] == 691                 # the <|bos|> in the text is the special token
  assert tok.decode(ids, skip_special_tokens=False) == TEXT     # lossless, unseen characters included
  plain = "def main(argv):\n    return 12345 + len(argv)  # 你好\n"
  assert loaded.decode(loaded.encode(plain)) == plain
  assert len(loaded.encode(plain)) < len(plain.encode()) * 0.7  # merges learned from the corpus
  # nanochat's split (the regex module, as rustbpe and tiktoken apply the pattern).
  assert _pieces_of(tok, plain + TEXT) == regex.findall(NANOCHAT_SPLIT, plain + TEXT)
  # the character budget: documents cut at --doc-cap, stop after the one that passes --max-chars.
  seen, count = 0, 0
  for d in _documents():
    seen, count = seen + len(d[:10_000]), count + 1
    if seen > 150_000:
      break
  assert f"trained on {count:,} documents, {seen:,} characters" in r.stdout, r.stdout


def _nanochat_ranks(text, merges):
  """Mergeable ranks as nanochat's rustbpe trains them: the 256 bytes, then the most frequent adjacent pair within
  the split's pieces, merged, `merges` times (a pair whose bytes are a token already is passed over)."""
  chunks = collections.Counter(regex.findall(NANOCHAT_SPLIT, text))
  words = [[bytes([b]) for b in c.encode()] for c in chunks]
  ranks = {bytes([i]): i for i in range(256)}
  for _ in range(merges):
    pairs = collections.Counter()
    for w, n in zip(words, chunks.values()):
      for pair in zip(w, w[1:]):
        pairs[pair] += n
    fresh = [(-n, pair) for pair, n in pairs.items() if pair[0] + pair[1] not in ranks]
    if not fresh:
      break
    a, b = min(fresh)[1]
    ranks[a + b] = len(ranks)
    for w in words:
      i = 0
      while i < len(w) - 1:
        if (w[i], w[i + 1]) == (a, b):
          w[i:i + 2] = [a + b]
        i += 1
  return ranks


def test_from_tiktoken_gives_tiktokens_ids(tmp_path):
  tiktoken = pytest.importorskip("tiktoken")
  ranks = _nanochat_ranks("".join(_documents(12))[:60_000], 250)
  # nanochat's RustBPETokenizer.train_from_iterator: the special tokens after the mergeable ranks; save(): pickle.dump.
  specials = {name: len(ranks) + i for i, name in enumerate(NANOCHAT_SPECIALS)}
  enc = tiktoken.Encoding(name="rustbpe", pat_str=NANOCHAT_SPLIT, mergeable_ranks=ranks, special_tokens=specials)
  (tmp_path / "nanochat").mkdir()
  with open(tmp_path / "nanochat" / "tokenizer.pkl", "wb") as f:
    pickle.dump(enc, f)
  run_ok(MODULE, "from-tiktoken", tmp_path / "nanochat", "--out", tmp_path / "tok", timeout=120)
  tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
  assert tok.get_vocab_size() == enc.n_vocab
  expected = enc.encode(TEXT, allowed_special="all")
  assert tok.encode(TEXT, add_special_tokens=False).ids == expected
  assert specials["<|bos|>"] in expected and specials["<|assistant_end|>"] in expected
  loaded = build_tokenizer(DataConfig(tokenizer=str(tmp_path / "tok" / "tokenizer.json")))
  assert loaded.bos_id == specials["<|bos|>"] and loaded.vocab_size == enc.n_vocab
  assert loaded.encode(TEXT) == expected
  # Any text: slices of source code and strings of runs and repeats, which stress the merge order.
  rng = random.Random(0)
  corpus = "".join(_documents(60)[40:])
  alphabet = list("aaabbbeeesst  \n\t0123456789.,'(") + ["é", "你", "🌍", "<|bos|>", "self", "    ", "'ll"]
  texts = [corpus[i:i + rng.randint(1, 300)] for i in (rng.randrange(len(corpus)) for _ in range(400))]
  texts += ["".join(rng.choice(alphabet) * rng.randint(1, 4) for _ in range(rng.randint(1, 30))) for _ in range(2000)]
  for t in texts:
    assert tok.encode(t, add_special_tokens=False).ids == enc.encode(t, allowed_special="all"), repr(t)
  assert tok.decode(expected, skip_special_tokens=False) == enc.decode(expected) == TEXT


class _Mkdir:
  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return os.mkdir, (self.path,)


def _error(capsys, *args, status=1) -> str:
  """The one stderr line of the command run in this process with args, which fails with status."""
  try:
    got = tokenizer_cli.main([str(a) for a in args])
  except SystemExit as e:   # argparse's errors
    got = e.code
  err = capsys.readouterr().err
  assert got == status and err.count("\n") == 1, (got, err)
  return err


def test_errors_are_one_line_and_no_pickled_code_runs(parquet, tmp_path, capsys):
  out = ("--out", tmp_path / "a")
  assert "--vocab-size 200 is too small" in _error(capsys, "train", "--source", parquet, "--vocab-size", 200, *out)
  assert "distinct tokens, fewer than the 4991 asked" in _error(capsys, "train", "--source", parquet, "--vocab-size",
                                                                5000, "--max-chars", 500, *out)
  err = _error(capsys, "train", "--source", tmp_path / "none_*.parquet", *out)
  assert "--source" in err and "matched no files" in err
  (tmp_path / "x.pkl").write_bytes(b"not a pickle")
  assert "is not a pickled tiktoken Encoding" in _error(capsys, "from-tiktoken", tmp_path / "x.pkl", *out)
  evil = tmp_path / "evil.pkl"
  evil.write_bytes(pickle.dumps(_Mkdir(str(tmp_path / "ran"))))
  assert f"holds {os.mkdir.__module__}.mkdir, not a tiktoken Encoding" in _error(capsys, "from-tiktoken", evil, *out)
  assert not (tmp_path / "ran").exists() and not (tmp_path / "a").exists()
  assert "invalid choice: 'frob'" in _error(capsys, "frob", status=2)
  # As a command: the same one line, exit status 1.
  r = run_command(MODULE, "from-tiktoken", tmp_path / "x.pkl", "--out", tmp_path / "a", timeout=60)
  assert "is not a pickled tiktoken Encoding" in one_error_line(r)
