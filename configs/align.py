"""Alignment experiments: DPO on preference pairs (`spmdtask.objectives.dpo`)."""
import functools

import fiddle as fdl
import optax

from configs.finetune import Llama31_8B_Lora
from configs.lm import tiny_model
from spmdtask.experiment import Experiment
from spmdtask.inputs.preferences import PreferenceInput, SyntheticPairInput
from spmdtask.objectives.dpo import Dpo
from spmdtask.registry import register
from spmdtask.task import Task, TrainParams


def pair_data(data_dir: str, synthetic, prepared) -> object:
  """Preference pairs: `prepared(data_dir=data_dir)` (a PreferenceInput partial) where
  `data_dir` is set (--data_dir sets it), else `synthetic` (a built input)."""
  return prepared(data_dir=data_dir) if data_dir else synthetic


@register
class TinyLmDpo(Experiment):
  """TinyLm (1.05M params) trained with DPO (sigmoid, beta 0.1). With no data dir the pairs
  are synthetic (the chosen completion counts on from the prompt, the rejected one is
  random); `--data_dir=DIR` (tools/prepare_pref_data.py) reads DIR's pairs (set
  task.model.vocab_size to its meta.json's). The reference is the policy's starting params
  (the fresh init, or task.train.init_checkpoint_dir's)."""
  group = "tiny"
  batch_size = 8  # pairs
  seq_len = 32

  @functools.cache  # one config per instance: the datasets share its model config
  def task(self) -> fdl.Config[Task]:
    train = fdl.Config(TrainParams, num_train_steps=20, learning_rate=1e-3,
                       optimizer=fdl.Partial(optax.adamw, b2=0.95, weight_decay=0.0),
                       log_interval_steps=5)
    return fdl.Config(Task, model=tiny_model(), ici_mesh_shape=(-1, 1, 1), train=train,
                      objective=fdl.Config(Dpo, beta=0.1))

  def datasets(self) -> dict[str, fdl.Config]:
    """'train' is endless; 'eval' 2 batches."""
    model = self.task().model
    return {split: fdl.Config(
        pair_data, data_dir="",
        synthetic=fdl.Config(SyntheticPairInput, batch_size=self.batch_size,
                             seq_len=self.seq_len, vocab_size=256, seed=seed,
                             num_batches=None if split == "train" else 2),
        prepared=fdl.Partial(PreferenceInput, split=split, batch_size=self.batch_size,
                             seq_len=self.seq_len, model=model,
                             objective=self.task().objective,
                             num_batches=None if split == "train" else 2))
        for split, seed in (("train", 1), ("eval", 2))}


@register
class TinyLmDpoFsdpTp(TinyLmDpo):
  """TinyLmDpo on 8 devices: data 2 x fsdp 2 x model 2."""

  @functools.cache
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.ici_mesh_shape = (2, 2, 2)
    return cfg


@register
class Llama31_8B_Dpo(Llama31_8B_Lora):
  """Llama 3.1 8B aligned with DPO (sigmoid, beta 0.1) on one v5e host
  (`--plan_topology=v5e:2x4`): LoRA rank 16 on Llama31_8B_Lora's layout (FSDP over 8, full
  remat, the frozen base in bfloat16), 8 pairs of 1024-token sequences a step (16 rows, 2
  per chip). The reference is the base with the adapters off: no second copy of the
  weights, one more forward a step. Warm-start the base (the SFT'd model) with
  --fdl_set=task.train.init_checkpoint_dir=DIR; --data_dir=DIR reads prepared pairs
  (tools/prepare_pref_data.py with the model's tokenizer, --max_len=1025)."""
  group = "align"
  batch_size = 8  # pairs
  seq_len = 1024
  peak_learning_rate = 5e-5
  num_train_steps = 500

  @functools.cache
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.objective = fdl.Config(Dpo, beta=0.1)
    return cfg

  def datasets(self) -> dict[str, fdl.Config]:
    model = self.task().model
    return {split: fdl.Config(
        pair_data, data_dir=self.data_dir or "",
        synthetic=fdl.Config(SyntheticPairInput, batch_size=self.batch_size,
                             seq_len=self.seq_len, vocab_size=model.vocab_size, seed=seed,
                             num_batches=None if split == "train" else 4),
        prepared=fdl.Partial(PreferenceInput, split=split, batch_size=self.batch_size,
                             seq_len=self.seq_len, model=model,
                             objective=self.task().objective,
                             num_batches=None if split == "train" else 4))
        for split, seed in (("train", 1), ("eval", 2))}

  def decode_datasets(self) -> dict[str, fdl.Config]:
    return {}
