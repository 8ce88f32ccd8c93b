"""benchmarks/pipeline_tpu_sim.py on a tiny LM and v5e:2x2 (XLA:TPU ahead of time; skipped
without libtpu): the MPMD per-part costs are the compiled programs' rooflines, and the
simulated steps are consistent with them; the SPMD pipeline's loop is counted per trip."""
import math

import pytest

pytest.importorskip("libtpu")

# pylint: disable=wrong-import-position
from spmdtask.plan import chips, targets
from spmdtask.pipeline.schedules import generators, simulate
from spmdtask.pipeline.mpmd import stage_costs
from spmdtask.pipeline.spmd import PipelineConfig
from benchmarks import pipeline_tpu_sim as tool

S, M, BATCH, SEQ, D = 2, 4, 8, 32, 64
FLAGS = ["--topology=v5e:2x2", f"--stages={S}", f"--microbatches={M}", "--layers=2",
         f"--d_model={D}", "--d_ff=128", "--heads=2", f"--seq={SEQ}", "--vocab=128",
         f"--batch={BATCH}"]


@pytest.fixture(scope="session")
def compiled():
  args = tool._flags(FLAGS)
  target = targets.tpu(args.topology)
  pl, times, updates = tool.mpmd_pipeline(
      args, 4, target, (1,), "zb_h1", 1,
      {"forward", "backward", "input_grad", "weight_grad", "update"})
  return args, target, pl, times, updates


def test_costs_are_the_compiled_rooflines(compiled):
  _, target, pl, times, _ = compiled
  assert len(times) == S * 4 + S  # F, B, I, W per part; an update per stage
  for name, t in times.items():
    assert t["seconds"] == max(t["terms"].values()) and t["seconds"] >= 0
    assert math.isclose(t["terms"]["compute"],
                        t["flops_per_device"] / target.chip.peak_bf16_flops_per_s)
  split = stage_costs.part_costs(pl, times, target.chip, True)
  whole = stage_costs.part_costs(pl, times, target.chip, False)
  for part, c, u in zip(pl.parts, split, whole):
    t = lambda k: times[f"stage {part.stage} part {part.index} {k}"]["seconds"] / 1e-6
    assert (c.forward, c.backward, c.weight) == (t("forward"), t("input_grad"),
                                                 t("weight_grad"))
    assert (u.forward, u.backward, u.weight) == (t("forward"), t("backward"), 0.0)
  # A hop: one microbatch's [BATCH/M, SEQ, D] bf16 activation and the [BATCH/M, SEQ]
  # int32 value that crosses beside it, over the 2 data shards of a stage, over the v5e's
  # ICI ingress (half its 400 GB/s both ways).
  assert [(pl.values[i].aval.shape, pl.values[i].aval.dtype.name)
          for i in pl.parts[1].float_in + pl.parts[1].int_in] == [
              ((BATCH // M, SEQ, D), "bfloat16"), ((BATCH // M, SEQ), "int32")]
  hop = ((BATCH // M) * SEQ * (D * 2 + 4) / 2
         / (chips.CHIPS["v5e"].ici_bidirectional_bytes_per_s / 2))
  assert split[1].latency == pytest.approx(hop / 1e-6)


def test_simulated_steps_are_consistent(compiled):
  _, target, pl, times, updates = compiled
  costs = stage_costs.part_costs(pl, times, target.chip, True)
  got = stage_costs.step(pl.schedule, costs, updates)
  sim = got["simulation"]
  for s in range(S):
    c = costs[s]
    assert sim.busy[s] == sum(simulate.durations(c, 1)[k] for k in "FIW") * M
    assert got["bubbles"][s] == pytest.approx(1 - got["busy"][s] / got["makespan"])
  assert got["makespan"] >= max(got["busy"])  # the slowest stage's work, at least
  ends = [float(row[-1].end) for row in sim.timeline]
  assert got["step"] == max(e + u for e, u in zip(ends, updates)) >= got["makespan"]
  # Same per-part costs: GPipe's step is at least 1F1B's (both unsplit).
  whole = stage_costs.part_costs(pl, times, target.chip, False)
  gpipe = simulate.simulate(generators.gpipe(S, M), whole)
  one_f_one_b = simulate.simulate(generators.one_f_one_b(S, M), whole)
  assert gpipe.makespan >= one_f_one_b.makespan
  assert gpipe.busy == one_f_one_b.busy


def test_spmd_pipeline_loop_counted_per_trip(compiled):
  args, target, _, _, _ = compiled
  cfg = tool.fdl.Config(PipelineConfig, num_stages=S, num_microbatches=M, remat_policy=None)
  got = tool.whole_step(tool.build(args, 4, cfg, (("stage", "data", "fsdp", "model"),
                                                   (S, 2, 1, 1))), target)
  assert M + S - 1 in got["loop_trips"]  # the pipeline loop, bubble iterations included
  assert got["step_ms"] == max(got["terms_ms"].values())
  assert got["flops_xla"] >= got["flops_model"]  # the bubble iterations' work is counted
