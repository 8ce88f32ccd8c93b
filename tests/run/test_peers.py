"""A lost peer: `peers.Watch`es of three processes on JAX's real distributed key-value service
(in one subprocess, so the watch's `os._exit` ends that process, not pytest). One that stops
beating is named by the others within LOST_S, or within SILENT_S once a collective failed;
each stops with one line naming it and the newest complete checkpoint, exit 5. A peer that
ended and marked itself done is never lost; an error while every peer beats on, or a
process's own fault, is not a lost peer."""
import re
import subprocess
import sys
import time

from spmdtask.run import peers
from tests import subproc as h

SETUP = """
import threading, time
import jax
from jax._src.lib import _jax
from tools.launch_local import free_port
from spmdtask.run import peers
address = f"127.0.0.1:{free_port()}"
service = _jax.get_distributed_runtime_service(address, 3)
clients = [_jax.get_distributed_runtime_client(address, i) for i in range(3)]
connecting = [threading.Thread(target=c.connect) for c in clients]  # connect waits for all
for t in connecting:
  t.start()
for t in connecting:
  t.join()
watches = [peers.Watch(c, i, 3, lambda: 12, "/job/checkpoints", "python -m spmdtask.main --x",
                       beat_s=0.1, silent_s=SILENT_S, lost_s=LOST_S)
           for i, c in enumerate(clients)]
for w in watches:
  w.start()
time.sleep(0.5)
watches[2].finish()     # process 2 ended normally: never lost
"""

HEARTBEAT = """
watches[1]._done.set()  # process 1 stops beating without a word, as a SIGKILLed one
print("silenced", flush=True)
time.sleep(30)
"""

COLLECTIVE = """
peers._watch = watches[0]
t0 = time.monotonic()
peers.stop_if_lost(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory"))
own = time.monotonic() - t0
peers.stop_if_lost(jax.errors.JaxRuntimeError("UNKNOWN: all-reduce failed"))  # all beat on
alive = time.monotonic() - t0 - own
print(f"returned {own:.2f} {alive:.2f}", flush=True)
watches[1]._done.set()
peers.stop_if_lost(jax.errors.JaxRuntimeError("UNKNOWN: Connection closed by peer"))
"""

END = (r"Process 0 stops here \(exit 5\); the newest complete checkpoint is step 12 in "
       r"/job/checkpoints: a rerun resumes from it\. Rerun every process with the command it "
       r"was started with \(this one: python -m spmdtask\.main --x\)\.")


def _run(script: str, silent_s: float, lost_s: float) -> tuple[subprocess.CompletedProcess, float]:
  t0 = time.time()
  code = f"SILENT_S, LOST_S = {silent_s}, {lost_s}\n" + SETUP + script
  p = subprocess.run([sys.executable, "-c", code], cwd=h.REPO, env=h.env(1),
                     capture_output=True, text=True, timeout=60)
  return p, time.time() - t0


def test_a_silent_peer_stops_the_others_with_one_line():
  p, seconds = _run(HEARTBEAT, silent_s=0.5, lost_s=1.5)
  assert p.returncode == peers.EXIT_LOST_PEER, p.stderr[-2000:]
  assert p.stdout == "silenced\n" and seconds < 20
  lines = p.stderr.splitlines()
  assert len(lines) == 1 and re.fullmatch(
      r"spmdtask: lost process 1 of 3 \(killed, crashed, or its host gone\): it has given no "
      r"sign of life for \d+ s\. " + END, lines[0]), lines


def test_a_failed_collective_asks_the_beats_and_names_the_silent_peer():
  # lost_s is long: only the failed collective's shorter wait (silent_s) can end it in time.
  p, seconds = _run(COLLECTIVE, silent_s=1.0, lost_s=40)
  assert p.returncode == peers.EXIT_LOST_PEER, p.stderr[-2000:]
  own, alive = map(float, re.fullmatch(r"returned (\S+) (\S+)\n", p.stdout).groups())
  assert own < 0.05 and alive < 1.0  # no wait for an OOM; beats moving: at once
  assert seconds < 20
  lines = p.stderr.splitlines()
  assert len(lines) == 1 and re.fullmatch(
      r"spmdtask: lost process 1 of 3 \(killed, crashed, or its host gone\): a collective or "
      r"key-value-store call failed \(JaxRuntimeError\), and it has given no sign of life for "
      r"1 s\. " + END, lines[0]), lines
