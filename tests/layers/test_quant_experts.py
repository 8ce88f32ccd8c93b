"""layers.quant_experts: the quantized grouped matmul equals qwix's per-expert quantized
dot_general (forward and both gradients) and its ragged_dot, within the quantizer's bound,
and the quantized MoE layer on 8 devices (experts, FSDP, tensor split) equals one device."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from qwix._src.core import dot_general_qt, qarray, ragged_dot

from spmdtask.errors import ConfigError
from spmdtask.layers import moe, quant, quant_experts
from tests import util
from tests.layers import test_moe
from tests.layers.test_quant import _step_error

KEYS = jax.random.split(jax.random.key(0), 3)
SIZES = (10, 0, 11)  # an expert without rows; 3 rows past the groups
X = jax.random.normal(KEYS[0], (24, 16))
W = jax.random.normal(KEYS[1], (3, 16, 8)) * 0.1
PROBE = jax.random.normal(KEYS[2], (21, 8))


def _ours(kind):
  q = quant.Quantization(kind)
  return lambda x, w: quant_experts.grouped(q, x, w, jnp.asarray(SIZES, jnp.int32))[:21]


def _per_expert(x, w, cfg):
  """Each expert's rows through qwix's own quantized dot_general (AQT's backward)."""
  starts = np.cumsum((0,) + SIZES)
  return jnp.concatenate([dot_general_qt.dot_general_qt(x[s:s + n], w[e], (((1,), (0,)), ((), ())), cfg)
                          for e, (s, n) in enumerate(zip(starts, SIZES)) if n])


def test_int8_equals_qwix_per_expert_and_its_ragged_dot():
  cfg = dot_general_qt.DotGeneralQtConfig(lhs_qtype=jnp.int8, rhs_qtype=jnp.int8,
                                          dlhs_grad_qtype=jnp.int8, drhs_grad_qtype=jnp.int8)
  ours, theirs = _ours("int8"), lambda x, w: _per_expert(x, w, cfg)
  loss = lambda f: jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) * PROBE), (0, 1)))
  (value, (dx, dw)), (want_value, (want_dx, want_dw)) = loss(ours)(X, W), loss(theirs)(X, W)
  util.assert_trees_close((value, dx), (want_value, want_dx))
  # w's gradient: each (expert, n) column's absmax element lands on the tie +-127.5 by
  # construction (bound 127.5), so one ulp in its division (XLA:CPU at -O0 divides by a
  # broadcast scale another way) rounds it to 127 or 128: at most one step of that column
  # (its scale, <= max|g * x's row scale| / 127.5) times an int8 x, 127.
  x_scale = jnp.max(jnp.abs(X[:21]), axis=1, keepdims=True) / 127.5
  flip = 127 * float(jnp.max(jnp.abs(PROBE * x_scale))) / 127.5
  util.assert_trees_close(dw, want_dw, atol=1.001 * flip)
  # qwix's ragged_dot on per-expert per-channel QArrays: the same forward.
  xq = qarray.quantize(X, qarray.HowToQuantize(qtype=jnp.int8, channelwise_axes=[0]))
  wq = qarray.quantize(W, qarray.HowToQuantize(qtype=jnp.int8, channelwise_axes=[0, 2]))
  want = ragged_dot.ragged_dot(xq, wq, jnp.asarray(SIZES, jnp.int32),
                               preferred_element_type=jnp.float32)[:21]
  util.assert_trees_close(jax.jit(ours)(X, W), want)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_error_within_the_quantizers_bound(kind):
  x, w = np.asarray(X, np.float64)[:21], np.asarray(W, np.float64)
  gid = np.repeat(np.arange(3), SIZES)
  per_tensor = kind == "fp8"
  ax = np.max(np.abs(x)) if per_tensor else np.max(np.abs(x), axis=1, keepdims=True)
  aw = np.max(np.abs(w), axis=(1, 2) if per_tensor else 1, keepdims=True)
  dx, dw = _step_error(x, ax, kind), _step_error(w, aw, kind)[gid]
  wr = w[gid]
  bound = (np.einsum("mk,mkn->mn", np.abs(x), dw) + np.einsum("mk,mkn->mn", dx, np.abs(wr))
           + np.einsum("mk,mkn->mn", dx, dw))
  got = np.asarray(jax.jit(_ours(kind))(X, W), np.float64)
  err = np.abs(got - np.einsum("mk,mkn->mn", x, wr))
  assert np.all(err <= bound * (1 + 1e-5) + 1e-6), float(np.max(err / bound))
  assert np.max(err) > 0.05 * np.max(bound)  # it does quantize


def _layer(cfg, kind, split=None, kernel="auto"):
  s = split or {k: tuple(None for _ in v) if k not in ("ff_act_split", "embed_split")
                else None for k, v in test_moe.EP.items()}
  return moe.MoeFfn(test_moe.D, cfg, jnp.float32, s["router"], s["in_split"], s["out_split"],
                    s["shared_in_split"], s["shared_out_split"], s["ff_act_split"],
                    s["embed_split"], kernel=kernel, quant=quant.Quantization(kind))


@pytest.mark.parametrize("kind,dispatch,chunks", [("int8", "dropless", 2),
                                                  ("fp8", "capacity", 1)])
def test_expert_parallel_equals_one_device(kind, dispatch, chunks):
  """Experts over `expert` 2, their weights over fsdp 2 (quantized shards gathered) and
  model 2, the batch over expert x fsdp: the quantized layer's value and grads as on one
  device (the scales reduced over the axes that split them: the same quantized values)."""
  cfg = dataclasses.replace(test_moe.CFG, dispatch=dispatch, capacity_factor=2.0,
                            ff_chunks=chunks)
  one = _layer(cfg, kind)
  want = test_moe._value_and_grads(lambda p, x: one.apply({"params": p}, x)[0],
                                   test_moe.PARAMS, test_moe.X)
  mesh = test_moe._mesh()
  split = _layer(cfg, kind, test_moe.EP)
  specs = test_moe.nn_specs(split)
  with jax.set_mesh(mesh):
    params = jax.device_put(test_moe._unbox(test_moe.PARAMS),
                            jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    x = jax.device_put(test_moe.X, NamedSharding(mesh, P(test_moe.BATCH)))
    got = jax.jit(lambda p, x: test_moe._value_and_grads(
        lambda p, x: split.apply({"params": p}, x)[0], p, x))(params, x)
  got, want = jax.tree.leaves(test_moe._unbox(got)), jax.tree.leaves(test_moe._unbox(want))
  if kind == "fp8":  # the same quantized values; float32 sums in another order
    util.assert_trees_close(got, want, terms=48)
    return
  # int8: every row's and channel's absmax element lands on qwix's tie +-127.5 by
  # construction; one ulp in the division by its scale (another fusion on 8 devices) rounds
  # it to 127 or 128, one step in 255 of that row. Such flips move a leaf by well under 1%
  # of its norm; a layout error (a scale or a sum over the wrong axes) by tens of percent.
  for a, b in zip(got, want):
    rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert rel < 1e-2, (a.shape, rel)


def test_megablox_refuses_quantization():
  with pytest.raises(ConfigError, match="MoeFfn.kernel='megablox'"):
    _layer(test_moe.CFG, "int8", kernel="megablox").init(jax.random.key(0), test_moe.X)
