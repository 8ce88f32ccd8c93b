"""Tests for spmdtask.pipeline.mpmd.pipeline: per-stage programs on submeshes, run by GPipe, 1F1B,
interleaved and ZB-H1 (I/W split) schedules, give the loss and grads of jax.grad on one device
and of 1F1B; the measured live activation sets (and W stashes) per stage equal the
simulator's; compiled FLOPs of I + W are those of B; bad configs raise ConfigError."""

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from spmdtask.errors import ConfigError
from spmdtask.pipeline.mpmd import pipeline as mpmd, parts
from spmdtask.pipeline.schedules import simulate
from spmdtask.pipeline.schedules.generators import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from spmdtask.pipeline.schedules.schedule import Action, Schedule
from spmdtask.pipeline.mpmd.split import stage_boundary
from tests import util

DIN, D, L, B, M = 4, 8, 4, 16, 4  # input width, model width, layers, batch, microbatches


def toy_params(seed=0):
  ks = jax.random.split(jax.random.key(seed), 2 * L + 1)
  return {"w_in": jax.random.normal(ks[0], (DIN, D)) / 2,
          "layers": [{"w": jax.random.normal(ks[1 + 2 * l], (D, D)) / np.sqrt(D),
                      "b": jax.random.normal(ks[2 + 2 * l], (D,)) / 4} for l in range(L)]}


def toy_batch(seed):
  kx, ky = jax.random.split(jax.random.key(100 + seed))
  return {"x": jax.random.normal(kx, (B, DIN)), "y": jax.random.normal(ky, (B, DIN))}


def toy_loss(cuts):
  """Residual dense layers with a marker after each layer in `cuts`; the output projection
  is w_in transposed (tied between the first and the last stage)."""
  def loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w_in"])
    for l, lp in enumerate(p["layers"]):
      h = h + jnp.tanh(h @ lp["w"] + lp["b"])
      if l in cuts:
        h = stage_boundary(h)
    return jnp.mean((h @ p["w_in"].T - batch["y"]) ** 2)
  return loss


def microbatch_shapes(batch):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((B // M, *x.shape[1:]), x.dtype), batch)


def gpipe_v(S, M):
  """GPipe over two chunks per stage, V placement: all forwards, then all backwards."""
  acts = tuple(tuple([Action("F", m, c) for c in range(2) for m in range(M)] +
                     [Action("B", m, c) for c in (1, 0) for m in reversed(range(M))])
               for _ in range(S))
  return Schedule(S, M, acts, 2, "v")


def measured_equals_simulated(result, schedule):
  """The executor's peak activation sets and W stashes equal the simulator's (1/v a chunk),
  and the residual bytes it measured holding (from the arrays) equal the simulator's
  replay of the schedule with one set's measured bytes per part."""
  sim = simulate.simulate(schedule, simulate.Costs())
  assert result.peak_activations == sim.peak_activations
  assert result.peak_weight_grad_stash == sim.peak_weight_grad_stash
  assert result.peak_activations == tuple(Fraction(n, schedule.num_chunks)
                                          for n in result.peak_residuals)
  fused = parts.fused_part(schedule)  # its F and B are one program: no set held between
  assert all((b == 0) == (v == fused) for v, b in enumerate(result.residual_set_bytes))
  assert result.peak_residual_bytes == simulate.peak_bytes(schedule, result.residual_set_bytes)
  return result.peak_residual_bytes


def submesh(devices, shape):
  return Mesh(np.asarray(devices).reshape(shape), ("data", "model"),
              axis_types=(AxisType.Auto,) * 2)


def stage_specs(shapes):
  """Disjoint submeshes of the given (data, model) shapes, in device order; weights split
  over `model` on their output dim, batch and activations over `data`."""
  devs, out, i = jax.devices(), [], 0
  params = toy_params()
  specs = {"w_in": P(None, "model"), "layers": [{"w": P(None, "model"), "b": P("model")}] * L}
  assert len(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))) == len(
      jax.tree.leaves(params))
  for shape in shapes:
    n = shape[0] * shape[1]
    out.append(mpmd.StageSpec(submesh(devs[i:i + n], shape), specs,
                              {"x": P("data"), "y": P("data")}, P("data")))
    i += n
  return out


@functools.lru_cache(maxsize=None)
def toy_pipeline(cuts: tuple, shapes: tuple, schedule: Schedule) -> mpmd.Pipeline:
  """The toy's pipeline with markers after the layers in `cuts`, on submeshes of `shapes`,
  built once: the tests share its compiled programs (params enter by their shapes only)."""
  return mpmd.Pipeline(toy_loss(set(cuts)), toy_params(), microbatch_shapes(toy_batch(0)),
                       stage_specs(shapes), schedule)


TWO = ((2, 2), (4, 1))  # two submeshes of different shapes
FOUR = ((2, 1), (1, 2), (2, 1), (1, 2))


def reference(loss_fn, params, batch):
  """Loss and grads of the unsplit function with jax.grad on one device."""
  with jax.default_device(jax.devices()[0]):
    return jax.jit(jax.value_and_grad(loss_fn))(params, batch)


def check_run(pipeline, params, batch, rtol=1e-5):
  result = pipeline.run(pipeline.place(params), batch)
  want_loss, want = reference(toy_loss(()), params, batch)
  np.testing.assert_allclose(result.loss, want_loss, rtol=rtol)
  want = dict(zip(pipeline.paths, jax.tree.leaves(want)))
  for s, grads in enumerate(result.grads):
    assert set(grads) == set(pipeline.stage_keys[s])
    for k, g in grads.items():
      util.assert_close_f32(g, want[k], terms=B, rtol=rtol, err_msg=f"stage {s} {k}")
  return result


def test_two_submeshes_of_different_shapes_gpipe_and_1f1b():
  params, batch = toy_params(), toy_batch(0)
  for schedule, want_peak in ((gpipe(2, M), (M, M)), (one_f_one_b(2, M), (2, 1))):  # M; S - s
    pl = toy_pipeline((0,), TWO, schedule)
    assert pl.stage_keys[0] == ("['layers'][0]['b']", "['layers'][0]['w']", "['w_in']")
    assert pl.tied == {"['w_in']": (0, 1)}
    result = check_run(pl, params, batch)
    assert result.peak_residuals == want_peak
    measured_equals_simulated(result, schedule)
    # Grads live on their stage's submesh, split as asked; tied copies are equal.
    g0 = result.grads[0]["['w_in']"]
    assert g0.sharding.mesh == pl.stages[0].mesh and g0.sharding.spec == P(None, "model")
    np.testing.assert_array_equal(g0, result.grads[1]["['w_in']"])


def test_four_stages_1f1b_peaks_and_interleaved_v():
  params, batch = toy_params(1), toy_batch(1)
  pl = toy_pipeline((0, 1, 2), FOUR, one_f_one_b(4, M))
  result = check_run(pl, params, batch)
  assert result.peak_residuals == (4, 3, 2, 1)  # S - s
  measured_equals_simulated(result, pl.schedule)
  # Two stages x two chunks. Interleaved 1F1B ('loop' placement: stage 0 runs parts 0, 2).
  pl = toy_pipeline((0, 1, 2), TWO, interleaved_1f1b(2, M, 2))
  assert pl.part_stage == [0, 1, 0, 1] and pl.tied == {"['w_in']": (0, 1)}
  measured_equals_simulated(check_run(pl, params, batch), pl.schedule)
  # V placement: parts 0 and 3 (both use w_in) on stage 0, so nothing is tied across stages.
  pl = toy_pipeline((0, 1, 2), TWO, gpipe_v(2, M))
  assert pl.part_stage == [0, 1, 1, 0] and pl.tied == {}
  result = check_run(pl, params, batch)
  assert result.peak_residuals == (2 * M, 2 * M)
  measured_equals_simulated(result, pl.schedule)


def test_bad_configs_raise():
  params, batch = toy_params(), toy_batch(0)
  mb = microbatch_shapes(batch)
  specs = stage_specs([(2, 2), (4, 1)])
  with pytest.raises(ConfigError, match="3 stage_boundary markers, so 4 parts.*2 stages x 1"):
    mpmd.Pipeline(toy_loss({0, 1, 2}), params, mb, specs, gpipe(2, M))
  with pytest.raises(ConfigError, match="disjoint"):
    mpmd.Pipeline(toy_loss({0}), params, mb, [specs[0], specs[0]], gpipe(2, M))
  acts = gpipe(2, M).actions
  swapped = Schedule(2, M, (acts[0], acts[1][M:] + acts[1][:M]))  # B before F on stage 1
  with pytest.raises(ConfigError, match="stage 1, action B0: runs before F0"):
    mpmd.Pipeline(toy_loss({0}), params, mb, specs, swapped)
  missing = Schedule(2, M, (acts[0][1:], acts[1]))
  with pytest.raises(ConfigError, match="stage 0, action B0: runs before F0"):
    mpmd.Pipeline(toy_loss({0}), params, mb, specs, missing)


def test_aux_and_microbatch_weights():
  """loss = sum_m w[m] * loss_m, grads of that; aux comes back per microbatch."""
  params, batch = toy_params(2), toy_batch(2)
  base = toy_loss({0})

  def with_aux(p, b):
    return base(p, b), {"y2": (b["y"] ** 2).mean()}

  pl = mpmd.Pipeline(with_aux, params, microbatch_shapes(batch), stage_specs([(2, 2), (4, 1)]),
                     one_f_one_b(2, M), has_aux=True)
  w = np.asarray([0.1, 0.2, 0.3, 0.4], np.float32)
  result = pl.run(pl.place(params), batch, weights=w)
  mbs = [jax.tree.map(lambda x: x[m::M], batch) for m in range(M)]  # rows m, m + M, ...
  want_loss, want = reference(lambda p, b: sum(wm * base(p, mb) for wm, mb in zip(w, mbs)),
                              params, batch)
  np.testing.assert_allclose(result.loss, want_loss, rtol=1e-5)
  want = dict(zip(pl.paths, jax.tree.leaves(want)))
  for grads in result.grads:
    for k, g in grads.items():
      util.assert_close_f32(g, want[k], terms=B)
  np.testing.assert_allclose([a["y2"] for a in result.aux],
                             [(mb["y"] ** 2).mean() for mb in mbs], rtol=1e-6)


def assert_same_run(got, want, rtol=1e-5):
  """Same loss and grads; the stages may hold different leaves (tied copies are equal)."""
  np.testing.assert_allclose(got.loss, want.loss, rtol=rtol)
  merge = lambda result: {k: g for grads in result.grads for k, g in grads.items()}
  got, want = merge(got), merge(want)
  assert got.keys() == want.keys()
  for k in got:
    util.assert_close_f32(got[k], want[k], terms=B, rtol=rtol, err_msg=k)


def test_zb_h1_and_interleaved_equal_1f1b_with_simulated_peaks():
  """Every schedule gives 1F1B's loss and grads (rel 1e-5); the executor's per-stage peaks
  equal the simulator's: ZB-H1 releases a set at I (peak p - s, as 1F1B) and holds s + 1
  W stashes on stage s; compiled FLOPs of I + W stay within 1.05x of B."""
  params, batch = toy_params(3), toy_batch(3)
  want = check_run(toy_pipeline((0, 1, 2), FOUR, one_f_one_b(4, M)), params, batch)
  zb = toy_pipeline((0, 1, 2), FOUR, zb_h1(4, M))
  got = zb.run(zb.place(params), batch)
  assert_same_run(got, want)
  assert got.peak_residuals == (4, 3, 2, 1) and got.peak_stash == (1, 2, 3, 4)
  measured_equals_simulated(got, zb.schedule)
  flops = zb.backward_flops(zb.place(params), batch)
  assert sorted(flops) == [0, 1, 2, 3]
  for b, i, w in flops.values():
    assert w > 0 and i + w <= 1.05 * b, (b, i, w)
  for schedule in (gpipe(2, M), one_f_one_b(2, M), interleaved_1f1b(2, M, 2), zb_h1(2, M)):
    pl = toy_pipeline((0, 1, 2) if schedule.num_chunks == 2 else (0,), TWO, schedule)
    result = pl.run(pl.place(params), batch)
    assert_same_run(result, want)
    measured_equals_simulated(result, schedule)
