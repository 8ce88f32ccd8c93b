"""A lost peer: two `peers.Watch`es on JAX's real distributed key-value service (in one
subprocess, so the watch's `os._exit` ends that process, not pytest): when one stops beating,
the other stops within LOST_S with one line naming the lost process and the newest complete
checkpoint, exit 5; one that ended and marked itself done is not counted lost."""
import re
import subprocess
import sys
import time

from spmdtask.run import peers
from tests import subproc as h

SCRIPT = """
import threading, time
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
watches = [peers.Watch(c, i, 3, lambda: 12, "/job/checkpoints", beat_s=0.1, lost_s=1.5)
           for i, c in enumerate(clients)]
for w in watches:
  w.start()
time.sleep(0.5)
watches[2].finish()     # process 2 ended normally: never lost
watches[1]._done.set()  # process 1 stops beating without a word, as a SIGKILLed one
print("silenced", flush=True)
time.sleep(30)
"""


def test_a_silent_peer_stops_the_others_with_one_line():
  t0 = time.time()
  p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=h.REPO, env=h.env(1),
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == peers.EXIT_LOST_PEER, p.stderr[-2000:]
  assert p.stdout == "silenced\n" and time.time() - t0 < 20
  lines = p.stderr.splitlines()
  assert len(lines) == 1 and re.fullmatch(
      r"spmdtask: lost process 1 of 3: it has given no sign of life for \d+ s \(killed, "
      r"crashed, or its host gone\)\. Process 0 stops here \(exit 5\); the newest complete "
      r"checkpoint is step 12 in /job/checkpoints: restart every process with the same "
      r"command to resume from it\.", lines[0]), lines
