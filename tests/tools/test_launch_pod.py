"""tools/launch_pod.py: the exact commands for a v5e-256 pod, a 2-slice job and a SLURM job;
arguments survive two levels of shell quoting; mistakes exit 2; against a fake `gcloud` on
PATH: create, wait until ACTIVE (or time out), start detached, status, logs, stop."""
import json
import os
import shlex
import stat

import pytest

from tools import launch_pod

EXP = ["--exp=lm.TextLm", "--fdl_set=datasets['train'].data_dir='gs://my-bucket/data'",
       "--fdl_set=task.train.num_train_steps=1000"]


def _printed(capsys, argv) -> list[str]:
  assert launch_pod.main(argv) == 0
  return capsys.readouterr().out.splitlines()


def _remote(printed_line: str) -> list[str]:
  """The argv a worker runs: the local shell's words, then the remote shell's (what
  `nohup setsid` starts, up to its output redirection)."""
  local = shlex.split(printed_line)
  command = next(w for w in local if w.startswith("--command="))[len("--command="):]
  words = shlex.split(command.split(" && ")[-1])
  return words[words.index("setsid") + 1:words.index(">")]


def test_v5e_256_pod(capsys):
  out = _printed(capsys, ["tpu", "--name=my-pod", "--zone=us-west4-a", "--create",
                          "--accelerator_type=v5litepod-256",
                          "--job_log_dir=gs://my-bucket/jobs/run1", "--", *EXP])
  tar = launch_pod.os.path.join(launch_pod.tempfile.gettempdir(), "spmdtask.tar.gz")
  ssh = "gcloud compute tpus tpu-vm ssh my-pod --zone=us-west4-a --worker=all "
  titles = [l for l in out if l.startswith("# ") and not l.startswith("# (polls)")]
  assert titles == [
      "# 1. Request the TPU VMs (a queued resource; several slices get MEGASCALE_* for JAX)",
      "# 2. Wait until it is ACTIVE (every 30 s, at most 7200 s)",
      "# 3. Pack this checkout (committed files)", "# 4. Put it next to the job",
      "# 5. Install Python 3.11 (a uv venv) and spmdtask with the tpu extra on every worker",
      "# 6. Start the job detached on every worker (its output: ~/spmdtask-logs/my-pod.log "
      "there)"]
  assert out[1] == ("gcloud compute tpus queued-resources create my-pod --zone=us-west4-a "
                    "--accelerator-type=v5litepod-256 --runtime-version=v2-alpha-tpuv5-lite "
                    "--node-id=my-pod")
  assert out[3] == ("# (polls) gcloud compute tpus queued-resources describe my-pod "
                    "--zone=us-west4-a '--format=value(state.state)'")
  assert out[5] == f"git -C {launch_pod.ROOT} archive --format=tar.gz --output={tar} HEAD"
  assert out[7] == f"gcloud storage cp {tar} gs://my-bucket/jobs/run1/code/spmdtask.tar.gz"
  assert out[9] == ssh + shlex.quote(
      "--command=gcloud storage cp gs://my-bucket/jobs/run1/code/spmdtask.tar.gz "
      "/tmp/spmdtask.tar.gz && rm -rf ~/spmdtask && mkdir -p ~/spmdtask && "
      "tar -xzf /tmp/spmdtask.tar.gz -C ~/spmdtask && "
      "python3 -m pip install --quiet --user uv && rm -rf ~/spmdtask-venv && "
      "python3 -m uv venv --quiet --python 3.11 ~/spmdtask-venv && "
      "python3 -m uv pip install --quiet --python ~/spmdtask-venv/bin/python "
      "\"$HOME/spmdtask[tpu]\"")
  assert out[11] == ssh + shlex.quote(
      "--command=mkdir -p ~/spmdtask-logs && cd ~/spmdtask && (nohup setsid "
      "~/spmdtask-venv/bin/python -m spmdtask.main --exp=lm.TextLm "
      "'--fdl_set=datasets['\"'\"'train'\"'\"'].data_dir='\"'\"'gs://my-bucket/data'\"'\"'' "
      "--fdl_set=task.train.num_train_steps=1000 --job_log_dir=gs://my-bucket/jobs/run1 "
      "> ~/spmdtask-logs/my-pod.log 2>&1 < /dev/null & echo $! > ~/spmdtask-logs/my-pod.pid)")
  # Every worker gets exactly the arguments given after `--`.
  assert _remote(out[11]) == ["~/spmdtask-venv/bin/python", "-m", "spmdtask.main", *EXP,
                              "--job_log_dir=gs://my-bucket/jobs/run1"]


def test_two_slices_and_own_python(capsys):
  out = _printed(capsys, ["tpu", "--name=my-slices", "--zone=us-east5-b", "--project=my-proj",
                          "--accelerator_type=v5litepod-256", "--num_slices=2",
                          "--dcn_mesh_shape=2,1,1", "--create", "--python=python3.11",
                          "--job_log_dir=gs://my-bucket/jobs/run2", "--", "--exp=lm.TinyLm"])
  where = "--zone=us-east5-b --project=my-proj"
  assert out[0].startswith("# 1. Request the TPU VMs (a queued resource")
  assert out[1] == (f"gcloud compute tpus queued-resources create my-slices {where} "
                    "--accelerator-type=v5litepod-256 --runtime-version=v2-alpha-tpuv5-lite "
                    "--node-count=2 --node-prefix=my-slices")
  ssh = f"gcloud compute tpus queued-resources ssh my-slices {where} --node=all --worker=all "
  assert out[9].startswith(ssh + "'--command=gcloud storage cp ")
  assert out[9].endswith("python3.11 -m pip install --quiet \"$HOME/spmdtask[tpu]\"'")
  assert _remote(out[11]) == ["python3.11", "-m", "spmdtask.main", "--exp=lm.TinyLm",
                              "--job_log_dir=gs://my-bucket/jobs/run2",
                              "--fdl_set=task.dcn_mesh_shape=(2,1,1)"]


FAKE_GCLOUD = """#!/usr/bin/env python3
import json, os, sys
d = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(d, "calls.jsonl"), "a") as f:
  f.write(json.dumps(sys.argv[1:]) + "\\n")
if "describe" in sys.argv:
  with open(os.path.join(d, "states")) as f:
    states = f.read().split()
  print(states[0])
  if len(states) > 1:  # the last state stays
    with open(os.path.join(d, "states"), "w") as f:
      f.write(" ".join(states[1:]))
elif "ssh" in sys.argv:
  print("t1v-worker-0: canned ssh output")
"""


@pytest.fixture
def gcloud(tmp_path, monkeypatch):
  """A fake `gcloud` first on PATH: records each call's argv; `describe` prints the next
  of the states written to `states` (the last one repeats)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  fake = bin_dir / "gcloud"
  fake.write_text(FAKE_GCLOUD)
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  # The launcher's own clock: each poll's sleep advances it. Not `time.sleep` itself: another
  # thread of this worker sleeping would advance it too (a "waited 41:20" seen in CI).
  now = [0.0]
  monkeypatch.setattr(launch_pod, "_monotonic", lambda: now[0])
  monkeypatch.setattr(launch_pod, "_sleep", lambda s: now.__setitem__(0, now[0] + s))

  def calls(states=None):
    if states is not None:
      (bin_dir / "states").write_text(" ".join(states))
    path = bin_dir / "calls.jsonl"
    done = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    if path.exists():
      path.unlink()
    return done
  return calls


POD = ["--name=my-pod", "--zone=us-west4-a"]


def test_launch_waits_until_active_then_starts_detached_and_is_controlled(gcloud, capfd):
  gcloud(["WAITING_FOR_RESOURCES", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"])
  assert launch_pod.main(["tpu", *POD, "--create", "--run", "--poll_s=30",
                          "--job_log_dir=gs://b/run1", "--", "--exp=lm.TinyLm"]) == 0
  calls = gcloud()
  describe = ["compute", "tpus", "queued-resources", "describe", "my-pod", "--zone=us-west4-a",
              "--format=value(state.state)"]
  assert calls[0][:5] == ["compute", "tpus", "queued-resources", "create", "my-pod"]
  assert calls[1:5] == [describe] * 4 and len(calls) == 8
  assert calls[5][:2] == ["storage", "cp"]
  install, start = calls[6], calls[7]
  assert install[:5] == start[:5] == ["compute", "tpus", "tpu-vm", "ssh", "my-pod"]
  assert "--worker=all" in start and "python3 -m uv venv --quiet --python 3.11" in install[-1]
  assert start[-1].startswith("--command=mkdir -p ~/spmdtask-logs && cd ~/spmdtask && "
                              "(nohup setsid ~/spmdtask-venv/bin/python -m spmdtask.main ")
  assert start[-1].endswith("< /dev/null & echo $! > ~/spmdtask-logs/my-pod.pid)")
  err = capfd.readouterr().err
  assert [l for l in err.splitlines() if "queued resource my-pod:" in l] == [
      "launch_pod: queued resource my-pod: WAITING_FOR_RESOURCES (waited 0:00)",
      "launch_pod: queued resource my-pod: PROVISIONING (waited 1:00)",
      "launch_pod: queued resource my-pod: ACTIVE (waited 1:30)"]

  assert launch_pod.main(["status", *POD]) == 0
  calls = gcloud()
  assert calls[0] == describe and calls[1][:5] == ["compute", "tpus", "tpu-vm", "ssh", "my-pod"]
  assert "kill -0 \"$(cat ~/spmdtask-logs/my-pod.pid" in calls[1][-1]
  assert capfd.readouterr().out.splitlines() == ["ACTIVE", "t1v-worker-0: canned ssh output"]
  assert launch_pod.main(["logs", *POD, "--worker=3", "--lines=20"]) == 0
  assert gcloud() == [["compute", "tpus", "tpu-vm", "ssh", "my-pod", "--zone=us-west4-a",
                       "--worker=3", "--command=tail -n 20 ~/spmdtask-logs/my-pod.log"]]
  assert launch_pod.main(["stop", *POD, "--delete"]) == 0
  stop, delete = gcloud()
  assert "--worker=all" in stop and "kill -TERM \"$(cat ~/spmdtask-logs/my-pod.pid" in stop[-1]
  assert delete == ["compute", "tpus", "queued-resources", "delete", "my-pod",
                    "--zone=us-west4-a", "--force", "--quiet"]

  gcloud(["WAITING_FOR_RESOURCES"])  # never granted: a timeout, nothing started
  assert launch_pod.main(["tpu", *POD, "--create", "--run", "--poll_s=30",
                          "--wait_timeout_s=60", "--job_log_dir=gs://b/run1", "--",
                          "--exp=lm.TinyLm"]) == 1
  assert [c[3] for c in gcloud()] == ["create", "describe", "describe", "describe"]
  assert "still WAITING_FOR_RESOURCES after 1:00 (--wait_timeout_s=60)" in capfd.readouterr().err
  gcloud(["PROVISIONING", "FAILED"])
  assert launch_pod.main(["tpu", *POD, "--create", "--run", "--poll_s=0",
                          "--job_log_dir=gs://b/run1", "--", "--exp=lm.TinyLm"]) == 1
  assert [c[3] for c in gcloud()] == ["create", "describe", "describe"]
  assert "queued resource my-pod is FAILED" in capfd.readouterr().err


def test_slurm_script(capfd):
  out = _printed(capfd, ["slurm", "--nodes=4", "--gpus_per_node=8", "--partition=a100",
                          "--workdir=/shared/spmdtask", "--job_log_dir=/shared/jobs/run3", "--",
                          *EXP])
  assert out[:9] == ["#!/bin/bash", "#SBATCH --job-name=spmdtask", "#SBATCH --nodes=4",
                     "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                     "#SBATCH --cpus-per-task=8", "#SBATCH --time=24:00:00",
                     "#SBATCH --output=spmdtask-%j.out", "#SBATCH --partition=a100"]
  assert out[-2:] == [
      "cd /shared/spmdtask",
      "srun python -m spmdtask.main --exp=lm.TextLm "
      "'--fdl_set=datasets['\"'\"'train'\"'\"'].data_dir='\"'\"'gs://my-bucket/data'\"'\"'' "
      "--fdl_set=task.train.num_train_steps=1000 --job_log_dir=/shared/jobs/run3"]
  assert shlex.split(out[-1])[4:] == [*EXP, "--job_log_dir=/shared/jobs/run3"]


@pytest.mark.parametrize("argv,message", [
    (["tpu", "--name=p", "--zone=z", "--job_log_dir=/home/me/run", "--", "--exp=lm.TinyLm"],
     "--job_log_dir='/home/me/run' is not in a bucket"),
    (["tpu", "--name=p", "--zone=z", "--num_slices=2", "--job_log_dir=gs://b/r", "--",
      "--exp=lm.TinyLm"], "--num_slices=2 needs --dcn_mesh_shape"),
    (["tpu", "--name=p", "--zone=z", "--num_slices=2", "--dcn_mesh_shape=4,1,1",
      "--job_log_dir=gs://b/r", "--", "--exp=lm.TinyLm"], "multiplies to 4, not --num_slices=2"),
    (["tpu", "--name=p", "--zone=z", "--job_log_dir=gs://b/r", "--"], "Name the experiment"),
    (["slurm", "--nodes=2", "--job_log_dir=/tmp/run", "--", "--exp=lm.TinyLm"], "node-local"),
])
def test_mistakes_exit_2_with_one_paragraph(capfd, argv, message):
  assert launch_pod.main(argv) == 2
  captured = capfd.readouterr()
  assert message in captured.err and captured.out == "" and "Traceback" not in captured.err
