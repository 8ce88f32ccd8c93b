"""Framework train step vs a hand-written jax.jit + optax step: same model, same shardings.

Prints the per-step time of each, measured interleaved in one process, and their ratio
(target <= 1.02), plus model FLOP/s. `python benchmarks/step.py [--exp=lm.TinyLmFsdpTp]`.
"""
import argparse
import functools
import statistics
import time

import common  # pylint: disable=unused-import  (sets 8 CPU devices first)
import jax
import optax
from spmdtask.core import program as program_lib, steps


def hand_written(program, model, tx, example_batch, seed):
  """The step a user would write by hand with jax.jit, optax and the same shardings."""
  mesh, split = program.mesh, program.layout.split
  named = functools.partial(steps.named_shardings, mesh)
  batch_sh = named(program.batch_specs)

  def init():
    params = model.init(jax.random.key(seed), example_batch, method=model.loss)["params"]
    params = jax.tree.map(lambda x: x.value if hasattr(x, "names") else x, params,
                          is_leaf=lambda x: hasattr(x, "names"))
    return params, tx.init(params)

  def step(params, opt_state, batch):
    loss_fn = lambda p: model.apply({"params": p}, batch, method=model.loss)[0]
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  with jax.set_mesh(mesh):
    params, opt_state = jax.jit(init, out_shardings=(named(split.params),
                                                     named(split.opt_state)))()
  jitted = jax.jit(step, in_shardings=(named(split.params), named(split.opt_state), batch_sh),
                   out_shardings=(named(split.params), named(split.opt_state), None),
                   donate_argnums=(0, 1))
  return jitted, params, opt_state


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--exp", default="lm.TinyLm")
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()
  run = common.build(args.exp, common.REFERENCE_LM)
  inputs = run.datasets["train"]
  program = program_lib.setup(run.task, inputs.batch_at(0))
  batch = program.global_batch(inputs.batch_at(0))
  init_batch = jax.tree.map(lambda x: x[:1], inputs.batch_at(0))
  hand, params, opt_state = hand_written(program, run.task.model, program.tx, init_batch,
                                         run.task.train.seed)
  state = program.init()

  def time_framework(state):
    t = time.perf_counter()
    for _ in range(args.steps):
      state, metrics = program.train(state, batch)
    jax.block_until_ready(metrics)
    return state, (time.perf_counter() - t) / args.steps

  def time_hand(params, opt_state):
    t = time.perf_counter()
    with jax.set_mesh(program.mesh):
      for _ in range(args.steps):
        params, opt_state, loss = hand(params, opt_state, batch)
    jax.block_until_ready(loss)
    return params, opt_state, (time.perf_counter() - t) / args.steps

  state, _ = time_framework(state)  # compile + warm up both
  params, opt_state, _ = time_hand(params, opt_state)
  fw, hw = [], []
  for _ in range(args.rounds):
    state, t = time_framework(state)
    fw.append(t)
    params, opt_state, t = time_hand(params, opt_state)
    hw.append(t)
  f, h = statistics.median(fw), statistics.median(hw)
  tokens = inputs.batch_size * inputs.seq_len
  flops = program.work.train_flops * inputs.batch_size
  n = sum(x.size for x in jax.tree.leaves(program.layout.logical.params))
  print(f"exp={args.exp} mesh={dict(program.mesh.shape)} params={n / 1e6:.2f}M "
        f"tokens/step={tokens}")
  print(f"framework step  {f * 1e3:8.2f} ms  ({flops / f / 1e9:.1f} model GFLOP/s)")
  print(f"hand-written    {h * 1e3:8.2f} ms  ({flops / h / 1e9:.1f} model GFLOP/s)")
  print(f"ratio framework/hand-written = {f / h:.3f}  (target <= 1.02)")


if __name__ == "__main__":
  main()
