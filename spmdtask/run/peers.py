"""A lost peer: the processes of a multi-process job watch each other; when one is lost, the
others stop within about LOST_S seconds, each with one line naming it and the newest complete
checkpoint, and exit EXIT_LOST_PEER.

JAX's own detection (its coordination service's heartbeats, `heartbeat_timeout_seconds` of
`jax.distributed.initialize`) ends a survivor with a C++ fatal error, an abort (exit 134), a
stack dump and no word of which process was lost. Its client takes a missed-heartbeat
callback instead, but not one written in Python: jaxlib 0.10.2 fails to pass it the status
(std::bad_cast, another abort). And a survivor waiting in a collective for the lost process
cannot be reached from Python. So every process writes a beat to JAX's distributed key-value
store every BEAT_S seconds and reads everyone's. A peer whose beat has not moved for LOST_S
(or process 0, the store's host, not answering for as long) is lost: the watching thread
prints the line and ends its process with `os._exit` (committed checkpoints stay as they are;
an unfinished one is never used). JAX's heartbeat timeout is set above LOST_S
(`cluster.JAX_HEARTBEAT_S`), as a backstop. A process that ends marks itself done at exit,
so the others never count it lost while they finish. Not covered: when process 0 itself is
lost, JAX's client on the others aborts at once (it polls the coordinator for errors).
"""
import atexit
import os
import sys
import threading
import time
from typing import Callable

from absl import logging

BEAT_S = 3.0
LOST_S = 30.0
EXIT_LOST_PEER = 5
_PREFIX = "spmdtask/beat/"
_DONE = "done"


def lost_line(lost: int, me: int, num_processes: int, seconds: float,
              newest_step: int | None, checkpoint_dir: str) -> str:
  """The one line survivor `me` stops with; process 0 lost means its key-value store no
  longer answers."""
  what = ("no longer answers (it hosts the job's coordinator)" if lost == 0
          else "has given no sign of life")
  kept = (f"the newest complete checkpoint is step {newest_step} in {checkpoint_dir}: restart "
          "every process with the same command to resume from it" if newest_step is not None
          else "no checkpoint was completed yet: a restart begins at step 0")
  return (f"spmdtask: lost process {lost} of {num_processes}: it {what} for {seconds:.0f} s "
          f"(killed, crashed, or its host gone). Process {me} stops here (exit "
          f"{EXIT_LOST_PEER}); {kept}.")


class Watch:
  """The beat-and-watch thread of this process (start it once the job is joined)."""

  def __init__(self, client, process: int, num_processes: int,
               newest_step: Callable[[], int | None], checkpoint_dir: str,
               beat_s: float = BEAT_S, lost_s: float = LOST_S):
    self.client, self.process, self.num_processes = client, process, num_processes
    self.newest_step, self.checkpoint_dir = newest_step, checkpoint_dir
    self.beat_s, self.lost_s = beat_s, lost_s
    self._done = threading.Event()

  def start(self) -> None:
    atexit.register(self.finish)  # runs before JAX's own exit handler (registered earlier)
    threading.Thread(target=self._run, daemon=True, name="spmdtask-peers").start()

  def finish(self) -> None:
    """This process is ending: the others must not count it lost."""
    if not self._done.is_set():
      self._done.set()
      try:
        self.client.key_value_set(f"{_PREFIX}{self.process}", _DONE, allow_overwrite=True)
      except Exception:  # pylint: disable=broad-except  # the store's host is gone
        pass

  def _run(self) -> None:
    now = time.monotonic()
    seen, moved, answered, beat = {}, {p: now for p in range(self.num_processes)}, now, 0
    while not self._done.wait(self.beat_s):
      now = time.monotonic()
      try:
        beat += 1
        self.client.key_value_set(f"{_PREFIX}{self.process}", str(beat), allow_overwrite=True)
        beats = dict(self.client.key_value_dir_get(_PREFIX))
        answered = now
      except Exception:  # pylint: disable=broad-except  # the store (process 0) is gone
        if now - answered > self.lost_s and not self._done.is_set():
          self._stop(0, now - answered)
        continue
      for p in range(self.num_processes):
        value = beats.get(f"{_PREFIX}{p}")
        if p == self.process or value == _DONE:
          continue
        if value != seen.get(p):
          seen[p], moved[p] = value, now
        elif now - moved[p] > self.lost_s and not self._done.is_set():
          self._stop(p, now - moved[p])

  def _stop(self, process: int, seconds: float) -> None:
    try:
      step = self.newest_step()
    except Exception:  # pylint: disable=broad-except  # unreadable: say so, stop anyway
      step = None
    line = lost_line(process, self.process, self.num_processes, seconds, step,
                     self.checkpoint_dir)
    logging.info("%s", line)
    logging.flush()
    print(line, file=sys.stderr, flush=True)
    os._exit(EXIT_LOST_PEER)  # pylint: disable=protected-access


def watch(job_log_dir: str) -> Watch | None:
  """Starts this process's watch in a joined multi-process job (None for one process)."""
  import jax  # pylint: disable=g-import-not-at-top
  from spmdtask.run import checkpoints, cluster  # pylint: disable=g-import-not-at-top
  client = cluster.kv_store()
  if client is None or jax.process_count() < 2:
    return None
  directory = checkpoints.checkpoint_dir(job_log_dir)
  w = Watch(client, jax.process_index(), jax.process_count(),
            lambda: max(checkpoints.complete_steps(directory), default=None), directory)
  w.start()
  return w
