"""GRPO's rollout feed: sampling at temperature 0 is greedy decoding, nothing compiles after
the first step, a rollout's batch, the plan of its phases (memory; on a chip, time)."""
import collections

import jax
import jax._src.dispatch as dispatch  # BACKEND_COMPILE_EVENT: one per XLA compile
import numpy as np
import pytest

from configs import grpo as grpo_configs  # pylint: disable=unused-import  (registers)
from spmdtask.core import model as model_lib, program as program_lib
from spmdtask.errors import PlanExceeded
from spmdtask.plan import hlo, phases, planner, targets
from spmdtask.run import loop, rollout, rollout_plan
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
  run = util.build_run("TinyLmGrpo", SMALL + ["task.ici_mesh_shape=(-1, 1, 1)"])
  plan = planner.make_plan(run, "TinyLmGrpo", None, *rollout_plan.plan_inputs(run))
  phases = {p["name"]: p for p in plan["phases"]}
  # the sampler (one program: prefill and the decode loop), the scorer (old log-probs)
  assert list(phases) == ["training", "sampling", "scoring"]
  assert phases["sampling"]["calls_per_step"] == phases["scoring"]["calls_per_step"] == 0.5
  assert phases["training"]["compiled"] == plan["compiled"]
  assert "rl_step" not in plan and not any("estimate" in p for p in plan["phases"])  # no chip
  assert all(p["compiled"]["peak_estimate_bytes"] > 0 for p in plan["phases"])
  sampling = phases["sampling"]["compiled"]["peak_estimate_bytes"]
  with pytest.raises(PlanExceeded, match=r"the sampling program does not fit.*sampler_slots"):
    planner.check_fits(plan, sampling - 1)  # the phases are checked before the train step


def test_the_sampling_phase_on_a_chip_reads_the_weights_and_cache_each_iteration():
  """TinyLmGrpo's sampler compiled for v5e:2x2 (data 2 x FSDP 2): a decode iteration is
  every slot's token through the whole model (its FLOPs), its rows whole over fsdp
  (`sampling.Generator.whole_rows`): each chip reads only its half of the weights, and
  the rows' partial sums cross the links, not the weights; the prefill gathers them
  (FSDP's). Charged for those weights and every slot's whole cache; the plan assumes the
  worst case's iterations: 128 samples on 16 slots, 8 waves."""
  new, slots = 16, 16
  run = util.build_run("TinyLmGrpo", ["task.ici_mesh_shape=(2, 2, 1)",
                                      f"task.objective.max_new_tokens={new}",
                                      f"task.objective.sampler_slots={slots}"])
  target = targets.topology("v5e:2x2", 1)
  program = program_lib.setup(run.task, rollout.example(run), devices=list(target.devices))
  lowering = rollout_plan.sampling_lowerings(run, program)[0]
  loop, rows = lowering.loop, slots // 4  # a chip's share of the work: a quarter
  assert loop.trips == 8 * (new - 1) and lowering.calls_per_step == 1
  weights = sum(x.size for x in jax.tree.leaves(program.layout.logical.params))
  assert loop.prefill_bytes == weights * 4  # the prefill: every chip every (f32) weight
  # a decode iteration: each chip its half (the norms, not split, whole on each: < 1%)
  assert weights * 4 / 2 < loop.weights_bytes < weights * 4 / 2 * 1.01
  assert loop.cache_bytes == model_lib.cache_bytes_per_token(program.model) * rows * (
      run.datasets["train"].prompt_len + new)
  text = planner.compile_lowering(lowering)[0].as_text()
  est = phases.estimate(target.chip, text, 1, loop)
  trip = est["trip"]["cost"]
  # 2 FLOPs a weight per row (the embedding's gather aside: < 2·P), plus attention
  assert 2 * weights * rows * 0.95 <= trip["flops"] <= 2 * weights * rows * 1.1
  # an iteration receives its rows' activations and partial sums, not the half of the
  # weights a chip lacks (FSDP's gather: `weights` bytes in bf16); measured: 0.20x of it
  # (TinyLm's d_model is 128: a row's partial sums are as wide as a weight's rows)
  assert 0 < trip["ici_bytes"] < 0.25 * weights
  ran = lambda trips: collections.Counter(
      (op.label, op.bytes) for op in hlo.collective_ops(text, unknown_trips=trips)
      for _ in range(op.runs))
  per_trip = ran(2) - ran(1)  # what one more iteration adds
  smallest = 2 * min(x.size // x.shape[0] for x in jax.tree.leaves(program.layout.logical.params)
                     if x.ndim == 3)  # a layer's smallest weight (k, v), bf16
  assert per_trip and max(size for _, size in per_trip) < smallest  # no weight moves
  assert trip["hbm_bytes"] == loop.weights_bytes + loop.cache_bytes
  assert est["trip"]["xla_hbm_bytes"] >= trip["hbm_bytes"]  # XLA counts more, never less
  assert est["seconds_lower_bound"] == pytest.approx(
      est["once"]["seconds_lower_bound"] + loop.trips * est["trip"]["seconds_lower_bound"])


def test_a_completion_stops_at_the_first_stop_id_in_rows_and_rewards():
  """Samples as the decoder returns them (stopped at the first of eos 2 and end-of-turn 6,
  that token kept): the train rows weight it, the rewards' text leaves it out."""
  samples = [{"prompt_ids": [9, 9, 9], "output_ids": [5, 6]},      # end-of-turn
             {"prompt_ids": [9], "output_ids": [5, 5, 2]},         # eos
             {"prompt_ids": [9, 9], "output_ids": [5, 5, 5, 5]}]   # max_new_tokens
  rows = rollout.lm_rows(samples, seq_len=7, max_new_tokens=4)
  assert rows["weights"].tolist() == [[0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0],
                                      [0, 1, 1, 1, 1, 0, 0]]
  assert rows["targets"][0, 2:4].tolist() == [5, 6] and rows["targets"][1, :3].tolist() == [5, 5, 2]
  assert [rollout.completion_ids(s, 4, (2, 6)) for s in samples] == [[5], [5, 5], [5, 5, 5, 5]]


def test_stop_ids_are_the_objectives_else_the_prompts_data_dirs():
  from spmdtask.objectives.grpo import Grpo  # pylint: disable=g-import-not-at-top
  class Prompts:  # a prompts data dir's stop ids (eos, end-of-turn)
    stop_ids = (6, 0)
  assert rollout.stop_ids(Grpo(), Prompts()) == (6, 0)
  assert rollout.stop_ids(Grpo(eos_id=256), Prompts()) == (256,)
  assert rollout.stop_ids(Grpo(eos_id=(1, 2)), Prompts()) == (1, 2)
  assert rollout.decode_params(Grpo(max_new_tokens=4), 5, (6, 0)).stop_ids == (6, 0)
  assert rollout.decode_params(Grpo(max_new_tokens=4), 5).eos_id is None


def test_a_changed_reward_file_on_resume_is_said(tmp_path, capsys, monkeypatch):
  from spmdtask import console  # pylint: disable=g-import-not-at-top
  from spmdtask.objectives.grpo import Grpo  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(console, "_echo", True)
  f = tmp_path / "r.py"
  f.write_text("def r(p, c, a):\n  return [0.0] * len(c)\n")
  obj = Grpo(rewards=(f"{f}:r", "final_answer"))
  rollout.note_reward_files(obj, str(tmp_path), 0)
  rollout.note_reward_files(obj, str(tmp_path), 10)  # unchanged: nothing said
  assert capsys.readouterr().out == ""
  f.write_text("def r(p, c, a):\n  return [1.0] * len(c)\n")
  rollout.note_reward_files(obj, str(tmp_path), 10)
  out = capsys.readouterr().out
  assert out.startswith(f"Reward {f}:r: its file changed since this job last ran (sha256 ")
  assert out.endswith("the steps from 11 on are rewarded by the file as it is now.\n")
  rollout.note_reward_files(obj, str(tmp_path), 12)  # recorded: said once
  assert capsys.readouterr().out == ""


def test_overlapped_sampling_trains_on_samples_of_the_params_one_update_older():
  run = util.build_run("TinyLmGrpo", SMALL[:2] + [
      "task.objective.overlap_sampling=True", "task.ici_mesh_shape=(1, 1, 1)"])
  program = program_lib.setup(run.task, rollout.example(run), jax.devices()[:1])
  feed = rollout.feed(run, program)
  state = program.init()
  before = jax.tree.map(np.array, state.params)  # θ0 (the step donates the state)
  state, metrics = feed.step(state)
  # The first batch is sampled at once (on-policy): nothing to clip.
  assert float(metrics["clip_ratio"]) == 0
  # A checkpoint now records the prompts' position before the batch sampled ahead.
  assert run.datasets["train"].get_state() == {"step": 2}
  assert feed.input_state() == {"step": 1}
  # The batch step 2 trains on was sampled from θ0, the params before step 1's update, on
  # the second batch of prompts; its ratio's old log-probs are that sampler's.
  inputs, obj = run.datasets["train"], run.task.objective
  sampler = rollout.Sampler(program, obj, 2, 2, inputs.prompt_len, feed.sampler.stops)
  theta0 = jax.device_put(before, jax.tree.map(lambda x: x.sharding, state.params))
  samples = sampler.sample(theta0, inputs.batch_at(1))
  seq_len = inputs.prompt_len + obj.max_new_tokens
  rows = rollout.lm_rows(samples, seq_len, obj.max_new_tokens)
  np.testing.assert_array_equal(np.asarray(feed._batch["inputs"]), rows["inputs"])
  np.testing.assert_array_equal(np.asarray(feed._batch["old_logp"]),
                                rollout.sampler_logp(samples, seq_len, obj.max_new_tokens))
  # One update later the policy has moved off the sampler's: the gap is the lag's (3e-5
  # here from a fresh init), not float noise (3e-7 on-policy).
  assert feed._extra["logp_gap_mean"] > 1e-5
