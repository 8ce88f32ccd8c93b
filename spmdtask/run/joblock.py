"""One training job per job dir: `--mode=train` holds `job_log_dir/job.lock` while it runs.

The lock holds a small JSON record of its holder (host, process id, start time; on GCS a lease
expiry), so a second job can name it. How the lock is held:
- A local (or NFS) dir: the file is `flock`ed. The kernel drops the lock however its holder ends
  (SIGKILL included), so a record left behind by a dead holder is taken over at once.
- gs://: an object created with `ifGenerationMatch=0`, so of several creators exactly one
  wins. The holder rewrites it every LEASE_S / 4 seconds from a daemon thread, conditioned on
  its own generation, moving the lease on. A record whose lease has passed is a job that is
  gone (SIGKILLed, its VM lost), as is one of this host whose process has ended; either is
  replaced, conditioned on the generation read, so again one of several starters wins.
- Other URL schemes (memory://, s3://): not locked.
Eval, decode and plan take no lock: evaluating a job's checkpoints while it trains is normal.
Multi-process jobs: process 0 holds the lock; it tells the others the outcome through JAX's
distributed key-value store, so all processes go on, or all exit 2, together.
"""
import contextlib
import fcntl
import json
import os
import socket
import threading
import time

from absl import logging

from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.run import cluster

LOCK_FILE = "job.lock"
LEASE_S = 60.0        # gs://: a holder not heard of for this long is gone
_OUTCOME_KEY = "spmdtask/joblock"
_OUTCOME_TIMEOUT_MS = 10 * 60 * 1000  # process 0 answers within seconds; a bound, not a wait


class Held(Exception):
  """The lock is held by `holder` (its record, or None if it could not be read)."""

  def __init__(self, holder: dict | None):
    super().__init__(holder)
    self.holder = holder


def _record(lease_s: float | None) -> dict:
  now = time.time()
  return {"host": socket.gethostname(), "pid": os.getpid(), "started": now,
          "lease_until": None if lease_s is None else now + lease_s}


def _parse(data: bytes) -> dict | None:
  try:
    record = json.loads(data.decode("utf-8"))
    return record if isinstance(record, dict) and "pid" in record else None
  except ValueError:
    return None


def _when(t: float) -> str:
  return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def describe(holder: dict | None) -> str:
  """'process 123 on host-a (started 2025-11-25 07:00:26)'."""
  if not holder:
    return "another process (its record is not readable yet)"
  return (f"process {holder.get('pid')} on {holder.get('host')} (started "
          f"{_when(holder.get('started', 0))})")


def _gone(holder: dict) -> bool:
  """A leased holder known to be gone: its lease has passed, or it ran on this host and its
  process has ended (a rerun after a kill need not wait for the lease)."""
  if (holder.get("lease_until") or 0) <= time.time():
    return True
  if holder.get("host") != socket.gethostname():
    return False
  try:
    os.kill(int(holder["pid"]), 0)
  except ProcessLookupError:
    return True
  except (OSError, ValueError):  # another user's process, or a bad record
    pass
  return False


class LocalLock:
  """An flock on a local file; `acquire` returns the record of a dead holder it replaced."""

  lease_s = None  # the kernel holds an flock for as long as its holder lives

  def __init__(self, path: str):
    self.path, self.fd = path, None

  def start_refreshing(self) -> None:
    """Nothing to refresh (see `lease_s`)."""

  def acquire(self, record: dict) -> dict | None:
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = self._read_holder(fd)
        os.close(fd)
        raise Held(holder) from None
      except OSError:  # a filesystem without locks (some FUSE mounts)
        os.close(fd)
        logging.warning("The job dir's filesystem has no file locks: %s is not locked, so "
                        "nothing stops a second job from training in it.", self.path)
        return None
      try:
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if not same:  # its holder released (removed) it between our open and flock
        os.close(fd)
        continue
      previous = _parse(os.pread(fd, 4096, 0))
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
      self.fd = fd
      return previous

  @staticmethod
  def _read_holder(fd: int) -> dict | None:
    for _ in range(20):  # the holder writes its record right after taking the lock
      holder = _parse(os.pread(fd, 4096, 0))
      if holder:
        return holder
      time.sleep(0.05)
    return None

  def release(self) -> None:
    if self.fd is not None:
      with contextlib.suppress(FileNotFoundError):
        os.unlink(self.path)  # before unlocking: a waiter then re-opens the path afresh
      os.close(self.fd)
      self.fd = None


class GcsLock:
  """An object with a lease, written with generation preconditions (see the module doc)."""

  def __init__(self, url: str, lease_s: float = LEASE_S):
    bucket, _, key = url.split("://", 1)[1].partition("/")
    self.blob = fs.gcs_client().bucket(bucket).blob(key)
    self.lease_s, self.generation, self.record = lease_s, None, None
    self._stop = threading.Event()
    self._thread = None

  def _write(self, record: dict, if_generation_match: int) -> None:
    self.blob.upload_from_string(json.dumps(record), content_type="application/json",
                                 if_generation_match=if_generation_match)
    self.generation, self.record = self.blob.generation, record

  def acquire(self, record: dict) -> dict | None:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    holder = None
    for _ in range(5):  # each pass loses only to a writer that changed the object meanwhile
      try:
        self._write(record, if_generation_match=0)
        return None
      except exceptions.PreconditionFailed:
        pass
      try:
        found = self.blob.bucket.get_blob(self.blob.name)
        data = found.download_as_bytes(if_generation_match=found.generation) if found else None
      except (exceptions.NotFound, exceptions.PreconditionFailed):
        continue  # released or rewritten meanwhile: try again
      if found is None:
        continue
      holder = _parse(data)
      if holder and not _gone(holder):
        raise Held(holder)
      try:
        self._write(record, if_generation_match=found.generation)
        return holder or {}
      except exceptions.PreconditionFailed:
        continue
    raise Held(holder)

  def start_refreshing(self) -> None:
    self._thread = threading.Thread(target=self._refresh_loop, daemon=True,
                                    name="spmdtask-joblock")
    self._thread.start()

  def _refresh_loop(self) -> None:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    while not self._stop.wait(self.lease_s / 4):
      try:
        self._write({**self.record, "lease_until": time.time() + self.lease_s},
                    if_generation_match=self.generation)
      except exceptions.PreconditionFailed:
        logging.warning("Lost the job lock %s: another job took it over after this job's "
                        "lease ran out (no refresh for %.0f s). Two jobs may now write this "
                        "job dir: stop one.", self.blob.name, self.lease_s)
        return
      except Exception as e:  # pylint: disable=broad-except  # network: try again next time
        logging.info("Job lock refresh failed (%s: %s); retrying.", type(e).__name__, e)

  def release(self) -> None:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    if self.generation is not None:
      with contextlib.suppress(exceptions.NotFound, exceptions.PreconditionFailed):
        self.blob.delete(if_generation_match=self.generation)
      self.generation = None


def lock_for(job_log_dir: str):
  """The lock of `job_log_dir` (LocalLock or GcsLock), or None where none is kept."""
  path = fs.join(job_log_dir, LOCK_FILE)
  if not fs.is_remote(path):
    return LocalLock(path)
  if path.startswith(("gs://", "gcs://")):
    return GcsLock(path)
  return None


def refusal(job_log_dir: str, holder: dict | None) -> str:
  """The paragraph a second job exits with."""
  lease = (holder or {}).get("lease_until")
  way_out = (f"If that job is gone (its VM lost, the process killed), its lease ends at "
             f"{_when(lease)} and a start after that takes the lock over; otherwise stop it"
             if lease else "Stop that job first (a job that died holds no lock here)")
  return (f"--job_log_dir={job_log_dir!r} is in use: {describe(holder)} is training in it "
          f"(it holds {fs.join(job_log_dir, LOCK_FILE)}). Two trainings in one job dir would "
          f"both write its checkpoints and summaries. {way_out}, or give this job another "
          "--job_log_dir. --mode=eval and --mode=decode may run beside it.")


def _take(job_log_dir: str):
  """Process 0's part: the lock taken (or None), and the line to print after a takeover."""
  lock = lock_for(job_log_dir)
  if lock is None:
    logging.info("No job lock for %s (only local and gs:// job dirs are locked).", job_log_dir)
    return None, None
  fs.makedirs(job_log_dir)
  try:
    previous = lock.acquire(_record(lock.lease_s))
  except Held as e:
    raise ConfigError(refusal(job_log_dir, e.holder)) from None
  lock.start_refreshing()
  line = None
  if previous is not None:
    line = (f"Took over the job lock of {describe(previous)}: that job ended without "
            "releasing it (killed, or its machine lost).")
  return lock, line


@contextlib.contextmanager
def held(job_log_dir: str):
  """Holds the job dir's lock for the `with` block (process 0; the others share its outcome).

  Raises ConfigError naming the holder when another job holds it. Yields the takeover line
  to print once the console is set up (or None)."""
  import jax  # pylint: disable=g-import-not-at-top
  lock, line = None, None
  if jax.process_index() == 0:
    try:
      lock, line = _take(job_log_dir)
      outcome = ""
    except ConfigError as e:
      outcome = str(e)
      raise
    except BaseException as e:
      outcome = (f"Process 0 could not take the job lock of --job_log_dir={job_log_dir!r} "
                 f"({type(e).__name__}: {e}); see its console.")
      raise
    finally:
      if jax.process_count() > 1:
        cluster.kv_store().key_value_set(_OUTCOME_KEY, outcome)
  else:
    outcome = cluster.kv_store().blocking_key_value_get(_OUTCOME_KEY, _OUTCOME_TIMEOUT_MS)
    if outcome:
      raise ConfigError(outcome)
  try:
    yield line
  finally:
    if lock is not None:
      lock.release()
