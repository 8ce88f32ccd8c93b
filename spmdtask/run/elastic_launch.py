"""Elastic slices, the launcher's half: which slices were lost, and the restarts that follow.

A launcher that supervises a multi-slice job's processes (tools/launch_local.py --slices)
runs a `Supervisor`. When a slice is lost, the job's survivors stop as every lost process
stops them (`peers`: exit 5, one line each); the supervisor tells the lost slices from the
exit statuses (`lost_slices`), waits up to `wait_s` for them to come back, and restarts the
job on the slices left (at least `min_slices`) with `--live_slices=L`, so the job shrinks
its DCN axis and keeps its batch (`run.elastic`); the restart resumes from the newest
checkpoint, resharded. When the lost slices are back (`returned`), the supervisor stops the
shrunk job with SIGTERM (it saves its step: a checkpoint, and exits 0) and restarts it on
every slice: the job grows back at that checkpoint.

Processes are numbered slice by slice (slice s holds processes s*P .. s*P+P-1); a restart
numbers the survivors' processes from 0 again, in slice order. Pure policy and a polling
loop: starting processes is the launcher's `start`.
"""
import signal
import subprocess
import time
from typing import Callable, Sequence

from spmdtask import fs
from spmdtask.errors import ConfigError
from spmdtask.run import elastic, peers

# A survivor's exit: spmdtask's lost-peer stop, or JAX's abort when process 0 (the
# coordination service's host) is the one lost (134, or -6 as a signal).
SURVIVED = frozenset({peers.EXIT_LOST_PEER, 134, -signal.SIGABRT})
COMMIT_FILE = "commit_success.txt"  # orbax's mark of a committed step (checkpoint_io's)


def newest_step(checkpoint_dir: str) -> int | None:
  """The newest committed step in `checkpoint_dir`, or None; read without orbax (a launcher
  imports neither it nor JAX)."""
  if not fs.exists(checkpoint_dir):
    return None
  return max((int(n) for n in fs.listdir(checkpoint_dir) if n.isdigit()
              and fs.exists(fs.join(checkpoint_dir, n, COMMIT_FILE))), default=None)


def check(num_processes: int, slices: int, min_slices: int, wait_s: float,
          returns_after_steps: int | None) -> int:
  """Processes per slice; ConfigError (naming the flag and the fix) for flags that cannot
  work together."""
  if slices < 1 or num_processes % slices:
    raise ConfigError(
        f"--slices={slices} does not split --num_processes={num_processes} into equal slices: "
        f"give a slice count that divides it (each slice the same processes), or 1 for a job "
        "that is not elastic.")
  if not 1 <= min_slices <= slices:
    raise ConfigError(
        f"--min_slices={min_slices}: the fewest slices the job goes on with must be from 1 "
        f"to --slices={slices}; with --min_slices={slices} a lost slice ends the job.")
  if wait_s < 0:
    raise ConfigError(f"--slice_wait_s={wait_s}: seconds to wait for a lost slice to come "
                      "back before going on without it: 0 or more.")
  if returns_after_steps is not None and returns_after_steps < 1:
    raise ConfigError(
        f"--slice_returns_after_steps={returns_after_steps}: the steps a lost slice stays "
        "away, 1 or more (or omit it: it never comes back).")
  return num_processes // slices


def describe(code: int) -> str:
  return f"killed by signal {-code}" if code < 0 else f"exited {code}"


def lost_slices(codes: Sequence[int], slices: Sequence[int], per_slice: int
                ) -> list[int] | None:
  """The slices lost, of `slices` whose processes ended with `codes` (slice by slice): those
  with a process that neither finished nor stopped as a survivor. None where no process
  stopped as a survivor (not a lost process: the job's own end or error)."""
  if not any(c in SURVIVED for c in codes):
    return None
  return [s for i, s in enumerate(slices)
          if any(c != 0 and c not in SURVIVED for c in codes[i * per_slice:(i + 1) * per_slice])]


class Supervisor:
  """Runs a job of `num_slices` slices to its end through slice losses and returns.

  Args:
    num_slices: the slices the job's config spans (task.dcn_mesh_shape's product).
    per_slice: processes per slice.
    start: (live slices) -> their processes, started (told `--live_slices` when fewer
      than all).
    newest_step: () -> the job's newest complete checkpoint step, or None.
    checkpoint_dir: the job's checkpoint dir (where the grow-back stop leaves
      `elastic.GROW_STOP_FILE` while the shrunk job stops); None: no such file.
    min_slices: fewer slices left than this ends the job (exit 5, as the survivors).
    wait_s: how long a lost slice is waited for before the job goes on without it.
    returns_after_steps: a lost slice is back once the shrunk job has a checkpoint this
      many steps past the one it resumed from (a local stand-in for a rescheduled slice);
      None: never.
    say: prints one console line.
  """

  def __init__(self, num_slices: int, per_slice: int,
               start: Callable[[list[int]], list[subprocess.Popen]],
               newest_step: Callable[[], int | None], min_slices: int = 1, wait_s: float = 0.0,
               returns_after_steps: int | None = None, say: Callable[[str], None] = print,
               poll_s: float = 0.2, checkpoint_dir: str | None = None):
    self.num_slices, self.per_slice, self.start = num_slices, per_slice, start
    self.newest_step, self.min_slices, self.wait_s = newest_step, min_slices, wait_s
    self.returns_after, self.say, self.poll_s = returns_after_steps, say, poll_s
    self.stop_file = (None if checkpoint_dir is None
                      else fs.join(checkpoint_dir, elastic.GROW_STOP_FILE))

  def run(self) -> int:
    """The job's exit status: 0 once a run finished, else the failing run's first non-zero."""
    live = list(range(self.num_slices))
    while True:
      procs = self.start(live)
      grown = self._wait(procs, live)
      codes = [p.returncode for p in procs]
      if grown and all(c == 0 for c in codes):
        live = list(range(self.num_slices))
        continue
      if all(c == 0 for c in codes):
        return 0
      lost = lost_slices(codes, live, self.per_slice)
      if not lost:
        return next(c for c in codes if c)
      left = [s for s in live if s not in lost]
      what = (f"launch_local: slice {_names(lost)} of {self.num_slices} lost ("
              + "; ".join(f"process {i} {describe(c)}" for i, c in enumerate(codes) if c) + ")")
      if len(left) < self.min_slices:
        self.say(f"{what}; {len(left)} of {self.num_slices} left, fewer than --min_slices="
                 f"{self.min_slices}: the job stops (rerun it when the slices are back).")
        return peers.EXIT_LOST_PEER
      if self.wait_s:  # the lost slice may come back in time (locally it never does)
        time.sleep(self.wait_s)
      newest = self.newest_step()
      self.say(f"{what}; restarting on {len(left)} of {self.num_slices} slices (slice "
               f"{_names(left)}) from the newest checkpoint ("
               + (f"step {newest})." if newest is not None else "none in the job dir: the "
                  "local tier's newest step where it restores, else the start)."))
      live = left

  def _wait(self, procs: list[subprocess.Popen], live: list[int]) -> bool:
    """Waits for every process; True where the lost slices came back and the shrunk job
    was stopped (SIGTERM: it saves) to grow back."""
    back_at = None
    if len(live) < self.num_slices and self.returns_after is not None:
      back_at = (self.newest_step() or 0) + self.returns_after
    grown = False
    try:
      while any(p.poll() is None for p in procs):
        try:
          grown = self._poll(procs, back_at, grown)
        except KeyboardInterrupt:  # the processes got the Ctrl-C too: they save, exit 130
          back_at = None
    finally:
      if grown and self.stop_file is not None and fs.exists(self.stop_file):
        fs.rm(self.stop_file)
    return grown

  def _poll(self, procs: list[subprocess.Popen], back_at: int | None, grown: bool) -> bool:
    """One look: once the lost slices are back, SIGTERM to the shrunk job (once)."""
    if back_at is not None and not grown and (self.newest_step() or 0) >= back_at:
      self.say(f"launch_local: the lost slices are back (the job passed step {back_at}): "
               f"stopping it at its next step, saved, to grow back to {self.num_slices} "
               "slices.")
      if self.stop_file is not None:  # before the signal: the stop reads it
        fs.write_text(self.stop_file, "the shrunk job stops to grow back\n")
      for p in procs:
        if p.poll() is None:
          p.send_signal(signal.SIGTERM)
      grown = True
    time.sleep(self.poll_s)
    return grown


def _names(slices: Sequence[int]) -> str:
  return ", ".join(map(str, slices))
