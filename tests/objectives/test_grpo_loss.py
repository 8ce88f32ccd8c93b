"""GRPO's loss against TRL 1.16's on fixed log-probs and rewards (fixture: data/grpo_trl.json,
made by data/make_grpo_fixture.py)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmdtask.objectives import grpo_loss

FIXTURE = json.load(open(os.path.join(os.path.dirname(__file__), "data", "grpo_trl.json")))


def _loss(case, logp):
  f = FIXTURE
  adv = grpo_loss.advantages(jnp.array(f["rewards"]), f["group_size"], case["scale_rewards"])
  old = jnp.array(f["old_logp"]) if case["with_old"] else None
  terms = grpo_loss.token_terms(logp, old, jnp.array(f["ref_logp"]), adv, case["beta"],
                                case["epsilon_low"], case["epsilon_high"])
  mask = jnp.array(f["mask"])
  w = grpo_loss.reduce(terms.loss, mask, case["loss_type"], f["max_completion_length"])
  return w.sum / w.weight, (adv, terms, mask)


@pytest.mark.parametrize("case", FIXTURE["cases"],
                         ids=lambda c: f"{c['loss_type']}-{c['scale_rewards']}-b{c['beta']}")
def test_loss_equals_trl(case):
  logp = jnp.array(FIXTURE["logp"])
  (loss, (adv, terms, mask)), grad = jax.value_and_grad(_loss, argnums=1, has_aux=True)(
      case, logp)
  np.testing.assert_allclose(adv, case["advantages"], atol=1e-5)
  assert abs(float(loss) - case["loss"]) <= 1e-5
  np.testing.assert_allclose(grad, case["grad"], atol=1e-5)
  kl = grpo_loss.masked_mean(terms.kl, mask)
  clip = grpo_loss.masked_mean(terms.clipped, mask)
  assert abs(float(kl.sum / kl.weight) - case["kl"]) <= 1e-5
  assert abs(float(clip.sum / clip.weight) - case["clip_ratio"]) <= 1e-6


def test_microbatches_sum_to_the_batch():
  """Summing (sum, weight) over two halves gives the whole batch's loss, each loss_type."""
  f = FIXTURE
  logp, mask = jnp.array(f["logp"]), jnp.array(f["mask"])
  adv = grpo_loss.advantages(jnp.array(f["rewards"]), f["group_size"])
  terms = grpo_loss.token_terms(logp, jnp.array(f["old_logp"]), jnp.array(f["ref_logp"]), adv,
                                0.04, 0.2, 0.2)
  for lt in grpo_loss.LOSS_TYPES:
    whole = grpo_loss.reduce(terms.loss, mask, lt, 6)
    parts = [grpo_loss.reduce(terms.loss[s], mask[s], lt, 6) for s in (slice(0, 3), slice(3, 8))]
    np.testing.assert_allclose(sum(p.sum for p in parts) / sum(p.weight for p in parts),
                               whole.sum / whole.weight, rtol=1e-6)
