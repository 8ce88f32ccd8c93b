"""Fused attention: splash (the Pallas kernel, interpret mode on CPU) equals xla, forward and
gradients, alone and through a sharded model; `auto` picks per backend; a choice that
cannot run is a ConfigError naming task.model.attention_impl."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spmdtask.core import program as program_lib, sharding
from spmdtask.errors import ConfigError
from spmdtask.layers.attention import fused as fa
from spmdtask.layers.attention.mha import attend
from spmdtask.layers.transformer import TransformerLm
from tests import util

TOL = dict(rtol=1e-5, atol=1e-5)


def _packed(b: int, t: int, cuts=(0, 37, 130, 131)):
  """Segment ids and per-segment positions of rows packed with documents starting at `cuts`."""
  starts = np.zeros(t, np.int32)
  starts[list(cuts)] = 1
  seg = np.cumsum(starts)
  pos = np.arange(t) - np.asarray(cuts)[seg - 1]
  return (jnp.asarray(np.broadcast_to(seg, (b, t))), jnp.asarray(np.broadcast_to(pos, (b, t))))


@pytest.mark.parametrize("causal,packed,kv_heads", [
    (True, False, 2),   # causal, grouped KV heads (2 query heads per KV head)
    (True, True, 2),    # packed rows: segment ids, positions restarting per segment
    (False, False, 4),  # an encoder (ViT): full mask, one KV head per query head
])
def test_splash_matches_xla_forward_and_grads(causal, packed, kv_heads):
  b, t, h, hd = 2, 256, 4, 64
  kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (b, t, h, hd))
  k, v = (jax.random.normal(key, (b, t, kv_heads, hd)) for key in (kk, kv))
  cot = jax.random.normal(kc, (b, t, h, hd))
  seg, pos = _packed(b, t) if packed else (None, jnp.broadcast_to(jnp.arange(t), (b, t)))

  def xla(q, k, v):
    return attend(q, k, v, pos, pos, causal, seg, seg)

  # Block 128 on t 256: a 2 x 2 grid, so the causal kernel skips the block above the diagonal.
  splash = functools.partial(fa.splash, segment_ids=seg, causal=causal, heads_split=None,
                             interpret=True, block=128)
  out_ref, vjp_ref = jax.vjp(xla, q, k, v)
  out, vjp = jax.jit(lambda *a: jax.vjp(splash, *a))(q, k, v)
  np.testing.assert_allclose(out, out_ref, **TOL)
  for got, want in zip(vjp(cot), vjp_ref(cot)):
    np.testing.assert_allclose(got, want, **TOL)


def _model_loss_and_grads(impl: str, mesh_shape, devices, packed: bool):
  run = util.build_run("lm.TinyLm", [
      f"task.model.attention_impl='{impl}'", f"task.ici_mesh_shape={mesh_shape}",
      "task.model.num_layers=2", "datasets['train'].seq_len=128",
      "datasets['train'].batch_size=4"])
  batch = run.datasets["train"].batch_at(0)
  if packed:
    seg, pos = _packed(4, 128, cuts=(0, 50, 51, 100))
    batch = dict(batch, segment_ids=np.asarray(seg), positions=np.asarray(pos))
  program = program_lib.setup(run.task, batch, devices=devices)
  params = sharding.unpad(program.init().params, program.layout.logical.params)
  model = program.model

  def loss(p, b):
    return model.apply({"params": p}, b, method=model.loss)[0]

  with jax.set_mesh(program.mesh):
    value, grads = jax.jit(jax.value_and_grad(loss))(params, batch)
  return jax.device_get((value, grads))


@pytest.mark.parametrize("mesh_shape,packed", [
    ((2, 2, 2), False),  # data 2 x fsdp 2 x model 2: 2 query and 1 KV head per device
    ((2, 1, 4), True),   # model 4 > 2 KV heads: KV heads repeated per query head; packed rows
])
def test_sharded_model_with_splash_matches_one_device_xla(mesh_shape, packed):
  want = _model_loss_and_grads("xla", (1, 1, 1), jax.devices()[:1], packed)
  got = _model_loss_and_grads("splash", mesh_shape, jax.devices(), packed)
  np.testing.assert_allclose(got[0], want[0], **TOL)
  util.assert_trees_close(got[1], want[1], **TOL)


def test_decoding_with_a_cache_uses_xla_whatever_the_impl():
  kwargs = dict(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=16, d_ff=64)
  xla, splash = (TransformerLm(**kwargs, attention_impl=i) for i in ("xla", "splash"))
  tokens = jnp.ones((1, 5), jnp.int32)  # 5 tokens: no splash shape, so splash would refuse
  params = xla.init(jax.random.key(0), tokens)["params"]
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), xla.cache_shape(1, 8))
  pos = jnp.arange(5)[None]
  want, _ = xla.apply({"params": params}, tokens, pos, cache)
  got, _ = splash.apply({"params": params}, tokens, pos, cache)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl,backend,seq,dtype,segments,want", [
    ("auto", "cpu", 256, "float32", False, "xla"),
    ("auto", "cpu", 256, "bfloat16", False, "xla"),
    ("auto", "tpu", 8192, "bfloat16", True, "splash"),
    ("auto", "tpu", 100, "bfloat16", False, "xla"),      # not a multiple of 128
    ("auto", "gpu", 256, "bfloat16", False, "cudnn"),
    ("auto", "gpu", 256, "float32", False, "xla"),       # cuDNN wants bf16 / fp16
    ("auto", "gpu", 256, "bfloat16", True, "cudnn"),     # packed rows: their mask as a bias
    ("splash", "cpu", 256, "float32", False, "splash"),  # interpret mode
    ("xla", "tpu", 256, "bfloat16", False, "xla"),
])
def test_auto_resolves_per_backend(impl, backend, seq, dtype, segments, want):
  heads = (("data", "fsdp"), None, "model", None)
  mesh = {"data": 2, "fsdp": 2, "model": 2}
  assert fa.choose(impl, backend, seq, 8, 128, jnp.dtype(dtype), segments, heads, mesh) == want


@pytest.mark.parametrize("seq,head_dim,dtype,packed,cc,want", [
    (8192, 128, "bfloat16", False, (9, 0), None),
    (8192, 256, "bfloat16", False, (9, 0), None),           # Hopper: head_dim up to 256
    (8192, 256, "bfloat16", False, (8, 0), "at most 128"),  # an A100: up to 128
    (8192, 100, "float16", False, (9, 0), "multiple of 8"),
    (8192, 64, "float32", False, (9, 0), "bfloat16 or float16"),
    (8191, 64, "bfloat16", True, (9, 0), "even sequence length (8191)"),
    (8191, 64, "bfloat16", False, (8, 0), None),            # unpacked: any length
    (8192, 64, "bfloat16", False, None, "cuDNN library is not installed"),
])
def test_cudnn_refusals_fall_back_to_xla(seq, head_dim, dtype, packed, cc, want):
  """The shapes JAX's cuDNN wrapper refuses go to xla under auto, and are a ConfigError
  when cudnn is asked for by name; the choice is pure (no GPU needed)."""
  problem = fa.cudnn_problem(seq, head_dim, jnp.dtype(dtype), packed, cc)
  assert (problem is None) == (want is None) and (want is None or want in problem), problem
  args = ("gpu", seq, 8, head_dim, jnp.dtype(dtype), packed, None, {}, cc)
  assert fa.choose("auto", *args) == ("cudnn" if want is None else "xla")
  if want is not None:
    with pytest.raises(ConfigError, match=f"attention_impl=.cudnn. cannot run here: .*{re.escape(want)}"):
      fa.choose("cudnn", *args)


def test_auto_falls_back_to_xla_where_heads_do_not_divide_the_mesh():
  heads = (("data", "fsdp"), None, "model", None)
  mesh = {"data": 1, "fsdp": 1, "model": 3}
  assert fa.choose("auto", "tpu", 256, 8, 128, jnp.bfloat16, False, heads, mesh) == "xla"
  with pytest.raises(ConfigError, match="num_heads=8 does not divide over the 3 shards"):
    fa.choose("splash", "tpu", 256, 8, 128, jnp.bfloat16, False, heads, mesh)


@pytest.mark.parametrize("impl,backend,seq,heads,needles", [
    ("flash", "cpu", 256, None, ["attention_impl='flash'", "auto, xla, splash, cudnn"]),
    ("cudnn", "cpu", 256, None, ["attention_impl='cudnn'", "GPU", "'cpu'"]),
    ("cudnn", "tpu", 256, None, ["attention_impl='cudnn'", "GPU", "'tpu'"]),
    ("splash", "gpu", 256, None, ["attention_impl='splash'", "cudnn"]),
    ("splash", "tpu", 200, None, ["attention_impl='splash'", "200", "multiple of 128"]),
    ("splash", "tpu", 256, (None, "model", None, None), ["activation_split_dims_mapping.heads"]),
])
def test_a_choice_that_cannot_run_is_a_config_error(impl, backend, seq, heads, needles):
  with pytest.raises(ConfigError) as err:
    fa.choose(impl, backend, seq, 8, 128, jnp.bfloat16, False, heads, {"model": 1})
  for needle in needles:
    assert needle in str(err.value), str(err.value)
  assert "task.model.attention_impl" in str(err.value)


def test_splash_inside_a_region_already_manual_over_the_batch_axis():
  """MPMD runs a stage's part under a shard_map manual over its data axes: splash then
  splits only over the axes left (here heads over 'model'), and equals xla."""
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  b, t, h, hd = 4, 256, 4, 64
  q, k, v = (jax.random.normal(key, (b, t, h, hd)) for key in jax.random.split(jax.random.key(1), 3))
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  want = attend(q, k, v, pos, pos, True, None, None)
  split = ("data", None, "model", None)

  def per_data_shard(q, k, v):
    return fa.splash(q, k, v, None, True, split, interpret=True, block=128)

  with jax.set_mesh(mesh):
    got = jax.jit(jax.shard_map(per_data_shard, in_specs=(P("data"),) * 3, out_specs=P("data"),
                                axis_names={"data"}))(q, k, v)
  np.testing.assert_allclose(got, want, **TOL)
