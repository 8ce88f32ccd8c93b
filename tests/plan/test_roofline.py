"""plan.roofline: bytes a device receives, per kind of collective. Pure."""
from spmdtask.plan import hlo, roofline

MIB = 2**20


def test_a_gather_over_two_axes_in_turn_receives_what_one_gather_over_both_does():
  """A 112 MiB weight split 16 x 16: gathered over fsdp_b (result 7 MiB) then over fsdp
  (112 MiB) its results count 119 MiB, yet a device receives 15/16 of 7 MiB plus 15/16 of
  112 MiB = 255/256 of 112 MiB, as from one gather over all 256; a reduce-scatter receives
  the others' partial sums of its shard, an all-reduce twice an all-gather's, across slices
  a kind of its own."""
  two = [hlo.Collective("all-gather", 7 * MIB, 32, 16),
         hlo.Collective("all-gather", 112 * MIB, 32, 16)]
  one = [hlo.Collective("all-gather", 112 * MIB, 32, 256)]
  assert hlo.by_kind(two)["all-gather"]["bytes"] == 32 * 119 * MIB
  assert roofline.received_by_kind(two) == roofline.received_by_kind(one) == {
      "all-gather": 32 * 112 * MIB * 255 / 256}
  ops = [hlo.Collective("reduce-scatter", 7 * MIB, 2, 16),
         hlo.Collective("all-reduce", 4 * MIB, 1, 8),
         hlo.Collective("all-reduce", 4 * MIB, 1, 2, dcn=True)]
  assert roofline.received_by_kind(ops) == {"reduce-scatter": 2 * 15 * 7 * MIB,
                                            "all-reduce": 2 * 4 * MIB * 7 / 8,
                                            "all-reduce (dcn)": 2 * 4 * MIB / 2}
  assert sum(roofline.received_by_kind(ops).values()) == sum(
      roofline.collective_traffic(ops).values())
