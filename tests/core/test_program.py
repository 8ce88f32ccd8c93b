"""The partitioner's program: canonical checkpoints across pipeline strategies, gradient
accumulation; each against an uninterrupted or unaccumulated run."""
import shutil

import jax
import numpy as np
import pytest

from spmdtask.core import program as program_lib
from spmdtask.run import checkpoints, loop
from spmdtask.errors import ConfigError
from tests import util

ONE_DEVICE = ["task.ici_mesh_shape=(1, 1, 1)"]


# Saved after 2 steps (TinyLm's warmup starts at learning rate 0: one update), so the
# checkpoint holds moved params and Adam's moments of two gradients; resumed for 2 more.
SAVE, END = 2, 4


def _train(exp, job_log_dir, num_steps, overrides=()):
  run = util.build_run(exp, [f"task.train.num_train_steps={num_steps}",
                             f"task.train.save_interval_steps={SAVE}", *overrides])
  return loop.train(run, job_log_dir=str(job_log_dir))


@pytest.mark.slow
def test_a_pipelined_checkpoint_resumes_scanned_and_circular_and_warm_starts(tmp_path):
  """TinyLmPipeline's step-2 checkpoint resumed for steps 3-4 as TinyLm and as
  TinyLmCircular gives the uninterrupted run's losses; a TinyLm warm start from the job
  takes its canonical params. (One test: the pipelined job is trained once.)"""
  job = tmp_path / "pipelined"
  # END uninterrupted steps, saved at SAVE and END.
  _, program, uninterrupted = _train("lm.TinyLmPipeline", job, END)
  meta = checkpoints.read_meta(str(job), SAVE)
  assert meta["pipeline"]["num_stages"] == 2 and meta["canonical"].startswith("logical")
  assert meta["pipeline"]["strategy"] == "spmd_pipeline"
  assert (meta["pipeline_microbatches"], meta["grad_accumulation_microbatches"]) == (4, 1)
  for exp in ("lm.TinyLm", "lm.TinyLmCircular"):
    shutil.copytree(job, tmp_path / exp)
    shutil.rmtree(tmp_path / exp / "checkpoints" / str(END))  # the job as it was at SAVE
    _, _, resumed = _train(exp, tmp_path / exp, END)
    np.testing.assert_allclose(resumed, uninterrupted[SAVE:], rtol=1e-4, err_msg=exp)
  # A warm start from the pipelined job takes its canonical params.
  ckpt = checkpoints.restore_state(str(job), program)[0]
  want = jax.device_get(program.to_canonical(ckpt).params)
  state, scanned, _ = _train("lm.TinyLm", tmp_path / "warm", 0,
                             [f"task.train.init_checkpoint_dir='{job}'"])
  assert int(state.step) == 0
  util.assert_trees_equal(jax.device_get(scanned.to_canonical(state).params), want)


# (lm.TinyLm on 1 device too, measured once; configs/test_lm covers every path's divisor)
@pytest.mark.parametrize("exp,devices", [("lm.TinyLmFsdpTp", 8)])
def test_gradient_accumulation_equals_the_whole_batch(exp, devices):
  extra = ONE_DEVICE if devices == 1 else []
  # The whole batch's run is test_steps' (test_layout_matches_one_device): once per process.
  whole = util.train_steps_once(exp, END, devices, tuple(extra))
  accumulated = util.train_steps(exp, END, jax.devices()[:devices],
                                 extra + ["task.train.num_microbatches=4"])
  np.testing.assert_allclose(accumulated[0], whole[0], rtol=1e-5)
  util.assert_trees_close(accumulated[1], whole[1], terms=util.TINY_LM_TOKENS)


def test_gradient_accumulation_that_does_not_divide_is_a_config_error():
  with pytest.raises(ConfigError, match="task.train.num_microbatches=3"):
    util.train_steps("lm.TinyLm", 1, overrides=["task.train.num_microbatches=3"])
  with pytest.raises(ConfigError, match=r"task.train.num_microbatches=8 .*\(8 shards\)"):
    util.train_steps("lm.TinyLm", 1, overrides=["task.train.num_microbatches=8"])


@pytest.mark.parametrize("exp", ["lm.TinyLmFsdpTp", "lm.TinyLmMpmd"])
def test_a_fresh_state_from_the_init_weights_is_the_init(exp):
  """program.fresh_state (an import's state: given weights, a fresh optimizer state, no
  random init) of init()'s own weights is init()'s state, bitwise, on both kinds of program."""
  program, state = util.program_and_state(exp, 8)
  canonical = program.to_canonical(state)
  fresh = program.to_canonical(program_lib.fresh_state(program, canonical.params))
  util.assert_trees_equal(jax.device_get(fresh), jax.device_get(canonical))
  targets = program.canonical_targets()
  assert jax.tree.map(lambda x: x.sharding, fresh) == jax.tree.map(lambda t: t.sharding, targets)
