"""What a person reads: spmdtask's own lines on stdout, everything else in job_log_dir/logs.

`setup(job_log_dir, verbose)` (called by `spmdtask.main`) sends process 0's absl log,
third-party INFO lines included (orbax, jax, ...), to `job_log_dir/logs/`; stderr then
shows only WARNING and above. `say(...)` is for the few lines a run is read by (the start
summary, progress, the end): process 0 prints them on stdout and logs them too. With
`verbose` (--verbosity, --alsologtostderr or --logtostderr given) stderr gets every log
line as before and `say` only logs, so nothing is printed twice.
"""
import contextlib
import os
import sys
import tempfile

from absl import flags, logging

_echo = False  # print `say` lines on stdout (set by `setup`; library use only logs them)


def setup(job_log_dir: str, verbose: bool) -> str:
  """Process 0 logs to `job_log_dir/logs/`; returns that dir. Other processes keep stderr."""
  global _echo
  import jax  # pylint: disable=g-import-not-at-top
  log_dir = os.path.join(job_log_dir, "logs")
  if jax.process_index() != 0:
    return log_dir
  os.makedirs(log_dir, exist_ok=True)
  logging.get_absl_handler().use_absl_log_file("spmdtask", log_dir)
  if verbose:
    flags.FLAGS.alsologtostderr = True
  elif not flags.FLAGS["stderrthreshold"].present:
    flags.FLAGS.stderrthreshold = "warning"
  _echo = not verbose
  return log_dir


def verbose_flags_given() -> bool:
  """True when the user asked for the full log on stderr (absl's own logging flags)."""
  return any(flags.FLAGS[name].present
             for name in ("verbosity", "alsologtostderr", "logtostderr"))


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


def duration(seconds: float) -> str:
  """h:mm:ss (or m:ss under an hour)."""
  s = max(0, int(round(seconds)))
  h, rem = divmod(s, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


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
