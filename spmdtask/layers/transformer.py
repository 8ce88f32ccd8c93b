"""A decoder-only Transformer LM (Llama-style) whose weights carry split-dims mappings."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spmdtask.core import checks, sharding
from spmdtask.errors import ConfigError
from spmdtask.layers import costs as costs_lib
from spmdtask.layers import fused_attention
from spmdtask.layers import moe as moe_lib
from spmdtask.layers import stack as stack_lib
from spmdtask.layers import xent
from spmdtask.layers.attention import KvCache
from spmdtask.layers.base import RmsNorm, SplitDims, constrain, dense_init, weight
from spmdtask.layers.block import Block
from spmdtask.layers.rope import Llama3Scaling
from spmdtask.core.model import Metrics, Weighted, Work
from spmdtask.core.strategy import StackFacts, Strategy

BATCH = ("data", "fsdp")  # the default data axes of an activation's batch dim


@dataclasses.dataclass(frozen=True)
class WeightSplit:
  """Split-dims mapping of every LM weight (per weight dim, in the order shown)."""
  embedding: SplitDims = ("model", "fsdp")        # [vocab, d_model]
  unembed: SplitDims = ("fsdp", "model")          # [d_model, vocab]
  q: SplitDims = ("fsdp", "model", None)          # [d_model, heads, head_dim]
  kv: SplitDims = ("fsdp", "model", None)         # [d_model, kv_heads, head_dim]
  o: SplitDims = ("model", None, "fsdp")          # [heads, head_dim, d_model]
  mlp_in: SplitDims = ("fsdp", "model")           # [d_model, d_ff]
  mlp_out: SplitDims = ("model", "fsdp")          # [d_ff, d_model]
  norm: SplitDims = (None,)                       # [d_model]
  # Mixture of Experts (layers.moe): no `expert` axis by default (dense meshes have none);
  # expert parallelism sets e.g. expert_in=("expert", "fsdp", "model").
  router: SplitDims = (None, None)                # [d_model, experts]
  expert_in: SplitDims = (None, "fsdp", "model")  # [experts, d_model, expert d_ff]
  expert_out: SplitDims = (None, "model", "fsdp") # [experts, expert d_ff, d_model]


@dataclasses.dataclass(frozen=True)
class ActivationSplit:
  """Split-dims mapping of the main activations."""
  embed: SplitDims = (BATCH, None, None)          # [batch, seq, d_model]
  heads: SplitDims = (BATCH, None, "model", None) # [batch, seq, heads, head_dim]
  ff: SplitDims = (BATCH, None, "model")          # [batch, seq, d_ff]
  logits: SplitDims = (BATCH, None, "model")      # [batch, seq, vocab]


class TransformerLm(nn.Module):
  """Decoder-only LM: implements spmdtask.core.model's `Model`, `Decodable` and `Stacked`.

  `loss(batch)` is the training objective; `__call__` gives logits. The layers are a
  `LayerStack` (one compiled layer body whatever the depth, rematerialized under
  `remat_policy`: a preset of spmdtask.core.remat such as 'minimal' or
  'minimal_offloaded', a `jax.checkpoint_policies` policy name, or None); the framework sets
  `execution` from `task.pipeline` to pipeline them. Params stay float32; compute runs
  in `fprop_dtype`. With `loss_vocab_tiles` > 1 the loss never holds the whole
  [tokens, vocab] logits: the head and the cross entropy run over that many vocabulary
  tiles (`layers.xent`; one more head matmul in the backward), the head weight gathered once.
  """
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  max_seq_len: int = 2048
  mlp_activation: str = "swiglu"
  tie_embeddings: bool = False
  scale_tied_logits: bool = True  # tied head times d_model**-0.5; Llama's is unscaled (False)
  rope_theta: float = 10000.0
  rope_scaling: Llama3Scaling | None = None  # Llama 3.1 / 3.2 frequency scaling
  norm_eps: float = 1e-6
  qk_norm: bool = False  # q and k RMS-normalized per head before RoPE (Qwen3)
  dropout_rate: float = 0.0
  fprop_dtype: str = "float32"
  attention_impl: str = "auto"  # auto | xla | splash | cudnn (layers.fused_attention)
  remat_policy: str | None = "nothing_saveable"
  scan_unroll: int | bool = 1
  loss_vocab_tiles: int = 1  # >1: the loss's logits in that many vocab tiles (layers.xent)
  moe: moe_lib.MoeConfig | None = None  # Mixture of Experts FFN (layers.moe); None: dense
  weight_split_dims_mapping: WeightSplit = WeightSplit()
  activation_split_dims_mapping: ActivationSplit = ActivationSplit()
  # Set by the framework from task.pipeline (the Stacked protocol); not a user field.
  execution: Strategy | None = None

  # ------------------------------------------------------------------ the model contract

  def validate(self, mesh, global_batch_size: int) -> None:
    """Checks dims, dtypes, remat and every split-dims field, and the pipeline."""
    checks.positive("task.model", vocab_size=self.vocab_size, d_model=self.d_model,
                    num_layers=self.num_layers, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, d_ff=self.d_ff,
                    max_seq_len=self.max_seq_len, loss_vocab_tiles=self.loss_vocab_tiles)
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"task.model.num_heads={self.num_heads} is not a multiple of task.model.num_kv_heads="
          f"{self.num_kv_heads} (grouped-query attention shares each KV head among a whole "
          "group of query heads): make num_kv_heads a divisor of num_heads.")
    if self.head_dim % 2:
      raise ConfigError(f"task.model.head_dim={self.head_dim} must be even: rotary positions "
                        "rotate pairs of dims. Use an even head_dim.")
    if self.mlp_activation not in ("swiglu", "gelu"):
      raise ConfigError(f"task.model.mlp_activation={self.mlp_activation!r}: use 'swiglu' or "
                        "'gelu'.")
    if self.rope_scaling is not None:
      if not isinstance(self.rope_scaling, Llama3Scaling):
        raise ConfigError(f"task.model.rope_scaling={self.rope_scaling!r} is not a "
                          "Llama3Scaling: set it to fdl.Config(Llama3Scaling, ...) or None.")
      self.rope_scaling.validate("task.model.rope_scaling")
    checks.in_range("task.model.dropout_rate", self.dropout_rate, 0.0, 0.99)
    checks.dtype("task.model.fprop_dtype", self.fprop_dtype)
    checks.remat_policy("task.model.remat_policy", self.remat_policy)
    fused_attention.check(self.attention_impl, mesh.devices.flat[0].platform, self.head_dim,
                          self.fprop_dtype)
    mesh_shape = dict(mesh.shape)
    for where, (split, shape) in self.split_dims_fields().items():
      sharding.validate(split, shape, mesh_shape, where)
    _validate_moe(self, mesh_shape)
    if self.execution is not None:
      self.execution.validate(StackFacts(_moe_layers(self), global_batch_size, mesh))

  def check_batch(self, batch) -> None:
    """Rows of at most max_seq_len tokens, ids in [0, vocab_size): an error, never a silent
    clamp (ChecksBatch)."""
    _check_batch(self, batch)

  def work_per_example(self, example) -> Work:
    """Train FLOPs of the params a token uses (with `moe`: top_k of the routed experts),
    and tokens, of one example (`layers.costs.lm_work`)."""
    return costs_lib.lm_work(self.clone(execution=None), example)

  @nn.nowrap  # builds modules of its own: not a child of this one
  def layer_costs(self, batch_size: int, seq_len: int) -> list[float]:
    """Train FLOPs of [embedding, each layer, head with the loss] (LayerCosts)."""
    return costs_lib.lm_layer_costs(self, batch_size, seq_len)

  def activation_memory(self, rows: float, seq_len: int):
    """The largest activations and this config's fixes (SizesActivations; layers.costs)."""
    return costs_lib.lm_activation_memory(self, rows, seq_len)

  def with_pipeline(self, pipeline):
    return self.clone(execution=pipeline)

  def layout_maps(self):
    return stack_lib.layout_maps(("layers",), self.execution)

  def split_dims_fields(self) -> dict[str, tuple[SplitDims, tuple[int, ...]]]:
    """Config field -> (split-dims mapping, shape of the tensor it maps), for validation."""
    d, v, h, kv, hd, ff = (self.d_model, self.vocab_size, self.num_heads, self.num_kv_heads,
                           self.head_dim, self.d_ff)
    shapes = dict(embedding=(v, d), unembed=(d, v), q=(d, h, hd), kv=(d, kv, hd), o=(h, hd, d),
                  mlp_in=(d, ff), mlp_out=(ff, d), norm=(d,))
    shapes.update(self.moe.weight_shapes(d) if self.moe else {})
    acts = dict(embed=("b", "t", d), heads=("b", "t", h, hd), ff=("b", "t", ff),
                logits=("b", "t", v))
    out = {f"task.model.weight_split_dims_mapping.{k}":
           (getattr(self.weight_split_dims_mapping, k), s) for k, s in shapes.items()}
    out.update({f"task.model.activation_split_dims_mapping.{k}":
                (getattr(self.activation_split_dims_mapping, k), s) for k, s in acts.items()})
    return out

  # ------------------------------------------------------------------ decoding (Decodable)

  def cache_shape(self, batch_size: int, max_len: int) -> KvCache:
    """ShapeDtypeStructs of an empty decode cache: [num_layers, batch, max_len, kv_heads, hd]."""
    shape = (self.num_layers, batch_size, max_len, self.num_kv_heads, self.head_dim)
    leaf = jax.ShapeDtypeStruct(shape, jnp.dtype(self.fprop_dtype))
    return KvCache(leaf, leaf)

  def cache_split_dims(self, mesh_shape) -> KvCache:
    """PartitionSpecs [layers, *activation_split_dims_mapping.heads]; KV heads that do not
    divide their axes stay whole."""
    heads = list(self.activation_split_dims_mapping.heads)
    if self.num_kv_heads % sharding.shards(heads[2], mesh_shape):
      heads[2] = None
    spec = jax.sharding.PartitionSpec(None, *heads)
    return KvCache(spec, spec)

  # ------------------------------------------------------------------ the network

  def block_kwargs(self) -> dict:
    """The fields of one layer (`layers.block.Block`)."""
    return dict(d_model=self.d_model, num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, d_ff=self.d_ff,
                mlp_activation=self.mlp_activation, rope_theta=self.rope_theta,
                rope_scaling=self.rope_scaling, norm_eps=self.norm_eps, qk_norm=self.qk_norm,
                dropout_rate=self.dropout_rate, attention_impl=self.attention_impl,
                dtype=jnp.dtype(self.fprop_dtype), wsplit=self.weight_split_dims_mapping,
                asplit=self.activation_split_dims_mapping)

  def _stack(self) -> stack_lib.LayerStack:
    return stack_lib.LayerStack(Block, self.block_kwargs(), self.num_layers, self.remat_policy,
                                self.scan_unroll, self.execution, name="layers")

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               cache: KvCache | None = None, segment_ids: jax.Array | None = None, *,
               head: bool = True, moe_stats: bool = False):
    """tokens [b, t] int -> logits [b, t, vocab] float32.

    With a `cache` (see `cache_shape`), returns `(logits, new_cache)`: the
    tokens' keys/values are written at `positions` and attention reads the cache.
    With `segment_ids` [b, t] (packed rows; `positions` then restart per segment),
    a token attends only to earlier tokens of its own segment. With `head=False`, returns
    `(x, w, scale)` instead of the logits: the final-norm features x [b, t, d_model], the
    head weight w [d_model, vocab] float32 and the logits' scale (logits = scale · x @ w).
    `moe_stats=True` (no cache): `(that, stats)`, an MoE's per-row stats or None.
    """
    w, a = self.weight_split_dims_mapping, self.activation_split_dims_mapping
    dt = jnp.dtype(self.fprop_dtype)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    emb = weight(self, "embedding", (self.vocab_size, self.d_model), w.embedding,
                 nn.initializers.normal(1.0))
    # Cast before the lookup: the rows cross the mesh in the compute dtype.
    x = constrain(jnp.take(emb.astype(dt), tokens, axis=0), a.embed)
    x, cache, stats = _layer_stacks(self, x, positions, segment_ids, cache)
    x = RmsNorm(self.d_model, self.norm_eps, w.norm, name="final_norm")(x)
    if self.tie_embeddings:
      unembed, scale = emb.T, self.d_model ** -0.5 if self.scale_tied_logits else 1.0
    else:
      unembed = weight(self, "unembed", (self.d_model, self.vocab_size), w.unembed,
                       dense_init(0, 1))
      scale = 1.0
    if not head:
      return ((x, unembed, scale), stats) if moe_stats else (x, unembed, scale)
    logits = x @ unembed.astype(dt)
    logits = logits * scale if scale != 1.0 else logits
    logits = constrain(logits.astype(jnp.float32), a.logits)
    return (logits, stats) if moe_stats else logits if cache is None else (logits, cache)

  def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, Metrics]:
    """Weighted mean next-token cross entropy (+ an MoE's router losses: `_moe_losses`):
    (loss, {'loss': Weighted(sum of token losses, tokens), MoE metrics}). batch: `inputs`,
    `targets` [b, t] int32, `weights` [b, t] float (0 = padding); packed rows add
    `segment_ids` and per-segment `positions` [b, t] int32."""
    inputs, targets, tiles = batch["inputs"], batch["targets"], self.loss_vocab_tiles
    out, stats = self(inputs, batch.get("positions"), segment_ids=batch.get("segment_ids"),
                      head=tiles == 1, moe_stats=True)
    token_xent = (_tiled_loss(self, *out, targets) if tiles > 1
                  else xent.cross_entropy(out, targets))
    weights = batch["weights"].astype(jnp.float32)
    token_xent, metrics = _moe_losses(self.moe, stats, token_xent, weights)
    loss_sum, num_tokens = jnp.sum(token_xent * weights), jnp.sum(weights)
    return (loss_sum / jnp.maximum(num_tokens, 1.0),
            {"loss": Weighted(loss_sum, num_tokens), **metrics})

def _moe_layers(model: TransformerLm) -> int:
  """Layers of the stack named `layers` (the one the execution strategy runs)."""
  return model.num_layers - (model.moe.first_moe_layer if model.moe else 0)


def _layer_stacks(model: TransformerLm, x, positions, segment_ids, cache):
  """The layer stacks (called inside `model`'s compact `__call__`): (x, new cache, per-row
  MoE stats averaged over the MoE layers, or None when dense). With `moe.first_moe_layer` =
  k > 0 the first k layers are a dense scanned stack `dense_layers`; the MoE layers are
  `layers` (run by the strategy)."""
  if model.moe is None:
    x, cache = model._stack()(x, positions, segment_ids, cache=cache)  # pylint: disable=protected-access
    return x, cache, None
  k, n = model.moe.first_moe_layer, _moe_layers(model)
  caches = (None, None) if cache is None else (
      jax.tree.map(lambda c: c[:k], cache), jax.tree.map(lambda c: c[k:], cache))
  if k:
    x, dense_cache = stack_lib.LayerStack(
        Block, model.block_kwargs(), k, model.remat_policy, model.scan_unroll, None,
        name="dense_layers")(x, positions, segment_ids, cache=caches[0])
  stats = jnp.zeros((x.shape[0], len(moe_lib.STATS)), jnp.float32)
  (x, stats), moe_cache = stack_lib.LayerStack(
      moe_lib.MoeBlock, {**model.block_kwargs(), "moe": model.moe}, n, model.remat_policy,
      model.scan_unroll, model.execution, name="layers")((x, stats), positions, segment_ids,
                                                         cache=caches[1])
  if cache is not None:
    cache = moe_cache if not k else jax.tree.map(
        lambda a, b: jnp.concatenate([a, b]), dense_cache, moe_cache)
  return x, cache, stats / n


def _moe_losses(cfg: moe_lib.MoeConfig | None, stats, token_xent, weights):
  """Each row's `aux_loss_coef · aux + z_loss_coef · z` (means over the MoE layers) added to
  its tokens' losses, and `layers.moe.STATS` as token-weighted means over rows; a dense
  model's (stats None) unchanged, no metrics."""
  if stats is None:
    return token_xent, {}
  row_tokens = jnp.sum(weights, axis=1)
  extra = cfg.aux_loss_coef * stats[:, 0] + cfg.z_loss_coef * stats[:, 1]
  metrics = {name: Weighted(jnp.sum(stats[:, i] * row_tokens), jnp.sum(row_tokens))
             for i, name in enumerate(moe_lib.STATS)}
  return token_xent + extra[:, None], metrics


def _tiled_loss(model: TransformerLm, x, w, scale, targets) -> jax.Array:
  """Per-token cross entropy over `model.loss_vocab_tiles` vocab tiles (layers.xent)."""
  ws = model.weight_split_dims_mapping
  split = tuple(reversed(ws.embedding)) if model.tie_embeddings else ws.unembed  # [d, vocab]
  w_tiles = xent.head_tiles(w.astype(x.dtype), model.loss_vocab_tiles, split)
  return xent.tiled_cross_entropy(x, w_tiles, targets, model.vocab_size, scale,
                                  model.activation_split_dims_mapping.logits, split)


def _validate_moe(model: TransformerLm, mesh_shape) -> None:
  """The MoE fields; an expert split on a dense model; experts over the batch's axes."""
  ws, field = model.weight_split_dims_mapping, "task.model.weight_split_dims_mapping"
  expert_axes = {a for e in (ws.expert_in[0], ws.expert_out[0])
                 for a in sharding.entry_axes(e) if mesh_shape.get(a, 1) > 1}
  if model.moe is None:
    if mesh_shape.get("expert", 1) > 1 or expert_axes:
      raise ConfigError(
          f"An expert split on a dense model: the mesh's `expert` axis has size "
          f"{mesh_shape.get('expert', 1)} and {field}.expert_in / expert_out name "
          f"{sorted(expert_axes) or 'no axis'}, but task.model.moe is None (no experts to "
          "split). Set task.model.moe to a MoeConfig, or give the `expert` axis size 1 "
          "(task.ici_mesh_shape) and name no axis on the expert dims.")
    return
  if sharding.entry_axes(ws.expert_in[0]) != sharding.entry_axes(ws.expert_out[0]):
    raise ConfigError(f"{field}.expert_in[0]={ws.expert_in[0]!r} and expert_out[0]="
                      f"{ws.expert_out[0]!r} must split the expert dim alike.")
  model.moe.validate(model.num_layers, sharding.shards(ws.expert_in[0], mesh_shape))
  batch = sharding.entry_axes(model.activation_split_dims_mapping.embed[0])
  if not expert_axes <= set(batch):
    raise ConfigError(
        f"{field}.expert_in[0]={ws.expert_in[0]!r} splits the experts over "
        f"{sorted(expert_axes - set(batch))}, which do not split the batch "
        f"(task.model.activation_split_dims_mapping.embed[0]={batch}): tokens reach their "
        "experts by all-to-all over the batch's axes. Add those axes to the batch's entry "
        "(embed, heads, ff, logits), as TinyMoe does with ('data', 'expert', 'fsdp').")


def _check_batch(model: TransformerLm, batch) -> None:
  """TransformerLm.check_batch: row length against max_seq_len, ids against vocab_size."""
  seq_len = np.shape(batch["inputs"])[-1]
  if seq_len > model.max_seq_len:
    raise ConfigError(
        f"The data's rows hold {seq_len} tokens (the datasets' seq_len), more than "
        f"task.model.max_seq_len={model.max_seq_len}, the longest sequence this model is "
        f"made for. Set datasets[...].seq_len to at most {model.max_seq_len} (e.g. "
        f"--fdl_set=\"datasets['train'].seq_len={model.max_seq_len}\"), or raise "
        f"task.model.max_seq_len to {seq_len} if the model should take longer sequences.")
  for key in ("inputs", "targets"):
    x = np.asarray(batch[key])
    if x.size and (x.min() < 0 or x.max() >= model.vocab_size):
      raise ConfigError(
          f"The data's {key!r} hold token ids in [{x.min()}, {x.max()}], outside "
          f"task.model.vocab_size={model.vocab_size}. Set vocab_size to the tokenizer's "
          "vocabulary size (or more), or fix the dataset's vocab_size / tokenizer.")
