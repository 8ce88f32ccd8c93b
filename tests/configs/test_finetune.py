"""configs/finetune.py: the fine-tunes' parameter counts (the published base + the adapters)
and their plans on the slices they are sized for (TPU ahead-of-time compile)."""
import fiddle as fdl
import numpy as np
import pytest

from spmdtask import registry
from spmdtask.layers.block import num_params
from spmdtask.plan import chips, planner, targets
from tests import util

# The base's published count + LoRA rank 16 on q, k, v, o, wi, wg, wo: per layer
# r · (in + out) summed over the targets.
BASE = {"Llama31_8B_Sft": 8_030_261_248, "Llama31_8B_Lora": 8_030_261_248,
        "Llama31_70B_Lora": 70_553_706_496}
ADAPTERS = {"Llama31_8B_Sft": 0,
            "Llama31_8B_Lora": 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024)
                                          + 3 * (4096 + 14336)),
            "Llama31_70B_Lora": 80 * 16 * (2 * (8192 + 8192) + 2 * (8192 + 1024)
                                           + 3 * (8192 + 28672))}


@pytest.mark.parametrize("name", sorted(BASE))
def test_parameter_count_is_the_base_plus_the_adapters(name):
  model = fdl.build(registry.get(f"finetune.{name}")().task().model)
  row = {"inputs": np.zeros((8,), np.int32), "targets": np.zeros((8,), np.int32),
         "weights": np.ones((8,), np.float32)}
  assert num_params(model, row) == BASE[name] + ADAPTERS[name]


@pytest.mark.slow
@pytest.mark.parametrize("name,topology", [("Llama31_8B_Lora", "v5e:2x4"),
                                           ("Llama31_70B_Lora", "v5e:8x8")])
def test_lora_plans_fit_their_slices(name, topology):
  """Compiled for the TPU slice on this CPU machine: the step fits the chip's HBM; only the
  adapters are trainable and hold (AdamW's two) optimizer moments."""
  got = planner.make_plan(util.build_run(f"finetune.{name}"), name, targets.tpu(topology))
  assert got["compiled"]["peak_estimate_bytes"] < chips.CHIPS["v5e"].hbm_bytes
  assert (got["num_trainable_params"], got["num_frozen_params"]) == (ADAPTERS[name], BASE[name])
  assert got["frozen_params_bytes_per_device"] < 2.2 * 2**30  # bfloat16 base, FSDP
  assert got["opt_state_bytes_per_device"] <= 2 * got["trainable_params_bytes_per_device"] + 2**20
