"""Tests for spmdtask.pipeline: pipelined == sequential, no bubble leaks, real stage sharding."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from spmdtask.pipeline import spmd as pl
from spmdtask.errors import ConfigError

D, F, MB = 8, 16, 4  # model dim, hidden dim, examples per microbatch
AXES = ("stage", "data", "model")


def layer(p, h, *bargs):
  h = h + jnp.tanh(h @ p["w1"]) @ p["w2"]
  for b in bargs:
    h = h * b
  return h


def sequential(params, x, *bargs):
  """Reference: a plain scan over the [L, ...] stack, one device."""
  return jax.lax.scan(lambda h, p: (layer(p, h, *bargs), None), x, params)[0]


def make_mesh(shape):
  return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def make_inputs(num_layers, batch, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  params = {
      "w1": jax.random.normal(k1, (num_layers, D, F)) / np.sqrt(D),
      "w2": jax.random.normal(k2, (num_layers, F, D)) / np.sqrt(F),
  }
  return params, jax.random.normal(k3, (batch, D))


def place(mesh, stage_params, x):
  """Stage dim over 'stage', the hidden dim over 'model', the batch over 'data'."""
  specs = {"w1": pl.stage_spec((None, "model")), "w2": pl.stage_spec(("model", None))}
  sp = jax.device_put(stage_params, {k: NamedSharding(mesh, s) for k, s in specs.items()})
  return sp, jax.device_put(x, NamedSharding(mesh, P("data")))


def assert_close(actual, expected, rel=1e-5):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, e = np.asarray(a), np.asarray(e)
    assert a.shape == e.shape
    assert np.all(np.isfinite(a))
    err = np.max(np.abs(a - e))
    assert err <= rel * np.max(np.abs(e)), (err, np.max(np.abs(e)))


def check_against_sequential(mesh_shape, cfg, num_layers, batch, bubble_fill=None, bargs=()):
  mesh = make_mesh(mesh_shape)
  params, x = make_inputs(num_layers, batch)
  sp, xd = place(mesh, pl.to_stages(params, cfg.num_stages, cfg.circular_repeat), x)

  def loss_pp(sp, x):
    y = pl.pipeline_apply(
        layer, sp, x, mesh=mesh, config=cfg, broadcast_args=bargs, _bubble_fill=bubble_fill
    )
    return jnp.sum(y**2), y

  def loss_seq(params, x):
    y = sequential(params, x, *bargs)
    return jnp.sum(y**2), y

  grad_pp = jax.jit(jax.value_and_grad(loss_pp, argnums=(0, 1), has_aux=True))
  (l_pp, y_pp), (g_pp, gx_pp) = grad_pp(sp, xd)
  grad_pp(sp, xd)
  assert grad_pp._cache_size() == 1  # a second call does not recompile
  (l_s, y_s), (g_s, gx_s) = jax.value_and_grad(loss_seq, argnums=(0, 1), has_aux=True)(params, x)
  assert_close(y_pp, y_s)
  assert_close(l_pp, l_s)
  assert_close(pl.from_stages(g_pp), g_s)
  assert_close(gx_pp, gx_s)


def test_to_stages_layout_and_inverse():
  s, r, lps = 2, 3, 2
  stack = jnp.arange(s * r * lps)
  staged = pl.to_stages(stack, s, r)
  assert staged.shape == (s, r, lps)
  for si in range(s):
    for ri in range(r):
      for j in range(lps):
        assert staged[si, ri, j] == (ri * s + si) * lps + j
  np.testing.assert_array_equal(pl.from_stages(staged), stack)


@pytest.mark.parametrize(
    "mesh_shape,s,r,m",
    [
        ((2, 2, 2), 2, 1, 4),  # GPipe, data + model parallel inside each stage
        ((4, 2, 1), 4, 1, 4),  # GPipe
        ((2, 2, 2), 2, 3, 5),  # circular, M > S: microbatches wait in the ring buffer
        ((4, 1, 2), 4, 2, 4),  # circular, M == S: direct loop back
        ((4, 2, 1), 4, 2, 8),  # circular, M > S
    ],
)
def test_matches_sequential_with_nan_bubbles(mesh_shape, s, r, m):
  """All internal buffers start as NaN; outputs and grads stay finite and exact."""
  cfg = pl.PipelineConfig(num_stages=s, num_microbatches=m, circular_repeat=r)
  check_against_sequential(mesh_shape, cfg, num_layers=2 * s * r, batch=m * MB,
                           bubble_fill=jnp.nan)


def test_microbatch_size_broadcast_args_no_remat_unrolled():
  cfg = pl.PipelineConfig(
      num_stages=2, microbatch_size=MB, circular_repeat=2, remat_policy=None, unroll=True
  )
  scale = jnp.linspace(0.5, 1.5, D)
  check_against_sequential((2, 2, 2), cfg, num_layers=4, batch=3 * MB, bargs=(scale,))


def _replica_groups(line):
  """Device groups of a collective, from either HLO replica_groups syntax."""
  m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
  if m:
    return [
        [int(v) for v in g.split(",") if v.strip()]
        for g in re.findall(r"\{([\d, ]*)\}", m.group(1))
    ]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    ids = np.arange(int(np.prod([int(v) for v in m.group(3).split(",")])))
    ids = ids.reshape([int(v) for v in m.group(3).split(",")])
    if m.group(4):
      ids = ids.transpose([int(v) for v in m.group(4).split(",")])
    return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
  return None


def test_stage_sharding_is_real():
  s, r, lps, m = 2, 2, 3, 4
  mesh = make_mesh((2, 2, 2))
  cfg = pl.PipelineConfig(num_stages=s, num_microbatches=m, circular_repeat=r)
  params, x = make_inputs(s * r * lps, m * MB)
  sp, xd = place(mesh, pl.to_stages(params, s, r), x)
  for leaf in jax.tree.leaves(sp):
    for shard in leaf.addressable_shards:
      assert shard.data.shape[0] == 1  # each device holds only its own stage

  def loss(sp, x):
    return jnp.sum(pl.pipeline_apply(layer, sp, x, mesh=mesh, config=cfg) ** 2)

  hlo = jax.jit(jax.grad(loss)).lower(sp, xd).compile().as_text()
  assert "collective-permute" in hlo
  # Devices of stage i: the mesh's devices[i]. A collective whose group spans two
  # stages moves data across stages.
  stage_of = {d.id: i for i, row in enumerate(mesh.devices) for d in row.flat}
  for line in hlo.splitlines():
    if " all-gather(" in line or " all-gather-start(" in line:
      groups = _replica_groups(line)
      assert groups is not None, line
      for g in groups:
        assert len({stage_of[d] for d in g}) == 1, f"all-gather over stages: {line}"
  # No instruction materializes a full [S, R, Lps, ...] weight on one device.
  assert not re.search(rf"\[{s},{r},{lps},", hlo)
  assert re.search(rf"\[1,{r},{lps},", hlo)  # ...while per-stage weights do appear


def _cfg(**kw):
  return pl.PipelineConfig(**{"num_stages": 2, "num_microbatches": 4, **kw})


@pytest.mark.parametrize(
    "cfg,num_layers,batch,mesh_shape,axes,field",
    [
        (_cfg(), 5, 8, (2, 4), ("stage", "data"), "model.num_layers"),
        (
            _cfg(circular_repeat=2),
            6,
            8,
            (2, 4),
            ("stage", "data"),
            "task.pipeline.circular_repeat",
        ),
        (
            _cfg(num_stages=4, circular_repeat=2, num_microbatches=2),
            8,
            8,
            (4, 2),
            ("stage", "data"),
            "task.pipeline.num_microbatches",
        ),
        (
            _cfg(num_microbatches=3),
            4,
            8,
            (2, 4),
            ("stage", "data"),
            "task.pipeline.num_microbatches",
        ),
        (
            _cfg(num_microbatches=None, microbatch_size=3),
            4,
            8,
            (2, 4),
            ("stage", "data"),
            "task.pipeline.microbatch_size",
        ),
        (
            _cfg(microbatch_size=2),
            4,
            8,
            (2, 4),
            ("stage", "data"),
            "task.pipeline.microbatch_size",
        ),
        (_cfg(num_stages=4), 4, 8, (2, 4), ("stage", "data"), "task.ici_mesh_shape"),
        (_cfg(), 4, 8, (8,), ("data",), "task.mesh_axis_names"),
        (
            _cfg(remat_policy="no_such_policy"),
            4,
            8,
            (2, 4),
            ("stage", "data"),
            "task.pipeline.remat_policy",
        ),
    ],
)
def test_config_errors_name_the_field(cfg, num_layers, batch, mesh_shape, axes, field):
  mesh = jax.make_mesh(mesh_shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  with pytest.raises(ConfigError, match=re.escape(field)) as e:
    pl.validate(cfg, num_layers=num_layers, batch_size=batch, mesh=mesh)
  assert "\n" not in str(e.value)


def test_pipeline_apply_rejects_wrong_weight_layout():
  mesh = make_mesh((2, 2, 2))
  params, x = make_inputs(4, 8)
  with pytest.raises(ConfigError, match="task.pipeline.circular_repeat"):
    pl.pipeline_apply(
        layer, pl.to_stages(params, 2, 1), x, mesh=mesh, config=_cfg(circular_repeat=2)
    )
