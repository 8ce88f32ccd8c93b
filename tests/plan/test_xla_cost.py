"""plan.xla_cost: the FLOPs fused kernels state themselves, per step."""
from spmdtask.plan import xla_cost


STATED_HLO = """HloModule m

%body (p: (s32[], bf16[128,128])) -> (s32[], bf16[128,128]) {
  %g = bf16[128,128]{1,0} custom-call(bf16[128,128]{1,0} %x), """ \
  """custom_call_target="tpu_custom_call", frontend_attributes={"meta":"{\\"a\\": 1,
}"}, backend_config={"custom_call_config":{"cost_estimate":{"flops":"4194304","bytes":"1"}}}
  %s = bf16[128,128]{1,0} custom-call(bf16[128,128]{1,0} %g), """ \
  """custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{}}
}

%cond (p: (s32[], bf16[128,128])) -> pred[] {
  %c = pred[] constant(true)
}

ENTRY %main (a: bf16[128,128]) -> bf16[128,128] {
  %w = (s32[], bf16[128,128]) while(%t), condition=%cond, body=%body, """ \
  """backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_stated_kernel_flops_are_each_calls_cost_estimate_times_its_runs():
  """megablox's calls state their FLOPs (cost_estimate, here after a newline in another
  attribute, as MaxText's kernels print); a kernel stating none (splash) adds nothing."""
  assert xla_cost.stated_kernel_flops(STATED_HLO) == 3 * 4194304
