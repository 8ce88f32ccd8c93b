"""Gemma 3 (text) experiments: `--exp=gemma3.Gemma3_27B` etc.

The published architectures, from each model's Hugging Face config.json (the text model's:
`text_config` of the multimodal 4B, 12B and 27B, whose unset fields take transformers'
Gemma3TextConfig defaults: vocab 262208, 8 heads / 4 KV heads of 256,
query_pre_attn_scalar 256, RoPE θ 1e6 global / 1e4 local, window pattern 6, context
131072), as MaxText's model configs carry them (src/maxtext/configs/models/gemma3-{4b,12b,
27b}.yml: base_emb_dim, base_num_query_heads, base_num_kv_heads, base_mlp_dim,
base_num_decoder_layers, head_dim, sliding_window_size 1024, local_rope_max_timescale,
rope_max_timescale, rope_linear_scaling_factor 8, its 5-local-1-global
GEMMA3_ATTENTION_PATTERN, and the 27B's query scale (d_model / heads = 168) ** -0.5 in
models/gemma3.py; MaxText pads the vocabulary to 262144, HF's checkpoints hold 262208
rows). Gemma 3 1B (text only, not in MaxText): google/gemma-3-1b's config.json — d_model
1152, 26 layers, 4 heads / 1 KV head of 256, MLP 6912, vocab 262144, window 512, no RoPE
scaling, context 32768.

Gemma's layer (TransformerLm fields): sandwich norms, every RMSNorm `1 + w`, QK-norm, GeGLU
(tanh GELU), the embedding times sqrt(d_model), a tied unscaled head, five local layers
(sliding window, RoPE 1e4) to one global (RoPE 1e6, linear scaling 8 from 4B up).
Parameter counts: tests/configs/test_gemma3.py; docs/families/gemma3.md.

`Gemma3Import` is the experiment tools/convert_hf.py writes a Gemma 3 checkpoint's model
overrides for; `TinyGemma3` a 1M-param Gemma 3 for tests and a CPU run.
"""
import fiddle as fdl

from configs import lm, llama
from spmdtask.layers.rope import LinearScaling
from spmdtask.registry import register

GEMMA3_VOCAB, GEMMA3_1B_VOCAB = 262208, 262144
GEMMA3_EOS = 106  # <end_of_turn>
PATTERN = ("local",) * 5 + ("global",)


def gemma3_model(*, d_model: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, d_ff: int, sliding_window: int = 1024,
                 query_pre_attn_scalar: float = 256, vocab_size: int = GEMMA3_VOCAB,
                 max_seq_len: int = 131072, rope_scaling: float | None = 8.0) -> fdl.Config:
  """A Gemma 3 TransformerLm on llama.llama_model's splits, remat and vocab tiles."""
  cfg = llama.llama_model(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                          num_heads=num_heads, num_kv_heads=num_kv_heads, d_ff=d_ff,
                          max_seq_len=max_seq_len, rope_theta=1e6, norm_eps=1e-6,
                          tie_embeddings=True, head_dim=head_dim)
  cfg.rope_scaling = fdl.Config(LinearScaling, factor=rope_scaling) if rope_scaling else None
  gemma3_layer(cfg, sliding_window, query_pre_attn_scalar)
  return cfg


def gemma3_layer(cfg: fdl.Config, sliding_window: int, query_pre_attn_scalar: float) -> None:
  """Sets the fields that make a TransformerLm config Gemma 3's."""
  cfg.mlp_activation, cfg.qk_norm = "geglu", True
  cfg.attention_pattern, cfg.sliding_window, cfg.local_rope_theta = PATTERN, sliding_window, 1e4
  cfg.attention_scale = query_pre_attn_scalar ** -0.5
  cfg.norm_offset, cfg.sandwich_norms, cfg.scale_embedding = 1.0, True, True


class _Gemma3(llama._Llama):  # pylint: disable=protected-access
  eos_id = GEMMA3_EOS


@register
class Gemma3_1B(_Gemma3):
  """Gemma 3 1B (999,885,952 params) on v5e-16: FSDP over 16 chips, 1 row × 8192 tokens
  per chip (global 16 rows), full remat."""
  batch_size = 16

  def model(self):
    return gemma3_model(d_model=1152, num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256,
                        d_ff=6912, sliding_window=512, vocab_size=GEMMA3_1B_VOCAB,
                        max_seq_len=32768, rope_scaling=None)


@register
class Gemma3_4B(_Gemma3):
  """Gemma 3 4B, text (3,880,263,168 params) on v5e-64: FSDP over 64 chips, 1 row × 8192
  tokens per chip (global 64 rows), full remat."""
  batch_size = 64

  def model(self):
    return gemma3_model(d_model=2560, num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256,
                        d_ff=10240)


@register
class Gemma3_12B(_Gemma3):
  """Gemma 3 12B, text (11,766,034,176 params) on v5p-128 (64 chips): FSDP over 64, 1 row ×
  8192 tokens per chip (global 64 rows), full remat."""
  batch_size = 64

  def model(self):
    return gemma3_model(d_model=3840, num_layers=48, num_heads=16, num_kv_heads=8,
                        head_dim=256, d_ff=15360)


@register
class Gemma3_27B(_Gemma3):
  """Gemma 3 27B, text (27,009,346,304 params; query scale 168 ** -0.5) on v6e-256: FSDP
  over 16 × 16 chips (each gradient reduce-scatter within 16), 1 row × 8192 tokens per chip
  (global 256 rows), full remat."""
  batch_size = 256
  ici_mesh_shape = (1, -1, 16, 1)

  def model(self):
    return gemma3_model(d_model=5376, num_layers=62, num_heads=32, num_kv_heads=16,
                        head_dim=128, d_ff=21504, query_pre_attn_scalar=5376 // 32)


@register
class Gemma3Import(llama.LlamaImport):
  """The experiment of a Gemma 3 checkpoint converted by tools/convert_hf.py (a
  gemma3_text one, or a gemma3's language model): its model_overrides.txt sets every model
  field (rope_scaling None or its factor), as LlamaImport's does for a Llama."""
  eos_id = GEMMA3_EOS

  def model(self):
    cfg = super().model()
    cfg.rope_scaling = fdl.Config(LinearScaling, factor=8.0)
    gemma3_layer(cfg, 1024, 256)
    return cfg


@register
class TinyGemma3(lm.TinyLm):
  """TinyLm's model as a Gemma 3: layers local, local, global, local (window 8 of the
  64-token rows), the rest of Gemma's layer as above."""

  def task(self):
    cfg = super().task()
    gemma3_layer(cfg.model, 8, 24)
    cfg.model.attention_pattern = ("local", "local", "global")
    # A fresh tied head times d_model**-0.5: unscaled (HF's), logits of a random init have a
    # std of ~sqrt(d_model) (converted checkpoints keep HF's: Gemma3Import).
    cfg.model.tie_embeddings, cfg.model.scale_tied_logits = True, True
    cfg.model.rope_scaling = fdl.Config(LinearScaling, factor=8.0)
    return cfg
