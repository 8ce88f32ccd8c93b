"""Tests for spmdtask.pipeline.mpmd.backward_split: a layer stack's backward (scan over
rematerialised dense layers, then a head) cut into I and W gives exactly the fused
backward's cotangents, W does the weight-gradient matmuls from I's stash (its FLOPs are
a real share of B's) and I + W compile to no more than 1.05x B's FLOPs."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from spmdtask.pipeline.mpmd import backward_split
from tests import util


def stage(p, x):
  def layer(h, w):
    return h + jnp.tanh(h @ w), None
  remat = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
  h, _ = jax.lax.scan(remat, x, p["w"])
  return jnp.tanh(h @ p["head"])


def test_split_equals_fused_backward_with_flops_of_b():
  k = jax.random.split(jax.random.key(0), 4)
  p = {"head": jax.random.normal(k[0], (64, 32)) / 8,
       "w": jax.random.normal(k[1], (3, 64, 64)) / 8}
  x, ct = jax.random.normal(k[2], (16, 64)), jax.random.normal(k[3], (16, 32))
  fwd, bwd = jax.fwd_and_bwd(stage, argnums=(0, 1), jitted=False)
  _, res = fwd(p, x)
  leaves, tree = jax.tree.flatten(res)

  def flat_bwd(*flat):
    d_p, d_x = bwd(jax.tree.unflatten(tree, flat[:-1]), flat[-1])
    return [*jax.tree.leaves(d_p), d_x]

  inputs = leaves + [ct]
  sb = backward_split.split(flat_bwd, *inputs, weight_outputs=[True, True, False])
  # W reads the layer inputs from the residuals ([3, 16, 64] stacked, and the head's input)
  # and I's stash: the per-layer output cotangents [3, 16, 64] and the head's.
  assert sorted(inputs[i].shape for i in sb.kept) == [(3, 16, 64), (16, 64)]
  assert sorted(a.shape for a in sb.stash_avals()) == [(3, 16, 64), (16, 32)]
  run_i = jax.jit(jcore.jaxpr_as_fun(sb.input_grad))
  run_w = jax.jit(jcore.jaxpr_as_fun(sb.weight_grad))
  d_x, *stash = run_i(*inputs)
  kept = [inputs[i] for i in sb.kept]
  d_head, d_w = run_w(*kept, *stash)
  want = jax.jit(flat_bwd)(*inputs)
  for got, ref in zip((d_head, d_w, d_x), want):
    util.assert_close_f32(got, ref, terms=x.shape[0], rtol=1e-6)
  flops = lambda fn, *a: jax.jit(fn).lower(*a).compile().cost_analysis()["flops"]
  b = flops(flat_bwd, *inputs)
  i = flops(jcore.jaxpr_as_fun(sb.input_grad), *inputs)
  w = flops(jcore.jaxpr_as_fun(sb.weight_grad), *kept, *stash)
  assert 0.3 * b < w < 0.7 * b and i + w <= 1.05 * b, (b, i, w)
