"""A lost peer: when a process of a multi-process job is lost, the others stop with one
line naming it, the newest complete checkpoint and the rerun command, and exit
EXIT_LOST_PEER, whichever way the loss shows itself first.

Every process writes a beat to JAX's distributed key-value store every BEAT_S seconds and
reads everyone's (the `Watch` thread). A loss shows itself in one of four ways:
- a collective fails (gloo, NCCL, TPU ICI/DCN: JAX raises an error carrying the runtime's
  status when a peer's connection closes) or a key-value-store call fails (orbax's
  barriers, the preemption sync point): `stop_if_lost(error)`, called where the train loop
  (before its hooks close: their saves would wait for the lost peer) and the binary meet
  an error, asks the beats which process is gone: one whose beat has not moved for
  SILENT_S, or process 0 when its store no longer answers. It waits at most LOST_S; if
  every peer beats on, the error was not a lost peer and goes on as it was;
- a collective that never returns (gloo sometimes waits on a dead peer instead of failing):
  the watch thread names a peer whose beat has not moved for LOST_S;
- the store (process 0) not answering for LOST_S;
- a peer on this machine (its beat names its pid, the machine's boot and pid namespace)
  whose process has ended without marking itself done: at the next beat, whatever the
  main thread waits on (a collective or an orbax barrier that would wait LOST_S).
The verdict is written to the store, so the other survivors adopt it at once rather than
taking process 0's exit for a second loss; process 0 (the store's host) waits for them, up
to SILENT_S, before it exits. The failure's traceback goes to the absl log (logs/), the
line to stderr, and the process ends with `os._exit`: a normal exit would wait in
`jax.distributed.shutdown` and orbax's barriers for the lost process until JAX's client
aborts it (exit 134). Committed checkpoints stay as they are; an unfinished one is never
used. A process that ends normally marks itself done, so the others never count it lost.

Why not JAX's own detection: its coordination service's missed heartbeats
(`heartbeat_timeout_seconds`, kept above LOST_S as a backstop: `cluster.JAX_HEARTBEAT_S`)
end a survivor with a C++ fatal error, exit 134 and no word of which process was lost; its
client's missed-heartbeat callback cannot be written in Python (jaxlib 0.10.2: bad_cast).
Not covered: process 0 lost. JAX's client on the others aborts them as soon as its poll of
the coordinator fails (measured over gloo: 2.5 ms after the survivor's own collective
failed, while its first store call still waited), exit 134, so nothing is said first.
"""
import atexit
import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Callable

from absl import logging

from spmdtask import console

BEAT_S = 1.0
SILENT_S = 5.0   # after a failed collective, a beat this still is a lost process
LOST_S = 30.0    # with no failure seen, a beat this still is a lost process
EXIT_LOST_PEER = 5
_PREFIX = "spmdtask/beat/"
_DONE = "done"
_LOST = "lost:"  # a survivor's verdict, in place of its beat: "lost:<process>"
# The absl status codes (the same from every runtime: gloo, NCCL, TPU ICI/DCN, JAX's
# coordination service) a lost peer shows as. JAX raises them as JaxRuntimeError, or as
# ValueError when a failed collective's output is used; an out-of-memory
# (RESOURCE_EXHAUSTED) or a bad program (INVALID_ARGUMENT) never needs the beats asked.
_PEER_CODES = ("UNKNOWN", "UNAVAILABLE", "INTERNAL", "DEADLINE_EXCEEDED", "ABORTED",
               "CANCELLED", "FAILED_PRECONDITION", "DATA_LOSS")


def lost_line(lost: int, me: int, num_processes: int, how: str, newest_step: int | None,
              checkpoint_dir: str, rerun: str = "") -> str:
  """The one line survivor `me` stops with; `how` says how the loss showed itself."""
  kept = (f"the newest complete checkpoint is step {newest_step} in {checkpoint_dir}: a "
          "rerun resumes from it" if newest_step is not None else
          "no checkpoint was completed yet: a rerun begins at step 0")
  again = f" (this one: {rerun})" if rerun else ""
  return (f"spmdtask: lost process {lost} of {num_processes} (killed, crashed, or its host "
          f"gone): {how}. Process {me} stops here (exit {EXIT_LOST_PEER}); {kept}. Rerun "
          f"every process with the command it was started with{again}.")


class Watch:
  """The beat-and-watch thread of this process (start it once the job is joined), and the
  verdict a failed collective asks of it."""

  def __init__(self, client, process: int, num_processes: int,
               newest_step: Callable[[], int | None], checkpoint_dir: str, rerun: str = "",
               beat_s: float = BEAT_S, silent_s: float = SILENT_S, lost_s: float = LOST_S):
    self.client, self.process, self.num_processes = client, process, num_processes
    self.newest_step, self.checkpoint_dir, self.rerun = newest_step, checkpoint_dir, rerun
    self.beat_s, self.silent_s, self.lost_s = beat_s, silent_s, lost_s
    self._done, self._lock, self._stopping = threading.Event(), threading.Lock(), False
    now = time.monotonic()
    self._beat, self._answered = 0, now
    self.here = _here()
    self._seen: dict[int, str | None] = {}
    self._moved = {p: now for p in range(num_processes)}  # when its beat last changed

  def start(self) -> None:
    atexit.register(self.finish)  # runs before JAX's own exit handler (registered earlier)
    threading.Thread(target=self._run, daemon=True, name="spmdtask-peers").start()

  def finish(self) -> None:
    """This process is ending: the others must not count it lost."""
    if not self._done.is_set():
      self._done.set()
      self._set(_DONE)

  def _set(self, value: str) -> bool:
    try:
      self.client.key_value_set(f"{_PREFIX}{self.process}", value, allow_overwrite=True)
      return True
    except Exception:  # pylint: disable=broad-except  # the store's host is gone
      return False

  def _poll(self) -> dict[int, str] | None:
    """Beats once and reads every beat (None: the store does not answer)."""
    with self._lock:
      self._beat += 1
      beat = self._beat
    try:
      if not self._done.is_set():
        self.client.key_value_set(f"{_PREFIX}{self.process}", f"{beat} {os.getpid()} {self.here}",
                                  allow_overwrite=True)
      raw = dict(self.client.key_value_dir_get(_PREFIX))
    except Exception:  # pylint: disable=broad-except  # the store (process 0) is gone
      return None
    now = time.monotonic()
    beats = {p: raw.get(f"{_PREFIX}{p}") for p in range(self.num_processes)}
    with self._lock:
      self._answered = now
      for p, value in beats.items():
        if value != self._seen.get(p):
          self._seen[p], self._moved[p] = value, now
    return beats

  def _still(self, beats: dict[int, str]) -> tuple[int, float] | None:
    """The peer whose beat has been still the longest (a finished one never counts)."""
    now = time.monotonic()
    with self._lock:
      still = [(now - self._moved[p], p) for p in range(self.num_processes)
               if p != self.process and beats.get(p) != _DONE]
    return (max(still)[1], max(still)[0]) if still else None

  def _ended_here(self, beats: dict[int, str]) -> int | None:
    """A peer in this machine's pid namespace whose process has ended (killed, crashed)
    without marking itself done: lost at once, no silence to wait for."""
    for p, value in beats.items():
      parts = str(value).split(" ")
      if (p != self.process and self.here and len(parts) == 3 and parts[2] == self.here
          and parts[1].isdigit() and _ended(int(parts[1]))):
        return p
    return None

  def _run(self) -> None:
    while not self._done.wait(self.beat_s):
      beats = self._poll()
      if beats is None:
        silent = time.monotonic() - self._answered
        if silent > self.lost_s and self.process != 0:
          self._stop(0, f"its key-value store has not answered for {silent:.0f} s")
        continue
      verdict = _verdict(beats, self.process)
      still = self._still(beats)
      gone = self._ended_here(beats)
      if verdict is not None:
        self._stop(verdict, "another process saw it go")
      elif gone is not None:
        self._stop(gone, "its process on this host has ended")
      elif still is not None and still[1] > self.lost_s:
        self._stop(still[0], f"it has given no sign of life for {still[1]:.0f} s")

  def lost_after(self, error: BaseException) -> None:
    """Ends this process with the line if `error` came from a lost peer; else returns."""
    # Meanwhile the loss's other failures (orbax's save threads) go to the log, not the console.
    with console.libraries_to_log():
      self._ask(error)

  def _ask(self, error: BaseException) -> None:
    what = f"a collective or key-value-store call failed ({peer_status(error)})"
    t0 = time.monotonic()
    first = None
    while time.monotonic() - t0 < self.lost_s:
      beats = self._poll()
      if beats is None:
        if self.process != 0:
          self._stop(0, f"{what}, and its key-value store no longer answers", error)
        return  # process 0 hosts the store: it cannot fail to answer here
      verdict = _verdict(beats, self.process)
      if verdict is not None:
        self._stop(verdict, f"{what}; another process saw it go", error)
      gone = self._ended_here(beats)
      if gone is not None:
        self._stop(gone, f"{what}, and its process on this host has ended", error)
      still = self._still(beats)
      if still is not None and still[1] > self.silent_s:
        self._stop(still[0], f"{what}, and it has given no sign of life for "
                   f"{still[1]:.0f} s", error)
      first = first or beats
      if all(beats[p] != first[p] for p in range(self.num_processes)
             if p != self.process and beats[p] != _DONE):
        return  # every peer beat on since: they are all alive
      time.sleep(self.beat_s / 5)

  def _stop(self, lost: int, how: str, error: BaseException | None = None) -> None:
    with self._lock:
      first, self._stopping = not self._stopping, True
    if not first:  # the other thread is printing the line: its os._exit ends this one too
      threading.Event().wait()
    try:
      step = self.newest_step()
    except Exception:  # pylint: disable=broad-except  # unreadable: say so, stop anyway
      step = None
    line = lost_line(lost, self.process, self.num_processes, how, step, self.checkpoint_dir,
                     self.rerun)
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)  # first: JAX's client may abort this process
    if error is not None:
      logging.info("The failure that showed the loss:\n%s",
                   "".join(traceback.format_exception(error)))
    logging.info("%s", line)
    logging.flush()
    self._done.set()  # no more beats: the verdict takes this process's key
    self._set(f"{_LOST}{lost}")
    for fn in list(_before_exit):  # e.g. the goodput record's end: the run ends here
      try:
        fn()
      except Exception:  # pylint: disable=broad-except  # the exit must happen
        logging.exception("Before the lost-peer exit:")
    logging.flush()
    if self.process == 0:
      self._linger(lost)
    os._exit(EXIT_LOST_PEER)  # pylint: disable=protected-access

  def _linger(self, lost: int) -> None:
    """Process 0 hosts the store: it stays until every other survivor has a verdict."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < self.silent_s:
      try:
        raw = dict(self.client.key_value_dir_get(_PREFIX))
      except Exception:  # pylint: disable=broad-except
        return
      if all(str(raw.get(f"{_PREFIX}{p}")).startswith((_LOST, _DONE))
             for p in range(1, self.num_processes) if p != lost):
        return
      time.sleep(self.beat_s / 5)


def _here() -> str:
  """This machine's boot and pid namespace: peers that share them see each other's
  processes (several processes per host, e.g. one per GPU, or tools/launch_local.py); ''
  where that cannot be told (not Linux)."""
  try:
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
      return f"{f.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
  except OSError:
    return ""


def _ended(pid: int) -> bool:
  """Whether process `pid` (of this pid namespace) has ended: gone, or a zombie its parent
  has not yet reaped."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
  except FileNotFoundError:
    return True
  except (OSError, IndexError):
    return False


def _verdict(beats: dict[int, str], me: int) -> int | None:
  """A lost process another survivor has already named."""
  return next((int(v[len(_LOST):]) for p, v in beats.items()
               if p != me and v and v.startswith(_LOST)), None)


_watch: Watch | None = None
_before_exit: list[Callable[[], None]] = []


@contextlib.contextmanager
def before_exit(fn: Callable[[], None]):
  """While inside, a lost-peer stop of this process calls `fn` (quick, local: it runs
  between the line and the exit) before it exits; its errors go to the log."""
  _before_exit.append(fn)
  try:
    yield
  finally:
    _before_exit.remove(fn)


def stop_if_lost(error: BaseException) -> None:
  """Call with an error a multi-process job met (an exception handler's `except`, before
  any cleanup that talks to the other processes): ends the process with the lost-peer line
  (exit EXIT_LOST_PEER) if a lost process caused it, else returns. Only an error that
  carries a status a lost peer shows as is asked of the beats."""
  if _watch is not None and peer_status(error) is not None:
    _watch.lost_after(error)


def peer_status(error: BaseException | None) -> str | None:
  """The status code a lost peer shows as that `error`, or an error it was raised from,
  carries (JAX's runtime errors begin their message with it); None if none does."""
  for _ in range(8):  # the chain a library's wrapping leaves is short
    if error is None:
      return None
    code = str(error).split(":", 1)[0]
    if code in _PEER_CODES:
      return code
    error = error.__cause__ or error.__context__
  return None


def watch(job_log_dir: str, rerun: str = "") -> Watch | None:
  """Starts this process's watch in a joined multi-process job (None for one process).
  `rerun`: this process's command line, named in the line."""
  global _watch
  import jax  # pylint: disable=g-import-not-at-top
  from spmdtask.run import checkpoints, cluster  # pylint: disable=g-import-not-at-top
  client = cluster.kv_store()
  if client is None or jax.process_count() < 2:
    return None
  directory = checkpoints.checkpoint_dir(job_log_dir)
  _watch = Watch(client, jax.process_index(), jax.process_count(),
                 lambda: max(checkpoints.complete_steps(directory), default=None), directory,
                 rerun)
  _watch.start()
  return _watch
