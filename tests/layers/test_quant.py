"""layers.quant: the quantized product's error bound, qwix's own results, FSDP's quantized
gathers (bytes in the compiled HLO) and 8 devices against 1."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from qwix._src.core import dot_general_qt, einsum_info

from spmdtask.errors import ConfigError
from spmdtask.layers import base, quant
from spmdtask.plan import hlo
from tests import util

EQN = "btd,dhk->bthk"
KEYS = jax.random.split(jax.random.key(0), 3)
X = jax.random.normal(KEYS[0], (16, 4, 64))
W = jax.random.normal(KEYS[1], (64, 2, 32)) * 0.1


def _step_error(a, absmax, kind):
  """The largest rounding error of a's quantized value: int8 half a step of absmax/127.5
  (qwix's symmetric bound); fp8 e4m3 half an ulp (2^-4 relative, 3 mantissa bits) or, among
  subnormals, half the smallest step (2^-10 of the scale, absmax / 448)."""
  if kind == "int8":
    return np.broadcast_to(absmax / 127.5 / 2, a.shape)
  return 2.0 ** -4 * np.abs(a) + 2.0 ** -10 * absmax / 448


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_error_within_the_quantizers_bound(kind):
  x, w = np.asarray(X, np.float64), np.asarray(W, np.float64)
  per_tensor = kind == "fp8"
  ax = np.max(np.abs(x)) if per_tensor else np.max(np.abs(x), axis=2, keepdims=True)
  aw = np.max(np.abs(w)) if per_tensor else np.max(np.abs(w), axis=0, keepdims=True)
  dx, dw = _step_error(x, ax, kind), _step_error(w, aw, kind)
  bound = (np.einsum(EQN, np.abs(x), dw) + np.einsum(EQN, dx, np.abs(w))
           + np.einsum(EQN, dx, dw))
  got = np.asarray(quant.Quantization(kind).einsum(EQN, X, W), np.float64)
  err = np.abs(got - np.einsum(EQN, x, w))
  assert np.all(err <= bound * (1 + 1e-5) + 1e-6), float(np.max(err / bound))
  assert np.max(err) > 0.05 * np.max(bound)  # it does quantize


def test_int8_equals_qwix_dot_general_qt():
  """Forward and both gradients as qwix's own quantized dot_general (AQT's scheme)."""
  cfg = dot_general_qt.DotGeneralQtConfig(lhs_qtype=jnp.int8, rhs_qtype=jnp.int8,
                                          dlhs_grad_qtype=jnp.int8, drhs_grad_qtype=jnp.int8)
  dims = einsum_info.EinsumInfo.parse(EQN).dimension_numbers
  ours = lambda x, w: quant.Quantization("int8").einsum(EQN, x, w)
  theirs = lambda x, w: dot_general_qt.dot_general_qt(x, w, dims, cfg)
  for f, g in ((ours, theirs),
               (jax.grad(lambda x, w: jnp.sum(ours(x, w) ** 2), (0, 1)),
                jax.grad(lambda x, w: jnp.sum(theirs(x, w) ** 2), (0, 1)))):
    util.assert_trees_close(f(X, W), g(X, W))


def test_fields_config_errors():
  assert quant.from_fields(None) is None
  with pytest.raises(ConfigError, match="model.quantization="):
    quant.from_fields("int4")
  with pytest.raises(ConfigError, match="model.quantization_scaling="):
    quant.from_fields("fp8", "delayed")


def _fsdp(kind, eqn, w, w_split, mesh_shape, at_once=False):
  """(y, dx, dw) of base.project on 1 device and jitted on a mesh of 8, and the latter's
  compiled train HLO."""
  q = quant.Quantization(kind) if kind else None
  x = jax.random.normal(KEYS[2], (16, 4) + w.shape[:eqn.index(",") - 2])
  batch = (("fsdp", "fsdp_b"), None, None)
  f = lambda x, w: base.project(eqn, x, w, w_split, batch, jnp.float32, at_once=at_once,
                                quant=q)
  vg = jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) ** 2), (0, 1))
  mesh = jax.make_mesh(mesh_shape, ("fsdp", "fsdp_b"), axis_types=(AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P(("fsdp", "fsdp_b"))))
    ws = jax.device_put(w, NamedSharding(mesh, P(*w_split)))
    compiled = jax.jit(vg).lower(xs, ws).compile()
    got = (jax.jit(f)(xs, ws), compiled(xs, ws)[1])
  return (f(x, w), vg(x, w)[1]), got, compiled.as_text()


@pytest.mark.parametrize("kind,eqn,w_split,mesh_shape,at_once", [
    ("int8", EQN, (("fsdp", "fsdp_b"), None, None), (2, 4), False),  # contracted dim split
    ("int8", "bthk,hkd->btd", (None, None, ("fsdp", "fsdp_b")), (4, 2), True),  # channels
    ("fp8", EQN, (("fsdp", "fsdp_b"), None, None), (8, 1), False),  # one scale per tensor
])
def test_fsdp_equals_one_device(kind, eqn, w_split, mesh_shape, at_once):
  w = W if eqn == EQN else jnp.reshape(W, (2, 32, 64))
  want, got, _ = _fsdp(kind, eqn, w, w_split, mesh_shape, at_once)
  # The same quantized values: int8 products are exact, fp8's sum in float32.
  util.assert_trees_close(got, want, terms=64)


def test_fsdp_gathers_quantized_weights():
  """The train step's all-gathers move int8 (XLA:CPU's float path moves float32): a quarter
  of the bytes, plus the per-channel scales where the channel dim is split."""
  w_split = (("fsdp", "fsdp_b"), None, None)
  gathered = {}
  for kind in (None, "int8"):
    text = _fsdp(kind, EQN, W, w_split, (2, 4))[2]
    gathered[kind] = hlo.collectives(text)["all-gather"]["bytes"]
  assert gathered[None] > 0
  assert gathered["int8"] <= 0.26 * gathered[None], gathered



def _mesh(task) -> jax.sharding.Mesh:
  shape = list(task.ici_mesh_shape)
  if -1 in shape:
    shape[shape.index(-1)] = 8 // -int(np.prod(shape))
  return jax.make_mesh(tuple(shape), task.mesh_axis_names,
                       axis_types=(AxisType.Auto,) * len(shape))


@pytest.mark.slow
@pytest.mark.parametrize("exp", ["TinyLmContext"])  # (TinyMoe too, measured once: suite time)
def test_composes_with_moe_and_context(exp):
  """int8 TinyMoe (experts split over 8 devices, quantized shared expert) and TinyLmContext
  (sequence split over 4): the loss at init on the experiment's 8-device mesh as on one
  device, up to what quantization makes of float32 rounding order: weights moved by 1e-7
  relative move TinyLm's int8 loss by 2.4e-4 (docs/quantization.md), and a flipped int8
  step can flip an MoE's top-k choice (measured 7e-4 and 3.7e-3 under other XLA flags), so
  to 1e-2, not 1e-5: this shows the layouts compose; the equality is the layer tests'."""
  run = util.build_run(exp, ["task.model.quantization='int8'"])
  model = run.task.model
  batch = jax.tree.map(jnp.asarray, dict(run.datasets["train"].batch_at(0)))
  params = jax.jit(lambda b: model.init(jax.random.key(0), b, method=model.loss))(batch)
  loss = lambda p, b: model.apply(p, b, method=model.loss)[0]
  one = jax.jit(loss)(params, batch)
  with jax.set_mesh(_mesh(run.task)):
    many = jax.jit(loss)(params, batch)
  assert abs(float(many) - float(one)) < 1e-2, (float(many), float(one))


def test_the_model_field_quantizes():
  """`task.model.quantization` reaches the blocks: TinyLm's int8 loss at init moves off the
  float loss (by more than float32 noise, less than the quantizer's error could), and the
  jaxprs hold int8 and fp8 dots. (A merge once left the field unread: every run was float.)"""
  losses = {}
  for q in (None, "int8", "fp8"):
    run = util.build_run("TinyLm", [f"task.model.quantization={q!r}"])
    model = run.task.model
    batch = jax.tree.map(jnp.asarray, dict(run.datasets["train"].batch_at(0)))
    params = model.init(jax.random.key(0), batch, method=model.loss)
    fn = lambda p, b, m=model: m.apply(p, b, method=m.loss)[0]
    text = str(jax.make_jaxpr(fn)(params, batch))
    assert ("i8[" in text) == (q == "int8") and ("f8_e4m3fn[" in text) == (q == "fp8"), q
    if q != "fp8":  # (fp8's numbers are the layer tests')
      losses[q] = float(jax.jit(fn)(params, batch))
  assert 1e-6 < abs(losses["int8"] - losses[None]) < 5e-2, losses
