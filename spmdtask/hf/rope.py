"""RoPE of a Hugging Face config: transformers >= 5's `rope_parameters` ({rope_theta,
rope_type, factor, ...}) or the older top-level `rope_theta` / `rope_scaling`, as
TransformerLm's rope_theta and rope_scaling. A rope_type or key the caller does not list
is refused by name (the conversion would not be exact). Pure.
"""
from spmdtask.errors import ConfigError

# The keys each supported rope_type has (HF's names); any other key is refused.
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")
ROPE_TYPES = {"default": (), "llama3": LLAMA3_KEYS}
HF_DEFAULT_ROPE_THETA = 10000.0  # LlamaConfig's, for old configs without rope_theta


def parameters(cfg: dict) -> tuple[dict, str]:
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


def rope_type(params: dict) -> str:
  """Pops the rope_type (or the older `type`) of `parameters`' dict; 'default' if none."""
  kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
  params.pop("type", None)
  return kind


def rope_fields(cfg: dict, rope_types: dict = ROPE_TYPES) -> dict:
  """TransformerLm's rope_theta and rope_scaling (None or the scaling's fields) of a HF
  config, whose rope_type must be one of `rope_types` (name -> its keys)."""
  params, where = parameters(cfg)
  kind = rope_type(params)
  theta = params.pop("rope_theta")
  if kind not in rope_types:
    raise ConfigError(f"config.json: {where} rope_type={kind!r} is not supported (only "
                      f"{sorted(rope_types)}); spmdtask's RoPE cannot express it, so the "
                      "conversion would not be exact.")
  keys = rope_types[kind]
  unknown, missing = sorted(set(params) - set(keys)), [k for k in keys if k not in params]
  if unknown or missing:
    raise ConfigError(f"config.json: {where} (rope_type={kind!r}) "
                      + (f"has keys this converter does not support: {unknown}" if unknown
                         else f"lacks {missing}, which rope_type {kind!r} needs")
                      + "; refusing rather than guessing their effect.")
  scaling = {k: float(params[k]) for k in keys}
  if "original_max_position_embeddings" in scaling:
    scaling["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
  return dict(rope_theta=float(theta), rope_scaling=scaling or None)
