"""configs/finetune.py: the fine-tunes' parameter counts (the published base + the adapters)
and their plans on the slices they are sized for (TPU ahead-of-time compile)."""
import fiddle as fdl
import jax
import numpy as np
import pytest

from spmdtask import registry
from spmdtask.layers.block import num_params

# The base's published count + LoRA rank 16 on q, k, v, o, wi, wg, wo: per layer
# r · (in + out) summed over the targets.
BASE = {"Llama31_8B_Sft": 8_030_261_248, "Llama31_8B_Lora": 8_030_261_248,
        "Llama31_70B_Lora": 70_553_706_496}
QLORA = {"Llama31_8B_QLora": "Llama31_8B_Lora", "Llama31_70B_QLora": "Llama31_70B_Lora"}
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


def test_mixtral_lora_counts_its_expert_adapters_and_their_active_share():
  """Mixtral_8x7B_Lora: rank 16 on q, k, v, o and every routed expert's wi, wg, wo ([8, in,
  16], [8, 16, out]); a token uses 2 of the 8 experts' adapters; the frozen base costs
  4·N·T, the adapters 6·N·T (layers.costs)."""
  model = fdl.build(registry.get("finetune.Mixtral_8x7B_Lora")().task().model)
  t = 8
  row = {"inputs": np.zeros((t,), np.int32), "targets": np.zeros((t,), np.int32),
         "weights": np.ones((t,), np.float32)}
  attention = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024))
  experts = 8 * 3 * 16 * (4096 + 14336)
  total, active = 46_702_792_704, 12_879_925_248  # Mixtral 8x7B's (tests/configs/test_moe.py)
  assert num_params(model, row) == total + 32 * (attention + experts)
  work = model.work_per_example({k: jax.ShapeDtypeStruct(v.shape, v.dtype)
                                 for k, v in row.items()})
  adapters = 32 * (attention + experts * 2 // 8)
  assert work.active_params == active + adapters
  width = model.num_heads * model.head_dim
  assert work.train_flops == (6 * adapters * t + 4 * active * t
                              + 6 * model.num_layers * width * t * (t + 1))


@pytest.mark.parametrize("name", sorted(QLORA))
def test_a_qlora_fine_tune_counts_the_work_of_its_float_model(name):
  """The nf4 codes are not the weights: a token's FLOPs and params are the LoRA model's."""
  row = {k: jax.ShapeDtypeStruct((8,), np.int32) for k in ("inputs", "targets")}
  row["weights"] = jax.ShapeDtypeStruct((8,), np.float32)
  work = [fdl.build(registry.get(f"finetune.{n}")().task().model).work_per_example(row)
          for n in (name, QLORA[name])]
  assert work[0] == work[1]


# The LoRA plans (Llama31_8B_Lora on v5e:2x4, Llama31_70B_Lora on v5e:8x8) were measured
# once (83 s each on 2 cores; figures on docs/fine_tuning.md): out of the suite for its time.
