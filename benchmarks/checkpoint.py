"""Checkpoint save / restore times for an experiment, and whether the async save overlaps training.

  python benchmarks/checkpoint.py --exp=TinyLm [--devices=8] [--steps=10] [--repeats=3]

Prints, per repeat: the blocking part of a save (until `save` returns: unpad + device->host
copy), the whole save (until committed), a restore (`checkpoints.restore_state`), and
`steps` train steps timed three ways: alone, after a blocking save+wait, and running while
an async save writes in the background. Overlap = (sync - async) / save time.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--exp", default="TinyLm")
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--fdl_set", action="append", default=[])
  args = ap.parse_args()
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import fiddle as fdl  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  from spmdtask.run import checkpoints
  from spmdtask import main as main_lib
  from spmdtask.core import program as program_lib  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)

  run = fdl.build(main_lib.resolved_config(args.exp, args.fdl_set))
  inputs = run.datasets["train"]
  program = program_lib.setup(run.task, inputs.batch_at(0))
  state = program.init()
  batch = program.global_batch(inputs.batch_at(0))
  n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(program.layout.logical))

  def train(k):
    nonlocal state
    for _ in range(k):
      state, m = program.train(state, batch)
    jax.block_until_ready(m)

  train(2)  # compile
  job = tempfile.mkdtemp(prefix="bench_ckpt_")
  ckpt = checkpoints.Checkpointer(job, program, 1, None)
  rows = []
  step = 1000
  for _ in range(args.repeats + 1):  # the first round warms up (compiles unpad / pad)
    t0 = time.perf_counter(); train(args.steps); alone = time.perf_counter() - t0
    step += 1
    t0 = time.perf_counter(); ckpt.save(step, state, inputs.get_state())
    blocking = time.perf_counter() - t0
    ckpt.wait(); save = time.perf_counter() - t0
    t0 = time.perf_counter(); train(args.steps); sync = save + time.perf_counter() - t0
    step += 1
    t0 = time.perf_counter(); ckpt.save(step, state, inputs.get_state()); train(args.steps)
    ckpt.wait(); overlapped = time.perf_counter() - t0
    t0 = time.perf_counter()
    restored, _ = checkpoints.restore_state(job, program, step)
    jax.block_until_ready(restored); restore = time.perf_counter() - t0
    rows.append((blocking, save, restore, alone, sync, overlapped))
  ckpt.close()
  shutil.rmtree(job, ignore_errors=True)
  med = [statistics.median(c) for c in zip(*rows[1:])]
  blocking, save, restore, alone, sync, overlapped = med
  print(f"{args.exp} on {jax.device_count()} devices ({program.mesh.shape}); state "
        f"{n_bytes / 2**20:.1f} MiB logical; median of {args.repeats}")
  print(f"  save, blocking part (unpad + copy, until save() returns): {blocking * 1e3:8.1f} ms")
  print(f"  save, until committed:                                    {save * 1e3:8.1f} ms")
  print(f"  restore (restore_state: read + re-pad):                   {restore * 1e3:8.1f} ms")
  print(f"  {args.steps} train steps alone:                                 {alone * 1e3:8.1f} ms")
  print(f"  blocking save + {args.steps} steps:                             {sync * 1e3:8.1f} ms")
  print(f"  async save during {args.steps} steps (until committed):         {overlapped * 1e3:8.1f} ms")
  hidden = (sync - overlapped) / max(save - blocking, 1e-9)
  print(f"  background part of the save hidden behind training: {100 * min(max(hidden, 0), 1):.0f}%")


if __name__ == "__main__":
  main()
