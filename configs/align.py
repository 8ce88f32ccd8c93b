"""Alignment experiments: DPO on preference pairs (`spmdtask.objectives.dpo`)."""
import fiddle as fdl
import optax

from configs.lm import tiny_model
from spmdtask.experiment import Experiment
from spmdtask.inputs.preferences import SyntheticPairInput
from spmdtask.objectives.dpo import Dpo
from spmdtask.registry import register
from spmdtask.task import Task, TrainParams


@register
class TinyLmDpo(Experiment):
  """TinyLm (1.05M params) trained with DPO (sigmoid, beta 0.1) on synthetic pairs: the
  chosen completion counts on from the prompt, the rejected one is random. The reference is
  the policy's starting params (the fresh init, or task.train.init_checkpoint_dir's)."""
  batch_size = 8  # pairs
  seq_len = 32

  def task(self) -> fdl.Config[Task]:
    train = fdl.Config(TrainParams, num_train_steps=20, learning_rate=1e-3,
                       optimizer=fdl.Partial(optax.adamw, b2=0.95, weight_decay=0.0),
                       log_interval_steps=5)
    return fdl.Config(Task, model=tiny_model(), ici_mesh_shape=(-1, 1, 1), train=train,
                      objective=fdl.Config(Dpo, beta=0.1))

  def datasets(self) -> dict[str, fdl.Config]:
    return {"train": fdl.Config(SyntheticPairInput, batch_size=self.batch_size,
                                seq_len=self.seq_len, vocab_size=256, seed=1),
            "eval": fdl.Config(SyntheticPairInput, batch_size=self.batch_size,
                               seq_len=self.seq_len, vocab_size=256, seed=2, num_batches=2)}


@register
class TinyLmDpoFsdpTp(TinyLmDpo):
  """TinyLmDpo on 8 devices: data 2 x fsdp 2 x model 2."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.ici_mesh_shape = (2, 2, 2)
    return cfg
