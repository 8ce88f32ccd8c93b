"""The gather-free and the vocab-tiled cross entropy equal optax's, values and gradients, on
one device and on a data x fsdp x model mesh of 8; the tiled scores' argmax ids equal
`jnp.argmax` of the whole logits, ties included."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask.layers import xent
from tests import util

B, T, D, V = 4, 6, 16, 37  # V: no number of tiles below divides it, so tiles are padded
LOGITS_SPLIT = (("data", "fsdp"), None, "model")


def _data(seed=0):
  kx, kw, kl, kg = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (B, T, D))
  w = jax.random.normal(kw, (D, V)) * 0.5
  labels = jax.random.randint(kl, (B, T), 0, V)
  g = jax.random.uniform(kg, (B, T))  # per-token weights: the cotangent is not uniform
  return x, w, labels, g


def _optax_loss(x, w, labels, g, scale):
  logits = scale * x @ w
  return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, labels) * g)


def _tiled_loss(tiles, split, weight_split):
  def loss(x, w, labels, g, scale):
    w_tiles = xent.head_tiles(w, tiles, weight_split)
    return jnp.sum(xent.tiled_cross_entropy(x, w_tiles, labels, V, scale, split,
                                            weight_split) * g)
  return loss


def _value_and_grads(fn, *args):
  return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)), static_argnums=4)(*args)


def _assert_close(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    util.assert_close_f32(a, b, terms=B * T, rtol=1e-6)


def test_one_hot_cross_entropy_equals_optax():
  x, w, labels, g = _data()
  want = _value_and_grads(_optax_loss, x, w, labels, g, 1.0)
  got = _value_and_grads(
      lambda x, w, l, g, s: jnp.sum(xent.cross_entropy(s * x @ w, l) * g), x, w, labels, g, 1.0)
  _assert_close(got, want)


@pytest.mark.parametrize("tiles,scale", [(4, 1.0), (5, 0.25)])
def test_tiled_cross_entropy_equals_optax_on_one_device(tiles, scale):
  x, w, labels, g = _data(tiles)
  want = _value_and_grads(_optax_loss, x, w, labels, g, scale)
  _assert_close(_value_and_grads(_tiled_loss(tiles, None, None), x, w, labels, g, scale), want)


def test_tiled_cross_entropy_equals_optax_on_a_data_fsdp_tp_mesh():
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  x, w, labels, g = _data(1)
  want = _value_and_grads(_optax_loss, x, w, labels, g, 1.0)
  put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
  batch = ("data", "fsdp")
  args = (put(x, batch, None, None), put(jnp.pad(w, ((0, 0), (0, 3))), "fsdp", "model"),
          put(labels, batch, None), put(g, batch, None))
  tiled = _tiled_loss(4, LOGITS_SPLIT, ("fsdp", "model"))

  def padded(x, w, labels, g, scale):  # vocab 40 splits over model; ids >= 37 never labels
    return tiled(x, w[:, :V], labels, g, scale)

  with jax.set_mesh(mesh):
    value, (dx, dw) = _value_and_grads(padded, *args, 1.0)
  _assert_close((value, dx, dw[:, :V]), want)
  np.testing.assert_array_equal(np.asarray(dw[:, V:]), 0.0)


def _tied_data():
  """`_data` with ids 7 and 30 given the same head column, the greatest logit of token
  (0, 0): with 4 tiles 30 sits in an earlier tile (2) than 7 (3), and 7 must win."""
  x, w, labels, _ = _data(2)
  column = 4.0 * x[0, 0] / jnp.linalg.norm(x[0, 0])
  w = w.at[:, 7].set(column).at[:, 30].set(column)
  labels = labels.at[0, 0].set(7).at[1, 0].set(30).at[2].set(jnp.argmax(x[2] @ w, -1))
  return x, w, labels


def _check_scores(got, x, w, labels):
  loss, ids = got
  want_ids = jnp.argmax(x @ w, -1)
  assert int(ids[0, 0]) == 7 and bool(jnp.all(ids[2] == labels[2]))
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
  util.assert_close_f32(loss, xent.cross_entropy(x @ w, labels), terms=D, rtol=1e-6)


@pytest.mark.parametrize("tiles", [4, 5])
def test_tiled_scores_give_the_loss_and_the_first_argmax_on_one_device(tiles):
  x, w, labels = _tied_data()
  got = jax.jit(lambda x, w, l: xent.tiled_scores(x, xent.head_tiles(w, tiles), l, V))(
      x, w, labels)
  _check_scores(got, x, w, labels)


def test_tiled_scores_on_a_data_fsdp_tp_mesh():
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  x, w, labels = _tied_data()
  put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
  batch, split = ("data", "fsdp"), ("fsdp", "model")

  def scores(x, w, labels):  # vocab 40 splits over model; ids >= 37 are never the argmax
    return xent.tiled_scores(x, xent.head_tiles(w[:, :V], 4, split), labels, V, 1.0,
                             LOGITS_SPLIT, split)

  with jax.set_mesh(mesh):
    got = jax.jit(scores)(put(x, batch, None, None),
                          put(jnp.pad(w, ((0, 0), (0, 3))), "fsdp", "model"),
                          put(labels, batch, None))
  _check_scores(got, x, w, labels)
