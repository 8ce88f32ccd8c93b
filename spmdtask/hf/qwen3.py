"""Qwen3 dense (`model_type` `qwen3`, Qwen3ForCausalLM) as a `Family`: Llama's layer with
QK-norm (the attention RMS-normalizes q and k per head before RoPE:
TransformerLm.qk_norm), usually a tied, unscaled head. Sliding-window layers are refused.
Pure.
"""
from spmdtask.errors import ConfigError
from spmdtask.hf import llama
from spmdtask.hf.family import Family, LayerTensors

UNSUPPORTED = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}


def no_sliding_layers(cfg: dict, kind: str) -> None:
  if "sliding_attention" in (cfg.get("layer_types") or ()):
    raise ConfigError(f"config.json: layer_types={cfg['layer_types']!r}: sliding-window "
                      f"layers in a {kind} config are not supported (use_sliding_window=false).")


class Qwen3(Family):
  model_types = ("qwen3",)
  experiment = "qwen3.Qwen3Import"
  lora_experiment = "finetune.Qwen3LoraImport"
  lora_targets = llama.LORA_TARGETS

  def model_fields(self, cfg: dict) -> dict:
    out = llama.fields(cfg, "qwen3", UNSUPPORTED)
    no_sliding_layers(cfg, "qwen3")
    return {**out, "qk_norm": True}

  def layer_tensors(self, cfg: dict, i: int) -> LayerTensors:
    return {**llama.attention(i, qk_norm=True), **llama.mlp(i)}


FAMILY = Qwen3()
