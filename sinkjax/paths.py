"""Every path a user gives, local or in a bucket: one abstraction (`etils.epath`, which Orbax and TFDS use too).

`as_path("runs/x")` is a local path, `as_path("gs://bucket/x")` (or `s3://`) an object-store path with the same
methods (`/`, `read_text`, `write_text`, `open`, `glob`, `exists`, `mkdir`, ...). An object-store URL is checked
before anything is written: the client library of its scheme must be installed (`pip install 'sinkjax[gcs]'` for
`gs://`, `s3fs` for `s3://`), else a one-line `StorageError` says so.

Object stores have no append and no rename: `write_atomic` replaces a whole object in one upload (readers see the
old or the new object, never a part of it), which is how metrics.jsonl is written there (`sinkjax.train`);
checkpoints use Orbax's own commit protocol. Local runs keep their append + `os.replace` writes.

To point every client at a GCS emulator (tests): STORAGE_EMULATOR_HOST (google-cloud-storage, gcsfs) and
TENSORSTORE_GCS_HTTP_URL (TensorStore, under Orbax), both before the process starts.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import pathlib
import re
import shutil
import tempfile
from typing import Iterator

from sinkjax.errors import ConfigError

# scheme -> (python module that serves it through fsspec, how to install it)
REMOTE_SCHEMES = {"gs": ("gcsfs", "pip install 'sinkjax[gcs]'"), "s3": ("s3fs", "pip install s3fs")}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


class _QuietClients(logging.Filter):
  """gcsfs logs a warning per call when it cannot tell a bucket's type (emulators, anonymous access) and a traceback
  before falling back from its move API to copy + delete; neither says anything to a user."""

  def filter(self, record: logging.LogRecord) -> bool:
    text = record.getMessage()
    return not ("Could not determine bucket type" in text or "moveTo" in text
                or "non-retriable exception" in text)


for _name in ("gcsfs", "gcsfs.core", "gcsfs.retry"):
  logging.getLogger(_name).addFilter(_QuietClients())


class StorageError(ConfigError):
  """A path or URL that cannot be used (unknown scheme, missing client library, missing bucket, no credentials)."""


def scheme(path) -> str:
  """'' for a local path, else the URL scheme ('gs', 's3', ...)."""
  m = _URL.match(str(path))
  return m.group(1).lower() if m else ""


def is_remote(path) -> bool:
  return scheme(path) != ""


def check_url(path, what: str = "path") -> None:
  """Raises StorageError unless `path` is local or an object-store URL whose client library is installed."""
  s = scheme(path)
  if not s:
    return
  if s not in REMOTE_SCHEMES:
    raise StorageError(f"{what} {str(path)!r}: unsupported URL scheme {s}://; give a local path, gs://BUCKET/... "
                       "or s3://BUCKET/...")
  bucket = _URL.match(str(path)).group(2).split("/")[0]
  if not bucket:
    raise StorageError(f"{what} {str(path)!r} names no bucket; write {s}://BUCKET/PATH")
  module, install = REMOTE_SCHEMES[s]
  if importlib.util.find_spec(module) is None:
    raise StorageError(f"{what} {str(path)!r} needs the {module} package for {s}:// paths; {install}")


def as_path(path, what: str = "path"):
  """An `etils.epath.Path` for a local path or a gs:// / s3:// URL (checked with `check_url`). Local paths
  expand `~`."""
  from etils import epath  # pylint: disable=import-outside-toplevel
  if isinstance(path, epath.Path) and not isinstance(path, pathlib.PurePath):
    return path
  text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
  check_url(text, what)
  return epath.Path(text if is_remote(text) else os.path.expanduser(text))


def bucket_of(path) -> str | None:
  m = _URL.match(str(path))
  return f"{m.group(1)}://{m.group(2).split('/')[0]}" if m else None


def check_bucket(path, what: str = "path") -> None:
  """For an object-store URL: raises StorageError when its bucket does not exist or cannot be reached (no
  credentials, no network). Local paths pass."""
  check_url(path, what)
  bucket = bucket_of(path)
  if bucket is None:
    return
  if scheme(path) == "gs" and not os.environ.get("STORAGE_EMULATOR_HOST"):
    try:
      import google.auth  # pylint: disable=import-outside-toplevel
      google.auth.default()
    except Exception as e:  # pylint: disable=broad-except  # DefaultCredentialsError, a malformed key file
      raise StorageError(f"{what} {str(path)!r}: no Google Cloud credentials ({describe(e)}); run `gcloud auth "
                         "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS to a key file (on a "
                         "TPU VM the VM's service account is used)") from None
  try:
    ok = as_path(bucket).exists()
  except Exception as e:  # pylint: disable=broad-except  # auth errors, connection errors, HTTP errors
    raise StorageError(f"{what} {str(path)!r}: cannot reach bucket {bucket} ({describe(e)}); check the "
                       "credentials (gcloud auth application-default login, or GOOGLE_APPLICATION_CREDENTIALS) "
                       "and the bucket name") from None
  if not ok:
    raise StorageError(f"{what} {str(path)!r}: bucket {bucket} does not exist (or these credentials cannot see it); "
                       f"create it (gcloud storage buckets create {bucket}) or fix the name")


def describe(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def write_atomic(path, text: str) -> None:
  """Replaces the file (local: a temporary file and `os.replace`) or the object (one whole-object upload)."""
  path = as_path(path)
  if is_remote(path):
    path.write_text(text)
    return
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


def _fs(url: str):
  """(fsspec filesystem, path without scheme) of an object-store URL: the client epath itself uses, for the
  recursive listings epath refuses on GCS."""
  import fsspec  # pylint: disable=import-outside-toplevel
  return fsspec.core.url_to_fs(str(url))


def expand_glob(pattern: str) -> list[str]:
  """The files a local or remote path / glob names, as strings (remote ones as URLs); `**` recurses."""
  if not is_remote(pattern):
    import glob  # pylint: disable=import-outside-toplevel
    return sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f))
  check_url(pattern)
  fs, _ = _fs(pattern)
  found = fs.glob(str(pattern).split("://", 1)[1], detail=True)
  return sorted(f"{scheme(pattern)}://{name}" for name, info in found.items() if info.get("type") == "file")


def list_files(directory) -> list[str]:
  """Every file under a local or remote directory (recursively), as strings."""
  if not is_remote(directory):
    return sorted(str(p) for p in pathlib.Path(os.path.expanduser(str(directory))).rglob("*") if p.is_file())
  check_url(directory)
  fs, root = _fs(directory)
  return sorted(f"{scheme(directory)}://{name}" for name in fs.find(root))


@contextlib.contextmanager
def local_dir(path, what: str = "directory") -> Iterator[pathlib.Path]:
  """A local directory with the contents of `path`: itself when local, else a temporary download (for readers that
  need real files, such as safetensors' mmap or a PyTorch checkpoint)."""
  if not is_remote(path):
    yield pathlib.Path(os.path.expanduser(str(path)))
    return
  src = as_path(path, what)
  if not src.is_dir():
    raise StorageError(f"{what} {str(path)!r} is not a directory in the bucket (or does not exist)")
  with tempfile.TemporaryDirectory(prefix="sinkjax-") as tmp:
    for f in list_files(path):
      dst = pathlib.Path(tmp) / os.path.relpath(f.split("://", 1)[1], str(path).split("://", 1)[1])
      dst.parent.mkdir(parents=True, exist_ok=True)
      dst.write_bytes(as_path(f).read_bytes())
    yield pathlib.Path(tmp)


@contextlib.contextmanager
def staged_dir(path, what: str = "--out") -> Iterator[pathlib.Path]:
  """A local directory whose contents end up in `path`: itself when local, else a temporary one uploaded file by
  file when the block succeeds (nothing is uploaded when it fails)."""
  if not is_remote(path):
    p = pathlib.Path(os.path.expanduser(str(path)))
    p.mkdir(parents=True, exist_ok=True)
    yield p
    return
  dst = as_path(path, what)
  with tempfile.TemporaryDirectory(prefix="sinkjax-") as tmp:
    yield pathlib.Path(tmp)
    for dirpath, _, names in os.walk(tmp):
      for name in names:
        local = os.path.join(dirpath, name)
        (dst / os.path.relpath(local, tmp)).write_bytes(pathlib.Path(local).read_bytes())


def copy_file(src, dst) -> None:
  """Copies one file between any two local or remote paths."""
  src, dst = as_path(src), as_path(dst)
  if not is_remote(src) and not is_remote(dst):
    shutil.copyfile(src, dst)
  else:
    dst.write_bytes(src.read_bytes())


class Mirror:
  """A local working copy of an output directory that may live in a bucket, for the studies (many files, training
  runs inside): `local` is the directory itself when it is local; for a URL it is a cache directory
  (~/.cache/sinkjax/mirror/SCHEME/BUCKET/PATH) filled with what the bucket already holds (so a rerun resumes), and
  `sync()` uploads every file that is new or changed since the last sync. Call it after each finished piece of work;
  what was not synced when a process dies is redone by the rerun, as locally."""

  def __init__(self, path, what: str = "--out"):
    self.url = str(path)
    self.remote = is_remote(path)
    if not self.remote:
      self.local = pathlib.Path(os.path.expanduser(self.url))
      return
    check_bucket(path, what)
    m = _URL.match(self.url)
    self.local = pathlib.Path(os.environ.get("SINKJAX_MIRROR_DIR", os.path.expanduser("~/.cache/sinkjax/mirror"))) \
        / m.group(1) / m.group(2).strip("/")
    self.local.mkdir(parents=True, exist_ok=True)
    self._seen: dict[str, tuple[int, int]] = {}
    prefix = self.url.rstrip("/") + "/"
    for f in list_files(self.url):
      dst = self.local / f[len(prefix):]
      if not dst.is_file() or dst.stat().st_size != as_path(f).stat().length:
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(as_path(f).read_bytes())
      self._seen[str(dst)] = self._stamp(dst)

  @staticmethod
  def _stamp(p: pathlib.Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_size, st.st_mtime_ns

  def sync(self) -> int:
    """Uploads new or changed files (a no-op for a local directory); returns how many."""
    if not self.remote:
      return 0
    n = 0
    dst = as_path(self.url)
    for dirpath, _, names in os.walk(self.local):
      for name in names:
        p = pathlib.Path(dirpath) / name
        stamp = self._stamp(p)
        if self._seen.get(str(p)) != stamp:
          (dst / os.path.relpath(p, self.local)).write_bytes(p.read_bytes())
          self._seen[str(p)] = stamp
          n += 1
    return n
