"""configs/qwen3.py: each Qwen3 has its published parameter count (abstract params, nothing
allocated); TinyQwen3 (TinyLm's layer with QK-norm and a tied head) trains the same on 8
devices (fsdp 4 x model 2) as on one over 4 steps. Its cached greedy decode equals a
repeated full forward in tests/run/test_decoding.py."""
import fiddle as fdl
import numpy as np
import pytest

from spmdtask import registry
from spmdtask.layers.block import num_params
from tests.configs import test_moe

# Hugging Face config.json of each (MaxText's qwen3-*.yml carry the same fields).
PUBLISHED = {"Qwen3_0_6B": 596_049_920, "Qwen3_8B": 8_190_735_360,
             "Qwen3_32B": 32_762_123_264}
STEPS = 4  # the warmup's first step moves nothing (lr 0): 3 updates
ROW = {"inputs": np.zeros((8,), np.int32), "targets": np.zeros((8,), np.int32),
       "weights": np.ones((8,), np.float32)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_is_the_published_one(name):
  model = fdl.build(registry.get(f"qwen3.{name}")().task().model)
  assert num_params(model, ROW) == PUBLISHED[name]


def test_fsdp_and_tensor_parallel_on_8_devices_equal_one_device():
  """fsdp 4 x model 2: the weights (the tied embedding too) split both ways, the 4 query
  heads over model, QK-norm's [head_dim] scales whole on each device."""
  want = test_moe.run("TinyQwen3", ("task.ici_mesh_shape=(1, 1, 1)",), 1, STEPS)
  got = test_moe.run("TinyQwen3", ("task.ici_mesh_shape=(1, 4, 2)",), steps=STEPS)
  test_moe.assert_same_training(got, want)
  assert want[0][-1] < want[0][0]  # it learns
