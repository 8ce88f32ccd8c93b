"""Placement: every state leaf lives where its split-dims mapping says; FSDP divides the bytes."""
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmdtask.core import program as program_lib, sharding
from tests import util


def _setup(exp):
  run = util.build_run(exp)
  program = program_lib.setup(run.task, run.datasets["train"].batch_at(0))
  return program, program.init()


def test_every_leaf_has_its_derived_sharding():
  program, state = _setup("lm.TinyLmFsdpTp")
  flat_state = jax.tree_util.tree_flatten_with_path(state)[0]
  flat_split = jax.tree.leaves(program.layout.split, is_leaf=lambda x: isinstance(x, P))
  assert len(flat_state) == len(flat_split)
  for (path, leaf), split in zip(flat_state, flat_split):
    want = NamedSharding(program.mesh, split)
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (sharding.path_str(path),
                                                             leaf.sharding, split)
  layer_split = program.layout.split.params["layers"]["block"]
  assert layer_split["mlp"]["wi"] == P(None, "fsdp", "model")  # scan adds the layer dim
  assert layer_split["attn"]["o"] == P(None, "model", None, "fsdp")
  adam = program.layout.split.opt_state[1][0]
  assert adam.mu["layers"]["block"]["mlp"]["wi"] == P(None, "fsdp", "model")
  assert adam.nu["embedding"] == P("model", "fsdp") and adam.count == P()
  # Each shard really is the slice: a [L, d, ff] weight on fsdp 2 x model 2.
  wi = state.params["layers"]["block"]["mlp"]["wi"]
  assert {s.data.shape for s in wi.addressable_shards} == {(4, 64, 256)}


def test_fsdp_state_bytes_per_device():
  program, state = _setup("lm.TinyLmFsdp")
  n = program.mesh.size
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(program.layout.logical))
  per_device = {}
  for leaf in jax.tree.leaves(state):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  padding = program.layout.padding(dict(program.mesh.shape))
  assert padding == {}  # TinyLm divides fsdp 8 evenly; nothing to report
  worst = max(per_device.values())
  print(f"FSDP x{n}: per-device {worst} B, total/N {total / n:.0f} B, ratio {worst * n / total:.4f}")
  assert worst <= 1.02 * total / n
  assert len(per_device) == n


def test_adapters_keeps_only_the_adapter_leaves():
  from spmdtask.core import train_state  # pylint: disable=g-import-not-at-top
  params = {"embed": 1, "layers": {"attn": {"q": 2, "q_lora_a": 3, "q_lora_b": 4},
                                   "norm": {"scale": 5}}}
  assert train_state.adapters(params) == {"layers": {"attn": {"q_lora_a": 3, "q_lora_b": 4}}}
