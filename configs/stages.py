"""Stages that chain for any imported model: `stages.Sft`, `stages.Dpo`, `stages.Grpo`.

Each is one experiment for every family tools/convert_hf.py imports (Llama, Qwen3, Gemma 3,
Mixtral, Qwen3-MoE, DeepSeek-V2/V3): `--init_from=DIR` (an import's job dir, or a previous
stage's) gives its family and model fields (DIR's model_overrides.txt) and its start
(task.train.init_checkpoint_dir); `--flagfile=IMPORT/model_overrides.txt` gives the same
model without the start. Full fine-tuning by default; `--lora_rank=R` trains new adapters
(on a LoRA start: on its merged weights). Each stage's job dir then holds the
model_overrides.txt of the stage after it (spmdtask/overrides.py: `Start`).

    python -m spmdtask.main --exp=stages.Sft --init_from=IMPORT --job_log_dir=RUN/sft \\
        --data_dir=CHAT_DATA --lora_rank=8
    python -m spmdtask.main --exp=stages.Dpo --init_from=RUN/sft --job_log_dir=RUN/dpo \\
        --data_dir=PREF_DATA --lora_rank=8

DPO's and GRPO's reference is where the stage starts (the start's params; with LoRA, the
model with its new adapters off: the start merged); task.objective.reference_checkpoint_dir
names another job (full models). The recipe (spmdtask/recipe.py) runs stages in order.
"""
import functools

import fiddle as fdl
import optax

from configs.align import pair_data
from configs.grpo import import_prompts
from spmdtask import registry
from spmdtask.errors import ConfigError
from spmdtask.experiment import Experiment
from spmdtask.hf import families
from spmdtask.inputs.preferences import PreferenceInput, SyntheticPairInput
from spmdtask.layers import lm_checks
from spmdtask.layers.lora import LoraConfig
from spmdtask.objectives import dpo, grpo
from spmdtask.task import Task

class _Stage(Experiment):
  """A stage over a family's import experiment (`for_family`): a cosine decay from
  `peak_learning_rate` over num_train_steps (set task.train.learning_rate.decay_steps with
  it), AdamW without weight decay, a checkpoint every
  `save_interval_steps` and at the end."""
  num_train_steps = 100
  peak_learning_rate = 1e-4
  save_interval_steps = 50

  def for_family(self, family: str | None) -> Experiment:
    """`experiment.ForFamily`: this stage on `family`'s model."""
    name = f"stages.{type(self).__name__}"
    if family is None:
      raise ConfigError(
          f"--exp={name} trains an imported model, and none is named: give --init_from=DIR "
          "(the job dir of an import, tools/convert_hf.py --from_hf, or of the stage before) "
          "or --flagfile=IMPORT/model_overrides.txt.")
    if family not in families.BY_TYPE:
      raise ConfigError(f"--family={family!r} is not a family the stages know; they build "
                        f"{', '.join(sorted(families.BY_TYPE))} models (an import's "
                        "model_overrides.txt names its family).")
    # The import experiment whose model the family's override lines set.
    base = registry.get(families.BY_TYPE[family].experiment)
    return type(type(self).__name__, (type(self), base), {"family": family})()

  def with_lora(self, cfg: fdl.Config, rank: int) -> None:
    """`experiment.ForFamily`: new adapters of `rank` (alpha 2 x rank) on every weight LoRA
    can adapt in `cfg`'s model (its override lines applied), the base in float32."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
      raise ConfigError(f"--lora_rank={rank}: the adapters' rank must be >= 1 (e.g. 8 or 16); "
                        "leave the flag out to train every param.")
    targets = lm_checks.lora_weights(fdl.build(cfg.task.model))
    cfg.task.model.lora = fdl.Config(LoraConfig, rank=rank, alpha=2.0 * rank, targets=targets)

  @functools.cache  # one config per instance: the datasets share its model
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    lr, steps = self.peak_learning_rate, self.num_train_steps
    cfg.train.num_train_steps = steps
    # No warmup (TRL's default): a stage starts from trained weights, and a short one (the
    # recipe's few steps) would otherwise spend them at a learning rate near 0.
    cfg.train.learning_rate = fdl.Config(
        optax.warmup_cosine_decay_schedule, init_value=lr, peak_value=lr, warmup_steps=0,
        decay_steps=steps, end_value=lr / 10)
    cfg.train.optimizer = fdl.Partial(optax.adamw, b1=0.9, b2=0.999, weight_decay=0.0)
    cfg.train.save_interval_steps = self.save_interval_steps
    cfg.train.log_interval_steps = 10
    return cfg


@registry.register
class Sft(_Stage):
  """Supervised fine-tuning of an imported model (`--init_from=IMPORT_OR_STAGE`) on
  conversations (`--data_dir`: tools/prepare_chat_data.py with the model's tokenizer; only
  the assistant's tokens are targets); 8 rows of 128 tokens a step, 100 steps, peak learning
  rate 1e-4; `--lora_rank=R` for LoRA."""
  group = "fine-tune"
  require_target_mask = True


@registry.register
class Dpo(_Stage):
  """DPO (sigmoid, beta 0.1) of an imported or fine-tuned model (`--init_from=DIR`) on
  preference pairs (`--data_dir`: tools/prepare_pref_data.py); 8 pairs of 128 tokens a step,
  100 steps, peak learning rate 1e-5 (2e-4 is PEFT's usual for LoRA: set it with
  --fdl_set=task.train.learning_rate.peak_value=...). The reference is the start (module
  doc)."""
  group = "align"
  peak_learning_rate = 1e-5

  @functools.cache
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.objective = fdl.Config(dpo.Dpo, beta=0.1)
    return cfg

  def datasets(self) -> dict[str, fdl.Config]:
    """Prepared pairs where --data_dir names them, else synthetic pairs (plans, smoke runs)."""
    model, objective = self.task().model, self.task().objective
    return {split: fdl.Config(
        pair_data, data_dir="",
        synthetic=fdl.Config(SyntheticPairInput, batch_size=self.batch_size,
                             seq_len=self.seq_len, model=model, seed=seed,
                             num_batches=None if split == "train" else 2),
        prepared=fdl.Partial(PreferenceInput, split=split, batch_size=self.batch_size,
                             seq_len=self.seq_len, model=model, objective=objective,
                             num_batches=None if split == "train" else 4))
        for split, seed in (("train", 1), ("eval", 2))}


@registry.register
class Grpo(_Stage):
  """GRPO of an imported or fine-tuned model (`--init_from=DIR`) on your prompts
  (`--data_dir`: tools/prepare_prompt_data.py with the model's tokenizer, its chat template
  and stop ids): 8 prompts a step, 4 samples each of up to 64 new tokens (temperature 1),
  rewarded by `--reward` (registered names or PATH.py:FN[:WEIGHT]; default `final_answer`),
  KL to the start (beta 0.04); 50 steps, peak learning rate 1e-5."""
  group = "align"
  num_train_steps = 50
  peak_learning_rate = 1e-5

  @functools.cache
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.train.log_interval_steps = 1
    cfg.objective = fdl.Config(grpo.Grpo, rewards=("final_answer",), num_generations=4,
                               max_new_tokens=64, temperature=1.0, beta=0.04)
    return cfg

  def datasets(self) -> dict[str, fdl.Config]:
    return {"train": fdl.Config(import_prompts, data_dir="", batch_size=self.batch_size,
                                model=self.task().model)}
