"""A stack of identical layers and how it runs: a scan, the SPMD pipeline, or the decode scan.

The execution strategy is not the model's choice: the framework picks it from the Task
(`task.pipeline`, through the `Stacked` protocol of spmdtask.model). Whatever the
strategy, the stack's canonical layout (what checkpoints hold) is the scanned one: every
weight stacked as `[num_layers, ...]`. `layout_map` converts between the two.

Strategies:
  scan      `nn.scan` over the layers, each rematerialized under `remat_policy`;
  pipeline  weights `[S, R, L/(S·R), ...]`, run by `pipeline.spmd.pipeline_apply` over the
            stage mesh axis (GPipe, or circular with R > 1);
  mpmd      `MpmdConfig`: the layers cut into groups by layer index, each group its own
            scan `block_<g>` [L_g, ...], with a `stage_boundary` between groups at the top
            level (outside scan and remat), where `pipeline.split` cuts the traced step;
  decode    a plain scan that also scans the per-layer KV cache (given a `cache`).
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from spmdtask.layers import remat
from spmdtask.model import LayoutMap
from spmdtask.pipeline import mpmd_config, spmd
from spmdtask.pipeline.split import stage_boundary

BLOCK = "block"  # the param scope of the stacked block inside the stack


class LayerStack(nn.Module):
  """`num_layers` copies of `block_cls(**block_kwargs)` applied in order.

  The block is called as `(x, *side, cache) -> (x, cache)`: `side` arguments (e.g.
  positions) are broadcast to every layer, the cache (a tree with a leading layer dim)
  is scanned. Returns `(x, new_cache)`; new_cache is None without a cache.
  """
  block_cls: type
  block_kwargs: dict
  num_layers: int
  remat_policy: str | None = "nothing_saveable"
  scan_unroll: int | bool = 1
  pipeline: spmd.PipelineConfig | mpmd_config.MpmdConfig | None = None

  def _scan(self, block, with_cache: bool, num_side: int, extra_rngs: dict, length=None):
    in_axes = (nn.broadcast,) * num_side + ((0,) if with_cache else ())
    return nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True, **extra_rngs},
                   in_axes=in_axes, length=length or self.num_layers, unroll=self.scan_unroll,
                   metadata_params={nn.PARTITION_NAME: None})

  @nn.compact
  def __call__(self, x: jax.Array, *side: Any, cache: Any = None):
    if cache is not None:
      if self.pipeline is not None:
        raise ValueError("A pipelined stack does not decode: decode with pipeline=None "
                         "(checkpoints are canonical, so the same weights load).")
      # Decoding: no gradients, so no remat; the cache is scanned over the layer dim.
      stack = self._scan(self.block_cls, True, len(side), {})
      return stack(**self.block_kwargs, name=BLOCK)(x, *side, cache)
    if isinstance(self.pipeline, mpmd_config.MpmdConfig):
      return self._mpmd(x, side), None
    if self.pipeline is not None:
      return self._pipelined(x, side), None
    stack = self._scan(self._remat_block(), False, len(side), {"dropout": True})
    x, _ = stack(**self.block_kwargs, name=BLOCK)(x, *side)
    return x, None

  def _remat_block(self):
    if not self.remat_policy:
      return self.block_cls
    return nn.remat(self.block_cls, policy=remat.policy(self.remat_policy), prevent_cse=False)

  def _mpmd(self, x: jax.Array, side: tuple) -> jax.Array:
    """Each group of layers scanned as `block_<g>`, a stage boundary between groups."""
    block = self._remat_block()
    for g, (start, end) in enumerate(mpmd_config.layer_groups(self.pipeline.layer_cuts,
                                                              self.num_layers)):
      if g:
        x = stage_boundary(x)
      stack = self._scan(block, False, len(side), {"dropout": True}, length=end - start)
      x, _ = stack(**self.block_kwargs, name=f"{BLOCK}_{g}")(x, *side)
    return x

  def _pipelined(self, x: jax.Array, side: tuple) -> jax.Array:
    pp = self.pipeline
    s, r = pp.num_stages, pp.circular_repeat
    # Weights [S, R, Lps, ...]: vmap once per leading dim, the outermost mapped to the stage axis.
    stack = self.block_cls
    for length, axis_name in ((self.num_layers // (s * r), None), (r, None), (s, pp.stage_axis)):
      stack = nn.vmap(stack, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(None,) * (1 + len(side)), out_axes=0, axis_size=length,
                      metadata_params={nn.PARTITION_NAME: axis_name})
    stack = stack(**self.block_kwargs, name=BLOCK)
    if self.is_initializing():
      stack(x, *side)  # creates the stacked weights; init needs no pipelined forward
      return x
    params = nn.unbox(self.variables["params"][BLOCK])
    block = self.block_cls(**self.block_kwargs)

    def layer_fn(p, h, *bargs):
      return block.apply({"params": p}, h, *bargs)[0]

    # Side inputs are shared by every microbatch: row 0's (e.g. positions arange(t)).
    side = tuple(jax.tree.map(lambda a: a[:1], v) for v in side)
    return spmd.pipeline_apply(layer_fn, params, x, mesh=jax.sharding.get_abstract_mesh(),
                               config=pp, broadcast_args=side)


def layout_map(path: tuple[str, ...], pipeline) -> tuple:
  """The `LayoutMap`s of a stack whose params live at `path` (none when it is scanned)."""
  if pipeline is None:
    return ()
  if isinstance(pipeline, mpmd_config.MpmdConfig):
    return (LayoutMap(tuple(path), _join_groups,
                      lambda tree: _split_groups(tree, pipeline.layer_cuts)),)
  s, r = pipeline.num_stages, pipeline.circular_repeat
  return (LayoutMap(tuple(path),
                    spmd.from_stages,
                    lambda tree: spmd.to_stages(tree, s, r)),)


def _join_groups(tree: dict) -> dict:
  """{block_0: [L0, ...], block_1: [L1, ...], ...} -> {block: [L0 + L1 + ..., ...]}."""
  groups = [tree[f"{BLOCK}_{g}"] for g in range(len(tree))]
  return {BLOCK: jax.tree.map(lambda *xs: jnp.concatenate(xs), *groups)}


def _split_groups(tree: dict, layer_cuts) -> dict:
  """{block: [L, ...]} -> {block_<g>: layers [start_g, end_g)} (inverse of `_join_groups`)."""
  num_layers = jax.tree.leaves(tree[BLOCK])[0].shape[0]
  return {f"{BLOCK}_{g}": jax.tree.map(lambda a, s=start, e=end: a[s:e], tree[BLOCK])
          for g, (start, end) in enumerate(mpmd_config.layer_groups(layer_cuts, num_layers))}
