"""Real-size Llama experiments: `--exp=llama.Llama3_8B` etc.

Each model is the published architecture (the fields of Meta's Hugging Face config.json:
hidden size, layers, heads, KV heads, MLP width, vocabulary, RMSNorm eps, RoPE θ and
scaling, tied embeddings, context length), so its parameter count is the published one
(tests/test_llama_configs.py). Params and optimizer state are float32 (master weights);
compute is bfloat16. Each names the slice it is sized for: the mesh fills the devices
present along `fsdp` (`ici_mesh_shape` holds a -1), and the global batch and
microbatching are chosen for that slice's chip memory. Plan one before booking it:
`--mode=plan --plan_devices=256` (shapes only; nothing is allocated).

Data: synthetic tokens by default. For a prepared corpus (tools/prepare_text_data.py
--tokenizer=hf:PATH/tokenizer.json, the model's own tokenizer), subclass and set
`data_dir`: train, eval and the decode prompts then read it (packed rows).

`LlamaImport` is the experiment `tools/convert_llama.py` writes its model overrides for.
"""
import functools

import fiddle as fdl
import optax

from configs import chat
from configs.tpu_flags import V5P_FLAGS, V6E_FLAGS
from spmdtask.experiment import Experiment
from spmdtask.inputs.prompts import SyntheticPromptInput
from spmdtask.inputs.synthetic import SyntheticLmInput
from spmdtask.inputs.text import PackedLmInput, TextPromptInput
from spmdtask.layers.rope import Llama3Scaling
from spmdtask.layers.lm_splits import ActivationSplit, WeightSplit
from spmdtask.layers.transformer import TransformerLm
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.registry import register
from spmdtask.task import DecodeParams, Task, TrainParams

LLAMA2_VOCAB, LLAMA3_VOCAB = 32000, 128256
LLAMA2_EOS, LLAMA3_EOS = 2, 128001  # </s>, <|end_of_text|>
# Llama 3.1 and 3.2 (HF rope_scaling, rope_type 'llama3'); 3.2 uses factor 32.
LLAMA31_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)


# FSDP over two mesh axes (`fsdp` x `fsdp_b`): each weight is gathered, and its gradient
# reduce-scattered, one axis at a time (layers.base.project). XLA:TPU compiles a reduce-scatter
# over a whole 256-chip slice as a full-size all-reduce; over 16 chips it stays one.
FSDP = ("fsdp", "fsdp_b")
BATCH = ("data", "fsdp", "fsdp_b")
MESH_AXES = ("data", "fsdp", "fsdp_b", "model")
WEIGHTS = dict(embedding=("model", FSDP), unembed=(FSDP, "model"), q=(FSDP, "model", None),
               kv=(FSDP, "model", None), o=("model", None, FSDP), mlp_in=(FSDP, "model"),
               mlp_out=("model", FSDP))
CONTEXT_MESH_AXES = ("data", "fsdp", "fsdp_b", "context", "model")  # Llama31_8B_128k
ACTIVATIONS = dict(embed=(BATCH, None, None), heads=(BATCH, None, "model", None),
                   ff=(BATCH, None, "model"), logits=(BATCH, None, "model"))


def llama_model(*, vocab_size: int, d_model: int, num_layers: int, num_heads: int,
                num_kv_heads: int, d_ff: int, max_seq_len: int, rope_theta: float,
                norm_eps: float = 1e-5, rope_scaling: dict | None = None,
                tie_embeddings: bool = False, head_dim: int | None = None,
                fprop_dtype: str = "bfloat16",
                loss_vocab_tiles: int = 8) -> fdl.Config[TransformerLm]:
  """A Llama TransformerLm: SwiGLU, RMSNorm, RoPE, an unscaled (HF) tied head, full remat,
  the loss over vocab tiles (Llama-3-8B at 8192 tokens per chip: the float32 logits would
  be 3.9 GiB)."""
  return fdl.Config(
      TransformerLm, vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
      num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim or d_model // num_heads,
      d_ff=d_ff, max_seq_len=max_seq_len, mlp_activation="swiglu",
      tie_embeddings=tie_embeddings, scale_tied_logits=False, rope_theta=rope_theta,
      rope_scaling=fdl.Config(Llama3Scaling, **rope_scaling) if rope_scaling else None,
      norm_eps=norm_eps, fprop_dtype=fprop_dtype, remat_policy="nothing_saveable",
      loss_vocab_tiles=loss_vocab_tiles,
      weight_split_dims_mapping=fdl.Config(WeightSplit, **WEIGHTS),
      activation_split_dims_mapping=fdl.Config(ActivationSplit, **ACTIVATIONS))


class _Llama(Experiment):
  """A published Llama on its target slice. Subclasses set the architecture and target.

  Attributes (class level):
    batch_size: the GLOBAL batch (rows of seq_len tokens) per optimizer step.
    seq_len: tokens per training row.
    num_microbatches: gradient accumulation steps per optimizer step.
    ici_mesh_shape: (data, fsdp, fsdp_b, model); -1 fills the devices present. FSDP runs
      over fsdp x fsdp_b: on slices of 256 chips and more, fsdp_b = 16 keeps each gradient
      reduce-scatter within 16 chips (see FSDP above).
    data_dir: None = synthetic tokens; else a prepared corpus (tools/prepare_text_data.py).
    xla_flags: task.xla_flags, the compiler flags the experiment's numbers rest on.
  """
  group = "pretrain"
  batch_size = 256
  seq_len = 8192
  num_microbatches = 1
  ici_mesh_shape = (1, -1, 1, 1)
  peak_learning_rate = 3e-4
  eos_id = LLAMA3_EOS
  max_decode_len = 256
  data_dir: str | None = None
  xla_flags: dict[str, str] | None = None

  def model(self) -> fdl.Config[TransformerLm]:
    raise NotImplementedError

  @functools.cache  # one config per instance: the datasets read its vocabulary
  def task(self) -> fdl.Config[Task]:
    lr = self.peak_learning_rate
    schedule = fdl.Config(optax.warmup_cosine_decay_schedule, init_value=0.0, peak_value=lr,
                          warmup_steps=2000, decay_steps=100_000, end_value=lr / 10)
    train = fdl.Config(TrainParams, num_train_steps=100_000, learning_rate=schedule,
                       optimizer=fdl.Partial(optax.adamw, b1=0.9, b2=0.95, weight_decay=0.1),
                       clip_grad_norm=1.0, num_microbatches=self.num_microbatches,
                       log_interval_steps=10, save_interval_steps=1000)
    decode = fdl.Config(DecodeParams, max_decode_len=self.max_decode_len, temperature=0.0, eos_id=self.eos_id)
    return fdl.Config(Task, model=self.model(), mesh_axis_names=MESH_AXES,
                      ici_mesh_shape=self.ici_mesh_shape, train=train, decode=decode,
                      xla_flags=self.xla_flags)

  def datasets(self) -> dict[str, fdl.Config]:
    model = self.task().model
    if self.data_dir:
      return {"train": fdl.Config(PackedLmInput, data_dir=self.data_dir, split="train",
                                  batch_size=self.batch_size, seq_len=self.seq_len, model=model),
              "eval": fdl.Config(PackedLmInput, data_dir=self.data_dir, split="eval",
                                 batch_size=self.batch_size, seq_len=self.seq_len, repeat=False,
                                 num_batches=4, model=model)}
    return {"train": fdl.Config(SyntheticLmInput, batch_size=self.batch_size,
                                seq_len=self.seq_len, vocab_size=model.vocab_size, seed=1),
            "eval": fdl.Config(SyntheticLmInput, batch_size=self.batch_size,
                               seq_len=self.seq_len, vocab_size=model.vocab_size, seed=2,
                               num_batches=4)}

  def decode_datasets(self) -> dict[str, fdl.Config]:
    model = self.task().model
    if self.data_dir:
      return {"prompts": fdl.Config(TextPromptInput, data_dir=self.data_dir, split="eval",
                                    batch_size=8, prompt_len=64, num_examples=8, model=model)}
    return {"prompts": fdl.Config(SyntheticPromptInput, batch_size=8, prompt_len=16,
                                  vocab_size=model.vocab_size, num_examples=16, seed=3)}


class _Llama2(_Llama):
  seq_len = 4096
  eos_id = LLAMA2_EOS


@register
class Llama2_7B(_Llama2):
  """Llama 2 7B (6,738,415,616 params; 4k context) on v5e-256: FSDP over 256 chips,
  batch 1 × 4096 tokens per chip (global 256 rows = 1M tokens), full remat."""
  ici_mesh_shape = (1, -1, 16, 1)  # FSDP 16 x 16 on 256 chips

  def model(self):
    return llama_model(vocab_size=LLAMA2_VOCAB, d_model=4096, num_layers=32, num_heads=32,
                       num_kv_heads=32, d_ff=11008, max_seq_len=4096, rope_theta=10000.0)


@register
class Llama2_13B(_Llama2):
  """Llama 2 13B (13,015,864,320 params; 4k context) on v5e-256: FSDP over 256 chips,
  batch 1 × 4096 tokens per chip (global 256 rows = 1M tokens), full remat."""
  ici_mesh_shape = (1, -1, 16, 1)  # FSDP 16 x 16 on 256 chips

  def model(self):
    return llama_model(vocab_size=LLAMA2_VOCAB, d_model=5120, num_layers=40, num_heads=40,
                       num_kv_heads=40, d_ff=13824, max_seq_len=4096, rope_theta=10000.0)


@register
class Llama2_70B(_Llama2):
  """Llama 2 70B (68,976,648,192 params; GQA 64/8; 4k context) on v5p-256 (128 chips):
  FSDP over 128, global batch 1024 × 4096 (4M tokens, Llama 2's) in 4 microbatches of
  2 rows per chip, full remat."""
  batch_size = 1024
  num_microbatches = 4
  peak_learning_rate = 1.5e-4

  def model(self):
    return llama_model(vocab_size=LLAMA2_VOCAB, d_model=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, d_ff=28672, max_seq_len=4096, rope_theta=10000.0)


@register
class Llama2_70B_V5p512(Llama2_70B):
  """Llama 2 70B on v5p-512 (256 chips), mirroring MaxText's published tuning config for it
  (benchmarks/maxtext_v5p_model_configs.py `llama2_70b_v5p_128`, 65.4% MFU measured by
  MaxText on 512 chips' worth, at the per-device batch of 4 that its measured revision and
  configs/tpu/v5p/llama2_70b.sh use; today's file says 2): FSDP over 256 chips, 4 × 4096
  tokens per chip (global 1024 rows = 4M tokens) with no microbatching. What differs: MaxText's
  `save_dot_except_mlpwi` remat keeps q/k/v, the attention out projection and the MLP out
  projection; spmdtask's `save_q_attn_out` keeps q and the attention out projection and
  recomputes k/v (5 GiB of temporaries less than keeping them, 76.6 against MaxText's 81.0
  GiB, for 0.5% more matmul FLOPs; `minimal` would also keep the attention context, 20 GiB
  more than a v5p holds)."""
  ici_mesh_shape = (1, -1, 16, 1)  # FSDP 16 x 16 on 256 chips
  num_microbatches = 1
  xla_flags = {"tpu": V5P_FLAGS}

  def model(self):
    cfg = super().model()
    cfg.remat_policy = "save_q_attn_out"
    return cfg


@register
class Llama2_70B_H100x64(Llama2_70B):
  """Llama 2 70B on 64 H100s (8 hosts of 8; plan it with --plan_topology=h100:8x8): MaxText's
  published GPU layout for it (its configs/gpu/models/llama2_70b.yml): FSDP over all 64
  GPUs, 6 rows × 4096 tokens per GPU (global 384 rows = 1.5M tokens), no microbatching,
  full remat, cuDNN fused attention (attention_impl 'auto' picks it on GPUs)."""
  batch_size = 384
  num_microbatches = 1


@register
class Llama3_8B(_Llama):
  """Llama 3 8B (8,030,261,248 params; 8k context, θ 500000) on v5e-256: FSDP over 256
  chips, batch 1 × 8192 tokens per chip (global 256 rows = 2M tokens), full remat but for
  the gathered q/k/v weights, which the backward keeps from the forward (remat
  `save_qkv_weights`: 1.2 GiB more temporaries for 1.5 GiB less all-gather per step), the
  MLP weights gathered at once over fsdp x fsdp_b (XLA:TPU keeps those all-gathers; each
  result counts the weight once, not 1 + 1/16 of it; compare_maxtext's
  `llama3_8b_v5e256`)."""
  ici_mesh_shape = (1, -1, 16, 1)  # FSDP 16 x 16 on 256 chips

  def model(self):
    cfg = llama_model(vocab_size=LLAMA3_VOCAB, d_model=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, d_ff=14336, max_seq_len=8192, rope_theta=500000.0)
    cfg.remat_policy = "save_qkv_weights"
    cfg.weight_split_dims_mapping.gather_at_once = ("mlp_in", "mlp_out")
    return cfg


@register
class Llama31_8B_V6e256(_Llama):
  """Llama 3.1 8B (8,030,261,248 params; 128k context by llama3 RoPE scaling ×8) on
  v6e-256, mirroring MaxText's published tuning config for it (benchmarks/
  maxtext_trillium_model_configs.py `llama3_1_8b_8192`, 45.46% MFU measured by MaxText):
  FSDP over 256 chips, 4 × 8192 tokens per chip (global 1024 rows = 8M tokens), no
  microbatching, splash attention, and that config's libtpu flags (`V6E_FLAGS`: a 98304 KiB
  scoped VMEM limit among them) as its `task.xla_flags`. Compare it with
  `tools/compare_maxtext.py`.
  Remat as MaxText's `custom` policy there: each layer's input and its q/k/v and out
  projections go to the host (`save_dot_except_mlp_offloaded`), the MLP is recomputed.
  What differs: MaxText sets splash blocks of 2048 with its fused backward kernel;
  spmdtask's splash picks its own block size."""
  ici_mesh_shape = (1, -1, 16, 1)  # FSDP 16 x 16 on 256 chips
  batch_size = 1024
  xla_flags = {"tpu": V6E_FLAGS}

  def model(self):
    cfg = llama_model(vocab_size=LLAMA3_VOCAB, d_model=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, d_ff=14336, max_seq_len=131072, rope_theta=500000.0,
                      rope_scaling=LLAMA31_SCALING)
    cfg.remat_policy = "save_dot_except_mlp_offloaded"
    cfg.weight_split_dims_mapping.gather_at_once = ("mlp_in", "mlp_out")  # as Llama3_8B's
    return cfg


@register
class Llama31_8B_128k(_Llama):
  """Llama 3.1 8B trained on rows of 131,072 tokens (its full context) on v5p-128 (64
  chips): each row's sequence split over a 16-chip `context` axis (8192 tokens per chip,
  zig-zag for causal balance), all_gather attention (layers.attention.context: each chip's
  queries against the whole row's K/V, gathered one KV head at a time, one splash call per
  KV head on TPU, its zig-zag causal mask skipping the masked blocks; the ring,
  `context_attention='ring'`, makes more HBM passes: docs/parallelism.md), 4 rows a step
  over fsdp 4; the weights FSDP
  over fsdp x context (64 shards). Plan it: `--mode=plan --plan_topology=v5p:4x4x4`."""
  seq_len = 131072
  batch_size = 4
  ici_mesh_shape = (1, -1, 1, 16, 1)

  def model(self):
    cfg = llama_model(vocab_size=LLAMA3_VOCAB, d_model=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, d_ff=14336, max_seq_len=131072, rope_theta=500000.0,
                      rope_scaling=LLAMA31_SCALING)
    fsdp = ("fsdp", "fsdp_b", "context")
    cfg.weight_split_dims_mapping = fdl.Config(WeightSplit, **{
        k: tuple(fsdp if e == FSDP else e for e in v) for k, v in WEIGHTS.items()})
    cfg.activation_split_dims_mapping = fdl.Config(ActivationSplit, **{
        k: (v[0], "context") + v[2:] for k, v in ACTIVATIONS.items()})
    cfg.context_attention = "all_gather"
    return cfg

  @functools.cache
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.mesh_axis_names = CONTEXT_MESH_AXES
    return cfg


@register
class Llama31_70B(_Llama):
  """Llama 3.1 70B (70,553,706,496 params; 128k context by llama3 RoPE scaling ×8) on
  v5p-256 (128 chips): FSDP over 128, rows of 8192 tokens (the pre-training length; longer
  rows need context parallelism), global batch 512 × 8192 (4M tokens) in 2 microbatches
  of 2 rows per chip, full remat. The same batch splits over 256 chips (1 row per chip),
  so `--plan_topology=v5e:16x16` plans it for v5e-256, where it does not fit."""
  batch_size = 512
  num_microbatches = 2
  peak_learning_rate = 1.5e-4

  def model(self):
    return llama_model(vocab_size=LLAMA3_VOCAB, d_model=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, d_ff=28672, max_seq_len=131072, rope_theta=500000.0,
                       rope_scaling=LLAMA31_SCALING)


@register
class Llama31_405B(_Llama):
  """Llama 3.1 405B (405,853,388,800 params; 128k context) on v5p-2048 (1024 chips):
  FSDP 256 × tensor parallel 4 (the `model` axis: heads, KV heads and the MLP split 4
  ways), global batch 2048 × 8192 (16M tokens, Llama 3's final batch) in 8 microbatches
  (1 row per FSDP shard each), full remat. State: 16 bytes/param / 1024 chips ≈ 6.3 GB."""
  batch_size = 2048
  num_microbatches = 8
  ici_mesh_shape = (1, -1, 16, 4)
  peak_learning_rate = 8e-5

  def model(self):
    return llama_model(vocab_size=LLAMA3_VOCAB, d_model=16384, num_layers=126, num_heads=128,
                       num_kv_heads=8, d_ff=53248, max_seq_len=131072, rope_theta=500000.0,
                       rope_scaling=LLAMA31_SCALING)


@register
class Llama32_1B(_Llama):
  """Llama 3.2 1B (1,235,814,400 params; tied embeddings; 128k context, scaling ×32) on
  v5e-64: FSDP over 64 chips, batch 1 × 8192 tokens per chip (global 64 rows = 0.5M
  tokens), full remat."""
  batch_size = 64

  def model(self):
    return llama_model(vocab_size=LLAMA3_VOCAB, d_model=2048, num_layers=16, num_heads=32,
                       num_kv_heads=8, head_dim=64, d_ff=8192, max_seq_len=131072,
                       rope_theta=500000.0, rope_scaling={**LLAMA31_SCALING, "factor": 32.0},
                       tie_embeddings=True)


@register
class Llama32_1B_Mpmd(Llama32_1B):
  """Llama 3.2 1B as an MPMD pipeline on v5e-8 (`--plan_topology=v5e:2x4`): two stages of
  4 chips, FSDP over each: embedding + layers 0-7 | layers 8-15 + head + the loss over 8
  vocab tiles (the tied embedding on both); 1F1B over 4 microbatches of 1 row × 8192
  tokens per chip (global 16 rows)."""
  batch_size = 16

  @functools.cache
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.pipeline = fdl.Config(MpmdConfig, layer_cuts=(8,), submesh_shapes=((1, 4, 1, 1),) * 2,
                              schedule="1f1b", num_microbatches=4)
    return cfg


@register
class Llama32_3B(_Llama):
  """Llama 3.2 3B (3,212,749,824 params; tied embeddings; 128k context, scaling ×32) on
  v5e-128: FSDP over 128 chips, batch 1 × 8192 tokens per chip (global 128 rows = 1M
  tokens), full remat."""
  batch_size = 128

  def model(self):
    return llama_model(vocab_size=LLAMA3_VOCAB, d_model=3072, num_layers=28, num_heads=24,
                       num_kv_heads=8, head_dim=128, d_ff=8192, max_seq_len=131072,
                       rope_theta=500000.0, rope_scaling={**LLAMA31_SCALING, "factor": 32.0},
                       tie_embeddings=True)


@register
class LlamaImport(Llama32_1B):
  """The experiment of a checkpoint converted by tools/convert_llama.py: its
  model_overrides.txt (a --flagfile) sets every model field (rope_scaling to None or its
  sub-fields), the data vocabulary, eos and the tokenizer. Float32 compute (decodes match
  HF's float32 greedy tokens), FSDP over the local devices, a small synthetic batch
  (8 × 128) so that a decode or a short fine-tune runs on one host. `--data_dir=DIR` trains
  and evaluates on a prepared dir (chat data: masked rows); `--mode=decode --chat_prompts=F
  --data_dir=DIR` decodes F's conversations rendered with DIR's chat template."""
  group = "families"
  batch_size = 8
  seq_len = 128
  max_decode_len = 64
  require_target_mask = False  # datasets[...].require_target_mask: plain text trains too

  def model(self):
    cfg = super().model()
    cfg.fprop_dtype = "float32"
    return cfg

  def datasets(self) -> dict[str, fdl.Config]:
    model = self.task().model
    return chat.with_data_dir(chat.in_model_vocab(super().datasets(), model), model,
                              self.batch_size, self.seq_len, self.require_target_mask)

  def decode_datasets(self) -> dict[str, fdl.Config]:
    model = self.task().model
    return chat.with_chat_prompts(chat.in_model_vocab(super().decode_datasets(), model), model)
