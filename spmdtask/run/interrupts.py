"""Ctrl-C and SIGTERM: stop training at a step boundary, save that step, exit cleanly.

`watch()` (the binary, first thing) starts a watcher thread on Python's signal wakeup fd,
so signals are seen even while the main thread waits in C++ (an XLA compile, a device
transfer), where Python-level handlers cannot run. Outside training, a first Ctrl-C raises
KeyboardInterrupt as usual (the binary prints one line and exits 130); a second one exits
at once (status 130) from the watcher thread.

During training, `StopRequest` (a context manager around the step loop) turns the first
Ctrl-C into a request to stop after the current step, and SIGTERM into a preemption; the
loop asks `stop(step)` after every step and, when told, saves that step and ends. A
second Ctrl-C exits at once without saving (the unfinished save is never committed, so
a rerun resumes from the previous complete checkpoint).

Multi-process jobs: every process must save the same step (the save is collective).
JAX's preemption sync point (`jax.distributed` with its preemption service, on by default)
already agrees on that step for SIGTERM: a process that gets Ctrl-C sends itself SIGTERM,
which JAX's own handler turns into a notice to every process; all stop and save at the
step the sync point names. Processes that saw Ctrl-C report "Interrupted" (exit 130), the
others "Preempted" (exit 0). Without the preemption service, Ctrl-C in a multi-process
job exits at once, as a second Ctrl-C does.
"""
import os
import signal
import sys
import threading
from typing import Callable

INTERRUPTED = "interrupted"
PREEMPTED = "preempted"
_ACK_AFTER_S = 10.0  # a stop that takes longer than this is acknowledged on the console


class _Watcher:
  """Counts SIGINTs on the wakeup fd in a thread; the one that matters exits at once."""

  def __init__(self):
    self.count = 0
    self.saving = None           # the active StopRequest while training
    self.lock = threading.Lock()
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=self._run, args=(read_end,), daemon=True,
                     name="spmdtask-signals").start()

  def _run(self, read_end: int) -> None:
    while True:
      data = os.read(read_end, 64)
      if not data:
        return
      for signum in data:
        if signum == signal.SIGINT:
          self._on_sigint()

  def _on_sigint(self) -> None:
    with self.lock:
      self.count += 1
      saving = self.saving
    if self.count >= 2:
      print(after_ctrl_c() + "Interrupted again: exiting now, without saving.",
            file=sys.stderr, flush=True)
      os._exit(130)  # pylint: disable=protected-access
    if saving is not None:
      saving.on_first_sigint()


_watcher: _Watcher | None = None


def after_ctrl_c() -> str:
  """A newline on a terminal, where the line holds the echoed ^C; nothing otherwise."""
  return "\n" if sys.stderr.isatty() else ""


def watch() -> None:
  """Starts the watcher (main thread only; once). Library use never calls it."""
  global _watcher
  if _watcher is None and threading.current_thread() is threading.main_thread():
    _watcher = _Watcher()


def _multiprocess_notice() -> bool:
  """Sends this process SIGTERM when JAX's preemption service will relay it; True if so."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  if distributed.global_state.preemption_sync_manager is None:
    return False
  os.kill(os.getpid(), signal.SIGTERM)  # JAX's C++ handler notifies every process
  return True


class StopRequest:
  """Why training should stop after a step: None, INTERRUPTED (Ctrl-C) or PREEMPTED.

  Args:
    num_processes: jax.process_count().
    reached_preemption: `step -> bool`, JAX's multi-host preemption sync point (through
      the checkpoint manager); True at the same step on every process.
  Use as a context manager around the step loop; call it after every step.
  """

  def __init__(self, num_processes: int, reached_preemption: Callable[[int], bool]):
    self.num_processes, self.reached_preemption = num_processes, reached_preemption
    self.sigint = self.sigterm = False
    self.done = threading.Event()
    self._old: dict[int, object] = {}

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self
    if self.num_processes == 1:  # multi-process jobs: JAX's own SIGTERM handler
      self._old[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
    if _watcher is not None:
      # The watcher thread handles SIGINT; the Python-level handler must not raise.
      self._old[signal.SIGINT] = signal.signal(signal.SIGINT, lambda *_: None)
      with _watcher.lock:
        _watcher.saving = self
    return self

  def __exit__(self, *exc):
    if _watcher is not None:
      with _watcher.lock:
        _watcher.saving = None
    for signum, handler in self._old.items():
      signal.signal(signum, handler)
    self._old = {}
    self.done.set()
    return False

  def _on_sigterm(self, *_):
    self.sigterm = True

  def on_first_sigint(self) -> None:
    """The watcher thread saw the first Ctrl-C."""
    if self.num_processes > 1 and not _multiprocess_notice():
      print(after_ctrl_c() + "Interrupted: this multi-process job has no preemption service "
            "to agree on a step to save, so it exits now, without saving.", file=sys.stderr,
            flush=True)
      os._exit(130)  # pylint: disable=protected-access
    self.sigint = True
    ack = threading.Timer(_ACK_AFTER_S, self._acknowledge)
    ack.daemon = True
    ack.start()

  def _acknowledge(self) -> None:
    if not self.done.is_set():
      print(after_ctrl_c() + "Ctrl-C: saving at the end of the current step (Ctrl-C again "
            "exits now, without saving)...", file=sys.stderr, flush=True)

  def __call__(self, step: int) -> str | None:
    """The reason to stop after `step` (every process gets the same answer), or None."""
    if self.num_processes > 1:
      if not self.reached_preemption(step):
        return None
      return INTERRUPTED if self.sigint else PREEMPTED
    if self.sigint:
      return INTERRUPTED
    if self.sigterm or self.reached_preemption(step):
      return PREEMPTED
    return None
