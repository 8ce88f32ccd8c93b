"""Splash for the all_gather method (spmdtask.layers.attention.splash_gathered), in Pallas interpret
mode: one call per shard against the gathered row equals all_gather with xla and one
device's attention, values and grads, causal and not, packed rows."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spmdtask.layers.attention import context as context_attention, splash_gathered
from tests.layers.attention import test_splash_blocks


def test_zigzag_causal_mask_is_causal_by_true_position_and_balanced():
  order = context_attention.zigzag(16, 2)
  mask = splash_gathered.ZigzagCausalMask(order)
  np.testing.assert_array_equal(mask[:, :], order[:, None] >= np.arange(16)[None, :])
  # The keys left in the gather's (zig-zag) order: positions from the index by shifts.
  mask = splash_gathered.ZigzagCausalMask(order, 2, keys_zigzag=True)
  np.testing.assert_array_equal(mask[:, :], order[:, None] >= order[None, :])
  assert not splash_gathered.keys_zigzag(24, 2) and splash_gathered.keys_zigzag(16, 2)
  # 2048 tokens over 2 shards: chunks of 512 = splash's blocks. Shard 0 holds chunks 0 and
  # 3 (1 + 4 visible key blocks), shard 1 chunks 1 and 2 (2 + 3): 5 of 8 each, the rest
  # skipped, each shard reading its own slice of the mask info.
  mesh = jax.make_mesh((2,), ("context",), devices=jax.devices()[:2])
  kern, spec = splash_gathered.kernel(context_attention.zigzag(2048, 2), 1, mesh,
                                      ("context",), True, True)
  blocks = np.asarray(kern.fwd_mask_info.block_mask)  # [head shards, q blocks, kv blocks]
  assert blocks.shape[1] == 4 and spec.fwd_mask_info.block_mask == P(None, ("context",))
  assert [np.count_nonzero(blocks[:, 2 * s:2 * s + 2]) for s in range(2)] == [5, 5]
  # Inside the SPMD pipeline's shard_map, manual over 'stage' (its spec: the free axes).
  manual = jax.sharding.AbstractMesh((2, 2), ("stage", "context"), axis_types=(
      jax.sharding.AxisType.Manual, jax.sharding.AxisType.Auto))
  _, spec = splash_gathered.kernel(context_attention.zigzag(2048, 2), 1, manual,
                                   ("context",), True, True)
  assert spec.fwd_mask_info.block_mask == P(None, ("context",))


@pytest.mark.parametrize("cp,local,causal", [(2, 1024, True), (4, 128, True), (4, 128, False),
                                             (2, 384, True)])
def test_all_gather_with_splash_equals_xla_and_one_device(cp, local, causal):
  """`local` tokens a shard (cp 2: chunks of 512 = splash's blocks, some skipped; cp 4:
  a block holds two 64-token chunks; chunks of 192, no power of two: the keys put back in
  token order), 2 rows, 4 heads on 2 KV heads, packed rows."""
  test_splash_blocks.assert_splash_equals_xla_and_one_device(
      "all_gather", cp, local * cp, kvh=2, g=2, causal=causal)


def test_tiny_lm_context_all_gather_with_splash_trains_like_one_device():
  """TinyLmContext (all_gather, context 4 x data 2) with splash: 256 tokens a shard, 2 rows,
  2 layers; losses, gradients and params after 2 Adam steps == lm.TinyLm on 1 device."""
  test_splash_blocks.assert_like_one_device(test_splash_blocks.context_steps(
      "lm.TinyLmContext", ("task.model.attention_impl='splash'",)))
