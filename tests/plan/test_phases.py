"""plan.phases: a program with a data-dependent loop read as what runs once plus one trip,
each charged at a chip's rates; the RL step's sum; the console lines; a phase the compiler
refuses."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask.core import layouts
from spmdtask.errors import PlanExceeded
from spmdtask.plan import chips, hlo, oom, phases, planner, printout

M, K = 64, 256  # a [64, 256] @ [256, 256] matmul: 2·M·K·K FLOPs


@pytest.fixture(scope="module")
def loop_program():
  """The optimized HLO of a program over 2 devices (rows split): the weight gathered and one
  matmul, then a loop of unknown trips, each a matmul and an all-reduce of its rows."""
  mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])

  def shard(x, w, n):
    full = jax.lax.all_gather(w, "d", tiled=True)

    def trip(c):
      i, y = c
      return i + 1, jnp.tanh(y @ full) + jax.lax.psum(y, "d")
    return jax.lax.while_loop(lambda c: c[0] < n, trip, (0, x @ full))[1]

  program = jax.shard_map(shard, mesh=mesh, in_specs=(P("d"), P("d"), P()), out_specs=P("d"))
  split = NamedSharding(mesh, P("d"))
  args = (jax.ShapeDtypeStruct((2 * M, K), jnp.float32, sharding=split),
          jax.ShapeDtypeStruct((K, K), jnp.float32, sharding=split),
          jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())))
  return jax.jit(program).lower(*args).compile().as_text()


def test_a_data_dependent_loop_splits_into_once_and_one_trip(loop_program):
  assert [l.trips for l in hlo.loops(loop_program)] == [None]
  once, trip = phases.loop_split(loop_program)
  matmul = 2.0 * M * K * K  # per device: its M rows
  # XLA counts the matmul and the elementwise ops (the add, the counter) per run
  assert matmul <= trip["flops"] <= matmul * 1.01
  assert matmul <= once["flops"] <= matmul * 1.01
  # once: the other device's half of w; a trip: the all-reduce of M x K f32 (ring, 2 devices)
  assert once["ici_bytes"] == K // 2 * K * 4
  assert trip["ici_bytes"] == M * K * 4
  # a trip reads at least w and its rows and writes its rows
  assert trip["hbm_bytes"] >= (K * K + 2 * M * K) * 4


def test_the_phase_time_is_once_plus_its_trips(loop_program):
  chip = chips.CHIPS["v5e"]
  weights, cache = 1e6, 3e6  # the bytes the loop says it must read
  est = phases.estimate(chip, loop_program, 1, layouts.Loop(1000, "every trip", weights, cache))
  once, trip = phases.loop_split(loop_program)
  assert est["once"]["cost"] == {**once, "hbm_bytes": weights}
  assert est["trip"]["cost"] == {**trip, "hbm_bytes": weights + cache}
  assert est["trip"]["xla_hbm_bytes"] == trip["hbm_bytes"]
  secs = est["trip"]["seconds"]
  assert secs["compute"] == pytest.approx(trip["flops"] / chip.peak_bf16_flops_per_s)
  assert secs["hbm"] == pytest.approx((weights + cache) / chip.hbm_bytes_per_s)
  assert secs["ici"] == pytest.approx(trip["ici_bytes"] / chip.ici_ingress_bytes_per_s)
  assert est["trip"]["seconds_lower_bound"] == max(secs.values()) == secs["hbm"]
  assert est["seconds_lower_bound"] == pytest.approx(
      est["once"]["seconds_lower_bound"] + 1000 * est["trip"]["seconds_lower_bound"])
  xla_trip = max(trip["flops"] / chip.peak_bf16_flops_per_s,
                 trip["hbm_bytes"] / chip.hbm_bytes_per_s,
                 trip["ici_bytes"] / chip.ici_ingress_bytes_per_s)
  assert est["trip"]["xla_bound_seconds"] == pytest.approx(xla_trip)
  assert est["unknown_loops"] == 1
  whole = phases.estimate(chip, loop_program, 1)  # no trips given: the loop once
  assert whole["cost"]["flops"] == pytest.approx(once["flops"] + trip["flops"])


def test_the_rl_step_sums_each_phase_per_optimizer_step():
  train = {"name": "training", "calls_per_step": 1,
           "compiled": {"peak_estimate_bytes": 3 << 30, "temp_size_in_bytes": 1 << 30},
           "estimate": {"seconds_lower_bound": 2.0, "bound": "hbm"}}
  bound = {"cost": {}, "seconds": {"compute": 0.01, "hbm": 0.02}, "bound": "hbm",
           "seconds_lower_bound": 0.02, "notes": []}
  xla = {**bound, "xla_hbm_bytes": 40 << 30, "xla_bound_seconds": 0.5}
  sampling = {"name": "sampling", "calls_per_step": 0.5,
              "compiled": {"peak_estimate_bytes": 4 << 30, "temp_size_in_bytes": 2 << 30},
              "estimate": {"once": xla, "trip": xla, "loop_trips": 511,
                           "loop_note": "the worst case", "unknown_loops": 1,
                           "weights_bytes": 1 << 30, "cache_bytes": 1 << 29,
                           "prefill_bytes": 8 << 30,
                           "seconds_lower_bound": 0.02 * 512,
                           "seconds_with_xla_hbm_bytes": 0.5 * 512}}
  plan = {"phases": [train, sampling]}
  plan["rl_step"] = phases.rl_step(plan["phases"])
  assert plan["rl_step"]["parts"] == {"training": 2.0, "sampling": 0.5 * 0.02 * 512}
  assert plan["rl_step"]["seconds_lower_bound"] == pytest.approx(2.0 + 5.12)
  lines = printout.phase_lines(plan)
  assert lines[2] == "phase sampling (once every 2 steps): peak estimate 4.0 GiB per device " \
                     "(temporaries 2.0 GiB)"
  assert "511 decode iterations x 20 ms (bound by hbm" in lines[3]
  assert lines[4].startswith("  HBM bytes per chip: the prefill reads the weights, 8.0 GiB; "
                             "an iteration 1.0 GiB of them and the whole KV cache it may read, "
                             "512.0 MiB")
  assert lines[4].endswith("with its count, 256 s")
  assert lines[-1].startswith("RL step (one optimizer step) >= 7.12 s = training 2 s + "
                              "sampling 5.12 s")
  assert phases.rl_step([train, {k: v for k, v in sampling.items() if k != "estimate"}]) is None


def test_a_phase_the_compiler_refuses_is_named_and_does_not_fit(loop_program):
  """A phase XLA refuses (out of memory) is kept in the plan with the compiler's first line;
  the plan then does not fit, naming that phase; the other phases are still compiled."""
  mesh = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
  low = lambda name: layouts.Lowering(name, None, mesh, lambda: None)

  def compile_fn(lw):
    if lw.name == "scoring":
      raise planner.CompilerOutOfMemory("RESOURCE_EXHAUSTED: 20.1G of 15.75G hbm\nmore")
    return jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
  train = {"peak_estimate_bytes": 1 << 20, "temp_size_in_bytes": 0}
  got = phases.report([low("sampling"), low("scoring")], train, None, None, 1, compile_fn,
                      planner.compiled_memory, planner.CompilerOutOfMemory)
  assert [p["name"] for p in got] == ["training", "sampling", "scoring"]
  assert got[1]["compiled"]["peak_estimate_bytes"] > 0
  assert got[2] == {"name": "scoring", "calls_per_step": 1,
                    "compiler_out_of_memory": "RESOURCE_EXHAUSTED: 20.1G of 15.75G hbm"}
  assert phases.rl_step(got) is None
  assert printout.phase_lines({"phases": got})[-1] == (
      "phase scoring (x1 a step): XLA refused it, out of memory: RESOURCE_EXHAUSTED: 20.1G of "
      "15.75G hbm")
  plan = {"phases": got, "compiled": {"peak_estimate_bytes": 1 << 20}}
  with pytest.raises(PlanExceeded, match=r"the scoring program does not fit: XLA refused to "
                                         r"compile it \(RESOURCE_EXHAUSTED"):
    oom.check_fits(plan, 1 << 30)
