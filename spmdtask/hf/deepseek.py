"""Hugging Face DeepSeek-V2 / V3 (`deepseek_v2`, `deepseek_v3`) as a `Family`: TransformerLm
fields and param paths. Pure.

The model: multi-head latent attention (`TransformerLm.mla`, layers.attention.mla) and
DeepSeekMoE (`moe`): the first first_k_dense_replace layers dense (the `dense_layers`
stack), the rest routed experts + shared ones (`layers`). V3 routes by sigmoid scores
within groups (n_group, topk_group, top-2 sums), with the balancing bias
e_score_correction_bias (a buffer: `moe/score_bias_buffer`), normalized top-k weights
(norm_topk_prob) times routed_scaling_factor; V2 by softmax (topk_method 'greedy', or
'group_limited_greedy': groups scored by their best expert), never renormalized, times
routed_scaling_factor. An import does not move the bias (bias_update_rate 0).
RoPE: rope_type 'default' or 'yarn' (factor, original_max_position_embeddings, beta_fast,
beta_slow, mscale, mscale_all_dim, truncate); the rotary dims are interleaved pairs (V2
always; V3 with rope_interleave, else rotate-half).

Layouts, HF Linear [out, in] -> ours: q_a_proj, kv_a_proj_with_mqa -> [d, rank] (.T);
q_proj / q_b_proj [h·qk, in] -> [in, h, qk]; kv_b_proj [h·(nope + v), r] -> [r, h, nope + v];
o_proj [d, h·v] -> [h, v, d]; MLPs and experts as Mixtral's (moe.py).
Multi-token prediction (V3's `num_nextn_predict_layers`, layers.mtp): HF layer
num_hidden_layers + j is MTP depth j + 1, `mtp/...` stacked [D, ...]: enorm, hnorm,
eh_proj [d, 2d] (.T), shared_head.norm -> head_norm, the rest its block's as any MoE
layer's. Its copies of the embedding (`embed_tokens`) and head (`shared_head.head`) must
equal the main ones (spmdtask shares them) and are written back as copies. A checkpoint
without those tensors (transformers' DeepseekV3 saves none) or read with --skip_mtp
imports with mtp_depth 0 (`held`), one line saying so; --to_hf then writes none.
"""
from spmdtask.errors import ConfigError
from spmdtask.hf import rope
from spmdtask.hf.family import Family, LayerTensors, Stacked, check_fields

REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
# HF config fields whose other values this converter cannot express: (key, the one value).
UNSUPPORTED = {
    "deepseek_v2": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                    "moe_layer_freq": 1, "scoring_func": "softmax", "norm_topk_prob": False,
                    "topk_method": ("greedy", "group_limited_greedy")},
    "deepseek_v3": {"hidden_act": "silu", "attention_bias": False, "moe_layer_freq": 1,
                    "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
}
YARN_KEYS = {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0, "truncate": True}


def mtp_layers(cfg: dict) -> dict[int, str]:
  """HF layer index -> its name prefix, of each MTP layer config.json declares (V3)."""
  if cfg.get("model_type") != "deepseek_v3":
    return {}
  n = cfg["num_hidden_layers"]
  return {n + j: f"model.layers.{n + j}." for j in range(cfg.get("num_nextn_predict_layers") or 0)}


def held(cfg: dict, tensors: dict, skip_mtp: bool = False) -> tuple[dict, dict, str | None]:
  """(config.json as the checkpoint's `tensors` (any mapping by HF name) hold it:
  num_nextn_predict_layers 0 where none of its MTP layers' tensors are there or `skip_mtp`,
  the tensors without those layers', a line saying so or None); ConfigError where some are
  there and some not."""
  layers = mtp_layers(cfg)
  there = [i for i, p in layers.items() if p + "eh_proj.weight" in tensors]
  if not layers or len(there) == len(layers) and not skip_mtp:
    return cfg, tensors, None
  if there and not skip_mtp:
    raise ConfigError(f"config.json: num_nextn_predict_layers={len(layers)}, but the "
                      f"checkpoint holds the tensors of MTP layers {there} only; give all or "
                      "none (or --skip_mtp to import without them).")
  why = ("--skip_mtp: the checkpoint's" if there else "the checkpoint holds no tensors of its")
  kept = {k: v for k, v in tensors.items() if not k.startswith(tuple(layers.values()))}
  return {**cfg, "num_nextn_predict_layers": 0}, kept, (
      f"{why} multi-token-prediction layer(s) {list(layers)} (config.json "
      f"num_nextn_predict_layers={len(layers)}): imported without them (task.model.mtp_depth=0).")


def mtp_copies(cfg: dict) -> dict[str, str]:
  """HF name of each MTP layer's copy of the embedding / head -> the main tensor's name."""
  head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
  out = {}
  for p in mtp_layers(cfg).values():
    out.update({p + "embed_tokens.weight": "model.embed_tokens.weight",
                p + "shared_head.head.weight": head})
  return out


def _check(cfg: dict, kind: str) -> None:
  check_fields(cfg, kind, REQUIRED, UNSUPPORTED[kind])
  k = cfg.get("first_k_dense_replace", 0) or 0
  if not 0 <= k < cfg["num_hidden_layers"]:
    raise ConfigError(f"config.json: first_k_dense_replace={k} leaves no MoE layer of "
                      f"num_hidden_layers={cfg['num_hidden_layers']}; not supported.")


def _yarn(cfg: dict) -> tuple[float, dict | None]:
  """(rope_theta, YarnScaling fields or None) of the config's RoPE."""
  params, where = rope.parameters(cfg)
  rope_type = rope.rope_type(params)
  theta = float(params.pop("rope_theta"))
  if rope_type == "default" and not params:
    return theta, None
  if rope_type != "yarn":
    raise ConfigError(f"config.json: {where} rope_type={rope_type!r} is not supported for "
                      f"DeepSeek (only 'default' and 'yarn').")
  unknown = sorted(set(params) - set(YARN_KEYS))
  missing = [k for k, v in YARN_KEYS.items() if v is None and params.get(k) is None]
  if unknown or missing:
    raise ConfigError(f"config.json: {where} (rope_type 'yarn') "
                      + (f"has keys this converter does not support: {unknown}" if unknown
                         else f"lacks {missing}")
                      + "; refusing rather than guessing their effect.")
  out = {k: params[k] if params.get(k) is not None else v for k, v in YARN_KEYS.items()}
  out = {k: bool(v) if k == "truncate" else int(v) if k == "original_max_position_embeddings"
         else float(v) for k, v in out.items()}
  return theta, out


def model_fields(cfg: dict) -> dict:
  """TransformerLm fields of a DeepSeek config, MoeConfig fields as `moe`, MlaConfig's as
  `mla` (its YaRN as mla['rope_scaling'], a dict or None); ConfigError naming an
  unsupported key."""
  kind = cfg["model_type"]
  _check(cfg, kind)
  heads = cfg["num_attention_heads"]
  if (cfg.get("num_key_value_heads") or heads) != heads:
    raise ConfigError(f"config.json: num_key_value_heads={cfg['num_key_value_heads']} differs "
                      f"from num_attention_heads={heads}; MLA has one KV head per head.")
  theta, yarn = _yarn(cfg)
  qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
  mla = dict(q_lora_rank=cfg.get("q_lora_rank") or None, kv_lora_rank=cfg["kv_lora_rank"],
             qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
             v_head_dim=cfg["v_head_dim"],
             rope_interleave=bool(cfg.get("rope_interleave", True)) if kind == "deepseek_v3"
             else True, rope_scaling=yarn)
  v3 = kind == "deepseek_v3"
  grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"
  moe = dict(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
             d_ff=cfg["moe_intermediate_size"], num_shared_experts=cfg.get("n_shared_experts") or 0,
             first_moe_layer=cfg.get("first_k_dense_replace", 0) or 0,
             score="sigmoid" if v3 else "softmax",
             renormalize=bool(cfg.get("norm_topk_prob", False)) if v3 else False,
             routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
             n_group=(cfg.get("n_group") or 1) if grouped else 1,
             topk_group=(cfg.get("topk_group") or 1) if grouped else 1,
             group_score="max" if grouped and not v3 else "top2_sum", score_bias=v3)
  return dict(vocab_size=cfg["vocab_size"], d_model=cfg["hidden_size"],
              num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=heads,
              head_dim=qk, d_ff=cfg["intermediate_size"],
              max_seq_len=cfg.get("max_position_embeddings", 2048), mlp_activation="swiglu",
              rope_theta=theta, rope_scaling=None, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
              tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
              scale_tied_logits=False, qk_norm=False, moe=moe, mla=mla,
              mtp_depth=len(mtp_layers(cfg)))


def override_lines(mla: dict | None) -> list[str]:
  """`--fdl_set` values of the MLA fields (`task.model.mla.*`; its YaRN one by one)."""
  if mla is None:
    return []
  mla = dict(mla)
  yarn = mla.pop("rope_scaling")
  lines = [f"task.model.mla.{k}={v!r}" for k, v in mla.items()]
  if yarn is None:
    return lines + ["task.model.mla.rope_scaling=None"]
  return lines + [f"task.model.mla.rope_scaling.{k}={v!r}" for k, v in yarn.items()]


def sub_fields(got: dict, want: dict) -> dict:
  """A built model's `moe` and `mla` configs (in `got`) as dicts of `want`'s keys (its
  YaRN too), to compare with `model_fields` (jobs.published)."""
  out = {}
  for sub in ("moe", "mla"):
    if sub in want and got.get(sub) is not None:
      out[sub] = {k: getattr(got[sub], k) for k in want[sub]}
  yarn = out.get("mla", {}).get("rope_scaling")
  if yarn is not None:
    out["mla"]["rope_scaling"] = {k: getattr(yarn, k) for k in YARN_KEYS}
  return out


def layouts(m: dict):
  """The MLA layout kinds (HF -> ours, ours -> HF) beside convert.py's."""
  h = m["num_heads"]
  to = {"mla_heads_in": lambda w: w.T.reshape(w.shape[1], h, -1),
        "mla_heads_out": lambda w: w.T.reshape(h, -1, w.shape[0])}
  back = {"mla_heads_in": lambda w: w.reshape(w.shape[0], -1).T,
          "mla_heads_out": lambda w: w.reshape(-1, w.shape[-1]).T}
  return to, back


def _attention(cfg: dict, p: str) -> LayerTensors:
  a, out = p + "self_attn.", {}
  if cfg.get("q_lora_rank"):
    out.update({"attn/q_down": (a + "q_a_proj.weight", "t"),
                "attn/q_norm/scale": (a + "q_a_layernorm.weight", "same"),
                "attn/q_up": (a + "q_b_proj.weight", "mla_heads_in")})
  else:
    out["attn/q"] = (a + "q_proj.weight", "mla_heads_in")
  out.update({"attn/kv_down": (a + "kv_a_proj_with_mqa.weight", "t"),
              "attn/kv_norm/scale": (a + "kv_a_layernorm.weight", "same"),
              "attn/kv_up": (a + "kv_b_proj.weight", "mla_heads_in"),
              "attn/o": (a + "o_proj.weight", "mla_heads_out"),
              "attn_norm/scale": (p + "input_layernorm.weight", "same"),
              "mlp_norm/scale": (p + "post_attention_layernorm.weight", "same")})
  return out


def _layer(cfg: dict, i: int) -> LayerTensors:
  """Our path under the stack's block -> (HF name in layer i, kind), experts aside."""
  p = f"model.layers.{i}."
  out = _attention(cfg, p)
  mlp = "mlp/" if i < (cfg.get("first_k_dense_replace") or 0) else "moe/shared/"
  hf_mlp = p + ("mlp." if mlp == "mlp/" else "mlp.shared_experts.")
  out.update({mlp + w: (hf_mlp + n + ".weight", "t")
              for w, n in (("wg", "gate_proj"), ("wi", "up_proj"), ("wo", "down_proj"))})
  if mlp != "mlp/":
    out["moe/router"] = (p + "mlp.gate.weight", "t")
    if cfg["model_type"] == "deepseek_v3":
      out["moe/score_bias_buffer"] = (p + "mlp.gate.e_score_correction_bias", "same")
  return out


def stacked(cfg: dict) -> list[Stacked]:
  """(our path, [per layer: HF name or [per expert: HF name]], kind) of every stacked
  param: `dense_layers` (the first first_k_dense_replace layers), then `layers`."""
  k, n = cfg.get("first_k_dense_replace") or 0, cfg["num_hidden_layers"]
  out = []
  for stack, layers in (("dense_layers", range(k)), ("layers", range(k, n))):
    if not layers:
      continue
    for path, (_, kind) in _layer(cfg, layers[0]).items():
      out.append((f"{stack}/block/{path}", [_layer(cfg, i)[path][0] for i in layers], kind))
  mtp = list(mtp_layers(cfg))
  if mtp:
    for path, (_, kind) in _mtp_layer(cfg, mtp[0]).items():
      out.append((f"mtp/{path}", [_mtp_layer(cfg, i)[path][0] for i in mtp], kind))
  experts = range(cfg["n_routed_experts"])
  for stack, layers in (("layers", range(k, n)), ("mtp", mtp)):
    for w, name in (("wg", "gate_proj"), ("wi", "up_proj"), ("wo", "down_proj")):
      if layers:
        out.append((f"{stack}/block/moe/{w}",
                    [[f"model.layers.{i}.mlp.experts.{j}.{name}.weight" for j in experts]
                     for i in layers], "t"))
  return out


def _mtp_layer(cfg: dict, i: int) -> LayerTensors:
  """Our path under `mtp` -> (HF name in MTP layer i, kind), experts aside."""
  p = f"model.layers.{i}."
  return {"enorm/scale": (p + "enorm.weight", "same"), "hnorm/scale": (p + "hnorm.weight", "same"),
          "eh_proj": (p + "eh_proj.weight", "t"),
          "head_norm/scale": (p + "shared_head.norm.weight", "same"),
          **{"block/" + k: v for k, v in _layer(cfg, i).items()}}


class DeepSeek(Family):
  model_types = ("deepseek_v2", "deepseek_v3")
  experiment = "deepseek.DeepSeekImport"
  lora_experiment = "finetune.DeepSeekLoraImport"
  # MLA's projections; not the MLPs: PEFT maps an MoE model's gate/up/down projections onto
  # its fused routed experts (peft.py).
  lora_targets = {"q": "q_proj", "q_down": "q_a_proj", "q_up": "q_b_proj",
                  "kv_down": "kv_a_proj_with_mqa", "kv_up": "kv_b_proj", "o": "o_proj"}

  def model_fields(self, cfg: dict) -> dict:
    return model_fields(cfg)

  def stacked(self, cfg: dict, m: dict) -> list[Stacked]:
    return stacked(cfg)

  def layouts(self, m: dict) -> tuple[dict, dict]:
    return layouts(m)

  def held(self, cfg: dict, tensors: dict, skip_mtp: bool = False
           ) -> tuple[dict, dict, str | None]:
    return held(cfg, tensors, skip_mtp)

  def copies(self, cfg: dict) -> dict[str, str]:
    return mtp_copies(cfg)


FAMILY = DeepSeek()
