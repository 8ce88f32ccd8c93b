"""One training per job dir: the lock on local disk (flock; a SIGKILLed holder taken over) and
on GCS (a leased object written with generation preconditions, against the emulator); and two
`spmdtask.main` trainings on one job dir, the second started 1 s after the first took the lock."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from google.api_core import exceptions
import pytest

from spmdtask.errors import ConfigError
from spmdtask.run import joblock
from tests import gcs_emulator
from tests import subproc as h


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


HOLD = """
import os, sys, time
from spmdtask.run import joblock
joblock.LocalLock(os.path.join(sys.argv[1], "job.lock")).acquire(joblock._record(None))
print("holding", flush=True)
time.sleep(600)
"""


def test_local_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
  job = str(tmp_path / "job")
  with joblock.held(job) as took_over:
    assert took_over is None
    with open(os.path.join(job, "job.lock")) as f:
      record = json.load(f)
    assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
    assert abs(record["started"] - time.time()) < 60
    with pytest.raises(ConfigError) as refused:  # a second holder: its own open file
      with joblock.held(job):
        pass
    text = str(refused.value)
    assert f"process {os.getpid()} on {socket.gethostname()} (started " in text
    assert f"--job_log_dir={job!r} is in use" in text and "another --job_log_dir" in text
  assert not os.path.exists(os.path.join(job, "job.lock"))  # released
  # A holder SIGKILLed while holding the lock is taken over at once, with one line.
  holder = subprocess.Popen([sys.executable, "-c", HOLD, job], cwd=h.REPO,
                            stdout=subprocess.PIPE, env=h.env(1))
  assert holder.stdout.readline() == b"holding\n"
  holder.send_signal(signal.SIGKILL)
  holder.wait()
  with pytest.raises(RuntimeError, match="boom"):
    with joblock.held(job) as took_over:
      assert took_over.startswith(f"Took over the job lock of process {holder.pid} on "
                                  f"{socket.gethostname()} (started ")
      assert took_over.endswith("that job ended without releasing it (killed, or its "
                                "machine lost).")
      raise RuntimeError("boom")
  assert not os.path.exists(os.path.join(job, "job.lock"))  # released on an error too


@pytest.fixture(scope="module")
def bucket():
  with gcs_emulator.Emulator("bucket") as emu:
    yield emu


def test_gcs_lock_generation_preconditions(bucket, monkeypatch):
  for k, v in bucket.env().items():
    monkeypatch.setenv(k, v)
  url = "gs://bucket/job/job.lock"
  first = joblock.GcsLock(url, lease_s=30)
  assert first.acquire(joblock._record(30)) is None
  with pytest.raises(joblock.Held) as held:  # the create precondition fails: named holder
    joblock.GcsLock(url).acquire(joblock._record(30))
  assert held.value.holder["pid"] == os.getpid() and held.value.holder["lease_until"] > time.time()
  # An expired lease of another host is replaced, conditioned on the generation read.
  blob = first.blob.bucket.blob("job/job.lock")
  blob.upload_from_string(json.dumps({"host": "lost-vm", "pid": 7, "started": 1.0,
                                      "lease_until": time.time() - 1}))
  second = joblock.GcsLock(url, lease_s=0.8)
  assert second.acquire(joblock._record(0.8))["host"] == "lost-vm"
  with pytest.raises(exceptions.PreconditionFailed):  # the old holder can no longer refresh
    first._write(first.record, if_generation_match=first.generation)
  first.release()  # deletes only its own generation: the new holder's object stays
  assert blob.exists()
  # The live holder refreshes its lease from a thread; a live lease of another host is kept.
  gen = second.generation
  second.start_refreshing()
  time.sleep(0.6)
  assert second.generation != gen and second.record["lease_until"] > time.time() + 0.3
  blob.reload()
  assert blob.generation == second.generation
  second.release()
  assert not blob.exists()
  # A holder on this host whose process ended is taken over before its lease ends.
  blob.upload_from_string(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(),
                                      "started": 1.0, "lease_until": time.time() + 600}))
  third = joblock.GcsLock(url)
  assert third.acquire(joblock._record(60))["lease_until"] > time.time()
  third.release()


TINY = ("task.train.num_train_steps=8", "task.train.save_interval_steps=4",
        "task.train.summary_interval_steps=1", "task.train.log_interval_steps=4",
        "task.model.num_layers=1")


def _events_per_step(job: str) -> dict[int, int]:
  from tensorboard.backend.event_processing import event_file_loader
  counts = {}
  train = os.path.join(job, "summaries", "train")
  for name in os.listdir(train):
    for e in event_file_loader.EventFileLoader(os.path.join(train, name)).Load():
      if any(v.tag == "loss" for v in e.summary.value):
        counts[e.step] = counts.get(e.step, 0) + 1
  return counts


def _wait_for_holder(job: str, proc: subprocess.Popen, timeout: float) -> None:
  """Until `proc` holds the job dir's lock (its record names it): on a loaded machine a
  process started 1 s later can reach the lock first, and then A is the one refused."""
  path, deadline = os.path.join(job, "job.lock"), time.time() + timeout
  while time.time() < deadline:
    assert proc.poll() is None, "A ended before it took the job lock"
    try:
      with open(path) as f:
        if json.load(f).get("pid") == proc.pid:
          return
    except (OSError, ValueError):  # not created yet, or its record half written
      pass
    time.sleep(0.1)
  raise AssertionError(f"A did not take the job lock within {timeout} s")


@pytest.mark.slow
def test_two_trainings_on_one_job_dir(tmp_path):
  """B, started 1 s after A holds the lock of A's job dir, exits 2 naming A within 30 s; A trains to the
  end, and every summary step and checkpoint is A's, written once."""
  job = str(tmp_path / "job")
  cmd = h.main_cmd("lm.TinyLm", job, *TINY)
  out = open(tmp_path / "a.out", "w+")
  a = subprocess.Popen(cmd, cwd=h.REPO, stdout=out, stderr=subprocess.STDOUT, env=h.env(1))
  _wait_for_holder(job, a, timeout=120)
  time.sleep(1)
  t0 = time.time()
  b = h.run(cmd, num_devices=1, timeout=120)
  b_seconds = time.time() - t0
  assert a.poll() is None, "A ended before B was refused"
  assert b.returncode == 2 and b_seconds < 30, (b_seconds, b.stderr[-2000:])
  assert f"is in use: process {a.pid} on {socket.gethostname()} (started " in b.stderr
  assert "Traceback" not in b.stderr and b.stdout == ""
  assert a.wait(timeout=240) == 0
  out.seek(0)
  assert "Done at step 8" in out.read()
  assert _events_per_step(job) == {s: 1 for s in range(1, 9)}
  assert sorted(os.listdir(os.path.join(job, "checkpoints"))) == ["4", "8"]
  logs = os.listdir(os.path.join(job, "logs"))  # one absl log file: A's
  assert len([n for n in logs if ".log.INFO." in n]) == 1, logs
  assert not os.path.exists(os.path.join(job, "job.lock"))
