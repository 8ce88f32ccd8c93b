"""configs/gemma3.py: each Gemma 3 (text) has its published parameter count (abstract
params, nothing allocated); TinyGemma3 (local and global layers, a window shorter than the
row, sandwich norms, GeGLU) trains the same on 8 devices (data 2 x fsdp 2 x model 2) as on
one over 4 steps; its model FLOPs count a local layer's attention within its window; a
pattern, window or attention scale that does not fit the model is a config error."""
import fiddle as fdl
import numpy as np
import pytest

from spmdtask import registry
from spmdtask.core import program as program_lib
from spmdtask.errors import ConfigError
from spmdtask.core import model as model_lib
from spmdtask.layers.block import num_params
from tests import util
from tests.configs import test_moe

# Text model of each Hugging Face config.json (configs/gemma3.py says where each came from).
PUBLISHED = {"Gemma3_1B": 999_885_952, "Gemma3_4B": 3_880_263_168,
             "Gemma3_12B": 11_766_034_176, "Gemma3_27B": 27_009_346_304}
# Steps of the 1 vs 8 devices check: the warmup's first moves nothing (lr 0), the other 3
# update from Adam moments of steps that used the params.
STEPS = 4
ROW = {"inputs": np.zeros((8,), np.int32), "targets": np.zeros((8,), np.int32),
       "weights": np.ones((8,), np.float32)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_is_the_published_one(name):
  model = fdl.build(registry.get(f"gemma3.{name}")().task().model)
  assert num_params(model, ROW) == PUBLISHED[name]


def test_fsdp_and_tensor_parallel_on_8_devices_equal_one_device():
  want = test_moe.run("TinyGemma3", ("task.ici_mesh_shape=(1, 1, 1)",), 1, STEPS)
  got = test_moe.run("TinyGemma3", ("task.ici_mesh_shape=(2, 2, 2)",), steps=STEPS)
  test_moe.assert_same_training(got, want)
  assert want[0][-1] < want[0][0]  # it learns


def test_model_flops_count_a_local_layers_attention_within_its_window():
  """TinyGemma3 (layers local, local, global, local; window 8) on 64-token rows: a local
  layer's query i sees min(i + 1, 8) keys, a global one's i + 1."""
  model = fdl.build(registry.get("gemma3.TinyGemma3")().task().model)
  row = {k: np.zeros((64,), v.dtype) for k, v in ROW.items()}
  work = model.work_per_example(row)
  local = sum(range(1, 9)) + (64 - 8) * 8  # 36 + 448 = 484 pairs
  back = np.subtract.outer(np.arange(64), np.arange(64))  # query position - key position
  assert local == ((back >= 0) & (back < 8)).sum()  # the causal window mask's ones
  width = 4 * 32  # heads x head_dim
  assert work.attention_flops == 12 * width * (3 * local + 64 * 65 // 2)
  assert work.train_flops == 6 * num_params(model, row) * 64 + work.attention_flops


def test_decode_cache_holds_every_position_in_every_layer():
  """docs/families/gemma3.md's figure: Gemma3_27B's cache per token is its 62 layers' keys
  and values (16 KV heads of 128, bfloat16), local layers included (no ring)."""
  model = fdl.build(registry.get("gemma3.Gemma3_27B")().task().model)
  assert model_lib.cache_bytes_per_token(model) == 62 * 2 * 16 * 128 * 2 == 507_904


@pytest.mark.parametrize("overrides,field", [
    (["task.model.attention_pattern=('local', 'local', 'local', 'local', 'global')"],
     "attention_pattern has 5"),  # TinyGemma3 has 4 layers
    (["task.model.sliding_window=0"], "sliding_window=0"),
    (["task.model.sliding_window=-3"], "sliding_window=-3"),
    (["task.model.sliding_window=None"], "sliding_window=None: the attention_pattern has local"),
    (["task.model.attention_pattern=('local', 'sliding')"], "attention_pattern=.* must be"),
    (["task.model.attention_pattern=('global',)"], "sliding_window=8 is set"),  # no local layer
    (["task.model.attention_scale=0.0"], "attention_scale=0.0"),
])
def test_a_pattern_or_window_that_does_not_fit_the_model_is_a_config_error(overrides, field):
  run = util.build_run("TinyGemma3", overrides)
  with pytest.raises(ConfigError, match=f"task.model.{field}"):
    program_lib.setup(run.task, run.datasets["train"].batch_at(0))
