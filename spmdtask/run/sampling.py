"""The on-device sampler: shared prefill, a pool of decode slots with refill, one while_loop.

One jitted program per batch of B prompts samples G completions each (N = B·G samples):

    prefill the B prompts once            -> their KV [layers, B, P, ...], last logits [B, V]
    while a sample waits or a slot runs:   (jax.lax.while_loop: no host round trip per token)
      admit: each free slot takes the next waiting sample: its prompt's KV copied into the
             slot's first P cache entries (shared prefill), its first token drawn from the
             prompt's last logits
      step:  one token for every running slot (the model's KV-cache forward)
      a sample that emits a stop id or reaches max_new_tokens frees its slot

`slots` (S) sets the pool: S = N runs every sample at once (all admitted before the loop,
no refill: the fewest loop iterations, the longest sample's); S < N holds S rows of KV cache
and refills (continuous batching: a short sample's slot goes to the next one, so a long tail
keeps the slots busy). Paged (`run.pages`), a slot reads its prompt's KV where the prefill
left it (no copy) and its completion's from pages of a pool the slots share; a sample waits
for a page or is preempted and re-run (the same tokens).
Where no weight is split over the data axes (`per_shard_loops`, decided once in `build`)
each data shard runs this loop alone (a shard_map manual over the data axes) on its own
B/shards prompts, their samples and S/shards slots, with no communication inside: a shard
stops when its own samples are done, and the devices do not meet per token. Otherwise (FSDP)
one loop runs over all S slots until the last sample of all is done, its decode steps with
the rows whole over the axes that split the weights (`Decodable.whole_rows`, decided once
in `build`): each device multiplies its own weight shard by every slot's row and the
partial sums are reduced, so a step reads 1/shards of the weights and moves a few rows,
not the weights (FSDP gathers each layer whole for its rows: on a chip, a step bound by
the links), and attention and the cache split over the KV heads where they divide. The
prompts' prefill stays FSDP's (many rows: the gathers pay), its KV resharded to the
cache's split (gathered whole inside a refill where that splits rows: `_prompt_copier`).
Either way each shard's worst case is ceil(N / S) waves (`worst_case_iterations`).
A sample's draws depend only on (seed, its id, position), as `run.decoding`'s, so the
samples are the same whatever S and the mesh (and at temperature 0 equal greedy decoding).
Each token's log-prob under the logits / `score_temperature` is returned beside it (what
the trainer scores: `objective.token_logprobs`). Slots are sharded like the decode batch
(over the data axes), the cache as the model says; outputs come back replicated, with the
slot-steps run summed over the loops (utilization: busy / slot_steps).
"""
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask.core import global_batch, layouts, mesh as mesh_lib, sharding, steps as steps_lib
from spmdtask.errors import ConfigError
from spmdtask.run import decoding, pages as pages_lib
from spmdtask.task import DecodeParams


class Samples(NamedTuple):
  """What one call returns (replicated), for N = B·G samples in prompt-major order."""
  tokens: jax.Array    # [N, max_new] int32: the completion, stop id included, 0 beyond
  logp: jax.Array      # [N, max_new] float32: each token's log-prob, 0 beyond
  lengths: jax.Array   # [N] int32 (0 for a padding prompt's samples)
  ids: jax.Array       # [N] int32: sample ids (prompt id · G + g; -1 for padding's)
  iterations: jax.Array  # [] int32: loop iterations (decode steps over the pool; per-shard
                         # loops: the longest loop's)
  busy: jax.Array      # [] int32: slot-steps that produced a token
  slot_steps: jax.Array  # [] int32: slot-steps run (iterations x slots, summed over the loops)
  preempted: jax.Array   # [] int32: preemptions (a paged pool's, `run.pages`; 0 unpaged)
  recomputed: jax.Array  # [] int32: slot-steps whose tokens a preemption discarded (not busy)


COUNTS = ("busy", "slot_steps", "preempted", "recomputed")  # summed over per-shard loops


class _Loop(NamedTuple):
  """The while_loop's carry: per slot [S] (sharded like the cache's rows) but the last four."""
  cache: Any
  last: jax.Array      # the token each slot feeds next
  pos: jax.Array       # its position
  sample: jax.Array    # the sample running in the slot, -1 = free
  sid: jax.Array       # that sample's id (its draws' stream)
  count: jax.Array     # tokens the slot's sample has
  held: jax.Array      # the sample whose tokens the slot's buffer holds, -1 = none
  tokens: jax.Array    # [S, max_new] the buffer: tokens of `held`
  logp: jax.Array      # [S, max_new] their log-probs
  busy: jax.Array      # decode steps that produced a token
  queued: jax.Array    # [] samples admitted so far
  flags: jax.Array     # [2] bool: (a slot is free and a sample waits, a sample runs or waits)
  out: Samples
  pages: Any = None    # a paged pool's allocator state (run.pages.State)


def check_slots(slots: int, samples: int, shards: int, field: str) -> None:
  """ConfigError unless 0 < slots <= samples and the slots divide over the data shards."""
  if isinstance(slots, bool) or not isinstance(slots, int) or not 0 < slots <= samples or (
      slots % shards):
    raise ConfigError(
        f"{field}={slots}: the sampler's decode slots must be between 1 and the step's samples "
        f"({samples}) and a multiple of the data shards ({shards}). Set it so, or 0 for one "
        "slot per sample.")


def worst_case_iterations(samples: int, slots: int, max_new: int) -> int:
  """The decode loop's iterations when every sample runs to `max_new` tokens: `slots`
  (0: one a sample) take the samples in waves of max_new - 1 iterations each (a sample's
  first token comes from its prompt's prefill; a freed slot takes the next sample in the
  iteration that decodes its first step)."""
  slots = slots or samples
  return -(-samples // slots) * max(max_new - 1, 0)


def _prompt_copier(cache_specs, rows: int):
  """`(cache, prompts' KV, take [S] bool, prompt [S] int) -> cache`: each slot that takes
  a sample gets its prompt's KV as its first P entries. Per device (shard_map over the
  cache's row axes): the prompts' KV gathered whole (split over those axes as the cache's
  where its `rows` prompts divide them, else held whole by every device), then a loop over
  its own slots, one slot's update at a time. The gather lives only while slots are filled, not
  through the decode steps; a gather of every slot's prompt selected into the cache made
  XLA:TPU copy the whole cache to a slot-major layout and back. Inside a loop per data shard
  (the row axes manual already) the rows are the shard's own: the same loop, no gather."""
  axes = jax.tree.leaves(cache_specs, is_leaf=lambda x: isinstance(x, P))[0][1]
  mesh = jax.sharding.get_abstract_mesh()
  # rows whole (one device, rows whole over FSDP's axes) or a shard's own: no gather
  own = not sharding.entry_axes(axes) or (
      not mesh.empty and bool(set(mesh.manual_axes) & set(sharding.entry_axes(axes))))
  split = not own and rows % sharding.shards(axes, dict(mesh.shape)) == 0
  def local(cache, pcache, take, prompt):
    if split:
      pcache = jax.tree.map(lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True), pcache)
    def one(j, cache):
      def put(cc, pc):
        new = jax.lax.dynamic_slice_in_dim(pc, prompt[j], 1, axis=1)
        old = jax.lax.dynamic_slice_in_dim(cc, j, 1, axis=1)[:, :, :pc.shape[2]]
        return jax.lax.dynamic_update_slice_in_dim(cc, jnp.where(take[j], new, old), j, axis=1)
      return jax.tree.map(put, cache, pcache)
    return jax.lax.fori_loop(0, take.shape[0], one, cache)
  prompt_specs = jax.tree.map(lambda s: P(s[0], axes if split else None, *s[2:]), cache_specs)
  if own:
    return local, prompt_specs
  return jax.shard_map(local, in_specs=(cache_specs, prompt_specs, P(axes), P(axes)),
                       out_specs=cache_specs), prompt_specs


def generate_fn(model, dp: DecodeParams, group: int, slots: int, max_new: int,
                score_temperature: float, cache_specs, slot_spec, prefill_model=None,
                pool: tuple | None = None):  # pylint: disable=too-many-statements
  """`(params, prompts [B, P], prompt_lens [B], ids [B]) -> Samples`: one pool loop over
  the rows it is given (all, or a shard's under `per_shard`); prompt rows with id < 0 are
  padding (no samples). Sample b·G + g has id ids[b]·G + g. The prompts are prefilled by
  `prefill_model` (None: `model`, which runs the decode steps: the same params). `pool`
  (num_pages, page_size): the completions' KV in pages (`run.pages`)."""
  stops = jnp.asarray(dp.stop_ids or (-1,), jnp.int32)
  num_pages, page_size = pool or (0, 0)

  def draw(logits, sid, position):
    nxt = decoding.sample(logits, decoding.draw_keys(dp.seed, sid, position), dp)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / score_temperature, axis=-1)
    return nxt, jnp.take_along_axis(logp, nxt[:, None], axis=1)[:, 0]

  def generate(params, prompts, prompt_lens, ids):
    b, plen = prompts.shape
    n, total = b * group, plen + max_new
    zeros = lambda shape: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                       model.cache_shape(*shape))
    positions = jnp.broadcast_to(jnp.arange(plen), (b, plen))
    logits, pcache = (prefill_model or model).apply(
        {"params": params}, prompts, positions, zeros((b, plen)),
                                 logits_at=prompt_lens - 1)  # the last positions' only
    first = logits[:, 0]
    # the prompts' KV stays split as their rows (gathered at each refill: _prompt_copier);
    # every device holds their last logits
    if pool:  # shared, not copied: a slot reads its prompt's row (core.model.PagedCache)
      pspecs = jax.tree.map(lambda s: P(s[0], None, *s[2:]), cache_specs)
    else:
      copy_prompts, pspecs = _prompt_copier(cache_specs, b)
    pcache = jax.tree.map(mesh_lib.constrain, pcache, pspecs)
    first = mesh_lib.constrain(first, P())
    # the waiting line: real prompts' samples in order (padding's never run)
    real = jnp.repeat(ids >= 0, group)
    order = jnp.argsort(~real, stable=True).astype(jnp.int32)
    waiting = jnp.sum(real.astype(jnp.int32))
    constrain = mesh_lib.constrain
    ids, prompt_lens = constrain(ids, P()), constrain(prompt_lens, P())  # read per refill
    full = lambda v, dtype=jnp.int32: constrain(jnp.full((slots,), v, dtype), slot_spec)
    buffer = lambda dtype: constrain(jnp.zeros((slots, max_new), dtype), P(slot_spec[0], None))
    if pool:
      cache = pages_lib.empty_cache(pcache, jax.tree.map(
          constrain, zeros((num_pages, page_size)), pages_lib.pool_specs(cache_specs)),
                                    slots, max_new, slot_spec[0])
    else:
      cache = jax.tree.map(constrain, zeros((slots, total)), cache_specs)
    sids = jnp.where(real, jnp.repeat(ids, group) * group + jnp.arange(n) % group, -1)
    out = Samples(jnp.zeros((n, max_new), jnp.int32), jnp.zeros((n, max_new), jnp.float32),
                  jnp.zeros((n,), jnp.int32), sids.astype(jnp.int32), *[jnp.int32(0)] * 5)

    def flush(c: _Loop, which) -> _Loop:
      """Copies the buffers of the slots `which` to their samples' rows of the output."""
      row = jnp.where(which, c.held, n)  # n: out of range, dropped
      out = c.out._replace(tokens=c.out.tokens.at[row].set(c.tokens, mode="drop"),
                           logp=c.out.logp.at[row].set(c.logp, mode="drop"),
                           lengths=c.out.lengths.at[row].set(c.count, mode="drop"))
      return c._replace(held=jnp.where(which, -1, c.held), out=out)

    def admit(c: _Loop) -> _Loop:
      free = c.sample < 0
      c = flush(c, free & (c.held >= 0))
      if pool:  # the preempted first, while pages last (run.pages.admit)
        take, q, paged, queued = pages_lib.admit(free, c.pages, c.queued, waiting,
                                                 c.cache.table, ~free, c.count, *pool)
      else:
        q = c.queued + jnp.cumsum(free.astype(jnp.int32)) - 1
        take = free & (q < waiting)
        paged, queued = None, c.queued + jnp.sum(take.astype(jnp.int32))
      sample = jnp.where(take, order[jnp.clip(q, 0, n - 1)], c.sample)
      prompt = jnp.maximum(sample, 0) // group
      sid = jnp.where(take, ids[prompt] * group + jnp.maximum(sample, 0) % group, c.sid)
      lens = prompt_lens[prompt]
      nxt, logp = draw(first[prompt], sid, lens)
      ended = take & (jnp.isin(nxt, stops) | (max_new == 1))
      if pool:
        cache = c.cache._replace(prompt=jnp.where(take, prompt, c.cache.prompt),
                                 base=jnp.where(take, lens, c.cache.base))
      else:
        cache = copy_prompts(c.cache, pcache, take, prompt)
      at0 = take[:, None] & (jnp.arange(max_new) == 0)[None, :]
      fresh = lambda buf, v: jnp.where(at0, v[:, None], jnp.where(take[:, None], 0, buf))
      return c._replace(cache=cache, last=jnp.where(take, nxt, c.last),
                        pos=jnp.where(take, lens, c.pos), sample=jnp.where(ended, -1, sample),
                        sid=sid, count=jnp.where(take, 1, c.count),
                        held=jnp.where(take, sample, c.held), tokens=fresh(c.tokens, nxt),
                        logp=fresh(c.logp, logp), queued=queued, pages=paged)

    def preempt(c: _Loop) -> _Loop:
      """Pages for the slots starting one; a preempted sample's slot freed, tokens dropped."""
      table, victim, paged = pages_lib.allocate(c.cache.table, c.sample >= 0, c.count,
                                                c.pages, *pool)
      lost = jnp.where(victim, c.count - 1, 0)  # its decode steps: recomputed, not busy
      return c._replace(cache=c.cache._replace(table=table), busy=c.busy - lost,
                        sample=jnp.where(victim, -1, c.sample),
                        held=jnp.where(victim, -1, c.held),
                        pages=paged._replace(recomputed=paged.recomputed + jnp.sum(lost)))

    def step(c: _Loop) -> _Loop:
      if slots < n or pool:  # one slot a sample, unpaged: all were admitted before the loop
        c = jax.lax.cond(c.flags[0], admit, lambda c: c, c)
      if pool:
        c = preempt(c)
      live = c.sample >= 0
      logits, cache = model.apply({"params": params}, c.last[:, None], c.pos[:, None], c.cache)
      nxt, logp = draw(logits[:, 0], c.sid, c.pos + 1)
      ended = live & (jnp.isin(nxt, stops) | (c.count + 1 >= max_new))
      at = live[:, None] & (jnp.arange(max_new)[None, :] == c.count[:, None])
      sample = jnp.where(ended, -1, c.sample)
      left = c.queued < waiting
      if pool:
        cache = cache._replace(table=pages_lib.release(cache.table, ended, num_pages))
        left = left | jnp.any(c.pages.back)
      free, runs = jnp.any(jnp.stack([sample < 0, sample >= 0], axis=-1), axis=0)  # one reduce
      return c._replace(
          cache=cache, last=jnp.where(live, nxt, c.last), pos=c.pos + live.astype(jnp.int32),
          sample=sample, count=c.count + live.astype(jnp.int32),
          tokens=jnp.where(at, nxt[:, None], c.tokens), logp=jnp.where(at, logp[:, None], c.logp),
          busy=c.busy + live.astype(jnp.int32), flags=jnp.stack([free & left, runs | left]),
          out=c.out._replace(iterations=c.out.iterations + 1))

    idle = full(-1)
    start = _Loop(cache, full(0), full(0), idle, idle, full(0), idle, buffer(jnp.int32),
                  buffer(jnp.float32), full(0), jnp.int32(0),
                  jnp.stack([waiting > 0, waiting > 0]), out,
                  pages_lib.start(n, slots) if pool else None)
    if slots >= n and not pool:
      start = admit(start)
      start = start._replace(flags=jnp.stack([False, jnp.any(start.sample >= 0)]))
    # a slot whose sample ended at admission is free again: admit more before stopping
    end = jax.lax.while_loop(lambda c: c.flags[1], step, start)
    end = flush(end, end.held >= 0)
    paged = {k: getattr(end.pages, k) for k in ("preempted", "recomputed")} if pool else {}
    return end.out._replace(busy=jnp.sum(end.busy), slot_steps=end.out.iterations * slots,
                            **paged)
  return generate


@dataclasses.dataclass(frozen=True)
class Generator:
  """The jitted sampler of one program for B prompts x G samples on S slots."""
  program: steps_lib.Partitioned
  prompt_specs: dict
  mesh: Any
  group: int
  max_new: int
  slots: int
  per_shard: bool = False  # a loop per data shard (build), else one shared loop
  model: Any = None  # the model it runs (rows whole over `whole_rows` where that is set)
  whole_rows: tuple[str, ...] = ()  # FSDP's axes: the decode rows are whole over them
  pages: int = 0  # the completions' KV pages (all loops'; run.pages), 0: unpaged
  page_size: int = 0  # tokens a page

  def __call__(self, padded_params, local: dict) -> Samples:
    """Samples of the global batch whose process-local prompt rows are `local`
    ({'prompts', 'prompt_lens', 'ids'})."""
    return self.program(padded_params, *self.global_prompts(local))

  def global_prompts(self, local: dict) -> tuple:
    """(prompts, prompt_lens, ids) as the program takes them, from this process's rows."""
    local = {k: np.asarray(local[k]) for k in self.prompt_specs}
    if self.prompt_specs["ids"] == P(None):  # prompts too few to split: every process all
      local = multihost_utils.process_allgather(local, tiled=True)
      g = {k: jax.make_array_from_process_local_data(NamedSharding(self.mesh, s), local[k],
                                                     local[k].shape)
           for k, s in self.prompt_specs.items()}
    else:
      g = global_batch.to_global(local, self.prompt_specs, self.mesh)
    return g["prompts"], g["prompt_lens"], g["ids"]


def per_shard_loops(program, prompts: int) -> bool:
  """Whether the sampler runs a loop per data shard: there are several shards, the prompts
  divide over them, and no weight is split over the data axes (each shard can step its
  slots alone; a layout that splits them, FSDP's, keeps the one shared loop)."""
  shards = sharding.shards(tuple(program.task.batch_axes()) or None, dict(program.mesh.shape))
  return shards > 1 and prompts % shards == 0 and not layouts.weight_data_axes(program)


def build(program, dp: DecodeParams, prompts: int, prompt_len: int, group: int, max_new: int,
          slots: int = 0, score_temperature: float = 1.0, per_shard: bool | None = None,
          pages: int = 0, page_size: int = 32) -> Generator:
  """Validates and jits the sampler for `prompts` prompts (global) of `prompt_len` tokens,
  `group` samples each, at most `max_new` new tokens, on `slots` slots (0 = one a sample).
  `pages` > 0 holds the completions' KV in that many pages of `page_size` tokens (split
  over the loops like the slots; `run.pages`), the prompts' KV shared, not copied.
  `per_shard` (None: `per_shard_loops`, the layout's choice) runs a pool loop per data
  shard, on its own prompts and slots / shards slots, with no communication inside: each
  shard stops when its own samples are done (one shared loop runs every device to the
  longest sample of all, rendezvousing per token). Forced True where weights are split over
  the data axes, each shard gathers them whole once, before its loop."""
  model, mesh = program.model, program.mesh
  decoding.validate(model, dataclasses.replace(dp, max_decode_len=prompt_len + max_new),
                    prompt_len)
  n = prompts * group
  slots = slots or n
  data = tuple(program.task.batch_axes()) or None
  shards = sharding.shards(data, dict(mesh.shape))
  check_slots(slots, n, shards, "task.objective.sampler_slots")
  per_shard = per_shard_loops(program, prompts) if per_shard is None else per_shard
  whole = () if per_shard else layouts.weight_data_axes(program)
  if whole:  # FSDP: the rows whole, each device's weight shard used where it lies
    model = model.whole_rows(whole, dict(mesh.shape))
  specs = decoding.state_specs(model, program.task.batch_axes(), dict(mesh.shape), slots)
  loops = shards if per_shard else 1
  pages_lib.check(pages, page_size, max_new, loops)
  if pages:
    pages_lib.check_place(model, specs.cache, dict(mesh.shape), set(data) if per_shard else set())
  pool = generate_fn(model, dp, group, slots // loops, max_new, score_temperature, specs.cache,
                     specs.pos, program.model, (pages // loops, page_size) if pages else None)
  logical = program.layout.logical.params
  if per_shard:
    fn = _per_shard(pool, logical, mesh, data)
  else:
    fn = lambda padded, *prompt_rows: pool(sharding.unpad(padded, logical), *prompt_rows)
  split = data if prompts % shards == 0 else None  # the prompts' rows: over the data axes
  prompt_specs = {"prompts": P(split, None), "prompt_lens": P(split), "ids": P(split)}
  jitted = steps_lib.partition(
      fn, mesh, (program.layout.split.params, *prompt_specs.values()),
      Samples(*[P()] * len(Samples._fields)))
  return Generator(jitted, prompt_specs, mesh, group, max_new, slots, per_shard, model, whole,
                   pages, page_size if pages else 0)


def _per_shard(pool, logical, mesh, data: tuple[str, ...]):
  """`pool` under a shard_map manual over the data axes (the others stay automatic): each
  shard's loop on its rows; their counts summed (iterations: the longest loop's)."""
  rows = P(data)

  def local(params, prompts, prompt_lens, ids):
    out = pool(params, prompts, prompt_lens, ids)
    return out._replace(iterations=out.iterations[None],
                        **{k: getattr(out, k)[None] for k in COUNTS})

  loops = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(data, None), rows, rows),
                        out_specs=Samples(*[rows] * len(Samples._fields)),
                        axis_names=frozenset(data), check_vma=False)

  def generate(padded_params, prompts, prompt_lens, ids):
    out = loops(sharding.unpad(padded_params, logical), prompts, prompt_lens, ids)
    return out._replace(iterations=jnp.max(out.iterations),
                        **{k: jnp.sum(getattr(out, k)) for k in COUNTS})
  return generate


def to_rows(samples: Samples) -> dict[int, dict]:
  """{sample id: {'output_ids', 'logp'}} of the real prompts' samples (host lists)."""
  tokens, logp, lengths, ids = jax.device_get(
      (samples.tokens, samples.logp, samples.lengths, samples.ids))
  return {int(ids[r]): {"output_ids": tokens[r, :lengths[r]].tolist(),
                        "logp": logp[r, :lengths[r]].tolist()}
          for r in range(len(ids)) if ids[r] >= 0}
