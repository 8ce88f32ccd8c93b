"""Quantized training matmuls (int8, fp8) for `base.project`, on qwix's quantizer.

The model field `quantization` (None | 'int8' | 'fp8') makes every projection that goes
through `base.project` (attention q/k/v/o, the dense MLP, shared experts) a quantized
product, and the routed experts' grouped matmuls (`layers.quant_experts`); the router,
norms, embedding and the head with its loss stay in float.

- int8: x per row (token) and w per output channel, dynamic absmax scales (symmetric,
  bound 127.5, qwix's); the backward quantizes the incoming gradient to int8 too, per
  channel, with the forward operand's scale shifted onto it (AQT's and qwix's scheme), so
  all three matmuls of a projection run int8 x int8 -> int32.
- fp8: e4m3 operands forward, e5m2 gradients backward, one scale per tensor, computed from
  the current step's absmax ('current' scaling) or from an amax history ('delayed', the
  projections only): each projection's `{name}_amax_buffer` [3 (x, w, gradient), H] holds
  the last H steps' amaxes; a step quantizes with each row's max (the current amax while
  the history is empty, the first step) and its backward puts the step's three amaxes in
  the buffer's gradient slot, which `update_histories` shifts in after the step (the
  buffers of `core.model.Buffered`).

Why qwix and not AQT (aqtp): both install beside jax 0.10.2 / flax 0.12; qwix is the one
MaxText moved to, is maintained, exposes its quantizer as plain functions (calibrate,
scale, quantize, a QArray-aware dot_general) that a custom VJP can call around our own
FSDP collectives, and supports fp8 e4m3/e5m2 with the same calls. Its pieces are used
as-is; what this module adds is the sharding: under FSDP the weight's shard is quantized
BEFORE its all-gather (its absmax reduced over the axes that split its contracted dims
first, a few floats), so int8/fp8 values and their scales cross the links, not bf16
copies. Every scale that reduces over a split dim is reduced over the axes that split it
(`pmax`), so a sharded program computes the scales a one-device program would: the same
math on any layout.
"""
import dataclasses
import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from qwix._src.core import dot_general as qdot
from qwix._src.core import einsum_info
from qwix._src.core import qarray
# qwix's own helpers for its quantized backward (pinned: setup.py's qwix range).
from qwix._src.core.dot_general_qt import (_apply_rhs_scale_to_lhs,
                                          _update_dimension_numbers_for_backward)

from spmdtask.core.train_state import BUFFER_SUFFIX
from spmdtask.errors import ConfigError

KINDS = ("int8", "fp8")
SCALINGS = ("current", "delayed")

Axes = tuple[tuple[str, ...], ...]  # per dim of an operand, the manual axes that split it


HISTORY = "_amax" + BUFFER_SUFFIX  # a projection's delayed-scaling amax history: {name}{HISTORY}


@dataclasses.dataclass(frozen=True)
class Quantization:
  """How projections are quantized: `kind` int8 | fp8, `scaling` (fp8) current | delayed
  with `history` steps of amax; `amax` a projection's history buffer (`bound`), or None."""
  kind: str
  scaling: str = "current"
  history: int = 16
  amax: object = None

  @property
  def forward_dtype(self):
    return jnp.int8 if self.kind == "int8" else jnp.float8_e4m3fn

  @property
  def gradient_dtype(self):
    return jnp.int8 if self.kind == "int8" else jnp.float8_e5m2

  @property
  def per_tensor(self) -> bool:
    return self.kind == "fp8"

  def einsum(self, eqn: str, x: jax.Array, w: jax.Array, out_dtype=None,
             rows: tuple[str, ...] = (), w_axes: Axes | None = None,
             gather=None, scatter=None, history: jax.Array | None = None) -> jax.Array:
    """`jnp.einsum(eqn, x, w)` quantized (`out_dtype`, default x's). Inside a shard_map
    manual over `rows` (the axes splitting x's dim 0) with `w` a shard split per dim over
    `w_axes`: `gather(a, axes)` makes the quantized shard whole, `scatter(g, axes)` (its
    transpose) sums w's gradient into the shard. Outside one, defaults: no collectives.
    `history`: delayed scaling's amax history [3, H] (`amax`, passed in explicitly)."""
    info = einsum_info.EinsumInfo.parse(eqn)
    if info.batch_chars or info.lhs[0] in info.contract_chars:
      raise ValueError(f"quantized einsum {eqn!r}: x's dim 0 must be a free dim, no batch dims")
    spec = _Spec(info.dimension_numbers, info.output_perm, dataclasses.replace(self, amax=None),
                 out_dtype or x.dtype, tuple(rows), w_axes or ((),) * w.ndim,
                 gather or identity, scatter or identity, x.dtype, w.dtype)
    return _product(x, w, history, spec)

  def bound(self, module: nn.Module, name: str) -> "Quantization":
    """This quantization with delayed scaling's amax history for `module`'s projection
    `name`: a param `{name}_amax_buffer` [3, history] (zeros: empty), a buffer the
    optimizer leaves alone; itself under current scaling."""
    if self.scaling != "delayed":
      return self
    history = module.param(name + HISTORY, nn.with_partitioning(nn.initializers.zeros,
                                                                  (None, None)),
                           (3, self.history), jnp.float32)
    return dataclasses.replace(self, amax=history)


def update_histories(params, grads):
  """`params` with every amax history (`HISTORY`) shifted by one step, the step's amaxes
  (their gradient slot's column 0, `_backward`) first, the oldest dropped."""
  def update(path, p, g):
    if not str(getattr(path[-1], "key", path[-1])).endswith(HISTORY):
      return p
    return jnp.concatenate([g[..., :1], p[..., :-1]], axis=-1)
  return jax.tree_util.tree_map_with_path(update, params, grads)


def from_fields(quantization: str | None, scaling: str = "current", history: int = 16
                ) -> Quantization | None:
  """The model fields `quantization`, `quantization_scaling` and `quantization_history` as
  a Quantization (None: float matmuls); a ConfigError naming the field for anything else."""
  if quantization is None:
    return None
  if quantization not in KINDS:
    raise ConfigError(
        f"model.quantization={quantization!r}: the projections' matmul type, one of None "
        "(float), 'int8' (per-channel dynamic scales) or 'fp8' (e4m3 forward, e5m2 gradients); "
        "e.g. --fdl_set=task.model.quantization=\"'int8'\".")
  if scaling not in SCALINGS or (scaling == "delayed" and quantization != "fp8"):
    raise ConfigError(
        f"model.quantization_scaling={scaling!r} with model.quantization={quantization!r}: "
        "'current' (scales from this step's absmax) or, for fp8 only, 'delayed' (per-tensor "
        "scales from an amax history of model.quantization_history steps); int8's per-"
        "channel scales are always current.")
  if not isinstance(history, int) or history < 1:
    raise ConfigError(f"model.quantization_history={history!r}: the steps of amax a delayed "
                      "fp8 scale looks back over, a positive integer (e.g. 16).")
  return Quantization(quantization, scaling, history)


def identity(a, axes):
  return a


class _Spec(NamedTuple):
  dims: tuple  # dot_general dimension numbers
  perm: tuple | None  # dot_general's output -> the einsum's
  quant: Quantization
  out_dtype: object
  rows: tuple[str, ...]
  w_axes: Axes
  gather: object
  scatter: object
  x_dtype: object
  w_dtype: object


def how_to(dims, ndims, for_lhs: bool, qtype, per_tensor: bool) -> qarray.HowToQuantize:
  how = qdot.get_how_to_quantize(dimension_numbers=dims, ndims=ndims, for_lhs=for_lhs,
                                 qtype=qtype, tile_size=None, calibration_method="absmax")
  return dataclasses.replace(how, channelwise_axes=[]) if per_tensor else how


def amax(a: jax.Array, how: qarray.HowToQuantize, axes: Axes) -> jax.Array:
  """qwix's absmax calibration of `a`, reduced over the axes of each dim it reduces that
  is split (so it is the whole array's); channel dims keep theirs."""
  absmax = qarray.calibrate(a, how)["absmax"]
  reduced = tuple(ax for d, ax in enumerate(axes) if absmax.shape[d] == 1 and a.shape[d] > 1
                  for ax in ax)
  return jax.lax.pmax(absmax, reduced) if reduced else absmax


def quantize(a: jax.Array, how: qarray.HowToQuantize, axes: Axes,
             absmax: jax.Array | None = None) -> qarray.QArray:
  """qwix's absmax quantization of `a` (`amax`), or with the given `absmax`."""
  absmax = amax(a, how, axes) if absmax is None else absmax
  scale, zero = qarray.compute_scale_zero_point({"absmax": absmax}, how.qtype)
  return qarray.quantize_with_scale_zero_point(a, how.qtype, scale, zero)


def whole(w: qarray.QArray, w_axes: Axes, gather) -> qarray.QArray:
  """The quantized weight's shard gathered whole (`gather(a, axes)`, per dim the axes
  that split it): its values (int8 / fp8) and the scales of its split channel dims (a
  per-tensor or contracted-dim scale is whole already)."""
  scale_axes = tuple(ax if w.scale.shape[d] > 1 else () for d, ax in enumerate(w_axes))
  return qarray.QArray(gather(w.qvalue, w_axes), gather(w.scale, scale_axes), None, w.qtype)


def sum_unsplit(dw: jax.Array, axes: tuple[str, ...], w_axes: Axes) -> jax.Array:
  """w's gradient summed over those of `axes` (devices with rows of their own) that split
  no dim of w: there each device holds the same shard and made its rows' share of it."""
  unsplit = tuple(a for a in axes if not any(a in ax for ax in w_axes))
  return jax.lax.psum(dw, unsplit) if unsplit else dw


def _delayed(history: jax.Array | None, current: jax.Array) -> jax.Array:
  """The absmax a scale is made from: `current`, or under delayed scaling the history
  row's max (the current while the history is empty: the first step)."""
  if history is None:
    return current
  past = jnp.max(history)
  return jnp.where(past > 0, past, current)


def _forward(x, w, history, spec: _Spec):
  q, ndims = spec.quant, (x.ndim, w.ndim)
  x_axes = (spec.rows,) + ((),) * (x.ndim - 1)
  how_x = how_to(spec.dims, ndims, True, q.forward_dtype, q.per_tensor)
  how_w = how_to(spec.dims, ndims, False, q.forward_dtype, q.per_tensor)
  ax, aw = amax(x, how_x, x_axes), amax(w, how_w, spec.w_axes)
  row = (lambda i: None) if history is None else (lambda i: history[i])
  xq = quantize(x, how_x, x_axes, _delayed(row(0), ax))
  wq = quantize(w, how_w, spec.w_axes, _delayed(row(1), aw))
  y = qdot.dot_general(xq, whole(wq, spec.w_axes, spec.gather), spec.dims,
                       preferred_element_type=spec.out_dtype)
  y = y if spec.perm is None else y.transpose(spec.perm)
  seen = None if history is None else (history, jnp.max(ax), jnp.max(aw))
  return y, (xq, wq, seen)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _product(x, w, history, spec: _Spec):
  return _forward(x, w, history, spec)[0]


def _backward(spec: _Spec, res, g):
  """qwix's quantized backward (dot_general_qt_bwd's scheme: the residual's scale shifted
  onto the gradient, the gradient quantized per channel, quantized x quantized dot), with
  every gradient scale reduced over the axes that split its reduced dims."""
  xq, wq, seen = res
  q, ndims = spec.quant, (xq.qvalue.ndim, wq.qvalue.ndim)
  if spec.perm is not None:
    g = g.transpose(np.argsort(spec.perm))
  # The product's dims: x's free dims (dim 0 the rows), then w's.
  g_axes = (spec.rows,) + ((),) * (g.ndim - 1)
  ag = used = None
  if seen is not None:  # delayed (per tensor): g's scale from its history, y's moved onto it
    ag = jnp.max(amax(g, qarray.HowToQuantize(qtype=q.gradient_dtype), g_axes))
    used = _delayed(seen[0][2], ag)

  def grad(y: qarray.QArray, for_x: bool):
    dims, perm = _update_dimension_numbers_for_backward(spec.dims, ndims, for_dlhs=for_x)
    gs = _apply_rhs_scale_to_lhs(g, y.scale, dims)
    how = how_to(dims, (g.ndim, y.qvalue.ndim), True, q.gradient_dtype, q.per_tensor)
    absmax = None if used is None else jnp.reshape(used * jnp.max(y.scale), (1,) * g.ndim)
    gq = quantize(gs, how, g_axes, absmax)
    if for_x:
      out = qdot.dot_general(gq, y.qvalue, dims, preferred_element_type=jnp.float32)
      return jax.lax.transpose(out, perm)
    # w's gradient as x^T g (x the lhs, the same products): it comes out in w's dim order.
    # g^T x then a transpose (qwix's order) left XLA:TPU a dim-0-minor layout whose FSDP
    # reduce-scatter's second stage it compiled as an all-reduce (docs/quantization.md).
    (g_c, x_c), (g_b, x_b) = dims
    out = qdot.dot_general(y.qvalue, gq, ((x_c, g_c), (x_b, g_b)),
                           preferred_element_type=jnp.float32)
    nb, ng = len(g_b), g.ndim - len(g_c) - len(g_b)
    nx = out.ndim - nb - ng  # g^T x's dims: batch, g's free, x's free; here batch, x's, g's
    where = list(range(nb)) + [nb + nx + j for j in range(ng)] + [nb + k for k in range(nx)]
    return jax.lax.transpose(out, tuple(where[a] for a in perm))

  dx = grad(whole(wq, spec.w_axes, spec.gather), True).astype(spec.x_dtype)
  dw = grad(xq, False).astype(spec.w_dtype)
  dw = sum_unsplit(dw, spec.rows, spec.w_axes)  # rows split where w is not: data parallel
  # The history's gradient slot carries the step's amaxes (x, w, g) in column 0.
  dh = None if seen is None else jnp.zeros_like(seen[0]).at[:, 0].set(
      jnp.stack([seen[1], seen[2], ag]).astype(seen[0].dtype))
  return dx, spec.scatter(dw, spec.w_axes), dh


_product.defvjp(lambda x, w, history, spec: _forward(x, w, history, spec), _backward)
