"""DeepSeek experiments: the published total and active parameter counts (abstract params;
DeepSeekV3Mtp with its multi-token-prediction layer); TinyDeepSeekV3 (MLA, group routing,
the balancing bias, a dense first layer, a shared expert, an MTP head) on 8 devices
(expert 2 x fsdp 2 x model 2) equals one device over 4 steps; its balancing bias equals a
hand computation of three steps' expert loads."""
import functools

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask import registry
from spmdtask.core import program as program_lib
from spmdtask.layers import costs
from spmdtask.layers.block import Block, num_params, param_shapes
from spmdtask.layers.moe import BIAS, MoeBlock, STATS, route, update_bias
from tests import util

ONE = ("task.ici_mesh_shape=(1, 1, 1, 1)",)
PUBLISHED = {"DeepSeekV2Lite": (15_706_484_224, 2_661_150_208),
             "DeepSeekV3": (671_026_419_200, 37_552_297_472),
             "DeepSeekV3Mtp": (682_636_487_424, 38_240_398_080)}
T = 8


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_parameter_counts(name):
  """HF's safetensors of DeepSeek-V2-Lite hold 15,706,484,224 params; DeepSeek-V3's
  684,531,386,000 = DeepSeekV3Mtp's 682,636,487,424 (the main 671,026,419,200 + the MTP
  layer's 11,610,068,224) + the MTP layer's copies of the embedding and head (2 x 129280 x
  7168 = 1,853,358,080) + the FP8 checkpoint's block scales (one float32 per 128 x 128
  block of each FP8 projection: 41,540,496). Active: every param but 256 - 8 (64 - 6)
  routed experts per MoE layer (the MTP layer's too)."""
  model = fdl.build(registry.get(f"deepseek.{name}")().task().model)
  row = {"inputs": np.zeros((T,), np.int32), "targets": np.zeros((T,), np.int32),
         "weights": np.ones((T,), np.float32)}
  total, active = PUBLISHED[name]
  assert num_params(model, row) == total
  shapes = param_shapes(model, {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
                                for k, v in row.items()})
  assert costs.active_params(shapes, model.moe.top_k, model.moe.num_experts) == active


# The published config.json fields (deepseek-ai/DeepSeek-V2-Lite, DeepSeek-V3) the converter reads.
HUB_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
V2L = {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
       "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
       "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
       "n_routed_experts": 64, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
       "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
       "qk_rope_head_dim": 64, "v_head_dim": 128, "routed_scaling_factor": 1.0,
       "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
       "scoring_func": "softmax", "rope_theta": 10000, "rope_scaling": HUB_YARN,
       "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
       "hidden_act": "silu", "attention_bias": False, "bos_token_id": 100000,
       "eos_token_id": 100001}
V3 = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
      "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
      "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
      "n_routed_experts": 256, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
      "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64, "v_head_dim": 128, "routed_scaling_factor": 2.5,
      "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
      "scoring_func": "sigmoid", "rope_theta": 10000,
      "rope_scaling": dict(HUB_YARN, mscale=1.0, mscale_all_dim=1.0),
      "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
      "hidden_act": "silu", "attention_bias": False, "num_nextn_predict_layers": 1,
      "bos_token_id": 0, "eos_token_id": 1}


def test_the_converter_names_the_experiment_of_each_published_hf_config():
  from spmdtask.hf.jobs import published  # pylint: disable=import-outside-toplevel
  assert published.published_experiment(V2L) == "deepseek.DeepSeekV2Lite"
  assert published.published_experiment(V3) == "deepseek.DeepSeekV3Mtp"  # its MTP layer
  assert published.published_experiment(dict(V3, num_nextn_predict_layers=0)) == \
      "deepseek.DeepSeekV3"


# With an MTP head (layers.mtp; depth 1 at DeepSeek's first weight): the 8-device run covers it.
SMALL = ("datasets['train'].batch_size=8", "datasets['train'].seq_len=32",
         "task.model.mtp_depth=1", "task.model.mtp_loss_weight=0.3")
# Three updates after the first step's (the warmup starts at learning rate 0), each from
# Adam's moments of the earlier gradients; the bias moves every step. More steps repeat the
# same programs.
STEPS = 4


@functools.lru_cache(maxsize=None)
def train(exp: str, devices: int):
  """(losses, canonical params before each step and after the last) of STEPS steps of the
  production program on the first `devices` devices, 8 rows x 32 tokens a step."""
  run = util.build_run(exp, SMALL + (ONE if devices == 1 else ()))
  data = run.datasets["train"]
  program = program_lib.setup(run.task, data.batch_at(0), jax.devices()[:devices])
  state, losses, params = program.init(), [], []
  for step in range(STEPS):
    params.append(jax.device_get(program.to_canonical(state).params))
    state, metrics = program.train(state, program.global_batch(data.batch_at(step)))
    losses.append(float(metrics["loss"]))
  params.append(jax.device_get(program.to_canonical(state).params))
  return np.asarray(losses), params, run


@pytest.mark.slow
def test_8_devices_equal_one_device_over_4_steps():
  losses, params, _ = train("TinyDeepSeekV3Split", 8)
  want_losses, want, _ = train("TinyDeepSeekV3", 1)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  util.assert_trees_close(params[-1], want[-1], rtol=1e-5, atol=1e-6)
  for layers in (params[-1]["layers"], params[-1]["mtp"]):  # exact counts, moved
    bias = layers["block"]["moe"][BIAS]
    np.testing.assert_array_equal(bias, want[-1]["layers"]["block"]["moe"][BIAS]
                                  if layers is params[-1]["layers"] else
                                  want[-1]["mtp"]["block"]["moe"][BIAS])
    assert np.abs(bias).max() > 0
  assert want_losses[-1] < want_losses[0]


def _experts(model, params, tokens):
  """[MoE layers, B, T, top_k] expert choices of `tokens`, layer by layer outside the stack:
  each MoE layer's router input captured, its choice made by `route` with that layer's bias
  (jitted by the caller: one compile, not one per op)."""
  kwargs = model.block_kwargs()
  x = jnp.take(params["embedding"], tokens, axis=0)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  first = model.moe.first_moe_layer
  for i in range(first):
    p = jax.tree.map(lambda a, i=i: a[i], params["dense_layers"]["block"])
    x = Block(**kwargs).apply({"params": p}, x, positions)[0]
  out, stats = [], jnp.zeros((x.shape[0], len(STATS)))
  for i in range(model.num_layers - first):
    p = jax.tree.map(lambda a, i=i: a[i], params["layers"]["block"])
    ((x, stats), _), state = MoeBlock(**kwargs, moe=model.moe).apply(
        {"params": p}, (x, stats), positions, capture_intermediates=True,
        mutable=["intermediates"])
    h = state["intermediates"]["mlp_norm"]["__call__"][0]
    out.append(route(h.astype(jnp.float32) @ p["moe"]["router"], model.moe,
                     p["moe"][BIAS])[1])
  return jnp.stack(out)


def _loads(experts, num_experts):
  """[MoE layers, E] expert assignments from `_experts`' choices."""
  return np.stack([np.bincount(np.asarray(e).ravel(), minlength=num_experts)
                   for e in experts]).astype(np.float32)


def test_balancing_bias_equals_a_hand_computation_over_3_steps():
  """bias_{s+1} = bias_s + rate · sign(mean load_s - load_s) per MoE layer, load_s counted
  here from step s's params and batch (every token's top-k, padding included)."""
  _, params, run = train("TinyDeepSeekV3", 1)
  model, data = run.task.model, run.datasets["train"]
  want = np.zeros((model.num_layers - model.moe.first_moe_layer, model.moe.num_experts),
                  np.float32)
  experts = jax.jit(functools.partial(_experts, model))
  for step in range(3):
    np.testing.assert_array_equal(params[step]["layers"]["block"]["moe"][BIAS], want)
    load = _loads(experts(params[step], jnp.asarray(data.batch_at(step)["inputs"])),
                  model.moe.num_experts)
    assert load.sum() == 8 * 32 * model.moe.top_k * len(load)
    want = np.asarray(update_bias(jnp.asarray(want), jnp.asarray(load),
                                  model.moe.bias_update_rate))
  np.testing.assert_array_equal(params[3]["layers"]["block"]["moe"][BIAS], want)
  assert np.abs(want).max() > 0
