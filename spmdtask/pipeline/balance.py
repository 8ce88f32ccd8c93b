"""Stage balancing: contiguous cuts of per-layer costs into stages, minimising the slowest.

`balance(costs, num_stages)` is a dynamic program over suffixes (Alpa's stage-construction
objective with one device group per stage): best[i][k] is the smallest possible cost of the
slowest stage when layers i.. are split into k non-empty contiguous stages. Among the optimal
splits it returns the one with the lexicographically smallest cuts, i.e. every stage as short
as an optimal split allows, front first: early stages hold the most activation sets under
1F1B (p - s on stage s), so they get the fewest layers when it costs nothing.

`lm_layer_costs` measures per-layer costs of the LM itself (the only function here that
imports jax).
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


def lm_layer_costs(model, batch_size: int, seq_len: int) -> list[float]:
  """Train-step FLOPs of [embedding, block x num_layers, head with the loss] of a TransformerLm.

  Compiled (`cost_analysis`) FLOPs of forward + backward on one batch of shape
  [batch_size, seq_len]: the embedding lookup's vjp; one `Block`'s vjp (grads of its weights
  and of its input); the head (final norm, unembedding, cross entropy) as the one-block
  model's loss-and-grad minus those two, so that it follows the model's own head code.
  Remat and pipelining are turned off: they do not change what a layer costs to train.
  """
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  from spmdtask.layers.block import Block
  num_layers = model.num_layers
  model = dataclasses.replace(model, num_layers=1, remat_policy=None, execution=None,
                              dropout_rate=0.0)
  dt = jnp.dtype(model.fprop_dtype)
  tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
  x = jax.ShapeDtypeStruct((batch_size, seq_len, model.d_model), dt)
  positions = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)

  def flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))

  def vjp(fn, *args, cotangent):
    out, pullback = jax.vjp(fn, *args)
    return out, pullback(cotangent)

  emb = jax.ShapeDtypeStruct((model.vocab_size, model.d_model), jnp.float32)
  embed = flops(lambda e, t, ct: vjp(lambda e: jnp.take(e, t, axis=0).astype(dt), e,
                                     cotangent=ct), emb, tokens, x)
  block = Block(**model.block_kwargs())
  block_params = jax.eval_shape(block.init, jax.random.key(0), x, positions)["params"]
  layer = flops(lambda p, h, pos: vjp(lambda p, h: block.apply({"params": p}, h, pos)[0], p, h,
                                      cotangent=h), block_params, x, positions)
  params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
  batch = {"inputs": tokens, "targets": tokens,
           "weights": jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)}
  whole = flops(jax.value_and_grad(
      lambda p, b: model.apply({"params": p}, b, method=model.loss)[0]), params, batch)
  return [embed] + [layer] * num_layers + [whole - embed - layer]
