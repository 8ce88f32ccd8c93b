"""Gemma 3 (text) as a `Family`: TransformerLm fields and param paths. Pure.

`gemma3_text` (Gemma3ForCausalLM) checkpoints, and the language model of a `gemma3`
(Gemma3ForConditionalGeneration) one: its `text_config` and the tensors under its language
model (`text_half`); the vision tower and projector are left out, and --to_hf writes the
text model back as a `gemma3_text` checkpoint.

Gemma 3's layer: sandwich norms (input_layernorm, post_attention_layernorm,
pre_feedforward_layernorm, post_feedforward_layernorm), every RMSNorm `1 + w`; QK-norm;
GeGLU (gelu_pytorch_tanh); the embedding times sqrt(hidden_size); scores scaled by
query_pre_attn_scalar**-0.5; layers local (`sliding_attention`, RoPE base
rope_local_base_freq / rope_parameters.sliding_attention, unscaled) or global
(`full_attention`, rope_theta, linear scaling where set); a tied head.
"""
from spmdtask.errors import ConfigError
from spmdtask.hf import llama, rope
from spmdtask.hf.family import Family, LayerTensors

# transformers' Gemma3TextConfig defaults: the hub's multimodal configs leave these out of
# their text_config (e.g. google/gemma-3-4b-it sets only the fields that differ).
DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0, "eos_token_id": 1}
UNSUPPORTED = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
               "final_logit_softcapping": None, "attn_logit_softcapping": None,
               "use_bidirectional_attention": False}
LANGUAGE_PREFIXES = ("model.language_model.", "language_model.model.")  # transformers 5, 4
KINDS = {"sliding_attention": "local", "full_attention": "global"}


def text_half(cfg: dict, tensors: dict) -> tuple[dict, dict]:
  """(a gemma3_text config, its tensors named as Gemma3ForCausalLM's) of a `gemma3`
  multimodal checkpoint; any other checkpoint unchanged."""
  if cfg.get("model_type") != "gemma3":
    return cfg, tensors
  prefix = next((p for p in LANGUAGE_PREFIXES if any(k.startswith(p) for k in tensors)), None)
  if prefix is None:
    raise ConfigError(f"config.json says model_type='gemma3' but the checkpoint has no "
                      f"tensor under {' or '.join(LANGUAGE_PREFIXES)} (its language model).")
  out = {"model." + k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
  return text_config(cfg), out


def text_config(cfg: dict) -> dict:
  """The gemma3_text config of a `gemma3` multimodal one (its text_config, with the
  top-level tie and token ids it inherits); any other config unchanged."""
  if cfg.get("model_type") != "gemma3":
    return cfg
  text = {**cfg.get("text_config", {}), "model_type": "gemma3_text",
          "architectures": ["Gemma3ForCausalLM"]}
  text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
  for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
    if key not in text and key in cfg:
      text[key] = cfg[key]
  return text


def field(cfg: dict, key: str):
  """A text config's field, or transformers' default."""
  return cfg[key] if key in cfg else DEFAULTS[key]


def _rope(cfg: dict) -> dict:
  """TransformerLm's global (rope_theta, rope_scaling) and local (local_rope_theta) RoPE."""
  params = cfg.get("rope_parameters")
  if params is None:  # transformers 4's layout
    full = {**(cfg.get("rope_scaling") or {}), "rope_theta": field(cfg, "rope_theta")}
    local = {"rope_type": "default", "rope_theta": field(cfg, "rope_local_base_freq")}
  elif set(params) == set(KINDS):
    full, local = params["full_attention"], params["sliding_attention"]
  else:
    raise ConfigError(f"config.json: rope_parameters={params!r} must hold 'full_attention' "
                      "and 'sliding_attention' (Gemma 3's RoPE per layer type).")
  local_fields = rope.rope_fields({"rope_parameters": dict(local)}, {"default": ()})
  return dict(**rope.rope_fields({"rope_parameters": dict(full)},
                            {"default": (), "linear": ("factor",)}),
              local_rope_theta=local_fields["rope_theta"])


def pattern(cfg: dict) -> tuple[str, ...]:
  """The shortest repeating attention_pattern of the config's layer kinds (layer_types, or
  sliding_window_pattern: every n-th layer global)."""
  n = field(cfg, "num_hidden_layers")
  types = cfg.get("layer_types")
  if types is None:
    every = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern",
                                                      DEFAULTS["sliding_window_pattern"]))
    types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
             for i in range(n)]
  unknown = sorted(set(types) - set(KINDS))
  if unknown or len(types) != n:
    raise ConfigError(f"config.json: layer_types={types!r} must name each of the "
                      f"{n} layers 'sliding_attention' or 'full_attention'.")
  kinds = [KINDS[t] for t in types]
  period = next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))
  return tuple(kinds[:period])


def model_fields(cfg: dict) -> dict:
  """TransformerLm fields of a gemma3_text config; ConfigError naming an unsupported key."""
  for key, ok in UNSUPPORTED.items():
    if cfg.get(key, ok) != ok:
      raise ConfigError(f"config.json: {key}={cfg[key]!r} is not supported (only {ok!r}); "
                        "spmdtask's TransformerLm cannot express it, so the conversion would "
                        "not be exact.")
  kinds = pattern(cfg)
  d = field(cfg, "hidden_size")
  return dict(vocab_size=field(cfg, "vocab_size"), d_model=d,
              num_layers=field(cfg, "num_hidden_layers"),
              num_heads=field(cfg, "num_attention_heads"),
              num_kv_heads=field(cfg, "num_key_value_heads"), head_dim=field(cfg, "head_dim"),
              d_ff=field(cfg, "intermediate_size"),
              max_seq_len=field(cfg, "max_position_embeddings"), mlp_activation="geglu",
              **_rope(cfg), norm_eps=float(field(cfg, "rms_norm_eps")),
              tie_embeddings=bool(field(cfg, "tie_word_embeddings")), scale_tied_logits=False,
              qk_norm=True, attention_pattern=kinds,
              sliding_window=field(cfg, "sliding_window") if "local" in kinds else None,
              attention_scale=float(field(cfg, "query_pre_attn_scalar")) ** -0.5,
              norm_offset=1.0, sandwich_norms=True, scale_embedding=True)


def layer_tensors(i: int) -> dict[str, tuple[str, str]]:
  """Our stacked param path -> (HF name in layer i, layout kind)."""
  p, b = f"model.layers.{i}.", "layers/block/"
  return {b + "attn/q": (p + "self_attn.q_proj.weight", "heads_in"),
          b + "attn/k": (p + "self_attn.k_proj.weight", "kv_in"),
          b + "attn/v": (p + "self_attn.v_proj.weight", "kv_in"),
          b + "attn/o": (p + "self_attn.o_proj.weight", "heads_out"),
          b + "attn/q_norm/scale": (p + "self_attn.q_norm.weight", "same"),
          b + "attn/k_norm/scale": (p + "self_attn.k_norm.weight", "same"),
          b + "attn_norm/scale": (p + "input_layernorm.weight", "same"),
          b + "attn_post_norm/scale": (p + "post_attention_layernorm.weight", "same"),
          b + "mlp_norm/scale": (p + "pre_feedforward_layernorm.weight", "same"),
          b + "mlp_post_norm/scale": (p + "post_feedforward_layernorm.weight", "same"),
          b + "mlp/wg": (p + "mlp.gate_proj.weight", "t"),
          b + "mlp/wi": (p + "mlp.up_proj.weight", "t"),
          b + "mlp/wo": (p + "mlp.down_proj.weight", "t")}


class Gemma3(Family):
  model_types = ("gemma3_text", "gemma3")
  experiment = "gemma3.Gemma3Import"
  lora_experiment = "finetune.Gemma3LoraImport"
  lora_targets = llama.LORA_TARGETS  # the GeGLU gate (gate_proj) too

  def model_fields(self, cfg: dict) -> dict:
    return model_fields(text_config(cfg))

  def layer_tensors(self, cfg: dict, i: int) -> LayerTensors:
    return layer_tensors(i)

  def text(self, cfg: dict, tensors: dict) -> tuple[dict, dict]:
    return text_half(cfg, tensors)

  def text_config(self, cfg: dict) -> dict:
    return text_config(cfg)


FAMILY = Gemma3()
