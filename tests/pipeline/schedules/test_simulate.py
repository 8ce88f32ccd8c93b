"""The simulator reproduces the published bubble and memory formulas (F = B = W = 1)."""
from fractions import Fraction as Fr

import pytest

from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import generators, generators_v
from spmdtask.pipeline.schedules import simulate as sim_lib
from spmdtask.pipeline.schedules.schedule import Action, Schedule

PM = [(4, 8), (2, 4), (3, 6), (4, 4), (8, 16), (4, 12)]


@pytest.mark.parametrize("p,m", PM)
def test_gpipe(p, m):
  r = sim_lib.simulate(generators.gpipe(p, m))
  assert r.makespan == 3 * (m + p - 1)  # F = 1, unsplit B = B + W = 2
  assert r.bubble_fractions == (Fr(p - 1, m + p - 1),) * p
  assert r.peak_activations == (m,) * p


@pytest.mark.parametrize("p,m", PM)
def test_one_f_one_b(p, m):
  r = sim_lib.simulate(generators.one_f_one_b(p, m))
  assert r.bubble_fraction == Fr(p - 1, m + p - 1)
  assert r.peak_activations == tuple(p - s for s in range(p))


@pytest.mark.parametrize("p,m", PM)
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved(p, m, v):
  r = sim_lib.simulate(generators.interleaved_1f1b(p, m, v))
  assert r.makespan == 3 * m + Fr(3 * (p - 1), v)
  assert r.bubble_fraction == Fr(p - 1, v * m + p - 1)
  # Megatron-LM's memory: stage s holds 2(p-1-s) + (v-1)p + 1 chunks of 1/v at the peak
  # (all m·v when the warm-up covers every forward); p + (p-1)/v on stage 0.
  assert r.peak_activations == tuple(Fr(min(2 * (p - 1 - s) + (v - 1) * p + 1, m * v), v)
                                     for s in range(p))
  if m > p:
    assert r.peak_activations[0] == p + Fr(p - 1, v)


@pytest.mark.parametrize("p,m", PM)
def test_zb_h1(p, m):
  r = sim_lib.simulate(generators.zb_h1(p, m))
  assert r.makespan == 3 * m + p - 1
  assert r.bubble_fractions == (Fr(p - 1, 3 * m + p - 1),) * p
  assert r.peak_activations[0] == p  # the same as 1F1B, released at I
  assert r.peak_activations == tuple(p - s for s in range(p))
  assert r.peak_weight_grad_stash == tuple(s + 1 for s in range(p))


def test_unsplit_backward_costs_b_plus_w():
  s = generators.one_f_one_b(4, 8)
  a = sim_lib.simulate(s, sim_lib.Costs(forward=1, backward=2, weight=0))
  b = sim_lib.simulate(s, sim_lib.Costs(forward=1, backward=1, weight=1))
  assert a == b
  split = sim_lib.simulate(generators.zb_h1(4, 8), sim_lib.Costs(forward=1, backward=2, weight=0))
  assert split.timeline[0][4].action == Action("I", 0) and split.timeline[0][4].end \
      - split.timeline[0][4].start == 2


def test_latency_adds_to_every_hop():
  p, m, d = 4, 8, Fr(1, 4)
  r = sim_lib.simulate(generators.gpipe(p, m), sim_lib.Costs(latency=0.25))
  # Forward and backward wavefronts each cross p - 1 links.
  assert r.makespan == 3 * (m + p - 1) + 2 * (p - 1) * d
  assert r.busy == (3 * m,) * p


def test_timeline_follows_each_stage_list_and_dependencies():
  s = generators.interleaved_1f1b(4, 8, 2)
  r = sim_lib.simulate(s, sim_lib.Costs(forward=1, backward=2, weight=1, latency=0.5))
  for stage, row in enumerate(r.timeline):
    assert [t.action for t in row] == list(s.actions[stage])
    assert all(a.end <= b.start for a, b in zip(row, row[1:]))
  end = {(t.stage, t.action): t.end for row in r.timeline for t in row}
  start = {(t.stage, t.action): t.start for row in r.timeline for t in row}
  # F of virtual stage 4 (stage 0, chunk 1) starts after F of virtual stage 3 plus the latency.
  assert start[0, Action("F", 0, 1)] >= end[3, Action("F", 0, 0)] + Fr(1, 2)


def test_chart():
  r = sim_lib.simulate(generators.one_f_one_b(2, 2), sim_lib.Costs(weight=0))
  assert sim_lib.chart(r) == ("time unit 1 (one cell = 3 characters); '.' idle\n"
                              "stage0: F0 F1 ...B0 ...B1\n"
                              "stage1: ...F0 B0 F1 B1 ...")


def test_bad_costs_and_schedules_are_config_errors():
  with pytest.raises(ConfigError, match="forward=-1"):
    sim_lib.simulate(generators.gpipe(2, 2), sim_lib.Costs(forward=-1))
  with pytest.raises(ConfigError, match="stage 0, action B1: runs before F1"):
    sim_lib.simulate(Schedule(1, 2, ((Action("F", 0), Action("B", 1), Action("F", 1),
                                      Action("B", 0)),)))


SCHEDULES = [generators.gpipe(4, 8), generators.one_f_one_b(4, 8), generators.zb_h1(4, 8),
             generators.interleaved_1f1b(4, 8, 2), generators_v.zb_v(4, 8)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"v{s.num_chunks}")
def test_equal_per_stage_costs_give_the_shared_result(schedule):
  c = sim_lib.Costs(forward=1, backward=1.5, weight=0.75, latency=0.25)
  shared = sim_lib.simulate(schedule, c)
  assert sim_lib.simulate(schedule, [c] * schedule.num_stages) == shared
  # One per part, each a 1/v share of its stage's cost.
  v = schedule.num_chunks
  part = sim_lib.Costs(forward=1 / v, backward=1.5 / v, weight=0.75 / v, latency=0.25)
  assert sim_lib.simulate(schedule, [part] * schedule.num_stages * v) == shared


def test_a_slow_stage_by_hand():
  """1F1B, 2 stages, 2 microbatches; stage 1 twice as slow; a hop into stage 0 takes 1/4,
  into stage 1 takes 1/2. Stage 1: F0 [3/2, 7/2], B0 [7/2, 15/2], F1 [15/2, 19/2] (its input
  arrived at 5/2), B1 [19/2, 27/2]; stage 0: F0 [0, 1], F1 [1, 2], B0 [31/4, 39/4],
  B1 [55/4, 63/4]."""
  costs = [sim_lib.Costs(forward=1, backward=2, weight=0, latency=0.25),
           sim_lib.Costs(forward=2, backward=3, weight=1, latency=0.5)]
  r = sim_lib.simulate(generators.one_f_one_b(2, 2), costs)
  assert r.makespan == Fr(63, 4)
  assert r.busy == (6, 12)
  assert r.bubble_fractions == (1 - Fr(6) / Fr(63, 4), 1 - Fr(12) / Fr(63, 4))
  assert [(t.start, t.end) for t in r.timeline[1]] == [
      (Fr(3, 2), Fr(7, 2)), (Fr(7, 2), Fr(15, 2)), (Fr(15, 2), Fr(19, 2)), (Fr(19, 2), Fr(27, 2))]
  assert [(t.start, t.end) for t in r.timeline[0]] == [
      (0, 1), (1, 2), (Fr(31, 4), Fr(39, 4)), (Fr(55, 4), Fr(63, 4))]


def test_per_part_costs_on_a_v_schedule():
  """zb_v, 2 stages x 2 chunks: part 3 (stage 0's chunk 1, with the head) costs 3x the
  others; each of its actions lasts its own part's cost, no 1/v."""
  s = generators_v.zb_v(2, 4)
  half = sim_lib.Costs(forward=0.5, backward=0.5, weight=0.5)
  slow = sim_lib.Costs(forward=1.5, backward=1.5, weight=1.5)
  base = sim_lib.simulate(s, [half] * 4)
  r = sim_lib.simulate(s, [half, half, half, slow])
  for row in r.timeline:
    for t in row:
      part = s.virtual_stage(t.stage, t.action.chunk)
      assert t.end - t.start == (Fr(3, 2) if part == 3 else Fr(1, 2))
  assert r.busy == (base.busy[0] + 4 * 3 * 1, base.busy[1])  # 4 microbatches x F, I, W x 1
  assert r.makespan > base.makespan and r.makespan >= max(r.busy)


def test_wrong_number_of_costs_is_a_config_error():
  with pytest.raises(ConfigError, match="3 pipeline Costs.*4 stages x 1 chunks"):
    sim_lib.simulate(generators.gpipe(4, 4), [sim_lib.Costs()] * 3)
