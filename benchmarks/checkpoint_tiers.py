"""The blocking cost of a local-tier save and of a persistent-tier save (GCS), per save and
as a fraction of the step time.

  python benchmarks/checkpoint_tiers.py [--exp=TinyLmFsdp] [--fdl_set=...] [--repeats=5]
      [--local_dir=/dev/shm/spmdtask_bench] [--local_interval=5] [--slices=1]
      [--dcn_axis=fsdp]

One process, 8 CPU devices, the experiment's FSDP layout; with `--slices=S` (S > 1), S
processes of 8/S devices joined by jax.distributed (gloo), the mesh's `--dcn_axis` across
them as task.dcn_mesh_shape (consecutive processes stand in for slices): `fsdp` shards the
state across the slices, so each local save also makes and writes the peer copies
(`run.peer_copies`); `data` replicates it across them (none), the comparison. The persistent tier is a job dir
in a local GCS emulator (`tests/gcs_emulator.py`: gcp-storage-emulator, in memory); the local
tier is `--local_dir` (default: the RAM disk). For each tier, `repeats` saves (after one to
warm up), each committed before the next: the blocking part (until `save` returns: unpad,
fingerprints, device->host copy; training resumes then) and the whole save (until
committed). The step time is the median of `--steps` train steps alone. The default model
(`--fdl_set` below) is TinyLm's architecture scaled to a step of about a second here.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ("task.model.d_model=256", "task.model.num_layers=6", "task.model.d_ff=1024",
         "task.model.num_heads=8", "task.model.num_kv_heads=4", "task.model.head_dim=32",
         "task.model.vocab_size=1024", "datasets['train'].vocab_size=1024",
         "datasets['train'].batch_size=32")


def _timed_saves(ckpt, state, inputs, first_step: int, repeats: int, **tiers):
  """(blocking s, committed s) of each of `repeats` saves, after one warm-up save."""
  rows = []
  for i in range(repeats + 1):
    t0 = time.perf_counter()
    ckpt.save(first_step + i, state, inputs.get_state(), **tiers)
    blocking = time.perf_counter() - t0
    ckpt.wait()
    if i:
      rows.append((blocking, time.perf_counter() - t0))
  return [statistics.median(c) for c in zip(*rows)]


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--exp", default="TinyLmFsdp")
  ap.add_argument("--fdl_set", action="append", default=None)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--local_dir", default="/dev/shm/spmdtask_bench")
  ap.add_argument("--local_interval", type=int, default=5)
  ap.add_argument("--slices", type=int, default=1)
  ap.add_argument("--dcn_axis", default="fsdp", choices=("fsdp", "data"))
  ap.add_argument("--process_id", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  overrides = list(MODEL) if args.fdl_set is None else args.fdl_set
  if args.slices > 1:
    dcn = tuple(args.slices if a == args.dcn_axis else 1 for a in ("data", "fsdp", "model"))
    overrides += [f"task.dcn_mesh_shape={dcn}", "task.ici_mesh_shape=(1, -1, 1)"]
  os.environ["XLA_FLAGS"] = (
      f"--xla_force_host_platform_device_count={8 // max(args.slices, 1)}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, ROOT)
  if args.process_id is not None:  # one of the --slices processes
    from spmdtask.run import cluster  # pylint: disable=g-import-not-at-top
    cluster.join(args.coordinator, args.slices, args.process_id)
    _measure(args, overrides)
    return
  from tests import gcs_emulator  # pylint: disable=g-import-not-at-top
  emulator = gcs_emulator.Emulator("bucket")
  os.environ.update(emulator.env())  # before gcsfs and tensorstore are imported
  try:
    if args.slices > 1:
      _processes(args)
    else:
      _measure(args, overrides)
  finally:
    emulator.stop()


def _processes(args) -> None:
  """This benchmark as `args.slices` processes of one jax.distributed job; process 0's
  output shows."""
  from tools import launch_local  # pylint: disable=g-import-not-at-top
  port = launch_local.free_port()
  scratch = tempfile.mkdtemp(prefix="bench_tiers_")  # the job dir all processes share
  procs = [subprocess.Popen(
      [sys.executable, *sys.argv, f"--process_id={i}", f"--coordinator=127.0.0.1:{port}",
       f"--scratch={scratch}"],
      stdout=None if i == 0 else subprocess.DEVNULL, stderr=subprocess.STDOUT)
      for i in range(args.slices)]
  codes = [p.wait() for p in procs]
  shutil.rmtree(scratch, ignore_errors=True)
  if any(codes):
    sys.exit(f"checkpoint_tiers: a process failed (exit statuses {codes})")


def _measure(args, overrides) -> None:
  import fiddle as fdl  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  from spmdtask import main as main_lib  # pylint: disable=g-import-not-at-top
  from spmdtask.core import program as program_lib  # pylint: disable=g-import-not-at-top
  from spmdtask.run import checkpoints, local_tier  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.ERROR)

  run = fdl.build(main_lib.resolved_config(args.exp, overrides))
  inputs = run.datasets["train"]
  program = program_lib.setup(run.task, inputs.batch_at(0))
  state = program.init()
  batch = program.global_batch(inputs.batch_at(0))
  n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(program.layout.logical))
  state, m = program.train(state, batch)  # compile
  jax.block_until_ready(m)
  times = []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    state, m = program.train(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)

  scratch = args.scratch or tempfile.mkdtemp(prefix="bench_tiers_")
  job = os.path.join(scratch, "job")
  local = checkpoints.Checkpointer(job, program, 10**9, None, local=local_tier.LocalTier(
      args.local_dir, job, 1, 2, run.task.dcn_sizes()))
  local_cost = _timed_saves(local, state, inputs, 1, args.repeats)
  local.close()
  bucket = checkpoints.Checkpointer("gs://bucket/job", program, 1, 2)
  persistent_cost = _timed_saves(bucket, state, inputs, 1, args.repeats)
  bucket.close()
  if args.scratch is None:  # (the processes' shared one: their parent removes it)
    shutil.rmtree(scratch, ignore_errors=True)
  shutil.rmtree(local.local.directory, ignore_errors=True)

  if jax.process_index():
    return
  print(f"{args.exp} {' '.join(overrides)}")
  print(f"  {jax.process_count()} process(es), {jax.device_count()} devices "
        f"{dict(program.mesh.shape)}; state "
        f"{n_bytes / 2**20:.1f} MiB logical (params + optimizer); step {step_s * 1e3:.0f} ms "
        f"(median of {args.steps}); saves: median of {args.repeats}")
  for name, (blocking, whole) in (("local tier (" + args.local_dir + ")", local_cost),
                                  ("persistent tier (GCS emulator)", persistent_cost)):
    print(f"  {name:42s} blocking {blocking * 1e3:8.1f} ms = {100 * blocking / step_s:5.1f}% "
          f"of a step; committed {whole * 1e3:8.1f} ms")
  per = local_cost[0] / (args.local_interval * step_s)
  print(f"  a local save every {args.local_interval} steps: {100 * per:.2f}% of the step time")


if __name__ == "__main__":
  main()
