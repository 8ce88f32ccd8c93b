"""Prints, and with --run executes, the commands that run spmdtask on a cluster.

Cloud TPU (one slice, or several over DCN), through queued resources:
  python tools/launch_pod.py tpu --name=my-pod --zone=us-west4-a \
      --accelerator_type=v5litepod-256 --job_log_dir=gs://my-bucket/jobs/run1 \
      [--num_slices=2 --dcn_mesh_shape=2,1,1] [--create] [--run] -- \
      --exp=lm.TextLm --fdl_set="datasets['train'].data_dir='gs://my-bucket/data'"
  Steps: (request the TPU VMs as a queued resource and poll it until ACTIVE,) pack this
  checkout (`git archive HEAD`) into the job dir's bucket, install it with the `tpu` extra
  on every worker into a uv venv of Python 3.11 (the runtime images' python3 is 3.10;
  --python=PATH uses one of yours), then start the same `python -m spmdtask.main ...`
  detached on every worker (nohup setsid; output in ~/spmdtask-logs/NAME.log there). Each
  worker's spmdtask joins the job through JAX's own Cloud TPU detection
  (--multihost=auto); several slices find each other through the MEGASCALE_* values that
  queued resources give every VM, and `task.dcn_mesh_shape` lays the mesh over them.
  Then, with the same --name/--zone (and --num_slices):
    status   the queued resource's state; on every worker: running or not, the last lines
    logs     a worker's output (--worker, --lines, --follow)
    stop     SIGTERM to the job on every worker (it saves a checkpoint and exits);
             --delete also deletes the queued resource and its VMs

SLURM (GPU clusters): an sbatch script, one task per GPU (JAX's SLURM detection gives each
task the GPU numbered by its SLURM_LOCALID):
  python tools/launch_pod.py slurm --nodes=4 --gpus_per_node=8 \
      --job_log_dir=/shared/jobs/run1 [--run] -- --exp=lm.TextLm ...
  --run writes the script next to nothing of yours (a temp file) and submits it with sbatch.

Everything after `--` is passed to spmdtask.main unchanged, shell-quoted (shlex).
Exit 2 with one paragraph for a mistake (e.g. a TPU job dir that is not gs://).
"""
import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from spmdtask import console  # pylint: disable=wrong-import-position

DEFAULT_RUNTIME = {"v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
                   "v6e": "v2-alpha-tpuv6e", "v4": "tpu-ubuntu2204-base"}
# The runtime images above are Ubuntu 22.04, whose python3 is 3.10; spmdtask needs 3.11+.
# Without --python every worker gets a venv of Python 3.11 made by uv (installed with pip;
# uv fetches a standalone CPython when the image has none).
PYTHON_VERSION = "3.11"
VENV = "~/spmdtask-venv"
LOG_DIR = "~/spmdtask-logs"  # on every worker: NAME.log (the job's output), NAME.pid
READY, GONE = "ACTIVE", ("FAILED", "SUSPENDING", "SUSPENDED", "DELETING")


class UsageError(Exception):
  """A launcher mistake: one paragraph, exit 2."""


class LaunchFailed(Exception):
  """A step could not complete (e.g. the slices were never granted): one line, exit 1."""


def _main_args(job_log_dir: str, passthrough: list[str], extra_sets: list[str]) -> list[str]:
  if any(a.startswith("--job_log_dir") for a in passthrough):
    raise UsageError("Give the job dir once, as the launcher's --job_log_dir (it checks it and "
                     "passes it on), not after `--`.")
  if not any(a.startswith("--exp=") or a == "--exp" for a in passthrough):
    raise UsageError("Name the experiment after `--`, e.g. `-- --exp=lm.TinyLm`.")
  return ["-m", "spmdtask.main", *passthrough, f"--job_log_dir={job_log_dir}",
          *[f"--fdl_set={s}" for s in extra_sets]]


def _where(args) -> list[str]:
  return [f"--zone={args.zone}"] + ([f"--project={args.project}"] if args.project else [])


def _ssh(args, worker: str = "all") -> list[str]:
  """The gcloud command prefix that runs a command on `worker` of every slice ("all") or of
  the first slice (a worker number)."""
  if args.num_slices > 1 and worker == "all":
    return ["gcloud", "compute", "tpus", "queued-resources", "ssh", args.name, *_where(args),
            "--node=all", "--worker=all"]
  node = f"{args.name}-0" if args.num_slices > 1 else args.name  # --node-prefix's names
  return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", node, *_where(args), f"--worker={worker}"]


def _describe(args) -> list[str]:
  return ["gcloud", "compute", "tpus", "queued-resources", "describe", args.name,
          *_where(args), "--format=value(state.state)"]


def _files(args) -> tuple[str, str]:
  """(log, pid file) of the job on each worker."""
  return f"{LOG_DIR}/{args.name}.log", f"{LOG_DIR}/{args.name}.pid"


# The poll loop's clock, a seam of this module's own: a test replaces these two names, never
# the `time` module every thread of its process shares.
_monotonic, _sleep = time.monotonic, time.sleep


def wait_active(args) -> None:
  """Polls the queued resource until it is ACTIVE: a line at each new state (and every ten
  polls); LaunchFailed when it fails or `--wait_timeout_s` passes."""
  start, state, polls = _monotonic(), None, 0
  while True:
    done = subprocess.run(_describe(args), capture_output=True, text=True, check=False)
    new = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "UNKNOWN"
    waited = _monotonic() - start
    if new != state or polls % 10 == 0:
      print(f"launch_pod: queued resource {args.name}: {new} (waited "
            f"{console.duration(waited)})", file=sys.stderr, flush=True)
    state, polls = new, polls + 1
    if state == READY:
      return
    if state in GONE:
      raise LaunchFailed(f"queued resource {args.name} is {state}; see `{shlex.join(_describe(args)[:-1])}`.")
    if waited + args.poll_s > args.wait_timeout_s:
      raise LaunchFailed(
          f"queued resource {args.name} is still {state} after {console.duration(waited)} "
          f"(--wait_timeout_s={args.wait_timeout_s:g}). The request stays queued: run the "
          "launcher again without --create once it is ACTIVE (`launch_pod.py status`), or "
          f"delete it (`launch_pod.py stop --delete`).")
    _sleep(args.poll_s)


def tpu_steps(args, passthrough: list[str]) -> list[tuple[str, list[str]]]:
  """The (title, argv) steps of a Cloud TPU job; argv None for the wait until ACTIVE."""
  if not args.job_log_dir.startswith("gs://"):
    raise UsageError(
        f"--job_log_dir={args.job_log_dir!r} is not in a bucket. On a Cloud TPU pod every "
        "worker writes its part of each checkpoint and worker 0 the summaries and logs, so a "
        "local path scatters the job over the workers' disks, which are deleted with the "
        "VMs (and with them the job, at preemption). Give a gs://BUCKET/PATH the TPU VMs' "
        "service account can write, e.g. --job_log_dir=gs://my-bucket/jobs/run1.")
  extra_sets = []
  if args.num_slices > 1:
    if not args.dcn_mesh_shape:
      raise UsageError(
          f"--num_slices={args.num_slices} needs --dcn_mesh_shape: one entry per mesh axis "
          "of the experiment's task.mesh_axis_names, multiplying to the number of slices, "
          f"e.g. --dcn_mesh_shape={args.num_slices},1,1 for data parallelism across slices "
          "(it becomes --fdl_set=task.dcn_mesh_shape=(...)).")
    shape = tuple(int(d) for d in args.dcn_mesh_shape.split(","))
    product = 1
    for d in shape:
      product *= d
    if product != args.num_slices:
      raise UsageError(f"--dcn_mesh_shape={args.dcn_mesh_shape} multiplies to {product}, not "
                       f"--num_slices={args.num_slices}; the slices are the DCN mesh.")
    extra_sets.append(f"task.dcn_mesh_shape={shape!r}".replace(" ", ""))
  for a in passthrough:
    value = a.split("=", 2)[-1].strip("'\"")
    if ("data_dir=" in a or "file_pattern=" in a) and not value.startswith("gs://"):
      print(f"launch_pod: warning: {a} is not in a bucket; it must then exist on every "
            "worker's disk.", file=sys.stderr)
  main_args = _main_args(args.job_log_dir, passthrough, extra_sets)
  runtime = args.runtime_version or DEFAULT_RUNTIME.get(args.accelerator_type.rsplit("-", 1)[0])
  if args.create and not runtime:
    raise UsageError(f"No default runtime for --accelerator_type={args.accelerator_type}; "
                     "pass --runtime_version (see `gcloud compute tpus versions list`).")
  job = args.job_log_dir.rstrip("/")
  tarball = f"{job}/code/spmdtask.tar.gz"
  steps = []
  if args.create:
    nodes = ([f"--node-count={args.num_slices}", f"--node-prefix={args.name}"]
             if args.num_slices > 1 else [f"--node-id={args.name}"])
    steps.append(("Request the TPU VMs (a queued resource; several slices get MEGASCALE_* "
                  "for JAX)",
                  ["gcloud", "compute", "tpus", "queued-resources", "create", args.name,
                   *_where(args), f"--accelerator-type={args.accelerator_type}",
                   f"--runtime-version={runtime}", *nodes]))
    steps.append((f"Wait until it is {READY} (every {args.poll_s:g} s, at most "
                  f"{args.wait_timeout_s:g} s)", None))
  local_tar = os.path.join(tempfile.gettempdir(), "spmdtask.tar.gz")
  steps.append(("Pack this checkout (committed files)",
                ["git", "-C", ROOT, "archive", "--format=tar.gz", f"--output={local_tar}",
                 "HEAD"]))
  steps.append(("Put it next to the job", ["gcloud", "storage", "cp", local_tar, tarball]))
  unpack = (f"gcloud storage cp {shlex.quote(tarball)} /tmp/spmdtask.tar.gz && "
            "rm -rf ~/spmdtask && mkdir -p ~/spmdtask && "
            "tar -xzf /tmp/spmdtask.tar.gz -C ~/spmdtask && ")
  if args.python:
    py = args.python
    install = f"{py} -m pip install --quiet \"$HOME/spmdtask[tpu]\""
    title = f"Install spmdtask with the tpu extra on every worker ({py})"
  else:
    py = f"{VENV}/bin/python"
    install = (f"python3 -m pip install --quiet --user uv && rm -rf {VENV} && "
               f"python3 -m uv venv --quiet --python {PYTHON_VERSION} {VENV} && "
               f"python3 -m uv pip install --quiet --python {py} \"$HOME/spmdtask[tpu]\"")
    title = (f"Install Python {PYTHON_VERSION} (a uv venv) and spmdtask with the tpu extra on "
             "every worker")
  steps.append((title, [*_ssh(args), f"--command={unpack}{install}"]))
  log, pid = _files(args)
  # `py` unquoted: ~ expands on the worker. Detached (setsid, no terminal, nohup): the job
  # outlives this ssh session; its pid (nohup and setsid exec it) is kept for `stop`.
  start = (f"mkdir -p {LOG_DIR} && cd ~/spmdtask && (nohup setsid {py} "
           f"{shlex.join(main_args)} > {log} 2>&1 < /dev/null & echo $! > {pid})")
  steps.append((f"Start the job detached on every worker (its output: {log} there)",
                [*_ssh(args), f"--command={start}"]))
  return steps


def control_steps(args) -> list[tuple[str, list[str]]]:
  """The steps of `status`, `logs` and `stop` for a job started by `tpu`."""
  log, pid = _files(args)
  if args.action == "status":
    check = (f"if kill -0 \"$(cat {pid} 2>/dev/null)\" 2>/dev/null; then echo \"$(hostname): "
             f"running (pid $(cat {pid}))\"; else echo \"$(hostname): not running\"; fi; "
             f"tail -n {args.lines} {log} 2>/dev/null")
    return [("The queued resource", _describe(args)),
            ("The job on every worker", [*_ssh(args), f"--command={check}"])]
  if args.action == "logs":
    tail = f"tail -n {args.lines}{' -f' * args.follow} {log}"
    return [(f"The job's output on worker {args.worker}",
             [*_ssh(args, str(args.worker)), f"--command={tail}"])]
  stop = (f"if kill -TERM \"$(cat {pid} 2>/dev/null)\" 2>/dev/null; then echo \"$(hostname): "
          "sent SIGTERM (the job saves a checkpoint, then exits)\"; else echo \"$(hostname): "
          "not running\"; fi")
  steps = [("Stop the job on every worker (SIGTERM: save, then exit)",
            [*_ssh(args), f"--command={stop}"])]
  if args.delete:
    steps.append(("Delete the TPU VMs (the queued resource)",
                  ["gcloud", "compute", "tpus", "queued-resources", "delete", args.name,
                   *_where(args), "--force", "--quiet"]))
  return steps


def slurm_script(args, passthrough: list[str]) -> str:
  """An sbatch script: one task per GPU, every task running the same spmdtask command."""
  if args.job_log_dir.startswith("/tmp"):
    raise UsageError(f"--job_log_dir={args.job_log_dir!r} is node-local; every task writes "
                     "its part of each checkpoint there. Use a filesystem all nodes share "
                     "(or gs://).")
  directives = [f"--job-name={args.job_name}", f"--nodes={args.nodes}",
                f"--ntasks-per-node={args.gpus_per_node}",
                f"--gpus-per-node={args.gpus_per_node}",
                f"--cpus-per-task={args.cpus_per_task}", f"--time={args.time}",
                f"--output={args.job_name}-%j.out"]
  if args.partition:
    directives.append(f"--partition={args.partition}")
  lines = ["#!/bin/bash", *[f"#SBATCH {d}" for d in directives],
           "# One task per GPU: JAX's SLURM detection (spmdtask's default --multihost=auto)",
           "# reads SLURM_JOB_ID/NTASKS/PROCID/LOCALID/STEP_NODELIST in every task and gives",
           "# task i of a node the GPU numbered SLURM_LOCALID.",
           f"cd {shlex.quote(args.workdir)}",
           "srun " + shlex.join([args.python, *_main_args(args.job_log_dir, passthrough, [])])]
  return "\n".join(lines) + "\n"


def _tpu_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument("--name", required=True, help="the queued resource (and TPU VM) name")
  p.add_argument("--zone", required=True)
  p.add_argument("--project", default=None)
  p.add_argument("--num_slices", type=int, default=1)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="where", required=True)
  tpu = sub.add_parser("tpu", help="a Cloud TPU pod or several slices")
  _tpu_flags(tpu)
  tpu.add_argument("--accelerator_type", default="v5litepod-256")
  tpu.add_argument("--runtime_version", default=None, help="default: by accelerator type")
  tpu.add_argument("--dcn_mesh_shape", default=None, help="e.g. 2,1,1 (with --num_slices)")
  tpu.add_argument("--create", action="store_true",
                   help="also request the TPU VMs and wait until they are ACTIVE")
  tpu.add_argument("--poll_s", type=float, default=30.0, help="--create: seconds between polls")
  tpu.add_argument("--wait_timeout_s", type=float, default=7200.0,
                   help="--create: give up waiting for ACTIVE after this long")
  tpu.add_argument("--python", default=None, help="the workers' Python 3.11+ (default: a "
                   f"uv venv of Python {PYTHON_VERSION}, made at install)")
  for action, text in (("status", "the queued resource's state and the job on every worker"),
                       ("logs", "the end of the job's output on one worker"),
                       ("stop", "SIGTERM to the job on every worker: it saves and exits")):
    p = sub.add_parser(action, help=text)
    _tpu_flags(p)
    p.set_defaults(action=action)
    if action in ("status", "logs"):
      p.add_argument("--lines", type=int, default=3 if action == "status" else 50)
    if action == "logs":
      p.add_argument("--worker", type=int, default=0)
      p.add_argument("--follow", action="store_true")
    if action == "stop":
      p.add_argument("--delete", action="store_true", help="also delete the TPU VMs")
  slurm = sub.add_parser("slurm", help="an sbatch script for a GPU cluster")
  slurm.add_argument("--nodes", type=int, required=True)
  slurm.add_argument("--gpus_per_node", type=int, default=8)
  slurm.add_argument("--cpus_per_task", type=int, default=8)
  slurm.add_argument("--time", default="24:00:00")
  slurm.add_argument("--partition", default=None)
  slurm.add_argument("--job_name", default="spmdtask")
  slurm.add_argument("--workdir", default=ROOT, help="the checkout on the shared filesystem")
  slurm.add_argument("--python", default="python")
  for p in (tpu, slurm):
    p.add_argument("--job_log_dir", required=True)
    p.add_argument("--run", action="store_true", help="execute instead of only printing")
  return parser


def _execute(args, steps) -> None:
  for title, cmd in steps:
    print(f"launch_pod: {title}", file=sys.stderr, flush=True)
    if cmd is None:
      wait_active(args)
    else:
      subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  split = argv.index("--") if "--" in argv else len(argv)
  args = _parser().parse_args(argv[:split])
  passthrough = argv[split + 1:]
  try:
    if args.where in ("status", "logs", "stop"):
      _execute(args, control_steps(args))  # they act at once: nothing to print first
      return 0
    if args.where == "tpu":
      steps = tpu_steps(args, passthrough)
      for i, (title, cmd) in enumerate(steps, 1):
        print(f"# {i}. {title}" + (f"\n{shlex.join(cmd)}" if cmd else
                                    f"\n# (polls) {shlex.join(_describe(args))}"))
      if args.run:
        _execute(args, steps)
      return 0
    script = slurm_script(args, passthrough)
    print(script, end="")
    if args.run:
      with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as f:
        f.write(script)
      subprocess.run(["sbatch", f.name], check=True)
    return 0
  except UsageError as e:
    print(f"launch_pod: {e}", file=sys.stderr)
    return 2
  except LaunchFailed as e:
    print(f"launch_pod: {e}", file=sys.stderr)
    return 1
  except subprocess.CalledProcessError as e:
    print(f"launch_pod: `{shlex.join(e.cmd)}` failed (exit {e.returncode}); the steps before "
          "it are done.", file=sys.stderr)
    return e.returncode


if __name__ == "__main__":
  sys.exit(main())
