"""The train loop: steps driven one by one, with small hooks for everything around them.

The loop itself only feeds batches, runs `program.train` and fetches metrics when a
hook asks for them (fetching is a host sync, so it happens only at those steps). What
happens around the steps is a `Hook`: progress logging, TensorBoard summaries,
checkpoints, evaluation; a new concern (profiling, NaN checks) is a new hook, not a
longer loop.
"""
import dataclasses
import os
import time
from typing import Any, Sequence

import jax
from absl import logging

from spmdtask import checkpoints, evaluation, summaries
from spmdtask import program as program_lib
from spmdtask.inputs import global_batch
from spmdtask.task import RunConfig


@dataclasses.dataclass(frozen=True)
class Fetched:
  """Metrics of the steps since the last fetch, and the throughput over them."""
  step: int                     # the last step in `metrics`
  metrics: list[dict]           # one dict of replicated scalars per step, as floats
  rates: dict[str, float]       # steps_per_sec, examples_per_sec, tokens_per_sec, mfu


class Hook:
  """Runs around train steps. Every method is optional; `step` counts completed steps."""

  def wants_metrics(self, step: int, last: bool) -> bool:
    """True if `on_metrics` should see the metrics up to `step` (forces a host fetch)."""
    return False

  def on_metrics(self, fetched: Fetched, last: bool) -> None:
    pass

  def after_step(self, step: int, state: Any, last: bool) -> None:
    pass

  def close(self) -> None:
    pass


class ProgressLog(Hook):
  """Process 0 logs step, loss, steps/s, tokens/s and MFU every `every` steps."""

  def __init__(self, every: int):
    self.every = max(1, every)

  def wants_metrics(self, step, last):
    return last or step % self.every == 0

  def on_metrics(self, fetched, last):
    if jax.process_index() == 0:
      r = fetched.rates
      logging.info("step %d loss %.5f steps/s %.2f tokens/s %.0f mfu %.3f", fetched.step,
                   fetched.metrics[-1]["loss"], r["steps_per_sec"], r["tokens_per_sec"],
                   r["mfu"])


class TrainSummaries(Hook):
  """TensorBoard scalars (summaries/train) every `every` steps: metrics and rates."""

  def __init__(self, job_log_dir: str | None, every: int):
    self.every = max(1, every)
    self.writer = summaries.SummaryWriter(
        summaries.summary_dir(job_log_dir) if job_log_dir else None)

  def wants_metrics(self, step, last):
    return self.writer.active and (last or step % self.every == 0)

  def on_metrics(self, fetched, last):
    self.writer.scalars(fetched.step, {**fetched.metrics[-1], **fetched.rates})
    self.writer.flush()

  def close(self):
    self.writer.close()


class Checkpoints(Hook):
  """Saves every `save_interval_steps`, at the last step and on preemption."""

  def __init__(self, ckpt: checkpoints.Checkpointer, inputs):
    self.ckpt, self.inputs = ckpt, inputs

  def after_step(self, step, state, last):
    if last or self.ckpt.should_save(step):
      self.ckpt.save(step, state, self.inputs.get_state() if hasattr(self.inputs, "get_state")
                     else None)

  def close(self):
    self.ckpt.close()


class PeriodicEval(Hook):
  """Evaluates every eval dataset every `every` steps (summaries, eval_metrics.jsonl)."""

  def __init__(self, datasets, program, every: int, eval_steps, job_log_dir):
    self.datasets, self.program, self.every = datasets, program, every
    self.eval_steps, self.job_log_dir = eval_steps, job_log_dir

  def after_step(self, step, state, last):
    if self.every and step % self.every == 0:
      evaluation.evaluate_all(self.datasets, self.program, state, step, self.eval_steps,
                              self.job_log_dir)


def rates(program: program_lib.Program, num_steps: int, seconds: float,
          batch_size: int) -> dict[str, float]:
  """Throughput of `num_steps` steps in `seconds`; MFU against the configured peak."""
  tp = program.task.train
  examples = num_steps * batch_size / seconds
  return {"steps_per_sec": num_steps / seconds, "examples_per_sec": examples,
          "tokens_per_sec": examples * program.work.tokens,
          "mfu": examples * program.work.train_flops / (tp.peak_flops_per_device
                                                        * program.mesh.devices.size)}


def run_steps(program: program_lib.Program, state, inputs, first: int, last_step: int,
              batch_size: int, hooks: Sequence[Hook], preempted=lambda step: False):
  """Runs steps first+1 .. last_step; returns (state, losses of the steps run)."""
  losses, pending = [], []
  t0 = time.perf_counter()
  for step in range(first, last_step):
    state, metrics = program.train(state, program.global_batch(next(inputs)))
    pending.append(metrics)
    done = step + 1
    stop = preempted(done)
    last = done == last_step or stop
    if any(h.wants_metrics(done, last) for h in hooks):
      values = [{k: float(v) for k, v in m.items()} for m in jax.device_get(pending)]
      fetched = Fetched(done, values, rates(program, len(pending), time.perf_counter() - t0,
                                            batch_size))
      losses.extend(m["loss"] for m in values)
      for h in hooks:
        if h.wants_metrics(done, last):
          h.on_metrics(fetched, last)
      pending, t0 = [], time.perf_counter()
    for h in hooks:
      h.after_step(done, state, last)
    if stop:
      logging.warning("Preempted: saved a checkpoint at step %d; exiting.", done)
      break
  return state, losses


def train(run: RunConfig, job_log_dir: str | None = None, restore_step: int | None = None,
          config_text: str | None = None, hooks: Sequence[Hook] = (), devices=None):
  """Trains `run.task` on `run.datasets['train']` for `num_train_steps`.

  Logs progress every `log_interval_steps` (process 0). With `job_log_dir`: resumes from
  its latest complete checkpoint (or `restore_step`), else warm-starts from
  `task.train.init_checkpoint_dir`; writes `config.txt` (the `config_text`) once the
  start state is known; saves checkpoints every `save_interval_steps` and at the end;
  writes TensorBoard scalars every `summary_interval_steps`; evaluates every eval dataset
  every `eval_interval_steps`; on SIGTERM or the multi-host preemption sync point,
  saves at the current step and returns early. `hooks` run after the built-in ones.
  `devices`: the devices of the mesh (default: all).
  Returns (final live state, program, losses of the steps run here, as floats).
  """
  task, inputs = run.task, run.datasets["train"]
  tp = task.train
  example = inputs.batch_at(0)
  program = program_lib.setup(task, example, devices)
  ckpt = None
  if job_log_dir is not None:
    ckpt = checkpoints.Checkpointer(job_log_dir, program, tp.save_interval_steps,
                                    tp.max_to_keep, {"config": config_text or ""})
  state = checkpoints.initial_state(ckpt, program, inputs, restore_step, tp.init_checkpoint_dir)
  if job_log_dir is not None and config_text is not None and jax.process_index() == 0:
    with open(os.path.join(job_log_dir, "config.txt"), "w") as f:
      f.write(config_text)
  builtin = [ProgressLog(tp.log_interval_steps),
             TrainSummaries(job_log_dir, tp.summary_interval_steps)]
  if ckpt is not None:
    ckpt.install_sigterm_handler()
    builtin.append(Checkpoints(ckpt, inputs))
  builtin.append(PeriodicEval(run.datasets, program, tp.eval_interval_steps, tp.eval_steps,
                              job_log_dir))
  all_hooks = builtin + list(hooks)
  batch_size = jax.tree.leaves(global_batch.global_shapes(example))[0].shape[0]
  try:
    state, losses = run_steps(program, state, inputs, int(jax.device_get(state.step)),
                              tp.num_train_steps, batch_size, all_hooks,
                              ckpt.preempted if ckpt is not None else (lambda step: False))
  finally:
    for h in all_hooks:
      h.close()
  return state, program, losses
