"""What every spmdtask layer shares: weights with split-dims metadata, activation constraints."""
import functools
from typing import Callable, Protocol, Sequence, runtime_checkable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from spmdtask.core import mesh as mesh_lib
from spmdtask.core.sharding import entry_axes, shards

SplitDims = tuple


def weight(module: nn.Module, name: str, shape: Sequence[int], split: SplitDims,
           init: Callable, dtype=jnp.float32, frozen: bool = False) -> jax.Array:
  """A weight (float32 unless `dtype`) whose `nn.Partitioned` box carries its split-dims
  mapping. `frozen` (a LoRA model's base, layers.lora) reads it through `stop_gradient`,
  so autodiff never forms its gradient."""
  w = module.param(name, nn.with_partitioning(init, tuple(split)), tuple(shape), dtype)
  return jax.lax.stop_gradient(w) if frozen else w


def dropout(x: jax.Array, rate: float, key: jax.Array, row_ids: jax.Array,
            which: int) -> jax.Array:
  """Inverted dropout of x [rows, ...]: row i's mask from (fold_in(key, which), row_ids[i])
  (`key`: uint32 key data), so it does not depend on how the batch is split."""
  keep = 1.0 - rate
  stream = jax.random.fold_in(jax.random.wrap_key_data(key), which)
  mask = jax.vmap(lambda i: jax.random.bernoulli(jax.random.fold_in(stream, i), keep,
                                                 x.shape[1:]))(row_ids)
  return jnp.where(mask, x / keep, jnp.zeros_like(x))


def constrain(x: jax.Array, split: SplitDims | None) -> jax.Array:
  """Pins an activation's sharding to its split-dims mapping, inside a mesh context, over
  its automatic axes (`core.mesh.constrain`: a shard_map's manual ones are split by hand).

  A no-op outside one (e.g. a layer applied eagerly in a unit test).
  """
  return x if split is None else mesh_lib.constrain(x, split)


def platform() -> str:
  """The platform the traced program is for: the context mesh's devices (a TPU topology
  compiled ahead of time on a CPU host says 'tpu'), else JAX's default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  return jax.default_backend() if mesh.empty else mesh.abstract_device.platform


class Quantizer(Protocol):
  """A quantized einsum (layers.quant.Quantization): inside a shard_map manual over `rows`
  it quantizes w's shard, `gather`s it whole and `scatter`s w's gradient; `amax` its
  delayed-scaling history (layers.quant.bound) or None, passed in as `history`."""
  amax: jax.Array | None

  def einsum(self, eqn: str, x: jax.Array, w: jax.Array, out_dtype=None,
             rows: tuple[str, ...] = (), w_axes=None, gather=None, scatter=None,
             history=None) -> jax.Array:
    ...

  def bound(self, module, name: str) -> "Quantizer":
    """Itself with `module`'s projection `name`'s amax history (delayed scaling)."""
    ...


@runtime_checkable
class Stored(Protocol):
  """A frozen weight held on the mesh as `parts` other than its dense array (layers.qlora's
  quantized LoRA base), each split as the weight's split-dims say; `shape` the dense
  weight's. `dense(parts, dtype)` is the weight made from whole parts."""
  parts: tuple[jax.Array, ...]
  shape: tuple[int, ...]

  def dense(self, parts, dtype) -> jax.Array:
    ...


def project(eqn: str, x: jax.Array, w: jax.Array | Stored, w_split: SplitDims,
            batch: SplitDims | None, dtype, out_dtype=None, gathered_name: str | None = None,
            at_once: bool = False, quant: Quantizer | None = None) -> jax.Array:
  """`jnp.einsum(eqn, x, w)` in `dtype` (the result in `out_dtype`, default `dtype`), x's
  dim 0 its batch (split over the axes of the entry `batch`), the result's dim 0 the same
  batch.

  Under FSDP (w split over axes that also split the batch) the product runs under a
  `jax.shard_map` manual over the batch's axes: each device casts its shard of w to
  `dtype`, gathers it whole (`gather`: one mesh axis at a time) and multiplies its own
  rows. The gradient then needs no rule of its own: the transpose of each all-gather is a
  reduce-scatter over that one axis, so w's gradient leaves the layer already reduced to
  each device's shard, in `dtype`. XLA:TPU compiles a reduce-scatter over a whole 256-chip
  slice as a full-size all-reduce; over one axis of a 16x16 mesh it stays a reduce-scatter,
  hence FSDP over two axes (`("fsdp", "fsdp_b")`) on big slices. Elsewhere (no mesh, no
  FSDP axis, a batch or weight dim that does not divide its axes) GSPMD partitions the
  plain einsum.

  `at_once` gathers the weight with one all-gather over all its axes (`gather_at_once`);
  its gradient still reduce-scatters one axis at a time.
  `quant` (layers.quant) makes the product quantized (int8 / fp8): under FSDP each device
  quantizes its shard and the gather moves the quantized values and their scales.
  `gathered_name` names the gathered whole weight (`checkpoint_name`) for the remat presets
  (spmdtask.core.remat): a preset that keeps it spares the backward its gather, as FSDP's
  "no reshard after forward" does, for the weight's size in memory. GSPMD's path gathers
  out of sight of a name: there is nothing to keep.
  A `Stored` w (frozen: no gradient) has its parts gathered (packed bytes cross the links)
  and made dense in `dtype` after the gather, per matmul (`_project_stored`).
  """
  if isinstance(w, Stored):
    return _project_stored(eqn, x, w, w_split, batch, dtype, out_dtype, gathered_name, at_once)
  mesh = jax.sharding.get_abstract_mesh()
  manual = batch_axes(mesh, batch, x.shape[0])
  w_axes = fsdp_axes(w.shape, w_split, manual)
  product = lambda x, w: jnp.einsum(eqn, x, w.astype(dtype), preferred_element_type=out_dtype)
  history = None if quant is None else quant.amax
  if quant is not None:
    product = lambda x, w: quant.einsum(eqn, x, w, out_dtype or dtype, history=history)
  if w_axes is None:
    return product(x, w)
  moved = moved_dtype(dtype)
  rows = P(manual, *[None] * (x.ndim - 1))
  out_ndim = len(eqn.split("->")[1])
  if quant is not None:
    # Quantized before the gather (in `moved`, as the float path, so w's gradient is
    # reduce-scattered in it): int8 / fp8 and scales cross the links.
    gather_q = (lambda a, axes: gather_at_once(a, axes)) if at_once else gather
    if history is not None:  # the amax history goes in as an argument (replicated)
      return jax.shard_map(
          lambda x, w, h: quant.einsum(eqn, x, w.astype(moved), out_dtype or dtype, manual,
                                       w_axes, gather_q, scatter, h),
          in_specs=(rows, P(*[a or None for a in w_axes]), P()),
          out_specs=P(manual, *[None] * (out_ndim - 1)), axis_names=set(manual))(x, w, history)
    product = lambda x, w: quant.einsum(eqn, x, w.astype(moved), out_dtype or dtype,
                                        manual, w_axes, gather_q, scatter)
    gathered = lambda w: w
  else:
    def gathered(w):
      whole = (gather_at_once if at_once else gather)(w.astype(moved), w_axes)
      return checkpoint_name(whole, gathered_name) if gathered_name else whole
  return jax.shard_map(lambda x, w: product(x, gathered(w)),
                       in_specs=(rows, P(*[a or None for a in w_axes])),
                       out_specs=P(manual, *[None] * (out_ndim - 1)),
                       axis_names=set(manual))(x, w)


def _project_stored(eqn: str, x: jax.Array, w: Stored, w_split: SplitDims,
                    batch: SplitDims | None, dtype, out_dtype, gathered_name: str | None,
                    at_once: bool) -> jax.Array:
  """`project` of a Stored weight: under FSDP (every part's dims divide their axes) each
  device gathers the parts whole and makes the weight dense in `dtype`; elsewhere GSPMD
  partitions the product of the dense weight."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = batch_axes(mesh, batch, x.shape[0])
  axes = [fsdp_axes(p.shape, w_split, manual) for p in w.parts]
  product = lambda x, whole: jnp.einsum(eqn, x, whole, preferred_element_type=out_dtype)
  if any(a is None for a in axes):
    return product(x, w.dense(w.parts, dtype))
  gather_parts = gather_at_once if at_once else gather

  def local(x, *parts):
    whole = w.dense(tuple(gather_parts(p, a) for p, a in zip(parts, axes)), dtype)
    return product(x, checkpoint_name(whole, gathered_name) if gathered_name else whole)
  out_ndim = len(eqn.split("->")[1])
  return jax.shard_map(local, in_specs=(P(manual, *[None] * (x.ndim - 1)),
                                        *[P(*[a or None for a in ax]) for ax in axes]),
                       out_specs=P(manual, *[None] * (out_ndim - 1)),
                       axis_names=set(manual))(x, *w.parts)


def fsdp_axes(shape: Sequence[int], split: SplitDims, manual: tuple[str, ...]
              ) -> tuple[tuple[str, ...], ...] | None:
  """Per dim of a weight of `shape` split as `split`, the axes of `manual` (the batch's,
  `batch_axes`) that split it: what `gather` gathers. None where there are none or a dim
  does not divide its axes (GSPMD then partitions the plain product)."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = tuple(tuple(a for a in entry_axes(e) if a in manual) for e in split)
  if not any(axes) or any(d % shards(a, mesh.shape) for d, a in zip(shape, axes)):
    return None
  return axes


def moved_dtype(dtype):
  """The dtype FSDP moves a weight's shards (and reduces its gradient) in: `dtype`, but
  float32 on XLA:CPU, which aborts on a bfloat16 reduce-scatter (AllReducePromotion)."""
  return jnp.float32 if platform() == "cpu" else dtype


def gather(w: jax.Array, axes: tuple[tuple[str, ...], ...]) -> jax.Array:
  """Inside a shard_map manual over `axes`: a weight's shard gathered whole, one mesh axis
  at a time (a dim's last axis first; `axes`: per dim, as `fsdp_axes` gives). Its
  transpose (`scatter`, also what autodiff gives) reduce-scatters over one axis at a time.

  On a 16x16 mesh the two all-gathers' results add up to 1 + 1/16 of the weight, but a
  chip receives what one all-gather over all 256 chips would bring it: 15/16 of the
  1/16 it gathers first, then 15/16 of the whole, together the 255/256 it lacks. One
  all-gather over both axes instead, XLA:TPU compiled as an all-reduce (twice the bytes
  received) for Llama-2-70B's weights on v5p-512 and for Llama-3-8B's k/v on v5e-256."""
  for dim, dim_axes in enumerate(axes):
    for axis in reversed(dim_axes):
      w = jax.lax.all_gather(w, axis, axis=dim, tiled=True)
  return w


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_at_once(w: jax.Array, axes: tuple[tuple[str, ...], ...]) -> jax.Array:
  """`gather` by one all-gather per dim over all its axes (the results count the weight
  once, not 1 + 1/16 of it on 16 x 16; a chip receives the same bytes); its transpose is
  `scatter`'s, one reduce-scatter per axis. Which all-gathers XLA keeps as such is its
  choice: on v5e-256 it keeps Llama-3-8B's q, o and MLP weights' (MaxText's are the same),
  but compiles its k/v's, and on v5p-512 Llama-2-70B's weights', as all-reduces (twice the
  bytes received)."""
  for dim, dim_axes in enumerate(axes):
    if dim_axes:
      w = jax.lax.all_gather(w, tuple(dim_axes), axis=dim, tiled=True)
  return w


def _gather_at_once_fwd(w, axes):
  return gather_at_once(w, axes), None


def _gather_at_once_bwd(axes, _, g):
  return (scatter(g, axes),)


gather_at_once.defvjp(_gather_at_once_fwd, _gather_at_once_bwd)


def scatter(g: jax.Array, axes: tuple[tuple[str, ...], ...]) -> jax.Array:
  """`gather`'s transpose: each device's whole `g` summed over `axes` and cut to its shard,
  one reduce-scatter per mesh axis (a dim's first axis first), each within that axis."""
  for dim, dim_axes in enumerate(axes):
    for axis in dim_axes:
      g = jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
  return g


def batch_axes(mesh, batch: SplitDims | None, rows: int) -> tuple[str, ...]:
  """The axes (of size > 1, not manual already) that split a batch of `rows` rows, or ()
  where there are none or they do not divide the rows."""
  if mesh.empty or batch is None:
    return ()
  axes = tuple(a for a in entry_axes(batch[0])
               if mesh.shape[a] > 1 and a not in mesh.manual_axes)
  return axes if axes and rows % shards(axes, mesh.shape) == 0 else ()


def manual_row_offset(rows: int) -> jax.Array | int:
  """The global id of this device's first row when `rows` rows per device are split by
  hand over the manual axes of the context (MPMD's per-device gradient accumulation runs
  a stage's part under a shard_map manual over its data axes), in mesh order; 0 outside
  one. Only valid where every manual axis splits the rows."""
  mesh = jax.sharding.get_abstract_mesh()
  index = 0
  for name in () if mesh.empty else mesh.manual_axes:
    index = index * dict(mesh.shape)[name] + jax.lax.axis_index(name)
  return index * rows


def dense_init(in_axis, out_axis) -> Callable:
  """Fan-in scaled truncated normal for an einsum weight with grouped in/out dims."""
  return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                          in_axis=in_axis, out_axis=out_axis)


class RmsNorm(nn.Module):
  """RMSNorm over the last dim, computed in float32, times `offset + scale` (offset 0: the
  Llama convention, scale initialised to 1; 1.0: Gemma's `1 + w`, w initialised to 0)."""
  dim: int
  eps: float = 1e-6
  split: SplitDims = (None,)
  frozen: bool = False  # a LoRA model's (layers.lora): no gradient; kept in float32
  offset: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.initializers.zeros if self.offset else nn.initializers.ones
    scale = weight(self, "scale", (self.dim,), self.split, init, frozen=self.frozen)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * (scale + self.offset if self.offset else scale)).astype(x.dtype)
