"""Balanced stage cuts equal brute force (also with a per-stage cost table); layer costs of
the LM follow its FLOPs."""
import dataclasses
import itertools
import random

import fiddle as fdl
import pytest

from configs import lm
from spmdtask.errors import ConfigError
from spmdtask.pipeline.schedules import balance as bl


def brute_force(costs, p):
  """min over all contiguous splits of (slowest stage, cuts): the documented tie-break."""
  n = len(costs)
  return min((max(sum(costs[a:b]) for a, b in zip((0,) + c, c + (n,))), c)
             for c in itertools.combinations(range(1, n), p - 1))


def test_equals_brute_force_on_random_costs():
  rng = random.Random(0)
  for _ in range(300):
    n = rng.randint(1, 10)
    p = rng.randint(1, n)
    costs = [rng.randint(0, 9) for _ in range(n)]
    got = bl.balance(costs, p)
    slowest, cuts = brute_force(costs, p)
    assert (max(got.stage_costs), got.cuts) == (slowest, cuts), (costs, p)
    assert [sum(costs[i] for i in got.layers(s)) for s in range(p)] == list(got.stage_costs)


def brute_force_table(table):
  """min over all contiguous splits of (slowest stage, cuts), stage s costed by table[s]."""
  p, n = len(table), len(table[0])
  return min((max(sum(table[s][a:b]) for s, (a, b) in enumerate(zip((0,) + c, c + (n,)))), c)
             for c in itertools.combinations(range(1, n), p - 1))


def test_table_equals_brute_force_on_random_costs():
  rng = random.Random(2)
  for _ in range(300):
    n = rng.randint(1, 9)
    p = rng.randint(1, n)
    table = [[rng.randint(0, 9) for _ in range(n)] for _ in range(p)]
    got = bl.balance_table(table)
    slowest, cuts = brute_force_table(table)
    assert (max(got.stage_costs), got.cuts) == (slowest, cuts), (table, p)
    assert bl.stage_loads(table, got.cuts) == got.stage_costs


def test_table_gives_the_faster_stage_more_layers():
  # 8 equal layers; stage 1 runs each 3x faster (3x the devices); the embedding rides on
  # layer 0 and the head on layer 7.
  layer = 6.0
  table = [[layer / 2] * 8, [layer / 6] * 8]
  table[0][0] += 0.1
  table[1][-1] += 0.5
  got = bl.balance_table(table)
  assert got.cuts == (2,) and got.stage_costs == pytest.approx((6.1, 6.5))
  # Several parts per stage: part v on stage owner[v]; loads add over a stage's parts.
  assert bl.stage_loads(table, (1, 4, 6), (0, 1, 1, 0)) == pytest.approx(
      (3.1 + 2 * 3.0, 3 * 1.0 + 2 * 1.0))


def test_float_costs_match_brute_force_value():
  rng = random.Random(1)
  for _ in range(100):
    n = rng.randint(2, 9)
    p = rng.randint(1, n)
    costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
    assert max(bl.balance(costs, p).stage_costs) == pytest.approx(brute_force(costs, p)[0])


def test_ties_give_early_stages_fewer_layers():
  assert bl.balance([1, 1, 1, 1], 2).cuts == (2,)
  assert bl.balance([1, 1, 1, 1, 1], 2).cuts == (2,)  # 2 + 3, not 3 + 2
  b = bl.balance([1, 4, 4, 4, 4, 4, 4, 9], 4)
  assert (b.cuts, b.stage_costs) == ((3, 5, 7), (9.0, 8.0, 8.0, 9.0))


@pytest.mark.parametrize("costs,p,match", [([1, 2], 3, "2 layer costs into 3 stages"),
                                           ([1, 2], 0, "2 layer costs into 0 stages"),
                                           ([1, -2, 3], 2, ">= 0"),
                                           ([1, float("nan")], 1, ">= 0")])
def test_errors(costs, p, match):
  with pytest.raises(ConfigError, match=match):
    bl.balance(costs, p)


def test_lm_layer_costs_follow_the_model():
  model = fdl.build(lm.tiny_model())
  b, t = 4, 64
  costs = model.layer_costs(b, t)
  assert len(costs) == model.num_layers + 2 and len(set(costs[1:-1])) == 1
  embed, block, head = costs[0], costs[1], costs[-1]
  d, tokens = model.d_model, b * t
  block_params = (d * (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
                  + model.num_heads * model.head_dim * d + 3 * d * model.d_ff)
  # Train FLOPs of a layer: 6 per weight per token plus attention's 12·d·T per token.
  assert block == pytest.approx(6 * block_params * tokens + 12 * d * t * tokens, rel=0.05)
  assert head == pytest.approx(6 * d * model.vocab_size * tokens, rel=0.05)
  assert 0 <= embed < 0.01 * block
  # A 16x larger vocabulary makes the head 16x dearer: the balancer gives it fewer blocks.
  big = dataclasses.replace(model, vocab_size=16 * model.vocab_size).layer_costs(b, t)
  assert big[:-1] == costs[:-1] and big[-1] == pytest.approx(16 * head, rel=0.05)
  assert bl.balance(costs, 2).cuts == (3,) and bl.balance(big, 2).cuts == (4,)
  # As layer_cuts (embedding with layer 0, head with the last layer).
  assert len(bl.stack_costs(costs)) == model.num_layers
  assert bl.balance(bl.stack_costs(costs), 2).cuts == (2,)


def test_moe_layer_costs_tell_the_dense_layers_from_the_moe_ones():
  """A Mixture of Experts with its first layer dense: that layer costs what a dense block
  does (as above), the MoE layers another (the same each)."""
  from spmdtask.layers.moe import MoeConfig  # pylint: disable=import-outside-toplevel
  b, t = 2, 32
  model = dataclasses.replace(fdl.build(lm.tiny_model()), moe=MoeConfig(
      num_experts=4, top_k=2, d_ff=64, first_moe_layer=1))
  costs = model.layer_costs(b, t)
  assert len(costs) == model.num_layers + 2
  d, tokens = model.d_model, b * t
  block_params = (d * (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
                  + model.num_heads * model.head_dim * d + 3 * d * model.d_ff)
  assert costs[1] == pytest.approx(6 * block_params * tokens + 12 * d * t * tokens, rel=0.05)
  assert len(set(costs[2:-1])) == 1 and costs[2] != costs[1]
  assert 0 < costs[-1] < costs[1]
