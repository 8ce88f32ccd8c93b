"""Experiments registered on import, for tests of `--exp=module.Class` lookup."""
from configs import lm
from spmdtask.registry import register


@register
class OtherLm(lm.TinyLm):
  pass


@register
class TinyLm(lm.TinyLm):  # a second 'TinyLm': the bare suffix becomes ambiguous
  pass
