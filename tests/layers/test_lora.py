"""layers/lora.py: the adapters' params (names, shapes, splits, PEFT init), the effective
weight W + (alpha / r)·A·B, frozen bases (no gradient, no optimizer state, bitwise
unchanged) and 1 vs 8 devices; the same for an MoE's routed experts (target `experts`)."""
import re

import fiddle as fdl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import deepseek, lm
from spmdtask.core import sharding, train_state
from spmdtask.errors import ConfigError
from spmdtask.layers.lora import LoraConfig
from spmdtask.layers.transformer import TransformerLm
from spmdtask.pipeline.mpmd.config import MpmdConfig
from spmdtask.pipeline.spmd import PipelineConfig
from tests import util

ALL = ("q", "k", "v", "o", "wi", "wg", "wo")
SMALL = ["task.model.num_layers=2"]
# Training steps of the 1 vs 8 devices checks: the warmup's first step moves nothing (lr 0),
# so 4 steps are 3 updates, the last 2 from moments of steps that used the adapters.
STEPS = 4
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
    ("dropout", 1.0, r"lora.dropout=1.0"),
    ("targets", ("q", "experts"), r"lora.targets=\('q', 'experts'\): 'experts' matches no"),
    ("targets", ("query",), r"'query' matches no weight.*q, k, v, o, wi, wg, wo"),
    ("base_dtype", "float16", r"lora.base_dtype"),
])
def test_bad_lora_fields_are_config_errors(field, value, match):
  model = _model(**{field: value})
  with pytest.raises(ConfigError, match=match):
    model.validate(_mesh(), 2)


def test_a_rank_above_a_targets_smaller_dim_is_refused():
  """k [16 in, 1 x 8 out]: rank 8 fits, 9 does not; MLA's kv_up [16 latent, ...] alike."""
  _model(rank=8).validate(_mesh(), 2)
  with pytest.raises(ConfigError, match=r"lora.rank=9: rank 9 > 8, the smaller dim of k in "
                     r"this model \(16 in x 8 out\).*rank <= 8"):
    _model(rank=9).validate(_mesh(), 2)
  model = _mla_model(32, ("kv_up",))
  with pytest.raises(ConfigError, match=r"rank 20 > 16, the smaller dim of kv_up"):
    model.clone(lora=LoraConfig(rank=20, alpha=1.0, targets=("kv_up",))).validate(_mesh(), 2)


def test_a_gelu_mlp_has_no_wg_to_adapt_a_gated_one_has():
  model = _model().clone(mlp_activation="gelu")
  with pytest.raises(ConfigError, match=r"'wg' matches no weight"):
    model.validate(_mesh(), 2)
  _model().clone(mlp_activation="geglu").validate(_mesh(), 2)  # Gemma's gate


def _mla_model(q_lora_rank, targets):
  """tiny_v3's MLA (3 dense layers) with LoRA adapters on `targets`."""
  cfg = deepseek.tiny_v3(vocab_size=32)
  cfg.mla.q_lora_rank = q_lora_rank
  cfg.moe, cfg.remat_policy = None, None
  cfg.lora = fdl.Config(LoraConfig, rank=4, alpha=3.0, targets=targets)
  return fdl.build(cfg)


MLA_V3 = ("q_down", "q_up", "kv_down", "kv_up", "o")


@pytest.mark.parametrize("q_lora_rank,targets,match", [
    (None, ("q_down",), r"'q_down' matches no weight of this model.*q, kv_down, kv_up, o"),
    (32, ("q",), r"'q' matches no weight.*q_down, q_up, kv_down, kv_up, o"),
    (32, ("k",), r"'k' matches no weight"),
])
def test_mla_targets_are_its_own_projections(q_lora_rank, targets, match):
  with pytest.raises(ConfigError, match=match):
    _mla_model(q_lora_rank, targets).validate(_mesh(), 2)


def _with_random_b(boxed):
  return jax.tree_util.tree_map_with_path(
      lambda p, x: 0.3 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
      if p[-1].key.endswith("_lora_b") else x, nn.unbox(boxed))


def _merged(params, scale):
  """Every adapted weight W + scale·A·B (in-dims, out-dims flattened; experts per expert)
  and the adapters dropped: a plain model's params."""
  def walk(tree):
    out = {k: walk(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for key in [k for k in out if k.endswith("_lora_a")]:
      name = key.removesuffix("_lora_a")
      a, b, w = out.pop(key), out.pop(name + "_lora_b"), out[name]
      n_lead = 2 if name in ("wi", "wg", "wo") and w.ndim == 4 else 1  # [L, E, ...] experts
      r = a.shape[-1]
      a2 = a.reshape(*a.shape[:n_lead], -1, r)
      b2 = b.reshape(*b.shape[:n_lead], r, -1)
      ab = jnp.einsum("...ir,...ro->...io", a2, b2)
      out[name] = w + scale * ab.reshape(w.shape)
    return out
  return walk(params)


def test_mla_adapters_add_alpha_over_rank_times_a_b_and_decode_absorbs_them():
  """Random adapters on MLA's projections and the MLPs: the LoRA model's logits equal the
  plain model's with each targeted W + (alpha / r)·A·B, over a full forward and through
  the latent cache (kv_up absorbed). (V2's direct q: the deepseek_v2 PEFT fixture,
  tests/hf; routed experts: the MoE test above.)"""
  model = _mla_model(32, MLA_V3 + ("wi", "wg", "wo"))
  tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, 32)
  boxed = model.init(jax.random.key(0), tokens)["params"]
  attn = boxed["layers"]["block"]["attn"]
  assert attn["kv_up_lora_a"].value.shape == (3, 16, 4)  # [L, kv_lora_rank, r]
  assert attn["kv_up_lora_b"].value.shape[1:] == (4, 4, 16)  # [r, h, nope + v]
  assert attn["kv_up_lora_b"].names == (None, None, "model", None)
  assert attn["o_lora_a"].value.shape[1:] == (4, 8, 4)  # [h, v, r]
  assert not np.any(np.asarray(attn["kv_down_lora_b"].value))
  params = _with_random_b(boxed)
  plain = model.clone(lora=None)
  merged = _merged(params, 3.0 / 4)
  lora_apply = jax.jit(lambda p: model.apply({"params": p}, tokens))
  got, want = lora_apply(params), jax.jit(lambda p: plain.apply({"params": p}, tokens))(merged)
  assert float(jnp.abs(got - lora_apply(nn.unbox(boxed))).max()) > 0.1  # adapters matter
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), model.cache_shape(2, 6))
  cached, _ = jax.jit(lambda p, t, c: model.apply(
      {"params": p}, t, jnp.broadcast_to(jnp.arange(6), (2, 6)), c))(params, tokens, cache)
  np.testing.assert_allclose(cached, want, rtol=1e-5, atol=2e-5)


def test_experts_are_a_target_of_moe_models_only():
  from spmdtask.layers.moe import MoeConfig  # pylint: disable=g-import-not-at-top
  moe = MoeConfig(num_experts=4, top_k=2, d_ff=8)
  _model(targets=("q", "experts")).clone(moe=moe).validate(_mesh(), 2)
  with pytest.raises(ConfigError, match=r"task.model.lora.targets=.*'experts' matches no"):
    _model(targets=("experts",)).validate(_mesh(), 2)
  # An MoE's routed experts have no dense 'wi' (only a shared expert or dense layer would).
  with pytest.raises(ConfigError, match=r"'wi' matches no weight"):
    _model(targets=("wi",)).clone(moe=moe).validate(_mesh(), 2)


@pytest.mark.parametrize("dispatch,ff_chunks", [("dropless", 1), ("capacity", 2)])
def test_expert_adapters_add_alpha_over_rank_times_a_b_per_expert(dispatch, ff_chunks):
  """Random adapters on the routed experts (and q): the LoRA MoE's loss equals the plain
  MoE's with each expert's W_e + (alpha / r)·A_e·B_e; A [L, e, in, r], B [L, e, r, out]
  split as W's expert, in and out entries."""
  from spmdtask.layers.moe import MoeConfig  # pylint: disable=g-import-not-at-top
  moe = MoeConfig(num_experts=4, top_k=2, d_ff=8, dispatch=dispatch, ff_chunks=ff_chunks,
                  capacity_factor=0.75)  # capacity: some assignments dropped
  model = _model(alpha=3.0, targets=("q", "experts")).clone(moe=moe)
  boxed = _boxed(model)
  experts = boxed["layers"]["block"]["moe"]
  assert experts["wi_lora_a"].value.shape == (2, 4, 16, 4)
  assert experts["wi_lora_a"].names == (None, None, "fsdp", None)
  assert experts["wg_lora_b"].value.shape == (2, 4, 4, 8)
  assert experts["wg_lora_b"].names == (None, None, None, "model")
  assert experts["wo_lora_a"].names == (None, None, "model", None)
  assert experts["wo_lora_b"].names == (None, None, None, "fsdp")
  assert not np.any(np.asarray(experts["wo_lora_b"].value))
  a = np.asarray(experts["wo_lora_a"].value)  # fan_in: d_ff
  assert np.abs(a).max() <= 1 / np.sqrt(8) and not np.array_equal(a[:, 0], a[:, 1])
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: jax.random.normal(jax.random.key(7), x.shape)
      if p[-1].key.endswith("_lora_b") else x, nn.unbox(boxed))
  merged = jax.tree.map(lambda x: x, params)  # new dicts, same arrays
  sub = merged["layers"]["block"]["moe"]
  for n in ("wi", "wg", "wo"):
    a, b = sub.pop(f"{n}_lora_a"), sub.pop(f"{n}_lora_b")
    sub[n] = sub[n] + (3.0 / 4) * jnp.einsum("leir,lero->leio", a, b)
  sub = merged["layers"]["block"]["attn"]
  a, b = sub.pop("q_lora_a"), sub.pop("q_lora_b")
  sub["q"] = sub["q"] + (3.0 / 4) * jnp.einsum("lir,lrhk->lihk", a, b)
  batch = _batch()
  loss = lambda m: jax.jit(lambda p: m.apply({"params": p}, batch, method=m.loss)[0])
  lora_loss = loss(model)
  got, want = lora_loss(params), loss(model.clone(lora=None))(merged)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert abs(got - lora_loss(nn.unbox(boxed))) > 1e-2  # the adapters matter


def test_trainable_mask_is_by_name():
  tree = {"a": {"q": 1, "q_lora_a": 2}, "x/y/wo_lora_b": 3, "x/y/wo": 4}
  assert train_state.trainable_mask(tree, True) == {
      "a": {"q": False, "q_lora_a": True}, "x/y/wo_lora_b": True, "x/y/wo": False}
  assert all(jax.tree.leaves(train_state.trainable_mask(tree, False)))


def _init_params(trained):
  """The canonical initial params of a `util.train_steps` result's program (its compiled
  init, run again: the fresh state the loop started from)."""
  program = trained[2]
  return jax.device_get(program.to_canonical(program.init()).params)


@pytest.fixture(scope="module")
def one_device():
  """TinyLmLora (2 layers, adapter dropout 0.1) trained STEPS steps on one device, and its
  initial params."""
  one = util.train_steps("lm.TinyLmLora", STEPS, devices=jax.devices()[:1],
                         overrides=SMALL + DROPOUT)
  return one, _init_params(one)


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


def test_lora_on_8_devices_equals_one_device(one_device):
  """data 2 x fsdp 2 x tensor 2 with the 'minimal' remat policy (the masks redrawn alike in
  the recompute). (data 4 x tp 2, save_qkv_proj, and fsdp 8 alone: measured once.)"""
  got = util.train_steps("lm.TinyLmLora", STEPS, overrides=SMALL + DROPOUT + [
      "task.ici_mesh_shape=(2, 2, 2)", "task.model.remat_policy='minimal'"])
  _assert_same_training(got, *one_device)


def _assert_same_training(got, want, init):
  """Losses and adapters equal at float32 rounding; frozen params bitwise.

  An adapter's atol is f32_atol plus 1e-4 of the distance Adam moved it from `init` (the
  initial params): Adam divides each gradient by its own running size, so the rounding of a
  gradient that cancels to near 0 moves its update by a share of lr however small the
  gradient is. B starts at 0, so f32_atol's scale (its largest value) is that distance
  itself (measured: one element of wg's B 11 eps32 * max * sqrt(tokens) off on an AVX-512
  CPU, 4.3e-5 of the distance; f32_atol allows 8). A bug moves them by the whole distance.
  """
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  adapters, base = _split(want[1])
  got_adapters, got_base = _split(got[1])
  init_adapters = _split(init)[0]

  def close(path, x, y, y0):
    atol = util.f32_atol(y, util.TINY_LM_TOKENS) + 1e-4 * float(np.max(np.abs(y - y0)))
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=atol, err_msg=sharding.path_str(path))
  jax.tree_util.tree_map_with_path(close, got_adapters, adapters, init_adapters)
  jax.tree.map(np.testing.assert_array_equal, got_base, base)


def _pipelined(mesh, **pipeline):
  def edit(cfg):
    cfg.task.mesh_axis_names = ("stage", "data", "fsdp", "model")
    cfg.task.ici_mesh_shape = mesh
    cfg.task.pipeline = fdl.Config(PipelineConfig, **pipeline)
  return edit


# (LoRA in the SPMD pipeline equals one device too, measured once; MPMD with a context
# axis stays in the suite.)


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
  want = util.train_steps("lm.TinyLmLora", STEPS, devices=jax.devices()[:1], overrides=SMALL)
  init = _init_params(want)
  for edit in (mpmd, context):
    _assert_same_training(util.train_steps("lm.TinyLmLora", STEPS, overrides=SMALL, edit=edit),
                          want, init)


def test_train_flops_count_no_weight_gradient_for_frozen_params():
  """6·N·T for the adapters, 4·N·T (forward, input gradient) for the frozen params."""
  model = _model(targets=("q", "k", "v", "o"))
  example = {k: jax.ShapeDtypeStruct((8,), v.dtype) for k, v in _batch().items()}
  full = model.clone(lora=None).work_per_example(example)
  adapters = 2 * (4 * (16 + 16) * 2 + 4 * (16 + 8) * 2)  # layers x q, o + k, v
  frozen = (full.train_flops - full.attention_flops) / (6 * 8)
  assert model.work_per_example(example).train_flops == (
      full.attention_flops + 6 * 8 * adapters + 4 * 8 * frozen)


def test_train_flops_count_top_k_of_the_expert_adapters():
  """With `experts` adapted, a token uses top_k of E experts' adapters (6·N·T) and of
  their frozen weights (4·N·T)."""
  from spmdtask.layers.moe import MoeConfig  # pylint: disable=g-import-not-at-top
  model = _model(targets=("experts",)).clone(moe=MoeConfig(num_experts=4, top_k=2, d_ff=8))
  example = {k: jax.ShapeDtypeStruct((8,), v.dtype) for k, v in _batch().items()}
  full = model.clone(lora=None).work_per_example(example)
  # layers x (wi, wg, wo) x top_k experts x r·(16 + 8)
  adapters = 2 * 3 * 2 * 4 * (16 + 8)
  frozen = (full.train_flops - full.attention_flops) / (6 * 8)
  work = model.work_per_example(example)
  assert work.train_flops == full.attention_flops + 6 * 8 * adapters + 4 * 8 * frozen
  assert work.active_params == full.active_params + adapters


def _moe_layer(cls, cfg, lora):
  none = (None, None, None)
  return cls(16, cfg, jnp.float32, (None, None), none, none, (None, None), (None, None), None,
             None, lora=lora)


def test_expert_adapters_init_under_nn_vmap():
  """The SPMD pipeline inits its layers under nn.vmap (a dim per stage, repeat, layer),
  where B's zeros are unbatched: the init (no adapter term: B = 0) still makes A and B."""
  from spmdtask.layers import moe  # pylint: disable=g-import-not-at-top
  stacked = nn.vmap(moe.MoeFfn, variable_axes={"params": 0}, split_rngs={"params": True},
                    in_axes=(None,), axis_size=2, metadata_params={nn.PARTITION_NAME: None})
  lora = LoraConfig(rank=2, alpha=4.0, targets=("experts",))
  layer = _moe_layer(stacked, moe.MoeConfig(num_experts=4, top_k=2, d_ff=8), lora)
  params = jax.eval_shape(layer.init, jax.random.key(0), jnp.zeros((2, 3, 16)))["params"]
  assert params["wo_lora_b"].value.shape == (2, 4, 2, 16)


def test_expert_adapter_grads_equal_over_ff_slices_and_remat():
  """An MoE layer's expert adapters (dropless): value and grads of A and B equal with the ff
  dim in 2 slices, and, with adapter dropout 0.1, under full remat of the layer (the masks
  redrawn alike in the recompute); the frozen experts and router get none."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from spmdtask.layers import lora as lora_lib, moe  # pylint: disable=g-import-not-at-top
  cfg = moe.MoeConfig(num_experts=4, top_k=2, d_ff=8)
  lora = LoraConfig(rank=2, alpha=4.0, dropout=0.1, targets=("experts",))
  layer = lambda c: _moe_layer(moe.MoeFfn, c, lora)
  x = jax.random.normal(jax.random.key(1), (4, 6, 16))
  drop = lora_lib.Dropout(jax.random.key_data(jax.random.key(3)), jnp.arange(4) + 10)
  params = nn.unbox(layer(cfg).init(jax.random.key(0), x)["params"])
  params = {k: jax.random.normal(jax.random.key(7), v.shape) if k.endswith("_lora_b") else v
            for k, v in params.items()}
  probe = jax.random.normal(jax.random.key(2), x.shape)
  loss = lambda c, d: lambda p: jnp.sum(layer(c).apply({"params": p}, x, d)[0] * probe)
  two = dataclasses.replace(cfg, ff_chunks=2)
  # (want, got) pairs: slices without dropout (wo's adapter draws its mask per slice), and
  # full remat with dropout, all at once and in slices.
  pairs = [(loss(cfg, None), loss(two, None))] + [
      (loss(c, drop), jax.checkpoint(loss(c, drop))) for c in (cfg, two)]
  got = jax.jit(lambda p: [[jax.value_and_grad(f)(p) for f in pair] for pair in pairs])(params)
  grads = got[1][0][1]
  assert not np.any(np.asarray(grads["wi"])) and not np.any(np.asarray(grads["router"]))
  assert np.any(np.asarray(grads["wo_lora_a"])) and np.any(np.asarray(grads["wi_lora_b"]))
  assert abs(got[1][0][0] - got[0][0][0]) > 1e-3  # the dropout is on
  for (want_value, want), (value, grads) in got:
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    util.assert_trees_close(grads, want, terms=48)


def _mla_lora(cfg):
  # No dense stack: its MLA and MLP are the MoE layers' own (the shared expert's MLP takes
  # the dense adapters), and each distinct stack is compiled (init and step) once more.
  cfg.task.model.num_layers, cfg.task.model.moe.first_moe_layer = 2, 0
  cfg.task.model.lora = fdl.Config(LoraConfig, rank=4, alpha=8.0, dropout=0.1,
                                   targets=MLA_V3 + ("wi", "wg", "wo", "experts"))
  cfg.task.model.moe.dispatch = "capacity"  # some assignments dropped, alike on 1 and 8
  cfg.task.model.moe.ff_chunks = 2
  cfg.task.model.remat_policy = "minimal"


@pytest.mark.slow
def test_mla_and_expert_lora_on_8_devices_equals_one_device():
  """TinyDeepSeekV3 as 2 MoE layers (MLA with a latent q, routed experts beside a shared
  one; capacity dispatch, the experts' ff dim in 2 slices, 'minimal' remat) with adapters
  on MLA's projections, the shared expert's MLP and the routed experts, adapter dropout
  0.1: the experts over `expert` (all-to-all), expert 2 x fsdp 2 x tensor 2 equals one
  device; the router and experts frozen (bitwise unchanged), the expert adapters trained.
  (TinyMoe's experts alike over data 2 x expert 2 x fsdp 2, dropless or capacity: measured
  once.)"""
  small = ["datasets['train'].batch_size=8", "datasets['train'].seq_len=32"]
  want = util.train_steps("TinyDeepSeekV3", STEPS, devices=jax.devices()[:1], edit=_mla_lora,
                          overrides=small + ["task.ici_mesh_shape=(1, 1, 1, 1)"])
  got = util.train_steps("TinyDeepSeekV3Split", STEPS, edit=_mla_lora, overrides=small)
  init = _init_params(want)
  _assert_same_training(got, want, init)
  jax.tree.map(np.testing.assert_array_equal, _split(want[1])[1], _split(init)[1])
  attn, moe = want[1]["layers"]["block"]["attn"], want[1]["layers"]["block"]["moe"]
  assert np.any(attn["kv_up_lora_b"]) and np.any(attn["q_down_lora_b"])
  assert np.any(moe["wo_lora_b"]) and np.any(moe["wi_lora_b"])
