"""Host dispatch cost of the MPMD executor per train step, on a toy dense model.

Two stages on submeshes 2x2 and 4x1 of the 8 CPU devices, 1F1B. Prints, per step, the
time for `TrainStep.__call__` to return (host-side dispatch: the executor's Python, jit
cache lookups, device_puts) and the time until the new state is ready, measured in the
same run, and their ratio; also per schedule action.

  python tools/bench_mpmd.py [--width=512] [--layers=8] [--microbatches=8] [--steps=10]
"""
import time

from absl import app, flags

import bench_common  # noqa: F401  (8 CPU devices; before jax)  pylint: disable=unused-import
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from spmdtask.pipeline import generators, mpmd, mpmd_step
from spmdtask.pipeline.split import stage_boundary

_WIDTH = flags.DEFINE_integer("width", 512, "model width")
_LAYERS = flags.DEFINE_integer("layers", 8, "dense layers (cut in half)")
_MICRO = flags.DEFINE_integer("microbatches", 8, "microbatches per step")
_ROWS = flags.DEFINE_integer("rows", 32, "rows per microbatch")
_STEPS = flags.DEFINE_integer("steps", 10, "timed steps")


def loss_fn(p, batch):
  h = batch["x"]
  for l, w in enumerate(p["layers"]):
    h = h + jnp.tanh(h @ w)
    if l == len(p["layers"]) // 2 - 1:
      h = stage_boundary(h)
  return jnp.mean((h - batch["y"]) ** 2)


def main(_):
  d, L, M, r = _WIDTH.value, _LAYERS.value, _MICRO.value, _ROWS.value
  keys = jax.random.split(jax.random.key(0), L + 2)
  params = {"layers": [jax.random.normal(k, (d, d)) / np.sqrt(d) for k in keys[:L]]}
  batch = {"x": np.asarray(jax.random.normal(keys[L], (M * r, d))),
           "y": np.asarray(jax.random.normal(keys[L + 1], (M * r, d)))}
  devs = np.asarray(jax.devices())
  specs = []
  for devices, shape in ((devs[:4], (2, 2)), (devs[4:], (4, 1))):
    mesh = Mesh(devices.reshape(shape), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    specs.append(mpmd.StageSpec(mesh, {"layers": [P(None, "model")] * L},
                                {"x": P("data"), "y": P("data")}, P("data")))
  micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((r, d), x.dtype), batch)
  schedule = generators.one_f_one_b(2, M)
  step = mpmd_step.TrainStep(mpmd.Pipeline(loss_fn, params, micro, specs, schedule),
                             optax.adamw(1e-3), max_grad_norm=1.0)
  states = step.init(params)
  for _ in range(2):  # compile
    states, metrics = step(states, batch)
  jax.block_until_ready((states, metrics["loss"]))
  dispatch, total = [], []
  for _ in range(_STEPS.value):
    t0 = time.perf_counter()
    states, metrics = step(states, batch)
    t1 = time.perf_counter()
    jax.block_until_ready((states, metrics["loss"]))
    t2 = time.perf_counter()
    dispatch.append(t1 - t0)
    total.append(t2 - t0)
  actions = sum(len(a) for a in schedule.actions)
  disp, tot = np.median(dispatch), np.median(total)
  print(f"width {d}, layers {L}, 2 stages (2x2, 4x1), 1F1B, {M} microbatches of {r} rows")
  print(f"dispatch per step  {disp * 1e3:8.2f} ms  ({disp / actions * 1e6:.0f} us per action, "
        f"{actions} actions)")
  print(f"step (ready)       {tot * 1e3:8.2f} ms")
  print(f"dispatch / step    {disp / tot:8.3f}")


if __name__ == "__main__":
  app.run(main)
