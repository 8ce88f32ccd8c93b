"""Prints, and with --run executes, the commands that run spmdtask on a cluster.

Cloud TPU (one slice, or several over DCN through queued resources):
  python tools/launch_pod.py tpu --name=my-pod --zone=us-west4-a \
      --accelerator_type=v5litepod-256 --job_log_dir=gs://my-bucket/jobs/run1 \
      [--num_slices=2 --dcn_mesh_shape=2,1,1] [--create] [--run] -- \
      --exp=lm.TextLm --fdl_set="datasets['train'].data_dir='gs://my-bucket/data'"
  Steps: (create the TPU VMs,) pack this checkout (`git archive HEAD`) into the job dir's
  bucket, install it with the `tpu` extra on every worker, then run the same
  `python -m spmdtask.main ...` on every worker. Each worker's spmdtask joins the job through
  JAX's own Cloud TPU detection (--multihost=auto); several slices find each other through
  the MEGASCALE_* values that queued resources give every VM, and
  `task.dcn_mesh_shape` lays the mesh over them.

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RUNTIME = {"v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
                   "v6e": "v2-alpha-tpuv6e", "v4": "tpu-ubuntu2204-base"}


class UsageError(Exception):
  """A launcher mistake: one paragraph, exit 2."""


def _main_args(job_log_dir: str, passthrough: list[str], extra_sets: list[str]) -> list[str]:
  if any(a.startswith("--job_log_dir") for a in passthrough):
    raise UsageError("Give the job dir once, as the launcher's --job_log_dir (it checks it and "
                     "passes it on), not after `--`.")
  if not any(a.startswith("--exp=") or a == "--exp" for a in passthrough):
    raise UsageError("Name the experiment after `--`, e.g. `-- --exp=lm.TinyLm`.")
  return ["-m", "spmdtask.main", *passthrough, f"--job_log_dir={job_log_dir}",
          *[f"--fdl_set={s}" for s in extra_sets]]


def _tpu_target(args) -> tuple[list[str], list[str]]:
  """(the gcloud command prefix that reaches every worker, its location flags)."""
  where = [f"--zone={args.zone}"] + ([f"--project={args.project}"] if args.project else [])
  if args.num_slices > 1:
    return (["gcloud", "compute", "tpus", "queued-resources", "ssh", args.name, *where,
             "--node=all", "--worker=all"], where)
  return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name, *where, "--worker=all"], where


def tpu_steps(args, passthrough: list[str]) -> list[tuple[str, list[str]]]:
  """The (title, argv) steps of a Cloud TPU job."""
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
  ssh, where = _tpu_target(args)
  runtime = args.runtime_version or DEFAULT_RUNTIME.get(args.accelerator_type.rsplit("-", 1)[0])
  if args.create and not runtime:
    raise UsageError(f"No default runtime for --accelerator_type={args.accelerator_type}; "
                     "pass --runtime_version (see `gcloud compute tpus versions list`).")
  tarball = f"{args.job_log_dir.rstrip('/')}/code/spmdtask.tar.gz"
  steps = []
  if args.create and args.num_slices > 1:
    steps.append(("Request the slices (queued resources; the VMs get MEGASCALE_* for JAX)",
                  ["gcloud", "compute", "tpus", "queued-resources", "create", args.name, *where,
                   f"--accelerator-type={args.accelerator_type}",
                   f"--runtime-version={runtime}", f"--node-count={args.num_slices}",
                   f"--node-prefix={args.name}"]))
  elif args.create:
    steps.append(("Create the TPU VMs",
                  ["gcloud", "compute", "tpus", "tpu-vm", "create", args.name, *where,
                   f"--accelerator-type={args.accelerator_type}", f"--version={runtime}"]))
  local_tar = os.path.join(tempfile.gettempdir(), "spmdtask.tar.gz")
  steps.append(("Pack this checkout (committed files)",
                ["git", "-C", ROOT, "archive", "--format=tar.gz", f"--output={local_tar}",
                 "HEAD"]))
  steps.append(("Put it next to the job", ["gcloud", "storage", "cp", local_tar, tarball]))
  py = args.python
  install = (f"gcloud storage cp {shlex.quote(tarball)} /tmp/spmdtask.tar.gz && "
             "rm -rf ~/spmdtask && mkdir -p ~/spmdtask && "
             "tar -xzf /tmp/spmdtask.tar.gz -C ~/spmdtask && "
             f"{py} -m pip install --quiet \"$HOME/spmdtask[tpu]\"")
  steps.append(("Install spmdtask with the tpu extra on every worker",
                [*ssh, f"--command={install}"]))
  run = "cd ~/spmdtask && " + shlex.join([py, *_main_args(args.job_log_dir, passthrough,
                                                             extra_sets)])
  steps.append(("Run the same command on every worker", [*ssh, f"--command={run}"]))
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


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="where", required=True)
  tpu = sub.add_parser("tpu", help="a Cloud TPU pod or several slices")
  tpu.add_argument("--name", required=True, help="TPU VM (or queued resource) name")
  tpu.add_argument("--zone", required=True)
  tpu.add_argument("--project", default=None)
  tpu.add_argument("--accelerator_type", default="v5litepod-256")
  tpu.add_argument("--runtime_version", default=None, help="default: by accelerator type")
  tpu.add_argument("--num_slices", type=int, default=1)
  tpu.add_argument("--dcn_mesh_shape", default=None, help="e.g. 2,1,1 (with --num_slices)")
  tpu.add_argument("--create", action="store_true", help="also create the TPU VMs")
  tpu.add_argument("--python", default="python3")
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


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  split = argv.index("--") if "--" in argv else len(argv)
  args = _parser().parse_args(argv[:split])
  passthrough = argv[split + 1:]
  try:
    if args.where == "tpu":
      steps = tpu_steps(args, passthrough)
      for i, (title, cmd) in enumerate(steps, 1):
        print(f"# {i}. {title}\n{shlex.join(cmd)}")
      if args.run:
        for title, cmd in steps:
          print(f"launch_pod: {title}", file=sys.stderr, flush=True)
          subprocess.run(cmd, check=True)
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
  except subprocess.CalledProcessError as e:
    print(f"launch_pod: `{shlex.join(e.cmd)}` failed (exit {e.returncode}); the steps before "
          "it are done.", file=sys.stderr)
    return e.returncode


if __name__ == "__main__":
  sys.exit(main())
