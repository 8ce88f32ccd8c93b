"""DeepSeek experiments: multi-head latent attention (layers.attention.mla) with DeepSeekMoE
(layers.moe). `--exp=TinyDeepSeekV3` etc.

Published sizes, from each model's Hugging Face config.json as MaxText's model configs
(src/MaxText/configs/models/deepseek2-16b.yml, deepseek3-671b.yml) and transformers'
DeepseekV2Config / DeepseekV3Config defaults give them:
  - `DeepSeekV2Lite` (deepseek-ai/DeepSeek-V2-Lite): 27 layers, d 2048, 16 heads, MLA with no
    q latent (q_lora_rank null), kv_lora_rank 512, nope 128 / rope 64 / v 128, the first
    layer dense (SwiGLU 10944), then 64 routed experts of 1408 (top-6, softmax, not
    renormalized, routed_scaling_factor 1.0) beside 2 shared ones; vocab 102400; RoPE θ
    10000 with YaRN (factor 40 over 4096, beta 32 / 1, mscale = mscale_all_dim = 0.707).
  - `DeepSeekV3` (deepseek-ai/DeepSeek-V3): 61 layers, d 7168, 128 heads, q_lora_rank 1536,
    kv_lora_rank 512, the first 3 layers dense (SwiGLU 18432), then 256 routed experts of
    2048 (top-8 of sigmoid scores within the 4 best of 8 groups, a balancing bias,
    renormalized, times 2.5) beside 1 shared; vocab 129280; YaRN factor 40, mscale 1.0.
    Its multi-token-prediction layer (the 62nd of the hub checkpoint: 671B + 14B = 685B)
    is not in the model: the counts are the 671B main model's. `DeepSeekV3Mtp` adds it
    (layers.mtp: depth 1, loss weight 0.1), sharing the main embedding and head.
Float32 params, bfloat16 compute, full remat, the loss over 8 vocab tiles, FSDP over the
slice (configs/llama.py's `_Llama`).
"""
import fiddle as fdl

from configs import lm, moe
from configs import llama
from spmdtask.layers.attention.mla import MlaConfig
from spmdtask.layers.moe import MoeConfig
from spmdtask.layers.rope import YarnScaling
from spmdtask.layers.lm_splits import WeightSplit
from spmdtask.registry import register
from spmdtask.task import Task

# MLA's weights FSDP-split like the others: d_model, and the latent ranks of the
# up-projections, over both FSDP axes; heads over `model`. The MTP projection's 2·d_model too.
MLA_WEIGHTS = dict(mla_q_down=(llama.FSDP, None), mla_q_up=(llama.FSDP, "model", None),
                   mla_kv_down=(llama.FSDP, None), mla_kv_up=(llama.FSDP, "model", None),
                   mtp_proj=(llama.FSDP, None))
V3_YARN = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
               beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def deepseek_model(*, mla: dict, yarn: dict | None, moe_fields: dict, num_heads: int,
                   **fields) -> fdl.Config:
  """A DeepSeek TransformerLm: `configs.moe.moe_model` (Llama-style, FSDP) with MLA (`mla`:
  MlaConfig fields, `yarn`: its YarnScaling fields or None); head_dim = the MLA query's
  (nope + rope: the attention FLOPs' width), every head its own KV head."""
  cfg = moe.moe_model(moe=moe_fields, num_heads=num_heads, num_kv_heads=num_heads,
                      head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
                      norm_eps=1e-6, **fields)
  cfg.mla = fdl.Config(MlaConfig, **mla,
                       rope_scaling=fdl.Config(YarnScaling, **yarn) if yarn else None)
  for k, v in MLA_WEIGHTS.items():
    setattr(cfg.weight_split_dims_mapping, k, v)
  return cfg


@register
class DeepSeekV2Lite(llama._Llama):  # pylint: disable=protected-access
  """DeepSeek-V2-Lite (15,706,484,224 params, 2,661,150,208 active; module doc) on v5p-128
  (64 chips; --plan_topology=v5p:4x4x4) as MaxText's DeepSeek end-to-end script trains it:
  FSDP over all 64 chips, 4 rows × 4096 tokens per chip (global 256 rows), full remat with
  each layer's input on the host (`full_offloaded`: 3.6 GiB fewer device temporaries, 6.2
  against 9.8 GiB, for 3.2 GiB a step over the host link; compare_maxtext's
  `deepseek2_16b_v5p128`, where MaxText keeps them on the device: 11.25 GiB)."""
  batch_size = 256
  seq_len = 4096
  eos_id = 100001
  ici_mesh_shape = (1, -1, 4, 1)

  def model(self):
    cfg = deepseek_model(
        mla=dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128),
        yarn=dict(V3_YARN, mscale=0.707, mscale_all_dim=0.707),
        moe_fields=dict(num_experts=64, top_k=6, d_ff=1408, num_shared_experts=2,
                        first_moe_layer=1, renormalize=False),
        vocab_size=102400, d_model=2048, num_layers=27, num_heads=16, d_ff=10944,
        max_seq_len=163840, rope_theta=10000.0)
    cfg.remat_policy = "full_offloaded"
    return cfg


@register
class DeepSeekV3(llama._Llama):  # pylint: disable=protected-access
  """DeepSeek-V3 (671,026,419,200 params, 37,552,297,472 active; module doc) on v5p-1024
  (512 chips; --plan_topology=v5p:8x8x8): FSDP 16 x 32, 1 row × 4096 tokens per chip,
  full remat; the balancing bias moves 0.001 a step (DeepSeek-V3's pre-training rate)."""
  batch_size = 512
  seq_len = 4096
  eos_id = 1
  ici_mesh_shape = (1, -1, 16, 1)

  def model(self):
    return deepseek_model(
        mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128),
        yarn=V3_YARN,
        moe_fields=dict(num_experts=256, top_k=8, d_ff=2048, num_shared_experts=1,
                        first_moe_layer=3, score="sigmoid", renormalize=True,
                        routed_scaling_factor=2.5, n_group=8, topk_group=4, score_bias=True,
                        bias_update_rate=0.001),
        vocab_size=129280, d_model=7168, num_layers=61, num_heads=128, d_ff=18432,
        max_seq_len=163840, rope_theta=10000.0)


@register
class DeepSeekV3Mtp(DeepSeekV3):
  """DeepSeekV3 with its multi-token-prediction layer (682,636,487,424 params, 38,240,398,080
  active; the layer 11,610,068,224, embedding and head shared): depth 1 (an MLA + MoE
  block), loss weight 0.1, DeepSeek-V3's for the last 4.8T of its 14.8T pre-training tokens
  (0.3 before): the phase the released checkpoint ends in, which training from it continues."""

  def model(self):
    cfg = super().model()
    cfg.mtp_depth, cfg.mtp_loss_weight = 1, 0.1
    return cfg


@register
class DeepSeekV3_V5p1024(DeepSeekV3):
  """DeepSeek-V3 doing the work of MaxText's published tuning config for v5p-1024
  (benchmarks/maxtext_v5p_model_configs.py `deepseek3_671b_v5p_1024`; compare_maxtext's
  `deepseek3_671b_v5p1024`): 6 rows x 8192 tokens per chip (global 3072 rows = 25M tokens),
  12 times `DeepSeekV3`'s 1 x 4096. Each layer's input alone is then 672 MiB a chip (43 GiB
  for 61 layers), so as that config offloads `decoder_layer_input` to the host, every
  layer's input goes to the host and the rest is recomputed (`full_offloaded`). The routed
  experts' d_ff runs in 2 slices (`moe.ff_chunks`): one slice's gathered weights (7 GiB in
  all three, not 21) and [393216, 1024] activations at a time, for temporaries 61.5 GiB in
  place of 68.7 at a step estimate 1.03x as long (60.2 s; XLA:TPU AOT)."""
  batch_size = 3072
  seq_len = 8192

  def model(self):
    cfg = super().model()
    cfg.remat_policy = "full_offloaded"
    cfg.moe.ff_chunks = 2
    return cfg


def tiny_v3(vocab_size: int = 256) -> fdl.Config:
  """A tiny DeepSeek-V3: 3 layers (the first dense), d 64, 4 heads, MLA (q latent 32, KV
  latent 16, nope 8 / rope 8 / v 8, YaRN), 8 experts of 32 in 4 groups (top-2 of the 2
  best groups), sigmoid scores, a balancing bias moving 0.01 a step, one shared expert;
  float32."""
  cfg = lm.tiny_model(vocab_size)
  cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads = 64, 3, 4, 4
  cfg.head_dim, cfg.d_ff, cfg.loss_vocab_tiles = 16, 96, 1
  cfg.mla = fdl.Config(MlaConfig, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=8, v_head_dim=8,
                       rope_scaling=fdl.Config(YarnScaling, factor=4.0,
                                               original_max_position_embeddings=64))
  cfg.moe = fdl.Config(MoeConfig, num_experts=8, top_k=2, d_ff=32, num_shared_experts=1,
                       first_moe_layer=1, score="sigmoid", renormalize=True,
                       routed_scaling_factor=2.5, n_group=4, topk_group=2, score_bias=True,
                       bias_update_rate=0.01)
  return cfg


@register
class TinyDeepSeekV3(lm.TinyLm):
  """`tiny_v3` on synthetic data; the experts over all devices (`expert` -1)."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.model = tiny_v3()
    moe.moe_split(cfg)
    cfg.ici_mesh_shape = (1, -1, 1, 1)
    return cfg


@register
class TinyDeepSeekV3Split(TinyDeepSeekV3):
  """TinyDeepSeekV3 on 8 devices: expert 2 x fsdp 2 x model (tensor) 2."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.ici_mesh_shape = (1, 2, 2, 2)
    return cfg


@register
class DeepSeekImport(llama.LlamaImport):
  """The experiment of a DeepSeek-V2 / V3 checkpoint converted by tools/convert_hf.py: its
  model_overrides.txt sets every model field, the MLA ones (`task.model.mla.*`) and the
  MoE ones (`task.model.moe.*`) and a V3's MTP depth (`task.model.mtp_depth`; its loss
  weight 0.1, DeepSeekV3Mtp's)."""

  def model(self):
    cfg = super().model()
    cfg.moe = fdl.Config(MoeConfig, num_experts=8, top_k=2, d_ff=cfg.d_ff)
    cfg.mla = fdl.Config(MlaConfig, rope_scaling=fdl.Config(YarnScaling))
    cfg.rope_scaling = None  # MLA's RoPE scaling is its own (mla.rope_scaling)
    cfg.mtp_loss_weight = 0.1
    cfg.weight_split_dims_mapping = fdl.Config(WeightSplit, **llama.WEIGHTS, **MLA_WEIGHTS)
    return cfg
