"""GRPO experiments: `TinyLmGrpo` (a tiny LM learning to add, rewarded by the exact sum)
after its supervised warm start `TinyLmSumSft`, `LlamaGrpoImport` (an imported model on your
prompts data dir, with your rewards), and `Llama31_8B_Grpo` (LoRA) to plan."""
import functools

import fiddle as fdl
import optax

from configs import lm
from configs.finetune import _FineTune, llama31_8b, with_lora
from configs.llama import LLAMA3_EOS, LlamaImport
from spmdtask.errors import ConfigError
from spmdtask.experiment import Experiment
from spmdtask.inputs.answers import PromptData, SumPrompts, SumSft
from spmdtask.objectives.grpo import Grpo
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


@register
class TinyLmGrpo(TinyLmSumSft):
  """TinyLmSumSft's model learning to add by GRPO: 16 prompts 'a+b=' (a, b in 0..9) a step,
  8 samples each (temperature 1, at most 4 new tokens, stopping at the end byte 256),
  rewarded 1 when the completion's number is a+b (`final_answer`). Warm-start it from a
  short TinyLmSumSft run: --fdl_set=task.train.init_checkpoint_dir=DIR (docs/grpo.md)."""
  batch_size = 16

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.train.num_train_steps = 40
    cfg.train.learning_rate = 1e-3
    cfg.train.log_interval_steps = 5
    cfg.train.summary_interval_steps = 1
    cfg.train.save_interval_steps = 40
    cfg.objective = fdl.Config(Grpo, rewards=("final_answer",), num_generations=8,
                               max_new_tokens=4, temperature=1.0, eos_id=256)
    return cfg

  def datasets(self) -> dict[str, fdl.Config]:
    return {"train": fdl.Config(SumPrompts, batch_size=self.batch_size)}


def import_prompts(data_dir: str, batch_size: int, model) -> PromptData:
  """GRPO's train input for an import: the prompts data dir `data_dir` (--data_dir sets it),
  `batch_size` prompts a step."""
  if not data_dir:
    raise ConfigError("datasets['train'].data_dir is empty: GRPO samples completions of your "
                      "prompts. Pass --data_dir=DIR, a dir written by tools/prepare_prompt_data.py "
                      "--input=PROMPTS.jsonl --tokenizer=IMPORT_DIR --output_dir=DIR.")
  return PromptData(data_dir=data_dir, batch_size=batch_size, model=model)


@register
class LlamaGrpoImport(LlamaImport):
  """GRPO on an imported model (tools/convert_hf.py --from_hf; its model_overrides.txt as
  --flagfile, its dir as task.train.init_checkpoint_dir) over a prompts data dir
  (--data_dir: tools/prepare_prompt_data.py): 8 prompts a step, 4 samples each (temperature
  1, at most 64 new tokens, stopping at the data dir's stop ids: eos and the chat template's
  end-of-turn), rewarded by `--reward` (registered names or PATH.py:FN[:WEIGHT]), KL penalty
  0.04 against the starting point (init_checkpoint_dir), AdamW at 1e-6 (TRL's default)."""
  group = "align"
  batch_size = 8
  num_train_steps = 200
  peak_learning_rate = 1e-6

  @functools.cache
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.train.num_train_steps = self.num_train_steps
    cfg.train.learning_rate = self.peak_learning_rate
    cfg.train.optimizer = fdl.Partial(optax.adamw, b1=0.9, b2=0.999, weight_decay=0.0)
    cfg.train.save_interval_steps = 50
    cfg.train.log_interval_steps = 1
    cfg.train.summary_interval_steps = 1
    cfg.objective = fdl.Config(Grpo, rewards=("final_answer",), num_generations=4,
                               max_new_tokens=64, temperature=1.0, beta=0.04)
    return cfg

  def datasets(self) -> dict[str, fdl.Config]:  # no eval set: GRPO evaluates no LM loss
    return {"train": fdl.Config(import_prompts, data_dir="", batch_size=self.batch_size,
                                model=self.task().model)}


@register
class Llama31_8B_Grpo(_FineTune):
  """Llama 3.1 8B with LoRA rank 16 (Llama31_8B_Lora's model) trained by GRPO on one v5e host
  (`--plan_topology=v5e:2x4`, 8 chips of 16 GiB, FSDP over 8): 8 prompts of up to 256 tokens
  a step, 8 samples each of up to 512 new tokens (64 rows of 768 tokens), the KL reference
  the base with the adapters off (beta 0.04: no second copy of the weights), the train step
  over 8 microbatches (1 row per chip at once). The plan compiles every phase: sampling (the
  prefill and the decode loop over the 64 rows), scoring (the old log-probs) and training,
  and names each one's peak memory and time on the chip, and the RL step's (docs/grpo.md). The prompts here are synthetic sums (shapes for the plan); for real training
  set datasets['train'] to an AnswerPrompts (a JSONL of prompts and answers, the model's
  tokenizer) and warm-start the base (task.train.init_checkpoint_dir)."""
  group = "align"
  batch_size = 8
  prompt_len = 256
  peak_learning_rate = 1e-5
  num_microbatches = 8

  def model(self):
    return with_lora(llama31_8b())

  @functools.cache
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.objective = fdl.Config(Grpo, rewards=("final_answer",), num_generations=8,
                               max_new_tokens=512, temperature=1.0, eos_id=LLAMA3_EOS, beta=0.04)
    return cfg

  def datasets(self) -> dict[str, fdl.Config]:
    return {"train": fdl.Config(SumPrompts, batch_size=self.batch_size,
                                max_operand=10**6, min_prompt_len=self.prompt_len)}

  def decode_datasets(self) -> dict[str, fdl.Config]:
    return {}
