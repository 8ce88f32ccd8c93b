"""Multi-head latent attention: greedy decoding with the latent KV cache (absorbed
up-projections) equals a repeated full forward; the cache holds kv_lora_rank +
qk_rope_head_dim values per token and layer (DeepSeek-V3: 70,272 bytes in bfloat16);
ranks that do not divide over their split axes are ConfigErrors naming the field."""
import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import deepseek
from spmdtask import registry
from spmdtask.errors import ConfigError
from spmdtask.core import model as model_lib
from spmdtask.layers.attention.mla import Mla, MlaConfig
from spmdtask.layers.rope import YarnScaling
from spmdtask.layers.lm_splits import WeightSplit


def _tiny(q_lora_rank):
  cfg = deepseek.tiny_v3(vocab_size=64)
  cfg.mla.q_lora_rank = q_lora_rank
  cfg.moe, cfg.remat_policy = None, None  # attention alone: dense MLPs
  return fdl.build(cfg)


def test_greedy_decode_with_the_latent_cache_equals_a_repeated_full_forward():
  """Prefill 4 tokens, then 6 greedy steps of one token through the cache; the full
  forward of the final row (causal: position i sees only tokens <= i, what a forward of
  the row's first i + 1 tokens gives) has the same logits at every position, so the same
  greedy tokens. V2's direct q projection is covered by the HF fixture (tools)."""
  model = _tiny(32)
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 4)), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(1), prompt)["params"]
  total = 10
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), model.cache_shape(2, total))
  step = jax.jit(lambda p, t, pos, c: model.apply({"params": p}, t, pos, c))
  logits, cache = step(params, prompt, jnp.broadcast_to(jnp.arange(4), (2, 4)), cache)
  tokens, cached = prompt, [logits]
  for i in range(4, total):
    nxt = jnp.argmax(cached[-1][:, -1], axis=-1)[:, None].astype(jnp.int32)
    tokens = jnp.concatenate([tokens, nxt], axis=1)
    if i < total - 1:
      logits, cache = step(params, nxt, jnp.full((2, 1), i), cache)
      cached.append(logits)
  cached = jnp.concatenate(cached, axis=1)  # [2, total - 1, vocab]: positions 0 .. total - 2
  full = jax.jit(lambda p, t: model.apply({"params": p}, t))(params, tokens)[:, :-1]
  np.testing.assert_allclose(cached, full, rtol=1e-5, atol=2e-5)
  np.testing.assert_array_equal(jnp.argmax(full[:, 3:], -1), tokens[:, 4:])


def test_cache_per_token_is_the_latent_and_the_rope_key():
  v3 = fdl.build(registry.get("deepseek.DeepSeekV3")().task().model)
  cache = v3.cache_shape(3, 16)
  assert cache.latent.shape == (61, 3, 16, 512) and cache.k_rope.shape == (61, 3, 16, 64)
  assert model_lib.cache_bytes_per_token(v3) == (512 + 64) * 2 * 61 == 70_272  # bfloat16
  tiny = _tiny(32)
  assert model_lib.cache_bytes_per_token(tiny) == (16 + 8) * 4 * 3  # float32, 3 layers
  specs = v3.cache_split_dims({"data": 1, "fsdp": 4, "fsdp_b": 2, "model": 2})
  assert specs.latent == jax.sharding.PartitionSpec(None, ("data", "fsdp", "fsdp_b"), None,
                                                    None)


@pytest.mark.parametrize("field,split", [
    ("mla_kv_up", (("fsdp",), "model", None)),    # kv_lora_rank 16 over fsdp 3
    ("mla_q_down", (None, "fsdp")),              # q_lora_rank 32 over fsdp 3
    ("mla_kv_down", (None, "fsdp"))])            # kv_lora_rank + rope 24 over 5
def test_ranks_that_do_not_divide_their_axes_are_config_errors(field, split):
  cfg = MlaConfig(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8)
  mesh = {"fsdp": 5 if field == "mla_kv_down" else 3, "model": 1}
  with pytest.raises(ConfigError, match=f"weight_split_dims_mapping.{field}"):
    cfg.validate(WeightSplit(**{field: split}), mesh)
  cfg.validate(WeightSplit(**{field: split}), {"fsdp": 2, "model": 1})  # 2 divides all


def test_splash_kernel_equals_xla():
  """On TPU `auto` runs MLA through splash (q rescaled, v padded to the query's width);
  here in interpret mode, one layer: the same output as the xla kernel."""
  cfg = MlaConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8, rope_scaling=YarnScaling(factor=4.0, mscale_all_dim=0.7,
                                                         original_max_position_embeddings=32))
  layer = Mla(32, 2, cfg, 10000.0, jnp.float32, WeightSplit(), None, "xla")
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 128, 32)), jnp.float32)
  pos = jnp.arange(128)[None]
  params = jax.jit(layer.init)(jax.random.key(0), x, pos)
  want = jax.jit(lambda p: layer.apply(p, x, pos)[0])(params)
  got = jax.jit(lambda p: layer.clone(impl="splash").apply(p, x, pos)[0])(params)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
