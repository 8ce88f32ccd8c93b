"""Every Hugging Face family spmdtask reads, by config.json `model_type`, and what follows
from the family alone: its TransformerLm fields and its experiments. Pure.
"""
from spmdtask.errors import ConfigError
from spmdtask.hf import deepseek, gemma3, llama, moe, qwen3
from spmdtask.hf.family import Family

FAMILIES = (llama.FAMILY, qwen3.FAMILY, moe.MIXTRAL, moe.QWEN3_MOE, gemma3.FAMILY,
            deepseek.FAMILY)
BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def model_type(cfg: dict) -> str:
  """The config's model_type (an old Llama config may have none); ConfigError if unknown."""
  kind = cfg.get("model_type", "llama")
  if kind not in BY_TYPE:
    raise ConfigError(f"config.json: model_type={kind!r} is not supported; this converter "
                      f"reads {', '.join(repr(k) for k in BY_TYPE)} checkpoints.")
  return kind


def of(cfg: dict) -> Family:
  """The family of a HF config; ConfigError naming an unknown model_type."""
  return BY_TYPE[model_type(cfg)]


def model_fields(cfg: dict) -> dict:
  """TransformerLm fields of a HF config; ConfigError naming an unsupported key."""
  return of(cfg).model_fields(cfg)


def experiment(cfg: dict, lora: dict | None = None) -> str:
  """The experiment (`configs/`) whose model the override lines of this HF config set
  (with `lora`, LoraConfig fields, the family's LoRA experiment)."""
  return of(cfg).experiment if lora is None else lora_experiment(cfg)


def lora_experiment(cfg: dict) -> str:
  """The LoRA experiment of this HF config's family; ConfigError for a family without one."""
  kind = model_type(cfg)
  if BY_TYPE[kind].lora_experiment is None:
    with_lora = [t for t, f in BY_TYPE.items() if f.lora_experiment is not None]
    raise ConfigError(f"config.json: model_type={kind!r}: LoRA adapters in and out of PEFT "
                      f"are supported for {', '.join(repr(k) for k in with_lora)} "
                      "models only.")
  return BY_TYPE[kind].lora_experiment
