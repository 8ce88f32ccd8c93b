"""Fine-tunes of published models on one slice: `--exp=Llama31_8B_Lora` etc.

Each starts from the base's weights (warm start: --fdl_set=task.train.init_checkpoint_dir=DIR,
e.g. a checkpoint tools/convert_hf.py --from_hf made) and is sized for the slice its
docstring names; plan it there (`--mode=plan --plan_topology=...`). Full fine-tunes train
every weight; LoRA ones (layers/lora.py) only adapters beside a frozen bfloat16 base.
"""
import functools

import fiddle as fdl
import optax

from configs.deepseek import DeepSeekImport
from configs.gemma3 import Gemma3Import
from configs.llama import LLAMA3_VOCAB, LLAMA31_SCALING, LlamaImport, _Llama, llama_model
from configs.moe import MoeImport, Mixtral_8x7B
from configs.qwen3 import Qwen3Import
from spmdtask.layers.lora import LoraConfig
from spmdtask.layers.transformer import TransformerLm
from spmdtask.registry import register
from spmdtask.task import Task


def llama31_8b() -> fdl.Config[TransformerLm]:
  """Llama 3.1 8B's architecture (as Llama31_8B_V6e256's)."""
  return llama_model(vocab_size=LLAMA3_VOCAB, d_model=4096, num_layers=32, num_heads=32,
                     num_kv_heads=8, d_ff=14336, max_seq_len=131072, rope_theta=500000.0,
                     rope_scaling=LLAMA31_SCALING)


def with_lora(cfg: fdl.Config[TransformerLm], rank: int = 16,
              base_quantization: str | None = None) -> fdl.Config[TransformerLm]:
  """`cfg` with LoRA adapters (alpha 2 x rank) on every attention and MLP weight, the
  frozen base stored in bfloat16 (layers.lora); with `base_quantization` (QLoRA,
  layers.qlora) those weights' base stored quantized in groups of 64, QLoRA's."""
  cfg.lora = fdl.Config(LoraConfig, rank=rank, alpha=2.0 * rank,
                        targets=("q", "k", "v", "o", "wi", "wg", "wo"), base_dtype="bfloat16",
                        base_quantization=base_quantization, group_size=64)
  return cfg


def llama31_70b() -> fdl.Config[TransformerLm]:
  """Llama 3.1 70B's architecture."""
  return llama_model(vocab_size=LLAMA3_VOCAB, d_model=8192, num_layers=80, num_heads=64,
                     num_kv_heads=8, d_ff=28672, max_seq_len=131072, rope_theta=500000.0,
                     rope_scaling=LLAMA31_SCALING)


class _FineTune(_Llama):
  """A fine-tune on one slice: a short cosine schedule from `peak_learning_rate`. Warm-start
  the base with --fdl_set=task.train.init_checkpoint_dir=DIR (tools/convert_hf.py
  --from_hf makes one)."""
  group = "fine-tune"
  num_train_steps = 1000

  @functools.cache
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    lr = self.peak_learning_rate
    cfg.train.num_train_steps = self.num_train_steps
    cfg.train.learning_rate.warmup_steps = 50
    cfg.train.learning_rate.decay_steps = self.num_train_steps
    cfg.train.learning_rate.end_value = lr / 10
    cfg.train.optimizer = fdl.Partial(optax.adamw, b1=0.9, b2=0.999, weight_decay=0.0)
    cfg.train.save_interval_steps = 200
    return cfg


@register
class Llama31_8B_Sft(_FineTune):
  """Llama 3.1 8B, full fine-tune on one v5e host (`--plan_topology=v5e:2x4`, 8 chips of
  16 GiB): FSDP over 8, 8 rows × 2048 tokens a step (1 row per chip), full remat, and
  Adafactor (factored second moments, no first: a few MiB of state). With AdamW the float32
  params and two moments (12 bytes a param, 11.2 GiB per chip) plus the step's 17.0 GiB of
  temporaries do not fit the chip (the plan says so)."""
  batch_size = 8
  seq_len = 2048
  peak_learning_rate = 1e-5

  def model(self):
    return llama31_8b()

  @functools.cache
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.train.optimizer = fdl.Partial(optax.adafactor, min_dim_size_to_factor=128)
    return cfg


@register
class Llama31_8B_Lora(_FineTune):
  """Llama31_8B_Sft's model and batch (8 × 2048 tokens on v5e:2x4: FSDP over 8, full remat)
  with LoRA rank 16 on every attention and MLP weight: the frozen base in bfloat16 (2 bytes
  a param, 1.9 GiB per chip), 42M adapters with their AdamW state."""
  batch_size = 8
  seq_len = 2048
  peak_learning_rate = 2e-4

  def model(self):
    return with_lora(llama31_8b())


@register
class Llama31_70B_Lora(_FineTune):
  """Llama 3.1 70B with LoRA rank 16 on every attention and MLP weight on v5e-64
  (`--plan_topology=v5e:8x8`): the frozen base in bfloat16 (2.1 GiB per chip), FSDP over
  64, 64 rows × 2048 tokens a step (1 row per chip), full remat."""
  batch_size = 64
  seq_len = 2048
  peak_learning_rate = 2e-4

  def model(self):
    return with_lora(llama31_70b())


@register
class Llama31_8B_QLora(Llama31_8B_Lora):
  """Llama 3.1 8B QLoRA on one v5e chip (`--plan_topology=v5e:1x1`, 16 GiB): LoRA rank 16
  on every attention and MLP weight, their base stored in nf4 (groups of 64, bfloat16
  scales: 0.53 bytes a weight), the embedding, head and norms in bfloat16 (as bitsandbytes
  keeps them); 2 rows x 2048 tokens a step, full remat: the plan's peak is 12.9 GiB of
  the chip's 16, a step ~1.7 s."""
  batch_size = 2

  def model(self):
    return with_lora(llama31_8b(), base_quantization="nf4")


@register
class Llama31_70B_QLora(Llama31_70B_Lora):
  """Llama 3.1 70B QLoRA on one v5e host (`--plan_topology=v5e:2x4`, 8 chips of 16 GiB):
  Llama31_70B_Lora's adapters, their base stored in nf4 (groups of 64, bfloat16 scales),
  FSDP over 8 gathering the packed codes; 8 rows x 2048 tokens a step (1 per chip), full
  remat. Its frozen base is 4.7 GiB a chip (0.29x a bfloat16 base's 16.4); the plan's
  peak is 14.1 GiB of the chip's 16 (7.8 GiB of temporaries), a step ~8.8 s."""
  batch_size = 8

  def model(self):
    return with_lora(llama31_70b(), base_quantization="nf4")


@register
class Mixtral_8x7B_Lora(_FineTune, Mixtral_8x7B):
  """Mixtral 8x7B with LoRA rank 16 on q, k, v, o and the routed experts (`experts`: every
  expert's wi, wg and wo, 240M adapters), the frozen base in bfloat16, on moe.Mixtral_8x7B's
  slice and batch (v5p-128, `--plan_topology=v5p:4x4x4`: FSDP 16 x 4, 256 rows x 4096
  tokens, full remat, megablox)."""
  peak_learning_rate = 2e-4

  def model(self):
    cfg = super().model()
    cfg.lora = fdl.Config(LoraConfig, rank=16, alpha=32.0, base_dtype="bfloat16",
                          targets=("q", "k", "v", "o", "experts"))
    return cfg


@register
class LlamaLoraImport(LlamaImport):
  """LlamaImport with LoRA adapters on every attention and MLP weight (rank 8, alpha 16,
  a float32 base): the experiment of `tools/convert_hf.py --from_hf=... --adapter=PEFT_DIR`
  (or `--lora_rank=R`), whose model_overrides.txt sets the adapters' rank, alpha, dropout
  and targets and whose step-0 checkpoint holds the base and the adapters; only the
  adapters train. Or warm-start from a plain import (its model_overrides.txt, and
  --fdl_set="task.train.init_checkpoint_dir='IMPORT_DIR'"): the fine-tuning recipe
  (docs/fine_tuning.md).
  `--data_dir` must name prepared conversations (target masks; LlamaImport's data)."""
  group = "fine-tune"
  require_target_mask = True
  num_train_steps = 200
  peak_learning_rate = 1e-3  # adapters of a small rank learn fast (PEFT's examples: 1e-4..1e-3)

  @functools.cache
  def task(self) -> fdl.Config[Task]:
    """A short run: 10 warmup steps, cosine decay over num_train_steps; eval every 50."""
    cfg = super().task()
    cfg.train.num_train_steps = self.num_train_steps
    cfg.train.learning_rate.warmup_steps = 10
    cfg.train.learning_rate.decay_steps = self.num_train_steps
    cfg.train.optimizer = fdl.Partial(optax.adamw, b1=0.9, b2=0.999, weight_decay=0.0)
    cfg.train.eval_interval_steps = 50
    return cfg

  lora_targets = ("q", "k", "v", "o", "wi", "wg", "wo")

  def model(self):
    cfg = super().model()
    cfg.lora = fdl.Config(LoraConfig, rank=8, alpha=16.0, targets=self.lora_targets)
    return cfg


# Each imported family's LoRA experiment (hf families' `lora_experiment`): its import
# experiment with LlamaLoraImport's adapters and schedule; the import's model_overrides.txt
# sets the adapters' fields (the defaults here: every weight PEFT can adapt in it).
@register
class Qwen3LoraImport(LlamaLoraImport, Qwen3Import):
  """Qwen3Import with LoRA adapters (as LlamaLoraImport)."""


@register
class Gemma3LoraImport(LlamaLoraImport, Gemma3Import):
  """Gemma3Import with LoRA adapters (as LlamaLoraImport; the GeGLU gate wg included)."""


@register
class MoeLoraImport(LlamaLoraImport, MoeImport):
  """MoeImport (Mixtral, Qwen3-MoE) with LoRA adapters on attention (as LlamaLoraImport);
  `experts` (the routed experts) trains and merges but has no PEFT adapter form."""
  lora_targets = ("q", "k", "v", "o")


@register
class DeepSeekLoraImport(LlamaLoraImport, DeepSeekImport):
  """DeepSeekImport with LoRA adapters on multi-head latent attention's projections (a
  direct q, or q_down and q_up with q_lora_rank), as LlamaLoraImport."""
  lora_targets = ("q", "kv_down", "kv_up", "o")
