"""The plan's view of a GRPO rollout: its sampling and scoring programs as `Lowering`s
from shapes (`plan.phases` times and sizes them), beside the train step's."""
import jax
import jax.numpy as jnp

from spmdtask.core import layouts
from spmdtask.run import rollout, sampling


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
                       obj.score_temperature())
  mesh, specs = program.mesh, gen.prompt_specs
  params = layouts.sharded_structs(mesh, program.layout.padded.params, program.layout.split.params)
  prompts = layouts.sharded_structs(
      mesh, (jax.ShapeDtypeStruct((batch, plen), jnp.int32),
             jax.ShapeDtypeStruct((batch,), jnp.int32),
             jax.ShapeDtypeStruct((batch,), jnp.int32)),
      (specs["prompts"], specs["prompt_lens"], specs["ids"]))
  trips = sampling.worst_case_iterations(n, gen.slots, obj.max_new_tokens)
  note = (f"the worst case: every sample runs to max_new_tokens ({obj.max_new_tokens}); "
          f"{n} samples on {gen.slots} slots: {-(-n // gen.slots)} wave(s) of "
          f"{max(obj.max_new_tokens - 1, 0)} decode iterations (the first token from the "
          "prefill)" + ("; a loop per data shard, each on its share of the samples and slots"
                        if gen.per_shard else ""))
  loop = layouts.Loop(trips, note, *sampling.bytes_read(program, gen, plen + obj.max_new_tokens))
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


def plan_inputs(run) -> tuple:
  """(example batch, sampling phase's lowerings `program -> [Lowering]` or None) for
  `plan.planner.run_plan`."""
  lowerings = ((lambda program: sampling_lowerings(run, program))
               if isinstance(run.task.objective, rollout.Samples) else None)
  return rollout.example(run), lowerings
