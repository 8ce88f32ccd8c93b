"""Qwen3 dense experiments: `--exp=qwen3.Qwen3_8B` etc.

The published architectures, each field from the model's Hugging Face config.json as
MaxText's model configs carry them (src/maxtext/configs/models/qwen3-{0.6b,8b,32b}.yml:
base_emb_dim, base_num_query_heads, base_num_kv_heads, base_mlp_dim,
base_num_decoder_layers, head_dim, vocab_size, normalization_layer_epsilon,
rope_max_timescale, use_qk_norm, logits_via_embedding = tie_word_embeddings) and
transformers' Qwen3Config for the context length (max_position_embeddings 40960). Qwen3 is
Llama's layer (SwiGLU, RMSNorm, RoPE, GQA) with q and k RMS-normalized per head before
RoPE (`qk_norm`); the 0.6B ties its embeddings (an unscaled head). Parameter counts: tests/
configs/test_qwen3.py; docs/families/qwen3.md.

`Qwen3Import` is the experiment tools/convert_hf.py writes a Qwen3 checkpoint's model
overrides for; `TinyQwen3` a 1M-param Qwen3 for tests and a CPU run.
"""
import fiddle as fdl

from configs import lm, llama
from spmdtask.registry import register

QWEN3_VOCAB, QWEN3_EOS = 151936, 151645  # <|im_end|>


def qwen3_model(**fields) -> fdl.Config:
  """A Qwen3 TransformerLm (llama.llama_model's, with QK-norm; RoPE θ 1e6, eps 1e-6)."""
  cfg = llama.llama_model(vocab_size=QWEN3_VOCAB, max_seq_len=40960, rope_theta=1e6,
                          norm_eps=1e-6, head_dim=128, **fields)
  cfg.qk_norm = True
  return cfg


class _Qwen3(llama._Llama):  # pylint: disable=protected-access
  eos_id = QWEN3_EOS


@register
class Qwen3_0_6B(_Qwen3):
  """Qwen3-0.6B (596,049,920 params; tied embeddings) on v5e-16: FSDP over 16 chips, 1 row
  × 8192 tokens per chip (global 16 rows), full remat."""
  batch_size = 16

  def model(self):
    return qwen3_model(d_model=1024, num_layers=28, num_heads=16, num_kv_heads=8, d_ff=3072,
                       tie_embeddings=True)


@register
class Qwen3_8B(_Qwen3):
  """Qwen3-8B (8,190,735,360 params) on v5p-64 (32 chips): FSDP over 32, 1 row × 8192
  tokens per chip (global 32 rows), full remat."""
  batch_size = 32

  def model(self):
    return qwen3_model(d_model=4096, num_layers=36, num_heads=32, num_kv_heads=8, d_ff=12288)


@register
class Qwen3_32B(_Qwen3):
  """Qwen3-32B (32,762,123,264 params; 64 query heads of 128: q wider than d_model) on
  v6e-256: FSDP over 16 × 16 chips (each gradient reduce-scatter within 16), 1 row × 8192
  tokens per chip (global 256 rows), full remat."""
  batch_size = 256
  ici_mesh_shape = (1, -1, 16, 1)

  def model(self):
    return qwen3_model(d_model=5120, num_layers=64, num_heads=64, num_kv_heads=8, d_ff=25600)


@register
class Qwen3Import(llama.LlamaImport):
  """The experiment of a Qwen3 checkpoint converted by tools/convert_hf.py: its
  model_overrides.txt sets every model field, as LlamaImport's does for a Llama."""
  eos_id = QWEN3_EOS

  def model(self):
    cfg = super().model()
    cfg.qk_norm = True
    return cfg


@register
class TinyQwen3(lm.TinyLm):
  """TinyLm's model as a Qwen3: QK-norm, tied embeddings."""

  def task(self):
    cfg = super().task()
    # A fresh tied head times d_model**-0.5 (configs/gemma3.py TinyGemma3 says why).
    cfg.model.qk_norm, cfg.model.tie_embeddings, cfg.model.scale_tied_logits = True, True, True
    return cfg
