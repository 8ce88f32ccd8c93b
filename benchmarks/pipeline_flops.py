"""Compiled FLOPs of a pipelined train step (loss + grad) vs the unpipelined one.

Theory: a pipeline runs N = M*R + S - 1 iterations where each stage does the work of
Lps layers on one microbatch, so the whole pipeline does S*N*Lps layer-microbatch
units against M*R*S*Lps for the plain stack: ratio (M*R + S - 1) / (M*R).

Measurement: `compiled.cost_analysis()['flops']` of the SPMD-partitioned program is the
FLOPs of ONE device's program (shard_map over 'stage' with S devices: one stage's work),
so the pipelined total is S x that. The unpipelined step is compiled for 1 device.
Loops are unrolled (`PipelineConfig.unroll=True`, `scan(unroll=True)` for the plain
stack) because cost_analysis counts a loop body once. Remat is off on both sides
(remat would add one forward recompute to the pipelined step only). Gradients are taken
w.r.t. the weights AND the stack's input on both sides, as in an LM where the embedding
below the stack needs it: otherwise the plain stack skips layer 0's input-gradient
matmuls, which a pipeline stage cannot (its input is another stage's output), and the
comparison would measure that asymmetry (about +1-2.5% here) rather than the bubble.

Usage: python benchmarks/pipeline_flops.py
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from spmdtask.pipeline import spmd as pl  # noqa: E402

D, F, MB, L = 64, 256, 64, 8


def layer(p, h):
  return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def flops(fn, *args):
  cost = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"])


def sequential_flops(m):
  params = {"w1": jnp.zeros((L, D, F)), "w2": jnp.zeros((L, F, D))}
  x = jnp.zeros((m * MB, D))

  def loss(params, x):
    y = jax.lax.scan(lambda h, p: (layer(p, h), None), x, params, unroll=True)[0]
    return jnp.sum(y**2)

  return flops(loss, params, x)


def pipelined_flops(s, m, r):
  mesh = jax.make_mesh(
      (s,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:s]
  )
  cfg = pl.PipelineConfig(
      num_stages=s, num_microbatches=m, circular_repeat=r, remat_policy=None, unroll=True
  )
  params = {"w1": jnp.zeros((L, D, F)), "w2": jnp.zeros((L, F, D))}
  sp = jax.device_put(pl.to_stages(params, s, r), NamedSharding(mesh, P("stage")))
  x = jax.device_put(jnp.zeros((m * MB, D)), NamedSharding(mesh, P()))

  def loss(sp, x):
    return jnp.sum(pl.pipeline_apply(layer, sp, x, mesh=mesh, config=cfg) ** 2)

  return flops(loss, sp, x) * s  # cost_analysis reports one device's program


def main():
  print(
      f"layer: h + tanh(h@w1)@w2, d={D} f={F} microbatch={MB} layers={L}; "
      f"FLOPs of loss+grad, pipelined = per-device x S"
  )
  print(
      f"{'S':>2} {'M':>3} {'R':>2} {'seq GFLOP':>10} {'pipe GFLOP':>11} "
      f"{'measured':>9} {'theory':>8} {'dev %':>7}"
  )
  seq = {}
  worst = 0.0
  for s in (2, 4):
    for m in (4, 8, 16):
      for r in (1, 2):
        if m not in seq:
          seq[m] = sequential_flops(m)
        pipe = pipelined_flops(s, m, r)
        measured = pipe / seq[m]
        theory = (m * r + s - 1) / (m * r)
        dev = (measured - theory) / theory
        worst = max(worst, abs(dev))
        print(
            f"{s:>2} {m:>3} {r:>2} {seq[m] / 1e9:>10.4f} {pipe / 1e9:>11.4f} "
            f"{measured:>9.4f} {theory:>8.4f} {100 * dev:>+6.2f}%",
            flush=True,
        )
  print(f"worst relative deviation: {100 * worst:.2f}% (target < 2%)")


if __name__ == "__main__":
  main()
