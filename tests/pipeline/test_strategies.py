"""Every strategy for every stacked model: cold starts from the 1-device initial weights,
packed text (segment ids, positions) and dropout under the SPMD pipeline and MPMD, ViT under
MPMD, each equal to one device; config errors; the plan of an MPMD job."""
import dataclasses
import functools
import re

import fiddle as fdl
import jax
import numpy as np
import pytest

from spmdtask.plan import chips, planner, printout, targets
from spmdtask.core import program as program_lib
from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import generators, simulate
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.pipeline.spmd import PipelineConfig
from spmdtask.core.strategy import StackFacts
from tests import util

STEPS = 3
DROPOUT = ("task.model.dropout_rate=0.1",)


def one_device(exp, overrides=(), edit=None, steps=STEPS):
  axes = util.build_run(exp, overrides).task.mesh_axis_names
  ones = "task.ici_mesh_shape=" + str((1,) * len(axes))
  return util.train_steps(exp, steps, jax.devices()[:1], (ones, *overrides), edit)


@functools.lru_cache(maxsize=None)
def tinylm(overrides=()):
  losses, params, program, _ = one_device("lm.TinyLm", overrides)
  init = jax.device_get(program.to_canonical(program.init()).params)
  return losses, params, init


@pytest.mark.parametrize("exp", ["lm.TinyLmPipeline", "lm.TinyLmCircular", "lm.TinyLmMpmd"])
def test_cold_start_has_the_one_device_weights_and_losses(exp):
  want_losses, _, want_init = tinylm()
  losses, _, program, _ = util.train_steps(exp, STEPS)
  init = jax.device_get(program.to_canonical(program.init()).params)
  util.assert_trees_equal(init, want_init)  # identical initial params
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


@pytest.mark.slow
def test_dropout_under_the_spmd_pipeline_and_mpmd_equals_one_device():
  # The SPMD pipeline splits inside the forward: masks are the whole batch's (row ids).
  want, _, _ = tinylm(DROPOUT)
  assert not np.allclose(want, tinylm()[0], rtol=1e-3)  # dropout changes the losses
  got, _, _, _ = util.train_steps("lm.TinyLmPipeline", STEPS, overrides=DROPOUT)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # MPMD draws microbatch m's key as 4-microbatch gradient accumulation does.
  want, _, _ = tinylm(DROPOUT + ("task.train.num_microbatches=4",))
  got, _, _, _ = util.train_steps("lm.TinyLmMpmd", STEPS, overrides=DROPOUT)
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_tiny_vit_mpmd_equals_tiny_vit_on_one_device():
  want, want_params, _, _ = one_device("vit.TinyVit")
  got, params, program, state = util.train_steps("vit.TinyVitMpmd", STEPS)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # Adam's first steps move a weight by ~lr whatever its gradient's size: one element in
  # 16k with a near-zero gradient differs by 4e-5 after 3 steps.
  util.assert_trees_close(params, want_params, rtol=1e-5, atol=1e-4)
  batch = program.global_batch(util.build_run("vit.TinyVit").datasets["eval"].batch_at(0))
  metrics = program.eval(state, batch)
  assert float(metrics["accuracy"].weight) == 32


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
  return util.packed_text_corpus(tmp_path_factory)


def _text(corpus):
  return ["task.model.vocab_size=257"] + [
      f"datasets['{s}'].{k}" for s in ("train", "eval")
      for k in (f"data_dir='{corpus}'", "batch_size=16", "seq_len=64")] + [
      f"decode_datasets['prompts'].data_dir='{corpus}'",
      "decode_datasets['prompts'].num_examples=4", "decode_datasets['prompts'].batch_size=4"]


def _spmd(cfg):
  cfg.task.mesh_axis_names = ("stage", "data", "fsdp", "model")
  cfg.task.ici_mesh_shape = (2, 2, 1, 2)
  cfg.task.pipeline = fdl.Config(PipelineConfig, num_stages=2, num_microbatches=4)


def _mpmd(cfg):
  cfg.task.pipeline = fdl.Config(MpmdConfig, layer_cuts=(2,),
                                 submesh_shapes=((2, 1, 2), (4, 1, 1)), num_microbatches=4)


@pytest.mark.slow
def test_packed_text_lm_under_both_pipelines_equals_one_device(corpus):
  want, want_params, _, _ = one_device("lm.TextLm", _text(corpus))
  batch = util.build_run("lm.TextLm", _text(corpus)).datasets["train"].batch_at(0)
  assert batch["segment_ids"].max() > 1  # packed rows
  for edit in (_spmd, _mpmd):
    got, params, _, _ = util.train_steps("lm.TextLm", STEPS, overrides=_text(corpus), edit=edit)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    util.assert_trees_close(params, want_params, terms=util.TINY_LM_TOKENS, rtol=1e-4)


def test_interleaved_with_one_chunk_is_a_config_error():
  run = util.build_run("lm.TinyLmMpmd", ["task.pipeline.schedule='interleaved_1f1b'"])
  with pytest.raises(ConfigError, match="num_chunks=1 would run un-interleaved"):
    run.task.pipeline.validate(StackFacts(num_layers=4, batch_size=16, mesh=None))


def test_plan_of_an_mpmd_job_compiles_every_stage_program(tmp_path):
  # XLA:CPU's programs, with a v5e's facts for the roofline.
  chip = chips.CHIPS["v5e"]
  target = dataclasses.replace(targets.present(), chip=chip)
  got = planner.make_plan(util.build_run("lm.TinyLmMpmd"), "lm.TinyLmMpmd", target)
  names = [p["name"] for p in got["programs"]]
  assert names == ["stage 0 part 0 forward", "stage 0 part 0 backward",
                   "stage 1 part 1 forward", "stage 1 part 1 backward",
                   "stage 0 gradient reduction", "stage 1 gradient reduction",
                   "stage 0 optimizer update", "stage 1 optimizer update"]
  assert all(p["devices"] == 4 and p["compiled"]["peak_estimate_bytes"] > 0
             for p in got["programs"])
  assert got["strategy"]["strategy"] == "mpmd"
  # The per-stage plan: live sets at the schedule's peak are the simulator's (1F1B: S - s),
  # their bytes that count times one set's compiled bytes; stage 1 holds the head.
  sim = simulate.simulate(generators.one_f_one_b(2, 4))
  stages = got["stage_plans"]
  assert [st["peak_activation_sets"] for st in stages] == [float(x) for x in
                                                           sim.peak_activations] == [2.0, 1.0]
  for st in stages:
    assert st["peak_activation_bytes"] == st["peak_activation_sets"] * st[
        "activation_set_bytes"][0] > 0
    assert st["transfer_bytes_per_step"] > 0 and st["flops_per_step"] > 0
    assert st["peak_estimate_bytes"] > st["state_bytes_per_device"] > 0
  assert stages[0]["layers"] == [[0, 1]] and stages[1]["layers"] == [[1, 4]]
  with pytest.raises(planner.PlanExceeded, match="pipeline stage 0 does not fit"):
    planner.check_fits(got, stages[0]["peak_estimate_bytes"] * 0.99)
  assert got["describe"][1].startswith("  stage 0: submesh data=2 fsdp=1 model=2 (devices 0-3), "
                                       "layers 0-0 + embedding, cost ")
  # Each stage's compiled cost (auto_cuts) next to the slowest: hand-set cut (1,) of 4 equal
  # layers on equal device counts leaves stage 0 (embedding + 1 layer) much the lighter.
  assert stages[1]["cost_vs_slowest"] == 1.0 and 0.2 < stages[0]["cost_vs_slowest"] < 0.5
  # The probe's costs are the stage programs' own: FLOPs per step per device per microbatch
  # (the optimizer update, once a step, adds under 2%).
  for st in stages:
    assert st["flops_per_step"] / 4 / 4 == pytest.approx(st["cost_flops_per_microbatch"],
                                                         rel=0.02)
  assert "(set by hand)" in got["describe"][-1]
  # The step's roofline (plan.stage_roofline): FLOPs summed over every stage program, the
  # bound the busiest stage's busy time, the MFU ceiling over all 8 chips.
  f, est = got["flops_per_step"], got["estimate"]
  assert sum(st["flops_per_step"] for st in stages) == pytest.approx(f["xla"], rel=1e-12)
  assert f["xla"] > f["model"] > 0
  busy = [st["busy_seconds"] for st in stages]
  assert busy == [max(st["seconds"].values()) for st in stages]
  assert est["step_seconds_lower_bound"] == max(busy) == busy[est["stage"]]
  assert stages[est["stage"]]["seconds"] == est["seconds"]
  assert 0 < est["mfu_upper_bound"] < 1
  assert abs(est["mfu_upper_bound"] - f["model"] / (
      est["step_seconds_lower_bound"] * chip.peak_bf16_flops_per_s * 8)) < 1e-9
  assert est["step_seconds_with_bubble_estimate"] == pytest.approx(
      max(b / (1 - st["bubble"]) for b, st in zip(busy, stages)), rel=1e-12)
  lines = printout.format_plan(got)
  assert sum(l.startswith(f"stage {s} busy per step: ") for s in (0, 1) for l in lines) == 2
  assert any(l.startswith("with the schedule's bubble (the simulator's estimate") for l in lines)


def test_stage_programs_hold_activations_split_as_the_mapping_says():
  """Each part is traced under its stage's submesh: stage 0 (data 2 x model 2) constrains the
  heads and feed-forward activations over `model`; stage 1 (data 4) over the batch only."""
  run = util.build_run("lm.TinyLmMpmd")
  example = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, example)
  got = {}
  for lw in program.lowerings(example):
    if lw.name.endswith("forward"):
      text = lw.lower().as_text()
      got[lw.stage] = (re.findall(r"sdy.mesh @\w+ = <([^>]*)>", text),
                       set(re.findall(r"sdy.sharding_constraint %\S+ <@\w+, (\[[^\n]*?\])>",
                                      text)), re.findall(r"manual_axes=(\{[^}]*\})", text))
  # Each part runs per device on the data axis (one gradient reduction a step, mpmd.local):
  # inside, the batch dim names the automatic data axes only (fsdp).
  assert got[0][0] == ['["data"=2, "fsdp"=1, "model"=2]'] and set(got[0][2]) == {'{"data"}'}
  assert '[{"fsdp"}, {}, {"model"}, {}]' in got[0][1]  # heads [b, t, h, hd]
  assert '[{"fsdp"}, {}, {"model"}]' in got[0][1]  # ff [b, t, d_ff]
  assert got[1][0] == ['["data"=4, "fsdp"=1, "model"=1]'] and set(got[1][2]) == {'{"data"}'}
  assert '[{"fsdp"}, {}, {"model"}]' in got[1][1]  # logits (model has size 1 here)
