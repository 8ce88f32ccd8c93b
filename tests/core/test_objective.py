"""The objective seam (spmdtask.core.objective): None is the model's own loss; the LoRA
reference is the policy with its adapters off; the pipelines refuse an objective with one
paragraph naming task.pipeline."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask.core import objective
from spmdtask.core.objective import Reference
from spmdtask.errors import ConfigError
from spmdtask.objectives import dpo
from tests import util


def test_adapters_off_zeroes_only_the_lora_b_leaves():
  params = {"attn": {"q": jnp.ones((2, 3)), "q_lora_a": jnp.ones((2, 1)),
                     "q_lora_b": jnp.ones((1, 3))}, "norm": jnp.ones(3)}
  off = objective.adapters_off(params)
  assert float(off["attn"]["q_lora_b"].sum()) == 0.0
  assert float(off["attn"]["q_lora_a"].sum()) == 2.0 and float(off["norm"].sum()) == 3.0
  # No gradient reaches the policy through its reference.
  g = jax.grad(lambda p: jnp.sum(objective.adapters_off(p)["attn"]["q"]))(params)
  assert float(g["attn"]["q"].sum()) == 0.0
  assert objective.step_reference(Reference.NONE, params, None) is None
  assert objective.step_reference(Reference.PRECOMPUTED, params, None) is None


def test_no_objective_is_the_model_loss_and_dpo_picks_its_reference():
  run = util.build_run("lm.TinyLm")
  assert run.task.objective is None and isinstance(objective.of(run.task), objective.ModelLoss)
  model = run.task.model
  assert dpo.Dpo().reference_kind(model) is Reference.PARAMS
  assert dpo.Dpo(reference="precomputed").reference_kind(model) is Reference.PRECOMPUTED
  lora = util.build_run("lm.TinyLmLora").task.model
  assert dpo.Dpo().reference_kind(lora) is Reference.ADAPTERS_OFF
  pairs = {"inputs": np.arange(12).reshape(2, 2, 3), "ref_logps": np.zeros((2, 2))}
  rows = dpo.Dpo().model_batch(pairs)  # chosen 0, rejected 0, chosen 1, rejected 1
  assert set(rows) == {"inputs"} and rows["inputs"].tolist() == [[0, 1, 2], [3, 4, 5],
                                                                  [6, 7, 8], [9, 10, 11]]


@pytest.mark.parametrize("exp", ["lm.TinyLmMpmd", "lm.TinyLmPipeline"])
def test_a_pipeline_refuses_an_objective_naming_task_pipeline(exp):
  run = util.build_run(exp)
  run.task.objective = dpo.Dpo()
  with pytest.raises(ConfigError) as e:
    run.task.validate()
  assert "task.pipeline" in str(e.value) and "\n" not in str(e.value)
  with pytest.raises(ConfigError) as e:  # the MPMD program builder refuses it by itself
    util.build_run("lm.TinyLmMpmd").task.pipeline.build_program(run.task, None, None)
  assert "task.pipeline" in str(e.value)
