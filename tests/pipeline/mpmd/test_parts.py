"""mpmd.parts' pure planning: which part runs its forward and backward as one program."""
import pytest

from spmdtask.pipeline.schedules import generators, generators_v
from spmdtask.pipeline.mpmd.parts import fused_part


@pytest.mark.parametrize("schedule, fused", [
    (generators.gpipe(2, 4), None),  # F0..F3 then B3..B0: only F3 B3 are adjacent
    (generators.one_f_one_b(4, 8), 3),
    (generators.zb_h1(4, 8), 3),  # F then I on the last stage
    (generators.interleaved_1f1b(2, 4, 2), 3),
    (generators_v.zb_v(2, 4), 3),  # the last part is chunk 1 of stage 0
    (generators_v.dualpipe_v(2, 4), None),
])
def test_fused_part_is_the_last_part_where_its_backward_always_follows_its_forward(
    schedule, fused):
  assert fused_part(schedule) == fused
