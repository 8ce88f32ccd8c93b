"""spmdtask.plan.flops counts matmul FLOPs through scans and remat: a scanned two-matmul layer costs
6 matmuls per layer without remat (forward 2, backward 4), 8 when its forward is recomputed."""
import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jex_core

from spmdtask.plan import flops
from spmdtask.core import remat

B, D, F, L = 8, 16, 32, 4
MATMUL = 2 * B * D * F


def _loss(w, x, policy):
  def layer(wi, h):
    return jnp.sin(jnp.tanh(h @ wi) @ wi.T)
  if policy is not None:
    layer = jax.checkpoint(layer, policy=remat.policy(policy))
  y, _ = jax.lax.scan(lambda h, wi: (layer(wi, h), None), x, w)
  return jnp.sum(y ** 2)


@pytest.mark.parametrize("policy,matmuls_per_layer", [
    (None, 6), ("full", 8), ("dots_saveable", 6), ("minimal_offloaded", 8)])
def test_scanned_layers_count_their_recompute(policy, matmuls_per_layer):
  grad = jax.grad(lambda w, x: _loss(w, x, policy))
  got = flops.traced_flops(grad, jnp.ones((L, D, F)), jnp.ones((B, D)))
  assert got == L * matmuls_per_layer * MATMUL


def test_shard_map_bodies_count_once_per_shard():
  mesh = jax.make_mesh((4,), ("s",), axis_types=(jax.sharding.AxisType.Explicit,))
  f = jax.shard_map(lambda a: a @ a.T, mesh=mesh, in_specs=jax.P("s"), out_specs=jax.P("s"),
                    axis_names={"s"})
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P("s")))
  assert flops.traced_flops(f, x) == 4 * 2 * 2 * 2 * 16  # 4 shards of [2,16] @ [16,2]


def test_a_pallas_kernel_counts_its_block_matmul_once_per_grid_point():
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] @ y_ref[...]

  def matmul(x, y):  # [64, 32] @ [32, 64] in 4 blocks of [32, 32] @ [32, 32]
    return pl.pallas_call(
        kernel, grid=(2, 2), interpret=True,
        in_specs=[pl.BlockSpec((32, 32), lambda i, j: (i, 0)),
                  pl.BlockSpec((32, 32), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((32, 32), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32))(x, y)

  x, y = jnp.ones((64, 32)), jnp.ones((32, 64))
  assert flops.traced_flops(matmul, x, y) == 2 * 64 * 32 * 64
  # Beside a plain matmul (in a scan), kernels_only counts the kernel's alone.
  step = lambda x, y: jax.lax.scan(lambda c, _: (c, matmul(x, y) @ y.T), 0.0, None, length=3)
  kernel = flops.traced_flops(step, x, y, kernels_only=True)
  assert kernel == 3 * 2 * 64 * 32 * 64 and flops.traced_flops(step, x, y) > kernel


def test_cudnn_attention_counts_two_matmuls_forward_and_five_backward():
  """cuDNN's fused attention traces as one primitive per direction (no dot inside); it is
  counted from q's and k's shapes, as a kernel. The primitives are stood in for by ones of
  the same names (this machine has no cuDNN to trace the real ones)."""
  def wrapper(name):
    prim = jex_core.Primitive(name)
    prim.def_abstract_eval(lambda q, k, v, **_: q)
    return prim

  fwd, bwd = (wrapper(f"dot_product_attention_{d}_wrapper") for d in ("fwd", "bwd"))
  b, t, h, kv, d = 2, 256, 4, 2, 64
  q, k = jnp.zeros((b, t, h, d)), jnp.zeros((b, t, kv, d))
  step = lambda q, k: bwd.bind(fwd.bind(q, k, k, layout=0), k, k, layout=0)
  per_matmul = 2.0 * b * h * t * t * d
  assert flops.traced_flops(step, q, k) == 7 * per_matmul
  assert flops.traced_flops(step, q, k, kernels_only=True) == 7 * per_matmul
  heads_first = lambda q, k: fwd.bind(q, k, k, layout=1)
  assert flops.traced_flops(heads_first, q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)) \
      == 2 * per_matmul


M, K, N, G = 128, 128, 256, 4  # tokens' rows, d_model, expert width, experts


def _grouped_loss(matmul):
  return jax.grad(lambda x, w, sizes: jnp.sum(matmul(x, w, sizes) ** 2), argnums=(0, 1))


def test_grouped_matmuls_count_each_row_once():
  """ragged_dot and megablox gmm (a Pallas kernel): forward and both gradients cost what a
  dense [M, K] @ [K, N] does, whatever the groups (3 such matmuls), gmm by its own cost
  estimates, which kernels_only counts (the plan's per-step XLA analysis sees none)."""
  from jax.experimental.pallas.ops.tpu import megablox  # pylint: disable=import-outside-toplevel
  x, w = jnp.ones((M, K)), jnp.ones((G, K, N))
  sizes = jnp.array([64, 0, 48, 16], jnp.int32)
  dense = 2 * M * K * N
  assert flops.traced_flops(_grouped_loss(jax.lax.ragged_dot), x, w, sizes) == 3 * dense
  gmm = lambda x, w, sizes: megablox.gmm(x, w, sizes, tiling=(128, 128, 128), interpret=True)
  assert flops.traced_flops(_grouped_loss(gmm), x, w, sizes) == 3 * dense
  assert flops.traced_flops(_grouped_loss(gmm), x, w, sizes, kernels_only=True) == 3 * dense


def test_a_frozen_weight_costs_no_gradient_kernel():
  """megablox gmm's custom VJP forms the weight gradient (tgmm) too; with the weight frozen
  (stop_gradient, as LoRA's base experts) nothing reads it and it is not counted: 2 kernel
  matmuls (forward, input gradient), not 3."""
  from spmdtask.layers import moe  # pylint: disable=import-outside-toplevel
  m, d, f, e = 256, 128, 128, 2
  sizes = jnp.array([128, 128], jnp.int32)
  loss = lambda w, x: jnp.sum(moe.grouped_matmul(x, w, sizes, "megablox_interpret") ** 2)
  args = (jnp.ones((e, d, f)), jnp.ones((m, d)))
  full = flops.traced_flops(jax.grad(loss, (0, 1)), *args, kernels_only=True)
  frozen = flops.traced_flops(
      jax.grad(lambda w, x: loss(jax.lax.stop_gradient(w), x), 1), *args, kernels_only=True)
  assert (full, frozen) == (3 * 2 * m * d * f, 2 * 2 * m * d * f)


def test_splash_counts_only_the_blocks_its_mask_runs():
  """Splash skips the grid points its block mask marks empty: a causal [512, 512] mask in
  128-blocks runs 10 of 16, forward (2 matmuls) and fused backward (5) alike; a full mask
  all 16."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=import-outside-toplevel
      splash_attention_kernel as sk, splash_attention_mask as sm)
  h, t, d = 2, 512, 64
  q = jax.ShapeDtypeStruct((h, t, d), jnp.bfloat16)
  per_matmul = 2.0 * h * t * t * d
  for mask, share in ((sm.CausalMask((t, t)), 10 / 16), (sm.FullMask((t, t)), 1.0)):
    kernel = sk.make_splash_mha(
        sm.MultiHeadMask([mask] * h), head_shards=1, q_seq_shards=1, interpret=True,
        block_sizes=sk.BlockSizes(*(128,) * 6, use_fused_bwd_kernel=True))
    loss = lambda q, kernel=kernel: kernel(q, q, q).sum()
    assert flops.traced_flops(loss, q, kernels_only=True) == 2 * share * per_matmul
    assert flops.traced_flops(jax.grad(loss), q, kernels_only=True) == 7 * share * per_matmul
