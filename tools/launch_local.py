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
Process 0's console shows here, as a single run's would; the other processes' output goes
to `process_<i>.log` in the job dir's logs/ (a temp dir for a gs:// job dir). Exits with the
first non-zero exit status of any process.

Elastic slices (`--slices=S`, S >= 2: consecutive processes form a slice, as many as
task.dcn_mesh_shape's product): when a slice is lost, the others stop (exit 5) and the job
restarts, unattended, on the slices left (`--live_slices`: the DCN axis shrinks, the global
batch stays, `spmdtask.run.elastic`), resuming from the newest checkpoint; with
`--slice_returns_after_steps=N` the lost slice comes back once the shrunk job has a
checkpoint N steps past its restart, and the job is stopped there (SIGTERM: it saves) and
restarted on every slice. `--min_slices` (default 1) and `--slice_wait_s` (default 0: go on
at once) bound it. Each (re)start prints the processes' pids (to kill one by hand).
"""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from spmdtask import fs  # pylint: disable=wrong-import-position
from spmdtask.errors import ConfigError  # pylint: disable=wrong-import-position
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


def start(num_processes: int, devices_per_process, main_args: list[str], env: dict | None,
          cluster: str, outputs: list, python: str = sys.executable) -> list[subprocess.Popen]:
  """Starts the processes (`python -m spmdtask.main ...`); process i writes stdout and stderr
  to `outputs[i]` (a pair of files; None: this terminal)."""
  env = dict(env or os.environ, JAX_PLATFORMS="cpu")
  # The caller's other XLA flags stay; only each process's device count is its own.
  flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_force_host_platform_device_count"))
  devices = [{"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip()}
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
  return [subprocess.Popen(
      [python, "-m", "spmdtask.main", *main_args, *args], cwd=ROOT,
      env={**env, **extra, **dev}, stdout=out and out[0], stderr=out and out[1], text=True)
      for (args, extra), dev, out in zip(per_process, devices, outputs)]


def _wait(procs: list[subprocess.Popen], timeout: float | None) -> None:
  """Waits for every process; kills them all if one runs past `timeout`."""
  for p in procs:
    try:
      p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise


def launch(num_processes: int, devices_per_process: int | Sequence[int], main_args: list[str],
           timeout: float | None = None, env: dict | None = None, cluster: str = "flags",
           python: str = sys.executable) -> list[subprocess.CompletedProcess]:
  """Starts the processes, waits for all, returns their results (stdout/stderr captured).
  `devices_per_process`: every process's CPU device count, or one count per process."""
  # Output goes to files, not pipes: a pipe nobody drains yet (we wait for the processes
  # one by one) fills at 64 KiB and blocks its writer, and a blocked process never reaches
  # jax.distributed's shutdown barrier, so the others abort there.
  outs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
          for _ in range(num_processes)]
  procs = start(num_processes, devices_per_process, main_args, env, cluster, outs, python)
  _wait(procs, timeout)
  results = []
  for p, (out, err) in zip(procs, outs):
    out.seek(0)
    err.seek(0)
    results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
    out.close()
    err.close()
  return results


def log_dir_of(main_args: list[str]) -> str:
  """Where processes 1.. log: the job dir's logs/ when it is local, else a temp dir."""
  job = next((a.split("=", 1)[1] for a in main_args if a.startswith("--job_log_dir=")), None)
  if job and "://" not in job:
    return os.path.join(os.path.abspath(job), "logs")
  return tempfile.mkdtemp(prefix="spmdtask-launch-")


def run_on_console(num_processes: int, devices_per_process, main_args: list[str],
                   cluster: str = "flags") -> int:
  """Process 0 on this terminal (its console, as a single run shows it); every other
  process's stdout and stderr in `<log dir>/process_<i>.log` (one line says where). Returns
  the first non-zero exit status (after the tail of that process's log), else 0."""
  run = _Console(num_processes, devices_per_process, main_args, cluster)
  procs = run.start([0])  # one slice: every process
  try:
    _wait(procs, None)
  except KeyboardInterrupt:  # the processes got the Ctrl-C too: they save, then exit
    _wait(procs, None)
  return run.ended(procs)


class _Console:
  """Starts processes (all, or those of some slices) with process 0 on this terminal and
  the others' output appended to `<log dir>/process_<i>.log`."""

  def __init__(self, num_processes, devices_per_process, main_args, cluster, slices=1):
    self.counts = device_counts(num_processes, devices_per_process)
    self.main_args, self.cluster, self.slices = main_args, cluster, slices
    self.log_dir = log_dir_of(main_args)
    os.makedirs(self.log_dir, exist_ok=True)
    self.logs: list[str] = []

  def start(self, live: list[int]) -> list[subprocess.Popen]:
    """The processes of slices `live` (every process is one slice's unless --slices), told
    `--live_slices` when fewer than all, renumbered from 0."""
    per = len(self.counts) // self.slices
    ids = [s * per + j for s in live for j in range(per)]
    args = self.main_args + ([f"--live_slices={len(live)}"] if len(live) < self.slices else [])
    self.logs = [os.path.join(self.log_dir, f"process_{i}.log") for i in range(1, len(ids))]
    files = [open(path, "a") for path in self.logs]  # pylint: disable=consider-using-with
    try:
      procs = start(len(ids), [self.counts[i] for i in ids], args, None, self.cluster,
                    [None] + [(f, f) for f in files])
    finally:
      for f in files:  # the children hold their own copies
        f.close()
    print(f"launch_local: {len(ids)} process{'es' if len(ids) > 1 else ''} (pids "
          f"{', '.join(str(p.pid) for p in procs)})"
          + (f" on {len(live)} of {self.slices} slices" if self.slices > 1 else "")
          + "; process 0 below, the others log to "
          f"{os.path.join(self.log_dir, 'process_<i>.log')}", file=sys.stderr, flush=True)
    return procs

  def ended(self, procs: list[subprocess.Popen]) -> int:
    """The first non-zero exit status (after the tail of that process's log), else 0."""
    for i, p in enumerate(procs[1:], 1):
      if p.returncode:
        with open(self.logs[i - 1]) as f:
          tail = f.read().splitlines()[-20:]
        print(f"launch_local: process {i} exited {p.returncode}; the end of "
              f"{self.logs[i - 1]}:\n" + "\n".join(tail), file=sys.stderr)
    return next((p.returncode for p in procs if p.returncode), 0)


def run_elastic(num_processes: int, devices_per_process, main_args: list[str], slices: int,
                min_slices: int = 1, wait_s: float = 0.0,
                returns_after_steps: int | None = None, cluster: str = "flags") -> int:
  """`run_on_console` for a job of `slices` slices (consecutive processes, the same count
  each) that goes on when slices are lost and grows back when they return
  (`spmdtask.run.elastic_launch.Supervisor`). Returns the job's exit status."""
  from spmdtask.run import elastic_launch  # pylint: disable=g-import-not-at-top
  per_slice = elastic_launch.check(num_processes, slices, min_slices, wait_s,
                                   returns_after_steps)
  run = _Console(num_processes, devices_per_process, main_args, cluster, slices)
  job = next((a.split("=", 1)[1] for a in main_args if a.startswith("--job_log_dir=")), None)
  if job is None:
    raise ConfigError(f"--slices={slices} restarts the job from its checkpoints: give "
                      "spmdtask.main's --job_log_dir after --, e.g. -- --exp=lm.TinyLm "
                      "--job_log_dir=/tmp/elastic.")
  directory = fs.join(job, "checkpoints")

  def say(line):
    print(line, file=sys.stderr, flush=True)

  return elastic_launch.Supervisor(slices, per_slice, run.start,
                                   lambda: elastic_launch.newest_step(directory), min_slices,
                                   wait_s, returns_after_steps, say,
                                   checkpoint_dir=directory).run()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", default="4",
                      help="CPU devices of each process, or a comma-separated count per process")
  parser.add_argument("--cluster", choices=("flags", "slurm"), default="flags")
  parser.add_argument("--slices", type=int, default=1,
                      help="Slices of the job (consecutive processes, equal counts; the "
                      "task.dcn_mesh_shape product): with 2 or more, a lost slice's job "
                      "restarts on the slices left (--live_slices) and grows back")
  parser.add_argument("--min_slices", type=int, default=1,
                      help="--slices: the fewest slices the job goes on with")
  parser.add_argument("--slice_wait_s", type=float, default=0.0,
                      help="--slices: seconds to wait for a lost slice before going on "
                      "without it")
  parser.add_argument("--slice_returns_after_steps", type=int, default=None,
                      help="--slices: a lost slice comes back once the shrunk job has a "
                      "checkpoint this many steps past its restart (default: never)")
  args, rest = parser.parse_known_args()
  rest = [a for a in rest if a != "--"]
  counts = [int(n) for n in args.devices_per_process.split(",")]
  devices = counts[0] if len(counts) == 1 else counts
  if args.slices == 1:
    sys.exit(run_on_console(args.num_processes, devices, rest, args.cluster))
  try:
    sys.exit(run_elastic(args.num_processes, devices, rest, args.slices, args.min_slices,
                         args.slice_wait_s, args.slice_returns_after_steps, args.cluster))
  except ConfigError as e:
    print(f"launch_local: config error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
