"""Stage balancing: contiguous cuts of per-layer costs into stages, minimising the slowest.

`balance(costs, num_stages)` is a dynamic program over suffixes (Alpa's stage-construction
objective with one device group per stage): best[i][k] is the smallest possible cost of the
slowest stage when layers i.. are split into k non-empty contiguous stages. Among the optimal
splits it returns the one with the lexicographically smallest cuts, i.e. every stage as short
as an optimal split allows, front first: early stages hold the most activation sets under
1F1B (p - s on stage s), so they get the fewest layers when it costs nothing.

Layer costs come from the model (`spmdtask.model.LayerCosts`); `stack_costs` folds the
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
  n, p = len(costs), num_stages
  if p < 1 or n < p:
    raise ConfigError(f"Cannot split {n} layer costs into {p} stages: every stage needs at "
                      "least one layer; give more layer costs or fewer stages.")
  if any(not c >= 0 for c in costs):  # also rejects NaN
    raise ConfigError(f"Layer costs must be numbers >= 0, got {list(costs)}.")
  prefix = [0.0] + list(itertools.accumulate(float(c) for c in costs))
  seg = lambda i, j: prefix[j] - prefix[i]  # one formula for every comparison: exact ties
  inf = float("inf")
  # best[k][i]: the slowest stage when layers i..n-1 form k stages (inf if fewer than k layers).
  best = [[inf] * (n + 1) for _ in range(p + 1)]
  best[0][n] = 0.0
  for k in range(1, p + 1):
    for i in range(n - k, -1, -1):
      best[k][i] = min(max(seg(i, j), best[k - 1][j]) for j in range(i + 1, n - k + 2))
  target, cuts, start = best[p][0], [], 0
  for k in range(p, 1, -1):  # the earliest cut that still allows an optimal rest
    start = next(j for j in range(start + 1, n - k + 2)
                 if seg(start, j) <= target and best[k - 1][j] <= target)
    cuts.append(start)
  bounds = [0] + cuts + [n]
  stage_costs = tuple(seg(bounds[s], bounds[s + 1]) for s in range(p))
  return Balance(tuple(cuts), stage_costs, n)


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
