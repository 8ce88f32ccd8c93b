"""Splash as the ring's block kernel (spmdtask.layers.attention.splash_blocks), in Pallas interpret
mode: a block's gradients against the whole row's softmax equal the xla kernel's, and the
ring with splash equals the ring with xla and one device's attention, values and grads."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask.layers.attention import context as context_attention, mha as attention, splash_blocks, xla_blocks
from tests import util
from tests.layers.attention import test_context as test_context_attention

# float32 sums over <= 2048 keys and 32 head dims, in other orders than the dense
# reference's: ~eps · sqrt(n) ≈ 1.2e-7 · 45 relative; atol for elements near zero.
RTOL, ATOL = 1e-5, 1e-6


def _packed(b, t, kvh, g, hd, seed=0):
  """q [b, t, kv·g, hd], k/v [b, t, kv, hd], positions and segment ids [b, t]: rows packed
  with segments of uneven lengths (one crossing every shard boundary)."""
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, kvh * g, hd))
  k, v = (jax.random.normal(x, (b, t, kvh, hd)) for x in keys[1:])
  cuts = [np.sort(np.random.default_rng(seed + r).choice(np.arange(1, t), 4, replace=False))
          for r in range(b)]
  seg = np.stack([np.searchsorted(c, np.arange(t), side="right") for c in cuts]) + 1
  pos = np.stack([np.arange(t) - np.concatenate([[0], c])[s - 1] for c, s in zip(cuts, seg)])
  return q, k, v, pos.astype(np.int32), seg.astype(np.int32)


def test_a_blocks_grads_against_the_rows_softmax_equal_the_xla_kernels():
  """Pins splash_blocks._global_grads (splash's private backward, fed the row's o and lse):
  a causal diagonal block and a full half block, as the ring holds them; 2048 queries, so
  that the blocks take splash's 512-token blocks and 1024 keys a backward step."""
  b, t, kvh, g, hd = 1, 2048, 1, 2, 32
  q, k, v, pos, seg = _packed(b, t, kvh, g, hd)
  q5 = q.reshape(b, t, kvh, g, hd)
  half = t // 2  # the second block: the first half of an earlier shard's keys, all visible
  k2, v2 = k[:, :half] * 0.5, v[:, :half] + 1.0
  pos2, seg2 = pos[:, :half] - t, seg[:, :half]  # earlier positions, same segments
  blocks = [(k, v, pos, seg, True), (k2, v2, pos2, seg2, False)]
  xla = xla_blocks.XlaBlocks(causal=True)
  parts = [xla.forward(q5, kb, vb, pos, pb, seg, sb, d) for kb, vb, pb, sb, d in blocks]
  o, m, l = context_attention._merge(*parts)  # pylint: disable=protected-access
  o, lse = o / l[..., None], m + jnp.log(l)
  do = jax.random.normal(jax.random.key(3), o.shape)
  delta = jnp.sum(do * o, axis=-1)
  splash = splash_blocks.SplashBlocks(causal=True, interpret=True)
  for kb, vb, pb, sb, d in blocks:
    want = xla.grads(q5, kb, vb, pos, pb, seg, sb, d, do, o, lse, delta)
    got = jax.jit(lambda *a, d=d: splash.grads(*a[:7], d, *a[7:]))(
        q5, kb, vb, pos, pb, seg, sb, do, o, lse, delta)
    util.assert_trees_close(got, want, rtol=RTOL, atol=ATOL)
    # The forward: the block's partial softmax, as its output and log-sum-exp.
    so, sm, sl = splash.forward(q5, kb, vb, pos, pb, seg, sb, d)
    xo, xm, xl = xla.forward(q5, kb, vb, pos, pb, seg, sb, d)
    seen = np.asarray(xl) > 0  # rows that see a key of this block (not another segment's)
    np.testing.assert_allclose(np.asarray(so)[seen], (xo / xl[..., None])[seen], rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_allclose(np.asarray(sm)[seen], (xm + jnp.log(xl))[seen], rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_array_equal(sl, 1.0)
    # A row that sees none: a finite log-sum-exp near splash's mask value, which the merge
    # weighs exp(lse_b - lse) = 0.
    assert np.all(np.asarray(sm)[~seen] < -1e37) and (d or (~seen).any())
    assert np.all(np.isfinite(so))


def assert_splash_equals_xla_and_one_device(method, cp, t, kvh, g, causal):
  """`context_attention.attend(method)` with splash == with xla == dense 1-device attention
  on 2 packed rows of `t` tokens split over `cp` shards (zig-zag order), `kvh` KV heads of
  `g` query heads each: value and grads (q, k, v) of a loss weighing every output."""
  b, hd = 2, 32
  q, k, v, pos, seg = _packed(b, t, kvh, g, hd, seed=cp)
  order = context_attention.zigzag(t, cp)
  w = jax.random.normal(jax.random.key(1), q.shape)[:, order]
  with_grads = lambda f: jax.jit(jax.value_and_grad(
      lambda q, k, v, p, s: jnp.sum(f(q, k, v, p, s) * w), argnums=(0, 1, 2)))
  shuffled = [x[:, order] for x in (q, k, v, pos, seg)]
  want = with_grads(lambda q, k, v, p, s: attention.attend(q, k, v, p, p, causal, s, s))(
      *shuffled)
  mesh = jax.make_mesh((cp,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:cp])
  split = (None, "context", None, None)
  got = {}
  for impl in ("xla", "splash"):
    with jax.set_mesh(mesh):
      got[impl] = with_grads(lambda q, k, v, p, s, impl=impl: context_attention.attend(
          method, q, k, v, p, s, causal, split, impl=impl, backend="cpu"))(*shuffled)
  # A gradient that is 0 in exact arithmetic (a segment's first token sees only itself:
  # dq = P·(dp - rowsum(o·do)) cancels) keeps the rounding of its terms: util.f32_atol over
  # the row's keys.
  util.assert_trees_close(got["splash"], got["xla"], rtol=RTOL, terms=t)
  util.assert_trees_close(got["splash"], want, rtol=RTOL, terms=t)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_with_splash_equals_ring_with_xla_and_one_device(cp):
  """256 tokens a shard, 2 heads on 1 KV head, packed rows."""
  assert_splash_equals_xla_and_one_device("ring", cp, 256 * cp, kvh=1, g=2, causal=True)


_DATA = ("datasets['train'].seq_len=1024", "datasets['train'].batch_size=2",
         "task.model.max_seq_len=1024", "task.model.num_layers=2")


def context_steps(exp, more=(), devices=None):
  """(losses, params, grads) of `exp` over 2 steps of 2 rows of 1024 tokens, 2 layers."""
  return test_context_attention.run_steps(exp, 2, _DATA + more,
                                          test_context_attention.keep_grads, devices)


@functools.cache
def one_device_steps():
  """lm.TinyLm on 1 device, 1024-token rows, 2 rows, 2 layers, 2 Adam steps: (losses,
  params, grads), the reference of the context splits with splash (shared)."""
  return context_steps("lm.TinyLm", ("task.ici_mesh_shape=(1, 1, 1)",), jax.devices()[:1])


def assert_like_one_device(got):
  """As test_context_attention's: float32 sums in other orders; gradients over the 2048
  tokens of a batch; Adam moves a weight with a near-zero gradient by ~lr whatever."""
  want = one_device_steps()
  np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
  util.assert_trees_close(got[2], want[2], rtol=RTOL, terms=2048)
  util.assert_trees_close(got[1], want[1], rtol=RTOL, atol=test_context_attention.PARAMS_ATOL)


def test_tiny_lm_context_ring_with_splash_trains_like_one_device():
  """TinyLmContextRing (context 4 x data 2) with splash blocks: 256 tokens a shard, 2 rows,
  2 layers; losses, gradients and params after 2 Adam steps == lm.TinyLm on 1 device."""
  assert_like_one_device(context_steps("lm.TinyLmContextRing",
                                       ("task.model.attention_impl='splash'",)))
