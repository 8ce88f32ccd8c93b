"""A stack of identical layers, run by the task's execution strategy (or the decode scan).

The strategy is not the model's choice: the framework picks it from the Task
(`task.pipeline`, a `spmdtask.core.strategy.Strategy`; None = the remat'd scan) and the stack
calls it through that protocol only (`apply_stack`, `layout_maps`), never by its type.
Whatever the strategy, the stack's canonical layout (what checkpoints hold) is the
scanned one: every weight stacked as `[num_layers, ...]`.

The block is called as `(x, *side, row_ids, cache, dropout_key) -> (x, cache)`: `side`
arguments (positions, segment ids: `[b, ...]` per example) and the rows' global ids are
the same for every layer; the cache and the dropout key are per layer (scanned). Dropout
draws its mask from (the layer's key, the row's id), so a strategy that splits the batch
into microbatches draws the masks the whole batch would.

`layer_flags` (one bool per layer, or None) reach the block as one more scanned argument
after the dropout key: what differs between otherwise identical layers (Gemma 3's local
and global attention, layers.attention.window). Scanned data rather than a scan over
groups of layers: the canonical layout stays [num_layers, ...] and the depth need not be
a multiple of the pattern (Gemma 3 27B: 62 layers, a pattern of 6). The scan and the MPMD
pipeline (which scans its parts, `scan_layers`) pass them; the SPMD pipeline's
`block_fn` does not take them yet (a ConfigError).
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from spmdtask.core import remat
from spmdtask.errors import ConfigError
from spmdtask.layers import base
from spmdtask.layers import lora as lora_lib
from spmdtask.layers.attention import paged
from spmdtask.layers.attention.mha import KvCache, StackedLayer, live_prefix
from spmdtask.core.model import LayoutMap, PagedCache

BLOCK = "block"  # the param scope of the stacked block inside the stack


class LayerStack(nn.Module):
  """`num_layers` copies of `block_cls(**block_kwargs)` applied in order (module doc).

  Returns `(x, new_cache)`; new_cache is None without a cache. Implements
  `spmdtask.core.strategy.StackRunner` for the strategy in `execution`.
  """
  block_cls: type
  block_kwargs: dict
  num_layers: int
  remat_policy: str | None = "nothing_saveable"
  scan_unroll: int | bool = 1
  execution: Any = None  # a spmdtask.core.strategy.Strategy; None = scan
  layer_flags: tuple[bool, ...] | None = None  # per layer, scanned to the block (module doc)

  def _scan(self, block, num_bcast: int, length: int):
    scanned = 2 if self.layer_flags is None else 3
    return nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                   in_axes=(nn.broadcast,) * num_bcast + (0,) * scanned, length=length,
                   unroll=self.scan_unroll, metadata_params={nn.PARTITION_NAME: None})

  @nn.compact
  def __call__(self, x: jax.Array, *side: Any, cache: Any = None):
    if cache is not None:
      if self.execution is not None:
        raise ValueError("A pipelined stack does not decode: decode with pipeline=None "
                         "(checkpoints are canonical, so the same weights load).")
      # Decoding: no gradients, so no remat. One token a row: the whole cache is carried
      # (mha.StackedLayer); a chunk (a prefill): the cache is scanned over the layer dim.
      if isinstance(cache, (KvCache, PagedCache)) and jax.tree.leaves(x)[0].shape[1] == 1:
        return self._decode_step(x, side, cache)
      stack = self._scan(self.block_cls, len(side) + 1, self.num_layers)
      return stack(**self.block_kwargs, name=BLOCK)(x, *side, None, cache, None,
                                                    *self._flags(0, self.num_layers))
    side = side + (self._row_ids(x),)
    keys = self.layer_keys()
    if self.execution is None:
      return self.scan_layers(x, side, keys), None
    return self.execution.apply_stack(self, x, side, keys), None

  def _decode_step(self, x, side: tuple, cache: KvCache | PagedCache):
    """The layers on one token a row, the cache carried whole through the scan: each layer
    writes its token in place (mha.write_stacked) where the scan over the layer dim would
    copy every layer's slice out and the new cache back at every step. `side[0]` is the
    positions [b, 1]: the prefix of the cache every layer reads (mha.live_prefix). A
    `PagedCache` is carried the same way (layers.attention.paged: the pages read, from its
    page table)."""
    def body(block, carry, *rest):
      x, view = carry
      x, view = block(x, *rest[:len(side)], None, view, None, *rest[len(side):])
      return (x, view._replace(layer=view.layer + 1)), None
    flags = self._flags(0, self.num_layers)
    scan = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True},
                   in_axes=(nn.broadcast,) * len(side) + (0,) * len(flags),
                   length=self.num_layers, unroll=self.scan_unroll,
                   metadata_params={nn.PARTITION_NAME: None})
    start = (paged.start(cache) if isinstance(cache, PagedCache) else
             StackedLayer(cache, jnp.int32(0), live_prefix(side[0], cache.k.shape[2])))
    (x, view), _ = scan(self.block_cls(**self.block_kwargs, name=BLOCK), (x, start), *side,
                        *flags)
    return x, view.stack

  def _dropout(self) -> bool:
    rate = self.block_kwargs.get("dropout_rate") or lora_lib.dropout_rate(
        self.block_kwargs.get("lora"))
    return bool(rate) and self.has_rng("dropout")

  def _row_ids(self, x):
    if not self._dropout():
      return None
    rows = jax.tree.leaves(x)[0].shape[0]  # x may be a carry tuple (layers.moe.MoeBlock)
    return jnp.arange(rows, dtype=jnp.int32) + base.manual_row_offset(rows)

  def layer_keys(self) -> jax.Array | None:
    """Dropout key data `[num_layers, 2]` uint32 (one stream per layer), or None."""
    if not self._dropout():
      return None
    return jax.random.key_data(jax.random.split(self.make_rng("dropout"), self.num_layers))

  def remat_block(self):
    """The block class under `remat_policy` (or unchanged without one)."""
    if not self.remat_policy:
      return self.block_cls
    return nn.remat(self.block_cls, policy=remat.policy(self.remat_policy), prevent_cse=False)

  def scan_layers(self, x: jax.Array, side: tuple, keys: jax.Array | None, *, start: int = 0,
                  length: int | None = None, name: str = BLOCK) -> jax.Array:
    """Layers [start, start + length) as one remat'd scan named `name` (StackRunner)."""
    length = self.num_layers - start if length is None else length
    keys = None if keys is None else keys[start:start + length]
    stack = self._scan(self.remat_block(), len(side), length)
    x, _ = stack(**self.block_kwargs, name=name)(x, *side, None, keys,
                                                 *self._flags(start, length))
    return x

  def _flags(self, start: int, length: int) -> tuple:
    """(the layer flags of layers [start, start + length) as a bool array,) or ()."""
    if self.layer_flags is None:
      return ()
    return (jnp.asarray(self.layer_flags[start:start + length]),)

  def block_fn(self):
    """`(params, h, key, *side) -> h`: one layer, pure (StackRunner)."""
    if self.layer_flags is not None:
      raise ConfigError(
          "task.pipeline: the SPMD pipeline runs identical layers, but task.model."
          "attention_pattern mixes local and global layers; use task.pipeline=None (the "
          "scan) or an MPMD pipeline, or a uniform attention_pattern.")
    block = self.block_cls(**self.block_kwargs)

    def layer_fn(p, h, key, *side):
      return block.apply({"params": p}, h, *side, None, key)[0]
    return layer_fn


def layout_maps(path: tuple[str, ...], execution) -> tuple[LayoutMap, ...]:
  """The `LayoutMap`s of a stack whose params live at `path` (none when it is scanned)."""
  return () if execution is None else tuple(execution.layout_maps(tuple(path)))
