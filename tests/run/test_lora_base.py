"""run/lora_base.py: a LoRA job warm-starts its frozen params from a base checkpoint (in
another dtype too) with fresh adapters; its checkpoints name the base and resume; a base
that is not the model's is a ConfigError naming task.train.init_checkpoint_dir."""
import jax
import numpy as np
import pytest

from spmdtask.core import train_state
from spmdtask.errors import ConfigError
from spmdtask.run import checkpoints, loop, lora_base
from tests import util

SMALL = ["task.model.num_layers=2", "task.ici_mesh_shape=(2, 2, 2)"]


@pytest.fixture(scope="module")
def base_job(tmp_path_factory):
  """TinyLm (2 layers) trained 3 steps, its checkpoint at step 3."""
  job = str(tmp_path_factory.mktemp("base"))
  run = util.build_run("lm.TinyLm", SMALL + ["task.train.num_train_steps=3"])
  loop.train(run, job_log_dir=job)
  return job


def test_lora_job_starts_from_its_base_names_it_and_resumes(base_job, tmp_path):
  job = str(tmp_path / "lora")
  over = SMALL + [f"task.train.init_checkpoint_dir={base_job!r}",
                  "task.model.lora.base_dtype='bfloat16'", "task.train.num_train_steps=2"]
  state, program, _ = loop.train(util.build_run("lm.TinyLmLora", over), job_log_dir=job)
  params = jax.device_get(program.to_canonical(state).params)
  base, _ = checkpoints.restore_state(base_job, _base_program(base_job))
  base = jax.device_get(base.params)
  # Every frozen param is the base's (cast to bfloat16), after 2 LoRA steps.
  frozen = lora_base.without_adapters(params)
  jax.tree.map(lambda got, want: np.testing.assert_array_equal(
      got, want.astype(got.dtype)), frozen, base)
  assert {x.dtype.name for x in jax.tree.leaves(frozen)} == {"bfloat16", "float32"}  # norms
  meta = checkpoints.read_meta(job)
  assert meta[lora_base.META_KEY] == {"dir": base_job, "step": 3,
                                      "shapes_fingerprint": lora_base.fingerprint(params)}
  # Resumed to step 4: the base stays, the record is kept.
  over[-1] = "task.train.num_train_steps=4"
  state, program, losses = loop.train(util.build_run("lm.TinyLmLora", over), job_log_dir=job)
  assert len(losses) == 2
  again = jax.device_get(program.to_canonical(state).params)
  jax.tree.map(np.testing.assert_array_equal, lora_base.without_adapters(again), frozen)
  assert checkpoints.read_meta(job)[lora_base.META_KEY]["step"] == 3
  mask = train_state.trainable_mask(again, True)
  assert sum(m for m in jax.tree.leaves(mask)) == 2 * 7 * 1  # 7 targets x (A, B), stacked


def _base_program(job):
  from spmdtask.core import program as program_lib  # pylint: disable=g-import-not-at-top
  run = util.build_run("lm.TinyLm", SMALL)
  return program_lib.setup(run.task, run.datasets["train"].batch_at(0))


def test_a_base_of_another_model_is_a_config_error(base_job):
  from spmdtask.core import program as program_lib  # pylint: disable=g-import-not-at-top
  run = util.build_run("lm.TinyLmLora", SMALL + ["task.model.d_ff=256"])
  program = program_lib.setup(run.task, run.datasets["train"].batch_at(0))
  want = (r"task.train.init_checkpoint_dir=.* is not the base of this LoRA model.*"
          r"layers/block/mlp/wi: checkpoint \(2, 128, 512\), model \(2, 128, 256\)")
  with pytest.raises(ConfigError, match=want):
    checkpoints.warm_start(base_job, program, program.init())
