"""The one error type for user mistakes in an experiment's config or flags."""


class ConfigError(ValueError):
  """A config field or flag is wrong.

  The message is one paragraph that names the field and says how to fix it.
  `spmdtask.main` prints it without a traceback and exits with status 2.
  """


class BatchSplitError(ConfigError):
  """A batch array dim that does not divide over its mesh axes (`dim`, `size`, `shards`)."""

  def __init__(self, message: str, dim: int, size: int, shards: int):
    super().__init__(message)
    self.dim, self.size, self.shards = dim, size, shards


class CheckpointUnreadable(ConfigError):
  """A checkpoint of --job_log_dir that cannot be read (`step`); `intact_step` is the newest
  earlier one that can (None: none). `spmdtask.main` adds the command that restores it."""

  def __init__(self, message: str, step: int, intact_step: int | None):
    super().__init__(message)
    self.step, self.intact_step = step, intact_step


class TrainingError(RuntimeError):
  """Training cannot go on (e.g. the loss became NaN); the message says why and what to try.

  `spmdtask.main` prints it without a traceback and exits with status 3.
  """


class PlanExceeded(RuntimeError):
  """`--mode=plan --device_memory_gib=X`: the estimate exceeds X; names the largest consumers.

  `spmdtask.main` prints it without a traceback and exits with status 4.
  """


class Interrupted(RuntimeError):
  """Ctrl-C during training: the current step was saved (`step`); a rerun resumes there.

  `spmdtask.main` prints one line and exits with status 130.
  """

  def __init__(self, step: int):
    super().__init__(f"Interrupted at step {step}: saved; rerun the same command to resume.")
    self.step = step
