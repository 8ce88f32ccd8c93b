"""layers.base: FSDP by hand (`project`, `gather`) on 8 CPU devices."""
import collections
import math

from spmdtask.core import memory
from spmdtask.core import program as program_lib
from spmdtask.plan import hlo, roofline
from tests import util

F32 = 4  # XLA:CPU moves the shards in float32 (base.moved_dtype)


def test_fsdp_gathers_each_weight_twice_per_layer_and_the_head_once_receiving_one_gathers_bytes():
  """TinyLm, FSDP over fsdp 4 x fsdp_b 2 (no tensor axis), full remat, the loss over 2 vocab
  tiles. In the layer loops each of a layer's 7 weights is gathered in the forward and once
  more in the backward's recompute, one axis at a time: a device receives 1/2 of the 1/4
  it gathers over fsdp_b, then 3/4 of the whole over fsdp, the 7/8 of the weight it lacks,
  what one gather over all 8 devices brings (the results count 1 + 1/4 of the weight).
  Each gradient is reduce-scattered one axis at a time; the only all-reduce left is the
  two norm scales'. The head is gathered once per step (the forward keeps its tiles for
  the backward), its gradient reduce-scattered, never all-reduced."""
  run = util.build_run("lm.TinyLmFsdp2", ["task.ici_mesh_shape=(1, 4, 2, 1)",
                                          "task.model.loss_vocab_tiles=2"])
  batch = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, batch)
  ops = hlo.collective_ops(program.lowerings(batch)[0].lower().compile().as_text())
  model = run.task.model
  rows = {r.path: r for r in memory.state_rows(program.layout, dict(program.mesh.shape))
          if r.kind == "params"}
  layer_weights = [r for path, r in rows.items() if "layers" in path and r.shards > 1]
  assert len(layer_weights) == 7, sorted(rows)
  layer_bytes = sum(math.prod(r.logical_shape[1:]) * F32 for r in layer_weights)
  received = lambda ops: sum(op.runs * roofline.received_bytes(op.kind, op.bytes, op.group_size)
                             for op in ops)

  in_layers = [op for op in ops if op.runs == model.num_layers]
  gathers = [op for op in in_layers if op.kind == "all-gather"]
  assert {op.group_size for op in gathers} == {2, 4}, gathers
  assert sum(op.bytes for op in gathers) == 2 * layer_bytes * 5 // 4, gathers  # per layer
  assert received(gathers) == model.num_layers * 2 * layer_bytes * 7 / 8, gathers
  scatters = [op for op in in_layers if op.kind == "reduce-scatter"]
  assert {op.group_size for op in scatters} == {2, 4}, scatters
  # over fsdp to a quarter of the gradient, then over fsdp_b to the device's eighth
  assert sum(op.bytes for op in scatters if op.group_size == 4) == layer_bytes // 4, scatters
  assert sum(op.bytes for op in scatters if op.group_size == 2) == layer_bytes // 8, scatters
  reduced = [op.bytes for op in in_layers if op.kind == "all-reduce"]
  assert sum(reduced) <= 2 * model.d_model * F32, reduced  # two f32 [d_model] norm scales

  in_tiles = [op for op in ops if op.runs == 2]
  head_bytes = math.prod(rows["params/unembed"].padded_shape) * F32
  assert received([op for op in in_tiles if op.kind == "all-gather"]) == head_bytes * 7 / 8
  assert {op.kind for op in in_tiles} == {"all-gather", "reduce-scatter"}, in_tiles
