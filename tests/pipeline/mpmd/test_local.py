"""Tests for spmdtask.pipeline.mpmd.local: a stage with data-parallel axes accumulates its
gradients per device and reduces them once per step, not once per microbatch: counted in
the compiled programs, with the gradients of jax.grad on one device (a toy with a tied
weight, 1F1B and ZB-H1's I/W split), and in lm.TinyLmMpmd's programs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from spmdtask.core import program as program_lib
from spmdtask.plan import hlo
from spmdtask.pipeline.mpmd import pipeline, local
from spmdtask.pipeline.schedules.generators import one_f_one_b, zb_h1
from tests import util
from tests.pipeline.mpmd.test_pipeline import B, M, microbatch_shapes, toy_batch, toy_loss, toy_params

REDUCTIONS = ("all-reduce", "reduce-scatter")


def reductions(compiled) -> int:
  """Reduction collectives the program runs (each op once per call; loops multiplied)."""
  return sum(c.runs for c in hlo.collective_ops(compiled.as_text()) if c.kind in REDUCTIONS)


def test_dp_axes_are_the_leading_row_axes_that_split_no_param():
  devs = np.asarray(jax.devices()).reshape(2, 2, 2)
  mesh = Mesh(devs, ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)
  rows = [P(("data", "fsdp")), P(("data", "fsdp"), None)]
  assert local.dp_axes(mesh, rows, [P(None, "model")]) == ("data", "fsdp")
  assert local.dp_axes(mesh, rows, [P("fsdp", "model")]) == ("data",)  # FSDP: not fsdp
  assert local.dp_axes(mesh, rows + [P("fsdp")], [P()]) == ()  # rows split otherwise
  assert local.dp_axes(mesh, [P(("fsdp", "data"))], [P()]) == ()  # not in mesh order
  one = Mesh(devs.reshape(1, 8, 1), ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)
  assert local.dp_axes(one, rows, [P("fsdp")]) == ()  # data has size 1


def sum_loss(cuts):
  """toy_loss as a sum over the microbatch's rows (what per-device accumulation needs)."""
  loss = toy_loss(cuts)
  return lambda p, batch: loss(p, batch) * batch["x"].shape[0]


@pytest.mark.parametrize("schedule", [one_f_one_b(2, M), zb_h1(2, M)], ids=["1f1b", "zb_h1"])
def test_one_reduction_per_step_with_the_one_device_grads(schedule):
  params, batch = toy_params(), toy_batch(0)
  devs = np.asarray(jax.devices())
  stages = [pipeline.StageSpec(Mesh(d.reshape(4, 1), ("data", "model"),
                                axis_types=(AxisType.Auto,) * 2), None,
                           {"x": P("data"), "y": P("data")}, P("data"))
            for d in (devs[:4], devs[4:])]
  loss = sum_loss({1})
  # Weights 1/B: the step's loss is the batch mean, as jax.grad of toy_loss sees it.
  w = jnp.full((M,), 1.0 / B, jnp.float32)
  want_loss, want = jax.value_and_grad(toy_loss({1}))(params, batch)
  counts = {}
  for per_device in (False, True):
    pl = pipeline.Pipeline(loss, params, microbatch_shapes(batch), stages, schedule,
                       rows_are_sums=per_device)
    assert pl.dp == ([("data",)] * 2 if per_device else [(), ()])
    placed = pl.place(params)
    got = pl.run(placed, batch, w)
    np.testing.assert_allclose(got.loss, want_loss, rtol=1e-5)
    util.assert_trees_close(pl.gather(got.grads), want, terms=B, rtol=2e-5)
    compiled = pl.compiled_backward(placed, batch)
    # Per step each part runs B (or I and W) M times and its stage's reduction once.
    runs = lambda c: (("input_grad", "weight_grad") if "input_grad" in c else ("bwd",))
    per_step = [M * sum(reductions(compiled[v][k]) for k in runs(compiled[v]))
                + (reductions(compiled["reduce", s]) if ("reduce", s) in compiled else 0)
                for v, s in enumerate(pl.part_stage)]
    counts[per_device] = per_step
  # GSPMD reduces the weight gradients in every backward (M a step); per device: once.
  assert all(n >= M for n in counts[False]), counts
  assert counts[True] == [1, 1], counts
  print("data-parallel reductions per step per stage, GSPMD vs per device:", counts)


def test_tinylm_mpmd_reduces_once_per_step():
  """(That lm.TinyLmMpmd, whose stages both accumulate per device, trains with the losses
  and params of one device: tests/pipeline/mpmd/test_program.py.)"""
  over = ("task.pipeline.submesh_shapes=((4,1,1),(4,1,1))",)  # data 4: every reduction is DP
  run = util.build_run("lm.TinyLmMpmd", over)
  example = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, example)
  pl, state = program.pipeline, program.init()
  assert pl.dp == [("data",), ("data",)]
  batch = program.train_batch(state, program.global_batch(example))
  compiled = pl.compiled_backward([st.params for st in state.stages], batch)
  assert [reductions(compiled[v]["bwd"]) for v in range(2)] == [0, 0]
  assert [reductions(compiled["reduce", s]) for s in range(2)] == [1, 1]
