"""The partitioner's pure functions: split dims -> PartitionSpecs, padding, optimizer state."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from spmdtask.core import sharding
from spmdtask.errors import ConfigError

MESH = {"data": 2, "fsdp": 2, "model": 2}


def sds(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_padded_shape_rounds_up_only_split_dims():
  assert sharding.padded_shape((257, 129), ("model", "fsdp"), MESH) == (258, 130)
  assert sharding.padded_shape((257, 129), (None, ("data", "fsdp")), MESH) == (257, 132)
  assert sharding.padded_shape((256, 128), ("model", "fsdp"), MESH) == (256, 128)


def test_pad_unpad_roundtrip_and_zero_fill():
  x = jnp.arange(6.0).reshape(3, 2)
  padded = sharding.pad({"w": x}, {"w": sds(4, 2)})["w"]
  assert padded.shape == (4, 2) and float(padded[3].sum()) == 0.0
  np.testing.assert_array_equal(sharding.unpad({"w": padded}, {"w": sds(3, 2)})["w"], x)


@pytest.mark.parametrize("split,msg", [
    (("fsdp",), "has 1 entries, but the tensor has rank 2"),
    (("fsdp", "modle"), "names mesh axis 'modle'"),
    (("fsdp", ("model", "fsdp")), "uses mesh axis 'fsdp' on more than one dim"),
])
def test_validate_names_the_field(split, msg):
  with pytest.raises(ConfigError, match=msg) as e:
    sharding.validate(split, (4, 8), MESH, "task.model.weight_split_dims_mapping.mlp_in")
  assert "task.model.weight_split_dims_mapping.mlp_in" in str(e.value)


def _opt_splits(tx, params, splits):
  shapes = jax.tree.map(lambda x: sds(*x.shape), params)
  opt = jax.eval_shape(tx.init, shapes)
  return opt, sharding.opt_state_split_dims(tx, opt, shapes, splits)[0]


def test_adamw_moments_take_the_param_spec_counters_replicated():
  params = {"w": jnp.zeros((8, 4)), "b": jnp.zeros((4,))}
  splits = {"w": P("fsdp", "model"), "b": P("model")}
  opt, out = _opt_splits(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
                         params, splits)
  adam = out[1][0]
  assert adam.mu == splits and adam.nu == splits
  assert adam.count == P()


def test_sgd_momentum_trace_takes_the_param_spec():
  params = {"w": jnp.zeros((8, 4))}
  _, out = _opt_splits(optax.sgd(0.1, momentum=0.9), params, {"w": P("fsdp", "model")})
  assert jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, P)) == [P("fsdp", "model")]


def test_adafactor_factored_stats_drop_the_reduced_dim():
  # [256, 512]: v_row drops the largest dim (1), v_col the second largest (0).
  params = {"w": jnp.zeros((256, 512)), "sq": jnp.zeros((256, 256)), "b": jnp.zeros((512,))}
  splits = {"w": P("fsdp", "model"), "sq": P("data", "model"), "b": P("model")}
  opt, out = _opt_splits(optax.adafactor(1e-3), params, splits)
  fac = [s for s in jax.tree.leaves(opt, is_leaf=lambda x: hasattr(x, "v_row"))
         if hasattr(s, "v_row")][0]
  fac_split = [s for s in jax.tree.leaves(out, is_leaf=lambda x: hasattr(x, "v_row"))
               if hasattr(s, "v_row")][0]
  assert fac.v_row["w"].shape == (256,) and fac_split.v_row["w"] == P("fsdp")
  assert fac.v_col["w"].shape == (512,) and fac_split.v_col["w"] == P("model")
  # Square: optax's own rule picks which dim each statistic keeps.
  assert fac_split.v_row["sq"] == P("data") and fac_split.v_col["sq"] == P("model")
  # Unfactored rank-1 param: full v keeps the spec, placeholders are replicated.
  assert fac_split.v["b"] == P("model") and fac_split.v_row["b"] == P(None)


def test_input_split_by_rank_default_and_explicit():
  shapes = {"inputs": sds(8, 16), "mask": sds(8, 16, 4), "ids": sds(8)}
  got = sharding.input_split_dims(shapes, None, ("data", "fsdp"), MESH)
  assert got == {"inputs": P(("data", "fsdp"), None), "mask": P(("data", "fsdp"), None, None),
                 "ids": P(("data", "fsdp"))}
  mapping = {"map_1d": ("data",), "map_2d": ("data", "model"), "map_3d": ("data", None, None)}
  got = sharding.input_split_dims(shapes, mapping, ("data",), MESH)
  assert got["inputs"] == P("data", "model") and got["ids"] == P("data")


def test_input_errors_name_the_field():
  with pytest.raises(ConfigError, match="no 'map_3d' entry"):
    sharding.input_split_dims({"x": sds(8, 2, 2)}, {"map_2d": ("data", None)}, ("data",), MESH)
  with pytest.raises(ConfigError, match="size 6, which does not divide .* batch_size"):
    sharding.input_split_dims({"x": sds(6, 2)}, None, ("data", "fsdp"), MESH)


def test_even_split_replicates_only_the_dims_that_do_not_divide():
  assert sharding.even_split(P("model", "fsdp"), (257, 128), MESH) == P(None, "fsdp")
  assert sharding.even_split(P(("data", "fsdp")), (6, 3), MESH) == P(None, None)
  assert sharding.even_split(P("model"), (8, 3), MESH) == P("model", None)


def test_spread_adds_the_unused_axes_to_the_dims_they_divide():
  dp = {"data": 8}
  assert sharding.spread(P(None, None), (16, 6), dp) == P("data", None)  # replicated: cut 8 ways
  assert sharding.spread(P(), (3, 40), dp) == P(None, "data")  # a short spec: one per dim
  three = {"data": 2, "fsdp": 2, "model": 2}
  # The layout's own axes stay; the unused two go to the dim with the most left (64 -> 32).
  assert sharding.spread(P("fsdp", None), (8, 64), three) == P("fsdp", ("data", "model"))
  assert sharding.spread(P("fsdp", "model"), (8, 6), three) == P(("fsdp", "data"), "model")
  # An axis that divides no dim is left out; an uneven entry is dropped first (even_split).
  assert sharding.spread(P(None), (7,), dp) == P(None)
  assert sharding.spread(P("data", None), (5, 4), {"data": 2}) == P(None, "data")
  assert sharding.spread(P(None, None), (16, 6), {"data": 1, "model": 1}) == P(None, None)
