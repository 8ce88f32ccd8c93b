"""What a person reads: spmdtask's own lines on the console, everything else in job_log_dir/logs.

The binary calls `start(verbose)` first thing: from then on what C/C++ libraries write to
fds 1 and 2 (TensorFlow, libtpu, XLA, tf.data, gloo) is captured (`spmdtask.native_output`),
and Python log records of WARNING and above are held back. `setup(job_log_dir, verbose)`
then sends process 0's absl log to `job_log_dir/logs/spmdtask.INFO` and the captured output
to `logs/native.log`, and decides what the console shows of the log records: spmdtask's
own warnings, JAX's warnings about the backend it picked (an accelerator present but
unused), and ERROR and above from anywhere, each as one `spmdtask: warning: ...` /
`spmdtask: <library> error: ...` line on stderr; third-party INFO and WARNING lines
(orbax, absl, TensorFlow) only go to the log. Processes other than 0 show the same lines
and log on their own host (`other_process_logs()`), never into the job dir.
`say(...)` is for the few lines a run is read by (the start summary, progress, the end):
process 0 prints them on stdout and logs them too. With `verbose` (--verbosity,
--alsologtostderr, --logtostderr or --stderrthreshold given) what was captured, and all that
follows, goes to the terminal, stderr gets every log line as absl prints it, and `say` only
logs, so nothing is printed twice.
The tools that load JAX or TensorFlow call `start_tool()` first: the same capture (dropped
at exit) and the records that matter shown at once.
"""
import atexit
import contextlib
import gc
import io
import logging as py_logging
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
import types

from absl import flags, logging

from spmdtask import fs, native_output

_echo = False  # print `say` lines on stdout (set by `setup`; library use only logs them)
_PACKAGE_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                   d) + os.sep for d in ("spmdtask", "configs", "tools",
                                                          "benchmarks"))
# Third-party warnings a person should see: JAX running on another backend than the
# hardware suggests ("A Google TPU may be present ... Falling back to cpu").
_SHOWN_LOGGERS = ("jax._src.xla_bridge",)


class _ConsoleRecords(py_logging.Handler):
  """Shows the log records that matter as spmdtask lines; holds them until `let_through`."""

  def __init__(self):
    super().__init__(py_logging.WARNING)
    self.pending: list[py_logging.LogRecord] | None = []
    self.show = False

  def emit(self, record):
    shown = (record.levelno >= py_logging.ERROR and not _library_errors_muted or _ours(record)
             or record.name in _SHOWN_LOGGERS)
    if not shown or _no_gpu_here(record):
      return
    if self.pending is not None:
      self.pending.append(record)
    elif self.show:
      _print_record(record)

  def let_through(self, show: bool) -> None:
    """From now on records are printed (`show`) or dropped; held ones go the same way."""
    pending, self.pending, self.show = self.pending or [], None, show
    if show:
      for record in pending:
        _print_record(record)


def _no_gpu_here(record: py_logging.LogRecord) -> bool:
  """JAX's CUDA plugin (the gpu_plan extra) failing to start on a machine without NVIDIA's
  driver, as it does on every run there: JAX runs on the CPU as it would without the plugin,
  and the first line names the devices. Where a driver is, the failure shows."""
  return (record.name == "jax._src.xla_bridge" and "xla_cuda" in _message(record)
          and not os.path.exists("/proc/driver/nvidia"))


def _message(record: py_logging.LogRecord) -> str:
  try:
    return record.getMessage()
  except Exception:  # pylint: disable=broad-except  # a library's bad format string
    return str(record.msg)


def _ours(record: py_logging.LogRecord) -> bool:
  return (record.pathname or "").startswith(_PACKAGE_DIRS)


def _print_record(record: py_logging.LogRecord) -> None:
  if _ours(record):
    kind = "warning" if record.levelno < py_logging.ERROR else "error"
  else:
    where = record.name.split(".")[0] if record.name not in ("absl", "root") else (
        os.path.basename(record.pathname or "?"))
    kind = (f"{where} warning" if record.levelno < py_logging.ERROR else f"{where} error")
  print(f"spmdtask: {kind}: {_message(record)}", file=sys.stderr, flush=True)


_records: _ConsoleRecords | None = None
_library_errors_muted = 0  # > 0 while a `libraries_to_log` is in force


class libraries_to_log:  # pylint: disable=invalid-name  # called like a function
  """From this call on, other libraries' ERROR records (from any thread), Python's
  "Exception ignored" reports and the tracebacks their threads report go to the log only:
  for calls whose failure spmdtask reports in its own words (orbax reading a damaged
  checkpoint: its abandoned read tasks each print a traceback with a TensorStore spec, its
  metadata reader logs the file's bytes; its reads still in flight after one failed report
  into an event loop that is closed).

  `with libraries_to_log(): ...` puts the previous hooks back after the block. Leaving the
  block by an exception in the binary (after `start`) keeps them instead: that exception
  ends the run with spmdtask's message, and the failed call's abandoned work reports later.
  Called alone, as the binary's run ends, they stay for the rest of the process.
  """

  def __init__(self):
    global _library_errors_muted
    _library_errors_muted += 1
    self._hooks = sys.unraisablehook, sys.excepthook, threading.excepthook
    sys.unraisablehook, sys.excepthook = _log_unraisable, _log_exception
    threading.excepthook = _log_thread_exception
    if _records is not None:
      py_logging.raiseExceptions = False  # nor a report that finds the log already closed

  def __enter__(self) -> "libraries_to_log":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    global _library_errors_muted
    if exc_type is not None:
      gc.collect()  # the failed call's abandoned tasks report now, into the log
      if _records is not None:
        return
    sys.unraisablehook, sys.excepthook, threading.excepthook = self._hooks
    _library_errors_muted -= 1


def _log_exception(exc_type, value, tb) -> None:
  _log_traceback("Exception reported by a library", exc_type, value, tb)


def _log_thread_exception(args) -> None:
  _log_traceback(f"Exception in thread {args.thread.name if args.thread else '?'}",
                 args.exc_type, args.exc_value, args.exc_traceback)


def _log_unraisable(report) -> None:
  _log_traceback(f"{report.err_msg or 'Exception ignored in'} {report.object!r}",
                 report.exc_type, report.exc_value, report.exc_traceback)


def _log_traceback(what: str, exc_type, value, tb) -> None:
  if sys.is_finalizing():  # the log is closed by now
    return
  trace = "".join(traceback.format_exception(exc_type, value, tb))
  logging.info("%s:\n%s", what, trace)


def start(verbose: bool) -> None:
  """The binary's first step: captures fds 1 and 2; holds log records until `setup`."""
  global _records
  if _records is not None:
    return
  if verbose:  # the binary captured from its first line: what came so far, and the rest, shown
    native_output.to_terminal(keep=True)
    return
  native_output.capture()
  # absl's lines until `setup` names the log file go with the captured fd 2 (the binary
  # captured before absl made its handler, which then took the terminal's copy).
  logging.get_absl_handler().python_handler.stream = sys.__stderr__
  _records = _ConsoleRecords()
  py_logging.getLogger().addHandler(_records)


def start_tool() -> None:
  """A tool's first step, before it imports JAX or TensorFlow: what C/C++ libraries print
  is captured and dropped at exit (a fatal line still shows), and of the log records the
  ones that matter (see the module's doc) show at once as `spmdtask: ...` lines."""
  start(verbose=False)
  _records.let_through(show=True)


def setup(job_log_dir: str, verbose: bool) -> str:
  """Process 0 logs to `job_log_dir/logs/`; returns that dir. The other processes log on
  their own host (`other_process_logs`) and show the same spmdtask lines as process 0:
  only process 0 writes into the job dir, and a pod's console is not every host's INFO log."""
  global _echo
  import jax  # pylint: disable=g-import-not-at-top
  log_dir = fs.join(job_log_dir, "logs")
  if jax.process_index() != 0:
    if _records is None:  # verbose: everything on the terminal, as absl prints it
      native_output.to_terminal()
      return log_dir
    local = other_process_logs()
    os.makedirs(local, exist_ok=True)
    name = f"spmdtask.process{jax.process_index()}"
    logging.get_absl_handler().use_absl_log_file(name, local)
    native_output.log_to(os.path.join(local, f"{name}.{os.getpid()}.native.log"))
    _records.let_through(show=True)
    return log_dir
  if fs.is_remote(log_dir):
    _log_to_object(log_dir)
    # A bucket cannot take the capture process's appends: native output (fatal lines still
    # reach the terminal) is dropped rather than left in a local file that outlives the VM.
    native_output.log_to(os.devnull)
  else:
    fs.makedirs(log_dir)
    logging.get_absl_handler().use_absl_log_file("spmdtask", log_dir)
    native_output.log_to(os.path.join(log_dir, "native.log"))
  if verbose:
    flags.FLAGS.alsologtostderr = True
  elif _records is not None:
    _records.let_through(show=True)
  _echo = not verbose
  return log_dir


def other_process_logs() -> str:
  """Where processes other than 0 log: a dir on their own host's local disk."""
  return os.path.join(tempfile.gettempdir(), "spmdtask_logs")


def _log_to_object(log_dir: str) -> None:
  """absl's log in memory, written to `log_dir` (gs://) at exit: nothing on the local disk
  (GCS cannot append, and a local file would outlive a killed VM's job anyway)."""
  buffer = io.StringIO()
  logging.get_absl_handler().python_handler.stream = buffer
  path = fs.join(log_dir, f"spmdtask.{time.strftime('%Y%m%d-%H%M%S')}.{socket.gethostname()}"
                 f".{os.getpid()}.log")
  atexit.register(lambda: (logging.flush(), fs.write_text(path, buffer.getvalue())))


def show_held_records() -> None:
  """Prints the records held back so far (an error ends the run before `setup`)."""
  if _records is not None and _records.pending:
    _records.let_through(show=True)


def verbose_flags_given() -> bool:
  """True when the user asked for the full log on stderr (absl's own logging flags)."""
  return any(flags.FLAGS[name].present
             for name in ("verbosity", "alsologtostderr", "logtostderr", "stderrthreshold"))


def say(fmt: str, *args) -> None:
  """One line for the reader: logged (INFO) and, on process 0 after `setup`, printed."""
  logging.info(fmt, *args)
  if _echo:
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_index() == 0:
      print(fmt % args if args else fmt, file=sys.stdout, flush=True)


def human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"


def human_count(n: float) -> str:
  for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
    if abs(n) >= div:
      return f"{n / div:.2f}{unit}"
  return f"{n:.0f}"


def params(n: int, active: int | None = None) -> str:
  """'46.70B params (12.88B active per token)': a model's params, and those a token uses
  where fewer (a mixture of experts')."""
  return f"{human_count(n)} params" + (f" ({human_count(active)} active per token)"
                                       if active else "")


def count(n: float, noun: str) -> str:
  """`n noun`, the noun in the plural unless n is 1: "1 batch", "7 batches", "2 devices"."""
  if n == 1:
    return f"{n:.0f} {noun}"
  return f"{n:.0f} {noun}{'es' if noun.endswith(('s', 'x', 'ch', 'sh')) else 's'}"


def human_seconds(seconds: float) -> str:
  """A short time with 3 significant digits in a readable unit: "2.54 s", "12.3 ms"."""
  for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
    if abs(seconds) >= scale or unit == "µs":
      value = seconds / scale
      return f"{value:.3g} {unit}" if abs(value) < 1000 else f"{value:.0f} {unit}"
  return f"{seconds} s"


def duration(seconds: float) -> str:
  """h:mm:ss (or m:ss under an hour)."""
  s = max(0, int(round(seconds)))
  h, rem = divmod(s, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@contextlib.contextmanager
def elapsed(what: str, every: float = 10.0):
  """Says `what ... N s` every `every` seconds until the block ends, after its first minute
  once a minute, so that a long wait (a compile for a pod slice: minutes) shows it is alive
  in a few lines; the seconds it took go to `.seconds` of the value it yields."""
  done, t0 = threading.Event(), time.monotonic()
  took = types.SimpleNamespace(seconds=0.0)

  def tick():
    while not done.wait(every if time.monotonic() - t0 < 60 else max(every, 60.0)):
      say("%s ... %s", what, duration(time.monotonic() - t0))

  thread = threading.Thread(target=tick, name="spmdtask-elapsed", daemon=True)
  thread.start()
  try:
    yield took
  finally:
    done.set()
    thread.join()
    took.seconds = time.monotonic() - t0


@contextlib.contextmanager
def captured_fd2(into: list[str]):
  """Captures what C++ (XLA, libtpu) writes to file descriptor 2 meanwhile; appends it to
  `into` (the caller logs it to job_log_dir/logs or parses it)."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      into.append(tmp.read().decode(errors="replace"))


def init_backends() -> str:
  """Initializes JAX's backends; returns what they printed (for the log, not the console).

  With libtpu installed on a machine without a TPU, JAX tries the TPU backend first and
  libtpu prints warnings (worker hostnames, accelerator type) before JAX falls back to
  the CPU. Should initialization fail, what was printed goes to stderr after all.
  """
  import jax  # pylint: disable=g-import-not-at-top
  out: list[str] = []
  try:
    with captured_fd2(out):
      jax.devices()
  except Exception:
    sys.stderr.write("".join(out))
    raise
  return "".join(out)


class Progress:
  """A long loop's progress for a tool's console: `update(line)` prints `LABEL: line()` (a
  function, so nothing is formatted between lines) once `every_s` seconds have passed since
  the start or the last line, as one periodic line with the time so far:
  'prepare_chat_data: 120000 records read, 119500 kept (0:10)'. A loop shorter than
  `every_s` prints nothing."""

  def __init__(self, label: str, every_s: float = 5.0, clock=time.monotonic):
    self.label, self.every_s, self._clock = label, every_s, clock
    self._start = self._last = clock()
    self.lines = 0

  def update(self, line) -> None:
    now = self._clock()
    if now - self._last >= self.every_s:
      self._last = now
      self.lines += 1
      print(f"{self.label}: {line()} ({duration(now - self._start)})", flush=True)

  def next_phase(self, line: str) -> None:
    """Prints `line` (what the run does next) where progress lines were printed: a long
    run says what it does between them; a short one stays quiet."""
    if self.lines:
      print(f"{self.label}: {line} ({duration(self._clock() - self._start)})", flush=True)
