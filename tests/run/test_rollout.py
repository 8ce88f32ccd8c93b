"""GRPO's rollout feed: sampling at temperature 0 is greedy decoding, nothing compiles after
the first step, a rollout's batch, the plan of both phases."""
import jax
import jax._src.dispatch as dispatch  # BACKEND_COMPILE_EVENT: one per XLA compile
import numpy as np
import pytest

from configs import grpo as grpo_configs  # pylint: disable=unused-import  (registers)
from spmdtask.errors import PlanExceeded
from spmdtask.run import loop, rollout
from tests import oracles, util

# 2 prompts x 4 samples a step, μ = 2 (a rollout every other step, with the old log-probs).
SMALL = ["datasets['train'].batch_size=2", "task.objective.num_generations=4",
         "task.objective.num_iterations=2", "task.objective.beta=0.04",
         "task.train.log_interval_steps=5", "task.ici_mesh_shape=(1, 1, 1)"]
STEPS = 5


class _Compiles(loop.Hook):
  """The number of XLA compiles so far, after each step."""

  def __init__(self):
    self.count, self.after = 0, {}
    self._listen = lambda event, secs, **kw: self._add(event)
    jax.monitoring.register_event_duration_secs_listener(self._listen)

  def _add(self, event):
    self.count += event == dispatch.BACKEND_COMPILE_EVENT

  def after_step(self, step, state, last):
    self.after[step] = self.count

  def close(self):
    jax.monitoring.unregister_event_duration_listener(self._listen)


@pytest.fixture(scope="module")
def trained():
  """TinyLmGrpo (fresh init) trained STEPS steps in-process on one device."""
  compiles = _Compiles()
  run = util.build_run("TinyLmGrpo", SMALL + [f"task.train.num_train_steps={STEPS}"])
  state, program, losses = loop.train(run, hooks=[compiles], devices=jax.devices()[:1])
  return run, state, program, losses, compiles.after


def test_no_compile_after_the_first_step(trained):
  *_, losses, after = trained
  assert len(losses) == STEPS and np.all(np.isfinite(losses))
  assert after[1] > 0
  # step 3 samples again (μ = 2) and trains; step 5, the last, runs the NaN guard's check
  assert after[4] == after[1], after


def test_sampling_at_temperature_0_is_greedy_decoding(trained):
  run, state, program, *_ = trained
  obj = run.task.objective
  obj.temperature, obj.eos_id = 0.0, None
  inputs = run.datasets["train"]
  sampler = rollout.Sampler(program, obj, 2, 2, inputs.prompt_len)
  local = inputs.batch_at(7)
  samples = sampler.sample(state.params, local)
  rows = rollout.repeat_prompts(local, obj.num_generations)
  want = oracles.greedy_without_cache(program, state.params, rows["prompts"], rows["prompt_lens"],
                                      inputs.prompt_len + obj.max_new_tokens)
  assert [s["id"] for s in samples] == list(rows["ids"])
  for s, w, n in zip(samples, want, rows["prompt_lens"]):
    assert s["output_ids"] == w[n:n + obj.max_new_tokens].tolist()
  # the rows the step trains on: the prompt, then the completion as targets
  batch = rollout.lm_rows(samples, inputs.prompt_len + obj.max_new_tokens, obj.max_new_tokens)
  r, n = 5, int(rows["prompt_lens"][5])
  assert batch["targets"][r][batch["weights"][r] > 0].tolist() == samples[r]["output_ids"]
  assert batch["inputs"][r, :n].tolist() == samples[r]["prompt_ids"]


def test_the_plan_names_each_phases_peak_memory():
  from spmdtask.plan import planner  # pylint: disable=g-import-not-at-top
  run = util.build_run("TinyLmGrpo", SMALL + ["task.ici_mesh_shape=(-1, 1, 1)"])
  plan = planner.make_plan(run, "TinyLmGrpo", None, *rollout.plan_inputs(run))
  phases = {p["name"]: p for p in plan["phases"]}
  assert list(phases) == ["training", "sampling prefill", "sampling step"]
  assert phases["sampling step"]["calls_per_step"] == run.task.objective.max_new_tokens - 1
  assert phases["training"]["compiled"] == plan["compiled"]
  assert all(p["compiled"]["peak_estimate_bytes"] > 0 for p in plan["phases"])
  sampling = max(p["compiled"]["peak_estimate_bytes"] for p in plan["phases"][1:])
  with pytest.raises(PlanExceeded, match=r"the sampling \w+ program does not fit"):
    planner.check_fits(plan, sampling - 1)  # the phases are checked before the train step
