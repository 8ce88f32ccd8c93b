"""Splash attention as the ring's block kernel (`layers.attention.context`, `ring`).

Splash takes its mask from token indices, and in the ring every block pair's mask is static
in local index order because the rows are in zig-zag order (shard i holds chunks i and
2cp-1-i of 2cp):
  its own block (the diagonal)   causal (t, t): chunk 2cp-1-i sees all of chunk i, chunk i
                                 none of chunk 2cp-1-i, each chunk causal on itself;
  a block from an earlier shard  every query against the block's first half: full (t, t/2);
  a block from a later shard     this shard's second half against the whole block: full
                                 (t/2, t);
and without causality every pair is full. The ring selects those halves; this module only
needs to know whether a block is the diagonal. Packed rows pass their segment ids (this
shard's for q, the block's for kv).

Forward: splash with its residuals gives a block's normalized output and log-sum-exp, which
is a partial softmax (o, m=lse, l=1) the ring merges like any other. A row that sees no key
of a block (another segment) gets lse ≈ splash's mask value (-0.7·f32 max) + log(keys):
finite, so its weight exp(lse_b - lse) is exactly 0 once the row's own diagonal is merged.
Backward: splash's own backward kernel, fed the ring's GLOBAL output and log-sum-exp,
gives a block's exact share of the gradients (P = exp(s - lse), di = rowsum(o·do)). The
fused one (dq, dk and dv in one pass: 5 matmuls a block, not 7 with a separate dq kernel):
on Llama31_8B_128k's v5p-128 plan (2-layer proxy) compute 357 -> 317 ms, temporaries
2.7 -> 3.0 GiB (its dq partials per DKV_KEYS keys, [s/1024, heads, t, hd] in q's dtype).

Precision: splash returns a block's output and gradients in q's dtype. In bfloat16 each
block's partial output and each block's dq, dk, dv are rounded to bfloat16 (~2^-9
relative; the fused kernel's dq also per DKV_KEYS keys, summed in q's dtype) before the
ring sums them in float32; the xla kernel keeps its partials in float32 (its probabilities
are rounded to bfloat16 for the P·V matmul all the same). Measured (CPU,
interpret mode, bfloat16 q/k/v, packed rows, 256 tokens a shard, head_dim 64), the largest
error of dq, dk, dv against float32 attention of the unrounded inputs, over the largest
gradient: cp 2: splash 6.7e-3, 5.8e-3, 3.3e-3 and xla the same; cp 4: splash 7.6e-3,
4.7e-3, 4.0e-3, xla 6.3e-3, 4.5e-3, 3.8e-3: the inputs' rounding dominates.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from spmdtask.layers.attention import fused as fused_attention

# Tokens per shard a ring of splash blocks needs: its half blocks (t/2) must be multiples of
# splash's 128-lane block.
LOCAL_MULTIPLE = 2 * fused_attention.SPLASH_LANES
DKV_KEYS = 1024  # keys per step of the fused backward kernel, where they divide a block


def _kernel(tq: int, tk: int, heads: int, causal: bool, interpret: bool):
  """A splash kernel (save_residuals: its output and log-sum-exp; the fused backward) for
  one static mask: causal (the diagonal, tq == tk) or full. Built in the trace that calls
  it: its mask info becomes that trace's constants (a kernel kept across traces would
  carry another mesh's arrays)."""
  mask = sm.CausalMask((tq, tk)) if causal else sm.FullMask((tq, tk))
  return sk.make_splash_mha(sm.MultiHeadMask([mask] * heads), block_sizes=block_sizes(tq, tk),
                            head_shards=1, q_seq_shards=1, save_residuals=True,
                            interpret=interpret)


def block_sizes(tq: int, tk: int, dkv_keys: int = DKV_KEYS) -> sk.BlockSizes:
  """Splash's block sizes for tq queries (a shard's) against tk keys, with the fused
  backward kernel (dq, dk and dv in one pass) taking `dkv_keys` keys a step where they
  divide tk."""
  sizes = fused_attention.splash_block_sizes(min(tq, tk))
  # The fused backward keeps dq partials per block_kv_dkv keys: 1024, not 512, halves them
  # (128k proxy temporaries 3.3 -> 3.0 GiB, step estimate unchanged).
  return dataclasses.replace(
      sizes, block_q_dq=None, block_kv_dq=None, use_fused_bwd_kernel=True,
      block_kv_dkv=dkv_keys if tk % dkv_keys == 0 else sizes.block_kv_dkv)


def _global_grads(kernel, q, k, v, segment_ids, o, lse, do):
  """(dq, dk, dv) of one example's splash call whose softmax rows are normalized by `lse`
  [h, t] and whose output is `o` [h, t, hd] (the ring's whole-row ones, not the block's),
  from the cotangent `do`: q [h, t, hd], k/v [kv, s, hd].

  Uses `_splash_attention_bwd`, a PRIVATE function of jax's splash kernel (jax 0.10.2):
  the public kernel's VJP normalizes by the block's own log-sum-exp, and would give the
  gradient of the block's softmax alone. Its residual tuple is (q, k, v, segment_ids,
  sinks, o, logsumexp, dq_mask_info, dkv_mask_info), as `_splash_attention_fwd` builds it
  (static masks: their partial mask blocks need no collapse). Pinned by
  tests/layers/attention/test_splash_blocks.py against the xla block's gradients.
  """
  res = (q, k, v, segment_ids, None, o, lse, kernel.dq_mask_info, kernel.dkv_mask_info)
  # pylint: disable-next=protected-access
  grads = sk._splash_attention_bwd(res=res, do=do, **kernel.kwargs)
  return grads[3:6]


@dataclasses.dataclass(frozen=True)
class SplashBlocks:
  """The ring's block kernel by splash (see the module doc). Arrays as the ring holds them:
  q [b, t, kv, g, hd], k/v [b, s, kv, hd], segment ids [b, t] / [b, s] or None; outputs
  [b, kv, g, t, hd] and [b, kv, g, t] float32. Positions are not read: the mask is static
  (`diagonal`). `interpret`: Pallas interpret mode (off TPU; tests)."""
  causal: bool
  interpret: bool

  def _setup(self, q, k, v, q_seg, kv_seg, diagonal: bool):
    """The block's kernel and its operands in splash's layout: q [b, heads, t, hd] (query
    head kv·g + j reads KV head kv; scaled, as splash does not), k/v [b, kv, s, hd], the
    segment ids; and q's shape."""
    b, t, kvh, g, hd = q.shape
    kernel = _kernel(t, k.shape[1], kvh * g, self.causal and diagonal, self.interpret)
    qh = jnp.transpose(q * jnp.asarray(hd ** -0.5, q.dtype), (0, 2, 3, 1, 4)).reshape(
        b, kvh * g, t, hd)
    kh, vh = (jnp.swapaxes(x, 1, 2) for x in (k, v))
    seg = None if q_seg is None else sk.SegmentIds(q_seg, kv_seg)
    return kernel, (qh, kh, vh, seg), (b, kvh, g, t, hd)

  def forward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, diagonal: bool):
    """A block's partial softmax (o, m, l) = (its normalized output, its log-sum-exp, 1)."""
    del q_pos, kv_pos
    kernel, args, shape = self._setup(q, k, v, q_seg, kv_seg, diagonal)
    o, (lse,) = jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=s))(*args)
    lse = lse.reshape(shape[:-1])
    return o.reshape(shape).astype(jnp.float32), lse, jnp.ones_like(lse)

  def grads(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, diagonal: bool, do, o, lse, delta):
    """A block's share of (dq [b, t, kv, g, hd], dk, dv [b, s, kv, hd]) float32, from the
    ring's output cotangent `do`, output `o` and log-sum-exp `lse` (the kernel computes
    rowsum(o·do) itself: `delta` is not read)."""
    del q_pos, kv_pos, delta
    kernel, args, (b, kvh, g, t, hd) = self._setup(q, k, v, q_seg, kv_seg, diagonal)
    heads = lambda x: x.reshape(b, kvh * g, *x.shape[3:])
    dq, dk, dv = jax.vmap(functools.partial(_global_grads, kernel))(
        *args, heads(o), heads(lse), heads(do).astype(q.dtype))
    dq = jnp.transpose(dq.reshape(b, kvh, g, t, hd), (0, 3, 1, 2, 4)).astype(jnp.float32)
    f32 = lambda x: jnp.swapaxes(x, 1, 2).astype(jnp.float32)
    return dq * hd ** -0.5, f32(dk), f32(dv)
