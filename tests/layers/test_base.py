"""layers.base: FSDP by hand (`project`) on 8 CPU devices."""
import collections

from spmdtask.core import program as program_lib
from spmdtask.plan import hlo
from tests import util


def test_fsdp_gathers_each_weight_twice_per_layer_and_reduce_scatters_its_gradient():
  """TinyLm, FSDP over fsdp 4 x fsdp_b 2 (no tensor axis), full remat: in the layer loops
  each of a layer's 7 weights is gathered once per FSDP axis in the forward and once in the
  backward's recompute (at most 28 gathers a layer; XLA may merge some), every weight's
  gradient is reduce-scattered, and the only all-reduce left is the two norm scales'. The
  vocab-tiled head (2 tiles: loops of 2 trips) the same: gathered, reduce-scattered."""
  run = util.build_run("lm.TinyLmFsdp2", ["task.ici_mesh_shape=(1, 4, 2, 1)",
                                          "task.model.loss_vocab_tiles=2"])
  batch = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, batch)
  text = program.lowerings(batch)[0].lower().compile().as_text()
  model = run.task.model
  in_layers = [op for op in hlo.collective_ops(text) if op.runs == model.num_layers]
  count = collections.Counter(op.kind for op in in_layers)
  assert 14 <= count["all-gather"] <= 7 * 2 * 2, count
  assert count["reduce-scatter"] >= 7, count
  assert {op.group_size for op in in_layers if op.kind != "all-reduce"} == {2, 4}
  reduced = [op.bytes for op in in_layers if op.kind == "all-reduce"]
  assert sum(reduced) <= 2 * model.d_model * 4, reduced  # two f32 [d_model] norm scales
  in_tiles = collections.Counter(op.kind for op in hlo.collective_ops(text) if op.runs == 2)
  assert in_tiles["all-gather"] >= 2 and in_tiles["reduce-scatter"] >= 1, in_tiles
  assert in_tiles["all-reduce"] == 0, in_tiles
