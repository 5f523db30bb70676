"""Document sources behind `data.source`: random-access lists of *blocks* of documents.

A source is what `grain.MapDataset.source` consumes: `len(src)` blocks, `src[i]` -> `list[str]` (the documents of
block i that belong to the requested split, possibly empty). Most sources have one document per block; Parquet
files use one row group per block so that a shuffled read decodes each row group once (documents inside a block are
shuffled separately by the pipeline).

`data.source` forms:
- `default`: the Python standard library's `.py` files (test suites and site-packages excluded) plus every help
  topic of `pydoc_data/topics.py`, one document each. Needs no download and is identical on every machine with the
  same Python version.
- a path, directory or glob (`**` allowed) of files:
  - `.txt`: the whole file is ONE document (blank lines do not split it).
  - `.jsonl`: one JSON object per line, the document is its `data.text_field` (default `text`); blank lines are
    skipped, `null` is an empty document.
  - `.parquet`: column `data.text_field` (FineWeb-Edu: `text`).
  A directory means all supported files below it.
- `tfds:NAME` (or `tfds:NAME/CONFIG:VERSION`): a TFDS dataset already prepared in `data.tfds_dir` with
  `file_format="array_record"`, read through `tfds.data_source` (TensorFlow is never imported). The document is the
  feature `data.text_field`.

Text decoding: bytes that are not valid UTF-8 are replaced by U+FFFD (never an error), so one bad byte does not stop
a long run; byte counts (and so BPB) refer to the text after this replacement.

Train/validation split: `data.val_source` (a path / directory / glob of files, e.g. nanochat's choice, the last
FineWeb-Edu shard: sinkjax.data.fineweb) makes those files the validation split and the whole `data.source` the
training split (no file may be in both). Without it, TFDS datasets with a `data.val_split` use it, and every other
source is split per document by a hash of a stable document key (file path relative to the matched files' common directory, plus the line / row number
in it; for `default` the path inside the standard library or the help-topic name): a document is validation iff
`hash(key) < data.val_fraction`. The split is therefore stable across machines and independent of the order files
are listed in.
"""
from __future__ import annotations

import bisect
import glob
import hashlib
import json
import os
import pathlib
import sysconfig
import threading
from typing import Sequence

import numpy as np

from sinkjax import paths
from sinkjax.errors import UserError

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")
_SOURCE_HINT = "give a path or glob of .txt/.jsonl/.parquet files, 'default', or tfds:NAME"
_SCAN_BLOCKS = 256   # sources with at most this many blocks are fully checked for content at build time


class DataError(UserError):
  """A user-facing data problem; the one-line message names the setting or file to fix."""


def _hash01(key: str) -> float:
  """Deterministic uniform [0, 1) hash of a string (same on every machine and Python run)."""
  return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                        "little") / 2.0**64


def decode_text(data: bytes) -> str:
  """UTF-8 decoding that replaces undecodable bytes with U+FFFD."""
  return data.decode("utf-8", errors="replace")


class _Split:
  """Per-document train/val filter by key hash. split: 'train' | 'val' | 'all'."""

  def __init__(self, split: str, val_fraction: float):
    self.split = split
    self.val_fraction = float(val_fraction)

  def keep(self, key: str) -> bool:
    if self.split == "all":
      return True
    is_val = _hash01(key) < self.val_fraction
    return is_val == (self.split == "val")


class BlockSource:
  """Base class: random access over blocks of documents (picklable; file handles are opened lazily)."""

  description: str = ""

  def __len__(self) -> int:
    raise NotImplementedError

  def __getitem__(self, index: int) -> list[str]:
    raise NotImplementedError


# ----------------------------------------------------------------------------------------------------- default
def _stdlib_documents() -> tuple[str, list[str], list[str]]:
  """(stdlib root, sorted relative .py paths, sorted help-topic names)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip_dirs = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in skip_dirs]
    for name in filenames:
      if name.endswith(".py"):
        rel = (pathlib.Path(dirpath) / name).relative_to(root).as_posix()
        if rel != "pydoc_data/topics.py":     # its help topics are documents of their own below
          files.append(rel)
  try:
    from pydoc_data import topics as _topics  # pylint: disable=import-outside-toplevel
    topic_names = sorted(_topics.topics)
  except ImportError:   # some minimal Python builds lack pydoc_data
    topic_names = []
  return str(root), sorted(files), topic_names


class DefaultSource(BlockSource):
  """The embedded corpus: standard-library sources + pydoc help topics, one document per block."""

  def __init__(self, split: str, val_fraction: float):
    root, files, topics = _stdlib_documents()
    self._root = root
    flt = _Split(split, val_fraction)
    self._entries = [("py", f) for f in files if flt.keep("stdlib/" + f)]
    self._entries += [("topic", t) for t in topics if flt.keep("topic/" + t)]
    self.description = f"default corpus (Python {sysconfig.get_python_version()} standard library + help topics)"

  @property
  def keys(self) -> list[str]:
    return [("stdlib/" if kind == "py" else "topic/") + name for kind, name in self._entries]

  def __len__(self) -> int:
    return len(self._entries)

  def __getitem__(self, index: int) -> list[str]:
    kind, name = self._entries[index]
    if kind == "py":
      with open(os.path.join(self._root, name), "rb") as f:
        return [decode_text(f.read())]
    from pydoc_data import topics as _topics  # pylint: disable=import-outside-toplevel
    return [_topics.topics[name]]


# ---------------------------------------------------------------------------------- files (local or in a bucket)
def _open_rb(path: str):
  """A binary file object of a local path or a gs:// / s3:// URL (`sinkjax.paths`)."""
  return paths.as_path(path).open("rb") if paths.is_remote(path) else open(path, "rb")  # pylint: disable=R1732


def _read_range(path: str, start: int, length: int, fd) -> bytes:
  if fd is not None:
    return os.pread(fd, length, start)
  with _open_rb(path) as f:             # an object store: one ranged read
    f.seek(start)
    return f.read(length)


class _TxtFile:
  """A .txt file: one document, the whole file."""

  def __init__(self, path: str, key: str, flt: _Split):
    self.path, self.key, self.flt = path, key, flt
    self.num_blocks = 1
    size = paths.as_path(path).stat().length if paths.is_remote(path) else os.path.getsize(path)
    self.num_records = 1 if size > 0 else 0

  def block(self, i: int) -> list[str]:
    del i
    if not self.flt.keep(self.key):
      return []
    with _open_rb(self.path) as f:
      return [decode_text(f.read())]


def _line_index(path: str) -> tuple[np.ndarray, np.ndarray]:
  """Start and end byte offsets of the non-empty lines of a file (chunked scan; works for large files)."""
  starts, ends = [], []
  pos = 0
  line_start = 0
  with _open_rb(path) as f:
    while True:
      chunk = f.read(1 << 24)
      if not chunk:
        break
      nl = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + pos
      if len(nl):
        s = np.concatenate([[line_start], nl[:-1] + 1])
        starts.append(s)
        ends.append(nl)
        line_start = int(nl[-1]) + 1
      pos += len(chunk)
  if line_start < pos:   # last line without a trailing newline
    starts.append(np.array([line_start]))
    ends.append(np.array([pos]))
  if not starts:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  s = np.concatenate(starts).astype(np.int64)
  e = np.concatenate(ends).astype(np.int64)
  keep = (e - s) > 0
  return s[keep], e[keep]


class _JsonlFile:
  """A .jsonl file: one document per non-blank line, the value of `text_field`."""

  def __init__(self, path: str, key: str, flt: _Split, text_field: str):
    self.path, self.key, self.flt, self.text_field = path, key, flt, text_field
    self.starts, self.ends = _line_index(path)
    self.num_blocks = len(self.starts)
    self.num_records = self.num_blocks
    self._fd = None
    if self.num_blocks:
      self._parse(0)   # fail early on a wrong text field / non-JSON file

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_fd"] = None
    return state

  def _line_number(self, i: int) -> int:
    with _open_rb(self.path) as f:
      return f.read(int(self.starts[i])).count(b"\n") + 1

  def _parse(self, i: int):
    if self._fd is None and not paths.is_remote(self.path):
      self._fd = os.open(self.path, os.O_RDONLY)
    raw = _read_range(self.path, int(self.starts[i]), int(self.ends[i] - self.starts[i]), self._fd)
    if not raw.strip():
      return None
    try:
      obj = json.loads(decode_text(raw))
    except json.JSONDecodeError as e:
      raise DataError(f"JSONL file {self.path} line {self._line_number(i)} is not valid JSON ({e.msg}); "
                      "give one JSON object per line") from None
    if not isinstance(obj, dict) or self.text_field not in obj:
      fields = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
      raise DataError(f"JSONL file {self.path} line {self._line_number(i)} has no field "
                      f"'{self.text_field}' (has: {fields}); set data.text_field to the field holding the text")
    text = obj[self.text_field]
    if text is None:
      return ""
    if not isinstance(text, str):
      raise DataError(f"JSONL file {self.path} line {self._line_number(i)}: field '{self.text_field}' is "
                      f"{type(text).__name__}, not a string; set data.text_field to a text field")
    return text

  def block(self, i: int) -> list[str]:
    if not self.flt.keep(f"{self.key}:{i}"):
      return []
    text = self._parse(i)
    return [] if text is None else [text]


class _ParquetFile:
  """A .parquet file: one block per row group, documents from column `text_field`."""

  def __init__(self, path: str, key: str, flt: _Split, text_field: str):
    try:
      import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise DataError("reading .parquet needs pyarrow; pip install pyarrow") from None
    self.path, self.key, self.flt, self.text_field = path, key, flt, text_field
    try:
      pf = pq.ParquetFile(_open_rb(path))
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(f"parquet file {path} cannot be read ({type(e).__name__}: {e}); "
                      "give valid .parquet files") from None
    names = pf.schema_arrow.names
    if text_field not in names:
      raise DataError(f"parquet file {path} has no column '{text_field}' (has: {', '.join(names)}); "
                      "set data.text_field to the column holding the text")
    md = pf.metadata
    self.row_offsets = np.cumsum([0] + [md.row_group(g).num_rows for g in range(md.num_row_groups)])
    self.num_blocks = md.num_row_groups
    self.num_records = int(self.row_offsets[-1])
    self._pf = None
    self._lock = threading.Lock()
    self._cache: tuple[int, list] | None = None

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_pf"] = None
    state["_lock"] = None
    state["_cache"] = None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def block(self, g: int) -> list[str]:
    with self._lock:
      if self._cache is not None and self._cache[0] == g:
        texts = self._cache[1]
      else:
        if self._pf is None:
          import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
          self._pf = pq.ParquetFile(_open_rb(self.path))
        texts = self._pf.read_row_group(g, columns=[self.text_field]).column(0).to_pylist()
        self._cache = (g, texts)
    first = int(self.row_offsets[g])
    out = []
    for j, t in enumerate(texts):
      if not self.flt.keep(f"{self.key}:{first + j}"):
        continue
      if t is None:
        t = ""
      elif isinstance(t, bytes):
        t = decode_text(t)
      elif not isinstance(t, str):
        raise DataError(f"parquet file {self.path}: column '{self.text_field}' holds {type(t).__name__}, "
                        "not text; set data.text_field to a string column")
      out.append(t)
    return out


def expand_files(pattern: str, setting: str = "data.source") -> list[str]:
  """The sorted files a `data.source` (or `setting`) path / directory / glob names, local or gs:// / s3:// (DataError
  if none or unsupported)."""
  if paths.is_remote(pattern):
    return _checked_files(pattern, _expand_remote(pattern, setting), setting)
  p = os.path.expanduser(pattern)
  if glob.has_magic(p):
    files = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
  elif os.path.isdir(p):
    files = sorted(str(f) for f in pathlib.Path(p).rglob("*")
                   if f.is_file() and f.suffix.lower() in SUPPORTED_SUFFIXES)
  elif os.path.isfile(p):
    files = [p]
  else:
    files = []
  return _checked_files(pattern, files, setting)


def _expand_remote(pattern: str, setting: str) -> list[str]:
  try:
    paths.check_bucket(pattern, setting)
  except paths.StorageError as e:
    raise DataError(str(e)) from None
  if glob.has_magic(pattern):
    return paths.expand_glob(pattern)
  p = paths.as_path(pattern)
  if p.is_dir():
    return [f for f in paths.list_files(pattern) if os.path.splitext(f)[1].lower() in SUPPORTED_SUFFIXES]
  return [pattern] if p.is_file() else []


def _checked_files(pattern: str, files: list[str], setting: str) -> list[str]:
  if not files:
    raise DataError(f"{setting} {pattern!r} matched no files; {_SOURCE_HINT}")
  bad = [f for f in files if pathlib.Path(f).suffix.lower() not in SUPPORTED_SUFFIXES]
  if bad:
    raise DataError(f"{setting} {pattern!r} matched {bad[0]!r}, which is not .txt/.jsonl/.parquet; "
                    f"narrow the glob or {_SOURCE_HINT}")
  return files


class FilesSource(BlockSource):
  """Concatenation of .txt / .jsonl / .parquet files, local or in a bucket (gs://, s3://)."""

  def __init__(self, pattern: str, split: str, val_fraction: float, text_field: str, setting: str = "data.source"):
    files = expand_files(pattern, setting)
    flt = _Split(split, val_fraction)
    local = [f if paths.is_remote(f) else os.path.abspath(f) for f in files]   # URLs: '/'-separated already
    common = os.path.dirname(local[0]) if len(local) == 1 else os.path.commonpath(local)
    self._files = []
    for f, full in zip(files, local):
      key = os.path.relpath(full, common).replace(os.sep, "/")
      suffix = pathlib.Path(f).suffix.lower()
      if suffix == ".txt":
        self._files.append(_TxtFile(f, key, flt))
      elif suffix == ".jsonl":
        self._files.append(_JsonlFile(f, key, flt, text_field))
      else:
        self._files.append(_ParquetFile(f, key, flt, text_field))
    self._offsets = np.cumsum([0] + [f.num_blocks for f in self._files]).tolist()
    self.num_records = sum(f.num_records for f in self._files)
    self.description = f"{len(files)} file(s) matching {pattern!r}"
    if self.num_records == 0:
      raise DataError(f"{setting} {pattern!r} contains no documents (all files are empty); "
                      "give files with text")

  def __len__(self) -> int:
    return self._offsets[-1]

  def __getitem__(self, index: int) -> list[str]:
    f = bisect.bisect_right(self._offsets, index) - 1
    return self._files[f].block(index - self._offsets[f])


# ------------------------------------------------------------------------------------------------------- TFDS
class TfdsSource(BlockSource):
  """A prepared array_record TFDS split; one record per block."""

  def __init__(self, name: str, tfds_split: str, data_dir: str | None, text_field: str, split: str,
               val_fraction: float, num_records: int):
    self._name, self._tfds_split, self._data_dir = name, tfds_split, data_dir
    self._text_field = text_field
    self._flt = _Split(split, val_fraction)
    self._len = num_records
    self._ds = None
    self.description = f"tfds:{name} split {tfds_split!r}"

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_ds"] = None
    return state

  def _open(self):
    if self._ds is None:
      import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
      self._ds = tfds.data_source(self._name, split=self._tfds_split, data_dir=self._data_dir,
                                  download=False)
    return self._ds

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> list[str]:
    if not self._flt.keep(f"{self._name}/{self._tfds_split}:{index}"):
      return []
    text = self._open()[index][self._text_field]
    if isinstance(text, np.ndarray):
      text = text.item()
    if isinstance(text, bytes):
      text = decode_text(text)
    return [text] if text else []


def _tfds_source(name: str, data_cfg, split: str) -> BlockSource:
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  src = f"tfds:{name}"
  data_dir = data_cfg.tfds_dir or None
  where = f"data.tfds_dir {data_cfg.tfds_dir!r}" if data_cfg.tfds_dir else "the default TFDS directory"
  if not name:
    raise DataError(f"data.source {src!r} names no dataset; {_SOURCE_HINT}")
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # pylint: disable=broad-except  # DatasetNotFoundError and friends
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise DataError(f"data.source {src!r}: TFDS dataset {name!r} does not exist ({first}); check the name "
                    f"or prepare it in {where}") from None
  if not builder.is_prepared():
    raise DataError(f"data.source {src!r}: TFDS dataset {name!r} is not prepared in {where}; build it first "
                    f"(e.g. `tfds build {name} --data_dir DIR --file_format array_record`) and set data.tfds_dir")
  info = builder.info
  file_format = getattr(info.file_format, "value", str(info.file_format))
  if "array_record" not in str(file_format):
    raise DataError(f"data.source {src!r} is stored as {file_format}, but only array_record can be read "
                    "without TensorFlow; rebuild it with --file_format array_record")
  splits = dict(info.splits.items()) if hasattr(info.splits, "items") else {k: info.splits[k] for k in
                                                                            info.splits.keys()}
  if data_cfg.text_field not in info.features.keys():
    raise DataError(f"data.source {src!r} has no feature '{data_cfg.text_field}' (has: "
                    f"{', '.join(info.features.keys())}); set data.text_field to the text feature")
  if data_cfg.train_split not in splits:
    raise DataError(f"data.source {src!r} has no split {data_cfg.train_split!r} (has: {', '.join(splits)}); "
                    "set data.train_split")
  if split == "val" and data_cfg.val_split in splits:
    tfds_split, flt = data_cfg.val_split, "all"
  elif data_cfg.val_split in splits:
    tfds_split, flt = data_cfg.train_split, "all"
  else:   # no validation split: carve it out of the training split by hash
    tfds_split, flt = data_cfg.train_split, split
  if split == "all":
    tfds_split, flt = (data_cfg.val_split if data_cfg.val_split in splits else data_cfg.train_split), "all"
  return TfdsSource(name, tfds_split, data_dir, data_cfg.text_field, flt, data_cfg.val_fraction,
                    int(splits[tfds_split].num_examples))


# ------------------------------------------------------------------------------------------------------ build
def build_source(data_cfg, split: str) -> BlockSource:
  """The block source of `data.source` for split 'train', 'val' or 'all' (every document of data.source, in stored
  order); with `data.val_source` set, 'train' is the whole data.source and 'val' the whole val_source. DataError on
  bad input."""
  if split not in ("train", "val", "all"):
    raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")
  if not 0.0 <= data_cfg.val_fraction <= 1.0:
    raise DataError(f"data.val_fraction must be in [0, 1], got {data_cfg.val_fraction}")
  source = (data_cfg.source or "").strip()
  if not source:
    raise DataError(f"data.source is empty; {_SOURCE_HINT}")
  val_source = (getattr(data_cfg, "val_source", "") or "").strip()
  if val_source:
    _check_val_source(source, val_source)
    if split == "val":
      src = FilesSource(val_source, "all", 0.0, data_cfg.text_field, setting="data.val_source")
    else:
      src = _whole_source(source, data_cfg)
  elif source == "default":
    src = DefaultSource(split, data_cfg.val_fraction)
  elif source.startswith("tfds:"):
    src = _tfds_source(source[len("tfds:"):].strip(), data_cfg, split)
  else:
    src = FilesSource(source, split, data_cfg.val_fraction, data_cfg.text_field)
  check_nonempty(src, data_cfg, split)
  return src


def _whole_source(source: str, data_cfg) -> BlockSource:
  if source == "default":
    return DefaultSource("all", 0.0)
  return FilesSource(source, "all", 0.0, data_cfg.text_field)


def _check_val_source(source: str, val_source: str) -> None:
  """data.val_source names files, none of which data.source also names (the validation text is never trained on)."""
  if val_source == "default" or val_source.startswith("tfds:"):
    raise DataError(f"data.val_source {val_source!r} must be a path or glob of .txt/.jsonl/.parquet files (a TFDS "
                    "dataset's validation split is data.val_split)")
  if source.startswith("tfds:"):
    raise DataError(f"data.val_source is for file sources; data.source {source!r} is a TFDS dataset, whose "
                    "validation split is data.val_split: leave data.val_source empty")
  try:
    val_files = expand_files(val_source, "data.val_source")
  except DataError as e:
    raise DataError(f"{e} (or set data.val_source= to split data.source by data.val_fraction)") from None
  if source == "default":
    return
  norm = lambda f: f if paths.is_remote(f) else os.path.abspath(f)
  both = sorted(set(map(norm, expand_files(source))) & set(map(norm, val_files)))
  if both:
    raise DataError(f"data.val_source file {both[0]!r} is also in data.source {source!r}; narrow data.source so that "
                    "it leaves the validation files out (e.g. a glob of the training shards only)")


def check_nonempty(src: BlockSource, data_cfg, split: str) -> None:
  """DataError if the split certainly has no text (small sources are scanned fully, large ones not at all)."""
  what = {"val": "validation", "train": "training", "all": "whole"}[split]
  if (getattr(data_cfg, "val_source", "") or "").strip():
    name, where, fix = ("data.val_source", data_cfg.val_source, "give files with text") if split == "val" else (
        "data.source", data_cfg.source, "give files with text")
    setting = ""
  else:
    name, where = "data.source", data_cfg.source
    fix = ("raise data.val_fraction or add documents" if split == "val" else
           "lower data.val_fraction or add documents with text")
    setting = f" (data.val_fraction={data_cfg.val_fraction})"
  if len(src) == 0:
    raise DataError(f"{name} {where!r} has no documents in the {what} split{setting}; {fix}")
  if len(src) <= _SCAN_BLOCKS and not any(any(d for d in src[i]) for i in range(len(src))):
    raise DataError(f"{name} {where!r} has no non-empty documents in the {what} split{setting}; {fix}")


def source_documents(src: BlockSource) -> Sequence[str]:
  """All documents of a source in order (for tests and small corpora)."""
  return [d for i in range(len(src)) for d in src[i]]
