"""The suite's fork server (tests/forkserver.py) is a correct `python`: argv, environment,
working dir, fds, exit status and signals as the real interpreter gives them."""
import os
import signal
import subprocess
import sys
import time

from tests import subproc as h

# Imports spmdtask, so it is routed; prints what a command sees.
SEES = """
import json, os, sys
import spmdtask
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "var": os.environ.get("SEEN"),
                  "path0": sys.path[0], "preloaded": "tensorflow" in sys.modules,
                  "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _python(**extra):
  python, env = h.python(1, **extra)
  if python == sys.executable:
    import pytest  # pylint: disable=g-import-not-at-top
    pytest.skip("SPMDTASK_TEST_NO_FORKSERVER=1")
  return python, env


def test_a_routed_command_gets_argv_env_cwd_fds_and_its_exit_status(tmp_path):
  # TF_USE_LEGACY_KERAS: set by the server's own TensorFlow import, as the command's would.
  python, env = _python(SEEN="yes", TF_USE_LEGACY_KERAS="1")
  r = subprocess.run([python, "-c", SEES, "3", "x y"], env=env, cwd=tmp_path, input="in",
                     capture_output=True, text=True, timeout=60, check=False)
  assert r.returncode == 3, r.stderr
  import json  # pylint: disable=g-import-not-at-top
  seen = json.loads(r.stdout)
  assert seen == {"argv": ["-c", "3", "x y"], "cwd": str(tmp_path), "var": "yes", "path0": "",
                  "preloaded": True, "stdin": "in"}
  assert r.stderr == "to stderr\n"


def test_other_commands_run_in_the_real_interpreter(tmp_path):
  """Not spmdtask's, or with a variable JAX reads at import set otherwise than the server's."""
  shows = "import sys; print(sys.executable, 'tensorflow' in sys.modules)"
  for code, extra in ((shows, {}), ("import spmdtask\n" + shows, {"JAX_ENABLE_X64": "1"})):
    python, env = _python(**extra)
    r = subprocess.run([python, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0 and r.stdout.split() == [sys.executable, "False"], r


def test_signals_reach_the_command_and_its_death_by_signal_is_the_callers(tmp_path):
  python, env = _python()
  killed = subprocess.run([python, "-c", "import os, signal, spmdtask; "
                           "os.kill(os.getpid(), signal.SIGKILL)"], env=env, timeout=60,
                          check=False)
  assert killed.returncode == -signal.SIGKILL
  handles = ("import signal, sys, time, spmdtask\n"
             "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
             "print('ready', flush=True)\n"
             "time.sleep(60)\n")
  p = subprocess.Popen([python, "-c", handles], env=env, stdout=subprocess.PIPE, text=True)
  assert p.stdout.readline() == "ready\n"
  p.send_signal(signal.SIGTERM)
  assert p.wait(timeout=30) == 7


def test_a_killed_caller_takes_the_command_and_its_children_along(tmp_path):
  python, env = _python()
  pids = tmp_path / "pids"
  tree = ("import os, subprocess, sys, time, spmdtask\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
          "time.sleep(60)\n")
  p = subprocess.Popen([python, "-c", tree], env=env)
  deadline = time.time() + 30
  while not pids.exists() or len(pids.read_text().split()) < 2:
    assert time.time() < deadline and p.poll() is None
    time.sleep(0.05)
  p.kill()
  p.wait()
  deadline = time.time() + 10
  for pid in map(int, pids.read_text().split()):
    while _alive(pid):
      assert time.time() < deadline, f"process {pid} outlived its killed caller"
      time.sleep(0.05)


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
  except FileNotFoundError:
    return False
