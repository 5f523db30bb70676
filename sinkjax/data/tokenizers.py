"""Tokenizers for `data.tokenizer`: `bytes` (default) or a Hugging Face `tokenizer.json`.

Both expose `vocab_size`, `bos_id`, `encode(text) -> list[int]` (no BOS added), `decode(ids) -> str` (BOS and other
special tokens dropped), `token_bytes` (np.int32 [vocab_size]: UTF-8 byte length of each token, 0 for specials) and
`encode_with_bytes(text) -> (ids, nbytes)` used by the pipeline, where `nbytes[i]` is the number of UTF-8 bytes of
`text` attributed to token i and `nbytes.sum() == len(text.encode())` always (so BPB is exact):

- `bytes`: ids 0..255 are the UTF-8 bytes, BOS = 256, vocab_size = 257; every token is one byte.
- Hugging Face: when the table `token_bytes[ids]` already sums to the document's byte count (byte-level BPE such as
  GPT-2's, or any lossless tokenizer) it is used as is; otherwise (normalizers, pre-tokenizers that drop text, unknown
  tokens) the bytes are attributed from the tokens' character offsets, each byte to the first token whose span
  reaches it, text not covered by any token going to the next token (or the last one).
  BOS: the first special token of the tokenizer's post-processor template if it has one (e.g. Llama's
  `<|begin_of_text|>`), else the first present of `<|begin_of_text|>`, `<|bos|>`, `<bos>`, `<s>`, `[BOS]`,
  `<|startoftext|>`, `<|endoftext|>`, `[CLS]`; if none exists a new id equal to the tokenizer's size is added
  (vocab_size grows by one; decode drops it).
"""
from __future__ import annotations

import json
import re

import numpy as np

from sinkjax import paths
from sinkjax.data.sources import DataError

_BOS_CANDIDATES = ("<|begin_of_text|>", "<|bos|>", "<bos>", "<s>", "[BOS]", "<|startoftext|>", "<|endoftext|>",
                   "[CLS]")


def clean_text(text: str) -> str:
  """`text` made encodable as UTF-8 (lone surrogates, e.g. from JSON escapes, become U+FFFD)."""
  try:
    text.encode("utf-8")
    return text
  except UnicodeEncodeError:
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _utf8(text: str) -> bytes:
  try:
    return text.encode("utf-8")
  except UnicodeEncodeError:
    return clean_text(text).encode("utf-8")


class ByteTokenizer:
  """UTF-8 bytes: ids 0..255, BOS = 256."""

  name = "bytes"
  vocab_size = 257
  bos_id = 256

  def __init__(self):
    self.token_bytes = np.array([1] * 256 + [0], np.int32)

  def encode(self, text: str) -> list[int]:
    return list(_utf8(text))

  def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    ids = np.frombuffer(_utf8(text), np.uint8).astype(np.int32)
    return ids, np.ones_like(ids)

  def decode(self, ids) -> str:
    return bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256).decode("utf-8", "replace")

  def __repr__(self) -> str:
    return "ByteTokenizer(vocab_size=257, bos_id=256)"


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte <-> printable-unicode table used by byte-level BPE vocabularies."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def _component_types(node) -> set[str]:
  """All `type` values in a tokenizer.json component (recursing into Sequence)."""
  out = set()
  if isinstance(node, dict):
    if "type" in node:
      out.add(node["type"])
    for v in node.values():
      out |= _component_types(v)
  elif isinstance(node, list):
    for v in node:
      out |= _component_types(v)
  return out


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer loaded from tokenizer.json."""

  def __init__(self, path: str):
    try:
      import tokenizers  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise DataError("data.tokenizer names a tokenizer.json, which needs the tokenizers package; "
                      "pip install tokenizers") from None
    self.name = path
    try:
      self._json = paths.as_path(path).read_bytes().decode("utf-8")
      self._tok = tokenizers.Tokenizer.from_str(self._json)
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(f"data.tokenizer {path!r} is not a valid Hugging Face tokenizer.json "
                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                      "give 'bytes' or a tokenizer.json path") from None
    self._setup()

  def __getstate__(self):
    return {"name": self.name, "_json": self._json}

  def __setstate__(self, state):
    import tokenizers  # pylint: disable=import-outside-toplevel
    self.name, self._json = state["name"], state["_json"]
    self._tok = tokenizers.Tokenizer.from_str(self._json)
    self._setup()

  def _setup(self):
    spec = json.loads(self._json)
    vocab = self._tok.get_vocab(with_added_tokens=True)
    base_size = max(vocab.values()) + 1 if vocab else 0
    added = self._tok.get_added_tokens_decoder()
    self._special_ids = {i for i, t in added.items() if t.special}
    bos = None
    template = (spec.get("post_processor") or {})
    for proc in [template] + list(template.get("processors", []) or []):
      single = proc.get("single") if isinstance(proc, dict) else None
      if isinstance(single, list) and single and isinstance(single[0], dict) and "SpecialToken" in single[0]:
        bos = vocab.get(single[0]["SpecialToken"].get("id"))
        if bos is not None:
          break
    if bos is None:
      for cand in _BOS_CANDIDATES:
        if cand in vocab:
          bos = vocab[cand]
          break
    self._extra_bos = bos is None
    self.bos_id = base_size if bos is None else int(bos)
    self.vocab_size = base_size + (1 if self._extra_bos else 0)
    self._special_ids.add(self.bos_id)

    # UTF-8 byte length of every token, for the table and for decoding-free byte accounting.
    types = _component_types(spec.get("decoder")) | _component_types(spec.get("pre_tokenizer"))
    byte_level = "ByteLevel" in types
    byte_dec = {c: b for b, c in _bytes_to_unicode().items()}
    metaspace = "Metaspace" in types
    wordpiece = (spec.get("model") or {}).get("type") == "WordPiece"
    prefix = (spec.get("model") or {}).get("continuing_subword_prefix") or "##"
    byte_fallback = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
    table = np.zeros(self.vocab_size, np.int32)
    for token, i in vocab.items():
      if i in self._special_ids:
        continue
      if byte_level and all(ch in byte_dec for ch in token):
        n = len(token)
      elif byte_fallback.match(token):
        n = 1
      else:
        t = token
        if metaspace:
          t = t.replace("\u2581", " ")
        if wordpiece and t.startswith(prefix):
          t = t[len(prefix):]
        n = len(t.encode("utf-8", "surrogatepass"))
      table[i] = n
    self.token_bytes = table

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(clean_text(text), add_special_tokens=False).ids

  def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    text = clean_text(text)
    enc = self._tok.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int32)
    total = len(text.encode("utf-8"))
    if len(ids) == 0:
      return ids, np.zeros(0, np.int32)
    nbytes = self.token_bytes[ids]
    if int(nbytes.sum()) == total:
      return ids, nbytes.astype(np.int32)
    # Offsets are character offsets into `text`: map them to byte offsets.
    char_bytes = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text)) if not text.isascii() \
        else np.ones(len(text), np.int64)
    byte_at = np.concatenate([[0], np.cumsum(char_bytes)])
    ends = byte_at[np.asarray([e for _, e in enc.offsets], np.int64)]
    reach = np.maximum.accumulate(ends)
    counts = np.diff(np.concatenate([[0], reach]))
    counts[-1] += total - reach[-1]
    return ids, counts.astype(np.int32)

  def decode(self, ids) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1) if not (self._extra_bos and int(i) == self.bos_id)]
    return self._tok.decode(ids, skip_special_tokens=True)

  def __repr__(self) -> str:
    return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id})"


def build_tokenizer(data_cfg):
  """`data.tokenizer`: 'bytes' or the path of a Hugging Face tokenizer.json (or a directory holding one)."""
  spec = (data_cfg.tokenizer or "bytes").strip()
  if spec == "bytes":
    return ByteTokenizer()
  try:
    p = paths.as_path(spec, "data.tokenizer")
  except paths.StorageError as e:
    raise DataError(str(e)) from None
  if p.is_dir() and (p / "tokenizer.json").is_file():
    p = p / "tokenizer.json"
  path = str(p)
  if not p.is_file():
    raise DataError(f"data.tokenizer {spec!r} does not exist; give 'bytes' or the path of a Hugging Face "
                    "tokenizer.json")
  return HFTokenizer(path)
