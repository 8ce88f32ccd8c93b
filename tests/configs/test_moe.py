"""TinyMoe on 8 CPU devices (expert parallelism by all-to-all, the SPMD pipeline, MPMD) equals
one device over 4 steps under each dispatch; its console and TensorBoard show the MoE
metrics; a checkpoint decodes; its param tree is the documented one. Each published Mixture
of Experts has its Hugging Face config's total and active parameter counts (abstract params,
nothing allocated), and its model FLOPs count the active ones."""
import functools
import glob
import json
import os

import fiddle as fdl
import flax.linen as nn
import jax
import numpy as np
import pytest

from spmdtask import registry
from spmdtask.layers import moe
from spmdtask.layers.block import num_params
from tests import subproc as h
from tests import util

# Three updates after the first step's (the warmup starts at learning rate 0), each from
# Adam's moments of the earlier gradients; more steps repeat the same programs.
STEPS = 4
ONE = ("task.ici_mesh_shape=(1, 1, 1, 1)",)
CAPACITY = ("task.model.moe.dispatch='capacity'",)


@functools.lru_cache(maxsize=None)
def run(exp: str, overrides=(), devices: int = 8, steps: int = STEPS):
  """(losses, canonical params, canonical optimizer state) after `steps` steps."""
  losses, params, program, state = util.train_steps(exp, steps, jax.devices()[:devices],
                                                    overrides)
  opt = jax.device_get(program.to_canonical(state).opt_state)
  return losses, params, opt


def assert_same_training(got, want):
  # Loss: float32 sums in another order over 16 x 64 tokens, ~eps * sqrt(1024) ~ 4e-6
  # relative at worst. Params and Adam's moments (the gradients' running averages, so the
  # grads of all the steps): 1e-5 relative, with an absolute floor for entries Adam moves
  # by ~lr whatever their (near-zero) gradient; the moments: util.f32_atol over a batch's
  # 16 x 64 tokens (scale-aware, as the gradients they average).
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  util.assert_trees_close(got[1], want[1], rtol=1e-5, atol=1e-6)
  util.assert_trees_close(got[2], want[2], rtol=1e-5, terms=16 * 64)


@pytest.mark.parametrize("dispatch", [(), CAPACITY], ids=["dropless", "capacity"])
def test_expert_parallel_on_8_devices_equals_one_device(dispatch):
  want = run("TinyMoe", ONE + dispatch, 1)
  assert_same_training(run("TinyMoe", dispatch), want)
  assert want[0][-1] < want[0][0]  # it learns


# (TinyMoePipeline too, measured once: suite time.) Over few steps: top-k routing turns
# float-order noise into a discrete change once a router logit pair is near-tied; on one CPU
# here MPMD's per-microbatch sums flipped a choice at step 7 (losses equal to 3e-7 relative
# through step 6, then 6e-4 apart), a fact of the CPU's rounding, not of the schedule.
@pytest.mark.parametrize("exp", ["TinyMoeMpmd"])
def test_spmd_pipeline_and_mpmd_equal_one_device(exp):
  assert_same_training(run(exp), run("TinyMoe", ONE, 1))


def test_param_tree():
  params = run("TinyMoe", ONE, 1)[1]
  block = params["layers"]["block"]
  shapes = jax.tree.map(np.shape, block["moe"])
  assert shapes == {"router": (4, 128, 8), "wi": (4, 8, 128, 128), "wg": (4, 8, 128, 128),
                    "wo": (4, 8, 128, 128),
                    "shared": {"wi": (4, 128, 128), "wg": (4, 128, 128), "wo": (4, 128, 128)}}
  assert "mlp" not in block and "dense_layers" not in params


def test_first_layers_dense_are_their_own_stack():
  r = util.build_run("TinyMoe", ONE + ("task.model.moe.first_moe_layer=1",))
  batch = r.datasets["train"].batch_at(0)
  model = r.task.model
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), batch, method=model.loss))
  params = jax.tree.map(np.shape, nn.unbox(params["params"]))
  assert params["dense_layers"]["block"]["mlp"] == {
      "wi": (1, 128, 512), "wg": (1, 128, 512), "wo": (1, 512, 128)}
  assert params["layers"]["block"]["moe"]["wi"] == (3, 8, 128, 128)


@pytest.mark.slow
def test_console_and_tensorboard_show_the_moe_metrics_and_the_checkpoint_decodes(tmp_path):
  job = str(tmp_path / "job")
  # Rows of 32 tokens, answers of 4 after the 8-token prompts: the metrics and the decode
  # need no more (each step costs seconds at -O0 on 8 emulated devices).
  base = ("task.train.num_train_steps=2", "task.train.log_interval_steps=1",
          "task.train.summary_interval_steps=1", "task.train.save_interval_steps=2",
          "task.model.moe.capacity_factor=1.0", *CAPACITY, "datasets['train'].seq_len=32",
          "task.decode.max_decode_len=12")
  r = h.run(h.main_cmd("TinyMoe", job, *base))
  assert r.returncode == 0, r.stderr[-3000:]
  lines = [l for l in r.stdout.splitlines() if "tokens/s" in l and " loss " in l]
  assert len(lines) == 2, r.stdout[-3000:]
  for line in lines:
    values = {k: float(line.split(f" {k} ")[1].split()[0]) for k in moe.STATS}
    assert values["moe_aux_loss"] >= 1.0 and values["moe_z_loss"] > 0
    assert 1.0 < values["moe_imbalance"] <= 8 and 0 < values["moe_dropped"] < 1
  tb = h.scalars(os.path.join(job, "summaries", "train"))
  for tag in moe.STATS:
    assert sorted(tb[tag]) == [1, 2] and all(v > 0 for v in tb[tag].values()), tag
  r = h.run(h.main_cmd("TinyMoe", job, *base, flags=["--mode=decode"]))
  assert r.returncode == 0, r.stderr[-3000:]
  out, = glob.glob(os.path.join(job, "decoder_out", "*_step2.jsonl"))
  rows = [json.loads(x) for x in open(out, encoding="utf-8")]
  assert len(rows) == 16 and all(len(r["output_ids"]) > 0 for r in rows)


# (total, active per token), from each config.json's arithmetic: all params; then the
# routed experts' only top_k of num_experts (router, shared experts, attention, norms,
# embedding and head whole).
PUBLISHED = {"Mixtral_8x7B": (46_702_792_704, 12_879_925_248),
             "Mixtral_8x22B": (140_620_634_112, 39_152_031_744),
             "Qwen3_30B_A3B": (30_532_122_624, 3_353_032_704),
             "DeepSeekMoE_16B": (16_375_728_128, 2_828_650_496)}
T = 8


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_parameter_counts_are_the_published_ones(name):
  model = fdl.build(registry.get(f"moe.{name}")().task().model)
  row = {"inputs": np.zeros((T,), np.int32), "targets": np.zeros((T,), np.int32),
         "weights": np.ones((T,), np.float32)}
  total, active = PUBLISHED[name]
  assert num_params(model, row) == total  # jax.eval_shape: shapes only
  work = model.work_per_example({k: jax.ShapeDtypeStruct(v.shape, v.dtype)
                                 for k, v in row.items()})
  assert work.active_params == active
  # 6·N_active·T + causal attention: 12·heads·head_dim per (query, key) pair, T·(T+1)/2.
  width = model.num_heads * model.head_dim
  assert work.train_flops == 6 * active * T + 6 * model.num_layers * width * T * (T + 1)


# The published config.json fields (Mixtral-8x7B-v0.1, Qwen3-30B-A3B) that the converter reads.
HF_CONFIGS = {
    "Mixtral_8x7B": {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "max_position_embeddings": 32768, "rope_theta": 1e6,
                     "rms_norm_eps": 1e-5, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "sliding_window": None, "tie_word_embeddings": False,
                     "hidden_act": "silu"},
    "Qwen3_30B_A3B": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128,
                      "max_position_embeddings": 40960, "rope_theta": 1e6,
                      "rms_norm_eps": 1e-6, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "use_sliding_window": False, "attention_bias": False,
                      "tie_word_embeddings": False, "hidden_act": "silu"},
}


def test_the_converter_names_the_experiment_of_each_published_hf_config():
  from spmdtask.hf.jobs import published  # pylint: disable=import-outside-toplevel
  for name, cfg in HF_CONFIGS.items():
    assert published.published_experiment(cfg) == f"moe.{name}", name


def test_mixtral_activations_hold_each_tokens_top_k_expert_rows():
  """What the plan's out-of-memory paragraph counts: a Mixtral layer's expert activations
  are [rows, tokens, top_k · expert d_ff / ff_chunks] (one of its 7 ff slices at a time),
  not the dense MLP's."""
  model = fdl.build(registry.get("moe.Mixtral_8x7B")().task().model)
  held = {h.what: h.shape for h in model.activation_memory(4, 4096).arrays}
  assert held["one MoE layer's expert activations (top_k per token, one ff slice) while it "
              "runs"] == (4, 4096, 2 * 14336 // 7)
