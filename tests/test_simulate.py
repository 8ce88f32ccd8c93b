"""The simulator reproduces the published bubble and memory formulas (F = B = W = 1)."""
from fractions import Fraction as Fr

import pytest

from spmdtask.errors import ConfigError
from spmdtask.pipeline import generators
from spmdtask.pipeline import simulate as sim_lib
from spmdtask.pipeline.schedule import Action, Schedule

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
