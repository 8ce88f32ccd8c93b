"""Stage balancing: contiguous cuts of per-layer costs into stages, minimising the slowest.

`balance(costs, num_stages)` is a dynamic program over suffixes (Alpa's stage-construction
objective with one device group per stage): best[i][k] is the smallest possible cost of the
slowest stage when layers i.. are split into k non-empty contiguous stages. Among the optimal
splits it returns the one with the lexicographically smallest cuts, i.e. every stage as short
as an optimal split allows, front first: early stages hold the most activation sets under
1F1B (p - s on stage s), so they get the fewest layers when it costs nothing.

`balance_table(table)` is the same program when a layer's cost depends on its stage
(`table[s][l]`: stages on submeshes of different sizes, `pipeline.auto_cuts` measures it);
`stage_loads` gives the stage costs of any cuts (hand-set, or several parts per stage).

Layer costs come from the model (`spmdtask.core.model.LayerCosts`); `stack_costs` folds the
embedding and head into the first and last layer, so the cuts are `layer_cuts` values.
"""
import dataclasses
import itertools
from typing import Sequence

from spmdtask.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Balance:
  """Stage s holds layers `layers(s)`: cuts[s-1] .. cuts[s] - 1, from 0 and up to num_layers."""
  cuts: tuple[int, ...]            # the p - 1 layer indices where a new stage starts
  stage_costs: tuple[float, ...]   # the summed layer costs of each stage
  num_layers: int

  def layers(self, stage: int) -> range:
    bounds = (0,) + self.cuts + (self.num_layers,)
    return range(bounds[stage], bounds[stage + 1])


def balance(costs: Sequence[float], num_stages: int) -> Balance:
  """The contiguous split of `costs` into `num_stages` non-empty stages with the smallest
  slowest stage (ties: lexicographically smallest cuts). ConfigError if it cannot be split."""
  if num_stages < 1:
    raise ConfigError(f"Cannot split {len(costs)} layer costs into {num_stages} stages: "
                      "give at least one stage.")
  return balance_table([list(costs)] * num_stages)


def balance_table(table: Sequence[Sequence[float]]) -> Balance:
  """`balance` when a layer's cost depends on the stage it lands on (stages on submeshes of
  different sizes): `table[s][l]` is layer l's cost on stage s, one row per stage. The same
  dynamic program and tie-break; a stage's cost is the sum of its layers' costs in its row."""
  p = len(table)
  n = len(table[0]) if p else 0
  if p < 1 or n < p:
    raise ConfigError(f"Cannot split {n} layer costs into {p} stages: every stage needs at "
                      "least one layer; give more layer costs or fewer stages.")
  if any(len(row) != n for row in table):
    raise ConfigError(f"Every stage needs one cost per layer: got rows of "
                      f"{[len(row) for row in table]} costs.")
  if any(not c >= 0 for row in table for c in row):  # also rejects NaN
    raise ConfigError(f"Layer costs must be numbers >= 0, got {[list(r) for r in table]}.")
  prefix = [[0.0] + list(itertools.accumulate(float(c) for c in row)) for row in table]
  seg = lambda s, i, j: prefix[s][j] - prefix[s][i]  # one formula everywhere: exact ties
  inf = float("inf")
  # best[k][i]: the slowest stage when layers i..n-1 form the last k stages p-k..p-1
  # (inf if fewer than k layers).
  best = [[inf] * (n + 1) for _ in range(p + 1)]
  best[0][n] = 0.0
  for k in range(1, p + 1):
    s = p - k
    for i in range(n - k, -1, -1):
      best[k][i] = min(max(seg(s, i, j), best[k - 1][j]) for j in range(i + 1, n - k + 2))
  target, cuts, start = best[p][0], [], 0
  for k in range(p, 1, -1):  # the earliest cut that still allows an optimal rest
    s = p - k
    start = next(j for j in range(start + 1, n - k + 2)
                 if seg(s, start, j) <= target and best[k - 1][j] <= target)
    cuts.append(start)
  bounds = [0] + cuts + [n]
  stage_costs = tuple(seg(s, bounds[s], bounds[s + 1]) for s in range(p))
  return Balance(tuple(cuts), stage_costs, n)


def stage_loads(table: Sequence[Sequence[float]], cuts: Sequence[int],
                part_stage: Sequence[int] | None = None) -> tuple[float, ...]:
  """Each stage's cost under `cuts` (parts of consecutive layers): the sum over the parts it
  runs (`part_stage[v]`; part v on stage v by default) of their layers' costs on that stage."""
  n = len(table[0])
  bounds = [0] + list(cuts) + [n]
  part_stage = range(len(bounds) - 1) if part_stage is None else part_stage
  loads = [0.0] * len(table)
  for v, s in enumerate(part_stage):
    loads[s] += sum(float(c) for c in table[s][bounds[v]:bounds[v + 1]])
  return tuple(loads)


def stack_costs(costs: Sequence[float]) -> list[float]:
  """[embedding, layer 0, ..., layer L-1, head] -> L layer costs, the embedding counted with
  layer 0 and the head with layer L-1: where an MPMD pipeline runs them, so that the cuts
  of `balance(stack_costs(costs), parts)` are `MpmdConfig.layer_cuts` values."""
  if len(costs) < 3:
    raise ConfigError(f"Layer costs {list(costs)} must be [embedding, layers..., head] with at "
                      "least one layer.")
  out = list(costs[1:-1])
  out[0] += costs[0]
  out[-1] += costs[-1]
  return out
