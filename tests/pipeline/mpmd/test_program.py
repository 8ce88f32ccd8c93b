"""Tests for spmdtask.pipeline.mpmd.program (and MpmdConfig, the LayerStack's MPMD layer groups):
lm.TinyLmMpmdTied through the production loop on 8 devices (two submeshes of different
shapes, the tied embedding on both) trains under GPipe and 1F1B with the losses, params and
eval metrics of lm.TinyLm on one device, and checkpoints cross between MPMD and lm.TinyLm
both ways; the executor's peak residual sets are GPipe's M and 1F1B's S - s; the last
stage's vocab-tiled loss and grads equal optax's; bad configs raise ConfigError naming the
field."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from spmdtask.run import checkpoints, evaluation, loop
from spmdtask.plan import buffers
from spmdtask.core import program as program_lib
from spmdtask.errors import ConfigError
from tests import util

STEPS = 4  # losses 3 and 4 follow Adam updates (step 1's learning rate is 0: warmup from 0)
ONE_DEVICE = ("task.ici_mesh_shape=(1, 1, 1)",)
TIED = ("task.model.tie_embeddings=True",)


def evaluate(program, state):
  """The whole eval set: 100 sequences, so the last batch is partial (padded)."""
  eval_set = util.build_run("lm.TinyLm").datasets["eval"]
  return evaluation.evaluate(program, state, eval_set)


def _train(exp, steps, job_log_dir, overrides=(), save_every=100):
  """(losses, canonical params, program, state) of `exp` trained (or resumed) to `steps`
  in `job_log_dir`, saved every `save_every` steps and at the end; lm.TinyLm on one
  device."""
  run = util.build_run(exp, list(overrides) + [f"task.train.num_train_steps={steps}",
                                               f"task.train.save_interval_steps={save_every}"])
  devices = jax.devices()[:1] if exp == "lm.TinyLm" else None
  state, program, losses = loop.train(run, job_log_dir=job_log_dir, devices=devices)
  return np.asarray(losses), jax.device_get(program.to_canonical(state).params), program, state


@pytest.mark.slow
def test_tied_tinylm_mpmd_gpipe_and_1f1b_equal_one_device_and_checkpoints_cross(tmp_path):
  """lm.TinyLmMpmdTied (two submeshes of different shapes; the tied embedding on both
  stages) against lm.TinyLm with tied embeddings on one device: GPipe from scratch saves at
  step 2 and lm.TinyLm resumes it to step 4; lm.TinyLm saves at step 2 and 1F1B resumes it
  to step 4. Every loss, the params at steps 2 and 4 and the eval metrics are those of one
  device's uninterrupted run. (Untied, the same submeshes train as one device too:
  tests/pipeline/test_strategies.py; 3 stages: tests/pipeline/mpmd/test_multiprocess.py.)"""
  half, spmd = STEPS // 2, ONE_DEVICE + TIED
  one_dir, spmd_dir, mpmd_dir = (str(tmp_path / d) for d in ("one", "spmd", "mpmd"))
  # One device's uninterrupted run, saved at step 2 too: spmd_dir is that job as it was
  # at step 2, the lm.TinyLm job that saved at step 2 (one run serves as both).
  want_losses, want_params, program, state = _train("lm.TinyLm", STEPS, one_dir, spmd, half)
  want_eval = evaluate(program, state)
  spmd_params = jax.device_get(program.to_canonical(
      checkpoints.restore_state(one_dir, program, half)[0]).params)
  shutil.copytree(one_dir, spmd_dir)
  shutil.rmtree(tmp_path / "spmd" / "checkpoints" / str(STEPS))
  # GPipe saves at step 2 (its params: one device's); lm.TinyLm resumes it.
  losses, params, program, state = _train("lm.TinyLmMpmdTied", half, mpmd_dir,
                                          ["task.pipeline.schedule='gpipe'"])
  assert program.last_peak_residuals == (4, 4)  # GPipe: M
  assert program.pipeline.tied == {"['embedding']": (0, 1)}
  stage0, stage1 = (st.params["['embedding']"] for st in state.stages)
  np.testing.assert_array_equal(stage0, stage1)  # the two copies stay identical
  assert "unembed" not in params  # the checkpoint holds one embedding
  np.testing.assert_allclose(losses, want_losses[:half], rtol=1e-4)
  util.assert_trees_close(params, spmd_params, terms=util.TINY_LM_TOKENS)
  np.testing.assert_allclose(_train("lm.TinyLm", STEPS, mpmd_dir, spmd)[0],
                             want_losses[half:], rtol=1e-4)
  # lm.TinyLm (one device) saved at step 2; 1F1B resumes it (the embedding onto both stages).
  losses, params, program, state = _train("lm.TinyLmMpmdTied", STEPS, spmd_dir)
  scope = lambda k: k[:k.index("]", k.index("block")) + 1] if "block" in k else k
  where = [{scope(k) for k in keys} for keys in program.pipeline.stage_keys]
  assert where == [{"['embedding']", "['layers']['block_0']"},
                   {"['layers']['block_1']", "['final_norm']['scale']", "['embedding']"}]
  assert program.last_peak_residuals == (2, 1)  # 1F1B: S - s
  stage0, stage1 = (st.params["['embedding']"] for st in state.stages)
  np.testing.assert_array_equal(stage0, stage1)
  np.testing.assert_allclose(losses, want_losses[half:], rtol=1e-4)
  util.assert_trees_close(params, want_params, terms=util.TINY_LM_TOKENS)
  got_eval = evaluate(program, state)
  assert got_eval["weight"] == want_eval["weight"] == 100 * 64
  np.testing.assert_allclose(got_eval["loss"], want_eval["loss"], rtol=1e-5)


# (ZB-H1 and interleaved on the whole TinyLm program also equal one device, measured once;
# tests/pipeline/mpmd/test_pipeline.py checks them against 1F1B: suite time.)


@pytest.mark.parametrize("overrides, match", [
    (["task.pipeline.layer_cuts=(4,)"], r"task.pipeline.layer_cuts=\(4,\).*beyond the last"),
    (["task.pipeline.layer_cuts=(2, 1)"], r"task.pipeline.layer_cuts=\(2, 1\).*increasing"),
    (["task.pipeline.layer_cuts=(1, 2)"], r"3 parts.*2 stages"),
    (["task.pipeline.submesh_shapes=((2, 1, 2), (2, 1, 1))"],
     r"task.pipeline.submesh_shapes=.*6 devices.*the job has 8"),
    (["task.pipeline.submesh_shapes=((2, 1, 2), (4, 1, 2))"], r"12 devices.*the job has 8"),
    (["task.pipeline.submesh_shapes=((2, 2), (4, 1))"], r"submesh_shapes\[0\].*one positive"),
    (["task.pipeline.schedule='zigzag'"], r"task.pipeline.schedule='zigzag'.*Unknown"),
    (["task.pipeline.schedule='interleaved_1f1b'", "task.pipeline.num_chunks=2"],
     r"2 parts.*2 stages.*x 2 chunks"),
    (["task.pipeline.schedule='1f1b'", "task.pipeline.num_chunks=2",
      "task.pipeline.layer_cuts=(1, 2, 3)"], r"task.pipeline.schedule='1f1b'.*one chunk"),
    (["task.pipeline.num_microbatches=3"],
     r"batch_size=16 does not split into task.pipeline.num_microbatches=3 equal microbatches"),
    (["datasets['train'].batch_size=12"],
     r"^datasets\['train'\].batch_size=12 split into task.pipeline.num_microbatches=4 "
     r"microbatches gives 3 rows each, which do not divide over the data axes \('data', 'fsdp'\) "
     r"of task.pipeline.submesh_shapes\[0\]=\(2, 1, 2\) \(2 shards\). Make the batch size a "
     r"multiple of 16 \(e.g. --fdl_set=\"datasets\['train'\].batch_size=16\"\), or change "
     r"task.pipeline.num_microbatches or the data axes' sizes in task.pipeline.submesh_shapes\[0\] "
     r"or task.pipeline.submesh_shapes\[1\].$"),
    (["task.train.num_microbatches=2"], r"task.train.num_microbatches=2.*MPMD"),
])
def test_bad_configs_raise(overrides, match):
  run = util.build_run("lm.TinyLmMpmd", overrides)
  with pytest.raises(ConfigError, match=match):
    program_lib.setup(run.task, run.datasets["train"].batch_at(0))


@pytest.mark.slow
def test_last_stage_vocab_tiled_loss_and_grads_equal_optax():
  """lm.TinyLmMpmd's last stage (head and loss over 4 vocab tiles, on a data-4 submesh):
  the pipeline's loss and every stage's gradients equal optax's untiled cross entropy of
  the same model's whole float32 logits, on one device; and no program of that stage
  makes a whole float32 logits array [1 row x 64 tokens, 256] per device."""
  run = util.build_run("lm.TinyLmMpmd")
  example = run.datasets["train"].batch_at(0)
  program = program_lib.setup(run.task, example)
  assert program.model.loss_vocab_tiles == 4
  for lw in program.lowerings(example):
    if lw.stage == 1 and "part" in lw.name:
      made = buffers.hlo_arrays(lw.lower().compile().as_text(), top=None)
      assert [b.shape for b in made if b.dims[-2:] == (64, 64) and b.dtype == "f32"]  # a tile
      assert not [b for b in made if b.dims[-1:] == (256,) and b.dtype == "f32"
                  and np.prod(b.dims[:-1]) == 64], lw.name
  state = program.init()
  pl, stage_params = program.pipeline, [st.params for st in state.stages]
  batch = program.train_batch(state, program.global_batch(run.datasets["train"].batch_at(0)))
  M = pl.schedule.num_microbatches
  last_mesh = pl.stages[pl.part_stage[-1]].mesh
  ones = jax.device_put(np.ones((M,), np.float32),
                        jax.sharding.NamedSharding(last_mesh, jax.sharding.PartitionSpec()))
  got = pl.run(stage_params, batch, ones)  # the sum of every token's cross entropy
  params = jax.device_get(pl.gather(stage_params))
  host = {k: np.asarray(v) for k, v in run.datasets["train"].batch_at(0).items()}

  def optax_loss(params):
    logits = program.model.apply({"params": params}, host["inputs"])
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, host["targets"]))

  with jax.default_device(jax.devices()[0]):
    want, want_grads = jax.jit(jax.value_and_grad(optax_loss))(params)
  tokens = host["targets"].size  # compared as the mean over tokens, as training uses them
  np.testing.assert_allclose(float(got.loss) / tokens, float(want) / tokens, rtol=1e-6)
  flat = dict(zip(pl.paths, jax.tree.leaves(want_grads)))
  for s, grads in enumerate(got.grads):
    for k, g in grads.items():
      util.assert_close_f32(np.asarray(g) / tokens, np.asarray(flat[k]) / tokens, terms=tokens,
                            rtol=1e-6, err_msg=f"stage {s} {k}")
