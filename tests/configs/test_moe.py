"""configs/moe.py: each published Mixture of Experts has its Hugging Face config's total and
active parameter counts (abstract params, nothing allocated), and its model FLOPs count the
active ones."""
import fiddle as fdl
import jax
import numpy as np
import pytest

from spmdtask import registry
from spmdtask.layers.block import num_params

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
  # 6·N_active·T + attention (12·L·heads·head_dim·T²): not the total's 6·N·T.
  width = model.num_heads * model.head_dim
  assert work.train_flops == 6 * active * T + 12 * model.num_layers * width * T * T


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
  from tools import convert_hf  # pylint: disable=import-outside-toplevel
  for name, cfg in HF_CONFIGS.items():
    assert convert_hf.published_experiment(cfg) == f"moe.{name}", name
