"""Runs `spmdtask.main` as N processes on this machine, one jax.distributed job.

Each process gets `--coordinator_address=127.0.0.1:PORT --num_processes=N --process_id=i`
and its own CPU devices, and the processes run real cross-process collectives (gloo).

`python tools/launch_local.py --num_processes=2 --devices_per_process=4 -- \
    --exp=lm.TinyLm --job_log_dir=/tmp/mh`
Exits with the first non-zero exit status of any process.
"""
import argparse
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(num_processes: int, devices_per_process: int, main_args: list[str],
           timeout: float | None = None, env: dict | None = None
           ) -> list[subprocess.CompletedProcess]:
  """Starts the processes, waits for all, returns their results (stdout/stderr captured)."""
  port = free_port()
  env = dict(env or os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
  procs = [subprocess.Popen(
      [sys.executable, "-m", "spmdtask.main", *main_args,
       f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}",
       f"--process_id={i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True) for i in range(num_processes)]
  results = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
  return results


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=4)
  args, rest = parser.parse_known_args()
  rest = [a for a in rest if a != "--"]
  results = launch(args.num_processes, args.devices_per_process, rest)
  for i, r in enumerate(results):
    sys.stderr.write(f"==== process {i} (exit {r.returncode}) ====\n{r.stderr[-4000:]}")
  sys.exit(next((r.returncode for r in results if r.returncode), 0))


if __name__ == "__main__":
  main()
