"""`python -m sinkjax.data.tokenizer`: nanochat's BPE as a Hugging Face tokenizer.json (for `data.tokenizer`).

    python -m sinkjax.data.tokenizer train --source PATH_OR_GLOB --vocab-size 65536 --out DIR
    python -m sinkjax.data.tokenizer from-tiktoken tokenizer.pkl --out DIR

Both write DIR/tokenizer.json in the layout of nanochat's tokenizer (commit 9d4c9b7, `nanochat/tokenizer.py`):
GPT-4-style byte-level BPE over the pieces of nanochat's split pattern (`SPLIT_PATTERN`: numbers in groups of at most
two digits), no normalizer, and nanochat's nine special tokens after the merged tokens, `<|bos|>` first of them
(a 65,536 vocabulary: 65,527 merged tokens, `<|bos|>` = 65527), which `sinkjax.data.tokenizers` finds as BOS.

- `train`: Hugging Face `tokenizers`' BPE trainer on the documents of `--source` (any `data.source`: .txt / .jsonl /
  .parquet paths or globs, local or gs://; the training split of `--val-fraction`, as the trainer splits it), with
  nanochat's character budget (`scripts/tok_train.py`): each document cut to `--doc-cap` characters (10,000), training
  stops after the document that passes `--max-chars` (2e9, what nanochat's speedrun.sh passes). The merges are
  Hugging Face's, so the ids are not those of a rustbpe training on the same text; the layout and the split are.
- `from-tiktoken`: nanochat's own tokenizer.pkl (a pickled tiktoken `Encoding`; or the directory holding it) as a
  tokenizer.json that gives tiktoken's ids on every text, special tokens included (tiktoken's
  `encode(text, allowed_special="all")`). The pickle is read by an unpickler that builds only tiktoken's Encoding
  state (a dict of bytes and ints): no code of the file runs, and tiktoken need not be installed. Each merged token
  becomes the merges of all its splits into two tokens, in rank order, and the model takes a piece that is a token
  whole (tiktoken's rule), so a Hugging Face BPE merges as tiktoken does: always the pair whose concatenation has the
  lowest rank.
"""
from __future__ import annotations

import dataclasses
import io
import json
import pickle
import sys
from typing import Iterable, Iterator

from sinkjax import errors, options, paths
from sinkjax.config import declare

# nanochat/tokenizer.py (9d4c9b7): every document begins with <|bos|>; the others render conversations.
SPECIAL_TOKENS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                  "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")
# nanochat's GPT-4 pattern with \p{N}{1,2} for \p{N}{1,3} (fewer number tokens for small vocabularies).
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
                 r"""\s*[\r\n]|\s+(?!\S)|\s+""")
MAX_CHARS = 2_000_000_000   # nanochat's speedrun.sh: tok_train --max_chars=2000000000
DOC_CAP = 10_000            # tok_train's --doc_cap


def _tokenizers():
  try:
    import tokenizers  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise errors.UserError("the tokenizers package is not installed; pip install 'sinkjax[hf]'") from None
  return tokenizers


def _byte_level(model, pattern: str):
  """A tokenizer around `model`: pieces of `pattern` (isolated), GPT-2's byte-to-character map, its decoder."""
  tk = _tokenizers()
  tok = tk.Tokenizer(model)
  tok.normalizer = None
  tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
      tk.pre_tokenizers.Split(pattern=tk.Regex(pattern), behavior="isolated", invert=False),
      tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = tk.decoders.ByteLevel()
  tok.post_processor = None
  return tok


def budgeted(documents: Iterable[str], max_chars: int = MAX_CHARS, doc_cap: int = DOC_CAP) -> Iterator[str]:
  """nanochat's tok_train text stream: each document cut to doc_cap characters; ends after the document with which
  the characters seen pass max_chars."""
  seen = 0
  for doc in documents:
    doc = doc[:doc_cap]
    seen += len(doc)
    yield doc
    if seen > max_chars:
      return


def train(documents: Iterable[str], vocab_size: int, progress: bool = False):
  """A `tokenizers.Tokenizer` of vocab_size ids: BPE trained on documents with nanochat's split, byte alphabet and
  special tokens (the last len(SPECIAL_TOKENS) ids)."""
  tk = _tokenizers()
  merged = vocab_size - len(SPECIAL_TOKENS)
  if merged < 256:
    raise errors.UserError(f"--vocab-size {vocab_size} is too small: the 256 bytes and {len(SPECIAL_TOKENS)} special "
                        f"tokens need at least {256 + len(SPECIAL_TOKENS)}")
  # byte_fallback, no unknown token, min_frequency 0: nanochat's HuggingFaceTokenizer.train_from_iterator.
  tok = _byte_level(tk.models.BPE(byte_fallback=True, unk_token=None, fuse_unk=False), SPLIT_PATTERN)
  trainer = tk.trainers.BpeTrainer(vocab_size=merged, show_progress=progress, min_frequency=0,
                                   initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
  tok.train_from_iterator(documents, trainer)
  if tok.get_vocab_size() != merged:
    raise errors.UserError(f"the text yields only {tok.get_vocab_size()} distinct tokens, fewer than the "
                        f"{merged} asked (--vocab-size {vocab_size} less {len(SPECIAL_TOKENS)} special tokens); "
                        "give more text (--source, --max-chars) or a smaller --vocab-size")
  tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
  return tok


def _byte_chars() -> dict[int, str]:
  """GPT-2's byte -> printable character map (the strings of a byte-level vocabulary)."""
  from sinkjax.data.tokenizers import _bytes_to_unicode  # pylint: disable=import-outside-toplevel
  return _bytes_to_unicode()


class _TiktokenEncoding:
  """Stands for tiktoken.core.Encoding while unpickling: keeps the state tiktoken pickles (no code runs)."""

  def __setstate__(self, state):
    self.state = state


class _EncodingUnpickler(pickle.Unpickler):

  def find_class(self, module, name):
    if (module, name) == ("tiktoken.core", "Encoding"):
      return _TiktokenEncoding
    raise pickle.UnpicklingError(f"it holds {module}.{name}, not a tiktoken Encoding")


def read_tiktoken(path: str) -> dict:
  """The state of a pickled tiktoken Encoding (nanochat's tokenizer.pkl, or the directory holding it): name, pat_str,
  mergeable_ranks {bytes: rank}, special_tokens {str: id}."""
  p = paths.as_path(path)
  if p.is_dir():
    p = p / "tokenizer.pkl"
  if not p.is_file():
    raise errors.UserError(f"{path!r} is not a file (or a directory holding tokenizer.pkl); give nanochat's "
                        "tokenizer.pkl")
  try:
    enc = _EncodingUnpickler(io.BytesIO(p.read_bytes())).load()
  except Exception as e:  # pylint: disable=broad-except  # any unreadable pickle is the user's file
    raise errors.UserError(f"{p} is not a pickled tiktoken Encoding ({type(e).__name__}: {e}); give nanochat's "
                        "tokenizer.pkl") from None
  state = getattr(enc, "state", None)
  if isinstance(state, str):
    raise errors.UserError(f"{p} names tiktoken's registered encoding {state!r} instead of holding its ranks; "
                        "convert a pickle of a custom Encoding such as nanochat's")
  if not isinstance(enc, _TiktokenEncoding) or not isinstance(state, dict) or \
      not {"pat_str", "mergeable_ranks", "special_tokens"} <= set(state):
    raise errors.UserError(f"{p} is not a pickled tiktoken Encoding; give nanochat's tokenizer.pkl")
  return state


def from_tiktoken(state: dict):
  """A `tokenizers.Tokenizer` giving the ids of the tiktoken Encoding whose state is given (`read_tiktoken`)."""
  tk = _tokenizers()
  ranks: dict[bytes, int] = state["mergeable_ranks"]
  chars = _byte_chars()
  text = {b: "".join(chars[x] for x in b) for b in ranks}
  merges = []   # (rank of the merged token, left rank, right rank, left, right)
  for b, rank in ranks.items():
    for i in range(1, len(b)):
      left, right = ranks.get(b[:i]), ranks.get(b[i:])
      if left is not None and right is not None and left < rank and right < rank:
        merges.append((rank, left, right, text[b[:i]], text[b[i:]]))
  merges.sort()
  model = tk.models.BPE(vocab={text[b]: r for b, r in ranks.items()}, merges=[(l, r) for *_, l, r in merges],
                        ignore_merges=True, byte_fallback=False, unk_token=None, fuse_unk=False)
  tok = _byte_level(model, state["pat_str"])
  spec = json.loads(tok.to_str())
  spec["added_tokens"] = [{"id": int(i), "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": True}
                          for t, i in sorted(state["special_tokens"].items(), key=lambda kv: kv[1])]
  return tk.Tokenizer.from_str(json.dumps(spec))


def save(tok, out: str) -> str:
  """tok as OUT/tokenizer.json (local or gs://); returns the file's path."""
  path = paths.as_path(out, "--out") / "tokenizer.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(tok.to_str())
  return str(path)


def _summary(tok) -> str:
  added = tok.get_added_tokens_decoder()
  return (f"{tok.get_vocab_size()} ids, special tokens {', '.join(f'{t.content}={i}' for i, t in sorted(added.items()))}"
          if added else f"{tok.get_vocab_size()} ids")


@dataclasses.dataclass
class TokenizerTrainOptions:
  """The train.* options of `python -m sinkjax.data.tokenizer train` (each flag the alias of its key)."""
  source: str = declare("", alias="--source", metavar="PATH_OR_GLOB", required=True,
                    help="documents as data.source: .txt/.jsonl/.parquet path, directory or glob (local or gs://), "
                         "'default' or tfds:NAME")
  vocab_size: int = declare(65536, ">=1", alias="--vocab-size", metavar="N",
                        help="ids in all, the 9 special tokens included (nanochat's)")
  out: str = declare("", alias="--out", metavar="DIR", required=True, help="directory for tokenizer.json")
  max_chars: int = declare(MAX_CHARS, ">=1", alias="--max-chars", metavar="N",
                       help="character budget: stop after the document that passes it")
  doc_cap: int = declare(DOC_CAP, ">=1", alias="--doc-cap", metavar="N", help="characters kept of each document")
  text_field: str = declare("text", alias="--text-field", metavar="F",
                        help="the text column / key of .parquet / .jsonl files")
  val_fraction: float = declare(0.02, "[0,1)", alias="--val-fraction", metavar="F",
                            help="documents left out as the trainer's validation split (data.val_fraction; 0: none)")


@dataclasses.dataclass
class FromTiktokenOptions:
  """The from_tiktoken.* options of `python -m sinkjax.data.tokenizer from-tiktoken PKL --out DIR` (PKL: the one word
  without "=", or --pkl)."""
  pkl: str = declare("", alias="--pkl", metavar="PKL", required=True, help="tokenizer.pkl, or the directory holding it")
  out: str = declare("", alias="--out", metavar="DIR", required=True, help="directory for tokenizer.json")


PROG = "python -m sinkjax.data.tokenizer"
COMMANDS = {
    "train": options.Command(
        prog=f"{PROG} train", sections={"train": TokenizerTrainOptions},
        description="train a BPE on documents (nanochat's split, specials and character budget)"),
    "from-tiktoken": options.Command(
        prog=f"{PROG} from-tiktoken", sections={"from_tiktoken": FromTiktokenOptions}, positional="from_tiktoken.pkl",
        description="nanochat's tokenizer.pkl (pickled tiktoken Encoding) as tokenizer.json"),
}


def main(argv=None) -> int:
  return options.main_of(PROG, __doc__.split("\n\n")[0].split(": ", 1)[1], COMMANDS, argv, {
      "train": lambda sections, _: train_and_save(sections["train"]),
      "from-tiktoken": lambda sections, _: convert_and_save(sections["from_tiktoken"])})


def train_and_save(opts: TokenizerTrainOptions) -> None:
  """Trains on opts.source's training split (nanochat's budget) and writes opts.out/tokenizer.json."""
  from sinkjax.config import DataConfig  # pylint: disable=import-outside-toplevel
  from sinkjax.data import sources  # pylint: disable=import-outside-toplevel
  try:
    src = sources.build_source(DataConfig(source=opts.source, text_field=opts.text_field,
                                          val_fraction=opts.val_fraction), "train")
  except sources.DataError as e:   # its message names the config keys these flags set
    raise errors.UserError(str(e).replace("data.source", "--source").replace("data.val_fraction", "--val-fraction")
                        .replace("data.text_field", "--text-field")) from None
  docs = (d for i in range(len(src)) for d in src[i])
  counted = {"docs": 0, "chars": 0}

  def counting(stream):
    for d in stream:
      counted["docs"] += 1
      counted["chars"] += len(d)
      yield d
  tok = train(counting(budgeted(docs, opts.max_chars, opts.doc_cap)), opts.vocab_size, progress=sys.stderr.isatty())
  print(f"trained on {counted['docs']:,} documents, {counted['chars']:,} characters of {opts.source}")
  print(f"wrote {save(tok, opts.out)}: {_summary(tok)}")


def convert_and_save(opts: FromTiktokenOptions) -> None:
  """opts.pkl (nanochat's tokenizer.pkl) as opts.out/tokenizer.json."""
  tok = from_tiktoken(read_tiktoken(opts.pkl))
  print(f"wrote {save(tok, opts.out)}: {_summary(tok)}")


if __name__ == "__main__":
  sys.exit(main())
