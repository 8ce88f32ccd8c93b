"""run/lora_base.py: a LoRA job warm-starts its frozen params from a base checkpoint (in
another dtype too) with fresh adapters; its checkpoints hold only the adapters and their
optimizer state and name the base, from which every restore (resume, another mesh) reads
the frozen params; a base that is gone, changed or not the model's is a ConfigError naming
task.train.init_checkpoint_dir (exit 2)."""
import functools
import os
import shutil
import types

import jax
import numpy as np
import pytest

from spmdtask.core import program as program_lib
from spmdtask.core import train_state
from spmdtask.errors import ConfigError
from spmdtask.run import checkpoint_check, checkpoint_io, checkpoints, loop, lora_base
from tests import subproc as h
from tests import util

SMALL = ["task.model.num_layers=2", "task.ici_mesh_shape=(2, 2, 2)",
         "task.train.save_interval_steps=1"]


@pytest.fixture(scope="module")
def base_job(tmp_path_factory):
  """TinyLm (2 layers) trained 3 steps, its checkpoints at steps 1, 2, 3 (`dir`), and its
  program (the tests that read it as a plain TinyLm use it: no second build and compile)."""
  job = str(tmp_path_factory.mktemp("base"))
  run = util.build_run("lm.TinyLm", SMALL + ["task.train.num_train_steps=3"])
  program = loop.train(run, job_log_dir=job)[1]
  return types.SimpleNamespace(dir=job, program=program)


def _lora_overrides(base: str, steps: int) -> list[str]:
  return SMALL + [f"task.train.init_checkpoint_dir={base!r}",
                  "task.model.lora.base_dtype='bfloat16'", f"task.train.num_train_steps={steps}"]


@pytest.fixture(scope="module")
def lora(base_job, tmp_path_factory):
  """A LoRA job warm-started from a copy of base_job (tests may damage the copy), 4 steps
  uninterrupted (`straight`); and `job`: its checkpoint of step 2, resumed to 4; `program`:
  the straight run's (the job's config: tests that restore the job as itself use it)."""
  root = tmp_path_factory.mktemp("lora")
  base, job, straight = (str(root / n) for n in ("base", "job", "straight"))
  shutil.copytree(base_job.dir, base)
  run = lambda: util.build_run("lm.TinyLmLora", _lora_overrides(base, 4))  # pylint: disable=unnecessary-lambda-assignment
  ref, program, ref_losses = loop.train(run(), job_log_dir=straight)
  # A job stopped after step 2 (its checkpoint names the base, not its job).
  shutil.copytree(os.path.join(straight, "checkpoints", "2"), os.path.join(job, "checkpoints", "2"))
  state, _, resumed = loop.train(run(), job_log_dir=job)
  canonical = lambda s: jax.device_get(program.to_canonical(s))  # pylint: disable=unnecessary-lambda-assignment
  return types.SimpleNamespace(base=base, job=job, meta_at_2=checkpoints.read_meta(job, 2),
                               program=program, resumed=resumed, ref_losses=ref_losses, state=canonical(state),
                               ref=canonical(ref))


def _du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_lora_job_starts_from_its_base_saves_only_adapters_and_resumes_bitwise(base_job, lora):
  params = lora.state.params
  base, _ = checkpoints.restore_state(base_job.dir, base_job.program)
  base = jax.device_get(base.params)
  # Every frozen param is the base's (cast to bfloat16), after 4 LoRA steps.
  frozen = lora_base.without_adapters(params)
  jax.tree.map(lambda got, want: np.testing.assert_array_equal(
      got, want.astype(got.dtype)), frozen, base)
  assert {x.dtype.name for x in jax.tree.leaves(frozen)} == {"bfloat16", "float32"}  # norms
  # Resumed at step 2 (adapters + opt state from the job, the base from its base): the same
  # losses and bitwise the same state as 4 uninterrupted steps.
  assert lora.resumed == lora.ref_losses[2:] and len(lora.ref_losses) == 4
  util.assert_trees_equal(lora.state, lora.ref)
  # The checkpoints hold only the adapters (7 targets x A, B, layers stacked) and name the base.
  for meta in (lora.meta_at_2, checkpoints.read_meta(lora.job)):
    assert meta[lora_base.META_KEY] == {
        "dir": lora.base, "step": 3, "shapes_fingerprint": lora_base.fingerprint(params),
        "values_fingerprint": meta[lora_base.META_KEY]["values_fingerprint"]}
    assert meta[checkpoint_io.HELD_KEY] == checkpoint_io.ADAPTERS
  mngr = checkpoint_io.manager(checkpoints.checkpoint_dir(lora.job), read_only=True)
  try:
    stored = {k: v.shape for k, v in lora_base._flat(mngr.item_metadata(4)["params"]).items()}  # pylint: disable=protected-access
  finally:
    mngr.close()
  assert sorted(stored) == sorted(k for k in lora_base._flat(params)  # pylint: disable=protected-access
                                  if train_state.is_adapter_name(k))
  assert len(stored) == 14 and stored["layers/block/attn/q_lora_a"] == (2, 128, 4)
  # On disk, the job's params item is the adapters (4% of the params' bytes here), not the
  # base: orbax adds its own files to each item (~100 KB, varying with its write buffers),
  # so the item is bounded by the adapters' bytes plus that, a quarter of the base's item.
  adapter_bytes = sum(4 * np.prod(s) for s in stored.values())
  assert adapter_bytes < 0.05 * sum(x.nbytes for x in jax.tree.leaves(base))
  job_bytes = _du(os.path.join(lora.job, "checkpoints", "4", "params"))
  base_bytes = _du(os.path.join(lora.base, "checkpoints", "3", "params"))
  print(f"params bytes: LoRA job step 4 {job_bytes}, base step 3 {base_bytes}")
  assert job_bytes * 4 < base_bytes
  # checkpoint_check's cut-short detection reads adapter-only checkpoints too.
  ck = os.path.join(lora.job, "checkpoints", "4")
  assert checkpoint_check.problem(ck) is None


@functools.cache  # the tests share programs (one setup and compile each): a program is immutable
def _program(exp, *overrides, devices=None):
  run = util.build_run(exp, SMALL + list(overrides))
  return program_lib.setup(run.task, run.datasets["train"].batch_at(0),
                           None if devices is None else list(devices))


def test_restore_onto_one_device_equals_eight(lora):
  one = _program("lm.TinyLmLora", "task.model.lora.base_dtype='bfloat16'",
                 "task.ici_mesh_shape=(1, 1, 1)", devices=tuple(jax.devices()[:1]))
  state, step = checkpoints.restore_state(lora.job, one)
  assert step == 4
  util.assert_trees_equal(jax.device_get(one.to_canonical(state)), lora.state)


def test_a_base_of_another_model_is_a_config_error(base_job):
  program = _program("lm.TinyLmLora", "task.model.d_ff=256")
  want = (r"task.train.init_checkpoint_dir=.* is not the base of this LoRA model.*"
          r"layers/block/mlp/wi: checkpoint \(2, 128, 512\), model \(2, 128, 256\)")
  with pytest.raises(ConfigError, match=want):
    checkpoints.warm_start(base_job.dir, program)


def test_a_missing_or_changed_base_is_a_config_error_exit_2(base_job, lora, tmp_path):
  program = lora.program  # the job's
  step3 = os.path.join(lora.base, "checkpoints", "3")
  field = f"task.train.init_checkpoint_dir={lora.base!r}, step 3"
  shutil.move(step3, tmp_path / "3")
  try:
    with pytest.raises(ConfigError, match=f"{field}.*no complete checkpoint at step 3"):
      checkpoints.restore_state(lora.job, program)
    r = h.run(h.main_cmd("lm.TinyLmLora", lora.job, *_lora_overrides(lora.base, 5)))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and field in r.stderr, r.stderr[-3000:]
    # Another checkpoint of the same shapes in its place: other values.
    shutil.copytree(os.path.join(lora.base, "checkpoints", "2"), step3)
    with pytest.raises(ConfigError, match=f"{field}.*holds other values"):
      checkpoints.restore_state(lora.job, program)
  finally:
    shutil.rmtree(step3, ignore_errors=True)
    shutil.move(tmp_path / "3", step3)
  # The model config changed: its frozen shapes are not the base's.
  with pytest.raises(ConfigError, match="job's checkpoints hold only the adapters|does not match"):
    checkpoints.restore_state(lora.job, _program("lm.TinyLmLora", "task.model.d_ff=256"))
  assert checkpoints.restore_state(lora.job, program)[1] == 4
  # A LoRA job's adapter-only checkpoint starts a plain model as its base with the adapters
  # merged in: W + (alpha / r)·A·B (layers.lora), read from the base the checkpoint names.
  plain = base_job.program  # a plain TinyLm
  got = jax.device_get(plain.to_canonical(checkpoints.warm_start(lora.job, plain)).params)
  base = jax.device_get(plain.to_canonical(checkpoints.restore_state(lora.base, plain)[0]).params)
  scale = lora.meta_at_2[lora_base.SCALE_KEY]
  assert scale == 2.0  # TinyLmLora: rank 4, alpha 8
  adapters = train_state.adapters(lora.state.params)
  want = train_state.merged_adapters(lora_base._overlay(base, adapters), scale)  # pylint: disable=protected-access
  util.assert_trees_close(got, jax.device_get(want), atol=1e-6)
  wq = got["layers"]["block"]["attn"]["q"]
  assert np.abs(wq - base["layers"]["block"]["attn"]["q"]).max() > 1e-3  # the adapters moved it


def test_a_resume_with_another_rank_names_both_ranks(lora):
  with pytest.raises(ConfigError, match=r"^task.model.lora.rank=8, the checkpoint's 4 \(at .*"
                     r"Resume with task.model.lora.rank=4 \(--lora_rank=4\)"):
    checkpoints.restore_state(lora.job, _program("lm.TinyLmLora", "task.model.lora.rank=8"))


def test_continue_trains_the_starts_own_adapters_on_its_base(lora):
  program = lora.program  # the job's
  state, base = checkpoints._warm_start(lora.job, program, "continue")  # pylint: disable=protected-access
  got = jax.device_get(program.to_canonical(state).params)
  util.assert_trees_equal(train_state.adapters(got), train_state.adapters(lora.state.params))
  util.assert_trees_equal(lora_base.without_adapters(got),
                          lora_base.without_adapters(lora.state.params))  # the base, unmerged
  assert base.dir == lora.base  # its saves name the start's own base
  with pytest.raises(ConfigError, match=r"init_adapters='continue', but .* holds rank 4 on "
                     r"other weights or of another rank"):
    other = _program("lm.TinyLmLora", "task.model.lora.rank=8")
    checkpoints.warm_start(lora.job, other, "continue")
