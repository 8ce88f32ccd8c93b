"""The one filesystem layer: every file spmdtask reads or writes, local or `gs://`.

Paths are strings. A plain path is a local file (relative paths as the OS resolves them);
`gs://bucket/key` goes through fsspec's gcsfs (credentials: `gcloud auth
application-default login`, or the VM's service account; `STORAGE_EMULATOR_HOST` points it
at an emulator). Other fsspec URLs (`memory://`, `s3://` with s3fs) work the same way.

Orbax (checkpoints) writes arrays through tensorstore and everything else through
etils.epath, whose gs:// backend would be TensorFlow's gfile whenever TensorFlow is
installed: a second GCS client that ignores `STORAGE_EMULATOR_HOST`. Importing this module
routes epath to fsspec too (`EPATH_USE_TF=false`), so one client (gcsfs) does every path op.
GCS has no append and no rename: `append_text` rewrites the object; writers that only take
a local path (jax's profiler, TensorFlow's TFRecord writer in the tools) write into a
`Staged` temp dir that is uploaded, then deleted.
"""
import builtins
import contextlib
import glob as globlib
import os
import posixpath
import shutil
import tempfile
import threading
import urllib.parse

# Set before etils.epath decides its backend (it caches the choice) and before gcsfs is
# imported (it reads the variable at import).
os.environ.setdefault("EPATH_USE_TF", "false")
if os.environ.get("STORAGE_EMULATOR_HOST"):
  # Emulators serve only the JSON API; gcsfs's bucket-layout probe (gRPC storage control)
  # would wait ~60 s for each bucket before falling back to it.
  os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import fsspec  # pylint: disable=g-import-not-at-top,wrong-import-position
import fsspec.config  # pylint: disable=g-import-not-at-top,wrong-import-position

from spmdtask.errors import ConfigError  # pylint: disable=g-import-not-at-top,wrong-import-position

# Orbax writes array chunks through tensorstore, behind gcsfs's back: a cached listing would
# hide them (and hide a checkpoint another process committed). Applies to every instance,
# epath's included.
for _protocol in ("gs", "gcs"):
  fsspec.config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)


def is_remote(path: str) -> bool:
  """True for a URL (`gs://...`); False for a local path."""
  return "://" in str(path)


def join(base: str, *parts: str) -> str:
  """`base/part/...`, with '/' for URLs and the OS separator for local paths."""
  return posixpath.join(base, *parts) if is_remote(base) else os.path.join(base, *parts)


def dirname(path: str) -> str:
  return posixpath.dirname(path) if is_remote(path) else os.path.dirname(path)


def absolute(path: str) -> str:
  """An absolute local path; a URL unchanged (never `./gs:/bucket/...`)."""
  return str(path).rstrip("/") if is_remote(path) else os.path.abspath(path)


def filesystem(path: str):
  """(fsspec filesystem, path as that filesystem names it)."""
  return fsspec.core.url_to_fs(str(path))


def _url(fs, name: str, like: str) -> str:
  """A filesystem's `name` as a path of the same kind as `like`."""
  return fs.unstrip_protocol(name) if is_remote(like) else name


def open(path: str, mode: str = "r", **kwargs):  # pylint: disable=redefined-builtin
  """A file object (text for 'r'/'w', bytes for 'rb'/'wb'). A remote 'w' file is
  uploaded when closed. No 'a' for remote files: use `append_text`."""
  if not is_remote(path):
    return builtins.open(path, mode, **kwargs)
  fs, p = filesystem(path)
  return fs.open(p, mode, **kwargs)


def exists(path: str) -> bool:
  fs, p = filesystem(path)
  return fs.exists(p)


def isdir(path: str) -> bool:
  fs, p = filesystem(path)
  return fs.isdir(p)


def isfile(path: str) -> bool:
  fs, p = filesystem(path)
  return fs.isfile(p)


def listdir(path: str) -> list[str]:
  """Names (not paths) in directory `path`; [] if it does not exist."""
  fs, p = filesystem(path)
  try:
    entries = fs.ls(p, detail=False)
  except FileNotFoundError:
    return []
  names = [posixpath.basename(e.rstrip("/")) for e in entries]
  return sorted(n for n in names if n)


def file_sizes(directory: str) -> dict[str, int]:
  """Bytes of every file under `directory`, by path relative to it ('/'-separated), from
  one listing (one request per 1000 objects on GCS); {} if it does not exist."""
  fs, p = filesystem(directory)
  try:
    found = fs.find(p, detail=True)
  except FileNotFoundError:
    return {}
  root = p.rstrip("/") + "/"
  return {name[len(root):]: int(info["size"]) for name, info in found.items()
          if name.startswith(root) and info.get("type") != "directory"}


def move(path: str, dest: str) -> None:
  """Moves a file or directory tree to `dest` (its parent is created). On GCS, which has no
  rename, each object is copied, then removed."""
  if not is_remote(path):
    makedirs(os.path.dirname(dest))
    shutil.move(path, dest)
    return
  fs, p = filesystem(path)
  fs.mv(p, filesystem(dest)[1], recursive=True)


def glob(pattern: str) -> list[str]:
  """Sorted paths matching `pattern` (`*`, `**`, `?`), of the same kind as `pattern`."""
  if not is_remote(pattern):
    return sorted(globlib.glob(pattern, recursive=True))
  fs, p = filesystem(pattern)
  return sorted(_url(fs, m, pattern) for m in fs.glob(p))


def makedirs(path: str) -> None:
  """Creates a local directory and its parents; a no-op for object stores (no directories)."""
  if not is_remote(path):
    os.makedirs(path, exist_ok=True)


def rm(path: str, recursive: bool = False) -> None:
  """Removes a file, or a directory tree with `recursive`; a missing path is fine."""
  fs, p = filesystem(path)
  try:
    fs.rm(p, recursive=recursive)
  except FileNotFoundError:
    pass


def read_bytes(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


_BOM = b"\xef\xbb\xbf"


def read_text(path: str) -> str:
  """The file's text: strict UTF-8 (a leading byte-order mark dropped); another encoding is
  a ConfigError naming PATH:LINE (`decode_text`)."""
  raw = read_bytes(path)
  return decode_text(raw[len(_BOM):] if raw.startswith(_BOM) else raw, path)


def decode_text(raw: bytes, path: str, first_line: int = 1) -> str:
  """`raw` (the text of `path` from line `first_line` on) as UTF-8; ConfigError naming the
  line and byte that is not, and the fix: never a guessed encoding or a replaced byte."""
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = first_line + raw.count(b"\n", 0, e.start)
    column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
    raise ConfigError(
        f"{path}:{line}: byte {column} of the line (0x{raw[e.start]:02x}) is not UTF-8 "
        f"({e.reason}), so its text cannot be read without guessing the encoding. Save the "
        "file as UTF-8 (e.g. `iconv -f LATIN1 -t UTF-8 IN > OUT` for Latin-1 text) or fix "
        "that line.") from None


def write_bytes(path: str, data: bytes) -> None:
  """Writes (replaces) `path`; local parent dirs are created."""
  makedirs(dirname(path) or ".")
  with open(path, "wb") as f:
    f.write(data)


def write_text(path: str, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def append_text(path: str, text: str) -> None:
  """Appends to a text file (a remote object is rewritten whole: GCS has no append)."""
  if not is_remote(path):
    with builtins.open(path, "a") as f:
      f.write(text)
    return
  write_text(path, (read_text(path) if exists(path) else "") + text)


def upload(local_dir: str, remote_dir: str) -> None:
  """Copies every file under `local_dir` to the same relative path under `remote_dir`."""
  for root, _, files in os.walk(local_dir):
    rel = os.path.relpath(root, local_dir)
    for name in files:
      if os.path.islink(os.path.join(root, name)):  # e.g. absl's `NAME.INFO` -> latest log
        continue
      dest = join(remote_dir, *([] if rel == "." else rel.split(os.sep)), name)
      with builtins.open(os.path.join(root, name), "rb") as f:
        write_bytes(dest, f.read())


@contextlib.contextmanager
def local_file(path: str):
  """A local path with `path`'s bytes, for readers that only take one: `path` itself when
  local; else a temporary copy, deleted on exit."""
  if not is_remote(path):
    yield path
    return
  fd, tmp = tempfile.mkstemp(prefix="spmdtask_", suffix="_" + posixpath.basename(path))
  try:
    with os.fdopen(fd, "wb") as f, open(path, "rb") as src:
      shutil.copyfileobj(src, f, 64 << 20)  # in pieces: a model's shard is gigabytes
    yield tmp
  finally:
    os.remove(tmp)


class Staged:
  """A local directory that stands for `directory`: itself when local; for a URL a
  temporary dir whose files `sync()` uploads there, deleted by `close()`.

  For writers that only take a local path (absl's log file, jax's profiler)."""

  def __init__(self, directory: str, prefix: str = "spmdtask_"):
    self.directory = directory
    self.remote = is_remote(directory)
    self.local = tempfile.mkdtemp(prefix=prefix) if self.remote else directory
    if not self.remote:
      makedirs(directory)

  def sync(self) -> None:
    if self.remote and os.path.isdir(self.local):
      upload(self.local, self.directory)

  def close(self, upload: bool = True) -> None:
    """Uploads (unless `upload` is False) and deletes the temporary dir."""
    if upload:
      self.sync()
    if self.remote:
      shutil.rmtree(self.local, ignore_errors=True)


def gcs_client():
  """google-cloud-storage's client (gcsfs's own dependency; it honours STORAGE_EMULATOR_HOST
  too) with the default credentials, or anonymous where there are none, as gcsfs would ask.
  For what gcsfs does not offer: a probe without retries, writes conditioned on an object's
  generation (the job lock)."""
  # pylint: disable=g-import-not-at-top
  import google.auth.exceptions
  from google.cloud import storage
  try:
    return storage.Client()
  except google.auth.exceptions.DefaultCredentialsError:
    return storage.Client.create_anonymous_client()


def unreachable(path: str, timeout_s: float = 20.0) -> str | None:
  """None if the bucket of URL `path` can be listed; else why not, within ~timeout_s.

  gcsfs retries a refused connection or a 401 for ~30 s with backoff; this asks once,
  with google-cloud-storage's client (gcsfs's own dependency; it honours
  STORAGE_EMULATOR_HOST too) and no retry, so a missing bucket, missing credentials or no
  network is reported at start. Without credentials it asks anonymously, as gcsfs would.
  Local paths and other schemes: None (their errors come from the first access)."""
  if not str(path).startswith(("gs://", "gcs://")):
    return None
  # pylint: disable=g-import-not-at-top
  from google.api_core import exceptions as api_exceptions
  import requests
  bucket = str(path).split("://", 1)[1].split("/")[0]
  result: list = []

  def probe():
    try:
      next(iter(gcs_client().list_blobs(bucket, max_results=1, timeout=timeout_s / 2, retry=None)),
           None)
      result.append(None)
    except api_exceptions.NotFound:
      result.append(f"bucket {bucket!r} does not exist")
    except requests.exceptions.ConnectionError as e:
      url = getattr(e.request, "url", None) or ""
      result.append(f"no connection to {urllib.parse.urlsplit(url).netloc or 'the GCS endpoint'}")
    except Exception as e:  # pylint: disable=broad-except  # HTTP, auth, DNS, socket errors
      text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
      result.append(f"{type(e).__name__}: {text}" if text else type(e).__name__)

  thread = threading.Thread(target=probe, daemon=True)  # a hard deadline whatever blocks
  thread.start()
  thread.join(timeout_s)
  return result[0] if result else f"no answer from bucket {bucket!r} within {timeout_s:.0f} s"


def check_reachable(path: str, field: str) -> None:
  """ConfigError within seconds if `path` (the value of config field / flag `field`) is a
  gs:// URL whose bucket cannot be reached; call it before anything is written."""
  why = unreachable(path)
  if why:
    raise ConfigError(
        f"{field}={path!r} cannot be reached ({why}). Check the bucket name and the network, "
        "and give this machine credentials that may use the bucket: `gcloud auth "
        "application-default login`, or a VM/TPU service account with Storage Object Admin "
        "on it (Storage Object Viewer for data read only). Nothing was written.")
