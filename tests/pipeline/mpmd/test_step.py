"""Tests for spmdtask.pipeline.mpmd.step: a few steps of adamw with global-norm clipping
through the MPMD executor on two submeshes (2x2 and 4x1) equal the same model trained with
plain jax.grad and optax.chain(clip_by_global_norm, adamw) on one device; GPipe and 1F1B
give equal results; the tied copies stay identical."""

import jax
import numpy as np
import optax

from spmdtask.pipeline.mpmd import step as mpmd_step
from tests import util
from tests.pipeline.mpmd.test_pipeline import (B, M, TWO, gpipe, one_f_one_b, toy_batch, toy_loss,
                                               toy_params, toy_pipeline)

STEPS, LR, WD, CLIP = 4, 3e-2, 0.1, 0.5


def reference_training(params):
  """Plain one-device training: jax.grad of the unsplit loss, clipping inside optax."""
  tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, weight_decay=WD))
  loss_fn = toy_loss(())

  @jax.jit
  def step(params, opt_state, batch):
    (loss, grads) = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

  with jax.default_device(jax.devices()[0]):
    opt_state = tx.init(params)
    losses, norms = [], []
    for i in range(STEPS):
      params, opt_state, loss, norm = step(params, opt_state, toy_batch(i))
      losses.append(float(loss))
      norms.append(float(norm))
  return np.asarray(losses), np.asarray(norms), params


def mpmd_training(params, schedule):
  pl = toy_pipeline((0,), TWO, schedule)
  step = mpmd_step.TrainStep(pl, optax.adamw(LR, weight_decay=WD), max_grad_norm=CLIP)
  states = step.init(params)
  losses, norms, peaks = [], [], set()
  for i in range(STEPS):
    states, metrics = step(states, toy_batch(i))
    losses.append(float(metrics["loss"]))
    norms.append(float(metrics["grad_norm"]))
    peaks.add(metrics["peak_residuals"])
  np.testing.assert_array_equal(states[0].params["['w_in']"], states[1].params["['w_in']"])
  return np.asarray(losses), np.asarray(norms), pl.gather([s.params for s in states]), peaks


def test_training_equals_one_device_for_gpipe_and_1f1b():
  params = toy_params()
  want_losses, want_norms, want_params = reference_training(params)
  assert (want_norms > CLIP).all()  # every step clips, so the global norm matters
  got = {}
  for name, schedule, peak in (("gpipe", gpipe(2, M), (M, M)),
                               ("1f1b", one_f_one_b(2, M), (2, 1))):
    losses, norms, final, peaks = mpmd_training(params, schedule)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
    util.assert_trees_close(final, want_params, terms=B)
    assert peaks == {peak}
    got[name] = (losses, final)
  np.testing.assert_allclose(got["gpipe"][0], got["1f1b"][0], rtol=1e-6)
  util.assert_trees_close(got["gpipe"][1], got["1f1b"][1], terms=B, rtol=1e-6)
