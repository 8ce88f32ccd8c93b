"""The one error type for user mistakes in an experiment's config or flags, and the command
lines and paragraphs those messages give (a rerun, a restore, a flag absl cannot parse)."""
import re
import shlex


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


def restore_command(argv: list[str], step: int) -> str:
  """This run's command line with --restore_step=`step` in place of any given."""
  return f"{rerun_command(argv)} --restore_step={step}"


def rerun_command(argv: list[str]) -> str:
  """This run's command line without any --restore_step (a rerun resumes the newest)."""
  args, skip = [], False
  for a in argv[1:]:
    if skip or a.startswith("--restore_step="):
      skip = False
      continue
    if a == "--restore_step":  # absl also takes `--flag value`
      skip = True
      continue
    args.append(a)
  return shlex.join(["python", "-m", "spmdtask.main", *args])


def flag_error(error: Exception) -> str:
  """The paragraph for a flag absl cannot parse (a value not among an enum's names, a
  malformed number, an unknown flag)."""
  enum = re.match(r"flag --(\w+)=(.*): value should be one of <(.*)>$", str(error))
  if enum:
    name, value, choices = enum.group(1), enum.group(2), enum.group(3).split("|")
    return (f"--{name}={value!r} is not one of its values: {', '.join(choices)}. Pass one of "
            f"them, e.g. --{name}={choices[0]} (--helpshort describes each).")
  text = str(error).strip().replace(" ?", "?")
  return (f"{text}{'' if text.endswith(('.', '?')) else '.'} Fix or remove that flag; python -m "
          "spmdtask.main --helpshort lists every flag with its values.")
