"""tools/launch_pod.py: the exact commands for a v5e-256 pod, a 2-slice job and a SLURM job;
arguments survive two levels of shell quoting; mistakes exit 2."""
import shlex

import pytest

from tools import launch_pod

EXP = ["--exp=lm.TextLm", "--fdl_set=datasets['train'].data_dir='gs://my-bucket/data'",
       "--fdl_set=task.train.num_train_steps=1000"]


def _printed(capsys, argv) -> list[str]:
  assert launch_pod.main(argv) == 0
  return capsys.readouterr().out.splitlines()


def _remote(printed_line: str) -> list[str]:
  """The argv a worker runs: the local shell's words, then the remote shell's."""
  local = shlex.split(printed_line)
  command = next(w for w in local if w.startswith("--command="))[len("--command="):]
  return shlex.split(command.split(" && ")[-1])


def test_v5e_256_pod(capsys):
  out = _printed(capsys, ["tpu", "--name=my-pod", "--zone=us-west4-a", "--create",
                          "--accelerator_type=v5litepod-256",
                          "--job_log_dir=gs://my-bucket/jobs/run1", "--", *EXP])
  tar = launch_pod.os.path.join(launch_pod.tempfile.gettempdir(), "spmdtask.tar.gz")
  ssh = "gcloud compute tpus tpu-vm ssh my-pod --zone=us-west4-a --worker=all "
  assert out[0::2] == ["# 1. Create the TPU VMs", "# 2. Pack this checkout (committed files)",
                       "# 3. Put it next to the job",
                       "# 4. Install spmdtask with the tpu extra on every worker",
                       "# 5. Run the same command on every worker"]
  assert out[1] == ("gcloud compute tpus tpu-vm create my-pod --zone=us-west4-a "
                    "--accelerator-type=v5litepod-256 --version=v2-alpha-tpuv5-lite")
  assert out[3] == f"git -C {launch_pod.ROOT} archive --format=tar.gz --output={tar} HEAD"
  assert out[5] == f"gcloud storage cp {tar} gs://my-bucket/jobs/run1/code/spmdtask.tar.gz"
  assert out[7] == ssh + shlex.quote(
      "--command=gcloud storage cp gs://my-bucket/jobs/run1/code/spmdtask.tar.gz "
      "/tmp/spmdtask.tar.gz && rm -rf ~/spmdtask && mkdir -p ~/spmdtask && "
      "tar -xzf /tmp/spmdtask.tar.gz -C ~/spmdtask && "
      "python3 -m pip install --quiet \"$HOME/spmdtask[tpu]\"")
  assert out[9] == ssh + shlex.quote(
      "--command=cd ~/spmdtask && python3 -m spmdtask.main --exp=lm.TextLm "
      "'--fdl_set=datasets['\"'\"'train'\"'\"'].data_dir='\"'\"'gs://my-bucket/data'\"'\"'' "
      "--fdl_set=task.train.num_train_steps=1000 --job_log_dir=gs://my-bucket/jobs/run1")
  # Every worker gets exactly the arguments given after `--`.
  assert _remote(out[9]) == ["python3", "-m", "spmdtask.main", *EXP,
                             "--job_log_dir=gs://my-bucket/jobs/run1"]


def test_two_slices(capsys):
  out = _printed(capsys, ["tpu", "--name=my-slices", "--zone=us-east5-b", "--project=my-proj",
                          "--accelerator_type=v5litepod-256", "--num_slices=2",
                          "--dcn_mesh_shape=2,1,1", "--create",
                          "--job_log_dir=gs://my-bucket/jobs/run2", "--", "--exp=lm.TinyLm"])
  where = "--zone=us-east5-b --project=my-proj"
  assert out[0] == "# 1. Request the slices (queued resources; the VMs get MEGASCALE_* for JAX)"
  assert out[1] == (f"gcloud compute tpus queued-resources create my-slices {where} "
                    "--accelerator-type=v5litepod-256 --runtime-version=v2-alpha-tpuv5-lite "
                    "--node-count=2 --node-prefix=my-slices")
  ssh = f"gcloud compute tpus queued-resources ssh my-slices {where} --node=all --worker=all "
  assert out[7].startswith(ssh + "'--command=gcloud storage cp ")
  assert out[9] == ssh + shlex.quote(
      "--command=cd ~/spmdtask && python3 -m spmdtask.main --exp=lm.TinyLm "
      "--job_log_dir=gs://my-bucket/jobs/run2 '--fdl_set=task.dcn_mesh_shape=(2,1,1)'")
  assert _remote(out[9])[3:] == ["--exp=lm.TinyLm", "--job_log_dir=gs://my-bucket/jobs/run2",
                                 "--fdl_set=task.dcn_mesh_shape=(2,1,1)"]


def test_slurm_script(capsys):
  out = _printed(capsys, ["slurm", "--nodes=4", "--gpus_per_node=8", "--partition=a100",
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
def test_mistakes_exit_2_with_one_paragraph(capsys, argv, message):
  assert launch_pod.main(argv) == 2
  captured = capsys.readouterr()
  assert message in captured.err and captured.out == "" and "Traceback" not in captured.err
