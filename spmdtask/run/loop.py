"""The train loop: steps driven one by one, with small hooks for everything around them.

The loop only feeds batches, runs `program.train` and fetches metrics when a hook asks for
them (a host sync, so only then). Around the steps, each concern (progress, summaries,
checkpoints, evaluation, profiling, the NaN guard) is a `Hook`, not a longer loop.
"""
import contextlib
import dataclasses
import functools
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp

from spmdtask.run import (checkpoints, evaluation, goodput, goodput_events, interrupts,
                          local_tier, peers, reference, rollout, summaries, throughput)
from spmdtask.run.hooks import Fetched, Hook  # pylint: disable=unused-import  # the loop's API
from spmdtask import console, fs
from spmdtask.core import global_batch, mesh as mesh_lib, steps
from spmdtask.core import host_input as inputs_base, program as program_lib
from spmdtask.errors import ConfigError, Interrupted, TrainingError
from spmdtask.plan import chips
from spmdtask.task import RunConfig


class ProgressLog(Hook):
  """Every `every` steps process 0 prints step, loss, model metrics, s/step, tokens/s, MFU, ETA.

  Times are averaged over the steps since the last line; the first line's include
  compiling the step, so its ETA is pessimistic. MFU is against `peak` per device and
  counts every token processed; with `targets` (data with target masks) the line also
  gives target tokens/s, the tokens the loss trains on.
  """

  def __init__(self, every: int, num_train_steps: int, peak: chips.Peak, targets: bool = False):
    self.every, self.num_steps, self.peak = max(1, every), num_train_steps, peak
    self.targets = targets
    self._first = True

  def wants_metrics(self, step, last):
    return last or step % self.every == 0

  def on_metrics(self, fetched, last):
    r = fetched.rates
    step_time = 1.0 / r["steps_per_sec"]
    others = "".join(f"  {k} {v:.4g}" for k, v in steps.model_metrics(fetched.metrics[-1]))
    targets = (f" ({console.human_count(r['target_tokens_per_sec'])} target)" if self.targets
               else "")
    console.say("step %d/%d  loss %.4f%s  %.3f s/step%s  %s tokens/s%s  MFU %.1f%% of %s  ETA %s",
                fetched.step, self.num_steps, fetched.metrics[-1]["loss"], others, step_time,
                " (incl. compile)" if self._first else "",
                console.human_count(r["tokens_per_sec"]), targets, 100 * r["mfu"],
                self.peak.figure(),
                console.duration((self.num_steps - fetched.step) * step_time))
    self._first = False


class NonFiniteGuard(Hook):
  """Stops training at the first non-finite loss or gradient norm, before it is saved.

  It asks for the metrics at every step where a checkpoint may be saved (and every
  `every` steps, and the last), sees every step since the previous fetch, and runs
  before the `Checkpoints` hook, so a non-finite state is never saved: the latest
  checkpoint stays the last good one. Raises `TrainingError`.
  """

  def __init__(self, every: int, saves, task, last_good=lambda: (None, False)):
    self.every, self.saves, self.task, self.last_good = max(1, every), saves, task, last_good

  def wants_metrics(self, step, last):
    return last or step % self.every == 0 or self.saves(step)

  def on_metrics(self, fetched, last):
    first = fetched.step - len(fetched.metrics) + 1
    for i, m in enumerate(fetched.metrics):
      bad = {k: m[k] for k in ("loss", "grad_norm") if k in m and not math.isfinite(m[k])}
      if bad:
        raise TrainingError(non_finite_message(first + i, bad, self.task, *self.last_good()))

  def after_step(self, step, state, last):
    # A step's metrics describe the params it started from; the state it leaves behind is
    # checked here, right before the Checkpoints hook would save it.
    if (last or self.saves(step)) and not _all_finite(state):
      raise TrainingError(non_finite_message(
          step, {"updated train state": "not finite"}, self.task, *self.last_good()))


def _all_finite(tree) -> bool:
  """Every floating leaf finite. Leaves are checked per device set: an MPMD state lives on
  several submeshes, and one program cannot take arrays from different devices. (With
  several MPMD processes each checks the stages it holds; the loss and gradient norm,
  checked on every process, catch a divergence first.)"""
  groups = {}
  for x in jax.tree.leaves(tree):
    if jnp.issubdtype(x.dtype, jnp.inexact):
      groups.setdefault(frozenset(x.sharding.device_set), []).append(x)
  return all(bool(_finite(xs, tuple(mesh_lib.spread(x) for x in xs))) for xs in groups.values())


@functools.partial(jax.jit, static_argnums=1)
def _finite(xs, spreads) -> jax.Array:
  """Each leaf checked as `mesh_lib.spread` lays it out: a replica's check split among the
  devices that hold it."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(
      x if s is None else jax.lax.with_sharding_constraint(x, s))) for x, s in zip(xs, spreads)]))


def non_finite_message(step: int, bad: dict, task, last_good: int | None, checked=False) -> str:
  """The one paragraph a diverged run ends with: the step, what diverged, the knobs."""
  tp = task.train
  lr = tp.learning_rate if isinstance(tp.learning_rate, (int, float)) else "a schedule"
  dtype = getattr(task.model, "fprop_dtype", None)
  what = " and ".join(f"the {k.replace('_', ' ')} is {v}" for k, v in bad.items())
  kept = ("no checkpoint was written" if last_good is None else
          f"the latest checkpoint, step {last_good}, is the last good one" if checked else
          f"the latest checkpoint, step {last_good}, has no fingerprints: its bytes are unchecked")
  return (f"Training stopped at step {step}: {what}. Nothing from that step was saved; {kept}. "
          f"Usual causes: a learning rate too high (task.train.learning_rate={lr}: lower it or "
          f"warm it up), loose or no gradient clipping (task.train.clip_grad_norm="
          f"{tp.clip_grad_norm}: try 1.0 or lower)"
          + (f", low-precision compute (task.model.fprop_dtype={dtype!r}: try 'float32')"
             if dtype not in (None, "float32") else "")
          + ", or bad data at that step. Fix the config and rerun with the same --job_log_dir "
          f"to resume from the {'last good' if checked else 'latest'} checkpoint.")


class Profiler(Hook):
  """Process 0 traces steps start .. start+count-1 with `jax.profiler` into `directory`.

  Steps are numbered as the progress lines number them (step 1 is the first). The trace
  (an .xplane.pb for TensorBoard's profile plugin and a perfetto_trace.json.gz) lands in
  `directory/plugins/profile/<run>/` (for a gs:// directory: traced locally, uploaded, the
  local copy deleted).
  """

  def __init__(self, directory: str, start: int, count: int):
    self.directory, self.start, self.stop = directory, start, start + count - 1
    self.active, self._staged = False, None

  def _maybe_start(self, done: int) -> None:
    if not self.active and done + 1 == self.start and jax.process_index() == 0:
      self._staged = fs.Staged(self.directory, "spmdtask_profile_")
      jax.profiler.start_trace(self._staged.local, create_perfetto_trace=True)
      self.active = True

  def begin(self, step):
    self._maybe_start(step)

  def after_step(self, step, state, last):
    if self.active and (step >= self.stop or last):
      jax.block_until_ready(state)
      self._end()
      console.say("Profiled steps %d-%d: trace in %s", self.start, step, self.directory)
    else:
      self._maybe_start(step)

  def _end(self):
    if self.active:
      jax.profiler.stop_trace()
      self._staged.close()
      self.active = False

  def close(self):
    self._end()


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
  """Saves at each tier's interval, at the last step and on a stop before `num_steps`
  (preemption, Ctrl-C: the fastest tier)."""

  def __init__(self, ckpt: checkpoints.Checkpointer, feed, num_steps: int):
    self.ckpt, self.feed, self.num_steps = ckpt, feed, num_steps

  def after_step(self, step, state, last):
    if last or self.ckpt.should_save(step):
      self.ckpt.save(step, state, self.feed.input_state(), last=last,
                     stop=last and step < self.num_steps)

  def close(self):
    self.ckpt.close()


class PeriodicEval(Hook):
  """Evaluates every eval dataset every `every` steps (summaries, eval_metrics.jsonl)."""

  def __init__(self, datasets, program, every: int, eval_steps, job_log_dir, record):
    self.datasets, self.program, self.every = datasets, program, every
    self.eval_steps, self.job_log_dir, self.record = eval_steps, job_log_dir, record

  def after_step(self, step, state, last):
    if self.every and step % self.every == 0:
      with self.record.phase("eval"):
        evaluation.evaluate_all(self.datasets, self.program, state, step, self.eval_steps,
                                self.job_log_dir)


def run_steps(program: program_lib.Program, state, feed, first: int, last_step: int,
              batch_size: int, hooks: Sequence[Hook], stop=lambda step: None,
              targets: bool = False):
  """Runs steps first+1 .. last_step, or until `stop(step)` gives a reason (a step that
  then counts as the last: metrics fetched, saved). `feed.step(state) -> (state, metrics)`
  runs one step (`rollout.feed`: a batch of the train input, or GRPO's rollout).
  `targets`: the data has target masks (the rates then count target tokens). Returns
  (state, losses of the steps run, the stop reason or None). The rates of a fetch time the
  steps since the previous one, from after that step's hooks ran: a hook that takes long
  (an eval) asks for the metrics at its step, so its time is no step's."""
  losses, pending, reason = [], [], None
  for h in hooks:
    h.begin(first)
  t0 = time.perf_counter()
  for step in range(first, last_step):
    state, metrics = feed.step(state)
    pending.append(metrics)
    done = step + 1
    reason = stop(done)
    last = done == last_step or reason is not None
    synced = any(h.wants_metrics(done, last) for h in hooks)
    if synced:
      values = [{k: float(v) for k, v in m.items()} for m in jax.device_get(pending)]
      fetched = Fetched(done, values, throughput.rates(
          program, len(pending), time.perf_counter() - t0, batch_size,
          sum(m["target_tokens"] for m in values) if targets else None))
      losses.extend(m["loss"] for m in values)
      for h in hooks:
        if h.wants_metrics(done, last):
          h.on_metrics(fetched, last)
      pending = []
    for h in hooks:
      h.after_step(done, state, last)
    if synced:  # the next window starts after this step's hooks (an eval, a save's
      t0 = time.perf_counter()  # blocking part): the rates time the steps alone
    if reason is not None:
      break
  return state, losses, reason


def hooks_for(run: RunConfig, program: program_lib.Program, ckpt, job_log_dir, feed,
              record: goodput_events.Recorder = goodput_events.OFF) -> list[Hook]:
  """The built-in hooks, in the order they must run (the guard before any save); `feed`
  (`rollout.feed`'s) gives the saves the train input's position."""
  tp = run.task.train
  hooks: list[Hook] = [
      goodput_events.LoopSteps(record),
      NonFiniteGuard(tp.log_interval_steps,
                     ckpt.should_save if ckpt is not None else (lambda step: False), run.task,
                     ckpt.latest_checked if ckpt else (lambda: (None, False))),
      ProgressLog(tp.log_interval_steps, tp.num_train_steps, throughput.mfu_peak(program),
                  inputs_base.target_masked(run.datasets["train"])),
      TrainSummaries(job_log_dir, tp.summary_interval_steps)]
  if tp.profile_steps is not None and job_log_dir is not None:
    hooks.append(Profiler(fs.join(job_log_dir, "profile"), *tp.profile_steps))
  if ckpt is not None:
    hooks.append(Checkpoints(ckpt, feed, tp.num_train_steps))
  hooks.append(PeriodicEval(run.datasets, program, tp.eval_interval_steps, tp.eval_steps,
                            job_log_dir, record))
  return hooks


_FINISHED = "finished before it started"


def _resume_and_run(run: RunConfig, program, ckpt, restore_step, config_text, batch_size,
                    hooks, job_log_dir, record):
  """The start state (restored, warm-started or fresh), then the steps to num_train_steps.

  Returns (state, losses of the steps run, why the steps stopped early: None, an
  `interrupts` reason, or _FINISHED when the checkpoint is already at num_train_steps).
  """
  tp = run.task.train
  inputs = run.datasets["train"]
  state = checkpoints.initial_state(ckpt, program, inputs, restore_step, tp.init_checkpoint_dir,
                                   tp.init_adapters)
  first = int(jax.device_get(state.step))
  if job_log_dir is not None and config_text is not None and jax.process_index() == 0:
    fs.write_text(fs.join(job_log_dir, "config.txt"), config_text)
  rollout.note_reward_files(run.task.objective, job_log_dir, first)
  if first >= tp.num_train_steps:
    console.say("Nothing to do: this job's checkpoint is at step %d and "
                "task.train.num_train_steps=%d, so training is finished. Raise num_train_steps "
                "to train on.", first, tp.num_train_steps)
    return state, [], _FINISHED
  console.say("%s at step %d; training to step %d.",
              "Resuming from the checkpoint" if first else "Starting", first, tp.num_train_steps)
  feed = rollout.feed(run, program, record)
  all_hooks = hooks_for(run, program, ckpt, job_log_dir, feed, record) + list(hooks)
  for h in all_hooks:
    h.attach(program, record)
  stop = (interrupts.StopRequest(jax.process_count(), ckpt.reached_preemption)
          if ckpt is not None else None)
  with stop or contextlib.nullcontext():
    try:
      return run_steps(program, state, feed, first,
                       tp.num_train_steps, batch_size, all_hooks, stop or (lambda step: None),
                       inputs_base.target_masked(inputs))
    except Exception as e:  # pylint: disable=broad-except  # the hooks' saves would wait for it
      peers.stop_if_lost(e)
      raise
    finally:
      for h in all_hooks:
        h.close()  # the last save is committed here


def train(run: RunConfig, job_log_dir: str | None = None, restore_step: int | None = None,
          config_text: str | None = None, hooks: Sequence[Hook] = (), devices=None,
          name: str = "experiment", started: float | None = None):
  """Trains `run.task` on `run.datasets['train']` for `num_train_steps`.

  Prints a start summary and progress every `log_interval_steps` (process 0). With
  `job_log_dir`: resumes from its latest complete checkpoint (or `restore_step`), else
  warm-starts from `task.train.init_checkpoint_dir`; a job already at `num_train_steps`
  says so and trains nothing; writes `config.txt` (the `config_text`) once the start
  state is known; saves checkpoints every `save_interval_steps` and at the end; writes
  TensorBoard scalars every `summary_interval_steps`; evaluates every eval dataset every
  `eval_interval_steps`; traces `profile_steps`; on SIGTERM or the multi-host preemption
  sync point, saves at the current step and returns early; on Ctrl-C (with the binary's
  `interrupts.watch()`), saves at the current step and raises `Interrupted`. A non-finite
  loss or gradient norm raises `TrainingError` before that state is saved. `hooks` run after
  the built-in ones. `devices`: the devices of the mesh (default: all). With `job_log_dir`,
  process 0 records where the run's time goes from `started` (Unix time; default now) in
  `goodput/` and ends with the job's goodput line (`run.goodput`).
  Returns (final live state, program, losses of the steps run here, as floats).
  """
  record = goodput_events.Recorder(job_log_dir, started)
  try:
    with peers.before_exit(lambda: record.close("lost process")):  # its time up to the line
      return _train(run, job_log_dir, restore_step, config_text, hooks, devices, name, record)
  except ConfigError:
    record.close("config error", keep=False)  # a user's mistake leaves nothing on disk
    raise
  finally:
    record.close("error")  # where no other end was recorded: an exception


def _train(run, job_log_dir, restore_step, config_text, hooks, devices, name, record):
  t_start = time.perf_counter()
  task, tp = run.task, run.task.train
  example = rollout.example(run)  # GRPO: the shape of a rollout's batch
  # An objective's frozen reference (e.g. DPO's) is fixed by the config, never the state.
  program = reference.attach(task, program_lib.setup(task, example, devices))
  batch_size = jax.tree.leaves(global_batch.global_shapes(example))[0].shape[0]
  # Each process's inputs read what the program asks of them (e.g. MPMD: its stages' leaves).
  run = dataclasses.replace(run, datasets=inputs_base.reading_all(run.datasets,
                                                                  program.input_share()))
  for line in throughput.start_summary(program, name, batch_size, job_log_dir):
    console.say("%s", line)
  ckpt = None
  if job_log_dir is not None:
    local = (local_tier.LocalTier(tp.local_checkpoint_dir, job_log_dir,
                                  tp.local_save_interval_steps, tp.local_max_to_keep,
                                  task.dcn_sizes())
             if tp.local_checkpoint_dir else None)
    ckpt = checkpoints.Checkpointer(job_log_dir, program, tp.save_interval_steps,
                                    tp.max_to_keep, {"config": config_text or ""}, record,
                                    local)
  try:  # the manager is closed on every way out (its threads outlive an error otherwise)
    state, losses, reason = _resume_and_run(run, program, ckpt, restore_step, config_text,
                                            batch_size, hooks, job_log_dir, record)
  finally:
    if ckpt is not None:
      ckpt.close()
  if reason == _FINISHED:
    record.close("finished", keep=False)  # nothing trained: not a run of the job's account
    return state, program, []
  end = int(jax.device_get(state.step))
  if reason == interrupts.INTERRUPTED:
    goodput.finish(record, job_log_dir, reason, end)
    raise Interrupted(end)
  if reason == interrupts.PREEMPTED:
    console.say("Preempted: saved a checkpoint at step %d; exiting. Rerun the same command to "
                "resume.", end)
    goodput.finish(record, job_log_dir, reason, end)
    return state, program, losses
  console.say("Done at step %d (loss %.4f) in %s%s.", end, losses[-1] if losses else math.nan,
              console.duration(time.perf_counter() - t_start),
              f"; checkpoint in {ckpt.directory}" if ckpt is not None else "")
  goodput.finish(record, job_log_dir, "done", end)
  return state, program, losses
