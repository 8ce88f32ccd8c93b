"""lm-evaluation-harness during training: `task.train.lm_eval_tasks` scored every
`task.train.lm_eval_every_n_steps` steps on the live train state.

`PeriodicLmEval` is a train-loop hook (`run.hooks.Hook`): it scores with the params the
loop just updated, on the train program's own mesh and layout (no checkpoint is read or
written for it), through the code `--mode=lm_eval` runs (`harness.tasks`: the same
backend, `evaluate` and `write`), so step N's `lm_eval/results_step<N>.json`, samples,
TensorBoard scalars (`summaries/lm_eval`) and console lines are those `--mode=lm_eval
--restore_step=N` gives on step N's checkpoint. Every process runs the eval (each feeds its
share of the rows); process 0 writes; goodput counts the time as `eval`. The tasks are
found when the hook is made, so a bad name stops the job before its first step.

A pipelined train program (`task.pipeline`) holds its stack in another layout than the
scorer's: that is a ConfigError here (score its checkpoints with --mode=lm_eval).
"""
from spmdtask.errors import ConfigError
from spmdtask.harness import tasks
from spmdtask.run.hooks import Hook

_FIELD = "task.train.lm_eval_batch_size"


class PeriodicLmEval(Hook):
  """Scores `options.tasks` every `every` steps with the live params (module doc)."""

  def __init__(self, run, text, options: tasks.Options, every: int, job_log_dir: str):
    if run.task.pipeline is not None:
      raise ConfigError(
          "task.train.lm_eval_every_n_steps scores the live params with the scanned "
          "(unpipelined) model, and this task trains under "
          f"task.pipeline={type(run.task.pipeline).__name__}. Set "
          "task.train.lm_eval_every_n_steps=0 and score the checkpoints with --mode=lm_eval "
          "--restore_step=N instead.")
    self.run, self.text, self.options, self.every = run, text, options, every
    self.job_log_dir = job_log_dir
    self.manager = tasks.find_tasks(options.tasks, options.include_path)
    self.make_lm = self.record = None

  def attach(self, program, record):
    # The batch size is checked here, before the first step, against the program's mesh.
    self.make_lm = tasks.lm_for(self.run, program, self.text, self.options.batch_size, _FIELD)
    self.record = record

  def wants_metrics(self, step, last):
    return step % self.every == 0  # (a sync before the eval: its time is not the steps')

  def after_step(self, step, state, last):
    if step % self.every == 0:
      with self.record.phase("eval"):  # (goodput: not a step's time)
        tasks.score_and_write(self.make_lm(state.params), self.options, self.manager,
                              self.job_log_dir, step)
