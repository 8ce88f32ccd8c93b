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
