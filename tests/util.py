"""Shared test helpers: build an experiment's run config, train it in-process on a device subset."""
import functools

import fiddle as fdl
import jax
import numpy as np

from spmdtask import loop, main, sharding


def build_run(exp: str, overrides=(), edit=None):
  """The built RunConfig of a registered experiment with `--fdl_set`-style overrides.

  `edit(cfg)`, if given, changes the unbuilt fiddle config in place first.
  """
  cfg = main.resolved_config(exp, list(overrides))
  if edit:
    edit(cfg)
  return fdl.build(cfg)


def train_steps(exp: str, num_steps: int, devices=None, overrides=(), edit=None):
  """Trains on `devices` (all by default).

  Returns (losses, logical params as numpy, program, padded state).
  """
  run = build_run(exp, overrides, edit)
  inputs = run.datasets["train"]
  program = loop.setup(run.task, inputs.batch_at(0), devices=devices)
  state = program.steps.init()
  losses = []
  for _ in range(num_steps):
    state, metrics = program.steps.train(state, program.global_batch(next(inputs)))
    losses.append(float(metrics["loss"]))
  params = jax.device_get(sharding.unpad(state.params, program.layout.logical.params))
  return np.asarray(losses), params, program, state


def assert_trees_close(a, b, rtol, atol=0.0):
  flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
  flat_b = jax.tree.leaves(b)
  assert len(flat_a) == len(flat_b)
  for (path, x), y in zip(flat_a, flat_b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                               err_msg=sharding.path_str(path))


@functools.lru_cache(maxsize=None)
def program_and_state(exp: str, num_devices: int):
  """A program for registered `exp` on the first `num_devices` devices and its fresh state.

  With one device the mesh is all ones (the experiment's mesh shape is overridden).
  """
  overrides = []
  if num_devices == 1:
    run = build_run(exp)
    overrides = [f"task.ici_mesh_shape={(1,) * len(run.task.mesh_axis_names)}"]
  run = build_run(exp, overrides)
  program = loop.setup(run.task, run.datasets["train"].batch_at(0),
                       devices=jax.devices()[:num_devices])
  return program, program.steps.init()
