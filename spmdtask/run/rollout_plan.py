"""The plan's view of a GRPO rollout: its sampling and scoring programs as `Lowering`s
from shapes (`plan.phases` times and sizes them), beside the train step's."""
import math

import jax
import jax.numpy as jnp

from spmdtask.core import layouts, sharding
from spmdtask.run import decoding, pages as pages_lib, rollout, sampling


def sampling_lowerings(run, program) -> list:
  """A rollout's programs besides the train step, as `Lowering`s from shapes, for the
  plan: the sampler (`run.sampling`'s, for B prompts x G samples; its decode loop assumed
  to run the worst case, every sample to max_new_tokens) and the scorer (one forward over
  the B·G rows: the old log-probs and the sampler's gap); each runs once every μ
  optimizer steps. [] without a `Samples` objective."""
  obj, inputs = run.task.objective, run.datasets["train"]
  if not isinstance(obj, rollout.Samples):
    return []
  batch, plen = int(inputs.batch_size), int(inputs.prompt_len)
  n, mu = batch * obj.num_generations, obj.num_iterations
  stops = rollout.stop_ids(obj, inputs)
  gen = sampling.build(program, rollout.decode_params(obj, plen, stops), batch, plen,
                       obj.num_generations, obj.max_new_tokens, obj.sampler_slots,
                       obj.score_temperature(), pages=obj.sampler_kv_pages,
                       page_size=obj.sampler_page_size)
  mesh, specs = program.mesh, gen.prompt_specs
  params = layouts.sharded_structs(mesh, program.layout.padded.params, program.layout.split.params)
  prompts = layouts.sharded_structs(
      mesh, (jax.ShapeDtypeStruct((batch, plen), jnp.int32),
             jax.ShapeDtypeStruct((batch,), jnp.int32),
             jax.ShapeDtypeStruct((batch,), jnp.int32)),
      (specs["prompts"], specs["prompt_lens"], specs["ids"]))
  slots = gen.slots
  if gen.pages:  # at max length a pool holds pages / width samples at once
    slots = min(slots, gen.pages // pages_lib.width(obj.max_new_tokens, obj.sampler_page_size))
  trips = sampling.worst_case_iterations(n, slots, obj.max_new_tokens)
  note = (f"the worst case: every sample runs to max_new_tokens ({obj.max_new_tokens}); "
          f"{n} samples on {slots} slots: {-(-n // slots)} wave(s) of "
          f"{max(obj.max_new_tokens - 1, 0)} decode iterations (the first token from the "
          "prefill)" + ("; a loop per data shard, each on its share of the samples and slots"
                        if gen.per_shard else "") +
          (f"; {gen.slots} slots share {gen.pages} KV pages: as many samples at max length as "
           "those hold (more run while they are short; a preempted one's tokens rerun)"
           if gen.pages else ""))
  loop = layouts.Loop(trips, note, *bytes_read(program, gen, plen + obj.max_new_tokens, batch,
                                               plen))
  rows = obj.model_batch(rollout.example_batch(obj, batch, plen))
  row_specs = {k: program.batch_specs[k] for k in rows}
  per_token = program.batch_specs["targets"]
  scored = layouts.sharded_structs(
      mesh, ({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in rows.items()},
             jax.ShapeDtypeStruct(rows["targets"].shape, jnp.float32)), (row_specs, per_token))
  scorer = rollout.scorer(program, obj)
  return [layouts.Lowering("sampling", None, mesh, lambda: gen.program.lower(params, *prompts),
                           calls_per_step=1 / mu, fn=gen.program.jitted,
                           args=(params, *prompts), loop=loop),
          layouts.Lowering("scoring", None, mesh, lambda: scorer.lower(params, *scored),
                           calls_per_step=1 / mu, fn=scorer.jitted, args=(params, *scored))]


def bytes_read(program, gen: "sampling.Generator", total: int, prompts: int, prompt_len: int
               ) -> tuple[float, float, float]:
  """(weights, cache, prefill's weights) bytes one device must read for a decode iteration
  of `gen` (its slots of `total` tokens) and for the prompts' prefill: every weight but the
  share split over non-batch axes (the data axes only split the rows: the prefill's, FSDP
  gathering the rest), or for a decode iteration whose rows are whole over the weights'
  axes (`Generator.whole_rows`) only each device's shard, at the compute dtype (the
  cache's) where that is narrower; the slots' whole cache (every position: what the worst
  case's last iterations read; a step reads up to its longest row's block,
  layers.attention.mha.live_prefix), or, paged (`gen.pages`, run.pages), the pool (every
  page, split over the data axes as the slots) and the `prompts` x `prompt_len` prompts'
  KV (read where the prefill left it). As the model declares them: a compiler may narrow
  f32 further (XLA:TPU feeds its bf16 matmul passes)."""
  model, mesh_shape = gen.model, dict(program.mesh.shape)
  caches = ([model.cache_shape(gen.pages, gen.page_size), model.cache_shape(prompts, prompt_len)]
            if gen.pages else [model.cache_shape(gen.slots, total)])
  width = min(x.dtype.itemsize for x in jax.tree.leaves(caches[0]))
  specs = decoding.state_specs(model, program.task.batch_axes(), mesh_shape, gen.slots).cache

  def per_device(x, spec, itemsize, keep=lambda a: True):
    return x.size * itemsize / math.prod(mesh_shape[a] for e in spec
                                         for a in sharding.entry_axes(e) if keep(a))

  def weights(batch: set[str]) -> float:
    return float(sum(jax.tree.leaves(jax.tree.map(
        lambda x, s: per_device(x, s, min(x.dtype.itemsize, width), lambda a: a not in batch),
        program.layout.logical.params, program.layout.split.params,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)))))
  kv = sum(sum(jax.tree.leaves(jax.tree.map(lambda x, s: per_device(x, s, x.dtype.itemsize),
                                            c, specs))) for c in caches)
  batch = set(program.task.batch_axes())
  return weights(batch - set(gen.whole_rows)), float(kv), weights(batch)


def plan_inputs(run) -> tuple:
  """(example batch, sampling phase's lowerings `program -> [Lowering]` or None) for
  `plan.planner.run_plan`."""
  lowerings = ((lambda program: sampling_lowerings(run, program))
               if isinstance(run.task.objective, rollout.Samples) else None)
  return rollout.example(run), lowerings
