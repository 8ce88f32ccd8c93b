"""The roofline of an MPMD step from its stage programs' costs (plan.stage_roofline): pure."""
import pytest

from spmdtask.plan import chips, stage_roofline
from spmdtask.plan.stage_roofline import ProgramCost

V5E = chips.CHIPS["v5e"]


def _costs() -> list[ProgramCost]:
  # Stage 0 (4 chips): XLA sees fewer FLOPs than stage 1's, but its Pallas kernels' traced
  # FLOPs make it the busier one. Stage 1 (2 chips) moves more HBM bytes.
  return [
      ProgramCost("stage 0 part 0 forward", 0, 4, 4, flops=3e12, kernel_flops=2e12,
                  hbm_bytes=1e9, ici_bytes=1e8),
      ProgramCost("stage 0 part 0 backward", 0, 4, 4, flops=6e12, kernel_flops=4e12,
                  hbm_bytes=2e9, ici_bytes=2e8,
                  collectives={"all-gather": {"count": 2, "bytes": 100}}),
      ProgramCost("stage 0 optimizer update", 0, 4, 1, flops=1e9, hbm_bytes=1e9,
                  collectives={"all-gather": {"count": 1, "bytes": 10}}),
      ProgramCost("stage 1 part 1 forward", 1, 2, 4, flops=2e12, hbm_bytes=4e9),
      ProgramCost("stage 1 part 1 backward", 1, 2, 4, flops=4e12, hbm_bytes=8e9),
  ]


def test_the_busiest_stage_bounds_the_step_with_its_kernels_counted():
  costs = _costs()
  sums = stage_roofline.stage_sums(costs, 2)
  assert sums[0]["flops"] == 4 * 3e12 + 4 * 6e12 + 1e9
  assert sums[0]["kernel_flops"] == 4 * 2e12 + 4 * 4e12
  assert sums[0]["collectives"] == {"all-gather": {"count": 9, "bytes": 410}}
  assert sums[1]["flops"] == 4 * 2e12 + 4 * 4e12 and sums[1]["devices"] == 2
  model, tokens, sent = 1.2e14, 65536.0, [4e9, 2e9]
  stages, est = stage_roofline.step_estimate(sums, sent, [0.2, 0.5], V5E, model, tokens, 6)
  busy0 = sums[0]["flops"] / V5E.peak_bf16_flops_per_s
  assert stages[0]["bound"] == "compute" and stages[0]["step_seconds_lower_bound"] == busy0
  assert stages[0]["seconds"]["transfers"] == 4e9 / 4 / V5E.ici_ingress_bytes_per_s
  busy1 = stages[1]["step_seconds_lower_bound"]
  assert busy1 < busy0  # without the kernels' FLOPs stage 1 would be the busier
  assert (sums[0]["flops"] - sums[0]["kernel_flops"]) / V5E.peak_bf16_flops_per_s < busy1
  # The step: stage 0's bound, ceilings over all 6 chips of the step.
  assert est["stage"] == 0 and est["bound"] == "compute"
  assert est["seconds"] == stages[0]["seconds"] and est["step_seconds_lower_bound"] == busy0
  assert est["mfu_upper_bound"] == pytest.approx(model / (busy0 * V5E.peak_bf16_flops_per_s * 6),
                                                 rel=1e-12)
  assert est["tokens_per_second_upper_bound"] == pytest.approx(tokens / busy0, rel=1e-12)
  # The bubble is an estimate beside the bound: the stage slowest with its own bubble.
  assert est["step_seconds_with_bubble_estimate"] == max(busy0 / 0.8, busy1 / 0.5)
  assert "bubble is not in this bound" in est["basis"]


def test_step_report_sums_every_program_and_fills_each_stage_row():
  costs = _costs()
  rows = [{"stage": 0, "transfer_bytes_per_step": 4e9, "bubble": 0.2},
          {"stage": 1, "transfer_bytes_per_step": 2e9, "bubble": 0.5}]
  out, got = stage_roofline.step_report(costs, rows, V5E, 1.2e14, 65536.0, 6)
  f = out["flops_per_step"]
  assert f["xla"] == sum(r["flops_per_step"] for r in got) == (
      4 * (4 * 3e12 + 4 * 6e12 + 1e9) + 2 * (4 * 2e12 + 4 * 4e12))
  assert f["kernels"] == 4 * (4 * 2e12 + 4 * 4e12) == got[0]["kernel_flops_per_step"]
  assert out["estimate"]["stage"] == 0 and out["hbm_bytes_per_step_per_device"] == 4 * 3e9 + 1e9
  assert got[0]["busy_seconds"] == out["estimate"]["step_seconds_lower_bound"]
  assert got[1]["busy_with_bubble_seconds"] == got[1]["busy_seconds"] / 0.5
  assert any("up to" in w and "Pallas kernels" in w for w in out["warnings"])
  # Without a chip: the sums, no estimate.
  out, got = stage_roofline.step_report(costs, rows, None, 1.2e14, 65536.0, 6)
  assert "estimate" not in out and "busy_seconds" not in got[0]
  assert out["flops_per_step"]["xla"] == f["xla"]
