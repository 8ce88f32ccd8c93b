"""Where a train run's wall time goes, written as it goes: `job_log_dir/goodput/*.jsonl`.

Process 0 of each run (every start of `--mode=train` on the job dir) writes one file, named
by its start time, host and process id, through `spmdtask.fs` (local or gs://). Its lines:
  {"run": ID, "start": T, ...}                the process's start (the binary's first line)
  {"start": T0, "end": T1, "seconds": {PHASE: S, ...}, "steps": [A, B]}
                                              a window: contiguous, the seconds of each
                                              phase in it summing to T1 - T0; steps A..B
                                              completed in it (absent: none)
  {"begin": STEP, "t": T}                      the loop starts after STEP (restored or 0)
  {"end": REASON, "t": T}                      how the run ended (done, preempted, ...)
Times are Unix seconds. A window is written every `flush_s` seconds by a thread (so a run
killed by SIGKILL loses at most that much, plus its unfinished step) and at the end. On a
local disk the file is appended to; an object store has no append, so there the part is
rewritten whole and a new part started past `part_bytes`.

Phases: `startup` (imports, config, program setup, init: the default before the loop),
`restore`, `compile` (JAX's tracing, lowering and XLA compile, from `jax.monitoring`, on
the thread that trains), `step`, `data` (waiting for the train input's next batch),
`save` (the blocking part of a checkpoint save, and the wait for the last one),
`eval` and `other` (after the loop). Attribution over runs is `run.goodput`'s.
"""
import contextlib
import json
import os
import socket
import threading
import time

from absl import logging
import jax

from spmdtask import fs
from spmdtask.run.hooks import Hook

DIR = "goodput"
# JAX's own timing events around each trace, lowering and backend compile (jax._src.dispatch):
# a scalar (their start) on entry, a time span on exit.
COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration",
                            "/jax/core/compile/jaxpr_to_mlir_module_duration",
                            "/jax/core/compile/backend_compile_duration"})


def events_dir(job_log_dir: str) -> str:
  return fs.join(job_log_dir, DIR)


class Recorder:
  """The phases of this run's wall time, from `started` (the process's start) on; a no-op
  off process 0 or without a job dir. `phase(name)` nests: leaving it resumes the outer one.

  Args:
    job_log_dir: the job whose `goodput/` gets this run's file; None = record nothing.
    started: Unix time the process started (the binary's first line); default now.
    flush_s: a window is written at least this often.
    part_bytes: on an object store, the size after which a new part file is started.
  """

  def __init__(self, job_log_dir: str | None, started: float | None = None,
               flush_s: float = 5.0, part_bytes: int = 256 << 10):
    self.active = job_log_dir is not None and jax.process_index() == 0
    now = time.time()
    self.started = min(started or now, now)
    self._stack = ["startup"]
    self._seg_start = self._win_start = self.started
    self._seconds: dict[str, float] = {}
    self._steps: list[int] | None = None
    self._lock, self._write_lock = threading.Lock(), threading.Lock()
    self._owner = threading.get_ident()
    if not self.active:
      return
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.started))
    self.run_id = f"{stamp}-{socket.gethostname()}-{os.getpid()}"
    self._base = fs.join(events_dir(job_log_dir), self.run_id)
    self._remote, self._part_bytes = fs.is_remote(job_log_dir), part_bytes
    self._part, self._part_lines, self._paths, self._unwritten = 0, [], [], ""
    self._write([{"run": self.run_id, "start": self.started, "host": socket.gethostname(),
                  "pid": os.getpid(), "processes": jax.process_count()}])
    jax.monitoring.register_scalar_listener(self._on_scalar)
    jax.monitoring.register_event_time_span_listener(self._on_span)
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._flush_every, args=(flush_s,), daemon=True,
                                    name="spmdtask-goodput")
    self._thread.start()

  # ---------------------------------------------------------------- phases

  def _close_segment(self, now: float) -> None:
    label = self._stack[-1]
    self._seconds[label] = self._seconds.get(label, 0.0) + max(0.0, now - self._seg_start)
    self._seg_start = max(self._seg_start, now)

  def push(self, name: str) -> None:
    if self.active:
      with self._lock:
        self._close_segment(time.time())
        self._stack.append(name)

  def pop(self, name: str | None = None) -> None:
    """Leaves the innermost phase (only if it is `name`, where given)."""
    if self.active:
      with self._lock:
        if len(self._stack) > 1 and name in (None, self._stack[-1]):
          self._close_segment(time.time())
          self._stack.pop()

  @contextlib.contextmanager
  def phase(self, name: str):
    self.push(name)
    try:
      yield
    finally:
      self.pop()

  def switch(self, name: str) -> None:
    """The outermost phase becomes `name` (e.g. `step` once the loop starts)."""
    if self.active:
      with self._lock:
        self._close_segment(time.time())
        self._stack[0] = name

  def _on_scalar(self, event: str, value: float, **_) -> None:
    if event in COMPILE_EVENTS and threading.get_ident() == self._owner:
      self.push("compile")

  def _on_span(self, event: str, start: float, end: float, **_) -> None:
    if event in COMPILE_EVENTS and threading.get_ident() == self._owner:
      self.pop("compile")  # never another phase: a compile begun before this recorder

  # ---------------------------------------------------------------- records

  def begin(self, step: int) -> None:
    """The loop starts after `step` (0 for a fresh start)."""
    if self.active:
      self.switch("step")
      self._record({"begin": int(step), "t": time.time()})

  def step_done(self, step: int) -> None:
    if self.active:
      with self._lock:
        self._steps = [self._steps[0] if self._steps else int(step), int(step)]

  def _record(self, line: dict) -> None:
    with self._write_lock:
      if self.active:
        self._write(self._window() + [line])

  def _window(self) -> list[dict]:
    """The window since the last one (closing the open segment at now), as lines."""
    with self._lock:
      now = time.time()
      self._close_segment(now)
      if now <= self._win_start and not self._steps:
        return []
      window = {"start": self._win_start, "end": now,
                "seconds": {k: round(v, 6) for k, v in self._seconds.items() if v > 0}}
      if self._steps:
        window["steps"] = self._steps
      self._win_start, self._seconds, self._steps = now, {}, None
    return [window]

  def flush(self) -> None:
    with self._write_lock:
      if self.active:  # checked under the lock: never a line after the run's end
        lines = self._window()
        if lines:
          self._write(lines)

  def _flush_every(self, flush_s: float) -> None:
    while not self._done.wait(flush_s):
      try:
        self.flush()
      except Exception as e:  # pylint: disable=broad-except  # the next flush writes it again
        logging.warning("Goodput events not written this time (%s: %s); trying again in "
                        "%.0f s.", type(e).__name__, e, flush_s)

  def _write(self, lines: list[dict]) -> None:
    text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
    path = f"{self._base}.{self._part}.jsonl"
    if path not in self._paths:
      self._paths.append(path)
    if not self._remote:
      self._unwritten += text  # kept until an append succeeds
      fs.makedirs(fs.dirname(path))
      fs.append_text(path, self._unwritten)
      self._unwritten = ""
      return
    self._part_lines.append(text)
    fs.write_text(path, "".join(self._part_lines))
    if sum(map(len, self._part_lines)) >= self._part_bytes:
      self._part, self._part_lines = self._part + 1, []

  def close(self, reason: str, keep: bool = True) -> None:
    """Writes the last window and how the run ended; `keep` False removes this run's file
    (a run with nothing to train). Idempotent."""
    if not self.active:
      return
    self._done.set()
    jax.monitoring.unregister_scalar_listener(self._on_scalar)
    jax.monitoring.unregister_event_time_span_listener(self._on_span)
    with self._write_lock:
      if keep:
        self._write(self._window() + [{"end": reason, "t": time.time()}])
      else:
        for path in self._paths:
          fs.rm(path)
        directory = fs.dirname(self._base)
        if not self._remote and not fs.listdir(directory):
          fs.rm(directory, recursive=True)  # empty; object stores have no directories
      self.active = False


def read(job_log_dir: str) -> list[list[dict]]:
  """Every run's lines in the job dir, runs in start order. A line cut short by a kill
  (the last of a file) is dropped; an unreadable line elsewhere raises ValueError naming it."""
  runs: dict[str, list[dict]] = {}
  for path in fs.glob(fs.join(events_dir(job_log_dir), "*.jsonl")):
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    run_id, part = name[:-len(".jsonl")].rsplit(".", 1)
    lines = fs.read_text(path).splitlines()
    got = []
    for i, text in enumerate(lines):
      try:
        got.append(json.loads(text))
      except json.JSONDecodeError:
        if i != len(lines) - 1:
          raise ValueError(f"{path}:{i + 1} is not a JSON line") from None
    runs.setdefault(run_id, []).append((int(part), got))
  out = [[line for _, got in sorted(parts) for line in got] for parts in runs.values()]
  out = [r for r in out if r and "run" in r[0]]
  return sorted(out, key=lambda r: r[0]["start"])


class LoopSteps(Hook):
  """Tells a recorder where the loop is: its start, each step completed, its end."""

  def __init__(self, record: Recorder):
    self.record = record

  def begin(self, step):
    self.record.begin(step)

  def after_step(self, step, state, last):
    self.record.step_done(step)

  def close(self):
    self.record.switch("other")


OFF = Recorder(None)  # records nothing: the default where no job dir is given
