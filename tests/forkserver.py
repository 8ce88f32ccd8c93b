"""The test suite's `python`: command lines forked from one process that imported spmdtask once.

Every `python -m spmdtask.main ...` a test starts costs ~5 s of CPU in imports before its
first compile, ~10 s when it reads or writes records (TensorFlow): a third of the
subprocesses' CPU in the suite. A fork server (one per pytest worker, started on first use)
imports JAX, TensorFlow, orbax, fiddle and every spmdtask module the binary and the tools
need, initializes no backend, and forks a child per command line. The child takes the
caller's argv, environment, working dir and fds 0-2, and runs the command as `python` would
(`-m MODULE`, a script path, `-c CODE`); it starts its own session, so a kill of the caller
(SIGKILL included: the server sees the connection close) ends the whole command tree.

Routed: `-m spmdtask...`, a script under this repo, `-c` code that imports spmdtask, when the
caller's JAX_/TF_/PYTHON environment equals the server's (JAX and TF read theirs at import).
Anything else execs the real interpreter, so `python` is always a correct `python`. Inside a
routed child `sys.executable` is this `python` too: the recipe runner's stages and the
launchers' processes are forked as well.

Client: the `bin/python` that `start` writes runs this file with `-S` (stdlib only: it starts
in ~20 ms). Server: `python tests/forkserver.py --forkserver-serve SOCKET WRAPPER`.
"""
import gc
import json
import os
import re
import select
import signal
import socket
import sys

SOCKET_ENV = "SPMDTASK_TEST_FORKSERVER"  # the server's socket, in a routed caller's environment
_SERVE = "--forkserver-serve"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# In the server: every variable its imports set (spmdtask.fs: EPATH_USE_TF, read when epath
# first picks a backend): a command's environment gets them as a fresh interpreter's would.
_SET_BY_IMPORTS: dict = {}
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2)


def _import_env(env) -> dict:
  """The variables read at import time by the preloaded libraries (and Python's path)."""
  return {k: v for k, v in env.items()
          if k.startswith(("JAX_", "TF_", "PYTHON")) and k != SOCKET_ENV}


def _routed(args: list[str]) -> bool:
  if len(args) >= 2 and args[0] == "-m":
    return args[1].split(".")[0] == "spmdtask"
  if len(args) >= 2 and args[0] == "-c":
    return re.search(r"^\s*(from|import)\s.*\bspmdtask\b", args[1], re.MULTILINE) is not None
  if args and args[0].endswith(".py") and not args[0].startswith("-"):
    return os.path.abspath(args[0]).startswith(_REPO + os.sep)
  return False


def _recv_line(sock) -> dict:
  data = b""
  while not data.endswith(b"\n"):
    chunk = sock.recv(4096)
    if not chunk:
      raise EOFError
    data += chunk
  return json.loads(data)


# --- the client: `python ARGS...` ---------------------------------------------------------


def _env_differs(server: dict) -> list[str]:
  """The import-time variables whose value here would make a fresh interpreter differ from
  the server: set otherwise than the server's before its imports, unless a preload import
  set it (TF_USE_LEGACY_KERAS) and the value here is that one or none."""
  here = _import_env(os.environ)
  before, added = server["before"], server["added"]
  return [k for k in sorted(set(here) | set(before))
          if here.get(k) != before.get(k) and not (k in added and here.get(k) in (None, added[k]))]


def client(args: list[str]) -> None:
  path = os.environ.get(SOCKET_ENV)
  env_file = f"{path}.env.json"
  routed = path and _routed(args) and os.path.exists(env_file)
  differs = routed and _env_differs(json.load(open(env_file)))
  if not routed or differs:
    if differs:  # kept for whoever wonders why a command ran slowly
      with open(f"{path}.fallbacks.log", "a") as f:
        f.write(f"{differs} {args[:2]}\n")
    os.execv(sys.executable, [sys.executable, *args])
  # The handlers come first: a signal sent once the command runs (it may print before its
  # pid reaches here) is the command's, never this process's default death.
  command, early = {}, []

  def forward(signum, _):
    if "pid" not in command:
      early.append(signum)
      return
    try:
      os.kill(command["pid"], signum)
    except ProcessLookupError:
      pass
  for s in _FORWARDED:
    signal.signal(s, forward)
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  sock.connect(path)
  request = {"args": args, "env": dict(os.environ), "cwd": os.getcwd()}
  socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
  command["pid"] = _recv_line(sock)["pid"]
  for signum in early:
    forward(signum, None)
  while True:
    try:
      status = _recv_line(sock)["status"]
      break
    except InterruptedError:
      continue
  code = os.waitstatus_to_exitcode(status)
  if code < 0:  # ended by a signal: so does this process, as the command's would have
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
      signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  os._exit(code)


def start(env: dict) -> tuple[str, dict]:
  """Starts a server with `env`; its `python` and the variable that routes a caller to it."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  d = tempfile.mkdtemp(prefix="spmdtask_forkserver_")
  path, wrapper = os.path.join(d, "sock"), os.path.join(d, "bin", "python")
  os.makedirs(os.path.dirname(wrapper))
  with open(wrapper, "w") as f:
    f.write(f"#!/bin/sh\nexec '{sys.executable}' -S '{os.path.abspath(__file__)}' \"$@\"\n")
  os.chmod(wrapper, 0o755)
  log = open(os.path.join(d, "server.log"), "w")
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), _SERVE, path, wrapper],
                          env=env, cwd=_REPO, stdout=log, stderr=subprocess.STDOUT)
  deadline = time.time() + 300
  while not os.path.exists(f"{path}.env.json"):
    if proc.poll() is not None or time.time() > deadline:
      raise RuntimeError(f"the fork server did not start: {open(log.name).read()[-3000:]}")
    time.sleep(0.05)
  return wrapper, {SOCKET_ENV: path}


# --- the server ---------------------------------------------------------------------------


class _Follows:
  """sys.stdout or sys.stderr while the server imports. A module that keeps the stream it
  finds at import (absl's log handler does) writes, in a command, to whatever that stream is
  then, and compares equal to it: as if imported after the command replaced the stream
  (spmdtask.main's native_output.capture does, before its imports)."""

  def __init__(self, name: str):
    self._name = name

  def _target(self):
    now = getattr(sys, self._name)
    return getattr(sys, f"__{self._name}__") if now is self else now

  def __getattr__(self, attr):
    return getattr(self._target(), attr)

  def __eq__(self, other):
    return other is self or other is self._target()

  __hash__ = object.__hash__


def freeze_gc() -> None:
  """Python's cycle collector for a process that has done its imports: what exists now is
  frozen (never walked again, nor written to: a forked command shares those pages with the
  server) and collections run after 50,000 new container objects, not 700. JAX's tracing
  makes many short-lived objects; with the defaults the collector walked the imported
  modules over and over (perf: ~11% of a test process's CPU in gc_collect_main and its
  visitors). Measured: tests/pipeline/test_strategies.py alone, 90.4 -> 78.2 s of CPU; in
  the whole suite the in-process tests' CPU did not fall measurably, the forked commands'
  wall did. The pytest workers call it after collection, the fork server after its imports
  (its commands inherit it)."""
  gc.collect()
  gc.freeze()
  gc.set_threshold(50_000, 50, 1000)


def _preload() -> None:
  """Imports what the binary, the recipe runner and the tools import; starts no backend."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  import spmdtask.main  # pylint: disable=g-import-not-at-top,unused-import
  # `-m spmdtask.main` runs main.py again as __main__: its flags must not be defined yet.
  for flag in list(flags.FLAGS.flags_by_module_dict().get("spmdtask.main", [])):
    delattr(flags.FLAGS, flag.name)
  del sys.modules["spmdtask.main"]
  import spmdtask  # pylint: disable=g-import-not-at-top
  del spmdtask.main
  from spmdtask import registry  # pylint: disable=g-import-not-at-top
  from spmdtask.inputs import tfdata  # pylint: disable=g-import-not-at-top
  registry.names()  # the config packages
  tfdata.tensorflow()
  import spmdtask.recipe.runner  # pylint: disable=g-import-not-at-top,unused-import
  import spmdtask.hf  # pylint: disable=g-import-not-at-top,unused-import
  import orbax.checkpoint  # pylint: disable=g-import-not-at-top,unused-import
  import tokenizers  # pylint: disable=g-import-not-at-top,unused-import
  import safetensors.numpy  # pylint: disable=g-import-not-at-top,unused-import
  # What a command imports as it runs (main's modes import their modules when chosen, the
  # summary writer TensorBoard's protos, with boto3): ~0.3 s of CPU a command otherwise.
  import spmdtask.run.loop  # pylint: disable=g-import-not-at-top,unused-import
  import spmdtask.run.decoding  # pylint: disable=g-import-not-at-top,unused-import
  import spmdtask.run.evaluation  # pylint: disable=g-import-not-at-top,unused-import
  from tensorboard.plugins.scalar import summary_v2  # pylint: disable=g-import-not-at-top,unused-import
  from tensorboard.summary.writer import record_writer  # pylint: disable=g-import-not-at-top,unused-import


def _run_command(request: dict, wrapper: str) -> None:
  """In the forked child: becomes the command. Ends in SystemExit (the interpreter's exit:
  threads joined, atexit run) or an uncaught exception (traceback, exit 1), as `python`."""
  import runpy  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  os.environ.clear()
  os.environ.update(request["env"])
  for k, v in _SET_BY_IMPORTS.items():
    os.environ.setdefault(k, v)
  tempfile.tempdir = None  # TMPDIR: the caller's
  os.chdir(request["cwd"])
  sys.executable = wrapper
  sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # as a fresh interpreter's
  args = request["args"]
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
  for s in _FORWARDED:
    signal.signal(s, signal.SIG_DFL)
  signal.signal(signal.SIGINT, signal.default_int_handler)
  if args[0] == "-m":
    sys.argv = [args[1], *args[2:]]
    sys.path[0] = os.getcwd()
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
  elif args[0] == "-c":
    sys.argv = ["-c", *args[2:]]
    sys.path[0] = ""
    import __main__  # pylint: disable=g-import-not-at-top
    exec(compile(args[1], "<string>", "exec"), vars(__main__))  # pylint: disable=exec-used
  else:
    sys.argv = list(args)
    sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
    runpy.run_path(args[0], run_name="__main__")
  sys.exit(0)


def _handle(conn: socket.socket, wrapper: str) -> None:
  """In a child of the server: forks the command, reports its pid and then its wait status;
  kills its session if the caller goes away first."""
  msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
  while not msg.endswith(b"\n"):
    msg += conn.recv(1 << 20)
  request = json.loads(msg)
  pid = os.fork()
  if pid == 0:
    os.setsid()
    conn.close()
    for target, fd in enumerate(fds):
      os.dup2(fd, target)
      os.close(fd)
    _run_command(request, wrapper)
  for fd in fds:
    os.close(fd)
  conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
  pidfd = os.pidfd_open(pid)
  while True:
    ready, _, _ = select.select([conn, pidfd], [], [])
    if pidfd in ready:
      break
    if not conn.recv(1):  # the caller was killed: so is the command, with its children
      try:
        os.killpg(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      break
  _, status = os.waitpid(pid, 0)
  try:
    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
  except OSError:
    pass


def serve(path: str, wrapper: str) -> None:
  sys.path[0] = _REPO  # not tests/: a command sees the path `python` would give it
  environ = dict(os.environ)
  sys.stdout, sys.stderr = _Follows("stdout"), _Follows("stderr")
  import logging  # pylint: disable=g-import-not-at-top
  _preload()
  # absl's first log call before app.run (orbax logs at import) gives the root logger
  # logging.basicConfig's stderr handler; a command imports orbax after app.run's absl handler.
  for handler in logging.root.handlers[:]:
    logging.root.removeHandler(handler)
  # The imports set some (TF_USE_LEGACY_KERAS, EPATH_USE_TF).
  _SET_BY_IMPORTS.update({k: v for k, v in os.environ.items() if environ.get(k) != v})
  freeze_gc()
  before = _import_env(environ)
  import_env = {"before": before, "added": {k: v for k, v in _import_env(_SET_BY_IMPORTS).items()
                                            if k not in before}}
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(64)
  with open(f"{path}.env.json", "w") as f:  # written last: the server is ready
    json.dump(import_env, f)
  signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
  parent = os.getppid()
  while os.getppid() == parent:  # ends with the pytest worker that started it
    if not select.select([listener], [], [], 1.0)[0]:
      continue
    conn, _ = listener.accept()
    if os.fork() == 0:
      listener.close()
      signal.signal(signal.SIGCHLD, signal.SIG_DFL)
      _handle(conn, wrapper)
      os._exit(0)
    conn.close()


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == _SERVE:
    serve(sys.argv[2], sys.argv[3])
  else:
    client(sys.argv[1:])
