"""Hugging Face model families as spmdtask TransformerLm fields and param paths. Pure.

Families, by config.json `model_type`: `llama` (LlamaForCausalLM), `qwen3`
(Qwen3ForCausalLM: Llama's layer with QK-norm), `mixtral` (MixtralForCausalLM),
`qwen3_moe` (Qwen3MoeForCausalLM) and `gemma3_text` (Gemma3ForCausalLM; `gemma3`, the
multimodal model, for its language model: tools/hf_gemma3.py). Each gives the TransformerLm
fields of a config (`model_fields`: a Mixture of Experts' as a `moe` dict of MoeConfig
fields) and where each HF tensor goes (`layer_tensors`, `expert_tensors`: our param path
-> (HF name, layout kind)). Anything a family's config sets that spmdtask cannot express
exactly is refused by name, never replaced by a default.

Routing: Mixtral and Qwen3-MoE score the router logits by a softmax over all experts,
keep the top k and (Mixtral always, Qwen3-MoE with norm_topk_prob) renormalize them to sum
1: MoeConfig(score='softmax', renormalize=...). Their routed experts are SwiGLU (w1 / gate_proj
the gate, w3 / up_proj the up projection, w2 / down_proj the down one), with no shared expert.
Qwen3's attention RMS-normalizes q and k per head before RoPE (TransformerLm.qk_norm).
"""
from spmdtask.errors import ConfigError
from tools import hf_gemma3

# model_type -> the experiment whose model the overrides set (configs/).
EXPERIMENTS = {"llama": "llama.LlamaImport", "qwen3": "qwen3.Qwen3Import",
               "mixtral": "moe.MoeImport", "qwen3_moe": "moe.MoeImport",
               "gemma3_text": "gemma3.Gemma3Import", "gemma3": "gemma3.Gemma3Import",
               # DeepSeek's mapping: tools/hf_deepseek.py
               "deepseek_v2": "deepseek.DeepSeekImport", "deepseek_v3": "deepseek.DeepSeekImport"}
DENSE = ("llama", "qwen3")  # Llama's layer (qwen3: with QK-norm)
GEMMA = ("gemma3_text", "gemma3")
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
# model_type -> the experiment of that model with LoRA adapters (a PEFT adapter's import).
LORA_EXPERIMENTS = {"llama": "finetune.LlamaLoraImport"}
# LoRA targets (layers.lora) -> the HF Linear module each adapts (PEFT's target_modules).
LORA_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                "wg": "gate_proj", "wi": "up_proj", "wo": "down_proj"}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
MOE_REQUIRED = {"mixtral": ("num_local_experts", "num_experts_per_tok"),
                "qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size")}
# HF config fields whose other values this converter cannot express: (key, the one value).
UNSUPPORTED = {
    "llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    "qwen3": {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
    "mixtral": {"hidden_act": "silu", "sliding_window": None},
    "qwen3_moe": {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
}
# The keys each supported rope_type has (HF's names); any other key is refused.
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")
ROPE_TYPES = {"default": (), "llama3": LLAMA3_KEYS}
HF_DEFAULT_ROPE_THETA = 10000.0  # LlamaConfig's, for old configs without rope_theta
# The routed experts' HF names: (gate, up, down) under each family's MoE submodule.
_EXPERTS = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
            "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def family(cfg: dict) -> str:
  """The config's model_type (an old Llama config may have none); ConfigError if unknown."""
  kind = cfg.get("model_type", "llama")
  if kind not in EXPERIMENTS:
    raise ConfigError(f"config.json: model_type={kind!r} is not supported; this converter "
                      f"reads {', '.join(repr(k) for k in EXPERIMENTS)} checkpoints.")
  return kind


def _rope_parameters(cfg: dict) -> tuple[dict, str]:
  """(RoPE parameters in transformers >= 5's form, the config key they came from)."""
  legacy = dict(cfg.get("rope_scaling") or {})
  if "rope_theta" in cfg:
    legacy["rope_theta"] = cfg["rope_theta"]
  params = cfg.get("rope_parameters")
  if params is None:
    legacy.setdefault("rope_theta", HF_DEFAULT_ROPE_THETA)
    return legacy, "rope_scaling"
  if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
    raise ConfigError(f"config.json: rope_parameters={params!r} is not one flat RoPE setting "
                      "(per-layer-type RoPE is not supported).")
  clash = {k: (v, params.get(k)) for k, v in legacy.items() if params.get(k) != v}
  if clash:
    raise ConfigError(f"config.json: rope_parameters and the top-level rope_theta/rope_scaling "
                      f"disagree on {sorted(clash)} ({clash}); keep one of the two layouts.")
  if "rope_theta" not in params:
    raise ConfigError("config.json: rope_parameters has no rope_theta; add the model's RoPE "
                      "base (e.g. 500000.0 for Llama 3).")
  return dict(params), "rope_parameters"


def rope_fields(cfg: dict, rope_types: dict = ROPE_TYPES) -> dict:
  """TransformerLm's rope_theta and rope_scaling (None or the scaling's fields) of a HF
  config, whose rope_type must be one of `rope_types` (name -> its keys)."""
  params, where = _rope_parameters(cfg)
  rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
  params.pop("type", None)
  theta = params.pop("rope_theta")
  if rope_type not in rope_types:
    raise ConfigError(f"config.json: {where} rope_type={rope_type!r} is not supported (only "
                      f"{sorted(rope_types)}); spmdtask's RoPE cannot express it, so the "
                      "conversion would not be exact.")
  keys = rope_types[rope_type]
  unknown, missing = sorted(set(params) - set(keys)), [k for k in keys if k not in params]
  if unknown or missing:
    raise ConfigError(f"config.json: {where} (rope_type={rope_type!r}) "
                      + (f"has keys this converter does not support: {unknown}" if unknown
                         else f"lacks {missing}, which rope_type {rope_type!r} needs")
                      + "; refusing rather than guessing their effect.")
  scaling = {k: float(params[k]) for k in keys}
  if "original_max_position_embeddings" in scaling:
    scaling["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
  return dict(rope_theta=float(theta), rope_scaling=scaling or None)


def _moe_fields(cfg: dict, kind: str) -> dict:
  """MoeConfig fields of a Mixtral or Qwen3-MoE config."""
  for key in MOE_REQUIRED[kind]:
    if key not in cfg:
      raise ConfigError(f"config.json has no {key!r}, which a {kind} config needs.")
  if kind == "mixtral":
    return dict(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                d_ff=cfg["intermediate_size"], score="softmax", renormalize=True)
  # The hub's configs say num_experts; transformers >= 5 writes num_local_experts.
  experts = cfg.get("num_experts", cfg.get("num_local_experts"))
  if experts is None:
    raise ConfigError("config.json has neither 'num_experts' nor 'num_local_experts', one of "
                      "which a qwen3_moe config needs.")
  return dict(num_experts=experts, top_k=cfg["num_experts_per_tok"],
              d_ff=cfg["moe_intermediate_size"], score="softmax",
              renormalize=bool(cfg.get("norm_topk_prob", False)))


def model_fields(cfg: dict) -> dict:
  """TransformerLm fields of a HF config; ConfigError naming an unsupported key."""
  kind = family(cfg)
  if kind in GEMMA:
    return hf_gemma3.model_fields(hf_gemma3.text_config(cfg), rope_fields)
  if kind in DEEPSEEK:
    from tools import hf_deepseek  # pylint: disable=g-import-not-at-top  (it imports this)
    return hf_deepseek.model_fields(cfg)
  for key in REQUIRED:
    if key not in cfg:
      raise ConfigError(f"config.json has no {key!r}, which a {kind} config needs.")
  for key, ok in UNSUPPORTED[kind].items():
    if key in cfg and cfg[key] != ok:
      raise ConfigError(f"config.json: {key}={cfg[key]!r} is not supported (only {ok!r}); "
                        "spmdtask's TransformerLm cannot express it, so the conversion would "
                        "not be exact.")
  heads = cfg["num_attention_heads"]
  tied = bool(cfg.get("tie_word_embeddings", False))
  out = dict(vocab_size=cfg["vocab_size"], d_model=cfg["hidden_size"],
             num_layers=cfg["num_hidden_layers"], num_heads=heads,
             num_kv_heads=cfg.get("num_key_value_heads") or heads,
             head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
             d_ff=cfg["intermediate_size"], max_seq_len=cfg.get("max_position_embeddings", 2048),
             mlp_activation="swiglu", **rope_fields(cfg),
             norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=tied,
             scale_tied_logits=False)  # HF's tied head is unscaled
  if kind == "qwen3" and "sliding_attention" in (cfg.get("layer_types") or ()):
    raise ConfigError(f"config.json: layer_types={cfg['layer_types']!r}: sliding-window "
                      "layers in a qwen3 config are not supported (use_sliding_window=false).")
  if kind != "llama":
    out.update(qk_norm=kind in ("qwen3", "qwen3_moe"))
  if kind not in DENSE:
    out.update(moe=_moe_fields(cfg, kind))
  return out


def layer_tensors(cfg: dict, i: int) -> dict[str, tuple[str, str]]:
  """Our stacked param path -> (HF name in layer i, layout kind), routed experts aside."""
  kind, p = family(cfg), f"model.layers.{i}."
  if kind in GEMMA:
    return hf_gemma3.layer_tensors(i)
  out = {"layers/block/attn/q": (p + "self_attn.q_proj.weight", "heads_in"),
         "layers/block/attn/k": (p + "self_attn.k_proj.weight", "kv_in"),
         "layers/block/attn/v": (p + "self_attn.v_proj.weight", "kv_in"),
         "layers/block/attn/o": (p + "self_attn.o_proj.weight", "heads_out"),
         "layers/block/attn_norm/scale": (p + "input_layernorm.weight", "same"),
         "layers/block/mlp_norm/scale": (p + "post_attention_layernorm.weight", "same")}
  if kind in ("qwen3", "qwen3_moe"):
    out.update({"layers/block/attn/q_norm/scale": (p + "self_attn.q_norm.weight", "same"),
                "layers/block/attn/k_norm/scale": (p + "self_attn.k_norm.weight", "same")})
  if kind in DENSE:
    out.update({"layers/block/mlp/wg": (p + "mlp.gate_proj.weight", "t"),
                "layers/block/mlp/wi": (p + "mlp.up_proj.weight", "t"),
                "layers/block/mlp/wo": (p + "mlp.down_proj.weight", "t")})
    return out
  out["layers/block/moe/router"] = (p + _EXPERTS[kind][0] + ".gate.weight", "t")  # [E, d]
  return out


def expert_tensors(cfg: dict, i: int, j: int) -> dict[str, tuple[str, str]]:
  """Our param path (stacked [layers, experts, ...]) -> (HF name of expert j of layer i,
  layout kind); none for a dense family."""
  kind = family(cfg)
  if kind not in _EXPERTS:
    return {}
  sub, gate, up, down = _EXPERTS[kind]
  p = f"model.layers.{i}.{sub}.experts.{j}."
  return {"layers/block/moe/wg": (p + gate + ".weight", "t"),
          "layers/block/moe/wi": (p + up + ".weight", "t"),
          "layers/block/moe/wo": (p + down + ".weight", "t")}


def num_experts(cfg: dict) -> int:
  """Routed experts per layer (0: dense)."""
  fields = model_fields(cfg)
  return fields["moe"]["num_experts"] if "moe" in fields else 0


def lora_experiment(cfg: dict) -> str:
  """The LoRA experiment of this HF config's family; ConfigError for a family without one."""
  kind = family(cfg)
  if kind not in LORA_EXPERIMENTS:
    raise ConfigError(f"config.json: model_type={kind!r}: LoRA adapters in and out of PEFT "
                      f"are supported for {', '.join(repr(k) for k in LORA_EXPERIMENTS)} "
                      "models only.")
  return LORA_EXPERIMENTS[kind]


def lora_modules(cfg: dict, i: int, targets) -> dict[str, tuple[str, str, str]]:
  """Adapter target -> (our stacked base param path, HF module name in layer i without
  '.weight', layout kind) for each of `targets`."""
  tensors = layer_tensors(cfg, i)
  out = {}
  for t in targets:
    path = f"layers/block/{'attn' if t in ('q', 'k', 'v', 'o') else 'mlp'}/{t}"
    name, kind = tensors[path]
    out[t] = (path, name.removesuffix(".weight"), kind)
  return out


# Layout kinds: HF Linear [out, in] -> spmdtask's [in, ...] (and back).
def layouts(m: dict):
  """(to ours, back to HF) by layout kind, for TransformerLm fields `m`."""
  d, h, kv, hd = m["d_model"], m["num_heads"], m["num_kv_heads"], m["head_dim"]
  to = {"heads_in": lambda w: w.T.reshape(d, h, hd), "kv_in": lambda w: w.T.reshape(d, kv, hd),
        "heads_out": lambda w: w.T.reshape(h, hd, d), "t": lambda w: w.T, "same": lambda w: w}
  back = {"heads_in": lambda w: w.reshape(d, -1).T, "kv_in": lambda w: w.reshape(d, -1).T,
          "heads_out": lambda w: w.reshape(h * hd, d).T, "t": lambda w: w.T,
          "same": lambda w: w}
  from tools import hf_deepseek  # pylint: disable=g-import-not-at-top  (it imports this)
  mla_to, mla_back = hf_deepseek.layouts(m)  # MLA's kinds
  return {**to, **mla_to}, {**back, **mla_back}


def stacked_paths(cfg: dict, m: dict):
  """(our path, [per layer: HF name or [per expert: HF name]], kind) of every stacked param."""
  if family(cfg) in DEEPSEEK:
    from tools import hf_deepseek  # pylint: disable=g-import-not-at-top  (it imports this)
    return hf_deepseek.stacked(cfg)
  layers, experts = range(m["num_layers"]), range(num_experts(cfg))
  out = [(path, [layer_tensors(cfg, i)[path][0] for i in layers], kind)
         for path, (_, kind) in layer_tensors(cfg, 0).items()]
  out += [(path, [[expert_tensors(cfg, i, j)[path][0] for j in experts]
                  for i in layers], kind)
          for path, (_, kind) in expert_tensors(cfg, 0, 0).items()]
  return out
