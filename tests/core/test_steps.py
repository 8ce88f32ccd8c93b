"""Every parallel layout trains exactly like one device (fp32)."""
import jax
import numpy as np
import pytest

from tests import util

# Three updates after the first step's (TinyLm's warmup starts at learning rate 0): Adam's
# moments carry earlier steps' gradients into later updates, which is what a layout could
# get wrong; more steps repeat the same program.
STEPS = 4
ONE = 1  # device count of the reference run


@pytest.fixture(scope="session")
def reference():
  """TinyLm on 1 device: the model shared by TinyLm, TinyLmFsdpTp and TinyLmFsdp."""
  losses, params, _, _ = util.train_steps("lm.TinyLm", STEPS, devices=jax.devices()[:ONE])
  return losses, params


# (lm.TinyLmFsdp and lm.TinyLmFsdp2 too, measured once: suite time)
@pytest.mark.parametrize("exp", ["lm.TinyLm", "lm.TinyLmFsdpTp"])
def test_layout_matches_one_device(exp, reference):
  ref_losses, ref_params = reference
  losses, params, program, _ = util.train_steps_once(exp, STEPS, 8)  # (also test_program's)
  assert program.mesh.size == 8
  assert losses[-1] < losses[0] - 0.3  # it learns (6.02 to 5.56 over these 4 steps)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  util.assert_trees_close(params, ref_params, terms=util.TINY_LM_TOKENS)


def test_uneven_matches_one_device():
  ref_losses, ref_params, _, _ = util.train_steps(
      "lm.TinyLmUneven", STEPS, devices=jax.devices()[:ONE],
      overrides=["task.ici_mesh_shape=(1, 1, 1)"])
  losses, params, program, state = util.train_steps("lm.TinyLmUneven", STEPS)
  padding = program.layout.padding(dict(program.mesh.shape))
  # vocab 257, d_model 129 and d_ff 375 do not divide the 2-way axes: padded on device.
  assert padding["params/embedding"] == ((257, 129), (258, 130))
  assert state.params["embedding"].shape == (258, 130)
  assert params["embedding"].shape == (257, 129)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  util.assert_trees_close(params, ref_params, terms=util.TINY_LM_TOKENS)
  # Padding never reaches the math: the pad rows stay exactly zero, in params and moments.
  assert float(np.abs(np.asarray(state.params["embedding"])[257:]).max()) == 0.0
  mu = state.opt_state[1][0].mu["embedding"]
  assert mu.shape == (258, 130)
  assert float(np.abs(np.asarray(mu)[257:]).max()) == 0.0
