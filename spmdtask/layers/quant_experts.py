"""The routed experts' grouped matmul quantized (int8, fp8), on qwix's quantizer.

`grouped(quant, x [m, k], w [G, k, n], sizes [G])` is `jax.lax.ragged_dot` (rows sorted by
expert, `sizes` rows each; rows past the groups undefined) with every operand quantized:

- int8: x per row, w per expert and output channel (a scale per (expert, n)); the backward
  quantizes the gradient as `layers.quant` does a projection's, per expert: for x's
  gradient per row with w's scales moved onto it (each row its expert's), for w's
  gradient per (expert, n) with x's row scales moved onto it, so all three products are
  int8 x int8 -> int32.
- fp8: e4m3 forward, e5m2 gradients; x and the gradient one scale per tensor, w one per
  expert (a grouped GEMM's per-GEMM scale, as Transformer Engine's grouped linear keeps).

Inside the experts' shard_map: `rows` are the manual axes that split the rows (all rows
of the one-device program are the union over them), `same` those over which devices hold
the same experts (their rows of an expert together are the expert's rows); `w_axes` the
manual (FSDP) axes per dim of w's shard (the expert dim's stay split: ()), `gather(a,
axes)` / `scatter(g, axes)` gather the quantized shard whole / reduce w's gradient to it.
Every scale is reduced (`pmax`) over the axes that split what it spans, so any layout
quantizes with the one-device program's scales.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from qwix._src.core import qarray

from spmdtask.layers import quant as quant_lib
from spmdtask.layers.quant import Axes, Quantization

# Contract the rows (x's and the gradient's dim 0) group by group: w's gradient [G, k, n].
_W_GRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


class _Spec(NamedTuple):
  quant: Quantization
  out_dtype: object
  rows: tuple[str, ...]
  same: tuple[str, ...]
  w_axes: Axes
  gather: object
  scatter: object
  x_dtype: object
  w_dtype: object


def grouped(quant: Quantization, x: jax.Array, w: jax.Array, sizes: jax.Array,
            out_dtype=None, rows: tuple[str, ...] = (), same: tuple[str, ...] = (),
            w_axes: Axes | None = None, gather=None, scatter=None) -> jax.Array:
  """`jax.lax.ragged_dot(x, w, sizes)` quantized, in `out_dtype` (default x's) (module doc)."""
  spec = _Spec(quant, out_dtype or x.dtype, tuple(rows), tuple(same), w_axes or ((),) * 3,
               gather or quant_lib.identity, scatter or quant_lib.identity, x.dtype, w.dtype)
  return _product(x, w, sizes, spec)


def _accumulator(quant: Quantization):
  return jnp.int32 if quant.kind == "int8" else jnp.float32


def group_ids(sizes: jax.Array, m: int) -> jax.Array:
  """Each of m sorted rows' group; rows past the groups get len(sizes)."""
  # (A compare and count, not searchsorted: jax 0.10.2's fails to trace under shard_map's
  # manual-axis types.)
  ends = jnp.cumsum(sizes)
  return jnp.sum(jnp.arange(m)[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def _per_row(scale: jax.Array, gid: jax.Array) -> jax.Array:
  """A weight scale [G, 1, n|1] as each row's expert's [m, n|1] (rows past the groups: the
  last expert's; their products are undefined anyway)."""
  return scale[jnp.minimum(gid, scale.shape[0] - 1), 0, :]


def _quantize_rows(a: jax.Array, qtype, per_tensor: bool, rows: tuple[str, ...]):
  """a [m, n] per row (or per tensor, its absmax over `rows`) as qwix quantizes."""
  how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=[] if per_tensor else [0])
  return quant_lib.quantize(a, how, (rows, ()))


def _forward(x, w, sizes, spec: _Spec):
  q = spec.quant
  xq = _quantize_rows(x, q.forward_dtype, q.per_tensor, spec.rows)
  how_w = qarray.HowToQuantize(qtype=q.forward_dtype,
                               channelwise_axes=[0] if q.per_tensor else [0, 2])
  wq = quant_lib.quantize(w, how_w, spec.w_axes)
  whole = quant_lib.whole(wq, spec.w_axes, spec.gather)
  gid = group_ids(sizes, x.shape[0])
  acc = jax.lax.ragged_dot(xq.qvalue, whole.qvalue, sizes,
                           preferred_element_type=_accumulator(q))
  y = acc.astype(jnp.float32) * xq.scale.astype(jnp.float32) * _per_row(
      whole.scale.astype(jnp.float32), gid)
  return y.astype(spec.out_dtype), (xq, wq, sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _product(x, w, sizes, spec: _Spec):
  return _forward(x, w, sizes, spec)[0]


def _w_grad_quantized(gs: jax.Array, gid: jax.Array, groups: int, qtype, per_tensor: bool,
                      spec: _Spec):
  """gs [m, n] quantized with a scale per (expert, n) (int8; its absmax over the expert's
  rows on every device that holds it) or per tensor (fp8): (values, scales [G, n|1])."""
  a = jnp.abs(gs.astype(jnp.float32))
  if per_tensor:
    absmax = jnp.max(a, keepdims=True)
    absmax = jax.lax.pmax(absmax, spec.rows) if spec.rows else absmax
    absmax = jnp.broadcast_to(absmax, (groups, 1))
  else:  # an expert without rows: -inf, which qwix's scale turns into 1 (its gradient is 0)
    absmax = jax.ops.segment_max(a, gid, num_segments=groups)
    absmax = jax.lax.pmax(absmax, spec.same) if spec.same else absmax
  scale, _ = qarray.compute_scale_zero_point({"absmax": absmax}, qtype)
  rows = scale[jnp.minimum(gid, groups - 1)]
  return qarray.quantize_with_scale_zero_point(gs.astype(jnp.float32), qtype, rows,
                                               None).qvalue, scale


def _backward(spec: _Spec, res, g):
  xq, wq, sizes = res
  q, qtype = spec.quant, spec.quant.gradient_dtype
  whole = quant_lib.whole(wq, spec.w_axes, spec.gather)
  groups, m = whole.qvalue.shape[0], g.shape[0]
  gid = group_ids(sizes, m)
  g = g.astype(jnp.float32)
  # x's gradient: g times each row's expert's w scales, quantized per row, times w^T.
  gq = _quantize_rows(g * _per_row(whole.scale.astype(jnp.float32), gid), qtype,
                      q.per_tensor, spec.rows)
  dx = jax.lax.ragged_dot(gq.qvalue, whole.qvalue.swapaxes(1, 2), sizes,
                          preferred_element_type=_accumulator(q))
  dx = (dx.astype(jnp.float32) * gq.scale).astype(spec.x_dtype)
  # w's gradient: g times x's row scales, quantized per (expert, n), x^T times it per expert.
  values, scale = _w_grad_quantized(g * xq.scale.astype(jnp.float32), gid, groups, qtype,
                                    q.per_tensor, spec)
  dw = jax.lax.ragged_dot_general(xq.qvalue, values, sizes, _W_GRAD_DIMS,
                                  preferred_element_type=_accumulator(q))
  dw = (dw.astype(jnp.float32) * scale[:, None, :]).astype(spec.w_dtype)
  dw = quant_lib.sum_unsplit(dw, spec.same, spec.w_axes)  # devices holding the same experts
  return dx, spec.scatter(dw, spec.w_axes), None


_product.defvjp(lambda x, w, sizes, spec: _forward(x, w, sizes, spec), _backward)
