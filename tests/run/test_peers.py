"""A lost peer: `peers.Watch`es of three processes on JAX's real distributed key-value service
(in one subprocess, so the watch's `os._exit` ends that process, not pytest). One that stops
beating is named by the others within LOST_S, or within SILENT_S once a collective failed;
each stops with one line naming it and the newest complete checkpoint, exit 5. A peer that
ended and marked itself done is never lost; an error while every peer beats on, or a
process's own fault, is not a lost peer."""
import os
import re
import subprocess
import sys
import time

import pytest

from spmdtask.run import checkpoints, peers
from tests import subproc as h
from tools import launch_local

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
  p = h.run([sys.executable, "-c", code], 1, timeout=60)
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
      r"key-value-store call failed \(UNKNOWN\), and it has given no sign of life for 1 s\. "
      + END, lines[0]), lines


def test_a_lost_peer_is_recognised_by_its_runtime_status_not_its_type():
  import jax  # pylint: disable=g-import-not-at-top
  gloo = ValueError("UNKNOWN: Gloo AllGather failed: Connection reset by peer")  # a used output
  try:
    try:
      raise jax.errors.JaxRuntimeError("UNAVAILABLE: Failed to send RPC")
    except jax.errors.JaxRuntimeError as e:
      raise RuntimeError("orbax: the barrier failed") from e
  except RuntimeError as e:
    wrapped = e
  assert [peers.peer_status(e) for e in (gloo, wrapped)] == ["UNKNOWN", "UNAVAILABLE"]
  for own in (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory"),
              ValueError("INVALID_ARGUMENT: bad shape"), ValueError("x: not a status"),
              KeyError("UNKNOWN")):
    assert peers.peer_status(own) is None, own


def test_a_peer_process_ended_on_this_machine_is_lost_at_once():
  # Its beat names its pid and this machine: once that process has ended (here a real one,
  # reaped), it is lost without waiting for its beat to go still; on another machine, or
  # alive, or done, it is not.
  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()
  w = peers.Watch(None, 0, 4, lambda: None, "/job/checkpoints")
  assert w.here  # Linux: /proc tells the boot and the pid namespace
  beats = {0: f"3 {os.getpid()} {w.here}", 1: f"3 {os.getpid()} {w.here}",
           2: peers._DONE, 3: f"3 {gone.pid} other-machine/pid:[1]"}
  assert w._ended_here(beats) is None
  beats[3] = f"3 {gone.pid} {w.here}"
  assert w._ended_here(beats) == 3


# End to end: a 2-process TinyLm job (tools/launch_local.py, gloo, one CPU device each: every
# collective crosses the processes), process 1 SIGKILLed at three moments, each found from
# the job's own output. One job dir: each rerun checks that the previous line's checkpoint
# resumes, then is the next kill's run.
E2E = ("task.model.num_layers=2", "task.train.log_interval_steps=1",
       "task.train.save_interval_steps=2", "task.train.summary_interval_steps=1000",
       "datasets['train'].batch_size=32")


def lost_line(lost: int = 1, of: int = 2, me: int = 0) -> re.Pattern:
  """Process `me`'s one line when process `lost` of `of` is gone (the step, the dir): found
  by its own failed call, or (3+ processes) named by a survivor that found it first."""
  return re.compile(
      rf"spmdtask: lost process {lost} of {of} \(killed, crashed, or its host gone\): (?:a "
      r"collective or key-value-store call failed \([A-Z_]+\)(?:, and it has given no sign of "
      r"life for \d+ s|; another process saw it go|, and its process on this host has ended)|"
      rf"another process saw it go|its process on this host has ended)\. Process {me} "
      r"stops here \(exit 5\); the newest complete checkpoint "
      r"is step (?P<step>\d+) in (?P<dir>\S+): a rerun resumes from it\. Rerun every process with the "
      rf"command it was started with \(this one: python -m spmdtask\.main .*--process_id={me}\)\.")


LINE = lost_line()


class _Job:
  """A launch of the job on `n` processes (one CPU device each) whose output is read as it
  comes."""

  def __init__(self, launched: list, job: str, tag: str, *overrides: str, n: int = 2):
    self.job = job
    self.paths = [f"{job}.{tag}.{i}.{s}" for i in range(n) for s in ("out", "err")]
    self.files = [open(p, "w+") for p in self.paths]  # pylint: disable=consider-using-with
    args = h.main_cmd("lm.TinyLm", job, *E2E, *overrides)[3:]
    python, env = h.python(1)
    self.procs = launch_local.start(n, 1, args, env, "flags",
                                    [self.files[i:i + 2] for i in range(0, 2 * n, 2)], python)
    launched.extend(self.procs)

  def out(self, i: int = 0, stream: int = 0) -> str:
    with open(self.paths[2 * i + stream]) as f:
      return f.read()

  def wait_for(self, ready, timeout: float = 120) -> float:
    """Polls until `ready()`; returns the time it became true."""
    t0 = time.time()
    while not ready():
      assert time.time() - t0 < timeout and self.procs[0].poll() is None, self.out(0, 1)[-3000:]
      time.sleep(0.01)
    return time.time()

  def kill_1_and_wait(self) -> tuple[float, str]:
    """SIGKILLs process 1; (seconds until process 0 exited, its stderr)."""
    t0 = time.time()
    self.procs[1].kill()
    self.procs[0].wait(timeout=90)
    for f in self.files:
      f.close()
    return time.time() - t0, self.out(0, 1)

  def check_lost_line(self) -> int:
    """Process 1 killed: process 0 ended with exit 5, the one line and no traceback; returns
    the checkpoint step the line names (the newest complete one on disk)."""
    seconds, err = self.kill_1_and_wait()
    assert self.procs[0].returncode == peers.EXIT_LOST_PEER, err[-3000:]
    assert seconds < 60
    assert "Traceback" not in err + self.out(0, 0)
    line = LINE.fullmatch(err.strip())
    assert line, err[-3000:]
    step = int(line["step"])
    assert step == max(checkpoints.complete_steps(line["dir"]))
    logs = open(os.path.join(self.job, "logs", "spmdtask.INFO")).read()
    # A failed call's traceback goes to the log; the watch may name the loss first (process
    # 1's process gone from this machine), with no failure to log.
    assert ("The failure that showed the loss:\nTraceback" in logs
            or "a collective or key-value-store call failed" not in line[0]), logs[-3000:]
    return step


def _resumed(job: _Job, step: int) -> None:
  job.wait_for(lambda: f"Resuming from the checkpoint at step {step};" in job.out())


@pytest.fixture
def launched():
  """The processes a test started; whatever still runs at its end is killed."""
  procs = []
  yield procs
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


@pytest.mark.slow
def test_process_1_killed_mid_step_between_steps_and_in_a_save_stops_process_0_in_one_line(
    tmp_path, launched):
  job = str(tmp_path / "job")
  ckpt = checkpoints.checkpoint_dir(job)
  # During a checkpoint save: step 4's save has begun (orbax's temporary dir is there).
  run = _Job(launched, job, "save")
  run.wait_for(lambda: os.path.isdir(ckpt) and any(
      n.startswith("4.orbax-checkpoint-tmp") for n in os.listdir(ckpt)))
  saved = run.check_lost_line()
  assert saved == 2  # step 4's save never completes: its line names step 2
  # Between steps: process 0 has just printed an odd step's metrics (no save follows).
  run = _Job(launched, job, "between")
  _resumed(run, saved)
  run.wait_for(lambda: f"step {saved + 3}/" in run.out())
  saved = run.check_lost_line()
  # Mid-step: half a step after an odd step's line (no save follows it); the step time is
  # the even step's, whose line comes before that step's save.
  run = _Job(launched, job, "mid")
  _resumed(run, saved)
  line = re.compile(r"step (\d+)/\d+ +loss \S+ +(\S+) s/step")
  run.wait_for(lambda: f"step {saved + 3}/" in run.out())
  step_s = {int(n): float(t) for n, t in line.findall(run.out())}[saved + 2]
  time.sleep(step_s / 2)
  saved = run.check_lost_line()
  # The rerun resumes from the newest checkpoint the line named.
  run = _Job(launched, job, "resume")
  _resumed(run, saved)


@pytest.mark.slow
def test_one_of_four_processes_killed_stops_the_other_three_in_one_line_each(tmp_path, launched):
  # Process 2 of 4 SIGKILLed between steps: every survivor's next collective fails, each asks
  # the beats, names process 2 and exits 5 with its own line; no traceback on any console.
  run = _Job(launched, str(tmp_path / "job"), "four", n=4)
  run.wait_for(lambda: "step 3/" in run.out())
  t0 = time.time()
  run.procs[2].kill()
  for i in (0, 1, 3):
    run.procs[i].wait(timeout=90)
  seconds = time.time() - t0
  for f in run.files:
    f.close()
  steps = set()
  for i in (0, 1, 3):
    err = run.out(i, 1)
    assert run.procs[i].returncode == peers.EXIT_LOST_PEER, (i, err[-3000:])
    assert "Traceback" not in err + run.out(i, 0), (i, err[-3000:])
    line = lost_line(lost=2, of=4, me=i).fullmatch(err.strip())
    assert line, (i, err[-3000:])
    steps.add(int(line["step"]))
  print(f"the 3 survivors exited {seconds:.1f} s after the kill")  # pytest -rP shows it
  assert seconds < 60, seconds
  assert steps == {max(checkpoints.complete_steps(checkpoints.checkpoint_dir(run.job)))}
