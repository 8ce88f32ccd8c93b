"""Train / eval programs: a built RunConfig on a mesh, driven step by step."""
import dataclasses
import os
import time
from typing import Any, Callable

import jax
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh

from spmdtask import mesh as mesh_lib
from spmdtask import checkpoints, evaluation, steps as steps_lib, summaries, train_state
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


def train(run: RunConfig, on_metrics: Callable[[int, dict], None] | None = None,
          job_log_dir: str | None = None, restore_step: int | None = None,
          config_text: str | None = None):
  """Trains `run.task` on `run.datasets['train']` for `num_train_steps`.

  Logs step, loss, steps/s and tokens/s every `log_interval_steps` (process 0).
  With `job_log_dir`: resumes from its latest complete checkpoint (or `restore_step`),
  else warm-starts from `task.train.init_checkpoint_dir`; writes `config.txt` (the
  `config_text`) once the start state is known; saves checkpoints every
  `save_interval_steps` and at the end; writes TensorBoard scalars every
  `summary_interval_steps`; evaluates every eval dataset every `eval_interval_steps`
  (summaries/eval_<name>, eval_metrics.jsonl); on SIGTERM or the multi-host preemption
  sync point, saves at the current step and returns early.
  Returns (final padded state, program, losses of the steps run here, as floats).
  """
  task, inputs = run.task, run.datasets["train"]
  tp = task.train
  writer = summaries.SummaryWriter(summaries.summary_dir(job_log_dir) if job_log_dir else None)
  example = inputs.batch_at(0)
  program = setup(task, example)
  ckpt = None
  if job_log_dir is not None:
    ckpt = checkpoints.Checkpointer(job_log_dir, program, tp.save_interval_steps,
                                    tp.max_to_keep, {"config": config_text or ""})
  state = checkpoints.initial_state(ckpt, program, inputs, restore_step, tp.init_checkpoint_dir)
  if job_log_dir is not None and config_text is not None and jax.process_index() == 0:
    with open(os.path.join(job_log_dir, "config.txt"), "w") as f:
      f.write(config_text)
  if ckpt is not None:
    ckpt.install_sigterm_handler()
  seq_len = example["inputs"].shape[1] if "inputs" in example else 0
  flops_per_tok = model_flops_per_token(task, program.layout, seq_len)
  log_every = max(1, tp.log_interval_steps)
  sum_every = max(1, tp.summary_interval_steps)
  losses, pending = [], []
  t0, tokens = time.perf_counter(), 0
  for step in range(int(jax.device_get(state.step)), tp.num_train_steps):
    local = next(inputs)
    state, metrics = program.steps.train(state, program.global_batch(local))
    pending.append(metrics)
    done = step + 1
    preempted = ckpt is not None and ckpt.preempted(done)
    last = done == tp.num_train_steps or preempted
    if last or done % log_every == 0 or done % sum_every == 0:
      fetched = jax.device_get(pending)
      pending = []
      for i, m in enumerate(fetched):
        losses.append(float(m["loss"]))
        tokens += float(m["num_tokens"])
        if on_metrics:
          on_metrics(done - len(fetched) + i + 1, m)
      dt = time.perf_counter() - t0
      rate = {"steps_per_sec": len(fetched) / dt, "tokens_per_sec": tokens / dt}
      if jax.process_index() == 0 and (last or done % log_every == 0):
        logging.info("step %d loss %.5f steps/s %.2f tokens/s %.0f", done, losses[-1],
                     rate["steps_per_sec"], rate["tokens_per_sec"])
      if last or done % sum_every == 0:
        m = fetched[-1]
        mfu = rate["tokens_per_sec"] * flops_per_tok / (tp.peak_flops_per_device
                                                         * program.mesh.devices.size)
        writer.scalars(done, {"loss": m["loss"], "learning_rate": m["learning_rate"],
                              "grad_norm": m["grad_norm"], "param_norm": m["param_norm"],
                              **rate, "mfu": mfu})
        writer.flush()
      t0, tokens = time.perf_counter(), 0
    if ckpt is not None and (last or ckpt.should_save(done)):
      ckpt.save(done, state, inputs.get_state() if hasattr(inputs, "get_state") else None)
    if tp.eval_interval_steps and done % tp.eval_interval_steps == 0:
      evaluation.evaluate_all(run.datasets, program, state, done, tp.eval_steps, job_log_dir)
    if preempted:
      logging.warning("Preempted: saved a checkpoint at step %d; exiting.", done)
      break
  if ckpt is not None:
    ckpt.close()
  writer.close()
  return state, program, losses
