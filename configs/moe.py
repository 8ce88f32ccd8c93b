"""Registered Mixture-of-Experts experiments. `--exp=TinyMoe` etc.

Published sizes (`Mixtral_8x7B`, `Mixtral_8x22B`, `Qwen3_30B_A3B`, `DeepSeekMoE_16B`): the
fields of each model's Hugging Face config.json, so that its total and active parameter
counts are the published ones (tests/configs/test_moe.py), float32 params, bfloat16
compute, full remat and the loss over 8 vocab tiles (configs/llama.py's `_Llama`), sized
for a named slice. `MoeImport` is the experiment tools/convert_hf.py writes a Mixtral's or
Qwen3-MoE's model overrides for.
"""
import fiddle as fdl

from configs import llama, lm
from spmdtask.layers.moe import MoeConfig
from spmdtask.layers.lm_splits import ActivationSplit, WeightSplit
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.pipeline.spmd import PipelineConfig
from spmdtask.registry import register
from spmdtask.task import Task

MESH_AXES = ("data", "expert", "fsdp", "model")
BATCH = ("data", "expert", "fsdp")  # the expert axis splits the batch too (MaxText, Praxis)
ACTIVATIONS = dict(embed=(BATCH, None, None), heads=(BATCH, None, "model", None),
                   ff=(BATCH, None, "model"), logits=(BATCH, None, "model"))
EXPERT_WEIGHTS = dict(expert_in=("expert", "fsdp", "model"),
                      expert_out=("expert", "model", "fsdp"))


def moe_split(cfg: fdl.Config[Task]) -> None:
  """Expert parallelism on `cfg`'s model: experts over `expert`, the batch over BATCH."""
  cfg.mesh_axis_names = MESH_AXES
  cfg.model.weight_split_dims_mapping = fdl.Config(WeightSplit, **EXPERT_WEIGHTS)
  cfg.model.activation_split_dims_mapping = fdl.Config(ActivationSplit, **ACTIVATIONS)


@register
class TinyMoe(lm.TinyLm):
  """TinyLm's model with a Mixture of Experts in every layer: 8 SwiGLU experts of 128,
  top-2, one shared expert, dropless; the experts split over all devices (`expert` -1)."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.model.moe = fdl.Config(MoeConfig, num_experts=8, top_k=2, d_ff=128,
                               num_shared_experts=1)
    moe_split(cfg)
    cfg.ici_mesh_shape = (1, -1, 1, 1)
    return cfg


@register
class TinyMoeMpmd(TinyMoe):
  """TinyMoe as an MPMD pipeline on 8 devices: embedding + layer 0 on stage 0 (expert 2 x
  model 2), layers 1-3 + head + loss on stage 1 (expert 4); 1F1B over 4 microbatches."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.pipeline = fdl.Config(MpmdConfig, layer_cuts=(1,),
                              submesh_shapes=((1, 2, 1, 2), (1, 4, 1, 1)), schedule="1f1b",
                              num_microbatches=4)
    return cfg


@register
class TinyMoePipeline(TinyMoe):
  """TinyMoe in a GPipe pipeline: stage 2 x expert 2 x model 2, 4 microbatches."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.mesh_axis_names = ("stage",) + MESH_AXES
    cfg.ici_mesh_shape = (2, 1, 2, 1, 2)
    cfg.pipeline = fdl.Config(PipelineConfig, num_stages=2, num_microbatches=4)
    return cfg


def moe_model(*, moe: dict, qk_norm: bool = False, **fields) -> fdl.Config:
  """A Llama-style TransformerLm (`configs.llama.llama_model`) with `moe` (MoeConfig
  fields) in its layers; the router and the expert weights FSDP-split over d_model on
  `fsdp` x `fsdp_b` (no `expert` axis: each device runs every expert on its own tokens,
  as MaxText's ici_fsdp_parallelism=-1 does)."""
  cfg = llama.llama_model(**fields)
  cfg.moe = fdl.Config(MoeConfig, **moe)
  split = cfg.weight_split_dims_mapping  # FSDP over both FSDP axes, as every other weight
  split.router = (llama.FSDP, None)
  split.expert_in, split.expert_out = (None, llama.FSDP, "model"), (None, "model", llama.FSDP)
  cfg.qk_norm = qk_norm
  return cfg


def mixtral(*, d_model, num_layers, num_heads, d_ff, max_seq_len) -> fdl.Config:
  """Mixtral (HF MixtralForCausalLM): 8 SwiGLU experts, top-2, softmax renormalized over
  the two, GQA with 8 KV heads, vocab 32000, RoPE θ 1e6, RMSNorm eps 1e-5, untied."""
  return moe_model(moe=dict(num_experts=8, top_k=2, d_ff=d_ff), vocab_size=llama.LLAMA2_VOCAB,
                   d_model=d_model, num_layers=num_layers, num_heads=num_heads, num_kv_heads=8,
                   d_ff=d_ff, max_seq_len=max_seq_len, rope_theta=1e6)


@register
class Mixtral_8x7B(llama._Llama):  # pylint: disable=protected-access
  """Mixtral 8x7B (46,702,792,704 params, 12,879,925,248 active per token) on v5p-128
  (64 chips; plan it with --plan_topology=v5p:4x4x4) as MaxText's Mixtral end-to-end
  script runs it (per_device_batch_size=4 max_target_length=4096 ici_fsdp_parallelism=-1
  remat_policy=full attention=flash megablox=True): FSDP over all 64 chips (16 x 4), 4 rows × 4096
  tokens per chip (global 256 rows = 1M tokens), full remat, splash attention and megablox
  grouped matmuls (what attention_impl 'auto' and the dropless dispatch pick on TPU)."""
  batch_size = 256
  seq_len = 4096
  eos_id = llama.LLAMA2_EOS
  # FSDP 16 x 4: XLA:TPU compiles a reduce-scatter over all 64 chips as a full-size
  # all-reduce (each expert weight's gradient: 896 MiB a layer); over 16 and 4 it stays one.
  ici_mesh_shape = (1, -1, 4, 1)

  def model(self):
    cfg = mixtral(d_model=4096, num_layers=32, num_heads=32, d_ff=14336, max_seq_len=32768)
    # The experts' d over `fsdp` (256 a chip) and d_ff over `fsdp_b`: d over all 64 chips
    # leaves 64 a chip, which XLA:TPU lays out minor-most in the layer stack's bf16 weight
    # copies and gradients, padded to 128 (twice the bytes).
    split = cfg.weight_split_dims_mapping
    split.expert_in = (None, "fsdp", ("fsdp_b", "model"))
    split.expert_out = (None, ("fsdp_b", "model"), "fsdp")
    # The experts' ff dim in 7 slices of 2048 (megablox tiles): one slice's gathered weights
    # and [tokens * top_k, 2048] activations live at a time.
    cfg.moe.ff_chunks = 7
    return cfg


@register
class Mixtral_8x22B(Mixtral_8x7B):
  """Mixtral 8x22B v0.1 (140,620,634,112 params, 39,152,031,744 active) on v5p-512 (256
  chips): FSDP 16 x 16, 1 row × 4096 tokens per chip (global 256 rows), full remat."""
  ici_mesh_shape = (1, -1, 16, 1)

  def model(self):
    return mixtral(d_model=6144, num_layers=56, num_heads=48, d_ff=16384, max_seq_len=65536)


@register
class Qwen3_30B_A3B(llama._Llama):  # pylint: disable=protected-access
  """Qwen3-30B-A3B (30,532,122,624 params, 3,353,032,704 active): 48 layers of 128 experts
  of 768, top-8 renormalized, QK-norm, GQA 32/4 with head_dim 128 (q wider than d_model
  2048), vocab 151936, untied; on v5p-64 (32 chips): FSDP over 32, 2 rows × 4096 tokens per
  chip (global 64 rows), full remat."""
  batch_size = 64
  seq_len = 4096
  eos_id = 151645  # <|im_end|>

  def model(self):
    return moe_model(moe=dict(num_experts=128, top_k=8, d_ff=768), qk_norm=True,
                     vocab_size=151936, d_model=2048, num_layers=48, num_heads=32,
                     num_kv_heads=4, head_dim=128, d_ff=6144, max_seq_len=40960,
                     rope_theta=1e6, norm_eps=1e-6)


@register
class DeepSeekMoE_16B(llama._Llama):  # pylint: disable=protected-access
  """DeepSeekMoE 16B (16,375,728,128 params, 2,828,650,496 active): 28 layers, the first
  dense (SwiGLU 10944), then 64 routed experts of 1408 (top-6, softmax, not renormalized)
  beside 2 shared ones; multi-head attention (16 heads), vocab 102400, RoPE θ 10000,
  untied; on v5p-32 (16 chips): FSDP over 16, 4 rows × 4096 tokens per chip (global 64
  rows), full remat."""
  batch_size = 64
  seq_len = 4096
  eos_id = 100001

  def model(self):
    return moe_model(moe=dict(num_experts=64, top_k=6, d_ff=1408, num_shared_experts=2,
                              first_moe_layer=1, renormalize=False),
                     vocab_size=102400, d_model=2048, num_layers=28, num_heads=16,
                     num_kv_heads=16, d_ff=10944, max_seq_len=4096, rope_theta=10000.0,
                     norm_eps=1e-6)


@register
class MoeImport(llama.LlamaImport):
  """The experiment of a Mixtral or Qwen3-MoE checkpoint converted by tools/convert_hf.py:
  its model_overrides.txt sets every model field and the MoE ones (`task.model.moe.*`),
  as LlamaImport's does for a Llama."""

  def model(self):
    cfg = super().model()
    cfg.moe = fdl.Config(MoeConfig, num_experts=8, top_k=2, d_ff=cfg.d_ff)
    return cfg
