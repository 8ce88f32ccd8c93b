"""What a checkpoint's fingerprints cost, as a fraction of the save that computes them.

  python benchmarks/fingerprint.py [--repeats=3]

Side by side in one process on 8 CPU devices: TinyLm (1.05M params, data 8) and a ~100M-param
TinyLm (d 768, 12 layers, SwiGLU 2816; fsdp 8). The state holds random values (params and
Adam moments: zeros would compress to nothing and flatter the save). Per model, median of
`repeats` after one warm-up: the fingerprints alone (`fingerprints.of` on the canonical arrays,
one jitted program, results fetched), and a whole save (`Checkpointer.save`, which computes
them, until committed). Prints the ratio, and the fingerprint program's first call (compile).
"""
import argparse
import shutil
import statistics
import tempfile
import time

import common  # pylint: disable=unused-import  (sets 8 CPU devices first)
import jax
import jax.numpy as jnp
from absl import logging

from spmdtask.core import program as program_lib  # pylint: disable=g-import-not-at-top
from spmdtask.run import checkpoints, fingerprints  # pylint: disable=g-import-not-at-top

MODELS = {
    "TinyLm (1.05M params, data 8)": [],
    "TinyLm at ~100M params (fsdp 8)": [
        "task.model.d_model=768", "task.model.num_layers=12", "task.model.num_heads=12",
        "task.model.num_kv_heads=12", "task.model.head_dim=64", "task.model.d_ff=2816",
        "task.ici_mesh_shape=(1, 8, 1)"],
}


def _random_state(program):
  """The live state of `program` with every float leaf drawn from N(0, 0.02)."""
  canonical = program.to_canonical(program.init())
  leaves, tree = jax.tree.flatten(canonical)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  drawn = [jax.jit(lambda k, x: 0.02 * jax.random.normal(k, x.shape, x.dtype),
                   out_shardings=x.sharding)(k, x) if jnp.issubdtype(x.dtype, jnp.floating)
           else x for k, x in zip(keys, leaves)]
  return program.from_canonical(jax.tree.unflatten(tree, drawn))


def measure(name: str, overrides, repeats: int) -> None:
  run = common.build("TinyLm", overrides)
  program = program_lib.setup(run.task, run.datasets["train"].batch_at(0))
  state = jax.block_until_ready(_random_state(program))
  canonical = jax.block_until_ready(program.to_canonical(state))
  items = {"params": canonical.params, "opt_state": canonical.opt_state}
  n = sum(x.size for x in jax.tree.leaves(items))
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(items))
  t0 = time.perf_counter()
  fingerprints.of(items, program.mesh)
  first = time.perf_counter() - t0
  job = tempfile.mkdtemp(prefix="bench_fingerprint_")
  ckpt = checkpoints.Checkpointer(job, program, 1, None)
  fp, save = [], []
  try:
    for step in range(repeats + 1):  # the first round warms up
      t0 = time.perf_counter()
      fingerprints.of(items, program.mesh)
      fp.append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      ckpt.save(step + 1, state, {})
      ckpt.wait()
      save.append(time.perf_counter() - t0)
  finally:
    ckpt.close()
    shutil.rmtree(job, ignore_errors=True)
  fp_s, save_s = statistics.median(fp[1:]), statistics.median(save[1:])
  print(f"{name}: {n / 1e6:.1f}M values ({nbytes / 2**20:.0f} MiB: params + Adam moments) on "
        f"{dict(program.mesh.shape)}; median of {repeats}")
  print(f"  fingerprints (one program, fetched): {fp_s * 1e3:8.1f} ms  "
        f"(first call, with its compile: {first * 1e3:.0f} ms)")
  print(f"  whole save, until committed:         {save_s * 1e3:8.1f} ms")
  print(f"  fingerprints / save:                 {100 * fp_s / save_s:8.1f} %")


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args()
  logging.set_verbosity(logging.WARNING)
  for name, overrides in MODELS.items():
    measure(name, overrides, args.repeats)


if __name__ == "__main__":
  main()
