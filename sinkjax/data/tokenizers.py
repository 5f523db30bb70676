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

The special tokens a tokenizer's model uses live here too, read from the files beside tokenizer.json (a Hugging Face
model's tokenizer_config.json, generation_config.json, chat_template.jinja, config.json):
- `add_bos`: whether a document or prompt gets BOS prepended. A model's tokenizer (its directory has a
  tokenizer_config.json) adds one only where its own encoding does: `add_bos_token` when the config sets it, else its
  post-processor's template (Llama 3: yes; Qwen, SmolLM2: no). A bare tokenizer.json (sinkjax's own trained or
  nanochat's BPE) and the bytes tokenizer keep sinkjax's BOS-separated documents. `data.add_bos` overrides (auto |
  true | false).
- `eos_ids` (the tokenizer's eos_token first, then generation_config.json's / config.json's eos_token_id) and
  `stop_ids`, what generation stops at (generation_config.json's eos ids as transformers' `generate`; else the
  eos_token; else BOS, the end of a sinkjax document).
- `chat`: a `ChatTemplate`, the tokenizer's own chat template (tokenizer_config.json's `chat_template` or
  chat_template.jinja) rendered as transformers renders it, or sinkjax's plain "User: ... / Assistant: ..." layout
  for a tokenizer that has none. A tokenizer that has one never gets another layout.
- `side_files`: those files' contents, so an export writes them back.
"""
from __future__ import annotations

import datetime
import json
import re

import numpy as np

from sinkjax import paths
from sinkjax.choices import ADD_BOS
from sinkjax.data.sources import DataError

_BOS_CANDIDATES = ("<|begin_of_text|>", "<|bos|>", "<bos>", "<s>", "[BOS]", "<|startoftext|>", "<|endoftext|>",
                   "[CLS]")


SIDE_FILES = ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json", "chat_template.jinja")
_PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


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

  def __init__(self, add_bos: bool = True):
    self.token_bytes = np.array([1] * 256 + [0], np.int32)
    self.add_bos = add_bos
    self.eos_ids, self.stop_ids = [], [self.bos_id]
    self.chat = ChatTemplate(None)
    self.side_files = {}

  def encode(self, text: str) -> list[int]:
    return list(_utf8(text))

  def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    ids = np.frombuffer(_utf8(text), np.uint8).astype(np.int32)
    return ids, np.ones_like(ids)

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    del skip_special_tokens                   # BOS has no text
    return bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256).decode("utf-8", "replace")

  def encode_document(self, text: str) -> list[int]:
    return _with_bos(self, self.encode(text))

  @property
  def eot_id(self) -> int:
    return self.bos_id

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

  def __init__(self, path: str, add_bos: str = "auto"):
    try:
      import tokenizers  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise DataError("data.tokenizer names a tokenizer.json, which needs the tokenizers package; "
                      "pip install tokenizers") from None
    self.name, self._add_bos = path, add_bos
    try:
      self._json = paths.as_path(path).read_bytes().decode("utf-8")
      self._tok = tokenizers.Tokenizer.from_str(self._json)
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(f"data.tokenizer {path!r} is not a valid Hugging Face tokenizer.json "
                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                      "give 'bytes' or a tokenizer.json path") from None
    self.side_files = _read_side_files(paths.as_path(path).parent)
    self._setup()

  def __getstate__(self):
    return {"name": self.name, "_json": self._json, "side_files": self.side_files, "add_bos": self._add_bos}

  def __setstate__(self, state):
    import tokenizers  # pylint: disable=import-outside-toplevel
    self.name, self._json = state["name"], state["_json"]
    self.side_files, self._add_bos = state["side_files"], state["add_bos"]
    self._tok = tokenizers.Tokenizer.from_str(self._json)
    self._setup()

  def _setup(self):
    spec = json.loads(self._json)
    vocab = self._tok.get_vocab(with_added_tokens=True)
    base_size = max(vocab.values()) + 1 if vocab else 0
    added = self._tok.get_added_tokens_decoder()
    self._special_ids = {i for i, t in added.items() if t.special}
    tc = _json_file(self.side_files, "tokenizer_config.json")
    bos, template_bos = None, False
    template = (spec.get("post_processor") or {})
    for proc in [template] + list(template.get("processors", []) or []):
      single = proc.get("single") if isinstance(proc, dict) else None
      if isinstance(single, list) and single and isinstance(single[0], dict) and "SpecialToken" in single[0]:
        bos = vocab.get(single[0]["SpecialToken"].get("id"))
        if bos is not None:
          template_bos = True
          break
    if bos is None and _token_text(tc.get("bos_token")) in vocab:
      bos = vocab[_token_text(tc.get("bos_token"))]
    if bos is None:
      for cand in _BOS_CANDIDATES:
        if cand in vocab:
          bos = vocab[cand]
          break
    self._extra_bos = bos is None
    self.bos_id = base_size if bos is None else int(bos)
    self.vocab_size = base_size + (1 if self._extra_bos else 0)
    self._special_ids.add(self.bos_id)
    self.is_model_tokenizer = "tokenizer_config.json" in self.side_files
    if self._add_bos != "auto":
      self.add_bos = self._add_bos == "true"
    elif isinstance(tc.get("add_bos_token"), bool):
      self.add_bos = tc["add_bos_token"]
    else:
      self.add_bos = template_bos or not self.is_model_tokenizer
    eos = []
    if _token_text(tc.get("eos_token")) in vocab:
      eos.append(vocab[_token_text(tc["eos_token"])])
    generation = []
    for name in ("generation_config.json", "config.json"):
      generation = _ids(_json_file(self.side_files, name).get("eos_token_id"))
      if generation:
        break
    self.eos_ids = eos + [i for i in generation if i not in eos]
    self.stop_ids = generation or eos or [self.bos_id]
    self.chat = ChatTemplate.from_files(self.side_files)

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

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    """The text of `ids`; special tokens dropped unless `skip_special_tokens` is False (generated text shows them)."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1) if not (self._extra_bos and int(i) == self.bos_id)]
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

  def encode_document(self, text: str) -> list[int]:
    """A document or prompt as the model reads it: BOS first where `add_bos`."""
    return _with_bos(self, self.encode(text))

  @property
  def eot_id(self) -> int:
    """The end-of-text token: the tokenizer's EOS, else BOS (sinkjax's document separator)."""
    return self.eos_ids[0] if self.eos_ids else self.bos_id

  def token_text(self, token_id: int) -> str | None:
    return self._tok.id_to_token(int(token_id))

  def __repr__(self) -> str:
    return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id})"


def vocabulary(tok) -> dict[str, int] | None:
  """token -> id of a tokenizer (added and special tokens included); None for bytes (ids are the bytes)."""
  if isinstance(tok, ByteTokenizer):
    return None
  return tok._tok.get_vocab(with_added_tokens=True)  # pylint: disable=protected-access


def same_vocabulary(a, b) -> bool:
  """Whether two tokenizers map the same text pieces to the same ids (the same embedding rows): both bytes, or two
  Hugging Face tokenizers with one token -> id table and the same BOS."""
  if isinstance(a, ByteTokenizer) or isinstance(b, ByteTokenizer):
    return isinstance(a, ByteTokenizer) and isinstance(b, ByteTokenizer)
  return a.vocab_size == b.vocab_size and a.bos_id == b.bos_id and vocabulary(a) == vocabulary(b)


def _with_bos(tok, ids: list[int]) -> list[int]:
  return [tok.bos_id] + list(ids) if tok.add_bos else list(ids)


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
  value = value.get("content") if isinstance(value, dict) else value
  return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
  if isinstance(value, bool):
    return []
  if isinstance(value, int):
    return [value]
  if isinstance(value, list):
    return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
  return []


def _read_side_files(folder) -> dict[str, str]:
  """The text of the Hugging Face files beside a tokenizer.json (those of SIDE_FILES present, and config.json)."""
  out = {}
  for name in SIDE_FILES + ("config.json",):
    try:
      p = folder / name
      if p.is_file():
        out[name] = p.read_text(encoding="utf-8")
    except OSError:
      pass
  return out


def _json_file(files: dict, name: str) -> dict:
  try:
    value = json.loads(files[name]) if name in files else {}
  except ValueError:
    raise DataError(f"the tokenizer's {name} is not valid JSON; fix or remove it") from None
  return value if isinstance(value, dict) else {}


class ChatTemplate:
  """A conversation ([{role, content}, ...]) as text: the tokenizer's Jinja chat template, rendered as transformers'
  `apply_chat_template` renders it (Jinja's sandbox, trim_blocks / lstrip_blocks, its `raise_exception`, `tojson`,
  `strftime_now`, bos_token / eos_token), or with `template` None sinkjax's plain layout
  "User: ...\n\nAssistant: ...\n\n". Rendered text is tokenized without adding special tokens, as transformers
  does: the template writes whatever BOS its model wants."""

  def __init__(self, template: str | None, special: dict | None = None):
    self.source, self.special = template, dict(special or {})
    self._template = None
    if template is not None:
      try:
        import jinja2.ext  # pylint: disable=import-outside-toplevel
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=import-outside-toplevel
      except ImportError:
        raise DataError("the tokenizer has a chat template, which needs jinja2; pip install jinja2") from None
      env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
      env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
          x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
      env.globals["raise_exception"] = _raise
      env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
      try:
        self._template = env.from_string(template)
      except jinja2.TemplateError as e:
        raise DataError(f"the tokenizer's chat template does not parse ({e}); fix or remove it") from None

  @classmethod
  def from_files(cls, files: dict) -> "ChatTemplate":
    tc = _json_file(files, "tokenizer_config.json")
    template = tc.get("chat_template")
    if isinstance(template, list):          # [{name, template}, ...]: the default one
      template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                      None)
    if not isinstance(template, str):
      template = files.get("chat_template.jinja")
    special = {k: _token_text(tc.get(k)) or "" for k in ("bos_token", "eos_token")}
    return cls(template, special)

  @property
  def plain(self) -> bool:
    return self._template is None

  def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    if self._template is None:
      text = "".join(f"{_PLAIN_ROLES.get(m['role'], str(m['role']).title())}: {m['content']}\n\n" for m in messages)
      return text + ("Assistant: " if add_generation_prompt else "")
    return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

  def prompt(self, text: str, system: str | None = None) -> str:
    """One user turn (after an optional system message) and the assistant's generation prompt."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return self.render(msgs, add_generation_prompt=True)

  def pieces(self, msgs: list[dict]) -> list[tuple[str, bool]]:
    """(text, is_response) pieces of a conversation: each assistant turn's text (and the template's end-of-turn
    after it) is response, everything else context."""
    if self._template is None:
      out = []
      for m in msgs:
        out.append((f"{_PLAIN_ROLES[m['role']]}: ", False))
        out.append((m["content"] + "\n\n", m["role"] == "assistant"))
      return out
    # Render growing prefixes: what an assistant turn adds after its generation prompt is response text.
    out, done = [], ""
    for i, m in enumerate(msgs):
      if m["role"] == "assistant":
        prompt = self.render(msgs[:i], True)
        if not prompt.startswith(done):
          raise DataError("the chat template does not render conversations incrementally; use prompt/response "
                          "data with a tokenizer without chat_template")
        out.append((prompt[len(done):], False))
        done = prompt
      full = self.render(msgs[:i + 1], False)
      if not full.startswith(done):
        raise DataError("the chat template does not render conversations incrementally")
      out.append((full[len(done):], m["role"] == "assistant"))
      done = full
    return [(t, r) for t, r in out if t]


def _raise(message):
  raise DataError(f"chat template: {message}")


def build_tokenizer(data_cfg):
  """`data.tokenizer`: 'bytes' or the path of a Hugging Face tokenizer.json (or a directory holding one)."""
  spec = (data_cfg.tokenizer or "bytes").strip()
  add_bos = str(getattr(data_cfg, "add_bos", "auto")).lower()
  if add_bos not in ADD_BOS:
    raise DataError(f"data.add_bos must be one of {'|'.join(ADD_BOS)}, got {add_bos!r}")
  if spec == "bytes":
    return ByteTokenizer(add_bos=add_bos != "false")
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
  return HFTokenizer(path, add_bos)
