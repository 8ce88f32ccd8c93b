"""A QLoRA job (layers/qlora.py): warm-started from a float base it quantizes once (run/
lora_base.py), trains only its adapters over an nf4 base, the same on 1 and 8 devices."""
import gc
import pathlib
import shutil
import weakref

import jax
import numpy as np
import pytest

from spmdtask import console
from spmdtask.core import program as program_lib, sharding, train_state
from spmdtask.layers import qlora
from spmdtask.hf.jobs import checkpoints as hf_checkpoints
from spmdtask.run import checkpoint_io, checkpoints, lora_base, loop, quantized_base
from tests import util

SMALL = ["task.model.num_layers=1"]  # (the jobs save at their end only: no test reads them)
NF4 = ["task.model.lora.base_quantization='nf4'", "task.model.lora.group_size=32"]
STEPS = 3  # the warmup's first step moves nothing (lr 0): 2 updates


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  """A float TinyLm base (1 layer, its init saved at step 0), and QLoRA jobs started from
  it on 1 and on 8 devices (data 2 x fsdp 2 x tensor 2)."""
  root = tmp_path_factory.mktemp("qlora")
  base = str(root / "base")
  prog = hf_checkpoints.program(SMALL, "lm.TinyLm")
  float_params = jax.device_get(prog.to_canonical(prog.init()).params)
  hf_checkpoints.write_checkpoint(base, SMALL, float_params, prog)
  lines = SMALL + NF4 + [f"task.train.init_checkpoint_dir={base!r}",
                         f"task.train.num_train_steps={STEPS}"]
  out = {"base": float_params, "base_dir": base, "root": root}
  for name, mesh, devices in (("one", "(1, 1, 1)", jax.devices()[:1]),
                              ("eight", "(2, 2, 2)", None)):
    run = util.build_run("lm.TinyLmLora", lines + [f"task.ici_mesh_shape={mesh}"])
    state, program, losses = loop.train(run, job_log_dir=str(root / name), devices=devices)
    out[name] = (np.asarray(losses), jax.device_get(program.to_canonical(state).params))
  return out


def _split(params):
  mask = train_state.trainable_mask(params, True)
  pick = lambda want: jax.tree.map(lambda x, m: x if m == want else None, params, mask)
  return pick(True), pick(False)


@pytest.mark.slow
def test_a_qlora_job_quantizes_its_float_base_once_and_trains_its_adapters(jobs):
  losses, params = jobs["one"]
  float_base = jobs["base"]
  attn = params["layers"]["block"]["attn"]
  want = qlora.quantize(float_base["layers"]["block"]["attn"]["q"], "nf4", 32, 1, np.float32)
  np.testing.assert_array_equal(attn["q_qvalue"], want[0])
  np.testing.assert_array_equal(attn["q_qscale"], want[1])
  np.testing.assert_array_equal(params["embedding"], float_base["embedding"])  # float
  assert np.abs(attn["q_lora_b"]).max() > 0 and np.isfinite(losses).all()


@pytest.mark.slow
def test_qlora_on_8_devices_equals_one_device(jobs):
  """The codes and scales are made per group from the same float weights on any layout:
  bitwise the same; the adapters' training then differs by float32 summation order only
  (as plain LoRA's), not by quantization noise."""
  (losses1, params1), (losses8, params8) = jobs["one"], jobs["eight"]
  np.testing.assert_allclose(losses8, losses1, rtol=1e-5)
  adapters1, base1 = _split(params1)
  adapters8, base8 = _split(params8)
  jax.tree.map(np.testing.assert_array_equal, base8, base1)
  util.assert_trees_close(adapters8, adapters1, terms=util.TINY_LM_TOKENS)


@pytest.fixture(scope="module")
def program(jobs):
  """The 8-device job's program (data 2 x fsdp 2 x tensor 2), for reads of its base."""
  run = util.build_run("lm.TinyLmLora", SMALL + NF4 + [
      f"task.train.init_checkpoint_dir={jobs['base_dir']!r}", "task.ici_mesh_shape=(2, 2, 2)"])
  return program_lib.setup(run.task, run.datasets["train"].batch_at(0))


def test_a_qlora_start_reads_its_float_base_one_weight_at_a_time(jobs, program, monkeypatch):
  """From a float checkpoint (data 2 x fsdp 2 x tensor 2) the start reads its embedding,
  norms and head at once, then each of the 7 weights it quantizes alone, the one before
  freed (its codes made) before the next is read: a base that does not fit the devices in
  float can start. The codes are those of the whole float weight."""
  reads, earlier, alive = [], [], []
  read_params = checkpoint_io.read_params

  def spy(directory, step, prog, targets, stored):
    gc.collect()
    alive.append(sum(ref() is not None for ref in earlier))
    got = read_params(directory, step, prog, targets, stored)
    names = sorted(sharding.path_str(p) for p, _ in
                   jax.tree_util.tree_flatten_with_path(got)[0])
    reads.append(names)
    if len(names) == 1:
      earlier.extend(weakref.ref(x) for x in jax.tree.leaves(got))
    return got
  monkeypatch.setattr(checkpoint_io, "read_params", spy)
  params = jax.device_get(lora_base.read(jobs["base_dir"], program)[1])
  weights = ["layers/block/attn/" + n for n in "kqov"] + ["layers/block/mlp/" + n
                                                          for n in ("wg", "wi", "wo")]
  assert "embedding" in reads[0] and not set(weights) & set(reads[0])
  assert sorted(r[0] for r in reads[1:]) == sorted(weights) and all(len(r) == 1 for r in reads[1:])
  assert alive == [0] * len(reads)
  float_base = jobs["base"]["layers"]["block"]
  for kind, name, axis in (("attn", "q", 1), ("mlp", "wo", 1)):
    want = qlora.quantize(float_base[kind][name], "nf4", 32, axis, np.float32)
    np.testing.assert_array_equal(params["layers"]["block"][kind][name + "_qvalue"], want[0])
    np.testing.assert_array_equal(params["layers"]["block"][kind][name + "_qscale"], want[1])


def test_a_qlora_job_saves_its_quantized_base_once_and_restores_without_the_float_base(
    jobs, program):
  """The job's first save writes its frozen params as it holds them (codes, scales, float
  embedding and norms) to quantized_base/; a restore reads them there: bitwise the job's,
  with the float base it started from moved away."""
  job = jobs["root"] / "eight"
  assert (job / quantized_base.DIR).is_dir()
  moved = jobs["root"] / "base_moved"
  (jobs["root"] / "base").rename(moved)
  try:
    state, step = checkpoints.restore_state(str(job), program)
  finally:
    moved.rename(jobs["root"] / "base")
  assert step == STEPS
  got = jax.device_get(program.to_canonical(state).params)
  jax.tree.map(np.testing.assert_array_equal, got, jobs["eight"][1])


def test_a_damaged_copy_of_the_quantized_base_is_left_and_the_base_read(jobs, program, tmp_path,
                                                                          monkeypatch):
  """Bytes flipped in the copy: a restore says so in one line and reads (and quantizes) the
  float base it was made from instead: the same params bitwise; the copy is left as it is."""
  job = tmp_path / "job"
  shutil.copytree(jobs["root"] / "eight", job)
  params_dir = job / quantized_base.DIR / str(quantized_base.STEP) / "params"
  util.flip_middle_of_largest(str(params_dir), lambda p: pathlib.Path(p).read_bytes(),
                              lambda p, b: pathlib.Path(p).write_bytes(b))
  damaged = {p: p.read_bytes() for p in params_dir.rglob("*") if p.is_file()}
  said = []
  monkeypatch.setattr(console, "say", lambda fmt, *args: said.append(fmt % args))
  state, _ = checkpoints.restore_state(str(job), program)
  assert len(said) == 1 and "cannot be read" in said[0], said
  assert said[0].endswith(f"This job's copy of its quantized base is left as it is; its base "
                          f"({jobs['base_dir']}) is read and quantized instead."), said
  jax.tree.map(np.testing.assert_array_equal,
               jax.device_get(program.to_canonical(state).params), jobs["eight"][1])
  assert {p: p.read_bytes() for p in params_dir.rglob("*") if p.is_file()} == damaged
