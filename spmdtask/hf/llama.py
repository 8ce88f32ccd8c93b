"""Llama (`model_type` `llama`, LlamaForCausalLM) as a `Family`, and the pieces of its
layer that Qwen3, Mixtral and Qwen3-MoE share (`fields`, `attention`, `mlp`). Pure.

Layouts, HF Linear [out, in] -> ours: q_proj [h·hd, d] -> q [d, h, hd] (`heads_in`),
k/v_proj [kv·hd, d] -> [d, kv, hd] (`kv_in`), o_proj [d, h·hd] -> o [h, hd, d]
(`heads_out`), gate/up/down_proj -> mlp wg/wi/wo transposed (`t`), norms as they are.
No permutation of q/k rows: HF applies RoPE in rotate-half form, as spmdtask does.
"""
from spmdtask.hf import rope
from spmdtask.hf.family import Family, LayerTensors, check_fields

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
# HF config fields whose other values spmdtask cannot express: (key, the one value).
UNSUPPORTED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
# LoRA target -> the HF Linear module it adapts (PEFT's target_modules name).
ATTENTION_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
LORA_TARGETS = {**ATTENTION_TARGETS, "wg": "gate_proj", "wi": "up_proj", "wo": "down_proj"}


def fields(cfg: dict, kind: str, unsupported: dict) -> dict:
  """TransformerLm fields of a Llama-layer config (`kind`: its model_type, for errors)."""
  check_fields(cfg, kind, REQUIRED, unsupported)
  heads = cfg["num_attention_heads"]
  return dict(vocab_size=cfg["vocab_size"], d_model=cfg["hidden_size"],
              num_layers=cfg["num_hidden_layers"], num_heads=heads,
              num_kv_heads=cfg.get("num_key_value_heads") or heads,
              head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
              d_ff=cfg["intermediate_size"],
              max_seq_len=cfg.get("max_position_embeddings", 2048),
              mlp_activation="swiglu", **rope.rope_fields(cfg),
              norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
              tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
              scale_tied_logits=False)  # HF's tied head is unscaled


def attention(i: int, qk_norm: bool = False) -> LayerTensors:
  """Layer i's attention and norms (with Qwen3's per-head q/k RMSNorms)."""
  p = f"model.layers.{i}."
  out = {"layers/block/attn/q": (p + "self_attn.q_proj.weight", "heads_in"),
         "layers/block/attn/k": (p + "self_attn.k_proj.weight", "kv_in"),
         "layers/block/attn/v": (p + "self_attn.v_proj.weight", "kv_in"),
         "layers/block/attn/o": (p + "self_attn.o_proj.weight", "heads_out"),
         "layers/block/attn_norm/scale": (p + "input_layernorm.weight", "same"),
         "layers/block/mlp_norm/scale": (p + "post_attention_layernorm.weight", "same")}
  if qk_norm:
    out.update({"layers/block/attn/q_norm/scale": (p + "self_attn.q_norm.weight", "same"),
                "layers/block/attn/k_norm/scale": (p + "self_attn.k_norm.weight", "same")})
  return out


def mlp(i: int) -> LayerTensors:
  """Layer i's SwiGLU MLP."""
  p = f"model.layers.{i}.mlp."
  return {"layers/block/mlp/wg": (p + "gate_proj.weight", "t"),
          "layers/block/mlp/wi": (p + "up_proj.weight", "t"),
          "layers/block/mlp/wo": (p + "down_proj.weight", "t")}


class Llama(Family):
  model_types = ("llama",)
  experiment = "llama.LlamaImport"
  lora_experiment = "finetune.LlamaLoraImport"
  lora_targets = LORA_TARGETS

  def model_fields(self, cfg: dict) -> dict:
    return fields(cfg, "llama", UNSUPPORTED)

  def layer_tensors(self, cfg: dict, i: int) -> LayerTensors:
    return {**attention(i), **mlp(i)}


FAMILY = Llama()
