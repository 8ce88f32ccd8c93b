"""Registered LM experiments. `--exp=lm.TinyLm` etc."""
import functools

import fiddle as fdl
import optax

from configs import llama
from configs.chat import sft_data
from spmdtask.experiment import Experiment
from spmdtask.inputs.prompts import SyntheticPromptInput
from spmdtask.inputs.synthetic import SyntheticLmInput
from spmdtask.inputs.text import PackedLmInput, TextPromptInput
from spmdtask.layers.lora import LoraConfig
from spmdtask.layers.lm_splits import ActivationSplit, WeightSplit
from spmdtask.layers.transformer import TransformerLm
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.pipeline.spmd import PipelineConfig
from spmdtask.registry import register
from spmdtask.task import DecodeParams, Task, TrainParams


def tiny_model(vocab_size: int = 256) -> fdl.Config[TransformerLm]:
  """About 1.05M params: d 128, 4 layers, 4 heads (2 KV heads), SwiGLU 512; the loss over 4
  vocab tiles (as the real-size LMs': layers.xent), so every strategy's tests run it."""
  return fdl.Config(TransformerLm, vocab_size=vocab_size, d_model=128, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=32, d_ff=512, max_seq_len=256,
                    loss_vocab_tiles=4,
                    weight_split_dims_mapping=fdl.Config(WeightSplit),
                    activation_split_dims_mapping=fdl.Config(ActivationSplit))


@register
class TinyLm(Experiment):
  """1.05M-param LM on synthetic data; all devices data parallel."""
  group = "tiny"
  batch_size = 16
  seq_len = 64

  def task(self) -> fdl.Config[Task]:
    schedule = fdl.Config(optax.warmup_cosine_decay_schedule, init_value=0.0, peak_value=3e-3,
                          warmup_steps=5, decay_steps=200, end_value=3e-4)
    train = fdl.Config(TrainParams, num_train_steps=20, learning_rate=schedule,
                       optimizer=fdl.Partial(optax.adamw, b2=0.95, weight_decay=0.01),
                       log_interval_steps=5)
    decode = fdl.Config(DecodeParams, max_decode_len=32, temperature=0.0, seed=0)
    return fdl.Config(Task, model=tiny_model(), mesh_axis_names=("data", "fsdp", "model"),
                      ici_mesh_shape=(-1, 1, 1), train=train, decode=decode)

  def datasets(self) -> dict[str, fdl.Config]:
    """'train' is endless; 'eval' is 100 held-out sequences (the last batch partial)."""
    vocab = 256
    return {"train": fdl.Config(SyntheticLmInput, batch_size=self.batch_size,
                                seq_len=self.seq_len, vocab_size=vocab, seed=1),
            "eval": fdl.Config(SyntheticLmInput, batch_size=self.batch_size,
                               seq_len=self.seq_len, vocab_size=vocab, seed=2, num_examples=100)}

  def decode_datasets(self) -> dict[str, fdl.Config]:
    return {"prompts": fdl.Config(SyntheticPromptInput, batch_size=8, prompt_len=8,
                                  vocab_size=256, num_examples=16, seed=3)}


@register
class TinyLmFsdpTp(TinyLm):
  """TinyLm on 8 devices: data 2 x fsdp 2 x model (tensor) 2."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.ici_mesh_shape = (2, 2, 2)
    return cfg


@register
class TinyLmFsdp(TinyLm):
  """TinyLm fully sharded over 8 devices: fsdp 8."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.ici_mesh_shape = (1, 8, 1)
    return cfg


@register
class TinyLmFsdp2(TinyLm):
  """TinyLm with FSDP over two mesh axes, as the big Llamas have it: fsdp 2 x fsdp_b 2 x
  model 2 (weights gathered and gradients reduce-scattered one axis at a time)."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.mesh_axis_names = llama.MESH_AXES
    cfg.ici_mesh_shape = (1, 2, 2, 2)
    cfg.model.weight_split_dims_mapping = fdl.Config(WeightSplit, **llama.WEIGHTS)
    cfg.model.activation_split_dims_mapping = fdl.Config(ActivationSplit, **llama.ACTIVATIONS)
    return cfg


@register
class TinyLmUneven(TinyLm):
  """Dims that do not divide their mesh axes: vocab 257, d_model 129, d_ff 375 on 2x2x2."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.model.vocab_size = 257
    cfg.model.d_model = 129
    cfg.model.d_ff = 375
    cfg.ici_mesh_shape = (2, 2, 2)
    return cfg

  def datasets(self) -> dict[str, fdl.Config]:
    sets = super().datasets()
    for cfg in sets.values():
      cfg.vocab_size = 257
    return sets

  def decode_datasets(self) -> dict[str, fdl.Config]:
    sets = super().decode_datasets()
    sets["prompts"].vocab_size = 257
    return sets


def _pipelined(cfg: fdl.Config[Task], ici_mesh_shape: tuple[int, ...], **pipeline) -> None:
  cfg.mesh_axis_names = ("stage", "data", "fsdp", "model")
  cfg.ici_mesh_shape = ici_mesh_shape
  cfg.pipeline = fdl.Config(PipelineConfig, **pipeline)


@register
class TinyLmPipeline(TinyLm):
  """TinyLm in a GPipe pipeline: stage 2 x data 2 x model 2, 4 microbatches."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    _pipelined(cfg, (2, 2, 1, 2), num_stages=2, num_microbatches=4)
    return cfg


@register
class TinyLmCircular(TinyLm):
  """TinyLm in a circular pipeline: stage 2 x data 2 x model 2, 2 repeats, 4 microbatches."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    _pipelined(cfg, (2, 2, 1, 2), num_stages=2, num_microbatches=4, circular_repeat=2)
    return cfg


@register
class TextLm(TinyLm):
  """TinyLm's model on a prepared text corpus (tools/prepare_text_data.py), packed rows.

  Set the data dir of 'train', 'eval' and the decode 'prompts' and the vocabulary of its
  meta.json (docs/data.md); each input checks task.model.vocab_size against meta.json (the
  inputs share the model's config, so an override of task.model reaches them).
  """
  batch_size = 16
  seq_len = 256

  @functools.cache  # one config per instance: the datasets share its model config
  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.train.num_train_steps = 400
    cfg.train.learning_rate.warmup_steps = 20
    cfg.train.learning_rate.decay_steps = 400
    cfg.train.log_interval_steps = 20
    cfg.train.eval_interval_steps = 100
    cfg.train.save_interval_steps = 200
    cfg.decode.max_decode_len = 160
    return cfg

  def datasets(self) -> dict[str, fdl.Config]:
    """'train' repeats; 'eval' is the first 8 batches of the eval split."""
    model = self.task().model
    return {"train": fdl.Config(PackedLmInput, split="train", batch_size=self.batch_size,
                                seq_len=self.seq_len, model=model),
            "eval": fdl.Config(PackedLmInput, split="eval", batch_size=self.batch_size,
                               seq_len=self.seq_len, repeat=False, num_batches=8, model=model)}

  def decode_datasets(self) -> dict[str, fdl.Config]:
    return {"prompts": fdl.Config(TextPromptInput, split="eval", batch_size=8, prompt_len=32,
                                  num_examples=8, model=self.task().model)}


@register
class TinyLmSft(TinyLm):
  """TinyLm fine-tuned on conversations: only the answers' tokens are targets, and the loss
  is their mean over the global batch (not per row). With no data dir the rows are
  synthetic conversation-like segments (SyntheticLmInput.target_mask); `--data_dir=DIR`
  (a prepared chat data dir, tools/prepare_chat_data.py) trains and evaluates on DIR's
  packed, masked documents instead (set task.model.vocab_size to its meta.json's)."""

  @functools.cache  # one config per instance: the datasets share its model config
  def task(self) -> fdl.Config[Task]:
    return super().task()

  def datasets(self) -> dict[str, fdl.Config]:
    """'train' is endless; 'eval' is 100 held-out rows (synthetic) or 8 batches (data dir)."""
    sets = super().datasets()
    model = self.task().model
    for cfg in sets.values():
      cfg.target_mask = True
    return {
        "train": fdl.Config(sft_data, data_dir="", synthetic=sets["train"], packed=fdl.Partial(
            PackedLmInput, split="train", batch_size=self.batch_size, seq_len=self.seq_len,
            model=model)),
        "eval": fdl.Config(sft_data, data_dir="", synthetic=sets["eval"], packed=fdl.Partial(
            PackedLmInput, split="eval", batch_size=self.batch_size, seq_len=self.seq_len,
            repeat=False, num_batches=8, model=model))}


@register
class TinyLmMpmd(TinyLm):
  """TinyLm as an MPMD pipeline on 8 devices: embedding + layer 0 on stage 0 (devices 0-3,
  data 2 x model 2), layers 1-3 + head + loss on stage 1 (devices 4-7, data 4); 1F1B over
  4 microbatches."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.pipeline = fdl.Config(MpmdConfig, layer_cuts=(1,),
                              submesh_shapes=((2, 1, 2), (4, 1, 1)), schedule="1f1b",
                              num_microbatches=4)
    return cfg


@register
class TinyLmMpmdTied(TinyLmMpmd):
  """TinyLmMpmd with tie_embeddings=True: the embedding lives on both stages."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.model.tie_embeddings = True
    return cfg


@register
class TinyLmMpmdAuto(TinyLmMpmd):
  """An 8-layer TinyLm as an MPMD pipeline on unequal stages: stage 0 on devices 0-1 (data
  2), stage 1 on devices 2-7 (data 6); layer_cuts="auto" picks the cuts from each layer's
  compiled cost on each submesh (the 6-device stage gets more layers). Batch 24 in 2
  microbatches of 12 rows (they split over 2 and over 6 data shards)."""
  batch_size = 24

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.model.num_layers = 8
    cfg.pipeline = fdl.Config(MpmdConfig, layer_cuts="auto",
                              submesh_shapes=((2, 1, 1), (6, 1, 1)), schedule="1f1b",
                              num_microbatches=2)
    return cfg


# Context parallelism: the seq dim of every activation split over a 'context' mesh axis.
CONTEXT_AXES = ("data", "fsdp", "context", "model")
CONTEXT_ACTIVATIONS = dict(embed=(("data", "fsdp"), "context", None),
                           heads=(("data", "fsdp"), "context", "model", None),
                           ff=(("data", "fsdp"), "context", "model"),
                           logits=(("data", "fsdp"), "context", "model"))


def with_context(cfg: fdl.Config[Task], ici_mesh_shape: tuple[int, ...],
                 context_attention: str = "all_gather") -> fdl.Config[Task]:
  """`cfg` on a (data, fsdp, context, model) mesh of `ici_mesh_shape`, every activation's
  sequence split over 'context' (attention across shards by `context_attention`)."""
  cfg.mesh_axis_names = CONTEXT_AXES
  cfg.ici_mesh_shape = ici_mesh_shape
  cfg.model.activation_split_dims_mapping = fdl.Config(ActivationSplit, **CONTEXT_ACTIVATIONS)
  cfg.model.context_attention = context_attention
  return cfg


@register
class TinyLmContext(TinyLm):
  """TinyLm with its sequence split over 4 devices (context 4 x data 2): each device holds
  a zig-zag quarter of every row; K/V all-gathered over 'context' in each layer."""

  def task(self) -> fdl.Config[Task]:
    return with_context(super().task(), (2, 1, 4, 1), "all_gather")


@register
class TinyLmContextRing(TinyLm):
  """TinyLmContext with ring attention: K/V blocks passed around the 4 'context' devices
  with ppermute, each attended with an online softmax."""

  def task(self) -> fdl.Config[Task]:
    return with_context(super().task(), (2, 1, 4, 1), "ring")


@register
class TinyLmLora(TinyLm):
  """TinyLm with LoRA adapters (rank 4, alpha 8) on every attention and MLP weight: only
  the adapters train (20.5K params; the 1.05M base frozen). Warm-start the base from a
  checkpoint with --fdl_set=task.train.init_checkpoint_dir=DIR."""

  def task(self) -> fdl.Config[Task]:
    cfg = super().task()
    cfg.model.lora = fdl.Config(LoraConfig, rank=4, alpha=8.0,
                                targets=("q", "k", "v", "o", "wi", "wg", "wo"))
    return cfg
