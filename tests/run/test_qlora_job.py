"""A QLoRA job (layers/qlora.py): warm-started from a float base it quantizes once (run/
lora_base.py), trains only its adapters over an nf4 base, the same on 1 and 8 devices."""
import jax
import numpy as np
import pytest

from spmdtask.core import train_state
from spmdtask.layers import qlora
from spmdtask.hf.jobs import checkpoints as hf_checkpoints
from spmdtask.run import loop
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
  out = {"base": float_params}
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

