"""configs/qwen3.py: each Qwen3 has its published parameter count (abstract params, nothing
allocated). Qwen3's layer is TinyLm's with QK-norm and a tied head: 8 devices against one
(fsdp, tp; 10 steps) runs both in tests/configs/test_gemma3.py (TinyGemma3 has them, with
Gemma's own parts), one compile-heavy equivalence test for the two families (suite time); its cached decode
(tests/run/test_decoding.py) likewise."""
import fiddle as fdl
import numpy as np
import pytest

from spmdtask import registry
from spmdtask.layers.block import num_params

# Hugging Face config.json of each (MaxText's qwen3-*.yml carry the same fields).
PUBLISHED = {"Qwen3_0_6B": 596_049_920, "Qwen3_8B": 8_190_735_360,
             "Qwen3_32B": 32_762_123_264}
ROW = {"inputs": np.zeros((8,), np.int32), "targets": np.zeros((8,), np.int32),
       "weights": np.ones((8,), np.float32)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_is_the_published_one(name):
  model = fdl.build(registry.get(f"qwen3.{name}")().task().model)
  assert num_params(model, ROW) == PUBLISHED[name]
