"""Fused attention kernels, and the choice among them: `xla`, `splash`, `cudnn`, or `auto`.

`task.model.attention_impl` picks how `softmax(q·kᵀ/√d + mask)·v` is computed on full
sequences (training, eval, a no-cache forward) by `layers.attention.mha.Attention`; every
choice computes the same function:
  xla     `attention.attend`: einsum + softmax, the [t, s] scores materialized; any backend.
  splash  the Pallas splash-attention kernel from jax (`jax.experimental.pallas.ops.tpu.
          splash_attention`): blockwise online softmax, scores never held whole; causal
          blocks above the diagonal skipped; segment ids; grouped KV heads natively (query
          head i reads KV head i // group). Compiled on TPU, run in Pallas interpret mode
          on CPU (slow; for tests). Not on GPU.
  cudnn   `jax.nn.dot_product_attention(implementation="cudnn")`: cuDNN's fused kernel;
          GPU only, bf16/fp16, head_dim a multiple of 8 up to 128 (256 from Hopper on:
          the limits JAX's cuDNN wrapper checks). Packed rows pass their segment mask, which
          cuDNN takes as a [b, 1, t, t] bias (and returns its gradient): an even t.
  auto    the default: splash on TPU and cudnn on GPU where the shapes allow (packed rows
          included), else xla: `cudnn_problem` says why cuDNN would refuse a shape, and
          `choose` then falls back to xla.

splash and cudnn take causality from the token index (key j visible to query i iff
j <= i, within the segment when packed): positions must count up by one along each row
(restarting per segment), which is what training and eval batches hold. The KV-cache
decode path (one query token against a cache) always uses xla.

`check` (at validation) and `choose` (at trace time, when the sequence length is known)
resolve the choice and raise ConfigError naming `task.model.attention_impl` where a choice
cannot run.
"""
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import PartitionSpec as P

from spmdtask.core.sharding import entry_axes, shards
from spmdtask.errors import ConfigError
from spmdtask.layers.attention import window as window_lib
from spmdtask.layers.base import SplitDims

FIELD = "task.model.attention_impl"
IMPLS = ("auto", "xla", "splash", "cudnn")
SPLASH_LANES = 128          # splash blocks are multiples of the TPU lane width
SPLASH_BLOCKS = (512, 256, 128)  # tried in order: the largest that divides the sequence
CUDNN_DTYPES = ("bfloat16", "float16")


def check(impl: str, backend: str, head_dim: int, dtype: str) -> None:
  """ConfigError unless `impl` is a known choice that can run on `backend` (at validation;
  on GPUs this looks for the cuDNN library and the GPUs' compute capability)."""
  _check_name(impl, backend)
  refused = backend == "gpu" and impl in ("auto", "cudnn") and cudnn_problem(
      2, head_dim, dtype, False, gpu_compute_capability())
  if refused and impl == "cudnn":  # the sequence length is checked at trace time (`choose`)
    raise ConfigError(f"{FIELD}='cudnn' cannot run here: {refused}. Change that, or use "
                      "'auto' (falls back to xla) or 'xla'.")
  if refused and gpu_compute_capability() is None:
    _warn_once(f"attention runs as xla (scores materialized), not cuDNN's fused kernel: "
               f"{refused}.")


@functools.cache
def _warn_once(message: str) -> None:  # validation runs once per program
  logging.warning("%s", message)


def _check_name(impl: str, backend: str) -> None:
  if impl not in IMPLS:
    raise ConfigError(f"{FIELD}={impl!r} is not an attention implementation: use one of "
                      f"{', '.join(IMPLS)} ('auto' picks the best for the backend).")
  if impl == "cudnn" and backend != "gpu":
    raise ConfigError(
        f"{FIELD}='cudnn' needs a GPU backend (cuDNN's fused attention), but the mesh's "
        f"devices are {backend!r}: use 'auto' (splash on TPU, xla on CPU) or 'xla'.")
  if impl == "splash" and backend == "gpu":
    raise ConfigError(f"{FIELD}='splash' is the TPU Pallas kernel (interpret mode on CPU for "
                      "tests); on GPU use 'cudnn' or 'auto'.")


def _splash_problem(seq: int, num_heads: int, heads_split: SplitDims | None,
                    mesh_shape) -> str | None:
  """Why splash cannot run on these shapes, or None."""
  if seq % SPLASH_LANES:
    return (f"the sequence length {seq} is not a multiple of {SPLASH_LANES} (the kernel's "
            "block size): pad or pack sequences to a multiple of 128")
  if heads_split is None or not mesh_shape:
    return None
  if heads_split[1] is not None or heads_split[3] is not None:
    return ("task.model.activation_split_dims_mapping.heads splits the sequence or head_dim "
            f"({heads_split}), but each device needs whole sequences and heads: split only "
            "batch and heads")
  return heads_problem(num_heads, heads_split, mesh_shape)


def heads_problem(num_heads: int, heads_split: SplitDims, mesh_shape) -> str | None:
  """Why splash cannot take these heads (each device needs whole heads), or None."""
  if num_heads % shards(heads_split[2], mesh_shape):
    return (f"num_heads={num_heads} does not divide over the "
            f"{shards(heads_split[2], mesh_shape)} shards task.model."
            "activation_split_dims_mapping.heads puts on heads, and each device needs whole "
            "heads: make it divide")
  return None


@functools.cache
def gpu_compute_capability() -> tuple[int, int] | None:
  """The GPUs' CUDA compute capability: the first GPU's; (9, 0) for a compile-only target
  (a plan's --plan_topology: XLA's description of an H100). None when the cuDNN library
  cannot be loaded (JAX's CUDA plugin alone, the `gpu_plan` extra, brings none)."""
  from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top
  try:
    if cuda_versions is None or not cuda_versions.cudnn_get_version():
      return None
  except RuntimeError:  # "cuDNN not found"
    return None
  try:
    cc = jax.devices("gpu")[0].compute_capability
  except RuntimeError:  # no GPU backend in this process
    return (9, 0)
  return tuple(int(x) for x in cc.split(".")[:2])


def cudnn_problem(seq: int, head_dim: int, dtype, has_segments: bool,
                  compute_capability: tuple[int, int] | None) -> str | None:
  """Why cuDNN's fused attention (through JAX 0.10) refuses these shapes, or None.
  `compute_capability` None: the cuDNN library is not installed."""
  if compute_capability is None:
    return "the cuDNN library is not installed here (pip install 'spmdtask[gpu]' brings it)"
  if str(jnp.dtype(dtype)) not in CUDNN_DTYPES:
    return f"it computes in bfloat16 or float16 (task.model.fprop_dtype is {jnp.dtype(dtype)})"
  max_hd = 256 if compute_capability >= (9, 0) else 128
  if head_dim % 8 or head_dim > max_hd:
    return (f"head_dim={head_dim} must be a multiple of 8, at most {max_hd} on compute "
            f"capability {compute_capability[0]}.{compute_capability[1]}")
  if has_segments and seq % 2:
    return f"packed rows train with a mask bias, which needs an even sequence length ({seq})"
  return None


def choose(impl: str, backend: str, seq: int, num_heads: int, head_dim: int, dtype,
           has_segments: bool, heads_split: SplitDims | None, mesh_shape=None,
           compute_capability: tuple[int, int] | None = (9, 0)) -> str:
  """The concrete implementation for this call: `auto` resolved, explicit ones checked.
  Pure: the same arguments give the same choice on any machine.

  `mesh_shape` ({axis: size}; None or empty outside a mesh) is what `heads_split` splits;
  `compute_capability` is the GPUs' (`gpu_compute_capability()`; unused off GPU; None:
  no cuDNN library).
  """
  _check_name(impl, backend)
  splash_problem = _splash_problem(seq, num_heads, heads_split, mesh_shape)
  cudnn_refuses = cudnn_problem(seq, head_dim, dtype, has_segments, compute_capability)
  if impl == "auto":
    if backend == "tpu" and splash_problem is None:
      return "splash"
    if backend == "gpu" and cudnn_refuses is None:
      return "cudnn"
    return "xla"
  if impl == "splash" and splash_problem is not None:
    raise ConfigError(f"{FIELD}='splash' cannot run here: {splash_problem}; or use 'auto' "
                      "(falls back to xla) or 'xla'.")
  if impl == "cudnn" and cudnn_refuses is not None:
    raise ConfigError(f"{FIELD}='cudnn' cannot run here: {cudnn_refuses}. Change that, or "
                      "use 'auto' (falls back to xla) or 'xla'.")
  return impl


def splash_block_sizes(seq: int, block: int | None = None):
  """Splash's block sizes, forward and backward: `block`, or the largest of SPLASH_BLOCKS
  that divides `seq`."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  b = block or next(s for s in SPLASH_BLOCKS if seq % s == 0)
  return sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                       block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)


def _splash_local(q, k, v, segment_ids, causal: bool, interpret: bool, block: int | None,
                  window: int | None = None, scale: float | None = None):
  """One device's splash call: q [b, t, h, hd], k/v [b, t, kv, hd], segment_ids [b, t] | None;
  `window` a local layer's (layers.attention.window), `scale` q's (default hd**-0.5)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  _, t, h, hd = q.shape
  head_mask = window_lib.splash_mask(t, window, causal)
  kernel = sk.make_splash_mha(sm.MultiHeadMask([head_mask] * h),
                              block_sizes=splash_block_sizes(t, block), head_shards=1,
                              q_seq_shards=1, interpret=interpret)
  # The kernel wants [heads, seq, hd] per example and does not scale q itself.
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q * jnp.asarray(scale or hd ** -0.5, q.dtype), k, v))
  if segment_ids is None:
    out = jax.vmap(kernel)(q, k, v)
  else:
    out = jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=sk.SegmentIds(s, s)))(
        q, k, v, segment_ids)
  return jnp.swapaxes(out, 1, 2)


def splash_layout(q, k, v, heads_split: SplitDims, mesh):
  """How a splash call (a Pallas call has no partitioning rule) splits over `mesh`:
  (the axes its shard_map is manual over, the axes of q's batch and heads dims, k, v).

  Axes already manual (the SPMD pipeline's 'stage', MPMD's per-device data axes) split the
  arrays by hand already: the call is manual over every other axis, and replicated over
  those `heads_split` does not put on batch or heads. KV heads that do not divide over the
  heads' axes come back repeated to one per query head; a batch that does not divide over
  its axes (init traces one row) is not split."""
  manual = set(mesh.axis_names) - set(mesh.manual_axes)
  free = lambda entry: tuple(a for a in entry_axes(entry) if a in manual) or None
  batch_axes, head_axes = free(heads_split[0]), free(heads_split[2])
  if k.shape[2] % shards(head_axes, mesh.shape):
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  if q.shape[0] % shards(batch_axes, mesh.shape):
    batch_axes = None
  return manual, batch_axes, head_axes, k, v


def splash(q, k, v, segment_ids, causal: bool, heads_split: SplitDims | None,
           interpret: bool, block: int | None = None, window: int | None = None,
           scale: float | None = None):
  """Splash attention on [b, t, heads, hd] arrays, per device inside a mesh context.

  `block`: the kernel's q and kv block size (a multiple of 128 dividing t); by default
  the largest of 512, 256, 128 that divides t.

  A Pallas call has no partitioning rule, so in a mesh it runs under `jax.shard_map` over
  the axes `heads_split` puts on batch and heads (each device: its examples, its heads,
  whole sequences; `choose` checked that the heads divide). KV heads that do not divide
  over the heads' axes are repeated to one per query head first.
  """
  local = functools.partial(_splash_local, causal=causal, interpret=interpret, block=block,
                            window=window, scale=scale)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or heads_split is None:
    return local(q, k, v, segment_ids)
  axis_names, batch, head_axes, k, v = splash_layout(q, k, v, heads_split, mesh)
  spec, seg_spec = P(batch, None, head_axes, None), P(batch, None)
  if segment_ids is None:
    fn = jax.shard_map(lambda a, b, c: local(a, b, c, None), in_specs=(spec,) * 3,
                       out_specs=spec, axis_names=axis_names, check_vma=False)
    return fn(q, k, v)
  fn = jax.shard_map(local, in_specs=(spec, spec, spec, seg_spec), out_specs=spec,
                     axis_names=axis_names, check_vma=False)
  return fn(q, k, v, segment_ids)


def cudnn(q, k, v, segment_ids, causal: bool, window: int | None = None,
          scale: float | None = None):
  """cuDNN fused attention (GPU). Packed rows pass their segment mask [b, 1, t, s]; a
  local layer its window (layers.attention.window)."""
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, scale=scale,
                                      local_window_size=window_lib.cudnn_window(window, causal),
                                      implementation="cudnn")


def fused(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
          causal: bool, heads_split: SplitDims | None, backend: str,
          window: int | None = None, scale: float | None = None,
          is_local: jax.Array | None = None) -> jax.Array:
  """Self-attention over full sequences by the fused kernel `impl` ('splash' or 'cudnn', as
  `choose` returned it): q [b, t, heads, hd], k/v [b, t, kv_heads, hd], segment_ids [b, t]
  or None -> [b, t, heads, hd]. `window`, `is_local`: a local layer's window and, in a
  stack that mixes kinds, the layer's traced flag (`window.select`); `scale`: q's scale
  (default head_dim**-0.5)."""
  kernels: dict[str, Callable] = {
      "splash": lambda w: splash(q, k, v, segment_ids, causal, heads_split,
                                 interpret=backend != "tpu", window=w, scale=scale),
      "cudnn": lambda w: cudnn(q, k, v, segment_ids, causal, w, scale),
  }
  return window_lib.select(is_local, window, kernels[impl])
