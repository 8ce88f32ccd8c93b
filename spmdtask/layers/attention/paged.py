"""A one-token decode step's keys and values in pages (`core.model.PagedCache`).

The layer stack carries the `PagedCache` whole through its layer scan in a `PagedLayer`
view (as the stacked cache in `mha.StackedLayer`), with the layer and the pages every layer
reads (`start`: found once a step from the page table, not in every layer). A layer
`write`s its new keys and values at each slot's page and `read`s, per slot, its prompt's
row of the prompts' KV (positions past the prompt's length masked: far beyond any query)
then its first n pages (positions past the slot's own masked by causality). Contract: a
page belongs to one slot at most (the sampler's allocator, `run.pages`), so one token a
slot is written without collisions; a slot whose table row holds no page writes nothing.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from spmdtask.core.model import PagedCache

FAR = 2 ** 30  # a key position no query reaches (the prompt's padding)


class PagedLayer(NamedTuple):
  """Layer `layer` of the whole `PagedCache`; every slot's pages [0, prefix] are read."""
  stack: PagedCache
  layer: jax.Array   # [] int32
  prefix: jax.Array  # [] int32: pages read - 1 (the most any slot holds, at least 1)


def _pool(cache: PagedCache) -> tuple[int, int]:
  """(num_pages, page_size) of the cache's pool."""
  return tuple(jax.tree.leaves(cache.pages)[0].shape[1:3])


def start(cache: PagedCache) -> PagedLayer:
  """The view of the first layer: the step reads as many pages a slot as any slot holds."""
  held = jnp.sum((cache.table < _pool(cache)[0]).astype(jnp.int32), axis=1)
  return PagedLayer(cache, jnp.int32(0), jnp.clip(jnp.max(held) - 1, 0, cache.table.shape[1] - 1))


def write(view: PagedLayer, new, positions: jax.Array) -> PagedLayer:
  """`view` with `new` (a tree like the pool's, leaves [S, 1, ...]) at each slot's completion
  token positions[s, 0] - base[s] (in place: a scatter, one token a slot; dropped where the
  slot holds no page for it)."""
  c = view.stack
  num_pages, size = _pool(c)
  j = positions[:, 0] - c.base
  col = jnp.clip(j // size, 0, c.table.shape[1] - 1)
  page = jnp.take_along_axis(c.table, col[:, None], axis=1)[:, 0]
  page = jnp.where((j >= 0) & (j < c.table.shape[1] * size), page, num_pages)
  put = lambda pool, x: pool.at[view.layer, page, j % size].set(x[:, 0].astype(pool.dtype),
                                                                mode="drop")
  return view._replace(stack=c._replace(pages=jax.tree.map(put, c.pages, new)))


def read(view: PagedLayer, n: int) -> tuple:
  """(keys and values: a tree like the pool's of [S, P + n·page_size, ...] leaves, their
  positions [S, P + n·page_size]): each slot's prompt row, then its first `n` pages."""
  c = view.stack
  num_pages, size = _pool(c)
  pages = jnp.minimum(c.table[:, :n], num_pages - 1)  # no page: read any, masked

  def rows(prompts, pool):
    own = pool[view.layer, pages]  # [S, n, size, ...]
    own = own.reshape((own.shape[0], n * size) + own.shape[3:])
    return jnp.concatenate([prompts[view.layer, c.prompt], own], axis=1)
  plen = jax.tree.leaves(c.prompts)[0].shape[2]
  at = jnp.arange(plen)[None, :]
  kv_pos = jnp.concatenate([jnp.where(at < c.base[:, None], at, FAR),
                            c.base[:, None] + jnp.arange(n * size)[None, :]], axis=1)
  return jax.tree.map(rows, c.prompts, c.pages), kv_pos
