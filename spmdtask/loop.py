"""Train / eval programs: a built RunConfig on a mesh, driven step by step."""
import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh

from spmdtask import mesh as mesh_lib
from spmdtask import steps as steps_lib, train_state
from spmdtask.inputs import global_batch
from spmdtask.layers.transformer import flops_per_token
from spmdtask.task import RunConfig, Task


@dataclasses.dataclass
class Program:
  """A task set up on a mesh: its state layout and jitted steps."""
  task: Task
  mesh: Mesh
  tx: optax.GradientTransformation
  schedule: Callable
  layout: train_state.StateLayout
  steps: steps_lib.Steps

  def global_batch(self, local_batch) -> Any:
    return global_batch.to_global(local_batch, self.steps.batch_specs, self.mesh)


def setup(task: Task, example_local_batch, devices=None) -> Program:
  """Mesh, layout and jitted steps for `task`; raises ConfigError on a bad config."""
  mesh = mesh_lib.create_mesh(task.mesh_axis_names, task.ici_mesh_shape, task.dcn_mesh_shape,
                              devices)
  mesh_shape = mesh_lib.mesh_shape(mesh)
  batch_specs = global_batch.specs(example_local_batch, task.train.inputs_split_mapping,
                                   task.batch_axes(), mesh)
  if hasattr(task.model, "validate"):
    global_size = jax.tree.leaves(global_batch.global_shapes(example_local_batch))[0].shape[0]
    task.model.validate(mesh, global_size)
  tx = task.train.make_optimizer()
  # Init traces on one row: params do not depend on the batch size.
  init_batch = jax.tree.map(lambda x: np.zeros((1,) + x.shape[1:], x.dtype), example_local_batch)
  with jax.set_mesh(mesh):  # layers read the mesh (constraints, pipeline) while tracing
    layout = train_state.layout(task.model, tx, init_batch, mesh_shape)
  steps = steps_lib.build(task.model, tx, task.train.schedule(), layout, mesh, batch_specs,
                          init_batch, task.train.seed)
  return Program(task, mesh, tx, task.train.schedule(), layout, steps)


def model_flops_per_token(task: Task, layout: train_state.StateLayout, seq_len: int) -> float:
  m = task.model
  n = sum(x.size for x in jax.tree.leaves(layout.logical.params))
  return flops_per_token(n, getattr(m, "num_layers", 0), getattr(m, "d_model", 0), seq_len)


def train(run: RunConfig, on_metrics: Callable[[int, dict], None] | None = None):
  """Trains `run.task` on `run.datasets['train']` for `num_train_steps`.

  Logs step, loss, steps/s and tokens/s every `log_interval_steps` (process 0).
  Returns (final padded state, program, per-step losses as floats).
  """
  task, inputs = run.task, run.datasets["train"]
  program = setup(task, inputs.batch_at(0))
  state = program.steps.init()
  interval = max(1, task.train.log_interval_steps)
  losses, pending = [], []
  t0, tokens = time.perf_counter(), 0
  for step in range(int(jax.device_get(state.step)), task.train.num_train_steps):
    local = next(inputs)
    state, metrics = program.steps.train(state, program.global_batch(local))
    pending.append(metrics)
    if (step + 1) % interval == 0 or step + 1 == task.train.num_train_steps:
      fetched = jax.device_get(pending)
      pending = []
      for i, m in enumerate(fetched):
        losses.append(float(m["loss"]))
        tokens += float(m["num_tokens"])
        if on_metrics:
          on_metrics(step + 1 - len(fetched) + i + 1, m)
      dt = time.perf_counter() - t0
      if jax.process_index() == 0:
        logging.info("step %d loss %.5f steps/s %.2f tokens/s %.0f", step + 1, losses[-1],
                     len(fetched) / dt, tokens / dt)
      t0, tokens = time.perf_counter(), 0
  return state, program, losses
