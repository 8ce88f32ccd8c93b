"""Runs `spmdtask.main` as N processes on this machine, one jax.distributed job.

Each process gets its own CPU devices, and the processes run real cross-process
collectives (gloo). How they find each other (`--cluster`):
  flags  `--coordinator_address=127.0.0.1:PORT --num_processes=N --process_id=i`;
  slurm  no flags: the environment `srun` gives each task (SLURM_JOB_ID, SLURM_NTASKS,
         SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NODELIST=127.0.0.1, ...), so spmdtask's
         default `--multihost=auto` joins through JAX's own SLURM detection, whose
         coordinator port is 61440 + SLURM_JOB_ID % 4096 (the job id is picked to hit a
         free port).

`python tools/launch_local.py --num_processes=2 --devices_per_process=4 -- \
    --exp=lm.TinyLm --job_log_dir=/tmp/mh`
`--devices_per_process=2,6` gives each process its own device count (e.g. an MPMD job
whose stages have 2 and 6 devices).
Exits with the first non-zero exit status of any process.
"""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# jax._src.clusters.slurm_cluster: port = 65535 - 2**12 + 1 + SLURM_JOB_ID % 2**12.
SLURM_PORT_BASE = 65535 - 2**12 + 1


def free_port(lo: int | None = None) -> int:
  """A free TCP port on 127.0.0.1: any, or the first free one from `lo` up."""
  for port in ([0] if lo is None else range(lo, 65536)):
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", port))
      except OSError:
        continue
      return s.getsockname()[1]
  raise RuntimeError(f"no free port from {lo}")


def slurm_env(num_processes: int, index: int, job_id: int) -> dict[str, str]:
  """What `srun --ntasks=N` on one node sets for task `index` (what JAX reads of it, and
  the usual companions)."""
  return {"SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id),
          "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(num_processes),
          "SLURM_NPROCS": str(num_processes), "SLURM_PROCID": str(index),
          "SLURM_LOCALID": str(index), "SLURM_NODEID": "0", "SLURM_NNODES": "1",
          "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": str(num_processes),
          "SLURM_NODELIST": "127.0.0.1", "SLURM_STEP_NODELIST": "127.0.0.1",
          "SLURMD_NODENAME": "127.0.0.1"}


def device_counts(num_processes: int, devices_per_process) -> list[int]:
  """Per process, its CPU device count: one int for all, or one per process."""
  counts = ([devices_per_process] * num_processes if isinstance(devices_per_process, int)
            else [int(n) for n in devices_per_process])
  if len(counts) != num_processes or min(counts) < 1:
    raise ValueError(f"devices_per_process={devices_per_process!r}: one count >= 1, or one "
                     f"per process ({num_processes})")
  return counts


def launch(num_processes: int, devices_per_process: int | Sequence[int], main_args: list[str],
           timeout: float | None = None, env: dict | None = None, cluster: str = "flags"
           ) -> list[subprocess.CompletedProcess]:
  """Starts the processes, waits for all, returns their results (stdout/stderr captured).
  `devices_per_process`: every process's CPU device count, or one count per process."""
  env = dict(env or os.environ, JAX_PLATFORMS="cpu")
  devices = [{"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
             for n in device_counts(num_processes, devices_per_process)]
  if cluster == "flags":
    port = free_port()
    per_process = [([f"--coordinator_address=127.0.0.1:{port}",
                     f"--num_processes={num_processes}", f"--process_id={i}"], {})
                   for i in range(num_processes)]
  elif cluster == "slurm":
    job_id = free_port(SLURM_PORT_BASE) - SLURM_PORT_BASE + 2**12  # -> that port
    per_process = [([], slurm_env(num_processes, i, job_id)) for i in range(num_processes)]
  else:
    raise ValueError(f"cluster={cluster!r}: flags or slurm")
  # Output goes to files, not pipes: a pipe nobody drains yet (we wait for the processes
  # one by one) fills at 64 KiB and blocks its writer, and a blocked process never reaches
  # jax.distributed's shutdown barrier, so the others abort there.
  outs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in per_process]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "spmdtask.main", *main_args, *args], cwd=ROOT,
      env={**env, **extra, **dev}, stdout=out, stderr=err, text=True)
      for (args, extra), dev, (out, err) in zip(per_process, devices, outs)]
  results = []
  for p, (out, err) in zip(procs, outs):
    try:
      p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    out.seek(0)
    err.seek(0)
    results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
    out.close()
    err.close()
  return results


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", default="4",
                      help="CPU devices of each process, or a comma-separated count per process")
  parser.add_argument("--cluster", choices=("flags", "slurm"), default="flags")
  args, rest = parser.parse_known_args()
  rest = [a for a in rest if a != "--"]
  counts = [int(n) for n in args.devices_per_process.split(",")]
  results = launch(args.num_processes, counts[0] if len(counts) == 1 else counts, rest,
                   cluster=args.cluster)
  for i, r in enumerate(results):
    sys.stderr.write(f"==== process {i} (exit {r.returncode}) ====\n{r.stderr[-4000:]}")
  sys.exit(next((r.returncode for r in results if r.returncode), 0))


if __name__ == "__main__":
  main()
