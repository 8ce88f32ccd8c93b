"""layers/qlora.py: a QLoRA base (lora.base_quantization) stored as packed codes and
per-group scales: nf4 dequantizes to the published code book exactly; int4/int8/nf4 round
trips within half a step of their group's scale; a tiny model's logits with an nf4 base near
the float base's, and equal to the dequantized (exported) base's; the stored parts split
as the weight; bad fields are ConfigErrors naming the field; 1 vs 8 devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spmdtask.core import train_state
from spmdtask.errors import ConfigError
from spmdtask.layers import qlora
from spmdtask.layers.lora import LoraConfig
from spmdtask.layers.transformer import TransformerLm
from spmdtask.plan import buffers, targets
from tests import util

ALL = ("q", "k", "v", "o", "wi", "wg", "wo")
# NF4 as published: QLoRA (Dettmers et al. 2023) appendix E, bitsandbytes' NF4 table.
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.2461123019456863, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def _model(lora=True, **fields):
  cfg = LoraConfig(**{"rank": 4, "alpha": 8.0, "targets": ALL, **fields}) if lora else None
  return TransformerLm(vocab_size=32, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=16, d_ff=48, lora=cfg)


def _tokens():
  return jax.random.randint(jax.random.key(1), (2, 8), 0, 32)


def _params(model):
  boxed = model.init(jax.random.key(0), _tokens())["params"]
  return jax.tree.map(lambda b: b.value, boxed, is_leaf=lambda x: hasattr(x, "value")), boxed


@pytest.mark.parametrize("dequantize", ["jax", "numpy"])
def test_nf4_dequantizes_to_the_published_code_book_exactly(dequantize):
  # One group of 16 whose absmax is 1 (scale 1): each code book value is its own code.
  w = np.asarray(NF4, np.float32)[:, None] * np.ones((1, 3), np.float32)
  qvalue, qscale = qlora.quantize(w, "nf4", 16, 0, jnp.float32)
  assert qvalue.shape == (8, 3) and qvalue.dtype == jnp.uint8  # two codes a byte
  assert (np.asarray(qvalue)[:, 0] == [c | (c + 1) << 4 for c in range(0, 16, 2)]).all()
  xp = jnp if dequantize == "jax" else np
  got = np.asarray(qlora.dequantize(qvalue, qscale, "nf4", 0, xp))
  np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("kind, half_step", [("nf4", max(np.diff(NF4)) / 2), ("int4", 1 / 15),
                                             ("int8", 1 / 255)])
def test_a_round_trip_is_within_half_a_step_of_each_groups_scale(kind, half_step):
  # half_step: the widest half-gap between codes, times the group's absmax (nf4: -1..-0.70;
  # int4: absmax / 7.5 / 2; int8: absmax / 127.5 / 2), plus float32 rounding of absmax.
  w = np.asarray(jax.random.normal(jax.random.key(2), (64, 2, 8)), np.float32)
  qvalue, qscale = qlora.quantize(w, kind, 16, 0, jnp.float32)
  assert qscale.shape == (4, 2, 8)
  got = np.asarray(qlora.dequantize(qvalue, qscale, kind, 0))
  absmax = np.repeat(np.abs(w).reshape(4, 16, 2, 8).max(1), 16, axis=0)
  assert (np.abs(got - w) <= (half_step + 4 * util.EPS32) * absmax).all()
  np.testing.assert_array_equal(got, qlora.dequantize(qvalue, qscale, kind, 0, np))


@pytest.fixture(scope="module")
def tiny():
  """The float tiny model's params and logits, and the nf4 model's params quantized from
  them (as a warm start does: Storage.quantized)."""
  float_model, nf4_model = _model(), _model(base_quantization="nf4", group_size=16)
  params, _ = _params(float_model)
  nf4_shapes, boxed = _params(nf4_model)
  storage = train_state.base_storage(nf4_model)
  nf4 = storage.quantized(params, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=None), nf4_shapes))
  # Random adapters (B is zero at init: it would hide the adapters' path).
  nf4 = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.1 if p[-1].key.endswith("_lora_b") else x, nf4)
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.1 if p[-1].key.endswith("_lora_b") else x, params)
  logits = lambda m, p: np.asarray(jax.jit(m.apply)({"params": p}, _tokens()))
  return dict(float=logits(float_model, params), nf4=logits(nf4_model, nf4), nf4_params=nf4,
              boxed=boxed, storage=storage, float_model=float_model, params=params,
              logits=logits)


def test_an_nf4_base_stores_packed_codes_and_scales_split_as_the_weight(tiny):
  attn, mlp = (tiny["boxed"]["layers"]["block"][k] for k in ("attn", "mlp"))
  # q [L, d 32, h, hd]: groups of 16 along d; o [L, h, hd 16, d]: along hd; wo [L, f 48, d].
  assert attn["q_qvalue"].value.shape == (2, 16, 2, 16) and attn["q_qvalue"].value.dtype == \
      jnp.uint8
  assert attn["q_qscale"].value.shape == (2, 2, 2, 16)
  assert attn["o_qvalue"].value.shape == (2, 2, 8, 32) and attn["o_qscale"].value.shape == \
      (2, 2, 1, 32)
  assert mlp["wo_qvalue"].value.shape == (2, 24, 32) and mlp["wo_qscale"].value.shape == (2, 3, 32)
  for name in ("q", "o"):
    assert attn[f"{name}_qvalue"].names == attn[f"{name}_qscale"].names
  assert "q" not in attn and "embedding" in tiny["boxed"]  # the embedding stays float
  # Nothing of the base trains: only adapters hold optimizer state.
  mask = train_state.trainable_mask(tiny["nf4_params"], True)
  assert not mask["layers"]["block"]["attn"]["q_qvalue"] and \
      mask["layers"]["block"]["attn"]["q_lora_a"]


def test_nf4_logits_stay_near_the_float_bases_and_equal_the_dequantized_bases(tiny):
  # nf4 moves each base weight by up to 0.152 x its group's absmax (its widest half-gap);
  # through this random 2-layer model with adapters the logits (max |logits| 3.37) moved by
  # 0.58 at most (0.17 x, measured): the bound is 0.3 x max |logits|. A wrong code book,
  # group or scale moves them by the logits' own size.
  err = np.abs(tiny["nf4"] - tiny["float"]).max()
  scale = np.abs(tiny["float"]).max()
  assert 0 < err <= 0.3 * scale, (err, scale)
  # The export's dequantized base (numpy, on the host) in the float model: the same logits
  # (float32 rounding: the same products, another order).
  plain = tiny["storage"].dequantized(jax.device_get(tiny["nf4_params"]))
  got = tiny["logits"](tiny["float_model"], plain)
  np.testing.assert_allclose(got, tiny["nf4"], rtol=0, atol=util.f32_atol(tiny["nf4"], 64))


@pytest.mark.parametrize("fields, match", [
    ({"base_quantization": "fp4"}, r"lora.base_quantization='fp4'.*'nf4'"),
    ({"base_quantization": "nf4", "group_size": 3}, r"lora.group_size=3.*even"),
    ({"base_quantization": "nf4", "targets": ("q", "experts")},
     r"lora.targets=.*'experts' cannot be stored quantized"),
])
def test_bad_qlora_fields_are_config_errors(fields, match):
  with pytest.raises(ConfigError, match=match):
    LoraConfig(rank=4, alpha=8.0, **{"targets": ("q",), **fields}).validate(ALL + ("experts",))


def test_a_group_size_that_does_not_divide_a_dim_is_a_config_error():
  # o's group dim is head_dim 16: 32 does not divide it (q's d = 32 would be fine).
  with pytest.raises(ConfigError, match=r"lora.group_size=32: .*'o' \(2, 16, 32\) has 16"):
    _params(_model(base_quantization="int4", group_size=32))


def test_multi_head_latent_attention_and_quantized_matmuls_are_refused():
  mla = LoraConfig(rank=4, alpha=8.0, targets=("q", "o"), base_quantization="nf4")
  with pytest.raises(ConfigError, match=r"'kv_down' cannot be stored quantized"):
    mla.validate(("q", "kv_down", "kv_up", "o"))
  model = _model(base_quantization="nf4", group_size=16).clone(quantization="int8")
  with pytest.raises(ConfigError, match=r"base_quantization='nf4' with task.model.quantization"):
    model.validate(None, 2)


def test_an_nf4_matmul_on_xla_tpu_writes_no_compare_and_no_float32_weight():
  """XLA:TPU (v5e, compiled ahead of time here) on a Llama 3.1 8B MLP weight's shape:
  x @ W and its backward with W dequantized from nf4 in bfloat16 need at most 2x the
  bfloat16 weight's bytes of temporaries (measured: 2.0x, the scales broadcast to the codes
  in float32 and the interleaved halves), and write no bool array. A chain of 16 compares
  wrote a bool array per compare and a float32 copy of the weight (6.0x: the 70B
  QLoRA plan's step then needed 21.3 GiB of a v5e's 16)."""
  d, f, tokens = 4096, 14336, 512
  one = NamedSharding(Mesh(np.array(targets.tpu("v5e:1x1").devices[:1]), ("x",)), P())
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=one) for shape, dtype in
          (((tokens, d), jnp.bfloat16), ((d // 2, f), jnp.uint8), ((d // 64, f), jnp.bfloat16))]

  def loss(x, qvalue, qscale):
    w = qlora.dequantize(qvalue, qscale, "nf4", 0, jnp, jnp.bfloat16)
    return jnp.sum(jnp.square((x @ w).astype(jnp.float32)))
  compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
  weight_bytes = d * f * 2
  assert compiled.memory_analysis().temp_size_in_bytes <= 2.1 * weight_bytes
  written = buffers.hlo_arrays(compiled.as_text(), None)
  assert not [a for a in written if a.dtype == "pred" and a.bytes >= 2**20], written
