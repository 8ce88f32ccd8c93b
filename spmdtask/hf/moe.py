"""Mixtral (`mixtral`, MixtralForCausalLM) and Qwen3-MoE (`qwen3_moe`, Qwen3MoeForCausalLM)
as `Family`s: Llama's attention (Qwen3-MoE's with QK-norm) and routed SwiGLU experts. Pure.

Routing: both score the router logits by a softmax over all experts, keep the top k and
(Mixtral always, Qwen3-MoE with norm_topk_prob) renormalize them to sum 1:
MoeConfig(score='softmax', renormalize=...). Their experts' gate (w1 / gate_proj), up (w3 /
up_proj) and down (w2 / down_proj) projections -> moe/wg, wi, wo stacked [L, E, ...]
(transposed); the router [E, d] -> moe/router [d, E]; no shared expert.
"""
from spmdtask.errors import ConfigError
from spmdtask.hf import llama
from spmdtask.hf.family import Family, LayerTensors, check_fields


class _Moe(Family):
  """What the two share; subclasses name their submodule, experts' names and fields."""
  experiment = "moe.MoeImport"
  lora_experiment = "finetune.MoeLoraImport"
  # Attention only: transformers 5 fuses the routed experts, which PEFT adapts only through
  # target_parameters (peft.py).
  lora_targets = llama.ATTENTION_TARGETS
  unsupported: dict = {}
  required: tuple[str, ...] = ()
  qk_norm = False
  sub, gate, up, down = "", "", "", ""  # the MoE submodule; its experts' projections

  def moe_fields(self, cfg: dict) -> dict:
    raise NotImplementedError

  def model_fields(self, cfg: dict) -> dict:
    kind = self.model_types[0]
    out = llama.fields(cfg, kind, self.unsupported)
    check_fields(cfg, kind, self.required, {})
    return {**out, "qk_norm": self.qk_norm, "moe": self.moe_fields(cfg)}

  def layer_tensors(self, cfg: dict, i: int) -> LayerTensors:
    return {**llama.attention(i, self.qk_norm),
            "layers/block/moe/router": (f"model.layers.{i}.{self.sub}.gate.weight", "t")}

  def expert_tensors(self, cfg: dict, i: int, j: int) -> LayerTensors:
    p = f"model.layers.{i}.{self.sub}.experts.{j}."
    return {"layers/block/moe/wg": (p + self.gate + ".weight", "t"),
            "layers/block/moe/wi": (p + self.up + ".weight", "t"),
            "layers/block/moe/wo": (p + self.down + ".weight", "t")}


class Mixtral(_Moe):
  model_types = ("mixtral",)
  unsupported = {"hidden_act": "silu", "sliding_window": None}
  required = ("num_local_experts", "num_experts_per_tok")
  sub, gate, up, down = "block_sparse_moe", "w1", "w3", "w2"

  def moe_fields(self, cfg: dict) -> dict:
    return dict(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                d_ff=cfg["intermediate_size"], score="softmax", renormalize=True)


class Qwen3Moe(_Moe):
  model_types = ("qwen3_moe",)
  unsupported = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
                 "decoder_sparse_step": 1, "mlp_only_layers": []}
  required = ("num_experts_per_tok", "moe_intermediate_size")
  qk_norm = True
  sub, gate, up, down = "mlp", "gate_proj", "up_proj", "down_proj"

  def moe_fields(self, cfg: dict) -> dict:
    # The hub's configs say num_experts; transformers >= 5 writes num_local_experts.
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
      raise ConfigError("config.json has neither 'num_experts' nor 'num_local_experts', one "
                        "of which a qwen3_moe config needs.")
    return dict(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                d_ff=cfg["moe_intermediate_size"], score="softmax",
                renormalize=bool(cfg.get("norm_topk_prob", False)))


MIXTRAL, QWEN3_MOE = Mixtral(), Qwen3Moe()
