"""Tests for spmdtask.pipeline.mpmd.stages' plan: `stages.plan` makes every decision of an
MPMD program once (resolved cuts, layer groups, schedule, microbatches, submeshes) into a
frozen StagePlan that `program.setup` reads; bad configs raise ConfigError naming the
field, before anything is traced."""
import dataclasses

import jax
import pytest

from spmdtask.core import global_batch, program as program_lib
from spmdtask.errors import ConfigError
from spmdtask.pipeline.mpmd import stages
from tests import util


def _plan(overrides=()):
  run = util.build_run("lm.TinyLmMpmd", overrides)
  shapes = global_batch.global_shapes(run.datasets["train"].batch_at(0))
  return stages.plan(run.task, run.task.pipeline, shapes, jax.devices()), run


def test_the_plan_holds_every_decision_and_is_frozen():
  plan, run = _plan()
  assert plan.config == run.task.pipeline and not plan.auto
  assert plan.layer_cuts == (1,) and plan.num_layers == 4
  assert plan.groups == ((0, 1), (1, 4))
  assert plan.schedule == stages.make_schedule(run.task.pipeline)
  assert plan.num_stages == 2 and plan.part_stage == (0, 1)
  assert plan.num_microbatches == 4
  assert plan.microbatch_size * 4 == plan.batch_rows
  assert {x.shape[0] for x in jax.tree.leaves(plan.micro)} == {plan.microbatch_size}
  assert [m.devices.size for m in plan.meshes] == [4, 4] and plan.mesh.devices.size == 8
  assert [d.id for m in plan.meshes for d in m.devices.flat] == list(range(8))
  assert plan.cut_costs(measure=False) is None  # hand-set cuts: measured only when asked
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.layer_cuts = (2,)


def test_setup_plans_once_and_the_program_reads_the_plan(monkeypatch):
  calls = {"plan": 0, "make_schedule": 0}

  def counted(name, fn):
    def wrapper(*args, **kwargs):
      calls[name] += 1
      return fn(*args, **kwargs)
    return wrapper

  monkeypatch.setattr(stages, "plan", counted("plan", stages.plan))
  monkeypatch.setattr(stages, "make_schedule", counted("make_schedule", stages.make_schedule))
  run = util.build_run("lm.TinyLmMpmd")
  program = program_lib.setup(run.task, run.datasets["train"].batch_at(0))
  assert calls == {"plan": 1, "make_schedule": 1}
  assert program.pipeline.schedule is program.plan.schedule
  assert program.config is program.plan.config and program.num_layers == 4


@pytest.mark.parametrize("overrides, match", [
    (["task.pipeline.num_microbatches=3"],
     r"datasets\['train'\].batch_size=16 does not split into task.pipeline.num_microbatches=3 "
     r"equal microbatches. Make the batch size a multiple of 12 \(e.g. --fdl_set=\"datasets"
     r"\['train'\].batch_size=24\"\)"),
    (["task.pipeline.layer_cuts=(4,)"], r"task.pipeline.layer_cuts=\(4,\).*beyond the last"),
    (["task.pipeline.layer_cuts='balanced'"], r"task.pipeline.layer_cuts='balanced'"),
    (["task.pipeline.layer_cuts='auto'", "task.pipeline.num_chunks=2"],
     r"task.pipeline.layer_cuts='auto' with task.pipeline.num_chunks=2"),
    (["task.pipeline.submesh_shapes=((2, 1, 2), (2, 1, 1))"],
     r"task.pipeline.submesh_shapes=.*the job has 8"),
    (["task.pipeline.schedule='zigzag'"], r"task.pipeline.schedule='zigzag'"),
    (["task.train.num_microbatches=2"], r"task.train.num_microbatches=2.*MPMD"),
    (["task.pipeline.num_microbatches=8"],
     r"batch_size=16 split into task.pipeline.num_microbatches=8 microbatches gives 2 rows each, "
     r"which do not divide over the data axes \('data', 'fsdp'\) of "
     r"task.pipeline.submesh_shapes\[1\]=\(4, 1, 1\) \(4 shards\)"),
])
def test_bad_plans_raise_naming_the_field(overrides, match):
  with pytest.raises(ConfigError, match=match):
    _plan(overrides)


def test_the_batch_need_only_split_over_the_stage_submeshes():
  """12 rows in 3 microbatches of 4 split over stage 0's 2 and stage 1's 4 data shards: a
  plan, although 12 does not divide over the all-device mesh's 8 (it only holds
  checkpoints)."""
  plan, _ = _plan(["datasets['train'].batch_size=12", "task.pipeline.num_microbatches=3"])
  assert (plan.batch_rows, plan.microbatch_size, dict(plan.mesh.shape)["data"]) == (12, 4, 8)
