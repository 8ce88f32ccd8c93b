"""The MoE layer: dropless grouped matmul == a dense every-expert reference (value and grads),
capacity at the busiest load == dropless, expert parallelism with FSDP and tensor parallelism
== one device, megablox's kernel (interpret mode) == ragged_dot, every remat preset, the ff
dim in slices (`ff_chunks`) == all at once at the same FLOPs, the dispatch's placement and
its gather-only backward."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask.core import remat
from spmdtask.errors import ConfigError
from spmdtask.layers import moe, moe_dispatch
from spmdtask.plan import flops

D, F, E, K = 16, 8, 4, 2
CFG = moe.MoeConfig(num_experts=E, top_k=K, d_ff=F, num_shared_experts=1)
BATCH = ("data", "expert", "fsdp")
EP = dict(router=(None, None), in_split=("expert", "fsdp", "model"),
          out_split=("expert", "model", "fsdp"), shared_in_split=("fsdp", "model"),
          shared_out_split=("model", "fsdp"), ff_act_split=(BATCH, None, "model"),
          embed_split=(BATCH, None, None))


def layer(cfg=CFG, kernel="auto", split=None):
  s = split or {k: tuple(None for _ in v) if k != "ff_act_split" and k != "embed_split"
                else None for k, v in EP.items()}
  return moe.MoeFfn(D, cfg, jnp.float32, s["router"], s["in_split"], s["out_split"],
                    s["shared_in_split"], s["shared_out_split"], s["ff_act_split"],
                    s["embed_split"], kernel=kernel)


X = jax.random.normal(jax.random.key(1), (8, 6, D))
PARAMS = layer().init(jax.random.key(0), X)["params"]


def dense_reference(params, x, cfg=CFG):
  """Every expert on every token, combined with the routing's gates (zero where unrouted)."""
  p = jax.tree.map(lambda a: getattr(a, "value", a), params,
                   is_leaf=lambda a: hasattr(a, "value"))
  logits = jnp.einsum("btd,de->bte", x, p["router"])
  gates, experts, _ = moe.route(logits, cfg)
  combine = jnp.sum(jax.nn.one_hot(experts, cfg.num_experts) * gates[..., None], axis=2)
  h = jnp.einsum("btd,edf->btef", x, p["wi"])
  g = jnp.einsum("btd,edf->btef", x, p["wg"])
  y = jnp.einsum("btef,efd->bted", jax.nn.silu(g) * h, p["wo"])
  s = p["shared"]
  shared = (jax.nn.silu(x @ s["wg"]) * (x @ s["wi"])) @ s["wo"]
  return jnp.einsum("bted,bte->btd", y, combine) + shared


def _value_and_grads(fn, params, x):
  """The output and the grads of a fixed random projection of it, wrt params and x (jitted:
  one compile instead of op-by-op dispatch)."""
  probe = jax.random.normal(jax.random.key(2), x.shape)
  return jax.jit(lambda p, x: (fn(p, x), jax.grad(
      lambda p, x: jnp.sum(fn(p, x) * probe), (0, 1))(p, x)))(params, x)


def _unbox(tree):
  return jax.tree.map(lambda a: getattr(a, "value", a), tree,
                      is_leaf=lambda a: hasattr(a, "value"))


def test_dropless_equals_the_dense_reference_value_and_grads():
  got = _value_and_grads(lambda p, x: layer().apply({"params": p}, x)[0], PARAMS, X)
  want = _value_and_grads(dense_reference, PARAMS, X)
  # float32 sums of <= F*D = 128 products of O(1) terms: eps * sqrt(128) ~ 1.3e-6 relative.
  for a, b in zip(jax.tree.leaves(_unbox(got)), jax.tree.leaves(_unbox(want))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_capacity_at_the_busiest_load_equals_dropless_and_below_drops():
  # Capacity factor E/K: C = T slots per expert per row, the most a row can send one expert.
  full = dataclasses.replace(CFG, dispatch="capacity", capacity_factor=E / K)
  short = dataclasses.replace(full, capacity_factor=0.5)
  (dropless, stats), (got, full_stats), (cut, cut_stats) = jax.jit(lambda p, x: [
      layer(c).apply({"params": p}, x) for c in (CFG, full, short)])(PARAMS, X)
  assert float(jnp.max(stats[:, 3])) == 0.0  # dropless drops nothing
  np.testing.assert_allclose(got, dropless, rtol=1e-6, atol=1e-6)
  assert float(jnp.max(full_stats[:, 3])) == 0.0
  assert moe_dispatch.capacity(6, K, E, 0.5) == 2
  got, dropped = cut, np.asarray(cut_stats[:, 3])
  assert dropped.min() >= 1 / 3 and dropped.max() <= 1  # >= 12 - 4*2 of 12 per row
  assert float(jnp.max(jnp.abs(got - dropless))) > 1e-2


def test_stats_aux_loss_z_loss_and_imbalance():
  _, stats = jax.jit(layer().apply)({"params": PARAMS}, X)
  logits = jnp.einsum("btd,de->bte", X, _unbox(PARAMS)["router"])
  np.testing.assert_allclose(stats[:, 1], jnp.mean(jax.nn.logsumexp(logits, -1) ** 2, -1),
                             rtol=1e-6)
  # Switch's loss is 1 for uniform routing and >= 1 when imbalanced (Cauchy-Schwarz, here
  # with near-uniform router scores); imbalance max/mean is in [1, E].
  assert np.all(np.asarray(stats[:, 0]) > 0.9) and np.all(np.asarray(stats[:, 2]) >= 1)
  assert np.all(np.asarray(stats[:, 2]) <= E)
  uniform = moe.row_stats(jnp.zeros((1, 4, E)), jnp.full((1, 4, E), 1 / E),
                          jnp.asarray([[[0, 1], [2, 3], [0, 1], [2, 3]]]), jnp.zeros(1), CFG)
  np.testing.assert_allclose(uniform[0], [1.0, np.log(E) ** 2, 1.0, 0.0], rtol=1e-6)


def test_placement_is_gathers_both_ways_and_its_backward_is_the_other_map():
  """rows / tokens equal the plain gathers and sum, their vjps equal autodiff's of those,
  and the backward of rows then tokens has no scatter (each map's transpose is the other)."""
  g, t, k = 2, 5, 3
  order = jax.random.permutation(jax.random.key(5), g * t * k)
  place = moe_dispatch.placement(order, k, g, t)
  x = jax.random.normal(jax.random.key(6), (g, t, D))
  out = jax.random.normal(jax.random.key(7), (g * t * k, D))
  plain_rows = lambda x: x.reshape(g * t, D)[order // k]
  plain_tokens = lambda o: jnp.sum(o[jnp.argsort(order)].reshape(g, t, k, D), axis=2)
  for got, want, arg in ((place.rows, plain_rows, x), (place.tokens, plain_tokens, out)):
    (y, vjp), (y0, vjp0) = jax.vjp(got, arg), jax.vjp(want, arg)
    ct = jax.random.normal(jax.random.key(8), y.shape)
    np.testing.assert_allclose(y, y0, rtol=1e-6)
    np.testing.assert_allclose(vjp(ct)[0], vjp0(ct)[0], rtol=1e-6, atol=1e-6)
  grad = jax.grad(lambda x: jnp.sum(place.tokens(jnp.sin(place.rows(x)))))
  assert "scatter" not in str(jax.make_jaxpr(grad)(x))


def test_megablox_kernel_in_interpret_mode_equals_ragged_dot():
  m, k, n = 256, 128, 128
  lhs = jax.random.normal(jax.random.key(3), (m, k))
  rhs = jax.random.normal(jax.random.key(4), (E, k, n))
  sizes = jnp.asarray([40, 0, 100, 116], jnp.int32)
  want = moe.grouped_matmul(lhs, rhs, sizes, "ragged_dot")
  got = moe.grouped_matmul(lhs, rhs, sizes, "megablox_interpret")
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)  # sums of 128 N(0,1) products


@functools.cache
def _mesh():
  return jax.make_mesh((1, 2, 2, 2), ("data", "expert", "fsdp", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)


@pytest.mark.parametrize("dispatch,chunks", [("dropless", 1), ("capacity", 1), ("dropless", 2)])
def test_expert_parallel_with_fsdp_and_tensor_parallel_equals_one_device(dispatch, chunks):
  """Experts over `expert` 2 (all-to-all), their weights over fsdp 2 (gathered in the
  shard_map) and model 2 (GSPMD), the batch over expert x fsdp: value and grads (with
  chunks 2: the ff dim in two slices, each gathered in its own step, f split over model)."""
  cfg = dataclasses.replace(CFG, dispatch=dispatch, capacity_factor=E / K, ff_chunks=chunks)
  one = layer(cfg)
  fn = lambda p, x: one.apply({"params": p}, x)
  want = _value_and_grads(lambda p, x: fn(p, x)[0], PARAMS, X)
  mesh = _mesh()
  split = layer(cfg, split=EP)
  specs = nn_specs(split)
  with jax.set_mesh(mesh):
    params = jax.device_put(_unbox(PARAMS), jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                         specs))
    x = jax.device_put(X, NamedSharding(mesh, P(BATCH)))
    got = jax.jit(lambda p, x: _value_and_grads(
        lambda p, x: split.apply({"params": p}, x)[0], p, x))(params, x)
  # The gradients' sums over 48 tokens run in another order (reduce-scatter over fsdp):
  # eps * sqrt(48 * 8) * |grad| ~ 2.4e-6 * |grad| (grads here up to ~4).
  for a, b in zip(jax.tree.leaves(_unbox(got)), jax.tree.leaves(_unbox(want))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_ff_chunks_equal_all_at_once_value_grads_and_flops():
  """The experts' ff dim in F / 2 and F slices (a lax.scan, a checkpoint per slice) gives
  the dropless and capacity outputs and grads of all at once; under full remat of the layer
  the grads cost the same matmul FLOPs (the gates multiply inside each slice, so their
  gradient needs no second run of the experts); a slice count not dividing d_ff is refused."""
  cap = dict(dispatch="capacity", capacity_factor=E / K)
  cfgs = [dataclasses.replace(CFG, ff_chunks=c, **d) for d in ({}, cap) for c in (1, 2, F)]
  fns = [lambda p, x, c=c: layer(c).apply({"params": p}, x)[0] for c in cfgs]
  probe = jax.random.normal(jax.random.key(2), X.shape)
  grads = [jax.grad(jax.checkpoint(lambda p, x, f=f: jnp.sum(f(p, x) * probe)), (0, 1))
           for f in fns]
  got = jax.jit(lambda p, x: [(f(p, x), g(p, x)) for f, g in zip(fns, grads)])(PARAMS, X)
  # The slices' partial sums add in another order; the grads (up to ~9) sum 48 tokens' terms
  # of <= 8 products: eps * sqrt(48 * 8) * |grad| ~ 2e-5 at worst; measured 1.9e-6.
  for i, one in enumerate(got):
    for a, b in zip(jax.tree.leaves(_unbox(one)), jax.tree.leaves(_unbox(got[i // 3 * 3]))):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=str(cfgs[i]))
  cost = [flops.traced_flops(g, PARAMS, X) for g in grads]
  assert cost[1] == cost[2] == cost[0] and cost[4] == cost[5] == cost[3], cost
  with pytest.raises(ConfigError, match=r"ff_chunks=3: .* divisor of 8"):
    dataclasses.replace(CFG, ff_chunks=3).validate(num_layers=1, expert_shards=1)


def nn_specs(module):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  boxed = jax.eval_shape(lambda: module.init(jax.random.key(0), X)["params"])
  return nn.get_partition_spec(boxed)


def test_every_remat_preset_gives_no_remats_grads(capsys):
  """The expert activations carry the MLP's checkpoint names: each preset's grads (all in
  one program) equal no remat's, and it keeps the names it says (minimal: mlp_out)."""
  fn = lambda p, x: jnp.sum(layer().apply({"params": p}, x)[0] ** 2)
  rematted = {p: jax.checkpoint(fn, policy=remat.policy(p)) for p in remat.PRESETS}
  want, *got = jax.jit(lambda p, x: [jax.grad(f)(p, x) for f in [fn, *rematted.values()]])(
      PARAMS, X)
  for preset, grads in zip(remat.PRESETS, got):
    for a, b in zip(jax.tree.leaves(_unbox(grads)), jax.tree.leaves(_unbox(want))):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=preset)
  for preset in remat.SAVED:  # on CPU the offloaded presets keep nothing on the device
    jax.ad_checkpoint.print_saved_residuals(rematted[preset], PARAMS, X)
    lines = capsys.readouterr().out.splitlines()
    names = {ln.split("'")[1] for ln in lines if "named '" in ln}
    assert names == set(remat.SAVED[preset]) & {remat.MLP_OUT, remat.MLP_UP, remat.MLP_GATE,
                                                remat.MLP_HIDDEN}, preset
