"""GRPO experiments: `TinyLmGrpo` (a tiny LM learning to add, rewarded by the exact sum)
after its supervised warm start `TinyLmSumSft`, and `Llama31_8B_Grpo` (LoRA) to plan."""
import functools

import fiddle as fdl
import optax

from configs import lm
from spmdtask.experiment import Experiment
from spmdtask.inputs.answers import SumPrompts, SumSft
from spmdtask.registry import register
from spmdtask.task import Task

BYTES_VOCAB = 264  # the byte tokenizer's 257 ids (256 = end of document), rounded up to 8


@register
class TinyLmSumSft(lm.TinyLm):
  """TinyLm (byte vocabulary) fine-tuned briefly on 'a+b=' -> the sum and an end byte
  (only those tokens are targets): TinyLmGrpo's warm start."""
  batch_size = 32
  seq_len = 8

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.model.vocab_size = BYTES_VOCAB
    cfg.train.num_train_steps = 60
    cfg.train.learning_rate = 3e-3
    cfg.train.save_interval_steps = 60
    return cfg

  def datasets(self) -> dict[str, fdl.Config]:
    return {"train": fdl.Config(SumSft, batch_size=self.batch_size, seq_len=self.seq_len),
            "eval": fdl.Config(SumSft, batch_size=self.batch_size, seq_len=self.seq_len,
                               seed=2, num_examples=128)}

  def decode_datasets(self) -> dict[str, fdl.Config]:
    return {}
