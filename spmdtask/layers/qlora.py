"""QLoRA: a LoRA model's frozen base weights stored quantized (`LoraConfig.base_quantization`).

A target's base weight W (q, k, v, o, wi, wg, wo: the dense projections `lora.project`
computes) is stored as two frozen params beside its adapters, each split as W is:
`{name}_qvalue`, the codes, and `{name}_qscale`, one scale per group of `group_size`
consecutive elements of W's last in-dim (`GROUP_AXIS`: d of q/k/v/wi/wg, hd of o, f of wo)
and per element of every other dim, in `base_dtype`. 'nf4' and 'int4' codes are 4 bits,
two per uint8 byte (neighbours along the group dim: that dim halves); 'int8' codes are int8.
Everything else (embedding, head, norms, untargeted weights) stays in `base_dtype`, as
bitsandbytes keeps the embedding and the head.

qwix gives the numbers: its absmax calibration per tile (`qarray.calibrate` with the group
dim tiled), its scale (absmax / the type's bound: 1 for nf4, 7.5 and 127.5 for int4, int8),
its code conversion (`numerics.convert_to`: nf4's nearest of the QLoRA paper's 16 values,
the ints rounded) and its nf4 code book; a weight is its codes' values times their group's
scale. What this module adds: the scaled value is clipped to the largest code before
conversion (a value at qwix's int4 bound, 7.5, rounds to 8, which int4 cannot hold); the
scale is rounded to its stored dtype before the codes are made from it; a dequantization
written for XLA:TPU's fusion (`_dequantize_on_device`: nf4's lookup a tree of selects on
the code's bits, where qwix's gather wrote a float32 copy of each weight); and the 4-bit
codes are packed into bytes, so the arrays a device holds and FSDP gathers are packed
(`base.project` gathers the parts of a `Stored` weight, then dequantizes per matmul: never
a bfloat16 copy of the whole base crosses the links).
"""
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from qwix._src.core import numerics, qarray

from spmdtask.layers.base import SplitDims

KINDS = ("nf4", "int4", "int8")
QVALUE, QSCALE = "_qvalue", "_qscale"  # a quantized base weight X's params: X_qvalue, X_qscale
# The group dim of each quantizable weight, counted from its end (a stack's layer dim first).
GROUP_AXIS = {"q": -3, "k": -3, "v": -3, "o": -2, "wi": -2, "wg": -2, "wo": -2}
_QTYPES = {"nf4": "nf4", "int4": jnp.int4, "int8": jnp.int8}
_LARGEST = {"nf4": 1.0, "int4": 7.0, "int8": 127.0}  # the largest code's value


def packed(kind: str) -> bool:
  """Whether `kind`'s codes are 4 bits, two a byte."""
  return kind != "int8"


@dataclasses.dataclass(frozen=True)
class Packed:
  """A quantized base weight (`base.Stored`): `parts` (qvalue, qscale) as stored; `shape`
  the dense weight's; `dense(parts, dtype)` dequantizes whole parts."""
  parts: tuple[jax.Array, jax.Array]
  shape: tuple[int, ...]
  kind: str
  axis: int  # the group dim

  def dense(self, parts, dtype) -> jax.Array:
    return dequantize(parts[0], parts[1], self.kind, self.axis, jnp, dtype)


def group_axis(name: str, ndim: int) -> int:
  """The group dim of weight `name` with `ndim` dims (`GROUP_AXIS`)."""
  return ndim + GROUP_AXIS[name]


def quantize(w, kind: str, group: int, axis: int, scale_dtype) -> tuple[jax.Array, jax.Array]:
  """(qvalue, qscale) of float `w` (module doc): groups of `group` along `axis`."""
  w = jnp.asarray(w, jnp.float32)
  qtype = _QTYPES[kind]
  how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=tuple(
      d for d in range(w.ndim) if d != axis), tiled_axes={axis: group})
  scale, _ = qarray.compute_scale_zero_point(qarray.calibrate(w, how), qtype)
  scale = scale.astype(scale_dtype)
  scaled = qarray.call_with_generic_broadcast(jnp.divide, w, scale.astype(jnp.float32))
  codes = numerics.convert_to(jnp.clip(scaled, -_LARGEST[kind], _LARGEST[kind]), qtype)
  if not packed(kind):
    return codes, scale
  codes = codes.astype(jnp.uint8) if kind == "nf4" else (codes.astype(jnp.int8) + 8).astype(
      jnp.uint8)
  pairs = codes.reshape(w.shape[:axis] + (w.shape[axis] // 2, 2) + w.shape[axis + 1:])
  lo, hi = jnp.take(pairs, 0, axis + 1), jnp.take(pairs, 1, axis + 1)
  return lo | (hi << 4), scale


def dequantize(qvalue, qscale, kind: str, axis: int, xp=jnp, dtype=jnp.float32):
  """The weight of (qvalue, qscale) (`quantize`'s), groups along `axis`; `xp` jax.numpy in
  a step, numpy on the host (an export, float32). On device it is computed in float32 and
  cast to `dtype` (`_dequantize_on_device`)."""
  if xp is not np:
    return _dequantize_on_device(qvalue, qscale, kind, axis, dtype)
  codes = np.asarray(qvalue)
  if packed(kind):
    codes = np.stack([codes & 15, codes >> 4], axis=axis + 1)
    codes = codes.reshape(qvalue.shape[:axis] + (2 * qvalue.shape[axis],)
                          + qvalue.shape[axis + 1:])
    codes = codes.astype(np.uint8) if kind == "nf4" else codes.astype(np.int8) - 8
  values = (np.asarray(numerics.get_nf4_buckets(), np.float32)[codes] if kind == "nf4"
            else codes.astype(np.float32))
  scale = np.repeat(np.asarray(qscale, np.float32), codes.shape[axis] // qscale.shape[axis],
                    axis=axis)
  return values * scale


def _dequantize_on_device(qvalue, qscale, kind, axis, dtype):
  """`dequantize` in a step, written for XLA:TPU's fusion: each nibble is decoded where it
  lies, scaled by its group's scale broadcast to the codes, cast to `dtype`, and only then
  interleaved; nf4's code book is a tree of selects on the code's 4 bits. Measured on
  Llama31_70B_QLora's step (v5e:2x4, temporaries a chip): a chain of 16 selects on
  `codes == c` made XLA write each compare as a bool array, 21.3 GiB (refused); the bit
  tree on interleaved codes, float32 values regrouped to the scales, 10.2 GiB; this, 7.8
  GiB. A gather (qwix's lookup) wrote a float32 copy of each weight (8 layers: 12.3 GiB
  against the tree's 5.5). Two matmuls, one per half, never interleaving the weight, wrote
  float32 halves and took XLA:TPU 13 minutes to compile (this: 1)."""
  scale = jnp.asarray(qscale, jnp.float32)
  per_scale = qvalue.shape[axis] // scale.shape[axis]  # codes a scale covers (of qvalue)
  scale = jnp.repeat(scale, per_scale, axis=axis) if per_scale > 1 else scale

  def decode(codes):
    if kind == "nf4":
      level = [jnp.float32(v) for v in numerics.get_nf4_buckets()]
      for bit in range(4):  # bit 0 picks between neighbouring codes, bit 3 between halves
        on = (codes >> bit) & 1 == 1
        level = [jnp.where(on, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
      return level[0]
    return (codes.astype(jnp.int8) - 8 if kind == "int4" else codes).astype(jnp.float32)

  if not packed(kind):
    return (decode(qvalue) * scale).astype(dtype)
  q = jnp.asarray(qvalue)
  halves = [(decode(codes) * scale).astype(dtype) for codes in (q & 15, q >> 4)]
  dense = jnp.stack(halves, axis=axis + 1)
  return dense.reshape(q.shape[:axis] + (2 * q.shape[axis],) + q.shape[axis + 1:])


def weight(module: nn.Module, name: str, shape, split: SplitDims, init, kind: str,
           group: int, scale_dtype) -> Packed:
  """Frozen base weight `name` of `shape` stored quantized (module doc), split as `split`
  says: its init is `init`'s float weight, quantized."""
  axis = group_axis(name, len(shape))
  made = {}

  def part(i):
    def init_part(key):
      if not made:  # one float init for both parts (the second's key unused)
        made["parts"] = quantize(init(key, tuple(shape), jnp.float32), kind, group, axis,
                                 scale_dtype)
      return made["parts"][i]
    return nn.with_partitioning(init_part, tuple(split))

  qvalue = module.param(name + QVALUE, part(0))
  qscale = module.param(name + QSCALE, part(1))
  return Packed((jax.lax.stop_gradient(qvalue), jax.lax.stop_gradient(qscale)), tuple(shape),
                kind, axis)


@dataclasses.dataclass(frozen=True)
class Storage:
  """A QLoRA base's storage (`core.model.BaseStorage`): `kind` codes in groups of `group`."""
  kind: str
  group: int

  def float_view(self, params):
    """`params` (nested dicts of arrays or ShapeDtypeStructs) with each pair X_qvalue,
    X_qscale as one float32 X (a ShapeDtypeStruct with qvalue's sharding): the float
    base's names and shapes, what a warm start reads."""
    def pair(name, qvalue, _):
      shape = list(qvalue.shape)
      shape[group_axis(name, len(shape))] *= 2 if packed(self.kind) else 1
      return jax.ShapeDtypeStruct(tuple(shape), jnp.float32,
                                  sharding=getattr(qvalue, "sharding", None))
    return _pairs(params, pair, lambda _, v: self.float_view(v))

  def quantized(self, params, model_params):
    """Float `params` (`float_view`'s names) as `model_params` (the model's arrays or
    ShapeDtypeStructs) hold them: each weight quantized where its parts lie, one after
    the other (a weight may be a loader, `() -> array`, called when its turn comes), a
    stack one layer at a time (its float32 copy one layer's); what `params` lacks (e.g.
    adapters) left out."""
    if not isinstance(model_params, dict):
      return params

    def pair(name, qvalue, qscale):
      w = params[name]
      return _quantize_program(self.kind, self.group, group_axis(name, len(qvalue.shape)),
                               qscale.dtype, qvalue.sharding, qscale.sharding)(
                                   w() if callable(w) else w)
    return _pairs(model_params, pair,
                  lambda k, v: self.quantized(params[k], v) if k in params else None)

  def dequantized(self, params):
    """`params` (nested dicts of numpy arrays) with each pair as its float32 weight X, on
    the host (numpy): a plain LoRA model's params, for an export."""
    return _pairs(params, lambda name, q, s: dequantize(q, s, self.kind,
                                                        group_axis(name, q.ndim), np),
                  lambda _, v: self.dequantized(v))


@functools.lru_cache(maxsize=None)
def _quantize_program(kind: str, group: int, axis: int, scale_dtype, qvalue_sharding,
                      qscale_sharding):
  """jit of `quantize` into the parts' shardings; with a dim before the group dim (a
  stack's layers), one slice of dim 0 at a time (`lax.map`: groups never span dim 0, so
  the codes are the same)."""
  def make(w):
    if axis == 0:
      return quantize(w, kind, group, axis, scale_dtype)
    return jax.lax.map(lambda s: quantize(s, kind, group, axis - 1, scale_dtype), w)
  return jax.jit(make, out_shardings=(qvalue_sharding, qscale_sharding))


def _pairs(tree, pair, other):
  """`tree` (nested dicts) with each pair X_qvalue, X_qscale as X: `pair(X, qvalue,
  qscale)` (one value, or a (qvalue, qscale) tuple that stays a pair), every other entry
  k as `other(k, value)` (None: left out)."""
  if not isinstance(tree, dict):
    return tree
  out = {}
  for k, v in tree.items():
    if str(k).endswith(QVALUE):
      name = str(k)[:-len(QVALUE)]
      got = pair(name, v, tree[name + QSCALE])
      if isinstance(got, tuple):
        out[k], out[name + QSCALE] = got
      else:
        out[name] = got
    elif not str(k).endswith(QSCALE):
      got = other(k, v)
      if got is not None:
        out[k] = got
  return out
