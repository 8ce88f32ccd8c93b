"""A Vision Transformer classifier whose weights carry split-dims mappings.

Patches of `patch_size`² pixels are embedded by one matmul, a learned position
embedding is added, non-causal pre-norm blocks (the LM's `Block`, `causal=False`, no
rotary positions) run as a `LayerStack`, and the mean of the tokens is classified.
"""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spmdtask.core import checks, sharding
from spmdtask.errors import ConfigError
from spmdtask.layers.attention import fused as fused_attention
from spmdtask.layers import stack as stack_lib
from spmdtask.layers import xent as xent_lib
from spmdtask.layers.base import RmsNorm, SplitDims, constrain, dense_init, weight
from spmdtask.layers.block import (Block, attention_flops, check_gather_at_once, num_params,
                                   train_flops)
from spmdtask.core.model import Metrics, Weighted, Work
from spmdtask.core.strategy import StackFacts, Strategy

BATCH = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class VitWeightSplit:
  """Split-dims mapping of every ViT weight (per weight dim, in the order shown)."""
  patch: SplitDims = (None, "fsdp")               # [patch_size² · channels, d_model]
  pos: SplitDims = (None, "fsdp")                 # [num_patches, d_model]
  head: SplitDims = ("fsdp", None)                # [d_model, num_classes]
  q: SplitDims = ("fsdp", "model", None)          # [d_model, heads, head_dim]
  kv: SplitDims = ("fsdp", "model", None)         # [d_model, heads, head_dim]
  o: SplitDims = ("model", None, "fsdp")          # [heads, head_dim, d_model]
  mlp_in: SplitDims = ("fsdp", "model")           # [d_model, d_ff]
  mlp_out: SplitDims = ("model", "fsdp")          # [d_ff, d_model]
  norm: SplitDims = (None,)                       # [d_model]
  gather_at_once: tuple[str, ...] = ()  # as lm_splits.WeightSplit's


@dataclasses.dataclass(frozen=True)
class VitActivationSplit:
  """Split-dims mapping of the main activations."""
  embed: SplitDims = (BATCH, None, None)          # [batch, patches, d_model]
  heads: SplitDims = (BATCH, None, "model", None) # [batch, patches, heads, head_dim]
  ff: SplitDims = (BATCH, None, "model")          # [batch, patches, d_ff]


class VisionTransformer(nn.Module):
  """ViT classifier: implements spmdtask.core.model's `Model` and `Stacked`.

  batch: `images` [b, H, W, C] float, `labels` [b] int32, `weights` [b] float (0 = padding).
  """
  image_size: int
  channels: int
  patch_size: int
  num_classes: int
  d_model: int
  num_layers: int
  num_heads: int
  head_dim: int
  d_ff: int
  norm_eps: float = 1e-6
  fprop_dtype: str = "float32"
  attention_impl: str = "auto"  # auto | xla | splash | cudnn (layers.attention.fused)
  remat_policy: str | None = "nothing_saveable"
  weight_split_dims_mapping: VitWeightSplit = VitWeightSplit()
  activation_split_dims_mapping: VitActivationSplit = VitActivationSplit()
  execution: Strategy | None = None  # set by the framework (task.pipeline)

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  def validate(self, mesh, global_batch_size: int) -> None:
    checks.positive("task.model", image_size=self.image_size, channels=self.channels,
                    patch_size=self.patch_size, num_classes=self.num_classes,
                    d_model=self.d_model, num_layers=self.num_layers, num_heads=self.num_heads,
                    head_dim=self.head_dim, d_ff=self.d_ff)
    checks.dtype("task.model.fprop_dtype", self.fprop_dtype)
    checks.remat_policy("task.model.remat_policy", self.remat_policy)
    fused_attention.check(self.attention_impl, mesh.devices.flat[0].platform, self.head_dim,
                          self.fprop_dtype)
    if self.image_size % self.patch_size:
      raise ConfigError(
          f"task.model.image_size={self.image_size} is not a multiple of "
          f"task.model.patch_size={self.patch_size}: pick a patch size that divides it.")
    mesh_shape = dict(mesh.shape)
    w, a = self.weight_split_dims_mapping, self.activation_split_dims_mapping
    d, h, hd, ff, t = self.d_model, self.num_heads, self.head_dim, self.d_ff, self.num_patches
    shapes = dict(patch=(self.patch_size ** 2 * self.channels, d), pos=(t, d),
                  head=(d, self.num_classes), q=(d, h, hd), kv=(d, h, hd), o=(h, hd, d),
                  mlp_in=(d, ff), mlp_out=(ff, d), norm=(d,))
    for k, shape in shapes.items():
      sharding.validate(getattr(w, k), shape, mesh_shape,
                        f"task.model.weight_split_dims_mapping.{k}")
    check_gather_at_once("task.model.weight_split_dims_mapping.gather_at_once", w.gather_at_once)
    for k, shape in dict(embed=("b", t, d), heads=("b", t, h, hd), ff=("b", t, ff)).items():
      sharding.validate(getattr(a, k), shape, mesh_shape,
                        f"task.model.activation_split_dims_mapping.{k}")
    if self.execution is not None:
      self.execution.validate(StackFacts(self.num_layers, global_batch_size, mesh))

  def check_batch(self, batch) -> None:
    """Labels must be in [0, num_classes) (ChecksBatch)."""
    y = np.asarray(batch["labels"])
    if y.size and (y.min() < 0 or y.max() >= self.num_classes):
      raise ConfigError(f"The data's labels are in [{y.min()}, {y.max()}], outside "
                        f"task.model.num_classes={self.num_classes}: set num_classes to the "
                        "dataset's number of classes.")

  def work_per_example(self, example) -> Work:
    n = num_params(self.clone(execution=None), example)
    return Work(train_flops(n, self.num_layers, self.d_model, self.num_patches),
                self.num_patches, attention_flops=attention_flops(
                    self.num_layers, self.d_model, self.num_patches, False))

  def with_pipeline(self, pipeline):
    return self.clone(execution=pipeline)

  def layout_maps(self):
    return stack_lib.layout_maps(("layers",), self.execution)

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    """images [b, H, W, C] -> class logits [b, num_classes] float32."""
    w, a = self.weight_split_dims_mapping, self.activation_split_dims_mapping
    dt = jnp.dtype(self.fprop_dtype)
    b, p = images.shape[0], self.patch_size
    g = self.image_size // p
    patches = images.reshape(b, g, p, g, p, self.channels).transpose(0, 1, 3, 2, 4, 5)
    patches = patches.reshape(b, g * g, p * p * self.channels).astype(dt)
    w_patch = weight(self, "patch", (p * p * self.channels, self.d_model), w.patch,
                     dense_init(0, 1))
    pos = weight(self, "pos", (g * g, self.d_model), w.pos, nn.initializers.normal(0.02))
    x = constrain(patches @ w_patch.astype(dt) + pos.astype(dt)[None], a.embed)
    kwargs = dict(d_model=self.d_model, num_heads=self.num_heads, num_kv_heads=self.num_heads,
                  head_dim=self.head_dim, d_ff=self.d_ff, mlp_activation="gelu",
                  rope_theta=None, norm_eps=self.norm_eps, dropout_rate=0.0, dtype=dt,
                  wsplit=w, asplit=a, causal=False, attention_impl=self.attention_impl)
    positions = jnp.broadcast_to(jnp.arange(g * g), (b, g * g))
    x, _ = stack_lib.LayerStack(Block, kwargs, self.num_layers, self.remat_policy,
                                execution=self.execution, name="layers")(x, positions, None)
    x = RmsNorm(self.d_model, self.norm_eps, w.norm, name="final_norm")(x)
    w_head = weight(self, "head", (self.d_model, self.num_classes), w.head, dense_init(0, 1))
    return (jnp.mean(x, axis=1) @ w_head.astype(dt)).astype(jnp.float32)

  def loss(self, batch) -> tuple[jax.Array, Metrics]:
    """Weighted mean cross entropy; metrics loss and accuracy, both weighted by example."""
    logits = self(batch["images"])
    xent = xent_lib.cross_entropy(logits, batch["labels"])
    weights = batch["weights"].astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
    n = jnp.sum(weights)
    loss_sum = jnp.sum(xent * weights)
    return loss_sum / jnp.maximum(n, 1.0), {"loss": Weighted(loss_sum, n),
                                            "accuracy": Weighted(jnp.sum(correct * weights), n)}
