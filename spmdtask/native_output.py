"""What C/C++ libraries write to fds 1 and 2 goes to a log file, not the console.

TensorFlow (oneDNN notice, "All log messages before absl::InitializeLog()"), libtpu
(accelerator-type probes on a machine without a TPU), XLA and tf.data ("Optimization loop
failed") print to fd 2 from C++ whatever Python's log levels say, some of it while being
imported; gloo prints its connections to fd 1. `capture()` points fds 1 and 2 at a pipe
drained by a small filter process and gives Python's `sys.stdout` and `sys.stderr` copies
of the original fds, so Python's own lines (spmdtask's, errors) still reach the terminal.
The filter writes everything to a temporary file until `log_to(path)` (appending what came
so far) or `to_terminal()`; from the first line that looks fatal (a C++ CHECK failure, a
FATAL log line, "Fatal Python error", a signal report) it also copies everything to the
terminal's stderr, so a crash is never silent. The binary and the tools call `capture()`
before they import JAX or TensorFlow: their C++ libraries print as they load. The filter is
a separate process because a crash of this one would lose what a thread had not read yet;
it ignores SIGINT (Ctrl-C reaches the whole process group) and ends when the pipe closes.
"""
import atexit
import os
import subprocess
import sys
import tempfile

_CONTROL = b"\x00spmdtask-native-output:"

# The filter process: stdin is the pipe, stdout the terminal's stderr, argv[1] a temp file.
_FILTER = r"""
import os, re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
CONTROL = %r
FATAL = re.compile(rb"^F\d{4} |Check failed|Fatal Python error|terminate called|"
                   rb"Segmentation fault|\*\*\* SIG|core dumped")
temp = sys.argv[1]
sink, forward = open(temp, "ab"), False
for line in sys.stdin.buffer:
  if line.startswith(CONTROL):
    target = line[len(CONTROL):].rstrip(b"\n").decode()
    sink.close()
    if target in ("-", "+"):  # everything from now on to the terminal ("+": so far too)
      if target == "+":
        with open(temp, "rb") as src:
          sys.stdout.buffer.write(src.read())
        sys.stdout.buffer.flush()
      sink, forward = open(os.devnull, "ab"), True
    else:
      with open(temp, "rb") as src, open(target, "ab") as dst:
        dst.write(src.read())
      sink = open(target, "ab")
    os.remove(temp)
    temp = None
    continue
  sink.write(line)
  sink.flush()
  forward = forward or bool(FATAL.search(line))
  if forward:
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()
sink.close()
if temp:
  os.remove(temp)
""" % (_CONTROL,)

_active = False
_filter: subprocess.Popen | None = None  # referenced, so never collected while it runs


def capture() -> None:
  """From now on fds 1 and 2 go through the filter; `sys.stdout`/`sys.stderr` stay put.

  Call once, early (before TensorFlow, JAX's backends or libtpu load), in the binary only.
  """
  global _active, _filter
  if _active:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  terminal_out, terminal = os.dup(1), os.dup(2)
  fd, temp = tempfile.mkstemp(prefix="spmdtask-native-", suffix=".log")
  os.close(fd)
  read_end, write_end = os.pipe()
  # pylint: disable-next=consider-using-with  # lives as long as this process
  _filter = subprocess.Popen([sys.executable, "-S", "-c", _FILTER, temp], stdin=read_end,
                             stdout=terminal, stderr=subprocess.DEVNULL, close_fds=True)
  os.close(read_end)
  os.dup2(write_end, 1)
  os.dup2(write_end, 2)
  os.close(write_end)
  # Python's own output (tracebacks, spmdtask's lines) keeps the terminal.
  sys.stdout = os.fdopen(terminal_out, "w", buffering=1, encoding=sys.stdout.encoding)
  sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.stderr.encoding,
                         errors="backslashreplace")
  _active = True
  atexit.register(_finish)  # registered first, so it runs after every later exit handler


def _finish() -> None:
  """At exit: closes the pipe and waits for the filter, so that when this process is gone
  so is the filter's temp file, and what it forwards has reached the terminal."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  os.dup2(devnull, 2)
  os.close(devnull)
  try:
    _filter.wait(timeout=10)  # a child process still holding the pipe keeps it open
  except subprocess.TimeoutExpired:
    pass


def log_to(path: str) -> None:
  """Appends what was captured so far to `path` (a local file) and sends the rest there."""
  _control(path)


def to_terminal(keep: bool = False) -> None:
  """Drops what was captured so far (`keep`: prints it); what comes goes to the terminal."""
  _control("+" if keep else "-")


def _control(target: str) -> None:
  if _active:
    os.write(2, _CONTROL + target.encode() + b"\n")
