"""Fingerprints: equal for equal logical values whatever the mesh (fsdp 8, one device), equal
to the formula computed in numpy, and changed by one ulp."""
import jax
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from spmdtask.run import fingerprints
from tests import util


def _numpy_fingerprint(x: np.ndarray) -> str:
  """The module docstring's formula, element by element in numpy's uint32 (wrapping)."""
  with np.errstate(over="ignore"):
    bits = x.reshape(-1).view(np.uint32)
    index = np.arange(bits.size, dtype=np.uint32)
    h = bits ^ (index * np.uint32(0x9E3779B9))
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    lanes = (h.sum(dtype=np.uint32), (h * (index * np.uint32(2) + np.uint32(1))).sum(
        dtype=np.uint32))
  return f"{int(lanes[0]):08x}{int(lanes[1]):08x}"


def test_fingerprints_equal_across_meshes_and_catch_one_ulp():
  program, state = util.program_and_state("TinyLmFsdp", 8)  # fsdp 8
  canonical = program.to_canonical(state)
  items = {"params": canonical.params, "opt_state": canonical.opt_state}
  specs = [x.sharding.spec for x in jax.tree.leaves(canonical.params)]
  assert sum("fsdp" in jax.tree.leaves(tuple(s)) for s in specs) >= 8  # most split 8 ways
  host = jax.device_get(items)
  one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  put = lambda tree: jax.device_put(tree, NamedSharding(one, PartitionSpec()))
  got_eight = fingerprints.of(items, program.mesh)
  got_one = fingerprints.of(put(host), one)
  assert len(got_eight) == len(jax.tree.leaves(items)) > 10
  assert got_one == got_eight  # the same 64 bits per array, sharded 8 ways or on one device
  for name in ("embedding", "layers/block/mlp/wi"):
    leaf = host["params"]
    for key in name.split("/"):
      leaf = leaf[key]
    assert got_eight[f"params/{name}"] == _numpy_fingerprint(np.asarray(leaf)), name

  changed = jax.tree.map(np.copy, host["params"])
  wi = changed["layers"]["block"]["mlp"]["wi"]
  wi[1, 7, 300] = np.nextafter(wi[1, 7, 300], np.float32(np.inf))  # one ulp
  why = fingerprints.mismatch(got_eight, fingerprints.of({"params": put(changed)}, one))
  assert why.startswith("the array params/layers/block/mlp/wi does not hold the values it "
                        "was saved with (its fingerprint"), why
  assert fingerprints.mismatch(got_eight, got_one) is None


def test_a_fingerprint_taken_block_by_block_equals_the_whole_arrays():
  mesh = jax.make_mesh((8,), ("d",))
  rng = np.random.default_rng(0)
  for x in (rng.normal(size=(3, 4, 5)).astype(np.float32), rng.normal(size=(3, 4, 5)) > 0,
            rng.integers(0, 99, size=(3, 4, 5)).astype(np.int32)):
    whole = fingerprints.of({"p": {"w": jax.device_put(x, NamedSharding(mesh, PartitionSpec()))}},
                            mesh)["p/w"]
    of = fingerprints.of_blocks
    rows = of(x.shape, [((i, 0, 0), x[i:i + 1]) for i in range(3)])
    cells = of(x.shape, [((i, j, 0), x[i:i + 1, j:j + 1]) for i in range(3) for j in range(4)])
    blocks = of(x.shape, [((0, 0, 0), x[:2]), ((2, 0, 0), x[2:])])
    assert whole == rows == cells == blocks
    assert of(x.shape, [((i, 0, 0), x[i:i + 1]) for i in (1, 0, 2)]) == whole  # any order
    assert of(x.shape, [((i, 0, 0), x[(i + 1) % 3:(i + 1) % 3 + 1]) for i in range(3)]) != whole
