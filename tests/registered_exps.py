"""Experiments registered on import, for tests of `--exp=module.Class` lookup."""
from configs import lm
from spmdtask.registry import register


@register
class OtherLm(lm.TinyLm):
  pass


@register
class TinyLmRecords(lm.TinyLm):
  """TinyLm trained on TFRecord files (datasets['train'].file_pattern, set per run)."""

  def datasets(self):
    import fiddle as fdl  # pylint: disable=g-import-not-at-top
    from spmdtask.inputs.tfdata import TfRecordLmInput  # pylint: disable=g-import-not-at-top
    return {**super().datasets(), "train": fdl.Config(
        TfRecordLmInput, file_pattern="", batch_size=self.batch_size, seq_len=self.seq_len)}
