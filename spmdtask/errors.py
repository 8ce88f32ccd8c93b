"""The one error type for user mistakes in an experiment's config or flags."""


class ConfigError(ValueError):
  """A config field or flag is wrong.

  The message is one paragraph that names the field and says how to fix it.
  `spmdtask.main` prints it without a traceback and exits with status 2.
  """
