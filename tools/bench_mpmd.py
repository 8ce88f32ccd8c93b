"""MPMD overhead on the 8 CPU devices: a toy dense model, then the product comparison.

Toy: two stages on submeshes 2x2 and 4x1, 1F1B. Prints, per step, the time for
`TrainStep.__call__` to return (host-side dispatch: the executor's Python, jit cache
lookups, device_puts) and the time until the new state is ready, measured in the same
run, and their ratio; also per schedule action.

Product (--product): `program.train` of lm.TinyLmMpmd (1F1B; 2 stages on 2x1x2 and
4x1x1 submeshes) against the SPMD pipeline lm.TinyLmPipeline (GPipe over the stage axis
of one 2x2x1x2 mesh), same model, data and microbatches, the two steps interleaved in
one run; with the MPMD host dispatch per step (time for `train` to return).

Zero-bubble split (--split_flops): compiled FLOPs (cost_analysis) of the fused backward B
against I + W of the ZB-H1 executor, per part, for the toy model and for lm.TinyLmMpmd's
LM stages; the ratio (I + W) / B shows W reuses I's stash instead of recomputing.

  python tools/bench_mpmd.py [--width=512] [--layers=8] [--microbatches=8] [--steps=10]
                             [--product] [--product_steps=20] [--product_set=...]
"""
import time

from absl import app, flags

import bench_common  # (8 CPU devices; before jax)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from spmdtask import program as program_lib
from spmdtask.pipeline import generators, mpmd, mpmd_step
from spmdtask.pipeline.split import stage_boundary

_WIDTH = flags.DEFINE_integer("width", 512, "model width")
_LAYERS = flags.DEFINE_integer("layers", 8, "dense layers (cut in half)")
_MICRO = flags.DEFINE_integer("microbatches", 8, "microbatches per step")
_ROWS = flags.DEFINE_integer("rows", 32, "rows per microbatch")
_STEPS = flags.DEFINE_integer("steps", 10, "timed steps")
_PRODUCT = flags.DEFINE_bool("product", True, "also compare lm.TinyLmMpmd with lm.TinyLmPipeline")
_PRODUCT_STEPS = flags.DEFINE_integer("product_steps", 20, "timed steps of each product program")
_SPLIT = flags.DEFINE_bool("split_flops", True, "print I + W vs B compiled FLOPs (ZB-H1)")
_OVERRIDES = flags.DEFINE_multi_string("product_set", [], "fdl_set-style overrides for both "
                                         "product experiments")


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


def product():
  """Interleaved step times of lm.TinyLmMpmd (1F1B) and lm.TinyLmPipeline (SPMD)."""
  names = ("lm.TinyLmMpmd", "lm.TinyLmPipeline")
  progs = {}
  for name in names:
    run = bench_common.build(name, _OVERRIDES.value)
    inputs = run.datasets["train"]
    program = program_lib.setup(run.task, inputs.batch_at(0))
    state = program.init()
    for i in range(2):  # compile
      state, metrics = program.train(state, program.global_batch(inputs.batch_at(i)))
    jax.block_until_ready((state, metrics))
    progs[name] = [program, state, inputs]
  dispatch, total = {n: [] for n in names}, {n: [] for n in names}
  for i in range(_PRODUCT_STEPS.value):
    for name in names:  # interleaved: both see the same machine load
      program, state, inputs = progs[name]
      local = inputs.batch_at(2 + i)
      t0 = time.perf_counter()
      state, metrics = program.train(state, program.global_batch(local))
      t1 = time.perf_counter()
      jax.block_until_ready((state, metrics))
      t2 = time.perf_counter()
      progs[name][1] = state
      dispatch[name].append(t1 - t0)
      total[name].append(t2 - t0)
  mpmd_prog = progs[names[0]][0]
  actions = sum(len(a) for a in mpmd_prog.pipeline.schedule.actions)
  print(f"\nproduct: {names[0]} (1F1B, submeshes "
        f"{[tuple(s) for s in mpmd_prog.config.submesh_shapes]}) vs {names[1]} (SPMD GPipe), "
        f"{_PRODUCT_STEPS.value} interleaved steps, medians")
  for name in names:
    print(f"{name:20s} step {np.median(total[name]) * 1e3:8.2f} ms   dispatch "
          f"{np.median(dispatch[name]) * 1e3:8.2f} ms")
  ratio = np.median(total[names[0]]) / np.median(total[names[1]])
  per_step = np.asarray(total[names[0]]) / np.asarray(total[names[1]])
  print(f"MPMD / SPMD step time  {ratio:6.3f}  (median of per-step ratios "
        f"{np.median(per_step):.3f})")
  disp = np.median(dispatch[names[0]])
  print(f"MPMD host dispatch     {disp * 1e3:6.2f} ms per step, {disp / actions * 1e6:.0f} us "
        f"per schedule action ({actions} actions), {disp / np.median(total[names[0]]):.3f} "
        "of the step")


def print_split_flops(name, pipeline, stage_params, batch):
  for part, (b, i, w) in sorted(pipeline.backward_flops(stage_params, batch).items()):
    print(f"{name:14s} part {part}: B {b:14,.0f}  I {i:14,.0f}  W {w:14,.0f}  "
          f"(I + W) / B {(i + w) / b:6.3f}")


def split_flops():
  """Compiled FLOPs of B vs I + W (zero-bubble split) on the toy and on lm.TinyLmMpmd."""
  d, L, M, r = _WIDTH.value, _LAYERS.value, _MICRO.value, _ROWS.value
  keys = jax.random.split(jax.random.key(0), L + 2)
  params = {"layers": [jax.random.normal(k, (d, d)) / np.sqrt(d) for k in keys[:L]]}
  batch = {"x": np.asarray(jax.random.normal(keys[L], (M * r, d))),
           "y": np.asarray(jax.random.normal(keys[L + 1], (M * r, d)))}
  devs = np.asarray(jax.devices())
  specs = [mpmd.StageSpec(Mesh(devices.reshape(4, 1), ("data", "model"),
                               axis_types=(AxisType.Auto,) * 2), None,
                          {"x": P("data"), "y": P("data")}, P("data"))
           for devices in (devs[:4], devs[4:])]
  micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((r, d), x.dtype), batch)
  pl = mpmd.Pipeline(loss_fn, params, micro, specs, generators.zb_h1(2, M))
  print("\nzero-bubble split, compiled FLOPs per microbatch")
  print_split_flops("toy", pl, pl.place(params), batch)
  run = bench_common.build("lm.TinyLmMpmd", _OVERRIDES.value + ["task.pipeline.schedule='zb_h1'"])
  inputs = run.datasets["train"]
  program = program_lib.setup(run.task, inputs.batch_at(0))
  state = program.init()
  print_split_flops("lm.TinyLmMpmd", program.pipeline, [st.params for st in state.stages],
                    program.train_batch(state, program.global_batch(inputs.batch_at(0))))


def run_all(argv):
  main(argv)
  if _SPLIT.value:
    split_flops()
  if _PRODUCT.value:
    product()


if __name__ == "__main__":
  app.run(run_all)
