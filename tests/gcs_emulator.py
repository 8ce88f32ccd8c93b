"""A local GCS for tests: `gcp-storage-emulator` (pip) on a free 127.0.0.1 port, in memory.

`Emulator` starts it with one bucket and gives the environment a subprocess needs to use
it (gcsfs: STORAGE_EMULATOR_HOST; tensorstore, i.e. orbax's arrays:
TENSORSTORE_GCS_HTTP_URL) and a gcsfs filesystem for the test itself to look in it.

Two gaps of the emulator are filled as GCS behaves: an object download carries the
object's generation in `x-goog-generation` (tensorstore's OCDBT reads its manifest's
generation there to commit the next write; without it: "Malformed StorageGeneration"); and a
simple upload or a delete with `ifGenerationMatch` (0: the object must not exist; N: its live
generation must be N) is refused with 412 when the condition fails (the job lock relies on it;
the emulator ignores the parameter). A third: objects.move (`.../o/SRC/moveTo/o/DEST`, which
gcsfs's `mv` tries first) is served as a copy and a delete (the emulator answers 501, which
gcsfs retries with backoff for about a minute before it copies).
"""
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


_SERVE = r"""
import sys
from gcp_storage_emulator.handlers import objects
_download = objects.download
def download(request, response, storage, *args, **kwargs):
  try:
    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    response["x-goog-generation"] = obj["generation"]
    response["x-goog-metageneration"] = obj["metageneration"]
  except Exception:  # NotFound: the handler answers 404
    pass
  return _download(request, response, storage, *args, **kwargs)
objects.download = download  # before the server module builds its routes

import threading
from http import HTTPStatus
from gcp_storage_emulator import storage as storage_module
_wanted = threading.local()
class _NotMet(Exception):
  pass
def _generation(storage, bucket, name):
  try:
    return str(storage.get_file_obj(bucket, name)["generation"])
  except Exception:  # NotFound
    return "0"
def _refuse(response):
  response.status = HTTPStatus.PRECONDITION_FAILED
  response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you "
                           "specified did not hold.", "errors": [{"reason": "conditionNotMet"}]}})
_create_file = storage_module.Storage.create_file
def create_file(self, bucket_name, file_name, *args, **kwargs):
  want = getattr(_wanted, "generation", None)
  if want is not None and _generation(self, bucket_name, file_name) != want:
    raise _NotMet()
  return _create_file(self, bucket_name, file_name, *args, **kwargs)
storage_module.Storage.create_file = create_file
_insert, _delete = objects.insert, objects.delete
def insert(request, response, storage, *args, **kwargs):
  _wanted.generation = request.query.get("ifGenerationMatch", [None])[0]
  try:
    return _insert(request, response, storage, *args, **kwargs)
  except _NotMet:
    _refuse(response)
  finally:
    _wanted.generation = None
def delete(request, response, storage, *args, **kwargs):
  want = request.query.get("ifGenerationMatch", [None])[0]
  if want is not None and _generation(storage, request.params["bucket_name"],
                                      request.params["object_id"]) != want:
    return _refuse(response)
  return _delete(request, response, storage, *args, **kwargs)
objects.insert, objects.delete = insert, delete

from gcp_storage_emulator import server
def move(request, response, storage, *args, **kwargs):
  bucket, source = request.params["bucket_name"], request.params["object_id"]
  try:
    moved = objects._copy(request.base_url, storage, bucket, source, bucket,
                          request.params["dest_object_id"])
  except Exception:  # NotFound
    response.status = HTTPStatus.NOT_FOUND
    return
  objects._delete(storage, bucket, source)
  response.json(moved)
server.HANDLERS = ((r"^/storage/v1/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/"
                    r"(?P<dest_object_id>.*[^/]+)$", {"POST": move}),) + server.HANDLERS
# TCP_NODELAY: the handler writes a response's headers and body in two sends; with Nagle's
# algorithm the body waits for the client's delayed ACK of the headers (~40 ms a request).
server.RequestHandler.disable_nagle_algorithm = True
# A listen backlog of 128, not http.server's 5: gcsfs sends a copy's or a find's requests at
# once, and a connection the backlog drops is retried by TCP 1 s, then 3 s later.
import http.server
http.server.HTTPServer.request_queue_size = 128
from gcp_storage_emulator.__main__ import main
main(sys.argv[1:])
"""


class Emulator:
  """The emulator process; use as a context manager (stopped and its data gone on exit)."""

  def __init__(self, bucket: str = "bucket"):
    self.bucket, self.port = bucket, free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, "start", "--host=127.0.0.1",
         f"--port={self.port}", f"--default-bucket={bucket}", "--in-memory", "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}", timeout=1).read()
        break
      except OSError:
        if self._proc.poll() is not None or time.time() > deadline:
          self.stop()
          raise RuntimeError("gcp-storage-emulator did not start")
        time.sleep(0.2)

  def env(self) -> dict[str, str]:
    """Variables that point gcsfs, google-cloud-storage and tensorstore at the emulator."""
    return env_for(self.url)

  def filesystem(self):
    """A gcsfs filesystem on the emulator (paths 'bucket/key'), not cached by fsspec."""
    import gcsfs.core  # pylint: disable=g-import-not-at-top  # the class without gRPC probes
    return gcsfs.core.GCSFileSystem(endpoint_url=self.url, token="anon",
                                    skip_instance_cache=True, use_listings_cache=False)

  def stop(self) -> None:
    if self._proc.poll() is None:
      self._proc.terminate()
      self._proc.wait(10)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()


def env_for(url: str) -> dict[str, str]:
  """The environment of a process using the GCS endpoint `url` anonymously."""
  return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
          # gcsfs's gRPC bucket-type probe: emulators have no gRPC (it would wait ~60 s).
          "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
          # No metadata server to ask for credentials on a test machine (none are needed).
          "NO_GCE_CHECK": "true"}
