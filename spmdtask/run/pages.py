"""The sampler's page allocator (`run.sampling` with `sampler_kv_pages`): which slot holds
which page of a pool of completion KV, admission under a page budget, and preemption by
recompute. Pure functions of one pool's state (a data shard's loop, or the one loop).

Contract, for a pool of `num_pages` pages of `page_size` tokens and S slots:
- `table` [S, W] int32, W = ceil(max_new / page_size) (`width`): slot s's completion token j
  lies in page table[s, j // page_size] (`core.model.PagedCache`); `num_pages` = no page.
  A page belongs to one slot at most.
- A slot takes a free page only when its sample's next token starts a new page (`allocate`,
  before each decode step); a sample's pages go back when it ends (`release`).
- Admission (`admit`): the waiting line is the preempted samples (in queue order) first,
  then those never run; free slots take them while the free pages exceed what the running
  slots need this step (an admitted sample needs one at once), so admitting never preempts.
  A preempted sample comes back only where W pages are free beside those needs (room to
  run it to max_new as things stand), and none behind it while it waits: re-admitted at
  once it would be preempted again as the pool fills (benchmarks/grpo_sampling.py, 64
  samples all to 128 tokens on 16 slots sharing 64 pages of 16 over 8 shards: 168
  preemptions without this rule, 56 with it).
- Preemption (vLLM's by recompute): where the running slots need more pages than are free,
  the running samples latest in the queue are preempted, the fewest whose pages (and needs)
  cover the shortfall: their pages freed, their tokens discarded, and they go back to the
  front of the waiting line, to be re-run from their first token. The running sample
  earliest in the queue is never preempted while the pool holds W pages (`check`): it ends
  within max_new steps, then the next earliest, so the loop cannot livelock. A sample's
  draws depend only on (seed, sample id, position) (`run.decoding.draw_keys`), so its re-run
  gives the same tokens as an unbounded pool.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from spmdtask.core import mesh as mesh_lib, sharding
from spmdtask.core.model import PagedCache
from spmdtask.errors import ConfigError

FIELD = "task.objective.sampler_kv_pages"


class State(NamedTuple):
  """The allocator's carry besides the table (which the `PagedCache` holds)."""
  back: jax.Array        # [n] bool by queue position: preempted, waiting again
  qpos: jax.Array        # [S] int32: the queue position of the slot's sample
  preempted: jax.Array   # [] int32: preemptions so far
  recomputed: jax.Array  # [] int32: decode slot-steps whose tokens a preemption discarded


def width(max_new: int, page_size: int) -> int:
  """W: the pages of a sample at max_new tokens (a page table's row)."""
  return -(-max_new // page_size)


def check(pages: int, page_size: int, max_new: int, shards: int) -> None:
  """ConfigError unless page_size > 0 and pages is 0 (unpaged) or a multiple of the loops
  (`shards`: a loop per data shard, or 1) with one whole sample's pages (`width`) a loop."""
  if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
    raise ConfigError(
        f"task.objective.sampler_page_size={page_size!r}: the tokens of a KV page must be a "
        "positive integer (e.g. 32, the default).")
  least = width(max_new, page_size)
  if isinstance(pages, bool) or not isinstance(pages, int) or pages < 0 or pages % shards or (
      0 < pages < least * shards):
    raise ConfigError(
        f"{FIELD}={pages!r}: the sampler's pool of completion KV pages "
        f"(sampler_page_size={page_size} tokens each) is split over the sampler's {shards} "
        f"loop(s) (one a data shard, or one), each of whose pools must hold one sample at "
        f"max_new_tokens ({max_new} tokens: {least} pages), so no sample waits forever, and "
        f"the pages divide over them. Set it to a multiple of {shards} "
        f"of at least {least * shards}, or 0 for the unpaged cache (a row of prompt + "
        "max_new_tokens positions a slot).")


def check_place(model, cache_specs, mesh_shape, manual: set) -> None:
  """ConfigError where a pool cannot be held: per-head keys and values only (not MLA's
  latents), one layer stack (no dense layers before an MoE's), and no automatic mesh axis
  (GSPMD's) splitting the cache's rows (a pool has no rows to split; the data axes of a
  loop per data shard are `manual`: each shard its own pool; FSDP's rows whole: one pool)."""
  fix = f"Set {FIELD}=0 (the unpaged cache)"
  if getattr(model, "mla", None):
    raise ConfigError(f"{FIELD}: multi-head latent attention's cache (task.model.mla) is not "
                      f"paged. {fix}.")
  if getattr(getattr(model, "moe", None), "first_moe_layer", 0):
    raise ConfigError(f"{FIELD}: a model with dense layers before its MoE layers "
                      f"(task.model.moe.first_moe_layer) has two caches; only one is paged. {fix}.")
  rows = [a for a in sharding.entry_axes(jax.tree.leaves(
      cache_specs, is_leaf=lambda x: isinstance(x, P))[0][1])
          if a not in manual and mesh_shape.get(a, 1) > 1]
  if rows:
    raise ConfigError(
        f"{FIELD}: the sampler's one loop here splits the KV cache's rows over mesh axes "
        f"{rows} (FSDP's decode rows stay split where the KV heads do not divide the weights' "
        "axes, and over a data axis beside them), and a page pool has no rows to split. A "
        "pool is held on one device, in a loop per data shard (no weight split over the data "
        f"axes) or in FSDP's loop with its rows whole (KV heads dividing its axes). {fix}.")


def pool_specs(cache_specs):
  """The pool's PartitionSpecs from the cache's [layers, rows, len, kv_heads, hd]: rows and
  length dropped (pages are no rows), the kv heads' split kept."""
  return jax.tree.map(lambda s: P(s[0], None, None, *s[3:]), cache_specs,
                      is_leaf=lambda x: isinstance(x, P))


def empty_cache(prompts, pool, slots: int, max_new: int, rows) -> PagedCache:
  """The `PagedCache` of the prompts' KV and an empty `pool` (leaves [layers, num_pages,
  page_size, ...]): no slot holding a page; its per-slot arrays split as `rows` says."""
  num_pages, page_size = jax.tree.leaves(pool)[0].shape[1:3]
  table = jnp.full((slots, width(max_new, page_size)), num_pages, jnp.int32)
  zero = mesh_lib.constrain(jnp.zeros((slots,), jnp.int32), P(rows))
  return PagedCache(prompts, pool, mesh_lib.constrain(table, P(rows, None)), zero, zero)


def start(samples: int, slots: int) -> State:
  """Nothing preempted, no slot holding a sample."""
  return State(jnp.zeros((samples,), bool), jnp.full((slots,), -1, jnp.int32), jnp.int32(0),
               jnp.int32(0))


def _needs(table: jax.Array, live: jax.Array, count: jax.Array, page_size: int, num_pages: int):
  """([S] bool: the slot's next token, its `count`-th, starts a page it lacks, [S] its column)."""
  col = jnp.clip((count - 1) // page_size, 0, table.shape[1] - 1)
  own = jnp.take_along_axis(table, col[:, None], axis=1)[:, 0]
  return live & (own >= num_pages), col


def free_pages(table: jax.Array, num_pages: int) -> jax.Array:
  """[] int32: the pages no slot holds."""
  return num_pages - jnp.sum((table < num_pages).astype(jnp.int32))


def admit(free: jax.Array, state: State, queued: jax.Array, waiting: jax.Array,
          table: jax.Array, live: jax.Array, count: jax.Array, num_pages: int, page_size: int
          ) -> tuple[jax.Array, jax.Array, State, jax.Array]:
  """(take [S] bool, the queue positions they take [S], state, queued): free slots in order
  take the preempted samples first (each W free pages), else the line's next (`queued` of
  `waiting` gone, each one page), within the free pages beyond the running slots' needs."""
  n, slots = state.back.shape[0], table.shape[0]
  need, _ = _needs(table, live, count, page_size, num_pages)
  budget = free_pages(table, num_pages) - jnp.sum(need.astype(jnp.int32))
  rank = jnp.cumsum(free.astype(jnp.int32)) - 1
  npre = jnp.sum(state.back.astype(jnp.int32))
  pre = jnp.nonzero(state.back, size=slots, fill_value=0)[0].astype(jnp.int32)
  q = jnp.where(rank < npre, pre[jnp.clip(rank, 0, slots - 1)], queued + rank - npre)
  limit = jnp.where(npre > 0, jnp.minimum(npre, budget // table.shape[1]),
                    jnp.minimum(waiting - queued, budget))
  take = free & (rank < limit)
  back = state.back.at[jnp.where(take & (rank < npre), q, n)].set(False, mode="drop")
  queued = queued + jnp.sum((take & (rank >= npre)).astype(jnp.int32))
  return take, q, state._replace(back=back, qpos=jnp.where(take, q, state.qpos)), queued


def allocate(table: jax.Array, live: jax.Array, count: jax.Array, state: State,
             num_pages: int, page_size: int) -> tuple[jax.Array, jax.Array, State]:
  """(table, preempted [S] bool, state): each running slot whose next token starts a page
  holds one, after preempting the running samples latest in the queue where the free pages
  are too few (module doc). The caller frees the preempted slots and discards their tokens."""
  slots, n = table.shape[0], state.back.shape[0]
  need, col = _needs(table, live, count, page_size, num_pages)
  owned = jnp.sum((table < num_pages).astype(jnp.int32), axis=1)
  short = jnp.sum(need.astype(jnp.int32)) - free_pages(table, num_pages)
  latest = jnp.argsort(jnp.where(live, -state.qpos, n), stable=True)  # free slots last
  covered = jnp.cumsum((need.astype(jnp.int32) + owned)[latest]) >= short
  victims = jnp.where(short > 0, jnp.argmax(covered) + 1, 0)
  victim = jnp.zeros((slots,), bool).at[latest].set(jnp.arange(slots) < victims) & live
  table = jnp.where(victim[:, None], num_pages, table)
  need = need & ~victim
  used = jnp.zeros((num_pages + 1,), bool).at[table].set(True)[:num_pages]
  ids = jnp.nonzero(~used, size=slots, fill_value=num_pages)[0].astype(jnp.int32)
  page = ids[jnp.clip(jnp.cumsum(need.astype(jnp.int32)) - 1, 0, slots - 1)]
  rows = jnp.arange(slots)
  table = table.at[rows, col].set(jnp.where(need, page, table[rows, col]))
  back = state.back.at[jnp.where(victim, state.qpos, n)].set(True, mode="drop")
  return table, victim, state._replace(
      back=back, preempted=state.preempted + jnp.sum(victim.astype(jnp.int32)))


def release(table: jax.Array, ended: jax.Array, num_pages: int) -> jax.Array:
  """The table with the pages of the slots whose samples `ended` [S] free."""
  return jnp.where(ended[:, None], num_pages, table)
