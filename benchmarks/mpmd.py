"""MPMD overhead on the 8 CPU devices: a toy dense model, then the product comparison.

Toy: two stages on submeshes 2x2 and 4x1, 1F1B. Prints, per step, the host's cost of
`TrainStep.__call__`: the dispatching thread's CPU time until it returns (the executor's
Python, jit cache lookups, device_puts: what a pod host pays) and its wall time (on 8
emulated devices sharing 2 cores it also waits for a core), the time until the new state
is ready, and both per schedule action.

Product (--product): `program.train` of the same 8-layer TinyLm (batch 32, 8 pipeline
microbatches) on the same 8 devices under every strategy (PRODUCT): unpipelined, the
SPMD pipeline (GPipe, circular; stage 2 x data 2 x model 2) and MPMD (gpipe, 1f1b,
zb_h1, zb_v; two stages of data 2 x model 2), the steps interleaved in one run; per
strategy the step time (and its ratio to SPMD GPipe), the host dispatch per step and per
schedule action, and the largest relative difference of its losses from the same model's
on 1 device.

Zero-bubble split (--split_flops): compiled FLOPs (cost_analysis) of the fused backward B
against I + W of the ZB-H1 executor, per part, for the toy model and for lm.TinyLmMpmd's
LM stages; the ratio (I + W) / B shows W reuses I's stash instead of recomputing.

  python benchmarks/mpmd.py [--width=512] [--layers=8] [--microbatches=8] [--steps=10]
                             [--product] [--product_steps=10] [--product_set=...]
"""
import time

from absl import app, flags

import common  # (8 CPU devices; before jax)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from spmdtask.core import program as program_lib
from spmdtask.pipeline.schedules import generators
from spmdtask.pipeline.mpmd import pipeline as mpmd, step as mpmd_step
from spmdtask.pipeline.mpmd.split import stage_boundary

_WIDTH = flags.DEFINE_integer("width", 512, "model width")
_LAYERS = flags.DEFINE_integer("layers", 8, "dense layers (cut in half)")
_MICRO = flags.DEFINE_integer("microbatches", 8, "microbatches per step")
_ROWS = flags.DEFINE_integer("rows", 32, "rows per microbatch")
_STEPS = flags.DEFINE_integer("steps", 10, "timed steps")
_PRODUCT = flags.DEFINE_bool("product", True, "also compare every strategy on an 8-layer TinyLm")
_PRODUCT_STEPS = flags.DEFINE_integer("product_steps", 10, "timed steps of each product program")
_SPLIT = flags.DEFINE_bool("split_flops", True, "print I + W vs B compiled FLOPs (ZB-H1)")
_OVERRIDES = flags.DEFINE_multi_string("product_set", [], "fdl_set-style overrides for every "
                                         "product experiment")


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
  dispatch, total, host = [], [], []
  for _ in range(_STEPS.value):
    c0, t0 = time.thread_time(), time.perf_counter()
    states, metrics = step(states, batch)
    c1, t1 = time.thread_time(), time.perf_counter()
    jax.block_until_ready((states, metrics["loss"]))
    t2 = time.perf_counter()
    dispatch.append(t1 - t0)
    host.append(c1 - c0)
    total.append(t2 - t0)
  actions = sum(len(a) for a in schedule.actions)
  disp, tot, cpu = np.median(dispatch), np.median(total), np.median(host)
  print(f"width {d}, layers {L}, 2 stages (2x2, 4x1), 1F1B, {M} microbatches of {r} rows")
  print(f"host CPU per step  {cpu * 1e3:8.2f} ms  ({cpu / actions * 1e6:.0f} us per action, "
        f"{actions} actions; the dispatching thread's CPU time until the step returns)")
  print(f"dispatch per step  {disp * 1e3:8.2f} ms  ({disp / actions * 1e6:.0f} us per action: "
        "wall time, incl. waiting for a core)")
  print(f"step (ready)       {tot * 1e3:8.2f} ms")
  print(f"host / step        {cpu / tot:8.3f}   dispatch / step {disp / tot:.3f}")


_COMMON = ("task.model.num_layers=8", "datasets['train'].batch_size=32")
_MPMD = ("task.pipeline.submesh_shapes=((2,1,2),(2,1,2))", "task.pipeline.num_microbatches=8")
PRODUCT = (  # (label, experiment, overrides): the same 8-layer model on the same 8 devices
    ("unpipelined (data 8)", "lm.TinyLm", ()),
    ("SPMD GPipe", "lm.TinyLmPipeline", ("task.pipeline.num_microbatches=8",)),
    ("SPMD circular", "lm.TinyLmCircular", ("task.pipeline.num_microbatches=8",)),
    ("MPMD gpipe", "lm.TinyLmMpmd", _MPMD + ("task.pipeline.layer_cuts=(4,)",
                                             "task.pipeline.schedule='gpipe'")),
    ("MPMD 1f1b", "lm.TinyLmMpmd", _MPMD + ("task.pipeline.layer_cuts=(4,)",)),
    ("MPMD zb_h1", "lm.TinyLmMpmd", _MPMD + ("task.pipeline.layer_cuts=(4,)",
                                             "task.pipeline.schedule='zb_h1'")),
    ("MPMD zb_v", "lm.TinyLmMpmd", _MPMD + ("task.pipeline.layer_cuts=(2,4,6)",
                                            "task.pipeline.num_chunks=2",
                                            "task.pipeline.schedule='zb_v'")),
)


def _program(exp, overrides, devices=None):
  run = common.build(exp, list(_COMMON) + list(overrides) + _OVERRIDES.value)
  inputs = run.datasets["train"]
  program = program_lib.setup(run.task, inputs.batch_at(0), devices=devices)
  return program, program.init(), inputs


def _loss(metrics) -> float:
  return float(np.asarray(metrics["loss"]))


def product():
  """Step time, host dispatch and losses of every strategy (PRODUCT), interleaved."""
  steps = _PRODUCT_STEPS.value
  ref, state, inputs = _program("lm.TinyLm", ("task.ici_mesh_shape=(1,1,1)",), jax.devices()[:1])
  want = []
  for i in range(steps + 2):  # the 1-device losses of the same batches
    state, metrics = ref.train(state, ref.global_batch(inputs.batch_at(i)))
    want.append(_loss(metrics))
  runs = {}
  for label, exp, over in PRODUCT:
    program, state, inputs = _program(exp, over)
    losses = []
    for i in range(2):  # compile
      state, metrics = program.train(state, program.global_batch(inputs.batch_at(i)))
      losses.append(_loss(metrics))
    runs[label] = dict(program=program, state=state, inputs=inputs, losses=losses,
                       wall=[], dispatch=[], host=[])
  for i in range(2, steps + 2):
    for label in runs:  # interleaved: every strategy sees the same machine load
      r = runs[label]
      batch = r["program"].global_batch(r["inputs"].batch_at(i))
      c0, t0 = time.thread_time(), time.perf_counter()
      r["state"], metrics = r["program"].train(r["state"], batch)
      c1, t1 = time.thread_time(), time.perf_counter()
      jax.block_until_ready((r["state"], metrics))
      t2 = time.perf_counter()
      r["losses"].append(_loss(metrics))
      r["wall"].append(t2 - t0)
      r["dispatch"].append(t1 - t0)
      r["host"].append(c1 - c0)
  base = np.median(runs["SPMD GPipe"]["wall"])
  print(f"\nproduct: 8-layer TinyLm, batch 32, 8 devices, 8 pipeline microbatches; "
        f"{steps} interleaved steps, medians. host = CPU time of the dispatching thread "
        "until train() returns; dispatch = its wall time")
  print(f"{'strategy':22s} {'step ms':>9s} {'/ GPipe':>8s} {'dispatch ms':>12s} "
        f"{'host ms':>8s} {'actions':>8s} {'host/action':>12s} {'host/step':>10s} "
        f"{'max |loss - 1 dev| / loss':>26s}")
  for label, r in runs.items():
    wall, host = np.median(r["wall"]), np.median(r["host"])
    actions = (sum(len(a) for a in r["program"].pipeline.schedule.actions)
               if label.startswith("MPMD") else 0)
    per_action = f"{host / actions * 1e3:9.3f} ms" if actions else f"{'-':>12s}"
    err = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], want))
    print(f"{label:22s} {wall * 1e3:9.1f} {wall / base:8.3f} "
          f"{np.median(r['dispatch']) * 1e3:12.2f} {host * 1e3:8.2f} {actions or '-':>8} "
          f"{per_action} {host / wall:10.3f} {err:26.2e}")


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
  run = common.build("lm.TinyLmMpmd", _OVERRIDES.value + ["task.pipeline.schedule='zb_h1'"])
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
