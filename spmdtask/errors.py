"""Errors that spmdtask raises for user-fixable configuration problems."""


class ConfigError(ValueError):
    """A configuration value is invalid or inconsistent with another one.

    The message is one paragraph that names the offending config field(s) by their
    full path (e.g. `model.pipeline.num_stages`) and says how to fix them.
    """
