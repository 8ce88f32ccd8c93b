"""layers/lora.py: the adapters' params (names, shapes, splits, PEFT init), the effective
weight W + (alpha / r)·A·B, frozen bases (no gradient, no optimizer state, bitwise
unchanged) and 1 vs 8 devices."""
import re

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import lm
from spmdtask.core import train_state
from spmdtask.errors import ConfigError
from spmdtask.layers.lora import LoraConfig
from spmdtask.layers.transformer import TransformerLm
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.pipeline.spmd import PipelineConfig
from tests import util

ALL = ("q", "k", "v", "o", "wi", "wg", "wo")
SMALL = ["task.model.num_layers=2"]
DROPOUT = ["task.model.lora.dropout=0.1"]


def _model(**lora):
  cfg = LoraConfig(**{"rank": 4, "alpha": 8.0, "targets": ALL, **lora})
  return TransformerLm(vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=8, d_ff=24, lora=cfg)


def _batch(rows=2, seq=8):
  tokens = jax.random.randint(jax.random.key(1), (rows, seq + 1), 0, 32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "weights": jnp.ones((rows, seq), jnp.float32)}


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1),
                           ("data", "fsdp", "model"))


def _boxed(model):
  return model.init(jax.random.key(0), _batch(), method=model.loss)["params"]


def test_adapters_sit_beside_their_weights_split_as_the_contract_says():
  boxed = _boxed(_model(base_dtype="bfloat16"))
  attn, mlp = boxed["layers"]["block"]["attn"], boxed["layers"]["block"]["mlp"]
  # [layers, *in, r] and [layers, r, *out]; A takes the in-dims' entries, B the out-dims'.
  want = {"q": ((2, 16, 4), (2, 4, 2, 8)), "k": ((2, 16, 4), (2, 4, 1, 8)),
          "o": ((2, 2, 8, 4), (2, 4, 16))}
  for name, (a_shape, b_shape) in want.items():
    assert attn[f"{name}_lora_a"].value.shape == a_shape
    assert attn[f"{name}_lora_b"].value.shape == b_shape
  assert attn["q_lora_a"].names == (None, "fsdp", None)
  assert attn["q_lora_b"].names == (None, None, "model", None)
  assert attn["o_lora_a"].names == (None, "model", None, None)
  assert attn["o_lora_b"].names == (None, None, "fsdp")
  assert mlp["wo_lora_a"].names == (None, "model", None)
  assert mlp["wi_lora_b"].names == (None, None, "model")
  # Frozen params in base_dtype (norms stay float32), adapters float32.
  assert attn["q"].value.dtype == jnp.bfloat16 and boxed["embedding"].value.dtype == jnp.bfloat16
  assert boxed["final_norm"]["scale"].value.dtype == jnp.float32
  assert attn["q_lora_a"].value.dtype == jnp.float32
  # PEFT's init: B zero, A uniform within ±1/sqrt(fan_in), per layer its own draw.
  assert not np.any(np.asarray(attn["q_lora_b"].value))
  a = np.asarray(attn["o_lora_a"].value)
  assert np.abs(a).max() <= 1 / np.sqrt(2 * 8) and np.abs(a).max() > 0.8 / np.sqrt(2 * 8)
  assert not np.array_equal(a[0], a[1])


def test_the_adapter_adds_alpha_over_rank_times_a_b_to_the_weight():
  """Random adapters: the LoRA model's loss equals the plain model's with every targeted
  weight replaced by W + (alpha / r)·A·B (in-dims and out-dims flattened)."""
  model = _model(alpha=3.0)
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: jax.random.normal(jax.random.key(7), x.shape)
      if p[-1].key.endswith("_lora_b") else x, nn.unbox(_boxed(model)))
  merged = jax.tree.map(lambda x: x, params)  # new dicts, same arrays
  for mod, names in (("attn", ALL[:4]), ("mlp", ALL[4:])):
    sub = merged["layers"]["block"][mod]
    for n in names:
      a, b = sub.pop(f"{n}_lora_a"), sub.pop(f"{n}_lora_b")
      ab = jnp.einsum("lir,lro->lio", a.reshape(2, -1, 4), b.reshape(2, 4, -1))
      sub[n] = sub[n] + (3.0 / 4) * ab.reshape(sub[n].shape)
  batch = _batch()
  got = model.apply({"params": params}, batch, method=model.loss)[0]
  plain = model.clone(lora=None)
  want = plain.apply({"params": merged}, batch, method=plain.loss)[0]
  np.testing.assert_allclose(got, want, rtol=2e-6)


def test_frozen_weights_get_no_gradient_matmul():
  """The gradient of the loss reads the frozen weights but never forms their gradient: no
  dot in the compiled backward has an MLP weight's shape (the full model's has)."""
  def dots(model):
    params = jax.eval_shape(lambda: _boxed(model))
    params = jax.tree.map(lambda x: x.value, params, is_leaf=lambda x: hasattr(x, "names"))
    grad = jax.jit(jax.grad(lambda p, b: model.apply({"params": p}, b, method=model.loss)[0]))
    text = grad.lower(params, _batch(3, 5)).compile().as_text()  # 15 tokens: no 16 or 24
    return re.findall(r"= f32\[(\d+,\d+)\]\S* dot\(", text)
  assert "16,24" in dots(_model().clone(lora=None)) or "24,16" in dots(
      _model().clone(lora=None))
  lora = dots(_model())
  assert "16,24" not in lora and "24,16" not in lora


@pytest.mark.parametrize("field,value,match", [
    ("rank", 0, r"lora.rank=0"), ("alpha", 0.0, r"lora.alpha=0.0"),
    ("dropout", 1.0, r"lora.dropout=1.0"), ("targets", ("q", "experts"), r"'experts' matches no"),
    ("targets", ("query",), r"'query' matches no weight.*q, k, v, o, wi, wg, wo"),
    ("base_dtype", "float16", r"lora.base_dtype"),
])
def test_bad_lora_fields_are_config_errors(field, value, match):
  model = _model(**{field: value})
  with pytest.raises(ConfigError, match=match):
    model.validate(_mesh(), 2)


def test_a_gelu_mlp_has_no_wg_to_adapt():
  model = _model().clone(mlp_activation="gelu")
  with pytest.raises(ConfigError, match=r"'wg' matches no weight"):
    model.validate(_mesh(), 2)


def test_adapters_on_routed_experts_are_refused():
  from spmdtask.layers.moe import MoeConfig  # pylint: disable=g-import-not-at-top
  model = _model(targets=("q", "experts")).clone(moe=MoeConfig(num_experts=4, top_k=2, d_ff=8))
  with pytest.raises(ConfigError, match=r"'experts'\) are not built yet"):
    model.validate(_mesh(), 2)
  # The attention of an MoE model adapts; its routed experts have no dense 'wi'.
  moe = MoeConfig(num_experts=4, top_k=2, d_ff=8)
  _model(targets=("q", "o")).clone(moe=moe).validate(_mesh(), 2)
  with pytest.raises(ConfigError, match=r"'wi' matches no weight"):
    _model(targets=("wi",)).clone(moe=moe).validate(_mesh(), 2)


def test_trainable_mask_is_by_name():
  tree = {"a": {"q": 1, "q_lora_a": 2}, "x/y/wo_lora_b": 3, "x/y/wo": 4}
  assert train_state.trainable_mask(tree, True) == {
      "a": {"q": False, "q_lora_a": True}, "x/y/wo_lora_b": True, "x/y/wo": False}
  assert all(jax.tree.leaves(train_state.trainable_mask(tree, False)))


@pytest.fixture(scope="module")
def one_device():
  """TinyLmLora (2 layers, adapter dropout 0.1) trained 10 steps on one device, and its
  initial params."""
  one = util.train_steps("lm.TinyLmLora", 10, devices=jax.devices()[:1],
                         overrides=SMALL + DROPOUT)
  init = util.train_steps("lm.TinyLmLora", 0, devices=jax.devices()[:1],
                          overrides=SMALL + DROPOUT)[1]
  return one, init


def _split(params):
  mask = train_state.trainable_mask(params, True)
  pick = lambda want: jax.tree.map(lambda x, m: x if m == want else None, params, mask)
  return pick(True), pick(False)


def test_only_adapters_train_and_hold_optimizer_state(one_device):
  (losses, params, program, state), init = one_device
  adapters, base = _split(params)
  init_adapters, init_base = _split(init)
  # The base comes back bitwise; the adapters moved.
  jax.tree.map(np.testing.assert_array_equal, base, init_base)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(adapters),
                                                      jax.tree.leaves(init_adapters)))
  assert losses[-1] < losses[0]
  # Adam's moments for the adapters alone (2 x their size).
  n_adapters = sum(x.size for x in jax.tree.leaves(adapters))
  n_state = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
  assert n_state == 2 * n_adapters and n_adapters < 0.05 * sum(
      x.size for x in jax.tree.leaves(params))


@pytest.mark.parametrize("over", [
    ["task.ici_mesh_shape=(2, 2, 2)"],
    pytest.param(["task.ici_mesh_shape=(1, 8, 1)", "task.model.remat_policy='minimal'"],
                 marks=pytest.mark.slow),
    pytest.param(["task.ici_mesh_shape=(4, 1, 2)", "task.model.remat_policy='save_qkv_proj'"],
                 marks=pytest.mark.slow),
], ids=["fsdp_tp", "fsdp_remat_minimal", "tp_remat_qkv"])
def test_lora_on_8_devices_equals_one_device(one_device, over):
  got = util.train_steps("lm.TinyLmLora", 10, overrides=SMALL + DROPOUT + over)
  _assert_same_training(got, one_device[0])


def _assert_same_training(got, want):
  """Losses and adapters equal at float32 rounding; frozen params bitwise."""
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  adapters, base = _split(want[1])
  got_adapters, got_base = _split(got[1])
  util.assert_trees_close(got_adapters, adapters, terms=util.TINY_LM_TOKENS)
  jax.tree.map(np.testing.assert_array_equal, got_base, base)


def _pipelined(mesh, **pipeline):
  def edit(cfg):
    cfg.task.mesh_axis_names = ("stage", "data", "fsdp", "model")
    cfg.task.ici_mesh_shape = mesh
    cfg.task.pipeline = fdl.Config(PipelineConfig, **pipeline)
  return edit


@pytest.mark.slow
def test_lora_in_the_spmd_pipeline_equals_one_device(one_device):
  got = util.train_steps("lm.TinyLmLora", 10, overrides=SMALL + DROPOUT,
                         edit=_pipelined((2, 2, 1, 2), num_stages=2, num_microbatches=4))
  _assert_same_training(got, one_device[0])


@pytest.mark.slow
def test_lora_under_mpmd_and_a_context_axis_equals_one_device():
  """No adapter dropout: a context split reorders each row's tokens (zig-zag), so masks over
  positions differ from one device's; MPMD draws per microbatch."""
  def mpmd(cfg):
    cfg.task.pipeline = fdl.Config(MpmdConfig, layer_cuts=(1,),
                                   submesh_shapes=((2, 1, 2), (4, 1, 1)), schedule="1f1b",
                                   num_microbatches=4)

  def context(cfg):
    lm.with_context(cfg.task, (2, 1, 4, 1), "ring")
  want = util.train_steps("lm.TinyLmLora", 4, devices=jax.devices()[:1], overrides=SMALL)
  for edit in (mpmd, context):
    _assert_same_training(util.train_steps("lm.TinyLmLora", 4, overrides=SMALL, edit=edit),
                          want)


@pytest.mark.slow
def test_attention_lora_on_an_expert_parallel_moe_equals_one_device():
  """TinyMoe (8 experts over the `expert` axis of all 8 devices) with adapters on q, v, o:
  the router and experts frozen."""
  def lora(cfg):
    cfg.task.model.lora = fdl.Config(LoraConfig, rank=4, alpha=8.0, targets=("q", "v", "o"))
  want = util.train_steps("TinyMoe", 4, devices=jax.devices()[:1], edit=lora,
                          overrides=["task.ici_mesh_shape=(1, 1, 1, 1)"])
  _assert_same_training(util.train_steps("TinyMoe", 4, edit=lora), want)
